"""A training step whose layers are scanned over (``lax.scan`` over stacked weights: MaxText's
``scan_layers=True``) as StableHLO text, HLO text and the directory ``XLA_FLAGS=--xla_dump_to`` fills.
Its forward and backward scans arrive as while loops; the importer brings them back as scans
(``hlo/scan_loops.py``), the pass joins and proves them (``passes/scan_derivative.py``), and
``--verify`` checks the rewritten module against the original on random data. The report names the
region inside the joined forward and backward scans (``scan[i]+scan[j]``, rewritten backward too)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from moe_lowering import cli
from moe_lowering.testing import zoo

SIZES = zoo.Sizes(T=8, d=6, f=10, E=4, k=2)
LAYERS = 2


def scanned_step(model, forward_only=False):
    """``value_and_grad`` of a residual stack of ``model``'s layer scanned over its stacked weights, plus an
    SGD update (or the loss alone)."""
    def loss(params, x):
        h, _ = lax.scan(lambda h, p: (h + model.fn(p, h), None), x, params)
        return jnp.mean(jnp.sin(h) ** 2)

    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return loss if forward_only else step


def stacked_args(model):
    """Each layer's own weights stacked on a leading layer axis, and the tokens (numpy arrays)."""
    per_layer = [jax.tree.map(np.asarray, model.args(jax.random.key(i))) for i in range(LAYERS)]
    return jax.tree.map(lambda *w: np.stack(w), *[p for p, _ in per_layer]), per_layer[0][1]


@pytest.fixture(scope="module")
def model():
    return zoo.build_mixtral(SIZES)


def _rewrite(source, tmp_path):
    out, report = tmp_path / "out", tmp_path / "report.json"
    out = out if source.is_dir() else out.with_suffix(".mlir")
    code = cli.main([str(source), "-o", str(out), "--report", str(report), "-q", "--verify"])
    return code, json.loads(report.read_text()), out


def _assert_scanned_region(report, backward: bool):
    [region] = report["regions"]
    assert "scan[" in region["scope"], region["scope"]
    assert ("+scan[" in region["scope"]) == backward and region["backward"] == backward, region
    assert [m["rewritten"] for m in report["modules"] if m["regions"]] == [True], report["modules"]


def test_scanned_train_step_is_rewritten_forward_and_backward(model, tmp_path):
    """StableHLO text; HLO text as an XLA dump holds it is the last test's."""
    source = tmp_path / "step.mlir"
    source.write_text(jax.jit(scanned_step(model)).lower(*stacked_args(model)).as_text())
    code, report, out = _rewrite(source, tmp_path)
    assert code == 0, report
    _assert_scanned_region(report, backward=True)
    assert "moe_lowering_sparse_moe" in out.read_text()


def test_scanned_forward_is_rewritten(model, tmp_path):
    source = tmp_path / "forward.mlir"
    source.write_text(jax.jit(scanned_step(model, forward_only=True)).lower(*stacked_args(model)).as_text())
    code, report, out = _rewrite(source, tmp_path)
    assert code == 0, report
    _assert_scanned_region(report, backward=False)


def test_xla_dump_of_a_scanned_training_job_is_rewritten(model, tmp_path):
    """The directory ``XLA_FLAGS=--xla_dump_to=DIR`` fills while a scanned step runs, given to
    ``moe-rewrite DIR``. The step runs in a child process (the flag is read once per process), on the
    arguments this process wrote, so that it compiles the step alone."""
    dump, arrays = tmp_path / "dump", tmp_path / "args.npz"
    leaves, _ = jax.tree.flatten(stacked_args(model))
    np.savez(arrays, *leaves)
    job = textwrap.dedent(f"""
        import jax, numpy as np
        from moe_lowering.testing import zoo
        from test_scanned_train_step_dumps import SIZES, scanned_step, stacked_args
        model = zoo.build_mixtral(SIZES)
        tree = jax.tree.structure(jax.eval_shape(lambda: model.args(jax.random.key(0))))  # stacked_args' too
        with np.load({str(arrays)!r}) as saved:
            params, x = jax.tree.unflatten(tree, [saved[f"arr_{{i}}"] for i in range(len(saved.files))])
        print(jax.jit(scanned_step(model))(params, x)[0])
    """)
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), os.path.dirname(__file__)) if p)
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump}", "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", job], env=env, check=True, capture_output=True, timeout=300)
    steps = sorted(p.name for p in dump.glob("*.before_optimizations.txt"))
    assert [name for name in steps if "scanned_step" in name or "jit_step" in name], steps
    code, report, out = _rewrite(dump, tmp_path)
    assert code == 0, report
    _assert_scanned_region(report, backward=True)
    assert sorted(p.name for p in out.iterdir()) == steps


# Mutants of the backward loop's body: the silu's VJP with a term doubled, and the residual connection's
# cotangent sum (carried cotangent + the layer's input cotangent) with the carried one dropped.
MUTANTS = {
    "silu_vjp_term": (r"(%3 = stablehlo\.add )%1, %2( : tensor<8x4x10xf32>)", r"\1%1, %1\2"),
    "residual_sum": (r"(%\d+ = stablehlo\.add )%(?:iterArg_|arg)\d+, (%\d+)( : tensor<8x6xf32>)", r"\1\2, \2\3"),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_mutated_scanned_backward_declines(model, mutant, tmp_path):
    pattern, replacement = MUTANTS[mutant]
    text = jax.jit(scanned_step(model)).lower(*stacked_args(model)).as_text()
    found = list(re.finditer(pattern, text))  # the last is the backward's (in its loop, or the body it calls)
    assert found, mutant
    last = found[-1]
    source = tmp_path / "mutant.mlir"
    source.write_text(text[:last.start()] + last.expand(replacement) + text[last.end():])
    code, report, _ = _rewrite(source, tmp_path)
    assert code == 0 and not report["regions"], report
    assert "derivative" in json.dumps(report["near_misses"]), report
