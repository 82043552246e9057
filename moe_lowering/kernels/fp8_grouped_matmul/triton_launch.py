"""``fp8_gmm`` on a CUDA GPU: :mod:`.triton_kernels` as an XLA custom call.

Contract and CPU path: :mod:`.reference`. The kernel reads the FP8 weight bytes and their
scales and dequantises tile by tile in registers, so it moves half the weight bytes of the bf16
``gmm`` and never writes a dequantised copy of the weights.

Operand order (``Fp8TileConfig.weight_as_lhs``, the kernel's ``WEIGHT_AS_LHS``). Measured on an
H200 (``benchmarks/fp8_gmm_bench.py``), the first version, with the dequantised weight as the dot's
B operand, was correct but 2-3x slower than the bf16 ``gmm`` and slower than dequantising first
(rows=4096, K=4096, N=14336, 2 groups: bf16 ``gmm`` 0.79 ms, dequantise-then-``gmm`` 1.65 ms, best
tile 2.32 ms): Hopper's wgmma reads B only from shared memory, so a tile converted in registers
goes back through shared memory (or Triton falls back to ``mma.sync``). With ``weight_as_lhs`` the
kernel computes the transposed tile, ``weight^T @ lhs^T``, so the dequantised weight is wgmma's
A operand, the one it may take from registers, and the activations stream through shared memory
as B. The MMA's M is then the column tile ``block_n`` (a multiple of 64 for wgmma) and its N the
row tile ``block_m``.

Tile shapes (:func:`fp8_gmm_config`): measured with ``benchmarks/fp8_gmm_bench.py``, which times the
table's tile against the candidates it lists, both operand orders. The weight-as-lhs kernel was
1.3-1.7x faster than the weight-as-rhs one at every shape measured. Dequantising a ``block_k x block_n``
tile holds ``block_k * block_n / (32 * num_warps)`` values per thread (the fp8 bytes, their float32
product, the bf16 operand) beside the accumulator's ``block_m * block_n / (32 * num_warps)`` float32
registers, so 128 x 128 tiles (64 accumulator registers on 8 warps) leave room where 128 x 256
risk spilling. The K step is capped at the scale block along K (32 for mxfp8), so each step reads
one row of scales.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import jax_triton

from moe_lowering.kernels.fp8_grouped_matmul import reference
from moe_lowering.kernels.fp8_grouped_matmul.quant_format import dequantize_blocks
from moe_lowering.kernels.fp8_grouped_matmul.triton_kernels import fp8_gmm_kernel
from moe_lowering.kernels.grouped_matmul.triton_launch import (
    _KERNEL_DTYPES,
    _TENSOR_CORE_DTYPES,
    TileConfig,
    _next_power_of_two,
    _offset_array,
    _row_tile_grid,
)
from moe_lowering.kernels.grouped_matmul.triton_launch import gmm as bf16_gmm

log = logging.getLogger(__name__)

_MIN_DOT_K = 16
"""The smallest K step ``tl.dot`` takes; finer fp8_e4m3 scale blocks go through the bf16 kernel."""


@dataclasses.dataclass(frozen=True)
class Fp8TileConfig(TileConfig):
    """A :class:`TileConfig` plus the operand order: ``weight_as_lhs`` computes the transposed tile
    with the dequantised weight as the dot's first (register) operand (module note). A plain
    ``TileConfig`` passed to :func:`fp8_gmm` runs with ``weight_as_lhs=True`` too."""

    weight_as_lhs: bool = True


_E4M3_TILE = Fp8TileConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4, weight_as_lhs=True)
_MXFP8_TILE = Fp8TileConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3, weight_as_lhs=True)


def fp8_gmm_config(num_rows: int, k: int, n: int, num_groups: int, quant: str = "fp8_e4m3") -> Fp8TileConfig:
    """The transposed (weight-as-lhs) kernel on 128 x 128 tiles, K steps of 64 (32 for mxfp8).

    Measured on an H200 (``results/fp8_gmm_bench_H200_20261122_v2.json``): the fastest tile at the
    DeepSeek-like local shape (8192 rows, K=7168, N=2048, 64 groups), 1.43 ms for both formats
    against 2.65-2.76 ms for dequantise-then-``gmm``; within 3% of the fastest at the Mixtral-like
    shape, where dequantising first is faster still (0.98 vs 1.67 ms), see ``use_fp8_kernel``.
    """
    del num_rows, k, n, num_groups
    return _MXFP8_TILE if quant == "mxfp8" else _E4M3_TILE


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

    ``config.block_k`` is capped at the scale block along K; ``config`` may be a :class:`Fp8TileConfig`
    (its ``weight_as_lhs`` picks the operand order) or a plain ``TileConfig`` (weight as lhs). Activations other than bf16/f16, and
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
    config = config or fp8_gmm_config(num_rows, k, n, num_local_groups, quant)
    block_k = min(config.block_k, scale_block_k)
    num_programs = _row_tile_grid(num_rows, n, num_local_groups, config)
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
        WEIGHT_AS_LHS=bool(getattr(config, "weight_as_lhs", True)),
    )
