"""moe_lowering: find dense-reference Mixture-of-Experts layers in JAX programs and lower them
to sorted, dropless grouped-GEMM MoE.

    from moe_lowering import moe_optimize, explain

The public names load on first use, so ``import moe_lowering`` stays cheap (no JAX until one is
touched); ``dir()`` and type checkers see them all. The sparse layer the rewrite emits, for code
that has its own routing: ``moe_lowering.sparse_moe.sparse_moe`` (one device) and
``moe_lowering.parallel.sharded_sparse_moe`` (over a mesh). (``sparse_moe`` is not exported here:
the package's attribute of that name is its submodule.)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers see; at run time ``__getattr__`` imports each name from _LAZY's module
    from moe_lowering.api import MoeNotFoundError, NoMoeFoundWarning, explain, moe_optimize, optimize_jaxpr
    from moe_lowering.arguments import StateNotCarriedError
    from moe_lowering.kernels import Backend
    from moe_lowering.parallel.exchange import ExchangeTransport
    from moe_lowering.parallel.quantize import WeightGatherQuant
    from moe_lowering.report import ExplainReport, NearMiss, RegionReport

_LAZY = {
    "moe_optimize": "moe_lowering.api",
    "explain": "moe_lowering.api",
    "optimize_jaxpr": "moe_lowering.api",
    "MoeNotFoundError": "moe_lowering.api",
    "NoMoeFoundWarning": "moe_lowering.api",
    "StateNotCarriedError": "moe_lowering.arguments",
    "ExplainReport": "moe_lowering.report",
    "NearMiss": "moe_lowering.report",
    "RegionReport": "moe_lowering.report",
    "Backend": "moe_lowering.kernels",
    "ExchangeTransport": "moe_lowering.parallel.exchange",
    "WeightGatherQuant": "moe_lowering.parallel.quantize",
}

__all__ = [  # a literal list, as type checkers read it; tests/test_typing.py holds it equal to _LAZY's names
    "Backend",
    "ExchangeTransport",
    "ExplainReport",
    "MoeNotFoundError",
    "NearMiss",
    "NoMoeFoundWarning",
    "RegionReport",
    "StateNotCarriedError",
    "WeightGatherQuant",
    "explain",
    "moe_optimize",
    "optimize_jaxpr",
]


if not TYPE_CHECKING:  # hidden from type checkers, so that they flag a name the package lacks

    def __getattr__(name: str) -> object:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'moe_lowering' has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The public names, the module's own ``__`` names and the submodules imported so far."""
    submodules = {name for name, value in globals().items() if getattr(value, "__name__", "").startswith(f"{__name__}.")}
    return sorted(set(__all__) | submodules | {name for name in globals() if name.startswith("__")})
