"""Storage operations of `TransferScheduler`: host -> storage and storage -> host.

`write_storage` puts host pages (held by the caller, e.g. after a backup)
into the scheduler's `StorageBackend` under their page keys; `prefetch` takes
host slots (atomically across pools, as a backup does), looks its keys up,
and reads the longest run of stored pages from the first key into them.

Both go through the scheduler's queue, each in a lane of its own with a
dispatch loop of its own (a slow store never holds a device copy back), and
are batched: one ``exists`` lookup per batch, then reads or writes in rounds
of about ``SchedulerConfig.storage_chunk_bytes``. Serialising pages to bytes
and back runs in a worker thread, never on the event loop.

Host pages keep one owner at a time (`HostPageOwnership`): a write reads its
pages as a load does (a free of them is deferred, a backup still writing them
is waited for); a prefetch writes its pages as a backup does, and at its end
hands the completed ones to the caller and frees the rest, exactly once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread
import structlog

from kvtier.errors import (
    CorruptionDetected,
    InvalidIndices,
    OperationCancelled,
    TransferFailed,
)
from kvtier.pools import PoolGroup
from kvtier.scheduler import verify as verify_pages
from kvtier.scheduler.storage_handle import (
    DONE,
    PREFETCH_POLICIES,
    QUEUED,
    RUNNING,
    PrefetchHandle,
    StorageDirection,
    StorageHandle,
    WriteStorageHandle,
    WriteStorageResult,
)
from kvtier.storage.base import MAX_KEY_BYTES, PageBlobs, StorageBackend
from kvtier.storage.errors import StorageError
from kvtier.storage.pages import decode_page, encode_page, page_members

if TYPE_CHECKING:
    from kvtier.scheduler.scheduler import IndexLike, TransferScheduler

__all__ = ["StorageLanes"]

log = structlog.get_logger(__name__)

# Storage batches of one lane in flight at once: one fetching or putting while
# the next one's lookup runs.
STORAGE_BATCHES_IN_FLIGHT = 2
# Prefetches of one batch that read from the store at the same time.
PREFETCHES_IN_FLIGHT = 8


class StorageLanes:
    """The storage half of a `TransferScheduler` with a storage backend: its
    two lanes, their batches and handles. It uses the scheduler's queue,
    ownership records, counters and task group; the scheduler's
    `~TransferScheduler.write_storage` and `~TransferScheduler.prefetch` call it."""

    def __init__(self, scheduler: TransferScheduler, storage: StorageBackend) -> None:
        self._s = scheduler
        self.group = scheduler.group
        self._storage = storage
        # Per slot-owning pool, the pools with bytes stored with its pages, and
        # the bytes of one page of it with its sidecars' rows.
        self._storage_members = storage_members(scheduler.group)
        self._page_bytes = {
            name: own + sum(b for _, b in sidecars) for name, (own, sidecars) in scheduler._bytes_per_page.items()
        }

    # -- submission ----------------------------------------------------------

    async def write_storage(
        self,
        host_indices: Mapping[str, IndexLike],
        keys: Mapping[str, Sequence[bytes]],
        *,
        priority: int = 0,
    ) -> WriteStorageHandle:
        """See `TransferScheduler.write_storage`."""
        queue = self._s._check_open()
        host = self._s._validate(host_indices, side="host")
        host_pages = {name: pages for name, (_, pages) in host.items()}
        key_lists = self._validate_keys(keys, {name: len(p) for name, p in host_pages.items()})
        await self._s._wait_for_writers(host_pages)
        queue = self._s._check_open()
        for name, pages in host_pages.items():
            self._s._ownership[name].check_readable(pages)
        for name, pages in host_pages.items():
            self._s._ownership[name].pin(pages)
        assert self._s._loop is not None
        handle = WriteStorageHandle(
            next(self._s._ids), StorageDirection.WRITE, self, self._s._loop.create_future(),
            keys=key_lists, host_pages=host_pages, priority=priority,
            nbytes=sum(len(p) * self._page_nbytes(name) for name, p in host_pages.items()),
        )
        await self._enqueue_storage(queue, handle)
        return handle

    async def prefetch(
        self,
        keys: Mapping[str, Sequence[bytes]],
        *,
        policy: str = "best_effort",
        timeout_s: float | None = None,
        priority: int = 0,
        all_pools: bool = False,
    ) -> PrefetchHandle:
        """See `TransferScheduler.prefetch`."""
        queue = self._s._check_open()
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch policy must be one of {list(PREFETCH_POLICIES)}; got {policy!r}")
        if policy == "timeout":
            if (
                isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                or not math.isfinite(timeout_s) or timeout_s <= 0
            ):
                raise ValueError(f"prefetch policy 'timeout' needs timeout_s, a finite number > 0; got {timeout_s!r}")
        elif timeout_s is not None:
            raise ValueError(
                f"timeout_s applies to policy 'timeout' only; got timeout_s={timeout_s!r} with policy {policy!r}"
            )
        if not isinstance(all_pools, bool):
            raise ValueError(f"all_pools must be a bool; got {all_pools!r}")
        key_lists = self._validate_keys(keys)
        pages = await self._s._allocate_host({name: len(k) for name, k in key_lists.items()})
        assert self._s._loop is not None
        handle = PrefetchHandle(
            next(self._s._ids), StorageDirection.PREFETCH, self, self._s._loop.create_future(),
            keys=key_lists, host_pages=pages, priority=priority, policy=policy, all_pools=all_pools,
            nbytes=sum(len(p) * self._page_nbytes(name) for name, p in pages.items()),
        )
        for name, p in pages.items():
            self._s._ownership[name].start_write(p, handle)
        submitted = self._s._loop.time()
        await self._enqueue_storage(queue, handle)
        if policy == "timeout" and handle._state != DONE:
            # Armed once queued (a stop must not race the wait for room), with
            # the time that wait took off the deadline.
            assert timeout_s is not None
            handle._timer = self._s._loop.call_later(
                max(0.0, timeout_s - (self._s._loop.time() - submitted)), handle.stop
            )
        return handle

    def _validate_keys(
        self, keys: Mapping[str, Sequence[bytes]], counts: Mapping[str, int] | None = None
    ) -> dict[str, list[bytes]]:
        """``keys`` as lists of valid keys. ``counts``: a write's pages per pool,
        which the keys must match one for one; None for a prefetch, whose pools
        are the keys' own (known, not sidecars), each with at least one key."""
        if not isinstance(keys, Mapping):
            raise InvalidIndices(
                f"keys must be a mapping of pool name to page keys; got {type(keys).__name__}", rule="mapping"
            )
        if counts is None:
            if not keys:
                raise InvalidIndices("a prefetch names at least one pool; got no keys", rule="non-empty")
            for name in keys:
                self._s._spec(name)
        elif set(keys) != set(counts):
            raise InvalidIndices(
                f"keys must name the same pools as the host indices ({sorted(counts)}); got {sorted(map(str, keys))}",
                rule="same-pools",
            )
        out: dict[str, list[bytes]] = {}
        for name in keys:
            if not self._storage_members.get(name):
                raise InvalidIndices(
                    f"pool {name!r} and its sidecars hold no bytes; there is nothing to store",
                    pool=name, rule="pool-has-bytes",
                )
            value = keys[name]
            if isinstance(value, (bytes, str)) or not isinstance(value, Sequence):
                raise InvalidIndices(
                    f"pool {name!r} needs a sequence of page keys (bytes); got {type(value).__name__}",
                    pool=name, rule="page-keys",
                )
            listed = list(value)
            if counts is None and not listed:
                raise InvalidIndices(f"pool {name!r} needs at least one page key; got none", pool=name, rule="page-keys")
            if counts is not None and len(listed) != counts[name]:
                raise InvalidIndices(
                    f"pool {name!r} names {counts[name]} pages and {len(listed)} keys; one key per page",
                    pool=name, rule="one-key-per-page",
                )
            for i, key in enumerate(listed):
                if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
                    raise InvalidIndices(
                        f"pool {name!r} key {i} must be 1..{MAX_KEY_BYTES} bytes; got {key!r:.80}",
                        pool=name, rule="page-keys",
                    )
            out[name] = listed
        return out

    async def _enqueue_storage(self, queue: Any, handle: StorageHandle) -> None:
        try:
            await queue.put(handle)
        except BaseException as exc:
            # Never queued, never counted: undo and resolve (a load may wait on a prefetch).
            error = exc if isinstance(exc, Exception) else OperationCancelled(
                f"submission of operation {handle.id} was cancelled"
            )
            self._release_storage(handle, result=None, error=error)
            handle._resolve(None, error)
            raise
        self._s._counters[handle.direction].submitted += 1

    def _page_nbytes(self, pool: str) -> int:
        """Bytes of one page of anchor ``pool`` with its sidecars' rows."""
        return self._page_bytes[pool]

    # -- batches -------------------------------------------------------------

    async def dispatch_loop(
        self,
        direction: StorageDirection,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        assert self._s._queue is not None and self._s._tg is not None
        cfg = self._s.config
        slots = anyio.Semaphore(STORAGE_BATCHES_IN_FLIGHT)
        run = self._run_write_batch if direction is StorageDirection.WRITE else self._run_prefetch_batch
        task_status.started()
        while True:
            await slots.acquire()
            entries = await self._s._queue.take_batch(direction, cfg.max_batch_bytes, cfg.max_batch_ops)
            if entries is None:
                slots.release()
                return
            handles: list[Any] = list(entries)
            now = time.perf_counter()
            for h in handles:
                h._state = RUNNING
                h._t_dispatch = now
            self._s._counters[direction].batch_taken(len(handles))
            log.debug("batch.dispatched", direction=direction.value, operations=len(handles))
            self._s._tg.start_soon(run, handles, slots)

    def _pages_per_round(self, pool: str) -> int:
        """Pages of ``pool`` per read or write round (at least one)."""
        return max(1, self._s.config.storage_chunk_bytes // self._page_nbytes(pool))

    async def _run_write_batch(
        self, handles: list[WriteStorageHandle], slots: anyio.Semaphore
    ) -> None:
        backend = self._storage
        assert backend is not None
        error: BaseException | None = None
        written = {h: dict.fromkeys(h._keys, 0) for h in handles}
        present_count = {h: dict.fromkeys(h._keys, 0) for h in handles}
        left = {h: sum(len(k) for k in h._keys.values()) for h in handles}
        looked_up = False
        try:
            if self._s.config.verify:
                await self._drop_corrupted_writes(handles)
            todo: list[tuple[WriteStorageHandle, str, int]] = [
                (h, pool, i)
                for h in handles if h._state != DONE
                for pool, ks in h._keys.items() for i in range(len(ks))
            ]
            present = await _exists(backend, [h._keys[pool][i] for h, pool, i in todo])
            looked_up = True
            # A key missing for several operations (a shared prefix) is put once,
            # by the first; the others count it as present once that put landed.
            missing: list[tuple[WriteStorageHandle, str, int]] = []
            sharers: dict[bytes, list[tuple[WriteStorageHandle, str]]] = {}
            for (h, pool, i), stored in zip(todo, present):
                key = h._keys[pool][i]
                if stored:
                    present_count[h][pool] += 1
                    left[h] -= 1
                elif key in sharers:
                    sharers[key].append((h, pool))
                else:
                    sharers[key] = []
                    missing.append((h, pool, i))

            def wanted(h: WriteStorageHandle) -> bool:
                return not h._cancel_requested and h._state != DONE

            for chunk in self._write_rounds(missing):
                chunk = [
                    (h, pool, i) for h, pool, i in chunk
                    if wanted(h) or any(wanted(o) for o, _ in sharers[h._keys[pool][i]])
                ]
                if not chunk:
                    continue
                pages = await anyio.to_thread.run_sync(self._encode_pages, chunk)
                await backend.put(pages)
                for h, pool, i in chunk:
                    written[h][pool] += 1
                    left[h] -= 1
                    for other, other_pool in sharers[h._keys[pool][i]]:
                        present_count[other][other_pool] += 1
                        left[other] -= 1
        except Exception as exc:
            error = _storage_failure(exc, "write_storage", handles)
        except BaseException:
            error = OperationCancelled("a write_storage batch was interrupted by cancellation")
            raise
        finally:
            for h in handles:
                if h._state == DONE:
                    continue
                if h._cancel_requested:
                    self._finish_storage(h, error=OperationCancelled(f"operation {h.id} was cancelled"))
                elif error is not None and (left[h] or not looked_up):
                    self._finish_storage(h, error=error)
                else:
                    nbytes = sum(n * self._page_nbytes(p) for p, n in written[h].items())
                    now = time.perf_counter()
                    self._finish_storage(h, result=WriteStorageResult(
                        h.id, {p: len(k) for p, k in h._keys.items()}, written[h], present_count[h], nbytes,
                        seconds_queued=h._t_dispatch - h._t_submit, seconds_total=now - h._t_submit,
                    ))
            slots.release()

    def _write_rounds(
        self, todo: list[tuple[WriteStorageHandle, str, int]]
    ) -> list[list[tuple[WriteStorageHandle, str, int]]]:
        """``todo`` in rounds of about ``storage_chunk_bytes`` (at least one page each)."""
        rounds: list[list[tuple[WriteStorageHandle, str, int]]] = []
        current: list[tuple[WriteStorageHandle, str, int]] = []
        size = 0
        limit = self._s.config.storage_chunk_bytes
        for item in todo:
            nbytes = self._page_nbytes(item[1])
            if current and size + nbytes > limit:
                rounds.append(current)
                current, size = [], 0
            current.append(item)
            size += nbytes
        if current:
            rounds.append(current)
        return rounds

    def _encode_pages(self, chunk: list[tuple[WriteStorageHandle, str, int]]) -> list[PageBlobs]:
        """(Worker thread) the stored form of each page of ``chunk``."""
        return [
            PageBlobs(h._keys[pool][i], encode_page(self.group, pool, h._host_pages[pool][i]))
            for h, pool, i in chunk
        ]

    async def _drop_corrupted_writes(self, handles: list[WriteStorageHandle]) -> None:
        """Verify mode: fail the writes whose host pages no longer match their
        checksums, so that corrupted bytes never reach the shared store."""
        found = await anyio.to_thread.run_sync(verify_pages.corrupted, self._s._checksums, self.group, handles)
        for h, pool, pages in found:
            self._finish_storage(h, error=CorruptionDetected(pool, pages, operation_id=h.id))

    async def _run_prefetch_batch(
        self, handles: list[PrefetchHandle], slots: anyio.Semaphore
    ) -> None:
        backend = self._storage
        assert backend is not None
        try:
            live = [h for h in handles if h._state != DONE]
            lookup = [(h, pool) for h in live for pool in h._keys]
            flat = [k for h, pool in lookup for k in h._keys[pool]]
            try:
                present = await _exists(backend, flat)
            except Exception as exc:
                error = _storage_failure(exc, "prefetch", live)
                for h in live:
                    self._finish_storage(h, error=error)
                return
            offset = 0
            found: dict[PrefetchHandle, dict[str, int]] = {}
            for h, pool in lookup:
                n = len(h._keys[pool])
                hits = present[offset:offset + n]
                offset += n
                found.setdefault(h, {})[pool] = hits.index(False) if False in hits else n
            for h, by_pool in found.items():
                if h._state == DONE:
                    continue
                if h.all_pools and any(hit < len(h._keys[pool]) for pool, hit in by_pool.items()):
                    by_pool = dict.fromkeys(by_pool, 0)  # one pool short: none is of use
                for pool, hit in by_pool.items():
                    self._shorten_prefetch(h, pool, hit)
                h._looked_up = True
            limiter = anyio.Semaphore(PREFETCHES_IN_FLIGHT)
            async with anyio.create_task_group() as tg:
                for h in live:
                    if h._state != DONE:
                        tg.start_soon(self._fetch_one, h, limiter)
        finally:
            for h in handles:  # only when cancelled from outside
                if h._state != DONE:
                    self._finish_storage(h, error=OperationCancelled(
                        f"prefetch {h.id} was interrupted by cancellation"
                    ))
            slots.release()

    def _shorten_prefetch(self, h: PrefetchHandle, pool: str, hit: int) -> None:
        """Only the first ``hit`` pages of ``pool`` can come: free the others now."""
        pages = h._host_pages[pool]
        if hit < len(pages):
            self._s._ownership[pool].end_write(pages[hit:], keep=False)
            h._host_pages[pool] = pages[:hit]
        h._hits[pool] = min(h._hits[pool], hit)

    async def _fetch_one(self, h: PrefetchHandle, limiter: anyio.Semaphore) -> None:
        """Read ``h``'s hit pages in rounds, pool by pool, and finish it."""
        backend = self._storage
        assert backend is not None
        if h._state == DONE:  # stopped or cancelled while its batch looked up keys
            return
        error: BaseException | None = None
        try:
            with anyio.CancelScope() as scope:
                h._scope = scope
                if h._stop_requested or h._cancel_requested:
                    scope.cancel()
                async with limiter:
                    for pool, keys in h._keys.items():
                        members = self._storage_members[pool]
                        per_round = self._pages_per_round(pool)
                        while h._done[pool] < h._hits[pool]:
                            if h._stop_requested or h._cancel_requested:
                                # Asked while a round was written (shielded): no further round.
                                return
                            start = h._done[pool]
                            end = min(start + per_round, h._hits[pool])
                            blobs = await backend.get(keys[start:end], members)
                            got = next((j for j, b in enumerate(blobs) if b is None), len(blobs))
                            if got < end - start:
                                # Evicted or overwritten since the lookup: the hit ends here.
                                self._shorten_prefetch(h, pool, start + got)
                            if got:
                                pages = h._host_pages[pool][start:start + got]
                                # Shielded: a stop waits for pages being written, and counts them.
                                with anyio.CancelScope(shield=True):
                                    ok, sums, rejected = await anyio.to_thread.run_sync(
                                        self._decode_pages, pool, pages, blobs[:got]
                                    )
                                    h._done[pool] = start + ok
                                    for name, by_page in sums.items():
                                        self._s._checksums.setdefault(name, {}).update(by_page)
                                if rejected is not None:
                                    # A stored page this group cannot take: a miss, not a failure,
                                    # so one bad page in a shared store fails no prefetch.
                                    log.warning("storage.page_rejected", operation=h.id, pool=pool,
                                                key=keys[start + ok].hex(), error=str(rejected))
                                    self._shorten_prefetch(h, pool, start + ok)
        except Exception as exc:
            # After a stop the caller was promised the pages done so far; a
            # read that failed after it does not change that.
            error = None if h._stop_requested else _storage_failure(exc, "prefetch", [h])
        except BaseException:
            error = OperationCancelled(f"prefetch {h.id} was interrupted by cancellation")
            raise
        finally:
            h._scope = None
            if h._state != DONE:
                if h._cancel_requested:
                    self._finish_storage(h, error=OperationCancelled(f"operation {h.id} was cancelled"))
                else:
                    self._finish_storage(h, error=error)

    def _decode_pages(
        self, pool: str, pages: list[int], blobs: list[dict[str, bytes] | None]
    ) -> tuple[int, dict[str, dict[int, int]], StorageError | None]:
        """(Worker thread) write stored pages into host ``pages`` of ``pool``, in
        order, up to the first whose blobs do not fit (`decode_page` checks a
        page before writing any of it). Returns how many were written, their
        checksums in verify mode, and the error of the page that did not fit."""
        ok = 0
        rejected = None
        for page, page_blobs in zip(pages, blobs):
            assert page_blobs is not None
            try:
                decode_page(self.group, pool, page, page_blobs)
            except StorageError as exc:
                rejected = exc
                break
            ok += 1
        sums = verify_pages.record(self.group, {pool: pages[:ok]}) if self._s.config.verify and ok else {}
        return ok, sums, rejected

    # -- completion ----------------------------------------------------------

    def _finish_storage(
        self,
        h: StorageHandle,
        *,
        result: object | None = None,
        error: BaseException | None = None,
    ) -> None:
        """Release what ``h`` holds and resolve it: the one place a storage
        operation ends, so it ends once."""
        if h._state == DONE:
            return
        result = self._release_storage(h, result=result, error=error)
        self._s._counters[h.direction].ended(h.id, h.direction.value, error, getattr(result, "nbytes", 0))
        h._resolve(result, error)

    def _release_storage(
        self, h: StorageHandle, *, result: object | None, error: BaseException | None
    ) -> object | None:
        """Give back what ``h`` holds (once; it is marked done first); the result
        a prefetch ends with."""
        h._state = DONE
        if isinstance(h, PrefetchHandle):
            if h._timer is not None:
                h._timer.cancel()
                h._timer = None
            if error is not None:
                h._done = dict.fromkeys(h._done, 0)
            for pool, pages in h._host_pages.items():
                n = h._done[pool]
                if n:
                    self._s._ownership[pool].end_write(pages[:n], keep=True)
                if n < len(pages):
                    self._s._ownership[pool].end_write(pages[n:], keep=False)
            if error is None:
                result = h._result_now()
        else:
            for pool, pages in h._host_pages.items():
                self._s._ownership[pool].unpin(pages)
        return result

    def _cancel_queued_storage(self, h: StorageHandle) -> None:
        """A queued storage operation was stopped or cancelled: drop it now."""
        assert self._s._queue is not None and h._state == QUEUED
        h._state = RUNNING  # leaves the queue's view before discard
        self._s._queue.discard(h)
        if h._cancel_requested:
            self._finish_storage(h, error=OperationCancelled(f"operation {h.id} was cancelled"))
        else:
            self._finish_storage(h)  # a stopped prefetch: no page done, all freed


async def _exists(backend: StorageBackend, keys: list[bytes]) -> list[bool]:
    """``backend.exists(keys)``, checked to answer once per key."""
    if not keys:
        return []
    present = await backend.exists(keys)
    if len(present) != len(keys):
        raise StorageError(
            f"{backend.name}: exists answered {len(present)} results for {len(keys)} keys",
            backend=backend.name, operation="exists",
        )
    return present


def _storage_failure(exc: Exception, operation: str, handles: Sequence[StorageHandle]) -> BaseException:
    """The error the handles of a failed storage batch raise: the backend's
    own `StorageError` (typed, chained), anything else as `TransferFailed`."""
    ids = [h.id for h in handles]
    log.warning("batch.failed", direction=operation, operations=ids, error=repr(exc))
    if isinstance(exc, StorageError):
        return exc
    error = TransferFailed(f"{operation} of operations {ids} failed: {exc!r}", operation_ids=tuple(ids))
    error.__cause__ = exc
    return error


def storage_members(group: PoolGroup) -> dict[str, list[str]]:
    """Per slot-owning pool, the pools with bytes stored with its pages."""
    out = {}
    for spec in group:
        if spec.owns_slots and spec.host.allocator is not None:
            pages = spec.host.slots // spec.page_size
            out[spec.name] = list(page_members(group, spec.name, 0)) if pages else []
    return out

