"""Times one MoE layer (SwiGLU experts, softmax top-k router) under several implementations.

Implementations (``--impls``):

* ``dense``: the dense reference (``moe_lowering.testing.zoo`` Mixtral idiom: every expert on
  every token, ``[T, E, f]`` intermediates, a ``[T, E]`` combine);
* ``moe_optimize``: ``moe_lowering.moe_optimize(dense reference)`` when the package has it, else
  the sorted sparse MoE it emits (``moe_lowering.sparse_moe.sparse_moe`` with a SwiGLU expert
  program) called directly; the row's ``via`` field says which;
* ``ragged_dot``: a hand-written sorted MoE on ``jax.lax.ragged_dot`` (XLA's autodiff backward);
* ``tokamax``: the same sorted MoE on ``tokamax.ragged_dot`` (skipped when not importable).

Each row holds the median forward and forward+backward (gradients of every parameter and the
input) times, useful TFLOP/s, the percentage of a plain bf16 matmul measured in the same run, and
the peak bytes of the compiled forward+backward program (arguments + outputs + temporaries, from
XLA's memory analysis). Useful FLOPs count only the three expert matmuls on the ``T * k`` routed
rows: ``2 * T*k * d * f`` each, 3 forward (``6 T k d f``), twice that backward, so
``18 T k d f`` forward+backward; the router (``2 T d E``) is left out.

Writes ``moe_layer_<device>_<date>.json`` (schema: ``{"device", "date", "matmul_tflops", "rows":
[{"config", "impl", "fwd_ms", "fwdbwd_ms", "fwdbwd_tflops", "pct_of_matmul", "peak_bytes", ...}]}``)
and a PNG bar chart beside it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

log = logging.getLogger("moe_layer")


@dataclass(frozen=True)
class LayerConfig:
    """One MoE layer's sizes: tokens, model width, expert width, experts, experts per token."""

    name: str
    T: int
    d: int
    f: int
    E: int
    k: int

    def useful_flops(self, backward: bool) -> float:
        forward = 6.0 * self.T * self.k * self.d * self.f
        return 3.0 * forward if backward else forward


CONFIGS = {
    "small": LayerConfig("small", T=256, d=128, f=256, E=8, k=2),
    "mixtral": LayerConfig("mixtral", T=8192, d=4096, f=14336, E=8, k=2),
    "qwen3": LayerConfig("qwen3", T=16384, d=2048, f=768, E=128, k=8),
    "deepseek": LayerConfig("deepseek", T=4096, d=7168, f=2048, E=256, k=8),
}
IMPLS = ("dense", "moe_optimize", "ragged_dot", "tokamax")


def _route(params, x, k):
    """The zoo Mixtral router: softmax over experts, top k, renormalised weights."""
    probs = jax.nn.softmax((x @ params["router"]).astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, k)
    return weights / weights.sum(axis=-1, keepdims=True), idx


