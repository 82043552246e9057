"""Row stores between the ranks of a mesh axis: the entry points, their reference and CPU path.

``peer_store`` is the ``"peer"`` exchange transport's one operation: slot ``j`` of every rank holds
``values[source_row[j]]`` and names a destination rank and a row there; each rank gets back the
``[recv_rows, ...]`` rows stored to it. On GPUs of one host (the Triton backend) the sender
stores the rows itself over NVLink (:mod:`.triton_launch`): into XLA buffers when every GPU is
this process's, into regions of the peer heap (:mod:`.heap`) when the GPUs belong to one process
each; elsewhere this module's reference all-gathers every rank's slots and scatters the ones
addressed here, which is exact and slow.

A store needs a receive buffer whose address every rank knows. ``peer_store`` makes one and
all-gathers its address; a caller with several stores ahead can instead make their
``PeerBuffer``s up front and share one all-gather among them (``gather_addresses``, which can
carry the caller's own small int32 payload too), so the layer pays one sync point, not one per store.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from moe_lowering.kernels import get_backend
from moe_lowering.kernels.peer_store import heap as peer_heap

# Programs of the Triton kernels: every push program signals every peer once; the waiting
# programs spin, so they are kept few enough to leave multiprocessors to NCCL's kernels.
PUSH_PROGRAMS = 132
WAIT_PROGRAMS = 32
# The peer heap's wait also copies the rows out of the heap region (one process per GPU): a
# bandwidth-bound copy, at 0.88-0.92 of a device copy with these (benchmarks/peer_heap_copy.py).
HEAP_WAIT_PROGRAMS = 132
HEAP_WAIT_WARPS = 8
HEAP_WAIT_BLOCK_ROWS = 16

_allocation_ids = itertools.count()


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PeerBuffer:
    """A receive buffer the other ranks store into, its arrival counters, and address words:
    this rank's ``[4]`` when made, every rank's ``[ranks, 4]`` once gathered.

    In the peer heap (``heap_zeroed`` set: whether the site needs unstored rows zero) ``recv`` is
    only the rows' shape and dtype, ``arrivals`` is ``None``, and the words are heap offsets until
    gathered (:mod:`.heap`)."""

    recv: jax.Array | jax.ShapeDtypeStruct
    arrivals: jax.Array | None
    addresses: jax.Array
    heap_zeroed: bool | None = dataclasses.field(default=None, metadata=dict(static=True))


def uses_kernels(backend: str) -> bool:
    """Whether stores on ``backend`` run the Triton kernels (else the all-gather reference)."""
    return get_backend(backend).name == "triton"


def allocate_buffer(recv_rows: int, trailing_shape: tuple[int, ...], dtype, *, axis_size: int,
                    zeroed: bool) -> PeerBuffer:
    """A fresh receive buffer for ``[recv_rows, *trailing_shape]`` rows (GPU kernels only): an XLA
    buffer, or a region of the peer heap once :mod:`.heap` has one (GPUs of one process each)."""
    dtype = jnp.int8 if dtype == jnp.bool_ else dtype
    heap = peer_heap.current_heap()
    if heap is not None:
        shape = (recv_rows, math.prod(trailing_shape))
        region = peer_heap.reserve_site(heap, math.prod(shape) * jnp.dtype(dtype).itemsize, axis_size)
        words = peer_heap.offset_words(peer_heap.device_id_here(heap), region)
        return PeerBuffer(jax.ShapeDtypeStruct(shape, dtype), None, words, heap_zeroed=bool(zeroed))
    from moe_lowering.kernels.peer_store import triton_launch as peer

    allocation_id = jnp.asarray(next(_allocation_ids) % (2**31), jnp.int32).reshape(1)
    recv, arrivals, address = peer.allocate(recv_rows, math.prod(trailing_shape), dtype, axis_size, allocation_id,
                                            zeroed=zeroed)
    return PeerBuffer(recv, arrivals, address)


def gather_addresses(buffers, axis_name: str, payload=None):
    """``(buffers with every rank's addresses, payload all-gathered [ranks, n])`` in one all-gather."""
    words = [b.addresses for b in buffers] + ([] if payload is None else [payload.astype(jnp.int32)])
    gathered = jax.lax.all_gather(jnp.concatenate(words), axis_name)
    rank = jax.lax.axis_index(axis_name)
    out = [dataclasses.replace(b, addresses=_usable_here(b, gathered[:, 4 * i: 4 * i + 4], rank))
           for i, b in enumerate(buffers)]
    return out, (None if payload is None else gathered[:, 4 * len(buffers):])


def _usable_here(buffer: PeerBuffer, words, rank):
    """Gathered words as addresses in this process (heap offsets plus the mapped heap bases)."""
    if buffer.heap_zeroed is None:
        return words
    return peer_heap.peer_address_words(words, peer_heap.current_heap().views, rank)


def _push_and_wait(buffer: PeerBuffer, push, recv_rows: int, num_arrived, *, axis_name: str, zero_tail: bool):
    """``push(addresses, rank) -> (done, signals per peer)`` into ``buffer``, then the wait for
    the rows stored here (``[recv_rows, d]``); in the heap, ``ready`` goes first."""
    from moe_lowering.kernels.peer_store import triton_launch as peer

    rank = jax.lax.axis_index(axis_name)
    addresses = buffer.addresses
    if buffer.heap_zeroed is not None:
        addresses = peer.ready(addresses, rank)
    done, signals = push(addresses, rank)
    if buffer.heap_zeroed is None:
        return peer.wait(buffer.recv, buffer.arrivals, num_arrived, done, signals_per_peer=signals,
                         num_programs=WAIT_PROGRAMS, zero_tail=zero_tail)
    return peer.heap_wait(addresses, rank, num_arrived, done, (recv_rows, buffer.recv.shape[1]), buffer.recv.dtype,
                          signals_per_peer=signals, num_programs=HEAP_WAIT_PROGRAMS, zeroed=buffer.heap_zeroed,
                          zero_tail=zero_tail, num_warps=HEAP_WAIT_WARPS,
                          block_rows=HEAP_WAIT_BLOCK_ROWS)


def peer_store_reference(values, source_row, dest_device, dest_row, recv_rows: int, num_arrived, *,
                         axis_name: str):
    """``[recv_rows, ...]``: rows stored here by any rank's slots; zeros from ``num_arrived`` on."""
    me = jax.lax.axis_index(axis_name)
    slot_values = jnp.take(values, jnp.clip(source_row, 0, values.shape[0] - 1), axis=0)
    every_value, every_device, every_row = (jax.lax.all_gather(a, axis_name)
                                            for a in (slot_values, dest_device, dest_row))
    rows = jnp.where(every_device == me, every_row, recv_rows).reshape(-1)  # out of range: not stored here
    out = jnp.zeros((recv_rows,) + values.shape[1:], values.dtype)
    out = out.at[rows].set(every_value.reshape((-1,) + values.shape[1:]), mode="drop", unique_indices=True)
    arrived = jnp.arange(recv_rows) < num_arrived
    return jnp.where(arrived.reshape((-1,) + (1,) * (values.ndim - 1)), out, jnp.zeros((), values.dtype))


def peer_store(values, source_row, dest_device, dest_row, recv_rows: int, num_arrived, *, axis_name: str,
               axis_size: int, zeroed: bool, backend: str = "auto", buffer: PeerBuffer | None = None,
               zero_tail: bool = True):
    """See the module docstring. ``zeroed``: rows below ``num_arrived`` that no slot names are zero
    (the Triton path otherwise leaves them unset, which costs nothing when every one is stored).
    ``zero_tail=False``: rows from ``num_arrived`` on are unspecified instead of zero (for callers
    that never read them). ``buffer``: one made by ``allocate_buffer`` with ``zeroed`` alike, its
    addresses gathered."""
    if not uses_kernels(backend):
        return peer_store_reference(values, source_row, dest_device, dest_row, recv_rows, num_arrived,
                                    axis_name=axis_name)
    from moe_lowering.kernels.peer_store import triton_launch as peer

    if buffer is None:
        (buffer,), _ = gather_addresses([allocate_buffer(recv_rows, values.shape[1:], values.dtype,
                                                         axis_size=axis_size, zeroed=zeroed)], axis_name)
    if buffer.recv.shape[0] != recv_rows:
        raise ValueError(f"peer store: buffer of {buffer.recv.shape[0]} rows for {recv_rows}")
    flat = values.reshape(values.shape[0], -1)
    flat = flat.astype(jnp.int8) if flat.dtype == jnp.bool_ else flat

    def push(addresses, rank):
        return peer.push(flat, source_row, dest_device, dest_row, addresses, rank,
                         num_programs=PUSH_PROGRAMS), PUSH_PROGRAMS

    out = _push_and_wait(buffer, push, recv_rows, num_arrived, axis_name=axis_name, zero_tail=zero_tail)
    return out.reshape((recv_rows,) + values.shape[1:]).astype(values.dtype)


def expand_rows(table, index, num_rows, *, backend: str = "auto", zero_tail: bool = True):
    """``out[i] = table[index[i]]`` for ``i < num_rows`` (``[len(index), ...]``): a receiver's
    tokens expanded into its sorted rows. Rows from ``num_rows`` on are zero, or unspecified
    without ``zero_tail`` (the GPU kernel then touches only the rows that arrived)."""
    if uses_kernels(backend):
        from moe_lowering.kernels.peer_store import triton_launch as peer

        flat = table.reshape(table.shape[0], -1)
        out = peer.expand_rows(flat, index, num_rows, zero_tail=zero_tail)
        return out.reshape(index.shape[:1] + table.shape[1:])
    out = jnp.take(table, jnp.clip(index, 0, table.shape[0] - 1), axis=0)
    arrived = jnp.arange(index.shape[0]) < num_rows
    return jnp.where(arrived.reshape((-1,) + (1,) * (table.ndim - 1)), out, jnp.zeros((), table.dtype))


def grouped_matmul_store(lhs, rhs, group_sizes, dest_device, dest_row, recv_rows: int, num_arrived, *,
                         axis_name: str, axis_size: int, zeroed: bool = True, backend: str = "auto",
                         buffer: PeerBuffer | None = None, group_offset=0, preferred_element_type=None,
                         expected_rows: int | None = None):
    """``peer_store`` of the grouped product ``lhs[r] @ rhs[group(r)]``, row ``r`` as slot ``r``.

    On the Triton kernels the GEMM's epilogue stores each output row straight into its receiving
    rank's buffer (``grouped_matmul.triton_launch.gmm_push``): the exchange runs under the GEMM instead of
    after it, and the product never exists on the computing GPU. Elsewhere, and for dtypes the
    kernel lacks, the product is formed and stored as ``peer_store`` does. ``zeroed`` as for
    ``peer_store`` (``buffer``, if given, was made alike); rows from ``num_arrived`` on are zero.
    ``expected_rows``: as for ``grouped_matmul`` (``lhs`` may be a buffer sized for the worst case).
    """
    product_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    stored_by_gemm = False
    if uses_kernels(backend):
        from moe_lowering.kernels.grouped_matmul import triton_launch as triton_grouped_matmul

        stored_by_gemm = triton_grouped_matmul.has_kernel(lhs.dtype, rhs.dtype, product_dtype)
    if not stored_by_gemm:
        product = get_backend(backend).gmm(lhs, rhs, group_sizes, group_offset=group_offset,
                                           preferred_element_type=preferred_element_type, expected_rows=expected_rows)
        slots = jnp.arange(lhs.shape[0], dtype=jnp.int32)
        return peer_store(product, slots, dest_device, dest_row, recv_rows, num_arrived, axis_name=axis_name,
                          axis_size=axis_size, zeroed=zeroed, backend=backend, buffer=buffer)

    if buffer is None:
        (buffer,), _ = gather_addresses([allocate_buffer(recv_rows, (rhs.shape[2],), product_dtype,
                                                         axis_size=axis_size, zeroed=zeroed)], axis_name)
    if buffer.recv.shape != (recv_rows, rhs.shape[2]) or buffer.recv.dtype != product_dtype:
        raise ValueError(f"grouped_matmul_store: buffer {buffer.recv.shape} {buffer.recv.dtype} for "
                         f"[{recv_rows}, {rhs.shape[2]}] {product_dtype}")

    def push(addresses, rank):
        return triton_grouped_matmul.gmm_push(lhs, rhs, group_sizes, dest_device, dest_row, addresses, rank,
                                              group_offset=group_offset, preferred_element_type=preferred_element_type,
                                              expected_rows=expected_rows)

    return _push_and_wait(buffer, push, recv_rows, num_arrived, axis_name=axis_name, zero_tail=True)

