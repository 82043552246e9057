"""SwiGLU's elementwise part on the leading rows of a buffer: the jnp reference (and CPU path).

``swiglu_rows(gate[M, N], up[M, N], num_rows) -> silu(gate) * up`` on rows ``[0, num_rows)``,
computed in float32 and rounded once; rows from ``num_rows`` on are unspecified. It exists for
buffers sized for the worst case whose tail nothing reads: an expert-parallel receive buffer
holds every row any rank could send, ``ep`` times what arrives when routing is balanced, and
an XLA elementwise fusion would pay for all of it. The GPU kernels
(:mod:`.triton_launch`) read ``num_rows`` on the device and touch only those rows; this
reference computes every row, which meets the same contract.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_lowering.kernels.swiglu_gmm.reference import swiglu_grads


def swiglu_rows_reference(gate, up, num_rows):
    """``silu(gate) * up`` (rows from ``num_rows`` on unspecified: here, computed too)."""
    check_swiglu_rows_operands(gate, up, "swiglu_rows")
    del num_rows
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def swiglu_rows_grads_reference(d_out, gate, up, num_rows):
    """``(d_gate, d_up)`` of :func:`swiglu_rows_reference` (rows from ``num_rows`` on unspecified)."""
    check_swiglu_rows_operands(gate, up, "swiglu_rows_grads")
    del num_rows
    return swiglu_grads(d_out, gate, up)


def check_swiglu_rows_operands(gate, up, name: str) -> None:
    """Clear errors for operands that cannot be a SwiGLU's gate and up pre-activations."""
    if gate.ndim != 2 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"{name}: expected gate and up of one [rows, features] shape and dtype, got "
                         f"{gate.shape} {gate.dtype} and {up.shape} {up.dtype}")
