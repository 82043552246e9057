"""The jnp references: ``gather_rows(src[S, D], index[R], scale[R] | None, out_dtype) -> [R, D]`` and
``sum_rows(src[S, D], index[T, k], out_dtype) -> [T, D]``."""

from __future__ import annotations

import jax.numpy as jnp


def gather_rows_reference(src, index, scale=None, out_dtype=None):
    """``out[r] = src[index[r]]``, times ``scale[r]`` (in float32 or wider) where given; ``index`` in
    ``[0, S)``. Rounded to ``out_dtype`` (default ``src``'s)."""
    out_dtype = jnp.dtype(out_dtype or src.dtype)
    rows = jnp.take(src, index, axis=0)
    if scale is None:
        return rows.astype(out_dtype)
    acc = jnp.promote_types(jnp.float32, jnp.result_type(src.dtype, scale.dtype))
    return (rows.astype(acc) * scale.astype(acc)[:, None]).astype(out_dtype)


def sum_rows_reference(src, index, out_dtype=None):
    """``out[t] = sum_j src[index[t, j]]``, added in float32 (or wider) and rounded once to
    ``out_dtype`` (default ``src``'s); ``index`` in ``[0, S)``."""
    out_dtype = jnp.dtype(out_dtype or src.dtype)
    acc = jnp.promote_types(jnp.float32, src.dtype)
    if index.size == 0 or src.shape[0] == 0:
        return jnp.zeros((index.shape[0], src.shape[1]), out_dtype)
    return jnp.take(src, index, axis=0).sum(axis=1, dtype=acc).astype(out_dtype)
