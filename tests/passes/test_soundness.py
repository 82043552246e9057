"""Regression tests for programs the pass once rewrote wrongly or crashed on.

Each program is a small variation of a zoo layer as a user (or a user's bug) would write it. For
every one the rewrite must agree with the program's own dense evaluation, outputs and gradients
with respect to every input, or decline; where the pass must decline, the test names the reason
``explain`` must give.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from moe_lowering import NoMoeFoundWarning, explain, moe_optimize
from moe_lowering.testing.device_checks import capacity_fallbacks

T, D, F, E = 16, 8, 16, 4


def _params(key, num_experts=E):
    k = jax.random.split(key, 3)
    return {
        "router": jax.random.normal(k[0], (D, num_experts)),
        "w_up": jax.random.normal(k[1], (num_experts, D, F)) / np.sqrt(D),
        "w_down": jax.random.normal(k[2], (num_experts, F, D)) / np.sqrt(F),
    }


def _tokens(key, shape=(T, D)):
    return jax.random.normal(key, shape)


def _relative_error(expected, got) -> float:
    expected = np.asarray(expected, np.float64)
    got = np.asarray(got, np.float64)
    if not np.array_equal(np.isnan(expected), np.isnan(got)):
        return float("inf")
    expected, got = np.nan_to_num(expected), np.nan_to_num(got)
    scale = np.linalg.norm(expected)
    return float(np.linalg.norm(expected - got) / (scale if scale else 1.0))


def _output_and_gradients(fn):
    """``fn``'s output and the gradients of ``sum(sin(output))`` for every parameter and the tokens, from one trace."""
    def loss_and_output(params, x):
        out = fn(params, x)
        return jnp.sum(jnp.sin(out)), out

    def run(params, x):
        (_, out), grads = jax.value_and_grad(loss_and_output, argnums=(0, 1), has_aux=True)(params, x)
        return out, grads

    return run


def rewritten_exactly(fn, params, x, *, gradients=True, tol=1e-5) -> bool:
    """``True`` if the pass rewrote ``fn`` and it agrees with ``fn``; ``False`` if it declined.

    Fails the test if it rewrote ``fn`` and the outputs (or, with ``gradients``, the gradients
    with respect to every parameter and the tokens) differ by more than ``tol``.
    """
    report = explain(fn, params, x)
    if not report.regions:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoMoeFoundWarning)
        optimized = moe_optimize(fn)
        # With gradients, each side's output and gradients come from one program: the rewrite is
        # traced and compiled once (the sparse layer's forward alone: tests/passes/test_zoo_rewrite.py).
        run = _output_and_gradients if gradients else lambda fn: lambda params, x: (fn(params, x), None)
        expected_out, expected = jax.jit(run(fn))(params, x)
        got_out, got = jax.jit(run(optimized))(params, x)
        error = _relative_error(expected_out, got_out)
        assert error < tol, f"outputs differ by {error:.3g}\n{report}"
        if gradients:
            for path, a, b in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(expected),
                                  jax.tree.leaves(got)):
                error = _relative_error(a, b)
                assert error < tol, f"gradient {jax.tree_util.keystr(path[0])} differs by {error:.3g}\n{report}"
    return True


def declined_because(fn, params, x, reason: str) -> None:
    report = explain(fn, params, x)
    assert not report.regions, str(report)
    reasons = [miss.reason for miss in report.near_misses]
    assert any(reason in r for r in reasons), reasons


# --------------------------------------------------------------------------- capacity layers


