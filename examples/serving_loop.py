"""A serving loop for a hybrid model: the pattern an engine author copies.

The model's cache has the kinds of pool hybrid models have:

* ``kv``: full-attention K and V on every layer, pages of 16 slots from the
  engine's own allocator;
* ``swa``: sliding-window K and V on the even layers only (``layer_map``); a
  prefix keeps only its last page (the window) there;
* ``c4``: compressed KV at ratio 4, a *sidecar* of ``kv``: 4 rows per ``kv``
  page, whose indices kvtier derives from ``kv``'s (never named in a call);
* ``state``: the recurrent state after the prefix, one slot (page size 1).

Requests name one of ``--prefixes`` shared prefixes (drawn by a Zipf law) and
run ``--concurrency`` at a time. Per request the loop:

1. looks the prefix up in the host tier's index (`HostCacheIndex`, SLRU order)
   and pins it while it reads the host pages;
2. on a host hit, loads it into device pages that kvtier takes from the
   engine's allocators (the sidecar follows ``kv``), waits for each layer
   before running that layer, and falls back to recomputing if the load fails;
3. on a miss, runs the prefill, backs the prefix up (write-through: the device
   rows are freed only once the bytes are on the host) and enters its host
   pages in the index;
4. frees its device pages: the device holds only the requests in flight.

When a pool's host pages run short, the scheduler calls the index's
``reclaim`` hook, which frees the coldest prefixes no request is reading. The
forward pass is a stand-in: a prefix's rows are a seeded function of (prefix,
pool, layer, plane), so "running layer i" compares every byte of layer i that
was loaded. It exits with status 1 if any differs (``--corrupt`` alters a
host row before the first load to show the check fail).

Run: ``python examples/serving_loop.py`` (``--help`` for the options).
Sharing prefixes across engines through a store: docs/storage.md.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import anyio
import torch

from kvtier import (
    CorruptionDetected,
    DevicePool,
    PageAllocator,
    PoolExhausted,
    PoolGroup,
    TransferFailed,
    TransferScheduler,
)
from kvtier.policies import HostCacheIndex, SegmentedLruEviction

PAGE = 16  # slots (tokens) per page of kv and swa
LAYERS = 4
HEADS, HEAD_DIM = 2, 16
C4_ROWS = PAGE // 4  # compressed KV: one row per 4 tokens
POOL_SEED = {"kv": 1, "swa": 2, "c4": 3, "state": 4}


@dataclass
class Options:
    requests: int = 48
    prefixes: int = 8
    prefix_pages: int = 4  # kv pages per prefix (64 tokens)
    concurrency: int = 4  # requests in flight; the device holds exactly these
    host_prefixes: int = 5  # the host tier holds this many prefixes: fewer than --prefixes, so it evicts
    seed: int = 0
    corrupt: bool = False


@dataclass
class Report:
    host_hits: int = 0
    prefills: int = 0
    failed_loads: int = 0
    not_backed_up: int = 0
    host_evictions: int = 0  # prefixes the reclaim hook freed from the host tier
    mismatches: list[str] = field(default_factory=list)


def stand_in_rows(prefix: int, pool: str, layer: int, plane: int, like: torch.Tensor, n: int) -> torch.Tensor:
    """What the forward pass writes into ``n`` rows of ``pool``'s ``layer``
    ``plane`` for ``prefix``: a seeded stand-in, the same on every call."""
    gen = torch.Generator().manual_seed(((prefix * 8 + POOL_SEED[pool]) * 64 + layer) * 4 + plane)
    return torch.randn((n, *like.shape[1:]), generator=gen).to(like.dtype)


class Engine:
    def __init__(self, opt: Options) -> None:
        self.opt = opt
        c = opt.concurrency
        # The engine's own cache memory and allocators (on CUDA: its GPU tensors).
        self.alloc = {
            "kv": PageAllocator(c * opt.prefix_pages * PAGE, PAGE, name="kv"),
            "swa": PageAllocator(c * PAGE, PAGE, name="swa"),
            "state": PageAllocator(c, 1, name="state"),
        }
        even = [t // 2 if t % 2 == 0 else None for t in range(LAYERS)]  # transfer layer -> swa's own layer
        self.device = {
            "kv": DevicePool(planes(c * opt.prefix_pages * PAGE, LAYERS, [(HEADS, HEAD_DIM)] * 2, torch.bfloat16),
                             allocator=self.alloc["kv"]),
            "swa": DevicePool(planes(c * PAGE, (LAYERS + 1) // 2, [(HEADS, HEAD_DIM)] * 2, torch.bfloat16), even,
                              allocator=self.alloc["swa"]),
            "c4": DevicePool(planes(c * opt.prefix_pages * C4_ROWS, LAYERS, [(HEAD_DIM,)], torch.bfloat16)),
            "state": DevicePool(planes(c, LAYERS, [(HEADS, HEAD_DIM, HEAD_DIM)], torch.float32),
                                allocator=self.alloc["state"]),
        }
        # Each pool's host capacity on its own: a shared budget starves the small pools.
        h = opt.host_prefixes
        self.group = PoolGroup()
        self.group.add_pool("kv", device=self.device["kv"], page_size=PAGE, host_slots=h * opt.prefix_pages * PAGE,
                            layout="page_first")
        self.group.add_pool("swa", device=self.device["swa"], page_size=PAGE, host_slots=h * PAGE, layout="page_first")
        self.group.add_sidecar("c4", source="kv", rows_per_page=C4_ROWS, device=self.device["c4"], layout="page_first")
        self.group.add_pool("state", device=self.device["state"], page_size=1, host_slots=h, layout="page_first")
        # The host tier's index: prefix -> its host pages, evicted coldest first.
        self.host = HostCacheIndex(SegmentedLruEviction(capacity=h))
        self.report = Report()
        self.corrupted = False

    async def serve(self, sched: TransferScheduler, prefix: int) -> None:
        host = self.host.lookup(prefix)
        if host is not None:
            self.host.pin(prefix)  # no reclaim frees these pages while the load reads them
            if self.opt.corrupt and not self.corrupted:  # --corrupt: a host row altered, as a bad DIMM would
                self.corrupted = True
                self.group["kv"].host.layer_view(0, 0)[int(host["kv"][0])] += 1
            try:
                load = await sched.load(host)  # device pages from the engine's allocators
                try:
                    for layer in range(LAYERS):
                        await load.layer_ready(layer)  # layer i of every pool is in place
                        self.run_layer(prefix, layer, load.device_indices)
                    await load
                except (TransferFailed, CorruptionDetected):
                    # kvtier freed the device pages it took; forget the copy and recompute.
                    self.report.failed_loads += 1
                    sched.free_host(self.host.remove(prefix) or {})
                else:
                    self.report.host_hits += 1
                    self.free_device(load.device_indices)
                    return
            finally:
                self.host.unpin(prefix)
        await self.prefill_and_back_up(sched, prefix)

    async def prefill_and_back_up(self, sched: TransferScheduler, prefix: int) -> None:
        self.report.prefills += 1
        taken = {
            "kv": self.alloc["kv"].try_alloc(self.opt.prefix_pages * PAGE),
            "swa": self.alloc["swa"].try_alloc(PAGE),
            "state": self.alloc["state"].try_alloc(1),
        }
        dev = {name: idx for name, idx in taken.items() if idx is not None}
        if len(dev) < len(taken):  # pragma: no cover - the device is sized for the requests in flight
            self.free_device(dev)
            raise RuntimeError("the device pools are sized for --concurrency requests")
        dev["c4"] = c4_rows(dev["kv"])  # the rows the model writes for kv's pages
        for name, idx in dev.items():  # the forward pass (stand-in)
            pool = self.device[name]
            for layer in range(pool.num_layers):
                for plane in range(len(pool.planes)):
                    t = pool.tensor(layer, plane)
                    t[idx] = stand_in_rows(prefix, name, layer, plane, t, len(idx))
        try:
            backup = await sched.backup({n: dev[n] for n in ("kv", "swa", "state")})  # c4 follows kv
            await backup  # the copy reads the device rows: free them only after it
        except PoolExhausted:
            self.report.not_backed_up += 1  # every host page is read by a load in flight: serve without a copy
        else:
            if prefix in self.host:  # another request computed it meanwhile: keep one copy
                sched.free_host(backup)
            else:
                self.host.insert(prefix, backup.host_indices)
        self.free_device(dev)

    def run_layer(self, prefix: int, layer: int, device_indices: Mapping[str, torch.Tensor]) -> None:
        """The forward pass of ``layer`` (stand-in): it reads every pool's rows of
        that layer, which must be the ones the prefill wrote."""
        for name, idx in device_indices.items():
            pool = self.device[name]
            pool_layer = pool.pool_layer(layer)
            if pool_layer is None:
                continue
            for plane in range(len(pool.planes)):
                t = pool.tensor(pool_layer, plane)
                if not torch.equal(t[idx], stand_in_rows(prefix, name, pool_layer, plane, t, len(idx))):
                    self.report.mismatches.append(f"prefix {prefix} pool {name!r} layer {layer} plane {plane}")

    def free_device(self, dev: Mapping[str, torch.Tensor]) -> None:
        for name, alloc in self.alloc.items():  # c4 has no allocator: its rows follow kv's pages
            if name in dev:
                alloc.free(dev[name])


def planes(slots: int, layers: int, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> list[list[torch.Tensor]]:
    return [[torch.zeros((slots, *shape), dtype=dtype) for shape in shapes] for _ in range(layers)]


def c4_rows(kv: torch.Tensor) -> torch.Tensor:
    """The compressed-KV rows of ``kv``'s pages: rows ``p*4 .. p*4+3`` for page ``p``."""
    pages = kv[::PAGE] // PAGE
    return (pages[:, None] * C4_ROWS + torch.arange(C4_ROWS)).flatten()


