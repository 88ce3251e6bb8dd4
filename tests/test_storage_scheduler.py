"""TransferScheduler's storage operations: `write_storage` and `prefetch`.

Two engines (two pool groups, two schedulers, two store handles) share pages
through a `FileStore` directory or a real ``redis-server``; every round trip
is compared byte-exact (``torch.equal``) with the rows the first engine had on
its device, sidecars included. Around that: the hit rule (longest stored run
from the first key), early stops (``best_effort`` / ``timeout``), cancellation,
backend failures (a wrapper store that blocks or raises on chosen calls), a
Redis server SIGKILLed mid-transfer, verify mode, ordering against backups,
deferred frees and closing. After each test the host pools are exact: the
caller holds what it was handed and nothing else.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch
from conftest import needs_redis_server, pages, used, wait_until

from kvtier import (
    ConfigurationError,
    CorruptionDetected,
    InvalidIndices,
    OperationCancelled,
    OperationHandle,
    PoolExhausted,
    PrefetchHandle,
    PrefetchResult,
    SchedulerClosed,
    SchedulerConfig,
    TransferFailed,
    TransferScheduler,
    WriteStorageHandle,
    WriteStorageResult,
)
from kvtier.pools import PoolGroup
from kvtier.storage import (
    FileStore,
    KeyNamespace,
    PageBlobs,
    RedisStore,
    StorageBackend,
    StorageError,
    StorageTimeout,
    page_keys,
)
from kvtier.testing.redis_server import LocalRedisCluster, LocalRedisServer
from kvtier.testing import (
    FaultInjectingExecutor,
    MemoryStore,
    device_rows,
    hybrid_group,
)

PS = 8  # page size of kv, swa and tok in hybrid_group; state has page size 1
ANCHORS = ("kv", "swa", "state", "tok")
ONE_PAGE_PER_ROUND = SchedulerConfig(storage_chunk_bytes=1)  # rounds hold at least one page


# -- fixtures -------------------------------------------------------------------


@pytest.fixture
def persistent_redis(fresh_server: Callable[..., LocalRedisServer]) -> LocalRedisServer:
    """A server of this test's own with an fsynced AOF: kill + start keeps what was acknowledged."""
    return fresh_server(persistent=True)


@pytest.fixture
def own_redis(fresh_server: Callable[..., LocalRedisServer]) -> LocalRedisServer:
    """A non-persistent server of this test's own (it may be paused or killed)."""
    return fresh_server()


# -- a store that blocks or fails on chosen calls --------------------------------

Hook = Callable[[int, list[bytes]], Awaitable[None]]


class HookedStore:
    """A `StorageBackend` delegating to ``inner``; before each ``exists`` /
    ``get`` / ``put`` it awaits that method's hook with the call's number
    (from 1) and keys. A hook may block or raise."""

    name = "hooked"

    def __init__(
        self, inner: StorageBackend, *, exists: Hook | None = None, get: Hook | None = None, put: Hook | None = None
    ) -> None:
        self.inner = inner
        self.hooks = {"exists": exists, "get": get, "put": put}
        self.calls = {"exists": 0, "get": 0, "put": 0}
        self.keys: dict[str, list[list[bytes]]] = {"exists": [], "get": [], "put": []}

    async def _hook(self, op: str, keys: list[bytes]) -> None:
        self.calls[op] += 1
        self.keys[op].append(keys)
        hook = self.hooks[op]
        if hook is not None:
            await hook(self.calls[op], keys)

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        await self._hook("exists", list(keys))
        return await self.inner.exists(keys)

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        await self._hook("get", list(keys))
        return await self.inner.get(keys, pools)

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        pages = list(pages)
        await self._hook("put", [p.key for p in pages])
        await self.inner.put(pages)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Gate:
    """A hook that holds calls number ``from_call`` on until `open` (create inside the loop)."""

    def __init__(self, from_call: int = 1) -> None:
        self.from_call = from_call
        self.released = anyio.Event()
        self.waiting = 0

    async def __call__(self, n: int, keys: list[bytes]) -> None:
        if n < self.from_call or self.released.is_set():
            return
        self.waiting += 1
        try:
            await self.released.wait()
        finally:
            self.waiting -= 1

    def open(self) -> None:
        self.released.set()


def fail_from(call: int, error: Exception) -> Hook:
    """A hook raising ``error`` on call number ``call`` and after."""

    async def hook(n: int, keys: list[bytes]) -> None:
        if n >= call:
            raise error

    return hook


# -- engines, keys, rows ----------------------------------------------------------


def engine(seed: int, layout: str = "layer_first") -> PoolGroup:
    return hybrid_group(seed=seed, device_allocator=True, layout=layout)  # type: ignore[arg-type]


def req_of(npages: int, state_pages: int = 2, pools: Sequence[str] = ANCHORS, first: int = 0) -> dict[str, torch.Tensor]:
    """Device indices of ``npages`` pages (``state_pages`` for state) of each of ``pools``."""
    out = {}
    for pool in pools:
        if pool == "state":
            out[pool] = torch.arange(first, first + state_pages)
        else:
            out[pool] = pages(*range(first, first + npages), page_size=PS)
    return out


def prefix_keys(
    group: PoolGroup, npages: int, state_pages: int = 2, pools: Sequence[str] = ANCHORS, prompt: int = 0
) -> dict[str, list[bytes]]:
    """The page keys of one prompt's first pages, per pool (model "m")."""
    tokens = [prompt * 100_000 + t for t in range(npages * PS)]
    out = {}
    for pool in pools:
        ns = KeyNamespace.for_pool(group, pool, model="m")
        n = state_pages if pool == "state" else npages
        out[pool] = page_keys(ns, tokens[: n * ns.page_size])
        assert len(out[pool]) == n
    return out


def members(group: PoolGroup, anchor: str) -> list[str]:
    """The anchor and its sidecars."""
    return [anchor, *sorted(s.name for s in group.sidecars_of(anchor))]


def page_nbytes(group: PoolGroup, anchor: str) -> int:
    """Bytes of one stored page of ``anchor``: its rows and its sidecars'."""
    return sum(group[n].page_size * group[n].slot_nbytes for n in members(group, anchor))


Rows = dict[str, list[list[torch.Tensor]]]


def prefix_rows(group: PoolGroup, device: Mapping[str, torch.Tensor], npages: Mapping[str, int]) -> Rows:
    """Device rows of the first ``npages[anchor]`` pages of each anchor and its
    sidecars, at ``device`` (a backup's or load's device indices)."""
    out: Rows = {}
    for anchor, k in npages.items():
        if not k:
            continue
        for name in members(group, anchor):
            if group[name].device is None:  # the logical anchor: no rows
                continue
            out[name] = device_rows(group, name, device[name][: k * group[name].page_size])
    return out


def assert_rows_equal(got: Rows, want: Rows) -> None:
    assert sorted(got) == sorted(want)
    for name, layers in want.items():
        assert len(got[name]) == len(layers) > 0, name
        for got_layer, want_layer in zip(got[name], layers):
            assert len(got_layer) == len(want_layer) > 0, name
            for a, b in zip(got_layer, want_layer):
                assert a.dtype == b.dtype and a.shape == b.shape, name
                assert a.numel() > 0, name
                assert torch.equal(a, b), f"pool {name!r} differs"


@dataclass
class Stored:
    """What engine A backed up and wrote: the host pages it holds, their keys,
    its device indices and the write's result."""

    host: dict[str, torch.Tensor]
    keys: dict[str, list[bytes]]
    device: dict[str, torch.Tensor]
    result: WriteStorageResult


async def backup(sched: TransferScheduler, req: Mapping[str, torch.Tensor]) -> OperationHandle:
    h = await sched.backup(req)
    await h
    return h


