"""The ``dot_general`` rules: expert projections (tokens or rows times an expert-batched weight, a
loop's ``w[e]`` or per-token gathered weights), the one-hot gate contracted with the top-k weights,
and the combine of rows with routing weights; in the capacity style, the dispatch and combine
tensors, whose axes are named by the token axes they meet (``_dispatch_roles``, ``_combine_roles``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from jax import lax

from moe_lowering.expert_program import ExpertMatmul, ParamKind, RowInput
from moe_lowering.passes.abstract import (
    CHOICE,
    EXPERT,
    FEATURE,
    ONE,
    PART,
    SLOT,
    Combined,
    ExpertParamSlice,
    Factor,
    FusedRows,
    Gate,
    GateValue,
    GatheredWeight,
    Roles,
    Rows,
    WeightPart,
    is_token,
    token_roles,
)
from moe_lowering.passes.canonicalize import (
    canonical_product,
    identity_annotations,
    taken_apart_axis,
    unit_axes_source,
    weight_parts,
)
from moe_lowering.passes.assumptions import TILED_CHOICES
from moe_lowering.passes.graph import Eqn, JaxprGraph, Value
from moe_lowering.passes.match_core import Analysis, FailedMatch, _plain_roles, _rows_like, expert_weight, rule
from moe_lowering.passes.rules_copies import copies_dot, tiled_tokens
from moe_lowering.passes.rules_layout import PARTS_NOT_TAKEN_APART, _merged_parts
from moe_lowering.passes.rules_sort import sorted_projection
from moe_lowering.passes.rules_rows import (
    _as_contribution,
    _gated_sum,
    _gathered_param,
    _style,
    _unit_reshape,
    _unit_view,
    gated_token_rows,
)


def _gathered_matmul(an: Analysis, eqn, x_roles, gathered: GatheredWeight, xc, wc, xb, wb, pet, swap):
    """``rows [t.., (k,) K] . W[idx] [t.., k, K, N]`` batched over (token, choice): each routed row times
    its own expert's weight, i.e. an expert projection in the choice space. ``None`` if it is not that."""
    if len(xc) != 1 or len(wc) != 1 or x_roles[xc[0]] != FEATURE:
        return None
    k_role = gathered.roles[wc[0]]
    if not k_role.startswith("p"):
        return None
    if sorted(x_roles[i] for i in xb) != sorted(gathered.roles[i] for i in wb):
        return None
    if any(x_roles[i] != gathered.roles[j] for i, j in zip(xb, wb)):
        return None
    w_free = [d for d in range(len(gathered.roles)) if d not in wc and d not in wb]
    x_free = [d for d in range(len(x_roles)) if d not in xc and d not in xb]
    tokens = token_roles(len(an.token_shape))
    batch_roles = {x_roles[i] for i in xb}
    routed = set(tokens) | {CHOICE}
    free_roles = [gathered.roles[d] for d in w_free]
    # every token axis and the choice axis batched, or the choice free on the weight (x without k)
    if not set(tokens) <= batch_roles or (CHOICE not in batch_roles and free_roles.count(CHOICE) != 1):
        return None
    n_dims = [d for d in w_free if gathered.roles[d].startswith("p")]
    if len(n_dims) != 1 or any(x_roles[d] != ONE for d in x_free) or len(w_free) != len(n_dims) + (
            CHOICE not in batch_roles):
        return None
    k_dim, n_dim = int(k_role[1:]), int(gathered.roles[n_dims[0]][1:])
    index = _gathered_param(an, gathered, ParamKind.EXPERT_WEIGHT, {k_dim: "K", n_dim: "N"})
    out_w_roles = tuple(FEATURE if r.startswith("p") else r for r in gathered.roles)
    roles = _dot_out_roles(x_roles, out_w_roles, xc, wc, xb, wb, swap)
    if sorted(r for r in roles if r not in (FEATURE, ONE)) != sorted(routed) or roles.count(FEATURE) != 1:
        return None
    return roles, index


@rule(lax.dot_general_p)
def _dot_general(an: Analysis, eqn: Eqn, abstracts):
    """A ``dot_general`` in its canonical form (``canonical_product``): an operand only broadcast along
    batch axes read unbroadcast; a weight whose parts the uses take apart one by one read part by part."""
    view = canonical_product(an.graph, eqn)
    axis = taken_apart_axis(an.graph, eqn.outputs[0])
    parts = weight_parts(view, axis) if axis is not None else None
    fused = _fused_product(an, parts, axis) if parts else None
    if isinstance(fused, FusedRows):
        return fused
    if view.eqn is eqn:
        found = _product(an, eqn, abstracts)
    else:
        found = _laid_out(_product(an, view.eqn, [an.abstract(a) for a in view.eqn.inputs]), view.dims)
    if found is not None:
        return found
    return fused if parts else _parts_not_taken_apart(an, view.eqn)


