"""Rules that recognise the expert rows' own computation: elementwise steps on expert activations
(recorded as the expert program, with biases as per-expert params), the routing weights applied to
them, the per-expert loop's contributions summed, a gather of the chosen experts' rows (by the
indices, or by (expert, token) pairs), per-token gathered expert weights (``W[idx]``), and
elementwise ``custom_jvp`` functions replayed with their own derivative rule. Also: the tokens
gated or masked per expert before the experts (``_gated_tokens``, with the zero-row proofs of
``_gated_sum``), and experts kept as separate modules (``separate_expert_weights`` seeds their
weights as slices of one ``StackedWeights``).
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moe_lowering import _compat
from moe_lowering.expert_program import (
    CustomJvpCall,
    Elementwise,
    ExpertMatmul,
    FeatureConcat,
    FeatureSlice,
    Literal,
    ParamKind,
    ParamRef,
    RowInput,
    custom_jvp_function,
    custom_jvp_node,
    replay_elementwise,
)
from moe_lowering.passes.abstract import (
    BROADCAST,
    CHOICE,
    COPY,
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
    PackedIndices,
    Rows,
    StackedWeights,
    is_token,
    token_roles,
)
from moe_lowering.passes.assumptions import GATE_ON_TOKENS, ONE_HOT_DISPATCH
from moe_lowering.passes.canonicalize import _params_tuple, identity_annotations
from moe_lowering.passes.graph import Const, Eqn, Value
from moe_lowering.passes.match_core import (
    _ELEMENTWISE,
    Analysis,
    FailedMatch,
    _broadcast_source,
    _compatible,
    _is_scalar,
    _is_zero,
    _plain_roles,
    _register_rules,
    _rows_like,
    rule,
)
from moe_lowering.passes.rules_copies import before_selection
from moe_lowering.passes.rules_sort import involves_sorted_dispatch, sorted_gather


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
    if first.style == GATE_ON_TOKENS:
        if isinstance(first.node, RowInput):
            return _step_before_first_product(eqn)
    elif first.gate is not None or any(r.gate is not None for r in rows):
        if prim is lax.convert_element_type_p:
            source = eqn.inputs[0].dtype
            if not (jnp.issubdtype(source, jnp.floating) and jnp.issubdtype(out.dtype, jnp.floating)
                    and jnp.finfo(out.dtype).nmant >= jnp.finfo(source).nmant
                    and jnp.finfo(out.dtype).maxexp >= jnp.finfo(source).maxexp):
                # a cast to an integer, a bool or a narrower float rounds each expert's weighted rows before
                # their sum, which the rewrite (weights applied once, to the rows' sum) cannot reproduce
                return FailedMatch(f"weighted expert activations are cast from {source} to {out.dtype}; only a "
                                   "widening float cast may follow the routing weights", eqn, "linear-after-gate")
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
            if COPY in roles:
                return FailedMatch("expert activations on the tokens' tiled copies meet a tensor with an axis along "
                                   "the copies (a per-copy value is not a parameter of the expert program; routing "
                                   "weights are read once the copies are split back into (token, choice))", eqn)
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


def _gated_tokens(an: Analysis, gate: Gate, gate_atom, atom, out) -> Rows | None:
    """``x[t.., None, :] * G[t.., E, None]`` (``repeat(x[:, None], E, 1) * G[..., None]``): the tokens,
    broadcast along the experts, scaled by the ``[tokens, E]`` routing weights before any expert
    product. Rows of every (token, expert) pair whose input is the gated token (``GATE_ON_TOKENS``);
    ``None`` if ``atom`` is not the tokens broadcast along the gate's expert axis."""
    if gate.boolean or gate.expert is not None or CHOICE in gate.roles or EXPERT not in gate.roles:
        return None
    source, mapping = _unit_view(an.graph, atom)
    tokens = token_roles(len(an.token_shape))
    if not isinstance(source, Value) or tuple(source.shape[:-1]) != tuple(an.token_shape):
        return None
    roles = [None] * len(out.shape)
    for dim, out_dim in enumerate(mapping):
        if out_dim is None:
            continue
        roles[out_dim] = FEATURE if dim == len(source.shape) - 1 else tokens[dim]
    if mapping[-1] is None or gate.roles[mapping[-1]] not in (ONE, BROADCAST):
        return None
    for d, role in enumerate(roles):
        if role is None:
            roles[d] = EXPERT if gate.roles[d] == EXPERT else ONE
        if roles[d] == ONE and out.shape[d] != 1:
            return None
    roles = tuple(roles)
    if EXPERT not in roles or not _compatible(gate.roles, roles) or any(
            is_token(g) and g != r for g, r in zip(gate.roles, roles)):
        return None
    return gated_token_rows(roles, source, gate, gate_atom)