async def backup_and_store(
    sched: TransferScheduler, group: PoolGroup, npages: int, state_pages: int = 2,
    pools: Sequence[str] = ANCHORS, only: Mapping[str, Sequence[int]] | None = None,
) -> Stored:
    """Back up ``npages`` device pages of each pool and write them to the store
    (``only[pool]``: just those page positions)."""
    b = await backup(sched, req_of(npages, state_pages, pools))
    host = {p: b.host_indices[p] for p in pools}
    keys = prefix_keys(group, npages, state_pages, pools)
    wh, wk = host, keys
    if only is not None:
        wh, wk = {}, {}
        for p, positions in only.items():
            size = group[p].page_size
            wh[p] = torch.cat([host[p][i * size:(i + 1) * size] for i in positions])
            wk[p] = [keys[p][i] for i in positions]
    result = await (await sched.write_storage(wh, wk))
    return Stored(host, keys, b.device_indices, result)


async def load_rows(sched: TransferScheduler, group: PoolGroup, result: PrefetchResult) -> Rows:
    """Load a prefetch's pages into newly allocated device slots; their rows."""
    ld = await sched.load(dict(result.host_indices))
    await ld
    return prefix_rows(group, ld.device_indices, result.pages)


def baseline(group: PoolGroup) -> dict[str, int | None]:
    out = used(group)
    assert all(v in (0, None) for v in out.values()), out
    return out


def with_pages(group: PoolGroup, base: Mapping[str, int | None], npages: Mapping[str, int]) -> dict[str, int | None]:
    """``base`` plus ``npages[pool]`` pages of each pool (the used slots expected)."""
    out = dict(base)
    for pool, k in npages.items():
        out[pool] = (out[pool] or 0) + k * group[pool].page_size
    return out


# -- 1, 2: two engines share a prefix ---------------------------------------------


@pytest.fixture(params=["file", pytest.param("redis", marks=needs_redis_server),
                        pytest.param("redis-cluster", marks=needs_redis_server)])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], StorageBackend]:
    """Opens a new handle on one shared store (a directory, or a Redis key
    prefix of this test's own, on one server or a three-master cluster)."""
    if request.param == "file":
        return lambda: FileStore(tmp_path / "store")
    prefix = f"t{secrets.token_hex(4)}:"
    if request.param == "redis-cluster":
        cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
        return lambda: RedisStore(cluster.url, prefix=prefix, timeout_s=5.0, cluster=True)
    server: LocalRedisServer = request.getfixturevalue("redis_server")
    return lambda: RedisStore(server.url, prefix=prefix, timeout_s=5.0)


@pytest.mark.parametrize(
    ("layout_a", "layout_b"),
    [("layer_first", "layer_first"), ("page_first", "page_first"),
     # A fleet mixes host layouts: both store the same bytes (layer by layer), so they share.
     ("page_first", "layer_first"), ("layer_first", "page_first")],
)
async def test_two_engines_share_a_prefix_through_the_store(
    open_store: Callable[[], StorageBackend], layout_a: str, layout_b: str
) -> None:
    a, b = engine(1, layout_a), engine(2, layout_b)
    n, n_state = 3, 2
    store_a, store_b = open_store(), open_store()
    try:
        async with TransferScheduler(a, storage=store_a) as sched_a:
            stored = await backup_and_store(sched_a, a, n, n_state)
            written = stored.result
            counts = {"kv": n, "swa": n, "state": n_state, "tok": n}
            assert dict(written.pages) == counts
            assert dict(written.pages_written) == counts
            assert dict(written.pages_present) == dict.fromkeys(ANCHORS, 0)
            assert written.nbytes == sum(k * page_nbytes(a, p) for p, k in counts.items())
            want = prefix_rows(a, stored.device, counts)
            assert set(want) == {"kv", "c4", "swa", "swa_state", "state", "idx"}
            sched_a.free_host(stored.host)
        base_b = baseline(b)
        async with TransferScheduler(b, storage=store_b) as sched_b:
            keys = prefix_keys(b, n, n_state)
            assert keys == stored.keys  # the same namespace in both engines
            # B's device rows differ before (another seed): the load is what makes them equal.
            before = device_rows(b, "kv", stored.device["kv"])
            assert not torch.equal(before[0][0], want["kv"][0][0])
            h = await sched_b.prefetch(keys, policy="wait_complete")
            res = await h
            assert dict(res.pages) == counts and dict(res.hit_pages) == counts
            assert dict(res.requested_pages) == counts
            assert res.complete and not res.stopped
            assert res.nbytes == written.nbytes
            assert used(b) == with_pages(b, base_b, counts)
            assert_rows_equal(await load_rows(sched_b, b, res), want)
            sched_b.free_host(res.host_indices)
            stats = sched_b.statistics().prefetch
            assert (stats.submitted, stats.completed, stats.failed, stats.bytes) == (1, 1, 0, res.nbytes)
        assert used(b) == base_b
    finally:
        await store_a.aclose()
        await store_b.aclose()


# -- 3, 4: hits, present pages, key order -----------------------------------------


async def test_hit_is_the_longest_stored_run_from_the_first_key(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path)) as sched_a:
        # kv: pages 0, 1 and 3 of 4 stored (2 missing); swa: all 4.
        stored = await backup_and_store(sched_a, a, 4, pools=("kv", "swa"), only={"kv": [0, 1, 3], "swa": [0, 1, 2, 3]})
        assert dict(stored.result.pages_written) == {"kv": 3, "swa": 4}
        want = prefix_rows(a, stored.device, {"kv": 2, "swa": 4})
    base = baseline(b)
    async with TransferScheduler(b, storage=FileStore(tmp_path)) as sched:
        keys = stored.keys
        res = await (await sched.prefetch(keys))
        assert dict(res.pages) == {"kv": 2, "swa": 4}
        assert dict(res.hit_pages) == {"kv": 2, "swa": 4}
        assert dict(res.requested_pages) == {"kv": 4, "swa": 4}
        assert not res.stopped and not res.complete
        assert res.nbytes == 2 * page_nbytes(b, "kv") + 4 * page_nbytes(b, "swa")
        # The pages past kv's hit were freed: the caller holds exactly the hit pages.
        assert used(b) == with_pages(b, base, {"kv": 2, "swa": 4})
        assert res.host_indices["kv"].numel() == 2 * PS
        assert_rows_equal(await load_rows(sched, b, res), want)
        sched.free_host(res.host_indices)
        assert used(b) == base
        # Page 3 alone is stored (its key names its whole prefix); a run from page 2 is empty.
        alone = await (await sched.prefetch({"kv": keys["kv"][3:]}))
        assert dict(alone.pages) == {"kv": 1}
        sched.free_host(alone.host_indices)
        miss = await (await sched.prefetch({"kv": keys["kv"][2:]}))
        assert dict(miss.pages) == {"kv": 0} and dict(miss.hit_pages) == {"kv": 0}
        assert dict(miss.host_indices) == {} and miss.nbytes == 0 and not miss.stopped
        assert used(b) == base


async def test_all_pools_reads_nothing_unless_every_pool_hits(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path)) as sched_a:
        # kv: all 4 pages stored; state: the first of its 2 pages only.
        stored = await backup_and_store(sched_a, a, 4, pools=("kv", "state"), only={"kv": [0, 1, 2, 3], "state": [0]})
        want = prefix_rows(a, stored.device, {"kv": 4, "state": 1})
    base = baseline(b)
    async with TransferScheduler(b, storage=FileStore(tmp_path)) as sched:
        h = await sched.prefetch(stored.keys, all_pools=True)
        res = await h
        assert h.hit_pages == {"kv": 0, "state": 0} == dict(res.hit_pages)
        assert dict(res.pages) == {"kv": 0, "state": 0} and dict(res.host_indices) == {}
        assert not res.complete and not res.stopped and res.nbytes == 0
        assert used(b) == base  # nothing read, every page given back
        # Without it, each pool hits on its own: the kv pages are read.
        res = await (await sched.prefetch(stored.keys))
        assert dict(res.pages) == {"kv": 4, "state": 1}
        sched.free_host(res.host_indices)
        # With every key stored, all_pools reads everything.
        whole = {"kv": stored.keys["kv"], "state": stored.keys["state"][:1]}
        res = await (await sched.prefetch(whole, all_pools=True, policy="wait_complete"))
        assert res.complete and dict(res.pages) == {"kv": 4, "state": 1}
        assert_rows_equal(await load_rows(sched, b, res), want)
        sched.free_host(res.host_indices)
        with pytest.raises(ValueError, match="all_pools must be a bool; got 'yes'"):
            await sched.prefetch(whole, all_pools="yes")  # type: ignore[arg-type]
        assert used(b) == base


