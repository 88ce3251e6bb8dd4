"""The storage section of ``python -m kvtier bench``: host <-> storage tier.

The same pages (a ``kv`` pool and a ``c4``-style sidecar: ``rows_per_page =
page_size / 4`` rows per page, an eighth of the page's bytes) go to a store and
back four ways, in alternating repetitions (A B C D, D C B A, ...), each
repetition under fresh keys:

* ``raw``: the blobs, already serialised, through the plainest client code: a
  redis-py asyncio pipeline of ``SET`` / ``GET`` (pipelines of the store's
  ``max_pipeline_bytes``), or a loop of open / write / rename and of reads,
  in one worker thread;
* ``raw+copy``: the same, plus packing the host rows into the blobs (write)
  or unpacking the blobs into host rows (read), in a worker thread: what
  kvtier has to do too, so the fair bar for the scheduler;
* ``store``: `RedisStore` / `FileStore` ``put`` / ``get`` of the encoded
  pages (blobs, then a commit record per page; reads check it);
* ``scheduler``: `TransferScheduler.write_storage` of held host pages (one
  ``exists`` lookup, then rounds of ``storage_chunk_bytes``: serialise in a
  worker thread, put) and `TransferScheduler.prefetch` ``wait_complete``
  (lookup, then rounds of get and deserialise into newly allocated host pages).

Redis needs redis-py and a server: ``--redis-url`` names one, else a
throwaway `LocalRedisServer` starts in a temporary directory; without either,
the Redis part says ``skipped: <why>`` and the rest runs. Files go to a
temporary directory (no fsync: reads come from the page cache). Every path is
checked byte for byte once, in the warm-up round, outside the timings.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.to_thread
import torch

from kvtier.bench.measures import LoopLagMonitor, lag_summary, ratio_of, summarize_times
from kvtier.pools import DevicePool, HostPool, PoolGroup
from kvtier.scheduler import SchedulerConfig, TransferScheduler
from kvtier.storage import EngineIdentity, FileStore, PageBlobs, StorageBackend, page_keys
from kvtier.transfers import CpuExecutor

if TYPE_CHECKING:
    from kvtier.bench.settings import Settings, Shape

__all__ = ["VARIANTS", "StoragePools", "build_storage_pools", "run_storage"]

POOL, SIDECAR = "kv", "c4"
BENCH_IDENTITY = EngineIdentity("kvtier-bench")  # the model string of the bench's stored pages
# The order of a repetition (reversed on odd ones).
VARIANTS = ("raw", "raw+copy", "store", "scheduler")
MiB = 1 << 20

Blobs = dict[str, Any]  # pool -> a buffer (memoryview or bytes)
Run = Callable[[], Awaitable[None]]


# -- the pages ----------------------------------------------------------------


@dataclass(eq=False)
class StoragePools:
    """A ``kv`` pool with a ``c4`` sidecar, its device rows backed up into held
    host pages (the pages that get written); the other half of the host pool
    stays free for prefetches and for the raw reads' copies."""

    group: PoolGroup
    kv: HostPool
    c4: HostPool
    page_size: int
    rows_per_page: int
    pages: int
    shape: Shape
    layout: str

    @property
    def blob_nbytes(self) -> dict[str, int]:
        return {POOL: self.page_size * self.kv.slot_nbytes, SIDECAR: self.rows_per_page * self.c4.slot_nbytes}

    @property
    def page_nbytes(self) -> int:
        return sum(self.blob_nbytes.values())

    def _rows(self, host: HostPool, plane: int, start: int, count: int) -> torch.Tensor:
        buf = host.buffer(plane)
        rows = buf[:, start:start + count] if host.layout == "layer_first" else buf[start:start + count].transpose(0, 1)
        return rows.unsqueeze(-1).view(torch.uint8)

    def _members(self, page: int) -> list[tuple[str, HostPool, int, int]]:
        k = self.rows_per_page
        return [(POOL, self.kv, page * self.page_size, self.page_size), (SIDECAR, self.c4, page * k, k)]

    def pack(self, page: int) -> Blobs:
        """The raw copy, host -> bytes: each pool's rows of host page ``page``,
        plane after plane, as ``[layers, rows, ...]`` (the stored format)."""
        out = {}
        for name, host, start, count in self._members(page):
            buf = bytearray(count * host.slot_nbytes)  # bytes without numpy (not a dependency)
            blob = torch.frombuffer(buf, dtype=torch.uint8)
            offset = 0
            for p in range(len(host.planes)):
                src = self._rows(host, p, start, count)
                blob[offset:offset + src.numel()].view(src.shape).copy_(src)
                offset += src.numel()
            out[name] = memoryview(buf)
        return out

    def zero(self, pages: Sequence[int]) -> None:
        for page in pages:
            for _, host, start, count in self._members(page):
                for p in range(len(host.planes)):
                    self._rows(host, p, start, count).zero_()

    def unpack(self, page: int, blobs: dict[str, Any]) -> None:
        """The raw copy, bytes -> host: `pack`'s inverse into host page ``page``."""
        for name, host, start, count in self._members(page):
            src = torch.frombuffer(blobs[name], dtype=torch.uint8)
            offset = 0
            for p in range(len(host.planes)):
                dst = self._rows(host, p, start, count)
                dst.copy_(src[offset:offset + dst.numel()].view(dst.shape))
                offset += dst.numel()


