"""Grouped matrix products with FP8 expert weights (W8A16): ``fp8_gmm``, and the FP8 format.

``fp8_gmm(lhs[M, K], rhs_values[G, K, N], rhs_scales, group_sizes)`` is ``grouped_matmul.gmm``
with the weights kept as ``float8_e4m3fn`` values and block scales, dequantised to the activation
dtype.

* :mod:`.quant_format`: the formats (``fp8_e4m3``: a float32 scale per 128x128 block; ``mxfp8``:
  an E8M0 exponent per 1x32 block along K) and ``quantize_blocks`` / ``dequantize_blocks``; the
  FP8 FSDP weight gather (``moe_lowering.parallel.quantize``) makes its weights with them;
* :mod:`.reference`: the contract and the CPU path (dequantise, then ``gmm``);
* :mod:`.triton_kernels`: the Triton kernel, dequantising tile by tile in registers;
* :mod:`.triton_launch`: that kernel as an XLA custom call and its tile table; needs ``triton``
  and ``jax_triton``, so import it explicitly.

The FP8-weight kernel is not part of a :class:`~moe_lowering.kernels.KernelBackend`: whether it
beats dequantise-then-``gmm`` depends on rows per expert, so the caller
(``moe_lowering.parallel.quantize.use_fp8_kernel``) decides.
"""

from moe_lowering.kernels.fp8_grouped_matmul.quant_format import (
    FP8_BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    MX_BLOCK,
    dequantize_blocks,
    quantize_blocks,
)
from moe_lowering.kernels.fp8_grouped_matmul.reference import FP8_GMM_QUANTS, check_fp8_operands, fp8_gmm

__all__ = ["FP8_BLOCK", "FP8_DTYPE", "FP8_GMM_QUANTS", "FP8_MAX", "MX_BLOCK", "check_fp8_operands",
           "dequantize_blocks", "fp8_gmm", "quantize_blocks"]
