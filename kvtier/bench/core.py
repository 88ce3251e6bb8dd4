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
  ceiling (one contiguous ``copy_`` of the same bytes), the raw best (the
  fastest of the hand-written copies in `kvtier.bench.copies` that apply to
  those tensors, chosen in a selection round; the winner is named) and kvtier
  moving the pages as one operation;
* throughput, many operations: the same pages as N one-page operations
  submitted concurrently (N = 10,000; fewer in ``--quick``), at the realistic
  shape (a one-page operation of page size 1 moves 128 KiB); page sizes whose
  N pages do not fit the memory budget at that shape are left out (and
  named), except page size 1, which a budget too small for it (``--tiny``)
  runs on a scaled-down shape;
* latency of a one-page load under a backup burst of hundreds of MiB, against
  the same load on an idle scheduler;
* event-loop lag during every kvtier run (a ticker on the loop), with the lag
  during the baselines and on an idle loop as references, and the garbage
  collections that ran meanwhile;
* scheduler overhead per operation, with an executor that copies nothing;
* the storage tier (`kvtier.bench.storage`): host pages to Redis and to
  files and back, through the scheduler (``write_storage``, ``prefetch``),
  through the store alone, and through raw client code on the same bytes
  (with and without the host <-> bytes copy). Needs redis-py and a
  redis-server (or ``--redis-url``) for its Redis part, which otherwise says
  why it was skipped; ``--no-storage`` leaves the section out.

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
import gc
import importlib.util
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import anyio.to_thread
import structlog
import torch

from kvtier.bench.copies import RAW_METHODS, Ceiling, RowCopy, Side, raw_methods_for
from kvtier.pools import DevicePool, HostPool, PoolGroup
from kvtier.scheduler import OperationHandle, SchedulerConfig, TransferScheduler
from kvtier.transfers import Batch, CpuExecutor, LayerProgress

__all__ = [
    "DEVICES",
    "MODES",
    "REALISTIC",
    "TINY",
    "Bench",
    "LoopLagMonitor",
    "NoCopyExecutor",
    "Pools",
    "Settings",
    "Shape",
    "alternate",
    "build_pools",
    "device_indices",
    "fit_shape",
    "kvtier_backup",
    "kvtier_load",
    "main",
    "many_ops_shapes",
    "page_slots",
    "parse_args",
    "percentile",
    "release",
    "run_bench",
    "summarize_latencies",
    "summarize_times",
]

MiB = 1 << 20
POOL = "kv"
# Device pages per moved page: room to scatter the moved pages in.
DEVICE_SPARE = 1.5

