"""The public entry points: ``moe_optimize`` (rewrite on call) and ``explain`` (report only)."""

from __future__ import annotations

import functools
import logging
import time
import warnings

import jax
import numpy as np

from moe_lowering import _compat
from moe_lowering.kernels import BACKEND_NAMES
from moe_lowering.passes.rewrite import RewriteOptions, ScopeResult, analyse_program, make_rewritten, region_layout
from moe_lowering.report import ExplainReport, NearMiss, already_sparse_message, region_report

log = logging.getLogger("moe_lowering")


class MoeNotFoundError(ValueError):
    """``strict=True`` and the program holds no MoE region that can be rewritten."""


class NoMoeFoundWarning(UserWarning):
    """``moe_optimize`` found nothing to rewrite; the function runs unchanged."""


WEIGHT_GATHER_QUANT = (None, "fp8_e4m3", "mxfp8")


def optimize_jaxpr(closed_jaxpr, *, backend: str = "auto", strict: bool = False, weight_gather_quant=None,
                   input_shardings=(), capacity_factor: float | None = None, exchange_transport: str = "auto"):
    """``(fn, report)``: ``fn(*flat_args)`` runs ``closed_jaxpr`` with its MoE regions rewritten.

    The shared entry point of the decorator and the ``moe-rewrite`` tool. ``input_shardings``
    (one ``NamedSharding`` or ``None`` per flat input) lets regions whose operands are sharded
    over a mesh take the expert-parallel lowering.
    """
    _check_backend(backend)
    _check_quant(weight_gather_quant)
    _check_capacity(capacity_factor)
    _check_transport(exchange_transport)
    scope = analyse_program(closed_jaxpr)
    report = build_report(scope, input_shardings, capacity_factor, exchange_transport, backend)
    if strict and not report.regions:
        raise MoeNotFoundError(_not_found_message(report))
    options = RewriteOptions(backend, weight_gather_quant, tuple(input_shardings), capacity_factor, exchange_transport)
    return make_rewritten(scope, options), report


def build_report(scope: ScopeResult, input_shardings=(), capacity_factor=None, exchange_transport: str = "auto",
                 backend: str = "auto") -> ExplainReport:
    """The regions and near misses of ``scope``; each sharded region names the transport it would
    run (``"auto"`` resolved on its mesh, as the rewrite resolves it)."""
    from moe_lowering.parallel.exchange import resolve_transport
    from moe_lowering.parallel.sharded_moe import plan_exchange

    regions = []
    for path, region in scope.all_regions():
        owner = _scope_at(scope, path)
        layout = region_layout(owner, region, input_shardings)
        described = None if layout is None else layout.describe()  # an UnsupportedLayout says why
        if layout:
            transport = resolve_transport(exchange_transport, layout.devices, backend)
            plan = plan_exchange(layout, region.program, num_tokens=region.num_tokens, top_k=region.top_k,
                                 num_experts=region.num_experts,
                                 row_bytes=region.d_model * np.dtype(region.tokens.dtype).itemsize,
                                 exchange_transport=transport, backend=backend)
            described = f"{layout.describe(transport, backend)}; {plan.describe(region.top_k)}"
        regions.append(region_report(region, path, described, capacity_factor))
    misses = tuple(
        NearMiss(anchor.describe(), failure.reason, failure.eqn.where() if failure.eqn else anchor.eqn.where(),
                 failure.assumption or "")
        for _, anchor, failure in scope.all_near_misses()
    )
    return ExplainReport(tuple(regions), misses, _already_sparse(scope))


def _already_sparse(scope: ScopeResult) -> tuple[str, ...]:
    from moe_lowering.passes.match import sparse_moe_ops

    found = [f"{e.primitive} at {e.where()}" for e in sparse_moe_ops(scope.graph)]
    for eqn in scope.graph.eqns:  # scan, while and remat bodies
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found += [f"{name} inside {eqn.primitive} at {eqn.where()}" for name in _sparse_names(inner)]
    return tuple(found)


