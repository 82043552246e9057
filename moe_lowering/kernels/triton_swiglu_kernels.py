"""Triton kernel for the grouped SwiGLU up-projection: gate and up products of a row tile in one pass.

Same on-device scheduling as :func:`triton_gmm_kernels.gmm_kernel` (per-group row tiles from the
cumulative group sizes, persistent programs, bands of ``GROUP_M`` row tiles, zero rows outside
the local groups). Each tile loads its ``lhs`` block once, multiplies it by the gate and the up
weight blocks into two float32 accumulators, and stores ``silu(gate) * up``: the two ``[M, N]``
pre-activations never go through memory, except in ``swiglu_gmm_preactivations_kernel``, which
also stores them as the backward's residuals. Contract: :mod:`swiglu_gmm`. Only ``triton`` is
imported, so the kernels also run under Triton's interpreter on a CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_lowering.kernels.triton_gmm_kernels import _band_swizzle, _pick


@triton.jit
def _swiglu_gmm_tiles(
    lhs_ptr,
    gate_ptr,
    up_ptr,
    group_sizes_ptr,
    group_offset_ptr,
    out_ptr,
    gate_out_ptr,
    up_out_ptr,
    M: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    STORE_PREACTIVATIONS: tl.constexpr,
):
    """The body of both kernels below; ``gate_out`` / ``up_out`` are written only with ``STORE_PREACTIVATIONS``."""
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    group_ids = tl.arange(0, GROUPS_PAD)
    sizes = tl.maximum(tl.load(group_sizes_ptr + group_ids, mask=group_ids < NUM_GROUPS, other=0), 0)
    offset = tl.load(group_offset_ptr)
    ends = tl.cumsum(sizes, axis=0)
    starts = ends - sizes
    is_local = (group_ids >= offset) & (group_ids < offset + NUM_LOCAL_GROUPS)
    m_tiles = tl.where(is_local, (sizes + BLOCK_M - 1) // BLOCK_M, 0)
    tile_ends = tl.cumsum(m_tiles, axis=0) * n_tiles
    num_tiles = tl.sum(m_tiles, axis=0) * n_tiles

    in_m = tl.arange(0, BLOCK_M)
    in_n = tl.arange(0, BLOCK_N)
    in_k = tl.arange(0, BLOCK_K)
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        group = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)
        selected = group_ids == group
        group_start = _pick(starts, selected)
        group_end = tl.minimum(_pick(ends, selected), M)
        group_m_tiles = _pick(m_tiles, selected)
        first_tile = _pick(tile_ends, selected) - group_m_tiles * n_tiles
        pm, pn = _band_swizzle(tile - first_tile, group_m_tiles, n_tiles, GROUP_M)

        row0 = group_start + pm * BLOCK_M
        # As in gmm_kernel: rows clamped (never stored past the group), columns masked, so the
        # contiguous axis keeps its 16-byte pipelined loads.
        tile_rows = tl.minimum(row0 + in_m, M - 1) - row0
        cols = pn * BLOCK_N + in_n
        a_ptrs = lhs_ptr + tl.cast(row0, tl.int64) * K + tile_rows[:, None] * K + in_k[None, :]
        weight_offset = tl.cast(group - offset, tl.int64) * (K * N) + in_k[:, None] * N + cols[None, :]
        g_ptrs = gate_ptr + weight_offset
        u_ptrs = up_ptr + weight_offset
        cols_ok = (cols < N)[None, :]
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if K % BLOCK_K == 0:
                a = tl.load(a_ptrs)
                if N % BLOCK_N == 0:
                    wg = tl.load(g_ptrs)
                    wu = tl.load(u_ptrs)
                else:
                    wg = tl.load(g_ptrs, mask=cols_ok, other=0.0)
                    wu = tl.load(u_ptrs, mask=cols_ok, other=0.0)
            else:
                k_ok = (k0 + in_k) < K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=k_ok[:, None] & cols_ok, other=0.0)
                wu = tl.load(u_ptrs, mask=k_ok[:, None] & cols_ok, other=0.0)
            if COMPUTE_F32:
                a32 = a.to(tl.float32)
                acc_gate = tl.dot(a32, wg.to(tl.float32), acc_gate, input_precision="ieee")
                acc_up = tl.dot(a32, wu.to(tl.float32), acc_up, input_precision="ieee")
            else:
                acc_gate = tl.dot(a, wg, acc_gate)
                acc_up = tl.dot(a, wu, acc_up)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * N
            u_ptrs += BLOCK_K * N

        rows = row0 + in_m
        out_offsets = tl.cast(row0, tl.int64) * N + in_m[:, None] * N + cols[None, :]
        store_mask = (rows < group_end)[:, None] & cols_ok
        hidden = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(out_ptr + out_offsets, hidden.to(out_ptr.dtype.element_ty), mask=store_mask)
        if STORE_PREACTIVATIONS:
            tl.store(gate_out_ptr + out_offsets, acc_gate.to(gate_out_ptr.dtype.element_ty), mask=store_mask)
            tl.store(up_out_ptr + out_offsets, acc_up.to(up_out_ptr.dtype.element_ty), mask=store_mask)

    # Rows outside the local groups (before them, after them, dropped rows) are zero.
    rows_begin = tl.minimum(tl.sum(tl.where(group_ids < offset, sizes, 0), axis=0), M)
    rows_end = tl.minimum(rows_begin + tl.sum(tl.where(is_local, sizes, 0), axis=0), M)
    zero_tiles_before = (rows_begin + BLOCK_M - 1) // BLOCK_M
    zero_tiles_after = (M - rows_end + BLOCK_M - 1) // BLOCK_M
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
    for tile in range(pid, (zero_tiles_before + zero_tiles_after) * n_tiles, NUM_PROGRAMS):
        zm = tile // n_tiles
        pn = tile % n_tiles
        before = zm < zero_tiles_before
        row0 = tl.where(before, zm * BLOCK_M, rows_end + (zm - zero_tiles_before) * BLOCK_M)
        row_limit = tl.where(before, rows_begin, M)
        rows = row0 + in_m
        cols = pn * BLOCK_N + in_n
        out_offsets = tl.cast(row0, tl.int64) * N + in_m[:, None] * N + cols[None, :]
        zero_mask = (rows < row_limit)[:, None] & (cols < N)[None, :]
        tl.store(out_ptr + out_offsets, zeros, mask=zero_mask)
        if STORE_PREACTIVATIONS:
            tl.store(gate_out_ptr + out_offsets, zeros, mask=zero_mask)
            tl.store(up_out_ptr + out_offsets, zeros, mask=zero_mask)


@triton.jit
def swiglu_gmm_kernel(
    lhs_ptr, gate_ptr, up_ptr, group_sizes_ptr, group_offset_ptr, out_ptr,
    M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr, NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, COMPUTE_F32: tl.constexpr,
):
    """``out[r] = silu(lhs[r] @ gate[g]) * (lhs[r] @ up[g])``, ``g = group(r) - offset``; zero outside."""
    _swiglu_gmm_tiles(lhs_ptr, gate_ptr, up_ptr, group_sizes_ptr, group_offset_ptr, out_ptr, out_ptr, out_ptr,
                      M, K, N, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                      NUM_PROGRAMS, COMPUTE_F32, False)


@triton.jit
def swiglu_gmm_preactivations_kernel(
    lhs_ptr, gate_ptr, up_ptr, group_sizes_ptr, group_offset_ptr, out_ptr, gate_out_ptr, up_out_ptr,
    M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr, NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, COMPUTE_F32: tl.constexpr,
):
    """``swiglu_gmm_kernel`` that also stores both products (rounded to the output type), zero outside."""
    _swiglu_gmm_tiles(lhs_ptr, gate_ptr, up_ptr, group_sizes_ptr, group_offset_ptr, out_ptr, gate_out_ptr,
                      up_out_ptr, M, K, N, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M, BLOCK_N, BLOCK_K,
                      GROUP_M, NUM_PROGRAMS, COMPUTE_F32, True)
