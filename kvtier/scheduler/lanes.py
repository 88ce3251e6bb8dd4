"""One lane runtime for every kind of operation.

A `Lane` owns, for one kind (backup, load, write_storage, prefetch):

* its bounded queue: within the lane a higher priority goes first, ties in
  submission order; `put` waits for room and waiting submitters are let in
  FIFO, exactly one per freed place (`put_nowait` raises `anyio.WouldBlock`);
* its dispatch loop: take a batch (up to a byte and an operation budget,
  always at least one operation) once fewer than ``max_in_flight`` batches
  run, and run it in the lane's own task group;
* finishing each entry exactly once (`Lane.finish`), taking one out of the
  queue when its carrier ends it early (`Lane.end_early`, `Lane.drop_request`),
  the undo of a submission that never got in, its counters (latencies
  included: an entry carries its ``perf_counter_ns`` timestamps) and its
  ``batch.*`` events, the same fields for every kind (``docs/log-events.md``).

What a batch *does* is the lane's `LaneWork`: device copies, storage writes
or prefetches. The work releases what an operation holds (`LaneWork.end`)
and may finish operations of its batch early; whatever it leaves unfinished
the lane finishes when its `LaneWork.run` returns (success) or raises (the
translated failure, for every operation still open).

The lane knows one kind of entry, `Entry`: a carrier of requests, whatever
its kind. It reads an entry's public fields only; a cancel, a stop and every
request's outcome belong to the carrier, which asks the lane to take it out
of the queue (`Lane.end_early`, `Lane.drop_request`). No caller's handle is
ever queued.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from kvtier.errors import ConfigurationError, OperationCancelled, SchedulerClosed
from kvtier.logs import get_logger
from kvtier.transfers import eventloop
from kvtier.scheduler.statistics import DirectionStatistics, LaneCounters

__all__ = ["PRIORITY_MAX", "PRIORITY_MIN", "Entry", "Lane", "LaneWork", "StepClock", "cancelled", "check_priority"]

log = get_logger("kvtier.scheduler")

QUEUED, RUNNING, DONE = "queued", "running", "done"

# How long a batch's completion runs on the loop before it lets others run.
FINISH_SLICE_S = 0.4e-3

PRIORITY_MIN = -(2**31)
PRIORITY_MAX = 2**31 - 1


def check_priority(priority: object) -> int:
    """``priority`` if it is an int in ``[PRIORITY_MIN, PRIORITY_MAX]``, else `ConfigurationError` (a `ValueError`)."""
    if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ConfigurationError(
            f"priority must be an int in [{PRIORITY_MIN}, {PRIORITY_MAX}] (higher goes first); got {priority!r}"
        )
    return priority


def cancelled(op_id: int) -> OperationCancelled:
    """The error an operation whose cancel was accepted ends with."""
    return OperationCancelled(f"operation {op_id} was cancelled")


class StepClock:
    """Slices long work on the loop without paying a loop turn for short work:
    `checkpoint` lets the loop run only once the work since the last turn took
    `FINISH_SLICE_S`. Each turn lets the GIL go (up to a switch interval
    beside a busy thread), so a turn that nothing needs is not taken."""

    __slots__ = ("_since",)

    def __init__(self) -> None:
        self._since = time.perf_counter()

    async def checkpoint(self) -> None:
        if time.perf_counter() - self._since >= FINISH_SLICE_S:
            await anyio.lowlevel.checkpoint()
            self._since = time.perf_counter()

    def due(self) -> bool:
        """Whether `checkpoint` would let the loop run now: a caller in a loop
        tests this first and makes no coroutine per step that would not."""
        return time.perf_counter() - self._since >= FINISH_SLICE_S

    def until(self) -> float:
        """When the work since the last turn has taken its slice (``perf_counter``)."""
        return self._since + FINISH_SLICE_S

    def restart(self) -> None:
        """A new loop step began here (the caller just resumed)."""
        self._since = time.perf_counter()


class Entry(Protocol):
    """What a lane queues: a carrier, the record of the requests one queue
    entry carries (`kvtier.scheduler.carriers.Carrier` for backups and
    loads, `kvtier.scheduler.storage.StorageCarrier` for `write_storage` and
    `prefetch`). A carrier is never the caller's handle: handles only read it.

    ``state`` is the entry's place in the lane (``"queued"``, ``"running"``,
    ``"done"``), written by the lane only; ``dispatched_ns`` and ``ended_ns``
    too, and ``count`` (the requests it counts in the bound) goes down by one
    in `Lane.drop_request`. The entry owns everything else: the lane asks it, through
    `ending_error`, what it ends with, and ends it once through `settle`."""

    id: int
    priority: int
    nbytes: int
    count: int
    submitted_ns: int
    dispatched_ns: int
    ended_ns: int
    state: str

    def request_ids(self) -> tuple[int, ...]: ...

    def ending_error(self, error: BaseException | None) -> BaseException | None:
        """What the entry ends with when it ends with ``error`` (None:
        success, or a stop): a cancel it accepted wins, its caller was
        promised `OperationCancelled`."""
        ...

    def settle(self, result: object, error: BaseException | None, lane: Lane[Any] | None) -> None: ...


H = TypeVar("H", bound=Entry)
W = TypeVar("W", bound=Entry)


class LaneWork(Protocol[W]):
    """What a lane's batches do."""

    @property
    def max_in_flight(self) -> int:
        """Batches of the lane that may run at once."""
        ...

    async def run(self, batch: int, entries: list[W], lane: Lane[Any], clock: StepClock) -> None:
        """Do the batch. May `Lane.finish` some operations itself; the lane
        finishes the rest when this returns or raises. ``clock`` is the
        runner's: the step that took the batch (and perhaps ended the one
        before) is already under way, so long work on the loop slices by it."""
        ...

    def end(self, entry: W, error: BaseException | None) -> object:
        """Give back what ``entry`` holds (called once, by `Lane.finish`,
        with ``entry.ended_ns`` set); return its result when ``error`` is None."""
        ...

    def interrupt(self, entry: W, lane: Lane[Any]) -> None:
        """A running operation was asked to stop (cancel, or a prefetch's stop)."""
        ...

    def failure(self, exc: Exception, batch: int, entries: list[W]) -> BaseException:
        """The error the operations of a failed batch end with (cause chained)."""
        ...


