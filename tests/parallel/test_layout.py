"""plan_layout: which axis is EP, which FSDP, which shard tokens; a reason for the rest."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from moe_lowering.parallel import UnsupportedLayout, plan_layout


def mesh(shape, names, axis_type=AxisType.Explicit):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape), devices=jax.devices("cpu")[:8])


W_FSDP = [P("expert", "fsdp", None), P("expert", "fsdp", None), P("expert", None, "fsdp")]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_expert_fsdp_and_token_axes(axis_type):
    layout = plan_layout(mesh((2, 2, 2), ("data", "expert", "fsdp"), axis_type), P("data"), W_FSDP, 8)
    assert (layout.expert_axis, layout.fsdp_axis, layout.token_axes) == ("expert", "fsdp", ("data",))
    assert layout.expert_parallel_size == 2 and layout.local_experts == 4 and layout.fsdp_size == 2
    assert [layout.fsdp_dim(i) for i in range(3)] == [1, 1, 2]
    assert layout.compute_axes == ("data", "expert", "fsdp")
    assert layout.tokens_spec == P("data", None)
    text = layout.describe()
    assert "'expert'" in text and "'fsdp'" in text and "all-to-all" in text and "all-gather" in text


def test_devices_of_concrete_and_abstract_meshes(monkeypatch):
    """An abstract mesh (Explicit axes traced inside ``jit``) names no devices: in a one-process
    job this process's devices of its platform stand in (so "auto" can still pick GPU-to-GPU
    stores), in a multi-process job none are known."""
    concrete = mesh((8,), ("expert",))
    assert plan_layout(concrete, P("expert"), [P("expert")], 16).devices == tuple(jax.devices("cpu")[:8])
    abstract = plan_layout(concrete.abstract_mesh, P("expert"), [P("expert")], 16)
    assert abstract.devices == tuple(jax.local_devices(backend="cpu"))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert abstract.devices == ()


def test_pure_expert_parallel_and_replicated_bias():
    layout = plan_layout(mesh((8,), ("expert",)), P("expert"), [P("expert"), None], 16)
    assert (layout.expert_axis, layout.fsdp_axis, layout.local_experts) == ("expert", None, 2)
    assert layout.expert_param_specs[1] == P("expert")  # a replicated [E, F] bias is sliced like the weights


def test_fsdp_without_expert_axis():
    layout = plan_layout(mesh((2, 4), ("data", "fsdp")), P(("data", "fsdp")), [P(None, "fsdp")], 8)
    assert layout.expert_axis is None and layout.fsdp_axis == "fsdp" and layout.expert_parallel_size == 1


def test_nothing_sharded_means_single_device_path():
    assert plan_layout(mesh((8,), ("expert",)), P(), [None, None, None], 8) is None
    assert plan_layout(mesh((1,), ("x",)), P("x"), [P("x")], 8) is None


@pytest.mark.parametrize(
    "tokens_spec, weight_specs, message",
    [
        (P(None, "fsdp"), [P("expert")], "along d_model"),
        (P("expert"), [P("expert"), P("fsdp")], "different axes"),
        (P("expert"), [P("expert", ("fsdp", "data"))], "several mesh axes"),
        (P("expert"), [P("expert", "fsdp", None), P("expert", None, "data")], "several axes"),
        (P("expert"), [P("expert", "expert")], "both E and a feature"),
        (P("expert"), [P(("expert", "fsdp"), "fsdp")], "both E and a feature"),
        (P("nope"), [P("expert")], "lacks"),
        (P("expert"), [P("nope")], "lacks"),
    ],
)
def test_unsupported_layouts_decline_with_a_reason(tokens_spec, weight_specs, message):
    """Shardings the program runs under but the lowering cannot serve: a falsy layout whose reason
    ``explain`` gives (the single-device sparse layer runs), never an exception."""
    layout = plan_layout(mesh((2, 2, 2), ("data", "expert", "fsdp")), tokens_spec, weight_specs, 8)
    assert isinstance(layout, UnsupportedLayout) and not layout
    assert message in layout.reason and "single-device sparse layer" in layout.describe()


def test_uneven_experts_are_padded_with_phantoms():
    """E = 6 over 4 ranks (GSPMD pads it): 8 experts, 2 a rank, the last two never routed to."""
    layout = plan_layout(mesh((2, 4), ("data", "expert")), P(), [P("expert")] * 3, 6)
    assert (layout.num_experts, layout.padded_experts, layout.local_experts) == (6, 8, 2)
    assert "6 padded with 2 that no token routes to" in layout.describe()
    assert plan_layout(mesh((2, 4), ("data", "expert")), P(), [P("expert")], 8).padded_experts == 8


def test_experts_over_two_axes_are_one_product_axis():
    layout = plan_layout(mesh((2, 2, 2), ("data", "expert", "fsdp")), P(), [P(("data", "expert"), "fsdp")] * 2, 8)
    assert layout.expert_axis == ("data", "expert") and layout.expert_parallel_size == 4
    assert layout.local_experts == 2 and layout.fsdp_axis == "fsdp"
    assert layout.expert_param_specs[0] == P(("data", "expert"), "fsdp")


def test_feature_dims_fsdp_does_not_divide_decline():
    """GSPMD pads a feature dim of 6 over 4 FSDP shards; the gather inside the lowering does not."""
    specs = [P("expert", "fsdp", None)]
    fsdp4 = mesh((2, 4), ("expert", "fsdp"))
    declined = plan_layout(fsdp4, P(), specs, 8, weight_shapes=[(8, 6, 16)])
    assert not declined and "dimension 1 of expert parameter 0 (size 6) does not split over the 4" in declined.reason
    assert plan_layout(fsdp4, P(), specs, 8, weight_shapes=[(8, 8, 16)]).fsdp_axis == "fsdp"
