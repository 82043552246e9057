"""The row-gather Triton kernels (only ``triton`` imported: they also run under the interpreter)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_rows_kernel(src_ptr, index_ptr, scale_ptr, out_ptr, R: tl.constexpr, D: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SCALE: tl.constexpr):
    """``out[r] = src[index[r]] (* scale[r])`` for the ``BLOCK_R`` rows of this program, ``BLOCK_D``
    columns at a time (the scale multiplies in float32)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    source = tl.load(index_ptr + rows, mask=row_ok, other=0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    src_rows = src_ptr + tl.cast(source, tl.int64)[:, None] * D
    out_rows = out_ptr + tl.cast(rows, tl.int64)[:, None] * D
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (cols < D)[None, :]
        values = tl.load(src_rows + cols[None, :], mask=mask, other=0.0)
        if HAS_SCALE:
            values = values.to(tl.float32) * scale[:, None]
        tl.store(out_rows + cols[None, :], values.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sum_rows_kernel(src_ptr, index_ptr, out_ptr, T: tl.constexpr, K: tl.constexpr, D: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[t] = sum_j src[index[t, j]]`` for the ``BLOCK_T`` outputs of this program, ``BLOCK_D``
    columns at a time, added in float32 in the order ``j = 0, 1, ...``."""
    outs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    out_ok = outs < T
    out_rows = out_ptr + tl.cast(outs, tl.int64)[:, None] * D
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = out_ok[:, None] & (cols < D)[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
        for j in tl.static_range(K):
            source = tl.load(index_ptr + tl.cast(outs, tl.int64) * K + j, mask=out_ok, other=0)
            src_rows = src_ptr + tl.cast(source, tl.int64)[:, None] * D
            acc += tl.load(src_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_rows + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
