"""What ``moe-rewrite`` prints: the dump-directory summary, verbosity, --version, --help,
``python -m moe_lowering``, and errors as one line through ``logging``."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys

import pytest

from moe_lowering import cli
from moe_lowering.testing import hlo_examples as examples

NEGATIVE_HLO = """HloModule jit_negate, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

ENTRY main.2 {
  x = f32[4,8]{1,0} parameter(0)
  ROOT negate.1 = f32[4,8]{1,0} negate(x)
}
"""

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, capsys):
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _python_m(*args, cwd=None):
    """``python -m ...`` importing this checkout's moe_lowering (whatever is installed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def mixtral_hlo():
    return examples.zoo_module_text("mixtral", "hlo")


def _dump(tmp_path, mixtral_hlo, negatives: int = 15):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "module_0000.jit_mixtral.before_optimizations.txt").write_text(mixtral_hlo)
    for i in range(1, negatives + 1):
        (dump / f"module_{i:04d}.jit_negate.before_optimizations.txt").write_text(NEGATIVE_HLO)
    return dump


# ------------------------------------------------------------------------------------------------
# A dump directory: one line per rewritten module, one for the rest.


def test_dump_directory_prints_one_line_per_rewrite_and_one_for_the_rest(tmp_path, capsys, mixtral_hlo):
    dump = _dump(tmp_path, mixtral_hlo)
    code, out, err = _run([dump, "-o", tmp_path / "out"], capsys)
    assert code == 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith(f"{dump / 'module_0000.jit_mixtral.before_optimizations.txt'}: rewritten: 1 MoE region at ")
    assert lines[1] == "15 modules without a MoE layer copied unchanged"
    assert len(list((tmp_path / "out").iterdir())) == 16


def test_dump_directory_verbose_has_per_module_detail(tmp_path, capsys, mixtral_hlo):
    dump = _dump(tmp_path, mixtral_hlo, negatives=2)
    code, _, err = _run([dump, "-o", tmp_path / "out", "-v"], capsys)
    assert code == 0
    for i in (1, 2):
        assert f"moe-rewrite: debug: {dump / f'module_{i:04d}.jit_negate.before_optimizations.txt'}: unchanged" in err
    assert "no routing decision" in err and "tokens=32 experts=8" in err
    assert err.strip().splitlines()[-1] == "2 modules without a MoE layer copied unchanged"


def test_dump_directory_quiet_prints_nothing(tmp_path, capsys, mixtral_hlo):
    dump = _dump(tmp_path, mixtral_hlo, negatives=2)
    code, out, err = _run([dump, "-o", tmp_path / "out", "-q"], capsys)
    assert code == 0 and out == "" and err == ""


def test_dump_directory_names_what_else_kept_modules_unchanged(tmp_path, capsys):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "module_0001.jit_negate.before_optimizations.txt").write_text(NEGATIVE_HLO)
    (dump / "module_0002.jit_attention.mlir").write_text(examples.zoo_module_text("topk_attention"))
    (dump / "module_0003.jit_broken.mlir").write_text("not a module\n")
    code, _, err = _run([dump, "-o", tmp_path / "out"], capsys)
    assert code == 0
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("moe-rewrite: warning: ") and "module_0003" in lines[0] and "copied unchanged" in lines[0]
    assert lines[1] == ("3 modules copied unchanged: 1 without a MoE layer, 1 whose routing did not match a MoE "
                        "layer (-v or --report says why), 1 that could not be rewritten (warned above)")


def test_single_module_keeps_the_full_summary(tmp_path, capsys, mixtral_hlo):
    source = tmp_path / "m.before_optimizations.txt"
    source.write_text(mixtral_hlo)
    code, _, err = _run([source, "-o", tmp_path / "o.txt"], capsys)
    assert code == 0
    assert err.startswith(f"{source}: rewritten\n") and "FLOPs: dense" in err


# ------------------------------------------------------------------------------------------------
# Logging: levels, one-line errors, the host's logging left as it was.


