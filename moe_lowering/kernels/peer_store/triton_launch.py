"""Row exchange between the GPUs of one process by device-initiated NVLink stores (Triton).

NCCL collectives need their sizes on the host, so a dropless exchange built on them either pads every
(source, destination) block to a static capacity and loops on the host while rows are left, or syncs
the counts to the host first. Here the sizes stay on the device: every row is *stored* by the sending
GPU straight into the receiving GPU's buffer at its final position, and the receiver waits on
arrival counters the senders bump after their stores. Nothing is padded, nothing waits on the host.

The receive buffers are ordinary XLA buffers. Each exchange runs as three custom calls per device
(their kernels are in :mod:`.triton_kernels`):

1. ``allocate``: outputs the receive buffer (left unwritten or zeroed), zeroed arrival counters,
   and both of their device addresses as int32 words. XLA keeps these buffers alive until the
   ``wait`` that consumes them.
2. ``push``, after the caller has all-gathered the address words over the exchange axis (one tiny
   collective, which several exchanges can share; it also orders every device's ``allocate``
   before any peer's ``push`` stores into its buffers): each program stores its rows at
   ``(dest_device, dest_row)`` through the peer's address, then bumps its counter on every peer
   (release, system scope).
3. ``wait``: spins until every peer's programs have signalled (acquire), then zeros the rows past
   the arrived ones; its output is the receive buffer itself (aliased), so nothing is copied.

Peer stores need CUDA peer access between the devices, which ``enable_peer_access`` turns on.

Between processes (one GPU each) the receive buffers are regions of the peer heap instead
(:mod:`.heap`, which describes that protocol): ``ready`` before the push, ``heap_wait`` instead of
``wait``; ``push`` is the same kernel.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import jax
import jax.numpy as jnp
import jax_triton
import triton

from moe_lowering.kernels.peer_address.triton_kernels import ADDRESS_WORDS
from moe_lowering.kernels.peer_store import heap
from moe_lowering.kernels.peer_store.triton_kernels import (
    allocate_kernel,
    expand_rows_kernel,
    heap_wait_kernel,
    push_kernel,
    ready_kernel,
    wait_kernel,
)

logger = logging.getLogger(__name__)


@functools.cache
def enable_peer_access(device_ids: tuple[int, ...]) -> None:
    """Turns on CUDA peer access between every pair of ``device_ids`` (local CUDA ordinals)."""
    cudart = heap.cudart()
    already_enabled = 704  # cudaErrorPeerAccessAlreadyEnabled
    current = ctypes.c_int(0)
    cudart.cudaGetDevice(ctypes.byref(current))  # restored below: the calling thread's device is not ours
    for device in device_ids:
        for peer in device_ids:
            if peer == device:
                continue
            can = ctypes.c_int(0)
            cudart.cudaDeviceCanAccessPeer(ctypes.byref(can), device, peer)
            if not can.value:
                raise RuntimeError(f"peer exchange: GPU {device} cannot access GPU {peer} directly")
            cudart.cudaSetDevice(device)
            status = cudart.cudaDeviceEnablePeerAccess(peer, 0)
            if status not in (0, already_enabled):
                raise RuntimeError(f"peer exchange: cudaDeviceEnablePeerAccess({device} -> {peer}) failed: {status}")
            cudart.cudaGetLastError()
    cudart.cudaSetDevice(current.value)
    logger.info("peer access enabled between GPUs %s", device_ids)


def allocate(num_rows: int, trailing: int, dtype, num_peers: int, allocation_id, *, zeroed: bool):
    """``(recv, arrivals, address_words)``: a receive buffer (zeroed if asked), zeroed counters.

    ``allocation_id`` (an int32 constant unique to the allocation) is an operand only so that XLA's
    common-subexpression elimination cannot hand two exchanges one buffer and one set of counters.
    """
    return jax_triton.triton_call(
        allocation_id,
        kernel=allocate_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_rows, trailing), dtype),
            jax.ShapeDtypeStruct((num_peers,), jnp.int32),
            jax.ShapeDtypeStruct((ADDRESS_WORDS,), jnp.int32),
        ),
        grid=(1,),
        num_warps=1,
        zeroed_outputs=(0, 1) if zeroed else (1,),
    )


def push(rows, source_row, dest_device, dest_row, peer_addresses, rank, *, num_programs: int,
         block_slots: int | None = None, block_d: int = 1024, num_warps: int = 4):
    """Slot ``j`` stores ``rows[source_row[j]]`` into peer ``dest_device[j]`` (< 0: none) at ``dest_row[j]``.

    ``peer_addresses [ep, 4]``: every peer's ``allocate`` address words, all-gathered. Returns a
    one-element token the matching ``wait`` must consume (it orders the push before the wait).
    ``block_slots`` (rows a program stores at a time) defaults to 8 rows of 128 elements or more
    and to ~1024 elements of narrower rows (one int32 per row: 1024 rows), so that a store of
    narrow rows is not a long loop of tiny tiles.
    """
    _, d = rows.shape
    block_d = min(block_d, triton.next_power_of_2(d))
    if block_slots is None:
        block_slots = max(8, 1024 // block_d)
    return jax_triton.triton_call(
        rows,
        source_row.astype(jnp.int32),
        dest_device.astype(jnp.int32),
        dest_row.astype(jnp.int32),
        peer_addresses.reshape(-1),
        jnp.reshape(rank, (1,)).astype(jnp.int32),
        kernel=push_kernel,
        out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
        grid=(num_programs,),
        num_warps=num_warps,
        NUM_SLOTS=source_row.shape[0],
        D=d,
        NUM_PEERS=peer_addresses.shape[0],
        BLOCK_SLOTS=block_slots,
        BLOCK_D=block_d,
        NUM_PROGRAMS=num_programs,
    )


def wait(recv, arrivals, num_rows, done, *, signals_per_peer: int, num_programs: int, zero_tail: bool = True,
         block_rows: int = 8, block_d: int = 1024, num_warps: int = 4):
    """``recv``'s first ``num_rows`` rows once every peer has pushed, zeros after them (in place;
    left as they are without ``zero_tail``)."""
    total, d = recv.shape
    return jax_triton.triton_call(
        recv,
        arrivals,
        jnp.reshape(num_rows, (1,)).astype(jnp.int32),
        done,
        kernel=wait_kernel,
        out_shape=jax.ShapeDtypeStruct((total, d), recv.dtype),
        input_output_aliases={0: 0},
        grid=(num_programs,),
        num_warps=num_warps,
        NUM_ROWS=total,
        D=d,
        NUM_PEERS=arrivals.shape[0],
        SIGNALS_PER_PEER=signals_per_peer,
        BLOCK_ROWS=block_rows,
        BLOCK_D=min(block_d, triton.next_power_of_2(d)),
        NUM_PROGRAMS=num_programs,
        ZERO_TAIL=bool(zero_tail),
    )


def ready(peer_addresses, rank):
    """``peer_addresses`` once every peer has read this rank's rows of the heap region's previous
    use; pass the result to ``push``/``gmm_push`` so that they start after it."""
    return jax_triton.triton_call(
        peer_addresses,
        jnp.reshape(rank, (1,)).astype(jnp.int32),
        kernel=ready_kernel,
        out_shape=jax.ShapeDtypeStruct(peer_addresses.shape, peer_addresses.dtype),
        input_output_aliases={0: 0},
        grid=(1,),
        num_warps=1,
        NUM_PEERS=peer_addresses.shape[0],
    )


def heap_wait(peer_addresses, rank, num_rows, done, shape: tuple[int, int], dtype, *, signals_per_peer: int,
              num_programs: int, zeroed: bool, zero_tail: bool = True, block_rows: int = 8, block_d: int = 1024,
              num_warps: int = 4):
    """``[rows, d]``: the heap region's first ``num_rows`` rows once every peer has pushed, zeros
    after them (not written without ``zero_tail``); the region is then free for the next use."""
    total, d = shape
    return jax_triton.triton_call(
        peer_addresses.reshape(-1),
        jnp.reshape(rank, (1,)).astype(jnp.int32),
        jnp.reshape(num_rows, (1,)).astype(jnp.int32),
        done,
        kernel=heap_wait_kernel,
        out_shape=jax.ShapeDtypeStruct((total, d), dtype),
        grid=(num_programs,),
        num_warps=num_warps,
        NUM_ROWS=total,
        D=d,
        NUM_PEERS=peer_addresses.shape[0],
        SIGNALS_PER_PEER=signals_per_peer,
        BLOCK_ROWS=block_rows,
        BLOCK_D=min(block_d, triton.next_power_of_2(d)),
        NUM_PROGRAMS=num_programs,
        ZEROED=bool(zeroed),
        ZERO_TAIL=bool(zero_tail),
    )


def expand_rows(table, index, num_rows, *, zero_tail: bool = True, num_programs: int = 132, block_rows: int = 8,
                block_d: int = 1024, num_warps: int = 4):
    """``table[index[i]]`` for ``i < num_rows``, zeros after (left untouched without ``zero_tail``)."""
    table_rows, d = table.shape
    (num_out,) = index.shape
    return jax_triton.triton_call(
        table,
        index.astype(jnp.int32),
        jnp.reshape(num_rows, (1,)).astype(jnp.int32),
        kernel=expand_rows_kernel,
        out_shape=jax.ShapeDtypeStruct((num_out, d), table.dtype),
        grid=(num_programs,),
        num_warps=num_warps,
        NUM_ROWS=num_out,
        TABLE_ROWS=table_rows,
        D=d,
        BLOCK_ROWS=block_rows,
        BLOCK_D=min(block_d, triton.next_power_of_2(d)),
        NUM_PROGRAMS=num_programs,
        ZERO_TAIL=bool(zero_tail),
    )
