"""A persistent, warp-specialised grouped GEMM for Hopper (sm_90) in Gluon: ``out[r] = lhs[r] @ rhs[group(r)]``.

bf16 operands, float32 accumulation, bf16 output; ``lhs [M, K]`` rows sorted by group, ``rhs [E, K, N]``
read as its ``[E*K, N]`` view, group sizes on the device (any sizes, empty groups included). Needs
``K % BLOCK_K == 0`` (a weight block never reaches into the next group's rows).

``TRANSPOSE_B``: ``rhs`` is ``[E, N, K]`` (the input gradient's ``ct @ w[g]^T``), read as ``[E*N, K]`` in
``[BLOCK_N, BLOCK_K]`` boxes that the MMA reads transposed from shared memory; K is then the boxes'
contiguous axis, zero-filled past its end, so any K runs (a box's columns past ``N`` come from the next
group's rows and reach only output columns that are never stored). ``PRODUCTS = 2``: the sum of two such
products, ``lhs[r] @ rhs[g] + lhs2[r] @ rhs2[g]``, one accumulator over both contractions (SwiGLU's gate
and up cotangents into the rows' gradient, written once).

Each program is one CTA per SM, split in two partitions that meet at a ring of ``STAGES`` shared-memory
stages, each guarded by a ``ready`` and an ``empty`` mbarrier:

* the producer (one warp) walks the program's tiles (``schedule.program_tiles``) and, per K step, waits
  for a stage to be empty and issues two TMA loads into it: the whole ``[BLOCK_M, BLOCK_K]`` box of
  ``lhs`` at the tile's first row (rows past the group's end belong to the next group, or past ``M`` are
  zero-filled; they are never stored) and the ``[BLOCK_K, BLOCK_N]`` box of the ``[E*K, N]`` weights at
  ``(group * K + k, col0)``;
* the consumers (the default partition: ``num_warps`` warps, two warp groups of 64 rows at 8) wait for a
  stage, issue an asynchronous ``wgmma`` on it, keep one in flight and hand the previous stage back; the
  producer is by then filling stages for the next tile, so the loads of tile ``i + 1`` overlap tile
  ``i``'s last MMAs and its epilogue. The epilogue writes the tile's rows of the group: a whole tile
  through shared memory and a TMA store (``TMA_STORE``; the store drains while the next tile's
  mainloop runs), a partial one (the group's last) by masked stores, which never touch the next
  group's rows.

``grouped_gemm_sm90_pingpong_kernel`` splits the consumers instead: two warp groups take the program's
tiles alternately, whole, and take turns at the mainloop, so one's epilogue runs under the other's MMAs
(the MMA units otherwise idle through every epilogue, which costs most on short contractions).

Only ``triton`` is imported here; :mod:`.gluon_launch` builds the descriptors and launches it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _total_tiles(group_sizes_ptr, E, n_tiles, BLOCK_M: gl.constexpr, GROUPS_PAD: gl.constexpr):
    """Work items over all groups: ``schedule.total_tiles``."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    groups = gl.arange(0, GROUPS_PAD, layout=layout)
    sizes = gl.maximum(gl.load(group_sizes_ptr + groups, mask=groups < E, other=0), 0)
    return gl.sum((sizes + BLOCK_M - 1) // BLOCK_M, axis=0) * n_tiles


@gluon.jit
def _next_tile(tile, cursor, group_sizes_ptr, M, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               GROUP_M: gl.constexpr):
    """Walks the group cursor ``(group, its first item, its items, its first row, its size)`` forward to
    ``tile``'s group and returns ``(cursor, group, row0, row_end, col0)``: ``schedule.program_tiles``."""
    group, first_tile, group_tiles, group_row, group_size = cursor
    while tile >= first_tile + group_tiles:
        first_tile += group_tiles
        group_row += group_size
        group += 1
        group_size = gl.maximum(gl.load(group_sizes_ptr + group), 0)
        group_tiles = (group_size + BLOCK_M - 1) // BLOCK_M * n_tiles
    m_tiles = (group_size + BLOCK_M - 1) // BLOCK_M
    local = tile - first_tile
    band_width = GROUP_M * n_tiles
    first_row_tile = (local // band_width) * GROUP_M
    band_rows = gl.minimum(m_tiles - first_row_tile, GROUP_M)
    within = local % band_width
    pm = first_row_tile + within % band_rows
    pn = within // band_rows
    row0 = group_row + pm * BLOCK_M
    row_end = gl.minimum(group_row + group_size, M)
    return (group, first_tile, group_tiles, group_row, group_size), group, row0, row_end, pn * BLOCK_N


@gluon.jit
def _walk_start(group_sizes_ptr, N, E, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUPS_PAD: gl.constexpr):
    """``(column tiles, work items, the group cursor at group 0)``: what every partition's tile walk starts from."""
    n_tiles = gl.cdiv(N, BLOCK_N)
    size = gl.maximum(gl.load(group_sizes_ptr), 0)
    cursor = (0, 0, (size + BLOCK_M - 1) // BLOCK_M * n_tiles, 0, size)
    return n_tiles, _total_tiles(group_sizes_ptr, E, n_tiles, BLOCK_M, GROUPS_PAD), cursor


@gluon.jit
def _zero_rows_past_groups(out_ptr, group_sizes_ptr, M, N, E, item0, items_step, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, GROUPS_PAD: gl.constexpr):
    """Zeros into ``out``'s rows past the groups (``sum(group_sizes)`` to ``M``), ``BLOCK_M x BLOCK_N`` chunks
    ``item0, item0 + items_step, ...``: what ``zero_outside`` promises, without a zero-filled output handed in
    (a whole pass over it, and a copy where XLA shares one zeros buffer between calls). Nothing to do when
    the groups cover every row, as a dropless layer's do."""
    sizes_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    groups = gl.arange(0, GROUPS_PAD, layout=sizes_layout)
    covered = gl.minimum(gl.sum(gl.maximum(gl.load(group_sizes_ptr + groups, mask=groups < E, other=0), 0), axis=0), M)
    zero_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows_in = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, zero_layout))
    cols_in = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, zero_layout))
    zeros = gl.zeros([BLOCK_M, BLOCK_N], out_ptr.dtype.element_ty, zero_layout)
    n_tiles = gl.cdiv(N, BLOCK_N)
    items = gl.cdiv(M - covered, BLOCK_M) * n_tiles
    for item in range(item0, items, items_step):
        row0 = covered + (item // n_tiles) * BLOCK_M
        col0 = (item % n_tiles) * BLOCK_N
        mask = ((row0 + rows_in) < M)[:, None] & ((col0 + cols_in) < N)[None, :]
        offsets = (row0 + rows_in).to(gl.int64)[:, None] * N + (col0 + cols_in)[None, :]
        gl.store(out_ptr + offsets, zeros, mask=mask)


@gluon.jit
def _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, counter, row0, group, col0, K, N,
                TRANSPOSE_B: gl.constexpr):
    """One product's K steps of a tile into the ring from ring use ``counter`` on; returns the next use."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    stage_bytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for k in range(0, K, BLOCK_K):
        stage = counter % STAGES
        # a fresh mbarrier counts as having completed the phase before 0: the first pass waits on nothing
        mbarrier.wait(empty.index(stage), ((counter // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), stage_bytes)
        tma.async_copy_global_to_shared(a_desc, [row0, k], ready.index(stage), a_bufs.index(stage))
        if TRANSPOSE_B:
            tma.async_copy_global_to_shared(b_desc, [group * N + col0, k], ready.index(stage), b_bufs.index(stage))
        else:
            tma.async_copy_global_to_shared(b_desc, [group * K + k, col0], ready.index(stage), b_bufs.index(stage))
        counter += 1
    return counter


@gluon.jit
def _producer(a_desc, b_desc, a2_desc, b2_desc, a_bufs, b_bufs, ready, empty, group_sizes_ptr, M, N, K, E,
              GROUPS_PAD: gl.constexpr, GROUP_M: gl.constexpr, TRANSPOSE_B: gl.constexpr, PRODUCTS: gl.constexpr):
    """One warp: TMA loads of every tile's K steps (of each product) into the ring, a stage at a time as it empties."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0] if TRANSPOSE_B else b_desc.block_type.shape[1]
    n_tiles, total, cursor = _walk_start(group_sizes_ptr, N, E, BLOCK_M, BLOCK_N, GROUPS_PAD)
    counter = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        cursor, group, row0, row_end, col0 = _next_tile(tile, cursor, group_sizes_ptr, M, n_tiles, BLOCK_M,
                                                        BLOCK_N, GROUP_M)
        counter = _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, counter, row0, group, col0, K, N,
                              TRANSPOSE_B)
        if PRODUCTS == 2:
            counter = _load_steps(a2_desc, b2_desc, a_bufs, b_bufs, ready, empty, counter, row0, group, col0, K, N,
                                  TRANSPOSE_B)


