"""FSDP all-gather of expert weights, optionally in FP8 with per-expert, per-block scales.

Each device quantises only its own shard (no communication for the scales' statistics), then
gathers FP8 bytes (as ``uint8``) plus scales: about half the bytes of a bf16 gather. The formats
(``"fp8_e4m3"``: a float32 scale per 128x128 block; ``"mxfp8"``: an E8M0 exponent per 1x32 block
along K) and ``quantize_blocks`` / ``dequantize_blocks`` are the kernel layer's
(:mod:`moe_lowering.kernels.fp8_grouped_matmul.quant_format`), since the FP8-weight kernels read them.

Two ways to use the gathered bytes. ``gather_weight`` dequantises them to the weights' dtype
(straight-through derivative: the gathered-weight gradient reduce-scattered in the weights' own
dtype). ``gather_weight_fp8`` keeps them as a :class:`GatheredFp8Weight`, which the grouped GEMMs
read as is (``GatheredFp8Weight.grouped_matmul``): on a GPU the FP8-weight Triton kernel never
writes a dequantised copy where it is the faster choice (:func:`use_fp8_kernel`); the same
straight-through derivative is that product's.

Straight-through in both autodiff modes: the layer computes with ``Q(W)`` and differentiates as
if the quantise-dequantise round trip ``Q`` were the identity, which is the derivative of
``W + stop_gradient(Q(W) - W)``. Both pieces are ``custom_jvp`` functions whose tangent is linear
in the input tangents (``all_gather`` of the weight's tangent, products with ``Q(W)``), so reverse
mode transposes it into the backward they always had (the weight gradient reduce-scattered to the
shard) and forward mode (``jax.jvp``, ``jacfwd``, Hessian-vector products) is its transpose.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from moe_lowering import primitives
from moe_lowering.kernels import get_backend
from moe_lowering.kernels.fp8_grouped_matmul.quant_format import FP8_DTYPE, MX_BLOCK, dequantize_blocks, quantize_blocks

WeightGatherQuant = Literal["fp8_e4m3", "mxfp8"]
"""How FSDP-sharded expert weights travel in their all-gather (``None`` in its place: unquantised,
exact): ``"fp8_e4m3"``, FP8 with a float32 scale per 128x128 block; ``"mxfp8"``, FP8 with a
power-of-two (E8M0) scale per 1x32 block along K."""

WEIGHT_GATHER_QUANTS: tuple[WeightGatherQuant | None, ...] = (None, *get_args(WeightGatherQuant))


def check_quantizable(shape, quant: str | None) -> None:
    """Raises ``ValueError`` when a weight shard ``[E, K, N]`` cannot be quantised as ``quant``."""
    if quant not in WEIGHT_GATHER_QUANTS:
        raise ValueError(f"weight_gather_quant must be one of {WEIGHT_GATHER_QUANTS}, got {quant!r}")
    if quant is None:
        return
    if len(shape) != 3:
        raise ValueError(f"weight-gather quantisation needs expert weights [E, K, N]; got shape {shape}")
    if quant == "mxfp8" and shape[1] % MX_BLOCK:
        raise ValueError(
            f"mxfp8 needs the local shard's contraction dim K to be a multiple of {MX_BLOCK}; got shape {shape}"
        )


def gather_weight(w, axis_name: str, dim: int, quant: str | None):
    """All-gathers the FSDP shard ``w`` along ``dim`` over ``axis_name`` (inside ``shard_map``)."""
    if quant is None:
        return jax.lax.all_gather(w, axis_name, axis=dim, tiled=True)
    return _quantized_gather(w, axis_name, dim, quant)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _quantized_gather(w, axis_name, dim, quant):
    values, scales = quantize_blocks(w, quant)
    # Sent as raw bytes: some backends (XLA:CPU) would widen an f8 all-gather to f16.
    wire = jax.lax.bitcast_convert_type(values, jnp.uint8)
    wire, scales = _opaque(jax.lax.all_gather(wire, axis_name, axis=dim, tiled=True),
                           jax.lax.all_gather(scales, axis_name, axis=dim, tiled=True))
    return dequantize_blocks(jax.lax.bitcast_convert_type(wire, FP8_DTYPE), scales, quant, w.dtype)


@_quantized_gather.defjvp
def _quantized_gather_jvp(axis_name, dim, quant, primals, tangents):
    """Straight through: the tangent is gathered exactly (its transpose reduce-scatters the gradient)."""
    (w,), (w_dot,) = primals, tangents
    return _quantized_gather(w, axis_name, dim, quant), _gathered(w_dot, axis_name, dim)


# The FP8-weight kernel against dequantise-then-GEMM on an H200 (results/fp8_gmm_bench_H200_20261122_v2.json):
# 1.85x faster at ~128 rows per expert (DeepSeek-like, weight-bound), 1.7x slower at ~2048 (Mixtral-like).
FP8_KERNEL_MAX_ROWS_PER_EXPERT = 256


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class GatheredFp8Weight:
    """An FSDP-gathered expert weight ``[E, K, N]`` kept as FP8 bytes and block scales.

    ``shard`` is this device's own slice of the weight in its original dtype. The forward never
    reads it; it is where the backward of :meth:`grouped_matmul` puts the weight gradient,
    reduce-scattered over ``axis_name`` along ``dim`` (the straight-through estimator).
    """

    values: jax.Array  # uint8 [E, K, N]: the FP8 bytes (integers, so no gradient flows into them)
    scales: jax.Array
    shard: jax.Array
    quant: str = field(metadata=dict(static=True))
    axis_name: str = field(metadata=dict(static=True))
    dim: int = field(metadata=dict(static=True))

    @property
    def shape(self):
        return self.values.shape

    @property
    def dtype(self):
        return self.shard.dtype

    def fp8_values(self):
        return jax.lax.bitcast_convert_type(self.values, FP8_DTYPE)

    def dequantize(self):
        """``Q(W)``, whose derivative is the gathered shard's (straight through ``Q``)."""
        return _straight_through_dequantized(self.values, self.scales, self.shard, self.quant, self.axis_name,
                                             self.dim)

    def grouped_matmul(self, lhs, group_sizes, backend, group_offset, preferred_element_type, expected_rows=None):
        """``lhs[r] @ self[group(r)]`` (the protocol :func:`moe_lowering.sparse_moe.expert_matmul` calls)."""
        return fp8_weight_matmul(lhs, self, group_sizes, backend, group_offset, preferred_element_type, expected_rows)


