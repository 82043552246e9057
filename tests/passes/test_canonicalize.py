"""Products the matcher reads in canonical form (``passes/canonicalize.py``), with near misses beside them.

Tokens broadcast over the experts before a batched expert matmul (bonsai GPT-OSS's
``broadcast_to(x[None], (E, T, H))``, DeepMind Gemma 4's ``repeat(expand_dims(x, (0, 1)), E, 1)``) are the
unbatched product; a weight fusing gate and up on an axis of its own (Gemma 4's ``[E, 2, f, d]``, its
product unpacked ``x1, x2 = einsum(...)``) is read part by part. Each is rewritten, alone and in a training
step, where the same values are computed; a broadcast that is not over the product's batch axis, a slice of
another axis, or parts used before they are taken apart decline or stay exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from moe_lowering import explain, moe_optimize

from test_soundness import declined_because, rewritten_exactly

T, D, F, E, K = 16, 8, 12, 4, 2


def _params(key):
    k = jax.random.split(key, 5)
    return {
        "router": jax.random.normal(k[0], (D, E)),
        "w_up": jax.random.normal(k[1], (E, D, F)) / np.sqrt(D),
        "w_down": jax.random.normal(k[2], (E, F, D)) / np.sqrt(F),
        "gating": jax.random.normal(k[3], (E, 2, F, D)) / np.sqrt(D),
    }


def _args(seed):
    return _params(jax.random.key(seed)), jax.random.normal(jax.random.key(seed + 1), (T, D))


def _gate(params, x):
    weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), K)
    return jnp.sum(jax.nn.one_hot(index, E) * weights[..., None], axis=1)  # [T, E]


def _broadcast_layer(up):
    """A one-hot gate layer whose up-projection ``up(params, x)`` gives ``[E, T, F]``."""

    def layer(params, x):
        out = jnp.einsum("etf,efd->etd", jax.nn.gelu(up(params, x)), params["w_down"])
        return jnp.sum(out * _gate(params, x).T[..., None], axis=0)

    return layer


def test_tokens_broadcast_over_the_experts_are_the_unbatched_product():
    """bonsai GPT-OSS's ``broadcast_to(x[None], (E, T, H))``; Gemma 4's form, on the other operand, below."""
    up = lambda p, x: jnp.einsum("enh,ehd->end", jnp.broadcast_to(x[None], (E,) + x.shape), p["w_up"])  # noqa: E731
    assert rewritten_exactly(_broadcast_layer(up), *_args(0))


def test_tokens_scaled_per_expert_are_not_a_broadcast():
    """Each expert's own copy of the tokens: the batch axis is real, so there is no product of the tokens."""
    up = lambda p, x: jnp.einsum("enh,ehd->end", x[None] * (1.0 + jnp.arange(E))[:, None, None], p["w_up"])  # noqa: E731
    declined_because(_broadcast_layer(up), *_args(1), "no matmul of the tokens")


@pytest.mark.parametrize("up", [
    # the broadcast copies summed over the experts: the tokens times the sum of the weights, for every expert
    lambda p, x: jnp.broadcast_to(jnp.einsum("enh,ehd->nd", jnp.broadcast_to(x[None], (E,) + x.shape),
                                             p["w_up"]), (E, T, F)),
    # broadcast along the contracted features: each token's features summed, times the weights' column sums
    lambda p, x: jnp.einsum("enh,ehd->end", jnp.broadcast_to(x.sum(-1)[None, :, None], (E, T, D)), p["w_up"]),
], ids=["summed-over-experts", "broadcast-features"])
def test_broadcasts_that_are_not_the_tokens_over_the_experts_decline_or_stay_exact(up):
    rewritten_exactly(_broadcast_layer(up), *_args(2))


def _fused_layer(take_apart, equation="td,ekfd->ketf", weight=lambda p: p["gating"]):
    """Gemma 4's experts: gate and up fused in one ``[E, 2, f, d]`` weight, its product taken apart by
    ``take_apart(h) -> (x1, x2)``."""

    def layer(params, x):
        x1, x2 = take_apart(jnp.einsum(equation, x, weight(params)))
        out = jnp.einsum("etf,efd->etd", jax.nn.gelu(x1) * x2, params["w_down"])
        return jnp.einsum("te,etd->td", _gate(params, x), out)

    return layer


