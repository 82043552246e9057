"""Eight host CPU devices for the sharded-lowering tests.

``jax_num_cpu_devices`` only takes effect before JAX initialises a backend, so it is set when
pytest loads this file (collection, before any test runs). If something initialised JAX earlier
with fewer devices, the tests fail with a message saying so instead of silently skipping; the
root ``tests/conftest.py`` should then set the same option.
"""

from __future__ import annotations

import jax
import pytest

NUM_DEVICES = 8

try:
    jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
except RuntimeError:  # a backend is already up: whatever it has must do
    pass


@pytest.fixture(autouse=True)
def _eight_devices():
    found = len(jax.devices("cpu"))
    if found < NUM_DEVICES:
        pytest.fail(
            f"tests/parallel needs {NUM_DEVICES} CPU devices but JAX has {found}: JAX was initialised "
            f"before tests/parallel/conftest.py ran; set jax.config.update('jax_num_cpu_devices', {NUM_DEVICES}) "
            "(or XLA_FLAGS=--xla_force_host_platform_device_count=8) in tests/conftest.py"
        )
