"""Addressing another GPU's XLA buffer from inside a Triton kernel, and signalling that GPU.

Device-side helpers, no operation of their own, shared by the two kernels that store rows on peer
GPUs: the peer store's ``push`` (:mod:`moe_lowering.kernels.peer_store`) and the grouped GEMM's
``gmm_push`` (:mod:`moe_lowering.kernels.grouped_matmul`). A receive buffer is published as four
int32 words per rank (``ADDRESS_WORDS``: its address, then its arrival counters' address, each
split low/high) and all-gathered by the caller. Between processes the words point into the
peer heap instead (``peer_store.heap`` turns its offsets into addresses first), so the kernels
read them the same way. Everything is in :mod:`.triton_kernels` (it
imports ``triton``), so nothing is exported here: there is no CPU path, addresses mean nothing
off a GPU.
"""