def gated_token_rows(roles, tokens, gate: Gate, gate_atom) -> Rows:
    """The tokens times a ``[tokens, E]`` gate, as rows: routing weights (``GATE_ON_TOKENS``, the weight
    carried into the rows), or a bare one-hot mask, 1 at the chosen experts (``ONE_HOT_DISPATCH``: the rows
    are the tokens themselves, the weights come at the combine)."""
    if not gate.factors:
        return Rows(roles, RowInput(), "dense", tokens, style=ONE_HOT_DISPATCH)
    return Rows(roles, RowInput(), "dense", tokens, gate=gate, gate_value=GateValue(gate_atom, gate.roles),
                style=GATE_ON_TOKENS)


def _unit_view(graph, atom) -> tuple:
    """The value ``atom`` is a broadcast of (through broadcasts, reshapes that add or drop unit axes and
    annotations), and for each of that value's dims the dim of ``atom`` it became (None: a unit dim dropped)."""
    mapping = list(range(len(atom.shape)))
    while isinstance(atom, Value):
        eqn = graph.producer.get(atom)
        if eqn is None:
            break
        source = eqn.inputs[0]
        if eqn.primitive in identity_annotations():
            inner = list(range(len(source.shape)))
        elif eqn.primitive is lax.broadcast_in_dim_p:
            inner = list(eqn.params["broadcast_dimensions"])
        elif eqn.primitive is lax.reshape_p and _unit_map(source.shape, atom.shape) is not None:
            inner = _unit_map(source.shape, atom.shape)
        elif eqn.primitive is lax.reduce_sum_p and all(source.shape[a] == 1 for a in eqn.params["axes"]):
            inner = _unit_map(source.shape, atom.shape)  # a sum over unit axes drops them
        else:
            break
        mapping = [None if d is None else mapping[d] for d in inner]
        atom = source
    return atom, mapping


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


def _unit_map(in_shape, out_shape) -> list | None:
    """``_unit_reshape`` the other way: each input dim's output dim (None: a unit dim dropped)."""
    forward = _unit_reshape(in_shape, out_shape)
    if forward is None:
        return None
    mapping: list = [None] * len(in_shape)
    for out_dim, in_dim in enumerate(forward):
        if in_dim is not None:
            mapping[in_dim] = out_dim
    return mapping


def _step_before_first_product(eqn: Eqn) -> FailedMatch:
    return FailedMatch(
        f"the routing weights scale the tokens (x * G[t, e]) and `{eqn.primitive}` follows before any product with "
        "an expert weight: the weight cannot be carried into the sorted rows of a layer whose experts do not "
        "begin with their weight", eqn, "gate-moves-into-rows")


def _gated_sum(rows: Rows, roles, eqn: Eqn):
    """The layer output from gated rows summed over the experts (or choices): ``Combined``, or for rows
    of gated tokens, where every unrouted expert ran on a zero row, why that sum is not the routed one."""
    if rows.style == GATE_ON_TOKENS:
        unknown = _nonzero_on_zero_rows(rows.node, rows.tokens.dtype)
        if unknown is not None:
            return FailedMatch(
                "the routing weights scale the tokens, so every expert also runs on the zero rows of the experts a "
                f"token did not choose, and the dense layer sums those outputs too; the expert program is not "
                f"provably zero, with a finite derivative, on a zero row ({unknown})", eqn, "unrouted-experts-vanish")
    if rows.style == ONE_HOT_DISPATCH:
        unknown = _nonzero_on_zero_rows(rows.node, rows.tokens.dtype, need_zero=False)
        if unknown is not None:
            return FailedMatch(
                "the tokens are masked per expert (a one-hot dispatch), so every expert also runs on the zero rows of "
                "the experts a token did not choose, whose outputs the gate multiplies by zero; the expert program is "
                f"not provably finite, with a finite derivative, on a zero row ({unknown})", eqn,
                "unrouted-experts-finite")
    return Combined(roles, rows.node, rows.tokens, rows.gate, style=_style(rows), gate_values=(rows.gate_value,))


def _style(rows: Rows) -> str:
    return rows.style or {"dense": "one-hot gate", "choice": "gather combine", "single": "per-expert loop", "slot": "capacity"}[
        rows.space
    ]


