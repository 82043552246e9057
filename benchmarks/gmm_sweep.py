"""Times the Triton ``gmm`` / ``tgmm`` kernels alone, per tile configuration, on the benchmark layers' shapes.

For each layer config (``moe_layer.CONFIGS``, or one of SonicMoE's shapes from ``sonic.py``) the six
grouped products of a SwiGLU MoE layer (forward up/down, activation gradients of both, weight
gradients of both) are timed with every candidate tile shape and with the one the table picks, on
group sizes drawn from uniform top-k routing. Prints TFLOP/s per (product, candidate) and writes
JSON; the table in ``moe_lowering/kernels/grouped_matmul/triton_launch.py`` is set from these
numbers by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_layer import CONFIGS as LAYER_CONFIGS, LayerConfig, _time_ms  # noqa: E402
from sonic import SHAPES as SONIC_SHAPES  # noqa: E402

from moe_lowering.kernels.grouped_matmul import triton_launch as tgm  # noqa: E402

CONFIGS = LAYER_CONFIGS | {name: LayerConfig(name, T=s.T, d=s.d, f=s.n, E=s.E, k=s.K)
                           for name, s in SONIC_SHAPES.items()}
"""The layer configs of ``moe_layer.py`` and SonicMoE's twelve shapes (``sonic.py``), by name."""

CANDIDATES = {
    "128x256x64s3": tgm.TileConfig(128, 256, 64, num_stages=3),
    "128x256x64s4": tgm.TileConfig(128, 256, 64, num_stages=4),
    "128x128x64s4": tgm.TileConfig(128, 128, 64, num_stages=4),
    "64x256x64s4": tgm.TileConfig(64, 256, 64, num_stages=4),
    "128x256x64s3-grid": tgm.TileConfig(128, 256, 64, num_stages=3, persistent=False),
}
# The table's candidates, swept by default; those below were tried for the weight gradient alone
# (benchmarks/NOTES.md: several programs per SM, the resident kernel's tiles) and are named with
# --candidates (some exceed shared memory on gmm products, or on any product).
TABLE_CANDIDATES = tuple(CANDIDATES)
CANDIDATES |= {
    "128x128x64s2w4x2": tgm.TileConfig(128, 128, 64, num_warps=4, num_stages=2, programs_per_sm=2),
    "128x128x64s3w4x2": tgm.TileConfig(128, 128, 64, num_warps=4, num_stages=3, programs_per_sm=2),
    "128x128x64s2w8x2": tgm.TileConfig(128, 128, 64, num_warps=8, num_stages=2, programs_per_sm=2),
    "128x128x32s3w4x2": tgm.TileConfig(128, 128, 32, num_warps=4, num_stages=3, programs_per_sm=2),
    "128x128x64s2w4x3": tgm.TileConfig(128, 128, 64, num_warps=4, num_stages=2, programs_per_sm=3),
    "64x256x64s2w4x2": tgm.TileConfig(64, 256, 64, num_warps=4, num_stages=2, programs_per_sm=2),
    "128x256x64s2w8x2": tgm.TileConfig(128, 256, 64, num_warps=8, num_stages=2, programs_per_sm=2),
    "128x256x128s2w8": tgm.TileConfig(128, 256, 128, num_warps=8, num_stages=2),
    "128x128x64s2w4-grid": tgm.TileConfig(128, 128, 64, num_warps=4, num_stages=2, persistent=False),
    "128x256x32s4": tgm.TileConfig(128, 256, 32, num_stages=4),
    "128x128x32s4w4x2": tgm.TileConfig(128, 128, 32, num_warps=4, num_stages=4, programs_per_sm=2),
    "128x128x128s3": tgm.TileConfig(128, 128, 128, num_stages=3),
    "128x128x128s4": tgm.TileConfig(128, 128, 128, num_stages=4),
    "128x128x128s3w4": tgm.TileConfig(128, 128, 128, num_warps=4, num_stages=3),
    "64x256x128s3": tgm.TileConfig(64, 256, 128, num_stages=3),
    "64x256x128s4": tgm.TileConfig(64, 256, 128, num_stages=4),
    "256x128x128s2": tgm.TileConfig(256, 128, 128, num_stages=2),
    "64x128x128s4w4": tgm.TileConfig(64, 128, 128, num_warps=4, num_stages=4),
    "128x256x64s4-flat": tgm.TileConfig(128, 256, 64, num_stages=4, flatten=True),
    "128x256x64s3-flat": tgm.TileConfig(128, 256, 64, num_stages=3, flatten=True),
    "64x256x64s4-flat": tgm.TileConfig(64, 256, 64, num_stages=4, flatten=True),
    "64x256x128s2": tgm.TileConfig(64, 256, 128, num_stages=2),
    "128x128x128s2x2": tgm.TileConfig(128, 128, 128, num_stages=2, programs_per_sm=2),
    "128x128x128s2w4x2": tgm.TileConfig(128, 128, 128, num_warps=4, num_stages=2, programs_per_sm=2),
    "128x128x64s2x2": tgm.TileConfig(128, 128, 64, num_stages=2, programs_per_sm=2),
}


