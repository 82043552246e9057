"""A training step whose MoE layers sit inside ``lax.scan`` over layers: its forward and backward scans, joined.

JAX's autodiff splits the scan into a forward scan, whose body holds the layer and emits its interior
values as stacked residual outputs (``ys``), and a transposed backward scan (iterating the other way)
whose body reads them back at the same index. At every iteration the backward body's residual input
is the value the forward body emitted, so the two bodies are joined into one graph: the forward
body's eqns, then the backward body's, each residual input replaced by the forward body's value
(an ``xs`` or const both scans read, by the forward body's own input). On it the matcher and the
derivative proof (``derivative_match.py``) run unchanged, one iteration standing for all of them.
Where they hold, both scans are re-emitted through ``lax.scan``: the forward body computes the sparse
layer and emits, stacked, the sparse VJP's residuals and the forward values the rest of the backward
still reads; the backward body runs the sparse VJP on them. With ``jax.checkpoint`` inside the scan
body, the backward body recomputes the layer: the remat is inlined (in a dump, read through its
``optimization_barrier``) and the recomputation merged with the forward body (``merged_recomputation``),
as at the top level. A ``jax.nn`` function with its own derivative rule (``relu``) is left in the forward
body as its inlined primal once autodiff applied the rule; it is bound again as the rule's
``custom_jvp_call`` (``restored_rules``), so that the proof compares the backward body with the rule's
derivative and the sparse layer's VJP applies the rule too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
from jax import lax

from moe_lowering import _compat
from moe_lowering.passes.derivative_match import constant_key, merged_recomputation, plain_params_key
from moe_lowering.passes.graph import Const, Eqn, JaxprGraph, Value, build_graph
from moe_lowering.passes.match_core import FailedMatch

CONST, CARRY, XS = "const", "carry", "xs"
TOP, STACKED = "top", "stacked"  # a crossing value read at the top level; one the forward scan stacks


@dataclass(frozen=True)
class ScanPair:
    """A forward scan and the backward scan autodiff transposed from it, rewritten together."""

    forward: Eqn
    backward: Eqn
    joint: Any  # the ScopeResult of the joined bodies
    forward_count: int  # the joint graph's first eqns, the forward body's
    forward_inputs: tuple  # the joint graph's inputs that are the forward body's (consts, carry, xs)
    fresh: tuple  # (joint input, role, position): backward body inputs that are not forward values
    carry_outputs: tuple  # the forward body's carry outputs
    kept_ys: tuple  # (position, atom): forward ys read outside the pair
    backward_outputs: tuple  # the backward body's outputs
    crossing: tuple  # (forward value, role, position): what the rewritten backward body reads of the forward's
    derived: tuple  # the joint regions whose sparse VJP crosses from the forward body to the backward
    shared: tuple  # top-level values the joined bodies read whole (``_hoisted``)


@dataclass(frozen=True)
class PairAttempt:
    """A forward/backward scan pair: rewritten (``pair``) or why not (``near_misses`` of the joined bodies)."""

    forward_index: int
    backward_index: int
    pair: ScanPair | None
    near_misses: tuple


def analyse_scan_pairs(graph: JaxprGraph, path: str, analyse_graph: Callable) -> list[PairAttempt]:
    """Each forward scan of ``graph`` whose residual outputs one backward scan reads, joined and analysed
    (``analyse_graph(graph, path) -> ScopeResult``); with remat inside either body, again inlined."""
    attempts = []
    for forward, backward in _candidate_pairs(graph):
        where = f"{path}/scan[{forward.index}]+scan[{backward.index}]"
        found = _attempt(graph, forward, backward, where, analyse_graph, inline_remat=False)
        if found.pair is None and _has_remat(forward, backward):
            inlined = _attempt(graph, forward, backward, where, analyse_graph, inline_remat=True)
            if inlined.pair is not None or not found.near_misses:
                found = inlined
        attempts.append(found)
    return attempts


def _has_remat(*scans) -> bool:
    """Whether a scan's body holds a ``jax.checkpoint``, or a lowered one's ``optimization_barrier`` (the backward
    then recomputes the layer)."""
    fences = (_compat.remat_p, _compat.optimization_barrier_p)
    return any(e.primitive in fences for scan in scans for e in _body_eqns(scan))


def _body_eqns(scan: Eqn):
    """Every eqn of ``scan``'s body, those of its sub-jaxprs included."""
    stack = [_compat.open_jaxpr(scan.params["jaxpr"])]
    while stack:
        for eqn in stack.pop().eqns:
            yield eqn
            stack.extend(map(_compat.open_jaxpr, _compat.sub_jaxprs(eqn.params)))  # cond branches too


