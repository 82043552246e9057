"""Row stores between the GPUs of a mesh axis (the ``"peer"`` exchange transport's operations).

``peer_store``: every rank's slots name a row of its own, a destination rank and a row there; each
rank gets back the rows stored to it. ``grouped_matmul_store``: the same for the rows of a grouped
product (on GPUs the GEMM's epilogue stores them, ``grouped_matmul``'s ``gmm_push``).
``expand_rows``: a receiver's tokens expanded into its sorted rows. On the Triton backend the
sender stores its rows straight into the receiver's buffer over NVLink and the receiver waits on
arrival counters; elsewhere an all-gather reference does the same, exactly and slowly.

* :mod:`.api`: the entry points, which run the kernels on the Triton backend and the jnp
  reference (``peer_store_reference``, the CPU path) elsewhere; receive buffers (``PeerBuffer``);
* :mod:`.triton_kernels`: the Triton kernels (``allocate``, ``push``, ``wait``, ``expand_rows``);
* :mod:`.triton_launch`: those kernels as XLA custom calls, the store protocol, and CUDA peer
  access; needs ``triton`` and ``jax_triton``.
"""

from moe_lowering.kernels.peer_store.api import PUSH_PROGRAMS, WAIT_PROGRAMS, PeerBuffer, allocate_buffer
from moe_lowering.kernels.peer_store.api import expand_rows, gather_addresses, grouped_matmul_store, peer_store
from moe_lowering.kernels.peer_store.api import peer_store_reference, uses_kernels

__all__ = ["PUSH_PROGRAMS", "WAIT_PROGRAMS", "PeerBuffer", "allocate_buffer", "expand_rows", "gather_addresses",
           "grouped_matmul_store", "peer_store", "peer_store_reference", "uses_kernels"]
