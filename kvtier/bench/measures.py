"""The benchmark's instruments and how their readings are summed up.

* `LoopLagMonitor`: how late the event loop runs a tick that falls due, the
  garbage collections and every callback the loop runs (`describe_callback`
  names its owner: kvtier, the benchmark or the runtime), per recording;
* `NoCopyExecutor`: an executor that copies nothing, so a run of it costs the
  scheduler's own time;
* summaries of what they read: `summarize_times`, `summarize_latencies`,
  `ratio_of`, `lag_summary`, `gc_summary`, `longest_collection`,
  `callback_summary`, `median_range`.

Every section of the benchmark reads these (`kvtier.bench.core`,
`kvtier.bench.loop`, `kvtier.bench.lean`, `kvtier.bench.storage`); this
module imports none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio

from kvtier.transfers import Batch, LayerProgress

__all__ = [
    "CallbackRecord",
    "CallbackStats",
    "LoopLagMonitor",
    "NoCopyExecutor",
    "callback_summary",
    "describe_callback",
    "gc_summary",
    "lag_summary",
    "longest_collection",
    "median_range",
    "percentile",
    "ratio_of",
    "summarize_latencies",
    "summarize_times",
]


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


# Callbacks shorter than this are counted, not named (naming one costs a few
# microseconds; a callback this short says nothing about a 1 ms bound).
CALLBACK_NAMED_S = 50e-6
SLOW_CALLBACK_S = 1e-3
OWNERS = ("kvtier", "bench", "other")
_BENCH_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_KVTIER_DIR = os.path.dirname(_BENCH_DIR.rstrip(os.sep)) + os.sep
# Frames of the runtime between a task and its own code: anyio's task wrapper,
# asyncio, contextlib.
_RUNTIME_DIRS = (os.path.dirname(os.path.abspath(anyio.__file__)) + os.sep,
                 os.path.dirname(os.path.abspath(asyncio.__file__)) + os.sep,
                 os.path.abspath(contextlib.__file__))


def _owner_of(filename: str) -> str:
    if filename.startswith(_BENCH_DIR):
        return "bench"
    if filename.startswith(_KVTIER_DIR):
        return "kvtier"
    return "other"


def _where(filename: str) -> str:
    if filename.startswith(_KVTIER_DIR):
        return "kvtier/" + filename[len(_KVTIER_DIR):]
    return os.path.basename(filename)


def describe_callback(callback: object) -> tuple[str, str]:
    """Whose a loop callback is, and its name.

    The owner is ``kvtier`` (the scheduler's own tasks and callbacks),
    ``bench`` (the benchmark's driver and ticker: a step of the driver's task
    includes the kvtier calls it makes, such as a whole ``backup_many``) or
    ``other`` (anyio's and asyncio's machinery). A task step is named after the
    task's first coroutine outside the runtime (anyio wraps every task in one
    of its own), e.g. ``task Lane._run (kvtier/scheduler/lanes.py)``."""
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        coro: Any = task.get_coro()
        while coro is not None and hasattr(coro, "cr_code"):
            filename = coro.cr_code.co_filename
            if not filename.startswith(_RUNTIME_DIRS):
                return _owner_of(filename), f"task {coro.__qualname__} ({_where(filename)})"
            coro = coro.cr_await
        # The task finished in this step: only its name is left, which anyio
        # makes its function's module and qualified name.
        name = task.get_name()
        owner = "bench" if name.startswith("kvtier.bench.") else "kvtier" if name.startswith("kvtier.") else "other"
        return owner, f"task {name} (its last step)"
    func: Any = callback.func if isinstance(callback, partial) else callback
    func = getattr(func, "__func__", func)
    code = getattr(func, "__code__", None)
    name = getattr(func, "__qualname__", type(func).__name__)
    if code is None:
        return "other", name
    return _owner_of(code.co_filename), f"{name} ({_where(code.co_filename)})"


@dataclass(frozen=True, slots=True)
class CallbackRecord:
    """One loop callback: its time without the garbage collections that ran
    inside it (those are the collector's, reported on their own), its time
    with them, and what it was; and the loop thread's CPU time in it
    (``time.thread_time``, the collections left out too): where it is well
    under the wall time, the thread waited (another process had the core, or
    another thread the GIL)."""

    seconds: float
    gross_seconds: float
    name: str
    cpu_seconds: float = 0.0


@dataclass(eq=False, slots=True)
class CallbackStats:
    """The callbacks the loop ran during one recording: how many, the longest
    of each owner (see `describe_callback`), and how many ran over 1 ms and
    over 0.5 ms (the longest-callback target's bound)."""

    count: int = 0
    longest: dict[str, CallbackRecord] = field(default_factory=dict)
    # The longest of each owner by its loop-thread CPU time.
    longest_cpu: dict[str, CallbackRecord] = field(default_factory=dict)
    over_1ms: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OWNERS, 0))
    over_half_ms: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OWNERS, 0))

    def note(self, callback: object, seconds: float, gc_seconds: float, cpu_seconds: float = 0.0) -> None:
        owner, name = describe_callback(callback)
        net = seconds - gc_seconds
        cpu = max(0.0, cpu_seconds - gc_seconds)
        by_cpu = self.longest_cpu.get(owner)
        if by_cpu is None or cpu > by_cpu.cpu_seconds:
            self.longest_cpu[owner] = CallbackRecord(net, seconds, name, cpu)
        if net > SLOW_CALLBACK_S / 2:
            self.over_half_ms[owner] += 1
            if net > SLOW_CALLBACK_S:
                self.over_1ms[owner] += 1
        best = self.longest.get(owner)
        if best is None or net > best.seconds:
            self.longest[owner] = CallbackRecord(net, seconds, name, cpu)