def _nonzero_on_zero_rows(output, dtype, need_zero: bool = True) -> str | None:
    """``None`` if the program ``output`` gives exactly zero (``need_zero``; else any finite value) on a zero
    row, every step finite there with finite partial derivatives (so a zero tangent stays zero); else what
    is not known to."""
    values: dict = {}

    def value(node):  # a [1]-shaped array, or None where it depends on a weight or bias
        if isinstance(node, Literal):
            return jnp.asarray(node.value)
        if isinstance(node, ParamRef):
            return None
        if id(node) not in values:
            values[id(node)] = evaluate(node)
        return values[id(node)]

    def evaluate(node):
        if isinstance(node, RowInput):
            return jnp.zeros((1,), dtype)
        if isinstance(node, ExpertMatmul):
            source = value(node.source)
            zero = source is not None and not np.any(source)
            return jnp.zeros((1,), node.preferred_element_type or source.dtype) if zero else None
        if isinstance(node, FeatureSlice):
            return value(node.source)
        if isinstance(node, FeatureConcat):
            parts = [value(s) for s in node.sources]
            return parts[0] if all(p is not None and not np.any(p) for p in parts) else None
        operands = [value(o) for o in node.operands]
        is_mul = isinstance(node, Elementwise) and node.primitive is lax.mul_p
        if any(o is None for o in operands):  # a weight or bias times zero is zero (weights are finite)
            zero = next((o for o in operands if o is not None and not np.any(o)), None)
            return jnp.zeros((1,), zero.dtype) if is_mul and zero is not None else None
        fn = custom_jvp_function(node) if isinstance(node, CustomJvpCall) else (
            lambda *args: node.primitive.bind(*args, **dict(node.params)))
        try:
            out = fn(*operands)
            for i, operand in enumerate(operands):
                if not jnp.issubdtype(operand.dtype, jnp.inexact):
                    continue
                tangents = [jnp.zeros_like(o) if j != i else jnp.ones_like(o) for j, o in enumerate(operands)
                            if jnp.issubdtype(o.dtype, jnp.inexact)]
                inexact = [o for o in operands if jnp.issubdtype(o.dtype, jnp.inexact)]
                _, partial = jax.jvp(lambda *f: fn(*_fill(operands, f)), inexact, tangents)
                if not np.all(np.isfinite(partial)):
                    return None
        except Exception:  # a step that cannot be evaluated on its own: not known to vanish
            return None
        return out if np.all(np.isfinite(out)) else None

    with jax.ensure_compile_time_eval():  # matching runs under the user's trace: evaluate now, on concrete zeros
        out = value(output)
        out = None if out is None else np.asarray(out)
    if out is None or (need_zero and np.any(out)):
        return "a bias, a per-expert value or a step that is not finite there" if out is None else (
            f"it gives {np.asarray(out).reshape(-1)[0]}")
    return None


def _fill(operands, inexact):
    """``operands`` with its inexact entries replaced, in order, by ``inexact``."""
    it = iter(inexact)
    return [next(it) if jnp.issubdtype(o.dtype, jnp.inexact) else o for o in operands]


def separate_expert_weights(an: Analysis) -> dict:
    """Experts kept as E separate modules: E computations of one shape, stacked (``jnp.stack``), each
    reading weights of its own. Each such weight becomes expert ``e``'s slice of one ``StackedWeights``
    (``w[e]``, as the loop style reads a stacked weight), so the expert rules follow the computations
    and the stack rule checks they are one program. Values every piece shares (the tokens) stay plain."""
    graph = an.graph
    seeds: dict = {}
    for eqn in graph.eqns:
        pieces = _stack_pieces(eqn)
        if len(pieces) != an.num_experts or an.num_experts < 2:
            continue
        leaves = [_leaf_inputs(graph, piece) for piece in pieces]
        if len({len(found) for found in leaves}) != 1:
            continue
        for column in zip(*leaves):
            if all(v is column[0] for v in column):
                continue  # shared by every expert: the tokens, a constant
            distinct = len({id(v) for v in column}) == len(column) and not any(v in seeds for v in column)
            if not distinct or any(v.shape != column[0].shape or v.dtype != column[0].dtype for v in column):
                continue
            stacked = StackedWeights(tuple(column))
            for expert, value in enumerate(column):
                seeds[value] = ExpertParamSlice(stacked, 0, expert, tuple(range(1, len(value.shape) + 1)))
    return seeds


def _stack_pieces(eqn: Eqn) -> tuple:
    """The values ``eqn`` stacks along a new axis: a ``stack``, or a concatenate of unit-axis pieces."""
    if _compat.stack_p is not None and eqn.primitive is _compat.stack_p:
        return tuple(eqn.inputs)
    if eqn.primitive is lax.concatenate_p and all(
            isinstance(a, Value) and a.shape[eqn.params["dimension"]] == 1 for a in eqn.inputs):
        return tuple(eqn.inputs)
    return ()


