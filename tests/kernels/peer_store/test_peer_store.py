"""The peer-store reference (the CPU path of the ``"peer"`` exchange) against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from moe_lowering.kernels.peer_store import expand_rows, peer_store
from moe_lowering.parallel._jax_shim import shard_map
from parallel_cases import random_peer_routes

RANKS, SLOTS, RECV_ROWS, WIDTH = 4, 12, 20, 3


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_arrived", [RECV_ROWS, 7])
def test_peer_store_reference(seed, num_arrived):
    source_row, dest_device, dest_row = random_peer_routes(np.random.default_rng(seed), ranks=RANKS, slots=SLOTS,
                                                           recv_rows=RECV_ROWS)
    values = np.random.default_rng(seed + 10).normal(size=(RANKS, SLOTS, WIDTH)).astype(np.float32)
    mesh = jax.make_mesh((RANKS,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:RANKS])

    def body(v, s, d, r):
        return peer_store(v[0], s[0], d[0], r[0], RECV_ROWS, num_arrived, axis_name="x", axis_size=RANKS,
                          zeroed=True, backend="xla")[None]

    got = jax.jit(shard_map(body, mesh=mesh, in_specs=(P("x"),) * 4, out_specs=P("x")))(
        jnp.asarray(values), jnp.asarray(source_row), jnp.asarray(dest_device), jnp.asarray(dest_row))
    want = np.zeros((RANKS, RECV_ROWS, WIDTH), np.float32)
    for rank in range(RANKS):
        for slot in range(SLOTS):
            if dest_device[rank, slot] >= 0:
                want[dest_device[rank, slot], dest_row[rank, slot]] = values[rank, source_row[rank, slot]]
    want[:, num_arrived:] = 0
    np.testing.assert_array_equal(np.asarray(got), want)


def test_expand_rows_reference():
    """The counted rows gather their tokens; rows after them are zero."""
    table = jnp.asarray(np.random.default_rng(4).standard_normal((6, 3)), jnp.float32)
    index = jnp.asarray([5, 0, 3, 3, 1], jnp.int32)
    got = expand_rows(table, index, 3, backend="xla")
    np.testing.assert_array_equal(got[:3], table[jnp.asarray([5, 0, 3])])
    np.testing.assert_array_equal(got[3:], 0)
