"""The kernel layer: one folder per operation, and the choice of backend (this module).

Each operation's folder holds its pure-jnp reference (the CPU path and the contract,
``reference.py``), its Triton kernels (``triton_kernels.py``: only ``triton`` imported, so
Triton's interpreter runs them on a CPU) and their launcher (``triton_launch.py``: the kernels as
XLA custom calls through ``jax_triton``):

* :mod:`.grouped_matmul`: ``gmm`` / ``tgmm``, products of rows sorted by group (and ``gmm_push``,
  whose epilogue stores each row on the GPU that owns it);
* :mod:`.fp8_grouped_matmul`: ``gmm`` with FP8 expert weights and block scales, and the
  quantisation format (``quant_format``) the FP8 FSDP gather sends;
* :mod:`.swiglu_gmm`: the fused grouped SwiGLU up-projection;
* :mod:`.swiglu_rows`: SwiGLU's elementwise part on a buffer's leading rows;
* :mod:`.peer_store`: row stores between the GPUs of a mesh axis (the ``"peer"`` exchange) and
  the receiver's row expansion;
* :mod:`.peer_address`: addressing a peer GPU's buffer from a kernel (shared by the two above).

A backend is a :class:`KernelBackend`, the set of these products the sparse MoE calls;
:func:`get_backend` chooses one: ``xla`` (the references: XLA tile loops) or ``triton`` (the GPU
kernels). Backends load on first use, so importing ``moe_lowering`` never pulls in Triton. The
kernel layer imports nothing else of ``moe_lowering`` (``tests/test_import_layers.py``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Literal, get_args

import jax

log = logging.getLogger(__name__)

Backend = Literal["auto", "xla", "triton"]
"""Which grouped-GEMM kernels the sparse MoE runs: ``"triton"``, the Triton GPU kernels (CUDA only);
``"xla"``, portable XLA tile loops (any device); ``"auto"``, Triton on a CUDA GPU where it loads, else XLA."""

BACKEND_NAMES: tuple[Backend, ...] = get_args(Backend)


@dataclass(frozen=True)
class KernelBackend:
    """The grouped products a backend provides; see :mod:`.grouped_matmul` for their contracts.

    ``gmm(lhs, rhs, group_sizes, *, group_offset, transpose_rhs, preferred_element_type, zero_outside,
    expected_rows)`` and
    ``tgmm(lhs, grad, group_sizes, *, num_groups, group_offset, preferred_element_type, expected_rows)``.
    ``swiglu_gmm(lhs, gate_rhs, up_rhs, group_sizes, *, group_offset, preferred_element_type,
    with_preactivations)`` (contract in :mod:`.swiglu_gmm`): the SwiGLU up-projection as one
    product (the XLA path: the jnp reference; the Triton kernels: the fused kernel for experts up to
    ``swiglu_gmm.triton_launch.FUSED_MAX_N`` wide, ``gmm_pair`` and the activation apart above);
    ``None`` keeps SwiGLU programs unfused. ``swiglu_gmm_max_n``: the widest experts whose SwiGLU
    programs go through ``swiglu_gmm`` (``None``: all); wider ones stay two products and XLA's
    elementwise activation, which measured faster there (Mixtral on an H200, benchmarks/NOTES.md).
    ``swiglu_rows(gate, up, num_rows)`` and ``swiglu_rows_grads(d_out, gate, up, num_rows)``
    (contract in :mod:`.swiglu_rows`): SwiGLU's elementwise part on a buffer's leading rows;
    ``None`` uses the jnp reference, which computes every row.
    ``gmm_pair(lhs, rhs_a, rhs_b, group_sizes, *, group_offset, preferred_element_type,
    zero_outside, expected_rows)``: ``gmm`` of the same rows by two weights of one shape, ``(out_a, out_b)``, set
    where doing both at once saves launches (the Triton kernels: one tail launch for SwiGLU's gate
    and up products); ``None``: two ``gmm`` calls.
    ``gmm_sum(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, *, group_offset, preferred_element_type,
    expected_rows)``: ``lhs_a @ rhs_a[g]^T + lhs_b @ rhs_b[g]^T`` written once, the rows' cotangent
    of ``gmm_pair`` (and of the fused SwiGLU product); ``None``: two transposed ``gmm`` calls added
    in float32.
    ``gather_gmm(lhs, rhs, row_index, row_scale, dot_with, group_sizes, *, group_offset, transpose_rhs,
    preferred_element_type)`` and ``gather_tgmm(lhs, grad, grad_index, grad_scale, group_sizes, *,
    num_groups, group_offset, preferred_element_type)``: ``gmm`` and ``tgmm`` of gathered, scaled
    rows, the combine's backward through the expert's last product without the scaled copy of the
    output's cotangent (contracts in :mod:`.grouped_matmul.reference`); ``None`` (both): that
    backward is ``spread``, ``gmm``, ``tgmm`` and ``combine_weights_ct`` apart.
    ``gather_swiglu_gmm(tokens, gate_rhs, up_rhs, row_index, group_sizes, *, group_offset,
    preferred_element_type)``: ``swiglu_gmm`` of the token rows in expert order,
    ``tokens[row_index]``, read from the tokens (a forward pass without the permuted copy of the
    tokens); ``None``: the rows are permuted first; ``with_preactivations=True`` also returns both products.
    ``gather_lhs_tgmm(lhs_source, grad, lhs_index, group_sizes, *, num_groups, group_offset,
    preferred_element_type)``: ``tgmm(lhs_source[lhs_index], grad)``, the weight gradient of that
    up-projection read from the tokens; ``None``: a training step keeps the permuted copy of the tokens
    for ``tgmm``.
    """

    name: str
    gmm: Callable
    tgmm: Callable
    swiglu_gmm: Callable | None = None
    swiglu_gmm_max_n: int | None = None
    swiglu_rows: Callable | None = None
    swiglu_rows_grads: Callable | None = None
    gmm_pair: Callable | None = None
    gmm_sum: Callable | None = None
    gather_gmm: Callable | None = None
    gather_tgmm: Callable | None = None
    gather_swiglu_gmm: Callable | None = None
    gather_lhs_tgmm: Callable | None = None

    def __repr__(self) -> str:  # short: a backend is a parameter of the sparse MoE's primitives, printed in jaxprs
        return f"KernelBackend({self.name!r})"


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
    """The requested kernel backend cannot run here (no GPU, Triton missing, ...).

    Raised by ``get_backend("triton")`` (and so by a rewritten layer asked for ``backend="triton"``)
    without a CUDA GPU, Triton or ``jax_triton``; ``"auto"`` falls back to ``"xla"`` instead.

    Examples:
        >>> from moe_lowering.kernels import BackendUnavailable, get_backend
        >>> try:
        ...     backend = get_backend("triton")
        ... except BackendUnavailable:
        ...     backend = get_backend("xla")
        >>> backend.name in ("triton", "xla")
        True
    """


@functools.cache
def get_backend(name: Backend) -> KernelBackend:
    """The kernel backend called ``name``, loaded on first use (importing the package loads none).

    Args:
        name: ``"auto"`` (Triton on a CUDA GPU when it loads, else XLA), ``"xla"`` or ``"triton"``.

    Returns:
        The ``KernelBackend``, one object per name (cached).

    Raises:
        ValueError: ``name`` is not one of ``BACKEND_NAMES``.
        BackendUnavailable: ``"triton"`` without a CUDA GPU, Triton or ``jax_triton``.

    Examples:
        >>> from moe_lowering.kernels import get_backend
        >>> get_backend("xla")
        KernelBackend('xla')
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        if _has_cuda_gpu():
            try:
                return get_backend("triton")
            except BackendUnavailable as err:
                log.warning("Triton kernels unavailable (%s); using the XLA grouped GEMM", err)
        return get_backend("xla")
    return _LOADERS[name]()


