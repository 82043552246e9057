"""The decorator end to end on a sharded program: the layout is read off the caller's shardings."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from moe_lowering import explain, moe_optimize
from moe_lowering.kernels import peer_store
from moe_lowering.parallel import exchange
from moe_lowering.testing.zoo import ZOO

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 8, reason="needs 8 host devices (tests/conftest.py)")


def _setup():
    model = ZOO["mixtral"].sized(E=8, T=64)
    params, x = model.args(jax.random.key(0))
    mesh = jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices("cpu")[:8])
    weight = NamedSharding(mesh, P("expert", "fsdp", None))
    shardings = ({k: weight if v.ndim == 3 else NamedSharding(mesh, P()) for k, v in params.items()},
                 NamedSharding(mesh, P(("fsdp", "expert"), None)))
    placed = jax.device_put((params, x), shardings)
    return model, params, x, shardings, placed


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))


def test_jit_in_shardings_give_expert_parallel_lowering():
    model, params, x, shardings, placed = _setup()
    sharded = moe_optimize(jax.jit(model.fn, in_shardings=shardings), strict=True)
    assert _rel(model.fn(params, x), sharded(*placed)) < 1e-5
    grads_ref = jax.jit(jax.grad(lambda p: jnp.sum(model.fn(p, x) ** 2)))(params)
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(sharded(p, x) ** 2)))(*placed)
    for name in params:
        assert _rel(grads_ref[name], grads[name]) < 1e-5, name
    hlo = sharded.lower(*placed).compile().as_text()
    assert "all-to-all" in hlo


def test_explain_names_the_axes_and_collectives():
    model, _, _, shardings, placed = _setup()
    report = explain(jax.jit(model.fn, in_shardings=shardings), *placed)
    layout = report.regions[0].parallel_layout
    assert layout.startswith("expert parallel over 'expert' (4 ranks x 2 experts): all-to-all of token rows")
    assert "FSDP over 'fsdp' (2 shards" in layout and "all-gather of weights" in layout
    assert "sharded: expert parallel" in str(report)


def test_committed_arguments_and_fp8_weight_gather():
    model, params, x, shardings, placed = _setup()
    exact = model.fn(params, x)
    assert _rel(exact, moe_optimize(model.fn)(*placed)) < 1e-5  # eager call: the arrays' own shardings
    fp8 = moe_optimize(jax.jit(model.fn, in_shardings=shardings), weight_gather_quant="fp8_e4m3")
    assert _rel(exact, fp8(*placed)) < 5e-2
    hlo = fp8.lower(*placed).compile().as_text()
    gathers = [line for line in hlo.splitlines() if "all-gather(" in line]
    weight_gathers = [line for line in gathers if "f32[8," in line.split("all-gather(")[0]]
    assert not weight_gathers, "expert weights must travel as fp8 bytes"
    assert any("u8[" in line for line in gathers)


def test_nnx_state_takes_the_declared_shardings_of_its_variables():
    """An ``nnx.State`` argument holds ``Param`` variables (NNX objects): under an outer ``jit`` its
    leaves are tracers, so their layout is read from ``in_shardings`` through the variables, and the
    layer is expert parallel with FP8 gathers (it once fell back to the single-device layer)."""
    nnx = pytest.importorskip("flax.nnx")
    model, params, x, shardings, placed = _setup()

    class Layer(nnx.Module):
        def __init__(self):
            for name, value in params.items():
                setattr(self, name, nnx.Param(value))

        def __call__(self, x):
            return model.fn({name: getattr(self, name)[...] for name in params}, x)

    graphdef, state = nnx.split(Layer())
    forward = lambda state, x: nnx.merge(graphdef, state)(x)  # noqa: E731
    param_shardings = jax.tree.map(lambda leaf: shardings[0]["w_gate" if leaf.ndim == 3 else "router"], state)
    placed_state = jax.device_put(state, param_shardings)
    rewritten = moe_optimize(jax.jit(forward, in_shardings=(param_shardings, shardings[1])),
                             weight_gather_quant="fp8_e4m3", strict=True)
    program = str(jax.make_jaxpr(rewritten)(placed_state, placed[1]))
    assert "shard_map" in program and "float8_e4m3fn" in program
    assert _rel(model.fn(params, x), rewritten(placed_state, placed[1])) < 5e-2


def test_explicit_axes_are_read_from_the_types():
    model = ZOO["mixtral"].sized(E=8, T=64)
    params, x = model.args(jax.random.key(1))
    exact = model.fn(params, x)
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Explicit,), devices=jax.devices("cpu")[:8])
    set_mesh = jax.set_mesh if hasattr(jax, "set_mesh") else jax.sharding.use_mesh
    with set_mesh(mesh):
        placed = jax.device_put(
            (params, x),
            ({k: NamedSharding(mesh, P("expert") if v.ndim == 3 else P()) for k, v in params.items()},
             NamedSharding(mesh, P())),
        )
        assert explain(model.fn, *placed).regions[0].parallel_layout.startswith("expert parallel over 'expert' (8 ranks")
        sharded = jax.jit(moe_optimize(model.fn, strict=True))
        assert _rel(exact, sharded(*placed)) < 1e-5
        assert "all-to-all" in sharded.lower(*placed).compile().as_text()
        # traced inside jit the mesh is abstract; this process's devices stand in for the peer stores
        peer = jax.jit(moe_optimize(model.fn, strict=True, exchange_transport="peer"))
        assert _rel(exact, peer(*placed)) < 1e-5
        assert "all-to-all" not in peer.lower(*placed).compile().as_text()


def test_capacity_factor_drops_the_same_copies_sharded_and_on_one_device():
    model, params, x, shardings, placed = _setup()
    single = moe_optimize(model.fn, capacity_factor=0.8)(params, x)
    sharded = moe_optimize(jax.jit(model.fn, in_shardings=shardings), capacity_factor=0.8)(*placed)
    assert _rel(single, sharded) < 1e-5
    assert _rel(model.fn(params, x), single) > 1e-3  # copies were dropped


def test_peer_transport_through_the_decorator():
    """``exchange_transport="peer"``: same results (its all-gather reference off GPUs), no token
    all-to-all, and ``explain`` on the decorated function names the transport as it runs here."""
    model, params, x, shardings, placed = _setup()
    peer = moe_optimize(jax.jit(model.fn, in_shardings=shardings), strict=True, exchange_transport="peer")
    assert _rel(model.fn(params, x), peer(*placed)) < 1e-5
    grads_ref = jax.jit(jax.grad(lambda p: jnp.sum(model.fn(p, x) ** 2)))(params)
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(peer(p, x) ** 2)))(*placed)
    for name in params:
        assert _rel(grads_ref[name], grads[name]) < 1e-5, name
    assert "all-to-all" not in peer.lower(*placed).compile().as_text()
    layout = explain(peer, *placed).regions[0].parallel_layout
    assert "the peer transport's all-gather reference" in layout and "all-to-all" not in layout, layout


def test_explain_says_how_the_exchange_runs(monkeypatch):
    """``explain`` gives the exchange the layer will run: rows per pair and round, one round or
    not, and whether the dispatch sends each token once per rank (as the layer's log does)."""
    model, _, _, shardings, placed = _setup()
    peer = moe_optimize(jax.jit(model.fn, in_shardings=shardings), exchange_transport="peer")
    layout = explain(peer, *placed).regions[0].parallel_layout
    assert "exchange by peer in 1 chunk(s) of" in layout and "one round under any skew" in layout, layout
    assert "once per rank" not in layout  # top-2 of 8 experts on 4 ranks: ~1.1 rows per (token, rank)
    monkeypatch.setattr(exchange, "DEDUP_MIN_ROWS_PER_TOKEN_RANK", 1.0)
    assert "the dispatch sends each token once per rank it needs" in explain(peer, *placed).regions[0].parallel_layout
    nccl = explain(jax.jit(model.fn, in_shardings=shardings), *placed).regions[0].parallel_layout
    assert "exchange by all_to_all" in nccl and "one round under any skew" not in nccl, nccl


def test_unknown_transport_is_named():
    with pytest.raises(ValueError, match="exchange_transport 'nvshmem'"):
        moe_optimize(lambda x: x, exchange_transport="nvshmem")


def test_explain_on_cpus_names_all_to_all_by_default():
    """The default transport ("auto") reads as the one it resolves to on host CPUs."""
    model, _, _, shardings, placed = _setup()
    for fn in (jax.jit(model.fn, in_shardings=shardings),
               moe_optimize(jax.jit(model.fn, in_shardings=shardings), exchange_transport="auto")):
        layout = explain(fn, *placed).regions[0].parallel_layout
        assert "(4 ranks x 2 experts): all-to-all of token rows," in layout, layout
        assert "auto" not in layout


def test_explain_names_the_transport_resolved_for_the_mesh_and_backend(monkeypatch):
    model, _, _, shardings, placed = _setup()
    asked = []

    def as_on_gpus(requested, devices, backend):
        asked.append((requested, tuple(devices), backend))
        return "peer"

    monkeypatch.setattr(exchange, "resolve_transport", as_on_gpus)
    fn = moe_optimize(jax.jit(model.fn, in_shardings=shardings), backend="xla")
    assert "the peer transport's all-gather reference" in explain(fn, *placed).regions[0].parallel_layout
    assert asked == [("auto", tuple(shardings[1].mesh.devices.flat), "xla")]
    monkeypatch.setattr(peer_store, "uses_kernels", lambda backend: True)  # as the Triton backend on GPUs
    assert "token rows stored GPU to GPU by Triton kernels" in explain(fn, *placed).regions[0].parallel_layout


def test_rewrite_logs_the_resolved_transport(caplog):
    model, _, _, shardings, placed = _setup()
    with caplog.at_level(logging.INFO, logger="moe_lowering"):
        moe_optimize(jax.jit(model.fn, in_shardings=shardings), strict=True)(*placed)
    lowered = [r.getMessage() for r in caplog.records if "expert-parallel lowering" in r.getMessage()]
    assert lowered and all("all-to-all of token rows" in m for m in lowered), lowered
