"""Idioms of real frameworks' dense MoE code that the matcher sees through, with negatives beside them.

MaxText names activations for remat (``checkpoint_name``) and constrains shardings of activations
and of index iotas; Qwen3-Next and SonicMoE's 30B shape have as many experts as the expert width,
so which axis of a weight counts experts must follow from the data flow, not from sizes.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from moe_lowering import explain, moe_optimize

from test_soundness import declined_because, rewritten_exactly


def _params(key, d=8, f=16, num_experts=4):
    k = jax.random.split(key, 4)
    return {
        "router": jax.random.normal(k[0], (d, num_experts)),
        "w_gate": jax.random.normal(k[1], (num_experts, d, f)) / np.sqrt(d),
        "w_up": jax.random.normal(k[2], (num_experts, d, f)) / np.sqrt(d),
        "w_down": jax.random.normal(k[3], (num_experts, f, d)) / np.sqrt(f),
    }


def _mixtral(annotate=lambda value, name: value, k=2):
    def layer(params, x):
        num_experts = params["router"].shape[-1]
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), k)
        weights = weights / weights.sum(-1, keepdims=True)
        iota = annotate(jnp.arange(num_experts), "iota")
        gate = ((index[..., None] == iota).astype(x.dtype) * weights[..., None]).sum(-2)
        hidden = annotate(jax.nn.silu(jnp.einsum("td,edf->tef", x, params["w_gate"])), "gate")
        hidden = hidden * annotate(jnp.einsum("td,edf->tef", x, params["w_up"]), "up")
        out = annotate(jnp.einsum("tef,efd->ted", hidden, params["w_down"]), "expert_out")
        return annotate(jnp.einsum("te,ted->td", gate, out), "output")

    return layer


def _checkpoint_name(value, name):
    return checkpoint_name(value, name)


def _sharding_constraint(value, name):
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = P(*([None] * value.ndim))
    return jax.lax.with_sharding_constraint(value, jax.sharding.NamedSharding(mesh, spec))


@pytest.mark.parametrize("annotate", [_checkpoint_name, _sharding_constraint], ids=["checkpoint_name", "sharding"])
def test_annotations_are_transparent(annotate):
    params, x = _params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (16, 8))
    assert rewritten_exactly(_mixtral(annotate), params, x)


def test_remat_names_are_kept_on_the_sparse_rows():
    """A remat policy that saves the named activations still finds the names in the rewrite."""
    params, x = _params(jax.random.key(2)), jax.random.normal(jax.random.key(3), (16, 8))
    rewritten = moe_optimize(_mixtral(_checkpoint_name), strict=True)
    text = str(jax.make_jaxpr(rewritten)(params, x))
    assert "name=gate" in text and "name=up" in text
    policy = jax.checkpoint_policies.save_only_these_names("gate", "up")
    loss = lambda fn: lambda p, x: jnp.sum(jax.checkpoint(fn, policy=policy)(p, x) ** 2)  # noqa: E731
    expected = jax.grad(loss(_mixtral(_checkpoint_name)))(params, x)
    got = jax.jit(jax.grad(loss(rewritten)))(params, x)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):  # to float32 rounding of each gradient
        assert np.linalg.norm(np.asarray(b) - np.asarray(a)) <= 1e-5 * np.linalg.norm(np.asarray(a))


def test_a_sharding_constraint_on_the_output_stays_on_the_output():
    params, x = _params(jax.random.key(4)), jax.random.normal(jax.random.key(5), (16, 8))
    rewritten = moe_optimize(_mixtral(_sharding_constraint), strict=True)
    text = str(jax.make_jaxpr(rewritten)(params, x))
    assert "sharding_constraint" in text


@pytest.mark.parametrize("shape", [(8, 4, 4, 16), (4, 4, 8, 16), (4, 4, 4, 16), (8, 16, 8, 8), (8, 16, 4, 2)],
                         ids=["E=d", "E=f", "E=d=f", "E=T=d", "E=k*T"])
def test_expert_axis_from_the_data_flow_when_sizes_coincide(shape):
    """E equal to d, f, the token count or k times it: the expert axis is the one the routing meets."""
    d, f, num_experts, num_tokens = shape
    params = _params(jax.random.key(6), d=d, f=f, num_experts=num_experts)
    x = jax.random.normal(jax.random.key(7), (num_tokens, d))
    assert rewritten_exactly(_mixtral(), params, x)


def test_expert_axis_last_in_the_weight_when_sizes_coincide():
    """Weights stored [d, f, E] with f == E: the last axis is the one the gate meets."""

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        gate = (jax.nn.one_hot(index, 4) * weights[..., None]).sum(-2)
        hidden = jax.nn.relu(jnp.einsum("td,dfe->tef", x, params["w_up"]))
        return jnp.einsum("te,ted->td", gate, jnp.einsum("tef,efd->ted", hidden, params["w_down"]))

    key = jax.random.split(jax.random.key(8), 3)
    params = {"router": jax.random.normal(key[0], (8, 4)), "w_up": jax.random.normal(key[1], (8, 4, 4)),
              "w_down": jax.random.normal(key[2], (4, 4, 8))}
    assert rewritten_exactly(layer, params, jax.random.normal(jax.random.key(9), (16, 8)))


def test_a_batched_matmul_whose_free_axes_both_count_experts_but_nothing_routes_declines():
    """Negative: the ambiguity is resolved by the routing, so an unrouted ensemble stays dense."""

    def ensemble(params, x):
        _, index = lax.top_k(x @ params["router"], 2)
        hidden = jax.nn.relu(jnp.einsum("td,edf->tef", x, params["w_up"]))
        return jnp.einsum("tef,efd->td", hidden, params["w_down"]) + index.sum()

    params = _params(jax.random.key(10), d=4, f=4, num_experts=4)
    report = explain(ensemble, params, jax.random.normal(jax.random.key(11), (16, 4)))
    assert not report.regions, str(report)


@pytest.mark.parametrize("num_experts, k", [(1, 1), (4, 4)], ids=["E=1", "k=E"])
def test_nothing_to_save_declines_with_a_reason(num_experts, k):
    params = _params(jax.random.key(12), num_experts=num_experts)
    declined_because(_mixtral(k=k), params, jax.random.normal(jax.random.key(13), (16, 8)), "(k = E)")


def _gate_by_where(select):
    """The gate as ``where(<token chose e>, probs, off)``: the chosen experts' probabilities."""

    def layer(params, x):
        num_experts = params["router"].shape[-1]
        probs = jax.nn.softmax(x @ params["router"])
        _, index = lax.top_k(probs, 2)
        chosen = jax.nn.one_hot(index, num_experts).sum(1)
        gate = select(chosen, probs)
        hidden = jax.nn.gelu(jnp.einsum("td,edf->tef", x, params["w_up"]))
        return jnp.einsum("te,ted->td", gate, jnp.einsum("tef,efd->ted", hidden, params["w_down"]))

    return layer


@pytest.mark.parametrize("select", [lambda chosen, probs: jnp.where(chosen > 0, probs, 0.0),
                                    lambda chosen, probs: jnp.where(chosen != 0, probs, 0.0)], ids=["gt", "ne"])
def test_a_gate_selected_where_the_token_chose_the_expert_is_rewritten(select):
    params, x = _params(jax.random.key(16)), jax.random.normal(jax.random.key(17), (16, 8))
    assert rewritten_exactly(_gate_by_where(select), params, x)


@pytest.mark.parametrize("select", [lambda chosen, probs: jnp.where(chosen > 0, probs, 0.01 * probs),
                                    lambda chosen, probs: jnp.where(chosen == 0, probs, 0.0),
                                    lambda chosen, probs: jnp.where(chosen > 1, probs, 0.0),
                                    lambda chosen, probs: jnp.where(chosen * probs > 0, probs, 0.0)],
                         ids=["leaky", "inverted", "threshold-one", "weighted-predicate"])