class Lane(Generic[H]):
    """One kind of operation: its queue, dispatch loop and endings (see the module doc)."""

    def __init__(
        self,
        name: str,
        work: LaneWork[H],
        loop: eventloop.Loop,
        *,
        capacity: int,
        max_batch_bytes: int,
        max_batch_ops: int,
        batch_ids: itertools.count[int],
    ) -> None:
        self.name = name
        self._work = work
        self._loop = loop
        self._capacity = capacity
        self._max_bytes = max_batch_bytes
        self._max_ops = max_batch_ops
        self._batch_ids = batch_ids
        self.counters = LaneCounters()
        self.in_flight = 0
        # The queue: (-priority, seq, entry); cancelled entries stay until they reach the top.
        self._heap: list[tuple[int, int, H]] = []
        self._seq = 0
        self._depth = 0
        self._peak = 0
        # Submitters waiting for room, oldest first; ``_reserved`` places were
        # handed to woken submitters that have not pushed yet.
        self._putters: deque[tuple[eventloop.Future[None], int]] = deque()
        self._reserved = 0
        # Runners waiting for work, oldest first (`_take`).
        self._takers: deque[eventloop.Future[None]] = deque()
        self._closed = False
        self._last: H | None = None  # the entry pushed last

    def new_future(self) -> eventloop.Future[Any]:
        return eventloop.new_future(self._loop)

    def check_caller(self, what: str) -> None:
        eventloop.check_caller(self._loop, what)

    # -- submission -------------------------------------------------------------------

    def put_nowait(self, entry: H) -> None:
        """Queue ``entry`` now; `anyio.WouldBlock` when the lane is full. On
        any failure the entry's claim is given back and it is resolved."""
        try:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed; it takes no new operations")
            if self._depth + self._reserved + entry.count > self._capacity or self._putters:
                raise anyio.WouldBlock(
                    f"the {self.name} lane holds {self._depth} operations, its bound "
                    "(SchedulerConfig.max_queued_ops)"
                )
        except BaseException as exc:
            self.abandon(entry, exc)
            raise
        self._push(entry)

    async def put(self, entry: H) -> None:
        """Queue ``entry``, waiting for room (FIFO among waiting submitters).
        On failure or cancellation the entry's claim is given back and it is
        resolved, and the error propagates."""
        await self.put_many([entry])

    async def put_many(self, entries: list[H]) -> None:
        """Queue every entry of ``entries`` at once, in order, waiting until
        the lane has room for all of them (FIFO among waiting submitters: a
        bulk submission waits its turn, and the ones behind it wait for it).
        All or none: on failure or cancellation every entry's claim is given
        back and each is resolved, and the error propagates. More entries than
        the lane's bound raise `ValueError` (they could never fit). An entry
        counts as the requests it carries (``Entry.count``)."""
        need = sum(h.count for h in entries)
        try:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed; it takes no new operations")
            self.check_fits(need)
            if self._depth + self._reserved + need > self._capacity or self._putters:
                waiter: eventloop.Future[None] = self.new_future()
                self._putters.append((waiter, need))
                try:
                    await waiter
                except BaseException:
                    if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                        self._reserved -= need  # room was handed to us as we were cancelled
                    elif not waiter.done():
                        self._putters.remove((waiter, need))
                    # Else a cancelled waiter stays in line, done (removing it would be
                    # O(n)); `_hand_over` drops it when it reaches the front. Pass the
                    # room on: the ones behind a bulk waiter may fit now.
                    self._hand_over()
                    raise
                self._reserved -= need
        except BaseException as exc:
            for entry in entries:
                self.abandon(entry, exc)
            raise
        for entry in entries:
            self._push(entry)

    def check_fits(self, need: int) -> None:
        """`ConfigurationError` (a `ValueError`) when ``need`` operations could never be queued at once
        (more than the lane's bound)."""
        if need > self._capacity:
            raise ConfigurationError(
                f"{need} operations in one call exceed the {self.name} lane's bound of {self._capacity} "
                "(SchedulerConfig.max_queued_ops); submit them in smaller groups"
            )

    def _push(self, entry: H) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (-entry.priority, self._seq, entry))
        self._last = entry
        self._depth += entry.count
        if self._depth > self._peak:
            self._peak = self._depth
        self.counters.submitted += entry.count
        self._wake_taker()

    def _wake_taker(self) -> None:
        """Work arrived: wake one waiting runner."""
        takers = self._takers
        while takers:
            taker = takers.popleft()
            if not taker.done():
                taker.set_result(None)
                return

    def newest_open(self) -> H | None:
        """The entry pushed last while it is still queued, when the lane has
        room for one more request now and nobody waits for room: a lone
        request may join it (`Carrier.join`) instead of queueing its own."""
        last = self._last
        if (
            last is None or last.state != QUEUED or self._closed or self._putters
            or self._depth + self._reserved >= self._capacity
        ):
            return None
        return last

    def joined(self, entry: H) -> None:
        """One request joined ``entry`` (`newest_open`): count it."""
        self._depth += 1
        if self._depth > self._peak:
            self._peak = self._depth
        self.counters.submitted += 1

    def _hand_over(self) -> None:
        """Places were freed: hand the room there is to the waiting submitters,
        oldest first, each when there is room for all it needs."""
        putters = self._putters
        room = self._capacity - self._depth - self._reserved
        while putters:
            waiter, need = putters[0]
            if waiter.done():
                putters.popleft()
                continue
            if need > room:
                return
            putters.popleft()
            self._reserved += need
            room -= need
            waiter.set_result(None)

    def abandon(self, entry: H, exc: BaseException) -> None:
        """Undo a submission that never reached the queue: give back its claim
        and resolve its entry (another operation may already wait on it),
        without counting it."""
        error = exc if isinstance(exc, Exception) else OperationCancelled(
            f"submission of operation {entry.id} was cancelled"
        )
        self._end(entry, error, count=False)

    # -- ending -------------------------------------------------------------------------

    def finish(self, entry: H, *, error: BaseException | None = None) -> None:
        """End ``entry``: give back what it holds and resolve it. The one place
        an operation ends; a second call is a no-op."""
        self._end(entry, error, count=True)

    def _end(self, entry: H, error: BaseException | None, *, count: bool) -> None:
        if entry.state == DONE:
            return
        entry.state = DONE
        # One clock read: the result's seconds and the latency histograms agree.
        entry.ended_ns = time.perf_counter_ns()
        try:
            result = self._work.end(entry, error)
        except Exception as exc:  # a bug in the release path must still resolve the entry
            for op_id in entry.request_ids():
                log.error("operation.release_failed", operation=op_id, lane=self.name, error=repr(exc))
            result, error = None, error or exc
        entry.settle(result, error, self if count else None)

    def drop_request(self, entry: H) -> None:
        """One request that queued ``entry`` carries ended before its batch
        was taken: its place goes to the waiting submitters, and ``entry``
        leaves the queue with its last request."""
        entry.count -= 1
        self._depth -= 1
        self._hand_over()
        if not entry.count:
            self.end_early(entry)

    def end_early(self, entry: H) -> None:
        """``entry`` was asked to end (its carrier accepted a cancel, or a
        prefetch's stop): a queued one leaves the queue and ends now, with what
        `Entry.ending_error` says; a running one through its work's
        `LaneWork.interrupt`."""
        if entry.state == QUEUED:
            entry.state = RUNNING  # out of the queue's view; skipped when it reaches the top
            self._depth -= entry.count
            self._hand_over()
            self.finish(entry, error=entry.ending_error(None))
        elif entry.state == RUNNING:
            self._work.interrupt(entry, lane=self)

    # -- running ----------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The dispatch loop: ``max_in_flight`` runners, each taking a batch
        once it is free and running it, so that what goes next is decided as
        late as possible and no task is spawned per batch. Returns once the
        lane is closed, empty and idle."""
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self._work.max_in_flight):
                    tg.start_soon(self._runner)
                task_status.started()
        finally:
            # The last entry refers back to this lane (its carrier's context):
            # dropped, a closed scheduler's lanes, pools and tensors go with
            # their last reference, not at a later full collection.
            self._last = None

    async def _runner(self) -> None:
        # One clock for the runner's steps: ending a batch, taking the next and
        # starting it share a step only while together they fit in a slice.
        clock = StepClock()
        while True:
            entries = await self._take(clock)
            if entries is None:
                return
            batch = next(self._batch_ids)
            now = time.perf_counter_ns()
            nbytes = ops = 0
            for h in entries:
                h.state = RUNNING
                h.dispatched_ns = now
                nbytes += h.nbytes
                ops += h.count
            self.counters.batch_taken(ops)
            self.in_flight += 1
            log.debug("batch.dispatched", batch=batch, lane=self.name, operations=ops, nbytes=nbytes)
            await self._run_batch(batch, entries, nbytes, ops, now, clock)
            if len(entries) > 1:  # the batch's end took a slice: the next batch starts in a step of its own
                await clock.checkpoint()

    async def _take(self, clock: StepClock) -> list[H] | None:
        while not self._depth:
            if self._closed:
                return None
            taker: eventloop.Future[None] = self.new_future()
            self._takers.append(taker)
            try:
                await taker
            finally:
                if not taker.done():
                    self._takers.remove(taker)
            clock.restart()
        heap = self._heap
        taken: list[H] = []
        total = ops = 0
        while heap and ops < self._max_ops:
            entry = heap[0][2]
            if entry.state != QUEUED:
                heapq.heappop(heap)
                continue
            if taken and (total + entry.nbytes > self._max_bytes or ops + entry.count > self._max_ops):
                break
            heapq.heappop(heap)
            taken.append(entry)
            total += entry.nbytes
            ops += entry.count
        self._depth -= ops
        self._hand_over()
        if self._depth:
            self._wake_taker()  # more than one batch is queued: another runner may take the next
        return taken

    async def _run_batch(
        self, batch: int, entries: list[H], nbytes: int, ops: int, dispatched_ns: int, clock: StepClock
    ) -> None:
        error: BaseException | None = None
        try:
            try:
                await self._work.run(batch, entries, self, clock)
            except Exception as exc:
                error = self._work.failure(exc, batch, entries)
                log.warning("batch.failed", batch=batch, lane=self.name, operations=ops,
                            operation_ids=[i for h in entries for i in h.request_ids()], error=repr(exc))
            except BaseException:
                # Cancelled (the scheduler's task group is going down). The work's
                # contract says its copies no longer touch memory once it returns.
                error = OperationCancelled(f"batch {batch} was interrupted by cancellation")
                raise
            # A batch of thousands ends in slices, the loop running between
            # them; shielded, so that a cancellation meanwhile waits for the
            # end. (One queue entry ends in one go, in the finally below.)
            if len(entries) > 1:
                with anyio.CancelScope(shield=True):
                    await clock.checkpoint()  # this step may have taken and run the whole batch already
                    start = 0
                    while start < len(entries):
                        start = self._finish_slice(entries, start, error, until=clock.until())
                        if start < len(entries):
                            await anyio.lowlevel.checkpoint()
                            clock.restart()
        finally:
            # Whatever is still open ends now, synchronously (cancelled above).
            self._finish_slice(entries, 0, error, until=math.inf)
            self.in_flight -= 1
            log.debug("batch.completed", batch=batch, lane=self.name, operations=ops, nbytes=nbytes,
                      ok=error is None, seconds=(time.perf_counter_ns() - dispatched_ns) * 1e-9)

    def _finish_slice(self, entries: list[H], start: int, error: BaseException | None, *, until: float) -> int:
        """Finish the open entries of ``entries`` from ``start`` on until
        ``perf_counter()`` reaches ``until`` (one at least); return where to
        go on. A cancel that an entry accepted wins over a failure of the
        batch (`Entry.ending_error`): its caller was promised OperationCancelled."""
        for i in range(start, len(entries)):
            h = entries[i]
            if h.state != DONE:
                self.finish(h, error=h.ending_error(error))
            if time.perf_counter() >= until:
                return i + 1
        return len(entries)

    # -- closing --------------------------------------------------------------------------------

    def close(self, *, cancel_queued: bool) -> None:
        """Refuse new operations; with ``cancel_queued`` end the queued ones
        with `SchedulerClosed`. Waiting submitters raise `SchedulerClosed`;
        the dispatch loop returns once the queue is empty."""
        self._closed = True
        if cancel_queued:
            queued = [h for _, _, h in sorted(self._heap) if h.state == QUEUED]
            self._heap.clear()
            self._depth = 0
            for h in queued:
                h.state = RUNNING
                self.finish(h, error=SchedulerClosed(
                    f"operation {h.id} was still queued when the scheduler closed"
                ))
        putters, self._putters = self._putters, deque()
        for waiter, _ in putters:
            if not waiter.done():
                waiter.set_exception(SchedulerClosed("the scheduler closed while this submission waited for room"))
        takers, self._takers = self._takers, deque()
        for taker in takers:
            if not taker.done():
                taker.set_result(None)

    # -- introspection ----------------------------------------------------------------------------

    def statistics(self) -> DirectionStatistics:
        c = self.counters
        return DirectionStatistics(
            c.submitted, c.completed, c.failed, c.cancelled, c.bytes, c.batches,
            c.batched, c.max_batch, self._depth, self._peak, c.latency(),
        )

    def __repr__(self) -> str:
        return (f"<Lane {self.name!r} [queued: {self._depth}/{self._capacity} | in flight: {self.in_flight} "
                f"batches | done: {self.counters.completed}]>")