def _switch(variant=None, capacity=None):
    """Switch-style top-1 capacity layer, and the variants users write (or write by mistake)."""

    def switch(params, x):
        num_experts = params["router"].shape[-1]
        slots = capacity or x.shape[0] // num_experts
        probs = jax.nn.softmax(x @ params["router"], axis=-1)
        mask = jax.nn.one_hot(jnp.argmax(probs, -1), num_experts, dtype=jnp.int32)
        gate = (probs * mask).sum(-1)
        position = jnp.cumsum(mask, 0) * mask - 1
        if variant == "overflow_clamped":
            position = jnp.minimum(position, slots - 1)
        keep = mask + (position < slots) if variant == "keep_added" else mask * (position < slots)
        dispatch = jax.nn.one_hot(position, slots) * keep[..., None]
        combine = dispatch * gate[:, None, None]
        if variant == "combine_other_slots":  # slots counted from the other end for the combine
            reversed_position = jnp.cumsum(mask[::-1], 0)[::-1] * mask - 1
            combine = (jax.nn.one_hot(reversed_position, slots) * (mask * (reversed_position < slots))[..., None]
                       * gate[:, None, None])
        if variant == "swapped":
            dispatch, combine = combine, dispatch
        if variant == "rescaled":
            dispatch, combine = 0.5 * dispatch, 2 * combine
        if variant == "straight_through":
            soft = jax.nn.one_hot(position, slots) * probs[..., None]
            dispatch = dispatch + soft - lax.stop_gradient(soft)
        expert_in = jnp.einsum("tec,td->ecd", dispatch, x)
        hidden = jax.nn.relu(jnp.einsum("ecd,edf->ecf", expert_in, params["w_up"]))
        return jnp.einsum("tec,ecd->td", combine, jnp.einsum("ecf,efd->ecd", hidden, params["w_down"]))

    return switch


def _gshard_without_offset(params, x):
    """Top-2 with capacity whose second-choice positions forget the first choices' count."""
    num_experts = params["router"].shape[-1]
    slots = x.shape[0] // 2
    gates, index = lax.top_k(jax.nn.softmax(x @ params["router"], -1), 2)
    mask_1 = jax.nn.one_hot(index[:, 0], num_experts, dtype=jnp.int32)
    mask_2 = jax.nn.one_hot(index[:, 1], num_experts, dtype=jnp.int32)
    position_1 = jnp.cumsum(mask_1, 0) - 1
    position_2 = jnp.cumsum(mask_2, 0) - 1
    slots_1 = jax.nn.one_hot(position_1, slots) * (mask_1 * (position_1 < slots))[..., None]
    slots_2 = jax.nn.one_hot(position_2, slots) * (mask_2 * (position_2 < slots))[..., None]
    combine = gates[:, 0, None, None] * slots_1 + gates[:, 1, None, None] * slots_2
    expert_in = jnp.einsum("tec,td->ecd", slots_1 + slots_2, x)
    hidden = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", expert_in, params["w_up"]))
    return jnp.einsum("tec,ecd->td", combine, jnp.einsum("ecf,efd->ecd", hidden, params["w_down"]))


@pytest.mark.parametrize("variant", [None, "overflow_clamped", "keep_added", "combine_other_slots", "rescaled"])
def test_capacity_variants_are_exact(variant):
    """Dispatch values other than 0/1, two tokens in one slot, a combine reading other slots than the
    dispatch wrote: each is checked on the device, where the dense layer runs instead."""
    assert rewritten_exactly(_switch(variant), _params(jax.random.key(0)), _tokens(jax.random.key(1)))


def test_gshard_second_choice_without_offset_is_exact():
    assert rewritten_exactly(_gshard_without_offset, _params(jax.random.key(2)), _tokens(jax.random.key(3)))


@pytest.mark.parametrize("variant", ["swapped", "straight_through"])
def test_differentiable_dispatch_declines(variant):
    """The sparse layer moves rows by index: a dispatch tensor with a derivative cannot be lowered."""
    declined_because(_switch(variant), _params(jax.random.key(0)), _tokens(jax.random.key(1)),
                     "the dispatch tensor has a derivative")


def _straight_through(v):
    return v - lax.stop_gradient(v)


