"""Rules of the sort-based dense dispatch: the routing's (token, choice) copies argsorted by expert and
gathered, every expert run on every sorted copy, each copy's own expert kept by an iota range mask
``start_e <= i < end_e`` (bounds from a cumsum of per-expert counts), summed over E, un-sorted by the
inverse permutation: each copy ends up with its own expert's output, the chosen rows of a top-k layer.

The chain, as abstract values (``abstract.py``): the indices reshaped ``[.., L, k] -> [.., L * k]``
(``CopyIndex``), ``argsort`` of them (``SortOrder``), ``order // k`` (the sorted copies' tokens), the
tokens gathered there (rows of space ``sorted``), a one-hot of the same indices (``CopyOneHot``) summed
into ``ExpertCounts``, their cumsum (``end``) and ``end - counts`` (``start``) compared with an iota over
the sorted positions (``RangeMask``), the mask times the dense rows, the sum over E, a gather by
``argsort(order)`` (``SortOrder(inverse=True)``): chosen rows with a ``COPY`` axis, split back into
``[.., L, k]`` as for tokens tiled per choice (``rules_copies.split_copies``). Each step that
departs from this declines with what broke (assumption ``sorted-copy-own-expert``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from jax import lax

from moe_lowering.expert_program import ExpertMatmul, RowInput
from moe_lowering.passes.abstract import (
    BROADCAST,
    CHOICE,
    COPY,
    EXPERT,
    FEATURE,
    ONE,
    SORTED,
    CopyIndex,
    CopyOneHot,
    ExpertCounts,
    ExpertIndex,
    Gate,
    Iota,
    NegativeIndexCheck,
    RangeMask,
    Rows,
    ShiftedIndex,
    SortOrder,
    is_token,
    reshaped_roles,
    token_roles,
)
from moe_lowering.passes.assumptions import SORTED_RANGE_MASK
from moe_lowering.passes.canonicalize import _holds_integers_up_to, floor_division_fixup, scalar_constant
from moe_lowering.passes.graph import Eqn
from moe_lowering.passes.match_core import (
    ITERATION_ROLE,
    Analysis,
    FailedMatch,
    IndexInBounds,
    _broadcast_source,
    _is_zero,
    _merge_roles,
    expert_weight,
    rule,
)
from moe_lowering.passes.rules_copies import _producer, tiled_tokens

SORT_KINDS = (CopyIndex, SortOrder, CopyOneHot, ExpertCounts, RangeMask)
OWN_EXPERT = "sorted-copy-own-expert"


def involves_sorted_dispatch(abstracts) -> bool:
    """An operand is part of the sort-based dispatch: its indices, counts, mask or sorted rows."""
    return any(isinstance(a, SORT_KINDS) or isinstance(a, Rows) and (
        a.space == "sorted" or a.space == "dense" and a.style == SORTED_RANGE_MASK) for a in abstracts)


def _max_copies(an: Analysis) -> int:
    return int(np.prod(an.token_shape)) * an.anchor.top_k


# ------------------------------------------------------------------------- the copies' indices


def copy_index(an: Analysis, eqn: Eqn, index: ExpertIndex):
    """``idx.reshape(.., L * k)``: the last token axis and k merged, tokens outer (copy n = l * k + j); the
    token axes, split by a reshape before (``[B, S, k] -> [B * S * k]`` over T = B * S tokens), merged back
    first, in order."""
    tokens = token_roles(len(an.token_shape))
    roles = reshaped_roles(index.roles, eqn.inputs[0].shape, eqn.outputs[0].shape, (tokens[-1], an.anchor.top_k))
    return CopyIndex(roles) if roles == tokens[:-1] + (COPY,) else None


@rule(lax.sort_p)
def _sort(an: Analysis, eqn: Eqn, abstracts):
    """``argsort(copies' indices)`` is the sort order; ``argsort(order)`` its inverse."""
    if all(a is None for a in abstracts):
        return None
    key = abstracts[0]
    dim = eqn.params["dimension"]
    position = abstracts[-1]
    argsort = (len(abstracts) == 2 and eqn.params.get("num_keys") == 1 and isinstance(position, Iota)
               and position.roles[dim] == ITERATION_ROLE)
    if argsort and isinstance(key, CopyIndex) and key.roles[dim] == COPY:
        order = SortOrder(key.roles[:dim] + (SORTED,) + key.roles[dim + 1:])
        return None, order
    if argsort and isinstance(key, SortOrder) and not key.inverse and key.divisor is None and key.roles[dim] == SORTED:
        return None, SortOrder(key.roles[:dim] + (COPY,) + key.roles[dim + 1:], inverse=True)
    if isinstance(key, (CopyIndex, SortOrder)):
        return FailedMatch("the copies are sorted other than by an ascending argsort along their copy axis", eqn,
                           OWN_EXPERT)
    ancestors = an.graph.ancestors(eqn.inputs[0])
    if an.anchor.indices not in ancestors or any(isinstance(an.values.get(v), SortOrder) for v in ancestors):
        return None  # not about the routing, or a permutation of an order: its gather says what it is
    return FailedMatch("the copies are sorted by a key that is not the routing's expert indices with the tokens and "
                       "choices merged (each copy's own expert), so the range mask of the counts does not keep each "
                       "copy's own expert", eqn, OWN_EXPERT)


@rule(lax.cumsum_p)
def _cumsum(an: Analysis, eqn: Eqn, abstracts):
    counts = abstracts[0]
    if not isinstance(counts, ExpertCounts):
        if involves_sorted_dispatch(abstracts):
            return FailedMatch("a cumulative sum of the sort-based dispatch that is not one of the expert counts", eqn)
        return None
    if counts.bound or counts.roles[eqn.params["axis"]] != EXPERT or eqn.params.get("reverse"):
        return FailedMatch("the range bounds are not a forward cumulative sum of the expert counts over the experts",
                           eqn, OWN_EXPERT)
    return replace(counts, bound="end")


# ------------------------------------------------------------------------- arithmetic


def sorted_arith(an: Analysis, eqn: Eqn, abstracts):
    """Elementwise steps of the dispatch: one-hot of the copies' indices, counts and bounds, the range
    comparisons and their conjunction, ``order // k``, and the mask's product with the dense rows."""
    prim = eqn.primitive
    a, b = (list(abstracts) + [None])[:2]
    rows = [x for x in abstracts if isinstance(x, Rows)]
    if rows:
        return _sorted_rows_step(an, eqn, abstracts, rows)
    if prim is lax.convert_element_type_p:
        return _cast(an, eqn, a)
    copies = isinstance(a, CopyIndex) or isinstance(b, CopyIndex)
    if isinstance(a, SortOrder) or isinstance(b, SortOrder) or (
            copies and prim in (lax.max_p, lax.lt_p, lax.add_p, lax.select_n_p)):
        return _order_arith(an, eqn, abstracts)
    if prim is lax.eq_p:
        index, other = (a, b) if isinstance(a, CopyIndex) else (b, a)
        if isinstance(index, CopyIndex) and isinstance(other, Iota):
            axis = other.roles.index(ITERATION_ROLE)
            if index.roles[axis] != ONE or eqn.outputs[0].shape[axis] != an.num_experts:
                return FailedMatch("a one-hot of the copies' indices against an iota that does not count the experts",
                                   eqn)
            roles = _merge_roles(index.roles, tuple(ONE if r == ITERATION_ROLE else r for r in other.roles))
            return CopyOneHot(roles[:axis] + (EXPERT,) + roles[axis + 1:])
        return None
    if prim is lax.sub_p and isinstance(a, ExpertCounts) and isinstance(b, ExpertCounts):
        if a.bound == "end" and not b.bound and a.roles == b.roles:
            return replace(a, bound="start")
        return FailedMatch("expert counts and bounds are subtracted other than as end - counts", eqn, OWN_EXPERT)
    counted = isinstance(a, ExpertCounts) or isinstance(b, ExpertCounts)
    if prim in (lax.le_p, lax.lt_p, lax.ge_p, lax.gt_p) and counted:
        return _range_bound(an, eqn, a, b)
    if prim is lax.and_p and isinstance(a, RangeMask) and isinstance(b, RangeMask):
        roles = _merge_roles(a.roles, b.roles)
        if roles is None or (a.lower and b.lower) or (a.upper and b.upper):
            return FailedMatch("range conditions of the sorted positions are combined that are not one lower and one "
                               "upper bound of the same experts", eqn, OWN_EXPERT)
        return RangeMask(roles, lower=True, upper=True)
    if counted:
        return FailedMatch(f"`{prim}` of the expert counts or bounds: only end = cumsum(counts) and start = end - "
                           "counts bound the experts' ranges of sorted positions", eqn, OWN_EXPERT)
    if (isinstance(a, RangeMask) or isinstance(b, RangeMask)) and prim in (lax.mul_p, lax.select_n_p):
        return FailedMatch("the range mask start_e <= i < end_e of the routing's copies meets values that are not "
                           "every expert's outputs on the tokens gathered in the order of those same copies sorted "
                           "(sorted by another key, or gathered otherwise), so it does not keep each copy's own "
                           "expert", eqn, OWN_EXPERT)
    if isinstance(a, RangeMask) or isinstance(b, RangeMask):
        return FailedMatch(f"`{prim}` of the range mask of sorted positions, which is not its product with the "
                           "expert outputs of the sorted copies", eqn, OWN_EXPERT)
    return None


def _cast(an: Analysis, eqn: Eqn, value):
    new = eqn.params["new_dtype"]
    if isinstance(value, (CopyOneHot, RangeMask)):
        return value  # a predicate: 0 and 1 survive any cast
    if isinstance(value, CopyIndex):
        largest = an.num_experts - 1
    elif isinstance(value, ExpertCounts):
        largest = _max_copies(an)
    else:  # a sort order or its inverse: positions among the copies
        largest = _max_copies(an) - 1
    if not _holds_integers_up_to(new, largest):
        return FailedMatch(f"a value of the sort-based dispatch is cast to {np.dtype(new).name}, which does not hold "
                           f"every value up to {largest}", eqn, OWN_EXPERT)
    return value


def _order_arith(an: Analysis, eqn: Eqn, abstracts):
    """``order // k`` (``div``, and ``jnp.floor_divide``'s correction, a no-op on a non-negative order), the
    normalisation of negative indices of a gather or scatter, and ``max(idx, 0)`` (``jnp.bincount``'s clip) of
    the copies' indices, none of which changes these non-negative values; other steps leave them."""
    prim = eqn.primitive
    a, b = (list(abstracts) + [None])[:2]
    if prim is lax.max_p and isinstance(a, CopyIndex) != isinstance(b, CopyIndex):
        floor = scalar_constant(an.graph, eqn.inputs[1 if isinstance(a, CopyIndex) else 0])
        return (a or b) if floor is not None and floor <= 0 else None
    if prim is lax.div_p and isinstance(a, SortOrder) and not a.inverse and a.divisor is None and b is None:
        divisor = scalar_constant(an.graph, eqn.inputs[1])
        return replace(a, divisor=int(divisor)) if divisor is not None and divisor > 0 else None
    if prim is lax.select_n_p and isinstance(a, NegativeIndexCheck):  # x < 0 ? x + n : x, of an x >= 0
        shifted = an.abstract(eqn.inputs[2])
        if eqn.inputs[1] is a.of and isinstance(shifted, ShiftedIndex) and shifted.of is a.of:
            return an.abstract(a.of)
        return None
    if prim is lax.select_n_p and isinstance(abstracts[1], SortOrder) and abstracts[1].divisor is not None:
        fixup = floor_division_fixup(an.graph, eqn)
        if fixup is not None and isinstance(an.abstract(fixup[1]), SortOrder):
            return abstracts[1]  # the order counts copies from 0: floor division is truncating division
        return None
    if prim is lax.lt_p and isinstance(a, (SortOrder, CopyIndex)) and _is_zero(an.graph, eqn.inputs[1]):
        return NegativeIndexCheck(eqn.inputs[0])
    if prim in (lax.ge_p, lax.gt_p, lax.le_p, lax.lt_p) and isinstance(a, SortOrder) and b is None:
        return _order_in_bounds(an, eqn, a)
    if prim is lax.add_p and isinstance(a, (SortOrder, CopyIndex)) and b is None:
        return ShiftedIndex(eqn.inputs[0])
    return None


def _order_in_bounds(an: Analysis, eqn: Eqn, order: SortOrder):
    """``order >= 0`` or ``order <= n - 1`` (a gather's bounds check): a permutation of the n copies holds
    0..n - 1, ``order // k`` 0..(n - 1) // k, so a check these pass is ``IndexInBounds``."""
    bound = scalar_constant(an.graph, _broadcast_source(an.graph, eqn.inputs[1])[0])
    axis = next((d for d, r in enumerate(order.roles) if r in (SORTED, COPY)), None)
    if bound is None or axis is None:
        return None
    largest = (eqn.inputs[0].shape[axis] - 1) // (order.divisor or 1)
    prim = eqn.primitive
    lower = (prim is lax.ge_p and bound <= 0) or (prim is lax.gt_p and bound < 0)
    upper = (prim is lax.le_p and bound >= largest) or (prim is lax.lt_p and bound > largest)
    return IndexInBounds(order.roles, lower, upper) if lower or upper else None


def _range_bound(an: Analysis, eqn: Eqn, a, b):
    """``start_e <= i`` or ``i < end_e`` (either operand order) of an iota ``i`` over the sorted positions."""
    prim = eqn.primitive
    if isinstance(b, ExpertCounts):  # i >= start  <=>  start <= i ;  i < end  <=>  end > i
        a, b = b, a
        prim = {lax.le_p: lax.ge_p, lax.lt_p: lax.gt_p, lax.ge_p: lax.le_p, lax.gt_p: lax.lt_p}[prim]
    bound, position = a, b
    if not isinstance(position, Iota) or list(position.roles).count(ITERATION_ROLE) != 1:
        return FailedMatch("the expert bounds are compared with a value that is not an iota over the sorted positions "
                           "(i = 0, 1, ..)", eqn, OWN_EXPERT)
    if EXPERT not in bound.roles or not bound.bound:
        return FailedMatch("the sorted positions are compared with the expert counts themselves, not with the bounds "
                           "end = cumsum(counts) and start = end - counts", eqn, OWN_EXPERT)
    roles = _merge_roles(bound.roles, tuple(SORTED if r == ITERATION_ROLE else r for r in position.roles))
    if roles is None or SORTED not in roles:
        return FailedMatch("the expert bounds and the iota of sorted positions do not line up", eqn, OWN_EXPERT)
    # with a as the bound: prim(bound, i) is le: start <= i, lt: start < i, gt: end > i, ge: end >= i
    if bound.bound == "start" and prim is lax.le_p:
        return RangeMask(roles, lower=True)
    if bound.bound == "end" and prim is lax.gt_p:
        return RangeMask(roles, upper=True)
    if bound.bound == "start" and prim is lax.lt_p:
        return FailedMatch("the range mask keeps start_e < i: off by one, it drops each expert's first sorted copy "
                           "(start_e <= i keeps exactly expert e's copies)", eqn, OWN_EXPERT)
    if bound.bound == "end" and prim is lax.ge_p:
        return FailedMatch("the range mask keeps i <= end_e: off by one, it also keeps the next expert's first sorted "
                           "copy (i < end_e keeps exactly expert e's copies)", eqn, OWN_EXPERT)
    side = "start" if bound.bound == "start" else "end"
    return FailedMatch(f"the sorted positions are bounded by {side}_e from the wrong side: the range mask is not "
                       "start_e <= i < end_e", eqn, OWN_EXPERT)


# ------------------------------------------------------------------------- the rows


def _sorted_rows_step(an: Analysis, eqn: Eqn, abstracts, rows):
    from moe_lowering.passes.rules_rows import _rows_elementwise

    prim = eqn.primitive
    first = rows[0]
    masks = [a for a in abstracts if isinstance(a, RangeMask)]
    others = [a for a in abstracts if a is not None and not isinstance(a, (Rows, RangeMask))]
    if first.space == "sorted" and EXPERT in first.roles:  # masked: only casts before the sum over E
        if prim is lax.convert_element_type_p:
            return first
        return FailedMatch(f"`{prim}` follows the range mask of the sorted copies; only the sum over the experts (and "
                           "casts) may follow it", eqn, OWN_EXPERT)
    per_copy = _per_copy_operand(an, eqn, abstracts, first)
    if masks or (first.space == "dense" and prim in (lax.mul_p, lax.select_n_p) and per_copy):
        return _masked(an, eqn, abstracts, first, masks)
    if others:
        return FailedMatch(f"`{prim}` combines the expert outputs of the sorted copies with a routing value that is "
                           "not the range mask start_e <= i < end_e", eqn, OWN_EXPERT)
    if per_copy:
        return FailedMatch(f"`{prim}` combines the sorted copies' rows with a value along their token rows or sorted "
                           "positions: not a parameter of one expert program", eqn, OWN_EXPERT)
    return _rows_elementwise(an, eqn, abstracts)


def _per_copy_operand(an: Analysis, eqn: Eqn, abstracts, rows: Rows) -> bool:
    """A plain operand with an axis along the rows' token rows or sorted positions (a mask the matcher did not
    follow, a per-token value: the sorted copies are no longer in token order)."""
    from moe_lowering.passes.match_core import _plain_roles

    for atom, abstract in zip(eqn.inputs, abstracts):
        if abstract is None and atom.shape:
            _, roles = _plain_roles(an.graph, atom, rows.roles, eqn.outputs[0].shape)
            if any(r in (SORTED, COPY) or is_token(r) for r in roles):
                return True
    return False


def _masked(an: Analysis, eqn: Eqn, abstracts, rows: Rows, masks):
    """``expert_out * mask`` or ``where(mask, expert_out, 0)``: each sorted copy keeps its own expert's row."""
    what = ("the expert outputs of the sorted copies are multiplied by a mask that is not the range mask "
            "start_e <= i < end_e of the counts of the sorted copies' own expert indices")
    if len(masks) != 1 or not (rows.space == "dense" and rows.style == SORTED_RANGE_MASK and rows.gate is None):
        return FailedMatch(what, eqn, OWN_EXPERT)
    mask = masks[0]
    if eqn.primitive is lax.select_n_p:
        if abstracts[0] is not mask or abstracts[2] is not rows or not _is_zero(an.graph, eqn.inputs[1]):
            return FailedMatch(what + " (a select must be where(mask, outputs, 0))", eqn, OWN_EXPERT)
    elif eqn.primitive is not lax.mul_p:
        return FailedMatch(what + f" (`{eqn.primitive}`, not a product)", eqn, OWN_EXPERT)
    if not (mask.lower and mask.upper):
        return FailedMatch("the expert outputs of the sorted copies are masked by only one side of the range "
                           f"start_e <= i < end_e (the {'lower' if mask.lower else 'upper'} bound)", eqn, OWN_EXPERT)
    aligned = all(m in (ONE, BROADCAST) or m == r for m, r in zip(mask.roles, rows.roles))
    if not aligned or EXPERT not in mask.roles or SORTED not in mask.roles:
        return FailedMatch("the range mask does not line up with the sorted copies' expert and position axes", eqn,
                           OWN_EXPERT)
    mask_rows = {r for r in mask.roles if is_token(r)}
    rows_rows = {r for r in rows.roles if is_token(r)}
    if mask_rows != rows_rows:
        return FailedMatch(f"the expert counts are taken per {sorted(mask_rows) or 'whole batch'}, the copies are "
                           f"sorted per {sorted(rows_rows) or 'whole batch'}: the range mask's bounds are not those "
                           "of the rows sorted", eqn, OWN_EXPERT)
    return replace(rows, space="sorted")


def sorted_reduce_sum(an: Analysis, eqn: Eqn, value):
    """The masked rows summed over E: each sorted copy's own expert's output. Counts: a one-hot of the copies'
    indices summed over the copies."""
    axes = tuple(eqn.params["axes"])
    summed = {value.roles[a] for a in axes} - {ONE}
    kept = tuple(r for i, r in enumerate(value.roles) if i not in axes)
    if isinstance(value, CopyOneHot):
        if summed != {COPY}:
            return FailedMatch(f"the one-hot of the copies' indices is summed over {sorted(summed)}, not over the "
                               "copies of each sorted row: these are not the counts of the sorted indices", eqn,
                               OWN_EXPERT)
        return ExpertCounts(kept)
    if isinstance(value, Rows) and value.space == "sorted" and EXPERT in value.roles:
        if summed != {EXPERT}:
            return FailedMatch(f"the masked outputs of the sorted copies are summed over {sorted(summed)}, not over "
                               "the experts", eqn)
        return replace(value, roles=kept)
    if isinstance(value, Rows) and value.style == SORTED_RANGE_MASK and value.space == "dense":
        return FailedMatch("the expert outputs of the sorted copies are summed over experts without the range mask "
                           "start_e <= i < end_e that keeps each copy's own expert", eqn, OWN_EXPERT)
    if isinstance(value, (Rows, ) + SORT_KINDS):
        return FailedMatch("a sum over the sort-based dispatch's values that is not the counts or the sum over E", eqn)
    return None


def counts_of_choices(an: Analysis, eqn: Eqn, one_hot: Gate, summed: set):
    """``sum(one_hot(idx[.., L, k], E), axis=(L, k))``: the one-hot of the routing indices before their last
    token axis and k are merged into copies, summed over both, is the one-hot of the copies summed over the
    copies: the counts (per leading token axes, which the range mask must share with the sorted rows). Only
    a plain one-hot (no factor, every expert) in a type that holds every count."""
    tokens = token_roles(len(an.token_shape))
    trailing = [set(tokens[i:]) | {CHOICE} for i in range(len(tokens))]
    if one_hot.factors or one_hot.expert is not None or one_hot.boolean or summed not in trailing:
        return None
    if EXPERT not in one_hot.roles or not _holds_integers_up_to(eqn.outputs[0].dtype, _max_copies(an)):
        return None
    return ExpertCounts(tuple(r for i, r in enumerate(one_hot.roles) if i not in eqn.params["axes"]))


def leading_ends(an: Analysis, eqn: Eqn, bounds: ExpertCounts):
    """``ends[.., :-1]``: the ends of every expert but the last (bound ``"leading ends"``), the starts of the
    experts after them."""
    axis = bounds.roles.index(EXPERT) if EXPERT in bounds.roles else None
    shape = eqn.inputs[0].shape
    limits = tuple(n - 1 if d == axis else n for d, n in enumerate(shape))
    exact = (axis is not None and bounds.bound == "end" and tuple(eqn.params["start_indices"]) == (0,) * len(shape)
             and tuple(eqn.params["limit_indices"]) == limits and set(eqn.params.get("strides") or (1,)) == {1})
    if eqn.primitive is not lax.slice_p or not exact:
        return FailedMatch("the expert counts or bounds are sliced other than as ends[:-1] along the experts (the "
                           "starts of the experts after the first)", eqn, OWN_EXPERT)
    return replace(bounds, bound="leading ends")


def exclusive_cumsum(an: Analysis, eqn: Eqn, abstracts):
    """``concatenate([zeros[.., 1], ends[.., :-1]])`` along the experts: each expert's start, the end of the
    expert before it (0 for the first), as ``ends - counts`` is. ``None`` where no operand is an expert bound."""
    if not any(isinstance(a, ExpertCounts) for a in abstracts):
        return None
    dim = eqn.params["dimension"]
    zero = eqn.inputs[0]
    if (len(abstracts) != 2 or abstracts[0] is not None or not isinstance(abstracts[1], ExpertCounts)
            or abstracts[1].bound != "leading ends" or abstracts[1].roles[dim] != EXPERT
            or zero.shape[dim] != 1 or not _is_zero(an.graph, zero)):
        return FailedMatch("the range starts are a concatenation that is not [0] followed by ends[:-1] along the "
                           "experts (ends = cumsum(counts)): not each expert's first sorted position", eqn, OWN_EXPERT)
    return replace(abstracts[1], bound="start")


def sorted_projection(an: Analysis, eqn: Eqn, abstracts):
    """Sorted rows ``[.., s, D]`` times an expert weight ``[E, D, F]`` over D: every expert on every sorted copy."""
    from moe_lowering.passes.rules_dot import _dot_out_roles

    lhs, rhs = eqn.inputs
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    for swap in (False, True):
        x, w, ax, aw = (rhs, lhs, abstracts[1], abstracts[0]) if swap else (lhs, rhs, abstracts[0], abstracts[1])
        xc, wc, xb, wb = (tuple(rc), tuple(lc), tuple(rb), tuple(lb)) if swap else (tuple(lc), tuple(rc), tuple(lb),
                                                                                    tuple(rb))
        if not isinstance(ax, Rows) or aw is not None or ax.space != "sorted" or EXPERT in ax.roles:
            continue
        if len(w.shape) != 3 or xb or wb or len(xc) != 1 or ax.roles[xc[0]] != FEATURE or len(wc) != 1:
            continue
        found = expert_weight(an, w, wc[0])
        if found is None:
            continue
        index, e_dim = found
        node = ExpertMatmul(ax.node, index, eqn.params.get("preferred_element_type"))
        roles = _dot_out_roles(ax.roles, tuple(EXPERT if d == e_dim else FEATURE for d in range(3)), xc, wc, xb, wb,
                               swap)
        return Rows(roles, node, "dense", ax.tokens, style=SORTED_RANGE_MASK)
    return FailedMatch("the sorted copies (or their sorted outputs) meet a matmul that is not a product with an expert "
                       f"weight [E={an.num_experts}, d, f]", eqn)


# ------------------------------------------------------------------------- gathers


def sorted_gather(an: Analysis, eqn: Eqn, abstracts):
    """The tokens gathered at ``order // k`` (the sorted copies), and the sorted outputs gathered back by
    ``argsort(order)`` (un-sorted)."""
    operand, index = abstracts[0], abstracts[1]
    if isinstance(operand, Rows):
        return _unsort(an, eqn, operand, index)
    if isinstance(index, SortOrder) and _is_repeated_token_iota(an, eqn.inputs[0]):
        return _copy_tokens(an, eqn, index)
    if operand is not None or not isinstance(index, SortOrder):
        return FailedMatch("a gather in the sort-based dispatch that is neither the tokens at order // k nor the "
                           "sorted outputs by argsort(order)", eqn, OWN_EXPERT)
    tiled = tiled_tokens(an, eqn.inputs[0]) if index.divisor is None and not index.inverse else None
    if tiled is not None:  # jnp.repeat(x, k, axis)[order]: copy n of the tiled tokens is token n // k
        roles = _gathered_roles(eqn, tiled[1], index, COPY)
        if roles is None:
            return FailedMatch("the tokens tiled per choice are gathered by the sort order other than one whole row "
                               "per sorted copy", eqn, OWN_EXPERT)
        return Rows(roles, RowInput(), "sorted", tiled[0], style=SORTED_RANGE_MASK)
    if index.inverse or index.divisor != an.anchor.top_k:
        by = ("the inverse order" if index.inverse else "the sort order itself" if index.divisor is None
              else f"order // {index.divisor}")
        return FailedMatch(f"values are gathered by {by}: the sorted copies' tokens are order // k "
                           f"(k = {an.anchor.top_k}) of the tokens, or the order of the tokens tiled per choice",
                           eqn, OWN_EXPERT)
    tokens = eqn.inputs[0]
    n = len(an.token_shape)
    if tuple(tokens.shape[:-1]) != tuple(an.token_shape):
        return FailedMatch(f"a {list(tokens.shape)} value is gathered at the sorted copies' tokens (order // k), not "
                           f"the tokens [{', '.join(map(str, an.token_shape))}, d]", eqn, OWN_EXPERT)
    roles = _gathered_roles(eqn, token_roles(n) + (FEATURE,), index, token_roles(n)[-1])
    if roles is None:
        return FailedMatch("the tokens are gathered at order // k other than one whole row per sorted copy of each "
                           "token row", eqn, OWN_EXPERT)
    from moe_lowering.passes.rules_dot import _token_source

    return Rows(roles, RowInput(), "sorted", _token_source(an.graph, tokens), style=SORTED_RANGE_MASK)


def _is_repeated_token_iota(an: Analysis, atom) -> bool:
    """``atom`` is ``jnp.repeat(jnp.arange(T), k)`` for the T tokens (one token axis) and the routing's k:
    ``iota(T)`` broadcast to ``[T, k]`` along its first axis, merged: entry ``n`` is ``n // k``."""
    k, token_shape = an.anchor.top_k, tuple(an.token_shape)
    reshape = _producer(an, atom)
    if len(token_shape) != 1 or reshape is None or reshape.primitive is not lax.reshape_p:
        return False
    broadcast = _producer(an, reshape.inputs[0])
    if (broadcast is None or broadcast.primitive is not lax.broadcast_in_dim_p
            or tuple(broadcast.params["broadcast_dimensions"]) != (0,)
            or tuple(broadcast.outputs[0].shape) != token_shape + (k,) or tuple(atom.shape) != (token_shape[0] * k,)
            or reshape.params.get("dimensions") is not None):
        return False
    iota = _producer(an, broadcast.inputs[0])
    return (iota is not None and iota.primitive is lax.iota_p and tuple(iota.params["shape"]) == token_shape
            and iota.params["dimension"] == 0 and _holds_integers_up_to(iota.outputs[0].dtype, token_shape[0] - 1))


def _copy_tokens(an: Analysis, eqn: Eqn, order: SortOrder):
    """``jnp.repeat(jnp.arange(T), k)[order]``: entry ``s`` is ``order[s] // k``, the token of the copy sorted to
    ``s``, as ``order // k`` (one entry per sorted position, of the order itself)."""
    dnums = eqn.params["dimension_numbers"]
    scalar = (tuple(dnums.offset_dims) == () and tuple(dnums.collapsed_slice_dims) == (0,)
              and tuple(dnums.start_index_map) == (0,) and tuple(eqn.params["slice_sizes"]) == (1,)
              and not tuple(getattr(dnums, "operand_batching_dims", ())))
    if order.inverse or order.divisor is not None or order.roles != (SORTED, ONE) or not scalar:
        return FailedMatch("the tokens repeated per choice (jnp.repeat(jnp.arange(T), k)) are gathered by an index "
                           "that is not the sort order, one entry per sorted position", eqn, OWN_EXPERT)
    return SortOrder((SORTED,), divisor=an.anchor.top_k)


def _unsort(an: Analysis, eqn: Eqn, rows: Rows, index):
    if rows.space != "sorted" or EXPERT in rows.roles or SORTED not in rows.roles:
        return FailedMatch("the sorted copies' rows are gathered before each copy's own expert is kept and summed over "
                           "E", eqn, OWN_EXPERT)
    if not (isinstance(index, SortOrder) and index.inverse):
        by = ("the sort order itself" if isinstance(index, SortOrder)
              else "an index that is not argsort of the sort order")
        return FailedMatch(f"the sorted outputs are gathered back by {by}: the un-sort is not the inverse permutation "
                           "of the sort, so copies do not return to their own (token, choice)", eqn, OWN_EXPERT)
    roles = _gathered_roles(eqn, rows.roles, index, SORTED)
    if roles is None:
        return FailedMatch("the sorted outputs are gathered back other than one whole row per copy along the sorted "
                           "positions of their own row", eqn, OWN_EXPERT)
    return replace(rows, roles=roles, space="choice")  # rules_copies.split_copies splits COPY into (token, k)


def _gathered_roles(eqn: Eqn, operand_roles, index: SortOrder, along: str):
    """Output roles of ``take_along_axis(operand, index[..., None], axis of along)``: one whole slice per index
    entry, the index's other axes batched against the operand's axes of the same role; else ``None``."""
    dnums = eqn.params["dimension_numbers"]
    if along not in operand_roles or not index.roles or index.roles[-1] != ONE:
        return None
    axis = operand_roles.index(along)
    if tuple(dnums.start_index_map) != (axis,) or tuple(dnums.collapsed_slice_dims) != (axis,):
        return None
    operand_batch = tuple(getattr(dnums, "operand_batching_dims", ()))
    index_batch = tuple(getattr(dnums, "start_indices_batching_dims", ()))
    batch_roles = index.roles[:-1]
    if any(operand_roles[o] != batch_roles[i] for o, i in zip(operand_batch, index_batch)):
        return None
    if sorted(operand_roles[o] for o in operand_batch) != sorted(r for r in batch_roles if is_token(r)):
        return None
    shape = eqn.inputs[0].shape
    offsets = [d for d in range(len(shape)) if d != axis and d not in operand_batch]
    if any(eqn.params["slice_sizes"][d] != shape[d] for d in offsets):
        return None
    roles, batch, offset = [], iter(batch_roles), iter(offsets)
    for d in range(len(eqn.outputs[0].shape)):
        roles.append(operand_roles[next(offset)] if d in tuple(dnums.offset_dims) else next(batch))
    return tuple(roles)


def sorted_scatter(an: Analysis, eqn: Eqn, abstracts):
    """``jnp.bincount(flat, length=E)`` of the copies' indices (one sorted row: no token axis left): a
    scatter-add of ones at each copy's expert into zeros, the per-expert counts. ``zeros.at[order].set(out)``:
    the sorted outputs un-sorted by writing each back where its copy came from."""
    operand, _, updates = eqn.inputs[:3]
    index = abstracts[1]
    dnums = eqn.params["dimension_numbers"]
    if isinstance(abstracts[2], Rows):
        return _unsort_by_scatter(an, eqn, abstracts[2], index)
    if (eqn.primitive is lax.scatter_add_p and isinstance(index, CopyIndex) and index.roles == (COPY, ONE)
            and abstracts[0] is None and abstracts[2] is None and tuple(operand.shape) == (an.num_experts,)
            and _is_zero(an.graph, operand) and scalar_constant(an.graph, updates) == 1
            and not tuple(dnums.update_window_dims) and tuple(dnums.inserted_window_dims) == (0,)
            and tuple(dnums.scatter_dims_to_operand_dims) == (0,)):
        return ExpertCounts((EXPERT,))
    return FailedMatch("a scatter in the sort-based dispatch that is not a bincount (ones added into zeros of E "
                       "experts at the copies' indices), so its values are not the counts of the sorted copies", eqn,
                       OWN_EXPERT)


def _unsort_by_scatter(an: Analysis, eqn: Eqn, rows: Rows, index):
    """``zeros[n, F].at[order].set(out[s, F])``: row ``s`` written at ``order[s]``, every position once (a
    permutation), so copy ``n`` gets the output sorted to ``inverse[n]``: the gather by ``argsort(order)``.
    One sorted row (no token axis), whole rows written into zeros."""
    dnums = eqn.params["dimension_numbers"]
    summed = rows.space == "sorted" and EXPERT not in rows.roles and rows.roles == (SORTED, FEATURE)
    if not (summed and isinstance(index, SortOrder) and not index.inverse and index.divisor is None):
        return FailedMatch("the sorted outputs are written back by a scatter at an index that is not the sort order, "
                           "or before each copy's own expert is kept and summed over E: the un-sort is not the "
                           "inverse permutation of the sort", eqn, OWN_EXPERT)
    whole_rows = (eqn.primitive is lax.scatter_p and tuple(dnums.update_window_dims) == (1,)
                  and tuple(dnums.inserted_window_dims) == (0,) and tuple(dnums.scatter_dims_to_operand_dims) == (0,)
                  and index.roles == (SORTED, ONE) and _is_zero(an.graph, eqn.inputs[0]))
    if not whole_rows:
        return FailedMatch("the sorted outputs are scattered other than as whole rows set into zeros at the sort "
                           "order", eqn, OWN_EXPERT)
    return replace(rows, roles=(COPY, FEATURE), space="choice")
