"""The sharded layer's first forward+backward call, in fresh processes, each under a timeout.

One process driving several GPUs launches each GPU's kernels from its own thread, and a peer
exchange's wait spins on one GPU until another GPU's launch thread has pushed its rows: anything
that holds up a launch thread while another GPU spins can deadlock the first call (on 2 x H200,
2026-11-28: the Gluon weight gradient loaded its kernel at its first launch under a lock, see
``EP_NOTES.md``). A stalled call shows only in a fresh process, so each run is a new one: the child
logs its phases (lowered, compiled, first call done, back-to-back time, checksums, kernels loaded at
launch) and dumps every thread's Python stack every 45 s; the parent records each run's outcome in
``ep_first_call_<device>_<date>.json``. ``--smoke`` runs tiny shapes on host CPU devices.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(config: str, mode: str, ep: int, transport: str) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(45, repeat=True)
    sys.path.insert(0, str(HERE))
    import ep_bench
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from moe_lowering.parallel import plan_layout, sharded_sparse_moe

    start = time.time()

    def say(*parts):
        print(f"[{time.time() - start:7.1f}s]", *parts, flush=True)

    cfg = ep_bench.CONFIGS[config]
    layer = ep_bench.LayerBench(None, cfg)
    mesh = ep_bench.make_mesh((ep,), ("expert",))
    specs = [P("expert")] * 3
    tokens, indices, weights, params = layer.sharded_args(mesh, P("expert"), specs)
    cotangent = jax.device_put(layer.cotangent, NamedSharding(mesh, P("expert")))
    layout = plan_layout(mesh, P("expert"), specs, cfg.E)

    def layer_fn(t, p, i, w):
        return sharded_sparse_moe(t, i, w, p, layer.program, num_experts=cfg.E, layout=layout,
                                  exchange_transport=transport)

    if mode == "closure":  # the routing as constants of the program
        fn = jax.jit(ep_bench.with_grad(lambda t, p: layer_fn(t, p, indices, weights)))
        args = (tokens, params, cotangent)
    else:
        fn = jax.jit(ep_bench.with_grad(layer_fn))
        args = (tokens, params, cotangent, indices, weights)
    compiled = fn.lower(*args).compile()
    say("compiled")
    jax.block_until_ready(compiled(*args))
    say("first call done")
    for _ in range(3):
        out = compiled(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(10):
        out = compiled(*args)
    jax.block_until_ready(out)
    ms = 1e3 * (time.perf_counter() - t0) / 10
    from moe_lowering.kernels.grouped_matmul_sm90 import xla_call

    loads = getattr(xla_call._driver, "launch_time_loads", None)
    checksums = [float(jnp.sum(jnp.abs(x.astype(jnp.float32)))) for x in jax.tree.leaves(out)]
    faulthandler.cancel_dump_traceback_later()
    print("RESULT " + json.dumps(dict(ms_b2b=ms, checksums=checksums, launch_time_loads=loads)), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["deepseek", "mixtral"], help="ep_bench layer configs")
    parser.add_argument("--modes", nargs="+", default=["args", "closure"], choices=["args", "closure"],
                        help="the routing passed to the step, or closed over")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per config and mode")
    parser.add_argument("--ep", type=int, default=2, help="GPUs in the expert mesh")
    parser.add_argument("--transport", default="peer", help="exchange_transport")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds a run may take before it counts as stalled")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on host CPU devices")
    parser.add_argument("--child", nargs=4, metavar=("CONFIG", "MODE", "EP", "TRANSPORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        config, mode, ep, transport = args.child
        child(config, mode, int(ep), transport)
        return 0
    env = dict(os.environ)
    if args.smoke:
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.ep}"
        args.configs, args.transport = ["smoke"], "auto"
    rows = []
    for run in range(args.runs):
        for config in args.configs:
            for mode in args.modes:
                command = [sys.executable, __file__, "--child", config, mode, str(args.ep), args.transport]
                started = time.time()
                try:
                    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
                    output, status = done.stdout + done.stderr, ("ok" if done.returncode == 0 else "failed")
                except subprocess.TimeoutExpired as stalled:
                    output = (stalled.stdout or b"").decode() + (stalled.stderr or b"").decode()
                    status = "stalled"
                row = dict(config=config, mode=mode, ep=args.ep, transport=args.transport, run=run, status=status,
                           seconds=round(time.time() - started, 1))
                result = [line for line in output.splitlines() if line.startswith("RESULT ")]
                row.update(json.loads(result[-1][7:]) if result else {})
                if status != "ok":
                    row["log_tail"] = [line for line in output.splitlines() if "INFO" not in line][-40:]
                print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
                rows.append(row)
    import jax

    device = jax.devices()[0].device_kind.replace(" ", "_") if not args.smoke else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ep_first_call_{device}_{datetime.date.today():%Y%m%d}.json"
    path.write_text(json.dumps(dict(device=device, date=str(datetime.date.today()), rows=rows), indent=1))
    print("wrote", path)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
