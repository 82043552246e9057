"""The Triton ``swiglu_rows`` kernels on a CUDA GPU against the jnp reference, on the counted rows.

Skipped without a GPU or jax_triton. Feature counts that are not a multiple of the column block,
row counts that end inside a row block, none, all and past the buffer; forward and gradient.
"""

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

from moe_lowering.kernels.swiglu_rows import triton_launch as triton_swiglu_rows  # noqa: E402
from moe_lowering.kernels.swiglu_rows import swiglu_rows_grads_reference, swiglu_rows_reference  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = {jnp.float32: 2e-6, jnp.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows, features, counted", [(1000, 1500, 677), (64, 2048, 0), (333, 96, 333),
                                                     (40, 3000, 10_000)])
def test_kernels_match_the_reference_on_the_counted_rows(dtype, rows, features, counted):
    rng = np.random.default_rng(rows + features)
    gate, up, d_out = (jnp.asarray(3 * rng.standard_normal((rows, features)), dtype) for _ in range(3))
    num_rows = jnp.int32(counted)
    got = jax.jit(triton_swiglu_rows.swiglu_rows)(gate, up, num_rows)
    got_grads = jax.jit(triton_swiglu_rows.swiglu_rows_grads)(d_out, gate, up, num_rows)
    want = swiglu_rows_reference(gate, up, num_rows)
    want_grads = swiglu_rows_grads_reference(d_out, gate, up, num_rows)
    counted_rows = slice(0, min(counted, rows))
    for a, b in zip((got, *got_grads), (want, *want_grads)):
        assert a.dtype == dtype
        np.testing.assert_allclose(np.float32(a[counted_rows]), np.float32(b[counted_rows]),
                                   rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
