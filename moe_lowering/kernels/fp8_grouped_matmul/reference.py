"""Grouped matrix products with FP8 expert weights (W8A16): the pure-jnp reference and CPU path.

``fp8_gmm(lhs[M, K], rhs_values[G, K, N], rhs_scales, group_sizes)`` is :func:`~moe_lowering.kernels.grouped_matmul.gmm`
with the weights kept as ``float8_e4m3fn`` values and block scales, in the formats of
:mod:`.quant_format` (what the FP8 FSDP weight gather sends):

* ``"fp8_e4m3"``: float32 scales ``[G, K // block_k, N // block_n]``, one per expert and per
  ``block_k x block_n`` block; the block sizes are read off the scales' shape;
* ``"mxfp8"``: uint8 E8M0 exponents ``[G, K // 32, N]``, one per 1x32 block along K.

Here the weights are dequantised to the activation dtype and multiplied by ``gmm``. The Triton
kernel (:mod:`.triton_launch`) dequantises tile by tile in registers with the same arithmetic
(``fp8 -> f32``, times the f32 scale, rounded once to the activation dtype), so the two agree up
to float32 accumulation order.
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_lowering.kernels.fp8_grouped_matmul.quant_format import FP8_DTYPE, MX_BLOCK, dequantize_blocks
from moe_lowering.kernels.grouped_matmul.reference import gmm

FP8_GMM_QUANTS = ("fp8_e4m3", "mxfp8")


def _scale_block(dim: int, num_blocks: int) -> int | None:
    """The block size when ``num_blocks`` power-of-two blocks tile ``dim`` exactly, else None."""
    if num_blocks <= 0 or dim % num_blocks:
        return None
    block = dim // num_blocks
    return block if block & (block - 1) == 0 else None


def check_fp8_operands(lhs, rhs_values, rhs_scales, group_sizes, quant: str, name: str) -> tuple[int, int]:
    """Raises ``ValueError`` naming the first problem; returns the ``(K, N)`` extent of one scale block."""
    if quant not in FP8_GMM_QUANTS:
        raise ValueError(f"{name}: quant must be one of {FP8_GMM_QUANTS}, got {quant!r}")
    if lhs.ndim != 2 or rhs_values.ndim != 3:
        raise ValueError(f"{name}: expected lhs [M, K] and rhs_values [G, K, N], got {lhs.shape}, {rhs_values.shape}")
    if not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise ValueError(f"{name}: lhs must be floating point (weights are dequantised to its dtype), got {lhs.dtype}")
    if rhs_values.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: rhs_values must be float8_e4m3fn, got {rhs_values.dtype}")
    if lhs.shape[1] != rhs_values.shape[1]:
        raise ValueError(f"{name}: contraction sizes differ: lhs {lhs.shape}, rhs_values {rhs_values.shape}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{name}: group_sizes must be 1-D integers, got {group_sizes.dtype}{list(group_sizes.shape)}")
    num_groups, k, n = rhs_values.shape
    scale_dtype = jnp.dtype(jnp.float32 if quant == "fp8_e4m3" else jnp.uint8)
    if rhs_scales.dtype != scale_dtype:
        raise ValueError(f"{name}: {quant} scales must be {scale_dtype}, got {rhs_scales.dtype}")
    if quant == "mxfp8":
        expected = (num_groups, k // MX_BLOCK, n)
        if k % MX_BLOCK or rhs_scales.shape != expected:
            raise ValueError(f"{name}: mxfp8 needs K a multiple of {MX_BLOCK} and scales [G, K // {MX_BLOCK}, N] = "
                             f"{expected}; got rhs_values {rhs_values.shape}, rhs_scales {rhs_scales.shape}")
        return MX_BLOCK, 1
    if rhs_scales.ndim == 3 and rhs_scales.shape[0] == num_groups:
        block_k, block_n = _scale_block(k, rhs_scales.shape[1]), _scale_block(n, rhs_scales.shape[2])
        if block_k and block_n:
            return block_k, block_n
    raise ValueError(f"{name}: fp8_e4m3 scales must be [G, K // block_k, N // block_n] with power-of-two blocks "
                     f"dividing K and N; got rhs_values {rhs_values.shape}, rhs_scales {rhs_scales.shape}")


def fp8_gmm(
    lhs,
    rhs_values,
    rhs_scales,
    group_sizes,
    *,
    quant: str = "fp8_e4m3",
    group_offset=0,
    preferred_element_type=None,
):
    """``out[r] = lhs[r] @ dequantise(rhs)[group(r) - group_offset]``; rows outside the local groups are zero.

    The weights are dequantised to ``lhs.dtype``; the output is ``preferred_element_type`` or
    ``lhs.dtype``.
    """
    check_fp8_operands(lhs, rhs_values, rhs_scales, group_sizes, quant, "fp8_gmm")
    rhs = dequantize_blocks(rhs_values, rhs_scales, quant, lhs.dtype)
    return gmm(lhs, rhs, group_sizes, group_offset=group_offset, preferred_element_type=preferred_element_type)
