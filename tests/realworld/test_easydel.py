"""EasyDeL 0.3.0's MoE blocks with ``moe_method="dense_moe"``, rewritten as shipped.

Tiny configs of Mixtral, Qwen2-MoE (with its sigmoid-gated shared expert), DeepSeek-V2
(group-limited greedy routing, one shared expert) and DeepSeek-V3 (noaux_tc gate), float32,
``precision=HIGHEST``. What EasyDeL computes is what is tested, quirks included: ``dense_moe``
renormalises the top-k weights whatever the model's ``norm_topk_prob`` (so DeepSeek-V2's
routed scaling factor cancels), it hands the *softmaxed* router output to DeepSeek-V2's selection
hook, which softmaxes it again, and 0.3.0's DeepSeek-V3 gate returns the top-k *values*
[tokens, k], which ``dense_moe`` softmaxes and top-k's again as if they were expert logits (so
only experts 0..k-1 are ever used). Expert weights are gathered per token (``jnp.take(w, idx)``:
``[tokens, k, d, f]``) rather than applied to every token.
EasyDeL's other MoE methods need Pallas/GPU kernels, so there is no second reference here.
"""

from __future__ import annotations

import functools

import pytest

from rw_check import check_rewritten_exactly
from rw_layers import EASYDEL_CASES, easydel_layer


@functools.cache
def layer(case):
    return easydel_layer(case)


@pytest.mark.parametrize("case", EASYDEL_CASES)
def test_rewritten_exactly(case):
    check_rewritten_exactly(layer(case))
