"""Generates the documentation's performance page from the committed benchmark results.

    python tools/perf_page.py            # writes docs/performance.md and docs/img/perf_*.png

Every table and plot on the page is read from a file under ``benchmarks/results/`` (named beside
it), so the page says nothing a result does not. The Markdown needs only the standard library
(``tests/test_perf_page.py`` checks that the committed page is what this script writes); the plots
need matplotlib (the ``[docs]`` extra). Run it after adding or replacing a result the page reads.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGE = REPO / "docs" / "performance.md"
IMAGES = REPO / "docs" / "img"

LAYER = "moe_layer_NVIDIA_H200_2026-11-24.json"
SONIC_OURS = ("sonic_small_H100_2026-11-27.json", "sonic_large_H100_2026-11-27.json")
SONIC_MEASURED = "sonic_measured_H100_2026-11-27.json"
SONIC_SIDE_BY_SIDE = ("sonic_side_by_side_small_NVIDIA_H200_2026-11-28.json",
                      "sonic_side_by_side_large_NVIDIA_H200_2026-11-28.json")
EP = ("ep_tiles_final_H200x4_20261122.json", "ep_tiles_final_mixtral_ep2_H200x4_20261122.json")
EP_RERUNS = {("mixtral", 2): EP[1]}  # the mesh's own rerun (with a profile) replaces the first file's row
REALWORLD = "realworld_cpu_cpu_2026-11-24.json"
COMPILE_TIME = "compile_time_cpu_2026-11-27.json"
TUTORIAL = "tutorial_cpu_2026-11-27.json"
HOPPER_TGMM = ("moe_layer_triton_tgmm_NVIDIA_H200_2026-11-28.json", "moe_layer_gluon_tgmm_NVIDIA_H200_2026-11-28.json")
RESIDENT_TGMM = ("moe_layer_tgmm_streamed_NVIDIA_H200_2026-11-29.json", "moe_layer_tgmm_resident_NVIDIA_H200_2026-11-29.json")
GLUON_FORWARD = ("moe_layer_gluon_forward_triton_NVIDIA_H200_2026-11-29.json",
                 "moe_layer_gluon_forward_auto_NVIDIA_H200_2026-11-29.json")
SPLIT_TGMM = ("moe_layer_tgmm_split_streamed_NVIDIA_H200_2026-11-29.json",
              "moe_layer_tgmm_split_auto_NVIDIA_H200_2026-11-29.json")
GLUON_JAX = "gluon_jax_NVIDIA_H200_2026-11-28.json"

LAYER_IMPLS = ("moe_optimize", "tokamax", "ragged_dot", "dense")
IMPL_LABELS = {"moe_optimize": "moe_optimize", "tokamax": "tokamax ragged_dot", "ragged_dot": "lax.ragged_dot",
               "dense": "dense reference"}
LAYER_NAMES = {"mixtral": "Mixtral-8x7B", "qwen3": "Qwen3-30B-A3B", "deepseek": "DeepSeek-V3"}
EP_NAMES = {"mixtral": "Mixtral-like", "deepseek": "DeepSeek-like"}


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _day(result: dict) -> str:
    return str(result["date"])[:10]


# ------------------------------------------------------------------------------------------------
# The data each section shows, read from the results.


def layer_rows() -> dict:
    """{config: {impl: row}} of the layer table (an implementation that failed has its ``error``)."""
    table: dict = {}
    for row in _load(LAYER)["rows"]:
        table.setdefault(row["config"], {})[row["impl"]] = row
    return table


def sonic_rows() -> list[dict]:
    """Per SonicMoE shape: ours (the vjp step, back to back) beside SonicMoE measured and published."""
    measured = {row["shape"]: row for row in _load(SONIC_MEASURED)["rows"]}
    rows = []
    for name in SONIC_OURS:
        for row in _load(name)["rows"]:
            flops = 18 * row["T"] * row["K"] * row["d"] * row["n"]
            sonic = measured[row["shape"]]
            rows.append({
                "shape": row["shape"], "T": row["T"], "d": row["d"], "n": row["n"], "E": row["E"], "K": row["K"],
                "ours": flops / (row["fwdbwd_vjp_back_to_back_ms"] * 1e-3) / 1e12,
                "measured": sonic["sonicmoe_measured_fwdbwd_tflops"],
                "paper": sonic["sonicmoe_figure14_fwdbwd_tflops"],
            })
    return rows


def ep_rows() -> dict:
    """{config: {gpus: (dense ms, moe_optimize ms)}}: forward, back to back, ``"peer"`` transport,
    from ``EP[0]`` except where ``EP_RERUNS`` names a rerun of one mesh."""
    table: dict = {}
    for name in EP:
        found: dict = {}
        for row in _load(name)["rows"]:
            if row.get("kind") != "overlap" or "ms_b2b" not in row or "profile" in row["name"]:
                continue
            gpus = 1 if row["mesh"] == "1gpu" else int(row["mesh"].removeprefix("ep"))
            if row["impl"] in ("dense", "sparse"):
                found.setdefault((row["config"], gpus), {})[row["impl"]] = row["ms_b2b"]
        for (config, gpus), times in found.items():
            if set(times) == {"dense", "sparse"} and EP_RERUNS.get((config, gpus), EP[0]) == name:
                table.setdefault(config, {})[gpus] = (times["dense"], times["sparse"])
    return {config: dict(sorted(by_gpus.items())) for config, by_gpus in table.items()}


def _sonic_by_eye_geomean() -> float:
    """Ours / SonicMoE as ``sonic.py`` itself computes it, against the Figure 14 bars it carries."""
    return _geomean(row["ratio_fwdbwd"] for name in SONIC_OURS for row in _load(name)["rows"])


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


# ------------------------------------------------------------------------------------------------
# The page.


def _layer_section() -> list[str]:
    result, table = _load(LAYER), layer_rows()
    lines = [
        "## One layer on one GPU",
        "",
        f"Forward+backward of one MoE layer in bf16 on one {result['device']} ({_day(result)}, jax "
        f"{result['jax']}), ms (forward in parentheses); `moe_optimize` is the rewritten dense reference. "
        f"Source: `benchmarks/results/{LAYER}` (`python -m benchmarks layer`).",
        "",
        "| layer (T, d, f, E, k) | " + " | ".join(IMPL_LABELS[impl] for impl in LAYER_IMPLS) + " |",
        "|---|" + "---|" * len(LAYER_IMPLS),
    ]
    for config, impls in table.items():
        first = next(row for row in impls.values() if "T" in row)
        sizes = ", ".join(str(first[key]) for key in ("T", "d", "f", "E", "k"))
        cells = []
        for impl in LAYER_IMPLS:
            row = impls.get(impl, {})
            if "fwdbwd_ms" not in row:
                cells.append("out of memory" if "Out of memory" in row.get("error", "") else "n/a")
            else:
                cell = f"{row['fwdbwd_ms']:.1f} ({row['fwd_ms']:.1f})"
                cells.append(f"**{cell}**" if impl == "moe_optimize" else cell)
        lines.append(f"| {LAYER_NAMES.get(config, config)} ({sizes}) | " + " | ".join(cells) + " |")
    mixtral = table["mixtral"]["moe_optimize"]
    lines += [
        "",
        f"Mixtral's rewritten layer runs at {mixtral['fwdbwd_tflops']:.0f} useful TFLOP/s forward+backward, "
        f"{mixtral['pct_of_matmul']:.0f}% of a plain bf16 matmul timed in the same run "
        f"({result['matmul_tflops']:.0f} TFLOP/s).",
        "",
        "![Layer table](img/perf_layer.png)",
        "",
    ]
    return lines


def _sonic_section() -> list[str]:
    rows = sonic_rows()
    ours_file = _load(SONIC_OURS[0])
    lines = [
        "## SonicMoE's shapes on an H100",
        "",
        "SonicMoE (arXiv 2512.14080) is the fastest published MoE layer on Hopper. Its twelve Figure 14 "
        "shapes, forward+backward TFLOPS (18·T·K·d·n / time), each side timed as SonicMoE's own benchmark "
        "runs the step (`jax.vjp` pulled back from a bf16 cotangent, calls back to back). Ours: "
        f"`benchmarks/results/{SONIC_OURS[0]}` and `benchmarks/results/{SONIC_OURS[1]}` (`python -m benchmarks "
        f"sonic`, {ours_file['device']}, {_day(ours_file)}); SonicMoE 0.1.2.post1 measured on an H100 and "
        f"its published Figure 14 bars: `benchmarks/results/{SONIC_MEASURED}`.",
        "",
        "| shape | T | d | n | E | K | ours | SonicMoE measured | SonicMoE paper | ours / max |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        best = max(row["measured"], row["paper"])
        lines.append(f"| {row['shape']} | {row['T']} | {row['d']} | {row['n']} | {row['E']} | {row['K']} | "
                     f"{row['ours']:.0f} | {row['measured']:.0f} | {row['paper']:.0f} | {row['ours'] / best:.2f} |")
    lines += [
        "",
        f"Geometric mean, ours / SonicMoE paper: {_geomean(r['ours'] / r['paper'] for r in rows):.3f}x; "
        f"ours / SonicMoE measured: {_geomean(r['ours'] / r['measured'] for r in rows):.3f}x; "
        f"ours / the larger of the two: {_geomean(r['ours'] / max(r['measured'], r['paper']) for r in rows):.3f}x. "
        f"(Against the bars read by eye that `sonic.py` carries, the same run gives {_sonic_by_eye_geomean():.3f}x: "
        "`benchmarks/results/sonic_H100_2026-11-27.log`.) The two sides ran in different sessions on H100s "
        "of the same kind.",
        "",
        "![SonicMoE shapes](img/perf_sonic.png)",
        "",
    ]
    return lines


def _sonic_side_by_side_section() -> list[str]:
    """SonicMoE itself and ours in one run each half (``sonic_side_by_side.py``), with the clocks under load."""
    halves = [_load(name) for name in SONIC_SIDE_BY_SIDE]
    rows = [row for half in halves for row in half["rows"]]
    lines = [
        f"## SonicMoE itself beside ours on an {halves[0]['device'].removeprefix('NVIDIA ')}",
        "",
        f"SonicMoE {halves[0]['sonicmoe_env'].get('sonicmoe', '')} and our layer on the same GPU, one run per six "
        "shapes (SonicMoE first, in its own process, then ours), each timed as above: "
        + ", ".join(f"`benchmarks/results/{name}`" for name in SONIC_SIDE_BY_SIDE)
        + f" (`python -m benchmarks sonic-side-by-side`, {halves[0]['device']}, {_day(halves[0])}). "
        "Forward+backward TFLOPS; the Figure 14 bars are SonicMoE's H100 numbers.",
        "",
        "| shape | ours | SonicMoE, same run | SonicMoE paper (H100) | ours / SonicMoE | ours / max |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['shape']} | {row['ours_fwdbwd_tflops']:.0f} | {row['sonicmoe_fwdbwd_tflops']:.0f} | "
                     f"{row['sonicmoe_figure14_fwdbwd_tflops']:.0f} | {row['ours_over_measured']:.2f} | "
                     f"{row['ours_over_max_measured_figure14']:.2f} |")
    lines += [
        "",
        f"Geometric mean, ours / SonicMoE in the same run: {_geomean(r['ours_over_measured'] for r in rows):.3f}x "
        f"(d <= 1536: {_geomean(r['ours_over_measured'] for r in halves[0]['rows']):.3f}x, d = 4096: "
        f"{_geomean(r['ours_over_measured'] for r in halves[1]['rows']):.3f}x); ours / the larger of that and "
        f"Figure 14: {_geomean(r['ours_over_max_measured_figure14'] for r in rows):.3f}x.",
        "",
        "At d = 4096 both sides run into the GPU's 700 W power cap, which it holds by lowering the SM clock "
        "(`nvidia-smi` names the reason: SW power cap), so there a layer's power sets its speed; ours draws more "
        "and runs at a lower clock. Median SM clock and power over each side's busy samples (`nvidia-smi` every "
        "250 ms; SonicMoE's timing flushes the L2 between calls, which lowers its average draw a little):",
        "",
        "| shapes | SonicMoE | ours |",
        "|---|---|---|",
    ]
    for label, half in zip(("d <= 1536", "d = 4096"), halves):
        cells = [f"{half['clocks'][side]['median_sm_mhz']:.0f} MHz, {half['clocks'][side]['median_power_w']:.0f} W"
                 for side in ("sonicmoe", "ours")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _hopper_tgmm_section() -> list[str]:
    """The layer with and without the Gluon weight gradient (same machine, back to back)."""
    before, after = (_load(name) for name in HOPPER_TGMM)
    ms = [{row["config"]: row["fwdbwd_ms"] for row in result["rows"] if row["impl"] == "moe_optimize"}
          for result in (before, after)]
    speedups = [row["gluon_over_triton_speed"] for row in _load(GLUON_JAX)["rows"] if row["op"].startswith("tgmm")]
    lines = [
        "## The Hopper weight gradient",
        "",
        "The H100 SonicMoE numbers above predate it; the H200 side-by-side runs it. Since 2026-11-28, on sm_90 "
        "GPUs, the backward's weight gradients run a Gluon kernel (a TMA producer warp, `wgmma` consumer warp groups; a group's last, "
        "partial row block multiplied in 16-row chunks), "
        "launched from JAX through a custom call that encodes the TMA descriptors at run time: "
        f"{min(speedups):.2f}-{max(speedups):.2f}x our Triton `tgmm_kernel` at the d = 4096 shapes "
        f"(`benchmarks/results/{GLUON_JAX}`). The layer's forward+backward without and with it, "
        f"{after['device']}, {_day(after)}, same machine back to back (`benchmarks/results/{HOPPER_TGMM[0]}`, "
        f"`benchmarks/results/{HOPPER_TGMM[1]}`):",
        "",
        "| layer | Triton weight gradient (ms) | Gluon weight gradient (ms) | speed-up |",
        "|---|---|---|---|",
    ]
    for config, name in LAYER_NAMES.items():
        lines.append(f"| {name} | {ms[0][config]:.2f} | {ms[1][config]:.2f} | {ms[0][config] / ms[1][config]:.2f}x |")
    streamed, resident = ({row["config"]: row for row in _load(name)["rows"] if row["impl"] == "moe_optimize"}
                          for name in RESIDENT_TGMM)
    before, after = streamed["deepseek"], resident["deepseek"]
    lines += [
        "",
        "At DeepSeek's groups of about 128 rows each weight gradient writes 7.5 GB, which a plain fill writes in "
        "2.22 ms on the same GPU; streaming both operands the kernel took 3.11-3.19 ms "
        "(`benchmarks/results/gluon_gmm_probe_tgmm_layers_H200_2026-11-28.json`). Since 2026-11-29, groups "
        "averaging at most 192 rows keep their `dout` columns in shared memory across k tiles and stream only "
        "`lhs` (2.57-2.58 ms a product, `benchmarks/results/gluon_gmm_probe_tgmm_resident_H200_2026-11-29.json`): "
        f"DeepSeek-V3's forward+backward {before['fwdbwd_ms']:.2f} -> {after['fwdbwd_ms']:.2f} ms synchronised, "
        f"{before['fwdbwd_back_to_back_ms']:.2f} -> {after['fwdbwd_back_to_back_ms']:.2f} back to back "
        f"(`benchmarks/results/{RESIDENT_TGMM[0]}`, `benchmarks/results/{RESIDENT_TGMM[1]}`).",
        "",
    ]
    streamed, routed = ({row["config"]: row for row in _load(name)["rows"] if row["impl"] == "moe_optimize"}
                        for name in SPLIT_TGMM)
    lines += [
        "With skewed routing a layer averaging ~128 rows a group also has groups of 1000 rows and more, which the "
        "resident kernel reduced a window at a time, reloading `dout` every k tile. It now takes only the groups its "
        "192 rows hold and the streaming kernel the longer ones in a second launch, both reading the sizes on the "
        "device: DeepSeek's products with log-normal expert popularity (5-1615 rows a group) 3.63-3.99 -> "
        "3.25-3.41 ms, balanced even (`benchmarks/results/gluon_tgmm_ab_split_H200_2026-11-29.json`). The streaming "
        "kernel's loop, rewritten for it, runs DeepSeek's products 12% faster. The layers after it, "
        f"{_load(SPLIT_TGMM[1])['device']}, {_day(_load(SPLIT_TGMM[1]))}, as routed and streaming only "
        f"(`benchmarks/results/{SPLIT_TGMM[1]}`, `benchmarks/results/{SPLIT_TGMM[0]}`):",
        "",
        "| layer | as routed (ms) | streaming only (ms) |",
        "|---|---|---|",
    ]
    for config, name in LAYER_NAMES.items():
        lines.append(f"| {name} | {routed[config]['fwdbwd_ms']:.2f} | {streamed[config]['fwdbwd_ms']:.2f} |")
    triton_only, gluon = ({row["config"]: row for row in _load(name)["rows"] if row["impl"] == "moe_optimize"}
                          for name in GLUON_FORWARD)
    lines += [
        "",
        "Since 2026-11-29 the forward and input-gradient products (SwiGLU's gate and up pair, the down projection, "
        "the transposed weights of the input gradient, and the gate and up cotangents summed in one accumulator) "
        "also run Gluon kernels where groups average at most 1024 rows; Mixtral's ~2048-row groups keep Triton's "
        "`gmm_kernel`, which ran them faster. The layers with Triton's forward products and as routed, "
        f"{_load(GLUON_FORWARD[1])['device']}, {_day(_load(GLUON_FORWARD[1]))}, same call "
        f"(`benchmarks/results/{GLUON_FORWARD[0]}`, `benchmarks/results/{GLUON_FORWARD[1]}`; Mixtral runs the same "
        "kernels in both, the run's noise):",
        "",
        "| layer | Triton forward products (ms, synchronised / back to back) | as routed (ms) |",
        "|---|---|---|",
    ]
    for config, name in LAYER_NAMES.items():
        before, after = triton_only[config], gluon[config]
        lines.append(f"| {name} | {before['fwdbwd_ms']:.2f} / {before['fwdbwd_back_to_back_ms']:.2f} | "
                     f"{after['fwdbwd_ms']:.2f} / {after['fwdbwd_back_to_back_ms']:.2f} |")
    lines.append("")
    return lines


def _ep_section() -> list[str]:
    table = ep_rows()
    result = _load(EP[0])
    lines = [
        "## Expert parallelism",
        "",
        f"The sharded layer's forward on one, two and four GPUs of one {result['device']} machine ({_day(result)}), "
        "bf16, ms back to back, "
        "with the `\"peer\"` transport; each speed-up is over the dense reference partitioned by XLA on the "
        f"same mesh. Source: `benchmarks/results/{EP[0]}` (Mixtral at two GPUs: `benchmarks/results/{EP[1]}`), "
        "`python -m benchmarks ep`.",
        "",
        "| layer | GPUs (expert axis) | dense | moe_optimize | speed-up | of the one-GPU speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for config, by_gpus in table.items():
        one_gpu = by_gpus[1][0] / by_gpus[1][1]
        for gpus, (dense, sparse) in by_gpus.items():
            lines.append(f"| {EP_NAMES.get(config, config)} | {gpus} | {dense:.2f} | {sparse:.2f} | "
                         f"{dense / sparse:.2f}x | {dense / sparse / one_gpu:.0%} |")
    lines += ["", "![Expert-parallel scaling](img/perf_ep.png)", ""]
    return lines


def _cpu_section() -> list[str]:
    realworld, compile_time, tutorial = _load(REALWORLD), _load(COMPILE_TIME), _load(TUTORIAL)
    lines = [
        "## On a CPU",
        "",
        f"The tutorial's Flax layer (`benchmarks/results/{TUTORIAL}`, {tutorial['device']}, dense and "
        f"rewritten calls alternated): forward {tutorial['forward_dense_ms']:.1f} -> "
        f"{tutorial['forward_moe_optimize_ms']:.1f} ms "
        f"({tutorial['forward_dense_ms'] / tutorial['forward_moe_optimize_ms']:.1f}x), forward+backward "
        f"{tutorial['fwdbwd_dense_ms']:.1f} -> {tutorial['fwdbwd_moe_optimize_ms']:.1f} ms "
        f"({tutorial['fwdbwd_dense_ms'] / tutorial['fwdbwd_moe_optimize_ms']:.1f}x).",
        "",
        f"Real frameworks' dense MoE layers as shipped, rewritten (`benchmarks/results/{REALWORLD}`, "
        f"`python -m benchmarks realworld`, {realworld['cpu_count']}-core CPU, {_day(realworld)}):",
        "",
        "| layer | forward | forward+backward |",
        "|---|---|---|",
    ]
    for row in realworld["rows"]:
        if row["status"] == "rewritten":
            lines.append(f"| {row['layer']} | {row['speedup_fwd']:.1f}x | {row['speedup_fwdbwd']:.1f}x |")
        else:
            lines.append(f"| {row['layer']} | {row['status']} | |")
    lines += [
        "",
        "### Compile time",
        "",
        "The rewritten program compiles longer than the dense one: trace + lower + XLA compile, this "
        f"process's CPU seconds, from cleared caches (`benchmarks/results/{COMPILE_TIME}`, "
        f"`python -m benchmarks compile-time`, {compile_time['device']}):",
        "",
        "| layer | step | dense s | moe_optimize s | ratio |",
        "|---|---|---|---|---|",
    ]
    for row in compile_time["rows"]:
        lines.append(f"| {row['layer']} | {row['step']} | {row['dense_total_cpu_s']:.2f} | "
                     f"{row['moe_optimize_total_cpu_s']:.2f} | {row['total_cpu_ratio']:.2f}x |")
    lines.append("")
    return lines


def render_markdown() -> str:
    lines = [
        "# Performance",
        "",
        "<!-- Generated by tools/perf_page.py from benchmarks/results: edit the script, not this page. -->",
        "",
        "Every number and plot on this page is read from a committed result under `benchmarks/results/`, "
        "named beside it; `benchmarks/README.md` indexes the results and the commands that made them, and "
        "`benchmarks/NOTES.md` says how the numbers were reached.",
        "",
    ]
    lines += (_layer_section() + _sonic_section() + _sonic_side_by_side_section() + _hopper_tgmm_section()
              + _ep_section() + _cpu_section())
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# The plots.


def render_plots(folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    folder.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        path = folder / name
        fig.tight_layout()
        fig.savefig(path, dpi=110, metadata={"Software": None})
        plt.close(fig)
        written.append(path)

    # The SonicMoE shapes: three bars per shape.
    rows = sonic_rows()
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.27
    for i, (key, label) in enumerate((("ours", "moe_optimize"), ("measured", "SonicMoE measured"),
                                      ("paper", "SonicMoE paper (Fig. 14)"))):
        ax.bar([j + (i - 1) * width for j in range(len(rows))], [row[key] for row in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [row["shape"] for row in rows], rotation=30, ha="right")
    ax.set_ylabel("forward+backward TFLOPS")
    ax.set_title("SonicMoE's twelve shapes, one H100, bf16")
    ax.legend(loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    save(fig, "perf_sonic.png")

    # The layer table: forward+backward ms per implementation, per layer.
    table = layer_rows()
    fig, axes = plt.subplots(1, len(table), figsize=(11, 3.6))
    for ax, (config, impls) in zip(axes, table.items()):
        names, values = [], []
        for impl in LAYER_IMPLS:
            names.append(IMPL_LABELS[impl].replace(" ", "\n", 1))
            values.append(impls.get(impl, {}).get("fwdbwd_ms", 0.0))
        bars = ax.bar(names, values, color=["C0", "C1", "C2", "C7"])
        for bar, value in zip(bars, values):
            ax.annotate("OOM" if value == 0.0 else f"{value:.1f}", (bar.get_x() + bar.get_width() / 2, value),
                        ha="center", va="bottom", fontsize=8)
        ax.set_title(LAYER_NAMES.get(config, config))
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("forward+backward ms (lower is better)")
    fig.suptitle("One MoE layer on one H200, bf16")
    save(fig, "perf_layer.png")

    # Expert-parallel scaling: forward ms against GPUs, dense and rewritten.
    table = ep_rows()
    fig, axes = plt.subplots(1, len(table), figsize=(9, 3.6))
    for ax, (config, by_gpus) in zip(axes, table.items()):
        gpus = list(by_gpus)
        ax.plot(gpus, [by_gpus[g][0] for g in gpus], "o-", color="C7", label="dense reference (XLA-partitioned)")
        ax.plot(gpus, [by_gpus[g][1] for g in gpus], "o-", color="C0", label="moe_optimize (peer transport)")
        for g in gpus:
            ax.annotate(f"{by_gpus[g][0] / by_gpus[g][1]:.1f}x", (g, by_gpus[g][1]), textcoords="offset points",
                        xytext=(0, 7), ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlim(0.8, gpus[-1] * 1.25)
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.set_xlabel("GPUs on the expert axis")
        ax.set_title(EP_NAMES.get(config, config))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("forward ms")
    axes[0].legend(fontsize=7)
    fig.suptitle("Expert parallelism on H200s, bf16 forward")
    save(fig, "perf_ep.png")
    return written


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-plots", action="store_true", help="write the Markdown only (no matplotlib needed)")
    args = parser.parse_args()
    PAGE.write_text(render_markdown())
    print(f"wrote {PAGE.relative_to(REPO)}")
    if not args.no_plots:
        for path in render_plots(IMAGES):
            print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