def _switch_with_zero_valued_combine_term(term):
    """Switch with biased experts (an empty slot's output is not zero) whose combine adds a term of
    value zero and derivative ``-empty * d(probs)`` on the slots the token was not dispatched to,
    written with ``neg`` so that a signed bound would cancel it (issue 38)."""

    def switch(params, x):
        num_tokens, num_experts = x.shape[0], params["router"].shape[-1]
        slots = num_tokens // num_experts
        probs = jax.nn.softmax(x @ params["router"], axis=-1)
        mask = jax.nn.one_hot(jnp.argmax(probs, -1), num_experts, dtype=jnp.int32)
        gate = (probs * mask).sum(-1)
        position = jnp.cumsum(mask, 0) * mask - 1
        dispatch = jax.nn.one_hot(position, slots) * (mask * (position < slots))[..., None]
        empty = 1 - dispatch
        q3 = jnp.broadcast_to(probs[..., None], dispatch.shape)
        if term == "neg_of_twice_minus_stop":
            zero = empty * q3 + (-(empty * (2 * q3 - lax.stop_gradient(q3))))
        else:  # "straight_through_pair": the probabilities and the probabilities rolled by one expert
            r3 = jnp.broadcast_to(jnp.roll(probs, 1, axis=-1)[..., None], dispatch.shape)
            zero = empty * _straight_through(q3) + (-(empty * _straight_through(r3)))
        combine = dispatch * gate[:, None, None] + zero
        expert_in = jnp.einsum("tec,td->ecd", dispatch, x)
        hidden = jax.nn.relu(jnp.einsum("ecd,edf->ecf", expert_in, params["w_up"]) + params["b_up"][:, None])
        expert_out = jnp.einsum("ecf,efd->ecd", hidden, params["w_down"]) + params["b_down"][:, None]
        return jnp.einsum("tec,ecd->td", combine, expert_out)

    return switch


@pytest.mark.parametrize("term", ["neg_of_twice_minus_stop", "straight_through_pair"])
def test_combine_derivative_written_to_cancel_is_kept(term):
    """Zero in value, so the outputs were always exact; the router's gradient was 0.87x / 0.72x off
    when ``neg`` was replayed into the derivative bound, which then cancelled under ``add``."""
    params = _params(jax.random.key(29))
    keys = jax.random.split(jax.random.key(30), 2)
    params.update(b_up=jax.random.normal(keys[0], (E, F)), b_down=jax.random.normal(keys[1], (E, D)))
    layer = _switch_with_zero_valued_combine_term(term)
    x = _tokens(jax.random.key(31))
    if rewritten_exactly(layer, params, x):
        assert capacity_fallbacks(layer, params, x) == [True]  # the derivative reaches the empty slots


def _gshard_argmax_then_second_of_top2(params, x):
    """GShard top-2 whose two choices are two routing decisions: the argmax, and the second of a
    top-2. The matcher sums their k (3), past E = 2."""
    num_experts = params["router"].shape[-1]
    slots = x.shape[0] // 2
    probs = jax.nn.softmax(x @ params["router"], -1)
    index = jnp.stack([jnp.argmax(probs, -1), lax.top_k(probs, 2)[1][:, 1]], axis=1)
    gates = jnp.take_along_axis(probs, index, axis=1)
    mask_1 = jax.nn.one_hot(index[:, 0], num_experts, dtype=jnp.int32)
    mask_2 = jax.nn.one_hot(index[:, 1], num_experts, dtype=jnp.int32)
    position_1 = jnp.cumsum(mask_1, 0) - 1
    mask_1 = mask_1 * (position_1 < slots)
    position_2 = jnp.cumsum(mask_2, 0) - 1 + mask_1.sum(0)
    mask_2 = mask_2 * (position_2 < slots)
    slots_1 = jax.nn.one_hot(position_1, slots) * mask_1[..., None]
    slots_2 = jax.nn.one_hot(position_2, slots) * mask_2[..., None]
    combine = gates[:, 0, None, None] * slots_1 + gates[:, 1, None, None] * slots_2
    expert_in = jnp.einsum("tec,td->ecd", slots_1 + slots_2, x)
    hidden = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", expert_in, params["w_up"]))
    return jnp.einsum("tec,ecd->td", combine, jnp.einsum("ecf,efd->ecd", hidden, params["w_down"]))


def test_routing_decisions_whose_k_sum_past_the_experts_are_exact():
    """Once a ValueError from ``top_k(kept, 3)`` over two experts while reading the choices."""
    params, x = _params(jax.random.key(32), num_experts=2), _tokens(jax.random.key(33))
    assert rewritten_exactly(_gshard_argmax_then_second_of_top2, params, x)
    assert capacity_fallbacks(_gshard_argmax_then_second_of_top2, params, x) == [False]


