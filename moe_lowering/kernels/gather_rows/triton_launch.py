"""``gather_rows`` on a CUDA GPU: :mod:`.triton_kernels` as an XLA custom call (contract: :mod:`.reference`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax_triton

from moe_lowering.kernels.gather_rows import reference
from moe_lowering.kernels.gather_rows.triton_kernels import gather_rows_kernel

_DTYPES = {jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32)}
BLOCK_R = 16


def gather_rows(src, index, scale=None, out_dtype=None):
    """``out[r] = src[index[r]]`` (times ``scale[r]``), ``[R, D]`` rows of ``src [S, D]``."""
    out_dtype = jnp.dtype(out_dtype or src.dtype)
    num_rows, d = index.shape[0], src.shape[1]
    dtypes = {jnp.dtype(src.dtype), out_dtype} | ({jnp.dtype(scale.dtype)} if scale is not None else set())
    if num_rows == 0 or d == 0 or src.shape[0] == 0:
        return jnp.zeros((num_rows, d), out_dtype)
    if src.ndim != 2 or index.ndim != 1 or not dtypes <= _DTYPES:
        return reference.gather_rows_reference(src, index, scale, out_dtype)
    block_d = min(256, 1 << max(0, (d - 1).bit_length()))
    operands = (src, index.astype(jnp.int32), scale if scale is not None else jnp.zeros((1,), jnp.float32))
    return jax_triton.triton_call(
        *operands,
        kernel=gather_rows_kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, d), out_dtype),
        grid=(-(-num_rows // BLOCK_R),),
        num_warps=4,
        num_stages=1,
        R=num_rows,
        D=d,
        BLOCK_R=BLOCK_R,
        BLOCK_D=block_d,
        HAS_SCALE=scale is not None,
    )