# -- what is measured ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """A KV pool's geometry: K and V planes of ``[heads, head_dim]`` per layer."""

    layers: int
    heads: int
    head_dim: int
    dtype_name: str = "bfloat16"

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)  # type: ignore[no-any-return]

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot across every layer and both planes."""
        return self.layers * 2 * self.heads * self.head_dim * self.dtype.itemsize

    @property
    def label(self) -> str:
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(self.dtype_name, self.dtype_name)
        return f"{self.layers}x{self.heads}x{self.head_dim} {short}"


REALISTIC = Shape(layers=32, heads=8, head_dim=128)
# Rows of 64 bytes: the copies are negligible, the scheduler's work is not.
TINY = Shape(layers=32, heads=1, head_dim=16)


def fit_shape(slots: int, budget_bytes: int, base: Shape = REALISTIC) -> Shape:
    """``base`` scaled down until ``slots`` slots fit ``budget_bytes``: halve
    the layers, then the heads, then the head dim (not below 16)."""
    s = base
    while slots * s.slot_nbytes > budget_bytes:
        if s.layers > 1:
            s = replace(s, layers=s.layers // 2)
        elif s.heads > 1:
            s = replace(s, heads=s.heads // 2)
        elif s.head_dim > 16:
            s = replace(s, head_dim=s.head_dim // 2)
        else:
            break
    return s


def many_ops_shapes(settings: Settings) -> tuple[list[tuple[int, Shape]], list[int]]:
    """Page sizes of the many-operations scenario with their shape, and the
    page sizes left out: ``many_ops`` pages must fit ``many_budget_bytes`` at
    the realistic shape; page size 1 always runs, scaled down if need be."""
    kept, left_out = [], []
    for ps in settings.many_page_sizes:
        slots = settings.many_ops * ps
        if slots * REALISTIC.slot_nbytes <= settings.many_budget_bytes:
            kept.append((ps, REALISTIC))
        elif ps == 1:
            kept.append((ps, fit_shape(slots, settings.many_budget_bytes)))
        else:
            left_out.append(ps)
    return kept, left_out


@dataclass(frozen=True, slots=True)
class Settings:
    """Sizes and counts of one benchmark run (see `MODES`)."""

    mode: str
    reps: int
    selection_rounds: int
    layouts: tuple[str, ...]
    page_sizes: tuple[int, ...]
    patterns: tuple[str, ...]
    one_op_directions: tuple[str, ...]
    one_op_bytes: int
    many_ops: int
    many_page_sizes: tuple[int, ...]
    many_budget_bytes: int
    burst_bytes: int
    burst_op_pages: int
    burst_page_size: int
    latency_samples: int
    overhead_ops: int
    sequential_ops: int
    torch_threads: int = 1
    seed: int = 0
    checkpoint_every: int = 32
    ticker_interval_s: float = 0.001
    gc_freeze: bool = False
    floor_s: float = 1.0
    devices: tuple[str, ...] = ("stacked", "per_layer")
    many_devices: tuple[str, ...] = ("stacked", "per_layer")
    # The storage tier (`kvtier.bench.storage`): pages of a kv pool of
    # ``storage_shape`` (page size ``storage_page_size``, 1 MiB at the realistic
    # shape) with a c4 sidecar (an eighth more), written and read back.
    storage: bool = True
    storage_backends: tuple[str, ...] = ("redis", "file")
    storage_pages: int = 128
    storage_page_size: int = 8
    storage_shape: Shape = REALISTIC
    storage_layout: str = "layer_first"

    @property
    def many_ops_nominal(self) -> int:
        return 10_000


_LAYOUTS = ("layer_first", "page_first")
_PAGES = (1, 16, 64)
_PATTERNS = ("contiguous", "scattered")

MODES: dict[str, Settings] = {
    "full": Settings(
        mode="full", reps=7, selection_rounds=2, layouts=_LAYOUTS, page_sizes=_PAGES, patterns=_PATTERNS,
        one_op_directions=("backup", "load"), one_op_bytes=256 * MiB, many_ops=10_000,
        # 10,000 pages of 128 KiB: 1.22 GiB per side (peak ~7 GiB with the
        # device, the ceiling's two buffers and the raw methods' staging).
        many_page_sizes=_PAGES, many_budget_bytes=1280 * MiB,
        burst_bytes=512 * MiB, burst_op_pages=4, burst_page_size=16,
        latency_samples=200, overhead_ops=10_000, sequential_ops=500, floor_s=3.0,
    ),
    "quick": Settings(
        mode="quick", reps=3, selection_rounds=1, layouts=_LAYOUTS, page_sizes=_PAGES, patterns=_PATTERNS,
        one_op_directions=("backup",), one_op_bytes=64 * MiB, many_ops=2_000,
        many_page_sizes=_PAGES, many_budget_bytes=256 * MiB,
        burst_bytes=256 * MiB, burst_op_pages=4, burst_page_size=16,
        latency_samples=40, overhead_ops=2_000, sequential_ops=200,
        # 250 MiB per run: one device allocation keeps --quick under a minute.
        many_devices=("per_layer",),
        storage_pages=64,
    ),
    # For the test suite: every code path, tiny sizes, seconds.
    "tiny": Settings(
        mode="tiny", reps=1, selection_rounds=1, layouts=_LAYOUTS, page_sizes=(1, 16), patterns=_PATTERNS,
        one_op_directions=("backup", "load"), one_op_bytes=2 * MiB, many_ops=64,
        many_page_sizes=(1, 16), many_budget_bytes=1 * MiB, burst_bytes=8 * MiB, burst_op_pages=1, burst_page_size=16,
        latency_samples=4, overhead_ops=128, sequential_ops=16, floor_s=0.2,
        storage_pages=4, storage_shape=TINY,
    ),
}


# -- measuring ----------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summarize_times(seconds: Sequence[float], nbytes: int) -> dict[str, Any]:
    """Median and range of run times, and the throughput they mean."""
    med = statistics.median(seconds)
    lo, hi = min(seconds), max(seconds)
    return {
        "seconds": list(seconds),
        "median_s": med,
        "min_s": lo,
        "max_s": hi,
        "gbps_median": nbytes / med / 1e9,
        "gbps_min": nbytes / hi / 1e9,
        "gbps_max": nbytes / lo / 1e9,
    }


def summarize_latencies(seconds: Sequence[float]) -> dict[str, Any]:
    return {
        "samples": len(seconds),
        "p50_ms": percentile(seconds, 50) * 1e3,
        "p99_ms": percentile(seconds, 99) * 1e3,
        "max_ms": max(seconds) * 1e3,
        "seconds": list(seconds),
    }


class LoopLagMonitor:
    """Measures how late the event loop runs a tick that falls due.

    A helper thread sleeps ``interval`` (to the microsecond, unlike a timer on
    the loop, whose epoll wait rounds up to whole milliseconds) and then posts a
    tick to the loop; the tick records how long after its due time it ran and
    lets the thread schedule the next one. So there is one tick outstanding at a
    time and a stall of the loop counts once, as with a timer-driven ticker.
    Ticks are recorded only inside `recording` (kvtier runs), and only when they
    fell due and ran within the same recording: a tick left over from one
    recording says nothing about the next. Garbage collections (generation and
    pause) are recorded alongside: with torch loaded, a full collection stops
    every thread of the process for tens of milliseconds.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
        self._loop = loop
        self._interval = interval_s
        self._label: str | None = None
        self._generation = 0
        self.samples: dict[str, list[float]] = {}
        self.collections: dict[str, list[tuple[int, float]]] = {}
        self._gc_start = 0.0
        self._active = threading.Event()
        self._ack = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-bench-ticker", daemon=True)

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._thread.start()

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)
        self._closed = True
        self._active.set()
        self._ack.set()
        self._thread.join()

    @contextmanager
    def recording(self, label: str) -> Iterator[None]:
        self.samples.setdefault(label, [])
        self.collections.setdefault(label, [])
        self._generation += 1
        self._label = label
        self._active.set()
        try:
            yield
        finally:
            self._active.clear()
            self._label = None
            self._generation += 1

    def all_samples(self, exclude: Callable[[str], bool] = lambda _: False) -> list[float]:
        return [s for label, values in self.samples.items() if not exclude(label) for s in values]

    def _run(self) -> None:
        while True:
            self._active.wait()
            if self._closed:
                return
            generation = self._generation
            due = time.perf_counter() + self._interval
            time.sleep(self._interval)
            self._ack.clear()
            try:
                self._loop.call_soon_threadsafe(self._tick, due, generation)
            except RuntimeError:  # the loop is closed
                return
            while not self._ack.wait(0.05):
                if self._closed:
                    return

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._label is not None:
            self.collections[self._label].append((info["generation"], time.perf_counter() - self._gc_start))

    def _tick(self, due: float, generation: int) -> None:
        late = time.perf_counter() - due
        label = self._label
        if label is not None and generation == self._generation:
            self.samples[label].append(max(0.0, late))
        self._ack.set()


