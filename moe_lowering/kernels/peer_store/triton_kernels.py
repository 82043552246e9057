"""The Triton kernel of ``peer_store.expand_rows`` (called from :mod:`.triton_launch`): a
receiver's tokens expanded into its sorted rows. Only ``triton`` is imported here, so Triton's
interpreter can run it on a CPU.
"""

import triton
import triton.language as tl


@triton.jit
def expand_rows_kernel(table_ptr, index_ptr, num_rows_ptr, out_ptr, NUM_ROWS: tl.constexpr,
                       TABLE_ROWS: tl.constexpr, D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                       NUM_PROGRAMS: tl.constexpr, ZERO_TAIL: tl.constexpr):
    """``out[i] = table[index[i]]`` for ``i < num_rows``; zeros after them with ``ZERO_TAIL``, else
    those rows are not touched (persistent programs over the row tiles that count)."""
    num_rows = tl.minimum(tl.maximum(tl.load(num_rows_ptr), 0), NUM_ROWS)
    if ZERO_TAIL:
        last_tile = tl.cdiv(NUM_ROWS, BLOCK_ROWS)
    else:
        last_tile = tl.cdiv(num_rows, BLOCK_ROWS)
    in_rows = tl.arange(0, BLOCK_ROWS)
    in_d = tl.arange(0, BLOCK_D)
    for tile in range(tl.program_id(0), last_tile, NUM_PROGRAMS):
        rows = tile * BLOCK_ROWS + in_rows
        arrived = rows < num_rows
        source = tl.load(index_ptr + rows, mask=arrived, other=0)
        source = tl.minimum(tl.maximum(source, 0), TABLE_ROWS - 1).to(tl.int64)
        offsets = rows.to(tl.int64)[:, None] * D
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + in_d
            in_cols = (cols < D)[None, :]
            values = tl.load(table_ptr + source[:, None] * D + cols[None, :], mask=arrived[:, None] & in_cols, other=0)
            tl.store(out_ptr + offsets + cols[None, :], values, mask=(rows < NUM_ROWS)[:, None] & in_cols)
