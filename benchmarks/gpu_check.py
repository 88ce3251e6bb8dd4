"""Device benchmark for a CUDA machine: kvtier's copies against raw DMA, every byte checked.

Writes one JSON document to ``--json`` (rewritten after every case, so that a
run cut short still leaves what it measured); stdout gets a few lines only
(status, byte checks, problems). Exit status 0 only when every byte check
passed, nothing was skipped for the deadline and no case raised.

* ``raw``: registered (``cudaHostRegister``, page-aligned, as kvtier's host
  pools) host<->device ``copy_`` of one large buffer, and of many separate
  copies of 2 KiB .. 2 MiB each, wall and CUDA-event device time; and
  ``registration_probe``: whether a copy across two registrations stays
  asynchronous on this driver (kvtier splits its copies there anyway);
* ``kvtier``: backup and load through the scheduler for ``layer_first`` and
  ``page_first`` host pools, page sizes 1, 16 and 64, per-layer and stacked
  device tensors, scattered disjoint source and destination pages. Per
  direction: end-to-end ``wall`` (submit to done, a backup's host scatters
  included), ``stream`` (the copy stream from first copy to last event,
  host enqueue gaps included), ``dma`` (the same batch queued behind a stall
  of the copy stream: device work alone), enqueue time, the copies issued and
  their sizes, and ``raw_same_copies``: those very copies replayed raw on
  registered memory (wall and DMA), with the ratios to it and to the large
  copy; time to the first layer of a load;
* ``load_under_backup_burst``: a one-page load's latency idle and while a
  burst of large backups runs;
* ``many_ops``: the same scattered one-page pages moved as one operation, as
  one ``backup``/``load`` call per page (single path) and as one
  ``backup_many``/``load_many`` call (bulk path), per host layout and device
  tensors: wall time, microseconds per operation, ratios to the one operation
  and to the raw large copy;
* ``scaling``: 10k / 50k / 100k one-page backups queued at once (a small
  shape, 2 KiB a slot), single and bulk path: microseconds per operation,
  resident memory per queued operation, collections, and largest over
  smallest per-operation time across the counts;
* ``loop``: the event loop's longest and p99 stall (a 1 ms ticker), counted
  only while timed runs are in flight; ``callbacks``: every callback the loop
  ran during them, timed (the longest of kvtier's own named), and the garbage
  collections (``gc``);
* ``checks``: every byte check. Before each repetition of every section the
  device rows get a pattern of their own (`Checker.pattern`), and after it
  both the backup (host rows against the device rows) and the load (device
  rows against their source) are compared bit for bit, outside the timed part.
  ``--plant bytes`` (or ``GPU_CHECK_PLANT=bytes``) flips one byte of every
  copy's destination before its check: the run must then fail every check and
  name every case.

Usage: ``python benchmarks/gpu_check.py [--quick] [--json PATH] [--deadline-s S] [--plant bytes]``.
``--device cpu`` runs the same code on CPU tensors as a smoke test, the CUDA
executor's routing included (through `HostBackend`); figures there mean
nothing. The whole device check, tests first, is ``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
RAW_COPY_SIZES = (2 * KiB, 8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB, 2 * MiB)


def quiet_logs() -> None:
    """kvtier logs through structlog; keep stdout for the JSON alone."""
    import structlog

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )


@dataclass(frozen=True)
class Sizes:
    layers: int
    slots: int  # device slots; a case moves half of them
    heads: int
    head_dim: int
    reps: int
    large_bytes: int
    raw_total_bytes: int  # per copy size, at most this many bytes ...
    raw_max_copies: int  # ... in at most this many copies
    burst_backups: int
    burst_slots: int  # slots per backup of the burst
    many_ops: int  # one-page operations of the many_ops cases (at most half the slots)
    scaling_counts: tuple[int, ...]
    scaling_reps: int


SCALING = (10_000, 50_000, 100_000)
FULL = Sizes(layers=32, slots=8192, heads=8, head_dim=128, reps=3, large_bytes=GiB,
             raw_total_bytes=256 * MiB, raw_max_copies=8192, burst_backups=8, burst_slots=512,
             many_ops=4096, scaling_counts=SCALING, scaling_reps=2)
QUICK = Sizes(layers=16, slots=4096, heads=8, head_dim=128, reps=2, large_bytes=256 * MiB,
              raw_total_bytes=64 * MiB, raw_max_copies=4096, burst_backups=4, burst_slots=256,
              many_ops=2048, scaling_counts=SCALING, scaling_reps=1)
SMOKE = Sizes(layers=4, slots=256, heads=2, head_dim=16, reps=2, large_bytes=4 * MiB,
              raw_total_bytes=1 * MiB, raw_max_copies=64, burst_backups=2, burst_slots=16,
              many_ops=64, scaling_counts=(64, 128, 256), scaling_reps=1)
# The scaling cases' shape: the CPU benchmark's TINY (32 layers, 1 x 16 bf16),
# 2 KiB a slot, so that 100k slots take 200 MiB on each side.
SCALING_SHAPE = (32, 1, 16)


class Device:
    """The device under test: streams, timing events and syncs, or their CPU
    stand-ins (no device time) for the smoke run."""

    def __init__(self, name: str) -> None:
        import torch

        self.torch = torch
        self.cuda = name != "cpu"
        self.device = torch.device(name)
        self._cycles_per_s: float | None = None
        self._host: Any = None
        self._host_release: Any = None

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def event(self, stream: Any = None) -> Any:
        if not self.cuda:
            return None
        ev = self.torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        ev.record(stream)
        return ev

    @staticmethod
    def elapsed_s(start: Any, end: Any) -> float | None:
        if start is None or end is None:
            return None
        return float(start.elapsed_time(end)) / 1e3

    def host_empty(self, n: int) -> Any:
        """``n`` bytes of host memory as kvtier's host pools hold it: page-aligned
        and registered with ``cudaHostRegister`` (in 1 GiB chunks), not torch's
        pinned allocator. One buffer, grown when a larger one is asked for and
        shared by every raw baseline (registering is slow; the figures are not
        about it)."""
        from kvtier.pools.host import aligned_empty, register_pinned

        if self._host is None or self._host.numel() < n:
            if self._host_release is not None:
                self._host_release()
            self._host = aligned_empty((n,), self.torch.uint8)
            self._host_release = register_pinned(self._host) if self.cuda else None
        return self._host[:n]

    def new_stream(self) -> Any:
        return self.torch.cuda.Stream(self.device) if self.cuda else None  # type: ignore[no-untyped-call]

    def on(self, stream: Any) -> Any:
        import contextlib

        return self.torch.cuda.stream(stream) if self.cuda and stream is not None else contextlib.nullcontext()

    def stall(self, stream: Any, seconds: float) -> None:
        """Keep ``stream`` busy for about ``seconds``, so that work enqueued
        next queues up behind it and then runs back to back (CUDA only)."""
        if not self.cuda:
            return
        torch = self.torch
        if self._cycles_per_s is None:
            cycles = 20_000_000
            with torch.cuda.stream(stream):
                a = self.event(stream)
                torch.cuda._sleep(cycles)
                b = self.event(stream)
            b.synchronize()
            self._cycles_per_s = cycles / max(1e-6, self.elapsed_s(a, b) or 1e-6)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(seconds * self._cycles_per_s))

    def fence(self) -> Any:
        """What a backup or load waits for: the work enqueued so far on the
        current stream (which filled or zeroed the rows)."""
        return self.torch.cuda.current_stream() if self.cuda else None


class HostStream:
    def wait_event(self, event: Any) -> None:
        pass


class HostEvent:
    """A CPU stand-in for a CUDA event: complete when recorded."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def record(self, stream: Any = None) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.at - self.at) * 1e3


