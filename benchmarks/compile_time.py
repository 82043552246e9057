"""What the rewrite costs at compile time: trace + lower and XLA compile of a jitted step, dense
reference against ``moe_optimize``, forward and forward+backward, on the local backend.

The rewritten program holds the routing sort, the grouped GEMMs' tile loops and their backward,
so it compiles longer than the dense einsums it replaces; this measures by how much, per zoo
layer. Each measurement starts from cleared caches (``jax.clear_caches()``) and the dense and the
rewritten sides alternate, so load on the machine slows both alike; the median of ``--reps`` is
reported, in wall seconds and in this process's CPU seconds (which load from other processes does
not inflate; the ratios are taken from them).

    python -m benchmarks compile-time --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from moe_lowering import moe_optimize
from moe_lowering.testing.zoo import ZOO

LAYERS = ("mixtral", "deepseek_v3", "switch", "grouped_capacity")


def _step(fn, backward: bool):
    if not backward:
        return fn
    return jax.grad(lambda params, x: jnp.mean(fn(params, x) ** 2))


def _compile_seconds(fn, params, x) -> dict:
    """Wall and CPU seconds of ``jax.jit(fn)``'s trace + lower and its compile, from cleared caches."""
    jax.clear_caches()
    wall, cpu = time.perf_counter(), time.process_time()
    lowered = jax.jit(fn).lower(params, x)
    lowered_wall, lowered_cpu = time.perf_counter(), time.process_time()
    lowered.compile()
    done_wall, done_cpu = time.perf_counter(), time.process_time()
    return {"lower_s": lowered_wall - wall, "compile_s": done_wall - lowered_wall, "total_s": done_wall - wall,
            "lower_cpu_s": lowered_cpu - cpu, "compile_cpu_s": done_cpu - lowered_cpu, "total_cpu_s": done_cpu - cpu}


def measure(layer: str, backward: bool, reps: int) -> dict:
    model = ZOO[layer]
    params, x = model.args(jax.random.key(0))
    sides = {"dense": _step(model.fn, backward), "moe_optimize": _step(moe_optimize(model.fn), backward)}
    for fn in sides.values():  # once each first: module imports and one-time set-up are not compile time
        _compile_seconds(fn, params, x)
    samples = {side: [] for side in sides}
    for _ in range(reps):
        for side, fn in sides.items():
            samples[side].append(_compile_seconds(fn, params, x))
    row = {"layer": layer, "step": "fwdbwd" if backward else "fwd"}
    for side, runs in samples.items():
        for key in runs[0]:
            row[f"{side}_{key}"] = statistics.median(run[key] for run in runs)
    row["total_cpu_ratio"] = row["moe_optimize_total_cpu_s"] / row["dense_total_cpu_s"]
    row["compile_cpu_ratio"] = row["moe_optimize_compile_cpu_s"] / row["dense_compile_cpu_s"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=sorted(ZOO))
    parser.add_argument("--reps", type=int, default=5, help="measurements per side (median reported)")
    parser.add_argument("--out", type=Path, help="write compile_time_<device>_<date>.json in this folder")
    args = parser.parse_args()
    rows = []
    for layer in args.layers:
        for backward in (False, True):
            row = measure(layer, backward, args.reps)
            rows.append(row)
            print(f"{layer:18s} {row['step']:6s} CPU s: dense {row['dense_total_cpu_s']:6.2f} "
                  f"moe_optimize {row['moe_optimize_total_cpu_s']:6.2f} (x{row['total_cpu_ratio']:.2f}; "
                  f"XLA compile alone x{row['compile_cpu_ratio']:.2f})", flush=True)
    device = jax.devices()[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "device": f"{device.platform.upper()} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        if device.platform == "cpu" else device.device_kind,
        "date": now.isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "reps": args.reps,
        "timing": "median seconds (wall; *_cpu_s: this process's CPU time) from cleared caches of "
                  "jax.jit(step).lower(...) and .compile(), after one unmeasured round; dense and moe_optimize "
                  "alternated; fwdbwd = jax.grad of mean(out**2)",
        "rows": rows,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = "cpu" if device.platform == "cpu" else device.device_kind.replace(" ", "_")
        path = args.out / f"compile_time_{tag}_{now.date().isoformat()}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
