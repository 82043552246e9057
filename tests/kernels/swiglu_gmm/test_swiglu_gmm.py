"""The jnp SwiGLU up-projection (CPU path and reference) against float64 numpy, at odd sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_lowering.kernels import get_backend
from moe_lowering.kernels.swiglu_gmm import swiglu_gmm_reference, swiglu_grads

# (group sizes, rows, group_offset, local groups)
CASES = {
    "empty-groups": ([0, 37, 0, 90, 3, 0], 130, 0, 6),
    "one-group-takes-all": ([0, 0, 77, 0], 77, 0, 4),
    "rows-past-the-groups": ([5, 7, 11], 50, 0, 3),
    "group-offset-window": ([6, 13, 2, 9, 8], 38, 1, 3),
    "single-row": ([1], 1, 0, 1),
}


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _products(lhs, weights, group_sizes, group_offset):
    lhs, weights = np.asarray(lhs, np.float64), np.asarray(weights, np.float64)
    ends = np.cumsum(group_sizes)
    out = np.zeros((lhs.shape[0], weights.shape[2]))
    for local in range(weights.shape[0]):
        end = ends[local + group_offset]
        start = end - group_sizes[local + group_offset]
        out[start:min(end, lhs.shape[0])] = lhs[start:end] @ weights[local]
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_numpy(case):
    group_sizes, rows, offset, num_local = CASES[case]
    keys = jax.random.split(jax.random.key(len(case)), 3)
    k, n = 19, 23
    lhs = jax.random.normal(keys[0], (rows, k))
    gate = jax.random.normal(keys[1], (num_local, k, n))
    up = jax.random.normal(keys[2], (num_local, k, n))
    sizes = jnp.asarray(group_sizes, jnp.int32)
    out, gate_out, up_out = swiglu_gmm_reference(lhs, gate, up, sizes, group_offset=offset, with_preactivations=True)
    g = _products(lhs, gate, group_sizes, offset)
    u = _products(lhs, up, group_sizes, offset)
    np.testing.assert_allclose(out, _silu(g) * u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gate_out, g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(up_out, u, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(swiglu_gmm_reference(lhs, gate, up, sizes, group_offset=offset), out)


def test_bf16_output_is_rounded_once_from_float32():
    keys = jax.random.split(jax.random.key(5), 3)
    lhs = jax.random.normal(keys[0], (40, 16)).astype(jnp.bfloat16)
    gate, up = (jax.random.normal(key, (2, 16, 12)).astype(jnp.bfloat16) for key in keys[1:])
    sizes = jnp.asarray([25, 15], jnp.int32)
    out = swiglu_gmm_reference(lhs, gate, up, sizes)
    assert out.dtype == jnp.bfloat16
    g = _products(lhs.astype(jnp.float32), gate.astype(jnp.float32), [25, 15], 0)
    u = _products(lhs.astype(jnp.float32), up.astype(jnp.float32), [25, 15], 0)
    expected = jnp.asarray(_silu(g) * u, jnp.float32).astype(jnp.bfloat16)
    np.testing.assert_allclose(out.astype(jnp.float32), expected.astype(jnp.float32), rtol=1e-2, atol=1e-2)


def test_swiglu_grads_match_autodiff():
    keys = jax.random.split(jax.random.key(6), 3)
    gate, up, d_out = (jax.random.normal(key, (30, 7)) * 3 for key in keys)
    _, vjp = jax.vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)
    for got, want in zip(swiglu_grads(d_out, gate, up), vjp(d_out)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shapes,message", [
    (((8, 4), (2, 4, 3), (2, 4, 5)), "differ in shape"),
    (((8, 4), (2, 6, 3), (2, 6, 3)), "contraction sizes differ"),
    (((8,), (2, 4, 3), (2, 4, 3)), "expected lhs"),
])
def test_bad_operands_raise_clear_errors(shapes, message):
    lhs, gate, up = (jnp.ones(shape) for shape in shapes)
    with pytest.raises(ValueError, match=message):
        swiglu_gmm_reference(lhs, gate, up, jnp.asarray([4, 4], jnp.int32))


def test_xla_backend_offers_the_reference():
    assert get_backend("xla").swiglu_gmm is swiglu_gmm_reference
