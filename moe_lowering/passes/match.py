"""Finds dense-reference MoE regions in a ``JaxprGraph`` by abstract interpretation.

Matching is anchored on routing (``top_k``, ``argmax``): from one anchor's expert indices the
analysis walks the program forward, giving each value it understands an abstract value
(``abstract.py``): one-hot masks and gates built from the indices, expert rows computed from the
tokens and an expert-batched weight, their gating and their sum. Rules are registered per
primitive object (``@rule(lax.mul_p, ...)``). Values it does not understand stay plain; a rule
that sees something *almost* right returns a ``FailedMatch`` whose reason ``explain`` reports.

Structure (this file) is separate from the semantic checks in ``_finish_region``: that every
expert is covered once, that routing weights are only applied where they commute with the rest
of the expert program, and that no interior value (the dense ``[T, E, F]`` activations) is used
outside the region, so replacing it cannot change anything else.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import jax
import numpy as np
from jax import lax

from moe_lowering import _compat
from moe_lowering.expert_program import (
    CustomJvpCall,
    Elementwise,
    ExpertMatmul,
    ExpertProgram,
    FeatureConcat,
    FeatureSlice,
    Literal,
    ParamKind,
    ParamRef,
    RowInput,
    custom_jvp_node,
    replay_elementwise,
    topological_nodes,
)
from moe_lowering.passes.abstract import (
    BROADCAST,
    CHOICE,
    EXPERT,
    FEATURE,
    ONE,
    SLOT,
    Combined,
    ExpertIndex,
    ExpertParamSlice,
    Factor,
    Gate,
    GateValue,
    GatheredWeight,
    Iota,
    NegativeIndexCheck,
    PackedIndices,
    Roles,
    Rows,
    ShiftedIndex,
    is_token,
    token_roles,
)
from moe_lowering.passes.assumptions import BY_NAME
from moe_lowering.passes.derivative_support import Support, derivative_support, tangent_free
from moe_lowering.passes.graph import Const, Eqn, JaxprGraph, Value, identity_annotations

log = logging.getLogger(__name__)

ITERATION_ROLE = "i"  # the axis of an iota, before a use says whether it counts tokens or experts


class FailedMatch:
    """A falsy match result that carries the reason, so ``explain`` can say what did not match, and
    the name of the assumption (``assumptions.py``) that could not be proven, where one could not."""

    __slots__ = ("reason", "eqn", "assumption")

    def __init__(self, reason: str, eqn: Eqn | None = None, assumption: str | None = None):
        assert assumption is None or assumption in BY_NAME, assumption
        self.reason = reason
        self.eqn = eqn
        self.assumption = assumption

    def __bool__(self):
        return False

    def __repr__(self):
        return f"FailedMatch({self.reason!r})"


@dataclass(frozen=True)
class IndexInBounds:
    """``0 <= idx`` and/or ``idx < E`` of the routing indices: always true for a top-k's output."""

    roles: Roles
    lower: bool
    upper: bool


@dataclass(frozen=True)
class RoutingAnchor:
    """A routing decision: ``indices [*tokens, k]`` choosing among ``num_experts``."""

    eqn: Eqn
    indices: Value
    num_experts: int
    top_k: int
    token_shape: tuple[int, ...]
    kind: str  # "top_k" or "argmax"

    def describe(self) -> str:
        return f"{self.kind} (k={self.top_k}, E={self.num_experts}) at {self.eqn.where()}"


@dataclass(frozen=True)
class ParamSource:
    """Where a program input comes from: ``source`` with per-dim ``roles``; how it is indexed."""

    source: Any
    kind: ParamKind
    roles: Roles  # EXPERT_WEIGHT: E/K/N per dim; otherwise token roles, E, F, 1


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


# --------------------------------------------------------------------------- rule registry

Rule = Callable[["Analysis", Eqn, list], Any]
_RULES: dict[Any, Rule] = {}
_ELEMENTWISE: set = set()


def rule(*primitives):
    """Registers ``fn`` as the abstract rule for each primitive object."""

    def register(fn):
        for primitive in primitives:
            _RULES[primitive] = fn
        return fn

    return register


@functools.cache
def _register_rules() -> None:
    """Primitive tables are built on first use, keeping ``import moe_lowering`` cheap."""
    names = (
        "add sub mul div max min neg exp exp2 log log1p expm1 logistic tanh erf erf_inv integer_pow pow "
        "sqrt rsqrt cbrt abs sign select_n convert_element_type clamp square sin cos tan reduce_precision "
        "copy eq lt gt le ge ne and or not erfc is_finite floor ceil round sinh cosh asinh acosh atanh "
        "asin acos atan atan2 rem nextafter"
    ).split()
    for name in names:
        primitive = getattr(lax, f"{name}_p", None)
        if primitive is not None:
            _ELEMENTWISE.add(primitive)
            _RULES.setdefault(primitive, _elementwise_rule)
    for primitive in identity_annotations():
        _RULES.setdefault(primitive, _annotation)


def rules() -> dict:
    _register_rules()
    return _RULES


# --------------------------------------------------------------------------- anchors


def find_anchors(graph: JaxprGraph) -> list[RoutingAnchor]:
    """Routing decisions over the last axis: ``top_k``, ``argmax``, and ``argsort(...)[..., :k]``."""
    anchors = []
    for eqn in graph.eqns:
        if eqn.primitive is lax.sort_p:
            anchors.extend(_argsort_anchors(graph, eqn))
        if eqn.primitive is lax.top_k_p:
            scores = eqn.inputs[0]
            axis = eqn.params.get("axis", len(scores.shape) - 1)
            if axis not in (-1, len(scores.shape) - 1) or len(scores.shape) < 2:
                continue
            k = eqn.params["k"]
            anchors.append(RoutingAnchor(eqn, eqn.outputs[1], scores.shape[-1], k, scores.shape[:-1], "top_k"))
        elif eqn.primitive is lax.argmax_p:
            scores = eqn.inputs[0]
            if tuple(eqn.params["axes"]) != (len(scores.shape) - 1,) or len(scores.shape) < 2:
                continue
            anchors.append(RoutingAnchor(eqn, eqn.outputs[0], scores.shape[-1], 1, scores.shape[:-1], "argmax"))
    return anchors


def _through_rev(graph: JaxprGraph, value, last: int):
    """``value`` with reversals along the last axis seen through (``argsort(descending=True)``)."""
    eqn = graph.producer.get(value)
    while eqn is not None and eqn.primitive is lax.rev_p and tuple(eqn.params["dimensions"]) == (last,):
        value = eqn.inputs[0]
        eqn = graph.producer.get(value)
    return value, eqn


def _argsort_anchors(graph: JaxprGraph, sort: Eqn) -> list[RoutingAnchor]:
    """``jnp.argsort(scores)`` sliced to k entries along the sorted (last) axis: a top-k by another name."""
    if len(sort.inputs) != 2 or sort.params.get("num_keys") != 1:
        return []
    last = len(sort.inputs[0].shape) - 1
    if sort.params["dimension"] != last or last < 1:
        return []
    _, iota = _through_rev(graph, sort.inputs[1], last)
    if iota is None or iota.primitive is not lax.iota_p or iota.params["dimension"] != last:
        return []
    indices = [sort.outputs[1]]
    for user in graph.users.get(sort.outputs[1], ()):
        if user.primitive is lax.rev_p and tuple(user.params["dimensions"]) == (last,):
            indices.append(user.outputs[0])
    num_experts = sort.inputs[0].shape[-1]
    anchors = []
    for value in indices:
        for user in graph.users.get(value, ()):
            if user.primitive is not lax.slice_p:
                continue
            out_shape = user.outputs[0].shape
            if out_shape[:-1] != value.shape[:-1] or not 0 < out_shape[-1] < num_experts:
                continue
            if (user.params.get("strides") or (1,) * len(out_shape))[-1] != 1:
                continue
            anchors.append(RoutingAnchor(user, user.outputs[0], num_experts, out_shape[-1], out_shape[:-1], "argsort"))
    return anchors


# --------------------------------------------------------------------------- analysis


