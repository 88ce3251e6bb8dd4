"""`CudaExecutor`: copies on CUDA streams, an event per layer, no host waits on the loop.

* One stream per direction, and two threads of its own per direction
  (`WorkerThread`s): one enqueues, one waits. A backup burst never delays a
  load, on the device or while its copies are enqueued. Batches of one
  direction reach their stream in dispatch order.
* A batch costs the loop one hand-off out (to the direction's enqueuing
  thread) and one back (from its waiting thread, ``call_soon_threadsafe``);
  the enqueuing thread passes the batch on to the waiting thread itself.
* A batch's copies are enqueued from the enqueuing thread, never from the
  event loop. After each transfer layer's copies (every pool, every plane) an
  event is recorded on the copy stream. The events are published to the
  handles, so a compute stream can wait for layer i on the device
  (``handle.wait_layer(i, stream)``).
* Completion is waited for in the waiting thread: it synchronizes the layer
  events in order (blocking-sync events: the thread sleeps in the driver
  instead of spinning) and reports each layer the moment its event completes.
  One waiting thread per direction loses nothing: a stream runs in order, so
  a later batch's events never complete before an earlier one's. The loop
  never polls, so no timer granularity (asyncio rounds sub-millisecond sleeps
  up to about a millisecond) is added to a batch.
* Fences (``after=``) become ``stream.wait_event(...)`` before the copies.
  Nothing else orders the copy streams after the engine's streams: device rows
  written on any stream (the default stream included) must be fenced.
* Runs consecutive on both sides become one ``copy_(non_blocking=True)`` each
  when the host side is contiguous (``layer_first``); the remaining rows go
  through staging: gathered on the source side (on the host into pinned
  memory for a load, on the device for a backup), copied in one piece, and
  scattered on the destination side. A backup's host scatter of layer i runs
  as soon as layer i's event completes, while later layers are still copying.
* A direct run copy never spans two pinned registrations of the host pool:
  runs are split at `HostPool.registration_cuts` (the driver may treat a range
  over two registrations as pageable, which is synchronous).
* Index tensors, staging buffers and the plan are held until the batch's
  last event completes. ``execute`` never returns while a copy may still run:
  after a failure it waits for what was already enqueued, and it is shielded
  from cancellation once called.

``handle.wait_layer(i)`` without a stream makes the *calling thread's* current
stream on the copy's device wait (torch keeps one current stream per thread):
that is the event loop's thread, so an engine whose forward pass runs on
another thread or stream must pass that stream.

The ordering logic talks to the GPU only through `DeviceBackend`, so the CPU
test suite drives it with a fake device that models asynchronous copies,
stream order and pinned memory.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import torch

from kvtier.errors import ConfigurationError
from kvtier.transfers.eventloop import Future, Loop, WorkerThread, new_future, running_loop
from kvtier.transfers.executor import Batch, LayerProgress
from kvtier.transfers.operation import Direction
from kvtier.transfers.plan import CopyPlan, PoolCopy

__all__ = ["CudaExecutor", "CudaExecutorStatistics", "DeviceBackend", "TorchCudaBackend"]


class DeviceBackend(Protocol):
    """The device operations the executor needs.

    Tensor operations are asynchronous on the calling thread's current stream
    (set with `use_stream`). ``copy`` moves bytes between the device and
    pinned, contiguous host memory without blocking the host. Events returned
    by ``new_event`` support ``record(stream)``, ``query()``,
    ``synchronize()`` (from a worker thread) and, with ``timing``,
    ``elapsed_time(other)`` in milliseconds.
    """

    def new_stream(self) -> Any: ...
    def new_event(self, *, timing: bool = False) -> Any: ...
    def use_stream(self, stream: Any) -> AbstractContextManager[Any]: ...
    def current_stream(self) -> Any: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor: ...
    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None: ...
    def to_device(self, t: torch.Tensor) -> torch.Tensor: ...
    def device_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class TorchCudaBackend:
    """`DeviceBackend` on ``torch.cuda``."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if not torch.cuda.is_available():
            raise ConfigurationError("TorchCudaBackend needs CUDA; torch.cuda.is_available() is False on this machine "
                                     f"(torch {torch.__version__}): use CpuExecutor")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def new_event(self, *, timing: bool = False) -> torch.cuda.Event:
        # blocking=True: a thread in synchronize() sleeps until the event
        # completes (cudaEventBlockingSync) instead of spinning on a core.
        return torch.cuda.Event(enable_timing=timing, blocking=True)  # type: ignore[no-untyped-call]

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return src.index_select(0, index)

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        dst.index_copy_(0, index, src)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        # Pinned first, so the host-to-device copy is truly asynchronous; torch's
        # caching host allocator keeps the pinned block until the copy is done.
        return t.pin_memory().to(self.device, non_blocking=True)

    def device_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Allocated for the current (copy) stream by the caching allocator.
        return torch.empty(shape, dtype=dtype, device=self.device)

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # torch's caching host allocator reuses these blocks across batches.
        return torch.empty(shape, dtype=dtype, pin_memory=True)


