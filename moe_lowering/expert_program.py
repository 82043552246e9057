"""The per-row expert computation lifted out of a dense MoE, as a tiny expression DAG.

The matcher reads the dense reference's expert body (up-projections, activation, biases, gating
products, down-projection) and records it here, eqn by eqn, with each operand's *role* instead
of its dense shape. The sparse implementation then replays the same primitives with ``bind`` on
sorted rows ``[rows, features]``: an expert weight becomes a grouped GEMM, a per-expert bias a
gather by the row's expert, a constant stays a constant. Whatever elementwise body the user
wrote (silu, gelu, relu, squared relu, clipped SwiGLU, ...) runs unchanged.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moe_lowering import _compat

log = logging.getLogger(__name__)

class ParamKind(Enum):
    """How a program input is indexed by a sorted row."""

    EXPERT_WEIGHT = "expert_weight"  # [E, K, N], used by a grouped GEMM
    PER_EXPERT = "per_expert"  # [E, F] or [E, 1]: gathered by the row's expert
    PER_TOKEN = "per_token"  # [T, F] or [T, 1]: gathered by the row's token
    CONSTANT = "constant"  # [1, F], [1, 1] or a scalar: the same for every row


@dataclass(frozen=True)
class RowInput:
    """The token row routed to an expert."""


@dataclass(frozen=True)
class ExpertMatmul:
    """``source @ weight[expert]`` with ``weight`` an ``EXPERT_WEIGHT`` input ``[E, K, N]``."""

    source: "Node"
    weight: int
    preferred_element_type: Any = None


@dataclass(frozen=True)
class ParamRef:
    """A non-row operand: program input ``index`` (see ``ParamKind``)."""

    index: int


@dataclass(frozen=True)
class Literal:
    """A scalar literal operand, kept exactly as the dense program had it."""

    value: Any


@dataclass(frozen=True)
class Elementwise:
    """One elementwise primitive of the dense body, re-bound on rows with its own params."""

    primitive: Any
    params: tuple[tuple[str, Any], ...]
    operands: tuple["Operand", ...]


@dataclass(frozen=True)
class FeatureSlice:
    """``source[:, start:stop:stride]`` (a split of a fused gate/up projection)."""

    source: "Node"
    start: int
    stop: int
    stride: int = 1


@dataclass(frozen=True)
class FeatureConcat:
    """Rows concatenated along the feature axis."""

    sources: tuple["Node", ...]


@dataclass(frozen=True)
class CustomJvpCall:
    """An elementwise ``jax.custom_jvp`` function of the dense body (``relu``, a straight-through
    estimator), replayed on rows with its own derivative rule, not autodiff's of its body.

    ``body`` and ``rule`` are ``(jaxpr, consts)``; both were checked to be elementwise, so they run
    unchanged on rows of any count. ``rule`` maps ``(*primals, *tangents)`` to ``(primal, tangent)``.
    Two calls are equal when their printed body and rule are (the loop style traces one per expert).
    """

    name: str
    body: tuple = field(compare=False)
    rule: tuple = field(compare=False)
    operands: tuple["Operand", ...]
    zero_tangent: bool = False  # the rule says the derivative is zero
    text: str = ""  # body and rule as printed, with their constants: what equality compares


Node = Union[RowInput, ExpertMatmul, Elementwise, FeatureSlice, FeatureConcat, CustomJvpCall]
Operand = Union[Node, ParamRef, Literal]


@dataclass(frozen=True)
class ExpertProgram:
    """``output`` computed from one routed row; ``param_kinds[i]`` says how input ``i`` is indexed."""

    output: Node
    param_kinds: tuple[ParamKind, ...]
    nodes: tuple[Node, ...] = field(default=(), compare=False)

    def matmuls(self) -> tuple[ExpertMatmul, ...]:
        return tuple(n for n in self.nodes if isinstance(n, ExpertMatmul))

    def describe(self) -> str:
        """The body's primitives in order, e.g. ``matmul, logistic, mul, mul, matmul``."""
        names = []
        for node in self.nodes:
            if isinstance(node, ExpertMatmul):
                names.append("matmul")
            elif isinstance(node, Elementwise):
                names.append(str(node.primitive))
            elif isinstance(node, CustomJvpCall):
                names.append(node.name)
            elif isinstance(node, FeatureSlice):
                names.append("split")
            elif isinstance(node, FeatureConcat):
                names.append("concat")
        if len(names) > 12:
            names = names[:5] + [f"... {len(names) - 10} more ..."] + names[-5:]
        return ", ".join(names)


