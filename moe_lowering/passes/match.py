"""Finds dense-reference MoE regions in a ``JaxprGraph`` by abstract interpretation.

Matching is anchored on routing (``top_k``, ``argmax``): from one anchor's expert indices the
analysis walks the program forward, giving each value it understands an abstract value
(``abstract.py``): one-hot masks and gates built from the indices, expert rows computed from the
tokens and an expert-batched weight, their gating and their sum. Rules are registered per
primitive object (``@rule(lax.mul_p, ...)``). Values it does not understand stay plain; a rule
that sees something *almost* right returns a ``FailedMatch`` whose reason ``explain`` reports.

Structure (the rule modules) is separate from the semantic checks in ``_finish_region``: that every
expert is covered once, that routing weights are only applied where they commute with the rest
of the expert program, and that no interior value (the dense ``[T, E, F]`` activations) is used
outside the region, so replacing it cannot change anything else, but by the region's own
reverse-mode derivative in a training step, proven to be ``jax.vjp`` of it (``derivative_match.py``)
and replaced with it.

The parts: ``match_core.py`` holds the records, the rule registry and ``Analysis``; the rules live
by family in ``rules_routing.py`` (anchors, expert indices, range checks, one-hot), ``rules_gate.py``
(routing weights), ``rules_rows.py`` (the expert rows' computation, gathers, ``custom_jvp``),
``rules_layout.py`` (broadcast, reshape, transpose, slice, reduce), ``rules_dot.py`` (projections,
dispatch and combine), ``rules_sort.py`` (copies sorted by expert, a range mask keeping each one's
own) and ``rules_elementwise.py``; ``canonicalize.py`` is what matching sees through (annotations,
casts that keep the indices, ``jnp.floor_divide``'s fix-up). This file finds the regions and checks them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

from moe_lowering import _compat
from moe_lowering.expert_program import (
    CustomJvpCall,
    Elementwise,
    ExpertMatmul,
    ExpertProgram,
    FeatureConcat,
    FeatureSlice,
    ParamKind,
    ParamRef,
    RowInput,
    topological_nodes,
)
from moe_lowering.passes.abstract import (
    COPY,
    FEATURE,
    SLOT,
    Combined,
    CopyIndex,
    CopyOneHot,
    FusedRows,
    Gate,
    GateValue,
    Roles,
    Rows,
    StackedWeights,
    WeightPart,
    is_token,
    token_roles,
    whole_token_axes,
)
from moe_lowering.passes.derivative_match import RegionDerivative, is_inexact, match_derivative
from moe_lowering.passes.derivative_support import Support, bounded_construction, derivative_support, tangent_free
from moe_lowering.passes.graph import Eqn, JaxprGraph, Value
from moe_lowering.passes.match_core import Analysis, FailedMatch, IndexInBounds, ParamSource, RoutingAnchor, rule, rules
from moe_lowering.passes.rules_routing import find_anchors


# the records and the registry live in match_core.py, the anchors in rules_routing.py; importable from here
__all__ = [
    "FailedMatch", "IndexInBounds", "MoeRegion", "ParamSource", "RoutingAnchor", "SPARSE_MOE_PRIMITIVES", "analyse",
    "find_anchors", "rule", "rules", "sparse_moe_ops",
]


@dataclass(frozen=True)
class MoeRegion:
    """One matched MoE layer: everything the rewrite needs, nothing it must rediscover."""

    anchor: RoutingAnchor
    output: Value
    output_roles: Roles
    tokens: Value
    program: ExpertProgram
    params: tuple[ParamSource, ...]
    gate: Gate | None  # top-k styles: the routing weights
    dispatch: tuple[Any, Roles] | None  # capacity style: the [t.., E, C] tensors and their roles
    combine: tuple[Any, Roles] | None
    replaced: frozenset  # eqn indices the sparse computation replaces
    style: str
    capacity: int | None = None
    top_k: int = 1
    gate_values: tuple[GateValue, ...] = ()  # top-k styles: the routing weights as the program computes them
    combine_support: Support | None = None  # capacity style: where combine's derivative can be non-zero
    slot_groups: tuple = ()  # capacity style: token axes whose every index has its own [E, C] slots
    derivative: RegionDerivative | None = None  # the region's own backward in the program, rewritten with it

    @property
    def num_experts(self) -> int:
        return self.anchor.num_experts

    @property
    def num_tokens(self) -> int:
        return math.prod(self.anchor.token_shape)

    @functools.cached_property
    def d_model(self) -> int:
        return self.tokens.shape[-1]

    @functools.cached_property
    def d_ff(self) -> int:
        first = self.program.matmuls()[0]
        return _weight_dims(self.params[first.weight])[2]

    @functools.cached_property
    def gated_activation(self) -> bool:
        """Two up-projections, or one split in two, multiplied: SwiGLU-style."""
        ups = [m for m in self.program.matmuls() if isinstance(m.source, RowInput)]
        has_split = any(isinstance(n, FeatureSlice) for n in self.program.nodes)
        return len(ups) > 1 or has_split

    def activation(self) -> str:
        """A readable name for the lifted body: ``swiglu``, ``gelu (tanh)``, ``squared relu``, ..."""
        prims = {str(n.primitive) for n in self.program.nodes if isinstance(n, Elementwise)}
        for node in self.program.nodes:
            if isinstance(node, CustomJvpCall):
                prims |= _primitive_names(node.body[0])
        if "logistic" in prims or prims - {"mul", "convert_element_type"} == {"neg", "exp", "add", "div"}:
            name = "silu"
        elif prims & {"erf", "erfc"}:
            name = "gelu (erf)"
        elif "tanh" in prims:
            name = "gelu (tanh)"
        elif "max" in prims:
            name = "squared relu" if prims & {"square", "integer_pow"} else "relu"
        else:
            name = ", ".join(sorted(prims)) or "identity"
        if self.gated_activation and name == "silu":
            name = "swiglu"
        elif self.gated_activation:
            name = f"gated {name}"
        return f"clipped {name}" if prims & {"clamp", "min"} else name


def _primitive_names(jaxpr) -> set[str]:
    """The primitives of ``jaxpr``, inside its ``jit`` and ``custom_jvp`` calls too."""
    names = set()
    for eqn in jaxpr.eqns:
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if inner is not None:
            names |= _primitive_names(_compat.open_jaxpr(inner))
        else:
            names.add(str(eqn.primitive))
    return names


def _weight_dims(param: ParamSource) -> tuple[int, int, int]:
    shape = param.source.shape
    return tuple(shape[param.roles.index(r)] for r in ("E", "K", "N"))


def analyse(graph: JaxprGraph) -> tuple[list[MoeRegion], list[tuple[RoutingAnchor, FailedMatch]]]:
    """All MoE regions of ``graph``, and for each anchor that gave none, why not."""
    regions: list[MoeRegion] = []
    near_misses: list[tuple[RoutingAnchor, FailedMatch]] = []
    anchors = find_anchors(graph)
    claimed: set = set()
    for anchor in anchors:
        analysis, results = _analysed(graph, anchor, anchors)
        if analysis.token_axes_merged and not any(isinstance(r, MoeRegion) for r in results):
            # the program merges the router's token axes: its layer is over one token axis, and why not is
            # said there too (past the merge)
            analysis, results = _analysed(graph, anchor.over_one_token_axis(), anchors)
        found = [r for r in results if isinstance(r, MoeRegion)]
        failures = [r for r in results if isinstance(r, FailedMatch)]
        found = [r for r in found if r.output not in claimed]
        for region in found:
            claimed.add(region.output)
        regions.extend(found)
        if not found and not _feeds_later_anchor(graph, anchor, anchors):
            why = failures[0] if failures else _why_not(analysis)
            if analysis.anchor.split_tokens:
                why = FailedMatch(f"{why.reason} (read over one axis of {analysis.anchor.token_shape[0]} tokens, as a "
                                  f"reshape merges the router's {list(anchor.token_shape)} token axes)", why.eqn,
                                  why.assumption)
            near_misses.append((anchor, why))
    counted = {id(a.eqn) for region in regions for a in _region_anchors(graph, region, anchors)}
    return regions, [(a, f) for a, f in near_misses if id(a.eqn) not in counted]


def _analysed(graph: JaxprGraph, anchor: RoutingAnchor, anchors) -> tuple[Analysis, list]:
    """The analysis from ``anchor`` and its regions or failures; where a weight's expert axis was ambiguous
    and no region followed, the other candidate axis's, should it give one."""
    analysis = Analysis(graph, anchor)
    analysis.run()
    results = _regions_of(analysis, anchors)
    if analysis.ambiguous_expert_axis and not any(isinstance(r, MoeRegion) for r in results):
        retry = Analysis(graph, anchor, expert_axis_choice=-1)
        retry.run()
        retried = _regions_of(retry, anchors)
        if any(isinstance(r, MoeRegion) for r in retried):
            return retry, retried
    return analysis, results


