"""Triton kernels under Triton's interpreter, from pytest, without a GPU or jax_triton.

Triton picks interpreter or compiler when a kernel is decorated, i.e. at import, so each
interpreter test module runs itself as a script in child processes started with
``TRITON_INTERPRET=1``. A module names its cases as jobs (:func:`run_as_child` gets a function
returning ``{report key: zero-argument callable}``); its tests read a lazy report
(:func:`report_fixture`) that runs the chunk of jobs holding the key asked for, in one child, the
first time one of them is asked for. Chunks keep each child short and its progress visible, and
no child has a time limit: a slower machine takes longer, it does not fail. The interpreter is
handed numpy arrays dressed as the tensors it expects (:class:`HostTensor`). Also here: the
grouped-row cases and float64 references the grouped-GEMM kernels' tests share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HARNESS_DIR = Path(__file__).resolve().parent
REPO_ROOT = HARNESS_DIR.parents[1]
# Seen with 3.6: its interpreter cannot bound a range() by a reduction's result.
MIN_TRITON = (3, 9)


def skip_without_interpreter(pytest) -> None:
    """Skips the calling test module where Triton or a recent enough interpreter is missing."""
    triton = pytest.importorskip("triton")
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < MIN_TRITON:
        pytest.skip(f"needs Triton's interpreter from {'.'.join(map(str, MIN_TRITON))} on, found "
                    f"{triton.__version__}", allow_module_level=True)


# Jobs per child: the interpreter runs a small case in 0.1-3 s, a child starts in about 2 s.
JOBS_PER_CHILD = 16


def run_as_child(jobs) -> None:
    """The child process's work: the jobs named on its command line, their results as one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.path.insert(0, str(REPO_ROOT))
    table = jobs()
    print(json.dumps({name: table[name]() for name in sys.argv[1:]}))


class _LazyReport:
    """``report[key]``: the chunk of keys holding ``key`` run in one interpreter child, once."""

    def __init__(self, test_file: str, keys, env: dict, jobs_per_child: int = JOBS_PER_CHILD):
        ordered = sorted(keys)
        self._chunk_of = {key: ordered[i - i % jobs_per_child: i - i % jobs_per_child + jobs_per_child]
                          for i, key in enumerate(ordered)}
        self._test_file = test_file
        self._env = env
        self._results: dict = {}
        self._failed: dict = {}  # first key of a chunk whose child failed -> its error output

    def __getitem__(self, key):
        chunk = self._chunk_of[key]
        if key not in self._results and chunk[0] not in self._failed:
            # The child runs a test file in an operation's folder: this harness and the repository
            # (the package under test, not an installed copy) go on its path.
            path = [str(HARNESS_DIR), str(REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
            child_env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(path), **self._env)
            done = subprocess.run([sys.executable, self._test_file, *chunk], env=child_env, capture_output=True,
                                  text=True)
            if done.returncode == 0:
                self._results.update(json.loads(done.stdout.strip().splitlines()[-1]))
            else:
                self._failed[chunk[0]] = done.stderr[-4000:]
        assert chunk[0] not in self._failed, f"interpreter run of {chunk} failed:\n{self._failed[chunk[0]]}"
        return self._results[key]


def report_fixture(test_file: str, keys, jobs_per_child: int = JOBS_PER_CHILD, **env):
    """A module-scoped fixture: the lazy report of ``test_file``'s jobs ``keys`` (see :class:`_LazyReport`),
    ``jobs_per_child`` keys to a child."""
    import pytest

    @pytest.fixture(scope="module")
    def interpreter_report():
        return _LazyReport(test_file, keys, env, jobs_per_child)

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


def install_interpreted_jax_triton(multiprocessors: int = 4):
    """Stands Triton's interpreter in for ``jax_triton`` (call it in the child before the launchers
    are imported): ``triton_call`` runs the kernel on host copies of its operands through
    ``jax.pure_callback``, as jax_triton 0.3 launches it (every operand and every output a kernel
    argument, in that order; an output aliasing an operand is that operand's buffer; zeroed outputs
    zeroed, the others poisoned: NaN, or -7 for integers). The launchers see ``multiprocessors``
    multiprocessors, so the persistent loops take several tiles a program. One kernel runs at a time:
    XLA may run independent callbacks on several threads, and the interpreter patches ``triton.language``
    while it runs a kernel."""
    import threading
    import types

    import jax

    one_at_a_time = threading.Lock()

    def triton_call(*arrays, kernel, out_shape, grid, num_warps=None, num_stages=None, input_output_aliases=None,
                    zeroed_outputs=(), **constants):
        del num_warps, num_stages
        many = isinstance(out_shape, (tuple, list))
        shapes = tuple(out_shape) if many else (out_shape,)
        aliased = {out: operand for operand, out in (input_output_aliases or {}).items()}

        def run(*host_arrays):
            operands = [np.array(a, copy=True, order="C") for a in host_arrays]
            outs = []
            for j, shape in enumerate(shapes):
                if j in aliased:
                    outs.append(operands[aliased[j]])
                elif j in zeroed_outputs:
                    outs.append(np.zeros(shape.shape, shape.dtype))
                else:
                    poison = np.nan if np.issubdtype(shape.dtype, np.floating) else -7
                    outs.append(np.full(shape.shape, poison, shape.dtype))
            with one_at_a_time:
                kernel[grid](*map(HostTensor, (*operands, *outs)), **constants)
            return tuple(np.array(out, copy=True) for out in outs)

        result = jax.pure_callback(run, shapes, *arrays)
        return tuple(result) if many else result[0]

    module = types.ModuleType("jax_triton")
    module.triton_call = triton_call
    sys.modules["jax_triton"] = module
    from moe_lowering.kernels.grouped_matmul import triton_launch

    triton_launch._multiprocessor_count = lambda: multiprocessors


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
