"""A hybrid model's serving loop, offloading every request's cache through kvtier.

Part one serves requests of a DeepSeek V4-shaped model whose pools come from
the preset (`kvtier.presets.deepseek_v4`), sized by ``--host-ratio``: a logical
anchor ``tok`` (token positions, no bytes) whose pages drive the sidecars
``c4`` (CSA compressed KV, rate 4), ``c4_indexer`` (CSA indexer keys) and
``c128`` (HCA compressed KV, rate 128), each on the layers that have such a
compressor; the sliding window ``swa`` with pages of its own; the compressor
overlaps ``c4_state`` (one slot per request) and the buffers ``c4_buffer`` and
``c128_buffer`` (one row per token not yet compressed). Each request takes device slots from the engine's
allocators, "runs its forward pass" (writes random rows), backs its cache up
to the host, loses its device rows (wiped and freed), loads them back into
fresh device slots that kvtier allocates, checks every byte, and frees what
it holds. Many requests run at once, so the scheduler merges their operations.

Part two (``--storage file|redis``, default ``file``) uses a hand-built hybrid
group with every kind of pool kvtier handles (``kv`` with its ``c4`` sidecar,
``swa`` with a ring-shaped ``swa_state`` sidecar, per-request ``state``, a
logical ``tok`` driving an ``idx`` sidecar). Two engines share a storage
tier: engine A serves prompts that share a long system prefix, computes their
cache, backs it up and writes it to the store (the shared prefix once); engine B,
with pools and a scheduler of its own, receives the same prompts, prefetches
their pages from the store by key, loads them into its own device slots and
checks every byte against what engine A computed. ``--storage none`` skips it.

Run: ``kvtier demo`` (or ``python -m kvtier demo``; ``--help`` lists the options).
``examples/serving_loop.py`` runs it from a checkout; read this module as the
pattern to copy.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TextIO
from dataclasses import asdict, dataclass, field, replace

import anyio
import torch

from types import SimpleNamespace

from kvtier import (
    ConfigurationError,
    DevicePool,
    KvtierError,
    PageAllocator,
    PoolGroup,
    PrefetchResult,
    SchedulerConfig,
    TransferScheduler,
    WriteStorageResult,
)
from kvtier.pools import Layout, SlotAllocator
from kvtier.presets import DeepseekV4Stack, deepseek_v4
from kvtier.storage import EngineIdentity, FileStore, KeyNamespace, RedisStore, page_keys, window_keys
from kvtier.testing.redis_server import LocalRedisServer, find_redis_server
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
    layout: Layout = "page_first"
    seed: int = 0
    # Part one: the DeepSeek V4 stack.
    v4_page_size: int = 128  # anchor tokens per page: a multiple of the HCA rate (128)
    host_ratio: float = 1.0  # host pages = ratio x device pages, per pool
    # The storage part: two engines sharing a store.
    storage: str = "file"  # "file", "redis" or "none"
    redis_url: str | None = None  # None: start a throwaway redis-server
    prompts: int = 8
    prefix_pages: int = 6  # the system prefix every prompt starts with
    suffix_pages: int = 2  # each prompt's own pages after it
    window_pages: int = 2  # sliding-window pages an engine keeps (the last ones)
    progress: bool = False  # a progress line on stderr (a terminal's only, unless --quiet)


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
    host_ratio: float = 0.0
    pools: list[dict[str, object]] = field(default_factory=list)  # per pool: kind, pages, rows, bytes
    # Where an operation's time went, in means over completed backups and loads:
    # submit to done as the demo's requests saw it, then the scheduler's own split
    # (queued: waiting in a lane for a batch; copying: its batch running), and the
    # rest (the loop busy with other requests' work: writing and checking rows).
    concurrency: int = 0
    mean_operation_ms: float = 0.0
    mean_queued_ms: float = 0.0
    mean_copying_ms: float = 0.0
    mean_rest_ms: float = 0.0


class Progress:
    """One line on stderr, rewritten in place (``\\r``) at most ten times a
    second: ``kvtier demo: part one: requests served 120/600``. Only on a
    terminal: captured output gets the summary alone."""

    def __init__(self, total: int, what: str, stream: TextIO | None = None) -> None:
        self.total, self.what, self.done = total, what, 0
        self.stream = sys.stderr if stream is None else stream
        self._shown = 0.0

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self._shown >= 0.1 or self.done == self.total:
            self._shown = now
            self.stream.write(f"\rkvtier demo: {self.what} {self.done}/{self.total}")
            self.stream.flush()

    def close(self) -> None:
        self.stream.write("\r\x1b[K")  # the line goes: the summary follows on stdout
        self.stream.flush()


def rate(nbytes: float, seconds: float) -> str:
    """``nbytes`` per ``seconds`` in the unit that shows it with three
    significant digits (a short run moves MB/s, not "0.00 GB/s")."""
    per_s = nbytes / seconds if seconds > 0 else 0.0
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if per_s >= scale:
            return f"{per_s / scale:.3g} {unit}"
    return f"{per_s:.3g} B/s"


def size(nbytes: float) -> str:
    """``nbytes`` in GB, MB or kB, three significant digits."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def build_model_pools(opt: Options) -> PoolGroup:
    """The engine's device tensors, wrapped in kvtier pools. A real engine
    passes its own GPU tensors and allocators here."""
    ps = opt.page_size
    slots = opt.concurrency * opt.pages_per_request * ps * 2  # room for two copies per request
    pages = slots // ps
    host_slots = slots  # each pool's host capacity is its own setting

    def layers(
        n: int, rows: int, *plane_shapes: tuple[int, ...], dtype: torch.dtype = torch.bfloat16
    ) -> list[list[torch.Tensor]]:
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
    """Copies of the rows at ``indices``: per pool, one tensor per plane (all
    layers at once where the pool's layers share one tensor) or per layer and plane."""
    out = {}
    for name, idx in indices.items():
        dev = group[name].device
        if dev is not None:
            rows = []
            for p in range(len(dev.planes)):
                stacked = dev.stacked(p)
                # index_select copies: several times faster than advanced indexing on CPU.
                if stacked is not None:
                    rows.append(stacked.index_select(1, idx))
                else:
                    rows += [dev.tensor(j, p).index_select(0, idx) for j in range(dev.num_layers)]
            out[name] = rows
    return out


