"""The Triton grouped GEMMs on a CUDA GPU against the float64 reference, at awkward sizes.

Skipped without a GPU or jax_triton. Sizes: M not a tile multiple, K and N not powers of two,
empty groups, one group taking every row, rows outside every group, a local window of groups
(``group_offset``). Outputs are poisoned: before each call a NaN buffer of the output's size is
freed, so the allocator hands that memory to the kernel's output and unwritten elements show.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from moe_lowering.kernels import BackendUnavailable, get_backend

try:
    get_backend("triton")
except BackendUnavailable as err:
    pytest.skip(f"Triton backend unavailable: {err}", allow_module_level=True)

from moe_lowering.kernels.grouped_matmul import triton_launch as tgm  # noqa: E402
from moe_lowering.sparse_moe import grouped_matmul  # noqa: E402

pytestmark = pytest.mark.gpu

# name: (group sizes, rows, group_offset, local groups)
CASES = {
    "empty-groups": ([130, 0, 257, 3, 0, 411, 199], 1000, 0, 7),
    "one-group-takes-all": ([0, 0, 777, 0], 777, 0, 4),
    "rows-outside-groups": ([100, 250, 0, 311], 901, 0, 4),
    "group-offset-window": ([120, 333, 64, 0, 290, 150], 957, 1, 4),
    "all-empty": ([0, 0, 0], 129, 0, 3),
    "large-groups": ([300, 0, 520, 270], 1090, 0, 4),  # over SMALL_GROUP_ROWS: tgmm_kernel, not the resident one
}
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2}


def _poison(shape, dtype):
    jnp.full(shape, jnp.nan, dtype).block_until_ready()


def _group_of_row(group_sizes, num_rows):
    group_of_row = np.full(num_rows, -1)
    ends = np.cumsum(group_sizes)
    for group, (start, end) in enumerate(zip(ends - np.asarray(group_sizes), ends)):
        group_of_row[start:min(end, num_rows)] = group
    return group_of_row


def _gmm_reference(lhs, rhs, group_sizes, group_offset, transpose_rhs):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    weights = np.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    out = np.zeros((lhs.shape[0], weights.shape[2]))
    for local in range(weights.shape[0]):
        rows = _group_of_row(group_sizes, lhs.shape[0]) == local + group_offset
        out[rows] = lhs[rows] @ weights[local]
    return out


def _tgmm_reference(lhs, grad, group_sizes, group_offset, num_groups):
    lhs, grad = np.asarray(lhs, np.float64), np.asarray(grad, np.float64)
    group_of_row = _group_of_row(group_sizes, lhs.shape[0])
    out = np.zeros((num_groups, lhs.shape[1], grad.shape[1]))
    for local in range(num_groups):
        rows = group_of_row == local + group_offset
        out[local] = lhs[rows].T @ grad[rows]
    return out


def _relative_error(actual, expected):
    actual = np.asarray(actual, np.float64)
    assert not np.isnan(actual).any(), f"{np.isnan(actual).sum()} output elements were never written (or NaN)"
    return np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)


def _random(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


# Every table entry: float32 inputs use the float32 entry, the others run in bf16.
DTYPE_CONFIGS = [
    pytest.param(jnp.float32 if config == tgm.gmm_config(1, 1, 1, 1, True) else jnp.bfloat16, config,
                 id=f"{config.block_m}x{config.block_n}x{config.block_k}s{config.num_stages}")
    for config in tgm.TABLE_CONFIGS
]


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["rhs", "rhsT"])
@pytest.mark.parametrize("dtype,config", DTYPE_CONFIGS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_gmm_matches_reference(case, dtype, transpose_rhs, config):
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    k, n = 200, 328
    keys = jax.random.split(jax.random.key(hash((case, transpose_rhs)) % 2**31), 2)
    lhs = _random(keys[0], (num_rows, k), dtype)
    rhs = _random(keys[1], (num_local, n, k) if transpose_rhs else (num_local, k, n), dtype)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    _poison((num_rows, n), dtype)
    out = tgm.gmm(lhs, rhs, sizes, group_offset=group_offset, transpose_rhs=transpose_rhs, config=config)
    assert out.shape == (num_rows, n) and out.dtype == dtype
    expected = _gmm_reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes, group_offset, transpose_rhs)
    assert _relative_error(out.astype(jnp.float32), expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["rhs", "rhsT"])
@pytest.mark.parametrize("k", [256, 2304], ids=["short-k", "long-k"])
@pytest.mark.parametrize("tail_apart", [True, False], ids=["tail-apart", "tail-in-main"])
def test_flattened_tile_loop_gives_the_same_bits(monkeypatch, tail_apart, k, transpose_rhs):
    """``TileConfig.flatten`` changes only the schedule: every output bit as the unflattened loop,
    over many waves of tiles, an empty group and rows past the groups (which stay zero), for both
    table tiles that flatten."""
    monkeypatch.setattr(tgm, "TAIL_APART", tail_apart)
    group_sizes = [3000, 0, 129, 4000, 1, 5000, 2500, 700]
    num_rows, n = sum(group_sizes) + 37, 768
    keys = jax.random.split(jax.random.key(7), 2)
    lhs = _random(keys[0], (num_rows, k), jnp.bfloat16)
    rhs = _random(keys[1], (len(group_sizes), n, k) if transpose_rhs else (len(group_sizes), k, n), jnp.bfloat16)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    table = tgm.gmm_config(num_rows, k, n, len(group_sizes), False)
    assert table.flatten
    outs = {}
    for flatten in (False, True):
        config = dataclasses.replace(table, flatten=flatten)
        _poison((num_rows, n), jnp.bfloat16)
        outs[flatten] = np.asarray(jax.jit(lambda a, b, c=config: tgm.gmm(a, b, sizes, transpose_rhs=transpose_rhs,
                                                                          config=c))(lhs, rhs), np.float32)
    np.testing.assert_array_equal(outs[True], outs[False])
    assert not outs[True][sum(group_sizes):].any()
    expected = _gmm_reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes, 0, transpose_rhs)
    assert _relative_error(jnp.asarray(outs[True]), expected) < TOLERANCE[jnp.bfloat16]


@pytest.mark.parametrize("k", [512, 2304], ids=["short-k", "long-k"])
@pytest.mark.parametrize("group_sizes", [[3000, 0, 2500, 700], [130, 0, 257, 3, 0, 411, 199]],
                         ids=["large-groups", "groups-of-142-rows"])
def test_float32_output_on_the_flattened_tiles(group_sizes, k):
    """bf16 products written in float32 (the JVP compositions' accumulation dtype, the FP8 weights'
    dequantised fallback) on the table's flattened tiles: they run unflattened there, or the
    epilogue's shared memory does not fit; ``gmm`` and ``gmm_pair``, against the float64 reference."""
    num_rows, n = sum(group_sizes) + 5, 512
    keys = jax.random.split(jax.random.key(12), 3)
    lhs = _random(keys[0], (num_rows, k), jnp.bfloat16)
    rhs_a = _random(keys[1], (len(group_sizes), k, n), jnp.bfloat16)
    rhs_b = _random(keys[2], (len(group_sizes), k, n), jnp.bfloat16)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    assert tgm.gmm_config(num_rows, k, n, len(group_sizes), False, flattened_loop=True).flatten
    out = tgm.gmm(lhs, rhs_a, sizes, preferred_element_type=jnp.float32)
    pair = tgm.gmm_pair(lhs, rhs_a, rhs_b, sizes, preferred_element_type=jnp.float32)
    for got, rhs in ((out, rhs_a), (pair[0], rhs_a), (pair[1], rhs_b)):
        assert got.dtype == jnp.float32
        expected = _gmm_reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes, 0, False)
        assert _relative_error(got, expected) < TOLERANCE[jnp.float32]


