"""Nothing kvtier does reaches SGLang's threads, and its counts tell the truth.

Faults (a store that raises, times out, answers short, hands back damaged or
foreign pages; a host pool whose page copies raise; a redis-server killed or
paused) are driven through a real ``HiCacheController``'s own storage threads:
backups go through its backup thread (``write_storage`` -> ``ack_backup_queue``),
prefetches through its prefetch thread (the hit query), its IO thread (the
page transfer) and its sync thread (the acks). After each fault the threads
are alive, SGLang logged no exception, whatever landed is byte for byte what
was backed up, and once the fault is gone the next backup and prefetch work.

Every method SGLang calls is also called directly with what makes kvtier's
own code fail (no host pool registered, indices that are not a tensor, keys
that are not strings, ...): each answers its neutral value, logs
``sglang_storage.call_failed`` and counts it.

Needs SGLang (see test_sglang_storage.py); skipped without it.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import torch

_SGLANG = importlib.util.find_spec("sglang")
if _SGLANG is not None and _SGLANG.origin is not None and importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(Path(__file__).parent / "stand_ins"))
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed; `make test-sglang` builds .venv-sglang with sglang==0.5.23")


import harness  # noqa: E402
from harness import (  # noqa: E402
    KVTIER, PAGE, Pools, backend_of, make_pools, needs_redis_server, page_hashes, pages_of, single_rank, tokens,
)
from kvtier.integrations.sglang import HiCacheStorageStatistics, KvtierHiCacheStorage  # noqa: E402
from kvtier.integrations.sglang import storage as sglang_storage  # noqa: E402
from kvtier.policies import CountedAdmission  # noqa: E402
from kvtier.storage import StorageBackend  # noqa: E402
from kvtier.testing import MemoryStore  # noqa: E402
from kvtier.testing.redis_server import LocalRedisServer  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult  # noqa: E402

pytestmark = pytest.mark.sglang

Event = MutableMapping[str, Any]
WAIT_S = 60.0  # a queue that gets nothing this long means a thread is gone


@pytest.fixture(autouse=True)
def one_rank() -> Iterator[None]:
    with single_rank():
        yield


@pytest.fixture
def logs(kvtier_warnings: list[Event]) -> list[Event]:
    """kvtier's events from every thread (warning and up)."""
    return kvtier_warnings


@pytest.fixture
def controllers() -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(pools: Pools, extra: dict[str, Any]) -> Any:
        ctl = harness.controller(pools, extra)
        made.append(ctl)
        return ctl

    yield make
    for ctl in made:
        ctl.detach_storage_backend()


class ShortStore(MemoryStore):
    """A store with a bug: while ``short``, it answers one entry fewer than asked."""

    short = False

    async def exists(self, keys: Any) -> list[bool]:
        found = await super().exists(keys)
        return found[:-1] if self.short else found

    async def get(self, keys: Any, pools: Any) -> list[Any]:
        got = await super().get(keys, pools)
        return got[:-1] if self.short else got


@pytest.fixture
def memory_store(monkeypatch: pytest.MonkeyPatch) -> Callable[[MemoryStore], None]:
    """Make every backend SGLang's factory builds open ``store`` (kvtier's
    fault-injecting in-memory store) instead of the one its options name."""

    def use(store: MemoryStore) -> None:
        def opened(options: Any, label: str) -> StorageBackend:
            return store

        monkeypatch.setattr(sglang_storage, "_open_store", opened)

    return use


# -- SGLang's own threads ---------------------------------------------------------------


def backup_in_thread(ctl: Any, host_indices: torch.Tensor, prompt: list[int]) -> int:
    """A backup through SGLang's backup thread; the tokens it reports written."""
    op_id = ctl.write_storage(host_indices, prompt, hash_value=page_hashes(prompt))
    op = ctl.ack_backup_queue.get(timeout=WAIT_S)
    assert op.id == op_id
    return int(op.completed_tokens)


