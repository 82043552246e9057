"""The examples run as the README and the docs say, each in a fresh interpreter (the tutorial and the
sharded example set their host devices before JAX starts), and their checks hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # The examples set their own host devices; of the suite's XLA flags only the optimisation level
    # (tests/conftest.py: compiling is most of an example's time on a CPU) goes with them.
    level = [flag for flag in env.pop("XLA_FLAGS", "").split() if flag.startswith("--xla_backend_optimization_level")]
    if level:
        env["XLA_FLAGS"] = " ".join(level)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, f"{name} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_quickstart():
    out = run_example("quickstart.py")
    assert out.startswith("moe_lowering: 1 MoE region(s) found\n")
    assert "output relative error vs dense reference: " in out


@pytest.mark.tutorial
def test_sharded_example_checks_the_expert_parallel_layer():
    """docs/sharded.md includes examples/sharded.py whole: it runs, on eight host devices, and its
    asserts (outputs and gradients against the dense layer) hold."""
    out = run_example("sharded.py")
    assert "sharded: expert parallel over 'expert' (4 ranks x 2 experts)" in out
    assert out.rstrip().endswith("gradients match the dense layer's")
    page = (ROOT / "docs" / "sharded.md").read_text()
    assert '--8<-- "examples/sharded.py"' in page


@pytest.mark.tutorial
def test_tutorial_runs_every_section_and_writes_its_timings(tmp_path):
    out = run_example("tutorial.py", "--reps", "3", "--out", str(tmp_path))
    sections = [line for line in out.splitlines() if line.startswith("== ")]
    assert [s.split(".")[0] for s in sections] == ["== 2", "== 3", "== 4", "== 6", "== 7", "== 8", "== 9"], sections
    assert "sharded: expert parallel over 'expert' (2 ranks x 8 experts)" in out
    (written,) = tmp_path.glob("tutorial_cpu_*.json")
    result = json.loads(written.read_text())
    assert result["reps"] == 3 and result["device"].startswith("CPU")
    for key in ("forward_dense_ms", "forward_moe_optimize_ms", "fwdbwd_dense_ms", "fwdbwd_moe_optimize_ms"):
        assert result[key] > 0, key


@pytest.mark.tutorial
def test_train_example_trains_three_placements_alike():
    """examples/train.py: the dense model, the decorated layer and the decorated train step train alike
    (the script asserts the trajectories agree to float32 relative 1e-5; 8 steps here)."""
    out = run_example("train.py", "--steps", "8")
    assert "layer: 8 steps" in out and "sparse MoE in the lowered step: yes" in out
    assert "layer: largest relative loss difference to dense" in out
