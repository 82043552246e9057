"""Suite-wide setup: eight host CPU devices (the sharded tests need them; the rest use one).

Set before any test initialises a JAX backend, so every test module sees the same devices.
``tests/parallel`` is importable from every test directory, for its shared ``parallel_cases``.
"""

import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent / "parallel"))

try:
    jax.config.update("jax_num_cpu_devices", 8)
except (RuntimeError, AttributeError):  # a backend is already up, or an older JAX
    pass
