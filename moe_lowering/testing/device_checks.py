"""Which branch a rewritten capacity layer takes: tests use it to show that a rewrite runs sparse on
the inputs they give it, and is not exact only because the dense fallback ran."""

from __future__ import annotations

import jax
import numpy as np

from moe_lowering.passes.graph import Const
from moe_lowering.passes.rewrite import _capacity_assumptions_fail, analyse_program


def capacity_fallbacks(fn, *args) -> list[bool]:
    """For each capacity region of ``fn``'s top-level jaxpr (program order), whether its device checks
    fail on ``args``, so that the dense fallback would run."""
    closed = jax.make_jaxpr(fn)(*args)
    scope = analyse_program(closed)
    graph = scope.graph
    env = dict(zip(graph.inputs, jax.tree.leaves(args)))

    def read(atom):
        return atom.value if isinstance(atom, Const) else env[atom]

    for eqn in graph.eqns:
        outputs = eqn.primitive.bind(*[read(a) for a in eqn.inputs], **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outputs, outputs if eqn.primitive.multiple_results else [outputs]))
    return [bool(np.asarray(_capacity_assumptions_fail(r, read))) for r in scope.regions if r.combine is not None]
