"""A hybrid model's serving loop, offloading every request's cache through kvtier.

The model (8 transfer layers) has every kind of pool kvtier handles:

* ``kv``: full-attention K and V on layers 3 and 7, pages of ``page_size`` slots;
* ``c4``: compressed KV, a sidecar of ``kv`` (ratio 4: ``page_size // 4`` rows per page);
* ``swa``: sliding-window K and V on layers 0 and 4;
* ``swa_state``: ring-shaped state, a sidecar of ``swa`` (``ring`` rows per page);
* ``state``: per-request recurrent state on layers 1, 2, 5, 6, page size 1;
* ``tok``: a logical anchor (slots, no bytes) driving ``idx``, an indexer sidecar
  with one row per page on layers 3 and 7.

Each request takes device slots from the engine's allocators, "runs its forward
pass" (writes random rows), backs its cache up to the host, loses its device
rows (wiped and freed), loads them back into fresh device slots that kvtier
allocates, checks every byte, and frees what it holds. Many requests run at
once, so the scheduler merges their operations into batches.

Run: ``python examples/serving_loop.py --requests 600`` (or ``python -m kvtier demo``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import anyio
import structlog
import torch

from kvtier import DevicePool, PageAllocator, PoolGroup, SchedulerConfig, TransferScheduler
from kvtier.transfers import derive_sidecar_indices

LAYERS = 8
FULL = {3: 0, 7: 1}  # transfer layer -> pool layer
WINDOW = {0: 0, 4: 1}
RECURRENT = {1: 0, 2: 1, 5: 2, 6: 3}


@dataclass
class Options:
    requests: int = 600
    concurrency: int = 64
    pages_per_request: int = 4
    page_size: int = 16
    ring: int = 4
    heads: int = 4
    head_dim: int = 64
    layout: str = "page_first"
    seed: int = 0


@dataclass
class Summary:
    requests: int
    operations: int
    gigabytes_moved: float
    seconds: float
    gigabytes_per_second: float
    p50_operation_ms: float
    p99_operation_ms: float
    batches: int
    operations_per_batch: float
    rollbacks: int
    mismatched_requests: int
    every_byte_matched: bool


def build_model_pools(opt: Options) -> PoolGroup:
    """The engine's device tensors, wrapped in kvtier pools. A real engine
    passes its own GPU tensors and allocators here."""
    ps = opt.page_size
    slots = opt.concurrency * opt.pages_per_request * ps * 2  # room for two copies per request
    pages = slots // ps
    host_slots = slots  # each pool's host capacity is its own setting

    def layers(n: int, rows: int, *plane_shapes: tuple[int, ...], dtype: torch.dtype = torch.bfloat16):
        return [[torch.zeros((rows, *s), dtype=dtype) for s in plane_shapes] for _ in range(n)]

    kv_plane = (opt.heads, opt.head_dim)
    group = PoolGroup()
    group.add_pool(
        "kv",
        device=DevicePool(layers(2, slots, kv_plane, kv_plane), FULL, PageAllocator(slots, ps, name="kv")),
        page_size=ps, host_slots=host_slots, layout=opt.layout,
    )
    group.add_sidecar(
        "c4", source="kv", rows_per_page=ps // 4,
        device=DevicePool(layers(2, pages * (ps // 4), (opt.head_dim,)), FULL), layout=opt.layout,
    )
    group.add_pool(
        "swa",
        device=DevicePool(layers(2, slots, kv_plane, kv_plane), WINDOW, PageAllocator(slots, ps, name="swa")),
        page_size=ps, host_slots=host_slots, layout=opt.layout,
    )
    group.add_sidecar(
        "swa_state", source="swa", rows_per_page=opt.ring,
        device=DevicePool(layers(2, pages * opt.ring, (opt.head_dim,), dtype=torch.float32), WINDOW),
        layout=opt.layout,
    )
    state_slots = opt.concurrency * 2
    group.add_pool(
        "state",
        device=DevicePool(
            layers(4, state_slots, (opt.heads, 16, 16), dtype=torch.float32), RECURRENT,
            PageAllocator(state_slots, 1, name="state"),
        ),
        page_size=1, host_slots=state_slots, layout=opt.layout,
    )
    group.add_logical_pool(
        "tok", page_size=ps, host_slots=host_slots, device_slots=slots,
        device_allocator=PageAllocator(slots, ps, name="tok"),
    )
    group.add_sidecar(
        "idx", source="tok", rows_per_page=1,
        device=DevicePool(layers(2, pages, (opt.head_dim,), dtype=torch.float16), FULL), layout=opt.layout,
    )
    return group


def device_rows(group: PoolGroup, indices: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    out = {}
    for name, idx in indices.items():
        dev = group[name].device
        if dev is not None:
            out[name] = [dev.tensor(j, p)[idx].clone() for j in range(dev.num_layers) for p in range(len(dev.planes))]
    return out


def write_rows(group: PoolGroup, indices: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Stand-in for the forward pass: fill the request's rows with fresh values."""
    for name, idx in indices.items():
        dev = group[name].device
        if dev is None:
            continue
        for j in range(dev.num_layers):
            for p, plane in enumerate(dev.planes):
                t = dev.tensor(j, p)
                t[idx] = torch.randn((len(idx), *plane.shape), generator=gen).to(plane.dtype)


