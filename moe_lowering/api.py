"""The public entry points: ``moe_optimize`` (rewrite on call) and ``explain`` (report only)."""

from __future__ import annotations

import functools
import logging
import time
import warnings
from typing import Any, Callable, ParamSpec, Sequence, TypeVar, overload

import jax
import numpy as np
from jax.sharding import NamedSharding

from moe_lowering import _compat
from moe_lowering.arguments import (CallArguments, StateNotCarriedError, StateWrites, is_bound_linen_module,
                                    linen_lifted, split_call, traced_function, unbind)
from moe_lowering.kernels import BACKEND_NAMES, Backend
from moe_lowering.parallel.exchange import ExchangeTransport
from moe_lowering.parallel.quantize import WEIGHT_GATHER_QUANTS, WeightGatherQuant
from moe_lowering.passes.rewrite import RewriteOptions, ScopeResult, analyse_program, make_rewritten, region_layout
from moe_lowering.report import ExplainReport, NearMiss, already_sparse_message, region_report

log = logging.getLogger("moe_lowering")


_P = ParamSpec("_P")
_R = TypeVar("_R")


class MoeNotFoundError(ValueError):
    """``strict=True`` and the program holds no MoE region that can be rewritten.

    Raised by a function decorated with ``moe_optimize(strict=True)`` when it is first traced for
    a call (not at decoration), and by ``optimize_jaxpr(strict=True)``. The message says why
    nothing matched: the routing decision that came closest and the piece that did not match, or
    that the program already runs a sparse MoE. A ``ValueError``, as a wrong argument is.

    Examples:
        >>> import jax.numpy as jnp
        >>> from moe_lowering import MoeNotFoundError, moe_optimize
        >>> strict_double = moe_optimize(lambda x: 2 * x, strict=True)
        >>> try:
        ...     strict_double(jnp.ones(3))
        ... except MoeNotFoundError as err:
        ...     print(str(err)[:51])
        moe_optimize(strict=True): no MoE region to rewrite
    """


class NoMoeFoundWarning(UserWarning):
    """``moe_optimize`` found nothing to rewrite; the function runs unchanged.

    Warned once per decorated function, at its first call, with the same reason
    ``MoeNotFoundError`` would give. ``strict=True`` raises instead; to silence it, filter it:
    ``warnings.filterwarnings("ignore", category=NoMoeFoundWarning)``.

    Examples:
        >>> import warnings
        >>> import jax.numpy as jnp
        >>> from moe_lowering import NoMoeFoundWarning, moe_optimize
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     doubled = moe_optimize(lambda x: 2 * x)(jnp.ones(3))
        >>> any(issubclass(w.category, NoMoeFoundWarning) for w in caught)
        True
        >>> doubled
        Array([2., 2., 2.], dtype=float32)
    """