def _sparse_names(jaxpr) -> list[str]:
    from moe_lowering.passes.match import SPARSE_MOE_PRIMITIVES

    names = []
    for eqn in jaxpr.eqns:
        name = str(eqn.primitive)
        if name in SPARSE_MOE_PRIMITIVES or name.startswith("moe_"):
            names.append(name)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                names += _sparse_names(inner)
    return names


def _scope_at(scope: ScopeResult, path: str) -> ScopeResult:
    if scope.path == path:
        return scope
    for child in scope.nested.values():
        if path.startswith(child.path):
            return _scope_at(child, path)
    return scope


def _why_not(report: ExplainReport) -> str:
    if report.already_sparse:
        return already_sparse_message(report.already_sparse)
    if report.near_misses:
        miss = report.near_misses[0]
        return f"routing {miss.routing}: {miss.reason}"
    return ("no routing decision (top_k, argmax or argsort over an expert axis) whose indices reach an expert "
            "computation: there is none, or its indices only pre-select for another or are unused")


def _not_found_message(report: ExplainReport) -> str:
    return f"moe_optimize(strict=True): no MoE region to rewrite; {_why_not(report)}"


def _check_backend(backend: str) -> None:
    if backend not in BACKEND_NAMES:
        raise ValueError(f"moe_optimize: unknown backend {backend!r}; expected one of {', '.join(BACKEND_NAMES)}")


def _check_quant(weight_gather_quant) -> None:
    if weight_gather_quant not in WEIGHT_GATHER_QUANT:
        raise ValueError(
            f"moe_optimize: unknown weight_gather_quant {weight_gather_quant!r}; expected None, 'fp8_e4m3' or 'mxfp8'"
        )


def _check_transport(exchange_transport) -> None:
    from moe_lowering.parallel.exchange import TRANSPORT_CHOICES

    if exchange_transport not in TRANSPORT_CHOICES:
        raise ValueError(f"moe_optimize: unknown exchange_transport {exchange_transport!r}; expected one of "
                         f"{', '.join(map(repr, TRANSPORT_CHOICES))}")


def _check_capacity(capacity_factor) -> None:
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"moe_optimize: capacity_factor must be positive or None (dropless), got {capacity_factor!r}")


