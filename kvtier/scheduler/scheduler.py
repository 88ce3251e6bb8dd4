"""`TransferScheduler`: the public face of kvtier's scheduler.

Data flow of one operation, one way down::

    parse (`parse.Parser`: page numbers, kvtier's own copy; bad input raises here)
      -> admit (`admission.Admission`: host or device slots, sorted pool names,
         reclaim once, all or nothing / acquire reads: wait for writers,
         re-check lives, pin)
      -> carry (`carriers.carry` / `carry_many`, or a storage carrier)
         -> Lane.put (bounded, FIFO backpressure)
      -> batch (byte budget) -> LaneWork (device copies or storage I/O, off the loop)
      -> Lane.finish (release the claim once, resolve the handle)

The scheduler itself only calls these in that order: `parse` owns what an
operation may name, `admission` what it takes and the one undo, `carriers`
the queue entries of backups and loads, `lanes` the runtime every kind
shares, `device` and `storage` what their batches do, `eventloop` the ties to
asyncio. See ``docs/architecture.md``.

Invariants the scheduler keeps:

* Bad input raises before any state changes.
* Allocation across the pools of an operation is all or nothing.
* Every host page has one owner at a time (`HostPageOwnership`); what an
  operation took is given back exactly once, by the event loop.
* An operation never reads host pages that another still writes, nor a later
  life of a page it named: it waits for the writer, then re-checks.
* One scheduler uses a `PoolGroup` at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import torch

from kvtier.errors import ConfigurationError, InvalidIndices, SchedulerClosed, SchedulerNotRunning, WrongType
from kvtier.logs import get_logger
from kvtier.policies import StoreAdmission
from kvtier.pools import PoolGroup
from kvtier.transfers import eventloop
from kvtier.scheduler.admission import Admission, IndexLike, ReclaimHook
from kvtier.scheduler.claims import Claim
from kvtier.scheduler.arrays import ArrayLike, PoolArrays
from kvtier.scheduler.bulk import BulkOperation, BulkResult
from kvtier.scheduler.carriers import CarrierContext, carry, carry_many
from kvtier.scheduler.config import SchedulerConfig
from kvtier.scheduler.device import DeviceCopies
from kvtier.scheduler.handles import OperationHandle, OperationResult
from kvtier.scheduler.lanes import PRIORITY_MAX, PRIORITY_MIN, Lane, LaneWork, check_priority
from kvtier.scheduler.parse import Parser
from kvtier.scheduler.requests import RequestPages, device_pages
from kvtier.scheduler.statistics import DirectionStatistics, SchedulerStatistics
from kvtier.scheduler.storage import (
    PrefetchCarrier,
    PrefetchHandle,
    RewriteKeys,
    StorageCounters,
    StoragePrefetches,
    StorageWrites,
    WriteCarrier,
    WriteStorageHandle,
    check_store_admission,
)
from kvtier.scheduler.storage_keys import check_prefetch_options, parse_keys
from kvtier.scheduler.store_calls import MeasuredStore, StoreCallStatistics
from kvtier.scheduler.taskgroup import task_group
from kvtier.storage.base import StorageBackend
from kvtier.storage.identity import ANONYMOUS_MODEL, EngineIdentity, PageIdentity
from kvtier.transfers import CopyExecutor, CpuExecutor, Direction, capture_fence

__all__ = ["ReclaimHook", "TransferScheduler"]

log = get_logger(__name__)


BACKUP, LOAD, WRITE, PREFETCH = "backup", "load", "write_storage", "prefetch"

_NO_LANE = DirectionStatistics(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
_NONE: frozenset[str] = frozenset()


class TransferScheduler(anyio.AsyncContextManagerMixin):
    """Moves pages of a `PoolGroup` between device and host, and, with a
    ``storage`` backend, between host and storage (`write_storage`, `prefetch`).

    Use as ``async with TransferScheduler(group) as sched:``; the lanes run
    while the block is open. Leaving it drains the queues (or cancels them,
    per ``config.on_close``) and waits for in-flight copies; submitting after
    that raises `SchedulerClosed`. Runs on asyncio or uvloop (another anyio
    backend raises `ConfigurationError` at ``async with``); call it only from
    that loop (`WrongEventLoop` otherwise). One scheduler uses a group at a
    time (`ConfigurationError` for a second one while the first runs).

    ``storage`` (a `kvtier.storage.StorageBackend`) enables `write_storage`
    and `prefetch`; the caller owns it and closes it after the scheduler.
    ``rewrite_keys``: the `RewriteKeys` of that store, when other schedulers
    use the same store (pass them the same one): a page any of them found bad
    is put again by the next `write_storage` of it on any of them. Default:
    this scheduler's own.

    ``identity`` (a `kvtier.storage.EngineIdentity`: the model string, the
    key scheme, per-pool shards and element formats the tensors cannot say):
    with the group's geometry, what each anchor pool's stored pages are
    (`page_identity`); every page written carries its tag and a page read
    under another identity is a miss counted by rule ``"identity"``, which the
    next write of it repairs. Default: the group's geometry under
    `kvtier.storage.identity.ANONYMOUS_MODEL` (pages bound to geometry and
    formats, not to a model).

    ``store_admission`` (a `kvtier.policies.StoreAdmission`; default None:
    store every page): asked ``admit(key, "store")`` once per page key of
    each `write_storage`, on the loop thread, before the store is looked up;
    a page it refuses is not written (`WriteStorageResult.pages_skipped`,
    `StorageStatistics.pages_skipped_by_reason`). A `FrequencyGate` here
    counts write-throughs, so it must be made with ``tier="store"``.
    `ConfigurationError` for something without ``admit``, a gate of the host
    tier, or a policy with no ``storage``.
    """

    def __init__(
        self,
        group: PoolGroup,
        executor: CopyExecutor | None = None,
        config: SchedulerConfig | None = None,
        reclaim: ReclaimHook | None = None,
        storage: StorageBackend | None = None,
        *,
        rewrite_keys: RewriteKeys | None = None,
        identity: EngineIdentity | None = None,
        store_admission: StoreAdmission | None = None,
    ) -> None:
        if store_admission is not None:
            check_store_admission(store_admission, storage)
        if not isinstance(group, PoolGroup):
            raise WrongType(f"group must be a PoolGroup; got {type(group).__name__}")
        if rewrite_keys is not None and not isinstance(rewrite_keys, RewriteKeys):
            raise WrongType(f"rewrite_keys must be a RewriteKeys; got {type(rewrite_keys).__name__}")
        if storage is not None and not isinstance(storage, StorageBackend):
            raise WrongType(
                f"storage must be a StorageBackend (exists/get/put/aclose), e.g. FileStore; "
                f"got {type(storage).__name__}"
            )
        if identity is not None and not isinstance(identity, EngineIdentity):
            raise ConfigurationError(
                f"identity must be a kvtier.storage.EngineIdentity (model, shards, formats); got {identity!r:.80}"
            )
        self.group = group
        self.config = config if config is not None else SchedulerConfig()
        self.executor: CopyExecutor = executor if executor is not None else default_executor(group)
        # A request is parsed (what it names, checked: `Parser`), admitted (what it
        # takes: `Admission`) and carried (`kvtier.scheduler.carriers`), in that
        # order. Admission is the Parser of its group, so both steps are one object.
        self._admission = Admission(group, reclaim)
        self._parse: Parser = self._admission
        # Timed per call, errors counted by kind (store_call_statistics); the backend is the caller's.
        self._storage = None if storage is None else MeasuredStore(storage)
        self._state = "new"
        self._ids = itertools.count(1)
        self._carrier_ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        # Per slot-owning pool: bytes per page, and (sidecar, bytes per source page).
        self._bytes_per_page = {
            spec.name: (
                spec.page_size * spec.slot_nbytes,
                tuple((side.name, side.page_size * side.slot_nbytes) for side in group.sidecars_of(spec.name)),
            )
            for spec in group
            if spec.owns_slots
        }
        # Bytes of one stored page of an anchor pool, its sidecars' rows included.
        self._page_nbytes = {name: own + sum(b for _, b in sides) for name, (own, sides) in self._bytes_per_page.items()}
        self._storage_members = self._parse.storage_members
        # What each anchor's stored pages are: checked here, so a bad shard or format fails the constructor.
        engine = identity if identity is not None else EngineIdentity(ANONYMOUS_MODEL)
        self._identities = {
            pool: engine.page_identity(group, pool) for pool in self._storage_members
        } if storage is not None or identity is not None else {}
        # Requests one carrier holds at most (see kvtier.scheduler.carriers).
        self._carrier_requests = min(self.config.max_batch_ops, _CARRIER_REQUESTS)
        # Keys whose stored bytes failed their checks: put again by the next write
        # (shared with other schedulers over the same store when the caller says so).
        self._suspects: RewriteKeys = rewrite_keys if rewrite_keys is not None else RewriteKeys()
        self._storage_counters = StorageCounters()
        self._store_admission = store_admission
        self._lanes: dict[str, Lane[Any]] = {}
        self._contexts: dict[str, CarrierContext] = {}
        self._prefetches: StoragePrefetches | None = None
        self._writes: StorageWrites | None = None
        self._loop: eventloop.Loop | None = None

    # -- lifecycle ------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncIterator[TransferScheduler]:
        if self._state != "new":
            raise SchedulerNotRunning("a TransferScheduler runs once; create a new one")
        loop = eventloop.running_loop()
        self.group.attach(self)
        try:
            self._loop = loop
            self._lanes = self._make_lanes(loop)
            async with task_group() as tg:  # the block's own error leaves as itself
                for lane in self._lanes.values():
                    await tg.start(lane.run)
                self._state = "open"
                try:
                    yield self
                except BaseException:
                    self._close(cancel_queued=True)
                    raise
                cancelling = self.config.on_close == "cancel"
                self._close(cancel_queued=cancelling, end_storage=cancelling)
        finally:
            self._state = "closed"
            self.group.detach(self)
            # No thread of kvtier's outlives the scheduler: its copies have all ended here.
            stop_threads = getattr(self.executor, "stop_threads", None)
            if stop_threads is not None:
                with anyio.CancelScope(shield=True):
                    await stop_threads()
        log.debug("scheduler.closed", rollbacks=self._admission.rollbacks)

    def _make_lanes(self, loop: eventloop.Loop) -> dict[str, Lane[Any]]:
        cfg = self.config
        group, admission = self.group, self._admission

        def lane(name: str, work: LaneWork[Any]) -> Lane[Any]:
            return Lane(name, work, loop, capacity=cfg.max_queued_ops, max_batch_bytes=cfg.max_batch_bytes,
                        max_batch_ops=cfg.max_batch_ops, batch_ids=self._batch_ids)

        def copies(direction: Direction) -> Lane[Any]:
            work = DeviceCopies(direction, group, self.executor, loop, min_run_bytes=cfg.min_run_bytes,
                                verify=cfg.verify)
            copy_lane = lane(direction.value, work)
            self._contexts[direction.value] = CarrierContext(
                copy_lane, direction, group, admission, admission.owners, self._bytes_per_page,
                max_bytes=cfg.max_batch_bytes, max_requests=self._carrier_requests,
                ids=self._ids, carrier_ids=self._carrier_ids,
            )
            return copy_lane

        # Loads first: a lane per kind, so a backup burst never holds a load back.
        lanes = {LOAD: copies(Direction.LOAD), BACKUP: copies(Direction.BACKUP)}
        if self._storage is not None:
            shared = dict(
                backend=self._storage, group=group, admission=admission, page_nbytes=self._page_nbytes,
                suspects=self._suspects, identities=self._identities, counters=self._storage_counters,
                chunk_bytes=cfg.storage_chunk_bytes,
                in_flight=cfg.storage_batches_in_flight, verify=cfg.verify,
            )
            self._prefetches = StoragePrefetches(prefetches_in_flight=cfg.prefetches_in_flight, **shared)
            lanes[PREFETCH] = lane(PREFETCH, self._prefetches)
            self._writes = StorageWrites(store_admission=self._store_admission, **shared)
            lanes[WRITE] = lane(WRITE, self._writes)
        return lanes

    def _close(self, *, cancel_queued: bool, end_storage: bool = False) -> None:
        """Refuse new operations; ``cancel_queued``: end the queued ones with
        `SchedulerClosed`; ``end_storage`` (a cancelling close): storage
        operations in flight end with it too, at once (a store that stopped
        answering must not hold the close for its timeout), while copies in
        flight finish, as they must (they touch memory). When the block is
        left with an error, the task group's cancellation interrupts them
        instead (`OperationCancelled`)."""
        self._state = "closed"
        for lane in self._lanes.values():
            lane.close(cancel_queued=cancel_queued)
        if end_storage:
            for kind, work in ((PREFETCH, self._prefetches), (WRITE, self._writes)):
                if work is not None:
                    work.abort(self._lanes[kind], SchedulerClosed(
                        "the scheduler closed (on_close='cancel') while this storage operation ran"
                    ))

    def _lane(self, kind: str, what: str) -> Lane[Any]:
        """The lane for a new operation of ``kind``, once the call is allowed."""
        if self._state == "open" and eventloop.on_loop(self._loop):  # the hot path: one C call
            lane = self._lanes.get(kind)
            if lane is not None:
                return lane
        if self._state != "open":
            if self._state == "new":
                raise SchedulerNotRunning("the scheduler is not running; use `async with TransferScheduler(...)`")
            raise SchedulerClosed("the scheduler is closed; it takes no new operations")
        eventloop.check_caller(self._loop, what)
        lane = self._lanes.get(kind)
        if lane is None:
            raise ConfigurationError(
                "this scheduler has no storage backend; pass TransferScheduler(..., storage=FileStore(...)) "
                "or RedisStore(...)"
            )
        return lane

    # -- backups and loads ------------------------------------------------------------

    async def backup(
        self,
        device_indices: Mapping[str, IndexLike],
        *,
        host_indices: Mapping[str, IndexLike] | None = None,
        priority: int = 0,
        after: object | None = None,
        valid_rows: Mapping[str, int] | None = None,
    ) -> OperationHandle:
        """Copy pages from the device to newly allocated host slots.

        ``device_indices`` maps slot-owning pools to their device slots (whole
        pages; copied now, so the caller may reuse its tensors at once);
        sidecars of those pools come along. Host slots are allocated in every
        pool in sorted name order; a short pool awaits the reclaim hook and is
        retried once, else every slot taken is freed and `PoolExhausted` is
        raised. Waits while the backup lane is full. Raises `InvalidIndices`
        for bad indices and `ValueError` for a bad priority (nothing changed),
        `SchedulerClosed` once closed.

        ``host_indices``: the host slots to write instead, named by an engine
        that keeps its own host block table (vLLM's offloading manager). The
        same pools as ``device_indices`` with as many slots each (sidecar
        entries as a handle gives them are accepted); every named page must be
        free (`free_host` a page first to write it again: a page an operation
        still reads is free once it ends), else `InvalidIndices` (rule
        ``host-pages-free``) and nothing changes. The pages are then the
        backup's, as if kvtier had allocated them: a new life of each.

        ``after``: a stream or event the copy must wait for (the forward pass
        that writes these rows); a stream is captured as an event now.

        ``valid_rows``: for pools (or sidecars) whose rows do not all hold data, how
        many do, counted from the first index in the order given (for a
        sidecar, from the first row its source's pages derive): only those
        move, here and in every later load, `write_storage` and verify-mode
        checksum of these host pages (`PoolGroup.valid_rows`). A window of
        ``w`` tokens in a page of 16, a buffer half full, a sidecar page with
        fewer entries than rows. `InvalidIndices` (rule ``valid-rows``) for a
        pool not in the backup or a count outside ``0 .. its rows``.
        """
        lane = self._lane(BACKUP, "backup()")
        if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            check_priority(priority)  # raises
        parse = self._parse
        admission = self._admission
        device, named = parse.parse_backup(device_indices, host_indices)
        fence = None if after is None else capture_fence(after)
        counts = None if valid_rows is None else parse.valid_counts(valid_rows, device)
        if named is None:
            host = admission.host_now(device)  # one pool with room: no coroutine
            if host is None:
                host = await admission.reserve_host({name: len(p) for name, p in device.items()})
        else:
            admission.take_host(named)
            host = named
        if counts:
            admission.record_valid(counts, host)
        handle, new = carry(self._contexts[BACKUP], host, device, priority, fence, _NONE)
        if new is not None:
            await lane.put(new)
        return handle

    def backup_nowait(
        self,
        device_indices: Mapping[str, IndexLike],
        *,
        host_indices: Mapping[str, IndexLike] | None = None,
        priority: int = 0,
        after: object | None = None,
        valid_rows: Mapping[str, int] | None = None,
    ) -> OperationHandle:
        """`backup` without waiting: a short pool raises `PoolExhausted` at once
        (the reclaim hook is not called) and a full lane raises `anyio.WouldBlock`;
        either way nothing stays allocated."""
        lane = self._lane(BACKUP, "backup_nowait()")
        check_priority(priority)
        parse = self._parse
        admission = self._admission
        device, named = parse.parse_backup(device_indices, host_indices)
        fence = None if after is None else capture_fence(after)
        counts = None if valid_rows is None else parse.valid_counts(valid_rows, device)
        if named is None:
            host = admission.try_reserve_host({name: len(p) for name, p in device.items()})
        else:
            admission.take_host(named)
            host = named
        if counts:
            admission.record_valid(counts, host)
        handle, new = carry(self._contexts[BACKUP], host, device, priority, fence, _NONE)
        if new is not None:
            lane.put_nowait(new)
        return handle

    async def backup_many(
        self, requests: Sequence[Mapping[str, IndexLike]], *, priority: int = 0, after: object | None = None,
        valid_rows: Sequence[Mapping[str, int] | None] | None = None,
    ) -> list[OperationHandle]:
        """Many backups in one call: one handle per request, in order, each
        resolving with its own result or failure (a failed batch fails the
        requests it carried, as for `backup`).

        What a serving step that evicts many prefixes wants: the requests are
        validated together (a few torch calls per pool for 128 requests of
        the common shape), host pages are reserved with one allocation per
        pool for all of them (sorted pools, the reclaim hook once per short
        pool), the requests are carried 128 to a queue entry
        (`kvtier.scheduler.carriers`), and those join the lane together, waiting
        for room for all. The call lets the event loop run between slices of
        that work. All or nothing: more requests than
        ``SchedulerConfig.max_queued_ops`` raise `ValueError` before anything
        else, bad input in any request raises `InvalidIndices` naming the
        request, a short pool raises `PoolExhausted`, and a cancelled call
        gives everything back; nothing stays allocated or queued.
        ``priority`` and ``after`` apply to every request. ``rows``: one
        `backup` ``valid_rows=`` per request (or None for a request whose rows all
        hold data), checked with the rest.
        """
        lane = self._lane(BACKUP, "backup_many()")
        check_priority(priority)
        parse = self._parse
        admission = self._admission
        requests = parse.backup_list(requests, valid_rows)
        lane.check_fits(len(requests))
        fence = None if after is None else capture_fence(after)
        device, offsets = await parse.many_pages(requests, "device")
        counts = parse.many_valid_counts(valid_rows, device, offsets)
        host = await admission.reserve_host({name: len(p) for name, p in device.items()}) if device else {}
        for i, per_pool in counts:
            if per_pool:
                admission.record_valid(per_pool, {name: p[offsets[name][i]:offsets[name][i + 1]] for name, p in host.items()})
        carriers, handles = await carry_many(self._contexts[BACKUP], RequestPages(host, device, offsets, len(requests)),
                                             priority, fence, _NONE)
        await lane.put_many(carriers)
        assert handles is not None
        return handles

    async def load_many(
        self,
        host_indices: Sequence[Mapping[str, IndexLike]],
        device_indices: Sequence[Mapping[str, IndexLike] | None] | None = None,
        *,
        priority: int = 0,
        after: object | None = None,
    ) -> list[OperationHandle]:
        """Many loads in one call: one handle per request, in order, each
        resolving with its own result or failure.

        ``host_indices[i]`` and ``device_indices[i]`` (None, or the list left
        out: device slots from the pools' allocators) are those of `load`. The
        requests are validated in one pass; the host pages of all of them are
        waited for (their writers), checked and pinned together; device slots
        are allocated with one call per pool for all of them; the handles join
        the lane together. All or nothing, as `backup_many`.
        """
        lane = self._lane(LOAD, "load_many()")
        check_priority(priority)
        fence = None if after is None else capture_fence(after)
        parse = self._parse
        admission = self._admission
        host_indices, device_indices = parse.load_lists(host_indices, device_indices)
        count = len(host_indices)
        lane.check_fits(count)
        host, offsets, given, given_offsets = await parse.many_loads(host_indices, device_indices,
                                                                         admission.check_readable)
        allocated, needed = parse.load_allocations(host, offsets, given_offsets, count)
        admission.check_device_allocators(needed)  # before any wait: bad input changes nothing
        await admission.acquire_reads(host, lambda: self._lane(LOAD, "load_many()"))
        try:
            owned = await admission.reserve_device(needed) if needed else {}
        except BaseException:
            admission.release(Claim(reads=host), succeeded=False)
            raise
        device = device_pages(offsets, given, given_offsets, {name: p.pages for name, p in owned.items()}, count)
        carriers, handles = await carry_many(self._contexts[LOAD], RequestPages(host, device, offsets, count), priority,
                                             fence, allocated)
        await lane.put_many(carriers)
        assert handles is not None
        return handles

    # -- array-native bulk --------------------------------------------------------------

    async def backup_arrays(
        self,
        device_indices: Mapping[str, ArrayLike],
        offsets: Mapping[str, ArrayLike] | None = None,
        *,
        host_indices: Mapping[str, ArrayLike] | None = None,
        priority: int = 0,
        after: object | None = None,
        valid_rows: Mapping[str, ArrayLike] | None = None,
        handles: bool = False,
    ) -> BulkOperation:
        """Many backups named by arrays, in one call, with one `BulkOperation`
        to await once (see `kvtier.scheduler.bulk`).

        ``device_indices[pool]``: the device slots of every request of a
        slot-owning pool, as one flat array with ``offsets[pool]`` (requests
        + 1 slot offsets; an empty range: the request does not name the pool)
        or a 2-D ``[requests, slots]`` array; numpy arrays or CPU torch
        tensors of an integer dtype (`kvtier.scheduler.arrays`). Each request
        is a `backup` of its ranges: the checks are the single call's, done
        in numpy for all requests (the first bad request is named), host
        pages are reserved with one allocation per pool for all of them, and
        the requests ride carriers as `backup_many`'s do. All or nothing as
        `backup_many`: `InvalidIndices`, `PoolExhausted`, `ValueError` (more
        requests than the lane holds) or a cancelled call leave nothing taken.

        ``host_indices``: the host slots to write, named per request as
        ``device_indices`` (same pools, same counts; the ``offsets`` apply to
        both), each page free (`backup`'s rule ``host-pages-free``).
        ``valid_rows[pool]``: per request, `backup`'s ``valid_rows=`` count of
        ``pool`` (a slot-owning pool of the call or a sidecar of one).
        ``priority`` and ``after`` apply to every request. ``handles``: also
        make one `OperationHandle` per request now (`BulkOperation.handles`).
        """
        lane = self._lane(BACKUP, "backup_arrays()")
        check_priority(priority)
        parse = self._parse
        admission = self._admission
        device, count = parse.parse_arrays(device_indices, offsets, side="device")
        lane.check_fits(count)
        named: PoolArrays | None = None
        if host_indices is not None:
            named, _ = parse.parse_arrays(host_indices, offsets, side="host", count=count)
            parse.check_array_pairs(named, device, every_pool=True)
        counts = None if valid_rows is None else parse.array_valid_counts(valid_rows, device, count)
        fence = None if after is None else capture_fence(after)
        device_lists = {name: pages.tolist() for name, (pages, _) in device.items()}
        page_offsets = {name: off.tolist() for name, (_, off) in device.items()}
        if named is None:
            host = await admission.reserve_host({name: len(p) for name, p in device_lists.items()})
        else:
            host = {name: named[name][0].tolist() for name in device_lists}
            admission.take_host(host)
        if counts:
            admission.record_array_valid(counts, host, page_offsets)
        requests = RequestPages(host, device_lists, page_offsets, count)
        carriers, made = await carry_many(self._contexts[BACKUP], requests, priority, fence, _NONE,
                                          want_handles=handles)
        await lane.put_many(carriers)
        return BulkOperation(BACKUP, Direction.BACKUP, carriers, requests, self.group, made)

    async def load_arrays(
        self,
        host_indices: Mapping[str, ArrayLike],
        offsets: Mapping[str, ArrayLike] | None = None,
        *,
        device_indices: Mapping[str, ArrayLike] | None = None,
        priority: int = 0,
        after: object | None = None,
        handles: bool = False,
    ) -> BulkOperation:
        """Many loads named by arrays, in one call, with one `BulkOperation`
        to await once: `backup_arrays`'s form for `load`.

        ``host_indices`` (and ``offsets``) as ``backup_arrays``'s device
        indices: host slots the caller holds, e.g. a `BulkResult`'s
        ``host_indices`` and ``offsets`` as they are (sidecar entries equal to
        what their source derives are accepted). ``device_indices``: for the
        pools it names, every request's device slots (the same counts; the
        ``offsets`` apply to both); the other pools' device slots come from
        their allocators, one allocation per pool for all requests (freed
        again for a request that fails). The host pages' writers are waited
        for and their lives checked as for `load_many`. All or nothing as
        `load_many`.
        """
        lane = self._lane(LOAD, "load_arrays()")
        check_priority(priority)
        parse = self._parse
        admission = self._admission
        host, count = parse.parse_arrays(host_indices, offsets, side="host")
        given: PoolArrays = {}
        if device_indices is not None:
            given, _ = parse.parse_arrays(device_indices, offsets, side="device", count=count, allow_empty=True)
            parse.check_array_pairs(host, given, every_pool=False)
        lane.check_fits(count)
        fence = None if after is None else capture_fence(after)
        host_lists = {name: pages.tolist() for name, (pages, _) in host.items()}
        page_offsets = {name: off.tolist() for name, (_, off) in host.items()}
        needed = {name: len(p) * self.group[name].page_size for name, p in host_lists.items() if name not in given}
        admission.check_readable(host_lists)
        admission.check_device_allocators(needed)  # before any wait: bad input changes nothing
        await admission.acquire_reads(host_lists, lambda: self._lane(LOAD, "load_arrays()"))
        try:
            owned = await admission.reserve_device(needed) if needed else {}
        except BaseException:
            admission.release(Claim(reads=host_lists), succeeded=False)
            raise
        device = {name: pages.tolist() for name, (pages, _) in given.items()}
        device |= {name: p.pages for name, p in owned.items()}
        requests = RequestPages(host_lists, device, page_offsets, count)
        carriers, made = await carry_many(self._contexts[LOAD], requests, priority, fence, frozenset(owned),
                                          want_handles=handles)
        await lane.put_many(carriers)
        return BulkOperation(LOAD, Direction.LOAD, carriers, requests, self.group, made)

    async def load(
        self,
        host_indices: Mapping[str, IndexLike],
        device_indices: Mapping[str, IndexLike] | None = None,
        *,
        priority: int = 0,
        after: object | None = None,
    ) -> OperationHandle:
        """Copy pages from host slots (held by the caller) to the device.

        ``host_indices`` may be a backup's or prefetch's ``host_indices`` as
        they are (sidecar entries that match their source are accepted).
        Device slots come from ``device_indices`` or, for pools left out of it,
        from the pool's device allocator (allocated atomically, sorted by name,
        reclaim once, rolled back on failure; freed again if the load fails).
        Indices are copied now. A load of host pages that a backup or prefetch
        is still writing waits for it (`TransferFailed` if it failed), then
        checks that the pages were not freed meanwhile (`InvalidIndices`,
        rule ``page-generation``, if they were: it never reads a page's next
        owner's bytes). Raises `InvalidIndices` for bad input, with nothing
        changed.

        ``after``: a stream or event the copy must wait for (a forward pass
        that still reads the device rows being overwritten).
        """
        lane = self._lane(LOAD, "load()")
        if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            check_priority(priority)  # raises
        fence = None if after is None else capture_fence(after)
        parse = self._parse
        admission = self._admission
        host, given = parse.parse_load(host_indices, device_indices)
        needed = {name: len(pages) * self.group[name].page_size for name, pages in host.items() if name not in given}
        if needed:
            admission.check_device_allocators(needed)  # before any wait: bad input changes nothing
        if not admission.pin_now(host):  # no writer to wait for: pinned without a coroutine
            await admission.acquire_reads(host, lambda: self._lane(LOAD, "load()"))
        if not needed:  # every device page given: nothing to allocate
            handle, new = carry(self._contexts[LOAD], host, given, priority, fence, _NONE)
            if new is not None:
                await lane.put(new)
            return handle
        try:
            owned = await admission.reserve_device(needed)
        except BaseException:
            admission.release(Claim(reads=host), succeeded=False)
            raise
        device = given | {name: pages.pages for name, pages in owned.items()}
        handle, new = carry(self._contexts[LOAD], host, device, priority, fence, frozenset(owned))
        if new is not None:
            await lane.put(new)
        return handle

    def free_host(
        self, host_indices: Mapping[str, IndexLike] | OperationHandle | OperationResult | BulkResult | Any
    ) -> None:
        """Give host slots back (the engine's host eviction).

        ``host_indices``: slots by pool, or what holds them: a backup's or
        load's handle or result (its request's host pages, read from kvtier's
        own record: nothing the caller did to tensors it was handed changes
        them), a `BulkResult` (the pages its requests leave with the caller),
        or anything else with a ``host_indices`` mapping (a prefetch's
        result). All or nothing: every pool is checked first (whole pages,
        held by the caller, not freed twice) and `InvalidIndices` changes
        nothing. Pages an in-flight operation still reads or writes are freed
        when it ends. An empty mapping (e.g. a prefetch that found nothing) is
        a no-op; a handle's ``host_indices`` may be passed as they are.
        """
        if self._state == "open":
            eventloop.check_caller(self._loop, "free_host()")
        if isinstance(host_indices, (OperationHandle, OperationResult, BulkResult)):
            self._admission.free_pages(host_indices.host_pages)
            return
        if not isinstance(host_indices, Mapping) and hasattr(host_indices, "host_indices"):
            host_indices = host_indices.host_indices
        self._admission.free_host(host_indices)

    # -- storage --------------------------------------------------------------------------

    async def write_storage(
        self,
        host_indices: Mapping[str, IndexLike],
        keys: Mapping[str, Sequence[bytes]],
        *,
        priority: int = 0,
    ) -> WriteStorageHandle:
        """Put host pages into the storage backend under their page keys.

        ``host_indices`` maps anchor pools to host slots the caller holds
        (whole pages, e.g. a backup's ``host_indices``; matching sidecar
        entries are accepted); ``keys[pool]`` holds one page key per page, in
        the same order (`kvtier.storage.page_keys`); a key names one page of
        one pool, so a key given twice (in one pool or two) is refused, and a
        write whose key another write of its batch gives for another pool
        fails. Each page is stored with its sidecars' rows and checksums bound
        to its key. Pages already
        stored are skipped, unless a read found their stored bytes bad: those
        are put again. Host pages that a backup or prefetch is still writing
        are waited for (`TransferFailed` if it fails; `InvalidIndices` if the
        pages were freed meanwhile); a `free_host` of the pages while the write
        reads them is deferred until it ends. Waits while the lane is full.

        Raises `InvalidIndices` for bad input (nothing changed),
        `ConfigurationError` when the scheduler has no storage backend, and
        `SchedulerClosed` once closed. The handle raises the backend's
        `StorageError` / `StorageTimeout` if it fails; pages it put before
        that are stored whole, the others are not visible.
        """
        lane = self._lane(WRITE, "write_storage()")
        check_priority(priority)
        parse = self._parse
        admission = self._admission
        host = parse.pages(host_indices, side="host")
        key_lists = parse_keys(keys, self._storage_members, counts={name: len(p) for name, p in host.items()})
        await admission.acquire_reads(host, lambda: self._lane(WRITE, "write_storage()"))
        carrier = WriteCarrier(lane, next(self._ids), priority, key_lists, host, group=self.group,
                               page_nbytes=self._page_nbytes)
        await lane.put(carrier)
        return WriteStorageHandle(carrier)

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
        A stored page whose bytes fail their checksums ends the hit like a
        missing one (`StorageStatistics.pages_rejected`).

        ``policy``: ``"wait_complete"`` hands back every hit page or fails;
        ``"best_effort"`` also stops when `PrefetchHandle.stop` is called;
        ``"timeout"`` stops by itself ``timeout_s`` seconds after submission
        (and on `stop`). A prefetch that stops hands back exactly the pages it
        completed, a prefix of each pool's keys, and frees the rest once.

        ``all_pools``: all or nothing across pools (for a hybrid model, kv
        pages without the matching state or window are of no use, and a
        window or state belongs to the whole prefix): the result holds every
        key of every pool, or no page at all. A pool short at the lookup, a
        page evicted or rejected after it, or a stop or deadline before the
        end cuts every pool to nothing, pages already read included; so a
        result never pairs pools of different lengths. ``result.complete``
        tells which.

        ``await handle`` gives a `PrefetchResult`; its ``host_indices`` the
        caller holds, as after a backup.

        Raises `InvalidIndices` / `ValueError` for bad input (nothing changed),
        `ConfigurationError` without a storage backend, `SchedulerClosed`
        once closed. The handle raises the backend's `StorageError` /
        `StorageTimeout` if a lookup or read fails; then every page it took is
        freed.
        """
        lane = self._lane(PREFETCH, "prefetch()")
        check_priority(priority)
        check_prefetch_options(policy, timeout_s, all_pools)
        parse = self._parse
        admission = self._admission
        key_lists = parse_keys(keys, self._storage_members, anchor=parse.spec)
        pages = await admission.reserve_host({name: len(k) for name, k in key_lists.items()})
        carrier = PrefetchCarrier(lane, next(self._ids), priority, key_lists, pages, admission=admission,
                                  page_nbytes=self._page_nbytes, policy=policy, all_pools=all_pools)
        loop = self._loop
        assert loop is not None
        submitted = loop.time()
        await lane.put(carrier)
        if policy == "timeout" and not carrier.done():
            # Armed once queued (a stop must not race the wait for room), with
            # the time that wait took off the deadline.
            assert timeout_s is not None
            carrier.timer = eventloop.call_later(loop, max(0.0, timeout_s - (loop.time() - submitted)), carrier.stop)
        return PrefetchHandle(carrier)

    # -- introspection ----------------------------------------------------------------------

    def page_identity(self, pool: str) -> PageIdentity:
        """What anchor ``pool``'s stored pages are (`kvtier.storage.PageIdentity`):
        this scheduler's ``identity`` with the group's geometry. Derive the
        pool's page keys from it (``page_keys(sched.page_identity(pool).namespace(), tokens)``)
        so that keys and headers name the same thing. Raises `ConfigurationError`
        for a pool that is not a slot-owning pool with host pages."""
        found = self._identities.get(pool)
        if found is None:
            if pool not in self._storage_members:
                raise ConfigurationError(
                    f"pool {pool!r} is not a pool whose pages are stored (those are {sorted(self._storage_members)})"
                )
            found = self._identities[pool] = EngineIdentity(ANONYMOUS_MODEL).page_identity(self.group, pool)
        return found

    def statistics(self) -> SchedulerStatistics:
        empty = _NO_LANE
        lanes = {kind: lane.statistics() for kind, lane in self._lanes.items()}
        return SchedulerStatistics(
            backup=lanes.get(BACKUP, empty),
            load=lanes.get(LOAD, empty),
            write_storage=lanes.get(WRITE, empty),
            prefetch=lanes.get(PREFETCH, empty),
            rollbacks=self._admission.rollbacks,
            batches_in_flight=sum(lane.in_flight for lane in self._lanes.values()),
            deferred_host_frees=self._admission.deferred_frees,
            pools=self.group.statistics(),
            storage=None if self._storage is None else self._storage_counters.statistics(len(self._suspects)),
        )

    def store_call_statistics(self) -> StoreCallStatistics | None:
        """The storage backend's calls: latency per operation and errors by
        kind (None without a backend). Read-only, safe from another thread."""
        return None if self._storage is None else self._storage.statistics()

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<TransferScheduler {self._state} [queued: {s.load.queue_depth} load, "
            f"{s.backup.queue_depth} backup | in flight: {s.batches_in_flight} batches | "
            f"done: {s.load.completed} load, {s.backup.completed} backup]>"
        )


# Requests that one carrier holds: each costs the loop a few microseconds.
_CARRIER_REQUESTS = 128


def default_executor(group: PoolGroup) -> CopyExecutor:
    """`CudaExecutor` when the device pools live on a CUDA device, else `CpuExecutor`."""
    devices = {spec.device.device for spec in group if spec.device is not None}
    cuda = [d for d in devices if d.type == "cuda"]
    if cuda:
        from kvtier.transfers.cuda import CudaExecutor

        return CudaExecutor(cuda[0])
    return CpuExecutor()