class HostBackend:
    """`kvtier.transfers.cuda.DeviceBackend` on the CPU, synchronous: the smoke
    run drives the CUDA executor's own routing (direct runs, staging, host
    scatters, registration cuts) with it, so its bytes are checked here too."""

    def __init__(self) -> None:
        self._stream = HostStream()

    def new_stream(self) -> Any:
        return HostStream()

    def new_event(self, *, timing: bool = False) -> Any:
        return HostEvent()

    def use_stream(self, stream: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def current_stream(self) -> Any:
        return self._stream

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def gather(self, src: Any, index: Any) -> Any:
        return src.index_select(0, index)

    def scatter(self, dst: Any, index: Any, src: Any) -> None:
        dst.index_copy_(0, index, src)

    def to_device(self, t: Any) -> Any:
        return t.clone()

    def device_empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        import torch

        return torch.empty(shape, dtype=dtype)

    def pinned_empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        import torch

        return torch.empty(shape, dtype=dtype)


class RecordingBackend:
    """Passes every call to ``inner``; while ``log`` is a list, appends the
    size in bytes of every host<->device copy the executor issues."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.log: list[int] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def copy(self, dst: Any, src: Any) -> None:
        if self.log is not None:
            self.log.append(dst.numel() * dst.element_size())
        self.inner.copy(dst, src)


# -- byte checks ------------------------------------------------------------------


PLANTS = ("bytes",)


def bits(t: Any) -> Any:
    """``t`` as integers of the same width: compared bit for bit (a NaN pattern
    equals itself), and XOR-able."""
    import torch

    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(kind)


class Checker:
    """Every byte check of the run, and the patterns that make each repetition's
    bytes its own.

    `pattern` XORs every element of a set of device tensors with a key new to
    the run (the previous key undone first), so stale rows left by an earlier
    repetition never pass for this one's. `backup` compares the host rows a
    backup wrote with the device rows it read; `load` the device rows a load
    wrote with the rows they came from. With ``plant="bytes"`` one byte of each
    copy's destination is flipped after the copy and before its check: every
    check must then fail (the check of the check).
    """

    def __init__(self, dev: Device, plant: str | None) -> None:
        self.dev = dev
        self.plant = plant
        self.keys: dict[int, int] = {}
        self.next_key = 0x1357
        self.results: list[dict[str, Any]] = []

    def pattern(self, tensors: list[list[Any]]) -> None:
        old = self.keys.get(id(tensors), 0)
        self.next_key = (self.next_key * 5 + 0x2A3) % 0x7FFF or 1
        new = self.next_key
        for layer in tensors:
            for t in layer:
                bits(t).bitwise_xor_(old ^ new)
        self.keys[id(tensors)] = new

    def _record(self, case: str, what: str, ok: bool) -> bool:
        self.results.append({"case": case, "what": what, "ok": ok})
        return ok

    def backup(self, case: str, what: str, host: Any, host_rows: Any, tensors: list[list[Any]], src: Any) -> bool:
        """Host rows ``host_rows`` of pool ``host`` against device rows ``src``
        of ``tensors`` (per layer, per plane), every layer and plane."""
        torch = self.dev.torch
        host_rows = host_rows.to("cpu")
        if self.plant == "bytes":
            bits(host.layer_view(0, 0)[int(host_rows[0])]).view(-1)[:1].bitwise_xor_(1)
        rows_dev = host_rows.to(self.dev.device)
        src_dev = src.to(self.dev.device)
        ok = True
        for p in range(len(tensors[0])):
            # The whole plane to the device in one copy, compared there.
            whole = host.buffer(p).to(self.dev.device)
            for j, layer in enumerate(tensors):
                view = whole[j] if host.layout == "layer_first" else whole[:, j]
                stored, source = view.index_select(0, rows_dev), layer[p].index_select(0, src_dev)
                ok = ok and bool(torch.equal(bits(stored), bits(source)))
            del whole
        return self._record(case, what, ok)

    def load(self, case: str, what: str, tensors: list[list[Any]], src: Any, dst: Any) -> bool:
        """Device rows ``dst`` against rows ``src`` of the same tensors."""
        torch = self.dev.torch
        src_dev, dst_dev = src.to(self.dev.device), dst.to(self.dev.device)
        if self.plant == "bytes":
            # Not where a planted backup left its flip: two flips of one bit would cancel.
            bits(tensors[-1][-1][int(dst[-1])]).view(-1)[-1:].bitwise_xor_(2)
        ok = all(bool(torch.equal(bits(t.index_select(0, dst_dev)), bits(t.index_select(0, src_dev))))
                 for layer in tensors for t in layer)
        return self._record(case, what, ok)

    def summary(self) -> dict[str, Any]:
        failed = [r for r in self.results if not r["ok"]]
        cases = sorted({r["case"] for r in self.results})
        return {"checks": len(self.results), "passed": len(self.results) - len(failed), "cases": cases,
                "failed_cases": sorted({r["case"] for r in failed}),
                "failed": [f"{r['case']}: {r['what']}" for r in failed], "plant": self.plant}


# -- raw baselines on registered memory, kvtier's copy sizes ------------------------


def raw_replay(dev: Device, copy_sizes: Sequence[int], direction: str, reps: int) -> dict[str, Any]:
    """The copies one kvtier batch issued (``copy_sizes``, in order) as raw
    ``copy_`` calls between registered host memory and the device, on a
    stream of their own: wall time (enqueue to done, median of ``reps``) and
    DMA time (the same copies queued behind a stall, CUDA events around the
    copies only)."""
    torch = dev.torch
    total = sum(copy_sizes)
    out: dict[str, Any] = {"copies": len(copy_sizes), "bytes": total}
    if not copy_sizes:
        return out
    host = dev.host_empty(total)
    host.fill_(3)
    device = torch.empty(total, dtype=torch.uint8, device=dev.device)
    spans, at = [], 0
    for n in copy_sizes:
        spans.append((at, n))
        at += n
    dst, src = (device, host) if direction == "h2d" else (host, device)
    stream = dev.new_stream()
    walls: list[float] = []
    dmas: list[float | None] = []
    for rep in range(reps + 1):  # the first is a warm-up
        dev.sync()
        t = time.perf_counter()
        with dev.on(stream):
            for o, n in spans:
                dst[o : o + n].copy_(src[o : o + n], non_blocking=True)
        dev.sync()
        wall = time.perf_counter() - t
        if dev.cuda:
            dev.stall(stream, 1.2 * wall + 0.002)
            with dev.on(stream):
                start = dev.event(stream)
                for o, n in spans:
                    dst[o : o + n].copy_(src[o : o + n], non_blocking=True)
                end = dev.event(stream)
            dev.sync()
            if rep:
                dmas.append(dev.elapsed_s(start, end))
        if rep:
            walls.append(wall)
    wall_s, dma_s = median(walls), median(dmas)
    out |= {"wall_ms": _ms(wall_s), "wall_gbps": gbps(total, wall_s), "dma_ms": _ms(dma_s),
            "dma_gbps": gbps(total, dma_s)}
    return out


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return None if not seconds else nbytes / seconds / 1e9


def median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# -- raw DMA -------------------------------------------------------------------


QUEUED_COPIES = 512  # few enough to be enqueued behind a 20 ms device sleep without blocking the host
SLEEP_CYCLES = 40_000_000  # about 20 ms at 2 GHz


def raw_copies(dev: Device, copy_bytes: int, copies: int, reps: int) -> dict[str, Any]:
    """``copies`` separate pinned<->device copies of ``copy_bytes`` each, at
    shuffled offsets, both directions: wall and device time (median of reps).

    Device time spans the first to the last copy on the stream, so for small
    copies it is bounded by how fast the host enqueues them. ``queued`` is the
    copy engine alone: up to 512 copies enqueued while the stream sleeps, then
    timed on the device as they run back to back."""
    torch = dev.torch
    total = copy_bytes * copies
    host = dev.host_empty(total)
    host.fill_(3)
    device = torch.empty(total, dtype=torch.uint8, device=dev.device)
    offsets = (torch.randperm(copies, generator=torch.Generator().manual_seed(copies)) * copy_bytes).tolist()
    out: dict[str, Any] = {"copy_bytes": copy_bytes, "copies": copies, "bytes": total}
    for name, dst, src in (("h2d", device, host), ("d2h", host, device)):
        walls, devs = [], []
        for _ in range(reps + 1):  # the first is a warm-up
            dev.sync()
            t = time.perf_counter()
            start = dev.event()
            for o in offsets:
                dst[o : o + copy_bytes].copy_(src[o : o + copy_bytes], non_blocking=True)
            end = dev.event()
            dev.sync()
            walls.append(time.perf_counter() - t)
            devs.append(dev.elapsed_s(start, end))
        wall, device_s = median(walls[1:]), median(devs[1:])
        out[name] = {
            "wall_gbps": gbps(total, wall), "device_gbps": gbps(total, device_s),
            "us_per_copy_wall": None if wall is None else wall / copies * 1e6,
            "us_per_copy_device": None if device_s is None else device_s / copies * 1e6,
        }
        if dev.cuda:
            q = min(copies, QUEUED_COPIES)
            queued = []
            for _ in range(reps):
                dev.sync()
                torch.cuda._sleep(SLEEP_CYCLES)  # the copies below queue up behind it
                start = dev.event()
                for o in offsets[:q]:
                    dst[o : o + copy_bytes].copy_(src[o : o + copy_bytes], non_blocking=True)
                end = dev.event()
                dev.sync()
                queued.append(dev.elapsed_s(start, end))
            qs = median(queued)
            out[name]["queued"] = {"copies": q, "device_gbps": gbps(q * copy_bytes, qs),
                                   "us_per_copy": None if qs is None else qs / q * 1e6}
    return out


def registration_probe(dev: Device) -> dict[str, Any] | None:
    """A fact of the driver, not of kvtier: does a non-blocking copy whose host
    range spans two adjacent ``cudaHostRegister`` registrations stay
    asynchronous (return while the stream is still busy) and land intact?
    kvtier never issues one (it splits runs at the cuts); the answer says
    whether it has to. One inside one registration is the control."""
    if not dev.cuda:
        return None
    from kvtier.pools.host import aligned_empty, register_pinned

    torch = dev.torch
    chunk = 1 << 20
    host = aligned_empty((2 * chunk,), torch.uint8)
    release = register_pinned(host, chunk)
    device = torch.arange(2 * chunk, device=dev.device).to(torch.uint8)
    stream = dev.new_stream()
    out: dict[str, Any] = {}
    try:
        for name, lo, hi in (("within_one", 0, chunk), ("across_two", chunk // 2, chunk + chunk // 2)):
            host.zero_()
            dev.sync()
            dev.stall(stream, 0.05)
            with dev.on(stream):
                busy = dev.event(stream)
                host[lo:hi].copy_(device[lo:hi], non_blocking=True)
                returned_while_busy = not busy.query()
            stream.synchronize()
            out[name] = {"returned_while_stream_busy": returned_while_busy,
                         "bytes_match": bool(torch.equal(host[lo:hi], device[lo:hi].cpu()))}
    finally:
        release()
    return out


def raw_section(dev: Device, sizes: Sizes) -> dict[str, Any]:
    chunked = []
    for c in RAW_COPY_SIZES:
        copies = max(1, min(sizes.raw_max_copies, sizes.raw_total_bytes // c))
        chunked.append(raw_copies(dev, c, copies, sizes.reps))
    return {"large": raw_copies(dev, sizes.large_bytes, 1, sizes.reps), "chunked": chunked,
            "registration_probe": registration_probe(dev)}


# -- the event loop's stalls ----------------------------------------------------


class Ticker:
    """How late a 1 ms sleep on the loop wakes up, counted only while armed
    (during timed runs, not set-up)."""

    def __init__(self) -> None:
        self.armed = False
        self.running = True
        self.lateness: list[float] = []

    async def run(self) -> None:
        import anyio

        while self.running:
            t = time.perf_counter()
            armed = self.armed
            await anyio.sleep(0.001)
            if armed and self.armed:
                self.lateness.append(max(0.0, time.perf_counter() - t - 0.001))

    def summary(self) -> dict[str, Any]:
        xs = sorted(self.lateness)
        if not xs:
            return {"ticks": 0, "max_stall_ms": None, "p99_stall_ms": None}
        return {"ticks": len(xs), "max_stall_ms": xs[-1] * 1e3, "p99_stall_ms": xs[int(0.99 * (len(xs) - 1))] * 1e3}


# -- kvtier cases ---------------------------------------------------------------


class Tensors:
    """Device K/V planes, made once and shared by every case: per-layer
    tensors, and one stacked ``[layers, slots, ...]`` tensor per plane."""

    def __init__(self, dev: Device, sizes: Sizes) -> None:
        torch = dev.torch
        gen = torch.Generator(device=dev.device).manual_seed(0)
        shape = (sizes.slots, sizes.heads, sizes.head_dim)

        def rand(*s: int) -> Any:
            return torch.randn(s, device=dev.device, generator=gen).to(torch.bfloat16)

        self.per_layer = [[rand(*shape), rand(*shape)] for _ in range(sizes.layers)]
        stacked = [rand(sizes.layers, *shape), rand(sizes.layers, *shape)]
        self.stacked = [[stacked[0][j], stacked[1][j]] for j in range(sizes.layers)]
        self.row_bytes = sizes.heads * sizes.head_dim * 2  # one plane, one slot, one layer
        dev.sync()

    def layers(self, kind: str) -> list[list[Any]]:
        return self.per_layer if kind == "per_layer" else self.stacked


def disjoint_pages(npages: int, moved: int, page_size: int, seed: int) -> tuple[Any, Any]:
    """Slot indices of ``moved`` scattered source pages and as many
    destination pages, drawn without overlap (so that a load never overwrites
    the rows it is compared against)."""
    import torch

    if 2 * moved > npages:
        raise ValueError(f"need 2 * {moved} disjoint pages; the pool has {npages}")
    perm = torch.randperm(npages, generator=torch.Generator().manual_seed(seed))
    offs = torch.arange(page_size)
    src = (perm[:moved, None] * page_size + offs).reshape(-1)
    dst = (perm[moved : 2 * moved, None] * page_size + offs).reshape(-1)
    return src, dst


def executor_for(dev: Device) -> Any:
    """kvtier's CUDA executor, on the device or (smoke run) on `HostBackend`,
    behind a `RecordingBackend`: ``executor.backend.log`` collects copy sizes."""
    from kvtier.transfers.cuda import CudaExecutor, TorchCudaBackend

    inner = TorchCudaBackend(dev.device) if dev.cuda else HostBackend()
    return CudaExecutor(backend=RecordingBackend(inner), timing=True)


def executor_seconds(ex: Any) -> tuple[float | None, float | None]:
    """(enqueue seconds, device seconds) so far."""
    s = ex.statistics()
    return s.enqueue_seconds, s.device_seconds


def zero_rows(tensors: list[list[Any]], idx: Any) -> None:
    for layer in tensors:
        for t in layer:
            t.index_fill_(0, idx, 0)


async def kvtier_case(dev: Device, sizes: Sizes, shared: Tensors, ticker: Ticker, monitor: Any, checker: Checker,
                      *, layout: str, page_size: int, device_tensors: str) -> dict[str, Any]:
    """Backup then load of half the device pages, scattered, into disjoint
    pages; every repetition with its own pattern, both copies checked. Then
    one more repetition of each behind a stall of the copy stream (DMA time),
    and the raw baseline: the copies the executor issued, replayed."""
    from kvtier import DevicePool, PoolGroup, SchedulerConfig, TransferScheduler
    from kvtier.transfers import Direction

    tensors = shared.layers(device_tensors)
    npages = sizes.slots // page_size
    moved = npages // 2
    src, dst = disjoint_pages(npages, moved, page_size, seed=page_size)
    src_dev, dst_dev = src.to(dev.device), dst.to(dev.device)
    name = f"{layout}/p{page_size}/{device_tensors}"
    group = PoolGroup()
    group.add_pool("kv", device=DevicePool(tensors), page_size=page_size, host_slots=moved * page_size,
                   layout=layout)  # type: ignore[arg-type]
    host = group["kv"].host
    nbytes = len(src) * group["kv"].slot_nbytes
    ex = executor_for(dev)
    recorder = ex.backend
    runs: dict[str, list[dict[str, float | None]]] = {"backup": [], "load": []}
    issued: dict[str, list[int]] = {}
    dma: dict[str, float | None] = {}
    stalls: dict[str, float] = {}
    first_layer: list[float] = []
    try:
        async with TransferScheduler(group, executor=ex, config=SchedulerConfig(max_batch_bytes=1 << 40)) as sched:
            for rep in range(sizes.reps + 2):  # rep 0 warms up (and records the copies); the last is the DMA one
                timed = 0 < rep <= sizes.reps
                queued = rep == sizes.reps + 1
                checker.pattern(tensors)
                zero_rows(tensors, dst_dev)
                ticker.armed = timed
                with monitor.recording(f"one_op:{name}") if timed else _untimed():
                    recorder.log = [] if rep == 0 else None
                    if queued:
                        stalls["backup"] = 1.2 * (median([r["wall"] for r in runs["backup"]]) or 0) + 0.005
                        dev.stall(ex.stream(Direction.BACKUP), stalls["backup"])
                    e0, d0 = executor_seconds(ex)
                    t0 = time.perf_counter()
                    b = await sched.backup({"kv": src}, after=dev.fence())
                    await b
                    t1 = time.perf_counter()
                    e1, d1 = executor_seconds(ex)
                    if rep == 0:
                        issued["d2h"] = recorder.log
                ticker.armed = False
                checker.backup(name, f"backup rep {rep}", host, b.host_indices["kv"], tensors, src)
                ticker.armed = timed
                with monitor.recording(f"one_op:{name}") if timed else _untimed():
                    recorder.log = [] if rep == 0 else None
                    if queued:
                        stalls["load"] = 1.2 * (median([r["wall"] for r in runs["load"]]) or 0) + 0.005
                        dev.stall(ex.stream(Direction.LOAD), stalls["load"])
                    e2, d2 = executor_seconds(ex)
                    t2 = time.perf_counter()
                    ld = await sched.load(b.host_indices, {"kv": dst}, after=dev.fence())
                    await ld.layer_ready(0)
                    t_first = time.perf_counter()
                    await ld
                    t3 = time.perf_counter()
                    e3, d3 = executor_seconds(ex)
                    if rep == 0:
                        issued["h2d"] = recorder.log
                    recorder.log = None
                ticker.armed = False
                checker.load(name, f"load rep {rep}", tensors, src, dst)
                sched.free_host(b.host_indices)
                if queued and dev.cuda:
                    dma = {"backup": _delta(d0, d1), "load": _delta(d2, d3)}
                if not timed:
                    continue
                for op, wall, enq, device_s in (
                    ("backup", t1 - t0, _delta(e0, e1), _delta(d0, d1)),
                    ("load", t3 - t2, _delta(e2, e3), _delta(d2, d3)),
                ):
                    runs[op].append({"wall": wall, "enqueue": enq, "device": device_s})
                first_layer.append(t_first - t2)
    finally:
        ticker.armed = False
        group.close()
    out: dict[str, Any] = {
        "layout": layout, "page_size": page_size, "device_tensors": device_tensors,
        "bytes": nbytes, "pages": moved, "page_copy_bytes": page_size * shared.row_bytes,
        "load_first_layer_ms": _ms(median(first_layer)),
    }
    for op, direction in (("backup", "d2h"), ("load", "h2d")):
        r = runs[op]
        wall_s, device_s = median([x["wall"] for x in r]), median([x["device"] for x in r])
        copies = issued.get(direction) or []
        out[op] = {
            # End to end: submit to handle done, a backup's host scatters included.
            "wall_ms": _ms(wall_s), "wall_gbps": gbps(nbytes, wall_s),
            # The copy stream from the batch's first copy to its last event:
            # includes gaps while the host was still enqueuing.
            "stream_ms": _ms(device_s), "stream_gbps": gbps(nbytes, device_s),
            # The same batch queued behind a stall: device work alone, no host gaps.
            "dma_ms": _ms(dma.get(op)), "dma_gbps": gbps(nbytes, dma.get(op)),
            "enqueue_ms": _ms(median([x["enqueue"] for x in r])),
            "copies": len(copies), "copy_bytes": _spread_bytes(copies),
            "raw_same_copies": raw_replay(dev, copies, direction, sizes.reps),
        }
    return out


def _spread_bytes(xs: Sequence[int]) -> dict[str, Any]:
    if not xs:
        return {"min": None, "median": None, "max": None, "total": 0}
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "total": sum(xs)}


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def add_many_ops_ratios(case: dict[str, Any], raw: dict[str, Any]) -> None:
    """kvtier / the raw large copy, same direction, wall time, per path."""
    large = raw.get("large") or {}
    for name, direction in (("backup", "d2h"), ("load", "h2d")):
        for part in case[name].values():
            part["vs_raw_large"] = ratio(part["wall_gbps"], (large.get(direction) or {}).get("wall_gbps"))


def add_ratios(case: dict[str, Any], raw: dict[str, Any]) -> None:
    """kvtier / raw, same direction: against the large copy (wall), and
    against the raw replay of the very copies kvtier issued on registered
    memory, end to end (wall) and DMA alone."""
    large = raw.get("large") or {}
    for name, direction in (("backup", "d2h"), ("load", "h2d")):
        c = case[name]
        same = c["raw_same_copies"]
        c["vs_raw_large"] = ratio(c["wall_gbps"], (large.get(direction) or {}).get("wall_gbps"))
        c["vs_raw_same_copies_wall"] = ratio(c["wall_gbps"], same.get("wall_gbps"))
        c["vs_raw_same_copies_dma"] = ratio(c["dma_gbps"], same.get("dma_gbps"))


async def load_under_burst(
    dev: Device, sizes: Sizes, shared: Tensors, ticker: Ticker, monitor: Any, checker: Checker
) -> dict[str, Any]:
    """A one-page load (page 16, layer_first) idle, then while a burst of
    backups runs; latency from submit to done. Each repetition has its own
    pattern: the small page is backed up again, the last small load and every
    backup of the burst are checked."""
    from kvtier import DevicePool, PoolGroup, SchedulerConfig, TransferScheduler

    import anyio

    page = 16
    tensors = shared.per_layer
    npages = sizes.slots // page
    burst_pages = sizes.burst_backups * (sizes.burst_slots // page)
    if burst_pages + 2 > npages:
        raise ValueError(f"the burst needs {burst_pages} pages and the small load 2; the pool has {npages}")
    group = PoolGroup()
    group.add_pool("kv", device=DevicePool(tensors), page_size=page, host_slots=(burst_pages + 1) * page,
                   layout="layer_first")
    host = group["kv"].host
    src_small = dev.torch.arange(0, page)
    dst_small = dev.torch.arange((npages - 1) * page, npages * page)  # the burst reads pages 1..burst_pages
    idle: list[float] = []
    busy: list[float] = []
    bursts = 0
    try:
        async with TransferScheduler(group, executor=executor_for(dev), config=SchedulerConfig()) as sched:
            small_host: dict[str, Any] = {}

            async def small_backup(what: str) -> None:
                checker.pattern(tensors)
                if small_host:
                    sched.free_host(small_host)
                b = await sched.backup({"kv": src_small}, after=dev.fence())
                await b
                small_host.clear()
                small_host.update(b.host_indices)
                checker.backup("burst", f"small backup {what}", host, small_host["kv"], tensors, src_small)

            async def one_load() -> float:
                t = time.perf_counter()
                ld = await sched.load(small_host, {"kv": dst_small}, after=dev.fence())
                await ld
                return time.perf_counter() - t

            await small_backup("idle")
            await one_load()  # warm-up
            ticker.armed = True
            with monitor.recording("burst:idle"):
                for _ in range(20):
                    idle.append(await one_load())
            ticker.armed = False
            checker.load("burst", "small load idle", tensors, src_small, dst_small)
            for rep in range(sizes.reps):
                await small_backup(f"rep {rep + 1}")
                zero_rows(tensors, dst_small.to(dev.device))
                ticker.armed = True
                loads_before = len(busy)
                with monitor.recording("burst:burst"):
                    handles, sources = [], []
                    for i in range(sizes.burst_backups):
                        lo = (1 + i * (sizes.burst_slots // page)) * page
                        burst = dev.torch.arange(lo, lo + sizes.burst_slots)
                        sources.append(burst)
                        handles.append(await sched.backup({"kv": burst}, after=dev.fence()))
                    while not all(h.done() for h in handles):
                        busy.append(await one_load())
                    for h in handles:
                        await h
                ticker.armed = False
                if len(busy) == loads_before:  # the burst ended before a load was timed
                    await one_load()
                checker.load("burst", f"small load rep {rep + 1}", tensors, src_small, dst_small)
                for i, (h, burst) in enumerate(zip(handles, sources)):
                    checker.backup("burst", f"burst backup {i} rep {rep + 1}", host, h.host_indices["kv"], tensors,
                                   burst)
                    sched.free_host(h.host_indices)
                bursts += 1
                await anyio.sleep(0)
    finally:
        ticker.armed = False
        group.close()
    burst_bytes = sizes.burst_backups * sizes.burst_slots * group["kv"].slot_nbytes
    return {
        "load_bytes": page * group["kv"].slot_nbytes, "burst_bytes": burst_bytes, "bursts": bursts,
        "idle_ms": _spread(idle), "during_burst_ms": _spread(busy),
    }


def _spread(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0, "p50": None, "max": None}
    return {"n": len(xs), "p50": statistics.median(xs) * 1e3, "max": max(xs) * 1e3}


def _untimed() -> Any:
    import contextlib

    return contextlib.nullcontext()


PATHS = ("one", "single", "bulk")


async def many_ops_case(dev: Device, sizes: Sizes, shared: Tensors, ticker: Ticker, monitor: Any,
                        checker: Checker, *, layout: str, device_tensors: str) -> dict[str, Any]:
    """``sizes.many_ops`` scattered one-page (page size 1) operations: a backup
    of them, then a load of what it wrote into disjoint pages, as one
    operation of all the pages, as a ``backup``/``load`` call per page, all
    submitted before any is awaited (single), and as one
    ``backup_many``/``load_many`` call (bulk); the three alternate (A B C,
    C B A, ...). Every run has its own pattern, and its backup and its load
    are checked byte for byte (outside the timed part). The rows are
    synchronized before each timed run, so no fences are passed."""
    from kvtier import DevicePool, PoolGroup, TransferScheduler

    torch = dev.torch
    tensors = shared.layers(device_tensors)
    n = sizes.many_ops
    src, dst = disjoint_pages(sizes.slots, n, 1, seed=11)
    dst_dev = dst.to(dev.device)
    src_parts = [{"kv": t} for t in torch.split(src, 1)]
    dst_parts = [{"kv": t} for t in torch.split(dst, 1)]
    group = PoolGroup()
    group.add_pool("kv", device=DevicePool(tensors), page_size=1, host_slots=2 * n,
                   layout=layout)  # type: ignore[arg-type]
    host_pool = group["kv"].host
    nbytes = n * group["kv"].slot_nbytes
    ex = executor_for(dev)
    walls: dict[str, list[float]] = {f"{d}:{p}": [] for d in ("backup", "load") for p in PATHS}
    batches: dict[str, list[int]] = {k: [] for k in walls}
    label = f"many_ops:{layout}:{device_tensors}"
    case = f"many_ops/{layout}/{device_tensors}"
    try:
        async with TransferScheduler(group, executor=ex) as sched:

            async def backup(path: str) -> list[Any]:
                if path == "one":
                    hs = [await sched.backup({"kv": src})]
                elif path == "single":
                    hs = [await sched.backup(r) for r in src_parts]
                else:
                    hs = await sched.backup_many(src_parts)
                for h in hs:
                    await h
                return hs

            async def load(path: str, backups: list[Any]) -> None:
                if path == "one":
                    hs = [await sched.load(backups[0].host_indices, {"kv": dst})]
                elif path == "single":
                    hs = [await sched.load(b.host_indices, d) for b, d in zip(backups, dst_parts)]
                else:
                    hs = await sched.load_many([b.host_indices for b in backups], dst_parts)
                for h in hs:
                    await h

            async def timed_step(key: str, timed: bool, step: Any) -> Any:
                direction = key.partition(":")[0]
                dev.sync()
                st = sched.statistics()
                before = (st.backup if direction == "backup" else st.load).batches
                ticker.armed = timed
                with monitor.recording(f"{label}:{key}") if timed else _untimed():
                    t0 = time.perf_counter()
                    result = await step
                    wall = time.perf_counter() - t0
                ticker.armed = False
                if timed:
                    st = sched.statistics()
                    walls[key].append(wall)
                    batches[key].append((st.backup if direction == "backup" else st.load).batches - before)
                return result

            for rep in range(sizes.reps + 1):  # rep 0 warms up
                timed = rep > 0
                order = PATHS if rep % 2 == 0 else tuple(reversed(PATHS))
                for path in order:
                    checker.pattern(tensors)
                    zero_rows(tensors, dst_dev)
                    hs = await timed_step(f"backup:{path}", timed, backup(path))
                    host = torch.cat([h.host_indices["kv"] for h in hs])
                    checker.backup(case, f"backup {path} rep {rep}", host_pool, host, tensors, src)
                    await timed_step(f"load:{path}", timed, load(path, hs))
                    checker.load(case, f"load {path} rep {rep}", tensors, src, dst)
                    sched.free_host({"kv": host})
    finally:
        ticker.armed = False
        group.close()
    out: dict[str, Any] = {"layout": layout, "device_tensors": device_tensors, "operations": n, "page_size": 1,
                           "bytes": nbytes}
    for direction in ("backup", "load"):
        one = median(walls[f"{direction}:one"])
        part: dict[str, Any] = {}
        for path in PATHS:
            seconds = median(walls[f"{direction}:{path}"])
            part[path] = {
                "wall_ms": _ms(seconds), "wall_gbps": gbps(nbytes, seconds),
                "us_per_op": None if seconds is None else seconds / (1 if path == "one" else n) * 1e6,
                "vs_one_op": ratio(one, seconds), "batches": median([float(b) for b in batches[f"{direction}:{path}"]]),
            }
        out[direction] = part
    return out


async def scaling_section(dev: Device, sizes: Sizes, monitor: Any, checker: Checker) -> dict[str, Any]:
    """``sizes.scaling_counts`` one-page backups queued at once, single path
    (every ``backup`` call, then every handle awaited) and bulk path (one
    ``backup_many``), through the device's executor at `SCALING_SHAPE`: one
    set of device tensors with a slot per operation of the largest count, a
    host pool of exactly ``n`` pages per count, lanes bounded above the
    largest count. Per run: microseconds per operation, submission time,
    resident memory per queued operation, batches, collections."""
    from kvtier import DevicePool, PoolGroup, SchedulerConfig, TransferScheduler
    from kvtier.bench.core import gc_summary, rss_bytes, trim_heap

    torch = dev.torch
    counts = sizes.scaling_counts
    layers, heads, head_dim = SCALING_SHAPE
    slots = max(counts)
    gen = torch.Generator(device=dev.device).manual_seed(3)
    tensors = [[torch.randn((slots, heads, head_dim), device=dev.device, generator=gen).to(torch.bfloat16)
                for _ in range(2)] for _ in range(layers)]
    dev.sync()
    config = SchedulerConfig(max_queued_ops=slots)
    rows: list[dict[str, Any]] = []
    for n in counts:
        group = PoolGroup()
        group.add_pool("kv", device=DevicePool(tensors), page_size=1, host_slots=n, layout="page_first")
        requests = [{"kv": t} for t in torch.split(torch.arange(n), 1)]
        runs: dict[str, list[dict[str, Any]]] = {"single": [], "bulk": []}
        try:
            async with TransferScheduler(group, executor=executor_for(dev), config=config) as sched:
                few = requests[: min(n, 1024)]  # warm-up: the scheduler's and executor's first batches
                for bulk in (False, True):
                    hs = await sched.backup_many(few) if bulk else [await sched.backup(r) for r in few]
                    for h in hs:
                        await h
                    sched.free_host({"kv": torch.cat([h.host_indices["kv"] for h in hs])})
                for rep in range(1, sizes.scaling_reps + 1):
                    for path in ("single", "bulk") if rep % 2 == 1 else ("bulk", "single"):
                        trim_heap()
                        rss0 = rss_bytes()
                        label = f"scaling:{path}:{n}"
                        checker.pattern(tensors)
                        dev.sync()
                        before = sched.statistics().backup.batches
                        collections = len(monitor.collections.get(label, []))
                        with monitor.recording(label):
                            t0 = time.perf_counter()
                            hs = [await sched.backup(r) for r in requests] if path == "single" else \
                                await sched.backup_many(requests)
                            submitted = time.perf_counter()
                            rss1 = rss_bytes()
                            t1 = time.perf_counter()
                            for h in hs:
                                await h
                            done = time.perf_counter()
                        host = torch.cat([h.host_indices["kv"] for h in hs])
                        del hs
                        checker.backup("scaling", f"{path} {n} rep {rep}", group["kv"].host, host, tensors,
                                       torch.arange(n))
                        sched.free_host({"kv": torch.arange(n)})  # every page of the pool is the run's
                        runs[path].append({
                            "seconds": (submitted - t0) + (done - t1), "submit_seconds": submitted - t0,
                            "rss_bytes": None if rss0 is None or rss1 is None else rss1 - rss0,
                            "batches": sched.statistics().backup.batches - before,
                            "collections": len(monitor.collections.get(label, [])) - collections,
                        })
        finally:
            group.close()
        for path, rs in runs.items():
            rss = [r["rss_bytes"] / n for r in rs if r["rss_bytes"] is not None]
            rows.append({
                "path": path, "operations": n,
                "us_per_op": median([r["seconds"] / n * 1e6 for r in rs]),
                "submit_us_per_op": median([r["submit_seconds"] / n * 1e6 for r in rs]),
                "rss_bytes_per_op": median(rss), "batches": median([float(r["batches"]) for r in rs]),
                "collections": median([float(r["collections"]) for r in rs]),
                "gc": gc_summary(monitor.collections.get(f"scaling:{path}:{n}", [])),
            })
    del tensors
    flat: dict[str, float | None] = {}
    for path in ("single", "bulk"):
        per_op: list[float] = [r["us_per_op"] for r in rows if r["path"] == path and r["us_per_op"] is not None]
        flat[path] = max(per_op) / min(per_op) if len(per_op) == len(counts) else None
    return {"shape": {"layers": layers, "heads": heads, "head_dim": head_dim, "dtype": "bfloat16"},
            "counts": list(counts), "max_queued_ops": config.max_queued_ops, "rows": rows,
            "max_over_min": flat}


# -- the run --------------------------------------------------------------------


class Report:
    """The JSON document, rewritten whole (atomically) after every step."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"status": "running", "errors": [], "skipped": []}
        self.checker: Checker | None = None

    def save(self) -> None:
        if self.checker is not None:
            self.doc["checks"] = self.checker.summary()
        if self.path is None:
            return
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2))
        os.replace(tmp, self.path)

    def error(self, where: str, exc: BaseException) -> None:
        self.doc["errors"].append({"where": where, "error": repr(exc),
                                   "traceback": traceback.format_exc(limit=8)[-3000:]})
        self.save()


