"""The sharded MoE layer with FP8 FSDP weight gathers against bf16 gathers, on a (fsdp, expert) mesh.

Per config (Mixtral-like, DeepSeek-like): the dense reference and the sparse layer with bf16,
``fp8_e4m3`` and ``mxfp8`` weight gathers, forward and forward+backward, timed back to back
(``ep_bench.Bench``), each output's relative error against the single-GPU sparse layer. Needs 4 GPUs
(or ``--smoke``: tiny shapes on 8 host CPU devices).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ep_bench import (  # noqa: E402
    CONFIGS,
    Bench,
    LayerBench,
    _print_table,
    add_bench_args,
    bench_from_args,
    make_mesh,
    rel_err,
    with_grad,
)

from moe_lowering.parallel.layout import plan_layout  # noqa: E402
from moe_lowering.parallel.sharded_moe import sharded_sparse_moe  # noqa: E402

log = logging.getLogger("fp8_layer_bench")

MESH = ((2, 2), ("fsdp", "expert"))
TOKENS = P(("fsdp", "expert"))
WEIGHTS = (P("expert", "fsdp", None), P("expert", "fsdp", None), P("expert", None, "fsdp"))


def measure(bench: Bench, layer: LayerBench, quant, with_backward: bool):
    cfg = layer.cfg
    mesh = make_mesh(*MESH)
    args = layer.sharded_args(mesh, TOKENS, WEIGHTS)
    layout = plan_layout(mesh, TOKENS, WEIGHTS, cfg.E)

    def forward(t, i, w, p):
        return sharded_sparse_moe(t, i, w, p, layer.program, num_experts=cfg.E, layout=layout,
                                  backend=bench.backend, weight_gather_quant=quant)

    fn = jax.jit(forward, out_shardings=NamedSharding(mesh, TOKENS))
    row = {"kind": "fp8_layer", "config": cfg.name, "mesh": "fsdp2xexpert2", "quant": quant or "bf16"}
    if with_backward:
        tokens, indices, weights, params = args
        cotangent = jax.device_put(layer.cotangent, NamedSharding(mesh, TOKENS))
        grad_fn = jax.jit(with_grad(lambda t, p: forward(t, indices, weights, p)))
        row["fwdbwd_ms_b2b"] = bench.time_back_to_back_ms(grad_fn, tokens, params, cotangent)
        return row
    out = fn(*args)
    row["fwd_ms_b2b"] = bench.time_back_to_back_ms(fn, *args)
    if layer.reference is not None:
        row["rel_err_vs_1gpu_sparse_bf16"] = rel_err(out, layer.reference)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    args = parser.parse_args(argv)
    bench = bench_from_args("fp8_layer", args)
    configs = (CONFIGS["smoke"],) if args.smoke else (CONFIGS["deepseek"], CONFIGS["mixtral"])
    for cfg in configs:
        layer = LayerBench(bench, cfg)
        bench.run(f"{cfg.name} 1gpu sparse", lambda: layer.single("sparse"), min_left=20)
        for quant in (None, "fp8_e4m3", "mxfp8"):
            bench.run(f"{cfg.name} fwd {quant}", lambda: measure(bench, layer, quant, False), min_left=20)
        for quant in (None, "fp8_e4m3"):
            bench.run(f"{cfg.name} fwdbwd {quant}", lambda: measure(bench, layer, quant, True), min_left=20)
        del layer
    _print_table(bench.doc["rows"])
    for row in bench.doc["rows"]:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "trace"})


if __name__ == "__main__":
    main()