def _sorted_moe(ragged_dot, k):
    """A hand-written dropless sorted MoE on ``ragged_dot(lhs, rhs, group_sizes)``."""

    def layer(params, x):
        num_experts = params["router"].shape[-1]
        weights, idx = _route(params, x, k)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        inverse = jnp.argsort(order)
        group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
        rows = jnp.take(x, order // k, axis=0)
        gate = ragged_dot(rows, params["w_gate"], group_sizes)
        up = ragged_dot(rows, params["w_up"], group_sizes)
        out_rows = ragged_dot(jax.nn.silu(gate) * up, params["w_down"], group_sizes)
        copies = jnp.take(out_rows, inverse, axis=0).reshape(x.shape[0], k, -1)
        return jnp.einsum("tk,tkd->td", weights.astype(jnp.float32), copies.astype(jnp.float32)).astype(x.dtype)

    return layer


def _swiglu_program(dtype):
    """The SwiGLU expert program as the matcher would record it (primitives from real jaxprs)."""
    from moe_lowering.expert_program import (Elementwise, ExpertMatmul, ExpertProgram, ParamKind, RowInput,
                                             topological_nodes)

    probe = jnp.ones((2, 2), dtype)
    logistic = jax.make_jaxpr(jax.lax.logistic)(probe).eqns[0]
    mul = jax.make_jaxpr(jax.lax.mul)(probe, probe).eqns[0]
    row = RowInput()
    gate = ExpertMatmul(row, 0)
    up = ExpertMatmul(row, 1)
    silu = Elementwise(mul.primitive, tuple(mul.params.items()),
                       (gate, Elementwise(logistic.primitive, tuple(logistic.params.items()), (gate,))))
    hidden = Elementwise(mul.primitive, tuple(mul.params.items()), (silu, up))
    out = ExpertMatmul(hidden, 2)
    return ExpertProgram(output=out, param_kinds=(ParamKind.EXPERT_WEIGHT,) * 3, nodes=topological_nodes(out))


def _optimized_layer(dense_fn, k, dtype):
    """``(fn, via)``: ``moe_optimize(dense_fn)`` if available, else the sparse MoE it emits."""
    try:
        from moe_lowering import moe_optimize
    except ImportError:
        moe_optimize = None
    if moe_optimize is not None:
        return moe_optimize(dense_fn), "moe_optimize"
    from moe_lowering.sparse_moe import sparse_moe

    program = _swiglu_program(dtype)

    def layer(params, x):
        weights, idx = _route(params, x, k)
        return sparse_moe(x, idx, weights, [params["w_gate"], params["w_up"], params["w_down"]], program,
                          num_experts=params["router"].shape[-1])

    return layer, "sparse_moe (moe_optimize not importable)"


def _tokamax_ragged_dot():
    import tokamax

    def ragged_dot(lhs, rhs, group_sizes):
        return tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype)

    return ragged_dot


def _time_ms(compiled, args, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


BACK_TO_BACK_CALLS = 10


def _time_back_to_back_ms(compiled, args, reps: int, calls: int = BACK_TO_BACK_CALLS) -> float:
    """Median over ``reps`` of the time per call of ``calls`` calls issued back to back, one sync at
    the end: the GPU's time per step as a training loop (or ``triton.testing.do_bench``, which times
    each repetition between CUDA events) sees it, without ``_time_ms``'s per-call dispatch and sync."""
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):  # each output dropped as the next call is issued, as in a training loop
            out = compiled(*args)
        jax.block_until_ready(out)  # one stream: the last call done, all are
        times.append((time.perf_counter() - start) * 1e3 / calls)
        del out
    return statistics.median(times)


def _peak_bytes(compiled) -> int | None:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
               - analysis.alias_size_in_bytes)


