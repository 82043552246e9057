"""Expert-parallel dispatch, local grouped GEMMs and combine, in rounds of static capacity.

Runs per device inside ``shard_map``. Every device holds its token copies sorted by (global)
expert, so the copies bound for expert-parallel rank ``d`` are one contiguous run. The counts
matrix ``[ep, E]`` (all-gathered group sizes) tells every device, without further
communication, how many rows each pair of ranks exchanges and in which expert order.

One *chunk* moves at most ``capacity`` rows from every rank to every rank:

1. dispatch: ``ep`` blocks of ``capacity`` rows (one per peer, gathered from the sorted rows)
   go out; the receiver gets ``ep`` blocks, one per source;
2. the receiver sorts the rows it got by local expert (a counting sort from the counts matrix,
   no ``argsort``), runs the expert program with grouped GEMMs over its ``E / ep`` experts, and
   un-sorts them into blocks again;
3. combine: the reverse transport brings each block home, where every sorted row *gathers* its
   result from the returned blocks (no scatter).

A *round* is ``chunks`` such chunks, each dispatched, computed and returned on its own, so that
XLA's scheduler can run one chunk's transport under another chunk's GEMMs (measured on H200s:
it overlaps some, but the split GEMMs cost more than that hides, so one chunk is the default).
Round 0 is straight-line code, so XLA schedules it like the rest of the layer; further rounds
run in a ``while_loop`` that takes zero trips unless some pair exceeds ``chunks * capacity`` rows. The exchange is dropless under any skew, and per-device
buffers stay ``ep * capacity`` rows per chunk.

Transports for the blocks (``ExchangeConfig.transport``): ``"all_to_all"`` (one collective per
direction), ``"ppermute"`` (``ep - 1`` collective permutes, shift ``s`` sending block ``s`` to
rank ``me + s``; the own block never leaves the device) and ``"ragged"``
(``jax.lax.ragged_all_to_all``: no padding bytes, but slow on GPU and unimplemented on XLA:CPU),
and ``"peer"`` (``kernels/peer_store/``: NVLink stores from Triton kernels between the GPUs of
one host, of one process or one process each (the peer heap); an all-gather reference elsewhere). With ``"peer"`` the
sender stores every row over NVLink straight to its final place: its sorted position on the
receiver for the dispatch, its home row for the return; so nothing is padded on the wire, and the
receiver's counting-sort gathers and the gather home disappear. On one host, XLA can run the first two on the GPUs' copy engines instead of NCCL
(``--xla_gpu_use_memcpy_local_p2p``, see ``benchmarks/EP_NOTES.md``).

The backward is the transposed exchange written out. Round 0 keeps the expert
program's residuals from the forward (as single-device autodiff would), so its backward sends
only the output cotangents and runs no forward GEMM again; the rare further rounds dispatch rows
and cotangents together and recompute their program under ``jax.vjp`` (nothing of size
``rounds x capacity`` is kept). Weight gradients of further rounds and chunks are added in
float32 and rounded to the weights' dtype once per addition.

Both autodiff modes: the exchange is a ``custom_jvp`` whose tangent is one linear primitive
(``exchange_tangent_p``) of the forward's residuals and the input tangents. Reverse mode
transposes it into the written-out backward above; forward mode (``jax.jvp``, ``jacfwd``)
evaluates it as JAX's own JVP of the forward on the collective transports (a ``custom_vjp``
could only do the first: JAX cannot run its backward forwards).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from moe_lowering import _compat
from moe_lowering.expert_program import (
    Elementwise,
    ExpertMatmul,
    ExpertProgram,
    ParamKind,
    ParamRef,
    RowContext,
    evaluate,
    topological_nodes,
)
from moe_lowering.kernels import get_backend
from moe_lowering.kernels.peer_store import heap as peer_heap
from moe_lowering.kernels.peer_store import (
    PeerBuffer,
    allocate_buffer,
    expand_rows,
    gather_addresses,
    grouped_matmul_store,
    peer_store,
    uses_kernels,
)
from moe_lowering.sparse_moe import expert_matmul, expert_matmul_pair, grouped_matmul_cotangents, swiglu_rows

ExchangeTransport = Literal["auto", "all_to_all", "ppermute", "ragged", "peer"]
"""How expert-parallel token rows travel between devices: ``"all_to_all"`` (NCCL/XLA collectives;
works across processes), ``"ppermute"`` (collective permutes), ``"ragged"``
(``jax.lax.ragged_all_to_all``; not on XLA:CPU), ``"peer"`` (Triton kernels store rows GPU to GPU;
every mesh device a GPU of this host: all of this process, or one per process), or ``"auto"`` (``"peer"`` where it can run, else
``"all_to_all"``; see ``resolve_transport``)."""

TRANSPORT_CHOICES: tuple[ExchangeTransport, ...] = get_args(ExchangeTransport)  # resolve_transport names the one used
AUTO_TRANSPORT = "auto"
TRANSPORTS = tuple(t for t in TRANSPORT_CHOICES if t != AUTO_TRANSPORT)  # what runs


@dataclass(frozen=True)
class ExchangeConfig:
    """Static description of one expert-parallel exchange (hashable: a ``custom_vjp`` nondiff arg).

    A round moves at most ``chunks * capacity`` rows per (source, destination) pair, as
    ``chunks`` independent slices of ``capacity`` rows: each slice is dispatched, computed and
    returned on its own, so XLA can run one slice's transport while another's GEMMs run.
    """

    program: ExpertProgram
    axis_name: str
    ep_size: int
    local_experts: int
    capacity: int  # rows per (source, destination) pair per chunk
    chunks: int = 1  # chunks per round
    backend: str = "auto"
    transport: str = "all_to_all"
    # Other mesh axes with collectives inside the rounds (the FP8-gathered weights' gradients
    # reduce-scatter over the FSDP axis in every round's backward, their tangents all-gather in
    # forward mode): the rounds loop runs the largest trip count over them, else a rank with more
    # rounds than its FSDP peer waits for it in the collective forever.
    lockstep_axes: tuple[str, ...] = ()
    # The mesh's device ids in its flat order and its axis names, where the mesh is known: the
    # peer heap's regions then name their device by the rank's run-time position
    # (``peer_heap.placement``), so every process of a job traces the same program.
    device_ids: tuple[int, ...] = ()
    mesh_axes: tuple[str, ...] = ()

    @property
    def round_rows(self) -> int:
        """Rows per (source, destination) pair per round."""
        return self.chunks * self.capacity


@dataclass(frozen=True)
class _ChunkPlan:
    """Index arithmetic of one chunk, identical on sender and receiver sides.

    Blocks: the ``ep`` groups of ``capacity`` slots a rank sends (block ``b`` to rank
    ``dest_of_block(b)``) and receives (block ``b`` from rank ``source_of_block(b)``); the
    returned results come home in the order of the sent blocks.
    """

    send_index: jax.Array  # [ep, C] my sorted row in slot i of sent block b (num_rows if unused)
    send_sizes: jax.Array  # [ep] rows I send to rank d in this chunk
    send_offsets: jax.Array  # [ep] first of those rows in my sorted rows
    recv_sizes: jax.Array  # [ep] rows rank s sends me in this chunk
    position_of_slot: jax.Array  # [ep * C] received (block, slot) -> position in the expert-sorted buffer
    slot_of_position: jax.Array  # [ep * C] its inverse
    local_group_sizes: jax.Array  # [E / ep]
    local_expert_of_row: jax.Array  # [ep * C], clipped into range
    peer_routes: "_PeerRoutes | None" = None  # the ``"peer"`` transport's destinations


@dataclass(frozen=True)
class _PeerRoutes:
    """Where the ``"peer"`` transport stores each row (device ``-1``: nothing to store)."""

    dispatch_device: jax.Array  # [ep * C] sent slot (block-major) -> receiving rank
    dispatch_row: jax.Array  # [ep * C] -> its position in the receiver's expert-sorted rows
    return_device: jax.Array  # [ep * C] my expert-sorted position -> the rank the row came from
    return_row: jax.Array  # [ep * C] -> the row's index among that rank's sorted rows


@dataclass(frozen=True)
class _TokenRoutes:
    """The deduplicated dispatch (DeepEP's): a token bound for several experts of one rank goes
    there once. The first of my sorted rows of each (token, rank) pair represents it and is
    stored into that rank's token buffer; every row's token slot is stored at its sorted
    position, and the receiver expands tokens into its sorted rows (``expand_rows``)."""

    token_device: jax.Array  # [N] my sorted row -> the rank it carries its token to (-1: not a representative)
    token_slot: jax.Array  # [N] -> the token's slot in that rank's token buffer
    slot_of_row: jax.Array  # [N] every row's token slot on the rank of its expert
    tokens_arriving: jax.Array  # [] tokens stored into my buffer


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RowSource:
    """Where ``rows`` came from: ``rows == tokens[token_of_row]``. The ``"peer"`` transport's
    first round then stores token rows straight from ``tokens``, so the caller's ``[N, D]`` gather
    into sorted rows is never read and XLA drops it (22 us of an EP=4 Mixtral step on an H200).
    The cotangent still flows through ``rows``: none is returned for ``tokens`` here."""

    tokens: jax.Array  # [T, D]
    token_of_row: jax.Array  # [N] int

    def token_index(self, row_index):
        """The token row behind each sorted row index (indices past the rows: clamped, never stored)."""
        return jnp.take(self.token_of_row, row_index, mode="clip")


# The deduplicated dispatch saves stored rows but adds the receiver's expansion and a second
# count per pair; on 4 x H200 it paid at 2.2 expected rows per (token, rank) pair (DeepSeek-like,
# k=8 of 256, EP=4: -0.10 ms a forward) and lost at 1.08 and 1.27 (Mixtral-like, k=2 of 8, EP=4
# and EP=2: +0.06 and +0.04 ms); see benchmarks/EP_NOTES.md, round 7.
DEDUP_MIN_ROWS_PER_TOKEN_RANK = 1.5


def rows_per_token_rank(top_k: int, num_experts: int, ep_size: int) -> float:
    """Expected rows a token has on a rank that holds any of its experts, for ``top_k`` distinct
    experts drawn uniformly: ``top_k`` over the expected number of ranks hit."""
    local = num_experts // ep_size
    draws = math.comb(num_experts, top_k)  # 0 for top_k > num_experts (repeated experts): every rank is hit
    missed = math.comb(num_experts - local, top_k) / draws if draws else 0.0
    return top_k / (ep_size * (1.0 - missed))


def deduplication_pays(top_k: int, num_experts: int, ep_size: int) -> bool:
    """Whether to offer the dispatch ``token_of_row`` (see :func:`deduplicates`): where uniform
    routing would put enough rows of one token on one rank for the fewer stores to pay."""
    return rows_per_token_rank(top_k, num_experts, ep_size) >= DEDUP_MIN_ROWS_PER_TOKEN_RANK


def deduplicates(cfg: ExchangeConfig, num_rows: int) -> bool:
    """Whether the forward dispatch sends tokens once per rank instead of rows once per expert:
    on ``"peer"``, in one round of one chunk, where a rank holds several experts (with one, no
    token has two rows on a rank)."""
    return (cfg.transport == "peer" and cfg.chunks == 1 and single_round(cfg, num_rows)
            and cfg.local_experts > 1)


def _bucket(ends, values):
    """For each value, how many of the sorted ``ends`` are <= it (``searchsorted(side="right")``).

    ``ends`` here are per rank or per local expert, a few to a few hundred: comparing against all
    of them is one fused kernel, where the default binary search is a loop of ``log2(len(ends))``
    steps, each a few tiny kernels on a GPU (~2 us apiece in an EP=4 step's routing).
    """
    return jnp.searchsorted(ends, values, side="right", method="compare_all")


def _representatives(token_of_row, group_sizes, cfg: ExchangeConfig):
    """``(destination [N], representative row [N], is representative [N], representatives per rank [ep])``
    of my sorted rows; dropped rows (past the counted ones) have destination ``ep`` and represent nothing."""
    ep, num_rows = cfg.ep_size, token_of_row.shape[0]
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    my_totals = group_sizes.reshape(ep, cfg.local_experts).sum(axis=1)
    dest = _bucket(jnp.cumsum(my_totals), rows).astype(jnp.int32)
    key = jnp.where(dest < ep, token_of_row.astype(jnp.int32) * ep + dest, num_rows * ep)
    first = jnp.full((num_rows * ep + 1,), num_rows, jnp.int32).at[key].min(rows)
    representative = first[key]
    is_representative = (representative == rows) & (dest < ep)
    per_rank = jnp.zeros((ep + 1,), jnp.int32).at[dest].add(is_representative.astype(jnp.int32))[:ep]
    return dest, representative, is_representative, per_rank


def _token_routes(representatives, unique_counts, cfg: ExchangeConfig) -> _TokenRoutes:
    """Slots from the all-gathered ``unique_counts [source, destination]``: a rank's token buffer
    holds source 0's tokens first, then source 1's, each in the source's row order."""
    ep = cfg.ep_size
    me = jax.lax.axis_index(cfg.axis_name)
    dest, representative, is_representative, per_rank = representatives
    dest_clipped = jnp.minimum(dest, ep - 1)
    flags = is_representative.astype(jnp.int32)
    rank_in_run = (jnp.cumsum(flags) - flags) - (jnp.cumsum(per_rank) - per_rank)[dest_clipped]
    earlier_sources = (jnp.cumsum(unique_counts, axis=0) - unique_counts)[me]  # [destination]
    token_slot = earlier_sources[dest_clipped] + rank_in_run
    routes = _materialized(jnp.where(is_representative, dest, -1).astype(jnp.int32), token_slot.astype(jnp.int32),
                           token_slot[representative].astype(jnp.int32), unique_counts[:, me].sum())
    return _TokenRoutes(*routes)


def _blocks_by_shift(cfg: ExchangeConfig) -> bool:
    return cfg.transport == "ppermute"


def _run_layout(counts, cfg: ExchangeConfig):
    """``(me, by_rank [source, destination, local expert], my run starts [ep], my run totals [ep])``."""
    me = jax.lax.axis_index(cfg.axis_name)
    by_rank = counts.reshape(cfg.ep_size, cfg.ep_size, cfg.local_experts)
    my_totals = by_rank.sum(axis=2)[me]
    return me, by_rank, jnp.cumsum(my_totals) - my_totals, my_totals


def _chunk_plan(counts, chunk_index, num_rows: int, cfg: ExchangeConfig) -> _ChunkPlan:
    """Chunk ``chunk_index`` (counted over all rounds) moves slots ``[chunk_index * C, + C)`` of every run."""
    ep, local, capacity = cfg.ep_size, cfg.local_experts, cfg.capacity
    me, by_rank, run_starts, my_totals = _run_layout(counts, cfg)
    ranks = jnp.arange(ep, dtype=jnp.int32)
    if _blocks_by_shift(cfg):  # block b goes to me + b and comes from me - b
        dest_of_block, source_of_block = (me + ranks) % ep, (me - ranks) % ep
    else:
        dest_of_block = source_of_block = ranks
    window = chunk_index * capacity
    slot = jnp.arange(capacity, dtype=jnp.int32)

    # Sender side: my run for rank d starts at run_starts[d]; this chunk sends [window, window + C) of it.
    send_offsets = run_starts + window
    send_sizes = jnp.clip(my_totals - window, 0, capacity)
    send_index = jnp.where(slot[None, :] < send_sizes[:, None], send_offsets[:, None] + slot[None, :], num_rows)
    send_index = send_index[dest_of_block]

    # Receiver side: this chunk's slice [window, window + C) of each source's expert-ordered run.
    position, valid, local_group_sizes, recv_sizes = _received_slots(by_rank, me, window, cfg)
    position, valid = position[source_of_block], valid[source_of_block]  # source-major -> block order
    num_valid = local_group_sizes.sum()
    padding_rank = jnp.cumsum(~valid.reshape(-1)) - 1
    position_of_slot = jnp.where(valid.reshape(-1), position.reshape(-1), num_valid + padding_rank).astype(jnp.int32)
    slot_of_position = jnp.zeros_like(position_of_slot).at[position_of_slot].set(
        jnp.arange(ep * capacity, dtype=jnp.int32), unique_indices=True)
    positions = jnp.arange(ep * capacity, dtype=jnp.int32)
    local_expert_of_row = jnp.minimum(
        _bucket(jnp.cumsum(local_group_sizes), positions), local - 1
    ).astype(jnp.int32)
    send_offsets = jnp.where(send_sizes > 0, send_offsets, 0)
    indices = _materialized(send_index, send_sizes, send_offsets, recv_sizes, position_of_slot, slot_of_position,
                            local_group_sizes.astype(jnp.int32), local_expert_of_row)
    if cfg.transport != "peer":
        return _ChunkPlan(*indices)

    # Peer stores: my slot (d, i) lands at its position in rank d's sorted rows; my sorted position
    # p, which holds slot (s, i) of source s, goes back to row ``run start + window + i`` of rank s.
    positions_everywhere = jax.vmap(lambda receiver: _received_slots(by_rank, receiver, window, cfg)[0])(ranks)
    dispatch_row = positions_everywhere[:, me, :]  # [destination, C]
    dispatch_device = jnp.where(send_index < num_rows, ranks[:, None], -1)
    source, slot_in_block = slot_of_position // capacity, slot_of_position % capacity
    totals = by_rank.sum(axis=2)  # [source, destination]
    run_starts_of = jnp.cumsum(totals, axis=1) - totals
    positions = jnp.arange(ep * capacity, dtype=jnp.int32)
    return_device = jnp.where(positions < local_group_sizes.sum(), source, -1)
    return_row = run_starts_of[source, me] + window + slot_in_block
    routes = _PeerRoutes(*_materialized(dispatch_device.reshape(-1).astype(jnp.int32),
                                        dispatch_row.reshape(-1).astype(jnp.int32),
                                        return_device.astype(jnp.int32), return_row.astype(jnp.int32)))
    return _ChunkPlan(*indices, peer_routes=routes)


def _received_slots(by_rank, receiver, window, cfg: ExchangeConfig):
    """Rank ``receiver``'s view of a chunk: ``(position [source, C], valid [source, C], group sizes, sizes)``.

    Slot ``i`` of source ``s``'s block holds row ``window + i`` of ``s``'s expert-ordered run for
    ``receiver``; ``position`` is where it goes among the received rows sorted by local expert
    (then by source); ``sizes [source]`` counts the rows each source sends in this chunk.
    """
    ep, local, capacity = cfg.ep_size, cfg.local_experts, cfg.capacity
    slot = jnp.arange(capacity, dtype=jnp.int32)
    ranks = jnp.arange(ep, dtype=jnp.int32)
    to_receiver = by_rank[:, receiver, :]  # [source, local expert]
    recv_sizes = jnp.clip(to_receiver.sum(axis=1) - window, 0, capacity)
    run_ends = jnp.cumsum(to_receiver, axis=1)
    chunk_ends = jnp.clip(run_ends - window, 0, capacity)  # [source, local expert]
    chunk_sizes = chunk_ends - jnp.concatenate([jnp.zeros((ep, 1), chunk_ends.dtype), chunk_ends[:, :-1]], axis=1)
    local_group_sizes = chunk_sizes.sum(axis=0)
    group_starts = jnp.cumsum(local_group_sizes) - local_group_sizes
    earlier_sources = jnp.cumsum(chunk_sizes, axis=0) - chunk_sizes  # same expert, sources before s

    expert_of_slot = jax.vmap(lambda ends: _bucket(ends, slot))(chunk_ends)  # [ep, C]
    valid = expert_of_slot < local
    expert_clipped = jnp.minimum(expert_of_slot, local - 1)
    start_in_chunk = jnp.take_along_axis(chunk_ends - chunk_sizes, expert_clipped, axis=1)
    position = group_starts[expert_clipped] + earlier_sources[ranks[:, None], expert_clipped] + slot - start_in_chunk
    return position, valid, local_group_sizes, recv_sizes


def _materialized(*indices):
    """The index vectors, computed once into buffers before the row gathers that read them.

    Left alone, XLA:GPU fuses an index vector's arithmetic (cumsums, searches, small gathers)
    into the ``[rows, d]`` gather that consumes it and recomputes it for every element of the
    row: measured 0.25 ms instead of ~0.02 ms for one ``[5120, 4096]`` gather on an H200.
    """
    return jax.lax.optimization_barrier(indices)


def _home_index(counts, round_index, num_rows: int, cfg: ExchangeConfig):
    """``[N]``: where my sorted row finds its result among the round's returned chunks.

    The round's chunks come home as one ``[chunks * ep * C]`` buffer (chunk-major, then block,
    then slot); rows of other rounds point past its end and read zeros.
    """
    ep, capacity = cfg.ep_size, cfg.capacity
    me, _, run_starts, my_totals = _run_layout(counts, cfg)
    row_ids = jnp.arange(num_rows, dtype=jnp.int32)
    dest_of_row = _bucket(jnp.cumsum(my_totals), row_ids).astype(jnp.int32)
    dest_clipped = jnp.minimum(dest_of_row, ep - 1)
    offset = row_ids - run_starts[dest_clipped] - round_index * cfg.round_rows  # within this round's window
    in_round = (dest_of_row < ep) & (offset >= 0) & (offset < cfg.round_rows)
    offset = jnp.clip(offset, 0, cfg.round_rows - 1)
    block = (dest_clipped - me) % ep if _blocks_by_shift(cfg) else dest_clipped
    index = (offset // capacity * ep + block) * capacity + offset % capacity
    (index,) = _materialized(jnp.where(in_round, index, cfg.chunks * ep * capacity).astype(jnp.int32))
    return index


def _shifted(blocks, shift_sign: int, cfg: ExchangeConfig):
    """``ppermute`` transport: block ``b`` travels to rank ``me + shift_sign * b``; block 0 stays."""
    ep = cfg.ep_size
    moved = [blocks[0]] + [
        jax.lax.ppermute(blocks[b], cfg.axis_name, [(i, (i + shift_sign * b) % ep) for i in range(ep)])
        for b in range(1, ep)
    ]
    return jnp.stack(moved)


def _dispatch(x, plan: _ChunkPlan, cfg: ExchangeConfig):
    """My sorted rows of this chunk -> ``[ep * C, ...]`` rows received, in (block, slot) order."""
    ep, capacity = cfg.ep_size, cfg.capacity
    if cfg.transport == "ragged":
        me = jax.lax.axis_index(cfg.axis_name)
        out = jnp.zeros((ep * capacity,) + x.shape[1:], x.dtype)
        output_offsets = jnp.full((ep,), me * capacity, jnp.int32)
        return jax.lax.ragged_all_to_all(x, out, plan.send_offsets.astype(jnp.int32), plan.send_sizes.astype(jnp.int32),
                                         output_offsets, plan.recv_sizes.astype(jnp.int32), axis_name=cfg.axis_name)
    blocks = jnp.take(x, plan.send_index, axis=0, mode="fill", fill_value=0)  # [ep, C, ...]
    if cfg.transport == "ppermute":
        received = _shifted(blocks, 1, cfg)
    else:
        received = jax.lax.all_to_all(blocks, cfg.axis_name, 0, 0)
    return received.reshape((ep * capacity,) + x.shape[1:])


def _return_blocks(y, plan: _ChunkPlan, cfg: ExchangeConfig):
    """Results ``[ep * C, ...]`` in received (block, slot) order -> the same for the blocks I sent."""
    ep, capacity = cfg.ep_size, cfg.capacity
    if cfg.transport == "ragged":
        me = jax.lax.axis_index(cfg.axis_name)
        input_offsets = jnp.arange(ep, dtype=jnp.int32) * capacity
        return jax.lax.ragged_all_to_all(y, jnp.zeros_like(y), input_offsets, plan.recv_sizes.astype(jnp.int32),
                                         jnp.full((ep,), me * capacity, jnp.int32),
                                         plan.send_sizes.astype(jnp.int32), axis_name=cfg.axis_name)
    blocks = y.reshape((ep, capacity) + y.shape[1:])
    if cfg.transport == "ppermute":
        returned = _shifted(blocks, -1, cfg)
    else:
        returned = jax.lax.all_to_all(blocks, cfg.axis_name, 0, 0)
    return returned.reshape(y.shape)


def _gather_home(returned_chunks, home_index):
    """Each sorted row reads its result from the round's returned chunks (zeros if not in the round)."""
    returned = jnp.concatenate(returned_chunks) if len(returned_chunks) > 1 else returned_chunks[0]
    return jnp.take(returned, home_index, axis=0, mode="fill", fill_value=0)


def _expected_rows(cfg: ExchangeConfig, num_rows: int) -> int:
    """Rows a chunk's receive buffer holds when routing is balanced: a rank receives as many rows
    as it sends, ``num_rows`` a round over the round's chunks. The buffer is sized for the worst
    case (``ep`` times this for ``"peer"``); the grouped GEMMs pick their tile shape for these."""
    return min(cfg.ep_size * cfg.capacity, -(-num_rows // cfg.chunks))


def _local_program(cfg: ExchangeConfig, group_sizes, expert_of_row, sorted_rows, sorted_payloads, params,
                   program: ExpertProgram | None = None, expected_rows: int | None = None):
    """The expert program (or ``program``, a part of it) on rows sorted by local expert; per-token
    inputs arrive as row payloads. ``expected_rows``: see :func:`_expected_rows`."""
    program = program or cfg.program
    payload_iter = iter(sorted_payloads)
    values = [next(payload_iter) if kind is ParamKind.PER_TOKEN else p
              for kind, p in zip(cfg.program.param_kinds, params)]
    context = RowContext(
        rows=sorted_rows,
        group_sizes=group_sizes,
        expert_of_row=expert_of_row,
        token_of_row=jnp.arange(sorted_rows.shape[0], dtype=jnp.int32),
    )

    zero_outside = _tails_read(cfg)  # rows past the received ones: see there

    def matmul(lhs, rhs, sizes, offset, preferred_element_type):
        return expert_matmul(lhs, rhs, sizes, cfg.backend, offset, preferred_element_type, zero_outside=zero_outside,
                             expected_rows=expected_rows)

    if zero_outside:
        return evaluate(program, values, context, matmul)

    def swiglu_matmul(lhs, gate_rhs, up_rhs, sizes, offset, preferred_element_type):
        """Both products, then the activation on the received rows only: the buffer is sized for
        the worst case (``ep`` times a balanced arrival with ``"peer"``), its tail is never read."""
        gate, up = expert_matmul_pair(lhs, gate_rhs, up_rhs, sizes, cfg.backend, offset, preferred_element_type,
                                      zero_outside=zero_outside, expected_rows=expected_rows)
        return swiglu_rows(gate, up, jnp.sum(sizes), cfg.backend)

    return evaluate(program, values, context, matmul, swiglu_matmul=swiglu_matmul)


@dataclass(frozen=True)
class _OutputMatmul:
    """The program's last grouped GEMM, which the ``"peer"`` transport fuses with the return:
    its epilogue stores every output row straight to the row's home rank
    (:func:`~moe_lowering.kernels.peer_store.grouped_matmul_store`), so the return exchange runs
    under the GEMM, not after it. ``prefix`` is the program up to that GEMM's input."""

    matmul: ExpertMatmul
    prefix: ExpertProgram
    weight_read_before: bool  # the prefix reads the same weight too (its gradients add up)


def _output_matmul(cfg: ExchangeConfig, params) -> _OutputMatmul | None:
    """The fusable output GEMM: the ``"peer"`` transport, a program ending in a grouped GEMM, and a
    plain weight array (a weight object, e.g. FP8-gathered, multiplies itself instead)."""
    output = cfg.program.output
    if cfg.transport != "peer" or not isinstance(output, ExpertMatmul):
        return None
    weight = params[output.weight]
    if not isinstance(weight, jax.Array) or weight.ndim != 3:
        return None
    nodes = tuple(n for n in (cfg.program.nodes or topological_nodes(output)) if n is not output)
    prefix = ExpertProgram(output.source, cfg.program.param_kinds, nodes)
    read_before = any((isinstance(n, ExpertMatmul) and n.weight == output.weight)
                      or (isinstance(n, Elementwise) and ParamRef(output.weight) in n.operands) for n in nodes)
    return _OutputMatmul(output, prefix, read_before)


def _output_matmul_vjp(fused: _OutputMatmul, backend: str, expected_rows: int, lhs, weight, group_sizes, prefix_vjp,
                       d_out):
    """The chunk's vjp when its output GEMM was fused with the return: the GEMM's two cotangent
    products, then the prefix's vjp; same ``(rows, payloads, params)`` cotangents as ``jax.vjp``."""
    d_lhs, d_weight = grouped_matmul_cotangents(lhs, weight, group_sizes, d_out.astype(lhs.dtype), backend,
                                                expected_rows=expected_rows)
    d_rows, d_payloads, d_params = prefix_vjp(d_lhs)
    d_params = list(d_params)
    index = fused.matmul.weight
    d_params[index] = (_add_rounded(d_params[index], d_weight) if fused.weight_read_before
                       else d_weight.astype(d_params[index].dtype))
    return d_rows, d_payloads, tuple(d_params)


def num_rounds(counts, cfg: ExchangeConfig):
    """Rounds needed for the largest (source, destination) pair; the same on every rank."""
    pair_totals = counts.reshape(cfg.ep_size, cfg.ep_size, cfg.local_experts).sum(axis=2)
    return (jnp.max(pair_totals) + cfg.round_rows - 1) // cfg.round_rows


def _tails_read(cfg: ExchangeConfig) -> bool:
    """Whether the expert program can read rows past the received ones: a per-expert or constant
    param's gradient sums over every row (unspecified rows could hold non-finite values, and
    0 * inf is not 0). Otherwise those rows need no zeros: they are never sent home, and the
    grouped GEMMs and their gradients read only the rows of their groups."""
    return any(kind in (ParamKind.PER_EXPERT, ParamKind.CONSTANT) for kind in cfg.program.param_kinds)


def _home_written_once(cfg: ExchangeConfig, num_rows: int) -> bool:
    """Whether one chunk returns every row that was sent: then the home buffers need no zeros
    but past the sent rows (which sort first); with several chunks or rounds each returns a part
    and the parts are summed."""
    return cfg.chunks == 1 and single_round(cfg, num_rows)


def _dispatch_sorted(x, plan: _ChunkPlan, cfg: ExchangeConfig, buffer: PeerBuffer | None = None,
                     row_source: RowSource | None = None):
    """Rows received in this chunk, sorted by local expert (zeros after the received ones, where
    the program could read them). ``row_source``: where the ``"peer"`` push reads ``x``'s rows."""
    if plan.peer_routes is not None:
        routes = plan.peer_routes
        values, source_row = x, plan.send_index.reshape(-1)
        if row_source is not None:
            values, source_row = row_source.tokens, row_source.token_index(source_row)
        return peer_store(values, source_row, routes.dispatch_device, routes.dispatch_row,
                          cfg.ep_size * cfg.capacity, plan.local_group_sizes.sum(), axis_name=cfg.axis_name,
                          axis_size=cfg.ep_size, zeroed=False, backend=cfg.backend, buffer=buffer,
                          zero_tail=_tails_read(cfg))
    return _dispatch(x, plan, cfg)[plan.slot_of_position]


def _dispatch_tokens(rows, routes: _TokenRoutes, plan: _ChunkPlan, cfg: ExchangeConfig, buffers=None,
                     row_source: RowSource | None = None):
    """:func:`_dispatch_sorted` of the rows, moving each (token, rank) pair's row once: the tokens
    into the receiver's token buffer, each row's token slot to its sorted position, then the
    receiver expands tokens into rows. The same rows result, so nothing after this changes."""
    num_rows, ep = rows.shape[0], cfg.ep_size
    token_buffer, slot_buffer = buffers if buffers is not None else (None, None)
    store = functools.partial(peer_store, axis_name=cfg.axis_name, axis_size=ep, zeroed=False, backend=cfg.backend,
                              zero_tail=False)
    values, source_row = rows, jnp.arange(num_rows, dtype=jnp.int32)
    if row_source is not None:
        values, source_row = row_source.tokens, row_source.token_of_row
    tokens = store(values, source_row, routes.token_device, routes.token_slot,
                   ep * num_rows, routes.tokens_arriving, buffer=token_buffer)
    received_rows = plan.local_group_sizes.sum()
    slots = store(routes.slot_of_row[:, None], plan.send_index.reshape(-1), plan.peer_routes.dispatch_device,
                  plan.peer_routes.dispatch_row, ep * cfg.capacity, received_rows, buffer=slot_buffer)
    return expand_rows(tokens, slots[:, 0], received_rows, backend=cfg.backend, zero_tail=_tails_read(cfg))


def _home_rows(plan: _ChunkPlan, cfg: ExchangeConfig, num_rows: int):
    """``(zeroed, rows that arrive)`` of a chunk's home buffer (rows past those arrive as zeros)."""
    if _home_written_once(cfg, num_rows):
        return False, plan.send_sizes.sum()
    return True, num_rows


def _send_home(results, plan: _ChunkPlan, cfg: ExchangeConfig, num_rows: int, buffer: PeerBuffer | None = None):
    """A chunk's results, sorted by local expert, on their way home (see :func:`_combine_home`)."""
    if plan.peer_routes is not None:
        routes = plan.peer_routes
        positions = jnp.arange(results.shape[0], dtype=jnp.int32)
        zeroed, arriving = _home_rows(plan, cfg, num_rows)
        return peer_store(results, positions, routes.return_device, routes.return_row, num_rows, arriving,
                          axis_name=cfg.axis_name, axis_size=cfg.ep_size, zeroed=zeroed, backend=cfg.backend,
                          buffer=buffer)
    return _return_blocks(results[plan.position_of_slot], plan, cfg)


def _send_home_from_matmul(lhs, weight, fused: _OutputMatmul, plan: _ChunkPlan, cfg: ExchangeConfig, num_rows: int,
                           buffer: PeerBuffer | None = None):
    """``_send_home(lhs @ weight[expert])`` with the product stored home by the GEMM itself (``"peer"``)."""
    routes = plan.peer_routes
    zeroed, arriving = _home_rows(plan, cfg, num_rows)
    return grouped_matmul_store(lhs, weight, plan.local_group_sizes, routes.return_device, routes.return_row,
                                num_rows, arriving, axis_name=cfg.axis_name, axis_size=cfg.ep_size, zeroed=zeroed,
                                backend=cfg.backend, buffer=buffer,
                                preferred_element_type=fused.matmul.preferred_element_type,
                                expected_rows=_expected_rows(cfg, num_rows))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class _ChunkBuffers:
    """A chunk's receive buffers for the ``"peer"`` transport, made before the exchange starts:
    the rows it dispatches (and their payloads), and the results that come home."""

    dispatched: PeerBuffer | None
    dispatched_payloads: tuple[PeerBuffer | None, ...]
    home: tuple[PeerBuffer | None, ...]  # one per array that comes home
    tokens: tuple[PeerBuffer, PeerBuffer] | None = None  # the deduplicated dispatch's tokens and slots

    @classmethod
    def none(cls, num_payloads: int, num_home: int) -> "_ChunkBuffers":
        """No buffers made up front: each store makes its own (further rounds, other transports)."""
        return cls(None, (None,) * num_payloads, (None,) * num_home)


def _preallocate(cfg: ExchangeConfig, dispatched, homecoming, num_rows: int, deduplicated: bool = False):
    """Round 0's ``"peer"`` buffers, one :class:`_ChunkBuffers` per chunk, addresses not yet gathered.

    ``dispatched``: the arrays sent out (rows first, then payloads); ``homecoming``: the
    ``ShapeDtypeStruct`` of each ``[num_rows, ...]`` array that comes back; ``deduplicated``: the
    rows go as tokens (:func:`_dispatch_tokens`). ``None`` if the transport is not ``"peer"`` on
    the GPU kernels.
    """
    if cfg.transport != "peer" or not uses_kernels(cfg.backend):
        return None
    sent_rows = cfg.ep_size * cfg.capacity

    def make(rows, like, zeroed):
        return allocate_buffer(rows, like.shape[1:], like.dtype, axis_size=cfg.ep_size, zeroed=zeroed)

    home_zeroed = not _home_written_once(cfg, num_rows)
    rows = dispatched[0]
    tokens = (make(cfg.ep_size * num_rows, rows, False),
              make(sent_rows, jax.ShapeDtypeStruct((1, 1), jnp.int32), False)) if deduplicated else None
    return tuple(
        _ChunkBuffers(None if deduplicated else make(sent_rows, rows, False),
                      tuple(make(sent_rows, p, False) for p in dispatched[1:]),
                      tuple(make(num_rows, h, home_zeroed) for h in homecoming), tokens)
        for _ in range(cfg.chunks)
    )


def _gather_with_addresses(cfg: ExchangeConfig, buffers, payload=None):
    """One all-gather for every buffer's address words (and ``payload``): one sync point, not one per store."""
    flat, tree = jax.tree.flatten(buffers, is_leaf=lambda x: isinstance(x, PeerBuffer))
    gathered, payload = gather_addresses(flat, cfg.axis_name, payload)
    return jax.tree.unflatten(tree, gathered), payload


def _gather_counts(cfg: ExchangeConfig, group_sizes, buffers=None, unique_per_rank=None):
    """``(counts [ep, E], buffers with gathered addresses, unique counts [ep, ep] or None)``: the
    all-gathered group sizes (and tokens per rank of a deduplicated dispatch), with the ``"peer"``
    buffers' addresses in the same collective."""
    payload = group_sizes if unique_per_rank is None else jnp.concatenate([group_sizes, unique_per_rank])
    if buffers is None:
        gathered = jax.lax.all_gather(payload, cfg.axis_name)
    else:
        buffers, gathered = _gather_with_addresses(cfg, buffers, payload)
    num_experts = group_sizes.shape[0]
    unique = None if unique_per_rank is None else gathered[:, num_experts:]
    return gathered[:, :num_experts], buffers, unique


def _combine_home(sent_home, counts, round_index, num_rows: int, cfg: ExchangeConfig):
    """``[N, ...]``: every sorted row's result from the round's chunks (zeros for rows not in the round)."""
    if cfg.transport == "peer":  # each chunk already stored its rows at home, zeros elsewhere
        return functools.reduce(jnp.add, sent_home)
    return _gather_home(sent_home, _home_index(counts, round_index, num_rows, cfg))


def _chunk_indices(round_index, cfg: ExchangeConfig):
    return [round_index * cfg.chunks + j for j in range(cfg.chunks)]


def _round_forward(cfg: ExchangeConfig, counts, round_index, rows, payloads, params, out_dtype, keep_vjp: bool,
                   buffers=None, token_routes: _TokenRoutes | None = None, row_source: RowSource | None = None):
    """One round: ``[N, F]`` results at home (zeros for rows of other rounds), and each chunk's vjp if asked.

    ``buffers``: the round's ``"peer"`` buffers made up front (round 0), else each store makes its own.
    ``token_routes``: the rows go as tokens (one round of one chunk, see :func:`deduplicates`).
    ``row_source``: where the ``"peer"`` pushes read the rows (see :class:`RowSource`).
    """
    num_rows = rows.shape[0]
    returned, vjps = [], []
    for j, chunk_index in enumerate(_chunk_indices(round_index, cfg)):
        plan = _chunk_plan(counts, chunk_index, num_rows, cfg)
        chunk = _ChunkBuffers.none(len(payloads), 1) if buffers is None else buffers[j]
        if token_routes is None:
            sorted_rows = _dispatch_sorted(rows, plan, cfg, chunk.dispatched, row_source)
        else:
            sorted_rows = _dispatch_tokens(rows, token_routes, plan, cfg, chunk.tokens, row_source)
        sorted_payloads = tuple(_dispatch_sorted(p, plan, cfg, b) for p, b in zip(payloads, chunk.dispatched_payloads))
        fused = _output_matmul(cfg, params)
        expected_rows = _expected_rows(cfg, num_rows)
        program = functools.partial(_local_program, cfg, plan.local_group_sizes, plan.local_expert_of_row,
                                    program=None if fused is None else fused.prefix, expected_rows=expected_rows)
        if keep_vjp:
            result, vjp = jax.vjp(program, sorted_rows, sorted_payloads, params)
        else:
            result, vjp = program(sorted_rows, sorted_payloads, params), None
        if fused is None:
            returned.append(_send_home(result.astype(out_dtype), plan, cfg, num_rows, chunk.home[0]))
        else:  # ``result`` is the output GEMM's input; the GEMM stores its rows at home
            weight = params[fused.matmul.weight]
            returned.append(_send_home_from_matmul(result, weight, fused, plan, cfg, num_rows, chunk.home[0]))
            if keep_vjp:
                vjp = jax.tree_util.Partial(functools.partial(_output_matmul_vjp, fused, cfg.backend, expected_rows),
                                            result, weight, plan.local_group_sizes, vjp)
        if keep_vjp:
            vjps.append(vjp)
    return _combine_home(returned, counts, round_index, num_rows, cfg), tuple(vjps)


def single_round(cfg: ExchangeConfig, num_rows: int) -> bool:
    """Whether one round holds every pair whatever the routing: no pair can exceed ``num_rows``
    (all of a rank's rows), so no overflow loop is built, and nothing waits on the host."""
    return cfg.round_rows >= num_rows


def _further_rounds(counts, cfg: ExchangeConfig, body, init, num_rows: int):
    """``body(round_index, state)`` for rounds 1, 2, ... while the largest pair has rows left (usually none).

    The loop's trip count is read on the host (a device-to-host copy and a sync every step), so it
    is left out where :func:`single_round` says one round suffices."""
    if single_round(cfg, num_rows):
        return init
    rounds = num_rounds(counts, cfg)
    if cfg.lockstep_axes:
        rounds = jax.lax.pmax(rounds, cfg.lockstep_axes)
    _, state = jax.lax.while_loop(lambda s: s[0] < rounds, lambda s: (s[0] + 1, body(s[0], s[1])),
                                  (jnp.ones((), jnp.int32), init))
    return state


def _placed(fn):
    """``fn(cfg, ...)`` traced inside ``cfg``'s heap placement (see :class:`ExchangeConfig`)."""

    @functools.wraps(fn)
    def traced(cfg: ExchangeConfig, *args, **kwargs):
        if not cfg.device_ids:
            return fn(cfg, *args, **kwargs)
        with peer_heap.placement(cfg.device_ids, cfg.mesh_axes):
            return fn(cfg, *args, **kwargs)

    return traced


@_placed
def _forward(cfg: ExchangeConfig, rows, payloads, params, group_sizes, token_of_row, keep_vjp: bool,
             row_source: RowSource | None = None):
    """``(results at home, round 0's vjps, counts)``."""
    out_rows = _output_rows(cfg, rows, payloads, params)
    deduplicated = token_of_row is not None and deduplicates(cfg, rows.shape[0])
    buffers = _preallocate(cfg, (rows, *payloads), (out_rows,), rows.shape[0], deduplicated)
    representatives = _representatives(token_of_row, group_sizes, cfg) if deduplicated else None
    counts, buffers, unique_counts = _gather_counts(cfg, group_sizes, buffers,
                                                    None if representatives is None else representatives[3])
    token_routes = None if representatives is None else _token_routes(representatives, unique_counts, cfg)
    out, vjps = _round_forward(cfg, counts, 0, rows, payloads, params, out_rows.dtype, keep_vjp, buffers,
                               token_routes, row_source)

    def body(round_index, out):
        more, _ = _round_forward(cfg, counts, round_index, rows, payloads, params, out_rows.dtype, False)
        return out + more  # rounds cover disjoint rows: exact

    return _further_rounds(counts, cfg, body, out, rows.shape[0]), vjps, counts


def _output_rows(cfg: ExchangeConfig, rows, payloads, params) -> jax.ShapeDtypeStruct:
    """Shape and dtype of the program's output rows (abstract evaluation, no FLOPs)."""
    group_sizes = jax.ShapeDtypeStruct((cfg.local_experts,), jnp.int32)
    expert_of_row = jax.ShapeDtypeStruct((rows.shape[0],), jnp.int32)
    return jax.eval_shape(functools.partial(_local_program, cfg), group_sizes, expert_of_row, rows, payloads, params)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def exchange_expert_rows(cfg: ExchangeConfig, rows, payloads, params, group_sizes, token_of_row=None,
                         row_source: RowSource | None = None):
    """Expert-program outputs for my sorted ``rows``, computed on the ranks that own their experts.

    ``rows [N, D]`` sorted by global expert (dropped copies last, never sent); ``payloads`` are
    per-row values of the program's ``PER_TOKEN`` inputs, in the same order; ``params`` the
    program inputs with expert-indexed ones sliced to this rank's experts; ``group_sizes [E]``
    my rows per expert (all-gathered here into the counts matrix, together with the ``"peer"``
    transport's buffer addresses). ``token_of_row [N]`` (rows of one token are copies of it)
    lets the dispatch send each token once per rank (:func:`deduplicates`). ``row_source``: see
    :class:`RowSource`. Rows that were not sent come back as zeros.
    """
    out, _, _ = _forward(cfg, rows, payloads, params, group_sizes, token_of_row, False, row_source)
    return out


@exchange_expert_rows.defjvp
def _exchange_jvp(cfg, primals, tangents):
    """The forward with round 0's vjps kept, and the tangent as one linear primitive of them."""
    rows, payloads, params, group_sizes, token_of_row, row_source = primals
    out, vjps, counts = _forward(cfg, rows, payloads, params, group_sizes, token_of_row, True, row_source)
    residuals = (rows, payloads, params, group_sizes, counts, vjps)
    differentiable = tuple(jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in jax.tree.leaves(primals[:3]))
    tangent_leaves = [t for t, keep in zip(jax.tree.leaves(tangents[:3]), differentiable) if keep]
    residual_leaves, residual_tree = jax.tree.flatten(residuals)
    statics = _TangentStatics(cfg, residual_tree, differentiable, jax.typeof(out))
    out_tangent = exchange_tangent_p.bind(*residual_leaves, *tangent_leaves, statics=statics, batch=(), batch_shape=())
    return out, out_tangent


def _param_cotangent(g, p):
    """``g`` in ``p``'s dtype; ``None`` for integer params; a weight object's cotangent as it comes."""
    if not isinstance(p, jax.Array):
        return g
    return g.astype(p.dtype) if jnp.issubdtype(p.dtype, jnp.floating) else None


def _add_rounded(total, more):
    """``total + more`` in float32, rounded to ``total``'s dtype, leaf by leaf (float0 leaves kept)."""
    if total is None or more is None:
        return total

    def add(a, b):
        if a.dtype == jax.dtypes.float0:
            return a
        return (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(a.dtype)

    return jax.tree.map(add, total, more)


def _round_backward(cfg: ExchangeConfig, counts, round_index, vjps, rows, payloads, params, d_out, buffers=None):
    """Cotangents of one round: rows and payloads at home, params summed over the round's chunks.

    ``vjps``: the forward's per-chunk vjps (round 0: only the output cotangents travel), or
    ``None`` to dispatch the rows again and recompute each chunk's program under ``jax.vjp``.
    ``buffers``: round 0's ``"peer"`` buffers made up front (cotangents out; rows and payloads home).
    """
    num_rows = rows.shape[0]
    returned_rows, returned_payloads, d_params = [], [[] for _ in payloads], None
    for j, chunk_index in enumerate(_chunk_indices(round_index, cfg)):
        plan = _chunk_plan(counts, chunk_index, num_rows, cfg)
        chunk = _ChunkBuffers.none(0, 1 + len(payloads)) if buffers is None else buffers[j]
        if vjps is None:
            program = functools.partial(_local_program, cfg, plan.local_group_sizes, plan.local_expert_of_row,
                                        expected_rows=_expected_rows(cfg, num_rows))
            sorted_payloads = tuple(_dispatch_sorted(p, plan, cfg) for p in payloads)
            _, vjp = jax.vjp(program, _dispatch_sorted(rows, plan, cfg), sorted_payloads, params)
        else:
            vjp = vjps[j]
        g_rows, g_payloads, g_params = vjp(_dispatch_sorted(d_out, plan, cfg, chunk.dispatched))
        returned_rows.append(_send_home(g_rows.astype(rows.dtype), plan, cfg, num_rows, chunk.home[0]))
        for returned, g, p, home in zip(returned_payloads, g_payloads, payloads, chunk.home[1:]):
            returned.append(_send_home(g.astype(p.dtype), plan, cfg, num_rows, home))
        if d_params is None:
            d_params = tuple(_param_cotangent(g, p) for g, p in zip(g_params, params))
        else:
            d_params = tuple(_add_rounded(a, g) for a, g in zip(d_params, g_params))
    return (_combine_home(returned_rows, counts, round_index, num_rows, cfg),
            tuple(_combine_home(r, counts, round_index, num_rows, cfg) for r in returned_payloads), d_params)


@_placed
def _exchange_bwd(cfg, residuals, d_out):
    rows, payloads, params, _, counts, vjps = residuals
    buffers = _preallocate(cfg, (d_out,), (rows, *payloads), rows.shape[0])
    if buffers is not None:
        buffers, _ = _gather_with_addresses(cfg, buffers)
    state = _round_backward(cfg, counts, 0, vjps, rows, payloads, params, d_out, buffers)

    def body(round_index, state):
        d_rows, d_payloads, d_params = state
        more_rows, more_payloads, more_params = _round_backward(cfg, counts, round_index, None, rows, payloads,
                                                                params, d_out)
        return (d_rows + more_rows, tuple(a + b for a, b in zip(d_payloads, more_payloads)),
                tuple(_add_rounded(a, g) for a, g in zip(d_params, more_params)))

    d_rows, d_payloads, d_params = _further_rounds(counts, cfg, body, state, rows.shape[0])
    return d_rows, d_payloads, d_params


# --------------------------------------------------------------------------- the tangent primitive
# Operands: the leaves of the residuals ``(rows, payloads, params, group_sizes, counts, round 0's
# vjps)``, then the tangents of the inexact leaves of ``(rows, payloads, params)``
# (``differentiable`` marks which). Linear in the tangents. ``batch`` holds one tuple per
# enclosing ``vmap`` (outermost first) telling which operands have that axis in front, as the
# primitives of ``moe_lowering.primitives`` do; ``batch_shape`` the sizes of those axes.


@dataclass(frozen=True, eq=False)
class _TangentStatics:
    """The tangent primitive's static parameters, compared by identity (primitive parameters must
    hash, and the expert program holds array literals)."""

    cfg: ExchangeConfig
    residual_tree: Any  # the residuals' PyTreeDef
    differentiable: tuple[bool, ...]  # which leaves of (rows, payloads, params) have tangent operands
    out_aval: Any  # the unbatched output's aval

    @property
    def num_residuals(self) -> int:
        return self.residual_tree.num_leaves


def _full_tangents(primals, differentiable, tangent_leaves):
    """Tangents of every leaf of ``primals`` (float0 zeros for the integer ones)."""
    tangents, given = [], iter(tangent_leaves)
    for leaf, keep in zip(jax.tree.leaves(primals), differentiable):
        tangents.append(next(given) if keep else np.zeros(leaf.shape, jax.dtypes.float0))
    return jax.tree.unflatten(jax.tree.structure(primals), tangents)


def _forward_mode_config(cfg: ExchangeConfig) -> ExchangeConfig:
    """``cfg`` on pieces JAX differentiates forwards: collective transports instead of the
    ``"peer"`` kernels."""
    transport = "all_to_all" if cfg.transport == "peer" else cfg.transport
    return dataclasses.replace(cfg, transport=transport)


def _vmapped(fn, batch, *operands):
    """``fn`` on ``operands`` unbatched, ``vmap``ped over each level of ``batch``."""
    for level in reversed(batch):
        fn = jax.vmap(fn, in_axes=tuple(0 if batched else None for batched in level))
    return fn(*operands)


def _tangent(statics: _TangentStatics, *operands):
    """Forward mode, one unbatched call: JAX's JVP of the exchange's forward at the residuals' primals."""
    residuals = jax.tree.unflatten(statics.residual_tree, operands[:statics.num_residuals])
    rows, payloads, params, group_sizes, _, _ = residuals
    primals = (rows, payloads, params)
    plain = _forward_mode_config(statics.cfg)

    def forward(rows, payloads, params):
        return _forward(plain, rows, payloads, params, group_sizes, None, False)[0]

    tangents = _full_tangents(primals, statics.differentiable, operands[statics.num_residuals:])
    return jax.jvp(forward, primals, tangents)[1]


def _tangent_cotangents(statics: _TangentStatics, d_out, *residual_leaves):
    """Reverse mode, one unbatched call: the cotangents of the tangent operands by the written-out
    backward (:func:`_exchange_bwd`) on the residuals."""
    residuals = jax.tree.unflatten(statics.residual_tree, residual_leaves)
    rows, payloads, params = residuals[:3]
    d_rows, d_payloads, d_params = _exchange_bwd(statics.cfg, residuals, d_out)
    cotangents = [d_rows, *d_payloads]
    for param, d_param in zip(params, d_params):
        structure = jax.tree.structure(param)
        cotangents += structure.flatten_up_to(d_param) if d_param is not None else [None] * structure.num_leaves
    primal_leaves = jax.tree.leaves((rows, payloads, params))
    return [jnp.zeros(leaf.shape, leaf.dtype) if ct is None else ct.astype(leaf.dtype)
            for ct, leaf, keep in zip(cotangents, primal_leaves, statics.differentiable) if keep]


def _tangent_impl(*operands, statics: _TangentStatics, batch, batch_shape):
    return _vmapped(functools.partial(_tangent, statics), batch, *operands)


def _tangent_abstract_eval(*operands, statics: _TangentStatics, batch, batch_shape):
    return _compat.ShapedArray(tuple(batch_shape) + tuple(statics.out_aval.shape), statics.out_aval.dtype)


def _tangent_transpose(d_out, *operands, statics: _TangentStatics, batch, batch_shape):
    num_residuals = statics.num_residuals
    if type(d_out) is _compat.Zero:
        return [None] * len(operands)
    cotangent_fn = functools.partial(_tangent_cotangents, statics)
    levels = tuple((True,) + level[:num_residuals] for level in batch)  # d_out has every level's axis
    cotangents = _vmapped(cotangent_fn, levels, _compat.instantiate_zeros(d_out), *operands[:num_residuals])
    summed = []
    for i, ct in enumerate(cotangents):  # over the levels a tangent operand lacks
        axes = tuple(j for j, level in enumerate(batch) if not level[num_residuals + i])
        summed.append(ct.sum(axis=axes) if axes else ct)
    return [None] * num_residuals + summed


def _tangent_jvp(primals, tangents, **params):
    """Second-order forward mode: the JVP of the forward-mode tangent."""
    tangents = [_compat.instantiate_zeros(t) for t in tangents]
    return jax.jvp(functools.partial(_tangent_impl, **params), tuple(primals), tuple(tangents))


def _tangent_batch(operands, dims, *, batch, batch_shape, **params):
    size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
    operands = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(operands, dims)]
    level = tuple(d is not None for d in dims)
    out = exchange_tangent_p.bind(*operands, batch=(level,) + tuple(batch), batch_shape=(size,) + tuple(batch_shape),
                                  **params)
    return out, 0


exchange_tangent_p = _compat.Primitive("moe_ep_exchange_tangent")
exchange_tangent_p.def_abstract_eval(_tangent_abstract_eval)
exchange_tangent_p.def_impl(_tangent_impl)
_compat.register_lowering(exchange_tangent_p, _tangent_impl, multiple_results=False)
_compat.primitive_transposes[exchange_tangent_p] = _tangent_transpose
_compat.primitive_jvps[exchange_tangent_p] = _tangent_jvp
_compat.primitive_batchers[exchange_tangent_p] = _tangent_batch


def prepare_peer_transport(devices, backend: str) -> None:
    """Checks that the ``"peer"`` transport can run on ``devices`` and prepares it: peer access
    between this process's GPUs, or, for GPUs of one process each on this host, the peer heap
    (``kernels/peer_store/heap.py``; every process of the mesh must prepare it)."""
    if get_backend(backend).name != "triton":
        return  # the all-gather reference: exact wherever the mesh's collectives run, across processes too
    devices = list(devices)
    if not devices:  # a mesh whose devices are not known here
        raise ValueError("exchange_transport='peer' needs the mesh's devices")
    local = set(jax.local_devices())
    if all(d in local for d in devices):
        from moe_lowering.kernels.peer_store import triton_launch

        triton_launch.enable_peer_access(tuple(sorted(d.local_hardware_id for d in devices)))
        return
    obstacle = peer_heap.job_obstacle(devices)
    if obstacle is not None:
        raise ValueError(f"exchange_transport='peer' across processes: {obstacle}; use 'all_to_all'")
    failure = peer_heap.agreed_open(tuple(sorted(d.id for d in devices)))  # also every process's mapped bases
    if failure is not None:
        raise RuntimeError(f"exchange_transport='peer' across processes: {failure}; use 'all_to_all'")


def resolve_transport(requested: str, devices, backend: str) -> str:
    """The transport to run for ``requested`` on ``devices``: names pass through; ``"auto"`` is
    ``"peer"`` where it can run, else ``"all_to_all"``.

    Peer stores go from GPU to GPU through the Triton kernels, so they need more than one device,
    every one a GPU of this host, and the Triton backend: either every GPU of this process, or
    one GPU per process with all those processes on this host (the peer heap, set up here; finding
    that out exchanges host names and the heaps' setup through ``jax.distributed``'s key-value
    store, so every process of the mesh must resolve it, as every one traces the same layer).
    Across hosts, on CPUs, or where a process could not set up its heap (with a warning) the
    NCCL/XLA collectives carry the rows.
    """
    if requested != AUTO_TRANSPORT:
        return requested
    from moe_lowering.kernels import BackendUnavailable

    devices, local = list(devices), set(jax.local_devices())
    if len(devices) < 2 or any(d.platform != "gpu" for d in devices):
        return "all_to_all"
    try:
        triton = get_backend(backend).name == "triton"
    except BackendUnavailable:
        triton = False
    if not triton:
        return "all_to_all"
    if all(d in local for d in devices):
        return "peer"
    if peer_heap.job_obstacle(devices) is not None:
        return "all_to_all"
    failure = peer_heap.agreed_open(tuple(sorted(d.id for d in devices)))
    if failure is not None:
        warnings.warn(f"exchange_transport='auto': the peer heap could not be set up ({failure}); "
                      "using 'all_to_all'", stacklevel=2)
        return "all_to_all"
    return "peer"


def exchange_config(**kwargs: Any) -> ExchangeConfig:
    """Validated :class:`ExchangeConfig`."""
    cfg = ExchangeConfig(**kwargs)
    if cfg.transport not in TRANSPORTS:
        raise ValueError(f"exchange transport must be one of {TRANSPORTS}, got {cfg.transport!r}")
    if cfg.capacity <= 0:
        raise ValueError(f"exchange capacity must be positive, got {cfg.capacity}")
    if not isinstance(cfg.chunks, int) or cfg.chunks <= 0:
        raise ValueError(f"exchange chunks must be a positive integer, got {cfg.chunks!r}")
    return cfg
