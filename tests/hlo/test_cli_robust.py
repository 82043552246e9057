"""``moe-rewrite`` on hostile input and hostile output paths: the exit contract holds.

Input that crashes jaxlib's native parser is invalid input (exit 2, one line), valid modules with
unusual contents (complex constants, composites) are rewritten, and outputs are all-or-nothing,
with the mode a plain write gives them.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import pytest

from moe_lowering import cli
from moe_lowering.hlo import _compat, isolated
from moe_lowering.testing import hlo_examples as examples

# HLO text that jaxlib's parser or HLO -> StableHLO converter handles with a fatal CHECK / LLVM
# ERROR instead of an error (SIGABRT), in some or all supported jaxlib versions.
CRASHING_HLO = {
    # openxla/xla#46955: HloInstruction::CreateReshape CHECKs the element count; the text parser
    # called it unguarded before the fix (a parse error since).
    "reshape_element_count": """HloModule seed_reshape
ENTRY main {
  a = f32[4,8] parameter(0)
  ROOT result = f32[31] reshape(a)
}
""",
    # hlo_computation.cc: Check failed: param_no >= 0 && param_no < parameter_count
    "parameter_out_of_range": """HloModule m
ENTRY main {
  a = f32[4] parameter(3)
  ROOT r = f32[4] negate(a)
}
""",
    # hlo_to_stablehlo: "LLVM ERROR: Failed to infer result type(s)."
    "tuple_index_out_of_range": """HloModule m