async def test_write_storage_skips_pages_already_stored(tmp_path: Path) -> None:
    group = engine(1)
    async with TransferScheduler(group, storage=FileStore(tmp_path)) as sched:
        stored = await backup_and_store(sched, group, 2)
        first = stored.result
        counts = {"kv": 2, "swa": 2, "state": 2, "tok": 2}
        assert dict(first.pages_written) == counts
        assert first.nbytes == sum(k * page_nbytes(group, p) for p, k in counts.items()) > 0
        again = await (await sched.write_storage(stored.host, stored.keys))
        assert dict(again.pages) == counts
        assert dict(again.pages_present) == counts
        assert dict(again.pages_written) == dict.fromkeys(ANCHORS, 0)
        assert again.nbytes == 0
        # Another engine's pages under the same keys are present too: one more
        # write of only the first kv page puts nothing.
        third = await (await sched.write_storage({"kv": stored.host["kv"][:PS]}, {"kv": stored.keys["kv"][:1]}))
        assert (dict(third.pages_written), dict(third.pages_present), third.nbytes) == ({"kv": 0}, {"kv": 1}, 0)
        stats = sched.statistics().write_storage
        assert (stats.submitted, stats.completed, stats.bytes) == (3, 3, first.nbytes)
        before = used(group)
        sched.free_host(stored.host)
        assert used(group) == baseline(group) and before != used(group)


async def test_write_storage_pairs_each_key_with_its_page_in_the_order_given(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path)) as sched_a:
        bk = await backup(sched_a, req_of(3, pools=("kv",)))
        keys = prefix_keys(a, 3, pools=("kv",))["kv"]
        host = bk.host_indices["kv"]
        # Pages listed 2, 0, 1 with their keys in the same order.
        order = [2, 0, 1]
        shuffled = torch.cat([host[i * PS:(i + 1) * PS] for i in order])
        await (await sched_a.write_storage({"kv": shuffled}, {"kv": [keys[i] for i in order]}))
        want = prefix_rows(a, bk.device_indices, {"kv": 3})
    async with TransferScheduler(b, storage=FileStore(tmp_path)) as sched_b:
        res = await (await sched_b.prefetch({"kv": keys}))
        assert dict(res.pages) == {"kv": 3}
        assert_rows_equal(await load_rows(sched_b, b, res), want)


# -- 5-8: stopping, timeouts, cancelling --------------------------------------------


async def test_best_effort_stop_mid_way_hands_back_the_completed_rounds(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path)) as sched_a:
        stored = await backup_and_store(sched_a, a, 4, pools=("kv",))
        want = prefix_rows(a, stored.device, {"kv": 2})
    base = baseline(b)
    gate = Gate(from_call=3)  # rounds of one page: the third round's read blocks
    store = HookedStore(FileStore(tmp_path), get=gate)
    with anyio.fail_after(20):
        async with TransferScheduler(b, storage=store, config=ONE_PAGE_PER_ROUND) as sched:
            h = await sched.prefetch(stored.keys, policy="best_effort")
            assert h.hit_pages is None  # not looked up yet
            await wait_until(lambda: gate.waiting == 1)
            assert h.pages_done == {"kv": 2} and not h.done()
            assert h.hit_pages == {"kv": 4}
            # Every page is still taken: the two done and the two being read.
            assert used(b) == with_pages(b, base, {"kv": 4})
            assert h.stop() is True
            res = await h
            assert h.stop() is False  # already finished
            assert res.stopped and not res.complete
            assert dict(res.pages) == {"kv": 2} and dict(res.hit_pages) == {"kv": 4}
            assert res.nbytes == 2 * page_nbytes(b, "kv")
            assert gate.waiting == 0  # the blocked read was abandoned
            assert used(b) == with_pages(b, base, {"kv": 2})
            assert_rows_equal(await load_rows(sched, b, res), want)
            sched.free_host(res.host_indices)
            assert used(b) == base
            assert store.calls["get"] == 3
            assert sched.statistics().prefetch.completed == 1


async def test_timeout_policy_stops_by_itself_with_the_completed_pages(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path)) as sched_a:
        stored = await backup_and_store(sched_a, a, 4, pools=("kv", "swa"))
        want = prefix_rows(a, stored.device, {"kv": 2, "swa": 0})
    base = baseline(b)
    gate = Gate(from_call=3)  # a store that stops answering after two reads
    store = HookedStore(FileStore(tmp_path), get=gate)
    with anyio.fail_after(20):
        async with TransferScheduler(b, storage=store, config=ONE_PAGE_PER_ROUND) as sched:
            h = await sched.prefetch(stored.keys, policy="timeout", timeout_s=0.5)
            res = await h
            assert res.stopped and res.seconds_total >= 0.45
            # kv is read first (key order): two pages of it, none of swa.
            assert dict(res.pages) == {"kv": 2, "swa": 0}
            assert dict(res.hit_pages) == {"kv": 4, "swa": 4}
            assert set(res.host_indices) == {"kv"}
            assert used(b) == with_pages(b, base, {"kv": 2})
            assert_rows_equal(await load_rows(sched, b, res), want)
            sched.free_host(res.host_indices)
            assert used(b) == base
            assert sched.statistics().prefetch.completed == 1
            gate.open()


async def test_wait_complete_cannot_stop_but_can_be_cancelled(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path)) as sched_a:
        stored = await backup_and_store(sched_a, a, 3)
    base = baseline(b)
    gate = Gate(from_call=2)
    with anyio.fail_after(20):
        async with TransferScheduler(b, storage=HookedStore(FileStore(tmp_path), get=gate), config=ONE_PAGE_PER_ROUND) as sched:
            h = await sched.prefetch(stored.keys, policy="wait_complete")
            await wait_until(lambda: gate.waiting == 1)
            assert h.pages_done["kv"] == 1
            with pytest.raises(ValueError, match="wait_complete"):
                h.stop()
            assert not h.done()
            assert h.cancel() is True
            with pytest.raises(OperationCancelled):
                await h
            assert h.cancel() is False
            # The page already read is freed too.
            assert used(b) == base
            stats = sched.statistics().prefetch
            assert (stats.cancelled, stats.completed, stats.failed) == (1, 0, 0)


async def test_stop_and_cancel_while_queued_free_everything(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path)) as sched_a:
        stored = await backup_and_store(sched_a, a, 2, pools=("kv", "swa"))
    base = baseline(b)
    gate = Gate()  # every read blocks until opened
    cfg = SchedulerConfig(max_batch_ops=1, storage_chunk_bytes=1)
    with anyio.fail_after(20):
        async with TransferScheduler(b, storage=HookedStore(FileStore(tmp_path), get=gate), config=cfg) as sched:
            # The prefetch lane runs two batches of one at a time: hold both.
            running = [await sched.prefetch(stored.keys) for _ in range(2)]
            await wait_until(lambda: gate.waiting == 2)
            queued = await sched.prefetch(stored.keys)
            doomed = await sched.prefetch({"kv": stored.keys["kv"]}, policy="wait_complete")
            await anyio.sleep(0.02)
            assert queued.queued and doomed.queued
            assert used(b) == with_pages(b, base, {"kv": 8, "swa": 6})
            assert queued.stop() is True
            res = await queued
            assert dict(res.pages) == {"kv": 0, "swa": 0} and res.stopped
            assert dict(res.host_indices) == {} and res.nbytes == 0
            assert doomed.cancel() is True
            with pytest.raises(OperationCancelled):
                await doomed
            assert used(b) == with_pages(b, base, {"kv": 4, "swa": 4})  # the two running ones only
            # A deadline that passes while queued hands back nothing either.
            late = await sched.prefetch(stored.keys, policy="timeout", timeout_s=0.05)
            assert late.queued
            res = await late
            assert dict(res.pages) == {"kv": 0, "swa": 0} and res.stopped and dict(res.host_indices) == {}
            assert used(b) == with_pages(b, base, {"kv": 4, "swa": 4})
            assert sched.statistics().prefetch.queue_depth == 0
            gate.open()
            for h in running:
                r = await h
                assert r.complete
                sched.free_host(r.host_indices)
            assert used(b) == base
            stats = sched.statistics().prefetch
            assert (stats.submitted, stats.completed, stats.cancelled) == (5, 4, 1)