class NoCopyExecutor:
    """Signals every layer of a batch and copies nothing: what a run of it
    costs is the scheduler's own time."""

    @property
    def max_in_flight(self) -> int:
        return 1

    async def execute(self, batch: Batch, progress: LayerProgress) -> None:
        for layer in range(batch.num_layers):
            progress.layer_done(layer)


DEVICES = ("stacked", "per_layer")


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
    submission to the last completion, and the handles (see `release`)."""
    t0 = time.perf_counter()
    handles = []
    for i, idx in enumerate(parts, 1):
        handles.append(await sched.backup({POOL: idx}))
        if i % checkpoint_every == 0:
            await asyncio.sleep(0)
    for h in handles:
        await h
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

    def executor(self) -> CpuExecutor:
        return CpuExecutor(torch_threads=self.settings.torch_threads)

    def threaded(self, fn: Callable[[], None], label: str) -> Runner:
        """A baseline run in a worker thread, as kvtier's copies are, with the
        loop free and the ticker running: the ticker's cost to the copying
        thread (measurable on a loaded 2-core machine) is then the same for
        baselines and kvtier, and the lag it records is a reference for
        kvtier's. The time is taken inside the thread: the copy alone.

        The thread is anyio's, as `CpuExecutor`'s is: anyio reuses its most
        recently idle worker, so baselines and kvtier's copies run on the same
        OS thread (two threads can sit on differently loaded cores for a while,
        which on a busy machine showed as one side copying 2-3x slower)."""

        async def run() -> float:
            with self.monitor.recording(label):
                return await anyio.to_thread.run_sync(_time_in_thread, fn, self.settings.torch_threads)

        return run

    async def select_raw(self, copy: RowCopy) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """Time every raw method that applies (alternating); return their
        figures and the two fastest, which go on to the measured repetitions."""
        copy.prepare()
        runners = [(name, self.threaded(partial(fn, copy), "raw")) for name, fn in raw_methods_for(copy).items()]
        times = await alternate(runners, self.settings.selection_rounds)
        figures = {name: summarize_times(t, copy.nbytes) for name, t in times.items()}
        ranked = sorted(times, key=lambda name: min(times[name]))
        return figures, ranked[:2]

    async def throughput(self, group_name: str) -> list[dict[str, Any]]:
        s = self.settings
        out = []
        directions = s.one_op_directions if group_name == "one_op" else ("backup",)
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
                    ceiling = Ceiling(pages * ps * shape.slot_nbytes)
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
                    del pools, ceiling
                    gc.collect()
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
        stable = True
        # Seconds the executor's worker spent per kvtier run (planning and
        # copying, without the hand-offs between the loop and the thread).
        worker: dict[str, list[float]] = {"kvtier_one": [], "kvtier_many": []}

        def in_worker(name: str, run: Runner) -> Runner:
            async def timed() -> float:
                before = executor.statistics().worker_seconds
                seconds = await run()
                worker[name].append(executor.statistics().worker_seconds - before)
                return seconds

            return timed

        if direction == "backup":
            host_idx = release(sched, (await kvtier_backup(sched, [dev_idx], s.checkpoint_every))[1])  # warm-up
            copy = RowCopy(pools.device, pools.host_side, dev_idx, host_idx)

            async def kv_one() -> float:
                nonlocal stable
                with self.monitor.recording(label + ":kvtier_one"):
                    seconds, handles = await kvtier_backup(sched, [dev_idx], s.checkpoint_every)
                stable = stable and torch.equal(release(sched, handles), host_idx)
                return seconds

            async def kv_many() -> float:
                nonlocal stable
                with self.monitor.recording(label + ":kvtier_many"):
                    seconds, handles = await kvtier_backup(sched, dev_parts, s.checkpoint_every)
                stable = stable and torch.equal(release(sched, handles), host_idx)
                return seconds

            held = None
        else:
            first = await sched.backup({POOL: dev_idx})
            await first
            host_idx = first.host_indices[POOL]
            held = host_idx
            copy = RowCopy(pools.host_side, pools.device, host_idx, dev_idx)
            host_parts = list(torch.split(host_idx, ps)) if many else []

            async def kv_one() -> float:
                with self.monitor.recording(label + ":kvtier_one"):
                    return await kvtier_load(sched, [host_idx], [dev_idx], s.checkpoint_every)

            async def kv_many() -> float:
                with self.monitor.recording(label + ":kvtier_many"):
                    return await kvtier_load(sched, host_parts, dev_parts, s.checkpoint_every)

            await kvtier_load(sched, [host_idx], [dev_idx], s.checkpoint_every)  # warm-up
        if many:
            await kv_many()  # warm-up
        stats_before = _batches(sched, direction)

        selection, finalists = await self.select_raw(copy)
        variants: list[tuple[str, Runner]] = [("ceiling", self.threaded(ceiling, "raw"))]
        variants += [(f"raw:{name}", self.threaded(partial(RAW_METHODS[name], copy), "raw")) for name in finalists]
        variants.append(("kvtier_one", in_worker("kvtier_one", kv_one)))
        if many:
            variants.append(("kvtier_many", in_worker("kvtier_many", kv_many)))
        times = await alternate(variants, s.reps)
        for name, seconds in worker.items():
            if seconds:
                times[f"{name}_worker"] = seconds
        many_batches = _batches(sched, direction) - stats_before - s.reps  # kvtier_one takes one batch a run
        if held is not None:
            sched.free_host({POOL: held})

        nbytes = copy.nbytes
        figures = {name: summarize_times(t, nbytes) for name, t in times.items()}
        best = min(finalists, key=lambda name: figures[f"raw:{name}"]["median_s"])
        raw_key = f"raw:{best}"
        ratios = {
            "raw_best_vs_ceiling": ratio_of(times, "ceiling", raw_key),
            "kvtier_one_vs_raw_best": ratio_of(times, raw_key, "kvtier_one"),
            "kvtier_one_vs_ceiling": ratio_of(times, "ceiling", "kvtier_one"),
            # The copy path alone: the executor's worker time against the raw copy.
            "kvtier_one_worker_vs_raw_best": ratio_of(times, raw_key, "kvtier_one_worker"),
        }
        if many:
            ratios["kvtier_many_vs_raw_best"] = ratio_of(times, raw_key, "kvtier_many")
            ratios["kvtier_many_vs_kvtier_one"] = ratio_of(times, "kvtier_one", "kvtier_many")
            ratios["kvtier_many_worker_vs_raw_best"] = ratio_of(times, raw_key, "kvtier_many_worker")
        lag = [x for key in (label + ":kvtier_one", label + ":kvtier_many") for x in self.monitor.samples.get(key, [])]
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
            "operations": {"kvtier_one": 1} | ({"kvtier_many": len(dev_parts)} if many else {}),
            "kvtier_many_batches_per_run": many_batches / s.reps if many else None,
            "variants": figures,
            "raw_selection": selection,
            "raw_best_method": best,
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
        """Scheduler time per operation for many tiny one-page operations."""
        s = self.settings
        n = s.overhead_ops
        dev_idx = torch.arange(n)
        parts = list(torch.split(dev_idx, 1))
        noop_pools = build_pools(TINY, 1, "page_first", device_slots=n, host_slots=n)
        cpu_pools = build_pools(TINY, 1, "page_first", device_slots=n, host_slots=n)
        async with TransferScheduler(noop_pools.group, NoCopyExecutor()) as noop, \
                TransferScheduler(cpu_pools.group, self.executor()) as cpu:
            host_idx = release(cpu, (await kvtier_backup(cpu, [dev_idx], s.checkpoint_every))[1])
            copy = RowCopy(cpu_pools.device, cpu_pools.host_side, dev_idx, host_idx)
            for sched in (noop, cpu):
                release(sched, (await kvtier_backup(sched, parts, s.checkpoint_every))[1])  # warm-up
            selection, finalists = await self.select_raw(copy)

            async def run_noop() -> float:
                with self.monitor.recording("overhead:noop"):
                    seconds, handles = await kvtier_backup(noop, parts, s.checkpoint_every)
                release(noop, handles)
                return seconds

            async def run_cpu() -> float:
                with self.monitor.recording("overhead:cpu"):
                    seconds, handles = await kvtier_backup(cpu, parts, s.checkpoint_every)
                release(cpu, handles)
                return seconds

            variants: list[tuple[str, Runner]] = [("noop", run_noop), ("cpu", run_cpu)]
            variants += [(f"raw:{name}", self.threaded(partial(RAW_METHODS[name], copy), "raw")) for name in finalists]
            times = await alternate(variants, s.reps)
            batches_before = noop.statistics().backup.batches
            await run_noop()
            noop_batches = noop.statistics().backup.batches - batches_before

            sequential: list[float] = []
            with self.monitor.recording("overhead:sequential"):
                for i in range(s.sequential_ops):
                    t0 = time.perf_counter()
                    h = await noop.backup({POOL: parts[i % n]})
                    await h
                    sequential.append(time.perf_counter() - t0)
                    noop.free_host({POOL: h.host_indices[POOL]})
        del noop_pools, cpu_pools
        gc.collect()
        raw_best = min(finalists, key=lambda name: statistics.median(times[f"raw:{name}"]))
        raw_s = statistics.median(times[f"raw:{raw_best}"])
        per_op = {name: [t / n * 1e6 for t in times[name]] for name in ("noop", "cpu")}
        cpu_minus_copy = [(t - raw_s) / n * 1e6 for t in times["cpu"]]
        return {
            "operations": n,
            "shape": asdict(TINY) | {"label": TINY.label},
            "page_size": 1,
            "noop_us_per_op": _range(per_op["noop"]),
            "cpu_us_per_op": _range(per_op["cpu"]),
            "cpu_minus_raw_copy_us_per_op": _range(cpu_minus_copy),
            "raw_copy_s": summarize_times(times[f"raw:{raw_best}"], copy.nbytes),
            "raw_best_method": raw_best,
            "raw_selection": selection,
            "noop_batches_per_run": noop_batches,
            "sequential_round_trip_us": _range([t * 1e6 for t in sequential]),
        }


def _range(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


def _batches(sched: TransferScheduler, direction: str) -> int:
    st = sched.statistics()
    return (st.backup if direction == "backup" else st.load).batches


def ratio_of(times: dict[str, list[float]], base: str, other: str) -> dict[str, float]:
    """Throughput of ``other`` over ``base``: the ratio of medians, and the
    range of the ratios of runs made next to each other."""
    paired = [b / o for b, o in zip(times[base], times[other])]
    return {
        "median": statistics.median(times[base]) / statistics.median(times[other]),
        "paired_min": min(paired),
        "paired_max": max(paired),
    }


def lag_summary(samples: Sequence[float]) -> dict[str, Any]:
    if not samples:
        return {"ticks": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"ticks": len(samples), "p50_ms": percentile(samples, 50) * 1e3,
            "p99_ms": percentile(samples, 99) * 1e3, "max_ms": max(samples) * 1e3}


def _gc_summary(collections: Sequence[tuple[int, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for gen in (0, 1, 2):
        pauses = [p for g, p in collections if g == gen]
        out[f"gen{gen}"] = {"count": len(pauses), "total_ms": sum(pauses) * 1e3,
                            "max_ms": max(pauses) * 1e3 if pauses else 0.0}
    return out


def _progress_line(r: dict[str, Any]) -> str:
    kv = r["ratios"]["kvtier_one_vs_raw_best"]["median"]
    copy = r["ratios"]["kvtier_one_worker_vs_raw_best"]["median"]
    line = (f"  {r['group']:8} {r['direction']:6} {r['device']:9} {r['layout']:11} page {r['page_size']:>2} "
            f"{r['pattern']:10} "
            f"kvtier 1 op / raw best {kv:.2f} (its copy in the worker {copy:.2f})")
    if "kvtier_many_vs_raw_best" in r["ratios"]:
        many = r["ratios"]["kvtier_many_vs_raw_best"]["median"]
        line += f", {r['operations']['kvtier_many']} ops / raw best {many:.2f}"
    return line


def _storage_label(label: str) -> bool:
    return label.startswith("storage:")


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
    if settings.gc_freeze:
        gc.collect()
        gc.freeze()
    monitor = LoopLagMonitor(asyncio.get_running_loop(), settings.ticker_interval_s)
    monitor.start()
    try:
        with monitor.recording("floor"):
            await asyncio.sleep(settings.floor_s)
        bench = Bench(settings, monitor, log)
        log("throughput, one operation ...")
        one_op = await bench.throughput("one_op")
        log(f"throughput, {settings.many_ops} one-page operations ...")
        many_ops = await bench.throughput("many_ops")
        log("latency under a burst ...")
        burst = await bench.burst()
        log("scheduler overhead ...")
        overhead = await bench.overhead()
        storage = await run_storage(settings, monitor, log, redis_url=redis_url)
    finally:
        monitor.close()
    # The targets are about device <-> host: the storage section's
    # lag is reported in its own object.
    during = monitor.all_samples(exclude=lambda label: label in ("floor", "raw") or _storage_label(label))
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
        },
        "throughput": one_op + many_ops,
        "burst": burst,
        "loop_lag": {
            "interval_ms": settings.ticker_interval_s * 1e3,
            "floor": lag_summary(monitor.samples.get("floor", [])),
            "during_raw_copies": lag_summary(monitor.samples.get("raw", [])),
            "during_kvtier": lag_summary(during),
            "by_run": {label: lag_summary(v) for label, v in monitor.samples.items()
                       if v and label not in ("floor", "raw") and not _storage_label(label)},
            "gc_during_kvtier": _gc_summary(
                [c for label, v in monitor.collections.items()
                 if label not in ("floor", "raw") and not _storage_label(label) for c in v]
            ),
            "gc_frozen": settings.gc_freeze,
        },
        "overhead": overhead,
        "storage": storage,
    }
    doc["targets"] = evaluate_targets(doc)
    doc["meta"]["seconds"] = time.perf_counter() - started
    return doc


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m kvtier bench",
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
        "--gc-freeze", action="store_true",
        help="gc.freeze() the heap first, as engines do after start-up (default: leave the collector as it is)",
    )
    ap.add_argument("--no-storage", action="store_true", help="leave out the storage tier section")
    ap.add_argument(
        "--redis-url", metavar="URL",
        help="the Redis of the storage section (only keys under a random prefix are touched, and deleted); "
             "default: a throwaway redis-server in a temporary directory",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress lines (they go to a terminal only anyway)")
    return ap.parse_args(argv)


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

    from kvtier.bench.report import format_report, plot

    # Progress, a line per step with the time so far: on a terminal only
    # (quiet when piped, as in CI logs, or with --quiet).
    show = not args.quiet and sys.stderr.isatty()
    t0 = time.perf_counter()

    def log(line: str) -> None:
        if show:
            print(f"[{time.perf_counter() - t0:6.1f} s] {line}", file=sys.stderr, flush=True)

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    doc = asyncio.run(run_bench(settings, log, redis_url=args.redis_url))
    print(format_report(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"figures written to {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"plot written to {args.plot}")
    return 0