def prefetch_in_threads(ctl: Any, prompt: list[int]) -> tuple[int, int, torch.Tensor]:
    """A prefetch through SGLang's prefetch thread (hit query), IO thread (page
    transfer) and sync thread (acks), the scheduler's part done here: (pages
    the query found, pages that landed, their host indices)."""
    op = ctl.prefetch("req", prompt)
    assert ctl.prefetch_hit_queue.get(timeout=WAIT_S) is op
    found = op.storage_hit_count // PAGE
    if not found:
        return 0, 0, torch.empty(0, dtype=torch.int64)
    op.host_indices = ctl.mem_pool_host.alloc(found * PAGE)
    ctl.prefetch_buffer.put(op)
    completed = 0
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=WAIT_S)
        if ack.completed_req:
            break
        completed = ack.completed_tokens
    return found, completed // PAGE, op.host_indices


def assert_threads_alive(*ctls: Any) -> None:
    for ctl in ctls:
        for thread in (ctl.prefetch_thread, ctl.prefetch_io_aux_thread, ctl.prefetch_sync_thread, ctl.backup_thread):
            assert thread.is_alive(), thread


def sglang_tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What SGLang's controller logged with a traceback (an exception its thread caught)."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("sglang") and r.exc_info]


def stats(ctl: Any) -> HiCacheStorageStatistics:
    s = backend_of(ctl).statistics()
    assert isinstance(s, HiCacheStorageStatistics)
    return s


def assert_counted_apart(s: HiCacheStorageStatistics) -> None:
    """Each page a read asked for is in exactly one of the four counts."""
    assert s.get_pages == s.get_hits + s.get_misses + s.get_refused + s.get_failed, s
    assert s.get_refused == sum(s.broken.values()), s


