"""sharded_sparse_moe against the unsharded sparse_moe and the dense reference, on 8 host devices.

Outputs and gradients (a random cotangent through ``jax.vjp``) must agree to float32 rounding;
FP8 weight gathers must agree exactly with a reference that fake-quantises the same shards, and
stay within the FP8 error of the exact result. The compiled HLO must show the token all-to-all,
byte-sized weight gathers when asked, and no per-device tensor the size of the dense
partitioning's ``[all tokens, local experts, f]``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from moe_lowering.parallel import drop_over_capacity, expert_capacity, plan_layout, sharded_sparse_moe
from moe_lowering.kernels.fp8_grouped_matmul.quant_format import dequantize_blocks, quantize_blocks
from moe_lowering.expert_program import ExpertMatmul, ExpertProgram, ParamKind, RowInput
from moe_lowering.parallel import exchange
from moe_lowering.parallel import sharded_moe as sharded_moe_module
from moe_lowering.parallel.sharded_moe import PEER_SINGLE_ROUND_MAX_RANKS
from moe_lowering.sparse_moe import sort_by_expert, sparse_moe
from parallel_cases import dense_reference, random_case, swiglu_program

E = 8
W_FSDP = [P("expert", "fsdp", None), P("expert", "fsdp", None), P("expert", None, "fsdp")]
MESHES = {
    # name: (shape, axis names, axis type, tokens spec, expert-param specs incl. the bias [E, F])
    "expert8": ((8,), ("expert",), AxisType.Auto, P("expert"), [P("expert")] * 4),
    "fsdp2_expert4": ((2, 4), ("fsdp", "expert"), AxisType.Explicit, P(("fsdp", "expert")),
                      W_FSDP + [P("expert", "fsdp")]),
    "data2_expert2_fsdp2": ((2, 2, 2), ("data", "expert", "fsdp"), AxisType.Explicit, P("data"), W_FSDP + [None]),
}


def make_layout(name, expert_bias=False):
    """The layout for ``swiglu_program(expert_bias=...)``: specs of w1, w3, w2 (and the bias)."""
    shape, names, axis_type, tokens_spec, weight_specs = MESHES[name]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape), devices=jax.devices("cpu")[:8])
    return plan_layout(mesh, tokens_spec, weight_specs[: 4 if expert_bias else 3], E)


def assert_close(actual, expected, tol):
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def rel_err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def out_and_grads(moe, tokens, weights, params, cotangent):
    """``moe(tokens, weights, params)`` and its vjp at ``cotangent`` (tokens, weights, params)."""
    out, vjp = jax.vjp(moe, tokens, weights, params)
    return out, vjp(cotangent)


def jitted_out_and_grads(moe, *args):
    """``out_and_grads`` as one compiled program: op by op, a reference takes 2-3x as long."""
    return jax.jit(functools.partial(out_and_grads, moe))(*args)


def compiled_out_and_grads(moe, *args):
    """``out_and_grads`` compiled once, and the compiled program's HLO text (forward and backward)."""
    compiled = jax.jit(functools.partial(out_and_grads, moe)).lower(*args).compile()
    return compiled(*args), compiled.as_text()


def out_grads_and_stats(moe, tokens, weights, params, cotangent):
    """``out_and_grads`` of a layer called with ``return_stats=True``, and its stats."""
    out, vjp, stats = jax.vjp(moe, tokens, weights, params, has_aux=True)
    return (out, vjp(cotangent)), stats


def compiled_forward_and_stats(moe, tokens, weights, params):
    """The forward program of a layer called with ``return_stats=True``, compiled once: its HLO
    text and its stats (computed in every call; the flag only returns them)."""
    compiled = jax.jit(moe).lower(tokens, weights, params).compile()
    return compiled.as_text(), compiled(tokens, weights, params)[1]


def sharded(layout, indices, program, **kwargs):
    return lambda t, w, p: sharded_sparse_moe(t, indices, w, p, program, num_experts=E, layout=layout, **kwargs)


def case(seed, num_tokens=64, top_k=2, **kwargs):
    kwargs.setdefault("expert_bias", True)
    kwargs.setdefault("token_scale", True)
    tokens, indices, weights, params = random_case(seed, num_tokens=num_tokens, d_model=64, d_ff=32,
                                                   num_experts=E, top_k=top_k, **kwargs)
    cotangent = jnp.asarray(np.random.default_rng(seed + 100).standard_normal(tokens.shape), tokens.dtype)
    return tokens, indices, weights, params, cotangent


