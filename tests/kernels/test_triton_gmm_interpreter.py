"""The Triton grouped-GEMM kernels run by Triton's interpreter on the CPU, at tiny tile sizes.

This checks the kernels' on-device scheduling (per-group row tiles, persistent loop, zero rows
outside the local groups, clamped loads, K remainders) without a GPU or jax_triton, in a child
process (``interpreter_harness``).
"""

from __future__ import annotations

import numpy as np

import interpreter_harness as harness
from interpreter_harness import CASES, HostTensor, gmm_reference

if __name__ != "__main__":
    import pytest

    harness.skip_without_interpreter(pytest)

BLOCK = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)
NUM_PROGRAMS = 3


def _tgmm_reference(lhs, grad, group_sizes, group_offset, num_groups):
    out = np.zeros((num_groups, lhs.shape[1], grad.shape[1]))
    group_of_row = harness.row_groups(group_sizes, lhs.shape[0])
    for local in range(num_groups):
        rows = group_of_row == local + group_offset
        out[local] = lhs[rows].astype(np.float64).T @ grad[rows].astype(np.float64)
    return out


GMM_VARIANTS = {f"{case}-k{k}-{'rhsT' if t else 'rhs'}": (case, k, t)
                for case in CASES for k in (24, 32) for t in (False, True)}


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
    return out, gmm_reference(lhs, rhs, group_sizes, group_offset, transpose_rhs)


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


TAIL_VARIANTS = {f"{case}-k{k}-{'rhsT' if t else 'rhs'}-p{programs}": (case, k, t, programs)
                 for case in CASES for k in (24, 136) for t in (False, True) for programs in (3, 4, 6, 8)}


def tail_pieces(case, k, programs):
    """How ``_tail_split`` cuts this case's tail tiles along K (1: left whole), from the sizes."""
    group_sizes, _, group_offset, num_local = CASES[case]
    local = group_sizes[group_offset:group_offset + num_local]
    tiles = sum(-(-size // BLOCK["BLOCK_M"]) for size in local) * -(-40 // BLOCK["BLOCK_N"])
    tail, k_steps = tiles % programs, -(-k // BLOCK["BLOCK_K"])
    return next((p for p in (8, 4, 2) if tail and p * tail <= programs and k_steps >= p), 1)


def _run_gmm_with_tail(kernels, case, k, transpose_rhs, programs):
    """``gmm_kernel`` leaving its tail apart, then ``gmm_tail_kernel`` into the same output."""
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    rng = np.random.default_rng(len(group_sizes) * 1000 + num_rows + k)
    n = 40
    group_sizes = np.asarray(group_sizes, np.int32)
    lhs = rng.standard_normal((num_rows, k)).astype(np.float32)
    rhs = rng.standard_normal((num_local, n, k) if transpose_rhs else (num_local, k, n)).astype(np.float32)
    out = np.full((num_rows, n), np.nan, np.float32)
    operands = [HostTensor(lhs), HostTensor(rhs), HostTensor(group_sizes), HostTensor(np.array([group_offset], np.int32))]
    common = dict(M=num_rows, K=k, N=n, NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes), GROUPS_PAD=8,
                  TRANSPOSE_RHS=transpose_rhs, NUM_PROGRAMS=programs, COMPUTE_F32=True, **BLOCK)
    kernels.gmm_kernel[(programs,)](*operands, HostTensor(out), TAIL_APART=True, **common)
    partials = np.full(programs * BLOCK["BLOCK_M"] * BLOCK["BLOCK_N"], np.nan, np.float32)
    counters = np.zeros(programs, np.int32)
    kernels.gmm_tail_kernel[(programs,)](*operands, HostTensor(out), HostTensor(out), HostTensor(partials),
                                         HostTensor(counters), **common)
    return out, gmm_reference(lhs, rhs, group_sizes, group_offset, transpose_rhs)


def _interpret_all():
    """Runs every case under the interpreter; called in the child process."""
    from moe_lowering.kernels import triton_gmm_kernels as kernels

    report = {f"gmm-{name}": harness.summary(*_run_gmm(kernels, *variant)) for name, variant in GMM_VARIANTS.items()}
    report.update({f"tgmm-{case}": harness.summary(*_run_tgmm(kernels, case)) for case in CASES})
    report.update({f"tail-{name}": harness.summary(*_run_gmm_with_tail(kernels, *variant))
                   for name, variant in TAIL_VARIANTS.items()})
    return report


if __name__ == "__main__":
    harness.run_as_child(_interpret_all)
else:
    interpreter_report = harness.report_fixture(__file__)

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

    @pytest.mark.parametrize("name", sorted(TAIL_VARIANTS))
    def test_gmm_with_its_tail_apart_matches_reference(interpreter_report, name):
        """The main kernel's full waves plus the tail kernel's K pieces write every output once."""
        result = interpreter_report[f"tail-{name}"]
        assert result["unwritten"] == 0, f"{result['unwritten']} output elements were never written"
        assert result["max_error"] < 1e-5, result

    def test_tail_cases_reach_every_cut():
        pieces = {tail_pieces(case, k, programs) for case, k, _, programs in TAIL_VARIANTS.values()}
        assert pieces == {1, 2, 4, 8}, pieces