@dataclass
class Analysis:
    """Abstract interpretation of ``graph`` seeded with one routing anchor."""

    graph: JaxprGraph
    anchor: RoutingAnchor
    values: dict = field(default_factory=dict)
    params: list = field(default_factory=list)
    failures: list = field(default_factory=list)
    counted_anchors: tuple = ()
    # A weight [E, d, f] with f == E (or d == E) leaves its expert axis to the data flow: the first
    # candidate is tried, and, if no region follows, the last (see ``analyse``).
    expert_axis_choice: int = 0
    ambiguous_expert_axis: bool = False

    @property
    def token_shape(self) -> tuple[int, ...]:
        return self.anchor.token_shape

    @property
    def num_experts(self) -> int:
        return self.anchor.num_experts

    def run(self) -> None:
        table = rules()
        index = self.anchor.indices
        roles = token_roles(len(self.token_shape)) + ((CHOICE,) if self.anchor.kind != "argmax" else ())
        self.values[index] = ExpertIndex(roles)
        for eqn in self.graph.eqns:  # expert matmuls may precede the routing in program order
            if eqn is not self.anchor.eqn:
                self._step(eqn, table)

    def _step(self, eqn: Eqn, table) -> None:
        abstracts = [self.abstract(a) for a in eqn.inputs]
        # iotas and matmuls of plain values can start a pattern (the one-hot's iota, x @ W[E, d, f])
        starts_something = eqn.primitive in (lax.iota_p, lax.dot_general_p)
        if not starts_something and all(a is None for a in abstracts) and not _maybe_param_slice(self, eqn):
            return
        fn = table.get(eqn.primitive)
        if fn is None:
            if any(isinstance(a, (Rows, Combined)) for a in abstracts):
                self.fail(f"`{eqn.primitive}` is applied to expert activations and is not understood", eqn)
            return
        try:
            result = fn(self, eqn, abstracts)
        except Exception as error:  # a matcher bug must not break the user's program: decline, loudly
            log.warning("moe_lowering: matcher error at %s (`%s`), declining this routing: %r", eqn.where(),
                        eqn.primitive, error)
            result = FailedMatch(f"internal matcher error on `{eqn.primitive}`: {error!r}", eqn)
        if isinstance(result, FailedMatch):
            self.fail(result.reason, result.eqn or eqn)
        elif isinstance(result, tuple):
            self.values.update(zip(eqn.outputs, result))
        elif result is not None:
            self.values[eqn.outputs[0]] = result

    def abstract(self, atom):
        return self.values.get(atom) if isinstance(atom, Value) else None

    def fail(self, reason: str, eqn: Eqn | None) -> None:
        log.debug("moe_lowering: near miss at %s: %s", eqn.where() if eqn else "?", reason)
        self.failures.append(FailedMatch(reason, eqn))

    def param(self, source, kind: ParamKind, roles: Roles) -> int:
        entry = ParamSource(source, kind, roles)
        for i, existing in enumerate(self.params):
            if existing.source is source and existing.kind is kind and existing.roles == roles:
                return i
        self.params.append(entry)
        return len(self.params) - 1

    def depends_on_anchor(self, atom) -> bool:
        return isinstance(atom, Value) and self.anchor.indices in self.graph.ancestors(atom)


# --------------------------------------------------------------------------- helpers


def _is_zero(graph: JaxprGraph, atom) -> bool:
    """``atom`` is a literal zero or a broadcast of one."""
    while True:
        if isinstance(atom, Const):
            return bool(np.all(np.asarray(atom.value) == 0))
        eqn = graph.producer.get(atom)
        if eqn is None:
            return False
        if eqn.primitive in (lax.broadcast_in_dim_p, lax.convert_element_type_p, lax.reshape_p) + identity_annotations():
            atom = eqn.inputs[0]
        else:
            return False


def _broadcast_source(graph: JaxprGraph, atom) -> tuple[Any, tuple[int, ...]]:
    """The value a plain operand was broadcast from, and which output dim each source dim became."""
    mapping = tuple(range(len(atom.shape)))
    while isinstance(atom, Value):
        eqn = graph.producer.get(atom)
        if eqn is None or eqn.primitive is not lax.broadcast_in_dim_p:
            break
        dims = tuple(eqn.params["broadcast_dimensions"])
        mapping = tuple(mapping[d] for d in dims)
        atom = eqn.inputs[0]
    return atom, mapping


def _plain_roles(graph: JaxprGraph, atom, target_roles: Roles, target_shape) -> tuple[Any, Roles]:
    """A plain operand's source and the role of each of its dims, read off the value it meets."""
    source, mapping = _broadcast_source(graph, atom)
    roles = []
    for dim, out_dim in enumerate(mapping):
        size = source.shape[dim]
        roles.append(target_roles[out_dim] if size != 1 and size == target_shape[out_dim] else ONE)
    return source, tuple(roles)


def _is_scalar(atom) -> bool:
    return len(atom.shape) == 0


def _params_tuple(eqn: Eqn) -> tuple:
    return tuple(sorted(eqn.params.items()))


def _merge_roles(a: Roles, b: Roles) -> Roles | None:
    out = []
    for x, y in zip(a, b):
        if x in (ONE, BROADCAST):
            out.append(y)
        elif y in (ONE, BROADCAST) or x == y:
            out.append(x)
        else:
            return None
    return tuple(out)


def _compatible(gate_roles: Roles, rows_roles: Roles) -> bool:
    """A gate (possibly broadcast) lines up with rows: every real gate role sits where rows have it."""
    return all(g in (ONE, BROADCAST) or g == r for g, r in zip(gate_roles, rows_roles))


def _rows_like(a, b) -> bool:
    return (
        a.space == b.space and a.tokens is b.tokens and a.expert == b.expert and a.roles == b.roles
        and a.dispatch is b.dispatch
    )


# --------------------------------------------------------------------------- rules


def _elementwise_rule(an: Analysis, eqn: Eqn, abstracts: list):
    prim = eqn.primitive
    if any(isinstance(a, IndexInBounds) for a in abstracts):
        return _bounds_arith(an, eqn, abstracts)
    if prim is lax.add_p and any(_is_contribution(a) for a in abstracts):
        abstracts = [_as_contribution(a) for a in abstracts]
    kinds = {type(a) for a in abstracts if a is not None}
    if Combined in kinds:
        return _combined_arith(an, eqn, abstracts)
    if Rows in kinds:
        return _rows_elementwise(an, eqn, abstracts)
    if kinds & {ExpertIndex, Iota, NegativeIndexCheck, ShiftedIndex}:
        return _index_arith(an, eqn, abstracts)
    if Gate in kinds:
        return _gate_arith(an, eqn, abstracts)
    if prim is lax.convert_element_type_p and isinstance(abstracts[0], ExpertParamSlice):
        return abstracts[0]
    return None


def _bounds_arith(an: Analysis, eqn: Eqn, abstracts):
    """Range checks combine with ``and``; selecting on a complete one keeps the in-range case."""
    a = abstracts[0]
    if eqn.primitive is lax.and_p and all(isinstance(x, IndexInBounds) for x in abstracts):
        b = abstracts[1]
        return IndexInBounds(_merge_roles(a.roles, b.roles) or a.roles, a.lower or b.lower, a.upper or b.upper)
    if eqn.primitive is lax.select_n_p and isinstance(a, IndexInBounds) and a.lower and a.upper:
        if len(abstracts) == 3 and abstracts[1] is None and isinstance(abstracts[2], Rows):
            return abstracts[2]
    return None


def _is_contribution(value) -> bool:
    return isinstance(value, Combined) or (
        isinstance(value, Rows) and value.space == "single" and value.gate is not None
    )


def _as_contribution(value):
    """One expert's gated output in the loop style, ready to be summed with the others."""
    if not (isinstance(value, Rows) and value.space == "single" and value.gate is not None):
        return value
    gate = replace(value.gate, expert=None, roles=tuple(r for r in value.gate.roles if r != ONE))
    return Combined(value.roles, value.node, value.tokens, gate, experts=frozenset({value.expert}), style="per-expert loop",
                    gate_values=(replace(value.gate_value, expert=value.expert),))


def _index_arith(an: Analysis, eqn: Eqn, abstracts):
    prim = eqn.primitive
    a, b = (abstracts + [None])[:2]
    if prim is lax.lt_p and isinstance(a, (ExpertIndex, Iota)) and _is_zero(an.graph, eqn.inputs[1]):
        return NegativeIndexCheck(eqn.inputs[0])
    if prim is lax.add_p and isinstance(a, (ExpertIndex, Iota)) and b is None:
        return ShiftedIndex(eqn.inputs[0])
    if prim is lax.select_n_p and isinstance(a, NegativeIndexCheck):
        on_false, on_true = eqn.inputs[1], eqn.inputs[2]
        shifted = an.abstract(on_true)
        if on_false is a.of and isinstance(shifted, ShiftedIndex) and shifted.of is a.of:
            return an.abstract(a.of)
        return None
    if prim is lax.convert_element_type_p and isinstance(a, (ExpertIndex, Iota)):
        largest = an.num_experts - 1 if isinstance(a, ExpertIndex) else eqn.inputs[0].shape[a.roles.index(ITERATION_ROLE)] - 1
        if not _holds_integers_up_to(eqn.params["new_dtype"], largest):
            return FailedMatch(f"expert indices are cast to {np.dtype(eqn.params['new_dtype']).name}, which does not "
                               f"hold every index up to {largest}", eqn, "routing-indices")
        return a
    if prim is lax.eq_p:
        return _one_hot(an, eqn, a, b)
    if isinstance(a, ExpertIndex) and b is None and prim in (lax.ge_p, lax.gt_p, lax.le_p, lax.lt_p):
        bound, _ = _broadcast_source(an.graph, eqn.inputs[1])
        if isinstance(bound, Const) and np.size(bound.value) == 1:
            return _bounds_check(an, prim, a, float(np.asarray(bound.value).reshape(())))
    return None


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


def _bounds_check(an: Analysis, prim, index: ExpertIndex, bound: float):
    """``idx >= 0``, ``idx <= E - 1``, ``idx < E``: the range checks of a clamped or filled gather."""
    lower = (prim is lax.ge_p and bound <= 0) or (prim is lax.gt_p and bound < 0)
    upper = (prim is lax.le_p and bound >= an.num_experts - 1) or (prim is lax.lt_p and bound >= an.num_experts)
    return IndexInBounds(index.roles, lower, upper) if lower or upper else None