def test_groups_of_128_rows_take_the_full_tile_only_where_the_loop_is_flattened():
    """DeepSeek's 128 rows per expert: ``gmm_kernel`` (flattened) takes the 128-row tile, the kernels
    that do not flatten keep the 64-row one, and groups under ``FULL_TILE_MIN_ROWS`` take it everywhere."""
    experts, k, n = 256, 7168, 2048
    deepseek_rows = 128 * experts
    assert tgm.gmm_config(deepseek_rows, k, n, experts, False, flattened_loop=True) == tgm._WIDE
    assert tgm.gmm_config(deepseek_rows, k, n, experts, False) == tgm._SMALL_GROUPS
    fewer = (tgm.FULL_TILE_MIN_ROWS - 1) * experts
    assert tgm.gmm_config(fewer, k, n, experts, False, flattened_loop=True) == tgm._SMALL_GROUPS
    assert tgm.gmm_config(tgm.SMALL_GROUP_ROWS * experts, 512, n, experts, False) == tgm._WIDE_SHORT_K


def test_tgmm_cases_reach_both_weight_gradient_kernels():
    small = [tgm._small_groups(rows, num_local) for _, rows, _, num_local in CASES.values()]
    assert any(small) and not all(small)


@pytest.mark.parametrize("dtype,config", DTYPE_CONFIGS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_tgmm_matches_reference(case, dtype, config):
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    k, n = 200, 328
    keys = jax.random.split(jax.random.key(hash(case) % 2**31), 2)
    lhs = _random(keys[0], (num_rows, k), dtype)
    grad = _random(keys[1], (num_rows, n), dtype)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    _poison((num_local, k, n), dtype)
    out = tgm.tgmm(lhs, grad, sizes, num_groups=num_local, group_offset=group_offset, config=config)
    assert out.shape == (num_local, k, n) and out.dtype == dtype
    expected = _tgmm_reference(lhs.astype(jnp.float32), grad.astype(jnp.float32), group_sizes, group_offset, num_local)
    assert _relative_error(out.astype(jnp.float32), expected) < TOLERANCE[dtype]


def test_gmm_inside_jit_with_device_group_sizes():
    """Group sizes computed on device inside the jitted program (no host sync, any split)."""
    num_rows, k, n, groups = 1531, 384, 520, 6
    keys = jax.random.split(jax.random.key(7), 3)
    lhs = _random(keys[0], (num_rows, k), jnp.bfloat16)
    rhs = _random(keys[1], (groups, k, n), jnp.bfloat16)
    experts = jnp.sort(jax.random.randint(keys[2], (num_rows,), 0, groups))

    @jax.jit
    def run(lhs, rhs, experts):
        sizes = jnp.zeros((groups,), jnp.int32).at[experts].add(1)
        return tgm.gmm(lhs, rhs, sizes), sizes

    out, sizes = run(lhs, rhs, experts)
    expected = _gmm_reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), np.asarray(sizes), 0, False)
    assert _relative_error(out.astype(jnp.float32), expected) < 1e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_grouped_matmul_gradients_match_reference(dtype):
    """Forward and both backward products through the custom_vjp, against float64 references."""
    num_rows, k, n = 1000, 200, 328
    group_sizes = CASES["empty-groups"][0]
    keys = jax.random.split(jax.random.key(3), 3)
    lhs = _random(keys[0], (num_rows, k), dtype)
    rhs = _random(keys[1], (len(group_sizes), k, n), dtype)
    cotangent = _random(keys[2], (num_rows, n), dtype)
    sizes = jnp.asarray(group_sizes, jnp.int32)

    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, "triton"), lhs, rhs)
    d_lhs, d_rhs = jax.jit(vjp)(cotangent)
    lhs32, rhs32, cot32 = (np.asarray(v.astype(jnp.float32)) for v in (lhs, rhs, cotangent))
    tolerance = TOLERANCE[dtype]
    assert _relative_error(out.astype(jnp.float32), _gmm_reference(lhs32, rhs32, group_sizes, 0, False)) < tolerance
    assert d_lhs.dtype == dtype and d_rhs.dtype == dtype
    expected_d_lhs = _gmm_reference(cot32, rhs32, group_sizes, 0, True)
    assert _relative_error(d_lhs.astype(jnp.float32), expected_d_lhs) < tolerance
    expected_d_rhs = _tgmm_reference(lhs32, cot32, group_sizes, 0, len(group_sizes))
    assert _relative_error(d_rhs.astype(jnp.float32), expected_d_rhs) < tolerance