def _region_anchors(graph: JaxprGraph, region: MoeRegion, anchors) -> list[RoutingAnchor]:
    """The routing decisions a region is built from: its anchor, and for a capacity layer every
    decision its dispatch depends on (GShard's second argmax), none of which is a near miss."""
    if region.dispatch is None:
        return [region.anchor]
    ancestors = graph.ancestors(region.dispatch[0])
    return [region.anchor] + [a for a in anchors if a.indices in ancestors]


SPARSE_MOE_PRIMITIVES = frozenset({"ragged_dot", "ragged_dot_general", "ragged_all_to_all"})


def sparse_moe_ops(graph: JaxprGraph) -> list[Eqn]:
    """Eqns that already compute a sparse MoE (grouped products over expert-sorted rows, ragged
    exchanges, this library's own primitives): a program made of them has no dense layer to rewrite."""
    return [e for e in graph.eqns if str(e.primitive) in SPARSE_MOE_PRIMITIVES or str(e.primitive).startswith("moe_")]


def _feeds_later_anchor(graph: JaxprGraph, anchor: RoutingAnchor, anchors) -> bool:
    """A top-k that only pre-selects for another routing decision (DeepSeek's group-limited top-k),
    or whose indices nothing uses: not a routing decision of its own, so no near miss to report."""
    if not graph.users.get(anchor.indices) and anchor.indices not in graph.output_set:
        return True
    return any(
        other is not anchor and any(out in graph.ancestors(other.eqn.inputs[0]) for out in anchor.eqn.outputs)
        for other in anchors
    )


