"""One lane runtime for every kind of operation.

A `Lane` owns, for one kind (backup, load, write_storage, prefetch):

* its bounded queue: within the lane a higher priority goes first, ties in
  submission order; `put` waits for room and waiting submitters are let in
  FIFO, exactly one per freed place (`put_nowait` raises `anyio.WouldBlock`);
* its dispatch loop: take a batch (up to a byte and an operation budget,
  always at least one operation) once fewer than ``max_in_flight`` batches
  run, and run it in the lane's own task group;
* finishing each operation exactly once (`Lane.finish`), cancelling a queued
  one (`Lane.cancel`), the undo of a submission that never got in, its
  counters (latencies included: `Handle` carries the operation's
  ``perf_counter_ns`` timestamps) and its ``batch.*`` events, the same
  fields for every kind (``docs/log-events.md``).

What a batch *does* is the lane's `LaneWork`: device copies, storage writes
or prefetches. The work releases what an operation holds (`LaneWork.end`)
and may finish operations of its batch early; whatever it leaves unfinished
the lane finishes when its `LaneWork.run` returns (success) or raises (the
translated failure, for every operation still open).

`Handle` is the base of every handle: its state, outcome and awaiting.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Generator
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from kvtier.errors import OperationCancelled, SchedulerClosed
from kvtier.logs import get_logger
from kvtier.transfers import eventloop
from kvtier.scheduler.statistics import DirectionStatistics, LaneCounters

__all__ = ["PRIORITY_MAX", "PRIORITY_MIN", "Entry", "Handle", "Lane", "LaneWork", "StepClock", "cancelled", "check_priority"]

log = get_logger("kvtier.scheduler")

QUEUED, RUNNING, DONE = "queued", "running", "done"

# How long a batch's completion runs on the loop before it lets others run.
FINISH_SLICE_S = 0.4e-3

PRIORITY_MIN = -(2**31)
PRIORITY_MAX = 2**31 - 1


def check_priority(priority: object) -> int:
    """``priority`` if it is an int in ``[PRIORITY_MIN, PRIORITY_MAX]``, else `ValueError`."""
    if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(
            f"priority must be an int in [{PRIORITY_MIN}, {PRIORITY_MAX}] (higher goes first); got {priority!r}"
        )
    return priority


class Handle:
    """What the caller holds for one submitted operation.

    ``await handle`` returns the operation's result or raises its error;
    awaiting again gives the same outcome. A handle resolves exactly once.
    Cancelling the task that awaits a handle does not cancel the operation;
    `cancel` does.

    ``nbytes``: the bytes the operation moves, only the valid rows of partial
    pages (`PoolGroup.valid_rows`) counted; a storage operation's is the most
    it may move until it completes (a prefetch cannot know a page's stored
    length before it reads it), then what its result's ``nbytes`` says.
    """

    __slots__ = (
        "id", "kind", "priority", "nbytes", "submitted_ns", "dispatched_ns", "ended_ns",
        "count", "_lane", "_state", "_cancel_requested", "_future", "_result", "_error",
    )

    def __init__(self, lane: Lane[Any], op_id: int, priority: int, nbytes: int) -> None:
        self.id = op_id
        self.kind = lane.name
        self.priority = priority
        self.nbytes = nbytes
        # time.perf_counter_ns() at submission, when its batch was taken
        # (0 until then) and at its end (0 until then).
        self.submitted_ns = time.perf_counter_ns()
        self.dispatched_ns = 0
        self.ended_ns = 0
        # The requests this queue entry carries: 1, or a bulk call's share (`Carrier`).
        self.count = 1
        self._lane = lane
        self._state = QUEUED
        self._cancel_requested = False
        # Made when someone waits before the end: most handles of a bulk call
        # are awaited after they resolved, and need none.
        self._future: eventloop.Future[None] | None = None
        self._result: Any = None
        self._error: BaseException | None = None

    @property
    def lane(self) -> Lane[Any]:
        """The lane that runs this operation."""
        return self._lane

    @property
    def state(self) -> str:
        """``"queued"``, ``"running"`` or ``"done"``."""
        return self._state

    @property
    def queued(self) -> bool:
        return self._state == QUEUED

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    def done(self) -> bool:
        return self._state == DONE

    def exception(self) -> BaseException | None:
        """The error the operation ended with (None while it runs, or on success)."""
        return self._error

    def cancel(self) -> bool:
        """Cancel the operation: the handle raises `OperationCancelled`. A
        queued operation is dropped at once (what it took is given back); a
        running one gives back what it holds once no copy uses it any more.
        Returns False when the operation had already finished."""
        return self._lane.cancel(self)

    async def settled(self) -> None:
        """Return once the operation has ended, however it ended."""
        if self._state != DONE:
            if self._future is None:
                self._future = self._lane.new_future()
            await eventloop.wait_future(self._future)

    async def wait(self) -> Any:
        """The same as ``await handle``."""
        await self.settled()
        return self.outcome()

    def __await__(self) -> Generator[Any, None, Any]:
        if self._state != DONE:  # an ended handle is awaited without a coroutine
            yield from self.settled().__await__()
        return self.outcome()

    def outcome(self) -> Any:
        """The result of an ended operation, or raise its error."""
        if self._error is not None:
            raise self._error
        return self._result

    def settle(self, result: object, error: BaseException | None, lane: Lane[Any] | None) -> None:
        """The operation ended (the lane's `Lane.finish`, after its work gave
        back what it held): count it in ``lane`` (None: a submission undone,
        not counted), record the outcome and wake every waiter. Called once."""
        if lane is not None:
            start = self.dispatched_ns or self.ended_ns
            lane.counters.ended(self.id, lane.name, error, getattr(result, "nbytes", 0),
                                start - self.submitted_ns, self.ended_ns - start)
        self._result = result if error is None else None
        self._error = error
        if self._future is not None:
            self._future.set_result(None)
        self._resolved()

    def _resolved(self) -> None:
        """Hook for subclasses: the handle has just resolved."""

    def request_ids(self) -> tuple[int, ...]:
        """The ids of the requests this queue entry carries and has not ended."""
        return (self.id,)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} [{self.kind}, {self._state}, {self.nbytes} bytes]>"


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

    def until(self) -> float:
        """When the work since the last turn has taken its slice (``perf_counter``)."""
        return self._since + FINISH_SLICE_S

    def restart(self) -> None:
        """A new loop step began here (the caller just resumed)."""
        self._since = time.perf_counter()


class Entry(Protocol):
    """What a lane queues: a `Handle` (a storage operation), or a record that
    carries requests (`kvtier.scheduler.carriers.Carrier`). The lane sets
    ``_state``, ``dispatched_ns`` and ``ended_ns``, and ends it once through
    `settle`."""

    id: int
    priority: int
    nbytes: int
    count: int
    submitted_ns: int
    dispatched_ns: int
    ended_ns: int
    _state: str
    _cancel_requested: bool

    def request_ids(self) -> tuple[int, ...]: ...

    def settle(self, result: object, error: BaseException | None, lane: Lane[Any] | None) -> None: ...


H = TypeVar("H", bound=Entry)
W = TypeVar("W", bound=Entry)


class LaneWork(Protocol[W]):
    """What a lane's batches do."""

    @property
    def max_in_flight(self) -> int:
        """Batches of the lane that may run at once."""
        ...

    async def run(self, batch: int, handles: list[W], lane: Lane[Any]) -> None:
        """Do the batch. May `Lane.finish` some operations itself; the lane
        finishes the rest when this returns or raises."""
        ...

    def end(self, handle: W, error: BaseException | None) -> object:
        """Give back what ``handle`` holds (called once, by `Lane.finish`,
        with ``handle.ended_ns`` set); return its result when ``error`` is None."""
        ...

    def interrupt(self, handle: W, lane: Lane[Any]) -> None:
        """A running operation was asked to stop (cancel, or a prefetch's stop)."""
        ...

    def failure(self, exc: Exception, batch: int, handles: list[W]) -> BaseException:
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
        # The queue: (-priority, seq, handle); cancelled entries stay until they reach the top.
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

    def put_nowait(self, handle: H) -> None:
        """Queue ``handle`` now; `anyio.WouldBlock` when the lane is full. On
        any failure the handle's claim is given back and it is resolved."""
        try:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed; it takes no new operations")
            if self._depth + self._reserved + handle.count > self._capacity or self._putters:
                raise anyio.WouldBlock(
                    f"the {self.name} lane holds {self._depth} operations, its bound "
                    "(SchedulerConfig.max_queued_ops)"
                )
        except BaseException as exc:
            self.abandon(handle, exc)
            raise
        self._push(handle)

    async def put(self, handle: H) -> None:
        """Queue ``handle``, waiting for room (FIFO among waiting submitters).
        On failure or cancellation the handle's claim is given back and it is
        resolved, and the error propagates."""
        await self.put_many([handle])

    async def put_many(self, handles: list[H]) -> None:
        """Queue every handle of ``handles`` at once, in order, waiting until
        the lane has room for all of them (FIFO among waiting submitters: a
        bulk submission waits its turn, and the ones behind it wait for it).
        All or none: on failure or cancellation every handle's claim is given
        back and each is resolved, and the error propagates. More handles than
        the lane's bound raise `ValueError` (they could never fit). A handle
        counts as the requests it carries (``Handle.count``)."""
        need = sum(h.count for h in handles)
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
            for handle in handles:
                self.abandon(handle, exc)
            raise
        for handle in handles:
            self._push(handle)

    def check_fits(self, need: int) -> None:
        """`ValueError` when ``need`` operations could never be queued at once
        (more than the lane's bound)."""
        if need > self._capacity:
            raise ValueError(
                f"{need} operations in one call exceed the {self.name} lane's bound of {self._capacity} "
                "(SchedulerConfig.max_queued_ops); submit them in smaller groups"
            )

    def _push(self, handle: H) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (-handle.priority, self._seq, handle))
        self._last = handle
        self._depth += handle.count
        if self._depth > self._peak:
            self._peak = self._depth
        self.counters.submitted += handle.count
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
            last is None or last._state != QUEUED or self._closed or self._putters
            or self._depth + self._reserved >= self._capacity
        ):
            return None
        return last

    def joined(self, handle: H) -> None:
        """One request joined ``handle`` (`newest_open`): count it."""
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

    def abandon(self, handle: H, exc: BaseException) -> None:
        """Undo a submission that never reached the queue: give back its claim
        and resolve its handle (another operation may already wait on it),
        without counting it."""
        error = exc if isinstance(exc, Exception) else OperationCancelled(
            f"submission of operation {handle.id} was cancelled"
        )
        self._end(handle, error, count=False)

    # -- ending -------------------------------------------------------------------------

    def finish(self, handle: H, *, error: BaseException | None = None) -> None:
        """End ``handle``: give back what it holds and resolve it. The one place
        an operation ends; a second call is a no-op."""
        self._end(handle, error, count=True)

    def _end(self, entry: H, error: BaseException | None, *, count: bool) -> None:
        if entry._state == DONE:
            return
        entry._state = DONE
        # One clock read: the result's seconds and the latency histograms agree.
        entry.ended_ns = time.perf_counter_ns()
        try:
            result = self._work.end(entry, error)
        except Exception as exc:  # a bug in the release path must still resolve the handle
            for op_id in entry.request_ids():
                log.error("operation.release_failed", operation=op_id, lane=self.name, error=repr(exc))
            result, error = None, error or exc
        entry.settle(result, error, self if count else None)

    def drop_request(self, handle: H) -> None:
        """One request that queued ``handle`` carries ended before its batch
        was taken: its place goes to the waiting submitters, and ``handle``
        leaves the queue with its last request."""
        handle.count -= 1
        self._depth -= 1
        self._hand_over()
        if not handle.count:
            self.end_early(handle)

    def cancel(self, handle: H) -> bool:
        """Cancel ``handle`` (see `Handle.cancel`)."""
        self.check_caller("cancel()")
        if handle._state == DONE:
            return False
        handle._cancel_requested = True
        self.end_early(handle)
        return True

    def end_early(self, handle: H) -> None:
        """``handle`` was asked to end (a cancel, or a prefetch's stop): a queued
        one ends now (cancelled, or with its result when only stopped), a
        running one through its work's `LaneWork.interrupt`."""
        if handle._state == QUEUED:
            handle._state = RUNNING  # out of the queue's view; skipped when it reaches the top
            self._depth -= handle.count
            self._hand_over()
            self.finish(handle, error=self.cancelled(handle) if handle._cancel_requested else None)
        elif handle._state == RUNNING:
            self._work.interrupt(handle, lane=self)

    @staticmethod
    def cancelled(handle: Entry) -> OperationCancelled:
        return cancelled(handle.id)

    # -- running ----------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The dispatch loop: ``max_in_flight`` runners, each taking a batch
        once it is free and running it, so that what goes next is decided as
        late as possible and no task is spawned per batch. Returns once the
        lane is closed, empty and idle."""
        async with anyio.create_task_group() as tg:
            for _ in range(self._work.max_in_flight):
                tg.start_soon(self._runner)
            task_status.started()

    async def _runner(self) -> None:
        # One clock for the runner's steps: ending a batch, taking the next and
        # starting it share a step only while together they fit in a slice.
        clock = StepClock()
        while True:
            handles = await self._take(clock)
            if handles is None:
                return
            batch = next(self._batch_ids)
            now = time.perf_counter_ns()
            nbytes = ops = 0
            for h in handles:
                h._state = RUNNING
                h.dispatched_ns = now
                nbytes += h.nbytes
                ops += h.count
            self.counters.batch_taken(ops)
            self.in_flight += 1
            log.debug("batch.dispatched", batch=batch, lane=self.name, operations=ops, nbytes=nbytes)
            await self._run_batch(batch, handles, nbytes, ops, now, clock)
            if len(handles) > 1:  # the batch's end took a slice: the next batch starts in a step of its own
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
            if entry._state != QUEUED:
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
        self, batch: int, handles: list[H], nbytes: int, ops: int, dispatched_ns: int, clock: StepClock
    ) -> None:
        error: BaseException | None = None
        try:
            try:
                await self._work.run(batch, handles, self)
            except Exception as exc:
                error = self._work.failure(exc, batch, handles)
                log.warning("batch.failed", batch=batch, lane=self.name, operations=ops,
                            operation_ids=[i for h in handles for i in h.request_ids()], error=repr(exc))
            except BaseException:
                # Cancelled (the scheduler's task group is going down). The work's
                # contract says its copies no longer touch memory once it returns.
                error = OperationCancelled(f"batch {batch} was interrupted by cancellation")
                raise
            # A batch of thousands ends in slices, the loop running between
            # them; shielded, so that a cancellation meanwhile waits for the
            # end. (One queue entry ends in one go, in the finally below.)
            if len(handles) > 1:
                with anyio.CancelScope(shield=True):
                    await clock.checkpoint()  # this step may have taken and run the whole batch already
                    start = 0
                    while start < len(handles):
                        start = self._finish_slice(handles, start, error, until=clock.until())
                        if start < len(handles):
                            await anyio.lowlevel.checkpoint()
                            clock.restart()
        finally:
            # Whatever is still open ends now, synchronously (cancelled above).
            self._finish_slice(handles, 0, error, until=math.inf)
            self.in_flight -= 1
            log.debug("batch.completed", batch=batch, lane=self.name, operations=ops, nbytes=nbytes,
                      ok=error is None, seconds=(time.perf_counter_ns() - dispatched_ns) * 1e-9)

    def _finish_slice(self, handles: list[H], start: int, error: BaseException | None, *, until: float) -> int:
        """Finish the open handles of ``handles`` from ``start`` on until
        ``perf_counter()`` reaches ``until`` (one at least); return where to
        go on. A cancel that `Handle.cancel` accepted wins over a failure of
        the batch: its caller was promised OperationCancelled."""
        for i in range(start, len(handles)):
            h = handles[i]
            if h._state != DONE:
                self.finish(h, error=self.cancelled(h) if h._cancel_requested else error)
            if time.perf_counter() >= until:
                return i + 1
        return len(handles)

    # -- closing --------------------------------------------------------------------------------

    def close(self, *, cancel_queued: bool) -> None:
        """Refuse new operations; with ``cancel_queued`` end the queued ones
        with `SchedulerClosed`. Waiting submitters raise `SchedulerClosed`;
        the dispatch loop returns once the queue is empty."""
        self._closed = True
        if cancel_queued:
            queued = [h for _, _, h in sorted(self._heap) if h._state == QUEUED]
            self._heap.clear()
            self._depth = 0
            for h in queued:
                h._state = RUNNING
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
