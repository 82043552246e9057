"""``gmm`` / ``tgmm`` on a CUDA GPU: the Triton kernels of :mod:`.triton_kernels` as XLA custom calls.

Same contracts as :mod:`.reference` (the reference and CPU path). Tile shapes come from a
small table keyed by the shape class of the product (:func:`gmm_config`, :func:`tgmm_config`),
measured once on an H200 (see ``benchmarks/NOTES.md``), never tuned per call.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import jax_triton

from moe_lowering.kernels.grouped_matmul import reference
from moe_lowering.kernels.grouped_matmul.triton_kernels import (
    gather_gmm_kernel,
    gather_lhs_tgmm_kernel,
    gather_lhs_tgmm_resident_kernel,
    gather_tgmm_kernel,
    gather_tgmm_resident_kernel,
    gmm_kernel,
    gmm_pair_tail_kernel,
    gmm_push_kernel,
    gmm_push_tail_kernel,
    gmm_sum_kernel,
    gmm_tail_kernel,
    tgmm_kernel,
    tgmm_resident_kernel,
)

log = logging.getLogger(__name__)

_TENSOR_CORE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_KERNEL_DTYPES = _TENSOR_CORE_DTYPES + (jnp.dtype(jnp.float32),)


# The row-tiled products leave the tiles past their last full wave to a second kernel that splits
# them along K (``triton_kernels.gmm_tail_kernel``): a GPU one row tile over a wave boundary
# otherwise runs a whole extra wave (benchmarks/EP_NOTES.md, round 8). False only to measure that.
TAIL_APART = True


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One kernel launch shape.

    For ``gmm`` the tile is ``block_m`` rows x ``block_n`` output columns, reduced ``block_k`` at
    a time; for ``tgmm`` it is ``block_m`` x ``block_n`` of a group's ``[K, N]`` output, reduced
    over the group's rows ``block_k`` at a time. ``persistent``: ``programs_per_sm`` programs per
    multiprocessor looping over tiles (more than one where a tile's few reduction steps leave its
    loads and stores exposed, so another program's work hides them), else one program per
    (possible) tile. ``flatten``: ``gmm_kernel`` (``gmm``, ``gmm_pair``) pipelines its tile loop and
    K loop as one (``tl.range(..., flatten=True)``), so the next tile's first loads overlap this
    tile's last steps and its store; one more stage of shared memory. The other row-tiled kernels
    do not read it: flattened, ``gather_gmm_kernel`` spilled and ran 0.60 against 0.42 ms,
    ``gmm_sum_kernel`` (two K loops a tile) kept 1 of its 4 stages, and the fused SwiGLU kernels
    ran up to 3x slower (``benchmarks/NOTES.md``).
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = True
    programs_per_sm: int = 1
    flatten: bool = False


_F32_CONFIG = TileConfig(64, 64, 32, group_m=8, num_warps=4, num_stages=2)
_SMALL_GROUPS = TileConfig(64, 256, 64, num_warps=8, num_stages=4)
_WIDE_SHORT_K = TileConfig(128, 256, 64, num_warps=8, num_stages=4, flatten=True)
_WIDE = TileConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True)
_RESIDENT = TileConfig(128, 128, 128, num_warps=8, num_stages=3)

TABLE_CONFIGS = (_F32_CONFIG, _SMALL_GROUPS, _WIDE_SHORT_K, _WIDE, _RESIDENT)
"""Every configuration the tables below can pick, so tests can run each one."""


SMALL_GROUP_ROWS = 256
"""Groups averaging fewer rows than this are small: each group's last row tile pads much of the
group (``gmm``), and a weight-gradient tile reduces over too few rows to hide its loads (``tgmm``)."""


FULL_TILE_MIN_ROWS = 128
"""Small groups averaging at least this many rows still take the flattened 128-row tile in
``gmm_kernel`` (``gmm``, ``gmm_pair``): at DeepSeek's 128 rows per expert on an H200 it beat the
64-row tile on all four products, padding and all (``benchmarks/NOTES.md``). Below it, and in the
kernels that do not flatten their tile loop (measured only against 64-row tiles unflattened: even,
and slower in the expert-parallel step), 64-row tiles."""


def _small_groups(num_rows: int, num_groups: int) -> bool:
    return num_rows / max(num_groups, 1) < SMALL_GROUP_ROWS


def runs_resident_tgmm(num_rows: int, num_groups: int, expected_rows: int | None = None) -> bool:
    """Whether ``tgmm`` of ``num_rows`` rows in ``num_groups`` groups takes ``tgmm_resident_kernel``."""
    return _small_groups(_rows_for_shape(num_rows, expected_rows), num_groups)


def _rows_for_shape(num_rows: int, expected_rows: int | None) -> int:
    """The rows a shape class is picked for: ``expected_rows`` where the operand is a buffer sized for
    the worst case (an expert-parallel receive buffer holds ``ep`` times a balanced arrival)."""
    return num_rows if expected_rows is None else max(1, min(expected_rows, num_rows))


def gmm_config(num_rows: int, k: int, n: int, num_groups: int, compute_f32: bool,
               flattened_loop: bool = False) -> TileConfig:
    """Tile shape for ``[num_rows, k] x [num_groups, k, n]`` by shape class.

    From ``benchmarks/gmm_sweep.py`` on an H200 (``benchmarks/NOTES.md``): 64-row tiles when
    groups average under 256 rows (less padding in each group's last tile), except from
    ``FULL_TILE_MIN_ROWS`` on for a kernel that flattens its tile loop (``flattened_loop``), a 4-deep
    pipeline when groups are large and the contraction short (K <= 2048), else 128 x 256 tiles 3
    deep. The 128-row tiles flatten their tile loop into the K loop: on an H100 at SonicMoE's shapes
    316 -> 395 TFLOP/s at K = 256, 478 -> 528 at K = 512; on an H200 Mixtral's transposed products
    (``rhs`` read as ``[G, N, K]``) 641-666 -> 739-766, its others even, and DeepSeek's (128 rows a
    group) 377-446 on 64-row tiles -> 403-449.
    """
    if compute_f32:
        return _F32_CONFIG
    if _small_groups(num_rows, num_groups):
        full_tiles = flattened_loop and num_rows / max(num_groups, 1) >= FULL_TILE_MIN_ROWS
        return _WIDE if full_tiles else _SMALL_GROUPS
    if k <= 2048:
        return _WIDE_SHORT_K
    return _WIDE


def tgmm_config(num_rows: int, k: int, n: int, num_groups: int, compute_f32: bool) -> TileConfig:
    """Tile shape for the per-group ``[k, n]`` weight gradient.

    Small groups run ``tgmm_resident_kernel`` on 128 x 128 tiles of 128 resident rows (the A/B in
    ``benchmarks/NOTES.md``); otherwise 128 x 256 blocks, which won on every larger layer shape.
    """
    if compute_f32:
        return _F32_CONFIG
    return _RESIDENT if _small_groups(num_rows, num_groups) else _WIDE


@functools.cache
def _multiprocessor_count() -> int:
    device = next(d for d in jax.devices() if d.platform == "gpu")
    return int(getattr(device, "core_count", 0) or 132)


def _grid_size(max_tiles: int, config: TileConfig) -> int:
    """Programs to launch: ``programs_per_sm`` per multiprocessor (persistent, never more than the tiles),
    else one per tile."""
    return min(max_tiles, config.programs_per_sm * _multiprocessor_count()) if config.persistent else max_tiles


def _row_tile_grid(num_rows: int, n: int, num_local_groups: int, config: TileConfig) -> int:
    """Programs for a product tiled over rows x columns: each group's last row tile may be partial,
    so there are at most ``ceil(rows / block_m) + groups`` row tiles."""
    max_tiles = (-(-num_rows // config.block_m) + num_local_groups) * -(-n // config.block_n)
    return _grid_size(max_tiles, config)


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def _check_group_sizes(group_sizes, name: str):
    if group_sizes.ndim != 1:
        raise ValueError(f"{name}: group_sizes must be 1-D, got shape {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"{name}: group_sizes must be integers, got {group_sizes.dtype}")


def _offset_array(group_offset):
    return jnp.asarray(group_offset, jnp.int32).reshape(1)


def has_kernel(*dtypes) -> bool:
    """Whether the kernels take operands and outputs of these dtypes (else the XLA path runs)."""
    return {jnp.dtype(d) for d in dtypes} <= set(_KERNEL_DTYPES)


def _compute_f32(*dtypes) -> bool:
    return not (len(set(dtypes)) == 1 and dtypes[0] in _TENSOR_CORE_DTYPES)


def _gmm_shapes(lhs, rhs, group_sizes, transpose_rhs: bool, preferred_element_type, name: str):
    """``(rows, K, N, local groups, output dtype)`` of a grouped product, its operands checked."""
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"{name}: expected lhs [M, K] and rhs [G, K, N], got {lhs.shape} and {rhs.shape}")
    _check_group_sizes(group_sizes, name)
    num_rows, k = lhs.shape
    rhs_k, n = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1], rhs.shape[2])
    if rhs_k != k:
        raise ValueError(f"{name}: contraction sizes differ: lhs {lhs.shape}, rhs {rhs.shape}, "
                         f"transpose_rhs={transpose_rhs}")
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    return num_rows, k, n, rhs.shape[0], out_dtype


def _for_output(config: TileConfig, out_dtype) -> TileConfig:
    """``config`` as ``gmm_kernel`` can run it for ``out_dtype``: unflattened for a float32 output.
    Flattened, the next tile's pipeline buffers are live during the epilogue, so the float32 tile's
    layout change cannot reuse them: 128 x 256 x 64 asked for 278528 bytes of shared memory in 3
    stages and 327680 in 4, where an H100 or H200 has 232448; unflattened 147456 and 196608 (compiled
    for sm_90 with Triton 3.6, ``benchmarks/kernel_resources.py``'s method)."""
    if jnp.dtype(out_dtype).itemsize <= 2:
        return config
    return dataclasses.replace(config, flatten=False)


def _gmm_main(lhs, rhs, operands, launch: dict, out_dtype, transpose_rhs: bool, zero_outside: bool, flatten: bool):
    """``gmm_kernel``'s launch: the whole product, or its full waves only with ``TAIL_APART``."""
    return jax_triton.triton_call(
        lhs,
        rhs,
        *operands,
        kernel=gmm_kernel,
        out_shape=jax.ShapeDtypeStruct((launch["M"], launch["N"]), out_dtype),
        TRANSPOSE_RHS=bool(transpose_rhs),
        ZERO_OUTSIDE=bool(zero_outside),
        TAIL_APART=TAIL_APART,
        FLATTEN=flatten,
        **launch,
    )


def gmm(
    lhs,
    rhs,
    group_sizes,
    *,
    group_offset=0,
    transpose_rhs: bool = False,
    preferred_element_type=None,
    config: TileConfig | None = None,
    zero_outside: bool = True,
    expected_rows: int | None = None,
):
    """``out[r] = lhs[r] @ rhs[group(r) - group_offset]``; rows outside the local groups are zero,
    or left unwritten with ``zero_outside=False``. ``expected_rows``: see :func:`_row_tiled_launch`."""
    num_rows, k, n, num_local_groups, out_dtype = _gmm_shapes(lhs, rhs, group_sizes, transpose_rhs,
                                                              preferred_element_type, "gmm")
    if num_rows == 0 or n == 0 or k == 0 or num_local_groups == 0:
        return jnp.zeros((num_rows, n), out_dtype)
    if not has_kernel(lhs.dtype, rhs.dtype, out_dtype):
        log.debug("gmm: dtypes %s, %s -> %s have no Triton kernel; using the XLA path", lhs.dtype, rhs.dtype, out_dtype)
        return reference.gmm(lhs, rhs, group_sizes, group_offset=group_offset, transpose_rhs=transpose_rhs,
                             preferred_element_type=preferred_element_type, zero_outside=zero_outside)
    config = _for_output(_row_tiled_config(lhs.dtype, rhs.dtype, num_rows, k, n, num_local_groups, config,
                                           expected_rows, flattened_loop=True), out_dtype)
    launch = _row_tiled_launch(lhs.dtype, rhs.dtype, num_rows, k, n, num_local_groups, group_sizes.shape[0], config,
                               expected_rows)
    sizes_and_offset = (group_sizes.astype(jnp.int32), _offset_array(group_offset))
    out = _gmm_main(lhs, rhs, sizes_and_offset, launch, out_dtype, transpose_rhs, zero_outside, config.flatten)
    if not TAIL_APART:
        return out
    out, _, _ = jax_triton.triton_call(
        lhs,
        rhs,
        *sizes_and_offset,
        out,
        kernel=gmm_tail_kernel,
        out_shape=(jax.ShapeDtypeStruct((num_rows, n), out_dtype), *_tail_scratch(launch)),
        input_output_aliases={4: 0},
        zeroed_outputs=(2,),
        TRANSPOSE_RHS=bool(transpose_rhs),
        TAIL_PAD=_tail_pad(launch),
        **launch,
    )
    return out


def gmm_pair(lhs, rhs_a, rhs_b, group_sizes, *, group_offset=0, preferred_element_type=None,
             config: TileConfig | None = None, zero_outside: bool = True, expected_rows: int | None = None):
    """``(gmm(lhs, rhs_a, ...), gmm(lhs, rhs_b, ...))`` with one tail launch for both products.

    For SwiGLU's gate and up products of the same rows: each tail launch was mostly fixed cost
    (38 us for 12 us of product on the GPU every other waits for at EP=4, and an empty launch
    on the others), so ``gmm_pair_tail_kernel`` does both products' tails at once. Two ``gmm``
    calls where the pair has no single launch: weights of different shapes or dtypes, no
    kernel for the dtypes, empty operands, or the tail left in the main kernel.
    """
    num_rows, k, n, num_local_groups, out_dtype = _gmm_shapes(lhs, rhs_a, group_sizes, False, preferred_element_type,
                                                              "gmm_pair")
    one_tail_launch = (TAIL_APART and rhs_b.shape == rhs_a.shape and rhs_b.dtype == rhs_a.dtype
                       and min(num_rows, k, n, num_local_groups) > 0 and has_kernel(lhs.dtype, rhs_a.dtype, out_dtype))
    if not one_tail_launch:
        return tuple(gmm(lhs, rhs, group_sizes, group_offset=group_offset, preferred_element_type=preferred_element_type,
                         config=config, zero_outside=zero_outside, expected_rows=expected_rows)
                     for rhs in (rhs_a, rhs_b))
    config = _for_output(_row_tiled_config(lhs.dtype, rhs_a.dtype, num_rows, k, n, num_local_groups, config,
                                           expected_rows, flattened_loop=True), out_dtype)
    launch = _row_tiled_launch(lhs.dtype, rhs_a.dtype, num_rows, k, n, num_local_groups, group_sizes.shape[0], config,
                               expected_rows)
    sizes_and_offset = (group_sizes.astype(jnp.int32), _offset_array(group_offset))
    outs = [_gmm_main(lhs, rhs, sizes_and_offset, launch, out_dtype, False, zero_outside, config.flatten)
            for rhs in (rhs_a, rhs_b)]
    out_shape = jax.ShapeDtypeStruct((num_rows, n), out_dtype)
    out_a, out_b, _, _ = jax_triton.triton_call(
        lhs,
        rhs_a,
        rhs_b,
        *sizes_and_offset,
        *outs,
        kernel=gmm_pair_tail_kernel,
        out_shape=(out_shape, out_shape, *_tail_scratch(launch)),
        input_output_aliases={5: 0, 6: 1},
        zeroed_outputs=(3,),
        TAIL_PAD=_tail_pad(launch),
        **launch,
    )
    return out_a, out_b


def gmm_sum(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, *, group_offset=0, preferred_element_type=None,
            config: TileConfig | None = None, expected_rows: int | None = None):
    """``lhs_a[r] @ rhs_a[g]^T + lhs_b[r] @ rhs_b[g]^T`` (weights ``[G, N, K]``), accumulated in float32
    and written once; zero outside the local groups.

    The rows' cotangent of ``gmm_pair`` (SwiGLU's gate and up products): two transposed ``gmm``
    calls and their float32 sum are three passes over ``[M, N]`` outputs, this kernel one. The
    XLA path (no kernel for the dtypes, empty operands) is exactly those two calls and the sum.
    """
    num_rows, k, n, num_local_groups, out_dtype = _gmm_shapes(lhs_a, rhs_a, group_sizes, True, preferred_element_type,
                                                              "gmm_sum")
    same = lhs_b.shape == lhs_a.shape and rhs_b.shape == rhs_a.shape
    if not same:
        raise ValueError(f"gmm_sum: the two products differ in shape: {lhs_a.shape} x {rhs_a.shape} and "
                         f"{lhs_b.shape} x {rhs_b.shape}")
    dtypes = (lhs_a.dtype, lhs_b.dtype, rhs_a.dtype, rhs_b.dtype)
    if min(num_rows, k, n, num_local_groups) == 0 or not has_kernel(*dtypes, out_dtype) or len(set(dtypes)) > 1:
        return reference.gmm_sum(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, group_offset=group_offset,
                                 preferred_element_type=preferred_element_type)
    # tiles picked for the whole 2k-long contraction; the kernel walks each product's k
    launch = _row_tiled_launch(lhs_a.dtype, rhs_a.dtype, num_rows, 2 * k, n, num_local_groups, group_sizes.shape[0],
                               config, expected_rows)
    return jax_triton.triton_call(
        lhs_a,
        lhs_b,
        rhs_a,
        rhs_b,
        group_sizes.astype(jnp.int32),
        _offset_array(group_offset),
        kernel=gmm_sum_kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, n), out_dtype),
        **{**launch, "K": k},
    )


