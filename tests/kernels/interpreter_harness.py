"""Triton kernels under Triton's interpreter, from pytest, without a GPU or jax_triton.

Triton picks interpreter or compiler when a kernel is decorated, i.e. at import, so each
interpreter test module runs itself as a script in one child process started with
``TRITON_INTERPRET=1`` (:func:`run_as_child`), and its tests read the JSON report the child
prints (:func:`report_fixture`). The interpreter is handed numpy arrays dressed as the tensors
it expects (:class:`HostTensor`). Also here: the grouped-row cases and float64 references the
grouped-GEMM kernels' tests share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
# Seen with 3.6: its interpreter cannot bound a range() by a reduction's result.
MIN_TRITON = (3, 9)


def skip_without_interpreter(pytest) -> None:
    """Skips the calling test module where Triton or a recent enough interpreter is missing."""
    triton = pytest.importorskip("triton")
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < MIN_TRITON:
        pytest.skip(f"needs Triton's interpreter from {'.'.join(map(str, MIN_TRITON))} on, found "
                    f"{triton.__version__}", allow_module_level=True)


def run_as_child(interpret_all) -> None:
    """The child process's work: ``interpret_all()``'s report, printed as one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.path.insert(0, str(REPO_ROOT))
    print(json.dumps(interpret_all()))


def report_fixture(test_file: str, **env):
    """A module-scoped fixture: ``test_file`` run as a script under the interpreter, its report."""
    import pytest

    @pytest.fixture(scope="module")
    def interpreter_report():
        child_env = dict(os.environ, TRITON_INTERPRET="1", **env)
        done = subprocess.run([sys.executable, test_file], env=child_env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"interpreter run failed:\n{done.stderr[-4000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    return interpreter_report


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


# (group sizes, rows, group_offset, local groups): empty groups, one group taking every row,
# rows past the last group (dropped copies), a local window of the groups.
CASES = {
    "empty-group": ([10, 0, 17, 3, 7], 37, 0, 5),
    "one-group-takes-all": ([0, 0, 45, 0], 45, 0, 4),
    "trailing-rows-outside": ([5, 9, 0, 11], 33, 0, 4),
    "group-offset-window": ([6, 13, 2, 9, 8], 38, 1, 3),
    "all-empty": ([0, 0, 0], 19, 0, 3),
}


def row_groups(group_sizes, num_rows):
    group_of_row = np.full(num_rows, -1)
    ends = np.cumsum(group_sizes)
    for group, (start, end) in enumerate(zip(ends - group_sizes, ends)):
        group_of_row[start:min(end, num_rows)] = group
    return group_of_row


def gmm_reference(lhs, rhs, group_sizes, group_offset, transpose_rhs):
    weights = np.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    out = np.zeros((lhs.shape[0], weights.shape[2]))
    for row, group in enumerate(row_groups(group_sizes, lhs.shape[0])):
        local = group - group_offset
        if group >= 0 and 0 <= local < weights.shape[0]:
            out[row] = lhs[row].astype(np.float64) @ weights[local].astype(np.float64)
    return out


def summary(out, expected):
    """Unwritten (still NaN) elements and the largest error, relative to the reference's scale."""
    unwritten = int(np.isnan(out).sum())
    error = float(np.nanmax(np.abs(out - expected), initial=0.0) / max(np.abs(expected).max(initial=0.0), 1.0))
    return {"unwritten": unwritten, "max_error": error}