@pytest.mark.parametrize("mesh_name, num_tokens, exchange_capacity", [
    ("expert8", 60, None),  # T not a multiple of the device count: padded inside
    ("fsdp2_expert4", 60, None),  # the same on Explicit axes, which cannot slice a sharded dim to 60
    ("fsdp2_expert4", 64, 3),  # 3 rows per pair per round: several rounds forward and backward
    ("data2_expert2_fsdp2", 64, None),
])
def test_matches_unsharded_and_dense(mesh_name, num_tokens, exchange_capacity):
    layout = make_layout(mesh_name, expert_bias=True)
    tokens, indices, weights, params, cotangent = case(1, num_tokens)
    indices = indices.at[5, 1].set(-1).at[17, 0].set(E)  # copies the caller dropped
    program = swiglu_program(expert_bias=True, token_scale=True)
    moe = sharded(layout, indices, program, exchange_capacity=exchange_capacity, return_stats=True)
    (out, grads), stats = jax.jit(functools.partial(out_grads_and_stats, moe))(tokens, weights, params, cotangent)
    ref_sparse = jitted_out_and_grads(lambda t, w, p: sparse_moe(t, indices, w, p, program, num_experts=E),
                                      tokens, weights, params, cotangent)
    ref_dense = jitted_out_and_grads(
        lambda t, w, p: dense_reference(t, indices, w, p, num_experts=E, expert_bias=True, token_scale=True),
        tokens, weights, params, cotangent)
    assert_close((out, grads), ref_sparse, 1e-5)
    assert_close((out, grads), ref_dense, 1e-5)
    if num_tokens % 8 == 0:  # the caller's token sharding comes back
        assert out.sharding.is_equivalent_to(NamedSharding(layout.mesh, layout.tokens_spec), 2)
    assert int(stats.dropped_copies) == 0
    assert int(stats.exchange_rounds) >= (2 if exchange_capacity else 1)


def fake_quantized(w, quant, fsdp_dim, shards):
    """The weights each FSDP shard's quantise-dequantise produces, with a straight-through gradient."""
    pieces = jnp.split(w, shards, axis=fsdp_dim)
    rounded = jnp.concatenate([dequantize_blocks(*quantize_blocks(p, quant), quant, w.dtype) for p in pieces],
                              axis=fsdp_dim)
    return w + jax.lax.stop_gradient(rounded - w)


@pytest.mark.parametrize("mesh_name, quant, exchange", [
    ("fsdp2_expert4", "fp8_e4m3", {}),
    ("data2_expert2_fsdp2", "mxfp8", {}),
    # two chunks of 2 rows per pair, several rounds: each chunk's product reduce-scatters its own
    # weight gradient, and the exchange sums them
    ("fsdp2_expert4", "fp8_e4m3", {"exchange_chunks": 2, "exchange_capacity": 3}),
    # the peer transport: its one round, with FP8 weight objects (no GEMM-fused return for them)
    ("fsdp2_expert4", "fp8_e4m3", {"exchange_transport": "peer"}),
])
def test_fp8_weight_gather(mesh_name, quant, exchange):
    layout = make_layout(mesh_name)
    tokens, indices, weights, params, cotangent = case(2, expert_bias=False, token_scale=False)
    program = swiglu_program()
    moe = sharded(layout, indices, program, weight_gather_quant=quant, **exchange)
    out, grads = jitted_out_and_grads(moe, tokens, weights, params, cotangent)

    def fake_quant_dense(t, w, p):
        p = [fake_quantized(x, quant, layout.fsdp_dim(i), layout.fsdp_size) for i, x in enumerate(p)]
        return dense_reference(t, indices, w, p, num_experts=E)

    assert_close((out, grads), jitted_out_and_grads(fake_quant_dense, tokens, weights, params, cotangent), 1e-5)
    # Against the exact layer: e4m3 keeps 3 mantissa bits (2.7% error per weight), three GEMMs in a row.
    exact_out, exact_grads = jitted_out_and_grads(lambda t, w, p: dense_reference(t, indices, w, p, num_experts=E),
                                                  tokens, weights, params, cotangent)
    assert rel_err(out, exact_out) < 5e-2
    for g, g_exact in zip(jax.tree.leaves(grads), jax.tree.leaves(exact_grads)):
        assert rel_err(g, g_exact) < 1e-1


