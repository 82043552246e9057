"""Training steps under ``jax.checkpoint``: the backward recomputes the layer's dense forward inside
its remat body; the remat is inlined and the recomputation merged with the forward, so the layer's
forward and backward are rewritten as in a plain step (``rewrite.analyse_program``).

Each step is compared with the undecorated step: the loss and every gradient, float32 tight, and
no dense ``[T, E, F]`` value may be left in the rewritten jaxpr.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from moe_lowering import NoMoeFoundWarning, _compat, explain, moe_optimize
from moe_lowering.passes.graph import Const, build_graph
from moe_lowering.testing import mutate, zoo
from test_train_step import MIXTRAL, SIZES, _assert_close, _check_rewritten, _relative_error


def _remat_step(policy):
    layer = jax.checkpoint(MIXTRAL.fn, policy=policy)
    return jax.value_and_grad(lambda p, x: jnp.mean(jnp.sin(layer(p, x)) ** 2), argnums=(0, 1))


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable],
                         ids=["no_policy", "nothing_saveable"])
def test_value_and_grad_under_checkpoint_rewrites_the_recomputing_backward(policy):
    params, x = MIXTRAL.args(jax.random.key(0))
    report = _check_rewritten(_remat_step(policy), params, x)
    assert report.regions[0].remat_inlined and "jax.checkpoint inlined" in str(report)


def test_the_step_under_jit_and_checkpoint():
    params, x = MIXTRAL.args(jax.random.key(2))
    _check_rewritten(jax.jit(_remat_step(None)), params, x)


def test_two_checkpointed_residual_blocks_sharing_weights():
    """MaxText's shape: each block (a norm, the layer, a residual add) under its own jax.checkpoint."""
    params, x = MIXTRAL.args(jax.random.key(3))

    def block(p, x):
        return x + MIXTRAL.fn(p, jnp.tanh(x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)))

    def loss(p, x):
        return jnp.mean(jnp.sin(jax.checkpoint(block)(p, jax.checkpoint(block)(p, x))) ** 2)

    report = _check_rewritten(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x, regions=2)
    assert all(r.remat_inlined for r in report.regions)


_NAMES = ("mlpwi_0", "mlpwi_1", "mlpwo")  # mixtral_annotated's checkpoint_name on its three expert activations
_SAVING = {
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "checkpoint_dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_only_these_names": jax.checkpoint_policies.save_only_these_names(*_NAMES),
    "save_and_offload_only_these_names": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=_NAMES[:1], names_which_can_be_offloaded=_NAMES[1:], offload_src="device",
        offload_dst="pinned_host"),
}


def _annotated():
    return zoo.ZOO["mixtral_annotated"].sized(T=SIZES.T, d=SIZES.d, f=SIZES.f, E=SIZES.E, k=SIZES.k)


@pytest.mark.parametrize("policy", list(_SAVING))
def test_a_remat_that_saves_the_expert_activations(policy):
    """A policy saving the layer's dots (or its named activations) returns them from the forward as residuals,
    marked by a ``reduce_precision`` to their own type (an offloaded one moved to host memory and back), and
    the backward's remat reads them: seen through and merged, they are read by the layer's own derivative
    only, so the step is rewritten and no saved dense [T, E, F] value is left (the sparse VJP's own residuals
    take their place)."""
    model = _annotated() if "names" in policy else MIXTRAL
    params, x = model.args(jax.random.key(5))
    layer = jax.checkpoint(model.fn, policy=_SAVING[policy])
    step = jax.value_and_grad(lambda p, x: jnp.mean(jnp.sin(layer(p, x)) ** 2), argnums=(0, 1))
    report = _check_rewritten(step, params, x)
    assert report.regions[0].remat_inlined


def test_a_saved_activation_also_read_by_the_loss_is_declined_with_its_reason():
    """An activation penalty on the up projection, which dots_saveable saves: the saved value is read by the
    penalty's derivative too, not by the layer's alone, so the step runs as written and explain says why."""
    model = _annotated()
    params, x = model.args(jax.random.key(0))

    def block(p, x):
        up = jnp.einsum("td,edf->tef", x, p["w_up"])
        return model.fn(p, x), jnp.mean(jax.nn.relu(up))

    layer = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_saveable)

    def loss(p, x):
        out, penalty = layer(p, x)
        return jnp.mean(jnp.sin(out) ** 2) + 0.1 * penalty

    step = jax.value_and_grad(loss, argnums=(0, 1))
    report = explain(step, params, x)
    assert not any(r.backward for r in report.regions)
    assert any("used outside it" in m.reason for m in report.near_misses), str(report)
    with pytest.warns(NoMoeFoundWarning, match="used outside it"):
        _assert_close(step(params, x), moe_optimize(step)(params, x), 1e-5)


