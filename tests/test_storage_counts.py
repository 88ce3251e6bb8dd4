"""Counts that tell the truth under faults (issue 43.8).

A `write_storage` whose put fails part way stored some pages: a later
prefetch finds them, byte-exact. ``statistics().storage.pages_written`` and
``kvtier_storage_write_pages_total{outcome="written"}`` count exactly those,
for a Redis at its memory limit (``maxmemory`` with ``noeviction``: the
first pages land, then every write is refused) and for a store of files
whose directory stops taking pages part way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch
from conftest import needs_redis_server, used
from prometheus_client import CollectorRegistry
from test_metrics import Scraped, scrape
from test_storage_checksums import raw_client
from test_storage_scheduler import (
    assert_rows_equal,
    backup,
    baseline,
    engine,
    prefix_keys,
    prefix_rows,
    req_of,
)

from kvtier import TransferScheduler
from kvtier.metrics import KvtierCollector
from kvtier.storage import FileStore, PageBlobs, RedisStore, StorageBackend, StorageError
from kvtier.scheduler import RewriteKeys
from kvtier.testing import MemoryStore
from kvtier.testing.redis_server import LocalRedisServer

NPAGES = 16  # two backups of every device page of kv in hybrid_group (8): all its host pages


async def write_then_count(group_seed: int, store: StorageBackend, reader: StorageBackend) -> int:
    """Write NPAGES kv pages through ``store`` (its put fails part way); check
    the counts against what ``reader`` finds, byte-exact; return the count."""
    group = engine(group_seed)
    keys = prefix_keys(group, NPAGES, pools=("kv",))
    registry = CollectorRegistry()
    async with TransferScheduler(group, storage=store) as sched:
        registry.register(KvtierCollector(sched))
        base = baseline(group)
        halves = [await backup(sched, req_of(NPAGES // 2, pools=("kv",))) for _ in range(2)]
        host = {p: torch.cat([b.host_indices[p] for b in halves]) for p in halves[0].host_indices}
        device = {p: torch.cat([b.device_indices[p] for b in halves]) for p in halves[0].device_indices}
        h = await sched.write_storage({"kv": host["kv"]}, keys)
        with pytest.raises(StorageError):
            await h
        sched.free_host(host)
        assert used(group) == base
        stats = sched.statistics().storage
        got = Scraped(await anyio.to_thread.run_sync(scrape, registry))
        # What the store holds: the run of stored pages from the first key.
        present = await reader.exists(keys["kv"])
    stored = sum(present)
    assert 0 < stored < NPAGES, f"the fault should store some pages, not all: {stored}"
    assert present == [True] * stored + [False] * (NPAGES - stored)  # a prefix: pages are put in order
    assert stats.pages_written == stored
    assert got("kvtier_storage_write_pages_total", outcome="written") == stored
    # A later prefetch finds exactly those, byte-exact.
    other = engine(group_seed + 1)
    async with TransferScheduler(other, storage=reader) as sched:
        res = await (await sched.prefetch(keys))
        assert dict(res.pages) == {"kv": stored}
        # Loaded back 8 pages at a time (the device holds 8), each compared with its rows.
        for first in range(0, stored, NPAGES // 2):
            n = min(NPAGES // 2, stored - first)
            part = {p: t[first * other[p].page_size:(first + n) * other[p].page_size]
                    for p, t in res.host_indices.items()}
            ld = await sched.load(part)
            await ld
            want = {p: t[first * group[p].page_size:] for p, t in device.items()}
            assert_rows_equal(prefix_rows(other, ld.device_indices, {"kv": n}), prefix_rows(group, want, {"kv": n}))
            other["kv"].device.allocator.free(ld.device_indices["kv"])  # type: ignore[union-attr]
        sched.free_host(res.host_indices)
    return stored


@needs_redis_server
async def test_a_redis_at_its_memory_limit_counts_the_pages_it_stored(
    fresh_server: Callable[..., LocalRedisServer],
) -> None:
    server = await anyio.to_thread.run_sync(fresh_server)
    # One page per pipeline, so that what Redis buffers of a put is one page.
    store, reader = RedisStore(server.url, max_pipeline_bytes=1), RedisStore(server.url)
    admin = raw_client(server.url)
    try:
        # Their connections open, the store's buffer for a page's pipeline
        # grown (Redis keeps it): all of it counted in the memory used.
        page = sum(group_page_nbytes(engine(1)))
        await store.put([PageBlobs(bytes(32), {"kv": bytes(page)})])
        await reader.exists([bytes(32)])
        await admin.config_set("maxmemory-policy", "noeviction")
        for _ in range(2):  # the first reply grows the server's own buffers by tens of kilobytes
            used_memory = int((await admin.info("memory"))["used_memory"])
        # Room for a few pages (with Redis's own overhead per key), then
        # "OOM command not allowed when used memory > 'maxmemory'".
        await admin.config_set("maxmemory", used_memory + 6 * (page + 1024))
        await write_then_count(1, store, reader)
    finally:
        await store.aclose()
        await reader.aclose()
        await admin.aclose()


class PutFails:
    """``inner`` with its own ``put`` in place of the store's (lookups and reads go
    to ``inner``): a store whose puts fail the way a test says."""

    name = "put-fails"

    def __init__(self, inner: StorageBackend, put: Callable[[list[PageBlobs]], Awaitable[None]]) -> None:
        self.inner, self._put = inner, put

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await self.inner.exists(keys)

    async def get(self, keys, pools):  # type: ignore[no-untyped-def]
        return await self.inner.get(keys, pools)

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        await self._put(list(pages))

    async def aclose(self) -> None:
        pass


async def test_a_file_store_that_stops_taking_pages_counts_the_pages_it_stored(tmp_path: Path) -> None:
    """The store's directory refuses new pages after the third (a full disk,
    as a fault of the store's own: its put writes page after page)."""
    inner = FileStore(tmp_path)

    async def fills_up(pages: list[PageBlobs]) -> None:
        await inner.put(pages[:3])
        raise StorageError(f"{tmp_path}: no space left on device", backend="fills-up", operation="put")

    assert await write_then_count(3, PutFails(inner, fills_up), FileStore(tmp_path)) == 3  # type: ignore[arg-type]


