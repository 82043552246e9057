"""Token axes merged or split by a reshape (``abstract.reshaped_roles``): layers that route on ``[B, S, d]``
tokens and reshape the indices, weights, chosen copies or expert outputs to ``[B * S, ..]`` and back, as
Grok-1, bonsai's Gemma 4 and GPT-OSS and DeepMind's Gemma 4 ship them; and the near misses that must
not be read so: a merge of transposed token axes, token axes mixed with the choices, a split then permuted.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from moe_lowering import explain
from moe_lowering.passes.abstract import CHOICE, COPY, FEATURE, ONE, reshaped_roles, token_parts

from test_soundness import declined_because, rewritten_exactly

D, F, E, K = 8, 16, 4, 2


def _args(key, shape=(2, 4)):
    k = jax.random.split(key, 4)
    params = {"router": jax.random.normal(k[0], (D, E)), "w_up": jax.random.normal(k[1], (E, D, F)) / np.sqrt(D),
              "w_down": jax.random.normal(k[2], (E, F, D)) / np.sqrt(F)}
    return params, jax.random.normal(k[3], shape + (D,))


def _gathered(index_of=lambda i: i.reshape(-1, K)):
    """bonsai's ``Gemma4RoutedExperts``: the router on ``[B, S, d]``, ``topk_indices.reshape(B * S, K)``
    (and the weights), each choice's expert weights gathered for the flattened tokens."""

    def layer(p, x):
        w, idx = lax.top_k(jax.nn.softmax(x @ p["router"]), K)
        xf = x.reshape(-1, D)
        idx, w = index_of(idx), w.reshape(-1, K)
        h = jax.nn.gelu(jnp.einsum("td,tkdf->tkf", xf, jnp.take(p["w_up"], idx, axis=0)))
        out = jnp.einsum("tkf,tkfd->tkd", h, jnp.take(p["w_down"], idx, axis=0))
        return jnp.sum(out * w[..., None], axis=1).reshape(x.shape)

    return layer


def _untiled(out, gate, b, s):
    """Grok-1's un-tiling: ``[T * k, d]`` copies as ``[B, S, k, d]``, times the ``[B, S, k]`` gate, summed over k."""
    return jnp.sum(gate.reshape(b, s, K)[..., None] * out.reshape(b, s, K, D), axis=2)


def _tiled(router_on_tokens=False, flat_index=lambda i: i.reshape(-1), untile=_untiled):
    """Grok-1's ``MoELayer``: tokens tiled per choice, every expert on every copy, each copy's own expert kept
    by a one-hot of ``index.reshape(-1)``, the copies un-tiled (``untile(out, gate, B, S)``). The router on
    ``[B, S, d]``, or with ``router_on_tokens`` on ``x.reshape(B * S, d)``."""

    def layer(p, x):
        xf = x.reshape(-1, D)
        gate, idx = lax.top_k(jax.nn.softmax((xf if router_on_tokens else x) @ p["router"]), K)
        one_hot = jax.nn.one_hot(flat_index(idx), E, axis=0)
        select = lambda h: jnp.einsum("bm,bmn->mn", one_hot, h)  # noqa: E731
        copies = jnp.tile(xf[:, None, :], (1, K, 1)).reshape(-1, D)
        h = jax.nn.gelu(select(jnp.einsum("mk,bkn->bmn", copies, p["w_up"])))
        return untile(select(jnp.einsum("mk,bkn->bmn", h, p["w_down"])), gate, *x.shape[:2])

    return layer


def _combined_over_experts(split_outputs=lambda out, b, s: out.reshape(E, b, s, D),
                           split_scores=lambda scores, b, s: scores.T.reshape(E, b, s)):
    """bonsai's GPT-OSS combine: every expert on the flattened tokens, ``[E, T, d]`` outputs reshaped to
    ``[E, B, S, d]``, weighted by ``router_scores.T.reshape(E, B, S)`` and summed over the experts."""

    def layer(p, x):
        xf = x.reshape(-1, D)
        v, i = lax.top_k(xf @ p["router"], K)
        scores = jnp.sum(jax.nn.one_hot(i, E) * jax.nn.softmax(v)[..., None], axis=1)
        out = jnp.einsum("end,edh->enh", jax.nn.gelu(jnp.einsum("nh,ehd->end", xf, p["w_up"])), p["w_down"])
        return jnp.sum(split_outputs(out, *x.shape[:2]) * split_scores(scores, *x.shape[:2])[..., None], axis=0)

    return layer