# -- 9: backend failures --------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "error", "raised"),
    [
        ("get", StorageError("boom", backend="hooked", operation="get"), StorageError),
        ("get", StorageTimeout("slow", backend="hooked", operation="get", timeout_s=1.0), StorageTimeout),
        ("exists", StorageError("down", backend="hooked", operation="exists"), StorageError),
        ("get", RuntimeError("a bug in the store"), TransferFailed),
    ],
    ids=["get-error", "get-timeout", "exists-error", "get-other"],
)
async def test_prefetch_backend_failure_frees_every_page(
    tmp_path: Path, where: str, error: Exception, raised: type[Exception]
) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path)) as sched_a:
        stored = await backup_and_store(sched_a, a, 3)
    base = baseline(b)
    # The second read fails, after the first round landed in host slots.
    store = HookedStore(FileStore(tmp_path), **{where: fail_from(2 if where == "get" else 1, error)})
    with anyio.fail_after(20):
        async with TransferScheduler(b, storage=store, config=ONE_PAGE_PER_ROUND) as sched:
            h = await sched.prefetch(stored.keys)
            with pytest.raises(raised) as info:
                await h
            if raised is TransferFailed:
                assert info.value.__cause__ is error
            else:
                assert info.value is error
            assert used(b) == base
            stats = sched.statistics().prefetch
            assert (stats.failed, stats.completed) == (1, 0)
            # The scheduler still works once the store does.
            store.hooks[where] = None
            res = await (await sched.prefetch(stored.keys))
            assert res.complete
            sched.free_host(res.host_indices)
            assert used(b) == base


async def test_write_storage_backend_timeout_keeps_the_callers_pages(tmp_path: Path) -> None:
    group = engine(1)
    base = baseline(group)
    store = HookedStore(FileStore(tmp_path), put=fail_from(2, StorageTimeout("slow", backend="hooked", operation="put")))
    async with TransferScheduler(group, storage=store, config=ONE_PAGE_PER_ROUND) as sched:
        bk = await backup(sched, req_of(3, pools=("kv",)))
        host = {"kv": bk.host_indices["kv"]}
        keys = prefix_keys(group, 3, pools=("kv",))
        held = used(group)
        w = await sched.write_storage(host, keys)
        with pytest.raises(StorageTimeout):
            await w
        assert used(group) == held == with_pages(group, base, {"kv": 3})
        # The first round's page is stored whole, the others not at all.
        assert await store.inner.exists(keys["kv"]) == [True, False, False]
        assert sched.statistics().deferred_host_frees == 0
        stats = sched.statistics().write_storage
        assert (stats.failed, stats.completed) == (1, 0)
        # The pages are no longer pinned: freed at once.
        sched.free_host(host)
        assert used(group) == base


# -- 10: a Redis server killed mid-transfer ------------------------------------------


@needs_redis_server
async def test_redis_killed_mid_transfer_leaves_whole_pages_and_exact_pools(
    persistent_redis: LocalRedisServer,
) -> None:
    server = persistent_redis
    a = engine(1)
    n = 6
    keys = prefix_keys(a, n, pools=("kv",))
    # Rounds of two kv pages: three puts; the server dies during the second.
    cfg = SchedulerConfig(storage_chunk_bytes=2 * page_nbytes(a, "kv"))
    killer: list[threading.Thread] = []

    async def kill_during(call: int, _keys: list[bytes]) -> None:
        if call == 2:
            t = threading.Thread(target=server.kill)  # races with this round's pipeline
            t.start()
            killer.append(t)
        elif call > 2:  # the server is dead before the third round, whoever won the race
            await anyio.to_thread.run_sync(killer[0].join)

    store = HookedStore(RedisStore(server.url, timeout_s=2.0), put=kill_during)
    base_a = baseline(a)
    with anyio.fail_after(30):
        try:
            async with TransferScheduler(a, storage=store, config=cfg) as sched:
                bk = await backup(sched, req_of(n, pools=("kv",)))
                host = {"kv": bk.host_indices["kv"]}
                want_all = prefix_rows(a, bk.device_indices, {"kv": n})
                w = await sched.write_storage(host, keys)
                with pytest.raises(StorageError):
                    await w
                await anyio.to_thread.run_sync(killer[0].join)
                assert store.calls["put"] >= 2
                # Only the caller's backup pages are held, and they are not pinned.
                assert used(a) == with_pages(a, base_a, {"kv": n})
                sched.free_host(host)
                assert used(a) == base_a
        finally:
            await store.aclose()

        await anyio.to_thread.run_sync(server.start)  # same port and directory: replays the AOF
        b = engine(2)
        base_b = baseline(b)
        fresh = HookedStore(RedisStore(server.url, timeout_s=2.0))
        try:
            present = await fresh.exists(keys["kv"])
            visible = present.index(False) if False in present else n
            # The first round was acknowledged before the kill; the third never sent.
            assert 2 <= visible <= 4
            assert present == [True] * visible + [False] * (n - visible)  # puts land in order
            async with TransferScheduler(b, storage=fresh, config=ONE_PAGE_PER_ROUND) as sched:
                res = await (await sched.prefetch(keys, policy="wait_complete"))
                assert dict(res.pages) == {"kv": visible} == dict(res.hit_pages)
                rows = await load_rows(sched, b, res)
                # Every visible page is whole and byte-exact (kv and its c4 rows).
                want = {name: [[t[: visible * b[name].page_size] for t in layer] for layer in layers]
                        for name, layers in want_all.items()}
                assert_rows_equal(rows, want)
                sched.free_host(res.host_indices)
                assert used(b) == base_b

                # Killed during a prefetch's first read: the prefetch fails, all its pages freed.
                async def kill_on_get(call: int, _keys: list[bytes]) -> None:
                    if call == 1:
                        t = threading.Thread(target=server.kill)  # races with the first read
                        t.start()
                        killer.append(t)
                    else:
                        await anyio.to_thread.run_sync(killer[1].join)

                fresh.hooks["get"] = kill_on_get
                fresh.calls["get"] = 0
                h = await sched.prefetch(keys)
                with pytest.raises(StorageError):
                    await h
                await anyio.to_thread.run_sync(killer[1].join)
                assert used(b) == base_b
                assert sched.statistics().prefetch.failed == 1
        finally:
            await fresh.aclose()


# -- 11: verify mode ------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["kv", "c4"])
async def test_verify_mode_keeps_corrupted_host_pages_out_of_the_store(tmp_path: Path, pool: str) -> None:
    group = engine(1)
    base = baseline(group)
    store = FileStore(tmp_path)
    async with TransferScheduler(group, storage=store, config=SchedulerConfig(verify=True)) as sched:
        bk = await backup(sched, req_of(2, pools=("kv",)))
        host = {"kv": bk.host_indices["kv"]}
        keys = prefix_keys(group, 2, pools=("kv",))
        # Behind kvtier's back: change one value in the second page's rows (its own or its sidecar's).
        victim = bk.host_indices[pool][-1]
        view = group[pool].host.layer_view(1, 0)
        view[victim] = view[victim] + 1
        w = await sched.write_storage(host, keys)
        with pytest.raises(CorruptionDetected) as info:
            await w
        assert info.value.pool == pool
        assert info.value.pages == [int(host["kv"][-1]) // PS]
        # Nothing was put, not even the intact first page.
        assert await store.exists(keys["kv"]) == [False, False]
        assert used(group) == with_pages(group, base, {"kv": 2})
        stats = sched.statistics().write_storage
        assert (stats.failed, stats.completed, stats.bytes) == (1, 0, 0)
        sched.free_host(host)
        assert used(group) == base


async def test_verify_mode_accepts_prefetched_pages(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path / "one"), config=SchedulerConfig(verify=True)) as sched_a:
        stored = await backup_and_store(sched_a, a, 3)
        counts = dict(stored.result.pages_written)
        want = prefix_rows(a, stored.device, counts)
    base = baseline(b)
    cfg = SchedulerConfig(verify=True, storage_chunk_bytes=1)
    async with TransferScheduler(b, storage=FileStore(tmp_path / "one"), config=cfg) as sched:
        res = await (await sched.prefetch(stored.keys, policy="wait_complete"))
        assert dict(res.pages) == counts
        # Loads check the checksums recorded when the pages came from the store.
        assert_rows_equal(await load_rows(sched, b, res), want)
        assert sched.statistics().load.failed == 0
        sched.free_host(res.host_indices)
        assert used(b) == base
        # Prefetched pages can be written back (verify checks them before the
        # lookup): their checksums were recorded as they came in.
        res = await (await sched.prefetch({"kv": stored.keys["kv"]}))
        out = await (await sched.write_storage(dict(res.host_indices), {"kv": stored.keys["kv"]}))
        assert dict(out.pages_present) == {"kv": 3} and out.nbytes == 0
        sched.free_host(res.host_indices)
        assert used(b) == base


