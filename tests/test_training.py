"""Training end to end (issue 33): a tiny decoder LM with an MoE FFN (the zoo's Mixtral layer),
in Flax NNX and in Linen, trained 20 steps with optax's Adam, with ``moe_optimize`` placed where
users place it: on the layer, on Linen's ``model.apply``, on the whole train step (value_and_grad
and the optimizer update). Each decorated step's lowered program holds the sparse MoE, and its
loss trajectory equals the undecorated step's (float32, relative 1e-5)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_lowering import explain, moe_optimize
from moe_lowering.testing.zoo import ZOO

optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")

MOE = ZOO["mixtral"].sized(T=16, d=8, f=16, E=4, k=2)
VOCAB, SEQ, BATCH, HEADS, STEPS = 32, 8, 2, 2, 20
D = MOE.sizes.d


def _moe_tokens(params, x):
    """The MoE layer on ``[B, S, D]`` activations: the zoo's layer on the flattened tokens."""
    return MOE.fn(params, x.reshape(-1, D)).reshape(x.shape)


def _batches():
    """``[STEPS, BATCH, SEQ + 1]`` tokens of a fixed rule from random starts: a learnable sequence."""
    tokens = [jax.random.randint(jax.random.key(1), (STEPS, BATCH), 0, VOCAB)]
    for _ in range(SEQ):
        tokens.append((5 * tokens[-1] + 3) % VOCAB)
    return jnp.stack(tokens, axis=-1)


# --- Flax NNX --------------------------------------------------------------------------------------

class NnxMoe(nnx.Module):
    def __init__(self, rngs):
        for name, value in MOE.make_params(rngs.params()).items():
            setattr(self, name, nnx.Param(value))

    def __call__(self, x):
        return _moe_tokens({name: getattr(self, name)[...] for name in ("router", "w_gate", "w_up", "w_down")}, x)


class NnxMoeDecorated(NnxMoe):
    __call__ = moe_optimize(NnxMoe.__call__)


class NnxLM(nnx.Module):
    def __init__(self, moe_class, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.moe = moe_class(rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        h = h + self.attention(h, mask=nnx.make_causal_mask(tokens))
        return self.head(h + self.moe(self.norm(h)))


def _nnx_forward(placement):
    graphdef, params = nnx.split(NnxLM(NnxMoeDecorated if placement == "layer" else NnxMoe, nnx.Rngs(0)))
    return (lambda params, tokens: nnx.merge(graphdef, params)(tokens)), params


# --- Flax Linen ------------------------------------------------------------------------------------

def _linen_moe(module, x):
    params = {name: module.param(name, lambda key, shape=spec.shape: MOE.make_params(key)[name], None)
              for name, spec in MOE.make_params(jax.random.key(0)).items()}
    return _moe_tokens(params, x)


class LinenMoe(linen.Module):
    @linen.compact
    def __call__(self, x):
        return _linen_moe(self, x)


class LinenMoeDecorated(linen.Module):
    @moe_optimize
    @linen.compact
    def __call__(self, x):
        return _linen_moe(self, x)


class LinenLM(linen.Module):
    moe_class: type

    @linen.compact
    def __call__(self, tokens):
        h = linen.Embed(VOCAB, D)(tokens)
        h = h + linen.SelfAttention(num_heads=HEADS, qkv_features=D)(h, mask=linen.make_causal_mask(tokens))
        return linen.Dense(VOCAB)(h + self.moe_class(name="moe")(linen.RMSNorm()(h)))


def _linen_forward(placement):
    reference = LinenLM(LinenMoe)
    model = LinenLM(LinenMoeDecorated if placement == "layer" else LinenMoe)
    params = reference.init(jax.random.key(0), jnp.zeros((BATCH, SEQ), jnp.int32))["params"]
    apply = moe_optimize(model.apply) if placement == "apply" else model.apply
    return (lambda params, tokens: apply({"params": params}, tokens)), params


# --- the train step ----------------------------------------------------------------------------------

def _train_step(forward, tx):
    def train_step(params, opt_state, batch):
        def loss_fn(params):
            logits = forward(params, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def _train(framework: str, placement: str):
    """``(losses, lowered step text)`` of 20 steps with ``moe_optimize`` at ``placement``."""
    forward, params = {"nnx": _nnx_forward, "linen": _linen_forward}[framework](placement)
    tx = optax.adam(3e-3)
    step = _train_step(forward, tx)
    step = jax.jit(moe_optimize(step) if placement == "step" else step)
    opt_state, batches = tx.init(params), _batches()
    lowered = step.lower(params, opt_state, batches[0]).as_text()
    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return np.array(losses), lowered


@functools.cache
def _reference_losses(framework: str):
    return _train(framework, "dense")[0]


@pytest.mark.parametrize("framework,placement", [
    ("nnx", "layer"), ("nnx", "step"), ("linen", "layer"), ("linen", "apply"), ("linen", "step"),
])
def test_decorated_training_follows_the_dense_loss(framework, placement):
    losses, lowered = _train(framework, placement)
    assert "moe_lowering_sparse_moe" in lowered, f"{framework}/{placement}: the step was not rewritten"
    reference = _reference_losses(framework)
    assert reference[-1] < 0.9 * reference[0]  # it learns: the trajectory says something
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


def _nnx_optimizer_losses(decorate: bool):
    """20 steps of the NNX idiom: ``nnx.jit`` of a step that mutates the model and an ``nnx.Optimizer``."""
    import inspect

    model = NnxLM(NnxMoe, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    takes_model = len(inspect.signature(optimizer.update).parameters) > 1  # Flax >= 0.11: update(model, grads)

    def train_step(model, optimizer, batch):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(batch[:, :-1]), batch[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(*((model, grads) if takes_model else (grads,)))
        return loss

    step = moe_optimize(train_step) if decorate else train_step
    batches = _batches()
    regions = len(explain(step, model, optimizer, batches[0]).regions) if decorate else 0
    jitted = nnx.jit(step)
    return np.array([float(jitted(model, optimizer, batch)) for batch in batches]), regions


def test_nnx_jit_step_with_an_optimizer_carries_the_updates():
    """The whole ``nnx.jit`` step decorated: the parameter and optimizer-state writes it makes to its
    NNX arguments come out of the rewritten program, so training follows the undecorated step."""
    losses, regions = _nnx_optimizer_losses(decorate=True)
    reference, _ = _nnx_optimizer_losses(decorate=False)
    assert regions == 1
    assert reference[-1] < 0.9 * reference[0]
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
