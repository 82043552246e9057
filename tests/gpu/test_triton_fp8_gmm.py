"""The Triton FP8-weight grouped GEMM on a CUDA GPU against the jnp reference (``fp8_grouped_matmul``).

Skipped without a GPU or jax_triton. A Mixtral-like product in bf16 (the shape the tile table is
for); awkward sizes with a float32 output, where the kernel must match dequantise-then-multiply
up to accumulation order (so each weight's rounding to bf16 is checked too), for the tile the
table picks and for tiles of both operand orders (``weight_as_lhs``: the transposed tile with the
weight as the dot's register operand, the default; and the weight as its second operand); float16
activations; and the inputs the kernel leaves to the bf16 ``gmm``. Outputs are
poisoned: a freed NaN buffer of the output's size is what the kernel's output gets, so unwritten
elements show.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from moe_lowering.kernels import BackendUnavailable, get_backend

try:
    get_backend("triton")
except BackendUnavailable as err:
    pytest.skip(f"Triton backend unavailable: {err}", allow_module_level=True)

from moe_lowering.kernels.fp8_grouped_matmul import triton_launch as tf8  # noqa: E402
from moe_lowering.kernels.fp8_grouped_matmul import fp8_gmm as fp8_gmm_reference  # noqa: E402
from moe_lowering.kernels.fp8_grouped_matmul.quant_format import quantize_blocks  # noqa: E402

pytestmark = pytest.mark.gpu

QUANTS = ["fp8_e4m3", "mxfp8"]
# name: (group sizes, rows, group_offset, local groups)
CASES = {
    "empty-groups": ([130, 0, 257, 3, 0, 411, 199], 1000, 0, 7),
    "one-group-takes-all": ([0, 0, 777, 0], 777, 0, 4),
    "rows-outside-groups": ([100, 250, 0, 311], 901, 0, 4),
    "group-offset-window": ([120, 333, 64, 0, 290, 150], 957, 1, 4),
    "all-empty": ([0, 0, 0], 129, 0, 3),
}
_TABLE = {tf8.fp8_gmm_config(*shape, quant): None for quant in QUANTS
          for shape in ((16384, 4096, 14336, 8), (131072, 2048, 768, 128), (32768, 7168, 2048, 256))}
_EXTRA = [tf8.Fp8TileConfig(128, 256, 64, num_stages=3, weight_as_lhs=True),
          tf8.Fp8TileConfig(64, 128, 128, num_stages=4, weight_as_lhs=True),
          tf8.Fp8TileConfig(128, 128, 64, num_stages=3, weight_as_lhs=False),
          tf8.Fp8TileConfig(64, 128, 64, num_stages=4, weight_as_lhs=False)]


def _config_id(config):
    order = "wlhs" if config.weight_as_lhs else "wrhs"
    return f"{order}-{config.block_m}x{config.block_n}x{config.block_k}s{config.num_stages}"


CONFIGS = [pytest.param(config, id=_config_id(config)) for config in {**_TABLE, **dict.fromkeys(_EXTRA)}]
ORDERS = [pytest.param(True, id="wlhs"), pytest.param(False, id="wrhs")]


def _poison(shape, dtype):
    jnp.full(shape, jnp.nan, dtype).block_until_ready()


def _relative_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert not np.isnan(actual).any(), f"{np.isnan(actual).sum()} output elements were never written (or NaN)"
    return np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)


def _reference(*args, **kwargs):
    """``fp8_gmm_reference`` with float32 products in full float32 (XLA takes TF32 on a GPU by default)."""
    with jax.default_matmul_precision("highest"):
        return fp8_gmm_reference(*args, **kwargs)


def _operands(key, num_rows, k, n, num_local, quant, dtype=jnp.bfloat16):
    """Activations in ``dtype`` and quantised weights spread over 2**-6 .. 2**6 by row and column."""
    keys = jax.random.split(key, 4)
    lhs = jax.random.normal(keys[0], (num_rows, k), jnp.float32).astype(dtype)
    weights = jax.random.normal(keys[1], (num_local, k, n), jnp.float32)
    weights *= jnp.exp2(jax.random.randint(keys[2], (num_local, k, 1), -3, 4).astype(jnp.float32))
    weights *= jnp.exp2(jax.random.randint(keys[3], (num_local, 1, n), -3, 4).astype(jnp.float32))
    return lhs, *quantize_blocks(weights, quant)


def test_table_default_is_the_transposed_kernel():
    assert all(config.weight_as_lhs for config in _TABLE)


@pytest.mark.parametrize("weight_as_lhs", ORDERS)
@pytest.mark.parametrize("quant", QUANTS)
def test_mixtral_shape_matches_reference(quant, weight_as_lhs):
    """4096 rows in 2 local groups, K=4096, N=14336, bf16 in and out, under jit, the table's tile."""
    num_rows, k, n = 4096, 4096, 14336
    lhs, values, scales = _operands(jax.random.key(0), num_rows, k, n, 2, quant)
    sizes = jnp.asarray([1709, 2387], jnp.int32)
    config = dataclasses.replace(tf8.fp8_gmm_config(num_rows, k, n, 2), weight_as_lhs=weight_as_lhs)
    _poison((num_rows, n), jnp.bfloat16)
    out = jax.jit(functools.partial(tf8.fp8_gmm, quant=quant, config=config))(lhs, values, scales, sizes)
    assert out.shape == (num_rows, n) and out.dtype == jnp.bfloat16
    expected = _reference(lhs, values, scales, sizes, quant=quant, preferred_element_type=jnp.float32)
    assert _relative_error(out, expected) < 1e-2


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_up_to_accumulation_order(case, quant, config):
    """K=256, N=328 (fp8_e4m3 blocks 128 x 8, no tile width divides N), float32 output."""
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    k, n = 256, 328
    key = jax.random.key(len(case) * 2 + QUANTS.index(quant))
    lhs, values, scales = _operands(key, num_rows, k, n, num_local, quant)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    _poison((num_rows, n), jnp.float32)
    out = tf8.fp8_gmm(lhs, values, scales, sizes, quant=quant, group_offset=group_offset,
                      preferred_element_type=jnp.float32, config=config)
    expected = _reference(lhs, values, scales, sizes, quant=quant, group_offset=group_offset,
                          preferred_element_type=jnp.float32)
    assert out.shape == (num_rows, n) and out.dtype == jnp.float32
    assert _relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("weight_as_lhs", ORDERS)
