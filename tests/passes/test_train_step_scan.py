"""Training steps whose MoE layers sit inside ``lax.scan`` over layers (MaxText's ``scan_layers=True``):
the forward scan's body and the backward scan JAX's autodiff transposed from it are joined, proven and
re-emitted as two scans (``passes/scan_derivative.py``).

Each step is compared with the undecorated step: the loss and every gradient, float32 tight, and no
dense ``[.., T, E, F]`` value may be left in the rewritten jaxpr (the stacked residuals included).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax._src.interpreters import partial_eval as pe

from moe_lowering import _compat, explain, moe_optimize
from moe_lowering.passes.graph import Const, JaxprGraph, Value, build_graph, inline_jaxpr
from moe_lowering.testing import mutate, zoo
from test_train_step import MIXTRAL, SIZES, _assert_close, _check_rewritten, _dense_elements, _largest_value
from test_train_step_remat import _SAVING, _bound, _evaluate, _outcome, assert_bfloat16_as_close_as_the_dense_step

LAYERS = 2


def _model(name: str) -> zoo.ZooModel:
    return MIXTRAL if name == "mixtral" else zoo.ZOO[name].sized(T=SIZES.T, d=SIZES.d, f=SIZES.f, E=SIZES.E, k=SIZES.k)


def _stacked_args(model, layers=LAYERS, seed=0):
    """Each layer's own random weights, stacked on a leading layer axis, and the tokens."""
    per_layer = [model.args(jax.random.key(seed + i)) for i in range(layers)]
    return jax.tree.map(lambda *w: jnp.stack(w), *[p for p, _ in per_layer]), per_layer[0][1]


def _scan_step(model, checkpoint=False, policy=None):
    def block(h, p):
        return h + model.fn(p, h), None

    body = jax.checkpoint(block, policy=policy) if checkpoint else block

    def loss(params, x):
        h, _ = lax.scan(body, x, params)
        return jnp.mean(jnp.sin(h) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1))


def _check_scan_rewritten(step, *args):
    report = _check_rewritten(step, *args)
    [region] = report.regions
    assert "scan[" in region.scope and "+scan[" in region.scope, region.scope  # the joined forward and backward
    return report


@pytest.mark.parametrize("name", ["mixtral", "gather_combine"])
def test_value_and_grad_through_a_scan_over_layers(name):
    model = _model(name)
    _check_scan_rewritten(_scan_step(model), *_stacked_args(model))


def test_three_layers_under_jit_equal_the_step_of_the_decorated_layer():
    """Three layers of sparse-versus-dense float32 rounding compound through the residual stream (up to
    ~1e-5 of the largest gradient entry, as much for the step whose layer alone is decorated): the whole
    step rewritten computes what the decorated layer's step computes (1e-6), and the dense step within 2e-5."""
    params, x = _stacked_args(MIXTRAL, layers=3, seed=3)
    step = jax.jit(_scan_step(MIXTRAL))
    [region] = explain(step, params, x).regions
    assert region.backward and "+scan[" in region.scope
    rewritten = moe_optimize(step, strict=True)
    layer = moe_optimize(MIXTRAL.fn, strict=True)

    def layer_loss(params, x):
        h, _ = lax.scan(lambda h, p: (h + layer(p, h), None), x, params)
        return jnp.mean(jnp.sin(h) ** 2)

    got = rewritten(params, x)
    _assert_close(jax.jit(jax.value_and_grad(layer_loss, argnums=(0, 1)))(params, x), got, 1e-6)
    _assert_close(step(params, x), got, 2e-5)
    assert _largest_value(jax.make_jaxpr(rewritten)(params, x)) < _dense_elements()


def test_jit_outside_the_decorated_step():
    params, x = _stacked_args(MIXTRAL, seed=5)
    step = _scan_step(MIXTRAL)
    outer = jax.jit(moe_optimize(step, strict=True))
    _assert_close(step(params, x), outer(params, x), 1e-5)
    assert _largest_value(jax.make_jaxpr(outer)(params, x)) < _dense_elements()


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable],
                         ids=["no_policy", "nothing_saveable"])
