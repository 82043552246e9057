"""The Hopper-native Gluon grouped GEMM (``moe_lowering/kernels/grouped_matmul_sm90``) checked and timed on a GPU.

On an H100 / H200 with torch and triton 3.6, every configuration (``--configs``, default all of
``gluon_launch.CONFIGS``) is

1. checked against a float32 per-group torch product on group-size patterns that stress the schedule
   (empty groups, sizes not multiples of the tile, one group holding every row, groups covering fewer
   rows than there are, a width not a multiple of the tile): max error relative to the largest product
   entry, and whether the rows past the groups kept their sentinel (nothing is stored past a group);
2. timed (``triton.testing.do_bench``: CUDA events, warm-up, L2 flushed, median) on SonicMoE's d = 4096
   shapes (``sonic.SHAPES``), the forward up projection ``[T*K, d] @ [E, d, 2n]`` and down projection
   ``[T*K, n] @ [E, n, d]`` with seeded multinomial group sizes, beside our Triton ``gmm_kernel`` launched
   the same way at its table tile (``triton_launch.gmm_config``, whole tile loop in one launch),
   ``torch._grouped_mm`` and a dense ``a @ b`` of the same FLOPs (the ceiling), each in TFLOP/s and
   checked against the per-group bf16 product.

The weight gradient ``dw[g] = lhs[rows of g]^T @ dout[rows of g]`` (``--ops tgmm``; the Gluon
``tgmm_sm90_kernel`` at every ``gluon_launch.TGMM_CONFIGS`` entry) gets the same two steps:

1. checks against the float32 per-group torch product on ``TGMM_CHECK_PATTERNS`` (empty groups, whose
   ``dw`` must be zeros over the sentinel it held; partial row blocks; one group holding every row;
   ``K`` and ``N`` off the tile; a float32 output), the rows past the groups set to inf / NaN: a
   group's last row block that let them in shows as a non-finite error;
2. timings of the backward's two weight gradients at SonicMoE's d = 4096 shapes, ``dW_up = x^T @
   d_h`` (``[T*K, d]^T [T*K, 2n]``) and ``dW_down = a^T @ d_y`` (``[T*K, n]^T [T*K, d]``), beside our
   Triton ``tgmm_kernel`` (or ``tgmm_resident_kernel``, as ``triton_launch.tgmm_config`` picks) launched
   the same way, ``torch._grouped_mm`` where it takes the ``[K, M] x [M, N]`` layout, and a dense product
   of the same FLOPs.

A configuration that fails to compile or launch is reported and skipped. Writes
``gluon_gmm_probe_<device>_<date>.json`` under ``--out``. ``--compile-only`` needs no GPU: it compiles
every configuration offline for sm_90 and reports registers, spills and shared memory.

    python benchmarks/gluon_gmm_probe.py --smoke --out /tmp/probe
    python benchmarks/gluon_gmm_probe.py --out benchmarks/results
    python benchmarks/gluon_gmm_probe.py --ops tgmm --out benchmarks/results
    python benchmarks/gluon_gmm_probe.py --compile-only --out /tmp/probe
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
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # jax is imported (the tile table), never run

D4096_SHAPES = ("30B-n256", "30B-n512", "30B-n1024", "120B-n512", "120B-n1024", "120B-n2048")
LAYER_SHAPES = ("mixtral", "qwen3", "deepseek", "deepseek-equal", "deepseek-skewed")
# A layer name's suffix picks the routing of its group sizes (``_group_sizes``); none: multinomial.
ROUTINGS = ("equal", "skewed")
# Log-normal expert popularity for "-skewed": the hottest of 256 experts gets ~8-12x the mean rows, as an
# unbalanced router does early in training.
SKEW_SIGMA = 1.0
"""``moe_layer.CONFIGS``' layers (``T*k`` rows, one expert weight a product: ``dW_up`` is ``[rows, d]^T
[rows, f]``, as the layer's gate and up gradients each are); ``deepseek-equal``: DeepSeek with every
group exactly ``T*k/E`` = 128 rows (no partial row block: the tail handling's share)."""
SMOKE_SHAPE = "30B-n512"
SMOKE_ROWS = 16384
CHECK_PATTERNS = {
    # name: (rows, K, N, group sizes)
    "empty groups": (2048, 512, 512, [0, 300, 0, 0, 1000, 129, 0, 619]),
    "ragged sizes": (3000, 256, 768, [1, 127, 129, 255, 257, 383, 385, 511, 952]),
    "one group holds all": (2304, 512, 512, [0, 0, 2304, 0]),
    "rows past the groups": (1536, 256, 512, [100, 0, 700, 33]),
    "width not a tile multiple": (1200, 512, 320, [500, 0, 700]),
    "one tiny group": (128, 256, 256, [0, 5, 0, 0, 0, 0, 0, 0]),
    "64-row boundaries": (2048, 256, 384, [64, 65, 128, 191, 192, 193, 256, 320, 639]),
}
TGMM_CHECK_PATTERNS = {
    # name: (rows, K, N, group sizes, output dtype)
    "empty groups": (2048, 256, 512, [0, 300, 0, 0, 1000, 129, 0, 619], "bfloat16"),
    "ragged sizes": (3000, 256, 768, [1, 63, 65, 127, 129, 255, 257, 511, 1592], "bfloat16"),
    "one group holds all": (2304, 512, 512, [0, 0, 2304, 0], "bfloat16"),
    "rows past the groups": (1536, 256, 512, [100, 0, 700, 33], "bfloat16"),
    "K and N not tile multiples": (1200, 200, 328, [500, 0, 650], "bfloat16"),
    "one tiny group": (128, 256, 256, [0, 5, 0, 0, 0, 0, 0, 0], "bfloat16"),
    "float32 output": (2048, 256, 512, [0, 1000, 48, 0, 900], "float32"),
    # a resident dout's launches split the groups at its 192 rows: both sides of the bound, groups past the rows
    "groups at the resident bound": (1400, 512, 512, [191, 192, 193, 0, 64, 384, 129, 300], "bfloat16"),
}
"""Weight-gradient checks: rows past ``sum(sizes)`` hold inf (``lhs``) and NaN (``dout``)."""
SENTINEL = 3.0
TOLERANCE = 2e-2
"""Largest error relative to the largest product entry a bf16 output may show (one bf16 rounding is 4e-3)."""


def _load_sm90():
    from moe_lowering.kernels.grouped_matmul_sm90 import gluon_launch

    return gluon_launch


def _known_configs(ops) -> dict:
    """Config name -> config of the ``ops`` (``gmm``: ``CONFIGS``; ``tgmm``: ``TGMM_CONFIGS``)."""
    launch = _load_sm90()
    return {**(launch.CONFIGS if "gmm" in ops else {}), **(launch.TGMM_CONFIGS if "tgmm" in ops else {})}


def _selected_configs(names, ops=("gmm", "tgmm")):
    known = _known_configs(ops)
    if not names:
        return list(known.values())
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known for {list(ops)}: {list(known)}")
    return [known[name] for name in names]


def _is_tgmm(config) -> bool:
    return isinstance(config, _load_sm90().GluonTgmmConfig)


def _error(message: str, exc: BaseException) -> dict:
    print(f"  {message}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}


# ---------------------------------------------------------------------------------------------- offline


def compile_report(configs, num_groups: int = 256) -> dict:
    """Each config compiled for sm_90 without a GPU: launch registers, ptxas spills, shared memory."""
    import triton

    launch = _load_sm90()
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    report = {}
    for config in configs:
        try:
            compiled = (launch.compile_tgmm_offline(config) if _is_tgmm(config)
                        else launch.compile_offline(config, num_groups))
            with tempfile.TemporaryDirectory() as scratch:
                ptx = Path(scratch) / "kernel.ptx"
                ptx.write_text(compiled.asm["ptx"])
                verbose = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx.with_suffix(".o"))],
                                         capture_output=True, text=True, check=True).stderr
            registers = int(re.search(r"Used (\d+) registers", verbose).group(1))
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", verbose)
            maxnreg = {int(v) for v in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)",
                                                   compiled.asm["ptx"])}
            entry = {"launch_registers": registers, "spill_store_bytes": int(spills.group(1)),
                     "spill_load_bytes": int(spills.group(2)), "shared_bytes": int(compiled.metadata.shared),
                     "shared_limit": launch.SHARED_LIMIT, "setmaxnreg_values": sorted(maxnreg),
                     "wgmma_instructions": compiled.asm["ptx"].count("wgmma.mma_async")}
            print(f"  {config.name:28s} regs {registers} (setmaxnreg {sorted(maxnreg)}), spills "
                  f"{entry['spill_store_bytes']}/{entry['spill_load_bytes']} B, shared {entry['shared_bytes']} B "
                  f"of {launch.SHARED_LIMIT}", flush=True)
        except Exception as exc:  # noqa: BLE001 - one config's failure is reported, the others still run
            entry = _error(f"{config.name} failed to compile", exc)
        report[config.name] = entry
    return report


