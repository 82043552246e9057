"""The weight-gradient grouped product for Hopper (sm_90) in Gluon: ``dw[g] = lhs[rows of g]^T @ dout[rows of g]``.

bf16 operands, float32 accumulation, bf16 or float32 output (``out``'s type); ``lhs [M, K]`` and ``dout
[M, N]`` rows sorted by group, group sizes on the device (any sizes, empty groups included: their
``dw[g]`` is zero), ``dw [E, K, N]`` written through its ``[E*K, N]`` view.

Work items are the output tiles ``(group, k tile, n tile)`` (``schedule.weight_tiles``): ``E * k_tiles *
n_tiles`` of them whatever the sizes, each reducing over its group's rows ``BLOCK_M`` at a time. The
partitions meet at a ring of ``STAGES`` stages with ``ready`` / ``empty`` mbarriers, as in
:mod:`.gluon_kernels`:

* the producer (one warp) loads, per row block, the ``[BLOCK_M, BLOCK_K]`` box of ``lhs`` at ``(r,
  k0)`` and the ``[BLOCK_M, BLOCK_N]`` box of ``dout`` at ``(r, n0)``;
* the consumers (``num_warps`` warps, one 64-row warp group of the ``BLOCK_K`` output rows each 4)
  issue ``wgmma(lhs_box^T, dout_box)``, the transpose a permuted view of the shared box (``wgmma``
  reads a 16-bit A operand M-major as well as K-major), one MMA in flight.

A group's last row block reaches past its end: TMA zero-fills rows past ``M`` only, so the rows there
are the next group's (or whatever follows the groups). The consumers zero them in shared memory
before that block's MMA (both boxes: a row past the groups may hold non-finite values, and
``0 * inf`` is not 0), then fence the generic writes against the MMA's async proxy. That is one
register round trip of two boxes per group per tile (1 step of ~``size / BLOCK_M``); the other way,
a descriptor per group bounded at the group's end, needs descriptors made on the device (global
scratch and a tensormap fence per group) for the same effect.

An empty group's tiles take no ring steps: the producer skips them and the consumers store zeros.

A launch may take only some groups (``min_group_rows``; the resident kernel: those its rows hold), decided
on the device by the sizes, so two launches share the groups without the host knowing them. The
persistent loops are ``while`` loops stepping by ``_next_item``: a skipped group costs one step a program,
not one an item. (Measured, ``benchmarks/results/gluon_tgmm_ab_split_H200_2026-11-29.log``: the streaming kernel
at DeepSeek-V3's ~128-row groups took 3.08-3.38 ms a product with a ``for ... range`` persistent loop and
2.72-2.83 as it is now, the same MMAs and loads; the forward kernels gained nothing from the loop form.)

``tgmm_sm90_pingpong_kernel`` splits the consumers as :mod:`.gluon_kernels`' ping-pong kernel does: two
warp groups take the program's tiles alternately, whole, and take turns at the mainloop, so one's
epilogue runs under the other's MMAs (short reductions: groups of a few row blocks). A tile's ring steps
depend on its group's size, so each warp group walks all of the program's tiles and counts the other's
steps to know where in the ring its own tile starts.

``tgmm_sm90_resident_kernel`` (small groups) keeps a group's ``dout`` columns in shared memory across
consecutive k tiles and streams only ``lhs`` (the section's comment below says how).
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

from moe_lowering.kernels.grouped_matmul_sm90.gluon_kernels import allocate_ring, allocate_turns


@gluon.jit
def _walk_to_group(cursor, target, group_sizes_ptr):
    """The group cursor ``(group, its first row, its size)`` walked forward to group ``target``."""
    group, group_row, group_size = cursor
    while group < target:
        group_row += group_size
        group += 1
        group_size = gl.maximum(gl.load(group_sizes_ptr + group), 0)
    return group, group_row, group_size


@gluon.jit
def _weight_tile(tile, cursor, group_sizes_ptr, M, k_tiles, n_tiles, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
                 GROUP_M: gl.constexpr):
    """Walks the group cursor ``(group, its first row, its size)`` forward to ``tile``'s group and
    returns ``(cursor, group, row0, row_end, k0, n0)``: ``schedule.weight_tiles``."""
    group, group_row, group_size = _walk_to_group(cursor, tile // (k_tiles * n_tiles), group_sizes_ptr)
    local = tile % (k_tiles * n_tiles)
    band_width = GROUP_M * n_tiles
    first_k_tile = (local // band_width) * GROUP_M
    band_rows = gl.minimum(k_tiles - first_k_tile, GROUP_M)
    within = local % band_width
    pk = first_k_tile + within % band_rows
    pn = within // band_rows
    row0 = gl.minimum(group_row, M)
    row_end = gl.minimum(group_row + group_size, M)
    return (group, group_row, group_size), group, row0, row_end, pk * BLOCK_K, pn * BLOCK_N


@gluon.jit
def _walk_start(group_sizes_ptr, K, N, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr):
    """``(k tiles, n tiles, the group cursor at group 0)``."""
    return gl.cdiv(K, BLOCK_K), gl.cdiv(N, BLOCK_N), (0, 0, gl.maximum(gl.load(group_sizes_ptr), 0))


@gluon.jit
def _launch_items(group_sizes_ptr, E, per_group, min_group_rows):
    """The launch's item count: every group's items, or none where no group has ``min_group_rows`` rows (the
    streaming launch beside a resident one on small groups only: its programs then end at once instead of
    walking every group's size, ~0.1 ms at 256 groups)."""
    CHUNK: gl.constexpr = 32
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    largest = 0
    if min_group_rows > 0:
        for g0 in range(0, E, CHUNK):
            groups = g0 + gl.arange(0, CHUNK, layout=layout)
            largest = gl.maximum(largest, gl.max(gl.load(group_sizes_ptr + groups, mask=groups < E, other=0), axis=0))
    return gl.where(largest >= min_group_rows, E * per_group, 0)


@gluon.jit
def _next_item(item, group, per_group, taken):
    """The program's next item: ``num_programs`` on, or past a group another launch takes, the program's
    first item of the next group (the items of the groups taken keep their programs; the skipped ones cost
    one step a group, not one an item)."""
    step = gl.num_programs(0)
    if taken:
        return item + step
    return item + gl.cdiv((group + 1) * per_group - item, step) * step


@gluon.jit
def _tgmm_producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_sizes_ptr, M, N, K, E, min_group_rows,
                   GROUP_M: gl.constexpr):
    """One warp: both boxes of every row block of every tile of the launch's groups into the ring, a stage at a
    time as it empties."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    stage_bytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    k_tiles, n_tiles, cursor = _walk_start(group_sizes_ptr, K, N, BLOCK_K, BLOCK_N)
    counter = 0
    tile = gl.program_id(0)
    items = _launch_items(group_sizes_ptr, E, k_tiles * n_tiles, min_group_rows)
    while tile < items:
        cursor, group, row0, row_end, k0, n0 = _weight_tile(tile, cursor, group_sizes_ptr, M, k_tiles, n_tiles,
                                                            BLOCK_K, BLOCK_N, GROUP_M)
        taken = cursor[2] >= min_group_rows
        if taken:
            for r in range(row0, row_end, BLOCK_M):
                stage = counter % STAGES
                # a fresh mbarrier counts as having completed the phase before 0: the first pass waits on nothing
                mbarrier.wait(empty.index(stage), ((counter // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(stage), stage_bytes)
                tma.async_copy_global_to_shared(a_desc, [r, k0], ready.index(stage), a_bufs.index(stage))
                tma.async_copy_global_to_shared(b_desc, [r, n0], ready.index(stage), b_bufs.index(stage))
                counter += 1
        tile = _next_item(tile, group, k_tiles * n_tiles, taken)


@gluon.jit
def _zero_rows_from(buf, first_zero_row):
    """Rows ``first_zero_row`` on of a ``[rows, cols]`` bf16 shared box set to zero (a register round trip)."""
    ROWS: gl.constexpr = buf.type.shape[0]
    COLS: gl.constexpr = buf.type.shape[1]
    LANES_C: gl.constexpr = 32 if COLS >= 256 else COLS // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANES_C, LANES_C], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    values = buf.load(layout)
    buf.store(gl.where((rows < first_zero_row)[:, None], values, gl.zeros_like(values)))


@gluon.jit
def _zero_chunk_past(buf, rows_left, TAIL_ROWS: gl.constexpr):
    """Rows ``rows_left`` on of the ``TAIL_ROWS``-row chunk of ``buf`` holding row ``rows_left`` set to zero
    (nothing when ``rows_left`` ends a chunk)."""
    BLOCK_M: gl.constexpr = buf.type.shape[0]
    for chunk in gl.static_range(BLOCK_M // TAIL_ROWS):
        if chunk == rows_left // TAIL_ROWS:
            _zero_rows_from(buf.slice(chunk * TAIL_ROWS, TAIL_ROWS), rows_left - chunk * TAIL_ROWS)


@gluon.jit
def _block_product(a_buf, b_buf, acc, rows_left, TAIL_ROWS: gl.constexpr, ZERO_B: gl.constexpr):
    """``acc += a_buf^T @ b_buf`` over a row block's first ``rows_left`` rows, one MMA left in flight. A block
    reaching past them (a group's last) is multiplied in ``TAIL_ROWS``-row chunks, only those holding rows,
    the last zeroed past them in ``a_buf`` (and ``b_buf`` with ``ZERO_B``) first: rows past a group are the
    next group's, or non-finite, and ``0 * inf`` is not 0."""
    BLOCK_M: gl.constexpr = a_buf.type.shape[0]
    if rows_left < BLOCK_M:
        _zero_chunk_past(a_buf, rows_left, TAIL_ROWS)
        if ZERO_B:
            _zero_chunk_past(b_buf, rows_left, TAIL_ROWS)
        fence_async_shared()
        gl.thread_barrier()
        # each MMA waited for down to one in flight inside its branch: an accumulator in flight cannot leave one
        for chunk in gl.static_range(BLOCK_M // TAIL_ROWS):
            if chunk * TAIL_ROWS < rows_left:
                acc = warpgroup_mma(a_buf.slice(chunk * TAIL_ROWS, TAIL_ROWS).permute((1, 0)),
                                    b_buf.slice(chunk * TAIL_ROWS, TAIL_ROWS), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc, ))
    else:
        acc = warpgroup_mma(a_buf.permute((1, 0)), b_buf, acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
    return acc


@gluon.jit
def _reduce_rows(a_bufs, b_bufs, ready, empty, counter, acc, row0, row_end, TAIL_ROWS: gl.constexpr,
                 RESIDENT: gl.constexpr):
    """``acc += lhs^T @ dout`` over rows ``[row0, row_end)`` in row blocks, each ``lhs`` box from the ring at
    use ``counter`` on, its ``dout`` block from the same stage or, ``RESIDENT``, the ``b_bufs`` block of the
    rows held in shared memory (zeroed past the group when they arrived). One MMA in flight; each stage
    handed back once its MMA has retired; no steps for no rows. Returns ``(acc, counter)``."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    for r in range(row0, row_end, BLOCK_M):
        stage = counter % STAGES
        mbarrier.wait(ready.index(stage), (counter // STAGES) & 1)
        b_buf = b_bufs.index((r - row0) // BLOCK_M) if RESIDENT else b_bufs.index(stage)
        acc = _block_product(a_bufs.index(stage), b_buf, acc, row_end - r, TAIL_ROWS, not RESIDENT)
        # the previous step's MMA has retired in this warp group; the barrier makes it so in all of them
        gl.thread_barrier()
        mbarrier.arrive(empty.index((counter + STAGES - 1) % STAGES), pred=r > row0)
        counter += 1
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    gl.thread_barrier()
    mbarrier.arrive(empty.index((counter + STAGES - 1) % STAGES), pred=row_end > row0)
    return acc, counter


@gluon.jit
def _tgmm_mainloop(a_bufs, b_bufs, ready, empty, counter, row0, row_end, acc_layout: gl.constexpr,
                   TAIL_ROWS: gl.constexpr):
    """One tile's ``wgmma`` chain over its group's row blocks (both boxes from the ring) from ring use
    ``counter`` on; zeros for an empty group.

    The group's last block, where it reaches past the group: only its ``TAIL_ROWS``-row chunks holding
    the group's rows are multiplied (one ``wgmma`` each), and only the last of them is zeroed past the
    group (with ``TAIL_ROWS == BLOCK_M``: the whole block, zeroed past the group). A smaller chunk is a
    fraction of the register round trip, which groups of a few blocks pay every tile. Returns ``(acc,
    counter)``."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    acc = gl.zeros([BLOCK_K, BLOCK_N], gl.float32, acc_layout)
    return _reduce_rows(a_bufs, b_bufs, ready, empty, counter, acc, row0, row_end, TAIL_ROWS, False)


@gluon.jit
def _tgmm_epilogue(acc, c_smem, out_desc, out_ptr, out_row0, k0, n0, K, N, TMA_STORE: gl.constexpr,
                   acc_layout: gl.constexpr, PENDING: gl.constexpr):
    """The ``[k0 : k0 + BLOCK_K, n0 : n0 + BLOCK_N]`` tile of one group's ``[K, N]`` output (whose first
    row of the ``[E*K, N]`` view is ``out_row0``): through the staging buffer ``c_smem`` and a TMA store
    left in flight (``TMA_STORE``: needs ``K % BLOCK_K == 0``; TMA clips columns past ``N``), else by
    masked stores. ``PENDING``: the stores that may stay in flight when ``c_smem`` is written (the
    staging buffers past this one: each tile's store has that many tiles' time to drain)."""
    BLOCK_K: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    tile_out = acc.to(out_ptr.dtype.element_ty)
    if TMA_STORE:
        tma.store_wait(PENDING)  # the store that last used this staging buffer has read it
        gl.thread_barrier()
        c_smem.store(tile_out)
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(out_desc, [out_row0 + k0, n0], c_smem)
    else:
        ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        tile_ptr = out_ptr + (out_row0 + k0).to(gl.int64) * N + n0
        mask = ((k0 + ks) < K)[:, None] & ((n0 + cols) < N)[None, :]
        gl.store(tile_ptr + ks[:, None] * N + cols[None, :], tile_out, mask=mask)


@gluon.jit
def _tgmm_consumer(a_bufs, b_bufs, ready, empty, c_smem, out_desc, out_ptr, group_sizes_ptr, M, N, K, E,
                   min_group_rows, GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr, TAIL_ROWS: gl.constexpr):
    """Cooperative: all ``num_warps`` warps (a warp group per 64 output rows) on every tile of the launch's
    groups, its staging buffers (``c_smem [STAGING, ...]``) taken in turn by the tiles stored (a skipped tile
    takes none: each buffer's last store is then ``STAGING`` stores back)."""
    STAGING: gl.constexpr = c_smem.type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    k_tiles, n_tiles, cursor = _walk_start(group_sizes_ptr, K, N, BLOCK_K, BLOCK_N)
    counter = 0
    program_tile = 0
    tile = gl.program_id(0)
    items = _launch_items(group_sizes_ptr, E, k_tiles * n_tiles, min_group_rows)
    while tile < items:
        cursor, group, row0, row_end, k0, n0 = _weight_tile(tile, cursor, group_sizes_ptr, M, k_tiles, n_tiles,
                                                            BLOCK_K, BLOCK_N, GROUP_M)
        taken = cursor[2] >= min_group_rows
        if taken:
            acc, counter = _tgmm_mainloop(a_bufs, b_bufs, ready, empty, counter, row0, row_end, acc_layout,
                                          TAIL_ROWS)
            _tgmm_epilogue(acc, c_smem.index(program_tile % STAGING), out_desc, out_ptr, group * K, k0, n0, K, N,
                           TMA_STORE, acc_layout, STAGING - 1)
            program_tile += 1
        tile = _next_item(tile, group, k_tiles * n_tiles, taken)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _tgmm_pingpong_consumer(a_bufs, b_bufs, ready, empty, turn, c_smem, out_desc, out_ptr, group_sizes_ptr, M, N, K,
                            E, min_group_rows, GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr,
                            TAIL_ROWS: gl.constexpr, WG: gl.constexpr):
    """Ping-pong: warp group ``WG`` (of 2) takes every other tile of the program's tiles of the launch's groups,
    whole, in turns at the mainloop (``turn``, as ``gluon_kernels._pingpong_consumer``); the other's tiles
    only advance its ring count."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    k_tiles, n_tiles, cursor = _walk_start(group_sizes_ptr, K, N, BLOCK_K, BLOCK_N)
    counter = 0
    program_tile = 0
    tile = gl.program_id(0)
    items = _launch_items(group_sizes_ptr, E, k_tiles * n_tiles, min_group_rows)
    while tile < items:
        cursor, group, row0, row_end, k0, n0 = _weight_tile(tile, cursor, group_sizes_ptr, M, k_tiles, n_tiles,
                                                            BLOCK_K, BLOCK_N, GROUP_M)
        taken = cursor[2] >= min_group_rows
        if taken:
            if program_tile % 2 == WG:
                # warp group 0's first turn passes on the fresh barrier; warp group 1's waits for 0's first tile
                mbarrier.wait(turn.index(WG), ((program_tile // 2) & 1) ^ (1 - WG))
                acc, counter = _tgmm_mainloop(a_bufs, b_bufs, ready, empty, counter, row0, row_end, acc_layout,
                                              TAIL_ROWS)
                mbarrier.arrive(turn.index(1 - WG))
                _tgmm_epilogue(acc, c_smem, out_desc, out_ptr, group * K, k0, n0, K, N, TMA_STORE, acc_layout, 0)
            else:
                counter += gl.cdiv(row_end - row0, BLOCK_M)
            program_tile += 1
        tile = _next_item(tile, group, k_tiles * n_tiles, taken)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def tgmm_sm90_kernel(a_desc, b_desc, out_desc, out_ptr, group_sizes_ptr, M, N, K, E, min_group_rows,
                     GROUP_M: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr, TAIL_ROWS: gl.constexpr,
                     STAGING: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """``out[g] = lhs[rows of g]^T @ dout[rows of g]`` for every group ``g < E`` of at least ``min_group_rows``
    rows (zero for empty ones with ``min_group_rows`` 0; the others' ``out[g]`` is left as it was: the
    resident kernel's groups).
    ``a_desc``: ``lhs [M, K]`` in ``[BLOCK_M, BLOCK_K]`` boxes; ``b_desc``: ``dout [M, N]`` in ``[BLOCK_M,
    BLOCK_N]`` boxes; ``out_desc``: ``out [E, K, N]`` as ``[E*K, N]`` in ``[BLOCK_K, BLOCK_N]`` boxes
    (read only with ``TMA_STORE``); ``out_ptr``: the same output. ``TAIL_ROWS``: the granularity of a
    group's last row block (see ``_tgmm_mainloop``); ``STAGING``: staging buffers of the TMA store."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    a_bufs, b_bufs, ready, empty = allocate_ring(a_desc, b_desc, STAGES)
    # without TMA_STORE the staging buffer is never used: a token 8 rows
    C_ROWS: gl.constexpr = BLOCK_K if TMA_STORE else 8
    c_smem = gl.allocate_shared_memory(out_desc.dtype, [STAGING if TMA_STORE else 1, C_ROWS, BLOCK_N],
                                       out_desc.layout)
    fence_async_shared()

    gl.warp_specialize([
        (_tgmm_consumer, (a_bufs, b_bufs, ready, empty, c_smem, out_desc, out_ptr, group_sizes_ptr, M, N, K, E,
                          min_group_rows, GROUP_M, TMA_STORE, TAIL_ROWS)),
        (_tgmm_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_sizes_ptr, M, N, K, E, min_group_rows,
                          GROUP_M)),
    ], [1], [PRODUCER_REGS])


@gluon.jit
def tgmm_sm90_pingpong_kernel(a_desc, b_desc, out_desc, out_ptr, group_sizes_ptr, M, N, K, E, min_group_rows,
                              GROUP_M: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr,
                              TAIL_ROWS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """:func:`tgmm_sm90_kernel` with two consumer warp groups taking whole tiles in turn (the default
    partition, ``num_warps`` = 4, and a worker of 4 warps), each with its own staging buffer."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    a_bufs, b_bufs, ready, empty = allocate_ring(a_desc, b_desc, STAGES)
    C_ROWS: gl.constexpr = BLOCK_K if TMA_STORE else 8
    c_smem = gl.allocate_shared_memory(out_desc.dtype, [2, C_ROWS, BLOCK_N], out_desc.layout)
    turn = allocate_turns()
    fence_async_shared()

    gl.warp_specialize([
        (_tgmm_pingpong_consumer, (a_bufs, b_bufs, ready, empty, turn, c_smem.index(0), out_desc, out_ptr,
                                   group_sizes_ptr, M, N, K, E, min_group_rows, GROUP_M, TMA_STORE, TAIL_ROWS, 0)),
        (_tgmm_pingpong_consumer, (a_bufs, b_bufs, ready, empty, turn, c_smem.index(1), out_desc, out_ptr,
                                   group_sizes_ptr, M, N, K, E, min_group_rows, GROUP_M, TMA_STORE, TAIL_ROWS, 1)),
        (_tgmm_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_sizes_ptr, M, N, K, E, min_group_rows,
                          GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------ resident dout
#
# Small groups: a tile reduces over a group's ~2 row blocks and loads both operands for it, 1.5-1.9 bytes
# in a byte out at DeepSeek-V3's sizes. ``tgmm_sm90_resident_kernel`` keeps a group's ``dout`` columns in
# shared memory (up to ``RES_BLOCKS`` row blocks) across ``K_CHUNK`` consecutive k tiles and streams only
# ``lhs``. Work items are ``(group, k chunk, n tile)``, n fastest, so the programs running at once read the
# same ``lhs`` rows (once from HBM, the rest from L2). It takes only the groups its rows hold: a longer
# group would reload its ``dout`` every k tile behind the MMAs (1.5x the streaming kernel's time), so
# ``tgmm_sm90_kernel`` takes those in a second launch (``min_group_rows``), both deciding by the sizes on
# the device.


@gluon.jit
def _resident_item(item, cursor, group_sizes_ptr, M, k_chunks, n_tiles, RES_ROWS: gl.constexpr,
                   BLOCK_N: gl.constexpr):
    """Walks the group cursor forward to ``item``'s group and returns ``(cursor, group, row0, row_end, k
    chunk, n0, taken)``: ``taken`` when the group fits the resident rows (else another launch's)."""
    group, group_row, group_size = _walk_to_group(cursor, item // (k_chunks * n_tiles), group_sizes_ptr)
    local = item % (k_chunks * n_tiles)
    row0 = gl.minimum(group_row, M)
    row_end = gl.minimum(group_row + group_size, M)
    return ((group, group_row, group_size), group, row0, row_end, local // n_tiles, (local % n_tiles) * BLOCK_N,
            group_size <= RES_ROWS)


@gluon.jit
def _resident_producer(a_desc, b_desc, a_bufs, res, ready, empty, res_ready, res_empty, group_sizes_ptr, M, N, K,
                       E, K_CHUNK: gl.constexpr):
    """One warp: per item of a group it takes, the group's ``dout`` rows into ``res`` once, then the ``lhs``
    boxes of every k tile into the ring."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    RES_BLOCKS: gl.constexpr = res.type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    lhs_bytes: gl.constexpr = a_desc.block_type.nbytes
    dout_bytes: gl.constexpr = b_desc.block_type.nbytes
    k_tiles, n_tiles, cursor = _walk_start(group_sizes_ptr, K, N, BLOCK_K, BLOCK_N)
    k_chunks = gl.cdiv(k_tiles, K_CHUNK)
    counter = 0
    windows = 0
    item = gl.program_id(0)
    while item < E * k_chunks * n_tiles:
        cursor, group, row0, row_end, chunk, n0, taken = _resident_item(item, cursor, group_sizes_ptr, M, k_chunks,
                                                                        n_tiles, RES_BLOCKS * BLOCK_M, BLOCK_N)
        if taken & (row_end > row0):
            mbarrier.wait(res_empty, (windows & 1) ^ 1)
            blocks = gl.cdiv(row_end - row0, BLOCK_M)
            for count in gl.static_range(1, RES_BLOCKS + 1):
                mbarrier.expect(res_ready, count * dout_bytes, pred=blocks == count)
            for b in gl.static_range(RES_BLOCKS):
                tma.async_copy_global_to_shared(b_desc, [row0 + b * BLOCK_M, n0], res_ready, res.index(b),
                                                pred=b < blocks)
            windows += 1
            first_kt = chunk * K_CHUNK
            for kt in range(first_kt, gl.minimum(first_kt + K_CHUNK, k_tiles)):
                for r in range(row0, row_end, BLOCK_M):
                    stage = counter % STAGES
                    mbarrier.wait(empty.index(stage), ((counter // STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(stage), lhs_bytes)
                    tma.async_copy_global_to_shared(a_desc, [r, kt * BLOCK_K], ready.index(stage), a_bufs.index(stage))
                    counter += 1
        item = _next_item(item, group, k_chunks * n_tiles, taken)


@gluon.jit
def _resident_consumer(a_bufs, res, ready, empty, res_ready, res_empty, c_smem, out_desc, out_ptr, group_sizes_ptr,
                       M, N, K, E, K_CHUNK: gl.constexpr, TMA_STORE: gl.constexpr, TAIL_ROWS: gl.constexpr):
    """Cooperative: all ``num_warps`` warps on every tile of the program's items of the groups it takes; a
    group's ``dout`` rows past its end zeroed once when they arrive, and ``res`` handed back once the item's
    last MMAs have retired (before that tile's epilogue). An empty group's tiles are zeros."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = res.type.shape[2]
    RES_BLOCKS: gl.constexpr = res.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    k_tiles, n_tiles, cursor = _walk_start(group_sizes_ptr, K, N, BLOCK_K, BLOCK_N)
    k_chunks = gl.cdiv(k_tiles, K_CHUNK)
    counter = 0
    windows = 0
    item = gl.program_id(0)
    while item < E * k_chunks * n_tiles:
        cursor, group, row0, row_end, chunk, n0, taken = _resident_item(item, cursor, group_sizes_ptr, M, k_chunks,
                                                                        n_tiles, RES_BLOCKS * BLOCK_M, BLOCK_N)
        if taken:
            has_rows = row_end > row0
            if has_rows:
                mbarrier.wait(res_ready, windows & 1)
                last_block = (row_end - row0 - 1) // BLOCK_M
                for b in gl.static_range(RES_BLOCKS):
                    if b == last_block:
                        _zero_chunk_past(res.index(b), row_end - row0 - b * BLOCK_M, TAIL_ROWS)
                fence_async_shared()
                gl.thread_barrier()
                windows += 1
            first_kt = chunk * K_CHUNK
            last_kt = gl.minimum(first_kt + K_CHUNK, k_tiles) - 1
            for kt in range(first_kt, last_kt + 1):
                acc = gl.zeros([BLOCK_K, BLOCK_N], gl.float32, acc_layout)
                acc, counter = _reduce_rows(a_bufs, res, ready, empty, counter, acc, row0, row_end, TAIL_ROWS, True)
                # the item's last MMAs have retired (the wait above): res handed back before the epilogue, so the
                # next item's rows load under it (after it: 5% slower at DeepSeek-V3's sizes)
                mbarrier.arrive(res_empty, pred=has_rows & (kt == last_kt))
                _tgmm_epilogue(acc, c_smem, out_desc, out_ptr, group * K, kt * BLOCK_K, n0, K, N, TMA_STORE,
                               acc_layout, 0)
        item = _next_item(item, group, k_chunks * n_tiles, taken)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def tgmm_sm90_resident_kernel(a_desc, b_desc, out_desc, out_ptr, group_sizes_ptr, M, N, K, E, STAGES: gl.constexpr,
                              TMA_STORE: gl.constexpr, TAIL_ROWS: gl.constexpr, RES_BLOCKS: gl.constexpr,
                              K_CHUNK: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """:func:`tgmm_sm90_kernel` for the groups of at most ``RES_BLOCKS`` row blocks (the others' ``out[g]`` left as
    it was), each one's ``dout`` columns resident over ``K_CHUNK`` k tiles; same descriptors. A ring of
    ``STAGES`` ``lhs`` boxes."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    res = gl.allocate_shared_memory(b_desc.dtype, [RES_BLOCKS] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    res_barriers = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(res_barriers.index(i), count=1)
    C_ROWS: gl.constexpr = BLOCK_K if TMA_STORE else 8
    c_smem = gl.allocate_shared_memory(out_desc.dtype, [C_ROWS, BLOCK_N], out_desc.layout)
    fence_async_shared()

    gl.warp_specialize([
        (_resident_consumer, (a_bufs, res, ready, empty, res_barriers.index(0), res_barriers.index(1), c_smem,
                              out_desc, out_ptr, group_sizes_ptr, M, N, K, E, K_CHUNK, TMA_STORE, TAIL_ROWS)),
        (_resident_producer, (a_desc, b_desc, a_bufs, res, ready, empty, res_barriers.index(0),
                              res_barriers.index(1), group_sizes_ptr, M, N, K, E, K_CHUNK)),
    ], [1], [PRODUCER_REGS])
