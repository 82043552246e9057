"""The Triton grouped SwiGLU kernels run by Triton's interpreter on the CPU, at tiny tile sizes.

Checks the fused kernel's scheduling, both accumulators, the epilogue and the zero rows outside
the local groups against a float64 reference, with and without the stored pre-activations, and with
the rows gathered from fewer token rows as loaded (``gather_swiglu_gmm_kernel``, with and without
the pre-activations). The kernels run in
a child process (``interpreter_harness``).
"""

from __future__ import annotations

import numpy as np

import interpreter_harness as harness
from interpreter_harness import CASES, HostTensor, gmm_reference, summary

if __name__ != "__main__":
    import pytest

    harness.skip_without_interpreter(pytest)

VARIANTS = {f"{case}-k{k}-n{n}-{kind}": (case, k, n, kind == "with-preactivations")
            for case in CASES for k, n in ((24, 40), (32, 32)) for kind in ("fused", "with-preactivations")}
BLOCK = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)
NUM_PROGRAMS = 3


def _silu(x):
    return x / (1.0 + np.exp(-x))


GATHER_VARIANTS = {f"gather-{case}-{kind}": (case, 24, 40, kind == "with-preactivations", True)
                   for case in ("empty-group", "trailing-rows-outside", "group-offset-window", "all-empty")
                   for kind in ("fused", "with-preactivations")}


def _run(kernels, case, k, n, with_preactivations, gathered=False):
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    rng = np.random.default_rng(len(group_sizes) * 100 + num_rows + k + n)
    group_sizes = np.asarray(group_sizes, np.int32)
    gate, up = (rng.standard_normal((num_local, k, n)).astype(np.float32) for _ in range(2))
    outs = [np.full((num_rows, n), np.nan, np.float32) for _ in range(3 if with_preactivations else 1)]
    common = dict(M=num_rows, K=k, N=n, NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes), GROUPS_PAD=8,
                  NUM_PROGRAMS=NUM_PROGRAMS, COMPUTE_F32=True, **BLOCK)
    offset = np.array([group_offset], np.int32)
    if gathered:  # rows gathered from half as many token rows; some indices out of range (clamped)
        tokens = rng.standard_normal((num_rows // 2 + 1, k)).astype(np.float32)
        index = rng.integers(0, tokens.shape[0], num_rows).astype(np.int32)
        index[::5] = tokens.shape[0] + 2
        lhs = tokens[np.minimum(index, tokens.shape[0] - 1)]
        kernel = (kernels.gather_swiglu_gmm_preactivations_kernel if with_preactivations
                  else kernels.gather_swiglu_gmm_kernel)
        kernel[(NUM_PROGRAMS,)](
            *map(HostTensor, (tokens, gate, up, index, group_sizes, offset, *outs)), LHS_SOURCE_ROWS=tokens.shape[0],
            **common,
        )
    else:
        lhs = rng.standard_normal((num_rows, k)).astype(np.float32)
        kernel = kernels.swiglu_gmm_preactivations_kernel if with_preactivations else kernels.swiglu_gmm_kernel
        kernel[(NUM_PROGRAMS,)](*map(HostTensor, (lhs, gate, up, group_sizes, offset, *outs)), **common)
    gate_ref = gmm_reference(lhs, gate, group_sizes, group_offset, False)
    up_ref = gmm_reference(lhs, up, group_sizes, group_offset, False)
    expected = [_silu(gate_ref) * up_ref, gate_ref, up_ref]
    return {name: summary(out, want) for name, out, want in zip(("out", "gate", "up"), outs, expected)}


def _jobs():
    """Every variant as a job for the interpreter child (see ``interpreter_harness``)."""
    from moe_lowering.kernels.swiglu_gmm import triton_kernels

    return {name: (lambda v=variant: _run(triton_kernels, *v))
            for name, variant in {**VARIANTS, **GATHER_VARIANTS}.items()}


if __name__ == "__main__":
    harness.run_as_child(_jobs)
else:
    interpreter_report = harness.report_fixture(__file__, [*VARIANTS, *GATHER_VARIANTS])

    @pytest.mark.parametrize("name", sorted({**VARIANTS, **GATHER_VARIANTS}))
    def test_swiglu_kernel_matches_reference(interpreter_report, name):
        for output, result in interpreter_report[name].items():
            assert result["unwritten"] == 0, f"{output}: {result['unwritten']} elements were never written"
            assert result["max_error"] < 1e-5, (output, result)
