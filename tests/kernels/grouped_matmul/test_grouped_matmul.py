"""The XLA grouped products (the CPU path and reference) against an obviously-correct version."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_lowering.kernels import get_backend, sequential_under_vmap
from moe_lowering.kernels.grouped_matmul import gmm, gmm_dense_reference, tgmm

SIZES = [
    ("empty groups", [0, 37, 0, 90, 3, 0], 130),
    ("one group takes all", [0, 0, 128, 0], 128),
    ("rows past the groups", [5, 7, 11], 50),
    ("single row", [1], 1),
]


def _tgmm_reference(lhs, grad, group_sizes):
    ends = np.cumsum(group_sizes)
    return np.stack([np.asarray(lhs[e - g:e], np.float64).T @ np.asarray(grad[e - g:e], np.float64)
                     for g, e in zip(group_sizes, ends)])


@pytest.mark.parametrize("case,group_sizes,rows", SIZES)
@pytest.mark.parametrize("tile_rows", [8, 32, 128])
def test_gmm_and_tgmm_match_reference(case, group_sizes, rows, tile_rows):
    keys = jax.random.split(jax.random.key(len(case) + tile_rows), 3)
    k, n, g = 24, 20, len(group_sizes)
    lhs = jax.random.normal(keys[0], (rows, k))
    rhs = jax.random.normal(keys[1], (g, k, n))
    grad = jax.random.normal(keys[2], (rows, n))
    sizes = jnp.asarray(group_sizes, jnp.int32)
    np.testing.assert_allclose(gmm(lhs, rhs, sizes, tile_rows=tile_rows), gmm_dense_reference(lhs, rhs, sizes),
                               rtol=1e-5, atol=1e-5)
    transposed = jnp.swapaxes(rhs, 1, 2)
    np.testing.assert_allclose(gmm(lhs, transposed, sizes, transpose_rhs=True, tile_rows=tile_rows),
                               gmm_dense_reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tgmm(lhs, grad, sizes, tile_rows=tile_rows), _tgmm_reference(lhs, grad, group_sizes),
                               rtol=1e-4, atol=1e-4)


def test_group_offset_computes_only_local_groups():
    sizes = jnp.asarray([10, 0, 25, 7, 30], jnp.int32)
    lhs = jax.random.normal(jax.random.key(0), (80, 16))
    rhs = jax.random.normal(jax.random.key(1), (5, 16, 12))
    local = gmm(lhs, rhs[1:4], sizes, group_offset=1, tile_rows=16)
    np.testing.assert_allclose(local, gmm_dense_reference(lhs, rhs[1:4], sizes, group_offset=1), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(local[:10]) == 0) and np.all(np.asarray(local[42:]) == 0)


def test_group_sizes_are_traced_not_synced():
    lhs = jax.random.normal(jax.random.key(2), (40, 8))
    rhs = jax.random.normal(jax.random.key(3), (3, 8, 4))
    sizes = jnp.asarray([13, 0, 20], jnp.int32)
    jitted = jax.jit(lambda l, r, s: gmm(l, r, s, tile_rows=8))
    np.testing.assert_allclose(jitted(lhs, rhs, sizes), gmm_dense_reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)


def test_sequential_under_vmap_batches_a_kernel_without_a_rule():
    sequential = sequential_under_vmap(gmm)
    lhs = jax.random.normal(jax.random.key(4), (3, 30, 8))
    rhs = jax.random.normal(jax.random.key(5), (2, 8, 5))
    sizes = jnp.asarray([[10, 20], [0, 30], [25, 0]], jnp.int32)
    got = jax.vmap(lambda l, s: sequential(l, rhs, s, tile_rows=8))(lhs, sizes)
    for i in range(3):
        np.testing.assert_allclose(got[i], gmm_dense_reference(lhs[i], rhs, sizes[i]), rtol=1e-5, atol=1e-5)


def test_backend_names():
    assert get_backend("xla").name == "xla"
    assert get_backend("auto").name in ("xla", "triton")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        get_backend("tpu")
