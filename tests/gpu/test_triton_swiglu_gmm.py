"""The fused Triton SwiGLU up-projection on a CUDA GPU against float64 references, at awkward sizes.

Skipped without a GPU or jax_triton. Same cases as ``test_triton_grouped_matmul`` (empty groups,
one group taking every row, rows outside every group, a ``group_offset`` window, all empty),
N not a multiple of any tile width, outputs poisoned with NaN before each call; forward with and
without the stored pre-activations, and the gradients of ``grouped_swiglu_matmul`` on it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from moe_lowering.kernels import BackendUnavailable, get_backend

try:
    get_backend("triton")
except BackendUnavailable as err:
    pytest.skip(f"Triton backend unavailable: {err}", allow_module_level=True)

from moe_lowering.kernels.grouped_matmul import triton_launch as tgm  # noqa: E402
from moe_lowering.kernels.swiglu_gmm import triton_launch as tsw  # noqa: E402
from moe_lowering import sparse_moe  # noqa: E402
from moe_lowering.kernels.grouped_matmul_sm90.xla_call import CUSTOM_CALL_TARGET as GLUON_TARGET  # noqa: E402


def _kernel_calls(hlo_text: str) -> int:
    """Kernel launches of a compiled program: Triton's custom calls and the Hopper Gluon kernels' (the
    weight gradient, ``tgmm``, runs the latter on an sm_90 GPU)."""
    return sum(hlo_text.count(f'custom_call_target="{target}"') for target in ("triton_kernel_call", GLUON_TARGET))

pytestmark = pytest.mark.gpu

CASES = {
    "empty-groups": ([130, 0, 257, 3, 0, 411, 199], 1000, 0, 7),
    "one-group-takes-all": ([0, 0, 777, 0], 777, 0, 4),
    "rows-outside-groups": ([100, 250, 0, 311], 901, 0, 4),
    "group-offset-window": ([120, 333, 64, 0, 290, 150], 957, 1, 4),
    "all-empty": ([0, 0, 0], 129, 0, 3),
}
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2}
DTYPE_CONFIGS = [
    pytest.param(jnp.float32 if config == tgm.gmm_config(1, 1, 1, 1, True) else jnp.bfloat16, config,
                 id=f"{config.block_m}x{config.block_n}x{config.block_k}s{config.num_stages}")
    for config in {tsw.swiglu_config(*shape, compute_f32): None
                   for shape in ((16384, 4096, 14336, 8), (131072, 2048, 768, 128), (32768, 7168, 2048, 256))
                   for compute_f32 in (False, True)}
]


def _group_of_row(group_sizes, num_rows):
    group_of_row = np.full(num_rows, -1)
    ends = np.cumsum(group_sizes)
    for group, (start, end) in enumerate(zip(ends - np.asarray(group_sizes), ends)):
        group_of_row[start:min(end, num_rows)] = group
    return group_of_row


def _products(lhs, weights, group_sizes, group_offset, transpose=False):
    """float64 ``lhs[r] @ weights[group(r) - offset]`` (``weights^T`` with ``transpose``), zero outside."""
    lhs, weights = np.asarray(lhs, np.float64), np.asarray(weights, np.float64)
    if transpose:
        weights = np.swapaxes(weights, 1, 2)
    out = np.zeros((lhs.shape[0], weights.shape[2]))
    for local in range(weights.shape[0]):
        rows = _group_of_row(group_sizes, lhs.shape[0]) == local + group_offset
        out[rows] = lhs[rows] @ weights[local]
    return out


def _weight_grads(lhs, grad, group_sizes, group_offset, num_groups):
    lhs, grad = np.asarray(lhs, np.float64), np.asarray(grad, np.float64)
    group_of_row = _group_of_row(group_sizes, lhs.shape[0])
    return np.stack([lhs[group_of_row == g + group_offset].T @ grad[group_of_row == g + group_offset]
                     for g in range(num_groups)])


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _relative_error(actual, expected):
    actual = np.asarray(actual, np.float64)
    assert not np.isnan(actual).any(), f"{np.isnan(actual).sum()} output elements were never written (or NaN)"
    return np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)


def _operands(case, dtype, k=200, n=328):
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    keys = jax.random.split(jax.random.key(hash(case) % 2**31), 4)
    lhs = jax.random.normal(keys[0], (num_rows, k), jnp.float32).astype(dtype)
    gate, up = (jax.random.normal(key, (num_local, k, n), jnp.float32).astype(dtype) for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], (num_rows, n), jnp.float32).astype(dtype)
    return lhs, gate, up, cotangent, jnp.asarray(group_sizes, jnp.int32), group_offset


def _f32(*arrays):
    return [np.asarray(a.astype(jnp.float32)) for a in arrays]


@pytest.mark.parametrize("with_preactivations", [False, True], ids=["fused", "with-preactivations"])
@pytest.mark.parametrize("dtype,config", DTYPE_CONFIGS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_swiglu_gmm_matches_reference(case, dtype, config, with_preactivations):
    lhs, gate, up, _, sizes, offset = _operands(case, dtype)
    group_sizes = np.asarray(sizes)
    jnp.full((lhs.shape[0], 3 * gate.shape[2]), jnp.nan, dtype).block_until_ready()
    got = tsw.swiglu_gmm(lhs, gate, up, sizes, group_offset=offset, with_preactivations=with_preactivations,
                         config=config)
    lhs32, gate32, up32 = _f32(lhs, gate, up)
    gate_ref = _products(lhs32, gate32, group_sizes, offset)
    up_ref = _products(lhs32, up32, group_sizes, offset)
    outputs = got if with_preactivations else (got,)
    for output, expected in zip(outputs, (_silu(gate_ref) * up_ref, gate_ref, up_ref)):
        assert output.shape == expected.shape and output.dtype == dtype
        assert _relative_error(output.astype(jnp.float32), expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("route", ["fused", "pair", "fused-no-sum"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", ["empty-groups", "group-offset-window"])
def test_grouped_swiglu_matmul_gradients_match_reference(case, dtype, route, monkeypatch):
    """The primitive's rules on the Triton backend's ``swiglu_gmm``: the fused kernel (narrow experts), or
    ``gmm_pair`` and the activation apart (``FUSED_MAX_N`` 0: wide ones); the rows' cotangent through
    ``gmm_sum``, or (``fused-no-sum``) two transposed products added apart."""
    triton_backend = get_backend("triton")
    assert triton_backend.swiglu_gmm is not None and triton_backend.gmm_sum is not None
    if route == "pair":
        monkeypatch.setattr(tsw, "FUSED_MAX_N", 0)
    if route == "fused-no-sum":
        triton_backend = dataclasses.replace(triton_backend, gmm_sum=None)
    monkeypatch.setattr(sparse_moe, "get_backend", lambda name: triton_backend)
    lhs, gate, up, cotangent, sizes, offset = _operands(case, dtype)
    group_sizes = np.asarray(sizes)

    def fused(x, wg, wu):
        return sparse_moe.grouped_swiglu_matmul(x, wg, wu, sizes, "triton", offset, None)

    out, vjp = jax.vjp(fused, lhs, gate, up)
    d_lhs, d_gate, d_up = jax.jit(vjp)(cotangent)
    lhs32, gate32, up32, cot32 = _f32(lhs, gate, up, cotangent)
    g = _products(lhs32, gate32, group_sizes, offset)
    u = _products(lhs32, up32, group_sizes, offset)
    sigmoid = 1.0 / (1.0 + np.exp(-g))
    dg = cot32 * u * sigmoid * (1.0 + g * (1.0 - sigmoid))
    du = cot32 * g * sigmoid
    expected = {
        "out": (out, _silu(g) * u),
        "d_lhs": (d_lhs, _products(dg, gate32, group_sizes, offset, True)
                  + _products(du, up32, group_sizes, offset, True)),
        "d_gate": (d_gate, _weight_grads(lhs32, dg, group_sizes, offset, gate.shape[0])),
        "d_up": (d_up, _weight_grads(lhs32, du, group_sizes, offset, up.shape[0])),
    }
    for name, (got, want) in expected.items():
        assert got.dtype == dtype, name
        error = _relative_error(got.astype(jnp.float32), want)
        assert error < TOLERANCE[dtype] * (2 if dtype == jnp.bfloat16 else 1), (name, error)


@pytest.mark.parametrize("n, fused", [(tsw.FUSED_MAX_N, True), (tsw.FUSED_MAX_N + 8, False)])
def test_backend_fuses_only_narrow_experts(n, fused, monkeypatch):
    """Where the fused kernel measured faster (SonicMoE's n <= 512 layers on an H100) it runs;
    wider experts run ``gmm_pair`` (two ``gmm`` launches and one pair tail) and the activation apart."""
    seen = []
    monkeypatch.setattr(tsw, "swiglu_gmm", lambda *a, **k: seen.append("fused") or tsw.reference.swiglu_gmm_reference(*a, **k))
    monkeypatch.setattr(tsw, "gmm_pair", lambda *a, **k: seen.append("pair") or tgm.gmm_pair(*a, **k))
    lhs = jnp.ones((64, 32), jnp.bfloat16)
    weights = jnp.ones((2, 32, n), jnp.bfloat16)
    tsw.swiglu_gmm_or_pair(lhs, weights, weights, jnp.asarray([30, 34], jnp.int32))
    assert seen == (["fused"] if fused else ["pair"])
    assert get_backend("triton").swiglu_gmm is not None


@pytest.mark.parametrize("with_preactivations", [False, True], ids=["fused", "with-preactivations"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gather_swiglu_gmm_matches_reference(case, dtype, with_preactivations):
    """The up projection reading its rows from fewer token rows (indices repeating) as it loads them,
    against the products of the gathered rows (and, stored for the backward, both products)."""
    lhs, gate, up, _, sizes, offset = _operands(case, dtype)
    group_sizes = np.asarray(sizes)
    keys = jax.random.split(jax.random.key(3), 2)
    tokens = jax.random.normal(keys[0], (lhs.shape[0] // 2 + 1, lhs.shape[1]), jnp.float32).astype(dtype)
    index = jax.random.randint(keys[1], (lhs.shape[0],), 0, tokens.shape[0])
    rows32 = np.asarray(tokens.astype(jnp.float32))[np.asarray(index)]
    jnp.full((lhs.shape[0], 3 * gate.shape[2]), jnp.nan, dtype).block_until_ready()
    got = tsw.gather_swiglu_gmm(tokens, gate, up, index, sizes, group_offset=offset,
                                with_preactivations=with_preactivations)
    gate32, up32 = _f32(gate, up)
    gate_ref, up_ref = _products(rows32, gate32, group_sizes, offset), _products(rows32, up32, group_sizes, offset)
    outputs = got if with_preactivations else (got,)
    for out, expected in zip(outputs, (_silu(gate_ref) * up_ref, gate_ref, up_ref)):
        assert out.shape == expected.shape and out.dtype == dtype
        assert _relative_error(out.astype(jnp.float32), expected) < TOLERANCE[dtype]


def test_layer_forward_reads_the_tokens_without_permuting_them(monkeypatch):
    """The rewritten Mixtral layer's forward with ``gather_swiglu_gmm``: no row-gather kernel (the
    permuted copy is never made), the same output as on permuted rows; differentiated, the weight
    gradients read the tokens too (``gather_lhs_tgmm``: no row gather in the training step either),
    and the gradients agree to bf16 rounding."""
    from moe_lowering import moe_optimize
    from moe_lowering.testing import ZOO

    model = ZOO["mixtral"].sized(T=512, d=256, f=128, E=8)
    params, x = model.args(jax.random.key(4), jnp.bfloat16)
    triton = get_backend("triton")
    permuted = dataclasses.replace(triton, name="triton-permuted", gather_swiglu_gmm=None)
    results, kernels = {}, {}
    for name, backend in (("gathered", triton), ("permuted", permuted)):
        monkeypatch.setattr(sparse_moe, "get_backend", lambda _, b=backend: b)
        layer = moe_optimize(model.fn, strict=True)  # one per backend: its trace is cached
        forward = jax.jit(layer).lower(params, x).compile().as_text()
        kernels[name] = _kernel_calls(forward)
        loss = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(layer(p, x).astype(jnp.float32)))))
        step = loss.lower(params, x).compile().as_text()
        kernels[f"{name}-step"] = _kernel_calls(step)
        results[name] = jax.tree_util.tree_leaves((jax.jit(layer)(params, x), loss(params, x)))
    assert kernels["gathered"] == kernels["permuted"] - 1, kernels  # no row-gather kernel
    assert kernels["gathered-step"] == kernels["permuted-step"] - 1, kernels  # nor in the training step
    for got, want in zip(results["gathered"], results["permuted"]):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.isfinite(got).all() and np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
