"""Grouped matrix products over rows sorted by group: the pure-jnp reference and CPU path.

``gmm(lhs[M, K], rhs[G, K, N], group_sizes[G]) -> [M, N]`` multiplies each contiguous run of
rows by its group's matrix; ``tgmm(lhs[M, K], grad[M, N], group_sizes) -> [G, K, N]`` is the
weight gradient, one ``lhs_g^T @ grad_g`` per group.

``jax.lax.ragged_dot`` is not sparse in XLA (on CPU it broadcasts the rows to ``[G, M, K]`` and
does one dense dot over all groups), so this follows the megablox tile schedule instead: a
static number of (row tile, group) visits, ``num_row_tiles + G - 1``, computed on device from
the group offsets, each a masked ``tile_rows x K x N`` product. That is also the schedule the
GPU kernels use, so both paths do the same arithmetic in the same order per tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

DEFAULT_TILE_ROWS = 128


@dataclass(frozen=True)
class TileSchedule:
    """Which group each row tile is visited for; arrays of length ``num_visits`` (static)."""

    group_ids: jax.Array
    tile_ids: jax.Array
    group_starts: jax.Array
    group_ends: jax.Array


def _tile_rows_for(num_rows: int, tile_rows: int | None) -> int:
    tile_rows = tile_rows or DEFAULT_TILE_ROWS
    return max(1, min(tile_rows, num_rows))


def make_tile_schedule(group_sizes, num_rows: int, tile_rows: int, group_offset=0, num_groups=None) -> TileSchedule:
    """The (group, row tile) visits covering rows of groups ``[group_offset, group_offset + num_groups)``.

    Computed on device from ``group_sizes``: no host synchronisation, any sizes (empty groups
    included). Unused trailing visits get an empty row range and contribute nothing.
    """
    group_sizes = group_sizes.astype(jnp.int32)
    num_groups = group_sizes.shape[0] if num_groups is None else num_groups
    ends_all = jnp.cumsum(group_sizes)
    starts_all = ends_all - group_sizes
    local = group_offset + jnp.arange(num_groups, dtype=jnp.int32)
    starts = jnp.take(starts_all, local, mode="clip")
    ends = jnp.take(ends_all, local, mode="clip")
    sizes = ends - starts
    first_tile = starts // tile_rows
    last_tile = (ends - 1) // tile_rows
    tiles_per_group = jnp.where(sizes > 0, last_tile - first_tile + 1, 0)
    visit_ends = jnp.cumsum(tiles_per_group)
    visit_starts = visit_ends - tiles_per_group
    num_tiles = -(-num_rows // tile_rows)
    num_visits = num_tiles + num_groups - 1
    visits = jnp.arange(num_visits, dtype=jnp.int32)
    group_ids = jnp.clip(jnp.searchsorted(visit_ends, visits, side="right"), 0, num_groups - 1).astype(jnp.int32)
    in_range = visits < visit_ends[-1]
    tile_ids = jnp.where(in_range, first_tile[group_ids] + visits - visit_starts[group_ids], 0)
    group_starts = jnp.where(in_range, starts[group_ids], 0)
    group_ends = jnp.where(in_range, ends[group_ids], 0)
    return TileSchedule(group_ids, tile_ids.astype(jnp.int32), group_starts, group_ends)


def _row_mask(schedule: TileSchedule, visit, tile_rows: int):
    rows = schedule.tile_ids[visit] * tile_rows + jnp.arange(tile_rows, dtype=jnp.int32)
    return (rows >= schedule.group_starts[visit]) & (rows < schedule.group_ends[visit])


def _pad_rows(x, tile_rows: int):
    pad = -x.shape[0] % tile_rows
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def gmm(
    lhs,
    rhs,
    group_sizes,
    *,
    group_offset=0,
    transpose_rhs: bool = False,
    preferred_element_type=None,
    tile_rows: int | None = None,
    zero_outside: bool = True,
    expected_rows: int | None = None,
):
    """``out[r] = lhs[r] @ rhs[group(r) - group_offset]``; rows outside the local groups are zero
    (with ``zero_outside=False`` they are unspecified: a caller that never reads them saves the
    writes; this implementation writes zeros either way). ``expected_rows`` (how many rows the
    groups should hold, where ``lhs`` is a buffer sized for the worst case) picks the GPU kernels'
    tile shape; this loop's tiles stay ``tile_rows``, so it does not use it.

    With ``transpose_rhs`` the weights are ``[G, N, K]`` and used transposed (the activation
    gradient reads the forward weights without copying them).
    """
    num_rows, _ = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
    if num_rows == 0:
        return jnp.zeros((0, n), out_dtype)
    tile_rows = _tile_rows_for(num_rows, tile_rows)
    schedule = make_tile_schedule(group_sizes, num_rows, tile_rows, group_offset, num_groups)
    lhs_padded = _pad_rows(lhs, tile_rows)
    acc_dtype = jnp.promote_types(out_dtype, jnp.float32)

    def visit_body(visit, out):
        row0 = schedule.tile_ids[visit] * tile_rows
        lhs_tile = jax.lax.dynamic_slice_in_dim(lhs_padded, row0, tile_rows, 0)
        weight = rhs[schedule.group_ids[visit]]
        weight = weight.T if transpose_rhs else weight
        product = jnp.dot(lhs_tile, weight, preferred_element_type=acc_dtype)
        product = jnp.where(_row_mask(schedule, visit, tile_rows)[:, None], product, 0)
        current = jax.lax.dynamic_slice_in_dim(out, row0, tile_rows, 0)
        return jax.lax.dynamic_update_slice_in_dim(out, current + product, row0, 0)

    out = jnp.zeros((lhs_padded.shape[0], n), acc_dtype)
    out = jax.lax.fori_loop(0, schedule.group_ids.shape[0], visit_body, out)
    return out[:num_rows].astype(out_dtype)


def tgmm(
    lhs,
    grad,
    group_sizes,
    *,
    num_groups: int | None = None,
    group_offset=0,
    preferred_element_type=None,
    tile_rows: int | None = None,
    expected_rows: int | None = None,
):
    """``out[g] = lhs[rows of g]^T @ grad[rows of g]`` for the local groups: ``[G, K, N]``.
    ``expected_rows`` picks the GPU kernel (as in :func:`gmm`); this loop does not use it."""
    num_rows, k = lhs.shape
    n = grad.shape[1]
    num_groups = group_sizes.shape[0] if num_groups is None else num_groups
    out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, grad.dtype)
    acc_dtype = jnp.promote_types(out_dtype, jnp.float32)
    if num_rows == 0:
        return jnp.zeros((num_groups, k, n), out_dtype)
    tile_rows = _tile_rows_for(num_rows, tile_rows)
    schedule = make_tile_schedule(group_sizes, num_rows, tile_rows, group_offset, num_groups)
    lhs_padded = _pad_rows(lhs, tile_rows)
    grad_padded = _pad_rows(grad, tile_rows)

    def visit_body(visit, out):
        row0 = schedule.tile_ids[visit] * tile_rows
        mask = _row_mask(schedule, visit, tile_rows)[:, None]
        # both operands masked: a row outside the group may hold anything, non-finite values included
        lhs_tile = jnp.where(mask, jax.lax.dynamic_slice_in_dim(lhs_padded, row0, tile_rows, 0), 0)
        grad_tile = jnp.where(mask, jax.lax.dynamic_slice_in_dim(grad_padded, row0, tile_rows, 0), 0)
        product = jnp.dot(lhs_tile.T, grad_tile, preferred_element_type=acc_dtype)
        group = schedule.group_ids[visit]
        return out.at[group].add(product)

    out = jnp.zeros((num_groups, k, n), acc_dtype)
    out = jax.lax.fori_loop(0, schedule.group_ids.shape[0], visit_body, out)
    return out.astype(out_dtype)


def gmm_dense_reference(lhs, rhs, group_sizes, *, group_offset=0, transpose_rhs=False):
    """Obviously-correct O(G) version for tests: every group's product, masked."""
    rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    group_of_row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(lhs.shape[0]), side="right")
    local = group_of_row - group_offset
    valid = (local >= 0) & (local < rhs.shape[0])
    per_group = jnp.einsum("mk,gkn->gmn", lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    picked = jnp.take_along_axis(per_group, jnp.clip(local, 0, rhs.shape[0] - 1)[None, :, None], axis=0)[0]
    return jnp.where(valid[:, None], picked, 0)


def gmm_sum(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, *, group_offset=0, preferred_element_type=None,
            expected_rows: int | None = None):
    """``lhs_a[r] @ rhs_a[g]^T + lhs_b[r] @ rhs_b[g]^T`` (weights ``[G, N, K]``, read transposed),
    accumulated in float32 (or wider) and rounded once; zero outside the local groups.

    The rows' cotangent of a pair of products of the same rows (SwiGLU's gate and up); the GPU
    kernel (``triton_launch.gmm_sum``) walks both contractions with one accumulator."""
    del expected_rows
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs_a.dtype, rhs_a.dtype))
    acc_dtype = jnp.promote_types(out_dtype, jnp.float32)
    parts = [gmm(lhs, rhs, group_sizes, group_offset=group_offset, transpose_rhs=True, preferred_element_type=acc_dtype)
             for lhs, rhs in ((lhs_a, rhs_a), (lhs_b, rhs_b))]
    return (parts[0] + parts[1]).astype(out_dtype)