def _load_xla() -> KernelBackend:
    """The portable backend: the references, grouped products as XLA tile loops. It offers the
    SwiGLU up-projection as its jnp reference too: on a CPU that was measured no slower than the
    unfused products forward and faster forward+backward (``benchmarks/NOTES.md``)."""
    from moe_lowering.kernels.grouped_matmul.reference import gather_gmm, gather_lhs_tgmm, gather_tgmm, gmm, tgmm
    from moe_lowering.kernels.swiglu_gmm.reference import gather_swiglu_gmm_reference, swiglu_gmm_reference

    return KernelBackend(name="xla", gmm=gmm, tgmm=tgmm, swiglu_gmm=swiglu_gmm_reference, gather_gmm=gather_gmm,
                         gather_tgmm=gather_tgmm, gather_swiglu_gmm=gather_swiglu_gmm_reference,
                         gather_lhs_tgmm=gather_lhs_tgmm)


def _load_triton() -> KernelBackend:
    """The GPU backend: the Triton kernels called from JAX through ``jax_triton``;
    ``BackendUnavailable`` without a CUDA GPU, Triton or jax_triton."""
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        gpus = []
    if not gpus:
        raise BackendUnavailable("the Triton backend needs a CUDA GPU and JAX sees none")
    if "rocm" in str(getattr(gpus[0].client, "platform_version", "")).lower():
        raise BackendUnavailable(f"the Triton backend is built for CUDA GPUs, found ROCm ({gpus[0].device_kind})")
    return triton_kernels()