def measure_matmul_tflops(size: int = 8192, reps: int = 20) -> float:
    """A plain ``[size, size] x [size, size]`` bf16 product on random data: the ceiling."""
    keys = jax.random.split(jax.random.key(0), 2)
    a = jax.random.normal(keys[0], (size, size), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(keys[1], (size, size), jnp.float32).astype(jnp.bfloat16)
    compiled = jax.jit(jnp.dot).lower(a, b).compile()
    return 2.0 * size**3 / (_time_ms(compiled, (a, b), reps, warmup=3) * 1e-3) / 1e12


def _fwd_bwd(fn):
    def loss(params, x, cotangent):
        return jnp.sum(fn(params, x).astype(jnp.float32) * cotangent)

    return jax.value_and_grad(loss, argnums=(0, 1))


def _fwd_vjp(fn):
    """``(params, x, dout) -> (out, (d_params, d_x))``: the forward and the backward from the output's
    cotangent ``dout`` (in the output's dtype), as a training step runs them and as SonicMoE's
    benchmark times ``o.backward(dout)``; ``_fwd_bwd``'s float32 loss adds a pass over the output
    and a cast of the cotangent."""

    def step(params, x, dout):
        out, pullback = jax.vjp(fn, params, x)
        return out, pullback(dout)

    return step


def bench_one(config: LayerConfig, impl: str, dense_fn, params, x, cotangent, reps: int, matmul_tflops: float,
              back_to_back: bool = False):
    """One implementation's forward and forward+backward times (``_time_ms``; with ``back_to_back``
    also ``_time_back_to_back_ms``), peak bytes and useful TFLOP/s."""
    row = {"config": config.name, "impl": impl, "T": config.T, "d": config.d, "f": config.f, "E": config.E,
           "k": config.k}
    if impl == "dense":
        fn = dense_fn
    elif impl == "moe_optimize":
        fn, row["via"] = _optimized_layer(dense_fn, config.k, x.dtype)
    elif impl == "ragged_dot":
        fn = _sorted_moe(lambda lhs, rhs, sizes: jax.lax.ragged_dot(lhs, rhs, sizes), config.k)
    elif impl == "tokamax":
        fn = _sorted_moe(_tokamax_ragged_dot(), config.k)
    else:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    forward = jax.jit(fn).lower(params, x).compile()
    row["fwd_ms"] = _time_ms(forward, (params, x), reps)
    if back_to_back:
        row["fwd_back_to_back_ms"] = _time_back_to_back_ms(forward, (params, x), reps)
    del forward
    both = jax.jit(_fwd_bwd(fn)).lower(params, x, cotangent).compile()
    row["peak_bytes"] = _peak_bytes(both)
    row["fwdbwd_ms"] = _time_ms(both, (params, x, cotangent), reps)
    if back_to_back:
        row["fwdbwd_back_to_back_ms"] = _time_back_to_back_ms(both, (params, x, cotangent), reps)
    row["fwd_tflops"] = config.useful_flops(False) / (row["fwd_ms"] * 1e-3) / 1e12
    row["fwdbwd_tflops"] = config.useful_flops(True) / (row["fwdbwd_ms"] * 1e-3) / 1e12
    row["pct_of_matmul"] = 100.0 * row["fwdbwd_tflops"] / matmul_tflops
    return row


def check_against_dense(config: LayerConfig, impl_fn, dense_fn, params, x) -> float:
    """Relative error of an implementation's output against the dense reference's."""
    got = jax.jit(impl_fn)(params, x).astype(jnp.float32)
    want = jax.jit(dense_fn)(params, x).astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def run(config_names, impls, reps: int, out_dir: Path, dense_max_gflop: float, back_to_back: bool = False):
    from moe_lowering.testing.zoo import Sizes, build_mixtral

    device = jax.devices()[0]
    matmul_tflops = measure_matmul_tflops() if device.platform == "gpu" else measure_matmul_tflops(1024, 5)
    log.info("bf16 matmul ceiling on %s: %.1f TFLOP/s", device.device_kind, matmul_tflops)
    rows = []
    for name in config_names:
        config = CONFIGS[name]
        model = build_mixtral(Sizes(T=config.T, d=config.d, f=config.f, E=config.E, k=config.k))
        params, x = model.args(jax.random.key(1), jnp.bfloat16)
        cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
        for impl in impls:
            dense_gflop = 6.0 * config.T * config.E * config.d * config.f / 1e9
            if impl == "dense" and dense_gflop > dense_max_gflop:
                rows.append({"config": name, "impl": impl, "skipped": f"dense forward is {dense_gflop:.0f} GFLOP"})
                continue
            try:
                row = bench_one(config, impl, model.fn, params, x, cotangent, reps, matmul_tflops, back_to_back)
            except ImportError as err:
                row = {"config": name, "impl": impl, "skipped": f"not importable: {err}"}
            except Exception as err:  # noqa: BLE001 - a failing baseline (OOM, missing package) is a result
                log.warning("%s/%s failed: %s", name, impl, err)
                row = {"config": name, "impl": impl, "error": f"{type(err).__name__}: {str(err)[:300]}"}
            rows.append(row)
            log.info("%s", json.dumps(row))
            gc.collect()
        if "moe_optimize" in impls:
            fn, _ = _optimized_layer(model.fn, config.k, x.dtype)
            try:
                error = check_against_dense(config, fn, model.fn, params, x)
                log.info("%s: moe_optimize vs dense relative error %.2e", name, error)
                for row in rows:
                    if row["config"] == name and row["impl"] == "moe_optimize":
                        row["rel_error_vs_dense"] = error
            except Exception as err:  # noqa: BLE001
                log.warning("%s: dense comparison failed: %s", name, err)
        del params, x, cotangent
        gc.collect()
        jax.clear_caches()

    result = {
        "device": device.device_kind,
        "platform": device.platform,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "matmul_tflops": matmul_tflops,
        "flops_counted": "18*T*k*d*f forward+backward, 6*T*k*d*f forward (expert matmuls only)",
        "peak_bytes_counted": "compiled forward+backward: arguments + outputs + temporaries - aliased",
        "rows": rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"moe_layer_{device.device_kind.replace(' ', '_')}_{result['date'][:10]}"
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=1))
    plot(result, out_dir / f"{stem}.png")
    print_table(result)
    return json_path


