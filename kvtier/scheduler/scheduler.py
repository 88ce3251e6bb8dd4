"""`TransferScheduler`: the public face of kvtier's scheduler.

Data flow of one operation::

    validate (Admission.pages: page numbers, kvtier's own copy)
      -> reserve (host or device slots, sorted pool names, reclaim once,
         all or nothing) / acquire reads (wait for writers, re-check lives, pin)
      -> Lane.put (bounded, FIFO backpressure)
      -> batch (byte budget) -> LaneWork (device copies or storage I/O, off the loop)
      -> Lane.finish (release the claim once, resolve the handle)

The scheduler itself only wires these together: `admission` owns what an
operation may name and take and the one undo, `lanes` the runtime every kind
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
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import torch

from kvtier.errors import ConfigurationError, InvalidIndices, SchedulerClosed, SchedulerNotRunning, WrongType
from kvtier.logs import get_logger
from kvtier.policies import FrequencyGate, StoreAdmission
from kvtier.pools import PageList, PoolGroup, as_request_list
from kvtier.transfers import eventloop
from kvtier.scheduler.admission import Admission, Claim, IndexLike, ReclaimHook
from kvtier.scheduler.arrays import ArrayLike, PoolArrays, as_int64_array, parse_pools, parse_valid_rows
from kvtier.scheduler.bulk import BulkOperation, BulkResult
from kvtier.scheduler.carriers import Carrier, CarrierContext
from kvtier.scheduler.config import SchedulerConfig
from kvtier.scheduler.device import DeviceCopies
from kvtier.scheduler.handles import OperationHandle, OperationResult
from kvtier.scheduler.lanes import Lane, LaneWork, StepClock, check_priority
from kvtier.scheduler.requests import (
    Pages,
    RequestPages,
    carrier_bounds,
    concatenated,
    device_pages,
    extend,
    rest_of_load,
)
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
    storage_members,
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


@contextmanager
def _naming_request(index: int) -> Iterator[None]:
    """An `InvalidIndices` raised for one request of a bulk call names its place."""
    try:
        yield
    except InvalidIndices as exc:
        raise InvalidIndices(f"request {index}: {exc}", pool=exc.pool, rule=exc.rule) from exc


def check_store_admission(policy: object, storage: object) -> None:
    """Refuse a ``store_admission`` the scheduler cannot use (`ConfigurationError`)."""
    if not callable(getattr(policy, "admit", None)):
        raise ConfigurationError(
            f"store_admission must be a kvtier.policies.StoreAdmission (admit(key, tier) -> None | reason), "
            f"e.g. FrequencyGate(tier='store'); got {policy!r:.80}"
        )
    if isinstance(policy, FrequencyGate) and policy.tier != "store":
        raise ConfigurationError(
            f"store_admission {policy!r} counts offers to the {policy.tier!r} tier, which a scheduler never "
            f"makes (it would store every page); make it with FrequencyGate(..., tier='store')"
        )
    if storage is None:
        raise ConfigurationError(f"store_admission {policy!r:.80} needs a storage backend (storage=...)")


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
        self._admission = Admission(group, reclaim)
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
        self._storage_members = storage_members(group)
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
                copy_lane, direction, group, admission, self._bytes_per_page,
                max_bytes=cfg.max_batch_bytes, max_requests=self._carrier_requests,
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
        device, named, fence = self._check_backup(device_indices, host_indices, priority, after)
        counts = None if valid_rows is None else self._valid_counts(valid_rows, device)
        if named is None:
            host = await self._admission.reserve_host({name: len(p) for name, p in device.items()})
        else:
            self._admission.take_host(named)
            host = named
        if counts:
            self._record_valid(counts, host)
        handle, new = self._carry(BACKUP, host, device, priority, fence, frozenset())
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
        device, named, fence = self._check_backup(device_indices, host_indices, priority, after)
        counts = None if valid_rows is None else self._valid_counts(valid_rows, device)
        if named is None:
            host = self._admission.try_reserve_host({name: len(p) for name, p in device.items()})
        else:
            self._admission.take_host(named)
            host = named
        if counts:
            self._record_valid(counts, host)
        handle, new = self._carry(BACKUP, host, device, priority, fence, frozenset())
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
        requests = as_request_list(requests, call="backup_many")
        rows = valid_rows
        if rows is not None and (isinstance(rows, Mapping) or not isinstance(rows, Sequence)
                                 or len(rows) != len(requests)):
            raise InvalidIndices(
                f"backup_many takes valid_rows as one mapping (or None) per request, {len(requests)} of them; got "
                f"{type(rows).__name__}" + (f" of {len(rows)}" if isinstance(rows, Sequence) else ""),
                rule="valid-rows",
            )
        lane.check_fits(len(requests))
        fence = None if after is None else capture_fence(after)
        device, offsets = await self._bulk_pages(requests, "device")
        counts = []
        for i, given in enumerate(rows or ()):
            if given is not None:
                with _naming_request(i):
                    mine = {name: p[off[i]:off[i + 1]] for name, p in device.items()
                            if (off := offsets[name])[i + 1] > off[i]}
                    counts.append((i, self._valid_counts(given, mine)))
        host = await self._admission.reserve_host({name: len(p) for name, p in device.items()}) if device else {}
        for i, per_pool in counts:
            if per_pool:
                self._record_valid(per_pool, {name: p[offsets[name][i]:offsets[name][i + 1]] for name, p in host.items()})
        carriers, handles = await self._carriers(BACKUP, RequestPages(host, device, offsets, len(requests)),
                                                 priority, fence, frozenset())
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
        admission = self._admission
        host_indices = as_request_list(host_indices, call="load_many", what="host index mappings")
        if device_indices is not None:
            device_indices = as_request_list(device_indices, call="load_many", what="device index mappings", nones=True)
        count = len(host_indices)
        if device_indices is not None and len(device_indices) != count:
            raise InvalidIndices(
                f"load_many got {count} host index mappings and {len(device_indices)} device ones; "
                "give one per request, or none", rule="equal-lengths",
            )
        lane.check_fits(count)
        host, offsets, given, given_offsets = await self._bulk_loads(host_indices, device_indices)
        # Per request, the pools whose device pages kvtier allocates: the same
        # for every request (one set), or not.
        every = {name for name, off in given_offsets.items() if off == offsets[name]}
        allocated: frozenset[str] | list[frozenset[str]]
        if every == given_offsets.keys():
            allocated = frozenset(host.keys() - every)
            needed = {name: len(host[name]) * self.group[name].page_size for name in allocated}
        else:
            allocated = [
                frozenset(name for name, off in offsets.items() if off[i + 1] > off[i] and not (
                    name in given_offsets and given_offsets[name][i + 1] > given_offsets[name][i]))
                for i in range(count)
            ]
            needed = {}
            for i, pools in enumerate(allocated):
                for name in pools:
                    off = offsets[name]
                    needed[name] = needed.get(name, 0) + (off[i + 1] - off[i]) * self.group[name].page_size
        admission.check_device_allocators(needed)  # before any wait: bad input changes nothing
        await admission.acquire_reads(host, lambda: self._lane(LOAD, "load_many()"))
        try:
            owned = await admission.reserve_device(needed) if needed else {}
        except BaseException:
            admission.release(Claim(reads=host), succeeded=False)
            raise
        device = device_pages(offsets, given, given_offsets, {name: p.pages for name, p in owned.items()}, count)
        carriers, handles = await self._carriers(LOAD, RequestPages(host, device, offsets, count), priority, fence,
                                                 allocated)
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
        device, count = self._parse_arrays(device_indices, offsets, side="device")
        lane.check_fits(count)
        named: PoolArrays | None = None
        if host_indices is not None:
            named, _ = self._parse_arrays(host_indices, offsets, side="host", count=count)
            self._check_array_pairs(named, device, every_pool=True)
        counts = None if valid_rows is None else self._array_valid_counts(valid_rows, device, count)
        fence = None if after is None else capture_fence(after)
        device_lists = {name: pages.tolist() for name, (pages, _) in device.items()}
        page_offsets = {name: off.tolist() for name, (_, off) in device.items()}
        if named is None:
            host = await self._admission.reserve_host({name: len(p) for name, p in device_lists.items()})
        else:
            host = {name: named[name][0].tolist() for name in device_lists}
            self._admission.take_host(host)
        if counts:
            self._record_array_valid(counts, host, page_offsets)
        requests = RequestPages(host, device_lists, page_offsets, count)
        carriers, made = await self._carriers(BACKUP, requests, priority, fence, frozenset(), want_handles=handles)
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
        host, count = self._parse_arrays(host_indices, offsets, side="host")
        given: PoolArrays = {}
        if device_indices is not None:
            given, _ = self._parse_arrays(device_indices, offsets, side="device", count=count, allow_empty=True)
            self._check_array_pairs(host, given, every_pool=False)
        lane.check_fits(count)
        fence = None if after is None else capture_fence(after)
        admission = self._admission
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
        carriers, made = await self._carriers(LOAD, requests, priority, fence, frozenset(owned), want_handles=handles)
        await lane.put_many(carriers)
        return BulkOperation(LOAD, Direction.LOAD, carriers, requests, self.group, made)

    def _parse_arrays(
        self, indices: Mapping[str, ArrayLike], offsets: Mapping[str, ArrayLike] | None, *, side: str,
        count: int | None = None, allow_empty: bool = False,
    ) -> tuple[PoolArrays, int]:
        """`parse_pools` for this group: slot-owning pools, and sidecar
        entries accepted when they are exactly what their source derives."""
        if not isinstance(indices, Mapping):
            raise InvalidIndices(
                f"{side} indices must be a mapping of pool name to index arrays; got {type(indices).__name__}",
                rule="mapping",
            )
        group = self.group
        owners: dict[str, ArrayLike] = {}
        derived: list[str] = []
        for name in indices:
            if isinstance(name, str) and name in group and group[name].sidecar is not None:
                derived.append(name)
            else:
                owners[self._admission.spec(name).name] = indices[name]
        if not owners and allow_empty and not derived:
            return {}, count or 0
        limits = {name: (group[name].host.slots if side == "host" else group[name].device_slots) for name in owners}

        def check_one(i: int, name: str, slots: np.ndarray) -> None:
            with _naming_request(i):
                self._admission.pages({name: torch.from_numpy(slots.copy())}, side=side)

        if offsets is not None:
            if not isinstance(offsets, Mapping):
                raise InvalidIndices(f"offsets must map pool names to offset arrays; got {type(offsets).__name__}",
                                     rule="offsets")
            # Offsets of a pool the indices do not name (a typo in a sidecar's key) would be ignored.
            extra = sorted(map(repr, offsets.keys() - indices.keys()))
            if extra:
                raise InvalidIndices(
                    f"offsets name pools {', '.join(extra)} that the {side} indices do not (they name "
                    f"{sorted(map(str, indices))}); every offsets key must be a pool of the indices",
                    rule="offsets",
                )
        out, count = parse_pools(owners, None if offsets is None else {k: v for k, v in offsets.items() if k in owners},
                                 page_sizes={name: group[name].page_size for name in owners}, limits=limits,
                                 check_one=check_one, count=count)
        for name in derived:
            sidecar = group[name].sidecar
            assert sidecar is not None
            source = out.get(sidecar.source)
            k = sidecar.rows_per_page
            got = as_int64_array(indices[name], what=f"pool {name!r} {side} indices", pool=name)
            if source is None or not np.array_equal(got.reshape(-1), _rows(source[0], k)):
                raise InvalidIndices(
                    f"pool {name!r} is a sidecar of {sidecar.source!r}; its {side} indices must be the rows derived "
                    f"from {sidecar.source!r}'s pages (as a result gives them), or left out",
                    pool=name, rule="derived-indices",
                )
        return {name: pa for name, pa in out.items() if pa[0].size}, count

    def _check_array_pairs(self, host: PoolArrays, device: PoolArrays, *, every_pool: bool) -> None:
        """As `_check_pairs`, per request: the same page counts in every pool both name."""
        missing = [n for n in device if n not in host] + ([n for n in host if n not in device] if every_pool else [])
        for name in missing:
            side, other = ("host", "device") if name in host else ("device", "host")
            raise InvalidIndices(f"pool {name!r} has {side} indices but no {other} indices", pool=name,
                                 rule="host-and-device")
        for name, (_, dev_off) in device.items():
            host_off = host[name][1]
            if not np.array_equal(dev_off, host_off):
                i = int(np.flatnonzero(np.diff(dev_off) != np.diff(host_off))[0])
                size = self.group[name].page_size
                raise InvalidIndices(
                    f"request {i}: pool {name!r} has {int(host_off[i + 1] - host_off[i]) * size} host indices and "
                    f"{int(dev_off[i + 1] - dev_off[i]) * size} device indices; they must be equal",
                    pool=name, rule="equal-lengths",
                )

    def _array_valid_counts(
        self, rows: Mapping[str, ArrayLike], device: PoolArrays, count: int
    ) -> dict[str, tuple[str, np.ndarray]]:
        """``valid_rows`` of `backup_arrays`, checked: pool -> (its slot owner,
        valid rows per request), for the pools with a partial page."""
        group = self.group
        totals: dict[str, np.ndarray] = {}
        owner_of: dict[str, str] = {}
        for owner, (_, off) in device.items():
            for name in self._storage_members.get(owner, ()):
                if name in group and group[name].host.has_bytes:
                    totals[name] = np.diff(off) * group[name].page_size
                    owner_of[name] = owner
        checked = parse_valid_rows(rows, count, totals)
        return {name: (owner_of[name], n) for name, n in checked.items() if bool((n < totals[name]).any())}

    def _record_array_valid(
        self, counts: Mapping[str, tuple[str, np.ndarray]], host: Mapping[str, list[int]],
        offsets: Mapping[str, list[int]],
    ) -> None:
        """Record the partial pages of a `backup_arrays`' host pages (`PoolGroup.valid_rows`)."""
        valid_rows = self.group.valid_rows
        for name, (owner, n) in counts.items():
            size = self.group[name].page_size
            off = np.array(offsets[owner], dtype=np.int64)
            per_request = np.diff(off)
            position = np.arange(int(off[-1]), dtype=np.int64) - np.repeat(off[:-1], per_request)
            valid = np.clip(np.repeat(n, per_request) - position * size, 0, size)
            partial = np.flatnonzero(valid < size)
            if partial.size:
                pages = host[owner]
                table = valid_rows.setdefault(name, {})
                for k, v in zip(partial.tolist(), valid[partial].tolist()):
                    table[pages[k]] = v

    async def _bulk_pages(self, requests: Sequence[Mapping[str, IndexLike]], side: str) -> Pages:
        """The pages of a bulk call's requests, one after the other, and their
        offsets (see `RequestPages`), checked a slice at a time; the loop runs
        in between once a step has taken long enough."""
        out: Pages = ({}, {})
        clock = StepClock()
        for start in range(0, len(requests), _VALIDATE_SLICE):
            await clock.checkpoint()
            part = requests[start:start + _VALIDATE_SLICE]
            got = self._admission.bulk_pages(part, side=side)
            if got is None:
                each = []
                for i, request in enumerate(part, start):
                    with _naming_request(i):
                        each.append(self._admission.pages(request, side=side))
                got = concatenated(each)
            extend(out, start, got, len(part))
        return out

    async def _bulk_loads(
        self, host_indices: Sequence[Mapping[str, IndexLike]],
        device_indices: Sequence[Mapping[str, IndexLike] | None] | None,
    ) -> tuple[dict[str, list[int]], dict[str, list[int]], dict[str, list[int]], dict[str, list[int]]]:
        """A `load_many`'s host pages and offsets (as `_bulk_pages`), and the
        device pages the requests gave with their offsets (a request that gave
        none of a pool has an empty range of it)."""
        admission = self._admission
        host: Pages = ({}, {})
        given: Pages = ({}, {})
        clock = StepClock()
        for start in range(0, len(host_indices), _VALIDATE_SLICE):
            await clock.checkpoint()
            hosts = host_indices[start:start + _VALIDATE_SLICE]
            devices = None if device_indices is None else device_indices[start:start + _VALIDATE_SLICE]
            fast = admission.bulk_pages(hosts, side="host")
            dev: Pages | None = ({}, {})
            if fast is not None and devices is not None:
                dev = admission.bulk_pages(devices, side="device")  # type: ignore[arg-type]
                if dev is not None and any(fast[1].get(name) != off for name, off in dev[1].items()):
                    dev = None  # not one device page per host page: the slow path names the request
            if fast is not None and dev is not None:
                try:
                    admission.check_readable(fast[0])
                except InvalidIndices:
                    dev = None
            if fast is None or dev is None:
                each_host, each_given = [], []
                for i, request in enumerate(hosts, start):
                    with _naming_request(i):
                        pages, own = self._load_pages(request, None if devices is None else devices[i - start])
                        admission.check_readable(pages)
                    each_host.append(pages)
                    each_given.append(own)
                fast, dev = concatenated(each_host), concatenated(each_given)
            extend(host, start, fast, len(hosts))
            extend(given, start, dev, len(hosts))
        return host[0], host[1], given[0], given[1]

    async def _carriers(
        self, kind: str, requests: RequestPages, priority: int, fence: object | None,
        allocated: frozenset[str] | Sequence[frozenset[str]], *, want_handles: bool = True,
    ) -> tuple[list[Carrier], list[OperationHandle] | None]:
        """The carriers of a bulk call's requests (cut by `carrier_bounds`) and
        their handles, in order; the loop runs in between once a step has
        taken long enough. A backup's requests become the writers of their
        pages. A call cancelled meanwhile gives back every page it took."""
        ctx = self._contexts[kind]
        common, each = (allocated, None) if isinstance(allocated, frozenset) else (frozenset[str](), allocated)
        bounds = carrier_bounds(requests.offsets, requests.count, self._bytes_per_page,
                                max_bytes=ctx.max_bytes, max_requests=ctx.max_requests, allocated=each)
        carriers: list[Carrier] = []
        handles: list[OperationHandle] = []
        clock = StepClock()
        ids = self._ids
        try:
            for a, b in bounds:
                own = requests.slice(a, b)
                pools = (common if each is None else each[a]) & own.host.keys()
                carrier = Carrier(ctx, next(self._carrier_ids), own, list(itertools.islice(ids, b - a)),
                                  priority=priority, fence=fence, allocated=pools)
                carriers.append(carrier)
                if ctx.direction is Direction.BACKUP:  # a backup's requests write its pages (no handle each)
                    carrier.start_writes()
                if want_handles:
                    handles += carrier.handles()
                await clock.checkpoint()
        except BaseException as exc:
            for carrier in carriers:
                ctx.lane.abandon(carrier, exc)
            done = sum(c.count for c in carriers)
            if ctx.direction is Direction.BACKUP:
                self._admission.abandon_host({name: requests.host[name][off[done]:]
                                              for name, off in requests.offsets.items()})
            else:
                reads, owned = rest_of_load(requests.host, requests.device, requests.offsets, done, allocated)
                device = {name: PageList(p, self.group[name].page_size) for name, p in owned.items()}
                self._admission.release(Claim(reads=reads, device=device), succeeded=False)
            raise
        return carriers, handles if want_handles else None

    def _load_pages(
        self, host_indices: Mapping[str, IndexLike], device_indices: Mapping[str, IndexLike] | None
    ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """A load's host pages and the device pages it was given, checked as a pair."""
        host = self._admission.pages(host_indices, side="host")
        given = self._admission.pages(device_indices or {}, side="device", allow_empty=True)
        self._check_pairs(host, given, every_pool=False, what="a load names its host pages for every pool")
        return host, given

    def _check_backup(
        self, device_indices: Mapping[str, IndexLike], host_indices: Mapping[str, IndexLike] | None,
        priority: int, after: object | None,
    ) -> tuple[dict[str, list[int]], dict[str, list[int]] | None, object | None]:
        check_priority(priority)
        device = self._admission.pages(device_indices, side="device")
        named = None
        if host_indices is not None:
            named = self._admission.pages(host_indices, side="host")
            self._check_pairs(named, device, every_pool=True, what="a backup into named host pages names both for every pool")
        return device, named, None if after is None else capture_fence(after)

    def _valid_counts(
        self, rows: Mapping[str, int], device: Mapping[str, list[int]]
    ) -> dict[str, tuple[str, list[int]]]:
        """A backup's ``valid_rows=`` as counts per page: pool -> (its slot owner,
        valid rows per page of the owner), only for pools with a partial page.
        `InvalidIndices` (rule ``valid-rows``) names the pool and the value."""
        if not isinstance(rows, Mapping):
            raise InvalidIndices(f"valid_rows must map pool names to row counts; got {type(rows).__name__}",
                                 rule="valid-rows")
        out: dict[str, tuple[str, list[int]]] = {}
        group = self.group
        for name, n in rows.items():
            spec = group[name] if name in group else None
            owner = None if spec is None else (spec.sidecar.source if spec.sidecar is not None else name)
            if spec is None or owner not in device or not spec.host.has_bytes:
                raise InvalidIndices(
                    f"valid_rows names pool {name!r}; it may name the pools with bytes of this backup and their "
                    f"sidecars ({sorted(n for o in device for n in self._storage_members.get(o, []))})",
                    pool=str(name), rule="valid-rows",
                )
            size = spec.page_size  # a sidecar's: its rows per source page
            assert owner is not None
            total = len(device[owner]) * size
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= total:
                raise InvalidIndices(
                    f"pool {name!r} has {total} rows in this backup; valid_rows[{name!r}] must be an int in 0..{total}, "
                    f"the rows from the first that hold data; got {n!r}",
                    pool=name, rule="valid-rows",
                )
            if n < total:
                out[name] = (owner, [min(size, max(0, n - i * size)) for i in range(len(device[owner]))])
        return out

    def _record_valid(self, counts: Mapping[str, tuple[str, list[int]]], host: Mapping[str, list[int]]) -> None:
        """Record the partial pages of a backup's host pages (`PoolGroup.valid_rows`)."""
        valid_rows = self.group.valid_rows
        for name, (owner, per_page) in counts.items():
            size = self.group[name].page_size
            table = valid_rows.setdefault(name, {})
            for page, n in zip(host[owner], per_page):
                if n < size:
                    table[page] = n

    def _check_pairs(
        self, host: Mapping[str, list[int]], device: Mapping[str, list[int]], *, every_pool: bool, what: str
    ) -> None:
        """`InvalidIndices` unless each pool of ``device`` has as many host
        pages; with ``every_pool`` also each pool of ``host`` device pages (a
        load may leave pools out of ``device``: kvtier allocates those)."""
        missing = [n for n in device if n not in host] + ([n for n in host if n not in device] if every_pool else [])
        for name in missing:
            side, other = ("host", "device") if name in host else ("device", "host")
            raise InvalidIndices(
                f"pool {name!r} has {side} indices but no {other} indices; {what}",
                pool=name, rule="host-and-device",
            )
        for name, dev in device.items():
            if len(dev) != len(host[name]):
                size = self.group[name].page_size
                raise InvalidIndices(
                    f"pool {name!r} has {len(host[name]) * size} host indices and {len(dev) * size} device "
                    "indices; they must be equal",
                    pool=name, rule="equal-lengths",
                )

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
        check_priority(priority)
        fence = None if after is None else capture_fence(after)
        admission = self._admission
        host, given = self._load_pages(host_indices, device_indices)
        needed = {name: len(pages) * self.group[name].page_size for name, pages in host.items() if name not in given}
        admission.check_device_allocators(needed)  # before any wait: bad input changes nothing
        await admission.acquire_reads(host, lambda: self._lane(LOAD, "load()"))
        try:
            owned = await admission.reserve_device(needed)
        except BaseException:
            admission.release(Claim(reads=host), succeeded=False)
            raise
        device = given | {name: pages.pages for name, pages in owned.items()}
        handle, new = self._carry(LOAD, host, device, priority, fence, frozenset(owned))
        if new is not None:
            await lane.put(new)
        return handle

    def _carry(
        self, kind: str, host: dict[str, list[int]], device: dict[str, list[int]], priority: int,
        fence: object | None, allocated: frozenset[str],
    ) -> tuple[OperationHandle, Carrier | None]:
        """A lone request's handle, and the carrier to queue for it: none when
        the lane's newest queued carrier takes it (a few list appends), else a
        new carrier of one request, which the lone requests after it may join."""
        ctx = self._contexts[kind]
        lane = ctx.lane
        last: Carrier | None = lane.newest_open() if fence is None else None
        if last is not None:
            handle = last.join(host, device, self._ids, priority, allocated)
            if handle is not None:
                lane.joined(last)
                return handle, None
        op_id = next(self._ids)
        carrier = Carrier(ctx, next(self._carrier_ids), RequestPages.one(host, device), [op_id],
                          priority=priority, fence=fence, allocated=allocated)
        handle = OperationHandle(carrier, 0, op_id)
        if ctx.direction is Direction.BACKUP:
            carrier.start_writes([handle])
        return handle, carrier

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
        admission = self._admission
        host = admission.pages(host_indices, side="host")
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
        admission = self._admission
        key_lists = parse_keys(keys, self._storage_members, anchor=admission.spec)
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


# Requests a bulk call checks at a time, and that one carrier holds: each
# costs the loop a few microseconds.
_VALIDATE_SLICE = 128
_CARRIER_REQUESTS = 128


def _rows(pages: np.ndarray, k: int) -> np.ndarray:
    """The rows ``p*k .. p*k+k-1`` of every page ``p`` (a sidecar's, derived from its source's pages)."""
    return pages if k == 1 else (pages[:, None] * k + np.arange(k, dtype=np.int64)).reshape(-1)


def default_executor(group: PoolGroup) -> CopyExecutor:
    """`CudaExecutor` when the device pools live on a CUDA device, else `CpuExecutor`."""
    devices = {spec.device.device for spec in group if spec.device is not None}
    cuda = [d for d in devices if d.type == "cuda"]
    if cuda:
        from kvtier.transfers.cuda import CudaExecutor

        return CudaExecutor(cuda[0])
    return CpuExecutor()
