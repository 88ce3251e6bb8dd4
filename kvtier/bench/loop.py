"""What kvtier costs the engine's own thread: the loop-CPU section of the benchmark.

An engine embeds kvtier in its serving loop, so what matters is the CPU time
kvtier takes on the loop's thread, results read included, and how often it
lets the GIL go (each loop turn, torch call or thread hop: beside a busy
Python thread in the same process each can cost up to a switch interval).
Measured here, on one-page operations of the tiny shape (page size 1), each
figure a median over alternating repetitions:

* loop-thread CPU (``time.thread_time``) and wall time per operation, single
  path (one ``await backup`` per request) and bulk path (one
  ``backup_many``), from the first submission until every handle is awaited
  and its ``host_indices`` read, and the array-native path (one
  ``backup_arrays`` of a 2-D array, its result awaited once and read), with an executor that copies nothing and with
  `CpuExecutor`;
* the share of a 20 ms engine step that 64, 128 and 256 such operations take;
* one lone operation submitted and awaited, its ``host_indices`` read: loop
  CPU, with each executor;
* cyclic garbage per operation (the collector off, then one ``gc.collect()``);
* per operation and per batch, for the three paths, lone backups (one at a
  time) and loads of the single path's host pages (a ``load`` each, one
  ``load_many``): loop turns, torch calls on the loop thread
  (counted with a ``TorchFunctionMode``, which sees tensor methods too: all of
  them, and the operators among them, which unlike metadata reads such as
  ``dtype``, ``numel`` or ``tolist`` may let the GIL go) and thread hops
  (hand-offs to the executor's thread and wake-ups back);
* many submitters: one task per request, all started at once, against the
  same requests from one task;
* beside one busy pure-Python thread in the process: a lone operation and a
  ``backup_many`` of all the requests, in switch intervals
  (``sys.getswitchinterval()``), with the executor that copies nothing (the
  targets: kvtier's own path) and with `CpuExecutor` (whose worker thread's
  torch calls each wait for the GIL as well).
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import anyio
import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from kvtier.bench.measures import NoCopyExecutor, median_range
from kvtier.scheduler import SchedulerConfig, TransferScheduler
from kvtier.transfers import CopyExecutor, CpuExecutor

__all__ = ["STEP_MS", "gc_objects", "loop_cost"]

# The engine step the shares are of.
STEP_MS = 20.0
STEP_OPS = (64, 128, 256)
# Lone operations the lone row and the counts table run one after the other.
LONE_OPS = 64


# Reads of a tensor's metadata and values that run no operator (so do not
# let the GIL go): what validating a caller's index tensor needs.
_METADATA = frozenset({"__get__", "dim", "numel", "tolist", "size", "__len__", "stride", "is_contiguous"})


class _TorchCalls(TorchFunctionMode):
    """Counts the torch functions and tensor methods called on this thread:
    all of them, and the operators among them (``ops``: not a metadata read)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.ops = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        if getattr(func, "__name__", "") not in _METADATA:
            self.ops += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _counting(loop: asyncio.AbstractEventLoop) -> Iterator[dict[str, int]]:
    """Loop turns and wake-ups from other threads while the block runs."""
    counts = {"turns": 0, "wakeups": 0}
    run_once = loop._run_once  # type: ignore[attr-defined]
    threadsafe = loop.call_soon_threadsafe

    def turn() -> None:
        counts["turns"] += 1
        run_once()

    def woken(*args: Any, **kwargs: Any) -> Any:
        counts["wakeups"] += 1
        return threadsafe(*args, **kwargs)

    loop._run_once = turn  # type: ignore[attr-defined]
    loop.call_soon_threadsafe = woken  # type: ignore[method-assign,assignment]
    try:
        yield counts
    finally:
        del loop._run_once  # type: ignore[attr-defined]
        del loop.call_soon_threadsafe