def test_a_gate_selected_otherwise_declines_or_stays_exact(select):
    params, x = _params(jax.random.key(16)), jax.random.normal(jax.random.key(17), (16, 8))
    rewritten_exactly(_gate_by_where(select), params, x)


def _outer_batch_of_one(drop):
    """AXLearn's layout: tokens ``[outer=1, T, d]`` through the layer, the output reshaped back to
    ``[T, d]`` (``drop="unit"``), or a real token axis dropped by taking one index (must decline)."""

    def layer(params, x):
        tokens = x[None] if drop == "unit" else jnp.stack([x, 2 * x])
        out = _mixtral()(params, tokens.reshape(-1, x.shape[-1])).reshape(tokens.shape)
        return out.reshape(x.shape) if drop == "unit" else out[0]

    return layer


def test_an_output_layout_that_drops_a_unit_token_axis_is_rewritten():
    params, x = _params(jax.random.key(18)), jax.random.normal(jax.random.key(19), (16, 8))
    assert rewritten_exactly(_outer_batch_of_one("unit"), params, x)


def test_an_output_that_keeps_some_of_the_tokens_declines_or_stays_exact():
    params, x = _params(jax.random.key(18)), jax.random.normal(jax.random.key(19), (16, 8))
    rewritten_exactly(_outer_batch_of_one("index"), params, x)


def _gathered(index_of=lambda index: index, tokens_of=lambda x: x):
    """EasyDeL's reference path (zoo ``gathered_weights``), with hooks for the negatives."""

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        w_up = jnp.take(params["w_up"], index_of(index), axis=0)
        w_down = jnp.take(params["w_down"], index_of(index), axis=0)
        hidden = jax.nn.gelu(jnp.einsum("td,tkdf->tkf", tokens_of(x), w_up))
        return jnp.sum(jnp.einsum("tkf,tkfd->tkd", hidden, w_down) * weights[..., None], axis=1)

    return layer


def test_gathered_expert_weights_are_rewritten():
    params, x = _params(jax.random.key(14)), jax.random.normal(jax.random.key(15), (16, 8))
    assert rewritten_exactly(_gathered(), params, x)


@pytest.mark.parametrize("index_of, tokens_of", [
    (lambda index: index[:, ::-1], lambda x: x),  # weights of the other choice: not the rows' own expert
    (lambda index: (index + 1) % 4, lambda x: x),  # shifted experts
    (lambda index: index, lambda x: jnp.roll(x, 1, axis=0)),  # another token's row
], ids=["choices-swapped", "experts-shifted", "tokens-rolled"])
def test_gathered_weights_that_do_not_line_up_decline_or_stay_exact(index_of, tokens_of):
    params, x = _params(jax.random.key(16)), jax.random.normal(jax.random.key(17), (16, 8))
    rewritten_exactly(_gathered(index_of, tokens_of), params, x)


def _gathered_matmul(expand=lambda x: x[:, None, None, :], collapse=lambda out: out.squeeze(2)):
    """bonsai's Gemma 4 ``Gemma4RoutedExperts``: the gathered weights multiplied by ``jnp.matmul`` with the
    tokens through unit axes (``[T, 1, 1, d] @ [T, k, d, f] -> [T, k, 1, f]``), the down product squeezed."""

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        w_up = jnp.take(params["w_up"], index, axis=0)
        w_down = jnp.take(params["w_down"], index, axis=0)
        hidden = jax.nn.gelu(jnp.matmul(expand(x), w_up))
        return jnp.sum(collapse(jnp.matmul(hidden, w_down)) * weights[..., None], axis=1)

    return layer


def test_gathered_weights_multiplied_through_unit_axes_are_rewritten():
    """The unit axes inserted and squeezed around the batched products are seen through (canonicalize's
    ``unit_axes_source``): the same projections as the einsums ``td,tkdf->tkf`` and ``tkf,tkfd->tkd``."""
    params, x = _params(jax.random.key(14)), jax.random.normal(jax.random.key(15), (16, 8))
    assert rewritten_exactly(_gathered_matmul(), params, x)
    assert explain(_gathered_matmul(), params, x).regions[0].style == "gathered weights"


def test_gathered_weights_through_an_axis_that_is_not_unit_decline():
    """The tokens broadcast to 2 along the inserted axis, the products summed over it: each row counted
    twice, not the tokens with unit axes inserted."""
    params, x = _params(jax.random.key(16)), jax.random.normal(jax.random.key(17), (16, 8))
    twice = _gathered_matmul(lambda x: jnp.broadcast_to(x[:, None, None, :], (16, 1, 2, 8)), lambda out: out.sum(2))
    assert not rewritten_exactly(twice, params, x)


@pytest.mark.parametrize("expand", [
    lambda x: x[:, None, None, ::-1], lambda x: jnp.roll(x, 1, axis=0)[:, None, None, :],
], ids=["features-reversed", "tokens-rolled"])
def test_gathered_weights_through_unit_axes_of_other_rows_stay_exact(expand):
    """Reversed features or another token's row under the unit axes: the rows the products read, exactly."""
    params, x = _params(jax.random.key(16)), jax.random.normal(jax.random.key(17), (16, 8))
    rewritten_exactly(_gathered_matmul(expand), params, x)


# --------------------------------------------------------------------------- grouped capacity


def _grouped_switch(variant=None, batch=2, seq=8, slots=3):
    """Top-1 with capacity per batch row, MaxText-style einsums over [B, S, E, C], and the variants
    that look alike: a dispatch laid out [S, B, E, C], a combine that sums every group's slots."""

    def layer(params, x):  # x [B, S, d]
        num_experts = params["router"].shape[-1]
        probs = jax.nn.softmax(x @ params["router"], -1)
        mask = jax.nn.one_hot(jnp.argmax(probs, -1), num_experts, dtype=jnp.int32)  # [B, S, E]
        if variant == "positions_wrap":  # two tokens of a row can share a slot: the device check's case
            position = (jnp.cumsum(mask, 1) * mask - 1) % slots
        else:
            position = jnp.cumsum(mask, 1) * mask - 1
        keep = mask * (position < slots)
        dispatch = jax.nn.one_hot(position, slots, dtype=x.dtype) * keep[..., None]  # [B, S, E, C]
        combine = dispatch * (probs * mask).sum(-1)[..., None, None]
        if variant == "dispatch_sbec":
            rows = jnp.einsum("sbec,bsd->ebcd", jnp.transpose(dispatch, (1, 0, 2, 3)), x)
        else:
            rows = jnp.einsum("bsec,bsd->ebcd", dispatch, x)
        e, b, c, d = rows.shape
        if variant == "all_to_all":  # [E, B, C, d] -> [E, B * C, d] and back: the same rows
            rows = rows.reshape(e, b * c, d)
        if variant == "slots_into_features":  # C and d traded: each row now mixes two tokens' features
            rows = jnp.swapaxes(rows, 2, 3).reshape(e, b, c, d)
        hidden = jax.nn.relu(jnp.einsum("e...d,edf->e...f", rows, params["w_up"]))
        out = jnp.einsum("e...f,efd->e...d", hidden, params["w_down"]).reshape(e, b, c, d)
        if variant == "groups_mixed":  # every token reads every group's slot c: not a capacity layer
            return jnp.einsum("bsec,excd->bsxd", combine, out).sum(2)
        return jnp.einsum("bsec,ebcd->bsd", combine, out)

    return layer


def _grouped_args(batch=2, seq=8, d=8, f=16, num_experts=4):
    k = jax.random.split(jax.random.key(3), 4)
    params = {"router": jax.random.normal(k[0], (d, num_experts)),
              "w_up": jax.random.normal(k[1], (num_experts, d, f)) / np.sqrt(d),
              "w_down": jax.random.normal(k[2], (num_experts, f, d)) / np.sqrt(f)}
    return params, jax.random.normal(k[3], (batch, seq, d))


