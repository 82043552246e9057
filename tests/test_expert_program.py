"""SwiGLU up-projections in expert programs: which are found for fusion, and fused == unfused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from moe_lowering.expert_program import (Elementwise, ExpertMatmul, ExpertProgram, ParamKind, RowContext, RowInput,
                                         evaluate, find_swiglu_fusions, topological_nodes)
from moe_lowering.passes.rewrite import analyse_program
from moe_lowering.primitives import gmm_p, swiglu_gmm_p
from moe_lowering.sparse_moe import grouped_matmul, grouped_swiglu_matmul, run_expert_program, sort_by_expert
from moe_lowering.testing import zoo

MUL = ((lax.mul_p, (("out_dtype", None),)))
LOGISTIC = ((lax.logistic_p, (("accuracy", None),)))


def _op(spec, *operands):
    return Elementwise(spec[0], spec[1], operands)


def _program(output, num_weights=3):
    return ExpertProgram(output=output, param_kinds=(ParamKind.EXPERT_WEIGHT,) * num_weights,
                         nodes=topological_nodes(output))


def _swiglu(gate, up, swap=False):
    silu = _op(MUL, _op(LOGISTIC, gate), gate) if swap else _op(MUL, gate, _op(LOGISTIC, gate))
    return _op(MUL, up, silu) if swap else _op(MUL, silu, up)


@pytest.mark.parametrize("builder,expected", [
    ("build_mixtral", 1), ("build_deepseek_v3", 1), ("build_flax_moe", 1),
    ("build_gpt_oss", 0),  # clipped SwiGLU with biases: not this pattern
])
def test_zoo_programs(builder, expected):
    model = getattr(zoo, builder)(zoo.Sizes(T=16, d=8, f=12, E=4, k=2))
    params, x = model.args(jax.random.key(0), jnp.float32)
    (region,) = analyse_program(jax.make_jaxpr(model.fn)(params, x)).regions
    assert len(find_swiglu_fusions(region.program)) == expected


def test_operand_order_and_separate_row_inputs_match():
    gate, up = ExpertMatmul(RowInput(), 0), ExpertMatmul(RowInput(), 1)
    (fusion,) = find_swiglu_fusions(_program(ExpertMatmul(_swiglu(gate, up, swap=True), 2)))
    assert fusion.gate is gate and fusion.up is up


def test_not_fused_when_an_intermediate_is_read_elsewhere_or_sources_differ():
    gate, up = ExpertMatmul(RowInput(), 0), ExpertMatmul(RowInput(), 1)
    hidden = _swiglu(gate, up)
    reads_gate = ExpertMatmul(_op(MUL, hidden, gate), 2)
    assert find_swiglu_fusions(_program(reads_gate)) == ()
    other_source = ExpertMatmul(_op(LOGISTIC, RowInput()), 1)
    assert find_swiglu_fusions(_program(ExpertMatmul(_swiglu(gate, other_source), 2))) == ()
    f32_gate = ExpertMatmul(RowInput(), 0, jnp.dtype(jnp.float32))
    assert find_swiglu_fusions(_program(ExpertMatmul(_swiglu(f32_gate, up), 2))) == ()
    assert len(find_swiglu_fusions(_program(_swiglu(gate, up), 2))) == 1  # the product may be the output


def _mixtral_case(dtype, group_sizes, num_rows, d=24, f=40):
    keys = jax.random.split(jax.random.key(num_rows), 5)
    num_experts = len(group_sizes)
    rows = jax.random.normal(keys[0], (num_rows, d)).astype(dtype)
    params = [jax.random.normal(keys[1], (num_experts, d, f)).astype(dtype),
              jax.random.normal(keys[2], (num_experts, d, f)).astype(dtype),
              jax.random.normal(keys[3], (num_experts, f, d)).astype(dtype)]
    cotangent = jax.random.normal(keys[4], (num_rows, d)).astype(dtype)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    model = zoo.build_mixtral(zoo.Sizes(T=16, d=8, f=12, E=4, k=2))
    probe_params, probe_x = model.args(jax.random.key(0), dtype)
    (region,) = analyse_program(jax.make_jaxpr(model.fn)(probe_params, probe_x)).regions
    return region.program, rows, params, cotangent, sizes


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("group_sizes,num_rows", [([9, 0, 30, 2], 41), ([0, 0, 23, 0], 30)],
                         ids=["empty-groups", "rows-outside-groups"])
def test_fused_evaluation_matches_unfused(dtype, tolerance, group_sizes, num_rows):
    """Forward and every gradient of the Mixtral program, fused vs two grouped products."""
    program, rows, params, cotangent, sizes = _mixtral_case(dtype, group_sizes, num_rows)
    experts = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(num_rows), side="right"), len(group_sizes) - 1)
    context = lambda rows: RowContext(rows, sizes, experts, jnp.arange(num_rows))  # noqa: E731
    calls = []

    def matmul(lhs, rhs, group_sizes, offset, pet):
        return grouped_matmul(lhs, rhs, group_sizes, "xla", offset, pet)

    def swiglu(lhs, gate, up, group_sizes, offset, pet):
        calls.append(pet)
        return grouped_swiglu_matmul(lhs, gate, up, group_sizes, "xla", offset, pet)

    def fused(rows, params):
        return evaluate(program, params, context(rows), matmul, swiglu_matmul=swiglu)

    def unfused(rows, params):
        return evaluate(program, params, context(rows), matmul)

    out, fused_vjp = jax.vjp(fused, rows, params)
    expected, unfused_vjp = jax.vjp(unfused, rows, params)
    assert len(calls) == 1 and out.dtype == expected.dtype == dtype
    grads = zip(jax.tree.leaves(fused_vjp(cotangent)), jax.tree.leaves(unfused_vjp(cotangent)))
    pairs = [(out, expected), *grads]
    for got, want in pairs:
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(got - want) <= tolerance * np.linalg.norm(want)


def test_sparse_moe_fuses_on_the_xla_backend():
    program, rows, params, _, _ = _mixtral_case(jnp.float32, [3, 5], 8)
    routing = sort_by_expert(jnp.asarray([[0, 1], [1, 0], [1, 1], [0, 1]]), 2)
    jaxpr = jax.make_jaxpr(lambda r, p: run_expert_program(program, p, r, routing, backend="xla"))(rows, params)
    products = [e.primitive for e in jaxpr.eqns if e.primitive in (gmm_p, swiglu_gmm_p)]
    assert products == [swiglu_gmm_p, gmm_p]  # the fused up-projection and the down-projection


@pytest.mark.parametrize("excess, fused", [(0, True), (1, False)], ids=["at-the-limit", "wider"])
def test_a_backend_fuses_experts_only_up_to_its_width(excess, fused, monkeypatch):
    """``KernelBackend.swiglu_gmm_max_n``: wider SwiGLU experts stay two products and the activation."""
    import dataclasses

    import moe_lowering.sparse_moe as sparse_moe
    from moe_lowering.kernels import get_backend

    program, rows, params, _, _ = _mixtral_case(jnp.float32, [3, 5], 8)
    width = params[program.matmuls()[0].weight].shape[-1]
    limited = dataclasses.replace(get_backend("xla"), swiglu_gmm_max_n=width - excess)
    monkeypatch.setattr(sparse_moe, "get_backend", lambda name: limited)
    routing = sort_by_expert(jnp.asarray([[0, 1], [1, 0], [1, 1], [0, 1]]), 2)
    jaxpr = jax.make_jaxpr(lambda r, p: run_expert_program(program, p, r, routing, backend="xla"))(rows, params)
    products = [e.primitive for e in jaxpr.eqns if e.primitive in (gmm_p, swiglu_gmm_p)]
    assert products == ([swiglu_gmm_p, gmm_p] if fused else [gmm_p, gmm_p, gmm_p])
