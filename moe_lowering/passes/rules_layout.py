"""Rules that move axes without changing values: broadcast, reshape (unit axes; token axes merged or
split in order, ``abstract.reshaped_roles``; slot rows regrouped by ``_slot_reshape_roles``), transpose, squeeze,
slice (a feature slice, one expert's weight ``w[e]``, one expert's rows ``xin[:, :, e]``, the parts of a fused
weight's products taken apart with ``unstack`` and ``split`` too), split and concatenate along the features, the
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
    PART,
    SLOT,
    Combined,
    ExpertCounts,
    ExpertIndex,
    ExpertParamSlice,
    FusedRows,
    Gate,
    Iota,
    PackedIndices,
    Roles,
    Rows,
    StackedWeights,
    is_token,
    reshaped_roles,
    token_part,
    token_roles,
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
    if isinstance(value, (Rows, Combined, FusedRows)):
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
    in_shape, out_shape = eqn.inputs[0].shape, eqn.outputs[0].shape
    mapping = _unit_reshape(in_shape, out_shape)
    if mapping is not None:
        return replace(value, roles=tuple(ONE if m is None else value.roles[m] for m in mapping))
    copies = split_copies(an, eqn, value) if isinstance(value, Rows) else None
    if copies is not None:  # chosen copies back as (token, choice), or why not
        return copies
    if isinstance(value, Rows) and value.space == "slot":
        roles = _slot_reshape_roles(value.roles, in_shape, out_shape) if value.gate is None else None
        if roles is not None:
            return replace(value, roles=roles)
    elif isinstance(value, ExpertIndex) and copy_index(an, eqn, value) is not None:
        return copy_index(an, eqn, value)  # [.., L, k] -> [.., L * k]: one index per (token, choice) copy
    elif isinstance(value, _RELABELLED):
        roles = reshaped_roles(value.roles, in_shape, out_shape)
        if roles is not None:  # token axes merged or split in order: the same values, their tokens renamed
            return replace(value, roles=roles)
    if isinstance(value, _RELABELLED) and _merges_token_axes(an, value.roles, in_shape, out_shape):
        an.token_axes_merged = True
        what = {ExpertIndex: "the routing indices", IndexInBounds: "the routing indices' range checks",
                Gate: "routing weights"}.get(type(value), "expert activations")
        return FailedMatch(f"{what} are reshaped {list(in_shape)} -> {list(out_shape)}, merging their token axes "
                           f"{list(an.token_shape)} in order (as x.reshape(B * S, d) does): read over one token axis "
                           "instead", eqn)
    if isinstance(value, ExpertIndex):
        return FailedMatch(
            f"the routing indices are reshaped {list(in_shape)} -> {list(out_shape)}, which neither merges or splits "
            "their token axes in order (row-major, as x.reshape(B * S, d) does) nor merges the last token axis with "
            "the choices ([.., L, k] -> [.., L * k]: copy n = token * k + choice): a one-hot, gather or scatter built "
            "from them after that is not followed, so no expert is known to be selected", eqn)
    if isinstance(value, (Rows, Combined, FusedRows)):
        return FailedMatch("a reshape regroups the axes of expert activations other than by merging or splitting "
                           "their token axes in order (row-major, as x.reshape(B * S, d) does)", eqn)
    return None


# the values whose token axes a reshape may merge or split (``reshaped_roles``)
_RELABELLED = (ExpertIndex, IndexInBounds, Gate, Rows, Combined)


def _merges_token_axes(an: Analysis, roles: Roles, in_shape, out_shape) -> bool:
    """The reshape, not a relabelling of these roles, is one were the routing's token axes parts of one
    token axis (``RoutingAnchor.over_one_token_axis``): it merges them in order."""
    if an.anchor.split_tokens or sum(n != 1 for n in an.token_shape) < 2:
        return False
    parts = dict(zip(token_roles(len(an.token_shape)), an.anchor.over_one_token_axis().index_token_roles()))
    renamed = tuple(parts.get(r, r) for r in roles)
    return reshaped_roles(renamed, in_shape, out_shape, (token_roles(1)[0], an.anchor.top_k)) is not None


def _merged_role(parts) -> str:
    """One axis of slot rows holding several (a token group's slots: ``[E, G, C, d] -> [E, G*C, d]``),
    named with each part's role and size, row-major, so that a later split can restore them."""
    return "(" + ",".join(f"{role}={size}" for role, size in parts) + ")"


def _merged_parts(role: str) -> list | None:
    if not role.startswith("("):
        return None
    return [(name, int(size)) for name, size in (part.rsplit("=", 1) for part in role[1:-1].split(","))]


def _unsplit(atoms) -> str | None:
    """``role`` if ``atoms`` are all parts of one split of ``role``, in order; else None."""
    bases = {name.split("#")[0] for name, _ in atoms}
    if len(bases) != 1 or not all("#" in name for name, _ in atoms):
        return None
    base = bases.pop()
    factors = atoms[0][0].split("/")[1]
    expected = [token_part(base, i, tuple(int(f) for f in factors.split("x"))) for i in range(len(atoms))]
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
            taken.append((token_part(role, 0, factors), rest))
            atoms[position] = (token_part(role, 1, factors), atom_size // rest)
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
    if isinstance(value, FusedRows):
        return FailedMatch(PARTS_NOT_TAKEN_APART, eqn)
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
    if isinstance(value, FusedRows):
        if len(changed) != 1:
            return FailedMatch(PARTS_NOT_TAKEN_APART, eqn) if changed else value
        axis = changed[0]
        indices = range(starts[axis], in_shape[axis], strides[axis])[:out_shape[axis]]
        return _parts_taken(value, axis, indices, eqn)
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
    """``jnp.split`` of a fused gate/up projection along the features, or of a fused weight's products
    into its parts."""
    value = abstracts[0]
    axis = eqn.params["axis"]
    if isinstance(value, FusedRows):
        pieces, start = [], 0
        for size in eqn.params["sizes"]:
            pieces.append(_parts_taken(value, axis, range(start, start + size), eqn))
            start += size
        failed = next((p for p in pieces if isinstance(p, FailedMatch)), None)
        return failed or tuple(pieces)
    if not isinstance(value, Rows):
        return None
    if value.roles[axis] != FEATURE or value.gate is not None:
        return FailedMatch("expert activations are split along a token or expert axis", eqn)
    pieces, start = [], 0
    for size in eqn.params["sizes"]:
        pieces.append(replace(value, node=FeatureSlice(value.node, start, start + size)))
        start += size
    return tuple(pieces)


@rule(*[p for p in (_compat.unstack_p,) if p is not None])
def _unstack(an: Analysis, eqn: Eqn, abstracts):
    """``x1, x2 = h`` (JAX 0.11+: one primitive): a fused weight's products taken apart into its parts."""
    value = abstracts[0]
    axis = eqn.params["axis"]
    if isinstance(value, FusedRows):
        pieces = [_parts_taken(value, axis, (i,), eqn) for i in range(eqn.inputs[0].shape[axis])]
        failed = next((p for p in pieces if isinstance(p, FailedMatch)), None)
        return failed or tuple(replace(p, roles=p.roles[:axis] + p.roles[axis + 1:]) for p in pieces)
    if isinstance(value, (Rows, Combined)):
        return FailedMatch("expert activations are unstacked (x1, x2 = h) along an axis that is not the parts of a "
                           "fused weight", eqn)
    return None


PARTS_NOT_TAKEN_APART = ("the products with a weight that fuses several projections along an axis of its own "
                          "([E, 2, f, d]: gate and up) are used before they are taken apart (x1, x2 = h; h[0], h[1])")


def _parts_taken(value: FusedRows, axis: int, indices, eqn: Eqn):
    """The parts ``indices`` along ``axis`` of a fused weight's products: one part's rows (a unit axis where
    the parts were), or fewer parts still fused."""
    if value.roles[axis] != PART:
        return FailedMatch(PARTS_NOT_TAKEN_APART, eqn)
    parts = tuple(value.parts[i] for i in indices)
    if len(parts) == 1:
        return replace(parts[0], roles=value.roles[:axis] + (ONE,) + value.roles[axis + 1:])
    return replace(value, parts=parts)


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
