"""Triton kernels for grouped matrix products over rows sorted by group.

Only ``triton`` is imported here, so the same kernels run under Triton's interpreter on a CPU
(``TRITON_INTERPRET=1``) and, through ``jax_triton``, as XLA custom calls on a GPU
(:mod:`.triton_launch`). The contracts are those of :mod:`.reference`.

Scheduling is done on device, by every program, from ``group_sizes``: the cumulative sums of
the sizes give each group's rows, and each local group is cut into its own row tiles (a tile
never spans two groups, so every output element is written by exactly one tile and no
accumulation across tiles is needed). Programs are persistent: program ``p`` takes tiles
``p, p + P, p + 2P, ...`` of a tile list whose length is known only on device. Within a
group, tiles go in bands of ``GROUP_M`` row tiles so that concurrently running programs share
both their row block and their weight block in L2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_lowering.kernels.peer_address.triton_kernels import peer_row_pointers, signal_peers


@triton.jit
def _band_swizzle(tile, rows_of_tiles, cols_of_tiles, GROUP_M: tl.constexpr):
    """(row tile, column tile) of ``tile`` when tiles go column-fastest in bands of GROUP_M rows."""
    band_width = GROUP_M * cols_of_tiles
    first_row = (tile // band_width) * GROUP_M
    band_rows = tl.minimum(rows_of_tiles - first_row, GROUP_M)
    within = tile % band_width
    return first_row + within % band_rows, within // band_rows


@triton.jit
def _pick(values, selector):
    """The element of ``values`` where ``selector`` is true (one-hot), as a scalar."""
    return tl.sum(tl.where(selector, values, 0), axis=0)


@triton.jit
def _group_layout(group_sizes_ptr, group_offset_ptr, n_tiles, NUM_LOCAL_GROUPS: tl.constexpr,
                  NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each group's rows and row tiles, from ``group_sizes`` on device (every program computes it).

    Returns ``(group_ids, sizes, offset, starts, ends, is_local, m_tiles, tile_ends, num_tiles)``:
    ``tile_ends`` is the cumulative count of (row tile x column tile) work items per group.
    """
    group_ids = tl.arange(0, GROUPS_PAD)
    sizes = tl.maximum(tl.load(group_sizes_ptr + group_ids, mask=group_ids < NUM_GROUPS, other=0), 0)
    offset = tl.load(group_offset_ptr)
    ends = tl.cumsum(sizes, axis=0)
    starts = ends - sizes
    is_local = (group_ids >= offset) & (group_ids < offset + NUM_LOCAL_GROUPS)
    m_tiles = tl.where(is_local, (sizes + BLOCK_M - 1) // BLOCK_M, 0)
    tile_ends = tl.cumsum(m_tiles, axis=0) * n_tiles
    num_tiles = tl.sum(m_tiles, axis=0) * n_tiles
    return group_ids, sizes, offset, starts, ends, is_local, m_tiles, tile_ends, num_tiles


@triton.jit
def _tile_position(tile, group_ids, starts, ends, m_tiles, tile_ends, n_tiles, M: tl.constexpr,
                   GROUP_M: tl.constexpr):
    """``(group, first row of the group, end row of the group, row tile, column tile)`` of ``tile``."""
    group = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)
    selected = group_ids == group
    group_m_tiles = _pick(m_tiles, selected)
    first_tile = _pick(tile_ends, selected) - group_m_tiles * n_tiles
    pm, pn = _band_swizzle(tile - first_tile, group_m_tiles, n_tiles, GROUP_M)
    return group, _pick(starts, selected), tl.minimum(_pick(ends, selected), M), pm, pn


