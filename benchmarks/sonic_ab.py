"""Same-run A/B of kernel-backend variants on SonicMoE's layer shapes, with a per-kernel profile.

Each variant is a ``KernelBackend`` built from the Triton one (``base``: no fused SwiGLU product, no
``gmm_sum``, no gathered products and XLA's gathers: the backend before issue 20; ``new``: the backend as it
is; ``apart``: ``new`` with the last product and the combine apart (no ``gather_gmm`` / ``gather_tgmm``, so no
``expert_combine``); ``permuted``: ``new`` with the up projection reading the permuted copy of the tokens (no
``gather_swiglu_gmm``); ``keptcopy``: ``new`` whose training step keeps the permuted copy of the tokens
for the up projection's weight gradients (no ``gather_lhs_tgmm``); ``gradstages``: ``new`` with
``gather_tgmm`` asking for two more pipeline stages, ``triton_launch.GATHERED_GRAD_EXTRA_STAGES``;
``nosum``: ``new`` without ``gmm_sum``; ``pair``: ``new`` with the fused kernel off, ``gmm_pair`` for every
width; ``xlagather``: ``new`` with ``permute`` and ``spread`` left to XLA's gather;
``wide``: ``new`` with the fused SwiGLU kernel for experts up to 2048 wide; ``unflattened``: ``new`` with
``gmm_kernel``'s tile loop not flattened into its K loop, ``TileConfig.flatten``; ``rows64``: ``new`` with
groups of 128-255 rows on the 64-row tiles, ``triton_launch.FULL_TILE_MIN_ROWS``; ``combine512`` /
``combine1024``: ``new`` with the last product and the combine as one piece up to that width,
``sparse_moe.COMBINE_IN_LAST_PRODUCT_MAX_WIDTH``). The rewritten layer (``moe_optimize`` of the zoo's
Mixtral-idiom dense reference, as ``sonic.py`` runs it) is compiled per variant, checked against ``base``
(relative error of the output and of every gradient), and timed forward and forward+backward in alternating
rounds (median of ``--reps`` per round), so every variant sees the same machine state. Forward+backward is
``moe_layer._fwd_vjp``, pulled back from a bf16 output cotangent as SonicMoE's benchmark runs
``o.backward(dout)``. ``--pipelined`` also times calls issued back to back
(``moe_layer._time_back_to_back_ms``: one sync per ten calls, as a training loop runs), which leaves out the
per-call dispatch and sync. ``--profile`` adds the GPU time per kernel of one forward and one forward+backward
step (``jax.profiler``) for each variant, with the step's busy GPU time and its idle time between kernels.

    python benchmarks/sonic_ab.py --shapes 1.4B-n256 7B-n256 --variants base new --out /tmp/ab

``--shapes`` also takes the layer configs of ``moe_layer.py`` (``qwen3``, ``mixtral``, ``deepseek``): the same
A/B on them, with no SonicMoE column.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_layer  # noqa: E402
from sonic import SHAPES as SONIC_SHAPES, SonicShape  # noqa: E402

log = logging.getLogger("sonic_ab")
SHAPES = SONIC_SHAPES | {name: SonicShape(name, c.T, c.d, c.f, c.E, c.k, math.nan, math.nan)
                         for name, c in moe_layer.CONFIGS.items() if name != "small"}
"""SonicMoE's twelve shapes, and the layer configs of ``moe_layer.py`` (no SonicMoE numbers: ratio NaN)."""
VARIANTS = ("base", "new", "apart", "permuted", "keptcopy", "gradstages", "nosum", "pair", "xlagather", "wide",
            "unflattened", "rows64", "combine512", "combine1024")
WIDE_MAX_N = 2048