@dataclass(frozen=True, slots=True)
class CudaExecutorStatistics:
    """What a `CudaExecutor` did.

    ``enqueue_seconds``: host time spent planning and enqueuing batches (in
    the enqueuing threads). ``device_seconds``: time on the copy streams from
    a batch's first copy (after its fences) to its last event, summed over
    batches; None unless the executor was made with ``timing=True``.
    """

    batches: int
    failed_batches: int
    nbytes: int
    enqueue_seconds: float
    max_enqueue_seconds: float
    device_seconds: float | None
    max_device_seconds: float | None


@dataclass(eq=False)
class _Job:
    """What one enqueued batch holds until its last event completes."""

    nbytes: int
    events: list[Any] = field(default_factory=list)
    start: Any = None  # a timing event before the first copy, with timing=True
    keep_alive: list[object] = field(default_factory=list)
    # Per transfer layer: (host view, host row indices, pinned staging) to place
    # once that layer's event completed (backups through staging).
    host_scatters: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    enqueue_seconds: float = 0.0
    error: BaseException | None = None


def _split_runs(
    runs: tuple[tuple[int, int, int], ...], cuts: tuple[int, ...], *, host_side: int
) -> list[tuple[int, int, int]]:
    """``runs`` (``(src, dst, length)``) split wherever the host side (item
    ``host_side`` of a run) crosses one of the ascending row ``cuts``."""
    out: list[tuple[int, int, int]] = []
    for s, d, n in runs:
        h = d if host_side else s
        i = bisect_right(cuts, h)
        while i < len(cuts) and cuts[i] < h + n:
            k = cuts[i] - h
            out.append((s, d, k))
            s, d, n, h = s + k, d + k, n - k, h + k
            i += 1
        out.append((s, d, n))
    return out


