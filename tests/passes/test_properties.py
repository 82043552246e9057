"""Property-based: random sizes, routing styles, activations and dtypes all rewrite and match."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from moe_lowering import explain, moe_optimize
from moe_lowering.testing.zoo import ZOO

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
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
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
    g_ref = jax.grad(loss(model.fn), argnums=(0, 1))(params32, x32)
    g_dense = jax.grad(loss(model.fn), argnums=(0, 1))(params, x)
    g_new = jax.grad(loss(sparse), argnums=(0, 1))(params, x)
    floor = 1e-2 * np.sqrt(sum(float(jnp.sum(jnp.square(g))) for g in jax.tree.leaves(g_ref)))
    for exact_g, dense_g, new_g in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_dense), jax.tree.leaves(g_new)):
        assert _rel(exact_g, new_g, floor) <= max(tolerance, 2 * _rel(exact_g, dense_g, floor))