def test_fp8_weight_gather_forward_mode_is_the_straight_through_derivative():
    """Forward mode through FP8-gathered weights (issue 38): the derivative of ``W + stop_gradient(Q(W) - W)``,
    the same straight-through derivative reverse mode takes, so ``jvp`` is the transpose of ``vjp``;
    and the Hessian-vector product of the fake-quantised dense layer. 32 tokens: the exchange takes
    two rounds on one FSDP row and one on the other, and each round's weight gradient
    reduce-scatters over the FSDP axis, so the rounds run in lockstep over it (the gradient hung)."""
    quant = "fp8_e4m3"
    layout = make_layout("fsdp2_expert4")
    tokens, indices, weights, params, cotangent = case(2, num_tokens=32, expert_bias=False, token_scale=False)
    moe = sharded(layout, indices, swiglu_program(), weight_gather_quant=quant)

    def fake_quant_dense(t, w, p):
        p = [fake_quantized(x, quant, layout.fsdp_dim(i), layout.fsdp_size) for i, x in enumerate(p)]
        return dense_reference(t, indices, w, p, num_experts=E)

    rng = np.random.default_rng(3)
    primals = (tokens, weights, params)
    tangents = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), primals)
    hvp = lambda f: jax.jvp(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)), primals, tangents)[1]

    def derivatives(f):
        out, tangent = jax.jvp(f, primals, tangents)
        _, vjp = jax.vjp(f, *primals)
        adjoint = sum(jnp.vdot(g, t) for g, t in zip(jax.tree.leaves(vjp(cotangent)), jax.tree.leaves(tangents)))
        return out, tangent, hvp(f), jnp.vdot(cotangent, tangent), adjoint

    out, tangent, got_hvp, forward, reverse = jax.jit(lambda: derivatives(moe))()
    want_out, want_tangent, want_hvp, *_ = jax.jit(lambda: derivatives(fake_quant_dense))()
    assert rel_err(out, want_out) < 1e-5 and rel_err(tangent, want_tangent) < 1e-5
    for got, want in zip(jax.tree.leaves(got_hvp), jax.tree.leaves(want_hvp), strict=True):
        assert rel_err(got, want) < 1e-5
    assert abs(float(forward - reverse)) < 1e-5 * abs(float(reverse))  # <v, J u> = <J^T v, u>