def topological_nodes(output: Node) -> tuple[Node, ...]:
    """All nodes reachable from ``output``, operands before users."""
    order: list[Node] = []
    seen: set[int] = set()

    def visit(node):
        if not isinstance(node, (RowInput, ExpertMatmul, Elementwise, FeatureSlice, FeatureConcat, CustomJvpCall)):
            return
        if id(node) in seen:
            return
        seen.add(id(node))
        for child in _children(node):
            visit(child)
        order.append(node)

    visit(output)
    return tuple(order)


def _children(node: Node) -> tuple:
    if isinstance(node, ExpertMatmul):
        return (node.source,)
    if isinstance(node, (Elementwise, CustomJvpCall)):
        return node.operands
    if isinstance(node, FeatureSlice):
        return (node.source,)
    if isinstance(node, FeatureConcat):
        return node.sources
    return ()


@dataclass(frozen=True)
class RowContext:
    """What the program needs to know about the sorted rows it runs on."""

    rows: jax.Array | None  # [N, D] token rows, sorted by expert (None: ``make_rows`` makes them)
    group_sizes: jax.Array  # [E] (or the local experts' when group_offset is used)
    expert_of_row: jax.Array  # [N] expert of each sorted row, clipped into range
    token_of_row: jax.Array  # [N] token of each sorted row
    group_offset: Any = 0
    # Where ``rows`` is None: makes them, called only if the program reads the rows themselves (not
    # only through a fusion that reads them from the tokens), so no unused permutation is traced.
    make_rows: Callable[[], jax.Array] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class SwigluFusion:
    """``mul(silu(source @ W[gate]), source @ W[up])`` in a program, with ``silu(h) = mul(h, logistic(h))``.

    ``inner`` are the nodes only this product uses (both matmuls, the logistic, the silu mul):
    a fused evaluation computes ``output`` from ``source`` and skips them.
    """

    output: Elementwise
    source: Node
    gate: ExpertMatmul
    up: ExpertMatmul
    inner: tuple[Node, ...]


def find_swiglu_fusions(program: ExpertProgram) -> tuple[SwigluFusion, ...]:
    """Every SwiGLU up-projection of ``program`` whose intermediates nothing else reads."""
    nodes = program.nodes or topological_nodes(program.output)
    users = Counter(id(child) for node in nodes for child in _children(node))
    users[id(program.output)] += 1
    fusions = []
    for node in nodes:
        fusion = _match_swiglu(node, users)
        if fusion is not None:
            fusions.append(fusion)
    return tuple(fusions)


def _is_primitive(node, primitive, arity: int) -> bool:
    return (isinstance(node, Elementwise) and node.primitive is primitive and len(node.operands) == arity
            and dict(node.params).get("out_dtype") is None)


def _match_swiglu(node, users: Counter) -> SwigluFusion | None:
    if not _is_primitive(node, lax.mul_p, 2):
        return None
    for silu, up in (node.operands, node.operands[::-1]):
        if not (_is_primitive(silu, lax.mul_p, 2) and isinstance(up, ExpertMatmul)):
            continue
        for gate, logistic in (silu.operands, silu.operands[::-1]):
            if not (isinstance(gate, ExpertMatmul) and _is_primitive(logistic, lax.logistic_p, 1)
                    and logistic.operands[0] is gate):
                continue
            same_source = gate.source is up.source or (isinstance(gate.source, RowInput)
                                                       and isinstance(up.source, RowInput))
            only_here = (users[id(gate)] == 2 and users[id(logistic)] == 1 and users[id(silu)] == 1
                         and users[id(up)] == 1 and gate is not up)
            if same_source and only_here and gate.preferred_element_type == up.preferred_element_type:
                return SwigluFusion(node, gate.source, gate, up, (gate, logistic, silu, up))
    return None


