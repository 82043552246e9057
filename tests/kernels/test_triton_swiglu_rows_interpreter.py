"""The Triton ``swiglu_rows`` kernels run by Triton's interpreter on the CPU.

Checks that the persistent programs cover exactly the first ``num_rows`` rows (an output
filled with NaN keeps its NaNs after them), clamp ``num_rows`` into the buffer, and compute the
activation and its gradient. Like ``test_triton_gmm_interpreter`` (whose numpy-backed tensors it
reuses), the kernels run in one child process started with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

if __name__ != "__main__":
    import pytest

    triton = pytest.importorskip("triton")
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"needs Triton's interpreter from 3.9 on, found {triton.__version__}", allow_module_level=True)

_HERE = Path(__file__).resolve().parent

# (rows in the buffer, features, rows counted): a partial last row block and column block, none,
# all, and more than the buffer holds (clamped)
CASES = {"partial": (29, 40, 13), "none": (16, 24, 0), "all": (24, 16, 24), "past-the-buffer": (10, 24, 99)}
LAUNCH = dict(BLOCK_ROWS=4, BLOCK_COLS=16, NUM_PROGRAMS=3)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(out, want, counted):
    """Max error on the counted rows, and how many elements after them are not NaN (written)."""
    return {"max_error": float(np.max(np.abs(out[:counted] - want[:counted]), initial=0.0)),
            "written_after": int(np.sum(~np.isnan(out[counted:])))}


def _run(kernels, host, rows, features, counted):
    rng = np.random.default_rng(rows * 100 + features)
    gate, up, d_out = (3 * rng.standard_normal((rows, features)).astype(np.float32) for _ in range(3))
    num_rows = np.array([counted], np.int32)
    out, d_gate, d_up = (np.full((rows, features), np.nan, np.float32) for _ in range(3))
    shape = dict(M=rows, N=features, **LAUNCH)
    kernels.swiglu_rows_kernel[(LAUNCH["NUM_PROGRAMS"],)](host(gate), host(up), host(num_rows), host(out), **shape)
    kernels.swiglu_rows_grads_kernel[(LAUNCH["NUM_PROGRAMS"],)](
        host(d_out), host(gate), host(up), host(num_rows), host(d_gate), host(d_up), **shape)
    g, u, d = (a.astype(np.float64) for a in (gate, up, d_out))
    s = 1.0 / (1.0 + np.exp(-g))
    counted = min(counted, rows)
    return {"out": _check(out, g * s * u, counted), "d_up": _check(d_up, d * g * s, counted),
            "d_gate": _check(d_gate, d * u * s * (1 + g * (1 - s)), counted)}


def _interpret_all():
    """Runs every case under the interpreter; called in the child process."""
    sys.path.insert(0, str(_HERE.parents[1]))
    from moe_lowering.kernels import triton_swiglu_rows_kernels as triton_swiglu_rows

    host = _load("_gmm_interpreter_helpers", _HERE / "test_triton_gmm_interpreter.py").HostTensor
    return {name: _run(triton_swiglu_rows, host, *case) for name, case in CASES.items()}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    print(json.dumps(_interpret_all()))
else:

    @pytest.fixture(scope="module")
    def interpreter_report():
        env = dict(os.environ, TRITON_INTERPRET="1")
        done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"interpreter run failed:\n{done.stderr[-4000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_swiglu_rows_kernels_cover_the_counted_rows(interpreter_report, name):
        for output, result in interpreter_report[name].items():
            assert result["written_after"] == 0, f"{output}: wrote {result['written_after']} elements past num_rows"
            assert result["max_error"] < 1e-5, (output, result)