TAKE_APART = {
    "tuple-unpacked": lambda h: tuple(h),
    "indexed, swapped": lambda h: (lax.dynamic_slice_in_dim(h, 1, 1)[0], h[0]),
}


@pytest.mark.parametrize("take_apart", TAKE_APART.values(), ids=TAKE_APART.keys())
def test_a_weight_fusing_gate_and_up_on_an_axis_of_its_own_is_read_part_by_part(take_apart):
    assert rewritten_exactly(_fused_layer(take_apart), *_args(3))


def test_the_parts_axis_anywhere_in_the_weight_and_the_product():
    layer = _fused_layer(lambda h: tuple(jnp.squeeze(part, 2) for part in jnp.split(h, 2, axis=2)), "td,efkd->etkf",
                         weight=lambda p: jnp.transpose(p["gating"], (0, 2, 1, 3)))
    assert rewritten_exactly(layer, *_args(4))


def _gemma(params, x):
    """DeepMind Gemma 4's experts: the tokens repeated over the experts, gate and up fused and unpacked."""
    tokens = jnp.repeat(jnp.expand_dims(x, (0, 1)), E, axis=1)
    x1, x2 = jnp.einsum("gecd,ekfd->kgecf", tokens, params["gating"])
    out = jnp.einsum("gecf,efd->gecd", jax.nn.gelu(x1) * x2, params["w_down"])[0]
    return jnp.einsum("te,etd->td", _gate(params, x), out)


def test_gemma_s_broadcast_tokens_and_fused_weight_together():
    assert rewritten_exactly(_gemma, *_args(5))


@pytest.mark.parametrize("take_apart", [
    lambda h: tuple(jax.nn.gelu(h)),
    lambda h: (h.sum(0), h[1]),
], ids=["activation-on-both-parts", "parts-summed"])
def test_fused_parts_read_before_they_are_taken_apart_decline(take_apart):
    declined_because(_fused_layer(take_apart), *_args(6), "takes one part at a time")


def test_fused_parts_out_of_expert_order_decline_or_stay_exact():
    rewritten_exactly(_fused_layer(lambda h: (h[0], h[1][::-1])), *_args(6))


def test_a_fused_product_taken_apart_along_the_experts_declines_or_stays_exact():
    """``h[:, e]``: expert ``e``'s rows of both parts (a loop over the experts), not one part of every expert."""

    def layer(params, x):
        h, gate, out = jnp.einsum("td,ekfd->ketf", x, params["gating"]), _gate(params, x), 0.0
        for e in range(E):
            both = h[:, e]
            out = out + gate[:, e:e + 1] * ((jax.nn.gelu(both[0]) * both[1]) @ params["w_down"][e])
        return out

    rewritten_exactly(layer, *_args(7))


def _step(layer):
    def step(params, x):
        return jax.value_and_grad(lambda p, x: jnp.mean(jnp.sin(layer(p, x)) ** 2), argnums=(0, 1))(params, x)

    return step


def test_a_training_step_is_rewritten_forward_and_backward():
    params, x = _args(8)
    step = _step(_gemma)
    report = explain(step, params, x)
    assert len(report.regions) == 1 and report.regions[0].backward, str(report)
    got, expected = jax.jit(moe_optimize(step, strict=True))(params, x), jax.jit(step)(params, x)
    for path, want, have in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(expected),
                                jax.tree.leaves(got)):
        scale = max(float(np.max(np.abs(want))), 1e-30)
        assert float(np.max(np.abs(np.asarray(want) - np.asarray(have)))) <= 1e-5 * scale, jax.tree_util.keystr(path[0])
    dense = f"{E},{T},{F}]"  # the experts' hidden activations [(1,) E, T, F], or their cotangents
    assert dense in str(jax.make_jaxpr(step)(params, x))
    assert dense not in str(jax.make_jaxpr(moe_optimize(step, strict=True))(params, x))