@gluon.jit
def _mainloop(a_bufs, b_bufs, ready, empty, counter, k_steps, acc_layout: gl.constexpr, TRANSPOSE_B: gl.constexpr):
    """One tile's ``wgmma`` chain of ``k_steps`` over the ring from ring use ``counter`` on, one MMA in flight;
    every stage is handed back to the producer as soon as its MMA has retired. Returns ``(acc, counter)``."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1] if TRANSPOSE_B else b_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    for step in range(k_steps):
        stage = counter % STAGES
        mbarrier.wait(ready.index(stage), (counter // STAGES) & 1)
        if TRANSPOSE_B:
            acc = warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        # The previous step's MMA has retired in this warp group; the barrier makes it so in all of
        # them before the one arriving thread hands its stage back to the producer.
        gl.thread_barrier()
        mbarrier.arrive(empty.index((counter + STAGES - 1) % STAGES), pred=step > 0)
        counter += 1
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    gl.thread_barrier()
    mbarrier.arrive(empty.index((counter + STAGES - 1) % STAGES))
    return acc, counter


@gluon.jit
def _epilogue(acc, c_smem, out_desc, out_ptr, row0, row_end, col0, N, TMA_STORE: gl.constexpr,
              acc_layout: gl.constexpr):
    """The tile's rows of its group into ``out``: a whole tile through ``c_smem`` and a TMA store (left
    in flight: the next call waits for it before reusing ``c_smem``), a partial one by masked stores."""
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    tile_out = acc.to(out_ptr.dtype.element_ty)
    if TMA_STORE and row0 + BLOCK_M <= row_end:
        tma.store_wait(0)  # the previous tile's store has read the staging buffer
        gl.thread_barrier()
        c_smem.store(tile_out)
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(out_desc, [row0, col0], c_smem)
    else:
        rows_in = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols_in = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        offsets = rows_in[:, None] * N + cols_in[None, :]
        tile_ptr = out_ptr + row0.to(gl.int64) * N + col0
        mask = ((row0 + rows_in) < row_end)[:, None] & ((col0 + cols_in) < N)[None, :]
        gl.store(tile_ptr + offsets, tile_out, mask=mask)


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, c_smem, out_desc, out_ptr, group_sizes_ptr, M, N, K, E,
              GROUPS_PAD: gl.constexpr, GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr, TRANSPOSE_B: gl.constexpr,
              PRODUCTS: gl.constexpr, ZERO_OUTSIDE: gl.constexpr):
    """Cooperative: all ``num_warps`` warps (two warp groups of 64 rows at 8) on every tile."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1] if TRANSPOSE_B else b_bufs.type.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    n_tiles, total, cursor = _walk_start(group_sizes_ptr, N, E, BLOCK_M, BLOCK_N, GROUPS_PAD)
    k_steps = PRODUCTS * gl.cdiv(K, BLOCK_K)
    counter = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        cursor, group, row0, row_end, col0 = _next_tile(tile, cursor, group_sizes_ptr, M, n_tiles, BLOCK_M,
                                                        BLOCK_N, GROUP_M)
        acc, counter = _mainloop(a_bufs, b_bufs, ready, empty, counter, k_steps, acc_layout, TRANSPOSE_B)
        _epilogue(acc, c_smem, out_desc, out_ptr, row0, row_end, col0, N, TMA_STORE, acc_layout)
    if ZERO_OUTSIDE:
        _zero_rows_past_groups(out_ptr, group_sizes_ptr, M, N, E, gl.program_id(0), gl.num_programs(0), BLOCK_M,
                               BLOCK_N, GROUPS_PAD)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _pingpong_consumer(a_bufs, b_bufs, ready, empty, turn, c_smem, out_desc, out_ptr, group_sizes_ptr, M, N, K, E,
                       GROUPS_PAD: gl.constexpr, GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr,
                       TRANSPOSE_B: gl.constexpr, PRODUCTS: gl.constexpr, ZERO_OUTSIDE: gl.constexpr,
                       WG: gl.constexpr):
    """Ping-pong: warp group ``WG`` (of 2) takes every other tile of the program, whole. The two take
    turns at the mainloop (``turn``), so one's epilogue runs under the other's MMAs; taking turns also
    keeps each within one phase of the ring's barriers (the other's uses come between its own)."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1] if TRANSPOSE_B else b_bufs.type.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    n_tiles, total, cursor = _walk_start(group_sizes_ptr, N, E, BLOCK_M, BLOCK_N, GROUPS_PAD)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    k_steps = PRODUCTS * gl.cdiv(K, BLOCK_K)
    for tile in range(pid + WG * programs, total, 2 * programs):
        cursor, group, row0, row_end, col0 = _next_tile(tile, cursor, group_sizes_ptr, M, n_tiles, BLOCK_M,
                                                        BLOCK_N, GROUP_M)
        program_tile = (tile - pid) // programs
        # warp group 0's first turn passes on the fresh barrier; warp group 1's waits for 0's first tile
        mbarrier.wait(turn.index(WG), ((program_tile // 2) & 1) ^ (1 - WG))
        acc, counter = _mainloop(a_bufs, b_bufs, ready, empty, program_tile * k_steps, k_steps, acc_layout,
                                 TRANSPOSE_B)
        mbarrier.arrive(turn.index(1 - WG))
        _epilogue(acc, c_smem, out_desc, out_ptr, row0, row_end, col0, N, TMA_STORE, acc_layout)
    if ZERO_OUTSIDE:
        _zero_rows_past_groups(out_ptr, group_sizes_ptr, M, N, E, 2 * pid + WG, 2 * programs, BLOCK_M, BLOCK_N,
                               GROUPS_PAD)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def allocate_ring(a_desc, b_desc, STAGES: gl.constexpr):
    """The operand ring ``(a_bufs, b_bufs, ready, empty)``: ``STAGES`` boxes of each descriptor and their
    barriers, initialised (the caller fences them, with any barriers of its own, before use)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return a_bufs, b_bufs, ready, empty


