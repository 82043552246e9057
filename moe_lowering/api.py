"""The public entry points: ``moe_optimize`` (rewrite on call) and ``explain`` (report only)."""

from __future__ import annotations

import functools
import logging
import warnings

import jax
import numpy as np

from moe_lowering import _compat
from moe_lowering.kernels import BACKEND_NAMES
from moe_lowering.passes.rewrite import ScopeResult, analyse_program, make_rewritten
from moe_lowering.report import ExplainReport, NearMiss, region_report

log = logging.getLogger("moe_lowering")


class MoeNotFoundError(ValueError):
    """``strict=True`` and the program holds no MoE region that can be rewritten."""


class NoMoeFoundWarning(UserWarning):
    """``moe_optimize`` found nothing to rewrite; the function runs unchanged."""


def optimize_jaxpr(closed_jaxpr, *, backend: str = "auto", strict: bool = False):
    """``(fn, report)``: ``fn(*flat_args)`` runs ``closed_jaxpr`` with its MoE regions rewritten.

    The shared entry point of the decorator and the ``moe-rewrite`` tool.
    """
    _check_backend(backend)
    scope = analyse_program(closed_jaxpr)
    report = build_report(scope)
    if strict and not report.regions:
        raise MoeNotFoundError(_not_found_message(report))
    return make_rewritten(scope, backend), report


def build_report(scope: ScopeResult) -> ExplainReport:
    regions = tuple(region_report(r, path) for path, r in scope.all_regions())
    misses = tuple(
        NearMiss(anchor.describe(), failure.reason, failure.eqn.where() if failure.eqn else anchor.eqn.where())
        for _, anchor, failure in scope.all_near_misses()
    )
    return ExplainReport(regions, misses)


def _not_found_message(report: ExplainReport) -> str:
    if report.near_misses:
        miss = report.near_misses[0]
        return f"moe_optimize(strict=True): no MoE region to rewrite; routing {miss.routing}: {miss.reason}"
    return "moe_optimize(strict=True): no MoE region to rewrite; the program has no routing (top_k or argmax)"


def _check_backend(backend: str) -> None:
    if backend not in BACKEND_NAMES:
        raise ValueError(f"moe_optimize: unknown backend {backend!r}; expected one of {', '.join(BACKEND_NAMES)}")


def _split_static(args, kwargs):
    """Array leaves are traced; anything else (strings, None, callables) is baked in as static."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [isinstance(l, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)) for l in leaves]
    return leaves, tree, dynamic


def _trace(fn, args, kwargs):
    leaves, tree, dynamic = _split_static(args, kwargs)
    dynamic_leaves = [l for l, d in zip(leaves, dynamic) if d]

    def flat_fn(*dynamic_values):
        it = iter(dynamic_values)
        full = [next(it) if d else l for l, d in zip(leaves, dynamic)]
        a, k = jax.tree_util.tree_unflatten(tree, full)
        return fn(*a, **k)

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dynamic_leaves)
    return closed, jax.tree_util.tree_structure(out_shape), dynamic_leaves


def explain(fn, *args, **kwargs) -> ExplainReport:
    """Traces ``fn(*args, **kwargs)`` without running it and reports the MoE regions found."""
    target = fn.__wrapped__ if _compat.is_jitted(fn) else fn
    target = getattr(target, "__moe_original__", target)
    closed, _, _ = _trace(target, args, kwargs)
    return build_report(analyse_program(closed))


def moe_optimize(fn=None, *, backend: str = "auto", strict: bool = False):
    """Rewrites the dense-reference MoE layers of ``fn`` into sorted, dropless grouped-GEMM MoE.

    Usable bare (``@moe_optimize``) or with options, on a plain or a ``jax.jit``-wrapped
    function (the result is jitted the same way: shardings, static and donated arguments kept).
    With nothing to rewrite the function runs unchanged after one ``NoMoeFoundWarning``;
    ``strict=True`` raises ``MoeNotFoundError`` naming the piece that did not match.
    """
    _check_backend(backend)
    if fn is None:
        return functools.partial(moe_optimize, backend=backend, strict=strict)
    if not callable(fn):
        raise TypeError(f"moe_optimize expects a function, got {type(fn).__name__}")
    jitted = _compat.is_jitted(fn)
    original = fn.__wrapped__ if jitted else fn
    warned = []

    @functools.wraps(original)
    def rewritten(*args, **kwargs):
        closed, out_tree, dynamic_leaves = _trace(original, args, kwargs)
        run, report = optimize_jaxpr(closed, backend=backend, strict=strict)
        if report.regions:
            log.info("moe_lowering: rewrote %d MoE region(s) in %s", len(report.regions), _name(original))
        elif not warned:
            warned.append(True)
            warnings.warn(
                f"moe_optimize: no MoE region rewritten in {_name(original)}; running it unchanged. "
                f"{_not_found_message(report).split(': ', 2)[-1]}",
                NoMoeFoundWarning,
                stacklevel=2,
            )
        outputs = run(*dynamic_leaves)
        return jax.tree_util.tree_unflatten(out_tree, outputs)

    rewritten.__moe_original__ = original
    if jitted:
        return jax.jit(rewritten, **_compat.jit_options(fn))
    return rewritten


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