def _parts_not_taken_apart(an: Analysis, eqn: Eqn) -> FailedMatch | None:
    """Why the tokens times a plain weight of an expert axis and one axis more is not read: the parts of a
    fused weight are read only as the uses take them apart. None for any other product."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    for x, w, xc in ((eqn.inputs[0], eqn.inputs[1], lc), (eqn.inputs[1], eqn.inputs[0], rc)):
        if (an.abstract(x) is None and an.abstract(w) is None and not lb and tuple(x.shape[:-1]) == an.token_shape
                and tuple(xc) == (len(x.shape) - 1,) and len(w.shape) == 4 and an.num_experts in w.shape):
            return FailedMatch(f"the tokens meet a {list(w.shape)} weight: one with an axis more than [E, d, f] (gate "
                               "and up fused on an axis of their own) is read part by part only where every use of "
                               "the product takes one part at a time (x1, x2 = h; h[0], h[1])", eqn)
    return None


def _fused_product(an: Analysis, parts, axis: int):
    """The product with a weight of several parts, read part by part (``weight_parts``): ``FusedRows`` where
    every part is a projection of the same rows by its part of a plain weight; a part's failure, or None."""
    whole = next(a.whole for a in parts[0].eqn.inputs if isinstance(a, WeightPart))
    if an.abstract(whole) is not None:
        return None
    found = [_laid_out(_product(an, p.eqn, [an.abstract(a) for a in p.eqn.inputs]), p.dims) for p in parts]
    if not all(isinstance(rows, Rows) for rows in found):
        return next((f for f in found if isinstance(f, FailedMatch)), None)
    first = found[0]
    if any(isinstance(rows.tokens, WeightPart) or not _rows_like(rows, first) for rows in found):
        return None
    return FusedRows(first.roles[:axis] + (PART,) + first.roles[axis + 1:], tuple(found))


def _laid_out(result, dims):
    """``result`` of a canonical product in the program's layout (``CanonicalProduct.dims``)."""
    if result is None or isinstance(result, FailedMatch):
        return result
    return replace(result, roles=tuple(ONE if d is None else result.roles[d] for d in dims))


def _product(an: Analysis, eqn: Eqn, abstracts):
    lhs, rhs = eqn.inputs
    a_lhs, a_rhs = abstracts
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    pet = eqn.params.get("preferred_element_type")
    if any(isinstance(a, Rows) and a.space == "sorted" for a in abstracts):
        return sorted_projection(an, eqn, abstracts)
    for swap in (False, True):
        x, w, ax, aw = (rhs, lhs, a_rhs, a_lhs) if swap else (lhs, rhs, a_lhs, a_rhs)
        xc, wc, xb, wb = (rc, lc, rb, lb) if swap else (lc, rc, lb, rb)
        result = _dot_case(an, eqn, x, w, ax, aw, tuple(xc), tuple(wc), tuple(xb), tuple(wb), pet, swap)
        if result is not None:
            return result
    if any(isinstance(a, FusedRows) for a in abstracts):
        return FailedMatch(PARTS_NOT_TAKEN_APART, eqn)
    if any(isinstance(a, (Rows, Combined)) for a in abstracts):
        return FailedMatch("a matmul of expert activations that is neither an expert projection nor the combine", eqn)
    return None


def _dot_out_roles(x_roles, w_roles, xc, wc, xb, wb, swap) -> Roles:
    """dot_general output order: batch dims, then lhs free dims, then rhs free dims."""
    x_free = [r for i, r in enumerate(x_roles) if i not in xc and i not in xb]
    w_free = [r for i, r in enumerate(w_roles) if i not in wc and i not in wb]
    batch = [x_roles[i] for i in xb]
    return tuple(batch + (w_free + x_free if swap else x_free + w_free))