def evaluate(program: ExpertProgram, params, context: RowContext, grouped_matmul, swiglu_matmul=None,
             swiglu_max_width: int | None = None, output_matmul=None, row_swiglu_matmul=None) -> jax.Array:
    """Runs ``program`` on sorted rows; ``grouped_matmul(lhs, rhs, group_sizes, group_offset, pet)``.

    With ``swiglu_matmul(lhs, gate_rhs, up_rhs, group_sizes, group_offset, pet)`` every SwiGLU
    up-projection (:func:`find_swiglu_fusions`) up to ``swiglu_max_width`` wide (``None``: any) is
    computed by it in one product instead of two grouped products and the elementwise activation.
    With ``output_matmul`` (same arguments as ``grouped_matmul``), a program whose output is an
    ``ExpertMatmul`` has that product computed by it, and its result is what this returns (the
    sparse MoE combines the rows in it: :func:`last_product_weight`). With ``row_swiglu_matmul(gate_rhs,
    up_rhs, group_sizes, group_offset, pet)``, a fused SwiGLU up-projection of the routed rows
    themselves is computed by it (the sparse MoE reads the rows from the tokens there).
    """
    values: dict[int, jax.Array] = {}
    fused_at: dict[int, SwigluFusion] = {}
    skipped: set[int] = set()
    for fusion in find_swiglu_fusions(program) if swiglu_matmul is not None else ():
        gate_rhs, up_rhs = params[fusion.gate.weight], params[fusion.up.weight]
        plain = not (hasattr(gate_rhs, "grouped_matmul") or hasattr(up_rhs, "grouped_matmul"))
        narrow = swiglu_max_width is None or jnp.shape(gate_rhs)[-1] <= swiglu_max_width
        if plain and narrow and jnp.shape(gate_rhs) == jnp.shape(up_rhs):
            fused_at[id(fusion.output)] = fusion
            skipped.update(id(node) for node in fusion.inner)
    if fused_at:
        log.debug("evaluating %d SwiGLU up-projection(s) with the fused grouped product", len(fused_at))
    nodes = program.nodes or topological_nodes(program.output)
    if row_swiglu_matmul is not None:
        # The rows themselves are not needed where every reader of them is a fused product that reads the
        # tokens instead: they are then never made (``RowContext.make_rows``).
        readers = [n for n in nodes if any(isinstance(child, RowInput) for child in _children(n))]
        if not isinstance(program.output, RowInput) and all(id(n) in skipped for n in readers):
            skipped.update(id(n) for n in nodes if isinstance(n, RowInput))

    def operand(op, like, primitive):
        if isinstance(op, Literal):
            value = op.value
        elif isinstance(op, ParamRef):
            value = _row_param(params[op.index], program.param_kinds[op.index], context, like)
        else:
            return values[id(op)]
        # lax.select_n wants every case at full shape; the dense program's were, the rows' must be too
        return jnp.broadcast_to(value, like.shape) if primitive is lax.select_n_p else value

    for node in nodes:
        if id(node) in skipped:
            continue
        if id(node) in fused_at:
            fusion = fused_at[id(node)]
            weights = (params[fusion.gate.weight], params[fusion.up.weight], context.group_sizes, context.group_offset,
                       fusion.gate.preferred_element_type)
            if row_swiglu_matmul is not None and isinstance(fusion.source, RowInput):
                out = row_swiglu_matmul(*weights)
            else:
                out = swiglu_matmul(values[id(fusion.source)], *weights)
        elif isinstance(node, RowInput):
            out = context.rows if context.rows is not None else context.make_rows()
        elif isinstance(node, ExpertMatmul):
            product = output_matmul if output_matmul is not None and node is program.output else grouped_matmul
            out = product(
                values[id(node.source)], params[node.weight], context.group_sizes, context.group_offset,
                node.preferred_element_type,
            )
        elif isinstance(node, FeatureSlice):
            out = lax.slice_in_dim(values[id(node.source)], node.start, node.stop, node.stride, axis=1)
        elif isinstance(node, FeatureConcat):
            out = jnp.concatenate([values[id(s)] for s in node.sources], axis=1)
        elif isinstance(node, CustomJvpCall):
            like = next(values[id(o)] for o in node.operands if id(o) in values)
            out = custom_jvp_function(node)(*[operand(o, like, None) for o in node.operands])
        else:
            like = next(values[id(o)] for o in node.operands if id(o) in values)
            operands = _compat.vary_alike(operand(o, like, node.primitive) for o in node.operands)
            out = node.primitive.bind(*operands, **dict(node.params))
        values[id(node)] = out
    return values[id(program.output)]


def last_product_weight(program: ExpertProgram, params):
    """The weight of the product that is ``program``'s output (``None`` where the output is anything
    else): the product a sparse MoE can combine its rows in."""
    return params[program.output.weight] if isinstance(program.output, ExpertMatmul) else None


