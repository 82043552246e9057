"""Probe of the device-initiated row exchange (``kernels/peer_store/triton_launch.py``) on the local GPUs.

For ep in (2, 4) GPUs of this host: every device holds ``rows`` rows sent to random devices; the
exchange stores each row at its final position on its destination. Checks the received rows against
numpy, bit for bit, then times it back to back against a padded NCCL ``all_to_all`` of the same rows
(capacity 1.25x the balanced share per pair, as ``parallel/exchange.py`` pads) and reports GB/s of
rows that leave each device.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_lowering.kernels.peer_store import triton_launch as peer
from moe_lowering.parallel._jax_shim import shard_map

log = logging.getLogger("peer_exchange_probe")


def destinations(key, ep, rows):
    """Random destination device per row, and each row's slot there (sources in rank order)."""
    dest_device = jax.random.randint(key, (ep, rows), 0, ep, dtype=jnp.int32)
    one_hot = jax.nn.one_hot(dest_device, ep, dtype=jnp.int32)  # [src, row, dst]
    counts = one_hot.sum(1)  # [src, dst]
    before_src = jnp.cumsum(counts, axis=0) - counts  # rows to dst from lower-ranked sources
    rank_in_pair = jnp.cumsum(one_hot, axis=1) - one_hot
    slot = jnp.take_along_axis(rank_in_pair, dest_device[..., None], axis=2)[..., 0]
    dest_row = slot + jnp.take_along_axis(before_src, dest_device, axis=1)
    return dest_device, dest_row, counts


def build_peer(mesh, ep, rows, d, dtype, push_programs, block_rows, block_d, wait_programs):
    def body(x, dest_device, dest_row, counts):
        rank = jax.lax.axis_index("x")
        recv, arrivals, address = peer.allocate(ep * rows, d, dtype, ep, jnp.zeros((1,), jnp.int32), zeroed=False)
        table = jax.lax.all_gather(address, "x")
        done = peer.push(x[0], jnp.arange(rows, dtype=jnp.int32), dest_device[0], dest_row[0], table, rank,
                         num_programs=push_programs, block_slots=block_rows, block_d=block_d)
        num_recv = jax.lax.all_gather(counts[0], "x")[:, rank].sum()
        return peer.wait(recv, arrivals, num_recv, done, signals_per_peer=push_programs,
                         num_programs=wait_programs, block_rows=block_rows, block_d=block_d)[None]

    return jax.jit(shard_map(body, mesh=mesh, in_specs=(P("x"),) * 4, out_specs=P("x")))


def build_padded_a2a(mesh, ep, capacity):
    def body(blocks):
        return jax.lax.all_to_all(blocks[0], "x", 0, 0, tiled=True)[None]

    return jax.jit(shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def time_b2b(fn, *args, calls=20, warmup=3):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def expected(x, dest_device, dest_row, counts, ep, rows, d):
    out = np.zeros((ep, ep * rows, d), x.dtype)
    for src in range(ep):
        out[dest_device[src], dest_row[src]] = x[src]
    return out


def probe(ep, rows, d, dtype, variants, results):
    devices = jax.devices()[:ep]
    peer.enable_peer_access(tuple(dev.local_hardware_id for dev in devices))
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    key_x, key_d = jax.random.split(jax.random.key(ep))
    x = jax.random.normal(key_x, (ep, rows, d), jnp.float32).astype(dtype)
    dest_device, dest_row, counts = destinations(key_d, ep, rows)
    args = [jax.device_put(a, sharding) for a in (x, dest_device, dest_row, counts)]
    host = [np.asarray(a) for a in (x, dest_device, dest_row, counts)]
    want = expected(*host, ep, rows, d)
    remote_rows = int(host[3].sum() - np.trace(host[3]))
    remote_bytes = remote_rows * d * jnp.dtype(dtype).itemsize / ep  # per device, leaving it
    for push_programs, block_rows, block_d, wait_programs in variants:
        name = f"peer ep{ep} {jnp.dtype(dtype).name} push{push_programs} rows{block_rows} d{block_d} wait{wait_programs}"
        row = {"name": name, "ep": ep, "rows": rows, "d": d, "dtype": jnp.dtype(dtype).name,
               "push_programs": push_programs, "block_rows": block_rows, "block_d": block_d}
        try:
            fn = build_peer(mesh, ep, rows, d, dtype, push_programs, block_rows, block_d, wait_programs)
            got = np.asarray(jax.block_until_ready(fn(*args)))
            recv_counts = host[3].sum(0)
            max_err = max(float(np.max(np.abs(got[j, :recv_counts[j]].astype(np.float32)
                                               - want[j, :recv_counts[j]].astype(np.float32))))
                          for j in range(ep))
            row["max_abs_err"] = max_err
            ms = time_b2b(fn, *args)
            row["ms_b2b"] = ms
            row["GBps_leaving_device"] = remote_bytes / ms / 1e6
        except Exception as err:  # noqa: BLE001 - a probe records what failed and goes on
            row["error"] = f"{type(err).__name__}: {err}"[:400]
        log.info("%s", row)
        results.append(row)
    capacity = math.ceil(1.25 * rows / ep)
    blocks = jax.device_put(jax.random.normal(key_x, (ep, ep * capacity, d), jnp.float32).astype(dtype), sharding)
    fn = build_padded_a2a(mesh, ep, capacity)
    ms = time_b2b(fn, blocks)
    wire = capacity * (ep - 1) * d * jnp.dtype(dtype).itemsize
    row = {"name": f"padded all_to_all ep{ep}", "ep": ep, "ms_b2b": ms, "GBps_wire": wire / ms / 1e6,
           "GBps_useful_rows": remote_bytes / ms / 1e6}
    log.info("%s", row)
    results.append(row)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--d", type=int, default=7168)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    results = []
    small = [(132, 8, 1024, 132)]
    variants = [(132, 8, 1024, 132), (64, 8, 1024, 132), (32, 8, 1024, 132), (132, 4, 2048, 132),
                (264, 8, 1024, 132), (132, 16, 512, 132)]
    count = len(jax.devices())
    probe(2, 256, 512, jnp.float32, small, results)
    for ep in (2, 4):
        if ep <= count:
            probe(ep, args.rows, args.d, jnp.bfloat16, variants, results)
    if count >= 4:
        probe(4, 4096, 4096, jnp.bfloat16, variants[:3], results)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "peer_exchange_probe.json"
    path.write_text(json.dumps({"device": jax.devices()[0].device_kind, "count": count, "rows": results}, indent=1))
    for row in results:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})


if __name__ == "__main__":
    main()
