"""The Triton ``swiglu_rows`` kernels run by Triton's interpreter on the CPU.

Checks that the persistent programs cover exactly the first ``num_rows`` rows (an output
filled with NaN keeps its NaNs after them), clamp ``num_rows`` into the buffer, and compute the
activation and its gradient, in a child process (``interpreter_harness``).
"""

from __future__ import annotations

import numpy as np

import interpreter_harness as harness
from interpreter_harness import HostTensor

if __name__ != "__main__":
    import pytest

    harness.skip_without_interpreter(pytest)

# (rows in the buffer, features, rows counted): a partial last row block and column block, none,
# all, and more than the buffer holds (clamped)
CASES = {"partial": (29, 40, 13), "none": (16, 24, 0), "all": (24, 16, 24), "past-the-buffer": (10, 24, 99)}
LAUNCH = dict(BLOCK_ROWS=4, BLOCK_COLS=16, NUM_PROGRAMS=3)


def _check(out, want, counted):
    """Max error on the counted rows, and how many elements after them are not NaN (written)."""
    return {"max_error": float(np.max(np.abs(out[:counted] - want[:counted]), initial=0.0)),
            "written_after": int(np.sum(~np.isnan(out[counted:])))}


def _run(kernels, rows, features, counted):
    rng = np.random.default_rng(rows * 100 + features)
    gate, up, d_out = (3 * rng.standard_normal((rows, features)).astype(np.float32) for _ in range(3))
    num_rows = np.array([counted], np.int32)
    out, d_gate, d_up = (np.full((rows, features), np.nan, np.float32) for _ in range(3))
    shape = dict(M=rows, N=features, **LAUNCH)
    grid = (LAUNCH["NUM_PROGRAMS"],)
    kernels.swiglu_rows_kernel[grid](*map(HostTensor, (gate, up, num_rows, out)), **shape)
    kernels.swiglu_rows_grads_kernel[grid](*map(HostTensor, (d_out, gate, up, num_rows, d_gate, d_up)), **shape)
    g, u, d = (a.astype(np.float64) for a in (gate, up, d_out))
    s = 1.0 / (1.0 + np.exp(-g))
    counted = min(counted, rows)
    return {"out": _check(out, g * s * u, counted), "d_up": _check(d_up, d * g * s, counted),
            "d_gate": _check(d_gate, d * u * s * (1 + g * (1 - s)), counted)}


def _jobs():
    """Every case as a job for the interpreter child (see ``interpreter_harness``)."""
    from moe_lowering.kernels.swiglu_rows import triton_kernels

    return {name: (lambda v=case: _run(triton_kernels, *v)) for name, case in CASES.items()}


if __name__ == "__main__":
    harness.run_as_child(_jobs)
else:
    interpreter_report = harness.report_fixture(__file__, CASES)

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_swiglu_rows_kernels_cover_the_counted_rows(interpreter_report, name):
        for output, result in interpreter_report[name].items():
            assert result["written_after"] == 0, f"{output}: wrote {result['written_after']} elements past num_rows"
            assert result["max_error"] < 1e-5, (output, result)
