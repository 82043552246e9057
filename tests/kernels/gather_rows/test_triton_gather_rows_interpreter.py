"""The row-gather and row-sum Triton kernels under Triton's interpreter (a child process,
``interpreter_harness``): every row written, repeated and unused source rows, a column remainder,
with and without a scale; each token's copies added up, a partial last block of tokens; and the CUDA
lowering of ``unpermute`` end to end with ``jax_triton`` stood in for by the interpreter (the
launcher hands the kernel the sort's ``inverse``, not its ``token_of_row``)."""

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
# (source rows, tokens, copies per token, columns)
SUM_VARIANTS = {f"sum-s{s}-t{t}-k{k}-d{d}": (s, t, k, d) for s, t, k, d in ((60, 21, 3, 40), (8, 8, 1, 16),
                                                                            (30, 5, 6, 7))}
LOWERING_VARIANTS = {f"unpermute-lowering-t{t}-k{k}-e{e}": (t, k, e) for t, k, e in ((19, 2, 4), (8, 3, 2))}


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


def _run_sum(src_rows, tokens, copies, d):
    from moe_lowering.kernels.gather_rows.triton_kernels import sum_rows_kernel

    rng = np.random.default_rng(src_rows * 1000 + tokens * 10 + copies)
    src = rng.standard_normal((src_rows, d)).astype(np.float32)
    index = rng.integers(0, src_rows, (tokens, copies)).astype(np.int32)
    out = np.full((tokens, d), np.nan, np.float32)
    sum_rows_kernel[(-(-tokens // 4),)](HostTensor(src), HostTensor(index), HostTensor(out), T=tokens, K=copies,
                                        D=d, BLOCK_T=4, BLOCK_D=16)
    return harness.summary(out, src.astype(np.float64)[index].sum(axis=1))


def _run_lowering(tokens, copies, experts):
    harness.install_interpreted_jax_triton()
    import jax
    import jax.numpy as jnp

    from moe_lowering import primitives, sparse_moe

    rng = np.random.default_rng(tokens * 10 + copies)
    expert_index = jnp.asarray(rng.integers(0, experts + 1, (tokens, copies)), jnp.int32)  # experts: dropped
    routing = sparse_moe.sort_by_expert(expert_index, experts)
    rows = jnp.asarray(rng.standard_normal((tokens * copies, 12)), jnp.float32)
    got = primitives._unpermute_cuda(rows, routing.token_of_row, routing.inverse, dtype=jnp.float32, batch=())
    want = np.asarray(rows, np.float64)[np.asarray(routing.inverse)].sum(axis=1)
    jax.block_until_ready(got)
    return {"shape_ok": got.shape == want.shape, **harness.summary(np.asarray(got), want)}


def _jobs():
    return {**{name: (lambda v=variant: _run(*v)) for name, variant in VARIANTS.items()},
            **{name: (lambda v=variant: _run_sum(*v)) for name, variant in SUM_VARIANTS.items()},
            **{name: (lambda v=variant: _run_lowering(*v)) for name, variant in LOWERING_VARIANTS.items()}}


if __name__ == "__main__":
    harness.run_as_child(_jobs)
else:
    interpreter_report = harness.report_fixture(__file__, [*VARIANTS, *SUM_VARIANTS, *LOWERING_VARIANTS])

    @pytest.mark.parametrize("name", sorted(VARIANTS))
    def test_gather_rows_kernel_matches_reference(interpreter_report, name):
        result = interpreter_report[name]
        assert result["unwritten"] == 0, result
        assert result["max_error"] < 1e-6, result

    @pytest.mark.parametrize("name", sorted(SUM_VARIANTS))
    def test_sum_rows_kernel_adds_each_tokens_copies(interpreter_report, name):
        result = interpreter_report[name]
        assert result["unwritten"] == 0, result
        assert result["max_error"] < 1e-5, result

    @pytest.mark.parametrize("name", sorted(LOWERING_VARIANTS))
    def test_unpermute_lowering_sums_each_tokens_copies(interpreter_report, name):
        result = interpreter_report[name]
        assert result["shape_ok"], result
        assert result["unwritten"] == 0, result
        assert result["max_error"] < 1e-5, result
