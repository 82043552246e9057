"""Addressing another GPU's XLA buffer from inside a Triton kernel, and signalling that GPU.

Shared by the exchange's ``push`` kernel (:mod:`moe_lowering.kernels.peer_store.triton_kernels`) and the
grouped GEMM that stores its output rows straight to their home GPUs
(:mod:`moe_lowering.kernels.grouped_matmul.triton_kernels`). Only ``triton``
is imported here. A receive buffer is published as four int32 words per rank (its address, then
its arrival counters' address, each split low/high) and all-gathered by the caller.
"""

from __future__ import annotations

import triton
import triton.language as tl

ADDRESS_WORDS = 4  # receive buffer address (lo, hi), arrival counters address (lo, hi)


@triton.jit
def split_address(pointer, out_ptr):
    address = pointer.to(tl.int64)
    tl.store(out_ptr, (address & 0xFFFFFFFF).to(tl.int32))
    tl.store(out_ptr + 1, (address >> 32).to(tl.int32))


@triton.jit
def join_address(words_ptr):
    lo = tl.load(words_ptr).to(tl.int64) & 0xFFFFFFFF
    hi = tl.load(words_ptr + 1).to(tl.int64)
    return (hi << 32) | lo


@triton.jit
def peer_row_pointers(base_ptr, peer_address_ptr, device, dest_row, ROW_ELEMENTS: tl.constexpr):
    """Pointers (typed like ``base_ptr``) to row ``dest_row`` of rank ``device``'s receive buffer.

    The peer's buffer is taken as an element offset from ``base_ptr`` (one address space): both
    are 16-byte aligned XLA buffers, and saying so lets the stores through them be vectorised.
    """
    ELEMENT_BYTES: tl.constexpr = base_ptr.dtype.element_ty.primitive_bitwidth // 8
    lo = tl.load(peer_address_ptr + device * 4).to(tl.int64) & 0xFFFFFFFF
    hi = tl.load(peer_address_ptr + device * 4 + 1).to(tl.int64)
    delta = tl.multiple_of(((hi << 32) | lo) - base_ptr.to(tl.int64), 16) // ELEMENT_BYTES
    return base_ptr + tl.multiple_of(delta, 16 // ELEMENT_BYTES) + dest_row.to(tl.int64) * ROW_ELEMENTS


@triton.jit
def signal_peers(peer_address_ptr, rank, NUM_PEERS: tl.constexpr):
    """After this program's stores: bumps its arrival counter on every peer (release, system scope)."""
    tl.debug_barrier()
    for peer in range(NUM_PEERS):
        arrivals = join_address(peer_address_ptr + peer * 4 + 2).to(tl.pointer_type(tl.int32))
        tl.atomic_add(arrivals + rank, 1, sem="release", scope="sys")
