"""The bound on where a routing value's derivative can be non-zero (``passes/derivative_support.py``).

Unit tests check the bound against forward-mode derivatives: wherever the bound's indicator is
zero, every tangent is zero. Layer tests check GShard/praxis top-2, whose combine is a sum of outer
products ``einsum('GSE,GSC->GSEC', gate * one_hot(index), one_hot(position))``: rewritten on the
sparse path, exact, also when capacity drops first choices; and its mutants (a derivative that
leaks outside the slots) decline or stay exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_lowering.passes.derivative_support import derivative_support, support_indicator
from moe_lowering.passes.graph import Const, build_graph
from moe_lowering.testing.device_checks import capacity_fallbacks

from test_soundness import rewritten_exactly

G, S, E, C = 2, 6, 4, 3


def _bound_and_tangents(fn, *args):
    """The indicator of ``fn``'s output bound (``None`` if unproven) and the output's JVP for a few
    random tangents of every float input."""
    closed = jax.make_jaxpr(fn)(*args)
    graph = build_graph(closed)
    support = derivative_support(graph, graph.outputs[0])
    indicator = None
    if support is not None:
        env = dict(zip(graph.inputs, args))
        for eqn in graph.eqns:
            values = eqn.primitive.bind(*[a.value if isinstance(a, Const) else env[a] for a in eqn.inputs],
                                        **eqn.primitive.get_bind_params(eqn.params))
            env.update(zip(eqn.outputs, values if eqn.primitive.multiple_results else [values]))
        indicator = np.asarray(support_indicator(support, lambda a: a.value if isinstance(a, Const) else env[a]))
    tangents = []
    for seed in range(3):
        keys = jax.random.split(jax.random.key(seed), len(args))
        dots = [jax.random.normal(k, a.shape, a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else
                np.zeros(a.shape, jax.dtypes.float0) for k, a in zip(keys, args)]
        tangents.append(np.asarray(jax.jvp(fn, args, tuple(dots))[1]))
    return indicator, tangents


def _routing(seed=0):
    logits = jax.random.normal(jax.random.key(seed), (G, S, E))
    index = jnp.argmax(logits, -1)
    position = jax.random.randint(jax.random.key(seed + 1), (G, S), 0, C)
    return logits, index, position


def _assert_sound(indicator, tangents):
    assert indicator is not None
    for tangent in tangents:
        assert not np.any((indicator == 0) & (tangent != 0)), "a tangent outside the bound"


def test_outer_product_bound_is_the_chosen_slot():
    logits, index, position = _routing()
    keep = (jnp.arange(S) % 3 != 0).astype(jnp.float32)  # every third token dropped: its gate is masked

    def combine(logits):
        gate = jax.nn.softmax(logits)[..., 0] * keep
        a = gate[..., None] * jax.nn.one_hot(index, E)
        return jnp.einsum("GSE,GSC->GSEC", a, jax.nn.one_hot(position, C))

    indicator, tangents = _bound_and_tangents(combine, logits)
    _assert_sound(indicator, tangents)
    slot = np.asarray(jnp.einsum("GSE,GSC->GSEC", jax.nn.one_hot(index, E), jax.nn.one_hot(position, C)))
    expected = slot * np.asarray(keep)[None, :, None, None]
    np.testing.assert_array_equal(indicator != 0, expected != 0)  # products intersect: dropped tokens have none


def test_sums_unite_selects_pick_and_slices_move():
    logits, index, position = _routing()
    second = (index + 1) % E

    def combine(logits):
        gates = jax.nn.softmax(logits)
        first = jnp.einsum("GSE,GSC->GSEC", gates * jax.nn.one_hot(index, E), jax.nn.one_hot(position, C))
        other = jnp.einsum("GSE,GSC->GSEC", gates * jax.nn.one_hot(second, E),
                           jax.nn.one_hot(position + 1, C + 1)[..., 1:])
        both = first + other
        return jnp.where(position[..., None, None] < C - 1, both, 0.0)

    indicator, tangents = _bound_and_tangents(combine, logits)
    _assert_sound(indicator, tangents)
    assert 0 < np.count_nonzero(indicator) < indicator.size


@pytest.mark.parametrize("leak", ["product_of_two_varying", "unknown_op", "sum_with_unbounded", "all_ones_factor"])
def test_a_derivative_off_the_chosen_expert_is_never_bounded_inside_it(leak):
    """Where the derivative reaches other experts, the bound says so (the device check then falls
    back) or there is none (the pass declines); it is never the chosen slot alone. (The outer
    product's derivative-free factor still confines it to the token's slot position.)"""
    logits, index, position = _routing()

    def combine(logits):
        gates = jax.nn.softmax(logits)
        mask = jax.nn.one_hot(index, E)
        if leak == "product_of_two_varying":
            a = gates * gates
        elif leak == "unknown_op":
            a = jnp.exp(gates * mask)
        elif leak == "sum_with_unbounded":
            a = gates * mask + 1e-3 * gates
        else:
            a = gates * jnp.ones((E,))
        return jnp.einsum("GSE,GSC->GSEC", a, jax.nn.one_hot(position, C))

    indicator, tangents = _bound_and_tangents(combine, logits)
    if indicator is not None:
        _assert_sound(indicator, tangents)
        slot = np.asarray(jnp.einsum("GSE,GSC->GSEC", jax.nn.one_hot(index, E), jax.nn.one_hot(position, C)))
        assert np.any((indicator != 0) & (slot == 0))


def test_a_contraction_sums_the_bounds():
    logits, index, _ = _routing()
    table = (jax.random.uniform(jax.random.key(3), (E, C)) < 0.4).astype(jnp.float32)

    def combine(logits):
        return jnp.einsum("GSE,EC->GSC", jax.nn.softmax(logits) * jax.nn.one_hot(index, E), table)

    indicator, tangents = _bound_and_tangents(combine, logits)
    _assert_sound(indicator, tangents)


def _straight_through(v):
    return v - jax.lax.stop_gradient(v)


def _minus_identity_contraction(v):
    return jnp.einsum("GSEC,CD->GSED", v, -jnp.eye(C))


# Each adds to a one-slot combine a term of value zero whose derivative lives on the other slots,
# written so that a signed bound (neg replayed, sub subtracted, a coefficient's sign or size kept)
# would cancel it to zero there.
CANCELLING_TERMS = {
    "neg_of_twice_minus_stop": lambda off, q, r: off * q + (-(off * (2 * q - jax.lax.stop_gradient(q)))),
    "straight_through_pair": lambda off, q, r: off * _straight_through(q) + (-(off * _straight_through(r))),
    "sub_of_equal_bounds": lambda off, q, r: off * (2 * _straight_through(q)) - off * _straight_through(q),
    "times_minus_one": lambda off, q, r: off * _straight_through(q) + -1.0 * (off * _straight_through(r)),
    "tiny_coefficient": lambda off, q, r: off * _straight_through(q) + 1e-30 * (off * _straight_through(r)),
    "negative_contraction": lambda off, q, r: (off * _straight_through(q)
                                               + _minus_identity_contraction(off * _straight_through(r))),
    "select_of_negated": lambda off, q, r: off * _straight_through(q) + jnp.where(
        off > 0, -(off * _straight_through(r)), 0.0),
}


@pytest.mark.parametrize("term", list(CANCELLING_TERMS))
def test_a_derivative_written_to_cancel_is_bounded_where_it_is(term):
    """The bound is unsigned: ``neg``, ``sub`` and ``add`` unite supports, a coefficient enters as
    ``!= 0``, and every indicator is 0 or 1 (issue 38: ``neg`` replayed cancelled under ``add``)."""
    logits, index, position = _routing()
    slot = jnp.einsum("GSE,GSC->GSEC", jax.nn.one_hot(index, E), jax.nn.one_hot(position, C))

    def combine(logits):
        probs = jax.nn.softmax(logits)
        gate = jnp.sum(probs * jax.nn.one_hot(index, E), -1)
        q = jnp.broadcast_to(probs[..., None], slot.shape)
        r = jnp.roll(q, 1, axis=-2)
        return slot * gate[..., None, None] + CANCELLING_TERMS[term](1 - slot, q, r)

    indicator, tangents = _bound_and_tangents(combine, logits)
    _assert_sound(indicator, tangents)
    assert set(np.unique(indicator)) <= {0.0, 1.0}
    assert all(np.any((t != 0) & (np.asarray(slot) == 0)) for t in tangents)  # there is a derivative to bound


def test_a_long_chain_of_contractions_stays_an_indicator():
    """Sums of indicators are clamped to 1: thirty contractions over 64 entries do not overflow to
    ``inf`` (and then to NaN under a zero coefficient), where the program's own values stay finite."""
    mean = jnp.full((64, 64), 1 / 64)

    def chain(v):
        for _ in range(30):
            v = v @ mean
        return v * jnp.zeros((64,)).at[0].set(1.0)

    indicator, tangents = _bound_and_tangents(chain, jnp.ones((2, 64)))
    _assert_sound(indicator, tangents)
    np.testing.assert_array_equal(indicator, np.broadcast_to(np.arange(64) == 0, (2, 64)).astype(np.float32))


