"""CPU times of real frameworks' dense MoE layers, as shipped and through ``moe_optimize``.

The layers are those of ``tests/realworld`` (MaxText 0.2.5 ``RoutedMoE`` / ``RoutedAndSharedMoE``
on the dense path, EasyDeL 0.3.0 ``dense_moe`` blocks), built by the same code
(``tests/realworld/rw_layers.py``) at a larger size. Per layer: ``explain``; if the pass rewrites
it, the median forward and forward+backward (gradients of every parameter and the input) times of
the layer and of ``moe_optimize(layer)``, both jitted, and the rewrite's largest relative output
error; MaxText's sparse path is timed beside them where it exists. A layer the pass declines is
reported as ``declined: <explain's reason>`` and not timed (``--time-declined`` times it anyway,
the "optimised" function then being the layer itself: a check of this script, not a result).

Needs the real-world dependencies (``pip install -e ".[test,realworld]"`` and
``bash tools/install_realworld.sh``, Python 3.12). Writes
``realworld_cpu_<device>_<date>.json`` (``{"device", "date", "jax", "sizes", "rows": [{"layer",
"status", "reason" | "dense_fwd_ms", "moe_fwd_ms", "dense_fwdbwd_ms", "moe_fwdbwd_ms", ...}]}``)
under ``--out`` (default ``benchmarks/results``).

    python benchmarks/realworld_cpu.py                      # every layer, B=2 S=128 d=128 f=256
    python benchmarks/realworld_cpu.py --layers maxtext/mixtral-8x7b --reps 3 --out /tmp/rw
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import platform
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "realworld"))

from rw_check import near_miss_reason  # noqa: E402
from rw_layers import EASYDEL_CASES, MAXTEXT_CASES, easydel_layer, maxtext_layer  # noqa: E402

import moe_layer  # noqa: E402  (its timing helper, as sonic.py uses it)
from moe_lowering import NoMoeFoundWarning, explain, moe_optimize  # noqa: E402

log = logging.getLogger("realworld_cpu")

LAYERS = [f"maxtext/{c}" for c in MAXTEXT_CASES] + [f"easydel/{c}" for c in EASYDEL_CASES]


def build(name: str, batch: int, seq: int, d_model: int, d_ff: int):
    framework, case = name.split("/", 1)
    builder = maxtext_layer if framework == "maxtext" else easydel_layer
    return builder(case, batch=batch, seq=seq, d_model=d_model, d_ff=d_ff)


def _time_ms(compiled, args, reps: int) -> float:
    return moe_layer._time_ms(compiled, args, reps, warmup=1)


def _fwd_bwd(fn):
    def both(params, x, cotangent):
        out, vjp = jax.vjp(fn, params, x)
        return out, vjp(cotangent)

    return both


def time_fn(fn, params, x, cotangent, reps: int) -> tuple[float, float]:
    forward = jax.jit(fn).lower(params, x).compile()
    fwd = _time_ms(forward, (params, x), reps)
    del forward
    both = jax.jit(_fwd_bwd(fn)).lower(params, x, cotangent).compile()
    fwdbwd = _time_ms(both, (params, x, cotangent), reps)
    return fwd, fwdbwd


def bench_layer(name: str, args) -> dict:
    layer = build(name, args.batch, args.seq, args.d_model, args.d_ff)
    row = {"layer": name, **layer.info}
    report = explain(layer.fn, layer.params, layer.x)
    if report.regions:
        row["status"] = "rewritten"
        row["regions"] = [r.summary() for r in report.regions]
    else:
        row["status"] = "declined"
        row["reason"] = near_miss_reason(report)
        print(f"{name}: declined: {row['reason']}", flush=True)
        if not args.time_declined:
            return row
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoMoeFoundWarning)
        optimized = moe_optimize(layer.fn)
        out = jax.jit(optimized)(layer.params, layer.x)
    want = jax.jit(layer.fn)(layer.params, layer.x)
    row["max_rel_error"] = float(jnp.max(jnp.abs(out - want)) / jnp.max(jnp.abs(want)))
    cotangent = jax.random.normal(jax.random.key(2), want.shape, want.dtype)
    row["dense_fwd_ms"], row["dense_fwdbwd_ms"] = time_fn(layer.fn, layer.params, layer.x, cotangent, args.reps)
    row["moe_fwd_ms"], row["moe_fwdbwd_ms"] = time_fn(optimized, layer.params, layer.x, cotangent, args.reps)
    row["speedup_fwd"] = row["dense_fwd_ms"] / row["moe_fwd_ms"]
    row["speedup_fwdbwd"] = row["dense_fwdbwd_ms"] / row["moe_fwdbwd_ms"]
    if layer.reference is not None:
        row["reference"] = layer.reference_name
        row["reference_fwd_ms"], row["reference_fwdbwd_ms"] = time_fn(layer.reference, layer.params, layer.x,
                                                                       cotangent, args.reps)
    print(f"{name}: {row['status']}: dense {row['dense_fwd_ms']:.2f} / {row['dense_fwdbwd_ms']:.2f} ms, "
          f"moe_optimize {row['moe_fwd_ms']:.2f} / {row['moe_fwdbwd_ms']:.2f} ms (fwd / fwd+bwd), "
          f"max rel error {row['max_rel_error']:.1e}", flush=True)
    return row


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", nargs="+", default=LAYERS, choices=LAYERS, metavar="LAYER",
                        help=f"layers to run (default: all): {' '.join(LAYERS)}")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--d-ff", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (median)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--time-declined", action="store_true",
                        help="time declined layers too (moe_optimize then runs the layer unchanged)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # MaxText logs every config key at INFO
    os.environ.setdefault("EASYDEL_AUTO", "0")

    device = jax.devices()[0]
    rows = []
    for name in args.layers:
        try:
            rows.append(bench_layer(name, args))
        except Exception as err:  # noqa: BLE001 - one layer failing to build or run is a result
            log.warning("%s failed: %s: %s", name, type(err).__name__, err)
            rows.append({"layer": name, "status": "error", "error": f"{type(err).__name__}: {str(err)[:500]}"})
        gc.collect()
        jax.clear_caches()
    result = {
        "device": device.device_kind,
        "platform": device.platform,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "sizes": {"batch": args.batch, "seq": args.seq, "d_model": args.d_model, "d_ff": args.d_ff},
        "reps": args.reps,
        "timing": "median of --reps calls of the jitted, compiled function after one warm call; "
                  "fwdbwd: forward and jax.vjp of every parameter and the input",
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"realworld_cpu_{device.device_kind.replace(' ', '_')}_{result['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
