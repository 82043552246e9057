"""Launch shapes of the ``swiglu_rows`` kernel against XLA's own fused SwiGLU (one GPU).

The EP layer's activation runs over the received rows only (``swiglu_rows``); XLA's fusion over a
static slice of the same rows is the bandwidth to match. Each variant runs ``--iters`` times in a
``fori_loop``, so host dispatch does not enter the time: XLA's fusion feeds its output to the next
gate (written in place), each kernel call depends on the last through one element (see
``chained``), and the gradient kernel is timed alike.

    python benchmarks/swiglu_rows_sweep.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_layer import _time_ms  # noqa: E402  (this folder: the script's own)

log = logging.getLogger("swiglu_rows_sweep")

# (name, buffer rows, rows that arrived, features): the EP=4 / EP=2 layers' busiest GPU.
SHAPES = [("mixtral-ep4", 16384, 4142, 14336), ("mixtral-ep2", 16384, 8263, 14336),
          ("deepseek-ep4", 65536, 16618, 2048)]


def looped(step, iters: int):
    """``iters`` activations in a row, each output the next gate (XLA's fusion writes the loop's
    carry in place)."""
    return jax.jit(lambda gate, up: jax.lax.fori_loop(0, iters, lambda _, g: step(g, up), gate))


def chained(step, iters: int):
    """``iters`` kernel calls in a row, each depending on the last through one element written in
    place into the gate: a custom call's output cannot be the loop's carry without a copy of the
    whole buffer, which would be timed too."""
    def body(_, gate_and_up):
        gate, up = gate_and_up
        out = step(gate, up)
        return gate.at[0, 0].set(out[0, 0]), up
    return jax.jit(lambda gate, up: jax.lax.fori_loop(0, iters, body, (gate, up))[0])


def chained_grads(step, iters: int):
    """As :func:`chained` for the gradient kernel (``d_out`` carries the dependence)."""
    def body(_, operands):
        d_out, gate, up = operands
        d_gate, d_up = step(d_out, gate, up)
        return d_out.at[0, 0].set(d_gate[0, 0] + d_up[0, 0]), gate, up
    return jax.jit(lambda d_out, gate, up: jax.lax.fori_loop(0, iters, body, (d_out, gate, up))[0])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--block-rows", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args(argv)
    # the GPU kernels (jax-triton): after --help
    from moe_lowering.kernels.swiglu_rows import triton_launch as triton_swiglu_rows

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    device = jax.devices()[0]
    sms = getattr(device, "core_count", 132)
    rows_out = []
    for name, buffer_rows, num_rows, features in SHAPES:
        keys = jax.random.split(jax.random.key(0), 2)
        gate = jax.random.normal(keys[0], (buffer_rows, features), jnp.bfloat16)
        up = jax.random.uniform(keys[1], (buffer_rows, features), jnp.bfloat16)
        arrived = jnp.asarray(num_rows, jnp.int32)
        moved = 3 * num_rows * features * 2  # gate and up read, the activation written (bf16)

        def report(variant, ms_total, bytes_moved=moved):
            us = ms_total * 1e3 / args.iters
            row = dict(shape=name, variant=variant, us=round(us, 2), TBps=round(bytes_moved / us / 1e6, 3))
            rows_out.append(row)
            log.info("%s", row)

        xla = looped(lambda g, u: (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype),
                     args.iters)
        report("xla fusion (arrived rows only)", _time_ms(xla, (gate[:num_rows], up[:num_rows]), args.reps))
        saved = (triton_swiglu_rows.NUM_PROGRAMS, triton_swiglu_rows.BLOCK_ROWS, triton_swiglu_rows.NUM_WARPS)
        for per_sm, block_rows, warps in itertools.product(args.programs_per_sm, args.block_rows, args.warps):
            triton_swiglu_rows.NUM_PROGRAMS, triton_swiglu_rows.BLOCK_ROWS = per_sm * sms, block_rows
            triton_swiglu_rows.NUM_WARPS = warps
            try:
                fn = chained(lambda g, u: triton_swiglu_rows.swiglu_rows(g, u, arrived), args.iters)
                report(f"triton {per_sm}/SM rows={block_rows} warps={warps}", _time_ms(fn, (gate, up), args.reps))
                grads = chained_grads(lambda d, g, u: triton_swiglu_rows.swiglu_rows_grads(d, g, u, arrived),
                                      args.iters)
                report(f"triton grads {per_sm}/SM rows={block_rows} warps={warps}",
                       _time_ms(grads, (up, gate, up), args.reps), bytes_moved=5 * moved // 3)
            except Exception as err:  # a launch shape the compiler refuses: recorded, not fatal
                log.warning("%s %s/SM rows=%s warps=%s failed: %s", name, per_sm, block_rows, warps, err)
            finally:
                triton_swiglu_rows.NUM_PROGRAMS, triton_swiglu_rows.BLOCK_ROWS, triton_swiglu_rows.NUM_WARPS = saved
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"swiglu_rows_sweep_{device.device_kind.replace(' ', '_')}_{stamp}.json"
    path.write_text(json.dumps(dict(device=device.device_kind, rows=rows_out), indent=1))
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