def with_sidecars(group: PoolGroup, owned: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(owned)
    for name in owned:
        for side in group.sidecars_of(name):
            spec = side.sidecar
            out[side.name] = derive_sidecar_indices(owned[name], spec.source_page_size, spec.rows_per_page)
    return out


async def serve_request(
    sched: TransferScheduler, group: PoolGroup, opt: Options, rid: int, latencies: list[float]
) -> bool:
    """One request's cache: compute, back up, evict, load back, compare. True if every byte matched."""
    gen = torch.Generator().manual_seed(opt.seed * 1_000_003 + rid)
    n = opt.pages_per_request * opt.page_size
    engine_alloc = {name: group[name].device_allocator for name in ("kv", "swa", "tok", "state")}
    owned = {name: a.try_alloc(1 if name == "state" else n) for name, a in engine_alloc.items()}
    if any(v is None for v in owned.values()):
        raise RuntimeError("demo device pools are sized for the concurrency; this is a bug")
    everything = with_sidecars(group, owned)
    write_rows(group, everything, gen)
    expected = device_rows(group, everything)

    t0 = time.perf_counter()
    backup = await sched.backup(owned)
    await backup
    latencies.append(time.perf_counter() - t0)

    # Evicted from the GPU: the rows are gone and the slots reused by others.
    for name, idx in owned.items():
        engine_alloc[name].free(idx)
    for name, idx in everything.items():
        dev = group[name].device
        if dev is not None:
            for j in range(dev.num_layers):
                for p in range(len(dev.planes)):
                    dev.tensor(j, p)[idx] = 0

    # The prefix comes back: kvtier allocates fresh device slots and loads.
    t0 = time.perf_counter()
    load = await sched.load({name: backup.host_indices[name] for name in owned})
    await load
    latencies.append(time.perf_counter() - t0)
    got = device_rows(group, load.device_indices)
    matched = all(
        torch.equal(a, b) for name in expected for a, b in zip(expected[name], got[name], strict=True)
    )
    sched.free_host({name: backup.host_indices[name] for name in owned})
    for name in owned:
        engine_alloc[name].free(load.device_indices[name])
    return matched


async def run(opt: Options) -> Summary:
    group = build_model_pools(opt)
    latencies: list[float] = []
    mismatched = 0
    limiter = anyio.CapacityLimiter(opt.concurrency)

    async def one(rid: int) -> None:
        nonlocal mismatched
        async with limiter:
            if not await serve_request(sched, group, opt, rid, latencies):
                mismatched += 1

    start = time.perf_counter()
    async with TransferScheduler(group, config=SchedulerConfig()) as sched:
        async with anyio.create_task_group() as tg:
            for rid in range(opt.requests):
                tg.start_soon(one, rid)
        stats = sched.statistics()
    seconds = time.perf_counter() - start
    moved = stats.backup.bytes + stats.load.bytes
    batches = stats.backup.batches + stats.load.batches
    ops = stats.backup.completed + stats.load.completed
    lat = sorted(latencies)
    return Summary(
        requests=opt.requests,
        operations=ops,
        gigabytes_moved=moved / 1e9,
        seconds=seconds,
        gigabytes_per_second=moved / 1e9 / seconds,
        p50_operation_ms=statistics.median(lat) * 1e3,
        p99_operation_ms=lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
        batches=batches,
        operations_per_batch=ops / batches if batches else 0.0,
        rollbacks=stats.rollbacks,
        mismatched_requests=mismatched,
        every_byte_matched=mismatched == 0,
    )


def parse_args(argv: list[str] | None) -> tuple[Options, bool]:
    d = Options()
    ap = argparse.ArgumentParser(prog="kvtier demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=d.requests, help="requests to serve (2 operations each)")
    ap.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight at once")
    ap.add_argument("--pages-per-request", type=int, default=d.pages_per_request)
    ap.add_argument("--page-size", type=int, default=d.page_size, help="slots per page (a multiple of 4)")
    ap.add_argument("--layout", choices=["layer_first", "page_first"], default=d.layout)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    if a.page_size % 4 or a.page_size < 4:
        ap.error(f"--page-size must be a positive multiple of 4 (compressed KV ratio); got {a.page_size}")
    for name in ("requests", "concurrency", "pages_per_request"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(a, name)}")
    opt = Options(
        requests=a.requests, concurrency=a.concurrency, pages_per_request=a.pages_per_request,
        page_size=a.page_size, layout=a.layout, seed=a.seed,
    )
    return opt, a.json


def main(argv: list[str] | None = None) -> int:
    opt, as_json = parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up
    summary = anyio.run(run, opt)
    if as_json:
        print(json.dumps(asdict(summary), indent=2))
    else:
        print(f"kvtier demo: {opt.requests} requests x 2 operations over pools kv, c4, swa, swa_state, state, tok, idx")
        print(f"  operations            {summary.operations}")
        print(f"  moved                 {summary.gigabytes_moved:.3f} GB in {summary.seconds:.2f} s "
              f"({summary.gigabytes_per_second:.2f} GB/s)")
        print(f"  operation latency     p50 {summary.p50_operation_ms:.2f} ms, p99 {summary.p99_operation_ms:.2f} ms")
        print(f"  batches               {summary.batches} ({summary.operations_per_batch:.1f} operations per batch)")
        print(f"  rollbacks             {summary.rollbacks}")
        print(f"  every byte matched    {'yes' if summary.every_byte_matched else f'NO ({summary.mismatched_requests} requests differ)'}")
    return 0 if summary.every_byte_matched else 1


if __name__ == "__main__":
    sys.exit(main())
