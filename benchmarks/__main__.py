"""One entry point for the benchmarks: ``python -m benchmarks <subcommand> [its options]``, from the
repository root.

Each subcommand runs one script of this folder exactly as ``python benchmarks/<script> [options]``
would (``python -m benchmarks <subcommand> --help`` prints the script's own options); ``gpu`` runs
``gpu_run.sh``'s named steps on the GPU machine. The scripts write their results under ``--out``
(most default to ``benchmarks/results``) with the device and the date in the file name and in the
JSON; ``benchmarks/README.md`` lists the results kept and the command that made each.
"""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The subcommands, grouped: name, script, what it measures. The usage text prints this table as is.
TABLE = """\
layer configs:
  layer         moe_layer.py            one MoE layer (Mixtral, Qwen3, DeepSeek, small): dense, moe_optimize,
                                        lax.ragged_dot, tokamax; the README's table
  profile       layer_profile.py        where a layer's forward+backward step spends its GPU time, kernel by kernel
  realworld     realworld_cpu.py        MaxText's and EasyDeL's dense MoE layers on a CPU, as shipped and rewritten
  train-step    train_step.py           a whole SGD step, moe_optimize on the step against on the layer (and dense)
  compile-time  compile_time.py         trace + lower + compile of a step, dense against moe_optimize

SonicMoE:
  sonic         sonic.py                SonicMoE's twelve layer shapes (arXiv 2512.14080, Figure 14) beside its numbers
  sonic-ab      sonic_ab.py             kernel-backend variants A/B on those shapes, alternated, with a per-kernel profile
  sonic-side-by-side sonic_side_by_side.py  SonicMoE itself (the shared harness, carried as .sonic) and ours on
                                        those shapes in one run on one GPU, with each side's clock under load

expert parallelism:
  ep            ep_overlap.py           the sharded layer at EP=2 and 4: transports, peer variants, back-to-back profiles
  ep-bench      ep_bench.py             bare transports, the exchange alone, FSDP weight gathers, NCCL settings
  ep-multiprocess ep_multiprocess.py    the sharded layer in one process per GPU against one process: times, exactness
  ep-first-call ep_first_call.py       the sharded forward+backward's first call in fresh processes, each under a
                                        timeout (stalls show with every thread's stack)
  peer-probe    peer_exchange_probe.py  the device-initiated peer exchange alone
  routing-sort  routing_sort.py         counting against comparison sort of the token copies

FP8:
  fp8           fp8_gmm_bench.py        the FP8-weight grouped GEMM against bf16 weights
  fp8-layer     fp8_layer_bench.py      the sharded layer with FP8 FSDP weight gathers against bf16

kernel sweeps:
  gmm-sweep     gmm_sweep.py            gmm / tgmm alone per tile shape (sets the tile table)
  tgmm-ab       tgmm_ab.py              the weight-gradient kernel against other revisions' (A/B)
  swiglu        swiglu_fusion.py        the fused SwiGLU up-projection against two gmm calls
  swiglu-rows   swiglu_rows_sweep.py    swiglu_rows launch shapes against XLA's fusion
  dense-ceiling dense_ceiling.py        dense cuBLAS products of SonicMoE's shapes: the ceiling for any MoE layer
  hbm-bandwidth hbm_bandwidth.py        HBM read / write / copy bandwidth, and the DeepSeek layer's byte floor at it
  kernel-resources kernel_resources.py  registers, spills, shared memory and pipeline stages per kernel, compiled
                                        offline for sm_90 (no GPU)
  gluon-gmm     gluon_gmm_probe.py      the Hopper-native Gluon grouped GEMM (grouped_matmul_sm90): checks, and
                                        TFLOP/s against gmm_kernel, torch._grouped_mm and dense at d = 4096
  gluon-tgmm-ab gluon_tgmm_ab.py        the Hopper weight-gradient kernels against another revision's, DeepSeek-V3's
                                        products with multinomial and skewed group sizes (A/B)
  gluon-forward-ab gluon_forward_ab.py  the layer's forward and input-gradient products, one form at a time, on the
                                        Gluon kernels against Triton's gmm_kernel at the benchmark layers' shapes
  gluon-jax     gluon_jax.py            the Gluon grouped GEMMs launched from JAX against our Triton ones, d = 4096
  gluon-layer-ops gluon_layer_ops.py    the layer's grouped products (gathered weight gradients included) at
                                        the benchmark layers' shapes, Triton's kernels beside every Gluon config
  peer-heap-copy peer_heap_copy.py      the peer heap receiver's copy alone against a device copy

GPU machine:
  gpu           gpu_run.sh              install the carried wheels, then run gpu_run.sh's named steps
"""
# name -> script, read off the table's rows that name one (a continuation line has no script).
SCRIPTS = dict(re.findall(r"(?m)^  (\S+) +(\S+\.(?:py|sh)) ", TABLE))


def usage() -> str:
    return ("usage: python -m benchmarks <subcommand> [options]   (options: python -m benchmarks <subcommand> --help)"
            f"\n\n{TABLE}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, options = argv[0], argv[1:]
    if name not in SCRIPTS:
        print(f"{usage()}\n\nunknown subcommand {name!r}", file=sys.stderr)
        return 2
    script = HERE / SCRIPTS[name]
    if script.suffix == ".sh":
        return subprocess.call(["bash", str(script), *options])
    sys.argv = [str(script), *options]
    sys.path.insert(0, str(HERE))  # as when the script is run by path: it imports its sibling scripts
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
