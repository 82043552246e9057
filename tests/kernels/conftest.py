"""``tests/kernels`` mirrors ``moe_lowering/kernels``: one folder per operation. The interpreter
tests in those folders share ``interpreter_harness`` (here), importable from each of them."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    """Interpreter cases are marked ``triton_interpreter``: one CI entry runs them, on the GPU machines'
    JAX version (most run no JAX; the launcher and backend cases launch through it)."""
    for item in items:
        if Path(str(item.path)).name.endswith("_interpreter.py"):
            item.add_marker(pytest.mark.triton_interpreter)