def group_page_nbytes(group) -> list[int]:  # type: ignore[no-untyped-def]
    return [group[n].page_size * group[n].slot_nbytes for n in ("kv", *sorted(s.name for s in group.sidecars_of("kv")))]


@pytest.mark.parametrize("marked", ["refused by a prefetch", "marked by the engine"])
async def test_a_repair_put_that_fails_leaves_the_damaged_page_to_be_put_again(marked: str) -> None:
    """A page a prefetch refused (damaged) is put again by the next write; when
    that put fails, `exists` still finds the damaged page. It must not count as
    written, and the write after must put it again: counted as landed, it was
    skipped as "already stored" and stayed damaged (found by the scheduler's
    stateful model with a faulty store)."""
    group = engine(5)
    keys = prefix_keys(group, 2, pools=("kv",))
    store = MemoryStore()
    failing = False

    async def flaky(pages: list[PageBlobs]) -> None:
        if failing:
            raise StorageError("flaky: the put failed", backend="flaky", operation="put")
        await store.put(pages)

    # The same record serves an engine that marks keys itself (vLLM marks the
    # blocks behind a refused one "unread"): a failed put must keep them too.
    rewrite = RewriteKeys()
    async with TransferScheduler(group, storage=PutFails(store, flaky), rewrite_keys=rewrite) as sched:  # type: ignore[arg-type]
        b = await backup(sched, req_of(2, pools=("kv",)))
        host = {"kv": b.host_indices["kv"]}
        await (await sched.write_storage(host, keys))
        (first, _) = keys["kv"]
        assert first in store.pages
        store.corrupt(first, "kv", 0)
        if marked == "refused by a prefetch":
            res = await (await sched.prefetch(keys))
            assert dict(res.pages).get("kv", 0) == 0  # refused at the first page
            sched.free_host(res.host_indices)
        else:
            rewrite.add(first, "unread")
        assert first in rewrite
        failing = True
        with pytest.raises(StorageError):
            await (await sched.write_storage(host, keys))
        failing = False
        written = sched.statistics().storage.pages_written
        await (await sched.write_storage(host, keys))
        assert sched.statistics().storage.pages_written == written + 1, "the damaged page was not put again"
        res = await (await sched.prefetch(keys))
        assert dict(res.pages) == {"kv": 2}
        sched.free_host(res.host_indices)
        sched.free_host(host)
