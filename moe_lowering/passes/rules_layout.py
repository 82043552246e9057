"""Rules that move axes without changing values: broadcast, reshape (unit axes; slot rows regrouped
by ``_slot_reshape_roles``), transpose, squeeze, slice (a feature slice, one expert's weight
``w[e]``, one expert's rows ``xin[:, :, e]``), split and concatenate along the features, the
experts' outputs stacked along a new axis (``jnp.stack``), and the sum over experts or choices that
turns gated rows into the combined output.
"""

from __future__ import annotations

from dataclasses import replace

from jax import lax

from moe_lowering import _compat
from moe_lowering.expert_program import ExpertMatmul, FeatureConcat, FeatureSlice, topological_nodes
from moe_lowering.passes.abstract import (
    BROADCAST,
    CHOICE,
    EXPERT,
    FEATURE,
    ONE,
    SLOT,
    Combined,
    ExpertCounts,
    ExpertIndex,
    ExpertParamSlice,
    Gate,
    Iota,
    PackedIndices,
    Roles,
    Rows,
    StackedWeights,
    is_token,
)
from moe_lowering.passes.assumptions import SEPARATE_EXPERTS
from moe_lowering.passes.graph import Const, Eqn
from moe_lowering.passes.match_core import ITERATION_ROLE, Analysis, FailedMatch, IndexInBounds, _rows_like, rule
from moe_lowering.passes.rules_copies import split_copies
from moe_lowering.passes.rules_rows import _gated_sum, _style, _unit_reshape
from moe_lowering.passes.rules_sort import (
    SORT_KINDS,
    copy_index,
    counts_of_choices,
    exclusive_cumsum,
    involves_sorted_dispatch,
    leading_ends,
    sorted_reduce_sum,
)


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
    if isinstance(value, (ExpertIndex, Iota, Gate, IndexInBounds) + SORT_KINDS):
        return replace(value, roles=roles)
    return None


@rule(lax.reshape_p)
def _reshape(an: Analysis, eqn: Eqn, abstracts):
    value = abstracts[0]
    if value is None or not hasattr(value, "roles"):
        return None
    mapping = _unit_reshape(eqn.inputs[0].shape, eqn.outputs[0].shape)
    if mapping is None:
        copies = split_copies(an, eqn, value) if isinstance(value, Rows) else None
        if copies is not None:  # chosen copies back as (token, choice), or why not
            return copies
        if isinstance(value, Rows) and value.space == "slot" and value.gate is None:
            roles = _slot_reshape_roles(value.roles, eqn.inputs[0].shape, eqn.outputs[0].shape)
            if roles is not None:
                return replace(value, roles=roles)
        if isinstance(value, (Rows, Combined)):
            return FailedMatch("a reshape merges or splits the axes of expert activations", eqn)
        if isinstance(value, ExpertIndex) and copy_index(an, eqn, value) is not None:
            return copy_index(an, eqn, value)  # [.., L, k] -> [.., L * k]: one index per (token, choice) copy
        if isinstance(value, ExpertIndex):
            return FailedMatch(
                f"the routing indices are reshaped {list(eqn.inputs[0].shape)} -> {list(eqn.outputs[0].shape)}, merging "
                "or splitting their token and choice axes (tokens tiled per choice, say): a one-hot, gather or "
                "scatter built from them after that is not followed, so no expert is known to be selected", eqn)
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
    if involves_sorted_dispatch([value]):
        return sorted_reduce_sum(an, eqn, value)
    summed = {value.roles[a] for a in axes} - {ONE}
    kept = tuple(r for i, r in enumerate(value.roles) if i not in axes)
    if isinstance(value, Gate):
        if summed == {CHOICE} and not value.boolean:
            return replace(value, roles=kept)
        if summed == {CHOICE}:
            return FailedMatch("a boolean one-hot mask is summed over k", eqn)
        return counts_of_choices(an, eqn, value, summed)
    if isinstance(value, Rows):
        target = CHOICE if value.space == "choice" else EXPERT
        if summed != {target}:
            return FailedMatch(f"expert activations are reduced over {sorted(summed)}, not over the experts", eqn)
        if value.gate is None:
            return FailedMatch(
                "expert outputs are summed over experts without routing weights (an ensemble, not a routed MoE)", eqn
            )
        return _gated_sum(value, kept, eqn)
    return None


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
    if isinstance(value, ExpertCounts):
        return leading_ends(an, eqn, value)
    if value is None:
        if len(changed) == 1 and in_shape[changed[0]] == an.num_experts and out_shape[changed[0]] == 1:
            axis = changed[0]
            return ExpertParamSlice(atom, axis, starts[axis], tuple(range(len(in_shape))))
        return None
    if isinstance(value, Gate) and len(changed) == 1 and value.roles[changed[0]] == EXPERT and out_shape[changed[0]] == 1:
        axis = changed[0]
        return replace(value, roles=value.roles[:axis] + (ONE,) + value.roles[axis + 1 :], expert=starts[axis])
    if (isinstance(value, Rows) and len(changed) == 1 and value.roles[changed[0]] == EXPERT and value.space == "dense"
            and value.gate is None and out_shape[changed[0]] == 1):  # xin[:, :, e]: expert e's rows, for a loop
        axis = changed[0]
        return replace(value, roles=value.roles[:axis] + (ONE,) + value.roles[axis + 1:], space="single",
                       expert=starts[axis])
    if isinstance(value, Rows) and len(changed) == 1 and value.roles[changed[0]] == FEATURE:
        axis = changed[0]
        stop = starts[axis] + (out_shape[axis] - 1) * strides[axis] + 1
        return replace(value, node=FeatureSlice(value.node, starts[axis], stop, strides[axis]))
    if isinstance(value, (Rows, Combined)):
        return FailedMatch("expert activations are sliced along a token or expert axis", eqn)
    return None


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


