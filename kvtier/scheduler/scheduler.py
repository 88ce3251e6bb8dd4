"""`TransferScheduler`: backups and loads through bounded lanes, batched copies.

Data flow of one operation::

    validate -> allocate destination slots (sorted pool names; reclaim once;
    roll back on failure) -> queue (load lane ahead of backup lane) -> batch
    (byte budget) -> executor (off the loop, layer by layer) -> resolve handle

Invariants the scheduler keeps:

* Bad input raises before any state changes.
* Allocation across the pools of an operation is all or nothing.
* Every host page has one owner at a time (see `HostPageOwnership`); slots an
  operation took are freed exactly once if it does not succeed, by the event
  loop, never by a worker thread.
* A load never reads host pages that a backup is still writing: it waits.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Protocol, cast

import anyio
import anyio.abc
import structlog
import torch

from kvtier.errors import (
    ConfigurationError,
    CorruptionDetected,
    InvalidIndices,
    OperationCancelled,
    PoolExhausted,
    SchedulerClosed,
    TransferFailed,
)
from kvtier.pools import PageList, PoolGroup, PoolSpec, as_index_tensor, page_numbers
from kvtier.scheduler.config import SchedulerConfig
from kvtier.scheduler.handle import DONE, QUEUED, RUNNING, OperationHandle, OperationResult
from kvtier.scheduler.ownership import HostPageOwnership
from kvtier.scheduler.queue import OperationQueue
from kvtier.scheduler import verify as verify_pages
from kvtier.scheduler.statistics import DirectionStatistics, LaneCounters, SchedulerStatistics
from kvtier.scheduler.storage_handle import StorageDirection, StorageHandle
from kvtier.scheduler.storage_handle import PrefetchHandle, WriteStorageHandle
from kvtier.scheduler.storage_ops import StorageLanes
from kvtier.storage.base import StorageBackend
from kvtier.transfers import (
    Batch,
    CacheOperation,
    CopyExecutor,
    CpuExecutor,
    Direction,
    LayerProgress,
    PoolTransfer,
    capture_fence,
)

__all__ = ["ReclaimHook", "TransferScheduler"]

# The queue's lanes, each with its own dispatch loop.
_LANES = (Direction.LOAD, Direction.BACKUP, StorageDirection.PREFETCH, StorageDirection.WRITE)

log = structlog.get_logger(__name__)

IndexLike = torch.Tensor | Sequence[int]


class ReclaimHook(Protocol):
    """The engine's eviction hook: try to free ``slots_needed`` slots of
    ``pool`` on ``tier`` ("host" or "device"). kvtier retries once after it."""

    async def __call__(self, pool: str, tier: str, slots_needed: int) -> None: ...


class TransferScheduler(anyio.AsyncContextManagerMixin):
    """Moves pages of a `PoolGroup` between device and host, and, with a
    ``storage`` backend, between host and storage (`write_storage`, `prefetch`).

    Use as ``async with TransferScheduler(group) as sched:``; the batching loop
    runs while the block is open. Leaving it drains the queue (or cancels it,
    per ``config.on_close``) and waits for in-flight copies; submitting after
    that raises `SchedulerClosed`. Needs the asyncio backend.

    ``storage`` (a `kvtier.storage.StorageBackend`) enables `write_storage`
    and `prefetch`; the caller owns it and closes it after the scheduler.
    """

    def __init__(
        self,
        group: PoolGroup,
        executor: CopyExecutor | None = None,
        config: SchedulerConfig | None = None,
        reclaim: ReclaimHook | None = None,
        storage: StorageBackend | None = None,
    ) -> None:
        if not isinstance(group, PoolGroup):
            raise TypeError(f"group must be a PoolGroup; got {type(group).__name__}")
        if storage is not None and not isinstance(storage, StorageBackend):
            raise TypeError(
                f"storage must be a StorageBackend (exists/get/put/aclose), e.g. FileStore; "
                f"got {type(storage).__name__}"
            )
        self.group = group
        self.config = config if config is not None else SchedulerConfig()
        self.executor: CopyExecutor = executor if executor is not None else default_executor(group)
        self._reclaim = reclaim
        self._state = "new"
        self._ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._counters: dict[Direction | StorageDirection, LaneCounters] = {d: LaneCounters() for d in _LANES}
        self._rollbacks = 0
        self._in_flight = 0
        group.freeze()
        # Per slot-owning pool: bytes per page, and (sidecar, bytes per source page).
        self._bytes_per_page = {
            spec.name: (
                spec.page_size * spec.slot_nbytes,
                tuple((side.name, side.page_size * side.slot_nbytes) for side in group.sidecars_of(spec.name)),
            )
            for spec in group
            if spec.owns_slots
        }
        # Verify mode: checksum of every backed-up host page, by pool and page.
        self._checksums: dict[str, dict[int, int]] = {}
        self._ownership = {
            spec.name: HostPageOwnership(spec.host.allocator)
            for spec in group
            if spec.owns_slots and spec.host.allocator is not None
        }
        # The storage tier's lanes (write_storage, prefetch), with a backend.
        self._storage = None if storage is None else StorageLanes(self, storage)
        self._queue: OperationQueue | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncIterator[TransferScheduler]:
        if self._state != "new":
            raise RuntimeError("a TransferScheduler runs once; create a new one")
        self._loop = asyncio.get_running_loop()
        self._queue = OperationQueue(self.config.max_queued_ops, _LANES)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            # One dispatch loop per direction: a backup burst never holds a load back.
            for direction in (Direction.LOAD, Direction.BACKUP):
                await tg.start(self._dispatch_loop, direction)
            if self._storage is not None:
                for lane in (StorageDirection.PREFETCH, StorageDirection.WRITE):
                    await tg.start(self._storage.dispatch_loop, lane)
            self._state = "open"
            try:
                yield self
            except BaseException:
                self._close(cancel_queued=True)
                raise
            self._close(cancel_queued=self.config.on_close == "cancel")
        log.debug("scheduler.closed", rollbacks=self._rollbacks)

    def _close(self, *, cancel_queued: bool) -> None:
        self._state = "closed"
        assert self._queue is not None
        if cancel_queued:
            for entry in self._queue.drain():
                assert isinstance(entry, (OperationHandle, StorageHandle))
                closed = SchedulerClosed(f"operation {entry.id} was still queued when the scheduler closed")
                if isinstance(entry, StorageHandle):
                    assert self._storage is not None
                    self._storage._finish_storage(entry, error=closed)
                else:
                    assert isinstance(entry, OperationHandle)
                    self._finish(entry, error=closed)
        self._queue.close()

    def _check_open(self) -> OperationQueue:
        if self._state == "open":
            assert self._queue is not None
            return self._queue
        if self._state == "new":
            raise RuntimeError("the scheduler is not running; use `async with TransferScheduler(...)`")
        raise SchedulerClosed("the scheduler is closed; it takes no new operations")

    # -- submission ----------------------------------------------------------

    async def backup(
        self, device_indices: Mapping[str, IndexLike], *, priority: int = 0, after: object | None = None
    ) -> OperationHandle:
        """Copy pages from the device to newly allocated host slots.

        ``device_indices`` maps slot-owning pools to their device slots (whole
        pages); sidecars of those pools come along. Host slots are allocated in
        every pool in sorted name order; a short pool awaits the reclaim hook and
        is retried once, else every slot taken is freed and `PoolExhausted` is
        raised. Waits while the backup lane is full. Raises `InvalidIndices` for
        bad input (nothing changed) and `SchedulerClosed` once closed.

        ``after``: a stream or event the copy must wait for (the forward pass
        that writes these rows); a stream is captured as an event now.
        """
        queue = self._check_open()
        pools = self._validate(device_indices, side="device")
        fence = None if after is None else capture_fence(after)
        pages = await self._allocate_host({name: len(p) for name, (_, p) in pools.items()})
        handle = self._new_backup(pools, pages, priority, fence)
        try:
            await queue.put(handle)
        except BaseException as exc:
            self._abandon(handle, exc)
            raise
        self._counters[Direction.BACKUP].submitted += 1
        return handle

    def backup_nowait(
        self, device_indices: Mapping[str, IndexLike], *, priority: int = 0, after: object | None = None
    ) -> OperationHandle:
        """`backup` without waiting: a short pool raises `PoolExhausted` at once
        (the reclaim hook is not called) and a full lane raises `anyio.WouldBlock`;
        either way nothing stays allocated."""
        queue = self._check_open()
        pools = self._validate(device_indices, side="device")
        fence = None if after is None else capture_fence(after)
        taken: dict[str, list[int]] = {}
        try:
            for name, (_, wanted) in sorted(pools.items()):
                alloc = self._ownership[name].allocator
                got = alloc.try_alloc_pages(len(wanted))
                if got is None:
                    raise PoolExhausted(name, "host", len(wanted) * alloc.page_size, alloc.num_free_slots)
                taken[name] = got
        except BaseException:
            self._roll_back_host(taken)
            raise
        handle = self._new_backup(pools, taken, priority, fence)
        try:
            queue.put_nowait(handle)
        except BaseException as exc:
            self._abandon(handle, exc)
            raise
        self._counters[Direction.BACKUP].submitted += 1
        return handle

    async def load(
        self,
        host_indices: Mapping[str, IndexLike],
        device_indices: Mapping[str, IndexLike] | None = None,
        *,
        priority: int = 0,
        after: object | None = None,
    ) -> OperationHandle:
        """Copy pages from host slots (held by the caller) to the device.

        Device slots come from ``device_indices`` or, for pools left out of it,
        from the pool's device allocator (allocated atomically, sorted by name,
        reclaim once, rolled back on failure; freed again if the load fails).
        A load of host pages that a backup is still writing waits for that
        backup, and raises `TransferFailed` if it failed. Raises
        `InvalidIndices` for bad input, with nothing changed.

        ``after``: a stream or event the copy must wait for (a forward pass
        that still reads the device rows being overwritten).
        """
        queue = self._check_open()
        fence = None if after is None else capture_fence(after)
        host = self._validate(host_indices, side="host")
        given = self._validate(device_indices or {}, side="device", allow_empty=True)
        for name, (dev, _) in given.items():
            if name not in host:
                raise InvalidIndices(
                    f"pool {name!r} has device indices but no host indices; a load names its "
                    "host pages for every pool",
                    pool=name, rule="host-and-device",
                )
            n_host = host[name][0].numel()
            if dev.numel() != n_host:
                raise InvalidIndices(
                    f"pool {name!r} has {n_host} host indices and {dev.numel()} device indices; "
                    "they must be equal",
                    pool=name, rule="equal-lengths",
                )
        needed = sorted(name for name in host if name not in given)
        for name in needed:
            if self.group[name].device_allocator is None:
                raise InvalidIndices(
                    f"pool {name!r} has no device allocator; pass its device_indices",
                    pool=name, rule="device-indices-needed",
                )
        host_pages = {name: pages for name, (_, pages) in host.items()}
        await self._wait_for_writers(host_pages)
        queue = self._check_open()
        for name, pages in host_pages.items():
            self._ownership[name].check_readable(pages)
        for name, pages in host_pages.items():
            self._ownership[name].pin(pages)
        try:
            owned = await self._allocate_device([(name, host[name][0].numel()) for name in needed])
        except BaseException:
            for name, pages in host_pages.items():
                self._ownership[name].unpin(pages)
            raise
        device = {name: dev for name, (dev, _) in given.items()} | owned
        handle = self._new_operation(
            Direction.LOAD, {name: idx for name, (idx, _) in host.items()}, device,
            host_pages, owned, priority, fence,
        )
        try:
            await queue.put(handle)
        except BaseException as exc:
            self._abandon(handle, exc)
            raise
        self._counters[Direction.LOAD].submitted += 1
        return handle

    async def write_storage(
        self,
        host_indices: Mapping[str, IndexLike],
        keys: Mapping[str, Sequence[bytes]],
        *,
        priority: int = 0,
    ) -> WriteStorageHandle:
        """Put host pages into the storage backend under their page keys.

        ``host_indices`` maps anchor pools (slot-owning, not sidecars) to host
        slots the caller holds (whole pages, e.g. a backup's
        ``host_indices``); ``keys[pool]`` holds one page key per page, in the
        same order (`kvtier.storage.page_keys`). Each page is stored with its
        sidecars' rows. Pages already stored are skipped. Host pages that a
        backup or prefetch is still writing are waited for (`TransferFailed`
        if it fails); a `free_host` of the pages while the write reads them is
        deferred until it ends. Waits while the lane is full.

        Raises `InvalidIndices` for bad input (nothing changed),
        `ConfigurationError` when the scheduler has no storage backend, and
        `SchedulerClosed` once closed. The handle raises the backend's
        `StorageError` / `StorageTimeout` if it fails; pages it put before
        that are stored whole, the others are not visible.
        """
        self._check_open()
        return await self._storage_lanes().write_storage(host_indices, keys, priority=priority)

    async def prefetch(
        self,
        keys: Mapping[str, Sequence[bytes]],
        *,
        policy: str = "best_effort",
        timeout_s: float | None = None,
        priority: int = 0,
        all_pools: bool = False,
    ) -> PrefetchHandle:
        """Read stored pages into newly allocated host slots.

        ``keys[pool]``: the page keys of anchor ``pool`` (slot-owning, not a
        sidecar), a prefix's pages in order (`kvtier.storage.page_keys`, or
        `~kvtier.storage.window_keys` for a sliding-window or state pool). One
        host page per key is allocated in every pool, sorted by name, all or
        nothing (reclaim hook once, then `PoolExhausted`). The hit of a pool is
        the longest run of stored pages from its first key; pages past it are
        freed as soon as that is known, and the hit pages are read in order.

        ``policy``: ``"wait_complete"`` hands back every hit page or fails;
        ``"best_effort"`` also stops when `PrefetchHandle.stop` is called;
        ``"timeout"`` stops by itself ``timeout_s`` seconds after submission
        (and on `stop`). A prefetch that stops hands back exactly the pages it
        completed, a prefix of each pool's keys, and frees the rest once.

        ``all_pools``: count a hit only when every key of every pool is
        stored, else read nothing (for a hybrid model, kv pages without the
        matching state or window are of no use). Pages that vanish from the
        store after the lookup still shorten a pool's hit; check
        ``result.complete``.

        ``await handle`` gives a `PrefetchResult`; its ``host_indices`` the
        caller holds, as after a backup.

        Raises `InvalidIndices` / `ValueError` for bad input (nothing changed),
        `ConfigurationError` without a storage backend, `SchedulerClosed`
        once closed. The handle raises the backend's `StorageError` /
        `StorageTimeout` if a lookup or read fails; then every page it took is
        freed.
        """
        self._check_open()
        return await self._storage_lanes().prefetch(
            keys, policy=policy, timeout_s=timeout_s, priority=priority, all_pools=all_pools
        )

    def _storage_lanes(self) -> StorageLanes:
        if self._storage is None:
            raise ConfigurationError(
                "this scheduler has no storage backend; pass TransferScheduler(..., storage=FileStore(...)) "
                "or RedisStore(...)"
            )
        return self._storage

    def free_host(self, host_indices: Mapping[str, IndexLike]) -> None:
        """Give host slots back (the engine's host eviction).

        All or nothing: every pool is checked first (whole pages, held by the
        caller, not freed twice) and `InvalidIndices` changes nothing. Pages an
        in-flight operation still reads or writes are freed when it ends.
        """
        pages = {name: p for name, (_, p) in self._validate(host_indices, side="host").items()}
        for name, p in pages.items():
            self._ownership[name].check_free(p)
        for name, p in pages.items():
            self._ownership[name].free(p)

    # -- validation ----------------------------------------------------------

    def _validate(
        self, indices: Mapping[str, IndexLike], *, side: str, allow_empty: bool = False
    ) -> dict[str, tuple[torch.Tensor, list[int]]]:
        """Check pools and index sets; return ``{pool: (indices, page numbers)}``."""
        if not isinstance(indices, Mapping):
            raise InvalidIndices(
                f"{side} indices must be a mapping of pool name to indices; got {type(indices).__name__}",
                rule="mapping",
            )
        if not indices and not allow_empty:
            raise InvalidIndices(
                f"an operation names at least one pool; got no {side} indices", rule="non-empty"
            )
        out = {}
        for name, value in indices.items():
            spec = self._spec(name)
            idx = as_index_tensor(value, pool=name, side=side)
            limit = spec.host.slots if side == "host" else spec.device_slots
            out[name] = (idx, page_numbers(idx, page_size=spec.page_size, limit=limit, pool=name, side=side))
        return out

    def _spec(self, name: object) -> PoolSpec:
        if not isinstance(name, str) or name not in self.group:
            raise InvalidIndices(
                f"unknown pool {name!r}; known pools: {sorted(self.group.names)}", rule="known-pool"
            )
        spec = self.group[name]
        if spec.sidecar is not None:
            raise InvalidIndices(
                f"pool {name!r} is a sidecar of {spec.sidecar.source!r}; its indices are derived, "
                f"name {spec.sidecar.source!r} instead",
                pool=name, rule="not-a-sidecar",
            )
        return spec

    # -- allocation and release ----------------------------------------------

    async def _allocate_host(self, pages_wanted: Mapping[str, int]) -> dict[str, list[int]]:
        """``pages_wanted[pool]`` free host pages of every pool, or none at all."""
        taken: dict[str, list[int]] = {}
        try:
            for name, npages in sorted(pages_wanted.items()):
                alloc = self._ownership[name].allocator
                got = alloc.try_alloc_pages(npages)
                if got is None and self._reclaim is not None:
                    await self._reclaim(name, "host", npages * alloc.page_size)
                    got = alloc.try_alloc_pages(npages)
                if got is None:
                    raise PoolExhausted(name, "host", npages * alloc.page_size, alloc.num_free_slots)
                taken[name] = got
        except BaseException:
            # Synchronous, so no cancellation can interrupt the undo.
            self._roll_back_host(taken)
            raise
        return taken

    def _roll_back_host(self, taken: dict[str, list[int]]) -> None:
        for name in reversed(list(taken)):
            self._ownership[name].allocator.free_pages(taken[name])
        if taken:
            self._rollbacks += 1
            log.info("allocation.rolled_back", tier="host", pools=list(taken))

    async def _allocate_device(self, requests: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        taken: dict[str, torch.Tensor] = {}
        try:
            for name, slots in requests:  # sorted by name by the caller
                alloc = self.group[name].device_allocator
                assert alloc is not None
                got = alloc.try_alloc(slots)
                if got is None and self._reclaim is not None:
                    await self._reclaim(name, "device", slots)
                    got = alloc.try_alloc(slots)
                if got is None:
                    raise PoolExhausted(name, "device", slots, alloc.num_free_slots)
                taken[name] = got
        except BaseException:
            for name in reversed(list(taken)):
                self.group[name].device_allocator.free(taken[name])  # type: ignore[union-attr]
            if taken:
                self._rollbacks += 1
                log.info("allocation.rolled_back", tier="device", pools=list(taken))
            raise
        return taken

    async def _wait_for_writers(self, host_pages: Mapping[str, list[int]]) -> None:
        while True:
            writers: set[object] = set()
            for name, pages in host_pages.items():
                writers |= self._ownership[name].writers_of(pages)
            if not writers:
                return
            for w in writers:
                # A backup (OperationHandle) or a prefetch (StorageHandle) filling the pages.
                assert isinstance(w, (OperationHandle, StorageHandle))
                await w._settled()
                if w._error is not None:
                    kind = w.direction.value
                    raise TransferFailed(
                        f"the operation reads host pages that {kind} {w.id} was writing, and that "
                        f"{kind} did not complete ({type(w._error).__name__})"
                    ) from w._error

    def _abandon(self, handle: OperationHandle, exc: BaseException) -> None:
        """Undo an operation that never reached the queue. Its handle was not
        returned, but a load may already wait on it as a writer: resolve it."""
        self._release(handle, succeeded=False)
        error = exc if isinstance(exc, Exception) else OperationCancelled(
            f"submission of operation {handle.id} was cancelled"
        )
        handle._resolve(None, error)

    def _release(self, handle: OperationHandle, *, succeeded: bool) -> None:
        """Give back what ``handle`` holds. Called exactly once per handle."""
        if handle.direction is Direction.BACKUP:
            for name, pages in handle._host_pages.items():
                self._ownership[name].end_write(pages, keep=succeeded)
        else:
            for name, pages in handle._host_pages.items():
                self._ownership[name].unpin(pages)
            if not succeeded:
                for name, idx in handle._device_owned.items():
                    self.group[name].device_allocator.free(idx)  # type: ignore[union-attr]

    # -- building operations -------------------------------------------------

    def _new_backup(
        self,
        pools: Mapping[str, tuple[torch.Tensor, list[int]]],
        pages: dict[str, list[int]],
        priority: int,
        fence: object | None,
    ) -> OperationHandle:
        # Page numbers, not tensors: the slot tensors are made in the executor's thread.
        host: dict[str, torch.Tensor | PageList] = {
            name: PageList(pages[name], self.group[name].page_size) for name in pools
        }
        device = {name: idx for name, (idx, _) in pools.items()}
        handle = self._new_operation(Direction.BACKUP, host, device, pages, {}, priority, fence)
        for name, p in pages.items():
            self._ownership[name].start_write(p, handle)
        return handle

    def _new_operation(
        self,
        direction: Direction,
        host: dict[str, torch.Tensor | PageList],
        device: dict[str, torch.Tensor],
        host_pages: dict[str, list[int]],
        device_owned: dict[str, torch.Tensor],
        priority: int,
        fence: object | None = None,
    ) -> OperationHandle:
        transfers: list[PoolTransfer] = []
        nbytes: dict[str, int] = {}
        for name in sorted(host) if len(host) > 1 else host:
            pages = len(host_pages[name])
            transfers.append(PoolTransfer(name, host[name], device[name]))
            bytes_per_page, sidecars = self._bytes_per_page[name]
            nbytes[name] = pages * bytes_per_page
            for side, side_bytes_per_page in sidecars:
                transfers.append(PoolTransfer(side, None, None, indices_from_pool=name))
                nbytes[side] = pages * side_bytes_per_page
        op = CacheOperation(next(self._ids), direction, tuple(transfers), priority, sum(nbytes.values()), fence)
        assert self._loop is not None
        return OperationHandle(
            op, self, self._loop.create_future(), host=host, device=device, host_pages=host_pages,
            device_owned=device_owned, bytes_per_pool=nbytes,
        )

    # -- batching and completion ---------------------------------------------

    async def _dispatch_loop(
        self, direction: Direction, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        assert self._queue is not None and self._tg is not None
        cfg = self.config
        slots = anyio.Semaphore(self.executor.max_in_flight)
        task_status.started()
        while True:
            # Take a batch only once the executor has room: what goes next is
            # decided as late as possible.
            await slots.acquire()
            entries = await self._queue.take_batch(direction, cfg.max_batch_bytes, cfg.max_batch_ops)
            if entries is None:
                slots.release()
                return
            handles = cast(list[OperationHandle], entries)
            batch, progress = self._start_batch(direction, handles)
            self._tg.start_soon(self._run_batch, batch, progress, handles, slots)

    def _start_batch(self, direction: Direction, handles: list[OperationHandle]) -> tuple[Batch, LayerProgress]:
        assert self._loop is not None
        loop = self._loop
        batch = Batch(
            next(self._batch_ids), direction, [h._op for h in handles], self.group,
            min_run_bytes=self.config.min_run_bytes,
        )

        def wake() -> None:
            loop.call_soon_threadsafe(_wake, handles)

        progress = LayerProgress(batch.num_layers, wake)
        now = time.perf_counter()
        watched = False
        for h in handles:
            h._state = RUNNING
            h._progress = progress
            h._t_dispatch = now
            watched = watched or bool(h._waiters)
        progress.watched = watched
        self._counters[direction].batch_taken(len(handles))
        self._in_flight += 1
        log.debug("batch.dispatched", batch=batch.id, direction=direction.value,
                  operations=len(handles), nbytes=batch.nbytes)
        return batch, progress

    async def _run_batch(
        self, batch: Batch, progress: LayerProgress, handles: list[OperationHandle], slots: anyio.Semaphore
    ) -> None:
        error: BaseException | None = None
        verify = self.config.verify
        try:
            if verify and batch.direction is Direction.LOAD:
                batch = await self._drop_corrupted(batch, handles)
            if handles:
                await self.executor.execute(batch, progress)
                if verify and batch.direction is Direction.BACKUP:
                    sums = await anyio.to_thread.run_sync(self._checksums_of, handles)
                    for pool, by_page in sums.items():
                        self._checksums.setdefault(pool, {}).update(by_page)
        except Exception as exc:
            error = TransferFailed(
                f"batch {batch.id} ({batch.direction.value}, {len(handles)} operations) failed: {exc}",
                operation_ids=tuple(h.id for h in handles),
            )
            error.__cause__ = exc
            log.warning("batch.failed", batch=batch.id, direction=batch.direction.value,
                        operations=[h.id for h in handles], error=repr(exc))
        except BaseException:
            # Cancelled (the scheduler's task group is going down). The executor
            # contract says its copies no longer touch memory once it returns.
            error = OperationCancelled(f"batch {batch.id} was interrupted by cancellation")
            raise
        finally:
            # Synchronous: completion cannot be interrupted half way.
            for h in handles:
                if error is not None:
                    self._finish(h, error=error)
                elif h._cancel_requested:
                    self._finish(h, error=OperationCancelled(f"operation {h.id} was cancelled"))
                else:
                    self._finish(h)
            progress.detach()  # break handle -> progress -> wake -> handles: no cyclic garbage
            self._in_flight -= 1
            slots.release()
            log.debug("batch.completed", batch=batch.id, ok=error is None)

    def _checksums_of(self, handles: list[OperationHandle]) -> dict[str, dict[int, int]]:
        """(Worker thread) checksums of the pages that ``handles`` backed up."""
        out: dict[str, dict[int, int]] = {}
        for h in handles:
            for pool, by_page in verify_pages.record(self.group, h._host_pages).items():
                out.setdefault(pool, {}).update(by_page)
        return out

    async def _drop_corrupted(self, batch: Batch, handles: list[OperationHandle]) -> Batch:
        """Fail the loads of ``batch`` whose host pages no longer match their
        checksums (removing them from ``handles``); the batch of the rest."""
        corrupted = await anyio.to_thread.run_sync(verify_pages.corrupted, self._checksums, self.group, handles)
        if not corrupted:
            return batch
        for h, pool, pages in corrupted:
            handles.remove(h)
            self._finish(h, error=CorruptionDetected(pool, pages, operation_id=h.id))
        return Batch(batch.id, batch.direction, [h._op for h in handles], self.group,
                     min_run_bytes=self.config.min_run_bytes)

    def _finish(self, handle: OperationHandle, *, error: BaseException | None = None) -> None:
        """Release what ``handle`` holds and resolve it: the single place an
        operation ends, so it ends once."""
        if handle._state == DONE:
            return
        succeeded = error is None
        self._release(handle, succeeded=succeeded)
        self._counters[handle.direction].ended(handle.id, handle.direction.value, error, handle.nbytes)
        if succeeded:
            now = time.perf_counter()
            start = handle._t_dispatch or now
            handle._resolve(OperationResult(
                handle.id, handle.direction, handle._bytes_per_pool,
                seconds_queued=start - handle._t_submit,
                seconds_copying=now - start,
                seconds_total=now - handle._t_submit,
            ), None)
            return
        handle._resolve(None, error)

    def _cancel_queued(self, handle: OperationHandle) -> None:
        assert self._queue is not None and handle._state == QUEUED
        handle._state = RUNNING  # leaves the queue's view before discard
        self._queue.discard(handle)
        self._finish(handle, error=OperationCancelled(f"operation {handle.id} was cancelled"))

    # -- introspection -------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        def lane(direction: Direction | StorageDirection) -> DirectionStatistics:
            c = self._counters[direction]
            depth = peak = 0
            if self._queue is not None:
                s = self._queue.statistics(direction)
                depth, peak = s.depth, s.peak_depth
            return DirectionStatistics(
                c.submitted, c.completed, c.failed, c.cancelled, c.bytes, c.batches,
                c.batched, c.max_batch, depth, peak,
            )

        return SchedulerStatistics(
            backup=lane(Direction.BACKUP),
            load=lane(Direction.LOAD),
            write_storage=lane(StorageDirection.WRITE),
            prefetch=lane(StorageDirection.PREFETCH),
            rollbacks=self._rollbacks,
            batches_in_flight=self._in_flight,
            deferred_host_frees=sum(len(o.deferred) for o in self._ownership.values()),
            pools=self.group.statistics(),
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<TransferScheduler {self._state} [queued: {s.load.queue_depth} load, "
            f"{s.backup.queue_depth} backup | in flight: {self._in_flight} batches | "
            f"done: {s.load.completed} load, {s.backup.completed} backup]>"
        )


def default_executor(group: PoolGroup) -> CopyExecutor:
    """`CudaExecutor` when the device pools live on a CUDA device, else `CpuExecutor`."""
    devices = {spec.device.device for spec in group if spec.device is not None}
    cuda = [d for d in devices if d.type == "cuda"]
    if cuda:
        from kvtier.transfers.cuda import CudaExecutor

        return CudaExecutor(cuda[0])
    return CpuExecutor()


def _wake(handles: list[OperationHandle]) -> None:
    for h in handles:
        h._wake()
