"""The portable backend: grouped products as XLA tile loops (``grouped_matmul``).

It offers the SwiGLU up-projection as its jnp reference too: on a CPU that was measured no slower
than the unfused products forward and faster forward+backward (``benchmarks/NOTES.md``).
"""

from moe_lowering.kernels import KernelBackend
from moe_lowering.kernels.grouped_matmul import gmm, tgmm
from moe_lowering.kernels.swiglu_gmm import swiglu_gmm_reference


def load() -> KernelBackend:
    return KernelBackend(name="xla", gmm=gmm, tgmm=tgmm, swiglu_gmm=swiglu_gmm_reference)
