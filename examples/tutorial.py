"""The runnable twin of ``docs/tutorial.md``: a Flax dense MoE, found, rewritten, checked, timed, sharded.

Run: ``python examples/tutorial.py`` (CPU, small sizes, under a minute on 2 cores). Each section
prints what the tutorial shows and asserts what it claims. ``--out benchmarks/results`` also
writes the CPU timings, with device and date, as ``tutorial_cpu_<date>.json`` (the file the
tutorial quotes). Four host CPU devices stand in for a 2x2 mesh: the flag below must be set
before JAX starts.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from moe_lowering import __version__, explain, moe_optimize  # noqa: E402
from moe_lowering.cli import main as moe_rewrite  # noqa: E402

REPOSITORY = Path(__file__).resolve().parents[1]

# Tokens are [batch, seq, d_model]: 8 x 64 = 512 tokens, 16 experts of width 128, top-2.
BATCH, SEQ, D_MODEL, D_FF, NUM_EXPERTS, TOP_K = 8, 64, 64, 128, 16, 2


# --------------------------------------------------------------------------- 1. the model, as people write it
class MoE(nnx.Module):
    """A Mixtral-style block in Flax NNX: every expert on every token, then the top-k gate."""

    def __init__(self, d_model, d_ff, num_experts, top_k, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.router = nnx.Linear(d_model, num_experts, use_bias=False, rngs=rngs)
        self.w_gate = nnx.Param(init(rngs.params(), (num_experts, d_model, d_ff)))
        self.w_up = nnx.Param(init(rngs.params(), (num_experts, d_model, d_ff)))
        self.w_down = nnx.Param(init(rngs.params(), (num_experts, d_ff, d_model)))
        self.num_experts, self.top_k = num_experts, top_k

    def __call__(self, x):  # [batch, seq, d_model]
        probs = jax.nn.softmax(self.router(x), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        weights = weights / weights.sum(-1, keepdims=True)
        gates = (jax.nn.one_hot(experts, self.num_experts) * weights[..., None]).sum(-2)  # [b, s, E]
        hidden = nnx.silu(jnp.einsum("bsd,edf->bsef", x, self.w_gate[...]))
        hidden = hidden * jnp.einsum("bsd,edf->bsef", x, self.w_up[...])
        out = jnp.einsum("bsef,efd->bsed", hidden, self.w_down[...])  # every expert's output
        return jnp.einsum("bse,bsed->bsd", gates, out)


class Expert(nn.Module):
    """One SwiGLU expert in Flax Linen."""

    d_ff: int

    @nn.compact
    def __call__(self, x):
        gate = nn.silu(nn.Dense(self.d_ff, use_bias=False, name="gate")(x))
        up = nn.Dense(self.d_ff, use_bias=False, name="up")(x)
        return nn.Dense(x.shape[-1], use_bias=False, name="down")(gate * up)


class LinenMoE(nn.Module):
    """The same block in Linen: the experts are one ``Expert`` lifted over an expert axis by ``nn.vmap``."""

    d_ff: int
    num_experts: int
    top_k: int

    @nn.compact
    def __call__(self, x):
        probs = jax.nn.softmax(nn.Dense(self.num_experts, use_bias=False, name="router")(x))
        weights, experts = jax.lax.top_k(probs, self.top_k)
        weights = weights / weights.sum(-1, keepdims=True)
        gates = (jax.nn.one_hot(experts, self.num_experts) * weights[..., None]).sum(-2)
        all_experts = nn.vmap(Expert, variable_axes={"params": 0}, split_rngs={"params": True},
                              in_axes=None, out_axes=-2, axis_size=self.num_experts)(self.d_ff, name="experts")
        return jnp.einsum("bse,bsed->bsd", gates, all_experts(x))  # all_experts(x): [b, s, E, d]


def loss(forward):
    return lambda params, x: jnp.mean(forward(params, x) ** 2)


def relative_error(reference, value):
    return float(jnp.linalg.norm(reference - value) / jnp.linalg.norm(reference))


def check_against(reference_forward, rewritten_forward, params, x, tolerance):
    """Relative errors of the output and of every parameter gradient, each asserted under ``tolerance``."""
    errors = {"output": relative_error(reference_forward(params, x), rewritten_forward(params, x))}
    reference_grads = jax.grad(loss(reference_forward))(params, x)
    grads = jax.jit(jax.grad(loss(rewritten_forward)))(params, x)
    paths = jax.tree_util.tree_flatten_with_path(reference_grads)[0]
    for (path, reference), value in zip(paths, jax.tree_util.tree_leaves(grads)):
        errors[f"grad{jax.tree_util.keystr(path)}"] = relative_error(reference, value)
    for name, error in errors.items():
        print(f"  {name:40s} relative error {error:.1e}")
        assert error < tolerance, (name, error)
    return errors


def in_repository(text):
    """``text`` with this checkout's paths made relative to it, for the result file."""
    return text.replace(f"{REPOSITORY}/", "")


