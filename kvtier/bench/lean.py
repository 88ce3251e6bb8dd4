"""The lean floor: a pure-Python scheduler written for one job, next to kvtier
in the same process, so the benchmark can say what kvtier's generality costs
the engine's thread.

`LeanScheduler` does what a one-page backup needs and nothing else:

* checks each request in plain Python (a known pool; a 1-D integer tensor
  of slots on the device, each in range; no slot twice), and refuses a bad
  one before it changes anything;
* takes host pages for all of a request's pools from a free list, all or
  nothing;
* records the pages' writer until the copy ends (the ownership record);
* queues the request in a bounded queue that one batching task drains, up to
  a batch bound at a time;
* "runs" each batch through an executor that signals every layer and copies
  nothing (as the benchmark's `NoCopyExecutor` does for kvtier), or, given
  ``copy``, hands the batch's rows to a `WorkerThread` to copy and awaits it
  (as kvtier's `CpuExecutor` does): the floor under a lone copying operation;
* ends one future per request, and gives the caller host indices that do not
  alias its own state (a tensor per pool, as kvtier's ``host_indices``).

It has none of kvtier's other promises: no priorities or ``after``, no
cancellation, no named host pages or page generations, no loads, no sidecar
pools, no statistics or log events, no anyio. The ratio of kvtier's loop CPU
to its own (`lean_cost`) is therefore an upper bound on what kvtier's design
could save, not a like-for-like race.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch

from kvtier.bench.loop import LONE_OPS
from kvtier.bench.measures import median_range
from kvtier.transfers.eventloop import WorkerThread

__all__ = ["LeanHandle", "LeanScheduler", "hop_cost", "lean_cost"]

_INTEGER = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


class LeanHandle:
    """One request's future, and its host pages: a tensor per pool, made at
    submission (the bulk path's are views of one tensor per pool)."""

    __slots__ = ("_future", "host_indices")

    def __init__(self, future: asyncio.Future[None], host_indices: dict[str, torch.Tensor]) -> None:
        self._future = future
        self.host_indices = host_indices

    def __await__(self) -> Any:
        return self._future.__await__()


class LeanScheduler:
    """See the module doc. ``pools`` maps each pool's name to its
    ``(device_slots, host_pages)``; page size 1. ``copy(slots, pages)``, when
    given, copies a batch's device slots to its host pages (both by pool), in
    a worker thread of the scheduler's own."""

    def __init__(
        self, pools: Mapping[str, tuple[int, int]], *, num_layers: int, max_queued: int = 4096,
        max_batch: int = 4096, copy: Callable[[dict[str, list[int]], dict[str, list[int]]], None] | None = None,
    ) -> None:
        self._device_slots = {name: d for name, (d, _) in pools.items()}
        # The free pages of each pool, a stack; and each page's writer (0: none).
        self._free = {name: list(range(h - 1, -1, -1)) for name, (_, h) in pools.items()}
        self._writer = {name: [0] * h for name, (_, h) in pools.items()}
        self._num_layers = num_layers
        self._max_queued = max_queued
        self._max_batch = max_batch
        self._queue: deque[tuple[int, asyncio.Future[None], dict[str, list[int]], dict[str, list[int]]]] = deque()
        self._copy = copy
        self._worker = WorkerThread("kvtier-bench-lean", idle_s=1.0) if copy is not None else None
        self._wake = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._next_id = 1
        self._layers_signalled = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LeanScheduler:
        self._task = asyncio.create_task(self._batcher())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def _check(self, request: Mapping[str, Any]) -> dict[str, list[int]]:
        out = {}
        for name, idx in request.items():
            if name not in self._device_slots:
                raise ValueError(f"unknown pool {name!r}; pools: {sorted(self._device_slots)}")
            if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.dtype not in _INTEGER:
                raise ValueError(f"pool {name!r} needs a 1-D integer tensor; got {idx!r}")
            slots = idx.tolist()
            if slots and (min(slots) < 0 or max(slots) >= self._device_slots[name]):
                raise ValueError(f"pool {name!r}: slots must lie in [0, {self._device_slots[name]})")
            if len(slots) > 1 and len(set(slots)) != len(slots):
                raise ValueError(f"pool {name!r}: a slot appears twice")
            out[name] = slots
        return out

    def _take(self, op: int, slots: Mapping[str, list[int]]) -> dict[str, list[int]]:
        taken: dict[str, list[int]] = {}
        for name, a in slots.items():
            free = self._free[name]
            if len(free) < len(a):
                for back, pages in taken.items():  # all or nothing
                    writer = self._writer[back]
                    for p in pages:
                        writer[p] = 0
                    self._free[back].extend(reversed(pages))
                raise MemoryError(f"pool {name!r}: {len(a)} pages asked, {len(free)} free")
            pages = [free.pop() for _ in a]
            writer = self._writer[name]
            for p in pages:
                writer[p] = op
            taken[name] = pages
        return taken

    def _submit(self, request: Mapping[str, Any]) -> LeanHandle:
        slots = self._check(request)
        pages = self._take(self._next_id, slots)
        future = asyncio.get_running_loop().create_future()
        self._queue.append((self._next_id, future, pages, slots))
        self._next_id += 1
        self._wake.set()
        return LeanHandle(future, {name: torch.tensor(p, dtype=torch.int64) for name, p in pages.items()})

    async def backup(self, request: Mapping[str, Any]) -> LeanHandle:
        while len(self._queue) >= self._max_queued:
            self._space.clear()
            await self._space.wait()
        return self._submit(request)

    async def backup_many(self, requests: Sequence[Mapping[str, Any]]) -> list[LeanHandle]:
        if len(self._queue) + len(requests) > self._max_queued:
            raise ValueError(f"{len(requests)} requests do not fit a queue of {self._max_queued}")
        checked = [self._check(r) for r in requests]  # every request checked before any page is taken
        loop = asyncio.get_running_loop()
        taken = []
        for slots in checked:
            pages = self._take(self._next_id, slots)
            taken.append((self._next_id, loop.create_future(), pages, slots))
            self._next_id += 1
        self._queue.extend(taken)
        # One tensor per pool for the whole call, a view of it per request.
        views: list[dict[str, torch.Tensor]] = [{} for _ in taken]
        for name in {name for _, _, pages, _ in taken for name in pages}:
            mine = [i for i, (_, _, pages, _) in enumerate(taken) if name in pages]
            flat = torch.tensor([p for i in mine for p in taken[i][2][name]], dtype=torch.int64)
            for i, view in zip(mine, torch.split(flat, [len(taken[i][2][name]) for i in mine])):
                views[i][name] = view
        self._wake.set()
        return [LeanHandle(future, v) for (_, future, _, _), v in zip(taken, views)]

    def free_host(self, pages: Mapping[str, torch.Tensor]) -> None:
        for name, idx in pages.items():
            a = idx.tolist()
            writer = self._writer[name]
            if any(writer[p] for p in a):
                raise ValueError(f"pool {name!r}: a page is still being written")
            self._free[name].extend(a)

    def _signal(self, layer: int) -> None:
        self._layers_signalled += 1

    async def _batcher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                n = min(len(self._queue), self._max_batch)
                batch = [self._queue.popleft() for _ in range(n)]
                self._space.set()
                if self._worker is not None and self._copy is not None:  # the batch's rows, copied off the loop
                    slots: dict[str, list[int]] = {}
                    to: dict[str, list[int]] = {}
                    for _, _, pages, asked in batch:
                        for name, taken in pages.items():
                            slots.setdefault(name, []).extend(asked[name])
                            to.setdefault(name, []).extend(taken)
                    await self._worker.run(self._copy, slots, to)
                for layer in range(self._num_layers):  # the executor: every layer lands
                    self._signal(layer)
                for _, future, pages, _ in batch:
                    for name, done in pages.items():
                        writer = self._writer[name]
                        for p in done:
                            writer[p] = 0
                    future.set_result(None)
                await asyncio.sleep(0)


async def lean_cost(
    kvtier_run: Callable[[str, list[dict[str, torch.Tensor]]], Awaitable[float]], *, ops: int, reps: int,
    num_layers: int, pool: str = "kv", row_bytes: int = 64,
) -> dict[str, Any]:
    """Loop-thread CPU per operation of `LeanScheduler` against kvtier's, one-page
    backups, the single path (an awaited ``backup`` each) and the bulk path (one
    ``backup_many``), from the first submission until every result is awaited
    and its ``host_indices`` read, in alternating repetitions.

    ``kvtier_run(path, requests)`` runs the same requests through kvtier's
    scheduler (the executor that copies nothing) and returns the loop CPU
    seconds it took; the ratio is kvtier's median over the lean median. Also
    the lean scheduler's lone backup (`LONE_OPS` of them, each submitted,
    awaited and read before the next), the same with its copy of
    ``row_bytes`` per slot and layer in a `WorkerThread` (`_lone_copying`),
    and one empty round trip to a `WorkerThread`: the floors under kvtier's
    lone row."""
    requests = [{pool: idx} for idx in torch.split(torch.arange(ops), 1)]

    async def lean_single(sched: LeanScheduler) -> list[torch.Tensor]:
        handles = [await sched.backup(r) for r in requests]
        for h in handles:
            await h
        return [h.host_indices[pool] for h in handles]

    async def lean_bulk(sched: LeanScheduler) -> list[torch.Tensor]:
        handles = await sched.backup_many(requests)
        for h in handles:
            await h
        return [h.host_indices[pool] for h in handles]

    paths = {"single": lean_single, "bulk": lean_bulk}
    out: dict[str, Any] = {"operations": ops}
    async with LeanScheduler({pool: (ops, 2 * ops)}, num_layers=num_layers, max_queued=max(ops, 4096),
                             max_batch=max(ops, 4096)) as lean:

        async def timed(path: str) -> float:
            c0 = time.thread_time()
            got = await paths[path](lean)
            c1 = time.thread_time()
            lean.free_host({pool: torch.cat(got)})
            return c1 - c0

        for path in paths:  # warm-up, both sides
            await timed(path)
            await kvtier_run(path, requests)
        for path in paths:
            mine: list[float] = []
            theirs: list[float] = []
            for rep in range(max(reps, 3)):
                if rep % 2 == 0:
                    mine.append(await timed(path))
                    theirs.append(await kvtier_run(path, requests))
                else:
                    theirs.append(await kvtier_run(path, requests))
                    mine.append(await timed(path))
            lean_us = statistics.median(mine) / ops * 1e6
            kvtier_us = statistics.median(theirs) / ops * 1e6
            out[path] = {"lean_loop_cpu_us": lean_us, "kvtier_loop_cpu_us": kvtier_us, "ratio": kvtier_us / lean_us}
        out["lone_loop_cpu_us"] = median_range(await _lone_us(lean, requests[:LONE_OPS], pool))
    out["lone_copying_loop_cpu_us"] = await _lone_copying(requests, num_layers, pool, row_bytes)
    out["hop_loop_cpu_us"] = await hop_cost(max(reps, 3) * 32)
    return out


async def _lone_copying(
    requests: list[dict[str, torch.Tensor]], num_layers: int, pool: str, row_bytes: int
) -> dict[str, float]:
    """The lean scheduler's lone backup with its copy in a worker thread, as
    kvtier's lone row runs with `CpuExecutor`: ``row_bytes`` per slot and
    layer, one ``index_select`` and one ``index_copy_`` per batch in the
    thread. Loop CPU per backup, submitted, awaited and its host indices
    read (after one untimed backup that starts the thread)."""
    ops = len(requests)
    device = torch.zeros(ops, num_layers, row_bytes, dtype=torch.uint8)
    host = torch.zeros(2 * ops, num_layers, row_bytes, dtype=torch.uint8)

    def copy(slots: dict[str, list[int]], pages: dict[str, list[int]]) -> None:
        host.index_copy_(0, torch.tensor(pages[pool]), device.index_select(0, torch.tensor(slots[pool])))

    async with LeanScheduler({pool: (ops, 2 * ops)}, num_layers=num_layers, copy=copy) as lean:
        await _lone_us(lean, requests[:1], pool)
        return median_range(await _lone_us(lean, requests[1:LONE_OPS + 1], pool))


async def _lone_us(lean: LeanScheduler, requests: list[dict[str, torch.Tensor]], pool: str) -> list[float]:
    """Loop CPU (us) of each of ``requests`` backed up alone, as the bench's
    lone row times kvtier's: submitted, awaited and its host_indices read
    before the next (its pages freed after the timing)."""
    cpu = []
    for r in requests:
        c0 = time.thread_time()
        h = await lean.backup(r)
        await h
        got = h.host_indices[pool]
        cpu.append((time.thread_time() - c0) * 1e6)
        lean.free_host({pool: got})
    return cpu


async def hop_cost(n: int) -> dict[str, float]:
    """The floor under a lone copying operation: loop-thread CPU of one round
    trip to a `WorkerThread` that runs nothing (a queue put out, a
    ``call_soon_threadsafe`` back, the loop's wake-up between), median and
    range over ``n`` trips."""
    worker = WorkerThread("kvtier-bench-hop", idle_s=1.0)
    await worker.run(int)  # the thread started
    cpu = []
    for _ in range(n):
        c0 = time.thread_time()
        await worker.run(int)
        cpu.append((time.thread_time() - c0) * 1e6)
    return median_range(cpu)
