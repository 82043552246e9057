"""moe_lowering: find dense-reference Mixture-of-Experts layers in JAX programs and lower them
to sorted, dropless grouped-GEMM MoE.

    from moe_lowering import moe_optimize, explain
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "moe_optimize": "moe_lowering.api",
    "explain": "moe_lowering.api",
    "optimize_jaxpr": "moe_lowering.api",
    "MoeNotFoundError": "moe_lowering.api",
    "NoMoeFoundWarning": "moe_lowering.api",
    "ExplainReport": "moe_lowering.report",
    "RegionReport": "moe_lowering.report",
    "sparse_moe": "moe_lowering.sparse_moe",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'moe_lowering' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