async def run(opt: Options) -> Report:
    engine = Engine(opt)
    rng = random.Random(opt.seed)
    weights = [1 / (k + 1) for k in range(opt.prefixes)]  # Zipf 1.0: a few hot prefixes, a long tail
    stream = rng.choices(range(opt.prefixes), weights, k=opt.requests)
    async with TransferScheduler(engine.group, reclaim=engine.host.reclaim) as sched:
        engine.host.bind(sched)  # the index frees host pages through this scheduler
        limit = anyio.Semaphore(opt.concurrency)

        async def one(prefix: int) -> None:
            async with limit:
                await engine.serve(sched, prefix)

        async with anyio.create_task_group() as tg:
            for prefix in stream:
                tg.start_soon(one, prefix)
    engine.report.host_evictions = engine.host.evicted
    return engine.report


def main(argv: Sequence[str] | None = None) -> int:
    d = Options()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--prefixes", type=int, default=d.prefixes)
    ap.add_argument("--prefix-pages", type=int, default=d.prefix_pages)
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--host-prefixes", type=int, default=d.host_prefixes, help="prefixes the host tier holds")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--corrupt", action="store_true",
                    help="alter a host row before the first load (the check must then fail)")
    a = ap.parse_args(argv)
    opt = Options(a.requests, a.prefixes, a.prefix_pages, a.concurrency, a.host_prefixes, a.seed, a.corrupt)
    r = anyio.run(run, opt)
    print(f"{opt.requests} requests over {opt.prefixes} prefixes, {opt.concurrency} at a time: "
          f"{r.host_hits} host hits, {r.prefills} prefills, {r.failed_loads} failed loads, "
          f"{r.not_backed_up} not backed up, {r.host_evictions} evicted from the host")
    if r.mismatches:
        print(f"loaded rows DIFFER from the prefill's: {r.mismatches[0]} (and {len(r.mismatches) - 1} more)")
        return 1
    print("every loaded row equals the prefill's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
