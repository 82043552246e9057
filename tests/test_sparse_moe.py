"""The sorted sparse MoE on its own: sorting, dropped copies, and its hand-written backward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_lowering.expert_program import Elementwise, ExpertMatmul, ExpertProgram, ParamKind, RowInput, topological_nodes
from moe_lowering.sparse_moe import sort_by_expert, sparse_moe

T, D, F, E, K = 24, 8, 12, 5, 2


def _relu_program():
    eqn = jax.make_jaxpr(lambda a: jnp.maximum(a, 0.5 * a))(jnp.ones(3)).eqns
    up = ExpertMatmul(RowInput(), 0)
    scaled = Elementwise(eqn[0].primitive, tuple(eqn[0].params.items()), (up, _literal(0.5)))
    leaky = Elementwise(eqn[1].primitive, tuple(eqn[1].params.items()), (up, scaled))
    out = ExpertMatmul(leaky, 1)
    return ExpertProgram(out, (ParamKind.EXPERT_WEIGHT,) * 2, topological_nodes(out))


def _literal(value):
    from moe_lowering.expert_program import Literal

    return Literal(np.float32(value))


def _loop_reference(x, idx, w, w_up, w_down):
    out = np.zeros((T, D))
    for t in range(T):
        for j in range(K):
            e = int(idx[t, j])
            if 0 <= e < E:
                h = np.asarray(x[t], np.float64) @ np.asarray(w_up[e], np.float64)
                out[t] += float(w[t, j]) * (np.maximum(h, 0.5 * h) @ np.asarray(w_down[e], np.float64))
    return out


def test_sort_is_stable_and_counts_on_device():
    idx = jnp.asarray([[2, 0], [2, 1], [0, 2], [5, 2]], jnp.int32)  # 5 == E: a dropped copy
    routing = sort_by_expert(idx, E)
    np.testing.assert_array_equal(routing.group_sizes, [2, 1, 4, 0, 0])
    np.testing.assert_array_equal(routing.expert_of_row, [0, 0, 1, 2, 2, 2, 2, 5])
    np.testing.assert_array_equal(routing.token_of_row[3:7], [0, 1, 2, 3])  # ties keep token order


def test_counting_sort_equals_the_comparison_sort(monkeypatch):
    """Both ways of sorting give the same routing, dropped and out-of-range choices included."""
    import moe_lowering.sparse_moe as sparse_moe_module

    for tokens, top_k, experts in [(512, 2, 8), (37, 3, 5), (96, 8, 64)]:
        idx = jax.random.randint(jax.random.key(tokens), (tokens, top_k), -2, experts + 2)
        monkeypatch.setattr(sparse_moe_module, "COUNTING_SORT_MAX_PAIRS", 1 << 30)
        counted = sort_by_expert(idx, experts)
        monkeypatch.setattr(sparse_moe_module, "COUNTING_SORT_MAX_PAIRS", 0)
        compared = sort_by_expert(idx, experts)
        assert not np.array_equal(counted.order, np.arange(tokens * top_k))  # a sort that moved rows
        for field, a, b in zip(counted._fields, counted, compared):
            np.testing.assert_array_equal(a, b, err_msg=field)


@pytest.mark.parametrize("experts", [1, 5, 64])
def test_group_sizes_count_each_experts_copies(experts):
    """Group sizes from where each expert's sorted run starts: empty experts (first, middle, last),
    dropped copies and a single expert, against a count."""
    for seed, (tokens, top_k) in enumerate([(40, 2), (3, 1), (200, 4)]):
        idx = jax.random.randint(jax.random.key(seed), (tokens, top_k), -1, experts + 1)
        idx = jnp.where(idx % 3 == 1, experts, idx)  # many dropped, some experts left empty
        want = np.bincount(np.asarray(idx).reshape(-1)[(np.asarray(idx).reshape(-1) >= 0)
                                                      & (np.asarray(idx).reshape(-1) < experts)], minlength=experts)
        np.testing.assert_array_equal(sort_by_expert(idx, experts).group_sizes, want)
    np.testing.assert_array_equal(sort_by_expert(jnp.full((4, 2), experts), experts).group_sizes,
                                  np.zeros(experts))  # every copy dropped


def test_dropped_copies_contribute_nothing_and_gradients_match():
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (T, D))
    w_up = jax.random.normal(keys[1], (E, D, F)) / np.sqrt(D)
    w_down = jax.random.normal(keys[2], (E, F, D)) / np.sqrt(F)
    idx = jax.random.randint(keys[3], (T, K), 0, E + 1)  # some copies are E: dropped
    w = jax.random.uniform(keys[4], (T, K))
    program = _relu_program()

    def layer(x, w, w_up, w_down):
        return sparse_moe(x, idx, w, [w_up, w_down], program, num_experts=E, backend="xla")

    np.testing.assert_allclose(layer(x, w, w_up, w_down), _loop_reference(x, idx, w, w_up, w_down), rtol=1e-5, atol=1e-5)

    def dense(x, w, w_up, w_down):
        h = jnp.einsum("td,edf->tef", x, w_up)
        out = jnp.einsum("tef,efd->ted", jnp.maximum(h, 0.5 * h), w_down)
        gate = (jax.nn.one_hot(idx, E) * w[..., None]).sum(1)  # one_hot of E is all zeros: dropped
        return jnp.einsum("te,ted->td", gate, out)

    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    for g_sparse, g_dense in zip(jax.grad(loss(layer), argnums=(0, 1, 2, 3))(x, w, w_up, w_down),
                                 jax.grad(loss(dense), argnums=(0, 1, 2, 3))(x, w, w_up, w_down)):
        np.testing.assert_allclose(g_sparse, g_dense, rtol=1e-5, atol=1e-6)


def _log_square_program():
    """``log((relu-ish(x @ up) @ down)^2)``: finite on the groups' rows, ``-inf`` on rows the grouped
    products leave zero (the dropped copies' rows)."""
    relu = _relu_program()
    eqns = jax.make_jaxpr(lambda a: jnp.log(a * a))(jnp.ones(3)).eqns
    square = Elementwise(eqns[0].primitive, tuple(eqns[0].params.items()), (relu.output, relu.output))
    out = Elementwise(eqns[1].primitive, tuple(eqns[1].params.items()), (square,))
    return ExpertProgram(out, relu.param_kinds, topological_nodes(out))


def test_dropped_copies_with_non_finite_rows_contribute_nothing():
    """A dropped copy's row may hold anything (here ``-inf``, and its weight is not zero): neither the
    output nor any gradient may see it, as in the dense layer, where that copy's gate is zero."""
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (T, D))
    w_up = jax.random.normal(keys[1], (E, D, F)) / np.sqrt(D)
    w_down = jax.random.normal(keys[2], (E, F, D)) / np.sqrt(F)
    idx = jax.random.randint(keys[3], (T, K), 0, E + 1)
    assert int((idx == E).sum()) > 0
    w = jax.random.uniform(keys[4], (T, K), minval=0.5)
    program = _log_square_program()

    def layer(x, w, w_up, w_down):
        return sparse_moe(x, idx, w, [w_up, w_down], program, num_experts=E, backend="xla")

    def dense(x, w, w_up, w_down):
        h = jnp.einsum("td,edf->tef", x, w_up)
        out = jnp.einsum("tef,efd->ted", jnp.maximum(h, 0.5 * h), w_down)
        gate = (jax.nn.one_hot(idx, E) * w[..., None]).sum(1)
        return jnp.einsum("te,ted->td", gate, jnp.log(out * out))

    np.testing.assert_allclose(layer(x, w, w_up, w_down), dense(x, w, w_up, w_down), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    for g_sparse, g_dense in zip(jax.grad(loss(layer), argnums=(0, 1, 2, 3))(x, w, w_up, w_down),
                                 jax.grad(loss(dense), argnums=(0, 1, 2, 3))(x, w, w_up, w_down)):
        assert np.isfinite(np.asarray(g_sparse)).all()
        np.testing.assert_allclose(g_sparse, g_dense, rtol=1e-3, atol=1e-4)  # log(y^2): 1/y amplifies rounding


def test_combine_family_ignores_the_dropped_rows():
    """``combine`` reads no row past ``num_valid`` (NaN there), its weight cotangent is zero for dropped
    copies, ``spread`` writes zeros there; each is checked against a loop over the kept copies."""
    from moe_lowering import primitives
    from moe_lowering.sparse_moe import combine

    keys = jax.random.split(jax.random.key(2), 4)
    idx = jax.random.randint(keys[0], (T, K), 0, E + 1)
    routing = sort_by_expert(idx, E)
    num_valid = int(routing.group_sizes.sum())
    assert num_valid < T * K
    rows = jax.random.normal(keys[1], (T * K, D)).at[num_valid:].set(jnp.nan)
    weights = jax.random.uniform(keys[2], (T, K))
    d_out = jax.random.normal(keys[3], (T, D))
    out, vjp = jax.vjp(lambda r, w: combine(r, w, routing), rows, weights)
    d_rows, d_weights = vjp(d_out)

    inverse, kept = np.asarray(routing.inverse), np.asarray(idx) < E
    want_out, want_d_rows, want_d_weights = np.zeros((T, D)), np.zeros((T * K, D)), np.zeros((T, K))
    for t in range(T):
        for j in range(K):
            if kept[t, j]:
                row = inverse[t, j]
                want_out[t] += float(weights[t, j]) * np.asarray(rows[row], np.float64)
                want_d_rows[row] = float(weights[t, j]) * np.asarray(d_out[t], np.float64)
                want_d_weights[t, j] = np.dot(np.asarray(d_out[t], np.float64), np.asarray(rows[row], np.float64))
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_rows, want_d_rows, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d_weights, want_d_weights, rtol=1e-5, atol=1e-5)
    spread = primitives.spread_p.bind(d_out, weights, routing.inverse, routing.token_of_row, routing.order,
                                      jnp.int32(num_valid), dtype=jnp.dtype(jnp.float32), batch=())
    np.testing.assert_array_equal(spread, d_rows)


