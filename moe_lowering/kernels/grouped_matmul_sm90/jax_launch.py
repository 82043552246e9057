"""The Gluon grouped GEMMs as JAX functions on Hopper GPUs: ``gmm`` (the forward product, also from
transposed weights: the input gradient), ``gmm_sum`` (two products into one output) and ``tgmm`` (the
weight gradient), each one ``moe_gluon_call`` custom call (:mod:`.xla_call`) whose kernel is compiled
for ``sm_90`` at trace time and cached per (configuration, shapes); ``backend_*`` are the Triton
backend's entry points, which take them where they apply and Triton's kernels elsewhere.

Contracts as :mod:`.reference`'s: ``gmm``'s rows past ``sum(group_sizes)`` are zero (the kernel writes
them after its tiles); ``tgmm`` writes every group (zeros for empty ones).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import tempfile

import jax
import jax.numpy as jnp
import triton

from moe_lowering import _compat
from moe_lowering.kernels.grouped_matmul_sm90 import gluon_launch, xla_call

logger = logging.getLogger(__name__)

gluon_call_p = _compat.jex_core.Primitive("moe_gluon_call")
gluon_call_p.multiple_results = True
_compat.def_compiled_impl(gluon_call_p)


@gluon_call_p.def_abstract_eval
def _abstract_eval(*operands, opaque, out_avals, aliases):
    del operands, opaque, aliases
    return out_avals


def _lowering(ctx, *operands, opaque, out_avals, aliases):
    xla_call.register_target()
    xla_call.preload(opaque, _local_gpu_ordinals())
    op = _compat.custom_call(xla_call.CUSTOM_CALL_TARGET,
                             result_types=[_compat.aval_to_ir_type(ctx, a) for a in out_avals], operands=list(operands),
                             backend_config=opaque, api_version=2, has_side_effect=False,
                             operand_output_aliases=dict(aliases) or None)
    return list(op.results)


def _local_gpu_ordinals() -> list[int]:
    """The CUDA ordinals of this process's GPUs (none where JAX has no GPU backend)."""
    try:
        return [d.local_hardware_id for d in jax.local_devices(backend="gpu")]
    except RuntimeError:
        return []


def _no_gpu(ctx, *operands, **params):
    raise RuntimeError("the Gluon grouped GEMMs run on Hopper GPUs (sm_90) only; use the 'triton' or 'xla' "
                       "backend elsewhere")


_compat.register_custom_call_lowering(gluon_call_p, _lowering, "cuda")
_compat.register_custom_call_lowering(gluon_call_p, _no_gpu, "cpu")


def _num_sms() -> int:
    device = jax.local_devices()[0]
    return int(getattr(device, "core_count", 132))


def _check_widths(op: str, k: int, n: int):
    if k % 16 or n % 16:  # the kernels are compiled with K and N taken as multiples of 16
        raise ValueError(f"gluon {op}: K = {k} and N = {n} must be multiples of 16")


def _descriptor(buffer: int, shape, meta: dict) -> xla_call.Descriptor:
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return xla_call.Descriptor(buffer, tuple(shape), strides, meta["swizzle"], meta["elem_size"], meta["elem_type"],
                               tuple(meta["block_size"]))


