"""SonicMoE itself and our layer on SonicMoE's twelve Figure 14 shapes, in one run on one GPU.

The SonicMoE side is the shared harness (``run_sonic.sh`` + ``bench_sonic.py``: SonicMoE 0.1.2.post1, the
PyPI release, with its CuTe DSL stack; kept beside the project, not in this repository), run first in its
own process, timed as SonicMoE's ``benchmarks/moe-cute.py`` times (``triton.testing.do_bench``). Our side
runs after that process has exited (JAX takes most of the GPU's memory), timed as ``sonic.py`` times it
(calls back to back, ``jax.vjp`` pulled back from a bf16 cotangent). Both count ``18 T K d n`` per
forward+backward. Each shape's row holds both sides' TFLOP/s, SonicMoE's Figure 14 bar (H100; from the
harness's ``fig14_published_h100.json``), ``ours / measured`` and ``ours / max(measured, Figure 14)``,
whose geometric mean is issue 37's measure.

The GPU's SM clock and power are sampled (``nvidia-smi``) through both sides: a timed loop at 700 W
runs at a power-capped clock (1.1-1.7 GHz on an H200, 2026-11-28, against 1.98 GHz idle), so each
side's clock under load is part of the result.

Writes ``sonic_side_by_side_<device>_<date>.json`` (with ``--tag``, ``sonic_side_by_side_<tag>_...``).

    cp -r ../shared/sonic .sonic          # an ignored folder of the checkout, carried to the GPU machine
    python -m benchmarks sonic-side-by-side --shapes 30B-n256 120B-n2048 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sonic  # noqa: E402  (our side; imports jax, which takes no GPU memory until first used)
from sonic import SHAPES  # noqa: E402

log = logging.getLogger("sonic_side_by_side")

SMI_FIELDS = "timestamp,clocks.sm,power.draw,utilization.gpu"


def harness_configs(names) -> str:
    """``bench_sonic.py --configs`` for our shape names: ``30B-n256`` is ``30B:256``."""
    return ",".join(name.replace("-n", ":") for name in names)


class ClockSampler:
    """``nvidia-smi`` sampling the SM clock, power and load every 250 ms into a file, summarised per
    phase (a wall-clock interval) over the samples at >= 50% load; a no-op where there is no nvidia-smi."""

    def __init__(self, path: Path):
        self.path, self.proc, self.phases = path, None, {}
        if shutil.which("nvidia-smi"):
            with path.open("w") as sink:  # the child keeps its own descriptor
                self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}",
                                              "--format=csv,noheader,nounits", "-lms", "250"],
                                             stdout=sink, stderr=subprocess.DEVNULL)

    def mark(self, phase: str, start: float, end: float) -> None:
        self.phases[phase] = (start, end)

    def stop(self) -> dict:
        if self.proc is None:
            return {"sampled": False}
        self.proc.terminate()
        self.proc.wait()
        samples = []
        for line in self.path.read_text().splitlines():
            fields = [f.strip() for f in line.split(",")]
            try:
                stamp = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((stamp, float(fields[1]), float(fields[2]), float(fields[3])))
            except (ValueError, IndexError):
                continue
        summary = {"sampled": True, "fields": SMI_FIELDS, "max_sm_mhz": max((s[1] for s in samples), default=None)}
        for phase, (start, end) in self.phases.items():
            busy = [s for s in samples if start <= s[0] <= end and s[3] >= 50]
            summary[phase] = {"busy_samples": len(busy),
                              "median_sm_mhz": statistics.median(s[1] for s in busy) if busy else None,
                              "median_power_w": statistics.median(s[2] for s in busy) if busy else None,
                              "max_power_w": max((s[2] for s in busy), default=None)}
        return summary


def run_sonicmoe(sonic_dir: Path, names, work: Path, budget_s: int) -> tuple[list[dict], dict]:
    """SonicMoE's rows and software versions (``bench_sonic.py``'s JSON), run by the harness in a process of
    its own (it puts its own stack on ``PYTHONPATH``)."""
    script = sonic_dir / "run_sonic.sh"
    if not script.is_file():
        raise SystemExit(f"no SonicMoE harness at {sonic_dir} (expected run_sonic.sh there): copy ../shared/sonic "
                         "into the checkout (e.g. .sonic) and pass --sonic-dir")
    env = dict(os.environ, OUT=str(work), SONIC_BUDGET_S=str(budget_s))
    proc = subprocess.run(["bash", str(script), "--configs", harness_configs(names)], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log.info("SonicMoE harness (rc %d):\n%s", proc.returncode, proc.stdout[-3000:])
    path = work / "sonic_moe_measured.json"
    if not path.is_file():
        raise SystemExit(f"the SonicMoE harness wrote no {path.name} (rc {proc.returncode}); its log: {work}/sonic.log")
    doc = json.loads(path.read_text())
    return doc["rows"], doc.get("env", {})


def figure14(sonic_dir: Path) -> dict:
    """SonicMoE's Figure 14 forward+backward TFLOP/s per shape name, as the harness read them off the figure."""
    doc = json.loads((sonic_dir / "fig14_published_h100.json").read_text())
    return {f"{r['model']}-n{r['n']}": r["fwdbwd_tflops"] for r in doc["rows"]}


