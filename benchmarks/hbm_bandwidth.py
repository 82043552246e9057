"""HBM read, write and copy bandwidth of one GPU (torch, CUDA events), and the byte floor they put
under a layer whose time is weight traffic: DeepSeek-V3's MoE layer forward+backward reads its 22.5 GB
of bf16 expert weights twice (forward, input gradient) and writes 22.5 GB of weight gradients.

One 7.5 GB bf16 tensor (a DeepSeek-V3 expert weight, ``[256, 7168, 2048]``): a row sum (read), a fill
(write), a copy (both); the median of ``--reps`` after a warm-up. Writes ``hbm_bandwidth_<device>_<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

DEEPSEEK_WEIGHT_BYTES = 3 * 256 * 7168 * 2048 * 2  # w_gate, w_up, w_down in bf16


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    args = parser.parse_args(argv)
    import torch

    x = torch.randn(DEEPSEEK_WEIGHT_BYTES // 6, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)

    def median_ms(fn):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    gigabytes = x.numel() * 2 / 1e9
    read_ms = median_ms(lambda: x.view(-1, 4096).sum(dim=1, dtype=torch.float32))
    write_ms = median_ms(lambda: y.fill_(1.0))
    copy_ms = median_ms(lambda: y.copy_(x))
    read, write = gigabytes / read_ms, gigabytes / write_ms  # TB/s
    weights = DEEPSEEK_WEIGHT_BYTES / 1e9
    result = dict(device=torch.cuda.get_device_name(), date=str(datetime.date.today()), tensor_GB=gigabytes,
                  read_TBps=read, write_TBps=write, copy_TBps=2 * gigabytes / copy_ms,
                  deepseek_weight_GB=weights, deepseek_fwdbwd_floor_ms=2 * weights / read + weights / write)
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"hbm_bandwidth_{result['device'].replace(' ', '_')}_{datetime.date.today():%Y%m%d}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
