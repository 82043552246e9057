"""A jitted training step (value_and_grad of a loss over the Mixtral layer, plus an SGD update) as
StableHLO text, HLO text and an XLA dump directory: the layer's forward and its autodiff backward are
rewritten together, and ``--verify`` checks the module against the original numerically."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from moe_lowering import cli
from moe_lowering.testing import zoo

MIXTRAL = zoo.build_mixtral(zoo.Sizes(T=16, d=8, f=12, E=4, k=2))


def _step(params, x):
    loss, grads = jax.value_and_grad(lambda p, y: jnp.mean(jnp.sin(MIXTRAL.fn(p, y)) ** 2))(params, x)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.fixture(scope="module")
def lowered():
    return jax.jit(_step).lower(*MIXTRAL.args(jax.random.key(0), jnp.float32))


def _rewrite(source, tmp_path):
    out, report = tmp_path / "out.mlir", tmp_path / "report.json"
    code = cli.main([str(source), "-o", str(out), "--report", str(report), "-q", "--verify"])
    return code, json.loads(report.read_text()), out


@pytest.mark.parametrize("kind", ["stablehlo", "hlo", "dump_dir"])
def test_train_step_is_rewritten_forward_and_backward(lowered, kind, tmp_path):
    if kind == "stablehlo":
        source = tmp_path / "step.mlir"
        source.write_text(lowered.as_text())
    else:
        source = tmp_path / "dump" if kind == "dump_dir" else tmp_path
        source.mkdir(exist_ok=True)
        source = source / "module_0001.jit__step.before_optimizations.txt"
        source.write_text(lowered.compiler_ir("hlo").as_hlo_text())
        if kind == "dump_dir":
            source = source.parent
    code, report, out = _rewrite(source, tmp_path)
    assert code == 0, report
    assert len(report["regions"]) == 1, report
    written = [f.read_text() for f in out.iterdir()] if out.is_dir() else [out.read_text()]
    assert any("moe_lowering_sparse_moe" in text for text in written)
    assert "backward" in json.dumps(report), report


SUMMED = "%3 = stablehlo.add %1, %2 : tensor<16x4x12xf32>"  # the silu's VJP: ct * s + (ct * x) * s(1 - s)
MUTANTS = {
    "wrong_term": "%3 = stablehlo.add %1, %1 : tensor<16x4x12xf32>",
    "scaled_cotangent": "%s = stablehlo.add %1, %2 : tensor<16x4x12xf32>\n    "
                        "%3 = stablehlo.add %s, %s : tensor<16x4x12xf32>",
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_mutated_silu_backward_declines_with_the_use(lowered, mutant, tmp_path):
    text = lowered.as_text()
    assert text.count(SUMMED) == 1
    source = tmp_path / "mutant.mlir"
    source.write_text(text.replace(SUMMED, MUTANTS[mutant]))
    code, report, _ = _rewrite(source, tmp_path)
    assert code == 0, report
    assert not report["regions"], report
    assert "not the derivative of the layer" in json.dumps(report["near_misses"]), report
