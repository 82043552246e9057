"""The sharded sparse MoE: ``sparse_moe`` under a mesh, with expert parallelism and FSDP.

Per device (inside ``jax.shard_map`` over the whole mesh): route and sort the local token
copies, all-gather the FSDP shards of the expert weights (optionally FP8), exchange rows with
the ranks that own their experts (see :mod:`exchange`), combine locally. Nothing of size
``[all tokens, local experts, f]`` exists anywhere: each device computes only rows routed to its
experts.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

from moe_lowering.expert_program import ExpertProgram, ParamKind
from moe_lowering.parallel import _jax_shim
from moe_lowering.parallel.capacity import (
    drop_over_capacity,
    earlier_device_counts,
    expert_capacity,
    local_expert_counts,
)
from moe_lowering.parallel.exchange import (
    TRANSPORT_CHOICES,
    ExchangeConfig,
    RowSource,
    deduplicates,
    deduplication_pays,
    exchange_config,
    exchange_expert_rows,
    num_rounds,
    prepare_peer_transport,
    resolve_transport,
)
from moe_lowering.parallel.layout import Layout
from moe_lowering.parallel.quantize import WEIGHT_GATHER_QUANTS, check_quantizable, gather_weight, gather_weight_fp8
from moe_lowering.sparse_moe import combine, permute, run_expert_program, sort_by_expert

log = logging.getLogger(__name__)

# Rows per (source, destination) pair per exchange round, relative to a perfectly balanced
# split: random routing over-fills some pairs by a few percent, so 1.25 keeps it to one round.
EXCHANGE_SLACK = 1.25
# Up to this many EP ranks the ``"peer"`` transport sizes its receive buffers for the worst case
# (every row of every rank sent to one rank): one round, no overflow loop, so nothing waits on the
# host (the loop's trip count cost 0.2-0.4 ms a step on H200s, benchmarks/EP_NOTES.md). The price
# is elementwise work and memory over unused rows: the buffers are ``ep`` times the balanced share.
PEER_SINGLE_ROUND_MAX_RANKS = 4
# ... and while the rows received in that round fit in this many bytes per device (the expert
# program's intermediates scale with them; beyond it, slack-sized rounds and the loop instead).
PEER_SINGLE_ROUND_MAX_BYTES = 2 << 30
# Chunks per exchange round (see :mod:`exchange`): more chunks hide more of the transport under
# the GEMMs but re-read the local expert weights once per chunk.
EXCHANGE_CHUNKS = 1

_EXPERT_INDEXED = (ParamKind.EXPERT_WEIGHT, ParamKind.PER_EXPERT)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ShardedMoEStats:
    """What the sharded lowering did at run time (replicated scalars; a pytree, so it leaves
    ``jax.jit``): ``sharded_sparse_moe(..., return_stats=True)`` returns one.

    Attributes:
        dropped_copies: Token copies dropped by ``capacity_factor`` (0 when dropless).
        exchange_rounds: Exchange rounds of the largest exchange (1 for balanced routing; more
            when skewed routing overflows the exchange buffers).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from moe_lowering.parallel import ShardedMoEStats
        >>> stats = ShardedMoEStats(dropped_copies=jnp.int32(0), exchange_rounds=jnp.int32(1))
        >>> [int(leaf) for leaf in jax.tree.leaves(stats)]
        [0, 1]
    """

    dropped_copies: jax.Array  # token copies dropped by ``capacity_factor`` (0 when dropless)
    exchange_rounds: jax.Array  # all-to-all rounds of the largest exchange (1 for balanced routing)


def _validate(tokens, expert_indices, expert_weights, params, program, num_experts, layout, quant):
    if quant not in WEIGHT_GATHER_QUANTS:
        raise ValueError(f"weight_gather_quant must be one of {WEIGHT_GATHER_QUANTS}, got {quant!r}")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [T, D]; got shape {tokens.shape}")
    if expert_indices.ndim != 2 or expert_indices.shape[0] != tokens.shape[0]:
        raise ValueError(f"expert_indices must be [T, k] with T={tokens.shape[0]}; got {expert_indices.shape}")
    if expert_weights.shape != expert_indices.shape:
        raise ValueError(f"expert_weights {expert_weights.shape} must match expert_indices {expert_indices.shape}")
    if len(params) != len(program.param_kinds):
        raise ValueError(f"the expert program takes {len(program.param_kinds)} params, got {len(params)}")
    if num_experts != layout.num_experts:
        raise ValueError(f"num_experts={num_experts} but the layout was planned for {layout.num_experts}")
    indexed = [p for p, kind in zip(params, program.param_kinds) if kind in _EXPERT_INDEXED]
    if len(indexed) != len(layout.expert_param_specs):
        raise ValueError(
            f"the layout has specs for {len(layout.expert_param_specs)} expert-indexed params, the program "
            f"has {len(indexed)}"
        )
    for p, kind in zip(params, program.param_kinds):
        if kind in _EXPERT_INDEXED and p.shape[0] != num_experts:
            raise ValueError(f"an expert-indexed param has leading dim {p.shape[0]}, expected {num_experts}")
        if kind is ParamKind.PER_TOKEN and p.shape[0] != tokens.shape[0]:
            raise ValueError(f"a per-token param has leading dim {p.shape[0]}, expected {tokens.shape[0]}")
    position = 0
    for p, kind in zip(params, program.param_kinds):
        if kind not in _EXPERT_INDEXED:
            continue
        dim = layout.fsdp_dim(position)
        if dim is not None and p.shape[dim] % layout.fsdp_size:
            raise ValueError(f"expert-indexed param dim {dim} ({p.shape}) does not split over {layout.fsdp_size} "
                             "FSDP shards")
        position += 1


def _unquantizable(params, program: ExpertProgram, layout: Layout, quant) -> str | None:
    """Why an FSDP shard of the expert weights cannot travel as ``quant`` (``None``: every one can)."""
    position = 0
    for p, kind in zip(params, program.param_kinds):
        if kind not in _EXPERT_INDEXED:
            continue
        dim = layout.fsdp_dim(position)
        position += 1
        if kind is ParamKind.EXPERT_WEIGHT and dim is not None:
            shard = [layout.local_experts, *p.shape[1:]]
            shard[dim] //= layout.fsdp_size
            try:
                check_quantizable(tuple(shard), quant)
            except ValueError as unquantizable:
                return str(unquantizable)
    return None


def _param_specs(program: ExpertProgram, layout: Layout, token_spec: PartitionSpec):
    specs, position = [], 0
    for kind in program.param_kinds:
        if kind in _EXPERT_INDEXED:
            specs.append(layout.expert_param_specs[position])
            position += 1
        elif kind is ParamKind.PER_TOKEN:
            specs.append(token_spec)
        else:
            specs.append(PartitionSpec())
    return specs


@dataclass(frozen=True)
class ExchangePlan:
    """How the layer's expert-parallel exchange runs for a layout and a routing shape: one place
    decides it for the layer, its log line and ``explain``."""

    transport: str  # resolved, never "auto"
    local_tokens: int  # tokens per device, padding included
    rows_per_pair: int  # rows per (source, destination) pair per round
    chunks: int
    config: ExchangeConfig | None  # None without an expert-parallel axis
    deduplicated: bool  # the dispatch sends each token once per rank (exchange.deduplicates)

    @property
    def rows_per_chunk(self) -> int:
        return -(-self.rows_per_pair // self.chunks)

    def describe(self, top_k: int) -> str:
        if self.config is None:
            return f"{self.local_tokens} tokens/device, no exchange"
        one_round = self.rows_per_pair >= self.local_tokens * top_k
        return (f"{self.local_tokens} tokens/device, exchange by {self.transport} in {self.chunks} chunk(s) of "
                f"{self.rows_per_chunk} rows/pair/round"
                + (" (one round under any skew: no overflow loop)" if one_round else "")
                + ("; the dispatch sends each token once per rank it needs" if self.deduplicated else ""))


def plan_exchange(layout: Layout, program: ExpertProgram, *, num_tokens: int, top_k: int, num_experts: int,
                  row_bytes: int, exchange_transport: str, backend: str = "auto",
                  exchange_capacity: int | None = None, exchange_chunks: int | None = None,
                  weight_gather_quant: str | None = None) -> ExchangePlan:
    """The :class:`ExchangePlan` for ``num_tokens`` tokens of ``row_bytes`` bytes routed to
    ``top_k`` of ``num_experts`` experts (``exchange_transport`` already resolved; ``weight_gather_quant``
    as the layer runs it, ``None`` where the weights gather exactly)."""
    chunks = EXCHANGE_CHUNKS if exchange_chunks is None else exchange_chunks
    if not isinstance(chunks, int) or chunks <= 0:
        raise ValueError(f"exchange_chunks must be a positive integer, got {exchange_chunks!r}")
    num_slices = math.prod(layout.mesh.shape[a] for a in layout.compute_axes)
    local_tokens = -(-num_tokens // num_slices)
    ep = layout.expert_parallel_size
    local_rows = local_tokens * top_k
    if exchange_capacity:
        rows_per_pair = exchange_capacity
    elif exchange_transport == "peer" and _single_round_fits(ep, local_rows, row_bytes):
        rows_per_pair = local_rows  # a rank's every row: one round under any skew
    else:
        rows_per_pair = max(1, math.ceil(local_rows / ep * EXCHANGE_SLACK))
    config = None
    if ep > 1:
        config = exchange_config(program=program, axis_name=layout.expert_axis, ep_size=ep,
                                 local_experts=layout.local_experts, capacity=-(-rows_per_pair // chunks),
                                 chunks=chunks, backend=backend, transport=exchange_transport,
                                 lockstep_axes=() if weight_gather_quant is None else (layout.fsdp_axis,),
                                 device_ids=tuple(d.id for d in layout.devices), mesh_axes=tuple(layout.mesh.axis_names))
    deduplicated = (config is not None and deduplication_pays(top_k, layout.padded_experts, ep)
                    and deduplicates(config, local_rows))
    return ExchangePlan(exchange_transport, local_tokens, rows_per_pair, chunks, config, deduplicated)


def sharded_sparse_moe(tokens, expert_indices, expert_weights, params: Sequence, program: ExpertProgram, *,
                       num_experts: int, layout: Layout, backend: str = "auto", capacity_factor: float | None = None,
                       weight_gather_quant: str | None = None, exchange_transport: str = "auto",
                       exchange_capacity: int | None = None, exchange_chunks: int | None = None,
                       return_stats: bool = False):
    """``sparse_moe`` over ``layout.mesh``: same result (up to float reordering), callable inside ``jit``.

    Expert parallelism and FSDP for a layer whose routing the caller already has (``moe_optimize``
    emits this for a dense layer whose operands are sharded). Per device, inside ``shard_map``:
    route and sort the local token copies, all-gather the FSDP shards of the expert weights
    (optionally FP8), exchange rows with the ranks that own their experts, run the grouped GEMMs
    and combine. Nothing of size ``[all tokens, local experts, f]`` exists anywhere. Dropless by
    default, whatever the routing skew (an exchange that overflows its buffers runs more rounds).

    Args:
        tokens: ``[T, D]`` token rows (sharded or not: the output comes back sharded like them).
        expert_indices: ``[T, k]`` expert choices; an index outside ``[0, num_experts)`` drops that copy.
        expert_weights: ``[T, k]`` routing weights.
        params: The program's inputs, as for ``sparse_moe``; the expert-indexed ones ``[E, ...]``
            sharded as ``layout`` says.
        program: The per-row expert computation (an ``ExpertProgram``, as for ``sparse_moe``).
        num_experts: ``E``; ``layout`` must have been planned for it.
        layout: Which mesh axis does what: from ``plan_layout(mesh, tokens_spec, weight_specs,
            num_experts)``.
        backend: The grouped-GEMM kernels: ``"auto"``, ``"xla"`` or ``"triton"``.
        capacity_factor: ``None`` (the default) is dropless; a positive factor drops the copies
            beyond ``ceil(capacity_factor * T * k / E)`` per expert, in global token order.
        weight_gather_quant: ``None`` (exact), ``"fp8_e4m3"`` or ``"mxfp8"``: the expert weights'
            FSDP all-gather in FP8 (ignored, with a warning, when they are not FSDP-sharded).
        exchange_transport: How token rows travel: ``"auto"`` (the default: ``"peer"`` on a
            one-process GPU mesh with the Triton kernels, else ``"all_to_all"``), ``"all_to_all"``,
            ``"ppermute"``, ``"ragged"`` (``jax.lax.ragged_all_to_all``; not on XLA:CPU) or
            ``"peer"`` (Triton kernels store rows over NVLink; every EP device a GPU of this
            process). See ``benchmarks/EP_NOTES.md``.
        exchange_capacity: Rows per (source, destination) pair per round. Default: the balanced
            share times ``EXCHANGE_SLACK``; for ``"peer"`` on at most ``PEER_SINGLE_ROUND_MAX_RANKS``
            ranks, all of a rank's rows while they fit ``PEER_SINGLE_ROUND_MAX_BYTES``, so one round
            always suffices and nothing waits on the host.
        exchange_chunks: Independent slices per round, so one slice's transport can run under
            another's GEMMs (default ``EXCHANGE_CHUNKS``).
        return_stats: Also return a ``ShardedMoEStats``.

    Returns:
        ``out`` ``[T, D_out]``, sharded like ``tokens``; with ``return_stats``, ``(out, stats)``.

    Raises:
        ValueError: Shapes that do not fit ``[T, D]``/``[T, k]``/the program, a ``layout`` planned
            for another ``num_experts``, an option outside its choices, or ``"peer"`` on devices
            of another process.

    Examples:
        Two experts, one on each of two devices, under ``jax.jit`` as in a training step:

        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from moe_lowering.expert_program import ExpertMatmul, ExpertProgram, ParamKind, RowInput, topological_nodes
        >>> from moe_lowering.parallel import plan_layout, sharded_sparse_moe
        >>> linear = ExpertMatmul(RowInput(), 0)  # a row times its expert's weight (input 0)
        >>> program = ExpertProgram(linear, (ParamKind.EXPERT_WEIGHT,), topological_nodes(linear))
        >>> mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2])
        >>> layout = plan_layout(mesh, P(), [P("expert")], num_experts=2)  # E over "expert"
        >>> w = jnp.stack([jnp.eye(3), 2 * jnp.eye(3)])  # expert 0 keeps a row, expert 1 doubles it
        >>> tokens, indices = jnp.arange(12.0).reshape(4, 3), jnp.array([[0, 1], [1, 1], [0, -1], [1, 0]])
        >>> @jax.jit
        ... def layer(tokens, indices, weights, w):
        ...     return sharded_sparse_moe(tokens, indices, weights, [w], program, num_experts=2, layout=layout,
        ...                               return_stats=True)
        >>> out, stats = layer(tokens, indices, jnp.full((4, 2), 0.5), w)
        >>> out
        Array([[ 0. ,  1.5,  3. ],
               [ 6. ,  8. , 10. ],
               [ 3. ,  3.5,  4. ],
               [13.5, 15. , 16.5]], dtype=float32)
        >>> int(stats.dropped_copies), int(stats.exchange_rounds)
        (0, 1)
    """
    params = tuple(params)
    _validate(tokens, expert_indices, expert_weights, params, program, num_experts, layout, weight_gather_quant)
    if exchange_transport not in TRANSPORT_CHOICES:
        raise ValueError(f"exchange_transport must be one of {TRANSPORT_CHOICES}, got {exchange_transport!r}")
    exchange_transport = resolve_transport(exchange_transport, layout.devices, backend)
    if exchange_transport == "peer" and layout.expert_parallel_size > 1:
        prepare_peer_transport(layout.devices, backend)
    if weight_gather_quant is not None:
        reason = ("the expert weights are not FSDP-sharded" if layout.fsdp_axis is None
                  else _unquantizable(params, program, layout, weight_gather_quant))
        if reason is not None:
            warnings.warn(f"weight_gather_quant={weight_gather_quant!r} ignored (the weights gather exactly): {reason}",
                          stacklevel=2)
            weight_gather_quant = None
    mesh = layout.mesh
    axes = layout.compute_axes
    num_slices = math.prod(mesh.shape[a] for a in axes)
    num_tokens, top_k = expert_indices.shape
    pad = -num_tokens % num_slices
    capacity = None if capacity_factor is None else expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    plan = plan_exchange(layout, program, num_tokens=num_tokens, top_k=top_k, num_experts=num_experts,
                         row_bytes=tokens.shape[1] * tokens.dtype.itemsize, exchange_transport=exchange_transport,
                         backend=backend, exchange_capacity=exchange_capacity, exchange_chunks=exchange_chunks,
                         weight_gather_quant=weight_gather_quant)
    cfg, deduplicate = plan.config, plan.deduplicated
    log.info("sharded_sparse_moe: %s; %s, expert capacity %s", layout.describe(exchange_transport, backend),
             plan.describe(top_k), capacity)

    if pad:
        log.info("sharded_sparse_moe: padding %d tokens to a multiple of %d devices", pad, num_slices)
        tokens = jnp.pad(tokens, ((0, pad), (0, 0)))
        expert_indices = jnp.pad(expert_indices, ((0, pad), (0, 0)), constant_values=-1)
        expert_weights = jnp.pad(expert_weights, ((0, pad), (0, 0)))
        params = tuple(jnp.pad(p, ((0, pad),) + ((0, 0),) * (p.ndim - 1)) if kind is ParamKind.PER_TOKEN else p
                       for p, kind in zip(params, program.param_kinds))

    params = _padded_experts(params, program, layout)
    token_spec = PartitionSpec(axes)
    param_specs = _param_specs(program, layout, token_spec)
    in_specs = (token_spec, token_spec, token_spec, *param_specs)
    args = [tokens, expert_indices, expert_weights, *params]
    args = [_jax_shim.reshard(a, mesh, s) for a, s in zip(args, in_specs)]

    padded_experts = layout.padded_experts  # the phantom experts past num_experts receive no rows

    def local_moe(tokens, expert_indices, expert_weights, *params):
        expert_indices = expert_indices.astype(jnp.int32)
        if padded_experts > num_experts:  # an index past E selects no expert, phantoms included
            expert_indices = jnp.where(expert_indices < num_experts, expert_indices, -1)
        dropped = jnp.zeros((), jnp.int32)
        if capacity is not None:
            earlier = earlier_device_counts(local_expert_counts(expert_indices, padded_experts), axes)
            expert_indices, dropped = drop_over_capacity(expert_indices, padded_experts, capacity, earlier)
        routing = sort_by_expert(expert_indices, padded_experts)
        rows = permute(tokens, routing)
        params = _gather_fsdp(params, program, layout, weight_gather_quant)
        if cfg is None:
            out_rows = run_expert_program(program, params, rows, routing, backend=backend)
            rounds = jnp.zeros((), jnp.int32)
        else:
            payloads = tuple(jnp.take(p, routing.token_of_row, axis=0)
                             for p, kind in zip(params, program.param_kinds) if kind is ParamKind.PER_TOKEN)
            out_rows = exchange_expert_rows(cfg, rows, payloads, params, routing.group_sizes,
                                            routing.token_of_row if deduplicate else None,
                                            RowSource(tokens, routing.token_of_row))
            rounds = num_rounds(jax.lax.all_gather(routing.group_sizes, layout.expert_axis), cfg)
        out = combine(out_rows, expert_weights, routing)
        stats = ShardedMoEStats(dropped_copies=jax.lax.psum(dropped, axes), exchange_rounds=jax.lax.pmax(rounds, axes))
        return out, stats

    stats_spec = ShardedMoEStats(PartitionSpec(), PartitionSpec())
    mapped = _jax_shim.shard_map(local_moe, mesh=mesh, in_specs=tuple(in_specs), out_specs=(token_spec, stats_spec))
    out, stats = mapped(*args)
    if pad:
        out = _unpadded(out, num_tokens, layout)
    else:
        out = _jax_shim.reshard(out, mesh, layout.tokens_spec)
    return (out, stats) if return_stats else out


def _padded_experts(params, program: ExpertProgram, layout: Layout):
    """Expert-indexed params with zero phantom experts appended up to ``layout.padded_experts``
    (E that does not divide over the expert-parallel ranks); the pad's transpose slices their
    gradients back to E."""
    extra = layout.padded_experts - layout.num_experts
    if not extra:
        return params
    log.info("sharded_sparse_moe: padding %d experts with %d that no token routes to", layout.num_experts, extra)
    return tuple(jnp.pad(p, ((0, extra),) + ((0, 0),) * (p.ndim - 1)) if kind in _EXPERT_INDEXED else p
                 for p, kind in zip(params, program.param_kinds))


def _unpadded(out, num_tokens: int, layout: Layout):
    """The first ``num_tokens`` rows of the padded output, in the caller's token layout.

    Explicit mesh axes cannot shard a dimension their devices do not divide, so neither the slice
    of the sharded rows nor a result sharded like the caller's (unpadded) tokens exists there: the
    rows are gathered first and the result stays replicated over the token axes that do not
    divide it. Auto axes take the caller's spec as a constraint either way.
    """
    mesh = layout.mesh
    if not any(mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit for a in layout.compute_axes):
        return _jax_shim.reshard(out[:num_tokens], mesh, layout.tokens_spec)
    out = _jax_shim.reshard(out, mesh, PartitionSpec())[:num_tokens]
    token_shards = math.prod(mesh.shape[a] for a in layout.token_axes)
    if num_tokens % token_shards == 0:
        return _jax_shim.reshard(out, mesh, layout.tokens_spec)
    log.info("sharded_sparse_moe: %d tokens do not split over %d token shards; the output stays replicated",
             num_tokens, token_shards)
    return out


def _single_round_fits(ep: int, rows_per_device: int, row_bytes: int) -> bool:
    """Whether the ``"peer"`` exchange sizes one round for the worst case (see the constants)."""
    received_bytes = ep * rows_per_device * row_bytes
    return ep <= PEER_SINGLE_ROUND_MAX_RANKS and received_bytes <= PEER_SINGLE_ROUND_MAX_BYTES


def _gather_fsdp(params, program: ExpertProgram, layout: Layout, quant):
    """Expert-indexed params all-gathered over the FSDP axis; with ``quant``, expert weights travel
    and stay FP8 (:class:`~moe_lowering.parallel.quantize.GatheredFp8Weight`)."""
    if layout.fsdp_axis is None:
        return params
    gathered, position = [], 0
    for p, kind in zip(params, program.param_kinds):
        if kind in _EXPERT_INDEXED:
            dim = layout.fsdp_dim(position)
            position += 1
            if dim is not None and quant is not None and kind is ParamKind.EXPERT_WEIGHT:
                p = gather_weight_fp8(p, layout.fsdp_axis, dim, quant)
            elif dim is not None:
                p = gather_weight(p, layout.fsdp_axis, dim, None)
        gathered.append(p)
    return tuple(gathered)