@gluon.jit
def allocate_turns():
    """The ping-pong warp groups' two ``turn`` barriers, initialised (the caller fences them)."""
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    return turn


@gluon.jit
def grouped_gemm_sm90_kernel(a_desc, b_desc, a2_desc, b2_desc, out_desc, out_ptr, group_sizes_ptr, M, N, K, E,
                             GROUPS_PAD: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                             TMA_STORE: gl.constexpr, TRANSPOSE_B: gl.constexpr, PRODUCTS: gl.constexpr,
                             ZERO_OUTSIDE: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """``out[r] = lhs[r] @ rhs[group(r)]`` (``+ lhs2[r] @ rhs2[group(r)]`` with ``PRODUCTS = 2``) for the rows
    of the groups; rows past ``sum(group_sizes)`` zero with ``ZERO_OUTSIDE``, else left unwritten. ``a_desc``: ``lhs [M, K]`` in
    ``[BLOCK_M, BLOCK_K]`` boxes; ``b_desc``: ``rhs`` as ``[E*K, N]`` in ``[BLOCK_K, BLOCK_N]`` boxes (as
    ``[E*N, K]`` in ``[BLOCK_N, BLOCK_K]`` boxes with ``TRANSPOSE_B``); ``a2_desc``, ``b2_desc``: the second
    product's, read only with ``PRODUCTS = 2``; ``out_desc``: ``out [M, N]`` in ``[BLOCK_M, BLOCK_N]`` boxes
    (read only with ``TMA_STORE``); ``out_ptr``: the same output."""
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    a_bufs, b_bufs, ready, empty = allocate_ring(a_desc, b_desc, STAGES)
    # without TMA_STORE the staging buffer is never used: a token 8 rows
    C_ROWS: gl.constexpr = BLOCK_M if TMA_STORE else 8
    c_smem = gl.allocate_shared_memory(out_desc.dtype, [C_ROWS, BLOCK_N], out_desc.layout)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, c_smem, out_desc, out_ptr, group_sizes_ptr, M, N, K, E,
                     GROUPS_PAD, GROUP_M, TMA_STORE, TRANSPOSE_B, PRODUCTS, ZERO_OUTSIDE)),
        (_producer, (a_desc, b_desc, a2_desc, b2_desc, a_bufs, b_bufs, ready, empty, group_sizes_ptr, M, N, K, E,
                     GROUPS_PAD, GROUP_M, TRANSPOSE_B, PRODUCTS)),
    ], [1], [PRODUCER_REGS])


