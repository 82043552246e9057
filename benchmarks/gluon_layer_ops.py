"""The layer's grouped products at the benchmark layers' shapes (``moe_layer.CONFIGS``: Mixtral, Qwen3,
DeepSeek-V3), the Triton kernels the layer runs beside the Hopper Gluon kernels, on one Hopper GPU.

The layer's weight gradients read rows by index: ``gather_lhs_tgmm`` (the gate and up weights': token
rows in expert order) and ``gather_tgmm`` (the down weights': the output cotangent's rows, scaled by
the routing weights). The Gluon weight gradient reads its rows by TMA, which on Hopper cannot gather, so
it is timed twice: on rows gathered first (an XLA gather inside the timed call, what a route through it
would cost) and alone (the kernel's share). Every Gluon configuration is timed; the first is the
launch's default. The forward's plain ``gmm`` is timed the same way, for the kernels' speeds at these
shapes. Each result is checked against the Triton kernel's (relative error). Writes
``gluon_layer_ops_<device>_<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gluon_jax import _group_sizes, _time_ms  # noqa: E402
from moe_layer import CONFIGS  # noqa: E402

from moe_lowering.kernels.grouped_matmul import triton_launch  # noqa: E402
from moe_lowering.kernels.grouped_matmul_sm90 import gluon_launch, jax_launch  # noqa: E402


def _relative_error(got, want) -> float:
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _operands(config, seed: int = 0):
    """Token rows, the expert-order row index, sizes and the routing scale, as the layer's backward sees them."""
    rows = config.T * config.k
    sizes = _group_sizes(rows, config.E, seed)
    token_of_row = np.random.default_rng(seed).permutation(rows) // config.k
    keys = jax.random.split(jax.random.key(seed), 4)
    tokens = jax.random.normal(keys[0], (config.T, config.d), jnp.bfloat16)
    hidden = jax.random.normal(keys[1], (rows, config.f), jnp.bfloat16)
    out_grad = jax.random.normal(keys[2], (config.T, config.d), jnp.bfloat16)
    scale = jax.random.uniform(keys[3], (rows,), jnp.float32)
    return (rows, jnp.asarray(sizes), jnp.asarray(token_of_row, jnp.int32), tokens, hidden, out_grad, scale)


