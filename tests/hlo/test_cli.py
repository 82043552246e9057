"""``moe-rewrite`` end to end: formats, reports, --verify, directories, and malformed input."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from moe_lowering import cli
from moe_lowering.testing import hlo_examples as examples
from moe_lowering.hlo.rewrite import RewriteResult


@pytest.fixture(scope="module")
def mixtral_text():
    return examples.zoo_module_text("mixtral", "stablehlo")


def _run(args, capsys):
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name,kind,dtype", [
    ("mixtral", "stablehlo", jnp.float32),
    ("two_layers", "hlo", jnp.float32),
    ("deepseek_v3", "hlo", jnp.float32),
    ("switch", "stablehlo", jnp.bfloat16),
])
def test_rewrite_and_verify(name, kind, dtype, tmp_path, capsys):
    source = tmp_path / ("in.before_optimizations.txt" if kind == "hlo" else "in.mlir")
    lowered, _ = examples.zoo_lowered(name, dtype)
    source.write_text(lowered.as_text() if kind == "stablehlo" else lowered.compiler_ir("hlo").as_hlo_text())
    out, report = tmp_path / "out", tmp_path / "report.json"
    code, _, err = _run([source, "-o", out, "--report", report, "--verify", "--backend", "xla"], capsys)
    assert code == 0, err
    assert "verify: ok" in err and "rewritten" in err
    data = json.loads(report.read_text())
    from moe_lowering.testing.zoo import ZOO
    assert len(data["regions"]) == ZOO[name].expected_regions
    assert {"tokens", "experts", "top_k", "dense_flops", "rewritten_flops"} <= set(data["regions"][0])
    assert data["modules"][0]["verify"]["ok"] is True
    written = out.read_text()
    assert written.startswith("HloModule") if kind == "hlo" else "moe_lowering_sparse_moe" in written


def test_negative_is_copied_byte_for_byte(tmp_path, capsys):
    source = tmp_path / "neg.mlir"
    source.write_text(examples.zoo_module_text("ensemble_average"))
    code, _, err = _run([source, "-o", tmp_path / "out.mlir", "--verify"], capsys)
    assert code == 0 and "unchanged" in err
    assert (tmp_path / "out.mlir").read_bytes() == source.read_bytes()


def test_stdout_and_emit_hlo(mixtral_text, tmp_path, capsys):
    source = tmp_path / "m.mlir"
    source.write_text(mixtral_text)
    code, out, _ = _run([source, "--emit", "hlo", "-q"], capsys)
    assert code == 0 and out.startswith("HloModule")


def test_dump_directory(tmp_path, capsys):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "module_0001.jit_mixtral.before_optimizations.txt").write_text(examples.zoo_module_text("mixtral", "hlo"))
    (dump / "module_0002.jit_neg.before_optimizations.txt").write_text(examples.zoo_module_text("topk_attention", "hlo"))
    (dump / "module_0001.jit_mixtral.after_optimizations.txt").write_text("not ours")
    code, _, err = _run([dump, "-o", tmp_path / "out", "--report", tmp_path / "r.json", "-q"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert [m["rewritten"] for m in report["modules"]] == [True, False]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "module_0001.jit_mixtral.before_optimizations.txt", "module_0002.jit_neg.before_optimizations.txt"]


def test_verify_mismatch_exits_1(mixtral_text, tmp_path, capsys, monkeypatch):
    """A rewrite that computes something else must be caught by --verify."""
    from moe_lowering.hlo import rewrite as rewrite_mod

    real = rewrite_mod.rewrite_module

    def wrong_rewrite(module, context, *, backend="auto"):
        result = real(module, context, backend=backend)
        program = result.program
        doubled = jax.jit(lambda *a: [2 * o for o in program.fn(*a)]).lower(*program.in_avals).as_text()
        return RewriteResult(doubled, result.report, program)

    monkeypatch.setattr(rewrite_mod, "rewrite_module", wrong_rewrite)
    source = tmp_path / "m.mlir"
    source.write_text(mixtral_text)
    code, _, err = _run([source, "-o", tmp_path / "o.mlir", "--verify"], capsys)
    assert code == 1 and "MISMATCH" in err


def _mutations(text: str) -> dict[str, str]:
    return {
        "truncated_early": text[: len(text) // 5],
        "truncated_late": text[: len(text) - 40],
        "wrong_result_type": text.replace("-> tensor<32x8xf32>", "-> tensor<32x8xi32>", 1),
        "wrong_operand_count": text.replace("stablehlo.dot_general %arg4, %arg0", "stablehlo.dot_general %arg4", 1),
        "unknown_op": text.replace("stablehlo.exponential", "stablehlo.frobnicate", 1),
        "unknown_dialect": text.replace("stablehlo.exponential", "madeup.exponential", 1),
        "undefined_value": text.replace("%arg4, %arg0", "%arg4, %nope", 1),
        "garbage": "\x00\x01binary junk\xff",
        "empty": "",
        "hlo_truncated": "HloModule jit_f\n\nENTRY main {\n  x = f32[4] parameter(0)\n  ROOT y = f32[4] add(x, ",
        "prose": "this is not a module\n",
    }


@pytest.mark.parametrize("mutation", list(_mutations("x")))
def test_malformed_input_exits_2_with_one_line(mutation, mixtral_text, tmp_path, capsys):
    mutated = _mutations(mixtral_text)[mutation]
    assert mutated != mixtral_text
    source = tmp_path / "bad.mlir"
    source.write_bytes(mutated.encode("utf-8", "surrogateescape"))
    target = tmp_path / "out.mlir"
    code, out, err = _run([source, "-o", target], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-rewrite: error: ") and str(source) in lines[0], err
    assert "Traceback" not in err and not target.exists() and out == ""


def test_console_script_help():
    run = subprocess.run([sys.executable, "-m", "moe_lowering.cli", "--help"], capture_output=True, text=True)
    assert run.returncode == 0
    assert "--verify" in run.stdout and "exit status" in run.stdout


def test_missing_directory_output(tmp_path, capsys):
    code, _, err = _run([tmp_path], capsys)
    assert code == 2 and "-o OUTPUT_DIR" in err


def test_internal_error_is_one_line_exit_3(mixtral_text, tmp_path, capsys, monkeypatch):
    from moe_lowering.hlo import rewrite as rewrite_mod

    def broken(module, context, *, backend="auto"):
        raise RuntimeError("matcher exploded\nsecond line")

    monkeypatch.setattr(rewrite_mod, "rewrite_module", broken)
    source = tmp_path / "m.mlir"
    source.write_text(mixtral_text)
    code, _, err = _run([source, "-o", tmp_path / "o.mlir"], capsys)
    assert code == 3 and err.strip() == (
        "moe-rewrite: internal error: RuntimeError: matcher exploded (rerun with -v for the traceback)")
    assert not (tmp_path / "o.mlir").exists()