@gluon.jit
def grouped_gemm_sm90_pingpong_kernel(a_desc, b_desc, a2_desc, b2_desc, out_desc, out_ptr, group_sizes_ptr, M, N, K,
                                      E, GROUPS_PAD: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                                      TMA_STORE: gl.constexpr, TRANSPOSE_B: gl.constexpr, PRODUCTS: gl.constexpr,
                                      ZERO_OUTSIDE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                      PRODUCER_REGS: gl.constexpr):
    """:func:`grouped_gemm_sm90_kernel` with two consumer warp groups taking whole tiles in turn (the
    default partition, ``num_warps`` = 4, and a worker of 4 warps), each with its own staging buffer."""
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    a_bufs, b_bufs, ready, empty = allocate_ring(a_desc, b_desc, STAGES)
    C_ROWS: gl.constexpr = BLOCK_M if TMA_STORE else 8
    c_smem = gl.allocate_shared_memory(out_desc.dtype, [2, C_ROWS, BLOCK_N], out_desc.layout)
    turn = allocate_turns()
    fence_async_shared()

    gl.warp_specialize([
        (_pingpong_consumer, (a_bufs, b_bufs, ready, empty, turn, c_smem.index(0), out_desc, out_ptr,
                              group_sizes_ptr, M, N, K, E, GROUPS_PAD, GROUP_M, TMA_STORE, TRANSPOSE_B, PRODUCTS, ZERO_OUTSIDE, 0)),
        (_pingpong_consumer, (a_bufs, b_bufs, ready, empty, turn, c_smem.index(1), out_desc, out_ptr,
                              group_sizes_ptr, M, N, K, E, GROUPS_PAD, GROUP_M, TMA_STORE, TRANSPOSE_B, PRODUCTS, ZERO_OUTSIDE, 1)),
        (_producer, (a_desc, b_desc, a2_desc, b2_desc, a_bufs, b_bufs, ready, empty, group_sizes_ptr, M, N, K, E,
                     GROUPS_PAD, GROUP_M, TRANSPOSE_B, PRODUCTS)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