@pytest.mark.parametrize("variant", [None, "dispatch_sbec", "all_to_all"])
def test_grouped_capacity_is_rewritten_on_its_sparse_path(variant):
    from moe_lowering.testing.device_checks import capacity_fallbacks

    fn = _grouped_switch(variant)
    params, x = _grouped_args()
    assert rewritten_exactly(fn, params, x)
    assert explain(fn, params, x).regions[0].style == "grouped capacity"
    assert capacity_fallbacks(fn, params, x) == [False]


def test_a_dispatch_whose_token_axes_are_transposed_reads_the_right_tokens():
    """'sbec,bsd->ecd' with B == S: naming the dispatch's token axes by position swaps them."""

    def layer(params, x):
        num_experts = params["router"].shape[-1]
        probs = jax.nn.softmax(x @ params["router"], -1)
        mask = jax.nn.one_hot(jnp.argmax(probs, -1), num_experts, dtype=jnp.int32)
        flat = mask.reshape(-1, num_experts)
        position = (jnp.cumsum(flat, 0) * flat - 1).reshape(mask.shape)
        dispatch = jax.nn.one_hot(position, 3, dtype=x.dtype) * (mask * (position < 3))[..., None]
        dispatch_sb = jnp.transpose(dispatch, (1, 0, 2, 3))
        combine_sb = dispatch_sb * jnp.transpose((probs * mask).sum(-1))[..., None, None]
        rows = jnp.einsum("sbec,bsd->ecd", dispatch_sb, x)
        out = jnp.einsum("ecf,efd->ecd", jax.nn.relu(jnp.einsum("ecd,edf->ecf", rows, params["w_up"])),
                         params["w_down"])
        return jnp.einsum("sbec,ecd->bsd", combine_sb, out)

    params, x = _grouped_args(batch=3, seq=3)
    assert rewritten_exactly(layer, params, x)


def test_grouped_capacity_slots_shared_within_a_row_take_the_dense_fallback():
    from moe_lowering.testing.device_checks import capacity_fallbacks

    fn = _grouped_switch("positions_wrap", slots=2)
    params, x = _grouped_args()
    assert rewritten_exactly(fn, params, x)
    assert capacity_fallbacks(fn, params, x) == [True]


def test_a_reshape_that_mixes_slots_with_features_declines():
    params, x = _grouped_args(seq=8)
    fn = _grouped_switch("slots_into_features", slots=8)
    declined_because(fn, params, x, "neither an expert projection nor the combine")


def test_a_combine_that_mixes_groups_declines():
    params, x = _grouped_args()
    declined_because(_grouped_switch("groups_mixed"), params, x, "does not keep the dispatch's token groups apart")


def test_an_expert_body_not_finite_on_empty_slots_takes_the_dense_fallback():
    """``h / |h|``: 0 / 0 on an empty slot's zero row, which the dense layer multiplies by 0 (NaN)."""
    from moe_lowering.testing.device_checks import capacity_fallbacks

    def layer(params, x):
        num_experts = params["router"].shape[-1]
        probs = jax.nn.softmax(x @ params["router"], -1)
        mask = jax.nn.one_hot(jnp.argmax(probs, -1), num_experts, dtype=jnp.int32)
        position = jnp.cumsum(mask, 1) * mask - 1
        dispatch = jax.nn.one_hot(position, 8, dtype=x.dtype) * mask[..., None]
        combine = dispatch * (probs * mask).sum(-1)[..., None, None]
        hidden = jnp.einsum("ebcd,edf->ebcf", jnp.einsum("bsec,bsd->ebcd", dispatch, x), params["w_up"])
        out = jnp.einsum("ebcf,efd->ebcd", hidden / jnp.abs(hidden), params["w_down"])
        return jnp.einsum("bsec,ebcd->bsd", combine, out)

    params, x = _grouped_args()
    assert capacity_fallbacks(layer, params, x) == [True]
    assert rewritten_exactly(layer, params, x, gradients=False)
    assert np.isnan(np.asarray(moe_optimize(layer)(params, x))).all()


def test_top2_from_two_argmaxes_is_one_region_and_no_near_miss():
    """GShard's top-2 as two argmaxes: both decisions build the one capacity layer; neither is a near miss."""
    num_experts, slots = 4, 8

    def gshard(params, x):
        probs = jax.nn.softmax(x @ params["router"], -1)
        first = jax.nn.one_hot(jnp.argmax(probs, -1), num_experts, dtype=jnp.int32)
        second = jax.nn.one_hot(jnp.argmax(probs * (1 - first), -1), num_experts, dtype=jnp.int32)
        gate_1, gate_2 = (probs * first).sum(-1), (probs * second).sum(-1)
        gate_1, gate_2 = gate_1 / (gate_1 + gate_2), gate_2 / (gate_1 + gate_2)
        position_1 = jnp.cumsum(first, 0) - 1
        first = first * (position_1 < slots)
        position_2 = jnp.cumsum(second, 0) - 1 + first.sum(0, keepdims=True)
        second = second * (position_2 < slots)
        slots_1 = jax.nn.one_hot(position_1, slots) * first[..., None]
        slots_2 = jax.nn.one_hot(position_2, slots) * second[..., None]
        combine = slots_1 * gate_1[:, None, None] + slots_2 * gate_2[:, None, None]
        rows = jnp.einsum("tec,td->ecd", slots_1 + slots_2, x)
        out = jnp.einsum("ecf,efd->ecd", jax.nn.relu(jnp.einsum("ecd,edf->ecf", rows, params["w_up"])),
                         params["w_down"])
        return jnp.einsum("tec,ecd->td", combine, out)

    params, x = _params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (16, 8))
    report = explain(gshard, params, x)
    assert len(report.regions) == 1 and report.regions[0].top_k == 2 and not report.near_misses, str(report)
    assert rewritten_exactly(gshard, params, x)


def test_a_dispatch_that_keeps_a_token_axis_free_says_why():
    """A [B, S, E, C] tensor summed with the tokens over S only, B of each left free (not batched as a
    group): every row mixes all groups' tokens into every group's slots. Not a dispatch."""
    params, x = _grouped_args()

    def not_a_dispatch(params, x):
        num_experts = params["router"].shape[-1]
        probs = jax.nn.softmax(x @ params["router"], -1)
        mask = jax.nn.one_hot(jnp.argmax(probs, -1), num_experts, dtype=jnp.int32)  # [B, S, E]
        position = jnp.cumsum(mask, 1) * mask - 1
        dispatch = jax.nn.one_hot(position, 3, dtype=x.dtype) * (mask * (position < 3))[..., None]  # [B, S, E, C]
        rows = jnp.einsum("bsec,zsd->ebczd", dispatch, x)
        out = jnp.einsum("ebczf,efd->ebczd", jax.nn.relu(jnp.einsum("ebczd,edf->ebczf", rows, params["w_up"])),
                         params["w_down"])
        return jnp.einsum("bsec,ebczd->bsd", dispatch * probs[..., None], out)

    declined_because(not_a_dispatch, params, x, "not as a dispatch [tokens.., E, C]")


@pytest.mark.parametrize("activation", [jax.nn.relu, jax.nn.gelu], ids=["relu", "gelu"])
def test_experts_applied_with_vmap_keep_their_custom_derivative(activation):
    """``jax.vmap`` over stacked expert weights (what flax's ``nn.vmap`` traces to): ``relu``'s
    ``custom_jvp`` rule comes out batched, with transposes out and back; it is elementwise still."""

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        gate = (jax.nn.one_hot(index, 4) * weights[..., None]).sum(1)

        def expert(w_up, w_down):
            return activation(x @ w_up) @ w_down

        return jnp.einsum("te,etd->td", gate, jax.vmap(expert)(params["w_up"], params["w_down"]))

    params, x = _params(jax.random.key(12)), jax.random.normal(jax.random.key(13), (16, 8))
    assert rewritten_exactly(layer, params, x)
    x = x.at[0, :].set(0.0)  # relu'(0): the rule's value, not autodiff's of max(x, 0)
    assert rewritten_exactly(layer, params, x)