def test_checkpoint_inside_the_scan_body(policy):
    """The backward scan's body recomputes the layer under remat: inlined and merged with the forward body."""
    params, x = _stacked_args(MIXTRAL, seed=7)
    report = _check_scan_rewritten(_scan_step(MIXTRAL, checkpoint=True, policy=policy), params, x)
    assert report.regions[0].remat_inlined and "jax.checkpoint inlined" in str(report)


def test_a_loop_invariant_value_hoisted_out_of_the_forward_scan_and_recomputed_by_the_backward():
    """MaxText's rotary tables and masks: a value of the scanned block computed from a loop-invariant
    input only is hoisted out of the forward scan by JAX, while the remat'd backward body recomputes it
    from that input; joined, the recomputation merges with the hoisted computation (``_hoisted``)."""
    params, x = _stacked_args(MIXTRAL, seed=13)
    positions = jnp.arange(x.shape[0], dtype=jnp.float32)

    def loss(params, x, positions):
        @jax.checkpoint
        def block(h, p):
            return h + MIXTRAL.fn(p, h * jnp.cos(positions / 7.0)[:, None]), None

        h, _ = lax.scan(block, x, params)
        return jnp.mean(jnp.sin(h) ** 2)

    _check_scan_rewritten(jax.value_and_grad(loss, argnums=(0, 1)), params, x, positions)


def test_gradient_accumulation_over_microbatches_in_an_outer_scan():
    """MaxText's gradient accumulation: the step's scans over layers inside a scan over microbatches;
    the pair is found in the outer scan's body."""
    params, x = _stacked_args(MIXTRAL, seed=21)
    microbatches = jnp.stack([x, x[::-1] * 0.5])
    step = _scan_step(MIXTRAL)

    def accumulate(params, microbatches):
        def add_microbatch(total, x):
            return jax.tree.map(jnp.add, total, step(params, x)), None

        zero = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), (params, x)))
        return lax.scan(add_microbatch, zero, microbatches)[0]

    [region] = explain(accumulate, params, microbatches).regions
    assert region.backward and region.scope.count("scan[") == 3, region.scope
    rewritten = moe_optimize(accumulate, strict=True)
    _assert_close(accumulate(params, microbatches), rewritten(params, microbatches), 1e-5)
    assert _largest_value(jax.make_jaxpr(rewritten)(params, microbatches)) < _dense_elements()


def test_bfloat16_scan_step_as_close_to_float32_as_the_dense_step():
    """bf16 against the float32 step on the same values: within 2e-2, or no worse than twice the dense
    bf16 step's error."""
    assert_bfloat16_as_close_as_the_dense_step(_scan_step(MIXTRAL), *_stacked_args(MIXTRAL, seed=17))


def test_a_forward_program_scan_is_still_rewritten_in_its_body():
    """Without a backward scan nothing is joined: the layer is rewritten inside the forward scan as before."""
    params, x = _stacked_args(MIXTRAL)

    def forward(params, x):
        return lax.scan(lambda h, p: (h + MIXTRAL.fn(p, h), None), x, params)[0]

    [region] = explain(forward, params, x).regions
    assert "+scan" not in region.scope and not region.backward
    _assert_close(forward(params, x), moe_optimize(forward, strict=True)(params, x), 1e-5)


def test_the_layer_outputs_also_returned_per_layer():
    """A forward scan output read outside the pair (here the layers' outputs, stacked and returned) stays
    an output of the rewritten forward scan."""
    params, x = _stacked_args(MIXTRAL, seed=9)

    def loss(params, x):
        def block(h, p):
            out = MIXTRAL.fn(p, h)
            return h + out, out

        h, outs = lax.scan(block, x, params)
        return jnp.mean(jnp.sin(h) ** 2), outs

    _check_scan_rewritten(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), params, x)


