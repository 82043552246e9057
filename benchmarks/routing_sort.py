"""How long the routing's sort of token copies by expert takes: counting vs comparison sort.

``sparse_moe.sort_by_expert`` sorts by counting (a cumulative sum over one-hot experts and one
scatter) up to ``COUNTING_SORT_MAX_PAIRS`` (copy, expert) pairs, by ``jnp.argsort`` beyond. This
times both on one device for the copies of the benchmark layers, one GPU and per EP rank. Each
call is one small jitted program, so on a GPU the host's dispatch (~50 us) dominates and the
numbers bound the sort from above (``benchmarks/EP_NOTES.md``, round 10: the layer's trace, not
this, measured the sort); on a CPU they are the sort's own time. Rows go to
``routing_sort_<device>_<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import moe_lowering.sparse_moe as sparse_moe  # noqa: E402

# (name, tokens, top_k, experts): Mixtral-like and DeepSeek-like layers on one GPU and per rank at EP=2, 4.
SHAPES = [
    ("mixtral 1gpu", 8192, 2, 8), ("mixtral ep2", 4096, 2, 8), ("mixtral ep4", 2048, 2, 8),
    ("deepseek 1gpu", 8192, 8, 256), ("deepseek ep2", 2048, 8, 256), ("deepseek ep4", 1024, 8, 256),
]


def time_us(fn, arg, calls: int = 200, reps: int = 5) -> float:
    """Median over ``reps`` of the mean us per call of ``calls`` calls issued back to back."""
    jax.block_until_ready(fn(arg))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(arg)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON")
    args = parser.parse_args(argv)
    rows = []
    for name, tokens, top_k, experts in SHAPES:
        indices = jax.random.randint(jax.random.key(0), (tokens, top_k), 0, experts)
        row = {"name": name, "copies": tokens * top_k, "experts": experts}
        saved = sparse_moe.COUNTING_SORT_MAX_PAIRS
        for way, limit in (("counting", 1 << 62), ("comparison", 0)):
            sparse_moe.COUNTING_SORT_MAX_PAIRS = limit
            try:
                fn = jax.jit(lambda i: sparse_moe.sort_by_expert(i, experts))
                row[f"{way}_us"] = round(time_us(fn, indices), 1)
            finally:
                sparse_moe.COUNTING_SORT_MAX_PAIRS = saved
        row["pairs"] = tokens * top_k * (experts + 1)
        row["counts_by_default"] = row["pairs"] <= saved
        rows.append(row)
        print(row, flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = jax.devices()[0].device_kind.replace(" ", "_")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    path = out_dir / f"routing_sort_{kind}_{stamp}.json"
    path.write_text(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
