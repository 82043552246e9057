"""Times a whole training step with ``moe_optimize`` on the step against ``moe_optimize`` on the layer.

A user decorates either the MoE layer or the jitted training step (``jax.value_and_grad`` of a loss
over the layer, then an SGD update). Decorating the step makes the pass find the layer's forward
*and* the backward JAX's autodiff emitted for it, prove that backward is the dense layer's VJP and
replace both (``passes/derivative_match.py``). This benchmark checks that the two placements give the
same step (loss and updated parameters) and times them, interleaved so that a drift of the machine
hits both, with the dense step as the baseline where it fits.

Variants (``--variants``):

* ``layer``: ``jax.jit(step(moe_optimize(layer)))``;
* ``step``: ``moe_optimize(jax.jit(step(layer)))``: the whole step handed to the pass;
* ``dense``: ``jax.jit(step(layer))``, skipped above ``--dense-max-gflop``.

Writes ``train_step_<device>_<date>.json`` (schema ``{"device", "date", "rows": [{"config", "variant",
"step_ms", "step_back_to_back_ms", "loss", "max_param_rel_diff_vs_layer", ...}]}``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_layer import CONFIGS, LayerConfig  # noqa: E402

log = logging.getLogger("train_step")
VARIANTS = ("layer", "step", "dense")
LEARNING_RATE = 1e-3


def make_step(layer):
    """``(params, x, target) -> (params, loss)``: one SGD step on a mean-squared error over the layer."""

    def loss(params, x, target):
        return jnp.mean(jnp.square(layer(params, x).astype(jnp.float32) - target))

    def step(params, x, target):
        value, grads = jax.value_and_grad(loss)(params, x, target)
        updated = jax.tree.map(lambda p, g: (p - LEARNING_RATE * g).astype(p.dtype), params, grads)
        return updated, value

    return step


def build_variant(variant: str, layer_fn):
    from moe_lowering import moe_optimize

    if variant == "layer":
        return jax.jit(make_step(moe_optimize(layer_fn)))
    if variant == "step":
        return moe_optimize(jax.jit(make_step(layer_fn)), strict=True)
    if variant == "dense":
        return jax.jit(make_step(layer_fn))
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


def _time_once_ms(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) * 1e3


def _time_back_to_back_ms(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) * 1e3 / calls


def _max_rel_diff(a, b) -> float:
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        worst = max(worst, float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(x)), 1e-30)))
    return worst


def run_config(config: LayerConfig, variants, reps: int, calls: int, dense_max_gflop: float):
    from moe_lowering import explain
    from moe_lowering.testing.zoo import Sizes, build_mixtral

    model = build_mixtral(Sizes(T=config.T, d=config.d, f=config.f, E=config.E, k=config.k))
    params, x = model.args(jax.random.key(1), jnp.bfloat16)
    target = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    args = (params, x, target)
    dense_gflop = 6.0 * config.T * config.E * config.d * config.f / 1e9
    rows, fns, results = [], {}, {}
    for variant in variants:
        row = {"config": config.name, "variant": variant, "T": config.T, "d": config.d, "f": config.f,
               "E": config.E, "k": config.k}
        if variant == "dense" and dense_gflop > dense_max_gflop:
            row["skipped"] = f"dense forward is {dense_gflop:.0f} GFLOP"
            rows.append(row)
            continue
        fn = build_variant(variant, model.fn)
        if variant == "step":
            report = explain(jax.jit(make_step(model.fn)), *args)
            row["regions"] = len(report.regions)
            row["backward_rewritten"] = all(r.backward for r in report.regions)
        updated, loss = jax.block_until_ready(fn(*args))  # compiles
        results[variant] = (updated, float(loss))
        row["loss"] = float(loss)
        fns[variant] = fn
        rows.append(row)
    if "layer" in results:
        for row in rows:
            if row["variant"] in results:
                updated, loss = results[row["variant"]]
                row["max_param_rel_diff_vs_layer"] = _max_rel_diff(results["layer"][0], updated)
                row["loss_rel_diff_vs_layer"] = abs(loss - results["layer"][1]) / max(abs(results["layer"][1]), 1e-30)
    del results
    once = {v: [] for v in fns}
    back_to_back = {v: [] for v in fns}
    for _ in range(reps):  # interleaved: each repetition times every variant once
        for variant, fn in fns.items():
            once[variant].append(_time_once_ms(fn, args))
            back_to_back[variant].append(_time_back_to_back_ms(fn, args, calls))
    for row in rows:
        if row["variant"] in fns:
            row["step_ms"] = statistics.median(once[row["variant"]])
            row["step_back_to_back_ms"] = statistics.median(back_to_back[row["variant"]])
            row["useful_tflops"] = config.useful_flops(True) / (row["step_back_to_back_ms"] * 1e-3) / 1e12
    by_variant = {r["variant"]: r for r in rows}
    if "step" in fns and "layer" in fns:
        by_variant["step"]["step_over_layer"] = (by_variant["step"]["step_back_to_back_ms"]
                                                 / by_variant["layer"]["step_back_to_back_ms"])
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["mixtral", "qwen3", "deepseek"])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--reps", type=int, default=10, help="interleaved repetitions (median reported)")
    parser.add_argument("--calls", type=int, default=5, help="steps issued back to back per timed repetition")
    parser.add_argument("--dense-max-gflop", type=float, default=4000.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    device = jax.devices()[0]
    rows = []
    for name in args.configs:
        rows += run_config(CONFIGS[name], args.variants, args.reps, args.calls, args.dense_max_gflop)
        for row in rows[-len(args.variants):]:
            log.info("%s", json.dumps(row))
        jax.clear_caches()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = {"device": device.device_kind, "platform": device.platform, "date": date, "jax": jax.__version__,
              "step": "value_and_grad of mean((layer(params, x) - target)^2) over params, then SGD; bf16",
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"train_step_{device.device_kind.replace(' ', '_')}_{date[:10]}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"device {device.device_kind}")
    print(f"{'config':10s} {'variant':8s} {'step ms':>9s} {'b2b ms':>9s} {'step/layer':>10s} {'param diff':>10s}")
    for row in rows:
        if "skipped" in row:
            print(f"{row['config']:10s} {row['variant']:8s} skipped: {row['skipped']}")
            continue
        print(f"{row['config']:10s} {row['variant']:8s} {row.get('step_ms', float('nan')):9.2f} "
              f"{row.get('step_back_to_back_ms', float('nan')):9.2f} {row.get('step_over_layer', float('nan')):10.3f} "
              f"{row.get('max_param_rel_diff_vs_layer', float('nan')):10.2e}")
    return path


if __name__ == "__main__":
    main()