def test_table_picks_a_config_for_every_benchmark_shape():
    for rows, k, n, groups in [(16384, 4096, 14336, 8), (131072, 2048, 768, 128), (32768, 7168, 2048, 256)]:
        for pick in (tgm.gmm_config, tgm.tgmm_config):
            assert pick(rows, k, n, groups, False) in tgm.TABLE_CONFIGS


@pytest.mark.parametrize("case", ["rows-outside-groups", "group-offset-window"])
def test_gmm_without_zeros_outside_writes_the_group_rows_alike(case):
    """``zero_outside=False`` leaves rows outside the local groups unwritten and the rest as ``gmm``'s."""
    group_sizes, num_rows, group_offset, local_groups = CASES[case]
    k_lhs, k_rhs = jax.random.split(jax.random.key(3))
    lhs = _random(k_lhs, (num_rows, 96), jnp.bfloat16)
    rhs = _random(k_rhs, (local_groups, 96, 136), jnp.bfloat16)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    inside = (_group_of_row(group_sizes, num_rows) >= group_offset) & (
        _group_of_row(group_sizes, num_rows) < group_offset + local_groups)
    full = np.asarray(tgm.gmm(lhs, rhs, sizes, group_offset=group_offset), np.float32)
    _poison((num_rows, 136), jnp.bfloat16)
    partial = np.asarray(tgm.gmm(lhs, rhs, sizes, group_offset=group_offset, zero_outside=False), np.float32)
    np.testing.assert_array_equal(partial[inside], full[inside])
    assert (full[~inside] == 0).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gmm_splits_the_tiles_past_its_last_wave_along_k(dtype, monkeypatch):
    """Sizes that leave a few tiles past the last full wave of 132 programs, which the tail kernel
    does in units cut along K. bf16's 128 x 256 tiles: 12 tail tiles, 4 of full rows (two 64-row
    halves each) and 8 of the second group's last 36 rows (one half, the other skipped), so 16
    units of 8 pieces; float32's 64 x 64 tiles are units whole: 32 of 4 pieces. The product equals
    the float64 reference and the product with its tail left whole."""
    group_sizes, num_rows, k, n = [1040, 1060], 2100, 512, 2048
    monkeypatch.setattr(tgm, "_multiprocessor_count", lambda: 132)
    config = tgm.gmm_config(num_rows, k, n, 2, dtype == jnp.float32)
    tiles = sum(-(-size // config.block_m) for size in group_sizes) * -(-n // config.block_n)
    assert 2 * (tiles % 132) <= 132 and tiles > 132, "the case must have a tail to split"
    k_lhs, k_rhs = jax.random.split(jax.random.key(6))
    lhs = _random(k_lhs, (num_rows, k), dtype)
    rhs = _random(k_rhs, (2, k, n), dtype)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    split = tgm.gmm(lhs, rhs, sizes)
    assert _relative_error(split, _gmm_reference(lhs, rhs, group_sizes, 0, False)) < TOLERANCE[dtype]
    monkeypatch.setattr(tgm, "TAIL_APART", False)
    whole = tgm.gmm(lhs, rhs, sizes)
    assert _relative_error(split, np.asarray(whole, np.float64)) < TOLERANCE[dtype] / 10


# (group sizes, rows, programs) leaving a tail. bf16's 128 x 256 tiles: the sizes of the test above
# on 132 programs, 16 units a product, 32 for the pair in 4 pieces; 128-row multiples on 40 programs,
# 16 tail tiles of two halves, 64 units for the pair, whole, some programs doing two. float32's
# 64 x 64 tiles: 32 units a product in 2 pieces on 132 programs, 8 a product in 2 pieces on 40.
PAIR_CASES = {"past-132": ([1040, 1060], 2100, 132), "more-units-than-programs": ([1024, 1152], 2200, 40)}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("zero_outside", [True, False])
@pytest.mark.parametrize("case", sorted(PAIR_CASES))
def test_gmm_pair_equals_two_gmm_with_one_tail_launch(case, dtype, zero_outside, monkeypatch):
    """The gate/up pair with one tail launch: each output equals its own ``gmm`` and the float64
    reference on the rows that must be written."""
    group_sizes, num_rows, programs = PAIR_CASES[case]
    k, n = 512, 2048
    monkeypatch.setattr(tgm, "_multiprocessor_count", lambda: programs)
    k_lhs, k_a, k_b = jax.random.split(jax.random.key(7), 3)
    lhs = _random(k_lhs, (num_rows, k), dtype)
    rhs_a, rhs_b = _random(k_a, (2, k, n), dtype), _random(k_b, (2, k, n), dtype)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    live = num_rows if zero_outside else sum(group_sizes)
    _poison((num_rows, n), dtype)
    pair = tgm.gmm_pair(lhs, rhs_a, rhs_b, sizes, zero_outside=zero_outside)
    for out, rhs in zip(pair, (rhs_a, rhs_b)):
        alone = np.asarray(tgm.gmm(lhs, rhs, sizes, zero_outside=zero_outside), np.float64)
        reference = _gmm_reference(lhs, rhs, group_sizes, 0, False)
        assert _relative_error(out[:live], reference[:live]) < TOLERANCE[dtype]
        assert _relative_error(out[:live], alone[:live]) < TOLERANCE[dtype] / 10


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_expected_rows_picks_the_tile_for_the_rows_that_come(transpose_rhs):
    """A receive buffer four times the rows its groups hold (as the expert-parallel exchange
    sizes it): ``expected_rows`` picks the small-group tiles that the buffer's size alone would
    not, and ``gmm``, ``gmm_pair`` and the gradients stay equal to the float64 reference."""
    group_sizes = [120, 131, 0, 97, 256, 129, 140, 127]
    live, groups, k, n = sum(group_sizes), len(group_sizes), 384, 512
    num_rows = 4 * live
    from_buffer = tgm._row_tiled_launch(jnp.bfloat16, jnp.bfloat16, num_rows, k, n, groups, groups)
    from_rows = tgm._row_tiled_launch(jnp.bfloat16, jnp.bfloat16, num_rows, k, n, groups, groups, expected_rows=live)
    assert (from_buffer["BLOCK_M"], from_rows["BLOCK_M"]) == (128, 64)
    assert from_rows["NUM_PROGRAMS"] == tgm._row_tile_grid(num_rows, n, groups, tgm.gmm_config(live, k, n, groups, False))

    keys = jax.random.split(jax.random.key(11), 4)
    lhs = _random(keys[0], (num_rows, k), jnp.bfloat16)
    shape = (groups, n, k) if transpose_rhs else (groups, k, n)
    rhs_a, rhs_b = _random(keys[1], shape, jnp.bfloat16), _random(keys[2], shape, jnp.bfloat16)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    _poison((num_rows, n), jnp.bfloat16)
    out = tgm.gmm(lhs, rhs_a, sizes, transpose_rhs=transpose_rhs, zero_outside=False, expected_rows=live)
    reference = _gmm_reference(lhs, rhs_a, group_sizes, 0, transpose_rhs)
    assert _relative_error(out[:live], reference[:live]) < TOLERANCE[jnp.bfloat16]
    if transpose_rhs:
        return
    pair = tgm.gmm_pair(lhs, rhs_a, rhs_b, sizes, zero_outside=False, expected_rows=live)
    for product, rhs in zip(pair, (rhs_a, rhs_b)):
        assert _relative_error(product[:live], _gmm_reference(lhs, rhs, group_sizes, 0, False)[:live]) < 1e-2

    cotangent = _random(keys[3], (num_rows, n), jnp.bfloat16)
    live_rows = (jnp.arange(num_rows) < live)[:, None]

    def loss(lhs, rhs):
        product = grouped_matmul(lhs, rhs, sizes, "triton", 0, None, False, live)
        return jnp.sum(jnp.where(live_rows, product.astype(jnp.float32) * cotangent.astype(jnp.float32), 0))

    d_lhs, d_rhs = jax.grad(loss, argnums=(0, 1))(lhs, rhs_a)
    masked = np.where(np.asarray(live_rows), np.asarray(cotangent, np.float64), 0)
    expected_d_lhs = _gmm_reference(masked, np.swapaxes(np.asarray(rhs_a, np.float64), 1, 2), group_sizes, 0, False)
    assert _relative_error(d_lhs[:live].astype(jnp.float32), expected_d_lhs[:live]) < 1e-2
    expected_d_rhs = _tgmm_reference(np.asarray(lhs, np.float64), masked, group_sizes, 0, groups)
    assert _relative_error(d_rhs.astype(jnp.float32), expected_d_rhs) < 1e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gmm_sum_matches_both_products(case, dtype):
    """``a @ rhs_a^T + b @ rhs_b^T`` in one kernel, every row written (poisoned output), zeros outside."""
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    k, n = 200, 328
    keys = jax.random.split(jax.random.key(hash(("sum", case)) % 2**31), 4)
    lhs_a, lhs_b = (_random(keys[i], (num_rows, k), dtype) for i in range(2))
    rhs_a, rhs_b = (_random(keys[i], (num_local, n, k), dtype) for i in range(2, 4))
    sizes = jnp.asarray(group_sizes, jnp.int32)
    _poison((num_rows, n), dtype)
    out = tgm.gmm_sum(lhs_a, lhs_b, rhs_a, rhs_b, sizes, group_offset=group_offset)
    assert out.shape == (num_rows, n) and out.dtype == dtype
    f32 = [x.astype(jnp.float32) for x in (lhs_a, lhs_b, rhs_a, rhs_b)]
    expected = (_gmm_reference(f32[0], f32[2], group_sizes, group_offset, True)
                + _gmm_reference(f32[1], f32[3], group_sizes, group_offset, True))
    assert _relative_error(out.astype(jnp.float32), expected) < TOLERANCE[dtype]


def _gathered(key, num_rows, width, dtype):
    """A ``[num_rows // 2 + 1, width]`` source, each row's index into it and its scale."""
    keys = jax.random.split(key, 3)
    source = _random(keys[0], (num_rows // 2 + 1, width), dtype)
    index = jax.random.randint(keys[1], (num_rows,), 0, source.shape[0])
    scale = jax.random.uniform(keys[2], (num_rows,), minval=0.5, maxval=1.5)
    return source, index, scale


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gather_gmm_and_gather_tgmm_match_reference(case, dtype):
    """The combine's backward products: rows gathered and scaled as they are loaded, the dots from
    the epilogue's column-tile partials (zero outside the local groups), both weight-gradient kernels."""
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    k, n = 200, 328
    keys = jax.random.split(jax.random.key(hash(("gather", case)) % 2**31), 4)
    source, index, scale = _gathered(keys[0], num_rows, k, dtype)
    rhs = _random(keys[1], (num_local, n, k), dtype)
    dot_with = _random(keys[2], (num_rows, n), dtype)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    gathered = np.asarray(source.astype(jnp.float32))[np.asarray(index)]
    product = _gmm_reference(gathered, rhs.astype(jnp.float32), group_sizes, group_offset, True)
    _poison((num_rows, n), dtype)
    out, dots = tgm.gather_gmm(source, rhs, index, scale, dot_with, sizes, group_offset=group_offset,
                               transpose_rhs=True)
    assert out.dtype == dtype and dots.dtype == jnp.float32
    assert _relative_error(out.astype(jnp.float32), product * np.asarray(scale)[:, None]) < TOLERANCE[dtype]
    want_dots = (product * np.asarray(dot_with.astype(jnp.float32), np.float64)).sum(axis=1)
    assert _relative_error(dots, want_dots) < TOLERANCE[dtype]

    lhs = _random(keys[3], (num_rows, k), dtype)
    grad_source, grad_index, grad_scale = _gathered(keys[0], num_rows, n, dtype)
    _poison((num_local, k, n), dtype)
    d_weight = tgm.gather_tgmm(lhs, grad_source, grad_index, grad_scale, sizes, num_groups=num_local,
                               group_offset=group_offset)
    grad = np.asarray(grad_source.astype(jnp.float32))[np.asarray(grad_index)] * np.asarray(grad_scale)[:, None]
    expected = _tgmm_reference(lhs.astype(jnp.float32), grad, group_sizes, group_offset, num_local)
    assert _relative_error(d_weight.astype(jnp.float32), expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gather_lhs_tgmm_matches_reference(case, dtype):
    """The up projection's weight gradient reading the token rows by index (repeated, some past the
    source: clamped), its tiles stored transposed (the resident schedule, and the row loop for
    ``large-groups``): ``[G, D, N]`` against the float32 product of the gathered rows, every element
    written (poisoned memory first)."""
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    d, n = 328, 200
    keys = jax.random.split(jax.random.key(hash(("gather_lhs", case)) % 2**31), 2)
    source, index, _ = _gathered(keys[0], num_rows, d, dtype)
    grad = _random(keys[1], (num_rows, n), dtype)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    rows = np.asarray(source.astype(jnp.float32))[np.minimum(np.asarray(index), source.shape[0] - 1)]
    expected = _tgmm_reference(rows, grad.astype(jnp.float32), group_sizes, group_offset, num_local)
    _poison((num_local, d, n), dtype)
    got = tgm.gather_lhs_tgmm(source, grad, index, sizes, num_groups=num_local, group_offset=group_offset)
    assert got.shape == (num_local, d, n) and got.dtype == dtype
    assert np.isfinite(np.asarray(got.astype(jnp.float32))).all()
    assert _relative_error(got.astype(jnp.float32), expected) < TOLERANCE[dtype]


def test_layer_combined_in_its_last_product_equals_them_apart(monkeypatch):
    """The sparse MoE with ``expert_combine`` (gathered backward products) against the last product and
    the combine apart on the Triton backend, dropped copies included: outputs and every gradient to
    bf16 rounding, no ``[N, D]`` spread in the fused program."""
    from moe_lowering import sparse_moe as sparse_moe_module
    from moe_lowering.expert_program import ExpertMatmul, ExpertProgram, ParamKind, RowInput, topological_nodes

    keys = jax.random.split(jax.random.key(7), 6)
    t, d, f, e, k = 600, 256, 192, 8, 2
    tokens = _random(keys[0], (t, d), jnp.bfloat16)
    idx = jax.random.randint(keys[1], (t, k), 0, e + 1)  # e: a dropped copy
    weights = jax.nn.softmax(jax.random.normal(keys[2], (t, k)))
    w_up = _random(keys[3], (e, d, f), jnp.bfloat16) * 0.1
    w_down = _random(keys[4], (e, f, d), jnp.bfloat16) * 0.1
    out_node = ExpertMatmul(ExpertMatmul(RowInput(), 0), 1)
    program = ExpertProgram(out_node, (ParamKind.EXPERT_WEIGHT,) * 2, topological_nodes(out_node))

    def loss(tokens, weights, w_up, w_down):
        out = sparse_moe_module.sparse_moe(tokens, idx, weights, [w_up, w_down], program, num_experts=e,
                                           backend="triton")
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    results = {}
    for fused in (False, True):
        monkeypatch.setattr(sparse_moe_module, "COMBINE_IN_LAST_PRODUCT_MAX_WIDTH", 256 if fused else 0)
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        text = str(jax.make_jaxpr(fn)(tokens, weights, w_up, w_down))
        assert ("moe_gather_gmm" in text) is fused and ("moe_spread" in text) is not fused
        results[fused] = fn(tokens, weights, w_up, w_down)
    for got, want in zip(jax.tree_util.tree_leaves(results[True]), jax.tree_util.tree_leaves(results[False])):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.isfinite(got).all() and np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
