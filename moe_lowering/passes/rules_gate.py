"""Rules that recognise routing weights (a ``Gate``): a one-hot mask times per-(token, choice)
or per-(token, expert) factors, divided, selected on, compared with zero, or written by a scatter of
the top-k weights into zeros (also as autodiff emits it); a gate times the tokens broadcast along the
experts starts expert rows (``rules_rows._gated_tokens``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from jax import lax

from moe_lowering.passes.abstract import (
    BROADCAST,
    CHOICE,
    EXPERT,
    ONE,
    Factor,
    Gate,
    PackedIndices,
    is_token,
    token_roles,
)
from moe_lowering.passes.graph import Const, Eqn, JaxprGraph, Value
from moe_lowering.passes.match_core import (
    Analysis,
    FailedMatch,
    _broadcast_source,
    _is_scalar,
    _is_zero,
    _plain_roles,
    rule,
)
from moe_lowering.passes.rules_rows import _gated_tokens
from moe_lowering.passes.rules_sort import involves_sorted_dispatch, sorted_scatter


def _gate_arith(an: Analysis, eqn: Eqn, abstracts):
    prim = eqn.primitive
    out = eqn.outputs[0]
    if prim is lax.convert_element_type_p:
        return replace(abstracts[0], boolean=False)
    if prim is lax.mul_p:
        gate_pos = 0 if isinstance(abstracts[0], Gate) else 1
        gate, other = abstracts[gate_pos], abstracts[1 - gate_pos]
        if other is not None:
            return None
        atom = eqn.inputs[1 - gate_pos]
        gated_tokens = _gated_tokens(an, gate, eqn.inputs[gate_pos], atom, out)
        if gated_tokens is not None:
            return gated_tokens
        return _with_factor(an, gate, atom, out, eqn)
    if prim is lax.div_p and isinstance(abstracts[0], Gate) and abstracts[1] is None:
        return _with_factor(an, abstracts[0], eqn.inputs[1], out, eqn, reciprocal=True)
    if prim in (lax.gt_p, lax.ne_p) and isinstance(abstracts[0], Gate) and abstracts[1] is None:
        # ``one_hot(idx).sum(choices) > 0``: the choices are distinct, so the count is the 0/1 mask
        gate = abstracts[0]
        if not gate.factors and _is_zero(an.graph, eqn.inputs[1]):
            return replace(gate, boolean=True)
        return None
    if prim is lax.select_n_p and isinstance(abstracts[0], Gate) and abstracts[0].boolean:
        on_false, on_true = eqn.inputs[1], eqn.inputs[2]
        if abstracts[1] is None and abstracts[2] is None and _is_zero(an.graph, on_false):
            return _with_factor(an, replace(abstracts[0], boolean=False), on_true, out, eqn)
    return None


def _with_factor(an: Analysis, gate: Gate, atom, out, eqn, reciprocal: bool = False):
    if isinstance(atom, Const) and _is_scalar(atom):
        return replace(gate, factors=gate.factors + (Factor(atom, (), reciprocal),))
    source, roles = _plain_roles(an.graph, atom, gate.roles, out.shape)
    if any(r in (ONE, BROADCAST) and n != 1 for r, n in zip(roles, source.shape)):
        return None  # varies along an axis routing weights do not have (a capacity slot, say)
    if not all(is_token(r) or r in (CHOICE, EXPERT, ONE) for r in roles) or (CHOICE in roles and EXPERT in roles):
        return FailedMatch("routing mask multiplied by a tensor that is not indexed by (token, choice) or (token, expert)", eqn)
    if reciprocal and EXPERT in roles:
        return None  # a per-expert divisor of a [T, E] gate is not a per-choice weight we can read
    return replace(gate, factors=gate.factors + (Factor(source, roles, reciprocal),))


@rule(lax.scatter_p, lax.scatter_add_p)
def _scatter(an: Analysis, eqn: Eqn, abstracts):
    """``zeros[T, E].at[arange(T)[:, None], idx].set(w)``: routing weights by scatter, or by the chain
    autodiff computes it with (``_differentiated_scatter_set``); the factor is the scatter's own
    updates (there the masked ``w``, equal to it), so the region reads what the program reads."""
    operand, indices, updates = eqn.inputs[:3]
    packed = abstracts[1]
    if involves_sorted_dispatch(abstracts):  # jnp.bincount of the copies' expert indices
        return sorted_scatter(an, eqn, abstracts)
    if not isinstance(packed, PackedIndices):
        return None
    if abstracts[0] is not None or abstracts[2] is not None:
        return FailedMatch("a scatter of routing indices into something other than zeros", eqn)
    if not _is_zero(an.graph, operand):
        differentiated = _differentiated_scatter_set(an.graph, eqn)
        if differentiated is None:
            return FailedMatch("a scatter of routing indices into something other than zeros", eqn)
        if not differentiated:
            return differentiated
    dnums = eqn.params["dimension_numbers"]
    if tuple(dnums.update_window_dims) or len(packed.components) != len(operand.shape):
        return FailedMatch("a scatter of routing indices with window dimensions", eqn)
    roles = [ONE] * len(operand.shape)
    for component, operand_dim in zip(packed.components, dnums.scatter_dims_to_operand_dims):
        roles[operand_dim] = component
    tokens = token_roles(len(an.token_shape))
    if sorted(r for r in roles if is_token(r)) != sorted(tokens) or roles.count(EXPERT) != 1:
        return FailedMatch("a scatter of routing indices that does not address every (token, expert)", eqn)
    source, factor_roles = _plain_roles(an.graph, updates, packed.roles, updates.shape)
    return Gate(tuple(roles), (Factor(source, factor_roles),))


def _differentiated_scatter_set(graph: JaxprGraph, eqn: Eqn):
    """The primal of a differentiated ``zeros.at[idx].set(w)`` (JAX's scatter JVP, for indices not
    declared unique): distinct ids (an iota) are scattered to ``idx`` and gathered back, the operand
    is kept where no id landed and ``w`` where its own id came back, then added:
    ``scatter_add(select_n(ids_at == 0, 0, zeros), idx, select_n(ids == ids_at[idx], 0, w))``. The
    operand is zero either way; the caller has proven ``idx`` distinct (a top-k per token), so every
    id comes back and the mask keeps all of ``w``: the value is ``zeros.at[idx].set(w)``. True, or
    a FailedMatch naming the piece of the chain that is not there (None where there is no chain)."""
    if eqn.primitive is not lax.scatter_add_p:
        return None
    operand, indices, updates = eqn.inputs[:3]
    kept = _select_of_zero(graph, operand)
    if kept is None or not _is_zero(graph, kept[1]):
        return None
    masked = _select_of_zero(graph, updates)
    if masked is None:
        return None
    mask = graph.producer.get(masked[0])
    if mask is None or mask.primitive is not lax.eq_p:
        return FailedMatch("a scatter-add into a masked zero whose updates are not masked by an id comparison", eqn)
    dnums = eqn.params["dimension_numbers"]
    for ids, gathered in (mask.inputs, mask.inputs[::-1]):
        gather = graph.producer.get(gathered)
        if gather is not None and gather.primitive is lax.gather_p:
            break
    else:
        return FailedMatch("a scatter-add whose update mask does not compare ids with ids gathered back", eqn)
    scattered = graph.producer.get(gather.inputs[0])
    if (gather.inputs[1] is not indices or not _gathers_what_scatters(gather.params, dnums)
            or scattered is None or scattered.primitive is not lax.scatter_p
            or scattered.inputs[1] is not indices or scattered.inputs[2] is not ids
            or scattered.params["dimension_numbers"] != dnums or not _is_zero(graph, scattered.inputs[0])):
        return FailedMatch("a scatter-add whose update mask does not gather back the ids scattered to its indices", eqn)
    if not _distinct_ids(graph, ids):
        return FailedMatch("a scatter-add whose update mask compares ids that are not distinct (not an iota)", eqn)
    predicate = graph.producer.get(kept[0])
    if (predicate is None or predicate.primitive is not lax.eq_p
            or scattered.outputs[0] not in predicate.inputs):
        return FailedMatch("a scatter-add whose operand is not kept where the scattered ids left zeros", eqn)
    return True


def _select_of_zero(graph: JaxprGraph, atom):
    """``select_n(pred, zeros, x)``: ``(pred, x)``, else None."""
    select = graph.producer.get(atom) if isinstance(atom, Value) else None
    if select is None or select.primitive is not lax.select_n_p or len(select.inputs) != 3:
        return None
    if not _is_zero(graph, select.inputs[1]):
        return None
    return select.inputs[0], select.inputs[2]


def _gathers_what_scatters(gather_params: dict, dnums) -> bool:
    """The gather reads back one element at each place the scatter wrote one."""
    gnums = gather_params["dimension_numbers"]
    return (not tuple(gnums.offset_dims) and tuple(gnums.collapsed_slice_dims) == tuple(dnums.inserted_window_dims)
            and tuple(gnums.start_index_map) == tuple(dnums.scatter_dims_to_operand_dims)
            and all(size == 1 for size in gather_params["slice_sizes"]))


def _distinct_ids(graph: JaxprGraph, atom) -> bool:
    """``iota(n).reshape(shape) [+ c]``: pairwise distinct integers (the type holds ``0..n-1``; adding
    a scalar, wrapping or not, keeps them distinct)."""
    eqn = graph.producer.get(atom) if isinstance(atom, Value) else None
    if eqn is not None and eqn.primitive is lax.add_p:
        plain = [a for a in eqn.inputs if not _is_scalar_broadcast(graph, a)]
        if len(plain) != 1:
            return False
        atom = plain[0]
        eqn = graph.producer.get(atom) if isinstance(atom, Value) else None
    if eqn is not None and eqn.primitive is lax.reshape_p:
        eqn = graph.producer.get(eqn.inputs[0]) if isinstance(eqn.inputs[0], Value) else None
    if eqn is None or eqn.primitive is not lax.iota_p or len(eqn.outputs[0].shape) != 1:
        return False
    dtype = np.dtype(eqn.outputs[0].dtype)
    return np.issubdtype(dtype, np.integer) and np.iinfo(dtype).max >= eqn.outputs[0].shape[0] - 1


def _is_scalar_broadcast(graph: JaxprGraph, atom) -> bool:
    source, _ = _broadcast_source(graph, atom)
    return isinstance(source, Const) and _is_scalar(source)
