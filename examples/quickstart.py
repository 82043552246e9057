"""Quickstart: a plain dense-reference Mixtral-style MoE layer, rewritten by ``moe_optimize``.

Run: ``python examples/quickstart.py``. Prints what the pass found, then checks the rewritten
layer (output and gradients) against the untouched reference.
"""

import jax
import jax.numpy as jnp

from moe_lowering import explain, moe_optimize

T, D, F, E, K = 256, 64, 128, 8, 2


def moe_layer(params, x):
    """Every expert on every token, then a top-k weighted combine: readable, E/k times too costly."""
    probs = jax.nn.softmax(x @ params["router"], axis=-1)
    weights, experts = jax.lax.top_k(probs, K)
    weights = weights / weights.sum(-1, keepdims=True)
    combine = (jax.nn.one_hot(experts, E) * weights[..., None]).sum(1)  # [T, E]
    gate = jax.nn.silu(jnp.einsum("td,edf->tef", x, params["w_gate"]))
    up = jnp.einsum("td,edf->tef", x, params["w_up"])
    out = jnp.einsum("tef,efd->ted", gate * up, params["w_down"])
    return jnp.einsum("te,ted->td", combine, out)


def init(key):
    k = jax.random.split(key, 5)
    scale = lambda fan_in: fan_in**-0.5  # noqa: E731
    params = {
        "router": jax.random.normal(k[0], (D, E)) * scale(D),
        "w_gate": jax.random.normal(k[1], (E, D, F)) * scale(D),
        "w_up": jax.random.normal(k[2], (E, D, F)) * scale(D),
        "w_down": jax.random.normal(k[3], (E, F, D)) * scale(F),
    }
    return params, jax.random.normal(k[4], (T, D))


def main():
    params, x = init(jax.random.key(0))
    print(explain(moe_layer, params, x))

    sparse_layer = jax.jit(moe_optimize(moe_layer))
    dense_out, sparse_out = moe_layer(params, x), sparse_layer(params, x)
    error = jnp.linalg.norm(dense_out - sparse_out) / jnp.linalg.norm(dense_out)
    print(f"\noutput relative error vs dense reference: {error:.2e}")

    loss = lambda f: lambda p: jnp.sum(f(p, x) ** 2)  # noqa: E731
    g_dense = jax.grad(loss(moe_layer))(params)
    g_sparse = jax.jit(jax.grad(loss(moe_optimize(moe_layer))))(params)
    for name in params:
        err = jnp.linalg.norm(g_dense[name] - g_sparse[name]) / jnp.linalg.norm(g_dense[name])
        print(f"grad[{name}] relative error: {err:.2e}")
    assert error < 1e-5


if __name__ == "__main__":
    main()