@contextlib.contextmanager
def _triton_cache_dir():
    """A real Triton cache folder while compiling: importing ``jax_triton`` sets ``TRITON_CACHE_DIR=""``,
    after which ``triton.compile`` fails ("Could not create or locate cache dir")."""
    if os.environ.get("TRITON_CACHE_DIR", None) != "":
        yield
        return
    os.environ["TRITON_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "moe_lowering_triton_cache")
    try:
        yield
    finally:
        os.environ["TRITON_CACHE_DIR"] = ""


@functools.cache
def _compiled_gmm(config: gluon_launch.GluonTileConfig, num_groups: int, form: gluon_launch.GemmForm):
    with _triton_cache_dir():
        return gluon_launch.compile_offline(config, num_groups, form)


@functools.cache
def _compiled_tgmm(config: gluon_launch.GluonTgmmConfig, out_dtype: str):
    with _triton_cache_dir():
        return gluon_launch.compile_tgmm_offline(config, out_dtype)


def _plan(compiled, grid: int, descriptors, group_sizes: int, scalars) -> xla_call.LaunchPlan:
    """The plan for a kernel of arguments ``(*descriptors, out_ptr, group_sizes_ptr, *scalars)``:
    ``descriptors``: each descriptor parameter's ``(buffer, shape)`` in order, the output's last (also
    ``out_ptr``); ``group_sizes``: the sizes' buffer index."""
    meta = compiled.metadata
    descs = [("desc", _descriptor(buffer, shape, m)) for (buffer, shape), m in zip(descriptors, meta.tensordesc_meta)]
    out, out_shape = descriptors[-1]
    params = (*descs, ("ptr", out), ("ptr", group_sizes), *(("i32", int(s)) for s in scalars))
    result = (out, math.prod(out_shape) * meta.tensordesc_meta[-1]["elem_size"])
    return xla_call.LaunchPlan(compiled.asm["cubin"], meta.name, meta.num_warps, meta.shared, grid, params, result,
                               kernel_hash=str(getattr(meta, "hash", "") or ""))


DEFAULT_TGMM_CONFIG = gluon_launch.LONG_GROUPS_TGMM_CONFIG
"""The probe's best streaming weight-gradient configuration at every measured shape
(``gluon_gmm_probe_tgmm_H200_2026-11-28``): 128 x 256 tiles over 64-row blocks, a group's last block in 16-row
chunks; at Mixtral's and Qwen3's group sizes within 1% of whole-block zeroing. At DeepSeek-V3's ~128-row
groups 2.72-2.83 ms a product since its loop jumps over other launches' groups (3.08-3.38 before,
``gluon_tgmm_ab_split_H200_2026-11-29.log``)."""

RESIDENT_TGMM_CONFIG = gluon_launch.TGMM_CONFIGS["tgmm-128x256-r64-s4-t16-d3x8-w8-tma"]
"""Small groups: a group's ``dout`` columns (up to 192 rows) resident over 8 k tiles, only ``lhs`` streamed; the
groups past 192 rows in a second, streaming launch (:meth:`~.gluon_launch.GluonTgmmConfig.launches`). At
DeepSeek-V3's ~128-row groups 2.60-2.93 ms a product (the output's write floor: 2.22); with skewed routing
(log-normal popularity, 5-1615 rows a group) 3.25-3.41, where the resident kernel alone took 3.63-3.99
(its long groups reloaded their rows every k tile) and the streaming kernel alone 3.05-3.11
(``gluon_tgmm_ab_split_H200_2026-11-29.log``)."""

RESIDENT_MAX_MEAN_ROWS = RESIDENT_TGMM_CONFIG.resident_rows
"""Groups averaging at most this many rows (the resident kernel's, 192) take :data:`RESIDENT_TGMM_CONFIG`."""


def tgmm_config(num_rows: int, num_groups: int, expected_rows: int | None = None) -> gluon_launch.GluonTgmmConfig:
    """The weight-gradient configuration by the rows a group holds on average: :data:`RESIDENT_TGMM_CONFIG`
    where they fit the resident window, :data:`DEFAULT_TGMM_CONFIG` otherwise. ``expected_rows``: the rows
    a buffer sized for the worst case (an expert-parallel receive buffer) holds when balanced."""
    rows = num_rows if expected_rows is None else max(1, min(expected_rows, num_rows))
    return RESIDENT_TGMM_CONFIG if rows <= RESIDENT_MAX_MEAN_ROWS * max(num_groups, 1) else DEFAULT_TGMM_CONFIG


PINGPONG_MAX_MEAN_ROWS = 256
"""Groups averaging at most this many rows take the ping-pong 64 x 256 tile whatever the contraction, where a
128-row tile pads a group's second tile: at DeepSeek-V3's ~128-row groups the layer's products took 13.07 ms
against 13.78-13.87 for Triton's ``gmm_kernel`` (``layer_profile_gluon_forward_H200_2026-11-29.log``). Alone,
one product at a time, they measured from 1.11x faster (``gluon_gmm_while_loop_ab_H200_2026-11-29.log``) to
even or slower on the gate/up pair (``gluon_forward_ab_H200_2026-11-29.log``)."""


def gmm_config(k: int, mean_rows: int | None = None) -> gluon_launch.GluonTileConfig:
    """The probe's best configuration by contraction length (``gluon_gmm_probe_H200_2026-11-28.json``, d =
    4096): ping-pong 64 x 256 tiles for the short contractions of down projections (K < 1024: 480-529
    against 400-505 TFLOP/s for the cooperative 128 x 256) and for groups of ``mean_rows`` rows on average up
    to :data:`PINGPONG_MAX_MEAN_ROWS`, the cooperative 128 x 256 tile otherwise."""
    small_groups = mean_rows is not None and mean_rows <= PINGPONG_MAX_MEAN_ROWS
    return gluon_launch.CONFIGS["64x256x64-s4-pingpong-tma" if k < 1024 or small_groups else "128x256x64-s3-w8-tma"]


def gmm(lhs, rhs, group_sizes, config: gluon_launch.GluonTileConfig | None = None, zero_outside: bool = True,
        transpose_rhs: bool = False):
    """``out[r] = lhs[r] @ rhs[group(r)]`` (bf16 ``[M, K]`` and ``[E, K, N]``, or ``[E, N, K]`` read transposed
    with ``transpose_rhs``; int32 ``[E]``); rows past the groups are zero (the kernel writes them after its
    tiles), or unspecified without ``zero_outside``. ``config``: :func:`gmm_config`'s by default."""
    return _gmm_call(((lhs, rhs),), group_sizes, config, zero_outside, transpose_rhs, "gmm")


def gmm_sum(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, config: gluon_launch.GluonTileConfig | None = None,
            zero_outside: bool = True, transpose_rhs: bool = True):
    """``lhs_a[r] @ rhs_a[g]^T + lhs_b[r] @ rhs_b[g]^T`` (weights ``[E, N, K]``; ``[E, K, N]`` without
    ``transpose_rhs``) accumulated in float32 over both contractions and written once, as bf16: the rows'
    cotangent of SwiGLU's gate and up products. Rows past the groups as :func:`gmm`'s."""
    if lhs_b.shape != lhs_a.shape or rhs_b.shape != rhs_a.shape:
        raise ValueError(f"gluon gmm_sum: the two products differ in shape: {lhs_a.shape} x {rhs_a.shape} and "
                         f"{lhs_b.shape} x {rhs_b.shape}")
    return _gmm_call(((lhs_a, rhs_a), (lhs_b, rhs_b)), group_sizes, config, zero_outside, transpose_rhs, "gmm_sum")


def _gmm_call(products, group_sizes, config, zero_outside: bool, transpose_rhs: bool, op: str):
    """One forward-kernel launch over ``products`` (``(lhs, rhs)`` pairs, summed) as a ``moe_gluon_call``."""
    (lhs, rhs) = products[0]
    num_rows, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if any(a.dtype != jnp.bfloat16 for pair in products for a in pair):
        raise TypeError(f"gluon {op}: bf16 operands only, got {[str(a.dtype) for pair in products for a in pair]}")
    if (rhs.shape[2] if transpose_rhs else rhs.shape[1]) != k:
        raise ValueError(f"gluon {op}: lhs {lhs.shape} and rhs {rhs.shape} disagree on the contraction")
    _check_widths(op, k, n)
    form = gluon_launch.GemmForm(transpose_b=transpose_rhs, products=len(products), zero_outside=zero_outside)
    config = config or gmm_config(k, _mean_rows(lhs, num_groups, None))
    gluon_launch.check_shapes(k, config, form)
    if num_rows == 0 or num_groups == 0:
        return jnp.zeros((num_rows, n), jnp.bfloat16)
    compiled = _compiled_gmm(config, num_groups, form)
    max_tiles = (triton.cdiv(num_rows, config.block_m) + num_groups) * triton.cdiv(n, config.block_n)
    grid = max(1, min(_num_sms(), max_tiles))
    # operands: each product's lhs and rhs, then group_sizes; the result is the buffer after them
    weight_shape = (num_groups * n, k) if transpose_rhs else (num_groups * k, n)
    operand_shapes = [shape for _ in products for shape in ((num_rows, k), weight_shape)]
    sizes_buffer = len(operand_shapes)
    descriptors = list(enumerate(operand_shapes))
    if len(products) == 1:
        descriptors += descriptors  # the second product's descriptors, never read
    plan = _plan(compiled, grid, (*descriptors, (sizes_buffer + 1, (num_rows, n))), sizes_buffer,
                 (num_rows, n, k, num_groups))
    (result,) = gluon_call_p.bind(*(a for pair in products for a in pair), group_sizes.astype(jnp.int32),
                                  opaque=xla_call.register_plan(plan),
                                  out_avals=(_compat.ShapedArray((num_rows, n), jnp.bfloat16),), aliases=())
    return result


def tgmm(lhs, dout, group_sizes, out_dtype=None, config: gluon_launch.GluonTgmmConfig | None = None,
         expected_rows: int | None = None):
    """``out[g] = lhs[rows of g]^T @ dout[rows of g]`` (bf16 ``[M, K]`` and ``[M, N]``) as ``[E, K, N]`` of
    ``out_dtype`` (bf16 or float32; ``lhs``'s by default), zeros for empty groups. ``config``:
    :func:`tgmm_config`'s by default (``expected_rows`` as it takes them)."""
    num_rows, k = lhs.shape
    (num_groups,) = group_sizes.shape
    n = dout.shape[1]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if lhs.dtype != jnp.bfloat16 or dout.dtype != jnp.bfloat16 or out_dtype not in (jnp.bfloat16, jnp.float32):
        raise TypeError(f"gluon tgmm: bf16 operands and a bf16 or float32 output, got {lhs.dtype}, {dout.dtype}, "
                        f"{out_dtype}")
    if dout.shape[0] != num_rows:
        raise ValueError(f"gluon tgmm: lhs {lhs.shape} and dout {dout.shape} disagree on rows")
    _check_widths("tgmm", k, n)
    if num_groups == 0 or num_rows == 0:
        return jnp.zeros((num_groups, k, n), out_dtype)
    bf16_out = out_dtype == jnp.bfloat16
    config = config or tgmm_config(num_rows, num_groups, expected_rows)
    operands = (lhs, dout, group_sizes.astype(jnp.int32))
    result = None
    # every launch after the first takes the output so far, aliased, and writes only its own groups
    for launch_config, min_group_rows in config.launches():
        launch_config = gluon_launch.launched_tgmm_config(launch_config, k, bf16_out)
        compiled = _compiled_tgmm(launch_config, "bf16" if bf16_out else "fp32")
        grid = max(1, min(_num_sms(), launch_config.work_items(num_groups, k, n)))
        scalars = (num_rows, n, k, num_groups) + (() if min_group_rows is None else (min_group_rows, ))
        # operands: lhs 0, dout 1, group_sizes 2 (and the output so far 3, aliased); the result is buffer 3
        plan = _plan(compiled, grid, ((0, (num_rows, k)), (1, (num_rows, n)), (3, (num_groups * k, n))), 2, scalars)
        (result,) = gluon_call_p.bind(*operands, *(() if result is None else (result, )),
                                      opaque=xla_call.register_plan(plan),
                                      out_avals=(_compat.ShapedArray((num_groups, k, n), out_dtype),),
                                      aliases=() if result is None else ((3, 0), ))
    return result


GLUON_GMM_MAX_MEAN_ROWS = 1024
"""Groups averaging at most this many rows run the forward and input-gradient products on the Gluon kernels;
longer ones keep Triton's ``gmm_kernel``. In the layers' profiles (H200, 2026-11-29,
``layer_profile_gluon_forward_H200_2026-11-29.log``) the Gluon kernels took DeepSeek-V3's (~128 rows a
group) 13.07 ms against 13.78-13.87 and Qwen3's (~1024) 3.68 against 3.94, but Mixtral's (~2048) 15.54
against 15.04; on Mixtral's products alone the cooperative kernel ran 5-14% slower
(``gluon_forward_ab_H200_2026-11-29.log``)."""


def _mean_rows(lhs, num_groups: int, expected_rows: int | None) -> int:
    num_rows = lhs.shape[0]
    rows = num_rows if expected_rows is None else max(1, min(expected_rows, num_rows))
    return rows // max(num_groups, 1)


def gmm_applies(lhs, rhs, group_sizes, group_offset, out_dtype, transpose_rhs: bool,
                expected_rows: int | None = None) -> bool:
    """Whether a forward-kernel product (``gmm``, each of ``gmm_pair``'s, ``gmm_sum``) runs the Hopper Gluon
    kernel: groups averaging at most :data:`GLUON_GMM_MAX_MEAN_ROWS` rows, bf16 operands and result, every
    group local (``group_offset`` 0, a size per weight), K and N multiples of 16 (K of ``block_k`` for an
    untransposed weight: a weight box must not reach into the next group), every GPU an sm_90 one, each
    process tracing its own program (see :func:`tgmm_applies`)."""
    if lhs.dtype != jnp.bfloat16 or rhs.dtype != jnp.bfloat16 or jnp.dtype(out_dtype) != jnp.bfloat16:
        return False
    if lhs.ndim != 2 or rhs.ndim != 3 or not (isinstance(group_offset, int) and group_offset == 0):
        return False
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        return False  # the Triton path raises, naming the problem
    k, n = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1], rhs.shape[2])
    if group_sizes.shape[0] != rhs.shape[0] or lhs.shape[1] != k or k % 16 or n % 16:
        return False
    if not transpose_rhs and k % min(c.block_k for c in gluon_launch.CONFIGS.values()):
        return False
    if _mean_rows(lhs, rhs.shape[0], expected_rows) > GLUON_GMM_MAX_MEAN_ROWS:
        return False
    if getattr(jax.config, "jax_share_binary_between_hosts", False):
        return False
    return _all_gpus_sm90() and _gluon_available()


