"""The Hopper weight-gradient kernel's persistent schedule (``schedule.weight_tiles``, which ``tgmm_sm90_kernel``
mirrors) on a CPU: every ``[K, N]`` element of every group, empty ones included, is written by exactly one item
of exactly one program, and the product assembled item by item as the kernel computes it (whole ``block_m``-row
boxes, zero-filled past the array as TMA fills them, the group's last box zeroed past the group's end) is
``grouped_matmul.reference.tgmm``'s, with non-finite rows past the groups."""

import numpy as np
import pytest

from moe_lowering.kernels.grouped_matmul_sm90 import reference, schedule


def _random_sizes(rng, num_groups: int, rows: int):
    """Group sizes summing to at most ``rows``, with empty groups and sizes off the block grid."""
    sizes = rng.multinomial(rows - int(rng.integers(0, 40)), rng.dirichlet(np.full(num_groups, 0.5)))
    sizes[rng.random(num_groups) < 0.25] = 0
    return sizes.tolist()


def _all_work(sizes, rows, k, n, block_k, block_n, group_m, programs, min_group_rows: int = 0):
    return [(p, w) for p in range(programs)
            for w in schedule.weight_tiles(sizes, rows, k, n, block_k, block_n, group_m, p, programs, min_group_rows)]


def _box(array, row, col, rows: int, cols: int):
    """A TMA box: ``array[row : row + rows, col : col + cols]``, zero past the array's ends."""
    padded = np.zeros((rows, cols), array.dtype)
    part = array[row:row + rows, col:col + cols]
    padded[:part.shape[0], :part.shape[1]] = part
    return padded


def _tile_product(lhs, dout, work: schedule.WeightTileWork, out, block_m: int, block_k: int, block_n: int,
                  zero_past_group: bool = True, tail_rows: int | None = None, tail_chunks_all: bool = False):
    """What the kernel does for one item: per row block both boxes, ``a^T @ b`` accumulated, stored inside
    ``[K, N]``. The group's last block (``_tgmm_mainloop``): with ``tail_rows`` None zeroed past the
    group's end and multiplied whole; with ``tail_rows`` only the ``tail_rows``-row chunks holding the
    group's rows are multiplied, the last of them zeroed past the group's end (``tail_chunks_all``: the
    mutant multiplying every chunk)."""
    acc = np.zeros((block_k, block_n), np.float32)
    for r in range(work.row0, work.row_end, block_m):
        a = _box(lhs, r, work.k0, block_m, block_k)
        b = _box(dout, r, work.col0, block_m, block_n)
        rows_left = work.row_end - r
        if rows_left >= block_m or tail_rows is None:
            if zero_past_group:
                a[rows_left:] = 0
                b[rows_left:] = 0
            acc += a.T @ b
            continue
        chunk = rows_left // tail_rows * tail_rows
        a[rows_left:chunk + tail_rows] = 0
        b[rows_left:chunk + tail_rows] = 0
        for c0 in range(0, block_m, tail_rows):
            if c0 < rows_left or tail_chunks_all:
                acc += a[c0:c0 + tail_rows].T @ b[c0:c0 + tail_rows]
    k, n = out.shape[1:]
    stored = acc[:k - work.k0, :n - work.col0]
    out[work.group, work.k0:work.k0 + stored.shape[0], work.col0:work.col0 + stored.shape[1]] = stored


def _operands(rng, rows, k, n, sizes):
    """Random ``lhs`` and ``dout``, their rows past the groups non-finite (a buffer's unwritten tail)."""
    lhs = rng.standard_normal((rows, k)).astype(np.float32)
    dout = rng.standard_normal((rows, n)).astype(np.float32)
    lhs[sum(sizes):] = np.inf
    dout[sum(sizes):] = np.nan
    return lhs, dout


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("block_m, block_k, block_n, group_m, programs, tail_rows", [
    (64, 128, 256, 8, 7, None), (128, 128, 128, 2, 3, None), (16, 16, 32, 1, 1, None), (64, 128, 256, 8, 7, 16),
    (32, 16, 32, 2, 3, 16), (64, 16, 32, 1, 2, 32)])
