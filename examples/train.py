"""Training with ``moe_optimize``: a small decoder LM (embedding, one causal attention block, an MoE
FFN of 8 SwiGLU experts, top-2) in Flax NNX, trained with optax's Adam for 30 steps on synthetic
data, three ways side by side:

* ``dense``: the model as written (the MoE layer a plain dense-reference jnp function);
* ``layer``: the MoE layer's ``__call__`` decorated with ``moe_optimize``;
* ``step``:  the whole jitted train step (``jax.value_and_grad`` + the optax update) decorated.

Run: ``python examples/train.py [--steps 30]``. Prints each step's loss for the three, checks that
the trajectories agree (float32, relative 1e-5) and says whether each decorated step's lowered
program holds the sparse MoE. About a minute on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import time
import warnings

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moe_lowering import NoMoeFoundWarning, moe_optimize

VOCAB, SEQ, BATCH, D_MODEL, HEADS, D_FF, EXPERTS, TOP_K = 64, 16, 4, 32, 2, 64, 8, 2


def dense_moe(x, router, w_gate, w_up, w_down):
    """Every expert on every token, then the top-2 weighted combine: the readable reference."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    weights, experts = jax.lax.top_k(probs, TOP_K)
    weights = weights / weights.sum(-1, keepdims=True)
    combine = (jax.nn.one_hot(experts, EXPERTS) * weights[..., None]).sum(-2)  # [T, E]
    hidden = jax.nn.silu(jnp.einsum("td,edf->tef", x, w_gate)) * jnp.einsum("td,edf->tef", x, w_up)
    return jnp.einsum("te,ted->td", combine, jnp.einsum("tef,efd->ted", hidden, w_down))


class MoeFFN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        def weight(shape, fan_in):
            return nnx.Param(jax.random.normal(rngs.params(), shape) * fan_in**-0.5)

        self.router = weight((D_MODEL, EXPERTS), D_MODEL)
        self.w_gate = weight((EXPERTS, D_MODEL, D_FF), D_MODEL)
        self.w_up = weight((EXPERTS, D_MODEL, D_FF), D_MODEL)
        self.w_down = weight((EXPERTS, D_FF, D_MODEL), D_FF)

    def __call__(self, x):  # [B, S, D]
        tokens = x.reshape(-1, x.shape[-1])
        out = dense_moe(tokens, self.router[...], self.w_gate[...], self.w_up[...], self.w_down[...])
        return out.reshape(x.shape)


class OptimizedMoeFFN(MoeFFN):
    """The same layer, its call rewritten: the one line a user adds (the ``layer`` placement)."""

    __call__ = moe_optimize(MoeFFN.__call__)


class DecoderLM(nnx.Module):
    def __init__(self, ffn_class, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(D_MODEL, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(HEADS, D_MODEL, decode=False, rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(D_MODEL, rngs=rngs)
        self.ffn = ffn_class(rngs)
        self.head = nnx.Linear(D_MODEL, VOCAB, rngs=rngs)

    def __call__(self, tokens):  # [B, S] -> [B, S, VOCAB]
        h = self.embed(tokens)
        h = h + self.attention(self.attn_norm(h), mask=nnx.make_causal_mask(tokens))
        h = h + self.ffn(self.ffn_norm(h))
        return self.head(h)


def synthetic_batches(steps: int, key):
    """``[steps, BATCH, SEQ + 1]`` tokens following a fixed rule from random starts: learnable."""
    tokens = [jax.random.randint(key, (steps, BATCH), 0, VOCAB)]
    for _ in range(SEQ):
        tokens.append((5 * tokens[-1] + 3) % VOCAB)
    return jnp.stack(tokens, axis=-1)


def make_step(graphdef, tx):
    def train_step(params, opt_state, batch):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params)(batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def setup(ffn_class):
    graphdef, params = nnx.split(DecoderLM(ffn_class, nnx.Rngs(0)))
    tx = optax.adam(3e-3)
    return make_step(graphdef, tx), params, tx.init(params)


def train(step, params, opt_state, batches):
    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    batches = synthetic_batches(args.steps, jax.random.key(1))

    dense_step, params, opt_state = setup(MoeFFN)
    layer_step, _, _ = setup(OptimizedMoeFFN)
    placements = {
        "dense": jax.jit(dense_step),
        "layer": jax.jit(layer_step),
        "step": jax.jit(moe_optimize(dense_step)),
    }
    losses, rewritten = {}, {}
    for name, step in placements.items():
        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NoMoeFoundWarning)
            rewritten[name] = "moe_lowering_sparse_moe" in step.lower(params, opt_state, batches[0]).as_text()
            losses[name] = train(step, params, opt_state, batches)
        declined = [str(w.message) for w in caught if issubclass(w.category, NoMoeFoundWarning)]
        print(f"{name:>5}: {args.steps} steps in {time.perf_counter() - started:.1f} s (compile included); "
              f"sparse MoE in the lowered step: {'yes' if rewritten[name] else 'no'}"
              + (f" ({declined[0][:160]})" if declined else ""))

    print("step   " + "   ".join(f"{name:>9}" for name in placements))
    for i in range(args.steps):
        print(f"{i:4d}   " + "   ".join(f"{losses[name][i]:9.6f}" for name in placements))
    for name in ("layer", "step"):
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses["dense"]))
        print(f"{name}: largest relative loss difference to dense {worst:.2e}")
        assert worst <= 1e-5, f"{name}: the loss trajectory departs from the dense model's ({worst:.2e})"
    assert losses["dense"][-1] < losses["dense"][0], "the model did not learn"
    assert rewritten["layer"], "the decorated layer was not rewritten"


if __name__ == "__main__":
    main()
