"""Proves that the ops outside a matched MoE region that read its interior are its own derivative.

A training step traced whole holds the dense layer's forward *and* the backward JAX's autodiff
emitted for it beside the forward: the backward reads the layer's dense ``[T, E, F]``
activations, so the forward cannot be replaced alone. The backward can be replaced with it, by
the sparse layer's VJP, where it is proven to be exactly the dense region's VJP:

* the region (its interior eqns, plus the eqns that build its routing weights from the routing's
  float values, for the sparse layer equals the dense one only as a function of those: its
  gate's cotangent off the chosen experts differs) is re-bound as a function of its operands and
  ``jax.vjp`` of it is traced: the *reference*;
* both programs are hash-consed: a value's key is its primitive, its params and its operands'
  keys, the leaves being the region's operands and the cotangent of its output; ``jit`` bodies
  are inlined (``graph.py``) and ``add_any`` trees are keyed by the multiset of their terms;
* every op outside the region that (transitively) reads an interior value must compute a value
  of the reference; the values it leaves with must be cotangents of the region's operands, or
  sums whose region part is exactly such a cotangent (the rest, e.g. the router's share of the
  tokens' cotangent, is re-added).

Anything else, a forward-mode (``jvp``) use among them, is declined with the use that broke the
proof and its location.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

import jax
import numpy as np

from moe_lowering import _compat
from moe_lowering.expert_program import custom_jvp_text
from moe_lowering.passes.canonicalize import is_identity_rounding
from moe_lowering.passes.derivative_support import tangent_free
from moe_lowering.passes.graph import Const, Eqn, JaxprGraph, Value, build_graph
from moe_lowering.passes.match_core import FailedMatch

_ADD_ANY = "add_any"
_MAX_COTANGENT_CANDIDATES = 8


@dataclass(frozen=True)
class DerivativeOutput:
    """A program value the sparse VJP replaces: the cotangent of ``inputs[input_index]``, plus ``rest``
    (terms of the program's sum that are not the region's, re-added as they are)."""

    value: Value
    input_index: int
    rest: tuple
    terms: tuple = ()  # every term of the program's sum (``rest`` included); one term where it is no sum


@dataclass(frozen=True)
class RegionDerivative:
    """The region's backward as found in the program, proven to be the dense region's VJP."""

    inputs: tuple  # the dense region's operands (routing-weight construction included): the VJP's primals
    gate_eqns: tuple[Eqn, ...]  # build the routing weights from ``inputs``: re-bound inside the sparse VJP
    cotangent: Value  # the incoming cotangent of the region's output
    replaced: frozenset  # program eqn indices the sparse VJP replaces
    outputs: tuple[DerivativeOutput, ...]


def match_derivative(graph: JaxprGraph, interior: frozenset, output: Value, gate_eqns: tuple[Eqn, ...],
                     sparse_reads: frozenset) -> RegionDerivative | FailedMatch:
    """The proof described in the module docstring, for the region of ``interior`` eqns with ``output``.

    ``sparse_reads``: the values the sparse layer reads (tokens, weights, routing weights); a
    cotangent the program takes of any other operand would not be the sparse layer's.
    """
    region_eqns = sorted({graph.eqns[i] for i in interior} | set(gate_eqns), key=lambda e: e.index)
    inputs = _operands(region_eqns)
    rebuilt = {v for e in gate_eqns for v in e.outputs}
    for value in sparse_reads:
        if isinstance(value, Value) and value not in inputs and value not in rebuilt and is_inexact(value):
            return FailedMatch(
                f"the sparse layer reads a value ({list(value.shape)}) the dense region does not, so their "
                "derivatives cannot be compared", graph.producer.get(value), "private-interior")
    interior_values = {v for i in interior for v in graph.eqns[i].outputs if v is not output}
    for value in interior_values:
        if value in graph.output_set:
            return FailedMatch(
                f"{_interior_used(value)} as an output of the function or scope (returned, saved by a remat policy "
                "or carried by a scan to its backward): replacing the layer would change that use",
                graph.producer[value], "private-interior")
    readers = [e for e in graph.eqns if e.index not in interior
               and any(isinstance(a, Value) and a in interior_values for a in e.inputs)]
    gate_ids = {e.index for e in gate_eqns}
    candidates = _cotangent_candidates(graph, output, interior_values, readers, interior | gate_ids)
    if not candidates:
        return FailedMatch(
            f"{_interior_used(_first_interior(readers[0], interior_values))} by {_describe(readers[0])}, and no "
            f"cotangent of the layer's output [{', '.join(map(str, output.shape))}] reaches that use, so it is not "
            "the layer's reverse-mode derivative: replacing the layer would change that use", readers[0],
            "private-interior")
    failures = []
    for differentiated in _differentiated_operands(graph, inputs, gate_eqns):
        reference = _reference(region_eqns, inputs, output, differentiated)
        if isinstance(reference, FailedMatch):
            return reference
        for cotangent in candidates[:_MAX_COTANGENT_CANDIDATES]:
            found = _prove(graph, reference, inputs, cotangent, interior_values, interior, gate_eqns, sparse_reads)
            if isinstance(found, RegionDerivative):
                return found
            failures.append(found)
    return max(failures, key=lambda failure: failure[1])[0]  # the candidate that explained the most uses


def _differentiated_operands(graph: JaxprGraph, inputs, gate_eqns) -> list[list[bool]]:
    """Which operands the reference differentiates, most first: every one; those with a derivative in the
    program (not under ``stop_gradient``); those, less the routing weights' own operands.

    A jaxpr does not say which of its inputs autodiff gave tangents, and where an operand had none
    (a frozen router, tokens that are data) autodiff emits other ops for the rest (symbolic zeros fold
    away). Each choice is a complete proof on its own: a program op that reads the layer's interior
    must still be a value of that reference, so a cotangent the program takes of a closed-over operand
    is never accepted."""
    free = [tangent_free(graph, v) for v in inputs]
    gate_operands = {a for e in gate_eqns for a in e.inputs}
    choices = [[True] * len(inputs), [not f for f in free],
               [not f and v not in gate_operands for v, f in zip(inputs, free)]]
    return [c for i, c in enumerate(choices) if c not in choices[:i]]


def is_inexact(value: Value) -> bool:
    """A float (or complex) value: one that has a cotangent."""
    return jax.numpy.issubdtype(value.dtype, jax.numpy.inexact)


def _interior_used(value: Value) -> str:
    return f"an interior value of the MoE (the expert activations {list(value.shape)}) is also used outside it,"


def _first_interior(eqn: Eqn, interior_values) -> Value:
    return next(a for a in eqn.inputs if isinstance(a, Value) and a in interior_values)


def _describe(eqn: Eqn) -> str:
    return f"`{eqn.primitive}` at {eqn.where()}"


def _operands(eqns) -> tuple:
    """Values the eqns read and do not compute, in order of first use."""
    produced = {v for e in eqns for v in e.outputs}
    seen: dict = {}
    for eqn in eqns:
        for atom in eqn.inputs:
            if isinstance(atom, Value) and atom not in produced:
                seen.setdefault(atom, None)
    return tuple(seen)


# --------------------------------------------------------------------------- hash-consing


class _Keys:
    """Interned structural keys: equal keys, equal computations over the same leaves."""

    def __init__(self):
        self.ids: dict = {}
        self.terms: dict[int, tuple] = {}  # add_any key -> its flattened, sorted terms
        self.backward: set[int] = set()  # keys that depend on the cotangent

    def intern(self, key, backward: bool) -> int:
        found = self.ids.get(key)
        if found is None:
            found = self.ids[key] = len(self.ids)
            if backward:
                self.backward.add(found)
        return found

    def leaf(self, name) -> int:
        return self.intern(("leaf", name), name == "cotangent")

    def const(self, atom: Const) -> int:
        """A constant's key, its value in its operand's type: a literal ``1.0:f32[]`` may hold a Python float."""
        return self.intern(("const",) + constant_key(np.asarray(atom.value, atom.dtype)), False)

    def eqn_outputs(self, eqn: Eqn, operand_keys) -> list[int]:
        backward = any(k in self.backward for k in operand_keys)
        # ``add`` of two cotangents is ``add_any``: a StableHLO module spells autodiff's accumulation as ``add``.
        cotangent_sum = str(eqn.primitive) == "add" and all(k in self.backward for k in operand_keys)
        if str(eqn.primitive) == _ADD_ANY or cotangent_sum:
            terms = tuple(sorted(t for k in operand_keys for t in self.terms.get(k, (k,))))
            key = self.intern((_ADD_ANY, terms), backward)
            self.terms[key] = terms
            return [key]
        head = (str(eqn.primitive), _params_key(eqn.params), tuple(operand_keys))
        return [self.intern(head + (j, out.shape, str(out.dtype)), backward) for j, out in enumerate(eqn.outputs)]

    def term_set(self, key: int) -> collections.Counter:
        return collections.Counter(self.terms.get(key, (key,)))


_STATEFUL = ("rng_uniform",)  # XLA's stateful generator: two calls draw different numbers


def merged_recomputation(graph: JaxprGraph) -> JaxprGraph:
    """``graph`` with each eqn that repeats an earlier one (same primitive and params, the same operand
    values) replaced by the earlier one's outputs. A backward inlined from ``jax.checkpoint``
    recomputes the layer's forward from the same operands; merged, it reads the forward's own
    interior, as autodiff's backward does without remat; the residuals a remat policy saves are read
    through the ``reduce_precision`` remat marks them with (``is_identity_rounding``), which is dropped, and
    an offloaded one as the value offloaded (its move to host memory dropped where nothing else reads it).
    A lowered ``jax.checkpoint`` (a dump, imported) has no remat eqn: its recomputation reads the outputs of an
    ``optimization_barrier`` on the forward's values, a scheduling fence with identity semantics, which is
    dropped (its outputs read as its operands) so the recomputation merges as an inlined remat body's does; a
    barrier that no merged eqn reads through (a user's own) is kept.
    Eqns with effects or state are kept; params that are not plain values (a jaxpr, an array, an
    unhashable object) must be the same object, except a ``custom_jvp_call``'s (``_mergeable_params_key``)."""
    barriers = {e.index for e in graph.eqns if e.primitive is _compat.optimization_barrier_p}
    merged, recomputed_behind = _merged(graph, barriers)
    if recomputed_behind != barriers:
        merged, _ = _merged(graph, recomputed_behind)
    return merged


def _merged(graph: JaxprGraph, dropped_barriers: set) -> tuple[JaxprGraph, set]:
    """``merged_recomputation`` dropping the ``optimization_barrier`` eqns of ``dropped_barriers`` (indices); with
    the indices of those an eqn merged with an earlier one reads through."""
    alias: dict = {}
    first: dict = {}
    printed: dict = {}
    offloaded: dict = {}  # a value moved to host memory -> the value moved
    barrier_of: dict = {}  # an output of a dropped barrier -> the barrier's eqn index
    recomputed_behind: set = set()
    eqns: list[Eqn] = []
    for eqn in graph.eqns:
        inputs = tuple(alias.get(a, a) if isinstance(a, Value) else a for a in eqn.inputs)
        if is_identity_rounding(eqn):  # remat's mark on a saved residual: the same value
            alias[eqn.outputs[0]] = inputs[0]
            continue
        if eqn.index in dropped_barriers:  # a lowered remat's fence: the same values
            alias.update(zip(eqn.outputs, inputs))
            barrier_of.update(dict.fromkeys(eqn.outputs, eqn.index))
            continue
        returned = _offload_round_trip(eqn, inputs, offloaded)
        if returned is not None:  # an offloaded residual moved back: the value offloaded
            alias.update(zip(eqn.outputs, returned))
            continue
        key = None
        if not getattr(eqn.source, "effects", None) and eqn.primitive.name not in _STATEFUL:
            key = (eqn.primitive, _mergeable_params_key(eqn, printed),
                   tuple(a if isinstance(a, Value) else _const_key(a) for a in inputs))
        earlier = first.get(key) if key is not None else None
        if earlier is not None:
            alias.update(zip(eqn.outputs, earlier.outputs))
            recomputed_behind.update(barrier_of[a] for a in eqn.inputs if a in barrier_of)
            continue
        kept = dataclasses.replace(eqn, index=len(eqns), inputs=inputs)
        if key is not None:
            first[key] = kept
        if _is_move_to(kept, "host"):
            offloaded.update(zip(kept.outputs, kept.inputs))
        eqns.append(kept)
    outputs = tuple(alias.get(a, a) if isinstance(a, Value) else a for a in graph.outputs)
    read = {a for e in eqns for a in e.inputs if isinstance(a, Value)} | set(outputs)
    unread_offloads = [e for e in eqns if _is_move_to(e, "host") and not any(v in read for v in e.outputs)]
    if unread_offloads:
        eqns = [dataclasses.replace(e, index=i) for i, e in enumerate(e for e in eqns if e not in unread_offloads)]
    return JaxprGraph(tuple(eqns), graph.inputs, outputs, graph.input_shardings), recomputed_behind


_CONST_KEYED_BY_VALUE = 64  # elements: the scalars and small tables of a layer, not its weights


def _const_key(const: Const):
    """A small constant by its type and value (``constant_key``), a larger one by identity: a dump spells each use
    of ``-inf`` or ``1.0`` as a constant of its own, so the forward's and the recomputation's are other objects."""
    if np.size(const.value) > _CONST_KEYED_BY_VALUE or np.asarray(const.value).dtype == object:
        return ("const", id(const.value))
    return ("const", str(const.aval)) + constant_key(const.value)


def unmerged_recomputation(graph: JaxprGraph) -> str | None:
    """Names a ``custom_jvp`` call that a remat body (inlined, ``merged_recomputation``'s ``graph``) makes on the
    operands of a call outside it and that was not merged with it (``_mergeable_params_key``), for ``explain``."""
    def in_remat(eqn: Eqn) -> bool:
        return any(c.primitive is _compat.remat_p for c in eqn.callers)

    calls = [e for e in graph.eqns if e.primitive is _compat.custom_jvp_call_p]
    forward = {e.inputs: e for e in calls if not in_remat(e)}
    for eqn in calls:
        if in_remat(eqn) and eqn.inputs in forward:
            return (f"jax.checkpoint's recomputation of the custom_jvp function "
                    f"`{_compat.custom_jvp_name(eqn.params)}` at {eqn.where()} is not the forward's call at "
                    f"{forward[eqn.inputs].where()} (another body or derivative rule, or a rule that does not "
                    "trace on its own), so it is not merged with it")
    return None


def _mergeable_params_key(eqn: Eqn, printed: dict):
    """``plain_params_key`` of ``eqn``'s params; a ``custom_jvp_call``'s body and derivative rule by their printed
    text (``custom_jvp_text``, cached in ``printed``). ``jax.checkpoint``'s recomputation of a ``custom_jvp``
    function (``jax.nn.relu``) is a call of its own, traced apart from the forward's: the same body and rule, other
    objects. Merged, the forward's call and its rule stand for both, and the backward's ops that apply the rule
    are proven against that rule's derivative; a rule that cannot be traced here keeps the call apart."""
    if eqn.primitive is not _compat.custom_jvp_call_p:
        return plain_params_key(eqn.params)
    call = (id(eqn.params["call_jaxpr"]), id(eqn.params["jvp_jaxpr_fun"]), len(eqn.inputs))
    if call not in printed:
        try:
            printed[call] = custom_jvp_text(eqn.params, len(eqn.inputs))
        except Exception:  # noqa: BLE001 - a rule that does not trace is compared by identity
            printed[call] = None
    if printed[call] is None:
        return plain_params_key(eqn.params)
    rest = {name: value for name, value in eqn.params.items() if name not in ("call_jaxpr", "jvp_jaxpr_fun")}
    return ("custom_jvp", printed[call], plain_params_key(rest))


def _is_move_to(eqn: Eqn, memory: str) -> bool:
    return eqn.primitive is _compat.device_put_p and _compat.memory_move(eqn.params) == memory


def _offload_round_trip(eqn: Eqn, inputs, offloaded: dict) -> tuple | None:
    """The values a ``device_put`` back to device memory moves, where each was moved to host memory by
    another (``offloaded``: a remat policy's offloaded residual, read back in the backward); else None."""
    if not _is_move_to(eqn, "device") or not all(isinstance(a, Value) and a in offloaded for a in inputs):
        return None
    return tuple(offloaded[a] for a in inputs)


def constant_key(value) -> tuple:
    """A constant's dtype, shape and bytes: equal exactly where the constants are the same."""
    value = np.asarray(value)
    return str(value.dtype), value.shape, value.tobytes()


def plain_params_key(params: dict):
    """Params as a key that is equal only where they are: plain values by value, anything else (a jaxpr, an
    array, an unhashable object) by identity."""
    def key(value):
        if isinstance(value, (tuple, list)):
            return tuple(key(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((name, key(v)) for name, v in value.items()))
        if isinstance(value, np.ndarray) or hasattr(value, "eqns") or hasattr(value, "jaxpr"):
            return ("object", id(value))
        try:
            hash(value)
        except TypeError:
            return ("object", id(value))
        return value

    return key(params)


_PLACEMENT_PARAMS = ("out_sharding", "sharding")


def _params_key(params: dict):
    """Params as a key of the value an eqn computes: a sharding places the value, it does not change it
    (autodiff spells a transposed ``dot_general``'s or a ``broadcast_in_dim``'s as ``None`` or as the mesh's,
    by how it was traced)."""
    return tuple(sorted((name, _param_key(value)) for name, value in params.items() if name not in _PLACEMENT_PARAMS))


def _param_key(value):
    if hasattr(value, "eqns") or hasattr(value, "jaxpr"):
        return ("jaxpr", str(value))
    if isinstance(value, (tuple, list)):
        return tuple(_param_key(v) for v in value)
    if isinstance(value, dict):
        return _params_key(value)
    if isinstance(value, np.ndarray):
        return ("array",) + constant_key(value)
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


def _key_graph(keys: _Keys, graph: JaxprGraph, leaves: dict) -> dict:
    """Keys of every value of ``graph`` computed from ``leaves`` and constants alone."""
    keyed = dict(leaves)
    for eqn in graph.eqns:
        if any(v in leaves for v in eqn.outputs):
            continue
        operand_keys = []
        for atom in eqn.inputs:
            key = keys.const(atom) if isinstance(atom, Const) else keyed.get(atom)
            if key is None:
                break
            operand_keys.append(key)
        else:
            if _is_placement(eqn):  # keyed as its operand: a sharding does not change the value
                keyed[eqn.outputs[0]] = operand_keys[0]
                continue
            if eqn.primitive is _compat.custom_jvp_call_p:  # keyed as its body: autodiff may have inlined it
                body = build_graph(_compat.as_closed(eqn.params["call_jaxpr"]))
                inner = _key_graph(keys, body, dict(zip(body.inputs, operand_keys)))
                found = [keys.const(a) if isinstance(a, Const) else inner.get(a) for a in body.outputs]
                if all(k is not None for k in found):
                    keyed.update(zip(eqn.outputs, found))
                continue
            widened = _elementwise_broadcast_shape(graph, eqn)
            composed = _composed_transpose(graph, eqn, keyed)
            if widened is not None or composed is not None:  # keyed as the one op it stands for
                params, operand_keys = ({**eqn.params, "shape": widened}, operand_keys) if widened else composed
                head = (str(eqn.primitive), _params_key(params), tuple(operand_keys))
                shape = widened or eqn.outputs[0].shape
                keyed[eqn.outputs[0]] = keys.intern(head + (0, shape, str(eqn.outputs[0].dtype)),
                                                    any(k in keys.backward for k in operand_keys))
                continue
            keyed.update(zip(eqn.outputs, keys.eqn_outputs(eqn, operand_keys)))
    return keyed


def _is_placement(eqn: Eqn) -> bool:
    """A ``reshard``, ``sharding_constraint`` or varying cast: the identity on values, which autodiff places
    differently by how it was traced (``full_like``'s reshard of a derivative rule's ``1``, a constraint's
    transpose applied before or after the sum with another layer's cotangent, the cast ``build_graph`` puts
    back on a scan body's output)."""
    return (str(eqn.primitive) in ("reshard", "sharding_constraint") or eqn.primitive in _compat.varying_casts) and len(
        eqn.inputs) == 1


def _composed_transpose(graph: JaxprGraph, eqn: Eqn, keyed: dict):
    """``(params, operand keys)`` of the one transpose a transpose of a transpose is (HLO text folds
    JAX's two into one), or None."""
    inner = graph.producer.get(eqn.inputs[0]) if str(eqn.primitive) == "transpose" else None
    if inner is None or str(inner.primitive) != "transpose" or keyed.get(inner.inputs[0]) is None:
        return None
    outer_perm, inner_perm = eqn.params["permutation"], inner.params["permutation"]
    return {**eqn.params, "permutation": tuple(int(inner_perm[i]) for i in outer_perm)}, [keyed[inner.inputs[0]]]


_ELEMENTWISE_BINARY = frozenset({"add", "add_any", "sub", "mul", "div", "max", "min"})


def _elementwise_broadcast_shape(graph: JaxprGraph, eqn: Eqn):
    """The shape a ``broadcast_in_dim`` to size-1 dimensions stands for when every user is an elementwise
    op that broadcasts it further to one shape (``mul x[T,k,E] b[T,1,E]``, as the StableHLO importer
    restores it), which JAX's own transpose spells as the full ``broadcast_in_dim``; else None."""
    if str(eqn.primitive) != "broadcast_in_dim" or eqn.outputs[0] in graph.output_set:
        return None
    users = graph.users.get(eqn.outputs[0], ())
    shapes = {u.outputs[0].shape for u in users if str(u.primitive) in _ELEMENTWISE_BINARY}
    if not users or len(shapes) != 1 or any(str(u.primitive) not in _ELEMENTWISE_BINARY for u in users):
        return None
    (shape,) = shapes
    return shape if shape != eqn.outputs[0].shape else None


# --------------------------------------------------------------------------- the reference


@dataclass(frozen=True)
class _Reference:
    keys: _Keys
    known: frozenset  # every key the reference VJP computes
    cotangents: tuple  # per input: the key of its cotangent, or None (integer inputs)


def _reference(region_eqns, inputs, output, differentiated) -> _Reference | FailedMatch:
    """``jax.vjp`` of the dense region, traced with its operands and output cotangent as free inputs.

    Operands without a derivative in the program (``differentiated`` false: a router under
    ``stop_gradient``, integer indices) are closed over, not differentiated: autodiff then emits the
    same ops the program's backward holds (no cotangent for them, symbolic zeros folded alike)."""

    def region(values):
        local = dict(zip(inputs, values))
        for eqn in region_eqns:
            args = [a.value if isinstance(a, Const) else local[a] for a in eqn.inputs]
            local.update(zip(eqn.outputs, eqn.bind_as_traced(args)))
        return local[output]

    def pullback(primals, cotangent):
        def of_differentiated(*moving):
            values, moving = list(primals), iter(moving)
            return region([next(moving) if d else v for v, d in zip(values, differentiated)])

        moving = [v for v, d in zip(primals, differentiated) if d]
        cotangents = iter(jax.vjp(of_differentiated, *moving)[1](cotangent))
        return [next(cotangents) if d else None for d in differentiated]

    avals = [_compat.shape_struct(v.aval) for v in inputs]
    try:
        closed = jax.make_jaxpr(pullback)(avals, _compat.shape_struct(output.aval))
    except Exception as error:  # noqa: BLE001 - a region JAX cannot differentiate is declined, not raised
        return FailedMatch(f"JAX cannot differentiate the dense region on its own ({type(error).__name__}: "
                           f"{error}), so its derivative in the program cannot be checked", None, "private-interior")
    ref_graph = build_graph(closed)
    keys = _Keys()
    leaves = {v: keys.leaf(("input", i)) for i, v in enumerate(ref_graph.inputs[:-1])}
    leaves[ref_graph.inputs[-1]] = keys.leaf("cotangent")
    keyed = _key_graph(keys, ref_graph, leaves)
    outputs = iter(ref_graph.outputs)
    cotangents = []
    for primal, d in zip(inputs, differentiated):
        atom = next(outputs) if d else None
        differentiable = d and jax.numpy.issubdtype(primal.dtype, jax.numpy.inexact)
        cotangents.append(keyed.get(atom) if differentiable and isinstance(atom, Value) else None)
    return _Reference(keys, frozenset(keyed.values()), tuple(cotangents))


# --------------------------------------------------------------------------- the proof


def _cotangent_candidates(graph: JaxprGraph, output: Value, interior_values, readers, region_ids) -> list:
    """Values that may be the incoming cotangent of ``output``: of its type, read (through other ops)
    by the readers of the interior, not computed inside the region; latest first."""
    outside = [a for e in readers for a in e.inputs if isinstance(a, Value) and a not in interior_values]
    ancestors = set()
    for atom in outside:
        ancestors |= graph.ancestors(atom)
    found = [v for v in ancestors if v.aval.shape == output.aval.shape and v.dtype == output.dtype
             and v is not output
             and (graph.producer.get(v) is None or graph.producer[v].index not in region_ids)]
    return sorted(found, key=lambda v: -graph.producer[v].index if v in graph.producer else 1)


def _prove(graph, reference: _Reference, inputs, cotangent, interior_values, interior, gate_eqns, sparse_reads):
    """The region's derivative with ``cotangent`` as its output's cotangent, or ``(FailedMatch, uses explained)``."""
    keys = reference.keys
    leaves = {v: keys.leaf(("input", i)) for i, v in enumerate(inputs)}
    leaves[cotangent] = keys.leaf("cotangent")
    keyed = _key_graph(keys, graph, leaves)
    known = reference.known
    derived = set(interior_values)
    uses = []
    for eqn in graph.eqns:
        if eqn.index in interior or not any(isinstance(a, Value) and a in derived for a in eqn.inputs):
            continue
        if _is_sum(eqn, keyed, keys) or all(keyed.get(v) in known for v in eqn.outputs):
            uses.append(eqn)
            derived.update(eqn.outputs)
        elif any(isinstance(a, Value) and a in interior_values for a in eqn.inputs):
            return FailedMatch(
                f"{_interior_used(_first_interior(eqn, interior_values))} by {_describe(eqn)}, which is not an op of "
                "the layer's reverse-mode derivative (compared with jax.vjp of the dense layer): replacing the layer "
                "would change that use", eqn, "private-interior"), len(uses)
    derived -= set(interior_values)
    use_ids = {e.index for e in uses}
    mixed_sums = {v for e in uses for v in e.outputs if keyed.get(v) not in known}
    leaving = []
    for eqn in uses:
        for value in eqn.outputs:
            users = graph.users.get(value, ())
            if value in graph.output_set or any(u.index not in use_ids for u in users):
                leaving.append(value)
            elif value in mixed_sums and any(not _is_sum(u, keyed, keys) for u in users):
                return FailedMatch(f"a sum of the layer's derivative and other terms is used by "
                                   f"{_describe(users[0])} before it is complete", users[0], "private-interior"), len(uses)
    outputs = []
    for value in leaving:
        matched = _match_output(graph, reference, keyed, value, derived, inputs, sparse_reads)
        if isinstance(matched, FailedMatch):
            return matched, len(uses)
        outputs.append(matched)
    outputs += _cotangents_of_the_output_alone(graph, reference, keyed, inputs, sparse_reads, use_ids | interior,
                                               {o.value for o in outputs})
    pinned = {cotangent} | set(inputs) | set(sparse_reads) | {a for o in outputs for a in o.rest}
    removed = _dead_backward(graph, use_ids | {graph.producer[o.value].index for o in outputs}, interior, pinned)
    return RegionDerivative(inputs, tuple(gate_eqns), cotangent, frozenset(removed), tuple(outputs))


def _cotangents_of_the_output_alone(graph, reference: _Reference, keyed, inputs, sparse_reads, skipped, found):
    """Cotangents of region operands the program computes without the interior (a per-expert output
    bias's: the output's cotangent times the gate, dense): exactly the reference's, so replaced too."""
    wanted = {key: index for index, key in enumerate(reference.cotangents)
              if key is not None and key in reference.keys.backward and inputs[index] in sparse_reads}
    extra = []
    for eqn in graph.eqns:
        if eqn.index in skipped or len(eqn.outputs) != 1 or eqn.outputs[0] in found:
            continue
        index = wanted.get(keyed.get(eqn.outputs[0]))
        if index is not None:
            extra.append(DerivativeOutput(eqn.outputs[0], index, (), (eqn.outputs[0],)))
    return extra


def _is_sum(eqn: Eqn, keyed: dict, keys: _Keys) -> bool:
    """``add_any``, or an ``add`` of two cotangents: a StableHLO module's spelling of it (``_Keys.eqn_outputs``),
    as where a residual connection adds the layer's input cotangent to the output's."""
    return str(eqn.primitive) == _ADD_ANY or (str(eqn.primitive) == "add" and keyed.get(eqn.outputs[0]) in keys.terms)


def _terms(graph: JaxprGraph, value, keyed: dict, keys: _Keys) -> list:
    """The terms of the ``add_any`` tree ending at ``value``: the same leaves for every region whose
    cotangents it sums (two layers sharing their weights), so that the rewrite can share them out."""
    eqn = graph.producer.get(value)
    if eqn is None or not _is_sum(eqn, keyed, keys):
        return [value]
    return [t for a in eqn.inputs for t in _terms(graph, a, keyed, keys)]


def _match_output(graph, reference: _Reference, keyed, value, derived, inputs, sparse_reads):
    """``value`` as the cotangent of one region operand plus terms that are not the region's."""
    keys = reference.keys
    terms = _terms(graph, value, keyed, keys)
    available = collections.Counter()
    for term in terms:
        key = term if isinstance(term, Const) else keyed.get(term)
        if key is not None and not isinstance(term, Const):
            available.update(keys.term_set(key))
    best = None
    for index, key in enumerate(reference.cotangents):
        if key is None:
            continue
        wanted = keys.term_set(key)
        if all(available[t] >= n for t, n in wanted.items()) and (best is None or sum(wanted.values()) > best[1]):
            best = (index, sum(wanted.values()), wanted)
    users = graph.users.get(value, ())
    where = _describe(users[0]) if users else "the function's outputs"
    if best is None:
        return FailedMatch(
            f"a value computed from the MoE's interior ({list(value.shape)}) is used by {where}, and it is not the "
            "derivative of the layer with respect to any of its operands", graph.producer[value], "private-interior")
    index, _, wanted = best
    if inputs[index] not in sparse_reads:
        return FailedMatch(
            f"the program takes the derivative of the layer with respect to an operand the sparse layer does not "
            f"read ({list(inputs[index].shape)}, used by {where})", graph.producer[value], "private-interior")
    if keyed.get(value) not in keys.backward and not (wanted.keys() & keys.backward):
        return FailedMatch(f"the layer's derivative at {where} does not depend on the output's cotangent",
                           graph.producer[value], "private-interior")
    rest = []
    remaining = collections.Counter(wanted)
    for term in terms:
        key = keyed.get(term) if isinstance(term, Value) else None
        parts = keys.term_set(key) if key is not None else None
        if parts is not None and all(remaining[t] >= n for t, n in parts.items()):
            remaining.subtract(parts)
            continue
        if isinstance(term, Value) and term in derived:
            return FailedMatch(f"a sum at {where} adds a value computed from the MoE's interior that is not part "
                               "of the layer's derivative", graph.producer[value], "private-interior")
        rest.append(term)
    if any(n > 0 for n in remaining.values()):
        return FailedMatch(f"the derivative of the layer at {where} is split across values the rewrite cannot "
                           "re-add", graph.producer[value], "private-interior")
    return DerivativeOutput(value, index, tuple(rest), tuple(terms))


def _dead_backward(graph: JaxprGraph, removed_ids, interior, pinned) -> set:
    """The uses of the interior, and every op only they (or other removed ops) read: the dense
    backward ops before them (``dot(cotangent, gate)``), zeros JAX materialised for them. Dead code,
    removed so that no dense value is left in the rewritten program's jaxpr."""
    removed = set(removed_ids)
    for eqn in reversed(graph.eqns):
        if eqn.index in removed or eqn.index in interior or getattr(eqn.source, "effects", None):
            continue
        if any(v in pinned or v in graph.output_set for v in eqn.outputs):
            continue
        if all(u.index in removed or u.index in interior for v in eqn.outputs for u in graph.users.get(v, ())):
            removed.add(eqn.index)
    return removed


def common_rest(claims) -> list:
    """The terms of a sum that none of the regions claiming it computes (each claim's ``rest``,
    intersected as multisets): what the rewrite adds to their cotangents."""
    common = collections.Counter(claims[0].rest)
    for claim in claims[1:]:
        common &= collections.Counter(claim.rest)
    return list(common.elements())


def unavailable_sums(graph: JaxprGraph, regions) -> list:
    """Regions one of whose rewritten sums would need a term that another region's rewrite removes
    (two regions' cotangents summed in ways the rewrite cannot share out)."""
    removed = set()
    claims: dict = {}
    for region in regions:
        removed |= set(region.replaced) | set(region.derivative.replaced if region.derivative else ())
        for out in region.derivative.outputs if region.derivative else ():
            claims.setdefault(out.value, []).append((region, out))
    broken = []
    for entries in claims.values():
        rest = common_rest([out for _, out in entries])
        total = collections.Counter(entries[0][1].terms)
        claimed = collections.Counter(rest)
        for _, out in entries:  # each claim's own terms: together with the rest, every term exactly once
            claimed.update(collections.Counter(out.terms) - collections.Counter(out.rest))
        if claimed != total or any(isinstance(t, Value) and t in graph.producer and graph.producer[t].index in removed
                                   for t in rest):
            broken.extend(region for region, _ in entries if all(region is not b for b in broken))
    return broken
