"""The matcher's canonicalization step: what a program may contain that does not change what it means.

Annotations (a remat name, a sharding constraint) are identities: ``identity_annotations`` lists them,
and matching, the derivative bounds and the token source see through them; on expert rows a remat
name is kept by ``_annotation``, the rule for every one of them. A cast keeps expert indices when
the new type holds each of them (``_holds_integers_up_to``). ``_params_tuple`` is an eqn's params in
one canonical, hashable order (how a replayed eqn records them). ``floor_division_fixup`` sees
``jnp.floor_divide``'s sign correction, a no-op for a non-negative dividend. ``unit_axes_source``
sees through steps that only insert or drop unit axes (``x[:, None, None, :]`` squeezed). A ``dot_general``
is read as a ``CanonicalProduct``: an operand only broadcast along batch axes unbroadcast
(``unbatched_product``), and a weight whose parts the uses take apart one by one read part by part
(``weight_parts``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from moe_lowering import _compat
from moe_lowering.expert_program import Elementwise
from moe_lowering.passes.abstract import Combined, Rows, WeightPart
from moe_lowering.passes.graph import Const, Eqn, Value

if TYPE_CHECKING:
    from moe_lowering.passes.match_core import Analysis


@functools.cache
def identity_annotations() -> tuple:
    """Primitives that only annotate a value (a remat name, a sharding): the canonical program is
    the same without them, so matching sees through them."""
    return (_compat.name_p, _compat.sharding_constraint_p) + _compat.varying_casts


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


@dataclass(frozen=True)
class CanonicalProduct:
    """A ``dot_general`` the matcher reads in place of a program's: ``eqn`` (outside the graph; its operands
    are program values or ``WeightPart``s of one) computes the same values laid out by ``dims``, the
    program's output dim ``i`` being ``eqn``'s dim ``dims[i]``, or an axis ``eqn`` does not have where
    ``None`` (a unit axis; for a part, the axis of the parts)."""

    eqn: Eqn
    dims: tuple


def canonical_product(graph, eqn: Eqn) -> CanonicalProduct:
    """``eqn``, a ``dot_general``, as ``unbatched_product`` reads it, or as it is."""
    return unbatched_product(graph, eqn) or CanonicalProduct(eqn, tuple(range(len(eqn.outputs[0].shape))))


def unbatched_product(graph, eqn: Eqn) -> CanonicalProduct | None:
    """A ``dot_general`` one operand of which is only a broadcast along batch axes of the product (bonsai
    GPT-OSS's ``einsum('enh,ehd->end', broadcast_to(x[None], (E, T, H)), W)``, Gemma 4's
    ``repeat(expand_dims(x, (0, 1)), E, 1)``), as the product of the value broadcast, those axes free on the
    other operand (``einsum('th,ehd->ted', x, W)``): every output element is the same sum of the same
    products. ``None`` unless some batch axis is such a broadcast, every other axis of that operand a unit
    axis or one of the value's (through ``_unit_view``: broadcasts, unit reshapes, annotations)."""
    from moe_lowering.passes.rules_rows import _unit_view

    contract, batch = eqn.params["dimension_numbers"]
    for side in (0, 1):
        operand, other = eqn.inputs[side], eqn.inputs[1 - side]
        source, mapping = _unit_view(graph, operand)
        if source is operand or None in mapping or any(
                source.shape[s] != operand.shape[d] for s, d in enumerate(mapping)):
            continue
        source_dim = {d: s for s, d in enumerate(mapping)}
        spread = [i for i, d in enumerate(batch[side]) if d not in source_dim]
        free = [d for d in range(len(operand.shape)) if d not in contract[side] and d not in batch[side]]
        if not spread or any(d not in source_dim for d in contract[side]) or any(
                d not in source_dim and operand.shape[d] != 1 for d in free):
            continue
        kept = [i for i in range(len(batch[side])) if i not in spread]
        own_c, own_b = tuple(source_dim[d] for d in contract[side]), tuple(source_dim[batch[side][i]] for i in kept)
        other_b = tuple(batch[1 - side][i] for i in kept)
        own_free = [("own", s) for s in range(len(source.shape)) if s not in own_c and s not in own_b]
        other_free = [("other", d) for d in range(len(other.shape)) if d not in contract[1 - side] and d not in other_b]
        labels = [("batch", i) for i in kept] + (own_free + other_free if side == 0 else other_free + own_free)
        program_own = [("own", source_dim[d]) if d in source_dim else None for d in free]
        program_other = [("other", d) for d in range(len(other.shape))
                         if d not in contract[1 - side] and d not in batch[1 - side]]
        program = [("batch", i) if i in kept else ("other", batch[1 - side][i]) for i in range(len(batch[side]))]
        program += program_own + program_other if side == 0 else program_other + program_own
        sizes = {("batch", i): other.shape[batch[1 - side][i]] for i in kept}
        sizes.update({("own", s): source.shape[s] for s in range(len(source.shape))})
        sizes.update({("other", d): other.shape[d] for d in range(len(other.shape))})
        numbers = ((own_c, tuple(contract[1])), (own_b, other_b)) if side == 0 else (
            (tuple(contract[0]), own_c), (other_b, own_b))
        inputs = (source, other) if side == 0 else (other, source)
        product = _product_eqn(eqn, inputs, numbers, tuple(sizes[label] for label in labels))
        return CanonicalProduct(product, tuple(None if label is None else labels.index(label) for label in program))
    return None


