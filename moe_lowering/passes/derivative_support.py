"""Where a routing value's derivative can be non-zero, proven from the program.

A capacity layer's combine tensor is differentiable (it carries the gates), and the sparse layer
reads it only at the slots the dispatch tensor fills. That is exact for the gradient too only if
combine's derivative is zero at every other slot. :func:`derivative_support` proves a bound on
where it can be non-zero, as a :class:`Support`: the program's own ops replayed on 0/1 indicators
(``value != 0`` of values without a derivative, the one-hot masks and slot positions). The device
check evaluates it (:func:`support_indicator`) and falls back to the dense layer where it reaches
an empty slot.

Why replaying is sound. Write ``B(v)`` for the bound of a value ``v`` with a derivative ``dv``,
``[c]`` for the indicator ``c != 0`` of a derivative-free value ``c``. The invariant: every
``B(v)`` is a non-negative array (its entries 0 or 1; clamped to 1 where a sum could grow past
it) and ``B(v)[i] == 0`` implies ``dv[i] == 0`` for every tangent of the program's inputs. The
leaves hold it: all zeros bound a derivative-free value, all ones bound any value (``[c]`` is
only ever a coefficient, and a ``select_n`` predicate only selects). Each rule keeps it because
it uses only operations that are monotone on non-negative numbers and give zero only where every
term is zero — no sign enters, so nothing cancels:

- ``neg``, ``sub``: ``d(-a) = -da`` is zero where ``da`` is: ``B(-a) = B(a)`` (neg is not
  replayed); ``d(a - b) = da - db`` is zero where both are: ``B(a) + B(b)``, the same as ``add``.
- ``add``: ``d(a + b) = da + db``; ``B(a) + B(b)`` is zero only where both are (non-negative).
- ``mul`` by a derivative-free ``c`` (of either sign): ``d(a * c) = da * c`` is zero where ``da``
  or ``c`` is: ``B(a) * [c]``, never ``B(a) * c`` (a negative ``c`` would flip a sign, and one of
  size 1e-30 would round the bound to zero).
- ``dot_general`` with a derivative-free operand ``c``: each output entry of the derivative is a
  sum over the contracted indices of ``da * c``; it is zero unless some term has ``da != 0`` and
  ``c != 0``, and then ``sum(B(a) * [c]) >= 1`` (non-negative terms) — the same contraction of
  ``B(a)`` and ``[c]`` bounds it. Batch and free dimensions move entries without mixing them.
- ``reduce_sum``: a sum of non-negative bounds is zero only where every term's is.
- ``select_n`` with a derivative-free predicate: the derivative is the selected case's, so is the
  replayed selection of the cases' bounds.
- ``convert_element_type`` (float to float), ``reduce_precision``, ``copy`` and the annotations
  (sharding, remat names): the derivative is the operand's, cast or rounded (which can only make
  an entry zero): ``B`` of the operand.
- ``broadcast_in_dim``, ``reshape``, ``transpose``, ``squeeze``, ``slice``, ``rev``: linear maps
  that move (or copy) entries without combining them, so the op applied to ``B(a)`` is zero
  exactly where the op applied to ``da`` must be.

An op without such a rule bounds nothing (every element may vary), and a bound made only of such
unknowns is no proof.
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
    return frozenset((lax.reduce_precision_p, lax.copy_p, lax.broadcast_in_dim_p, lax.reshape_p,
                      lax.transpose_p, lax.squeeze_p, lax.slice_p, lax.reduce_sum_p, lax.rev_p)
                     + identity_annotations())


def is_float(atom) -> bool:
    """``jnp.issubdtype``: numpy's own does not count bfloat16 (or the FP8 types) as inexact."""
    return jnp.issubdtype(atom.dtype, jnp.inexact) if hasattr(atom, "dtype") else False


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


def bounded_construction(graph: JaxprGraph, atom) -> tuple[tuple[Eqn, ...], tuple]:
    """``(eqns, leaves)``: the eqns that build ``atom`` from the values its bound reaches as "anywhere"
    (``leaves``: the router's probabilities or logits, which carry the derivative), through the eqns
    :func:`derivative_support` has a rule for. A capacity layer's training step compares its VJP as a
    function of the leaves: the sparse layer reads combine only at the dispatched slots, so combine's
    own cotangent differs from the dense layer's, but not the cotangent of what combine is built from."""
    memo = graph.__dict__.setdefault("_derivative_support", {})
    eqns: dict = {}
    leaves: dict = {}
    stack = [atom]
    while stack:
        value = stack.pop()
        if not isinstance(value, Value) or tangent_free(graph, value) or value in leaves:
            continue
        eqn = graph.producer.get(value)
        if eqn is None or not _support(graph, value, memo).bounded:
            leaves[value] = None
            continue
        if eqn.index not in eqns:
            eqns[eqn.index] = eqn
            stack.extend(eqn.inputs)
    return tuple(eqns[i] for i in sorted(eqns)), tuple(leaves)


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
    if prim is lax.neg_p:
        return sub(inputs[0])  # where -a's derivative is non-zero, a's is: never a negative bound
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
    """The op on non-negative indicators; a sum (``add``, ``reduce_sum``, a contraction) is clamped
    back to 1, so no chain of sums can overflow float32."""
    params = dict(eqn.params)
    if eqn.primitive is lax.dot_general_p:
        params["preferred_element_type"] = jnp.float32  # the indicators are float32, whatever the program's type
    elif eqn.primitive is lax.reduce_precision_p:
        return operands[0]  # rounding keeps a non-negative count non-zero
    elif eqn.primitive in _compat.varying_casts:
        return operands[0]  # a type only: the operands are cast alike below, where they meet
    out = eqn.primitive.bind(*_compat.vary_alike(operands), **params)
    return jnp.minimum(out, 1.0) if eqn.primitive in (lax.add_p, lax.reduce_sum_p, lax.dot_general_p) else out
