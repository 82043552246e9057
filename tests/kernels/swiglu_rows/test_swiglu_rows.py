"""``swiglu_rows`` (the SwiGLU activation on a buffer's leading rows): the reference, and the
primitive's derivatives of every order against autodiff of the unfused activation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_lowering import primitives
from moe_lowering.kernels import get_backend
from moe_lowering.kernels.swiglu_rows import swiglu_rows_grads_reference, swiglu_rows_reference
from moe_lowering.sparse_moe import swiglu_rows


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _operands(seed, shape=(37, 19), dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    gate, up, d_out = (jnp.asarray(3 * rng.standard_normal(shape), dtype) for _ in range(3))
    return gate, up, d_out


def test_reference_matches_numpy():
    gate, up, _ = _operands(0)
    got = swiglu_rows_reference(gate, up, jnp.int32(20))
    want = _silu(np.float64(gate)) * np.float64(up)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_vjp_matches_autodiff_on_the_counted_rows(dtype, tol):
    gate, up, d_out = _operands(1, dtype=dtype)
    num_rows = 23

    def unfused(g, u):
        return (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(dtype)

    out, vjp = jax.vjp(lambda g, u: swiglu_rows(g, u, jnp.int32(num_rows), "xla"), gate, up)
    want_out, want_vjp = jax.vjp(unfused, gate, up)
    rows = slice(0, num_rows)
    for got, want in zip((out, *vjp(d_out)), (want_out, *want_vjp(d_out))):
        assert got.dtype == dtype
        np.testing.assert_allclose(np.float32(got[rows]), np.float32(want[rows]), rtol=tol, atol=tol)


def test_grads_reference_matches_numpy():
    gate, up, d_out = _operands(2)
    d_gate, d_up = swiglu_rows_grads_reference(d_out, gate, up, jnp.int32(5))
    g, u, d = (np.float64(a) for a in (gate, up, d_out))
    s = 1.0 / (1.0 + np.exp(-g))
    np.testing.assert_allclose(np.asarray(d_up), d * g * s, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(d_gate), d * u * s * (1 + g * (1 - s)), rtol=2e-5, atol=2e-5)


def test_mismatched_operands_are_named():
    gate, up, _ = _operands(3)
    with pytest.raises(ValueError, match="swiglu_rows: expected gate and up of one"):
        swiglu_rows_reference(gate, up[:, :5], jnp.int32(3))


def _tail_poisoning_backend():
    """The XLA backend with row kernels that write NaN past ``num_rows``, where the contract leaves
    rows unspecified (as the Triton kernels leave them unwritten): a derivative that read them shows."""
    import dataclasses

    def poisoned(kernel):
        def run(*operands):
            *_, gate, _, num_rows = operands
            tail = (jnp.arange(gate.shape[0]) >= num_rows)[:, None]
            return jax.tree.map(lambda out: jnp.where(tail, jnp.nan, out), kernel(*operands))

        return run

    return dataclasses.replace(get_backend("xla"), name="xla-poisoned-tails",
                               swiglu_rows=poisoned(swiglu_rows_reference),
                               swiglu_rows_grads=poisoned(swiglu_rows_grads_reference))


def _backend(name):
    if name == "triton":
        from moe_lowering.kernels import BackendUnavailable

        try:
            return get_backend("triton")
        except BackendUnavailable as err:
            pytest.skip(f"Triton backend unavailable: {err}")
    return _tail_poisoning_backend()


@pytest.mark.parametrize("backend", ["poisoned tails", pytest.param("triton", marks=pytest.mark.gpu)])
def test_every_derivative_order_matches_autodiff_on_the_counted_rows(backend):
    """Forward mode, reverse mode (on the backend's ``swiglu_rows_grads``), Hessian-vector products
    forward over reverse and reverse over reverse, ``jacfwd`` of ``jacfwd`` and ``vmap`` of a
    Hessian-vector product, against the unfused activation: the expert-parallel layer's SwiGLU is
    this primitive, so its Hessian-vector products rest on these (issue 38)."""
    gate, up, _ = _operands(4, shape=(9, 5))
    num_rows = 6
    kernels = _backend(backend)
    weights = jnp.cos(jnp.arange(num_rows * 5, dtype=jnp.float32)).reshape(num_rows, 5)

    def loss(activation):
        return lambda g, u: jnp.sum(jnp.sin(activation(g, u)[:num_rows]) * weights)

    rows_loss = loss(lambda g, u: primitives.swiglu_rows(g, u, num_rows, kernels))
    unfused_loss = loss(lambda g, u: jax.nn.silu(g) * u)
    operands, tangents = (gate, up), (jnp.sin(up), jnp.cos(gate))

    def derivatives(f):
        grad = jax.grad(f, argnums=(0, 1))
        hvp = lambda g, u: jax.jvp(grad, (g, u), tangents)[1]  # noqa: E731
        reverse_hvp = jax.grad(lambda g, u: sum(jnp.vdot(d, t) for d, t in zip(grad(g, u), tangents)), argnums=(0, 1))
        second = jax.jacfwd(jax.jacfwd(f, argnums=(0, 1)), argnums=(0, 1))(gate, up)  # leaves [M, N, M, N]
        return {"loss": f(*operands), "grad": grad(*operands), "jvp": jax.jvp(f, operands, tangents)[1],
                "hvp": hvp(*operands), "reverse hvp": reverse_hvp(*operands),
                "jacfwd of jacfwd": jax.tree.map(lambda h: h[:num_rows, :, :num_rows], second),
                "vmap of hvp": jax.vmap(hvp)(jnp.stack([gate, -gate]), jnp.stack([up, 2 * up]))}

    got, want = jax.jit(lambda: derivatives(rows_loss))(), derivatives(unfused_loss)
    for name in want:
        for g, w in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name])):
            rows = (slice(None), slice(0, num_rows)) if name == "vmap of hvp" else slice(0, num_rows)
            if np.ndim(w):
                g, w = g[rows], w[rows]
            g, w = np.float64(g), np.float64(w)
            assert np.all(np.isfinite(g)), name
            assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w), name


def test_reverse_mode_runs_the_row_kernels_only():
    """The gradient transposes the tangent into ``swiglu_rows_grads`` (the backend's row kernel,
    as the former ``custom_vjp`` backward ran it): no forward-mode tangent is left in it."""
    gate, up, d_out = _operands(5, shape=(9, 5))
    grad = jax.grad(lambda g, u: jnp.vdot(swiglu_rows(g, u, jnp.int32(6), "xla"), d_out), argnums=(0, 1))
    jaxpr = str(jax.make_jaxpr(grad)(gate, up))
    assert "moe_swiglu_rows_grads" in jaxpr and "moe_swiglu_rows_tangent" not in jaxpr