# ------------------------------------------------------------------------------------------------- GPU


def _torch():
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    return torch


def _reference(lhs, rhs, sizes, dtype):
    """Per-group product of the groups' rows in ``dtype`` (float32: exact-ish; bf16: cuBLAS, for the large
    shapes), rows past the groups zero."""
    torch = _torch()
    out = torch.zeros(lhs.shape[0], rhs.shape[2], dtype=dtype, device=lhs.device)
    start = 0
    for group, size in enumerate(sizes):
        end = min(start + max(int(size), 0), lhs.shape[0])
        if end > start:
            out[start:end] = lhs[start:end].to(dtype) @ rhs[group].to(dtype)
        start = end
    return out


def _relative_error(out, reference, rows: int, chunk: int = 1 << 16) -> float:
    """Largest ``|out - reference|`` over the first ``rows`` rows relative to the largest ``|reference|``
    (NaN anywhere gives NaN), in row chunks: float32 copies of a [T*K, d] output would take 8 GB each."""
    error, scale = 0.0, 0.0
    for start in range(0, rows, chunk):
        expected = reference[start:min(rows, start + chunk)].float()
        scale = max(scale, expected.abs().max().item())
        error = max(error, (out[start:start + len(expected)].float() - expected).abs().max().item(), key=_nan_first)
    return error / (scale or 1.0)


