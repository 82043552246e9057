"""docs/performance.md is what tools/perf_page.py writes from the committed results (an edited
result, or an edited page, fails here until the page is regenerated), and its plots are there."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _perf_page():
    spec = importlib.util.spec_from_file_location("perf_page", ROOT / "tools" / "perf_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_the_generated_one():
    committed = (ROOT / "docs" / "performance.md").read_text()
    assert committed == _perf_page().render_markdown(), "run: python tools/perf_page.py"


def test_the_page_shows_its_plots_and_names_its_sources():
    page = (ROOT / "docs" / "performance.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\((img/[^)]+\.png)\)", page)
    assert len(images) >= 3, images
    assert all((ROOT / "docs" / image).is_file() for image in images), images
    assert all((ROOT / "benchmarks" / "results" / name).is_file()
               for name in re.findall(r"benchmarks/results/([\w.-]+)", page))