def same_pages(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def two_controllers(controllers: Callable[..., Any], extra: dict[str, Any], seed: int) -> tuple[Pools, Pools, Any, Any]:
    a, b = make_pools("mha", "page_first"), make_pools("mha", "page_first")
    a.fill(seed=seed)
    return a, b, controllers(a, extra), controllers(b, extra)


# -- store faults through the threads -----------------------------------------------------


@pytest.mark.parametrize("interface_v1", [1, 0], ids=["v1", "legacy"])
@pytest.mark.parametrize("fault", ["raises", "times_out", "answers_short"])
def test_a_failing_store_is_misses_in_sglangs_threads_and_heals(
    fault: str, interface_v1: int, memory_store: Callable[[MemoryStore], None], controllers: Callable[..., Any],
    caplog: pytest.LogCaptureFixture, logs: list[Event],
) -> None:
    store = ShortStore()
    memory_store(store)
    extra = {**KVTIER, "interface_v1": interface_v1, "timeout_s": 1.0}  # a fault-free call takes far less
    a, b, ctl_a, ctl_b = two_controllers(controllers, extra, seed=40)
    prompt = tokens(4, seed=41)
    src = a.host.alloc(4 * PAGE)
    assert backup_in_thread(ctl_a, src, prompt) == 4 * PAGE
    before = stats(ctl_b)

    if fault == "raises":
        store.fail_probability = 1.0
    elif fault == "times_out":
        store.delay_s = 30.0  # far past timeout_s: the call is cancelled and answered with misses
    else:
        store.short = True
    caplog.set_level(logging.WARNING)
    assert prefetch_in_threads(ctl_b, prompt)[:2] == (0, 0)
    # a put answers nothing to be short of: only the failing store fails it
    written = backup_in_thread(ctl_a, src[: 2 * PAGE], tokens(2, seed=42))
    assert written == (2 * PAGE if fault == "answers_short" else 0)
    assert stats(ctl_a).put_failed == (0 if fault == "answers_short" else 2)
    assert_threads_alive(ctl_a, ctl_b)
    assert sglang_tracebacks(caplog) == []
    assert any(e["event"] == "sealed_store.fault" for e in logs)
    assert stats(ctl_b).faults > before.faults
    assert stats(ctl_b).get_hits == before.get_hits

    store.fail_probability, store.delay_s, store.short = 0.0, 0.0, False
    found, landed, dst = prefetch_in_threads(ctl_b, prompt)
    assert (found, landed) == (4, 4)
    assert same_pages(pages_of(b, dst), pages_of(a, src))
    assert stats(ctl_b).get_hits == before.get_hits + 4
    assert_counted_apart(stats(ctl_b))


def test_damaged_and_foreign_pages_are_refused_counted_apart_never_hits(
    memory_store: Callable[[MemoryStore], None], controllers: Callable[..., Any], caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    memory_store(store)
    a, b, ctl_a, ctl_b = two_controllers(controllers, dict(KVTIER), seed=43)
    prompt = tokens(5, seed=44)
    src = a.host.alloc(5 * PAGE)
    assert backup_in_thread(ctl_a, src, prompt) == 5 * PAGE
    ns = backend_of(ctl_a).namespace
    keys = [ns.key(h) for h in page_hashes(prompt)]
    # page 3: one flipped byte; page 1: another page's sealed blob under its key (bytes that pass
    # their own checksum, but not this key's seal)
    store.corrupt(keys[3], "kv", len(store.pages[keys[3]]["kv"]) // 2)
    store.pages[keys[1]] = dict(store.pages[keys[4]])
    caplog.set_level(logging.WARNING)
    found, landed, dst = prefetch_in_threads(ctl_b, prompt)
    assert (found, landed) == (5, 1)  # the prefix stops at the first refused page
    assert same_pages(pages_of(b, dst)[:1], pages_of(a, src)[:1])
    s = stats(ctl_b)
    # pages 0, 2 and 4 landed (SGLang uses page 0 only), 1 and 3 were refused
    assert (s.get_hits, s.get_refused, s.get_failed, s.get_misses) == (3, 2, 0, 0)
    assert set(s.broken) <= {"checksum", "key", "identity"} and sum(s.broken.values()) == s.get_refused
    assert_counted_apart(s)
    assert sglang_tracebacks(caplog) == []
    assert_threads_alive(ctl_a, ctl_b)
    # the next backup repairs both; the next prefetch is whole
    assert backup_in_thread(ctl_a, src, prompt) == 5 * PAGE
    found, landed, dst = prefetch_in_threads(ctl_b, prompt)
    assert (found, landed) == (5, 5)
    assert same_pages(pages_of(b, dst), pages_of(a, src))


class BrokenCopies:
    """SGLang's host pool with page copies that raise while ``broken``."""

    def __init__(self, host: Any) -> None:
        self._host = host
        self.broken = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)

    def get_data_page(self, index: Any, flat: bool = True) -> Any:
        if self.broken:
            raise RuntimeError("page copy out of the host pool failed")
        return self._host.get_data_page(index, flat=flat)

    def set_from_flat_data_page(self, index: Any, data_page: Any) -> None:
        if self.broken:
            raise RuntimeError("page copy into the host pool failed")
        self._host.set_from_flat_data_page(index, data_page)


@pytest.mark.parametrize("interface_v1", [1, 0], ids=["v1", "legacy"])
def test_a_page_that_cannot_land_is_a_failure_not_a_hit(
    interface_v1: int, tmp_path: Path, controllers: Callable[..., Any], caplog: pytest.LogCaptureFixture,
    logs: list[Event],
) -> None:
    """kvtier reads the page whole, SGLang's host pool refuses it: a miss
    counted as failed. With the legacy interface SGLang itself copies the page
    in, and a refusal there is SGLang's own exception, outside kvtier."""
    extra = {**KVTIER, "store_path": str(tmp_path), "interface_v1": interface_v1}
    a, b, ctl_a, ctl_b = two_controllers(controllers, extra, seed=45)
    prompt = tokens(3, seed=46)
    src = a.host.alloc(3 * PAGE)
    assert backup_in_thread(ctl_a, src, prompt) == 3 * PAGE
    backend = backend_of(ctl_b)
    broken = BrokenCopies(b.host)
    backend.mem_pool_host = broken  # what kvtier copies pages into (the controller keeps its own)
    broken.broken = True
    caplog.set_level(logging.WARNING)
    if interface_v1:
        assert prefetch_in_threads(ctl_b, prompt)[:2] == (3, 0)
        s = stats(ctl_b)
        assert (s.get_hits, s.get_failed, s.get_refused) == (0, 3, 0)
        assert any(e["event"] == "sglang_storage.land_failed" for e in logs)
    else:
        # the legacy get hands SGLang flat pages: the landing is SGLang's, and kvtier's hits are real
        assert prefetch_in_threads(ctl_b, prompt)[:2] == (3, 3)
    assert sglang_tracebacks(caplog) == []
    # and a backup whose page copy raises writes nothing, says so, and is counted
    bk = BrokenCopies(a.host)
    bk.broken = True
    backend_of(ctl_a).mem_pool_host = bk
    if interface_v1:
        assert backup_in_thread(ctl_a, src, tokens(3, seed=47)) == 0
        assert stats(ctl_a).put_failed == 3 and stats(ctl_a).call_errors == {"batch_set_v1": 1}
    broken.broken = bk.broken = False
    assert_threads_alive(ctl_a, ctl_b)
    found, landed, dst = prefetch_in_threads(ctl_b, prompt)
    assert (found, landed) == (3, 3)
    assert same_pages(pages_of(b, dst), pages_of(a, src))
    assert_counted_apart(stats(ctl_b))


@needs_redis_server
@pytest.mark.parametrize("how", ["killed", "paused"])
def test_a_dead_or_stuck_redis_server_is_misses_in_sglangs_threads(
    how: str, fresh_server: Callable[..., LocalRedisServer], controllers: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = fresh_server()
    extra = {**KVTIER, "store": "redis", "redis_url": server.url, "timeout_s": 1.0}
    a, b, ctl_a, ctl_b = two_controllers(controllers, extra, seed=48)
    prompt = tokens(3, seed=49)
    src = a.host.alloc(3 * PAGE)
    assert backup_in_thread(ctl_a, src, prompt) == 3 * PAGE
    caplog.set_level(logging.WARNING)
    server.kill() if how == "killed" else server.pause()
    assert prefetch_in_threads(ctl_b, prompt)[:2] == (0, 0)
    assert backup_in_thread(ctl_a, src, prompt) == 0
    assert sglang_tracebacks(caplog) == []
    assert_threads_alive(ctl_a, ctl_b)
    assert stats(ctl_b).faults >= 1 and stats(ctl_b).get_hits == 0
    if how == "killed":
        server.start()  # empty again
        assert backup_in_thread(ctl_a, src, prompt) == 3 * PAGE
    else:
        server.resume()
    found, landed, dst = prefetch_in_threads(ctl_b, prompt)
    assert (found, landed) == (3, 3)
    assert same_pages(pages_of(b, dst), pages_of(a, src))


# -- every method, with what makes kvtier's own code fail -------------------------------------


def _transfer(**kw: Any) -> PoolTransfer:
    return PoolTransfer(name=PoolName.SWA, **kw)


KEYS = page_hashes(tokens(2, seed=50))
IDX = torch.arange(2 * PAGE)
# (method, arguments, the neutral answer): each fails inside kvtier on a backend with no host pool
CALLS: list[tuple[str, tuple[Any, ...], Any]] = [
    ("batch_exists", (KEYS,), 0),
    ("exists", (KEYS[0],), False),
    ("batch_get_v1", (KEYS, IDX), [False, False]),
    ("batch_set_v1", (KEYS, IDX), [False, False]),
    ("batch_get", (KEYS,), [None, None]),
    ("get", (KEYS[0],), None),
    ("batch_set", (KEYS, [torch.zeros(4), torch.zeros(4)]), False),
    ("set", (KEYS[0], torch.zeros(4)), False),
    ("batch_exists_v2", (KEYS, [_transfer(hit_policy=PoolHitPolicy.ALL_PAGES)]), PoolTransferResult(0, {}, [])),
    ("batch_get_v2", ([_transfer(keys=KEYS, host_indices=IDX)],), {PoolName.SWA: [False, False]}),
    ("batch_set_v2", ([_transfer(keys=KEYS, host_indices=IDX)],), {PoolName.SWA: [False, False]}),
    ("clear", (), False),
]


@pytest.mark.parametrize(("method", "args", "neutral"), CALLS, ids=[c[0] for c in CALLS])
def test_every_method_answers_its_neutral_value_before_attach(
    method: str, args: tuple[Any, ...], neutral: Any, tmp_path: Path, logs: list[Event],
) -> None:
    pools = make_pools("mha", "page_first")
    backend = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path)}))
    backend.mem_pool_host = pools.host  # SGLang's base class set it, kvtier's attach has not run
    assert getattr(backend, method)(*args) == neutral
    failed = [e for e in logs if e["event"] == "sglang_storage.call_failed"]
    assert failed and failed[0]["call"] in (method, f"batch_{method}") and "no host pool yet" in failed[0]["error"]
    assert sum(backend.statistics().call_errors.values()) == len(failed)