def _nan_first(value: float) -> float:
    return float("inf") if value != value else value


def check_patterns(config, seed: int = 0) -> dict:
    """The kernel against the float32 reference on every ``CHECK_PATTERNS`` entry."""
    torch = _torch()
    launch = _load_sm90()
    results = {}
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for name, (rows, k, n, sizes) in CHECK_PATTERNS.items():
        try:
            lhs = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=generator)
            rhs = torch.randn(len(sizes), k, n, device="cuda", dtype=torch.bfloat16, generator=generator) / k ** 0.5
            group_sizes = torch.tensor(sizes, dtype=torch.int32, device="cuda")
            out = torch.full((rows, n), SENTINEL, device="cuda", dtype=torch.bfloat16)
            launch.gmm(lhs, rhs, group_sizes, config, out=out)
            torch.cuda.synchronize()
            covered = min(sum(sizes), rows)
            error = _relative_error(out, _reference(lhs, rhs, sizes, torch.float32), covered)
            untouched = bool((out[covered:] == SENTINEL).all().item())
            results[name] = {"rows": rows, "K": k, "N": n, "group_sizes": sizes, "max_rel_error": error,
                             "rows_past_groups_untouched": untouched,
                             "ok": bool(error < TOLERANCE and untouched)}
            print(f"  check {name:28s} max rel error {error:.2e}, rows past groups untouched {untouched}"
                  f"{'' if results[name]['ok'] else '   <-- FAILED'}", flush=True)
        except Exception as exc:  # noqa: BLE001
            results[name] = _error(f"check {name}", exc)
    return results


def _tgmm_reference(lhs, dout, sizes, dtype):
    """Per-group ``lhs[rows of g]^T @ dout[rows of g]`` in ``dtype``, ``[E, K, N]`` (zeros for empty groups)."""
    torch = _torch()
    out = torch.zeros(len(sizes), lhs.shape[1], dout.shape[1], dtype=dtype, device=lhs.device)
    start = 0
    for group, size in enumerate(sizes):
        end = min(start + max(int(size), 0), lhs.shape[0])
        if end > start:
            out[group] = lhs[start:end].to(dtype).T @ dout[start:end].to(dtype)
        start = end
    return out


def _weights_error(out, reference) -> float:
    """:func:`_relative_error` over every group's ``[K, N]`` (as ``[E*K, N]`` rows)."""
    n = reference.shape[2]
    return _relative_error(out.reshape(-1, n), reference.reshape(-1, n), reference.shape[0] * reference.shape[1])


def check_tgmm_patterns(config, seed: int = 0) -> dict:
    """The weight-gradient kernel against the float32 reference on every ``TGMM_CHECK_PATTERNS`` entry:
    rows past the groups inf / NaN, the output a sentinel before the launch (every group is written)."""
    torch = _torch()
    launch = _load_sm90()
    results = {}
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for name, (rows, k, n, sizes, out_dtype) in TGMM_CHECK_PATTERNS.items():
        try:
            covered = min(sum(sizes), rows)
            lhs = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=generator)
            dout = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16, generator=generator)
            dout /= max(covered, 1) ** 0.5
            lhs[covered:] = float("inf")
            dout[covered:] = float("nan")
            group_sizes = torch.tensor(sizes, dtype=torch.int32, device="cuda")
            out = torch.full((len(sizes), k, n), SENTINEL, device="cuda", dtype=getattr(torch, out_dtype))
            launch.tgmm(lhs, dout, group_sizes, config, out=out)
            torch.cuda.synchronize()
            error = _weights_error(out, _tgmm_reference(lhs, dout, sizes, torch.float32))
            empty = [g for g, size in enumerate(sizes) if size <= 0]
            empty_zero = bool((out[empty] == 0).all().item()) if empty else True
            results[name] = {"rows": rows, "K": k, "N": n, "group_sizes": sizes, "out_dtype": out_dtype,
                             "max_rel_error": error, "empty_groups_zero": empty_zero,
                             "ok": bool(error < TOLERANCE and empty_zero)}
            print(f"  check {name:28s} max rel error {error:.2e}, empty groups zero {empty_zero}"
                  f"{'' if results[name]['ok'] else '   <-- FAILED'}", flush=True)
        except Exception as exc:  # noqa: BLE001
            results[name] = _error(f"check {name}", exc)
    return results


