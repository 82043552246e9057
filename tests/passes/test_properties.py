"""Property-based: random sizes, routing styles, activations and dtypes all rewrite and match; and
no input the undecorated program accepts (k = 0, k past E, no token, no slot, one expert) raises
from inside the pass: the decorated call matches the program or declines with a reason."""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from moe_lowering import NoMoeFoundWarning, explain, moe_optimize
from moe_lowering.testing.zoo import ZOO

DRAWN_EXAMPLES = int(os.environ.get("MOE_PROPERTY_EXAMPLES", "6"))
"""Drawn cases per property test (the zoo-at-tiny-sizes test draws two thirds as many); the
explicit ``@example`` cases (past regressions) always run. CI (.ci/run) draws 3."""

STYLES = ("mixtral", "mixtral_logits_topk", "hf_loop", "gather_combine", "deepseek_v3", "mlp_gelu",
          "mlp_relu_bias", "mlp_squared_relu", "gpt_oss", "mixtral_bsd")


@st.composite
def moe_cases(draw):
    style = draw(st.sampled_from(STYLES))
    num_experts = draw(st.sampled_from([2, 4, 6, 8]))
    top_k = draw(st.integers(1, min(3, num_experts - 1)))  # k = E saves nothing: declined by design
    sizes = dict(T=draw(st.sampled_from([4, 9, 16, 33])), d=draw(st.sampled_from([3, 8, 12])),
                 f=draw(st.sampled_from([5, 16, 24])), E=num_experts, k=top_k)
    if style == "mixtral_bsd":
        sizes.update(B=2, T=max(2, sizes["T"] - sizes["T"] % 2))
    if style == "deepseek_v3":
        sizes.update(E=8, k=min(top_k, 2))
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    seed = draw(st.integers(0, 2**16))
    return style, sizes, dtype, seed


def _rel(a, b, floor=1e-30):
    """Relative error; ``floor`` keeps a leaf whose true gradient is ~0 from dividing noise by noise."""
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(a), floor)


# derandomize: the same examples every run. Drawn afresh, CI once met a bf16 case where the
# comparison is a coin flip rather than a check (deepseek_v3, T=4 d=3 f=5 E=8 k=1, seed 69: an output
# near 9 lands one bf16 ulp lower than the dense path's, and cos' of it moves the gradient 13% against
# the dense path's 3%); see benchmarks/NOTES.md, "Property test in bf16".
@settings(max_examples=DRAWN_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(moe_cases())
@example(("gather_combine", dict(T=4, d=3, f=5, E=2, k=1), jnp.float32, 0))  # k=1: per-token weights only
@example(("hf_loop", dict(T=9, d=12, f=24, E=6, k=3), jnp.bfloat16, 7))
def test_random_moe_rewrites_and_matches(case):
    style, sizes, dtype, seed = case
    model = ZOO[style].sized(**sizes)
    params, x = model.args(jax.random.key(seed), dtype)
    assert len(explain(model.fn, params, x).regions) == 1
    sparse = moe_optimize(model.fn, strict=True)
    tolerance = 1e-5 if dtype == jnp.float32 else 3e-2
    params32, x32 = jax.tree.map(lambda a: a.astype(jnp.float32), (params, x))
    exact = model.fn(params32, x32)
    dense_error = _rel(exact, model.fn(params, x))
    assert _rel(exact, jax.jit(sparse)(params, x)) <= max(tolerance, 2 * dense_error)
    loss = lambda f: lambda p, x: jnp.sum(jnp.cos(f(p, x).astype(jnp.float32)))  # noqa: E731
    # jitted, one program each (op by op, the gradients took twice as long on a CPU)
    g_ref = jax.jit(jax.grad(loss(model.fn), argnums=(0, 1)))(params32, x32)
    g_dense = jax.jit(jax.grad(loss(model.fn), argnums=(0, 1)))(params, x)
    g_new = jax.jit(jax.grad(loss(sparse), argnums=(0, 1)))(params, x)
    floor = 1e-2 * np.sqrt(sum(float(jnp.sum(jnp.square(g))) for g in jax.tree.leaves(g_ref)))
    for exact_g, dense_g, new_g in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_dense), jax.tree.leaves(g_new)):
        assert _rel(exact_g, new_g, floor) <= max(tolerance, 2 * _rel(exact_g, dense_g, floor))


