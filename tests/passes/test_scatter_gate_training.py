"""Routing weights written by a scatter-set (MaxText's ``zeros.at[b, s, idx].set(w)``), in a forward
and in a training step, where JAX's scatter JVP replaces the primal with an id-scatter, gather,
masks and a scatter-add (``rules_gate._differentiated_scatter_set``).

Rewritten programs are compared with the undecorated ones (outputs and every gradient, float32
tight); mutants of the chain that break its proof must decline with the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from moe_lowering import explain, moe_optimize
from moe_lowering.passes.graph import build_graph

B, S, D, F, E, K = 2, 4, 8, 12, 4, 2


def _gate_by_scatter(x, router, choose=None):
    probs = jax.nn.softmax(x @ router, axis=-1)
    weights, idx = lax.top_k(probs, K)
    if choose is not None:
        idx = choose(probs)
    rows, positions = jnp.arange(B)[:, None, None], jnp.arange(S)[:, None]
    return jnp.zeros((B, S, E), x.dtype).at[rows, positions, idx].set(weights)


def _layer(params, x, choose=None):
    gate = _gate_by_scatter(x, params["router"], choose)
    h = jax.nn.silu(jnp.einsum("bsd,edf->bsef", x, params["w1"])) * jnp.einsum("bsd,edf->bsef", x, params["w3"])
    y = jnp.einsum("bsef,efd->bsed", h, params["w2"])
    return jnp.einsum("bsed,bse->bsd", y, gate)


def _step(layer):
    loss = lambda params, x: jnp.mean(jnp.sin(layer(params, x)) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1))


def _args():
    keys = jax.random.split(jax.random.key(0), 5)
    params = {
        "router": jax.random.normal(keys[0], (D, E)),
        "w1": 0.3 * jax.random.normal(keys[1], (E, D, F)),
        "w3": 0.3 * jax.random.normal(keys[2], (E, D, F)),
        "w2": 0.3 * jax.random.normal(keys[3], (E, F, D)),
    }
    return params, jax.random.normal(keys[4], (B, S, D))


def _assert_close(expected, got, rtol=1e-5):
    for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        want, have = np.asarray(want, np.float64), np.asarray(have, np.float64)
        assert np.max(np.abs(want - have)) <= rtol * max(np.max(np.abs(want)), 1e-30)


def test_forward_scatter_gate_is_rewritten_exactly():
    params, x = _args()
    assert len(explain(_layer, params, x).regions) == 1
    _assert_close(_layer(params, x), moe_optimize(_layer, strict=True)(params, x))


def test_training_step_with_scatter_gate_is_rewritten_forward_and_backward():
    params, x = _args()
    step = _step(_layer)
    report = explain(step, params, x)
    assert len(report.regions) == 1 and report.regions[0].backward, str(report)
    assert "rewritten forward and backward" in str(report)
    rewritten = moe_optimize(step, strict=True)
    expected, got = step(params, x), rewritten(params, x)
    assert np.any(np.asarray(expected[1][0]["router"]) != 0)  # the router's gradient flows through the scatter
    _assert_close(expected, got)
    dense = {(B, S, E, F), (B, S, E, D)}
    assert dense & _shapes(jax.make_jaxpr(step)(params, x).jaxpr)
    assert not dense & _shapes(jax.make_jaxpr(rewritten)(params, x).jaxpr), "a dense [B, S, E, F] value is left"


def _shapes(jaxpr) -> set:
    """Every value's shape in ``jaxpr`` and its sub-jaxprs."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes.update(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    shapes |= _shapes(inner)
    return shapes


def test_possibly_duplicated_indices_decline():
    """``argmax`` twice: a scatter-set keeps one weight per place, a sparse layer would add two."""
    params, x = _args()
    twice = lambda probs: jnp.stack([jnp.argmax(probs, -1)] * K, -1)
    layer = lambda params, x: _layer(params, x, twice)
    for fn in (layer, _step(layer)):
        assert not explain(fn, params, x).regions


def _replaying(closed, mutate):
    """``closed`` re-emitted eqn by eqn with ``bind``; ``mutate(eqn, inputs)`` may return an eqn's
    outputs instead (None keeps it)."""
    graph = build_graph(closed)

    def fn(*args):
        env = dict(zip(graph.inputs, args))
        read = lambda a: env[a] if a in env else a.value
        for eqn in graph.eqns:
            inputs = [read(a) for a in eqn.inputs]
            outputs = mutate(eqn, inputs)
            if outputs is None:
                out = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(eqn.params))
                outputs = list(out) if eqn.primitive.multiple_results else [out]
            env.update(zip(eqn.outputs, outputs))
        return [read(a) for a in graph.outputs]

    return fn


def _is_id_iota(eqn):
    return eqn.primitive is lax.iota_p and eqn.params["dtype"] == jnp.uint32


def _ids_not_an_iota(eqn, inputs):
    return [jnp.zeros(eqn.outputs[0].shape, jnp.uint32)] if _is_id_iota(eqn) else None


def _mask_against_the_ids_themselves(eqn, inputs):
    if eqn.primitive is lax.eq_p and inputs[0].dtype == jnp.uint32 and inputs[0].shape == (B, S, K):
        return [lax.eq(inputs[0], inputs[0])]
    return None


@pytest.mark.parametrize("mutate, reason", [
    (_ids_not_an_iota, "not distinct (not an iota)"),
    (_mask_against_the_ids_themselves, "does not compare ids with ids gathered back"),
])
def test_chain_mutants_decline_with_the_reason(mutate, reason):
    params, x = _args()
    flat = jax.tree.leaves((params, x))
    closed = jax.make_jaxpr(_step(_layer))(params, x)
    replayed = _replaying(closed, lambda eqn, inputs: None)
    assert len(explain(replayed, *flat).regions) == 1  # the replay alone keeps the rewrite
    mutant = _replaying(closed, mutate)
    _assert_close(replayed(*flat), mutant(*flat), rtol=0)  # with top-k indices the mutant computes the same
    report = explain(mutant, *flat)
    assert not report.regions, str(report)
    assert any(reason in miss.reason for miss in report.near_misses), str(report)


@pytest.mark.parametrize("name", ("gpt_oss", "deepseek_v3"))
def test_zoo_scatter_gate_training_steps(name):
    """The zoo's scatter-built gates (GPT-OSS, DeepSeek-V3): their training steps, declined before
    this chain was recognised, are rewritten forward and backward."""
    from moe_lowering.testing import zoo

    model = zoo.ZOO[name].sized(T=8, d=8, f=12, E=4, k=2)
    params, x = model.args(jax.random.key(1))
    step = _step(model.fn)
    report = explain(step, params, x)
    assert len(report.regions) == 1 and report.regions[0].backward, str(report)
    _assert_close(step(params, x), moe_optimize(step, strict=True)(params, x))