def _gluon_gmm_config(lhs, rhs, expected_rows: int | None) -> gluon_launch.GluonTileConfig:
    return gmm_config(lhs.shape[1], _mean_rows(lhs, rhs.shape[0], expected_rows))


def backend_gmm(lhs, rhs, group_sizes, *, group_offset=0, transpose_rhs=False, preferred_element_type=None,
                config=None, zero_outside=True, expected_rows=None):
    """The Triton backend's ``gmm`` (``grouped_matmul.triton_launch.gmm``'s arguments): the Gluon kernel where
    :func:`gmm_applies`, Triton's ``gmm_kernel`` otherwise."""
    from moe_lowering.kernels.grouped_matmul import triton_launch

    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    if config is None and gmm_applies(lhs, rhs, group_sizes, group_offset, out_dtype, transpose_rhs, expected_rows):
        return gmm(lhs, rhs, group_sizes, _gluon_gmm_config(lhs, rhs, expected_rows), zero_outside, transpose_rhs)
    return triton_launch.gmm(lhs, rhs, group_sizes, group_offset=group_offset, transpose_rhs=transpose_rhs,
                             preferred_element_type=preferred_element_type, config=config, zero_outside=zero_outside,
                             expected_rows=expected_rows)


def backend_gmm_pair(lhs, rhs_a, rhs_b, group_sizes, *, group_offset=0, preferred_element_type=None, config=None,
                     zero_outside=True, expected_rows=None):
    """The Triton backend's ``gmm_pair``: two Gluon launches where :func:`gmm_applies` to both (the Gluon
    kernel finishes its partial tiles itself: no tail launch to share), Triton's pair otherwise."""
    from moe_lowering.kernels.grouped_matmul import triton_launch

    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs_a.dtype))
    if config is None and all(gmm_applies(lhs, rhs, group_sizes, group_offset, out_dtype, False, expected_rows)
                              for rhs in (rhs_a, rhs_b)):
        return tuple(gmm(lhs, rhs, group_sizes, _gluon_gmm_config(lhs, rhs, expected_rows), zero_outside)
                     for rhs in (rhs_a, rhs_b))
    return triton_launch.gmm_pair(lhs, rhs_a, rhs_b, group_sizes, group_offset=group_offset,
                                  preferred_element_type=preferred_element_type, config=config,
                                  zero_outside=zero_outside, expected_rows=expected_rows)


