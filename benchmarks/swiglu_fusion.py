"""Fused SwiGLU up-projection (gate and up grouped GEMMs in one pass) against the unfused products.

Two parts, in one process:

1. **Check**: on random data at each benchmark shape (bf16), the Triton ``swiglu_gmm`` (with and
   without its stored pre-activations; outputs poisoned with NaN first) against
   ``silu(gmm(x, Wg)) * gmm(x, Wu)`` from the float32-output Triton ``gmm``.
2. **Time**: ``moe_optimize`` of the zoo Mixtral-idiom dense layer, forward and forward+backward
   (gradients of every parameter and the input), in three variants of the rewrite's expert
   program: ``unfused`` (two grouped GEMMs + XLA's elementwise SwiGLU), ``fused_save`` (the fused
   kernel; the forward under differentiation also stores both pre-activations for the backward).
   (A third variant, the backward recomputing them, was measured at commit eaa1b18.) Variants are
   compiled once and timed in alternating rounds, so each median has a twin to show the noise.
   The isolated up-projection (fused kernel vs two ``gmm`` + the elementwise pass, forward) is
   timed the same way.

The variants are selected by patching ``moe_lowering.sparse_moe`` while the layer is traced (a
benchmark-only switch; the library fuses whenever the backend offers ``swiglu_gmm``). On a CPU
the fused variants run the jnp reference (``swiglu_gmm_reference``), which answers whether the
XLA backend should offer it.
Writes ``swiglu_fusion_<device>_<date>.json``; ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_lowering import moe_optimize, sparse_moe  # noqa: E402
from moe_lowering.kernels import get_backend, sequential_under_vmap  # noqa: E402
from moe_lowering.kernels.swiglu_gmm import swiglu_gmm_reference  # noqa: E402
from moe_lowering.testing.zoo import Sizes, build_mixtral  # noqa: E402

log = logging.getLogger("swiglu_fusion")

CONFIGS = {
    "small": Sizes(T=256, d=128, f=256, E=8, k=2),
    "mixtral": Sizes(T=8192, d=4096, f=14336, E=8, k=2),
    "qwen3": Sizes(T=16384, d=2048, f=768, E=128, k=8),
    "deepseek": Sizes(T=4096, d=7168, f=2048, E=256, k=8),
}
VARIANTS = ("unfused", "fused_save")


@contextlib.contextmanager
def variant(name: str):
    """Traces the rewrite's expert program as ``name`` (see the module docstring)."""
    real_get_backend = sparse_moe.get_backend

    def patched_backend(backend):
        kernels = real_get_backend(backend)
        fused = None if name == "unfused" else _fused_kernel(kernels)
        return dataclasses.replace(kernels, swiglu_gmm=fused)

    sparse_moe.get_backend = patched_backend
    try:
        yield
    finally:
        sparse_moe.get_backend = real_get_backend


def _fused_kernel(kernels):
    """The backend's fused kernel; the Triton one, or the jnp reference, where it offers none."""
    if kernels.swiglu_gmm is not None:
        return kernels.swiglu_gmm
    if kernels.name == "triton":
        from moe_lowering.kernels.swiglu_gmm.triton_launch import swiglu_gmm

        return sequential_under_vmap(swiglu_gmm)
    return swiglu_gmm_reference


def _time_ms(compiled, args, reps: int) -> float:
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _peak_bytes(compiled):
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
               - analysis.alias_size_in_bytes)


@jax.jit
def _squared_norms(got, want):
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.sum(jnp.square(got - want)), jnp.sum(jnp.square(want))


def _relative_error(got, want) -> float:
    """``|got - want| / |want|`` reduced on the device (NaN if any element of ``got`` is NaN)."""
    diff, ref = (float(v) for v in _squared_norms(got, want))
    return float(np.sqrt(diff / max(ref, 1e-30)))


