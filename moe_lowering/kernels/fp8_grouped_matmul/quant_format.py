"""The FP8 weight formats: block-scaled ``float8_e4m3fn`` values, and how to make and undo them.

What the FP8 FSDP weight gather (:mod:`moe_lowering.parallel.quantize`) sends and what the
FP8-weight grouped matmul (:mod:`.reference`, :mod:`.triton_launch`) reads. Weights are
``[E, K, N]`` (experts, contraction, output features):

* ``"fp8_e4m3"``: ``float8_e4m3fn`` with one float32 scale per expert and per 128x128 block of
  the ``[K, N]`` matrix (the block shrinks to the largest power of two dividing a small shard);
  scales ``[E, K // block_k, N // block_n]``;
* ``"mxfp8"``: OCP MX-style, one power-of-two scale per 1x32 block along the contraction dim
  K, kept as its 8-bit exponent (E8M0, ``uint8``), so the scales cost 1/32 of the FP8 bytes;
  scales ``[E, K // 32, N]``.
"""

from __future__ import annotations

import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
FP8_BLOCK = 128
MX_BLOCK = 32
_E8M0_BIAS = 127


def _block_size(dim: int, preferred: int) -> int:
    """The largest power of two <= ``preferred`` that divides ``dim``."""
    block = preferred
    while dim % block:
        block //= 2
    return block


def quantize_blocks(w, quant: str):
    """``w [E, K, N]`` -> (FP8 values ``[E, K, N]``, scales); ``dequantize_blocks`` inverts it."""
    num_experts, k, n = w.shape
    if quant == "fp8_e4m3":
        bk, bn = _block_size(k, FP8_BLOCK), _block_size(n, FP8_BLOCK)
    else:
        bk, bn = MX_BLOCK, 1
    blocks = w.astype(jnp.float32).reshape(num_experts, k // bk, bk, n // bn, bn)
    amax = jnp.max(jnp.abs(blocks), axis=(2, 4), keepdims=True)
    if quant == "fp8_e4m3":
        scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
        stored_scale = scale[:, :, 0, :, 0]
    else:
        # Smallest power of two that keeps the block's amax within FP8 range: no saturation.
        exponent = jnp.ceil(jnp.log2(jnp.where(amax > 0, amax, 1.0) / FP8_MAX))
        exponent = jnp.clip(exponent, -_E8M0_BIAS, _E8M0_BIAS)
        scale = jnp.exp2(exponent)
        stored_scale = (exponent[:, :, 0, :, 0] + _E8M0_BIAS).astype(jnp.uint8)
    values = jnp.clip(blocks / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE).reshape(w.shape)
    return values, stored_scale


def dequantize_blocks(values, stored_scale, quant: str, dtype):
    """The ``[E, K, N]`` weights in ``dtype`` from FP8 ``values`` and their block scales."""
    num_experts, k, n = values.shape
    if quant == "fp8_e4m3":
        scale = stored_scale
    else:
        scale = jnp.exp2(stored_scale.astype(jnp.float32) - _E8M0_BIAS)
    blocks_k, blocks_n = scale.shape[1], scale.shape[2]
    blocks = values.astype(jnp.float32).reshape(num_experts, blocks_k, k // blocks_k, blocks_n, n // blocks_n)
    return (blocks * scale[:, :, None, :, None]).reshape(values.shape).astype(dtype)
