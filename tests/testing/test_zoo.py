"""The zoo computes what it claims: every model against an independent per-token numpy loop.

The references below share no code with the zoo: routing is re-derived with ``np.argsort`` per token,
each chosen expert's MLP is evaluated on that one token in float64, and capacity models drop token
copies by walking a per-expert queue in token order. Gradients are checked as directional
derivatives against central differences of the same float64 references.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_lowering.testing import NEGATIVE, POSITIVE, ZOO, Sizes, ZooModel, zoo

KEY = jax.random.key(0)
TIE_MARGIN = 1e-6  # the reference refuses routing decisions closer than this: they would be ties

# --------------------------------------------------------------------------------------------
# float64 numpy building blocks


def softmax(z):
    z = np.exp(z - z.max())
    return z / z.sum()


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def silu(z):
    return z * sigmoid(z)


def relu(z):
    return np.maximum(z, 0.0)


_erf = np.vectorize(math.erf)


def gelu_erf(z):
    return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))


def gelu_tanh(z):
    return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))


def top(values, k):
    """Indices of the k largest values, best first; a near-tie at the cut or inside is an error."""
    order = np.argsort(-values, kind="stable")
    ranked = values[order]
    gaps = ranked[: min(k, len(values) - 1)] - ranked[1 : min(k, len(values) - 1) + 1]
    assert np.all(gaps > TIE_MARGIN), f"routing tie in {values}: the zoo must not produce ties"
    return order[:k]


# --------------------------------------------------------------------------------------------
# Routing: per token, a list of (expert, weight).


def route_softmax_renormalise(logits_row, k):
    probs = softmax(logits_row)
    chosen = top(probs, k)
    return list(zip(chosen, probs[chosen] / probs[chosen].sum()))


def route_logits_then_softmax(logits_row, k):
    chosen = top(logits_row, k)
    return list(zip(chosen, softmax(logits_row[chosen])))


def route_deepseek(logits_row, bias, k, n_group, topk_group, scale, *, grouped=True):
    scores = sigmoid(logits_row)
    biased = scores + bias
    allowed = np.ones_like(biased, bool)
    if grouped:
        per_group = biased.reshape(n_group, -1)
        group_scores = np.array([np.sort(g)[-2:].sum() for g in per_group])
        allowed = np.zeros_like(allowed)
        for g in top(group_scores, topk_group):
            allowed.reshape(n_group, -1)[g] = True
    chosen = top(np.where(allowed, biased, -np.inf), k)
    weights = scores[chosen] / scores[chosen].sum() * scale
    return list(zip(chosen, weights))


def route_with_capacity(logits, k, capacity):
    """Switch (k=1) / GShard (k=2): choices queue per expert, all first choices before second ones."""
    routes = [[] for _ in logits]
    probs = [softmax(row) for row in logits]
    chosen = [top(p, k) for p in probs]
    gates = [p[c] / (p[c].sum() + 1e-9) if k == 2 else p[c] for p, c in zip(probs, chosen)]
    queue_length = {}
    dropped = 0
    for choice in range(k):
        for t in range(len(logits)):
            expert = chosen[t][choice]
            if queue_length.get(expert, 0) < capacity:
                queue_length[expert] = queue_length.get(expert, 0) + 1
                routes[t].append((expert, gates[t][choice]))
            else:
                dropped += 1
    return routes, dropped


# --------------------------------------------------------------------------------------------
# Expert MLPs on one token.


def swiglu_expert(p, e, x_t):
    return (silu(x_t @ p["w_gate"][e]) * (x_t @ p["w_up"][e])) @ p["w_down"][e]


def swiglu_bias_expert(p, e, x_t):
    return swiglu_expert(p, e, x_t) + p["b_down"][e]


def fused_swiglu_expert(p, e, x_t):
    gate, up = np.split(x_t @ p["w_gate_up"][e], 2)
    return (silu(gate) * up) @ p["w_down"][e]


def mlp_expert(activation, biases=False):
    def expert(p, e, x_t):
        hidden = x_t @ p["w_up"][e] + (p["b_up"][e] if biases else 0.0)
        return activation(hidden) @ p["w_down"][e] + (p["b_down"][e] if biases else 0.0)

    return expert


def gpt_oss_expert(limit, alpha):
    def expert(p, e, x_t):
        gate_up = x_t @ p["w_gate_up"][e] + p["b_gate_up"][e]
        gate, up = np.minimum(gate_up[0::2], limit), np.clip(gate_up[1::2], -limit, limit)
        return ((up + 1.0) * gate * sigmoid(alpha * gate)) @ p["w_down"][e] + p["b_down"][e]

    return expert


def moe_loop(x, routes, expert, p):
    """``out[t] = sum over (e, w) in routes[t] of w * expert(e, x[t])``; tokens with no route stay 0."""
    out = np.zeros_like(x)
    for t, token_routes in enumerate(routes):
        for e, w in token_routes:
            out[t] += w * expert(p, e, x[t])
    return out


# --------------------------------------------------------------------------------------------
# One reference per zoo model: reference(params, x, model) with float64 numpy arrays.


def mixtral_reference(p, x, model, expert=swiglu_expert, route=route_softmax_renormalise):
    routes = [route(row, model.top_k) for row in x @ p["router"]]
    return moe_loop(x, routes, expert, p)


def gpt_oss_reference(p, x, model):
    logits = x @ p["router"] + p["router_bias"]
    routes = [route_logits_then_softmax(row, model.top_k) for row in logits]
    return moe_loop(x, routes, gpt_oss_expert(**model.hyperparams), p)


def deepseek_reference(p, x, model, grouped=True):
    routes = [route_deepseek(row, p["e_score_correction_bias"], model.top_k, grouped=grouped,
                             **_deepseek_hyper(model)) for row in x @ p["router"]]
    shared = (silu(x @ p["shared_gate"]) * (x @ p["shared_up"])) @ p["shared_down"]
    return moe_loop(x, routes, swiglu_expert, p) + shared


def _deepseek_hyper(model):
    h = model.hyperparams
    return {"n_group": h["n_group"], "topk_group": h["topk_group"], "scale": h["routed_scaling_factor"]}


def route_grouped_capacity(logits, k, capacity):
    """MaxText's per-row capacity: each batch row queues its (token, choice) pairs in flattened
    token-major order; an expert keeps the first ``capacity`` of its row's copies."""
    routes = []
    dropped = 0
    for row in logits:
        chosen = [route_softmax_renormalise(token_logits, k) for token_logits in row]
        queue_length = {}
        for token_routes in chosen:
            kept = []
            for expert, weight in token_routes:
                queue_length[expert] = queue_length.get(expert, 0) + 1
                if queue_length[expert] <= capacity:
                    kept.append((expert, weight))
                else:
                    dropped += 1
            routes.append(kept)
    return routes, dropped


