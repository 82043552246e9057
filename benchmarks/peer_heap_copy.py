"""The peer heap receiver's copy (``heap_wait_kernel``) alone on one GPU, against a plain device copy.

In one process per GPU the rows a rank receives land in its peer-heap region and ``heap_wait``
copies them out into an XLA buffer; one process needs no copy. This times that copy for the row
counts of the Mixtral- and DeepSeek-like layers at EP=2 and 4 over (programs, warps, rows per
tile), with the pushes taken as arrived (the arrival words preset), to choose the launch; the
ceiling is ``torch``'s device-to-device copy of the same bytes. Every variant's output is compared
with the region's rows. Writes ``peer_heap_copy_<device>_<date>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_lowering.kernels.peer_store.triton_kernels import heap_wait_kernel  # noqa: E402

NUM_PEERS = 2
# (name, rows received, width): home rows (T_local * k) and dispatched rows of the layers at EP=2.
SHAPES = [("deepseek-home-ep2", 16384, 7168), ("deepseek-tokens-ep2", 4096, 7168),
          ("mixtral-home-ep2", 16384, 4096), ("deepseek-home-ep4", 8192, 7168)]
VARIANTS = [(32, 4, 8), (132, 4, 8), (132, 8, 8), (132, 8, 16), (264, 4, 8), (264, 8, 8)]


def _words(address: int) -> list[int]:
    return [address & 0xFFFFFFFF, address >> 32]


def _time(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    device = torch.cuda.get_device_name()
    rows_out = []
    for name, rows, width in SHAPES:
        region = torch.randn(rows, width, device="cuda").to(torch.bfloat16)
        out = torch.empty_like(region)
        control = torch.zeros(2 * NUM_PEERS + 2, dtype=torch.int32, device="cuda")
        control[:NUM_PEERS] = 2**30  # every peer's pushes counted as arrived, for ~2**30 / signals uses
        table = torch.tensor([_words(region.data_ptr()) + _words(control.data_ptr())] * NUM_PEERS,
                             dtype=torch.int64).to(torch.int32).cuda().reshape(-1)
        rank = torch.zeros(1, dtype=torch.int32, device="cuda")
        num_rows = torch.tensor([rows], dtype=torch.int32, device="cuda")
        done = torch.zeros(1, dtype=torch.int32, device="cuda")
        gigabytes = 2 * region.numel() * region.element_size() / 1e9
        ceiling_ms = _time(lambda: out.copy_(region), args.reps)
        row = {"shape": name, "rows": rows, "width": width, "torch_copy_ms": ceiling_ms,
               "torch_copy_GBps": gigabytes / ceiling_ms * 1e3, "variants": []}
        for programs, warps, block_rows in VARIANTS:
            def launch():
                heap_wait_kernel[(programs,)](table, rank, num_rows, done, out, NUM_ROWS=rows, D=width,
                                              NUM_PEERS=NUM_PEERS, SIGNALS_PER_PEER=1, BLOCK_ROWS=block_rows,
                                              BLOCK_D=1024, NUM_PROGRAMS=programs, ZEROED=False, ZERO_TAIL=False,
                                              num_warps=warps)
            out.zero_()
            launch()
            torch.cuda.synchronize()
            exact = bool(torch.equal(out, region))
            ms = _time(launch, args.reps)
            row["variants"].append({"programs": programs, "warps": warps, "block_rows": block_rows, "exact": exact,
                                    "ms": ms, "GBps": gigabytes / ms * 1e3, "of_copy": ceiling_ms / ms})
            print(f"{name:22s} programs {programs:4d} warps {warps} rows/tile {block_rows:2d}: {ms:.3f} ms "
                  f"{gigabytes / ms * 1e3:6.0f} GB/s ({ceiling_ms / ms:.2f} of torch copy {ceiling_ms:.3f} ms) "
                  f"exact {exact}", flush=True)
        rows_out.append(row)
    now = datetime.datetime.now(datetime.timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"peer_heap_copy_{device.replace(' ', '_')}_{now:%Y-%m-%d}.json"
    path.write_text(json.dumps({"device": device, "date": now.isoformat(), "triton": triton.__version__,
                                "rows": rows_out}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
