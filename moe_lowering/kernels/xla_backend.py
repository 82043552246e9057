"""The portable backend: grouped products as XLA tile loops (``grouped_matmul``)."""

from moe_lowering.kernels import KernelBackend
from moe_lowering.kernels.grouped_matmul import gmm, tgmm


def load() -> KernelBackend:
    return KernelBackend(name="xla", gmm=gmm, tgmm=tgmm)
