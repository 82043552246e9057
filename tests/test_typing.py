"""What type checkers and ``dir()`` see of the package: a user's program passes ``mypy --strict``
(decorated functions keep their signatures, option strings are ``Literal`` types), a wrong option
or argument is flagged, and the lazy exports are listed, typed and stable.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import moe_lowering

ROOT = Path(__file__).resolve().parents[1]

USER_PROGRAM = '''
"""A user's program, as the quickstart writes it: decorate, explain, call, differentiate."""

import warnings

import jax
import jax.numpy as jnp

from moe_lowering import Backend, ExplainReport, MoeNotFoundError, NoMoeFoundWarning, explain, moe_optimize


def moe_layer(router: jax.Array, w_up: jax.Array, w_down: jax.Array, x: jax.Array) -> jax.Array:
    weights, experts = jax.lax.top_k(jax.nn.softmax(x @ router), 2)
    combine = (jax.nn.one_hot(experts, 4) * weights[..., None]).sum(1)
    hidden = jax.nn.relu(jnp.einsum("td,edf->tef", x, w_up))
    return jnp.einsum("te,ted->td", combine, jnp.einsum("tef,efd->ted", hidden, w_down))


@moe_optimize
def bare(router: jax.Array, w_up: jax.Array, w_down: jax.Array, x: jax.Array) -> jax.Array:
    return moe_layer(router, w_up, w_down, x)


@moe_optimize(backend="xla", capacity_factor=1.25, exchange_transport="all_to_all", weight_gather_quant="mxfp8")
def configured(router: jax.Array, w_up: jax.Array, w_down: jax.Array, x: jax.Array) -> jax.Array:
    return moe_layer(router, w_up, w_down, x)


def main(backend: Backend) -> None:
    keys = jax.random.split(jax.random.key(0), 4)
    router, x = jax.random.normal(keys[0], (4, 4)), jax.random.normal(keys[1], (8, 4))
    w_up, w_down = jax.random.normal(keys[2], (4, 4, 8)), jax.random.normal(keys[3], (4, 8, 4))
    report: ExplainReport = explain(moe_layer, router, w_up, w_down, x)
    print(report, report.regions[0].experts, report.to_dict()["regions"])
    out: jax.Array = bare(router, w_up, w_down, x) + configured(router, w_up, w_down, x)
    sparse = jax.jit(moe_optimize(moe_layer, backend=backend, strict=True))
    grads = jax.grad(lambda w: jnp.sum(sparse(router, w, w_down, x)))(w_up)
    print(out.shape, grads.shape)
    warnings.simplefilter("error", NoMoeFoundWarning)
    try:
        moe_optimize(jnp.tanh, strict=True)(x)
    except MoeNotFoundError as err:
        print(err)


if __name__ == "__main__":
    main("auto")
'''

MISUSES = '''
import jax
from moe_lowering import moe_optimize


def scale(x: jax.Array, factor: int) -> jax.Array:
    return x * factor


moe_optimize(scale, backend="cuda")
moe_optimize(exchange_transport="nccl")
moe_optimize(scale, weight_gather_quant="fp8")
moe_optimize(scale)(jax.numpy.ones(3), "two")
moe_optimize(backend="xla")(scale)(jax.numpy.ones(3), "two")
from moe_lowering import moe_optimise
'''


def run_mypy(tmp_path: Path, cache: Path, source: str) -> subprocess.CompletedProcess:
    """``mypy --strict`` on ``source`` as a user's module. The package is found from the checkout
    (an editable install's import hook is invisible to mypy) and checked silently: the user's
    program is under test, through the types the package declares."""
    program = tmp_path / "user_program.py"
    program.write_text(textwrap.dedent(source))
    env = dict(os.environ, MYPYPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-error-summary",
         "--cache-dir", str(cache), str(program)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory) -> Path:
    pytest.importorskip("mypy", reason="mypy is in the test extras: pip install -e '.[test]'")
    return tmp_path_factory.mktemp("mypy_cache")


@pytest.mark.typecheck
def test_user_program_passes_mypy_strict(tmp_path, mypy_cache):
    result = run_mypy(tmp_path, mypy_cache, USER_PROGRAM)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.typecheck
def test_mypy_flags_wrong_options_and_arguments(tmp_path, mypy_cache):
    """Each misuse is an error on its own line: unknown option strings, an argument of the wrong
    type to a decorated function (bare and with options), a name the package does not export."""
    result = run_mypy(tmp_path, mypy_cache, MISUSES)
    flagged = {int(line.split(":")[1]) for line in result.stdout.splitlines() if ": error:" in line}
    lines = textwrap.dedent(MISUSES).splitlines()
    expected = {number for number, line in enumerate(lines, 1)
                if line.startswith(("moe_optimize(", "from moe_lowering import moe_optimise"))}
    assert result.returncode == 1 and flagged == expected, result.stdout + result.stderr


def test_dir_lists_the_public_names():
    assert set(moe_lowering.__all__) <= set(dir(moe_lowering))
    assert {"moe_optimize", "explain", "ExplainReport", "MoeNotFoundError", "NoMoeFoundWarning"} <= set(
        moe_lowering.__all__)


def _type_checking_imports() -> dict[str, str]:
    """``{name: module}`` imported under ``if TYPE_CHECKING:`` in the package's ``__init__``."""
    tree = ast.parse((ROOT / "moe_lowering" / "__init__.py").read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom):
                    found.update({alias.asname or alias.name: statement.module for alias in statement.names})
    return found


def test_exports_agree_for_type_checkers_and_at_run_time():
    """``__all__``, the lazy table and the ``TYPE_CHECKING`` imports name the same objects, and each
    name resolves, twice to the same object (no submodule of that name shadows it)."""
    assert sorted(moe_lowering.__all__) == moe_lowering.__all__
    assert dict(sorted(_type_checking_imports().items())) == dict(sorted(moe_lowering._LAZY.items()))
    assert set(moe_lowering._LAZY) == set(moe_lowering.__all__)
    for name in moe_lowering.__all__:
        first = getattr(moe_lowering, name)
        assert getattr(moe_lowering, name) is first, name
    with pytest.raises(AttributeError, match="no attribute 'moe_optimise'"):
        moe_lowering.moe_optimise  # noqa: B018


def test_import_is_cheap_and_typed():
    """``import moe_lowering`` loads no JAX (the names load on first use), and the package ships
    ``py.typed`` so that type checkers read its annotations."""
    code = "import sys, moe_lowering; assert 'jax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
    assert (ROOT / "moe_lowering" / "py.typed").is_file()
