"""The executor seam: what the scheduler hands an executor and what it gets back.

`CopyExecutor` is the seam: ``await executor.execute(batch, progress)`` returns
once every copy of the batch has landed (or raises the copy's error), never
while a copy may still touch memory, and calls ``progress.layer_done(t)`` for
t = 0, 1, ... in order, once each, and only once transfer layer ``t`` of every
pool is in place. A `Batch` is the operations of one direction taken together
(its plan made in the executor's thread); `LayerProgress` carries the per-layer
signal from the executor's thread to the event loop; `capture_fence` fixes a
caller's ``after=`` at submission time. The executors themselves live beside
this module: `kvtier.transfers.cpu` (`CpuExecutor`) and `kvtier.transfers.cuda`
(`CudaExecutor`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from kvtier.errors import WrongType
from kvtier.pools import PoolGroup
from kvtier.transfers.operation import CacheOperation, Direction
from kvtier.transfers.plan import BatchPlan, plan_batch

__all__ = ["Batch", "CopyExecutor", "LayerProgress", "capture_fence"]


class Batch:
    """The operations the batching stage took together, all of one direction.

    `plan` is pure and computed once, in whichever thread first asks: executors
    call it in their own thread so that planning stays off the event loop.
    """

    __slots__ = ("id", "direction", "operations", "_group", "_min_run_bytes", "_plan")

    def __init__(
        self,
        id: int,
        direction: Direction,
        operations: Sequence[CacheOperation],
        group: PoolGroup,
        *,
        min_run_bytes: int = 0,
    ) -> None:
        self.id = id
        self.direction = direction
        self.operations = tuple(operations)
        self._group = group
        self._min_run_bytes = min_run_bytes
        self._plan: BatchPlan | None = None

    @property
    def nbytes(self) -> int:
        return sum(op.nbytes for op in self.operations)

    @property
    def num_layers(self) -> int:
        return self._group.num_layers

    @property
    def fences(self) -> tuple[object, ...]:
        """What the batch's copies must wait for (from ``after=``)."""
        return tuple(op.fence for op in self.operations if op.fence is not None)

    def plan(self) -> BatchPlan:
        if self._plan is None:
            self._plan = plan_batch(self.direction, self.operations, self._group, min_run_bytes=self._min_run_bytes)
        return self._plan

    def __repr__(self) -> str:
        return f"<Batch {self.id} [{self.direction.value}: {len(self.operations)} ops, {self.nbytes} bytes]>"


class LayerProgress:
    """How many transfer layers of one batch have landed.

    Written by the executor's thread, read on the event loop. The loop sets
    ``watched`` *before* it reads ``layers_done``; the executor writes
    ``layers_done`` *before* it reads ``watched``. So either the loop sees the
    new count, or the executor sees the watcher and calls ``wake`` (which must
    be thread-safe): no wake-up is lost, and none is paid for when nobody
    waits on a layer.

    A device executor also publishes ``layer_events`` (one per transfer layer,
    recorded on its copy stream) once the batch is enqueued, so that a compute
    stream can wait for a layer on the device (`OperationHandle.wait_layer`).
    """

    __slots__ = ("num_layers", "layers_done", "watched", "layer_events", "default_stream", "_wake")

    def __init__(self, num_layers: int, wake: Callable[[], None] | None = None) -> None:
        self.num_layers = num_layers
        self.layers_done = 0
        self.watched = False
        self.layer_events: Sequence[object] | None = None
        self.default_stream: Callable[[], object] | None = None
        self._wake = wake

    def detach(self) -> None:
        """Drop the wake-up callback once the batch has ended."""
        self._wake = None

    def layer_done(self, layer: int) -> None:
        """Record that transfer layers ``0..layer`` have landed (any thread)."""
        self.layers_done = layer + 1
        if self.watched and self._wake is not None:
            self._wake()

    def publish_events(self, events: Sequence[object], default_stream: Callable[[], object]) -> None:
        """Publish per-layer device events (any thread); waiters re-check."""
        self.default_stream = default_stream
        self.layer_events = events
        if self.watched and self._wake is not None:
            self._wake()


def capture_fence(after: object) -> object:
    """Turn a caller's ``after=`` into a fence fixed at submission time.

    A stream (anything with ``record_event``) is captured as an event recorded
    on it now, so the copy waits for the work submitted so far and no more; an
    event (anything with ``query`` and ``synchronize``) is used as is.
    Recording an event does not block the host.
    """
    record = getattr(after, "record_event", None)
    if callable(record):
        return record()
    if callable(getattr(after, "query", None)) and callable(getattr(after, "synchronize", None)):
        return after
    raise WrongType(
        f"after= takes a stream or an event (torch.cuda.Stream / torch.cuda.Event); got {type(after).__name__}"
    )


@runtime_checkable
class CopyExecutor(Protocol):
    """Runs batches of copies.

    ``max_in_flight`` bounds concurrent `execute` calls *per direction*: loads
    and backups are dispatched independently. `execute` must not return or
    raise while a copy of the batch may still touch memory: the scheduler frees
    slots right after it. It waits for ``batch.fences`` before copying.

    An executor with threads of its own may also have ``async def
    stop_threads()``, which ends them once what they were handed has run (the
    next batch may start them again); `TransferScheduler` calls it as it
    closes, after its last copy ended.
    """

    @property
    def max_in_flight(self) -> int: ...

    async def execute(self, batch: Batch, progress: LayerProgress) -> None: ...