# --------------------------------------------------------------------------- the gate applied to the tokens


def _gate_on_tokens(body=None, k=2, scores=jax.nn.sigmoid, combine="sum"):
    """``xe = repeat(x[:, None], E, 1) * G[..., None]`` (the zoo's ``gate_on_tokens``), the experts on
    ``[T, E, d]``, a sum over E (``combine="einsum"``: folded into the down-projection,
    'tef,efd->td'). ``body(xe, params) -> [T, E, f]`` replaces the SwiGLU up-projection."""

    def swiglu(gated, params):
        return jax.nn.silu(jnp.einsum("ted,edf->tef", gated, params["w_gate"])) * jnp.einsum(
            "ted,edf->tef", gated, params["w_up"])

    def layer(params, x):
        num_experts = params["router"].shape[-1]
        weights, index = lax.top_k(scores(x @ params["router"]), k)
        gate = (jax.nn.one_hot(index, num_experts, dtype=x.dtype) * weights[..., None]).sum(-2)
        gated = jnp.repeat(x[:, None], num_experts, 1) * gate[..., None]
        hidden = (body or swiglu)(gated, params)
        if combine == "einsum":
            return jnp.einsum("tef,efd->td", hidden, params["w_down"])
        return jnp.einsum("tef,efd->ted", hidden, params["w_down"]).sum(axis=1)

    return layer


@pytest.mark.parametrize("k, scores, combine", [(1, jax.nn.sigmoid, "sum"), (2, jax.nn.softmax, "einsum"),
                                                (2, jax.nn.sigmoid, "sum")], ids=["top1-sigmoid", "top2-softmax-einsum",
                                                                                   "top2-sigmoid"])
def test_a_gate_on_the_tokens_is_carried_into_the_rows(k, scores, combine):
    """The weight scales each routed copy before the (nonlinear) expert: moving it to the combine
    would be wrong, so this also checks where the rewrite puts it."""
    params, x = _params(jax.random.key(20)), jax.random.normal(jax.random.key(21), (16, 8))
    layer = _gate_on_tokens(k=k, scores=scores, combine=combine)
    assert explain(layer, params, x).regions[0].style == "gate on tokens"
    assert rewritten_exactly(layer, params, x)


def test_a_gate_on_the_tokens_with_relu_experts_keeps_relu_s_derivative():
    params, x = _params(jax.random.key(22)), jax.random.normal(jax.random.key(23), (16, 8))
    layer = _gate_on_tokens(lambda gated, p: jax.nn.relu(jnp.einsum("ted,edf->tef", gated, p["w_up"])))
    assert rewritten_exactly(layer, params, x)


@pytest.mark.parametrize("body, reason", [
    (lambda gated, p: jnp.einsum("ted,edf->tef", jax.nn.gelu(gated), p["w_up"]), "follows before any product"),
    (lambda gated, p: jnp.einsum("ted,edf->tef", jnp.tanh(gated), p["w_up"]), "follows before any product"),
    (lambda gated, p: jax.nn.relu(jnp.einsum("ted,edf->tef", gated, p["w_up"]) + p["w_gate"][:, 0]),
     "not provably zero"),
    (lambda gated, p: jnp.exp(jnp.einsum("ted,edf->tef", gated, p["w_up"])), "not provably zero"),
    (lambda gated, p: 1.0 / jnp.einsum("ted,edf->tef", gated, p["w_up"]), "not provably zero"),
    (lambda gated, p: jnp.sqrt(jnp.abs(jnp.einsum("ted,edf->tef", gated, p["w_up"]))), "not provably zero"),
], ids=["gelu-first", "tanh-first", "bias", "exp", "reciprocal", "sqrt"])
def test_a_gate_on_the_tokens_declines_where_unrouted_experts_do_not_vanish(body, reason):
    """Every expert runs on the gated copy x * G[t, e], zero off the chosen experts: where the body
    is not zero there (a bias, exp), or has an infinite derivative (sqrt), or an activation comes before
    the first product, the dense sum over all E is not the routed sum."""
    params, x = _params(jax.random.key(24)), jax.random.normal(jax.random.key(25), (16, 8))
    declined_because(_gate_on_tokens(body), params, x, reason)


# --------------------------------------------------------------------------- experts as separate modules


def _separate_modules(params):
    """``_params`` as a list of E expert modules, each with weight arrays of its own."""
    experts = [{name: params[name][e] for name in ("w_gate", "w_up", "w_down")}
               for e in range(params["router"].shape[-1])]
    return {"router": params["router"], "experts": experts}


def _separate(pick="gather", body=None, order=None):
    """The zoo's ``separate_experts``: every module's output stacked, each choice picking its own
    (``pick="gather"``: ``outs[idx, t, :]``; ``"one-hot"``: a ``[T, E]`` gate against ``[T, E, d]``)."""

    def swiglu(x, expert):
        return (jax.nn.silu(x @ expert["w_gate"]) * (x @ expert["w_up"])) @ expert["w_down"]

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        experts = params["experts"]
        outs = [(body or swiglu)(x, experts[e], e) if body else swiglu(x, experts[e]) for e in range(len(experts))]
        outs = [outs[e] for e in (order or range(len(outs)))]
        if pick == "one-hot":
            gate = (jax.nn.one_hot(index, len(experts)) * weights[..., None]).sum(1)
            return jnp.einsum("te,ted->td", gate, jnp.stack(outs, axis=1))
        tokens = jnp.arange(x.shape[0])[:, None] if pick == "gather" else (jnp.arange(x.shape[0])[:, None] + 1) % 16
        return jnp.sum(jnp.stack(outs)[index, tokens, :] * weights[..., None], axis=1)

    return layer


@pytest.mark.parametrize("pick", ["gather", "one-hot"])
def test_experts_as_separate_modules_are_stacked_and_rewritten(pick):
    params, x = _separate_modules(_params(jax.random.key(26))), jax.random.normal(jax.random.key(27), (16, 8))
    assert rewritten_exactly(_separate(pick), params, x)
    [region] = explain(_separate(pick), params, x).regions
    assert region.style == "separate expert weights"
    assert region.stacked_weight_bytes == 3 * 4 * 8 * 16 * 4  # three [E, 8, 16] float32 weights, copied per call
    assert "stacked on every call" in str(region.summary())


def test_a_loop_over_slices_of_one_weight_stacked_and_gathered_is_rewritten():
    """``jnp.stack([expert(x, w[e]) for e])[idx, t]``: the loop style's slices, stacked rather than summed."""
    params, x = _params(jax.random.key(28)), jax.random.normal(jax.random.key(29), (16, 8))

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        outs = jnp.stack([jax.nn.gelu(x @ params["w_up"][e]) @ params["w_down"][e] for e in range(4)])
        return jnp.sum(outs[index, jnp.arange(16)[:, None], :] * weights[..., None], axis=1)

    assert rewritten_exactly(layer, params, x)
    assert explain(layer, params, x).regions[0].stacked_weight_bytes == 0


def test_separate_modules_stacked_in_another_order_stay_exact():
    """Stacked in reverse, module E-1-e sits at position e; the stacked weight follows the stack."""
    params, x = _separate_modules(_params(jax.random.key(30))), jax.random.normal(jax.random.key(31), (16, 8))
    assert rewritten_exactly(_separate(order=[3, 2, 1, 0]), params, x)


