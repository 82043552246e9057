"""Eight host CPU devices for the sharded-lowering tests, however pytest was started.

``jax_num_cpu_devices`` only takes effect before JAX initialises a backend, so it is set when
pytest loads this file. When a test module collected earlier already initialised JAX with fewer
devices (the whole-suite run), the selected tests of this directory run once more in one
subprocess that has eight devices, and each test here reports that run's outcome for itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import pytest

NUM_DEVICES = 8
_RESULTS_ENV = "MOE_PARALLEL_TEST_RESULTS"  # set in the subprocess: where it writes its outcomes
_HERE = Path(__file__).parent

try:
    jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
except RuntimeError:  # a backend is already up; the subprocess below takes over
    pass


def _enough_devices() -> bool:
    return len(jax.devices("cpu")) >= NUM_DEVICES


def _is_ours(item) -> bool:
    return _HERE in Path(str(item.fspath)).parents


def pytest_collection_modifyitems(session, config, items):
    config._parallel_nodeids = [item.nodeid for item in items if _is_ours(item)]


def _run_in_subprocess(config) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        results_path = Path(tmp) / "results.json"
        env = dict(os.environ)
        env[_RESULTS_ENV] = str(results_path)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={NUM_DEVICES}"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *config._parallel_nodeids]
        done = subprocess.run(command, cwd=config.rootpath, env=env, capture_output=True, text=True)
        if not results_path.exists():
            return {"__error__": done.stdout[-4000:] + done.stderr[-4000:]}
        return json.loads(results_path.read_text())


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if _enough_devices() or not _is_ours(pyfuncitem):
        return None
    config = pyfuncitem.config
    if not hasattr(config, "_parallel_results"):
        config._parallel_results = _run_in_subprocess(config)
    results = config._parallel_results
    if "__error__" in results:
        pytest.fail(f"the 8-device subprocess run of tests/parallel failed to report:\n{results['__error__']}")
    outcome, text = results.get(pyfuncitem.nodeid, ("missing", "not run by the 8-device subprocess"))
    if outcome == "passed":
        return True
    if outcome == "skipped":
        pytest.skip(text)
    pytest.fail(f"failed in the 8-device subprocess:\n{text}", pytrace=False)


_outcomes: dict = {}


def pytest_runtest_logreport(report):
    if os.environ.get(_RESULTS_ENV) is None:
        return
    if report.when == "call" or report.outcome != "passed":
        previous = _outcomes.get(report.nodeid)
        if previous is None or previous[0] == "passed":
            _outcomes[report.nodeid] = (report.outcome, str(report.longrepr or ""))


def pytest_sessionfinish(session):
    path = os.environ.get(_RESULTS_ENV)
    if path is not None:
        Path(path).write_text(json.dumps(_outcomes))
