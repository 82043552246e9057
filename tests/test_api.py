"""Contracts of the public API: explain's report, the warning and the strict error, word for word."""

from __future__ import annotations

import logging
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

from moe_lowering import MoeNotFoundError, NoMoeFoundWarning, explain, moe_optimize
from moe_lowering.testing.zoo import ZOO


def _escaping_moe(params, x):
    """Mixtral, except the dense expert activations are also returned: the rewrite must decline."""
    weights, idx = jax.lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
    gate = (jax.nn.one_hot(idx, params["router"].shape[-1]) * weights[..., None]).sum(1)
    hidden = jax.nn.relu(jnp.einsum("td,edf->tef", x, params["w_up"]))
    out = jnp.einsum("tef,efd->ted", hidden, params["w_down"])
    return jnp.einsum("te,ted->td", gate, out), hidden.mean()


def _params(T=8, d=4, f=6, E=4):
    k = jax.random.split(jax.random.key(0), 4)
    return {"router": jax.random.normal(k[0], (d, E)), "w_up": jax.random.normal(k[1], (E, d, f)),
            "w_down": jax.random.normal(k[2], (E, f, d))}, jax.random.normal(k[3], (T, d))


def test_explain_summary_of_a_region():
    model = ZOO["mixtral"]
    params, x = model.args(jax.random.key(0))
    report = explain(model.fn, params, x)
    text = str(report)
    assert text.startswith("moe_lowering: 1 MoE region(s) found\nMoE region (one-hot gate) at ")
    s = model.sizes
    assert f"  tokens={s.T} experts={s.E} top_k={s.k} d_model={s.d} d_ff={s.f} dtype=float32\n" in text
    region = report.regions[0]
    assert region.dense_flops == s.E * region.rewritten_flops // s.k
    assert region.to_dict()["style"] == "one-hot gate"


def test_interior_value_used_outside_declines_with_reason():
    params, x = _params()
    report = explain(_escaping_moe, params, x)
    assert report.regions == ()
    reason = report.near_misses[0].reason
    assert reason.startswith("an interior value of the MoE (the expert activations [8, 4, 6]) is also used outside it")
    with pytest.raises(MoeNotFoundError) as err:
        moe_optimize(_escaping_moe, strict=True)(params, x)
    assert "an interior value of the MoE" in str(err.value)


def test_ensemble_near_miss_names_the_missing_piece():
    def ensemble_with_router(params, x):
        _, idx = jax.lax.top_k(x @ params["router"], 2)
        out = jnp.einsum("td,edf->tef", x, params["w_up"]).sum(1)
        return out, idx

    params, x = _params()
    report = explain(ensemble_with_router, params, x)
    assert [m.reason for m in report.near_misses] == [
        "expert outputs are summed over experts without routing weights (an ensemble, not a routed MoE)"
    ]


