"""Row gathers: ``out[r] = src[index[r]]`` (times ``scale[r]``): the sparse MoE's permutation of token
rows into expert order (``permute``) and the combine's backward in its rows (``spread``); and
``out[r] = sum_j src[index[r, j]]``: the sum of each token's copies (``unpermute``, the
permutation's transpose). CUDA lowers all three to these kernels (:mod:`moe_lowering.primitives`).

* :mod:`.reference`: the jnp version (the contract);
* :mod:`.triton_kernels`: two Triton kernels, each program copying (or adding up) a block of whole
  rows with 16-byte loads (XLA's gather fusion of ``jnp.take`` ran the permutation at about 1.3 TB/s
  on an H100, the kernel at 1.8);
* :mod:`.triton_launch`: the kernel as an XLA custom call; needs ``triton`` and ``jax_triton``.
"""

from moe_lowering.kernels.gather_rows.reference import gather_rows_reference, gather_sum_rows_reference

__all__ = ["gather_rows_reference", "gather_sum_rows_reference"]
