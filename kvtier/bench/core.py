"""``python -m kvtier bench``: kvtier against the raw copy, in one process.

Every scenario runs next to its baselines on the same tensors and indices, in
alternating repetitions (A B C, C B A, ...), so drift on a shared machine hits
all of them alike:

* throughput, one operation: the realistic shape (32 layers, 8 KV heads, head
  dim 128, bf16, K and V), for each device allocation (``stacked``: one
  ``[layers, slots, ...]`` tensor per plane whose layer slices the engine
  passes, as some engines allocate; ``per_layer``: a separate ``[2, slots,
  ...]`` K/V tensor per layer, as most engines allocate), host layout, page
  size (1, 16, 64) and pattern (contiguous or scattered device pages): the
  contiguous reference (one contiguous ``copy_`` of the same bytes between
  buffers of its own; ``ceiling`` in the JSON, though not a bound: runs that
  fit the cache copy tensors the previous runs left there, and the raw
  methods can beat it), the raw best (the
  fastest of the hand-written copies in `kvtier.bench.copies` that apply to
  those tensors, chosen in a selection round; the winner is named) and kvtier
  moving the pages as one operation;
* throughput, many operations: the same pages as N one-page operations
  submitted concurrently (N = 10,000; fewer in ``--quick``), at the realistic
  shape (a one-page operation of page size 1 moves 128 KiB), on three paths:
  single (a ``backup``/``load`` call each), bulk (one ``backup_many`` /
  ``load_many`` call) and array-native (one ``backup_arrays`` /
  ``load_arrays`` call of a ``[operations, slots]`` array, one result read);
  page sizes whose N pages do not fit the memory budget
  at that shape are left out (and named), except page size 1, which a budget
  too small for it (``--tiny``) runs on a scaled-down shape;
* latency of a one-page load under a backup burst of hundreds of MiB, against
  the same load on an idle scheduler;
* event-loop lag during every kvtier run (a ticker on the loop), with the lag
  during the baselines and on an idle loop as references, and the garbage
  collections that ran meanwhile; every callback the loop runs is timed
  too, and the longest of kvtier's own is named;
* scheduler overhead per operation, with an executor that copies nothing and
  with `CpuExecutor`: backups and loads, single and bulk path;
* scaling: 10k / 50k / 100k one-page operations queued at once, single and
  bulk path: time and resident memory per operation, and once more with the
  heap frozen (``gc.freeze()``); `PageAllocator`'s cost per page at 10k and
  1M pages;
* the storage tier (`kvtier.bench.storage`): host pages to Redis and to
  files and back, through the scheduler (``write_storage``, ``prefetch``),
  through the store alone, and through raw client code on the same bytes
  (with and without the host <-> bytes copy). Needs redis-py and a
  redis-server (or ``--redis-url``) for its Redis part, which otherwise says
  why it was skipped; a ``--redis-url`` that does not answer is refused before
  anything runs (exit 2); ``--no-storage`` leaves the section out.

It ends with PASS/FAIL against its targets. Baselines run in a
worker thread as kvtier's copies do, with the same torch thread count
(``--torch-threads``, default 1, kvtier's default) and with the ticker running,
so that neither side pays for the measurement alone. ``--json PATH`` writes
every figure, ``--plot PATH`` draws throughput against page size (needs
matplotlib: ``pip install 'kvtier[plot]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import torch

from kvtier.bench.copies import RAW_METHODS, Ceiling, RowCopy, Side, raw_methods_for
from kvtier.bench.measures import (
    CallbackRecord,
    CallbackStats,
    LoopLagMonitor,
    NoCopyExecutor,
    callback_summary,
    describe_callback,
    gc_summary,
    lag_summary,
    longest_collection,
    percentile,
    ratio_of,
    summarize_latencies,
    summarize_times,
)
from kvtier.bench.settings import MODES, REALISTIC, TINY, Settings, Shape, fit_shape, many_ops_shapes
from kvtier.pools import DevicePool, HostPool, PageAllocator, PoolGroup
from kvtier.scheduler import OperationHandle, SchedulerConfig, TransferScheduler
from kvtier.transfers import CopyExecutor, CpuExecutor, Direction, PoolCopy, process_calibrator

__all__ = [
    "DEVICES",
    "MODES",
    "REALISTIC",
    "TINY",
    "Bench",
    "CallbackRecord",
    "CallbackStats",
    "LoopLagMonitor",
    "NoCopyExecutor",
    "Pools",
    "Settings",
    "Shape",
    "allocator_costs",
    "alternate",
    "build_pools",
    "callback_summary",
    "describe_callback",
    "device_indices",
    "fit_shape",
    "gc_summary",
    "kvtier_backup",
    "kvtier_backup_bulk",
    "kvtier_load",
    "kvtier_load_bulk",
    "longest_collection",
    "main",
    "many_ops_shapes",
    "page_slots",
    "parse_args",
    "percentile",
    "release",
    "rss_bytes",
    "run_bench",
    "summarize_latencies",
    "summarize_times",
    "torch_calls",
    "trim_heap",
]

POOL = "kv"
# Device pages per moved page: room to scatter the moved pages in.
DEVICE_SPARE = 1.5
# A raw method this many times slower than the fastest in the selection round
# does not go on to the repetitions (see `Bench.select_raw`).
FINALIST_WITHIN = 1.5


DEVICES = ("stacked", "per_layer")
SCALING_PATHS = ("single", "bulk", "arrays")


@dataclass(eq=False)
class Pools:
    """One ``kv`` pool: the engine's device tensors and kvtier's host pool."""

    group: PoolGroup
    host: HostPool
    device: Side
    host_side: Side
    shape: Shape
    page_size: int
    device_kind: str = "stacked"


def build_pools(
    shape: Shape, page_size: int, layout: str, device_slots: int, host_slots: int, device: str = "stacked"
) -> Pools:
    """The engine's device K and V, allocated as ``device`` says, and kvtier's
    host pool:

    * ``stacked``: one ``[layers, slots, heads, head_dim]`` buffer per plane,
      each layer a view (`DevicePool.stacked` finds them one storage);
    * ``per_layer``: one ``[2, slots, heads, head_dim]`` tensor per layer, K
      and V its two views (vLLM's layout): no copy can span the layers.

    Every byte is touched here, so no timed run pays for first-touch page faults."""
    if device not in DEVICES:
        raise ValueError(f"device allocation must be one of {DEVICES}; got {device!r}")
    row = (shape.heads, shape.head_dim)
    if device == "stacked":
        planes = tuple(
            torch.empty((shape.layers, device_slots, *row), dtype=shape.dtype).fill_(1) for _ in range(2)
        )
        layers = [[planes[0][j], planes[1][j]] for j in range(shape.layers)]
        device_side = Side(planes, "layer_first")
    else:
        kv = [torch.empty((2, device_slots, *row), dtype=shape.dtype).fill_(1) for _ in range(shape.layers)]
        layers = [[t[0], t[1]] for t in kv]
        device_side = Side.per_layer(tuple(tuple(t[p] for t in kv) for p in range(2)))
    pool = DevicePool(layers)
    group = PoolGroup()
    host = group.add_pool(
        POOL, device=pool, page_size=page_size, host_slots=host_slots, layout=layout  # type: ignore[arg-type]
    )
    for p in range(2):
        host.buffer(p).zero_()
    return Pools(
        group, host, device_side, Side((host.buffer(0), host.buffer(1)), layout), shape, page_size, device
    )


def page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def device_indices(pattern: str, pages: int, device_pages: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """Slots of ``pages`` device pages: the first ones in order, or a random
    subset of ``device_pages`` in random order (nothing left to coalesce)."""
    if pattern == "contiguous":
        chosen = torch.arange(pages)
    else:
        chosen = torch.randperm(device_pages, generator=gen)[:pages]
    return page_slots(chosen, page_size)


async def kvtier_backup(
    sched: TransferScheduler, parts: Sequence[torch.Tensor], checkpoint_every: int
) -> tuple[float, list[OperationHandle]]:
    """Back up ``parts`` (one operation each), all submitted before any is
    awaited, yielding to the loop every ``checkpoint_every`` submissions as a
    serving loop would between requests. Returns the wall time from the first
    submission until every handle is awaited and its ``host_indices`` read (an
    engine must read them), and the handles (see `release`)."""
    t0 = time.perf_counter()
    handles = []
    for i, idx in enumerate(parts, 1):
        handles.append(await sched.backup({POOL: idx}))
        if i % checkpoint_every == 0:
            await asyncio.sleep(0)
    for h in handles:
        await h
    for h in handles:
        h.host_indices[POOL]
    return time.perf_counter() - t0, handles


def release(sched: TransferScheduler, handles: Sequence[OperationHandle]) -> torch.Tensor:
    """Free the host slots of finished backups; return them, in order."""
    host = torch.cat([h.host_indices[POOL] for h in handles])
    sched.free_host({POOL: host})
    return host


async def kvtier_load(
    sched: TransferScheduler, host_parts: Sequence[torch.Tensor], dev_parts: Sequence[torch.Tensor],
    checkpoint_every: int,
) -> float:
    """Load ``host_parts`` into ``dev_parts`` (one operation per pair); see `kvtier_backup`."""
    t0 = time.perf_counter()
    handles = []
    for i, (h_idx, d_idx) in enumerate(zip(host_parts, dev_parts), 1):
        handles.append(await sched.load({POOL: h_idx}, {POOL: d_idx}))
        if i % checkpoint_every == 0:
            await asyncio.sleep(0)
    for h in handles:
        await h
    return time.perf_counter() - t0


async def kvtier_backup_bulk(
    sched: TransferScheduler, parts: Sequence[torch.Tensor], max_requests: int
) -> tuple[float, list[OperationHandle]]:
    """Back up ``parts`` (one operation each) through `backup_many`, in calls
    of at most ``max_requests`` (the lane's bound, ``max_queued_ops``). Returns
    what `kvtier_backup` does."""
    t0 = time.perf_counter()
    handles: list[OperationHandle] = []
    for i in range(0, len(parts), max_requests):
        handles += await sched.backup_many([{POOL: idx} for idx in parts[i : i + max_requests]])
    for h in handles:
        await h
    for h in handles:
        h.host_indices[POOL]
    return time.perf_counter() - t0, handles


async def kvtier_load_bulk(
    sched: TransferScheduler, host_parts: Sequence[torch.Tensor], dev_parts: Sequence[torch.Tensor],
    max_requests: int,
) -> float:
    """Load ``host_parts`` into ``dev_parts`` through `load_many`; see `kvtier_backup_bulk`."""
    t0 = time.perf_counter()
    handles: list[OperationHandle] = []
    for i in range(0, len(host_parts), max_requests):
        handles += await sched.load_many([{POOL: h} for h in host_parts[i : i + max_requests]],
                                         [{POOL: d} for d in dev_parts[i : i + max_requests]])
    for h in handles:
        await h
    return time.perf_counter() - t0


async def kvtier_backup_arrays(
    sched: TransferScheduler, slots: np.ndarray, max_requests: int
) -> tuple[float, torch.Tensor]:
    """Back up the rows of ``slots`` (``[operations, slots]``, one operation
    each) through `backup_arrays`, in calls of at most ``max_requests``, each
    awaited once and its host indices read. Returns the wall time and the host
    slots, in order (`free_host` them)."""
    t0 = time.perf_counter()
    hosts = []
    for i in range(0, len(slots), max_requests):
        result = await (await sched.backup_arrays({POOL: slots[i : i + max_requests]}))
        if not result.all_ok:
            raise RuntimeError(f"backup_arrays: {len(result.errors)} requests failed, e.g. {next(iter(result.errors.values()))!r}")
        hosts.append(result.host_indices[POOL])
    return time.perf_counter() - t0, torch.cat(hosts)


async def kvtier_load_arrays(
    sched: TransferScheduler, host_slots: np.ndarray, dev_slots: np.ndarray, max_requests: int
) -> float:
    """Load the rows of ``host_slots`` into those of ``dev_slots`` (one
    operation per row) through `load_arrays`; see `kvtier_backup_arrays`."""
    t0 = time.perf_counter()
    for i in range(0, len(host_slots), max_requests):
        result = await (await sched.load_arrays({POOL: host_slots[i : i + max_requests]},
                                                device_indices={POOL: dev_slots[i : i + max_requests]}))
        if not result.all_ok:
            raise RuntimeError(f"load_arrays: {len(result.errors)} requests failed, e.g. {next(iter(result.errors.values()))!r}")
    return time.perf_counter() - t0


def torch_calls(method: str, copy: RowCopy) -> int:
    """A lower bound of the torch calls (slices, views, copies, stacks) the raw
    method ``method`` of `kvtier.bench.copies` makes for ``copy``: per run,
    layer and plane two slices and a ``copy_`` (``slices``); per run and plane
    two views and a ``copy_`` (``slices_all_layers``) or a slice per layer and
    a ``stack`` (``stack_all_layers``); per layer and plane or per plane at
    least two (the gathers)."""
    layers, planes, runs = copy.src.num_layers, copy.src.num_planes, len(copy.runs)
    return {
        "slices": 3 * runs * layers * planes,
        "slices_all_layers": 3 * runs * planes,
        "stack_all_layers": runs * planes * (layers + 1),
        "index_per_layer": 2 * layers * planes,
    }.get(method, 2 * planes)


def rss_bytes() -> int | None:
    """This process's resident memory now (``/proc/self/statm``); None where
    there is no ``/proc``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def trim_heap() -> None:
    """Collect garbage and hand the C heap's free pages back to the system
    (glibc's ``malloc_trim``), so that a resident-memory delta measured next
    counts memory taken, not memory reused. A no-op without glibc."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


Runner = Callable[[], Awaitable[float]]


def _time_in_thread(fn: Callable[[], None], torch_threads: int) -> float:
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


async def alternate(variants: Sequence[tuple[str, Runner]], reps: int) -> dict[str, list[float]]:
    """Run every variant once per repetition, the order reversed on odd ones
    (A B C, C B A, ...), so a drift of the machine hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for r in range(reps):
        order = variants if r % 2 == 0 else list(reversed(variants))
        for name, run in order:
            times[name].append(await run())
    return times


@dataclass(eq=False)
class Bench:
    """The state of one benchmark run."""

    settings: Settings
    monitor: LoopLagMonitor
    log: Callable[[str], None]
    _ceiling: Ceiling | None = field(default=None, init=False)
    _call_floor: float | None = field(default=None, init=False)

    def executor(self) -> CpuExecutor:
        return CpuExecutor(torch_threads=self.settings.torch_threads)

    def threaded(
        self, fn: Callable[[], None], label: str, executor: CpuExecutor | None = None,
        from_loop: list[float] | None = None,
    ) -> Runner:
        """A baseline run in a worker thread, as kvtier's copies are, with the
        loop free and the ticker running: the ticker's cost to the copying
        thread (measurable on a loaded 2-core machine) is then the same for
        baselines and kvtier, and the lag it records is a reference for
        kvtier's. The time is taken inside the thread: the copy alone. With
        ``from_loop``, each run's wall time on the loop, from handing the copy
        to the thread until the loop has its answer, is appended to it too:
        what an engine running the same copy off its loop itself would wait.

        With ``executor``, the thread is that executor's own copy thread
        (`CpuExecutor.run_in_worker`), so baselines and kvtier's copies run on
        the same OS thread (two threads can sit on differently loaded cores
        for a while, which on a busy machine showed as one side copying 2-3x
        slower); without, anyio's worker thread."""

        async def run() -> float:
            with self.monitor.recording(label):
                t0 = time.perf_counter()
                if executor is not None:
                    seconds = await executor.run_in_worker(_time_in_thread, fn, self.settings.torch_threads)
                else:
                    seconds = await anyio.to_thread.run_sync(_time_in_thread, fn, self.settings.torch_threads)
                if from_loop is not None:
                    from_loop.append(time.perf_counter() - t0)
                return seconds

        return run

    async def select_raw(
        self, copy: RowCopy, executor: CpuExecutor | None = None
    ) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """Time every raw method that applies (alternating); return their
        figures and the two fastest, which go on to the measured repetitions.

        Two shortcuts, both sound: a method whose torch calls alone (a lower
        bound, `torch_calls` times the cost of the cheapest call, measured
        once) would take over `FINALIST_WITHIN` times the fastest method so far
        is not run (the methods run fewest calls first); its figure says
        ``skipped`` and why. And a runner-up over `FINALIST_WITHIN` times
        slower than the fastest does not go on to the repetitions. On scattered
        one-page rows a copy per row is 10-40x slower than a gather, and timing
        it cost seconds a scenario."""
        copy.prepare()
        floor = await self.call_floor()
        methods = sorted(raw_methods_for(copy).items(), key=lambda kv: torch_calls(kv[0], copy))
        times: dict[str, list[float]] = {}
        figures: dict[str, dict[str, Any]] = {}
        for name, fn in methods:
            bound = torch_calls(name, copy) * floor
            fastest = min((min(t) for t in times.values()), default=math.inf)
            if bound > FINALIST_WITHIN * fastest:
                figures[name] = {"skipped": f"{torch_calls(name, copy):,} torch calls take at least "
                                            f"{bound * 1e3:.1f} ms, over {FINALIST_WITHIN} x the fastest "
                                            f"({fastest * 1e3:.1f} ms)"}
                continue
            times[name] = [await self.threaded(partial(fn, copy), "raw", executor)()]
        rounds = self.settings.selection_rounds - 1
        if rounds > 0:
            more = await alternate([(name, self.threaded(partial(fn, copy), "raw", executor)) for name, fn in methods
                                    if name in times], rounds)
            for name, t in more.items():
                times[name] += t
        figures |= {name: summarize_times(t, copy.nbytes) for name, t in times.items()}
        ranked = sorted(times, key=lambda name: min(times[name]))
        fastest = min(times[ranked[0]])
        return figures, [name for name in ranked[:2] if min(times[name]) <= FINALIST_WITHIN * fastest]

    async def call_floor(self) -> float:
        """The cost of the cheapest torch call (a slice of a small tensor), in
        the worker thread the raw methods run in: the fastest of five rounds."""
        if self._call_floor is None:
            def measure() -> float:
                t = torch.zeros(4096)
                best = math.inf
                for _ in range(5):
                    t0 = time.perf_counter()
                    for i in range(1000):
                        t[i : i + 1]
                    best = min(best, (time.perf_counter() - t0) / 1000)
                return best

            self._call_floor = await anyio.to_thread.run_sync(measure)
        return self._call_floor

    def ceiling(self, nbytes: int) -> Ceiling:
        """The ceiling copy of ``nbytes``, kept for the next scenario of the
        same size (filling its two buffers costs more than a scenario's copies)."""
        if self._ceiling is None or self._ceiling.nbytes != nbytes:
            self._ceiling = None
            self._ceiling = Ceiling(nbytes)
        return self._ceiling

    async def throughput(self, group_name: str) -> list[dict[str, Any]]:
        s = self.settings
        out = []
        directions = s.one_op_directions if group_name == "one_op" else s.many_ops_directions
        if group_name == "one_op":
            shapes = [(ps, REALISTIC) for ps in s.page_sizes]
        else:
            shapes = many_ops_shapes(s)[0]
        for device in s.devices if group_name == "one_op" else s.many_devices:
            # The same scattered pages for every device allocation.
            gen = torch.Generator().manual_seed(s.seed)
            for layout in s.layouts:
                for ps, shape in shapes:
                    if group_name == "one_op":
                        pages = max(1, s.one_op_bytes // (ps * shape.slot_nbytes))
                    else:
                        pages = s.many_ops
                    device_pages = math.ceil(pages * DEVICE_SPARE)
                    pools = build_pools(shape, ps, layout, device_slots=device_pages * ps, host_slots=pages * ps,
                                        device=device)
                    ceiling = self.ceiling(pages * ps * shape.slot_nbytes)
                    executor = self.executor()
                    async with TransferScheduler(pools.group, executor) as sched:
                        for pattern in s.patterns:
                            dev_idx = device_indices(pattern, pages, device_pages, ps, gen)
                            for direction in directions:
                                r = await self.throughput_scenario(
                                    sched, executor, pools, ceiling, group_name, pattern, direction, dev_idx, pages
                                )
                                out.append(r)
                                self.log(_progress_line(r))
                    del pools, ceiling  # freed now: a pool and its scheduler hold no reference cycle
                # A full collection costs 0.1-0.3 s with torch loaded: one per
                # layout, not per pool, keeps the collector's state fresh.
                gc.collect()
        self._ceiling = None
        return out

    async def throughput_scenario(
        self, sched: TransferScheduler, executor: CpuExecutor, pools: Pools, ceiling: Ceiling, group_name: str,
        pattern: str, direction: str, dev_idx: torch.Tensor, pages: int,
    ) -> dict[str, Any]:
        s = self.settings
        ps = pools.page_size
        many = group_name == "many_ops"
        label = f"{group_name}:{direction}:{pools.device_kind}:{pools.host.layout}:{ps}:{pattern}"
        dev_parts = list(torch.split(dev_idx, ps)) if many else []
        max_requests = sched.config.max_queued_ops
        stable = True
        kv_names = ("kvtier_one", "kvtier_many", "kvtier_bulk", "kvtier_arrays") if many else ("kvtier_one",)
        # The same operations as one [operations, slots] array (the array-native path).
        dev_rows = dev_idx.numpy().reshape(-1, ps) if many else None
        # Seconds the executor's worker spent per kvtier run (planning and
        # copying, without the hand-offs between the loop and the thread), and
        # the batches each run took.
        worker: dict[str, list[float]] = {name: [] for name in kv_names}
        batches: dict[str, list[int]] = {name: [] for name in kv_names}

        def counted(name: str, run: Runner) -> Runner:
            async def timed() -> float:
                before = executor.statistics().worker_seconds
                batches_before = _batches(sched, direction)
                seconds = await run()
                worker[name].append(executor.statistics().worker_seconds - before)
                batches[name].append(_batches(sched, direction) - batches_before)
                return seconds

            return timed

        runs: dict[str, Runner] = {}
        if direction == "backup":
            host_idx = release(sched, (await kvtier_backup(sched, [dev_idx], s.checkpoint_every))[1])  # warm-up
            copy = RowCopy(pools.device, pools.host_side, dev_idx, host_idx)

            def backups(name: str, submit: Callable[[], Awaitable[tuple[float, list[OperationHandle]]]]) -> Runner:
                async def run() -> float:
                    nonlocal stable
                    with self.monitor.recording(f"{label}:{name}"):
                        seconds, handles = await submit()
                    stable = stable and torch.equal(release(sched, handles), host_idx)
                    return seconds

                return run

            runs["kvtier_one"] = backups("kvtier_one", lambda: kvtier_backup(sched, [dev_idx], s.checkpoint_every))
            if many:
                runs["kvtier_many"] = backups(
                    "kvtier_many", lambda: kvtier_backup(sched, dev_parts, s.checkpoint_every))
                runs["kvtier_bulk"] = backups("kvtier_bulk", lambda: kvtier_backup_bulk(sched, dev_parts, max_requests))
                assert dev_rows is not None

                async def arrays_run() -> float:
                    nonlocal stable
                    with self.monitor.recording(f"{label}:kvtier_arrays"):
                        seconds, got = await kvtier_backup_arrays(sched, dev_rows, max_requests)
                    sched.free_host({POOL: got})
                    stable = stable and torch.equal(got, host_idx)
                    return seconds

                runs["kvtier_arrays"] = arrays_run
            held = None
        else:
            first = await sched.backup({POOL: dev_idx})
            await first
            host_idx = first.host_indices[POOL]
            held = host_idx
            copy = RowCopy(pools.host_side, pools.device, host_idx, dev_idx)
            host_parts = list(torch.split(host_idx, ps)) if many else []

            def loads(name: str, submit: Callable[[], Awaitable[float]]) -> Runner:
                async def run() -> float:
                    with self.monitor.recording(f"{label}:{name}"):
                        return await submit()

                return run

            runs["kvtier_one"] = loads(
                "kvtier_one", lambda: kvtier_load(sched, [host_idx], [dev_idx], s.checkpoint_every))
            if many:
                runs["kvtier_many"] = loads(
                    "kvtier_many", lambda: kvtier_load(sched, host_parts, dev_parts, s.checkpoint_every))
                runs["kvtier_bulk"] = loads(
                    "kvtier_bulk", lambda: kvtier_load_bulk(sched, host_parts, dev_parts, max_requests))
                assert dev_rows is not None
                host_rows = host_idx.numpy().reshape(-1, ps)
                runs["kvtier_arrays"] = loads(
                    "kvtier_arrays", lambda: kvtier_load_arrays(sched, host_rows, dev_rows, max_requests))
        for name in kv_names:
            if name != "kvtier_one" or direction == "load":  # a backup's first run above was its warm-up
                await runs[name]()

        selection, finalists = await self.select_raw(copy, executor)
        variants: list[tuple[str, Runner]] = [("ceiling", self.threaded(ceiling, "raw", executor))]
        # Each raw finalist's wall time on the loop too (the hand-off to the
        # copy thread and back included): the floor for any copy kept off the loop.
        from_loop: dict[str, list[float]] = {name: [] for name in finalists}
        variants += [(f"raw:{name}", self.threaded(partial(RAW_METHODS[name], copy), "raw", executor,
                                                   from_loop[name]))
                     for name in finalists]
        variants += [(name, counted(name, runs[name])) for name in kv_names]
        times = await alternate(variants, s.reps)
        for name, seconds in worker.items():
            times[f"{name}_worker"] = seconds
        for name, seconds in from_loop.items():
            times[f"raw:{name}_from_loop"] = seconds
        if held is not None:
            sched.free_host({POOL: held})

        nbytes = copy.nbytes
        # kvtier's choice for these rows as one operation, as its executor plans it.
        copy_direction = Direction.BACKUP if direction == "backup" else Direction.LOAD
        device_pool = pools.group[POOL].device
        assert device_pool is not None
        kvtier_method = process_calibrator().label(
            PoolCopy(POOL, pools.host, device_pool, copy_direction, copy.src_idx, copy.dst_idx,
                     sched.config.min_run_bytes))
        figures = {name: summarize_times(t, nbytes) for name, t in times.items()}
        best = min(finalists, key=lambda name: figures[f"raw:{name}"]["median_s"])
        raw_key = f"raw:{best}"
        ratios = {
            "raw_best_vs_ceiling": ratio_of(times, "ceiling", raw_key),
            "kvtier_one_vs_raw_best": ratio_of(times, raw_key, "kvtier_one"),
            "kvtier_one_vs_ceiling": ratio_of(times, "ceiling", "kvtier_one"),
            # The copy path alone: the executor's worker time against the raw copy.
            "kvtier_one_worker_vs_raw_best": ratio_of(times, raw_key, "kvtier_one_worker"),
            # The raw copy as an engine would wait for it off its loop, against
            # the copy alone: what the two hand-offs cost, with no scheduler.
            "raw_best_from_loop_vs_raw_best": ratio_of(times, raw_key, f"{raw_key}_from_loop"),
            "kvtier_one_vs_raw_best_from_loop": ratio_of(times, f"{raw_key}_from_loop", "kvtier_one"),
        }
        if many:
            for name in ("kvtier_many", "kvtier_bulk", "kvtier_arrays"):
                ratios[f"{name}_vs_raw_best"] = ratio_of(times, raw_key, name)
                ratios[f"{name}_vs_kvtier_one"] = ratio_of(times, "kvtier_one", name)
                ratios[f"{name}_worker_vs_raw_best"] = ratio_of(times, raw_key, f"{name}_worker")
            ratios["kvtier_bulk_vs_kvtier_many"] = ratio_of(times, "kvtier_many", "kvtier_bulk")
        lag = [x for name in kv_names for x in self.monitor.samples.get(f"{label}:{name}", [])]
        return {
            "group": group_name,
            "direction": direction,
            "device": pools.device_kind,
            "layout": pools.host.layout,
            "page_size": ps,
            "pattern": pattern,
            "shape": asdict(pools.shape) | {"label": pools.shape.label, "slot_nbytes": pools.shape.slot_nbytes},
            "pages": pages,
            "rows": copy.rows,
            "runs": len(copy.runs),
            "nbytes": nbytes,
            "operations": {"kvtier_one": 1} | (
                {"kvtier_many": len(dev_parts), "kvtier_bulk": len(dev_parts), "kvtier_arrays": len(dev_parts)}
                if many else {}),
            "bulk_calls": -(-len(dev_parts) // max_requests) if many else None,
            "kvtier_many_batches_per_run": statistics.mean(batches["kvtier_many"]) if many else None,
            "kvtier_bulk_batches_per_run": statistics.mean(batches["kvtier_bulk"]) if many else None,
            "kvtier_arrays_batches_per_run": statistics.mean(batches["kvtier_arrays"]) if many else None,
            "variants": figures,
            "raw_selection": selection,
            "raw_best_method": best,
            "raw_finalists": finalists,
            "kvtier_method": kvtier_method,
            "ratios": ratios,
            "host_indices_stable": stable,
            "loop_lag": lag_summary(lag),
        }

    async def burst(self) -> dict[str, Any]:
        """A one-page load's latency, on an idle scheduler and while a backup
        burst is in flight, alternating idle and burst blocks."""
        s = self.settings
        shape, ps = REALISTIC, s.burst_page_size
        page_bytes = ps * shape.slot_nbytes
        burst_pages = max(s.burst_op_pages, s.burst_bytes // page_bytes)
        burst_pages -= burst_pages % s.burst_op_pages
        pools = build_pools(shape, ps, "page_first", device_slots=(burst_pages + 2) * ps,
                            host_slots=(burst_pages + 1) * ps)
        config = SchedulerConfig()
        burst_parts = list(torch.split(page_slots(torch.arange(burst_pages), ps), s.burst_op_pages * ps))
        probe_dev = page_slots(torch.tensor([burst_pages]), ps)
        target_dev = page_slots(torch.tensor([burst_pages + 1]), ps)
        idle: list[float] = []
        under: list[float] = []
        arrivals = random.Random(s.seed)
        batch_copy: list[float] = []
        bursts = 0
        async with TransferScheduler(pools.group, self.executor(), config) as sched:
            held = await sched.backup({POOL: probe_dev})
            await held
            probe_host = held.host_indices[POOL]

            async def one_load() -> float:
                t0 = time.perf_counter()
                h = await sched.load({POOL: probe_host}, {POOL: target_dev})
                await h
                return time.perf_counter() - t0

            for _ in range(3):
                await one_load()
            per_block = max(1, s.latency_samples // max(1, s.reps))
            while len(under) < s.latency_samples or len(idle) < s.latency_samples:
                with self.monitor.recording("burst:idle"):
                    for _ in range(per_block):
                        idle.append(await one_load())
                        await asyncio.sleep(0.001)
                with self.monitor.recording("burst:burst"):
                    bursts += 1
                    handles = [await sched.backup({POOL: idx}) for idx in burst_parts]
                    await asyncio.sleep(0)  # let the first batch start
                    while not all(h.done() for h in handles):
                        # A random arrival time: back to back, every load would
                        # arrive just as the next batch starts.
                        await asyncio.sleep(arrivals.uniform(0, 0.01))
                        if all(h.done() for h in handles):
                            break
                        under.append(await one_load())
                    results = [await h for h in handles]
                batch_copy += [r.seconds_copying for r in results]
                sched.free_host({POOL: torch.cat([h.host_indices[POOL] for h in handles])})
            sched.free_host({POOL: probe_host})
        del pools
        gc.collect()
        idle_fig = summarize_latencies(idle)
        under_fig = summarize_latencies(under)
        batch_ms = statistics.median(batch_copy) * 1e3
        batch_p99_ms = percentile(batch_copy, 99) * 1e3
        # p99 against p99: a load waits for what is left of the batch in flight.
        bound = idle_fig["p99_ms"] + batch_p99_ms + 2.0
        return {
            "shape": asdict(shape) | {"label": shape.label},
            "layout": "page_first",
            "page_size": ps,
            "load_nbytes": page_bytes,
            "burst_nbytes": burst_pages * page_bytes,
            "burst_operations": len(burst_parts),
            "bursts": bursts,
            "max_batch_bytes": config.max_batch_bytes,
            "idle": idle_fig,
            "burst": under_fig,
            "batch_copy_ms_median": batch_ms,
            "batch_copy_ms_p99": batch_p99_ms,
            "batch_copy_ms": sorted({round(x * 1e3, 3) for x in batch_copy}),
            "p99_bound_ms": bound,
        }

    async def overhead(self) -> dict[str, Any]:
        """Scheduler time per operation for many tiny one-page operations:
        backups and loads, each submitted one call per operation (single) and
        in one `backup_many` / `load_many` call (bulk), with an executor that
        copies nothing and with `CpuExecutor` (against the raw copy of the
        same rows); and one operation at a time, submit to done."""
        s = self.settings
        n = s.overhead_ops
        dev_idx = torch.arange(n)
        parts = list(torch.split(dev_idx, 1))
        executors: dict[str, CopyExecutor] = {"noop": NoCopyExecutor(), "cpu": self.executor()}
        # Host room for the loads' pages (held throughout) and for the backups'.
        pools = {name: build_pools(TINY, 1, "page_first", device_slots=n, host_slots=2 * n) for name in executors}
        batches: dict[str, list[int]] = {}
        async with AsyncExitStack() as stack:
            scheds = {name: await stack.enter_async_context(TransferScheduler(pools[name].group, ex))
                      for name, ex in executors.items()}
            held: dict[str, torch.Tensor] = {}
            for name, sched in scheds.items():
                h = await sched.backup({POOL: dev_idx})
                await h
                held[name] = h.host_indices[POOL]
            host_parts = {name: list(torch.split(idx, 1)) for name, idx in held.items()}
            cpu = scheds["cpu"]
            backup_host = release(cpu, (await kvtier_backup(cpu, parts, s.checkpoint_every))[1])
            copies = {
                "backup": RowCopy(pools["cpu"].device, pools["cpu"].host_side, dev_idx, backup_host),
                "load": RowCopy(pools["cpu"].host_side, pools["cpu"].device, held["cpu"], dev_idx),
            }
            freeze_setup(s)  # the section's requests (6,000 index tensors) join the frozen heap

            def runner(executor: str, direction: str, path: str) -> Runner:
                sched = scheds[executor]
                label = f"overhead:{executor}:{direction}:{path}"
                max_requests = sched.config.max_queued_ops
                batches[label] = []

                async def run() -> float:
                    before = _batches(sched, direction)
                    with self.monitor.recording(label):
                        if direction == "load":
                            if path == "single":
                                seconds = await kvtier_load(sched, host_parts[executor], parts, s.checkpoint_every)
                            else:
                                seconds = await kvtier_load_bulk(sched, host_parts[executor], parts, max_requests)
                        else:
                            if path == "single":
                                seconds, handles = await kvtier_backup(sched, parts, s.checkpoint_every)
                            else:
                                seconds, handles = await kvtier_backup_bulk(sched, parts, max_requests)
                    if direction == "backup":
                        release(sched, handles)
                    batches[label].append(_batches(sched, direction) - before)
                    return seconds

                return run

            kv = [(f"{e}:{d}:{p}", runner(e, d, p)) for e in executors for d in ("backup", "load")
                  for p in ("single", "bulk")]
            for _, run in kv:
                await run()  # warm-up
            for label in batches:
                batches[label].clear()
            raw: dict[str, dict[str, Any]] = {}
            variants = list(kv)
            for direction, copy in copies.items():
                selection, finalists = await self.select_raw(copy)
                raw[direction] = {"selection": selection, "finalists": finalists}
                variants += [(f"raw:{direction}:{m}", self.threaded(partial(RAW_METHODS[m], copy), "raw"))
                             for m in finalists]
            times = await alternate(variants, s.reps)

            sequential: list[float] = []
            noop = scheds["noop"]
            with self.monitor.recording("overhead:sequential"):
                for i in range(s.sequential_ops):
                    t0 = time.perf_counter()
                    h = await noop.backup({POOL: parts[i % n]})
                    await h
                    sequential.append(time.perf_counter() - t0)
                    noop.free_host({POOL: h.host_indices[POOL]})
            for name, sched in scheds.items():
                sched.free_host({POOL: held[name]})
        del pools
        gc.collect()
        for direction, r in raw.items():
            r["method"] = min(r["finalists"], key=lambda m: statistics.median(times[f"raw:{direction}:{m}"]))
            r["copy_s"] = summarize_times(times[f"raw:{direction}:{r['method']}"], copies[direction].nbytes)
        per_op: dict[str, Any] = {e: {d: {} for d in ("backup", "load")} for e in executors}
        minus_raw: dict[str, Any] = {d: {} for d in ("backup", "load")}
        for name, _ in kv:
            e, d, p = name.split(":")
            per_op[e][d][p] = _range([t / n * 1e6 for t in times[name]])
            if e == "cpu":
                raw_s = raw[d]["copy_s"]["median_s"]
                minus_raw[d][p] = _range([(t - raw_s) / n * 1e6 for t in times[name]])
        return {
            "operations": n,
            "shape": asdict(TINY) | {"label": TINY.label},
            "page_size": 1,
            "max_requests_per_bulk_call": scheds["noop"].config.max_queued_ops,
            "us_per_op": per_op,
            "cpu_minus_raw_us_per_op": minus_raw,
            "raw": raw,
            "batches_per_run": {label.removeprefix("overhead:"): statistics.mean(v) for label, v in batches.items()},
            "sequential_round_trip_us": _range([t * 1e6 for t in sequential]),
            # The names of earlier documents: backups, single path.
            "noop_us_per_op": per_op["noop"]["backup"]["single"],
            "cpu_us_per_op": per_op["cpu"]["backup"]["single"],
            "cpu_minus_raw_copy_us_per_op": minus_raw["backup"]["single"],
            "raw_copy_s": raw["backup"]["copy_s"],
            "raw_best_method": raw["backup"]["method"],
            "noop_batches_per_run": statistics.mean(batches["overhead:noop:backup:single"]),
        }

    async def scaling(self) -> dict[str, Any]:
        """10k / 50k / 100k one-page backups queued at once (`Settings.scaling_counts`),
        with an executor that copies nothing: the single path (every `backup`
        call, then every handle awaited), the bulk path (one `backup_many`)
        and the array-native path (one `backup_arrays` of an ``[n, 1]`` array,
        its result awaited once).
        Each count has its own pool of exactly that many pages, and every lane
        bound holds the largest count, so nothing waits for room. Per run: time
        per operation (first submission to last completion), submission time,
        resident memory per queued operation (read once every operation is
        queued and none has run: the loop was not yielded to), batches and
        collections. Then one more single run with the heap the other way: when
        the whole run is frozen (``--gc-freeze``, the default) one with the
        heap unfrozen (what an engine that never calls ``gc.freeze()`` pays),
        else one frozen (``gc.freeze()``)."""
        s = self.settings
        counts = s.scaling_counts
        config = SchedulerConfig(max_queued_ops=max(counts))
        runs: dict[str, list[dict[str, Any]]] = {}
        async with AsyncExitStack() as stack:
            scheds: dict[int, TransferScheduler] = {}
            requests: dict[int, list[dict[str, torch.Tensor]]] = {}
            slots: dict[int, np.ndarray] = {}
            for n in counts:
                pools = build_pools(TINY, 1, "page_first", device_slots=n, host_slots=n)
                scheds[n] = await stack.enter_async_context(TransferScheduler(pools.group, NoCopyExecutor(), config))
                requests[n] = [{POOL: idx} for idx in torch.split(torch.arange(n), 1)]
                slots[n] = np.arange(n, dtype=np.int64).reshape(n, 1)  # the array-native path's requests
                del pools

            def runner(path: str, n: int, label: str) -> Runner:
                sched = scheds[n]
                ops = requests[n]

                async def run() -> float:
                    trim_heap()
                    rss_before = rss_bytes()
                    batches_before = sched.statistics().backup.batches
                    collections_before = len(self.monitor.collections.get(label, []))
                    with self.monitor.recording(label):
                        t0 = time.perf_counter()
                        handles: Sequence[Any]
                        if path == "single":
                            handles = [await sched.backup(r) for r in ops]
                        elif path == "bulk":
                            handles = await sched.backup_many(ops)
                        else:
                            handles = [await sched.backup_arrays({POOL: slots[n]})]
                        submitted = time.perf_counter()
                        rss_queued = rss_bytes()
                        t1 = time.perf_counter()
                        for h in handles:
                            await h
                        done = time.perf_counter()
                    del handles
                    sched.free_host({POOL: torch.arange(n)})  # every page of the pool is the run's
                    seconds = (submitted - t0) + (done - t1)
                    runs.setdefault(label, []).append({
                        "seconds": seconds,
                        "submit_seconds": submitted - t0,
                        "rss_bytes": None if rss_before is None or rss_queued is None else rss_queued - rss_before,
                        "batches": sched.statistics().backup.batches - batches_before,
                        "collections": len(self.monitor.collections[label]) - collections_before,
                    })
                    return seconds

                return run

            for n, sched in scheds.items():  # warm-up: each scheduler's first batches, every path
                few = requests[n][: min(n, 256)]
                single = [await sched.backup(r) for r in few]
                for h in single:
                    await h
                release(sched, single)
                bulk = await sched.backup_many(few)
                for h in bulk:
                    await h
                release(sched, bulk)
                # The array-native path's first call ran in the timed 10k run before.
                result = await (await sched.backup_arrays({POOL: slots[n][: len(few)]}))
                sched.free_host(result)
            # The section's set-up (300k request objects at 100k) joins the frozen heap, as an engine's
            # own state does after start-up: a collection during the runs walks what kvtier makes.
            freeze_setup(s)
            labels = {(path, n): f"scaling:{path}:{n}" for n in counts for path in SCALING_PATHS}
            await alternate([(label, runner(path, n, label)) for (path, n), label in labels.items()], s.scaling_reps)
            frozen_label = unfrozen_label = None
            n = s.scaling_freeze_count if s.scaling_freeze_count in counts else counts[0]
            if not s.gc_freeze:
                frozen_label = f"scaling:single:{n}:frozen"
                gc.collect()
                gc.freeze()
                try:
                    await runner("single", n, frozen_label)()
                finally:
                    gc.unfreeze()
            else:
                unfrozen_label = f"scaling:single:{n}:unfrozen"
                gc.unfreeze()
                try:
                    await runner("single", n, unfrozen_label)()
                finally:
                    gc.collect()
                    gc.freeze()
        rows = [self._scaling_row(path, n, label, runs[label]) for (path, n), label in labels.items()]
        flat = {}
        for path in SCALING_PATHS:
            per_op = [r["us_per_op"]["median"] for r in rows if r["path"] == path]
            flat[path] = {"max_over_min": max(per_op) / min(per_op), "us_per_op": per_op}
        frozen = unfrozen = None
        if frozen_label is not None:
            frozen = self._scaling_row("single", n, frozen_label, runs[frozen_label]) | {
                "unfrozen": labels[("single", n)]}
        if unfrozen_label is not None:
            unfrozen = self._scaling_row("single", n, unfrozen_label, runs[unfrozen_label]) | {
                "frozen": labels[("single", n)]}
        return {
            "shape": asdict(TINY) | {"label": TINY.label},
            "page_size": 1,
            "counts": list(counts),
            "reps": s.scaling_reps,
            "max_queued_ops": config.max_queued_ops,
            "max_batch_ops": config.max_batch_ops,
            "rows": rows,
            "flat": flat,
            "gc_frozen": s.gc_freeze,
            "gc_frozen_run": frozen,
            "gc_unfrozen_run": unfrozen,
            "allocator": allocator_costs(s.allocator_pool_pages, s.allocator_ops, max(s.reps, 3)),
        }

    async def loop_cost(self) -> dict[str, Any]:
        """What kvtier costs the loop's thread (`kvtier.bench.loop`)."""
        from kvtier.bench.loop import gc_objects, loop_cost

        s = self.settings

        def build(device_slots: int, host_slots: int) -> PoolGroup:
            return build_pools(TINY, 1, "page_first", device_slots=device_slots, host_slots=host_slots).group

        # Not a recording: the ticker thread (a third thread wanting the GIL)
        # would distort the busy-thread figures; the section reports its own.
        out = await loop_cost(build, self.executor, ops=s.loop_ops, reps=s.loop_reps,
                              busy_reps=s.loop_busy_reps, pool=POOL)
        out["lean"] = await self.lean_cost(build)
        out["gc_objects"] = await gc_objects(build, ops=max(s.scaling_counts[0], s.loop_ops), pool=POOL)
        return out

    async def lean_cost(self, build: Callable[[int, int], PoolGroup]) -> dict[str, Any]:
        """kvtier's loop CPU against `kvtier.bench.lean`'s lean scheduler, same
        requests, same process (the executor that copies nothing)."""
        from kvtier.bench.lean import lean_cost

        s = self.settings
        config = SchedulerConfig(max_queued_ops=max(s.loop_ops, 4096))
        async with TransferScheduler(build(s.loop_ops, 2 * s.loop_ops), NoCopyExecutor(), config) as sched:

            async def kvtier_run(path: str, requests: list[dict[str, torch.Tensor]]) -> float:
                c0 = time.thread_time()
                if path == "single":
                    handles = [await sched.backup(r) for r in requests]
                else:
                    handles = await sched.backup_many(requests)
                for h in handles:
                    await h
                got = [h.host_indices[POOL] for h in handles]
                c1 = time.thread_time()
                sched.free_host({POOL: torch.cat(got)})
                return c1 - c0

            return await lean_cost(kvtier_run, ops=s.loop_ops, reps=s.loop_reps, num_layers=TINY.layers, pool=POOL,
                                   row_bytes=TINY.slot_nbytes // TINY.layers)

    def _scaling_row(self, path: str, n: int, label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
        rss = [r["rss_bytes"] / n for r in runs if r["rss_bytes"] is not None]
        return {
            "path": path,
            "operations": n,
            "label": label,
            "us_per_op": _range([r["seconds"] / n * 1e6 for r in runs]),
            "submit_us_per_op": _range([r["submit_seconds"] / n * 1e6 for r in runs]),
            "rss_bytes_per_op": _range(rss) if rss else None,
            "batches_per_run": statistics.mean(r["batches"] for r in runs),
            "collections_per_run": statistics.mean(r["collections"] for r in runs),
            "gc": gc_summary(self.monitor.collections.get(label, [])),
            "callbacks": callback_summary({label: self.monitor.callbacks[label]}),
        }


def freeze_setup(settings: Settings) -> None:
    """After a section's set-up (pools, requests, warm-up), as an engine after
    start-up: ``gc.collect(); gc.freeze()``, so that a collection during its
    runs walks only what the runs make (kvtier's objects and the handles the
    caller keeps). Nothing with ``--no-gc-freeze``. What is frozen and later
    dropped is still freed by its reference count; kvtier's schedulers leave
    no reference cycle behind (`tests/test_bench.py`)."""
    if settings.gc_freeze:
        gc.collect()
        gc.freeze()


def allocator_costs(pool_pages: Sequence[int], ops: int, reps: int) -> dict[str, Any]:
    """`PageAllocator` cost per page at each pool size: ``ops`` pages taken
    one call each and freed one call each, and taken and freed in one call;
    nanoseconds per page (median of ``reps`` alternating repetitions), and
    each size against the smallest."""
    if ops > min(pool_pages):
        raise ValueError(f"{ops} pages do not fit the smallest pool, of {min(pool_pages)} pages")
    allocators = {n: PageAllocator(n, 1, name=f"bench-{n}") for n in pool_pages}
    times: dict[str, list[float]] = {}
    for r in range(reps):
        for n in allocators if r % 2 == 0 else reversed(list(allocators)):
            a = allocators[n]
            t0 = time.perf_counter()
            pages = [a.try_alloc_pages(1) for _ in range(ops)]
            t1 = time.perf_counter()
            taken = [p for p in pages if p is not None]
            if len(taken) != ops:
                raise RuntimeError(f"allocator of {n} pages ran out after {len(taken)} of {ops} pages")
            t1b = time.perf_counter()
            for p in taken:
                a.free_pages(p)
            t2 = time.perf_counter()
            bulk = a.try_alloc_pages(ops)
            t3 = time.perf_counter()
            if bulk is None:
                raise RuntimeError(f"allocator of {n} pages cannot take {ops} pages")
            t3b = time.perf_counter()
            a.free_pages(bulk)
            t4 = time.perf_counter()
            for key, seconds in (("alloc_one", t1 - t0), ("free_one", t2 - t1b), ("alloc_bulk", t3 - t2),
                                 ("free_bulk", t4 - t3b)):
                times.setdefault(f"{key}:{n}", []).append(seconds / ops * 1e9)
    smallest = min(pool_pages)
    rows = []
    for n in pool_pages:
        row: dict[str, Any] = {"pool_pages": n}
        for key in ("alloc_one", "free_one", "alloc_bulk", "free_bulk"):
            ns = statistics.median(times[f"{key}:{n}"])
            row[f"{key}_ns_per_page"] = ns
            row[f"{key}_vs_smallest"] = ns / statistics.median(times[f"{key}:{smallest}"])
        rows.append(row)
    return {"operations": ops, "reps": reps, "rows": rows,
            "worst_vs_smallest": max(v for r in rows for k, v in r.items() if k.endswith("_vs_smallest"))}


def _range(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


def _batches(sched: TransferScheduler, direction: str) -> int:
    st = sched.statistics()
    return (st.backup if direction == "backup" else st.load).batches


def _section(label: str) -> str:
    """The benchmark section a recording belongs to (``one_op``, ``burst``, ``storage``, ...)."""
    return label.split(":", 1)[0]


def _progress_line(r: dict[str, Any]) -> str:
    kv = r["ratios"]["kvtier_one_vs_raw_best"]["median"]
    copy = r["ratios"]["kvtier_one_worker_vs_raw_best"]["median"]
    line = (f"  {r['group']:8} {r['direction']:6} {r['device']:9} {r['layout']:11} page {r['page_size']:>2} "
            f"{r['pattern']:10} "
            f"kvtier 1 op / raw best {kv:.2f} (its copy in the worker {copy:.2f}; "
            f"raw {r['raw_best_method']}, kvtier {r['kvtier_method']})")
    if "kvtier_many_vs_raw_best" in r["ratios"]:
        many = r["ratios"]["kvtier_many_vs_raw_best"]["median"]
        bulk = r["ratios"]["kvtier_bulk_vs_raw_best"]["median"]
        line += f", {r['operations']['kvtier_many']} ops / raw best {many:.2f} (bulk {bulk:.2f})"
    return line


def _storage_label(label: str) -> bool:
    return label.startswith("storage:")


def _lag_label(label: str) -> bool:
    """Whether a recording counts in the loop-lag and collection figures of
    kvtier's runs: not the baselines, the storage section (reported on its
    own) or the scaling table, whose single path keeps the loop on purpose
    for the whole submission of up to 100k operations."""
    return (label not in ("floor", "raw", "loop") and not _storage_label(label)
            and not label.startswith("scaling:"))


async def run_bench(
    settings: Settings, log: Callable[[str], None] = lambda _: None, *, redis_url: str | None = None
) -> dict[str, Any]:
    """Run every scenario; return every figure (the JSON document). ``redis_url``:
    the Redis of the storage section (default: a throwaway local redis-server)."""
    from kvtier.bench.report import evaluate_targets
    from kvtier.bench.storage import run_storage

    started = time.perf_counter()
    torch.set_num_threads(settings.torch_threads)
    load_before = os.getloadavg()
    # As engines run: the process set up (torch, kvtier and the bench imported), its heap frozen,
    # so that a collection during a run walks what was made since: kvtier's and the bench's own.
    frozen_objects = 0
    if settings.gc_freeze:
        gc.collect()
        gc.freeze()
        frozen_objects = gc.get_freeze_count()
    monitor = LoopLagMonitor(asyncio.get_running_loop(), settings.ticker_interval_s)
    # Seconds each section took: what keeps --quick under a minute is visible.
    section_seconds: dict[str, float] = {}
    mark = time.perf_counter()

    def done(section: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        section_seconds[section] = now - mark
        mark = now

    monitor.start()
    try:
        with monitor.recording("floor"):
            await asyncio.sleep(settings.floor_s)
        done("floor")
        bench = Bench(settings, monitor, log)
        log("throughput, one operation ...")
        one_op = await bench.throughput("one_op")
        done("one_op")
        log(f"throughput, {settings.many_ops} one-page operations ...")
        many_ops = await bench.throughput("many_ops")
        done("many_ops")
        log("latency under a burst ...")
        burst = await bench.burst()
        done("burst")
        log("scheduler overhead ...")
        overhead = await bench.overhead()
        done("overhead")
        log(f"scaling: {', '.join(f'{n:,}' for n in settings.scaling_counts)} operations queued at once ...")
        scaling = await bench.scaling()
        done("scaling")
        log(f"the engine's thread: {settings.loop_ops:,} one-page operations, loop CPU ...")
        loop_section = await bench.loop_cost()
        done("loop")
        storage = await run_storage(settings, monitor, log, redis_url=redis_url)
        done("storage")
    finally:
        monitor.close()
    # The targets are about device <-> host: the storage section's
    # lag is reported in its own object.
    during = monitor.all_samples(exclude=lambda label: not _lag_label(label))
    # The loop section runs beside a busy thread on purpose: it reports its own.
    kvtier_runs = {label: st for label, st in monitor.callbacks.items() if label not in ("floor", "raw", "loop")}
    run_sections = sorted({_section(label) for label in kvtier_runs})
    doc: dict[str, Any] = {
        "meta": {
            "kvtier_bench": 1,
            "mode": settings.mode,
            "settings": asdict(settings),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": settings.torch_threads,
            "loadavg_before": list(load_before),
            "loadavg_after": list(os.getloadavg()),
            "many_ops_scaled_down": settings.many_ops < settings.many_ops_nominal,
            "many_ops_page_sizes_left_out": many_ops_shapes(settings)[1],
            "seconds": time.perf_counter() - started,
            "section_seconds": section_seconds,
        },
        "throughput": one_op + many_ops,
        "burst": burst,
        "loop_lag": {
            "interval_ms": settings.ticker_interval_s * 1e3,
            "floor": lag_summary(monitor.samples.get("floor", [])),
            "during_raw_copies": lag_summary(monitor.samples.get("raw", [])),
            "during_kvtier": lag_summary(during),
            "during_burst": lag_summary(monitor.samples.get("burst:burst", [])),
            "by_run": {label: lag_summary(v) for label, v in monitor.samples.items() if v and _lag_label(label)},
            "gc_during_kvtier": gc_summary(
                [c for label, v in monitor.collections.items() if _lag_label(label) for c in v]
            ),
            "gc_longest": longest_collection(
                {label: v for label, v in monitor.collections.items() if _lag_label(label)}, monitor.collection_cpu),
            "gc_frozen": settings.gc_freeze,
            "gc_frozen_objects": frozen_objects,
        },
        "callbacks": {
            "during_kvtier": callback_summary(kvtier_runs),
            "during_raw_copies": callback_summary({k: v for k, v in monitor.callbacks.items() if k == "raw"}),
            "by_section": {sec: callback_summary({k: v for k, v in kvtier_runs.items() if _section(k) == sec})
                           for sec in run_sections},
        },
        "overhead": overhead,
        "scaling": scaling,
        "loop": loop_section,
        "storage": storage,
    }
    doc["targets"] = evaluate_targets(doc)
    doc["meta"]["seconds"] = time.perf_counter() - started
    return doc


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="kvtier bench",
        description="Benchmark kvtier against the raw copy of the same pages, in one process.",
    )
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions (under a minute)")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # for the test suite
    ap.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    ap.add_argument("--plot", metavar="PATH", help="draw throughput against page size to PATH (needs matplotlib)")
    ap.add_argument("--reps", type=int, help="alternating repetitions per scenario (default: 7, --quick: 3)")
    ap.add_argument("--torch-threads", type=int, help="torch threads of the executor and the baselines (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the scattered page choice")
    ap.add_argument(
        "--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
        help="gc.collect(); gc.freeze() once the process is set up, before the first section, as engines "
             "(vLLM, SGLang) do after start-up, so that collections walk only what was made since (default); "
             "--no-gc-freeze leaves the collector as it is",
    )
    ap.add_argument("--no-storage", action="store_true", help="leave out the storage tier section")
    ap.add_argument(
        "--redis-url", metavar="URL",
        help="the Redis of the storage section (only keys under a random prefix are touched, and deleted); "
             "default: a throwaway redis-server in a temporary directory",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress lines (they go to a terminal only anyway)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when a target is missed (default: report the targets and exit 0)")
    return ap.parse_args(argv)


def redis_url_unusable(url: str, *, no_storage: bool = False) -> str | None:
    """Why ``--redis-url URL`` cannot serve the storage section, in one line,
    or None when the server answers a lookup."""
    if no_storage:
        return "--no-storage leaves out the storage section it is for"
    from kvtier.bench.storage import redis_unavailable

    why = redis_unavailable(url)
    if why is not None:
        return why
    import anyio

    from kvtier.demo import check_redis_url

    return anyio.run(check_redis_url, url)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(
            "kvtier bench: --plot needs matplotlib, which is not installed; "
            "pip install 'kvtier[plot]' (or matplotlib), or leave out --plot",
            file=sys.stderr,
        )
        return 2
    settings = MODES["tiny" if args.tiny else "quick" if args.quick else "full"]
    for field, value in (("reps", args.reps), ("torch_threads", args.torch_threads)):
        if value is not None:
            if value < 1:
                print(f"kvtier bench: --{field.replace('_', '-')} must be >= 1; got {value}", file=sys.stderr)
                return 2
            settings = replace(settings, **{field: value})
    settings = replace(settings, seed=args.seed, gc_freeze=args.gc_freeze, storage=not args.no_storage)
    if args.redis_url is not None:
        # Up front, as the demo does: an unusable URL used to surface only as a
        # skipped Redis part at the end of a full run, with exit status 0.
        why = redis_url_unusable(args.redis_url, no_storage=args.no_storage)
        if why is not None:
            print(f"kvtier bench: --redis-url {args.redis_url} cannot be used: {why}", file=sys.stderr)
            return 2

    from kvtier.bench.report import check_targets, format_report, plot

    # Progress, a line per step with the time so far: on a terminal only
    # (quiet when piped, as in CI logs, or with --quiet).
    show = not args.quiet and sys.stderr.isatty()
    t0 = time.perf_counter()

    def log(line: str) -> None:
        if show:
            print(f"[{time.perf_counter() - t0:6.1f} s] {line}", file=sys.stderr, flush=True)

    doc = asyncio.run(run_bench(settings, log, redis_url=args.redis_url))
    print(format_report(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"figures written to {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"plot written to {args.plot}")
    return check_targets(doc) if args.check else 0
