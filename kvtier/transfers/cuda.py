"""`CudaExecutor`: copies on CUDA streams, an event per layer, no host waits.

* One stream per direction, so a backup burst never delays a load.
* A batch's copies are enqueued from the executor's thread, never from the
  event loop. After each transfer layer's copies (every pool, every plane) an
  event is recorded; the loop polls the events with ``query()`` between
  awaits, in FIFO order, and signals each layer as its event completes. The
  events are published to the handles, so a compute stream can wait for layer
  i on the device (``handle.wait_layer(i, stream)``).
* Fences (``after=``) become ``stream.wait_event(...)`` before the copies.
* Runs consecutive on both sides become one ``copy_(non_blocking=True)`` each
  when the host side is contiguous (``layer_first``); the remaining rows go
  through staging: gathered on the source side (on the host into pinned
  memory for a load, on the device for a backup), copied in one piece, and
  scattered on the destination side.
* Index tensors, staging buffers and the plan are held until the batch's
  last event completes. ``execute`` never returns while a copy may still run:
  after a failure it waits for what was already enqueued.

The ordering logic talks to the GPU only through `DeviceBackend`, so the CPU
test suite drives it with fakes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.to_thread
import torch

from kvtier.transfers.executor import Batch, LayerProgress
from kvtier.transfers.operation import Direction
from kvtier.transfers.plan import CopyPlan, PoolCopy

__all__ = ["CudaExecutor", "DeviceBackend", "TorchCudaBackend"]


class DeviceBackend(Protocol):
    """The device operations the executor needs, all asynchronous on the
    current stream (set with `use_stream`)."""

    def new_stream(self) -> Any: ...
    def new_event(self) -> Any: ...
    def use_stream(self, stream: Any) -> AbstractContextManager[Any]: ...
    def current_stream(self) -> Any: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor: ...
    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None: ...
    def to_device(self, t: torch.Tensor) -> torch.Tensor: ...
    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class TorchCudaBackend:
    """`DeviceBackend` on ``torch.cuda``."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("TorchCudaBackend needs CUDA; torch.cuda.is_available() is False")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()  # type: ignore[no-untyped-call]

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
        # Pinned first, so the host-to-device copy is truly asynchronous.
        return t.pin_memory().to(self.device, non_blocking=True)

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # torch's caching host allocator reuses these blocks across batches.
        return torch.empty(shape, dtype=dtype, pin_memory=True)


