"""The demo's storage part: two engines share a prefix through a store, byte-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import needs_redis_server

ROOT = Path(__file__).resolve().parent.parent
POOLS = {"kv", "swa", "state", "tok"}


def demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier", "demo", "--requests", "20", "--concurrency", "4", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env=env, check=False,
    )


def check_shared(storage: dict[str, Any], backend: str) -> None:
    assert storage["backend"] == backend
    assert storage["every_byte_matched"] is True
    assert storage["mismatched_prompts"] == 0
    written, present = storage["pages_written"], storage["pages_present"]
    requested, hit, fetched = storage["pages_requested"], storage["pages_hit"], storage["pages_prefetched"]
    assert set(requested) == POOLS
    for pool in POOLS:
        # Engine A stored exactly the pages engine B asks for, each once; B hit
        # and read all of them.
        assert written[pool] + present[pool] == requested[pool], pool
        assert hit[pool] == fetched[pool] == requested[pool] > 0, pool
    # The shared system prefix: written by the first prompt, found by the others.
    assert present["kv"] > 0 and present["tok"] > 0
    assert written["kv"] < requested["kv"]
    assert storage["bytes_written"] > 0 and storage["bytes_prefetched"] > storage["bytes_written"]


def run_json(*args: str) -> dict[str, Any]:
    out = demo(*args, "--json")
    assert out.returncode == 0, out.stderr
    summary: dict[str, Any] = json.loads(out.stdout)
    assert summary["every_byte_matched"] is True
    assert summary["operations"] == 40
    return summary


def test_file_storage_two_engines_share_the_prefix() -> None:
    summary = run_json("--storage", "file")
    check_shared(summary["storage"], "file")
    assert not Path(summary["storage"]["location"]).exists()  # the temporary directory is gone


@needs_redis_server
def test_redis_storage_two_engines_share_the_prefix() -> None:
    summary = run_json("--storage", "redis")
    check_shared(summary["storage"], "redis")
    assert summary["storage"]["location"].startswith("redis://127.0.0.1:")


def test_storage_none_is_the_one_engine_demo() -> None:
    summary = run_json("--storage", "none")
    assert "storage" not in summary


def test_text_output_reports_both_parts() -> None:
    out = demo("--prompts", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("every byte matched    yes") == 2
    assert "2 engines share 3 prompts" in out.stdout
    assert "the shared prefix, written once" in out.stdout


def test_redis_without_a_server_says_how_to_install() -> None:
    env = dict(os.environ, KVTIER_REDIS_SERVER="/nonexistent/redis-server")
    out = demo("--storage", "redis", env=env)
    assert out.returncode == 2
    assert "apt-get install redis-server" in out.stderr
    assert "--redis-url" in out.stderr
