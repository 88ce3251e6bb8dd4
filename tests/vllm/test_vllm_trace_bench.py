"""benchmarks/vllm_trace.py runs end to end at tiny sizes (its figures come from
a modest run; here only the table's shape and values that must hold whatever
the timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "vllm_trace.py"
PAIRS = ["store-all + LRU", "gate + LRU", "store-all + SLRU", "gate + SLRU"]


def test_the_trace_benchmark_prints_one_row_per_share_and_policy_pair_and_the_gate_stores_less(
    tmp_path: Path,
) -> None:
    out = tmp_path / "trace.json"
    tiny = ["--prefixes", "4", "--prefix-blocks", "2", "--repeated", "8", "--shares", "0,0.5", "--repeats", "1",
            "--suffix", "8", "--layers", "2", "--hidden", "64", "--heads", "2", "--intermediate", "128",
            "--vocab", "512"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), *tiny, "--json", str(out)], capture_output=True,
                          text=True, env=env, timeout=840, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + 2 * 4, proc.stdout  # header, separator, one row per share and pair
    assert all(line.count("|") == 11 for line in lines), lines
    assert [line.split("|")[2].strip() for line in lines[2:]] == PAIRS * 2, lines
    rows = json.loads(out.read_text())["rows"]
    by = {(r["share"], r["policies"]): r for r in rows}
    for r in rows:
        assert 0 <= r["hit_repeated"] <= 1 and 0 <= r["hit_overall"] <= 1 and 0 <= r["host_share_of_loads"] <= 1, r
        assert r["failed_blocks"] == 0, r  # no load kvtier offered failed
        assert r["ttft_median_ms"] > 0 and r["ttft_p90_ms"] >= r["ttft_median_ms"] and r["tokens_per_s"] > 0, r
        assert r["requests"] == (8 if r["share"] == 0 else 16), r
        assert r["mib_to_host"] > 0, r  # the repeated prefixes, at least, were backed up
    for eviction in ("LRU", "SLRU"):
        # The gate never backs up a block seen once (a one-shot prompt's, a prefix sent once).
        gate, all_ = by[0.0, f"gate + {eviction}"], by[0.0, f"store-all + {eviction}"]
        assert gate["mib_to_host"] <= all_["mib_to_host"], (gate, all_)
        gate, all_ = by[0.5, f"gate + {eviction}"], by[0.5, f"store-all + {eviction}"]
        assert gate["mib_to_host"] < all_["mib_to_host"], (gate, all_)
        assert gate["mib_to_store"] < all_["mib_to_store"], (gate, all_)
    # One-shot prompts are never hits, so the overall hit rate is below the repeated prefixes' at 50%.
    for pair in PAIRS:
        assert by[0.5, pair]["hit_overall"] <= by[0.5, pair]["hit_repeated"], by[0.5, pair]
