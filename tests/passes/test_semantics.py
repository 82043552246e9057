"""Rewrites that must keep the reference's semantics in corner cases, or step aside at run time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_lowering import explain, moe_optimize

T, D, F, E = 32, 8, 16, 4


def _params(key):
    k = jax.random.split(key, 4)
    return {
        "router": jax.random.normal(k[0], (D, E)),
        "w_up": jax.random.normal(k[1], (E, D, F)) / np.sqrt(D),
        "w_down": jax.random.normal(k[2], (E, F, D)) / np.sqrt(F),
        "expert_scale": jax.random.uniform(k[3], (E,), minval=0.5, maxval=1.5),
    }


def _switch_like(params, x, threshold):
    """Top-1 capacity routing whose dispatch also sends tokens to every expert scoring over ``threshold``."""
    capacity = T // 2
    probs = jax.nn.softmax(x @ params["router"], axis=-1)
    choice = jnp.argmax(probs, axis=-1)
    mask = jnp.maximum(jax.nn.one_hot(choice, E, dtype=jnp.int32), (probs > threshold).astype(jnp.int32))
    position = jnp.cumsum(mask, axis=0) * mask - 1
    mask = mask * (position < capacity)
    dispatch = jax.nn.one_hot(position, capacity) * mask[..., None]
    combine = dispatch * probs[..., None]
    hidden = jax.nn.relu(jnp.einsum("ecd,edf->ecf", jnp.einsum("tec,td->ecd", dispatch, x), params["w_up"]))
    return jnp.einsum("tec,ecd->td", combine, jnp.einsum("ecf,efd->ecd", hidden, params["w_down"]))


def test_capacity_dispatch_with_more_experts_than_routed_falls_back_to_dense():
    params = _params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (T, D))
    for threshold in (1.1, 0.2):  # 1.1: exactly top-1 (sparse path); 0.2: several experts per token (fallback)
        fn = lambda p, x: _switch_like(p, x, threshold)  # noqa: E731
        assert len(explain(fn, params, x).regions) == 1
        expected = fn(params, x)
        got = jax.jit(moe_optimize(fn, strict=True))(params, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_per_expert_scale_in_the_gate():
    """Routing weights that include a per-expert factor ``scale[e]`` (indexed by expert only)."""

    def scaled(params, x):
        weights, idx = jax.lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        gate = (jax.nn.one_hot(idx, E) * weights[..., None]).sum(1) * params["expert_scale"]
        hidden = jax.nn.gelu(jnp.einsum("td,edf->tef", x, params["w_up"]))
        return jnp.einsum("te,ted->td", gate, jnp.einsum("tef,efd->ted", hidden, params["w_down"]))

    params = _params(jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (T, D))
    got = jax.jit(moe_optimize(scaled, strict=True))(params, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(scaled(params, x)), rtol=1e-5, atol=1e-6)
    g_ref = jax.grad(lambda p: jnp.sum(scaled(p, x) ** 2))(params)
    g_new = jax.grad(lambda p: jnp.sum(moe_optimize(scaled)(p, x) ** 2))(params)
    for name in params:
        np.testing.assert_allclose(np.asarray(g_new[name]), np.asarray(g_ref[name]), rtol=1e-4, atol=1e-5)


def test_argsort_routing_is_an_anchor():
    """``argsort(scores)[..., -k:]`` and ``argsort(-scores)[..., :k]`` route like ``top_k``."""

    def argsort_moe(params, x, descending):
        probs = jax.nn.softmax(x @ params["router"])
        idx = jnp.argsort(-probs, axis=-1)[..., :2] if descending else jnp.argsort(probs, axis=-1)[..., -2:]
        weights = jnp.take_along_axis(probs, idx, axis=-1)
        gate = (jax.nn.one_hot(idx, E) * weights[..., None]).sum(1)
        hidden = jax.nn.silu(jnp.einsum("td,edf->tef", x, params["w_up"]))
        return jnp.einsum("te,ted->td", gate, jnp.einsum("tef,efd->ted", hidden, params["w_down"]))

    params = _params(jax.random.key(4))
    x = jax.random.normal(jax.random.key(5), (T, D))
    for descending in (False, True):
        fn = lambda p, x: argsort_moe(p, x, descending)  # noqa: E731
        report = explain(fn, params, x)
        assert [r.top_k for r in report.regions] == [2]
        got = jax.jit(moe_optimize(fn, strict=True))(params, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(fn(params, x)), rtol=1e-5, atol=1e-6)


def test_gate_renormalised_after_masking():
    """``gates = one_hot(idx) * probs[:, None]...``, then divided by their sum: weights read per choice."""

    def renormalised(params, x):
        probs = jax.nn.softmax(x @ params["router"])
        _, idx = jax.lax.top_k(probs, 2)
        gates = (jax.nn.one_hot(idx, E) * jnp.take_along_axis(probs, idx, -1)[..., None]).sum(1)
        gates = gates / jnp.take_along_axis(probs, idx, -1).sum(-1, keepdims=True)
        hidden = jax.nn.relu(jnp.einsum("td,edf->tef", x, params["w_up"]))
        return jnp.einsum("te,ted->td", gates, jnp.einsum("tef,efd->ted", hidden, params["w_down"]))

    params = _params(jax.random.key(6))
    x = jax.random.normal(jax.random.key(7), (T, D))
    got = jax.jit(moe_optimize(renormalised, strict=True))(params, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(renormalised(params, x)), rtol=1e-5, atol=1e-6)
    g_ref = jax.grad(lambda p: jnp.sum(renormalised(p, x) ** 2))(params)
    g_new = jax.grad(lambda p: jnp.sum(moe_optimize(renormalised)(p, x) ** 2))(params)
    np.testing.assert_allclose(np.asarray(g_new["router"]), np.asarray(g_ref["router"]), rtol=1e-4, atol=1e-6)
