"""A flat, read-only view of a jaxpr for matching, with cached producer and user indices.

Calls that do not change semantics (``jit`` / ``pjit``, ``closed_call``) are inlined, so a
pattern can span ``jax.nn.one_hot`` (a ``jit``) or a user's nested ``@jax.jit`` layer. Calls with
their own semantics (``custom_jvp_call``, ``custom_vjp_call``, ``remat``, ``scan``, ``while``)
stay single eqns: the rewrite re-binds them unchanged, or recurses into their bodies as scopes.
Each inlined use of a shared sub-jaxpr gets fresh variables, so values never alias.

Inside ``shard_map(check_vma=True)`` JAX casts every value that does not vary over the manual mesh
axes to one that does (``pvary``) where it meets one that does: a type, not a value. The graph reads
through these casts (each reader of the cast's output reads its operand), so the matcher sees the
program as it is without ``check_vma``; ``Eqn.bind_as_traced`` types an eqn's operands back as they
were traced when it is re-bound, and ``build_graph`` casts the outputs back to their traced types.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe_lowering import _compat

_ids = itertools.count()


class Value:
    """One SSA value of the flat graph (identity-hashed)."""

    __slots__ = ("id", "aval")

    def __init__(self, aval):
        self.id = next(_ids)
        self.aval = aval

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.aval.shape)

    @property
    def dtype(self):
        return self.aval.dtype

    def __repr__(self):
        return f"%{self.id}:{self.aval.str_short() if hasattr(self.aval, 'str_short') else self.aval}"


@dataclass(frozen=True, eq=False)
class Const:
    """A literal or closed-over constant operand."""

    value: Any
    aval: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(np.shape(self.value))

    @property
    def dtype(self):
        return self.aval.dtype


Atom = Value | Const


@dataclass(frozen=True, eq=False)
class Eqn:
    """One primitive application of the flat graph."""

    index: int
    primitive: Any
    params: dict
    inputs: tuple[Atom, ...]
    outputs: tuple[Value, ...]
    source: Any = None  # the original JaxprEqn, for source locations in reports
    callers: tuple = ()  # the inlined jit eqns it was inside, outermost first: locations where it has none

    def where(self) -> str:
        for source in (self.source,) + self.callers[::-1]:
            info = getattr(source, "source_info", None)
            try:
                from jax._src import source_info_util

                summary = source_info_util.summarize(info) if info is not None else "?"
            except Exception:  # noqa: BLE001 - a location is a nicety, never a failure
                return "?"
            if summary:
                # an op of JAX's own code (jax.nn.silu's derivative) is placed at the user's call of it
                return summary if source is self.source else f"{self.primitive} inside the call at {summary}"
        return f"{self.primitive} (no source line)"

    def as_traced(self, values) -> list:
        """``values``, this eqn's operands, each cast to vary over the manual mesh axes its traced operand
        varied over: the casts the graph reads through, put back (``None``: a value not computed, left so)."""
        traced = getattr(self.source, "invars", ())
        if len(traced) != len(values):
            return list(values)
        return [_compat.vary_over(v, _compat.varying_axes(t.aval)) if v is not None and _compat.varying_axes(t.aval)
                else v for v, t in zip(values, traced)]

    def bind_as_traced(self, values) -> list:
        """This eqn bound on ``values`` (its operands typed as traced): its outputs, as a list."""
        outputs = self.primitive.bind(*self.as_traced(values), **self.primitive.get_bind_params(self.params))
        return list(outputs) if self.primitive.multiple_results else [outputs]


_INLINED = (_compat.jit_p, _compat.closed_call_p)


@dataclass(frozen=True)
class JaxprGraph:
    """The flattened program: ``eqns`` in order, ``inputs`` and ``outputs`` as flat values."""

    eqns: tuple[Eqn, ...]
    inputs: tuple[Value, ...]
    outputs: tuple[Atom, ...]
    input_shardings: dict = field(default_factory=dict, compare=False)

    @functools.cached_property
    def producer(self) -> dict[Value, Eqn]:
        return {out: eqn for eqn in self.eqns for out in eqn.outputs}

    @functools.cached_property
    def users(self) -> dict[Value, tuple[Eqn, ...]]:
        found: dict[Value, list[Eqn]] = {}
        for eqn in self.eqns:
            for atom in eqn.inputs:
                if isinstance(atom, Value):
                    found.setdefault(atom, []).append(eqn)
        return {value: tuple(eqns) for value, eqns in found.items()}

    @functools.cached_property
    def output_set(self) -> frozenset:
        return frozenset(a for a in self.outputs if isinstance(a, Value))

    def ancestors(self, value: Atom) -> frozenset:
        """Every value ``value`` depends on (itself included)."""
        seen: set = set()
        stack = [value]
        while stack:
            v = stack.pop()
            if not isinstance(v, Value) or v in seen:
                continue
            seen.add(v)
            eqn = self.producer.get(v)
            if eqn is not None:
                stack.extend(eqn.inputs)
        return frozenset(seen)


def build_graph(closed_jaxpr, inline_remat: bool = False) -> JaxprGraph:
    """Flattens ``closed_jaxpr`` (inlining jit and closed_call, and with ``inline_remat`` the bodies of
    ``jax.checkpoint``: the same values, without remat's recomputation boundary) into a ``JaxprGraph``."""
    jaxpr, consts = _compat.jaxpr_parts(closed_jaxpr)
    env: dict = {}
    for var, const in zip(jaxpr.constvars, consts):
        env[var] = Const(const, var.aval)
    inputs = tuple(Value(v.aval) for v in jaxpr.invars)
    env.update(zip(jaxpr.invars, inputs))
    eqns: list[Eqn] = []
    shardings: dict = {}
    inlined = _INLINED + (_compat.remat_p,) if inline_remat else _INLINED
    outputs = inline_jaxpr(jaxpr, env, eqns, shardings, inlined=inlined)
    outputs = [_typed_output(eqns, atom, var.aval) for atom, var in zip(outputs, jaxpr.outvars)]
    return JaxprGraph(tuple(eqns), inputs, tuple(outputs), shardings)


def _typed_output(eqns: list, atom, aval):
    """``atom``, a jaxpr output read through a varying cast, cast again (an eqn appended) to vary as traced:
    a scan body's carry keeps its type, and a ``shard_map``'s output its ``out_specs``."""
    missing = _compat.varying_axes(aval) - _compat.varying_axes(atom.aval)
    if not missing or _compat.pvary_p is None:
        return atom
    params = {"axes": tuple(a for a in aval.sharding.mesh.axis_names if a in missing)}
    output = Value(aval)
    eqns.append(Eqn(len(eqns), _compat.pvary_p, params, (atom,), (output,)))
    return output


def _read(env, atom):
    if _compat.is_literal(atom):
        return Const(_compat.literal_value(atom), atom.aval)
    return env[atom]


def inline_jaxpr(jaxpr, env, eqns: list, shardings: dict, callers: tuple = (), inlined: tuple = _INLINED):
    """Appends ``jaxpr``'s eqns to ``eqns`` (the bodies of ``inlined`` primitives inlined); returns its outputs."""
    for source in jaxpr.eqns:
        inputs = tuple(_read(env, a) for a in source.invars)
        if source.primitive in inlined:
            sub = source.params.get("jaxpr") or source.params.get("call_jaxpr")
            sub_open = _compat.open_jaxpr(sub)
            sub_env = {v: Const(c, v.aval) for v, c in zip(sub_open.constvars, _compat.sub_jaxpr_consts(sub))}
            sub_env.update(zip(sub_open.invars, inputs))
            for value, sharding in zip(inputs, source.params.get("in_shardings", ())):
                if isinstance(value, Value) and not _is_unspecified(sharding):
                    shardings.setdefault(value, sharding)
            results = inline_jaxpr(sub_open, sub_env, eqns, shardings, callers + (source,), inlined)
            for var, result in zip(source.outvars, results):
                env[var] = result
            continue
        if source.primitive in _compat.varying_casts:  # a type: its readers read its operand
            env[source.outvars[0]] = inputs[0]
            continue
        outputs = tuple(Value(v.aval) for v in source.outvars)
        env.update(zip(source.outvars, outputs))
        primitive, params = source.primitive, dict(source.params)
        if primitive.name == "tile":  # jnp.tile of size-1 axes (Grok-1's tokens, tunix's weights): a broadcast
            primitive, params = _compat.unit_tile_as_broadcast(primitive, params, inputs[0].shape,
                                                               outputs[0].shape) or (primitive, params)
        eqns.append(Eqn(len(eqns), primitive, params, inputs, outputs, source, callers))
    return [_read(env, a) for a in jaxpr.outvars]


def _is_unspecified(sharding) -> bool:
    return sharding is None or type(sharding).__name__ in ("UnspecifiedValue", "AUTO")