def _candidate_pairs(graph: JaxprGraph):
    """``(forward, backward)`` scans: the backward iterates the other way over as many steps and is the
    one scan that reads the forward's stacked outputs."""
    for forward in graph.eqns:
        if forward.primitive is not lax.scan_p:
            continue
        _, carry, _ = _compat.scan_roles(forward.params, forward.inputs)
        readers = {id(u): u for y in forward.outputs[len(carry):] for u in graph.users.get(y, ())
                   if u.primitive is lax.scan_p and u.params["reverse"] != forward.params["reverse"]
                   and u.params["length"] == forward.params["length"]}
        if len(readers) == 1:
            yield forward, next(iter(readers.values()))


def _attempt(graph, forward, backward, where, analyse_graph, inline_remat: bool) -> PairAttempt:
    joined = _join(graph, forward, backward, inline_remat)
    scope = analyse_graph(joined.graph, where)
    if inline_remat:
        scope = dataclasses.replace(scope, remat_inlined=True)
    plan = _plan(joined, scope, forward, backward)
    if isinstance(plan, ScanPair):
        return PairAttempt(forward.index, backward.index, plan, ())
    misses = tuple(scope.all_near_misses())
    if scope.regions:  # regions found, but the pair cannot be split back into two scans
        misses += tuple((where, r.anchor, plan) for r in scope.regions)
    for note in (_indirect_residuals(graph, forward, backward), _rule_applied(forward)):
        if note is not None:
            misses = tuple((p, a, FailedMatch(f"{f.reason} ({note})", f.eqn, f.assumption)) for p, a, f in misses)
    return PairAttempt(forward.index, backward.index, None, tuple((a, f) for _, a, f in misses))


@dataclass(frozen=True)
class _Joined:
    graph: JaxprGraph
    forward_count: int
    forward_values: frozenset
    forward_inputs: tuple
    fresh: tuple
    carry_outputs: tuple
    kept_ys: tuple
    backward_outputs: tuple
    hoisted: frozenset  # the prologue's values and ``shared``: top-level values, read there by the rewritten scans
    shared: tuple  # top-level values the backward scan reads whole: inputs of the joined bodies


def _join(graph: JaxprGraph, forward: Eqn, backward: Eqn, inline_remat: bool) -> _Joined:
    """One iteration of both scans as one graph (module docstring)."""
    f_body = build_graph(_compat.as_closed(forward.params["jaxpr"]), inline_remat)
    b_body = build_graph(_compat.as_closed(backward.params["jaxpr"]), inline_remat)
    f_consts, f_carry, f_xs = _compat.scan_roles(forward.params, forward.inputs)
    fb_consts, _, fb_xs = _compat.scan_roles(forward.params, f_body.inputs)
    carried = len(f_carry)
    ys, body_ys = forward.outputs[carried:], f_body.outputs[carried:]
    same_iteration = {}  # (role in the backward scan, top-level value) -> the forward body's value
    same_iteration.update({(CONST, t): v for t, v in zip(f_consts, fb_consts) if isinstance(t, Value)})
    same_iteration.update({(XS, t): v for t, v in zip(f_xs, fb_xs) if isinstance(t, Value)})
    same_iteration.update({(XS, t): v for t, v in zip(ys, body_ys)})
    tops = _compat.scan_roles(backward.params, backward.inputs)
    inners = _compat.scan_roles(backward.params, b_body.inputs)
    prologue, substitute, shared = _hoisted(graph, list(zip(f_consts, fb_consts)), list(zip(tops[0], inners[0])))
    fresh = []
    for role, top_values, inner_values in zip((CONST, CARRY, XS), tops, inners):
        for position, (top, inner) in enumerate(zip(top_values, inner_values)):
            found = same_iteration.get((role, top)) if isinstance(top, Value) else None
            if found is not None and inner not in substitute:
                substitute[inner] = found
            elif inner not in substitute:
                fresh.append((inner, role, position))

    def renamed(atom):
        return substitute.get(atom, atom) if isinstance(atom, Value) else atom

    eqns = []
    for eqn in prologue + list(f_body.eqns) + list(b_body.eqns):
        eqns.append(dataclasses.replace(eqn, index=len(eqns), inputs=tuple(renamed(a) for a in eqn.inputs)))
    residual_reads = {id(a) for a in tops[2]}
    kept = tuple((i, inner) for i, (top, inner) in enumerate(zip(ys, body_ys))
                 if top in graph.output_set or id(top) not in residual_reads
                 or any(u is not backward for u in graph.users.get(top, ())))
    carry_outputs = tuple(f_body.outputs[:carried])
    backward_outputs = tuple(renamed(a) for a in b_body.outputs)
    joint = JaxprGraph(tuple(eqns), tuple(f_body.inputs) + shared + tuple(v for v, _, _ in fresh),
                       carry_outputs + tuple(a for _, a in kept) + backward_outputs,
                       {**f_body.input_shardings, **b_body.input_shardings})
    forward_values = frozenset(f_body.inputs + shared) | {v for e in prologue + list(f_body.eqns) for v in e.outputs}
    joint = restored_rules(joint)  # first: the call bound again merges with a remat's recomputation of it
    if inline_remat:
        merged = merged_recomputation(joint)
        alias = {a: b for a, b in zip(joint.outputs, merged.outputs)}
        carry_outputs = tuple(alias.get(a, a) for a in carry_outputs)
        kept = tuple((i, alias.get(a, a)) for i, a in kept)
        backward_outputs = tuple(alias.get(a, a) for a in backward_outputs)
        joint = merged
    forward_count = next((e.index for e in joint.eqns if any(v not in forward_values for v in e.outputs)),
                         len(joint.eqns))
    return _Joined(joint, forward_count, forward_values, tuple(f_body.inputs), tuple(fresh), carry_outputs, kept,
                   backward_outputs, frozenset(shared) | {v for e in prologue for v in e.outputs}, shared)