ENTRY main {
  a = (f32[4], f32[4]) parameter(0)
  ROOT r = f32[4] get-tuple-element(a), index=5
}
""",
}


def _run(args, capsys):
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-rewrite: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def mixtral_hlo():
    return examples.zoo_module_text("mixtral", "hlo")


@pytest.fixture(scope="module")
def mixtral_text():
    return examples.zoo_module_text("mixtral", "stablehlo")


# ------------------------------------------------------------------------------------------------
# 1. Native crashes in the parser are invalid input.


@pytest.mark.parametrize("name", list(CRASHING_HLO))
def test_hlo_that_crashes_jaxlib_exits_2_with_one_line(name, tmp_path, capsys):
    source = tmp_path / "bad.before_optimizations.txt"
    source.write_text(CRASHING_HLO[name])
    target, report = tmp_path / "out.txt", tmp_path / "report.json"
    code, out, err = _run([source, "-o", target, "--report", report], capsys)  # this process survives
    assert code == 2, err
    line = _one_error_line(err)
    assert line.startswith(f"moe-rewrite: error: {source}: invalid HLO: "), line
    assert out == "" and not target.exists() and not report.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.before_optimizations.txt"]  # no temporaries


def test_crash_message_names_the_problem(tmp_path, capsys):
    source = tmp_path / "bad.txt"
    source.write_text(CRASHING_HLO["parameter_out_of_range"])
    code, _, err = _run([source, "-o", tmp_path / "out.txt"], capsys)
    line = _one_error_line(err)
    assert code == 2 and "parameter" in line, line


def test_console_script_survives_a_parser_crash(tmp_path):
    """As a user runs it: a separate process, which must not die of SIGABRT itself."""
    source = tmp_path / "bad.txt"
    source.write_text(CRASHING_HLO["tuple_index_out_of_range"])
    run = subprocess.run([sys.executable, "-m", "moe_lowering.cli", str(source), "-o", str(tmp_path / "o.txt")],
                         capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "invalid HLO" in run.stderr, run.stderr


def test_crashing_module_in_a_dump_directory_is_copied_unchanged(mixtral_hlo, tmp_path, capsys):
    dump = tmp_path / "dump"
    dump.mkdir()
    good = dump / "module_0001.jit_mixtral.before_optimizations.txt"
    bad = dump / "module_0002.jit_bad.before_optimizations.txt"
    good.write_text(mixtral_hlo)
    bad.write_text(CRASHING_HLO["parameter_out_of_range"])
    code, _, err = _run([dump, "-o", tmp_path / "out", "--report", tmp_path / "r.json", "-q"], capsys)
    assert code == 0, err
    assert (tmp_path / "out" / bad.name).read_bytes() == bad.read_bytes()
    assert "moe_lowering_sparse_moe" in (tmp_path / "out" / good.name).read_text() or \
        (tmp_path / "out" / good.name).read_text().startswith("HloModule")
    modules = json.loads((tmp_path / "r.json").read_text())["modules"]
    assert [m["rewritten"] for m in modules] == [True, False]
    assert "invalid HLO" in modules[1]["skipped"] and "skipped" not in modules[0]


def test_worker_restarts_after_a_crash(mixtral_hlo):
    with isolated.Worker() as worker:
        with pytest.raises(isolated.IsolatedError) as caught:
            worker.check_module(CRASHING_HLO["tuple_index_out_of_range"], "hlo")
        assert caught.value.crashed and "SIGABRT" in str(caught.value)
        with pytest.raises(isolated.IsolatedError) as caught:  # an ordinary parse error: no crash
            worker.check_module("HloModule m\nENTRY main {\n  ROOT x = f32[4] frobnicate()\n}\n", "hlo")
        assert not caught.value.crashed
        # The same bytecode the in-process converter makes: a valid module round-trips as before.
        assert worker.check_module(mixtral_hlo, "hlo") == _compat.hlo_text_to_stablehlo_bytecode(mixtral_hlo)
        assert worker.check_module(mixtral_hlo, "hlo") != b""  # still the same worker
        assert worker.stablehlo_to_hlo_text(examples.zoo_module_text("mixtral")).startswith("HloModule")


def test_invalid_stablehlo_is_still_reported_with_its_line(mixtral_text, tmp_path, capsys):
    source = tmp_path / "bad.mlir"
    source.write_text(mixtral_text.replace("stablehlo.exponential", "stablehlo.frobnicate", 1))
    code, _, err = _run([source, "-o", tmp_path / "o.mlir"], capsys)
    line = _one_error_line(err)
    assert code == 2 and f"{source}: line " in line and "frobnicate" in line, line


# ------------------------------------------------------------------------------------------------
# 2. Valid modules with unusual contents beside a MoE are rewritten, not internal errors.


def _mixtral_with(extra):
    """The mixtral zoo model, with ``extra(out) -> outputs`` applied to its result, lowered."""
    from moe_lowering.testing.zoo import ZOO

    model = ZOO["mixtral"]
    params, x = model.args(jax.random.key(0), jnp.float32)
    flat, tree = jax.tree.flatten((params, x))

    def fn(*leaves):
        return extra(model.fn(*jax.tree.unflatten(tree, leaves)))

    return jax.jit(fn).lower(*flat)


def _complex_beside(out):
    return out, jnp.real(out.astype(jnp.complex64) * jnp.complex64(1 + 2j))


def _composite_beside(out):
    scaled_tanh = jax.lax.composite(lambda y, *, scale: jnp.tanh(y) * scale, name="my.scaled_tanh", version=2)
    return scaled_tanh(out, scale=2.0) + 1


@pytest.mark.parametrize("kind", ["stablehlo", "hlo"])
@pytest.mark.parametrize("extra,marker", [
    (_complex_beside, "complex"),
    (_composite_beside, "composite"),
])
def test_unusual_ops_beside_a_moe_are_kept_and_the_moe_rewritten(extra, marker, kind, tmp_path, capsys):
    lowered = _mixtral_with(extra)
    text = lowered.as_text() if kind == "stablehlo" else lowered.compiler_ir("hlo").as_hlo_text()
    if kind == "stablehlo":
        assert ("dense<(1.000000e+00,2.000000e+00)> : tensor<complex<f32>>" in text if marker == "complex"
                else 'stablehlo.composite "my.scaled_tanh"' in text)
    source = tmp_path / ("in.mlir" if kind == "stablehlo" else "in.before_optimizations.txt")
    source.write_text(text)
    out, report = tmp_path / "out.mlir", tmp_path / "report.json"
    code, _, err = _run([source, "-o", out, "--report", report, "--verify", "--backend", "xla", "--emit", "stablehlo"],
                        capsys)
    assert code == 0, err
    assert "rewritten" in err and "verify: ok" in err, err
    assert len(json.loads(report.read_text())["regions"]) == 1
    written = out.read_text()
    assert "moe_lowering_sparse_moe" in written
    if marker == "complex":
        assert "dense<(1.000000e+00,2.000000e+00)> : tensor<complex<f32>>" in written
    else:  # the composite survives as a composite, with its attributes, version and decomposition
        line = next(l for l in written.splitlines() if "stablehlo.composite" in l)
        assert '"my.scaled_tanh"' in line and "scale = 2.000000e+00 : f64" in line and "version = 2" in line, line
        decomposition = line.split("decomposition = @")[1].split(",")[0].split("}")[0].strip()
        assert f"func.func private @{decomposition}(" in written


def test_composite_module_round_trips_as_hlo(tmp_path, capsys):
    lowered = _mixtral_with(_composite_beside)
    source = tmp_path / "in.before_optimizations.txt"
    source.write_text(lowered.compiler_ir("hlo").as_hlo_text())
    code, _, err = _run([source, "-o", tmp_path / "out.txt", "-q"], capsys)
    assert code == 0, err
    written = (tmp_path / "out.txt").read_text()
    assert written.startswith("HloModule") and "is_composite=true" in written
    assert 'composite.name="my.scaled_tanh"' in written and 'composite.version="2"' in written


# ------------------------------------------------------------------------------------------------
# 3. Outputs are checked first and written all or nothing.


def _must_not_rewrite(monkeypatch):
    from moe_lowering.hlo import rewrite as rewrite_mod

    def fail(*_, **__):
        raise AssertionError("the rewrite ran although an output path was bad")

    monkeypatch.setattr(rewrite_mod, "rewrite_module", fail)


@pytest.mark.parametrize("bad", ["parent_is_a_file", "is_a_directory"])
def test_unwritable_report_writes_nothing_and_fails_before_the_rewrite(bad, mixtral_text, tmp_path, capsys,
                                                                       monkeypatch):
    source = tmp_path / "m.mlir"
    source.write_text(mixtral_text)
    if bad == "parent_is_a_file":
        (tmp_path / "file").write_text("x")
        report = tmp_path / "file" / "report.json"
    else:
        report = tmp_path / "reports"
        report.mkdir()
    _must_not_rewrite(monkeypatch)
    target = tmp_path / "out.mlir"
    code, out, err = _run([source, "-o", target, "--report", report], capsys)
    assert code == 2
    line = _one_error_line(err)
    assert f"cannot write {report}" in line, line
    assert not target.exists() and out == ""


def test_unwritable_output_writes_no_report(mixtral_text, tmp_path, capsys, monkeypatch):
    source = tmp_path / "m.mlir"
    source.write_text(mixtral_text)
    (tmp_path / "file").write_text("x")
    _must_not_rewrite(monkeypatch)
    code, _, err = _run([source, "-o", tmp_path / "file" / "o.mlir", "--report", tmp_path / "r.json"], capsys)
    assert code == 2 and "cannot write" in _one_error_line(err)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("args", [
    ["-o", "{d}/same.mlir", "--report", "{d}/same.mlir"],
    ["--report", "-"],
    ["-o", "{d}"],
])
def test_conflicting_outputs_exit_2(args, mixtral_text, tmp_path, capsys, monkeypatch):
    source = tmp_path / "m.mlir"
    source.write_text(mixtral_text)
    _must_not_rewrite(monkeypatch)
    code, _, err = _run([source] + [a.format(d=tmp_path) for a in args], capsys)
    assert code == 2, err
    _one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.mlir"]


NEGATE_HLO = """HloModule jit_negate, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

