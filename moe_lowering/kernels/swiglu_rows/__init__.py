"""SwiGLU's elementwise part on the leading rows of a buffer: ``silu(gate) * up`` on rows ``< num_rows``.

For expert-parallel receive buffers sized for the worst case, whose tail nothing reads: the GPU
kernels read ``num_rows`` on the device and touch only those rows.

* :mod:`.reference`: the contract and the jnp version (the CPU path), which computes every row;
* :mod:`.triton_kernels`: the forward and gradient Triton kernels;
* :mod:`.triton_launch`: those kernels as XLA custom calls and their launch shape; needs
  ``triton`` and ``jax_triton`` (the Triton backend's ``swiglu_rows`` / ``swiglu_rows_grads``).
"""

from moe_lowering.kernels.swiglu_rows.reference import (
    check_swiglu_rows_operands,
    swiglu_rows_grads_reference,
    swiglu_rows_reference,
)

__all__ = ["check_swiglu_rows_operands", "swiglu_rows_grads_reference", "swiglu_rows_reference"]