def _one_hot(an: Analysis, eqn: Eqn, a, b):
    """``idx == iota`` is a one-hot mask over experts; ``idx == e`` selects one expert."""
    if isinstance(b, ExpertIndex) and not isinstance(a, ExpertIndex):
        a, b = b, a
        lhs, rhs = eqn.inputs[1], eqn.inputs[0]
    else:
        lhs, rhs = eqn.inputs
    if not isinstance(a, ExpertIndex):
        return None
    if isinstance(b, Iota):
        axis = b.roles.index(ITERATION_ROLE)
        if a.roles[axis] != ONE or eqn.outputs[0].shape[axis] != an.num_experts:
            return FailedMatch("one-hot compares the indices with an iota that does not count the experts", eqn)
        roles = _merge_roles(a.roles, tuple(ONE if r == ITERATION_ROLE else r for r in b.roles))
        roles = roles[:axis] + (EXPERT,) + roles[axis + 1 :]
        return Gate(roles, boolean=True)
    if b is None:
        source, _ = _broadcast_source(an.graph, rhs)
        if isinstance(source, Const) and np.ndim(source.value) == 0:
            expert = int(source.value)
            if 0 <= expert < an.num_experts:
                return Gate(a.roles, expert=expert, boolean=True)
    return None


def _gate_arith(an: Analysis, eqn: Eqn, abstracts):
    prim = eqn.primitive
    out = eqn.outputs[0]
    if prim is lax.convert_element_type_p:
        return replace(abstracts[0], boolean=False)
    if prim is lax.mul_p:
        gate_pos = 0 if isinstance(abstracts[0], Gate) else 1
        gate, other = abstracts[gate_pos], abstracts[1 - gate_pos]
        if other is not None:
            return None
        atom = eqn.inputs[1 - gate_pos]
        return _with_factor(an, gate, atom, out, eqn)
    if prim is lax.div_p and isinstance(abstracts[0], Gate) and abstracts[1] is None:
        return _with_factor(an, abstracts[0], eqn.inputs[1], out, eqn, reciprocal=True)
    if prim in (lax.gt_p, lax.ne_p) and isinstance(abstracts[0], Gate) and abstracts[1] is None:
        # ``one_hot(idx).sum(choices) > 0``: the choices are distinct, so the count is the 0/1 mask
        gate = abstracts[0]
        if not gate.factors and _is_zero(an.graph, eqn.inputs[1]):
            return replace(gate, boolean=True)
        return None
    if prim is lax.select_n_p and isinstance(abstracts[0], Gate) and abstracts[0].boolean:
        on_false, on_true = eqn.inputs[1], eqn.inputs[2]
        if abstracts[1] is None and abstracts[2] is None and _is_zero(an.graph, on_false):
            return _with_factor(an, replace(abstracts[0], boolean=False), on_true, out, eqn)
    return None


def _with_factor(an: Analysis, gate: Gate, atom, out, eqn, reciprocal: bool = False):
    if isinstance(atom, Const) and _is_scalar(atom):
        return replace(gate, factors=gate.factors + (Factor(atom, (), reciprocal),))
    source, roles = _plain_roles(an.graph, atom, gate.roles, out.shape)
    if any(r in (ONE, BROADCAST) and n != 1 for r, n in zip(roles, source.shape)):
        return None  # varies along an axis routing weights do not have (a capacity slot, say)
    if not all(is_token(r) or r in (CHOICE, EXPERT, ONE) for r in roles) or (CHOICE in roles and EXPERT in roles):
        return FailedMatch("routing mask multiplied by a tensor that is not indexed by (token, choice) or (token, expert)", eqn)
    if reciprocal and EXPERT in roles:
        return None  # a per-expert divisor of a [T, E] gate is not a per-choice weight we can read
    return replace(gate, factors=gate.factors + (Factor(source, roles, reciprocal),))


def _rows_elementwise(an: Analysis, eqn: Eqn, abstracts):
    prim = eqn.primitive
    out = eqn.outputs[0]
    rows = [a for a in abstracts if isinstance(a, Rows)]
    first = rows[0]
    if any(not _rows_like(r, first) for r in rows):
        return FailedMatch(f"`{prim}` mixes expert activations of different layouts or experts", eqn)
    gates = [a for a in abstracts if isinstance(a, Gate)]
    if gates:
        return _apply_gate(an, eqn, abstracts, first, gates)
    if first.gate is not None or any(r.gate is not None for r in rows):
        if prim is lax.convert_element_type_p:
            return replace(first, node=_elementwise_node(an, eqn, abstracts, first))
        return FailedMatch(
            f"routing weights are applied before the nonlinear step `{prim}`; only linear steps may follow them", eqn,
            "linear-after-gate")
    if first.space == "choice" and prim is lax.mul_p and len(rows) == 1:
        other = eqn.inputs[1 - abstracts.index(first)]
        source, roles = _plain_roles(an.graph, other, first.roles, out.shape)
        if all(is_token(r) or r in (CHOICE, ONE) for r in roles) and any(is_token(r) for r in roles):
            # the chosen experts' outputs times per-(token, choice) weights (k = 1: per token)
            return replace(first, gate=Gate(tuple(r for r in first.roles if r != FEATURE), (Factor(source, roles),)),
                           gate_value=GateValue(source, roles))
    node = _elementwise_node(an, eqn, abstracts, first)
    if isinstance(node, FailedMatch):
        return node
    return replace(first, node=node)


def _elementwise_node(an: Analysis, eqn: Eqn, abstracts, rows: Rows):
    operands = []
    out = eqn.outputs[0]
    for atom, abstract in zip(eqn.inputs, abstracts):
        if isinstance(abstract, Rows):
            operands.append(abstract.node)
        elif isinstance(abstract, ExpertParamSlice):
            if rows.expert != abstract.expert:
                return FailedMatch("an expert's bias is used with another expert's activations", eqn)
            operands.append(ParamRef(_slice_param(an, abstract, rows, out, eqn)))
        elif isinstance(abstract, GatheredWeight):
            bias = _gathered_bias(an, abstract, rows)
            if bias is None:
                return FailedMatch("a per-token gathered expert tensor does not line up with the expert rows", eqn)
            operands.append(ParamRef(bias))
        elif abstract is not None:
            return FailedMatch(f"`{eqn.primitive}` combines expert activations with a routing value", eqn)
        elif isinstance(atom, Const) and _is_scalar(atom):
            operands.append(Literal(atom.value))
        else:
            source, roles = _plain_roles(an.graph, atom, rows.roles, out.shape)
            slice_ = an.abstract(source)
            if isinstance(slice_, ExpertParamSlice):
                operands.append(ParamRef(_slice_param(an, slice_, rows, out, eqn, atom)))
                continue
            has_tokens = any(is_token(r) for r in roles)
            if CHOICE in roles or SLOT in roles or (has_tokens and EXPERT in roles):
                return FailedMatch(
                    "expert activations are combined with a [tokens, experts] tensor that is not recognised as "
                    "routing weights (build them from one_hot(indices), a scatter of the top-k weights, or "
                    "where(indices == e))",
                    eqn,
                )
            if EXPERT in roles:
                kind = ParamKind.PER_EXPERT
            elif has_tokens:
                kind = ParamKind.PER_TOKEN
            else:
                kind = ParamKind.CONSTANT
            operands.append(ParamRef(an.param(source, kind, roles)))
    return Elementwise(eqn.primitive, _params_tuple(eqn), tuple(operands))


def _gathered_bias(an: Analysis, gathered: GatheredWeight, rows: Rows) -> int | None:
    """``b[E, F][idx]`` added to chosen rows: the row's expert's bias (its token and choice axes must be
    the rows' own, its one other axis their features)."""
    if rows.space != "choice" or len(gathered.roles) != len(rows.roles):
        return None
    features = {}
    for g_role, r_role in zip(gathered.roles, rows.roles):
        if g_role.startswith("p") and r_role == FEATURE:
            features[int(g_role[1:])] = FEATURE
        elif g_role != r_role:
            return None
    if len(features) != 1:
        return None
    return _gathered_param(an, gathered, ParamKind.PER_EXPERT, features)


def _slice_param(an: Analysis, slice_: ExpertParamSlice, rows: Rows, out, eqn, atom=None) -> int:
    """A per-expert bias ``b[e]`` (loop style) as the full ``b`` indexed by the row's expert."""
    source = slice_.source
    roles = [ONE] * len(source.shape)
    roles[slice_.expert_axis] = EXPERT
    if atom is not None:
        _, mapping = _broadcast_source(an.graph, atom)
        for dim, out_dim in zip(slice_.roles, mapping):
            if source.shape[dim] != 1:
                roles[dim] = rows.roles[out_dim]
    else:
        for dim, role in zip(slice_.roles, rows.roles):
            if source.shape[dim] != 1:
                roles[dim] = role
    return an.param(source, ParamKind.PER_EXPERT, tuple(roles))


def _apply_gate(an: Analysis, eqn: Eqn, abstracts, rows: Rows, gates):
    if eqn.primitive is not lax.mul_p or len(gates) != 1 or len(abstracts) != 2:
        return FailedMatch(f"routing weights enter the experts through `{eqn.primitive}`, not a product", eqn)
    gate = gates[0]
    if rows.gate is not None:
        return FailedMatch("routing weights are applied twice", eqn)
    if CHOICE in gate.roles:
        return FailedMatch("routing weights still have a top-k axis: sum the one-hot over k first", eqn)
    if gate.boolean:
        return FailedMatch("a boolean routing mask multiplies expert activations", eqn)
    value = GateValue(eqn.inputs[abstracts.index(gate)], gate.roles, gate.expert)
    if rows.space == "dense" and gate.expert is None and _compatible(gate.roles, rows.roles):
        return replace(rows, gate=gate, gate_value=value)
    if rows.space == "single" and gate.expert == rows.expert and _compatible(gate.roles, rows.roles):
        return replace(rows, gate=gate, gate_value=value)
    return FailedMatch("routing weights do not line up with the expert activations' token and expert axes", eqn)


