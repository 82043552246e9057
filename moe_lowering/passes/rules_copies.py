"""Tokens tiled per choice (issue 35's idiom 3): the tokens repeated to one row per routed copy
(``jnp.repeat(x, k, axis=0)``, ``[T*k, d]``: copy ``n`` is token ``n // k``), every expert's product
computed on every copy (``einsum('md,edf->emf')``), and each copy's own expert kept by contracting E
against a one-hot of the flattened routing indices (``einsum('em,emf->mf', one_hot(idx.reshape(-1), E,
axis=0), ...)``), again after each later product; the activation on the chosen rows, the routing weights
and the sum over k at the end.

The copies' axis has the role ``COPY`` in the tiled tokens, in the one-hot of the flattened indices
(``CopyOneHot``) and in the rows, so a selection is accepted only where the one-hot's copy axis is the
rows' own: each copy is selected by the routing's index of its own (token, choice)
(``copy-selects-own-expert``). A product of chosen rows with every expert's weight is ``pending`` until
that selection; a step before a selection must be finite wherever its input is (``finite-before-selection``).
Once selected, the rows are chosen rows (``choice`` space) whose copy axis is split back into (token, k),
and the rules for a gather's chosen rows take over.
"""

from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp
from jax import lax

from moe_lowering.expert_program import ExpertMatmul
from moe_lowering.passes.abstract import (
    COPY,
    EXPERT,
    FEATURE,
    ONE,
    CopyOneHot,
    Roles,
    Rows,
    reshaped_roles,
    token_roles,
)
from moe_lowering.passes.assumptions import TILED_CHOICES
from moe_lowering.passes.canonicalize import identity_annotations
from moe_lowering.passes.graph import Eqn, Value
from moe_lowering.passes.match_core import Analysis, FailedMatch, expert_weight

# finite, with finite partial derivatives, at every finite input (barring overflow, as products of
# finite weights are assumed not to): what may run on every expert's values before the selection
_TOTAL = frozenset(getattr(lax, f"{name}_p") for name in (
    "add sub mul neg max min abs select_n tanh logistic erf erfc sin cos square sign floor ceil round clamp "
    "copy").split() if hasattr(lax, f"{name}_p"))


def tiled_tokens(an: Analysis, atom) -> tuple[Value, Roles] | None:
    """``atom`` as the tokens repeated k times along their last token axis (``jnp.repeat(x, k, axis=-2)``:
    x broadcast along a new axis of size k right after it, the two merged, copy ``n`` of token ``n // k``):
    the tokens and the roles of ``atom``'s dims, ``COPY`` for the copies. None for anything else."""
    k = an.anchor.top_k
    token_shape = tuple(an.token_shape)
    reshape = _producer(an, atom)
    if reshape is None or reshape.primitive is not lax.reshape_p or an.anchor.kind == "argmax" or k < 2:
        return None
    broadcast = _producer(an, reshape.inputs[0])
    if broadcast is None or broadcast.primitive is not lax.broadcast_in_dim_p:
        return None
    n = len(token_shape)
    spread = tuple(broadcast.outputs[0].shape)
    inner = _producer(an, broadcast.inputs[0])
    if (tuple(broadcast.params["broadcast_dimensions"]) == tuple(range(n + 2)) and inner is not None
            and inner.primitive is lax.broadcast_in_dim_p and tuple(inner.outputs[0].shape) == token_shape + (1,) + spread[-1:]):
        # x[..., None, :] spread over the size-1 copy axis (jnp.tile(x[:, None], (1, k, 1)), Grok-1): one broadcast
        broadcast = inner
    tokens = broadcast.inputs[0]
    if not isinstance(tokens, Value) or tuple(tokens.shape[:-1]) != token_shape or len(tokens.shape) != n + 1:
        return None
    d = tokens.shape[-1]
    if (tuple(broadcast.params["broadcast_dimensions"]) != tuple(range(n)) + (n + 1,)
            or spread != token_shape + (k, d)):
        return None
    if tuple(atom.shape) != token_shape[:-1] + (token_shape[-1] * k, d):
        return None
    return tokens, token_roles(n - 1) + (COPY, FEATURE)


