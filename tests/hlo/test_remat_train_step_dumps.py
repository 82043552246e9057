"""A training step whose layer is under ``jax.checkpoint`` as StableHLO and HLO text: lowered, the remat is
the layer's forward recomputed in the backward from the outputs of an ``optimization_barrier`` on its
operands. The analysis reads through the barrier (``merged_recomputation``), so the recomputation merges
with the forward and the backward is proven and rewritten as for a traced remat. A recomputation that is
not the forward's must not merge; a barrier no recomputation reads through is kept."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from moe_lowering import cli
from moe_lowering.hlo import _compat
from moe_lowering.hlo.verify import random_inputs
from moe_lowering.testing import zoo

MIXTRAL = zoo.build_mixtral(zoo.Sizes(T=8, d=6, f=10, E=4, k=2))
POLICIES = {"nothing_saveable": jax.checkpoint_policies.nothing_saveable,
            "dots_saveable": jax.checkpoint_policies.dots_saveable}
BARRIER = "stablehlo.optimization_barrier"


def remat_step(policy, scanned=False, fenced_output=False):
    """The loss and its gradients with respect to the weights and the tokens, the layer under
    ``jax.checkpoint(policy=policy)`` (``scanned``: a residual stack of it scanned over stacked weights); with
    ``fenced_output`` the tokens behind a barrier of the user's too."""
    layer = jax.checkpoint(MIXTRAL.fn, policy=policy)

    def loss(params, x):
        h = lax.scan(lambda h, p: (h + layer(p, h), None), x, params)[0] if scanned else x + layer(params, x)
        return jnp.mean(jnp.sin(h) ** 2)

    def step(params, x):
        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
        return (value, grads, lax.optimization_barrier(x) * 2.0) if fenced_output else (value, grads)

    return step


def _lowered(step, scanned=False):
    params, x = MIXTRAL.args(jax.random.key(0), jnp.float32)
    if scanned:  # two layers' weights, stacked
        params = jax.tree.map(lambda *w: jnp.stack(w), params, MIXTRAL.args(jax.random.key(1), jnp.float32)[0])
    return jax.jit(step).lower(params, x)


def _rewrite(source, tmp_path):
    out, report = tmp_path / "out.mlir", tmp_path / "report.json"
    code = cli.main([str(source), "-o", str(out), "--report", str(report), "-q", "--verify"])
    return code, json.loads(report.read_text()), out


def _assert_same_outputs(original: str, rewritten: str, in_avals):
    """Every output (loss, all gradients) of both modules on random inputs, float32 tight."""
    run_original, run_rewritten = _compat.compile_stablehlo(original), _compat.compile_stablehlo(rewritten)
    for seed in range(3):
        inputs = random_inputs(in_avals, seed)
        expected, got = run_original(inputs), run_rewritten(inputs)
        assert len(expected) == len(got)
        for want, have in zip(expected, got):
            np.testing.assert_allclose(have, want, rtol=2e-5, atol=2e-6 * float(np.max(np.abs(want))))


def _in_avals(lowered):
    return jax.tree.leaves(lowered.in_avals)


@pytest.mark.parametrize("scanned", [False, True], ids=["unscanned", "scanned"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_remat_step_stablehlo_is_rewritten_forward_and_backward(policy, scanned, tmp_path):
    lowered = _lowered(remat_step(POLICIES[policy], scanned), scanned)
    text = lowered.as_text()
    assert BARRIER in text
    source = tmp_path / "step.mlir"
    source.write_text(text)
    code, report, out = _rewrite(source, tmp_path)
    assert code == 0, report
    assert [r["backward"] for r in report["regions"]] == [True], report
    assert ("+scan[" in report["regions"][0]["scope"]) == scanned, report  # the forward and backward scans joined
    rewritten = out.read_text()
    assert "moe_lowering_sparse_moe" in rewritten and BARRIER not in rewritten
    _assert_same_outputs(text, rewritten, _in_avals(lowered))


def test_remat_step_hlo_text_is_rewritten_forward_and_backward(tmp_path):
    source = tmp_path / "module_0001.jit_step.before_optimizations.txt"
    source.write_text(_lowered(remat_step(POLICIES["nothing_saveable"])).compiler_ir("hlo").as_hlo_text())
    code, report, _ = _rewrite(source, tmp_path)
    assert code == 0, report  # --verify: the rewritten module agrees with the original
    assert [r["backward"] for r in report["regions"]] == [True], report


# Mutants of the recomputation behind the barrier (its first op of the kind): the softmax's max started from 0
# instead of -inf (the same routing, computed otherwise), and the gate projection recomputed from the up weights.
RECOMPUTATION_MUTANTS = {
    "max_init": (r"dense<0xFF800000>", "dense<0.000000e+00>"),
    "gate_weights": (r"(dot_general %\d+#4, %\d+#)2\b", r"\g<1>3"),
}


@pytest.mark.parametrize("scanned", [False, True], ids=["unscanned", "scanned"])
@pytest.mark.parametrize("mutant", list(RECOMPUTATION_MUTANTS))
def test_a_recomputation_other_than_the_forward_is_not_merged(mutant, scanned, tmp_path):
    pattern, replacement = RECOMPUTATION_MUTANTS[mutant]
    lowered = _lowered(remat_step(POLICIES["nothing_saveable"], scanned), scanned)
    text = lowered.as_text()
    forward, recomputation = text.split(BARRIER)
    mutated, count = re.subn(pattern, replacement, recomputation, count=1)
    assert count == 1, mutant
    source = tmp_path / "mutant.mlir"
    source.write_text(forward + BARRIER + mutated)
    code, report, out = _rewrite(source, tmp_path)
    assert code == 0, report  # --verify: the rewritten module agrees with the mutant
    assert not any(r["backward"] for r in report["regions"]), report
    if report["regions"]:  # the forward alone, its dense backward and the barrier before it kept
        assert BARRIER in out.read_text()
        _assert_same_outputs(source.read_text(), out.read_text(), _in_avals(lowered))


def test_a_barrier_no_recomputation_reads_through_is_kept(tmp_path):
    lowered = _lowered(remat_step(POLICIES["nothing_saveable"], fenced_output=True))
    text = lowered.as_text()
    assert text.count(BARRIER) == 2
    source = tmp_path / "step.mlir"
    source.write_text(text)
    code, report, out = _rewrite(source, tmp_path)
    assert code == 0, report
    assert [r["backward"] for r in report["regions"]] == [True], report
    rewritten = out.read_text()
    assert rewritten.count(BARRIER) == 1  # the remat's merged away, the user's on the tokens kept
    _assert_same_outputs(text, rewritten, _in_avals(lowered))
