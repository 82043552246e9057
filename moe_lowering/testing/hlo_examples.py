"""Input modules for the golden tests and ``tools/regen_golden.py``: zoo models lowered by JAX.

Generated from the zoo at test time rather than committed, because StableHLO and HLO text differ
between the JAX versions we support (function names, attribute spelling, op order); only the
CHECK lines over the rewritten modules are committed (``tests/golden/*.check``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_lowering.testing.zoo import ZOO


def zoo_lowered(name: str, dtype=jnp.float32, seed: int = 0):
    """``(lowered, flat_args)`` of zoo model ``name`` jitted on flat array arguments."""
    model = ZOO[name]
    params, x = model.args(jax.random.key(seed), dtype)
    flat, tree = jax.tree.flatten((params, x))

    def flat_fn(*leaves):
        return model.fn(*jax.tree.unflatten(tree, leaves))

    flat_fn.__name__ = name
    return jax.jit(flat_fn).lower(*flat), flat


def zoo_module_text(name: str, kind: str = "stablehlo", dtype=jnp.float32) -> str:
    """Zoo model ``name`` as StableHLO text or as the HLO text an XLA dump holds."""
    lowered, _ = zoo_lowered(name, dtype)
    if kind == "stablehlo":
        return lowered.as_text()
    if kind == "hlo":
        return lowered.compiler_ir("hlo").as_hlo_text()
    raise ValueError(f"unknown module kind {kind!r}; expected 'stablehlo' or 'hlo'")


def golden_sizes(name: str) -> dict[str, int]:
    """Substitutions for ``${T}`` etc. in a check file: the model's default sizes."""
    model = ZOO[name]
    sizes = model.sizes
    tokens = sizes.T
    k = model.top_k or sizes.k
    return {"T": tokens, "D": sizes.d, "F": sizes.f, "E": model.num_experts or sizes.E, "K": k, "TK": tokens * k}