def backend_for(variant: str):
    from moe_lowering.kernels import get_backend
    from moe_lowering.kernels.swiglu_gmm import triton_launch as swiglu_launch

    triton = get_backend("triton")
    if variant == "base":
        return dataclasses.replace(triton, name="triton-base", swiglu_gmm=None, gmm_sum=None, gather_gmm=None,
                                   gather_tgmm=None, gather_swiglu_gmm=None)
    if variant == "permuted":  # the up projection of the permuted copy of the tokens
        return dataclasses.replace(triton, name="triton-permuted", gather_swiglu_gmm=None)
    if variant == "keptcopy":  # the weight gradients of the up projection read a kept permuted copy
        return dataclasses.replace(triton, name="triton-keptcopy", gather_lhs_tgmm=None)
    if variant == "apart":  # the last product and the combine apart (no expert_combine)
        return dataclasses.replace(triton, name="triton-apart", gather_gmm=None, gather_tgmm=None)
    if variant in ("new", "xlagather", "unflattened", "rows64", "gradstages", "combine512", "combine1024"):
        return triton
    if variant == "wide":
        return dataclasses.replace(triton, name="triton-wide", swiglu_gmm_max_n=WIDE_MAX_N,
                                   swiglu_gmm=_with_fused_max_n(triton.swiglu_gmm, WIDE_MAX_N),
                                   gather_swiglu_gmm=_with_fused_max_n(triton.gather_swiglu_gmm, WIDE_MAX_N))
    if variant == "nosum":
        return dataclasses.replace(triton, name="triton-nosum", gmm_sum=None)
    if variant == "pair":
        return dataclasses.replace(triton, name="triton-pair",
                                   swiglu_gmm=_with_fused_max_n(swiglu_launch.swiglu_gmm_or_pair, 0))
    raise ValueError(variant)


def _with_fused_max_n(launcher, max_n: int):
    """``launcher`` run (traced) with ``swiglu_gmm.triton_launch.FUSED_MAX_N`` set to ``max_n``."""
    from moe_lowering.kernels.swiglu_gmm import triton_launch as swiglu_launch

    def launch(*args, **kwargs):
        saved, swiglu_launch.FUSED_MAX_N = swiglu_launch.FUSED_MAX_N, max_n
        try:
            return launcher(*args, **kwargs)
        finally:
            swiglu_launch.FUSED_MAX_N = saved

    return launch


def layer_for(variant: str, dense_fn, k, dtype):
    """``moe_optimize(dense_fn)`` whose sparse MoE runs on ``variant``'s backend."""
    import moe_lowering.sparse_moe as sparse_moe

    backend = backend_for(variant)
    fn, _ = moe_layer._optimized_layer(dense_fn, k, dtype)

    def layer(params, x):
        saved = sparse_moe.get_backend
        sparse_moe.get_backend = lambda name: backend
        try:
            return fn(params, x)
        finally:
            sparse_moe.get_backend = saved

    return layer


