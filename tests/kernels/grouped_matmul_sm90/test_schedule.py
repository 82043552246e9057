"""The Hopper grouped GEMM's persistent tile schedule (``grouped_matmul_sm90.schedule``, which the Gluon kernel
mirrors) on a CPU: every output element of every group is computed by exactly one tile of exactly one program,
nothing past a group's rows is stored, and the product assembled tile by tile as the kernel stores it is
``grouped_matmul.reference``'s."""

import numpy as np
import pytest

from moe_lowering.kernels.grouped_matmul_sm90 import reference, schedule


def _random_sizes(rng, num_groups: int, rows: int):
    """Group sizes summing to at most ``rows``, with empty groups and sizes off the tile grid."""
    sizes = rng.multinomial(rows - int(rng.integers(0, 40)), rng.dirichlet(np.full(num_groups, 0.5)))
    sizes[rng.random(num_groups) < 0.25] = 0
    return sizes.tolist()


def _all_work(sizes, rows, n, block_m, block_n, group_m, programs):
    return [(p, w) for p in range(programs)
            for w in schedule.program_tiles(sizes, rows, n, block_m, block_n, group_m, p, programs)]


def _tile_product(lhs, rhs, work: schedule.TileWork, out, block_m: int, block_n: int):
    """What the kernel does for one item: a whole ``block_m`` box of rows (zero past the array, as TMA
    fills), stored only below the group's end and inside the columns."""
    padded = np.zeros((block_m, lhs.shape[1]), lhs.dtype)
    box = lhs[work.row0:work.row0 + block_m]
    padded[:len(box)] = box
    product = padded @ rhs[work.group][:, work.col0:work.col0 + block_n]
    stored = max(0, min(block_m, work.row_end - work.row0))
    out[work.row0:work.row0 + stored, work.col0:work.col0 + block_n] = product[:stored]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block_m, block_n, group_m, programs", [(128, 256, 8, 7), (64, 128, 2, 3), (16, 32, 1, 1)])
def test_every_element_once_and_the_product_is_the_references(seed, block_m, block_n, group_m, programs):
    rng = np.random.default_rng(seed)
    num_groups, rows, k, n = int(rng.integers(1, 9)), int(rng.integers(1, 700)), 16, int(rng.choice([32, 48, 300]))
    sizes = _random_sizes(rng, num_groups, rows)
    lhs = rng.standard_normal((rows, k)).astype(np.float32)
    rhs = rng.standard_normal((num_groups, k, n)).astype(np.float32)
    work = _all_work(sizes, rows, n, block_m, block_n, group_m, programs)

    assert len(work) == schedule.total_tiles(sizes, block_m, schedule.cdiv(n, block_n))
    covered = np.zeros((rows, n), np.int32)
    out = np.full((rows, n), np.nan, np.float32)
    for _, item in work:
        stored = max(0, min(block_m, item.row_end - item.row0))
        covered[item.row0:item.row0 + stored, item.col0:item.col0 + block_n] += 1
        _tile_product(lhs, rhs, item, out, block_m, block_n)
    in_groups = min(sum(sizes), rows)
    assert (covered[:in_groups] == 1).all() and (covered[in_groups:] == 0).all()
    assert np.isnan(out[in_groups:]).all()  # rows past the groups are never stored
    np.testing.assert_allclose(out[:in_groups], reference.gmm_rows(lhs, rhs, sizes)[:in_groups], rtol=1e-5, atol=1e-5)


def test_the_assembled_product_is_the_jax_references():
    rng = np.random.default_rng(7)
    sizes, rows, k, n = [0, 130, 1, 0, 257, 12], 400, 8, 40
    lhs = rng.standard_normal((rows, k)).astype(np.float32)
    rhs = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    out = np.zeros((rows, n), np.float32)
    for _, item in _all_work(sizes, rows, n, 128, 32, 8, 5):
        _tile_product(lhs, rhs, item, out, 128, 32)
    np.testing.assert_allclose(out, np.asarray(reference.gmm_dense(lhs, rhs, np.asarray(sizes, np.int32))), rtol=1e-5,
                               atol=1e-5)


def test_items_go_column_fastest_in_bands_and_each_program_walks_forward():
    sizes = [300, 0, 1000]
    items = schedule.program_tiles(sizes, 1300, 512, 128, 256, 2, 0, 1)
    assert [(w.group, w.row0, w.col0) for w in items[:6]] == [
        (0, 0, 0), (0, 128, 0), (0, 0, 256), (0, 128, 256), (0, 256, 0), (0, 256, 256)]
    assert items[6] == schedule.TileWork(2, 300, 1300, 0)
    later = schedule.program_tiles(sizes, 1300, 512, 128, 256, 2, 3, 4)
    assert [w.group for w in later] == sorted(w.group for w in later)
