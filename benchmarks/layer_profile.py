"""Where one forward+backward step of ``moe_optimize``'s layer spends its GPU time, kernel by kernel.

Builds the benchmark layers of ``moe_layer.py`` (the zoo's Mixtral-idiom dense reference, rewritten
by ``moe_optimize``), traces a few steps with ``jax.profiler`` and prints, per layer, the GPU time per
step of the kernels that take the most (``ep_overlap.profile_summary``), so the next kernel to work
on is read off a measurement. Writes the summaries as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ep_overlap import profile_summary  # noqa: E402
from moe_layer import CONFIGS, _fwd_bwd, _optimized_layer  # noqa: E402

from moe_lowering.testing.zoo import Sizes, build_mixtral  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["deepseek", "qwen3", "mixtral"])
    parser.add_argument("--steps", type=int, default=3, help="traced steps (times are per step)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for name in args.configs:
        config = CONFIGS[name]
        model = build_mixtral(Sizes(T=config.T, d=config.d, f=config.f, E=config.E, k=config.k))
        params, x = model.args(jax.random.key(1), jnp.bfloat16)
        cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
        layer, _ = _optimized_layer(model.fn, config.k, x.dtype)
        summary = profile_summary(jax.jit(_fwd_bwd(layer)), (params, x, cotangent), args.out / f"trace_{name}",
                                  steps=args.steps)
        summaries[name] = summary
        print(f"== {name}: {summary.get('window_ms_per_step', float('nan')):.2f} ms a step, "
              f"{summary.get('compute_ms', float('nan')):.2f} ms of it in kernels")
        for kernel, ms in summary.get("top_kernels_ms", {}).items():
            print(f"  {ms:8.3f} ms  {kernel}")
        del params, x, cotangent
        jax.clear_caches()
    (args.out / "layer_profile.json").write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