@jax.jit
def _squared_norms(a, b):
    """``(|a - b|^2, |b|^2)`` in float32, the casts fused into the sums (DeepSeek's weight gradients
    are 22.5 GB: a float32 copy of two of them does not fit beside the compiled variants)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.sum(jnp.square(a - b)), jnp.sum(jnp.square(b))


def _rel(a, b) -> float:
    diff, ref = _squared_norms(a, b)
    return math.sqrt(float(diff)) / max(math.sqrt(float(ref)), 1e-30)


def run(names, variants, reps: int, rounds: int, profile: bool, out_dir: Path, hlo: bool = False,
        pipelined: bool = False):
    from ep_overlap import profile_summary
    from moe_lowering import primitives, sparse_moe
    from moe_lowering.kernels.grouped_matmul import triton_launch as tgm
    from moe_lowering.testing.zoo import Sizes, build_mixtral

    out_dir.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    rows = []
    for name in names:
        shape = SHAPES[name]
        model = build_mixtral(Sizes(T=shape.T, d=shape.d, f=shape.n, E=shape.E, k=shape.K))
        params, x = model.args(jax.random.key(1), jnp.bfloat16)
        cotangent = jax.random.normal(jax.random.key(2), x.shape, x.dtype)
        compiled, results = {}, {}
        for variant in variants:
            layer = layer_for(variant, model.fn, shape.K, x.dtype)
            primitives.GPU_ROW_GATHER = variant not in ("base", "xlagather")  # read when lowering
            tiles = tgm._WIDE_SHORT_K, tgm._WIDE  # read when lowering, as the flag above
            if variant in ("base", "unflattened"):
                tgm._WIDE_SHORT_K, tgm._WIDE = (dataclasses.replace(tile, flatten=False) for tile in tiles)
            full_tile_rows = tgm.FULL_TILE_MIN_ROWS  # read when lowering
            if variant == "rows64":
                tgm.FULL_TILE_MIN_ROWS = tgm.SMALL_GROUP_ROWS
            grad_stages = tgm.GATHERED_GRAD_EXTRA_STAGES  # read when lowering
            if variant == "gradstages":
                tgm.GATHERED_GRAD_EXTRA_STAGES = 2
            combine_width = sparse_moe.COMBINE_IN_LAST_PRODUCT_MAX_WIDTH
            if variant.startswith("combine"):
                sparse_moe.COMBINE_IN_LAST_PRODUCT_MAX_WIDTH = int(variant.removeprefix("combine"))
            try:
                fwd = jax.jit(layer).lower(params, x).compile()
                both = jax.jit(moe_layer._fwd_vjp(layer)).lower(params, x, cotangent).compile()
            finally:
                primitives.GPU_ROW_GATHER = True
                sparse_moe.COMBINE_IN_LAST_PRODUCT_MAX_WIDTH = combine_width
                tgm.FULL_TILE_MIN_ROWS = full_tile_rows
                tgm.GATHERED_GRAD_EXTRA_STAGES = grad_stages
                tgm._WIDE_SHORT_K, tgm._WIDE = tiles
            compiled[variant] = (fwd, both)
            if hlo:
                (out_dir / f"hlo_{name}_{variant}_fwd.txt").write_text(fwd.as_text())
                (out_dir / f"hlo_{name}_{variant}_fwdbwd.txt").write_text(both.as_text())
            out = fwd(params, x)
            _, grads = both(params, x, cotangent)
            results[variant] = (out, jax.tree_util.tree_leaves(grads))
        row = {"shape": name, "T": shape.T, "d": shape.d, "n": shape.n, "E": shape.E, "K": shape.K,
               "sonic_fwdbwd_ms": shape.sonic_fwdbwd_ms(),
               "sonic_fwd_ms": 1e3 * shape.flops(False) / (shape.sonic_fwd_tflops * 1e12), "variants": {}}
        ref_out, ref_grads = results[variants[0]]
        for variant in variants:
            out, grads = results[variant]
            row["variants"][variant] = {
                "rel_error_out": _rel(out, ref_out),
                "rel_error_grads": max(_rel(g, r) for g, r in zip(grads, ref_grads)),
                "finite": bool(jnp.isfinite(out).all()) and all(bool(jnp.isfinite(g).all()) for g in grads),
                "fwd_ms": [], "fwdbwd_ms": [], "peak_bytes": moe_layer._peak_bytes(compiled[variant][1]),
            }
        del results
        for _ in range(rounds):
            for variant in variants:
                fwd, both = compiled[variant]
                entry = row["variants"][variant]
                entry["fwd_ms"].append(moe_layer._time_ms(fwd, (params, x), reps))
                entry["fwdbwd_ms"].append(moe_layer._time_ms(both, (params, x, cotangent), reps))
                if pipelined:
                    entry.setdefault("fwd_pipelined_ms", []).append(
                        moe_layer._time_back_to_back_ms(fwd, (params, x), reps))
                    entry.setdefault("fwdbwd_pipelined_ms", []).append(
                        moe_layer._time_back_to_back_ms(both, (params, x, cotangent), reps))
        for variant in variants:
            entry = row["variants"][variant]
            entry["fwd_ms_best"] = min(entry["fwd_ms"])
            entry["fwdbwd_ms_best"] = min(entry["fwdbwd_ms"])
            entry["ratio_fwdbwd"] = row["sonic_fwdbwd_ms"] / entry["fwdbwd_ms_best"]
            if profile:
                fwd, both = compiled[variant]
                for key, fn, args in (("fwd", fwd, (params, x)), ("fwdbwd", both, (params, x, cotangent))):
                    summary = profile_summary(fn, args, out_dir / f"trace_{name}_{variant}_{key}", steps=3)
                    entry[f"profile_{key}"] = summary.get("top_kernels_ms")
                    entry[f"gpu_{key}"] = {
                        "busy_ms": summary.get("compute_ms"), "idle_inside_ms": summary.get("idle_inside_steps_ms"),
                        "kernels": sum(s["events"] for s in summary.get("streams", {}).values()) / 3}
        rows.append(row)
        (out_dir / "sonic_ab_partial.json").write_text(json.dumps(rows, indent=1))  # what a cut-off run keeps
        log.info("%s", json.dumps({k: v for k, v in row.items() if k != "variants"}))
        print_row(row)
        del compiled, params, x, cotangent
        jax.clear_caches()
    result = {"device": device.device_kind,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "variants": list(variants), "reps": reps, "rounds": rounds, "rows": rows}
    for variant in variants:
        ratios = [r["variants"][variant]["ratio_fwdbwd"] for r in rows if not math.isnan(r["sonic_fwdbwd_ms"])]
        result[f"geomean_ratio_fwdbwd_{variant}"] = (math.exp(sum(map(math.log, ratios)) / len(ratios))
                                                     if ratios else math.nan)
    path = out_dir / f"sonic_ab_{device.device_kind.replace(' ', '_')}_{result['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=1))
    print("geomean ours/SonicMoE fwd+bwd: " + ", ".join(
        f"{v} {result[f'geomean_ratio_fwdbwd_{v}']:.3f}" for v in variants))
    return path


def print_row(row):
    print(f"== {row['shape']} (SonicMoE fwd {row['sonic_fwd_ms']:.2f} ms, fwd+bwd {row['sonic_fwdbwd_ms']:.2f} ms)")
    for variant, e in row["variants"].items():
        fwd = " ".join(f"{t:.3f}" for t in e["fwd_ms"])
        both = " ".join(f"{t:.3f}" for t in e["fwdbwd_ms"])
        print(f"  {variant:6s} fwd [{fwd}] fwd+bwd [{both}] ratio {e['ratio_fwdbwd']:.3f} "
              f"err out {e['rel_error_out']:.1e} grads {e['rel_error_grads']:.1e} finite {e['finite']} "
              f"peak {(e['peak_bytes'] or 0) / 1e9:.2f} GB")
        if "fwd_pipelined_ms" in e:
            print(f"    pipelined fwd [{' '.join(f'{t:.3f}' for t in e['fwd_pipelined_ms'])}] "
                  f"fwd+bwd [{' '.join(f'{t:.3f}' for t in e['fwdbwd_pipelined_ms'])}]")
        for key in ("gpu_fwd", "gpu_fwdbwd"):
            if e.get(key):
                g = e[key]
                print(f"    {key}: busy {g['busy_ms']:.3f} ms, idle between kernels {g['idle_inside_ms']:.3f} ms, "
                      f"{g['kernels']:.0f} kernels")
        for key in ("profile_fwd", "profile_fwdbwd"):
            if e.get(key):
                top = ", ".join(f"{k[:40]} {ms:.3f}" for k, ms in list(e[key].items())[:14])
                print(f"    {key}: {top}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["1.4B-n256", "7B-n256"])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["base", "new"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--pipelined", action="store_true", help="also time calls issued back to back")
    parser.add_argument("--hlo", action="store_true", help="also write each variant's optimized HLO to --out")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    run(args.shapes, args.variants, args.reps, args.rounds, args.profile, args.out, args.hlo, args.pipelined)


if __name__ == "__main__":
    main()
