"""Training steps over experts kept as E separate weight arrays (a Flax/HF module list after tracing:
per-expert dicts in a list). The sparse layer reads their stacked copy; its VJP splits the stacked
weight's cotangent back into each array's, so the step is rewritten forward and backward.

Each step is compared with the undecorated step: the loss and the gradient of every input (every
separate array, the router, the tokens), float32 tight, and no dense ``[T, E, F]`` value nor a
per-expert activation of every token may be left.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from test_train_step import SIZES, _assert_close, _check_rewritten

from moe_lowering import explain, moe_optimize

NAMES = ("w_gate", "w_up", "w_down")


def _params(key):
    keys = jax.random.split(key, 3 * SIZES.E + 2)
    shapes = {"w_gate": (SIZES.d, SIZES.f), "w_up": (SIZES.d, SIZES.f), "w_down": (SIZES.f, SIZES.d)}
    experts = [{name: jax.random.normal(keys[3 * e + i], shapes[name]) / 3 for i, name in enumerate(NAMES)}
               for e in range(SIZES.E)]
    router = jax.random.normal(keys[-2], (SIZES.d, SIZES.E))
    return {"router": router, "experts": experts}, jax.random.normal(keys[-1], (SIZES.T, SIZES.d))


def _layer(module_of=lambda e: e, stack_order=None, w_up_of=lambda e: e, one_hot=False):
    """``outs = [experts[module_of(e)](x) for e]``, stacked (``outs[stack_order[e]]`` at position e: the
    router's expert e) and gathered per choice (``one_hot``: combined by a ``[T, E]`` gate instead)."""

    def layer(params, x):
        weights, index = lax.top_k(jax.nn.softmax(x @ params["router"]), SIZES.k)
        experts = params["experts"]

        def expert(e):
            own = experts[module_of(e)]
            up = experts[module_of(w_up_of(e))]["w_up"]
            return (jax.nn.silu(x @ own["w_gate"]) * (x @ up)) @ own["w_down"]

        outs = [expert(e) for e in range(SIZES.E)]
        order = stack_order or range(SIZES.E)
        stacked = jnp.stack([outs[e] for e in order])
        if one_hot:
            gate = (jax.nn.one_hot(index, SIZES.E) * weights[..., None]).sum(1)
            return jnp.einsum("te,etd->td", gate, stacked)
        return jnp.sum(stacked[index, jnp.arange(SIZES.T)[:, None], :] * weights[..., None], axis=1)

    return layer


def _step(layer, outside=lambda params: 0.0):
    def loss(params, x):
        return jnp.mean(jnp.sin(layer(params, x)) ** 2) + outside(params)

    return lambda params, x: jax.value_and_grad(loss, argnums=(0, 1))(params, x)


def _full_token_activations(step, params, x) -> int:
    """Values of one expert's activations on every token ([T, F]) in ``step``'s jaxpr."""
    count = 0

    def walk(jaxpr):
        nonlocal count
        for eqn in jaxpr.eqns:
            count += sum(getattr(v.aval, "shape", ()) == (SIZES.T, SIZES.f) for v in eqn.outvars)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(step)(params, x).jaxpr)
    return count


@pytest.mark.parametrize("module_of, stack_order, one_hot", [
    (lambda e: e, None, False),
    (lambda e: (e + 1) % SIZES.E, None, False),
    (lambda e: e, [3, 1, 0, 2], False),
    (lambda e: e, [2, 0, 3, 1], True),
], ids=["in-order", "modules-listed-out-of-order", "stacked-out-of-order", "one-hot-gate"])
def test_separate_arrays_step_rewritten_forward_and_backward(module_of, stack_order, one_hot):
    """Every array's gradient is its expert's slice of the stacked weight's, whichever module list
    position or stack position expert e's arrays hold."""
    params, x = _params(jax.random.key(0))
    step = _step(_layer(module_of, stack_order, one_hot=one_hot))
    report = _check_rewritten(step, params, x)
    assert report.regions[0].style == "separate expert weights"
    assert _full_token_activations(step, params, x) > 0  # the check can fail
    assert _full_token_activations(moe_optimize(step, strict=True), params, x) == 0


def test_an_array_also_read_outside_the_layer_gets_both_gradients():
    """Expert 2's down-projection is also in a weight penalty: its gradient is the layer's slice plus
    the penalty's."""
    params, x = _params(jax.random.key(1))
    step = _step(_layer(), outside=lambda p: 0.1 * jnp.sum(p["experts"][2]["w_down"] ** 2))
    _check_rewritten(step, params, x)


def test_one_array_read_by_two_experts_declines_or_stays_exact():
    """Experts 0 and 1 read the same up-projection (a module list holding one array twice): the
    array's gradient is the sum of both experts' slices, never one of them."""
    params, x = _params(jax.random.key(2))
    for step in (_step(_layer(w_up_of=lambda e: 0 if e == 1 else e)),
                 _step(_layer(module_of=lambda e: 0 if e == 1 else e))):
        if explain(step, params, x).regions:
            _assert_close(step(params, x), moe_optimize(step)(params, x), 1e-5)