CASES = [(layout, page_size, kind) for layout in ("layer_first", "page_first") for page_size in (1, 16, 64)
         for kind in ("per_layer", "stacked")]


MANY_OPS_CASES = [(layout, kind) for layout in ("layer_first", "page_first") for kind in ("per_layer", "stacked")]


def loop_figures(monitor: Any) -> dict[str, Any]:
    """Callbacks and collections during the timed runs (`kvtier.bench.core`'s
    monitor): the longest kvtier callback is the issue-14 target (<= 1 ms)."""
    from kvtier.bench.core import callback_summary, gc_summary, longest_collection

    return {
        "callbacks": callback_summary(dict(monitor.callbacks)),
        "gc": gc_summary([c for v in monitor.collections.values() for c in v])
        | {"longest": longest_collection(dict(monitor.collections))},
    }


async def measure(dev: Device, sizes: Sizes, report: Report, deadline: float, checker: Checker) -> None:
    import asyncio

    import anyio

    from kvtier.bench.core import LoopLagMonitor

    doc = report.doc
    ticker = Ticker()
    # Times every loop callback inside its recordings (no ticker of its own:
    # the Ticker above is the stall figure).
    monitor = LoopLagMonitor(asyncio.get_running_loop(), 0.001, ticks=False)
    monitor.start()

    def late(what: str, need_s: float) -> bool:
        if time.monotonic() + need_s > deadline:
            doc["skipped"].append({"what": what, "why": f"deadline: less than {need_s:.0f} s left"})
            report.save()
            return True
        return False

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker.run)
        try:
            shared = Tensors(dev, sizes)
            doc["kvtier"] = []
            for layout, page_size, kind in CASES:
                name = f"{layout}/p{page_size}/{kind}"
                if late(name, 8):
                    continue
                try:
                    case = await kvtier_case(dev, sizes, shared, ticker, monitor, checker, layout=layout,
                                             page_size=page_size, device_tensors=kind)
                    add_ratios(case, doc.get("raw") or {})
                    doc["kvtier"].append(case)
                except Exception as exc:  # keep measuring the other cases
                    doc["kvtier"].append({"layout": layout, "page_size": page_size, "device_tensors": kind,
                                          "error": repr(exc)})
                    report.error(name, exc)
                doc["loop"] = ticker.summary()
                report.save()
            if not late("load_under_backup_burst", 10):
                try:
                    doc["load_under_backup_burst"] = await load_under_burst(dev, sizes, shared, ticker, monitor,
                                                                            checker)
                except Exception as exc:
                    report.error("load_under_backup_burst", exc)
            doc["loop"] = ticker.summary()
            report.save()
            doc["many_ops"] = []
            for layout, kind in MANY_OPS_CASES:
                name = f"many_ops/{layout}/{kind}"
                if late(name, 15):
                    continue
                try:
                    case = await many_ops_case(dev, sizes, shared, ticker, monitor, checker, layout=layout,
                                               device_tensors=kind)
                    add_many_ops_ratios(case, doc.get("raw") or {})
                    doc["many_ops"].append(case)
                except Exception as exc:
                    doc["many_ops"].append({"layout": layout, "device_tensors": kind, "error": repr(exc)})
                    report.error(name, exc)
                doc |= loop_figures(monitor)
                report.save()
            del shared
            if not late("scaling", 45):
                try:
                    doc["scaling"] = await scaling_section(dev, sizes, monitor, checker)
                except Exception as exc:
                    report.error("scaling", exc)
            doc["loop"] = ticker.summary()
            doc |= loop_figures(monitor)
            report.save()
        finally:
            ticker.running = False
            monitor.close()