def _routed_operands(sizes: Sizes, key):
    """Sorted rows, weights and on-device group sizes of a random top-k routing at ``sizes``."""
    keys = jax.random.split(key, 4)
    rows = sizes.T * sizes.k
    x = jax.random.normal(keys[0], (rows, sizes.d), jnp.float32).astype(jnp.bfloat16)
    scale = sizes.d ** -0.5
    w_gate = (jax.random.normal(keys[1], (sizes.E, sizes.d, sizes.f), jnp.float32) * scale).astype(jnp.bfloat16)
    w_up = (jax.random.normal(keys[2], (sizes.E, sizes.d, sizes.f), jnp.float32) * scale).astype(jnp.bfloat16)
    experts = jax.random.randint(keys[3], (rows,), 0, sizes.E)
    group_sizes = jnp.zeros((sizes.E,), jnp.int32).at[experts].add(1)
    return x, w_gate, w_up, group_sizes


def check_and_time_op(name: str, sizes: Sizes, reps: int) -> dict:
    """Fused ``swiglu_gmm`` vs ``silu(gmm) * gmm`` at one layer's shape: error and forward time.

    ``fused_wide`` is the fused kernel with full-width (256-column) tiles, 3 stages, to see whether
    the halved tile of the table costs the small-group shapes their ``lhs`` reuse (64-row tiles
    only; elsewhere it is the table's tile again, a second timing of ``fused``).
    """
    from moe_lowering.kernels.swiglu_gmm.triton_launch import swiglu_config, swiglu_gmm

    kernels = dataclasses.replace(get_backend("triton"), swiglu_gmm=swiglu_gmm)
    x, w_gate, w_up, group_sizes = _routed_operands(sizes, jax.random.key(11))
    shape = (x.shape[0], sizes.f)

    def unfused(x, w_gate, w_up, group_sizes):
        return (jax.nn.silu(kernels.gmm(x, w_gate, group_sizes)) * kernels.gmm(x, w_up, group_sizes))

    def fused(x, w_gate, w_up, group_sizes):
        return kernels.swiglu_gmm(x, w_gate, w_up, group_sizes)

    def fused_with_preactivations(x, w_gate, w_up, group_sizes):
        return kernels.swiglu_gmm(x, w_gate, w_up, group_sizes, with_preactivations=True)

    def reference(x, w_gate, w_up, group_sizes):
        gate = kernels.gmm(x, w_gate, group_sizes, preferred_element_type=jnp.float32)
        up = kernels.gmm(x, w_up, group_sizes, preferred_element_type=jnp.float32)
        return jax.nn.silu(gate) * up, gate, up

    args = (x, w_gate, w_up, group_sizes)
    want, want_gate, want_up = jax.jit(reference)(*args)
    row = {"config": name}
    compiled = {}
    table = swiglu_config(x.shape[0], sizes.d, sizes.f, sizes.E, False)
    # 64 x 256 x 64 with two weight blocks, 3 stages: 216 KB of shared memory (local sm_90 compile);
    # 128-row tiles that wide exceed the 227 KB limit and spill their two accumulators.
    wide = dataclasses.replace(table, block_n=256, num_stages=3) if table.block_m == 64 else table

    def fused_wide(x, w_gate, w_up, group_sizes):
        return swiglu_gmm(x, w_gate, w_up, group_sizes, config=wide)

    row["fused_wide_config"] = dataclasses.asdict(wide)
    for label, fn in (("unfused", unfused), ("fused", fused), ("fused_with_preactivations", fused_with_preactivations),
                      ("fused_wide", fused_wide)):
        compiled[label] = jax.jit(fn).lower(*args).compile()
        jnp.full(shape, jnp.nan, jnp.bfloat16).block_until_ready()  # freed: the next output lands on NaNs
        got = compiled[label](*args)
        if label == "fused_with_preactivations":
            got, gate, up = got
            row["err_gate"] = _relative_error(gate.astype(jnp.float32), want_gate)
            row["err_up"] = _relative_error(up.astype(jnp.float32), want_up)
        row[f"err_{label}"] = _relative_error(got.astype(jnp.float32), want)
    del want, want_gate, want_up
    gc.collect()
    for round_ in range(2):
        for label, exe in compiled.items():
            row[f"{label}_ms_{round_}"] = _time_ms(exe, args, reps)
    flops = 4.0 * x.shape[0] * sizes.d * sizes.f
    row["fused_tflops"] = flops / (min(row["fused_ms_0"], row["fused_ms_1"]) * 1e-3) / 1e12
    row["unfused_tflops"] = flops / (min(row["unfused_ms_0"], row["unfused_ms_1"]) * 1e-3) / 1e12
    return row