def _group_sizes(rows: int, groups: int, seed: int, routing: str = "multinomial") -> list[int]:
    """Seeded group sizes summing to ``rows``: ``multinomial`` (uniform, as random routing is), ``equal``
    (``rows / groups`` each) or ``skewed`` (multinomial over log-normal expert popularities)."""
    if routing == "equal":
        return [rows // groups] * groups
    rng = np.random.default_rng(seed)
    popularity = np.exp(SKEW_SIGMA * rng.standard_normal(groups)) if routing == "skewed" else np.ones(groups)
    return rng.multinomial(rows, popularity / popularity.sum()).astype(int).tolist()


def _routing(shape_name: str) -> str:
    """The routing a probe shape's name asks for: its suffix (``deepseek-skewed``), else multinomial."""
    suffix = shape_name.rsplit("-", 1)[-1]
    return suffix if suffix in ROUTINGS else "multinomial"


def _bench_ms(fn, smoke: bool) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=5 if smoke else 25, rep=20 if smoke else 100,
                                         return_mode="median"))


def _gmm_kernel_launch(rows: int, k: int, n: int, groups: int):
    """``(grid, keyword arguments, label)`` of our current Triton ``gmm_kernel`` at its table tile
    (``triton_launch.gmm_config``), the whole tile loop in one launch (the production path adds a K-split
    tail launch)."""
    torch = _torch()
    import triton
    from kernel_resources import _launchers  # the launcher's tile table without jax_triton

    table = _launchers()
    config = table.gmm_config(rows, k, n, groups, False, flattened_loop=True)
    programs = min(torch.cuda.get_device_properties(0).multi_processor_count,
                   (triton.cdiv(rows, config.block_m) + groups) * triton.cdiv(n, config.block_n))
    kwargs = dict(M=rows, K=k, N=n, NUM_LOCAL_GROUPS=groups, NUM_GROUPS=groups,
                  GROUPS_PAD=table._next_power_of_two(groups), TRANSPOSE_RHS=False, BLOCK_M=config.block_m,
                  BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m, NUM_PROGRAMS=programs,
                  COMPUTE_F32=False, ZERO_OUTSIDE=True, TAIL_APART=False, FLATTEN=config.flatten,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    label = f"gmm_kernel {config.block_m}x{config.block_n}x{config.block_k} s{config.num_stages}"
    return (programs, ), kwargs, label + (" flat" if config.flatten else "")


def _gmm_kernel_launcher(lhs, rhs, group_sizes, out):
    """``gmm_kernel`` on torch tensors: ``(run, label)``."""
    torch = _torch()
    from moe_lowering.kernels.grouped_matmul.triton_kernels import gmm_kernel

    grid, kwargs, label = _gmm_kernel_launch(*lhs.shape, rhs.shape[2], rhs.shape[0])
    offset = torch.zeros(1, dtype=torch.int32, device=lhs.device)
    return lambda: gmm_kernel[grid](lhs, rhs, group_sizes, offset, out, **kwargs), label


def _tgmm_kernel_launch(rows: int, k: int, n: int, groups: int):
    """``(kernel, grid, keyword arguments, label)`` of our current Triton weight gradient at its table tile
    (``triton_launch.tgmm_config``): ``tgmm_resident_kernel`` for small groups, else ``tgmm_kernel``."""
    torch = _torch()
    import triton
    from kernel_resources import _launchers

    from moe_lowering.kernels.grouped_matmul.triton_kernels import tgmm_kernel, tgmm_resident_kernel

    table = _launchers()
    config = table.tgmm_config(rows, k, n, groups, False)
    resident = table._small_groups(rows, groups)
    work_items = groups * triton.cdiv(n, config.block_n) * (1 if resident else triton.cdiv(k, config.block_m))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = min(work_items, config.programs_per_sm * sms) if config.persistent else work_items
    kwargs = dict(M=rows, K=k, N=n, NUM_LOCAL_GROUPS=groups, NUM_GROUPS=groups,
                  GROUPS_PAD=table._next_power_of_two(groups), BLOCK_K=config.block_m, BLOCK_N=config.block_n,
                  BLOCK_R=config.block_k, NUM_PROGRAMS=programs, COMPUTE_F32=False, num_warps=config.num_warps,
                  num_stages=config.num_stages, **({} if resident else {"GROUP_M": config.group_m}))
    kernel = tgmm_resident_kernel if resident else tgmm_kernel
    label = f"{kernel.fn.__name__} {config.block_m}x{config.block_n} r{config.block_k} s{config.num_stages}"
    return kernel, (programs, ), kwargs, label


def _tgmm_kernel_launcher(lhs, dout, group_sizes, out):
    """Our Triton weight gradient on torch tensors: ``(run, label)``."""
    torch = _torch()
    kernel, grid, kwargs, label = _tgmm_kernel_launch(*lhs.shape, dout.shape[1], out.shape[0])
    offset = torch.zeros(1, dtype=torch.int32, device=lhs.device)
    return lambda: kernel[grid](lhs, dout, group_sizes, offset, out, **kwargs), label


def _compile_job(job):
    """One compile, in a worker process of ``_warm_compile_cache``: a Gluon config for a group count (a launch
    on empty groups: nothing runs), or ``gmm_kernel`` for a product (``warmup``: compiled, not launched)."""
    kind, args = job
    try:
        torch = _torch()
        if kind == "gluon":
            name, groups = args
            config = _load_sm90().CONFIGS[name]
            lhs = torch.zeros(config.block_m, config.block_k, device="cuda", dtype=torch.bfloat16)
            rhs = torch.zeros(groups, config.block_k, config.block_n, device="cuda", dtype=torch.bfloat16)
            _load_sm90().gmm(lhs, rhs, torch.zeros(groups, dtype=torch.int32, device="cuda"), config)
            torch.cuda.synchronize()
        elif kind == "gluon_tgmm":
            name, groups = args
            config = _load_sm90().TGMM_CONFIGS[name]
            lhs = torch.zeros(config.block_m, config.block_k, device="cuda", dtype=torch.bfloat16)
            dout = torch.zeros(config.block_m, config.block_n, device="cuda", dtype=torch.bfloat16)
            _load_sm90().tgmm(lhs, dout, torch.zeros(groups, dtype=torch.int32, device="cuda"), config)
            torch.cuda.synchronize()
        elif kind == "tgmm_kernel":
            kernel, grid, kwargs, _ = _tgmm_kernel_launch(*args)
            kernel.warmup(torch.bfloat16, torch.bfloat16, torch.int32, torch.int32, torch.bfloat16, grid=grid, **kwargs)
        else:
            from moe_lowering.kernels.grouped_matmul.triton_kernels import gmm_kernel

            grid, kwargs, _ = _gmm_kernel_launch(*args)
            gmm_kernel.warmup(torch.bfloat16, torch.bfloat16, torch.int32, torch.int32, torch.bfloat16, grid=grid,
                              **kwargs)
        return job, None
    except Exception as exc:  # noqa: BLE001 - reported; the timed launch compiles (or fails) again
        return job, f"{type(exc).__name__}: {exc}"[:1000]


def _warm_compile_cache(configs, products, tgmm_products=(), workers: int = 16) -> dict:
    """Every kernel the run launches compiled at once, one process each, into Triton's disk cache: the
    run then loads them instead of compiling them one after another."""
    import concurrent.futures
    import multiprocessing
    import time

    group_counts = sorted({len(sizes) for *_, sizes in CHECK_PATTERNS.values()} | {e for *_, e in products})
    # the Gluon kernels take E as an argument: one compile per specialisation (a multiple of 16 or not)
    tgmm_group_counts = sorted({16 if e % 16 == 0 else 8 for e in
                                {len(p[3]) for p in TGMM_CHECK_PATTERNS.values()} | {e for *_, e in tgmm_products}})
    jobs = [("gluon", (config.name, groups)) for config in configs if not _is_tgmm(config) for groups in group_counts]
    jobs += [("gluon_tgmm", (config.name, groups)) for config in configs if _is_tgmm(config)
             for groups in tgmm_group_counts]
    jobs += [("gmm_kernel", product) for product in dict.fromkeys(products)]
    jobs += [("tgmm_kernel", product) for product in dict.fromkeys(tgmm_products)]
    began = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(jobs)),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = {f"{kind} {args}": error for (kind, args), error in pool.map(_compile_job, jobs) if error}
    seconds = time.perf_counter() - began
    print(f"compiled {len(jobs)} kernels in parallel in {seconds:.0f} s; failed: {failed or 'none'}", flush=True)
    return {"jobs": len(jobs), "seconds": seconds, "failed": failed}


