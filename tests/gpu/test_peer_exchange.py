"""The ``"peer"`` exchange on the GPUs of this host: its Triton stores against the all-gather
reference, and the sharded layer on it against the same layer on NCCL's all-to-all (outputs and
gradients), balanced and skewed, one and several rounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from moe_lowering.kernels import get_backend
from moe_lowering.kernels.peer_store import expand_rows, grouped_matmul_store, peer_store, peer_store_reference
from moe_lowering.parallel import exchange, plan_layout, sharded_sparse_moe
from moe_lowering.parallel._jax_shim import shard_map
from moe_lowering.parallel.exchange import prepare_peer_transport
from parallel_cases import random_case, random_peer_routes, swiglu_program

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
pytestmark = pytest.mark.skipif(len(GPUS) < 2, reason="needs two GPUs of one host")
RANKS = min(4, len(GPUS))
E = 8


@pytest.mark.parametrize("dtype, width", [(jnp.float32, 40), (jnp.bfloat16, 4096), (jnp.int32, 1)])
@pytest.mark.parametrize("zeroed", [True, False])
def test_triton_stores_match_reference(dtype, width, zeroed):
    slots, recv_rows = 300, 500
    rng = np.random.default_rng(width)
    # Unzeroed rows must all be stored: number each rank's arrivals 0, 1, ... and read the fewest.
    source_row, dest_device, dest_row = random_peer_routes(rng, ranks=RANKS, slots=slots, recv_rows=recv_rows,
                                                           packed=not zeroed)
    num_arrived = recv_rows if zeroed else min(int((dest_device == rank).sum()) for rank in range(RANKS))
    values = jnp.asarray(rng.standard_normal((RANKS, slots, width)) * 100).astype(dtype)
    mesh = jax.make_mesh((RANKS,), ("x",), axis_types=(AxisType.Auto,), devices=GPUS[:RANKS])
    prepare_peer_transport(GPUS[:RANKS], "auto")

    def run(backend):
        def body(v, s, d, r):
            return peer_store(v[0], s[0], d[0], r[0], recv_rows, num_arrived, axis_name="x", axis_size=RANKS,
                              zeroed=zeroed, backend=backend)[None]

        fn = jax.jit(shard_map(body, mesh=mesh, in_specs=(P("x"),) * 4, out_specs=P("x")))
        return np.asarray(fn(values, jnp.asarray(source_row), jnp.asarray(dest_device), jnp.asarray(dest_row)))

    want = run("xla")
    got = run("triton")
    for _ in range(3):  # fresh buffers every call: nothing left over from an earlier exchange
        np.testing.assert_array_equal(run("triton"), got)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gemm_stores_its_rows_on_peers(dtype):
    """``grouped_matmul_store``'s GEMM epilogue stores equal ``gmm`` then the reference store, bit
    for bit; rows outside the local groups (and slots naming no rank) are stored nowhere."""
    rows, k, n, groups, recv_rows = 300, 64, 96, 3, 500
    rng = np.random.default_rng(11)
    _, dest_device, dest_row = random_peer_routes(rng, ranks=RANKS, slots=rows, recv_rows=recv_rows)
    group_sizes = np.stack([rng.multinomial(rows - 40, np.ones(groups) / groups) for _ in range(RANKS)])
    dest_device[np.arange(rows)[None, :] >= group_sizes.sum(1, keepdims=True)] = -1  # outside the groups
    lhs = jnp.asarray(rng.standard_normal((RANKS, rows, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((RANKS, groups, k, n)) / 8, dtype)
    mesh = jax.make_mesh((RANKS,), ("x",), axis_types=(AxisType.Auto,), devices=GPUS[:RANKS])
    prepare_peer_transport(GPUS[:RANKS], "auto")

    def body(lhs, rhs, sizes, device, row):
        lhs, rhs, sizes, device, row = lhs[0], rhs[0], sizes[0], device[0], row[0]
        stored = grouped_matmul_store(lhs, rhs, sizes, device, row, recv_rows, recv_rows, axis_name="x",
                                      axis_size=RANKS, backend="auto")
        product = get_backend("auto").gmm(lhs, rhs, sizes)
        reference = peer_store_reference(product, jnp.arange(rows), device, row, recv_rows, recv_rows, axis_name="x")
        return stored[None], reference[None]

    fn = jax.jit(shard_map(body, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=(P("x"), P("x"))))
    args = (lhs, rhs, jnp.asarray(group_sizes, jnp.int32), jnp.asarray(dest_device), jnp.asarray(dest_row))
    got, want = fn(*args)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert np.abs(np.asarray(want, np.float32)).sum() > 0
    np.testing.assert_array_equal(np.asarray(fn(*args)[0], np.float32), np.asarray(got, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("zero_tail", [True, False])
def test_expand_rows_matches_reference(dtype, zero_tail):
    """A receiver's tokens expanded into rows by the Triton kernel, as the reference does it."""
    rng = np.random.default_rng(5)
    table = jnp.asarray(rng.standard_normal((300, 7000)), dtype)
    index = jnp.asarray(rng.integers(0, 300, 1000), jnp.int32)
    got = jax.jit(lambda t, i: expand_rows(t, i, 613, backend="triton", zero_tail=zero_tail))(table, index)
    want = expand_rows(table, index, 613, backend="xla")
    rows = slice(None) if zero_tail else slice(0, 613)
    np.testing.assert_array_equal(np.asarray(got[rows], np.float32), np.asarray(want[rows], np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("exchange_capacity, chunks, skew_to, expert_bias, top_k", [
    (None, 1, None, False, 2),  # one round, one chunk: buffers need no zeros past the rows that arrive
    (None, 1, None, False, 4),  # the same, the dispatch deduplicated (tokens once per rank)
    (None, 1, None, True, 2),  # a per-expert bias: its gradient sums every row, so the tails are zeroed
    (5, 1, None, False, 2),  # several rounds (the overflow loop)
    (None, 2, 0, False, 2),  # two chunks, every copy to one rank
])
def test_layer_on_peer_matches_all_to_all(dtype, exchange_capacity, chunks, skew_to, expert_bias, top_k,
                                          monkeypatch):
    """Outputs bit for bit, and gradients too with two copies per token: both transports put the
    same rows in the same sorted order before the GEMMs."""
    if top_k > 2:
        monkeypatch.setattr(exchange, "DEDUP_MIN_ROWS_PER_TOKEN_RANK", 1.0)
    tokens, indices, weights, params = random_case(7, num_tokens=256, d_model=128, d_ff=64, num_experts=E,
                                                   top_k=top_k, dtype=dtype, expert_bias=expert_bias,
                                                   token_scale=True, skew_to=skew_to)
    cotangent = jnp.asarray(np.random.default_rng(8).standard_normal(tokens.shape), dtype)
    program = swiglu_program(expert_bias=expert_bias, token_scale=True)
    mesh = jax.make_mesh((RANKS,), ("expert",), axis_types=(AxisType.Auto,), devices=GPUS[:RANKS])
    layout = plan_layout(mesh, P("expert"), [P("expert")] * (4 if expert_bias else 3), E)

    # The same rounds and chunks on both transports (by default "peer" makes one round of a rank's
    # every row): chunks and rounds partition the weight-gradient sums, and so their rounding.
    capacity = exchange_capacity or tokens.shape[0] // RANKS * top_k

    def out_and_grads(transport):
        def moe(t, w, p):
            return sharded_sparse_moe(t, indices, w, p, program, num_experts=E, layout=layout,
                                      exchange_transport=transport, exchange_capacity=capacity,
                                      exchange_chunks=chunks)

        def run(t, w, p, g):
            out, vjp = jax.vjp(moe, t, w, p)
            return out, vjp(g)

        return jax.jit(run)(tokens, weights, params, cotangent)

    got, want = out_and_grads("peer"), out_and_grads("all_to_all")
    (out, (d_tokens, d_weights, d_params)), (out_want, (d_tokens_want, d_weights_want, d_params_want)) = got, want
    if expert_bias:  # its gradient is a scatter-add over rows: XLA:GPU's atomics sum in no fixed order
        bias_grad, bias_grad_want = d_params[3], d_params_want[3]
        error = float(jnp.linalg.norm((bias_grad - bias_grad_want).astype(jnp.float32))
                      / jnp.linalg.norm(bias_grad_want.astype(jnp.float32)))
        assert error < (1e-5 if dtype == jnp.float32 else 3e-2), error
        d_params, d_params_want = d_params[:3] + d_params[4:], d_params_want[:3] + d_params_want[4:]
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_want, np.float32))
    for a, b in zip(jax.tree.leaves((d_tokens, d_weights, d_params)),
                    jax.tree.leaves((d_tokens_want, d_weights_want, d_params_want)), strict=True):
        if top_k <= 2:
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        else:  # four copies per token: the two programs' sums over a token's copies differ in order (last bits)
            error = float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
            assert error < (1e-6 if dtype == jnp.float32 else 1e-2), error


