"""Re-emits a program with its MoE regions replaced, by interpreting it with ``bind``.

Every eqn outside a region is re-bound exactly as traced; at a region's output the sparse MoE
is called on the region's inputs, read from the environment. Interpreting instead of building a
new jaxpr composes with ``jit``, ``grad`` and ``vmap`` and never touches jaxpr internals that
differ between JAX versions. ``scan`` and ``remat`` bodies are scopes of their own: regions
inside are rewritten and the loop re-emitted through the public ``lax.scan`` / ``jax.checkpoint``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from moe_lowering import _compat
from moe_lowering.expert_program import ParamKind, RowContext, evaluate
from moe_lowering.passes.abstract import (
    CHOICE,
    EXPERT,
    FEATURE,
    ONE,
    SLOT,
    StackedWeights,
    WeightPart,
    token_roles,
    whole_token_axes,
)
from moe_lowering.passes.assumptions import GATE_ON_TOKENS
from moe_lowering.passes.graph import Const, JaxprGraph, Value, build_graph
from moe_lowering.passes.derivative_match import (common_rest, merged_recomputation, unavailable_sums,
                                                   unmerged_recomputation)
from moe_lowering.passes.derivative_support import support_indicator
from moe_lowering.passes.match import FailedMatch, MoeRegion, RoutingAnchor, analyse
from moe_lowering.passes.scan_derivative import analyse_scan_pairs, emit_backward, emit_forward

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScopeResult:
    """What the pass found in one jaxpr and the scopes nested in it."""

    graph: JaxprGraph
    regions: tuple[MoeRegion, ...]
    near_misses: tuple[tuple[RoutingAnchor, FailedMatch], ...]
    nested: dict  # eqn index -> ScopeResult of its body (scan / remat) holding regions
    path: str = ""
    remat_inlined: bool = False  # the remat bodies of this scope inlined, for the backwards inside them
    scan_pairs: dict = dataclasses.field(default_factory=dict)  # forward and backward scan eqn index -> ScanPair

    def all_regions(self):
        yield from ((self.path, r) for r in self.regions)
        for child in self.nested.values():
            yield from child.all_regions()

    def all_near_misses(self):
        yield from ((self.path, a, f) for a, f in self.near_misses)
        for child in self.nested.values():
            yield from child.all_near_misses()

    @property
    def changed(self) -> bool:
        return bool(self.regions) or bool(self.nested)


_SCOPE_PARAM = {}


def _scope_primitives():
    if not _SCOPE_PARAM:
        _SCOPE_PARAM.update({lax.scan_p: "jaxpr", lax.while_p: "body_jaxpr", _compat.remat_p: "jaxpr"})
    return _SCOPE_PARAM


def analyse_program(closed_jaxpr, path: str = "") -> ScopeResult:
    """Finds the regions of ``closed_jaxpr`` and, recursively, of its scan and remat bodies.

    A backward under ``jax.checkpoint`` recomputes the layer's dense forward inside its remat body,
    where no proof can see the forward (in a dump, beside it behind an ``optimization_barrier``).
    Where the program holds a remat (or such a barrier) and a region is left without
    its backward (or a near miss), the program is analysed again with its remat bodies inlined and
    their recomputation merged with the forward (``merged_recomputation``): the same values, the
    plain training step's shape. That analysis is kept where it rewrites more backwards; the rewritten
    program then has no remat boundary there, which ``explain`` says (``remat_inlined``)."""
    found = _analyse_graph(build_graph(closed_jaxpr), path)
    if not _may_recompute_a_region(found):
        return found
    merged = merged_recomputation(build_graph(closed_jaxpr, inline_remat=True))
    inlined = _analyse_graph(merged, path)
    if _backward_count(inlined) > _backward_count(found) and len(list(inlined.all_regions())) >= len(
            list(found.all_regions())):
        log.info("remat inlined at %s: %d backward(s) rewritten", path or "top level", _backward_count(inlined))
        return dataclasses.replace(inlined, remat_inlined=True)
    note = unmerged_recomputation(merged)
    if note is None:
        return found
    return dataclasses.replace(found, near_misses=tuple((a, FailedMatch(f"{f.reason} ({note})", f.eqn, f.assumption))
                                                        for a, f in found.near_misses))


def _may_recompute_a_region(scope: ScopeResult) -> bool:
    fences = (_compat.remat_p, _compat.optimization_barrier_p)  # a traced remat, or a lowered one's barrier
    has_remat = any(eqn.primitive in fences for eqn in scope.graph.eqns)
    return has_remat and (bool(scope.near_misses) or any(r.derivative is None for _, r in scope.all_regions()))


def _backward_count(scope: ScopeResult) -> int:
    return sum(r.derivative is not None for _, r in scope.all_regions())


def _analyse_graph(graph: JaxprGraph, path: str) -> ScopeResult:
    regions, near_misses = analyse(graph)
    broken = unavailable_sums(graph, regions)
    if broken:
        regions = [r for r in regions if all(r is not b for b in broken)]
        near_misses = list(near_misses) + [(r.anchor, FailedMatch(
            "the layer's derivative is summed with another layer's in a way the rewrite cannot share out, so "
            "neither is rewritten", graph.producer[r.output], "private-interior")) for r in broken]
    attempts = {}  # forward and backward scan eqn index -> PairAttempt
    for attempt in analyse_scan_pairs(graph, path, _analyse_graph):
        attempts[attempt.forward_index] = attempts[attempt.backward_index] = attempt
    pairs = {}
    for attempt in attempts.values():
        if attempt.pair is not None:
            pairs[attempt.forward_index] = pairs[attempt.backward_index] = attempt.pair
    nested = {}
    for eqn in graph.eqns:
        param = _scope_primitives().get(eqn.primitive)
        if param is None:
            continue
        if eqn.index in pairs:  # a forward scan and its backward, rewritten together: their joined bodies
            if eqn is pairs[eqn.index].forward:
                nested[eqn.index] = pairs[eqn.index].joint
            continue
        body = eqn.params[param]
        where = f"{path}/{eqn.primitive}[{eqn.index}]"
        child = analyse_program(_compat.as_closed(body), where)
        attempt = attempts.get(eqn.index)
        if attempt is not None and attempt.near_misses:  # the joined bodies say why better than either body
            child = dataclasses.replace(child, near_misses=attempt.near_misses if eqn.index == attempt.forward_index
                                        else ())
        if child.changed or child.near_misses:
            nested[eqn.index] = child
    nested_changed = {i: c for i, c in nested.items() if c.changed}
    result = ScopeResult(graph, tuple(regions), tuple(near_misses), nested_changed, path, scan_pairs=pairs)
    if not nested_changed:
        # near misses of unchanged scopes still matter to explain
        return ScopeResult(graph, tuple(regions), tuple(near_misses) + tuple(
            (a, f) for c in nested.values() for _, a, f in c.all_near_misses()
        ), {}, path)
    return result


def make_rewritten(scope: ScopeResult, options: "RewriteOptions") -> Callable:
    """``fn(*flat_inputs) -> list of flat outputs`` with every region replaced."""
    return functools.partial(_evaluate, scope, options)


def _evaluate(scope: ScopeResult, options: "RewriteOptions", *args):
    env = dict(zip(scope.graph.inputs, args))
    read = _run(scope, options, env, scope.graph.eqns, {})
    return [read(a) for a in scope.graph.outputs]


def _run(scope: ScopeResult, options: "RewriteOptions", env: dict, eqns, backward: dict):
    """Interprets ``eqns`` of ``scope`` into ``env``; returns the reader of its values. ``backward``: id(region)
    -> its sparse pullback, then the cotangents it gave (a scan pair makes the pullback in the forward body
    and calls it in the backward's)."""
    graph = scope.graph
    sharding_of = functools.partial(_sharding_of, graph, declared_shardings(scope, options.input_shardings))

    def read(atom):
        return atom.value if isinstance(atom, Const) else env[atom]

    replaced = set()
    by_output_eqn = {}
    cotangents_at = {}  # eqn index -> (region, DerivativeOutput) of the region's backward computed there
    for region in scope.regions:
        replaced |= region.replaced
        by_output_eqn[graph.producer[region.output].index] = region
        if region.derivative is not None:
            replaced |= region.derivative.replaced
            for out in region.derivative.outputs:
                cotangents_at.setdefault(graph.producer[out.value].index, []).append((region, out))
    emitted: dict = {}  # forward scan eqn index -> what its rewritten scan stacked for the backward's
    for eqn in eqns:
        pair = scope.scan_pairs.get(eqn.index)
        if pair is not None:
            emit = emit_forward if eqn is pair.forward else emit_backward
            run = functools.partial(_run_scope, options)
            env.update(zip(eqn.outputs, emit(pair, read, run, emitted)))
            continue
        if eqn.index in replaced:
            region = by_output_eqn.get(eqn.index)
            if region is not None and region.derivative is not None:
                env[region.output], backward[id(region)] = differentiable_region(region, read, options, sharding_of,
                                                                                 graph)
            elif region is not None:
                env[region.output] = lower_region(region, read, options, sharding_of, graph)
            claims = {}
            for region, out in cotangents_at.get(eqn.index, ()):
                if callable(backward[id(region)]):  # the cotangent typed as the output (a cast read through)
                    cotangent = _compat.vary_over(read(region.derivative.cotangent),
                                                  _compat.varying_axes(region.output.aval))
                    backward[id(region)] = backward[id(region)](cotangent)
                claims.setdefault(out.value, []).append((backward[id(region)][out.input_index], out))
            for value, parts in claims.items():
                env[value] = _region_cotangent(value, parts, read)
            continue
        inputs = [read(a) for a in eqn.inputs]
        child = scope.nested.get(eqn.index)
        if child is not None:
            outputs = _rebind_scope(eqn, child, eqn.as_traced(inputs), options)
            if not eqn.primitive.multiple_results:
                outputs = [outputs]
        else:
            outputs = eqn.bind_as_traced(inputs)
        env.update(zip(eqn.outputs, outputs))
    return read


def _run_scope(options: "RewriteOptions", scope: ScopeResult, env: dict, eqns, backward: dict):
    return _run(scope, options, env, eqns, backward)


def _rebind_scope(eqn, child: ScopeResult, inputs, options: "RewriteOptions"):
    """Re-emits a scan or while loop (its primitive, with the rewritten body traced in) or a remat."""
    body = make_rewritten(child, options)
    if eqn.primitive is not _compat.remat_p:
        body_avals = [_compat.shape_struct(v.aval) for v in child.graph.inputs]
        new_body = jax.make_jaxpr(body)(*body_avals)
        return eqn.primitive.bind(*inputs, **{**eqn.params, _scope_primitives()[eqn.primitive]: new_body})
    return _compat.remat_wrapper(eqn.params)(lambda *a: body(*a))(*inputs)


# --------------------------------------------------------------------------- one region


def lower_region(region: MoeRegion, read, options: "RewriteOptions", sharding_of=lambda atom: None, graph=None):
    """The sparse replacement of ``region``, built from the values its inputs have now.

    Capacity-style regions keep at most ``top_k`` experts per token (the routing's own count);
    should a dispatch tensor ever select more, the original dense computation runs instead
    (an on-device ``lax.cond``), so the rewrite never changes results.
    """
    if region.combine is None or graph is None:
        return _sparse_region(region, read, options, sharding_of)
    # the sparse layer inside its branch: computed outside, its backward would still run (on zero
    # cotangents) when the dense branch is taken, and 0 * NaN would reach the gradients
    return lax.cond(_capacity_assumptions_fail(region, read), lambda: _dense_region(graph, region, read),
                    lambda: _sparse_region(region, read, options, sharding_of))


def differentiable_region(region: MoeRegion, read, options: "RewriteOptions", sharding_of, graph: JaxprGraph):
    """``(output, pullback)``: the sparse layer and its VJP, as a function of the dense region's operands.

    The routing weights (or a capacity layer's combine tensor) are rebuilt from their operands inside
    (``RegionDerivative.gate_eqns``): the sparse layer equals the dense one as a function of those, so
    its VJP is the dense region's, which the program's backward was proven to be
    (``derivative_match.py``). A capacity layer is the forward's on-device ``lax.cond``; its dense
    branch is under ``jax.checkpoint``, so that the residuals kept for it are its operands alone: no
    dense expert activations are saved when the sparse branch runs.
    """
    derivative = region.derivative
    producers = {out: eqn for eqn in derivative.gate_eqns for out in eqn.outputs}

    def rebuilt(values):
        local = dict(zip(derivative.inputs, values))

        def value(atom):  # the eqns the sparse layer reads are re-bound on demand: not a dense weight copy
            if isinstance(atom, Value) and atom not in local and atom in producers:
                eqn = producers[atom]
                local.update(zip(eqn.outputs, eqn.bind_as_traced([value(a) for a in eqn.inputs])))
            return local[atom] if isinstance(atom, Value) and atom in local else read(atom)

        return value

    def sparse(*values):
        return _sparse_region(region, rebuilt(values), options, sharding_of)

    layer = sparse
    if region.combine is not None:
        dense = jax.checkpoint(lambda *values: _dense_region(graph, region, rebuilt(values)))

        def layer(*values):  # the check reads combine rebuilt too: the program's may be gone with its backward
            fails = _capacity_assumptions_fail(region, rebuilt([lax.stop_gradient(v) for v in values]))
            return lax.cond(fails, dense, sparse, *values)

    return jax.vjp(layer, *[read(a) for a in derivative.inputs])


def _region_cotangent(value, parts, read):
    """A program value the sparse VJPs replace: their cotangents of it (one per region summed into it:
    layers sharing weights), plus the program's other terms of that sum."""
    total = sum(jnp.asarray(cotangent).astype(value.dtype).reshape(value.shape) for cotangent, _ in parts)
    for term in common_rest([out for _, out in parts]):
        total = total + read(term)
    return total


def _dense_region(graph: JaxprGraph, region: MoeRegion, read):
    """The region's original eqns, re-bound as traced: the fallback that is always right."""
    local = {}

    def value(atom):
        return local[atom] if isinstance(atom, Value) and atom in local else read(atom)

    for index in sorted(region.replaced):
        eqn = graph.eqns[index]
        local.update(zip(eqn.outputs, eqn.bind_as_traced([value(a) for a in eqn.inputs])))
    return local[region.output]


def _sparse_region(region: MoeRegion, read, options: "RewriteOptions", sharding_of):
    from moe_lowering.sparse_moe import sparse_moe

    read = _varying_like_output(region, read)
    anchor = region.anchor
    num_tokens = region.num_tokens
    tokens = read(region.tokens).reshape(num_tokens, region.d_model)
    if region.combine is not None:
        expert_indices, expert_weights = _capacity_choices(region, read)
    else:
        expert_indices = _index_matrix(anchor, read(anchor.indices))
        expert_weights = _routing_weights(region, read, expert_indices)
    if region.style == GATE_ON_TOKENS:
        tokens, expert_indices, expert_weights = _gated_copies(tokens, expert_indices, expert_weights)
    params = _region_params(region, read)
    capacity_factor = options.capacity_factor if region.combine is None else None
    layout = _sharded_layout(region, sharding_of)
    if layout:
        from moe_lowering.parallel import sharded_sparse_moe
        from moe_lowering.parallel.exchange import resolve_transport

        transport = resolve_transport(options.exchange_transport, layout.devices, options.backend)
        log.info("expert-parallel lowering, %s", layout.describe(transport, options.backend))
        out, stats = sharded_sparse_moe(tokens, expert_indices, expert_weights, params, region.program,
                                        num_experts=region.num_experts, layout=layout, backend=options.backend,
                                        weight_gather_quant=options.weight_gather_quant,
                                        capacity_factor=capacity_factor, exchange_transport=transport,
                                        return_stats=True)
        _report_dropped(region, capacity_factor, stats.dropped_copies)
        return _to_output_layout(out, region)
    if capacity_factor is not None:
        from moe_lowering.parallel.capacity import drop_over_capacity, expert_capacity

        capacity = expert_capacity(num_tokens, region.top_k, region.num_experts, capacity_factor)
        expert_indices, dropped = drop_over_capacity(expert_indices, region.num_experts, capacity)
        _report_dropped(region, capacity_factor, dropped)

    def sparse(tokens, expert_indices, expert_weights, *params):
        return sparse_moe(tokens, expert_indices, expert_weights, params, region.program,
                          num_experts=region.num_experts, backend=options.backend)

    sparse.__name__ = "moe_lowering_sparse_moe"
    out = jax.jit(sparse)(tokens, expert_indices, expert_weights, *params)
    return _to_output_layout(out, region)


def _varying_like_output(region: MoeRegion, read):
    """``read`` whose values vary over the manual mesh axes the region's output varies over (inside
    ``shard_map(check_vma=True)``; none elsewhere). The dense layer's values met its operands that do not
    vary (a replicated weight) through a ``pvary``, whose cotangent sums over the devices; the sparse layer's
    operands are cast the same way where they enter it, so its values and cotangents are typed as the
    dense layer's and its output as the region's."""
    axes = _compat.varying_axes(region.output.aval)
    return (lambda atom: _compat.vary_over(read(atom), axes)) if axes else read


def _report_dropped(region: MoeRegion, capacity_factor, dropped) -> None:
    """With ``capacity_factor``, log how many token copies each call dropped (INFO, on the host)."""
    if capacity_factor is None or not log.isEnabledFor(logging.INFO):
        return
    total = region.num_tokens * region.top_k
    jax.debug.callback(
        lambda n: log.info("capacity_factor=%s dropped %d of %d token copies", capacity_factor, n, total),
        dropped,
    )


@dataclass(frozen=True)
class RewriteOptions:
    """How regions are lowered: kernels, FSDP weight-gather quantisation, optional expert capacity,
    the expert-parallel exchange's transport."""

    backend: str = "auto"
    weight_gather_quant: str | None = None
    input_shardings: tuple = ()  # per top-level input: a NamedSharding or None
    capacity_factor: float | None = None  # None: dropless
    exchange_transport: str = "auto"  # how expert-parallel token rows travel (parallel.exchange.TRANSPORT_CHOICES)


def declared_shardings(scope: ScopeResult, input_shardings) -> dict:
    """Shardings known for values of ``scope``: its arguments' (top level only) and inlined jits'."""
    declared = dict(zip(scope.graph.inputs, input_shardings)) if not scope.path else {}
    declared.update(scope.graph.input_shardings)
    return {value: sharding for value, sharding in declared.items() if sharding is not None}


def _param_sharding(source, sharding_of):
    """``(mesh, spec)`` of a param's ``source``; a fused weight's, less the parts' axis, for its part."""
    if isinstance(source, Const):
        return None
    if not isinstance(source, WeightPart):
        return sharding_of(source)
    found = sharding_of(source.whole)
    return found and (found[0], found[1][:source.axis] + found[1][source.axis + 1:])


def region_layout(scope: ScopeResult, region: MoeRegion, input_shardings=()):
    """The expert-parallel layout of ``region`` (or None), as ``explain`` and the rewrite see it."""
    return _sharded_layout(region, functools.partial(_sharding_of, scope.graph, declared_shardings(scope, input_shardings)))


def _sharding_of(graph: JaxprGraph, declared: dict, atom):
    """``(mesh, spec)`` of a region input: its explicit-sharding type, a ``with_sharding_constraint``
    that produced it, or the sharding its top-level argument was given. ``None`` if unsharded."""
    typed = getattr(getattr(atom, "aval", None), "sharding", None)
    explicit = typed is not None and not getattr(typed.mesh, "empty", True) and any(tuple(typed.spec))
    sharding = typed if explicit else None
    while sharding is None and isinstance(atom, Value):
        if atom in declared:
            sharding = declared[atom]
            break
        eqn = graph.producer.get(atom)
        if eqn is None:
            break
        if eqn.primitive is _compat.sharding_constraint_p:
            sharding = eqn.params["sharding"]
        elif eqn.primitive in (lax.convert_element_type_p, lax.reduce_precision_p):
            atom = eqn.inputs[0]
        else:
            break
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None or not getattr(mesh, "shape_tuple", ()):
        return None
    rank = len(atom.shape)
    return mesh, tuple(spec) + (None,) * (rank - len(tuple(spec)))


def _sharded_layout(region: MoeRegion, sharding_of):
    """The expert-parallel layout read off the operands' shardings: None for one device, a falsy
    ``UnsupportedLayout`` (the single-device layer, with its reason) for shardings it cannot serve."""
    from jax.sharding import PartitionSpec

    token_sharding = sharding_of(region.tokens)
    mesh = token_sharding[0] if token_sharding else None
    weight_specs, weight_shapes = [], []
    for param in region.params:
        if param.kind not in (ParamKind.EXPERT_WEIGHT, ParamKind.PER_EXPERT):
            continue
        order = ("E", "K", "N") if param.kind is ParamKind.EXPERT_WEIGHT else (EXPERT, FEATURE)
        weight_shapes.append(tuple(param.source.shape[param.roles.index(r)] if r in param.roles else 1 for r in order))
        found = _param_sharding(param.source, sharding_of)
        if found is None:
            weight_specs.append(None)
            continue
        mesh = mesh or found[0]
        weight_specs.append(PartitionSpec(*[found[1][param.roles.index(r)] if r in param.roles else None for r in order]))
    if mesh is None or all(s is None for s in weight_specs) and not token_sharding:
        return None
    token_axes = ()
    if token_sharding:
        for entry in token_sharding[1][: len(region.anchor.token_shape)]:
            token_axes += (entry,) if isinstance(entry, str) else tuple(entry or ())
    from moe_lowering.parallel import plan_layout

    return plan_layout(mesh, PartitionSpec(token_axes or None, None), weight_specs, region.num_experts, weight_shapes)


def _index_matrix(anchor: RoutingAnchor, indices):
    """``[T, k]`` expert indices, the sizes named: ``-1`` would divide by ``k`` (and cannot infer ``T = 0``)."""
    return indices.reshape(math.prod(anchor.token_shape), anchor.top_k)


def _canonical(value, roles, order):
    """``value`` with its dims moved to ``order`` (roles), size-1 dims of other roles dropped."""
    keep = [i for i, r in enumerate(roles) if r in order]
    drop = [i for i, r in enumerate(roles) if r not in order]
    if any(value.shape[i] != 1 for i in drop):
        raise ValueError(f"cannot drop non-unit dims of roles {[roles[i] for i in drop]}")
    value = value.reshape([value.shape[i] for i in keep])
    kept_roles = [roles[i] for i in keep]
    perm = [kept_roles.index(r) for r in order if r in kept_roles]
    return jnp.transpose(value, perm), [r for r in order if r in kept_roles]


def _per_token(value, roles, token_shape, trailing=()):
    """``value`` as ``[T, *trailing]``: its token axes (any subset, in any order) broadcast to every
    token, its ``trailing`` roles last, axes of other roles (size 1, or only broadcast) read at 0. A token
    axis a reshape split into parts (``x.reshape(B, S, d)`` of ``[T, d]`` tokens) is merged back first."""
    roles, shape = whole_token_axes(roles, jnp.shape(value))
    value = jnp.asarray(value).reshape(shape)
    tokens = token_roles(len(token_shape))
    index = tuple(slice(None) if r in tokens or r in trailing else 0 for r in roles)
    value = value[index]
    kept = [r for r in roles if r in tokens or r in trailing]
    order = [r for r in tokens + tuple(trailing) if r in kept]
    value = jnp.transpose(value, [kept.index(r) for r in order])
    full = [token_shape[tokens.index(r)] if r in tokens else None for r in tokens]
    shape = [n if r in kept else 1 for r, n in zip(tokens, full)] + list(value.shape[len(value.shape) - len(trailing):])
    value = value.reshape(shape)
    value = jnp.broadcast_to(value, tuple(token_shape) + value.shape[len(tokens):])
    return value.reshape((math.prod(token_shape),) + value.shape[len(tokens):])


def _routing_weights(region: MoeRegion, read, expert_indices):
    """``[T, k]`` routing weights: the program's own gate values, read at the chosen experts.

    A ``[T, E]`` gate is zero off the chosen experts (the matcher proved it for finite values);
    should an entry there be NaN or infinite, the reference's output for that token is not
    finite either, and the ``0 * entry`` term below carries that into the weights.
    """
    num_tokens, top_k = expert_indices.shape
    token_shape = region.anchor.token_shape
    values = region.gate_values
    if values[0].expert is not None:  # the loop style: one [T] value per expert
        by_expert = sorted(values, key=lambda v: v.expert)
        table = jnp.stack([_per_token(read(v.atom), v.roles, token_shape) for v in by_expert], axis=1)
    elif EXPERT in values[0].roles:
        table = _per_token(read(values[0].atom), values[0].roles, token_shape, (EXPERT,))
    elif CHOICE in values[0].roles:
        return _per_token(read(values[0].atom), values[0].roles, token_shape, (CHOICE,))
    else:  # one weight per token, for each of its choices
        weights = _per_token(read(values[0].atom), values[0].roles, token_shape)
        return jnp.broadcast_to(weights[:, None], (num_tokens, top_k))
    if table.shape[0] != num_tokens:
        table = jnp.broadcast_to(table, (num_tokens,) + table.shape[1:])
    chosen = jnp.any(expert_indices[..., None] == jnp.arange(table.shape[1]), axis=1)
    poison = jnp.sum(jnp.where(chosen, 0, table) * 0, axis=1, keepdims=True)
    return jnp.take_along_axis(table, expert_indices, axis=1) + poison


def _slot_tensor(region: MoeRegion, read, which):
    """The dispatch or combine tensor as ``[T, E, C]``."""
    value, roles = which
    order = token_roles(len(region.anchor.token_shape)) + (EXPERT, SLOT)
    tensor, _ = _canonical(read(value), roles, order)
    return tensor.reshape(region.num_tokens, region.num_experts, tensor.shape[-1])


def _grouped_slot_tensor(region: MoeRegion, tensor):
    """A ``[T, E, C]`` slot tensor as ``[G, T / G, E, C]``: the tokens of each slot group together
    (``G = 1`` when every token shares the slots)."""
    token_shape = tuple(region.anchor.token_shape)
    tokens = token_roles(len(token_shape))
    order = list(region.slot_groups) + [r for r in tokens if r not in region.slot_groups]
    per_token = tensor.reshape(token_shape + tensor.shape[1:])
    per_token = jnp.transpose(per_token, [tokens.index(r) for r in order] + [len(tokens), len(tokens) + 1])
    groups = math.prod(token_shape[tokens.index(r)] for r in region.slot_groups)
    per_group = math.prod(token_shape[tokens.index(r)] for r in order[len(region.slot_groups):])
    return per_token.reshape((groups, per_group) + tensor.shape[1:])  # named sizes: T may be 0


def _kept(region: MoeRegion, read):
    """``[T, E]``: which experts the dispatch tensor sends each token to."""
    return jnp.any(_slot_tensor(region, read, region.dispatch) != 0, axis=-1)


def _capacity_assumptions_fail(region: MoeRegion, read):
    """True where the sparse capacity layer would not compute the reference, checked on the device.

    The sparse layer sends each token once to each expert whose slots it occupies and weighs the
    result by the token's combine entries there. That is the reference when the dispatch tensor is
    0/1, no slot holds two tokens (of one slot group), every token occupies at most ``top_k``
    experts, and combine and its derivative (bounded by ``region.combine_support``) are zero
    outside the dispatched slots.
    """
    dispatch = _slot_tensor(region, read, region.dispatch)
    occupied = dispatch != 0
    fails = jnp.any(occupied & (dispatch != 1))
    tokens_per_slot = jnp.sum(_grouped_slot_tensor(region, occupied.astype(jnp.int32)), axis=1)  # [G, E, C]
    fails |= jnp.any(tokens_per_slot > 1)
    fails |= jnp.any(jnp.sum(jnp.any(occupied, axis=-1), axis=-1) > region.top_k)
    combine_atom, roles = region.combine
    for mask in (read(combine_atom), support_indicator(region.combine_support, read)):
        full = jnp.broadcast_to(jnp.asarray(mask), combine_atom.shape)
        fails |= jnp.any((_slot_tensor(region, lambda _: full, (combine_atom, roles)) != 0) & ~occupied)
    has_empty_slot = jnp.any(tokens_per_slot == 0, axis=(0, 2))
    return fails | jnp.any(has_empty_slot & ~_expert_output_finite_at_zero(region, read))


def _expert_output_finite_at_zero(region: MoeRegion, read):
    """``[E]``: whether each expert's program, and its derivative, is finite on a zero row: what an
    empty slot holds.

    The dense layer computes every slot and multiplies the empty ones' outputs by zero combine
    entries, and their derivatives by zero cotangents; where the program or its derivative is not
    finite there (``x / norm(x)``, ``c / x**3``), ``0 * inf`` makes every token's output, or the
    gradients, NaN. A product of an all-zero row is zero without reading the weight (assumed
    finite), so this costs a few elementwise ops per expert unless biases make the row non-zero.
    """
    num_experts = region.num_experts
    params = _region_params(region, read)
    dtype = jnp.result_type(read(region.tokens))
    experts = jnp.arange(num_experts, dtype=jnp.int32)

    def one_row_per_expert(lhs, rhs, group_sizes, group_offset, preferred_element_type):
        lhs, rhs = _compat.vary_alike([lhs, rhs])  # both branches typed alike inside shard_map(check_vma=True)
        out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
        out_shape = (lhs.shape[0], rhs.shape[-1])

        def zero_product():  # 0 where lhs is finite, and a NaN cotangent still reaches lhs
            return jnp.broadcast_to((jnp.sum(lhs, axis=-1, keepdims=True) * 0).astype(out_dtype), out_shape)

        return lax.cond(jnp.any(lhs != 0),
                        lambda: jnp.einsum("ek,ekn->en", lhs, rhs, preferred_element_type=out_dtype), zero_product)

    def program_on(rows):
        context = RowContext(rows, jnp.ones((num_experts,), jnp.int32), experts, jnp.zeros((num_experts,), jnp.int32))
        return evaluate(region.program, params, context, one_row_per_expert)

    out, pullback = jax.vjp(program_on, jnp.zeros((num_experts, region.d_model), dtype))
    (d_rows,) = pullback(jnp.zeros_like(out))
    return jnp.all(jnp.isfinite(out), axis=-1) & jnp.all(jnp.isfinite(d_rows), axis=-1)


def _capacity_choices(region: MoeRegion, read):
    """Capacity style: each token's kept experts and weights, read off dispatch and combine.

    ``region.top_k`` sums the k of every routing decision the dispatch reads (GShard's two); past
    ``E`` (an argmax and a top-2 over two experts) a token still occupies at most ``E`` experts."""
    num_experts = region.num_experts
    kept = _kept(region, read)
    gate = jnp.sum(_slot_tensor(region, read, region.combine), axis=-1)
    _, choices = lax.top_k(kept.astype(jnp.float32), min(region.top_k, num_experts))
    kept_choice = jnp.take_along_axis(kept, choices, axis=1)
    weights = jnp.take_along_axis(gate, choices, axis=1)
    expert_indices = jnp.where(kept_choice, choices, num_experts)
    return expert_indices, jnp.where(kept_choice, weights, 0)


def _region_params(region: MoeRegion, read) -> list:
    """The region's program inputs as they are now, each in the layout ``ExpertProgram`` expects."""
    sources = [_read_source(p.source, read) for p in region.params]
    return [_normalise_param(p, value, region) for p, value in zip(region.params, sources)]


def _read_source(source, read):
    """A program input's value now: a constant's, E separate weights stacked (experts kept as separate
    modules: a copy per call), one part of a fused weight, or the value ``read`` gives."""
    if isinstance(source, Const):
        return source.value
    if isinstance(source, StackedWeights):
        return jnp.stack([read(part) for part in source.parts])
    if isinstance(source, WeightPart):
        return lax.index_in_dim(_read_source(source.whole, read), source.index, source.axis, keepdims=False)
    return read(source)


def _normalise_param(param, value, region: MoeRegion):
    """A program input in the layout ``ExpertProgram`` expects (see ``ParamKind``)."""
    value = jnp.asarray(value)
    if param.kind is ParamKind.EXPERT_WEIGHT:
        return jnp.transpose(value, [param.roles.index(r) for r in ("E", "K", "N")])
    if param.kind is ParamKind.PER_EXPERT:
        out, roles = _canonical(value, param.roles, (EXPERT, FEATURE))
        return out if FEATURE in roles else out.reshape(-1, 1)
    if param.kind is ParamKind.PER_TOKEN:  # any subset of the token axes, broadcast to every token
        trailing = (FEATURE,) if FEATURE in param.roles else ()
        out = _per_token(value, param.roles, region.anchor.token_shape, trailing)
        return out if trailing else out.reshape(-1, 1)
    if value.ndim == 0:
        return value
    out, roles = _canonical(value, param.roles, (FEATURE,))
    return out.reshape(1, -1)


def _gated_copies(tokens, expert_indices, expert_weights):
    """The gate-on-tokens style (``x * G[t, e]`` before the experts): each routed copy of a token,
    scaled by its routing weight, as a token of its own with one expert and weight 1. The expert
    program then runs on the scaled row as the dense layer's does (exact for a nonlinear body, where
    weighting the output would not be); ``_to_output_layout`` sums a token's copies."""
    num_tokens, top_k = expert_indices.shape
    copies = (tokens[:, None, :] * expert_weights[..., None].astype(tokens.dtype)).reshape(num_tokens * top_k, -1)
    return copies, expert_indices.reshape(-1, 1), jnp.ones((num_tokens * top_k, 1), expert_weights.dtype)


def _to_output_layout(out, region: MoeRegion):
    if region.style == GATE_ON_TOKENS:  # one row per routed copy (``_gated_copies``), summed per token
        out = jnp.sum(out.reshape(region.num_tokens, region.top_k, -1), axis=1,
                      dtype=jnp.promote_types(out.dtype, jnp.float32)).astype(out.dtype)
    token_shape = tuple(region.anchor.token_shape)
    tokens = token_roles(len(token_shape))
    roles = [r for r in region.output_roles if r != ONE]
    kept = [r for r in tokens if r in roles]  # token axes of size 1 the output's layout dropped are left out
    out = out.reshape(tuple(token_shape[tokens.index(r)] for r in kept) + (out.shape[-1],))
    canonical = kept + [FEATURE]
    out = jnp.transpose(out, [canonical.index(r) for r in roles])
    return out.reshape(region.output.shape).astype(region.output.dtype)
