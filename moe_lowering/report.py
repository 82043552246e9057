"""What ``explain`` and ``moe-rewrite --report`` say: regions found, and near misses with reasons."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moe_lowering import _compat
from moe_lowering.passes.abstract import StackedWeights
from moe_lowering.passes.assumptions import SORTED_RANGE_MASK, device_checks


@dataclass(frozen=True)
class RegionReport:
    """One MoE layer the pass rewrites (or would rewrite), with its costs before and after.

    The costs are counted from the matched shapes: the dense reference runs every expert on every
    token, the sorted MoE only the routed token copies.

    Attributes:
        location: Where the routing decision stands in the source (``file:line:column (function)``).
        style: How the dense layer combines its experts, e.g. ``"one-hot gate"``,
            ``"gathered weights"``, ``"per-expert loop"``, ``"grouped capacity"``.
        tokens: Tokens ``T`` the layer routes.
        experts: Experts ``E``.
        top_k: Experts each token is routed to.
        d_model: Width of a token row.
        d_ff: Hidden width of an expert.
        activation: The expert body's activation, e.g. ``"swiglu"``, ``"gelu (tanh)"``, ``"identity"``.
        gated: Whether the body multiplies two up-projections (GLU style).
        capacity: Token copies each expert keeps (the layer's own, or ``capacity_factor``'s);
            ``None``: dropless.
        dtype: The layer's output dtype.
        dense_flops: FLOPs of the dense reference's expert products.
        rewritten_flops: FLOPs of the sorted MoE's grouped products.
        dense_peak_intermediate_bytes: The dense layer's largest intermediate.
        rewritten_peak_intermediate_bytes: The sorted MoE's largest intermediate.
        expert_body: The expert body's primitives in order, e.g. ``"matmul, logistic, mul, mul, matmul"``.
        scope: Where a layer inside a control-flow body (``scan``, ``while``, ``remat``) sits; empty at top level.
        parallel_layout: The expert-parallel layout and exchange the sharded lowering runs; ``None`` unsharded.
        device_checks: Assumptions checked on device at run time, with the dense layer as the fallback.
        backward: Whether the program's own derivative of the layer (``jax.vjp`` of it, as in a
            training step traced whole) was proven and rewritten with it.
        remat_inlined: Whether the ``jax.checkpoint`` bodies around it were inlined so that the backward
            recomputing the layer inside them could be rewritten (remat's memory saving dropped there).
        stacked_weight_bytes: Experts kept as separate weight arrays: the bytes the rewrite copies on
            every call to stack them into ``[E, ...]`` weights (0 where the weights are stacked already).
        routing: What the routing decision computes where that is not plain: ``lax.approx_max_k``'s
            exactness by platform (empty for ``top_k`` and ``argmax``).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from moe_lowering import explain
        >>> def top1_layer(x, router, w):  # each token to its argmax expert, one linear map per expert
        ...     gate = jax.nn.one_hot(jnp.argmax(x @ router, axis=-1), 4)  # [T, E]
        ...     return jnp.einsum("te,ted->td", gate, jnp.einsum("td,edf->tef", x, w))
        >>> shape = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)
        >>> [region] = explain(top1_layer, shape(8, 4), shape(4, 4), shape(4, 4, 6)).regions
        >>> region.style, region.top_k, region.activation, region.dense_flops // region.rewritten_flops
        ('one-hot gate', 1, 'identity', 4)
        >>> region.to_dict()["d_ff"]
        6
    """

    location: str
    style: str
    tokens: int
    experts: int
    top_k: int
    d_model: int
    d_ff: int
    activation: str
    gated: bool
    capacity: int | None
    dtype: str
    dense_flops: int
    rewritten_flops: int
    dense_peak_intermediate_bytes: int
    rewritten_peak_intermediate_bytes: int
    expert_body: str
    scope: str = ""
    parallel_layout: str | None = None
    device_checks: tuple[str, ...] = ()  # assumptions checked at run time, the dense layer as fallback
    backward: bool = False  # the layer's own derivative in the program, proven and rewritten with it
    remat_inlined: bool = False  # jax.checkpoint bodies of its scope inlined to rewrite the backward inside them
    stacked_weight_bytes: int = 0  # separate expert weight arrays, stacked by the rewrite on every call
    routing: str = ""  # approx_max_k: where it is an exact top-k, and what the rewrite assumes of it

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)

    def summary(self) -> str:
        """A few readable lines: where, shapes, body, FLOPs and peak intermediates, dense versus sorted."""
        cap = f", capacity {self.capacity}" if self.capacity else ""
        act = self.activation
        ratio = self.dense_flops / max(1, self.rewritten_flops)
        return (
            f"MoE region ({self.style}) at {self.location}{' in ' + self.scope if self.scope else ''}:\n"
            f"  tokens={self.tokens} experts={self.experts} top_k={self.top_k} d_model={self.d_model} "
            f"d_ff={self.d_ff} dtype={self.dtype}{cap}\n"
            f"  expert body: {act} [{self.expert_body}]\n"
            f"  FLOPs: dense {_si(self.dense_flops)} -> sorted {_si(self.rewritten_flops)} ({ratio:.1f}x fewer)\n"
            f"  peak intermediate: dense {_bytes(self.dense_peak_intermediate_bytes)} -> "
            f"sorted {_bytes(self.rewritten_peak_intermediate_bytes)}"
            + (f"\n  sharded: {self.parallel_layout}" if self.parallel_layout else "")
            + ("\n  rewritten forward and backward (the program's derivative of the layer is jax.vjp of it)"
               if self.backward else "")
            + ("\n  jax.checkpoint inlined in its scope: the backward reads the forward's values instead of "
               "recomputing them (the same results; remat's memory saving is dropped there, and the other ops of "
               "the remat body keep their residuals)" if self.remat_inlined else "")
            + (f"\n  checked on device, dense layer as fallback: {', '.join(self.device_checks)}"
               if self.device_checks else "")
            + (f"\n  separate expert weight arrays, stacked on every call: {_bytes(self.stacked_weight_bytes)} copied "
               "(stack them once, outside the step, to save it)" if self.stacked_weight_bytes else "")
            + (f"\n  routing: {self.routing}" if self.routing else "")
        )


@dataclass(frozen=True)
class NearMiss:
    """A routing decision that did not lead to a rewrite, and the piece that did not match.

    Attributes:
        routing: The routing decision and where it stands, e.g. ``"argmax (k=1, E=4) at file:13:28 (layer)"``.
        reason: Why it led to no rewrite: the piece of the layer that did not match, or the
            semantics the rewrite could not keep.
        location: Where that piece stands in the source.
        assumption: The replacement's assumption that could not be proven, if that was the reason.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from moe_lowering import explain
        >>> def unrouted_layer(x, router, w):  # routes, then runs every expert on every token anyway
        ...     choice = jnp.argmax(x @ router, axis=-1)
        ...     return jnp.einsum("td,edf->tf", x, w) * choice[:, None]
        >>> shape = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)
        >>> report = explain(unrouted_layer, shape(8, 4), shape(4, 4), shape(4, 4, 6))
        >>> report.regions, len(report.near_misses)
        ((), 1)
    """

    routing: str
    reason: str
    location: str
    assumption: str = ""  # the replacement's assumption that could not be proven (passes/assumptions.py)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)

    def summary(self) -> str:
        """Two or three readable lines: the routing, and why it was not rewritten."""
        unproven = f"\n  unproven assumption: {self.assumption}" if self.assumption else ""
        return f"not rewritten: routing {self.routing}\n  because {self.reason} (at {self.location}){unproven}"


@dataclass(frozen=True)
class ExplainReport:
    """What ``explain`` found in a program: the MoE layers it rewrites, and the routing it could not.

    ``explain`` returns one; ``optimize_jaxpr`` returns one beside the rewritten function, and
    ``moe-rewrite --report`` writes ``to_dict()`` as JSON. ``str(report)`` is the readable summary:
    a count line, then each region's ``summary()``, then each near miss's.

    Attributes:
        regions: One ``RegionReport`` per MoE layer the pass rewrites (or would rewrite).
        near_misses: One ``NearMiss`` per routing decision (``top_k``, ``argmax`` or ``argsort``
            over an expert axis) that led to no rewrite, with the reason.
        already_sparse: Sparse MoE operations the program already runs, with their locations:
            there is no dense layer to rewrite there.

    Examples:
        >>> from moe_lowering import ExplainReport
        >>> report = ExplainReport(regions=())
        >>> print(report)
        moe_lowering: 0 MoE region(s) found
        no routing decision (top_k or argmax over an expert axis) in the traced program
        >>> report.to_dict()
        {'regions': [], 'near_misses': [], 'already_sparse': []}
    """

    regions: tuple[RegionReport, ...]
    near_misses: tuple[NearMiss, ...] = field(default=())
    already_sparse: tuple[str, ...] = ()  # sparse MoE operations the program already runs, with locations

    def to_dict(self) -> dict[str, Any]:
        """The report as a JSON-ready dict: ``regions``, ``near_misses``, ``already_sparse``."""
        return {"regions": [r.to_dict() for r in self.regions], "near_misses": [n.to_dict() for n in self.near_misses],
                "already_sparse": list(self.already_sparse)}

    def __str__(self) -> str:
        lines = [f"moe_lowering: {len(self.regions)} MoE region(s) found"]
        lines += [r.summary() for r in self.regions]
        if not self.regions and self.already_sparse:
            lines.append(already_sparse_message(self.already_sparse))
        lines += [n.summary() for n in self.near_misses]
        if not self.regions and not self.near_misses and not self.already_sparse:
            lines.append("no routing decision (top_k or argmax over an expert axis) in the traced program")
        return "\n".join(lines)


def already_sparse_message(operations) -> str:
    shown = ", ".join(operations[:3]) + (f" and {len(operations) - 3} more" if len(operations) > 3 else "")
    return f"the program already runs a sparse MoE ({shown}): there is no dense layer to rewrite"


def region_report(region, scope: str = "", parallel_layout: str | None = None,
                  capacity_factor: float | None = None, remat_inlined: bool = False) -> RegionReport:
    """Costs from the matched shapes: the dense reference runs every expert on every token.

    ``capacity`` is the matched layer's own (Switch/GShard) or, with ``capacity_factor``, the
    per-expert limit the rewrite applies; None means dropless.
    """
    T, E, k = region.num_tokens, region.num_experts, region.top_k
    capacity = region.capacity
    if capacity is None and capacity_factor is not None:
        capacity = max(1, math.ceil(capacity_factor * T * k / E))
    dtype = np.dtype(region.output.dtype)
    # gathered weights: T*k weight copies; sorted copies: every expert on each of the T*k copies
    dense_rows = (T * k if region.style == "gathered weights" else T * k * E if region.style == SORTED_RANGE_MASK
                  else T * E)
    routed_rows = T * k if region.capacity is None else min(T * k, E * region.capacity)
    per_row_flops = 0
    widest = 0
    for matmul in region.program.matmuls():
        e, kk, n = _dims(region.params[matmul.weight])
        per_row_flops += 2 * kk * n
        widest = max(widest, n)
    gated = region.gated_activation
    return RegionReport(
        location=region.anchor.eqn.where(),
        style=region.style,
        tokens=T,
        experts=E,
        top_k=k,
        d_model=region.d_model,
        d_ff=region.d_ff,
        activation=region.activation(),
        gated=gated,
        capacity=capacity,
        dtype=str(dtype),
        dense_flops=int(dense_rows * per_row_flops) if region.capacity is None else int(E * region.capacity * per_row_flops),
        rewritten_flops=int(routed_rows * per_row_flops),
        dense_peak_intermediate_bytes=int(_gathered_weight_bytes(region, dtype)) if region.style == "gathered weights"
        else int(dense_rows * widest * dtype.itemsize) if region.capacity is None
        else int(E * region.capacity * widest * dtype.itemsize),
        rewritten_peak_intermediate_bytes=int(T * k * widest * dtype.itemsize),
        expert_body=region.program.describe(),
        scope=scope,
        parallel_layout=parallel_layout,
        device_checks=device_checks(region.style),
        stacked_weight_bytes=sum(math.prod(p.source.shape) * np.dtype(p.source.dtype).itemsize for p in region.params
                                 if isinstance(p.source, StackedWeights)),
        backward=region.derivative is not None,
        remat_inlined=remat_inlined,
        routing=routing_note(region.anchor),
    )


def routing_note(anchor) -> str:
    """``approx_max_k`` / ``approx_min_k``: exact on CPU and GPU, on a TPU exact only where its candidate bins
    keep every expert; the rewrite reads the op's own indices either way. Empty for other routing."""
    if anchor.kind != "approx_top_k":
        return ""
    params = anchor.eqn.params
    name = "approx_max_k" if params["is_max_k"] else "approx_min_k"
    recall = float(params["recall_target"])
    scores = anchor.eqn.inputs[0]
    kept = _compat.approx_top_k_candidates(anchor.num_experts, len(scores.shape), anchor.top_k, recall,
                                           params["reduction_input_size_override"])
    if kept is not None and kept >= anchor.num_experts:
        tpu = f"also exact: at E={anchor.num_experts} every expert stays a candidate"
    elif kept is not None:
        tpu = (f"approximate: it keeps {kept} of the E={anchor.num_experts} experts as candidates (the best of each "
               "bin), so a token with two of its true top k in one bin gets another expert for one of them")
    else:
        tpu = "approximate, with an expected recall of recall_target"
    return (f"{name} (recall_target={recall:g}) is an exact top-k on CPU and GPU (JAX lowers it with is_fallback: "
            f"a sort and a slice); on a TPU it is {tpu}. The rewrite reads its indices, not a top-k of its own, so "
            "it computes what the dense layer computes on every platform")


def _gathered_weight_bytes(region, dtype) -> int:
    """The largest per-token weight copy ``[T, k, K, N]`` the gathered-weights style materialises."""
    sizes = [math.prod(_dims(region.params[m.weight])[1:]) for m in region.program.matmuls()]
    return region.num_tokens * region.top_k * max(sizes) * dtype.itemsize


def _dims(param):
    shape = param.source.shape
    return tuple(shape[param.roles.index(r)] for r in ("E", "K", "N"))


def _si(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}E"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} PiB"


__all__ = ["ExplainReport", "NearMiss", "RegionReport", "region_report"]
