"""CPU copy execution: a batch's copies run in a worker thread, layer by layer.

`run_batch_copies` plans a batch and copies it in the calling thread,
reporting each transfer layer in order, once, after all its bytes landed in
every pool. It copies every layer at once (one call per row group across all
layers where the engine's tensors allow it) unless someone waits on a layer;
then it goes in groups of layers, so that waiter is not kept until the end.

`CpuExecutor` is the `CopyExecutor` for CPU device pools: it runs
`run_batch_copies` in a thread of its own (`WorkerThread`: one hand-off out
and one back per batch, one batch at a time, so the scheduler's choice of the
next batch is made as late as possible), with torch at ``torch_threads``
intra-op threads for the batch's copies only: the process-wide default is
back before ``execute`` returns, so threads started later see no change.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvtier.errors import ConfigurationError
from kvtier.transfers.calibration import CopyCalibrator, process_calibrator
from kvtier.transfers.eventloop import WorkerThread
from kvtier.transfers.executor import Batch, LayerProgress

__all__ = ["CpuExecutor", "CpuExecutorStatistics", "run_batch_copies"]

T = TypeVar("T")


def run_batch_copies(batch: Batch, progress: LayerProgress, calibrator: CopyCalibrator | None = None) -> None:
    """Plan ``batch`` and copy it in the calling thread; report each layer.

    With a ``calibrator``, each pool's copy method is its choice for the
    copy's shape (measured here on the shape's first copy, see
    `kvtier.transfers.calibration`); without one, the fixed rules'.

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
        plan.copy_layers(start, stop, copy=None if calibrator is None else calibrator.copy)
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

    ``torch_threads`` is the torch intra-op thread count for a batch's copies;
    the default of 1 leaves the event loop a core. The count is set for the
    batch and the previous one restored after it (see `_run`).

    ``calibrator`` chooses each copy's method from measurements on this
    machine (`kvtier.transfers.calibration`): by default the process-wide
    `process_calibrator` (on unless ``KVTIER_COPY_CALIBRATION=0``);
    ``calibrate=False`` leaves the choice to the fixed rules. Raises
    `ConfigurationError` for a ``torch_threads`` that is not an int >= 1.
    """

    def __init__(
        self, *, torch_threads: int = 1, calibrate: bool = True, calibrator: CopyCalibrator | None = None
    ) -> None:
        if not isinstance(torch_threads, int) or isinstance(torch_threads, bool) or torch_threads < 1:
            raise ConfigurationError(f"torch_threads must be an int >= 1; got {torch_threads!r}")
        self._torch_threads = torch_threads
        self._calibrator = None if not calibrate else calibrator if calibrator is not None else process_calibrator()
        self._worker = WorkerThread("kvtier-cpu-copies", idle_s=30.0)
        # Written by the worker (one batch at a time), read anywhere.
        self._batches = 0
        self._nbytes = 0
        self._worker_seconds = 0.0
        self._max_batch_seconds = 0.0

    @property
    def max_in_flight(self) -> int:
        return 1

    @property
    def calibrator(self) -> CopyCalibrator | None:
        """What chooses this executor's copy methods (None: the fixed rules)."""
        return self._calibrator

    async def execute(self, batch: Batch, progress: LayerProgress) -> None:
        # Not abandoned on cancellation: the copies finish before the caller
        # may release the slots they touch.
        await self._worker.run(self._run, batch, progress)

    async def stop_threads(self) -> None:
        """End the copy thread once the batches handed to it have run (the
        next batch starts another). `TransferScheduler` calls it as it closes,
        so that no thread of kvtier's outlives the scheduler."""
        await self._worker.stop()

    async def run_in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the executor's copy thread, between batches (one
        thing at a time runs there), as `execute` runs a batch's copies: for
        timing a baseline copy on the very OS thread kvtier copies on."""
        return await self._worker.run(fn, *args)

    def _run(self, batch: Batch, progress: LayerProgress) -> None:
        start = time.perf_counter()
        # torch.set_num_threads (torch 2.13, CPU, OpenMP build) is neither
        # thread-local nor process-wide: it sets the calling thread's OpenMP and
        # MKL counts, and also a process-wide default that every thread takes on
        # its first parallel torch op (a fresh thread, or a main thread that had
        # not run one yet). Threads that already ran one keep their own count.
        # So the count is set for this batch only and restored in the finally,
        # which also puts the process-wide default back.
        # The default is wrong for a thread that first runs torch during the
        # batch itself (torch has no way to set one without the other). Setting
        # and restoring costs about half a microsecond per batch.
        previous = torch.get_num_threads()
        if previous != self._torch_threads:
            torch.set_num_threads(self._torch_threads)
        try:
            for fence in batch.fences:
                fence.synchronize()  # type: ignore[attr-defined]  # blocks this worker, never the loop
            run_batch_copies(batch, progress, self._calibrator)
            self._nbytes += batch.nbytes
        finally:
            if previous != self._torch_threads:
                torch.set_num_threads(previous)
            seconds = time.perf_counter() - start
            self._batches += 1
            self._worker_seconds += seconds
            self._max_batch_seconds = max(self._max_batch_seconds, seconds)

    def statistics(self) -> CpuExecutorStatistics:
        return CpuExecutorStatistics(self._batches, self._nbytes, self._worker_seconds, self._max_batch_seconds)

    def __repr__(self) -> str:
        return (f"<CpuExecutor [torch_threads={self._torch_threads} | {self._batches} batches, "
                f"{self._worker_seconds:.3f} s in the worker]>")