def test_top_k_of_zero_experts_declines():
    """``top_k(probs, 0)`` routes nowhere (the program returns zeros); once a ZeroDivisionError in
    the rewrite's ``reshape(-1, k)``."""

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 0)
        gate = (jax.nn.one_hot(index, E) * weights[..., None]).sum(1)
        hidden = jax.nn.gelu(jnp.einsum("td,edf->tef", x, params["w_up"]))
        return jnp.einsum("te,ted->td", gate, jnp.einsum("tef,efd->ted", hidden, params["w_down"]))

    params, x = _params(jax.random.key(34)), _tokens(jax.random.key(35))
    declined_because(layer, params, x, "k = 0 experts")
    with pytest.warns(NoMoeFoundWarning, match="k = 0"):
        np.testing.assert_array_equal(jax.jit(moe_optimize(layer))(params, x), np.zeros((T, D)))


def test_capacity_dense_fallback_keeps_gradients_finite():
    """The dense branch taken: the sparse branch's backward must not leak 0 * NaN into gradients."""
    params = _params(jax.random.key(4))
    params["router"] = params["router"].at[0, 0].set(jnp.nan)
    assert rewritten_exactly(_switch(), params, _tokens(jax.random.key(5)))


# --------------------------------------------------------------------------- casts


def _top2(index_dtype=None, gate_quantiser=None):
    def layer(params, x):
        num_experts = params["router"].shape[-1]
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        if index_dtype == "bool":
            index = index.astype(bool).astype(jnp.int32)
        elif index_dtype is not None:
            index = index.astype(index_dtype)
        gate = (jax.nn.one_hot(index, num_experts) * weights[..., None]).sum(1)
        if gate_quantiser is not None:
            gate = gate_quantiser(gate)
        hidden = jax.nn.gelu(jnp.einsum("td,edf->tef", x, params["w_up"]))
        return jnp.einsum("te,ted->td", gate, jnp.einsum("tef,efd->ted", hidden, params["w_down"]))

    return layer


def test_index_cast_through_bool_declines():
    declined_because(_top2("bool"), _params(jax.random.key(6)), _tokens(jax.random.key(7)), "cast to bool")


def test_index_cast_that_wraps_declines():
    """int8 cannot hold expert 159; the router is biased so that such experts are chosen."""
    params = _params(jax.random.key(8), num_experts=160)
    params["router"] = params["router"].at[:, 150:].add(5.0)
    declined_because(_top2(jnp.int8), params, _tokens(jax.random.key(9)), "cast to int8")


@pytest.mark.filterwarnings("ignore:jax.nn.one_hot input should be integer-typed:DeprecationWarning")
@pytest.mark.parametrize("dtype", [jnp.int16, jnp.uint8, jnp.float32, jnp.bfloat16])
def test_index_cast_that_keeps_values_is_rewritten(dtype):
    assert rewritten_exactly(_top2(dtype), _params(jax.random.key(10)), _tokens(jax.random.key(11)))


def _weighted_rows_cast(cast, scale=4.0, before_down=False):
    """Top-2 one-hot layer whose weighted expert rows are cast (``cast``) before their sum over the experts,
    or, ``before_down``, whose weighted hidden rows are cast before the down projection."""

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        gate = (jax.nn.one_hot(index, params["router"].shape[-1]) * weights[..., None]).sum(-2)
        hidden = jax.nn.relu(jnp.einsum("td,edf->tef", x * scale, params["w_up"]))
        if before_down:
            return jnp.einsum("tef,efd->td", cast(hidden * gate[..., None]), params["w_down"])
        rows = gate[..., None] * jnp.einsum("tef,efd->ted", hidden, params["w_down"])
        return cast(rows).astype(jnp.float32).sum(1)

    return layer


@pytest.mark.parametrize("cast", [
    lambda r: r.astype(jnp.int32), lambda r: r.astype(jnp.uint8), lambda r: r.astype(jnp.bool_),
    lambda r: r.astype(jnp.bfloat16), lambda r: r.astype(jnp.float16),
], ids=["int32", "uint8", "bool", "bfloat16", "float16"])
@pytest.mark.parametrize("before_down", [False, True], ids=["before-sum", "before-down"])
def test_weighted_rows_cast_to_a_narrower_type_declines(cast, before_down):
    """Each expert's weighted rows rounded (to an integer, a bool or a narrower float) before they are summed
    cannot be had from the rows' sum weighted once; the pass rewrote these (audit 2026-11-29)."""
    declined_because(_weighted_rows_cast(cast, before_down=before_down), _params(jax.random.key(30)),
                     _tokens(jax.random.key(31)), "only a widening float cast may follow the routing weights")