def _leaf_inputs(graph, value) -> list:
    """The program inputs ``value`` is computed from, in the order a depth-first walk meets them."""
    leaves, seen, stack = [], set(), [value]
    while stack:
        atom = stack.pop()
        if not isinstance(atom, Value) or atom in seen:
            continue
        seen.add(atom)
        eqn = graph.producer.get(atom)
        if eqn is None:
            leaves.append(atom)
        else:
            stack.extend(reversed(eqn.inputs))
    return leaves


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


@rule(lax.gather_p)
def _gather(an: Analysis, eqn: Eqn, abstracts):
    """``take_along_axis(expert_out[T, E, D], idx[..., None], axis=1)``: pick the chosen experts."""
    rows, index = abstracts[0], abstracts[1]
    if involves_sorted_dispatch(abstracts[:2]):  # the sorted copies' tokens, or their outputs un-sorted
        return sorted_gather(an, eqn, abstracts)
    if rows is None and isinstance(index, ExpertIndex):
        return _gathered_weight(an, eqn, index)
    if rows is None and isinstance(index, PackedIndices) and EXPERT in index.components:
        return FailedMatch(
            f"a gather by the routing indices and the token positions reads a {list(eqn.inputs[0].shape)} value that is "
            "not known as expert outputs: it is not computed by products of the tokens with one weight of expert "
            f"axis E={an.num_experts} (or its w[e] slices); experts kept as separate weight arrays and stacked after "
            "their products are not recognised", eqn)
    if not isinstance(rows, Rows):
        return None
    if rows.space == "dense" and rows.gate is None and isinstance(index, PackedIndices):
        return _gather_by_expert_and_token(eqn, rows, index)
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
    return Rows(tuple(roles), rows.node, "choice", rows.tokens, style=rows.style)


def _gather_by_expert_and_token(eqn: Eqn, rows: Rows, index: PackedIndices):
    """``outs[idx, arange(T)[:, None], :]`` of rows ``[E, T, D]``: each (token, choice) reads its own token's
    row of its chosen expert. Every expert and token axis of the rows is addressed by the index component
    of the same role (the routing indices, an iota over that token axis), the features are whole slices."""
    dnums = eqn.params["dimension_numbers"]
    start_map = tuple(dnums.start_index_map)
    addressed = [rows.roles[d] for d in start_map]
    whole = [d for d in range(len(rows.roles)) if d not in start_map]
    if (addressed != list(index.components) or sorted(dnums.collapsed_slice_dims) != sorted(start_map)
            or getattr(dnums, "operand_batching_dims", ()) or any(is_token(rows.roles[d]) for d in whole)):
        return FailedMatch("a gather of expert activations that does not read each token's own row of its "
                           "chosen expert", eqn)
    if any(eqn.params["slice_sizes"][d] != eqn.inputs[0].shape[d] for d in whole):
        return FailedMatch("a gather of partial expert activations", eqn)
    roles, batch, offsets = [], iter(index.roles), iter(whole)
    for d in range(len(eqn.outputs[0].shape)):
        roles.append(rows.roles[next(offsets)] if d in tuple(dnums.offset_dims) else next(batch))
    return Rows(tuple(roles), rows.node, "choice", rows.tokens, style=rows.style)


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


@rule(_compat.custom_jvp_call_p)
def _custom_jvp(an: Analysis, eqn: Eqn, abstracts):
    """An elementwise ``custom_jvp`` function (``relu``, a straight-through estimator) on expert
    activations: replayed on the sorted rows with its own derivative rule (``CustomJvpCall``)."""
    rows = [a for a in abstracts if isinstance(a, Rows)]
    if not rows:
        return None
    name = _compat.custom_jvp_name(eqn.params)
    first = rows[0]
    if any(before_selection(r) for r in rows):
        return FailedMatch(f"custom_jvp function `{name}` runs on every expert's output for every tiled copy before "
                           "each copy's own expert is selected, where the one-hot's 0 meets it (0 * inf is NaN): "
                           "not proven finite there (apply it after the selection)", eqn, "finite-before-selection")
    if first.style == GATE_ON_TOKENS and isinstance(first.node, RowInput):
        return _step_before_first_product(eqn)
    if any(not _rows_like(r, first) for r in rows) or (first.gate is not None and first.style != GATE_ON_TOKENS):
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
        elif eqn.primitive not in _ELEMENTWISE and eqn.primitive not in _compat.varying_casts:
            return False
    return True