def assert_bfloat16_as_close_as_the_dense_step(step, *args):
    """``step`` rewritten on ``args`` cast to bf16, against the float32 step on the same values: within 2e-2,
    or no worse than twice the dense bf16 step's error."""
    low = jax.tree.map(lambda a: a.astype(jnp.bfloat16), args)
    report = explain(step, *low)
    assert report.regions and report.regions[0].backward, str(report)
    exact = step(*jax.tree.map(lambda a: a.astype(jnp.float32), low))
    dense, rewritten = step(*low), moe_optimize(step, strict=True)(*low)
    for want, base, got in zip(*map(jax.tree.leaves, (exact, dense, rewritten)), strict=True):
        assert got.dtype == base.dtype
        assert _relative_error(want, got) < max(2e-2, 2 * _relative_error(want, base))


def test_bfloat16_remat_that_saves_the_dots_as_close_to_float32_as_the_dense_step():
    assert_bfloat16_as_close_as_the_dense_step(_remat_step(jax.checkpoint_policies.dots_saveable),
                                               *MIXTRAL.args(jax.random.key(6)))


# --------------------------------------------------------------------------- mutants of the saving step

def _evaluate(graph, args, mutation=None):
    """``graph`` evaluated with ``bind``; ``mutation = (eqn index, change(eqn, inputs, env) -> outputs)``."""
    env = dict(zip(graph.inputs, args))

    def read(atom):
        return atom.value if isinstance(atom, Const) else env[atom]

    for eqn in graph.eqns:
        inputs = [read(a) for a in eqn.inputs]
        if mutation is not None and eqn.index == mutation[0]:
            outputs = mutation[1](eqn, inputs, env)
        else:
            outputs = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(eqn.params))
            outputs = outputs if eqn.primitive.multiple_results else [outputs]
        env.update(zip(eqn.outputs, outputs))
    return [read(a) for a in graph.outputs]


def _saving_step():
    params, x = MIXTRAL.args(jax.random.key(8))
    flat = jax.tree.leaves((params, x))
    step = _remat_step(jax.checkpoint_policies.dots_saveable)
    graph = build_graph(jax.make_jaxpr(lambda *a: step(*jax.tree.unflatten(jax.tree.structure((params, x)), a)))(
        *flat))
    remat = next(e for e in graph.eqns if e.primitive is _compat.remat_p)
    return graph, remat, flat


def _in_the_backward(remat, body, body_index, change):
    """A mutation of the remat's ``body`` (the backward) at ``body_index``: re-bound under the same policy."""

    def rebound(eqn, inputs, env):
        return _compat.remat_wrapper(remat.params)(lambda *a: _evaluate(body, a, (body_index, change)))(*inputs)

    return remat.index, rebound


def _outcome(graph, flat, mutation) -> str:
    def mutant(*args):
        return _evaluate(graph, args, mutation)

    if not any(r.backward for r in explain(mutant, *flat).regions):
        return "declined"
    _assert_close(mutant(*flat), moe_optimize(mutant)(*flat), 1e-5)
    return "exact"


def _bound(eqn, inputs):
    out = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(eqn.params))
    return out if eqn.primitive.multiple_results else [out]


def _dense(shape) -> bool:
    return tuple(shape) == (SIZES.T, SIZES.E, SIZES.f)


@pytest.mark.parametrize("factor", [1, 2])
def test_a_scaled_gate_cotangent_in_the_backward_of_a_saving_remat_declines(factor):
    """Scaled by 2: declined. Re-bound unchanged (1): rewritten, exact."""
    graph, remat, flat = _saving_step()
    body = build_graph(_compat.as_closed(remat.params["jaxpr"]))
    site = next(e for e in body.eqns if str(e.primitive) == "dot_general" and e.outputs[0].shape == (SIZES.T, SIZES.E))
    scaled = _in_the_backward(remat, body, site.index,
                              lambda eqn, inputs, env: [o * factor if factor != 1 else o for o in _bound(eqn, inputs)])
    assert _outcome(graph, flat, scaled) == ("exact" if factor == 1 else "declined")


def test_a_saved_residual_swapped_for_another_in_the_backward_declines_or_stays_exact():
    """The gate projection's saved value read where the backward reads the up projection's, and back."""
    graph, remat, flat = _saving_step()
    body = build_graph(_compat.as_closed(remat.params["jaxpr"]))
    saved = [v for v in body.inputs if _dense(v.shape)]
    assert len(saved) >= 2
    sites = [(e, i) for e in body.eqns for i, a in enumerate(e.inputs) if a in saved[:2]]
    assert sites
    for eqn, position in sites[:3]:
        other = saved[1] if eqn.inputs[position] is saved[0] else saved[0]

        def swapped(eqn, inputs, env, position=position, other=other):
            return _bound(eqn, inputs[:position] + [env[other]] + inputs[position + 1:])

        assert _outcome(graph, flat, _in_the_backward(remat, body, eqn.index, swapped)) in ("declined", "exact")


