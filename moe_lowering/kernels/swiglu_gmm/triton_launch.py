"""``swiglu_gmm`` on a CUDA GPU: :mod:`.triton_kernels` as an XLA custom call.

Contract and CPU path: :mod:`.reference`. Tile shapes follow the ``gmm`` table
(:func:`moe_lowering.kernels.grouped_matmul.triton_launch.gmm_config`) with half its column width: the two float32
accumulators of a ``BLOCK_M x BLOCK_N/2`` tile hold as many registers, and its two weight blocks
as much shared memory, as one ``BLOCK_M x BLOCK_N`` tile of ``gmm``.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import jax_triton

from moe_lowering.kernels.grouped_matmul.triton_launch import (
    _KERNEL_DTYPES,
    TileConfig,
    _check_group_sizes,
    _compute_f32,
    _next_power_of_two,
    _offset_array,
    _row_tile_grid,
    gmm_config,
    gmm_pair,
)
from moe_lowering.kernels.swiglu_gmm import reference
from moe_lowering.kernels.swiglu_gmm.triton_kernels import (
    gather_swiglu_gmm_kernel,
    gather_swiglu_gmm_preactivations_kernel,
    swiglu_gmm_kernel,
    swiglu_gmm_preactivations_kernel,
)

log = logging.getLogger(__name__)


def swiglu_config(num_rows: int, k: int, n: int, num_groups: int, compute_f32: bool) -> TileConfig:
    """``gmm_config``'s tile for the same product with half the columns (two accumulators per tile)."""
    config = gmm_config(num_rows, k, n, num_groups, compute_f32)
    return config if compute_f32 else dataclasses.replace(config, block_n=config.block_n // 2)


def swiglu_gmm(
    lhs,
    gate_rhs,
    up_rhs,
    group_sizes,
    *,
    group_offset=0,
    preferred_element_type=None,
    with_preactivations: bool = False,
    config: TileConfig | None = None,
):
    """``silu(lhs[r] @ gate[g]) * (lhs[r] @ up[g])``; with ``with_preactivations`` also both products."""
    reference.check_swiglu_operands(lhs, gate_rhs, up_rhs, "swiglu_gmm")
    _check_group_sizes(group_sizes, "swiglu_gmm")
    num_rows, k = lhs.shape
    num_local_groups, _, n = gate_rhs.shape
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, gate_rhs.dtype, up_rhs.dtype))
    dtypes = {lhs.dtype, gate_rhs.dtype, up_rhs.dtype, out_dtype}
    if num_rows == 0 or n == 0 or k == 0 or num_local_groups == 0 or not dtypes <= set(_KERNEL_DTYPES):
        log.debug("swiglu_gmm: %s x %s (%s) has no Triton kernel launch; using the XLA path", lhs.shape,
                  gate_rhs.shape, dtypes)
        return reference.swiglu_gmm_reference(lhs, gate_rhs, up_rhs, group_sizes, group_offset=group_offset,
                                              preferred_element_type=preferred_element_type,
                                              with_preactivations=with_preactivations)
    compute_f32 = _compute_f32(lhs.dtype, gate_rhs.dtype, up_rhs.dtype)
    config = config or swiglu_config(num_rows, k, n, num_local_groups, compute_f32)
    num_programs = _row_tile_grid(num_rows, n, num_local_groups, config)
    num_groups = group_sizes.shape[0]
    out_shape = jax.ShapeDtypeStruct((num_rows, n), out_dtype)
    return jax_triton.triton_call(
        lhs,
        gate_rhs,
        up_rhs,
        group_sizes.astype(jnp.int32),
        _offset_array(group_offset),
        kernel=swiglu_gmm_preactivations_kernel if with_preactivations else swiglu_gmm_kernel,
        out_shape=(out_shape, out_shape, out_shape) if with_preactivations else out_shape,
        grid=(num_programs,),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        M=num_rows,
        K=k,
        N=n,
        NUM_LOCAL_GROUPS=num_local_groups,
        NUM_GROUPS=num_groups,
        GROUPS_PAD=_next_power_of_two(num_groups),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        NUM_PROGRAMS=num_programs,
        COMPUTE_F32=compute_f32,
    )


FUSED_MAX_N = 512
"""Widest expert (``N`` columns) for which ``swiglu_gmm_or_pair`` runs the fused kernel; wider ones
run ``gmm_pair`` and the activation apart (the fused kernel's two half-width accumulators cost
more than the saved traffic there: ``benchmarks/NOTES.md``)."""