def backend_gmm_sum(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, *, group_offset=0, preferred_element_type=None,
                    config=None, expected_rows=None):
    """The Triton backend's ``gmm_sum`` (``lhs_a @ rhs_a[g]^T + lhs_b @ rhs_b[g]^T``): one Gluon launch
    accumulating both products where :func:`gmm_applies` to both, Triton's ``gmm_sum_kernel`` otherwise."""
    from moe_lowering.kernels.grouped_matmul import triton_launch

    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs_a.dtype, rhs_a.dtype))
    if (config is None and lhs_a.shape == lhs_b.shape and rhs_a.shape == rhs_b.shape
            and all(gmm_applies(lhs, rhs, group_sizes, group_offset, out_dtype, True, expected_rows)
                    for lhs, rhs in ((lhs_a, rhs_a), (lhs_b, rhs_b)))):
        return gmm_sum(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, _gluon_gmm_config(lhs_a, rhs_a, expected_rows))
    return triton_launch.gmm_sum(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, group_offset=group_offset,
                                 preferred_element_type=preferred_element_type, config=config,
                                 expected_rows=expected_rows)


def tgmm_applies(lhs, grad, group_sizes, num_groups, group_offset, out_dtype) -> bool:
    """Whether the weight gradient runs the Hopper Gluon kernel (``grouped_matmul_sm90``: 1.03-1.12x
    Triton's ``tgmm_kernel`` at d = 4096 on an H200, ``benchmarks/results/gluon_jax_*``): bf16 operands, a bf16
    or float32 result, every group local, K and N multiples of 16, every GPU an sm_90 one, and each process
    tracing its own program (not ``jax_share_binary_between_hosts``: a launch plan lives in the process
    that traced it, while Triton's kernels travel inside the program)."""
    if lhs.dtype != jnp.bfloat16 or grad.dtype != jnp.bfloat16 or out_dtype not in (jnp.bfloat16, jnp.float32):
        return False
    if not (isinstance(group_offset, int) and group_offset == 0):
        return False
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        return False  # the Triton path raises, naming the problem
    if num_groups not in (None, group_sizes.shape[0]) or lhs.shape[1] % 16 or grad.shape[1] % 16:
        return False
    if getattr(jax.config, "jax_share_binary_between_hosts", False):
        return False  # other processes would run the program untraced, their launch plans never registered
    return _all_gpus_sm90() and _gluon_available()


