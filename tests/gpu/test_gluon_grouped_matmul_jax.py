"""The Hopper Gluon grouped GEMMs launched from JAX (``grouped_matmul_sm90.jax_launch``: a custom call
encoding TMA descriptors at run time) against the float32 reference, on an sm_90 GPU.

Group patterns as the probe's: empty groups, ragged sizes, one group holding every row, rows past
the groups (``gmm`` must give zeros there), K and N not tile multiples, a tiny group; ``tgmm`` also
with a float32 output. Each case runs twice in one program, with new data, so that stale
descriptors (an address from another call) would show.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

if not any(d.platform == "gpu" for d in jax.devices()) or getattr(jax.devices()[0], "compute_capability", "") != "9.0":
    pytest.skip("needs a Hopper GPU (sm_90)", allow_module_level=True)

from moe_lowering.kernels.grouped_matmul import triton_launch  # noqa: E402,F401 - imports jax_triton, which clears TRITON_CACHE_DIR
from moe_lowering.kernels.grouped_matmul_sm90 import jax_launch, reference  # noqa: E402

pytestmark = pytest.mark.gpu

# name: (group sizes, rows, K, N)
CASES = {
    "empty-groups": ([300, 0, 517, 0, 129], 946, 256, 512),
    "ragged": ([1, 255, 256, 257, 700], 1469, 512, 384),
    "one-group-holds-all": ([0, 1500, 0], 1500, 256, 256),
    "rows-past-groups": ([200, 333], 1000, 256, 512),
    "k-n-not-tile-multiples": ([190, 70, 400], 660, 320, 272),
    "tiny-group": ([3], 3, 128, 256),
}


def _data(seed, rows, k, n, groups):
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((rows, k)).astype(np.float32)
    rhs = rng.standard_normal((groups, k, n)).astype(np.float32) / np.sqrt(k)
    dout = rng.standard_normal((rows, n)).astype(np.float32)
    return [jnp.asarray(a, jnp.bfloat16) for a in (lhs, rhs, dout)]


def _relative_error(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


@pytest.mark.parametrize("name", sorted(CASES))
def test_gmm_matches_reference(name):
    sizes, rows, k, n = CASES[name]
    if k % 64:
        pytest.skip("gmm needs K a multiple of block_k (64)")
    group_sizes = jnp.asarray(sizes, jnp.int32)
    step = jax.jit(lambda a, b, c, d, g: (jax_launch.gmm(a, b, g), jax_launch.gmm(c, d, g)))
    (lhs, rhs, _), (lhs2, rhs2, _) = _data(1, rows, k, n, len(sizes)), _data(2, rows, k, n, len(sizes))
    out, out2 = step(lhs, rhs, lhs2, rhs2, group_sizes)
    for got, a, b in ((out, lhs, rhs), (out2, lhs2, rhs2)):
        want = reference.gmm_rows(np.asarray(a, np.float32), np.asarray(b, np.float32), sizes)
        assert _relative_error(got, want) < 1e-2
        assert np.all(np.asarray(got, np.float32)[sum(sizes):] == 0)


@pytest.mark.parametrize("config", ["default", "64x256x64-s4-pingpong-tma", "128x256x64-s3-w8-tma"])
def test_gmm_unzeroed_keeps_the_groups_rows(config):
    """Without ``zero_outside`` the groups' rows are the product; the rest is unspecified."""
    sizes, rows, k, n = CASES["rows-past-groups"]
    chosen = None if config == "default" else jax_launch.gluon_launch.CONFIGS[config]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs, rhs, _ = _data(5, rows, k, n, len(sizes))
    out = jax.jit(lambda a, b, g: jax_launch.gmm(a, b, g, config=chosen, zero_outside=False))(lhs, rhs, group_sizes)
    want = reference.gmm_rows(np.asarray(lhs, np.float32), np.asarray(rhs, np.float32), sizes)
    assert _relative_error(np.asarray(out, np.float32)[:sum(sizes)], want[:sum(sizes)]) < 1e-2


FORWARD_CONFIGS = ["default", "64x256x64-s4-pingpong-tma", "128x256x64-s3-w8-tma"]


def _weights_transposed(seed, groups, n, k):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((groups, n, k)) / np.sqrt(k), jnp.bfloat16)