def gather_weight_fp8(w, axis_name: str, dim: int, quant: str) -> GatheredFp8Weight:
    """Like ``gather_weight(w, axis_name, dim, quant)``, but the gathered weight stays FP8."""
    values, scales = jax.lax.stop_gradient(quantize_blocks(w, quant))
    wire = jax.lax.all_gather(jax.lax.bitcast_convert_type(values, jnp.uint8), axis_name, axis=dim, tiled=True)
    scales = jax.lax.all_gather(scales, axis_name, axis=dim, tiled=True)
    return GatheredFp8Weight(*_opaque(wire, scales), w, quant, axis_name, dim)


def _opaque(*arrays):
    """``arrays`` as XLA must keep them. Where the all-gather is a no-op (an FSDP axis of size 1),
    XLA:GPU would otherwise fold quantise-then-dequantise (f32 -> fp8 -> f32) away as excess
    precision, and a dequantised product would silently use the unquantised weights."""
    return jax.lax.optimization_barrier(arrays)


def use_fp8_kernel(lhs, weight: GatheredFp8Weight, backend: str, expected_rows: int | None = None) -> bool:
    """Whether the FP8-weight kernel beats dequantise-then-GEMM here: a GPU backend and few rows per
    expert, counted in ``expected_rows`` where ``lhs`` is a receive buffer sized for the worst case
    (at DeepSeek's EP=4 the buffer alone says 512 rows per expert, a balanced arrival 128)."""
    rows = lhs.shape[0] if expected_rows is None else min(expected_rows, lhs.shape[0])
    rows_per_expert = rows / max(weight.shape[0], 1)
    return (get_backend(backend).name == "triton" and lhs.dtype in (jnp.bfloat16, jnp.float16)
            and rows_per_expert <= FP8_KERNEL_MAX_ROWS_PER_EXPERT)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5, 6))
def fp8_weight_matmul(lhs, weight: GatheredFp8Weight, group_sizes, backend, group_offset, preferred_element_type,
                      expected_rows=None):
    """``lhs[r] @ weight[group(r)]`` with the weight read from its FP8 bytes where that is faster.
    ``expected_rows``: as for :func:`moe_lowering.sparse_moe.grouped_matmul`."""
    if use_fp8_kernel(lhs, weight, backend, expected_rows):
        from moe_lowering.kernels.fp8_grouped_matmul.triton_launch import fp8_gmm

        return fp8_gmm(lhs, weight.fp8_values(), weight.scales, group_sizes, quant=weight.quant,
                       group_offset=group_offset, preferred_element_type=preferred_element_type)
    return get_backend(backend).gmm(lhs, weight.dequantize(), group_sizes, group_offset=group_offset,
                                    preferred_element_type=preferred_element_type, expected_rows=expected_rows)


@fp8_weight_matmul.defjvp
def _fp8_weight_matmul_jvp(backend, group_offset, preferred_element_type, expected_rows, primals, tangents):
    """``lhs_dot @ Q(W) + lhs @ all_gather(shard_dot)`` (straight through ``Q``; the bytes and scales
    carry no derivative). Its transpose is the backward: ``d_out @ Q(W)^T`` on the grouped GEMM and
    the weight gradient ``tgmm(lhs, d_out)`` reduce-scattered to the shard. ``Q(W)`` is recomputed
    from the bytes there (``jax.checkpoint``), so reverse mode keeps the FP8 bytes between the
    passes, never a dequantised copy."""
    lhs, weight, group_sizes = primals
    lhs_dot, weight_dot, _ = tangents
    out = fp8_weight_matmul(lhs, weight, group_sizes, backend, group_offset, preferred_element_type, expected_rows)
    kernels = get_backend(backend)
    options = dict(group_offset=group_offset, preferred_element_type=out.dtype, expected_rows=expected_rows)

    @jax.checkpoint
    def through_rows(lhs_dot, weight, group_sizes):
        return primitives.gmm(lhs_dot, weight.dequantize(), group_sizes, kernels, **options)

    gathered_dot = _gathered(weight_dot.shard, weight.axis_name, weight.dim)
    through_weight = primitives.gmm(lhs, gathered_dot, group_sizes, kernels, **options)
    return out, through_rows(lhs_dot, weight, group_sizes) + through_weight


def _gathered(shard, axis_name, dim):
    return jax.lax.all_gather(shard, axis_name, axis=dim, tiled=True)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def _straight_through_dequantized(values, scales, shard, quant, axis_name, dim):
    return dequantize_blocks(jax.lax.bitcast_convert_type(values, FP8_DTYPE), scales, quant, shard.dtype)


@_straight_through_dequantized.defjvp
def _straight_through_dequantized_jvp(quant, axis_name, dim, primals, tangents):
    """The shard's tangent gathered exactly; none through the bytes or the scales. In every order,
    so the second derivatives of the layer are those of the dense layer at ``Q(W)``."""
    return _straight_through_dequantized(*primals, quant, axis_name, dim), _gathered(tangents[2], axis_name, dim)