def batch_prioritized_reference(p, x, model):
    """Tokens claim their expert's slots in order of top-1 probability, most confident first."""
    capacity = math.ceil(model.hyperparams["capacity_factor"] * len(x) / p["router"].shape[-1])
    probs = [softmax(row) for row in x @ p["router"]]
    choice = [int(top(pr, 1)[0]) for pr in probs]
    confidence = np.array([pr[c] for pr, c in zip(probs, choice)])
    routes = [[] for _ in x]
    queue_length = {}
    for t in top(confidence, len(x)):
        if queue_length.get(choice[t], 0) < capacity:
            queue_length[choice[t]] = queue_length.get(choice[t], 0) + 1
            routes[t].append((choice[t], probs[t][choice[t]]))
    return moe_loop(x, routes, mlp_expert(gelu_tanh), p)


def grouped_capacity_reference(p, x, model):
    batch, seq, d = x.shape
    capacity = zoo.grouped_expert_capacity(seq, p["router"].shape[-1], model.top_k,
                                           model.hyperparams["capacity_factor"])
    routes, _ = route_grouped_capacity(x @ p["router"], model.top_k, capacity)
    return moe_loop(x.reshape(-1, d), routes, swiglu_expert, p).reshape(x.shape)


def capacity_reference(activation):
    def reference(p, x, model):
        num_experts = p["router"].shape[-1]
        capacity = math.ceil(model.hyperparams["capacity_factor"] * len(x) * model.top_k / num_experts)
        routes, _ = route_with_capacity(x @ p["router"], model.top_k, capacity)
        return moe_loop(x, routes, mlp_expert(activation), p)

    return reference


def bsd_reference(p, x, model):
    return mixtral_reference(p, x.reshape(-1, x.shape[-1]), model).reshape(x.shape)


def two_layers_reference(p, x, model):
    h = x + mixtral_reference(p["layer_0"], x, model)
    return h + mixtral_reference(p["layer_1"], h, model)


def scan_layers_reference(p, x, model):
    h = x
    for layer in range(model.hyperparams["num_layers"]):
        h = h + mixtral_reference({name: w[layer] for name, w in p.items()}, h, model)
    return h


