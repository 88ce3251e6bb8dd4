"""`SealedPageStore`: a kvtier store for engines that call from their own threads.

An engine's storage hooks are plain synchronous calls made from the engine's
threads (SGLang's prefetch and backup threads, for one), while kvtier's stores
are async. `SealedPageStore` owns one asyncio event loop on a daemon thread,
opens the store there, and hands it each batch as one coroutine: one thread hop
per batch, whatever thread asks, and the engine's thread never runs the loop.
`exists_pools`, `get_pools` and `put_pools` take the pages of several pools
(a hybrid model's sidecars) as one batch, one hop for all of them. A store
that can answer on the caller's thread (a `BlockingStore`: `FileStore`) is
called there instead, no hop at all: a local disk answers a lookup faster
than a thread hop and back (see `SealedPageStore` for what that changes).

Pages are raw bytes the engine gives (`kvtier.storage.sealed`): each is sealed
under its kvtier key (the engine's key in an `EngineNamespace`) and its
pool's identity tag before it is stored, and opened against both when it is
read back, so a page that is damaged, cut short, was copied in under another
key, or was written under another identity (model, pool, format, shard)
reads as a miss, counted by the rule it broke.

Faults never reach the caller as exceptions. A store that fails, times out, is
gone, or answers another number of entries than it was asked answers a batch
with misses (``exists``: False, ``get``: None, ``put``:
False for every page) and the fault is counted in `statistics` and logged once
per failed batch (``sealed_store.fault``). What an engine can rely on:

* a page ``get`` returns is byte for byte the payload ``put`` was given under
  that key, in that namespace and pool;
* ``exists`` says what the store holds whole (a commit record and every blob);
  it does not read the bytes, so a page that is present but damaged is found
  by ``exists`` and then missed by ``get``: a prefix becomes shorter, never wrong.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import math
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from kvtier.errors import ConfigurationError, WrongEventLoop
from kvtier.logs import get_logger
from kvtier.storage.base import BlockingStore, Buffer, PageBlobs, SizedLookup, StorageBackend
from kvtier.storage.errors import StorageError, StorageTimeout
from kvtier.storage.sealed import (
    SEAL_HEADER_BYTES,
    TAG_BYTES,
    EngineNamespace,
    SealBroken,
    UnsupportedPayload,
    open_sealed,
    seal,
    seal_tensor,
)

__all__ = ["ClearableStore", "SealedPageStore", "SealedStoreStatistics"]

log = get_logger(__name__)

_T = TypeVar("_T")

# The probe page (`SealedPageStore.probe`): one fixed key in a pool no engine page uses.
_PROBE_KEY = b"kvtier sealed store probe"
_PROBE_POOL = "probe"
_PROBE_BYTES = b"kvtier sealed store probe, format 1\n" * 4


@runtime_checkable
class ClearableStore(Protocol):
    """A store that can drop every page it holds (`FileStore`, `RedisStore`, `MemoryStore`)."""

    async def clear(self) -> int:
        """Remove every page under this store's directory or prefix; how many pages went."""
        ...


@dataclass(frozen=True, slots=True)
class SealedStoreStatistics:
    """Counters of one `SealedPageStore` since it opened (pages, not calls, unless named so).

    ``faults``: batches the store failed (error, timeout, or an answer of
    another length than the batch), each answered with misses; ``broken``:
    pages read whole that failed their seal, by rule (``"checksum"``,
    ``"length"``, ...), each answered as a miss.

    A page ``get`` asked for is counted once, in one of four: ``get_hits``
    (handed back), ``get_misses`` (not stored), ``get_refused`` (stored but
    refused by its seal: damaged, torn, foreign; the sum of ``broken``) or
    ``get_failed`` (its batch faulted: the store never answered for it).
    ``put_skipped``: pages an engine's store admission policy refused before
    a put (the store never counts them itself: `KvtierHiCacheStorage.statistics`
    fills them in), by reason in ``put_skipped_by_reason``.
    """

    exists_pages: int
    exists_found: int
    get_pages: int
    get_hits: int
    get_misses: int
    put_pages: int
    put_failed: int
    bytes_read: int
    bytes_written: int
    faults: int
    broken: dict[str, int]
    put_skipped: int = 0
    put_skipped_by_reason: dict[str, int] = field(default_factory=dict)
    get_refused: int = 0
    get_failed: int = 0


