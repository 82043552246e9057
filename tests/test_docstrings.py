"""The public API's docstrings, as the API reference renders them (Google style): every public
function and class has them with Args (each of its arguments), Returns, Examples, and the
examples run (doctest) on a CPU in a few seconds.

Public: what ``moe_lowering`` and ``moe_lowering.parallel`` (the sharded layer) export, and the
single-device layer and backend choice the docs point to.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import inspect
import io
import re

import pytest

import moe_lowering
import moe_lowering.parallel

PUBLIC = [f"moe_lowering.{name}" for name in moe_lowering.__all__] + [
    f"moe_lowering.parallel.{name}" for name in moe_lowering.parallel.__all__] + [
    "moe_lowering.sparse_moe.sparse_moe",
    "moe_lowering.kernels.get_backend",
    "moe_lowering.kernels.BackendUnavailable",
]


def resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def documented_objects() -> list[str]:
    """The public functions and classes (the ``Literal`` option types are documented where they
    are defined, as attribute docstrings, which do not exist at run time)."""
    return [name for name in PUBLIC if inspect.isfunction(resolve(name)) or inspect.isclass(resolve(name))]


def google_sections(doc: str) -> dict[str, str]:
    """``{section: body}`` of a Google-style docstring: a line ``Name:`` at the left margin starts
    a section, which holds the indented lines after it."""
    sections, current = {}, None
    for line in doc.splitlines():
        header = re.fullmatch(r"([A-Z][a-z]+):", line)
        if header:
            current = header.group(1)
            sections[current] = ""
        elif current is not None and (line.startswith(" ") or not line):
            sections[current] += line + "\n"
        else:
            current = None
    return sections


def documented_names(section: str) -> set[str]:
    """The names an Args or Attributes section describes (``name: text``, ``*args: text``)."""
    return set(re.findall(r"^    \**(\w+)(?: \([^)]*\))?:", section, re.MULTILINE))


def test_google_sections_reads_a_docstring():
    doc = inspect.cleandoc('''Summary.

        Args:
            fn: A function.
            *args: Its arguments,
                over two lines.

        Returns:
            Something.
        Not a section: prose.
        ''')
    sections = google_sections(doc)
    assert set(sections) == {"Args", "Returns"}
    assert documented_names(sections["Args"]) == {"fn", "args"}
    assert documented_names("    x: 1\n        y: not an entry\n") == {"x"}


def test_public_names_resolve():
    assert len(documented_objects()) >= 15


@pytest.mark.parametrize("name", documented_objects())
def test_public_docstring_is_google_style(name):
    obj = resolve(name)
    doc = inspect.getdoc(obj)
    assert doc, f"{name} has no docstring"
    sections = google_sections(doc)
    assert "Examples" in sections and ">>> " in sections["Examples"], f"{name}: no Examples section with a doctest"
    if inspect.isfunction(obj):
        arguments = set(inspect.signature(obj).parameters)
        if arguments:
            assert "Args" in sections, f"{name}: no Args section"
            assert documented_names(sections["Args"]) == arguments, f"{name}: Args do not match the signature"
        assert "Returns" in sections, f"{name}: no Returns section"
    elif dataclasses.is_dataclass(obj):
        fields = {f.name for f in dataclasses.fields(obj)}
        assert documented_names(sections.get("Attributes", "")) == fields, f"{name}: Attributes do not match its fields"


def modules_to_doctest() -> list[str]:
    return sorted({resolve(name).__module__ for name in documented_objects()})


@pytest.mark.parametrize("module", modules_to_doctest())
def test_examples_run(module):
    """Every docstring example of the modules that define the public names (theirs and the rest)."""
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report = io.StringIO()
    for test in doctest.DocTestFinder().find(importlib.import_module(module)):
        runner.run(test, out=report.write)
    failed, attempted = runner.summarize(verbose=False)
    assert attempted and not failed, report.getvalue()