def build_storage_pools(shape: Shape, page_size: int, pages: int, layout: str) -> StoragePools:
    """``pages`` device pages of random bytes in a ``kv`` pool (``shape``) and
    its ``c4`` sidecar (``page_size / 4`` rows per page, one plane sized to an
    eighth of a ``kv`` page); a host pool of twice as many pages."""
    k = max(1, page_size // 4)
    kv_page = page_size * shape.slot_nbytes
    width = max(1, kv_page // 8 // (shape.layers * k * shape.dtype.itemsize))
    gen = torch.Generator().manual_seed(0)
    slots = pages * page_size

    def rand(*size: int) -> torch.Tensor:
        t = torch.empty(size, dtype=shape.dtype)
        t.view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen,
                                                dtype=torch.uint8).view(t.view(torch.uint8).shape))
        return t

    group = PoolGroup()
    kv = group.add_pool(
        POOL, device=DevicePool([[rand(slots, shape.heads, shape.head_dim) for _ in range(2)]
                                 for _ in range(shape.layers)]),
        page_size=page_size, host_slots=2 * slots, layout=layout,  # type: ignore[arg-type]
    )
    c4 = group.add_sidecar(
        SIDECAR, source=POOL, rows_per_page=k,
        device=DevicePool([[rand(pages * k, width)] for _ in range(shape.layers)]),
        layout=layout,  # type: ignore[arg-type]
    )
    for host in (kv, c4):
        for p in range(len(host.planes)):
            host.buffer(p).zero_()  # touched now, not in a timed run
    return StoragePools(group, kv, c4, page_size, k, pages, shape, layout)


def _pack_all(pools: StoragePools, pages: Sequence[int]) -> list[Blobs]:
    return [pools.pack(p) for p in pages]


