"""Rules that recognise routing: the anchors (``top_k``, ``approx_max_k``, ``argmax``, ``argsort(...)[..., :k]``),
the expert indices' arithmetic (casts that keep them, the normalisation of negative indices), their
range checks (``IndexInBounds``), the one-hot comparison with an iota or an expert number, and the
iota itself.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from jax import lax

from moe_lowering.passes.abstract import (
    BROADCAST,
    EXPERT,
    ONE,
    ExpertIndex,
    Gate,
    Iota,
    NegativeIndexCheck,
    Rows,
    ShiftedIndex,
)
from moe_lowering.passes.canonicalize import _holds_integers_up_to
from moe_lowering.passes.graph import Const, Eqn, JaxprGraph
from moe_lowering.passes.match_core import (
    ITERATION_ROLE,
    Analysis,
    FailedMatch,
    IndexInBounds,
    RoutingAnchor,
    _broadcast_source,
    _is_zero,
    _merge_roles,
    rule,
)


def find_anchors(graph: JaxprGraph) -> list[RoutingAnchor]:
    """Routing decisions over the last axis: ``top_k``, ``approx_max_k``, ``argmax``, and ``argsort(...)[..., :k]``."""
    anchors = []
    for eqn in graph.eqns:
        if eqn.primitive is lax.sort_p:
            anchors.extend(_argsort_anchors(graph, eqn))
        if eqn.primitive is lax.top_k_p:
            scores = eqn.inputs[0]
            axis = eqn.params.get("axis", len(scores.shape) - 1)
            if axis not in (-1, len(scores.shape) - 1) or len(scores.shape) < 2:
                continue
            k = eqn.params["k"]
            anchors.append(RoutingAnchor(eqn, eqn.outputs[1], scores.shape[-1], k, scores.shape[:-1], "top_k"))
        elif eqn.primitive is lax.approx_top_k_p:
            anchors.extend(_approx_top_k_anchor(eqn))
        elif eqn.primitive is lax.argmax_p:
            scores = eqn.inputs[0]
            if tuple(eqn.params["axes"]) != (len(scores.shape) - 1,) or len(scores.shape) < 2:
                continue
            anchors.append(RoutingAnchor(eqn, eqn.outputs[0], scores.shape[-1], 1, scores.shape[:-1], "argmax"))
    return anchors


def _approx_top_k_anchor(eqn: Eqn) -> list[RoutingAnchor]:
    """``lax.approx_max_k`` / ``approx_min_k`` over the last axis. On a CPU or GPU it is an exact top-k; on
    a TPU its indices may miss some of the true top k (recall below 1). Either way they are k distinct
    experts per token, and the replacement reads these very indices (the router stays the program's own),
    so the rewrite is exact whichever experts they name."""
    scores = eqn.inputs[0]
    last = len(scores.shape) - 1
    if eqn.params["reduction_dimension"] not in (-1, last) or last < 1:
        return []
    k = eqn.outputs[1].shape[-1]
    if k != eqn.params["k"]:  # aggregate_to_topk=False: candidates per bin, not k choices
        return []
    return [RoutingAnchor(eqn, eqn.outputs[1], scores.shape[-1], k, scores.shape[:-1], "approx_top_k")]


def _through_rev(graph: JaxprGraph, value, last: int):
    """``value`` with reversals along the last axis seen through (``argsort(descending=True)``)."""
    eqn = graph.producer.get(value)
    while eqn is not None and eqn.primitive is lax.rev_p and tuple(eqn.params["dimensions"]) == (last,):
        value = eqn.inputs[0]
        eqn = graph.producer.get(value)
    return value, eqn


def _argsort_anchors(graph: JaxprGraph, sort: Eqn) -> list[RoutingAnchor]:
    """``jnp.argsort(scores)`` sliced to k entries along the sorted (last) axis: a top-k by another name. Also
    the descending sort an XLA dump holds for ``top_k`` / ``approx_max_k`` on CPU and GPU, as the StableHLO
    importer reads it: ``sort(-scores, scores, iota)`` by the first key."""
    descending = len(sort.inputs) == 3 and _negation_of(graph, sort.inputs[0], sort.inputs[1])
    if len(sort.inputs) != 2 + descending or sort.params.get("num_keys") != 1:
        return []
    last = len(sort.inputs[0].shape) - 1
    if sort.params["dimension"] != last or last < 1:
        return []
    _, iota = _through_rev(graph, sort.inputs[-1], last)
    if not _iota_along(graph, iota, last):
        return []
    indices = [sort.outputs[-1]]
    for user in graph.users.get(sort.outputs[1], ()):
        if user.primitive is lax.rev_p and tuple(user.params["dimensions"]) == (last,):
            indices.append(user.outputs[0])
    num_experts = sort.inputs[0].shape[-1]
    anchors = []
    for value in indices:
        for user in graph.users.get(value, ()):
            if user.primitive is not lax.slice_p:
                continue
            out_shape = user.outputs[0].shape
            if out_shape[:-1] != value.shape[:-1] or not 0 < out_shape[-1] < num_experts:
                continue
            if (user.params.get("strides") or (1,) * len(out_shape))[-1] != 1:
                continue
            anchors.append(RoutingAnchor(user, user.outputs[0], num_experts, out_shape[-1], out_shape[:-1], "argsort"))
    return anchors


def _iota_along(graph: JaxprGraph, eqn: Eqn | None, axis: int) -> bool:
    """``eqn`` makes an iota along ``axis``, itself or by broadcasting one (as an XLA dump writes it)."""
    if eqn is not None and eqn.primitive is lax.broadcast_in_dim_p:
        source = graph.producer.get(eqn.inputs[0])
        dims = eqn.params["broadcast_dimensions"]
        return (source is not None and source.primitive is lax.iota_p and dims[source.params["dimension"]] == axis
                and source.outputs[0].shape[source.params["dimension"]] == eqn.outputs[0].shape[axis])
    return eqn is not None and eqn.primitive is lax.iota_p and eqn.params["dimension"] == axis


def _negation_of(graph: JaxprGraph, key, value) -> bool:
    """``key`` is ``-value`` (or ``~value`` of integers): ascending in ``key`` is descending in ``value``."""
    eqn = graph.producer.get(key)
    return eqn is not None and eqn.primitive in (lax.neg_p, lax.not_p) and eqn.inputs[0] is value


def _bounds_arith(an: Analysis, eqn: Eqn, abstracts):
    """Range checks combine with ``and``; selecting on a complete one keeps the in-range case."""
    a = abstracts[0]
    if eqn.primitive is lax.and_p and all(isinstance(x, IndexInBounds) for x in abstracts):
        b = abstracts[1]
        return IndexInBounds(_merge_roles(a.roles, b.roles) or a.roles, a.lower or b.lower, a.upper or b.upper)
    if eqn.primitive is lax.select_n_p and isinstance(a, IndexInBounds) and a.lower and a.upper:
        if len(abstracts) == 3 and abstracts[1] is None and isinstance(abstracts[2], Rows):
            return abstracts[2]
    return None


def _index_arith(an: Analysis, eqn: Eqn, abstracts):
    prim = eqn.primitive
    a, b = (abstracts + [None])[:2]
    if prim is lax.lt_p and isinstance(a, (ExpertIndex, Iota)) and _is_zero(an.graph, eqn.inputs[1]):
        return NegativeIndexCheck(eqn.inputs[0])
    if prim is lax.add_p and isinstance(a, (ExpertIndex, Iota)) and b is None:
        return ShiftedIndex(eqn.inputs[0])
    if prim is lax.select_n_p and isinstance(a, NegativeIndexCheck):
        on_false, on_true = eqn.inputs[1], eqn.inputs[2]
        shifted = an.abstract(on_true)
        if on_false is a.of and isinstance(shifted, ShiftedIndex) and shifted.of is a.of:
            return an.abstract(a.of)
        return None
    if prim is lax.convert_element_type_p and isinstance(a, (ExpertIndex, Iota)):
        largest = an.num_experts - 1 if isinstance(a, ExpertIndex) else eqn.inputs[0].shape[a.roles.index(ITERATION_ROLE)] - 1
        if not _holds_integers_up_to(eqn.params["new_dtype"], largest):
            return FailedMatch(f"expert indices are cast to {np.dtype(eqn.params['new_dtype']).name}, which does not "
                               f"hold every index up to {largest}", eqn, "routing-indices")
        return a
    if prim is lax.eq_p:
        return _one_hot(an, eqn, a, b)
    if isinstance(a, ExpertIndex) and b is None and prim in (lax.ge_p, lax.gt_p, lax.le_p, lax.lt_p):
        bound, _ = _broadcast_source(an.graph, eqn.inputs[1])
        if isinstance(bound, Const) and np.size(bound.value) == 1:
            return _bounds_check(an, prim, a, float(np.asarray(bound.value).reshape(())))
    return None


def _bounds_check(an: Analysis, prim, index: ExpertIndex, bound: float):
    """``idx >= 0``, ``idx <= E - 1``, ``idx < E``: the range checks of a clamped or filled gather."""
    lower = (prim is lax.ge_p and bound <= 0) or (prim is lax.gt_p and bound < 0)
    upper = (prim is lax.le_p and bound >= an.num_experts - 1) or (prim is lax.lt_p and bound >= an.num_experts)
    return IndexInBounds(index.roles, lower, upper) if lower or upper else None


def _one_hot(an: Analysis, eqn: Eqn, a, b):
    """``idx == iota`` is a one-hot mask over experts; ``idx == e`` selects one expert."""
    if isinstance(b, ExpertIndex) and not isinstance(a, ExpertIndex):
        a, b = b, a
        lhs, rhs = eqn.inputs[1], eqn.inputs[0]
    else:
        lhs, rhs = eqn.inputs
    if not isinstance(a, ExpertIndex):
        return None
    if isinstance(b, Iota):
        axis = b.roles.index(ITERATION_ROLE)
        if a.roles[axis] != ONE or eqn.outputs[0].shape[axis] != an.num_experts:
            return FailedMatch("one-hot compares the indices with an iota that does not count the experts", eqn)
        roles = _merge_roles(a.roles, tuple(ONE if r == ITERATION_ROLE else r for r in b.roles))
        roles = roles[:axis] + (EXPERT,) + roles[axis + 1 :]
        return Gate(roles, boolean=True)
    if b is None:
        source, _ = _broadcast_source(an.graph, rhs)
        if isinstance(source, Const) and np.ndim(source.value) == 0:
            expert = int(source.value)
            if 0 <= expert < an.num_experts:
                return Gate(a.roles, expert=expert, boolean=True)
    return None


@rule(lax.reduce_and_p)
def _reduce_and(an: Analysis, eqn: Eqn, abstracts):
    value = abstracts[0]
    axes = tuple(eqn.params["axes"])
    if isinstance(value, IndexInBounds) and all(value.roles[a] == ONE for a in axes):
        return replace(value, roles=tuple(r for i, r in enumerate(value.roles) if i not in axes))
    return None


@rule(lax.iota_p)
def _iota(an: Analysis, eqn: Eqn, abstracts):
    shape = eqn.params["shape"]
    dim = eqn.params["dimension"]
    return Iota(tuple(ITERATION_ROLE if d == dim else (ONE if s == 1 else BROADCAST) for d, s in enumerate(shape)))
