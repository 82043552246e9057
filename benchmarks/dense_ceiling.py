"""What a dense GEMM reaches on the expert products of SonicMoE's twelve shapes: the ceiling for any MoE layer.

For each shape the six products of a SwiGLU expert layer with ``M = T * K`` routed rows, run as plain dense
cuBLAS products through torch (no routing, no gather, no grouping: strictly less work than the layer):
forward ``[M, d] @ [d, 2n]`` and ``[M, n] @ [n, d]``; backward the two input gradients ``[M, d] @ [d, n]`` and
``[M, 2n] @ [2n, d]`` and the two weight gradients ``[n, M] @ [M, d]`` and ``[d, M] @ [M, 2n]``. Timed by CUDA
events (``triton.testing.do_bench``), as SonicMoE's benchmark times. TFLOP/s as issue 20 counts them (forward
``6 T K d n``, backward twice that), beside SonicMoE's Figure 14 bars and the time a layer at 1.15x SonicMoE
would take, as a share of the dense products' time.

    python benchmarks/dense_ceiling.py --out results/dense_ceiling.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sonic import SHAPES  # noqa: E402

TARGET_RATIO = 1.15


def _ms(a, b) -> float:
    return triton.testing.do_bench(lambda: torch.mm(a, b), warmup=10, rep=100)


def _rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(0), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "rows": []}
    square = _rand(8192, 8192)
    square_ms = _ms(square, square)
    result["square_8192_tflops"] = 2 * 8192 ** 3 / square_ms / 1e9
    print(f"{result['device']} {result['date']}: dense 8192^3 bf16 {result['square_8192_tflops']:.0f} TFLOP/s")
    print(f"{'shape':12s} {'dense fwd/bwd TFLOP/s':>22s} {'Sonic fwd/bwd':>14s} {'Sonic/dense':>11s} "
          f"{'1.15x Sonic/dense':>17s}")
    for shape in SHAPES.values():
        m, d, n = shape.T * shape.K, shape.d, shape.n
        x, h, g2 = _rand(m, d), _rand(m, n), _rand(m, 2 * n)
        w_up, w_down = _rand(d, 2 * n), _rand(n, d)
        forward = [_ms(x, w_up), _ms(h, w_down)]
        del w_up, w_down
        backward = [_ms(x, _rand(d, n)), _ms(g2, _rand(2 * n, d)), _ms(h.T, x), _ms(x.T, g2)]
        del x, h, g2
        torch.cuda.empty_cache()
        fwd_flop, bwd_flop = 6.0 * m * d * n, 12.0 * m * d * n
        dense_fwd, dense_bwd = fwd_flop / sum(forward) / 1e9, bwd_flop / sum(backward) / 1e9
        dense_ms = sum(forward) + sum(backward)
        sonic_ms = fwd_flop / shape.sonic_fwd_tflops / 1e9 + bwd_flop / shape.sonic_bwd_tflops / 1e9
        row = {"shape": shape.name, "dense_fwd_tflops": dense_fwd, "dense_bwd_tflops": dense_bwd,
               "dense_ms": dense_ms, "sonic_ms": sonic_ms, "forward_ms": forward, "backward_ms": backward,
               "sonic_over_dense": dense_ms / sonic_ms, "target_over_dense": dense_ms / (sonic_ms / TARGET_RATIO)}
        result["rows"].append(row)
        print(f"{shape.name:12s} {dense_fwd:10.0f} / {dense_bwd:<9.0f} {shape.sonic_fwd_tflops:6d} / "
              f"{shape.sonic_bwd_tflops:<5d} {row['sonic_over_dense']:11.2f} {row['target_over_dense']:17.2f}",
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