# --------------------------------------------------------------------------- praxis / GShard top-2


def _params(key, d=8, h=16):
    k = jax.random.split(key, 3)
    return {"gate": jax.random.normal(k[0], (d, E)), "wi": jax.random.normal(k[1], (E, d, h)) / np.sqrt(d),
            "wo": jax.random.normal(k[2], (E, h, d)) / np.sqrt(h)}


def _gshard_top2(capacity, variant=None):
    """GShard top-2 as praxis writes it: combine as a sum of two outer products, dispatch = combine != 0."""

    def layer(params, x):
        logits = jnp.einsum("gsm,me->gse", x, params["gate"])
        raw_gates = jax.nn.softmax(logits, axis=-1)
        index_1 = jnp.argmax(raw_gates, axis=-1)
        mask_1 = jax.nn.one_hot(index_1, E, dtype=jnp.int32)
        gate_1 = jnp.einsum("GSE,GSE->GS", raw_gates, mask_1.astype(raw_gates.dtype))
        without_1 = raw_gates * (1.0 - mask_1.astype(raw_gates.dtype))
        index_2 = jnp.argmax(without_1, axis=-1)
        mask_2 = jax.nn.one_hot(index_2, E, dtype=jnp.int32)
        gate_2 = jnp.einsum("GSE,GSE->GS", without_1, mask_2.astype(without_1.dtype))
        denom = gate_1 + gate_2 + 1e-9
        gate_1, gate_2 = gate_1 / denom, gate_2 / denom
        position_1 = jnp.cumsum(mask_1, axis=-2) - mask_1
        mask_1 = mask_1 * (position_1 < capacity).astype(mask_1.dtype)
        position_1 = jnp.einsum("GSE,GSE->GS", position_1, mask_1)
        count_1 = jnp.einsum("GSE->GE", mask_1)
        position_2 = jnp.cumsum(mask_2, axis=-2) - mask_2 + count_1[:, None, :]
        mask_2 = mask_2 * (position_2 < capacity).astype(mask_2.dtype)
        position_2 = jnp.einsum("GSE,GSE->GS", position_2, mask_2)
        kept_1 = jnp.sum(mask_1, axis=-1).astype(jnp.float32)
        kept_2 = jnp.sum(mask_2, axis=-1).astype(jnp.float32)
        if variant == "gate_not_masked":  # a dropped choice keeps its gate: its derivative leaks into slot 0
            kept_1 = jnp.ones_like(kept_1)
        a_1 = (gate_1 * kept_1)[..., None] * jax.nn.one_hot(index_1, E)
        if variant == "gate_over_all_experts":  # the gate is not confined to the chosen expert
            a_1 = (gate_1 * kept_1)[..., None] * jnp.ones((E,))
        a_2 = (gate_2 * kept_2)[..., None] * jax.nn.one_hot(index_2, E)
        combine = (jnp.einsum("GSE,GSC->GSEC", a_1, jax.nn.one_hot(position_1, capacity))
                   + jnp.einsum("GSE,GSC->GSEC", a_2, jax.nn.one_hot(position_2, capacity)))
        if variant == "straight_through":  # same values, a derivative on every slot
            soft = jnp.einsum("GSE,GSC->GSEC", raw_gates, jnp.ones((G, S, capacity)) / capacity)
            combine = combine + soft - jax.lax.stop_gradient(soft)
        dispatch = combine.astype(bool).astype(jnp.float32)
        expert_in = jnp.einsum("gsec,gsm->egcm", dispatch, x)
        hidden = jax.nn.relu(jnp.einsum("egcm,emh->egch", expert_in, params["wi"]))
        expert_out = jnp.einsum("egch,ehm->egcm", hidden, params["wo"])
        return jnp.einsum("gecm,gsec->gsm", jnp.einsum("egcm->gecm", expert_out), combine)

    return layer


@pytest.mark.parametrize("capacity", [2, 4], ids=["first-choices-dropped", "second-choices-dropped"])
def test_gshard_top2_outer_product_combine_is_rewritten_on_its_sparse_path(capacity):
    params, x = _params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (G, S, 8))
    layer = _gshard_top2(capacity)
    assert rewritten_exactly(layer, params, x)
    assert capacity_fallbacks(layer, params, x) == [False]


@pytest.mark.parametrize("variant", ["gate_not_masked", "gate_over_all_experts", "straight_through"])
def test_gshard_top2_combines_whose_derivative_leaks_decline_or_fall_back(variant):
    params, x = _params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (G, S, 8))
    layer = _gshard_top2(2, variant)
    if rewritten_exactly(layer, params, x):  # rewritten: the device check must have sent it to the dense layer
        assert capacity_fallbacks(layer, params, x) == [True]
