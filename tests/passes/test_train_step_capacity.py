"""Training steps of capacity (Switch / GShard) layers: the forward's on-device check and its
``lax.cond`` differentiated whole, the dense branch under ``jax.checkpoint`` (``rewrite.py``,
``differentiable_region``), the program's backward proven to be ``jax.vjp`` of the dense region with
its combine tensor's construction (``derivative_match.py``, ``derivative_support.bounded_construction``).

Each step is compared with the undecorated step: the loss and the gradients w.r.t. every input,
float32 tight, on the sparse branch (tokens dropped past capacity included) and on the dense one.
"""

from __future__ import annotations

import collections
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from moe_lowering import _compat, explain, moe_optimize
from moe_lowering.testing import mutate, zoo
from moe_lowering.testing.device_checks import capacity_fallbacks
from test_train_step import (STEP_OF_KINDS, TRAIN_KINDS, _assert_close, assert_mutants_declined_or_exact,
                             follows_the_dense_trajectory)
from test_train_step_remat import assert_bfloat16_as_close_as_the_dense_step

D, F = 8, 12
# C differs from E, d and f, so that a value holding expert activations is told by its shape
MODELS = {
    "switch": zoo.ZOO["switch"].builder(zoo.Sizes(T=16, d=D, f=F, E=4, k=1), capacity_factor=0.75),  # C = 3
    "gshard_top2": zoo.ZOO["gshard_top2"].builder(zoo.Sizes(T=16, d=D, f=F, E=4, k=2), capacity_factor=1.25),  # 10
    "grouped_capacity": zoo.ZOO["grouped_capacity"].builder(zoo.Sizes(B=2, T=20, d=D, f=F, E=4, k=2),
                                                            capacity_factor=1.25),  # [B, S, E, C], S = 10, C = 6
    # combine as praxis builds it (outer products, dispatch = combine != 0); V-MoE's batch-prioritised
    # queue; the all-to-all layout ([E, B * C, d] rows, B * C = 14)
    "gshard_top2_outer": zoo.ZOO["gshard_top2_outer"].builder(zoo.Sizes(T=16, d=D, f=F, E=4, k=2),
                                                              capacity_factor=1.25),
    "batch_prioritized": zoo.ZOO["batch_prioritized"].builder(zoo.Sizes(T=16, d=D, f=F, E=4, k=1),
                                                              capacity_factor=0.75),
    "grouped_capacity_a2a": zoo.ZOO["grouped_capacity_a2a"].builder(zoo.Sizes(B=2, T=20, d=D, f=F, E=4, k=2),
                                                                    capacity_factor=1.5),  # C = 7
}


def _loss(fn):
    return lambda params, x: jnp.mean(jnp.sin(fn(params, x)) ** 2)


def _step(fn):
    return jax.jit(jax.value_and_grad(_loss(fn), argnums=(0, 1)))


def _activation_shapes(closed, num_experts: int, capacity: int, into_cond: bool) -> list:
    """Shapes of the values of ``closed`` (sub-jaxprs included) holding expert activations or their
    cotangents: an experts, a slots and a feature axis. ``into_cond=False``: a ``cond``'s outputs are
    looked at, not its branches (the dense fallback's own values); its outputs are the residuals the
    forward keeps for the backward."""
    found = []
    wanted = [collections.Counter({num_experts: 1, capacity: 1, feature: 1}) for feature in (D, F)]

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                dims = collections.Counter(getattr(var.aval, "shape", ()))
                if any(all(dims[n] >= c for n, c in want.items()) for want in wanted):
                    found.append(tuple(var.aval.shape))
            if str(eqn.primitive) == "cond" and not into_cond:
                continue
            for inner in _compat.sub_jaxprs(eqn.params):
                walk(_compat.open_jaxpr(inner))

    walk(closed.jaxpr)
    return found


