"""The expert-parallel layer in one process per GPU against one process for all GPUs (issue 36).

For EP=2 and EP=4 (``--ep``) and the Mixtral-like and DeepSeek-like layers of ``ep_bench``, the
same measurements run twice on one host, each as a job of its own (``moe_lowering.testing.
multiprocess``): once as one process holding all ``ep`` GPUs, once as ``ep`` processes of one GPU
each (``jax.distributed``, the mesh across the processes). Each job times, on the mesh
``(expert=ep,)``, the dense layer (XLA-partitioned from the same shardings) and the sharded sparse
layer, forward and forward+backward, synchronised (``Bench.time_ms``) and back to back
(``Bench.time_back_to_back_ms``), for the transport ``"auto"`` picks there (``"peer"`` on the GPUs
of one host in both layouts: across processes its receive buffers live in the peer heap,
``kernels/peer_store/heap.py``, sized by ``--peer-heap-mb``) and for ``--transports`` (default
``"all_to_all"``) where they differ.
Every process writes its rows and the shards it holds of the sparse layer's output and gradient
fingerprints (per token and per expert: sums and sums of squares); this parent merges them:
each time is the slowest process's, and for every transport both jobs ran, the one-GPU-per-process
layer is checked against the one-process layer element for element (outputs and fingerprints).

Results: ``ep_multiprocess_ep<sizes>_<device>_<date>.json`` under ``--out`` (device, date, process layouts,
the rows of both jobs, and per measurement the multi-process time over the one-process time).
``--smoke`` runs tiny shapes on host CPU devices (one per process, gloo collectives).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402

from moe_lowering.testing import multiprocess  # noqa: E402 (starts no JAX backend: a worker joins its job first)

log = logging.getLogger("ep_multiprocess")

LAYOUTS = ("one_process", "process_per_device")
JOB_TIMEOUT_S = 900
# Both configs' forward and forward+backward programs at EP=2 keep about 2.8 GB of receive regions
# (the deduplicated DeepSeek-like dispatch alone ~0.5 GB a site); XLA leaves a quarter of an H100 free.
PEER_HEAP_MB = 6144


def _job_layout(layout: str, ep: int) -> tuple[int, int]:
    """``(processes, devices per process)``."""
    return (1, ep) if layout == "one_process" else (ep, 1)


# ---------------------------------------------------------------------------------------------
# A worker: one process of a job; every process runs the same calls in the same order.


def worker_main(args) -> None:
    identity = multiprocess.initialize()
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import ep_bench
    from moe_lowering.parallel import plan_layout, sharded_sparse_moe
    from moe_lowering.parallel.exchange import resolve_transport

    out_dir = Path(args.worker_out)
    (ep,) = args.ep
    tag = f"{args.layout}_ep{ep}_process{identity.process_id}"
    bench = ep_bench.Bench(out_dir / f"{tag}.json", math.inf, args.reps)
    bench.doc.update(layout=args.layout, processes=jax.process_count(), process_id=identity.process_id,
                     local_devices=[str(d) for d in jax.local_devices()])
    mesh = ep_bench.make_mesh((ep,), ("expert",))
    spec = P("expert")
    shards = {}

    def global_array(x):  # every process made the same ``x``; each keeps its devices' rows
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda index: x[index])

    def measure(name, fn, fn_args, **extra):
        started = time.monotonic()
        row = {"name": name, "sync_ms": bench.time_ms(fn, *fn_args),
               "b2b_ms": bench.time_back_to_back_ms(fn, *fn_args), **extra}
        bench.record({**row, "wall_s": time.monotonic() - started})

    @jax.jit
    def fingerprints(grads):
        """Per token / per expert: sum and sum of squares of each gradient (float32)."""
        def reduce(g):
            g = g.astype(jnp.float32)
            axes = tuple(range(1, g.ndim))
            return jnp.stack([g.sum(axes), (g * g).sum(axes)], axis=1)
        return jax.tree.map(reduce, grads)

    for config_name in args.configs:
        cfg = ep_bench.CONFIGS["smoke" if args.shapes == "smoke" else config_name]
        tokens, indices, weights, params, cotangent = (
            jax.tree.map(global_array, part) for part in ep_bench.make_layer_data(cfg))
        program = ep_bench.swiglu_program()
        layout = plan_layout(mesh, spec, [spec] * 3, cfg.E)
        auto = resolve_transport("auto", layout.devices, bench.backend)
        common = {"config": config_name, "ep": ep}
        try:
            def dense(t, p, i, w):
                return ep_bench.dense_layer(t, i, w, p, cfg.E)

            routing = (indices, weights)  # arguments, never closed over: a global array cannot be a constant
            forward = jax.jit(dense, out_shardings=NamedSharding(mesh, spec))
            measure(f"{config_name} dense fwd", forward, (tokens, params, *routing), impl="dense", step="fwd",
                    **common)
            measure(f"{config_name} dense fwdbwd", jax.jit(ep_bench.with_grad(dense)),
                    (tokens, params, cotangent, *routing), impl="dense", step="fwdbwd", **common)
            for transport in dict.fromkeys((auto, *args.transports)):
                def sparse(t, p, i, w, transport=transport):
                    return sharded_sparse_moe(t, i, w, p, program, num_experts=cfg.E, layout=layout,
                                              backend=bench.backend, exchange_transport=transport)

                forward, backward = jax.jit(sparse), jax.jit(ep_bench.with_grad(sparse))
                label = f"{config_name} sparse {transport}"
                extra = {"impl": "sparse", "transport": transport, "auto": transport == auto, **common}
                measure(f"{label} fwd", forward, (tokens, params, *routing), step="fwd", **extra)
                measure(f"{label} fwdbwd", backward, (tokens, params, cotangent, *routing), step="fwdbwd", **extra)
                shards.update(multiprocess.shard_entries(f"{config_name}|{transport}|out",
                                                         forward(tokens, params, *routing)))
                shards.update(multiprocess.shard_entries(f"{config_name}|{transport}|grads",
                                                         fingerprints(backward(tokens, params, cotangent, *routing))))
        except Exception:
            bench.record({"name": f"{config_name} failed", "error": traceback.format_exc()[-3000:], **common})
            raise  # the launcher ends the job: the other processes would wait in a collective
        finally:
            np.savez(out_dir / f"{tag}.npz", **shards)
        del tokens, indices, weights, params, cotangent


# ---------------------------------------------------------------------------------------------
# The parent: two jobs per EP size, then the merge.


def run_job(args, layout: str, ep: int, job_dir: Path) -> dict:
    """Runs one job; ``{"processes": [doc per process], "shards": {...}}``, or ``{"error": ...}``."""
    processes, per_process = _job_layout(layout, ep)
    command = [sys.executable, __file__, "--worker-out", str(job_dir), "--layout", layout, "--ep", str(ep),
               "--reps", str(args.reps), "--shapes", "smoke" if args.smoke else "full", "--configs", *args.configs,
               "--transports", *args.transports]
    log.info("job %s ep=%d: %d process(es) x %d device(s)", layout, ep, processes, per_process)
    started = time.monotonic()
    error = None
    try:
        multiprocess.launch(command, num_processes=processes, devices_per_process=per_process,
                            platform="cpu" if args.smoke else "gpu", timeout_s=args.timeout, cwd=ROOT,
                            env={"MOE_LOWERING_PEER_HEAP_MB": str(args.peer_heap_mb)})
    except multiprocess.MultiprocessFailure as failure:
        error = str(failure)[-6000:]
        log.error("job %s ep=%d failed:\n%s", layout, ep, error)
    docs, shards = [], {}
    for process in range(processes):
        tag = f"{layout}_ep{ep}_process{process}"
        if (job_dir / f"{tag}.json").exists():
            docs.append(json.loads((job_dir / f"{tag}.json").read_text()))
        if (job_dir / f"{tag}.npz").exists():
            with np.load(job_dir / f"{tag}.npz") as saved:
                shards.update({k: saved[k] for k in saved.files})
    return {"layout": layout, "ep": ep, "processes": processes, "devices_per_process": per_process,
            "wall_s": time.monotonic() - started, "error": error, "docs": docs, "shards": shards}


def compare_jobs(single: dict, multi: dict, key: str, multi_key: str | None = None) -> dict:
    """How far the multi-process job's arrays under ``multi_key`` (default ``key``) are from the
    one-process job's under ``key``."""
    expected = multiprocess.assemble(single["shards"], key)
    got = multiprocess.assemble(multi["shards"], multi_key or key)
    if not expected or expected.keys() != got.keys():
        return {"compared": False, "why": f"leaves {sorted(expected)} vs {sorted(got)}"}
    worst, bitwise = 0.0, True
    for leaf, want in expected.items():
        have = got[leaf]
        if want.shape != have.shape or np.isnan(have).any() or np.isnan(want).any():
            return {"compared": False, "why": f"{leaf}: shapes {want.shape} vs {have.shape} or elements missing"}
        bitwise &= bool(np.array_equal(want, have))
        worst = max(worst, float(np.linalg.norm(want - have) / max(np.linalg.norm(want), 1e-30)))
    return {"compared": True, "bitwise": bitwise, "max_rel_err": worst}