def _combined_arith(an: Analysis, eqn: Eqn, abstracts):
    """Per-expert contributions summed one by one (the loop style)."""
    if eqn.primitive is not lax.add_p:
        return None
    a, b = abstracts
    if a is None and _is_zero(an.graph, eqn.inputs[0]):
        return b
    if b is None and _is_zero(an.graph, eqn.inputs[1]):
        return a
    if not (isinstance(a, Combined) and isinstance(b, Combined)) or a.experts is None or b.experts is None:
        return None
    if a.roles != b.roles or a.tokens is not b.tokens or a.experts & b.experts:
        return FailedMatch("per-expert outputs of different layouts (or the same expert twice) are added", eqn)
    if a.node != b.node:
        return FailedMatch("experts in the loop do not all compute the same program", eqn, "expert-program")
    return replace(a, experts=a.experts | b.experts, gate_values=a.gate_values + b.gate_values)


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


@rule(lax.reduce_and_p)
def _reduce_and(an: Analysis, eqn: Eqn, abstracts):
    value = abstracts[0]
    axes = tuple(eqn.params["axes"])
    if isinstance(value, IndexInBounds) and all(value.roles[a] == ONE for a in axes):
        return replace(value, roles=tuple(r for i, r in enumerate(value.roles) if i not in axes))
    return None


@rule(lax.iota_p)
def _iota(an: Analysis, eqn: Eqn, abstracts):
    shape = eqn.params["shape"]
    dim = eqn.params["dimension"]
    return Iota(tuple(ITERATION_ROLE if d == dim else (ONE if s == 1 else BROADCAST) for d, s in enumerate(shape)))


@rule(lax.broadcast_in_dim_p)
def _broadcast(an: Analysis, eqn: Eqn, abstracts):
    value = abstracts[0]
    if not hasattr(value, "roles"):  # nothing known, or a half-built index normalisation
        return None
    out_shape = eqn.outputs[0].shape
    in_shape = eqn.inputs[0].shape
    dims = tuple(eqn.params["broadcast_dimensions"])
    roles = [ONE if s == 1 else BROADCAST for s in out_shape]
    for src, dst in enumerate(dims):
        roles[dst] = value.roles[src] if in_shape[src] == out_shape[dst] else BROADCAST
    roles = tuple(roles)
    if isinstance(value, (Rows, Combined)):
        if BROADCAST in roles:
            return FailedMatch("expert activations are broadcast to a larger shape", eqn)
        return replace(value, roles=roles)
    if isinstance(value, (ExpertIndex, Iota, Gate, IndexInBounds)):
        return replace(value, roles=roles)
    return None


def _unit_reshape(in_shape, out_shape) -> list | None:
    """For a reshape that only adds or drops size-1 dims: each output dim's input dim (or None)."""
    src = [i for i, s in enumerate(in_shape) if s != 1]
    dst = [i for i, s in enumerate(out_shape) if s != 1]
    if [in_shape[i] for i in src] != [out_shape[i] for i in dst]:
        return None
    mapping: list = [None] * len(out_shape)
    for i, j in zip(src, dst):
        mapping[j] = i
    return mapping


@rule(lax.reshape_p)
def _reshape(an: Analysis, eqn: Eqn, abstracts):
    value = abstracts[0]
    if value is None or not hasattr(value, "roles"):
        return None
    mapping = _unit_reshape(eqn.inputs[0].shape, eqn.outputs[0].shape)
    if mapping is None:
        if isinstance(value, Rows) and value.space == "slot" and value.gate is None:
            roles = _slot_reshape_roles(value.roles, eqn.inputs[0].shape, eqn.outputs[0].shape)
            if roles is not None:
                return replace(value, roles=roles)
        if isinstance(value, (Rows, Combined)):
            return FailedMatch("a reshape merges or splits the axes of expert activations", eqn)
        return None
    roles = tuple(ONE if m is None else value.roles[m] for m in mapping)
    return replace(value, roles=roles)


def _merged_role(parts) -> str:
    """One axis of slot rows holding several (a token group's slots: ``[E, G, C, d] -> [E, G*C, d]``),
    named with each part's role and size, row-major, so that a later split can restore them."""
    return "(" + ",".join(f"{role}={size}" for role, size in parts) + ")"


def _merged_parts(role: str) -> list | None:
    if not role.startswith("("):
        return None
    return [(name, int(size)) for name, size in (part.rsplit("=", 1) for part in role[1:-1].split(","))]


def _split_part(role: str, index: int, factors: tuple) -> str:
    """Part ``index`` of a token group axis split row-major into ``factors`` (flaxformer's
    ``[G, ...] -> [E, G / E, ...]``); the parts, adjacent and in order, merge back into ``role``."""
    return f"{role}#{index}/{'x'.join(map(str, factors))}"


def _unsplit(atoms) -> str | None:
    """``role`` if ``atoms`` are all parts of one split of ``role``, in order; else None."""
    bases = {name.split("#")[0] for name, _ in atoms}
    if len(bases) != 1 or not all("#" in name for name, _ in atoms):
        return None
    base = bases.pop()
    factors = atoms[0][0].split("/")[1]
    expected = [_split_part(base, i, tuple(int(f) for f in factors.split("x"))) for i in range(len(atoms))]
    return base if [name for name, _ in atoms] == expected and len(factors.split("x")) == len(atoms) else None


