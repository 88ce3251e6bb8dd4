"""Device benchmark for a CUDA machine: kvtier's copies against raw pinned DMA.

Writes one JSON document (to ``--json``, rewritten after every case, so that
a run cut short still leaves what it measured; and to stdout at the end):

* ``raw``: pinned host<->device ``copy_`` of one large buffer, and of many
  separate copies of 2 KiB .. 2 MiB each (the per-copy cost kvtier pays for
  small pages), wall time and CUDA-event device time;
* ``kvtier``: backup and load through the scheduler for ``layer_first`` and
  ``page_first`` host pools, page sizes 1, 16 and 64, per-layer and stacked
  device tensors, scattered disjoint source and destination pages: wall and
  device GB/s, enqueue time, time to the first layer of a load, whether the
  loaded rows equal the backed-up rows byte for byte, and ratios to the raw
  figures (to the large copy, and to raw copies of kvtier's per-copy size);
* ``load_under_backup_burst``: a one-page load's latency idle and while a
  burst of large backups runs;
* ``loop``: the event loop's longest and p99 stall (a 1 ms ticker), counted
  only while timed runs are in flight.

Usage: ``python benchmarks/gpu_check.py [--quick] [--json PATH] [--deadline-s S]``.
``--device cpu`` runs the same code on CPU tensors as a smoke test (figures
there mean nothing). The whole device check, tests first, is
``benchmarks/gpu_check.sh``.
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


FULL = Sizes(layers=32, slots=8192, heads=8, head_dim=128, reps=3, large_bytes=GiB,
             raw_total_bytes=256 * MiB, raw_max_copies=8192, burst_backups=8, burst_slots=512)
QUICK = Sizes(layers=16, slots=4096, heads=8, head_dim=128, reps=2, large_bytes=256 * MiB,
              raw_total_bytes=64 * MiB, raw_max_copies=4096, burst_backups=4, burst_slots=256)
SMOKE = Sizes(layers=4, slots=256, heads=2, head_dim=16, reps=2, large_bytes=4 * MiB,
              raw_total_bytes=1 * MiB, raw_max_copies=64, burst_backups=2, burst_slots=16)


class Device:
    """The device under test: streams, timing events and syncs, or their CPU
    stand-ins (no device time) for the smoke run."""

    def __init__(self, name: str) -> None:
        import torch

        self.torch = torch
        self.cuda = name != "cpu"
        self.device = torch.device(name)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def event(self) -> Any:
        if not self.cuda:
            return None
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @staticmethod
    def elapsed_s(start: Any, end: Any) -> float | None:
        if start is None or end is None:
            return None
        return float(start.elapsed_time(end)) / 1e3

    def host_empty(self, n: int) -> Any:
        return self.torch.empty(n, dtype=self.torch.uint8, pin_memory=self.cuda)

    def fence(self) -> Any:
        """What a backup or load waits for: the work enqueued so far on the
        current stream (which filled or zeroed the rows)."""
        return self.torch.cuda.current_stream() if self.cuda else None


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


def raw_section(dev: Device, sizes: Sizes) -> dict[str, Any]:
    chunked = []
    for c in RAW_COPY_SIZES:
        copies = max(1, min(sizes.raw_max_copies, sizes.raw_total_bytes // c))
        chunked.append(raw_copies(dev, c, copies, sizes.reps))
    return {"large": raw_copies(dev, sizes.large_bytes, 1, sizes.reps), "chunked": chunked}


def raw_at(raw: dict[str, Any], copy_bytes: int, direction: str) -> float | None:
    """Raw wall GB/s of copies of ``copy_bytes`` (the nearest measured size)."""
    rows = raw.get("chunked") or []
    if not rows:
        return None
    best = min(rows, key=lambda r: abs(r["copy_bytes"] - copy_bytes))
    v: float | None = best[direction]["wall_gbps"]
    return v


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
    if dev.cuda:
        from kvtier.transfers.cuda import CudaExecutor

        return CudaExecutor(dev.device, timing=True)
    from kvtier import CpuExecutor

    return CpuExecutor()


def executor_seconds(ex: Any) -> tuple[float | None, float | None]:
    """(enqueue or worker seconds, device seconds) so far."""
    s = ex.statistics()
    if hasattr(s, "enqueue_seconds"):
        return s.enqueue_seconds, s.device_seconds
    return s.worker_seconds, None


def zero_rows(tensors: list[list[Any]], idx: Any) -> None:
    for layer in tensors:
        for t in layer:
            t.index_fill_(0, idx, 0)


def rows_match(tensors: list[list[Any]], src: Any, dst: Any) -> bool:
    return all(bool(t[dst].equal(t[src])) for layer in tensors for t in layer)


async def kvtier_case(dev: Device, sizes: Sizes, shared: Tensors, ticker: Ticker, *, layout: str,
                      page_size: int, device_tensors: str) -> dict[str, Any]:
    from kvtier import DevicePool, PoolGroup, SchedulerConfig, TransferScheduler

    tensors = shared.layers(device_tensors)
    npages = sizes.slots // page_size
    moved = npages // 2
    src, dst = disjoint_pages(npages, moved, page_size, seed=page_size)
    src_dev, dst_dev = src.to(dev.device), dst.to(dev.device)
    group = PoolGroup()
    group.add_pool("kv", device=DevicePool(tensors), page_size=page_size, host_slots=moved * page_size,
                   layout=layout)  # type: ignore[arg-type]
    nbytes = len(src) * group["kv"].slot_nbytes
    ex = executor_for(dev)
    runs: dict[str, list[dict[str, float | None]]] = {"backup": [], "load": []}
    first_layer: list[float] = []
    try:
        async with TransferScheduler(group, executor=ex, config=SchedulerConfig(max_batch_bytes=1 << 40)) as sched:
            for rep in range(sizes.reps + 1):  # rep 0 warms up
                zero_rows(tensors, dst_dev)
                timed = rep > 0
                ticker.armed = timed
                e0, d0 = executor_seconds(ex)
                t0 = time.perf_counter()
                b = await sched.backup({"kv": src}, after=dev.fence())
                await b
                t1 = time.perf_counter()
                e1, d1 = executor_seconds(ex)
                ld = await sched.load(b.host_indices, {"kv": dst}, after=dev.fence())
                await ld.layer_ready(0)
                t_first = time.perf_counter()
                await ld
                t2 = time.perf_counter()
                e2, d2 = executor_seconds(ex)
                ticker.armed = False
                sched.free_host(b.host_indices)
                if not timed:
                    continue
                for name, wall, enq, device_s in (
                    ("backup", t1 - t0, _delta(e0, e1), _delta(d0, d1)),
                    ("load", t2 - t1, _delta(e1, e2), _delta(d1, d2)),
                ):
                    runs[name].append({"wall": wall, "enqueue": enq, "device": device_s})
                first_layer.append(t_first - t1)
        match = rows_match(tensors, src_dev, dst_dev)
    finally:
        ticker.armed = False
        group.close()
    copy_bytes = page_size * shared.row_bytes  # one page of one plane of one layer
    out: dict[str, Any] = {
        "layout": layout, "page_size": page_size, "device_tensors": device_tensors,
        "bytes": nbytes, "pages": moved, "page_copy_bytes": copy_bytes, "bytes_match": match,
        "load_first_layer_ms": _ms(median(first_layer)),
    }
    for name in ("backup", "load"):
        r = runs[name]
        wall, device_s = median([x["wall"] for x in r]), median([x["device"] for x in r])
        out[name] = {
            "wall_ms": _ms(wall), "wall_gbps": gbps(nbytes, wall),
            "device_ms": _ms(device_s), "device_gbps": gbps(nbytes, device_s),
            "enqueue_ms": _ms(median([x["enqueue"] for x in r])),
        }
    return out


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def add_ratios(case: dict[str, Any], raw: dict[str, Any]) -> None:
    """kvtier / raw: against the large copy, and against raw copies of
    kvtier's per-page copy size, same direction, wall time."""
    large = raw.get("large") or {}
    for name, direction in (("backup", "d2h"), ("load", "h2d")):
        k = case[name]["wall_gbps"]
        case[name]["vs_raw_large"] = ratio(k, (large.get(direction) or {}).get("wall_gbps"))
        case[name]["vs_raw_same_copy_size"] = ratio(k, raw_at(raw, case["page_copy_bytes"], direction))


