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


COSTLY = '''
import time
import pytest

@pytest.fixture(scope="session")
def session_server():
    time.sleep(0.4)
    yield
    time.sleep(0.4)

@pytest.fixture(scope="module")
def module_cluster(session_server):
    time.sleep(0.3)
    yield
    time.sleep(0.3)

@pytest.fixture
def on_the_module_cluster(request):
    request.getfixturevalue("module_cluster")

@pytest.fixture
def own_cluster():
    time.sleep(0.3)
    yield
    time.sleep(0.3)

def test_starts_a_cluster_of_its_own(own_cluster):
    pass

def test_first_on_the_session_server(session_server):
    pass

def test_on_the_module_cluster(module_cluster):
    pass

def test_plain():
    pass

def test_on_the_module_cluster_too(on_the_module_cluster):
    pass
'''


def _run_as_mutmut(tmp_path: Path, mutant: str, *tests: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--timeout=60", *tests],
        cwd=tmp_path, env={**os.environ, "KVTIER_MUTATION": "1", "MUTANT_UNDER_TEST": mutant},
        capture_output=True, text=True, timeout=60,
    )


def test_under_mutation_a_mutants_tests_run_cheapest_first_by_what_the_clean_run_spent_on_each(
    tmp_path: Path,
) -> None:
    """mutmut times a test's call alone: a test that starts a cluster of its own in
    set-up looked free and ran first, seconds before the quick test that kills."""
    (tmp_path / "tests").mkdir()
    shutil.copy(CONFTEST, tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_costly.py").write_text(COSTLY)
    (tmp_path / "tests" / "test_elsewhere.py").write_text("def test_cheap_elsewhere():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 120\n")
    files = ("tests/test_costly.py", "tests/test_elsewhere.py")
    # mutmut's clean run: every test's set-up, call and teardown, less the fixtures
    # wider than a test (paid once a session or a module), and each file's module fixtures
    clean = _run_as_mutmut(tmp_path, "stats", *files)
    assert clean.returncode == 0, clean.stdout[-2000:]
    costs = json.loads((tmp_path / "kvtier-test-costs.json").read_text())
    own = {k.split("::")[1]: v for k, v in costs["tests"].items()}
    assert own["test_starts_a_cluster_of_its_own"] >= 0.6, own
    assert max(own["test_first_on_the_session_server"], own["test_on_the_module_cluster"],
               own["test_on_the_module_cluster_too"]) < 0.2, own
    assert 0.3 <= costs["module_fixtures"]["tests/test_costly.py"]["module_cluster"] < 0.6, costs
    assert costs["uses"]["tests/test_costly.py::test_on_the_module_cluster_too"] == ["module_cluster"], costs
    # a mutant: the cluster test last, the module cluster's two tests together (one asks
    # for it through another fixture), and a
    # cheap test of another file before both (files no longer run as blocks)
    mutant = _run_as_mutmut(tmp_path, "kvtier.x_f__mutmut_1", *files)
    assert mutant.returncode == 0, mutant.stdout[-2000:]
    order = [line.split("::")[1].split()[0] for line in mutant.stdout.splitlines() if "::test_" in line]
    assert sorted(order) == sorted(own), order
    assert order[-1] == "test_starts_a_cluster_of_its_own", order
    together = order.index("test_on_the_module_cluster"), order.index("test_on_the_module_cluster_too")
    assert abs(together[0] - together[1]) == 1, order
    assert order.index("test_cheap_elsewhere") < min(together), order