def _rows_on_unmerged_tokens(p, x):
    """Every expert on the ``[B, S, d]`` tokens, combined with a gate whose token axes were merged first."""
    w, idx = lax.top_k(jax.nn.softmax(x @ p["router"]), K)
    gate = jnp.sum(jax.nn.one_hot(idx, E) * w[..., None], axis=-2).reshape(-1, E)
    out = jnp.einsum("bsef,efd->bsed", jax.nn.gelu(jnp.einsum("bsd,edf->bsef", x, p["w_up"])), p["w_down"])
    return jnp.einsum("te,ted->td", gate, out.reshape(-1, E, D))


@pytest.mark.parametrize("layer, style", [
    (_gathered(), "gathered weights"),
    (_tiled(), "tokens tiled per choice"),
    (_combined_over_experts(), "one-hot gate"),
], ids=["index-merged-gathered", "index-raveled-copies-untiled", "expert-outputs-split"])
def test_token_axes_merged_or_split_in_order_are_rewritten(layer, style):
    """The router's ``[B, S]`` token axes merged for the indices (``[B*S, k]``, ``[B*S*k]``), the chosen copies
    split back to ``[B, S, k, d]``, the experts' ``[E, T, d]`` outputs split to ``[E, B, S, d]``: each the
    same tokens row-major, as ``x.reshape(B * S, d)`` has them."""
    params, x = _args(jax.random.key(60))
    assert rewritten_exactly(layer, params, x)
    assert explain(layer, params, x).regions[0].style == style


@pytest.mark.parametrize("layer, reason", [
    (_gathered(index_of=lambda i: i.swapaxes(0, 1).reshape(-1, K)), "neither merges or splits their token axes"),
    (_tiled(flat_index=lambda i: i.transpose(2, 0, 1).reshape(-1)), "neither merges or splits their token axes"),
    (_tiled(untile=lambda out, gate, b, s: jnp.sum(gate[..., None] * out.reshape(s, b, K, D).swapaxes(0, 1), axis=2)),
     "then permuted or regrouped"),
    (_tiled(untile=lambda out, gate, b, s: _untiled(out, gate, b, s).swapaxes(0, 1)), "then permuted or regrouped"),
    (_tiled(untile=lambda out, gate, b, s: jnp.sum(
        gate.reshape(-1, K)[..., None] * out.reshape(b, s, K, D).swapaxes(0, 1).reshape(-1, K, D), axis=1)),
     "other than by merging or splitting their token axes in order"),
    (_tiled(untile=lambda out, gate, b, s: jnp.sum(
        gate.reshape(b, s, K)[:, :1, :, None] * out.reshape(b, s, K, D), axis=2)),
     "not over all of its parts in order"),
    (_combined_over_experts(split_outputs=lambda out, b, s: out.reshape(E, b, s, D).swapaxes(1, 2)),
     "routing weights do not line up"),
    (_combined_over_experts(split_scores=lambda scores, b, s: scores.T.reshape(E, b, s).swapaxes(1, 2)),
     "routing weights do not line up"),
    (_rows_on_unmerged_tokens, "as a reshape merges the router's [4, 4] token axes"),
], ids=["index-transposed-merge", "index-choice-major", "copies-split-permuted", "output-split-permuted",
        "copies-split-permuted-merged", "weights-of-one-part", "outputs-split-permuted", "scores-split-permuted",
        "rows-on-unmerged-tokens"])
def test_token_axes_regrouped_otherwise_decline(layer, reason):
    """Token axes merged transposed (``[S, B]``), mixed with the choices, or split and then permuted or read
    in part: a row would meet another token's index, weight or output. Square ``[4, 4]`` tokens, so that
    every permuted shape still fits. A layer read over the merged tokens says so in its reason."""
    params, x = _args(jax.random.key(61), shape=(4, 4))
    declined_because(layer, params, x, reason)


