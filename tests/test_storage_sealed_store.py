"""`SealedPageStore` (`kvtier.storage.sealed_store`) as an engine and its operator
see it: every fault's log event and counters, the probe's errors, `clear`,
`close` against a store that will not close, the statistics and the repr.

The mirror of ``kvtier/storage/sealed_store.py`` for `make mutate`: each test
pins something a caller sees (an answer, a counter, a log event's fields, an
error's message and attributes, a bound on how long a call takes), so a change
that alters it fails here. Round trips and damage are in `test_storage_sealed.py`,
the engine-thread path in `test_storage_blocking.py`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import pytest

import kvtier
from kvtier.errors import ConfigurationError, WrongEventLoop
from kvtier.storage import (
    SEAL_HEADER_BYTES,
    EngineNamespace,
    FileStore,
    PageBlobs,
    SealedPageStore,
    StorageError,
    StorageTimeout,
    UnsupportedPayload,
    open_sealed,
    seal,
)
from kvtier.testing import MemoryStore

NS = EngineNamespace(engine="test", model="m", page_size=4, dtype="bfloat16", layout="page_first", tp_rank=0, tp_size=2)
Event = dict[str, Any]


@pytest.fixture
def events(kvtier_warnings: list[Event]) -> list[Event]:
    return kvtier_warnings


def _named(events: list[Event], name: str) -> list[Event]:
    return [e for e in events if e["event"] == name]


def _faults(events: list[Event]) -> list[dict[str, Any]]:
    """Each ``sealed_store.fault`` event's fields, in order."""
    fields = ("operation", "pages", "reason", "store", "storage_error")
    return [{f: e[f] for f in fields} for e in _named(events, "sealed_store.fault")]


def _fault(operation: str, pages: int, reason: str, store: str = "memory", storage_error: bool = False) -> dict[str, Any]:
    return {"operation": operation, "pages": pages, "reason": reason, "store": store, "storage_error": storage_error}