def topk_attention_reference(p, x, model):
    q, key, v = x @ p["w_q"], x @ p["w_k"], x @ p["w_v"]
    out = np.zeros_like(x)
    for t in range(len(x)):
        scores = key @ q[t] / math.sqrt(q.shape[-1])
        keys = top(scores, model.top_k)
        out[t] = softmax(scores[keys]) @ v[keys]
    return out @ p["w_o"]


def ensemble_average_reference(p, x, model):
    experts = p["w_up"].shape[0]
    return np.mean([relu(x @ p["w_up"][e]) @ p["w_down"][e] for e in range(experts)], axis=0)


def batched_matmul_unrouted_reference(p, x, model):
    heads = np.concatenate([gelu_tanh(x @ w) for w in p["w_heads"]], axis=-1)
    scores = x @ p["w_score"]
    confidence = sigmoid(np.array([np.sort(row)[-model.top_k:].mean() for row in scores]))
    return (heads @ p["w_out"]) * confidence[:, None]


def route_sigmoid(logits_row, k):
    probs = sigmoid(logits_row)
    chosen = top(probs, k)
    return list(zip(chosen, probs[chosen]))


def gate_on_tokens_reference(p, x, model):
    """The routing weight scales the token before its expert: ``sum over (e, w) of expert(e, w * x[t])``."""
    routes = [route_sigmoid(row, model.top_k) for row in x @ p["router"]]
    return np.stack([sum(swiglu_expert(p, e, w * x[t]) for e, w in token_routes) for t, token_routes in enumerate(routes)])


def separate_experts_reference(p, x, model):
    stacked = {name: np.stack([expert[name] for expert in p["experts"]]) for name in ("w_gate", "w_up", "w_down")}
    return mixtral_reference({"router": p["router"], **stacked}, x, model)


def scaled_geglu_expert(p, e, x_t):
    """GeGLU (tanh gelu) with each expert weight scaled per output column, ``W[e] * scale[e]``."""
    w = {name: p[name][e] * p[name + "_scale"][e] for name in ("w_gate", "w_up", "w_down")}
    return (gelu_tanh(x_t @ w["w_gate"]) * (x_t @ w["w_up"])) @ w["w_down"]


REFERENCES = {
    "mixtral": mixtral_reference,
    "mixtral_logits_topk": lambda p, x, m: mixtral_reference(p, x, m, fused_swiglu_expert, route_logits_then_softmax),
    "mixtral_bsd": bsd_reference,
    "mixtral_annotated": mixtral_reference,
    "mixtral_square": mixtral_reference,
    "mlp_gelu": lambda p, x, m: mixtral_reference(p, x, m, mlp_expert(gelu_erf)),
    "mlp_relu_bias": lambda p, x, m: mixtral_reference(p, x, m, mlp_expert(relu, biases=True)),
    "mlp_squared_relu": lambda p, x, m: mixtral_reference(p, x, m, mlp_expert(lambda z: relu(z) ** 2)),
    "gpt_oss": gpt_oss_reference,
    "deepseek_v3": deepseek_reference,
    "switch": capacity_reference(relu),
    "gshard_top2": capacity_reference(gelu_tanh),
    "gshard_top2_outer": capacity_reference(gelu_tanh),
    "grouped_capacity": grouped_capacity_reference,
    "grouped_capacity_a2a": grouped_capacity_reference,
    "batch_prioritized": batch_prioritized_reference,
    "hf_loop": mixtral_reference,
    "gather_combine": mixtral_reference,
    "gathered_weights": lambda p, x, m: mixtral_reference(p, x, m, swiglu_bias_expert),
    "gate_on_tokens": gate_on_tokens_reference,
    "one_hot_dispatch_loop": bsd_reference,
    "separate_experts": separate_experts_reference,
    "tiled_per_choice": lambda p, x, m: mixtral_reference(p, x, m, scaled_geglu_expert),
    "sorted_range_mask": bsd_reference,
    "two_layers": two_layers_reference,
    "scan_layers": scan_layers_reference,
    "flax_moe": mixtral_reference,
    "topk_attention": topk_attention_reference,
    "ensemble_average": ensemble_average_reference,
    "batched_matmul_unrouted": batched_matmul_unrouted_reference,
}


def as_float64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def reference(model: ZooModel, params, x):
    return REFERENCES[model.name](as_float64(params), np.asarray(x, np.float64), model)


