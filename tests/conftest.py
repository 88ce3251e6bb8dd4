from __future__ import annotations

import contextlib
import faulthandler
import functools
import importlib.util
import inspect
import json
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from blockbuster import BlockBuster

from kvtier.pools import HostPool, PoolGroup
from kvtier.storage import FileStore, StorageBackend
from kvtier.storage.pages import page_members
from kvtier.testing.redis_server import LocalRedisCluster, LocalRedisServer, find_redis_server


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "allow_blocking: run an async test without the blocking-call detector"
    )
    if MUTATION and os.environ.get("MUTANT_UNDER_TEST") == "stats":  # mutmut's clean run
        config.pluginmanager.register(_CostRecorder(), "kvtier-test-costs")


@pytest.fixture(autouse=True)
def no_blocking_on_the_loop(request: pytest.FixtureRequest) -> Iterator[BlockBuster | None]:
    """Around every async test (the scheduler's event loop runs in the test's
    thread): a synchronous sleep, file or socket I/O, or a wait on a held lock
    made from the running loop's thread raises `blockbuster.BlockingError`.

    Other threads may block (executors copy in worker threads), and nothing is
    checked where no loop runs, so importing torch and sync tests are untouched.
    Opt out with ``@pytest.mark.allow_blocking``.
    """
    if not inspect.iscoroutinefunction(request.function) or request.node.get_closest_marker("allow_blocking"):
        yield None
        return
    detector = BlockBuster()
    # FileStore stats its directory once where it is made, to refuse a file there.
    # Under `make mutate` (docs/testing.md) mutmut runs its body as x__check_directory__mutmut_*.
    from kvtier.storage import file_store
    check_directory = {"_check_directory", *(n for n in vars(file_store) if n.startswith("x__check_directory__mutmut"))}
    detector.functions["os.stat"].can_block_in("kvtier/storage/file_store.py", check_directory)
    detector.activate()
    try:
        yield detector
    finally:
        detector.deactivate()


def pages(*ps: int, page_size: int) -> torch.Tensor:
    """Slot indices of whole pages ``ps``."""
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in ps])


async def wait_until(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.001)


def wipe(group: PoolGroup) -> None:
    """Zero every device tensor of every pool (the engine lost the rows)."""
    for spec in group:
        if spec.device is None:
            continue
        for j in range(spec.device.num_layers):
            for p in range(len(spec.device.planes)):
                spec.device.tensor(j, p).zero_()


def rows(group: PoolGroup, pool: str, idx: torch.Tensor) -> list[torch.Tensor]:
    dev = group[pool].device
    assert dev is not None
    return [dev.tensor(j, p)[idx].clone() for j in range(dev.num_layers) for p in range(len(dev.planes))]


def assert_rows_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        assert torch.equal(x, y)


def used(group: PoolGroup) -> dict[str, int | None]:
    return {name: s.used_slots for name, s in group.statistics().items()}


@contextlib.contextmanager
def captured_events(level: int = logging.WARNING) -> Iterator[list[MutableMapping[str, Any]]]:
    """kvtier's events at ``level`` and up, from every thread, as
    `structlog.testing.capture_logs` sees them, whatever an earlier test
    configured: structlog's configuration and the ``kvtier`` logger's level
    (which governs kvtier's events) come back afterwards."""
    import structlog
    from structlog.testing import capture_logs

    config, logger = structlog.get_config(), logging.getLogger("kvtier")
    before = logger.level
    logger.setLevel(level)
    try:
        with capture_logs() as captured:
            yield captured
    finally:
        logger.setLevel(before)
        structlog.configure(**config)


@pytest.fixture
def kvtier_warnings() -> Iterator[list[MutableMapping[str, Any]]]:
    """kvtier's warnings and errors (`captured_events`)."""
    with captured_events() as captured:
        yield captured


@pytest.fixture
def kvtier_events() -> Iterator[list[MutableMapping[str, Any]]]:
    """kvtier's events at every level (`captured_events`)."""
    with captured_events(logging.DEBUG) as captured:
        yield captured


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """An event that holds executor batches; always released at teardown."""
    ev = threading.Event()
    yield ev
    ev.set()


ASYNC_TEST_DEADLINE_S = float(os.environ.get("KVTIER_TEST_DEADLINE_S", "30"))
"""How long an async test may run before it fails with `TimeoutError`: a bug
that leaves a handle unresolved fails the test in seconds, with the stack of
the wait, instead of hanging until pytest-timeout's 120 s. End-to-end tests and
tests with a ``timeout`` marker of their own keep pytest-timeout's limit."""


