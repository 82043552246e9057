"""The training step's gathered launchers run end to end on the CPU: ``gather_lhs_tgmm`` and
``gather_swiglu_gmm(with_preactivations=True)`` through ``triton_launch`` with ``jax_triton`` stood in
for by Triton's interpreter.

The kernels' own tests call them with hand-written arguments; this checks what only a GPU run would
otherwise check: that a launcher hands its kernel the operands, outputs and constants in the order and
under the names the kernel takes, picks the schedule (resident or row loop) and writes the output shape
the reference has (``interpreter_harness.install_interpreted_jax_triton``: every output poisoned
first, 4 multiprocessors, so the persistent loops take several tiles per program). Float32 operands
(numpy has no bfloat16): the launchers' float32 tiles.
"""

from __future__ import annotations

import numpy as np

import interpreter_harness as harness
from interpreter_harness import CASES

if __name__ != "__main__":
    import pytest

    harness.skip_without_interpreter(pytest)

# The harness's cases, and groups large enough for the row-loop weight-gradient kernel (not resident).
LAUNCH_CASES = {**CASES, "large-groups": ([300, 0, 420], 760, 0, 3)}


def _launchers():
    harness.install_interpreted_jax_triton()
    from moe_lowering.kernels.grouped_matmul import triton_launch as grouped
    from moe_lowering.kernels.swiglu_gmm import triton_launch as swiglu

    return grouped, swiglu


def _operands(case, width):
    group_sizes, num_rows, group_offset, num_local = LAUNCH_CASES[case]
    rng = np.random.default_rng(num_rows * 7 + width)
    tokens = rng.standard_normal((num_rows // 2 + 1, width)).astype(np.float32)
    index = rng.integers(0, tokens.shape[0], num_rows).astype(np.int32)
    rows = tokens[index].astype(np.float64)
    return rng, np.asarray(group_sizes, np.int32), num_rows, group_offset, num_local, tokens, index, rows


def _run_gather_lhs_tgmm(case):
    import jax.numpy as jnp

    grouped, _ = _launchers()
    d, n = 24, 40
    rng, sizes, num_rows, offset, num_local, tokens, index, rows = _operands(case, d)
    grad = rng.standard_normal((num_rows, n)).astype(np.float32)
    got = np.asarray(grouped.gather_lhs_tgmm(jnp.asarray(tokens), jnp.asarray(grad), jnp.asarray(index),
                                             jnp.asarray(sizes), num_groups=num_local, group_offset=offset))
    group_of_row = harness.row_groups(sizes, num_rows) - offset
    expected = np.zeros((num_local, d, n))
    for local in range(num_local):
        chosen = group_of_row == local
        expected[local] = rows[chosen].T @ grad[chosen].astype(np.float64)
    return {"shape_ok": got.shape == expected.shape, **harness.summary(got, expected)}


def _run_gather_swiglu_preactivations(case):
    import jax.numpy as jnp

    _, swiglu = _launchers()
    d, n = 24, 40
    rng, sizes, num_rows, offset, num_local, tokens, index, rows = _operands(case, d)
    gate, up = (rng.standard_normal((num_local, d, n)).astype(np.float32) for _ in range(2))
    outs = swiglu.gather_swiglu_gmm(jnp.asarray(tokens), jnp.asarray(gate), jnp.asarray(up), jnp.asarray(index),
                                    jnp.asarray(sizes), group_offset=offset, with_preactivations=True)
    gate_ref = harness.gmm_reference(rows, gate, sizes, offset, False)
    up_ref = harness.gmm_reference(rows, up, sizes, offset, False)
    expected = (gate_ref / (1.0 + np.exp(-gate_ref)) * up_ref, gate_ref, up_ref)
    return {name: harness.summary(np.asarray(out), want)
            for name, out, want in zip(("out", "gate", "up"), outs, expected)}


JOBS = {**{f"gather-lhs-tgmm-{case}": (_run_gather_lhs_tgmm, case) for case in LAUNCH_CASES},
        **{f"gather-swiglu-preactivations-{case}": (_run_gather_swiglu_preactivations, case) for case in CASES}}


def _jobs():
    return {name: (lambda fn=fn, case=case: fn(case)) for name, (fn, case) in JOBS.items()}


if __name__ == "__main__":
    harness.run_as_child(_jobs)
else:
    interpreter_report = harness.report_fixture(__file__, list(JOBS), JAX_PLATFORMS="cpu")

    @pytest.mark.parametrize("case", sorted(LAUNCH_CASES))
    def test_gather_lhs_tgmm_launch_matches_reference(interpreter_report, case):
        result = interpreter_report[f"gather-lhs-tgmm-{case}"]
        assert result["shape_ok"], result
        assert result["unwritten"] == 0, f"{result['unwritten']} output elements were never written"
        assert result["max_error"] < 1e-5, result

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_gather_swiglu_gmm_launch_with_preactivations_matches_reference(interpreter_report, case):
        for output, result in interpreter_report[f"gather-swiglu-preactivations-{case}"].items():
            assert result["unwritten"] == 0, f"{output}: {result['unwritten']} elements were never written"
            assert result["max_error"] < 1e-5, (output, result)