def _producer(an: Analysis, atom):
    """The eqn computing ``atom``, seen through annotations."""
    eqn = an.graph.producer.get(atom) if isinstance(atom, Value) else None
    while eqn is not None and eqn.primitive in identity_annotations():
        eqn = an.graph.producer.get(eqn.inputs[0]) if isinstance(eqn.inputs[0], Value) else None
    return eqn


def before_selection(rows) -> bool:
    """Rows holding every expert's value on each copy: tiled tokens' products, or ``pending`` ones."""
    return isinstance(rows, Rows) and rows.style == TILED_CHOICES and rows.space in ("dense", "pending")


def copies_dot(an: Analysis, eqn: Eqn, w, ax, aw, xc, wc, xb, wb, pet, out_roles):
    """The dot_generals of tiled copies: a selection of each copy's own expert (``ax`` the one-hot), a
    contraction over E of every expert's values with anything else (declined), chosen copies times every
    expert's weight (``pending``). ``out_roles(x_roles, w_roles)``: the dot's output roles. None if ``ax``
    and ``aw`` are none of these."""
    if isinstance(ax, CopyOneHot) and before_selection(aw):
        return _selection(ax, aw, xc, wc, xb, wb, out_roles, eqn)
    if isinstance(ax, CopyOneHot) and aw is None and any(ax.roles[i] == EXPERT for i in xc):
        return FailedMatch(
            "a one-hot of the routing indices flattened to one per (token, choice) copy is contracted over the experts "
            f"with a {list(w.shape)} value that is not known as every expert's output on the tokens tiled in that same "
            "order (jnp.repeat(x, k, axis=0): copy n = token * k + choice; tiled otherwise, as jnp.tile does, a copy "
            "would meet another token's row)", eqn, "copy-selects-own-expert")
    if before_selection(ax) and not isinstance(aw, CopyOneHot) and any(ax.roles[i] == EXPERT for i in xc):
        return FailedMatch(
            "every expert's output on the tiled copies of the tokens is contracted over the experts with a value "
            "the matcher does not know as a one-hot of the routing indices flattened as the tokens were tiled (copy "
            "n = token * k + choice): a copy could keep another copy's or another expert's output", eqn,
            "copy-selects-own-expert")
    if (isinstance(ax, Rows) and ax.space == "choice" and ax.style == TILED_CHOICES and ax.gate is None
            and aw is None and len(w.shape) == 3 and not xb and len(xc) == 1 and ax.roles[xc[0]] == FEATURE):
        return _every_expert_product(an, ax, w, xc, wc, pet, out_roles, eqn)
    return None


def _selection(mask: CopyOneHot, rows: Rows, xc, wc, xb, wb, out_roles, eqn: Eqn):
    """``einsum('em,emf->mf', one_hot(idx.reshape(-1), E, axis=0), rows)``: each copy keeps its own
    expert's row, when E is what is contracted and every other axis of the rows but the features is
    batched against the one-hot's axis of the same role (the copies, the other token axes)."""
    copies = tuple(r for r in rows.roles if r not in (EXPERT, FEATURE))
    if (len(xc) != 1 or mask.roles[xc[0]] != EXPERT or rows.roles[wc[0]] != EXPERT
            or any(mask.roles[i] != rows.roles[j] for i, j in zip(xb, wb)) or sorted(rows.roles[j] for j in wb) != sorted(copies)
            or any(r != ONE for i, r in enumerate(mask.roles) if i not in xc and i not in xb)):
        return FailedMatch(
            "a one-hot of the flattened routing indices meets every expert's output on the tiled copies, but not "
            "as a selection of each copy's own expert (E contracted, every copy axis batched against the one-hot's "
            "own)", eqn, "copy-selects-own-expert")
    return replace(rows, roles=out_roles(mask.roles, rows.roles), space="choice")


