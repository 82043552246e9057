"""Regions are reported at the module's own source locations, never at a line of the importer."""

from __future__ import annotations

import json
import re

import jax
import pytest
from jax._src import source_info_util
from jaxlib.mlir import ir

from moe_lowering import cli
from moe_lowering.hlo import _compat
from moe_lowering.testing import hlo_examples as examples
from moe_lowering.hlo.importer import import_module
from moe_lowering.hlo.locations import NO_LOCATION, Locations, SourceLocation, parse_location


@pytest.mark.parametrize("text,expected", [
    ('loc("model.py":42:7)', SourceLocation("model.py", 42, 7)),
    ('loc("model.py":42:7 to :30)', SourceLocation("model.py", 42, 7)),
    ('loc("model.py":42:7 to 44:2)', SourceLocation("model.py", 42, 7)),
    # JAX without full tracebacks: the op's name stack around the file.
    ('loc("jit(f)/top_k"("model.py":42:7))', SourceLocation("model.py", 42, 7, op_name="jit(f)/top_k")),
    # JAX's full tracebacks: the callee end of the call chain, with its function.
    ('loc("jit(f)/top_k"(callsite("Moe.route"("/src/model.py":42:7 to :30) at callsite('
     '"step"("/src/train.py":10:4) at "<module>"("/src/run.py":3:0)))))',
     SourceLocation("/src/model.py", 42, 7, "Moe.route", "jit(f)/top_k")),
    ('loc("top_k:"("jit(f)/top_k"("route"("m.py":5:2))))', SourceLocation("m.py", 5, 2, "route", "jit(f)/top_k")),
    # An XLA dump's metadata={op_name=... source_file=... source_line=...}, converted.
    ('loc(fused["jit(f)/top_k", "/src/model.py":42:0])', SourceLocation("/src/model.py", 42, 0, op_name="jit(f)/top_k")),
    ('loc("jit(f)/neg")', SourceLocation(op_name="jit(f)/neg")),
    ('loc("a\\"b\\\\c.py":1:2)', SourceLocation('a"b\\c.py', 1, 2)),
    # Nothing: unknown, the parser's own place in the IR text, unreadable syntax.
    ("loc(unknown)", None),
    ('loc("-":3:8)', None),
    ("loc(#loc3)", None),
    ('loc(callsite("f"("m.py":1:2) at', None),
])
def test_parse_location(text, expected):
    assert parse_location(text) == expected


@pytest.mark.parametrize("location,described", [
    (SourceLocation("/src/model.py", 42, 7, "Moe.route", "jit(f)/top_k"), "/src/model.py:42:7 (Moe.route)"),
    (SourceLocation("/src/model.py", 42, 0, op_name="jit(f)/top_k"), "/src/model.py:42 (jit(f)/top_k)"),
    (SourceLocation("model.py", 42, 7), "model.py:42:7"),
    (SourceLocation("model.py", 0, 0, "f"), "model.py (f)"),
    (SourceLocation(op_name="jit(f)/top_k"), "jit(f)/top_k"),
    (SourceLocation(), NO_LOCATION),
])
def test_describe(location, described):
    assert location.describe() == described


@pytest.mark.parametrize("line,column", [(1, 0), (1, 1), (2, 5), (42, 7), (100000, 300)])
def test_traceback_frame_is_exact(line, column):
    """JAX's own summary of the captured frame reads as the location, every line and column."""
    location = SourceLocation("/src/model.py", line, column, "Moe.route")
    locations = Locations()
    traceback = locations.traceback(location)
    info = source_info_util.SourceInfo(traceback, source_info_util.NameStack())
    assert source_info_util.summarize(info) == location.describe()
    assert locations.labels == {}  # nothing to relabel: the frame says it all


MODULE = """\
module @jit_f {
  func.func public @main(%arg0: tensor<4x8xf32>) -> (tensor<4x2xf32>, tensor<4x8xf32>, tensor<4x8xf32>) {
    %values, %indices = chlo.top_k(%arg0, k = 2) : tensor<4x8xf32> -> (tensor<4x2xf32>, tensor<4x2xi32>) loc(#top_k)
    %0 = stablehlo.negate %arg0 : tensor<4x8xf32> loc("jit(f)/neg")
    %1 = stablehlo.exponential %arg0 : tensor<4x8xf32>
    return %values, %0, %1 : tensor<4x2xf32>, tensor<4x8xf32>, tensor<4x8xf32>
  }
}
#top_k = loc("jit(f)/top_k"(callsite("Moe.route"("/src/model.py":42:7) at "step"("/src/train.py":10:4))))
"""


def test_traced_eqns_carry_the_module_locations():
    with _compat.make_ir_context():
        program = import_module(ir.Module.parse(MODULE))
    jaxpr = jax.make_jaxpr(program.fn)(*program.in_avals).jaxpr
    where = {eqn.primitive.name: source_info_util.summarize(eqn.source_info) for eqn in jaxpr.eqns}
    assert where["top_k"] == "/src/model.py:42:7 (Moe.route)"
    # What a Python frame cannot say is relabelled in reports.
    labels = program.locations.labels
    assert labels[where["neg"]] == "jit(f)/neg"
    assert labels[where["exp"]] == NO_LOCATION
    assert not any("importer.py" in w or "locations.py" in w for w in where.values()), where