@pytest.mark.skipif(len(GPUS) < 4, reason="needs four GPUs of one host")
@pytest.mark.parametrize("quant", [None, "fp8_e4m3"])
def test_peer_on_fsdp_by_expert_mesh(quant):
    """(fsdp=2, expert=2): the peer stores run beside the FSDP weight all-gathers (bf16 or FP8) and
    their reduce-scatters, on two EP groups at once; bit for bit against all_to_all."""
    tokens, indices, weights, params = random_case(9, num_tokens=256, d_model=128, d_ff=64, num_experts=E,
                                                         top_k=2, dtype=jnp.bfloat16, skew_to=None)
    cotangent = jnp.asarray(np.random.default_rng(10).standard_normal(tokens.shape), jnp.bfloat16)
    program = swiglu_program()
    mesh = jax.make_mesh((2, 2), ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2, devices=GPUS[:4])
    specs = [P("expert", "fsdp", None), P("expert", "fsdp", None), P("expert", None, "fsdp")]
    layout = plan_layout(mesh, P(("fsdp", "expert")), specs, E)
    capacity = tokens.shape[0] // mesh.size * 2  # a device's every row (top_k = 2) in one round on both transports

    def out_and_grads(transport):
        def moe(t, w, p):
            return sharded_sparse_moe(t, indices, w, p, program, num_experts=E, layout=layout,
                                      exchange_transport=transport, exchange_capacity=capacity,
                                      weight_gather_quant=quant)

        def run(t, w, p, g):
            out, vjp = jax.vjp(moe, t, w, p)
            return out, vjp(g)

        return jax.jit(run)(tokens, weights, params, cotangent)

    got, want = out_and_grads("peer"), out_and_grads("all_to_all")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_default_transport_is_peer_on_this_host():
    """``"auto"``, the default, picks ``"peer"`` on the GPUs of this process with the Triton kernels,
    and the layer it runs is the explicit ``"peer"`` one: no token all-to-all, bit for bit."""
    from moe_lowering.parallel.exchange import resolve_transport

    assert resolve_transport("auto", GPUS[:RANKS], "auto") == "peer"
    tokens, indices, weights, params = random_case(12, num_tokens=256, d_model=128, d_ff=64, num_experts=E,
                                                   top_k=2, dtype=jnp.bfloat16, skew_to=None)
    cotangent = jnp.asarray(np.random.default_rng(13).standard_normal(tokens.shape), jnp.bfloat16)
    program = swiglu_program()
    mesh = jax.make_mesh((RANKS,), ("expert",), axis_types=(AxisType.Auto,), devices=GPUS[:RANKS])
    layout = plan_layout(mesh, P("expert"), [P("expert")] * 3, E)
    assert layout.devices == tuple(GPUS[:RANKS])

    def out_and_grads(**transport):
        def moe(t, w, p):
            return sharded_sparse_moe(t, indices, w, p, program, num_experts=E, layout=layout, **transport)

        def run(t, w, p, g):
            out, vjp = jax.vjp(moe, t, w, p)
            return out, vjp(g)

        return jax.jit(run)

    default, peer = out_and_grads(), out_and_grads(exchange_transport="peer")
    args = (tokens, weights, params, cotangent)
    assert "all-to-all" not in default.lower(*args).compile().as_text()
    for a, b in zip(jax.tree.leaves(default(*args)), jax.tree.leaves(peer(*args)), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_first_call_loads_no_kernel_at_launch():
    """One process launches each GPU's kernels from its own thread, and a peer wait spins until
    another GPU's thread has pushed: a launch thread held up meanwhile (a kernel loaded at its first
    launch under a lock) deadlocked the first forward+backward call (``benchmarks/EP_NOTES.md``).
    The Hopper weight gradient's kernels are loaded when the program is lowered, on every GPU."""
    from moe_lowering.kernels.grouped_matmul_sm90 import jax_launch, xla_call

    if not jax_launch._all_gpus_sm90():
        pytest.skip("the Hopper weight gradient runs on sm_90 GPUs only")
    tokens, indices, weights, params = random_case(9, num_tokens=512, d_model=256, d_ff=512, num_experts=E, top_k=2,
                                                   dtype=jnp.bfloat16)
    mesh = jax.make_mesh((RANKS,), ("expert",), axis_types=(AxisType.Auto,), devices=GPUS[:RANKS])
    layout = plan_layout(mesh, P("expert"), [P("expert")] * 3, E)

    def loss(t, p):
        out = sharded_sparse_moe(t, indices, weights, p, swiglu_program(), num_experts=E, layout=layout,
                                 exchange_transport="peer")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(tokens, params)
    assert xla_call.CUSTOM_CALL_TARGET in lowered.as_text(), "the weight gradient did not take the Hopper kernel"
    compiled = lowered.compile()
    driver = xla_call._loaded_driver()
    loads_before = driver.launch_time_loads
    jax.block_until_ready(compiled(tokens, params))
    assert driver.launch_time_loads == loads_before