CLOCKS = ("sync_ms", "b2b_ms")
# The one-process-per-device layer must compute what the one-process layer does with the same
# transport: the same per-device programs and collectives (only float reordering could differ).
EXACT_TOLERANCE = 1e-6


def merge(jobs: list[dict]) -> list[dict]:
    """One row per (EP, config, measurement) with both layouts' times (the slowest process's),
    their ratio, the speed-up over the dense layer of the same layout, and the exactness checks."""
    rows = []
    for ep in sorted({j["ep"] for j in jobs}):
        by_layout = {j["layout"]: j for j in jobs if j["ep"] == ep}
        measured: dict[tuple, dict] = {}
        for layout, job in by_layout.items():
            for doc in job["docs"]:
                for r in doc["rows"]:
                    if "sync_ms" not in r:
                        continue
                    key = (r["config"], r["impl"], r.get("transport"), r["step"])
                    row = measured.setdefault(key, dict(zip(("config", "impl", "transport", "step"), key), ep=ep))
                    for clock in CLOCKS:
                        row[f"{layout}_{clock}"] = max(row.get(f"{layout}_{clock}", 0.0), r[clock])
                    if r.get("auto"):
                        row[f"{layout}_auto"] = True
        for row in measured.values():
            for clock in CLOCKS:
                one, many = row.get(f"one_process_{clock}"), row.get(f"process_per_device_{clock}")
                if one and many:
                    row[f"{clock}_multi_over_one"] = many / one
            dense = measured.get((row["config"], "dense", None, row["step"]))
            one_auto = next((r for r in measured.values() if r.get("one_process_auto") and r["step"] == row["step"]
                             and r["config"] == row["config"]), None)
            for clock in CLOCKS if row["impl"] == "sparse" else ():
                for key in (f"{layout}_{clock}" for layout in LAYOUTS):
                    if dense and dense.get(key) and row.get(key):
                        row[f"{key}_speedup_vs_dense"] = dense[key] / row[key]
                if row.get("process_per_device_auto") and one_auto and row.get(f"process_per_device_{clock}"):
                    row[f"{clock}_multi_auto_over_one_auto"] = (row[f"process_per_device_{clock}"]
                                                                / one_auto[f"one_process_{clock}"])
        rows.extend(measured.values())
        if len(by_layout) < 2:
            continue
        both = [r for r in measured.values() if r["impl"] == "sparse" and r["step"] == "fwd"
                and all(f"{layout}_sync_ms" in r for layout in LAYOUTS)]
        single, multi = by_layout["one_process"], by_layout["process_per_device"]
        for r in both:
            for what in ("out", "grads"):
                rows.append({"config": r["config"], "ep": ep, "check": f"{what}, {r['transport']}: one process per "
                             "device vs one process",
                             **compare_jobs(single, multi, f"{r['config']}|{r['transport']}|{what}")})
        # each layout's default ("auto": "peer" in one process on GPUs): other rounds, so reported, not required exact
        for config in dict.fromkeys(r["config"] for r in both):
            picks = [next((r["transport"] for r in measured.values() if r["config"] == config
                           and r.get(f"{layout}_auto") and r["impl"] == "sparse"), None) for layout in LAYOUTS]
            if None in picks or picks[0] == picks[1]:
                continue
            for what in ("out", "grads"):
                rows.append({"config": config, "ep": ep, "informational": True,
                             "check": f"{what}: one process per device ({picks[1]}) vs one process ({picks[0]})",
                             **compare_jobs(single, multi, f"{config}|{picks[0]}|{what}",
                                            f"{config}|{picks[1]}|{what}")})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON")
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--configs", nargs="+", default=["mixtral", "deepseek"], choices=["mixtral", "deepseek"])
    parser.add_argument("--transports", nargs="+", default=["all_to_all"],
                        choices=["all_to_all", "ppermute", "ragged", "peer"],
                        help="timed beside the one 'auto' picks (ragged: GPUs only)")
    parser.add_argument("--peer-heap-mb", type=int, default=PEER_HEAP_MB,
                        help="the peer heap of each process of one GPU (MOE_LOWERING_PEER_HEAP_MB): every "
                             "exchange site of every timed program keeps its region")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=JOB_TIMEOUT_S, help="seconds per job")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on host CPU devices")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set for the job's processes
    parser.add_argument("--layout", choices=LAYOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--shapes", choices=["smoke", "full"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        worker_main(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    jobs = []
    stamp = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="ep_multiprocess_") as tmp:
        for ep in args.ep:
            for layout in LAYOUTS:
                job_dir = Path(tmp) / f"{layout}_ep{ep}"
                job_dir.mkdir()
                jobs.append(run_job(args, layout, ep, job_dir))
                result = write_result(args, jobs, stamp)  # after every job: a run cut short keeps what it has
    _print_table(result["rows"])
    failed = [j for j in jobs if j["error"]] + [r for r in result["rows"] if not r.get("informational") and (
        r.get("compared") is False or r.get("max_rel_err", 0.0) > EXACT_TOLERANCE)]
    if failed:
        log.error("%d job(s) failed or differ from the one-process layer", len(failed))
        sys.exit(1)


