"""The Gluon grouped GEMMs launched from JAX (``grouped_matmul_sm90.jax_launch``) beside our Triton
``gmm`` / ``tgmm`` launched from JAX, at SonicMoE's d = 4096 shapes, on one Hopper GPU.

For each shape: the forward's up and down products (rows past the groups zeroed, and not: every row
here is in a group, so both give the same product) and the two weight gradients, each checked
against the other launch (relative error) and timed in one jitted loop of back-to-back calls (the
custom call's host-side descriptor encoding included). Writes ``gluon_jax_<device>_<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from moe_lowering.kernels.grouped_matmul import triton_launch  # noqa: E402
from moe_lowering.kernels.grouped_matmul_sm90 import jax_launch  # noqa: E402

SHAPE_NAMES = ["30B-n256", "30B-n512", "30B-n1024", "120B-n512", "120B-n1024", "120B-n2048"]


def _group_sizes(rows: int, groups: int, seed: int) -> np.ndarray:
    """Near-uniform sizes summing to ``rows`` (multinomial over the experts, as routing gives)."""
    return np.random.default_rng(seed).multinomial(rows, np.full(groups, 1.0 / groups)).astype(np.int32)


def _time_ms(fn, args, reps: int) -> float:
    """Milliseconds per call of ``fn`` over ``reps`` back-to-back calls in one program."""
    def loop(*a):
        def body(i, acc):
            out = fn(*a)
            return acc + out.reshape(-1)[i].astype(jnp.float32)
        return jax.lax.fori_loop(0, reps, body, jnp.float32(0))
    compiled = jax.jit(loop).lower(*args).compile()
    compiled(*args).block_until_ready()
    start = time.perf_counter()
    compiled(*args).block_until_ready()
    return (time.perf_counter() - start) / reps * 1e3


def main(argv=None) -> None:
    from sonic import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--shapes", nargs="+", default=SHAPE_NAMES, choices=SHAPE_NAMES)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    device = jax.devices()[0].device_kind
    rows_out = []
    for name in args.shapes:
        shape = SHAPES[name]
        rows = shape.T * shape.K
        sizes = jnp.asarray(_group_sizes(rows, shape.E, 0))
        key = jax.random.split(jax.random.key(0), 4)
        products = [("up", shape.d, 2 * shape.n), ("down", shape.n, shape.d)]
        for product, k, n in products:
            lhs = jax.random.normal(key[0], (rows, k), jnp.bfloat16)
            rhs = (jax.random.normal(key[1], (shape.E, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
            dout = jax.random.normal(key[2], (rows, n), jnp.bfloat16)
            flops = 2.0 * rows * k * n
            ours = {
                f"gmm {product}": ((lambda a, b, g: jax_launch.gmm(a, b, g)),
                                   (lambda a, b, g: triton_launch.gmm(a, b, g)), (lhs, rhs, sizes)),
                f"gmm {product} unzeroed": ((lambda a, b, g: jax_launch.gmm(a, b, g, zero_outside=False)),
                                            (lambda a, b, g: triton_launch.gmm(a, b, g, zero_outside=False)),
                                            (lhs, rhs, sizes)),
                f"tgmm dW_{product}": ((lambda a, b, g: jax_launch.tgmm(a, b, g)),
                                       (lambda a, b, g: triton_launch.tgmm(a, b, g)), (lhs, dout, sizes)),
            }
            for label, (gluon_fn, triton_fn, operands) in ours.items():
                got, want = jax.jit(gluon_fn)(*operands), jax.jit(triton_fn)(*operands)
                error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))
                              / jnp.max(jnp.abs(want.astype(jnp.float32))))
                gluon_ms = _time_ms(gluon_fn, operands, args.reps)
                triton_ms = _time_ms(triton_fn, operands, args.reps)
                row = {"shape": name, "op": label, "rows": rows, "K": k, "N": n, "E": shape.E,
                       "gluon_ms": gluon_ms, "triton_ms": triton_ms, "gluon_tflops": flops / gluon_ms / 1e9,
                       "triton_tflops": flops / triton_ms / 1e9, "gluon_over_triton_speed": triton_ms / gluon_ms,
                       "max_rel_err_vs_triton": error}
                rows_out.append(row)
                print(f"{name:11s} {label:21s} gluon {gluon_ms:7.3f} ms {row['gluon_tflops']:6.1f} TFLOP/s | triton "
                      f"{triton_ms:7.3f} ms {row['triton_tflops']:6.1f} | speed-up {row['gluon_over_triton_speed']:.3f}"
                      f" | rel err {error:.1e}", flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gluon_jax_{device.replace(' ', '_')}_{now:%Y-%m-%d}.json"
    path.write_text(json.dumps({"device": device, "date": now.isoformat(), "jax": jax.__version__, "reps": args.reps,
                                "rows": rows_out}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