def _dot_case(an: Analysis, eqn, x, w, ax, aw, xc, wc, xb, wb, pet, swap):
    """One operand order of a dot_general: the tokens/rows/gate side ``x`` against ``w``."""
    out_roles = _dot_out_roles
    E = an.num_experts
    token_shape = an.token_shape
    n_tok = len(token_shape)
    tokens = token_roles(n_tok)

    # tokens tiled per choice: a one-hot selection of each copy's expert, chosen copies times every expert
    copies = copies_dot(an, eqn, w, ax, aw, xc, wc, xb, wb, pet,
                        lambda x_roles, w_roles: out_roles(x_roles, w_roles, xc, wc, xb, wb, swap))
    if copies is not None:
        return copies

    # gate [t.., E] times tokens [t.., D], batched over the tokens, nothing contracted -> rows [t.., E, D]
    if isinstance(ax, Gate) and aw is None and not xc and not wc and not ax.boolean and ax.expert is None:
        return _gated_tokens_product(an, ax, x, w, xb, wb, swap)

    # tokens [t.., D] @ W [E, D, F] -> dense rows [t.., E, F]; tokens tiled per choice [.., L*k, D] alike
    tiled = tiled_tokens(an, x) if ax is None and aw is None and x.shape[:-1] != token_shape else None
    if ax is None and aw is None and not xb and len(w.shape) == 3 and (x.shape[:-1] == token_shape or tiled):
        if xc != (len(x.shape) - 1,) or len(wc) != 1:
            return None
        found = expert_weight(an, w, wc[0])
        if found is None:
            return None
        index, e_dim = found
        node = ExpertMatmul(RowInput(), index, pet)
        x_roles, source = (tiled[1], tiled[0]) if tiled else (tokens + (FEATURE,), x)
        roles = out_roles(x_roles, tuple(EXPERT if d == e_dim else FEATURE for d in range(3)), xc, wc, xb, wb, swap)
        return Rows(roles, node, "dense", _token_source(an.graph, source), style=TILED_CHOICES if tiled else "")

    # tokens [t.., D] . W[idx] [t.., k, D, F] over D, batched over tokens -> chosen rows [t.., k, F]; the
    # tokens with unit axes inserted (jnp.matmul(x[:, None, None, :], W[idx])) alike, the unit axes ONE
    tokens_shape = tuple(token_shape) + tuple(x.shape[-1:])
    unit = unit_axes_source(an.graph, x, tokens_shape) if ax is None and x.shape[:-1] != token_shape else None
    if unit is not None:
        source, x_roles = unit[0], [ONE] * len(x.shape)
        for role, dim in zip(tokens + (FEATURE,), unit[1]):
            x_roles[dim] = role
        x_roles = tuple(x_roles)
    else:
        source, x_roles = x, tokens + (FEATURE,)
    if ax is None and isinstance(aw, GatheredWeight) and source.shape[:-1] == token_shape:
        found = _gathered_matmul(an, eqn, x_roles, aw, xc, wc, xb, wb, pet, swap)
        if found is None:
            return FailedMatch("the tokens meet per-token gathered expert weights in a way that is not a projection", eqn)
        roles, index = found
        return Rows(roles, ExpertMatmul(RowInput(), index, pet), "choice", _token_source(an.graph, source),
                    style="gathered weights")

    # chosen rows [t.., k, F] . W[idx] [t.., k, F, N] batched over (token, choice) -> chosen rows
    if isinstance(ax, Rows) and isinstance(aw, GatheredWeight) and ax.space == "choice":
        found = None if ax.gate is not None else _gathered_matmul(an, eqn, ax.roles, aw, xc, wc, xb, wb, pet, swap)
        if found is None:
            return FailedMatch("chosen expert rows meet per-token gathered expert weights in a way that is not a "
                               "projection of each row by its own expert", eqn)
        roles, index = found
        return replace(ax, roles=roles, node=ExpertMatmul(ax.node, index, pet))

    # tokens [t.., D] @ W[e] [D, F] -> one expert's rows [t.., F]
    if ax is None and isinstance(aw, ExpertParamSlice) and not xb and x.shape[:-1] == token_shape and len(w.shape) == 2:
        if xc != (len(x.shape) - 1,):
            return None
        index = _slice_weight(an, aw, wc[0])
        roles = out_roles(tokens + (FEATURE,), (FEATURE, FEATURE), xc, wc, xb, wb, swap)
        return Rows(roles, ExpertMatmul(RowInput(), index, pet), "single", _token_source(an.graph, x), expert=aw.expert)

    # dispatch [t.., E, C] contracted with tokens [t.., D] over the token axes -> slot rows [E, C, D];
    # token axes batched instead are groups with slots of their own ('BSM,BSEC->EBCM': [E, B, C, D])
    if ax is None and aw is None and len(w.shape) == n_tok + 1 and w.shape[:-1] == token_shape:
        if len(x.shape) == n_tok + 2 and n_tok not in wc + wb and an.depends_on_anchor(x):
            x_roles = _dispatch_roles(x, xc, wc, xb, wb, tokens, E)
            if x_roles is None:
                return FailedMatch(
                    f"a {list(x.shape)} tensor built from the routing meets the tokens {list(w.shape)} in a dot, but "
                    "not as a dispatch [tokens.., E, C]: each token axis must be summed over (or batched, as a group "
                    f"with its own slots) and the two axes left must be the E={E} experts and the slots", eqn)
            roles = out_roles(x_roles, tokens + (FEATURE,), xc, wc, xb, wb, swap)
            return Rows(roles, RowInput(), "slot", w, dispatch=(x, x_roles))

    # rows [.., E, .., F] @ W [E, F, N] batched over E -> rows
    if isinstance(ax, Rows) and aw is None and len(w.shape) == 3 and ax.space in ("dense", "slot"):
        e_x = ax.roles.index(EXPERT)
        f_dims = tuple(i for i in xc if ax.roles[i] == FEATURE)
        if len(wc) != len(xc):
            return None
        if xb == (e_x,) and len(xc) == 1 and f_dims == xc:
            e_w = wb[0]
            k_w = wc[0]
            n_w = next(d for d in range(3) if d not in (e_w, k_w))
            w_roles = tuple(EXPERT if d == e_w else ("K" if d == k_w else "N") for d in range(3))
            node = ExpertMatmul(ax.node, an.param(w, ParamKind.EXPERT_WEIGHT, w_roles), pet)
            roles = out_roles(ax.roles, tuple(EXPERT if d == e_w else FEATURE for d in range(3)), xc, wc, xb, wb, swap)
            return replace(ax, roles=roles, node=node)
        if not xb and set(xc) == {e_x} | set(f_dims) and len(xc) == 2 and ax.space == "dense":
            if ax.gate is None:
                return FailedMatch("expert outputs are summed over experts without routing weights", eqn)
            e_w = wc[xc.index(e_x)]
            k_w = wc[xc.index(f_dims[0])]
            n_w = next(d for d in range(3) if d not in (e_w, k_w))
            w_roles = tuple(EXPERT if d == e_w else ("K" if d == k_w else "N") for d in range(3))
            node = ExpertMatmul(ax.node, an.param(w, ParamKind.EXPERT_WEIGHT, w_roles), pet)
            roles = out_roles(ax.roles, tuple(FEATURE if d == n_w else EXPERT for d in range(3)), xc, wc, xb, wb, swap)
            return _gated_sum(replace(ax, node=node), roles, eqn)
        return None

    # one expert's rows [t.., F] @ W[e] [F, N]
    if isinstance(ax, Rows) and isinstance(aw, ExpertParamSlice) and ax.space == "single" and len(w.shape) == 2:
        if aw.expert != ax.expert or xb or len(xc) != 1 or ax.roles[xc[0]] != FEATURE:
            return FailedMatch("an expert's activations are multiplied by another expert's weight", eqn)
        node = ExpertMatmul(ax.node, _slice_weight(an, aw, wc[0]), pet)
        roles = out_roles(ax.roles, (FEATURE, FEATURE), xc, wc, xb, wb, swap)
        rows = replace(ax, roles=roles, node=node)
        if rows.gate is not None:
            return _as_contribution(rows)
        return rows

    # gate [t.., E] . rows [t.., E, F] over E -> combined
    if isinstance(ax, Gate) and isinstance(aw, Rows) and aw.space == "dense":
        if ax.boolean or CHOICE in ax.roles or aw.gate is not None:
            return None
        if not xc and [ax.roles[i] for i in xb] == [aw.roles[i] for i in wb] and EXPERT in [ax.roles[i] for i in xb]:
            # an einsum's elementwise step ('te,tef->tef'): gating before the down-projection
            roles = out_roles(ax.roles, aw.roles, xc, wc, xb, wb, swap)
            return replace(aw, roles=roles, gate=replace(ax, roles=tuple(r for r in ax.roles if r != EXPERT)),
                           gate_value=GateValue(x, ax.roles))
        if len(xc) == 1 and ax.roles[xc[0]] == EXPERT and aw.roles[wc[0]] == EXPERT:
            if [ax.roles[i] for i in xb] == [aw.roles[i] for i in wb] and all(is_token(ax.roles[i]) for i in xb):
                roles = out_roles(ax.roles, aw.roles, xc, wc, xb, wb, swap)
                gate = replace(ax, roles=tuple(r for r in ax.roles if r != EXPERT))
                return _gated_sum(replace(aw, gate=gate, gate_value=GateValue(x, ax.roles)), roles, eqn)
        return None

    # one-hot [t.., k, E] . weights [t.., k] over k -> gate [t.., E]
    if isinstance(ax, Gate) and aw is None and CHOICE in ax.roles and len(xc) == 1 and ax.roles[xc[0]] == CHOICE:
        w_source, w_roles = _plain_roles(an.graph, w, _dot_align(ax.roles, xc, wc, xb, wb, len(w.shape)), w.shape)
        roles = out_roles(ax.roles, _dot_align(ax.roles, xc, wc, xb, wb, len(w.shape)), xc, wc, xb, wb, swap)
        return Gate(roles, ax.factors + (Factor(w_source, w_roles),), ax.expert)

    # weights [t.., k] . chosen rows [t.., k, F] over k -> combined
    if ax is None and isinstance(aw, Rows) and aw.space == "choice" and aw.gate is None:
        if len(wc) == 1 and aw.roles[wc[0]] == CHOICE:
            x_roles = _dot_align(aw.roles, wc, xc, wb, xb, len(x.shape))
            source, f_roles = _plain_roles(an.graph, x, x_roles, x.shape)
            roles = out_roles(x_roles, aw.roles, xc, wc, xb, wb, swap)
            gate = Gate(tuple(r for r in aw.roles if r not in (FEATURE,)), (Factor(source, f_roles),))
            return Combined(roles, aw.node, aw.tokens, gate, style=_style(aw),
                            gate_values=(GateValue(source, f_roles),))
        return None

    # combine [t.., E, C] . slot rows [E, C, F] over (E, C), batched over the rows' groups -> combined
    if ax is None and isinstance(aw, Rows) and aw.space == "slot" and len(wc) == 2:
        if {aw.roles[i] for i in wc} == {EXPERT, SLOT} and len(x.shape) == n_tok + 2 and an.depends_on_anchor(x):
            groups = tuple(r for r in aw.roles if is_token(r))
            if any(r not in tokens for r in groups) or any(_merged_parts(r) for r in aw.roles):
                return FailedMatch("the slot rows reach the combine with their group and slot axes still "
                                   "regrouped (split or merged by a reshape that is not undone)", eqn)
            if sorted(aw.roles[i] for i in wb) != sorted(groups) or not all(is_token(aw.roles[i]) for i in wb):
                return FailedMatch("the combine does not keep the dispatch's token groups apart (each group's "
                                   "slots must meet only that group's tokens)", eqn)
            x_roles = _combine_roles(x, xc, wc, xb, wb, aw.roles, tokens, token_shape)
            if x_roles is None:
                return None
            roles = out_roles(x_roles, aw.roles, xc, wc, xb, wb, swap)
            return Combined(roles, aw.node, aw.tokens, None, combine=(x, x_roles), dispatch=aw.dispatch,
                            style="grouped capacity" if groups else "capacity", slot_groups=tuple(sorted(groups)))
    return None


