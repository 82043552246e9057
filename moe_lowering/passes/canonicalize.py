"""The matcher's canonicalization step: what a program may contain that does not change what it means.

Annotations (a remat name, a sharding constraint) are identities: ``identity_annotations`` lists them,
and matching, the derivative bounds and the token source see through them; on expert rows a remat
name is kept by ``_annotation``, the rule for every one of them. A cast keeps expert indices when
the new type holds each of them (``_holds_integers_up_to``). ``_params_tuple`` is an eqn's params in
one canonical, hashable order (how a replayed eqn records them).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from moe_lowering import _compat
from moe_lowering.expert_program import Elementwise
from moe_lowering.passes.abstract import Combined, Rows
from moe_lowering.passes.graph import Eqn

if TYPE_CHECKING:
    from moe_lowering.passes.match_core import Analysis


@functools.cache
def identity_annotations() -> tuple:
    """Primitives that only annotate a value (a remat name, a sharding): the canonical program is
    the same without them, so matching sees through them."""
    return (_compat.name_p, _compat.sharding_constraint_p)


def _params_tuple(eqn: Eqn) -> tuple:
    return tuple(sorted(eqn.params.items()))


def _holds_integers_up_to(dtype, largest: int) -> bool:
    """Every integer in ``[0, largest]`` survives a cast to ``dtype`` unchanged."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return largest <= 1
    if np.issubdtype(dtype, np.integer):
        return np.iinfo(dtype).max >= largest
    if np.issubdtype(dtype, np.floating) or dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return largest <= 2 ** (ml_dtypes.finfo(dtype).nmant + 1)
    return False


def _annotation(an: Analysis, eqn: Eqn, abstracts):
    """``checkpoint_name`` / ``with_sharding_constraint``: the value's meaning passes through. On expert
    rows a remat name is kept (replayed on the sorted rows, so a remat policy still sees it); a
    sharding of the dense rows does not apply to sorted rows and is dropped. On the layer's output
    nothing passes through, so the annotation stays outside the region and applies to its result."""
    value = abstracts[0]
    if isinstance(value, Combined):
        return None
    if isinstance(value, Rows) and eqn.primitive is _compat.name_p:
        return replace(value, node=Elementwise(eqn.primitive, _params_tuple(eqn), (value.node,)))
    return value
