"""Kernel backends for the sparse MoE: each a set of grouped matrix products with one signature.

``xla`` is the pure-jnp tile schedule in :mod:`grouped_matmul` (the CPU path and the reference);
``triton`` holds the GPU kernels. Backends are imported lazily on first use, so importing
``moe_lowering`` never pulls in Triton.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Callable

import jax

log = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "xla", "triton")


@dataclass(frozen=True)
class KernelBackend:
    """The grouped products a backend provides; see ``grouped_matmul`` for their contracts.

    ``gmm(lhs, rhs, group_sizes, *, group_offset, transpose_rhs, preferred_element_type, zero_outside,
    expected_rows)`` and
    ``tgmm(lhs, grad, group_sizes, *, num_groups, group_offset, preferred_element_type, expected_rows)``.
    ``swiglu_gmm(lhs, gate_rhs, up_rhs, group_sizes, *, group_offset, preferred_element_type,
    with_preactivations)`` (contract in ``swiglu_gmm``) is set only where the fused gate/up
    product was measured no slower than two ``gmm`` calls and an elementwise pass (the XLA
    path on a CPU; not the Triton kernel on an H200); ``None`` keeps SwiGLU programs unfused.
    ``swiglu_rows(gate, up, num_rows)`` and ``swiglu_rows_grads(d_out, gate, up, num_rows)``
    (contract in ``swiglu_rows``): SwiGLU's elementwise part on a buffer's leading rows;
    ``None`` uses the jnp reference, which computes every row.
    ``gmm_pair(lhs, rhs_a, rhs_b, group_sizes, *, group_offset, preferred_element_type,
    zero_outside, expected_rows)``: ``gmm`` of the same rows by two weights of one shape, ``(out_a, out_b)``, set
    where doing both at once saves launches (the Triton kernels: one tail launch for SwiGLU's gate
    and up products); ``None``: two ``gmm`` calls.
    """

    name: str
    gmm: Callable
    tgmm: Callable
    swiglu_gmm: Callable | None = None
    swiglu_rows: Callable | None = None
    swiglu_rows_grads: Callable | None = None
    gmm_pair: Callable | None = None

    def __repr__(self) -> str:  # short: a backend is a parameter of the sparse MoE's primitives, printed in jaxprs
        return f"KernelBackend({self.name!r})"


_BACKEND_MODULES = {
    "xla": "moe_lowering.kernels.xla_backend",
    "triton": "moe_lowering.kernels.triton_backend",
}


def sequential_under_vmap(kernel: Callable) -> Callable:
    """``kernel`` that runs once per batch element under ``jax.vmap``.

    Custom-call kernels (``jax_triton``) have no batching rule; this gives them one, so a
    rewritten layer still composes with ``vmap``. Keyword options are static.
    """

    @functools.wraps(kernel)
    def batched(*arrays, **options):
        return jax.custom_batching.sequential_vmap(functools.partial(kernel, **options))(*arrays)

    return batched


class BackendUnavailable(RuntimeError):
    """The requested kernel backend cannot run here (no GPU, Triton missing, ...)."""


@functools.cache
def get_backend(name: str) -> KernelBackend:
    """The backend called ``name``; ``"auto"`` is Triton on a CUDA GPU when it loads, else XLA."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        if _has_cuda_gpu():
            try:
                return get_backend("triton")
            except BackendUnavailable as err:
                log.warning("moe_lowering: Triton kernels unavailable (%s); using the XLA grouped GEMM", err)
        return get_backend("xla")
    try:
        module = importlib.import_module(_BACKEND_MODULES[name])
    except ImportError as err:
        raise BackendUnavailable(f"backend {name!r} could not be imported: {err}") from err
    return module.load()


def _has_cuda_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False
