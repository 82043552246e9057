"""``moe_optimize(capacity_factor=...)``: opt-in, deterministic token dropping, reported."""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_lowering import explain, moe_optimize
from moe_lowering.testing.zoo import ZOO


def _dropping_reference(params, x, k, capacity):
    """Mixtral in numpy: expert e keeps its first ``capacity`` copies in (token, choice) order."""
    probs = np.asarray(jax.nn.softmax(x @ params["router"]), np.float64)
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, idx, axis=-1)
    weights /= weights.sum(-1, keepdims=True)
    out = np.zeros(x.shape, np.float64)
    taken = np.zeros(probs.shape[-1], int)
    for t in range(x.shape[0]):
        for j in range(k):
            e = idx[t, j]
            if taken[e] >= capacity:
                continue
            taken[e] += 1
            xt = np.asarray(x[t], np.float64)
            gate = xt @ np.asarray(params["w_gate"][e], np.float64)
            hidden = gate / (1 + np.exp(-gate)) * (xt @ np.asarray(params["w_up"][e], np.float64))
            out[t] += weights[t, j] * (hidden @ np.asarray(params["w_down"][e], np.float64))
    return out


def test_capacity_factor_drops_like_the_reference_and_logs(caplog):
    model = ZOO["mixtral"]
    params, x = model.args(jax.random.key(0))
    s = model.sizes
    factor = 0.75
    capacity = math.ceil(factor * s.T * s.k / s.E)
    dropping = moe_optimize(model.fn, capacity_factor=factor)
    assert explain(dropping, params, x).regions[0].capacity == capacity
    with caplog.at_level(logging.INFO, logger="moe_lowering"):
        got = jax.jit(dropping)(params, x)
        jax.block_until_ready(got)
    np.testing.assert_allclose(np.asarray(got), _dropping_reference(params, x, s.k, capacity), rtol=1e-4, atol=1e-5)
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert dropped and dropped[-1].startswith(f"capacity_factor={factor} dropped ")
    assert not np.allclose(np.asarray(got), np.asarray(model.fn(params, x)), atol=1e-4)  # something was dropped


def test_capacity_factor_is_validated():
    with pytest.raises(ValueError, match="capacity_factor must be positive or None"):
        moe_optimize(lambda x: x, capacity_factor=0)
