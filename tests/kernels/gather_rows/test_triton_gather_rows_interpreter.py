"""The row-gather Triton kernels under Triton's interpreter (a child process, ``interpreter_harness``):
every row written, repeated and unused source rows, a column remainder, with and without a scale;
the sum of each row's sources likewise."""

from __future__ import annotations

import numpy as np

import interpreter_harness as harness
from interpreter_harness import HostTensor

if __name__ != "__main__":
    import pytest

    harness.skip_without_interpreter(pytest)

# (source rows, gathered rows, columns, block of columns)
VARIANTS = {f"s{s}-r{r}-d{d}-{'scale' if scaled else 'plain'}": (s, r, d, scaled)
            for s, r, d in ((5, 37, 24), (40, 16, 48), (3, 1, 8)) for scaled in (False, True)}


def _run(src_rows, rows, d, scaled):
    from moe_lowering.kernels.gather_rows.triton_kernels import gather_rows_kernel

    rng = np.random.default_rng(src_rows * 1000 + rows + d)
    src = rng.standard_normal((src_rows, d)).astype(np.float32)
    index = rng.integers(0, src_rows, rows).astype(np.int32)
    scale = rng.standard_normal(rows).astype(np.float32)
    out = np.full((rows, d), np.nan, np.float32)
    gather_rows_kernel[(-(-rows // 8),)](HostTensor(src), HostTensor(index), HostTensor(scale), HostTensor(out),
                                        R=rows, D=d, BLOCK_R=8, BLOCK_D=16, HAS_SCALE=scaled)
    expected = src[index] * (scale[:, None] if scaled else 1.0)
    return harness.summary(out, expected)


# The sum of each row's sources (``unpermute``): K copies, repeated sources, a column remainder.
SUM_VARIANTS = {f"sum-s{s}-r{r}-k{k}-d{d}": (s, r, k, d) for s, r, k, d in ((40, 19, 2, 24), (9, 8, 3, 48), (5, 3, 1, 8))}


def _run_sum(src_rows, rows, k, d):
    from moe_lowering.kernels.gather_rows.triton_kernels import gather_sum_rows_kernel

    rng = np.random.default_rng(src_rows * 1000 + rows + k + d)
    src = rng.standard_normal((src_rows, d)).astype(np.float32)
    index = rng.integers(0, src_rows, (rows, k)).astype(np.int32)
    out = np.full((rows, d), np.nan, np.float32)
    gather_sum_rows_kernel[(-(-rows // 8),)](HostTensor(src), HostTensor(index), HostTensor(out), R=rows, K=k, D=d,
                                             BLOCK_R=8, BLOCK_D=16)
    return harness.summary(out, src.astype(np.float64)[index].sum(axis=1))


def _jobs():
    jobs = {name: (lambda v=variant: _run(*v)) for name, variant in VARIANTS.items()}
    jobs.update({name: (lambda v=variant: _run_sum(*v)) for name, variant in SUM_VARIANTS.items()})
    return jobs


if __name__ == "__main__":
    harness.run_as_child(_jobs)
else:
    interpreter_report = harness.report_fixture(__file__, list(VARIANTS) + list(SUM_VARIANTS))

    @pytest.mark.parametrize("name", sorted(VARIANTS))
    def test_gather_rows_kernel_matches_reference(interpreter_report, name):
        result = interpreter_report[name]
        assert result["unwritten"] == 0, result
        assert result["max_error"] < 1e-6, result

    @pytest.mark.parametrize("name", sorted(SUM_VARIANTS))
    def test_gather_sum_rows_kernel_matches_reference(interpreter_report, name):
        result = interpreter_report[name]
        assert result["unwritten"] == 0, result
        assert result["max_error"] < 1e-6, result
