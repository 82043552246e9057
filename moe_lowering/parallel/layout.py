"""Which mesh axis does what for one MoE layer: expert parallelism, FSDP, token sharding.

The rewrite reads the caller's ``PartitionSpec``s (tokens ``[T, D]`` and the parameters whose
leading dimension is the expert dimension E) and asks :func:`plan_layout` for a :class:`Layout`.
The layout fixes the ``shard_map`` specs of the sharded lowering:

* the **expert axis** shards E: each of its ranks holds ``E / ep`` experts and receives, through
  an all-to-all, exactly the token copies routed to them. It may be several mesh axes taken as
  one (``P(('fsdp', 'expert'))``: ranks in the order ``shard_map`` gives them); E that does not
  divide over it is padded, as GSPMD pads it, with experts no token routes to;
* the **FSDP axis** shards a feature dimension (d or f) of the expert weights; the lowering
  all-gathers them before the grouped GEMMs (optionally in FP8) and reduce-scatters their
  gradients;
* **tokens** are split over every mesh axis, the caller's token axes first: devices that the
  caller's layout would give the same tokens (replicas along an axis that does not shard them)
  each take a distinct slice instead of repeating the work, and the result is gathered back to
  the caller's token sharding afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import jax
from jax.sharding import Mesh, PartitionSpec


@dataclass(frozen=True)
class Layout:
    """The parallel layout of one MoE layer; see the module docstring. Made by ``plan_layout``.

    Attributes:
        mesh: The mesh (a ``jax.sharding.Mesh``, or the abstract mesh of explicit axes under ``jit``).
        num_experts: ``E``.
        expert_axis: The axis sharding E: one axis name or a tuple of them (their product is the
            expert-parallel axis; collectives take either); ``None``: every device holds all experts.
        fsdp_axis: The axis sharding a feature dimension of the expert weights, or ``None``.
        token_axes: The axes the caller shards the tokens over, in order.
        expert_param_specs: One normalised spec per expert-indexed parameter (``[E, ...]``: expert
            weights and per-expert biases), in program order: E on ``expert_axis`` (or replicated
            when there is none), at most one other dimension on ``fsdp_axis``.

    Examples:
        >>> import jax
        >>> from jax.sharding import PartitionSpec as P
        >>> from moe_lowering.parallel import plan_layout
        >>> mesh = jax.make_mesh((2, 2), ("data", "expert"), devices=jax.devices()[:4])
        >>> layout = plan_layout(mesh, P("data", None), [P("expert", None, None)] * 2, num_experts=4)
        >>> layout.expert_axis, layout.expert_parallel_size, layout.local_experts, layout.token_axes
        ('expert', 2, 2, ('data',))
        >>> print(layout.describe())  # doctest: +ELLIPSIS
        expert parallel over 'expert' (2 ranks x 2 experts): all-to-all of token rows, ...
    """

    mesh: object
    num_experts: int
    expert_axis: str | tuple[str, ...] | None
    fsdp_axis: str | None
    token_axes: tuple[str, ...]
    expert_param_specs: tuple[PartitionSpec, ...]

    @property
    def devices(self) -> tuple:
        """The devices the mesh runs on. An abstract mesh (Explicit axes traced inside ``jit``)
        names none; in a one-process job its devices are among this process's devices of its
        platform, which then stand in (what the ``"peer"`` transport asks: are all of them GPUs
        of this process); otherwise none are known."""
        if isinstance(self.mesh, Mesh):
            return tuple(self.mesh.devices.flat)
        if jax.process_count() != 1:
            return ()
        platform = getattr(getattr(self.mesh, "abstract_device", None), "platform", None)
        local = tuple(jax.local_devices(backend=platform))
        return local if len(local) >= self.mesh.size else ()

    @property
    def expert_parallel_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in _axes_of(self.expert_axis))

    @property
    def fsdp_size(self) -> int:
        return self.mesh.shape[self.fsdp_axis] if self.fsdp_axis else 1

    @property
    def padded_experts(self) -> int:
        """E rounded up to a multiple of the expert-parallel ranks: the experts past ``num_experts``
        are phantoms (zero weights, no token routes to them), as GSPMD pads an uneven E."""
        return -(-self.num_experts // self.expert_parallel_size) * self.expert_parallel_size

    @property
    def local_experts(self) -> int:
        return self.padded_experts // self.expert_parallel_size

    @property
    def compute_axes(self) -> tuple[str, ...]:
        """Axes splitting the token dimension inside the lowering: the caller's first, then the rest."""
        rest = tuple(a for a in self.mesh.axis_names if a not in self.token_axes)
        return self.token_axes + rest

    @property
    def tokens_spec(self) -> PartitionSpec:
        """The caller's token sharding, restored on the output."""
        if not self.token_axes:
            return PartitionSpec(None, None)
        axes = self.token_axes[0] if len(self.token_axes) == 1 else self.token_axes
        return PartitionSpec(axes, None)

    def fsdp_dim(self, param_position: int) -> int | None:
        """The dimension of expert-indexed parameter ``param_position`` sharded over FSDP, if any."""
        spec = self.expert_param_specs[param_position]
        for dim, axis in enumerate(spec):
            if dim > 0 and axis is not None:
                return dim
        return None

    def describe(self, exchange_transport: str = "all_to_all", backend: str = "auto") -> str:
        """One paragraph for ``explain``: the axes, their sizes and the collectives they imply.

        ``exchange_transport`` is the transport that runs (``exchange.resolve_transport``'s answer,
        never ``"auto"``, which depends on the devices and kernels); ``backend`` says whether
        ``"peer"`` runs its GPU kernels or its all-gather reference.
        """
        parts = []
        if self.expert_axis:
            padding = self.padded_experts - self.num_experts
            parts.append(
                f"expert parallel over {self.expert_axis!r} ({self.expert_parallel_size} ranks x "
                f"{self.local_experts} experts"
                + (f", {self.num_experts} padded with {padding} that no token routes to" if padding else "")
                + f"): {_exchange_words(exchange_transport, backend)}, all-gather of the counts matrix"
            )
        else:
            parts.append("no expert-parallel axis: every device holds all experts")
        if self.fsdp_axis:
            dims = [self.fsdp_dim(i) for i in range(len(self.expert_param_specs))]
            parts.append(
                f"FSDP over {self.fsdp_axis!r} ({self.fsdp_size} shards, expert-param dims {dims}): "
                "all-gather of weights before the grouped GEMMs, reduce-scatter of their gradients"
            )
        token_axes = ", ".join(repr(a) for a in self.token_axes) or "none"
        parts.append(
            f"tokens sharded by the caller over ({token_axes}); split inside over "
            f"{self.compute_axes} ({math.prod(self.mesh.shape[a] for a in self.compute_axes)} slices)"
        )
        return "; ".join(parts)