def _with_deadline(test: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    @functools.wraps(test)
    async def run(*args: Any, **kwargs: Any) -> Any:
        with anyio.fail_after(seconds):
            return await test(*args, **kwargs)

    return run


# -- under `make mutate` (docs/testing.md) ----------------------------------------
#
# scripts/mutate.py sets KVTIER_MUTATION=1. Each mutant runs the tests that reach the
# mutated function, stopping at the first failure (-x), so the run's time is spent
# (a) on every Hypothesis example a surviving or equivalent mutant passes and (b) on
# shrinking the first failing example of a killed one, which a kill does not need.
# Under mutation: no shrinking, no example database (one mutant's failure is not the
# next one's), a fixed seed (a rerun gives the same verdicts: a baseline stays true),
# at most MUTATION_MAX_EXAMPLES examples a test, and the tests that are not
# Hypothesis tests first, so the cheap ones kill before the long ones start.

MUTATION = os.environ.get("KVTIER_MUTATION") == "1"
MUTATION_MAX_EXAMPLES = int(os.environ.get("KVTIER_MUTATION_MAX_EXAMPLES", "40"))
# A test under a mutant may take MUTATION_SLOWDOWN times its clean time (mutmut's
# clean run records the test function's own time, fixtures apart), and never less
# than MUTATION_FLOOR_S: a mutant that leaves a waiter unwoken, or spins, fails at
# that limit, not at the module's deadline (5 to 30 s, most of a run's time where
# the killed mutants are hangs). Only the test function is limited, as mutmut
# measured it: a fixture's server start-up is not.
MUTATION_SLOWDOWN = 10.0
MUTATION_FLOOR_S = 1.0

if MUTATION:
    from hypothesis import HealthCheck, Phase
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile(
        "mutation", deadline=None, database=None, derandomize=True,
        phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck),
    )
    _hypothesis_settings.load_profile("mutation")


def _capped(current: Any) -> Any:
    """``current`` (a test's Hypothesis settings) with the mutation profile's limits."""
    from hypothesis import HealthCheck, Phase
    from hypothesis import settings as hypothesis_settings

    return hypothesis_settings(
        current, max_examples=min(current.max_examples, MUTATION_MAX_EXAMPLES), database=None, derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=tuple(p for p in current.phases if p not in (Phase.reuse, Phase.shrink, Phase.explain)),
    )


def _hypothesis_cost(item: pytest.Item) -> int:
    """1 for a Hypothesis test (a property or a state machine), else 0; caps its settings."""
    from hypothesis import settings as hypothesis_settings

    function = getattr(item, "obj", None)
    function = getattr(function, "__func__", function)  # a test class's method: set it on the function
    if getattr(function, "is_hypothesis_test", False):
        current = getattr(function, "_hypothesis_internal_use_settings", None) or hypothesis_settings.default
        function._hypothesis_internal_use_settings = _capped(current)  # type: ignore[union-attr]
        return 1
    cls = getattr(item, "cls", None)
    if isinstance(getattr(cls, "settings", None), hypothesis_settings):  # a RuleBasedStateMachine's TestCase
        cls.settings = _capped(cls.settings)  # type: ignore[union-attr]
        return 1
    return 0


def _clean_durations() -> dict[str, float]:
    """Under mutation, each test's time in mutmut's clean run (``mutmut-stats.json``
    in the directory mutmut runs the tests from: the call alone, which sets each
    test's limit). Empty when there is none."""
    try:
        with open("mutmut-stats.json") as f:
            took = json.load(f).get("duration_by_test", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: v for k, v in took.items() if isinstance(v, (int, float))} if isinstance(took, dict) else {}


# What a test costs a mutant is more than its call: a test that starts a cluster of its
# own spends seconds in set-up. mutmut's clean run (MUTANT_UNDER_TEST=stats) records,
# beside mutmut-stats.json, each test's set-up, call and teardown, less what fixtures
# wider than a test cost there (a session's server is started once, by whichever test
# comes first), and each file's module fixtures. A mutant's tests run cheapest first,
# each on its own, except that the tests sharing a module fixture that costs more than
# MUTATION_SHARED_FIXTURE_S stay together (leaving their file would start it again).
MUTATION_COSTS = "kvtier-test-costs.json"
MUTATION_SHARED_FIXTURE_S = 0.05


