"""Optional expert capacity: which token copies a capacity-limited MoE drops, deterministically.

Semantics (shared by the single-device helper and the sharded lowering): expert ``e`` keeps the
first ``capacity`` copies routed to it in token-major order (token ``t``'s choice ``j`` comes
at flat position ``t * top_k + j``); later copies are dropped and contribute nothing. In the
sharded lowering the order is the global token order, so a device first learns how many copies
of each expert the devices before it hold (an all-gather of ``[E]`` counts).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moe_lowering.sparse_moe import sort_by_expert


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Copies each expert may take: ``ceil(capacity_factor * tokens * top_k / experts)``.

    Args:
        num_tokens: Tokens ``T`` routed.
        top_k: Experts each token is routed to.
        num_experts: ``E``.
        capacity_factor: The capacity relative to a perfectly balanced split (1.0: exactly
            balanced, higher: slack for skew).

    Returns:
        The capacity, at least 1.

    Raises:
        ValueError: ``capacity_factor`` is not positive.

    Examples:
        >>> from moe_lowering.parallel import expert_capacity
        >>> expert_capacity(num_tokens=8, top_k=2, num_experts=4, capacity_factor=1.25)
        5
    """
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def _rank_within_expert(expert_indices, num_experts: int):
    """Flat ``[T * k]`` expert ids (E for invalid ones) and each copy's rank among its expert's copies."""
    routing = sort_by_expert(expert_indices, num_experts)
    flat = expert_indices.reshape(-1).astype(jnp.int32)
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(routing.group_sizes)])
    rank = routing.inverse.reshape(-1) - starts[flat]
    return flat, rank, routing.group_sizes


def drop_over_capacity(expert_indices, num_experts: int, capacity: int, earlier_counts=None):
    """``expert_indices`` with copies over ``capacity`` set to -1 (dropped), and how many were dropped.

    Each expert keeps its first ``capacity`` copies in token-major order (see the module docstring).

    Args:
        expert_indices: ``[T, k]`` expert choices; indices outside ``[0, num_experts)`` are
            dropped already and are not counted.
        num_experts: ``E``.
        capacity: Copies each expert keeps (``expert_capacity``).
        earlier_counts: ``[E]`` copies of each expert that come before these tokens in the global
            order (held by other devices); ``None`` on a single device.

    Returns:
        ``(kept, dropped)``: the ``[T, k]`` indices with dropped copies set to -1, and the number
        of copies dropped (an int32 scalar).

    Examples:
        >>> import jax.numpy as jnp
        >>> from moe_lowering.parallel import drop_over_capacity
        >>> kept, dropped = drop_over_capacity(jnp.array([[0, 1], [0, 1], [0, 2]]), num_experts=3, capacity=2)
        >>> kept.tolist(), int(dropped)
        ([[0, 1], [0, 1], [-1, 2]], 1)
    """
    flat, rank, _ = _rank_within_expert(expert_indices, num_experts)
    if earlier_counts is not None:
        rank = rank + jnp.take(earlier_counts, flat, mode="fill", fill_value=0)
    valid = flat < num_experts
    keep = valid & (rank < capacity)
    kept = jnp.where(keep, flat, -1).reshape(expert_indices.shape)
    return kept, jnp.sum(valid & ~keep, dtype=jnp.int32)


def local_expert_counts(expert_indices, num_experts: int):
    """Copies of each expert among these tokens, ``[E]`` int32."""
    flat = expert_indices.reshape(-1).astype(jnp.int32)
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    return jnp.zeros((num_experts + 1,), jnp.int32).at[flat].add(1)[:num_experts]


def earlier_device_counts(local_counts, axes: tuple[str, ...]):
    """Per-expert copies held by the devices before this one along ``axes`` (inside ``shard_map``)."""
    every = jax.lax.all_gather(local_counts, axes)  # [devices, E], major-to-minor over ``axes``
    me = jax.lax.axis_index(axes)
    before = jnp.arange(every.shape[0]) < me
    return jnp.sum(jnp.where(before[:, None], every, 0), axis=0)