def test_slices_of_one_weight_stacked_out_of_order_decline():
    params, x = _params(jax.random.key(28)), jax.random.normal(jax.random.key(29), (16, 8))

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        outs = jnp.stack([jax.nn.gelu(x @ params["w_up"][e]) @ params["w_down"][e] for e in (1, 0, 2, 3)])
        return jnp.sum(outs[index, jnp.arange(16)[:, None], :] * weights[..., None], axis=1)

    declined_because(layer, params, x, "stacked out of order")


def _other_activation_for_expert_2(x, expert, e):
    activation = jax.nn.gelu if e == 2 else jax.nn.silu
    return (activation(x @ expert["w_gate"]) * (x @ expert["w_up"])) @ expert["w_down"]


@pytest.mark.parametrize("pick, body, reason", [
    ("shifted", None, "something other than the routing indices"),
    ("gather", _other_activation_for_expert_2, "same program"),
], ids=["another-token-s-row", "one-expert-another-body"])
def test_separate_modules_that_are_not_one_routed_layer_decline(pick, body, reason):
    params, x = _separate_modules(_params(jax.random.key(32))), jax.random.normal(jax.random.key(33), (16, 8))
    declined_because(_separate(pick, body), params, x, reason)


def test_separate_modules_reading_one_array_twice_decline():
    """Expert 1 reads expert 0's up-projection: the arrays are not E weights of one expert each."""
    params, x = _separate_modules(_params(jax.random.key(32))), jax.random.normal(jax.random.key(33), (16, 8))

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        experts = params["experts"]
        outs = jnp.stack([(jax.nn.silu(x @ experts[e]["w_gate"]) * (x @ experts[0 if e == 1 else e]["w_up"]))
                          @ experts[e]["w_down"] for e in range(4)])
        return jnp.sum(outs[index, jnp.arange(16)[:, None], :] * weights[..., None], axis=1)

    declined_because(layer, params, x, "same program")


# --------------------------------------------------------------------------- a one-hot dispatch and a loop, stacked


def _dispatch_loop(expert_of=lambda i: i, body=None, order=None, input_weights=False):
    """The zoo's ``one_hot_dispatch_loop`` on ``[B, S, d]`` tokens, with hooks for the negatives: the
    weight slice expert ``i`` reads, its body, the stacking order, routing weights in the dispatch mask."""

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        mask = jnp.swapaxes(jax.nn.one_hot(index, 4, dtype=x.dtype), -1, -2)  # [B, S, E, k]
        dispatch = mask * weights[:, :, None, :] if input_weights else mask
        xin = jnp.einsum("BTID,BTEK->BTED", x[:, :, None], dispatch)

        def expert(i):
            h = xin[:, :, i] @ params["w_up"][expert_of(i)]
            return (body(h) if body else jax.nn.gelu(h)) @ params["w_down"][expert_of(i)]

        outs = jnp.stack([expert(i) for i in (order or range(4))], axis=2)
        return jnp.einsum("BTED,BTEK->BTD", outs, mask * weights[:, :, None, :])

    return layer


def test_a_one_hot_dispatch_with_a_stacked_loop_is_rewritten():
    params, x = _params(jax.random.key(34)), jax.random.normal(jax.random.key(35), (2, 8, 8))
    assert rewritten_exactly(_dispatch_loop(), params, x)
    assert explain(_dispatch_loop(), params, x).regions[0].style == "one-hot dispatch"


@pytest.mark.parametrize("variant, reason", [
    (dict(expert_of=lambda i: (i + 1) % 4), "another expert's weight"),
    (dict(order=[1, 0, 2, 3]), "stacked out of order"),
    (dict(body=lambda h: 1.0 / h), "not provably finite"),
    (dict(body=lambda h: jnp.log(jnp.abs(h))), "not provably finite"),
    (dict(input_weights=True), "sliced along a token or expert axis"),
], ids=["other-expert-s-weight", "out-of-order", "reciprocal", "log", "weights-at-both-ends"])
def test_a_one_hot_dispatch_that_is_not_the_routed_layer_declines(variant, reason):
    """Unchosen experts run on zero rows and the combine multiplies them by zero: 1/h or log|h| there is
    inf, and 0 * inf is NaN in the dense layer, so the body must be finite on a zero row."""
    params, x = _params(jax.random.key(36)), jax.random.normal(jax.random.key(37), (2, 8, 8))
    declined_because(_dispatch_loop(**variant), params, x, reason)


# --------------------------------------------------------------------------- approx_max_k; idioms still declined


def test_approx_max_k_routing_is_read_like_top_k():
    """On a CPU ``approx_max_k`` is an exact top-k; anywhere, the rewrite reads its own indices."""
    params, x = _params(jax.random.key(38)), jax.random.normal(jax.random.key(39), (16, 8))

    def layer(params, x):
        weights, index = lax.approx_max_k(jax.nn.softmax(x @ params["router"]), 2)
        gate = (jax.nn.one_hot(index, 4) * weights[..., None]).sum(1)
        hidden = jax.nn.gelu(jnp.einsum("td,edf->tef", x, params["w_up"]))
        return jnp.einsum("te,ted->td", gate, jnp.einsum("tef,efd->ted", hidden, params["w_down"]))

    assert rewritten_exactly(layer, params, x)
    assert explain(layer, params, x).regions[0].location


def _sorted_range_mask(params, x, count=lambda flat: jnp.sum(jax.nn.one_hot(flat, 4, dtype=jnp.int32), axis=0),
                       unsort=lambda out, order: out[jnp.argsort(order)]):
    """approx_max_k routing, copies of the tokens tiled per choice argsorted by expert, every expert on
    every sorted copy, each copy's own expert kept by ``start_e <= i < end_e``, un-sorted."""
    weights, index = lax.approx_max_k(jax.nn.softmax(x @ params["router"]), 2)
    flat = index.reshape(-1)
    order = jnp.argsort(flat)
    copies = jnp.repeat(x, 2, axis=0)[order]
    counts = count(flat)
    end = jnp.cumsum(counts)
    position = jnp.arange(flat.shape[0])
    in_range = ((end - counts)[:, None] <= position) & (position < end[:, None])  # [E, T*k]
    out = jnp.einsum("enf,efd->end", jax.nn.gelu(jnp.einsum("nd,edf->enf", copies, params["w_up"])), params["w_down"])
    out = unsort(jnp.sum(out * in_range[..., None], axis=0), order).reshape(16, 2, -1)
    return jnp.einsum("lkd,lk->ld", out, weights)


def test_separate_arrays_gathered_by_something_other_than_stacked_products_say_so():
    """``outs[idx, t]`` of a value no expert product computes: the gather by the routing indices is
    found (explain must not say there is none), what is missing is the experts' weights."""
    params, x = _params(jax.random.key(42)), jax.random.normal(jax.random.key(43), (16, 8))

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        outs = jnp.stack([jnp.tanh(x) * e for e in range(4)])  # [E, T, d]: no expert weight
        return jnp.sum(outs[index, jnp.arange(16)[:, None], :] * weights[..., None], axis=1)

    declined_because(layer, params, x, "a gather by the routing indices and the token positions")


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.bfloat16])
def test_a_loop_weight_slice_cast_narrower_is_not_the_weight(dtype):
    """``w[e].astype(int8).astype(float32)`` rounds the weights the dense expert uses: the slice is then
    not the stacked weight's (a mutant the suite found rewritten with the unrounded weights)."""
    params, x = _params(jax.random.key(44)), jax.random.normal(jax.random.key(45), (16, 8))
    params["w_up"] = params["w_up"] * 4  # entries of a few units: int8 truncates them, bfloat16 rounds them

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        out = jnp.zeros_like(x)
        for e in range(4):
            w_up = params["w_up"][e].astype(dtype).astype(x.dtype)
            gate = jnp.where(index == e, weights, 0.0).sum(-1)
            out = out + gate[:, None] * (jax.nn.gelu(x @ w_up) @ params["w_down"][e])
        return out

    rewritten_exactly(layer, params, x)


