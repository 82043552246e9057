"""Abstract values: what the matcher knows about a value of the program, role by role.

Each dimension of a value carries a *role*: ``t0, t1, ...`` (token axes, in the routing's
order), ``k`` (top-k choice), ``E`` (expert), ``C`` (capacity slot), ``F`` (a feature axis),
``1`` (a size-1 axis), ``*`` (an axis that only broadcasts), ``P`` (the parts of a weight that fuses
several projections, until they are taken apart). Roles make the rules independent of
layout: a transpose only permutes them, ``einsum`` orderings do not matter, and a reshape that merges
or splits token axes in order (``x.reshape(B * S, d)`` and back) renames them (``reshaped_roles``).
"""

from __future__ import annotations

import math
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
PART = "P"


def token_roles(rank: int) -> Roles:
    return tuple(f"t{i}" for i in range(rank))


def is_token(role: str) -> bool:
    return role.startswith("t")


# --------------------------------------------------------------------------------------------
# Token axes merged or split by a reshape, row-major (``x.reshape(B * S, d)`` and back): a token axis split
# into factors gives one role per factor, a *part* (``t0#1/2x16``: part 1 of t0 split as 2 x 16); its
# parts, adjacent, complete and in order, are that axis again. Any other regrouping has no roles.


def token_part(role: str, index: int, factors: tuple[int, ...]) -> str:
    """Part ``index`` of token axis ``role`` split row-major into ``factors``."""
    return f"{role}#{index}/{'x'.join(map(str, factors))}"


def token_parts(role: str, factors: tuple[int, ...]) -> Roles:
    return tuple(token_part(role, i, factors) for i in range(len(factors)))


def _part_of(role: str) -> tuple[str, tuple[int, ...]] | None:
    """The token axis ``role`` is a part of, and that axis's factors; None for any other role."""
    if not is_token(role) or "#" not in role:
        return None
    base, rest = role.split("#", 1)
    return base, tuple(int(f) for f in rest.split("/", 1)[1].split("x"))


def _merge_parts(atoms: list) -> list:
    """``(role, size)`` atoms with each run of one token axis's parts, complete and in order, merged back."""
    out, i = [], 0
    while i < len(atoms):
        part = _part_of(atoms[i][0])
        if part is not None and tuple(r for r, _ in atoms[i:i + len(part[1])]) == token_parts(*part):
            out.append((part[0], math.prod(part[1])))
            i += len(part[1])
        else:
            out.append(atoms[i])
            i += 1
    return out


def whole_token_axes(roles: Roles, shape) -> tuple[Roles, tuple[int, ...]] | None:
    """``roles`` and ``shape`` with every token axis split into parts merged back (the reshape that undoes
    the split); None where parts are apart, permuted or missing (no one token axis they are the split of)."""
    atoms = _merge_parts(list(zip(roles, shape)))
    if any(_part_of(role) is not None for role, _ in atoms):
        return None
    return tuple(r for r, _ in atoms), tuple(n for _, n in atoms)


def reshaped_roles(roles: Roles, in_shape, out_shape, copies: tuple[str, int] | None = None) -> Roles | None:
    """The roles after a reshape that only regroups token axes, row-major: a token axis split into factors
    (its parts), parts merged back into their axis, unit axes added or dropped, every other axis kept whole
    and in order. With ``copies`` (the last token axis and k, for indices and chosen copies), that axis
    followed by ``k`` merges into one ``COPY`` axis (copy n = token * k + choice) and a ``COPY`` axis splits
    back into them. None for any other reshape: one that mixes a token axis with another axis, or merges
    token axes that are not one axis's parts in order, changes which token an element belongs to."""
    atoms = []
    for role, size in zip(roles, in_shape):
        if size == 1:
            continue
        if role == COPY:
            if copies is None:
                return None
            atoms += [(copies[0], size // copies[1]), (CHOICE, copies[1])]
        else:
            atoms.append((role, size))
    atoms = _merge_parts(atoms)
    out: list = []
    position, dim = 0, 0
    while dim < len(out_shape):
        size = out_shape[dim]
        if size == 1:
            out.append(ONE)
            dim += 1
            continue
        if position == len(atoms):
            return None
        role, atom_size = atoms[position]
        if atom_size == size:
            out.append(role)
            position, dim = position + 1, dim + 1
        elif (copies is not None and role == copies[0] and size == atom_size * copies[1]
              and atoms[position + 1:position + 2] == [(CHOICE, copies[1])]):
            out.append(COPY)
            position, dim = position + 2, dim + 1
        elif is_token(role) and _part_of(role) is None and size and atom_size % size == 0:
            factors, product = [], 1
            while dim < len(out_shape) and product < atom_size and out_shape[dim] != 1:
                factors.append(out_shape[dim])
                product *= out_shape[dim]
                dim += 1
            if product != atom_size:
                return None
            out.extend(token_parts(role, tuple(factors)))
            position += 1
        else:
            return None
    named = [r for r in out if r != ONE]
    if position != len(atoms) or len(set(named)) != len(named) or not _split_one_way(named):
        return None
    return tuple(out)


def _split_one_way(roles) -> bool:
    """Each token axis among ``roles`` whole or split into parts one way, never both."""
    splits: dict = {}
    for role in filter(is_token, roles):
        base, factors = _part_of(role) or (role, ())
        if splits.setdefault(base, factors) != factors:
            return False
    return True


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
class WeightPart:
    """``lax.index_in_dim(whole, index, axis, keepdims=False)``: one part of a weight that fuses several
    projections along an axis of its own (Gemma 4's gate and up, ``[E, 2, f, d]``), read as a weight of
    its own. Equal parts are one param; the rewrite indexes ``whole`` where it reads it, so a cotangent
    reaches ``whole``."""

    whole: Any  # graph Value or Const
    axis: int
    index: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(n for d, n in enumerate(self.whole.shape) if d != self.axis)

    @property
    def dtype(self):
        return self.whole.dtype


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
class FusedRows:
    """The products of the tokens (or rows) with a weight of several parts (``WeightPart``), computed as one:
    ``roles`` has ``PART`` on the parts' axis, ``parts[i]`` is part ``i``'s rows (their own roles are not
    kept up: ``roles``, read at one part, is their layout). Only taking the parts apart reads them."""

    roles: Roles
    parts: tuple[Rows, ...]


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