async def load_under_burst(dev: Device, sizes: Sizes, shared: Tensors, ticker: Ticker) -> dict[str, Any]:
    """A one-page load (page 16, layer_first) idle, then while a burst of
    backups runs; latency from submit to done."""
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
    src_small = dev.torch.arange(0, page)
    dst_small = dev.torch.arange((npages - 1) * page, npages * page)  # the burst reads pages 1..burst_pages
    idle: list[float] = []
    busy: list[float] = []
    bursts = 0
    try:
        async with TransferScheduler(group, executor=executor_for(dev), config=SchedulerConfig()) as sched:
            b = await sched.backup({"kv": src_small}, after=dev.fence())
            await b
            small_host = b.host_indices

            async def one_load() -> float:
                t = time.perf_counter()
                ld = await sched.load(small_host, {"kv": dst_small}, after=dev.fence())
                await ld
                return time.perf_counter() - t

            await one_load()  # warm-up
            ticker.armed = True
            for _ in range(20):
                idle.append(await one_load())
            for _ in range(sizes.reps):
                handles = []
                for i in range(sizes.burst_backups):
                    lo = (1 + i * (sizes.burst_slots // page)) * page
                    burst = dev.torch.arange(lo, lo + sizes.burst_slots)
                    handles.append(await sched.backup({"kv": burst}, after=dev.fence()))
                while not all(h.done() for h in handles):
                    busy.append(await one_load())
                for h in handles:
                    await h
                    sched.free_host(h.host_indices)
                bursts += 1
                await anyio.sleep(0)
            ticker.armed = False
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


# -- the run --------------------------------------------------------------------


class Report:
    """The JSON document, rewritten whole (atomically) after every step."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"status": "running", "errors": [], "skipped": []}

    def save(self) -> None:
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


async def measure(dev: Device, sizes: Sizes, report: Report, deadline: float) -> None:
    import anyio

    doc = report.doc
    ticker = Ticker()

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
                name = f"{layout}/page{page_size}/{kind}"
                if late(name, 8):
                    continue
                try:
                    case = await kvtier_case(dev, sizes, shared, ticker, layout=layout, page_size=page_size,
                                             device_tensors=kind)
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
                    doc["load_under_backup_burst"] = await load_under_burst(dev, sizes, shared, ticker)
                except Exception as exc:
                    report.error("load_under_backup_burst", exc)
            doc["loop"] = ticker.summary()
            report.save()
        finally:
            ticker.running = False


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """The few figures that answer the goal, for a closing note."""
    out: dict[str, Any] = {}
    large = (doc.get("raw") or {}).get("large") or {}
    out["raw_large_gbps"] = {d: (large.get(d) or {}).get("wall_gbps") for d in ("h2d", "d2h")}
    cases = [c for c in doc.get("kvtier") or [] if "error" not in c]
    out["cases_ok"] = len(cases)
    out["cases_failed"] = len([c for c in doc.get("kvtier") or [] if "error" in c])
    out["bytes_match_all"] = bool(cases) and all(c["bytes_match"] for c in cases)
    out["vs_raw_large"] = {
        f"{c['layout']}/p{c['page_size']}/{c['device_tensors']}": {
            "backup": _round(c["backup"]["vs_raw_large"]), "load": _round(c["load"]["vs_raw_large"]),
        }
        for c in cases
    }
    burst = doc.get("load_under_backup_burst") or {}
    out["small_load_p50_ms"] = {"idle": _round((burst.get("idle_ms") or {}).get("p50")),
                                "during_burst": _round((burst.get("during_burst_ms") or {}).get("p50"))}
    out["loop_max_stall_ms"] = _round((doc.get("loop") or {}).get("max_stall_ms"))
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller pools, fewer repetitions")
    ap.add_argument("--json", type=Path, help="write the document here too (rewritten after every case)")
    ap.add_argument("--deadline-s", type=float, default=240.0,
                    help="skip what would not finish within this many seconds of the start")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    args = ap.parse_args(argv)
    # A timeout's SIGTERM ends the run through the finally below, which saves the document.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    started = time.monotonic()
    deadline = started + args.deadline_s
    report = Report(args.json)
    doc = report.doc
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
        sizes = SMOKE if not dev.cuda else QUICK if args.quick else FULL
        doc["device"] = torch.cuda.get_device_name(dev.device) if dev.cuda else "cpu (smoke run: no figures)"
        doc["sizes"] = sizes.__dict__
        report.save()
        try:
            doc["raw"] = raw_section(dev, sizes)
        except Exception as exc:
            report.error("raw", exc)
        report.save()
        anyio.run(measure, dev, sizes, report, deadline)
        doc["status"] = "ok" if not doc["errors"] else "errors"
    except BaseException as exc:  # what failed goes in the document, whatever it was
        doc["status"] = "failed"
        report.error("interrupted" if isinstance(exc, (SystemExit, KeyboardInterrupt)) else "setup", exc)
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
        print(json.dumps(doc, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