@pytest.mark.parametrize("quant", ["fp8_e4m3", "mxfp8"])
def test_block_quantization_bounds(quant):
    w = jnp.asarray(np.random.default_rng(3).standard_normal((2, 64, 48)) * np.logspace(-3, 2, 48), jnp.float32)
    values, scales = quantize_blocks(w, quant)
    assert values.dtype == jnp.float8_e4m3fn
    restored = dequantize_blocks(values, scales, quant, jnp.float32)
    # e4m3 rounds to 3 mantissa bits: relative error <= 2^-4 wherever the value is a normal number.
    normal = jnp.abs(w) > 2.0**-6 * jnp.max(jnp.abs(w))
    assert float(jnp.max(jnp.where(normal, jnp.abs(restored - w) / jnp.abs(w), 0))) <= 2.0**-4
    if quant == "mxfp8":
        assert scales.dtype == jnp.uint8 and scales.shape == (2, 64 // 32, 48)  # one E8M0 exponent per 1x32 block
        block_amax = jnp.max(jnp.abs(w.reshape(2, 2, 32, 48)), axis=2)
        scale = jnp.exp2(scales.astype(jnp.float32) - 127)
        assert bool(jnp.all(block_amax / scale <= 448)) and bool(jnp.all(block_amax / scale > 224))
    else:
        assert scales.shape == (2, 1, 3)  # 64x48: blocks of 64x16 (largest powers of two <= 128 dividing)


def test_skewed_routing_stays_dropless():
    layout = make_layout("fsdp2_expert4")
    tokens, indices, weights, params, _ = case(4, num_tokens=128, expert_bias=False, token_scale=False, skew_to=0)
    program = swiglu_program()
    out, stats = jax.jit(lambda t, w, p: sharded(layout, indices, program, return_stats=True)(t, w, p))(
        tokens, weights, params)
    assert_close(out, dense_reference(tokens, indices, weights, params, num_experts=E), 1e-5)
    # Every copy goes to rank 0 (experts 0 and 1): 2 * 16 rows from each rank, 10 per round.
    assert int(stats.exchange_rounds) == 4 and int(stats.dropped_copies) == 0


@pytest.mark.parametrize("mesh_name, exchange_capacity, skew_to", [
    ("expert8", None, None),  # 8 ranks: 7 shifts each way, one round
    ("fsdp2_expert4", 3, None),  # several rounds: the while_loop path forward and backward
    ("fsdp2_expert4", None, 0),  # every copy to rank 0: 4 rounds
])
def test_ppermute_transport(mesh_name, exchange_capacity, skew_to):
    layout = make_layout(mesh_name, expert_bias=True)
    tokens, indices, weights, params, cotangent = case(10, num_tokens=128, skew_to=skew_to)
    program = swiglu_program(expert_bias=True, token_scale=True)
    moe = sharded(layout, indices, program, exchange_transport="ppermute", exchange_capacity=exchange_capacity,
                  return_stats=True)
    got = jax.jit(functools.partial(out_grads_and_stats, moe))(tokens, weights, params, cotangent)[0]
    want = jitted_out_and_grads(lambda t, w, p: sparse_moe(t, indices, w, p, program, num_experts=E),
                                tokens, weights, params, cotangent)
    assert_close(got, want, 1e-5)
    hlo, stats = compiled_forward_and_stats(moe, tokens, weights, params)
    assert collectives(hlo, "collective-permute") and not collectives(hlo, "all-to-all")
    if exchange_capacity is not None or skew_to is not None:
        assert int(stats.exchange_rounds) >= 2


@pytest.mark.parametrize("mesh_name, exchange_capacity, exchange_chunks, skew_to, expert_bias", [
    ("expert8", None, 1, None, True),
    ("fsdp2_expert4", 3, 1, None, True),  # several rounds: the while_loop path forward and backward
    ("fsdp2_expert4", None, 2, 0, True),  # every copy to rank 0, two chunks a round
    ("data2_expert2_fsdp2", None, 1, None, True),
    # no per-expert param: rows past the received ones are never read, so they get no zeros and
    # the SwiGLU activation runs on the received rows only (``swiglu_rows``)
    ("fsdp2_expert4", None, 1, None, False),
    ("fsdp2_expert4", 3, 1, None, False),
    ("expert8", None, 2, 0, False),
])
def test_peer_transport_routes(mesh_name, exchange_capacity, exchange_chunks, skew_to, expert_bias):
    """The ``"peer"`` transport's destinations (sorted positions out, home rows back), through the
    all-gather reference of its stores; the GPU kernels are checked against it in tests/gpu."""
    layout = make_layout(mesh_name, expert_bias=expert_bias)
    tokens, indices, weights, params, cotangent = case(13, num_tokens=128, skew_to=skew_to, expert_bias=expert_bias)
    program = swiglu_program(expert_bias=expert_bias, token_scale=True)
    moe = sharded(layout, indices, program, exchange_transport="peer", exchange_capacity=exchange_capacity,
                  exchange_chunks=exchange_chunks)
    got, hlo = compiled_out_and_grads(moe, tokens, weights, params, cotangent)
    want = jitted_out_and_grads(lambda t, w, p: sparse_moe(t, indices, w, p, program, num_experts=E),
                                tokens, weights, params, cotangent)
    assert_close(got, want, 1e-5)
    assert not collectives(hlo, "all-to-all")  # forward or backward
    # Sized for the worst case by default on few ranks: one round, no overflow loop waiting on the host.
    looped = exchange_capacity is not None or layout.expert_parallel_size > PEER_SINGLE_ROUND_MAX_RANKS
    assert has_exchange_loop(jax.make_jaxpr(moe)(tokens, weights, params).jaxpr) == looped


def test_peer_output_gemm_reads_its_weight_twice():
    """``(x @ w[e]) @ w[e]``: the output GEMM fused with the return uses a weight the rest of the
    program reads too, so its weight gradient adds to the prefix's (exact on the reference path)."""
    layout = plan_layout(jax.make_mesh((4,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:4]),
                         P("expert"), [P("expert")], E)
    tokens, indices, weights, _, cotangent = case(21, num_tokens=64, expert_bias=False, token_scale=False)
    square = jnp.asarray(np.random.default_rng(22).standard_normal((E, 64, 64)) / 8, jnp.float32)
    program = ExpertProgram(ExpertMatmul(ExpertMatmul(RowInput(), 0), 0), (ParamKind.EXPERT_WEIGHT,))
    fused = exchange._output_matmul(exchange.exchange_config(program=program, axis_name="expert", ep_size=4,
                                                             local_experts=2, capacity=8, transport="peer"), (square,))
    assert fused is not None and fused.weight_read_before
    moe = sharded(layout, indices, program, exchange_transport="peer")
    got = jitted_out_and_grads(moe, tokens, weights, (square,), cotangent)
    want = jitted_out_and_grads(lambda t, w, p: sparse_moe(t, indices, w, p, program, num_experts=E),
                                tokens, weights, (square,), cotangent)
    assert_close(got, want, 1e-5)


def test_output_gemm_fuses_only_on_peer_with_plain_weights():
    program = swiglu_program()
    weights = tuple(jnp.zeros(s, jnp.float32) for s in ((2, 4, 3), (2, 4, 3), (2, 3, 4)))
    config = functools.partial(exchange.exchange_config, program=program, axis_name="expert", ep_size=4,
                               local_experts=2, capacity=8)
    fused = exchange._output_matmul(config(transport="peer"), weights)
    assert fused is not None and fused.prefix.output is program.output.source and not fused.weight_read_before
    assert exchange._output_matmul(config(transport="all_to_all"), weights) is None
    weight_object = SimpleNamespace(grouped_matmul=lambda *a: None)  # e.g. an FP8-gathered weight
    assert exchange._output_matmul(config(transport="peer"), weights[:2] + (weight_object,)) is None


def test_peer_single_round_within_its_byte_bound(monkeypatch):
    layout = make_layout("fsdp2_expert4", expert_bias=True)
    tokens, indices, weights, params, _ = case(13, num_tokens=128)
    moe = sharded(layout, indices, swiglu_program(expert_bias=True, token_scale=True), exchange_transport="peer")
    assert not has_exchange_loop(jax.make_jaxpr(moe)(tokens, weights, params).jaxpr)
    monkeypatch.setattr(sharded_moe_module, "PEER_SINGLE_ROUND_MAX_BYTES", 1024)
    retraced = lambda *a: moe(*a)  # noqa: E731  (a new function: make_jaxpr caches by function)
    assert has_exchange_loop(jax.make_jaxpr(retraced)(tokens, weights, params).jaxpr)


def has_exchange_loop(jaxpr) -> bool:
    """Whether a ``while`` loop of ``jaxpr`` (at any depth) exchanges rows (its body all-gathers)."""
    def sub_jaxprs(eqn):
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    yield inner

    def contains(jaxpr, name) -> bool:
        return any(eqn.primitive.name == name or any(contains(j, name) for j in sub_jaxprs(eqn))
                   for eqn in jaxpr.eqns)

    return any((eqn.primitive.name == "while" and contains(eqn.params["body_jaxpr"].jaxpr, "all_gather"))
               or any(has_exchange_loop(j) for j in sub_jaxprs(eqn)) for eqn in jaxpr.eqns)


def test_drop_over_capacity_semantics():
    rng = np.random.default_rng(5)
    indices = rng.integers(-1, E, size=(40, 2)).astype(np.int32)
    kept, dropped = drop_over_capacity(jnp.asarray(indices), E, 4)
    expected, seen = indices.copy(), np.zeros(E, int)
    for flat in range(indices.size):  # per-expert queue in token-major order
        t, j = divmod(flat, 2)
        e = indices[t, j]
        if 0 <= e < E:
            seen[e] += 1
            if seen[e] > 4:
                expected[t, j] = -1
    np.testing.assert_array_equal(np.where(expected >= 0, expected, -1), np.asarray(kept))
    assert int(dropped) == int(np.sum(np.maximum(seen - 4, 0))) > 0


@pytest.mark.parametrize("transport", ["all_to_all", "peer"])
def test_capacity_factor_drops_like_single_device(transport):
    """Dropped copies sort last and never travel; on ``"peer"`` (one round) they are exactly the
    home rows past the sent ones, which its return leaves zero."""
    layout = make_layout("data2_expert2_fsdp2")
    tokens, indices, weights, params, _ = case(6, expert_bias=False, token_scale=False)
    indices = indices.at[:24, 0].set(3)  # overfill expert 3
    program = swiglu_program()
    out, stats = jax.jit(lambda t, w, p: sharded(layout, indices, program, capacity_factor=1.0, return_stats=True,
                                                 exchange_transport=transport)(t, w, p))(tokens, weights, params)
    kept, dropped = drop_over_capacity(indices, E, expert_capacity(64, 2, E, 1.0))
    assert int(stats.dropped_copies) == int(dropped) > 0
    assert_close(out, dense_reference(tokens, kept, weights, params, num_experts=E), 1e-5)


ARRAY_TYPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn)\[([\d,]*)\]")


