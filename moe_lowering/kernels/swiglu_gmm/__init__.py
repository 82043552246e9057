"""The grouped SwiGLU up-projection, fused: ``silu(lhs @ gate[g]) * (lhs @ up[g])`` per group.

Has the contract of ``grouped_matmul.gmm`` with two weights of one shape; the activation is applied
to the float32 accumulators, so the output is rounded once. ``with_preactivations`` also returns
both products, which the backward reuses (``swiglu_grads``).

* :mod:`.reference`: the contract, the jnp version (the CPU path: the XLA backend's
  ``swiglu_gmm``) and ``swiglu_grads``, SwiGLU's elementwise gradient;
* :mod:`.triton_kernels`: the fused Triton kernels (no ``[M, N]`` pre-activation goes to memory);
* :mod:`.triton_launch`: those kernels as XLA custom calls; needs ``triton`` and ``jax_triton``.
  The Triton backend does not offer it: it measured no faster than two ``gmm`` calls on an H200
  (``benchmarks/NOTES.md``, "Fused SwiGLU").
"""

from moe_lowering.kernels.swiglu_gmm.reference import check_swiglu_operands, swiglu_gmm_reference, swiglu_grads

__all__ = ["check_swiglu_operands", "swiglu_gmm_reference", "swiglu_grads"]