ENTRY main.2 {
  x = f32[4,8]{1,0} parameter(0)
  ROOT negate.1 = f32[4,8]{1,0} negate(x)
}
"""


@pytest.mark.parametrize("form", ["existing", "trailing_slash_existing", "trailing_slash_new", "new_nested"])
def test_output_directory_receives_the_module_under_its_name(form, tmp_path, capsys):
    """``-o DIR`` (existing) or ``-o DIR/`` (made if missing) writes ``DIR/<input's name>``, not a file ``DIR``."""
    source = tmp_path / "negate.txt"
    source.write_text(NEGATE_HLO)
    out = tmp_path / ("out" if form != "new_nested" else "new/nested")
    if form.endswith("existing"):
        out.mkdir()
    target = str(out) + (os.sep if form != "existing" else "")
    code, _, err = _run([source, "-o", target, "-q"], capsys)
    assert code == 0, err
    assert out.is_dir() and sorted(p.name for p in out.iterdir()) == ["negate.txt"]
    assert (out / "negate.txt").read_text() == NEGATE_HLO  # nothing to rewrite: copied byte for byte


@pytest.mark.parametrize("option", ["-o", "--report"])
def test_file_output_into_a_missing_directory_is_an_error(option, tmp_path, capsys):
    """A file path whose directory does not exist is refused with one line (a typo must not grow a tree)."""
    source = tmp_path / "negate.txt"
    source.write_text(NEGATE_HLO)
    target = tmp_path / "missing" / "o.txt"
    args = [source, "-o", tmp_path / "o.txt", "--report", target] if option == "--report" else [source, "-o", target]
    code, _, err = _run(args, capsys)
    assert code == 2
    line = _one_error_line(err)
    assert f"cannot write {target}: no directory {tmp_path / 'missing'}" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["negate.txt"]