def write_rows(group: PoolGroup, indices: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Stand-in for the forward pass: fill the request's rows with fresh values."""
    for name, idx in indices.items():
        dev = group[name].device
        if dev is None:
            continue
        for p, plane in enumerate(dev.planes):
            stacked = dev.stacked(p)
            if stacked is not None:
                values = torch.randn((dev.num_layers, len(idx), *plane.shape), generator=gen).to(plane.dtype)
                stacked.index_copy_(1, idx, values)
                continue
            for j in range(dev.num_layers):
                t = dev.tensor(j, p)
                t.index_copy_(0, idx, torch.randn((len(idx), *plane.shape), generator=gen).to(plane.dtype))


def device_allocator(group: PoolGroup, name: str) -> SlotAllocator:
    """The engine's allocator of pool ``name`` (every demo pool has one)."""
    alloc = group[name].device_allocator
    assert alloc is not None, name
    return alloc


def take(allocators: Mapping[str, SlotAllocator], slots: Mapping[str, int], sized_for: str) -> dict[str, torch.Tensor]:
    """``slots[pool]`` device slots from each allocator (the engine's own allocation)."""
    out = {}
    for name, n in slots.items():
        got = allocators[name].try_alloc(n)
        if got is None:
            # An invariant of the demo's own sizing, not input: a bug if it fires.
            raise RuntimeError(f"demo device pools are sized for {sized_for}; this is a bug")
        out[name] = got
    return out


def with_sidecars(group: PoolGroup, owned: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(owned)
    for name in owned:
        for side in group.sidecars_of(name):
            spec = side.sidecar
            assert spec is not None  # sidecars_of gives sidecars
            out[side.name] = derive_sidecar_indices(owned[name], spec.source_page_size, spec.rows_per_page)
    return out


def v4_config(opt: Options) -> SimpleNamespace:
    """A DeepSeek V4-shaped config: V4-Pro's layer schedule (two HCA layers, then
    HCA / CSA alternating), the real compress rates and window, small widths.
    The preset reads these attributes only; ``transformers.DeepseekV4Config``
    has them all."""
    interleave = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(LAYERS - 2)]
    return SimpleNamespace(
        layer_types=["heavily_compressed_attention"] * 2 + interleave,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        sliding_window=128, head_dim=opt.head_dim, index_head_dim=opt.head_dim // 2, num_key_value_heads=1,
    )


def build_v4_pools(opt: Options) -> tuple[PoolGroup, DeepseekV4Stack]:
    """The V4 stack from the preset: device pools for ``concurrency`` requests
    of ``pages_per_request`` anchor pages, twice over (a load lands in fresh
    slots while the old ones are still taken), the host tier sized by ratio.
    A real engine passes its own tensors (``devices=``) instead."""
    group = PoolGroup()
    requests = 2 * opt.concurrency
    stack, _ = deepseek_v4(
        v4_config(opt), group, page_size=opt.v4_page_size, dtype=torch.bfloat16, layout=opt.layout,
        tokens=requests * opt.pages_per_request * opt.v4_page_size, requests=requests, host_ratio=opt.host_ratio,
    )
    return group, stack


def request_tokens(opt: Options, rid: int) -> int:
    """A request's length: it ends somewhere in its last anchor page, so the
    window, the buffers and the partial page differ from request to request."""
    page = opt.v4_page_size
    return (opt.pages_per_request - 1) * page + 1 + (rid * 37) % page


async def serve_request(
    sched: TransferScheduler, group: PoolGroup, stack: DeepseekV4Stack, opt: Options, rid: int,
    latencies: list[float],
) -> bool:
    """One request's cache: compute, back up, evict, load back, compare. True if every byte matched."""
    gen = torch.Generator().manual_seed(opt.seed * 1_000_003 + rid)
    needed = stack.slots_needed(request_tokens(opt, rid))  # per slot-owning pool
    engine_alloc = {name: device_allocator(group, name) for name in needed}
    owned = take(engine_alloc, needed, "the concurrency")
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
            for p in range(len(dev.planes)):
                stacked = dev.stacked(p)
                if stacked is not None:
                    stacked.index_fill_(1, idx, 0)
                else:
                    for j in range(dev.num_layers):
                        dev.tensor(j, p).index_fill_(0, idx, 0)

    # The prefix comes back: kvtier allocates fresh device slots and loads.
    t0 = time.perf_counter()
    load = await sched.load({name: backup.host_indices[name] for name in owned})
    await load
    latencies.append(time.perf_counter() - t0)
    got = device_rows(group, load.device_indices)
    matched = set(got) == set(expected) and all(
        same_bytes(a, b) for name in expected for a, b in zip(expected[name], got[name], strict=True)
    )
    sched.free_host({name: backup.host_indices[name] for name in owned})
    for name in owned:
        engine_alloc[name].free(load.device_indices[name])
    return matched


async def run(opt: Options) -> Summary:
    group, stack = build_v4_pools(opt)
    latencies: list[float] = []
    mismatched = 0
    limiter = anyio.CapacityLimiter(opt.concurrency)

    progress = Progress(opt.requests, "part one: requests served") if opt.progress else None

    async def one(rid: int) -> None:
        nonlocal mismatched
        async with limiter:
            if not await serve_request(sched, group, stack, opt, rid, latencies):
                mismatched += 1
        if progress is not None:
            progress.step()

    start = time.perf_counter()
    async with TransferScheduler(group, config=SchedulerConfig()) as sched:
        async with anyio.create_task_group() as tg:
            for rid in range(opt.requests):
                tg.start_soon(one, rid)
        stats = sched.statistics()
    if progress is not None:
        progress.close()
    seconds = time.perf_counter() - start
    moved = stats.backup.bytes + stats.load.bytes
    batches = stats.backup.batches + stats.load.batches
    ops = stats.backup.completed + stats.load.completed
    lat = sorted(latencies)
    queued = stats.backup.latency.queued.sum_seconds + stats.load.latency.queued.sum_seconds
    copying = stats.backup.latency.running.sum_seconds + stats.load.latency.running.sum_seconds
    mean = statistics.fmean(lat) if lat else 0.0
    per_op = 1e3 / ops if ops else 0.0
    return Summary(
        requests=opt.requests,
        operations=ops,
        gigabytes_moved=moved / 1e9,
        seconds=seconds,
        gigabytes_per_second=moved / 1e9 / seconds if seconds > 0 else 0.0,
        p50_operation_ms=statistics.median(lat) * 1e3,
        p99_operation_ms=lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
        batches=batches,
        operations_per_batch=ops / batches if batches else 0.0,
        rollbacks=stats.rollbacks,
        mismatched_requests=mismatched,
        every_byte_matched=mismatched == 0,
        host_ratio=opt.host_ratio,
        pools=stack.describe(group),
        concurrency=opt.concurrency,
        mean_operation_ms=mean * 1e3,
        mean_queued_ms=queued * per_op,
        mean_copying_ms=copying * per_op,
        mean_rest_ms=max(0.0, mean * 1e3 - (queued + copying) * per_op),
    )


# -- Two engines sharing a storage tier ------------------------------------------

MODEL = "demo-model"  # part of every page key: engines share pages of the same model only
IDENTITY = EngineIdentity(MODEL)  # what each scheduler's stored pages carry (and their keys derive from)
ANCHORS = ("kv", "swa", "state", "tok")  # the pools that own slots; sidecars travel with them


@dataclass
class StorageSummary:
    backend: str
    location: str
    prompts: int
    # Per anchor pool (sidecars are stored with their anchor's pages):
    pages_written: dict[str, int] = field(default_factory=dict)  # put by engine A
    pages_present: dict[str, int] = field(default_factory=dict)  # already stored when A wrote: skipped
    pages_requested: dict[str, int] = field(default_factory=dict)  # keys engine B looked up
    pages_hit: dict[str, int] = field(default_factory=dict)  # found in the store
    pages_prefetched: dict[str, int] = field(default_factory=dict)  # read into B's host, loaded to its device
    bytes_written: int = 0
    bytes_prefetched: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    mismatched_prompts: int = 0
    every_byte_matched: bool = False


def make_prompts(opt: Options) -> list[list[int]]:
    """Token ids: one system prefix shared by every prompt, then each prompt's own pages."""
    gen = torch.Generator().manual_seed(opt.seed)
    ps = opt.page_size
    system = torch.randint(0, 32_000, (opt.prefix_pages * ps,), generator=gen).tolist()
    return [
        system + torch.randint(0, 32_000, (opt.suffix_pages * ps,), generator=gen).tolist()
        for _ in range(opt.prompts)
    ]


def key_namespaces(group: PoolGroup) -> dict[str, KeyNamespace]:
    """One namespace per anchor pool, from its page identity (`IDENTITY` with
    the group: model, pool, page size, element formats, layout and shapes, its
    sidecars' too). Engines with the same model and pools get the same
    namespaces, so the same keys for the same tokens."""
    return {pool: IDENTITY.page_identity(group, pool).namespace() for pool in ANCHORS}


def prompt_keys(namespaces: dict[str, KeyNamespace], tokens: list[int], window_pages: int) -> dict[str, list[bytes]]:
    """The page keys of ``tokens`` that an engine stores and looks up, per anchor pool."""
    return {
        # Full attention (and the indexer on ``tok``) keeps every whole page.
        "kv": page_keys(namespaces["kv"], tokens),
        "tok": page_keys(namespaces["tok"], tokens),
        # A sliding window keeps only its last pages, and which of their rows
        # it still holds depends on where the prompt ends: window_keys name
        # the whole prompt as well as the page. (A lookup counts its hit from
        # the first key passed, so the window's keys alone are fine.)
        "swa": window_keys(namespaces["swa"], tokens, window_pages),
        # Page size 1, one slot per request: the state after the whole prompt.
        "state": window_keys(namespaces["state"], tokens, 1),
    }


def scramble(group: PoolGroup, seed: int) -> None:
    """Fill every device tensor with noise, so a page that is not loaded shows."""
    gen = torch.Generator().manual_seed(seed)
    for spec in group:
        dev = spec.device
        if dev is not None:
            for j in range(dev.num_layers):
                for p, plane in enumerate(dev.planes):
                    t = dev.tensor(j, p)
                    t.copy_(torch.randn(t.shape, generator=gen).to(plane.dtype))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (``torch.equal`` compares values: 0.0 == -0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def compute_pages(group: PoolGroup, owned: dict[str, torch.Tensor], keys: dict[str, list[bytes]]) -> None:
    """Stand-in for the forward pass, page by page.

    A page's cache depends only on the tokens up to its end, which is what its
    key names, so its rows come from a generator seeded by the key: prompts
    that share a prefix get the same bytes for its pages, as with a real model.
    """
    for name, idx in owned.items():
        size = group[name].page_size
        for i, key in enumerate(keys[name]):
            page = {name: idx[i * size:(i + 1) * size]}
            gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
            write_rows(group, with_sidecars(group, page), gen)


async def engine_a_serve(
    sched: TransferScheduler, group: PoolGroup, keys: dict[str, list[bytes]]
) -> tuple[dict[str, list[torch.Tensor]], WriteStorageResult]:
    """Engine A, one prompt: compute its cache, back it up, write it to the
    store, free everything. Returns the rows it computed and the write's result."""
    allocators = {name: device_allocator(group, name) for name in ANCHORS}
    owned = take(allocators, {name: len(keys[name]) * group[name].page_size for name in ANCHORS}, "the prompts")
    compute_pages(group, owned, keys)
    computed = device_rows(group, with_sidecars(group, owned))

    backup = await sched.backup(owned)
    await backup
    for name, idx in owned.items():  # the GPU copy is no longer needed
        allocators[name].free(idx)

    # Host -> storage, one key per page, in page order. Pages another prompt
    # already stored (the shared prefix) are skipped.
    host = {name: backup.host_indices[name] for name in ANCHORS}  # anchors only: sidecars come along
    write = await sched.write_storage(host, keys)
    written = await write
    sched.free_host(host)
    return computed, written


async def engine_b_serve(
    sched: TransferScheduler, group: PoolGroup, keys: dict[str, list[bytes]],
    expected: dict[str, list[torch.Tensor]],
) -> tuple[PrefetchResult, bool]:
    """Engine B, one prompt: prefetch its pages from the store, load them into
    device slots kvtier allocates, compare with what engine A computed, free
    everything. Returns the prefetch's result and whether every byte matched."""
    # all_pools: a hybrid model needs every pool's pages (kv without the state
    # after the prefix is of no use), so read nothing unless every key is stored.
    prefetch = await sched.prefetch(keys, policy="wait_complete", all_pools=True)
    fetched = await prefetch
    if not fetched.complete:  # engine A stored every page of every prompt
        if fetched.host_indices:
            sched.free_host(fetched.host_indices)
        return fetched, False

    load = await sched.load(fetched.host_indices)
    await load
    got = device_rows(group, load.device_indices)  # anchors and sidecars
    matched = set(got) == set(expected) and all(
        same_bytes(a, b) for name in expected for a, b in zip(expected[name], got[name], strict=True)
    )
    sched.free_host(fetched.host_indices)
    for name in ANCHORS:
        device_allocator(group, name).free(load.device_indices[name])
    return fetched, matched


def _add(total: dict[str, int], part: Mapping[str, int]) -> None:
    for name, n in part.items():
        total[name] = total.get(name, 0) + n


async def run_storage(
    opt: Options, backend: str, location: str, open_store: Callable[[], FileStore | RedisStore]
) -> StorageSummary:
    """Engine A writes every prompt's cache to the store; engine B, with pools
    and a scheduler of its own, reads it back by key. ``open_store()`` gives a
    new store instance on the shared directory or server: one per engine."""
    prompts = make_prompts(opt)
    # Room for every prompt at once, in each engine.
    sizing = replace(opt, concurrency=opt.prompts, pages_per_request=opt.prefix_pages + opt.suffix_pages)
    out = StorageSummary(backend=backend, location=location, prompts=len(prompts))

    # Engine A serves every prompt at once. The system prefix's pages are put
    # once: writes that share them in one batch put each key once, and a later
    # write finds them already stored.
    group_a = build_model_pools(sizing)
    scramble(group_a, seed=opt.seed + 1)
    ns_a = key_namespaces(group_a)
    computed: dict[int, dict[str, list[torch.Tensor]]] = {}

    async def serve_a(i: int) -> None:
        computed[i], written = await engine_a_serve(sched_a, group_a, prompt_keys(ns_a, prompts[i], opt.window_pages))
        _add(out.pages_written, written.pages_written)
        _add(out.pages_present, written.pages_present)
        out.bytes_written += written.nbytes

    start = time.perf_counter()
    async with open_store() as store_a, TransferScheduler(group_a, storage=store_a, identity=IDENTITY) as sched_a:
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(serve_a, i)
    out.write_seconds = time.perf_counter() - start

    # Engine B: separate pools (other device contents), scheduler and store
    # instance; it knows only the prompts' tokens.
    group_b = build_model_pools(sizing)
    scramble(group_b, seed=opt.seed + 2)
    ns_b = key_namespaces(group_b)

    async def serve_b(i: int) -> None:
        fetched, matched = await engine_b_serve(
            sched_b, group_b, prompt_keys(ns_b, prompts[i], opt.window_pages), computed[i]
        )
        _add(out.pages_requested, fetched.requested_pages)
        _add(out.pages_hit, fetched.hit_pages)
        _add(out.pages_prefetched, fetched.pages)
        out.bytes_prefetched += fetched.nbytes
        if not matched:
            out.mismatched_prompts += 1

    start = time.perf_counter()
    async with (
        open_store() as store_b,
        TransferScheduler(group_b, storage=store_b, identity=IDENTITY) as sched_b,
        anyio.create_task_group() as tg,
    ):
        for i in range(len(prompts)):
            tg.start_soon(serve_b, i)
    out.read_seconds = time.perf_counter() - start
    out.every_byte_matched = out.mismatched_prompts == 0
    return out


@contextlib.contextmanager
def shared_store(opt: Options) -> Iterator[tuple[str, Callable[[], FileStore | RedisStore]]]:
    """Where the two engines meet: yields (location, a function giving a new
    store instance there), and cleans up afterwards."""
    if opt.storage == "file":
        with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as directory:
            yield directory, lambda: FileStore(directory)
    elif opt.redis_url is not None:
        # Someone else's server: keep this run's pages apart and let them expire.
        prefix = f"kvtier-demo-{secrets.token_hex(4)}:"
        yield opt.redis_url, lambda: RedisStore(opt.redis_url, prefix=prefix, ttl_s=600)
    else:
        with tempfile.TemporaryDirectory(prefix="kvtier-demo-redis-") as directory:
            server = LocalRedisServer(directory).start()
            try:
                yield server.url, lambda: RedisStore(server.url)
            finally:
                server.stop()


def _by_pool(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in counts.items())


def print_storage(s: StorageSummary, opt: Options) -> None:
    present = {name: n for name, n in s.pages_present.items() if n}
    print(f"kvtier demo, storage tier: 2 engines share {s.prompts} prompts "
          f"({opt.prefix_pages}-page system prefix + {opt.suffix_pages} own pages each) through {s.backend} "
          f"({s.location})")
    print(f"  engine A wrote        {sum(s.pages_written.values())} pages ({_by_pool(s.pages_written)}), "
          f"{size(s.bytes_written)} in {s.write_seconds:.2f} s")
    print(f"  already stored        {sum(s.pages_present.values())} pages ({_by_pool(present) or 'none'}): "
          f"the shared prefix, written once")
    print(f"  engine B prefetched   {sum(s.pages_prefetched.values())} pages, {sum(s.pages_hit.values())} of "
          f"{sum(s.pages_requested.values())} keys hit ({_by_pool(s.pages_hit)}), "
          f"{size(s.bytes_prefetched)} in {s.read_seconds:.2f} s, loaded into its own device slots")
    print(f"  every byte matched    {'yes' if s.every_byte_matched else f'NO ({s.mismatched_prompts} prompts differ)'}")


def print_pools(pools: list[dict[str, object]]) -> None:
    """Each pool's pages and bytes, as the preset registered them."""
    print(f"  {'pool':<12} {'kind':<8} {'page':>5} {'device slots':>13} {'host slots':>11} {'host MB':>9}  layers")
    for r in pools:
        page = f"x{r['page_size']}" if r["kind"] == "sidecar" else str(r["page_size"])
        of = f" (rows of {r['source']}'s pages)" if r["source"] else ""
        print(f"  {r['pool']!s:<12} {r['kind']!s:<8} {page:>5} {r['device_slots']!s:>13} {r['host_slots']!s:>11} "
              f"{int(r['host_bytes']) / 1e6:>9.2f}  {r['layers']}{of}")  # type: ignore[call-overload]


def parse_args(argv: list[str] | None) -> tuple[Options, bool]:
    d = Options()
    ap = argparse.ArgumentParser(prog="kvtier demo", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--requests", type=int, default=d.requests, help="requests to serve (2 operations each)")
    ap.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight at once")
    ap.add_argument("--pages-per-request", type=int, default=d.pages_per_request,
                    help="anchor pages of each request in part one")
    ap.add_argument("--page-size", type=int, default=d.page_size,
                    help="slots per page of the storage part's pools (a multiple of 4)")
    ap.add_argument("--layout", choices=["layer_first", "page_first"], default=d.layout,
                    help="host pools' layout")
    ap.add_argument("--v4-page-size", type=int, default=d.v4_page_size,
                    help="DeepSeek V4 anchor tokens per page (a multiple of the HCA rate, 128)")
    ap.add_argument("--host-ratio", type=float, default=d.host_ratio,
                    help="DeepSeek V4 stack: host pages per device page, for every pool")
    ap.add_argument("--seed", type=int, default=d.seed, help="seed of the rows and prompts")
    ap.add_argument("--storage", choices=["file", "redis", "none"], default=d.storage,
                    help="storage tier two engines share (file: a temporary directory; none: skip that part)")
    ap.add_argument("--redis-url", default=argparse.SUPPRESS, metavar="URL",
                    help="with --storage redis: a server to use, checked before anything runs "
                         "(default: start a throwaway redis-server)")
    ap.add_argument("--prompts", type=int, default=d.prompts, help="prompts the two engines share")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress line (it goes to a terminal's stderr only anyway)")
    a = ap.parse_args(argv)
    a.redis_url = getattr(a, "redis_url", None)
    if a.page_size % 4 or a.page_size < 4:
        ap.error(f"--page-size must be a positive multiple of 4 (compressed KV ratio); got {a.page_size}")
    if a.v4_page_size % 128 or a.v4_page_size < 128:
        ap.error(f"--v4-page-size must be a positive multiple of 128 (the HCA compress rate); got {a.v4_page_size}")
    if not a.host_ratio > 0 or a.host_ratio != a.host_ratio or a.host_ratio == float("inf"):
        ap.error(f"--host-ratio must be a positive finite number; got {a.host_ratio}")
    for name in ("requests", "concurrency", "pages_per_request", "prompts"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(a, name)}")
    if a.redis_url is not None and a.storage != "redis":
        ap.error("--redis-url goes with --storage redis")
    if a.storage == "redis":
        if importlib.util.find_spec("redis") is None:
            ap.error("--storage redis needs redis-py: pip install 'kvtier[redis]' (or use --storage file)")
        if a.redis_url is None and find_redis_server() is None:
            ap.error("--storage redis needs a redis-server binary (apt-get install redis-server, or set "
                     "$KVTIER_REDIS_SERVER), or a server's --redis-url redis://HOST:PORT/0")
    opt = Options(
        requests=a.requests, concurrency=a.concurrency, pages_per_request=a.pages_per_request,
        page_size=a.page_size, layout=a.layout, seed=a.seed, v4_page_size=a.v4_page_size, host_ratio=a.host_ratio,
        storage=a.storage, redis_url=a.redis_url, prompts=a.prompts,
        progress=not a.quiet and not a.json and sys.stderr.isatty(),
    )
    return opt, a.json


async def check_redis_url(url: str) -> str | None:
    """Why the server at ``url`` cannot serve the demo's storage part, in one
    line, or None when it answers a lookup."""
    try:
        async with RedisStore(url, timeout_s=5.0) as store:
            await store.exists([bytes(32)])
    except KvtierError as exc:  # StorageError, StorageTimeout; ConfigurationError for a malformed URL
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def main(argv: list[str] | None = None) -> int:
    opt, as_json = parse_args(argv)
    if opt.storage == "redis" and opt.redis_url is not None:
        # Before part one: an unreachable store would only show after it, as a
        # task group's traceback.
        why = anyio.run(check_redis_url, opt.redis_url)
        if why is not None:
            print(f"kvtier demo: --redis-url {opt.redis_url} cannot be used: {why}", file=sys.stderr)
            return 2
    try:
        summary = anyio.run(run, opt)
    except ConfigurationError as exc:  # e.g. a --host-ratio that gives a pool no whole page
        print(f"kvtier demo: {exc}", file=sys.stderr)
        return 2
    stored = None
    if opt.storage != "none":
        with shared_store(opt) as (location, open_store):
            stored = anyio.run(run_storage, opt, opt.storage, location, open_store)
    if as_json:
        out = asdict(summary)
        if stored is not None:
            out["storage"] = asdict(stored)
        print(json.dumps(out, indent=2))
    else:
        print(f"kvtier demo: {opt.requests} requests x 2 operations over the DeepSeek V4 stack "
              f"(kvtier.presets.deepseek_v4, host tier sized by host_ratio {summary.host_ratio:g})")
        print_pools(summary.pools)
        print(f"  operations            {summary.operations}")
        moved = summary.gigabytes_moved * 1e9
        print(f"  moved                 {size(moved)} in {summary.seconds:.2f} s of demo "
              f"({rate(moved, summary.seconds)} over the whole run, which mostly writes and checks rows on "
              "the CPU: not a copy rate; `kvtier bench` measures that)")
        print(f"  operation latency     p50 {summary.p50_operation_ms:.2f} ms, p99 {summary.p99_operation_ms:.2f} ms, "
              f"mean {summary.mean_operation_ms:.2f} ms (submit to done, {summary.concurrency} requests at once)")
        print(f"    queued in kvtier    mean {summary.mean_queued_ms:.2f} ms (waiting in a lane for a batch)")
        print(f"    copying             mean {summary.mean_copying_ms:.2f} ms (its batch's copies running)")
        print(f"    the rest            mean {summary.mean_rest_ms:.2f} ms (the event loop busy with the other "
              "requests' work; --concurrency 1 shows one operation alone)")
        print(f"  batches               {summary.batches} ({summary.operations_per_batch:.1f} operations per batch)")
        print(f"  rollbacks             {summary.rollbacks}")
        print(f"  every byte matched    {'yes' if summary.every_byte_matched else f'NO ({summary.mismatched_requests} requests differ)'}")
        if stored is not None:
            print_storage(stored, opt)
    ok = summary.every_byte_matched and (stored is None or stored.every_byte_matched)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