def _grouped_mm_launcher(lhs, rhs, group_sizes):
    torch = _torch()
    offsets = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    try:
        torch._grouped_mm(lhs, rhs, offs=offsets, out_dtype=torch.bfloat16)
        weights = rhs
    except Exception:  # noqa: BLE001 - some releases want the weights column-major
        weights = rhs.transpose(1, 2).contiguous().transpose(1, 2)
    return lambda: torch._grouped_mm(lhs, weights, offs=offsets, out_dtype=torch.bfloat16)


def _measurer(entry: dict, error_of, smoke: bool):
    """``measure(name, fn, out=None)``: times ``fn`` into ``entry["kernels"][name]`` (ms, TFLOP/s of
    ``entry["flops"]``) and, given ``out`` (a tensor, or a callable returning one), its ``error_of``."""
    torch = _torch()

    def measure(name, fn, out=None):
        try:
            fn()
            torch.cuda.synchronize()
            result = {"ms": _bench_ms(fn, smoke)}
            result["tflops"] = entry["flops"] / result["ms"] / 1e9
            if out is not None:
                result["max_rel_error"] = error_of(out() if callable(out) else out)
            entry["kernels"][name] = result
            error = f", rel err {result['max_rel_error']:.1e}" if "max_rel_error" in result else ""
            print(f"    {name:36s} {result['ms']:8.3f} ms {result['tflops']:7.1f} TFLOP/s{error}", flush=True)
        except Exception as exc:  # noqa: BLE001
            entry["kernels"][name] = _error(f"  {name}", exc)

    return measure


