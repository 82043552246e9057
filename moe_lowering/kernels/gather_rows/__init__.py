"""Row gathers: ``out[r] = src[index[r]]`` (times ``scale[r]``): the sparse MoE's permutation of token
rows into expert order (``permute``, lowered to it on CUDA by :mod:`moe_lowering.primitives`).

* :mod:`.reference`: the jnp version (the contract);
* :mod:`.triton_kernels`: one Triton kernel, each program copying a block of whole rows with 16-byte
  loads (XLA's gather fusion of ``jnp.take`` ran the permutation at about 1.3 TB/s on an H100, this
  kernel at 1.8);
* :mod:`.triton_launch`: the kernel as an XLA custom call; needs ``triton`` and ``jax_triton``.
"""

from moe_lowering.kernels.gather_rows.reference import gather_rows_reference

__all__ = ["gather_rows_reference"]