def fwdbwd_flops(shape) -> float:
    """``18 T K d n``: ``sonic.SonicShape.flops`` counts the forward (6) or the backward (12) alone."""
    return shape.flops(False) + shape.flops(True)


def merge(names, sonic_rows, ours_rows, paper) -> list[dict]:
    """One row per shape: both sides' TFLOP/s and the ratios (None where a side has no number)."""
    order = list(SHAPES)  # bench_sonic.py's config index is the position in sonic.py's table (skipped rows carry no n)
    sonic_by_name = {order[r["idx"]]: r for r in sonic_rows}
    ours_by_name = {r["shape"]: r for r in ours_rows}
    rows = []
    for name in names:
        shape, sonic, ours = SHAPES[name], sonic_by_name.get(name, {}), ours_by_name.get(name, {})
        row = {"shape": name, "T": shape.T, "d": shape.d, "n": shape.n, "E": shape.E, "K": shape.K,
               "sonicmoe_figure14_fwdbwd_tflops": paper.get(name)}
        if "fwdbwd_tflops" in sonic:
            row.update(sonicmoe_fwd_tflops=sonic["fwd_tflops"], sonicmoe_bwd_tflops=sonic["bwd_tflops"],
                       sonicmoe_fwdbwd_tflops=sonic["fwdbwd_tflops"], sonicmoe_fwdbwd_ms=sonic["fwdbwd_ms"],
                       sonicmoe_check_ok=sonic.get("check_ok"))
        else:
            row["sonicmoe_error"] = sonic.get("error", "no row")
        if "fwdbwd_vjp_back_to_back_ms" in ours:
            fwdbwd_ms = ours["fwdbwd_vjp_back_to_back_ms"]
            row.update(ours_fwd_tflops=ours["fwd_tflops"], ours_bwd_tflops=ours["bwd_tflops"],
                       ours_fwdbwd_tflops=fwdbwd_flops(shape) / (fwdbwd_ms * 1e-3) / 1e12, ours_fwdbwd_ms=fwdbwd_ms,
                       ours_peak_bytes=ours.get("peak_bytes"))
        else:
            row["ours_error"] = ours.get("error", "no row")
        if "ours_fwdbwd_tflops" in row and "sonicmoe_fwdbwd_tflops" in row:
            row["ours_over_measured"] = row["ours_fwdbwd_tflops"] / row["sonicmoe_fwdbwd_tflops"]
            best = max(row["sonicmoe_fwdbwd_tflops"], paper.get(name) or 0.0)
            row["ours_over_max_measured_figure14"] = row["ours_fwdbwd_tflops"] / best
        rows.append(row)
    return rows


