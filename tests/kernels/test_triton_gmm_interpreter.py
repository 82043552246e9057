"""The Triton grouped-GEMM kernels run by Triton's interpreter on the CPU, at tiny tile sizes.

This checks the kernels' on-device scheduling (per-group row tiles, persistent loop, zero rows
outside the local groups, clamped loads, K remainders) without a GPU or jax_triton: the
interpreter is handed numpy arrays dressed as the tensors it expects.

Triton picks interpreter or compiler when its functions are decorated, i.e. at import, so the
kernels run in one child process started with ``TRITON_INTERPRET=1`` (this file as a script);
the tests read its JSON report.
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
        # Seen with 3.6: its interpreter cannot bound a range() by a reduction's result.
        pytest.skip(f"needs Triton's interpreter from 3.9 on, found {triton.__version__}", allow_module_level=True)

_REPO_ROOT = Path(__file__).resolve().parents[2]


class _HostStorage:
    def __init__(self, array):
        self.array = array

    def data_ptr(self):
        return self.array.ctypes.data

    def cpu(self):
        return self

    def copy_(self, other):
        return self


class HostTensor:
    """A numpy array posing as the device tensor Triton's interpreter reads and writes in place."""

    def __init__(self, array):
        assert array.flags.c_contiguous
        self.array = array

    @property
    def dtype(self):
        return str(self.array.dtype)

    def data_ptr(self):
        return self.array.ctypes.data

    def untyped_storage(self):
        return _HostStorage(self.array)

    def new_empty(self, *args, **kwargs):
        return self

    def set_(self, *args, **kwargs):
        return self

    def storage_offset(self):
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(step // self.array.itemsize for step in self.array.strides)

    def copy_(self, other):
        return self


BLOCK = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)
NUM_PROGRAMS = 3


def _row_groups(group_sizes, num_rows):
    group_of_row = np.full(num_rows, -1)
    ends = np.cumsum(group_sizes)
    for group, (start, end) in enumerate(zip(ends - group_sizes, ends)):
        group_of_row[start:min(end, num_rows)] = group
    return group_of_row


def _gmm_reference(lhs, rhs, group_sizes, group_offset, transpose_rhs):
    weights = np.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    out = np.zeros((lhs.shape[0], weights.shape[2]))
    for row, group in enumerate(_row_groups(group_sizes, lhs.shape[0])):
        local = group - group_offset
        if group >= 0 and 0 <= local < weights.shape[0]:
            out[row] = lhs[row].astype(np.float64) @ weights[local].astype(np.float64)
    return out


def _tgmm_reference(lhs, grad, group_sizes, group_offset, num_groups):
    out = np.zeros((num_groups, lhs.shape[1], grad.shape[1]))
    group_of_row = _row_groups(group_sizes, lhs.shape[0])
    for local in range(num_groups):
        rows = group_of_row == local + group_offset
        out[local] = lhs[rows].astype(np.float64).T @ grad[rows].astype(np.float64)
    return out


# (group sizes, rows, group_offset, local groups): empty groups, one group taking every row,
# rows past the last group (dropped copies), a local window of the groups.
CASES = {
    "empty-group": ([10, 0, 17, 3, 7], 37, 0, 5),
    "one-group-takes-all": ([0, 0, 45, 0], 45, 0, 4),
    "trailing-rows-outside": ([5, 9, 0, 11], 33, 0, 4),
    "group-offset-window": ([6, 13, 2, 9, 8], 38, 1, 3),
    "all-empty": ([0, 0, 0], 19, 0, 3),
}
GMM_VARIANTS = {f"{case}-k{k}-{'rhsT' if t else 'rhs'}": (case, k, t) for case in CASES for k in (24, 32) for t in (False, True)}


def _run_gmm(kernels, case, k, transpose_rhs):
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    rng = np.random.default_rng(len(group_sizes) * 100 + num_rows + k)
    n = 40
    group_sizes = np.asarray(group_sizes, np.int32)
    lhs = rng.standard_normal((num_rows, k)).astype(np.float32)
    rhs_shape = (num_local, n, k) if transpose_rhs else (num_local, k, n)
    rhs = rng.standard_normal(rhs_shape).astype(np.float32)
    out = np.full((num_rows, n), np.nan, np.float32)
    kernels.gmm_kernel[(NUM_PROGRAMS,)](
        HostTensor(lhs), HostTensor(rhs), HostTensor(group_sizes), HostTensor(np.array([group_offset], np.int32)),
        HostTensor(out), M=num_rows, K=k, N=n, NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes),
        GROUPS_PAD=8, TRANSPOSE_RHS=transpose_rhs, NUM_PROGRAMS=NUM_PROGRAMS, COMPUTE_F32=True, **BLOCK,
    )
    return out, _gmm_reference(lhs, rhs, group_sizes, group_offset, transpose_rhs)


def _run_tgmm(kernels, case):
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    rng = np.random.default_rng(len(group_sizes) * 100 + num_rows)
    k, n = 24, 40
    group_sizes = np.asarray(group_sizes, np.int32)
    lhs = rng.standard_normal((num_rows, k)).astype(np.float32)
    grad = rng.standard_normal((num_rows, n)).astype(np.float32)
    out = np.full((num_local, k, n), np.nan, np.float32)
    kernels.tgmm_kernel[(NUM_PROGRAMS,)](
        HostTensor(lhs), HostTensor(grad), HostTensor(group_sizes), HostTensor(np.array([group_offset], np.int32)),
        HostTensor(out), M=num_rows, K=k, N=n, NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes), GROUPS_PAD=8,
        BLOCK_K=16, BLOCK_N=16, BLOCK_R=16, GROUP_M=2, NUM_PROGRAMS=NUM_PROGRAMS, COMPUTE_F32=True,
    )
    return out, _tgmm_reference(lhs, grad, group_sizes, group_offset, num_local)


def _summary(out, expected):
    """Unwritten (still NaN) elements and the largest error, relative to the reference's scale."""
    unwritten = int(np.isnan(out).sum())
    error = float(np.nanmax(np.abs(out - expected), initial=0.0) / max(np.abs(expected).max(initial=0.0), 1.0))
    return {"unwritten": unwritten, "max_error": error}


def _interpret_all():
    """Runs every case under the interpreter; called in the child process."""
    spec = importlib.util.spec_from_file_location(
        "triton_gmm_kernels", _REPO_ROOT / "moe_lowering" / "kernels" / "triton_gmm_kernels.py")
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    report = {f"gmm-{name}": _summary(*_run_gmm(kernels, *variant)) for name, variant in GMM_VARIANTS.items()}
    report.update({f"tgmm-{case}": _summary(*_run_tgmm(kernels, case)) for case in CASES})
    return report


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

    @pytest.mark.parametrize("name", sorted(GMM_VARIANTS))
    def test_gmm_kernel_matches_reference(interpreter_report, name):
        result = interpreter_report[f"gmm-{name}"]
        assert result["unwritten"] == 0, f"{result['unwritten']} output elements were never written"
        assert result["max_error"] < 1e-5, result

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_tgmm_kernel_matches_reference(interpreter_report, case):
        result = interpreter_report[f"tgmm-{case}"]
        assert result["unwritten"] == 0, f"{result['unwritten']} output elements were never written"
        assert result["max_error"] < 1e-5, result