def _fwd_bwd(fn):
    def loss(params, x, cotangent):
        return jnp.sum(fn(params, x).astype(jnp.float32) * cotangent)

    return jax.value_and_grad(loss, argnums=(0, 1))


def time_layer(name: str, sizes: Sizes, reps: int, variants=VARIANTS) -> list[dict]:
    """``moe_optimize`` of the dense layer in every variant: forward, forward+backward, peak bytes, errors."""
    model = build_mixtral(sizes)
    params, x = model.args(jax.random.key(1), jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    layer = moe_optimize(model.fn)
    forward, both = {}, {}
    for label in variants:
        with variant(label):  # a fresh function per variant: jit caches traces by function
            forward[label] = jax.jit(lambda params, x: layer(params, x)).lower(params, x).compile()
            both[label] = jax.jit(_fwd_bwd(layer)).lower(params, x, cotangent).compile()
    rows = {label: {"config": name, "variant": label, "peak_bytes": _peak_bytes(both[label])} for label in variants}
    want = forward["unfused"](params, x)
    _, want_grads = both["unfused"](params, x, cotangent)
    for label in variants[1:]:
        rows[label]["rel_error_vs_unfused"] = _relative_error(forward[label](params, x).astype(jnp.float32),
                                                              want.astype(jnp.float32))
        _, grads = both[label](params, x, cotangent)
        rows[label]["grad_rel_error_vs_unfused"] = max(
            _relative_error(g.astype(jnp.float32), w.astype(jnp.float32))
            for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)))
        del grads
    del want, want_grads
    gc.collect()
    for round_ in range(2):
        for label in variants:
            rows[label][f"fwd_ms_{round_}"] = _time_ms(forward[label], (params, x), reps)
            rows[label][f"fwdbwd_ms_{round_}"] = _time_ms(both[label], (params, x, cotangent), reps)
    return list(rows.values())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["mixtral", "qwen3", "deepseek"])
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per round (median kept)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="layer variants to time; the first is the one the others are checked against")
    parser.add_argument("--skip-op", action="store_true", help="time only the layers (no isolated-kernel check)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    result = {"device": device.device_kind, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "jax": jax.__version__, "ops": [], "layers": []}
    for name in args.configs:
        if on_gpu and not args.skip_op:
            row = check_and_time_op(name, CONFIGS[name], args.reps)
            log.info("op %s", json.dumps(row))
            result["ops"].append(row)
            gc.collect()
        for row in time_layer(name, CONFIGS[name], args.reps, tuple(args.variants)):
            log.info("layer %s", json.dumps(row))
            result["layers"].append(row)
        gc.collect()
        jax.clear_caches()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"swiglu_fusion_{device.device_kind.replace(' ', '_')}_{result['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=1))
    print_table(result)


def print_table(result):
    print(f"device {result['device']}")
    for row in result["ops"]:
        print(f"op {row['config']:9s} err fused {row['err_fused']:.1e} "
              f"(+pre {row['err_fused_with_preactivations']:.1e},"
              f" gate {row['err_gate']:.1e}, up {row['err_up']:.1e}) unfused {row['err_unfused']:.1e} | ms unfused "
              f"{row['unfused_ms_0']:.3f}/{row['unfused_ms_1']:.3f}"
              f" fused {row['fused_ms_0']:.3f}/{row['fused_ms_1']:.3f}"
              f" +pre {row['fused_with_preactivations_ms_0']:.3f}/{row['fused_with_preactivations_ms_1']:.3f}"
              f" wide {row['fused_wide_ms_0']:.3f}/{row['fused_wide_ms_1']:.3f} (err {row['err_fused_wide']:.1e})")
    for row in result["layers"]:
        err = (f" err {row['rel_error_vs_unfused']:.1e} grad {row['grad_rel_error_vs_unfused']:.1e}"
               if "rel_error_vs_unfused" in row else "")
        print(f"layer {row['config']:9s} {row['variant']:16s} fwd {row['fwd_ms_0']:8.3f}/{row['fwd_ms_1']:8.3f} "
              f"f+b {row['fwdbwd_ms_0']:8.3f}/{row['fwdbwd_ms_1']:8.3f} peak {(row['peak_bytes'] or 0) / 1e9:6.2f} GB"
              + err)


if __name__ == "__main__":
    main()