def _gated_tokens_product(an: Analysis, gate: Gate, gate_atom, w, xb, wb, swap):
    """``einsum('BTID,BTEK->BTED', x[:, :, None], mask)``: each token times its gate entry for every
    expert (the k and unit axes summed before the product); ``None`` unless ``w`` is the tokens and every
    token axis is batched against the gate's own."""
    tokens = token_roles(len(an.token_shape))
    if CHOICE in gate.roles or EXPERT not in gate.roles or sorted(gate.roles[i] for i in xb) != sorted(tokens):
        return None
    source, mapping = _unit_view(an.graph, w)
    if not isinstance(source, Value) or tuple(source.shape[:-1]) != tuple(an.token_shape) or mapping[-1] is None:
        return None
    w_roles = [ONE] * len(w.shape)
    for dim, w_dim in enumerate(mapping):
        if w_dim is not None:
            w_roles[w_dim] = FEATURE if dim == len(source.shape) - 1 else tokens[dim]
    if any(w_roles[j] != gate.roles[i] for i, j in zip(xb, wb)) or w_roles[mapping[-1]] != FEATURE:
        return None
    if any(r == ONE and w.shape[d] != 1 for d, r in enumerate(w_roles)):
        return None
    roles = _dot_out_roles(gate.roles, tuple(w_roles), (), (), xb, wb, swap)
    if any(r not in (EXPERT, ONE) for d, r in enumerate(gate.roles) if d not in xb) or roles.count(EXPERT) != 1:
        return None
    return gated_token_rows(roles, source, gate, gate_atom)


