"""``moe-rewrite`` on ``jax.export``'s modules (issue 33): the StableHLO portable artifact
(``Exported.mlir_module_serialized``, versioned VHLO bytecode whose ``lax.top_k`` is a
``chlo.top_k`` composite) and a serialized ``Exported`` (``Exported.serialize()``, a flatbuffer)
are read as the StableHLO they hold, rewritten and verified like any module."""

from __future__ import annotations

import json

import jax
import pytest

from moe_lowering import cli
from moe_lowering.testing.zoo import ZOO

MODEL = ZOO["mixtral"].sized(T=16, d=8, f=16, E=4, k=2)


@pytest.fixture(scope="module")
def exported():
    return jax.export.export(jax.jit(MODEL.fn))(*MODEL.args(jax.random.key(0)))


def _rewrite(source, tmp_path, capsys):
    out, report = tmp_path / "out.mlir", tmp_path / "report.json"
    code = cli.main([str(source), "-o", str(out), "--report", str(report), "--verify", "--backend", "xla"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "verify: ok" in err
    assert len(json.loads(report.read_text())["regions"]) == 1
    assert "moe_lowering_sparse_moe" in out.read_text()


def test_portable_artifact_is_rewritten(exported, tmp_path, capsys):
    source = tmp_path / "exported.mlirbc"
    source.write_bytes(exported.mlir_module_serialized)
    _rewrite(source, tmp_path, capsys)


def test_serialized_exported_is_rewritten(exported, tmp_path, capsys):
    pytest.importorskip("flatbuffers")  # what jax.export's (de)serializer needs
    source = tmp_path / "exported.bin"
    source.write_bytes(exported.serialize())
    _rewrite(source, tmp_path, capsys)


def test_other_binary_input_is_a_one_line_error(tmp_path, capsys):
    source = tmp_path / "junk.bin"
    source.write_bytes(b"not a module\x00\x01\x02")
    assert cli.main([str(source), "-o", str(tmp_path / "out.mlir")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{source}: " in err
    assert "not a serialized jax.export module" in err or "flatbuffers" in err