def test_weighted_rows_cast_wider_is_rewritten():
    """The control (no cast) is rewritten exactly, and so is a bf16 layer's rows widened to float32."""
    layer = _weighted_rows_cast(lambda r: r, scale=1.0)
    assert rewritten_exactly(layer, _params(jax.random.key(32)), _tokens(jax.random.key(33)))
    bf16_params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), _params(jax.random.key(34)))
    widened = _weighted_rows_cast(lambda r: r.astype(jnp.float32), scale=1.0)
    assert explain(widened, bf16_params, _tokens(jax.random.key(35)).astype(jnp.bfloat16)).regions


@pytest.mark.parametrize("quantiser", [
    lambda g: (g * 127).astype(jnp.int8).astype(jnp.float32) / 127,
    lambda g: g.astype(jnp.bfloat16).astype(jnp.float32),
], ids=["int8-fake-quantised", "bf16-round-trip"])
def test_gate_the_program_rounds_is_used_as_rounded(quantiser, request):
    """The replacement reads the program's own gate at the chosen experts, rounding included, and
    its gradient (zero through the int8 cast) too."""
    if "bf16" in request.node.callspec.id and jax.default_backend() != "cpu":
        pytest.skip("XLA:GPU's xla_allow_excess_precision may drop the dense reference's own f32 -> bf16 -> f32 "
                    "round trip, so the reference is not the program's rounding there")
    assert rewritten_exactly(_top2(gate_quantiser=quantiser), _params(jax.random.key(12)), _tokens(jax.random.key(13)))


# --------------------------------------------------------------------------- [B, S, d] with partial token axes


def _bsd(kind):
    def layer(params, x):
        num_experts = params["router"].shape[-1]
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        gate = (jax.nn.one_hot(index, num_experts) * weights[..., None]).sum(-2)  # [B, S, E]
        if kind == "gate_per_position":
            gate = gate * params["per_position"][None, :, None]
        hidden = jnp.einsum("bsd,edf->bsef", x, params["w_up"])
        if kind == "scale_per_example":
            hidden = hidden * params["per_example"][:, None, None, None]
        if kind == "bias_per_position":
            hidden = hidden + params["bias_per_position"][None, :, None, :]
        hidden = jax.nn.relu(hidden)
        return jnp.einsum("bse,bsed->bsd", gate, jnp.einsum("bsef,efd->bsed", hidden, params["w_down"]))

    return layer


@pytest.mark.parametrize("kind", ["plain", "gate_per_position", "scale_per_example", "bias_per_position"])
def test_operands_with_some_of_the_token_axes(kind):
    batch, seq = 2, 8
    keys = jax.random.split(jax.random.key(14), 3)
    params = {**_params(jax.random.key(15)), "per_position": jax.random.normal(keys[0], (seq,)),
              "per_example": jax.random.normal(keys[1], (batch,)),
              "bias_per_position": jax.random.normal(keys[2], (seq, F))}
    assert rewritten_exactly(_bsd(kind), params, _tokens(jax.random.key(16), (batch, seq, D)))


# --------------------------------------------------------------------------- custom_jvp in the expert body


@jax.custom_jvp
def _straight_through_relu(h):
    return jnp.maximum(h, 0)


_straight_through_relu.defjvp(lambda primals, tangents: (_straight_through_relu(primals[0]), tangents[0]))


@pytest.mark.parametrize("activation", [jax.nn.relu, _straight_through_relu, lambda h: jnp.clip(h, -1, 1)],
                         ids=["relu", "straight-through", "clip"])
def test_custom_jvp_body_keeps_its_derivative(activation):
    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        gate = (jax.nn.one_hot(index, E) * weights[..., None]).sum(1)
        hidden = activation(jnp.einsum("td,edf->tef", x, params["w_up"]))
        return jnp.einsum("te,ted->td", gate, jnp.einsum("tef,efd->ted", hidden, params["w_down"]))

    assert rewritten_exactly(layer, _params(jax.random.key(17)), _tokens(jax.random.key(18)))


