"""Triton kernel for grouped matrix products with FP8 weights dequantised in registers (W8A16).

Same on-device scheduling as the grouped matmul's ``gmm_kernel``, through its helpers (per-group
row tiles from the cumulative group sizes, persistent programs, bands of ``GROUP_M`` row tiles,
zero rows outside the local groups). Each K step loads a ``BLOCK_K x BLOCK_N`` tile of FP8 weights
(one byte an element: half the weight traffic of bf16) and the row of block scales covering it,
forms ``(fp8 -> f32) * scale`` rounded once to the activation dtype in registers, which is the
arithmetic of ``dequantize_blocks``, and feeds that to the tensor-core dot with a float32
accumulator. No dequantised weight goes through memory. Contract: :mod:`.reference`. Only
``triton`` is imported, so the kernel also runs under Triton's interpreter on a CPU.

Two operand orders, picked by ``WEIGHT_AS_LHS``:

* off: ``acc[BLOCK_M, BLOCK_N] += dot(lhs tile [BLOCK_M, BLOCK_K], weight tile [BLOCK_K, BLOCK_N])``.
  The dequantised weight is the dot's B operand, which Hopper's wgmma reads only from shared
  memory, so Triton writes the converted tile back to shared memory (or falls back to mma.sync):
  2-3x slower than the bf16 ``gmm`` on an H200.
* on: the transposed tile, ``acc_t[BLOCK_N, BLOCK_M] += dot(weight^T tile [BLOCK_N, BLOCK_K],
  lhs^T tile [BLOCK_K, BLOCK_M])``, stored as ``trans(acc_t)``. The weight is loaded already
  transposed (pointer arithmetic, no shuffle in registers) and dequantised with the same
  arithmetic; as the dot's A operand it may stay in registers (wgmma's register-A form), while the
  activations, B, stream through shared memory as in the bf16 kernel. The MMA's M is ``BLOCK_N``
  (wgmma wants a multiple of 64) and its N is ``BLOCK_M``.

Both give the same result up to float32 accumulation order (the same products, summed by K step).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_lowering.kernels.grouped_matmul.triton_kernels import _group_layout, _tile_position, _zero_outside_groups


@triton.jit
def fp8_gmm_kernel(
    lhs_ptr,
    values_ptr,
    scales_ptr,
    group_sizes_ptr,
    group_offset_ptr,
    out_ptr,
    M: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
    E8M0_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WEIGHT_AS_LHS: tl.constexpr = False,
):
    """``out[r] = lhs[r] @ dequantise(rhs)[group(r) - offset]`` for rows of local groups, zero elsewhere.

    ``values`` is ``[G, K, N]`` float8_e4m3fn and ``scales`` ``[G, K // SCALE_BLOCK_K, N // SCALE_BLOCK_N]``:
    float32, or with ``E8M0_SCALES`` uint8 exponents ``e`` standing for ``2**(e - 127)`` (built from
    the bits, exact; ``e = 0``, a subnormal, reads as 0 as under flush-to-zero). ``BLOCK_K`` divides
    ``SCALE_BLOCK_K`` (so also ``K``): a K step never spans two scale blocks and needs one row of scales.
    ``WEIGHT_AS_LHS``: compute the transposed tile with the weight as the dot's first operand (module note).
    """
    tl.static_assert(SCALE_BLOCK_K % BLOCK_K == 0, "BLOCK_K must divide SCALE_BLOCK_K")
    scale_cols: tl.constexpr = N // SCALE_BLOCK_N
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
        cols_ok = cols < N
        local_group = tl.cast(group - offset, tl.int64)
        row_base = lhs_ptr + tl.cast(row0, tl.int64) * K
        s_ptrs = scales_ptr + local_group * ((K // SCALE_BLOCK_K) * scale_cols) + cols // SCALE_BLOCK_N
        if WEIGHT_AS_LHS:
            # Element (k, m) of lhs^T is lhs[row0 + m, k]; element (n, k) of weight^T is values[g, k, n].
            a_ptrs = row_base + tile_rows[None, :] * K + in_k[:, None]
            v_ptrs = values_ptr + local_group * (K * N) + in_k[None, :] * N + cols[:, None]
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            a_ptrs = row_base + tile_rows[:, None] * K + in_k[None, :]
            v_ptrs = values_ptr + local_group * (K * N) + in_k[:, None] * N + cols[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs)
            scale_row_ptrs = s_ptrs + (k0 // SCALE_BLOCK_K) * scale_cols
            if N % BLOCK_N == 0:
                fp8 = tl.load(v_ptrs)
                scale = tl.load(scale_row_ptrs)
            elif WEIGHT_AS_LHS:
                fp8 = tl.load(v_ptrs, mask=cols_ok[:, None], other=0.0)
                scale = tl.load(scale_row_ptrs, mask=cols_ok, other=0)
            else:
                fp8 = tl.load(v_ptrs, mask=cols_ok[None, :], other=0.0)
                scale = tl.load(scale_row_ptrs, mask=cols_ok, other=0)
            if E8M0_SCALES:
                scale = (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            if WEIGHT_AS_LHS:
                weight_t = (fp8.to(tl.float32) * scale[:, None]).to(a.dtype)
                acc = tl.dot(weight_t, a, acc)
            else:
                weight = (fp8.to(tl.float32) * scale[None, :]).to(a.dtype)
                acc = tl.dot(a, weight, acc)
            a_ptrs += BLOCK_K
            v_ptrs += BLOCK_K * N

        if WEIGHT_AS_LHS:
            acc = tl.trans(acc)
        rows = row0 + in_m
        out_ptrs = out_ptr + tl.cast(row0, tl.int64) * N + in_m[:, None] * N + cols[None, :]
        store_mask = (rows < group_end)[:, None] & cols_ok[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)

    _zero_outside_groups(out_ptr, pid, sizes, group_ids, offset, is_local, n_tiles, M, N, BLOCK_M, BLOCK_N,
                         NUM_PROGRAMS)
