"""Every zoo model through the pass: regions found, outputs and gradients equal to the reference."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_lowering import MoeNotFoundError, NoMoeFoundWarning, explain, moe_optimize
from moe_lowering.testing.zoo import NEGATIVE, POSITIVE, ZOO


def relative_error(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    scale = np.linalg.norm(a)
    if scale == 0:
        return float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b) / scale)


def loss_of(out):
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))


def loss(fn):
    return lambda params, x: loss_of(fn(params, x))


def reference_output_and_grads(fn, params, x):
    """The dense reference's output and the gradients of ``loss(fn)``, as one compiled program."""
    def loss_and_output(params, x):
        out = fn(params, x)
        return loss_of(out), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss_and_output, argnums=(0, 1), has_aux=True))(params, x)
    return out, grads


@pytest.mark.parametrize("name", POSITIVE + NEGATIVE)
def test_explain_counts_regions(name):
    model = ZOO[name]
    params, x = model.args(jax.random.key(0))
    report = explain(model.fn, params, x)
    assert len(report.regions) == model.expected_regions, str(report)
    for region in report.regions:
        if region.style == "gathered weights":  # as many FLOPs, without the [T, k, d, f] weight copies
            assert region.rewritten_peak_intermediate_bytes < region.dense_peak_intermediate_bytes
        else:
            assert region.rewritten_flops < region.dense_flops or region.capacity


@pytest.mark.parametrize("name", POSITIVE)
def test_outputs_and_gradients_match_float32(name):
    model = ZOO[name]
    params, x = model.args(jax.random.key(1))
    sparse = jax.jit(moe_optimize(model.fn, strict=True))  # the rewritten forward alone, and below its gradients
    out_ref, grads_ref = reference_output_and_grads(model.fn, params, x)
    assert relative_error(out_ref, sparse(params, x)) < 1e-5
    grads_new = jax.jit(jax.grad(loss(moe_optimize(model.fn, strict=True)), argnums=(0, 1)))(params, x)
    for path, (g_ref, g_new) in zip(
        jax.tree_util.tree_flatten_with_path(grads_ref)[0], zip(jax.tree.leaves(grads_ref), jax.tree.leaves(grads_new))
    ):
        assert relative_error(g_ref, g_new) < 1e-5, path[0]


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "hf_loop", "gather_combine", "switch", "mixtral_bsd",
                                  "gate_on_tokens", "sorted_range_mask", "tiled_per_choice"])
def test_outputs_and_gradients_match_bfloat16(name):
    """bf16 against the float32 reference on the same values: within 2e-2, or no worse than dense bf16."""
    model = ZOO[name]
    params, x = model.args(jax.random.key(2), jnp.bfloat16)
    params32, x32 = jax.tree.map(lambda a: a.astype(jnp.float32), (params, x))
    sparse = moe_optimize(model.fn, strict=True)
    out_ref, out_new = model.fn(params, x), jax.jit(sparse)(params, x)  # op by op: bf16 rounded at each op
    assert out_new.dtype == out_ref.dtype == jnp.bfloat16
    out_exact, (g_exact, _) = reference_output_and_grads(model.fn, params32, x32)
    assert relative_error(out_exact, out_new) < max(2e-2, 2 * relative_error(out_exact, out_ref))
    g_ref = jax.grad(loss(model.fn))(params, x)
    g_new = jax.jit(jax.grad(loss(sparse)))(params, x)
    for exact, a, b in zip(jax.tree.leaves(g_exact), jax.tree.leaves(g_ref), jax.tree.leaves(g_new)):
        assert relative_error(exact, b) < max(2e-2, 2 * relative_error(exact, a))


@pytest.mark.parametrize("name", NEGATIVE)
def test_negatives_run_unchanged_with_one_warning(name):
    model = ZOO[name]
    params, x = model.args(jax.random.key(3))
    wrapped = moe_optimize(model.fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = wrapped(params, x)
        wrapped(params, x)
    assert [w.category for w in caught] == [NoMoeFoundWarning]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(model.fn(params, x)))
    with pytest.raises(MoeNotFoundError, match="no MoE region to rewrite"):
        moe_optimize(model.fn, strict=True)(params, x)


def _intermediate_shapes(closed):
    jaxpr = getattr(closed, "jaxpr", closed)
    for eqn in jaxpr.eqns:
        for out in eqn.outvars:
            yield tuple(out.aval.shape)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from _intermediate_shapes(sub)


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "gpt_oss", "gather_combine", "scan_layers", "mixtral_bsd",
                                  "sorted_range_mask"])
def test_rewritten_program_has_no_dense_expert_intermediate(name):
    model = ZOO[name].sized(E=8)  # E > 2k, so [T, k, 2f] rows stay under [T, E, f]
    params, x = model.args(jax.random.key(4))
    sizes = model.sizes
    dense_elements = sizes.T * sizes.E * sizes.f
    before = jax.make_jaxpr(model.fn)(params, x)
    after = jax.make_jaxpr(jax.grad(loss(moe_optimize(model.fn))))(params, x)
    weight_shapes = {tuple(leaf.shape) for leaf in jax.tree.leaves(params)}
    large = lambda shapes: [s for s in shapes if np.prod(s) >= dense_elements and s not in weight_shapes]  # noqa: E731
    assert large(_intermediate_shapes(before))
    assert not large(_intermediate_shapes(after))


def test_composes_with_vmap():
    model = ZOO["mixtral"]
    params, x = model.args(jax.random.key(5))
    xs = jnp.stack([x, x * 0.5 + 1.0])
    expected = jax.vmap(model.fn, in_axes=(None, 0))(params, xs)
    got = jax.jit(jax.vmap(moe_optimize(model.fn), in_axes=(None, 0)))(params, xs)
    assert relative_error(expected, got) < 1e-5


def test_jitted_function_keeps_static_and_donated_arguments():
    model = ZOO["mixtral"]
    params, x = model.args(jax.random.key(6))

    @moe_optimize
    @jax.jit
    def scaled(params, x, scale):
        return model.fn(params, x) * scale

    jitted = jax.jit(lambda p, x, s: model.fn(p, x) * s, static_argnums=2)
    wrapped = moe_optimize(jitted)
    assert relative_error(jitted(params, x, 3.0), wrapped(params, x, 3.0)) < 1e-5
    assert relative_error(model.fn(params, x) * 2.0, scaled(params, x, 2.0)) < 1e-5
    assert "sort" in wrapped.lower(params, x, 3.0).as_text()


def test_bare_and_configured_decorator_forms():
    model = ZOO["mixtral"]
    params, x = model.args(jax.random.key(7))
    bare = moe_optimize(model.fn)
    configured = moe_optimize(backend="xla")(model.fn)
    assert relative_error(bare(params, x), configured(params, x)) < 1e-6
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        moe_optimize(model.fn, backend="cuda")
    with pytest.raises(TypeError, match="expects a function"):
        moe_optimize(3)
