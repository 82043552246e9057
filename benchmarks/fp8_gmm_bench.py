"""Times the FP8-weight grouped GEMM (W8A16) against bf16 weights, at Mixtral- and DeepSeek-like shapes.

Per shape (rows routed to the local groups by uniform random choice) and quant format:

* ``bf16_gmm``: the bf16 Triton ``gmm`` (``kernels/grouped_matmul/triton_launch.py``) on bf16 weights;
* ``dequantize_then_gmm``: ``dequantize_blocks`` to bf16, then that ``gmm`` (what the FP8 FSDP
  gather feeds the experts today);
* ``fp8_gmm_wlhs`` / ``fp8_gmm_wrhs``: the Triton ``fp8_gmm``
  (``kernels/fp8_grouped_matmul/triton_launch.py``) on the FP8 values and scales, computing the transposed tile with the dequantised weight as the dot's first
  (register) operand (``weight_as_lhs=True``, the default) or the weight as its second operand (the
  first version), with the tile its table picks and with each candidate tile, since that table is
  not measured yet.

Tile labels are ``block_m x block_n x block_k`` (rows x output columns x K step) and the pipeline
depth, prefixed by the operand order; for ``wlhs`` the MMA's M is ``block_n`` and its N ``block_m``.
``block_k`` is capped at the scale block along K, so every mxfp8 run steps 32 along K.

Each row: median ms over ``--reps`` after a warm-up, TFLOP/s (``2 * rows * K * N``) and, for
``fp8_gmm``, the relative (Frobenius) error against ``dequantize_then_gmm``, which computes the
same dequantised product. Prints a table of every row (shape, variant, quant, tile, ms, TFLOP/s,
error), then the fastest tile of each operand order per shape and quant beside the two baselines,
and writes ``fp8_gmm_bench_<device>_<date>.json`` under ``--out``. Needs a
CUDA GPU with jax_triton; ``--help`` works anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_layer import _time_ms  # noqa: E402

# name: (rows, K, N, local groups)
SHAPES = {
    "mixtral-4096-rows-2-groups": (4096, 4096, 14336, 2),
    "mixtral-4096-rows-4-groups": (4096, 4096, 14336, 4),
    "mixtral-8192-rows-2-groups": (8192, 4096, 14336, 2),
    "mixtral-8192-rows-4-groups": (8192, 4096, 14336, 4),
    "deepseek-8192-rows-64-groups": (8192, 7168, 2048, 64),
}
# Tiles tried for fp8_gmm beside the table's pick (block_k is capped at the scale block, 32 for mxfp8).
# wlhs: weight as the dot's first operand (transposed tile; block_n is the MMA's M, a multiple of 64).
# wrhs: weight as its second operand, the tiles of the first measurement.
CANDIDATES = {
    "wlhs-128x128x64s3": dict(block_m=128, block_n=128, block_k=64, num_stages=3, weight_as_lhs=True),
    "wlhs-128x128x64s4": dict(block_m=128, block_n=128, block_k=64, num_stages=4, weight_as_lhs=True),
    "wlhs-128x128x128s3": dict(block_m=128, block_n=128, block_k=128, num_stages=3, weight_as_lhs=True),
    "wlhs-128x256x64s3": dict(block_m=128, block_n=256, block_k=64, num_stages=3, weight_as_lhs=True),
    "wlhs-64x128x128s4": dict(block_m=64, block_n=128, block_k=128, num_stages=4, weight_as_lhs=True),
    "wrhs-128x128x64s3": dict(block_m=128, block_n=128, block_k=64, num_stages=3, weight_as_lhs=False),
    "wrhs-128x128x64s4": dict(block_m=128, block_n=128, block_k=64, num_stages=4, weight_as_lhs=False),
    "wrhs-128x256x64s3": dict(block_m=128, block_n=256, block_k=64, num_stages=3, weight_as_lhs=False),
    "wrhs-128x128x128s3": dict(block_m=128, block_n=128, block_k=128, num_stages=3, weight_as_lhs=False),
    "wrhs-64x128x64s4": dict(block_m=64, block_n=128, block_k=64, num_stages=4, weight_as_lhs=False),
}


def _tile_label(config) -> str:
    order = "wlhs" if getattr(config, "weight_as_lhs", True) else "wrhs"
    return f"{order}-{config.block_m}x{config.block_n}x{config.block_k}s{config.num_stages}"


def _relative_error(actual, expected) -> float:
    actual, expected = actual.astype(jnp.float32), expected.astype(jnp.float32)
    return float(jnp.linalg.norm(actual - expected) / jnp.maximum(jnp.linalg.norm(expected), 1e-30))


def _timed(fn, args, reps: int, flops: float) -> tuple[dict, jax.Array]:
    """(``ms``/``tflops`` of the compiled ``fn``, its output); a compile failure is a row too."""
    try:
        compiled = jax.jit(fn).lower(*args).compile()
        out = compiled(*args)
        ms = _time_ms(compiled, args, reps)
    except Exception as err:  # noqa: BLE001 - a tile that fails to compile is a result
        return {"error": str(err)[:300]}, None
    return {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}, out


def bench_shape(name: str, quants, candidates, reps: int) -> list[dict]:
    from moe_lowering.kernels.fp8_grouped_matmul import triton_launch as tf8
    from moe_lowering.kernels.fp8_grouped_matmul.quant_format import dequantize_blocks, quantize_blocks
    from moe_lowering.kernels.grouped_matmul import triton_launch as tgm

    rows, k, n, groups = SHAPES[name]
    keys = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(keys[0], (rows, k), jnp.float32).astype(jnp.bfloat16)
    weights = jax.random.normal(keys[1], (groups, k, n), jnp.float32)
    sizes = jnp.bincount(jax.random.randint(keys[2], (rows,), 0, groups), length=groups).astype(jnp.int32)
    flops = 2.0 * rows * k * n
    base = {"shape": name, "rows": rows, "K": k, "N": n, "groups": groups}

    results = []
    timing, _ = _timed(tgm.gmm, (lhs, weights.astype(jnp.bfloat16), sizes), reps, flops)
    results.append({**base, "variant": "bf16_gmm", **timing})
    for quant in quants:
        values, scales = quantize_blocks(weights, quant)

        def dequantize_then_gmm(a, v, s, g, quant=quant):
            return tgm.gmm(a, dequantize_blocks(v, s, quant, a.dtype), g)

        timing, expected = _timed(dequantize_then_gmm, (lhs, values, scales, sizes), reps, flops)
        results.append({**base, "variant": "dequantize_then_gmm", "quant": quant, **timing})
        table = tf8.fp8_gmm_config(rows, k, n, groups)
        tiles = {f"table:{_tile_label(table)}": table}
        for label in candidates:  # a candidate equal to the table's pick is timed once, as the table's
            config = dataclasses.replace(table, **CANDIDATES[label])
            if config not in tiles.values():
                tiles[label] = config
        for label, config in tiles.items():
            fp8_gmm = functools.partial(tf8.fp8_gmm, quant=quant, config=config)
            timing, out = _timed(fp8_gmm, (lhs, values, scales, sizes), reps, flops)
            variant = "fp8_gmm_wlhs" if config.weight_as_lhs else "fp8_gmm_wrhs"
            row = {**base, "variant": variant, "quant": quant, "tile": label, **timing,
                   "config": dataclasses.asdict(config)}
            if out is not None and expected is not None:
                row["rel_err_vs_dequantize_then_gmm"] = _relative_error(out, expected)
            results.append(row)
    for row in results:
        print(json.dumps(row), flush=True)
    return results


def _summary(results) -> str:
    """Every row, then per shape and quant the fastest ``fp8_gmm`` of each operand order beside the baselines."""
    header = f"{'shape':30s} {'variant':20s} {'quant':9s} {'tile':24s} {'ms':>8s} {'TFLOP/s':>8s} {'rel err':>9s}"

    def line(row):
        cells = f"{row['ms']:8.3f} {row['tflops']:8.1f}" if "ms" in row else f"{'error':>8s} {'':8s}"
        error = row.get("rel_err_vs_dequantize_then_gmm")
        return (f"{row['shape']:30s} {row['variant']:20s} {row.get('quant', ''):9s} {row.get('tile', ''):24s} "
                f"{cells} {'' if error is None else f'{error:9.2e}'}")

    lines = [header, *map(line, results), "", "fastest per shape, quant and operand order:", header]
    for shape in dict.fromkeys(row["shape"] for row in results):
        rows = [row for row in results if row["shape"] == shape]
        lines += [line(row) for row in rows if row["variant"] == "bf16_gmm"]
        for quant in dict.fromkeys(row["quant"] for row in rows if "quant" in row):
            quant_rows = [row for row in rows if row.get("quant") == quant]
            lines += [line(row) for row in quant_rows if row["variant"] == "dequantize_then_gmm"]
            for variant in ("fp8_gmm_wlhs", "fp8_gmm_wrhs"):
                timed = [row for row in quant_rows if row["variant"] == variant and "ms" in row]
                if timed:
                    lines.append(line(min(timed, key=lambda row: row["ms"])))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON results")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES), metavar="SHAPE",
                        help=f"default: all of {', '.join(SHAPES)}")
    parser.add_argument("--quants", nargs="+", choices=["fp8_e4m3", "mxfp8"], default=["fp8_e4m3", "mxfp8"])
    parser.add_argument("--candidates", nargs="*", choices=sorted(CANDIDATES), default=list(CANDIDATES),
                        metavar="TILE", help=f"fp8_gmm tiles to time beside the table's pick; default: all of "
                        f"{', '.join(CANDIDATES)}")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)

    device = jax.devices()[0].device_kind
    results = [row for name in args.shapes for row in bench_shape(name, args.quants, args.candidates, args.reps)]
    args.out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    path = args.out / f"fp8_gmm_bench_{device.replace(' ', '_')}_{date}.json"
    path.write_text(json.dumps({"device": device, "date": date, "reps": args.reps, "rows": results}, indent=1))
    print(_summary(results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
