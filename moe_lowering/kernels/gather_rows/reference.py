"""``gather_rows(src[S, D], index[R], scale[R] | None, out_dtype) -> [R, D]``: the jnp reference."""

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