def triton_kernels() -> KernelBackend:
    """The Triton kernels' ``KernelBackend``, built without asking for a GPU: ``get_backend("triton")``
    on a CUDA GPU, and on a CPU the tests that launch the kernels through Triton's interpreter."""
    try:
        from moe_lowering.kernels.grouped_matmul import triton_launch as grouped_matmul
        from moe_lowering.kernels.grouped_matmul_sm90 import jax_launch as grouped_matmul_sm90
        from moe_lowering.kernels.swiglu_gmm import triton_launch as swiglu_gmm
        from moe_lowering.kernels.swiglu_rows import triton_launch as swiglu_rows
    except ImportError as err:
        raise BackendUnavailable(f"the Triton backend needs triton and jax_triton: {err}") from err
    # swiglu_gmm: the fused kernel only for narrow experts (swiglu_gmm_or_pair; at Mixtral-like widths
    # it measured no faster on an H200, benchmarks/NOTES.md, "Fused SwiGLU"), gmm_pair elsewhere; with
    # gmm_sum the backward adds the gate and up products' row cotangents in one pass.
    return KernelBackend(
        name="triton",
        swiglu_gmm=sequential_under_vmap(swiglu_gmm.swiglu_gmm_or_pair),
        swiglu_gmm_max_n=swiglu_gmm.FUSED_MAX_N,
        # the grouped products run the Hopper Gluon kernels where they apply, Triton's elsewhere
        gmm_sum=sequential_under_vmap(grouped_matmul_sm90.backend_gmm_sum),
        gmm=sequential_under_vmap(grouped_matmul_sm90.backend_gmm),
        tgmm=sequential_under_vmap(grouped_matmul_sm90.backend_tgmm),
        swiglu_rows=sequential_under_vmap(swiglu_rows.swiglu_rows),
        swiglu_rows_grads=sequential_under_vmap(swiglu_rows.swiglu_rows_grads),
        gmm_pair=sequential_under_vmap(grouped_matmul_sm90.backend_gmm_pair),
        gather_gmm=sequential_under_vmap(grouped_matmul.gather_gmm),
        gather_tgmm=sequential_under_vmap(grouped_matmul.gather_tgmm),
        gather_swiglu_gmm=sequential_under_vmap(swiglu_gmm.gather_swiglu_gmm),
        gather_lhs_tgmm=sequential_under_vmap(grouped_matmul.gather_lhs_tgmm),
    )


_LOADERS = {"xla": _load_xla, "triton": _load_triton}


def _has_cuda_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False
