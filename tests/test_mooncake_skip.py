"""The Mooncake tests skip, saying why, when mooncake does not import for any
reason: plain `pytest` outside `make test` has no LD_LIBRARY_PATH for the
libraries the wheel links, and the import fails with an ImportError that is
not a ModuleNotFoundError (which pytest.importorskip alone would skip)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("failure", ["ImportError('libibverbs.so.1: cannot open shared object file')", None])
def test_the_mooncake_tests_skip_when_mooncake_does_not_import(failure: str | None, tmp_path: Path) -> None:
    # A stand-in `mooncake` package first on the path: its `store` raises what the
    # real wheel raises without libibverbs, or is missing altogether.
    pkg = tmp_path / "mooncake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    if failure is not None:
        (pkg / "store.py").write_text(f"raise {failure}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_storage_mooncake.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 5, text  # a module skipped whole collects nothing: pytest's 5, not 2 (an error)
    assert "1 skipped" in text and "ERROR" not in text and " error" not in text, text
    assert "mooncake does not import" in text and "LD_LIBRARY_PATH=.venv/mooncake-libs" in text, text
    if failure is not None:
        assert "libibverbs.so.1" in text, text
