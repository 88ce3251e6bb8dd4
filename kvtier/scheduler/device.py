"""What a batch of the backup or load lane does: `DeviceCopies`.

A batch is one `Batch` of its carriers' operations for the `CopyExecutor`,
which copies off the event loop and reports each transfer layer as it lands;
carriers wake the waiters of the layers that landed, once per report (one
thread hop per batch, not per operation). In verify mode a load batch first
fails the requests whose host pages no longer match their checksums, and a
backup batch records the checksums of what it wrote.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread

from kvtier.errors import CorruptionDetected, TransferFailed
from kvtier.pools import PoolGroup
from kvtier.transfers import eventloop
from kvtier.scheduler import verify as verify_pages
from kvtier.scheduler.carriers import Carrier
from kvtier.scheduler.lanes import Lane, StepClock
from kvtier.transfers import Batch, CopyExecutor, Direction, LayerProgress

__all__ = ["DeviceCopies"]


class DeviceCopies:
    """The work of the backup or the load lane: one `Batch` per lane batch."""

    def __init__(
        self,
        direction: Direction,
        group: PoolGroup,
        executor: CopyExecutor,
        loop: eventloop.Loop,
        *,
        min_run_bytes: int,
        verify: bool,
    ) -> None:
        self.direction = direction
        self._group = group
        self._executor = executor
        self._loop = loop
        self._min_run_bytes = min_run_bytes
        self._verify = verify

    @property
    def max_in_flight(self) -> int:
        return self._executor.max_in_flight

    async def run(self, batch: int, carriers: list[Carrier], lane: Lane[Any], clock: StepClock) -> None:
        # Making the operations of a batch of thousands takes a slice of the
        # loop at a time (its carriers are running: no request joins them), on
        # the runner's clock: this step may have ended the batch before.
        if len(carriers) == 1:  # a lone carrier: no slices to keep
            if not carriers[0].prepare():
                return
        else:
            prepared = []
            for c in carriers:
                if c.prepare():
                    prepared.append(c)
                if clock.due():
                    await clock.checkpoint()
            carriers = prepared
        if self._verify and self.direction is Direction.LOAD:
            await self._drop_corrupted(carriers)
            carriers = [c for c in carriers if c.prepare()]
        if not carriers:
            return
        loop = self._loop

        def wake() -> None:
            eventloop.wake_from_thread(loop, _wake, carriers)

        progress = LayerProgress(self._group.num_layers, wake)
        watched = False
        for c in carriers:
            c.progress = progress
            watched = watched or c.watched
        progress.watched = watched
        try:
            await self._executor.execute(
                Batch(batch, self.direction, [c.operation for c in carriers], self._group,  # type: ignore[misc]
                      min_run_bytes=self._min_run_bytes),
                progress,
            )
        finally:
            progress.detach()
        if self._verify and self.direction is Direction.BACKUP:
            sums = await anyio.to_thread.run_sync(_checksums_of, self._group, [c.claim.writes for c in carriers])
            for pool, by_page in sums.items():
                self._group.checksums.setdefault(pool, {}).update(by_page)

    async def _drop_corrupted(self, carriers: list[Carrier]) -> None:
        """Fail the loads whose host pages no longer match their checksums,
        request by request."""
        units = [(c, i) for c in carriers for i in c.live()]
        reads = [c.part_claim(i).reads for c, i in units]
        found = await anyio.to_thread.run_sync(verify_pages.corrupted, self._group.checksums, self._group, reads)
        for index, pool, pages in found:
            c, i = units[index]
            c.end_request(i, CorruptionDetected(pool, pages, operation_id=c.ids[i]))

    def end(self, carrier: Carrier, error: BaseException | None) -> None:
        """Give back what the carrier's requests hold; each request's result
        is its own (`Carrier.outcome`)."""
        carrier.release(error)

    def interrupt(self, carrier: Carrier, lane: Lane[Any]) -> None:
        """Copies in flight finish; the carrier ends a cancelled request after them."""

    def failure(self, exc: Exception, batch: int, carriers: list[Carrier]) -> BaseException:
        error = TransferFailed(
            f"batch {batch} ({self.direction.value}, {sum(c.count for c in carriers)} operations) failed: {exc}",
            operation_ids=tuple(i for c in carriers for i in c.request_ids()),
        )
        error.__cause__ = exc
        return error


def _checksums_of(group: PoolGroup, writes: list[dict[str, list[int]]]) -> dict[str, dict[int, int]]:
    """(Worker thread) checksums of the pages that a backup batch wrote."""
    out: dict[str, dict[int, int]] = {}
    for pages in writes:
        for pool, by_page in verify_pages.record(group, pages).items():
            out.setdefault(pool, {}).update(by_page)
    return out


def _wake(carriers: list[Carrier]) -> None:
    for c in carriers:
        c.wake()
