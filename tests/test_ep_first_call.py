"""The first-call benchmark's driver on host CPU devices: each run a fresh process under a timeout, its
outcome (finished with checksums, or stalled with the child's log) in one JSON per device and date."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multidevice  # two host CPU devices in each child
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ep_first_call.py"


def _run(tmp_path, *options):
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--runs", "1", "--out", str(tmp_path), *options],
                          capture_output=True, text=True, timeout=900)
    (result,) = tmp_path.glob("ep_first_call_cpu_*.json")
    return done.returncode, json.loads(result.read_text())["rows"]


def test_first_calls_finish_alike_with_the_routing_passed_or_closed_over(tmp_path):
    code, rows = _run(tmp_path, "--modes", "args", "closure", "--timeout", "600")
    assert code == 0, rows
    assert [(r["mode"], r["status"]) for r in rows] == [("args", "ok"), ("closure", "ok")]
    assert rows[0]["checksums"] == rows[1]["checksums"] and len(rows[0]["checksums"]) == 4


def test_a_run_past_its_timeout_is_reported_stalled_with_its_log(tmp_path):
    code, rows = _run(tmp_path, "--modes", "args", "--timeout", "0.01")  # no process imports JAX this fast
    assert code == 1
    (row,) = rows
    assert row["status"] == "stalled" and "checksums" not in row and isinstance(row["log_tail"], list)
