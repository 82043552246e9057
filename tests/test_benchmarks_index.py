"""The benchmarks folder stays navigable: one entry point that knows every script, an index
(``benchmarks/README.md``) that lists every kept result file, and quotes of result files that resolve.

Runs no benchmark: it reads files, and starts ``python -m benchmarks`` only to print its usage.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"
RESULT_FILE = r"[A-Za-z0-9_.{},*-]+\.(?:json|log|png|txt|gz|\*)"


def _entry_point():
    namespace: dict = {}
    exec(compile((BENCHMARKS / "__main__.py").read_text(), "benchmarks/__main__.py", "exec"),
         {"__name__": "benchmarks_entry", "__file__": str(BENCHMARKS / "__main__.py")}, namespace)
    return namespace


def _expand_braces(pattern: str) -> list[str]:
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combination) for combination in itertools.product(*choices)]


def test_every_script_has_a_subcommand_and_every_subcommand_a_script():
    scripts = _entry_point()["SCRIPTS"]
    assert all((BENCHMARKS / script).is_file() for script in scripts.values()), scripts
    on_disk = {path.name for path in BENCHMARKS.glob("*.py") if path.name != "__main__.py"} | {"gpu_run.sh"}
    assert on_disk == set(scripts.values())


def test_the_entry_point_lists_its_subcommands_and_refuses_others():
    listed = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=REPO, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    assert all(f"  {name} " in listed.stdout for name in _entry_point()["SCRIPTS"])
    refused = subprocess.run([sys.executable, "-m", "benchmarks", "no-such-benchmark"], cwd=REPO,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "unknown subcommand" in refused.stderr


def test_the_index_lists_exactly_the_kept_results():
    index = (BENCHMARKS / "README.md").read_text()
    named = set(re.findall(r"`([A-Za-z0-9_.-]+\.(?:json|log|png|txt|gz))`", index))
    kept = {path.name for path in RESULTS.iterdir() if path.is_file()}
    assert not kept - named, f"result files benchmarks/README.md does not list: {sorted(kept - named)}"
    assert not named - kept, f"benchmarks/README.md lists files not in results/: {sorted(named - kept)}"


def test_the_index_names_only_steps_gpu_run_has():
    steps = set(re.findall(r"(?m)^    ([a-z0-9-]+)\) ", (BENCHMARKS / "gpu_run.sh").read_text()))
    for document in ("README.md", "EP_NOTES.md", "NOTES.md"):
        for step_list in re.findall(r"gpu_run\.sh ((?:[a-z0-9-]+ ?)+)", (BENCHMARKS / document).read_text()):
            assert set(step_list.split()) <= steps, (document, step_list, sorted(steps))


def test_quoted_result_files_exist():
    """Every ``results/<file or glob>`` the notes, the README and the code quote names a kept file."""
    documents = [REPO / "README.md", BENCHMARKS / "NOTES.md", BENCHMARKS / "EP_NOTES.md",
                 *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "moe_lowering").rglob("*.py"))]
    quoted = []
    for document in documents:
        for pattern in re.findall(rf"results/({RESULT_FILE})", document.read_text()):
            quoted += [(document.relative_to(REPO), expanded) for expanded in _expand_braces(pattern)]
    assert quoted, "found no quotes at all"
    unresolved = [(str(where), pattern) for where, pattern in quoted if not list(RESULTS.glob(pattern))]
    assert not unresolved, unresolved
