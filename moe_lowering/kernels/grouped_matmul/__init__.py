"""Grouped matrix products over rows sorted by group: ``gmm``, its weight gradient ``tgmm``.

``gmm(lhs[M, K], rhs[G, K, N], group_sizes[G]) -> [M, N]`` multiplies each contiguous run of rows
by its group's (expert's) matrix; ``tgmm(lhs[M, K], grad[M, N], group_sizes) -> [G, K, N]`` is the
weight gradient. Group sizes stay on the device; ``group_offset`` picks the local groups of an
expert-parallel shard.

* :mod:`.reference`: the contracts, the pure-jnp tile schedule (the CPU path and the reference)
  and ``gmm_dense_reference`` for tests;
* :mod:`.triton_kernels`: the Triton kernels (``gmm``, ``tgmm``, the K-split tail kernels, and
  ``gmm_push``, whose epilogue stores each row on the GPU that owns it);
* :mod:`.triton_launch`: those kernels as XLA custom calls and their tile table
  (``gmm_config``, ``tgmm_config``); needs ``triton`` and ``jax_triton``, so import it explicitly.

Which of the two runs is chosen in :func:`moe_lowering.kernels.get_backend`.
"""

from moe_lowering.kernels.grouped_matmul.reference import (
    DEFAULT_TILE_ROWS,
    TileSchedule,
    gmm,
    gmm_dense_reference,
    make_tile_schedule,
    tgmm,
)

__all__ = ["DEFAULT_TILE_ROWS", "TileSchedule", "gmm", "gmm_dense_reference", "make_tile_schedule", "tgmm"]