def collectives(hlo: str, op: str) -> list[str]:
    """Result types of every ``op`` instruction in compiled HLO text."""
    return [line.split("=", 1)[1].split(op)[0].strip() for line in hlo.splitlines()
            if re.search(rf"= .*\b{op}\(", line)]


def largest_array(hlo: str) -> int:
    return max(int(np.prod([int(d) for d in dims.split(",") if d])) for _, dims in ARRAY_TYPE.findall(hlo))


def test_compiled_collectives_and_per_device_sizes():
    layout = make_layout("fsdp2_expert4")
    num_tokens, d_ff = 256, 32
    tokens, indices, weights, params, cotangent = case(7, num_tokens, expert_bias=False, token_scale=False)
    program = swiglu_program()
    moe = sharded(layout, indices, program, weight_gather_quant="fp8_e4m3")
    forward = jax.jit(moe).lower(tokens, weights, params).compile().as_text()
    backward = jax.jit(lambda *a: out_and_grads(moe, *a)[1]).lower(tokens, weights, params, cotangent).compile()
    backward = backward.as_text()

    assert collectives(forward, "all-to-all") and collectives(backward, "all-to-all")
    for hlo in (forward, backward):
        gathered = collectives(hlo, "all-gather")
        weight_gathers = [g for g in gathered if g.startswith("u8[")]
        assert len(weight_gathers) == 3, gathered  # FP8 bytes of w1, w3, w2
        for g in gathered:  # the rest: f32 block scales and the s32 [ep, E] counts matrix, never token rows
            assert g.startswith(("u8[", "s32[4,8]", "f32[2,2,1]", "f32[2,1,2]")), g
    assert all(t.startswith("f32[2,32,32]") for t in collectives(backward, "reduce-scatter"))

    dense_partitioned = num_tokens * layout.local_experts * d_ff  # XLA's [all tokens, local experts, f]
    assert largest_array(forward) < dense_partitioned and largest_array(backward) < dense_partitioned
    shardings = NamedSharding(layout.mesh, P(("fsdp", "expert")))
    specs = [NamedSharding(layout.mesh, s) for s in W_FSDP]
    dense = jax.jit(lambda t, w, p: dense_reference(t, indices, w, p, num_experts=E),
                    in_shardings=(shardings, shardings, specs))
    assert largest_array(dense.lower(tokens, weights, params).compile().as_text()) >= dense_partitioned