class _Counters:
    """The mutable counters behind `SealedStoreStatistics`; engine threads update them under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.exists_pages = self.exists_found = 0
        self.get_pages = self.get_hits = self.get_misses = self.get_refused = self.get_failed = 0
        self.put_pages = self.put_failed = 0
        self.bytes_read = self.bytes_written = 0
        self.faults = 0
        self.broken: dict[str, int] = {}


class SealedPageStore:
    """Sealed raw pages in a kvtier store, asked synchronously from any thread.

    ``open_store`` builds the `StorageBackend` (``lambda: FileStore(path)``);
    it is called on the store's own loop thread, so a client that binds to
    its event loop (redis-py) binds to that one. ``namespace`` turns the
    engine's keys into kvtier's. ``timeout_s`` bounds each batch: a batch
    still running then is cancelled and answered with misses.

    Raises `ConfigurationError` for a ``timeout_s`` that is not a finite
    number of seconds > 0, and when the store cannot be opened (the cause
    chained), so a bad configuration fails at engine start rather than as
    misses later. Call `close` when done: it ends every call still in flight
    at once (each answered with misses); the loop thread is a daemon, and a
    store dropped without `close` is closed, its thread ended, when it is
    garbage-collected.

    A `BlockingStore` (`FileStore`) is opened and closed on the loop thread
    but answers each call on the caller's thread, so ``timeout_s`` does not
    bound those calls (a local disk's call cannot be abandoned half way; a
    directory on a network filesystem that stops answering holds the
    caller, as any file read would), and `close` waits, at most ``timeout_s``,
    for the calls running to return before it closes the store.
    Calling it from its own loop thread raises `RuntimeError` (it would wait
    on itself).
    """

    def __init__(
        self,
        open_store: Callable[[], StorageBackend],
        namespace: EngineNamespace,
        *,
        timeout_s: float = 30.0,
        thread_name: str = "kvtier-sealed-store",
    ) -> None:
        if not callable(open_store):
            raise ConfigurationError(f"SealedPageStore needs open_store, a callable returning a store; got {open_store!r:.80}")
        if (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
            or not math.isfinite(timeout_s) or not 0 < timeout_s <= threading.TIMEOUT_MAX
        ):
            raise ConfigurationError(
                f"SealedPageStore timeout_s must be a finite number of seconds > 0 "
                f"(at most {threading.TIMEOUT_MAX:g}); got {timeout_s!r}"
            )
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self._counters = _Counters()
        # Calls waiting on the loop thread; `close` cancels them, so none waits out timeout_s.
        self._lock = threading.Lock()
        self._closed = False
        self._in_flight: set[concurrent.futures.Future[Any]] = set()
        self._calling = 0  # calls a BlockingStore is answering on the callers' threads
        self._idle = threading.Condition(self._lock)  # notified when the last of those returns
        self._loop = asyncio.new_event_loop()
        # The thread holds the loop, never this object: one dropped without
        # `close` is collected, and its finalizer (below) ends the thread.
        self._thread = threading.Thread(target=_serve, args=(self._loop,), name=thread_name, daemon=True)
        self._thread.start()

        async def opened() -> StorageBackend:
            store = open_store()
            # A non-store would fail later, in the engine's thread, as an AttributeError.
            lacking = [m for m in ("exists", "get", "put", "aclose") if not callable(getattr(store, m, None))]
            if lacking:
                raise ConfigurationError(
                    f"open_store must return a StorageBackend (FileStore, RedisStore, ...); it returned "
                    f"{store!r:.80}, which has no {', '.join(lacking)}"
                )
            enter = getattr(store, "__aenter__", None)
            if enter is not None:
                await enter()
            return store

        try:
            self.store: StorageBackend = self._submit(opened()).result(self.timeout_s)
        except BaseException as exc:
            self._stop_loop()
            # A timeout's own text is empty: say what ran out.
            why = (f"it did not open within timeout_s={self.timeout_s:g} s"
                   if isinstance(exc, concurrent.futures.TimeoutError) else str(exc))
            raise ConfigurationError(f"could not open the store for {namespace.engine!r}: {why}") from exc
        # Answered on the caller's thread, no hop (the module doc).
        self._blocking: BlockingStore | None = self.store if isinstance(self.store, BlockingStore) else None
        self._sized: SizedLookup | None = self.store if isinstance(self._blocking, SizedLookup) else None
        # Dropped without `close` (an engine that relies on garbage collection):
        # close the store and stop the loop thread, without waiting on it (the
        # collector may run on any thread, the loop's own included).
        self._finalizer = weakref.finalize(self, _release, self._loop, self.store)
        self._finalizer.atexit = False  # at exit the daemon thread just ends

    # -- the loop thread -------------------------------------------------------

    def _submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, operation: str, npages: int, coro: Coroutine[Any, Any, _T]) -> _T | None:
        """``coro``'s result on the loop thread, or None after a fault (counted, logged)."""
        if threading.get_ident() == self._thread.ident:
            coro.close()
            raise WrongEventLoop("SealedPageStore was called from its own loop thread; call it from the engine's threads")
        with self._lock:
            if self._closed:
                coro.close()
                future = None
            else:
                future = self._submit(coro)
                self._in_flight.add(future)
        if future is None:
            self._fault(operation, npages, "closed", None)
            return None
        try:
            return future.result(self.timeout_s)
        # these two are the caller's waits ending, not errors of the store (storage_error=False)
        except concurrent.futures.CancelledError:  # `close` ended it
            self._fault(operation, npages, "closed while the call was in flight", None)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self._fault(operation, npages, f"no answer within {self.timeout_s:g} s", None)
        except Exception as exc:  # noqa: BLE001 - every fault of the store is a miss for the engine
            self._fault(operation, npages, f"{type(exc).__name__}: {exc}", exc)
        finally:
            with self._lock:
                self._in_flight.discard(future)
        return None

    def _ask(
        self, operation: str, npages: int, blocking: Callable[[BlockingStore], _T],
        hop: Callable[[], Coroutine[Any, Any, _T]],
    ) -> _T | None:
        """One batch: ``blocking(store)`` on this thread for a `BlockingStore`,
        else ``hop()`` on the loop thread; None after a fault (counted, logged)."""
        store = self._blocking
        if store is None:
            return self._run(operation, npages, hop())
        if threading.get_ident() == self._thread.ident:
            raise WrongEventLoop("SealedPageStore was called from its own loop thread; call it from the engine's threads")
        with self._lock:
            closed = self._closed
            if not closed:
                self._calling += 1
        if closed:
            self._fault(operation, npages, "closed", None)
            return None
        try:
            return blocking(store)
        except Exception as exc:  # noqa: BLE001 - every fault of the store is a miss for the engine
            self._fault(operation, npages, f"{type(exc).__name__}: {exc}", exc)
            return None
        finally:
            with self._lock:
                self._calling -= 1
                if not self._calling:
                    self._idle.notify_all()

    def _answer(self, operation: str, npages: int, answer: Sequence[_T] | None) -> Sequence[_T] | None:
        """``answer`` if it has one entry per page asked, else None: an answer of
        another length (a store bug) is a fault, never matched up page by page."""
        if answer is None or (isinstance(answer, Sequence) and len(answer) == npages):
            return answer
        got = f"{len(answer)} entries" if isinstance(answer, Sequence) else type(answer).__name__
        self._fault(operation, npages, f"the store answered {got} for {npages} pages", None)
        return None

    def _fault(self, operation: str, npages: int, reason: str, exc: BaseException | None) -> None:
        with self._counters.lock:
            self._counters.faults += 1
        log.warning(
            "sealed_store.fault", operation=operation, pages=npages, reason=reason,
            store=getattr(self.store, "name", "?"),  # calls begin once the store is open
            storage_error=isinstance(exc, StorageError),
        )

    # -- pages -------------------------------------------------------------------

    def pool_tag(self, pool: str) -> bytes:
        """The identity tag pages of ``pool`` are sealed under when the caller gives
        none: 8 bytes of the namespace's root and the pool's name, so a blob
        written in another namespace or pool reads as rule ``"identity"``."""
        h = hashlib.blake2b(self.namespace.root(), digest_size=TAG_BYTES, person=b"kvtier-sealtag")
        h.update(pool.encode("utf-8"))
        return h.digest()

    def exists(
        self, engine_keys: Sequence[str | bytes], *, pool: str = "kv", nbytes: int | None = None
    ) -> list[bool]:
        """For each key, whether its page is stored whole (not whether its bytes are
        intact: `get` checks). With ``nbytes`` (a whole page's payload bytes), a store
        that can tell a page by its size (`SizedLookup`) looks it up by size alone."""
        return self.exists_pools([(pool, engine_keys, nbytes)])[0]

    def exists_pools(
        self, requests: Sequence[tuple[str, Sequence[str | bytes]] | tuple[str, Sequence[str | bytes], int | None]]
    ) -> list[list[bool]]:
        """`exists` for several pools at once, ``(pool, engine_keys)`` or
        ``(pool, engine_keys, nbytes)`` each, in one hop to the store's thread:
        for each request, for each key, whether its page is stored whole. A
        fault answers every request with False.

        With ``nbytes`` (the payload bytes a whole page of that pool has; None:
        not given) and a store that can look a page up by its size alone (a
        `SizedLookup`: `FileStore`, one ``stat`` a page instead of a read of its
        header), a page is found when it is stored with the size a sealed page
        of ``nbytes`` has. A page of that size whose header is damaged is then
        found, and `get` misses it, as it misses one whose bytes are damaged.
        Raises `ConfigurationError` for an ``nbytes`` that is not an integer >= 0."""
        sizes = [_payload_size(r[2]) if len(r) > 2 else None for r in requests]
        keys = [self.namespace.keys(r[1], pool=r[0]) for r in requests]
        flat = [k for pool_keys in keys for k in pool_keys]  # a key names its pool: one lookup for all
        total = len(flat)
        sized = self._sized if any(n is not None for n in sizes) else None

        def look_here(store: BlockingStore) -> list[bool]:
            if sized is None:
                return store.exists_blocking(flat)
            found: list[bool] = []
            for r, pool_keys, n in zip(requests, keys, sizes):
                if pool_keys:
                    found += (store.exists_blocking(pool_keys) if n is None
                              else sized.exists_sized_blocking(pool_keys, {r[0]: SEAL_HEADER_BYTES + n}))
            return found

        found = self._answer("exists", total, self._ask(
            "exists", total, look_here, lambda: self.store.exists(flat))) if flat else []
        answer = [bool(f) for f in found] if found is not None else [False] * total
        out, at = [], 0
        for pool_keys in keys:
            out.append(answer[at:at + len(pool_keys)])
            at += len(pool_keys)
        with self._counters.lock:
            self._counters.exists_pages += total
            self._counters.exists_found += sum(sum(o) for o in out)
        return out

    def prefix_length(self, engine_keys: Sequence[str | bytes], *, pool: str = "kv", nbytes: int | None = None) -> int:
        """How many of ``engine_keys``, from the first, `exists` finds without a gap."""
        found = self.exists(engine_keys, pool=pool, nbytes=nbytes)
        return found.index(False) if False in found else len(found)

    def get(
        self, engine_keys: Sequence[str | bytes], *, pool: str = "kv", nbytes: int | None = None,
        tag: bytes | None = None,
    ) -> list[memoryview | None]:
        """For each key, its payload as `put` was given it (a read-only view), or None:
        not stored, damaged, torn, sealed under another key, pool or identity
        ``tag`` (default `pool_tag`), not ``nbytes`` long, or the store failed.
        Never raises for a fault of the store."""
        return self.get_pools([(pool, engine_keys, nbytes, tag)])[0]

    def get_pools(
        self, requests: Sequence[tuple[str, Sequence[str | bytes], int | None, bytes | None]]
    ) -> list[list[memoryview | None]]:
        """`get` for several pools at once, ``(pool, engine_keys, nbytes, tag)``
        each, in one hop to the store's thread; for each request, each page's
        payload or None, as `get` answers. A fault answers every request with None."""
        keys = [self.namespace.keys(engine_keys, pool=pool) for pool, engine_keys, _, _ in requests]
        total = sum(len(k) for k in keys)
        store = self.store

        async def read() -> list[list[dict[str, bytes] | None]]:
            return [await store.get(k, [pool]) if k else [] for k, (pool, _, _, _) in zip(keys, requests)]

        def read_here(here: BlockingStore) -> list[list[dict[str, bytes] | None]]:
            return [here.get_blocking(k, [pool]) if k else [] for k, (pool, _, _, _) in zip(keys, requests)]

        got = self._ask("get", total, read_here, read) if total else [[] for _ in keys]
        if got is not None and any(self._answer("get", len(k), g) is None for k, g in zip(keys, got)):
            got = None  # one answer of another length: the store is not trusted for the batch
        out: list[list[memoryview | None]] = []
        broken: list[tuple[str, str]] = []
        read_bytes = hits = 0
        for i, (pool, _, nbytes, tag) in enumerate(requests):
            tag = self.pool_tag(pool) if tag is None else tag
            pages = list(got[i]) if got is not None else [None] * len(keys[i])
            answer: list[memoryview | None] = []
            for key, page in zip(keys[i], pages):
                blob = None if page is None else page.get(pool)
                if blob is None:
                    answer.append(None)
                    continue
                try:
                    payload = open_sealed(key, blob, tag=tag, nbytes=nbytes)
                except SealBroken as exc:
                    broken.append((pool, exc.rule))
                    answer.append(None)
                    continue
                read_bytes += len(payload)
                hits += 1
                answer.append(payload)
            out.append(answer)
        c = self._counters
        with c.lock:
            c.get_pages += total
            c.get_hits += hits
            failed = total if got is None else 0
            c.get_failed += failed
            c.get_refused += len(broken)
            c.get_misses += total - hits - len(broken) - failed
            c.bytes_read += read_bytes
            for _, rule in broken:
                c.broken[rule] = c.broken.get(rule, 0) + 1
        for pool in sorted({p for p, _ in broken}):
            rules = sorted({r for p, r in broken if p == pool})
            log.warning("sealed_store.pages_broken", pool=pool, pages=sum(p == pool for p, _ in broken), rules=rules)
        return out

    def put(
        self, items: Sequence[tuple[str | bytes, Buffer | torch.Tensor]], *, pool: str = "kv", tag: bytes | None = None
    ) -> list[bool]:
        """Seal (under identity ``tag``, default `pool_tag`) and store each
        ``(engine_key, payload)``; for each, whether it is now stored.

        A payload is bytes-like or a CPU tensor (copied once from where it
        lies, strided or not). Sealing runs on the calling thread; the store
        sees one batch. After a fault every page reads False (some may have
        landed whole; `exists` tells). Raises `ValueError` for a bad key and
        `UnsupportedPayload` naming the payload (its place, key and type) for
        one of another kind; then nothing of the batch is stored or counted.
        """
        return self.put_pools([(pool, items, tag)])[0]

    def put_pools(
        self, requests: Sequence[tuple[str, Sequence[tuple[str | bytes, Buffer | torch.Tensor]], bytes | None]]
    ) -> list[list[bool]]:
        """`put` for several pools at once, ``(pool, items, tag)`` each: every
        page sealed on the calling thread, then one batch in one hop to the
        store's thread; for each request, for each page, whether it is stored
        (a fault: False for every page of every request). Raises as `put`
        does, and then nothing of any request is stored or counted."""
        pages: list[PageBlobs] = []
        written = 0
        for pool, items, tag in requests:
            keys = self.namespace.keys([k for k, _ in items], pool=pool)
            tag = self.pool_tag(pool) if tag is None else tag
            for i, (key, (engine_key, payload)) in enumerate(zip(keys, items)):
                try:
                    if isinstance(payload, torch.Tensor):
                        blob = seal_tensor(key, payload, tag=tag)
                    else:
                        blob = seal(key, payload, tag=tag)
                except UnsupportedPayload as exc:
                    raise UnsupportedPayload(
                        f"SealedPageStore.put payload {i} (key {engine_key!r:.80}): {exc}", value_type=exc.value_type
                    ) from None
                written += len(blob)
                pages.append(PageBlobs(key, {pool: blob}))
        ok = bool(pages) and bool(self._ask(
            "put", len(pages), lambda store: _put_here(store, pages), lambda: self._put(pages)))  # None: a fault
        with self._counters.lock:
            self._counters.put_pages += len(pages)
            if ok:
                self._counters.bytes_written += written
            else:
                self._counters.put_failed += len(pages)
        return [[ok] * len(items) for _, items, _ in requests]

    def probe(self) -> None:
        """Put one small sealed page (a fixed probe key in pool ``"probe"``),
        look it up and read it back, checked, so that a store that cannot work
        fails the engine's start instead of answering every later call with
        misses. Engines starting together write the same bytes (puts are
        idempotent), so none reads another's probe as a mismatch.

        Raises `StorageError` saying what failed, the store's error chained
        (`kvtier.storage.StorageTimeout` when it gives no answer within ``timeout_s``).
        """
        key = self.namespace.key(_PROBE_KEY, pool=_PROBE_POOL)
        tag = self.pool_tag(_PROBE_POOL)
        blob = seal(key, _PROBE_BYTES, tag=tag)
        store = self.store

        async def round_trip() -> tuple[bool, bytes | None]:
            await store.put([PageBlobs(key, {_PROBE_POOL: blob})])
            (present,) = await store.exists([key])
            (got,) = await store.get([key], [_PROBE_POOL])
            return present, None if got is None else got.get(_PROBE_POOL)

        name = getattr(store, "name", type(store).__name__)
        if self._closed:
            raise StorageError(f"{name}: the probe found the SealedPageStore closed", backend=name, operation="probe")
        future = self._submit(round_trip())
        try:
            present, got = future.result(self.timeout_s)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise StorageTimeout(f"{name}: the probe page got no answer within {self.timeout_s:g} s",
                                 backend=name, operation="probe", timeout_s=self.timeout_s) from exc
        except Exception as exc:
            raise StorageError(f"{name}: the probe page failed: {type(exc).__name__}: {exc}",
                               backend=name, operation="probe") from exc
        if not present or got is None:
            raise StorageError(f"{name}: a probe page just put did not read back whole", backend=name, operation="probe")
        try:
            payload = open_sealed(key, got, tag=tag, nbytes=len(_PROBE_BYTES))
        except SealBroken as exc:
            raise StorageError(f"{name}: the probe page read back broken ({exc.rule}): {exc}",
                               backend=name, operation="probe") from exc
        if bytes(payload) != _PROBE_BYTES:  # whole and sealed right, but another page (another release's probe)
            raise StorageError(f"{name}: the probe page read back other bytes", backend=name, operation="probe")

    async def _put(self, pages: list[PageBlobs]) -> bool:
        await self.store.put(pages)
        return True

    def clear(self) -> bool:
        """Remove every page of this store (its directory or prefix); False if
        the store cannot clear (not a `ClearableStore`) or failed."""
        store = self.store
        if not isinstance(store, ClearableStore):
            log.warning("sealed_store.clear_unsupported", store=getattr(store, "name", type(store).__name__))
            return False
        return self._run("clear", 0, store.clear()) is not None

    def statistics(self) -> SealedStoreStatistics:
        c = self._counters
        with c.lock:
            return SealedStoreStatistics(
                exists_pages=c.exists_pages, exists_found=c.exists_found,
                get_pages=c.get_pages, get_hits=c.get_hits, get_misses=c.get_misses,
                put_pages=c.put_pages, put_failed=c.put_failed,
                bytes_read=c.bytes_read, bytes_written=c.bytes_written,
                faults=c.faults, broken=dict(c.broken), get_refused=c.get_refused, get_failed=c.get_failed,
            )

    def close(self) -> None:
        """End every call in flight at once (each answered with misses, counted
        as a fault), close the store and stop the loop thread. Idempotent;
        waits at most ``timeout_s`` for the store to close."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            in_flight = list(self._in_flight)
        self._finalizer.detach()
        for future in in_flight:
            future.cancel()  # its caller wakes now; the loop cancels the batch's task
        with self._lock:  # a BlockingStore's calls cannot be cancelled: they return, then it closes
            returned = self._idle.wait_for(lambda: not self._calling, self.timeout_s)
            running = self._calling
        if not returned:
            log.warning("sealed_store.close_failed", error=f"{running} call(s) still running on the engine's "
                        f"threads after {self.timeout_s:g} s: the store is left open")
            self._stop_loop()
            return
        try:
            self._submit(self.store.aclose()).result(self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - closing is best effort: the process may be going down
            log.warning("sealed_store.close_failed", error=f"{type(exc).__name__}: {exc}")
        self._stop_loop()

    def _stop_loop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.timeout_s)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> SealedPageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.statistics()
        state = "closed" if self._closed else "open"
        return (
            f"<SealedPageStore {getattr(self.store, 'name', '?')} ns={self.namespace.label()} {state} "
            f"[get: {s.get_hits} hits, {s.get_misses} misses | put: {s.put_pages - s.put_failed}/{s.put_pages} | "
            f"faults: {s.faults}]>"
        )


def _payload_size(nbytes: object) -> int | None:
    """``nbytes`` (a page's payload bytes, or None: not known), if it is None or an integer >= 0."""
    if nbytes is not None and (type(nbytes) is not int or nbytes < 0):
        raise ConfigurationError(f"a page's payload size (nbytes) is an integer >= 0 or None; got {nbytes!r:.80}")
    return nbytes


def _put_here(store: BlockingStore, pages: list[PageBlobs]) -> bool:
    store.put_blocking(pages)
    return True


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """A `SealedPageStore`'s loop thread: run ``loop`` until it is stopped, then close it."""
    try:
        loop.run_forever()
    finally:
        loop.close()


def _release(loop: asyncio.AbstractEventLoop, store: StorageBackend) -> None:
    """Close ``store`` on ``loop``, then stop the loop (its thread closes it);
    never waits, so it may run on any thread, during garbage collection."""

    async def shut_down() -> None:
        try:
            await store.aclose()
        except Exception as exc:  # noqa: BLE001 - nobody is left to tell but the log
            log.warning("sealed_store.close_failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            loop.stop()

    try:
        asyncio.run_coroutine_threadsafe(shut_down(), loop)
    except RuntimeError:  # the loop is closed already
        pass