def print_table(result) -> None:
    print(f"device {result['device']}  {result['date']}  SonicMoE {result['sonicmoe_env'].get('sonicmoe', '?')}")
    print(f"{'shape':12s} {'ours':>6s} {'Sonic':>6s} {'Fig.14':>6s} {'/meas':>6s} {'/max':>6s}   (fwd+bwd TFLOP/s)")
    for r in result["rows"]:
        def fmt(key, spec=".0f"):
            return f"{r[key]:{spec}}" if r.get(key) is not None else "-"
        print(f"{r['shape']:12s} {fmt('ours_fwdbwd_tflops'):>6s} {fmt('sonicmoe_fwdbwd_tflops'):>6s} "
              f"{fmt('sonicmoe_figure14_fwdbwd_tflops'):>6s} {fmt('ours_over_measured', '.3f'):>6s} "
              f"{fmt('ours_over_max_measured_figure14', '.3f'):>6s}"
              + (f"   Sonic: {r['sonicmoe_error'][:50]}" if "sonicmoe_error" in r else "")
              + (f"   ours: {r['ours_error'][:50]}" if "ours_error" in r else ""))
    for key in ("geomean_ours_over_measured", "geomean_ours_over_max_measured_figure14"):
        if result[key]:
            print(f"{key}: {result[key]:.3f} over {result[key + '_shapes']} shapes")
    clocks = result["clocks"]
    for phase in ("sonicmoe", "ours"):
        if clocks.get(phase):
            print(f"{phase}: SM clock {clocks[phase]['median_sm_mhz']} MHz (median under load; "
                  f"max {clocks['max_sm_mhz']}), power {clocks[phase]['median_power_w']} W")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--sonic-dir", type=Path, default=HERE.parent / ".sonic",
                        help="the SonicMoE harness folder (a copy of ../shared/sonic; default: .sonic in the checkout)")
    parser.add_argument("--sonic-budget-s", type=int, default=500,
                        help="SonicMoE's time budget (its first call per shape autotunes, 5-80 s)")
    parser.add_argument("--reps", type=int, default=10, help="our side's timed repetitions (median kept)")
    parser.add_argument("--tag", default="", help="a word for the result file's name")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sampler = ClockSampler(work / "clocks.csv")
        start = time.time()
        sonic_rows, sonic_env = run_sonicmoe(args.sonic_dir.resolve(), args.shapes, work, args.sonic_budget_s)
        middle = time.time()
        ours_path = sonic.run(args.shapes, args.reps, work / "ours", check=False)
        sampler.mark("sonicmoe", start, middle)
        sampler.mark("ours", middle, time.time())
        clocks = sampler.stop()
        ours = json.loads(ours_path.read_text())
    rows = merge(args.shapes, sonic_rows, ours["rows"], figure14(args.sonic_dir))
    result = {
        "device": ours["device"],
        "date": ours["date"],
        "jax": ours["jax"],
        "sonicmoe_env": sonic_env,
        "timing": {"sonicmoe": "triton.testing.do_bench(warmup=5, rep=500), L2 flushed, as its benchmarks/moe-cute.py",
                   "ours": ours["timing"]},
        "flops_counted": "18*T*K*d*n forward+backward (SonicMoE's convention)",
        "order": "SonicMoE first (its own process, exited), then ours",
        "clocks": clocks,
        "rows": rows,
    }
    for key in ("ours_over_measured", "ours_over_max_measured_figure14"):
        values = [r[key] for r in rows if key in r]
        result[f"geomean_{key}"], result[f"geomean_{key}_shapes"] = sonic._geomean(values), len(values)
    stem = "sonic_side_by_side" + (f"_{args.tag}" if args.tag else "")
    path = args.out / f"{stem}_{result['device'].replace(' ', '_')}_{result['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=1))
    print_table(result)
    log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