def gather_gmm(lhs, rhs, row_index, row_scale, dot_with, group_sizes, *, group_offset=0, transpose_rhs=False,
               preferred_element_type=None):
    """``out[r] = row_scale[r] * (lhs[row_index[r]] @ rhs[group(r) - group_offset])``, zero outside
    the local groups, and with ``dot_with [M, N]`` (else ``None``) also ``dots[r] = (lhs[row_index[r]] @ rhs[g]) .
    dot_with[r]`` (the unscaled product; float32 or wider, zero outside), else ``dots`` is ``None``.

    The combine's backward through the expert's last product: ``lhs`` is the layer output's
    cotangent, ``row_index`` each row's token and ``row_scale`` its routing weight, and with the
    product's input rows as ``dot_with`` the dots are the routing weights' cotangent. The GPU
    kernel (``triton_launch.gather_gmm``) gathers the rows as it loads them and computes the dots
    in its epilogue."""
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    acc_dtype = jnp.promote_types(out_dtype, jnp.float32)
    rows = jnp.take(lhs, row_index, axis=0, mode="clip")
    product = gmm(rows, rhs, group_sizes, group_offset=group_offset, transpose_rhs=transpose_rhs,
                  preferred_element_type=acc_dtype)
    out = (product * row_scale.astype(acc_dtype)[:, None]).astype(out_dtype)
    dots = None if dot_with is None else jnp.sum(product * dot_with.astype(acc_dtype), axis=1)
    return out, dots


