"""Where a routing value's derivative can be non-zero, proven from the program.

A capacity layer's combine tensor is differentiable (it carries the gates), and the sparse layer
reads it only at the slots the dispatch tensor fills. That is exact for the gradient too only if
combine's derivative is zero at every other slot. :func:`derivative_support` proves a bound on
where it can be non-zero, as a :class:`Support`: the program's own ops replayed on 0/1 indicators
(``value != 0`` of values without a derivative, the one-hot masks and slot positions). The device
check evaluates it (:func:`support_indicator`) and falls back to the dense layer where it reaches
an empty slot.

Why replaying is sound: the derivative of each op below is linear in its operands' derivatives
with coefficients that are the other, derivative-free operands, and each op is monotone on
non-negative inputs. So evaluating the op on non-negative indicators of (derivative bound, free
operand) gives a non-negative array that is zero wherever the true derivative must be zero:
``mul`` intersects, ``add`` unites, ``dot_general`` multiplies out (an outer product, or a sum
over the contracted axes), layout ops, slices and sums move or merge the bounds, ``select_n``
picks one. An op without such a rule bounds nothing (every element may vary), and a bound made
only of such unknowns is no proof.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from moe_lowering import _compat
from moe_lowering.passes.canonicalize import identity_annotations
from moe_lowering.passes.graph import Const, Eqn, JaxprGraph, Value

# Primitives whose outputs have a zero derivative whatever their inputs.
_ZERO_DERIVATIVE_NAMES = "floor ceil round sign stop_gradient iota argmax argmin is_finite"


@functools.cache
def _zero_derivative_primitives() -> frozenset:
    return frozenset(p for p in (getattr(lax, f"{n}_p", None) for n in _ZERO_DERIVATIVE_NAMES.split()) if p) | {
        _compat.stop_gradient_p}


@functools.cache
def _replayed_primitives() -> frozenset:
    """Ops whose derivative bound is the op itself applied to its operand's bound."""
    return frozenset((lax.neg_p, lax.reduce_precision_p, lax.copy_p, lax.broadcast_in_dim_p, lax.reshape_p,
                      lax.transpose_p, lax.squeeze_p, lax.slice_p, lax.reduce_sum_p, lax.rev_p)
                     + identity_annotations())


def is_float(atom) -> bool:
    return np.issubdtype(np.dtype(atom.dtype), np.inexact) if hasattr(atom, "dtype") else False


