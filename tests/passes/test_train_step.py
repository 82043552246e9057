"""Whole training steps: the MoE layer's forward and its own backward, emitted by JAX's autodiff,
rewritten together (``passes/derivative_match.py``), or declined with the use that broke the proof.

Each step is compared with the undecorated step: the loss and every gradient, float32 tight. A
rewritten step must hold no dense ``[T, E, F]`` (or ``[T, E, d]``) value anywhere in its jaxpr.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_lowering import explain, moe_optimize
from moe_lowering.testing import mutate, zoo

SIZES = zoo.Sizes(T=16, d=8, f=12, E=4, k=2)  # every dense intermediate holds T * E * min(d, f) = 512 or more
MIXTRAL = zoo.build_mixtral(SIZES)


def _loss(params, x):
    return jnp.mean(jnp.sin(MIXTRAL.fn(params, x)) ** 2)


def _args(dtype=jnp.float32):
    return MIXTRAL.args(jax.random.key(0), dtype)


def _largest_value(closed, sizes=SIZES) -> int:
    """Elements of the largest value of ``closed`` (its sub-jaxprs included) with a tokens and an
    experts axis: the dense layer's [T, E, F] activations, or their cotangents."""
    largest = 0

    def walk(jaxpr):
        nonlocal largest
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                shape = getattr(var.aval, "shape", ())
                if sizes.T in shape and sizes.E in shape:
                    largest = max(largest, math.prod(shape))
            for param in eqn.params.values():
                for inner in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(inner, "jaxpr", inner)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    return largest


def _dense_elements(sizes=SIZES) -> int:
    return sizes.T * sizes.E * min(sizes.d, sizes.f)


def _assert_close(expected, got, rtol):
    for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        want, have = np.asarray(want, np.float64), np.asarray(have, np.float64)
        scale = max(np.max(np.abs(want)), 1e-30)
        assert np.max(np.abs(want - have)) <= rtol * scale, (want.shape, np.max(np.abs(want - have)) / scale)


def _check_rewritten(step, *args, rtol=1e-5, regions=1, dense=True):
    report = explain(step, *args)
    assert len(report.regions) == regions, str(report)
    assert all(r.backward for r in report.regions), str(report)
    assert "rewritten forward and backward" in str(report)
    rewritten = moe_optimize(step, strict=True)
    _assert_close(step(*args), rewritten(*args), rtol)
    assert _largest_value(jax.make_jaxpr(rewritten)(*args)) < _dense_elements(), "a dense [T, E, F] value is left"
    if dense:  # the check can fail
        assert _largest_value(jax.make_jaxpr(step)(*args)) >= _dense_elements()
    return report


def test_value_and_grad_of_a_plain_loss():
    params, x = _args()

    def step(params, x):
        return jax.value_and_grad(_loss, argnums=(0, 1))(params, x)

    _check_rewritten(step, params, x)


def test_grad_of_the_weights_only_under_jit():
    params, x = _args()
    _check_rewritten(jax.jit(jax.grad(_loss)), params, x)


def _relative_error(exact, got) -> float:
    exact, got = np.asarray(exact, np.float64), np.asarray(got, np.float64)
    return float(np.linalg.norm(exact - got) / max(np.linalg.norm(exact), 1e-30))


# zoo layers whose training step is rewritten whole (forward and backward) on a CPU in a few seconds each
STEP_REWRITTEN = ("mixtral_logits_topk", "mlp_relu_bias", "mlp_squared_relu", "hf_loop", "gather_combine",
                  "gathered_weights", "separate_experts")


@pytest.mark.parametrize("name", STEP_REWRITTEN)
def test_zoo_layers_training_steps(name):
    model = zoo.ZOO[name].sized(T=SIZES.T, d=SIZES.d, f=SIZES.f, E=SIZES.E, k=SIZES.k)
    params, x = model.args(jax.random.key(1))

    def step(params, x):
        return jax.value_and_grad(lambda p, x: jnp.mean(jnp.sin(model.fn(p, x)) ** 2), argnums=(0, 1))(params, x)

    # the loop computes one expert at a time; EasyDeL's style gathers [T, k, d, f] weight copies instead
    _check_rewritten(step, params, x, dense=name not in ("hf_loop", "gathered_weights"))


