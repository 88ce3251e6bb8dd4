"""benchmarks/vllm_ttft.py runs end to end at tiny sizes (its figures come
from the default sizes; here only the table's shape and what it checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "vllm_ttft.py"


def test_the_ttft_benchmark_prints_one_row_per_prefix_size_with_every_host_hit_loaded_from_kvtier(
    tmp_path: Path,
) -> None:
    out = tmp_path / "ttft.json"
    tiny = ["--prefix-blocks", "1,3", "--block", "32", "--suffix", "8", "--repeats", "2", "--layers", "2",
            "--hidden", "64", "--heads", "2", "--intermediate", "128", "--vocab", "512"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), *tiny, "--json", str(out)], capture_output=True,
                          text=True, env=env, timeout=540, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 2, proc.stdout  # header, separator, one row per prefix size
    assert all(line.count("|") == 9 for line in rows), rows
    assert [line.split("|")[1].strip() for line in rows[2:]] == ["40", "104"], rows
    figures = json.loads(out.read_text())
    assert [r["prefix_blocks"] for r in figures["rows"]] == [1, 3]
    assert [r["host_loaded_blocks"] for r in figures["rows"]] == [[1, 1], [3, 3]], figures["rows"]
    for r in figures["rows"]:
        assert r["recompute_ms"] > 0 and r["host_hit_ms"] > 0 and r["device_hit_ms"] > 0, r
        assert r["host_speedup"] == pytest.approx(r["recompute_ms"] / r["host_hit_ms"]), r