def _check_step(fn, params, x, capacity, num_experts=4, rtol=1e-5):
    step = _step(fn)
    report = explain(step, params, x)
    assert len(report.regions) == 1 and report.regions[0].backward, str(report)
    assert "rewritten forward and backward" in str(report)
    rewritten = moe_optimize(step, strict=True)
    _assert_close(step(params, x), rewritten(params, x), rtol)
    dense_jaxpr, sparse_jaxpr = jax.make_jaxpr(step)(params, x), jax.make_jaxpr(rewritten)(params, x)
    assert _activation_shapes(dense_jaxpr, num_experts, capacity, into_cond=True)  # the check can fail
    assert _activation_shapes(sparse_jaxpr, num_experts, capacity, into_cond=True)  # the dense fallback is there
    assert not _activation_shapes(sparse_jaxpr, num_experts, capacity, into_cond=False), (
        "a dense expert activation is kept outside the fallback branch (a residual of the cond)")
    return step, rewritten


@pytest.mark.parametrize("name", list(MODELS))
def test_capacity_training_step_rewritten_forward_and_backward(name):
    """The sparse branch (the device checks hold on this data): loss and gradients w.r.t. every
    parameter and the tokens as the dense step's."""
    model = MODELS[name]
    params, x = model.args(jax.random.key(1))
    assert capacity_fallbacks(model.fn, params, x) == [False]
    _check_step(model.fn, params, x, model.capacity)


def test_tokens_dropped_past_capacity_are_dropped_alike():
    """Switch with 12 slots for 16 tokens: at least 4 tokens are dropped (their output is zero), on the
    sparse branch, and the gradients are still the dense step's, which drops the same tokens; with
    ``jit`` inside the decorated step and outside it."""
    model = MODELS["switch"]
    params, x = model.args(jax.random.key(2))
    assert model.capacity * 4 < 16
    assert np.sum(np.all(np.asarray(model.fn(params, x)) == 0, axis=-1)) >= 16 - model.capacity * 4
    assert capacity_fallbacks(model.fn, params, x) == [False]
    step, _ = _check_step(model.fn, params, x, model.capacity)
    outer = jax.jit(moe_optimize(jax.value_and_grad(_loss(model.fn), argnums=(0, 1)), strict=True))
    _assert_close(step(params, x), outer(params, x), 1e-5)  # jit outside the decorated step


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["remat", "frozen_router"])
def test_rematerialised_layer_and_frozen_router(variant):
    """The layer under ``jax.checkpoint`` (its recomputing backward: the remat inlined, as for dropless
    layers), and a router under ``stop_gradient`` (combine then has no derivative: nothing to rebuild)."""
    model = MODELS["switch"]
    params, x = model.args(jax.random.key(5))
    if variant == "remat":
        fn = jax.checkpoint(model.fn)
    else:
        def fn(params, x):
            return model.fn({**params, "router": lax.stop_gradient(params["router"])}, x)
    _check_step(fn, params, x, model.capacity)


def _switch_like(variant: str, capacity: int = 3):
    """Top-1 capacity routing whose dispatch breaks a device check on some data: ``several``: tokens also
    go to every expert scoring over 0.2 (more than k experts); ``wrap``: positions wrap around the
    slots (two tokens in one slot)."""

    def layer(params, x):
        num_experts = params["router"].shape[-1]
        probs = jax.nn.softmax(x @ params["router"], axis=-1)
        mask = jax.nn.one_hot(jnp.argmax(probs, axis=-1), num_experts, dtype=jnp.int32)
        if variant == "several":
            mask = jnp.maximum(mask, (probs > 0.2).astype(jnp.int32))
        position = jnp.cumsum(mask, axis=0) * mask - 1
        if variant == "wrap":
            position = position % capacity
        dispatch = jax.nn.one_hot(position, capacity, dtype=x.dtype) * (mask * (position < capacity))[..., None]
        combine = dispatch * probs[..., None]
        hidden = jax.nn.relu(jnp.einsum("ecd,edf->ecf", jnp.einsum("tec,td->ecd", dispatch, x), params["w_up"]))
        return jnp.einsum("tec,ecd->td", combine, jnp.einsum("ecf,efd->ecd", hidden, params["w_down"]))

    return layer


