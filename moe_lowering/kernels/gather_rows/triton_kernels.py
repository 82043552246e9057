"""The row-gather Triton kernel (only ``triton`` imported: it also runs under the interpreter)."""

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
