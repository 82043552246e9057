"""GPU time of the combine's backward products at SonicMoE's small-n shapes, per tile shape.

The last product and the combine as one piece (``primitives.expert_combine``) run their backward on
``gather_gmm`` (the rows' cotangent: the output's cotangent gathered by token inside the loads, the
routing weights' cotangent in the epilogue) and ``gather_tgmm`` (the weight gradient, the same rows
gathered inside the loads). This times each against what it replaces, the plain ``gmm`` / ``tgmm`` of
a materialised ``[T*K, d]`` copy (the copy itself, ``spread``, and ``combine_weights_ct`` are not
counted), for a list of tile shapes, by GPU kernel time (``jax.profiler``), not wall time.

``--up`` times the up projection's weight gradient instead: ``gather_lhs_tgmm`` (the token rows
gathered as loaded, the tiles stored transposed) per tile shape of ``UP_TILES``, against ``tgmm`` of
the materialised permuted copy and the row gather that makes the copy, with each result's relative
error against ``tgmm``'s.

    python benchmarks/gather_products.py --shapes 1.4B-n256 7B-n256 --out /tmp/gather
    python benchmarks/gather_products.py --up --shapes 1.4B-n256 30B-n512 --out /tmp/gather_up
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sonic import SHAPES  # noqa: E402

TILES = {  # name: (block_m, block_n, block_k, num_warps, num_stages)
    "128x256x64s4": (128, 256, 64, 8, 4),
    "128x256x64s3": (128, 256, 64, 8, 3),
    "128x128x64s4": (128, 128, 64, 8, 4),
    "128x128x64s4w4": (128, 128, 64, 4, 4),
    "64x256x64s4": (64, 256, 64, 8, 4),
    "128x128x128s3": (128, 128, 128, 8, 3),
}

UP_TILES = {  # gather_lhs_tgmm: block over the expert's width, over d, over the rows; warps; stages
    "128x256x64s3": (128, 256, 64, 8, 3),
    "128x256x64s4": (128, 256, 64, 8, 4),
    "128x256x64s6": (128, 256, 64, 8, 6),
    "128x128x64s5": (128, 128, 64, 8, 5),
    "128x128x64s5w4": (128, 128, 64, 4, 5),
    "256x128x64s4": (256, 128, 64, 8, 4),
    "64x256x64s5": (64, 256, 64, 8, 5),
    "128x256x32s6": (128, 256, 32, 8, 6),
}


def operands(shape, key):
    """Sorted rows of a balanced random routing: ``(d_out [T, d], w_down [E, n, d], hidden [T*K, n],
    token_of_row, row_scale, group_sizes)``."""
    from moe_lowering.sparse_moe import sort_by_expert

    keys = jax.random.split(key, 5)
    logits = jax.random.normal(keys[0], (shape.T, shape.E))
    idx = jax.lax.top_k(logits, shape.K)[1]
    routing = sort_by_expert(idx, shape.E)
    d_out = jax.random.normal(keys[1], (shape.T, shape.d), jnp.bfloat16)
    w_down = (jax.random.normal(keys[2], (shape.E, shape.n, shape.d)) * 0.05).astype(jnp.bfloat16)
    hidden = jax.random.normal(keys[3], (shape.T * shape.K, shape.n), jnp.bfloat16)
    scale = jax.random.uniform(keys[4], (shape.T * shape.K,))
    return d_out, w_down, hidden, routing.token_of_row, scale, routing.group_sizes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1.4B-n256", "7B-n256"], choices=sorted(SHAPES))
    parser.add_argument("--tiles", nargs="+", default=list(TILES), choices=list(TILES))
    parser.add_argument("--up", action="store_true", help="the up projection's weight gradient instead")
    parser.add_argument("--tiles-up", action="store_true", help="with --up: every tile of UP_TILES too")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.up:
        return main_up(args)
    from moe_lowering.kernels.grouped_matmul import triton_launch as tgm

    args.out.mkdir(parents=True, exist_ok=True)
    results = {"device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(), "shapes": {}}
    for name in args.shapes:
        shape = SHAPES[name]
        d_out, w_down, hidden, token_of_row, scale, sizes = operands(shape, jax.random.key(0))
        spread = (d_out[token_of_row].astype(jnp.float32) * scale[:, None]).astype(jnp.bfloat16)
        runs = {
            "gmm (spread rows)": (lambda s, w: tgm.gmm(s, w, sizes, transpose_rhs=True), (spread, w_down)),
            "tgmm (spread rows)": (lambda h, s: tgm.tgmm(h, s, sizes), (hidden, spread)),
        }
        for tile in [None, *args.tiles]:
            config = None if tile is None else tgm.TileConfig(*TILES[tile][:3], num_warps=TILES[tile][3],
                                                              num_stages=TILES[tile][4])
            label = tile or "table"
            runs[f"gather_gmm+dots {label}"] = (
                lambda o, w, h, c=config: tgm.gather_gmm(o, w, token_of_row, scale, h, sizes, transpose_rhs=True,
                                                         config=c), (d_out, w_down, hidden))
            runs[f"gather_tgmm {label}"] = (
                lambda h, o, c=config: tgm.gather_tgmm(h, o, token_of_row, scale, sizes, config=c), (hidden, d_out))
        results["shapes"][name] = _profile_runs(name, {label: (*run, False) for label, run in runs.items()},
                                                args.out)
        (args.out / "gather_products.json").write_text(json.dumps(results, indent=1))


def _profile_runs(name, runs, out: Path, want=None) -> dict:
    """GPU kernel time of each ``label: (fn, args, checked)`` run; ``checked`` runs also get their
    result's relative error against ``want``. A run that does not compile or fit is recorded, not fatal."""
    from ep_overlap import profile_summary

    row = {}
    for label, (fn, fn_args, checked) in runs.items():
        try:
            jitted = jax.jit(fn)
            summary = profile_summary(jitted, fn_args, out / "traces" / f"{name}_{len(row)}")
            kernels = summary.get("top_kernels_ms", {})
            row[label] = {"total_ms": round(sum(kernels.values()), 4), "kernels": kernels}
            if checked:
                got = jitted(*fn_args).astype(jnp.float32)
                row[label]["rel_error"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        except Exception as err:  # noqa: BLE001
            row[label] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        print(f"{name:10s} {label:32s} {row[label].get('total_ms', row[label].get('error'))} "
              f"{row[label].get('rel_error', '')}", flush=True)
    return row


def main_up(args):
    from moe_lowering.kernels.gather_rows.triton_launch import gather_rows
    from moe_lowering.kernels.grouped_matmul import triton_launch as tgm

    args.out.mkdir(parents=True, exist_ok=True)
    results = {"device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(), "shapes": {}}
    for name in args.shapes:
        shape = SHAPES[name]
        _, _, d_pre, token_of_row, _, sizes = operands(shape, jax.random.key(0))
        tokens = jax.random.normal(jax.random.key(1), (shape.T, shape.d), jnp.bfloat16)
        rows = gather_rows(tokens, token_of_row)
        want = jax.jit(lambda r, g: tgm.tgmm(r, g, sizes))(rows, d_pre).astype(jnp.float32)
        runs = {"row gather (the copy)": (lambda t: gather_rows(t, token_of_row), (tokens,), False),
                "tgmm (permuted copy)": (lambda g, r: tgm.tgmm(r, g, sizes), (d_pre, rows), False)}
        for tile in [None, *UP_TILES] if args.tiles_up else [None]:
            config = None if tile is None else tgm.TileConfig(*UP_TILES[tile][:3], num_warps=UP_TILES[tile][3],
                                                              num_stages=UP_TILES[tile][4])
            runs[f"gather_lhs_tgmm {tile or 'table'}"] = (
                lambda g, t, c=config: tgm.gather_lhs_tgmm(t, g, token_of_row, sizes, config=c), (d_pre, tokens), True)
        # Gate and up products as one launch over a [rows, 2n] cotangent: how much of the gathered
        # kernel's cost is reading the token rows once per product.
        both = jnp.concatenate([d_pre, d_pre[::-1]], axis=1)
        runs["tgmm both (2n)"] = (lambda g, r: tgm.tgmm(r, g, sizes), (both, rows), False)
        runs["gather_lhs_tgmm both (2n)"] = (lambda g, t: tgm.gather_lhs_tgmm(t, g, token_of_row, sizes),
                                             (both, tokens), False)
        results["shapes"][name] = _profile_runs(name, runs, args.out, want)
        (args.out / "gather_products_up.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