@triton.jit
def _outside_rows(sizes, group_ids, offset, is_local, M: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows before and after the local groups (they must be written as zeros), in row tiles."""
    rows_begin = tl.minimum(tl.sum(tl.where(group_ids < offset, sizes, 0), axis=0), M)
    rows_end = tl.minimum(rows_begin + tl.sum(tl.where(is_local, sizes, 0), axis=0), M)
    zero_tiles_before = (rows_begin + BLOCK_M - 1) // BLOCK_M
    zero_tiles_after = (M - rows_end + BLOCK_M - 1) // BLOCK_M
    return rows_begin, rows_end, zero_tiles_before, zero_tiles_after


@triton.jit
def _zero_tile(tile, n_tiles, rows_begin, rows_end, zero_tiles_before, M: tl.constexpr, N: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(offsets, mask)`` of the output elements zero tile ``tile`` covers."""
    in_m = tl.arange(0, BLOCK_M)
    zm = tile // n_tiles
    before = zm < zero_tiles_before
    row0 = tl.where(before, zm * BLOCK_M, rows_end + (zm - zero_tiles_before) * BLOCK_M)
    row_limit = tl.where(before, rows_begin, M)
    cols = (tile % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    offsets = tl.cast(row0, tl.int64) * N + in_m[:, None] * N + cols[None, :]
    return offsets, ((row0 + in_m) < row_limit)[:, None] & (cols < N)[None, :]


@triton.jit
def _zero_outside_groups(out_ptr, pid, sizes, group_ids, offset, is_local, n_tiles, M: tl.constexpr,
                         N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """Writes zeros to the rows outside the local groups (before them, after them, dropped rows),
    this program's share of the zero tiles."""
    rows_begin, rows_end, zero_tiles_before, zero_tiles_after = _outside_rows(
        sizes, group_ids, offset, is_local, M, BLOCK_M
    )
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
    for tile in range(pid, (zero_tiles_before + zero_tiles_after) * n_tiles, NUM_PROGRAMS):
        offsets, zero_mask = _zero_tile(tile, n_tiles, rows_begin, rows_end, zero_tiles_before, M, N, BLOCK_M, BLOCK_N)
        tl.store(out_ptr + offsets, zeros, mask=zero_mask)


@triton.jit
def _tile_product(lhs_ptr, rhs_ptr, local_group, row0, cols, k_begin, k_end, M: tl.constexpr, K: tl.constexpr,
                  N: tl.constexpr, TRANSPOSE_RHS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, COMPUTE_F32: tl.constexpr, row_index_ptr=None,
                  LHS_SOURCE_ROWS: tl.constexpr = 0):
    """float32 ``lhs[row0 : row0 + BLOCK_M, k_begin:k_end] @ rhs[local_group][k_begin:k_end, cols]``
    (rows past ``M`` read clamped). ``k_begin`` and ``k_end`` are multiples of ``BLOCK_K`` or ``K``:
    the main kernels pass the constants ``0, K``, so their loop keeps constant bounds.

    With ``LHS_SOURCE_ROWS > 0`` the product's row ``r`` is ``lhs[row_index[r]]`` of a
    ``[LHS_SOURCE_ROWS, K]`` ``lhs`` (indices clamped into it): the rows are gathered as they
    are loaded, so no gathered copy is ever written."""
    in_m = tl.arange(0, BLOCK_M)
    in_k = tl.arange(0, BLOCK_K)
    # Rows past the group (or past M) are read clamped and never stored. Column indices stay
    # unclamped along the contiguous axis (a clamp would hide their contiguity from the
    # compiler and cost the 16-byte pipelined loads); a remainder there is masked instead.
    tile_rows = tl.minimum(row0 + in_m, M - 1) - row0
    if LHS_SOURCE_ROWS > 0:
        source = tl.load(row_index_ptr + row0 + tile_rows)
        source = tl.minimum(tl.maximum(source, 0), LHS_SOURCE_ROWS - 1)
        a_ptrs = lhs_ptr + tl.cast(source, tl.int64)[:, None] * K + k_begin + in_k[None, :]
    else:
        a_ptrs = lhs_ptr + tl.cast(row0, tl.int64) * K + tile_rows[:, None] * K + k_begin + in_k[None, :]
    weight_ptr = rhs_ptr + tl.cast(local_group, tl.int64) * (K * N)
    if TRANSPOSE_RHS:
        b_ptrs = weight_ptr + tl.minimum(cols, N - 1)[None, :] * K + k_begin + in_k[:, None]
        b_step = BLOCK_K
    else:
        b_ptrs = weight_ptr + tl.cast(k_begin, tl.int64) * N + in_k[:, None] * N + cols[None, :]
        b_step = BLOCK_K * N
    b_cols_ok = (cols < N)[None, :] | TRANSPOSE_RHS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if K % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            if TRANSPOSE_RHS or N % BLOCK_N == 0:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=b_cols_ok, other=0.0)
        else:
            k_ok = (k0 + in_k) < k_end
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & b_cols_ok, other=0.0)
        if COMPUTE_F32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += b_step
    return acc


@triton.jit
def _row_tile(lhs_ptr, rhs_ptr, tile, group_ids, offset, starts, ends, m_tiles, tile_ends, n_tiles, M: tl.constexpr,
              K: tl.constexpr, N: tl.constexpr, TRANSPOSE_RHS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, COMPUTE_F32: tl.constexpr):
    """Work item ``tile`` of a row-tiled grouped product: ``(float32 tile, first row, columns, group end)``."""
    group, group_start, group_end, pm, pn = _tile_position(
        tile, group_ids, starts, ends, m_tiles, tile_ends, n_tiles, M, GROUP_M
    )
    row0 = group_start + pm * BLOCK_M
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tile_product(lhs_ptr, rhs_ptr, group - offset, row0, cols, 0, K, M, K, N, TRANSPOSE_RHS, BLOCK_M,
                        BLOCK_N, BLOCK_K, COMPUTE_F32)
    return acc, row0, cols, group_end


@triton.jit
def gmm_kernel(
    lhs_ptr,
    rhs_ptr,
    group_sizes_ptr,
    group_offset_ptr,
    out_ptr,
    M: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    TRANSPOSE_RHS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    ZERO_OUTSIDE: tl.constexpr = True,
    TAIL_APART: tl.constexpr = False,
    FLATTEN: tl.constexpr = False,
):
    """``out[r] = lhs[r] @ rhs[group(r) - offset]`` for rows of local groups, zero elsewhere
    (left unwritten elsewhere without ``ZERO_OUTSIDE``).

    ``rhs`` is ``[G, K, N]``, or ``[G, N, K]`` read transposed with ``TRANSPOSE_RHS``. With
    ``TAIL_APART`` the tiles past the last full wave are left to ``gmm_tail_kernel`` wherever
    ``_tail_split`` cuts them. ``FLATTEN``: the tile loop and the K loop are software-pipelined as
    one, so the next tile's first blocks load during this tile's last steps and its store.
    """
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    group_ids, sizes, offset, starts, ends, is_local, m_tiles, tile_ends, num_tiles = _group_layout(
        group_sizes_ptr, group_offset_ptr, n_tiles, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M
    )
    if TAIL_APART:
        num_tiles = _tail_split(num_tiles, NUM_PROGRAMS, (K + BLOCK_K - 1) // BLOCK_K)[0]

    in_m = tl.arange(0, BLOCK_M)
    for tile in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        acc, row0, cols, group_end = _row_tile(lhs_ptr, rhs_ptr, tile, group_ids, offset, starts, ends, m_tiles,
                                               tile_ends, n_tiles, M, K, N, TRANSPOSE_RHS, BLOCK_M, BLOCK_N, BLOCK_K,
                                               GROUP_M, COMPUTE_F32)
        rows = row0 + in_m
        out_ptrs = out_ptr + tl.cast(row0, tl.int64) * N + in_m[:, None] * N + cols[None, :]
        store_mask = (rows < group_end)[:, None] & (cols < N)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)

    if ZERO_OUTSIDE:
        _zero_outside_groups(out_ptr, pid, sizes, group_ids, offset, is_local, n_tiles, M, N, BLOCK_M, BLOCK_N,
                             NUM_PROGRAMS)


@triton.jit
def gather_gmm_kernel(
    lhs_ptr,
    rhs_ptr,
    row_index_ptr,
    row_scale_ptr,
    dot_with_ptr,
    group_sizes_ptr,
    group_offset_ptr,
    out_ptr,
    dots_ptr,
    M: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    LHS_SOURCE_ROWS: tl.constexpr,
    NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    TRANSPOSE_RHS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    WITH_DOTS: tl.constexpr,
):
    """``out[r] = row_scale[r] * (lhs[row_index[r]] @ rhs[group(r) - offset])`` for rows of local
    groups, zero elsewhere; ``lhs`` is ``[LHS_SOURCE_ROWS, K]``.

    The combine's backward through the expert's last product: ``lhs`` is the layer output's
    cotangent, ``row_index`` each row's token and ``row_scale`` its routing weight, so the
    ``[M, K]`` scaled copy of the cotangent (``spread``) is never written. With ``WITH_DOTS`` the
    epilogue also stores ``dots[c, r]``, the unscaled product's row ``r`` times ``dot_with[r]``
    summed over column tile ``c`` (unwritten outside the local groups): with ``dot_with`` the
    product's own input rows, the routing weights' cotangent, without re-reading the forward's output.
    """
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    group_ids, sizes, offset, starts, ends, is_local, m_tiles, tile_ends, num_tiles = _group_layout(
        group_sizes_ptr, group_offset_ptr, n_tiles, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M
    )
    in_m = tl.arange(0, BLOCK_M)
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        group, group_start, group_end, pm, pn = _tile_position(
            tile, group_ids, starts, ends, m_tiles, tile_ends, n_tiles, M, GROUP_M
        )
        row0 = group_start + pm * BLOCK_M
        cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _tile_product(lhs_ptr, rhs_ptr, group - offset, row0, cols, 0, K, M, K, N, TRANSPOSE_RHS, BLOCK_M,
                            BLOCK_N, BLOCK_K, COMPUTE_F32, row_index_ptr, LHS_SOURCE_ROWS)
        rows = row0 + in_m
        in_rows = rows < group_end
        offsets = tl.cast(row0, tl.int64) * N + in_m[:, None] * N + cols[None, :]
        store_mask = in_rows[:, None] & (cols < N)[None, :]
        scale = tl.load(row_scale_ptr + rows, mask=in_rows, other=0.0)
        tl.store(out_ptr + offsets, (acc * scale[:, None]).to(out_ptr.dtype.element_ty), mask=store_mask)
        if WITH_DOTS:
            other = tl.load(dot_with_ptr + offsets, mask=store_mask, other=0.0).to(tl.float32)
            tl.store(dots_ptr + pn * M + rows, tl.sum(acc * other, axis=1), mask=in_rows)

    _zero_outside_groups(out_ptr, pid, sizes, group_ids, offset, is_local, n_tiles, M, N, BLOCK_M, BLOCK_N,
                         NUM_PROGRAMS)


@triton.jit
def _store_on_peers(tile, rows, cols, row_end, dest_device_ptr, dest_row_ptr, peer_address_ptr, done_ptr,
                    N: tl.constexpr):
    """Store a product tile's rows below ``row_end`` at their places in the peers' receive buffers
    (``dest_device`` -1: a row that goes nowhere)."""
    device = tl.load(dest_device_ptr + rows, mask=rows < row_end, other=-1)
    stored = device >= 0
    device = tl.maximum(device, 0)
    dest_row = tl.load(dest_row_ptr + rows, mask=stored, other=0)
    dest = peer_row_pointers(done_ptr, peer_address_ptr, device, dest_row, N)
    tl.store(dest[:, None] + cols[None, :], tile.to(done_ptr.dtype.element_ty),
             mask=stored[:, None] & (cols < N)[None, :])


@triton.jit
def gmm_push_kernel(
    lhs_ptr,
    rhs_ptr,
    group_sizes_ptr,
    group_offset_ptr,
    dest_device_ptr,
    dest_row_ptr,
    peer_address_ptr,
    rank_ptr,
    done_ptr,
    M: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    NUM_PEERS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    TAIL_APART: tl.constexpr = False,
):
    """``gmm_kernel``'s product, each output row stored straight into a peer's receive buffer.

    Row ``r`` of a local group goes to row ``dest_row[r]`` of rank ``dest_device[r]`` (negative:
    nowhere); rows outside the local groups are not stored at all. Then every program bumps its
    arrival counter on every peer, as the peer store's ``push_kernel`` does, so the receiver's
    ``wait`` counts ``NUM_PROGRAMS`` signals per peer. ``done`` (typed like the output) orders the
    wait after this kernel and is the base the peers' addresses are taken relative to.
    """
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    group_ids, sizes, offset, starts, ends, is_local, m_tiles, tile_ends, num_tiles = _group_layout(
        group_sizes_ptr, group_offset_ptr, n_tiles, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M
    )
    if TAIL_APART:
        num_tiles = _tail_split(num_tiles, NUM_PROGRAMS, (K + BLOCK_K - 1) // BLOCK_K)[0]
    rank = tl.load(rank_ptr)
    in_m = tl.arange(0, BLOCK_M)
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        acc, row0, cols, group_end = _row_tile(lhs_ptr, rhs_ptr, tile, group_ids, offset, starts, ends, m_tiles,
                                               tile_ends, n_tiles, M, K, N, False, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                               COMPUTE_F32)
        _store_on_peers(acc, row0 + in_m, cols, group_end, dest_device_ptr, dest_row_ptr, peer_address_ptr, done_ptr, N)
    signal_peers(peer_address_ptr, rank, NUM_PEERS)


# ---------------------------------------------------------------------------------------------
# The tail past the last full wave. Programs take tiles round robin, so a product with a few tiles
# past its last full wave runs a whole extra wave for them: at EP=4 the GPU whose experts need one
# more row tile than the others' runs 15 waves instead of 14 and 5 instead of 4, and every GPU waits
# for it (benchmarks/EP_NOTES.md, round 8). The tail kernel does those tiles in units of UNIT_M
# rows, the two 64-row halves of a tile when BLOCK_M >= 128 (whole tiles with 64-row tiles), and
# skips the units that start past the tile's group: the tail is often one group's last row tile,
# mostly rows that are never stored (31 of 128 on that GPU). It splits each remaining unit along K
# into pieces, one per program, so the extra wave takes a fraction of a tile's time; the last piece
# of a unit to finish adds the others' float32 partials in piece order and stores the unit. It is
# a kernel of its own, after the main one, so that the main loop's code stays exactly as it is
# (cutting the tail inside the main kernel slowed every full wave by ~5%): the main kernels pick
# the tail tiles by ``_tail_split`` alone, and only the tail kernel looks at their rows.


@triton.jit
def _tail_split(num_tiles, NUM_PROGRAMS: tl.constexpr, K_STEPS: tl.constexpr):
    """``(tiles of the full waves, pieces per tail tile)``: the tail tiles are cut into 8, 4 or 2
    pieces along K (never more than the K steps) when every piece gets a program of its own;
    1: the tail stays whole, in the main kernel."""
    full = (num_tiles // NUM_PROGRAMS) * NUM_PROGRAMS
    pieces = _unit_pieces(num_tiles - full, NUM_PROGRAMS, K_STEPS)
    return tl.where(pieces > 1, full, num_tiles), pieces


@triton.jit
def _unit_pieces(units, NUM_PROGRAMS: tl.constexpr, K_STEPS: tl.constexpr):
    """Pieces along K per tail unit (or tile): 8, 4 or 2 (never more than the K steps) when every
    piece gets a program of its own, else 1 (a program per whole unit: the main kernel leaves at
    most ``NUM_PROGRAMS / 2`` tail tiles, so at most ``NUM_PROGRAMS`` units of a product; the pair's
    tail kernel loops over its two products' units)."""
    return tl.where((8 * units <= NUM_PROGRAMS) & (K_STEPS >= 8), 8,
                    tl.where((4 * units <= NUM_PROGRAMS) & (K_STEPS >= 4), 4,
                             tl.where((2 * units <= NUM_PROGRAMS) & (K_STEPS >= 2), 2, 1)))


@triton.jit
def _tail_units(full_tiles, num_tiles, starts, ends, m_tiles, tile_ends, n_tiles, M: tl.constexpr,
                GROUPS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, UNIT_M: tl.constexpr, GROUP_M: tl.constexpr,
                TAIL_PAD: tl.constexpr):
    """Active units of tail tiles ``full_tiles + t``, ``t < TAIL_PAD`` (0 past the tail): the tile's
    UNIT_M-row slices that start before its group's end (as stored: at most ``M``). Every program
    needs every tail tile's count to number the units, so this is ``_tile_position``'s rows for
    all of them at once."""
    tile = full_tiles + tl.arange(0, TAIL_PAD)
    in_tail = tile < num_tiles
    # Clamped: the positions past the tail (or of no tile at all) are not used.
    tile = tl.minimum(tile, tl.maximum(num_tiles - 1, 0))
    group = tl.minimum(tl.sum((tile_ends[None, :] <= tile[:, None]).to(tl.int32), axis=1), GROUPS_PAD - 1)
    group_m_tiles = tl.gather(m_tiles, group, 0)
    first_tile = tl.gather(tile_ends, group, 0) - group_m_tiles * n_tiles
    pm, _ = _band_swizzle(tile - first_tile, group_m_tiles, n_tiles, GROUP_M)
    rows_left = tl.minimum(tl.gather(ends, group, 0), M) - (tl.gather(starts, group, 0) + pm * BLOCK_M)
    units = tl.minimum(tl.maximum(rows_left + UNIT_M - 1, 0) // UNIT_M, BLOCK_M // UNIT_M)
    return tl.where(in_tail, units, 0)


@triton.jit
def _sum_pieces(partial, unit, pieces, row_end, partials_ptr, counters_ptr, UNIT_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """``(the unit's sum over its pieces, row end)`` for the unit's last piece to finish, ``(zeros,
    0)`` for the others: each program's partial goes to a slot of its own (program ``p``'s is
    ``p``, so unit ``u``'s are ``u * pieces ...``), and the last one adds them in piece order, so
    the sum does not depend on who came last."""
    unit_elems: tl.constexpr = UNIT_M * BLOCK_N
    in_unit = tl.arange(0, UNIT_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(partials_ptr + tl.cast(tl.program_id(0), tl.int64) * unit_elems + in_unit, partial)
    tl.debug_barrier()  # every thread's partial is stored before the release below
    arrived = tl.atomic_add(counters_ptr + unit, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()  # the acquire above orders every thread's loads of the other pieces' partials
    is_last = arrived == pieces - 1
    total = tl.zeros((UNIT_M, BLOCK_N), dtype=tl.float32)
    first = tl.cast(unit * pieces, tl.int64) * unit_elems
    read_limit = tl.where(is_last, unit_elems, 0)
    for i in range(0, pieces):
        total += tl.load(partials_ptr + first + i * unit_elems + in_unit, mask=in_unit < read_limit, other=0.0,
                         cache_modifier=".cg")
    return total, tl.where(is_last, row_end, 0)


@triton.jit
def _tail_layout(group_sizes_ptr, group_offset_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                 NUM_LOCAL_GROUPS: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 NUM_PROGRAMS: tl.constexpr, TAIL_PAD: tl.constexpr):
    """What every program of a tail kernel needs to number the units: the group layout, the tail's
    first tile and each tail tile's active units (``_tail_units``)."""
    tl.static_assert(TAIL_PAD >= NUM_PROGRAMS // 2, "TAIL_PAD must hold NUM_PROGRAMS // 2 tail tiles")
    UNIT_M: tl.constexpr = BLOCK_M // 2 if BLOCK_M >= 128 else BLOCK_M
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    group_ids, sizes, offset, starts, ends, is_local, m_tiles, tile_ends, num_tiles = _group_layout(
        group_sizes_ptr, group_offset_ptr, n_tiles, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M
    )
    full_tiles = _tail_split(num_tiles, NUM_PROGRAMS, (K + BLOCK_K - 1) // BLOCK_K)[0]
    units = _tail_units(full_tiles, num_tiles, starts, ends, m_tiles, tile_ends, n_tiles, M, GROUPS_PAD, BLOCK_M,
                        UNIT_M, GROUP_M, TAIL_PAD)
    return group_ids, offset, starts, ends, m_tiles, tile_ends, num_tiles, full_tiles, units


@triton.jit
def _unit_piece(lhs_ptr, rhs_ptr, unit, numbered_unit, piece, pieces, has_piece, group_ids, offset, starts, ends,
                m_tiles, tile_ends, num_tiles, full_tiles, units, partials_ptr, counters_ptr, M: tl.constexpr,
                K: tl.constexpr, N: tl.constexpr, TRANSPOSE_RHS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, COMPUTE_F32: tl.constexpr,
                TAIL_PAD: tl.constexpr):
    """Piece ``piece`` of ``pieces`` along K of active unit ``unit`` of a product's tail (in tail
    order): ``(the unit's float32 sum, its rows, columns, end of the rows to store)``. Only the
    program that stores the unit (the whole unit's, or its last piece to finish) gets the sum and a
    row end past its first row; every other program, and one without a piece, zeros and a row end
    of 0. ``numbered_unit`` is the unit's number among all the units the kernel does: its counter,
    and its pieces' partial slots (``numbered_unit * pieces + piece``, the program's id)."""
    UNIT_M: tl.constexpr = BLOCK_M // 2 if BLOCK_M >= 128 else BLOCK_M
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    k_steps: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    units_before = tl.cumsum(units, axis=0) - units
    tail_index = tl.sum((units_before + units <= unit).to(tl.int32), axis=0)  # the tail tile holding the unit
    group, group_start, group_end, pm, pn = _tile_position(
        tl.minimum(full_tiles + tail_index, tl.maximum(num_tiles - 1, 0)), group_ids, starts, ends, m_tiles,
        tile_ends, n_tiles, M, GROUP_M
    )
    # A tile's active units are its first ones (rows below the group end), so the unit's place
    # among them is its slice of the tile.
    slice_index = unit - _pick(units_before, tl.arange(0, TAIL_PAD) == tail_index)
    row0 = group_start + pm * BLOCK_M + slice_index * UNIT_M
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)

    total = tl.zeros((UNIT_M, BLOCK_N), dtype=tl.float32)
    row_end = tl.where(has_piece, group_end, 0)
    if has_piece:
        steps_per_piece = (k_steps + pieces - 1) // pieces
        k_begin = tl.minimum(piece * steps_per_piece * BLOCK_K, K)
        k_end = tl.minimum(k_begin + steps_per_piece * BLOCK_K, K)
        total = _tile_product(lhs_ptr, rhs_ptr, group - offset, row0, cols, k_begin, k_end, M, K, N, TRANSPOSE_RHS,
                              UNIT_M, BLOCK_N, BLOCK_K, COMPUTE_F32)
        if pieces > 1:
            total, row_end = _sum_pieces(total, numbered_unit, pieces, row_end, partials_ptr, counters_ptr, UNIT_M,
                                         BLOCK_N)
    return total, row0 + tl.arange(0, UNIT_M), cols, row_end


@triton.jit
def _tail_piece(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, partials_ptr, counters_ptr, M: tl.constexpr,
                K: tl.constexpr, N: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr, NUM_GROUPS: tl.constexpr,
                GROUPS_PAD: tl.constexpr, TRANSPOSE_RHS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                COMPUTE_F32: tl.constexpr, TAIL_PAD: tl.constexpr):
    """This program's piece of a tail unit (``_unit_piece``): program ``p`` takes piece ``p %
    pieces`` of active unit ``p // pieces``, the units numbered in tail order."""
    group_ids, offset, starts, ends, m_tiles, tile_ends, num_tiles, full_tiles, units = _tail_layout(
        group_sizes_ptr, group_offset_ptr, M, K, N, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M, BLOCK_N,
        BLOCK_K, GROUP_M, NUM_PROGRAMS, TAIL_PAD
    )
    pid = tl.program_id(0)
    num_units = tl.sum(units, axis=0)
    pieces = _unit_pieces(num_units, NUM_PROGRAMS, (K + BLOCK_K - 1) // BLOCK_K)
    unit = pid // pieces
    return _unit_piece(lhs_ptr, rhs_ptr, unit, unit, pid % pieces, pieces, pid < pieces * num_units, group_ids,
                       offset, starts, ends, m_tiles, tile_ends, num_tiles, full_tiles, units, partials_ptr,
                       counters_ptr, M, K, N, TRANSPOSE_RHS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, COMPUTE_F32,
                       TAIL_PAD)


@triton.jit
def gmm_tail_kernel(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, prior_ptr, out_ptr, partials_ptr,
                    counters_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                    NUM_LOCAL_GROUPS: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr,
                    TRANSPOSE_RHS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                    COMPUTE_F32: tl.constexpr, TAIL_PAD: tl.constexpr):
    """The tail tiles ``gmm_kernel(TAIL_APART=True)`` left, written into its output (``out``
    aliases ``prior``). ``partials`` is float32 scratch of ``NUM_PROGRAMS`` units (``UNIT_M x
    BLOCK_N`` each), ``counters`` ``NUM_PROGRAMS`` zeroed int32; ``TAIL_PAD`` a power of two of at
    least ``NUM_PROGRAMS / 2``, room for every tail tile."""
    total, rows, cols, row_end = _tail_piece(
        lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, partials_ptr, counters_ptr, M, K, N, NUM_LOCAL_GROUPS,
        NUM_GROUPS, GROUPS_PAD, TRANSPOSE_RHS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, COMPUTE_F32, TAIL_PAD
    )
    out_ptrs = out_ptr + tl.cast(rows, tl.int64)[:, None] * N + cols[None, :]
    store_mask = (rows < row_end)[:, None] & (cols < N)[None, :]
    tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def gmm_pair_tail_kernel(lhs_ptr, rhs_a_ptr, rhs_b_ptr, group_sizes_ptr, group_offset_ptr, prior_a_ptr, prior_b_ptr,
                         out_a_ptr, out_b_ptr, partials_ptr, counters_ptr, M: tl.constexpr, K: tl.constexpr,
                         N: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr, NUM_GROUPS: tl.constexpr,
                         GROUPS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                         COMPUTE_F32: tl.constexpr, TAIL_PAD: tl.constexpr):
    """The tail tiles ``gmm_kernel(TAIL_APART=True)`` left of two products of the same rows,
    ``lhs @ rhs_a`` into ``out_a`` and ``lhs @ rhs_b`` into ``out_b`` (aliasing ``prior_a`` and
    ``prior_b``; weights ``[G, K, N]`` both), in one launch instead of two: the tail launches
    were mostly fixed cost (benchmarks/EP_NOTES.md).

    Same rows, sizes and shapes give both products the same tail tiles and ``U`` active units,
    so one count numbers them all: ``a``'s units ``0 .. U - 1``, then ``b``'s ``U .. 2U - 1``,
    cut into pieces by ``_unit_pieces(2U)``. A product leaves at most ``NUM_PROGRAMS / 2`` tail
    tiles, so ``2U`` may reach ``2 * NUM_PROGRAMS``; then there is one piece per unit and program
    ``p`` does units ``p, p + NUM_PROGRAMS``. When units are cut, every piece has a program, so
    the scratch of ``gmm_tail_kernel`` (``NUM_PROGRAMS`` units and counters) holds the pair's.
    """
    group_ids, offset, starts, ends, m_tiles, tile_ends, num_tiles, full_tiles, units = _tail_layout(
        group_sizes_ptr, group_offset_ptr, M, K, N, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M, BLOCK_N,
        BLOCK_K, GROUP_M, NUM_PROGRAMS, TAIL_PAD
    )
    units_per_product = tl.sum(units, axis=0)
    pieces = _unit_pieces(2 * units_per_product, NUM_PROGRAMS, (K + BLOCK_K - 1) // BLOCK_K)
    for work in range(tl.program_id(0), pieces * 2 * units_per_product, NUM_PROGRAMS):
        numbered_unit = work // pieces
        in_b = numbered_unit >= units_per_product
        total, rows, cols, row_end = _unit_piece(
            lhs_ptr, tl.where(in_b, rhs_b_ptr, rhs_a_ptr), numbered_unit - tl.where(in_b, units_per_product, 0),
            numbered_unit, work % pieces, pieces, True, group_ids, offset, starts, ends, m_tiles, tile_ends,
            num_tiles, full_tiles, units, partials_ptr, counters_ptr, M, K, N, False, BLOCK_M, BLOCK_N, BLOCK_K,
            GROUP_M, COMPUTE_F32, TAIL_PAD
        )
        out_ptrs = tl.where(in_b, out_b_ptr, out_a_ptr) + tl.cast(rows, tl.int64)[:, None] * N + cols[None, :]
        store_mask = (rows < row_end)[:, None] & (cols < N)[None, :]
        tl.store(out_ptrs, total.to(out_a_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def gmm_push_tail_kernel(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, dest_device_ptr, dest_row_ptr,
                         peer_address_ptr, rank_ptr, main_done_ptr, done_ptr, partials_ptr, counters_ptr,
                         M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr,
                         NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, NUM_PEERS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, COMPUTE_F32: tl.constexpr,
                         TAIL_PAD: tl.constexpr):
    """The tail tiles ``gmm_push_kernel(TAIL_APART=True)`` left, stored on the peers as it stores
    its rows; then every program signals every peer, as the main kernel's do."""
    total, rows, cols, row_end = _tail_piece(
        lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, partials_ptr, counters_ptr, M, K, N, NUM_LOCAL_GROUPS,
        NUM_GROUPS, GROUPS_PAD, False, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, COMPUTE_F32, TAIL_PAD
    )
    _store_on_peers(total, rows, cols, row_end, dest_device_ptr, dest_row_ptr, peer_address_ptr, done_ptr, N)
    signal_peers(peer_address_ptr, tl.load(rank_ptr), NUM_PEERS)


@triton.jit
def _group_rows(group_sizes_ptr, group_offset_ptr, NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr):
    """``(group_ids, offset, starts, ends)``: every group's rows, from ``group_sizes`` on device."""
    group_ids = tl.arange(0, GROUPS_PAD)
    sizes = tl.maximum(tl.load(group_sizes_ptr + group_ids, mask=group_ids < NUM_GROUPS, other=0), 0)
    ends = tl.cumsum(sizes, axis=0)
    return group_ids, tl.load(group_offset_ptr), ends - sizes, ends


@triton.jit
def _local_group_rows(group_ids, offset, starts, ends, local_group, M: tl.constexpr):
    """``(first row, end row)`` of local group ``local_group``, clamped to the ``M`` rows."""
    selected = group_ids == local_group + offset
    return tl.minimum(_pick(starts, selected), M), tl.minimum(_pick(ends, selected), M)


@triton.jit
def _transposed_dot(a, b, acc, COMPUTE_F32: tl.constexpr):
    """``acc + a^T @ b`` (float32 inputs multiplied exactly where ``COMPUTE_F32``)."""
    if COMPUTE_F32:
        return tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(tl.trans(a), b, acc)


@triton.jit
def _source_rows(src_ptr, index_ptr, rows, rows_ok, cols, N: tl.constexpr, SOURCE_ROWS: tl.constexpr):
    """``src[index[r], cols]`` for ``rows`` (zero where not ``rows_ok``; indices clamped into the
    ``SOURCE_ROWS`` rows)."""
    source = tl.minimum(tl.maximum(tl.load(index_ptr + rows, mask=rows_ok, other=0), 0), SOURCE_ROWS - 1)
    return tl.load(src_ptr + tl.cast(source, tl.int64)[:, None] * N + cols[None, :],
                   mask=rows_ok[:, None] & (cols < N)[None, :], other=0.0)


@triton.jit
def _scaled(values, scale_ptr, rows, rows_ok):
    """``scale[r] * values[r]`` computed in float32, rounded to ``values``' type (zero where not ``rows_ok``)."""
    scale = tl.load(scale_ptr + rows, mask=rows_ok, other=0.0)
    return (values.to(tl.float32) * scale[:, None]).to(values.dtype)


@triton.jit
def _grad_rows(grad_ptr, r0, in_r, rows_ok, cols, N: tl.constexpr, BLOCK_N: tl.constexpr, grad_index_ptr,
               GRAD_SOURCE_ROWS: tl.constexpr):
    """``grad[r0 + in_r, cols]`` (zero where not ``rows_ok``), or with ``GRAD_SOURCE_ROWS > 0``
    ``grad[grad_index[r0 + in_r], cols]`` of a ``[GRAD_SOURCE_ROWS, N]`` ``grad``, gathered as loaded."""
    if GRAD_SOURCE_ROWS > 0:
        return _source_rows(grad_ptr, grad_index_ptr, r0 + in_r, rows_ok, cols, N, GRAD_SOURCE_ROWS)
    b_ptrs = grad_ptr + tl.cast(r0, tl.int64) * N + in_r[:, None] * N + cols[None, :]
    if N % BLOCK_N == 0:
        return tl.load(b_ptrs, mask=rows_ok[:, None], other=0.0)
    return tl.load(b_ptrs, mask=rows_ok[:, None] & (cols < N)[None, :], other=0.0)


@triton.jit
def _reduce_group_rows(lhs_ptr, grad_ptr, group_start, group_end, ks, cols, K: tl.constexpr, N: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       COMPUTE_F32: tl.constexpr, grad_index_ptr=None, grad_scale_ptr=None,
                       GRAD_SOURCE_ROWS: tl.constexpr = 0, GRAD_SCALED: tl.constexpr = True):
    """float32 ``lhs[group rows][:, ks]^T @ grad[group rows][:, cols]``, ``BLOCK_R`` rows at a time.

    With ``GRAD_SOURCE_ROWS > 0`` row ``r``'s term is ``(grad_scale[r] * lhs[r])^T grad[grad_index[r]]``
    (without the scale unless ``GRAD_SCALED``): the gradient's rows are gathered as loaded and the scale
    goes on the narrower ``lhs`` block, so the gathered block reaches the tensor cores as loaded."""
    in_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in range(group_start, group_end, BLOCK_R):
        rows_ok = r0 + in_r < group_end
        a_ptrs = lhs_ptr + tl.cast(r0, tl.int64) * K + in_r[:, None] * K + ks[None, :]
        if K % BLOCK_K == 0:
            a = tl.load(a_ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=rows_ok[:, None] & (ks < K)[None, :], other=0.0)
        if GRAD_SOURCE_ROWS > 0 and GRAD_SCALED:
            a = _scaled(a, grad_scale_ptr, r0 + in_r, rows_ok)
        b = _grad_rows(grad_ptr, r0, in_r, rows_ok, cols, N, BLOCK_N, grad_index_ptr, GRAD_SOURCE_ROWS)
        acc = _transposed_dot(a, b, acc, COMPUTE_F32)
    return acc


@triton.jit
def _store_weight_tile(out_group_ptr, acc, ks, cols, K: tl.constexpr, N: tl.constexpr,
                       TRANSPOSE_OUT: tl.constexpr = False):
    """The ``[ks, cols]`` tile of one group's ``[K, N]`` output, or with ``TRANSPOSE_OUT`` of its ``[N, K]``
    transpose (stored at ``[cols, ks]``)."""
    mask = (ks < K)[:, None] & (cols < N)[None, :]
    if TRANSPOSE_OUT:
        tl.store(out_group_ptr + cols[None, :] * K + ks[:, None], acc.to(out_group_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_group_ptr + ks[:, None] * N + cols[None, :], acc.to(out_group_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tgmm_tiles(lhs_ptr, grad_ptr, grad_index_ptr, grad_scale_ptr, group_sizes_ptr, group_offset_ptr, out_ptr,
                M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, GRAD_SOURCE_ROWS: tl.constexpr,
                NUM_LOCAL_GROUPS: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
                NUM_PROGRAMS: tl.constexpr, COMPUTE_F32: tl.constexpr, GRAD_SCALED: tl.constexpr = True,
                TRANSPOSE_OUT: tl.constexpr = False):
    """The body of ``tgmm_kernel`` and the gathered kernels."""
    pid = tl.program_id(0)
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    tiles_per_group = k_tiles * n_tiles
    group_ids, offset, starts, ends = _group_rows(group_sizes_ptr, group_offset_ptr, NUM_GROUPS, GROUPS_PAD)
    for tile in range(pid, NUM_LOCAL_GROUPS * tiles_per_group, NUM_PROGRAMS):
        local_group = tile // tiles_per_group
        pk, pn = _band_swizzle(tile % tiles_per_group, k_tiles, n_tiles, GROUP_M)
        group_start, group_end = _local_group_rows(group_ids, offset, starts, ends, local_group, M)
        ks = pk * BLOCK_K + tl.arange(0, BLOCK_K)
        cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _reduce_group_rows(lhs_ptr, grad_ptr, group_start, group_end, ks, cols, K, N, BLOCK_K, BLOCK_N,
                                 BLOCK_R, COMPUTE_F32, grad_index_ptr, grad_scale_ptr, GRAD_SOURCE_ROWS, GRAD_SCALED)
        _store_weight_tile(out_ptr + tl.cast(local_group, tl.int64) * (K * N), acc, ks, cols, K, N, TRANSPOSE_OUT)


@triton.jit
def tgmm_kernel(
    lhs_ptr,
    grad_ptr,
    group_sizes_ptr,
    group_offset_ptr,
    out_ptr,
    M: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
):
    """``out[g] = lhs[rows of g + offset]^T @ grad[rows of g + offset]``; empty groups give zeros.

    Each tile is a ``BLOCK_K x BLOCK_N`` block of one local group's ``[K, N]`` output, reduced
    over that group's rows ``BLOCK_R`` at a time.
    """
    _tgmm_tiles(lhs_ptr, grad_ptr, grad_ptr, grad_ptr, group_sizes_ptr, group_offset_ptr, out_ptr, M, K, N, 0,
                NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, NUM_PROGRAMS,
                COMPUTE_F32)


@triton.jit
def gather_tgmm_kernel(
    lhs_ptr, grad_ptr, grad_index_ptr, grad_scale_ptr, group_sizes_ptr, group_offset_ptr, out_ptr,
    M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, GRAD_SOURCE_ROWS: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, COMPUTE_F32: tl.constexpr,
):
    """``tgmm_kernel`` with row ``r`` of the gradient ``grad_scale[r] * grad[grad_index[r]]`` of a
    ``[GRAD_SOURCE_ROWS, N]`` ``grad``: the weight gradient of the expert's last product read from the
    layer output's cotangent, without its scaled ``[M, N]`` copy."""
    _tgmm_tiles(lhs_ptr, grad_ptr, grad_index_ptr, grad_scale_ptr, group_sizes_ptr, group_offset_ptr, out_ptr, M, K,
                N, GRAD_SOURCE_ROWS, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M,
                NUM_PROGRAMS, COMPUTE_F32)


@triton.jit
def gather_lhs_tgmm_kernel(
    lhs_ptr, grad_ptr, grad_index_ptr, group_sizes_ptr, group_offset_ptr, out_ptr,
    M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, GRAD_SOURCE_ROWS: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, COMPUTE_F32: tl.constexpr,
):
    """``out[g] = grad[grad_index[rows of g]]^T @ lhs[rows of g]`` (``[G, N, K]``): the weight gradient
    of a product whose rows are token rows gathered by index (the up projection of tokens in expert
    order), without their permuted ``[M, N]`` copy. It is ``gather_tgmm_kernel`` unscaled with its
    tiles stored transposed: the gathered rows are the wide operand loaded as is, which ran near the
    speed of a materialised copy, where gathering the transposed operand ran 47% slower."""
    _tgmm_tiles(lhs_ptr, grad_ptr, grad_index_ptr, grad_index_ptr, group_sizes_ptr, group_offset_ptr, out_ptr, M, K,
                N, GRAD_SOURCE_ROWS, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M,
                NUM_PROGRAMS, COMPUTE_F32, False, True)


@triton.jit
def _resident_column_tiles(lhs_ptr, grad_ptr, out_group_ptr, group_start, group_end, cols, K: tl.constexpr,
                           N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                           WITH_HI: tl.constexpr, COMPUTE_F32: tl.constexpr, grad_index_ptr, grad_scale_ptr,
                           GRAD_SOURCE_ROWS: tl.constexpr, GRAD_SCALED: tl.constexpr = True,
                           TRANSPOSE_OUT: tl.constexpr = False):
    """Every ``BLOCK_K`` tile of one group's output columns ``cols``, from one load of the group's
    ``grad`` rows: ``BLOCK_R`` of them (``lo``), and where ``WITH_HI`` the next ``BLOCK_R // 2`` (``hi``)."""
    in_k = tl.arange(0, BLOCK_K)
    in_lo = tl.arange(0, BLOCK_R)
    lo_rows = group_start + in_lo
    lo_ok = lo_rows < group_end
    b_lo = _grad_rows(grad_ptr, group_start, in_lo, lo_ok, cols, N, BLOCK_N, grad_index_ptr, GRAD_SOURCE_ROWS)
    if GRAD_SOURCE_ROWS > 0 and GRAD_SCALED:  # scaled once: the block is reused for every K tile
        b_lo = _scaled(b_lo, grad_scale_ptr, lo_rows, lo_ok)
    if WITH_HI:
        in_hi = tl.arange(0, BLOCK_R // 2)
        hi_rows = group_start + BLOCK_R + in_hi
        hi_ok = hi_rows < group_end
        b_hi = _grad_rows(grad_ptr, group_start + BLOCK_R, in_hi, hi_ok, cols, N, BLOCK_N, grad_index_ptr,
                          GRAD_SOURCE_ROWS)
        if GRAD_SOURCE_ROWS > 0 and GRAD_SCALED:
            b_hi = _scaled(b_hi, grad_scale_ptr, hi_rows, hi_ok)
    for pk in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        ks = pk * BLOCK_K + in_k
        ks_ok = (ks < K)[None, :]
        a_lo = tl.load(lhs_ptr + tl.cast(lo_rows, tl.int64)[:, None] * K + ks[None, :], mask=lo_ok[:, None] & ks_ok,
                       other=0.0)
        acc = _transposed_dot(a_lo, b_lo, tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32), COMPUTE_F32)
        if WITH_HI:
            a_hi = tl.load(lhs_ptr + tl.cast(hi_rows, tl.int64)[:, None] * K + ks[None, :],
                           mask=hi_ok[:, None] & ks_ok, other=0.0)
            acc = _transposed_dot(a_hi, b_hi, acc, COMPUTE_F32)
        _store_weight_tile(out_group_ptr, acc, ks, cols, K, N, TRANSPOSE_OUT)


@triton.jit
def _tgmm_resident_tiles(lhs_ptr, grad_ptr, grad_index_ptr, grad_scale_ptr, group_sizes_ptr, group_offset_ptr,
                         out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, GRAD_SOURCE_ROWS: tl.constexpr,
                         NUM_LOCAL_GROUPS: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                         NUM_PROGRAMS: tl.constexpr, COMPUTE_F32: tl.constexpr, GRAD_SCALED: tl.constexpr = True,
                         TRANSPOSE_OUT: tl.constexpr = False):
    """The body of ``tgmm_resident_kernel`` and the gathered resident kernels."""
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    group_ids, offset, starts, ends = _group_rows(group_sizes_ptr, group_offset_ptr, NUM_GROUPS, GROUPS_PAD)
    for item in range(pid, NUM_LOCAL_GROUPS * n_tiles, NUM_PROGRAMS):
        local_group = item // n_tiles
        cols = (item % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        group_start, group_end = _local_group_rows(group_ids, offset, starts, ends, local_group, M)
        out_group_ptr = out_ptr + tl.cast(local_group, tl.int64) * (K * N)
        rows = group_end - group_start
        if rows <= BLOCK_R:
            _resident_column_tiles(lhs_ptr, grad_ptr, out_group_ptr, group_start, group_end, cols, K, N, BLOCK_K,
                                   BLOCK_N, BLOCK_R, False, COMPUTE_F32, grad_index_ptr, grad_scale_ptr,
                                   GRAD_SOURCE_ROWS, GRAD_SCALED, TRANSPOSE_OUT)
        elif rows <= BLOCK_R + BLOCK_R // 2:
            _resident_column_tiles(lhs_ptr, grad_ptr, out_group_ptr, group_start, group_end, cols, K, N, BLOCK_K,
                                   BLOCK_N, BLOCK_R, True, COMPUTE_F32, grad_index_ptr, grad_scale_ptr,
                                   GRAD_SOURCE_ROWS, GRAD_SCALED, TRANSPOSE_OUT)
        else:
            for pk in range(0, (K + BLOCK_K - 1) // BLOCK_K):
                ks = pk * BLOCK_K + tl.arange(0, BLOCK_K)
                acc = _reduce_group_rows(lhs_ptr, grad_ptr, group_start, group_end, ks, cols, K, N, BLOCK_K,
                                         BLOCK_N, BLOCK_R, COMPUTE_F32, grad_index_ptr, grad_scale_ptr,
                                         GRAD_SOURCE_ROWS, GRAD_SCALED)
                _store_weight_tile(out_group_ptr, acc, ks, cols, K, N, TRANSPOSE_OUT)


@triton.jit
def tgmm_resident_kernel(
    lhs_ptr,
    grad_ptr,
    group_sizes_ptr,
    group_offset_ptr,
    out_ptr,
    M: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
):
    """``tgmm_kernel``'s product for groups of about ``BLOCK_R`` rows (DeepSeek-like: ~128 per expert).

    Reducing over so few rows, ``tgmm_kernel`` loads both operands' rows again for every output
    tile. Here a program takes one group's ``BLOCK_N`` output columns, loads those columns of the
    group's ``grad`` rows once, and keeps them while it walks the group's ``K`` tiles, loading only
    ``lhs`` per tile: 2/3 less operand traffic at ``BLOCK_K = BLOCK_N = BLOCK_R``. Groups of up
    to 1.5 ``BLOCK_R`` rows keep a second, half-height block; larger groups loop over their rows.
    """
    _tgmm_resident_tiles(lhs_ptr, grad_ptr, grad_ptr, grad_ptr, group_sizes_ptr, group_offset_ptr, out_ptr, M, K, N,
                         0, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_K, BLOCK_N, BLOCK_R, NUM_PROGRAMS,
                         COMPUTE_F32)


@triton.jit
def gather_tgmm_resident_kernel(
    lhs_ptr, grad_ptr, grad_index_ptr, grad_scale_ptr, group_sizes_ptr, group_offset_ptr, out_ptr,
    M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, GRAD_SOURCE_ROWS: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, NUM_PROGRAMS: tl.constexpr, COMPUTE_F32: tl.constexpr,
):
    """``tgmm_resident_kernel`` with the gathered, scaled gradient rows of ``gather_tgmm_kernel``."""
    _tgmm_resident_tiles(lhs_ptr, grad_ptr, grad_index_ptr, grad_scale_ptr, group_sizes_ptr, group_offset_ptr,
                         out_ptr, M, K, N, GRAD_SOURCE_ROWS, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_K,
                         BLOCK_N, BLOCK_R, NUM_PROGRAMS, COMPUTE_F32)


@triton.jit
def gather_lhs_tgmm_resident_kernel(
    lhs_ptr, grad_ptr, grad_index_ptr, group_sizes_ptr, group_offset_ptr, out_ptr,
    M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, GRAD_SOURCE_ROWS: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, NUM_PROGRAMS: tl.constexpr, COMPUTE_F32: tl.constexpr,
):
    """``tgmm_resident_kernel``'s schedule for ``gather_lhs_tgmm_kernel``'s transposed, gathered product."""
    _tgmm_resident_tiles(lhs_ptr, grad_ptr, grad_index_ptr, grad_index_ptr, group_sizes_ptr, group_offset_ptr,
                         out_ptr, M, K, N, GRAD_SOURCE_ROWS, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_K,
                         BLOCK_N, BLOCK_R, NUM_PROGRAMS, COMPUTE_F32, False, True)


# ---------------------------------------------------------------------------------------------
# The rows' cotangent of a pair of products of the same rows (SwiGLU's gate and up):
# ``out[r] = a[r] @ rhs_a[g]^T + b[r] @ rhs_b[g]^T`` in one pass. Two ``gmm`` calls write two
# ``[M, N]`` outputs and a third pass adds them in float32 (at SonicMoE's 1.4B-n256 layer, three
# passes over 0.5 GB rows); here one accumulator walks both contractions, so ``out`` is written once.


@triton.jit
def _tile_product_sum(lhs_a_ptr, lhs_b_ptr, rhs_a_ptr, rhs_b_ptr, local_group, row0, cols, M: tl.constexpr,
                      K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, COMPUTE_F32: tl.constexpr):
    """float32 ``lhs_a[rows] @ rhs_a[g]^T + lhs_b[rows] @ rhs_b[g]^T`` (weights ``[G, N, K]``) as one
    loop of ``2 * K / BLOCK_K`` steps, the first half over ``a`` and the second over ``b``, so the
    pipeline fills once per tile (rows past ``M`` read clamped, never stored)."""
    in_m = tl.arange(0, BLOCK_M)
    in_k = tl.arange(0, BLOCK_K)
    tile_rows = tl.minimum(row0 + in_m, M - 1) - row0
    a_offsets = tl.cast(row0, tl.int64) * K + tile_rows[:, None] * K + in_k[None, :]
    b_offsets = tl.cast(local_group, tl.int64) * (K * N) + tl.minimum(cols, N - 1)[None, :] * K + in_k[:, None]
    k_steps: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, 2 * k_steps):
        second = step >= k_steps
        k0 = (step - tl.where(second, k_steps, 0)) * BLOCK_K
        lhs_ptr = tl.where(second, lhs_b_ptr, lhs_a_ptr)
        rhs_ptr = tl.where(second, rhs_b_ptr, rhs_a_ptr)
        if K % BLOCK_K == 0:
            a = tl.load(lhs_ptr + a_offsets + k0)
            b = tl.load(rhs_ptr + b_offsets + k0)
        else:
            k_ok = (k0 + in_k) < K
            a = tl.load(lhs_ptr + a_offsets + k0, mask=k_ok[None, :], other=0.0)
            b = tl.load(rhs_ptr + b_offsets + k0, mask=k_ok[:, None], other=0.0)
        if COMPUTE_F32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def gmm_sum_kernel(
    lhs_a_ptr,
    lhs_b_ptr,
    rhs_a_ptr,
    rhs_b_ptr,
    group_sizes_ptr,
    group_offset_ptr,
    out_ptr,
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
):
    """``out[r] = lhs_a[r] @ rhs_a[g]^T + lhs_b[r] @ rhs_b[g]^T``, ``g = group(r) - offset``, for rows
    of local groups, zero elsewhere. ``lhs_*`` are ``[M, K]``, ``rhs_*`` ``[G, N, K]`` (the forward's
    weights, read transposed); same scheduling as ``gmm_kernel`` (the tail stays in this kernel)."""
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    group_ids, sizes, offset, starts, ends, is_local, m_tiles, tile_ends, num_tiles = _group_layout(
        group_sizes_ptr, group_offset_ptr, n_tiles, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M
    )
    in_m = tl.arange(0, BLOCK_M)
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        group, group_start, group_end, pm, pn = _tile_position(
            tile, group_ids, starts, ends, m_tiles, tile_ends, n_tiles, M, GROUP_M
        )
        row0 = group_start + pm * BLOCK_M
        cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _tile_product_sum(lhs_a_ptr, lhs_b_ptr, rhs_a_ptr, rhs_b_ptr, group - offset, row0, cols, M, K, N,
                                BLOCK_M, BLOCK_N, BLOCK_K, COMPUTE_F32)
        out_ptrs = out_ptr + tl.cast(row0, tl.int64) * N + in_m[:, None] * N + cols[None, :]
        store_mask = ((row0 + in_m) < group_end)[:, None] & (cols < N)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)

    _zero_outside_groups(out_ptr, pid, sizes, group_ids, offset, is_local, n_tiles, M, N, BLOCK_M, BLOCK_N,
                         NUM_PROGRAMS)
