"""Row gathers: ``out[r] = src[index[r]]`` (times ``scale[r]``): the sparse MoE's permutation of token
rows into expert order (``permute``); and row sums ``out[t] = sum_j src[index[t, j]]``: its transpose,
each token's copies added up (``unpermute``, the tokens' cotangent). CUDA lowers both primitives to
these kernels (:mod:`moe_lowering.primitives`).

* :mod:`.reference`: the jnp versions (the contracts);
* :mod:`.triton_kernels`: the Triton kernels, each program reading or writing whole rows with 16-byte
  accesses (XLA's gather fusion of ``jnp.take`` ran the permutation at about 1.3 TB/s on an H100, the
  row gather at 1.8);
* :mod:`.triton_launch`: the kernels as XLA custom calls; need ``triton`` and ``jax_triton``.
"""

from moe_lowering.kernels.gather_rows.reference import gather_rows_reference, sum_rows_reference

__all__ = ["gather_rows_reference", "sum_rows_reference"]