def _split_static(args, kwargs):
    """Array leaves (and ``jax.ShapeDtypeStruct``, an array known by its type) are traced; anything
    else is baked in as static: Python ``int``/``float``/``bool``/``complex`` numbers (concrete in
    the undecorated function, so ``lax.top_k(x, k)`` and ``if train:`` work), strings, None,
    callables. NumPy scalars count as arrays, as under ``jax.jit``."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [isinstance(l, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)) for l in leaves]
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
    options = getattr(target, "__moe_options__", {})
    target = getattr(target, "__moe_original__", target)
    started = time.perf_counter()
    closed, _, _ = _trace(target, args, kwargs)
    traced = time.perf_counter()
    declared = options.get("declared_shardings")
    if declared is None and _compat.is_jitted(fn):
        declared = _compat.jit_options(fn).get("in_shardings")
    report = build_report(analyse_program(closed), _input_shardings(args, kwargs, declared),
                          options.get("capacity_factor"), options.get("exchange_transport", "auto"),
                          options.get("backend", "auto"))
    log.info("moe_lowering: explain(%s): traced in %s, matched in %s: %d MoE region(s)", _name(target),
             _seconds(traced - started), _seconds(time.perf_counter() - traced), len(report.regions))
    return report


def moe_optimize(fn=None, *, backend: str = "auto", strict: bool = False, weight_gather_quant: str | None = None,
                 capacity_factor: float | None = None, exchange_transport: str = "auto"):
    """Rewrites the dense-reference MoE layers of ``fn`` into sorted, dropless grouped-GEMM MoE.

    Usable bare (``@moe_optimize``) or with options, on a plain or a ``jax.jit``-wrapped
    function (the result is jitted the same way: shardings, static and donated arguments kept).
    With nothing to rewrite the function runs unchanged after one ``NoMoeFoundWarning``;
    ``strict=True`` raises ``MoeNotFoundError`` naming the piece that did not match.

    Operands sharded over a mesh (explicit axes) get the expert-parallel lowering; with
    ``weight_gather_quant="fp8_e4m3"`` or ``"mxfp8"`` the FSDP-sharded expert weights are
    quantised per expert and block before their all-gather (``None`` keeps results exact).
    ``capacity_factor`` opts into dropping: each expert keeps its first
    ``ceil(capacity_factor * tokens * k / E)`` token copies in token order (on one device and
    sharded alike); ``None``, the default, is dropless and keeps the reference's results.
    ``exchange_transport`` says how expert-parallel token rows travel: ``"auto"`` (the default)
    picks ``"peer"`` on a one-process GPU mesh with the Triton kernels and ``"all_to_all"``
    otherwise; ``"all_to_all"`` (NCCL; works across processes), ``"peer"`` (Triton kernels store
    rows GPU to GPU over NVLink and the last GEMM stores results home; every mesh device must be
    a GPU of this process; the fastest measured, see ``benchmarks/EP_NOTES.md``), ``"ppermute"``
    or ``"ragged"`` (``jax.lax.ragged_all_to_all``). ``explain`` names the transport picked.
    """
    _check_backend(backend)
    _check_quant(weight_gather_quant)
    _check_capacity(capacity_factor)
    _check_transport(exchange_transport)
    if fn is None:
        return functools.partial(moe_optimize, backend=backend, strict=strict, weight_gather_quant=weight_gather_quant,
                                 capacity_factor=capacity_factor, exchange_transport=exchange_transport)
    if not callable(fn):
        raise TypeError(f"moe_optimize expects a function, got {type(fn).__name__}")
    jitted = _compat.is_jitted(fn)
    original = fn.__wrapped__ if jitted else fn
    declared = _compat.jit_options(fn).get("in_shardings") if jitted else None
    warned = []
    compiled_calls: dict = {}  # call signature -> (jitted rewritten program, output tree), for eager calls

    def rewrite(args, kwargs):
        log.info("moe_lowering: tracing %s", _name(original))
        started = time.perf_counter()
        closed, out_tree, dynamic_leaves = _trace(original, args, kwargs)
        traced = time.perf_counter()
        shardings = _input_shardings(args, kwargs, declared)
        run, report = optimize_jaxpr(closed, backend=backend, strict=strict, weight_gather_quant=weight_gather_quant,
                                     input_shardings=shardings, capacity_factor=capacity_factor,
                                     exchange_transport=exchange_transport)
        timing = f"traced in {_seconds(traced - started)}, matched in {_seconds(time.perf_counter() - traced)}"
        if report.regions:
            log.info("moe_lowering: rewrote %d MoE region(s) in %s (%s)", len(report.regions), _name(original), timing)
        else:
            log.info("moe_lowering: no MoE region to rewrite in %s (%s)", _name(original), timing)
        if not report.regions and not warned:
            warned.append(True)
            warnings.warn(
                f"moe_optimize: no MoE region rewritten in {_name(original)}; running it unchanged. {_why_not(report)}",
                NoMoeFoundWarning,
                stacklevel=3,
            )
        return run, out_tree, dynamic_leaves, bool(report.regions)

    @functools.wraps(original)
    def rewritten(*args, **kwargs):
        leaves, tree, dynamic = _split_static(args, kwargs)
        signature = None if jitted else _call_signature(leaves, tree, dynamic)
        if signature is None:  # traced by an outer jit (which caches), or arguments that cannot key a cache
            run, out_tree, dynamic_leaves, _ = rewrite(args, kwargs)
            return jax.tree_util.tree_unflatten(out_tree, run(*dynamic_leaves))
        if signature not in compiled_calls:
            run, out_tree, _, rewritten_any = rewrite(args, kwargs)
            # Nothing rewritten: the user's function itself runs, eagerly as called, bit for bit.
            compiled_calls[signature] = None
            if rewritten_any:
                compiled_calls[signature] = (_jit_logged(run, leaves, dynamic, original), out_tree)
            log.debug("moe_lowering: %s traced for a new call signature (%d cached)", _name(original),
                      len(compiled_calls))
        if compiled_calls[signature] is None:
            return original(*args, **kwargs)
        run, out_tree = compiled_calls[signature]
        return jax.tree_util.tree_unflatten(out_tree, run(*(l for l, d in zip(leaves, dynamic) if d)))

    rewritten.__moe_original__ = original
    rewritten.__moe_options__ = {"backend": backend, "capacity_factor": capacity_factor, "declared_shardings": declared,
                                 "exchange_transport": exchange_transport}
    if jitted:
        return jax.jit(rewritten, **_compat.jit_options(fn))
    return rewritten


def _jit_logged(run, leaves, dynamic, original):
    """``jax.jit(run)``; with INFO logging on, lowered and compiled here, so that the log says how long the
    rewritten program took to trace and lower and XLA to compile it (the first call then reuses both)."""
    jitted = jax.jit(run)
    if log.isEnabledFor(logging.INFO):
        started = time.perf_counter()
        lowered = jitted.lower(*(l for l, d in zip(leaves, dynamic) if d))
        lowered_at = time.perf_counter()
        lowered.compile()
        log.info("moe_lowering: %s: rewritten program lowered in %s, compiled in %s", _name(original),
                 _seconds(lowered_at - started), _seconds(time.perf_counter() - lowered_at))
    return jitted


def _call_signature(leaves, tree, dynamic):
    """What an eager call's rewrite depends on (``_split_static``'s split of its arguments): the
    argument tree, each traced leaf's type and sharding, each static leaf's value (a Python
    number's too: ``f(p, x, 2)`` and ``f(p, x, 3)`` are two programs). ``None`` under an outer
    trace, for ``ShapeDtypeStruct`` arguments, or for unhashable statics."""
    key = [tree]
    for leaf, is_dynamic in zip(leaves, dynamic):
        if isinstance(leaf, (jax.core.Tracer, jax.ShapeDtypeStruct)):
            return None
        if is_dynamic:
            key.append((jax.typeof(leaf), getattr(leaf, "sharding", None)))
        else:
            key.append(_static_key(leaf))
    try:
        hash(tuple(key))
    except TypeError:
        return None
    return tuple(key)


def _static_key(value):
    """A static leaf's cache key: its type and value; floats by their bits (``nan`` equals itself,
    ``-0.0`` differs from ``0.0``), so a key means one traced program."""
    if isinstance(value, float):
        return type(value), value.hex()
    if isinstance(value, complex):
        return type(value), value.real.hex(), value.imag.hex()
    return type(value), value


def _input_shardings(args, kwargs, declared) -> tuple:
    """Per traced leaf: the ``NamedSharding`` a committed array carries or ``jit`` declared for it."""
    from jax.sharding import NamedSharding

    leaves, _, dynamic = _split_static(args, kwargs)
    declared_leaves = [None] * len(leaves)
    if declared is not None:
        per_arg = declared if isinstance(declared, (tuple, list)) else (declared,) * len(args)
        expanded = []
        for arg, sharding in zip(args, per_arg):
            count = len(jax.tree_util.tree_leaves(arg))
            expanded.extend(jax.tree_util.tree_leaves(sharding, is_leaf=lambda s: isinstance(s, NamedSharding))
                            if not isinstance(sharding, NamedSharding) and sharding is not None
                            and len(jax.tree_util.tree_leaves(sharding)) == count else [sharding] * count)
        declared_leaves[: len(expanded)] = expanded
    out = []
    for leaf, is_dynamic, sharding in zip(leaves, dynamic, declared_leaves):
        if not is_dynamic:
            continue
        concrete = getattr(leaf, "sharding", None) if not isinstance(leaf, jax.core.Tracer) else None
        chosen = sharding if isinstance(sharding, NamedSharding) else concrete
        out.append(chosen if isinstance(chosen, NamedSharding) else None)
    return tuple(out)


def _seconds(duration: float) -> str:
    return f"{duration:.3g} s"


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