def _why_not(analysis: Analysis) -> FailedMatch:
    if analysis.failures:
        return analysis.failures[0]
    kinds = {type(v) for v in analysis.values.values()}
    if Gate not in kinds and Rows not in kinds and kinds & {CopyIndex, CopyOneHot}:
        return FailedMatch(
            "the routing indices are flattened to one per (token, choice) copy"
            f"{' and a one-hot over E is built from them' if CopyOneHot in kinds else ''}, but no product of the "
            "tokens tiled in that order (jnp.repeat(x, k, axis=0)) with an expert weight "
            f"[E={analysis.num_experts}, d, f] was found")
    if Gate not in kinds and Rows not in kinds:
        return FailedMatch(
            "the routing indices are not seen to select experts: the matcher follows no one-hot mask "
            "(indices == iota over E), scatter or gather built from them, and finds no matmul of the tokens with a "
            f"weight of expert axis E={analysis.num_experts}"
        )
    if Rows not in kinds:
        return FailedMatch(
            f"routing weights are built, but no matmul of the tokens [{', '.join(map(str, analysis.token_shape))}, d] "
            f"with an expert weight [E={analysis.num_experts}, d, f] was found"
        )
    return FailedMatch("expert activations are computed but never combined with the routing weights")


def _regions_of(analysis: Analysis, anchors) -> list:
    graph = analysis.graph
    results = []
    for value, abstract in analysis.values.items():
        if not isinstance(abstract, Combined) or value not in graph.producer:
            continue
        users = graph.users.get(value, ())
        absorbed = all(isinstance(analysis.values.get(u.outputs[0]), Combined) for u in users) and users
        if absorbed and value not in graph.output_set:
            continue
        results.append(_finish_region(analysis, value, abstract, anchors))
    return results