def interleaved_median_ms(fns, *args, reps):
    """Median wall time in ms of each ``fns[name](*args)``, after one call each that compiles it.

    The calls alternate (a, b, a, b, ...), so load from other work on the machine slows both sides
    alike instead of whichever happened to run while it lasted.
    """
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(samples) for name, samples in times.items()}


class LogRecords(logging.Handler):
    """Keeps the ``moe_lowering`` log lines, for the result file."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the CPU timings as tutorial_cpu_<date>.json in this folder")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per measurement (median reported)")
    args = parser.parse_args()
    started_wall, started_cpu = time.perf_counter(), time.process_time()

    # ----------------------------------------------------------------------- 1. the model
    model = MoE(D_MODEL, D_FF, NUM_EXPERTS, TOP_K, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)  # the functional form every JAX transform takes

    def forward(params, x):
        return nnx.merge(graphdef, params)(x)

    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, D_MODEL))

    # ----------------------------------------------------------------------- 2. explain
    print("== 2. explain")
    report = explain(forward, params, x)
    print(report)
    assert len(report.regions) == 1
    record = {"explain": in_repository(str(report))}

    # ----------------------------------------------------------------------- 3. moe_optimize, checked
    print("\n== 3. moe_optimize: outputs and gradients against the undecorated model")
    sparse_forward = moe_optimize(forward)
    print(" NNX:")
    record["errors_nnx"] = check_against(forward, sparse_forward, params, x, tolerance=1e-5)

    linen_model = LinenMoE(D_FF, NUM_EXPERTS, TOP_K)
    linen_params = jax.jit(linen_model.init)(jax.random.key(0), x)["params"]

    def linen_forward(params, x):
        return linen_model.apply({"params": params}, x)

    print(" Linen:")
    assert len(explain(linen_forward, linen_params, x).regions) == 1
    record["errors_linen"] = check_against(linen_forward, moe_optimize(linen_forward), linen_params, x, tolerance=1e-5)

    # ----------------------------------------------------------------------- 4. CPU timings
    print(f"\n== 4. CPU timings (median of {args.reps}, dense and rewritten calls alternated, ms)")
    grad_of = lambda fn: jax.jit(jax.grad(loss(fn)))  # noqa: E731
    timings = {
        **interleaved_median_ms({"forward_dense_ms": jax.jit(forward),
                                 "forward_moe_optimize_ms": jax.jit(sparse_forward)}, params, x, reps=args.reps),
        **interleaved_median_ms({"fwdbwd_dense_ms": grad_of(forward),
                                 "fwdbwd_moe_optimize_ms": grad_of(sparse_forward)}, params, x, reps=args.reps),
    }
    load_average = os.getloadavg()[0]  # other work on the machine slows the timings
    for name, ms in timings.items():
        print(f"  {name:28s} {ms:8.2f}")
    print(f"  forward {timings['forward_dense_ms'] / timings['forward_moe_optimize_ms']:.1f}x, "
          f"forward+backward {timings['fwdbwd_dense_ms'] / timings['fwdbwd_moe_optimize_ms']:.1f}x faster")

    # ----------------------------------------------------------------------- 6. a 2x2 fsdp x expert mesh
    print("\n== 6. the same model on a 2x2 (fsdp, expert) mesh of host devices")
    mesh = jax.make_mesh((2, 2), ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])

    def placement(leaf):  # expert weights [E, d, f]: E over 'expert', d over 'fsdp'; the router replicated
        return NamedSharding(mesh, P("expert", "fsdp", None) if leaf.ndim == 3 else P())

    param_shardings = jax.tree.map(placement, params)
    token_sharding = NamedSharding(mesh, P(("fsdp", "expert")))  # the batch over all four devices
    placed_params, placed_x = jax.device_put((params, x), (param_shardings, token_sharding))
    sharded_forward = jax.jit(forward, in_shardings=(param_shardings, token_sharding))
    report = explain(sharded_forward, placed_params, placed_x)
    print(report)
    assert report.regions[0].parallel_layout.startswith("expert parallel over 'expert' (2 ranks x 8 experts)")
    record["explain_sharded"] = in_repository(str(report))
    expert_parallel = moe_optimize(sharded_forward)
    record["errors_sharded"] = check_against(
        forward, lambda p, x: expert_parallel(*jax.device_put((p, x), (param_shardings, token_sharding))),
        params, x, tolerance=1e-5)

    # ----------------------------------------------------------------------- 7. FP8 weight gathers
    print("\n== 7. FP8 weight gathers over 'fsdp'")
    fp8_gathers = moe_optimize(sharded_forward, weight_gather_quant="fp8_e4m3")
    compiled = fp8_gathers.lower(placed_params, placed_x).compile()
    fp8_error = relative_error(forward(params, x), compiled(placed_params, placed_x))
    print(f"  output relative error with fp8_e4m3 gathers: {fp8_error:.1e}")
    assert 1e-4 < fp8_error < 0.1  # quantised, and close
    gathers = [line for line in compiled.as_text().splitlines() if "all-gather" in line]
    assert any("u8[" in line for line in gathers)  # the weights travel as FP8 bytes
    record["error_fp8_e4m3_gathers"] = fp8_error

    # ----------------------------------------------------------------------- 8. capacity_factor
    print("\n== 8. capacity_factor: opt-in token dropping")
    dropping = moe_optimize(forward, capacity_factor=1.0)
    region = explain(dropping, params, x).regions[0]
    print(f"  capacity per expert: {region.capacity} token copies "
          f"(ceil(1.0 * {BATCH * SEQ} tokens * {TOP_K} / {NUM_EXPERTS}))")
    logging.basicConfig(format="%(message)s")
    log_records = LogRecords()
    package_logger = logging.getLogger("moe_lowering")
    package_logger.addHandler(log_records)
    package_logger.setLevel(logging.INFO)
    dropped_error = relative_error(forward(params, x), jax.jit(dropping)(params, x))
    package_logger.setLevel(logging.WARNING)
    package_logger.removeHandler(log_records)
    print(f"  output relative error against the dropless layer: {dropped_error:.1e}")
    assert dropped_error > 1e-4
    record.update(capacity=region.capacity, error_capacity_factor_1=dropped_error, log_capacity=log_records.lines)

    # ----------------------------------------------------------------------- 9. moe-rewrite on a dump
    print("\n== 9. moe-rewrite on the model's StableHLO")
    with tempfile.TemporaryDirectory() as folder:
        dump = Path(folder, "model.mlir")
        dump.write_text(jax.jit(forward).lower(params, x).as_text(debug_info=True))  # with source locations
        status = moe_rewrite([str(dump), "-o", str(Path(folder, "model.moe.mlir")),
                              "--report", str(Path(folder, "regions.json")), "--verify"])
        regions = json.loads(in_repository(Path(folder, "regions.json").read_text()))["regions"]
    assert status == 0 and len(regions) == 1, (status, regions)
    record["moe_rewrite_regions"] = regions

    if args.out:
        now = datetime.datetime.now(datetime.timezone.utc)
        result = {
            "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "date": now.isoformat(timespec="seconds"),
            "jax": jax.__version__,
            "moe_lowering": __version__,
            "command": " ".join(["python", "examples/tutorial.py", *sys.argv[1:]]),
            "sizes": {"batch": BATCH, "seq": SEQ, "d_model": D_MODEL, "d_ff": D_FF,
                      "num_experts": NUM_EXPERTS, "top_k": TOP_K, "dtype": "float32"},
            "reps": args.reps,
            "load_average_1min_after_timing": load_average,
            "timing": ("median wall ms of a jitted call after one compiling call, dense and moe_optimize calls "
                       "alternated; fwdbwd = jax.grad of mean(out**2)"),
            **timings,
            **record,
            "script_wall_s": time.perf_counter() - started_wall,
            "script_cpu_s": time.process_time() - started_cpu,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"tutorial_cpu_{now.date().isoformat()}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