def _token_source(graph: JaxprGraph, tokens):
    """The value ``tokens`` is a view of: seen through squeezes, reshapes and broadcasts that only add or
    drop unit axes (keeping the feature axis last) and through annotations, so that two projections of
    ``x[:, None, :]`` squeezed twice read the same tokens. Same elements, same order: the rewrite
    reshapes whichever it reads to ``[T, d]``."""
    while isinstance(tokens, Value):
        eqn = graph.producer.get(tokens)
        if eqn is None:
            break
        source = eqn.inputs[0]
        if eqn.primitive in identity_annotations():
            tokens = source
            continue
        if eqn.primitive not in (lax.squeeze_p, lax.reshape_p, lax.broadcast_in_dim_p) or not isinstance(source, Value):
            break
        if not source.shape or source.shape[-1] != tokens.shape[-1] or math.prod(source.shape) != math.prod(tokens.shape):
            break
        if eqn.primitive is lax.broadcast_in_dim_p and list(eqn.params["broadcast_dimensions"]) != sorted(
                eqn.params["broadcast_dimensions"]):
            break
        if _unit_reshape(source.shape, tokens.shape) is None:
            break
        tokens = source
    return tokens


def _dot_align(roles: Roles, own_c, other_c, own_b, other_b, other_rank) -> Roles:
    """Roles of the other operand of a dot, read off this one's contracted and batch dims."""
    out = [FEATURE] * other_rank
    for mine, theirs in zip(own_c + own_b, other_c + other_b):
        out[theirs] = roles[mine]
    return tuple(out)