def test_routing_weights_permuted_before_the_combine_are_read_as_computed():
    """The weights are the program's own values, read at each row's token as it lays them out: a permuted
    ``[B, S, k]`` gate is a different function, still computed exactly."""
    params, x = _args(jax.random.key(62), shape=(4, 4))
    layer = _tiled(untile=lambda out, gate, b, s: jnp.sum(
        gate.reshape(s, b, K).swapaxes(0, 1)[..., None] * out.reshape(b, s, K, D), axis=2))
    assert rewritten_exactly(layer, params, x)


_T = token_parts("t0", (2, 3))


@pytest.mark.parametrize("roles, in_shape, out_shape", [
    (_T + (CHOICE,), (2, 3, 2), (6, 2)),
    (_T + (CHOICE,), (2, 3, 2), (12,)),
    (_T + (CHOICE,), (2, 3, 2), (3, 2, 2)),
    (_T[::-1] + (CHOICE,), (3, 2, 2), (6, 2)),
    (("t0", CHOICE), (6, 2), (12,)),
    (("t0", CHOICE), (6, 2), (2, 6)),
    (("t0", CHOICE, FEATURE), (6, 2, 4), (2, 3, 2, 4)),
    (("t0", CHOICE, FEATURE), (6, 2, 4), (2, 3, 8)),
    ((COPY, FEATURE), (12, 4), (2, 3, 2, 4)),
    ((COPY, FEATURE), (12, 4), (3, 4, 4)),
    ((COPY, FEATURE), (12, 4), (2, 6, 4)),
    ((CHOICE,) + _T, (2, 2, 3), (2, 6)),
    ((CHOICE,) + _T, (2, 2, 3), (12,)),
    (("t0", ONE, CHOICE), (6, 1, 2), (1, 2, 3, 1, 2)),
])
def test_reshaped_roles_name_each_element_s_own_token_and_choice(roles, in_shape, out_shape):
    """``reshaped_roles`` against numpy's reshape: where it names the result's axes, each element's token
    and choice read off those names (token parts row-major, a copy n = token * k + choice) are the ones it
    had; where the reshape moves an element to another token or choice, it names nothing."""
    token, choice = _token_and_choice(roles, in_shape)
    out_roles = reshaped_roles(roles, in_shape, out_shape, copies=("t0", 2))
    moved_token, moved_choice = token.reshape(out_shape), choice.reshape(out_shape)
    if out_roles is None:
        assert not _reads_back(moved_token, moved_choice, out_shape)
        return
    read_token, read_choice = _token_and_choice(out_roles, out_shape)
    assert np.array_equal(read_token, moved_token) and np.array_equal(read_choice, moved_choice)


def _token_and_choice(roles, shape):
    """Each element's token and choice, read off ``roles`` (token parts row-major, ``COPY`` n = token * 2 +
    choice); -1 where no axis says (a feature, a unit axis, parts of a token axis that are not all there)."""
    token, choice = np.full(shape, -1), np.full(shape, -1)
    parts = {int(r.split("#")[1].split("/")[0]): (dim, [int(f) for f in r.split("/")[1].split("x")])
             for dim, r in enumerate(roles) if "#" in r}
    factors = next(iter(parts.values()))[1] if parts else []
    whole = sorted(parts) == list(range(len(factors))) and all(shape[parts[i][0]] == n for i, n in enumerate(factors))
    for index in itertools.product(*map(range, shape)):
        named = dict(zip(roles, index))
        if "t0" in named:
            token[index] = named["t0"]
        if parts and whole:
            token[index] = np.ravel_multi_index([index[parts[i][0]] for i in range(len(factors))], factors)
        if COPY in named:
            token[index], choice[index] = divmod(named[COPY], 2)
        if CHOICE in named:
            choice[index] = named[CHOICE]
    return token, choice


def _reads_back(token, choice, shape) -> bool:
    """Some naming of ``shape``'s axes (tokens split, merged with the choices) reads these tokens and choices."""
    names = [("t0",), _T, (CHOICE,), (COPY,), (FEATURE,), (ONE,)]
    for combo in itertools.product(*[[n for n in names if len(n) <= len(shape)]] * len(shape)):
        roles = tuple(r for n in combo for r in n)[:len(shape)]
        if len(roles) == len(shape) and len(set(roles)) == len(roles):
            got = _token_and_choice(roles, shape)
            if np.array_equal(got[0], token) and np.array_equal(got[1], choice):
                return True
    return False
