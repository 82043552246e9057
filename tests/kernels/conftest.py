"""``tests/kernels`` mirrors ``moe_lowering/kernels``: one folder per operation. The interpreter
tests in those folders share ``interpreter_harness`` (here), importable from each of them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