def write_result(args, jobs: list[dict], stamp: datetime.datetime) -> dict:
    """``ep_multiprocess_[smoke_]ep<sizes>_<device>_<date>.json`` under ``--out``: what ``jobs`` measured."""
    docs = [d for j in jobs for d in j["docs"]]
    device = docs[0]["device"].split(" x ", 1)[-1] if docs else "unknown"
    result = {
        "device": device, "platform": docs[0]["platform"] if docs else None, "jax": docs[0]["jax"] if docs else None,
        "date": stamp.isoformat(), "smoke": args.smoke, "reps": args.reps,
        "jobs": [{"layout": j["layout"], "ep": j["ep"], "processes": j["processes"],
                  "devices_per_process": j["devices_per_process"], "wall_s": round(j["wall_s"], 1),
                  "error": j["error"], "local_devices": [d["local_devices"] for d in j["docs"]]} for j in jobs],
        "rows": merge(jobs),
        "process_rows": {f"{j['layout']}_ep{j['ep']}": [d["rows"] for d in j["docs"]] for j in jobs},
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = "-".join(str(ep) for ep in args.ep)
    name = f"ep_multiprocess_{'smoke_' if args.smoke else ''}ep{sizes}_{device.replace(' ', '_')}_{stamp:%Y%m%d}.json"
    (out_dir / name).write_text(json.dumps(result, indent=1))
    log.info("wrote %s", out_dir / name)
    return result


def _print_table(rows):
    for row in rows:
        print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
