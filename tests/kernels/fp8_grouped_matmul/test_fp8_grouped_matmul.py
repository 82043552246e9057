"""The jnp FP8-weight grouped GEMM (CPU path and reference) against float64 numpy, and its input checks.

The numpy side dequantises on its own (block scales repeated over their blocks, E8M0 exponents
as ``2**(e - 127)``), without ``dequantize_blocks``. Weights are spread over 2**-6 .. 2**6 by
row and column before quantising, so every scale block has its own scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moe_lowering.kernels.fp8_grouped_matmul import fp8_gmm
from moe_lowering.kernels.fp8_grouped_matmul.quant_format import quantize_blocks

# (group sizes, rows, group_offset, local groups)
CASES = {
    "empty-groups": ([0, 37, 0, 90, 3, 0], 130, 0, 6),
    "one-group-takes-all": ([0, 0, 77, 0], 77, 0, 4),
    "rows-past-the-groups": ([5, 7, 11], 50, 0, 3),
    "group-offset-window": ([6, 13, 2, 9, 8], 38, 1, 3),
    "no-rows": ([0, 0], 0, 0, 2),
}
K, N = 96, 40


def _spread_weights(rng, num_local, k, n):
    weights = rng.standard_normal((num_local, k, n)) * np.exp2(rng.integers(-3, 4, (num_local, k, 1)))
    return (weights * np.exp2(rng.integers(-3, 4, (num_local, 1, n)))).astype(np.float32)


def _dequantise(values, scales, quant, dtype):
    """numpy: ``f32(values) * scale`` of each element's block, rounded to ``dtype``."""
    values = np.asarray(values).astype(np.float32)
    scales = np.asarray(scales)
    if quant == "mxfp8":
        scales = np.exp2(scales.astype(np.float32) - 127)
    block_k, block_n = values.shape[1] // scales.shape[1], values.shape[2] // scales.shape[2]
    per_element = np.repeat(np.repeat(scales, block_k, axis=1), block_n, axis=2)
    return (values * per_element).astype(dtype)


def _grouped_products(lhs, weights, group_sizes, group_offset):
    """float64 ``lhs[r] @ weights[group(r) - group_offset]``; zero for rows outside the local groups."""
    lhs, weights = np.asarray(lhs, np.float64), np.asarray(weights, np.float64)
    ends = np.cumsum(group_sizes)
    out = np.zeros((lhs.shape[0], weights.shape[2]))
    for local in range(weights.shape[0]):
        end = ends[local + group_offset]
        start = end - group_sizes[local + group_offset]
        out[start:min(end, lhs.shape[0])] = lhs[start:end] @ weights[local]
    return out


def _operands(case, quant, seed):
    group_sizes, rows, offset, num_local = CASES[case]
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((rows, K)).astype(ml_dtypes.bfloat16)
    values, scales = quantize_blocks(jnp.asarray(_spread_weights(rng, num_local, K, N)), quant)
    return lhs, values, scales, group_sizes, offset