def gather_tgmm(lhs, grad, grad_index, grad_scale, group_sizes, *, num_groups: int | None = None, group_offset=0,
                preferred_element_type=None):
    """``tgmm(lhs, g)`` with ``g[r] = grad_scale[r] * grad[grad_index[r]]`` (computed in float32 or
    wider, rounded to ``grad``'s type): the expert's last product's weight gradient read from the
    layer output's cotangent. The GPU kernel gathers and scales the rows as it loads them."""
    acc_dtype = jnp.promote_types(grad.dtype, jnp.float32)
    rows = jnp.take(grad, grad_index, axis=0, mode="clip").astype(acc_dtype) * grad_scale.astype(acc_dtype)[:, None]
    return tgmm(lhs, rows.astype(grad.dtype), group_sizes, num_groups=num_groups, group_offset=group_offset,
                preferred_element_type=preferred_element_type)


def gather_lhs_tgmm(lhs_source, grad, lhs_index, group_sizes, *, num_groups: int | None = None, group_offset=0,
                    preferred_element_type=None):
    """``tgmm(lhs_source[lhs_index], grad)`` (``[G, D, N]``): the weight gradient of a product of token
    rows in expert order. The GPU kernel gathers the rows as it loads them."""
    rows = jnp.take(lhs_source, lhs_index, axis=0, mode="clip")
    return tgmm(rows, grad, group_sizes, num_groups=num_groups, group_offset=group_offset,
                preferred_element_type=preferred_element_type)