def test_errors_go_through_logging_once_and_logging_is_restored(tmp_path, capsys):
    root_stream = io.StringIO()
    root_handler = logging.StreamHandler(root_stream)
    logging.getLogger().addHandler(root_handler)
    package = logging.getLogger("moe_lowering")
    before = (package.level, package.propagate, list(package.handlers), logging.getLogger("moe_lowering.cli").level)
    try:
        code, _, err = _run([tmp_path / "missing.mlir", "-o", tmp_path / "o.mlir"], capsys)
    finally:
        logging.getLogger().removeHandler(root_handler)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("moe-rewrite: error: ") and "cannot read" in err
    assert root_stream.getvalue() == ""  # not printed twice by a host application's handlers
    assert (package.level, package.propagate, list(package.handlers),
            logging.getLogger("moe_lowering.cli").level) == before


def test_verbose_internal_error_prints_the_traceback_then_one_line(tmp_path, capsys, monkeypatch):
    from moe_lowering.hlo import rewrite as rewrite_mod

    def broken(module, context, *, backend="auto"):
        raise RuntimeError("matcher exploded")

    monkeypatch.setattr(rewrite_mod, "rewrite_module", broken)
    source = tmp_path / "m.before_optimizations.txt"
    source.write_text(NEGATIVE_HLO)
    code, _, err = _run([source, "-o", tmp_path / "o.txt", "-v"], capsys)
    assert code == 3
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1] == "moe-rewrite: internal error: RuntimeError: matcher exploded"


def test_quiet_and_verbose_together_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["x.mlir", "-q", "-v"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe-rewrite: error: ") and "(see moe-rewrite --help)" in err


# ------------------------------------------------------------------------------------------------
# --version, --help, python -m moe_lowering.


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"moe-rewrite \(moe_lowering\) \S+, jax \S+, jaxlib \S+\n", out), out
    assert f"jax {metadata.version('jax')}" in out
    try:
        assert f"(moe_lowering) {metadata.version('moe_lowering')}," in out
    except metadata.PackageNotFoundError:
        pass


def test_version_without_installed_metadata(monkeypatch):
    from importlib import metadata

    import moe_lowering

    real = metadata.version

    def version(name):
        if name == "moe_lowering":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    assert cli.version_string().startswith(f"moe-rewrite (moe_lowering) {moe_lowering.__version__}, jax ")


def test_help_reads_well():
    parser = cli.build_parser()
    for action in parser._actions:
        assert action.help and len(action.help) > 10, action.option_strings
    text = parser.format_help()
    assert text.startswith("usage: moe-rewrite ")
    for needle in ("exit status:", "examples:", "stderr:", "--version", "(no location in the module)", "130"):
        assert needle in text, needle
    codes = re.findall(r"^  (\d+) ", text.split("exit status:")[1].split("examples:")[0], re.M)
    assert codes == ["0", "1", "2", "3", "130"]


def test_python_m_moe_lowering_help_names_itself(tmp_path):
    run = _python_m("moe_lowering", "--help", cwd=tmp_path)
    assert run.returncode == 0 and run.stderr == ""
    assert run.stdout.startswith("usage: python -m moe_lowering ")
    assert "exit status:" in run.stdout and "moe-rewrite model.mlir" in run.stdout


def test_python_m_moe_lowering_runs_the_cli(tmp_path):
    source = tmp_path / "m.before_optimizations.txt"
    source.write_text(NEGATIVE_HLO)
    out = tmp_path / "o.txt"
    run = _python_m("moe_lowering", str(source), "-o", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert out.read_text() == NEGATIVE_HLO
    assert run.stderr.startswith(f"{source}: unchanged\n")

    version = _python_m("moe_lowering", "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("moe-rewrite (moe_lowering) ")

    usage = _python_m("moe_lowering", "--frobnicate", cwd=tmp_path)
    assert usage.returncode == 2 and usage.stdout == ""
    assert usage.stderr.count("\n") == 1 and "(see python -m moe_lowering --help)" in usage.stderr


def test_unavailable_backend_is_a_one_line_usage_error(tmp_path, capsys):
    import jax

    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("the Triton backend may run here")
    source = tmp_path / "m.before_optimizations.txt"
    source.write_text(NEGATIVE_HLO)
    code, out, err = _run([source, "-o", tmp_path / "o.txt", "--backend", "triton"], capsys)
    assert code == 2 and out == "" and not (tmp_path / "o.txt").exists()
    assert err.count("\n") == 1 and err.startswith("moe-rewrite: error: --backend triton: "), err