def test_relu_at_exactly_zero_keeps_relus_derivative():
    """``relu``'s own rule gives 0 at 0 where autodiff of ``max(h, 0)`` gives 0.5."""

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        gate = (jax.nn.one_hot(index, E) * weights[..., None]).sum(1)
        hidden = jax.nn.relu(jnp.einsum("td,edf->tef", x, params["w_up"]))
        return jnp.einsum("te,ted->td", gate, jnp.einsum("tef,efd->ted", hidden, params["w_down"]))

    params = _params(jax.random.key(19))
    params["w_up"] = params["w_up"].at[:, :, ::2].set(0.0)  # half the pre-activations exactly 0
    assert rewritten_exactly(layer, params, _tokens(jax.random.key(20)))


# --------------------------------------------------------------------------- loop style


def _loop(gate_of_expert, up_weight_of_expert=lambda params, e: params["w_up"][e]):
    def layer(params, x):
        weights, selected = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        out = jnp.zeros_like(x)
        for e in range(params["router"].shape[-1]):
            hidden = jax.nn.relu(x @ up_weight_of_expert(params, e))
            out = out + gate_of_expert(weights, selected, e)[:, None] * (hidden @ params["w_down"][e])
        return out

    return layer


def test_loop_with_a_new_numpy_constant_each_iteration():
    gate = lambda w, sel, e: jnp.where(sel == e, w * np.float32(1.0), np.zeros((1,), np.float32)).sum(-1)  # noqa: E731
    assert rewritten_exactly(_loop(gate), _params(jax.random.key(21)), _tokens(jax.random.key(22)))


def test_loop_with_a_clamped_dynamic_slice():
    """``dynamic_slice`` at start ``e + 1`` is clamped by XLA: the last expert's weight twice."""
    gate = lambda w, sel, e: jnp.where(sel == e, w, 0).sum(-1)  # noqa: E731
    up = lambda params, e: lax.dynamic_slice_in_dim(params["w_up"], e + 1, 1, 0)[0]  # noqa: E731
    layer = _loop(gate, up)
    params, x = _params(jax.random.key(23)), _tokens(jax.random.key(24))
    rewritten_exactly(layer, params, x)


# --------------------------------------------------------------------------- non-finite routing


@pytest.mark.parametrize("layer", [_switch(), _top2()], ids=["switch", "top2"])
def test_nan_router_reaches_the_output_as_in_the_reference(layer):
    params = _params(jax.random.key(25))
    params["router"] = params["router"].at[0, 1].set(jnp.nan)
    x = _tokens(jax.random.key(26))
    expected = layer(params, x)
    got = jax.jit(moe_optimize(layer, strict=True))(params, x)
    assert np.isnan(np.asarray(expected)).any()
    np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(np.asarray(expected)))
    np.testing.assert_allclose(np.nan_to_num(np.asarray(got)), np.nan_to_num(np.asarray(expected)), rtol=1e-5,
                               atol=1e-6)


def test_non_finite_weight_of_an_expert_no_token_selects_does_not_poison():
    """The point of sparsity, and a documented difference: dense gives NaN everywhere (0 * NaN)."""
    params = _params(jax.random.key(27), num_experts=8)
    x = _tokens(jax.random.key(28), (4, D))
    _, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
    unused = sorted(set(range(8)) - set(np.asarray(index).ravel().tolist()))
    assert unused, "every expert is chosen: pick other data"
    params["w_down"] = params["w_down"].at[unused[0]].set(jnp.nan)
    got = jax.jit(moe_optimize(_top2(), strict=True))(params, x)
    assert np.isfinite(np.asarray(got)).all()
    assert np.isnan(np.asarray(_top2()(params, x))).all()


def test_non_finite_weight_of_a_selected_expert_reaches_only_its_tokens():
    """The README's limit: the sparse layer multiplies an expert's weights only into the tokens that
    select it; the dense one also into every other token (0 * inf = NaN)."""
    params = _params(jax.random.key(27), num_experts=8)
    x = _tokens(jax.random.key(28), (16, D))
    _, index = lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
    expert = int(np.asarray(index)[0, 0])
    params["w_down"] = params["w_down"].at[expert].set(jnp.inf)
    got = np.asarray(jax.jit(moe_optimize(_top2(), strict=True))(params, x))
    selects = np.any(np.asarray(index) == expert, axis=1)
    assert not np.isfinite(got[selects]).all(axis=1).any()
    assert np.isfinite(got[~selects]).all() and (~selects).any()
    assert np.isnan(np.asarray(_top2()(params, x))).all()