# Models rebuilt at other sizes: the builders and the shape-generic fns must agree with the references.
RESIZED = {
    "mixtral_k1_e4": ("mixtral", dict(k=1, E=4, T=24)),
    "mixtral_bsd_b4": ("mixtral_bsd", dict(B=4, T=32, d=8)),
    "deepseek_v3_e16": ("deepseek_v3", dict(E=16, k=3, n_group=4, topk_group=2)),
    "switch_roomy": ("switch", dict(capacity_factor=4.0)),
    "gshard_top2_e8": ("gshard_top2", dict(E=8, T=48, capacity_factor=1.25)),
    "gshard_top2_outer_e8": ("gshard_top2_outer", dict(E=8, T=48, capacity_factor=1.25)),
    "hf_loop_e4": ("hf_loop", dict(E=4, f=16)),
}


@functools.cache
def _args(case: str, dtype=jnp.float32):
    return _model(case).args(KEY, dtype)


@functools.cache
def _model(case: str) -> ZooModel:
    if case in RESIZED:
        name, overrides = RESIZED[case]
        return ZOO[name].sized(**overrides)
    return ZOO[case]


# --------------------------------------------------------------------------------------------


def test_every_model_has_an_independent_reference():
    assert set(REFERENCES) == set(ZOO)
    assert set(POSITIVE) | set(NEGATIVE) == set(ZOO) and not set(POSITIVE) & set(NEGATIVE)
    assert {"mixtral", "deepseek_v3", "switch", "gshard_top2", "hf_loop", "gather_combine"} <= set(POSITIVE)
    assert {"topk_attention", "ensemble_average", "batched_matmul_unrouted"} == set(NEGATIVE)


@pytest.mark.parametrize("case", list(ZOO) + list(RESIZED))
def test_forward_matches_per_token_reference(case):
    model = _model(case)
    params, x = _args(case)
    out = jax.jit(model.fn)(params, x)
    expected = reference(model, params, x)
    assert out.shape == x.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("name", ["mixtral", "switch", "hf_loop", "scan_layers"])
def test_size_overrides_of_make_functions_reach_the_same_fn(name):
    """``fn`` reads T, d, f and E from the shapes, so make_* overrides need no rebuilt model."""
    model = ZOO[name]
    overrides = dict(T=16, d=8, f=12, E=4)
    params = model.make_params(jax.random.key(3), **overrides)
    x = model.make_inputs(jax.random.key(4), **overrides)
    assert x.shape == (16, 8)
    out = jax.jit(model.fn)(params, x)
    expected = reference(model, params, x)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("name", list(ZOO))
def test_gradient_matches_reference_directional_derivative(name):
    """``<grad, v>`` of ``sum(fn * c)`` over params and x against a float64 central difference."""
    model = ZOO[name]
    params, x = _args(name)
    rng = np.random.default_rng(1)
    cotangent = rng.standard_normal(x.shape)

    def loss(params, x):
        return jnp.sum(model.fn(params, x) * cotangent.astype(np.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    primal = as_float64((params, x))
    direction = jax.tree.map(lambda a: rng.standard_normal(a.shape), primal)
    analytic = sum(np.vdot(np.asarray(g, np.float64), v) for g, v in
                   zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
    scale = sum(np.abs(np.asarray(g, np.float64) * v).sum() for g, v in
                zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))

    def ref_loss(step):
        p, xs = jax.tree.map(lambda a, v: a + step * v, primal, direction)
        return np.sum(REFERENCES[name](p, xs, model) * cotangent)

    eps = 1e-6
    numeric = (ref_loss(eps) - ref_loss(-eps)) / (2 * eps)
    assert scale > 0
    assert abs(analytic - numeric) <= 1e-5 * scale, (analytic, numeric, scale)


@pytest.mark.parametrize("name", ["switch", "gshard_top2"])
def test_capacity_models_drop_tokens_as_documented(name):
    model = ZOO[name]
    params, x = _args(name)
    logits = np.asarray(x, np.float64) @ np.asarray(params["router"], np.float64)
    _, dropped = route_with_capacity(logits, model.top_k, model.capacity)
    assert model.capacity == math.ceil(model.hyperparams["capacity_factor"] * x.shape[0] * model.top_k
                                       / model.num_experts)
    assert dropped > 0
    assert f"{dropped} of {x.shape[0] * model.top_k}" in model.notes
    roomy = model.sized(capacity_factor=float(model.num_experts))
    assert route_with_capacity(logits, model.top_k, roomy.capacity)[1] == 0


def test_grouped_capacity_drops_per_batch_row():
    """At the default sizes some copies are dropped, and a row's drops depend on that row alone."""
    model = ZOO["grouped_capacity"]
    params, x = as_float64(_args("grouped_capacity"))
    logits = x @ params["router"]
    _, dropped = route_grouped_capacity(logits, model.top_k, model.capacity)
    assert dropped > 0
    assert model.capacity == zoo.grouped_expert_capacity(x.shape[1], model.num_experts, model.top_k, 1.0)
    one_row = [route_grouped_capacity(logits[b : b + 1], model.top_k, model.capacity)[0] for b in range(len(x))]
    assert sum(one_row, []) == route_grouped_capacity(logits, model.top_k, model.capacity)[0]
    pooled, _ = route_with_capacity(logits.reshape(-1, logits.shape[-1]), model.top_k, model.capacity * len(x))
    assert pooled != route_grouped_capacity(logits, model.top_k, model.capacity)[0]


def test_deepseek_bias_and_group_limit_change_the_selection():
    """Both routing refinements matter at the default sizes, so the reference checks them for real."""
    model = ZOO["deepseek_v3"]
    params, x = as_float64(_args("deepseek_v3"))
    hyper = _deepseek_hyper(model)

    def selections(bias, grouped):
        return [sorted(e for e, _ in route_deepseek(row, bias, model.top_k, grouped=grouped, **hyper))
                for row in x @ params["router"]]

    bias = params["e_score_correction_bias"]
    chosen = selections(bias, True)
    assert chosen != selections(np.zeros_like(bias), True)
    assert chosen != selections(bias, False)


@pytest.mark.parametrize("name", list(ZOO))
def test_bfloat16_keeps_dtype_and_stays_close(name):
    model = ZOO[name]
    params, x = _args(name, jnp.bfloat16)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params)) and x.dtype == jnp.bfloat16
    out = jax.jit(model.fn)(params, x)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    exact = np.asarray(jax.jit(model.fn)(*jax.tree.map(lambda a: a.astype(jnp.float32), (params, x))))
    token_error = np.linalg.norm(np.asarray(out, np.float32) - exact, axis=-1) / np.linalg.norm(exact, axis=-1).mean()
    # bf16 rounds each value by ~0.4%; a near-tie in the routing may flip for the odd token.
    assert np.median(token_error) < 2e-2, token_error
    assert np.mean(token_error > 5e-2) <= 1 / 16, token_error


