"""The contract of the Hopper grouped GEMM, on NumPy arrays: :func:`grouped_matmul.reference.gmm`'s.

``gmm_rows`` is the per-group product in float32 on NumPy; ``gmm_dense`` is
``grouped_matmul.reference.gmm_dense_reference`` (JAX, imported lazily), which the schedule test holds
both to.
"""

from __future__ import annotations

import numpy as np


def gmm_rows(lhs, rhs, group_sizes):
    """float32 ``out[r] = lhs[r] @ rhs[group(r)]`` for rows of the groups, zero past them (negative sizes empty)."""
    lhs = np.asarray(lhs, np.float32)
    rhs = np.asarray(rhs, np.float32)
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32)
    start = 0
    for group, size in enumerate(np.maximum(np.asarray(group_sizes), 0)):
        end = min(start + int(size), lhs.shape[0])
        out[start:end] = lhs[start:end] @ rhs[group]
        start = end
    return out


def gmm_dense(lhs, rhs, group_sizes):
    """``grouped_matmul.reference.gmm_dense_reference``: every group's product, masked (float32)."""
    import jax.numpy as jnp

    from moe_lowering.kernels.grouped_matmul import reference

    return reference.gmm_dense_reference(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes))
