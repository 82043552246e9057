"""Rewrite one StableHLO module: import -> jaxpr -> shared matcher/rewrite -> re-lower.

The module is interpreted with ``jax.lax`` (:mod:`importer`), traced, and handed to
``moe_lowering.api.optimize_jaxpr`` -- the decorator's own entry point. The rewritten function is
lowered again with ``jax.jit``; the sparse MoE arrives as private functions plus calls because
the rewrite wraps it in named jits. Nothing found: the caller keeps the input as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
from jax._src import core as jax_core
from jax._src.interpreters import partial_eval as pe
from jaxlib.mlir import ir

from moe_lowering import _compat as jaxpr_compat

from moe_lowering.hlo import _compat
from moe_lowering.hlo.importer import ImportedProgram, UnsupportedModuleError, import_module
from moe_lowering.hlo.importer import _attribute_names as importer_attribute_names

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewriteResult:
    """``stablehlo`` is the rewritten module's text, or None when nothing was rewritten."""

    stablehlo: str | None
    report: object  # moe_lowering.report.ExplainReport
    program: ImportedProgram

    @property
    def changed(self) -> bool:
        return self.stablehlo is not None


def rewrite_module(module: ir.Module, context: ir.Context, *, backend: str = "auto") -> RewriteResult:
    """Rewrite ``module``'s MoE regions; the returned text keeps its signature attributes."""
    from moe_lowering.api import optimize_jaxpr

    with context:
        program = import_module(module)
    with _compat.enable_x64(program.needs_x64):
        closed = jax.make_jaxpr(program.fn)(*program.in_avals)
        run, report = optimize_jaxpr(closed, backend=backend)
        report = program.locations.relabel(report)  # op names and "(no location in the module)"
        if not report.regions:
            return RewriteResult(None, report, program)

        rewritten_jaxpr, consts = _dead_code_eliminated(jax.make_jaxpr(run)(*program.in_avals))

        def rewritten(*args):
            return jax_core.eval_jaxpr(rewritten_jaxpr, consts, *args)

        rewritten.__name__ = rewritten.__qualname__ = program.fn.__name__
        lowered = jax.jit(rewritten, keep_unused=True).lower(*program.in_avals)
        text = lowered.as_text()
    return RewriteResult(_carry_signature(module, text, context), report, program)


def _dead_code_eliminated(closed):
    """The rewritten jaxpr without the dense computations it no longer uses (the dense one-hot
    combine weights, broadcast constants of the replaced expert body): JAX lowers dead
    equations, and the output module should not carry them."""
    jaxpr, consts = jaxpr_compat.jaxpr_parts(closed)
    pruned, used_inputs = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    if not all(used_inputs):  # keep the signature: unused inputs stay as (unused) parameters
        pruned = pruned.replace(invars=jaxpr.invars)
    return pruned, consts


def _carry_signature(original: ir.Module, rewritten_text: str, context: ir.Context) -> str:
    """``rewritten_text`` with the original module name, module attributes and ``main`` arg/result
    attributes (shardings, donation, result names), which the re-lowering does not know."""
    with context:
        rewritten = ir.Module.parse(_with_meshes(original, rewritten_text))
        old_main = _function(original, "main")
        new_main = _function(rewritten, "main")
        for name in ("arg_attrs", "res_attrs"):
            if name in old_main.attributes:
                new_main.attributes[name] = ir.Attribute.parse(str(old_main.attributes[name]))
            elif name in new_main.attributes:
                del new_main.attributes[name]
        for name in _attribute_names(original.operation):
            if name == "sym_name" or name not in rewritten.operation.attributes:
                try:
                    value = ir.Attribute.parse(str(original.operation.attributes[name]))
                except TypeError:  # an attribute the bindings cannot hand to Python (complex elements)
                    raise UnsupportedModuleError(f"module attribute {name} cannot be carried over") from None
                rewritten.operation.attributes[name] = value
        return str(rewritten)


def _with_meshes(original: ir.Module, rewritten_text: str) -> str:
    """``rewritten_text`` with the Shardy meshes of ``original`` it lacks, which the copied attributes
    may refer to. Added as text before parsing: moving an op between modules can crash the bindings."""
    meshes = [str(op.operation) for op in original.body.operations if op.operation.name == "sdy.mesh"]
    missing = [m for m in meshes if m.split("=")[0].strip() not in rewritten_text]
    if not missing:
        return rewritten_text
    head, brace, body = rewritten_text.partition("{\n")
    if not brace:
        raise UnsupportedModuleError("cannot carry the module's Shardy meshes over: no module body found")
    return head + brace + "".join(f"  {m}\n" for m in missing) + body


def _function(module: ir.Module, name: str):
    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == name:
            return op
    raise ValueError(f"module has no @{name}")


def _attribute_names(op) -> list[str]:
    return importer_attribute_names(op)  # names only: building a NamedAttribute can abort