_HOISTED_EQNS = 64


def _hoisted(graph: JaxprGraph, forward_consts, backward_consts) -> tuple[list, dict, tuple]:
    """Loop-invariant values autodiff hoisted out of the scans (the one-hot's iota, rotary tables, an
    attention mask: a remat'd backward body recomputes them from what they were computed from): the
    top-level eqns computing a scan's const from constants, the forward's consts and the values the
    backward scan reads whole, as a prologue of the joined bodies, so that the recomputation merges with
    them. A const that is a constant (a ``pvary``'s operand, once the graph reads through it) is that constant
    in the joined graph. Returns the prologue, ``{scan body input or top-level leaf: its value in the joined
    graph}`` and the values the backward scan reads whole (``shared``, inputs of the joined graph)."""
    inner_of = {top: inner for top, inner in forward_consts if isinstance(top, Value)}
    shared = tuple(dict.fromkeys(t for t, _ in backward_consts if isinstance(t, Value) and t not in inner_of))
    chains: dict = {}
    substitute: dict = {inner: top for top, inner in forward_consts + backward_consts if isinstance(top, Const)}
    for top, inner in forward_consts + backward_consts:
        if not isinstance(top, Value) or (top in inner_of and inner is not inner_of[top]):
            continue  # a const of both scans: the forward body's own (``same_iteration``)
        chain = _invariant_chain(graph, top, (set(inner_of) | set(shared) | set(chains)) - {top})
        if chain:
            chains.update({v: e for e in chain for v in e.outputs})
        if chain or top in shared:
            substitute[inner] = top
    for top, inner in forward_consts:
        if isinstance(top, Value) and top not in chains:
            substitute[top] = inner  # the prologue reads the forward body's const
    prologue = sorted({id(e): e for e in chains.values()}.values(), key=lambda e: e.index)
    return prologue, substitute, shared


def _invariant_chain(graph: JaxprGraph, value: Value, leaves: set) -> list | None:
    """The top-level eqns computing ``value`` from ``leaves`` and constants alone (at most a few), else None."""
    chain: dict = {}
    stack = [value]
    while stack:
        atom = stack.pop()
        if not isinstance(atom, Value) or atom in leaves or graph.producer.get(atom) in chain.values():
            continue
        eqn = graph.producer.get(atom)
        if eqn is None or getattr(eqn.source, "effects", None) or len(chain) >= _HOISTED_EQNS:
            return None
        chain[eqn.index] = eqn
        stack.extend(eqn.inputs)
    return list(chain.values())


