"""Abstract values: what the matcher knows about a value of the program, role by role.

Each dimension of a value carries a *role*: ``t0, t1, ...`` (token axes, in the routing's
order), ``k`` (top-k choice), ``E`` (expert), ``C`` (capacity slot), ``F`` (a feature axis),
``1`` (a size-1 axis), ``*`` (an axis that only broadcasts). Roles make the rules independent of
layout: a transpose only permutes them, ``einsum`` orderings do not matter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_lowering.expert_program import Node

Roles = tuple[str, ...]

ONE = "1"
BROADCAST = "*"
EXPERT = "E"
CHOICE = "k"
SLOT = "C"
FEATURE = "F"


def token_roles(rank: int) -> Roles:
    return tuple(f"t{i}" for i in range(rank))


def is_token(role: str) -> bool:
    return role.startswith("t")


@dataclass(frozen=True)
class Factor:
    """One multiplicative piece of the routing weights: ``source`` indexed by ``roles``."""

    source: Any  # graph Value or Const
    roles: Roles  # per dim of source: token roles, k, E or 1
    reciprocal: bool = False  # the gate was divided by it (renormalised after masking)


@dataclass(frozen=True)
class ExpertIndex:
    """The routing's expert indices (possibly broadcast): ``value[t.., k] = idx[t.., k]``."""

    roles: Roles


@dataclass(frozen=True)
class Iota:
    """``iota`` along the dim whose role is not ``1``: over experts or over tokens."""

    roles: Roles


@dataclass(frozen=True)
class NegativeIndexCheck:
    """``x < 0`` of an index: the first half of JAX's negative-index normalisation."""

    of: Any


@dataclass(frozen=True)
class ShiftedIndex:
    """``x + n`` of an index: the second half of the normalisation."""

    of: Any


@dataclass(frozen=True)
class PackedIndices:
    """A scatter/gather index tensor: ``roles`` for the batch dims, ``components`` along the last."""

    roles: Roles
    components: Roles


@dataclass(frozen=True)
class Gate:
    """``value[..] = [idx[t, k] == e] * prod(factors)``: a one-hot mask or routing weights.

    ``roles`` contains ``E`` unless ``expert`` fixes one expert (the per-expert loop style);
    it contains ``k`` until the choices are summed. ``boolean`` while it is still a predicate.
    """

    roles: Roles
    factors: tuple[Factor, ...] = ()
    expert: int | None = None
    boolean: bool = False


@dataclass(frozen=True, eq=False)
class GateValue:
    """The routing weights as the program itself computes them, where they meet the expert outputs.

    ``atom`` (a graph value or constant) with ``roles``: tokens and ``E`` (a ``[t.., E]`` gate,
    zero off the chosen experts), tokens and ``k`` (per-choice weights), or tokens only (one
    ``expert``'s weights in the loop style, or one weight per token). The rewrite reads this value
    at the chosen experts, so whatever the program did to it (a cast, a fake quantisation, a
    per-position factor) is kept, not assumed away.
    """

    atom: Any
    roles: Roles
    expert: int | None = None


@dataclass(frozen=True)
class GatheredWeight:
    """``take(param, idx, axis=expert_axis)``: a weight (or bias) gathered per routed (token, choice).

    ``roles`` per output dim: the index's token and ``k`` roles, or ``p<i>`` for the output dim that
    is the param's dim ``i`` (EasyDeL's reference path: ``W[E, d, f][idx] -> [T, k, d, f]``).
    """

    source: Any
    expert_axis: int
    roles: Roles


@dataclass(frozen=True)
class ExpertParamSlice:
    """``param[e]`` for a static expert ``e``: the per-expert loop's weight or bias slice."""

    source: Any
    expert_axis: int
    expert: int
    roles: Roles  # per dim of the slice (before a squeeze: the expert dim has role ONE)


@dataclass(frozen=True, eq=False)
class StackedWeights:
    """E separate weight (or bias) arrays of one shape, one per expert (experts kept as separate modules),
    read as one ``[E, ...]`` weight: the rewrite stacks them on every call (a copy of the weights,
    unless the caller hoists it)."""

    parts: tuple  # graph values, expert by expert

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts),) + tuple(self.parts[0].shape)

    @property
    def dtype(self):
        return self.parts[0].dtype