@pytest.mark.skipif(jax.default_backend() == "cpu" or jax.device_count() < 2,
                    reason="ragged_all_to_all is UNIMPLEMENTED on XLA:CPU; needs 2+ accelerators")
def test_ragged_all_to_all_transport():
    devices = jax.devices()[: 4 if jax.device_count() >= 4 else 2]
    mesh = jax.make_mesh((len(devices),), ("expert",), devices=devices)
    layout = plan_layout(mesh, P("expert"), [P("expert")] * 3, E)
    tokens, indices, weights, params, cotangent = case(8, expert_bias=False, token_scale=False)
    program = swiglu_program()
    got = jax.jit(lambda *a: out_and_grads(sharded(layout, indices, program, exchange_transport="ragged",
                                                   exchange_capacity=5), *a))(tokens, weights, params, cotangent)
    want = out_and_grads(lambda t, w, p: dense_reference(t, indices, w, p, num_experts=E),
                         tokens, weights, params, cotangent)
    assert_close(got, want, 1e-4)


def test_bad_arguments_raise_and_unquantizable_shards_gather_exactly():
    layout = make_layout("fsdp2_expert4")
    tokens, indices, weights, params, _ = case(9, expert_bias=False, token_scale=False)
    program = swiglu_program()
    with pytest.raises(ValueError, match="weight_gather_quant"):
        sharded(layout, indices, program, weight_gather_quant="int4")(tokens, weights, params)
    with pytest.raises(ValueError, match="takes 3 params"):
        sharded(layout, indices, program)(tokens, weights, params[:2])
    with pytest.raises(ValueError, match="exchange_transport"):
        sharded(layout, indices, program, exchange_transport="nvshmem")(tokens, weights, params)
    tokens, indices, weights, params = random_case(9, num_tokens=64, d_model=32, d_ff=32, num_experts=E, top_k=2)
    with pytest.warns(UserWarning, match="'mxfp8' ignored .*mxfp8 needs"):  # w1's K shard is 32 / 2: no 1x32 block
        out = jax.jit(sharded(layout, indices, program, weight_gather_quant="mxfp8"))(tokens, weights, params)
    exact = jax.jit(lambda t, w, p: sparse_moe(t, indices, w, p, program, num_experts=E))(tokens, weights, params)
    assert rel_err(out, exact) < 1e-5  # gathered exactly instead


@pytest.mark.parametrize("mesh_name, exchange_chunks, exchange_capacity, skew_to", [
    ("expert8", 2, None, None),  # one round of two chunks
    ("fsdp2_expert4", 3, 7, None),  # chunks of 3 rows (the last one short of 7), several rounds
    ("fsdp2_expert4", 2, None, 0),  # every copy to rank 0: the while_loop over rounds of chunks
])
def test_chunked_exchange(mesh_name, exchange_chunks, exchange_capacity, skew_to):
    layout = make_layout(mesh_name, expert_bias=True)
    tokens, indices, weights, params, cotangent = case(11, num_tokens=128, skew_to=skew_to)
    program = swiglu_program(expert_bias=True, token_scale=True)
    kwargs = dict(exchange_chunks=exchange_chunks, exchange_capacity=exchange_capacity)
    moe = sharded(layout, indices, program, return_stats=True, **kwargs)
    got = jax.jit(functools.partial(out_grads_and_stats, moe))(tokens, weights, params, cotangent)[0]
    want = jitted_out_and_grads(lambda t, w, p: sparse_moe(t, indices, w, p, program, num_experts=E),
                                tokens, weights, params, cotangent)
    assert_close(got, want, 1e-5)
    hlo, stats = compiled_forward_and_stats(moe, tokens, weights, params)
    assert len(collectives(hlo, "all-to-all")) >= 2 * exchange_chunks  # each chunk out and back on its own
    if exchange_capacity is not None or skew_to is not None:
        assert int(stats.exchange_rounds) >= 2