def _indirect_residuals(graph: JaxprGraph, forward: Eqn, backward: Eqn) -> str | None:
    """Names the op through which the backward scan reads a forward output other than directly (not joined)."""
    outputs = set(forward.outputs)
    consts, _, xs = _compat.scan_roles(backward.params, backward.inputs)
    for atom in consts + xs:  # the carry is the cotangent: computed from the forward's outputs by the loss
        eqn = graph.producer.get(atom) if isinstance(atom, Value) else None
        if eqn is not None and eqn is not forward and any(a in outputs for a in eqn.inputs):
            return (f"the backward scan reads the forward scan's outputs through `{eqn.primitive}` at {eqn.where()}, "
                    "which the join of the two scan bodies does not follow")
    return None


def _derivative_rules() -> dict:
    """The ``jax.nn`` functions with their own derivative rule (``custom_jvp``), by name."""
    return {name: value for name, value in vars(jax.nn).items() if isinstance(value, jax.custom_jvp)}


def restored_rules(graph: JaxprGraph) -> JaxprGraph:
    """``graph`` with each inlined primal of a ``jax.nn`` function with its own derivative rule (``relu``'s
    ``max(x, 0)`` inside ``jit[name=relu]``, what autodiff leaves in a forward scan's body once it applied the
    rule) bound again as that function's ``custom_jvp_call``, traced by JAX at the same operand types. The
    values are the same: the call's body is compared with the inlined eqns op by op. Its derivative is then
    the rule's (relu's 0 at 0, where ``max``'s is 0.5), so the reference VJP the proof compares the backward
    body with, and the sparse layer's VJP, apply the rule as the program's backward did; a backward body
    that does not apply it still fails the proof."""
    rules = _derivative_rules()
    groups: dict = {}
    for eqn in graph.eqns:
        depth = next((i for i in reversed(range(len(eqn.callers))) if eqn.callers[i].primitive is _compat.jit_p
                      and eqn.callers[i].params.get("name") in rules), None)
        if depth is not None:  # keyed by the whole call path: a jaxpr inlined twice holds the same call twice
            path = tuple(map(id, eqn.callers[:depth + 1]))
            groups.setdefault(path, (eqn.callers[depth], []))[1].append(eqn)
    restored: dict = {}  # index of a group's first eqn -> the call; the group's other eqn indices -> None
    for caller, eqns in groups.values():
        call = _rule_call(graph, caller, eqns, rules[caller.params["name"]])
        if call is not None:
            restored.update({e.index: None for e in eqns})
            restored[eqns[0].index] = call
    if not restored:
        return graph
    kept = (restored.get(e.index, e) for e in graph.eqns)
    eqns = tuple(dataclasses.replace(e, index=i) for i, e in enumerate(e for e in kept if e is not None))
    return JaxprGraph(eqns, graph.inputs, graph.outputs, graph.input_shardings)


def _rule_call(graph: JaxprGraph, caller, eqns: list, function) -> Eqn | None:
    """The ``custom_jvp_call`` of ``function`` that ``eqns`` (the inlined body of the jit ``caller``) are the
    primal of, or None where they are not exactly its body."""
    avals = [_compat.shape_struct(v.aval) for v in caller.invars]
    try:
        traced = jax.make_jaxpr(function)(*avals)
    except Exception:  # noqa: BLE001 - a function that does not trace at these types is left inlined
        return None
    calls = [e for e in traced.jaxpr.eqns if e.primitive is _compat.custom_jvp_call_p]
    if len(traced.jaxpr.eqns) != 1 or len(calls) != 1:
        return None
    body = build_graph(_compat.as_closed(calls[0].params["call_jaxpr"]))
    if len(body.eqns) != len(eqns) or any(isinstance(a, Const) for a in body.outputs):
        return None
    mapped: dict = {}
    for ours, theirs in zip(eqns, body.eqns):
        if ours.primitive is not theirs.primitive or plain_params_key(ours.params) != plain_params_key(
                theirs.params) or len(ours.inputs) != len(theirs.inputs):
            return None
        for atom, body_atom in zip(ours.inputs, theirs.inputs):
            if isinstance(body_atom, Const):
                if not isinstance(atom, Const) or constant_key(atom.value) != constant_key(body_atom.value):
                    return None
            elif mapped.setdefault(body_atom, atom) is not atom:
                return None
        mapped.update(zip(theirs.outputs, ours.outputs))
    if any(v not in mapped for v in body.inputs):
        return None
    outputs = tuple(mapped[v] for v in body.outputs)
    inner = {v for e in eqns for v in e.outputs} - set(outputs)
    if any(v in graph.output_set or any(u not in eqns for u in graph.users.get(v, ())) for v in inner):
        return None
    return Eqn(eqns[0].index, _compat.custom_jvp_call_p, dict(calls[0].params),
               tuple(mapped[v] for v in body.inputs), outputs, eqns[0].source, eqns[0].callers)


