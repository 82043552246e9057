"""``fp8_gmm`` on a CUDA GPU: :mod:`triton_fp8_gmm_kernel` as an XLA custom call.

Contract and CPU path: :mod:`fp8_grouped_matmul`. The kernel reads the FP8 weight bytes and their
scales and dequantises tile by tile in registers, so it moves half the weight bytes of the bf16
``gmm`` and never writes a dequantised copy of the weights.

Tile shapes (:func:`fp8_gmm_config`) are not measured yet: ``benchmarks/fp8_gmm_bench.py`` times
them against the candidates it lists. The starting point is the bf16 table's tile
(:func:`triton_grouped_matmul.gmm_config`) at half its column width, as for the fused SwiGLU:
dequantising a ``BLOCK_K x BLOCK_N`` tile holds ``BLOCK_K * BLOCK_N / (32 * num_warps)`` more
float32 values per thread beside the accumulator's ``BLOCK_M * BLOCK_N / (32 * num_warps)``, which
at 128 x 256 x 64 on 8 warps is 128 + 64 registers, at risk of spilling; 128 x 128 x 64 needs
64 + 32. The K step is capped at the scale block along K (32 for mxfp8), so each step reads one
row of scales. To measure on Hopper: the dequantised weight is the dot's B operand, which wgmma
takes only from shared memory, so Triton stores it there from registers (or falls back to
``mma.sync``) instead of feeding wgmma asynchronously from the pipelined loads; computing the
transposed tile, ``weight^T @ lhs^T``, would make the weight wgmma's register operand instead.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import jax_triton

from moe_lowering.kernels import fp8_grouped_matmul as reference
from moe_lowering.kernels.triton_fp8_gmm_kernel import fp8_gmm_kernel
from moe_lowering.kernels.triton_grouped_matmul import (
    _KERNEL_DTYPES,
    _TENSOR_CORE_DTYPES,
    TileConfig,
    _multiprocessor_count,
    _next_power_of_two,
    _offset_array,
    gmm_config,
)
from moe_lowering.kernels.triton_grouped_matmul import gmm as bf16_gmm
from moe_lowering.parallel.quantize import dequantize_blocks

log = logging.getLogger(__name__)

_MIN_DOT_K = 16
"""The smallest K step ``tl.dot`` takes; finer fp8_e4m3 scale blocks go through the bf16 kernel."""


def fp8_gmm_config(num_rows: int, k: int, n: int, num_groups: int) -> TileConfig:
    """``gmm_config``'s bf16 tile for the same product at half the column width (see the module note)."""
    config = gmm_config(num_rows, k, n, num_groups, compute_f32=False)
    return dataclasses.replace(config, block_n=config.block_n // 2)


def fp8_gmm(
    lhs,
    rhs_values,
    rhs_scales,
    group_sizes,
    *,
    quant: str = "fp8_e4m3",
    group_offset=0,
    preferred_element_type=None,
    config: TileConfig | None = None,
):
    """``out[r] = lhs[r] @ dequantise(rhs)[group(r) - group_offset]``; rows outside the local groups are zero.

    ``config.block_k`` is capped at the scale block along K. Activations other than bf16/f16, and
    fp8_e4m3 scale blocks under 16 rows, dequantise first and use the bf16 ``gmm`` kernel.
    """
    scale_block_k, scale_block_n = reference.check_fp8_operands(
        lhs, rhs_values, rhs_scales, group_sizes, quant, "fp8_gmm"
    )
    num_rows, k = lhs.shape
    num_local_groups, _, n = rhs_values.shape
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    if num_rows == 0 or num_local_groups == 0:
        return jnp.zeros((num_rows, n), out_dtype)
    if lhs.dtype not in _TENSOR_CORE_DTYPES or out_dtype not in _KERNEL_DTYPES or scale_block_k < _MIN_DOT_K:
        log.debug("fp8_gmm: %s activations, %s output, %d-row scale blocks have no FP8 kernel; dequantising first",
                  lhs.dtype, out_dtype, scale_block_k)
        rhs = dequantize_blocks(rhs_values, rhs_scales, quant, lhs.dtype)
        return bf16_gmm(lhs, rhs, group_sizes, group_offset=group_offset, preferred_element_type=preferred_element_type)
    config = config or fp8_gmm_config(num_rows, k, n, num_local_groups)
    block_k = min(config.block_k, scale_block_k)
    n_tiles = -(-n // config.block_n)
    max_tiles = (-(-num_rows // config.block_m) + num_local_groups) * n_tiles
    num_programs = min(max_tiles, _multiprocessor_count()) if config.persistent else max_tiles
    num_groups = group_sizes.shape[0]
    return jax_triton.triton_call(
        lhs,
        rhs_values,
        rhs_scales,
        group_sizes.astype(jnp.int32),
        _offset_array(group_offset),
        kernel=fp8_gmm_kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, n), out_dtype),
        grid=(num_programs,),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        M=num_rows,
        K=k,
        N=n,
        NUM_LOCAL_GROUPS=num_local_groups,
        NUM_GROUPS=num_groups,
        GROUPS_PAD=_next_power_of_two(num_groups),
        SCALE_BLOCK_K=scale_block_k,
        SCALE_BLOCK_N=scale_block_n,
        E8M0_SCALES=quant == "mxfp8",
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        GROUP_M=config.group_m,
        NUM_PROGRAMS=num_programs,
    )