@pytest.mark.parametrize("policy", ["dots_saveable", "save_only_these_names", "save_and_offload_only_these_names"])
def test_a_remat_that_saves_the_expert_activations_inside_the_scan(policy):
    """The forward scan stacks the saved projections (marked by remat's ``reduce_precision``; offloaded ones
    moved to host memory and back) for the backward's remat: joined, inlined and merged, they are read by the
    layer's own derivative only, so both scans are rewritten and nothing dense is stacked (the sparse VJP's
    residuals take their place)."""
    model = _model("mixtral_annotated") if "names" in policy else MIXTRAL
    params, x = _stacked_args(model, seed=23)
    report = _check_scan_rewritten(_scan_step(model, checkpoint=True, policy=_SAVING[policy]), params, x)
    assert report.regions[0].remat_inlined


def test_nnx_scan_over_a_vmapped_stack_of_blocks():
    """Flax NNX: blocks made with nnx.vmap, run with nnx.scan, differentiated with nnx.value_and_grad."""
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, key):
            params, _ = MIXTRAL.args(key)
            self.w = nnx.Dict({name: nnx.Param(value) for name, value in params.items()})

        def __call__(self, h):
            return h + MIXTRAL.fn({name: value[...] for name, value in self.w.items()}, h)

    blocks = nnx.vmap(Block, in_axes=0, out_axes=0)(jax.random.split(jax.random.key(11), LAYERS))
    graphdef, state = nnx.split(blocks)

    def loss(blocks, x):
        run = nnx.scan(lambda block, h: block(h), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        return jnp.mean(jnp.sin(run(blocks, x)) ** 2)

    def step(state, x):
        return nnx.value_and_grad(loss)(nnx.merge(graphdef, state), x)

    _check_scan_rewritten(step, state, MIXTRAL.args(jax.random.key(12))[1])


def _relu_step_with_zeros(activation=jax.nn.relu, seed=25, scanned=True, checkpoint=False):
    """The zoo's relu MLP layer scanned over two layers (or one layer, unscanned; the scanned block under
    ``jax.checkpoint`` with ``checkpoint``), with a quarter of the tokens zero and half of the first layer's
    up-projection biases zero: its pre-activations there are exactly 0, where relu's rule has derivative 0
    and ``max(x, 0)``'s autodiff 0.5. The loss's cotangent is not zero at h = 0."""
    model = _model("mlp_relu_bias")
    params, x = _stacked_args(model, seed=seed)
    params = {**params, "b_up": params["b_up"].at[0, :, :SIZES.f // 2].set(0.0)}
    x = x.at[:SIZES.T // 4].set(0.0)
    fn = zoo._mlp_fn("mlp_relu_bias", SIZES.k, activation, True)

    def block(h, p):
        return h + fn(p, h), None

    def loss(params, x):
        h = lax.scan(jax.checkpoint(block) if checkpoint else block, x, params)[0] if scanned else x + fn(params, x)
        return jnp.mean(jnp.sin(h + 0.5) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1)), params if scanned else jax.tree.map(lambda a: a[0], params), x


_BY_MAX = {"relu": lambda v: jnp.maximum(v, 0.0), "relu6": lambda v: jnp.minimum(jnp.maximum(v, 0.0), 6.0)}


@pytest.mark.parametrize("name", list(_BY_MAX))
def test_a_scanned_relu_layer_is_rewritten_with_the_rule_derivative_at_zero(name):
    """jax.nn.relu's custom_jvp rule is applied when autodiff splits the scan: the forward body holds
    max(x, 0) and the backward body the rule's select(x > 0, ct, 0). The primal is bound again as relu's
    custom_jvp (``restored_rules``), whose derivative the proof compares with the backward body's and the
    sparse layer applies: equal to the untouched step at the exact zeros, where max's would not be."""
    step, params, x = _relu_step_with_zeros(getattr(jax.nn, name))
    report = explain(step, params, x)
    [region] = report.regions
    assert region.backward and "+scan[" in region.scope and "rewritten forward and backward" in str(report)
    rewritten = moe_optimize(step, strict=True)
    _assert_close(step(params, x), rewritten(params, x), 1e-5)
    # JAX hoists the rule's zeros [T, E, F] out of the backward scan, which does not read them (in the
    # untouched step too): dead code, which jit drops; every live value is smaller than a dense one
    def live_largest(fn):
        return _largest_value(types.SimpleNamespace(jaxpr=pe.dce_jaxpr(jax.make_jaxpr(fn)(params, x).jaxpr,
                                                                        [True] * 7)[0]))

    assert live_largest(rewritten) < _dense_elements() <= live_largest(step)
    by_max, _, _ = _relu_step_with_zeros(_BY_MAX[name])
    assert not jnp.allclose(step(params, x)[1][1], by_max(params, x)[1][1]), "the zeros do not reach the rule"


def test_an_unscanned_relu_layer_at_exact_zeros_keeps_its_custom_jvp():
    """Unscanned, the step's forward keeps relu's custom_jvp call: rewritten with the rule's derivative too."""
    step, params, x = _relu_step_with_zeros(scanned=False)
    _check_rewritten(step, params, x)
    by_max, _, _ = _relu_step_with_zeros(_BY_MAX["relu"], scanned=False)
    assert not jnp.allclose(step(params, x)[1][1], by_max(params, x)[1][1]), "the zeros do not reach the rule"


def test_a_scanned_relu_layer_under_checkpoint_at_exact_zeros():
    """The forward body holds relu's primal (bound again as its custom_jvp), the backward body remat's
    recomputation, a custom_jvp call of its own: merged once the primal is bound again, so the backward body
    is proven against the rule's derivative."""
    step, params, x = _relu_step_with_zeros(checkpoint=True)
    [region] = _check_scan_rewritten(step, params, x).regions
    assert region.remat_inlined
    by_max, _, _ = _relu_step_with_zeros(_BY_MAX["relu"], checkpoint=True)
    assert not jnp.allclose(step(params, x)[1][1], by_max(params, x)[1][1]), "the zeros do not reach the rule"


def test_bfloat16_scanned_relu_step_as_close_to_float32_as_the_dense_step():
    assert_bfloat16_as_close_as_the_dense_step(*_relu_step_with_zeros(seed=27))


def _relu_backward_mutant(body_of, pick, change):
    """The relu step with one eqn of a scan body changed: ``body_of`` picks the scan, ``pick(body)`` the eqn."""
    step, params, x = _relu_step_with_zeros(seed=29)
    flat = jax.tree.leaves((params, x))
    tree = jax.tree.structure((params, x))
    graph = build_graph(jax.make_jaxpr(lambda *a: step(*jax.tree.unflatten(tree, a)))(*flat))
    scan = next(e for e in graph.eqns if str(e.primitive) == "scan" and body_of(e))
    jaxpr, consts = _compat.jaxpr_parts(_compat.as_closed(scan.params["jaxpr"]))
    env = {v: Const(c, v.aval) for v, c in zip(jaxpr.constvars, consts)}
    inputs = tuple(Value(v.aval) for v in jaxpr.invars)
    env.update(zip(jaxpr.invars, inputs))
    eqns: list = []
    outputs = inline_jaxpr(jaxpr, env, eqns, {}, inlined=())  # relu's jit kept: re-bound as it was
    body = JaxprGraph(tuple(eqns), inputs, tuple(outputs))
    site = pick(body)

    def rebound(eqn, inputs, env):
        avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in body.inputs]
        new_body = jax.make_jaxpr(lambda *a: _evaluate(body, a, (site.index, change)))(*avals)
        return eqn.primitive.bind(*inputs, **{**eqn.params, "jaxpr": new_body})

    return graph, flat, (scan.index, rebound)


@pytest.mark.parametrize("mask", ["gt", "ge"])
def test_a_scanned_relu_mask_that_keeps_the_zeros_declines(mask):
    """The forward body's mask for the rule's derivative, x > 0, changed to x >= 0 (max's tie goes the other
    way): the backward body is no longer the rule's derivative, and the proof says so. The body re-bound
    unchanged (``gt``) is rewritten, exact."""
    graph, flat, mutation = _relu_backward_mutant(
        lambda e: not e.params["reverse"], lambda body: next(e for e in body.eqns if str(e.primitive) == "gt"),
        lambda eqn, inputs, env: [getattr(lax, mask)(*inputs)])
    assert _outcome(graph, flat, mutation) == ("exact" if mask == "gt" else "declined")


def test_a_scaled_cotangent_through_the_scanned_relu_declines():
    graph, flat, mutation = _relu_backward_mutant(
        lambda e: e.params["reverse"], lambda body: next(e for e in body.eqns if str(e.primitive) == "select_n"),
        lambda eqn, inputs, env: [2 * o for o in _bound(eqn, inputs)])
    assert _outcome(graph, flat, mutation) == "declined"


# --------------------------------------------------------------------------- mutants of the backward scan

def _backward_scan_sites(context: str, kind: str, predicate):
    """Mutants of ``kind`` in the backward scan's body of ``train-<model>`` with ``predicate(site, what)``."""
    ctx = mutate.model_context(context)
    backward = next(e.index for e in ctx.graph.eqns if str(e.primitive) == "scan" and e.params["reverse"])
    sites = {s.path: s for s in ctx.sites}
    return [m for m, _ in mutate.candidates(context, kind)
            if m.path[0] == backward and len(m.path) == 2 and predicate(sites[m.path], m.what)]


def _dense_shape(shape) -> bool:
    return len(shape) == 3 and shape[0] == mutate.TINY["T"] and shape[1] == mutate.TINY["E"]


def _arg_shape(site, what: str):
    name = what.rsplit(",", 1)[-1]
    return site.graph.inputs[int(name[3:])].shape if name.startswith("arg") else None


SCAN_STEP = f"{mutate.TRAIN_STEP}scan_layers"


@pytest.mark.mutation
def test_a_scaled_gate_cotangent_in_the_backward_scan_declines():
    [mutant] = _backward_scan_sites(SCAN_STEP, "scale", lambda s, w: str(s.eqn.primitive) == "dot_general"
                                    and s.eqn.outputs[0].shape == (mutate.TINY["T"], mutate.TINY["E"])
                                    and w.endswith(",x2"))[:1]
    outcome = mutate.check_mutant(mutant, 1)
    assert outcome.status == "declined", outcome.message()


@pytest.mark.mutation
@pytest.mark.parametrize("kind", ["substitute", "extra_use"])
def test_a_residual_swapped_or_read_once_more_in_the_backward_scan(kind):
    """A dense residual ([T, E, F]) read in place of another, or used by one more op of the backward body:
    declined, or rewritten and equal to the mutant's own dense step."""
    found = _backward_scan_sites(SCAN_STEP, kind, lambda s, w: _dense_shape(_arg_shape(s, w) or ())
                                 and any(_dense_shape(a.shape) for a in s.eqn.inputs))
    assert found, f"no {kind} site reads a dense residual"
    for mutant in found[:2]:
        outcome = mutate.check_mutant(mutant, 1)
        assert outcome.status in ("declined", "exact"), outcome.message()


@pytest.mark.mutation
@pytest.mark.parametrize("primitive", ["logistic", "mul"])
def test_a_stop_gradient_on_one_path_of_the_scanned_layer(primitive):
    """``step-scan_layers``: a stop_gradient in the layer inside the scan; JAX's backward follows it."""
    mutant = next(m for m, _ in mutate.candidates(f"{mutate.STEP_OF}scan_layers", "stop_gradient")
                  if len(m.path) == 2 and m.what.startswith(f"{primitive},"))
    outcome = mutate.check_mutant(mutant, 1)
    assert outcome.status in ("declined", "exact"), outcome.message()