def _pair_operands(seed=3, rows=37, k=16, n=24, groups=(9, 0, 13, 8), group_offset=1, local_groups=2):
    keys = jax.random.split(jax.random.key(seed), 5)
    lhs = jax.random.normal(keys[0], (rows, k), jnp.float32)
    rhs_a, rhs_b = (jax.random.normal(key, (local_groups, k, n), jnp.float32) for key in keys[1:3])
    cotangents = tuple(jax.random.normal(key, (rows, n), jnp.float32) for key in keys[3:])
    return lhs, rhs_a, rhs_b, jnp.asarray(groups, jnp.int32), group_offset, cotangents


def _pair_and_two(backend, zero_outside):
    """Outputs and gradients of ``expert_matmul_pair`` and of two ``expert_matmul`` calls."""
    from moe_lowering.sparse_moe import expert_matmul, expert_matmul_pair

    lhs, rhs_a, rhs_b, sizes, offset, (d_a, d_b) = _pair_operands()

    def loss(products, lhs, rhs_a, rhs_b):
        out_a, out_b = products(lhs, rhs_a, rhs_b)
        rows = jnp.sum(sizes[offset:offset + rhs_a.shape[0]])  # rows past the local groups may be unspecified
        live = (jnp.arange(lhs.shape[0]) < jnp.sum(sizes[:offset]) + rows)[:, None]
        return jnp.sum(jnp.where(live, out_a * d_a + out_b * d_b, 0.0)), (out_a, out_b)

    def pair(lhs, rhs_a, rhs_b):
        return expert_matmul_pair(lhs, rhs_a, rhs_b, sizes, backend, offset, None, zero_outside)

    def two(lhs, rhs_a, rhs_b):
        return tuple(expert_matmul(lhs, rhs, sizes, backend, offset, None, zero_outside) for rhs in (rhs_a, rhs_b))

    return [jax.jit(jax.grad(functools.partial(loss, products), argnums=(0, 1, 2), has_aux=True))(lhs, rhs_a, rhs_b)
            for products in (pair, two)]


