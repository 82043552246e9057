"""Grouped SwiGLU up-projection: ``silu(lhs @ gate[g]) * (lhs @ up[g])`` per group, the jnp reference.

``swiglu_gmm(lhs[M, K], gate[G, K, N], up[G, K, N], group_sizes[G]) -> [M, N]`` has the contract
of :func:`~moe_lowering.kernels.grouped_matmul.gmm` (rows sorted by group, sizes on device, ``group_offset`` selects
the local groups, rows outside them are zero: ``silu(0) * 0 = 0``). Both products accumulate in
float32 and the activation is applied to the float32 accumulators, so the output is rounded
once. The fused GPU kernel (:mod:`.triton_launch`) computes the same thing without writing
the two ``[M, N]`` pre-activations to memory; this version is the CPU path and its reference.

With ``with_preactivations`` it also returns both pre-activations (rounded to the output type),
which the backward reuses instead of recomputing two grouped products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_lowering.kernels.grouped_matmul import reference as grouped_matmul


def swiglu_gmm_reference(
    lhs,
    gate_rhs,
    up_rhs,
    group_sizes,
    *,
    group_offset=0,
    preferred_element_type=None,
    with_preactivations: bool = False,
):
    """``silu(lhs[r] @ gate[g]) * (lhs[r] @ up[g])`` with ``g = group(r) - group_offset``; see the module."""
    check_swiglu_operands(lhs, gate_rhs, up_rhs, "swiglu_gmm")
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, gate_rhs.dtype, up_rhs.dtype))
    acc_dtype = jnp.promote_types(out_dtype, jnp.float32)
    gate = grouped_matmul.gmm(lhs, gate_rhs, group_sizes, group_offset=group_offset, preferred_element_type=acc_dtype)
    up = grouped_matmul.gmm(lhs, up_rhs, group_sizes, group_offset=group_offset, preferred_element_type=acc_dtype)
    out = (jax.nn.silu(gate) * up).astype(out_dtype)
    if with_preactivations:
        return out, gate.astype(out_dtype), up.astype(out_dtype)
    return out


def gather_swiglu_gmm_reference(tokens, gate_rhs, up_rhs, row_index, group_sizes, *, group_offset=0,
                                preferred_element_type=None, with_preactivations: bool = False):
    """:func:`swiglu_gmm_reference` of the rows ``tokens[row_index[r]]`` (the token rows in expert order)."""
    rows = jnp.take(tokens, row_index, axis=0, mode="clip")
    return swiglu_gmm_reference(rows, gate_rhs, up_rhs, group_sizes, group_offset=group_offset,
                                preferred_element_type=preferred_element_type, with_preactivations=with_preactivations)


def swiglu_grads(d_out, gate, up):
    """``(d_gate, d_up)`` of ``silu(gate) * up`` in float32 (float64 for float64 operands), rounded
    to the pre-activations' type."""
    acc = jnp.promote_types(jnp.float32, jnp.result_type(d_out.dtype, gate.dtype, up.dtype))
    d_out, gate32, up32 = (v.astype(acc) for v in (d_out, gate, up))
    sigmoid = jax.nn.sigmoid(gate32)
    d_up = d_out * gate32 * sigmoid
    d_gate = d_out * up32 * sigmoid * (1.0 + gate32 * (1.0 - sigmoid))
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


def check_swiglu_operands(lhs, gate_rhs, up_rhs, name: str) -> None:
    """Clear errors for operands that cannot be a grouped SwiGLU up-projection."""
    if lhs.ndim != 2 or gate_rhs.ndim != 3:
        raise ValueError(f"{name}: expected lhs [M, K] and weights [G, K, N], got {lhs.shape} and {gate_rhs.shape}")
    if gate_rhs.shape != up_rhs.shape:
        raise ValueError(f"{name}: gate and up weights differ in shape: {gate_rhs.shape} vs {up_rhs.shape}")
    if gate_rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"{name}: contraction sizes differ: lhs {lhs.shape}, weights {gate_rhs.shape}")