@pytest.mark.parametrize("quant", ["fp8_e4m3", "mxfp8"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_numpy(case, quant):
    """bf16 activations, float32 output: equal up to accumulation order, bf16 rounding of each weight included."""
    lhs, values, scales, group_sizes, offset = _operands(case, quant, seed=len(case))
    out = fp8_gmm(jnp.asarray(lhs), values, scales, jnp.asarray(group_sizes, jnp.int32), quant=quant,
                  group_offset=offset, preferred_element_type=jnp.float32)
    expected = _grouped_products(lhs, _dequantise(values, scales, quant, ml_dtypes.bfloat16), group_sizes, offset)
    assert out.shape == expected.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * max(np.abs(expected).max(initial=0), 1))


@pytest.mark.parametrize("quant", ["fp8_e4m3", "mxfp8"])
def test_output_defaults_to_the_activation_dtype(quant):
    lhs, values, scales, group_sizes, offset = _operands("empty-groups", quant, seed=3)
    out = fp8_gmm(jnp.asarray(lhs), values, scales, jnp.asarray(group_sizes, jnp.int32), quant=quant)
    assert out.dtype == jnp.bfloat16
    expected = _grouped_products(lhs, _dequantise(values, scales, quant, ml_dtypes.bfloat16), group_sizes, offset)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def test_fp8_e4m3_block_sizes_come_from_the_scale_shape():
    """Scales not made by ``quantize_blocks``: 16 x 4 blocks, every scale different, under jit."""
    rng = np.random.default_rng(11)
    group_sizes = [9, 0, 14]
    lhs = rng.standard_normal((23, 64)).astype(np.float32)
    values = rng.standard_normal((3, 64, 24)).astype(ml_dtypes.float8_e4m3fn)
    scales = np.exp2(rng.uniform(-6, 6, (3, 4, 6))).astype(np.float32)
    out = jax.jit(fp8_gmm)(lhs, values, scales, jnp.asarray(group_sizes, jnp.int32))
    expected = _grouped_products(lhs, _dequantise(values, scales, "fp8_e4m3", np.float32), group_sizes, 0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def _operands_with(quant="fp8_e4m3", lhs=(8, 64), values=(2, 64, 32), values_dtype="float8_e4m3fn", scales=None,
                   scales_dtype=None, lhs_dtype="bfloat16", group_sizes=(2,), group_sizes_dtype="int32"):
    """Well-formed operands except where an argument says otherwise."""
    if scales is None:
        scales = (values[0], values[1] // 32, values[2]) if quant == "mxfp8" else (values[0], 1, 1)
    scales_dtype = scales_dtype or ("uint8" if quant == "mxfp8" else "float32")
    operands = (jnp.ones(lhs, lhs_dtype), jnp.ones(values, values_dtype), jnp.ones(scales, scales_dtype),
                jnp.ones(group_sizes, group_sizes_dtype))
    return operands, quant


BAD_OPERANDS = [
    (dict(quant="int8"), "quant must be one of"),
    (dict(lhs=(8,)), "expected lhs"),
    (dict(values=(64, 32)), "expected lhs"),
    (dict(lhs_dtype="int32"), "lhs must be floating point"),
    (dict(values_dtype="bfloat16"), "rhs_values must be float8_e4m3fn"),
    (dict(lhs=(8, 48)), "contraction sizes differ"),
    (dict(group_sizes=(2, 1)), "group_sizes must be 1-D integers"),
    (dict(group_sizes_dtype="float32"), "group_sizes must be 1-D integers"),
    (dict(scales_dtype="uint8"), "fp8_e4m3 scales must be float32"),
    (dict(quant="mxfp8", scales_dtype="float32"), "mxfp8 scales must be uint8"),
    (dict(scales=(2, 3, 1)), r"fp8_e4m3 scales must be \[G, K // block_k"),
    (dict(lhs=(8, 48), values=(2, 48, 32), scales=(2, 2, 1)), r"fp8_e4m3 scales must be \[G, K // block_k"),
    (dict(values=(2, 64, 33), scales=(2, 1, 2)), r"fp8_e4m3 scales must be \[G, K // block_k"),
    (dict(scales=(3, 1, 1)), r"fp8_e4m3 scales must be \[G, K // block_k"),
    (dict(scales=(2, 1)), r"fp8_e4m3 scales must be \[G, K // block_k"),
    (dict(quant="mxfp8", scales=(2, 4, 32)), "mxfp8 needs K a multiple of 32"),
    (dict(quant="mxfp8", scales=(2, 2, 16)), "mxfp8 needs K a multiple of 32"),
    (dict(quant="mxfp8", lhs=(8, 48), values=(2, 48, 32), scales=(2, 1, 32)), "mxfp8 needs K a multiple of 32"),
]


@pytest.mark.parametrize("problem,message", [
    pytest.param(problem, message, id=",".join(f"{key}={value}" for key, value in problem.items()))
    for problem, message in BAD_OPERANDS
])
def test_bad_operands_are_rejected(problem, message):
    (lhs, values, scales, group_sizes), quant = _operands_with(**problem)
    with pytest.raises(ValueError, match=message):
        fp8_gmm(lhs, values, scales, group_sizes, quant=quant)