@dataclass(eq=False)
class _Job:
    """What one enqueued batch holds until its last event completes."""

    events: list[Any] = field(default_factory=list)
    keep_alive: list[object] = field(default_factory=list)
    # (host view, host row indices, pinned staging) to place after the copy lands.
    host_scatters: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    error: BaseException | None = None


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
    waits for one to complete. ``poll_interval_s``: sleep between event
    queries on the loop while a batch is in flight.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        *,
        backend: DeviceBackend | None = None,
        max_in_flight: int = 2,
        poll_interval_s: float = 50e-6,
    ) -> None:
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1; got {max_in_flight!r}")
        if poll_interval_s < 0:
            raise ValueError(f"poll_interval_s must be >= 0; got {poll_interval_s!r}")
        self.backend: DeviceBackend = backend if backend is not None else TorchCudaBackend(device)
        self._streams = {Direction.LOAD: self.backend.new_stream(), Direction.BACKUP: self.backend.new_stream()}
        self._max_in_flight = max_in_flight
        self._poll = poll_interval_s
        # One enqueuing thread: batches reach each stream in dispatch order.
        self._enqueue_limiter = anyio.CapacityLimiter(1)

    @property
    def max_in_flight(self) -> int:
        return self._max_in_flight

    def stream(self, direction: Direction) -> Any:
        return self._streams[direction]

    async def execute(self, batch: Batch, progress: LayerProgress) -> None:
        stream = self._streams[batch.direction]
        job = await anyio.to_thread.run_sync(self._enqueue, batch, stream, limiter=self._enqueue_limiter)
        if job.error is None:
            progress.publish_events(job.events, self.backend.current_stream)
        # Shielded: the copies run whatever happens to the caller, and the
        # slots they touch may only be released after they finish.
        with anyio.CancelScope(shield=True):
            backup_rows = bool(job.host_scatters)
            for layer, event in enumerate(job.events):
                while not event.query():
                    await anyio.sleep(self._poll)
                if job.error is None and not backup_rows:
                    progress.layer_done(layer)
            if job.error is not None:
                raise job.error
            if backup_rows:
                await anyio.to_thread.run_sync(self._place_host_rows, job, progress, limiter=self._enqueue_limiter)

    # -- the executor's thread -----------------------------------------------

    def _enqueue(self, batch: Batch, stream: Any) -> _Job:
        job = _Job()
        backend = self.backend
        with backend.use_stream(stream):
            try:
                plan = batch.plan()
                job.keep_alive.append(plan)
                for fence in batch.fences:
                    stream.wait_event(fence)
                load = plan.direction is Direction.LOAD
                routes = [self._route(c, job) for c in plan.copies]
                for layer in range(plan.num_layers):
                    for c, route in zip(plan.copies, routes):
                        j = c.device.pool_layer(layer)
                        if j is None:
                            continue
                        for p in range(len(c.device.planes)):
                            host, dev = c.host.layer_view(j, p), c.device.tensor(j, p)
                            if load:
                                self._load_rows(route, host, dev, job)
                            else:
                                self._backup_rows(route, host, dev, job)
                    event = backend.new_event()
                    event.record(stream)
                    job.events.append(event)
            except Exception as exc:  # raised before or while enqueuing
                job.error = exc
                # Wait (on the loop, by polling) for whatever was enqueued already.
                event = backend.new_event()
                event.record(stream)
                job.events.append(event)
        return job

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

    def _load_rows(self, route: _Route, host: torch.Tensor, dev: torch.Tensor, job: _Job) -> None:
        backend = self.backend
        for s, d, n in route.runs:
            backend.copy(dev[d : d + n], host[s : s + n])
        if route.src is not None:
            assert route.dev_dst is not None
            staging = backend.pinned_empty((len(route.src), *host.shape[1:]), host.dtype)
            torch.index_select(host, 0, route.src, out=staging)  # host gather, in this thread
            on_device = dev.new_empty((len(route.src), *dev.shape[1:]))  # on the copy stream
            backend.copy(on_device, staging)
            backend.scatter(dev, route.dev_dst, on_device)
            job.keep_alive.extend((staging, on_device))

    def _backup_rows(self, route: _Route, host: torch.Tensor, dev: torch.Tensor, job: _Job) -> None:
        backend = self.backend
        for s, d, n in route.runs:
            backend.copy(host[d : d + n], dev[s : s + n])
        if route.src is not None:
            assert route.dev_src is not None and route.dst is not None
            gathered = backend.gather(dev, route.dev_src)  # device gather
            staging = backend.pinned_empty(tuple(gathered.shape), gathered.dtype)
            backend.copy(staging, gathered)
            job.keep_alive.append(gathered)
            job.host_scatters.append((host, route.dst, staging))

    @staticmethod
    def _place_host_rows(job: _Job, progress: LayerProgress) -> None:
        """After a backup's copies landed: scatter staged rows into the host pool."""
        for host, rows, staging in job.host_scatters:
            host.index_copy_(0, rows, staging)
        for layer in range(len(job.events)):
            progress.layer_done(layer)

    def __repr__(self) -> str:
        return f"<CudaExecutor [max_in_flight={self._max_in_flight}, poll={self._poll * 1e6:.0f} us]>"


@dataclass(frozen=True, slots=True, eq=False)
class _Route:
    runs: tuple[tuple[int, int, int], ...]
    src: torch.Tensor | None
    dst: torch.Tensor | None
    dev_src: torch.Tensor | None
    dev_dst: torch.Tensor | None