@rule(*[p for p in (_compat.stack_p,) if p is not None])
def _stack(an: Analysis, eqn: Eqn, abstracts):
    """``jnp.stack([expert_0(x), ..., expert_{E-1}(x)], axis)`` (JAX 0.11+: one primitive)."""
    if not any(isinstance(a, (Rows, Combined)) for a in abstracts):
        return None
    axis = eqn.params["axis"]
    expanded = [replace(a, roles=a.roles[:axis] + (ONE,) + a.roles[axis:]) if isinstance(a, Rows) else a
                for a in abstracts]
    return _stacked_experts(an, eqn, expanded, axis)


def _stacked_experts(an: Analysis, eqn: Eqn, pieces, axis: int):
    """One expert's rows per piece, piece ``e`` computed by expert ``e`` with a unit axis at ``axis``,
    stacked along it: every (token, expert) pair's rows (the loop's outputs stacked, not summed)."""
    first = pieces[0]
    if len(pieces) != an.num_experts or not all(isinstance(p, Rows) and p.space == "single" for p in pieces):
        return FailedMatch(f"{len(pieces)} values are stacked along an axis of expert activations; only the "
                           f"{an.num_experts} experts' outputs, one per expert in order, stack into expert rows", eqn)
    if [p.expert for p in pieces] != list(range(an.num_experts)):
        return FailedMatch("the experts' outputs are stacked out of order: position e of the stack must hold "
                           "expert e's", eqn, "expert-program")
    if any(p.gate is not None or p.roles != first.roles or p.tokens is not first.tokens for p in pieces):
        return FailedMatch("the stacked expert outputs differ in layout or tokens, or are already weighted", eqn)
    if any(p.node != first.node for p in pieces):
        return FailedMatch("the stacked experts do not all compute the same program", eqn, "expert-program")
    roles = first.roles[:axis] + (EXPERT,) + first.roles[axis + 1:]
    stacked = any(isinstance(an.params[n.weight].source, StackedWeights) for n in topological_nodes(first.node)
                  if isinstance(n, ExpertMatmul))
    return Rows(roles, first.node, "dense", first.tokens, style=SEPARATE_EXPERTS if stacked else first.style)


@rule(lax.concatenate_p)
def _concatenate(an: Analysis, eqn: Eqn, abstracts):
    dim = eqn.params["dimension"]
    starts = exclusive_cumsum(an, eqn, abstracts)
    if starts is not None:
        return starts
    if all(isinstance(a, Rows) for a in abstracts):
        first = abstracts[0]
        if all(_rows_like(a, first) for a in abstracts) and first.roles[dim] == FEATURE and first.gate is None:
            return replace(first, node=FeatureConcat(tuple(a.node for a in abstracts)))
        if first.space == "single" and all(a.roles[dim] == ONE for a in abstracts):  # jnp.stack before JAX 0.11
            return _stacked_experts(an, eqn, abstracts, dim)
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
