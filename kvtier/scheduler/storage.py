"""Storage operations: host -> storage (`write_storage`) and storage -> host (`prefetch`).

A storage operation moves whole pages between host slots and a
`StorageBackend`, keyed per anchor pool by page keys (see `kvtier.storage`).
It goes through a lane of its own like a backup or a load (a slow store never
holds a device copy back), and its handle is awaited the same way:
``await handle`` gives a `WriteStorageResult` or a `PrefetchResult`, or raises
the operation's error (`StorageError`, `StorageTimeout`, `TransferFailed`,
`OperationCancelled`, `SchedulerClosed`, `CorruptionDetected`).

One queue-entry model: the lane queues a `StorageCarrier` (`WriteCarrier`,
`PrefetchCarrier`), as it queues a `Carrier` for backups and loads. The
carrier owns the operation's transitions (a cancel, a prefetch's stop and
deadline) and state; the caller's `WriteStorageHandle` / `PrefetchHandle`
only reads it and passes a cancel or stop on, and the carrier keeps no
handle. The request's way is `storage_keys` (parse, pure) -> `Admission`
(pin or reserve the host pages) -> a carrier on the lane.

Batches: one ``exists`` lookup per batch, then reads or writes in rounds of
about ``SchedulerConfig.storage_chunk_bytes``. Serialising pages to bytes and
back (with each page's checksums, `kvtier.storage.pages`) runs in a worker
thread, never on the event loop.

Host pages keep one owner at a time: a write reads its pages as a load does
(admitted through `Admission.acquire_reads`); a prefetch writes its pages as
a backup does, and at its end hands the completed ones to the caller and
frees the rest, exactly once (`Admission.release` with the pages kept).

A stored page whose bytes fail their checksum (or do not fit this group, or
were written under another page identity: another model, page size, layout,
element format or shard, `kvtier.storage.identity`) is a **miss**: the hit
ends there, the pages before it are handed back, the count is in
`StorageStatistics.pages_rejected` (and by rule in ``pages_rejected_by_rule``,
``"identity"`` for the last) and one warning is logged per batch.
Its key is remembered (with the rule it broke) in the scheduler's
`RewriteKeys`, and a later `write_storage` of it puts it again instead of
trusting ``exists``, which repairs the store. Schedulers over one store may
share one `RewriteKeys` (``TransferScheduler(rewrite_keys=...)``), so a page
refused by one is put again by another's write.

`StorageCounters`, shared by both lanes, counts pages as they are put, found
present, rejected, and (for each completed prefetch) hit, missed or left
unread by a stop; `StorageStatistics` is its frozen record.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import torch

from kvtier.errors import ConfigurationError, CorruptionDetected, InvalidIndices, OperationCancelled, TransferFailed
from kvtier.logs import get_logger
from kvtier.policies import FrequencyGate, StoreAdmission
from kvtier.pools import PoolGroup, slots_of_pages
from kvtier.transfers import eventloop
from kvtier.scheduler import verify as verify_pages
from kvtier.scheduler.admission import Admission
from kvtier.scheduler.claims import Claim
from kvtier.scheduler.parse import storage_members
from kvtier.scheduler.lanes import DONE, QUEUED, Lane, StepClock, cancelled
from kvtier.scheduler.statistics import StorageStatistics
from kvtier.storage.base import PageBlobs, StorageBackend
from kvtier.storage.errors import StorageError, StorageTimeout
from kvtier.storage.identity import PageIdentity
from kvtier.storage.pages import decode_page, encode_page

__all__ = [
    "PrefetchCarrier",
    "PrefetchHandle",
    "PrefetchResult",
    "RewriteKeys",
    "StorageCarrier",
    "StorageCounters",
    "StorageHandle",
    "StoragePrefetches",
    "StorageStatistics",
    "StorageWrites",
    "WriteCarrier",
    "WriteStorageHandle",
    "WriteStorageResult",
    "check_store_admission",
    "storage_members",
]

log = get_logger("kvtier.scheduler")

# Keys whose stored bytes were found bad, remembered for a rewrite (oldest dropped first).
MAX_SUSPECT_KEYS = 1 << 16


class RewriteKeys(dict[bytes, str]):
    """Keys of stored pages found bad, each with the rule it broke (a
    `PageCorrupted` rule such as ``"checksum"``, ``"key"``, ``"length"``;
    ``"decode"`` for another `StorageError`): a `write_storage` of such a key
    puts it again instead of trusting ``exists``, and a lookup reads it as a
    miss until then. One per store: schedulers over the same store share one,
    so a page refused by one scheduler's prefetch is repaired by another's
    write. Holds at most ``limit`` keys (the oldest are dropped first).
    A plain dict underneath, so a lookup costs what a dict's does.

    Safe to share across threads (each scheduler's loop thread, an engine's
    own): `add` and `pop` take one lock, so concurrent adds at the bound
    never raise and no thread ever sees more than ``limit`` keys; lookups
    (``in``, ``get``, ``len``) take none. Change it only through `add` and `pop`.
    """

    def __init__(self, limit: int = MAX_SUSPECT_KEYS) -> None:
        super().__init__()
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(f"RewriteKeys needs an int limit >= 1; got {limit!r}")
        self.limit = limit
        self._lock = threading.Lock()

    def add(self, key: bytes, reason: str) -> None:
        """Remember ``key`` as bad for ``reason`` (the newest; the oldest is dropped at the bound)."""
        with self._lock:
            dict.pop(self, key, None)  # newest last: the oldest is dropped first
            if len(self) >= self.limit:
                # Drop before inserting, so a reader never sees limit + 1 keys.
                del self[next(iter(self))]
            self[key] = reason

    def pop(self, key: bytes, default: Any = None, /) -> Any:
        """Forget ``key`` (a write put it again); its reason, or ``default``."""
        with self._lock:
            return dict.pop(self, key, default)


@dataclass(frozen=True, slots=True)
class WriteStorageResult:
    """What a finished `write_storage` did, per anchor pool.

    ``pages_written`` were put by this operation; ``pages_present`` were
    already stored (by this engine or another), or put by another operation
    of the same batch that shares them (a common prefix), and not put again.
    ``pages_skipped`` were refused by the scheduler's store admission policy
    (``TransferScheduler(store_admission=...)``): not put and not looked up,
    so a skipped page may or may not be in the store; it counts in neither
    ``pages_written`` nor ``pages_present``, and the write still succeeds.
    ``nbytes`` counts the bytes put, sidecars included.
    """

    id: int
    pages: Mapping[str, int]
    pages_written: Mapping[str, int]
    pages_present: Mapping[str, int]
    nbytes: int
    seconds_queued: float
    seconds_total: float
    pages_skipped: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What a finished `prefetch` handed back, per anchor pool.

    ``pages[pool]`` pages are in host slots now, the first ``pages[pool]``
    keys of that pool, in key order; ``host_indices[pool]`` are their slots
    (pools with no page are left out, so it is empty when nothing was
    found; `TransferScheduler.free_host` of an empty mapping is a no-op),
    which the caller holds from now on: pass them to
    `TransferScheduler.load` and give them back with
    `TransferScheduler.free_host`, as after a backup. ``hit_pages`` is the
    run the prefetch set out to read: the longest run of stored pages from
    the first key as its lookup found it, cut short where a page was evicted,
    failed its checksum or could not be decoded before it was read; every key
    when the prefetch ended before its lookup. ``requested_pages``: keys asked
    for. ``stopped`` is True when it ended (stop or deadline) before every
    page of ``hit_pages`` was in.
    """

    id: int
    host_indices: Mapping[str, torch.Tensor]
    pages: Mapping[str, int]
    hit_pages: Mapping[str, int]
    requested_pages: Mapping[str, int]
    stopped: bool
    nbytes: int
    seconds_queued: float
    seconds_total: float

    @property
    def complete(self) -> bool:
        """Every requested page of every pool is in host slots."""
        return all(self.pages[p] == n for p, n in self.requested_pages.items())


