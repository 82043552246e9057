"""Rules that recognise routing weights (a ``Gate``): a one-hot mask times per-(token, choice)
or per-(token, expert) factors, divided, selected on, compared with zero, or written by a scatter of
the top-k weights into zeros; a gate times the tokens broadcast along the experts starts expert rows
(``rules_rows._gated_tokens``).
"""

from __future__ import annotations

from dataclasses import replace

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
from moe_lowering.passes.graph import Const, Eqn
from moe_lowering.passes.match_core import Analysis, FailedMatch, _is_scalar, _is_zero, _plain_roles, rule
from moe_lowering.passes.rules_rows import _gated_tokens


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
    """``zeros[T, E].at[arange(T)[:, None], idx].set(w)``: routing weights by scatter."""
    operand, indices, updates = eqn.inputs[:3]
    packed = abstracts[1]
    if not isinstance(packed, PackedIndices):
        return None
    if abstracts[0] is not None or abstracts[2] is not None or not _is_zero(an.graph, operand):
        return FailedMatch("a scatter of routing indices into something other than zeros", eqn)
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
