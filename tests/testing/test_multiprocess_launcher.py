"""The multi-process launcher fails cleanly: a process that dies or hangs is named, and nothing is left running."""

from __future__ import annotations

import os
import sys
import time

import pytest

from moe_lowering.testing.multiprocess import MultiprocessFailure, launch

# Stand-in workers (no JAX): each reads its identity as a worker would.
_EXIT_BY_ID = "import os, sys; sys.exit(int(os.environ['MOE_MP_PROCESS_ID']) * 3)"
_SLEEPER_PID_FILE = ("import os, sys, time; "
                     "open(sys.argv[1] + os.environ['MOE_MP_PROCESS_ID'], 'w').write(str(os.getpid()))")


def test_every_process_gets_its_identity_and_the_coordinator():
    script = ("import os; print(os.environ['MOE_MP_PROCESS_ID'], os.environ['MOE_MP_NUM_PROCESSES'], "
              "os.environ['MOE_MP_COORDINATOR'], os.environ['MOE_MP_DEVICES_PER_PROCESS'])")
    outcomes = launch([sys.executable, "-c", script], num_processes=3, devices_per_process=2, timeout_s=60)
    lines = [o.stdout.split() for o in outcomes]
    assert [line[0] for line in lines] == ["0", "1", "2"] and {line[1] for line in lines} == {"3"}
    assert len({line[2] for line in lines}) == 1 and lines[0][2].startswith("127.0.0.1:")
    assert {line[3] for line in lines} == {"2"}


def test_a_failed_process_is_named_with_its_output():
    with pytest.raises(MultiprocessFailure, match=r"process 1 exited with status 3") as failure:
        launch([sys.executable, "-c", _EXIT_BY_ID + "; print('from', os.environ['MOE_MP_PROCESS_ID'])"],
               num_processes=2, timeout_s=60)
    assert "process 0" not in str(failure.value)


def test_a_process_left_waiting_on_a_dead_one_is_killed(tmp_path):
    """Process 0 fails; process 1 would wait forever (as in a collective): the job ends after the
    grace period, both named, and process 1 no longer runs."""
    script = (_SLEEPER_PID_FILE + "\nif os.environ['MOE_MP_PROCESS_ID'] == '0': sys.exit(2)\ntime.sleep(600)")
    started = time.monotonic()
    with pytest.raises(MultiprocessFailure) as failure:
        launch([sys.executable, "-c", script, str(tmp_path / "pid")], num_processes=2, timeout_s=300)
    assert time.monotonic() - started < 60
    message = str(failure.value)
    assert "process 0 exited with status 2" in message and "process 1 was still running" in message
    _assert_gone(int((tmp_path / "pid1").read_text()))


def test_a_hung_job_times_out(tmp_path):
    script = _SLEEPER_PID_FILE + "\ntime.sleep(600)"
    with pytest.raises(MultiprocessFailure, match=r"process 0 was still running after 5 s") as failure:
        launch([sys.executable, "-c", script, str(tmp_path / "pid")], num_processes=2, timeout_s=5)
    assert "process 1 was still running" in str(failure.value)
    for process in range(2):
        _assert_gone(int((tmp_path / f"pid{process}").read_text()))


def _assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
