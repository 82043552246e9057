"""The contract of the Hopper grouped GEMM, on NumPy arrays: :func:`grouped_matmul.reference.gmm`'s.

``gmm_rows`` is the per-group product in float32 on NumPy; ``gmm_dense`` is
``grouped_matmul.reference.gmm_dense_reference`` (JAX, imported lazily), which the schedule test holds
both to. The weight gradient's: ``tgmm_rows`` on NumPy, held to ``grouped_matmul.reference.tgmm``
(``tgmm_jax``).
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


def tgmm_rows(lhs, dout, group_sizes):
    """float32 ``dw[g] = lhs[rows of g]^T @ dout[rows of g]``, ``[E, K, N]``; empty groups (negative sizes
    too) give zeros, rows past ``M`` count for none."""
    lhs = np.asarray(lhs, np.float32)
    dout = np.asarray(dout, np.float32)
    sizes = np.maximum(np.asarray(group_sizes), 0)
    out = np.zeros((len(sizes), lhs.shape[1], dout.shape[1]), np.float32)
    start = 0
    for group, size in enumerate(sizes):
        end = min(start + int(size), lhs.shape[0])
        out[group] = lhs[start:end].T @ dout[start:end]
        start = end
    return out


def tgmm_jax(lhs, dout, group_sizes):
    """``grouped_matmul.reference.tgmm`` in float32 (JAX, imported lazily)."""
    import jax.numpy as jnp

    from moe_lowering.kernels.grouped_matmul import reference

    return reference.tgmm(jnp.asarray(lhs), jnp.asarray(dout), jnp.asarray(group_sizes),
                          preferred_element_type=jnp.float32)
