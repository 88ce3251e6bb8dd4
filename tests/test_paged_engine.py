"""`examples/paged_engine.py` runs, reuses prefixes from the host tier, and matches
a run that never evicts, bit for bit; with one host page altered it says so and fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--prefix-tokens", "128", "--suffix-tokens", "16", "--new-tokens", "4", "--requests", "4",
         "--layers", "4", "--hidden", "128"]


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "paged_engine.py"), *SMALL, *args],
        check=False, capture_output=True, text=True, cwd=ROOT, timeout=120,
    )


def test_paged_engine_reuses_host_prefixes_with_identical_outputs() -> None:
    out = run_example("--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["identical_outputs"] is True
    # Requests 0 and 1 compute prefixes A and B; 2 and 3 find them on the host.
    assert [r["source"] for r in summary["reports"]] == ["computed", "computed", "host", "host"]
    assert summary["host_hits"] == 2
    assert summary["tokens_reused_from_host"] == 2 * 128
    assert summary["loads"] == 2 and summary["backups"] == 2
    assert summary["evictions"] >= 2


def test_paged_engine_prints_per_request_reuse() -> None:
    out = run_example()
    assert out.returncode == 0, out.stderr
    assert "request 2 (prefix A): 128 tokens reused from the host tier" in out.stdout
    assert "outputs               identical to the never-evicting run" in out.stdout


def test_paged_engine_fails_when_a_host_page_is_altered() -> None:
    out = run_example("--corrupt")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "outputs               DIFFERENT to the never-evicting run" in out.stdout