def _attached(tmp_path: Path, pools: Pools) -> KvtierHiCacheStorage:
    backend = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path)}))
    backend.register_mem_pool_host(pools.host)
    backend.register_mem_host_pool_v2(make_pools("mha", "layer_first").host, PoolName.SWA)
    return backend


# (method, arguments SGLang never sends, the neutral answer, the failed calls counted)
BAD_CALLS: list[tuple[str, tuple[Any, ...], Any, dict[str, int]]] = [
    ("batch_exists", ([1, 2],), 0, {"batch_exists": 1}),  # keys that are not strings
    ("batch_get_v1", (KEYS, IDX.tolist()), [False, False], {"batch_get_v1": 1}),  # indices that are not a tensor
    ("batch_set_v1", (KEYS, IDX.view(2, PAGE)), [False, False], {"batch_set_v1": 1}),  # a 2-d index tensor
    ("batch_get", (KEYS, [None]), [None, None], {"batch_get": 1}),  # one target for two keys
    ("batch_set", (KEYS, [None, "page"]), False, {"batch_set": 1}),  # values that are not pages
    ("batch_get_v2", ([_transfer(keys=KEYS, host_indices=None), PoolTransfer(name=PoolName.MAMBA, keys=KEYS[:1])],),
     {PoolName.SWA: [False, False], PoolName.MAMBA: [False]}, {"batch_get_v2": 2}),
    ("batch_exists_v2", (KEYS, [PoolTransfer(name=PoolName.SWA, hit_policy=PoolHitPolicy.TRAILING_PAGES, keys=3)]),  # type: ignore[arg-type]
     PoolTransferResult(0, {}, []), {"batch_exists_v2": 1}),
]


