"""Where one large operation's time goes outside the copy, on CPU.

`kvtier bench` compares one large backup with the best raw copy of the same
rows timed inside the copy thread, and finds kvtier 0.82-0.9x of it: a fixed
0.5-1.2 ms per operation on 10-15 ms copies. This script takes one such
operation apart. Each repetition backs up every page of a ``kv`` pool (32
layers x 8 KV heads x 128 dims, bf16 K and V: 128 KiB a slot, ``--mib`` MiB in
all) with one ``backup`` and reads its ``host_indices``, and measures:

* ``submit``: the ``await sched.backup(...)`` call (loop CPU);
* ``worker``: the copy thread's time for the batch (planning and copying,
  `CpuExecutor.statistics`);
* ``outside``: the operation's wall time less the worker's (submission, the
  hand-offs to the thread and back, and ending the operation on the loop);
* ``loop_cpu``: the event loop thread's CPU for the whole operation.

Three executors, each for ``--reps`` repetitions in a row after a warm-up:
``copies`` (`CpuExecutor`, kvtier's own),
``no_copy`` (the same hand-offs to a `CpuExecutor`'s thread, which signals
the layers and copies nothing), and ``no_copy_flush`` (as ``no_copy``, but the
thread copies ``--mib`` MiB between two buffers of its own, as large as the
operation: the loop's working set leaves the caches as in a real copy).
``no_copy_flush`` against ``no_copy`` is what the copy's cache traffic costs
the loop's own work. Before timing, one backup and a load back into zeroed
device rows are compared byte for byte.

    python benchmarks/large_op_timeline.py [--mib 64] [--page-size 1] [--reps 9] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvtier import TransferScheduler
from kvtier.pools import DevicePool, PoolGroup
from kvtier.transfers import Batch, CpuExecutor, LayerProgress

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
SLOT_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 2  # K and V, bf16


class HandOffOnly:
    """A `CopyExecutor` with `CpuExecutor`'s hand-offs and no copy of the
    batch: its thread signals the layers, after copying ``flush_bytes`` between
    two buffers of its own when that is not 0."""

    def __init__(self, flush_bytes: int) -> None:
        self._inner = CpuExecutor()
        self._buffers = (torch.ones(flush_bytes, dtype=torch.uint8), torch.zeros(flush_bytes, dtype=torch.uint8)) \
            if flush_bytes else None
        self.worker_s = 0.0

    @property
    def max_in_flight(self) -> int:
        return 1

    def _run(self, batch: Batch, progress: LayerProgress) -> None:
        start = time.perf_counter()
        if self._buffers is not None:
            self._buffers[1].copy_(self._buffers[0])
        for layer in range(batch.num_layers):
            progress.layer_done(layer)
        self.worker_s += time.perf_counter() - start

    async def execute(self, batch: Batch, progress: LayerProgress) -> None:
        await self._inner.run_in_worker(self._run, batch, progress)


def build(slots: int, page_size: int) -> tuple[PoolGroup, list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    layers = [[torch.randint(-1000, 1000, (slots, HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16)
               for _ in "kv"] for _ in range(LAYERS)]
    group = PoolGroup()
    group.add_pool("kv", device=DevicePool(layers), page_size=page_size, host_slots=slots)
    return group, layers


async def check_round_trip(sched: TransferScheduler, layers: list[list[torch.Tensor]], slots: int) -> None:
    """One backup of every slot, the device rows zeroed, a load back: the same bytes."""
    want = [[t.clone() for t in layer] for layer in layers]
    b = await sched.backup({"kv": torch.arange(slots)})
    await b
    for layer in layers:
        for t in layer:
            t.zero_()
    ld = await sched.load({"kv": b.host_indices["kv"]}, {"kv": torch.arange(slots)})
    await ld
    if not all(torch.equal(a, w) for la, lw in zip(layers, want, strict=True) for a, w in zip(la, lw, strict=True)):
        raise SystemExit("the round trip changed bytes")
    sched.free_host({"kv": b.host_indices["kv"]})


async def one(sched: TransferScheduler, slots: int, worker_s: Any) -> dict[str, float]:
    """One backup of every slot, awaited and its host indices read; the phases in seconds."""
    idx = torch.arange(slots)
    w0, c0, k0 = time.perf_counter(), time.thread_time(), worker_s()
    handle = await sched.backup({"kv": idx})
    submit_cpu = time.thread_time() - c0
    await handle
    host = handle.host_indices["kv"]
    wall, loop_cpu, worker = time.perf_counter() - w0, time.thread_time() - c0, worker_s() - k0
    sched.free_host({"kv": host})
    return {"wall": wall, "submit": submit_cpu, "worker": worker, "outside": wall - worker, "loop_cpu": loop_cpu}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    pages = max(1, args.mib * 2**20 // (args.page_size * SLOT_BYTES))
    slots = pages * args.page_size
    group, layers = build(slots, args.page_size)
    nbytes = slots * SLOT_BYTES
    copies = CpuExecutor()
    runs: dict[str, tuple[Any, Any]] = {
        "copies": (copies, lambda: copies.statistics().worker_seconds),
    }
    for name, flush in (("no_copy", 0), ("no_copy_flush", nbytes)):
        ex = HandOffOnly(flush)
        runs[name] = (ex, lambda ex=ex: ex.worker_s)
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    async with contextlib.AsyncExitStack() as stack:
        scheds = {name: await stack.enter_async_context(
            TransferScheduler(group if name == "copies" else build(slots, args.page_size)[0], ex))
            for name, (ex, _) in runs.items()}
        await check_round_trip(scheds["copies"], layers, slots)
        # Each executor's repetitions run back to back after a warm-up, not
        # alternating: a repetition right after another executor's copy would
        # start with the caches that copy left.
        for name, (_, worker_s) in runs.items():
            await one(scheds[name], slots, worker_s)
            figures[name] = [await one(scheds[name], slots, worker_s) for _ in range(args.reps)]
    out: dict[str, Any] = {"pages": pages, "page_size": args.page_size, "nbytes": nbytes, "reps": args.reps}
    for name, rows in figures.items():
        out[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return out


def report(out: dict[str, Any]) -> None:
    print(f"one backup of {out['pages']} pages of {out['page_size']} slots ({out['nbytes'] / 2**20:.0f} MiB), "
          f"medians of {out['reps']} (ms)")
    print("| executor | wall | worker | outside the worker | submit (loop CPU) | loop CPU, whole operation |")
    print("|---|---|---|---|---|---|")
    for name in ("copies", "no_copy", "no_copy_flush"):
        f = {k: v * 1e3 for k, v in out[name].items()}
        print(f"| {name} | {f['wall']:.2f} | {f['worker']:.2f} | {f['outside']:.2f} | {f['submit']:.3f} "
              f"| {f['loop_cpu']:.3f} |")
    warm, cold = out["no_copy"]["loop_cpu"], out["no_copy_flush"]["loop_cpu"]
    print(f"the loop's CPU for the operation after the thread moved {out['nbytes'] / 2**20:.0f} MiB: "
          f"{cold / warm:.2f}x its CPU with nothing moved")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    result = asyncio.run(main(a))
    report(result)
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
