"""The row-gather Triton kernel under Triton's interpreter (a child process, ``interpreter_harness``):
every row written, repeated and unused source rows, a column remainder, with and without a scale."""

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


def _jobs():
    return {name: (lambda v=variant: _run(*v)) for name, variant in VARIANTS.items()}


if __name__ == "__main__":
    harness.run_as_child(_jobs)
else:
    interpreter_report = harness.report_fixture(__file__, list(VARIANTS))

    @pytest.mark.parametrize("name", sorted(VARIANTS))
    def test_gather_rows_kernel_matches_reference(interpreter_report, name):
        result = interpreter_report[name]
        assert result["unwritten"] == 0, result
        assert result["max_error"] < 1e-6, result