@pytest.mark.parametrize("config", FORWARD_CONFIGS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_gmm_with_transposed_weights_matches_reference(name, config):
    """``ct @ w[g]^T`` (the input gradient) from ``[E, N, K]`` weights: any K (the boxes' contiguous axis),
    N off the tile (a box's columns past N come from the next group and must never be stored)."""
    sizes, rows, k, n = CASES[name]
    chosen = None if config == "default" else jax_launch.gluon_launch.CONFIGS[config]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs, _, _ = _data(11, rows, k, n, len(sizes))
    rhs_t = _weights_transposed(12, len(sizes), n, k)
    out = jax.jit(lambda a, b, g: jax_launch.gmm(a, b, g, config=chosen, transpose_rhs=True))(lhs, rhs_t, group_sizes)
    want = reference.gmm_rows(np.asarray(lhs, np.float32), np.swapaxes(np.asarray(rhs_t, np.float32), 1, 2), sizes)
    assert out.shape == (rows, n)
    assert _relative_error(out, want) < 1e-2
    assert np.all(np.asarray(out, np.float32)[sum(sizes):] == 0)


@pytest.mark.parametrize("transpose_rhs", [True, False])
@pytest.mark.parametrize("config", FORWARD_CONFIGS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_gmm_sum_matches_the_sum_of_the_products(name, config, transpose_rhs):
    """Both products in one accumulator; neither alone (a mutant dropping one is off by a whole product)."""
    sizes, rows, k, n = CASES[name]
    if k % 64 and not transpose_rhs:
        pytest.skip("untransposed weights need K a multiple of block_k (64)")
    chosen = None if config == "default" else jax_launch.gluon_launch.CONFIGS[config]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    (lhs_a, rhs_a, _), (lhs_b, rhs_b, _) = _data(13, rows, k, n, len(sizes)), _data(14, rows, k, n, len(sizes))
    if transpose_rhs:
        rhs_a, rhs_b = (jnp.swapaxes(w, 1, 2) for w in (rhs_a, rhs_b))
    step = jax.jit(lambda a, b, wa, wb, g: jax_launch.gmm_sum(a, b, wa, wb, g, config=chosen,
                                                              transpose_rhs=transpose_rhs))
    out = step(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes)
    as_kn = (lambda w: np.swapaxes(np.asarray(w, np.float32), 1, 2)) if transpose_rhs else (
        lambda w: np.asarray(w, np.float32))
    want = (reference.gmm_rows(np.asarray(lhs_a, np.float32), as_kn(rhs_a), sizes)
            + reference.gmm_rows(np.asarray(lhs_b, np.float32), as_kn(rhs_b), sizes))
    assert _relative_error(out, want) < 1e-2
    assert np.all(np.asarray(out, np.float32)[sum(sizes):] == 0)


@pytest.mark.parametrize("config", FORWARD_CONFIGS)
def test_rows_past_the_groups_are_zeroed_by_the_kernel_over_stale_memory(config):
    """The output is not handed in zeroed: the kernel writes the rows past the groups itself. A freed
    NaN-filled buffer of the output's size comes first, so an output laid over it shows any row left out
    (without ``zero_outside`` they keep what the memory held)."""
    sizes, rows, k, n = [100, 0, 37], 700, 256, 272
    chosen = None if config == "default" else jax_launch.gluon_launch.CONFIGS[config]
    lhs, rhs, _ = _data(17, rows, k, n, len(sizes))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    outs = {}
    for zero_outside in (False, True):
        junk = jnp.full((rows, n), jnp.nan, jnp.bfloat16).block_until_ready()
        del junk
        outs[zero_outside] = np.asarray(jax.jit(lambda a, b, g, z=zero_outside: jax_launch.gmm(
            a, b, g, config=chosen, zero_outside=z))(lhs, rhs, group_sizes), np.float32)
    assert np.all(outs[True][sum(sizes):] == 0)
    np.testing.assert_array_equal(outs[True][:sum(sizes)], outs[False][:sum(sizes)])


def test_the_backends_products_run_gluon_and_match_triton():
    """The Triton backend's ``gmm`` (both forms), ``gmm_pair`` and ``gmm_sum`` on a Hopper GPU launch the Gluon
    kernel (a ``moe_gluon_call`` in the program) and agree with Triton's kernels; a group offset (an
    expert-parallel shard) keeps Triton's."""
    from moe_lowering.kernels import get_backend

    backend = get_backend("triton")
    sizes = [190, 70, 0, 400]
    rows, k, n = sum(sizes) + 9, 512, 384
    group_sizes = jnp.asarray(sizes, jnp.int32)
    (lhs, rhs, dout), (lhs2, rhs2, _) = _data(15, rows, k, n, len(sizes)), _data(16, rows, k, n, len(sizes))
    rhs_t, rhs2_t = (jnp.swapaxes(w, 1, 2) for w in (rhs, rhs2))
    cases = {
        "gmm": (lambda: backend.gmm(lhs, rhs, group_sizes),
                lambda: triton_launch.gmm(lhs, rhs, group_sizes)),
        "gmm-transposed": (lambda: backend.gmm(dout, rhs, group_sizes, transpose_rhs=True),
                           lambda: triton_launch.gmm(dout, rhs, group_sizes, transpose_rhs=True)),
        "gmm_pair": (lambda: backend.gmm_pair(lhs, rhs, rhs2, group_sizes),
                     lambda: triton_launch.gmm_pair(lhs, rhs, rhs2, group_sizes)),
        "gmm_sum": (lambda: backend.gmm_sum(lhs, lhs2, rhs_t, rhs2_t, group_sizes),
                    lambda: triton_launch.gmm_sum(lhs, lhs2, rhs_t, rhs2_t, group_sizes)),
    }
    for name, (ours, triton_only) in cases.items():
        assert "moe_gluon_call" in str(jax.make_jaxpr(ours)()), name
        got, want = jax.jit(ours)(), jax.jit(triton_only)()
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert _relative_error(g, w) < 1e-2, name
            assert np.all(np.asarray(g, np.float32)[sum(sizes):] == 0), name
    offset = jax.make_jaxpr(lambda: backend.gmm(lhs, rhs[:2], group_sizes, group_offset=1))()
    assert "moe_gluon_call" not in str(offset)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("name", sorted(CASES))
def test_tgmm_matches_reference(name, out_dtype):
    sizes, rows, k, n = CASES[name]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    step = jax.jit(lambda a, b, c, d, g: (jax_launch.tgmm(a, b, g, out_dtype), jax_launch.tgmm(c, d, g, out_dtype)))
    (lhs, _, dout), (lhs2, _, dout2) = _data(3, rows, k, n, len(sizes)), _data(4, rows, k, n, len(sizes))
    dw, dw2 = step(lhs, dout, lhs2, dout2, group_sizes)
    assert dw.dtype == out_dtype and dw.shape == (len(sizes), k, n)
    for got, a, b in ((dw, lhs, dout), (dw2, lhs2, dout2)):
        want = reference.tgmm_rows(np.asarray(a, np.float32), np.asarray(b, np.float32), sizes)
        assert _relative_error(got, want) < (1e-2 if out_dtype == jnp.bfloat16 else 1e-5)
        for group, size in enumerate(sizes):
            if size == 0:
                assert np.all(np.asarray(got[group], np.float32) == 0)


TAIL_CONFIGS = [name for name, c in jax_launch.gluon_launch.TGMM_CONFIGS.items() if c.tail_rows or c.staging > 1]


@pytest.mark.parametrize("config", ["default", *TAIL_CONFIGS])
def test_tgmm_small_groups_keep_the_rows_past_them_out(config):
    """Groups of a few row blocks, sizes off the 16-row chunks, and non-finite rows past the groups: every
    tile's last block is partial, and only the group's rows may reach the product."""
    sizes = [97, 128, 0, 113, 1, 150, 64, 79, 16, 17]
    rows, k, n = sum(sizes) + 37, 256, 512
    chosen = jax_launch.DEFAULT_TGMM_CONFIG if config == "default" else jax_launch.gluon_launch.TGMM_CONFIGS[config]
    lhs, _, dout = _data(6, rows, k, n, len(sizes))
    lhs = lhs.at[sum(sizes):].set(jnp.inf)
    dout = dout.at[sum(sizes):].set(jnp.nan)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    dw = jax.jit(lambda a, b, g: jax_launch.tgmm(a, b, g, config=chosen))(lhs, dout, group_sizes)
    covered = sum(sizes)
    want = reference.tgmm_rows(np.asarray(lhs, np.float32)[:covered], np.asarray(dout, np.float32)[:covered], sizes)
    assert np.isfinite(np.asarray(dw, np.float32)).all()
    assert _relative_error(dw, want) < 1e-2


RESIDENT_CONFIGS = [name for name, c in jax_launch.gluon_launch.TGMM_CONFIGS.items() if c.resident_blocks]


@pytest.mark.parametrize("k, n", [(1280, 384), (320, 272)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("config", RESIDENT_CONFIGS)
def test_tgmm_resident_dout_with_groups_past_its_window(config, out_dtype, k, n):
    """Groups longer than the resident rows (the second, streaming launch's, on the output the first left)
    beside ones that fit, one of exactly the resident rows, an empty one, K past a chunk's k tiles or off the
    tile (masked stores), N off the tile, non-finite rows past the groups; float32 leaves by masked stores."""
    sizes = [500, 0, 193, 64, 1000, 191, 3, 192]
    rows = sum(sizes) + 21
    chosen = jax_launch.gluon_launch.TGMM_CONFIGS[config]
    lhs, _, dout = _data(8, rows, k, n, len(sizes))
    lhs = lhs.at[sum(sizes):].set(jnp.inf)
    dout = dout.at[sum(sizes):].set(jnp.nan)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    dw = jax.jit(lambda a, b, g: jax_launch.tgmm(a, b, g, out_dtype, config=chosen))(lhs, dout, group_sizes)
    covered = sum(sizes)
    want = reference.tgmm_rows(np.asarray(lhs, np.float32)[:covered], np.asarray(dout, np.float32)[:covered], sizes)
    assert np.isfinite(np.asarray(dw, np.float32)).all()
    assert _relative_error(dw, want) < (1e-2 if out_dtype == jnp.bfloat16 else 1e-5)
    assert np.all(np.asarray(dw[1], np.float32) == 0)


def test_small_groups_take_the_resident_dout_by_default():
    """DeepSeek-V3's ~128 rows a group: the default weight gradient is the resident-``dout`` kernel's."""
    sizes = [100, 140, 0, 157, 128, 99, 136, 120]
    rows, k, n = sum(sizes), 512, 256
    assert jax_launch.tgmm_config(rows, len(sizes)) is jax_launch.RESIDENT_TGMM_CONFIG
    lhs, _, dout = _data(9, rows, k, n, len(sizes))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    dw = jax.jit(lambda a, b, g: jax_launch.tgmm(a, b, g))(lhs, dout, group_sizes)
    want = reference.tgmm_rows(np.asarray(lhs, np.float32), np.asarray(dout, np.float32), sizes)
    assert _relative_error(dw, want) < 1e-2


def test_bad_shapes_raise_naming_the_problem():
    lhs = jnp.zeros((64, 100), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiples of 16"):
        jax_launch.tgmm(lhs, jnp.zeros((64, 128), jnp.bfloat16), jnp.asarray([64], jnp.int32))
    with pytest.raises(TypeError, match="bf16"):
        jax_launch.gmm(jnp.zeros((64, 128), jnp.float32), jnp.zeros((1, 128, 128), jnp.float32),
                       jnp.asarray([64], jnp.int32))


def test_kernels_load_when_lowered_not_at_their_first_launch():
    """Loading at a launch can wait for work queued on the GPU, and in one process driving several GPUs
    that work can be a peer exchange's wait for another GPU's launch thread (a deadlock: ``xla_call``'s
    docstring): every device's context holds the kernel before the program first runs."""
    from moe_lowering.kernels.grouped_matmul_sm90 import xla_call

    lhs, _, dout = _data(3, 777, 256, 384, 3)
    group_sizes = jnp.asarray([300, 0, 477], jnp.int32)
    step = jax.jit(lambda a, d, g: jax_launch.tgmm(a, d, g, out_dtype=jnp.float32) * 2.0)
    compiled = step.lower(lhs, dout, group_sizes).compile()
    driver = xla_call._loaded_driver()
    ordinals = [d.local_hardware_id for d in jax.local_devices()]
    contexts = {driver.primary_context(o) for o in ordinals}
    assert {context for _, context in driver.functions} >= contexts
    loads_before = driver.launch_time_loads
    jax.block_until_ready(compiled(lhs, dout, group_sizes))
    assert driver.launch_time_loads == loads_before, "XLA ran the call in a context other than the primary one"