@pytest.mark.parametrize("chunks", [0, -1, 1.5])
def test_bad_exchange_chunks(chunks):
    layout = make_layout("expert8")
    tokens, indices, weights, params, _ = case(12, expert_bias=False, token_scale=False)
    with pytest.raises(ValueError, match="exchange_chunks must be a positive integer"):
        sharded(layout, indices, swiglu_program(), exchange_chunks=chunks)(tokens, weights, params)


@pytest.mark.parametrize("mesh_name", ["fsdp2_expert4", "data2_expert2_fsdp2"])
def test_deduplicated_dispatch_sends_each_token_once_per_rank(mesh_name, monkeypatch):
    """With several experts per rank, ``"peer"`` sends a token once to each rank holding any of
    its experts and the receiver expands it into rows: the same rows, so the same results (bit
    for bit) as sending every row, and fewer stored rows."""
    layout = make_layout(mesh_name, expert_bias=False)
    tokens, indices, weights, params, cotangent = case(17, num_tokens=128, expert_bias=False, top_k=4)
    program = swiglu_program(token_scale=True)
    monkeypatch.setattr(exchange, "DEDUP_MIN_ROWS_PER_TOKEN_RANK", 1.0)  # on whatever the routing
    traced = []
    representatives = exchange._representatives
    monkeypatch.setattr(exchange, "_representatives", lambda *a: traced.append(1) or representatives(*a))
    moe = sharded(layout, indices, program, exchange_transport="peer")
    deduplicated = jitted_out_and_grads(moe, tokens, weights, params, cotangent)
    assert traced, "the deduplicated dispatch was not taken"
    monkeypatch.setattr(exchange, "deduplicates", lambda cfg, num_rows: False)
    traced.clear()
    per_row = jax.jit(lambda *a: out_and_grads(lambda t, w, p: moe(t, w, p), *a))(tokens, weights, params, cotangent)
    assert not traced
    for a, b in zip(jax.tree.leaves(deduplicated), jax.tree.leaves(per_row), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = jitted_out_and_grads(lambda t, w, p: sparse_moe(t, indices, w, p, program, num_experts=E),
                                tokens, weights, params, cotangent)
    assert_close(deduplicated, want, 1e-5)


def test_rows_per_token_rank_matches_uniform_routing():
    rng = np.random.default_rng(5)
    for top_k, num_experts, ep in [(2, 8, 4), (2, 8, 2), (8, 256, 4), (4, 8, 4), (1, 8, 4)]:
        picks = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(4000)])
        ranks_hit = np.mean([len(set(p // (num_experts // ep))) for p in picks])
        np.testing.assert_allclose(exchange.rows_per_token_rank(top_k, num_experts, ep), top_k / ranks_hit, rtol=0.02)
    assert exchange.rows_per_token_rank(10, 8, 4) == 10 / 4  # more copies than experts: every rank is hit


def test_deduplication_is_offered_where_it_paid_on_gpus():
    """The measured cases (benchmarks/EP_NOTES.md, round 7): DeepSeek-like routing dedups, Mixtral-like does not."""
    assert exchange.deduplication_pays(8, 256, 4) and exchange.deduplication_pays(8, 256, 2)
    assert not exchange.deduplication_pays(2, 8, 4) and not exchange.deduplication_pays(2, 8, 2)
    assert not exchange.deduplication_pays(1, 64, 8)


def test_representatives_are_the_unique_token_rank_pairs():
    ep, local, num_tokens, top_k = 4, 2, 40, 4
    rng = np.random.default_rng(3)
    indices = np.stack([rng.permutation(ep * local)[:top_k] for _ in range(num_tokens)]).astype(np.int32)
    indices[5, 1] = -1  # a dropped copy: sorts last, represents nothing
    routing = sort_by_expert(jnp.asarray(indices), ep * local)
    cfg = exchange.exchange_config(program=swiglu_program(), axis_name="expert", ep_size=ep, local_experts=local,
                                   capacity=num_tokens * top_k, transport="peer")
    dest, representative, is_representative, per_rank = exchange._representatives(routing.token_of_row,
                                                                                     routing.group_sizes, cfg)
    expert_of_row = np.asarray(routing.expert_of_row)
    token_of_row = np.asarray(routing.token_of_row)
    pairs = {(t, e // local) for t, e in zip(token_of_row, expert_of_row) if e < ep * local}
    assert int(np.sum(is_representative)) == len(pairs)
    np.testing.assert_array_equal(per_rank, [sum(1 for _, r in pairs if r == d) for d in range(ep)])
    valid = expert_of_row < ep * local
    np.testing.assert_array_equal(np.asarray(dest)[valid], expert_of_row[valid] // local)
    representative = np.asarray(representative)
    assert np.all(token_of_row[representative[valid]] == token_of_row[valid])  # a copy of the same token
    assert np.all(np.asarray(dest)[representative[valid]] == np.asarray(dest)[valid])  # bound for the same rank


def test_bucket_is_the_binary_search():
    """The exchange's searches compare against every end; with empty groups (repeated ends) and
    values past the last end they give what ``searchsorted(side="right")`` gives."""
    key = jax.random.key(7)
    for num_ends in (1, 2, 4, 64):
        sizes = jax.random.randint(key, (num_ends,), 0, 5)  # zeros: repeated ends
        ends = jnp.cumsum(sizes)
        values = jnp.arange(int(ends[-1]) + 3)
        np.testing.assert_array_equal(exchange._bucket(ends, values),
                                      np.searchsorted(np.asarray(ends), np.asarray(values), side="right"))
        key = jax.random.split(key)[0]


@pytest.mark.parametrize("transport, exchange_chunks, quant", [
    ("peer", 1, None), ("peer", 2, None), ("all_to_all", 1, None),
    ("all_to_all", 1, "fp8_e4m3"),  # the FP8-gathered weights' own product passes it on
])
def test_receive_buffer_gemms_pick_tiles_for_a_balanced_arrival(transport, exchange_chunks, quant, monkeypatch):
    """Every grouped GEMM on a receive buffer (forward, the fused output GEMM, and the backward's
    activation and weight-gradient products) is told how many rows a balanced routing brings, the
    rows a rank sends over the round's chunks: the buffer holds up to ``ep`` times that, and the GPU
    kernels pick their tile shape (and the weight gradient its kernel) from it (128-row tiles at
    DeepSeek's 128 rows per expert otherwise)."""
    from moe_lowering import sparse_moe as sparse_moe_module
    from moe_lowering.kernels import get_backend
    from moe_lowering.kernels.peer_store import api as peer_store
    from moe_lowering.parallel import quantize

    xla = get_backend("xla")
    calls = []

    def recording(product):
        def run(lhs, *args, **options):
            calls.append((product.__name__, lhs.shape[0], options.get("expected_rows")))
            return product(lhs, *args, **options)
        return run

    recorder = dataclasses.replace(xla, gmm=recording(xla.gmm), tgmm=recording(xla.tgmm))
    for module in (sparse_moe_module, peer_store, quantize):
        monkeypatch.setattr(module, "get_backend", lambda name: recorder)
    layout = make_layout("fsdp2_expert4")  # 8 token slices, 2 experts on each of 4 ranks
    tokens, indices, weights, params, cotangent = case(23, num_tokens=128, expert_bias=False, token_scale=False)
    program = swiglu_program()
    moe = sharded(layout, indices, program, exchange_transport=transport, exchange_chunks=exchange_chunks,
                  weight_gather_quant=quant)
    got = jitted_out_and_grads(moe, tokens, weights, params, cotangent)
    local_rows = 128 // 8 * 2
    expected = local_rows // exchange_chunks
    on_buffers = [(name, rows, rows_hint) for name, rows, rows_hint in calls if rows != local_rows]  # not the shape probe
    assert sum(name == "gmm" for name, _, _ in on_buffers) >= 3 * exchange_chunks, calls  # gate, up, down; backward's
    assert sum(name == "tgmm" for name, _, _ in on_buffers) >= 3 * exchange_chunks, calls  # the weight gradients
    assert {rows_hint for _, _, rows_hint in on_buffers} == {expected}, calls
    if transport == "peer":
        assert {rows for _, rows, _ in on_buffers} == {4 * expected}, calls  # ep times a balanced arrival
    want = jitted_out_and_grads(lambda t, w, p: sparse_moe(t, indices, w, p, program, num_experts=E),
                                tokens, weights, params, cotangent)
    if quant is None:
        assert_close(got, want, 1e-5)
    else:
        assert rel_err(got[0], want[0]) < 5e-2


def test_fp8_kernel_choice_counts_the_rows_that_come(monkeypatch):
    """The FP8-weight kernel wins at few rows per expert: a receive buffer four times a balanced
    arrival must not talk the choice out of it (DeepSeek at EP=4: 512 rows per expert by the
    buffer, 128 arriving)."""
    from moe_lowering.parallel import quantize

    monkeypatch.setattr(quantize, "get_backend", lambda name: SimpleNamespace(name="triton"))
    weight = SimpleNamespace(shape=(64, 7168, 2048))
    buffer = jax.ShapeDtypeStruct((4 * 8192, 7168), jnp.bfloat16)
    assert not quantize.use_fp8_kernel(buffer, weight, "auto")
    assert quantize.use_fp8_kernel(buffer, weight, "auto", expected_rows=8192)