def test_separate_modules_stacked_by_concatenate_are_rewritten():
    """``jnp.stack`` is one primitive from JAX 0.11; before, unit-axis pieces and a concatenate."""
    params, x = _separate_modules(_params(jax.random.key(46))), jax.random.normal(jax.random.key(47), (16, 8))

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        mask = jnp.swapaxes(jax.nn.one_hot(index, 4, dtype=x.dtype), -1, -2)  # [T, E, k]
        xin = jnp.einsum("TID,TEK->TED", x[:, None], mask)
        outs = [(jax.nn.gelu(xin[:, i] @ expert["w_up"]) @ expert["w_down"])[:, None]
                for i, expert in enumerate(params["experts"])]
        return jnp.einsum("TED,TEK->TD", lax.concatenate(outs, 1), mask * weights[:, None, :])

    assert rewritten_exactly(layer, params, x)


# --------------------------------------------------------------------------- idiom 3: tokens tiled per choice


def _tiled(tile=None, first_index=None, later_index=None, before=None, split=None, weights_of=None):
    """The zoo's ``tiled_per_choice`` (E=4, k=2): the tokens repeated per choice, every expert's product
    (weights scaled per expert) on every copy, each copy's own expert kept by a one-hot of the flattened
    indices. Hooks for the negatives: how the tokens are tiled, the index each selection reads (the first
    two products, the last), a step on every expert's values before the first selection, how the copies
    are split back into (token, choice), which weights combine them."""

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        tiled = tile(x) if tile else jnp.repeat(x, 2, axis=0)
        first = jax.nn.one_hot((first_index or (lambda i: i.reshape(-1)))(index), 4, axis=0)
        later = jax.nn.one_hot((later_index or (lambda i: i.reshape(-1)))(index), 4, axis=0)

        def product(a, w, select, step=lambda v: v):
            return jnp.einsum("bm,bmn->mn", select, step(jnp.einsum("mk,bkn->bmn", a, w)))

        hidden = jax.nn.gelu(product(tiled, params["w_gate"] * params["scale"], first, before or (lambda v: v)))
        out = product(hidden * product(tiled, params["w_up"], first), params["w_down"], later)
        out = split(out) if split else out.reshape(-1, 2, out.shape[-1])
        return jnp.sum(out * (weights_of or (lambda w, p: w))(weights, params)[..., None], axis=1)

    return layer


def _tiled_args(key):
    params = _params(key)
    params["scale"] = jax.random.uniform(jax.random.fold_in(key, 1), (4, 1, 16), minval=0.5, maxval=1.5)
    params["other_weights"] = jax.random.uniform(jax.random.fold_in(key, 2), (16, 2))
    return params, jax.random.normal(jax.random.fold_in(key, 3), (16, 8))


def test_tokens_tiled_by_jnp_tile_of_a_unit_axis_are_rewritten():
    """Grok-1's copies (xai-org/grok-1 ``MoELayer``): ``jnp.tile(x[:, None, :], (1, k, 1)).reshape(-1, d)``,
    copy ``n`` token ``n // k`` as ``jnp.repeat`` makes them."""
    params, x = _tiled_args(jax.random.key(52))
    grok = _tiled(tile=lambda x: jnp.tile(x[:, None, :], (1, 2, 1)).reshape(-1, x.shape[-1]))
    assert rewritten_exactly(grok, params, x)
    assert explain(grok, params, x).regions[0].style == "tokens tiled per choice"
    outer = _tiled(tile=lambda x: jnp.tile(x[None], (2, 1, 1)).reshape(-1, x.shape[-1]))  # copy n: token n % T
    declined_because(outer, params, x, "tiled otherwise, as jnp.tile does")


@pytest.mark.parametrize("before", [None, jnp.tanh, jax.nn.gelu], ids=["after-selection", "tanh-before", "gelu-before"])
def test_tokens_tiled_per_choice_are_rewritten(before):
    """Each copy keeps its own expert's product; a step finite everywhere (tanh, gelu) may also run on every
    expert's values before the selection: a one-hot selection of it is it of the selection."""
    params, x = _tiled_args(jax.random.key(50))
    assert rewritten_exactly(_tiled(before=before), params, x)
    assert explain(_tiled(before=before), params, x).regions[0].style == "tokens tiled per choice"


@pytest.mark.parametrize("variant, reason", [
    (dict(first_index=lambda i: i[:, ::-1].reshape(-1)), "not know as a one-hot of the routing indices flattened"),
    (dict(first_index=lambda i: jnp.roll(i.reshape(-1), 1)), "not know as a one-hot of the routing indices flattened"),
    (dict(first_index=lambda i: (i.reshape(-1) + 1) % 4), "not know as a one-hot of the routing indices flattened"),
    (dict(later_index=lambda i: i[:, ::-1].reshape(-1)), "not know as a one-hot of the routing indices flattened"),
    (dict(tile=lambda x: jnp.tile(x, (2, 1))), "tiled otherwise, as jnp.tile does"),
    (dict(split=lambda out: out.reshape(2, -1, out.shape[-1]).swapaxes(0, 1)), "not split back in place"),
    (dict(split=lambda out: (out * np.linspace(0.5, 1.5, 32, dtype=np.float32)[:, None]).reshape(16, 2, -1)),
     "a tensor with an axis along the copies"),
    (dict(before=jnp.exp), "only steps finite everywhere may come before the selection"),
    (dict(before=lambda v: jnp.log(jnp.abs(v))), "only steps finite everywhere may come before the selection"),
    (dict(before=lambda v: 1.0 / v), "only steps finite everywhere may come before the selection"),
    (dict(before=lambda v: v.astype(jnp.float16)), "only steps finite everywhere may come before the selection"),
    (dict(before=jax.nn.relu), "not proven finite there"),
], ids=["reversed-choices", "shifted-copies", "other-expert", "later-reversed", "tiled-by-jnp-tile", "split-k-outer",
        "weighted-per-copy", "exp-before", "log-before", "reciprocal-before", "float16-before",
        "custom-jvp-before"])
def test_tokens_tiled_per_choice_that_are_not_the_routed_layer_decline(variant, reason):
    """A copy selected by another copy's index (or another expert), tokens tiled in another order than the
    indices were flattened, copies split back in another order, a per-copy factor before the split (not read
    as routing weights), or a step that can be inf or NaN on an expert the copy did not choose (0 * inf is NaN
    in the dense layer only): each declines with why."""
    params, x = _tiled_args(jax.random.key(51))
    declined_because(_tiled(**variant), params, x, reason)


def test_tokens_tiled_per_choice_weighted_by_values_not_from_the_routing_stay_exact():
    """The weights per (token, choice) are read from the program as computed, whatever computed them."""
    params, x = _tiled_args(jax.random.key(52))
    assert rewritten_exactly(_tiled(weights_of=lambda w, p: p["other_weights"]), params, x)