def problems(doc: dict[str, Any]) -> list[str]:
    """Why this run does not pass, each reason in words; empty when it does."""
    out = []
    checks = doc.get("checks") or {}
    if checks.get("failed"):
        out.append(f"bytes: {len(checks['failed'])} of {checks['checks']} checks failed in "
                   f"{len(checks['failed_cases'])} cases: {', '.join(checks['failed_cases'])}")
    elif not checks.get("checks"):
        out.append("bytes: no byte check ran")
    if doc.get("skipped"):
        out.append(f"deadline: skipped {', '.join(x['what'] for x in doc['skipped'])}")
    if doc.get("errors"):
        out.append(f"errors in: {', '.join(e['where'] for e in doc['errors'])}")
    return out


def _range(xs: Sequence[float | None]) -> dict[str, float | None]:
    vals = [x for x in xs if x is not None]
    if not vals:
        return {"min": None, "median": None, "max": None}
    return {"min": _round(min(vals)), "median": _round(statistics.median(vals)), "max": _round(max(vals))}


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """The few figures that answer the goal, for a closing note."""
    out: dict[str, Any] = {}
    large = (doc.get("raw") or {}).get("large") or {}
    out["raw_large_gbps"] = {d: _round((large.get(d) or {}).get("wall_gbps")) for d in ("h2d", "d2h")}
    cases = [c for c in doc.get("kvtier") or [] if "error" not in c]
    out["cases_ok"] = len(cases)
    out["cases_failed"] = len([c for c in doc.get("kvtier") or [] if "error" in c])
    checks = doc.get("checks") or {}
    out["bytes_checks"] = checks.get("checks", 0)
    out["bytes_failed_cases"] = checks.get("failed_cases", [])
    out["bytes_match_all"] = bool(checks.get("checks")) and not checks.get("failed")
    # Ranges over the main cases: kvtier / the raw replay of its own copies on
    # registered memory, end to end and DMA alone; and / the large raw copy.
    for op in ("backup", "load"):
        out[f"{op}_vs_raw_same_copies_wall"] = _range([c[op].get("vs_raw_same_copies_wall") for c in cases])
        out[f"{op}_vs_raw_same_copies_dma"] = _range([c[op].get("vs_raw_same_copies_dma") for c in cases])
        out[f"{op}_vs_raw_large"] = _range([c[op].get("vs_raw_large") for c in cases])
    out["per_case"] = {
        f"{c['layout']}/p{c['page_size']}/{c['device_tensors']}": {
            op: {"wall_gbps": _round(c[op]["wall_gbps"]), "dma_gbps": _round(c[op]["dma_gbps"]),
                 "vs_same_wall": _round(c[op].get("vs_raw_same_copies_wall")),
                 "vs_same_dma": _round(c[op].get("vs_raw_same_copies_dma")), "copies": c[op]["copies"]}
            for op in ("backup", "load")
        }
        for c in cases
    }
    burst = doc.get("load_under_backup_burst") or {}
    out["small_load_p50_ms"] = {"idle": _round((burst.get("idle_ms") or {}).get("p50")),
                                "during_burst": _round((burst.get("during_burst_ms") or {}).get("p50"))}
    out["loop_max_stall_ms"] = _round((doc.get("loop") or {}).get("max_stall_ms"))
    many = [c for c in doc.get("many_ops") or [] if "error" not in c]
    out["many_ops_vs_one_op"] = {
        f"{c['layout']}/{c['device_tensors']}": {
            f"{d}_{p}": _round(c[d][p]["vs_one_op"]) for d in ("backup", "load") for p in ("single", "bulk")
        }
        for c in many
    }
    scaling = doc.get("scaling") or {}
    out["scaling_us_per_op"] = {f"{r['path']}/{r['operations']}": _round(r["us_per_op"])
                                for r in scaling.get("rows") or []}
    out["scaling_max_over_min"] = {p: _round(v) for p, v in (scaling.get("max_over_min") or {}).items()}
    kv = ((doc.get("callbacks") or {}).get("owners") or {}).get("kvtier")
    out["longest_kvtier_callback"] = None if not kv else {"ms": _round(kv["longest_ms"]), "name": kv["name"],
                                                          "where": kv["label"]}
    longest_gc = (doc.get("gc") or {}).get("longest")
    out["longest_collection_ms"] = None if not longest_gc else _round(longest_gc["ms"])
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller pools, fewer repetitions")
    ap.add_argument("--json", type=Path, help="write the document here (rewritten after every case)")
    ap.add_argument("--deadline-s", type=float, default=240.0,
                    help="skip what would not finish within this many seconds of the start (a skip fails the run)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    ap.add_argument("--plant", default=os.environ.get("GPU_CHECK_PLANT") or None,
                    help="a planted fault to prove the checks fail: 'bytes' flips one byte of every copy's "
                         "destination before its check (default: $GPU_CHECK_PLANT)")
    args = ap.parse_args(argv)
    if args.plant is not None and args.plant not in PLANTS:
        ap.error(f"--plant (or GPU_CHECK_PLANT) must be one of {PLANTS}; got {args.plant!r}")
    # A timeout's SIGTERM ends the run through the finally below, which saves the document.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    started = time.monotonic()
    deadline = started + args.deadline_s
    report = Report(args.json)
    doc = report.doc
    doc["plant"] = args.plant
    code = 0
    try:
        quiet_logs()
        import anyio
        import torch

        doc["torch"] = torch.__version__
        doc["torch_cuda"] = torch.version.cuda
        doc["python"] = sys.version.split()[0]
        if args.device != "cpu" and not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available: torch.cuda.is_available() is False")
        dev = Device(args.device)
        report.checker = Checker(dev, args.plant)
        sizes = SMOKE if not dev.cuda else QUICK if args.quick else FULL
        doc["device"] = torch.cuda.get_device_name(dev.device) if dev.cuda else "cpu (smoke run: no figures)"
        doc["sizes"] = sizes.__dict__
        report.save()
        try:
            doc["raw"] = raw_section(dev, sizes)
        except Exception as exc:
            report.error("raw", exc)
        report.save()
        anyio.run(measure, dev, sizes, report, deadline, report.checker)
        report.save()
        doc["problems"] = problems(doc)
        doc["status"] = "ok" if not doc["problems"] else "failed"
        code = 0 if not doc["problems"] else 1
    except BaseException as exc:  # what failed goes in the document, whatever it was
        doc["status"] = "failed"
        report.error("interrupted" if isinstance(exc, (SystemExit, KeyboardInterrupt)) else "setup", exc)
        doc["problems"] = problems(doc)
        code = 1
        if not isinstance(exc, Exception):
            raise
    finally:
        doc["seconds"] = time.monotonic() - started
        try:
            doc["summary"] = summary(doc)
        except Exception as exc:
            report.error("summary", exc)
        report.save()
        # The document goes to --json; stdout gets a few lines only.
        checks = doc.get("checks") or {}
        print(f"gpu_check.py: status {doc['status']} in {doc['seconds']:.1f} s; {checks.get('passed', 0)} of "
              f"{checks.get('checks', 0)} byte checks passed; plant {doc['plant']}; document: {args.json}")
        for line in doc.get("problems") or []:
            print(f"- {line[:300]}")
    return code


if __name__ == "__main__":
    sys.exit(main())