def test_bfloat16_step_as_close_to_float32_as_the_dense_step():
    """bf16 against the float32 step on the same values: within 2e-2, or no worse than the dense bf16
    step; and as close to the step with the layer itself decorated (two bf16 roundings of one sum, in
    different orders: a few bf16 ulps apart on small gradients)."""
    params, x = _args(jnp.bfloat16)

    def step(params, x):
        return jax.value_and_grad(_loss, argnums=(0, 1))(params, x)

    def layer_step(params, x):
        loss = lambda p, x: jnp.mean(jnp.sin(moe_optimize(MIXTRAL.fn)(p, x)) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    assert explain(step, params, x).regions[0].backward
    exact = step(*jax.tree.map(lambda a: a.astype(jnp.float32), (params, x)))
    dense, rewritten, layer = step(params, x), moe_optimize(step, strict=True)(params, x), layer_step(params, x)
    for want, base, got, by_layer in zip(*map(jax.tree.leaves, (exact, dense, rewritten, layer)), strict=True):
        assert got.dtype == base.dtype
        bound = max(2e-2, 2 * _relative_error(want, base))
        assert _relative_error(want, got) < bound
        assert _relative_error(by_layer, got) < bound


def test_two_layers_sharing_weights_sum_their_cotangents():
    params, x = _args()

    def loss(params, x):
        return jnp.mean(MIXTRAL.fn(params, jnp.tanh(MIXTRAL.fn(params, x))) ** 2)

    _check_rewritten(jax.jit(jax.grad(loss, argnums=(0, 1))), params, x, regions=2)


def test_forward_mode_declines_with_the_use_and_its_location():
    params, x = _args()

    def step(params, x):
        return jax.jvp(lambda x: MIXTRAL.fn(params, x), (x,), (x,))

    report = explain(step, params, x)
    assert not report.regions
    [miss] = report.near_misses
    assert "not an op of the layer's reverse-mode derivative" in miss.reason
    assert "zoo.py:" in miss.reason and "zoo.py:" in miss.location  # the use, placed in the source


# --------------------------------------------------------------------------- mutants of training steps

TRAIN_MUTANTS_PER_KIND = int(os.environ.get("MOE_TRAIN_MUTANTS_PER_KIND", "10"))
TRAIN_MUTATION_SEED = int(os.environ.get("MOE_MUTATION_SEED", "0"))  # each CI entry its own mutants
TRAIN_KINDS = ("scale", "swap_operands", "substitute", "extra_use", "constant", "replace_op")
STEP_OF_KINDS = ("stop_gradient", "scale", "apply_twice", "extra_use")
TRAIN_CASES = [(f"{mutate.TRAIN_STEP}{model}", kind) for model in ("mixtral", "mlp_gelu") for kind in TRAIN_KINDS] + [
    (f"{mutate.STEP_OF}{model}", kind) for model in ("mixtral", "mlp_gelu") for kind in STEP_OF_KINDS]


@pytest.mark.mutation
@pytest.mark.parametrize("context, kind", TRAIN_CASES)
def test_training_step_mutants_are_declined_or_rewritten_exactly(context, kind):
    """``train-<model>``: the traced step mutated anywhere, its backward included (a cotangent scaled, a
    transpose given the wrong operand, an interior value read once more); ``step-<model>``: the step of
    a mutated layer (a stop_gradient on one path). 20 cases x 10 = 200 mutants (CI: 5 per case, 100),
    2.5 s each on average on a shared 2-core CPU (rewritten ones ~3 s, declined ones 0.1 s)."""
    assert_mutants_declined_or_exact(context, kind, TRAIN_MUTANTS_PER_KIND)


def assert_mutants_declined_or_exact(context: str, kind: str, count: int):
    """``count`` mutants of ``kind`` in ``context`` (``TRAIN_MUTATION_SEED``): each declined, or rewritten and
    exact (``mutate.check_mutant``)."""
    mutants = mutate.sample(context, kind, count, TRAIN_MUTATION_SEED)
    assert mutants, f"{context} has no site for {kind}"
    outcomes = [mutate.check_mutant(m, 1) for m in mutants]
    bad = [o for o in outcomes if o.status in ("wrong", "crashed", "invalid")]
    assert not bad, "\n\n".join(o.message() for o in bad)


def test_a_scaled_cotangent_in_the_layers_backward_declines():
    """The derivative's own ops, changed: x2 on the gate's cotangent is no longer jax.vjp of the layer."""
    mutant = next(m for m in mutate.candidates(f"{mutate.TRAIN_STEP}mixtral", "scale")
                  if m[0].site.primitive is jax.lax.dot_general_p and len(m[0].site.inputs[1].shape) == 3
                  and m[0].site.outputs[0].shape == (mutate.TINY["T"], mutate.TINY["E"]))[0]
    outcome = mutate.check_mutant(mutant, 1)
    assert outcome.status == "declined", outcome.message()
    assert any("private-interior" in r or "derivative" in r for r in outcome.near_misses), outcome.message()


def follows_the_dense_trajectory(loss_fn, params, x, steps: int):
    """A jitted step with the optax update after the gradient, decorated whole: the same losses and
    parameters for ``steps`` steps (float32), with the layer's forward and backward rewritten."""
    import optax

    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    assert explain(step, params, optimizer.init(params), x).regions[0].backward
    fast = moe_optimize(step, strict=True)
    dense_state = sparse_state = (params, optimizer.init(params))
    for _ in range(steps):
        *dense_state, dense_loss = step(*dense_state, x)
        *sparse_state, sparse_loss = fast(*sparse_state, x)
        np.testing.assert_allclose(sparse_loss, dense_loss, rtol=1e-5)
    _assert_close(dense_state[0], sparse_state[0], 1e-5)


def test_optax_training_loop_follows_the_dense_trajectory():
    follows_the_dense_trajectory(_loss, *_args(), steps=4)


def test_what_still_declines_says_why():
    """Second-order programs' derivatives are left dense, with the reason (capacity layers' steps are
    rewritten: test_train_step_capacity.py; jax.checkpoint's recomputing backward too:
    test_train_step_remat.py)."""
    params, x = _args()
    switch = zoo.ZOO["switch"].sized(T=SIZES.T, d=SIZES.d, f=SIZES.f, E=SIZES.E)
    sparams, sx = switch.args(jax.random.key(1))
    report = explain(jax.grad(lambda p, x: jnp.sum(switch.fn(p, x) ** 2)), sparams, sx)
    assert not report.near_misses and report.regions[0].backward, str(report)

    second_order = jax.grad(lambda x: jnp.sum(jax.grad(_loss, argnums=1)(params, x) ** 2))
    report = explain(second_order, x)
    assert not report.regions and "reverse-mode derivative" in report.near_misses[0].reason


def test_the_same_layer_twice_on_the_same_tokens_shares_out_its_sums():
    """Two regions with the same operands and the same output cotangent: each region's terms of the
    weights' gradient sums are keyed alike, and each must be counted once."""
    params, x = _args()

    def step(params, x):
        loss = lambda p, x: jnp.mean(jnp.sin(MIXTRAL.fn(p, x) + MIXTRAL.fn(p, x)) ** 2)  # noqa: E731
        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    _check_rewritten(step, params, x, regions=2)


def test_jit_outside_the_decorated_step():
    params, x = _args()
    step = jax.value_and_grad(_loss, argnums=(0, 1))
    outer = jax.jit(moe_optimize(step, strict=True))
    _assert_close(step(params, x), outer(params, x), 1e-5)
    assert _largest_value(jax.make_jaxpr(outer)(params, x)) < _dense_elements()


@pytest.mark.parametrize(("name", "frozen"), [("deepseek_v3", ("router",)), ("mixtral", ("w_up", "w_down"))])
def test_frozen_router_or_experts_under_stop_gradient(name, frozen):
    """Fine-tuning with part of the layer frozen: a weight under ``stop_gradient`` has no tangent, and
    autodiff then leaves out ops the reference would hold (DeepSeek's gate cotangent through its
    normalised weights); the proof closes over operands without a derivative instead."""
    model = zoo.ZOO[name].sized(T=SIZES.T, d=SIZES.d, f=SIZES.f, E=SIZES.E, k=SIZES.k)
    params, x = model.args(jax.random.key(2))

    def loss(p, x):
        p = {key: jax.lax.stop_gradient(v) if key in frozen else v for key, v in p.items()}
        return jnp.mean(jnp.sin(model.fn(p, x)) ** 2)

    grads = _check_rewritten(jax.jit(jax.value_and_grad(loss)), params, x)
    assert grads.regions[0].backward
    fast = moe_optimize(jax.jit(jax.grad(loss)))(params, x)
    assert all(not np.any(fast[key]) for key in frozen)  # a frozen weight's gradient stays exactly zero