def print_table(result):
    print(f"device {result['device']}  matmul ceiling {result['matmul_tflops']:.0f} TFLOP/s")
    print(f"{'config':10s} {'impl':13s} {'fwd ms':>9s} {'f+b ms':>9s} {'TFLOP/s':>8s} {'%mm':>6s} {'peak GB':>8s}")
    for row in result["rows"]:
        if "fwdbwd_ms" not in row:
            print(f"{row['config']:10s} {row['impl']:13s} {row.get('error') or row.get('skipped')}")
            continue
        peak = (row["peak_bytes"] or 0) / 1e9
        print(f"{row['config']:10s} {row['impl']:13s} {row['fwd_ms']:9.2f} {row['fwdbwd_ms']:9.2f} "
              f"{row['fwdbwd_tflops']:8.1f} {row['pct_of_matmul']:6.1f} {peak:8.2f}")


def plot(result, path: Path):
    """Bar chart of forward+backward TFLOP/s per config and implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib missing: no chart written")
        return
    rows = [r for r in result["rows"] if "fwdbwd_tflops" in r]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    width = 0.8 / len(IMPLS)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, impl in enumerate(IMPLS):
        values = [next((r["fwdbwd_tflops"] for r in rows if r["config"] == c and r["impl"] == impl), 0.0)
                  for c in configs]
        ax.bar([j + i * width for j in range(len(configs))], values, width, label=impl)
    ax.axhline(result["matmul_tflops"], color="k", linestyle="--", linewidth=1, label="bf16 matmul")
    ax.set_xticks([j + width * (len(IMPLS) - 1) / 2 for j in range(len(configs))], configs)
    ax.set_ylabel("useful TFLOP/s, forward+backward")
    ax.set_title(f"MoE layer, {result['device']}, {result['date'][:10]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["mixtral", "qwen3", "deepseek"])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement (median kept)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    parser.add_argument("--dense-max-gflop", type=float, default=float("inf"),
                        help="skip the dense reference above this many forward GFLOP (it computes every expert)")
    parser.add_argument("--plot-only", type=Path, help="redraw the chart and table of an existing JSON and exit")
    parser.add_argument("--back-to-back", action="store_true",
                        help=f"also time {BACK_TO_BACK_CALLS} calls issued back to back with one sync (the GPU's time "
                             "per step, as a training loop sees it)")
    parser.add_argument("--weight-gradient", choices=("auto", "streamed", "triton"), default="auto",
                        help="the backend's weight-gradient kernel: its own choice (the Hopper Gluon kernel where it "
                             "applies, with a resident dout for small groups), the Gluon kernel streaming both "
                             "operands at every group size, or Triton's kernels only (A/Bs of those choices)")
    parser.add_argument("--forward-products", choices=("auto", "triton"), default="auto",
                        help="the backend's forward-kernel products (gmm, gmm_pair, gmm_sum: the forward and the input "
                             "gradient): its own choice (the Hopper Gluon kernels where they apply) or Triton's "
                             "gmm_kernel only (the A/B of that choice)")
    args = parser.parse_args(argv)
    if args.forward_products == "triton":
        from moe_lowering.kernels.grouped_matmul_sm90 import jax_launch

        jax_launch.gmm_applies = lambda *_, **__: False
    if args.weight_gradient != "auto":
        from moe_lowering.kernels.grouped_matmul_sm90 import jax_launch

        if args.weight_gradient == "triton":
            jax_launch.tgmm_applies = lambda *_, **__: False
        jax_launch.RESIDENT_MAX_MEAN_ROWS = 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if args.plot_only:
        result = json.loads(args.plot_only.read_text())
        plot(result, args.plot_only.with_suffix(".png"))
        print_table(result)
        return
    run(args.configs, args.impls, args.reps, args.out, args.dense_max_gflop, args.back_to_back)


if __name__ == "__main__":
    main()