@pytest.mark.parametrize(("method", "args", "neutral", "errors"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_arguments_sglang_never_sends_are_neutral_answers_counted(
    method: str, args: tuple[Any, ...], neutral: Any, errors: dict[str, int], tmp_path: Path,
) -> None:
    pools = make_pools("mha", "page_first")
    pools.fill(seed=51)
    backend = _attached(tmp_path, pools)
    try:
        assert backend.batch_set_v1(KEYS, IDX) == [True, True]
        assert getattr(backend, method)(*args) == neutral
        s = backend.statistics()
        assert s.call_errors == errors
        assert_counted_apart(s)
        # and the backend goes on
        assert backend.batch_get_v1(KEYS, IDX + 8 * PAGE) == [True, True]
        assert same_pages(pages_of(pools, IDX + 8 * PAGE), pages_of(pools, IDX))
    finally:
        backend.close()


def test_a_store_admission_policy_that_raises_writes_nothing_and_says_so(tmp_path: Path, logs: list[Event]) -> None:
    pools = make_pools("mha", "page_first")
    backend = _attached(tmp_path, pools)
    try:
        class Raising:
            def admit(self, key: Any, tier: str) -> str | None:
                raise RuntimeError("the engine's policy failed")

        backend.admission = CountedAdmission(Raising())
        assert backend.batch_set_v1(KEYS, IDX) == [False, False]
        assert backend.statistics().call_errors == {"batch_set_v1": 1}
        assert backend.batch_exists(KEYS) == 0
        assert [e["call"] for e in logs if e["event"] == "sglang_storage.call_failed"] == ["batch_set_v1"]
    finally:
        backend.close()


def test_a_legacy_page_that_cannot_be_handed_over_is_a_failure_not_a_hit(tmp_path: Path, logs: list[Event]) -> None:
    pools = make_pools("mha", "page_first")
    pools.fill(seed=52)
    backend = _attached(tmp_path, pools)
    try:
        assert backend.batch_set_v1(KEYS, IDX) == [True, True]
        dummy = pools.host.get_dummy_flat_data_page()
        strided = torch.empty(2 * dummy.numel(), dtype=dummy.dtype)[::2]  # a page's bytes, but no byte view of it
        got = backend.batch_get(KEYS, [strided, torch.empty_like(dummy)])
        assert got[0] is None and got[1] is not None
        assert torch.equal(got[1].view(torch.uint8), pages_of(pools, IDX)[1])
        s = backend.statistics()
        assert (s.get_hits, s.get_failed, s.get_refused, s.get_misses) == (1, 1, 0, 0)
        assert [e["pages"] for e in logs if e["event"] == "sglang_storage.target_copy_failed"] == [1]
    finally:
        backend.close()
