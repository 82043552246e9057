"""Triton kernel for the grouped SwiGLU up-projection: gate and up products of a row tile in one pass.

Same on-device scheduling as the grouped matmul's ``gmm_kernel`` (per-group row tiles from the
cumulative group sizes, persistent programs, bands of ``GROUP_M`` row tiles, zero rows outside
the local groups). Each tile loads its ``lhs`` block once, multiplies it by the gate and the up
weight blocks into two float32 accumulators, and stores ``silu(gate) * up``: the two ``[M, N]``
pre-activations never go through memory, except in ``swiglu_gmm_preactivations_kernel``, which
also stores them as the backward's residuals. Contract: :mod:`.reference`. Only ``triton`` is
imported, so the kernels also run under Triton's interpreter on a CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_lowering.kernels.grouped_matmul.triton_kernels import _group_layout, _outside_rows, _tile_position, _zero_tile


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
    row_index_ptr=None,
    LHS_SOURCE_ROWS: tl.constexpr = 0,
):
    """The body of the kernels below; ``gate_out`` / ``up_out`` are written only with
    ``STORE_PREACTIVATIONS``; with ``LHS_SOURCE_ROWS > 0`` row ``r`` is ``lhs[row_index[r]]`` of a
    ``[LHS_SOURCE_ROWS, K]`` ``lhs``, gathered as loaded (indices clamped into it)."""
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    group_ids, sizes, offset, starts, ends, is_local, m_tiles, tile_ends, num_tiles = _group_layout(
        group_sizes_ptr, group_offset_ptr, n_tiles, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M
    )

    in_m = tl.arange(0, BLOCK_M)
    in_n = tl.arange(0, BLOCK_N)
    in_k = tl.arange(0, BLOCK_K)
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        group, group_start, group_end, pm, pn = _tile_position(
            tile, group_ids, starts, ends, m_tiles, tile_ends, n_tiles, M, GROUP_M
        )

        row0 = group_start + pm * BLOCK_M
        # As in gmm_kernel: rows clamped (never stored past the group), columns masked, so the
        # contiguous axis keeps its 16-byte pipelined loads.
        tile_rows = tl.minimum(row0 + in_m, M - 1) - row0
        cols = pn * BLOCK_N + in_n
        if LHS_SOURCE_ROWS > 0:
            source = tl.minimum(tl.maximum(tl.load(row_index_ptr + row0 + tile_rows), 0), LHS_SOURCE_ROWS - 1)
            a_ptrs = lhs_ptr + tl.cast(source, tl.int64)[:, None] * K + in_k[None, :]
        else:
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
    rows_begin, rows_end, zero_tiles_before, zero_tiles_after = _outside_rows(
        sizes, group_ids, offset, is_local, M, BLOCK_M
    )
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
    for tile in range(pid, (zero_tiles_before + zero_tiles_after) * n_tiles, NUM_PROGRAMS):
        out_offsets, zero_mask = _zero_tile(
            tile, n_tiles, rows_begin, rows_end, zero_tiles_before, M, N, BLOCK_M, BLOCK_N
        )
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


@triton.jit
def gather_swiglu_gmm_kernel(
    lhs_ptr, gate_ptr, up_ptr, row_index_ptr, group_sizes_ptr, group_offset_ptr, out_ptr,
    M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, LHS_SOURCE_ROWS: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, COMPUTE_F32: tl.constexpr,
):
    """``swiglu_gmm_kernel`` whose row ``r`` is ``lhs[row_index[r]]`` of the ``[LHS_SOURCE_ROWS, K]``
    token rows: the permutation of the tokens into expert order happens in the loads, so its
    ``[M, K]`` copy is never written."""
    _swiglu_gmm_tiles(lhs_ptr, gate_ptr, up_ptr, group_sizes_ptr, group_offset_ptr, out_ptr, out_ptr, out_ptr, M, K, N,
                      NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS,
                      COMPUTE_F32, False, row_index_ptr, LHS_SOURCE_ROWS)


@triton.jit
def gather_swiglu_gmm_preactivations_kernel(
    lhs_ptr, gate_ptr, up_ptr, row_index_ptr, group_sizes_ptr, group_offset_ptr, out_ptr, gate_out_ptr, up_out_ptr,
    M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, LHS_SOURCE_ROWS: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, COMPUTE_F32: tl.constexpr,
):
    """``gather_swiglu_gmm_kernel`` that also stores both products, the backward's residuals: a
    training step's forward reads the tokens by index too, and no permuted copy is kept for the
    weight gradients (``gather_lhs_tgmm`` reads the tokens again)."""
    _swiglu_gmm_tiles(lhs_ptr, gate_ptr, up_ptr, group_sizes_ptr, group_offset_ptr, out_ptr, gate_out_ptr, up_out_ptr,
                      M, K, N, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                      NUM_PROGRAMS, COMPUTE_F32, True, row_index_ptr, LHS_SOURCE_ROWS)