def _rule_applied(forward: Eqn) -> str | None:
    """Names a ``jax.nn`` function with its own derivative rule (``relu``: a ``custom_jvp``) that the forward
    scan's body calls: autodiff applied the rule when it split the scan, leaving the body only its primal,
    bound again as the rule's call where it is exactly its body (``restored_rules``)."""
    rules = _derivative_rules()
    name = next((e.params["name"] for e in _body_eqns(forward)
                 if e.primitive is _compat.jit_p and e.params.get("name") in rules), None)
    return None if name is None else (
        f"the scanned layer calls `jax.nn.{name}`, a function with its own derivative rule (custom_jvp): autodiff "
        "applied the rule when it split the scan; the proof compares the backward body with the rule's derivative "
        "where the forward body holds exactly the function's primal")


def _plan(joined: _Joined, scope, forward: Eqn, backward: Eqn) -> ScanPair | FailedMatch:
    """The pair as two scans again, or why the joined bodies' rewrite cannot be split back into them."""
    graph, boundary, forward_values = joined.graph, joined.forward_count, joined.forward_values
    derived = tuple(r for r in scope.regions if r.derivative is not None)
    if not derived:
        return FailedMatch("no MoE layer of the forward scan's body has its derivative in the backward scan's body",
                           None, "private-interior")
    if scope.scan_pairs:
        return FailedMatch("the scan bodies hold scans of their own whose residuals would cross between the "
                           "rewritten bodies", None, "private-interior")
    for eqn in graph.eqns[:boundary]:
        if any(isinstance(a, Value) and a not in forward_values for a in eqn.inputs):
            return FailedMatch("an op of the forward scan's body reads a value of the backward's once joined",
                               eqn, "private-interior")
    for region in scope.regions:
        if any(i >= boundary for i in region.replaced):
            return FailedMatch("a MoE layer computed in the backward scan's body (not the forward's) is not split "
                               "between the scans", graph.producer[region.output], "private-interior")
    replaced = set()
    reads = list(joined.backward_outputs)
    for region in scope.regions:
        replaced |= region.replaced
    for region in derived:
        derivative = region.derivative
        replaced |= derivative.replaced
        if any(isinstance(v, Value) and v not in forward_values for v in derivative.inputs) or (
                derivative.cotangent in forward_values
                or any(graph.producer[o.value].index < boundary for o in derivative.outputs)):
            return FailedMatch("the layer's derivative does not read the forward scan's values and the backward's "
                               "cotangent alone", graph.producer[region.output], "private-interior")
        reads.append(derivative.cotangent)
        reads += [t for o in derivative.outputs for t in o.rest]
    for eqn in graph.eqns[boundary:]:
        if eqn.index not in replaced:
            reads += eqn.inputs
    unevaluated = {v for i in replaced if i < boundary for v in graph.eqns[i].outputs} - {
        r.output for r in scope.regions}
    if any(isinstance(a, Value) and a in unevaluated for a in reads):
        return FailedMatch("the backward scan's body reads a value of the forward's that the rewrite removes",
                           None, "private-interior")
    roles = _forward_roles(forward, joined.forward_inputs)
    roles.update({v: (TOP, None) for v in joined.hoisted})
    crossing, seen = [], set()
    for atom in reads:
        if isinstance(atom, Value) and atom in forward_values and atom not in seen:
            seen.add(atom)
            crossing.append((atom,) + roles.get(atom, (STACKED, None)))
    return ScanPair(forward, backward, scope, boundary, joined.forward_inputs, joined.fresh, joined.carry_outputs,
                    joined.kept_ys, joined.backward_outputs, tuple(crossing), derived, joined.shared)


def _forward_roles(forward: Eqn, forward_inputs) -> dict:
    """The forward body's const and xs inputs: ``(role, position)``, read by the backward scan from the same
    top-level operands (its carry inputs change every iteration: they are stacked)."""
    consts, _, xs = _compat.scan_roles(forward.params, forward_inputs)
    found = {v: (CONST, i) for i, v in enumerate(consts)}
    found.update({v: (XS, i) for i, v in enumerate(xs)})
    return found


# --------------------------------------------------------------------------- re-emission


