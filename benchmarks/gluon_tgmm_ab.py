"""A/B of the Hopper weight-gradient kernels (``grouped_matmul_sm90.gluon_tgmm_kernels``): this checkout's
against another revision's file, alternated in one run on one GPU.

The other revision's file (``git show REV:moe_lowering/kernels/grouped_matmul_sm90/gluon_tgmm_kernels.py >
old.py``) is loaded as a module; its kernels are launched with this checkout's descriptors, grid and
constexprs, with the scalars its signature takes (``min_group_rows`` only where it has it). Variants per
product: both revisions' streaming kernel (every group), both revisions' resident-``dout`` kernel alone,
this checkout's streaming kernel on the groups past the resident rows alone, and this checkout's launch of
the resident configuration (``gluon_launch.make_tgmm_launch``: resident kernel, then streaming kernel on the
longer groups). DeepSeek-V3's two weight-gradient products, with multinomial and skewed group sizes
(``gluon_gmm_probe._group_sizes``). Each round times every variant (``--reps`` calls, one sync); prints each
variant's fastest and slowest round, and each output's largest difference from the first variant's.

    python benchmarks/gluon_tgmm_ab.py --baseline old.py --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PRODUCTS = {  # name: (rows, groups, K, N)
    "deepseek dW_up": (32768, 256, 7168, 2048),
    "deepseek dW_down": (32768, 256, 2048, 7168),
}


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("baseline_gluon_tgmm_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launcher(kernel, config, lhs, dout, group_sizes, out, min_group_rows=None):
    """``kernel`` on ``config``'s descriptors and grid; ``min_group_rows`` passed where the kernel takes it."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from moe_lowering.kernels.grouped_matmul_sm90 import gluon_launch

    num_rows, k = lhs.shape
    groups, _, n = out.shape
    a_layout, b_layout, c_layout = gluon_launch.tgmm_shared_layouts(config, gl.bfloat16)
    descriptors = (TensorDescriptor.from_tensor(lhs, [config.block_m, config.block_k], a_layout),
                   TensorDescriptor.from_tensor(dout, [config.block_m, config.block_n], b_layout),
                   TensorDescriptor.from_tensor(out.view(groups * k, n), [config.block_k, config.block_n], c_layout))
    import torch

    sms = torch.cuda.get_device_properties(lhs.device).multi_processor_count
    grid = (max(1, min(sms, config.work_items(groups, k, n))), )
    scalars = (num_rows, n, k, groups)
    if "min_group_rows" in kernel.arg_names:
        scalars += (min_group_rows or 0, )
    fixed = gluon_launch.tgmm_constexprs(config)
    return lambda: kernel[grid](*descriptors, out, group_sizes, *scalars, **fixed, num_warps=config.num_warps,
                                maxnreg=config.maxnreg)


def _round_ms(fn, reps: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def run(baseline_path: Path, rounds: int, reps: int, seed: int) -> dict:
    import torch

    from gluon_gmm_probe import _group_sizes
    from moe_lowering.kernels.grouped_matmul_sm90 import gluon_launch, gluon_tgmm_kernels, jax_launch

    baseline = _load(baseline_path)
    resident = jax_launch.RESIDENT_TGMM_CONFIG
    streaming = gluon_launch.LONG_GROUPS_TGMM_CONFIG
    report = {"device": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
              "baseline": str(baseline_path), "rounds": rounds, "reps": reps, "results": []}
    print(report["device"], flush=True)
    for routing in ("multinomial", "skewed"):
        for name, (rows, groups, k, n) in PRODUCTS.items():
            sizes = _group_sizes(rows, groups, seed, routing)
            generator = torch.Generator(device="cuda").manual_seed(seed)
            lhs = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=generator)
            dout = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16, generator=generator) / 128 ** 0.5
            group_sizes = torch.tensor(sizes, dtype=torch.int32, device="cuda")
            outs = {}

            def variant(label, make):
                outs[label] = torch.zeros(groups, k, n, device="cuda", dtype=torch.bfloat16)
                return label, make(outs[label])

            past = resident.resident_rows + 1
            variants = dict([
                variant("baseline streaming", lambda o: _launcher(baseline.tgmm_sm90_kernel, streaming, lhs, dout,
                                                                  group_sizes, o)),
                variant("streaming", lambda o: _launcher(gluon_tgmm_kernels.tgmm_sm90_kernel, streaming, lhs, dout,
                                                         group_sizes, o)),
                variant("baseline resident", lambda o: _launcher(baseline.tgmm_sm90_resident_kernel, resident, lhs,
                                                                 dout, group_sizes, o)),
                variant("resident alone", lambda o: _launcher(gluon_tgmm_kernels.tgmm_sm90_resident_kernel, resident,
                                                              lhs, dout, group_sizes, o)),
                variant(f"streaming, groups >= {past} rows", lambda o: _launcher(
                    gluon_tgmm_kernels.tgmm_sm90_kernel, streaming, lhs, dout, group_sizes, o, past)),
                variant("resident launch (both kernels)", lambda o: gluon_launch.make_tgmm_launch(
                    lhs, dout, group_sizes, o, resident)),
            ])
            for fn in variants.values():
                fn()
            torch.cuda.synchronize()
            times = {label: [] for label in variants}
            for _ in range(rounds):
                for label, fn in variants.items():
                    times[label].append(_round_ms(fn, reps))
            first = outs["baseline streaming"].float()
            scale = float(first.abs().max())
            entry = {"product": name, "routing": routing, "rows": rows, "groups": groups, "K": k, "N": n,
                     "sizes_min_max": [min(sizes), max(sizes)],
                     "groups_past_resident_rows": sum(size > resident.resident_rows for size in sizes),
                     "ms": times,
                     "max_difference_from_first": {label: float((o.float() - first).abs().max()) / scale
                                                   for label, o in outs.items()
                                                   if "groups >=" not in label and label != "resident alone"}}
            report["results"].append(entry)
            print(f"{name}, {routing} ({min(sizes)}-{max(sizes)} rows a group, "
                  f"{entry['groups_past_resident_rows']} past {resident.resident_rows}):", flush=True)
            for label, values in times.items():
                diff = entry["max_difference_from_first"].get(label)
                shown = "" if diff is None else f"  difference {diff:.1e}"
                print(f"    {label:34s} {min(values):.3f}-{max(values):.3f} ms{shown}", flush=True)
            del lhs, dout, outs
            torch.cuda.empty_cache()
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another revision's gluon_tgmm_kernels.py")
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20, help="calls a round, one sync")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = run(args.baseline, args.rounds, args.reps, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    device = next((tag for tag in ("H200", "H100") if tag in report["device"]), report["device"].replace(" ", "_"))
    path = args.out / f"gluon_tgmm_ab_{device}_{report['date']}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