class StorageCounters:
    """The live page counts of both storage lanes (see `StorageStatistics`)."""

    __slots__ = ("rejected", "hit", "missed", "stopped", "written", "present", "rejected_by_rule", "skipped",
                 "skipped_by_reason")

    def __init__(self) -> None:
        self.rejected = self.hit = self.missed = self.stopped = self.written = self.present = self.skipped = 0
        self.rejected_by_rule: dict[str, int] = {}
        self.skipped_by_reason: dict[str, int] = {}

    def reject(self, rule: str) -> None:
        """One stored page refused for ``rule``."""
        self.rejected += 1
        self.rejected_by_rule[rule] = self.rejected_by_rule.get(rule, 0) + 1

    def statistics(self, keys_to_rewrite: int) -> StorageStatistics:
        return StorageStatistics(
            self.rejected, keys_to_rewrite, self.hit, self.missed, self.stopped, self.written, self.present,
            dict(self.rejected_by_rule), self.skipped, dict(self.skipped_by_reason),
        )


def stored_nbytes(group: PoolGroup, page_nbytes: Mapping[str, int], pool: str, pages: Sequence[int]) -> int:
    """Bytes of host ``pages`` of anchor ``pool`` with its sidecars' rows
    (``page_nbytes[pool]`` a whole page), counting only the valid rows of
    partial pages (`PoolGroup.valid_rows`): the bytes a write puts and a read
    lands."""
    valid_rows = group.valid_rows
    if not any(valid_rows.values()):
        return len(pages) * page_nbytes[pool]
    total = 0
    for spec in (group[pool], *group.sidecars_of(pool)):
        table = valid_rows.get(spec.name)
        rows = spec.page_size  # a sidecar's: its rows per source page
        counted = sum(table.get(p, rows) for p in pages) if table else len(pages) * rows
        total += counted * spec.slot_nbytes
    return total