def weight_parts(view: CanonicalProduct, axis: int) -> tuple[CanonicalProduct, ...] | None:
    """``view``'s product read part by part along the program's output ``axis``, where that is a free axis
    of an operand: one product per index, with that operand's ``WeightPart`` (Gemma 4's
    ``x1, x2 = einsum('td,ekfd->ketf', x, W)`` as ``x @ W[:, 0]`` and ``x @ W[:, 1]``). Each part's
    ``dims`` has ``None`` at ``axis``."""
    eqn = view.eqn
    position = view.dims[axis]
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if position is None or position < len(lb):
        return None
    lhs_free = [d for d in range(len(eqn.inputs[0].shape)) if d not in lc and d not in lb]
    rhs_free = [d for d in range(len(eqn.inputs[1].shape)) if d not in rc and d not in rb]
    side, dim = (0, lhs_free[position - len(lb)]) if position - len(lb) < len(lhs_free) else (
        1, rhs_free[position - len(lb) - len(lhs_free)])
    whole = eqn.inputs[side]
    if isinstance(whole, WeightPart):
        return None

    def shifted(dims):
        return tuple(d - (d > dim) for d in dims)

    numbers = ((shifted(lc), rc), (shifted(lb), rb)) if side == 0 else ((lc, shifted(rc)), (lb, shifted(rb)))
    shape = tuple(n for d, n in enumerate(eqn.outputs[0].shape) if d != position)
    dims = tuple(None if i == axis or d is None else d - (d > position) for i, d in enumerate(view.dims))
    parts = []
    for index in range(whole.shape[dim]):
        inputs = list(eqn.inputs)
        inputs[side] = WeightPart(whole, dim, index)
        parts.append(CanonicalProduct(_product_eqn(eqn, tuple(inputs), numbers, shape), dims))
    return tuple(parts)


def taken_apart_axis(graph, value) -> int | None:
    """The axis (of 2 or more) of ``value`` whose every use reads single indices of it, seen through
    transposes and annotations: ``x1, x2 = h`` (``unstack``), ``h[0]`` and ``h[1]`` (``slice``), ``jnp.split``
    into single indices. ``None`` where a use reads more, or where ``value`` leaves the function."""
    if value in graph.output_set:
        return None
    axes = {_axis_read_by(graph, user, value) for user in graph.users.get(value, ())}
    if len(axes) != 1 or None in axes:
        return None
    axis = axes.pop()
    return axis if value.shape[axis] >= 2 else None


def _axis_read_by(graph, user: Eqn, value) -> int | None:
    from jax import lax

    if user.inputs[0] is not value:
        return None
    if user.primitive is lax.transpose_p or user.primitive in identity_annotations():
        inner = taken_apart_axis(graph, user.outputs[0])
        return None if inner is None else (user.params["permutation"][inner] if user.primitive is lax.transpose_p
                                           else inner)
    if _compat.unstack_p is not None and user.primitive is _compat.unstack_p:
        return user.params["axis"]
    if user.primitive is lax.split_p:
        return user.params["axis"] if set(user.params["sizes"]) == {1} else None
    if user.primitive in (lax.slice_p, lax.dynamic_slice_p):
        if user.primitive is lax.dynamic_slice_p and not all(isinstance(a, Const) for a in user.inputs[1:]):
            return None
        changed = [d for d, (a, b) in enumerate(zip(value.shape, user.outputs[0].shape)) if a != b]
        return changed[0] if len(changed) == 1 and user.outputs[0].shape[changed[0]] == 1 else None
    return None


def _product_eqn(eqn: Eqn, inputs, dimension_numbers, shape) -> Eqn:
    """A ``dot_general`` like ``eqn`` (its source location, its precision and result type) of ``inputs``."""
    output = Value(_compat.ShapedArray(shape, eqn.outputs[0].dtype))
    params = dict(eqn.params, dimension_numbers=dimension_numbers)
    return Eqn(eqn.index, eqn.primitive, params, tuple(inputs), (output,), eqn.source, eqn.callers)


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
