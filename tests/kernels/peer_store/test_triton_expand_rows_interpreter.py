"""The Triton ``expand_rows`` kernel (a receiver's tokens into its sorted rows) run by Triton's
interpreter on the CPU, in a child process (``interpreter_harness``): the counted rows gathered,
the rest zero or left as they were (NaN stays NaN).
"""

from __future__ import annotations

import numpy as np

import interpreter_harness as harness
from interpreter_harness import HostTensor

if __name__ != "__main__":
    import pytest

    harness.skip_without_interpreter(pytest)

# (table rows, output rows, features, rows counted, zero the tail)
CASES = {"partial-zeroed": (11, 29, 40, 13, True), "partial-untouched": (11, 29, 40, 13, False),
         "none": (5, 16, 24, 0, True), "all": (7, 24, 16, 24, False), "past-the-buffer": (7, 10, 24, 99, True)}
LAUNCH = dict(BLOCK_ROWS=4, BLOCK_D=16, NUM_PROGRAMS=3)


def _run(kernel, table_rows, out_rows, features, counted, zero_tail):
    rng = np.random.default_rng(table_rows * 100 + out_rows)
    table = rng.standard_normal((table_rows, features)).astype(np.float32)
    index = rng.integers(0, table_rows, out_rows).astype(np.int32)
    out = np.full((out_rows, features), np.nan, np.float32)
    kernel[(LAUNCH["NUM_PROGRAMS"],)](*map(HostTensor, (table, index, np.array([counted], np.int32), out)),
                                      NUM_ROWS=out_rows, TABLE_ROWS=table_rows, D=features, ZERO_TAIL=zero_tail,
                                      **LAUNCH)
    counted = min(counted, out_rows)
    tail = out[counted:]
    return {"max_error": float(np.max(np.abs(out[:counted] - table[index[:counted]]), initial=0.0)),
            "tail_zero": bool(np.all(tail == 0)),
            "tail_written_past_block": int(np.sum(~np.isnan(tail[LAUNCH["BLOCK_ROWS"]:])))}


def _jobs():
    """Every case as a job for the interpreter child (see ``interpreter_harness``)."""
    from moe_lowering.kernels.peer_store.triton_kernels import expand_rows_kernel

    return {name: (lambda v=case: _run(expand_rows_kernel, *v)) for name, case in CASES.items()}


if __name__ == "__main__":
    harness.run_as_child(_jobs)
else:
    interpreter_report = harness.report_fixture(__file__, CASES)

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_expand_rows_kernel(interpreter_report, name):
        result, zero_tail = interpreter_report[name], CASES[name][4]
        assert result["max_error"] == 0.0, result
        if zero_tail:
            assert result["tail_zero"], result
        else:  # rows past the counted ones are left as they were, past the last counted row block
            assert result["tail_written_past_block"] == 0, result
