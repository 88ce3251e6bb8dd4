"""Backups and loads: `OperationHandle` and what a device-copy batch does.

``await handle`` returns an `OperationResult` or raises the operation's error
(`TransferFailed`, `CorruptionDetected`, `OperationCancelled`,
`SchedulerClosed`). Index tensors a handle hands out are new each time: the
caller's to keep and change.

A batch of the backup or load lane (`DeviceCopies`) is one `Batch` of the
operations' transfers for the `CopyExecutor`, which copies off the event loop
and reports each transfer layer as it lands; handles wake their layer waiters
once per report (one thread hop per batch, not per operation). In verify mode
a load batch first drops the loads whose host pages no longer match their
checksums, and a backup batch records the checksums of what it wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch

from kvtier.errors import CorruptionDetected, InvalidIndices, TransferFailed
from kvtier.pools import PageList, PoolGroup, slots_of_pages
from kvtier.scheduler import eventloop
from kvtier.scheduler import verify as verify_pages
from kvtier.scheduler.admission import Admission, Claim
from kvtier.scheduler.lanes import Handle, Lane
from kvtier.transfers import (
    Batch,
    CacheOperation,
    CopyExecutor,
    Direction,
    LayerProgress,
    PoolTransfer,
    derive_sidecar_indices,
)

if TYPE_CHECKING:
    from kvtier.scheduler.bulk import Carrier

__all__ = ["DeviceCopies", "OperationHandle", "OperationResult"]


@dataclass(frozen=True, slots=True)
class OperationResult:
    """What a finished operation moved and how long it took."""

    id: int
    direction: Direction
    bytes_per_pool: Mapping[str, int]
    seconds_queued: float
    seconds_copying: float
    seconds_total: float

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_per_pool.values())


class OperationHandle(Handle):
    """A backup or a load in flight: await it, wait for its layers, cancel it."""

    __slots__ = ("direction", "operation", "claim", "bytes_per_pool", "_group", "_progress", "_waiters")

    def __init__(
        self,
        lane: Lane[Any],
        operation: CacheOperation,
        claim: Claim,
        group: PoolGroup,
        bytes_per_pool: Mapping[str, int],
    ) -> None:
        super().__init__(lane, operation.id, operation.priority, operation.nbytes)
        self.direction = operation.direction
        self.operation = operation
        self.claim = claim
        self.bytes_per_pool = bytes_per_pool
        self._group = group
        self._progress: LayerProgress | None = None
        # Futures of tasks waiting for layer progress; all woken on any progress.
        self._waiters: list[eventloop.Future[None]] = []

    # -- what the caller reads -------------------------------------------------------

    @property
    def host_indices(self) -> dict[str, torch.Tensor]:
        """Host indices of every pool, derived sidecars included (new tensors)."""
        return self._indices(host=True)

    @property
    def device_indices(self) -> dict[str, torch.Tensor]:
        """Device indices of every pool, derived sidecars included (new tensors)."""
        return self._indices(host=False)

    def _indices(self, *, host: bool) -> dict[str, torch.Tensor]:
        pages = {}
        for t in self.operation.transfers:
            if t.indices_from_pool is None:
                listed = t.host_indices if host else t.device_indices
                assert isinstance(listed, PageList)
                pages[t.name] = listed.pages
        return slots_by_pool(self._group, pages)

    def _copies(self) -> OperationHandle:
        """The handle whose copies carry this operation (itself, or a bulk call's `Carrier`)."""
        return self

    async def layer_ready(self, layer: int) -> None:
        """Return once transfer layer ``layer`` of every pool is in place.

        Raises the operation's error if it failed or was cancelled.
        """
        await self._until_layer(layer, device_wait=False, stream=None)

    async def wait_layer(self, layer: int, stream: object | None = None) -> None:
        """Make ``stream`` (default: the current stream of the copy's device)
        wait on the device until transfer layer ``layer`` is in place, without
        a host sync. Returns once the wait is enqueued, which needs the batch to
        be enqueued on the copy stream. With an executor that has no device
        events (the CPU executor) this is `layer_ready`.
        """
        await self._until_layer(layer, device_wait=True, stream=stream)

    async def _until_layer(self, layer: int, *, device_wait: bool, stream: object | None) -> None:
        num_layers = self._group.num_layers
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < num_layers:
            raise InvalidIndices(
                f"layer {layer!r} is out of range; this group has transfer layers 0..{num_layers - 1}",
                rule="layer-in-range",
            )
        while True:
            if self.done():
                self.outcome()
                return
            copies = self._copies()
            progress = copies._progress
            if progress is not None:
                progress.watched = True  # before reading progress: see LayerProgress
                events = progress.layer_events
                if device_wait and events is not None:
                    assert progress.default_stream is not None
                    target = stream if stream is not None else progress.default_stream()
                    target.wait_event(events[layer])  # type: ignore[attr-defined]
                    return
                if progress.layers_done > layer:
                    return
            waiter: eventloop.Future[None] = self.lane.new_future()
            copies._waiters.append(waiter)
            await waiter

    def wake(self) -> None:
        """Wake every task waiting for progress; each re-checks its condition."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _resolved(self) -> None:
        self._progress = None  # break handle -> progress -> wake -> handles
        self.wake()

    def __repr__(self) -> str:
        return f"<OperationHandle {self.id} [{self.direction.value}, {self.state}, {self.nbytes} bytes]>"


class DeviceCopies:
    """The work of the backup or the load lane: one `Batch` per lane batch."""

    def __init__(
        self,
        direction: Direction,
        group: PoolGroup,
        executor: CopyExecutor,
        admission: Admission,
        loop: eventloop.Loop,
        *,
        min_run_bytes: int,
        verify: bool,
    ) -> None:
        self.direction = direction
        self._group = group
        self._executor = executor
        self._admission = admission
        self._loop = loop
        self._min_run_bytes = min_run_bytes
        self._verify = verify

    @property
    def max_in_flight(self) -> int:
        return self._executor.max_in_flight

    async def run(self, batch: int, handles: list[Carrier], lane: Lane[Any]) -> None:
        handles = _to_copy(handles)
        if self._verify and self.direction is Direction.LOAD:
            await self._drop_corrupted(handles, lane)
            handles = _to_copy(handles)
        if not handles:
            return
        loop = self._loop

        def wake() -> None:
            eventloop.wake_from_thread(loop, _wake, handles)

        progress = LayerProgress(self._group.num_layers, wake)
        watched = False
        for h in handles:
            h._progress = progress
            watched = watched or bool(h._waiters)
        progress.watched = watched
        try:
            await self._executor.execute(
                Batch(batch, self.direction, [h.operation for h in handles], self._group,
                      min_run_bytes=self._min_run_bytes),
                progress,
            )
        finally:
            progress.detach()
        if self._verify and self.direction is Direction.BACKUP:
            sums = await anyio.to_thread.run_sync(_checksums_of, self._group, [h.claim.writes for h in handles])
            for pool, by_page in sums.items():
                self._group.checksums.setdefault(pool, {}).update(by_page)

    async def _drop_corrupted(self, handles: list[Carrier], lane: Lane[Any]) -> None:
        """Fail the loads whose host pages no longer match their checksums,
        request by request."""
        units = [(h, part) for h in handles for part in h.live_parts()]
        reads = [h.part_claim(part._index).reads for h, part in units]
        found = await anyio.to_thread.run_sync(verify_pages.corrupted, self._group.checksums, self._group, reads)
        for index, pool, pages in found:
            h, part = units[index]
            h.end_part(part, CorruptionDetected(pool, pages, operation_id=part.id), lane)

    def end(self, handle: Carrier, error: BaseException | None) -> None:
        """Give back what the carrier's requests hold; each request's result
        is its own (`BulkPart.outcome`)."""
        handle.release(error)

    def interrupt(self, handle: OperationHandle, lane: Lane[Any]) -> None:
        """Copies in flight finish; the lane ends a cancelled operation after them."""

    def failure(self, exc: Exception, batch: int, handles: list[OperationHandle]) -> BaseException:
        error = TransferFailed(
            f"batch {batch} ({self.direction.value}, {sum(h.count for h in handles)} operations) failed: {exc}",
            operation_ids=tuple(i for h in handles for i in h.request_ids()),
        )
        error.__cause__ = exc
        return error


def new_operation(
    op_id: int,
    direction: Direction,
    host: Mapping[str, PageList],
    device: Mapping[str, PageList],
    group: PoolGroup,
    bytes_per_page: Mapping[str, tuple[int, tuple[tuple[str, int], ...]]],
    priority: int,
    fence: object | None,
    requests: tuple[int, ...] | None = None,
) -> tuple[CacheOperation, dict[str, int]]:
    """The `CacheOperation` of a backup or load (sidecars derived from their
    sources) and its bytes by pool."""
    transfers: list[PoolTransfer] = []
    nbytes: dict[str, int] = {}
    for name in sorted(host) if len(host) > 1 else host:
        pages = len(host[name].pages)
        transfers.append(PoolTransfer(name, host[name], device[name]))
        own, sidecars = bytes_per_page[name]
        nbytes[name] = pages * own
        for side, side_bytes in sidecars:
            transfers.append(PoolTransfer(side, None, None, indices_from_pool=name))
            nbytes[side] = pages * side_bytes
    return CacheOperation(op_id, direction, tuple(transfers), priority, sum(nbytes.values()), fence, requests), nbytes


def slots_by_pool(group: PoolGroup, pages: Mapping[str, list[int]]) -> dict[str, torch.Tensor]:
    """Slot indices of slot-owning pools' ``pages`` and of their sidecars' rows (new tensors)."""
    out = {name: slots_of_pages(p, group[name].page_size) for name, p in pages.items()}
    for name in pages:
        for side in group.sidecars_of(name):
            spec = side.sidecar
            assert spec is not None
            out[side.name] = derive_sidecar_indices(out[name], spec.source_page_size, spec.rows_per_page)
    return out


def _checksums_of(group: PoolGroup, writes: list[dict[str, list[int]]]) -> dict[str, dict[int, int]]:
    """(Worker thread) checksums of the pages that a backup batch wrote."""
    out: dict[str, dict[int, int]] = {}
    for pages in writes:
        for pool, by_page in verify_pages.record(group, pages).items():
            out.setdefault(pool, {}).update(by_page)
    return out


def _to_copy(handles: list[Carrier]) -> list[Carrier]:
    """The carriers of a batch still to copy, rebuilt from the requests they still carry."""
    return [h for h in handles if not h.done() and h.refresh()]


def _wake(handles: list[Carrier]) -> None:
    for h in handles:
        h.wake()