def _products(config):
    """``{label: (flops, reference fn, {variant: fn}, operands)}`` for one layer."""
    rows, sizes, index, tokens, hidden, out_grad, scale = _operands(config)
    tgmm_configs = list(gluon_launch.TGMM_CONFIGS.values())

    def gathered_tokens(t, i):
        return jnp.take(t, i, axis=0)

    def gathered_grad(g, i, s):
        return (jnp.take(g, i, axis=0).astype(jnp.float32) * s[:, None]).astype(g.dtype)

    dw_up = {}
    dw_down = {}
    for c in tgmm_configs[:1]:
        dw_up[f"gluon gathered first {c.name}"] = (
            lambda t, h, i, g, c=c: jax_launch.tgmm(gathered_tokens(t, i), h, g, config=c), (tokens, hidden, index, sizes))
        dw_down[f"gluon gathered first {c.name}"] = (
            lambda h, o, i, s, g, c=c: jax_launch.tgmm(h, gathered_grad(o, i, s), g, config=c),
            (hidden, out_grad, index, scale, sizes))
    permuted_tokens = jnp.take(tokens, index, axis=0)
    scaled_grad = jnp.take(out_grad, index, axis=0).astype(jnp.float32) * scale[:, None]
    scaled_grad = scaled_grad.astype(jnp.bfloat16)
    for c in tgmm_configs:
        dw_up[f"gluon alone {c.name}"] = (lambda t, h, g, c=c: jax_launch.tgmm(t, h, g, config=c),
                                          (permuted_tokens, hidden, sizes))
        dw_down[f"gluon alone {c.name}"] = (lambda h, o, g, c=c: jax_launch.tgmm(h, o, g, config=c),
                                            (hidden, scaled_grad, sizes))
    dw_up["triton tgmm on gathered rows"] = (lambda t, h, g: triton_launch.tgmm(t, h, g), (permuted_tokens, hidden, sizes))
    dw_down["triton tgmm on gathered rows"] = (lambda h, o, g: triton_launch.tgmm(h, o, g), (hidden, scaled_grad, sizes))
    gmm_variants = {}
    gmm_down_variants = {}
    weights_up = (jax.random.normal(jax.random.key(5), (config.E, config.d, config.f), jnp.float32)
                  / np.sqrt(config.d)).astype(jnp.bfloat16)
    weights_down = (jax.random.normal(jax.random.key(6), (config.E, config.f, config.d), jnp.float32)
                    / np.sqrt(config.f)).astype(jnp.bfloat16)
    for c in gluon_launch.CONFIGS.values():
        if config.d % c.block_k == 0:
            gmm_variants[f"gluon {c.name}"] = (
                lambda a, b, g, c=c: jax_launch.gmm(a, b, g, config=c, zero_outside=False),
                (permuted_tokens, weights_up, sizes))
        if config.f % c.block_k == 0:
            gmm_down_variants[f"gluon {c.name}"] = (
                lambda a, b, g, c=c: jax_launch.gmm(a, b, g, config=c, zero_outside=False),
                (hidden, weights_down, sizes))
    return {
        "dW_up gather_lhs_tgmm [E, d, f]": (
            2.0 * rows * config.d * config.f,
            (lambda t, h, i, g: triton_launch.gather_lhs_tgmm(t, h, i, g), (tokens, hidden, index, sizes)), dw_up),
        "dW_down gather_tgmm [E, f, d]": (
            2.0 * rows * config.d * config.f,
            (lambda h, o, i, s, g: triton_launch.gather_tgmm(h, o, i, s, g), (hidden, out_grad, index, scale, sizes)),
            dw_down),
        "gmm up [rows, d] x [E, d, f]": (
            2.0 * rows * config.d * config.f,
            (lambda a, b, g: triton_launch.gmm(a, b, g, zero_outside=False), (permuted_tokens, weights_up, sizes)),
            gmm_variants),
        "gmm down [rows, f] x [E, f, d]": (
            2.0 * rows * config.d * config.f,
            (lambda a, b, g: triton_launch.gmm(a, b, g, zero_outside=False), (hidden, weights_down, sizes)),
            gmm_down_variants),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--layers", nargs="+", default=["deepseek", "qwen3", "mixtral"],
                        choices=[c for c in CONFIGS if c != "small"])
    parser.add_argument("--products", nargs="*", default=None, help="label prefixes to run (default: all)")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    device = jax.devices()[0].device_kind
    now = datetime.datetime.now(datetime.timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gluon_layer_ops_{device.replace(' ', '_')}_{now:%Y-%m-%d}.json"
    rows_out = []
    for layer in args.layers:
        config = CONFIGS[layer]
        for label, (flops, (ref_fn, ref_operands), variants) in _products(config).items():
            if args.products and not any(label.startswith(p) for p in args.products):
                continue
            want = jax.jit(ref_fn)(*ref_operands)
            ref_ms = _time_ms(ref_fn, ref_operands, args.reps)
            print(f"{layer:9s} {label:34s} {'triton (the layer)':52s} {ref_ms:7.3f} ms "
                  f"{flops / ref_ms / 1e9:6.1f} TFLOP/s", flush=True)
            for name, (fn, operands) in variants.items():
                row = {"layer": layer, "product": label, "variant": name, "reference_ms": ref_ms}
                try:
                    row["max_rel_err"] = _relative_error(jax.jit(fn)(*operands), want)
                    row["ms"] = _time_ms(fn, operands, args.reps)
                    row["tflops"] = flops / row["ms"] / 1e9
                    row["speedup_over_reference"] = ref_ms / row["ms"]
                    print(f"{layer:9s} {label:34s} {name:52s} {row['ms']:7.3f} ms {row['tflops']:6.1f} TFLOP/s "
                          f"x{row['speedup_over_reference']:.2f} err {row['max_rel_err']:.1e}", flush=True)
                except Exception as error:  # noqa: BLE001 - a failing variant is a result
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    print(f"{layer:9s} {label:34s} {name:52s} ERROR {row['error']}", flush=True)
                rows_out.append(row)
            path.write_text(json.dumps({"device": device, "date": now.isoformat(), "jax": jax.__version__,
                                        "reps": args.reps, "rows": rows_out}, indent=1))
        jax.clear_caches()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