def optimize_jaxpr(closed_jaxpr: Any, *, backend: Backend = "auto", strict: bool = False,
                   weight_gather_quant: WeightGatherQuant | None = None,
                   input_shardings: Sequence[NamedSharding | None] = (), capacity_factor: float | None = None,
                   exchange_transport: ExchangeTransport = "auto") -> tuple[Callable[..., list[Any]], ExplainReport]:
    """Rewrites the MoE regions of a traced program: the pass under ``moe_optimize`` and ``moe-rewrite``.

    For code that holds a jaxpr rather than a function to decorate (a compiler pipeline, the
    ``moe-rewrite`` tool). The program is analysed once; the function returned evaluates it with
    each matched region replaced by the sorted, dropless grouped-GEMM MoE, and everything else
    bound as it was.

    Args:
        closed_jaxpr: The program, as ``jax.make_jaxpr(fn)(*args)`` returns it.
        backend: The grouped-GEMM kernels: ``"auto"`` (Triton on a CUDA GPU where it loads, else
            XLA), ``"xla"`` or ``"triton"``. See ``moe_lowering.Backend``.
        strict: Raise ``MoeNotFoundError`` when no region can be rewritten (else ``fn`` runs the
            program unchanged and ``report`` has no regions).
        weight_gather_quant: ``None`` (exact), ``"fp8_e4m3"`` or ``"mxfp8"``: how FSDP-sharded
            expert weights travel in their all-gather. See ``moe_lowering.WeightGatherQuant``.
        input_shardings: One ``NamedSharding`` or ``None`` per flat input of ``closed_jaxpr``;
            regions whose operands are sharded over a mesh take the expert-parallel lowering.
            Empty (the default): nothing is sharded.
        capacity_factor: ``None`` (the default) is dropless; a positive factor keeps each expert's
            first ``ceil(capacity_factor * tokens * top_k / experts)`` token copies.
        exchange_transport: How expert-parallel token rows travel; see
            ``moe_lowering.ExchangeTransport``.

    Returns:
        ``(fn, report)``: ``fn(*flat_args)`` returns the list of the program's flat outputs (it
        traces: wrap it in ``jax.jit``, differentiate it); ``report`` is the
        ``ExplainReport`` of what was rewritten and what was not.

    Raises:
        ValueError: An option outside its choices, or a ``capacity_factor`` that is not positive.
        MoeNotFoundError: ``strict=True`` and no region can be rewritten.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from moe_lowering import optimize_jaxpr
        >>> def top1_layer(x, router, w):
        ...     gate = jax.nn.one_hot(jnp.argmax(x @ router, axis=-1), 4)  # [T, E]
        ...     return jnp.einsum("te,ted->td", gate, jnp.einsum("td,edf->tef", x, w))
        >>> keys = jax.random.split(jax.random.key(0), 3)
        >>> args = (jax.random.normal(keys[0], (8, 4)), jax.random.normal(keys[1], (4, 4)),
        ...         jax.random.normal(keys[2], (4, 4, 6)))
        >>> run, report = optimize_jaxpr(jax.make_jaxpr(top1_layer)(*args), backend="xla")
        >>> len(report.regions), report.regions[0].top_k
        (1, 1)
        >>> [out] = jax.jit(run)(*args)
        >>> bool(jnp.allclose(out, top1_layer(*args), atol=1e-5))
        True
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
        regions.append(region_report(region, path, described, capacity_factor, owner.remat_inlined))
    misses = tuple(
        NearMiss(anchor.describe(), failure.reason, failure.eqn.where() if failure.eqn else anchor.eqn.where(),
                 failure.assumption or "")
        for _, anchor, failure in scope.all_near_misses()
    )
    if not regions and not misses:
        misses = tuple(_routing_in_unentered_bodies(scope.graph))
    return ExplainReport(tuple(regions), misses, _already_sparse(scope))


def _routing_in_unentered_bodies(graph, depth: int = 0) -> list[NearMiss]:
    """Routing decisions inside a body the pass does not enter (a ``shard_map``, a ``cond`` branch, a
    ``custom_vjp`` function), each named, so that ``explain`` never says the program has none."""
    from moe_lowering.passes.graph import build_graph
    from moe_lowering.passes.rewrite import _scope_primitives
    from moe_lowering.passes.rules_routing import find_anchors

    found = []
    for eqn in graph.eqns:
        if eqn.primitive in _scope_primitives():
            continue
        for body in _compat.sub_jaxprs(eqn.params):
            inner = build_graph(_compat.as_closed(body))
            found += [NearMiss(anchor.describe(), f"the routing decision is inside the body of `{eqn.primitive}`, which "
                               "the pass does not enter (it follows jit, scan, while and remat bodies): apply "
                               "moe_optimize to the function inside it", anchor.eqn.where())
                      for anchor in find_anchors(inner)]
            if depth < 4:
                found += _routing_in_unentered_bodies(inner, depth + 1)
    return found


def _already_sparse(scope: ScopeResult) -> tuple[str, ...]:
    from moe_lowering.passes.match import sparse_moe_ops

    found = [f"{e.primitive} at {e.where()}" for e in sparse_moe_ops(scope.graph)]
    for eqn in scope.graph.eqns:  # scan, while, cond and remat bodies
        for inner in map(_compat.open_jaxpr, _compat.sub_jaxprs(eqn.params)):
            found += [f"{name} inside {eqn.primitive} at {eqn.where()}" for name in _sparse_names(inner)]
    return tuple(found)


def _sparse_names(jaxpr) -> list[str]:
    from moe_lowering.passes.match import SPARSE_MOE_PRIMITIVES

    names = []
    for eqn in jaxpr.eqns:
        name = str(eqn.primitive)
        if name in SPARSE_MOE_PRIMITIVES or name.startswith("moe_"):
            names.append(name)
        for inner in map(_compat.open_jaxpr, _compat.sub_jaxprs(eqn.params)):
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
    if weight_gather_quant not in WEIGHT_GATHER_QUANTS:
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


def _trace(fn, call: CallArguments):
    """``(closed jaxpr, output tree, StateWrites)`` of ``fn`` on ``call``'s arguments (see
    ``arguments.split_call``: array leaves are traced; Python numbers, strings, None and callables
    are baked in, so ``lax.top_k(x, k)`` and ``if train:`` work). The program returns ``fn``'s
    outputs, then the Flax NNX state it wrote."""
    flat_fn, writes = traced_function(fn, call, _name(fn))
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*call.dynamic_values())
    return closed, jax.tree_util.tree_structure(out_shape), writes[0]


def _finish(call: CallArguments, out_tree, writes: StateWrites, flat_outputs):
    """The function's outputs from the program's; the NNX state it wrote written into the caller's objects."""
    out, written = jax.tree_util.tree_unflatten(out_tree, flat_outputs)
    writes.write_back(call, written)
    return out


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ExplainReport:
    """Reports what ``moe_optimize`` would rewrite in ``fn(*args, **kwargs)``, without running it.

    ``fn`` is traced (nothing computes, nothing compiles), so arguments may be
    ``jax.ShapeDtypeStruct`` values; Python numbers, strings and ``None`` are static, as they are for
    the decorated function. On a function already decorated with ``moe_optimize``, its options
    (``capacity_factor``, ``exchange_transport``, ``backend``) and a ``jax.jit``'s
    ``in_shardings`` shape the report as they shape the rewrite; arrays sharded over a mesh
    report the expert-parallel layout.

    Args:
        fn: The function to look into: plain, ``jax.jit``-wrapped, decorated with
            ``moe_optimize``, or a Flax NNX module (or its bound method), whose state is traced
            as inputs.
        *args: Its positional arguments: arrays, ``jax.ShapeDtypeStruct`` values, or static values.
        **kwargs: Its keyword arguments, as ``args``.

    Returns:
        An ``ExplainReport``: ``regions``, one ``RegionReport`` per MoE layer the pass rewrites
        (where, its shapes, expert body, capacity, FLOPs and peak intermediate bytes dense versus
        sorted, the sharded layout and transport); ``near_misses``, one ``NearMiss`` per routing
        decision that led to no rewrite, with the piece that did not match; and
        ``already_sparse``, sparse MoE operations the program already runs. ``str(report)`` is a
        readable summary, ``report.to_dict()`` a JSON-ready one.

    Raises:
        Exception: Whatever tracing ``fn`` raises (a shape error in ``fn``, a wrong argument).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from moe_lowering import explain
        >>> def moe_layer(x, router, w_in, w_out):  # top-2 of 4 GELU experts, every expert on every token
        ...     weights, experts = jax.lax.top_k(jax.nn.softmax(x @ router), 2)
        ...     gate = (jax.nn.one_hot(experts, 4) * weights[..., None]).sum(1)  # [T, E]
        ...     hidden = jax.nn.gelu(jnp.einsum("td,edf->tef", x, w_in))
        ...     return jnp.einsum("te,ted->td", gate, jnp.einsum("tef,efd->ted", hidden, w_out))
        >>> f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
        >>> report = explain(moe_layer, f32(16, 8), f32(8, 4), f32(4, 8, 32), f32(4, 32, 8))
        >>> region = report.regions[0]
        >>> region.tokens, region.experts, region.top_k, region.d_model, region.d_ff, region.capacity
        (16, 4, 2, 8, 32, None)
        >>> print(report)  # doctest: +ELLIPSIS
        moe_lowering: 1 MoE region(s) found
        MoE region (one-hot gate) at ... (moe_layer):
          tokens=16 experts=4 top_k=2 d_model=8 d_ff=32 dtype=float32
          expert body: gelu (tanh) [matmul, integer_pow, mul, add, mul, tanh, add, mul, mul, matmul]
          FLOPs: dense 65.5K -> sorted 32.8K (2.0x fewer)
          peak intermediate: dense 8 KiB -> sorted 4 KiB
    """
    target = fn.__wrapped__ if _compat.is_jitted(fn) else fn
    options = getattr(target, "__moe_options__", {})
    target, bound = unbind(getattr(target, "__moe_original__", target))
    call = split_call((*bound, *args), kwargs)
    started = time.perf_counter()
    closed, _, _ = _trace(target, call)
    traced = time.perf_counter()
    declared = options.get("declared_shardings")
    if declared is None and _compat.is_jitted(fn):
        declared = _compat.jit_options(fn).get("in_shardings")
    report = build_report(analyse_program(closed), _input_shardings(call, args, declared, bound),
                          options.get("capacity_factor"), options.get("exchange_transport", "auto"),
                          options.get("backend", "auto"))
    log.info("explain(%s): traced in %s, matched in %s: %d MoE region(s)", _name(target),
             _seconds(traced - started), _seconds(time.perf_counter() - traced), len(report.regions))
    return report