def _finish_region(an: Analysis, output: Value, combined: Combined, anchors) -> MoeRegion | FailedMatch:
    graph = an.graph
    if combined.experts is not None and combined.experts != frozenset(range(an.num_experts)):
        missing = sorted(set(range(an.num_experts)) - combined.experts)
        return FailedMatch(f"the per-expert loop leaves out experts {missing}", graph.producer[output], "expert-program")
    replaced = _interior(an, output)
    used_outside = _used_outside(graph, replaced, output)
    program_nodes = topological_nodes(combined.node)
    used = sorted({n.weight for n in program_nodes if isinstance(n, ExpertMatmul)} | {
        o.index for n in program_nodes if isinstance(n, Elementwise) for o in n.operands if isinstance(o, ParamRef)
    })
    renumber = {old: new for new, old in enumerate(used)}
    program_nodes_renumbered = _renumber(combined.node, renumber)
    params = tuple(an.params[i] for i in used)
    program = ExpertProgram(program_nodes_renumbered, tuple(p.kind for p in params), topological_nodes(program_nodes_renumbered))
    if not program.matmuls():
        return FailedMatch("the expert computation has no projection with an expert weight")
    token_roles_ = token_roles(len(an.token_shape))
    whole = whole_token_axes(combined.roles, output.shape)
    if whole is None:
        return FailedMatch("the MoE output's tokens are split by a reshape and then permuted or regrouped, not kept "
                           "in order (row-major, as x.reshape(B, S, d) splits them)", graph.producer[output])
    out_roles = whole[0]
    per_token = [(v.atom, v.roles) for v in combined.gate_values if v is not None]
    per_token += [(p.source, p.roles) for p in params if p.kind is ParamKind.PER_TOKEN]
    apart = [atom for atom, roles in per_token if whole_token_axes(roles, atom.shape) is None]
    if apart:
        return FailedMatch(f"a {list(apart[0].shape)} routing weight or per-token value meets the expert activations "
                           "over a token axis split by a reshape, but not over all of its parts in order: which token "
                           "each entry is for is not known", graph.producer[output])
    present = [r for r in out_roles if is_token(r)]
    unit = {r for r, n in zip(token_roles_, an.token_shape) if n == 1}  # a reshape may drop these
    if (len(set(present)) != len(present) or not set(token_roles_) - unit <= set(present) <= set(token_roles_)
            or out_roles.count(FEATURE) != 1 or COPY in out_roles):
        return FailedMatch("the MoE output is not laid out as [tokens.., features]")
    capacity = None
    top_k = an.anchor.top_k
    if top_k == 0:
        return FailedMatch("the routing chooses k = 0 experts per token: no expert reaches the output, so there "
                           "is nothing to make sparse", an.anchor.eqn)
    combine_support = None
    if combined.combine is not None:
        dispatch, dispatch_roles = combined.dispatch
        capacity = dispatch.shape[dispatch_roles.index(SLOT)]
        top_k = sum(a.top_k for a in anchors if a.indices in graph.ancestors(dispatch))
        if not tangent_free(graph, dispatch):
            return FailedMatch(
                "the dispatch tensor has a derivative (a soft or straight-through dispatch); the sparse rewrite "
                "moves token rows by index and would drop it", graph.producer.get(dispatch), "dispatch-has-no-derivative")
        if any(p.kind is ParamKind.PER_TOKEN for p in params):
            return FailedMatch("a per-token value inside the experts of a capacity layer (an empty slot has no token "
                               "to read it for)", graph.producer.get(output), "expert-program")
        combine_support = derivative_support(graph, combined.combine[0])
        if combine_support is None:
            return FailedMatch(
                "cannot prove that the combine tensor's derivative vanishes outside the dispatched slots (write it as "
                "a 0/1 slot mask times the gate)", graph.producer.get(combined.combine[0]), "combine-derivative-in-slots")
    elif top_k >= an.num_experts:
        return FailedMatch(f"every token goes to all {an.num_experts} expert(s) (k = E): the sorted layer would do "
                           "the dense layer's work plus a sort, so it is left dense", an.anchor.eqn)
    elif not _gate_values_complete(combined, an.num_experts):
        return FailedMatch("the routing weights are not one value per expert layer", graph.producer[output],
                           "gate-values")
    derivative = None
    if used_outside is not None:
        derivative = _derivative(an, combined, replaced, output, params)
        if isinstance(derivative, FailedMatch):
            return derivative
    return MoeRegion(
        anchor=an.anchor,
        output=output,
        output_roles=out_roles,
        tokens=combined.tokens,
        program=program,
        params=params,
        gate=combined.gate,
        dispatch=combined.dispatch,
        combine=combined.combine,
        replaced=frozenset(replaced),
        style=combined.style,
        capacity=capacity,
        top_k=top_k,
        gate_values=combined.gate_values,
        combine_support=combine_support,
        slot_groups=combined.slot_groups,
        derivative=derivative,
    )