def test_every_element_once_and_the_product_is_the_references(seed, block_m, block_k, block_n, group_m, programs,
                                                              tail_rows):
    rng = np.random.default_rng(seed)
    num_groups, rows = int(rng.integers(1, 9)), int(rng.integers(1, 700))
    k, n = int(rng.choice([16, 200, 256])), int(rng.choice([32, 48, 300]))
    sizes = _random_sizes(rng, num_groups, rows)
    lhs, dout = _operands(rng, rows, k, n, sizes)
    work = _all_work(sizes, rows, k, n, block_k, block_n, group_m, programs)

    assert len(work) == num_groups * schedule.cdiv(k, block_k) * schedule.cdiv(n, block_n)
    covered = np.zeros((num_groups, k, n), np.int32)
    out = np.full((num_groups, k, n), np.nan, np.float32)
    for _, item in work:
        covered[item.group, item.k0:item.k0 + block_k, item.col0:item.col0 + block_n] += 1
        _tile_product(lhs, dout, item, out, block_m, block_k, block_n, tail_rows=tail_rows)
    assert (covered == 1).all()
    np.testing.assert_allclose(out, reference.tgmm_rows(lhs, dout, sizes), rtol=1e-5, atol=1e-4)


def test_the_rows_past_a_group_are_what_the_masking_keeps_out():
    """Without the last block's zeroing the next group's rows (and the non-finite tail) reach the product."""
    rng = np.random.default_rng(3)
    sizes, rows, k, n = [40, 0, 33, 5], 128, 32, 32
    lhs, dout = _operands(rng, rows, k, n, sizes)
    out = np.zeros((len(sizes), k, n), np.float32)
    for _, item in _all_work(sizes, rows, k, n, 32, 32, 8, 2):
        _tile_product(lhs, dout, item, out, 64, 32, 32, zero_past_group=False)
    expected = reference.tgmm_rows(lhs, dout, sizes)
    assert not np.isfinite(out[3]).all()
    assert np.abs(out[0] - expected[0]).max() > 1.0


def test_a_tail_chunk_past_the_group_must_not_be_multiplied():
    """With 16-row tail chunks only the chunk holding the group's end is zeroed: multiplying the chunks
    past it (the mutant) lets the next group's rows and the non-finite tail in."""
    rng = np.random.default_rng(4)
    sizes, rows, k, n = [40, 0, 33, 5], 128, 32, 32
    lhs, dout = _operands(rng, rows, k, n, sizes)
    expected = reference.tgmm_rows(lhs, dout, sizes)
    for chunks_all in (False, True):
        out = np.zeros((len(sizes), k, n), np.float32)
        for _, item in _all_work(sizes, rows, k, n, 32, 32, 8, 2):
            _tile_product(lhs, dout, item, out, 64, 32, 32, tail_rows=16, tail_chunks_all=chunks_all)
        if chunks_all:
            assert not np.isfinite(out[3]).all()
            assert np.abs(out[0] - expected[0]).max() > 1.0
        else:
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_tgmm_rows_is_the_jax_reference():
    rng = np.random.default_rng(7)
    sizes, rows, k, n = [0, 130, 1, 0, 257, 12], 420, 24, 40
    lhs = rng.standard_normal((rows, k)).astype(np.float32)
    dout = rng.standard_normal((rows, n)).astype(np.float32)
    np.testing.assert_allclose(reference.tgmm_rows(lhs, dout, sizes),
                               np.asarray(reference.tgmm_jax(lhs, dout, np.asarray(sizes, np.int32))), rtol=1e-5,
                               atol=1e-4)