class StorageCarrier:
    """The queue entry of one storage operation: a record, not a handle.

    It owns the operation's transitions and state: its pages (``claim``,
    key by key in ``keys``), a cancel asked for, the outcome, and who waits
    for it. The lane writes only ``state``, ``dispatched_ns`` and
    ``ended_ns`` (`Entry`), and the lane's work the progress of a running
    batch. The caller's handle (`WriteStorageHandle`, `PrefetchHandle`)
    reads it and asks it to cancel or stop; the carrier keeps no handle.
    """

    __slots__ = (
        # What the lane reads and writes: the queue entry.
        "id", "kind", "priority", "nbytes", "count", "submitted_ns", "dispatched_ns", "ended_ns", "state",
        # What it carries and how it ends.
        "lane", "keys", "claim", "cancel_requested", "closed_error", "result", "error", "_future",
    )

    def __init__(
        self, lane: Lane[Any], op_id: int, priority: int, keys: dict[str, list[bytes]], claim: Claim, nbytes: int
    ) -> None:
        self.lane = lane
        self.id = op_id
        self.kind = lane.name
        self.priority = priority
        self.nbytes = nbytes
        self.count = 1
        self.submitted_ns = time.perf_counter_ns()
        self.dispatched_ns = self.ended_ns = 0
        self.state = QUEUED
        self.keys = keys
        self.claim = claim
        self.cancel_requested = False
        # Set when a cancelling close ends it while it runs (`_StorageWork.abort`).
        self.closed_error: BaseException | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        # Made when someone waits before the end.
        self._future: eventloop.Future[None] | None = None

    # -- what the lane asks ---------------------------------------------------------------

    def request_ids(self) -> tuple[int, ...]:
        return (self.id,)

    @property
    def ending(self) -> bool:
        """Asked to end with an error: cancelled, or its scheduler closed cancelling."""
        return self.cancel_requested or self.closed_error is not None

    def ending_error(self, error: BaseException | None) -> BaseException | None:
        """A cancel it accepted wins over ``error`` (`Entry.ending_error`), and
        a cancelling close over both."""
        if self.cancel_requested:
            return cancelled(self.id)
        return self.closed_error or error

    def settle(self, result: object, error: BaseException | None, lane: Lane[Any] | None) -> None:
        """It ended (`Lane.finish`, after its work gave back what it held):
        count it in ``lane`` (None: a submission undone, not counted), record
        the outcome and wake every waiter. Called once."""
        if lane is not None:
            start = self.dispatched_ns or self.ended_ns
            lane.counters.ended(self.id, lane.name, error, getattr(result, "nbytes", 0),
                                start - self.submitted_ns, self.ended_ns - start)
        self.result = result if error is None else None
        self.error = error
        future, self._future = self._future, None
        if future is not None:
            future.set_result(None)
        self._resolved()

    def _resolved(self) -> None:
        """Hook for subclasses: the operation has just ended."""

    # -- what its handle (and a reader waiting on its pages) asks --------------------------

    def done(self) -> bool:
        return self.state == DONE

    def exception(self) -> BaseException | None:
        return self.error

    def cancel(self) -> bool:
        """Cancel it (see `StorageHandle.cancel`); False once it ended."""
        lane = self.lane
        lane.check_caller("cancel()")
        if self.state == DONE:
            return False
        self.cancel_requested = True
        lane.end_early(self)
        return True

    async def settled(self) -> None:
        if self.state != DONE:
            if self._future is None:
                self._future = self.lane.new_future()
            await eventloop.wait_future(self._future)

    def outcome(self) -> Any:
        """The result (None until it ended), or raise its error."""
        if self.error is not None:
            raise self.error
        return self.result

    def __repr__(self) -> str:
        pages = sum(len(p) for p in self.keys.values())
        return f"<{type(self).__name__} {self.id} [{self.kind}, {self.state}, {pages} pages]>"


class WriteCarrier(StorageCarrier):
    """The carrier of a `write_storage`: the host pages it reads (pinned by
    `Admission.acquire_reads`) by key, and per pool the pages put, found
    present and skipped so far. ``nbytes``: the bytes it puts, only the valid
    rows of partial pages (`PoolGroup.valid_rows`), as a backup counts them."""

    __slots__ = ("written", "present", "skipped", "written_nbytes")

    def __init__(
        self, lane: Lane[Any], op_id: int, priority: int, keys: dict[str, list[bytes]], host: dict[str, list[int]],
        *, group: PoolGroup, page_nbytes: Mapping[str, int],
    ) -> None:
        nbytes = sum(stored_nbytes(group, page_nbytes, name, pages) for name, pages in host.items())
        super().__init__(lane, op_id, priority, keys, Claim(reads=host), nbytes)
        self.written = dict.fromkeys(self.keys, 0)
        self.present = dict.fromkeys(self.keys, 0)
        self.skipped = dict.fromkeys(self.keys, 0)
        self.written_nbytes = 0  # the bytes put: valid rows only, for partial pages


