"""The demo's storage part: two engines share a prefix through a store, byte-exact."""

from __future__ import annotations

import json
import os
import pty
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
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


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("url", ["closed", "not-a-url"])
def test_an_unusable_redis_url_fails_at_once_in_one_line(url: str) -> None:
    """Before part one runs: no summary, one line naming the URL and why, exit 2
    (it used to run part one, then print an ExceptionGroup of 1,182 lines)."""
    if url == "closed":
        url = f"redis://127.0.0.1:{closed_port()}/0"
        pytest.importorskip("redis")
    out = demo("--storage", "redis", "--redis-url", url)
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"kvtier demo: --redis-url {url} cannot be used: "), lines[0]
    assert "Traceback" not in out.stderr


def test_a_short_run_reports_its_rate_in_a_unit_that_shows_it() -> None:
    out = demo("--storage", "none", "--requests", "1", "--concurrency", "1")
    assert out.returncode == 0, out.stderr
    moved = next(line for line in out.stdout.splitlines() if line.strip().startswith("moved"))
    assert re.search(r"\(\d[\d.]* [kMG]?B/s over the whole run", moved), moved
    assert not re.search(r"\b0\.0+ [kMG]?B/s", out.stdout), moved


def test_rate_and_size_keep_three_significant_digits() -> None:
    from kvtier.demo import rate, size

    assert rate(483e3, 0.04) == "12.1 MB/s"
    assert rate(6.3e9, 1.0) == "6.3 GB/s"
    assert rate(999, 1.0) == "999 B/s" and rate(1, 0.0) == "0 B/s"
    assert size(483_000) == "483 kB" and size(2.5e9) == "2.5 GB" and size(12) == "12 B"


def run_on_a_terminal(*args: str) -> tuple[int, str, str]:
    """The demo with its stderr on a pseudo-terminal: (exit status, stdout, what the terminal got)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier", "demo", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=slave, text=True,
    )
    os.close(slave)
    got: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed its end
                return
            if not chunk:
                return
            got.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    stdout, _ = proc.communicate(timeout=120)
    reader.join(timeout=30)
    os.close(master)
    return proc.returncode, stdout, b"".join(got).decode()


def test_progress_shows_on_a_terminal_only_and_not_with_quiet() -> None:
    args = ("--storage", "none", "--requests", "40", "--concurrency", "4")
    rc, stdout, terminal = run_on_a_terminal(*args)
    assert rc == 0, terminal
    assert "\rkvtier demo: part one: requests served 40/40" in terminal, terminal
    assert terminal.endswith("\r\x1b[K"), repr(terminal[-40:])  # the line is cleared before the summary
    assert "every byte matched    yes" in stdout and "requests served" not in stdout
    rc, _, terminal = run_on_a_terminal(*args, "--quiet")
    assert rc == 0 and "requests served" not in terminal, terminal
    out = demo("--storage", "none")  # captured stderr: no progress either
    assert out.returncode == 0 and "requests served" not in out.stderr, out.stderr