@overload
def moe_optimize(fn: Callable[_P, _R], *, backend: Backend = ..., strict: bool = ...,
                 weight_gather_quant: WeightGatherQuant | None = ..., capacity_factor: float | None = ...,
                 exchange_transport: ExchangeTransport = ...) -> Callable[_P, _R]: ...


@overload
def moe_optimize(fn: None = None, *, backend: Backend = ..., strict: bool = ...,
                 weight_gather_quant: WeightGatherQuant | None = ..., capacity_factor: float | None = ...,
                 exchange_transport: ExchangeTransport = ...) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...


def moe_optimize(fn: Callable[_P, _R] | None = None, *, backend: Backend = "auto", strict: bool = False,
                 weight_gather_quant: WeightGatherQuant | None = None, capacity_factor: float | None = None,
                 exchange_transport: ExchangeTransport = "auto"
                 ) -> Callable[_P, _R] | Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Rewrites the dense-reference MoE layers of ``fn`` into sorted, dropless grouped-GEMM MoE.

    A dense-reference layer runs every expert on every token and masks the result with the
    routing: easy to read, ``experts / top_k`` times the work. On each new call signature the
    decorated function is traced, its MoE layers are matched (routing, expert computation,
    combine) and replaced by a sort of the token copies by expert, grouped GEMMs over only the
    routed rows, and a weighted combine; everything else runs as written. Outputs and gradients
    equal the reference's up to float reordering (dropless: no token is dropped). Where a
    replacement's assumption cannot be proven at trace time it is checked on device, with the
    dense layer as the fallback (``explain`` lists these checks).

    Use it bare (``@moe_optimize``) or with options (``@moe_optimize(backend="xla")``), on a plain
    or a ``jax.jit``-wrapped function (the result is jitted the same way: shardings, static and
    donated arguments kept), inside or outside ``jax.jit``, ``jax.grad``, ``jax.vmap``. With
    nothing to rewrite the function runs unchanged after one ``NoMoeFoundWarning``.

    Args:
        fn: The function holding the MoE layers (a Flax NNX module or its bound method too:
            its state is read anew at each call and its writes, such as batch statistics and RNG
            advances, are written back, as for NNX objects among the arguments); ``None``
            (options only) returns the decorator.
        backend: The grouped-GEMM kernels: ``"auto"`` (the default: the Triton kernels on a CUDA
            GPU where they load, else XLA), ``"xla"`` (portable XLA tile loops, any device) or
            ``"triton"`` (the Triton GPU kernels; raises ``BackendUnavailable`` at the first call
            without a CUDA GPU, Triton and ``jax_triton``).
        strict: Raise ``MoeNotFoundError`` (naming the piece that did not match) at the first call
            when nothing can be rewritten, instead of warning and running unchanged.
        weight_gather_quant: For expert weights sharded FSDP-style over a mesh: ``None`` (the
            default; exact) gathers them as they are; ``"fp8_e4m3"`` (a float32 scale per 128x128
            block) or ``"mxfp8"`` (a power-of-two scale per 1x32 block) quantises each device's
            shard per expert and block before the all-gather, moving half the bytes of bf16.
        capacity_factor: ``None`` (the default) is dropless and keeps the reference's results.
            A positive factor opts into dropping: each expert keeps its first
            ``ceil(capacity_factor * tokens * top_k / experts)`` token copies in token order (on
            one device and sharded alike) and the dropped copies contribute nothing.
        exchange_transport: How expert-parallel token rows travel between devices: ``"auto"``
            (the default: ``"peer"`` on a one-process GPU mesh with the Triton kernels, else
            ``"all_to_all"``), ``"all_to_all"`` (NCCL; works across processes), ``"peer"``
            (Triton kernels store rows GPU to GPU over NVLink and the last GEMM stores results
            home; every mesh device a GPU of this process; the fastest measured, see
            ``benchmarks/EP_NOTES.md``), ``"ppermute"``, or ``"ragged"``
            (``jax.lax.ragged_all_to_all``; not on XLA:CPU). ``explain`` names the one picked.

    Returns:
        The rewritten function, with ``fn``'s signature (jitted like ``fn`` when ``fn`` is a
        ``jax.jit`` function); with ``fn=None``, a decorator that makes one.

    Raises:
        ValueError: An option outside its choices, or a ``capacity_factor`` that is not positive
            (at decoration).
        TypeError: ``fn`` is not callable.
        MoeNotFoundError: ``strict=True`` and nothing to rewrite (at the first call).
        moe_lowering.kernels.BackendUnavailable: ``backend="triton"`` without a CUDA GPU, Triton
            and ``jax_triton`` (at the first call).
        moe_lowering.arguments.StateNotCarriedError: A rewritten function writes state the
            rewritten program cannot carry back (e.g. an array attribute of a plain object), at
            the first call, before anything runs.

    Examples:
        A dense-reference layer: every expert on every token, then a top-2 weighted combine.

        >>> import jax, jax.numpy as jnp
        >>> from moe_lowering import moe_optimize
        >>> def moe_layer(router, w_up, w_down, x):
        ...     weights, experts = jax.lax.top_k(jax.nn.softmax(x @ router), 2)
        ...     combine = (jax.nn.one_hot(experts, 4) * weights[..., None]).sum(1)  # [T, E]
        ...     hidden = jax.nn.relu(jnp.einsum("td,edf->tef", x, w_up))
        ...     return jnp.einsum("te,ted->td", combine, jnp.einsum("tef,efd->ted", hidden, w_down))
        >>> keys = jax.random.split(jax.random.key(0), 4)
        >>> router, x = jax.random.normal(keys[0], (4, 4)), jax.random.normal(keys[1], (8, 4))
        >>> w_up, w_down = jax.random.normal(keys[2], (4, 4, 8)), jax.random.normal(keys[3], (4, 8, 4))
        >>> sparse_layer = jax.jit(moe_optimize(moe_layer))  # or @moe_optimize on its def
        >>> out = sparse_layer(router, w_up, w_down, x)
        >>> bool(jnp.allclose(out, jax.jit(moe_layer)(router, w_up, w_down, x), atol=1e-4))
        True

        With options, as a decorator factory; gradients flow through the rewrite:

        >>> strict_layer = moe_optimize(backend="xla", strict=True)(moe_layer)
        >>> loss = lambda w_up: jnp.sum(strict_layer(router, w_up, w_down, x) ** 2)
        >>> jax.jit(jax.grad(loss))(w_up).shape
        (4, 4, 8)
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
    target, bound = unbind(original)  # an NNX module's state is an argument, read anew and written back
    declared = _compat.jit_options(fn).get("in_shardings") if jitted else None
    warned = []
    compiled_calls: dict = {}  # call signature -> (jitted rewritten program, output tree, state writes), eager calls

    def rewrite(call, args):
        log.info("tracing %s", _name(original))
        started = time.perf_counter()
        closed, out_tree, writes = _trace(target, call)
        traced = time.perf_counter()
        shardings = _input_shardings(call, args, declared, bound)
        run, report = optimize_jaxpr(closed, backend=backend, strict=strict, weight_gather_quant=weight_gather_quant,
                                     input_shardings=shardings, capacity_factor=capacity_factor,
                                     exchange_transport=exchange_transport)
        timing = f"traced in {_seconds(traced - started)}, matched in {_seconds(time.perf_counter() - traced)}"
        if report.regions:
            log.info("rewrote %d MoE region(s) in %s (%s)", len(report.regions), _name(original), timing)
        else:
            log.info("no MoE region to rewrite in %s (%s)", _name(original), timing)
        if not report.regions and not warned:
            warned.append(True)
            warnings.warn(
                f"moe_optimize: no MoE region rewritten in {_name(original)}; running it unchanged. {_why_not(report)}",
                NoMoeFoundWarning,
                stacklevel=3,
            )
        if report.regions and writes.uncarried:
            raise StateNotCarriedError(f"moe_optimize: {writes.uncarried}")
        return (run, out_tree, writes) if report.regions else None

    @functools.wraps(original)
    def rewritten(*args, **kwargs):
        if not bound and args and is_bound_linen_module(args[0]):  # a Linen method inside init/apply
            return linen_lifted(target, functools.partial(
                moe_optimize, backend=backend, strict=strict, weight_gather_quant=weight_gather_quant,
                capacity_factor=capacity_factor, exchange_transport=exchange_transport))(*args, **kwargs)
        call = split_call((*bound, *args), kwargs)
        signature = None if jitted else _call_signature(call)
        if signature is None:  # traced by an outer jit (which caches), or arguments that cannot key a cache
            program = rewrite(call, args)
        else:
            if signature not in compiled_calls:
                program = rewrite(call, args)
                if program is not None:
                    run, out_tree, writes = program
                    program = (_jit_logged(run, call, original), out_tree, writes)
                compiled_calls[signature] = program
                log.debug("%s traced for a new call signature (%d cached)", _name(original),
                          len(compiled_calls))
            program = compiled_calls[signature]
        if program is None:  # nothing rewritten: the user's function itself runs, as called, bit for bit
            return original(*args, **kwargs)
        run, out_tree, writes = program
        return _finish(call, out_tree, writes, run(*call.dynamic_values()))

    rewritten.__moe_original__ = original
    rewritten.__moe_options__ = {"backend": backend, "capacity_factor": capacity_factor, "declared_shardings": declared,
                                 "exchange_transport": exchange_transport}
    if jitted:
        return jax.jit(rewritten, **_compat.jit_options(fn))
    return rewritten