def test_a_saved_residual_used_once_more_outside_the_backward_declines():
    """The saved gate projection (the remat's input) also added to the router's gradient: a use outside the
    layer's derivative."""
    graph, remat, flat = _saving_step()
    saved = next(a for a in remat.inputs if _dense(a.shape))

    def extra_use(eqn, inputs, env):
        outputs = _bound(eqn, inputs)
        return [outputs[0] + 0.5 * jnp.mean(env[saved])] + outputs[1:]

    assert _outcome(graph, flat, (remat.index, extra_use)) == "declined"


@pytest.mark.parametrize("primitive", ["logistic", "mul"])
def test_a_stop_gradient_inside_a_saving_remat(primitive):
    """A stop_gradient on one path of the layer under dots_saveable: JAX's backward follows it."""
    mutant = next(m for m, _ in mutate.candidates("mixtral", "stop_gradient") if m.what.startswith(f"{primitive},"))
    params, x = mutant.args(3)
    layer = jax.checkpoint(mutant.fn, policy=jax.checkpoint_policies.dots_saveable)
    step = jax.value_and_grad(lambda p, x: jnp.mean(jnp.sin(layer(p, x)) ** 2), argnums=(0, 1))
    if any(r.backward for r in explain(step, params, x).regions):
        _assert_close(step(params, x), moe_optimize(step)(params, x), 1e-5)


def test_a_plain_step_is_not_marked_inlined():
    params, x = MIXTRAL.args(jax.random.key(0))
    [region] = explain(jax.value_and_grad(lambda p, x: jnp.mean(MIXTRAL.fn(p, x) ** 2)), params, x).regions
    assert region.backward and not region.remat_inlined


def test_checkpointed_blocks_with_sharding_constraints_under_a_mesh():
    """MaxText's decoder layer: under a mesh, the block's tokens are constrained before the layer and the
    layer's hidden values after its projections, inside a remat. Autodiff places the constraints'
    transposes (and ``full_like``'s reshard of silu's ``1 - y``) differently in the recomputing backward
    than in the reference VJP; the proof keys them as the values they constrain."""
    params, x = MIXTRAL.args(jax.random.key(4))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def block(p, x):
        h = jax.lax.with_sharding_constraint(x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6), replicated)
        return x + jax.lax.with_sharding_constraint(MIXTRAL.fn(p, h), replicated)

    def loss(p, x):
        return jnp.mean(jnp.sin(jax.checkpoint(block)(p, jax.checkpoint(block)(p, x))) ** 2)

    set_mesh = jax.set_mesh if hasattr(jax, "set_mesh") else jax.sharding.use_mesh
    with set_mesh(mesh):
        report = _check_rewritten(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x, regions=2)
    assert all(r.remat_inlined for r in report.regions)


# --------------------------------------------------------------------------- a ReLU-family expert under remat