@dataclass(frozen=True)
class Rows:
    """Expert outputs for (token, expert) pairs, computed by ``node`` from token rows ``tokens``.

    ``space``: ``dense`` (roles hold tokens and ``E``: every expert on every token), ``choice``
    (tokens and ``k``: the chosen experts, after a gather), ``single`` (one ``expert``: the loop
    style), ``slot`` (``E`` and ``C``: capacity slots after a dispatch einsum), ``pending`` (``E`` and
    the chosen rows' axes: every expert's weight applied to rows already chosen, valid only once each
    row's own expert is selected again; tokens tiled per choice). ``gate`` is set once routing weights
    have been multiplied in; only linear steps may follow.
    """

    roles: Roles
    node: Node
    space: str
    tokens: Any
    expert: int | None = None
    gate: Gate | None = None
    dispatch: Any = None  # slot space: the [t.., E, C] dispatch tensor
    gate_value: GateValue | None = None  # set with ``gate``: the value that was multiplied in
    style: str = ""  # how the dense program computed them, where the space does not say it


@dataclass(frozen=True)
class Combined:
    """The layer output ``y[t.., F] = sum over chosen experts of weight * program(x[t])``."""

    roles: Roles
    node: Node
    tokens: Any
    gate: Gate | None  # None for the slot space, whose weights are ``combine``
    experts: frozenset | None = None  # the loop style: which experts are summed so far
    combine: Any = None  # slot space: the [t.., E, C] combine tensor
    dispatch: Any = None
    style: str = ""
    gate_values: tuple[GateValue, ...] = ()  # the routing weights as computed (one per expert in the loop style)
    slot_groups: tuple = ()  # slot space: token axes batched through dispatch and combine, each group with its own slots


# --------------------------------------------------------------------------------------------
# The sort-based dense dispatch (``rules_sort.py``): the routing's copies sorted by expert, every expert
# run on every sorted copy, each copy's own expert kept by a range mask ``start_e <= i < end_e``.

COPY = "n"  # one (token, choice) copy: the last token axis and k merged, copy n = token * k + choice
SORTED = "s"  # a position among the copies sorted by expert


@dataclass(frozen=True)
class CopyIndex:
    """The routing's expert indices with the last token axis and ``k`` merged into one ``COPY`` axis
    (``idx.reshape(B, L * k)``): ``value[b.., n] = idx[b.., n // k, n % k]``."""

    roles: Roles


@dataclass(frozen=True)
class SortOrder:
    """``argsort`` of a ``CopyIndex`` along its ``COPY`` axis (ascending, stable or not): ``value[b.., s]``
    is the copy sorted to position ``s``, the copies' expert indices non-decreasing in ``s``. ``inverse``:
    ``argsort`` of such an order, the inverse permutation (``value[b.., n]`` is where copy ``n`` went);
    ``token``: ``order // divisor``, the token each sorted copy is of where ``divisor`` is k."""

    roles: Roles
    inverse: bool = False
    divisor: int | None = None


@dataclass(frozen=True)
class CopyOneHot:
    """``CopyIndex == iota over E``: a one-hot of the copies' expert indices (a predicate or 0/1 numbers)."""

    roles: Roles


@dataclass(frozen=True)
class ExpertCounts:
    """How many copies chose each expert: a ``CopyOneHot`` summed over its ``COPY`` axis (per sorted row,
    the rows being the token axes left). ``bound``: ``""`` for the counts, ``"end"`` for their cumsum over
    E (one past expert e's last sorted position), ``"start"`` for end - counts (its first), ``"leading ends"``
    for ``end[:-1]`` (the starts of experts 1..E-1, before a zero is put in front)."""

    roles: Roles
    bound: str = ""


@dataclass(frozen=True)
class RangeMask:
    """``start_e <= i`` (``lower``), ``i < end_e`` (``upper``) or both, of an iota ``i`` over the
    ``SORTED`` positions: with both, 1 exactly where sorted position ``i`` holds a copy of expert e."""

    roles: Roles
    lower: bool = False
    upper: bool = False
