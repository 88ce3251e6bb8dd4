"""`OperationHandle`: what the caller holds for one submitted operation.

``await handle`` returns an `OperationResult` or raises the operation's error
(`TransferFailed`, `OperationCancelled`, `SchedulerClosed`); awaiting again
gives the same outcome. A handle resolves exactly once. Cancelling the task
that awaits a handle does not cancel the operation; `cancel` does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtier.errors import InvalidIndices
from kvtier.pools import PageList, as_slot_tensor
from kvtier.transfers import CacheOperation, Direction, LayerProgress, derive_sidecar_indices

if TYPE_CHECKING:
    from kvtier.scheduler.scheduler import TransferScheduler

__all__ = ["OperationHandle", "OperationResult"]


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


QUEUED, RUNNING, DONE = "queued", "running", "done"


class OperationHandle:
    """The live state of one operation; the scheduler drives it, the caller reads it.

    ``_host_pages`` are the pages of slot-owning host pools the operation
    touches (written for a backup, read for a load); ``_device_owned`` the
    device slots kvtier allocated for a load (freed if the load does not
    succeed). The scheduler releases both exactly once, in ``_release``.
    """

    __slots__ = (
        "_op", "_scheduler", "_state", "_cancel_requested", "_host", "_device",
        "_host_pages", "_device_owned", "_progress", "_waiters", "_finished",
        "_result", "_error", "_t_submit", "_t_dispatch", "_t_done", "_bytes_per_pool",
    )

    def __init__(
        self,
        op: CacheOperation,
        scheduler: TransferScheduler,
        finished: asyncio.Future[None],
        *,
        host: dict[str, torch.Tensor | PageList],
        device: dict[str, torch.Tensor],
        host_pages: dict[str, list[int]],
        device_owned: dict[str, torch.Tensor],
        bytes_per_pool: dict[str, int],
    ) -> None:
        self._op = op
        self._scheduler = scheduler
        self._state = QUEUED
        self._cancel_requested = False
        self._host = host
        self._device = device
        self._host_pages = host_pages
        self._device_owned = device_owned
        self._bytes_per_pool = bytes_per_pool
        self._progress: LayerProgress | None = None
        # Futures of tasks waiting for layer progress; all woken on any progress.
        self._waiters: list[asyncio.Future[None]] = []
        self._finished = finished
        self._result: OperationResult | None = None
        self._error: BaseException | None = None
        self._t_submit = time.perf_counter()
        self._t_dispatch = 0.0
        self._t_done = 0.0

    # -- what the queue reads ----------------------------------------------

    @property
    def id(self) -> int:
        return self._op.id

    @property
    def direction(self) -> Direction:
        return self._op.direction

    @property
    def priority(self) -> int:
        return self._op.priority

    @property
    def nbytes(self) -> int:
        return self._op.nbytes

    @property
    def queued(self) -> bool:
        return self._state == QUEUED

    @property
    def operation(self) -> CacheOperation:
        return self._op

    # -- what the caller reads ---------------------------------------------

    @property
    def host_indices(self) -> dict[str, torch.Tensor]:
        """Host indices of every pool, derived sidecars included."""
        return self._with_sidecars({name: as_slot_tensor(idx) for name, idx in self._host.items()})

    @property
    def device_indices(self) -> dict[str, torch.Tensor]:
        """Device indices of every pool, derived sidecars included."""
        return self._with_sidecars(self._device)

    def _with_sidecars(self, owned: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(owned)
        group = self._scheduler.group
        for t in self._op.transfers:
            if t.indices_from_pool is not None:
                spec = group[t.name].sidecar
                assert spec is not None
                out[t.name] = derive_sidecar_indices(
                    owned[t.indices_from_pool], spec.source_page_size, spec.rows_per_page
                )
        return out

    def done(self) -> bool:
        return self._state == DONE

    def cancel(self) -> bool:
        """Cancel the operation. A queued one is dropped at once (its slots
        freed); an in-flight one releases its slots once its copies finish.
        Either way the handle raises `OperationCancelled`. Returns False when
        the operation had already finished."""
        if self._state == DONE:
            return False
        if self._state == QUEUED:
            self._scheduler._cancel_queued(self)
        else:
            self._cancel_requested = True
        return True

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
        self._check_layer(layer)
        while True:
            if self._state == DONE:
                self._outcome()
                return
            progress = self._progress
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
            await self._next_progress()

    def _check_layer(self, layer: int) -> None:
        num_layers = self._scheduler.group.num_layers
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < num_layers:
            raise InvalidIndices(
                f"layer {layer!r} is out of range; this group has transfer layers 0..{num_layers - 1}",
                rule="layer-in-range",
            )

    async def _next_progress(self) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    async def wait(self) -> OperationResult:
        """The same as ``await handle``."""
        await self._settled()
        return self._outcome()

    async def _settled(self) -> None:
        # Shielded: cancelling the waiting task must not cancel the shared future.
        if not self._finished.done():
            await asyncio.shield(self._finished)

    def __await__(self) -> Generator[Any, None, OperationResult]:
        return self.wait().__await__()

    def _outcome(self) -> OperationResult:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # -- driven by the scheduler -------------------------------------------

    def _wake(self) -> None:
        """Wake every task waiting for progress; each re-checks its condition."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _resolve(self, result: OperationResult | None, error: BaseException | None) -> None:
        self._state = DONE
        self._t_done = time.perf_counter()
        self._result = result
        self._error = error
        self._finished.set_result(None)
        self._wake()

    def __repr__(self) -> str:
        return (
            f"<OperationHandle {self._op.id} [{self._op.direction.value}, {self._state}, "
            f"{self._op.nbytes} bytes]>"
        )
