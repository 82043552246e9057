"""Suite-wide setup: eight host CPU devices (the sharded tests need them; the rest use one), and
float32 products at full precision, so that a test comparing the rewrite with the dense layer at
float32 tolerances also holds on a GPU, where XLA's default for float32 dots is TF32.

The suite compiles well over a thousand small programs, and on a CPU compiling them is most of its
time. So, without a GPU plugin, XLA's CPU code is compiled without LLVM's optimisation passes
(``--xla_backend_optimization_level=0``, unless ``XLA_FLAGS`` sets a level), and a run shares one
persistent compilation cache between its pytest-xdist workers and the interpreter tests' children
(a temporary folder, removed when the run ends), so a program compiled by one test is loaded by the
next. On a 2-core machine the two together took the first CI entry's tests from 1050 to 661 s.

Set before any test initialises a JAX backend, so every test module sees the same devices.
``tests/parallel`` is importable from every test directory, for its shared ``parallel_cases``.
"""

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "parallel"))

try:
    jax.config.update("jax_num_cpu_devices", 8)
except (RuntimeError, AttributeError):  # a backend is already up, or an older JAX
    pass


def _has_gpu_plugin() -> bool:
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{version}") for version in (12, 13))
    except ModuleNotFoundError:  # no jax_plugins namespace: no plugin installed
        return False


if not _has_gpu_plugin() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()


def pytest_configure(config):
    """The run's compilation cache: made by the controlling process, whose environment the xdist
    workers and the interpreter tests' children inherit, unless ``JAX_COMPILATION_CACHE_DIR`` names one."""
    if not hasattr(config, "workerinput") and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        config.moe_owned_compilation_cache = tempfile.mkdtemp(prefix="moe_lowering_tests_xla_cache_")
        os.environ.update(JAX_COMPILATION_CACHE_DIR=config.moe_owned_compilation_cache,
                          JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # jax read its environment at import, before this ran
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 1.0)))
        jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                          int(os.environ.get("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", 0)))


def pytest_unconfigure(config):
    owned = getattr(config, "moe_owned_compilation_cache", None)
    if owned:
        shutil.rmtree(owned, ignore_errors=True)


# The quick selection (README: ``pytest -m "not slow"``) keeps the pass's own semantics (matching,
# rewriting, soundness, composability, the kernels' references, the API) and leaves out what takes
# most of the suite's time: the Triton interpreter's kernels, the mutation suite, the transcribed
# frameworks, the example scripts, mypy, the multi-device layers, the moe-rewrite tool (tests/hlo),
# the golden IR files, the zoo's own reference checks and the property tests. CI runs everything;
# ``slow`` only names the complement of the quick subset.
SLOW_MARKERS = frozenset({"triton_interpreter", "mutation", "transcribed", "tutorial", "multidevice", "typecheck"})
SLOW_PATHS = ("parallel/", "realworld/", "hlo/", "golden/", "testing/test_zoo.py", "passes/test_properties.py")
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Runs before ``-m`` deselects (pytest's own hook comes last); the interpreter files are named
    here too, as tests/kernels/conftest.py may mark them after this."""
    for item in items:
        where = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
        if (where.startswith(SLOW_PATHS) or where.endswith("_interpreter.py")
                or any(next(item.iter_markers(name), None) for name in SLOW_MARKERS)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def float32_products():
    with jax.default_matmul_precision("highest"):
        yield