def time_product(label: str, rows: int, k: int, n: int, groups: int, configs, smoke: bool, seed: int,
                 routing: str = "multinomial") -> dict:
    """Every kernel on one grouped product: ms, TFLOP/s, relative error against the per-group bf16 product.
    ``routing``: how the group sizes are drawn (``_group_sizes``)."""
    torch = _torch()
    launch = _load_sm90()
    sizes = _group_sizes(rows, groups, seed, routing)
    flops = 2.0 * rows * k * n
    generator = torch.Generator(device="cuda").manual_seed(seed)
    lhs = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=generator)
    rhs = torch.randn(groups, k, n, device="cuda", dtype=torch.bfloat16, generator=generator) / k ** 0.5
    group_sizes = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    reference = _reference(lhs, rhs, sizes, torch.bfloat16)
    entry = {"product": label, "M": rows, "K": k, "N": n, "E": groups, "flops": flops,
             "group_sizes_min_max": [min(sizes), max(sizes)], "kernels": {}}

    measure = _measurer(entry, lambda out: _relative_error(out, reference, rows), smoke)

    print(f"  {label}: [{rows}, {k}] x [{groups}, {k}, {n}], sizes {min(sizes)}-{max(sizes)}", flush=True)
    for config in configs:
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        try:
            run = launch.make_launch(lhs, rhs, group_sizes, out, config)
        except Exception as exc:  # noqa: BLE001
            entry["kernels"][f"gluon {config.name}"] = _error(f"  gluon {config.name}", exc)
            continue
        measure(f"gluon {config.name}", run, out)
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    try:
        run, name = _gmm_kernel_launcher(lhs, rhs, group_sizes, out)
        measure(name, run, out)
    except Exception as exc:  # noqa: BLE001
        entry["kernels"]["gmm_kernel"] = _error("  gmm_kernel", exc)
    try:
        grouped = _grouped_mm_launcher(lhs, rhs, group_sizes)
        measure("torch._grouped_mm", grouped, grouped)
    except Exception as exc:  # noqa: BLE001
        entry["kernels"]["torch._grouped_mm"] = _error("  torch._grouped_mm", exc)
    dense_rhs = rhs[0]
    measure("dense a @ b (ceiling)", lambda: lhs @ dense_rhs)
    del lhs, rhs, reference, out
    torch.cuda.empty_cache()
    return entry


def _tgmm_grouped_mm_launcher(lhs, dout, group_sizes):
    """``torch._grouped_mm`` of ``lhs^T [K, M]`` and ``dout [M, N]`` split along ``M`` (its 2d x 2d case):
    ``(run, label)``, on the transposed views where the release takes them, else on copies with ``M``
    contiguous in both (made once, outside the timing: a real backward would pay for them)."""
    torch = _torch()
    offsets = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    layouts = (("views", lambda: (lhs.t(), dout)),
               ("M-contiguous copies, untimed", lambda: (lhs.t().contiguous(), dout.t().contiguous().t())))
    for index, (name, operands) in enumerate(layouts):
        a, b = operands()
        try:
            torch._grouped_mm(a, b, offs=offsets, out_dtype=torch.bfloat16)
        except Exception:  # noqa: BLE001 - the next layout, or the last one's error
            if index == len(layouts) - 1:
                raise
            continue
        return (lambda: torch._grouped_mm(a, b, offs=offsets, out_dtype=torch.bfloat16)), f"torch._grouped_mm ({name})"