@functools.cache
def _all_gpus_sm90() -> bool:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    return bool(gpus) and all(getattr(d, "compute_capability", "") == "9.0" for d in gpus)


@functools.cache
def _gluon_available() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError as error:
        logger.info("Hopper weight gradient unavailable (%s): tgmm_kernel runs instead", error)
        return False
    return True


def backend_tgmm(lhs, grad, group_sizes, *, num_groups=None, group_offset=0, preferred_element_type=None,
                 config=None, expected_rows=None):
    """The Triton backend's ``tgmm`` (``grouped_matmul.triton_launch.tgmm``'s arguments): the Gluon kernel
    where :func:`tgmm_applies` (at DeepSeek-V3's ~128-row groups with a resident ``dout`` 1.30x
    ``tgmm_resident_kernel``, ``gluon_gmm_probe_tgmm_resident_H200_2026-11-29``; at Mixtral's ~2000 1.10-1.15x
    ``tgmm_kernel``, ``gluon_gmm_probe_tgmm_H200_2026-11-28``), except a float32
    gradient of small groups, Triton's kernels otherwise. A float32 tile leaves by masked stores (its staging
    buffer does not fit beside the ring), which with a few row blocks a tile ran 2.4x slower than the
    resident kernel (the ``s4-direct`` config at DeepSeek's shapes)."""
    from moe_lowering.kernels.grouped_matmul import triton_launch

    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, grad.dtype))
    if (config is None and lhs.ndim == 2 and grad.ndim == 2 and lhs.shape[0] == grad.shape[0]
            and not (out_dtype != jnp.bfloat16
                     and triton_launch.runs_resident_tgmm(lhs.shape[0], group_sizes.shape[0], expected_rows))
            and tgmm_applies(lhs, grad, group_sizes, num_groups, group_offset, out_dtype)):
        return tgmm(lhs, grad, jnp.maximum(group_sizes.astype(jnp.int32), 0), out_dtype, expected_rows=expected_rows)
    return triton_launch.tgmm(lhs, grad, group_sizes, num_groups=num_groups, group_offset=group_offset,
                              preferred_element_type=preferred_element_type, config=config,
                              expected_rows=expected_rows)