# --------------------------------------------------------------------------- nothing raises from inside the pass


def _activation(name):
    return {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "silu": jax.nn.silu}[name]


def _grammar_layer(routing: str, combine: str, activation: str, k: int, capacity: int):
    """A layer from a small grammar of routing decisions and combines (biased experts, so an
    empty capacity slot's output is not zero). ``argmax_and_kth``: GShard's two choices from two
    decisions, the argmax and the k-th of a top-k (the same expert twice when k = 1)."""
    act = _activation(activation)

    def layer(params, x):
        num_experts = params["router"].shape[-1]
        logits = x @ params["router"]
        probs = jax.nn.softmax(logits, axis=-1)
        if routing == "top_k_of_probs":
            weights, index = jax.lax.top_k(probs, k)
        elif routing == "softmax_of_top_k_logits":
            top, index = jax.lax.top_k(logits, k)
            weights = jax.nn.softmax(top, axis=-1)
        else:  # argmax_and_kth
            index = jnp.stack([jnp.argmax(probs, -1), jax.lax.top_k(probs, k)[1][:, -1]], axis=1)
            weights = jnp.take_along_axis(probs, index, axis=1)
        mask = jax.nn.one_hot(index, num_experts, dtype=jnp.int32)  # [T, choices, E]
        if combine == "gate":
            gate = jnp.sum(mask * weights[..., None], axis=1)
            hidden = act(jnp.einsum("td,edf->tef", x, params["w_up"]) + params["b_up"])
            return jnp.einsum("te,ted->td", gate, jnp.einsum("tef,efd->ted", hidden, params["w_down"]))
        dispatch = jnp.zeros(mask.shape[:1] + mask.shape[2:] + (capacity,), x.dtype)  # [T, E, C]
        combined = dispatch
        taken = jnp.zeros((num_experts,), jnp.int32)
        for j in range(mask.shape[1]):  # each choice queues after the earlier choices (GShard)
            position = jnp.cumsum(mask[:, j], axis=0) - 1 + taken
            kept = mask[:, j] * (position < capacity)
            taken = taken + kept.sum(axis=0)
            slots = jax.nn.one_hot(position, capacity, dtype=x.dtype) * kept[..., None].astype(x.dtype)
            dispatch = dispatch + slots
            combined = combined + weights[:, j, None, None] * slots
        hidden = act(jnp.einsum("tec,td->ecd", dispatch, x) @ params["w_up"] + params["b_up"][:, None])
        return jnp.einsum("tec,ecd->td", combined, hidden @ params["w_down"] + params["b_down"][:, None])

    return layer


def _grammar_params(key, d, f, num_experts):
    k = jax.random.split(key, 6)
    return {"router": jax.random.normal(k[0], (d, num_experts)),
            "w_up": jax.random.normal(k[1], (num_experts, d, f)) / np.sqrt(d),
            "b_up": 0.1 * jax.random.normal(k[2], (num_experts, f)),
            "w_down": jax.random.normal(k[3], (num_experts, f, d)) / np.sqrt(f),
            "b_down": 0.1 * jax.random.normal(k[4], (num_experts, d))}, k[5]