def test_items_go_n_fastest_in_bands_of_k_tiles_and_each_program_walks_forward():
    sizes = [300, 0, 1000]
    items = schedule.weight_tiles(sizes, 1300, 512, 512, 128, 256, 2, 0, 1)
    assert [(w.group, w.k0, w.col0) for w in items[:6]] == [
        (0, 0, 0), (0, 128, 0), (0, 0, 256), (0, 128, 256), (0, 256, 0), (0, 384, 0)]
    assert items[8] == schedule.WeightTileWork(1, 300, 300, 0, 0)  # the empty group: no rows, zeros stored
    assert items[16] == schedule.WeightTileWork(2, 300, 1300, 0, 0)
    later = schedule.weight_tiles(sizes, 1300, 512, 512, 128, 256, 2, 3, 4)
    assert [w.group for w in later] == sorted(w.group for w in later)
    # groups past the rows there are: clamped, so they reduce over nothing
    assert schedule.weight_tiles([10, 50, 7], 40, 16, 16, 16, 16, 1, 0, 1)[1:] == [
        schedule.WeightTileWork(1, 10, 40, 0, 0), schedule.WeightTileWork(2, 40, 40, 0, 0)]


def _resident_product(lhs, dout, tile: schedule.ResidentTile, out, block_m: int, block_k: int, block_n: int,
                      tail_rows: int, zero_resident: bool = True):
    """``tgmm_sm90_resident_kernel`` on one tile: its ``dout`` blocks as they sit in shared memory (zeroed past
    the group in the chunk holding its end when they arrived; ``zero_resident`` False: the mutant that skips
    it), each ``lhs`` box from the ring against its block, a partial last block in ``tail_rows``-row chunks
    holding rows (the ``lhs`` chunk zeroed past the end)."""
    acc = np.zeros((block_k, block_n), np.float32)
    for r in range(tile.row0, tile.row_end, block_m):
        a = _box(lhs, r, tile.k0, block_m, block_k)
        b = _box(dout, r, tile.col0, block_m, block_n)
        rows_left = tile.row_end - r
        if rows_left >= block_m:
            acc += a.T @ b
            continue
        chunk = rows_left // tail_rows * tail_rows
        a[rows_left:chunk + tail_rows] = 0
        if zero_resident:
            b[rows_left:chunk + tail_rows] = 0
        for c0 in range(0, rows_left, tail_rows):
            acc += a[c0:c0 + tail_rows].T @ b[c0:c0 + tail_rows]
    k, n = out.shape[1:]
    stored = acc[:k - tile.k0, :n - tile.col0]
    out[tile.group, tile.k0:tile.k0 + stored.shape[0], tile.col0:tile.col0 + stored.shape[1]] = stored


