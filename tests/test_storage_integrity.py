"""Stored pages bound to what they claim, through the scheduler (DESIGN lessons 20, 22).

A page whose blobs belong to another key (a whole page copied under it, or one
blob spliced in from another page: a store bug, a migration, a copy tool) is
a miss counted as rejected, and the next `write_storage` of its key puts it
again, which repairs it; a page of the format before is the same. Against a
real `FileStore` and a real ``redis-server``; the damage is done through the
store's own ``put``, as a faulty copy tool would. Every round trip is
compared byte-exact with the rows on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
import torch
from conftest import pages, used

from kvtier import TransferScheduler
from kvtier.pools import PoolGroup
from kvtier.storage import FileStore, KeyNamespace, PageBlobs, StorageBackend, page_keys
from kvtier.testing import device_rows, hybrid_group

PS = 8  # page size of kv in hybrid_group
WAIT_S = 30  # every wait on a handle here fails after this long instead of hanging


def engine(seed: int) -> PoolGroup:
    return hybrid_group(seed=seed, device_allocator=True)


def kv_keys(group: PoolGroup, npages: int) -> list[bytes]:
    ns = KeyNamespace.for_pool(group, "kv", model="m")
    return page_keys(ns, list(range(npages * PS)))


Rows = dict[str, list[list[torch.Tensor]]]


def kv_rows(group: PoolGroup, device: torch.Tensor) -> Rows:
    """Device rows of kv pages ``device`` and of the c4 rows they derive."""
    k = group["c4"].page_size
    c4 = torch.cat([torch.arange(p * k, (p + 1) * k) for p in (device[::PS] // PS).tolist()])
    return {"kv": device_rows(group, "kv", device), "c4": device_rows(group, "c4", c4)}


def assert_same_rows(got: Rows, want: Rows) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert len(got[name]) == len(want[name]) > 0
        for got_layer, want_layer in zip(got[name], want[name]):
            assert len(got_layer) == len(want_layer) > 0
            for a, b in zip(got_layer, want_layer):
                assert a.numel() > 0 and torch.equal(a, b), f"pool {name!r} differs"


async def _swap(store: StorageBackend, key: bytes, source: bytes) -> None:
    (blobs,) = await store.get([source], ["kv", "c4"])
    assert blobs is not None
    await store.put([PageBlobs(key, blobs)])


async def _splice(store: StorageBackend, key: bytes, pool: str, source: bytes) -> None:
    mine, theirs = await store.get([key, source], ["kv", "c4"])
    assert mine is not None and theirs is not None
    await store.put([PageBlobs(key, {**mine, pool: theirs[pool]})])


async def _prefetch_rows(sched: TransferScheduler, group: PoolGroup, keys: list[bytes]) -> tuple[int, Rows | None]:
    """Prefetch ``keys`` of kv, load what came and free it: (pages, their device rows)."""
    with anyio.fail_after(WAIT_S):
        result = await (await sched.prefetch({"kv": keys}, policy="wait_complete"))
        n = result.pages["kv"]
        if not n:
            return 0, None
        load = await sched.load(dict(result.host_indices))
        await load
    rows = kv_rows(group, load.device_indices["kv"])
    sched.free_host(dict(result.host_indices))
    alloc = group["kv"].device_allocator
    assert alloc is not None
    alloc.free(load.device_indices["kv"])
    return n, rows


@pytest.mark.parametrize("damage", ["swap", "splice-kv", "splice-c4", "version-1"])
async def test_a_page_of_another_key_is_a_miss_and_the_next_write_repairs_it(
    open_store: Callable[[], StorageBackend], damage: str
) -> None:
    group = engine(1)
    keys = kv_keys(group, 3)
    async with open_store() as store, TransferScheduler(group, storage=store) as sched:
        base = used(group)
        device = pages(0, 1, 2, page_size=PS)
        want = kv_rows(group, device)

        async def write() -> tuple[int, int]:
            with anyio.fail_after(WAIT_S):
                b = await sched.backup({"kv": device})
                await b
                w = await (await sched.write_storage({"kv": b.host_indices["kv"]}, {"kv": keys}))
            sched.free_host({"kv": b.host_indices["kv"]})
            return w.pages_written["kv"], w.pages_present["kv"]

        assert await write() == (3, 0)
        n, rows = await _prefetch_rows(sched, group, keys)
        assert n == 3 and rows is not None
        assert_same_rows(rows, want)
        # Page 1 now holds what does not belong to it, its lengths intact.
        if damage == "swap":
            await _swap(store, keys[1], keys[2])
        elif damage.startswith("splice"):
            await _splice(store, keys[1], damage.removeprefix("splice-"), keys[0])
        else:
            (blobs,) = await store.get([keys[1]], ["kv", "c4"])
            assert blobs is not None
            old = {name: bytes([*b[:4], 1, *b[5:]]) for name, b in blobs.items()}
            await store.put([PageBlobs(keys[1], old)])
        assert await store.exists(keys) == [True, True, True]
        n, rows = await _prefetch_rows(sched, group, keys)
        assert n == 1 and rows is not None  # the hit ends at the page of another key
        assert_same_rows(rows, kv_rows(group, device[:PS]))
        stats = sched.statistics().storage
        assert stats is not None and (stats.pages_rejected, stats.keys_to_rewrite) == (1, 1)
        # The next write puts page 1 again although the store says it is present.
        assert await write() == (1, 2)
        stats = sched.statistics().storage
        assert stats is not None and stats.keys_to_rewrite == 0
        n, rows = await _prefetch_rows(sched, group, keys)
        assert n == 3 and rows is not None
        assert_same_rows(rows, want)
        assert used(group) == base


# -- all_pools: a result never pairs pools of different lengths (lesson 22) ----------


ALL = ("kv", "swa", "state")


def all_keys(group: PoolGroup) -> dict[str, list[bytes]]:
    """Three pages of kv and swa and two of state, keyed per pool."""
    out = {}
    for pool, n in (("kv", 3), ("swa", 3), ("state", 2)):
        ns = KeyNamespace.for_pool(group, pool, model="m")
        out[pool] = page_keys(ns, list(range(n * ns.page_size)))
    return out


async def _store_all(sched: TransferScheduler, group: PoolGroup) -> dict[str, list[bytes]]:
    keys = all_keys(group)
    device = {"kv": pages(0, 1, 2, page_size=PS), "swa": pages(0, 1, 2, page_size=PS), "state": torch.arange(2)}
    with anyio.fail_after(WAIT_S):
        b = await sched.backup(device)
        await b
        host = {p: b.host_indices[p] for p in ALL}
        w = await (await sched.write_storage(host, keys))
    assert dict(w.pages_written) == {"kv": 3, "swa": 3, "state": 2}
    sched.free_host(host)
    return keys


@pytest.mark.parametrize("damage", ["flip", "evict"])
@pytest.mark.parametrize("pool", ALL)
async def test_all_pools_cuts_every_pool_when_one_is_short_after_the_lookup(damage: str, pool: str) -> None:
    """A page of ``pool`` damaged or evicted once the lookup found every key:
    the prefetch hands back no pool at all (not the others whole and ``pool``
    cut), frees every page it took, pages already read included, and counts
    them missed."""
    from kvtier.testing import MemoryStore

    group = engine(1)
    store = MemoryStore()
    async with TransferScheduler(group, storage=store) as sched:
        base = used(group)
        keys = await _store_all(sched, group)
        victim = keys[pool][-1]  # the last page: the other pools and this one's first pages read first
        store.hold(("get",))
        with anyio.fail_after(WAIT_S):
            h = await sched.prefetch(keys, all_pools=True, policy="wait_complete")
            while not store.waiting:
                await anyio.sleep(0.001)
            assert h.hit_pages == {"kv": 3, "swa": 3, "state": 2}  # the lookup found every key
            if damage == "flip":
                store.corrupt(victim, pool, len(store.pages[victim][pool]) // 2)
            else:
                del store.pages[victim]
            store.release()
            result = await h
        assert not result.complete and not result.stopped
        assert dict(result.pages) == {"kv": 0, "swa": 0, "state": 0} and dict(result.host_indices) == {}
        assert result.nbytes == 0 and dict(h.pages_done) == {"kv": 0, "swa": 0, "state": 0}
        assert used(group) == base
        stats = sched.statistics().storage
        assert stats is not None
        assert stats.pages_rejected == (damage == "flip")
        assert (stats.pages_hit, stats.pages_missed) == (0, 8)
        # Without all_pools each pool keeps its own run: the damage cuts only its pool.
        result = await (await sched.prefetch(keys, policy="wait_complete"))
        want = {"kv": 3, "swa": 3, "state": 2}
        want[pool] -= 1
        assert dict(result.pages) == want
        sched.free_host(dict(result.host_indices))
        assert used(group) == base


async def test_all_pools_stopped_before_every_pool_is_in_hands_back_nothing() -> None:
    from kvtier.testing import MemoryStore

    group = engine(1)
    store = MemoryStore()
    async with TransferScheduler(group, storage=store) as sched:
        base = used(group)
        keys = await _store_all(sched, group)
        store.hold(("get",))
        with anyio.fail_after(WAIT_S):
            h = await sched.prefetch(keys, all_pools=True, policy="best_effort")
            while not store.waiting:
                await anyio.sleep(0.001)
            store.step()  # kv's pages come
            while h.pages_done["kv"] < 3:
                await anyio.sleep(0.001)
            assert h.stop()
            store.release()
            result = await h
        assert result.stopped and not result.complete
        assert dict(result.pages) == {"kv": 0, "swa": 0, "state": 0} and dict(result.host_indices) == {}
        assert used(group) == base
        # Without all_pools the same stop hands back kv's pages.
        store.hold(("get",))
        with anyio.fail_after(WAIT_S):
            h = await sched.prefetch(keys, policy="best_effort")
            while not store.waiting:
                await anyio.sleep(0.001)
            store.step()
            while h.pages_done["kv"] < 3:
                await anyio.sleep(0.001)
            assert h.stop()
            store.release()
            result = await h
        assert dict(result.pages) == {"kv": 3, "swa": 0, "state": 0}
        sched.free_host(dict(result.host_indices))
        assert used(group) == base


# -- one key names one page of one pool ----------------------------------------------


async def test_a_key_repeated_across_pools_or_within_one_is_refused_before_anything_is_written() -> None:
    """The issue's case: one key for kv and swa was reported written for one
    and present for the other, and only one page was stored. Now the call is
    refused, naming the key, both places and the rule; nothing is pinned,
    taken or put. (A prefetch may name a key twice: both host pages get its
    bytes, and a key of another pool is a miss.)"""
    from kvtier import InvalidIndices
    from kvtier.testing import MemoryStore

    group = engine(1)
    store = MemoryStore()
    async with TransferScheduler(group, storage=store) as sched:
        base = used(group)
        with anyio.fail_after(WAIT_S):
            b = await sched.backup({"kv": pages(0, 1, page_size=PS), "swa": pages(0, page_size=PS)})
            await b
        host = {p: b.host_indices[p] for p in ("kv", "swa")}
        keys = all_keys(group)
        k = keys["kv"][0]
        cases = [
            ({"kv": [k, keys["kv"][1]], "swa": [k]}, r"names page 0 of pool 'kv' and page 0 of pool 'swa'"),
            ({"kv": [k, k], "swa": keys["swa"][:1]}, r"names page 0 of pool 'kv' and page 1 of pool 'kv'"),
        ]
        for bad, where in cases:
            with pytest.raises(InvalidIndices, match=rf"key {k.hex()} {where}; one key names one page of one pool") as err:
                await sched.write_storage(host, bad)
            assert err.value.rule == "one-page-per-key"
        assert store.pages == {} and store.calls == 0
        assert used(group) == {**base, "kv": 2 * PS, "swa": PS}  # the backup's pages only
        sched.free_host(host)  # not pinned by a refused write
        assert used(group) == base


async def test_writes_of_one_batch_naming_one_key_for_two_pools_fail_the_later_one() -> None:
    from kvtier import InvalidIndices
    from kvtier.testing import MemoryStore

    group = engine(1)
    store = MemoryStore()
    async with TransferScheduler(group, storage=store) as sched:
        with anyio.fail_after(WAIT_S):
            b = await sched.backup({"kv": pages(0, page_size=PS), "swa": pages(0, page_size=PS)})
            await b
        host = {p: b.host_indices[p] for p in ("kv", "swa")}
        k = all_keys(group)["kv"][0]
        with anyio.fail_after(WAIT_S):
            first = await sched.write_storage({"kv": host["kv"]}, {"kv": [k]})
            second = await sched.write_storage({"swa": host["swa"]}, {"swa": [k]})
            done = await first
            with pytest.raises(InvalidIndices, match=rf"write {second.id} names key {k.hex()}, which write "
                                                     rf"{first.id} of the same batch names for pool 'kv'"):
                await second
        assert sched.statistics().write_storage.batches == 1
        assert dict(done.pages_written) == {"kv": 1}
        assert sorted(store.pages[k]) == ["c4", "kv"]  # kv's page, whole, and nothing of swa's
        sched.free_host(host)
