"""`examples/serving_loop.py`, the README's "full pattern" for a hybrid model,
runs as written: prefixes come back from the host tier into fresh device pages
(the sidecar derived from its source), the host tier evicts through the reclaim
hook, every loaded row is the prefill's, and an altered host row fails it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(
    r"(\d+) requests over (\d+) prefixes, (\d+) at a time: (\d+) host hits, (\d+) prefills, (\d+) failed loads, "
    r"(\d+) not backed up, (\d+) evicted from the host"
)


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "serving_loop.py"), "--requests", "24", *args],
        check=False, capture_output=True, text=True, cwd=ROOT, timeout=120,
    )


def test_the_serving_loop_serves_from_the_host_tier_and_every_row_matches() -> None:
    out = run_example()
    assert out.returncode == 0, out.stdout + out.stderr
    m = SUMMARY.search(out.stdout)
    assert m is not None, out.stdout
    requests, _, _, hits, prefills, failed, not_backed_up, evicted = map(int, m.groups())
    assert hits + prefills - failed == requests
    assert hits > 0 and failed == 0 and not_backed_up == 0
    assert evicted > 0  # 8 prefixes through a host tier of 5: the reclaim hook ran
    assert "every loaded row equals the prefill's" in out.stdout


def test_the_serving_loop_fails_when_a_host_row_is_altered() -> None:
    out = run_example("--corrupt")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "loaded rows DIFFER from the prefill's: prefix " in out.stdout
