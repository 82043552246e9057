"""The FP8-gathered expert weight's grouped product on a GPU: the FP8-weight kernel where it is
chosen, against dequantise-then-GEMM, outputs and the straight-through gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from moe_lowering.kernels.fp8_grouped_matmul.quant_format import dequantize_blocks, quantize_blocks
from moe_lowering.parallel._jax_shim import shard_map
from moe_lowering.parallel.quantize import GatheredFp8Weight, gather_weight_fp8, use_fp8_kernel
from moe_lowering.sparse_moe import expert_matmul, grouped_matmul

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

NUM_EXPERTS, K, N = 16, 512, 384


def _case(rows_per_expert: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(NUM_EXPERTS * rows_per_expert, np.ones(NUM_EXPERTS) / NUM_EXPERTS).astype(np.int32)
    lhs = jnp.asarray(rng.standard_normal((NUM_EXPERTS * rows_per_expert, K)), jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((NUM_EXPERTS, K, N)) / np.sqrt(K), jnp.bfloat16)
    cotangent = jnp.asarray(rng.standard_normal((lhs.shape[0], N)), jnp.bfloat16)
    return lhs, weight, jnp.asarray(sizes), cotangent


def _loss(gather, lhs, weight, sizes, cotangent):
    mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])

    def body(lhs, weight):
        out = expert_matmul(lhs, gather(weight), sizes, "auto", 0, None)
        return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32)), out

    return shard_map(body, mesh=mesh, in_specs=(P(), P(None, "fsdp")), out_specs=(P(), P()))(lhs, weight)


@pytest.mark.parametrize("quant", ["fp8_e4m3", "mxfp8"])
@pytest.mark.parametrize("rows_per_expert, kernel", [(64, True), (1024, False)])
def test_matches_dequantize_then_gemm(quant, rows_per_expert, kernel):
    lhs, weight, sizes, cotangent = _case(rows_per_expert)
    values, scales = quantize_blocks(weight, quant)
    # Dequantised eagerly and passed in: under one jit, XLA:GPU may fold the f32 -> fp8 -> f32 round
    # trip of quantise-then-dequantise away (excess precision), and the reference would be exact.
    dequantized = dequantize_blocks(values, scales, quant, weight.dtype)

    def straight_through(shard):
        return dequantized + (shard - jax.lax.stop_gradient(shard))

    fp8 = jax.jit(jax.value_and_grad(lambda l, w: _loss(lambda s: gather_weight_fp8(s, "fsdp", 1, quant), l, w, sizes,
                                                         cotangent), argnums=(0, 1), has_aux=True))
    exact = jax.jit(jax.value_and_grad(lambda l, w: _loss(straight_through, l, w, sizes, cotangent), argnums=(0, 1),
                                       has_aux=True))
    (_, out), (d_lhs, d_weight) = fp8(lhs, weight)
    (_, want), (want_d_lhs, want_d_weight) = exact(lhs, weight)
    for name, got, ref in (("out", out, want), ("d_lhs", d_lhs, want_d_lhs), ("d_weight", d_weight, want_d_weight)):
        err = float(jnp.linalg.norm((got - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
        assert err < 1e-2, (name, err)
    gathered = GatheredFp8Weight(jax.lax.bitcast_convert_type(values, jnp.uint8), scales, weight, quant, "fsdp", 1)
    assert use_fp8_kernel(lhs, gathered, "auto") is kernel


def test_plain_weights_keep_the_grouped_matmul():
    lhs, weight, sizes, _ = _case(64)
    np.testing.assert_array_equal(np.asarray(expert_matmul(lhs, weight, sizes, "auto", 0, None)),
                                  np.asarray(grouped_matmul(lhs, weight, sizes, "auto", 0, None)))
