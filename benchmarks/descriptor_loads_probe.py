"""TMA-descriptor loads in the row-tiled grouped products, with and without Triton's warp specialisation.

Three questions, each answered on torch tensors through Triton's own launcher (which gives device-side
descriptors their global scratch and launches a warp-specialised kernel's full warp count), each variant
checked and timed by CUDA events (``triton.testing.do_bench``):

* default: ``gmm_kernel``'s product (the table's flattened 128 x 256 x 64 pointer-load tile) against the
  same tile loop with both operands TMA loads, flattened, and against it warp-specialised: Triton 3.6
  warp-specialises a ``tl.range(..., warp_specialize=True)`` loop on sm_90 when its loads are descriptor
  loads and the kernel asks for 4 warps (one producer warp group, two consumer groups splitting the
  128-row tile), so the next tile's loads run during this tile's store. The pass takes no reduction in
  the loop, so the probe's kernel reads each tile's position from a host-computed table;
* ``--gathered``: ``gather_gmm_kernel`` as shipped against its weights read through a descriptor (the
  gathered rows stay pointer loads: Hopper's TMA has no row gather), bit for bit;
* ``--diagnose``: where the warp-specialised kernels' outputs go wrong, on small products.

    python benchmarks/descriptor_loads_probe.py --out results/descriptor_loads_probe.json
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
    _group_layout,
    _tile_position,
    gather_gmm_kernel,
    gmm_kernel,
)

NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


@triton.jit
def ws_gmm_kernel(lhs_ptr, rhs_ptr, tile_info_ptr, num_tiles_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr,
                  N: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr, TRANSPOSE_RHS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                  WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr):
    """``gmm_kernel``'s product with TMA-descriptor loads (rows past the group read and never
    stored, as there; rows past ``M`` zero-filled by the TMA unit) and a masked pointer store.

    The warp-specialisation pass takes no reductions in the loop it partitions, so each work item's
    ``(first row, local group, group end, column tile)`` is read from ``tile_info`` (``_tile_info``)."""
    pid = tl.program_id(0)
    num_tiles = tl.load(num_tiles_ptr)
    a_desc = tl.make_tensor_descriptor(lhs_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    if TRANSPOSE_RHS:
        b_desc = tl.make_tensor_descriptor(rhs_ptr, [NUM_LOCAL_GROUPS * N, K], [K, 1], [BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(rhs_ptr, [NUM_LOCAL_GROUPS * K, N], [N, 1], [BLOCK_K, BLOCK_N])
    in_m = tl.arange(0, BLOCK_M)
    for tile in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        row0 = tl.load(tile_info_ptr + 4 * tile)
        local = tl.load(tile_info_ptr + 4 * tile + 1)
        group_end = tl.load(tile_info_ptr + 4 * tile + 2)
        pn = tl.load(tile_info_ptr + 4 * tile + 3)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
            a = a_desc.load([row0, k])
            if TRANSPOSE_RHS:
                b = b_desc.load([local * N + pn * BLOCK_N, k]).T
            else:
                b = b_desc.load([local * K + k, pn * BLOCK_N])
            acc = tl.dot(a, b, acc)
        rows = row0 + in_m
        cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + tl.cast(row0, tl.int64) * N + in_m[:, None] * N + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < group_end)[:, None] & (cols < N)[None, :])


@triton.jit
def gather_gmm_tma_kernel(lhs_ptr, rhs_ptr, row_index_ptr, row_scale_ptr, dot_with_ptr, group_sizes_ptr,
                          group_offset_ptr, out_ptr, dots_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                          LHS_SOURCE_ROWS: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr, NUM_GROUPS: tl.constexpr,
                          GROUPS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                          WITH_DOTS: tl.constexpr):
    """``gather_gmm_kernel`` (``rhs`` read transposed) with the weights loaded through a TMA descriptor of
    the ``[G * N, K]`` weights, the gathered rows still by pointer: the operand a TMA unit can fetch."""
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    group_ids, sizes, offset, starts, ends, is_local, m_tiles, tile_ends, num_tiles = _group_layout(
        group_sizes_ptr, group_offset_ptr, n_tiles, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M
    )
    rhs_desc = tl.make_tensor_descriptor(rhs_ptr, [NUM_LOCAL_GROUPS * N, K], [K, 1], [BLOCK_N, BLOCK_K])
    in_m = tl.arange(0, BLOCK_M)
    in_k = tl.arange(0, BLOCK_K)
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        group, group_start, group_end, pm, pn = _tile_position(tile, group_ids, starts, ends, m_tiles, tile_ends,
                                                               n_tiles, M, GROUP_M)
        row0 = group_start + pm * BLOCK_M
        cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        tile_rows = tl.minimum(row0 + in_m, M - 1) - row0
        source = tl.load(row_index_ptr + row0 + tile_rows)
        source = tl.minimum(tl.maximum(source, 0), LHS_SOURCE_ROWS - 1)
        a_ptrs = lhs_ptr + tl.cast(source, tl.int64)[:, None] * K + in_k[None, :]
        weight_row0 = (group - offset) * N + pn * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs)
            b = rhs_desc.load([weight_row0, k0]).T
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
        rows = row0 + in_m
        in_rows = rows < group_end
        offsets = tl.cast(row0, tl.int64) * N + in_m[:, None] * N + cols[None, :]
        store_mask = in_rows[:, None] & (cols < N)[None, :]
        scale = tl.load(row_scale_ptr + rows, mask=in_rows, other=0.0)
        tl.store(out_ptr + offsets, (acc * scale[:, None]).to(out_ptr.dtype.element_ty), mask=store_mask)
        if WITH_DOTS:
            other = tl.load(dot_with_ptr + offsets, mask=store_mask, other=0.0).to(tl.float32)
            tl.store(dots_ptr + pn * M + rows, tl.sum(acc * other, axis=1), mask=in_rows)


# (name, tokens T, top-k, d, n, experts): gather_gmm's product in the backward, d_act = w * dY[token] @ W_down^T.
GATHERED = [
    ("1.4B-n256 gather_gmm", 40960, 8, 768, 256, 128),
    ("7B-n256 gather_gmm", 24576, 8, 1536, 256, 128),
    ("1.4B-n512 gather_gmm", 40960, 4, 768, 512, 64),
    ("30B-n512 gather_gmm", 32768, 8, 4096, 512, 128),
]


def gathered(gen) -> list:
    """``gather_gmm_kernel`` as shipped (table tile, unflattened) against TMA weight loads, checked
    against each other and against a torch product on sampled rows."""
    rows_out = []
    for name, t, top_k, d, n, g in GATHERED:
        m = t * top_k
        sizes = _group_sizes(m, g, gen)
        row_index = torch.randint(0, t, (m,), generator=gen).to(torch.int32).cuda()
        row_scale = torch.rand(m, generator=gen).cuda()
        d_out = torch.randn(t, d, generator=gen).to(torch.bfloat16).cuda()
        w_down = (torch.randn(g, n, d, generator=gen) / d ** 0.5).to(torch.bfloat16).cuda()
        dot_with = torch.randn(m, n, generator=gen).to(torch.bfloat16).cuda()
        sizes_d = sizes.cuda()
        offset = torch.zeros(1, dtype=torch.int32, device="cuda")
        consts = dict(M=m, K=d, N=n, LHS_SOURCE_ROWS=t, NUM_LOCAL_GROUPS=g, NUM_GROUPS=g,
                      GROUPS_PAD=triton.next_power_of_2(g), BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8,
                      NUM_PROGRAMS=NUM_SMS, WITH_DOTS=True)
        outputs = {}
        for label, kernel, extra, stages in (("shipped 128x256x64 s4", gather_gmm_kernel,
                                              {"TRANSPOSE_RHS": True, "COMPUTE_F32": False}, 4),
                                             ("tma weights 128x256x64 s4", gather_gmm_tma_kernel, {}, 4),
                                             ("tma weights 128x256x64 s3", gather_gmm_tma_kernel, {}, 3),
                                             ("tma weights 128x256x64 s5", gather_gmm_tma_kernel, {}, 5)):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            dots = torch.zeros((-(-n // 256), m), dtype=torch.float32, device="cuda")
            row = {"product": name, "variant": label}
            try:
                def launch():
                    return kernel[(NUM_SMS,)](d_out, w_down, row_index, row_scale, dot_with, sizes_d, offset, out,
                                              dots, **consts, **extra, num_warps=8, num_stages=stages)
                compiled = launch()
                torch.cuda.synchronize()
                outputs[label] = (out.clone(), dots.clone())
                base_out, base_dots = next(iter(outputs.values()))
                ms = triton.testing.do_bench(launch, warmup=25, rep=200)
                row.update(ms=round(ms, 4), tflops=round(2.0 * m * d * n / ms / 1e9, 1),
                           same_bits_as_shipped=bool(torch.equal(out, base_out) and torch.equal(dots, base_dots)),
                           finite=bool(torch.isfinite(out).all()), shared=compiled.metadata.shared,
                           registers=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None))
            except Exception as exc:  # report and go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(row), flush=True)
            rows_out.append(row)
        base_out = next(iter(outputs.values()))[0] if outputs else None
        if base_out is not None:
            sample = torch.randint(0, m, (256,), generator=gen)
            starts = torch.cumsum(sizes, 0) - sizes
            group_of = torch.searchsorted(torch.cumsum(sizes, 0), sample, right=True)
            want = torch.stack([row_scale[r].cpu() * (d_out[row_index[r]].float().cpu()
                                                      @ w_down[group_of[i]].float().cpu().T)
                                for i, r in enumerate(sample.tolist())])
            got = base_out[sample.cuda()].float().cpu()
            err = ((got - want).abs().max() / want.abs().max()).item()
            print(json.dumps({"product": name, "shipped_rel_err_vs_torch": err, "rows_checked": 256,
                              "group_starts_ok": bool(starts[-1] < m)}), flush=True)
    return rows_out


@triton.jit
def ws_dense_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``a @ b`` a program, descriptor loads: the smallest case of the pass."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [N, 1], [BLOCK_K, BLOCK_N])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        acc = tl.dot(a_desc.load([pid_m * BLOCK_M, k]), b_desc.load([k, pid_n * BLOCK_N]), acc)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty))


def diagnose() -> list:
    """Where the warp-specialised kernels' outputs go wrong, on small products."""
    gen = torch.Generator().manual_seed(1)
    m, k, n = 1024, 256, 512
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    b = torch.randn(k, n, generator=gen).to(torch.bfloat16).cuda()
    dense_expected = (a.float() @ b.float())
    sizes = torch.full((4,), m // 4, dtype=torch.int32)
    rhs = torch.randn(4, k, n, generator=gen).to(torch.bfloat16).cuda()
    grouped_expected = _reference(a, rhs, sizes, False).float()
    info, num_tiles = _tile_info(sizes, n, 128, 256)
    info, num_tiles_d = info.cuda(), torch.tensor([num_tiles], dtype=torch.int32, device="cuda")
    cases = {}
    for ws in (False, True):
        for stages in (2, 3):
            cases[f"dense ws={ws} s{stages}"] = (dense_expected, lambda c, ws=ws, stages=stages: ws_dense_kernel[
                (m // 128, n // 256)](a, b, c, M=m, N=n, K=k, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                                      WARP_SPECIALIZE=ws, num_warps=4, num_stages=stages))
    for programs in (num_tiles, 3):
        for ws in (False, True):
            cases[f"grouped ws={ws} programs={programs}"] = (grouped_expected, lambda c, ws=ws, p=programs: ws_gmm_kernel[
                (p,)](a, rhs, info, num_tiles_d, c, M=m, K=k, N=n, NUM_LOCAL_GROUPS=4, TRANSPOSE_RHS=False,
                      BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, NUM_PROGRAMS=p, WARP_SPECIALIZE=ws, FLATTEN=not ws,
                      num_warps=4 if ws else 8, num_stages=3))
    rows = []
    for case, (expected, launch) in cases.items():
        c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        row = {"case": case}
        try:
            launch(c)
            torch.cuda.synchronize()
            row.update(_where_wrong(c, expected))
        except Exception as exc:  # report and go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _where_wrong(c, expected) -> dict:
    """NaN share (the output starts as NaN: unwritten elements), wrong share, and which 64-row halves."""
    c = c.float()
    finite = torch.isfinite(c)
    wrong = ~finite | ((c - expected).abs() > 0.02 * expected.abs().max())
    halves = wrong.reshape(-1, 64, c.shape[1]).any(dim=2).any(dim=1)
    return {"nan_share": 1 - finite.float().mean().item(), "wrong_share": wrong.float().mean().item(),
            "wrong_halves": halves.nonzero().flatten().tolist()[:16], "num_halves": halves.numel()}


def _tile_info(sizes, n: int, block_m: int, block_n: int, group_m: int = 8):
    """``[tiles, 4]`` int32 ``(first row, group, group end, column tile)`` in ``gmm_kernel``'s order
    (groups in turn, bands of ``group_m`` row tiles column-fastest), and the tile count."""
    n_tiles = -(-n // block_n)
    info = []
    start = 0
    for g, size in enumerate(sizes.tolist()):
        m_tiles = -(-size // block_m)
        for t in range(m_tiles * n_tiles):
            band_width = group_m * n_tiles
            first = (t // band_width) * group_m
            band_rows = min(m_tiles - first, group_m)
            within = t % band_width
            pm, pn = first + within % band_rows, within // band_rows
            info.append((start + pm * block_m, g, start + size, pn))
        start += size
    return torch.tensor(info, dtype=torch.int32).reshape(-1, 4), len(info)


# (name, rows M, K, N, groups, rhs read transposed): SonicMoE shapes' plain products.
PRODUCTS = [
    ("1.4B-n256 down fwd", 40960 * 8, 256, 768, 128, False),
    ("1.4B-n256 up dX", 40960 * 8, 512, 768, 128, True),
    ("7B-n256 down fwd", 24576 * 8, 256, 1536, 128, False),
    ("7B-n256 up dX", 24576 * 8, 512, 1536, 128, True),
    ("1.4B-n512 down fwd", 40960 * 4, 512, 768, 64, False),
    ("30B-n512 down fwd", 32768 * 8, 512, 4096, 128, False),
    ("30B-n512 up dX", 32768 * 8, 1024, 4096, 128, True),
    ("120B-n1024 down fwd", 32768 * 8, 1024, 4096, 128, False),
]


def _group_sizes(rows: int, groups: int, gen: torch.Generator) -> torch.Tensor:
    """Multinomial routing counts, as the layer benchmarks draw them."""
    choice = torch.randint(0, groups, (rows,), generator=gen)
    return torch.bincount(choice, minlength=groups).to(torch.int32)


def _reference(lhs, rhs, sizes, transpose_rhs):
    out = torch.empty(lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2], dtype=lhs.dtype,
                      device=lhs.device)
    start = 0
    for g, size in enumerate(sizes.tolist()):
        w = rhs[g].T if transpose_rhs else rhs[g]
        out[start:start + size] = (lhs[start:start + size].float() @ w.float()).to(lhs.dtype)
        start += size
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=None, help="product names to run (default all)")
    parser.add_argument("--diagnose", action="store_true", help="only the small correctness cases")
    parser.add_argument("--gathered", action="store_true", help="only gather_gmm against TMA weight loads")
    args = parser.parse_args()
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    if args.gathered:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "triton": triton.__version__,
                                        "date": datetime.datetime.now().isoformat(timespec="seconds"),
                                        "gathered": gathered(torch.Generator().manual_seed(2))}, indent=1))
        return
    if args.diagnose:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "diagnose": diagnose()}, indent=1))
        return
    gen = torch.Generator().manual_seed(0)
    results = {"device": torch.cuda.get_device_name(0), "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "triton": triton.__version__, "rows": []}
    for name, m, k, n, g, transpose_rhs in PRODUCTS:
        if args.only and name not in args.only:
            continue
        sizes = _group_sizes(m, g, gen)
        lhs = (torch.randn(m, k, generator=gen) / k ** 0.5).to(torch.bfloat16).cuda()
        rhs_shape = (g, n, k) if transpose_rhs else (g, k, n)
        rhs = torch.randn(*rhs_shape, generator=gen).to(torch.bfloat16).cuda()
        sizes_d = sizes.cuda()
        offset = torch.zeros(1, dtype=torch.int32, device="cuda")
        expected = _reference(lhs, rhs, sizes, transpose_rhs)
        flops = 2.0 * m * k * n
        variants = {"table (pointer, flattened) 128x256x64 s4": (
            gmm_kernel, 8, 4, (lhs, rhs, sizes_d, offset),
            dict(M=m, K=k, N=n, NUM_LOCAL_GROUPS=g, NUM_GROUPS=g, GROUPS_PAD=triton.next_power_of_2(g),
                 TRANSPOSE_RHS=transpose_rhs, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, NUM_PROGRAMS=NUM_SMS,
                 COMPUTE_F32=False, ZERO_OUTSIDE=False, TAIL_APART=False, FLATTEN=True))}
        infos = {}
        for bn in (256, 128):
            info, num_tiles = _tile_info(sizes, n, 128, bn)
            infos[bn] = (info.cuda(), torch.tensor([num_tiles], dtype=torch.int32, device="cuda"))
        for bn, stages, ws in ((256, 3, True), (256, 4, True), (128, 3, True), (128, 4, True), (256, 4, False)):
            label = f"{'ws' if ws else 'tma flattened'} 128x{bn}x64 s{stages}"
            variants[label] = (ws_gmm_kernel, 4 if ws else 8, stages, (lhs, rhs) + infos[bn],
                               dict(M=m, K=k, N=n, NUM_LOCAL_GROUPS=g, TRANSPOSE_RHS=transpose_rhs, BLOCK_M=128,
                                    BLOCK_N=bn, BLOCK_K=64, NUM_PROGRAMS=NUM_SMS, WARP_SPECIALIZE=ws,
                                    FLATTEN=not ws))
        for label, (kernel, warps, stages, inputs, consts) in variants.items():
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            row = {"product": name, "variant": label}
            try:
                def launch():
                    return kernel[(NUM_SMS,)](*inputs, out, **consts, num_warps=warps, num_stages=stages)
                compiled = launch()
                torch.cuda.synchronize()
                err = ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
                ms = triton.testing.do_bench(launch, warmup=25, rep=200)
                row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1), rel_err=err,
                           finite=bool(torch.isfinite(out).all()), warps=compiled.metadata.num_warps,
                           shared=compiled.metadata.shared)
            except Exception as exc:  # report and go on: one variant failing must not hide the rest
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