def _clean_costs() -> tuple[dict[str, float], dict[str, dict[str, float]], dict[str, list[str]]]:
    """Under mutation, what the clean run recorded (above): each test's own cost, each
    file's module fixtures with their set-up time, and the module fixtures each test
    used (asked for by name or through another fixture). Empty where there is none."""
    try:
        with open(MUTATION_COSTS) as f:
            recorded = json.load(f)
        return (dict(recorded["tests"]), {k: dict(v) for k, v in recorded["module_fixtures"].items()},
                {k: list(v) for k, v in recorded["uses"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}, {}, {}


class _CostRecorder:
    """Records, in mutmut's clean run, what `_clean_costs` reads."""

    def __init__(self) -> None:
        self.tests, self.module_fixtures, self.uses = _clean_costs()  # a later clean run adds new tests
        self.wider = 0.0  # this test's time in fixtures wider than a test
        self.depth = 0  # wider fixtures being set up or torn down (one may ask for another)
        self.started = 0.0

    def _enter(self) -> None:
        if self.depth == 0:
            self.started = time.perf_counter()
        self.depth += 1

    def _leave(self) -> float:
        self.depth -= 1
        took = time.perf_counter() - self.started
        if self.depth == 0:
            self.wider += took
        return took

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Iterator[Any]:
        if fixturedef.scope == "function":
            return (yield)
        self._enter()
        try:
            return (yield)
        finally:
            took = self._leave()
            if fixturedef.scope == "module":
                file = request.node.nodeid.split("::")[0]
                self.module_fixtures.setdefault(file, {})[fixturedef.argname] = took
            # runs first at teardown (finalizers run last in, first out); the hook below last
            fixturedef.addfinalizer(self._enter)

    def pytest_fixture_post_finalizer(self, fixturedef: Any, request: Any) -> None:
        if fixturedef.scope != "function" and self.depth > 0:
            self._leave()

    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        # before the teardown: every fixture the test used is active (pytest's request
        # also names those a fixture asked for with getfixturevalue)
        request = getattr(item, "_request", None)
        active = set(getattr(request, "fixturenames", None) or getattr(item, "fixturenames", ()))
        self.uses[item.nodeid] = sorted(active & set(self.module_fixtures.get(item.nodeid.split("::")[0], ())))

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.wider = 0.0
        self.tests[nodeid] = 0.0

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tests[report.nodeid] = self.tests.get(report.nodeid, 0.0) + report.duration
        if report.when == "teardown":
            self.tests[report.nodeid] = max(0.0, self.tests[report.nodeid] - self.wider)

    def pytest_sessionfinish(self) -> None:
        with open(MUTATION_COSTS, "w") as f:
            json.dump({"tests": self.tests, "module_fixtures": self.module_fixtures, "uses": self.uses}, f)


def _session_timeout(config: pytest.Config) -> float:
    """pytest-timeout's limit for this session (``--timeout``, else the ini's), 0 for none."""
    return float(config.getvalue("timeout") or config.getini("timeout") or 0)


@contextlib.contextmanager
def _process_ends_after(seconds: float) -> Iterator[None]:
    """End the process (exit code 1, every thread's stack dumped to stderr) unless the
    block is done within ``seconds`` (0: no limit)."""
    if seconds <= 0:
        yield
        return
    # sys.__stderr__: mutmut replaces sys.stderr with objects that have no file number
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__ or sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


if MUTATION:
    # Under a mutant each test function has its own limit (below), which leaves its
    # fixtures' set-up and teardown out: they keep the session's limit, as a watchdog
    # that ends the process (a fixture stuck on a mutant's store or lane is a kill).

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
        with _process_ends_after(_session_timeout(item.config)):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
        with _process_ends_after(_session_timeout(item.config)):
            return (yield)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every async test waits at most `ASYNC_TEST_DEADLINE_S`; tests marked
    ``gpu`` need CUDA: skip them cleanly without it. Under mutation, Hypothesis
    tests run capped and last, and each test has a limit from its clean time (above)."""
    took = _clean_durations() if MUTATION else {}
    if MUTATION:
        hypothesis = {item.nodeid: _hypothesis_cost(item) for item in items}  # before the deadline's wrapper
        own, module_fixtures, uses = _clean_costs()

        def cost(item: pytest.Item) -> float:
            return own.get(item.nodeid, took.get(item.nodeid, 0.0))

        # A test runs on its own, or with the tests of its file that share a costly
        # module fixture (set up once). Property tests last; then cheapest first.
        def group(item: pytest.Item) -> tuple[int, str]:
            file = item.nodeid.split("::")[0]
            shared = {name for name, s in module_fixtures.get(file, {}).items() if s > MUTATION_SHARED_FIXTURE_S}
            together = not shared.isdisjoint([*getattr(item, "fixturenames", ()), *uses.get(item.nodeid, ())])
            return hypothesis[item.nodeid], file if together else item.nodeid

        key = {item.nodeid: group(item) for item in items}
        total: dict[tuple[int, str], float] = {}
        first: dict[tuple[int, str], int] = {}
        for i, item in enumerate(items):
            k = key[item.nodeid]
            if k not in total and k[1] in module_fixtures:
                total[k] = sum(module_fixtures[k[1]].values())
            total[k] = total.get(k, 0.0) + cost(item)
            first.setdefault(k, i)
        items.sort(key=lambda item: (key[item.nodeid][0], total[key[item.nodeid]], first[key[item.nodeid]], cost(item)))
    for item in items:
        if item.get_closest_marker("e2e") is not None or item.get_closest_marker("timeout") is not None:
            continue
        deadline = ASYNC_TEST_DEADLINE_S
        if MUTATION and item.nodeid in took:
            limit = max(MUTATION_FLOOR_S, MUTATION_SLOWDOWN * took[item.nodeid])
            deadline = min(deadline, limit)
            # A spinning mutant never lets the async deadline fire, and a signal's
            # exception can be swallowed by the loop it spins: pytest-timeout's thread
            # ends the process a second later (exit 1, a kill; the test function only,
            # as measured). Before, such a mutant ran to mutmut's CPU limit (a minute).
            ceiling = _session_timeout(item.config) or limit + 1.0
            item.add_marker(pytest.mark.timeout(min(limit + 1.0, ceiling), method="thread", func_only=True))
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            item.obj = _with_deadline(item.obj, deadline)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# -- real Redis servers for the storage tests -------------------------------------


def _why_no_redis() -> str | None:
    if importlib.util.find_spec("redis") is None:
        return "redis-py is not installed (pip install 'kvtier[redis]')"
    if find_redis_server() is None:
        return "redis-server binary not found (apt-get install -y redis-server, or set $KVTIER_REDIS_SERVER)"
    return None


NO_REDIS = _why_no_redis()
"""Why Redis tests cannot run here, or None."""
needs_redis_server = pytest.mark.skipif(NO_REDIS is not None, reason=NO_REDIS or "")


# One server and one cluster a session, emptied for each test module that uses them:
# a module sees what a server of its own would hold (nothing), and the session pays
# one start each (a cluster's is 2 s of Redis's own delay before a master takes
# writes), not one a module. Tests that stop, pause or reconfigure a server start
# their own (`fresh_server`).


@pytest.fixture(scope="session")
def _session_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisServer]:
    if NO_REDIS is not None:
        pytest.skip(NO_REDIS)
    with LocalRedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def _session_redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    if NO_REDIS is not None:
        pytest.skip(NO_REDIS)
    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"), masters=3) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def redis_server(_session_redis_server: LocalRedisServer) -> LocalRedisServer:
    """A non-persistent server, empty when a test module first asks for it
    (each test uses a key prefix of its own)."""
    _session_redis_server.command("FLUSHALL")
    return _session_redis_server


@pytest.fixture(scope="module")
def redis_cluster(_session_redis_cluster: LocalRedisCluster) -> LocalRedisCluster:
    """A real three-master Redis Cluster on loopback ports, empty when a test
    module first asks for it."""
    for node in _session_redis_cluster.nodes:
        node.command("FLUSHALL")
    return _session_redis_cluster


@pytest.fixture(params=["file", pytest.param("redis", marks=needs_redis_server)])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], StorageBackend]:
    """A way to open a fresh store, once a FileStore and once a RedisStore
    (on the module's redis-server, under a key prefix of its own)."""
    if request.param == "file":
        return lambda: FileStore(tmp_path / "store")
    from kvtier.storage import RedisStore

    server: LocalRedisServer = request.getfixturevalue("redis_server")
    prefix = f"t{secrets.token_hex(4)}:"
    return lambda: RedisStore(server.url, prefix=prefix, timeout_s=5.0)


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[Callable[..., LocalRedisServer]]:
    """Start servers of one's own (persistent, cluster...); all killed at teardown."""
    if NO_REDIS is not None:
        pytest.skip(NO_REDIS)
    started: list[LocalRedisServer] = []

    def start(**kwargs: object) -> LocalRedisServer:
        server = LocalRedisServer(tmp_path / f"redis{len(started)}", **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def randomize_host(group: PoolGroup, seed: int) -> None:
    """Fill every host pool of ``group`` with seeded random bytes."""
    gen = torch.Generator().manual_seed(seed)
    for spec in group:
        host = spec.host
        if isinstance(host, HostPool):
            for p in range(len(host.planes)):
                flat = host.buffer(p).reshape(-1).view(torch.uint8)
                flat.copy_(torch.randint(0, 256, flat.shape, generator=gen, dtype=torch.uint8))


def page_bytes(group: PoolGroup, anchor: str, page: int) -> dict[str, list[torch.Tensor]]:
    """Every row of a stored page's members, per layer and plane, as bytes (copies)."""
    return {
        name: [
            host.layer_view(j, p)[start:start + count].contiguous().view(torch.uint8).clone()
            for p in range(len(host.planes)) for j in range(host.num_layers)
        ]
        for name, (host, start, count) in page_members(group, anchor, page).items()
    }


def assert_pages_equal(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> None:
    assert a.keys() == b.keys()
    for name, rows in a.items():
        assert all(torch.equal(x, y) for x, y in zip(rows, b[name], strict=True)), name