@st.composite
def grammar_cases(draw):
    """Typical values first (hypothesis tries a list's first entries most), the edges after them."""
    routing = draw(st.sampled_from(["top_k_of_probs", "argmax_and_kth", "softmax_of_top_k_logits"]))
    num_experts = draw(st.sampled_from([4, 3, 2, 1]))
    k = draw(st.sampled_from([1, 2, 0, num_experts, num_experts + 1]))  # what the program accepts is kept
    combine = draw(st.sampled_from(["capacity", "gate"]))
    tokens = draw(st.sampled_from([8, 5, 3, 1, 0]))
    capacity = draw(st.sampled_from([max(1, tokens // 2), tokens, 1, 0]))
    activation = draw(st.sampled_from(["gelu", "relu", "silu"]))
    return routing, combine, activation, k, capacity, dict(T=tokens, d=draw(st.sampled_from([3, 2])),
                                                            f=draw(st.sampled_from([5, 2])), E=num_experts)


def _outputs_and_gradients(fn):
    """``fn``'s outputs and the gradients of a loss of them (every input), in one compiled call."""

    def loss(params, x):
        out = fn(params, x)
        return jnp.sum(jnp.sin(out)), out

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


def _decorated_matches_or_declines(fn, params, x):
    """The pass either rewrites ``fn`` to its outputs and gradients (every input) or declines with a
    ``NoMoeFoundWarning``; an exception from the decorated call, where ``fn`` itself runs, fails."""
    try:
        expected_grads, expected = _outputs_and_gradients(fn)(params, x)
    except Exception:  # noqa: BLE001 - the program itself rejects this input (k > E, an empty axis indexed)
        assume(False)
    rewritten = bool(explain(fn, params, x).regions)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_grads, got = _outputs_and_gradients(moe_optimize(fn))(params, x)
    declined = [w for w in caught if issubclass(w.category, NoMoeFoundWarning)]
    assert rewritten or (declined and str(declined[0].message)), "neither rewritten nor declined with a reason"
    scale = max([1.0] + [float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected_grads) if g.size])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(expected_grads), jax.tree.leaves(got_grads)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * scale)


@settings(max_examples=DRAWN_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(grammar_cases(), st.integers(0, 2**16))
@example(("top_k_of_probs", "gate", "gelu", 0, 1, dict(T=8, d=3, f=5, E=4)), 0)  # issue 38: k = 0
@example(("argmax_and_kth", "capacity", "gelu", 2, 8, dict(T=8, d=3, f=5, E=2)), 0)  # issue 38: k summed past E
@example(("argmax_and_kth", "gate", "relu", 1, 1, dict(T=5, d=2, f=2, E=3)), 1)  # the argmax chosen twice
@example(("top_k_of_probs", "capacity", "silu", 1, 0, dict(T=3, d=2, f=2, E=2)), 2)  # no slot at all
@example(("softmax_of_top_k_logits", "gate", "relu", 1, 1, dict(T=0, d=2, f=2, E=2)), 3)  # no token
def test_no_accepted_input_raises_inside_the_pass(case, seed):
    routing, combine, activation, k, capacity, sizes = case
    params, key = _grammar_params(jax.random.key(seed), sizes["d"], sizes["f"], sizes["E"])
    x = jax.random.normal(key, (sizes["T"], sizes["d"]))
    _decorated_matches_or_declines(_grammar_layer(routing, combine, activation, k, capacity), params, x)


@settings(max_examples=max(1, DRAWN_EXAMPLES * 2 // 3), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["switch", "gshard_top2", "gshard_top2_outer", "batch_prioritized", "grouped_capacity",
                        "mixtral", "deepseek_v3", "gather_combine", "hf_loop"]),
       st.sampled_from([5, 3, 2, 1]), st.sampled_from([4, 2, 3, 1]), st.sampled_from([2, 1, 3, 4]), st.integers(0, 2**16))
@example("gshard_top2", 2, 2, 2, 0)  # k = E, two tokens
@example("switch", 1, 1, 1, 0)  # one token, one expert
def test_zoo_at_tiny_sizes_matches_or_declines(style, tokens, num_experts, top_k, seed):
    """The zoo's layers at the smallest sizes they build at (``sized`` rejects k > E and a k the
    style does not have)."""
    try:
        model = ZOO[style].sized(T=tokens, d=3, f=4, E=num_experts, k=top_k, B=1)
        params, x = model.args(jax.random.key(seed))
    except ValueError:
        assume(False)
    _decorated_matches_or_declines(model.fn, params, x)
