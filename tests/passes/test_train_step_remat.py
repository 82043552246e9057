"""Training steps under ``jax.checkpoint``: the backward recomputes the layer's dense forward inside
its remat body; the remat is inlined and the recomputation merged with the forward, so the layer's
forward and backward are rewritten as in a plain step (``rewrite.analyse_program``).

Each step is compared with the undecorated step: the loss and every gradient, float32 tight, and
no dense ``[T, E, F]`` value may be left in the rewritten jaxpr.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from moe_lowering import explain, moe_optimize
from test_train_step import MIXTRAL, _assert_close, _check_rewritten


def _remat_step(policy):
    layer = jax.checkpoint(MIXTRAL.fn, policy=policy)
    return jax.value_and_grad(lambda p, x: jnp.mean(jnp.sin(layer(p, x)) ** 2), argnums=(0, 1))


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable],
                         ids=["no_policy", "nothing_saveable"])
def test_value_and_grad_under_checkpoint_rewrites_the_recomputing_backward(policy):
    params, x = MIXTRAL.args(jax.random.key(0))
    report = _check_rewritten(_remat_step(policy), params, x)
    assert report.regions[0].remat_inlined and "jax.checkpoint inlined" in str(report)


def test_the_step_under_jit_and_checkpoint():
    params, x = MIXTRAL.args(jax.random.key(2))
    _check_rewritten(jax.jit(_remat_step(None)), params, x)


def test_two_checkpointed_residual_blocks_sharing_weights():
    """MaxText's shape: each block (a norm, the layer, a residual add) under its own jax.checkpoint."""
    params, x = MIXTRAL.args(jax.random.key(3))

    def block(p, x):
        return x + MIXTRAL.fn(p, jnp.tanh(x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)))

    def loss(p, x):
        return jnp.mean(jnp.sin(jax.checkpoint(block)(p, jax.checkpoint(block)(p, x))) ** 2)

    report = _check_rewritten(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x, regions=2)
    assert all(r.remat_inlined for r in report.regions)


def test_a_remat_that_saves_the_dots_is_declined_with_its_reason():
    """dots_saveable returns the expert projections from the forward's remat as residuals: an interior
    value used outside the layer, so the backward stays dense (the forward is not rewritten either)."""
    params, x = MIXTRAL.args(jax.random.key(0))
    step = _remat_step(jax.checkpoint_policies.dots_saveable)
    report = explain(step, params, x)
    assert not any(r.backward for r in report.regions)
    assert any("used outside it" in m.reason for m in report.near_misses), str(report)
    _assert_close(step(params, x), moe_optimize(step)(params, x), 1e-5)


def test_a_plain_step_is_not_marked_inlined():
    params, x = MIXTRAL.args(jax.random.key(0))
    [region] = explain(jax.value_and_grad(lambda p, x: jnp.mean(MIXTRAL.fn(p, x) ** 2)), params, x).regions
    assert region.backward and not region.remat_inlined


def test_checkpointed_blocks_with_sharding_constraints_under_a_mesh():
    """MaxText's decoder layer: under a mesh, the block's tokens are constrained before the layer and the
    layer's hidden values after its projections, inside a remat. Autodiff places the constraints'
    transposes (and ``full_like``'s reshard of silu's ``1 - y``) differently in the recomputing backward
    than in the reference VJP; the proof keys them as the values they constrain."""
    params, x = MIXTRAL.args(jax.random.key(4))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def block(p, x):
        h = jax.lax.with_sharding_constraint(x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6), replicated)
        return x + jax.lax.with_sharding_constraint(MIXTRAL.fn(p, h), replicated)

    def loss(p, x):
        return jnp.mean(jnp.sin(jax.checkpoint(block)(p, jax.checkpoint(block)(p, x))) ** 2)

    set_mesh = jax.set_mesh if hasattr(jax, "set_mesh") else jax.sharding.use_mesh
    with set_mesh(mesh):
        report = _check_rewritten(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x, regions=2)
    assert all(r.remat_inlined for r in report.regions)
