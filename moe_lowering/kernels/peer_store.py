"""Row stores between the ranks of a mesh axis: the reference (and CPU path) of ``triton_peer_store``.

``peer_store`` is the ``"peer"`` exchange transport's one operation: slot ``j`` of every rank holds
``values[source_row[j]]`` and names a destination rank and a row there; each rank gets back the
``[recv_rows, ...]`` rows stored to it. On GPUs of one process (the Triton backend) the sender
stores the rows itself over NVLink (``triton_peer_store``); elsewhere this module's reference
all-gathers every rank's slots and scatters the ones addressed here, which is exact and slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_lowering.kernels import get_backend


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


# Programs of the Triton kernels: every push program signals every peer once; the waiting
# programs spin, so they are kept few enough to leave multiprocessors to NCCL's kernels.
PUSH_PROGRAMS = 132
WAIT_PROGRAMS = 32


def peer_store(values, source_row, dest_device, dest_row, recv_rows: int, num_arrived, *, axis_name: str,
               axis_size: int, zeroed: bool, backend: str = "auto"):
    """See the module docstring. ``zeroed``: rows below ``num_arrived`` that no slot names are zero
    (the Triton path otherwise leaves them unset, which costs nothing when every one is stored)."""
    if get_backend(backend).name != "triton":
        return peer_store_reference(values, source_row, dest_device, dest_row, recv_rows, num_arrived,
                                    axis_name=axis_name)
    from moe_lowering.kernels import triton_peer_store as peer

    if values.dtype == jnp.bool_:
        return peer_store(values.astype(jnp.int8), source_row, dest_device, dest_row, recv_rows, num_arrived,
                          axis_name=axis_name, axis_size=axis_size, zeroed=zeroed, backend=backend).astype(jnp.bool_)
    flat = values.reshape(values.shape[0], -1)
    recv, arrivals, address = peer.allocate(recv_rows, flat.shape[1], axis_size, flat, dest_device, dest_row,
                                            zeroed=zeroed)
    addresses = jax.lax.all_gather(address, axis_name)
    done = peer.push(flat, source_row, dest_device, dest_row, addresses, jax.lax.axis_index(axis_name),
                     num_programs=PUSH_PROGRAMS)
    out = peer.wait(recv, arrivals, num_arrived, done, signals_per_peer=PUSH_PROGRAMS, num_programs=WAIT_PROGRAMS)
    return out.reshape((recv_rows,) + values.shape[1:])