def _resident_tiles(sizes, rows, k, n, block_m, block_k, block_n, resident_blocks, k_chunk, programs):
    return [t for p in range(programs) for t in schedule.resident_weight_tiles(
        sizes, rows, k, n, block_m, block_k, block_n, resident_blocks, k_chunk, p, programs)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("block_m, block_k, block_n, resident_blocks, k_chunk, programs", [
    (64, 128, 256, 3, 8, 7), (16, 16, 32, 2, 3, 3), (32, 16, 32, 1, 1, 1), (16, 32, 16, 3, 2, 5)])
def test_resident_and_long_group_launches_cover_every_element_once_and_are_the_reference(
        seed, block_m, block_k, block_n, resident_blocks, k_chunk, programs):
    """The resident launch's groups (up to its rows) and the streaming launch's (``min_group_rows`` one past
    them), decided by the same sizes: every element of every group written once, the product the
    reference's; groups of exactly the resident rows included."""
    rng = np.random.default_rng(seed)
    num_groups, rows = int(rng.integers(1, 9)), int(rng.integers(1, 700))
    k, n = int(rng.choice([16, 200, 256])), int(rng.choice([32, 48, 300]))
    sizes = _random_sizes(rng, num_groups, rows)
    resident_rows = resident_blocks * block_m
    sizes[int(rng.integers(0, num_groups))] = resident_rows  # the bound itself (past the rows: clamped)
    lhs, dout = _operands(rng, rows, k, n, sizes)
    tiles = _resident_tiles(sizes, rows, k, n, block_m, block_k, block_n, resident_blocks, k_chunk, programs)
    long_work = _all_work(sizes, rows, k, n, block_k, block_n, 8, programs, min_group_rows=resident_rows + 1)

    covered = np.zeros((num_groups, k, n), np.int32)
    out = np.full((num_groups, k, n), np.nan, np.float32)
    for tile in tiles:
        assert tile.row_end - tile.row0 <= resident_rows
        covered[tile.group, tile.k0:tile.k0 + block_k, tile.col0:tile.col0 + block_n] += 1
        _resident_product(lhs, dout, tile, out, block_m, block_k, block_n, tail_rows=min(16, block_m))
    for _, item in long_work:
        covered[item.group, item.k0:item.k0 + block_k, item.col0:item.col0 + block_n] += 1
        _tile_product(lhs, dout, item, out, block_m, block_k, block_n, tail_rows=min(16, block_m))
    assert (covered == 1).all()
    np.testing.assert_allclose(out, reference.tgmm_rows(lhs, dout, sizes), rtol=1e-5, atol=1e-4)


def test_a_long_group_launch_from_the_resident_rows_writes_their_groups_twice():
    """The mutant bound: the streaming launch from ``min_group_rows`` = the resident rows (not one past)
    takes a group of exactly that many rows too."""
    sizes, rows, k, n = [192, 30, 193], 415, 32, 32
    resident = _resident_tiles(sizes, rows, k, n, 64, 16, 16, 3, 2, 3)
    for bound, twice in ((193, False), (192, True)):
        covered = np.zeros((len(sizes), k, n), np.int32)
        for tile in resident:
            covered[tile.group, tile.k0:tile.k0 + 16, tile.col0:tile.col0 + 16] += 1
        for _, item in _all_work(sizes, rows, k, n, 16, 16, 8, 3, min_group_rows=bound):
            covered[item.group, item.k0:item.k0 + 16, item.col0:item.col0 + 16] += 1
        assert (covered[0] == 2).all() == twice and (covered[1:] == 1).all()


def test_resident_rows_past_the_group_are_zeroed_when_they_arrive():
    """The resident block's rows past the group sit there for every k tile: unzeroed (the mutant), the
    ``lhs`` chunk's zeros meet a non-finite ``dout`` row (``0 * nan``)."""
    rng = np.random.default_rng(5)
    sizes, rows, k, n = [40, 0, 33, 5], 128, 32, 32
    lhs, dout = _operands(rng, rows, k, n, sizes)
    expected = reference.tgmm_rows(lhs, dout, sizes)
    for zero_resident in (True, False):
        out = np.zeros((len(sizes), k, n), np.float32)
        for tile in _resident_tiles(sizes, rows, k, n, 64, 32, 32, 3, 2, 2):
            _resident_product(lhs, dout, tile, out, 64, 32, 32, 16, zero_resident=zero_resident)
        if zero_resident:
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
        else:
            assert not np.isfinite(out[3]).all()


def test_resident_items_go_n_fastest_load_once_an_item_and_skip_long_groups():
    """A group's rows are loaded at its item's first k tile and released after the last; an empty group
    has neither; a group past the resident rows has no items here."""
    sizes = [100, 0, 300]
    tiles = schedule.resident_weight_tiles(sizes, 400, 512, 512, 64, 128, 256, 3, 2, 0, 1)
    assert [(t.group, t.k0, t.col0) for t in tiles[:6]] == [
        (0, 0, 0), (0, 128, 0), (0, 0, 256), (0, 128, 256), (0, 256, 0), (0, 384, 0)]
    assert tiles[0] == schedule.ResidentTile(0, 0, 100, 0, 0, loaded=True, released=False)
    assert tiles[1] == schedule.ResidentTile(0, 0, 100, 128, 0, loaded=False, released=True)
    assert all(not t.loaded and not t.released and t.row0 == t.row_end for t in tiles if t.group == 1)
    assert {t.group for t in tiles} == {0, 1}
    assert sum(t.loaded for t in tiles) == sum(t.released for t in tiles)