def _assert_same(pair, two):
    (grads_pair, outs_pair), (grads_two, outs_two) = pair, two
    for got, want in zip((*outs_pair, *grads_pair), (*outs_two, *grads_two)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("zero_outside", [True, False])
def test_expert_matmul_pair_equals_two_expert_matmuls(zero_outside):
    """Outputs and the gradients of lhs and both weights, on the XLA backend (no ``gmm_pair``)."""
    _assert_same(*_pair_and_two("xla", zero_outside))


def test_expert_matmul_pair_runs_the_backends_pair(monkeypatch):
    """A backend's ``gmm_pair`` gives the forward (called once per pair), its ``gmm``/``tgmm`` the backward."""
    from moe_lowering import sparse_moe
    from moe_lowering.kernels import KernelBackend, get_backend

    xla = get_backend("xla")
    calls = []

    def gmm_pair(lhs, rhs_a, rhs_b, group_sizes, **options):
        calls.append(options)
        return tuple(xla.gmm(lhs, rhs, group_sizes, **options) for rhs in (rhs_a, rhs_b))

    with_pair = KernelBackend(name="xla-pair", gmm=xla.gmm, tgmm=xla.tgmm, gmm_pair=gmm_pair)
    monkeypatch.setattr(sparse_moe, "get_backend", lambda name: with_pair if name == "xla-pair" else get_backend(name))
    pair, two = _pair_and_two("xla-pair", zero_outside=False)
    assert len(calls) == 1 and calls[0]["zero_outside"] is False, calls
    _assert_same(pair, two)


def _dense_gmm(lhs, rhs, sizes):
    from moe_lowering.kernels.grouped_matmul import gmm_dense_reference

    return gmm_dense_reference(lhs, rhs, sizes)


@pytest.mark.parametrize("batched", [(True, False, True), (False, True, False), (True, True, True),
                                     (False, False, True)], ids=["rows+sizes", "weights", "all", "sizes"])
def test_grouped_products_under_vmap_jvp_and_grad(batched):
    """``grouped_matmul``, ``grouped_matmul_pair`` and ``grouped_swiglu_matmul`` (primitives with
    batching, JVP and transpose rules) against dense per-group products, with any operands batched:
    values, tangents, and gradients through the batching levels (rows past the groups included)."""
    from moe_lowering.sparse_moe import grouped_matmul, grouped_matmul_pair, grouped_swiglu_matmul

    B, M, Kd, N = 3, 19, 6, 5
    keys = jax.random.split(jax.random.key(21), 4)
    sizes = jnp.asarray([[4, 0, 9], [0, 19, 0], [7, 7, 2]], jnp.int32)  # the last leaves 3 rows outside
    lhs = jax.random.normal(keys[0], (B, M, Kd)) / np.sqrt(Kd)
    rhs = jax.random.normal(keys[1], (B, 3, Kd, N))
    operands = [x if b else x[0] for x, b in zip((lhs, rhs, sizes), batched)]
    axes = tuple(0 if b else None for b in batched)
    sparse = {
        "gmm": lambda l, r, s: grouped_matmul(l, r, s, "xla"),
        "pair": lambda l, r, s: grouped_matmul_pair(l, r, 0.5 * r + 1.0, s, "xla"),
        "swiglu": lambda l, r, s: grouped_swiglu_matmul(l, r, 0.5 * r + 1.0, s, "xla"),
    }
    dense = {
        "gmm": _dense_gmm,
        "pair": lambda l, r, s: (_dense_gmm(l, r, s), _dense_gmm(l, 0.5 * r + 1.0, s)),
        "swiglu": lambda l, r, s: jax.nn.silu(_dense_gmm(l, r, s)) * _dense_gmm(l, 0.5 * r + 1.0, s),
    }
    tangents = [jax.random.normal(keys[2], operands[0].shape), jax.random.normal(keys[3], operands[1].shape)]
    for name in sparse:  # each check one compiled program: op by op, they took most of the test's time
        got_fn, want_fn = (jax.vmap(f, in_axes=axes) for f in (sparse[name], dense[name]))
        np.testing.assert_allclose(jax.tree.leaves(jax.jit(got_fn)(*operands)),
                                   jax.tree.leaves(jax.jit(want_fn)(*operands)), rtol=1e-5, atol=1e-5, err_msg=name)
        jvp = lambda f: jax.jit(lambda: jax.jvp(lambda l, r: f(l, r, operands[2]), operands[:2], tangents))()  # noqa
        np.testing.assert_allclose(jax.tree.leaves(jvp(got_fn)), jax.tree.leaves(jvp(want_fn)), rtol=1e-5, atol=1e-5,
                                   err_msg=name)
        loss = lambda f: lambda l, r: sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(f(l, r, operands[2])))  # noqa
        grads = (jax.jit(jax.grad(loss(f), (0, 1)))(*operands[:2]) for f in (got_fn, want_fn))
        for got, want in zip(*grads):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_last_product_and_combine_match_them_apart(monkeypatch):
    """``expert_combine`` (the last product and the combine as one primitive, its backward on the
    gathered products) against the two apart: outputs, every gradient, each operand's alone (the
    transpose computes only the cotangents asked for), forward mode, a Hessian-vector product (second
    order through the fused pieces' compositions) and ``vmap`` of the gradient, with dropped copies."""
    import moe_lowering.sparse_moe as sparse_moe_module

    keys = jax.random.split(jax.random.key(5), 6)
    x = jax.random.normal(keys[0], (T, D))
    w_up = jax.random.normal(keys[1], (E, D, F)) / np.sqrt(D)
    w_down = jax.random.normal(keys[2], (E, F, D)) / np.sqrt(F)
    idx = jax.random.randint(keys[3], (T, K), 0, E + 1)
    assert int((idx == E).sum()) > 0
    w = jax.random.uniform(keys[4], (T, K), minval=0.2)
    operands = (x, w, w_up, w_down)
    program = _relu_program()

    def loss(x, w, w_up, w_down):
        return jnp.sum(jnp.sin(sparse_moe(x, idx, w, [w_up, w_down], program, num_experts=E, backend="xla")))

    def evaluated(*operands):  # one compiled program: op by op, these took most of the test's time
        grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*operands)
        alone = [jax.grad(loss, argnums=i)(*operands) for i in range(4)]
        tangent = jax.jvp(loss, operands, operands)[1]
        hvp = jax.jvp(jax.grad(loss, argnums=(0, 1, 2, 3)), operands, operands)[1]
        batched = jax.vmap(jax.grad(loss, argnums=(1, 3)), in_axes=(0, 0, None, None))(
            jnp.stack([x, -x]), jnp.stack([w, 1 - w]), w_up, w_down)
        return (loss(*operands), *grads, *alone, tangent, *hvp, *batched)

    def results():
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*operands))
        return jaxpr, jax.jit(evaluated)(*operands)

    fused_jaxpr, fused = results()
    monkeypatch.setattr(sparse_moe_module, "COMBINE_IN_LAST_PRODUCT_MAX_WIDTH", 0)
    apart_jaxpr, apart = results()
    assert "moe_gather_gmm" in fused_jaxpr and "moe_gather_tgmm" in fused_jaxpr and "moe_spread" not in fused_jaxpr
    assert "moe_gather_gmm" not in apart_jaxpr
    for got, want in zip(fused, apart):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_up_projection_read_from_the_tokens_matches_the_permuted_rows(monkeypatch):
    """``gather_swiglu_gmm`` (the SwiGLU up-projection reading the routed rows from the tokens; its weight
    gradients ``gather_lhs_tgmm`` read them again) against the same layer on permuted rows, and against
    the gathered forward whose weight gradients read a kept permuted copy (a backend without
    ``gather_lhs_tgmm``): outputs, every gradient, forward mode, a Hessian-vector product both ways
    (forward over reverse and reverse over reverse) and ``vmap`` of the gradient, on the zoo's Mixtral."""
    import dataclasses

    from moe_lowering import moe_optimize
    from moe_lowering import sparse_moe as sparse_moe_module
    from moe_lowering.kernels import get_backend
    from moe_lowering.testing import ZOO

    model = ZOO["mixtral"].sized(T=24, E=8)
    params, x = model.args(jax.random.key(6))
    xla = get_backend("xla")
    probe = jax.tree_util.tree_map(lambda v: jnp.cos(3.0 * v), (params, x))

    def results(backend):
        monkeypatch.setattr(sparse_moe_module, "get_backend",
                            lambda name: backend if name == "xla" else get_backend(name))
        layer = moe_optimize(model.fn, strict=True, backend="xla")  # one per backend: its trace is cached

        def loss(p, x):
            return jnp.sum(jnp.sin(layer(p, x)))

        def grad_dot_probe(p, x):
            grads = jax.grad(loss, argnums=(0, 1))(p, x)
            return sum(jnp.vdot(g, v) for g, v in zip(jax.tree_util.tree_leaves(grads),
                                                       jax.tree_util.tree_leaves(probe)))

        jaxpr = str(jax.make_jaxpr(layer)(params, x))
        grad_jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x))
        def evaluated(params, x):  # one compiled program: op by op, these took most of the test's time
            grads = jax.grad(loss, argnums=(0, 1))(params, x)
            tangent = jax.jvp(loss, (params, x), (params, x))[1]
            hvp = jax.jvp(jax.grad(loss, argnums=(0, 1)), (params, x), (params, x))[1]
            reverse_hvp = jax.grad(grad_dot_probe, argnums=(0, 1))(params, x)
            batched = jax.vmap(jax.grad(loss, argnums=1), in_axes=(None, 0))(params, jnp.stack([x, -x]))
            return layer(params, x), loss(params, x), grads, tangent, hvp, reverse_hvp, batched

        return jaxpr, grad_jaxpr, jax.tree_util.tree_leaves(jax.jit(evaluated)(params, x))

    gathered_jaxpr, gathered_grad_jaxpr, gathered = results(xla)
    permuted_jaxpr, permuted_grad_jaxpr, permuted = results(
        dataclasses.replace(xla, name="xla-permuted", gather_swiglu_gmm=None))
    _, kept_copy_grad_jaxpr, kept_copy = results(dataclasses.replace(xla, name="xla-kept-copy", gather_lhs_tgmm=None))
    assert "moe_gather_swiglu_gmm" in gathered_jaxpr and "moe_gather_swiglu_gmm" not in permuted_jaxpr
    # a training step writes no permuted copy of the tokens: the weight gradients read them by index
    assert "moe_gather_lhs_tgmm" in gathered_grad_jaxpr and "moe_permute[" not in gathered_grad_jaxpr
    for grad_jaxpr in (permuted_grad_jaxpr, kept_copy_grad_jaxpr):
        assert "moe_gather_lhs_tgmm" not in grad_jaxpr and "moe_permute[" in grad_jaxpr
    for other in (permuted, kept_copy):
        for got, want in zip(gathered, other):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