def tangent_free(graph: JaxprGraph, atom) -> bool:
    """``atom`` has a zero derivative with respect to every input of the program: it is an integer or
    boolean value, a constant, or computed from such values (through ``stop_gradient``, ``floor``, ...)."""
    zero = _zero_derivative_primitives()
    memo = graph.__dict__.setdefault("_tangent_free", {})
    stack = [atom]
    while stack:
        value = stack[-1]
        if not isinstance(value, Value) or value in memo:
            stack.pop()
            continue
        if not is_float(value):
            memo[value] = True
            stack.pop()
            continue
        eqn = graph.producer.get(value)
        if eqn is None:
            memo[value] = False  # a program input
            stack.pop()
            continue
        if eqn.primitive in zero:
            memo[value] = True
            stack.pop()
            continue
        pending = [a for a in eqn.inputs if isinstance(a, Value) and a not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[value] = all(memo.get(a, True) for a in eqn.inputs)
        stack.pop()
    return memo.get(atom, True) if isinstance(atom, Value) else True


@dataclass(frozen=True, eq=False)
class Support:
    """A bound on where a value's derivative can be non-zero, shaped like the value.

    A leaf is ``value != 0`` for a derivative-free program value (``as_is``: the value itself, a
    ``select_n`` predicate), or all ones (``value is None``: unknown) or all zeros (``zero``: no
    derivative). Otherwise ``eqn``'s primitive, with its params, applied to ``operands``.
    ``bounded``: whether the bound is smaller than "anywhere" by construction.
    """

    shape: tuple
    eqn: Eqn | None = None
    operands: tuple = ()
    value: Any = None
    as_is: bool = False
    zero: bool = False
    bounded: bool = True

    @staticmethod
    def of_value(atom, as_is: bool = False) -> "Support":
        return Support(tuple(atom.shape), value=atom, as_is=as_is)

    @staticmethod
    def anywhere(shape) -> "Support":
        return Support(tuple(shape), bounded=False)

    @staticmethod
    def nowhere(shape) -> "Support":
        return Support(tuple(shape), zero=True)


def derivative_support(graph: JaxprGraph, atom) -> Support | None:
    """A bound on where ``atom``'s derivative can be non-zero, or ``None`` if none is proven."""
    support = _support(graph, atom, graph.__dict__.setdefault("_derivative_support", {}))
    return support if support.bounded else None


def _support(graph: JaxprGraph, atom, memo: dict, depth: int = 0) -> Support:
    if tangent_free(graph, atom):
        return Support.nowhere(atom.shape)
    if atom in memo:
        return memo[atom]
    eqn = graph.producer.get(atom)
    if eqn is None or depth > 64 or len(eqn.outputs) != 1:
        return Support.anywhere(atom.shape)
    memo[atom] = result = _support_of_eqn(graph, eqn, atom, memo, depth)
    return result


def _support_of_eqn(graph: JaxprGraph, eqn: Eqn, atom, memo: dict, depth: int) -> Support:
    prim, inputs = eqn.primitive, eqn.inputs
    free = [tangent_free(graph, a) for a in inputs]
    anywhere = Support.anywhere(atom.shape)

    def sub(a) -> Support:
        return _support(graph, a, memo, depth + 1)

    if prim is lax.convert_element_type_p:
        return sub(inputs[0])  # a float to float cast (to an integer the result is derivative-free)
    if prim in _replayed_primitives():
        inner = sub(inputs[0])
        return Support(tuple(atom.shape), eqn, (inner,), bounded=inner.bounded)  # each takes one operand
    if prim in (lax.mul_p, lax.dot_general_p):
        if sum(not f for f in free) != 1:
            return anywhere  # a product of two varying values: no bound without reading them
        operands = tuple(Support.of_value(a) if f else sub(a) for a, f in zip(inputs, free))
        return Support(tuple(atom.shape), eqn, operands)  # bounded by the free factor's support
    if prim in (lax.add_p, lax.sub_p):
        operands = tuple(Support.nowhere(a.shape) if f else sub(a) for a, f in zip(inputs, free))
        return Support(tuple(atom.shape), _as_add(eqn), operands, bounded=all(o.bounded for o in operands))
    if prim is lax.select_n_p and free[0]:
        cases = tuple(Support.nowhere(a.shape) if f else sub(a) for a, f in zip(inputs[1:], free[1:]))
        unknown = [c for c in cases if not c.bounded]
        bounded = not unknown or (len(unknown) == 1 and all(c.zero for c in cases if c.bounded))
        return Support(tuple(atom.shape), eqn, (Support.of_value(inputs[0], as_is=True),) + cases, bounded=bounded)
    return anywhere


@functools.cache
def _add_eqn() -> Eqn:
    return Eqn(-1, lax.add_p, {}, (), ())


def _as_add(eqn: Eqn) -> Eqn:
    """``a - b``'s derivative is where either's is: the bounds are added, never subtracted."""
    return eqn if eqn.primitive is lax.add_p else _add_eqn()


def support_indicator(support: Support, read):
    """The bound as a float32 array, non-zero wherever the derivative may be; ``read`` gives
    program values."""
    memo: dict[int, Any] = {}

    def walk(node: Support):
        if id(node) in memo:
            return memo[id(node)]
        if node.eqn is None:
            if node.value is None:
                out = jnp.full(node.shape, 0.0 if node.zero else 1.0, jnp.float32)
            else:
                value = jnp.asarray(node.value.value if isinstance(node.value, Const) else read(node.value))
                out = value if node.as_is else (value != 0).astype(jnp.float32)
        else:
            out = _replay(node.eqn, [walk(o) for o in node.operands])
        memo[id(node)] = out
        return out

    return walk(support)


def _replay(eqn: Eqn, operands):
    params = dict(eqn.params)
    if eqn.primitive is lax.dot_general_p:
        params["preferred_element_type"] = jnp.float32  # the indicators are float32, whatever the program's type
    elif eqn.primitive is lax.reduce_precision_p:
        return operands[0]  # rounding keeps a non-negative count non-zero
    return eqn.primitive.bind(*operands, **params)
