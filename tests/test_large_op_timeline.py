"""benchmarks/large_op_timeline.py at a tiny size: its round trip is byte-exact
(the script exits non-zero otherwise), and each executor's phases add up: the
worker's time lies within the operation's wall time, and the executor that
copies nothing spends less in its worker than the one that copies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "large_op_timeline.py"


def test_the_timeline_of_one_large_backup_splits_its_wall_time_into_worker_and_outside(tmp_path: Path) -> None:
    out = tmp_path / "timeline.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--mib", "4", "--page-size", "2", "--reps", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["pages"] == 4 * 2**20 // (2 * 128 * 1024) and result["nbytes"] == 4 * 2**20
    for name in ("copies", "no_copy", "no_copy_flush"):
        f = result[name]
        assert 0 < f["worker"] <= f["wall"] and f["outside"] > 0, (name, f)  # medians: each <= holds per run
        assert 0 < f["submit"] <= f["loop_cpu"], (name, f)
    assert result["no_copy"]["worker"] < result["copies"]["worker"], result
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["copies", "no_copy", "no_copy_flush"], proc.stdout