def _jit_logged(run, call: CallArguments, original):
    """``jax.jit(run)``; with INFO logging on, lowered and compiled here, so that the log says how long the
    rewritten program took to trace and lower and XLA to compile it (the first call then reuses both)."""
    jitted = jax.jit(run)
    if log.isEnabledFor(logging.INFO):
        started = time.perf_counter()
        lowered = jitted.lower(*call.dynamic_values())
        lowered_at = time.perf_counter()
        lowered.compile()
        log.info("%s: rewritten program lowered in %s, compiled in %s", _name(original),
                 _seconds(lowered_at - started), _seconds(time.perf_counter() - lowered_at))
    return jitted


def _call_signature(call: CallArguments):
    """What an eager call's rewrite depends on: the argument tree (and its NNX objects' graph),
    each traced leaf's type and sharding, each static leaf's value (a Python number's too:
    ``f(p, x, 2)`` and ``f(p, x, 3)`` are two programs). ``None`` under an outer trace, for
    ``ShapeDtypeStruct`` arguments, or for unhashable statics."""
    key = [call.structure()]
    for leaf, is_dynamic in zip(call.leaves, call.dynamic):
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


def _input_shardings(call: CallArguments, args, declared, bound: tuple = ()) -> tuple:
    """Per traced leaf: the ``NamedSharding`` a committed array carries or ``jit`` declared for it.

    ``declared`` is ``jit``'s ``in_shardings``, per positional argument of ``args`` (``bound``
    arguments come first and declare nothing): one sharding for a whole argument, or a tree of them
    shaped like it. NNX objects in an argument (an ``nnx.State`` holds ``Param`` variables) take their
    leaves' shardings from the same objects in the declared tree."""
    is_node = _compat.nnx_is_graph_node
    is_declared_leaf = lambda s: isinstance(s, NamedSharding) or s is None or is_node(s)  # noqa: E731
    tree_declared: list = []
    node_declared: list = []  # per NNX object of the call, in order: (object, its declared counterpart)
    per_arg = ((declared if isinstance(declared, (tuple, list)) else (declared,) * len(args))
               if declared is not None else (None,) * len(args))
    for arg, sharding in [*((b, None) for b in bound), *zip(args, per_arg)]:
        arg_leaves = jax.tree_util.tree_leaves(arg, is_leaf=is_node)
        leaf_shardings = jax.tree_util.tree_leaves(sharding, is_leaf=is_declared_leaf)
        if not isinstance(sharding, NamedSharding) and len(leaf_shardings) == len(arg_leaves):
            pairs = zip(arg_leaves, leaf_shardings)
        else:  # one sharding for the argument (or a tree that does not fit it: unknown)
            pairs = ((leaf, sharding if isinstance(sharding, NamedSharding) else None) for leaf in arg_leaves)
        for leaf, leaf_sharding in pairs:
            tree_declared.append(None if is_node(leaf) else leaf_sharding)
            if is_node(leaf):
                node_declared.append((leaf, leaf_sharding))
    if len(tree_declared) != call.num_tree_leaves:  # keyword arguments: nothing declared for them
        tree_declared = [*tree_declared, *[None] * call.num_tree_leaves][: call.num_tree_leaves]
    out = []
    for leaf, is_dynamic, sharding in zip(call.leaves, call.dynamic, tree_declared + _state_shardings(call, node_declared)):
        if not is_dynamic:
            continue
        concrete = getattr(leaf, "sharding", None) if not isinstance(leaf, jax.core.Tracer) else None
        chosen = sharding if isinstance(sharding, NamedSharding) else concrete
        out.append(chosen if isinstance(chosen, NamedSharding) else None)
    return tuple(out)


def _state_shardings(call: CallArguments, node_declared: list) -> list:
    """The declared sharding of each state leaf of the call's NNX objects, ``None`` where unknown:
    each object's counterpart split as the object is (one sharding is broadcast over its leaves).
    Objects that share variables are split together by the call: then nothing is known."""
    unknown = [None] * call.num_state_leaves
    if not call.nodes or len(node_declared) != len(call.nodes):
        return unknown
    nnx = _compat.flax_nnx()
    is_sharding = lambda s: isinstance(s, NamedSharding) or s is None  # noqa: E731
    shardings: list = []
    for node, counterpart in node_declared:
        count = len(jax.tree_util.tree_leaves(nnx.split(node)[1]))
        if is_sharding(counterpart):
            shardings.extend([counterpart] * count)
            continue
        try:
            split = jax.tree_util.tree_leaves(nnx.split(counterpart)[1], is_leaf=is_sharding)
        except Exception:  # noqa: BLE001  (a declared tree nnx cannot split: unknown, not an error)
            split = []
        shardings.extend(split if len(split) == count else [None] * count)
    return shardings if len(shardings) == call.num_state_leaves else unknown


def _seconds(duration: float) -> str:
    return f"{duration:.3g} s"


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
