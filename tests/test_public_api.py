"""Every public module's __all__ names exactly what it exports, and the demo runs."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

MODULES = [
    "kvtier", "kvtier.pools", "kvtier.transfers", "kvtier.scheduler", "kvtier.errors", "kvtier.testing",
    "kvtier.integrations", "kvtier.integrations.hf", "kvtier.storage", "kvtier.metrics", "kvtier.presets",
    "kvtier.storage.sealed", "kvtier.storage.sealed_store", "kvtier.storage.identity",
    "kvtier.logs", "kvtier.policies",
]
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", MODULES)
def test_all_matches_public_names(name: str) -> None:
    module = importlib.import_module(name)
    exported = set(module.__all__)
    assert len(exported) == len(module.__all__), "duplicates in __all__"
    missing = [n for n in exported if not hasattr(module, n)]
    assert missing == []
    public = {
        n for n, v in vars(module).items()
        if not n.startswith("_")
        and getattr(v, "__module__", "").startswith(name)
        and not isinstance(v, type(sys))
    }
    assert public <= exported, f"public but not in __all__: {sorted(public - exported)}"


def test_demo_rejects_bad_options() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "demo", "--page-size", "6"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert out.returncode == 2
    assert "--page-size must be a positive multiple of 4" in out.stderr
