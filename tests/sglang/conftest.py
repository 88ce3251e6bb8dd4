"""The SGLang tests: kvtier's HiCache storage backend inside SGLang's own host
pools, backend factory and cache controller (``make test-sglang``).

They need SGLang (sglang==0.5.23, installed ``--no-deps`` with the pure
packages of tests/sglang/requirements.txt into ``.venv-sglang``). Without it
every test here is reported skipped, so ``make test`` in kvtier's own venv
passes.

torchvision: SGLang's config modules import it at module level, and the
wheels a resolver finds do not load against the CPU torch; where no
torchvision is installed, tests/sglang/stand_ins/torchvision (an import-only
stand-in whose every callable raises; its docstring says exactly what and
why) is put at the END of ``sys.path``, so a real torchvision always wins.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
_SPEC = importlib.util.find_spec("sglang")
# With tests/ on sys.path this very directory is a namespace package named
# sglang (origin None); only a real sglang package counts.
HAVE_SGLANG = _SPEC is not None and _SPEC.origin is not None

if HAVE_SGLANG and importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(HERE / "stand_ins"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_SGLANG:
        return
    skip = pytest.mark.skip(reason="SGLang is not installed; `make test-sglang` builds .venv-sglang with sglang==0.5.23")
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)
