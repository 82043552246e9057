"""Registers, spills and shared memory of the Triton kernels for Hopper, compiled offline: no GPU needed.

Each kernel of the SwiGLU expert's products is compiled for ``sm_90`` (Triton's own ``ptxas``) at the
tile its launcher picks for one of SonicMoE's shapes, with 16-byte aligned pointers (as launches of
XLA buffers specialise them: without that, alignment analysis gives up on 16-byte loads and nothing
is software-pipelined), and ``cuobjdump -res-usage`` reads the result. Per kernel: registers per
thread, stack bytes per thread (spills: the local-memory traffic a kernel pays in its loops), shared
memory, and the pipeline stages that shared memory holds. A kernel edit's register pressure can so be
checked on a CPU before it costs GPU time (``NOTES.md``: an epilogue that spilled 4.9 KB per thread
ran 12x slower than its neighbour), and so can whether a launch fits an H100's or H200's shared
memory (``SHARED_LIMIT``): the products written in float32 (forward mode's compositions, the FP8
weights' fallback, float32 weights' gradients) are listed too, as a flattened tile with a float32
output once did not fit.

    python benchmarks/kernel_resources.py --shapes 1.4B-n256 7B-n256 --out /tmp/res
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sonic import SHAPES  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H100_MULTIPROCESSORS = 132
SHARED_LIMIT = 232448
"""Shared memory a block may use on an H100 or H200 (227 KB); a launch asking more fails."""
INDEX_POINTERS = {"group_sizes_ptr", "group_offset_ptr", "row_index_ptr", "grad_index_ptr"}
FLOAT32_POINTERS = {"row_scale_ptr", "grad_scale_ptr", "dots_ptr"}


def resources(kernel, constexprs: dict, num_warps: int, num_stages: int, float32_out: bool = False) -> dict:
    """``kernel`` compiled for ``sm_90`` with bf16 data pointers (``out_ptr`` float32 with
    ``float32_out``): registers, stack and shared bytes."""
    float32_pointers = FLOAT32_POINTERS | ({"out_ptr"} if float32_out else set())
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = ("*i32" if name in INDEX_POINTERS else "*fp32" if name in float32_pointers
                               else "*bf16")
        else:
            signature[name] = "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if signature[name].startswith("*")}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned),
                              target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as scratch:
        cubin = Path(scratch) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {kernel.fn.__name__}: {usage[-300:]}")
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2)),
            "shared_bytes": int(compiled.metadata.shared), "num_warps": num_warps, "num_stages": num_stages}


def _launchers():
    """The launchers' tile tables, importable without jax_triton or a GPU (nothing is launched here):
    a CPU machine gets a placeholder ``jax_triton`` module and an H100's multiprocessor count."""
    try:
        import jax_triton  # noqa: F401
    except ImportError:
        sys.modules["jax_triton"] = types.ModuleType("jax_triton")
    from moe_lowering.kernels.grouped_matmul import triton_launch

    triton_launch._multiprocessor_count = lambda: H100_MULTIPROCESSORS
    return triton_launch