def _slot_reshape_roles(roles: Roles, in_shape, out_shape) -> Roles | None:
    """Roles after a reshape of slot rows that only regroups expert, token-group and slot axes: a group
    axis split into factors, adjacent axes merged into one (``[G, E, C, d] -> [E, G*C, d]``, what an
    all-to-all moves; vmoe flattens ``[E, G, C, d]`` to ``[E*G*C, d]`` on the way), a merged axis split
    back into exactly its parts, parts merged back into their axis. Every element keeps its (expert, group, slot, feature) name, so the layout
    stays known; ``None`` for any other reshape (one that mixes experts or features into other axes
    changes what the rows mean)."""
    atoms = []  # the input as a row-major list of (role, size), merged axes opened, unit axes dropped
    for role, size in zip(roles, in_shape):
        parts = _merged_parts(role)
        atoms.extend(parts if parts else [(role, size)] if size != 1 else [])
    out: list = []
    position = 0
    for size in out_shape:
        if size == 1:
            out.append(ONE)
            continue
        taken, product = [], 1
        while product < size and position < len(atoms):
            role, atom_size = atoms[position]
            if product * atom_size <= size:
                taken.append((role, atom_size))
                product *= atom_size
                position += 1
                continue
            rest = size // product
            if size % product or atom_size % rest or "#" in role or not is_token(role):
                return None  # a split that is not of a whole token group axis
            factors = (rest, atom_size // rest)
            taken.append((_split_part(role, 0, factors), rest))
            atoms[position] = (_split_part(role, 1, factors), atom_size // rest)
            product *= rest
        if product != size or not taken:
            return None
        if len(taken) == 1:
            out.append(taken[0][0])
            continue
        whole = _unsplit(taken)
        if whole is not None:
            out.append(whole)
        elif all(is_token(r) or r in (SLOT, EXPERT) for r, _ in taken):
            out.append(_merged_role(taken))  # experts merged in must be split out before any product
        else:
            return None
    if position != len(atoms):
        return None
    return tuple(out)


@rule(lax.transpose_p)
def _transpose(an: Analysis, eqn: Eqn, abstracts):
    value = abstracts[0]
    if value is None or not hasattr(value, "roles"):
        return None
    return replace(value, roles=tuple(value.roles[p] for p in eqn.params["permutation"]))


@rule(lax.reduce_sum_p)
def _reduce_sum(an: Analysis, eqn: Eqn, abstracts):
    value = abstracts[0]
    axes = tuple(eqn.params["axes"])
    if value is None:
        return None
    if not hasattr(value, "roles"):
        return None
    summed = {value.roles[a] for a in axes} - {ONE}
    kept = tuple(r for i, r in enumerate(value.roles) if i not in axes)
    if isinstance(value, Gate):
        if summed == {CHOICE} and not value.boolean:
            return replace(value, roles=kept)
        if summed == {CHOICE}:
            return FailedMatch("a boolean one-hot mask is summed over k", eqn)
        return None
    if isinstance(value, Rows):
        target = CHOICE if value.space == "choice" else EXPERT
        if summed != {target}:
            return FailedMatch(f"expert activations are reduced over {sorted(summed)}, not over the experts", eqn)
        if value.gate is None:
            return FailedMatch(
                "expert outputs are summed over experts without routing weights (an ensemble, not a routed MoE)", eqn
            )
        return Combined(kept, value.node, value.tokens, value.gate, style=_style(value), gate_values=(value.gate_value,))
    return None


def _style(rows: Rows) -> str:
    return rows.style or {"dense": "one-hot gate", "choice": "gather combine", "single": "per-expert loop", "slot": "capacity"}[
        rows.space
    ]


@rule(lax.slice_p, lax.dynamic_slice_p)
def _slice(an: Analysis, eqn: Eqn, abstracts):
    value = abstracts[0]
    atom = eqn.inputs[0]
    in_shape = atom.shape
    out_shape = eqn.outputs[0].shape
    if eqn.primitive is lax.slice_p:
        starts = tuple(eqn.params["start_indices"])
        strides = eqn.params.get("strides") or (1,) * len(in_shape)
    else:
        starts = []
        for dim, idx in enumerate(eqn.inputs[1:]):
            if not isinstance(idx, Const):
                return None
            # XLA clamps a start so that the slice stays inside the operand
            starts.append(min(max(int(idx.value), 0), in_shape[dim] - out_shape[dim]))
        strides = (1,) * len(in_shape)
    changed = [d for d in range(len(in_shape)) if out_shape[d] != in_shape[d]]
    if value is None:
        if len(changed) == 1 and in_shape[changed[0]] == an.num_experts and out_shape[changed[0]] == 1:
            axis = changed[0]
            return ExpertParamSlice(atom, axis, starts[axis], tuple(range(len(in_shape))))
        return None
    if isinstance(value, Gate) and len(changed) == 1 and value.roles[changed[0]] == EXPERT and out_shape[changed[0]] == 1:
        axis = changed[0]
        return replace(value, roles=value.roles[:axis] + (ONE,) + value.roles[axis + 1 :], expert=starts[axis])
    if isinstance(value, Rows) and len(changed) == 1 and value.roles[changed[0]] == FEATURE:
        axis = changed[0]
        stop = starts[axis] + (out_shape[axis] - 1) * strides[axis] + 1
        return replace(value, node=FeatureSlice(value.node, starts[axis], stop, strides[axis]))
    if isinstance(value, (Rows, Combined)):
        return FailedMatch("expert activations are sliced along a token or expert axis", eqn)
    return None


def _maybe_param_slice(an: Analysis, eqn: Eqn) -> bool:
    """Plain slices of a weight with an expert axis are worth a look (the loop style's ``w[e]``)."""
    if eqn.primitive not in (lax.slice_p, lax.dynamic_slice_p):
        return False
    shape = eqn.inputs[0].shape
    return len(shape) >= 2 and an.num_experts in shape


@rule(lax.squeeze_p)
def _squeeze(an: Analysis, eqn: Eqn, abstracts):
    value = abstracts[0]
    if value is None:
        return None
    if not hasattr(value, "roles"):
        return None
    dims = set(d % len(eqn.inputs[0].shape) for d in eqn.params["dimensions"])
    return replace(value, roles=tuple(r for i, r in enumerate(value.roles) if i not in dims))


@rule(lax.split_p)
def _split(an: Analysis, eqn: Eqn, abstracts):
    """``jnp.split`` of a fused gate/up projection along the features."""
    value = abstracts[0]
    if not isinstance(value, Rows):
        return None
    axis = eqn.params["axis"]
    if value.roles[axis] != FEATURE or value.gate is not None:
        return FailedMatch("expert activations are split along a token or expert axis", eqn)
    pieces, start = [], 0
    for size in eqn.params["sizes"]:
        pieces.append(replace(value, node=FeatureSlice(value.node, start, start + size)))
        start += size
    return tuple(pieces)


@rule(lax.concatenate_p)
def _concatenate(an: Analysis, eqn: Eqn, abstracts):
    dim = eqn.params["dimension"]
    if all(isinstance(a, Rows) for a in abstracts):
        first = abstracts[0]
        if all(_rows_like(a, first) for a in abstracts) and first.roles[dim] == FEATURE and first.gate is None:
            return replace(first, node=FeatureConcat(tuple(a.node for a in abstracts)))
        return FailedMatch("expert activations are concatenated along a token or expert axis", eqn)
    if not all(isinstance(a, (ExpertIndex, Iota)) for a in abstracts):
        return None
    if any(eqn.inputs[i].shape[dim] != 1 for i in range(len(abstracts))):
        return None
    index_roles = next((a.roles for a in abstracts if isinstance(a, ExpertIndex)), None)
    if index_roles is None:
        return None
    components = []
    for a in abstracts:
        if isinstance(a, ExpertIndex):
            components.append(EXPERT)
        else:
            axis = a.roles.index(ITERATION_ROLE)
            role = index_roles[axis]
            if not is_token(role):
                return None
            components.append(role)
    roles = index_roles[:dim] + index_roles[dim + 1 :]
    return PackedIndices(roles, tuple(components))


@rule(lax.scatter_p, lax.scatter_add_p)
def _scatter(an: Analysis, eqn: Eqn, abstracts):
    """``zeros[T, E].at[arange(T)[:, None], idx].set(w)``: routing weights by scatter."""
    operand, indices, updates = eqn.inputs[:3]
    packed = abstracts[1]
    if not isinstance(packed, PackedIndices):
        return None
    if abstracts[0] is not None or abstracts[2] is not None or not _is_zero(an.graph, operand):
        return FailedMatch("a scatter of routing indices into something other than zeros", eqn)
    dnums = eqn.params["dimension_numbers"]
    if tuple(dnums.update_window_dims) or len(packed.components) != len(operand.shape):
        return FailedMatch("a scatter of routing indices with window dimensions", eqn)
    roles = [ONE] * len(operand.shape)
    for component, operand_dim in zip(packed.components, dnums.scatter_dims_to_operand_dims):
        roles[operand_dim] = component
    tokens = token_roles(len(an.token_shape))
    if sorted(r for r in roles if is_token(r)) != sorted(tokens) or roles.count(EXPERT) != 1:
        return FailedMatch("a scatter of routing indices that does not address every (token, expert)", eqn)
    source, factor_roles = _plain_roles(an.graph, updates, packed.roles, updates.shape)
    return Gate(tuple(roles), (Factor(source, factor_roles),))


@rule(lax.gather_p)
def _gather(an: Analysis, eqn: Eqn, abstracts):
    """``take_along_axis(expert_out[T, E, D], idx[..., None], axis=1)``: pick the chosen experts."""
    rows, index = abstracts[0], abstracts[1]
    if rows is None and isinstance(index, ExpertIndex):
        return _gathered_weight(an, eqn, index)
    if not isinstance(rows, Rows):
        return None
    if rows.space != "dense" or rows.gate is not None or not isinstance(index, ExpertIndex):
        return FailedMatch("a gather of expert activations by something other than the routing indices", eqn)
    dnums = eqn.params["dimension_numbers"]
    expert_dim = rows.roles.index(EXPERT)
    if tuple(dnums.start_index_map) != (expert_dim,) or tuple(dnums.collapsed_slice_dims) != (expert_dim,):
        return FailedMatch("a gather of expert activations along an axis other than the experts", eqn)
    operand_batch = tuple(getattr(dnums, "operand_batching_dims", ()))
    index_batch = tuple(getattr(dnums, "start_indices_batching_dims", ()))
    if any(rows.roles[o] != index.roles[i] for o, i in zip(operand_batch, index_batch)):
        return FailedMatch("a gather of expert activations whose batch axes are not the tokens", eqn)
    slice_sizes = eqn.params["slice_sizes"]
    operand_shape = eqn.inputs[0].shape
    offset_src = [d for d in range(len(operand_shape)) if d != expert_dim and d not in operand_batch]
    if any(slice_sizes[d] != operand_shape[d] for d in offset_src):
        return FailedMatch("a gather of partial expert activations", eqn)
    batch_roles = list(index.roles[:-1])
    out_rank = len(eqn.outputs[0].shape)
    offset_dims = tuple(dnums.offset_dims)
    roles, b, o = [], iter(batch_roles), iter(offset_src)
    for d in range(out_rank):
        roles.append(rows.roles[next(o)] if d in offset_dims else next(b))
    return Rows(tuple(roles), rows.node, "choice", rows.tokens)


def _gathered_weight(an: Analysis, eqn: Eqn, index: ExpertIndex):
    """``jnp.take(W, idx, axis=a)`` of a plain weight along an axis of E: whole slices, no batching."""
    dnums = eqn.params["dimension_numbers"]
    operand = eqn.inputs[0]
    if tuple(getattr(dnums, "operand_batching_dims", ())) or len(dnums.start_index_map) != 1:
        return None
    axis = dnums.start_index_map[0]
    if tuple(dnums.collapsed_slice_dims) != (axis,) or operand.shape[axis] != an.num_experts:
        return None
    slice_sizes = eqn.params["slice_sizes"]
    if any(slice_sizes[d] != operand.shape[d] for d in range(len(operand.shape)) if d != axis):
        return None
    if not index.roles or index.roles[-1] != ONE:  # the index vector dim, of size 1
        return None
    batch_roles = iter(index.roles[:-1])
    kept = iter(d for d in range(len(operand.shape)) if d != axis)
    offset_dims = tuple(dnums.offset_dims)
    roles = tuple(f"p{next(kept)}" if d in offset_dims else next(batch_roles) for d in range(len(eqn.outputs[0].shape)))
    return GatheredWeight(operand, axis, roles)


def _gathered_param(an: Analysis, gathered: GatheredWeight, kind: ParamKind, role_of_param_dim: dict) -> int:
    """The gathered weight's source as a program input: its E axis, and ``role_of_param_dim``."""
    roles = [ONE] * len(gathered.source.shape)
    roles[gathered.expert_axis] = EXPERT if kind is ParamKind.PER_EXPERT else "E"
    for dim, role in role_of_param_dim.items():
        roles[dim] = role
    return an.param(gathered.source, kind, tuple(roles))


def _gathered_matmul(an: Analysis, eqn, x_roles, gathered: GatheredWeight, xc, wc, xb, wb, pet, swap):
    """``rows [t.., (k,) K] . W[idx] [t.., k, K, N]`` batched over (token, choice): each routed row times
    its own expert's weight, i.e. an expert projection in the choice space. ``None`` if it is not that."""
    if len(xc) != 1 or len(wc) != 1 or x_roles[xc[0]] != FEATURE:
        return None
    k_role = gathered.roles[wc[0]]
    if not k_role.startswith("p"):
        return None
    if sorted(x_roles[i] for i in xb) != sorted(gathered.roles[i] for i in wb):
        return None
    if any(x_roles[i] != gathered.roles[j] for i, j in zip(xb, wb)):
        return None
    w_free = [d for d in range(len(gathered.roles)) if d not in wc and d not in wb]
    x_free = [d for d in range(len(x_roles)) if d not in xc and d not in xb]
    tokens = token_roles(len(an.token_shape))
    batch_roles = {x_roles[i] for i in xb}
    routed = set(tokens) | {CHOICE}
    free_roles = [gathered.roles[d] for d in w_free]
    # every token axis and the choice axis batched, or the choice free on the weight (x without k)
    if not set(tokens) <= batch_roles or (CHOICE not in batch_roles and free_roles.count(CHOICE) != 1):
        return None
    n_dims = [d for d in w_free if gathered.roles[d].startswith("p")]
    if len(n_dims) != 1 or x_free or len(w_free) != len(n_dims) + (CHOICE not in batch_roles):
        return None
    k_dim, n_dim = int(k_role[1:]), int(gathered.roles[n_dims[0]][1:])
    index = _gathered_param(an, gathered, ParamKind.EXPERT_WEIGHT, {k_dim: "K", n_dim: "N"})
    out_w_roles = tuple(FEATURE if r.startswith("p") else r for r in gathered.roles)
    roles = _dot_out_roles(x_roles, out_w_roles, xc, wc, xb, wb, swap)
    if sorted(r for r in roles if r != FEATURE) != sorted(routed) or roles.count(FEATURE) != 1:
        return None
    return roles, index


@rule(_compat.custom_jvp_call_p)
def _custom_jvp(an: Analysis, eqn: Eqn, abstracts):
    """An elementwise ``custom_jvp`` function (``relu``, a straight-through estimator) on expert
    activations: replayed on the sorted rows with its own derivative rule (``CustomJvpCall``)."""
    rows = [a for a in abstracts if isinstance(a, Rows)]
    if not rows:
        return None
    name = _compat.custom_jvp_name(eqn.params)
    first = rows[0]
    if any(not _rows_like(r, first) for r in rows) or first.gate is not None:
        return FailedMatch(f"custom_jvp function `{name}` mixes expert activations or follows the routing weights", eqn, "expert-program")
    if len(eqn.outputs) != 1 or eqn.params.get("num_consts", 0):
        return FailedMatch(f"custom_jvp function `{name}` has several outputs or closed-over values", eqn, "expert-program")
    operands = []
    for atom, abstract in zip(eqn.inputs, abstracts):
        if isinstance(abstract, Rows):
            operands.append(abstract.node)
        elif isinstance(atom, Const) and _is_scalar(atom):
            operands.append(Literal(atom.value))
        else:
            return FailedMatch(f"custom_jvp function `{name}` takes an operand that is not a row or a scalar", eqn, "expert-program")
    body = eqn.params["call_jaxpr"]
    if not _elementwise_jaxpr(_compat.open_jaxpr(body), _compat.sub_jaxpr_consts(body)):
        return FailedMatch(f"custom_jvp function `{name}` is not elementwise", eqn, "expert-program")
    try:
        node = custom_jvp_node(eqn.params, name, tuple(operands))
    except Exception as error:  # the rule cannot be traced on its own: nothing to replay
        return FailedMatch(f"custom_jvp function `{name}`: its derivative rule cannot be read ({error})", eqn,
                           "expert-program")
    if not _elementwise_jaxpr(*node.rule):
        aligned = _without_layout_moves(*node.rule)
        if aligned is None or not _elementwise_jaxpr(*aligned):
            return FailedMatch(f"custom_jvp function `{name}` has a derivative rule that is not elementwise", eqn,
                               "expert-program")
        node = replace(node, rule=aligned)
    return replace(first, node=node)


def _without_layout_moves(jaxpr, consts):
    """A ``custom_jvp`` rule traced under ``vmap`` (flax's ``nn.vmap`` experts) moves the batch axis
    around: transposes out and back, broadcasts of a constant with the axis inserted. When every
    non-constant value keeps one consistent axis order and the outputs return to the inputs' order,
    the rule is elementwise: this is it with the moves dropped, as ``(jaxpr, consts)``; else None."""
    if any(np.size(c) != 1 for c in consts):
        return None
    order: dict = {v: tuple(range(len(v.aval.shape))) for v in jaxpr.invars}  # axis order vs the inputs'
    uniform = set(jaxpr.constvars)  # values equal everywhere (broadcasts of a scalar)

    def layout(atom):
        if _compat.is_literal(atom) or atom in uniform:
            return "uniform"
        return order.get(atom)

    for eqn in jaxpr.eqns:
        layouts = [layout(a) for a in eqn.invars]
        if any(layout_ is None for layout_ in layouts):
            return None
        moving = {layout_ for layout_ in layouts if layout_ != "uniform"}
        if eqn.primitive is lax.transpose_p and moving:
            (before,) = moving
            order[eqn.outvars[0]] = tuple(before[p] for p in eqn.params["permutation"])
        elif eqn.primitive is lax.broadcast_in_dim_p and not moving:
            uniform.add(eqn.outvars[0])
        elif eqn.primitive in _ELEMENTWISE or eqn.primitive in (_compat.custom_jvp_call_p, _compat.jit_p):
            if len(moving) > 1:
                return None
            for out in eqn.outvars:
                if moving:
                    order[out] = next(iter(moving))
                else:
                    uniform.add(out)
        else:
            return None
    if any(layout(v) not in ("uniform", tuple(range(len(v.aval.shape)))) for v in jaxpr.outvars):
        return None
    shape = tuple(jaxpr.invars[0].aval.shape)

    def aligned(*args):
        env = dict(zip(jaxpr.constvars, [np.asarray(c).reshape(()) for c in consts]))
        env.update(zip(jaxpr.invars, args))

        def read(atom):
            return _compat.literal_value(atom) if _compat.is_literal(atom) else env[atom]

        def full(value):  # a uniform value is kept as a scalar until it meets a full-shaped one
            return lax.broadcast_in_dim(value, shape, ()) if np.ndim(value) == 0 else value

        for eqn in jaxpr.eqns:
            inputs = [read(a) for a in eqn.invars]
            if eqn.primitive in (lax.transpose_p, lax.broadcast_in_dim_p):
                outputs = inputs
            else:
                if any(np.ndim(x) for x in inputs):
                    inputs = [full(x) for x in inputs]
                if eqn.primitive in (_compat.jit_p, _compat.custom_jvp_call_p):
                    # a rule's nested custom_jvp call computes its primal: its body, inlined (its own
                    # rule came out of vmap batched too, and a rule is not differentiated again here)
                    inner = eqn.params["jaxpr" if eqn.primitive is _compat.jit_p else "call_jaxpr"]
                    outputs = replay_elementwise(_compat.open_jaxpr(inner), _compat.sub_jaxpr_consts(inner), inputs,
                                                 shape)
                else:
                    result = eqn.primitive.bind(*inputs, **eqn.params)
                    outputs = result if eqn.primitive.multiple_results else [result]
            env.update(zip(eqn.outvars, outputs))
        return [full(read(v)) for v in jaxpr.outvars]

    closed = jax.make_jaxpr(aligned)(*[jax.ShapeDtypeStruct(shape, v.aval.dtype) for v in jaxpr.invars])
    return closed.jaxpr, closed.consts


def _elementwise_jaxpr(jaxpr, consts) -> bool:
    """Every eqn elementwise (or a broadcast, or a nested elementwise ``custom_jvp``), constants scalar."""
    _register_rules()
    if any(np.size(c) != 1 for c in consts):
        return False
    for eqn in jaxpr.eqns:
        if eqn.primitive in (_compat.custom_jvp_call_p, _compat.jit_p):
            inner = eqn.params["call_jaxpr" if eqn.primitive is _compat.custom_jvp_call_p else "jaxpr"]
            if not _elementwise_jaxpr(_compat.open_jaxpr(inner), _compat.sub_jaxpr_consts(inner)):
                return False
        elif eqn.primitive is lax.broadcast_in_dim_p:
            if int(np.prod(eqn.invars[0].aval.shape)) != 1:
                return False
        elif eqn.primitive not in _ELEMENTWISE:
            return False
    return True


@rule(lax.dot_general_p)
def _dot_general(an: Analysis, eqn: Eqn, abstracts):
    lhs, rhs = eqn.inputs
    a_lhs, a_rhs = abstracts
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    pet = eqn.params.get("preferred_element_type")
    for swap in (False, True):
        x, w, ax, aw = (rhs, lhs, a_rhs, a_lhs) if swap else (lhs, rhs, a_lhs, a_rhs)
        xc, wc, xb, wb = (rc, lc, rb, lb) if swap else (lc, rc, lb, rb)
        result = _dot_case(an, eqn, x, w, ax, aw, tuple(xc), tuple(wc), tuple(xb), tuple(wb), pet, swap)
        if result is not None:
            return result
    if any(isinstance(a, (Rows, Combined)) for a in abstracts):
        return FailedMatch("a matmul of expert activations that is neither an expert projection nor the combine", eqn)
    return None


def _dot_out_roles(x_roles, w_roles, xc, wc, xb, wb, swap) -> Roles:
    """dot_general output order: batch dims, then lhs free dims, then rhs free dims."""
    x_free = [r for i, r in enumerate(x_roles) if i not in xc and i not in xb]
    w_free = [r for i, r in enumerate(w_roles) if i not in wc and i not in wb]
    batch = [x_roles[i] for i in xb]
    return tuple(batch + (w_free + x_free if swap else x_free + w_free))


def _dot_case(an: Analysis, eqn, x, w, ax, aw, xc, wc, xb, wb, pet, swap):
    """One operand order of a dot_general: the tokens/rows/gate side ``x`` against ``w``."""
    out_roles = _dot_out_roles
    E = an.num_experts
    token_shape = an.token_shape
    n_tok = len(token_shape)
    tokens = token_roles(n_tok)

    # tokens [t.., D] @ W [E, D, F] -> dense rows [t.., E, F]
    if ax is None and aw is None and not xb and len(w.shape) == 3 and x.shape[:-1] == token_shape:
        if xc != (len(x.shape) - 1,) or len(wc) != 1:
            return None
        free = [d for d in range(3) if d != wc[0]]
        expert_dims = [d for d in free if w.shape[d] == E]
        if not expert_dims:
            return None
        if len(expert_dims) > 1:  # both free axes count E: try one; the data flow rejects the wrong one
            an.ambiguous_expert_axis = True
        e_dim = expert_dims[an.expert_axis_choice]
        w_roles = tuple(EXPERT if d == e_dim else ("K" if d == wc[0] else "N") for d in range(3))
        index = an.param(w, ParamKind.EXPERT_WEIGHT, w_roles)
        node = ExpertMatmul(RowInput(), index, pet)
        roles = out_roles(tokens + (FEATURE,), tuple(EXPERT if d == e_dim else FEATURE for d in range(3)), xc, wc, xb, wb, swap)
        return Rows(roles, node, "dense", _token_source(an.graph, x))

    # tokens [t.., D] . W[idx] [t.., k, D, F] over D, batched over tokens -> chosen rows [t.., k, F]
    if ax is None and isinstance(aw, GatheredWeight) and x.shape[:-1] == token_shape:
        found = _gathered_matmul(an, eqn, tokens + (FEATURE,), aw, xc, wc, xb, wb, pet, swap)
        if found is None:
            return FailedMatch("the tokens meet per-token gathered expert weights in a way that is not a projection", eqn)
        roles, index = found
        return Rows(roles, ExpertMatmul(RowInput(), index, pet), "choice", _token_source(an.graph, x),
                    style="gathered weights")

    # chosen rows [t.., k, F] . W[idx] [t.., k, F, N] batched over (token, choice) -> chosen rows
    if isinstance(ax, Rows) and isinstance(aw, GatheredWeight) and ax.space == "choice":
        found = None if ax.gate is not None else _gathered_matmul(an, eqn, ax.roles, aw, xc, wc, xb, wb, pet, swap)
        if found is None:
            return FailedMatch("chosen expert rows meet per-token gathered expert weights in a way that is not a "
                               "projection of each row by its own expert", eqn)
        roles, index = found
        return replace(ax, roles=roles, node=ExpertMatmul(ax.node, index, pet))

    # tokens [t.., D] @ W[e] [D, F] -> one expert's rows [t.., F]
    if ax is None and isinstance(aw, ExpertParamSlice) and not xb and x.shape[:-1] == token_shape and len(w.shape) == 2:
        if xc != (len(x.shape) - 1,):
            return None
        index = _slice_weight(an, aw, wc[0])
        roles = out_roles(tokens + (FEATURE,), (FEATURE, FEATURE), xc, wc, xb, wb, swap)
        return Rows(roles, ExpertMatmul(RowInput(), index, pet), "single", _token_source(an.graph, x), expert=aw.expert)

    # dispatch [t.., E, C] contracted with tokens [t.., D] over the token axes -> slot rows [E, C, D];
    # token axes batched instead are groups with slots of their own ('BSM,BSEC->EBCM': [E, B, C, D])
    if ax is None and aw is None and len(w.shape) == n_tok + 1 and w.shape[:-1] == token_shape:
        if len(x.shape) == n_tok + 2 and n_tok not in wc + wb and an.depends_on_anchor(x):
            x_roles = _dispatch_roles(x, xc, wc, xb, wb, tokens, E)
            if x_roles is None:
                return FailedMatch(
                    f"a {list(x.shape)} tensor built from the routing meets the tokens {list(w.shape)} in a dot, but "
                    "not as a dispatch [tokens.., E, C]: each token axis must be summed over (or batched, as a group "
                    f"with its own slots) and the two axes left must be the E={E} experts and the slots", eqn)
            roles = out_roles(x_roles, tokens + (FEATURE,), xc, wc, xb, wb, swap)
            return Rows(roles, RowInput(), "slot", w, dispatch=(x, x_roles))

    # rows [.., E, .., F] @ W [E, F, N] batched over E -> rows
    if isinstance(ax, Rows) and aw is None and len(w.shape) == 3 and ax.space in ("dense", "slot"):
        e_x = ax.roles.index(EXPERT)
        f_dims = tuple(i for i in xc if ax.roles[i] == FEATURE)
        if len(wc) != len(xc):
            return None
        if xb == (e_x,) and len(xc) == 1 and f_dims == xc:
            e_w = wb[0]
            k_w = wc[0]
            n_w = next(d for d in range(3) if d not in (e_w, k_w))
            w_roles = tuple(EXPERT if d == e_w else ("K" if d == k_w else "N") for d in range(3))
            node = ExpertMatmul(ax.node, an.param(w, ParamKind.EXPERT_WEIGHT, w_roles), pet)
            roles = out_roles(ax.roles, tuple(EXPERT if d == e_w else FEATURE for d in range(3)), xc, wc, xb, wb, swap)
            return replace(ax, roles=roles, node=node)
        if not xb and set(xc) == {e_x} | set(f_dims) and len(xc) == 2 and ax.space == "dense":
            if ax.gate is None:
                return FailedMatch("expert outputs are summed over experts without routing weights", eqn)
            e_w = wc[xc.index(e_x)]
            k_w = wc[xc.index(f_dims[0])]
            n_w = next(d for d in range(3) if d not in (e_w, k_w))
            w_roles = tuple(EXPERT if d == e_w else ("K" if d == k_w else "N") for d in range(3))
            node = ExpertMatmul(ax.node, an.param(w, ParamKind.EXPERT_WEIGHT, w_roles), pet)
            roles = out_roles(ax.roles, tuple(FEATURE if d == n_w else EXPERT for d in range(3)), xc, wc, xb, wb, swap)
            return Combined(roles, node, ax.tokens, ax.gate, style="one-hot gate", gate_values=(ax.gate_value,))
        return None

    # one expert's rows [t.., F] @ W[e] [F, N]
    if isinstance(ax, Rows) and isinstance(aw, ExpertParamSlice) and ax.space == "single" and len(w.shape) == 2:
        if aw.expert != ax.expert or xb or len(xc) != 1 or ax.roles[xc[0]] != FEATURE:
            return FailedMatch("an expert's activations are multiplied by another expert's weight", eqn)
        node = ExpertMatmul(ax.node, _slice_weight(an, aw, wc[0]), pet)
        roles = out_roles(ax.roles, (FEATURE, FEATURE), xc, wc, xb, wb, swap)
        rows = replace(ax, roles=roles, node=node)
        if rows.gate is not None:
            return _as_contribution(rows)
        return rows

    # gate [t.., E] . rows [t.., E, F] over E -> combined
    if isinstance(ax, Gate) and isinstance(aw, Rows) and aw.space == "dense":
        if ax.boolean or CHOICE in ax.roles or aw.gate is not None:
            return None
        if not xc and [ax.roles[i] for i in xb] == [aw.roles[i] for i in wb] and EXPERT in [ax.roles[i] for i in xb]:
            # an einsum's elementwise step ('te,tef->tef'): gating before the down-projection
            roles = out_roles(ax.roles, aw.roles, xc, wc, xb, wb, swap)
            return replace(aw, roles=roles, gate=replace(ax, roles=tuple(r for r in ax.roles if r != EXPERT)),
                           gate_value=GateValue(x, ax.roles))
        if len(xc) == 1 and ax.roles[xc[0]] == EXPERT and aw.roles[wc[0]] == EXPERT:
            if [ax.roles[i] for i in xb] == [aw.roles[i] for i in wb] and all(is_token(ax.roles[i]) for i in xb):
                roles = out_roles(ax.roles, aw.roles, xc, wc, xb, wb, swap)
                gate = replace(ax, roles=tuple(r for r in ax.roles if r != EXPERT))
                return Combined(roles, aw.node, aw.tokens, gate, style="one-hot gate", gate_values=(GateValue(x, ax.roles),))
        return None

    # one-hot [t.., k, E] . weights [t.., k] over k -> gate [t.., E]
    if isinstance(ax, Gate) and aw is None and CHOICE in ax.roles and len(xc) == 1 and ax.roles[xc[0]] == CHOICE:
        w_source, w_roles = _plain_roles(an.graph, w, _dot_align(ax.roles, xc, wc, xb, wb, len(w.shape)), w.shape)
        roles = out_roles(ax.roles, _dot_align(ax.roles, xc, wc, xb, wb, len(w.shape)), xc, wc, xb, wb, swap)
        return Gate(roles, ax.factors + (Factor(w_source, w_roles),), ax.expert)

    # weights [t.., k] . chosen rows [t.., k, F] over k -> combined
    if ax is None and isinstance(aw, Rows) and aw.space == "choice" and aw.gate is None:
        if len(wc) == 1 and aw.roles[wc[0]] == CHOICE:
            x_roles = _dot_align(aw.roles, wc, xc, wb, xb, len(x.shape))
            source, f_roles = _plain_roles(an.graph, x, x_roles, x.shape)
            roles = out_roles(x_roles, aw.roles, xc, wc, xb, wb, swap)
            gate = Gate(tuple(r for r in aw.roles if r not in (FEATURE,)), (Factor(source, f_roles),))
            return Combined(roles, aw.node, aw.tokens, gate, style=_style(aw),
                            gate_values=(GateValue(source, f_roles),))
        return None

    # combine [t.., E, C] . slot rows [E, C, F] over (E, C), batched over the rows' groups -> combined
    if ax is None and isinstance(aw, Rows) and aw.space == "slot" and len(wc) == 2:
        if {aw.roles[i] for i in wc} == {EXPERT, SLOT} and len(x.shape) == n_tok + 2 and an.depends_on_anchor(x):
            groups = tuple(r for r in aw.roles if is_token(r))
            if any(r not in tokens for r in groups) or any(_merged_parts(r) for r in aw.roles):
                return FailedMatch("the slot rows reach the combine with their group and slot axes still "
                                   "regrouped (split or merged by a reshape that is not undone)", eqn)
            if sorted(aw.roles[i] for i in wb) != sorted(groups) or not all(is_token(aw.roles[i]) for i in wb):
                return FailedMatch("the combine does not keep the dispatch's token groups apart (each group's "
                                   "slots must meet only that group's tokens)", eqn)
            x_roles = _combine_roles(x, xc, wc, xb, wb, aw.roles, tokens, token_shape)
            if x_roles is None:
                return None
            roles = out_roles(x_roles, aw.roles, xc, wc, xb, wb, swap)
            return Combined(roles, aw.node, aw.tokens, None, combine=(x, x_roles), dispatch=aw.dispatch,
                            style="grouped capacity" if groups else "capacity", slot_groups=tuple(sorted(groups)))
    return None


def _token_source(graph: JaxprGraph, tokens):
    """The value ``tokens`` is a view of: seen through squeezes, reshapes and broadcasts that only add or
    drop unit axes (keeping the feature axis last) and through annotations, so that two projections of
    ``x[:, None, :]`` squeezed twice read the same tokens. Same elements, same order: the rewrite
    reshapes whichever it reads to ``[T, d]``."""
    while isinstance(tokens, Value):
        eqn = graph.producer.get(tokens)
        if eqn is None:
            break
        source = eqn.inputs[0]
        if eqn.primitive in identity_annotations():
            tokens = source
            continue
        if eqn.primitive not in (lax.squeeze_p, lax.reshape_p, lax.broadcast_in_dim_p) or not isinstance(source, Value):
            break
        if not source.shape or source.shape[-1] != tokens.shape[-1] or math.prod(source.shape) != math.prod(tokens.shape):
            break
        if eqn.primitive is lax.broadcast_in_dim_p and list(eqn.params["broadcast_dimensions"]) != sorted(
                eqn.params["broadcast_dimensions"]):
            break
        if _unit_reshape(source.shape, tokens.shape) is None:
            break
        tokens = source
    return tokens


def _dot_align(roles: Roles, own_c, other_c, own_b, other_b, other_rank) -> Roles:
    """Roles of the other operand of a dot, read off this one's contracted and batch dims."""
    out = [FEATURE] * other_rank
    for mine, theirs in zip(own_c + own_b, other_c + other_b):
        out[theirs] = roles[mine]
    return tuple(out)


def _dispatch_roles(x, xc, wc, xb, wb, tokens: Roles, num_experts: int) -> Roles | None:
    """Roles of a ``[t.., E, C]`` dispatch tensor, each token axis named by the tokens' axis it meets in
    the dot (contracted, or batched as a group): never by position, so ``'sbec,bsd->ecd'`` reads the
    right tokens. The two axes left are the experts (of size E) and the slots."""
    if not wc or sorted(wc + wb) != list(range(len(tokens))):
        return None
    roles: list = [None] * len(x.shape)
    for mine, theirs in zip(xc + xb, wc + wb):
        roles[mine] = tokens[theirs]
    rest = [d for d in range(len(x.shape)) if roles[d] is None]
    if len(rest) != 2:
        return None
    e_dim = next((d for d in rest if x.shape[d] == num_experts), None)
    if e_dim is None:
        return None
    for d in rest:
        roles[d] = EXPERT if d == e_dim else SLOT
    return tuple(roles)


def _combine_roles(x, xc, wc, xb, wb, rows_roles: Roles, tokens: Roles, token_shape) -> Roles | None:
    """Roles of a ``[t.., E, C]`` combine tensor: expert, slot and group axes from the slot rows they
    meet; its other token axes, in order, name the output's tokens. That naming needs no proof: the
    device check compares combine with dispatch entry by entry under it (``combine-within-dispatch``),
    so a token whose combine weights sit in another token's slots takes the dense fallback."""
    roles: list = [None] * len(x.shape)
    for mine, theirs in zip(xc + xb, wc + wb):
        roles[mine] = rows_roles[theirs]
    free = [r for r in tokens if r not in roles]
    rest = [d for d in range(len(x.shape)) if roles[d] is None]
    if len(rest) != len(free):
        return None
    for d, r in zip(rest, free):
        roles[d] = r
    if any(x.shape[d] != token_shape[tokens.index(r)] for d, r in enumerate(roles) if is_token(r)):
        return None
    return tuple(roles)


def _slice_weight(an: Analysis, slice_: ExpertParamSlice, contract_dim: int) -> int:
    """The loop style's ``w[e]`` as the full expert weight ``w [E, K, N]``."""
    source = slice_.source
    k_src = slice_.roles[contract_dim]
    roles = tuple(EXPERT if d == slice_.expert_axis else ("K" if d == k_src else "N") for d in range(len(source.shape)))
    return an.param(source, ParamKind.EXPERT_WEIGHT, roles)


# --------------------------------------------------------------------------- regions


def analyse(graph: JaxprGraph) -> tuple[list[MoeRegion], list[tuple[RoutingAnchor, FailedMatch]]]:
    """All MoE regions of ``graph``, and for each anchor that gave none, why not."""
    regions: list[MoeRegion] = []
    near_misses: list[tuple[RoutingAnchor, FailedMatch]] = []
    anchors = find_anchors(graph)
    claimed: set = set()
    for anchor in anchors:
        analysis = Analysis(graph, anchor)
        analysis.run()
        results = _regions_of(analysis, anchors)
        if analysis.ambiguous_expert_axis and not any(isinstance(r, MoeRegion) for r in results):
            retry = Analysis(graph, anchor, expert_axis_choice=-1)
            retry.run()
            retried = _regions_of(retry, anchors)
            if any(isinstance(r, MoeRegion) for r in retried):
                analysis, results = retry, retried
        found = [r for r in results if isinstance(r, MoeRegion)]
        failures = [r for r in results if isinstance(r, FailedMatch)]
        found = [r for r in found if r.output not in claimed]
        for region in found:
            claimed.add(region.output)
        regions.extend(found)
        if not found and not _feeds_later_anchor(graph, anchor, anchors):
            near_misses.append((anchor, failures[0] if failures else _why_not(analysis)))
    counted = {id(a.eqn) for region in regions for a in _region_anchors(graph, region, anchors)}
    return regions, [(a, f) for a, f in near_misses if id(a.eqn) not in counted]


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
    if Gate not in kinds and Rows not in kinds:
        return FailedMatch(
            "the routing indices never select experts: no one-hot mask, scatter or gather built from them, "
            "and no matmul of the tokens with a weight of expert axis "
            f"E={analysis.num_experts}"
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
    for eqn_index in replaced:
        eqn = graph.eqns[eqn_index]
        for value in eqn.outputs:
            if value is output:
                continue
            outside = [u for u in graph.users.get(value, ()) if u.index not in replaced]
            if outside or value in graph.output_set:
                where = outside[0].where() if outside else "the function's outputs"
                return FailedMatch(
                    f"an interior value of the MoE (the expert activations {list(value.shape)}) is also used "
                    f"outside it, at {where}; replacing the layer would change that use",
                    eqn,
                    "private-interior",
                )
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
    out_roles = combined.roles
    present = [r for r in out_roles if is_token(r)]
    unit = {r for r, n in zip(token_roles_, an.token_shape) if n == 1}  # a reshape may drop these
    if (len(set(present)) != len(present) or not set(token_roles_) - unit <= set(present) <= set(token_roles_)
            or out_roles.count(FEATURE) != 1):
        return FailedMatch("the MoE output is not laid out as [tokens.., features]")
    capacity = None
    top_k = an.anchor.top_k
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
    )


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
        if eqn is None or not isinstance(an.values.get(value), (Rows, Combined)):
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
