"""How the suite runs under `make mutate` (``KVTIER_MUTATION=1``, tests/conftest.py):
each test limited to a multiple of its clean time, quick tests first.

The conftest is copied beside a small test file and run in a subprocess, from a
directory holding the ``mutmut-stats.json`` that mutmut's clean run writes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

TESTS = '''
import threading
import anyio
import pytest

@pytest.fixture
def stuck_server():
    threading.Event().wait()

def test_with_a_fixture_that_never_starts(stuck_server):
    pass

def test_slow_defined_first():
    pass

async def test_an_unwoken_waiter():
    await anyio.Event().wait()

def test_a_thread_wait_that_never_ends():
    threading.Event().wait()

def test_quick():
    pass

async def test_with_no_clean_time():
    pass
'''


def test_under_mutation_each_test_fails_at_ten_times_its_clean_time_and_quick_tests_run_first(
    tmp_path: Path,
) -> None:
    (tmp_path / "tests").mkdir()
    shutil.copy(CONFTEST, tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_limits.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\ntimeout = 120\n")
    clean = {f"tests/test_limits.py::{name}": seconds for name, seconds in [
        ("test_slow_defined_first", 0.015), ("test_an_unwoken_waiter", 0.01),
        ("test_a_thread_wait_that_never_ends", 0.02), ("test_quick", 0.001),
        ("test_with_a_fixture_that_never_starts", 0.001)]}
    (tmp_path / "mutmut-stats.json").write_text(json.dumps({"duration_by_test": clean}))
    # Limits: max(1 s, 10 x clean). Without them the async waiter would run to the 30 s
    # deadline and the thread wait to the 60 s timeout, past this run's 20 s.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--timeout=60", "tests/test_limits.py",
         "-k", "not fixture_that_never_starts"],
        cwd=tmp_path, env={**os.environ, "KVTIER_MUTATION": "1", "PYTHONUNBUFFERED": "1"},
        capture_output=True, text=True, timeout=20,
    )
    out = done.stdout + done.stderr
    order = [line.split("::")[1].split()[0] for line in done.stdout.splitlines()
             if line.startswith("tests/test_limits.py::")]
    assert order[:5] == ["test_with_no_clean_time", "test_quick", "test_an_unwoken_waiter", "test_slow_defined_first",
                     "test_a_thread_wait_that_never_ends"], out[-3000:]
    # (its traceback would come at the session's end, which the stuck test below never reaches)
    assert "test_an_unwoken_waiter FAILED" in out, out[-3000:]
    assert "test_slow_defined_first PASSED" in out, out[-3000:]
    # A thread wait, or a loop that spins, never lets a deadline fire: pytest-timeout's
    # thread ends the process with exit code 1 (a kill, to mutmut), naming where it hung.
    assert done.returncode == 1 and "Timeout" in out and "threading.Event().wait()" in out, out[-3000:]
    # A fixture's set-up has no limit of its own (mutmut times test functions only): it
    # keeps the session's, after which the process ends the same way.
    # (run as mutmut runs it: sys.stderr replaced by an object with no file number)
    stuck = subprocess.run(
        [sys.executable, "-c", "import io, sys, pytest; sys.stderr = io.StringIO(); sys.exit(pytest.main(sys.argv[1:]))",
         "-v", "-p", "no:cacheprovider", "--timeout=2", "tests/test_limits.py::test_with_a_fixture_that_never_starts"],
        cwd=tmp_path, env={**os.environ, "KVTIER_MUTATION": "1"}, capture_output=True, text=True, timeout=20,
    )
    # (the stacks go where pytest captures the set-up's output, which the ended process
    # never shows; without the limit the run would hang to this call's timeout)
    assert stuck.returncode == 1 and " in " not in stuck.stdout.splitlines()[-1], stuck.stdout[-2000:]