def _row_param(value, kind: ParamKind, context: RowContext, like):
    if kind is ParamKind.PER_EXPERT:
        value = jnp.take(value, context.expert_of_row, axis=0, mode="clip")
    elif kind is ParamKind.PER_TOKEN:
        value = jnp.take(value, context.token_of_row, axis=0, mode="clip")
    elif kind is ParamKind.CONSTANT and jnp.ndim(value) == 0:
        return value
    return jnp.broadcast_to(value, like.shape).astype(value.dtype)


def custom_jvp_function(node: CustomJvpCall):
    """``node`` as a ``jax.custom_jvp`` function of rows: its body, and its own derivative rule."""

    def replay(jaxpr_and_consts, args):
        jaxpr, consts = jaxpr_and_consts
        like = next(a for a in args if jnp.ndim(a))
        return replay_elementwise(jaxpr, consts, args, like.shape)

    function = jax.custom_jvp(lambda *args: replay(node.body, args)[0])

    def rule(primals, tangents):
        outputs = replay(node.rule, tuple(primals) + tuple(tangents))
        return outputs[0], jnp.zeros_like(outputs[0]) if node.zero_tangent else outputs[1]

    function.defjvp(rule)
    return function


def replay_elementwise(jaxpr, consts, args, shape) -> list:
    """Runs an elementwise jaxpr on arguments of another ``shape`` than it was traced for: every
    broadcast goes to ``shape``, nested ``custom_jvp`` calls keep their rules. A ``pvary`` (traced inside
    ``shard_map``) is a type: the operands of each op are cast alike instead, to whatever the rows vary over."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(atom):
        return _compat.literal_value(atom) if _compat.is_literal(atom) else env[atom]

    for eqn in jaxpr.eqns:
        inputs = [read(a) for a in eqn.invars]
        if eqn.primitive is lax.broadcast_in_dim_p:
            outputs = [jnp.broadcast_to(inputs[0], shape)]
        elif eqn.primitive is _compat.custom_jvp_call_p:
            node = custom_jvp_node(eqn.params, _compat.custom_jvp_name(eqn.params), tuple(Literal(None) for _ in inputs))
            outputs = [custom_jvp_function(node)(*inputs)]
        elif eqn.primitive is _compat.jit_p:
            inner = eqn.params["jaxpr"]
            outputs = replay_elementwise(_compat.open_jaxpr(inner), _compat.sub_jaxpr_consts(inner), inputs, shape)
        elif eqn.primitive in _compat.varying_casts:
            outputs = inputs
        else:
            result = eqn.primitive.bind(*_compat.vary_alike(inputs), **eqn.params)
            outputs = result if eqn.primitive.multiple_results else [result]
        env.update(zip(eqn.outvars, outputs))
    return [read(a) for a in jaxpr.outvars]


def custom_jvp_node(params, name: str, operands: tuple) -> CustomJvpCall:
    """A ``CustomJvpCall`` for a ``custom_jvp_call`` eqn's params (one output, no consts)."""
    body = params["call_jaxpr"]
    rule_jaxpr, rule_consts, out_zeros = _compat.custom_jvp_rule(params, len(operands))
    body_jaxpr, body_consts = _compat.open_jaxpr(body), _compat.sub_jaxpr_consts(body)
    return CustomJvpCall(name, (body_jaxpr, body_consts), (rule_jaxpr, rule_consts), operands, bool(out_zeros[0]),
                         _printed(body_jaxpr, body_consts, rule_jaxpr, rule_consts))


def custom_jvp_text(params, num_inputs: int) -> str:
    """A ``custom_jvp_call`` eqn's body and derivative rule as printed, with their constants: equal for two
    calls of one function at the same types, traced apart (what ``CustomJvpCall`` equality compares)."""
    from moe_lowering import _compat

    body = params["call_jaxpr"]
    rule_jaxpr, rule_consts, _ = _compat.custom_jvp_rule(params, num_inputs)
    return _printed(_compat.open_jaxpr(body), _compat.sub_jaxpr_consts(body), rule_jaxpr, rule_consts)


def _printed(body_jaxpr, body_consts, rule_jaxpr, rule_consts) -> str:
    return "\n".join([str(body_jaxpr), repr([np.asarray(c).tolist() for c in body_consts]), str(rule_jaxpr),
                      repr([np.asarray(c).tolist() for c in rule_consts])])