def time_tgmm_product(label: str, rows: int, k: int, n: int, groups: int, configs, smoke: bool, seed: int,
                      routing: str = "multinomial") -> dict:
    """Every weight-gradient kernel on ``dw[g] = lhs[g]^T @ dout[g]`` (``lhs [rows, k]``, ``dout [rows, n]``):
    ms, TFLOP/s, relative error against the per-group bf16 product. ``routing``: how the group sizes are
    drawn (``_group_sizes``)."""
    torch = _torch()
    launch = _load_sm90()
    sizes = _group_sizes(rows, groups, seed, routing)
    flops = 2.0 * rows * k * n
    generator = torch.Generator(device="cuda").manual_seed(seed)
    lhs = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=generator)
    dout = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16, generator=generator) / (rows / groups) ** 0.5
    group_sizes = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    reference = _tgmm_reference(lhs, dout, sizes, torch.bfloat16)
    entry = {"product": label, "M": rows, "K": k, "N": n, "E": groups, "flops": flops,
             "group_sizes_min_max": [min(sizes), max(sizes)], "kernels": {}}

    measure = _measurer(entry, lambda out: _weights_error(out, reference), smoke)

    print(f"  {label}: [{rows}, {k}]^T x [{rows}, {n}] -> [{groups}, {k}, {n}], sizes {min(sizes)}-{max(sizes)}",
          flush=True)
    out = torch.empty(groups, k, n, device="cuda", dtype=torch.bfloat16)
    for config in configs:
        try:
            run = launch.make_tgmm_launch(lhs, dout, group_sizes, out, config)
        except Exception as exc:  # noqa: BLE001
            entry["kernels"][f"gluon {config.name}"] = _error(f"  gluon {config.name}", exc)
            continue
        out.fill_(SENTINEL)
        measure(f"gluon {config.name}", run, out)
    try:
        out.fill_(SENTINEL)
        run, name = _tgmm_kernel_launcher(lhs, dout, group_sizes, out)
        measure(name, run, out)
    except Exception as exc:  # noqa: BLE001
        entry["kernels"]["tgmm_kernel"] = _error("  tgmm_kernel", exc)
    measure("output fill (HBM write floor)", lambda: out.fill_(0))
    del out
    try:
        grouped, name = _tgmm_grouped_mm_launcher(lhs, dout, group_sizes)
        measure(name, grouped, grouped)
        del grouped
    except Exception as exc:  # noqa: BLE001
        entry["kernels"]["torch._grouped_mm"] = _error("  torch._grouped_mm", exc)
    measure("dense a^T @ b (ceiling)", lambda: lhs.t() @ dout)
    del lhs, dout, reference
    torch.cuda.empty_cache()
    return entry