def _relu_at_zeros(activation=jax.nn.relu, policy=None, seed=31):
    """The zoo's ReLU MLP layer (per-expert biases) under ``jax.checkpoint``, with a quarter of the tokens zero
    and half of the up-projection biases zero: its pre-activations there are exactly 0, where relu's rule has
    derivative 0 and ``max(x, 0)``'s autodiff 0.5. Returns the step, its arguments and the pre-activations."""
    model = zoo.ZOO["mlp_relu_bias"].sized(T=SIZES.T, d=SIZES.d, f=SIZES.f, E=SIZES.E, k=SIZES.k)
    params, x = model.args(jax.random.key(seed))
    params = {**params, "b_up": params["b_up"].at[:, :SIZES.f // 2].set(0.0)}
    x = x.at[:SIZES.T // 4].set(0.0)
    layer = jax.checkpoint(zoo._mlp_fn("mlp_relu_bias", SIZES.k, activation, True), policy=policy)
    step = jax.value_and_grad(lambda p, x: jnp.mean(jnp.sin(x + layer(p, x) + 0.5) ** 2), argnums=(0, 1))
    return step, (params, x), jnp.einsum("td,edf->tef", x, params["w_up"]) + params["b_up"]


def _user_relu(floor=0.0, mask=jax.lax.gt):
    """A ``custom_jvp`` relu written by a user: ``max(v, floor)``, its derivative ``mask(v, 0)`` (``ge``: 1 at 0)."""

    @jax.custom_jvp
    def relu(v):
        return jnp.maximum(v, floor)

    @relu.defjvp
    def rule(primals, tangents):
        (v,), (t,) = primals, tangents
        return relu(v), jnp.where(mask(v, 0.0), t, 0.0)

    return relu


_BY_MAX = {"relu": lambda v: jnp.maximum(v, 0.0), "relu6": lambda v: jnp.minimum(jnp.maximum(v, 0.0), 6.0)}


def _largest_difference(results, others) -> float:
    """The largest relative error between two steps' losses and gradients, leaf by leaf."""
    return max(_relative_error(a, b) for a, b in zip(jax.tree.leaves(results), jax.tree.leaves(others), strict=True))


@pytest.mark.parametrize("name, policy", [("relu", None), ("relu6", "nothing_saveable"),
                                          ("squared_relu", "dots_saveable")])
def test_a_relu_expert_under_checkpoint_is_rewritten_with_the_rule_derivative_at_zero(name, policy):
    """The forward calls relu's custom_jvp, and remat's backward calls it again on the same pre-activations
    (traced apart: other objects, the same printed body and rule), then applies the rule (select(x > 0)). The two
    calls are merged (``merged_recomputation``), so the forward and the backward are rewritten, the backward
    proven against the rule's derivative: equal to the untouched step at the exact zeros, where max's is not."""
    activation = zoo.squared_relu if name == "squared_relu" else getattr(jax.nn, name)
    step, args, hidden = _relu_at_zeros(activation, policy and getattr(jax.checkpoint_policies, policy))
    assert int(jnp.sum(hidden == 0)) >= SIZES.T // 4 * SIZES.E * SIZES.f // 2
    report = _check_rewritten(step, *args)
    assert report.regions[0].remat_inlined
    if name in _BY_MAX:  # the zeros reach the rule: max's derivative there gives other gradients
        by_max, _, _ = _relu_at_zeros(_BY_MAX[name], policy and getattr(jax.checkpoint_policies, policy))
        assert _largest_difference(step(*args), by_max(*args)) > 1e-3


def test_a_user_relu_with_its_own_derivative_at_zero_is_rewritten_with_its_rule():
    """A custom_jvp relu whose derivative at 0 is 1 (``ge``), under remat: rewritten with its own rule, the
    untouched step's gradients at the zeros, which jax.nn.relu's rule would not give."""
    step, args, _ = _relu_at_zeros(_user_relu(mask=jax.lax.ge))
    _check_rewritten(step, *args)
    by_rule_of_nn, _, _ = _relu_at_zeros(jax.nn.relu)
    assert _largest_difference(step(*args), by_rule_of_nn(*args)) > 1e-3


def _recomputed_by(forward, recompute):
    """The step of ``_relu_at_zeros(forward)`` (no policy) with the remat body's call of the activation, the
    backward's recomputation, swapped for ``recompute``: the forward and the backward's rule ops unchanged."""
    step, args, _ = _relu_at_zeros(forward)
    flat = jax.tree.leaves(args)
    graph = build_graph(jax.make_jaxpr(lambda *a: step(*jax.tree.unflatten(jax.tree.structure(args), a)))(*flat))
    remat = next(e for e in graph.eqns if e.primitive is _compat.remat_p)
    body = build_graph(_compat.as_closed(remat.params["jaxpr"]))
    [call] = [e for e in body.eqns if e.primitive is _compat.custom_jvp_call_p]
    return graph, flat, _in_the_backward(remat, body, call.index, lambda eqn, inputs, env: [recompute(inputs[0])])


@pytest.mark.parametrize("forward, recompute, outcome", [
    (jax.nn.relu, jax.nn.relu, "exact"),  # traced again: the same body and rule
    (jax.nn.relu, jax.nn.relu6, "declined"),  # the same values here (all below 6), another function
    (jax.nn.relu, lambda v: jnp.maximum(v, 0.0), "declined"),  # the primal without relu's rule
    (_user_relu(), _user_relu(), "exact"),
    (_user_relu(), _user_relu(floor=1e-6), "declined"),  # another body
    (_user_relu(), _user_relu(mask=jax.lax.ge), "declined"),  # the same body, another rule
], ids=["relu", "relu6", "max", "user_relu", "user_floor", "user_rule"])
def test_a_recomputation_that_is_not_the_forward_call_declines(forward, recompute, outcome):
    """The backward's recomputation merges with the forward's call only where it is the same function: its body
    and its derivative rule as printed. Any other is declined (explain names a custom_jvp call left apart)."""
    graph, flat, mutation = _recomputed_by(forward, recompute)
    assert _outcome(graph, flat, mutation) == outcome
    if outcome == "declined" and isinstance(recompute, jax.custom_jvp):
        report = explain(lambda *a: _evaluate(graph, a, mutation), *flat)
        assert any("is not merged with it" in m.reason for m in report.near_misses), str(report)