# -- 12: ordering against backups ----------------------------------------------------


async def test_write_storage_waits_for_the_backup_still_writing_its_pages(
    tmp_path: Path, gate: threading.Event
) -> None:
    a, b = engine(1), engine(2)
    ex = FaultInjectingExecutor(hold=gate)
    pools = ("kv", "swa", "tok")
    with anyio.fail_after(20):
        async with TransferScheduler(a, executor=ex, storage=FileStore(tmp_path)) as sched:
            bk = await sched.backup(req_of(2, pools=pools))
            await wait_until(ex.started.is_set)  # the copy is held in the worker
            host = {p: bk.host_indices[p] for p in pools}
            keys = prefix_keys(a, 2, pools=pools)
            handles = []

            async def submit() -> None:
                handles.append(await sched.write_storage(host, keys))

            async with anyio.create_task_group() as tg:
                tg.start_soon(submit)
                await anyio.sleep(0.05)
                # Not queued yet: it waits for the backup writing its host pages.
                assert not handles and not bk.done()
                assert sched.statistics().write_storage.submitted == 0
                gate.set()
            await bk
            res = await handles[0]
            assert dict(res.pages_written) == dict.fromkeys(pools, 2)
            want = prefix_rows(a, bk.device_indices, dict.fromkeys(pools, 2))
    # The store holds the backed-up rows, not what the host slots held before.
    async with TransferScheduler(b, storage=FileStore(tmp_path)) as sched:
        got = await (await sched.prefetch(keys))
        assert got.complete
        assert_rows_equal(await load_rows(sched, b, got), want)


async def test_write_storage_of_a_failed_backups_pages_raises(tmp_path: Path, gate: threading.Event) -> None:
    group = engine(1)
    base = baseline(group)
    ex = FaultInjectingExecutor(hold=gate, fail_batches={0})
    store = FileStore(tmp_path)
    with anyio.fail_after(20):
        async with TransferScheduler(group, executor=ex, storage=store) as sched:
            bk = await sched.backup(req_of(2, pools=("kv",)))
            await wait_until(ex.started.is_set)
            keys = prefix_keys(group, 2, pools=("kv",))
            errors: list[BaseException] = []

            async def submit() -> None:
                try:
                    await sched.write_storage({"kv": bk.host_indices["kv"]}, keys)
                except TransferFailed as exc:
                    errors.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(submit)
                await anyio.sleep(0.02)
                gate.set()  # the held backup now fails
            with pytest.raises(TransferFailed):
                await bk
            assert len(errors) == 1 and isinstance(errors[0].__cause__, TransferFailed)
            # Afterwards the pages are the allocator's again: not the caller's to write.
            with pytest.raises(InvalidIndices):
                await sched.write_storage({"kv": bk.host_indices["kv"]}, keys)
            assert used(group) == base  # the failed backup gave its pages back
            assert sched.statistics().write_storage.submitted == 0
            assert await store.exists(keys["kv"]) == [False, False]


# -- 13: configuration and bad input --------------------------------------------------


async def test_storage_operations_need_a_storage_backend() -> None:
    group = engine(1)
    base = baseline(group)
    with pytest.raises(TypeError, match="StorageBackend"):
        TransferScheduler(group, storage=object())  # type: ignore[arg-type]
    async with TransferScheduler(group) as sched:
        bk = await backup(sched, req_of(1, pools=("kv",)))
        keys = prefix_keys(group, 1, pools=("kv",))
        with pytest.raises(ConfigurationError, match="no storage backend"):
            await sched.write_storage({"kv": bk.host_indices["kv"]}, keys)
        with pytest.raises(ConfigurationError, match="no storage backend"):
            await sched.prefetch(keys)
        stats = sched.statistics()
        assert stats.write_storage.submitted == stats.prefetch.submitted == 0
        assert used(group) == with_pages(group, base, {"kv": 1})  # the backup's page only
        sched.free_host({"kv": bk.host_indices["kv"]})
    with pytest.raises(SchedulerClosed):
        await sched.prefetch(keys)


async def test_bad_storage_input_raises_and_changes_nothing(tmp_path: Path) -> None:
    group = engine(1)
    store = HookedStore(FileStore(tmp_path))
    async with TransferScheduler(group, storage=store) as sched:
        bk = await backup(sched, req_of(2, pools=("kv", "swa")))
        kv = bk.host_indices["kv"]
        keys = prefix_keys(group, 2, pools=("kv", "swa"))
        k = keys["kv"]
        held = used(group)
        before = sched.statistics()
        free_page = pages(15, page_size=PS)  # a kv host page nobody holds

        write_cases: list[tuple[object, object, type[InvalidIndices], str]] = [
            ({"nope": kv}, {"nope": k}, InvalidIndices, "known-pool"),
            ({"c4": bk.host_indices["c4"]}, {"c4": k}, InvalidIndices, "not-a-sidecar"),
            ({"kv": kv}, {"kv": k[:1]}, InvalidIndices, "one-key-per-page"),
            ({"kv": kv}, {"kv": [*k, k[0]]}, InvalidIndices, "one-key-per-page"),
            ({"kv": kv}, {"kv": [k[0].hex(), k[1]]}, InvalidIndices, "page-keys"),
            ({"kv": kv}, {"kv": [k[0], b""]}, InvalidIndices, "page-keys"),
            ({"kv": kv}, {"kv": [k[0], b"x" * 257]}, InvalidIndices, "page-keys"),
            ({"kv": kv}, {"kv": b"".join(k)}, InvalidIndices, "page-keys"),
            ({"kv": kv}, {"swa": keys["swa"]}, InvalidIndices, "same-pools"),
            ({"kv": kv}, {"kv": k, "swa": keys["swa"]}, InvalidIndices, "same-pools"),
            ({"kv": kv}, [k], InvalidIndices, "mapping"),
            ({"kv": kv[:5]}, {"kv": k}, InvalidIndices, "whole-pages"),
            ({"kv": free_page}, {"kv": k[:1]}, InvalidIndices, "host-pages-held"),
            ({}, {}, InvalidIndices, "non-empty"),
        ]
        for host, wkeys, werror, rule in write_cases:
            with pytest.raises(werror) as info:
                await sched.write_storage(host, wkeys)  # type: ignore[arg-type]
            assert info.value.rule == rule, (host, wkeys, info.value)

        prefetch_cases: list[tuple[object, dict[str, object], type[Exception]]] = [
            ({"kv": k}, {"policy": "eager"}, ValueError),
            ({"kv": k}, {"policy": "best_effort", "timeout_s": 1.0}, ValueError),
            ({"kv": k}, {"policy": "wait_complete", "timeout_s": 1.0}, ValueError),
            ({"kv": k}, {"policy": "timeout"}, ValueError),
            ({"kv": k}, {"policy": "timeout", "timeout_s": 0}, ValueError),
            ({"kv": k}, {"policy": "timeout", "timeout_s": -1.0}, ValueError),
            ({"kv": k}, {"policy": "timeout", "timeout_s": math.nan}, ValueError),
            ({"kv": k}, {"policy": "timeout", "timeout_s": math.inf}, ValueError),
            ({"kv": k}, {"policy": "timeout", "timeout_s": True}, ValueError),
            ({"kv": k}, {"policy": "timeout", "timeout_s": "1"}, ValueError),
            ({}, {}, InvalidIndices),
            ({"nope": k}, {}, InvalidIndices),
            ({"c4": k}, {}, InvalidIndices),
            ({"kv": []}, {}, InvalidIndices),
            ({"kv": k[0]}, {}, InvalidIndices),
            ({"kv": [k[0], "key"]}, {}, InvalidIndices),
            ({"kv": [k[0], b""]}, {}, InvalidIndices),
            ([k], {}, InvalidIndices),
        ]
        for pkeys, kwargs, error in prefetch_cases:
            with pytest.raises(error):
                await sched.prefetch(pkeys, **kwargs)  # type: ignore[arg-type]

        # All or nothing across pools: kv's pages are given back when swa is short.
        swa_pages_free = group["swa"].host.slots // PS - 2
        with pytest.raises(PoolExhausted) as exhausted:
            await sched.prefetch({"kv": k, "swa": [bytes([i]) * 32 for i in range(swa_pages_free + 1)]})
        assert exhausted.value.pool == "swa"

        assert used(group) == held
        after = sched.statistics()
        assert after.write_storage == before.write_storage and after.prefetch == before.prefetch
        assert after.deferred_host_frees == 0
        assert store.calls == {"exists": 0, "get": 0, "put": 0}  # the store was never asked
        # And the held pages are still writable and freeable as usual.
        res = await (await sched.write_storage({"kv": kv}, {"kv": k}))
        assert dict(res.pages_written) == {"kv": 2}
        sched.free_host({"kv": kv, "swa": bk.host_indices["swa"]})
        assert used(group) == baseline(group)


