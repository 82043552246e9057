"""The GPU backend: grouped products as Triton kernels called from JAX through ``jax_triton``."""

from __future__ import annotations

import jax

from moe_lowering.kernels import BackendUnavailable, KernelBackend, sequential_under_vmap


def load() -> KernelBackend:
    """The Triton backend; ``BackendUnavailable`` without a CUDA GPU, Triton or jax_triton."""
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        gpus = []
    if not gpus:
        raise BackendUnavailable("the Triton backend needs a CUDA GPU and JAX sees none")
    if "rocm" in str(getattr(gpus[0].client, "platform_version", "")).lower():
        raise BackendUnavailable(f"the Triton backend is built for CUDA GPUs, found ROCm ({gpus[0].device_kind})")
    try:
        from moe_lowering.kernels import triton_grouped_matmul, triton_swiglu_rows
    except ImportError as err:
        raise BackendUnavailable(f"the Triton backend needs triton and jax_triton: {err}") from err
    # No swiglu_gmm: the fused kernel (triton_swiglu_gmm) measured no faster on an H200 at any
    # benchmark layer, forward or forward+backward (benchmarks/NOTES.md, "Fused SwiGLU").
    return KernelBackend(
        name="triton",
        gmm=sequential_under_vmap(triton_grouped_matmul.gmm),
        tgmm=sequential_under_vmap(triton_grouped_matmul.tgmm),
        swiglu_rows=sequential_under_vmap(triton_swiglu_rows.swiglu_rows),
        swiglu_rows_grads=sequential_under_vmap(triton_swiglu_rows.swiglu_rows_grads),
        gmm_pair=sequential_under_vmap(triton_grouped_matmul.gmm_pair),
    )
