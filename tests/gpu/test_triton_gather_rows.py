"""The Triton row gather on a CUDA GPU: ``permute`` and ``spread`` lowered to it give exactly what
XLA's gather gives (the sparse MoE's forward; its gradients to rounding), and the launcher against
the reference."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from moe_lowering.kernels import BackendUnavailable, get_backend

try:
    get_backend("triton")
except BackendUnavailable as err:
    pytest.skip(f"Triton backend unavailable: {err}", allow_module_level=True)

from moe_lowering import primitives, sparse_moe  # noqa: E402
from moe_lowering.kernels.gather_rows import gather_rows_reference  # noqa: E402
from moe_lowering.kernels.gather_rows.triton_launch import gather_rows  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows, d", [(1000, 200), (7, 768), (0, 64)])
def test_gather_rows_matches_reference(rows, d, dtype):
    keys = jax.random.split(jax.random.key(rows + d), 3)
    src = jax.random.normal(keys[0], (300, d)).astype(dtype)
    index = jax.random.randint(keys[1], (rows,), 0, 300)
    scale = jax.random.normal(keys[2], (rows,))
    jnp.full((rows, d), jnp.nan, dtype).block_until_ready()  # poison: unwritten rows would show
    np.testing.assert_array_equal(jax.jit(gather_rows)(src, index), gather_rows_reference(src, index))
    got = jax.jit(gather_rows, static_argnums=3)(src, index, scale, jnp.bfloat16)
    np.testing.assert_array_equal(got, gather_rows_reference(src, index, scale, jnp.bfloat16))


def test_layer_with_the_row_gather_equals_xla_gather(monkeypatch):
    """``sparse_moe`` compiled with and without the Triton row gather (``permute`` forward, ``spread``
    backward, some copies dropped): the same forward bit for bit (the gather is exact), gradients to
    bf16 rounding (XLA may fuse the code around it differently)."""
    keys = jax.random.split(jax.random.key(0), 6)
    t, d, f, e, k = 300, 192, 96, 8, 2
    tokens = jax.random.normal(keys[0], (t, d)).astype(jnp.bfloat16)
    idx = jax.random.randint(keys[1], (t, k), 0, e + 1)  # e: a dropped copy
    weights = jax.nn.softmax(jax.random.normal(keys[2], (t, k)))
    params = [jax.random.normal(key, (e, d, f)).astype(jnp.bfloat16) * 0.1 for key in keys[3:5]]
    w_down = jax.random.normal(keys[5], (e, f, d)).astype(jnp.bfloat16) * 0.1

    def loss(tokens, weights, w_up, w_down):
        rows = sparse_moe.permute(tokens, routing)
        hidden = jax.nn.relu(sparse_moe.grouped_matmul(rows, w_up, routing.group_sizes))
        out = sparse_moe.grouped_matmul(hidden, w_down, routing.group_sizes)
        return jnp.sum(jnp.sin(sparse_moe.combine(out, weights, routing).astype(jnp.float32)))

    routing = sparse_moe.sort_by_expert(idx, e)
    results, kernel_calls = {}, {}
    for flag in (False, True):
        monkeypatch.setattr(primitives, "GPU_ROW_GATHER", flag)
        fn = jax.jit(jax.value_and_grad(lambda *a: loss(*a), argnums=(0, 1, 2, 3)))
        kernel_calls[flag] = fn.lower(tokens, weights, params[0], w_down).as_text().count("triton_kernel_call")
        results[flag] = fn(tokens, weights, params[0], w_down)
    assert kernel_calls[True] == kernel_calls[False] + 2, kernel_calls  # the permute and the spread
    np.testing.assert_array_equal(results[True][0], results[False][0])
    for got, want in zip(jax.tree_util.tree_leaves(results[True][1]), jax.tree_util.tree_leaves(results[False][1])):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
