"""The demo's first part: requests through the DeepSeek V4 stack from the preset, sized by ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
V4_POOLS = ["tok", "c4", "c4_indexer", "c128", "swa", "c4_state", "c4_buffer", "c128_buffer"]


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier", "demo", "--requests", "8", "--concurrency", "4", "--storage", "none", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
    )


def test_v4_stack_sized_by_ratio_moves_every_byte() -> None:
    out = demo("--host-ratio", "1.5", "--json")
    assert out.returncode == 0, out.stderr
    summary: dict[str, Any] = json.loads(out.stdout)
    assert summary["every_byte_matched"] is True and summary["operations"] == 16
    assert summary["host_ratio"] == 1.5
    pools = {row["pool"]: row for row in summary["pools"]}
    assert list(pools) == V4_POOLS
    assert pools["tok"]["kind"] == "logical" and pools["tok"]["host_bytes"] == 0
    for name in ("c4", "c4_indexer", "c128"):
        assert pools[name]["kind"] == "sidecar" and pools[name]["source"] == "tok"
    assert pools["c4"]["page_size"] == 128 // 4 and pools["c128"]["page_size"] == 1
    for name in ("tok", "swa", "c4_state", "c4_buffer", "c128_buffer"):  # host pages = 1.5 x device pages, per pool
        page = pools[name]["page_size"]
        assert pools[name]["host_slots"] // page == int(1.5 * (pools[name]["device_slots"] // page))
    assert all(row["host_bytes"] > 0 for name, row in pools.items() if name != "tok")
    # An operation's time, split: queued and copying from the scheduler, the rest the demo's own work.
    parts = [summary[k] for k in ("mean_queued_ms", "mean_copying_ms", "mean_rest_ms")]
    assert summary["concurrency"] == 4 and all(p >= 0 for p in parts) and summary["mean_copying_ms"] > 0
    assert sum(parts) >= summary["mean_operation_ms"] * (1 - 1e-9)


def test_text_output_lists_each_pools_pages_and_bytes() -> None:
    out = demo()
    assert out.returncode == 0, out.stderr
    assert "over the DeepSeek V4 stack (kvtier.presets.deepseek_v4, host tier sized by host_ratio 1)" in out.stdout
    assert "device slots" in out.stdout and "host MB" in out.stdout
    for name in V4_POOLS:
        assert f"  {name} " in out.stdout
    assert "every byte matched    yes" in out.stdout
    # The headline says what it is: demo time, not a copy rate; latency split into queueing and copying.
    assert "s of demo (" in out.stdout and "not a copy rate; `kvtier bench` measures that" in out.stdout
    assert "(submit to done, 4 requests at once)" in out.stdout
    for line in ("    queued in kvtier    mean ", "    copying             mean ", "    the rest            mean "):
        assert line in out.stdout


def test_bad_v4_options_are_refused() -> None:
    out = demo("--v4-page-size", "100")
    assert out.returncode == 2
    assert "--v4-page-size must be a positive multiple of 128 (the HCA compress rate); got 100" in out.stderr
