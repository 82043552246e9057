"""Real-world tests: MaxText's and EasyDeL's dense MoE layers, as shipped, through the pass.

They need the frameworks, pinned: ``pip install -e ".[test,realworld]"`` and then
``bash tools/install_realworld.sh`` (the ``--no-deps`` installs), on Python 3.12 (MaxText 0.2.5
requires it). ``.ci/run``'s ``py312-realworld`` entry does exactly that. Elsewhere — the other
CI entries, a plain ``pytest`` — each test whose framework is not installed is skipped, saying so.
With ``MOE_REALWORLD_REQUIRED=1`` (the CI entry sets it) a missing framework is an error instead:
that entry exists to run these tests, so it must not pass by skipping them all.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # rw_layers, rw_check, rw_hf_stubs

FRAMEWORK_OF_MODULE = {"test_maxtext.py": "maxtext", "test_maxtext_train.py": "maxtext", "test_easydel.py": "easydel"}
PINNED = {"maxtext": "maxtext==0.2.5", "easydel": "easydel==0.3.0 (with eformer==0.0.99.12, ejkernel==0.0.78)"}


def _installed(framework: str) -> bool:
    return importlib.util.find_spec(framework) is not None


def pytest_collection_modifyitems(config, items):
    required = os.environ.get("MOE_REALWORLD_REQUIRED") == "1"
    for item in items:
        path = Path(str(item.path))
        if path.parent != HERE:
            continue
        framework = FRAMEWORK_OF_MODULE.get(path.name)
        if framework is None:
            continue
        if _installed(framework):
            # The frameworks' own deprecations (flax, jax's `with mesh:`, transformers) are not ours.
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))
            continue
        why = (f"{framework} is not installed: the real-world tests need {PINNED[framework]} on Python 3.12 "
               f"(pip install -e '.[test,realworld]' && bash tools/install_realworld.sh)")
        if required:
            raise pytest.UsageError(f"MOE_REALWORLD_REQUIRED=1 but {why}")
        item.add_marker(pytest.mark.skip(reason=why))
