"""Hand-built expert programs (from real jaxpr eqns) and the dense reference they must match."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_lowering.expert_program import (
    Elementwise,
    ExpertMatmul,
    ExpertProgram,
    ParamKind,
    ParamRef,
    RowInput,
    topological_nodes,
)


def _eqn(fn, *args):
    eqn = jax.make_jaxpr(fn)(*args).eqns[0]
    return eqn.primitive, tuple(sorted(eqn.params.items()))


def swiglu_program(*, expert_bias: bool = False, token_scale: bool = False) -> ExpertProgram:
    """``(silu(x @ w1 [+ b1[e]]) * (x @ w3) [* s[t]]) @ w2``, params ``w1, w3, w2[, b1][, s]``."""
    x = jnp.ones((2, 3), jnp.float32)
    logistic = _eqn(jax.lax.logistic, x)
    mul = _eqn(jax.lax.mul, x, x)
    add = _eqn(jax.lax.add, x, x)
    kinds = [ParamKind.EXPERT_WEIGHT] * 3
    rows = RowInput()
    h1 = ExpertMatmul(rows, 0)
    if expert_bias:
        kinds.append(ParamKind.PER_EXPERT)
        h1 = Elementwise(add[0], add[1], (h1, ParamRef(len(kinds) - 1)))
    h3 = ExpertMatmul(rows, 1)
    silu = Elementwise(mul[0], mul[1], (h1, Elementwise(logistic[0], logistic[1], (h1,))))
    hidden = Elementwise(mul[0], mul[1], (silu, h3))
    if token_scale:
        kinds.append(ParamKind.PER_TOKEN)
        hidden = Elementwise(mul[0], mul[1], (hidden, ParamRef(len(kinds) - 1)))
    out = ExpertMatmul(hidden, 2)
    return ExpertProgram(output=out, param_kinds=tuple(kinds), nodes=topological_nodes(out))


def dense_reference(tokens, expert_indices, expert_weights, params, *, num_experts, expert_bias=False,
                    token_scale=False):
    """Every expert on every token, combined with a one-hot gate: the semantics to match."""
    w1, w3, w2, *rest = params
    rest = list(rest)
    h1 = jnp.einsum("td,edf->tef", tokens, w1, preferred_element_type=jnp.float32)
    if expert_bias:
        h1 = h1 + rest.pop(0)[None]
    hidden = jax.nn.silu(h1) * jnp.einsum("td,edf->tef", tokens, w3, preferred_element_type=jnp.float32)
    if token_scale:
        hidden = hidden * rest.pop(0)[:, None, :]
    y = jnp.einsum("tef,efd->ted", hidden.astype(tokens.dtype), w2, preferred_element_type=jnp.float32)
    valid = (expert_indices >= 0) & (expert_indices < num_experts)
    gate = jnp.einsum("tk,tke->te", jnp.where(valid, expert_weights, 0).astype(jnp.float32),
                      jax.nn.one_hot(expert_indices, num_experts, dtype=jnp.float32))
    return jnp.einsum("te,ted->td", gate, y).astype(tokens.dtype)


def random_case(seed, *, num_tokens, d_model, d_ff, num_experts, top_k, dtype=jnp.float32, expert_bias=False,
                token_scale=False, skew_to=None):
    """Random tokens, distinct top-k routing, softmax weights and expert params (never zeros)."""
    rng = np.random.default_rng(seed)
    tokens = rng.standard_normal((num_tokens, d_model)).astype(np.float32)
    logits = rng.standard_normal((num_tokens, num_experts))
    indices = np.argsort(-logits, axis=1)[:, :top_k].astype(np.int32)
    if skew_to is not None:
        indices[:, 0] = skew_to
        indices[:, 1:] = (skew_to + 1 + np.arange(top_k - 1)) % num_experts
    weights = np.exp(rng.standard_normal((num_tokens, top_k)))
    weights = (weights / weights.sum(1, keepdims=True)).astype(np.float32)
    scale = 1.0 / np.sqrt(d_model)
    params = [
        rng.standard_normal((num_experts, d_model, d_ff)) * scale,
        rng.standard_normal((num_experts, d_model, d_ff)) * scale,
        rng.standard_normal((num_experts, d_ff, d_model)) / np.sqrt(d_ff),
    ]
    if expert_bias:
        params.append(rng.standard_normal((num_experts, d_ff)) * 0.1)
    if token_scale:
        params.append(1.0 + 0.5 * rng.standard_normal((num_tokens, 1)))
    params = [jnp.asarray(p, dtype) for p in params]
    return jnp.asarray(tokens, dtype), jnp.asarray(indices), jnp.asarray(weights, dtype), params


def random_peer_routes(rng, *, ranks, slots, recv_rows, packed=False):
    """Random peer-store slots per rank: ``(source_row, dest_device, dest_row)``, each ``[ranks, slots]``.

    A slot reads a random source row and names a random rank (``-1``: none) and a row there, unique
    per destination rank; ``packed`` numbers each rank's arrivals ``0, 1, ...`` instead.
    """
    source_row = rng.integers(0, slots, size=(ranks, slots)).astype(np.int32)
    dest_device = rng.integers(-1, ranks, size=(ranks, slots)).astype(np.int32)
    dest_row = np.zeros((ranks, slots), np.int32)
    for rank in range(ranks):
        mine = np.argwhere(dest_device == rank)
        rows = np.arange(len(mine)) if packed else rng.permutation(recv_rows)[: len(mine)]
        dest_row[tuple(mine.T)] = rows
    return source_row, dest_device, dest_row
