"""The matcher's canonicalization step: what a program may contain that does not change what it means.

Annotations (a remat name, a sharding constraint) are identities: ``identity_annotations`` lists them,
and matching, the derivative bounds and the token source see through them; on expert rows a remat
name is kept by ``_annotation``, the rule for every one of them. A cast keeps expert indices when
the new type holds each of them (``_holds_integers_up_to``). ``_params_tuple`` is an eqn's params in
one canonical, hashable order (how a replayed eqn records them). ``floor_division_fixup`` sees
``jnp.floor_divide``'s sign correction, a no-op for a non-negative dividend. ``unit_axes_source``
sees through steps that only insert or drop unit axes (``x[:, None, None, :]`` squeezed).
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


def is_identity_rounding(eqn: Eqn) -> bool:
    """``reduce_precision`` to its operand's own exponent and mantissa widths: the identity on its values.
    JAX's remat puts one on each residual it saves (against excess precision, jax PR 22244), between the
    layer's dense value and the backward that reads it."""
    import jax.numpy as jnp
    from jax import lax

    if eqn.primitive is not lax.reduce_precision_p or not jnp.issubdtype(eqn.inputs[0].dtype, jnp.floating):
        return False
    info = jnp.finfo(eqn.inputs[0].dtype)
    return (eqn.params.get("exponent_bits"), eqn.params.get("mantissa_bits")) == (info.nexp, info.nmant)


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


def floor_division_fixup(graph, eqn: Eqn):
    """``(quotient, dividend, divisor)`` where ``eqn`` is the last step of ``jnp.floor_divide`` of integers,
    ``select_n(sign(a) != sign(b) & rem(a, b) != 0, div(a, b), div(a, b) - 1)``, with ``b`` a positive
    constant; else ``None``. For ``a >= 0`` the condition is false (``sign(a)`` differs from ``sign(b) = 1``
    only at ``a = 0``, where the remainder is 0), so the value is the truncating ``div(a, b)``: the caller
    proves ``a >= 0``."""
    from jax import lax

    if eqn.primitive is not lax.select_n_p or len(eqn.inputs) != 3:
        return None
    predicate, quotient, lowered = eqn.inputs
    producer = graph.producer.get
    div, sub, both = producer(quotient), producer(lowered), producer(predicate)
    if div is None or div.primitive is not lax.div_p or sub is None or sub.primitive is not lax.sub_p:
        return None
    dividend, divisor = div.inputs
    value = scalar_constant(graph, divisor)
    if sub.inputs[0] is not quotient or scalar_constant(graph, sub.inputs[1]) != 1 or value is None or value <= 0:
        return None
    if both is None or both.primitive is not lax.and_p:
        return None
    signs, remainder = (producer(a) for a in both.inputs)
    if signs is None or remainder is None or signs.primitive is not lax.ne_p or remainder.primitive is not lax.ne_p:
        return None
    sign_a, sign_b = (producer(_unbroadcast(graph, a)) for a in signs.inputs)
    rem = producer(remainder.inputs[0])
    if sign_a is None or sign_a.primitive is not lax.sign_p or sign_a.inputs[0] is not dividend:
        return None
    if not (scalar_constant(graph, signs.inputs[1]) == 1 or sign_b is not None and sign_b.primitive is lax.sign_p
            and scalar_constant(graph, sign_b.inputs[0]) == value):
        return None
    if (rem is None or rem.primitive is not lax.rem_p or rem.inputs[0] is not dividend
            or scalar_constant(graph, rem.inputs[1]) != value or scalar_constant(graph, remainder.inputs[1]) != 0):
        return None
    return quotient, dividend, value


def scalar_constant(graph, atom):
    """The number an operand of one element, or a broadcast of one, is, seen through casts (``jnp`` casts a
    Python int divisor); else None."""
    from jax import lax

    from moe_lowering.passes.graph import Const

    while not isinstance(atom, Const):
        eqn = graph.producer.get(atom)
        if eqn is None or eqn.primitive not in (lax.convert_element_type_p, lax.broadcast_in_dim_p):
            return None
        atom = eqn.inputs[0]
    return np.asarray(atom.value).reshape(()).item() if np.size(atom.value) == 1 else None


def _unbroadcast(graph, atom):
    """The value ``atom`` broadcasts (through ``broadcast_in_dim``), or ``atom``."""
    from jax import lax

    eqn = graph.producer.get(atom)
    while eqn is not None and eqn.primitive is lax.broadcast_in_dim_p:
        atom = eqn.inputs[0]
        eqn = graph.producer.get(atom)
    return atom


def unit_axes_source(graph, atom, shape):
    """``(source, dims)`` where ``atom`` holds the values of ``source``, the nearest value of shape ``shape``
    it comes from through steps that only insert or drop unit axes (``broadcast_in_dim`` to size-1 new
    axes, a ``squeeze``, a reshape adding or dropping 1s, annotations): ``dims[i]`` is the dim of ``atom``
    that ``source``'s dim ``i`` became. ``None`` where there is no such value (or a dim of it is not traced
    to one dim of ``atom``)."""
    from jax import lax

    mapping = list(range(len(atom.shape)))
    while tuple(atom.shape) != tuple(shape):
        eqn = graph.producer.get(atom)
        if eqn is None:
            return None
        source = eqn.inputs[0]
        if eqn.primitive in identity_annotations():
            inner = list(range(len(source.shape)))
        elif eqn.primitive is lax.broadcast_in_dim_p and _inserts_unit_axes(eqn):
            inner = list(eqn.params["broadcast_dimensions"])
        elif eqn.primitive is lax.squeeze_p:
            dropped = {d % len(source.shape) for d in eqn.params["dimensions"]}
            kept = iter(range(len(atom.shape)))
            inner = [None if d in dropped else next(kept) for d in range(len(source.shape))]
        elif (eqn.primitive is lax.reshape_p and eqn.params.get("dimensions") is None
              and _non_unit(source.shape) == _non_unit(atom.shape)):
            kept = iter(d for d, n in enumerate(atom.shape) if n != 1)
            inner = [None if n == 1 else next(kept) for n in source.shape]
        else:
            return None
        mapping = [None if d is None else mapping[d] for d in inner]
        atom = source
    return None if None in mapping else (atom, tuple(mapping))


def _non_unit(shape) -> tuple:
    return tuple(n for n in shape if n != 1)


def _inserts_unit_axes(eqn: Eqn) -> bool:
    """A ``broadcast_in_dim`` that keeps each operand dim's size, in order, and adds only size-1 dims."""
    dims = tuple(eqn.params["broadcast_dimensions"])
    shape, out = eqn.inputs[0].shape, eqn.outputs[0].shape
    new = [d for d in range(len(out)) if d not in dims]
    return (list(dims) == sorted(dims) and all(shape[i] == out[d] for i, d in enumerate(dims))
            and all(out[d] == 1 for d in new))
