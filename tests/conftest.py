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


# The quick selection (README: ``pytest -m "not slow"``, a few minutes on 2 cores) keeps the pass's
# own semantics (matching, rewriting, soundness, composability, training steps, the kernels'
# references, the API) and leaves out what takes most of the suite's time: the Triton interpreter's
# kernels, the mutation suite, the transcribed frameworks, the example scripts, mypy, the multi-device
# layers, the moe-rewrite tool (tests/hlo), the golden IR files, the zoo's own reference checks, the
# property tests and the end-to-end training loops. A test run once per zoo model runs in it for
# QUICK_MODELS only (a top-k gate, a capacity dispatch, grouped routing), and SLOW_TESTS are tests that
# repeat a quick one at a higher cost (second order, bf16, float64, batching of each primitive,
# numerical derivatives, a second layout of a case the quick tests cover). CI runs everything;
# ``slow`` only names the complement of the quick subset.
SLOW_MARKERS = frozenset({"triton_interpreter", "mutation", "transcribed", "tutorial", "multidevice", "typecheck"})
SLOW_PATHS = ("parallel/", "realworld/", "hlo/", "golden/", "testing/test_zoo.py", "passes/test_properties.py",
              "test_training.py", "passes/test_train_step_scan.py", "passes/test_train_step_remat.py",
              "passes/test_scatter_gate_training.py")
SLOW_TESTS = frozenset({
    "test_composability.py::test_second_order_forward_over_forward",
    "test_composability.py::test_jacfwd_and_hessian_match_the_dense_layer",
    "test_composability.py::test_per_example_gradients_with_nested_vmaps_and_batched_weights",
    "test_composability.py::test_float64_stays_float64",
    "test_sparse_moe.py::test_up_projection_read_from_the_tokens_matches_the_permuted_rows",
    "test_sparse_moe.py::test_last_product_and_combine_match_them_apart",
    "test_sparse_moe.py::test_grouped_products_under_vmap_jvp_and_grad",
    "kernels/grouped_matmul/test_gmm_sum.py::test_primitive_derivatives_match_numerical_ones",
    "passes/test_zoo_rewrite.py::test_outputs_and_gradients_match_bfloat16",
    "passes/test_train_step.py::test_bfloat16_step_as_close_to_float32_as_the_dense_step",
    "passes/test_train_step.py::test_two_layers_sharing_weights_sum_their_cotangents",
    "passes/test_train_step.py::test_the_same_layer_twice_on_the_same_tokens_shares_out_its_sums",
    "passes/test_train_step.py::test_optax_training_loop_follows_the_dense_trajectory",
    "passes/test_derivative_support.py::test_gshard_top2_outer_product_combine_is_rewritten_on_its_sparse_path",
    "passes/test_derivative_support.py::test_gshard_top2_combines_whose_derivative_leaks_decline_or_fall_back",
    "passes/test_idioms.py::test_expert_axis_from_the_data_flow_when_sizes_coincide",
    "passes/test_idioms.py::test_grouped_capacity_is_rewritten_on_its_sparse_path",
})
QUICK_MODELS = frozenset({"mixtral", "switch", "deepseek_v3"})
TESTS = Path(__file__).resolve().parent


def _zoo_model_of(item) -> str | None:
    """The zoo model a parametrized test runs on (the first parameter naming one), if any."""
    from moe_lowering.testing.zoo import ZOO

    params = getattr(getattr(item, "callspec", None), "params", {})
    return next((value for value in params.values() if isinstance(value, str) and value in ZOO), None)


def pytest_collection_modifyitems(config, items):
    """Runs before ``-m`` deselects (pytest's own hook comes last); the interpreter files are named
    here too, as tests/kernels/conftest.py may mark them after this."""
    for item in items:
        where = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
        model = _zoo_model_of(item)
        if (where.startswith(SLOW_PATHS) or where.endswith("_interpreter.py")
                or f"{where}::{item.originalname}" in SLOW_TESTS
                or (model is not None and model not in QUICK_MODELS)
                or any(next(item.iter_markers(name), None) for name in SLOW_MARKERS)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def float32_products():
    with jax.default_matmul_precision("highest"):
        yield
