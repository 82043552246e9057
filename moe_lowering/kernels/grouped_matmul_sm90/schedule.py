"""The persistent tile schedule of the Hopper grouped GEMM, as plain Python the Gluon kernel mirrors.

Work items are (group, row tile, column tile): each group's rows are cut into ``block_m``-row tiles
starting at the group's first row (a tile never spans two groups; the last one may be partial, and its
rows past the group's end are loaded but never stored), and each row tile into ``block_n``-column tiles.
Items are numbered group by group; within a group they go column-fastest in bands of ``group_m`` row
tiles (programs running at once share their weight block and their row block in L2), as
``grouped_matmul.triton_kernels._band_swizzle`` orders them. Program ``p`` of ``P`` takes items
``p, p + P, p + 2P, ...`` and finds each one's group by walking the groups forward from the last one
it used (its items only ever increase), so neither a tile table nor a search is needed on device.
In the ping-pong kernel the program's two consumer warp groups take its items alternately (warp group
``w`` the program's items ``w, w + 2, ...``), each walking its own cursor.

The weight gradient (``gluon_tgmm_kernels``) has items ``(group, k tile, n tile)`` of the ``[E, K, N]``
output instead, ``E * k_tiles * n_tiles`` of them whatever the sizes (an empty group's items write
zeros), banded the same way over k tiles; each reduces over its group's rows in ``block_m`` blocks
(:func:`weight_tiles`). With a resident ``dout`` two launches share the groups by their sizes on the
device: the resident kernel the groups its rows hold (:func:`resident_weight_tiles`), the streaming one
the longer ones (``min_group_rows``); the other launch's items are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TileWork:
    """One work item: ``out[row0 : row_end, col0 : col0 + block_n] = lhs[row0 : ...] @ rhs[group][:, col0 : ...]``
    (``row_end`` the group's end, clamped to the rows there are; the tile's own rows stop at
    ``min(row0 + block_m, row_end)``)."""

    group: int
    row0: int
    row_end: int
    col0: int


def total_tiles(group_sizes, block_m: int, n_tiles: int) -> int:
    """Work items over all groups (negative sizes count as empty)."""
    return sum(cdiv(max(int(size), 0), block_m) for size in group_sizes) * n_tiles


def band_swizzle(local: int, m_tiles: int, n_tiles: int, group_m: int) -> tuple[int, int]:
    """(row tile, column tile) of a group's ``local``-th item, column-fastest in bands of ``group_m`` row tiles."""
    band_width = group_m * n_tiles
    first_row = (local // band_width) * group_m
    band_rows = min(m_tiles - first_row, group_m)
    within = local % band_width
    return first_row + within % band_rows, within // band_rows


def program_tiles(group_sizes, num_rows: int, n: int, block_m: int, block_n: int, group_m: int, program: int,
                  num_programs: int) -> list[TileWork]:
    """The items program ``program`` of ``num_programs`` computes, in order, found as the kernel finds them."""
    n_tiles = cdiv(n, block_n)
    total = total_tiles(group_sizes, block_m, n_tiles)
    group, group_first_tile, group_row = 0, 0, 0
    group_size = max(int(group_sizes[0]), 0) if len(group_sizes) else 0
    group_items = cdiv(group_size, block_m) * n_tiles
    work = []
    for tile in range(program, total, num_programs):
        while tile >= group_first_tile + group_items:  # the kernel's cursor walk
            group_first_tile += group_items
            group_row += group_size
            group += 1
            group_size = max(int(group_sizes[group]), 0)
            group_items = cdiv(group_size, block_m) * n_tiles
        pm, pn = band_swizzle(tile - group_first_tile, cdiv(group_size, block_m), n_tiles, group_m)
        work.append(TileWork(group, group_row + pm * block_m, min(group_row + group_size, num_rows), pn * block_n))
    return work


@dataclass(frozen=True)
class WeightTileWork:
    """One weight-gradient item: ``dw[group][k0 : k0 + block_k, col0 : col0 + block_n] = lhs[row0 :
    row_end, k0 : ...]^T @ dout[row0 : row_end, col0 : ...]``, reduced in ``block_m``-row blocks from
    ``row0`` (the group's rows, clamped to the rows there are; none for an empty group)."""

    group: int
    row0: int
    row_end: int
    k0: int
    col0: int


def _group_items(group_sizes, per_group: int, program: int, num_programs: int):
    """``(item, group, group's first row, group's size)`` of program ``program``'s items, ``per_group`` items a
    group taken round robin, each item's group found as the weight-gradient kernels find it (a cursor that
    only walks forward)."""
    group, group_row = 0, 0
    group_size = max(int(group_sizes[0]), 0) if len(group_sizes) else 0
    for item in range(program, len(group_sizes) * per_group, num_programs):
        while group < item // per_group:
            group_row += group_size
            group += 1
            group_size = max(int(group_sizes[group]), 0)
        yield item, group, group_row, group_size


def weight_tiles(group_sizes, num_rows: int, k: int, n: int, block_k: int, block_n: int, group_m: int, program: int,
                 num_programs: int, min_group_rows: int = 0) -> list[WeightTileWork]:
    """The weight-gradient items program ``program`` of ``num_programs`` computes, in order, found as
    ``tgmm_sm90_kernel`` finds them (its group cursor only walks forward): those of the groups of at least
    ``min_group_rows`` rows."""
    k_tiles, n_tiles = cdiv(k, block_k), cdiv(n, block_n)
    per_group = k_tiles * n_tiles
    work = []
    for tile, group, group_row, group_size in _group_items(group_sizes, per_group, program, num_programs):
        if group_size < min_group_rows:
            continue
        pk, pn = band_swizzle(tile % per_group, k_tiles, n_tiles, group_m)
        work.append(WeightTileWork(group, min(group_row, num_rows), min(group_row + group_size, num_rows),
                                   pk * block_k, pn * block_n))
    return work


@dataclass(frozen=True)
class ResidentTile:
    """One output tile of a resident-``dout`` item: ``dw[group][k0 : k0 + block_k, col0 : col0 + block_n]``
    over the group's rows ``[row0, row_end)`` (none for an empty group: zeros), reduced against its ``dout``
    blocks held in shared memory. ``loaded``: the producer loads them before this tile (the item's first);
    ``released``: the consumers hand them back after it (the item's last); neither without rows."""

    group: int
    row0: int
    row_end: int
    k0: int
    col0: int
    loaded: bool
    released: bool


def resident_weight_tiles(group_sizes, num_rows: int, k: int, n: int, block_m: int, block_k: int, block_n: int,
                          resident_blocks: int, k_chunk: int, program: int, num_programs: int) -> list[ResidentTile]:
    """The tiles program ``program`` of ``num_programs`` computes in ``tgmm_sm90_resident_kernel``, in order.

    Items are ``(group, k chunk, n tile)`` with n fastest, taken round robin, of the groups of at most
    ``resident_blocks * block_m`` rows (the longer ones' items are skipped: :func:`weight_tiles` with
    ``min_group_rows`` one past it takes them); an item's tiles are its chunk's ``k_chunk`` k tiles."""
    k_tiles, n_tiles = cdiv(k, block_k), cdiv(n, block_n)
    k_chunks = cdiv(k_tiles, k_chunk)
    per_group = k_chunks * n_tiles
    tiles = []
    for item, group, group_row, group_size in _group_items(group_sizes, per_group, program, num_programs):
        if group_size > resident_blocks * block_m:
            continue
        chunk, pn = divmod(item % per_group, n_tiles)
        row0, row_end = min(group_row, num_rows), min(group_row + group_size, num_rows)
        first_kt, last_kt = chunk * k_chunk, min((chunk + 1) * k_chunk, k_tiles) - 1
        for kt in range(first_kt, last_kt + 1):
            has_rows = row_end > row0
            tiles.append(ResidentTile(group, row0, row_end, kt * block_k, pn * block_n, has_rows and kt == first_kt,
                                      has_rows and kt == last_kt))
    return tiles
