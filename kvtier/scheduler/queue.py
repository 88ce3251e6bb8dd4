"""`OperationQueue`: two bounded lanes of queued operations.

There is one lane per direction (load, backup, and the storage lanes), each
with its own taker (the scheduler runs one dispatch loop per lane), so loads
never queue behind backups; within a lane a higher
priority goes first, ties in submission order. A batch is taken from one lane,
up to a byte and an operation budget (always at least one operation). Each lane is bounded: `put` waits for room
(backpressure) and `put_nowait` raises `anyio.WouldBlock`.

Entries are the scheduler's handles; the queue needs only ``nbytes``,
``priority``, ``direction`` and ``queued`` (False once cancelled) from them.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol

import anyio

from kvtier.errors import SchedulerClosed
from kvtier.transfers import Direction

__all__ = ["LaneStatistics", "OperationQueue"]


class Queued(Protocol):
    @property
    def nbytes(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def direction(self) -> Hashable: ...
    @property
    def queued(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class LaneStatistics:
    depth: int
    peak_depth: int
    capacity: int


class _Lane:
    __slots__ = ("heap", "depth", "peak", "filled")

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, Queued]] = []
        self.depth = 0
        self.peak = 0
        # Set when an entry arrives (or the queue closes); the lane's one taker clears it.
        self.filled = asyncio.Event()


class OperationQueue:
    def __init__(self, max_per_lane: int, directions: Iterable[Hashable] = (Direction.LOAD, Direction.BACKUP)) -> None:
        self._max = max_per_lane
        self._lanes = {d: _Lane() for d in directions}
        self._seq = 0
        self._closed = False
        # Set when room appears; every waiting putter wakes and re-checks.
        self._space = asyncio.Event()

    @property
    def closed(self) -> bool:
        return self._closed

    def put_nowait(self, entry: Queued) -> None:
        if self._closed:
            raise SchedulerClosed("the scheduler is closed; it takes no new operations")
        lane = self._lanes[entry.direction]
        if lane.depth >= self._max:
            raise anyio.WouldBlock(
                f"the {getattr(entry.direction, 'value', entry.direction)} lane holds {lane.depth} operations, its bound "
                "(SchedulerConfig.max_queued_ops)"
            )
        self._seq += 1
        heapq.heappush(lane.heap, (-entry.priority, self._seq, entry))
        lane.depth += 1
        if lane.depth > lane.peak:
            lane.peak = lane.depth
        lane.filled.set()

    async def put(self, entry: Queued) -> None:
        lane = self._lanes[entry.direction]
        while lane.depth >= self._max and not self._closed:
            self._space.clear()
            await self._space.wait()
        self.put_nowait(entry)

    def discard(self, entry: Queued) -> None:
        """Forget a cancelled entry (already marked not ``queued``); it is
        skipped when it reaches the head of its lane."""
        self._lanes[entry.direction].depth -= 1
        self._wake_space()

    async def take_batch(
        self, direction: Hashable, max_bytes: int, max_ops: int
    ) -> list[Queued] | None:
        """Wait for work in ``direction``'s lane and take a batch of it. None
        once the queue is closed and that lane is empty."""
        lane = self._lanes[direction]
        while True:
            if lane.depth:
                return self._take(lane, max_bytes, max_ops)
            if self._closed:
                return None
            lane.filled.clear()
            await lane.filled.wait()

    def _take(self, lane: _Lane, max_bytes: int, max_ops: int) -> list[Queued]:
        heap = lane.heap
        taken: list[Queued] = []
        total = 0
        while heap and len(taken) < max_ops:
            entry = heap[0][2]
            if not entry.queued:
                heapq.heappop(heap)
                continue
            if taken and total + entry.nbytes > max_bytes:
                break
            heapq.heappop(heap)
            taken.append(entry)
            total += entry.nbytes
        lane.depth -= len(taken)
        self._wake_space()
        return taken

    def drain(self) -> list[Queued]:
        """Remove and return every queued entry (for cancel-on-close)."""
        out: list[Queued] = []
        for lane in self._lanes.values():
            out.extend(e for _, _, e in sorted(lane.heap) if e.queued)
            lane.heap.clear()
            lane.depth = 0
        self._wake_space()
        return out

    def close(self) -> None:
        """Refuse new entries; waiting putters raise `SchedulerClosed`, and
        `take_batch` returns None once the lanes are empty."""
        self._closed = True
        self._space.set()
        for lane in self._lanes.values():
            lane.filled.set()

    def statistics(self, direction: Hashable) -> LaneStatistics:
        lane = self._lanes[direction]
        return LaneStatistics(lane.depth, lane.peak, self._max)

    def _wake_space(self) -> None:
        self._space.set()  # cheap when nobody waits
