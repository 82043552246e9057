"""The kernels' references are checked at float32 tolerances, so their products must be float32:
on a GPU, XLA's default precision for float32 dots is TF32 (errors near 1e-3), which would fail
these tests for a reason that is not the code's."""

import jax
import pytest


@pytest.fixture(autouse=True)
def float32_products():
    with jax.default_matmul_precision("highest"):
        yield
