"""The README's code runs as written: its first snippet, and its logging recipe prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE)


def readme_section(title: str) -> str:
    """The text under the README's ``## title`` heading, up to the next ``## `` heading."""
    readme = (ROOT / "README.md").read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", readme, flags=re.DOTALL | re.MULTILINE)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def first_snippet() -> str:
    return python_blocks((ROOT / "README.md").read_text())[0]


def test_first_snippet_runs_as_written_and_rewrites():
    namespace = {"__name__": "readme_snippet"}
    exec(compile(first_snippet(), "README.md (first python block)", "exec"), namespace)
    layer, params, x, y = (namespace[name] for name in ("moe_layer", "params", "x", "y"))
    dense = layer.__moe_original__(params, x)
    assert jnp.allclose(y, dense, rtol=1e-5, atol=1e-5)
    from moe_lowering import explain

    assert len(explain(layer, params, x).regions) == 1


def test_logging_recipe_prints_the_rewrite_and_its_timings():
    """The recipe, then the first snippet and an eager call, in a fresh interpreter (pytest's own log
    handlers would hide a recipe that configures nothing): its INFO lines reach stderr."""
    (recipe,) = python_blocks(readme_section("Logging"))
    script = f"{recipe}\n{first_snippet()}\nmoe_layer(params, x)  # eager: compiled by moe_optimize itself\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert "moe_lowering: tracing moe_layer" in lines, result.stderr
    assert any(re.fullmatch(r"moe_lowering: rewrote 1 MoE region\(s\) in moe_layer \(traced in .*\)", line)
               for line in lines), result.stderr
    assert any(re.fullmatch(r"moe_lowering: moe_layer: rewritten program lowered in .*, compiled in .*", line)
               for line in lines), result.stderr
    assert not [line for line in lines if line.count("moe_lowering") > 1], result.stderr  # the name once, from %(name)s