class LoopLagMonitor:
    """Measures how late the event loop runs a tick that falls due.

    A helper thread sleeps ``interval`` (to the microsecond, unlike a timer on
    the loop, whose epoll wait rounds up to whole milliseconds) and then posts a
    tick to the loop; the tick records how long after its due time it ran and
    lets the thread schedule the next one. So there is one tick outstanding at a
    time and a stall of the loop counts once, as with a timer-driven ticker.
    Ticks are recorded only inside `recording` (kvtier runs), and only when they
    fell due and ran within the same recording: a tick left over from one
    recording says nothing about the next (``ticks=False``: no ticker, only
    the collections and callbacks below). Garbage collections (generation and
    pause) are recorded alongside: with torch loaded, a full collection stops
    every thread of the process for tens of milliseconds.

    Every callback the loop runs inside a recording is timed too (`callbacks`,
    per label): from `start` to `close`, ``asyncio.events.Handle._run`` (what
    the loop calls for each ready callback and task step) is wrapped, and put
    back at `close`. Outside recordings the wrapper only calls through.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float, *, ticks: bool = True) -> None:
        self._loop = loop
        self._ticks = ticks
        self._interval = interval_s
        self._label: str | None = None
        self._generation = 0
        self.samples: dict[str, list[float]] = {}
        self.collections: dict[str, list[tuple[int, float]]] = {}
        # Per label, in the order of `collections`: the CPU time of the thread
        # that ran each collection (on a shared machine the pause can be mostly
        # waiting for a core).
        self.collection_cpu: dict[str, list[float]] = {}
        self.callbacks: dict[str, CallbackStats] = {}
        self._gc_start = 0.0
        self._gc_cpu_start = 0.0
        self._gc_seconds = 0.0  # every collection's pause so far, recording or not
        self._handle_run: Callable[[asyncio.Handle], None] | None = None
        self._active = threading.Event()
        self._ack = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-bench-ticker", daemon=True)

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._time_callbacks()
        if self._ticks:
            self._thread.start()

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)
        if self._handle_run is not None:
            setattr(asyncio.events.Handle, "_run", self._handle_run)
            self._handle_run = None
        self._closed = True
        self._active.set()
        self._ack.set()
        if self._ticks:
            self._thread.join()

    @contextmanager
    def recording(self, label: str) -> Iterator[None]:
        self.samples.setdefault(label, [])
        self.collections.setdefault(label, [])
        self.collection_cpu.setdefault(label, [])
        self.callbacks.setdefault(label, CallbackStats())
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

    def _time_callbacks(self) -> None:
        original = asyncio.events.Handle._run
        monitor = self

        def timed_run(handle: asyncio.Handle) -> None:
            started_in = monitor._label
            if started_in is None:
                original(handle)
                return
            gc_before = monitor._gc_seconds
            c0 = time.thread_time()
            t0 = time.perf_counter()
            original(handle)
            seconds = time.perf_counter() - t0
            cpu = time.thread_time() - c0
            # A step that starts a recording (a driver entering ``recording``,
            # then submitting) is that recording's.
            stats = monitor.callbacks[monitor._label or started_in]
            stats.count += 1
            if seconds >= CALLBACK_NAMED_S:
                stats.note(handle._callback, seconds, monitor._gc_seconds - gc_before,  # type: ignore[attr-defined]
                           cpu)

        self._handle_run = original
        setattr(asyncio.events.Handle, "_run", timed_run)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_cpu_start = time.thread_time()
            self._gc_start = time.perf_counter()
            return
        pause = time.perf_counter() - self._gc_start
        cpu = time.thread_time() - self._gc_cpu_start
        self._gc_seconds += pause
        label = self._label
        if label is not None:
            self.collections[label].append((info["generation"], pause))
            self.collection_cpu[label].append(cpu)

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


LONG_COLLECTION_S = 10e-3


def gc_summary(collections: Sequence[tuple[int, float]]) -> dict[str, Any]:
    """Collections per generation (count, total and longest pause) and how
    many paused over 10 ms, from ``(generation, seconds)`` pairs."""
    out: dict[str, Any] = {}
    for gen in (0, 1, 2):
        pauses = [p for g, p in collections if g == gen]
        out[f"gen{gen}"] = {"count": len(pauses), "total_ms": sum(pauses) * 1e3,
                            "max_ms": max(pauses) * 1e3 if pauses else 0.0}
    out["over_10ms"] = sum(1 for _, p in collections if p > LONG_COLLECTION_S)
    return out


def longest_collection(
    collections: dict[str, list[tuple[int, float]]], cpu: dict[str, list[float]] | None = None
) -> dict[str, Any] | None:
    """The longest collection of these runs: its pause, generation and run,
    and (given ``cpu``, `LoopLagMonitor.collection_cpu`) the CPU time of the
    thread that ran it."""
    found = [(p, g, label, i) for label, v in collections.items() for i, (g, p) in enumerate(v)]
    if not found:
        return None
    pause, gen, label, i = max(found)
    out: dict[str, Any] = {"ms": pause * 1e3, "generation": gen, "label": label}
    mine = (cpu or {}).get(label)
    if mine is not None and i < len(mine):
        out["cpu_ms"] = mine[i] * 1e3
    return out


def callback_summary(stats: dict[str, CallbackStats]) -> dict[str, Any]:
    """The callbacks of these runs (label: `CallbackStats`): how many, and per
    owner the longest (its own time, its time with the collections inside it,
    what and where) and how many ran over 1 ms."""
    owners: dict[str, Any] = {}
    for owner in OWNERS:
        mine = [(st.longest[owner], label) for label, st in stats.items() if owner in st.longest]
        if not mine:
            owners[owner] = None
            continue
        rec, label = max(mine, key=lambda x: x[0].seconds)
        by_cpu, cpu_label = max(((st.longest_cpu[owner], lb) for lb, st in stats.items() if owner in st.longest_cpu),
                                key=lambda x: x[0].cpu_seconds)
        owners[owner] = {
            "longest_ms": rec.seconds * 1e3, "longest_gross_ms": rec.gross_seconds * 1e3, "name": rec.name,
            "label": label, "over_1ms": sum(st.over_1ms[owner] for st in stats.values()),
            "over_half_ms": sum(st.over_half_ms[owner] for st in stats.values()),
            "longest_cpu_ms": rec.cpu_seconds * 1e3,
            "longest_by_cpu": {"cpu_ms": by_cpu.cpu_seconds * 1e3, "wall_ms": by_cpu.seconds * 1e3,
                               "name": by_cpu.name, "label": cpu_label},
        }
    return {"callbacks": sum(st.count for st in stats.values()), "named_from_us": CALLBACK_NAMED_S * 1e6,
            "owners": owners}


def median_range(values: Sequence[float]) -> dict[str, float]:
    """The median, the least and the greatest of ``values`` (non-empty)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
