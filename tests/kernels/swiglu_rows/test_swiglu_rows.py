"""``swiglu_rows`` (the SwiGLU activation on a buffer's leading rows): reference and ``custom_vjp``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
def test_custom_vjp_matches_autodiff_on_the_counted_rows(dtype, tol):
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
