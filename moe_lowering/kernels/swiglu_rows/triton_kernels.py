"""The Triton kernels of ``swiglu_rows`` (wrapped as XLA custom calls in :mod:`.triton_launch`).

Both load ``num_rows`` on the device and loop, as persistent programs, over the tiles of those
rows only; rows from ``num_rows`` on are left unwritten. Activation and gradient in float32.
"""

import triton
import triton.language as tl


@triton.jit
def _row_tile(tile, num_rows, N: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Element offsets and mask of ``tile``, counted row block by row block."""
    col_blocks = tl.cdiv(N, BLOCK_COLS)
    rows = (tile // col_blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = (tile % col_blocks) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    return offsets, (rows < num_rows)[:, None] & (cols < N)[None, :]


@triton.jit
def _num_tiles(num_rows_ptr, M: tl.constexpr, N: tl.constexpr, BLOCK_ROWS: tl.constexpr,
               BLOCK_COLS: tl.constexpr):
    num_rows = tl.minimum(tl.maximum(tl.load(num_rows_ptr), 0), M)
    return num_rows, tl.cdiv(num_rows, BLOCK_ROWS) * tl.cdiv(N, BLOCK_COLS)


@triton.jit
def swiglu_rows_kernel(gate_ptr, up_ptr, num_rows_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr,
                       BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """``out = silu(gate) * up`` in float32 on the first ``num_rows`` rows."""
    num_rows, num_tiles = _num_tiles(num_rows_ptr, M, N, BLOCK_ROWS, BLOCK_COLS)
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        offsets, mask = _row_tile(tile, num_rows, N, BLOCK_ROWS, BLOCK_COLS)
        gate = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
        up = tl.load(up_ptr + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offsets, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_rows_grads_kernel(d_out_ptr, gate_ptr, up_ptr, num_rows_ptr, d_gate_ptr, d_up_ptr, M: tl.constexpr,
                             N: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                             NUM_PROGRAMS: tl.constexpr):
    """``d_gate``, ``d_up`` of ``silu(gate) * up`` in float32 on the first ``num_rows`` rows."""
    num_rows, num_tiles = _num_tiles(num_rows_ptr, M, N, BLOCK_ROWS, BLOCK_COLS)
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        offsets, mask = _row_tile(tile, num_rows, N, BLOCK_ROWS, BLOCK_COLS)
        d_out = tl.load(d_out_ptr + offsets, mask=mask).to(tl.float32)
        gate = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
        up = tl.load(up_ptr + offsets, mask=mask).to(tl.float32)
        sigmoid = tl.sigmoid(gate)
        tl.store(d_up_ptr + offsets, (d_out * gate * sigmoid).to(d_up_ptr.dtype.element_ty), mask=mask)
        d_gate = d_out * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))
        tl.store(d_gate_ptr + offsets, d_gate.to(d_gate_ptr.dtype.element_ty), mask=mask)