def test_tokens_tiled_per_choice_inside_shard_map():
    """The pass does not enter a ``shard_map`` body: explain names the routing decision there (not "no
    routing decision"), and ``moe_optimize`` applied to the function inside rewrites it exactly."""
    params, x = _tiled_args(jax.random.key(53))
    mesh = jax.make_mesh((1,), ("data",))

    def mapped(layer):
        return jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P(), P()), out_specs=P()))

    declined_because(mapped(_tiled()), params, x, "inside the body of `shard_map`")
    rewritten = mapped(moe_optimize(_tiled(), strict=True))
    assert "moe_lowering_sparse_moe" in str(jax.make_jaxpr(rewritten)(params, x))
    np.testing.assert_allclose(rewritten(params, x), _tiled()(params, x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- idiom 4: sorted copies, a range mask


def _sort_dispatch(route=lax.approx_max_k, key_of=None, counts_of=None, lower=None, upper=None, unsort_by=None,
                   mask_with="mul", stable=True, sums_counts_over=(1,)):
    """The zoo's ``sorted_range_mask`` on ``[B=2, L=4, d]`` tokens (E=4, k=2): each row's copies argsorted by
    expert, the tokens gathered at ``order // k``, every expert on every sorted copy, ``start_e <= i < end_e``
    keeping each copy's own expert, summed over E, un-sorted by ``argsort(order)``. Hooks for the variants
    and the negatives: the sort key, the index the counts read, the two range conditions, the un-sort
    index, how the mask is applied, the sort's stability, the axes the one-hot is summed over."""

    def layer(params, x):
        batch, length, _ = x.shape
        weights, index = route(jax.nn.softmax(x @ params["router"]), 2)
        flat = index.reshape(batch, length * 2)
        order = jnp.argsort(key_of(params, x, flat) if key_of else flat, axis=-1, stable=stable)
        copies = jnp.take_along_axis(x, (order // 2)[..., None], axis=1)
        counted = counts_of(params, x, flat) if counts_of else flat
        counts = jnp.sum(jax.nn.one_hot(counted, 4, dtype=jnp.int32), axis=sums_counts_over, keepdims=False)
        counts = jnp.broadcast_to(counts, (batch, 4))
        end = jnp.cumsum(counts, axis=-1)
        start = end - counts
        i = jnp.arange(length * 2)
        in_range = ((lower or (lambda s, i: s <= i))(start[:, :, None], i)
                    & (upper or (lambda i, e: i < e))(i, end[:, :, None]))
        out = jnp.einsum("benf,efd->bend", jax.nn.gelu(jnp.einsum("bnd,edf->benf", copies, params["w_up"])),
                         params["w_down"])
        if mask_with == "where":
            out = jnp.where(in_range[..., None], out, 0.0)
        else:
            out = out * in_range[..., None].astype(x.dtype)
        inverse = unsort_by(order) if unsort_by else jnp.argsort(order, axis=-1)
        out = jnp.take_along_axis(out.sum(1), inverse[..., None], axis=1).reshape(batch, length, 2, -1)
        return jnp.einsum("blkd,blk->bld", out, weights)

    return layer


def _other_router_indices(params, x, flat):
    """The expert indices of a second router (the first one's weights reversed along E)."""
    return lax.top_k(x @ params["router"][:, ::-1], 2)[1].reshape(flat.shape)


def _args_of(layer, seed):
    """``[T=16, d]`` tokens for the 1-D ``_sorted_range_mask`` variants, ``[B=2, L=4, d]`` for the others."""
    shape = (16, 8) if getattr(layer, "func", layer) is _sorted_range_mask else (2, 4, 8)
    return _params(jax.random.key(seed)), jax.random.normal(jax.random.key(seed + 1), shape)


_BINCOUNT = functools.partial(_sorted_range_mask, count=lambda flat: jnp.bincount(flat, length=4),
                              unsort=lambda out, order: jnp.zeros_like(out).at[order].set(out))


@pytest.mark.parametrize("layer", [
    _sort_dispatch(), _sort_dispatch(route=lax.top_k, mask_with="where", stable=False),
    _sort_dispatch(lower=lambda s, i: i >= s, upper=lambda i, e: e > i), _sorted_range_mask, _BINCOUNT,
], ids=["approx_max_k", "top_k-where-unstable", "flipped-comparisons", "tiled-tokens-1d", "bincount-scatter-1d"])
def test_a_sort_based_range_mask_dispatch_is_rewritten(layer):
    """Issue 35, idiom 4: the range mask keeps each sorted copy's own expert, so the layer is the chosen
    experts' rows; rewritten exactly (outputs and gradients) whichever way the mask is written."""
    params, x = _args_of(layer, 50)
    assert rewritten_exactly(layer, params, x)
    assert explain(layer, params, x).regions[0].style == "sorted range mask"


@pytest.mark.parametrize("layer, reason", [
    (_sort_dispatch(lower=lambda s, i: s < i), "keeps start_e < i: off by one"),
    (_sort_dispatch(upper=lambda i, e: i <= e), "keeps i <= end_e: off by one"),
    (_sort_dispatch(lower=lambda s, i: s <= i + 1), "not an iota over the sorted positions"),
    (_sort_dispatch(counts_of=_other_router_indices), "not the range mask start_e <= i < end_e"),
    (_sort_dispatch(sums_counts_over=(0, 1)), "not over the copies of each sorted row"),
    (_sort_dispatch(unsort_by=lambda order: order), "the un-sort is not the inverse permutation"),
    (_sort_dispatch(unsort_by=lambda order: jnp.argsort(order[:, ::-1], axis=-1)),
     "the un-sort is not the inverse permutation"),
    (_sort_dispatch(key_of=lambda params, x, flat: -flat), "sorted by a key that is not the routing's"),
    (_sort_dispatch(key_of=_other_router_indices), "(sorted by another key, or gathered otherwise)"),
    (functools.partial(_sorted_range_mask, unsort=lambda out, order: jnp.zeros_like(out).at[order[::-1]].set(out)),
     "the un-sort is not the inverse permutation"),
], ids=["lower-off-by-one", "upper-off-by-one", "shifted-iota", "counts-of-another-index", "counts-over-the-batch",
        "unsorted-by-the-order", "unsorted-by-another-permutation", "sorted-descending", "sorted-by-another-index",
        "scattered-at-another-permutation"])
def test_a_range_mask_dispatch_that_does_not_keep_each_copys_own_expert_declines(layer, reason):
    """Each breaks one link of the proof (assumption sorted-copy-own-expert) and is declined, naming it."""
    params, x = _args_of(layer, 52)
    declined_because(layer, params, x, reason)


def _gemma4_sorted(tokens_of=lambda order: order // 2, counts_of=None, starts_of=lambda end, counts: end - counts):
    """google-deepmind/gemma's gemma4 sorted range layer on ``[T=16, d]`` tokens (E=4, k=2), each piece written
    one way it ships (or a near miss of it): the sorted copies' token index from the order, the counts from the
    ``[T, k]`` indices, the starts from the ends."""

    def layer(params, x):
        weights, index = lax.approx_max_k(jax.nn.softmax(x @ params["router"]), 2)
        flat = index.reshape(-1)
        order = jnp.argsort(flat)
        copies = x[tokens_of(order)]
        counts = (counts_of(index) if counts_of
                  else jnp.sum(jax.nn.one_hot(flat, 4, dtype=jnp.int32), axis=0))
        end = jnp.cumsum(counts)
        position = jnp.arange(flat.shape[0])
        in_range = (starts_of(end, counts)[:, None] <= position) & (position < end[:, None])
        out = jnp.einsum("enf,efd->end", jax.nn.gelu(jnp.einsum("nd,edf->enf", copies, params["w_up"])),
                         params["w_down"])
        out = jnp.sum(out * in_range[..., None], axis=0)[jnp.argsort(order)].reshape(16, 2, -1)
        return jnp.einsum("lkd,lk->ld", out, weights)

    return layer


_REPEATED_TOKENS = lambda order: jnp.repeat(jnp.arange(16), 2)[order]  # noqa: E731
_CHOICE_COUNTS = lambda index: jnp.sum(jax.nn.one_hot(index, 4, dtype=jnp.int32), axis=(0, 1))  # noqa: E731
_EXCLUSIVE_STARTS = lambda end, counts: jnp.concatenate([jnp.array([0]), end[:-1]])  # noqa: E731


@pytest.mark.parametrize("layer", [
    _gemma4_sorted(tokens_of=_REPEATED_TOKENS), _gemma4_sorted(counts_of=_CHOICE_COUNTS),
    _gemma4_sorted(starts_of=_EXCLUSIVE_STARTS),
    _gemma4_sorted(tokens_of=_REPEATED_TOKENS, counts_of=_CHOICE_COUNTS, starts_of=_EXCLUSIVE_STARTS),
], ids=["repeated-iota-tokens", "counts-of-the-choices", "concatenated-starts", "all-three"])
def test_gemma4_sorted_range_pieces_are_read(layer):
    """``repeat(arange(T), k)[order]`` is ``order // k``; the one-hot of ``[T, k]`` indices summed over both
    axes is the counts of the copies; ``concatenate([[0], ends[:-1]])`` is ``ends - counts``: rewritten exactly."""
    params, x = _params(jax.random.key(54)), jax.random.normal(jax.random.key(55), (16, 8))
    assert rewritten_exactly(layer, params, x)
    assert explain(layer, params, x).regions[0].style == "sorted range mask"


@pytest.mark.parametrize("layer, reason", [
    (_gemma4_sorted(tokens_of=lambda order: jnp.repeat(jnp.arange(16)[::-1], 2)[order]),
     "gathered by the sort order itself"),
    (_gemma4_sorted(tokens_of=lambda order: jnp.repeat(jnp.arange(8), 4)[order]), "gathered by the sort order itself"),
    (_gemma4_sorted(tokens_of=lambda order: jnp.tile(jnp.arange(16), 2)[order]), "gathered by the sort order itself"),
    (_gemma4_sorted(counts_of=lambda index: jnp.sum(jax.nn.one_hot(index[:, :1], 4, dtype=jnp.int32), axis=(0, 1))),
     "not the range mask start_e <= i < end_e"),
    (_gemma4_sorted(counts_of=lambda index: jnp.sum(jax.nn.one_hot(index[:, ::-1] % 3, 4, dtype=jnp.int32),
                                                    axis=(0, 1))), "not the range mask start_e <= i < end_e"),
    (_gemma4_sorted(starts_of=lambda end, counts: jnp.concatenate([jnp.array([1]), end[:-1]])),
     "not [0] followed by ends[:-1]"),
    (_gemma4_sorted(starts_of=lambda end, counts: jnp.concatenate([jnp.array([0]), end[1:]])),
     "sliced other than as ends[:-1]"),
    (_gemma4_sorted(starts_of=lambda end, counts: jnp.concatenate([end[:-1], jnp.array([0])])),
     "not [0] followed by ends[:-1]"),
], ids=["reversed-iota", "repeat-by-another-k", "tiled-not-repeated", "counts-of-the-first-choice-only",
        "counts-of-other-indices", "starts-from-one", "starts-from-the-next-ends", "zero-at-the-end"])
def test_gemma4_sorted_range_near_misses_decline(layer, reason):
    """Each near miss breaks the link its form stands for (assumption sorted-copy-own-expert): declined."""
    params, x = _params(jax.random.key(56)), jax.random.normal(jax.random.key(57), (16, 8))
    declined_because(layer, params, x, reason)


def _per_row_choice_counts(counted_axes):
    """The copies of each row of ``[B=2, L=4, d]`` tokens sorted on their own, the counts summed from the
    ``[B, L, k]`` indices over ``counted_axes``, the starts concatenated per row."""

    def layer(params, x):
        weights, index = lax.approx_max_k(jax.nn.softmax(x @ params["router"]), 2)
        order = jnp.argsort(index.reshape(2, 8), axis=-1)
        copies = jnp.take_along_axis(x, (order // 2)[..., None], axis=1)
        counts = jnp.broadcast_to(jnp.sum(jax.nn.one_hot(index, 4, dtype=jnp.int32), axis=counted_axes), (2, 4))
        end = jnp.cumsum(counts, axis=-1)
        start = jnp.concatenate([jnp.zeros((2, 1), end.dtype), end[:, :-1]], axis=1)
        i = jnp.arange(8)
        out = jnp.einsum("benf,efd->bend", jax.nn.gelu(jnp.einsum("bnd,edf->benf", copies, params["w_up"])),
                         params["w_down"]) * ((start[:, :, None] <= i) & (i < end[:, :, None]))[..., None]
        out = jnp.take_along_axis(out.sum(1), jnp.argsort(order, axis=-1)[..., None], axis=1).reshape(2, 4, 2, -1)
        return jnp.einsum("blkd,blk->bld", out, weights)

    return layer


def test_counts_of_the_choices_per_sorted_row():
    """Counts of ``[B, L, k]`` indices summed over L and k are each row's: read; summed over B too, they are
    the whole batch's while each row is sorted on its own: declined."""
    params, x = _params(jax.random.key(58)), jax.random.normal(jax.random.key(59), (2, 4, 8))
    assert rewritten_exactly(_per_row_choice_counts((1, 2)), params, x)
    declined_because(_per_row_choice_counts((0, 1, 2)), params, x, "the expert counts are taken per whole batch")


@pytest.mark.parametrize("num_experts, exact_on_tpu", [(8, True), (256, False)])
def test_explain_says_where_approx_max_k_is_an_exact_top_k(num_experts, exact_on_tpu):
    """CPU and GPU lower approx_max_k to a sort and a slice; a TPU keeps every expert as a candidate only
    while its bins are the experts themselves (E <= 128 at k=2, recall 0.95)."""
    from moe_lowering import _compat
    from moe_lowering.passes.graph import build_graph
    from moe_lowering.passes.rules_routing import find_anchors
    from moe_lowering.report import routing_note

    jaxpr = jax.make_jaxpr(lambda s: lax.approx_max_k(s, 2))(jnp.zeros((4, num_experts)))
    [anchor] = find_anchors(build_graph(jaxpr))
    note = routing_note(anchor)
    assert "exact top-k on CPU and GPU" in note and "reads its indices" in note
    assert "also exact" not in note or exact_on_tpu
    if _compat.approx_top_k_candidates(num_experts, 2, 2, 0.95, -1) is not None:  # this jaxlib says how many
        assert ("also exact" in note) == exact_on_tpu and ("keeps 128 of the E=256" in note) == (not exact_on_tpu)


def _tiled_weights_layer(tile_weights):
    """tunix's dense Qwen3 MoE (google/tunix ``tunix/models/qwen3/model.py``, its un-meshed fallback): a one-hot
    dispatch loop whose per-choice routing weights are spread over the experts by ``tile_weights``."""

    def layer(params, x):  # x [B, S, d]
        num_experts = params["router"].shape[-1]
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        mask = jnp.swapaxes(jax.nn.one_hot(index, num_experts), -1, -2)  # [B, S, E, k]
        expert_in = jnp.einsum("BTID,BTEK->BTED", x[:, :, None, :], mask)
        outs = jnp.stack([jax.nn.gelu(expert_in[:, :, e] @ params["w_up"][e]) @ params["w_down"][e]
                          for e in range(num_experts)], axis=2)
        return jnp.einsum("BTED,BTEK->BTD", outs, mask * tile_weights(weights, num_experts))

    return layer


def test_tile_of_size_one_axes_is_read_as_the_broadcast_it_is():
    """``jnp.tile`` (its own primitive in recent JAX) repeating only size-1 axes gives a broadcast's values."""
    params, x = _params(jax.random.key(40)), jax.random.normal(jax.random.key(41), (2, 8, 8))
    assert rewritten_exactly(_tiled_weights_layer(lambda w, e: jnp.tile(w[:, :, None, :], (1, 1, e, 1))), params, x)


def test_tile_of_a_longer_axis_is_not_a_broadcast():
    """Tiling a longer axis (here each token given the weights of a token of the first half) is another
    order, not a broadcast: declined, or exact."""
    params, x = _params(jax.random.key(42)), jax.random.normal(jax.random.key(43), (2, 8, 8))
    half = x.shape[1] // 2
    first_half = _tiled_weights_layer(lambda w, e: jnp.tile(w[:, :half, None, :], (1, 2, e, 1)))
    rewritten_exactly(first_half, params, x)
    swapped = _tiled_weights_layer(lambda w, e: jnp.tile(w[:, :, None, ::-1], (1, 1, e, 1)))
    rewritten_exactly(swapped, params, x)