def test_no_routing_at_all():
    report = explain(lambda x: x * 2, jnp.ones(3))
    assert str(report) == (
        "moe_lowering: 0 MoE region(s) found\n"
        "no routing decision (top_k or argmax over an expert axis) in the traced program"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert moe_optimize(lambda x: x * 2)(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]
    assert len(caught) == 1 and caught[0].category is NoMoeFoundWarning
    assert str(caught[0].message).startswith("moe_optimize: no MoE region rewritten in ")


def test_group_limited_routing_reports_no_spurious_near_miss():
    model = ZOO["deepseek_v3"]
    params, x = model.args(jax.random.key(0))
    report = explain(model.fn, params, x)
    assert len(report.regions) == 1 and report.near_misses == ()


def test_eager_calls_trace_once_per_signature():
    model = ZOO["mixtral"]
    traces = []

    def counted(params, x):
        traces.append(x.shape)
        return model.fn(params, x)

    params, x = model.args(jax.random.key(0))
    layer = moe_optimize(counted)
    first, again = layer(params, x), layer(params, x + 1.0)
    assert traces == [x.shape]  # the second call reuses the first call's compiled rewrite
    assert jnp.allclose(first, model.fn(params, x), rtol=1e-5, atol=1e-5)
    assert jnp.allclose(again, model.fn(params, x + 1.0), rtol=1e-5, atol=1e-5)
    shorter = x[: x.shape[0] // 2]
    assert jnp.allclose(layer(params, shorter), model.fn(params, shorter), rtol=1e-5, atol=1e-5)
    assert traces == [x.shape, shorter.shape]  # a new shape is a new signature
    jax.jit(layer)(params, x)
    assert len(traces) == 3  # under an outer jit the rewrite traces with it, uncached


def test_strict_message_for_a_top_k_that_routes_nothing():
    """A top_k whose indices are unused is not 'no routing': the message says what is missing."""
    import jax
    import jax.numpy as jnp
    import pytest

    from moe_lowering import MoeNotFoundError, moe_optimize

    def scores_only(x):
        values, _ = jax.lax.top_k(x, 2)
        return values.sum()

    with pytest.raises(MoeNotFoundError, match="whose indices reach an expert computation"):
        moe_optimize(scores_only, strict=True)(jnp.ones((4, 8)))


def test_info_log_times_tracing_matching_lowering_and_compiling(caplog):
    """A first call can trace and compile for a minute: at INFO the log says where that time went."""
    model = ZOO["mixtral"]
    params, x = model.args(jax.random.key(0))
    name = re.escape(model.fn.__qualname__)
    seconds = r"\d[\d.e+-]* s"
    with caplog.at_level(logging.INFO, logger="moe_lowering"):
        layer = moe_optimize(model.fn)
        out = layer(params, x)
        layer(params, x + 1.0)  # cached: logs nothing more
        explain(model.fn, params, x)
    messages = [r.getMessage() for r in caplog.records if r.name == "moe_lowering"]
    expected = [
        rf"tracing {name}",
        rf"rewrote 1 MoE region\(s\) in {name} \(traced in {seconds}, matched in {seconds}\)",
        rf"{name}: rewritten program lowered in {seconds}, compiled in {seconds}",
        rf"explain\({name}\): traced in {seconds}, matched in {seconds}: 1 MoE region\(s\)",
    ]
    assert len(messages) == len(expected), messages
    for pattern, message in zip(expected, messages):
        assert re.fullmatch(pattern, message), (pattern, message)
    assert jnp.allclose(out, model.fn(params, x), rtol=1e-5, atol=1e-5)


def test_info_log_when_nothing_is_rewritten(caplog):
    with caplog.at_level(logging.INFO, logger="moe_lowering"), warnings.catch_warnings():
        warnings.simplefilter("ignore", NoMoeFoundWarning)
        moe_optimize(lambda x: x * 2)(jnp.ones(3))
    messages = [r.getMessage() for r in caplog.records if r.name == "moe_lowering"]
    assert re.fullmatch(r"no MoE region to rewrite in .*<lambda> \(traced in \d[\d.e+-]* s, "
                        r"matched in \d[\d.e+-]* s\)", messages[-1]), messages


def test_explain_says_a_program_that_is_already_sparse_is_so():
    """A layer written with ``ragged_dot`` over expert-sorted rows has nothing to rewrite, and says why."""
    num_tokens, d, f, num_experts, k = 16, 8, 16, 4, 2

    def sparse_layer(params, x):
        weights, index = jax.lax.top_k(jax.nn.softmax(x @ params["router"]), k)
        order = jnp.argsort(index.reshape(-1))
        sizes = jnp.bincount(index.reshape(-1), length=num_experts)
        rows = jnp.repeat(x, k, axis=0)[order]
        out = jax.lax.ragged_dot(jax.nn.relu(jax.lax.ragged_dot(rows, params["w_up"], sizes)), params["w_down"], sizes)
        out = jnp.zeros_like(out).at[order].set(out).reshape(num_tokens, k, d)
        return (out * weights[..., None]).sum(1)

    keys = jax.random.split(jax.random.key(0), 4)
    params = {"router": jax.random.normal(keys[0], (d, num_experts)),
              "w_up": jax.random.normal(keys[1], (num_experts, d, f)),
              "w_down": jax.random.normal(keys[2], (num_experts, f, d))}
    x = jax.random.normal(keys[3], (num_tokens, d))
    report = explain(sparse_layer, params, x)
    assert not report.regions and len(report.already_sparse) == 2
    assert "already runs a sparse MoE (ragged_dot" in str(report)
    with pytest.raises(MoeNotFoundError, match="already runs a sparse MoE"):
        moe_optimize(sparse_layer, strict=True)(params, x)
