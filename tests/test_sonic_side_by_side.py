"""The side-by-side SonicMoE benchmark's driver, on a stand-in harness (no GPU, no SonicMoE)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sonic  # noqa: E402
import sonic_side_by_side as side  # noqa: E402

SHAPES = ["30B-n256", "120B-n2048"]

# A stand-in for run_sonic.sh: writes bench_sonic.py's JSON for the configs it is given; the second shape
# "ran out of time", as the real harness reports a skipped config.
FAKE_HARNESS = r"""#!/usr/bin/env bash
echo "$@" > "$OUT/args.txt"
cat > "$OUT/sonic_moe_measured.json" <<JSON
{"env": {"sonicmoe": "fake"}, "rows": [
 {"idx": 6, "model": "30B", "T": 32768, "d": 4096, "n": 256, "E": 256, "K": 16, "fwd_ms": 7.0, "fwdbwd_ms": 20.0,
  "fwd_tflops": 460.0, "bwd_tflops": 480.0, "fwdbwd_tflops": 400.0, "check_ok": true},
 {"idx": 11, "model": "120B", "error": "skipped: time budget (13 s left)"}]}
JSON
"""


@pytest.fixture
def harness(tmp_path):
    folder = tmp_path / "sonic"
    folder.mkdir()
    (folder / "run_sonic.sh").write_text(FAKE_HARNESS)
    (folder / "fig14_published_h100.json").write_text(json.dumps({"rows": [
        {"model": "30B", "n": 256, "fwdbwd_tflops": 450.0}, {"model": "120B", "n": 2048, "fwdbwd_tflops": 590.0}]}))
    return folder


def _fake_ours(monkeypatch, fwdbwd_ms):
    def run(names, reps, out_dir, check):
        rows = []
        for name in names:
            if name not in fwdbwd_ms:
                rows.append({"shape": name, "error": "RESOURCE_EXHAUSTED: out of memory"})
                continue
            rows.append({"shape": name, "fwdbwd_vjp_back_to_back_ms": fwdbwd_ms[name], "fwd_tflops": 1.0,
                         "bwd_tflops": 1.0, "peak_bytes": 1})
        out_dir.mkdir(parents=True)
        path = out_dir / "ours.json"
        path.write_text(json.dumps({"device": "Fake GPU", "date": "2026-11-28T00:00:00+00:00", "jax": "x",
                                    "timing": "t", "rows": rows}))
        return path

    monkeypatch.setattr(sonic, "run", run)


def test_harness_configs_are_bench_sonic_names():
    assert side.harness_configs(["30B-n256", "1.4B-n1024"]) == "30B:256,1.4B:1024"
    assert side.harness_configs(list(sonic.SHAPES)).count(":") == 12


def test_one_result_with_both_sides_and_the_ratios(harness, tmp_path, monkeypatch, capsys):
    flops = 18 * 32768 * 16 * 4096 * 256  # 18 T K d n of 30B-n256
    ours_ms = flops / 420e12 * 1e3  # 420 TFLOP/s: above SonicMoE measured (400), below Figure 14 (450)
    _fake_ours(monkeypatch, {"30B-n256": ours_ms, "120B-n2048": 30.0})
    out = tmp_path / "results"
    assert side.main(["--shapes", *SHAPES, "--sonic-dir", str(harness), "--out", str(out), "--reps", "1"]) == 0
    (path,) = out.glob("sonic_side_by_side_Fake_GPU_2026-11-28.json")
    result = json.loads(path.read_text())
    first, second = result["rows"]
    assert first["ours_fwdbwd_tflops"] == pytest.approx(420.0)
    assert first["ours_over_measured"] == pytest.approx(420.0 / 400.0)
    assert first["ours_over_max_measured_figure14"] == pytest.approx(420.0 / 450.0)  # the larger of the two
    assert second["sonicmoe_error"].startswith("skipped: time budget")
    assert "ours_over_measured" not in second  # no SonicMoE number, no ratio
    assert result["geomean_ours_over_max_measured_figure14"] == pytest.approx(420.0 / 450.0)
    assert result["geomean_ours_over_max_measured_figure14_shapes"] == 1
    assert result["sonicmoe_env"] == {"sonicmoe": "fake"}
    assert "skipped: time budget" in capsys.readouterr().out


def test_a_failed_shape_of_ours_is_a_row_not_a_crash(harness, tmp_path, monkeypatch):
    _fake_ours(monkeypatch, {})
    out = tmp_path / "results"
    side.main(["--shapes", "30B-n256", "--sonic-dir", str(harness), "--out", str(out)])
    (row,) = json.loads(next(out.glob("*.json")).read_text())["rows"]
    assert row["ours_error"].startswith("RESOURCE_EXHAUSTED") and "ours_over_measured" not in row


def test_a_missing_harness_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no SonicMoE harness"):
        side.main(["--shapes", "30B-n256", "--sonic-dir", str(tmp_path / "absent"), "--out", str(tmp_path)])