def _every_expert_product(an: Analysis, rows: Rows, w, xc, wc, pet, out_roles, eqn: Eqn):
    """Chosen copies ``[.., n, F]`` times an expert weight ``[E, F, N]`` for every expert: ``pending``
    rows, each copy's own expert selected again later (``einsum('mk,bkn->bmn', h, W)``)."""
    found = expert_weight(an, w, wc[0])
    if found is None:
        return None
    index, e_dim = found
    roles = out_roles(rows.roles, tuple(EXPERT if d == e_dim else FEATURE for d in range(3)))
    return replace(rows, roles=roles, node=ExpertMatmul(rows.node, index, pet), space="pending")


def step_before_selection(eqn: Eqn, abstracts) -> FailedMatch | None:
    """Why a step on every expert's values before the selection is not kept (None: it may be)."""
    if not any(before_selection(a) for a in abstracts):
        return None
    prim = eqn.primitive
    if prim in _TOTAL or (prim is lax.integer_pow_p and eqn.params["y"] >= 0) or _holds_every_value(eqn):
        return None
    return FailedMatch(
        f"`{prim}` runs on every expert's output for every tiled copy before each copy's own expert is selected: "
        "the one-hot multiplies the other experts' values by 0, and where this step is not finite (inf or NaN, "
        "or an infinite derivative) 0 * inf is NaN in the dense layer but not in the sparse one; only steps "
        "finite everywhere may come before the selection (apply it after)", eqn, "finite-before-selection")


def _holds_every_value(eqn: Eqn) -> bool:
    """A cast whose type holds every finite value of its input's, so no finite input becomes inf (float16
    does not hold a float32's 1e5); ``reduce_precision`` likewise, where it keeps the exponent."""
    source = jnp.dtype(eqn.inputs[0].dtype)
    if eqn.primitive is lax.reduce_precision_p:
        return eqn.params["exponent_bits"] >= jnp.finfo(source).nexp
    if eqn.primitive is not lax.convert_element_type_p:
        return False
    target = jnp.dtype(eqn.params["new_dtype"])
    if not jnp.issubdtype(target, jnp.floating):
        return True  # integers and booleans are finite
    if jnp.issubdtype(source, jnp.floating):
        return jnp.finfo(target).max >= jnp.finfo(source).max
    return not jnp.issubdtype(source, jnp.integer) or jnp.finfo(target).max >= jnp.iinfo(source).max


def split_copies(an: Analysis, eqn: Eqn, rows: Rows):
    """A reshape of chosen rows with a copy axis: the rows with it split back into (token, k) in place,
    everything else unmoved (copy n = token * k + choice), the token axis maybe split further in order
    (Grok-1's ``[T * k, d] -> [B, S, k, d]``); why not, for any other reshape of them; None for rows
    without one."""
    if COPY not in rows.roles or rows.space != "choice" or rows.gate is not None:
        return None
    in_shape, out_shape = tuple(eqn.inputs[0].shape), tuple(eqn.outputs[0].shape)
    split = (an.token_shape[-1], an.anchor.top_k)
    last_token = token_roles(len(an.token_shape))[-1]
    roles = reshaped_roles(rows.roles, in_shape, out_shape, (last_token, split[1]))
    if roles is None or COPY in roles or last_token in rows.roles:
        return FailedMatch(f"the chosen copies {list(in_shape)} are reshaped to {list(out_shape)}, not split back in "
                           f"place into the {split[0]} tokens and k = {split[1]} choices they were merged from (copy "
                           "n = token * k + choice), those tokens split only in order", eqn,
                           "copy-selects-own-expert" if rows.style == TILED_CHOICES else "sorted-copy-own-expert")
    return replace(rows, roles=roles)