def _wait_for(condition: Callable[[], bool], what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {within_s} s")
        time.sleep(0.01)


class _Scripted(MemoryStore):
    """A `MemoryStore` whose calls can be made to raise (``fail``), to answer
    something else (``answers``: operation -> function of the call's keys), and
    whose `aclose` can raise or take long (on the loop, or blocking its thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: dict[str, BaseException] = {}
        self.answers: dict[str, Callable[[Sequence[bytes]], Any]] = {}
        self.closes = 0
        self.close_error: BaseException | None = None
        self.close_sleep_s = 0.0
        self.close_block_s = 0.0

    def _scripted(self, operation: str, keys: Sequence[bytes]) -> tuple[bool, Any]:
        if operation in self.fail:
            raise self.fail[operation]
        if operation in self.answers:
            return True, self.answers[operation](keys)
        return False, None

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        scripted, answer = self._scripted("exists", keys)
        return answer if scripted else await super().exists(keys)  # type: ignore[no-any-return]

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        scripted, answer = self._scripted("get", keys)
        return answer if scripted else await super().get(keys, pools)  # type: ignore[no-any-return]

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        self._scripted("put", [p.key for p in pages])
        await super().put(pages)

    async def clear(self) -> int:
        self._scripted("clear", [])
        return await super().clear()

    async def aclose(self) -> None:
        self.closes += 1
        if self.close_block_s:
            time.sleep(self.close_block_s)  # a store that blocks its event loop while it closes
        if self.close_sleep_s:
            await asyncio.sleep(self.close_sleep_s)
        if self.close_error is not None:
            raise self.close_error
        await super().aclose()


class _Nameless(_Scripted):
    """A store without a ``name``."""

    @property
    def name(self) -> str:  # type: ignore[override]
        raise AttributeError("name")


class _Delegating:
    """A store's async calls (no ``clear``), passed on to ``self.inner``."""

    inner: Any

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await self.inner.exists(keys)

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        return await self.inner.get(keys, pools)

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        await self.inner.put(pages)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _NoClear(_Delegating):
    """A store that cannot clear (no ``clear`` method), with or without a name."""

    def __init__(self, name: str | None) -> None:
        self.inner = MemoryStore()
        if name is not None:
            self.name = name


class _CountingFileStore(FileStore):
    """A `FileStore` that counts its calls on the caller's thread, can hold
    them at a barrier (two calls inside at once) or make them raise."""

    def __init__(self, path: Path, barrier: threading.Barrier | None = None) -> None:
        super().__init__(path)
        self.barrier = barrier
        self.get_calls = 0
        self.fail: BaseException | None = None

    def get_blocking(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        self.get_calls += 1
        if self.fail is not None:
            raise self.fail
        if self.barrier is not None:
            self.barrier.wait(30)
        return super().get_blocking(keys, pools)


def _opened(store: object, timeout_s: float = 5) -> SealedPageStore:
    return SealedPageStore(lambda: store, NS, timeout_s=timeout_s)  # type: ignore[arg-type, return-value]


# -- faults: each one a miss, counted and logged with what failed and why ------------------


def test_each_fault_of_a_store_call_is_logged_with_its_operation_pages_and_reason(events: list[Event]) -> None:
    mem = _Scripted()
    with _opened(mem) as sealed:
        assert sealed.put([("a", b"x" * 8), ("b", b"y" * 8)]) == [True, True]
        mem.fail["get"] = RuntimeError("disk on fire")
        assert sealed.get(["a", "b", "c"]) == [None, None, None]
        mem.fail["put"] = StorageError("no room", backend="memory", operation="put")
        assert sealed.put([("c", b"z"), ("d", b"w")]) == [False, False]
        mem.fail["clear"] = StorageError("read-only", backend="memory", operation="clear")
        assert sealed.clear() is False
        assert sealed.statistics().faults == 3
    assert _faults(events) == [
        _fault("get", 3, "RuntimeError: disk on fire"),
        _fault("put", 2, "StorageError: no room", storage_error=True),
        _fault("clear", 0, "StorageError: read-only", storage_error=True),
    ]


def test_a_call_that_outlives_timeout_s_is_logged_as_no_answer(events: list[Event]) -> None:
    mem = _Scripted()
    with _opened(mem, timeout_s=0.25) as sealed:
        mem.hold(["get"])
        assert sealed.get(["a", "b"]) == [None, None]
        mem.release()
    assert _faults(events) == [_fault("get", 2, "no answer within 0.25 s")]


def test_calls_on_a_closed_store_are_logged_as_closed_on_either_path(tmp_path: Path, events: list[Event]) -> None:
    mem = _Scripted()
    sealed = _opened(mem)
    sealed.close()
    assert sealed.get(["a", "b"]) == [None, None]
    assert sealed.put([("a", b"x")]) == [False]
    assert sealed.clear() is False
    file_sealed = _opened(FileStore(tmp_path))
    file_sealed.close()
    assert file_sealed.get(["a", "b", "c"]) == [None, None, None]
    assert file_sealed.put([("a", b"x")]) == [False]
    assert _faults(events) == [
        _fault("get", 2, "closed"), _fault("put", 1, "closed"), _fault("clear", 0, "closed"),
        _fault("get", 3, "closed", store="file"), _fault("put", 1, "closed", store="file"),
    ]
    assert sealed.statistics().faults == 3 and file_sealed.statistics().faults == 2


def test_a_call_ended_by_close_is_logged_as_closed_in_flight(events: list[Event]) -> None:
    mem = _Scripted()
    sealed = _opened(mem, timeout_s=300)
    mem.hold(["get"])
    answers: list[object] = []
    caller = threading.Thread(target=lambda: answers.append(sealed.get(["a", "b", "c", "d"])))
    caller.start()
    _wait_for(lambda: bool(mem.waiting), "the call reaching the store")
    sealed.close()
    caller.join(60)
    assert answers == [[None] * 4]
    assert _faults(events) == [_fault("get", 4, "closed while the call was in flight")]


def test_a_fault_on_the_callers_thread_is_logged_with_its_pages_and_the_error(tmp_path: Path, events: list[Event]) -> None:
    fs = _CountingFileStore(tmp_path)
    with _opened(fs) as sealed:
        fs.fail = RuntimeError("bad sector")
        assert sealed.get(["a", "b", "c"]) == [None, None, None]
        fs.fail = StorageError("gone", backend="file", operation="get")
        assert sealed.get(["a"]) == [None]
    assert _faults(events) == [
        _fault("get", 3, "RuntimeError: bad sector", store="file"),
        _fault("get", 1, "StorageError: gone", store="file", storage_error=True),
    ]


def test_an_answer_of_another_length_or_kind_is_a_fault_naming_what_came(events: list[Event]) -> None:
    mem = _Scripted()
    with _opened(mem) as sealed:
        assert sealed.put([("a", b"x" * 8), ("b", b"y" * 8)]) == [True, True]
        mem.answers["get"] = lambda keys: [None] * (len(keys) - 1)
        assert sealed.get(["a", "b"]) == [None, None]
        mem.answers["get"] = lambda keys: {k: None for k in keys}  # a dict, not a sequence
        assert sealed.get(["a", "b", "c"]) == [None, None, None]
        s = sealed.statistics()
    assert _faults(events) == [
        _fault("get", 2, "the store answered 1 entries for 2 pages"),
        _fault("get", 3, "the store answered dict for 3 pages"),
    ]
    assert (s.faults, s.get_failed, s.get_hits) == (2, 5, 0)


def test_a_fault_names_a_store_without_a_name_as_a_question_mark(events: list[Event]) -> None:
    mem = _Nameless()
    with _opened(mem) as sealed:
        mem.fail["get"] = RuntimeError("x")
        assert sealed.get(["a"]) == [None]
    assert _faults(events) == [_fault("get", 1, "RuntimeError: x", store="?")]


# -- calls from the loop thread, calls on the engine's threads at once --------------------------


@pytest.mark.parametrize("kind", ["blocking", "hop"])
def test_a_call_from_the_loop_thread_is_refused_saying_why(tmp_path: Path, kind: str) -> None:
    with _opened(FileStore(tmp_path) if kind == "blocking" else MemoryStore()) as sealed:
        async def from_the_loop() -> None:
            sealed.get(["a"])

        with pytest.raises(WrongEventLoop) as refused:
            asyncio.run_coroutine_threadsafe(from_the_loop(), sealed._loop).result(10)
        assert str(refused.value) == (
            "SealedPageStore was called from its own loop thread; call it from the engine's threads")


def test_after_overlapping_calls_on_engine_threads_close_closes_the_store_at_once(
    tmp_path: Path, events: list[Event],
) -> None:
    """Two calls inside the store at once, both returned: `close` has nothing
    to wait for, closes the store and logs no failure."""
    fs = _CountingFileStore(tmp_path, barrier=threading.Barrier(2))
    sealed = _opened(fs)
    answers: list[object] = []
    callers = [threading.Thread(target=lambda: answers.append(sealed.get(["a"]))) for _ in range(2)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(30)
    assert answers == [[None], [None]]
    sealed.timeout_s = 2.0  # what close would wait for a call it thought still running
    started = time.monotonic()
    sealed.close()
    assert time.monotonic() - started < 1.5
    assert _named(events, "sealed_store.close_failed") == []
    with pytest.raises(StorageError):
        fs.exists_blocking([NS.key("a")])  # closed


# -- get_pools: what a read counts and logs ------------------------------------------------


def test_broken_pages_are_logged_once_per_pool_with_their_count_and_rules(events: list[Event]) -> None:
    mem = _Scripted()
    with _opened(mem) as sealed:
        assert sealed.put([("a", b"A" * 8), ("b", b"B" * 8), ("c", b"C" * 8)]) == [True] * 3
        assert sealed.put([("d", b"D" * 8)], tag=b"\x07" * 8) == [True]  # another identity
        assert sealed.put([("a", b"a" * 8), ("b", b"b" * 8)], pool="c4") == [True, True]
        mem.corrupt(NS.key("a"), "kv", SEAL_HEADER_BYTES + 1)
        got = sealed.get_pools([("kv", ["a", "b", "d", "z"], 8, None), ("c4", ["a", "z"], 16, None)])
        assert [[g is not None for g in pool] for pool in got] == [[False, True, False, False], [False, False]]
        assert bytes(got[0][1] or b"") == b"B" * 8
        s = sealed.statistics()
    broken = [{k: e[k] for k in ("pool", "pages", "rules")} for e in _named(events, "sealed_store.pages_broken")]
    assert broken == [
        {"pool": "c4", "pages": 1, "rules": ["length"]},
        {"pool": "kv", "pages": 2, "rules": ["checksum", "identity"]},
    ]
    assert (s.get_pages, s.get_hits, s.get_misses, s.get_refused, s.get_failed) == (6, 1, 2, 3, 0)
    assert s.broken == {"checksum": 1, "identity": 1, "length": 1}


def test_a_page_of_another_length_than_nbytes_is_refused_by_its_length() -> None:
    with _opened(MemoryStore()) as sealed:
        sealed.put([("a", b"x" * 8)])
        assert sealed.get(["a"], nbytes=16) == [None]
        assert sealed.get(["a"], nbytes=7) == [None]
        assert bytes(sealed.get(["a"], nbytes=8)[0] or b"") == b"x" * 8
        assert sealed.statistics().broken == {"length": 2}


def test_read_counters_add_up_over_calls() -> None:
    mem = MemoryStore()
    with _opened(mem) as sealed:
        sealed.put([("a", b"x" * 8), ("b", b"y" * 5)])
        mem.corrupt(NS.key("b"), "kv", SEAL_HEADER_BYTES + 1)
        for _ in range(2):
            sealed.get(["a", "b", "z"])
        s = sealed.statistics()
    assert (s.get_pages, s.get_hits, s.get_misses, s.get_refused, s.bytes_read) == (6, 2, 2, 2, 16)


def test_a_request_without_keys_asks_the_store_nothing(tmp_path: Path) -> None:
    mem = MemoryStore()
    with _opened(mem) as sealed:
        sealed.put([("a", b"x" * 8)], pool="c4")
        calls = mem.calls
        assert sealed.get([]) == []
        assert sealed.get_pools([]) == []
        assert mem.calls == calls
        got = sealed.get_pools([("kv", [], None, None), ("c4", ["a"], None, None)])
        assert got[0] == [] and [bytes(g or b"") for g in got[1]] == [b"x" * 8]
        assert mem.calls == calls + 1  # the pool with keys only
    fs = _CountingFileStore(tmp_path)
    with _opened(fs) as sealed:
        got = sealed.get_pools([("kv", [], None, None), ("c4", ["a"], None, None)])
        assert got == [[], [None]] and fs.get_calls == 1
    assert sealed.get([]) == [] and sealed.statistics().faults == 0  # closed, and nothing asked: no fault


# -- exists_pools: one lookup for the batch, by size where the store can ---------------------


class _LookupFileStore(FileStore):
    """A `FileStore` that records each lookup on the caller's thread: its kind and keys."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.lookups: list[tuple[str, int, dict[str, int] | None]] = []

    def exists_blocking(self, keys: Sequence[bytes]) -> list[bool]:
        self.lookups.append(("full", len(keys), None))
        return super().exists_blocking(keys)

    def exists_sized_blocking(self, keys: Sequence[bytes], lengths: Any) -> list[bool]:
        self.lookups.append(("sized", len(keys), dict(lengths)))
        return super().exists_sized_blocking(keys, lengths)


def test_a_lookup_of_several_pools_without_sizes_is_one_store_call(tmp_path: Path) -> None:
    fs = _LookupFileStore(tmp_path)
    with _opened(fs) as sealed:
        assert sealed.put_pools([("kv", [("a", b"x" * 8)], None), ("c4", [("a", b"y" * 4)], None)]) == [[True], [True]]
        fs.lookups.clear()
        assert sealed.exists_pools([("kv", ["a", "b"]), ("c4", ["a"]), ("swa", ["a"], None)]) == [
            [True, False], [True], [False]]
        assert fs.lookups == [("full", 4, None)]


def test_a_lookup_with_sizes_asks_each_pool_by_its_sealed_size_and_the_rest_in_full(tmp_path: Path) -> None:
    fs = _LookupFileStore(tmp_path)
    with _opened(fs) as sealed:
        sealed.put_pools([("kv", [("a", b"x" * 8)], None), ("c4", [("a", b"y" * 4), ("b", b"z" * 4)], None)])
        fs.lookups.clear()
        assert sealed.exists_pools([("kv", ["a", "b"], 8), ("c4", []), ("c4", ["a", "b", "c"], None)]) == [
            [True, False], [], [True, True, False]]
        assert fs.lookups == [("sized", 2, {"kv": SEAL_HEADER_BYTES + 8}), ("full", 3, None)]


def test_a_lookup_fault_is_logged_as_an_exists_of_its_pages(tmp_path: Path, events: list[Event]) -> None:
    mem = _Scripted()
    with _opened(mem) as sealed:
        assert sealed.put([("a", b"x" * 8)]) == [True]
        mem.fail["exists"] = RuntimeError("no index")
        assert sealed.exists_pools([("kv", ["a", "b"]), ("c4", ["a"])]) == [[False, False], [False]]
        del mem.fail["exists"]
        mem.answers["exists"] = lambda keys: [True] * (len(keys) + 1)
        assert sealed.exists(["a", "b"]) == [False, False]
        s = sealed.statistics()
    fs = _CountingFileStore(tmp_path)
    with _opened(fs) as file_sealed:
        file_sealed.close()
        assert file_sealed.exists(["a"], nbytes=8) == [False]
    assert _faults(events) == [
        _fault("exists", 3, "RuntimeError: no index"),
        _fault("exists", 2, "the store answered 3 entries for 2 pages"),
        _fault("exists", 1, "closed", store="file"),
    ]
    assert (s.faults, s.exists_pages, s.exists_found) == (2, 5, 0)


def test_a_lookup_without_keys_asks_the_store_nothing(tmp_path: Path) -> None:
    mem = MemoryStore()
    with _opened(mem) as sealed:
        calls = mem.calls
        assert sealed.exists([]) == [] and sealed.exists_pools([]) == []
        assert sealed.exists_pools([("kv", []), ("c4", [], 8)]) == [[], []]
        assert sealed.prefix_length([]) == 0
        assert mem.calls == calls
    assert sealed.exists([]) == [] and sealed.statistics().faults == 0  # closed, and nothing asked: no fault
    fs = _LookupFileStore(tmp_path)
    with _opened(fs) as file_sealed:
        assert file_sealed.exists_pools([("kv", []), ("c4", [], 8)]) == [[], []]
        assert fs.lookups == []


class _PlainBlocking(_Delegating):
    """A store that answers on the caller's thread (a `BlockingStore`) but cannot
    look a page up by its size (no `exists_sized_blocking`): a `FileStore` behind it."""

    def __init__(self, path: Path) -> None:
        self.inner = FileStore(path)
        self.name = "plain"
        self.full_lookups = 0

    def exists_blocking(self, keys: Sequence[bytes]) -> list[bool]:
        self.full_lookups += 1
        return self.inner.exists_blocking(keys)

    def get_blocking(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        return self.inner.get_blocking(keys, pools)

    def put_blocking(self, pages: Sequence[PageBlobs]) -> None:
        self.inner.put_blocking(pages)


def test_a_blocking_store_that_cannot_tell_by_size_is_asked_in_full(tmp_path: Path, events: list[Event]) -> None:
    plain = _PlainBlocking(tmp_path)
    with _opened(plain) as sealed:
        assert sealed.put([("a", b"x" * 8)]) == [True]
        assert sealed.exists(["a", "b"], nbytes=8) == [True, False]
        assert sealed.exists_pools([("kv", ["a"], 8), ("kv", ["b"], None)]) == [[True], [False]]
        assert plain.full_lookups == 2 and sealed.statistics().faults == 0
    assert _faults(events) == []


def test_a_prefix_is_every_key_when_every_page_is_found(tmp_path: Path) -> None:
    for opener in (MemoryStore, lambda: FileStore(tmp_path)):
        with SealedPageStore(opener, NS, timeout_s=5) as sealed:
            sealed.put([(k, b"x" * 8) for k in ("a", "b", "c")])
            assert sealed.prefix_length(["a", "b", "c"]) == 3
            assert sealed.prefix_length(["a", "b", "c"], nbytes=8) == 3
            assert sealed.prefix_length(["a", "z", "c"], nbytes=8) == 1
            assert sealed.prefix_length([]) == 0


# -- put_pools: what a write counts ---------------------------------------------------------


def test_bytes_written_are_the_sealed_bytes_the_store_holds_and_add_up() -> None:
    mem = _Scripted()
    with _opened(mem) as sealed:
        assert sealed.put([("a", b"x" * 8), ("b", b"y" * 100)]) == [True, True]
        assert sealed.put_pools([("c4", [("a", b"z" * 3)], None)]) == [[True]]
        held = sum(len(b) for page in mem.pages.values() for b in page.values())
        s = sealed.statistics()
        assert (s.put_pages, s.put_failed, s.bytes_written) == (3, 0, held)
        mem.fail["put"] = RuntimeError("full")
        assert sealed.put([("c", b"c" * 8)]) == [False]
        assert sealed.put([("d", b"d" * 8), ("e", b"e")]) == [False, False]
        s = sealed.statistics()
        assert (s.put_pages, s.put_failed, s.bytes_written) == (6, 3, held)


def test_a_put_that_stored_its_pages_answers_true_on_either_path(tmp_path: Path) -> None:
    for opener in (MemoryStore, lambda: FileStore(tmp_path)):
        with SealedPageStore(opener, NS, timeout_s=5) as sealed:
            assert sealed.put([("a", b"x" * 8)]) == [True]
            assert sealed.statistics().put_failed == 0


def test_an_unsupported_payload_names_its_type_in_value_type() -> None:
    with _opened(MemoryStore()) as sealed:
        with pytest.raises(UnsupportedPayload) as refused:
            sealed.put([("a", b"x"), ("b", 3.5)])  # type: ignore[list-item]
    assert refused.value.value_type == "float"


def test_statistics_start_at_zero_and_count_lookups() -> None:
    with _opened(MemoryStore()) as sealed:
        s = sealed.statistics()
        assert (s.exists_pages, s.exists_found, s.get_pages, s.put_pages, s.bytes_read, s.bytes_written, s.faults) == (
            0, 0, 0, 0, 0, 0, 0)
        sealed.put([("a", b"x")])
        sealed.exists(["a", "b", "c"])
        s = sealed.statistics()
        assert (s.exists_pages, s.exists_found) == (3, 1) and s.bytes_written > 0


# -- the probe -----------------------------------------------------------------------------


def _probe_error(store: object, setup: Callable[[SealedPageStore], None] = lambda s: None,
                 timeout_s: float = 5) -> StorageError:
    with _opened(store, timeout_s) as sealed:
        setup(sealed)
        with pytest.raises(StorageError) as failed:
            sealed.probe()
    assert failed.value.operation == "probe"
    return failed.value


def test_the_probe_page_lives_in_its_own_pool_not_among_the_engines_pages() -> None:
    mem = MemoryStore()
    with _opened(mem) as sealed:
        sealed.probe()
        assert sealed.exists([b"kvtier sealed store probe"]) == [False]
        assert sealed.exists([b"kvtier sealed store probe"], pool="probe") == [True]


def test_the_probe_on_a_closed_store_says_so() -> None:
    sealed = _opened(MemoryStore())
    sealed.close()
    with pytest.raises(StorageError) as failed:
        sealed.probe()
    assert str(failed.value) == "memory: the probe found the SealedPageStore closed"
    assert (failed.value.backend, failed.value.operation) == ("memory", "probe")


def test_the_probe_names_the_stores_error() -> None:
    mem = _Scripted()
    mem.fail["put"] = RuntimeError("no disk")
    err = _probe_error(mem)
    assert str(err) == "memory: the probe page failed: RuntimeError: no disk"
    assert err.backend == "memory" and err.__cause__ is mem.fail["put"]


def test_the_probe_of_a_silent_store_is_a_storage_timeout_naming_the_bound() -> None:
    mem = _Scripted()
    err = _probe_error(mem, lambda s: mem.hold(["put"]), timeout_s=0.3)
    assert isinstance(err, StorageTimeout)
    assert str(err) == "memory: the probe page got no answer within 0.3 s"
    assert (err.backend, err.timeout_s) == ("memory", 0.3)


@pytest.mark.parametrize("lost", ["get", "exists"])
def test_a_probe_page_that_does_not_read_back_whole_fails_the_probe(lost: str) -> None:
    mem = _Scripted()
    mem.answers[lost] = lambda keys: [None] if lost == "get" else [False]
    err = _probe_error(mem)
    assert str(err) == "memory: a probe page just put did not read back whole"
    assert err.backend == "memory"


def _probe_answer(mem: _Scripted, sealed: SealedPageStore, change: Callable[[bytes], bytes]) -> None:
    """Make ``mem`` answer the probe's read with a page sealed right (its key,
    its pool's tag) over other bytes: ``change`` of the payload it was given."""
    tag = sealed.pool_tag("probe")

    def answer(keys: Sequence[bytes]) -> list[dict[str, bytes]]:
        (key,) = keys
        payload = bytes(open_sealed(key, mem.pages[key]["probe"], tag=tag))
        return [{"probe": seal(key, change(payload), tag=tag)}]

    mem.answers["get"] = answer


def test_a_probe_page_of_another_length_is_refused_by_its_seal() -> None:
    mem = _Scripted()
    err = _probe_error(mem, lambda s: _probe_answer(mem, s, lambda p: p + b"!"))
    assert str(err).startswith("memory: the probe page read back broken (length): ")
    assert err.backend == "memory" and err.__cause__ is not None


def test_a_probe_page_with_other_bytes_of_its_length_fails_the_probe() -> None:
    """A store handing back another page sealed under the probe's key (another
    release's probe bytes, say): whole, but not this probe."""
    mem = _Scripted()
    err = _probe_error(mem, lambda s: _probe_answer(mem, s, lambda p: p.replace(b"format 1", b"format 2")))
    assert str(err) == "memory: the probe page read back other bytes"
    assert err.backend == "memory"


def test_the_probe_names_a_store_without_a_name_by_its_type() -> None:
    mem = _Nameless()
    mem.fail["put"] = RuntimeError("no")
    err = _probe_error(mem)
    assert str(err) == "_Nameless: the probe page failed: RuntimeError: no" and err.backend == "_Nameless"


# -- clear -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "named"), [("cold-tier", "cold-tier"), (None, "_NoClear")])
def test_clear_on_a_store_that_cannot_clear_is_false_and_logged(events: list[Event], name: str | None, named: str) -> None:
    with _opened(_NoClear(name)) as sealed:
        sealed.put([("a", b"x")])
        assert sealed.clear() is False
        assert sealed.exists(["a"]) == [True]  # nothing removed
    assert [e["store"] for e in _named(events, "sealed_store.clear_unsupported")] == [named]
    assert _faults(events) == []


def test_clear_removes_every_page_and_says_true() -> None:
    mem = MemoryStore()
    with _opened(mem) as sealed:
        sealed.put([("a", b"x"), ("b", b"y")])
        assert sealed.clear() is True
        assert sealed.exists(["a", "b"]) == [False, False] and mem.pages == {}


# -- construction ---------------------------------------------------------------------------


def test_defaults_a_thirty_second_bound_and_a_named_loop_thread() -> None:
    named = "kvtier-sealed-store"
    before = sum(t.name == named for t in threading.enumerate())
    sealed = SealedPageStore(MemoryStore, NS)
    try:
        assert sealed.timeout_s == 30.0
        assert sum(t.name == named for t in threading.enumerate()) == before + 1
    finally:
        sealed.close()


def test_the_longest_timeout_threading_allows_is_accepted() -> None:
    with SealedPageStore(MemoryStore, NS, timeout_s=threading.TIMEOUT_MAX) as sealed:
        assert sealed.timeout_s == threading.TIMEOUT_MAX
        assert sealed.put([("a", b"x")]) == [True]


def test_an_opener_returning_no_store_is_refused_naming_every_missing_method() -> None:
    with pytest.raises(ConfigurationError) as refused:
        SealedPageStore(lambda: 42, NS, timeout_s=5)  # type: ignore[arg-type, return-value]
    assert str(refused.value).endswith("it returned 42, which has no exists, get, put, aclose")


@pytest.mark.parametrize("fails", ["raises", "hangs", "no store"])
def test_a_store_that_fails_to_open_leaves_no_loop_thread(fails: str) -> None:
    class Hangs(MemoryStore):
        async def __aenter__(self) -> Hangs:
            await asyncio.sleep(30)
            return self

    def opener() -> object:
        if fails == "raises":
            raise OSError("no such device")
        return Hangs() if fails == "hangs" else 42

    name = f"kvtier-failed-open-{fails}"
    with pytest.raises(ConfigurationError):
        SealedPageStore(opener, NS, timeout_s=0.3, thread_name=name)  # type: ignore[arg-type]
    _wait_for(lambda: not any(t.name == name for t in threading.enumerate()), "the loop thread ending", 10)


def test_refusals_name_what_was_given_cut_to_80_characters() -> None:
    long = "redis://" + "h" * 200
    with pytest.raises(ConfigurationError) as refused:
        SealedPageStore(long, NS)  # type: ignore[arg-type]
    assert str(refused.value) == (
        f"SealedPageStore needs open_store, a callable returning a store; got {repr(long)[:80]}")
    with pytest.raises(ConfigurationError) as refused:
        SealedPageStore(lambda: long, NS, timeout_s=5)  # type: ignore[arg-type, return-value]
    assert str(refused.value) == (
        "could not open the store for 'test': open_store must return a StorageBackend (FileStore, RedisStore, ...); "
        f"it returned {repr(long)[:80]}, which has no exists, get, put, aclose")
    with pytest.raises(ConfigurationError) as refused:
        SealedPageStore(MemoryStore, NS, timeout_s=threading.TIMEOUT_MAX * 2)
    assert str(refused.value) == (
        f"SealedPageStore timeout_s must be a finite number of seconds > 0 (at most {threading.TIMEOUT_MAX:g}); "
        f"got {threading.TIMEOUT_MAX * 2!r}")


def test_a_store_lacking_one_method_is_refused_naming_only_that_one() -> None:
    class NoPut(_NoClear):
        put = None  # type: ignore[assignment]

    with pytest.raises(ConfigurationError) as refused:
        SealedPageStore(lambda: NoPut("n"), NS, timeout_s=5)  # type: ignore[arg-type, return-value]
    assert str(refused.value).endswith(", which has no put")


def test_the_loop_thread_is_a_daemon() -> None:
    """What lets an engine exit without `close` (the test below, in a process of its own)."""
    name = "kvtier-daemon-check"
    with SealedPageStore(MemoryStore, NS, timeout_s=5, thread_name=name) as sealed:
        (thread,) = [t for t in threading.enumerate() if t.name == name]
        assert thread.daemon is True and sealed.put([("a", b"x")]) == [True]


def test_a_process_that_never_closes_its_store_still_exits() -> None:
    """The loop thread is a daemon: an engine that exits without `close` (and
    keeps its store to the end) is not held up by it."""
    code = (
        "from kvtier.storage import SealedPageStore, EngineNamespace\n"
        "from kvtier.testing import MemoryStore\n"
        "ns = EngineNamespace(engine='e', model='m', page_size=4, dtype='bfloat16', layout='page_first')\n"
        "store = SealedPageStore(MemoryStore, ns, timeout_s=5)\n"
        "assert store.put([('a', b'x')]) == [True]\n"
        "print('done', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(kvtier.__file__).resolve().parent.parent)}
    started = time.monotonic()
    ran = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout == "done\n", ran.stderr[-2000:]
    assert time.monotonic() - started < 15, "the interpreter waited on the loop thread"


# -- dropped without close, close against a store that will not close ----------------------


def _drop(opener: Callable[[], object], thread_name: str) -> None:
    stores = [SealedPageStore(opener, NS, timeout_s=5, thread_name=thread_name)]  # type: ignore[arg-type]
    threads = [t for t in threading.enumerate() if t.name == thread_name]
    assert stores[0].put([("a", b"x")]) == [True]
    del stores
    gc.collect()
    for t in threads:
        t.join(10)
    assert threads and not any(t.is_alive() for t in threads)


def test_a_store_dropped_without_close_is_closed(events: list[Event]) -> None:
    mem = _Scripted()
    _drop(lambda: mem, "kvtier-dropped-closes")
    assert mem.closes == 1
    assert _named(events, "sealed_store.close_failed") == []


def test_a_store_dropped_without_close_that_fails_to_close_is_logged(events: list[Event]) -> None:
    mem = _Scripted()
    mem.close_error = RuntimeError("lid stuck")
    _drop(lambda: mem, "kvtier-dropped-fails")
    assert mem.closes == 1
    assert [e["error"] for e in _named(events, "sealed_store.close_failed")] == ["RuntimeError: lid stuck"]


def test_close_logs_a_store_that_fails_to_close(events: list[Event]) -> None:
    mem = _Scripted()
    mem.close_error = RuntimeError("lid stuck")
    sealed = _opened(mem)
    sealed.close()
    assert [e["error"] for e in _named(events, "sealed_store.close_failed")] == ["RuntimeError: lid stuck"]
    assert not sealed._thread.is_alive()


def test_close_waits_at_most_timeout_s_for_a_store_that_takes_long_to_close(events: list[Event]) -> None:
    mem = _Scripted()
    mem.close_sleep_s = 6.0
    sealed = _opened(mem)
    sealed.timeout_s = 0.3
    started = time.monotonic()
    sealed.close()
    assert time.monotonic() - started < 4.0
    assert [e["error"].split(":")[0] for e in _named(events, "sealed_store.close_failed")] == ["TimeoutError"]


def test_close_returns_when_a_store_blocks_its_loop_thread_while_closing() -> None:
    """A store that blocks the loop thread in `aclose` (a synchronous call
    where an await belongs): `close` gives up on it after its bounds and
    returns, without an error, leaving the thread to end when the store does."""
    mem = _Scripted()
    mem.close_block_s = 6.0
    sealed = _opened(mem)
    sealed.timeout_s = 0.3
    started = time.monotonic()
    sealed.close()  # raises nothing
    assert time.monotonic() - started < 4.0


def test_calls_leave_no_futures_behind() -> None:
    """Each batch's future is dropped once it is answered: a long-running
    engine's calls keep nothing (not their answers' pages either)."""

    def futures() -> int:
        gc.collect()
        return sum(type(o) is concurrent.futures.Future for o in gc.get_objects())

    with _opened(MemoryStore()) as sealed:
        sealed.put([("a", b"x" * 64)])
        before = futures()
        for _ in range(40):
            assert sealed.get(["a"])[0] is not None
        assert futures() - before < 10


# -- the repr ---------------------------------------------------------------------------------


def test_the_repr_names_the_store_namespace_state_and_counts() -> None:
    mem = _Scripted()
    sealed = _opened(mem)
    sealed.put([("a", b"x"), ("b", b"y")])
    mem.fail["put"] = RuntimeError("full")
    sealed.put([("c", b"z")])
    sealed.get(["a", "z"])
    label = NS.label()
    assert repr(sealed) == (
        f"<SealedPageStore memory ns={label} open [get: 1 hits, 1 misses | put: 2/3 | faults: 1]>")
    sealed.close()
    assert repr(sealed) == (
        f"<SealedPageStore memory ns={label} closed [get: 1 hits, 1 misses | put: 2/3 | faults: 1]>")
    with _opened(_Nameless()) as nameless:
        assert repr(nameless).startswith(f"<SealedPageStore ? ns={label} open [")


def test_the_pool_tag_is_the_same_in_every_release() -> None:
    """Pages already stored are sealed under these tags: a change would turn
    every stored page into an identity miss."""
    with _opened(MemoryStore()) as sealed:
        assert sealed.pool_tag("kv").hex() == "5cad55368446417c"
        assert sealed.pool_tag("probe").hex() == "9d1a636ce0565fcc"
        assert sealed.pool_tag("é").hex() != sealed.pool_tag("e").hex()
