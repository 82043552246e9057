"""Does a TMA store epilogue lift the small-group weight gradient (``tgmm_resident_kernel``) off its store stalls?

At DeepSeek-V3's 128 rows per expert each weight gradient is bound by writing its ``[E, K, N]`` output
(7.5 GB at d = 7168, n = 2048): ``tgmm_resident_kernel`` reaches about 44% of HBM bandwidth (``NOTES.md``),
each ``[BLOCK_K, BLOCK_N]`` tile's pointer store waiting before the next tile's product starts. A TMA store
(``desc.store``) is issued from shared memory and completes asynchronously, so the next tile's product runs
under it. This probe launches, through Triton's own launcher on torch tensors (which allocates the device-side
descriptor's scratch), the resident kernel as it is and with the output tile stored through a descriptor of
the ``[G, K, N]`` output (clipped at each group's ``K``), checks both against torch, and times them by CUDA
events.

    python benchmarks/tma_store_probe.py --out results/tma_store_probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_lowering.kernels.grouped_matmul.triton_kernels import (  # noqa: E402
    _grad_rows,
    _group_rows,
    _local_group_rows,
    _transposed_dot,
    tgmm_resident_kernel,
)


@triton.jit
def _column_tiles_tma(lhs_ptr, grad_ptr, out_desc, local_group, group_start, group_end, col0, K: tl.constexpr,
                      N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                      WITH_HI: tl.constexpr):
    """``_resident_column_tiles`` with each output tile stored through ``out_desc``."""
    cols = col0 + tl.arange(0, BLOCK_N)
    in_k = tl.arange(0, BLOCK_K)
    in_lo = tl.arange(0, BLOCK_R)
    lo_rows = group_start + in_lo
    lo_ok = lo_rows < group_end
    b_lo = _grad_rows(grad_ptr, group_start, in_lo, lo_ok, cols, N, BLOCK_N, grad_ptr, 0)
    if WITH_HI:
        in_hi = tl.arange(0, BLOCK_R // 2)
        hi_rows = group_start + BLOCK_R + in_hi
        hi_ok = hi_rows < group_end
        b_hi = _grad_rows(grad_ptr, group_start + BLOCK_R, in_hi, hi_ok, cols, N, BLOCK_N, grad_ptr, 0)
    for pk in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        ks = pk * BLOCK_K + in_k
        ks_ok = (ks < K)[None, :]
        a_lo = tl.load(lhs_ptr + tl.cast(lo_rows, tl.int64)[:, None] * K + ks[None, :], mask=lo_ok[:, None] & ks_ok,
                       other=0.0)
        acc = _transposed_dot(a_lo, b_lo, tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32), False)
        if WITH_HI:
            a_hi = tl.load(lhs_ptr + tl.cast(hi_rows, tl.int64)[:, None] * K + ks[None, :],
                           mask=hi_ok[:, None] & ks_ok, other=0.0)
            acc = _transposed_dot(a_hi, b_hi, acc, False)
        out_desc.store([local_group, pk * BLOCK_K, col0], acc.to(out_desc.dtype).reshape(1, BLOCK_K, BLOCK_N))


@triton.jit
def tgmm_resident_tma_kernel(lhs_ptr, grad_ptr, group_sizes_ptr, group_offset_ptr, out_ptr, M: tl.constexpr,
                             K: tl.constexpr, N: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr,
                             NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """``tgmm_resident_kernel`` (groups of at most 1.5 ``BLOCK_R`` rows only) with TMA stores."""
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    group_ids, offset, starts, ends = _group_rows(group_sizes_ptr, group_offset_ptr, NUM_GROUPS, GROUPS_PAD)
    out_desc = tl.make_tensor_descriptor(out_ptr, [NUM_LOCAL_GROUPS, K, N], [K * N, N, 1], [1, BLOCK_K, BLOCK_N])
    for item in range(pid, NUM_LOCAL_GROUPS * n_tiles, NUM_PROGRAMS):
        local_group = item // n_tiles
        col0 = (item % n_tiles) * BLOCK_N
        group_start, group_end = _local_group_rows(group_ids, offset, starts, ends, local_group, M)
        if group_end - group_start <= BLOCK_R:
            _column_tiles_tma(lhs_ptr, grad_ptr, out_desc, local_group, group_start, group_end, col0, K, N, BLOCK_K,
                              BLOCK_N, BLOCK_R, False)
        else:
            _column_tiles_tma(lhs_ptr, grad_ptr, out_desc, local_group, group_start, group_end, col0, K, N, BLOCK_K,
                              BLOCK_N, BLOCK_R, True)


# (name, groups, rows per group, K, N): DeepSeek-V3's weight gradients (T = 4096, k = 8, E = 256).
PRODUCTS = [
    ("deepseek dW gate/up (7168 x 2048)", 256, 128, 7168, 2048),
    ("deepseek dW down (2048 x 7168)", 256, 128, 2048, 7168),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    gen = torch.Generator().manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = {"device": torch.cuda.get_device_name(0), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "triton": triton.__version__, "rows": []}
    for name, g, rows_per_group, k, n in PRODUCTS:
        choice = torch.randint(0, g, (g * rows_per_group,), generator=gen)
        sizes = torch.bincount(choice, minlength=g).to(torch.int32)
        assert int(sizes.max()) <= 192, "the probe's kernel takes groups of at most 1.5 x 128 rows"
        m = int(sizes.sum())
        lhs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        sizes_d = sizes.cuda()
        offset = torch.zeros(1, dtype=torch.int32, device="cuda")
        check_groups = [0, 1, g // 2, g - 1]
        starts = torch.cumsum(sizes, 0) - sizes
        consts = dict(M=m, K=k, N=n, NUM_LOCAL_GROUPS=g, NUM_GROUPS=g, GROUPS_PAD=triton.next_power_of_2(g),
                      BLOCK_K=128, BLOCK_N=128, BLOCK_R=128)
        work_items = g * -(-n // 128)
        for label, kernel, extra in (("pointer store (as shipped)", tgmm_resident_kernel, {"COMPUTE_F32": False}),
                                     ("TMA store", tgmm_resident_tma_kernel, {})):
            for programs_per_sm, warps, stages in ((1, 8, 3), (2, 4, 2), (1, 4, 3)):
                programs = min(work_items, num_sms * programs_per_sm)
                out = torch.full((g, k, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                row = {"product": name, "variant": f"{label} {programs_per_sm}/SM {warps} warps s{stages}"}
                try:
                    def launch(operands=(lhs, grad, sizes_d, offset, out)):
                        kernel[(programs,)](*operands, **consts, **extra, NUM_PROGRAMS=programs, num_warps=warps,
                                            num_stages=stages)
                    launch()
                    torch.cuda.synchronize()
                    err = 0.0
                    for e in check_groups:
                        s, z = int(starts[e]), int(sizes[e])
                        want = lhs[s:s + z].float().T @ grad[s:s + z].float()
                        err = max(err, ((out[e].float() - want).abs().max() / want.abs().max()).item())
                    ms = triton.testing.do_bench(launch, warmup=5, rep=60)
                    row.update(ms=round(ms, 3), store_tb_s=round(g * k * n * 2 / ms / 1e9, 2), rel_err=err,
                               finite=bool(torch.isfinite(out).all()))
                except Exception as exc:  # report and go on
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
                del out
        del lhs, grad
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