@pytest.mark.parametrize("quant", QUANTS)
def test_float16_activations(quant, weight_as_lhs):
    group_sizes, num_rows, group_offset, num_local = CASES["group-offset-window"]
    lhs, values, scales = _operands(jax.random.key(5), num_rows, 256, 328, num_local, quant, jnp.float16)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    config = dataclasses.replace(tf8.fp8_gmm_config(num_rows, 256, 328, num_local), weight_as_lhs=weight_as_lhs)
    _poison((num_rows, 328), jnp.float32)
    out = tf8.fp8_gmm(lhs, values, scales, sizes, quant=quant, group_offset=group_offset,
                      preferred_element_type=jnp.float32, config=config)
    expected = _reference(lhs, values, scales, sizes, quant=quant, group_offset=group_offset,
                          preferred_element_type=jnp.float32)
    assert _relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("k,dtype", [(200, jnp.bfloat16), (256, jnp.float32)], ids=["8-row-scale-blocks", "f32"])
def test_inputs_without_an_fp8_kernel_still_match(k, dtype):
    """fp8_e4m3 scale blocks shorter than a dot's K step, and float32 activations: dequantised first."""
    group_sizes, num_rows, group_offset, num_local = CASES["empty-groups"]
    lhs, values, scales = _operands(jax.random.key(6), num_rows, k, 328, num_local, "fp8_e4m3", dtype)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    out = tf8.fp8_gmm(lhs, values, scales, sizes, preferred_element_type=jnp.float32)
    expected = _reference(lhs, values, scales, sizes, preferred_element_type=jnp.float32)
    assert _relative_error(out, expected) < 1e-5
