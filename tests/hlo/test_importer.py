"""The importer reproduces a module's outputs: ``lower(f).as_text()`` -> import -> run == f."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxlib.mlir import ir

from moe_lowering.hlo import _compat
from moe_lowering.testing import hlo_examples as examples
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


SHARDING_CALL_MODULE = """
module @m {
  func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.custom_call @Sharding(%arg0) {mhlo.sharding = "{replicated}"} : (tensor<4xf32>) -> tensor<4xf32>
    %1 = stablehlo.add %0, %0 : tensor<4xf32>
    return %1 : tensor<4xf32>
  }
}"""
"""A custom call the importer has no lax op for (kept verbatim), then an add."""


def test_unknown_custom_call_is_kept_verbatim():
    program = _import(SHARDING_CALL_MODULE)
    relowered = jax.jit(program.fn).lower(*program.in_avals).as_text()
    assert 'stablehlo.custom_call @Sharding' in relowered and 'mhlo.sharding = "{replicated}"' in relowered


def test_an_imported_program_runs_outside_jit():
    """Ops kept verbatim evaluate op by op too (compiled alone), so the imported program can be called as is."""
    program = _import(SHARDING_CALL_MODULE)
    with jax.disable_jit():
        out = program.fn(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(out).reshape(-1), 2 * np.arange(4, dtype=np.float32))


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


# Constants the MLIR bindings cannot hand to Python, and composites.


def _complex_cases():
    rng = np.random.default_rng(1)
    for dtype in (np.complex64, np.complex128):
        small = (rng.standard_normal((2, 3)) + 1j * rng.standard_normal((2, 3))).astype(dtype)
        small[0, 1] = complex(np.nan, np.inf)  # printed as hex bit patterns
        small[1, 2] = complex(-np.inf, -0.0)
        large = (rng.standard_normal((20, 30)) + 1j * rng.standard_normal((20, 30))).astype(dtype)  # hex blob
        for name, value in (("list", small), ("hex_blob", large), ("splat", np.full((4,), 1 - 2j, dtype)),
                            ("scalar", np.asarray(dtype(0.5 + 3j)))):
            yield pytest.param(value, id=f"{np.dtype(dtype).name}-{name}")


@pytest.mark.parametrize("constant", list(_complex_cases()))
def test_complex_constants_are_read_exactly(constant):
    def f(x):
        return x.astype(constant.dtype) * constant, jnp.sum(constant)

    x = np.ones(constant.shape, np.float32)
    with _compat.enable_x64(constant.dtype == np.complex128), np.errstate(invalid="ignore"):
        program = _import(jax.jit(f).lower(x).as_text())
        got = jax.jit(program.fn)(x)
        want = f(x)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # Read as a value, not kept opaque: the jaxpr has the constant, as traced JAX would.
        assert "stablehlo_verbatim" not in str(jax.make_jaxpr(program.fn)(*program.in_avals))


def test_unreadable_constant_is_re_emitted_as_printed():
    """An int4 constant numpy cannot read from the attribute: copied through unchanged."""
    constant = np.array([1, -2, 3, 0], jnp.int4)

    def f(x):
        return x + constant

    x = np.ones(4, jnp.int4)
    program = _import(jax.jit(f).lower(x).as_text())
    np.testing.assert_array_equal(np.asarray(jax.jit(program.fn)(x)[0], np.int8), np.asarray(f(x), np.int8))
    relowered = jax.jit(program.fn).lower(*program.in_avals).as_text()
    assert "dense<[1, -2, 3, 0]> : tensor<4xi4>" in relowered


def test_composite_round_trips_with_its_attributes():
    def decomposition(x, y, *, alpha, name, axes, table, flag):
        return jnp.tanh(x) * alpha + y.sum(axis=axes[0]), x * table.sum()

    composite = jax.lax.composite(decomposition, name="test.odd_attributes", version=7)

    def f(x, y):
        out = composite(x, y, alpha=0.5, name="a, b = {c}", axes=np.array([0], np.int64),
                        table=np.arange(4, dtype=np.float32), flag=True)
        return out[0] + 1, out[1]

    args = (np.ones((3, 4), np.float32), np.ones((2, 3, 4), np.float32))
    text = jax.jit(f).lower(*args).as_text()
    original = next(line for line in text.splitlines() if "stablehlo.composite" in line)
    program = _import(text)
    assert "composite[" in str(jax.make_jaxpr(program.fn)(*program.in_avals))
    relowered = jax.jit(program.fn).lower(*program.in_avals).as_text()
    line = next(line for line in relowered.splitlines() if "stablehlo.composite" in line)
    attributes = original.split("composite_attributes = ")[1].split("}, decomposition")[0]
    assert attributes in line and "version = 7" in line and '"test.odd_attributes"' in line, (original, line)
    for a, b in zip(jax.jit(program.fn)(*args), f(*args)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_dictionary_attribute_keys_are_split_at_top_level():
    from moe_lowering.hlo.importer import _dict_attr_names

    text = ('{a = 1 : i32, "b.c" = "x, y = {z}", d = array<i64: 1, 2>, e = dense<[1, 2]> : tensor<2xi32>, '
            'f = (i32) -> i32, g, h = {i = [1, 2]}}')
    assert _dict_attr_names(text) == ["a", "b.c", "d", "e", "f", "g", "h"]
