"""Does the routing's gather mode matter? The single-GPU rewritten layer with ``jnp.take``'s
``"fill"`` mode (a select over every gathered element) against ``"clip"`` (``sparse_moe.IN_RANGE``).

The permute and combine gathers index in range by construction, so both modes give the same
numbers (checked here, bit for bit); only the extra pass differs. Alternating rounds, median of
``--reps`` synced calls each, forward and forward+backward; writes
``gather_mode_<device>_<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_layer import CONFIGS, _fwd_bwd, _time_ms  # noqa: E402

from moe_lowering import moe_optimize, sparse_moe  # noqa: E402
from moe_lowering.testing.zoo import Sizes, build_mixtral  # noqa: E402

log = logging.getLogger("gather_mode")
MODES = ("fill", "clip")


def time_mode(model, mode: str, params, x, cotangent, reps: int) -> dict:
    sparse_moe.IN_RANGE = mode
    layer = moe_optimize(lambda p, t: model.fn(p, t))  # a fresh function: traced with this mode
    forward = jax.jit(layer).lower(params, x).compile()
    out = forward(params, x)
    both = jax.jit(_fwd_bwd(layer)).lower(params, x, cotangent).compile()
    return {"mode": mode, "fwd_ms": _time_ms(forward, (params, x), reps),
            "fwdbwd_ms": _time_ms(both, (params, x, cotangent), reps), "out": out}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["mixtral", "deepseek"])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of both modes")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    device = jax.devices()[0]
    rows, committed = [], sparse_moe.IN_RANGE
    try:
        for name in args.configs:
            config = CONFIGS[name]
            model = build_mixtral(Sizes(T=config.T, d=config.d, f=config.f, E=config.E, k=config.k))
            params, x = model.args(jax.random.key(1), jnp.bfloat16)
            cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
            outputs = {}
            for round_index in range(args.rounds):
                for mode in MODES:
                    row = time_mode(model, mode, params, x, cotangent, args.reps)
                    outputs[mode] = np.asarray(row.pop("out").astype(jnp.float32))
                    rows.append({"config": name, "round": round_index, **row})
                    log.info("%s", json.dumps(rows[-1]))
            rows.append({"config": name, "outputs_equal": bool(np.array_equal(*outputs.values()))})
            log.info("%s", json.dumps(rows[-1]))
    finally:
        sparse_moe.IN_RANGE = committed
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gather_mode_{device.device_kind.replace(' ', '_')}_{stamp}.json"
    path.write_text(json.dumps({"device": device.device_kind, "jax": jax.__version__, "rows": rows}, indent=1))
    print(path)


if __name__ == "__main__":
    main()