class PrefetchCarrier(StorageCarrier):
    """The carrier of a `prefetch`.

    ``hits[pool]``: pages still wanted (the hit run, once looked up; every key
    before that); ``done_pages[pool]``: pages in host slots so far, a prefix;
    ``scope``: the cancel scope of its running fetch; ``timer``: its deadline
    (policy ``"timeout"``), dropped when it ends.
    """

    __slots__ = ("all_pools", "policy", "hits", "done_pages", "looked_up", "stop_requested", "scope", "timer")

    def __init__(
        self, lane: Lane[Any], op_id: int, priority: int, keys: dict[str, list[bytes]], pages: dict[str, list[int]],
        *, admission: Admission, page_nbytes: Mapping[str, int], policy: str, all_pools: bool,
    ) -> None:
        nbytes = sum(len(p) * page_nbytes[name] for name, p in pages.items())  # the most it may read
        super().__init__(lane, op_id, priority, keys, Claim(writes=pages), nbytes)
        # The writer of the host pages reserved for it (a backup's requests are theirs):
        # a load or write of them waits for this prefetch's end.
        owners = admission.owners
        for name, p in pages.items():
            owners[name].start_write(p, self)
        self.policy = policy
        self.all_pools = all_pools
        self.hits = {pool: len(keys) for pool, keys in self.keys.items()}
        self.done_pages = dict.fromkeys(self.keys, 0)
        self.looked_up = False
        self.stop_requested = False
        self.scope: anyio.CancelScope | None = None
        self.timer: eventloop.TimerHandle | None = None

    def stop(self) -> bool:
        """See `PrefetchHandle.stop`."""
        if self.policy == "wait_complete":
            raise ConfigurationError(
                f"prefetch {self.id} has policy 'wait_complete', which does not stop early; "
                "use cancel(), or policy 'best_effort' or 'timeout'"
            )
        lane = self.lane
        lane.check_caller("stop()")
        if self.state == DONE:
            return False
        self.stop_requested = True
        lane.end_early(self)
        return True

    def _resolved(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None  # breaks carrier -> timer -> carrier.stop


class StorageHandle:
    """What the caller holds for a storage operation: a promise that reads
    its carrier (`StorageCarrier`) and changes nothing itself.

    ``await handle`` returns the operation's result or raises its error;
    awaiting again gives the same outcome. A handle resolves exactly once.
    Cancelling the task that awaits a handle does not cancel the operation;
    `cancel` does. ``nbytes``: the most it may move until it ends (a prefetch
    cannot know a page's stored length before it reads it), then what its
    result's ``nbytes`` says.
    """

    __slots__ = ("_carrier", "id")

    def __init__(self, carrier: StorageCarrier) -> None:
        self._carrier = carrier
        self.id = carrier.id

    @property
    def kind(self) -> str:
        """``"write_storage"`` or ``"prefetch"``."""
        return self._carrier.kind

    @property
    def priority(self) -> int:
        return self._carrier.priority

    @property
    def nbytes(self) -> int:
        return self._carrier.nbytes

    @property
    def keys(self) -> dict[str, list[bytes]]:
        """The page keys by anchor pool, as given (a new dict of new lists)."""
        return {pool: list(keys) for pool, keys in self._carrier.keys.items()}

    @property
    def submitted_ns(self) -> int:
        """``time.perf_counter_ns()`` at submission."""
        return self._carrier.submitted_ns

    @property
    def state(self) -> str:
        """``"queued"``, ``"running"`` or ``"done"``."""
        return self._carrier.state

    @property
    def queued(self) -> bool:
        return self._carrier.state == QUEUED

    @property
    def cancel_requested(self) -> bool:
        return self._carrier.cancel_requested

    def done(self) -> bool:
        return self._carrier.state == DONE

    def exception(self) -> BaseException | None:
        """The error the operation ended with (None while it runs, or on success)."""
        return self._carrier.error

    def cancel(self) -> bool:
        """Cancel the operation: the handle raises `OperationCancelled`. A
        queued operation is dropped at once (what it took is given back); a
        running one gives back what it holds once no read or write uses it
        any more. Returns False when the operation had already finished."""
        return self._carrier.cancel()

    async def settled(self) -> None:
        """Return once the operation has ended, however it ended."""
        await self._carrier.settled()

    async def wait(self) -> Any:
        """The same as ``await handle``."""
        await self._carrier.settled()
        return self._carrier.outcome()

    def __await__(self) -> Generator[Any, None, Any]:
        carrier = self._carrier
        if carrier.state != DONE:  # an ended handle is awaited without a coroutine
            yield from carrier.settled().__await__()
        return carrier.outcome()

    def outcome(self) -> Any:
        """The result of an ended operation, or raise its error."""
        return self._carrier.outcome()

    def __repr__(self) -> str:
        c = self._carrier
        pages = sum(len(p) for p in c.keys.values())
        return f"<{type(self).__name__} {self.id} [{c.kind}, {c.state}, {pages} pages]>"


class WriteStorageHandle(StorageHandle):
    """Handle of a `write_storage`; ``await`` gives a `WriteStorageResult`.

    `cancel` ends it at once (a round of its pages being read into their
    stored form is finished first): its host pages are the caller's again
    and a store call that no other operation of its batch waits for is
    abandoned, so a store that stopped answering never holds it. Pages it
    already put stay stored, each whole; a put abandoned in flight leaves
    each of its pages whole or absent.
    """

    __slots__ = ()

    async def wait(self) -> WriteStorageResult:
        result: WriteStorageResult = await super().wait()
        return result


class PrefetchHandle(StorageHandle):
    """Handle of a `prefetch`; ``await`` gives a `PrefetchResult`."""

    __slots__ = ()
    _carrier: PrefetchCarrier

    def __init__(self, carrier: PrefetchCarrier) -> None:
        super().__init__(carrier)

    async def wait(self) -> PrefetchResult:
        result: PrefetchResult = await super().wait()
        return result

    @property
    def policy(self) -> str:
        return self._carrier.policy

    @property
    def all_pools(self) -> bool:
        return self._carrier.all_pools

    @property
    def pages_done(self) -> Mapping[str, int]:
        """Pages of each pool in host slots so far (a prefix of its keys)."""
        return dict(self._carrier.done_pages)

    @property
    def hit_pages(self) -> Mapping[str, int] | None:
        """Pages of each pool the prefetch is reading (the stored run from the
        first key), once its lookup ran; None before. With `pages_done`, what
        an engine needs to decide whether to wait or `stop`."""
        c = self._carrier
        return dict(c.hits) if c.looked_up else None

    def stop(self) -> bool:
        """End the prefetch now and hand back the pages it completed (policy
        ``best_effort`` or ``timeout``). A page being written into host slots
        at this moment is finished first; a read from the store in flight is
        abandoned (a `FileStore` read, which runs in a worker thread, is
        waited for and its pages not used). ``await handle`` then gives the
        `PrefetchResult`. Returns False when the prefetch had already finished.

        Raises `ValueError` for policy ``wait_complete`` (it hands back every
        hit page or fails; use `cancel` to give up on it).
        """
        return self._carrier.stop()


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


class _RunningBatch:
    """One storage batch in flight: its carriers, the cancel scope of its
    store calls, and whether a worker thread uses its host pages now."""

    __slots__ = ("carriers", "scope", "in_thread")

    def __init__(self, carriers: list[Any]) -> None:
        self.carriers = carriers
        self.scope = anyio.CancelScope()
        self.in_thread = False

    def abandon_if_ended(self) -> None:
        """Every operation of the batch ended: nothing waits for its store calls."""
        if all(h.done() for h in self.carriers):
            self.scope.cancel()

    async def in_worker(self, func: Any, *args: Any) -> Any:
        """``func(*args)`` in a worker thread that reads or writes the batch's
        host pages: an operation asked to end meanwhile ends after it returns."""
        self.in_thread = True
        try:
            return await anyio.to_thread.run_sync(func, *args)
        finally:
            self.in_thread = False


class _StorageWork:
    """What both storage lanes share: the backend, page sizes, failures, and
    the record of keys whose stored bytes were bad."""

    def __init__(
        self,
        backend: StorageBackend,
        group: PoolGroup,
        admission: Admission,
        page_nbytes: Mapping[str, int],
        suspects: RewriteKeys,
        *,
        identities: Mapping[str, PageIdentity],
        counters: StorageCounters,
        chunk_bytes: int,
        in_flight: int,
        verify: bool,
    ) -> None:
        self._backend = backend
        self._group = group
        self._admission = admission
        self._page_nbytes = page_nbytes
        self._suspects = suspects
        self._identities = identities  # per anchor pool: what its stored pages are (headers carry its tags)
        self.counters = counters
        self._chunk_bytes = chunk_bytes
        self._in_flight = in_flight
        self._verify = verify
        # The carriers of running batches, each with its batch (`run`).
        self._batches: dict[Any, _RunningBatch] = {}

    @property
    def max_in_flight(self) -> int:
        return self._in_flight

    def _stored_nbytes(self, pool: str, pages: list[int]) -> int:
        return stored_nbytes(self._group, self._page_nbytes, pool, pages)

    async def run(self, batch: int, carriers: list[Any], lane: Lane[Any], clock: StepClock) -> None:
        """Run the batch's store calls in a cancel scope of its own: once every
        operation of the batch has ended (each cancelled, or a cancelling
        close), the call the batch waits on is abandoned at once instead of
        waiting for the store's answer or its timeout. An abandoned call's late
        answer goes nowhere: the backend drops the connection it was sent on."""
        running = _RunningBatch(carriers)
        batches = self._batches
        for h in carriers:
            batches[h] = running
        try:
            with running.scope:
                await self._run(batch, carriers, lane, running)
        finally:
            for h in carriers:
                batches.pop(h, None)

    async def _run(self, batch: int, carriers: list[Any], lane: Lane[Any], running: _RunningBatch) -> None:
        raise NotImplementedError

    def interrupt(self, carrier: Any, lane: Lane[Any]) -> None:
        """A running operation was asked to end (cancel, stop, cancelling close)."""
        running = self._batches.get(carrier)
        if running is None:
            return
        self._end_now(carrier, running, lane)
        running.abandon_if_ended()

    def _end_now(self, carrier: Any, running: _RunningBatch, lane: Lane[Any]) -> None:
        """End ``carrier`` now if no worker thread reads or writes its host
        pages at this moment; else its batch ends it once that thread returns."""
        if not running.in_thread:
            lane.finish(carrier, error=carrier.ending_error(None))

    def abort(self, lane: Lane[Any], error: BaseException) -> None:
        """A cancelling close: every running operation of the lane that is not
        already ending ends with ``error`` (`SchedulerClosed`), now or once a
        worker thread that uses its pages returns, and the store calls no
        operation waits for any more are abandoned."""
        for h in list(self._batches):
            if h.done() or h.ending:
                continue
            h.closed_error = error
            self.interrupt(h, lane)

    def failure(self, exc: Exception, batch: int, carriers: list[Any]) -> BaseException:
        """The backend's own `StorageError` (typed, chained); anything else as `TransferFailed`."""
        if isinstance(exc, StorageError):
            return exc
        ids = tuple(h.id for h in carriers)
        error = TransferFailed(f"storage batch {batch} (operations {list(ids)}) failed: {exc!r}", operation_ids=ids)
        error.__cause__ = exc
        return error

    async def exists(self, keys: list[bytes]) -> list[bool]:
        """``backend.exists(keys)``, checked to answer once per key; a key whose
        stored bytes were found bad counts as missing."""
        if not keys:
            return []
        present = await self._backend.exists(keys)
        if len(present) != len(keys):
            raise StorageError(
                f"{self._backend.name}: exists answered {len(present)} results for {len(keys)} keys",
                backend=self._backend.name, operation="exists",
            )
        suspects = self._suspects
        if suspects:
            present = [p and k not in suspects for k, p in zip(keys, present)]
        return present


class StorageWrites(_StorageWork):
    """The work of the write_storage lane.

    ``store_admission`` (None: store every page) is asked once per page key
    of each live write, tier ``"store"``, on the loop thread before the
    batch's ``exists`` lookup; a page it refuses is neither looked up nor
    put (counted in ``pages_skipped``, by reason).
    """

    def __init__(self, *args: Any, store_admission: StoreAdmission | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._store_admission = store_admission

    def _admitted(self, live: list[WriteCarrier]) -> list[tuple[WriteCarrier, str, int]]:
        """The pages of ``live`` the store admission policy lets through;
        the others are counted skipped, on their carrier and by reason."""
        policy = self._store_admission
        if policy is None:
            return [(h, pool, i) for h in live for pool, ks in h.keys.items() for i in range(len(ks))]
        admit = policy.admit
        counters = self.counters
        by_reason = counters.skipped_by_reason
        todo = []
        for h in live:
            for pool, ks in h.keys.items():
                for i, key in enumerate(ks):
                    reason = admit(key, "store")
                    if reason is None:
                        todo.append((h, pool, i))
                        continue
                    if not isinstance(reason, str) or not reason:
                        raise ConfigurationError(
                            f"store admission policy {policy!r} must return None or a non-empty reason string; "
                            f"got {reason!r}"
                        )
                    h.skipped[pool] += 1
                    counters.skipped += 1
                    by_reason[reason] = by_reason.get(reason, 0) + 1
        return todo

    async def _run(self, batch: int, carriers: list[WriteCarrier], lane: Lane[Any], running: _RunningBatch) -> None:
        if self._verify:
            await self._drop_corrupted(carriers, lane, running)
            self._end_asked(running, lane)
        self._drop_key_conflicts(carriers, lane)
        live = [h for h in carriers if not h.done()]
        todo = self._admitted(live)
        left = dict.fromkeys(live, 0)
        for h, _, _ in todo:
            left[h] += 1
        present = await self.exists([h.keys[pool][i] for h, pool, i in todo])
        # A key missing for several operations (a shared prefix) is put once,
        # by the first; the others count it as present once that put landed.
        missing: list[tuple[WriteCarrier, str, int]] = []
        sharers: dict[bytes, list[tuple[WriteCarrier, str, int]]] = {}
        counters = self.counters
        for (h, pool, i), stored in zip(todo, present):
            key = h.keys[pool][i]
            if stored:
                h.present[pool] += 1
                counters.present += 1
                left[h] -= 1
            elif key in sharers:
                sharers[key].append((h, pool, i))
            else:
                sharers[key] = []
                missing.append((h, pool, i))

        def landed(item: tuple[WriteCarrier, str, int]) -> None:
            h, pool, i = item
            key = h.keys[pool][i]
            self._suspects.pop(key, None)
            counters.written += 1
            h.written[pool] += 1
            h.written_nbytes += self._stored_nbytes(pool, h.claim.reads[pool][i:i + 1])
            left[h] -= 1
            for other, other_pool, _ in sharers[key]:
                other.present[other_pool] += 1
                counters.present += 1
                left[other] -= 1

        try:
            for chunk in self._rounds(missing):
                chunk = [item for item in (self._owner(item, sharers) for item in chunk) if item is not None]
                if not chunk:
                    continue
                pages = await running.in_worker(self._encode, chunk)
                # An operation asked to end while its pages were read ends now;
                # the put goes on for the others that want its pages.
                self._end_asked(running, lane)
                try:
                    await self._backend.put(pages)
                except Exception as exc:
                    # Some pages may have landed (a store at its memory limit stores
                    # the first ones): count what is stored, not what was asked.
                    after = await self._stored_after_failure(chunk, exc)
                    for item, ok in zip(chunk, after):
                        if ok:
                            landed(item)
                    raise
                for item in chunk:
                    landed(item)
        except Exception:
            # Operations whose every page landed before the failure succeed.
            for h in live:
                if not left[h] and not h.ending:
                    lane.finish(h)
            raise

    @staticmethod
    def _owner(
        item: tuple[WriteCarrier, str, int], sharers: dict[bytes, list[tuple[WriteCarrier, str, int]]]
    ) -> tuple[WriteCarrier, str, int] | None:
        """Who puts ``item``'s page: its first operation while that one still
        wants it, else the first of the others sharing the key that does (its
        own host page of that key: an ended operation's pages are no longer its),
        else nobody."""
        h, pool, i = item
        if not h.ending and not h.done():
            return item
        key = h.keys[pool][i]
        others = sharers[key]
        for n, (o, o_pool, o_i) in enumerate(others):
            if not o.ending and not o.done():
                del others[n]
                sharers[key] = others
                return o, o_pool, o_i
        return None

    async def _stored_after_failure(self, chunk: list[tuple[WriteCarrier, str, int]], exc: Exception) -> list[bool]:
        """After a failed put of ``chunk`` (pages missing before it), which of
        them the store holds now, by one ``exists`` lookup. None are counted
        after a timeout (the store is not answering: asking again would wait
        as long) or when the lookup fails too."""
        if isinstance(exc, StorageTimeout):
            return [False] * len(chunk)
        keys = [h.keys[pool][i] for h, pool, i in chunk]
        try:
            present = await self._backend.exists(keys)
        except Exception:  # noqa: BLE001 - the put's own error is the one raised
            return [False] * len(chunk)
        if len(present) != len(keys):
            return [False] * len(chunk)
        # A suspect (a page found damaged, put again to repair it) is present
        # before its put: `exists` cannot tell the repaired page from the
        # damaged one, so it is not counted and stays a suspect to rewrite.
        return [bool(p) and k not in self._suspects for k, p in zip(keys, present)]

    def _end_asked(self, running: _RunningBatch, lane: Lane[Any]) -> None:
        """End the operations of the batch asked to end while a worker thread used their pages."""
        for h in running.carriers:
            if h.ending and not h.done():
                lane.finish(h, error=h.ending_error(None))
        running.abandon_if_ended()

    def _drop_key_conflicts(self, carriers: list[WriteCarrier], lane: Lane[Any]) -> None:
        """Fail the writes that name a key another write of the batch names for
        another pool, before anything is put (one call is checked at submission:
        `check_one_page_per_key`). The first write to name it keeps it."""
        owner: dict[bytes, tuple[str, WriteCarrier]] = {}
        for h in carriers:
            if h.done():
                continue
            clash = None
            for pool, listed in h.keys.items():
                for key in listed:
                    first = owner.get(key)
                    if first is not None and first[0] != pool:
                        clash = (key, first)
                        break
                if clash is not None:
                    break
            if clash is None:
                for pool, listed in h.keys.items():
                    for key in listed:
                        owner.setdefault(key, (pool, h))
            else:
                key, (pool, other) = clash
                lane.finish(h, error=InvalidIndices(
                    f"write {h.id} names key {key.hex()}, which write {other.id} of the same batch names for pool "
                    f"{pool!r}; one key names one page of one pool",
                    pool=pool, rule="one-page-per-key",
                ))

    def _rounds(self, todo: list[tuple[WriteCarrier, str, int]]) -> list[list[tuple[WriteCarrier, str, int]]]:
        """``todo`` in rounds of about ``storage_chunk_bytes`` (at least one page each)."""
        rounds: list[list[tuple[WriteCarrier, str, int]]] = []
        current: list[tuple[WriteCarrier, str, int]] = []
        size = 0
        for item in todo:
            nbytes = self._page_nbytes[item[1]]
            if current and size + nbytes > self._chunk_bytes:
                rounds.append(current)
                current, size = [], 0
            current.append(item)
            size += nbytes
        if current:
            rounds.append(current)
        return rounds

    def _encode(self, chunk: list[tuple[WriteCarrier, str, int]]) -> list[PageBlobs]:
        """(Worker thread) the stored form of each page of ``chunk``."""
        return [
            PageBlobs(key, encode_page(self._group, pool, h.claim.reads[pool][i], key=key,
                                       identity=self._identities[pool]))
            for h, pool, i in chunk
            for key in (h.keys[pool][i],)
        ]

    async def _drop_corrupted(self, carriers: list[WriteCarrier], lane: Lane[Any], running: _RunningBatch) -> None:
        """Verify mode: fail the writes whose host pages no longer match their
        checksums, so that corrupted bytes never reach the shared store."""
        reads = [h.claim.reads for h in carriers]
        found = await running.in_worker(verify_pages.corrupted, self._group.checksums, self._group, reads)
        for index, pool, pages in found:
            h = carriers[index]
            lane.finish(h, error=CorruptionDetected(pool, pages, operation_id=h.id))

    def end(self, h: WriteCarrier, error: BaseException | None) -> WriteStorageResult | None:
        self._admission.release(h.claim, succeeded=error is None)
        if error is not None:
            return None
        end = h.ended_ns
        nbytes = h.nbytes = h.written_nbytes  # the bytes put: none for a page found stored
        return WriteStorageResult(
            h.id, {p: len(k) for p, k in h.keys.items()}, dict(h.written), dict(h.present), nbytes,
            seconds_queued=((h.dispatched_ns or end) - h.submitted_ns) * 1e-9,
            seconds_total=(end - h.submitted_ns) * 1e-9, pages_skipped=dict(h.skipped),
        )


class StoragePrefetches(_StorageWork):
    """The work of the prefetch lane."""

    def __init__(self, *args: Any, prefetches_in_flight: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prefetches_in_flight = prefetches_in_flight
        self._members = storage_members(self._group)

    async def _run(
        self, batch: int, carriers: list[PrefetchCarrier], lane: Lane[Any], running: _RunningBatch
    ) -> None:
        live = [h for h in carriers if not h.done()]
        lookup = [(h, pool) for h in live for pool in h.keys]
        present = await self.exists([k for h, pool in lookup for k in h.keys[pool]])
        offset = 0
        found: dict[PrefetchCarrier, dict[str, int]] = {}
        for h, pool in lookup:
            n = len(h.keys[pool])
            hits = present[offset:offset + n]
            offset += n
            found.setdefault(h, {})[pool] = hits.index(False) if False in hits else n
        for h, by_pool in found.items():
            if h.done():
                continue
            if h.all_pools and any(hit < len(h.keys[pool]) for pool, hit in by_pool.items()):
                by_pool = dict.fromkeys(by_pool, 0)  # one pool short: none is of use
            for pool, hit in by_pool.items():
                self._shorten(h, pool, hit)
            h.looked_up = True
        rejected: list[tuple[int, str, bytes, str]] = []
        limiter = anyio.Semaphore(self._prefetches_in_flight)
        async with anyio.create_task_group() as tg:
            for h in live:
                if not h.done():
                    tg.start_soon(self._fetch_one, batch, h, limiter, lane, rejected)
        if rejected:
            log.warning("storage.pages_rejected", batch=batch, lane=lane.name, pages=len(rejected),
                        first=[{"operation": o, "pool": p, "key": k.hex(), "error": e} for o, p, k, e in rejected[:4]])

    def _shorten(self, h: PrefetchCarrier, pool: str, hit: int) -> None:
        """Only the first ``hit`` pages of ``pool`` can come: free the others now."""
        self._admission.shorten_writes(h.claim, pool, hit)
        h.hits[pool] = min(h.hits[pool], hit)
        h.done_pages[pool] = min(h.done_pages[pool], hit)

    def _cut(self, h: PrefetchCarrier, pool: str, hit: int) -> None:
        """A read found only ``hit`` pages of ``pool``. With ``all_pools`` one
        pool short makes every pool useless (a window or state belongs to the
        whole prefix, kv pages without them to none): every pool is cut to
        nothing, pages already read included, and the fetch reads no more. No
        read is writing any of them now: a fetch writes one pool's round at a
        time, and this runs after that round."""
        self._shorten(h, pool, hit)
        if h.all_pools and hit < len(h.keys[pool]):
            for p in h.keys:
                self._shorten(h, p, 0)

    async def _fetch_one(
        self, batch: int, h: PrefetchCarrier, limiter: anyio.Semaphore, lane: Lane[Any], rejected: list[tuple[int, str, bytes, str]]
    ) -> None:
        """Read ``h``'s hit pages in rounds, pool by pool, and finish it."""
        if h.done():  # stopped or cancelled while its batch looked up keys
            return
        error: BaseException | None = None
        try:
            with anyio.CancelScope() as scope:
                h.scope = scope
                if h.stop_requested or h.ending:
                    scope.cancel()
                async with limiter:
                    for pool, keys in h.keys.items():
                        members = self._members[pool]
                        per_round = max(1, self._chunk_bytes // self._page_nbytes[pool])
                        while h.done_pages[pool] < h.hits[pool]:
                            if h.stop_requested or h.ending:
                                # Asked while a round was written (shielded): no further round.
                                return
                            start = h.done_pages[pool]
                            end = min(start + per_round, h.hits[pool])
                            blobs = await self._backend.get(keys[start:end], members)
                            got = next((j for j, b in enumerate(blobs) if b is None), len(blobs))
                            if got < end - start:
                                # Evicted or overwritten since the lookup: the hit ends here.
                                self._cut(h, pool, start + got)
                            if not got:
                                continue
                            pages = h.claim.writes[pool][start:start + got]
                            # Shielded: a stop waits for pages being written, and counts them.
                            with anyio.CancelScope(shield=True):
                                ok, sums, bad = await anyio.to_thread.run_sync(
                                    self._decode, pool, pages, keys[start:start + got], blobs[:got]
                                )
                                h.done_pages[pool] = start + ok
                                for name, by_page in sums.items():
                                    self._group.checksums.setdefault(name, {}).update(by_page)
                            if bad is not None:
                                # Bytes that fail their checksum or do not fit: a miss, not a
                                # failure (one bad page in a shared store fails no prefetch),
                                # and a key to put again.
                                key = keys[start + ok]
                                rule = getattr(bad, "rule", None) or "decode"
                                rejected.append((h.id, pool, key, str(bad)))
                                self.counters.reject(rule)  # counted before the carrier resolves
                                self._suspects.add(key, rule)
                                self._cut(h, pool, start + ok)
        except Exception as exc:
            # After a stop the caller was promised the pages done so far; a
            # read that failed after it does not change that.
            error = None if h.stop_requested else self.failure(exc, batch, [h])
            if error is not None:
                log.warning("operation.storage_failed", operation=h.id, lane=lane.name, error=repr(exc))
        except BaseException:
            error = OperationCancelled(f"prefetch {h.id} was interrupted by cancellation")
            raise
        finally:
            h.scope = None
            if not h.done():
                lane.finish(h, error=h.ending_error(error))

    def _decode(
        self, pool: str, pages: list[int], keys: list[bytes], blobs: list[dict[str, bytes] | None]
    ) -> tuple[int, dict[str, dict[int, int]], StorageError | None]:
        """(Worker thread) write stored pages into host ``pages`` of ``pool``, in
        order, up to the first whose blobs fail their checks (`decode_page`
        checks a page before writing any of it). Returns how many were written,
        their checksums in verify mode, and the error of the page refused."""
        ok = 0
        refused = None
        group = self._group
        identity = self._identities[pool]
        for page, key, page_blobs in zip(pages, keys, blobs):
            assert page_blobs is not None
            try:
                written = decode_page(group, pool, page, page_blobs, key=key, identity=identity)
            except StorageError as exc:
                refused = exc
                break
            # A partial page's valid rows, recorded here, in the worker: the
            # page is this prefetch's (its writer) until it ends, and nothing
            # walks the record, so one dict operation per page is safe.
            for name, n in written.items():
                if n < group[name].page_size:
                    group.valid_rows.setdefault(name, {})[page] = n
            ok += 1
        sums = verify_pages.record(self._group, {pool: pages[:ok]}) if self._verify and ok else {}
        return ok, sums, refused

    def interrupt(self, h: PrefetchCarrier, lane: Lane[Any]) -> None:
        if h.scope is not None:
            h.scope.cancel()  # its fetch finishes the carrier once out of the scope
            return
        # Its batch is still looking keys up: nothing writes its pages yet.
        lane.finish(h, error=h.ending_error(None))
        running = self._batches.get(h)
        if running is not None:
            running.abandon_if_ended()  # nobody waits for the lookup any more

    def abort(self, lane: Lane[Any], error: BaseException) -> None:
        """As `_StorageWork.abort`; a prefetch already stopped keeps its
        promise (the pages done so far), so it is left to end."""
        for h in list(self._batches):
            if not h.stop_requested and not h.done() and not h.ending:
                h.closed_error = error
                self.interrupt(h, lane)

    def end(self, h: PrefetchCarrier, error: BaseException | None) -> PrefetchResult | None:
        if error is not None or (h.all_pools and any(n < len(h.keys[p]) for p, n in h.done_pages.items())):
            # Failed, or all_pools stopped before every pool was in: a result
            # never pairs pools of different lengths, so it hands back none.
            h.done_pages = dict.fromkeys(h.done_pages, 0)
        self._admission.release(h.claim, succeeded=error is None, kept=h.done_pages)
        if error is not None:
            return None
        host = {
            pool: slots_of_pages(h.claim.writes[pool][:n], self._group[pool].page_size)
            for pool, n in h.done_pages.items() if n
        }
        nbytes = sum(self._stored_nbytes(pool, h.claim.writes[pool][:n]) for pool, n in h.done_pages.items())
        h.nbytes = nbytes  # until now the most it could read (whole pages); now the bytes it read
        counters = self.counters
        for pool, done in h.done_pages.items():
            hits = h.hits[pool]
            counters.hit += done
            counters.stopped += hits - done
            counters.missed += len(h.keys[pool]) - hits
        end = h.ended_ns
        start = h.dispatched_ns or end
        return PrefetchResult(
            h.id, host, dict(h.done_pages), dict(h.hits),
            {pool: len(k) for pool, k in h.keys.items()},
            stopped=any(h.done_pages[p] < h.hits[p] for p in h.done_pages),
            nbytes=nbytes, seconds_queued=(start - h.submitted_ns) * 1e-9, seconds_total=(end - h.submitted_ns) * 1e-9,
        )
