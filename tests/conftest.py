"""Suite-wide setup: eight host CPU devices (the sharded tests need them; the rest use one), and
float32 products at full precision, so that a test comparing the rewrite with the dense layer at
float32 tolerances also holds on a GPU, where XLA's default for float32 dots is TF32.

Set before any test initialises a JAX backend, so every test module sees the same devices.
``tests/parallel`` is importable from every test directory, for its shared ``parallel_cases``.
"""

import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "parallel"))

try:
    jax.config.update("jax_num_cpu_devices", 8)
except (RuntimeError, AttributeError):  # a backend is already up, or an older JAX
    pass


@pytest.fixture(autouse=True)
def float32_products():
    with jax.default_matmul_precision("highest"):
        yield