@dataclass(frozen=True)
class _ForwardResults:
    stacked: list  # the crossing values the forward scan stacked, in ``crossing`` order (stacked ones only)
    leaves: list  # each derived region's sparse VJP residuals, stacked
    treedefs: dict  # id(region) -> the tree of its sparse VJP


def emit_forward(pair: ScanPair, read, run: Callable, emitted: dict) -> list:
    """The rewritten forward scan's outputs (``None`` for the residuals only the backward read); what the
    backward needs goes into ``emitted``. ``run(scope, env, eqns, pullbacks)`` interprets joint eqns."""
    eqn, joint = pair.forward, pair.joint
    consts, carry, xs = _compat.scan_roles(eqn.params, eqn.as_traced([read(a) for a in eqn.inputs]))
    shared = [(v, read(v)) for v in pair.shared]
    stacked = [v for v, role, _ in pair.crossing if role == STACKED]
    treedefs: dict = {}

    def body(carry_values, xs_values):
        env = dict(zip(pair.forward_inputs, list(consts) + list(carry_values) + list(xs_values)))
        env.update(shared)
        pullbacks: dict = {}
        value = run(joint, env, joint.graph.eqns[:pair.forward_count], pullbacks)
        leaves = []
        for region in pair.derived:
            region_leaves, treedefs[id(region)] = jax.tree.flatten(pullbacks[id(region)])
            leaves.append(region_leaves)
        ys = [value(a) for _, a in pair.kept_ys], [value(v) for v in stacked], leaves
        return [value(a) for a in pair.carry_outputs], ys

    carry_out, (kept, crossing, leaves) = lax.scan(body, list(carry), list(xs), length=eqn.params["length"],
                                                   reverse=eqn.params["reverse"], unroll=eqn.params.get("unroll", 1))
    emitted[pair.forward.index] = _ForwardResults(crossing, leaves, treedefs)
    outputs: list = [None] * (len(eqn.outputs) - len(carry_out))
    for (position, _), value in zip(pair.kept_ys, kept):
        outputs[position] = value
    return list(carry_out) + outputs


def emit_backward(pair: ScanPair, read, run: Callable, emitted: dict) -> list:
    """The rewritten backward scan's outputs: its body on its own inputs, the forward's crossing values and
    the sparse VJPs' residuals."""
    eqn, joint = pair.backward, pair.joint
    results: _ForwardResults = emitted[pair.forward.index]
    tops = _compat.scan_roles(eqn.params, eqn.as_traced([read(a) for a in eqn.inputs]))
    f_consts, _, f_xs = _compat.scan_roles(pair.forward.params, pair.forward.inputs)
    fresh_consts = [(v, tops[0][p]) for v, role, p in pair.fresh if role == CONST]
    fresh_carry = [(v, tops[1][p]) for v, role, p in pair.fresh if role == CARRY]
    fresh_xs = [(v, tops[2][p]) for v, role, p in pair.fresh if role == XS]
    forward_consts = [(v, read(f_consts[p])) for v, role, p in pair.crossing if role == CONST]
    forward_xs = [(v, read(f_xs[p])) for v, role, p in pair.crossing if role == XS]
    hoisted = [(v, read(v)) for v, role, _ in pair.crossing if role == TOP]
    stacked = [v for v, role, _ in pair.crossing if role == STACKED]
    xs = ([x for _, x in fresh_xs], [x for _, x in forward_xs], results.stacked, results.leaves)

    def body(carry_values, xs_values):
        own_xs, forward_slices, stacked_slices, leaves = xs_values
        env = dict(fresh_consts + forward_consts + hoisted)
        env.update(zip([v for v, _ in fresh_carry], carry_values))
        env.update(zip([v for v, _ in fresh_xs], own_xs))
        env.update(zip([v for v, _ in forward_xs], forward_slices))
        env.update(zip(stacked, stacked_slices))
        pullbacks = {id(region): jax.tree.unflatten(results.treedefs[id(region)], region_leaves)
                     for region, region_leaves in zip(pair.derived, leaves)}
        value = run(joint, env, joint.graph.eqns[pair.forward_count:], pullbacks)
        outputs = [value(a) for a in pair.backward_outputs]
        return outputs[:len(fresh_carry)], outputs[len(fresh_carry):]

    carry_out, ys = lax.scan(body, [x for _, x in fresh_carry], xs, length=eqn.params["length"],
                             reverse=eqn.params["reverse"], unroll=eqn.params.get("unroll", 1))
    return list(carry_out) + list(ys)
