"""Expert-parallel dispatch, local grouped GEMMs and combine, in rounds of static capacity.

Runs per device inside ``shard_map``. Every device holds its token copies sorted by (global)
expert, so the copies bound for expert-parallel rank ``d`` are one contiguous run. The counts
matrix ``[ep, E]`` (all-gathered group sizes) tells every device, without further
communication, how many rows each pair of ranks exchanges and in which expert order.

One *round* moves at most ``capacity`` rows from every rank to every rank:

1. dispatch: row chunk ``[ep, capacity, D]`` -> ``all_to_all`` over the expert axis;
2. the receiver sorts the ``ep * capacity`` rows it got by local expert (a counting sort from
   the counts matrix, no ``argsort``), runs the expert program with grouped GEMMs over its
   ``E / ep`` experts, and un-sorts;
3. combine: the reverse ``all_to_all`` brings each row's result home to its sorted position.

Rounds repeat (``while_loop``) until the largest pair count is covered, so the exchange is
dropless under any skew, while balanced routing takes one round and per-device buffers stay at
``ep * capacity`` rows whatever the skew. With ``transport="ragged"`` each round uses
``jax.lax.ragged_all_to_all`` instead (same rounds, no padding bytes; unsupported on XLA:CPU).

The backward is the transposed exchange written out (``custom_vjp``): rows and output
cotangents are dispatched together, the expert program is recomputed per round under
``jax.vjp`` (nothing of size ``rounds x capacity`` is kept from the forward), the row
cotangents travel back, and weight gradients accumulate in float32 across rounds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from moe_lowering.expert_program import ExpertProgram, ParamKind, RowContext, evaluate
from moe_lowering.sparse_moe import grouped_matmul

TRANSPORTS = ("all_to_all", "ragged")


@dataclass(frozen=True)
class ExchangeConfig:
    """Static description of one expert-parallel exchange (hashable: a ``custom_vjp`` nondiff arg)."""

    program: ExpertProgram
    axis_name: str
    ep_size: int
    local_experts: int
    capacity: int  # rows per (source, destination) pair per round
    backend: str = "auto"
    transport: str = "all_to_all"


@dataclass(frozen=True)
class _RoundPlan:
    """Index arithmetic of one round, identical on sender and receiver sides."""

    send_index: jax.Array  # [ep, C] my sorted row sent to rank d in slot i (num_rows if unused)
    send_sizes: jax.Array  # [ep] rows I send to rank d this round
    send_offsets: jax.Array  # [ep] first of those rows in my sorted rows
    recv_sizes: jax.Array  # [ep] rows rank s sends me this round
    remote_offsets: jax.Array  # [ep] where my results land in rank s's sorted rows
    position_of_slot: jax.Array  # [ep * C] received (source, slot) -> position in the expert-sorted buffer
    slot_of_position: jax.Array  # [ep * C] its inverse
    local_group_sizes: jax.Array  # [E / ep]
    local_expert_of_row: jax.Array  # [ep * C], clipped into range


def _round_plan(counts, round_index, num_rows: int, cfg: ExchangeConfig) -> _RoundPlan:
    ep, local, capacity = cfg.ep_size, cfg.local_experts, cfg.capacity
    me = jax.lax.axis_index(cfg.axis_name)
    by_rank = counts.reshape(ep, ep, local)  # [source, destination rank, local expert]
    pair_totals = by_rank.sum(axis=2)  # [source, destination]
    window = round_index * capacity

    my_totals = pair_totals[me]
    send_offsets = jnp.cumsum(my_totals) - my_totals + window
    send_sizes = jnp.clip(my_totals - window, 0, capacity)
    slot = jnp.arange(capacity, dtype=jnp.int32)
    send_index = jnp.where(slot[None, :] < send_sizes[:, None], send_offsets[:, None] + slot[None, :], num_rows)

    to_me = by_rank[:, me, :]  # [source, local expert]
    recv_sizes = jnp.clip(to_me.sum(axis=1) - window, 0, capacity)
    remote_offsets = (jnp.cumsum(pair_totals, axis=1) - pair_totals)[:, me] + window

    # This round's slice [window, window + C) of each source's expert-ordered run, per expert.
    run_ends = jnp.cumsum(to_me, axis=1)
    chunk_ends = jnp.clip(run_ends - window, 0, capacity)  # [source, local expert]
    chunk_sizes = chunk_ends - jnp.concatenate([jnp.zeros((ep, 1), chunk_ends.dtype), chunk_ends[:, :-1]], axis=1)
    local_group_sizes = chunk_sizes.sum(axis=0)
    group_starts = jnp.cumsum(local_group_sizes) - local_group_sizes
    earlier_sources = jnp.cumsum(chunk_sizes, axis=0) - chunk_sizes  # same expert, sources before s

    expert_of_slot = jax.vmap(lambda ends: jnp.searchsorted(ends, slot, side="right"))(chunk_ends)  # [ep, C]
    valid = expert_of_slot < local
    expert_clipped = jnp.minimum(expert_of_slot, local - 1)
    start_in_chunk = jnp.take_along_axis(chunk_ends - chunk_sizes, expert_clipped, axis=1)
    source = jnp.arange(ep, dtype=jnp.int32)[:, None]
    position = group_starts[expert_clipped] + earlier_sources[source, expert_clipped] + slot[None, :] - start_in_chunk
    num_valid = local_group_sizes.sum()
    padding_rank = jnp.cumsum(~valid.reshape(-1)) - 1
    position_of_slot = jnp.where(valid.reshape(-1), position.reshape(-1), num_valid + padding_rank).astype(jnp.int32)
    slot_of_position = jnp.zeros_like(position_of_slot).at[position_of_slot].set(
        jnp.arange(ep * capacity, dtype=jnp.int32))
    row_ids = jnp.arange(ep * capacity, dtype=jnp.int32)
    local_expert_of_row = jnp.minimum(
        jnp.searchsorted(jnp.cumsum(local_group_sizes), row_ids, side="right"), local - 1
    ).astype(jnp.int32)
    send_offsets = jnp.where(send_sizes > 0, send_offsets, 0)
    remote_offsets = jnp.where(recv_sizes > 0, remote_offsets, 0)
    return _RoundPlan(send_index, send_sizes, send_offsets, recv_sizes, remote_offsets, position_of_slot,
                      slot_of_position, local_group_sizes.astype(jnp.int32), local_expert_of_row)


def _dispatch(x, plan: _RoundPlan, cfg: ExchangeConfig):
    """My rows of this round -> ``[ep * C, ...]`` rows received, in (source, slot) order."""
    ep, capacity = cfg.ep_size, cfg.capacity
    if cfg.transport == "ragged":
        me = jax.lax.axis_index(cfg.axis_name)
        out = jnp.zeros((ep * capacity,) + x.shape[1:], x.dtype)
        output_offsets = jnp.full((ep,), me * capacity, jnp.int32)
        return jax.lax.ragged_all_to_all(x, out, plan.send_offsets.astype(jnp.int32), plan.send_sizes.astype(jnp.int32),
                                         output_offsets, plan.recv_sizes.astype(jnp.int32), axis_name=cfg.axis_name)
    chunk = jnp.take(x, plan.send_index, axis=0, mode="fill", fill_value=0)  # [ep, C, ...]
    received = jax.lax.all_to_all(chunk, cfg.axis_name, 0, 0)
    return received.reshape((ep * capacity,) + x.shape[1:])


def _return_rows(y, into, plan: _RoundPlan, cfg: ExchangeConfig):
    """Results ``[ep * C, ...]`` in (source, slot) order -> written at their rows of ``into`` at home."""
    ep, capacity = cfg.ep_size, cfg.capacity
    if cfg.transport == "ragged":
        input_offsets = jnp.arange(ep, dtype=jnp.int32) * capacity
        return jax.lax.ragged_all_to_all(y, into, input_offsets, plan.recv_sizes.astype(jnp.int32),
                                         plan.remote_offsets.astype(jnp.int32), plan.send_sizes.astype(jnp.int32),
                                         axis_name=cfg.axis_name)
    returned = jax.lax.all_to_all(y.reshape((ep, capacity) + y.shape[1:]), cfg.axis_name, 0, 0)
    return into.at[plan.send_index.reshape(-1)].set(returned.reshape((ep * capacity,) + y.shape[1:]), mode="drop")


def _local_program(cfg: ExchangeConfig, group_sizes, expert_of_row, sorted_rows, sorted_payloads, params):
    """The expert program on rows sorted by local expert; per-token inputs arrive as row payloads."""
    payload_iter = iter(sorted_payloads)
    values = [next(payload_iter) if kind is ParamKind.PER_TOKEN else p
              for kind, p in zip(cfg.program.param_kinds, params)]
    context = RowContext(
        rows=sorted_rows,
        group_sizes=group_sizes,
        expert_of_row=expert_of_row,
        token_of_row=jnp.arange(sorted_rows.shape[0], dtype=jnp.int32),
    )

    def matmul(lhs, rhs, sizes, offset, preferred_element_type):
        return grouped_matmul(lhs, rhs, sizes, cfg.backend, offset, preferred_element_type)

    return evaluate(cfg.program, values, context, matmul)


def _num_rounds(counts, cfg: ExchangeConfig):
    """Rounds needed for the largest (source, destination) pair; the same on every rank."""
    pair_totals = counts.reshape(cfg.ep_size, cfg.ep_size, cfg.local_experts).sum(axis=2)
    return (jnp.max(pair_totals) + cfg.capacity - 1) // cfg.capacity


def _forward(cfg: ExchangeConfig, rows, payloads, params, counts, out_features: int, out_dtype):
    num_rows = rows.shape[0]

    def body(state):
        round_index, out = state
        plan = _round_plan(counts, round_index, num_rows, cfg)
        received = _dispatch(rows, plan, cfg)
        received_payloads = tuple(_dispatch(p, plan, cfg) for p in payloads)
        result = _local_program(cfg, plan.local_group_sizes, plan.local_expert_of_row,
                                received[plan.slot_of_position],
                                tuple(p[plan.slot_of_position] for p in received_payloads), params)
        result = result.astype(out_dtype)[plan.position_of_slot]
        return round_index + 1, _return_rows(result, out, plan, cfg)

    rounds = _num_rounds(counts, cfg)
    out = jnp.zeros((num_rows, out_features), out_dtype)
    _, out = jax.lax.while_loop(lambda s: s[0] < rounds, body, (jnp.zeros((), jnp.int32), out))
    return out


def _output_shape(cfg: ExchangeConfig, rows, payloads, params):
    """Feature count and dtype of the program's output rows (abstract evaluation, no FLOPs)."""
    group_sizes = jax.ShapeDtypeStruct((cfg.local_experts,), jnp.int32)
    expert_of_row = jax.ShapeDtypeStruct((rows.shape[0],), jnp.int32)
    shape = jax.eval_shape(functools.partial(_local_program, cfg), group_sizes, expert_of_row, rows, payloads, params)
    return shape.shape[1], shape.dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def exchange_expert_rows(cfg: ExchangeConfig, rows, payloads, params, counts):
    """Expert-program outputs for my sorted ``rows``, computed on the ranks that own their experts.

    ``rows [N, D]`` sorted by global expert (dropped copies last, never sent); ``payloads`` are
    per-row values of the program's ``PER_TOKEN`` inputs, in the same order; ``params`` the
    program inputs with expert-indexed ones sliced to this rank's experts; ``counts [ep, E]``
    the all-gathered group sizes. Rows that were not sent come back as zeros.
    """
    out_features, out_dtype = _output_shape(cfg, rows, payloads, params)
    return _forward(cfg, rows, payloads, params, counts, out_features, out_dtype)


