"""The rule of every elementwise primitive: which family's arithmetic applies is read off the kinds
of its abstract operands (range checks, contributions and rows, expert indices, gates).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from moe_lowering.passes.abstract import (
    Combined,
    ExpertIndex,
    ExpertParamSlice,
    FusedRows,
    Gate,
    Iota,
    NegativeIndexCheck,
    Rows,
    ShiftedIndex,
)
from moe_lowering.passes.graph import Eqn
from moe_lowering.passes.match_core import Analysis, FailedMatch, IndexInBounds
from moe_lowering.passes.rules_copies import step_before_selection
from moe_lowering.passes.rules_gate import _gate_arith
from moe_lowering.passes.rules_layout import PARTS_NOT_TAKEN_APART
from moe_lowering.passes.rules_routing import _bounds_arith, _index_arith
from moe_lowering.passes.rules_sort import involves_sorted_dispatch, sorted_arith
from moe_lowering.passes.rules_rows import _as_contribution, _combined_arith, _is_contribution, _rows_elementwise


def _elementwise_rule(an: Analysis, eqn: Eqn, abstracts: list):
    prim = eqn.primitive
    if any(isinstance(a, IndexInBounds) for a in abstracts):
        return _bounds_arith(an, eqn, abstracts)
    if involves_sorted_dispatch(abstracts):  # copies sorted by expert, kept by a range mask
        return sorted_arith(an, eqn, abstracts)
    if prim is lax.add_p and any(_is_contribution(a) for a in abstracts):
        abstracts = [_as_contribution(a) for a in abstracts]
    kinds = {type(a) for a in abstracts if a is not None}
    if FusedRows in kinds:
        return FailedMatch(PARTS_NOT_TAKEN_APART, eqn)
    if Combined in kinds:
        return _combined_arith(an, eqn, abstracts)
    if Rows in kinds:
        before = step_before_selection(eqn, abstracts)
        return _rows_elementwise(an, eqn, abstracts) if before is None else before
    if kinds & {ExpertIndex, Iota, NegativeIndexCheck, ShiftedIndex}:
        return _index_arith(an, eqn, abstracts)
    if Gate in kinds:
        return _gate_arith(an, eqn, abstracts)
    if prim is lax.convert_element_type_p and isinstance(abstracts[0], ExpertParamSlice):
        # a cast that keeps every value of the slice (a widening one) is the slice; a narrowing one
        # (float32 -> int8, -> bfloat16) changes the weights the dense experts use, so it is not
        if jnp.promote_types(eqn.inputs[0].dtype, eqn.params["new_dtype"]) == jnp.dtype(eqn.params["new_dtype"]):
            return abstracts[0]
    return None