def _used_outside(graph: JaxprGraph, replaced, output):
    """The first interior eqn one of whose values is read outside the region (or leaves the function)."""
    for eqn_index in sorted(replaced):
        eqn = graph.eqns[eqn_index]
        for value in eqn.outputs:
            if value is output:
                continue
            if value in graph.output_set or any(u.index not in replaced for u in graph.users.get(value, ())):
                return eqn
    return None


def _derivative(an: Analysis, combined: Combined, replaced, output: Value, params):
    """The region's interior is read outside it: only its own backward may read it, proven against
    ``jax.vjp`` of the dense region (``derivative_match.py``), the eqns that build its routing weights
    (dropless) or its combine tensor (capacity) included."""
    graph = an.graph
    if combined.combine is not None:  # combine rebuilt from the router's float values (``bounded_construction``)
        gate_eqns, leaves = bounded_construction(graph, combined.combine[0])
        reads = {combined.tokens} | {v for p in params for v in _read_values(p.source)} | set(leaves)
    else:
        gate_eqns = _gate_construction(an, [v.atom for v in combined.gate_values])
        reads = {combined.tokens, an.anchor.indices} | {v for p in params for v in _read_values(p.source)} | {
            v.atom for v in combined.gate_values}
        reads |= {a for e in gate_eqns for a in e.inputs}
    prologue = _layout_prologue(graph, [graph.eqns[i] for i in replaced] + list(gate_eqns), reads)
    return match_derivative(graph, frozenset(replaced), output, tuple(sorted(set(gate_eqns) | set(prologue),
                                                                             key=lambda e: e.index)),
                            frozenset(reads | {a for e in prologue for a in e.inputs}))


def _read_values(source) -> tuple:
    """The program values the sparse layer reads for a param's ``source``: a fused weight for its part;
    E separate arrays for their stack, whose VJP splits the stacked weight's cotangent back into theirs
    (summed where one array stands at two positions), so each array's cotangent is the sparse layer's."""
    if isinstance(source, WeightPart):
        return _read_values(source.whole)
    if isinstance(source, StackedWeights):
        return source.parts
    return (source,)