# -- 14, 15: deferred frees, closing ---------------------------------------------------


async def test_free_host_while_write_storage_reads_is_deferred(tmp_path: Path) -> None:
    group = engine(1)
    base = baseline(group)
    gate = Gate()
    store = HookedStore(FileStore(tmp_path), put=gate)
    with anyio.fail_after(20):
        async with TransferScheduler(group, storage=store) as sched:
            bk = await backup(sched, req_of(2, pools=("kv",)))
            host = {"kv": bk.host_indices["kv"]}
            keys = prefix_keys(group, 2, pools=("kv",))
            w = await sched.write_storage(host, keys)
            await wait_until(lambda: gate.waiting == 1)
            sched.free_host(host)
            # Not reusable while the write reads it: still taken, the free deferred.
            assert sched.statistics().deferred_host_frees == 2
            assert used(group) == with_pages(group, base, {"kv": 2})
            with pytest.raises(InvalidIndices):
                sched.free_host(host)  # freed once already
            with pytest.raises(InvalidIndices):
                await sched.write_storage(host, keys)  # no longer the caller's
            # Every other kv host page can be taken, but not these two.
            other = await sched.prefetch({"kv": [bytes([i]) * 32 for i in range(group["kv"].host.slots // PS - 2)]})
            with pytest.raises(PoolExhausted):
                await sched.prefetch({"kv": [b"\x01" * 32]})
            await other
            gate.open()
            res = await w
            assert dict(res.pages_written) == {"kv": 2}  # the bytes it read were the backup's
            assert sched.statistics().deferred_host_frees == 0
            assert used(group) == base
    async with TransferScheduler(b := engine(2), storage=FileStore(tmp_path)) as sched:
        got = await (await sched.prefetch(keys))
        assert_rows_equal(await load_rows(sched, b, got), prefix_rows(group, bk.device_indices, {"kv": 2}))


async def test_closing_with_cancel_ends_queued_and_running_storage_operations(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path)) as sched_a:
        stored = await backup_and_store(sched_a, a, 2, pools=("kv",))
    base = baseline(b)
    gate = Gate()
    store = HookedStore(FileStore(tmp_path), get=gate, put=gate)
    cfg = SchedulerConfig(max_batch_ops=1, on_close="cancel")
    with anyio.fail_after(20):
        async with anyio.create_task_group() as outer:
            async with TransferScheduler(b, storage=store, config=cfg) as sched:
                bk = await backup(sched, req_of(1, pools=("kv",), first=4))
                own = {"kv": bk.host_indices["kv"]}
                own_keys = prefix_keys(b, 1, pools=("kv",), prompt=7)
                running = [await sched.prefetch(stored.keys) for _ in range(2)]
                writing = [await sched.write_storage(own, own_keys) for _ in range(2)]
                await wait_until(lambda: gate.waiting == 4)  # both lanes full
                queued_prefetch = await sched.prefetch(stored.keys)
                queued_write = await sched.write_storage(own, own_keys)
                assert queued_prefetch.queued and queued_write.queued
                assert used(b) == with_pages(b, base, {"kv": 7})

                async def open_later() -> None:
                    await anyio.sleep(0.05)
                    gate.open()

                outer.start_soon(open_later)
            # Closed cancelling: the queued ones never ran; the running ones
            # ended too (a store call they waited on is abandoned), every page back.
            for h in (queued_prefetch, queued_write, *running, *writing):
                with pytest.raises(SchedulerClosed):
                    await h
            stats = sched.statistics()
            assert stats.prefetch.cancelled == 3 and stats.write_storage.cancelled == 3
            assert stats.deferred_host_frees == 0
            # Only the backup's page is held.
            assert used(b) == with_pages(b, base, {"kv": 1})
            sched.free_host(own)
            assert used(b) == base


# -- more edges: the lookup, evictions, cancelled writes, abandoned submissions --------


async def test_stop_and_cancel_during_the_lookup_free_at_once(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path)) as sched_a:
        stored = await backup_and_store(sched_a, a, 2, pools=("kv", "swa"))
        want = prefix_rows(a, stored.device, {"kv": 2, "swa": 2})
    base = baseline(b)
    gate = Gate()  # every exists blocks until opened
    store = HookedStore(FileStore(tmp_path), exists=gate)
    with anyio.fail_after(20):
        async with TransferScheduler(b, storage=store) as sched:
            stopped = await sched.prefetch(stored.keys)
            await wait_until(lambda: gate.waiting == 1)
            cancelled = await sched.prefetch(stored.keys, policy="wait_complete")
            await wait_until(lambda: gate.waiting == 2)  # two batches, each looking up
            assert not stopped.queued and not cancelled.queued
            assert stopped.stop() is True
            res = await stopped
            assert dict(res.pages) == {"kv": 0, "swa": 0} and res.stopped and dict(res.host_indices) == {}
            assert cancelled.cancel() is True
            with pytest.raises(OperationCancelled):
                await cancelled
            assert used(b) == base  # freed before the lookups answered
            gate.open()
            await wait_until(lambda: gate.waiting == 0)
            # The lookups' answers change nothing now; the pools are consistent.
            again = await (await sched.prefetch(stored.keys))
            assert again.complete
            assert used(b) == with_pages(b, base, {"kv": 2, "swa": 2})
            assert_rows_equal(await load_rows(sched, b, again), want)
            sched.free_host(again.host_indices)
            assert used(b) == base
            stats = sched.statistics().prefetch
            assert (stats.completed, stats.cancelled, stats.failed) == (2, 1, 0)


@pytest.mark.parametrize(("round_pages", "evicted"), [(1, 2), (2, 3), (2, 0)])
async def test_a_page_evicted_after_the_lookup_ends_the_hit(tmp_path: Path, round_pages: int, evicted: int) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path)) as sched_a:
        stored = await backup_and_store(sched_a, a, 4, pools=("kv",))
        want = prefix_rows(a, stored.device, {"kv": evicted})
    victim = stored.keys["kv"][evicted]

    async def evict_before_its_read(call: int, keys: list[bytes]) -> None:
        if victim in keys:  # FileStore layout: one file a page, <dir>/<hex[:2]>/<hex>.data
            page_file = tmp_path / victim.hex()[:2] / f"{victim.hex()}.data"
            await anyio.to_thread.run_sync(page_file.unlink)

    base = baseline(b)
    store = HookedStore(FileStore(tmp_path), get=evict_before_its_read)
    cfg = SchedulerConfig(storage_chunk_bytes=round_pages * page_nbytes(b, "kv"))
    async with TransferScheduler(b, storage=store, config=cfg) as sched:
        res = await (await sched.prefetch(stored.keys, policy="wait_complete"))
        # The run ends at the evicted page: the pages before it, nothing after.
        assert dict(res.pages) == {"kv": evicted}
        assert not res.complete and not res.stopped
        assert [len(k) for k in store.keys["get"]] == [round_pages] * (evicted // round_pages + 1)
        assert used(b) == with_pages(b, base, {"kv": evicted})
        if evicted:
            assert_rows_equal(await load_rows(sched, b, res), want)
            sched.free_host(res.host_indices)
        else:
            assert dict(res.host_indices) == {}
        assert used(b) == base


async def test_cancel_a_running_write_storage_keeps_whole_pages_only(tmp_path: Path) -> None:
    group = engine(1)
    base = baseline(group)
    gate = Gate(from_call=2)
    store = HookedStore(FileStore(tmp_path), put=gate)
    with anyio.fail_after(20):
        async with TransferScheduler(group, storage=store, config=ONE_PAGE_PER_ROUND) as sched:
            bk = await backup(sched, req_of(4, pools=("kv",)))
            host = {"kv": bk.host_indices["kv"]}
            keys = prefix_keys(group, 4, pools=("kv",))
            w = await sched.write_storage(host, keys)
            await wait_until(lambda: gate.waiting == 1)
            assert w.cancel() is True
            gate.open()
            with pytest.raises(OperationCancelled):
                await w
            assert w.cancel() is False
            present = await store.inner.exists(keys["kv"])
            # The round in flight when cancelled may land; no round starts after it.
            assert present in ([True, False, False, False], [True, True, False, False])
            assert store.calls["put"] == 2
            assert sched.statistics().write_storage.cancelled == 1
            sched.free_host(host)  # unpinned: freed at once
            assert sched.statistics().deferred_host_frees == 0
            assert used(group) == base


async def test_submissions_cancelled_while_waiting_for_room_give_everything_back(tmp_path: Path) -> None:
    group = engine(1)
    base = baseline(group)
    gets, puts = Gate(), Gate(from_call=2)  # the first put passes
    store = HookedStore(FileStore(tmp_path), get=gets, put=puts)
    cfg = SchedulerConfig(max_batch_ops=1, max_queued_ops=1)
    with anyio.fail_after(20):
        async with TransferScheduler(group, storage=store, config=cfg) as sched:
            stored = await backup_and_store(sched, group, 1, pools=("kv",))
            assert store.calls["put"] == 1
            # Fill both storage lanes: two batches running (blocked) and one queued each.
            prefetches = [await sched.prefetch(stored.keys) for _ in range(2)]
            bk = await backup(sched, req_of(4, pools=("kv",), first=1))
            mine = [{"kv": bk.host_indices["kv"][i * PS:(i + 1) * PS]} for i in range(4)]
            mine_keys = [prefix_keys(group, 1, pools=("kv",), prompt=10 + i) for i in range(4)]
            writes = [await sched.write_storage(mine[i], mine_keys[i]) for i in range(2)]
            await wait_until(lambda: gets.waiting == 2 and puts.waiting == 2)
            prefetches.append(await sched.prefetch(stored.keys))
            writes.append(await sched.write_storage(mine[2], mine_keys[2]))
            held = used(group)
            before = sched.statistics()
            with anyio.move_on_after(0.05) as scope:
                await sched.prefetch(stored.keys)
            assert scope.cancelled_caught
            with anyio.move_on_after(0.05) as scope:
                await sched.write_storage(mine[3], mine_keys[3])
            assert scope.cancelled_caught
            assert used(group) == held  # the prefetch's page was given back
            sched.free_host(mine[3])  # the abandoned write's page is not pinned
            assert sched.statistics().deferred_host_frees == 0
            assert used(group) == with_pages(group, held, {"kv": -1})
            after = sched.statistics()
            assert after.prefetch.submitted == before.prefetch.submitted
            assert after.write_storage.submitted == before.write_storage.submitted
            gets.open()
            puts.open()
            for ph in prefetches:
                sched.free_host((await ph).host_indices)
            for wh in writes:
                assert dict((await wh).pages_written) == {"kv": 1}
            sched.free_host(stored.host)
            sched.free_host({"kv": torch.cat([m["kv"] for m in mine[:3]])})
            assert used(group) == base


@pytest.mark.parametrize("direction", ["prefetch", "write_storage"])
async def test_abandoned_submissions_are_not_counted(tmp_path: Path, direction: str) -> None:
    """An operation whose submission was cancelled never reached the queue:
    like an abandoned backup, it should not show in the lane's statistics
    (else cancelled + completed + failed > submitted)."""
    group = engine(1)
    gets, puts = Gate(), Gate()
    store = HookedStore(FileStore(tmp_path), get=gets, put=puts)
    cfg = SchedulerConfig(max_batch_ops=1, max_queued_ops=1)
    with anyio.fail_after(20):
        async with TransferScheduler(group, storage=store, config=cfg) as sched:
            bk = await backup(sched, req_of(4, pools=("kv",)))
            one = [{"kv": bk.host_indices["kv"][i * PS:(i + 1) * PS]} for i in range(4)]
            keys = [prefix_keys(group, 1, pools=("kv",), prompt=i) for i in range(4)]

            async def submit(i: int) -> PrefetchHandle | WriteStorageHandle:
                if direction == "prefetch":
                    return await sched.prefetch(keys[0])
                return await sched.write_storage(one[i], keys[i])

            if direction == "prefetch":
                puts.open()
                await (await sched.write_storage(one[0], keys[0]))
            handles = [await submit(i) for i in range(2)]
            await wait_until(lambda: gets.waiting + puts.waiting == 2)
            handles.append(await submit(2))
            with anyio.move_on_after(0.05) as scope:
                await submit(3)
            assert scope.cancelled_caught
            gets.open()
            puts.open()
            for h in handles:
                await h
            stats = getattr(sched.statistics(), direction)
            assert stats.submitted == 3
            assert stats.completed + stats.failed + stats.cancelled == stats.submitted, stats


async def test_writes_of_one_batch_sharing_a_prefix_put_each_page_once(tmp_path: Path) -> None:
    group = engine(1)
    store = HookedStore(FileStore(tmp_path))
    async with TransferScheduler(group, storage=store) as sched:
        bk = await backup(sched, req_of(3, pools=("kv", "swa")))
        host = {p: bk.host_indices[p] for p in ("kv", "swa")}
        keys = prefix_keys(group, 3, pools=("kv", "swa"))
        short_host = {"kv": host["kv"][: 2 * PS]}
        short_keys = {"kv": keys["kv"][:2]}
        # Submitted back to back: the write lane takes both in one batch.
        long = await sched.write_storage(host, keys)
        short = await sched.write_storage(short_host, short_keys)
        r_long, r_short = await long, await short
        assert sched.statistics().write_storage.batches == 1
        put = [k for call in store.keys["put"] for k in call]
        assert sorted(put) == sorted(set(keys["kv"]) | set(keys["swa"]))  # each page put once
        assert r_long.pages_written["kv"] + r_short.pages_written["kv"] == 3
        assert r_long.pages_present["kv"] + r_short.pages_present["kv"] == 2
        assert dict(r_long.pages_written) == {"kv": 3, "swa": 3}  # the first puts the shared pages
        assert dict(r_short.pages_present) == {"kv": 2}
        assert r_short.nbytes == 0 and r_long.nbytes == 3 * (page_nbytes(group, "kv") + page_nbytes(group, "swa"))
        sched.free_host(host)
        assert used(group) == baseline(group)


async def test_deadline_passing_while_the_submission_waits_for_room(tmp_path: Path) -> None:
    group = engine(1)
    base = baseline(group)
    gets = Gate()
    store = HookedStore(FileStore(tmp_path), get=gets)
    cfg = SchedulerConfig(max_batch_ops=1, max_queued_ops=1)
    with anyio.fail_after(20):
        async with TransferScheduler(group, storage=store, config=cfg) as sched:
            stored = await backup_and_store(sched, group, 1, pools=("kv",))
            sched.free_host(stored.host)
            keys = stored.keys
            running = [await sched.prefetch(keys) for _ in range(2)]
            await wait_until(lambda: gets.waiting == 2)
            queued = await sched.prefetch(keys)  # the lane's one place
            admitted: list[PrefetchHandle] = []

            async def submit_other() -> None:
                admitted.append(await sched.prefetch(keys))

            async with anyio.create_task_group() as tg:
                tg.start_soon(submit_other)  # waits for room first
                await anyio.sleep(0.01)
                late: list[PrefetchHandle] = []
                with anyio.move_on_after(0.2) as scope:
                    # Its deadline passes while it waits for room, then the caller gives up.
                    late.append(await sched.prefetch(keys, policy="timeout", timeout_s=0.05))
                if not scope.cancelled_caught:  # also fine: handed back, stopped, with nothing
                    res = await late[0]
                    assert res.stopped and dict(res.pages) == {"kv": 0}
                # The lane still holds only `queued`: nobody was admitted past its bound.
                assert admitted == []
                assert sched.statistics().prefetch.queue_depth == 1
                # Pages: 2 running + 1 queued + 1 waiting submission; the abandoned one's freed once.
                assert used(group) == with_pages(group, base, {"kv": 4})
                gets.open()
            for h in [*running, queued, *admitted]:
                sched.free_host((await h).host_indices)
            assert used(group) == base


@needs_redis_server
async def test_a_redis_read_abandoned_by_stop_does_not_poison_the_connection(own_redis: LocalRedisServer) -> None:
    """stop() abandons a read whose reply has not come (the server is paused);
    the next reads, on a pool of one connection, get their own replies."""
    server = own_redis
    a, b = engine(1), engine(2)
    writer = RedisStore(server.url)
    async with TransferScheduler(a, storage=writer) as sched_a:
        stored = await backup_and_store(sched_a, a, 4, pools=("kv",))
        want = prefix_rows(a, stored.device, {"kv": 4})
    await writer.aclose()

    paused = threading.Event()

    async def pause_third_read(call: int, _keys: list[bytes]) -> None:
        if call == 3:
            await anyio.to_thread.run_sync(server.pause)
            paused.set()

    store = HookedStore(RedisStore(server.url, max_connections=1, timeout_s=5.0), get=pause_third_read)
    base = baseline(b)
    with anyio.fail_after(20):
        try:
            async with TransferScheduler(b, storage=store, config=ONE_PAGE_PER_ROUND) as sched:
                h = await sched.prefetch(stored.keys)
                await wait_until(paused.is_set)
                await anyio.sleep(0.05)  # the third read is sent; its reply cannot come
                assert h.pages_done == {"kv": 2}
                assert h.stop() is True
                res = await h
                assert dict(res.pages) == {"kv": 2} and res.stopped
                sched.free_host(res.host_indices)
                await anyio.to_thread.run_sync(server.resume)  # the abandoned reply arrives now
                await anyio.sleep(0.05)
                again = await (await sched.prefetch(stored.keys, policy="wait_complete"))
                assert again.complete
                assert_rows_equal(await load_rows(sched, b, again), want)
                sched.free_host(again.host_indices)
                assert used(b) == base
        finally:
            await anyio.to_thread.run_sync(server.resume)
            await store.aclose()


async def test_a_stored_page_of_the_wrong_size_ends_the_hit_there(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    store = FileStore(tmp_path)
    async with TransferScheduler(a, storage=store) as sched_a:
        stored = await backup_and_store(sched_a, a, 3, pools=("kv",))
        sched_a.free_host(stored.host)
    # Another writer (a bug, another format) committed page 1 with a short kv blob.
    good = await store.get(stored.keys["kv"][1:2], ["kv", "c4"])
    assert good[0] is not None
    await store.put([PageBlobs(stored.keys["kv"][1], {"kv": good[0]["kv"][:-4], "c4": good[0]["c4"]})])
    base = baseline(b)
    async with TransferScheduler(b, storage=FileStore(tmp_path), config=ONE_PAGE_PER_ROUND) as sched:
        h = await sched.prefetch(stored.keys)
        result = await h  # a miss from the bad page on, not a failure of the prefetch
        assert dict(result.pages) == {"kv": 1} and dict(result.hit_pages) == {"kv": 1}
        assert not result.stopped
        assert used(b) == with_pages(b, base, {"kv": 1})  # page 0 held by the caller, pages 1-2 freed
        assert_rows_equal(await load_rows(sched, b, result), prefix_rows(a, stored.device, {"kv": 1}))
        sched.free_host(dict(result.host_indices))
        assert used(b) == base
        assert sched.statistics().prefetch.failed == 0


class EngineCrashed(Exception):
    pass


def _contains(exc: BaseException, kind: type[BaseException]) -> bool:
    if isinstance(exc, kind):
        return True
    return any(_contains(e, kind) for e in getattr(exc, "exceptions", ()))


async def test_an_error_in_the_engine_cancels_running_storage_operations(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=FileStore(tmp_path)) as sched_a:
        stored = await backup_and_store(sched_a, a, 3, pools=("kv",))
    base = baseline(b)
    gets, puts = Gate(from_call=2), Gate()
    store = HookedStore(FileStore(tmp_path), get=gets, put=puts)
    with anyio.fail_after(20):
        with pytest.raises(Exception) as info:
            async with TransferScheduler(b, storage=store, config=ONE_PAGE_PER_ROUND) as sched:
                bk = await backup(sched, req_of(2, pools=("kv",), first=3))
                host = {"kv": bk.host_indices["kv"]}
                w = await sched.write_storage(host, prefix_keys(b, 2, pools=("kv",), prompt=5))
                p = await sched.prefetch(stored.keys, policy="wait_complete")
                await wait_until(lambda: gets.waiting == 1 and puts.waiting == 1)
                assert p.pages_done == {"kv": 1}
                raise EngineCrashed
    assert _contains(info.value, EngineCrashed)
    with pytest.raises(OperationCancelled):
        await p
    with pytest.raises(OperationCancelled):
        await w
    # The prefetch's pages (one already read) are freed; the write's pages are
    # the caller's again, unpinned.
    assert used(b) == with_pages(b, base, {"kv": 2})
    assert sched.statistics().deferred_host_frees == 0
    sched.free_host(host)
    assert used(b) == base
    with pytest.raises(SchedulerClosed):
        await sched.write_storage(host, prefix_keys(b, 2, pools=("kv",)))


async def test_a_stop_during_a_rounds_write_ends_the_prefetch_even_if_the_next_read_fails() -> None:
    """A stop() that lands while a round is written into host slots (shielded)
    ends the prefetch before its next read, with the pages done. Found by the
    soak: with a store whose get does not wait, the stop was never seen, and
    a next read that failed failed the prefetch after stop() returned True."""
    group = engine(1)
    base = baseline(group)

    class Store(MemoryStore):
        handle: PrefetchHandle | None = None
        stopped: bool | None = None
        gets = 0

        async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
            self.gets += 1
            if self.gets == 1:  # runs during round 1's shielded write into host slots
                loop = asyncio.get_running_loop()
                loop.call_soon(lambda: setattr(self, "stopped", self.handle.stop() if self.handle else None))
            elif self.gets == 2:
                raise StorageError("injected in get #2", backend="memory", operation="get")
            return await super().get(keys, pools)

    store = Store()
    async with TransferScheduler(group, storage=store, config=ONE_PAGE_PER_ROUND) as sched:
        stored = await backup_and_store(sched, group, 4, pools=("kv",))
        sched.free_host(stored.host)
        h = await sched.prefetch(stored.keys, policy="best_effort")
        store.handle = h
        res = await h
        assert store.stopped is True
        assert dict(res.pages) == {"kv": 1} and res.stopped
        assert store.gets == 1  # no round after the stop
        assert used(group) == with_pages(group, base, {"kv": 1})
        sched.free_host(dict(res.host_indices))
        assert used(group) == base
        assert sched.statistics().prefetch.failed == 0
