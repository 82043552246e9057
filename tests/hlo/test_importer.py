"""The importer reproduces a module's outputs: ``lower(f).as_text()`` -> import -> run == f."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxlib.mlir import ir

from moe_lowering.hlo import _compat, examples
from moe_lowering.hlo.importer import UnsupportedModuleError, import_module


def _import(text_or_bytes):
    context = _compat.make_ir_context()
    with context:
        return import_module(ir.Module.parse(text_or_bytes))


def _routes(lowered) -> dict:
    return {
        "stablehlo": lowered.as_text(),
        "hlo": _compat.hlo_text_to_stablehlo_bytecode(lowered.compiler_ir("hlo").as_hlo_text()),
    }


def _many_ops(x, w, idx):
    values, indices = jax.lax.top_k(x, 2)
    one_hot = jax.nn.one_hot(indices, 4)
    ascending = jnp.argsort(x[:, 0], stable=True)
    descending = jnp.argsort(x[:, 1], descending=True)
    gathered = jnp.take(x, ascending, axis=0)
    counts = jnp.zeros((8,)).at[idx].add(1.0)
    written = jnp.zeros((8,)).at[idx].set(2.0)

    def layer(carry, weight):
        return jax.nn.silu(carry @ weight), None

    scanned, _ = jax.lax.scan(layer, x, w)
    branch = jax.lax.cond(x[0, 0] > 0, lambda: scanned, lambda: -scanned)
    mixed = jax.nn.gelu(branch, approximate=False) + jax.nn.softmax(branch)
    return (values, one_hot, gathered, counts, written, mixed, jax.lax.rsqrt(jnp.abs(mixed) + 1),
            jnp.clip(mixed, -1, 1) ** 3.0, jnp.argmax(x, axis=-1), jnp.cumsum(x, axis=0), descending,
            jax.nn.sigmoid(x), jax.scipy.special.erf(x), jnp.where(x > 0, x, 0.1 * x).sum(), x.astype(jnp.bfloat16))


@pytest.mark.parametrize("route", ["stablehlo", "hlo"])
def test_round_trip_many_ops(route):
    rng = np.random.default_rng(0)
    args = (rng.standard_normal((4, 4), np.float32), rng.standard_normal((2, 4, 4), np.float32),
            np.array([1, 3, 3, 7], np.int32))
    program = _import(_routes(jax.jit(_many_ops).lower(*args))[route])
    got = jax.jit(program.fn)(*args)
    want = jax.tree.leaves(_many_ops(*args))
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, index
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6,
                                   err_msg=f"output {index}")


@pytest.mark.parametrize("name,dtype", [("mixtral", jnp.float32), ("switch", jnp.float32),
                                        ("scan_layers", jnp.float32), ("deepseek_v3", jnp.bfloat16),
                                        ("gshard_top2", jnp.bfloat16)])
def test_zoo_round_trip_is_bit_exact(name, dtype):
    lowered, flat = examples.zoo_lowered(name, dtype)
    want = jax.tree.leaves(lowered.compile()(*flat))
    for route, module in _routes(lowered).items():
        program = _import(module)
        got = jax.jit(program.fn)(*flat)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=route)


def test_jaxpr_reads_like_traced_jax():
    """Broadcast constants are scalars, one-hot keeps its [1, 1, E] iota, argmax is argmax."""
    def f(logits):
        one_hot = jax.nn.one_hot(jnp.argmax(logits, -1)[:, None], 8)
        return one_hot * 0.5

    program = _import(jax.jit(f).lower(jnp.ones((4, 8))).as_text())
    printed = str(jax.make_jaxpr(program.fn)(*program.in_avals))
    assert "argmax[" in printed
    assert "shape=(1, 1, 8)" in printed
    assert "0.5:f32[]" in printed


def test_unknown_custom_call_is_kept_verbatim():
    text = """
    module @m {
      func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
        %0 = stablehlo.custom_call @Sharding(%arg0) {mhlo.sharding = "{replicated}"} : (tensor<4xf32>) -> tensor<4xf32>
        %1 = stablehlo.add %0, %0 : tensor<4xf32>
        return %1 : tensor<4xf32>
      }
    }"""
    program = _import(text)
    relowered = jax.jit(program.fn).lower(*program.in_avals).as_text()
    assert 'stablehlo.custom_call @Sharding' in relowered and 'mhlo.sharding = "{replicated}"' in relowered


def test_unsupported_region_op_is_reported():
    text = """
    module @m {
      func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
        %0 = "stablehlo.map"(%arg0, %arg0) <{dimensions = array<i64: 0>}> ({
        ^bb0(%a: tensor<f32>, %b: tensor<f32>):
          %s = stablehlo.add %a, %b : tensor<f32>
          stablehlo.return %s : tensor<f32>
        }) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
        return %0 : tensor<4xf32>
      }
    }"""
    program = _import(text)
    with pytest.raises(UnsupportedModuleError, match="stablehlo.map"):
        jax.make_jaxpr(program.fn)(*program.in_avals)