_EXCHANGE_WORDS = {
    "all_to_all": "all-to-all of token rows",
    "ppermute": "collective permutes of token rows",
    "ragged": "ragged all-to-all of token rows",
    "peer": "token rows stored GPU to GPU by Triton kernels (results stored home by the last GEMM)",
}


def _exchange_words(transport: str, backend: str) -> str:
    from moe_lowering.kernels.peer_store import uses_kernels

    if transport == "peer" and not uses_kernels(backend):
        return "token rows by the peer transport's all-gather reference (exact; no GPU kernels on this backend)"
    return _EXCHANGE_WORDS.get(transport, transport)


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


@dataclass(frozen=True)
class UnsupportedLayout:
    """A sharding the expert-parallel lowering does not serve (falsy, like a failed match): the
    region runs the single-device sparse layer under the caller's shardings instead, and
    ``explain`` gives ``reason``.

    Attributes:
        reason: Why the layout is not served.

    Examples:
        >>> import jax
        >>> from jax.sharding import PartitionSpec as P
        >>> from moe_lowering.parallel import plan_layout
        >>> mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
        >>> declined = plan_layout(mesh, P(None, "model"), [P()], num_experts=4)
        >>> bool(declined)
        False
        >>> print(declined.reason)  # doctest: +ELLIPSIS
        tokens are sharded along d_model (...); the sharded MoE lowering needs whole token rows
    """

    reason: str

    def __bool__(self) -> bool:
        return False

    def describe(self) -> str:
        return f"not expert parallel ({self.reason}): the single-device sparse layer runs under the caller's shardings"