def _dispatch_roles(x, xc, wc, xb, wb, tokens: Roles, num_experts: int) -> Roles | None:
    """Roles of a ``[t.., E, C]`` dispatch tensor, each token axis named by the tokens' axis it meets in
    the dot (contracted, or batched as a group): never by position, so ``'sbec,bsd->ecd'`` reads the
    right tokens. The two axes left are the experts (of size E) and the slots."""
    if not wc or sorted(wc + wb) != list(range(len(tokens))):
        return None
    roles: list = [None] * len(x.shape)
    for mine, theirs in zip(xc + xb, wc + wb):
        roles[mine] = tokens[theirs]
    rest = [d for d in range(len(x.shape)) if roles[d] is None]
    if len(rest) != 2:
        return None
    e_dim = next((d for d in rest if x.shape[d] == num_experts), None)
    if e_dim is None:
        return None
    for d in rest:
        roles[d] = EXPERT if d == e_dim else SLOT
    return tuple(roles)


def _combine_roles(x, xc, wc, xb, wb, rows_roles: Roles, tokens: Roles, token_shape) -> Roles | None:
    """Roles of a ``[t.., E, C]`` combine tensor: expert, slot and group axes from the slot rows they
    meet; its other token axes, in order, name the output's tokens. That naming needs no proof: the
    device check compares combine with dispatch entry by entry under it (``combine-within-dispatch``),
    so a token whose combine weights sit in another token's slots takes the dense fallback."""
    roles: list = [None] * len(x.shape)
    for mine, theirs in zip(xc + xb, wc + wb):
        roles[mine] = rows_roles[theirs]
    free = [r for r in tokens if r not in roles]
    rest = [d for d in range(len(x.shape)) if roles[d] is None]
    if len(rest) != len(free):
        return None
    for d, r in zip(rest, free):
        roles[d] = r
    if any(x.shape[d] != token_shape[tokens.index(r)] for d, r in enumerate(roles) if is_token(r)):
        return None
    return tuple(roles)


def _slice_weight(an: Analysis, slice_: ExpertParamSlice, contract_dim: int) -> int:
    """The loop style's ``w[e]`` as the full expert weight ``w [E, K, N]``."""
    source = slice_.source
    k_src = slice_.roles[contract_dim]
    roles = tuple(EXPERT if d == slice_.expert_axis else ("K" if d == k_src else "N") for d in range(len(source.shape)))
    return an.param(source, ParamKind.EXPERT_WEIGHT, roles)