def _run(args, capsys):
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _rewrite(text: str, suffix: str, tmp_path, capsys) -> tuple[dict, str]:
    source = tmp_path / f"in{suffix}"
    source.write_text(text)
    report = tmp_path / "report.json"
    code, _, err = _run([source, "-o", tmp_path / f"out{suffix}", "--report", report], capsys)
    assert code == 0, err
    data = json.loads(report.read_text())
    assert "importer.py" not in report.read_text() + err and "locations.py" not in report.read_text() + err
    return data, err


@pytest.fixture(scope="module")
def mixtral():
    lowered, _ = examples.zoo_lowered("mixtral")
    return lowered


def test_stablehlo_with_debug_info_names_the_users_line(mixtral, tmp_path, capsys):
    data, err = _rewrite(mixtral.as_text(debug_info=True), ".mlir", tmp_path, capsys)
    (region,) = data["regions"]
    assert re.fullmatch(r".*moe_lowering/testing/zoo\.py:\d+:\d+ \(_softmax_topk_renormalise\)", region["location"])
    assert f"at {region['location']}" in err


def test_stablehlo_without_locations_says_so(mixtral, tmp_path, capsys):
    data, err = _rewrite(mixtral.as_text(), ".mlir", tmp_path, capsys)
    assert data["regions"][0]["location"] == NO_LOCATION
    assert f"at {NO_LOCATION}:" in err


def _hlo_with_topk_metadata(mixtral, metadata: str) -> str:
    text = mixtral.compiler_ir("hlo").as_hlo_text()
    text, count = re.subn(r"( topk\([^\n]*)", lambda m: m.group(1) + f", metadata={{{metadata}}}", text, count=1)
    assert count == 1
    return text


def test_hlo_metadata_source_file_and_line(mixtral, tmp_path, capsys):
    text = _hlo_with_topk_metadata(mixtral, 'op_name="jit(mixtral)/top_k" source_file="/src/model.py" source_line=42')
    data, err = _rewrite(text, ".before_optimizations.txt", tmp_path, capsys)
    assert data["regions"][0]["location"] == "/src/model.py:42 (jit(mixtral)/top_k)"
    assert "at /src/model.py:42 (jit(mixtral)/top_k):" in err


def test_hlo_metadata_op_name_only(mixtral, tmp_path, capsys):
    text = _hlo_with_topk_metadata(mixtral, 'op_name="jit(mixtral)/top_k"')
    data, _ = _rewrite(text, ".before_optimizations.txt", tmp_path, capsys)
    assert data["regions"][0]["location"] == "jit(mixtral)/top_k"


def test_hlo_dump_with_stack_frames(mixtral, tmp_path, capsys):
    """Newer XLA dumps keep the call stack in tables (stack_frame_id=...): the innermost frame."""
    module = mixtral.compiler_ir("hlo").get_hlo_module()
    text = module.to_string()
    if "stack_frame_id" not in text:
        pytest.skip("this jaxlib prints no stack frames in HLO metadata")
    data, _ = _rewrite(text, ".before_optimizations.txt", tmp_path, capsys)
    assert re.fullmatch(r".*zoo\.py:\d+:\d+ \(_softmax_topk_renormalise\)", data["regions"][0]["location"])


def test_near_miss_names_the_users_line(tmp_path, capsys):
    lowered, _ = examples.zoo_lowered("topk_attention")
    data, err = _rewrite(lowered.as_text(debug_info=True), ".mlir", tmp_path, capsys)
    assert not data["regions"]
    (near,) = data["near_misses"]
    assert re.fullmatch(r".*zoo\.py:\d+:\d+ \(_topk_attention_fn\.<locals>\.topk_attention\)", near["location"])
    assert near["location"] in near["routing"] and near["location"] in err


def test_near_miss_without_locations_is_relabelled_everywhere(tmp_path, capsys):
    """The routing description and the reason embed the location too."""
    data, err = _rewrite(examples.zoo_module_text("topk_attention"), ".mlir", tmp_path, capsys)
    (near,) = data["near_misses"]
    assert near["location"] == NO_LOCATION and f"at {NO_LOCATION}" in near["routing"]
    assert "<no location in the module>" not in json.dumps(data) + err


@pytest.mark.parametrize("location", [
    SourceLocation(op_name="jit(f)/top_k"),
    SourceLocation(),
    SourceLocation("/src/model.py", 0, 0, "Moe.route"),  # a file without a line
    SourceLocation(jax.__file__, 12, 3, "jax_internal"),  # a file JAX's summaries skip as its own
    SourceLocation("/src/model.py", 42, 100000, "wide"),  # a column too wide to place
])
def test_what_a_frame_cannot_say_is_relabelled(location):
    locations = Locations()
    traceback = locations.traceback(location)
    summary = source_info_util.summarize(source_info_util.SourceInfo(traceback, source_info_util.NameStack()))
    assert summary and "locations.py" not in summary
    assert locations.labels.get(summary, summary) == location.describe()