def plan_layout(mesh, tokens_spec: PartitionSpec, weight_specs: Sequence[PartitionSpec | None], num_experts: int,
                weight_shapes: Sequence[tuple[int, ...]] | None = None) -> Layout | UnsupportedLayout | None:
    """The layout for tokens ``[T, D]`` sharded as ``tokens_spec`` and expert-indexed params as ``weight_specs``.

    Never raises: every layout it declines is one the program itself runs under, so the region
    keeps the single-device sparse layer there.

    Args:
        mesh: The mesh the operands are sharded over.
        tokens_spec: The tokens' ``PartitionSpec`` (``[T, D]``: only T may be sharded); ``None``: replicated.
        weight_specs: One spec per parameter whose leading dimension is E (``EXPERT_WEIGHT`` and
            ``PER_EXPERT`` inputs, in program order); ``None`` means replicated.
        num_experts: ``E``.
        weight_shapes: The shapes of those parameters, in the same order (optional): feature dims
            the FSDP axis does not divide are declined (GSPMD pads them; the gather does not).

    Returns:
        A ``Layout``; ``None`` when nothing is sharded (the single-device lowering is then the
        right one); an ``UnsupportedLayout`` saying why for a layout the lowering cannot honour.

    Examples:
        >>> import jax
        >>> from jax.sharding import PartitionSpec as P
        >>> from moe_lowering.parallel import plan_layout
        >>> mesh = jax.make_mesh((2, 2), ("fsdp", "expert"), devices=jax.devices()[:4])
        >>> layout = plan_layout(mesh, P(("fsdp", "expert")), [P("expert", "fsdp", None)], num_experts=4)
        >>> layout.expert_axis, layout.fsdp_axis, layout.token_axes
        ('expert', 'fsdp', ('fsdp', 'expert'))
        >>> plan_layout(mesh, P(), [None], num_experts=4) is None  # nothing sharded
        True
    """
    if num_experts <= 0:
        return UnsupportedLayout(f"num_experts must be positive, got {num_experts}")
    axis_names = tuple(mesh.axis_names)
    tokens_spec = PartitionSpec() if tokens_spec is None else tokens_spec
    if len(tokens_spec) > 2:
        return UnsupportedLayout(f"tokens must be 2-D [T, D]; got a spec of rank {len(tokens_spec)}: {tokens_spec}")
    if len(tokens_spec) == 2 and tokens_spec[1] is not None:
        return UnsupportedLayout(
            f"tokens are sharded along d_model ({tokens_spec}); the sharded MoE lowering needs whole token rows")
    token_axes = _axes_of(tokens_spec[0]) if len(tokens_spec) else ()
    for axis in token_axes:
        if axis not in axis_names:
            return UnsupportedLayout(f"token spec names axis {axis!r}, which the mesh {axis_names} lacks")

    specs = [PartitionSpec() if s is None else s for s in weight_specs]
    expert_entries, fsdp_axes = set(), set()
    for position, spec in enumerate(specs):
        for dim, entry in enumerate(spec):
            axes = _axes_of(entry)
            missing = [a for a in axes if a not in axis_names]
            if missing:
                return UnsupportedLayout(f"expert parameter {position} ({spec}) names axis {missing[0]!r}, "
                                         "which the mesh lacks")
            if not axes:
                continue
            if dim == 0:
                expert_entries.add(axes)
            elif len(axes) > 1:
                return UnsupportedLayout(f"dimension {dim} of expert parameter {position} ({spec}) is sharded over "
                                         f"several mesh axes {axes}; the FSDP gather supports one axis")
            else:
                fsdp_axes.add(axes[0])
    if len(expert_entries) > 1:
        return UnsupportedLayout(f"expert parameters shard E over different axes {sorted(expert_entries)}")
    if len(fsdp_axes) > 1:
        return UnsupportedLayout(f"expert parameters shard their feature dims over several axes {sorted(fsdp_axes)}")
    expert_axes = next(iter(expert_entries), ())
    expert_axis = None if not expert_axes else expert_axes[0] if len(expert_axes) == 1 else expert_axes
    fsdp_axis = next(iter(fsdp_axes), None)
    if fsdp_axis is not None and fsdp_axis in expert_axes:
        return UnsupportedLayout(f"axis {fsdp_axis!r} shards both E and a feature dimension of the expert weights")
    for position, spec in enumerate(specs):
        feature_axes = [a for a in spec[1:] if a is not None]
        if len(feature_axes) > 1:
            return UnsupportedLayout(f"expert parameter {position} ({spec}) shards two feature dims over FSDP")
    for position, (spec, shape) in enumerate(zip(specs, weight_shapes or ())):
        for dim, entry in enumerate(spec):
            shards = mesh.shape[_axes_of(entry)[0]] if dim > 0 and entry is not None else 1
            if shape[dim] % shards:
                return UnsupportedLayout(f"dimension {dim} of expert parameter {position} (size {shape[dim]}) does not "
                                         f"split over the {shards} FSDP shards of {entry!r}")

    if mesh.size == 1 or (not token_axes and expert_axis is None and fsdp_axis is None):
        return None

    normalised = tuple(PartitionSpec(expert_axis, *[_axes_of(e)[0] if e else None for e in spec[1:]])
                       for spec in specs)
    return Layout(
        mesh=mesh,
        num_experts=num_experts,
        expert_axis=expert_axis,
        fsdp_axis=fsdp_axis,
        token_axes=token_axes,
        expert_param_specs=normalised,
    )
