"""The package's import layers, read from the source (AST, function-level imports included).

The package is layered (``cli -> hlo -> api -> passes -> parallel -> sparse_moe -> kernels``, the
kernel operations below them all), and these tests hold the layering in place:

* no import cycle among the package's parts: its subpackages at every depth (``kernels``,
  ``kernels.grouped_matmul``, ...) and its top-level modules (``api``, ``sparse_moe``, ...);
* nothing outside ``moe_lowering.testing`` imports ``moe_lowering.testing`` (package code never
  depends on the test zoo);
* ``moe_lowering.kernels`` imports nothing else of the package: it is the lowest layer.

An import counts wherever it stands (module top, inside a function, under ``if TYPE_CHECKING``),
and so does a string constant naming a package module (``importlib.import_module("...")``, a
table of lazy imports). The checker's own pieces are tested on small synthetic graphs and
packages, so a broken checker cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "moe_lowering"


# --- reading the imports ------------------------------------------------------------------------


def module_files(package_dir: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module below ``package_dir`` (itself a package)."""
    root = package_dir.parent
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_package(modules: dict[str, Path], name: str) -> bool:
    return name in modules and modules[name].name == "__init__.py"


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """``(module of the package imported, line)`` for every import in ``path``, at any depth."""
    root = next(iter(modules)).split(".")[0]
    package = name if _is_package(modules, name) else name.rpartition(".")[0]
    found = []

    def add(target: str, line: int) -> None:
        # The longest prefix that is a module of the package: ``from a.b import c`` names module
        # ``a.b.c`` when there is one, else the module ``a.b`` (``c`` is a name in it).
        parts = target.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in modules:
                found.append((candidate, line))
                return

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == root:
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != root:
                continue
            for alias in node.names:
                add(f"{source}.{alias.name}", node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in modules:  # importlib.import_module("moe_lowering.x"), tables of lazy imports
            add(node.value, node.lineno)
    return found


def part_of(name: str, modules: dict[str, Path]) -> str:
    """The part of the package a module belongs to: its innermost package, except that a module
    directly in the top package is a part of its own (``moe_lowering.api``)."""
    if _is_package(modules, name) or "." not in name:
        return name
    parent = name.rpartition(".")[0]
    return name if "." not in parent else parent


def import_edges(package_dir: Path) -> dict[tuple[str, str], list[str]]:
    """``{(importing part, imported part): ["module:line", ...]}`` between different parts."""
    modules = module_files(package_dir)
    edges = defaultdict(list)
    for name, path in modules.items():
        for target, line in imported_modules(name, path, modules):
            source_part, target_part = part_of(name, modules), part_of(target, modules)
            where = f"{path.relative_to(package_dir.parent)}:{line}"
            if source_part != target_part and where not in edges[source_part, target_part]:
                edges[source_part, target_part].append(where)
    return dict(edges)


def module_imports(package_dir: Path) -> list[tuple[str, str, str]]:
    """``(importing module, imported module, "file:line")`` for every import of the package."""
    modules = module_files(package_dir)
    return [(name, target, f"{path.relative_to(package_dir.parent)}:{line}")
            for name, path in modules.items() for target, line in imported_modules(name, path, modules)]


# --- finding cycles -----------------------------------------------------------------------------


def find_cycles(edges) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) for each strongly connected group of nodes that has one."""
    graph = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
        graph.setdefault(target, set())
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def connect(node):  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph[node]:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_through(min(group), group, graph) for group in groups]


def _cycle_through(start, group, graph) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``group`` (breadth first)."""
    previous = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & group):
                if successor == start:
                    path = [node]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if successor not in previous:
                    previous[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def _describe(cycle, edges) -> str:
    steps = [f"  {a} -> {b}  ({', '.join(edges[a, b][:3])})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


# --- the package's layers -----------------------------------------------------------------------

KERNELS = "moe_lowering.kernels"
TESTING = "moe_lowering.testing"


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_no_import_cycle_among_the_packages_parts():
    edges = import_edges(PACKAGE_DIR)
    assert (KERNELS, f"{KERNELS}.grouped_matmul") in edges or edges, "the walker found no imports at all"
    cycles = find_cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(_describe(cycle, edges) for cycle in cycles)


def test_package_code_never_imports_the_testing_package():
    offenders = [f"{where}: {source} imports {target}" for source, target, where in module_imports(PACKAGE_DIR)
                 if _within(target, TESTING) and not _within(source, TESTING)]
    assert not offenders, "\n".join(offenders)


def test_kernels_are_the_lowest_layer():
    """``kernels`` imports nothing of the package outside itself (``parallel``, ``passes``,
    ``hlo``, ``api``, ``cli`` above all) but the version shims, which import nothing of it."""
    imports = module_imports(PACKAGE_DIR)
    assert any(_within(source, KERNELS) for source, _, _ in imports), "the walker found no kernel imports"
    shims = f"{KERNELS.rsplit('.', 1)[0]}._compat"
    offenders = [f"{where}: {source} imports {target}" for source, target, where in imports
                 if (_within(source, KERNELS) and not _within(target, KERNELS) and target != shims)
                 or (source == shims and target.startswith(shims.rsplit(".", 1)[0] + "."))]
    assert not offenders, "\n".join(offenders)


# --- the checker itself -------------------------------------------------------------------------


def test_find_cycles_finds_a_cycle_and_passes_a_layered_graph():
    layered = [("cli", "api"), ("api", "passes"), ("passes", "kernels"), ("api", "kernels")]
    assert find_cycles(layered) == []
    cycles = find_cycles(layered + [("kernels", "parallel"), ("parallel", "passes"), ("cli", "hlo")])
    assert cycles == [["kernels", "parallel", "passes", "kernels"]]
    assert find_cycles([("a", "a")]) == [["a", "a"]]
    two = find_cycles([("a", "b"), ("b", "a"), ("c", "d"), ("d", "c"), ("b", "c")])
    assert sorted(two) == [["a", "b", "a"], ["c", "d", "c"]]


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_walker_sees_function_level_relative_and_string_imports(tmp_path):
    package = _write(tmp_path, {
        "pkg/__init__.py": "_LAZY = {'api': 'pkg.api'}\n",
        "pkg/api.py": "from pkg.low import ops\n",
        "pkg/low/__init__.py": "",
        "pkg/low/ops/__init__.py": "from .reference import f\n",
        "pkg/low/ops/reference.py": "def f():\n    from ...high import g\n    return g\n",
        "pkg/high/__init__.py": "import pkg.low.ops.reference\ng = 1\n",
        "pkg/testing/__init__.py": "",
    })
    edges = import_edges(package)
    assert set(edges) == {("pkg", "pkg.api"), ("pkg.api", "pkg.low.ops"), ("pkg.low.ops", "pkg.high"),
                          ("pkg.high", "pkg.low.ops")}
    assert edges["pkg.low.ops", "pkg.high"] == ["pkg/low/ops/reference.py:2"]
    assert find_cycles(edges) == [["pkg.high", "pkg.low.ops", "pkg.high"]]


def test_walker_reports_an_import_of_the_testing_package(tmp_path):
    package = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/hlo/__init__.py": "",
        "pkg/hlo/examples.py": "def zoo():\n    from pkg.testing.zoo import ZOO\n    return ZOO\n",
        "pkg/testing/__init__.py": "",
        "pkg/testing/zoo.py": "ZOO = {}\n",
    })
    assert ("pkg.hlo.examples", "pkg.testing.zoo", "pkg/hlo/examples.py:2") in module_imports(package)


@pytest.mark.parametrize("statement", ["import pkg.other", "from pkg import other", "from .. import other",
                                       "from pkg.other import thing"])
def test_walker_resolves_each_import_form(tmp_path, statement):
    package = _write(tmp_path, {"pkg/__init__.py": "", "pkg/other.py": "thing = 1\n", "pkg/sub/__init__.py": "",
                                "pkg/sub/mod.py": f"def f():\n    {statement}\n"})
    assert module_imports(package) == [("pkg.sub.mod", "pkg.other", "pkg/sub/mod.py:2")]
