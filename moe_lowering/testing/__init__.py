"""Test and benchmark support: the zoo of dense-reference MoE models (``moe_lowering.testing.zoo``)."""

from moe_lowering.testing.zoo import NEGATIVE, POSITIVE, ZOO, Sizes, ZooModel, expert_capacity

__all__ = ["NEGATIVE", "POSITIVE", "ZOO", "Sizes", "ZooModel", "expert_capacity"]