def _layout_prologue(graph: JaxprGraph, eqns, reads, depth: int = 8) -> list[Eqn]:
    """One-operand eqns (a bias reshaped, routing weights broadcast) between a value the sparse layer
    reads and an operand of the region's eqns: part of the function whose VJP is compared, so that
    the cotangent of what the sparse layer reads is the one compared."""
    produced = {v for e in eqns for v in e.outputs}
    found: dict = {}
    for atom in {a for e in eqns for a in e.inputs if isinstance(a, Value) and a not in produced and a not in reads}:
        chain, value = [], atom
        while value not in reads and len(chain) < depth:
            eqn = graph.producer.get(value)
            operands = [a for a in eqn.inputs if isinstance(a, Value) and is_inexact(a)] if eqn is not None else []
            if len(operands) != 1:  # one float operand (a weight gathered by integer indices counts)
                break
            chain.append(eqn)
            value = operands[0]
        if value in reads:
            found.update((e.index, e) for e in chain)
    return list(found.values())


def _gate_construction(an: Analysis, atoms) -> tuple[Eqn, ...]:
    """The eqns that build the routing weights (one-hot masks times factors) the region multiplies in.

    The sparse layer equals the dense one as a function of these eqns' operands, not of the gate:
    off the chosen experts the dense gate's cotangent is not zero, the sparse one's is."""
    graph = an.graph
    found: dict = {}
    stack = [a for a in atoms if isinstance(a, Value)]
    while stack:
        value = stack.pop()
        eqn = graph.producer.get(value)
        if eqn is None or eqn.index in found or not isinstance(an.values.get(value), Gate):
            continue
        found[eqn.index] = eqn
        stack.extend(a for a in eqn.inputs if isinstance(a, Value))
    return tuple(found[i] for i in sorted(found))


def _gate_values_complete(combined: Combined, num_experts: int) -> bool:
    """One routing-weight value for the layer, or (loop style) one per expert."""
    values = combined.gate_values
    if any(v is None for v in values):
        return False
    if combined.experts is not None:
        return sorted(v.expert for v in values) == list(range(num_experts))
    return len(values) == 1 and values[0].expert is None


def _interior(an: Analysis, output: Value) -> set[int]:
    """Eqns computing expert activations that feed ``output`` (routing eqns are not interior)."""
    graph = an.graph
    interior: set[int] = set()
    stack = [output]
    seen = set()
    while stack:
        value = stack.pop()
        if not isinstance(value, Value) or value in seen:
            continue
        seen.add(value)
        eqn = graph.producer.get(value)
        if eqn is None or not isinstance(an.values.get(value), (Rows, Combined, FusedRows)):
            continue
        interior.add(eqn.index)
        stack.extend(eqn.inputs)
    return interior


def _renumber(node, mapping):
    """A copy of the program with param indices renumbered to the region's own list."""
    memo: dict[int, Any] = {}

    def walk(n):
        if id(n) in memo:
            return memo[id(n)]
        if isinstance(n, ExpertMatmul):
            out = ExpertMatmul(walk(n.source), mapping[n.weight], n.preferred_element_type)
        elif isinstance(n, Elementwise):
            out = Elementwise(n.primitive, n.params, tuple(walk(o) for o in n.operands))
        elif isinstance(n, ParamRef):
            out = ParamRef(mapping[n.index])
        elif isinstance(n, FeatureSlice):
            out = FeatureSlice(walk(n.source), n.start, n.stop, n.stride)
        elif isinstance(n, FeatureConcat):
            out = FeatureConcat(tuple(walk(s) for s in n.sources))
        elif isinstance(n, CustomJvpCall):
            out = replace(n, operands=tuple(walk(o) for o in n.operands))
        else:
            out = n
        memo[id(n)] = out
        return out

    return walk(node)