def kernel_specs(shape):
    """``(label, kernel, constexprs, num_warps, num_stages, bytes of one pipeline stage, float32 output)``
    for each product of ``shape``'s SwiGLU expert forward and backward at its launcher's table tile,
    then ``gmm_kernel``'s products written in float32."""
    from moe_lowering.kernels.grouped_matmul import triton_kernels as grouped
    from moe_lowering.kernels.swiglu_gmm import triton_kernels as swiglu

    launch = _launchers()
    from moe_lowering.kernels.swiglu_gmm.triton_launch import swiglu_config

    rows, d, n, experts = shape.T * shape.K, shape.d, shape.n, shape.E
    groups = dict(NUM_LOCAL_GROUPS=experts, NUM_GROUPS=experts, GROUPS_PAD=launch._next_power_of_two(experts),
                  COMPUTE_F32=False)

    def row_tiled(k, out_n, config=None, flattened_loop=False, **extra):
        config = config or launch.gmm_config(rows, k, out_n, experts, False, flattened_loop)
        tile = dict(groups, M=rows, K=k, N=out_n, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                    BLOCK_K=config.block_k, GROUP_M=config.group_m,
                    NUM_PROGRAMS=launch._row_tile_grid(rows, out_n, experts, config), FLATTEN=config.flatten,
                    **extra)
        return tile, config.num_warps, config.num_stages, 2 * config.block_k * (config.block_m + config.block_n)

    def weight_tiled(k, out_n, extra_stages=0, **extra):
        config = launch.tgmm_config(rows, k, out_n, experts, False)
        config = launch.dataclasses.replace(config, num_stages=config.num_stages + extra_stages)
        tile = dict(groups, M=rows, K=k, N=out_n, BLOCK_K=config.block_m, BLOCK_N=config.block_n,
                    BLOCK_R=config.block_k, GROUP_M=config.group_m,
                    NUM_PROGRAMS=launch._grid_size(experts * (k // config.block_m) * (out_n // config.block_n), config),
                    **extra)
        return tile, config.num_warps, config.num_stages, 2 * config.block_k * (config.block_m + config.block_n)

    from moe_lowering.kernels.swiglu_gmm.triton_launch import FUSED_MAX_N
    from moe_lowering.sparse_moe import COMBINE_IN_LAST_PRODUCT_MAX_WIDTH

    if n > FUSED_MAX_N:
        raise ValueError(f"{shape.name}: experts wider than {FUSED_MAX_N} run gmm_pair, which this does not list")
    up = swiglu_config(rows, d, n, experts, False)
    up_stage = 2 * up.block_k * (up.block_m + 2 * up.block_n)
    specs = [
        ("forward: up projection, gathered rows", swiglu.gather_swiglu_gmm_kernel,
         *row_tiled(d, n, up, LHS_SOURCE_ROWS=shape.T)[:3], up_stage),
        ("training forward: up projection and pre-activations", swiglu.gather_swiglu_gmm_preactivations_kernel,
         *row_tiled(d, n, up, LHS_SOURCE_ROWS=shape.T)[:3], up_stage),
        ("forward: down projection", grouped.gmm_kernel, *row_tiled(n, d, flattened_loop=True, TRANSPOSE_RHS=False)),
        ("backward: d_rows of gate and up (gmm_sum)", grouped.gmm_sum_kernel, *row_tiled(2 * n, d)),
        ("backward: d_w_gate, d_w_up, gathered token rows", grouped.gather_lhs_tgmm_kernel,
         *weight_tiled(n, d, launch.GATHERED_ROWS_EXTRA_STAGES, GRAD_SOURCE_ROWS=shape.T)),
    ]
    if n <= COMBINE_IN_LAST_PRODUCT_MAX_WIDTH:  # the down projection and the combine as one piece
        specs += [("backward: d_act, gathered cotangent, dots", grouped.gather_gmm_kernel,
                   *row_tiled(d, n, LHS_SOURCE_ROWS=shape.T, TRANSPOSE_RHS=True, WITH_DOTS=True)),
                  ("backward: d_w_down, gathered cotangent", grouped.gather_tgmm_kernel,
                   *weight_tiled(n, d, GRAD_SOURCE_ROWS=shape.T))]
    else:
        specs += [("backward: d_act (spread cotangent)", grouped.gmm_kernel,
                   *row_tiled(d, n, flattened_loop=True, TRANSPOSE_RHS=True)),
                  ("backward: d_w_down (spread cotangent)", grouped.tgmm_kernel, *weight_tiled(n, d))]
    for label, kernel, constexprs, warps, stages, stage_bytes in specs:
        if "FLATTEN" not in kernel.arg_names:  # only gmm_kernel reads TileConfig.flatten
            constexprs = {name: value for name, value in constexprs.items() if name != "FLATTEN"}
        if kernel is grouped.gmm_sum_kernel:
            constexprs = {**constexprs, "K": n}  # gmm_sum's K is each product's; the tile was picked for 2n
        yield label, kernel, constexprs, warps, stages, stage_bytes, False
    for label, k, out_n in (("float32 output: down projection", n, d), ("float32 output: up projection", d, n)):
        table = launch.gmm_config(rows, k, out_n, experts, False, flattened_loop=True)
        config = launch._for_output(table, "float32")  # as gmm and gmm_pair launch it
        constexprs, warps, stages, stage_bytes = row_tiled(k, out_n, config, TRANSPOSE_RHS=False)
        yield label, grouped.gmm_kernel, constexprs, warps, stages, stage_bytes, True
    # a weight gradient in float32 beside bf16 activations (float32 master weights): its tile at the launch's stages
    yield ("float32 output: d_w_gate, d_w_up, gathered token rows", grouped.gather_lhs_tgmm_kernel,
           *weight_tiled(n, d, launch.GATHERED_ROWS_EXTRA_STAGES, GRAD_SOURCE_ROWS=shape.T), True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1.4B-n256", "7B-n256", "30B-n256", "1.4B-n512"],
                        choices=sorted(name for name, shape in SHAPES.items() if shape.n <= 512))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    result = {"target": "sm_90", "triton": triton.__version__, "date": datetime.date.today().isoformat(), "rows": []}
    print(f"triton {triton.__version__}, compiled for sm_90 (no GPU used)")
    print(f"{'shape':10s} {'kernel':52s} {'regs':>4s} {'stack':>5s} {'shared KB':>9s} {'stages':>6s}")
    for name in args.shapes:
        for label, kernel, constexprs, warps, stages, stage_bytes, float32_out in kernel_specs(SHAPES[name]):
            row = {"shape": name, "kernel": label, "function": kernel.fn.__name__,
                   **resources(kernel, constexprs, warps, stages, float32_out)}
            row["stages_in_shared"] = row["shared_bytes"] // stage_bytes
            row["fits"] = row["shared_bytes"] <= SHARED_LIMIT
            result["rows"].append(row)
            print(f"{name:10s} {label:52s} {row['registers']:4d} {row['stack_bytes']:5d} "
                  f"{row['shared_bytes'] / 1024:9.0f} {row['stages_in_shared']:4d}/{stages}"
                  f"{'' if row['fits'] else '  OVER THE SHARED-MEMORY LIMIT'}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernel_resources_sm90_{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    return path


if __name__ == "__main__":
    main()
