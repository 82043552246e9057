"""``swiglu_rows`` and its gradient on a CUDA GPU: Triton kernels as XLA custom calls.

Contract and CPU path: :mod:`.reference`; kernels: :mod:`.triton_kernels`, which touch
only the first ``num_rows`` rows, so a receive buffer sized for the worst case costs what arrived.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax_triton
import triton

from moe_lowering.kernels.swiglu_rows.reference import check_swiglu_rows_operands
from moe_lowering.kernels.swiglu_rows.triton_kernels import swiglu_rows_grads_kernel, swiglu_rows_kernel

# Launch shape from benchmarks/swiglu_rows_sweep.py (H200, the EP layers' received rows): sixteen
# programs per multiprocessor (more than fit at once: eight of 8 warps fill one) over 4 x 1024
# tiles ran the forward 16-23% and the gradient 5-25% faster than four of 4 warps over 8 x 1024
# (Mixtral EP=4: 106 vs 137 us; XLA's fusion over the same rows 96 us). Tiles of 16 rows spill
# the gradient kernel's registers (10x slower).
NUM_PROGRAMS = 16 * 132
BLOCK_ROWS = 4
MAX_BLOCK_COLS = 1024
NUM_WARPS = 8


def _launch_options(gate):
    m, n = gate.shape
    return dict(grid=(NUM_PROGRAMS,), num_warps=NUM_WARPS, M=m, N=n, BLOCK_ROWS=BLOCK_ROWS,
                BLOCK_COLS=min(MAX_BLOCK_COLS, triton.next_power_of_2(n)), NUM_PROGRAMS=NUM_PROGRAMS)


def _num_rows_operand(num_rows):
    return jnp.reshape(num_rows, (1,)).astype(jnp.int32)


def swiglu_rows(gate, up, num_rows):
    """See :mod:`.reference`."""
    check_swiglu_rows_operands(gate, up, "swiglu_rows")
    if gate.size == 0:
        return jnp.zeros_like(gate)
    return jax_triton.triton_call(
        gate, up, _num_rows_operand(num_rows), kernel=swiglu_rows_kernel,
        out_shape=jax.ShapeDtypeStruct(gate.shape, gate.dtype), **_launch_options(gate),
    )


def swiglu_rows_grads(d_out, gate, up, num_rows):
    """``(d_gate, d_up)``; see :mod:`.reference`."""
    check_swiglu_rows_operands(gate, up, "swiglu_rows_grads")
    if gate.size == 0:
        return jnp.zeros_like(gate), jnp.zeros_like(up)
    return jax_triton.triton_call(
        d_out, gate, up, _num_rows_operand(num_rows), kernel=swiglu_rows_grads_kernel,
        out_shape=(jax.ShapeDtypeStruct(gate.shape, gate.dtype), jax.ShapeDtypeStruct(up.shape, up.dtype)),
        **_launch_options(gate),
    )