def group_sizes_for(config, key):
    """Expert loads of uniform top-k routing of T tokens (each token picks k distinct experts)."""
    scores = jax.random.uniform(key, (config.T, config.E))
    _, idx = jax.lax.top_k(scores, config.k)
    return jnp.bincount(idx.reshape(-1), length=config.E).astype(jnp.int32)


def products(config):
    """(name, kind, lhs shape, rhs/grad shape, transpose_rhs) of the layer's six grouped products."""
    m, d, f, e = config.T * config.k, config.d, config.f, config.E
    return [
        ("fwd_up", "gmm", (m, d), (e, d, f), False),
        ("fwd_down", "gmm", (m, f), (e, f, d), False),
        ("dlhs_up", "gmm", (m, f), (e, d, f), True),
        ("dlhs_down", "gmm", (m, d), (e, f, d), True),
        ("dw_up", "tgmm", (m, d), (m, f), False),
        ("dw_down", "tgmm", (m, f), (m, d), False),
    ]


def _gpu_ms(compiled, operands, trace_dir: Path) -> float:
    """GPU kernel time of one call (every kernel it launches), from a profile of three calls."""
    import shutil

    from ep_overlap import profile_summary

    summary = profile_summary(compiled, operands, trace_dir)
    shutil.rmtree(trace_dir, ignore_errors=True)
    return sum(summary["top_kernels_ms"].values())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["mixtral", "qwen3", "deepseek"],
                        help="moe_layer.py's layer configs or SonicMoE's shapes (sonic.py)")
    parser.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=list(TABLE_CANDIDATES))
    parser.add_argument("--products", nargs="+", help="time only these products (e.g. dw_up dw_down)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--gpu-time", action="store_true",
                        help="time by GPU kernel time (jax.profiler) instead of wall time: a sub-millisecond "
                             "product's wall time carries the call's fixed cost")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    results = []
    for name in args.configs:
        config = CONFIGS[name]
        sizes = group_sizes_for(config, jax.random.key(0))
        for product, kind, lhs_shape, other_shape, transpose in products(config):
            if args.products and product not in args.products:
                continue
            keys = jax.random.split(jax.random.key(1), 2)
            lhs = jax.random.normal(keys[0], lhs_shape, jnp.float32).astype(jnp.bfloat16)
            other = jax.random.normal(keys[1], other_shape, jnp.float32).astype(jnp.bfloat16)
            if kind == "gmm":
                n = other_shape[1] if transpose else other_shape[2]
                flops = 2.0 * lhs_shape[0] * lhs_shape[1] * n
                table = tgm.gmm_config(lhs_shape[0], lhs_shape[1], n, config.E, False)
            else:
                flops = 2.0 * lhs_shape[0] * lhs_shape[1] * other_shape[1]
                table = tgm.tgmm_config(lhs_shape[0], lhs_shape[1], other_shape[1], config.E, False)
            for label in args.candidates:
                candidate = CANDIDATES[label]
                if kind == "gmm":
                    fn = jax.jit(lambda a, b, s, c=candidate, t=transpose: tgm.gmm(a, b, s, transpose_rhs=t, config=c))
                else:
                    fn = jax.jit(lambda a, b, s, c=candidate, g=config.E: tgm.tgmm(a, b, s, num_groups=g, config=c))
                try:
                    compiled = fn.lower(lhs, other, sizes).compile()
                    ms = (_gpu_ms(compiled, (lhs, other, sizes), args.out.with_suffix(".traces"))
                          if args.gpu_time else _time_ms(compiled, (lhs, other, sizes), args.reps))
                    row = {"config": name, "product": product, "candidate": label, "ms": ms,
                           "tflops": flops / (ms * 1e-3) / 1e12, "is_table_pick": candidate == table}
                except Exception as err:  # noqa: BLE001 - a config that fails to compile is a result
                    row = {"config": name, "product": product, "candidate": label, "error": str(err)[:200]}
                results.append(row)
                print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"{'config':9s} {'product':10s} " + " ".join(f"{c:>18s}" for c in args.candidates))
    for name in args.configs:
        for product, *_ in products(CONFIGS[name]):
            if args.products and product not in args.products:
                continue
            cells = []
            for label in args.candidates:
                row = next(r for r in results if (r["config"], r["product"], r["candidate"]) == (name, product, label))
                cells.append(f"{row['tflops']:17.0f}{'*' if row['is_table_pick'] else ' '}" if "tflops" in row else f"{'err':>18s}")
            print(f"{name:9s} {product:10s} " + " ".join(cells))


if __name__ == "__main__":
    main()
