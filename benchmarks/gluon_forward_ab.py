"""The layer's forward-kernel products on the Hopper Gluon kernels against Triton's ``gmm_kernel``, one product
form at a time, at the benchmark layers' shapes (sizes from a multinomial routing, as the layer's).

Forms: ``pair`` (SwiGLU's gate and up products of the same rows), ``down`` (the down projection), ``down_t``
(its input gradient, ``dy @ w_down[g]^T``), ``sum`` (the gate and up products' input gradient, two transposed
products into one output). Each variant's output is checked against Triton's (max relative difference) and
timed as the back-to-back mean of ``--calls`` calls, in ``--rounds`` alternated rounds (min-max reported): the
variants see the same clock and power state. Writes one JSON and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

import jax
import jax.numpy as jnp

# name: (tokens x choices, d, f, experts)
SHAPES = {
    "mixtral": (8192 * 2, 4096, 14336, 8),
    "qwen3": (16384 * 8, 2048, 768, 128),
    "deepseek": (4096 * 8, 7168, 2048, 256),
}


def _sizes(rows: int, experts: int, seed: int):
    return jnp.asarray(np.random.default_rng(seed).multinomial(rows, np.full(experts, 1.0 / experts)), jnp.int32)


def _forms(rows, d, f, experts, seed=0):
    """``{form: (flop, {variant: callable of no arguments})}``; the operands are arguments of the jitted
    products (closed over, they would be compiled in as constants)."""
    from moe_lowering.kernels.grouped_matmul import triton_launch
    from moe_lowering.kernels.grouped_matmul_sm90 import gluon_launch, jax_launch

    keys = jax.random.split(jax.random.key(seed), 6)
    normal = lambda key, shape, scale: (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)
    x = normal(keys[0], (rows, d), 1.0)
    h = normal(keys[1], (rows, f), 1.0)
    w_gate, w_up = normal(keys[2], (experts, d, f), d ** -0.5), normal(keys[3], (experts, d, f), d ** -0.5)
    w_down = normal(keys[4], (experts, f, d), f ** -0.5)
    dy = normal(keys[5], (rows, d), 1.0)
    sizes = _sizes(rows, experts, seed)
    configs = {"coop": gluon_launch.CONFIGS["128x256x64-s3-w8-tma"],
               "pingpong": gluon_launch.CONFIGS["64x256x64-s4-pingpong-tma"]}
    operands = {"pair": (x, w_gate, w_up, sizes), "down": (h, w_down, sizes), "down_t": (dy, w_down, sizes),
                "sum": (h, h, w_gate, w_up, sizes)}
    products = {
        "pair": (4 * rows * d * f, lambda a, wa, wb, g: triton_launch.gmm_pair(a, wa, wb, g),
                 lambda c: lambda a, wa, wb, g: tuple(jax_launch.gmm(a, w, g, c) for w in (wa, wb))),
        "down": (2 * rows * d * f, lambda a, w, g: triton_launch.gmm(a, w, g),
                 lambda c: lambda a, w, g: jax_launch.gmm(a, w, g, c)),
        "down_t": (2 * rows * d * f, lambda a, w, g: triton_launch.gmm(a, w, g, transpose_rhs=True),
                   lambda c: lambda a, w, g: jax_launch.gmm(a, w, g, c, transpose_rhs=True)),
        "sum": (4 * rows * d * f, lambda a, b, wa, wb, g: triton_launch.gmm_sum(a, b, wa, wb, g),
                lambda c: lambda a, b, wa, wb, g: jax_launch.gmm_sum(a, b, wa, wb, g, c)),
    }
    forms = {}
    for form, (flop, triton_fn, gluon_fn) in products.items():
        variants = {"triton": jax.jit(triton_fn)} | {name: jax.jit(gluon_fn(c)) for name, c in configs.items()}
        forms[form] = (flop, {name: functools.partial(fn, *operands[form]) for name, fn in variants.items()})
    return forms


def _time(fn, calls: int) -> float:
    jax.block_until_ready(fn())
    start = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def _max_rel(got, want) -> float:
    diffs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
             / max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))), 1e-30)
             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    return max(diffs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0].device_kind
    rows_out = []
    for shape in args.shapes:
        forms = _forms(*SHAPES[shape])
        for form, (flop, variants) in forms.items():
            want = variants["triton"]()
            errors = {name: _max_rel(fn(), want) for name, fn in variants.items()}
            times = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    times[name].append(_time(fn, args.calls))
            row = {"shape": shape, "form": form, "flop": flop,
                   "ms": {name: [min(t), max(t)] for name, t in times.items()}, "max_rel_vs_triton": errors}
            rows_out.append(row)
            cells = " | ".join(f"{name} {min(t):.3f}-{max(t):.3f} ms {flop / min(t) / 1e9:.0f} TF/s (d {errors[name]:.0e})"
                               for name, t in times.items())
            print(f"{shape:8s} {form:6s} {cells}", flush=True)
        del forms
    result = {"device": device, "date": date.today().isoformat(), "jax": jax.__version__,
              "calls": args.calls, "rounds": args.rounds, "rows": rows_out}
    path = args.out / f"gluon_forward_ab_{device.replace(' ', '_')}_{date.today().isoformat()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