async def loop_cost(
    build: Callable[[int, int], Any], executor: Callable[[], CopyExecutor], *, ops: int, reps: int,
    busy_reps: int, pool: str = "kv",
) -> dict[str, Any]:
    """The section's figures (see the module doc). ``build(device_slots,
    host_slots)`` makes the pool group of one ``pool`` of page size 1;
    ``executor()`` a fresh copying executor."""
    loop = asyncio.get_running_loop()
    requests = [{pool: idx} for idx in torch.split(torch.arange(ops), 1)]
    config = SchedulerConfig(max_queued_ops=max(ops, 4096))
    executors: dict[str, Callable[[], CopyExecutor]] = {"noop": NoCopyExecutor, "cpu": executor}
    out: dict[str, Any] = {"operations": ops, "page_size": 1, "step_ms": STEP_MS}
    async with AsyncExitStack() as stack:
        scheds = {name: await stack.enter_async_context(TransferScheduler(build(ops, 2 * ops), make(), config))
                  for name, make in executors.items()}

        async def single(sched: TransferScheduler, reqs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
            handles = [await sched.backup(r) for r in reqs]
            for h in handles:
                await h
            return [h.host_indices[pool] for h in handles]

        async def bulk(sched: TransferScheduler, reqs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
            handles = await sched.backup_many(reqs)
            for h in handles:
                await h
            return [h.host_indices[pool] for h in handles]

        slots = np.arange(ops, dtype=np.int64).reshape(ops, 1)  # the requests' slots as the engine's array

        async def arrays(sched: TransferScheduler, reqs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
            result = await (await sched.backup_arrays({pool: slots[:len(reqs)]}))
            return [result.host_indices[pool]]

        paths: dict[str, Callable[[TransferScheduler, list[dict[str, torch.Tensor]]], Awaitable[list[torch.Tensor]]]]
        paths = {"single": single, "bulk": bulk, "arrays": arrays}

        async def timed(sched: TransferScheduler, path: str, reqs: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
            c0, w0 = time.thread_time(), time.perf_counter()
            got = await paths[path](sched, reqs)
            c1, w1 = time.thread_time(), time.perf_counter()
            sched.free_host({pool: torch.cat(got)})
            return c1 - c0, w1 - w0

        for sched in scheds.values():  # warm-up
            for path in paths:
                await timed(sched, path, requests[:256])

        per_op: dict[str, Any] = {}
        runs: dict[str, list[tuple[float, float]]] = {}
        labels = [(e, p) for e in scheds for p in paths]
        for rep in range(reps):
            for e, p in labels if rep % 2 == 0 else reversed(labels):
                runs.setdefault(f"{e}:{p}", []).append(await timed(scheds[e], p, requests))
        for label, values in runs.items():
            per_op[label] = {"loop_cpu_us": median_range([c / ops * 1e6 for c, _ in values]),
                             "wall_us": median_range([w / ops * 1e6 for _, w in values])}
        out["per_op"] = per_op

        noop = scheds["noop"]
        share: dict[str, Any] = {}
        for n in STEP_OPS:
            for p in paths:
                cpu = [(await timed(noop, p, requests[:n]))[0] for _ in range(max(reps, 3))]
                share[f"{p}:{n}"] = {"loop_cpu_ms": statistics.median(cpu) * 1e3,
                                     "share": statistics.median(cpu) * 1e3 / STEP_MS}
        out["step_share"] = share

        lone: dict[str, Any] = {}
        for name, sched in scheds.items():
            cpu_us = []
            for i in range(LONE_OPS):
                c0 = time.thread_time()
                h = await sched.backup(requests[i])
                await h
                got = h.host_indices[pool]
                cpu_us.append((time.thread_time() - c0) * 1e6)
                sched.free_host({pool: got})
            lone[name] = median_range(cpu_us)
        out["lone_loop_cpu_us"] = lone

        garbage: dict[str, float] = {}
        for p in paths:
            gc.collect()
            gc.disable()
            try:
                kept = await paths[p](noop, requests)
                found = gc.collect()
            finally:
                gc.enable()
            noop.free_host({pool: torch.cat(kept)})
            garbage[p] = found / ops
        out["cyclic_garbage_per_op"] = garbage

        # Lone: one backup at a time, submitted, awaited and read before the
        # next (LONE_OPS of them); loads: the backups' host pages back into
        # the same device slots, a load() each or one load_many.
        async def lone_path(sched: TransferScheduler, reqs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
            got = []
            for r in reqs[:LONE_OPS]:
                h = await sched.backup(r)
                await h
                got.append(h.host_indices[pool])
            return got

        async def load_path(
            sched: TransferScheduler, hosts: list[dict[str, torch.Tensor]], bulk_call: bool
        ) -> list[dict[str, torch.Tensor]]:
            handles = (await sched.load_many(hosts, requests[:len(hosts)]) if bulk_call
                       else [await sched.load(h, requests[i]) for i, h in enumerate(hosts)])
            for h in handles:
                await h
            return [h.device_indices for h in handles]

        counts: dict[str, Any] = {}

        def counted(label: str, n: int, batches: int, c: dict[str, int], mode: _TorchCalls, cpu: bool) -> None:
            hops = c["wakeups"] + (batches if cpu else 0)
            counts[label] = {
                "batches": batches,
                "loop_turns_per_op": c["turns"] / n, "torch_calls_per_op": mode.calls / n,
                "torch_ops_per_op": mode.ops / n, "thread_hops_per_op": hops / n,
                "loop_turns_per_batch": c["turns"] / max(batches, 1),
                "torch_calls_per_batch": mode.calls / max(batches, 1),
                "torch_ops_per_batch": mode.ops / max(batches, 1),
                "thread_hops_per_batch": hops / max(batches, 1),
            }

        counted_paths: dict[str, Callable[[TransferScheduler, list[dict[str, torch.Tensor]]], Awaitable[list[torch.Tensor]]]]
        counted_paths = {**paths, "lone": lone_path}
        for name, sched in scheds.items():
            for p, run in counted_paths.items():
                before = sched.statistics().backup.batches
                mode = _TorchCalls()
                with _counting(loop) as c, mode:
                    kept = await run(sched, requests)
                batches = sched.statistics().backup.batches - before
                n = LONE_OPS if p == "lone" else ops
                if p == "arrays" or p == "lone":
                    sched.free_host({pool: torch.cat(kept)})
                    counted(f"{name}:{p}", n, batches, c, mode, name == "cpu")
                    continue
                counted(f"{name}:{p}", n, batches, c, mode, name == "cpu")
                if p != "single":
                    sched.free_host({pool: torch.cat(kept)})
                    continue
                # The single backups' host pages, loaded back: load() each, then load_many.
                hosts = [{pool: k} for k in kept]
                for load_label, bulk_call in (("load_single", False), ("load_bulk", True)):
                    before = sched.statistics().load.batches
                    mode = _TorchCalls()
                    with _counting(loop) as c, mode:
                        await load_path(sched, hosts, bulk_call)
                    batches = sched.statistics().load.batches - before
                    counted(f"{name}:{load_label}", ops, batches, c, mode, name == "cpu")
                sched.free_host({pool: torch.cat(kept)})
        out["counts"] = counts

        # Many submitters: one asyncio task per request, all at once, against
        # the same tasks doing nothing (what spawning them costs; anyio's
        # start_soon costs several times asyncio's, and neither is kvtier's).
        async def tasks(sched: TransferScheduler, work: bool) -> float:
            handles: list[Any] = []

            async def one(r: dict[str, torch.Tensor]) -> None:
                if work:
                    handles.append(await sched.backup(r))

            c0 = time.thread_time()
            await asyncio.gather(*[asyncio.create_task(one(r)) for r in requests])
            for h in handles:
                await h
            got = [h.host_indices[pool] for h in handles]
            c1 = time.thread_time()
            if got:
                sched.free_host({pool: torch.cat(got)})
            return c1 - c0

        # The least of several runs each: the three differ by little, and a
        # shared machine's noise is larger than that difference.
        spawn, many, one_task = [], [], []
        for _ in range(max(reps, 5)):
            spawn.append(await tasks(noop, False))
            many.append(await tasks(noop, True))
            one_task.append((await timed(noop, "single", requests))[0])
        spawn_us = min(spawn) / ops * 1e6
        many_us = min(many) / ops * 1e6
        one_us = min(one_task) / ops * 1e6
        out["many_submitters"] = {
            "tasks": ops, "loop_cpu_us_per_op": many_us, "spawn_only_us_per_op": spawn_us,
            "kvtier_us_per_op": many_us - spawn_us, "one_task_loop_cpu_us_per_op": one_us,
            "ratio": max(many_us - spawn_us, 0.0) / one_us,
        }

        # Beside a busy Python thread.
        stop = threading.Event()

        def spin() -> None:
            x = 0
            while not stop.is_set():
                x += 1

        interval = sys.getswitchinterval()
        busy: dict[str, Any] = {"switch_interval_ms": interval * 1e3}
        spinner = threading.Thread(target=spin, name="kvtier-bench-busy", daemon=True)
        spinner.start()
        try:
            # The targets' figures: what kvtier's own path costs (the executor
            # that copies nothing); then the same with CpuExecutor, whose
            # worker's torch calls each wait for the GIL too.
            for name in ("noop", "cpu"):
                sched = scheds[name]
                lone_s, bulk_s, drop_s = [], [], []
                for i in range(busy_reps):
                    t0 = time.perf_counter()
                    h = await sched.backup(requests[i])
                    await h
                    one = h.host_indices[pool]
                    lone_s.append(time.perf_counter() - t0)
                    sched.free_host({pool: one})
                    del h, one
                    t0 = time.perf_counter()
                    kept = await bulk(sched, requests)
                    bulk_s.append(time.perf_counter() - t0)
                    sched.free_host({pool: torch.cat(kept)})
                    # The caller drops the run's index tensors here, not in the
                    # next timed run: the end of each torch tensor lets the GIL
                    # go (numpy arrays' do not), which beside a busy thread
                    # costs about one switch interval per hundred tensors.
                    t0 = time.perf_counter()
                    del kept
                    drop_s.append(time.perf_counter() - t0)
                prefix = "" if name == "noop" else "cpu_"
                busy[f"{prefix}drop_ms"] = median_range([x * 1e3 for x in drop_s])
                busy[f"{prefix}lone_ms"] = median_range([x * 1e3 for x in lone_s])
                busy[f"{prefix}lone_intervals"] = statistics.median(lone_s) / interval
                busy[f"{prefix}bulk_ms"] = median_range([x * 1e3 for x in bulk_s])
                busy[f"{prefix}bulk_intervals"] = statistics.median(bulk_s) / interval
        finally:
            stop.set()
            spinner.join()
        out["busy_thread"] = busy
    return out


# -- what the collector walks -------------------------------------------------------------------


def _census(before: set[int]) -> tuple[int, int]:
    """The GC-tracked objects made since ``before`` (ids) that are still alive
    after a full collection, and the references the collector follows from
    them (what a collection walks: ``gc.get_referents`` of each)."""
    gc.collect()
    found = [o for o in gc.get_objects() if id(o) not in before]
    mine = {id(before), id(found)}
    kept = [o for o in found if id(o) not in mine]
    return len(kept), sum(len(gc.get_referents(o)) for o in kept)


def _walked_from(*records: object) -> tuple[int, int]:
    """The GC-tracked objects ``records`` hold (one level down) and the
    references the collector follows from them and from those."""
    held = [x for r in records for x in gc.get_referents(r) if gc.is_tracked(x)]
    return len(held), sum(len(gc.get_referents(x)) for x in (*records, *held))


def _full_collection_ms() -> float:
    """The shortest of three full collections (a gen-2 pause at this heap)."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


async def gc_objects(build: Callable[[int, int], Any], *, ops: int, pool: str = "kv") -> dict[str, Any]:
    """The GC-tracked objects kvtier keeps per queued operation and per host page.

    For each path (single: one ``backup`` per request, bulk: one
    ``backup_many``, arrays: one ``backup_arrays`` of a 2-D array) with an
    executor that copies nothing, ``ops`` one-page backups of page size 1,
    each figure per operation (or per page), after a full collection:

    * ``queued``: every operation submitted and none run (the loop not
      yielded to): what the collector walks while they wait, the objects the
      call handed the caller (``returned``: handles and their list, or one
      bulk operation) included and also given alone;
    * ``done``: every operation awaited and its ``host_indices`` read, the
      handles (or the one result) still held;
    * ``owned``: the handles dropped, the host pages still the caller's
      (per host page; the caller's own index tensors left out);
    * ``left``: the pages freed and everything dropped (a leak shows here);
    * ``record``: per host page, the objects the pool's ownership record and
      allocator hold and the references a collection follows from them, with
      every page written by a queued operation (``queued``), every page the
      caller's (``owned``) and every page free (``free``).

    Besides, the full-collection time (shortest of 3) with nothing queued and
    with every operation queued: a gen-2 pause at this process's heap.
    """
    requests = [{pool: idx} for idx in torch.split(torch.arange(ops), 1)]
    slots = np.arange(ops, dtype=np.int64).reshape(ops, 1)
    out: dict[str, Any] = {"operations": ops, "page_size": 1}
    paths: dict[str, Any] = {}
    async with TransferScheduler(build(ops, ops), NoCopyExecutor(), SchedulerConfig(max_queued_ops=ops)) as sched:
        few = min(ops, 64)
        for _ in range(2):  # warm-up: every path's first batches and caches
            for path in ("single", "bulk"):
                warm = [await sched.backup(r) for r in requests[:few]] if path == "single" \
                    else await sched.backup_many(requests[:few])
                for h in warm:
                    await h
                sched.free_host({pool: torch.cat([h.host_indices[pool] for h in warm])})
            bulk = await (await sched.backup_arrays({pool: slots[:few]}))
            sched.free_host({pool: bulk.host_indices[pool]})
        del warm, h, bulk
        idle_ms = _full_collection_ms()
        for path in ("single", "bulk", "arrays"):
            gc.collect()
            before = {id(o) for o in gc.get_objects()}
            queued: Any
            if path == "single":
                queued = [await sched.backup(r) for r in requests]
                returned = ops + 1
            elif path == "bulk":
                queued = await sched.backup_many(requests)
                returned = ops + 1
            else:
                queued = await sched.backup_arrays({pool: slots})
                returned = 1
            q_objects, q_refs = _census(before)
            owner = sched.group.ownership(pool)
            r_queued = _walked_from(owner, owner.allocator)
            queued_ms = _full_collection_ms()
            if path == "arrays":
                result = await queued
                got = [result.host_indices[pool]]
                del result
            else:
                for h in queued:
                    await h
                del h
                got = [h.host_indices[pool] for h in queued]
            d_objects, d_refs = _census(before)
            del queued
            o_objects, o_refs = _census(before)
            r_owned = _walked_from(owner, owner.allocator)
            o_objects -= len(got) + 1  # the caller's tensors and their list
            o_refs -= 2 * len(got)  # the list's references and each tensor's (to its storage's owner)
            sched.free_host({pool: torch.cat(got)})
            del got
            l_objects, l_refs = _census(before)
            r_free = _walked_from(owner, owner.allocator)
            paths[path] = {
                "queued": {"objects_per_op": q_objects / ops, "references_per_op": q_refs / ops,
                           "returned_per_op": returned / ops, "kvtier_objects_per_op": (q_objects - returned) / ops},
                "done": {"objects_per_op": d_objects / ops, "references_per_op": d_refs / ops},
                "owned": {"objects_per_page": o_objects / ops, "references_per_page": o_refs / ops},
                "left": {"objects_per_op": l_objects / ops, "references_per_op": l_refs / ops},
                "record": {state: {"objects_per_page": r[0] / ops, "references_per_page": r[1] / ops}
                           for state, r in (("queued", r_queued), ("owned", r_owned), ("free", r_free))},
                "full_collection_ms": {"idle": idle_ms, "queued": queued_ms},
            }
    out["paths"] = paths
    return out