def _rows(plan: CopyPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (source, destination) row of a plan, runs and gathered rows alike."""
    src = [torch.arange(s, s + n) for s, _, n in plan.runs]
    dst = [torch.arange(d, d + n) for _, d, n in plan.runs]
    if plan.gather_src is not None and plan.gather_dst is not None:
        src.append(plan.gather_src)
        dst.append(plan.gather_dst)
    return torch.cat(src), torch.cat(dst)


class CudaExecutor:
    """Runs batches on CUDA streams; see the module docstring.

    ``max_in_flight``: batches enqueued per direction before the scheduler
    waits for one to complete. ``timing``: record timing events so that
    `statistics` reports device time (a little more work per batch).
    Raises ValueError for a ``max_in_flight`` that is not an int >= 1.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        *,
        backend: DeviceBackend | None = None,
        max_in_flight: int = 2,
        timing: bool = False,
    ) -> None:
        if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
            raise ConfigurationError(f"max_in_flight must be an int >= 1; got {max_in_flight!r}")
        self.backend: DeviceBackend = backend if backend is not None else TorchCudaBackend(device)
        self._streams = {d: self.backend.new_stream() for d in (Direction.LOAD, Direction.BACKUP)}
        self._max_in_flight = max_in_flight
        self._timing = timing
        # Per direction, a thread that enqueues and one that waits, each
        # taking its batches in order: batches reach each stream in dispatch
        # order, and a long backup enqueue never holds up a load's.
        self._enqueuers = {d: WorkerThread(f"kvtier-cuda-{d.value}-enqueue", idle_s=30.0) for d in self._streams}
        self._waiters = {d: WorkerThread(f"kvtier-cuda-{d.value}-wait", idle_s=30.0) for d in self._streams}
        # Written by the worker threads, read anywhere.
        self._lock = threading.Lock()
        self._batches = 0
        self._failed = 0
        self._nbytes = 0
        self._enqueue_seconds = 0.0
        self._max_enqueue_seconds = 0.0
        self._device_seconds = 0.0
        self._max_device_seconds = 0.0

    @property
    def max_in_flight(self) -> int:
        return self._max_in_flight

    def stream(self, direction: Direction) -> Any:
        """The copy stream of one direction."""
        return self._streams[direction]

    async def execute(self, batch: Batch, progress: LayerProgress) -> None:
        loop = running_loop()
        future: Future[None] = new_future(loop)
        # One hand-off out: the enqueuing thread hands the batch on to the
        # waiting thread, whose answer settles ``future`` on the loop.
        self._enqueuers[batch.direction].submit(loop, None, self._enqueue_and_pass_on, batch, progress, loop, future)
        # Shielded: once handed a batch, its copies run whatever happens to the
        # caller, and the slots they touch may only be released after they finish.
        with anyio.CancelScope(shield=True):
            await future  # the batch's error, if any, is raised here

    async def stop_threads(self) -> None:
        """End the enqueuing and waiting threads once the batches handed to
        them have run (the next batch starts them again); the enqueuing ones
        first, since each hands its batches on to a waiting one.
        `TransferScheduler` calls it as it closes."""
        for workers in (self._enqueuers, self._waiters):
            for worker in workers.values():
                await worker.stop()

    # -- the enqueuing thread (one per direction) ------------------------------

    def _enqueue_and_pass_on(self, batch: Batch, progress: LayerProgress, loop: Loop, future: Future[None]) -> None:
        """Enqueue ``batch``, publish its events, and pass it on to the waiting
        thread, which answers ``future``; never raises (see `WorkerThread.submit`)."""
        job: _Job | None = None
        try:
            job = self._enqueue(batch, self._streams[batch.direction])
            if job.error is None:
                progress.publish_events(job.events, self.backend.current_stream)
        except BaseException as exc:  # whatever it is, the waiting thread hands it to the caller
            # (after waiting for the events of what was enqueued, if any)
            job = job if job is not None else _Job(nbytes=batch.nbytes)
            job.error = exc
        self._waiters[batch.direction].submit(loop, future, self._finish, job, progress)

    def _enqueue(self, batch: Batch, stream: Any) -> _Job:
        started = time.perf_counter()
        job = _Job(nbytes=batch.nbytes)
        backend = self.backend
        with backend.use_stream(stream):
            try:
                plan = batch.plan()
                job.keep_alive.append(plan)
                self._wait_for_fences(batch, stream)
                if self._timing:
                    job.start = backend.new_event(timing=True)
                    job.start.record(stream)
                load = plan.direction is Direction.LOAD
                routes = [self._route(c, job) for c in plan.copies]
                for layer in range(plan.num_layers):
                    scatters: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
                    for c, route in zip(plan.copies, routes):
                        j = c.device.pool_layer(layer)
                        if j is None:
                            continue
                        for p in range(len(c.device.planes)):
                            host, dev = c.host.layer_view(j, p), c.device.tensor(j, p)
                            cuts = c.host.registration_cuts(j, p) if route.runs else ()
                            if load:
                                self._load_rows(route, host, dev, job, cuts)
                            else:
                                self._backup_rows(route, host, dev, job, scatters, cuts)
                    event = backend.new_event(timing=self._timing)
                    event.record(stream)
                    job.events.append(event)
                    job.host_scatters.append(scatters)
            except Exception as exc:  # raised before or while enqueuing
                job.error = exc
                # Wait (in the waiting thread) for whatever was enqueued already.
                event = backend.new_event()
                event.record(stream)
                job.events.append(event)
        job.enqueue_seconds = time.perf_counter() - started
        return job

    @staticmethod
    def _wait_for_fences(batch: Batch, stream: Any) -> None:
        for fence in batch.fences:
            stream.wait_event(fence)

    def _route(self, c: PoolCopy, job: _Job) -> _Route:
        """Split a pool's rows into direct run copies and staged rows.

        Runs are copied directly only where the host slice is contiguous
        (``layer_first``): a strided host slice would make torch stage it in
        pageable memory behind our back, which is synchronous.
        """
        plan = c.plan
        if c.host.layout == "layer_first" or c.host.num_layers == 1:
            runs, src, dst = plan.runs, plan.gather_src, plan.gather_dst
        else:
            runs, (src, dst) = (), _rows(plan)
        if src is None or dst is None:
            return _Route(runs, None, None, None, None)
        # Host-side indices stay on the host; the device side needs its own
        # copy, made once per batch and held until the batch completes.
        dev_src, dev_dst = self.backend.to_device(src), self.backend.to_device(dst)
        job.keep_alive.extend((src, dst, dev_src, dev_dst))
        return _Route(runs, src, dst, dev_src, dev_dst)

    def _load_rows(self, route: _Route, host: torch.Tensor, dev: torch.Tensor, job: _Job,
                   cuts: tuple[int, ...] = ()) -> None:
        backend = self.backend
        for s, d, n in _split_runs(route.runs, cuts, host_side=0) if cuts else route.runs:
            backend.copy(dev[d : d + n], host[s : s + n])
        if route.src is not None:
            if route.dev_dst is None:
                raise AssertionError("a staged load needs its device destination rows")
            staging = backend.pinned_empty((len(route.src), *host.shape[1:]), host.dtype)
            torch.index_select(host, 0, route.src, out=staging)  # host gather, in this thread
            on_device = backend.device_empty((len(route.src), *dev.shape[1:]), dev.dtype)
            backend.copy(on_device, staging)
            backend.scatter(dev, route.dev_dst, on_device)
            job.keep_alive.extend((staging, on_device))

    def _backup_rows(
        self,
        route: _Route,
        host: torch.Tensor,
        dev: torch.Tensor,
        job: _Job,
        scatters: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        cuts: tuple[int, ...] = (),
    ) -> None:
        backend = self.backend
        for s, d, n in _split_runs(route.runs, cuts, host_side=1) if cuts else route.runs:
            backend.copy(host[d : d + n], dev[s : s + n])
        if route.src is not None:
            if route.dev_src is None or route.dst is None:
                raise AssertionError("a staged backup needs its device source and host destination rows")
            gathered = backend.gather(dev, route.dev_src)  # device gather
            staging = backend.pinned_empty(tuple(gathered.shape), gathered.dtype)
            backend.copy(staging, gathered)
            job.keep_alive.extend((gathered, staging))
            scatters.append((host, route.dst, staging))

    # -- the waiting thread (one per direction) --------------------------------

    def _finish(self, job: _Job, progress: LayerProgress) -> None:
        """Wait for each layer's event in order; place a backup's staged rows
        of that layer and report it while later layers still copy."""
        try:
            for layer, event in enumerate(job.events):
                event.synchronize()  # blocks this worker thread, never the loop
                if job.error is None:
                    for host, rows, staging in job.host_scatters[layer]:
                        host.index_copy_(0, rows, staging)
                    progress.layer_done(layer)
        except BaseException:
            self._count(job, failed=True)
            raise
        self._count(job, failed=job.error is not None)
        if job.error is not None:
            raise job.error

    def _count(self, job: _Job, *, failed: bool) -> None:
        device = None
        if job.start is not None and not failed:
            device = job.start.elapsed_time(job.events[-1]) / 1e3
        with self._lock:
            self._batches += 1
            self._failed += failed
            if not failed:
                self._nbytes += job.nbytes
            self._enqueue_seconds += job.enqueue_seconds
            self._max_enqueue_seconds = max(self._max_enqueue_seconds, job.enqueue_seconds)
            if device is not None:
                self._device_seconds += device
                self._max_device_seconds = max(self._max_device_seconds, device)

    def statistics(self) -> CudaExecutorStatistics:
        with self._lock:
            return CudaExecutorStatistics(
                self._batches, self._failed, self._nbytes, self._enqueue_seconds, self._max_enqueue_seconds,
                self._device_seconds if self._timing else None,
                self._max_device_seconds if self._timing else None,
            )

    def __repr__(self) -> str:
        return (f"<CudaExecutor [max_in_flight={self._max_in_flight}, timing={self._timing} | "
                f"{self._batches} batches]>")


@dataclass(frozen=True, slots=True, eq=False)
class _Route:
    runs: tuple[tuple[int, int, int], ...]
    src: torch.Tensor | None
    dst: torch.Tensor | None
    dev_src: torch.Tensor | None
    dev_dst: torch.Tensor | None