def _pages_of(slots: torch.Tensor, page_size: int) -> list[int]:
    return (slots[::page_size] // page_size).tolist()


# -- one backend ----------------------------------------------------------------


class _Raw(Protocol):
    """The raw side of one backend: writes and reads of named blobs."""

    async def put(self, rep: str, blobs: Sequence[Blobs]) -> None: ...

    async def get(self, rep: str, n: int) -> list[Blobs]: ...

    async def cleanup(self, rep: str) -> None: ...


class _RawRedis(_Raw):
    def __init__(self, client: Any, prefix: str, limit: int, page_bytes: int) -> None:
        self.client, self.prefix, self.limit, self.page_bytes = client, prefix, limit, page_bytes

    def _names(self, rep: str, n: int) -> list[list[bytes]]:
        return [[f"{self.prefix}{rep}:{i}:{pool}".encode() for pool in (POOL, SIDECAR)] for i in range(n)]

    async def put(self, rep: str, blobs: Sequence[Blobs]) -> None:
        from kvtier.bench.redis import raw_put

        await raw_put(self.client, self._names(rep, len(blobs)), list(blobs), self.limit)

    async def get(self, rep: str, n: int) -> list[Blobs]:
        from kvtier.bench.redis import raw_get

        replies = await raw_get(self.client, self._names(rep, n), self.page_bytes, self.limit)
        return [{POOL: replies[2 * i], SIDECAR: replies[2 * i + 1]} for i in range(n)]

    async def cleanup(self, rep: str) -> None:
        from kvtier.bench.redis import unlink

        await unlink(self.client, f"{self.prefix}{rep}:")


class _RawFiles(_Raw):
    """A loop of open / write / rename (and of reads), in one worker thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _paths(self, rep: str, i: int) -> list[Path]:
        return [self.directory / rep / f"{i}.{pool}" for pool in (POOL, SIDECAR)]

    def write(self, rep: str, blobs: Sequence[Blobs]) -> None:
        (self.directory / rep).mkdir(parents=True, exist_ok=True)
        for i, page in enumerate(blobs):
            for path, data in zip(self._paths(rep, i), page.values()):
                tmp = path.with_name(path.name + ".tmp")
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)

    def read(self, rep: str, n: int) -> list[Blobs]:
        out = []
        for i in range(n):
            kv, c4 = (p.read_bytes() for p in self._paths(rep, i))
            out.append({POOL: memoryview(kv), SIDECAR: memoryview(c4)})
        return out

    async def put(self, rep: str, blobs: Sequence[Blobs]) -> None:
        await anyio.to_thread.run_sync(self.write, rep, blobs)

    async def get(self, rep: str, n: int) -> list[Blobs]:
        return await anyio.to_thread.run_sync(self.read, rep, n)

    async def cleanup(self, rep: str) -> None:
        await anyio.to_thread.run_sync(shutil.rmtree, self.directory / rep, True)


@dataclass(eq=False)
class _Backend:
    name: str
    raw: _Raw
    store: StorageBackend  # the store variant's
    sched_store: StorageBackend  # the scheduler's
    cleanup: Callable[[], Awaitable[None]]  # after each repetition: the stores' keys
    info: dict[str, Any]


async def _measure(
    backend: _Backend, pools: StoragePools, settings: Settings, monitor: LoopLagMonitor, log: Callable[[str], None]
) -> dict[str, Any]:
    """Warm-up (checked byte for byte), then ``settings.reps`` alternating repetitions."""
    n = pools.pages
    token = secrets.token_hex(4)
    executor = CpuExecutor(torch_threads=settings.torch_threads)
    config = SchedulerConfig()
    nbytes = n * pools.page_nbytes
    times: dict[str, dict[str, list[float]]] = {"write": {v: [] for v in VARIANTS}, "read": {v: [] for v in VARIANTS}}
    members = [POOL, SIDECAR]
    async with TransferScheduler(
        pools.group, executor, config, storage=backend.sched_store, identity=BENCH_IDENTITY
    ) as sched:
        dev = torch.arange(n * pools.page_size)
        h = await sched.backup({POOL: dev})
        await h
        source = h.host_indices[POOL]
        source_pages = _pages_of(source, pools.page_size)
        held = set(source_pages)
        spare = [p for p in range(2 * n) if p not in held]  # where raw+copy reads land: every free page
        blobs = await anyio.to_thread.run_sync(_pack_all, pools, source_pages)

        async def one_rep(rep: str, order: Sequence[str], record: bool, check: bool) -> None:
            # Fresh keys per repetition and way (an extra string of the identity); the
            # headers carry the scheduler's identity, BENCH_IDENTITY.
            ns = {v: BENCH_IDENTITY.page_identity(pools.group, POOL, extra=(f"{token}-{rep}-{v}",)).namespace()
                  for v in ("store", "scheduler")}
            keys = {v: page_keys(ns[v], range(n * pools.page_size)) for v in ns}
            prefetched: list[torch.Tensor] = []
            got: dict[str, list[Any]] = {}

            async def write(v: str) -> None:
                if v == "raw":
                    await backend.raw.put(f"{rep}r", blobs)
                elif v == "raw+copy":
                    packed = await anyio.to_thread.run_sync(_pack_all, pools, source_pages)
                    await backend.raw.put(f"{rep}c", packed)
                elif v == "store":
                    await backend.store.put([PageBlobs(k, b) for k, b in zip(keys["store"], blobs)])
                else:
                    handle = await sched.write_storage({POOL: source}, {POOL: keys["scheduler"]})
                    result = await handle
                    if result.pages_written[POOL] != n:
                        raise RuntimeError(f"bench: write_storage wrote {result.pages_written} of {n} pages")

            async def read(v: str) -> None:
                if v == "raw":
                    got[v] = await backend.raw.get(f"{rep}r", n)
                elif v == "raw+copy":
                    fetched = await backend.raw.get(f"{rep}c", n)

                    def unpack() -> None:
                        for p, b in zip(spare, fetched):
                            pools.unpack(p, b)

                    await anyio.to_thread.run_sync(unpack)
                elif v == "store":
                    got[v] = await backend.store.get(keys["store"], members)
                else:
                    handle = await sched.prefetch({POOL: keys["scheduler"]}, policy="wait_complete")
                    result = await handle
                    if result.pages[POOL] != n:
                        raise RuntimeError(f"bench: prefetch read {result.pages} of {n} pages")
                    prefetched.append(result.host_indices[POOL])

            async def check_read(v: str) -> None:
                """Warm-up: what ``v`` read is the source, byte for byte. Host
                pages that reads write into are zeroed after each check (the
                spare pages are every free page: prefetches land there too)."""
                where = f"{backend.name} {v} read"
                if v in ("raw", "store"):
                    _check_same(got[v], blobs, where)
                    return
                pages = spare if v == "raw+copy" else _pages_of(prefetched[0], pools.page_size)
                _check_same(await anyio.to_thread.run_sync(_pack_all, pools, pages), blobs, where)
                await anyio.to_thread.run_sync(pools.zero, spare)

            for phase, fn in (("write", write), ("read", read)):
                for v in order:
                    label = f"storage:{backend.name}:{v}" if record else "storage:warm-up"
                    with monitor.recording(label):
                        t0 = time.perf_counter()
                        await fn(v)
                        seconds = time.perf_counter() - t0
                    if record:
                        times[phase][v].append(seconds)
                    if phase == "read" and check:
                        await check_read(v)
                    if phase == "read" and v == "scheduler":
                        sched.free_host({POOL: prefetched.pop()})
            got.clear()
            await backend.raw.cleanup(f"{rep}r")
            await backend.raw.cleanup(f"{rep}c")
            await backend.cleanup()

        await one_rep("w", VARIANTS, record=False, check=True)
        for r in range(settings.reps):
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
            await one_rep(str(r), order, record=True, check=False)
        sched.free_host({POOL: source})
    stats = sched.statistics()
    out: dict[str, Any] = {"skipped": None, **backend.info, "verified": True}
    for phase in ("write", "read"):
        t = times[phase]
        out[phase] = {
            "variants": {v: summarize_times(t[v], nbytes) for v in VARIANTS},
            "ratios": {
                "raw_copy_vs_raw": ratio_of(t, "raw", "raw+copy"),
                "store_vs_raw": ratio_of(t, "raw", "store"),
                "scheduler_vs_raw": ratio_of(t, "raw", "scheduler"),
                "scheduler_vs_raw_copy": ratio_of(t, "raw+copy", "scheduler"),
                "scheduler_vs_store": ratio_of(t, "store", "scheduler"),
            },
        }
    out["loop_lag"] = {v: lag_summary(monitor.samples.get(f"storage:{backend.name}:{v}", [])) for v in VARIANTS}
    out["scheduler_batches"] = {"write": stats.write_storage.batches, "read": stats.prefetch.batches}
    log(f"  storage {backend.name}: " + ", ".join(
        f"{phase} scheduler/raw+copy {out[phase]['ratios']['scheduler_vs_raw_copy']['median']:.2f} "
        f"store/raw {out[phase]['ratios']['store_vs_raw']['median']:.2f}" for phase in ("write", "read")))
    return out


def _check_same(got: Sequence[Any], want: Sequence[Blobs], where: str) -> None:
    if len(got) != len(want):
        raise RuntimeError(f"bench: {where} gave {len(got)} pages, not {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None or any(bytes(g[name]) != bytes(w[name]) for name in w):
            raise RuntimeError(f"bench: {where}: page {i} does not read back byte for byte")


def _unlink_files(directory: Path) -> None:
    for sub in directory.iterdir() if directory.is_dir() else ():
        for entry in os.scandir(sub):
            os.unlink(entry.path)


# -- the section ----------------------------------------------------------------


def redis_unavailable(redis_url: str | None) -> str | None:
    if importlib.util.find_spec("redis") is None:
        return "redis-py is not installed (pip install 'kvtier[redis]')"
    if redis_url is None:
        from kvtier.testing.redis_server import find_redis_server

        if find_redis_server() is None:
            return ("redis-server not found (apt-get install redis-server, set $KVTIER_REDIS_SERVER, "
                    "or pass --redis-url)")
    return None


async def _redis_part(
    pools: StoragePools, settings: Settings, monitor: LoopLagMonitor, log: Callable[[str], None],
    redis_url: str | None,
) -> dict[str, Any]:
    why = await anyio.to_thread.run_sync(redis_unavailable, redis_url)
    if why is not None:
        return {"skipped": why}
    import redis
    import redis.asyncio as aioredis

    from kvtier.bench.redis import has_hiredis, unlink
    from kvtier.testing.redis_server import LocalRedisServer
    from kvtier.storage.redis_store import (
        CLIENT_OPTIONS,
        DEFAULT_PIPELINE_BYTES,
        RedisStore,
        _redact,
    )

    tmp: tempfile.TemporaryDirectory[str] | None = None
    server: LocalRedisServer | None = None
    client: Any = None
    stores: list[RedisStore] = []
    try:
        if redis_url is None:
            tmp = await anyio.to_thread.run_sync(partial(tempfile.TemporaryDirectory, prefix="kvtier-bench-redis-"))
            server = LocalRedisServer(Path(tmp.name))
            try:
                await anyio.to_thread.run_sync(server.start)
            except (OSError, RuntimeError) as exc:
                return {"skipped": f"redis-server did not start: {exc}"}
            url = server.url
        else:
            url = redis_url
        client = aioredis.Redis.from_url(url, **CLIENT_OPTIONS)
        try:
            version = (await client.info("server")).get("redis_version", "?")
        except (redis.RedisError, OSError) as exc:
            return {"skipped": f"{_redact(url)} does not answer: {type(exc).__name__}: {exc}"}
        prefix = f"kvbench{secrets.token_hex(4)}:"
        limit = DEFAULT_PIPELINE_BYTES
        raw = _RawRedis(client, prefix + "r:", limit, pools.page_nbytes)
        store = RedisStore(url, prefix=prefix + "s:", timeout_s=60.0)
        sched_store = RedisStore(url, prefix=prefix + "k:", timeout_s=60.0)
        stores += [store, sched_store]

        async def cleanup() -> None:
            await unlink(client, prefix + "s:")
            await unlink(client, prefix + "k:")

        info = {
            "server": f"redis {version}, " + ("a throwaway local redis-server" if server else "--redis-url"),
            "url": _redact(url),
            "redis_py": redis.__version__,
            "hiredis": has_hiredis(),
            "max_pipeline_bytes": limit,
            # Pages per pipeline: every path sends a pipeline once it reaches the bound.
            "pages_per_pipeline": {
                "raw_set": -(-limit // pools.page_nbytes),
                "raw_get": -(-limit // pools.page_nbytes),
                "store": -(-limit // pools.page_nbytes),
            },
        }
        return await _measure(_Backend("redis", raw, store, sched_store, cleanup, info), pools, settings, monitor, log)
    finally:
        for s in stores:
            await s.aclose()
        if client is not None:
            await client.aclose()
        if server is not None:
            await anyio.to_thread.run_sync(server.stop)
        if tmp is not None:
            await anyio.to_thread.run_sync(tmp.cleanup)


async def _file_part(
    pools: StoragePools, settings: Settings, monitor: LoopLagMonitor, log: Callable[[str], None],
) -> dict[str, Any]:
    tmp = await anyio.to_thread.run_sync(partial(tempfile.TemporaryDirectory, prefix="kvtier-bench-files-"))
    root = Path(tmp.name)
    raw = _RawFiles(root / "raw")
    store, sched_store = FileStore(root / "store"), FileStore(root / "scheduler")

    async def cleanup() -> None:
        # The pages go, their fan-out directories stay, as in a store in use.
        for d in ("store", "scheduler"):
            await anyio.to_thread.run_sync(_unlink_files, root / d)

    info = {"directory": str(root.parent), "fsync": False}
    try:
        return await _measure(_Backend("file", raw, store, sched_store, cleanup, info), pools, settings, monitor, log)
    finally:
        await store.aclose()
        await sched_store.aclose()
        await anyio.to_thread.run_sync(tmp.cleanup)


async def run_storage(
    settings: Settings, monitor: LoopLagMonitor, log: Callable[[str], None] = lambda _: None,
    *, redis_url: str | None = None,
) -> dict[str, Any]:
    """The storage section's JSON object (see the module doc)."""
    if not settings.storage:
        return {"skipped": "--no-storage"}
    started = time.perf_counter()
    shape = settings.storage_shape
    parts: dict[str, Any] = {}
    setup: dict[str, Any] = {}
    for name in settings.storage_backends:
        pools = build_storage_pools(shape, settings.storage_page_size, settings.storage_pages, settings.storage_layout)
        setup = {
            "pages": pools.pages,
            "page_size": pools.page_size,
            "shape": asdict(shape) | {"label": shape.label, "slot_nbytes": shape.slot_nbytes},
            "layout": pools.layout,
            "sidecar_rows_per_page": pools.rows_per_page,
            "blob_nbytes": pools.blob_nbytes,
            "page_nbytes": pools.page_nbytes,
            "nbytes": pools.pages * pools.page_nbytes,
            "reps": settings.reps,
            "storage_chunk_bytes": SchedulerConfig().storage_chunk_bytes,
        }
        log(f"storage tier, {name} ...")
        if name == "redis":
            parts[name] = await _redis_part(pools, settings, monitor, log, redis_url)
        else:
            parts[name] = await _file_part(pools, settings, monitor, log)
        if parts[name].get("skipped"):
            log(f"  storage {name}: skipped: {parts[name]['skipped']}")
        pools.group.close()
        del pools
    return {"skipped": None, "setup": setup, **parts, "seconds": time.perf_counter() - started}

