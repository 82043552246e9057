"""What the matcher's rule families share: the records they build (``FailedMatch`` with its
reason, ``RoutingAnchor``, ``ParamSource``, ``IndexInBounds``), the rule registry (``@rule(prim)``,
one rule per anchor primitive; ``rules()`` imports the rule modules on first use), the abstract
interpretation that runs them (``Analysis``), and small helpers on plain operands (``_is_zero``,
``_plain_roles``, ...) and on roles (``_merge_roles``, ``_compatible``, ``_rows_like``).

The rule modules import this one, never the other way round at import time: ``rules_routing``,
``rules_gate``, ``rules_rows``, ``rules_layout``, ``rules_dot``, ``rules_sort``, ``rules_elementwise``
and ``canonicalize``. ``match.py`` drives it and assembles the regions.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
from jax import lax

from moe_lowering.expert_program import ParamKind
from moe_lowering.passes.abstract import (
    BROADCAST,
    CHOICE,
    EXPERT,
    ONE,
    Combined,
    ExpertIndex,
    FusedRows,
    Roles,
    Rows,
    token_parts,
    token_roles,
)
from moe_lowering.passes.assumptions import BY_NAME
from moe_lowering.passes.canonicalize import identity_annotations
from moe_lowering.passes.graph import Const, Eqn, JaxprGraph, Value


# the matcher's one logger, under the name it had before the rule families moved out of match.py
log = logging.getLogger("moe_lowering.passes.match")

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
    kind: str  # "top_k", "approx_top_k", "argmax" or "argsort"
    split_tokens: tuple[int, ...] = ()  # the indices' own token axes, read as parts of the one axis of token_shape

    def describe(self) -> str:
        return f"{self.kind} (k={self.top_k}, E={self.num_experts}) at {self.eqn.where()}"

    def over_one_token_axis(self) -> RoutingAnchor:
        """The same decision over its T tokens in one axis, row-major as ``x.reshape(T, d)`` has them: what a
        program that merges the router's token axes (``idx.reshape(B * S, k)``) computes its layer over."""
        return replace(self, token_shape=(math.prod(self.token_shape),), split_tokens=self.token_shape)

    def index_token_roles(self) -> Roles:
        """The roles of the indices' token axes: each its own, or (``split_tokens``) parts of one axis."""
        if not self.split_tokens:
            return token_roles(len(self.token_shape))
        parts = iter(token_parts(token_roles(1)[0], tuple(n for n in self.split_tokens if n != 1)))
        return tuple(ONE if n == 1 else next(parts) for n in self.split_tokens)


@dataclass(frozen=True)
class ParamSource:
    """Where a program input comes from: ``source`` with per-dim ``roles``; how it is indexed."""

    source: Any
    kind: ParamKind
    roles: Roles  # EXPERT_WEIGHT: E/K/N per dim; otherwise token roles, E, F, 1


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


# the rule families' modules, imported by ``_register_rules`` on first use
_RULE_MODULES = (
    "moe_lowering.passes.rules_routing",
    "moe_lowering.passes.rules_gate",
    "moe_lowering.passes.rules_rows",
    "moe_lowering.passes.rules_layout",
    "moe_lowering.passes.rules_dot",
    "moe_lowering.passes.rules_sort",
)


@functools.cache
def _register_rules() -> None:
    """Primitive tables are built on first use, keeping ``import moe_lowering`` cheap."""
    for module in _RULE_MODULES:  # each registers its rules (``@rule``) as it is imported
        importlib.import_module(module)
    from moe_lowering.passes.canonicalize import _annotation
    from moe_lowering.passes.rules_elementwise import _elementwise_rule

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
    # A reshape merged the routing's token axes (``idx.reshape(B * S, k)``): the layer may be read over
    # one token axis instead (``RoutingAnchor.over_one_token_axis``, see ``analyse``).
    token_axes_merged: bool = False

    @property
    def token_shape(self) -> tuple[int, ...]:
        return self.anchor.token_shape

    @property
    def num_experts(self) -> int:
        return self.anchor.num_experts

    def run(self) -> None:
        table = rules()
        index = self.anchor.indices
        roles = self.anchor.index_token_roles() + ((CHOICE,) if self.anchor.kind != "argmax" else ())
        self.values[index] = ExpertIndex(roles)
        from moe_lowering.passes.rules_rows import separate_expert_weights  # a rule module: imported by rules()

        self.values.update(separate_expert_weights(self))
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
            if any(isinstance(a, (Rows, Combined, FusedRows)) for a in abstracts):
                self.fail(f"`{eqn.primitive}` is applied to expert activations and is not understood", eqn)
            return
        try:
            result = fn(self, eqn, abstracts)
        except Exception as error:  # a matcher bug must not break the user's program: decline, loudly
            log.warning("matcher error at %s (`%s`), declining this routing: %r", eqn.where(),
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
        log.debug("near miss at %s: %s", eqn.where() if eqn else "?", reason)
        self.failures.append(FailedMatch(reason, eqn))

    def param(self, source, kind: ParamKind, roles: Roles) -> int:
        entry = ParamSource(source, kind, roles)
        for i, existing in enumerate(self.params):
            if existing.source == source and existing.kind is kind and existing.roles == roles:  # equal WeightParts
                return i
        self.params.append(entry)
        return len(self.params) - 1

    def depends_on_anchor(self, atom) -> bool:
        return isinstance(atom, Value) and self.anchor.indices in self.graph.ancestors(atom)


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


def _maybe_param_slice(an: Analysis, eqn: Eqn) -> bool:
    """Plain slices of a weight with an expert axis are worth a look (the loop style's ``w[e]``)."""
    if eqn.primitive not in (lax.slice_p, lax.dynamic_slice_p):
        return False
    shape = eqn.inputs[0].shape
    return len(shape) >= 2 and an.num_experts in shape


def expert_weight(an: Analysis, w, contract_dim: int) -> tuple[int, int] | None:
    """A weight ``[E, K, N]`` (any axis order) contracted over ``contract_dim``: its param index and its
    expert axis, the free axis of size E; ``None`` without one. Where both free axes count E, the analysis's
    ``expert_axis_choice`` picks one and the data flow rejects the wrong one (``ambiguous_expert_axis``)."""
    expert_dims = [d for d in range(3) if d != contract_dim and w.shape[d] == an.num_experts]
    if not expert_dims:
        return None
    if len(expert_dims) > 1:
        an.ambiguous_expert_axis = True
    e_dim = expert_dims[an.expert_axis_choice]
    roles = tuple(EXPERT if d == e_dim else ("K" if d == contract_dim else "N") for d in range(3))
    return an.param(w, ParamKind.EXPERT_WEIGHT, roles), e_dim