def swiglu_gmm_or_pair(lhs, gate_rhs, up_rhs, group_sizes, *, group_offset=0, preferred_element_type=None,
                       with_preactivations: bool = False):
    """The Triton backend's ``swiglu_gmm``: the fused kernel for experts up to ``FUSED_MAX_N`` wide,
    where the products are short and the ``[M, N]`` passes it saves are a large part of the time;
    else ``gmm_pair`` (both products, one tail launch) and the activation on the rounded products.

    Either way the SwiGLU goes through ``moe_swiglu_gmm``, whose backward adds the rows' cotangents
    of both products in one ``gmm_sum`` pass."""
    n = gate_rhs.shape[-1]
    if n <= FUSED_MAX_N:
        return swiglu_gmm(lhs, gate_rhs, up_rhs, group_sizes, group_offset=group_offset,
                          preferred_element_type=preferred_element_type, with_preactivations=with_preactivations)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, gate_rhs.dtype, up_rhs.dtype))
    gate, up = gmm_pair(lhs, gate_rhs, up_rhs, group_sizes, group_offset=group_offset,
                        preferred_element_type=out_dtype)
    acc = jnp.promote_types(out_dtype, jnp.float32)
    out = (jax.nn.silu(gate.astype(acc)) * up.astype(acc)).astype(out_dtype)
    return (out, gate, up) if with_preactivations else out


def gather_swiglu_gmm(tokens, gate_rhs, up_rhs, row_index, group_sizes, *, group_offset=0, preferred_element_type=None,
                      with_preactivations: bool = False, config: TileConfig | None = None):
    """``swiglu_gmm_or_pair`` of the rows ``tokens[row_index[r]]``: up to ``FUSED_MAX_N`` wide the
    fused kernel gathers them as it loads them (no ``[M, K]`` permuted copy); wider, the rows are
    gathered first (XLA) and ``swiglu_gmm_or_pair`` runs on them. ``with_preactivations``: also
    both products, as ``swiglu_gmm``."""
    reference.check_swiglu_operands(tokens, gate_rhs, up_rhs, "gather_swiglu_gmm")
    _check_group_sizes(group_sizes, "gather_swiglu_gmm")
    num_rows, k = row_index.shape[0], tokens.shape[1]
    num_local_groups, _, n = gate_rhs.shape
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(tokens.dtype, gate_rhs.dtype, up_rhs.dtype))
    dtypes = {tokens.dtype, gate_rhs.dtype, up_rhs.dtype, out_dtype}
    if (n > FUSED_MAX_N or min(num_rows, n, k, num_local_groups, tokens.shape[0]) == 0
            or not dtypes <= set(_KERNEL_DTYPES)):
        rows = jnp.take(tokens, row_index, axis=0, mode="clip")
        return swiglu_gmm_or_pair(rows, gate_rhs, up_rhs, group_sizes, group_offset=group_offset,
                                  preferred_element_type=preferred_element_type,
                                  with_preactivations=with_preactivations)
    compute_f32 = _compute_f32(tokens.dtype, gate_rhs.dtype, up_rhs.dtype)
    config = config or swiglu_config(num_rows, k, n, num_local_groups, compute_f32)
    num_programs = _row_tile_grid(num_rows, n, num_local_groups, config)
    num_groups = group_sizes.shape[0]
    out_shape = jax.ShapeDtypeStruct((num_rows, n), out_dtype)
    return jax_triton.triton_call(
        tokens,
        gate_rhs,
        up_rhs,
        row_index.astype(jnp.int32),
        group_sizes.astype(jnp.int32),
        _offset_array(group_offset),
        kernel=gather_swiglu_gmm_preactivations_kernel if with_preactivations else gather_swiglu_gmm_kernel,
        out_shape=(out_shape, out_shape, out_shape) if with_preactivations else out_shape,
        grid=(num_programs,),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        M=num_rows,
        K=k,
        N=n,
        LHS_SOURCE_ROWS=tokens.shape[0],
        NUM_LOCAL_GROUPS=num_local_groups,
        NUM_GROUPS=num_groups,
        GROUPS_PAD=_next_power_of_two(num_groups),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        NUM_PROGRAMS=num_programs,
        COMPUTE_F32=compute_f32,
    )