def test_params_are_random_and_scaled_by_fan_in():
    params = ZOO["mixtral"].make_params(KEY, d=64, f=128, E=4)
    for name, fan_in in (("router", 64), ("w_gate", 64), ("w_up", 64), ("w_down", 128)):
        assert np.std(np.asarray(params[name])) == pytest.approx(1 / math.sqrt(fan_in), rel=0.1), name
    assert params["w_gate"].shape == (4, 64, 128) and params["w_down"].shape == (4, 128, 64)
    # Past the one-draw limit every weight has its own draw; the law is the same.
    big = ZOO["switch"].make_params(KEY, jnp.bfloat16, d=512, f=2048, E=16)
    assert sum(a.size for a in jax.tree.leaves(big)) > zoo._ONE_DRAW_LIMIT
    assert np.std(np.asarray(big["w_down"], np.float32)) == pytest.approx(1 / math.sqrt(2048), rel=0.05)
    assert not np.allclose(np.asarray(big["w_up"][0, :8, :8], np.float32), 0)


def test_flax_params_have_the_structure_of_module_init():
    from moe_lowering.testing.zoo import init_flax_moe

    model = ZOO["flax_moe"]
    sizes = dict(d=model.sizes.d, f=model.sizes.f, E=model.num_experts, k=model.top_k)

    def structure(tree):
        return jax.tree.map(lambda a: (a.shape, a.dtype), tree)

    assert structure(jax.eval_shape(lambda key: init_flax_moe(key, jnp.bfloat16, **sizes)[1], KEY)) == structure(
        model.make_params(KEY, jnp.bfloat16)
    )
    _, initialised = init_flax_moe(KEY, jnp.float32, **sizes)
    assert structure(initialised) == structure(model.make_params(KEY))
    # Flax's own init draws with the same N(0, 1/fan_in) law: standard deviations agree.
    for name, fan_in in (("router", model.sizes.d), ("w_up", model.sizes.d), ("w_down", model.sizes.f)):
        assert np.std(np.asarray(initialised[name])) == pytest.approx(1 / math.sqrt(fan_in), rel=0.2)


def test_sized_rejects_unknown_overrides_and_impossible_routing():
    with pytest.raises(TypeError, match="unknown overrides"):
        ZOO["mixtral"].sized(capacity_factor=2.0)
    with pytest.raises(ValueError, match="exceeds the number of experts"):
        ZOO["mixtral"].sized(E=2, k=4)
    with pytest.raises(ValueError, match="n_group"):
        ZOO["deepseek_v3"].sized(E=6, n_group=4)
    assert Sizes() == ZOO["mixtral"].sizes