def _exchange_fwd(cfg, rows, payloads, params, counts):
    return exchange_expert_rows(cfg, rows, payloads, params, counts), (rows, payloads, params, counts)


def _accumulator(p):
    return jnp.zeros(p.shape, jnp.float32) if jnp.issubdtype(p.dtype, jnp.floating) else None


def _exchange_bwd(cfg, residuals, d_out):
    rows, payloads, params, counts = residuals
    num_rows = rows.shape[0]

    def body(state):
        round_index, d_rows, d_payloads, d_params = state
        plan = _round_plan(counts, round_index, num_rows, cfg)
        sorted_rows = _dispatch(rows, plan, cfg)[plan.slot_of_position]
        sorted_payloads = tuple(_dispatch(p, plan, cfg)[plan.slot_of_position] for p in payloads)
        sorted_d_out = _dispatch(d_out, plan, cfg)[plan.slot_of_position]
        program = functools.partial(_local_program, cfg, plan.local_group_sizes, plan.local_expert_of_row)
        _, vjp = jax.vjp(program, sorted_rows, sorted_payloads, params)
        g_rows, g_payloads, g_params = vjp(sorted_d_out)
        d_rows = _return_rows(g_rows.astype(rows.dtype)[plan.position_of_slot], d_rows, plan, cfg)
        d_payloads = tuple(_return_rows(g.astype(p.dtype)[plan.position_of_slot], acc, plan, cfg)
                           for g, p, acc in zip(g_payloads, payloads, d_payloads))
        d_params = tuple(acc if acc is None else acc + g.astype(jnp.float32)
                         for acc, g in zip(d_params, g_params))
        return round_index + 1, d_rows, d_payloads, d_params

    init = (
        jnp.zeros((), jnp.int32),
        jnp.zeros_like(rows),
        tuple(jnp.zeros_like(p) for p in payloads),
        tuple(_accumulator(p) for p in params),
    )
    rounds = _num_rounds(counts, cfg)
    _, d_rows, d_payloads, d_params = jax.lax.while_loop(lambda s: s[0] < rounds, body, init)
    d_params = tuple(None if g is None else g.astype(p.dtype) for g, p in zip(d_params, params))
    return d_rows, d_payloads, d_params, None


exchange_expert_rows.defvjp(_exchange_fwd, _exchange_bwd)


def exchange_config(**kwargs: Any) -> ExchangeConfig:
    """Validated :class:`ExchangeConfig`."""
    cfg = ExchangeConfig(**kwargs)
    if cfg.transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {cfg.transport!r}")
    if cfg.capacity <= 0:
        raise ValueError(f"exchange capacity must be positive, got {cfg.capacity}")
    return cfg
