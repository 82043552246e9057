"""``gmm_sum`` (the rows' cotangent of a pair of products of the same rows) and its primitive.

The GPU kernel's interpreter cases are in ``test_triton_gmm_interpreter.py``; here the jnp reference
against numpy, and ``moe_gmm_sum``'s rules: a backend with ``gmm_sum`` gives the fused SwiGLU
product the same gradients as one without, and the primitive's JVP, transposes and batching agree
with the function it computes (numerical derivatives, ``vmap`` against a loop).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from moe_lowering import primitives
from moe_lowering.kernels import get_backend
from moe_lowering.kernels.grouped_matmul.reference import gmm_dense_reference, gmm_sum

CASES = {
    "empty-groups": ([0, 13, 0, 20, 3], 40, 0, 5),
    "rows-past-the-groups": ([5, 7, 11], 30, 0, 3),
    "group-offset-window": ([6, 13, 2, 9, 8], 38, 1, 3),
}


def _operands(case, key, k=7, n=9):
    group_sizes, rows, offset, num_local = CASES[case]
    keys = jax.random.split(key, 4)
    lhs_a, lhs_b = (jax.random.normal(keys[i], (rows, k)) for i in range(2))
    rhs_a, rhs_b = (jax.random.normal(keys[i], (num_local, n, k)) for i in range(2, 4))
    return lhs_a, lhs_b, rhs_a, rhs_b, jnp.asarray(group_sizes, jnp.int32), offset


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_is_the_sum_of_both_products(case):
    lhs_a, lhs_b, rhs_a, rhs_b, sizes, offset = _operands(case, jax.random.key(len(case)))
    got = gmm_sum(lhs_a, lhs_b, rhs_a, rhs_b, sizes, group_offset=offset)
    want = sum(gmm_dense_reference(lhs, rhs, sizes, group_offset=offset, transpose_rhs=True)
               for lhs, rhs in ((lhs_a, rhs_a), (lhs_b, rhs_b)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _with_sum():
    xla = get_backend("xla")
    return dataclasses.replace(xla, name="xla-sum", gmm_sum=gmm_sum)


def _bind(backend, offset):
    def f(lhs_a, lhs_b, rhs_a, rhs_b, sizes):
        lhs_a, lhs_b, rhs_a, rhs_b = map(jnp.asarray, (lhs_a, lhs_b, rhs_a, rhs_b))  # check_grads hands numpy
        return primitives.gmm_sum_p.bind(lhs_a, lhs_b, rhs_a, rhs_b, sizes, kernels=backend, group_offset=offset,
                                         preferred_element_type=None, expected_rows=None, batch=())
    return f


@pytest.mark.parametrize("case", sorted(CASES))
def test_primitive_derivatives_match_numerical_ones(case):
    """JVP (forward) and transposes (reverse), to second order, in float32."""
    lhs_a, lhs_b, rhs_a, rhs_b, sizes, offset = _operands(case, jax.random.key(3))
    f = _bind(_with_sum(), offset)
    args = (lhs_a, lhs_b, rhs_a, rhs_b)
    product = jax.jit(lambda *x: f(*x, sizes))  # its derivatives run jitted too: op by op took 3x as long
    check_grads(product, args, order=2, modes=("fwd",), atol=5e-2, rtol=5e-2, eps=1e-2)
    check_grads(product, args, order=1, modes=("rev",), atol=5e-2, rtol=5e-2, eps=1e-2)
    # second order in reverse mode (transposes of the transposes) against forward over reverse
    grad = jax.grad(lambda a, rb: jnp.sum(jnp.sin(f(a, lhs_b, rhs_a, rb, sizes))), argnums=(0, 1))
    probe = lambda a, rb: jnp.sum(jnp.cos(grad(a, rb)[0])) + jnp.sum(jnp.cos(grad(a, rb)[1]))  # noqa: E731
    for rev, fwd in zip(jax.jit(jax.grad(probe, argnums=(0, 1)))(lhs_a, rhs_b),
                        jax.jit(jax.jacfwd(probe, argnums=(0, 1)))(lhs_a, rhs_b)):
        np.testing.assert_allclose(rev, fwd, rtol=1e-3, atol=1e-3)


def test_primitive_under_vmap_matches_a_loop():
    lhs_a, lhs_b, rhs_a, rhs_b, sizes, offset = _operands("empty-groups", jax.random.key(4))
    f = _bind(_with_sum(), offset)
    batch_a = jnp.stack([lhs_a, 2 * lhs_a, -lhs_a])
    got = jax.vmap(f, in_axes=(0, None, None, None, None))(batch_a, lhs_b, rhs_a, rhs_b, sizes)
    want = jnp.stack([f(a, lhs_b, rhs_a, rhs_b, sizes) for a in batch_a])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    grads = jax.vmap(jax.grad(lambda a, rb: jnp.sum(jnp.sin(f(a, lhs_b, rhs_a, rb, sizes))), argnums=(0, 1)),
                     in_axes=(0, None))(batch_a, rhs_b)
    for i, a in enumerate(batch_a):
        one = jax.grad(lambda a, rb: jnp.sum(jnp.sin(f(a, lhs_b, rhs_a, rb, sizes))), argnums=(0, 1))(a, rhs_b)
        np.testing.assert_allclose(grads[0][i], one[0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(grads[1][i], one[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_swiglu_gradients_with_and_without_gmm_sum_agree(case):
    """The fused SwiGLU product's backward through ``gmm_sum`` equals the one through two transposed
    products added in float32 (both the jnp references here)."""
    lhs_a, _, _, _, sizes, offset = _operands(case, jax.random.key(5))
    keys = jax.random.split(jax.random.key(6), 2)
    num_local = CASES[case][3]
    gate, up = (jax.random.normal(key, (num_local, lhs_a.shape[1], 11)) for key in keys)

    def loss(backend):
        def f(x, g, u):
            out = primitives.swiglu_gmm(x, g, u, sizes, backend, group_offset=offset)
            return jnp.sum(jnp.cos(out))
        return jax.grad(f, argnums=(0, 1, 2))

    with_sum = loss(_with_sum())(lhs_a, gate, up)
    without = loss(get_backend("xla"))(lhs_a, gate, up)
    for got, want in zip(with_sum, without):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(loss(_with_sum()))(lhs_a, gate, up))
    assert "moe_gmm_sum" in jaxpr