def gather_gmm(lhs, rhs, row_index, row_scale, dot_with, group_sizes, *, group_offset=0, transpose_rhs=False,
               preferred_element_type=None, config: TileConfig | None = None):
    """``(out, dots)`` of :func:`.reference.gather_gmm`: ``row_scale[r] * (lhs[row_index[r]] @ rhs[g])``
    with the rows gathered as the kernel loads them, and the dots with ``dot_with`` summed from
    the epilogue's per-column-tile partials (``None`` without ``dot_with``)."""
    if lhs.ndim != 2 or row_index.ndim != 1 or row_scale.shape != row_index.shape:
        raise ValueError(f"gather_gmm: expected lhs [T, K], row_index [M] and row_scale [M], got {lhs.shape}, "
                         f"{row_index.shape} and {row_scale.shape}")
    num_rows = row_index.shape[0]
    rows = jax.ShapeDtypeStruct((num_rows, lhs.shape[1]), lhs.dtype)
    _, k, n, num_local_groups, out_dtype = _gmm_shapes(rows, rhs, group_sizes, transpose_rhs, preferred_element_type,
                                                       "gather_gmm")
    if dot_with is not None and dot_with.shape != (num_rows, n):
        raise ValueError(f"gather_gmm: dot_with must be [{num_rows}, {n}], got {dot_with.shape}")
    dtypes = (lhs.dtype, rhs.dtype, out_dtype) + (() if dot_with is None else (dot_with.dtype,))
    if min(num_rows, k, n, num_local_groups, lhs.shape[0]) == 0 or not has_kernel(*dtypes):
        return reference.gather_gmm(lhs, rhs, row_index, row_scale, dot_with, group_sizes,
                                    group_offset=group_offset, transpose_rhs=transpose_rhs,
                                    preferred_element_type=preferred_element_type)
    launch = _row_tiled_launch(lhs.dtype, rhs.dtype, num_rows, k, n, num_local_groups, group_sizes.shape[0], config)
    n_tiles = -(-n // launch["BLOCK_N"])
    row_scale = row_scale.astype(jnp.float32)
    out, partial_dots = jax_triton.triton_call(
        lhs,
        rhs,
        row_index.astype(jnp.int32),
        row_scale,
        row_scale if dot_with is None else dot_with,
        group_sizes.astype(jnp.int32),
        _offset_array(group_offset),
        kernel=gather_gmm_kernel,
        out_shape=(jax.ShapeDtypeStruct((num_rows, n), out_dtype),
                   jax.ShapeDtypeStruct((n_tiles, num_rows) if dot_with is not None else (1,), jnp.float32)),
        LHS_SOURCE_ROWS=lhs.shape[0],
        TRANSPOSE_RHS=bool(transpose_rhs),
        WITH_DOTS=dot_with is not None,
        **launch,
    )
    if dot_with is None:
        return out, None
    # rows outside the local groups have no partials written: zero there
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    first = jnp.where(group_offset > 0, ends[max(group_offset - 1, 0)], 0)
    last = ends[group_offset + num_local_groups - 1]
    row_ids = jnp.arange(num_rows, dtype=jnp.int32)
    return out, jnp.where((row_ids >= first) & (row_ids < last), partial_dots.sum(axis=0), 0.0)


def _tail_scratch(launch: dict) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The tail kernels' float32 partial units (one per program) and their zeroed per-unit counters
    (at most one unit per program, also for the pair's: units are cut only when every piece has a
    program). A unit is the kernel's ``UNIT_M`` rows: half a tile of 128
    rows or more, else the whole tile."""
    programs, block_m = launch["NUM_PROGRAMS"], launch["BLOCK_M"]
    unit_m = block_m // 2 if block_m >= 128 else block_m
    return (jax.ShapeDtypeStruct((programs * unit_m * launch["BLOCK_N"],), jnp.float32),
            jax.ShapeDtypeStruct((programs,), jnp.int32))


def _tail_pad(launch: dict) -> int:
    """The tail kernels' ``TAIL_PAD``: room for every tile past the last full wave, at most half
    the programs (``_tail_split`` leaves it whole otherwise)."""
    return _next_power_of_two(launch["NUM_PROGRAMS"] // 2)


def _row_tiled_config(lhs_dtype, rhs_dtype, num_rows: int, k: int, n: int, num_local_groups: int,
                      config: TileConfig | None, expected_rows: int | None, flattened_loop: bool = False) -> TileConfig:
    """``config``, or the table's tile for the rows expected (see :func:`_row_tiled_launch`)."""
    return config or gmm_config(_rows_for_shape(num_rows, expected_rows), k, n, num_local_groups,
                                _compute_f32(lhs_dtype, rhs_dtype), flattened_loop)


def _row_tiled_launch(lhs_dtype, rhs_dtype, num_rows: int, k: int, n: int, num_local_groups: int, num_groups: int,
                      config: TileConfig | None = None, expected_rows: int | None = None) -> dict:
    """Grid, warps, stages and the constants ``gmm_kernel`` and ``gmm_push_kernel`` share.

    ``expected_rows``: how many of the ``num_rows`` the groups are expected to hold, where the
    operand is a buffer sized for the worst case (an expert-parallel receive buffer holds ``ep``
    times a balanced arrival). The tile shape is picked for the rows that come, not for the
    buffer: at DeepSeek's 128 rows per expert the buffer alone would pick 128-row tiles, half of
    each group's last tile padding; the grid still covers the whole buffer.
    """
    compute_f32 = _compute_f32(lhs_dtype, rhs_dtype)
    config = _row_tiled_config(lhs_dtype, rhs_dtype, num_rows, k, n, num_local_groups, config, expected_rows)
    num_programs = _row_tile_grid(num_rows, n, num_local_groups, config)
    return dict(
        grid=(num_programs,),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        M=num_rows,
        K=k,
        N=n,
        NUM_LOCAL_GROUPS=num_local_groups,
        NUM_GROUPS=num_groups,
        GROUPS_PAD=_next_power_of_two(num_groups),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        NUM_PROGRAMS=num_programs,
        COMPUTE_F32=compute_f32,
    )


def gmm_push(lhs, rhs, group_sizes, dest_device, dest_row, peer_addresses, rank, *, group_offset=0,
             preferred_element_type=None, expected_rows: int | None = None):
    """``gmm``'s rows stored straight into peers' receive buffers: ``(done token, programs that signal)``.

    Row ``r`` of a local group goes to row ``dest_row[r]`` of rank ``dest_device[r]`` (negative:
    nowhere) through ``peer_addresses [ranks, 4]`` (all-gathered ``allocate`` words); the matching
    ``peer_store.triton_launch.wait`` consumes the token and counts the returned number of signals per
    peer. Same tiles as ``gmm``, so every row equals ``gmm``'s bit for bit.
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"gmm_push: expected lhs [M, K] and rhs [G, K, N], got {lhs.shape} and {rhs.shape}")
    _check_group_sizes(group_sizes, "gmm_push")
    num_rows, k = lhs.shape
    num_local_groups, _, n = rhs.shape
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    if not has_kernel(lhs.dtype, rhs.dtype, out_dtype):
        raise ValueError(f"gmm_push: no kernel for {lhs.dtype} x {rhs.dtype} -> {out_dtype}")
    launch = _row_tiled_launch(lhs.dtype, rhs.dtype, num_rows, k, n, num_local_groups, group_sizes.shape[0],
                               expected_rows=expected_rows)
    operands = (lhs, rhs, group_sizes.astype(jnp.int32), _offset_array(group_offset), dest_device.astype(jnp.int32),
                dest_row.astype(jnp.int32), peer_addresses.reshape(-1), jnp.reshape(rank, (1,)).astype(jnp.int32))
    done_shape = jax.ShapeDtypeStruct((16 // out_dtype.itemsize,), out_dtype)
    done = jax_triton.triton_call(
        *operands,
        kernel=gmm_push_kernel,
        out_shape=done_shape,
        NUM_PEERS=peer_addresses.shape[0],
        TAIL_APART=TAIL_APART,
        **launch,
    )
    if not TAIL_APART:
        return done, launch["NUM_PROGRAMS"]
    done, _, _ = jax_triton.triton_call(
        *operands,
        done,
        kernel=gmm_push_tail_kernel,
        out_shape=(done_shape, *_tail_scratch(launch)),
        zeroed_outputs=(2,),
        NUM_PEERS=peer_addresses.shape[0],
        TAIL_PAD=_tail_pad(launch),
        **launch,
    )
    return done, 2 * launch["NUM_PROGRAMS"]  # both kernels' programs signal every peer


def tgmm(
    lhs,
    grad,
    group_sizes,
    *,
    num_groups: int | None = None,
    group_offset=0,
    preferred_element_type=None,
    config: TileConfig | None = None,
    expected_rows: int | None = None,
):
    """``out[g] = lhs[rows of g]^T @ grad[rows of g]`` for the local groups: ``[G, K, N]``.

    Small groups (``SMALL_GROUP_ROWS``; ``expected_rows`` as in :func:`_row_tiled_launch`) run
    ``tgmm_resident_kernel``, which keeps each group's ``grad`` columns while it walks ``K``.
    """
    if lhs.ndim != 2 or grad.ndim != 2 or lhs.shape[0] != grad.shape[0]:
        raise ValueError(f"tgmm: expected lhs [M, K] and grad [M, N], got {lhs.shape} and {grad.shape}")
    return _tgmm_call(lhs, grad, None, group_sizes, num_groups, group_offset, preferred_element_type, config,
                      expected_rows, "tgmm")


def gather_tgmm(lhs, grad, grad_index, grad_scale, group_sizes, *, num_groups: int | None = None, group_offset=0,
                preferred_element_type=None, config: TileConfig | None = None):
    """``tgmm(lhs, g)`` with ``g[r] = grad_scale[r] * grad[grad_index[r]]``, gathered as the kernel
    loads it: no ``[M, N]`` copy of ``g`` is written. The kernel puts the scale on ``lhs``'s rows
    instead (the narrower block; rounded once to ``lhs``'s type, where the reference rounds the scaled
    gradient rows: the same product to that rounding)."""
    if lhs.ndim != 2 or grad.ndim != 2 or grad_index.shape != (lhs.shape[0],) or grad_scale.shape != grad_index.shape:
        raise ValueError(f"gather_tgmm: expected lhs [M, K], grad [T, N], grad_index [M] and grad_scale [M], got "
                         f"{lhs.shape}, {grad.shape}, {grad_index.shape} and {grad_scale.shape}")
    if grad.shape[0] == 0 or not has_kernel(lhs.dtype, grad.dtype):
        return reference.gather_tgmm(lhs, grad, grad_index, grad_scale, group_sizes, num_groups=num_groups,
                                     group_offset=group_offset, preferred_element_type=preferred_element_type)
    gather = (grad_index.astype(jnp.int32), grad_scale.astype(jnp.float32))
    return _tgmm_call(lhs, grad, gather, group_sizes, num_groups, group_offset, preferred_element_type, config, None,
                      "gather_tgmm")


GATHERED_ROWS_EXTRA_STAGES = 2
"""Pipeline stages ``gather_lhs_tgmm``'s row loop asks for beyond the table tile's. The gathered rows'
loads wait on their index loads, which take two stages of the pipeline: compiled offline for sm_90
(``benchmarks/kernel_resources.py``'s method, Triton 3.6) the 128 x 256 x 64 tile holds 2 operand
buffers (96 KB) at 3 stages and 4, and 3 (145 KB, 223 registers, no spill) at 5, as ``tgmm_kernel``
holds 3 at its 3. On an H100 the two products then run 0.566 ms at 1.4B-n256 against 0.844 for the
kept copy's row gather and ``tgmm`` (``benchmarks/NOTES.md``)."""

GATHERED_GRAD_EXTRA_STAGES = 0
"""The same for ``gather_tgmm``'s row loop, whose gathered gradient rows wait on index loads too:
compiled offline it holds 2 gradient buffers at its table's 3 stages and 3 at 5. At 5 it ran 10%
slower on an H100 (0.390 -> 0.429 ms at 1.4B-n256; ``sonic_ab.py``'s ``gradstages`` variant), so none."""


def gather_lhs_tgmm(lhs_source, grad, lhs_index, group_sizes, *, num_groups: int | None = None, group_offset=0,
                    preferred_element_type=None, config: TileConfig | None = None):
    """``tgmm(lhs_source[lhs_index], grad)``, ``[G, D, N]``: the weight gradient of a product of token
    rows in expert order, read from the ``[T, D]`` tokens as the kernel loads them (no ``[M, D]``
    permuted copy). It runs as ``gather_lhs_tgmm_kernel``: ``gather_tgmm``'s kernel, unscaled, with
    the gathered rows as its wide operand and its tiles stored transposed."""
    if (lhs_source.ndim != 2 or grad.ndim != 2 or lhs_index.ndim != 1
            or lhs_index.shape[0] != grad.shape[0]):
        raise ValueError(f"gather_lhs_tgmm: expected lhs_source [T, D], grad [M, N] and lhs_index [M], got "
                         f"{lhs_source.shape}, {grad.shape} and {lhs_index.shape}")
    if lhs_source.shape[0] == 0 or not has_kernel(lhs_source.dtype, grad.dtype):
        return reference.gather_lhs_tgmm(lhs_source, grad, lhs_index, group_sizes, num_groups=num_groups,
                                         group_offset=group_offset, preferred_element_type=preferred_element_type)
    return _tgmm_call(grad, lhs_source, (lhs_index.astype(jnp.int32),), group_sizes, num_groups, group_offset,
                      preferred_element_type, config, None, "gather_lhs_tgmm")


def _tgmm_call(lhs, grad, gather, group_sizes, num_groups, group_offset, preferred_element_type, config,
               expected_rows, name: str):
    """``tgmm``'s launch; with ``gather = (grad_index, grad_scale)`` the gathered kernels', with
    ``gather = (grad_index,)`` the unscaled transposed ones (``[G, N, K]``: ``gather_lhs_tgmm``)."""
    _check_group_sizes(group_sizes, name)
    num_rows, k = lhs.shape
    n = grad.shape[1]
    num_local_groups = group_sizes.shape[0] if num_groups is None else num_groups
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, grad.dtype))
    transposed = gather is not None and len(gather) == 1
    out_core = (n, k) if transposed else (k, n)
    if num_rows == 0 or n == 0 or k == 0 or num_local_groups == 0:
        return jnp.zeros((num_local_groups, *out_core), out_dtype)
    if not has_kernel(lhs.dtype, grad.dtype, out_dtype):
        log.debug("%s: dtypes %s, %s -> %s have no Triton kernel; using the XLA path", name, lhs.dtype, grad.dtype,
                  out_dtype)
        options = dict(num_groups=num_groups, group_offset=group_offset, preferred_element_type=preferred_element_type)
        if gather is None:
            return reference.tgmm(lhs, grad, group_sizes, **options)
        if transposed:
            return reference.gather_lhs_tgmm(grad, lhs, *gather, group_sizes, **options)
        return reference.gather_tgmm(lhs, grad, *gather, group_sizes, **options)
    compute_f32 = _compute_f32(lhs.dtype, grad.dtype)
    rows_for_shape = _rows_for_shape(num_rows, expected_rows)
    resident = _small_groups(rows_for_shape, num_local_groups)
    if config is None:
        config = tgmm_config(rows_for_shape, k, n, num_local_groups, compute_f32)
        if gather is not None and not resident and not compute_f32:
            extra = GATHERED_ROWS_EXTRA_STAGES if transposed else GATHERED_GRAD_EXTRA_STAGES
            config = dataclasses.replace(config, num_stages=config.num_stages + extra)
    if resident:
        work_items = num_local_groups * -(-n // config.block_n)  # (group, column block); each walks all of K
        swizzle = {}
    else:
        work_items = num_local_groups * -(-k // config.block_m) * -(-n // config.block_n)
        swizzle = {"GROUP_M": config.group_m}
    if gather is None:
        kernel = tgmm_resident_kernel if resident else tgmm_kernel
        operands, source_rows = (), {}
    elif transposed:
        kernel = gather_lhs_tgmm_resident_kernel if resident else gather_lhs_tgmm_kernel
        operands, source_rows = gather, {"GRAD_SOURCE_ROWS": grad.shape[0]}
    else:
        kernel = gather_tgmm_resident_kernel if resident else gather_tgmm_kernel
        operands, source_rows = gather, {"GRAD_SOURCE_ROWS": grad.shape[0]}
    num_programs = _grid_size(work_items, config)
    total_groups = group_sizes.shape[0]
    return jax_triton.triton_call(
        lhs,
        grad,
        *operands,
        group_sizes.astype(jnp.int32),
        _offset_array(group_offset),
        kernel=kernel,
        out_shape=jax.ShapeDtypeStruct((num_local_groups, *out_core), out_dtype),
        grid=(num_programs,),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        M=num_rows,
        K=k,
        N=n,
        NUM_LOCAL_GROUPS=num_local_groups,
        NUM_GROUPS=total_groups,
        GROUPS_PAD=_next_power_of_two(total_groups),
        BLOCK_K=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_R=config.block_k,
        NUM_PROGRAMS=num_programs,
        COMPUTE_F32=compute_f32,
        **source_rows,
        **swizzle,
    )