def _dump_with_two_modules(tmp_path, mixtral_hlo):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "module_0001.jit_a.before_optimizations.txt").write_text(mixtral_hlo)
    (dump / "module_0002.jit_b.before_optimizations.txt").write_text(examples.zoo_module_text("topk_attention", "hlo"))
    return dump


def test_dump_directory_second_output_in_the_way_leaves_nothing(mixtral_hlo, tmp_path, capsys, monkeypatch):
    dump = _dump_with_two_modules(tmp_path, mixtral_hlo)
    out = tmp_path / "out"
    (out / "module_0002.jit_b.before_optimizations.txt").mkdir(parents=True)  # a directory where a file goes
    _must_not_rewrite(monkeypatch)
    code, _, err = _run([dump, "-o", out, "-q"], capsys)
    assert code == 2 and "module_0002" in _one_error_line(err)
    assert [p.name for p in out.iterdir()] == ["module_0002.jit_b.before_optimizations.txt"]


def test_dump_directory_failure_while_writing_rolls_back(mixtral_hlo, tmp_path, capsys, monkeypatch):
    """The second file fails after the first was renamed into place: the first is restored."""
    dump = _dump_with_two_modules(tmp_path, mixtral_hlo)
    out = tmp_path / "out"
    out.mkdir()
    first = out / "module_0001.jit_a.before_optimizations.txt"
    first.write_text("the previous output\n")
    real_replace = os.replace
    calls = []

    def replace_failing_second(src, dst):
        calls.append(dst)
        if str(dst).endswith("module_0002.jit_b.before_optimizations.txt"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(cli.os, "replace", replace_failing_second)
    code, _, err = _run([dump, "-o", out, "--report", tmp_path / "r.json", "-q"], capsys)
    assert code == 2, err
    line = _one_error_line(err)
    assert "module_0002" in line and "No space left on device" in line, line
    assert any(str(c).endswith("module_0001.jit_a.before_optimizations.txt") for c in calls)  # it was committed
    assert first.read_text() == "the previous output\n"  # ... and restored
    assert sorted(p.name for p in out.iterdir()) == [first.name]  # no temporaries, no second file
    assert not (tmp_path / "r.json").exists()


def test_new_output_directories_are_removed_on_failure(mixtral_text, tmp_path, capsys, monkeypatch):
    source = tmp_path / "m.mlir"
    source.write_text(mixtral_text)
    real_replace = os.replace

    def replace_failing_report(src, dst):
        if str(dst).endswith("r.json"):
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(cli.os, "replace", replace_failing_report)
    code, _, err = _run([source, "-o", f"{tmp_path / 'new' / 'deep'}{os.sep}", "--report", tmp_path / "r.json"], capsys)
    assert code == 2 and "Input/output error" in _one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.mlir"]


# ------------------------------------------------------------------------------------------------
# 4. Output modes: what a plain write would give.


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_outputs_get_the_umask_mode(umask, mixtral_text, tmp_path, capsys):
    source = tmp_path / "m.mlir"
    source.write_text(mixtral_text)
    neg = tmp_path / "neg.mlir"
    neg.write_text(examples.zoo_module_text("ensemble_average"))
    (tmp_path / "sub").mkdir()  # a file output into a missing directory is an error (test_cli_output.py)
    old = os.umask(umask)
    try:
        assert _run([source, "-o", tmp_path / "o.mlir", "--report", tmp_path / "sub" / "r.json", "-q"], capsys)[0] == 0
        assert _run([neg, "-o", tmp_path / "neg.out.mlir", "-q"], capsys)[0] == 0  # copied unchanged
    finally:
        os.umask(old)
    for name in ("o.mlir", "sub/r.json", "neg.out.mlir"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o666 & ~umask, name


def test_replaced_output_keeps_its_mode(mixtral_text, tmp_path, capsys):
    source = tmp_path / "m.mlir"
    source.write_text(mixtral_text)
    target = tmp_path / "o.mlir"
    target.write_text("old")
    os.chmod(target, 0o640)
    assert _run([source, "-o", target, "-q"], capsys)[0] == 0
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640 and "moe_lowering_sparse_moe" in target.read_text()


def test_output_through_a_symlink_replaces_the_file_it_names(mixtral_text, tmp_path, capsys):
    source = tmp_path / "m.mlir"
    source.write_text(mixtral_text)
    real = tmp_path / "real.mlir"
    real.write_text("old")
    link = tmp_path / "link.mlir"
    link.symlink_to(real)
    assert _run([source, "-o", link, "-q"], capsys)[0] == 0
    assert link.is_symlink() and "moe_lowering_sparse_moe" in real.read_text()


def test_output_to_a_fifo_is_written_directly(mixtral_text, tmp_path, capsys):
    """Not a regular file (a FIFO here; /dev/null, /dev/stdout alike): written through, never
    renamed over. (A FIFO in tmp_path, so that a regression cannot replace a real device.)"""
    source = tmp_path / "m.mlir"
    source.write_text(mixtral_text)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    try:
        assert _run([source, "-o", fifo, "--report", tmp_path / "r.json", "-q"], capsys)[0] == 0
    finally:
        reader.join(5)
        if reader.is_alive():  # the CLI never opened the FIFO: unblock the reader, never blocking here
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader left after all
                pass
        reader.join(10)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still the FIFO, not a file renamed over it
    assert b"moe_lowering_sparse_moe" in received[0]
    assert json.loads((tmp_path / "r.json").read_text())["modules"][0]["rewritten"] is True


# ------------------------------------------------------------------------------------------------
# Help and usage errors.


def test_help_documents_the_contract():
    run = subprocess.run([sys.executable, "-m", "moe_lowering.cli", "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stderr == ""
    for needle in ("exit status", "0666 less the umask", "nothing written", "rerun with -v", "child process"):
        assert needle in run.stdout, needle


@pytest.mark.parametrize("argv", [[], ["x.mlir", "--emit", "llvm"], ["x.mlir", "--frobnicate"]])
def test_usage_errors_are_one_line_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    _one_error_line(captured.err)
    assert captured.out == ""


def test_missing_input_is_one_line_exit_2(tmp_path, capsys):
    code, _, err = _run([tmp_path / "nope.mlir", "-o", tmp_path / "o.mlir"], capsys)
    assert code == 2 and "cannot read" in _one_error_line(err)
    assert not (tmp_path / "o.mlir").exists()
