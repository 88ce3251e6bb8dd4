"""`BlockingStore`: a `FileStore` answers on the caller's own thread, and
`SealedPageStore` calls it there (no hop to its loop thread), as SGLang's
storage threads call it.

What must hold on that path as on the hop's: pages byte for byte, every fault
a miss counted (never an exception into the engine's thread), calls from
several threads at once, and `close` never closing the store under a call
that is still running.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import structlog

from kvtier.errors import ConfigurationError, WrongEventLoop
from kvtier.storage import (
    BlockingStore,
    EngineNamespace,
    FileStore,
    PageBlobs,
    SealedPageStore,
    SizedLookup,
    StorageError,
)
from kvtier.testing import MemoryStore

NS = EngineNamespace(engine="test", model="m", page_size=4, dtype="bfloat16", layout="page_first")


def random_pages(n: int, pools: tuple[str, ...] = ("kv", "c4")) -> list[PageBlobs]:
    return [PageBlobs(secrets.token_bytes(32), {p: secrets.token_bytes(97 + 13 * i) for i, p in enumerate(pools)})
            for _ in range(n)]


# -- FileStore's blocking methods ------------------------------------------------------


def test_file_store_is_a_blocking_store_and_a_memory_store_is_not() -> None:
    assert isinstance(FileStore("/nonexistent-kvtier-dir"), BlockingStore)
    assert not isinstance(MemoryStore(), BlockingStore)  # the hop's path stays tested with it


async def test_blocking_calls_answer_what_the_async_ones_answer(tmp_path: Path) -> None:
    pages = random_pages(6)
    async with FileStore(tmp_path) as store:
        here = anyio.to_thread.run_sync  # blocking calls are an engine thread's, never the loop's
        await here(store.put_blocking, pages[:3])
        await store.put(pages[3:])
        keys = [p.key for p in pages] + [secrets.token_bytes(32)]
        assert await here(store.exists_blocking, keys) == await store.exists(keys) == [True] * 6 + [False]
        blocking, awaited = await here(store.get_blocking, keys, ["kv", "c4"]), await store.get(keys, ["c4", "kv"])
        assert blocking == awaited == [p.blobs for p in pages] + [None]
        assert await here(store.get_blocking, keys[:2], ["c4"]) == [{"c4": p.blobs["c4"]} for p in pages[:2]]


async def test_entering_a_file_store_makes_its_page_directories(tmp_path: Path) -> None:
    async with FileStore(tmp_path / "s"):
        pass
    made = await anyio.to_thread.run_sync(lambda: sorted(d.name for d in (tmp_path / "s").iterdir() if d.is_dir()))
    assert made == [f"{i:02x}" for i in range(256)]


def test_blocking_calls_check_their_input_and_a_closed_store_refuses_them(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(ConfigurationError, match=r"page keys are 1\.\.\d+ bytes; got 'a str'"):
        store.exists_blocking(["a str"])  # type: ignore[list-item]
    store.put_blocking(random_pages(1))
    anyio.run(store.aclose)
    for call in (lambda: store.exists_blocking([bytes(32)]), lambda: store.get_blocking([bytes(32)], ["kv"]),
                 lambda: store.put_blocking(random_pages(1))):
        with pytest.raises(StorageError, match="file store is closed"):
            call()


def test_an_os_error_of_a_blocking_call_is_a_storage_error_naming_the_directory(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    page = random_pages(1)[0]
    (tmp_path / page.key.hex()[:2]).write_bytes(b"a file where the page's directory goes")
    with pytest.raises(StorageError, match=rf"file store '{tmp_path}' could not write pages: ") as info:
        store.put_blocking([page])
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(StorageError, match="could not look pages up: "):
        store.exists_blocking([page.key])


# -- SealedPageStore over a BlockingStore -------------------------------------------------


def test_sealed_calls_run_on_the_callers_thread_and_round_trip(tmp_path: Path) -> None:
    threads: list[int] = []
    with SealedPageStore(lambda: FileStore(tmp_path, before_commit=lambda key: threads.append(threading.get_ident())),
                         NS, timeout_s=5) as sealed:
        payloads = [os.urandom(100 + i) for i in range(4)] + [b""]  # a 0-byte page too (V4's anchor)
        keys = [f"{i:064x}" for i in range(5)]
        assert sealed.put(list(zip(keys, payloads))) == [True] * 5
        assert threads == [threading.get_ident()] * 5  # no hop: the put ran here
        assert sealed.exists(keys) == [True] * 5
        assert [bytes(p) if p is not None else None for p in sealed.get(keys)] == payloads
        s = sealed.statistics()
        assert (s.get_hits, s.put_pages, s.put_failed, s.faults) == (5, 5, 0, 0)


def test_a_fault_on_the_callers_thread_is_a_miss_counted_never_an_exception(tmp_path: Path) -> None:
    def die(key: bytes) -> None:
        raise OSError("disk gone")

    with structlog.testing.capture_logs() as logs:
        with SealedPageStore(lambda: FileStore(tmp_path, before_commit=die), NS, timeout_s=5) as sealed:
            assert sealed.put([("aa" * 32, b"page")]) == [False]
            assert sealed.get(["aa" * 32]) == [None]
            s = sealed.statistics()
    assert (s.put_failed, s.faults, s.get_misses) == (1, 1, 1)
    (fault,) = [e for e in logs if e["event"] == "sealed_store.fault"]
    assert fault["operation"] == "put" and "disk gone" in fault["reason"] and fault["storage_error"]


def test_several_engine_threads_at_once_on_a_bounded_store_keep_every_page_and_the_ledger(tmp_path: Path) -> None:
    """Two writers and a reader at once (SGLang's backup and prefetch threads,
    and one more): every page reads back byte for byte, and the bounded
    store's ledgers, kept under a lock now that calls come from several
    threads, add up to the page files on disk."""
    n, threads = 40, 3
    payloads = {f"{t:02x}{i:062x}": os.urandom(200 + i) for t in range(threads) for i in range(n)}
    errors: list[BaseException] = []
    with SealedPageStore(lambda: FileStore(tmp_path, max_bytes="1GiB"), NS, timeout_s=30) as sealed:
        def work(t: int) -> None:
            try:
                mine = [(k, v) for k, v in payloads.items() if k.startswith(f"{t:02x}")]
                for i in range(0, n, 4):
                    assert sealed.put(mine[i:i + 4]) == [True] * 4
                    got = sealed.get([k for k, _ in mine[:i + 4]])
                    assert [bytes(g) if g is not None else None for g in got] == [v for _, v in mine[:i + 4]]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert not errors, errors
        store = sealed.store
        assert isinstance(store, FileStore)
        on_disk = sum(f.stat().st_size for f in tmp_path.glob("??/*.data"))
        usage = store.usage()
        assert usage is not None and usage.used_bytes == on_disk
        assert sealed.statistics().faults == 0


def test_close_waits_for_a_call_running_on_an_engine_thread(tmp_path: Path) -> None:
    """A call on the caller's thread cannot be cancelled: `close` waits for it
    to return before it closes the store (a closed bounded store's ledgers
    must not be in use), and every call after `close` is a miss."""
    entered, release = threading.Event(), threading.Event()

    def slow(key: bytes) -> None:
        entered.set()
        assert release.wait(30)

    sealed = SealedPageStore(lambda: FileStore(tmp_path, max_bytes="1GiB", before_commit=slow), NS, timeout_s=30)
    answers: list[list[bool]] = []
    putter = threading.Thread(target=lambda: answers.append(sealed.put([("ab" * 32, b"page")])))
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (sealed.close(), closed.set()))
    try:
        putter.start()
        assert entered.wait(30)
        closer.start()
        assert not closed.wait(0.3)  # still waiting on the put
    finally:
        release.set()
        putter.join(30)
        closer.join(30)
    assert closed.is_set() and answers == [[True]]  # the put finished whole, then the store closed
    store = sealed.store
    assert isinstance(store, FileStore) and not store._ledgers  # closed after the put, not under it
    assert sealed.put([("cd" * 32, b"later")]) == [False]
    assert sealed.statistics().faults == 1


def test_close_gives_up_on_a_call_that_outlives_timeout_s_and_leaves_the_store_open(tmp_path: Path) -> None:
    entered, release = threading.Event(), threading.Event()

    def stuck(key: bytes) -> None:
        entered.set()
        assert release.wait(30)

    sealed = SealedPageStore(lambda: FileStore(tmp_path, before_commit=stuck), NS)
    sealed.timeout_s = 0.3  # what close waits; opening the store (256 directories) had the default on a loaded machine
    putter = threading.Thread(target=sealed.put, args=([("ab" * 32, b"page")],))
    try:
        putter.start()
        assert entered.wait(30)
        with structlog.testing.capture_logs() as logs:
            sealed.close()
        (failed,) = [e for e in logs if e["event"] == "sealed_store.close_failed"]
        assert "1 call(s) still running" in failed["error"]
    finally:
        release.set()
        putter.join(30)
    assert not sealed._thread.is_alive()  # the loop thread ended all the same


@pytest.mark.parametrize("kind", ["blocking", "hop"])
def test_a_call_from_the_stores_own_loop_thread_is_refused_on_either_path(tmp_path: Path, kind: str) -> None:
    """On the hop's path such a call would wait on itself; on the caller's-thread
    path it would block the loop that serves the store: both refuse it, naming why."""
    opener = (lambda: FileStore(tmp_path)) if kind == "blocking" else MemoryStore
    with SealedPageStore(opener, NS, timeout_s=5) as sealed:
        assert (sealed._blocking is not None) == (kind == "blocking")

        async def from_the_loop() -> None:
            sealed.exists(["ab" * 32])

        future = asyncio.run_coroutine_threadsafe(from_the_loop(), sealed._loop)
        with pytest.raises(WrongEventLoop, match="called from its own loop thread"):
            future.result(10)
        assert sealed.put([("ab" * 32, b"page")]) == [True]  # from this thread, as ever


# -- lookups by size (`SizedLookup`): what SGLang's hit query asks --------------------------------


def test_a_lookup_given_the_page_size_stats_a_file_store_and_answers_what_the_full_lookup_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = {"kv": 0, "c4": 40, "swa": 300}  # a V4 anchor has no bytes
    keys = [f"{i:064x}" for i in range(4)]
    with SealedPageStore(lambda: FileStore(tmp_path), NS, timeout_s=5) as sealed:
        assert isinstance(sealed.store, SizedLookup)
        for pool, n in sizes.items():  # every pool holds the first three pages
            assert sealed.put([(k, os.urandom(n)) for k in keys[:3]], pool=pool) == [True] * 3
        full = sealed.exists_pools([(pool, keys) for pool in sizes])
        opened: list[str] = []
        real_open = os.open
        monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(str(a[0])) or real_open(*a, **k))
        sized = sealed.exists_pools([(pool, keys, n) for pool, n in sizes.items()])
        assert sized == full == [[True, True, True, False]] * 3
        assert opened == []  # a stat a page: no page file opened
        # Mixed, in order, with an empty request between: each answered as asked.
        assert sealed.exists_pools([("c4", keys[:1], 40), ("kv", []), ("swa", keys[2:]), ("kv", keys, 0)]) \
            == [[True], [], [True, False], [True, True, True, False]]
        # The size is the page's: another size finds nothing; none given, the full lookup.
        assert sealed.exists(keys, pool="c4", nbytes=41) == [False] * 4
        assert sealed.prefix_length(keys, pool="c4", nbytes=40) == sealed.prefix_length(keys, pool="c4") == 3
        assert sealed.prefix_length(keys, pool="c4", nbytes=39) == 0
        s = sealed.statistics()
        assert (s.exists_pages, s.exists_found) == (12 + 12 + 7 + 4 + 3 * 4, 9 + 9 + 5 + 0 + 3 + 3 + 0)


def test_a_page_of_the_right_size_with_a_damaged_header_is_found_by_size_and_missed_by_the_read(
    tmp_path: Path,
) -> None:
    """What a lookup by size gives up, and why nothing wrong can land: the read checks."""
    key = "ab" * 32
    with SealedPageStore(lambda: FileStore(tmp_path), NS, timeout_s=5) as sealed:
        assert sealed.put([(key, os.urandom(64))], pool="c4") == [True]
        (path,) = tmp_path.glob("*/*.data")
        raw = bytearray(path.read_bytes())
        raw[0] ^= 0xFF  # the page file's magic
        path.write_bytes(bytes(raw))
        assert sealed.exists([key], pool="c4", nbytes=64) == [True]
        assert sealed.exists([key], pool="c4") == [False]
        assert sealed.get([key], pool="c4", nbytes=64) == [None]


def test_a_lookup_given_the_page_size_on_a_store_that_cannot_tell_by_size_is_the_full_lookup() -> None:
    store = MemoryStore()
    with SealedPageStore(lambda: store, NS, timeout_s=5) as sealed:
        assert not isinstance(sealed.store, SizedLookup)
        assert sealed.put([("cd" * 32, b"page")], pool="c4") == [True]
        assert sealed.exists(["cd" * 32, "ef" * 32], pool="c4", nbytes=4) == [True, False]
        # The size only chooses how a store that can tell looks; the read checks it.
        assert sealed.exists(["cd" * 32], pool="c4", nbytes=5) == [True]
        assert sealed.get(["cd" * 32], pool="c4", nbytes=5) == [None]


@pytest.mark.parametrize("nbytes", [-1, 1.5, "4", True])
def test_a_lookup_refuses_a_page_size_that_is_not_a_byte_count_and_counts_nothing(
    tmp_path: Path, nbytes: object
) -> None:
    with SealedPageStore(lambda: FileStore(tmp_path), NS, timeout_s=5) as sealed:
        with pytest.raises(ConfigurationError, match=r"payload size \(nbytes\) is an integer >= 0") as raised:
            sealed.exists_pools([("kv", ["aa" * 32], nbytes)])  # type: ignore[list-item]
        assert repr(nbytes) in str(raised.value)
        s = sealed.statistics()
        assert (s.exists_pages, s.faults) == (0, 0)
