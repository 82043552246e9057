"""Sharded lowering of the sparse MoE: expert-parallel exchange and FSDP weight gathers (FP8 optional)."""

from moe_lowering.parallel.capacity import drop_over_capacity, expert_capacity
from moe_lowering.parallel.layout import Layout, UnsupportedLayout, plan_layout
from moe_lowering.parallel.quantize import WEIGHT_GATHER_QUANTS
from moe_lowering.parallel.sharded_moe import ShardedMoEStats, sharded_sparse_moe

__all__ = [
    "Layout",
    "ShardedMoEStats",
    "UnsupportedLayout",
    "WEIGHT_GATHER_QUANTS",
    "drop_over_capacity",
    "expert_capacity",
    "plan_layout",
    "sharded_sparse_moe",
]