def _checks_in_child(config, seed: int, timeout_s: int) -> dict:
    """``check_patterns`` (``check_tgmm_patterns``) in a process of its own: a kernel that deadlocks on its
    barriers is killed after ``timeout_s`` and reported, and the run goes on with the other configurations.
    Prints the child's lines as one block once it is done (the configurations' children run at once)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--out", "-", "--configs", config.name,
               "--seed", str(seed), "--checks-only"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        print(f"checks, {config.name}: did not finish in {timeout_s} s (a hang?)", flush=True)
        return {"hung": {"error": f"no result in {timeout_s} s", "stdout": str(exc.stdout)[-2000:]}}
    print(f"checks, {config.name}:\n" + done.stdout.split("CHECKS_JSON")[0].rstrip(), flush=True)
    if "CHECKS_JSON" not in done.stdout:
        print(done.stderr[-3000:], flush=True)
        return {"crashed": {"error": f"exit {done.returncode}", "stderr": done.stderr[-4000:]}}
    return json.loads(done.stdout.split("CHECKS_JSON", 1)[1])


def _passed(checks: dict) -> bool:
    return bool(checks) and all(check.get("ok") for check in checks.values())


def run_gpu(configs, shapes, smoke: bool, seed: int, report: dict, path: Path, check_timeout_s: int,
            ops=("gmm", "tgmm")) -> dict:
    """Checks every configuration (each in a child process), then times the ones that passed on the
    forward's products (``gmm``) and the weight gradients (``tgmm``), writing ``report`` to ``path``
    after every step (a run cut short keeps what it measured)."""
    torch = _torch()
    import triton
    from sonic import SHAPES

    report |= {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
               "smoke": smoke, "configs": {c.name: c.__dict__ | {"maxnreg": c.maxnreg} for c in configs},
               "checks": {}, "products": []}
    print(f"{report['device']}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    products, tgmm_products = [], []  # (shape, product, rows, K, N, E)
    for name in shapes:
        if name in LAYER_SHAPES:
            from moe_layer import CONFIGS as LAYERS

            layer = LAYERS[name.split("-")[0]]
            rows = SMOKE_ROWS if smoke else layer.T * layer.k
            if "gmm" in ops:
                products += [(name, "up", rows, layer.d, layer.f, layer.E),
                             (name, "down", rows, layer.f, layer.d, layer.E)]
            if "tgmm" in ops:
                tgmm_products += [(name, "dW_up", rows, layer.d, layer.f, layer.E),
                                  (name, "dW_down", rows, layer.f, layer.d, layer.E)]
            continue
        shape = SHAPES[name]
        rows = SMOKE_ROWS if smoke else shape.T * shape.K
        if "gmm" in ops:
            products += [(name, "up", rows, shape.d, 2 * shape.n, shape.E),
                         (name, "down", rows, shape.n, shape.d, shape.E)]
        if "tgmm" in ops:  # dW_up = x^T d_h, dW_down = a^T d_y
            tgmm_products += [(name, "dW_up", rows, shape.d, 2 * shape.n, shape.E),
                              (name, "dW_down", rows, shape.n, shape.d, shape.E)]
    report["warm_compile"] = _warm_compile_cache(configs, [product[2:] for product in products],
                                                 [product[2:] for product in tgmm_products])
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:  # small products: one GPU holds them all
        for config, checks in zip(configs, pool.map(lambda c: _checks_in_child(c, seed, check_timeout_s), configs)):
            report["checks"][config.name] = checks
            _write(report, path)
    timed = [config for config in configs if _passed(report["checks"][config.name])]
    if len(timed) < len(configs):
        print(f"timing only the configs that passed: {[c.name for c in timed]}", flush=True)
    for name, label, rows, k, n, groups in products:
        print(f"{name}, {rows} rows:", flush=True)
        entry = time_product(label, rows, k, n, groups, [c for c in timed if not _is_tgmm(c)], smoke, seed,
                             routing=_routing(name))
        report["products"].append({"shape": name, **entry})
        _write(report, path)
    for name, label, rows, k, n, groups in tgmm_products:
        print(f"{name}, {rows} rows:", flush=True)
        entry = time_tgmm_product(label, rows, k, n, groups, [c for c in timed if _is_tgmm(c)], smoke, seed,
                                  routing=_routing(name))
        report["products"].append({"shape": name, **entry})
        _write(report, path)
    return report


def _write(report: dict, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))


def _keep_triton_cache_dir() -> None:
    """Importing jax_triton (our launchers' tile tables do) sets ``TRITON_CACHE_DIR=""``, after which
    every Triton compile fails ("Could not create or locate cache dir"): import it first, then name a
    real folder."""
    try:
        import jax_triton  # noqa: F401
    except ImportError:
        pass
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / "gluon_gmm_probe_triton_cache")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--ops", nargs="+", choices=("gmm", "tgmm"), default=["gmm", "tgmm"],
                        help="the forward product (gmm), the weight gradient (tgmm), or both (default)")
    parser.add_argument("--configs", nargs="*", default=None,
                        help="gluon_launch.CONFIGS / TGMM_CONFIGS names (default: all of the --ops)")
    parser.add_argument("--shapes", nargs="*", default=None,
                        help=f"sonic.SHAPES names or layers {LAYER_SHAPES} (default: {D4096_SHAPES})")
    parser.add_argument("--smoke", action="store_true",
                        help=f"seconds: the first config, {SMOKE_SHAPE} at {SMOKE_ROWS} rows, short timings")
    parser.add_argument("--compile-only", action="store_true", help="compile offline for sm_90 (no GPU) and report")
    parser.add_argument("--checks-only", action="store_true", help=argparse.SUPPRESS)  # the child of _checks_in_child
    parser.add_argument("--check-timeout", type=int, default=120, help="seconds for one config's checks")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _keep_triton_cache_dir()
    configs = _selected_configs(args.configs, args.ops)
    if args.checks_only:
        checks = (check_tgmm_patterns if _is_tgmm(configs[0]) else check_patterns)(configs[0], args.seed)
        print("CHECKS_JSON" + json.dumps(checks, default=str), flush=True)
        return
    if args.smoke and args.configs is None:  # the first config of each op
        configs = list({_is_tgmm(config): config for config in reversed(configs)}.values())
    shapes = args.shapes or ([SMOKE_SHAPE] if args.smoke else list(D4096_SHAPES))
    stamp = datetime.datetime.now(datetime.timezone.utc)
    print("offline sm_90 compile:", flush=True)
    report = {"date": stamp.isoformat(timespec="seconds"), "ops": args.ops, "compile": compile_report(configs)}
    kind = ("smoke_" if args.smoke else "") + ("" if {"gmm", "tgmm"} <= set(args.ops) else f"{args.ops[0]}_")
    if args.compile_only:
        path = args.out / f"gluon_gmm_probe_{kind}offline-sm90_{stamp.date().isoformat()}.json"
    else:
        import torch

        device = torch.cuda.get_device_name(0).replace("NVIDIA ", "").split()[0]
        path = args.out / f"gluon_gmm_probe_{kind}{device}_{stamp.date().isoformat()}.json"
        run_gpu(configs, shapes, args.smoke, args.seed, report, path, args.check_timeout, args.ops)
    _write(report, path)
    failed = [(config, name) for config, checks in report.get("checks", {}).items()
              for name, check in checks.items() if not check.get("ok")]
    print(f"wrote {path}; checks failed: {failed or 'none'}", flush=True)


if __name__ == "__main__":
    main()
