"""Test and benchmark support: the zoo of dense-reference MoE models (``moe_lowering.testing.zoo``),
the zoo lowered to StableHLO / HLO text (``hlo_examples``) and the matcher's mutation tester
(``mutate``). Package code never imports this package (``tests/test_import_layers.py``)."""

from moe_lowering.testing.zoo import NEGATIVE, POSITIVE, ZOO, Sizes, ZooModel, expert_capacity

__all__ = ["NEGATIVE", "POSITIVE", "ZOO", "Sizes", "ZooModel", "expert_capacity"]