@pytest.mark.parametrize("variant", [pytest.param("several", marks=pytest.mark.slow), "wrap"])
def test_the_dense_fallback_branch_gives_the_dense_gradients(variant):
    """A dispatch the device check rejects on this data: the cond takes the dense branch, whose VJP (under
    jax.checkpoint) is the dense step's."""
    params, x = MODELS["switch"].args(jax.random.key(3))
    layer = _switch_like(variant)
    assert capacity_fallbacks(layer, params, x) == [True]
    _check_step(layer, params, x, capacity=3)


@pytest.mark.slow
def test_optax_training_loop_follows_the_dense_trajectory():
    """GShard top-2 with capacity: three Adam steps, the dense step's losses and parameters."""
    model = MODELS["gshard_top2"]
    follows_the_dense_trajectory(_loss(model.fn), *model.args(jax.random.key(4)), steps=3)


@pytest.mark.slow
def test_bfloat16_step_as_close_to_float32_as_the_dense_step():
    assert_bfloat16_as_close_as_the_dense_step(_step(MODELS["switch"].fn), *MODELS["switch"].args(jax.random.key(1)))


# --------------------------------------------------------------------------- mutants of the capacity step

MUTANTS_PER_KIND = max(1, int(os.environ.get("MOE_TRAIN_MUTANTS_PER_KIND", "10")) // 3)  # 30 locally, 10 in CI
CASES = [(f"{mutate.TRAIN_STEP}switch", kind) for kind in TRAIN_KINDS] + [
    (f"{mutate.STEP_OF}switch", kind) for kind in STEP_OF_KINDS]


@pytest.mark.mutation
@pytest.mark.parametrize("context, kind", CASES)
def test_capacity_training_step_mutants_are_declined_or_rewritten_exactly(context, kind):
    """The Switch step mutated anywhere, its backward included (a cotangent scaled, a transpose given the
    wrong operand, an interior value read once more), or the step of a mutated layer (a stop_gradient on
    one path): declined, or rewritten and exact (``mutate.check_mutant``)."""
    assert_mutants_declined_or_exact(context, kind, MUTANTS_PER_KIND)


def test_a_scaled_cotangent_in_the_capacity_layers_backward_declines():
    """x2 on the expert outputs' cotangent (the transpose of the combine einsum): no longer jax.vjp of
    the layer, so the step is left dense with the reason."""
    tiny = mutate.TINY
    capacity = zoo.expert_capacity(tiny["T"], tiny["E"], 1, 1.0)
    candidates = [m for m, _ in mutate.candidates(f"{mutate.TRAIN_STEP}switch", "scale")
                  if m.site.primitive is lax.dot_general_p
                  and m.site.outputs[0].shape == (tiny["E"], capacity, tiny["d"])
                  and any(math.prod(a.shape) == tiny["T"] * tiny["d"] for a in m.site.inputs)]
    # the dispatch einsum's output has that type too; the backward's transpose comes last
    outcome = mutate.check_mutant(max(candidates, key=lambda m: m.site.index), 1)
    assert outcome.status == "declined", outcome.message()
    assert any("derivative" in r for r in outcome.near_misses), outcome.message()


def test_bfloat16_values_carry_a_derivative():
    """bfloat16 is not a numpy inexact type: counted as one, or every bf16 layer's dispatch and combine
    would pass as derivative-free (a soft dispatch rewritten, combine's support check vacuous)."""
    from moe_lowering.passes.derivative_support import tangent_free
    from moe_lowering.passes.graph import build_graph

    graph = build_graph(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(3, jnp.bfloat16)))
    assert not tangent_free(graph, graph.outputs[0])
