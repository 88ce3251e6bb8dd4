"""Executors run a batch's copies off the event loop and report each layer.

`CopyExecutor` is the seam: ``await executor.execute(batch, progress)`` returns
once every copy of the batch has landed (or raises the copy's error), and calls
``progress.layer_done(t)`` for t = 0, 1, ... in order, once each, and only once
transfer layer ``t`` of every pool is in place. `CpuExecutor` plans and copies
in a worker thread (one at a time, so the scheduler's choice of the next batch
is made as late as possible), leaving the event loop a core by running torch
with one thread there. It copies every layer of a batch at once (one call per
row group across all layers where the engine's tensors allow it), unless
someone waits on a layer: then it goes in groups of layers
(`run_batch_copies`), so that waiter is not kept until the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import anyio
import anyio.to_thread
import torch

from kvtier.errors import ConfigurationError

from kvtier.pools import PoolGroup
from kvtier.transfers.operation import CacheOperation, Direction
from kvtier.transfers.plan import BatchPlan, plan_batch

__all__ = [
    "Batch",
    "CopyExecutor",
    "CpuExecutor",
    "CpuExecutorStatistics",
    "LayerProgress",
    "capture_fence",
    "run_batch_copies",
]


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
    raise TypeError(
        f"after= takes a stream or an event (torch.cuda.Stream / torch.cuda.Event); got {type(after).__name__}"
    )


@runtime_checkable
class CopyExecutor(Protocol):
    """Runs batches of copies.

    ``max_in_flight`` bounds concurrent `execute` calls *per direction*: loads
    and backups are dispatched independently. `execute` must not return or
    raise while a copy of the batch may still touch memory: the scheduler frees
    slots right after it. It waits for ``batch.fences`` before copying.
    """

    @property
    def max_in_flight(self) -> int: ...

    async def execute(self, batch: Batch, progress: LayerProgress) -> None: ...


def run_batch_copies(batch: Batch, progress: LayerProgress) -> None:
    """Plan ``batch`` and copy it in the calling thread; report each layer.

    While nobody waits on a layer (``progress.watched`` is False) the rest of
    the batch is copied at once, across every layer (one call per row group
    for stacked pools; see `BatchPlan.copy_layers`). Once someone waits, the
    copy goes on in groups of `BatchPlan.layer_group` transfer layers, so that
    layer t is reported about one group after it landed instead of at the end.
    Layers are reported in order, each exactly once, after all its bytes
    landed in every pool.
    """
    plan = batch.plan()
    num_layers = plan.num_layers
    group = 0
    start = 0
    while start < num_layers:
        if progress.watched:
            group = group or plan.layer_group()
            stop = min(num_layers, start + group)
        else:
            stop = num_layers
        plan.copy_layers(start, stop)
        for layer in range(start, stop):
            progress.layer_done(layer)
        start = stop


@dataclass(frozen=True, slots=True)
class CpuExecutorStatistics:
    """What a `CpuExecutor` did: batches run, bytes they moved, and seconds its
    worker thread spent on them (fences, planning and copies; not the hand-off
    between the event loop and the thread), in total and for the longest batch."""

    batches: int
    nbytes: int
    worker_seconds: float
    max_batch_seconds: float


class CpuExecutor:
    """Copies in one worker thread, one batch at a time.

    ``torch_threads`` is the torch intra-op thread count inside the worker
    (thread-local in torch); the default of 1 leaves the event loop a core.
    """

    def __init__(self, *, torch_threads: int = 1) -> None:
        if not isinstance(torch_threads, int) or isinstance(torch_threads, bool) or torch_threads < 1:
            raise ConfigurationError(f"torch_threads must be an int >= 1; got {torch_threads!r}")
        self._torch_threads = torch_threads
        self._limiter = anyio.CapacityLimiter(1)
        # Written by the worker (one batch at a time), read anywhere.
        self._batches = 0
        self._nbytes = 0
        self._worker_seconds = 0.0
        self._max_batch_seconds = 0.0

    @property
    def max_in_flight(self) -> int:
        return 1

    async def execute(self, batch: Batch, progress: LayerProgress) -> None:
        # Not abandoned on cancellation: the copies finish before the caller
        # may release the slots they touch.
        await anyio.to_thread.run_sync(self._run, batch, progress, limiter=self._limiter)

    def _run(self, batch: Batch, progress: LayerProgress) -> None:
        start = time.perf_counter()
        try:
            if torch.get_num_threads() != self._torch_threads:
                torch.set_num_threads(self._torch_threads)
            for fence in batch.fences:
                fence.synchronize()  # type: ignore[attr-defined]  # blocks this worker, never the loop
            run_batch_copies(batch, progress)
            self._nbytes += batch.nbytes
        finally:
            seconds = time.perf_counter() - start
            self._batches += 1
            self._worker_seconds += seconds
            self._max_batch_seconds = max(self._max_batch_seconds, seconds)

    def statistics(self) -> CpuExecutorStatistics:
        return CpuExecutorStatistics(self._batches, self._nbytes, self._worker_seconds, self._max_batch_seconds)

    def __repr__(self) -> str:
        return (f"<CpuExecutor [torch_threads={self._torch_threads} | {self._batches} batches, "
                f"{self._worker_seconds:.3f} s in the worker]>")
