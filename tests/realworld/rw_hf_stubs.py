"""Stand-ins for the six Hugging Face modeling modules that EasyDeL 0.3.0 patches at import.

EasyDeL's model registry imports ``transformers.models.<name>.modeling_<name>`` for dbrx, llama4,
qwen3_next, qwen3_5_moe, phimoe and glm4v_moe and patches attributes on them. Without torch,
transformers hands out placeholder objects for those modules whose attribute access raises
``ImportError`` ("requires PyTorch"), which aborts ``import easydel.modules...``. EasyDeL reads
every attribute with ``getattr(module, name, None)`` and skips the patch on ``None``, so an empty
module is enough. Installed only when torch is absent (torch is huge; these tests do not need it).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

PATCHED_BY_EASYDEL = ("dbrx", "llama4", "qwen3_next", "qwen3_5_moe", "phimoe", "glm4v_moe")


def install() -> list[str]:
    """Puts an empty module in place of each patched HF modeling module; returns their names."""
    if importlib.util.find_spec("torch") is not None:
        return []
    installed = []
    for model in PATCHED_BY_EASYDEL:
        name = f"transformers.models.{model}.modeling_{model}"
        package = importlib.import_module(f"transformers.models.{model}")  # a lazy module: needs no torch
        if isinstance(sys.modules.get(name), types.ModuleType) and getattr(sys.modules[name], "__rw_stub__", False):
            continue
        stub = types.ModuleType(name, f"stand-in for {name} (torch is not installed)")
        stub.__rw_stub__ = True
        sys.modules[name] = stub
        # `from transformers.models.X import modeling_X` reads the package attribute first; the lazy
        # package would otherwise answer with its torch-requiring placeholder.
        setattr(package, f"modeling_{model}", stub)
        installed.append(name)
    return installed
