"""`kvtier.policies.HostCacheIndex` as a real `TransferScheduler`'s reclaim
hook: it frees victims in its policy's order, never a pinned block nor a page
it was not given, and what it keeps loads back byte-exact."""

from __future__ import annotations

import pytest
import torch
from conftest import pages, used

from kvtier import ConfigurationError, PoolExhausted, TransferScheduler
from kvtier.policies import HostCacheIndex, LruEviction, SegmentedLruEviction
from kvtier.testing import device_rows, full_attention_group

PS = 4


async def test_reclaim_frees_the_policys_victim_and_the_kept_block_loads_back_exact() -> None:
    group = full_attention_group(host_slots=2 * PS, page_size=PS)  # room for two blocks
    index = HostCacheIndex(LruEviction())
    async with TransferScheduler(group, reclaim=index.reclaim) as sched:
        index.bind(sched)
        want = device_rows(group, "kv", pages(0, page_size=PS))
        for key, page in (("a", 0), ("b", 1)):
            h = await sched.backup({"kv": pages(page, page_size=PS)})
            await h
            index.insert(key, h.host_indices)
        assert index.lookup("a") is not None  # a use: b is now least recently used
        c = await sched.backup({"kv": pages(2, page_size=PS)})  # host full: reclaim frees b
        await c
        index.insert("c", c.host_indices)
        assert ("a" in index, "b" in index, "c" in index, index.evicted) == (True, False, True, 1)
        assert used(group) == {"kv": 2 * PS}
        # a's pages were not freed: its rows load back exactly.
        a = index.lookup("a")
        assert a is not None
        index.pin("a")
        ld = await sched.load(a, {"kv": pages(10, page_size=PS)})
        await ld
        index.unpin("a")
        got = device_rows(group, "kv", pages(10, page_size=PS))
        assert all(torch.equal(x, y) for gl, wl in zip(got, want) for x, y in zip(gl, wl)) and len(got) == len(want) > 0
        # A pinned block is skipped: a is least recently used... after c's lookup, but pinned.
        index.lookup("c")
        index.pin("a")
        d = await sched.backup({"kv": pages(3, page_size=PS)})
        await d
        assert ("a" in index, "c" in index) == (True, False)
        index.insert("d", d.host_indices)
        # Every block pinned: nothing is freed and the backup fails, pools exact.
        index.pin("d")
        before = used(group)
        with pytest.raises(PoolExhausted):
            await sched.backup({"kv": pages(4, page_size=PS)})
        assert used(group) == before and len(index) == 2
        # Pages the engine took back (remove) are never freed by the index.
        held = index.remove("d")
        index.unpin("a")
        e = await sched.backup({"kv": pages(5, page_size=PS)})  # frees a, the only block left
        await e
        assert len(index) == 0 and index.evicted == 3
        with pytest.raises(PoolExhausted):
            await sched.backup({"kv": pages(6, page_size=PS)})  # d's pages are the engine's; e unindexed
        assert held is not None
        sched.free_host(held)
        sched.free_host(e)
    assert used(group) == {"kv": 0}


async def test_slru_keeps_a_reused_block_through_a_burst_of_one_shot_blocks() -> None:
    group = full_attention_group(host_slots=3 * PS, page_size=PS)
    index = HostCacheIndex(SegmentedLruEviction(3))
    async with TransferScheduler(group, reclaim=index.reclaim) as sched:
        index.bind(sched)
        h = await sched.backup({"kv": pages(0, page_size=PS)})
        await h
        index.insert("hot", h.host_indices)
        assert index.lookup("hot") is not None  # reused once: protected
        for i in range(1, 6):  # one-shot blocks cycle through probation
            b = await sched.backup({"kv": pages(i, page_size=PS)})
            await b
            index.insert(f"once{i}", b.host_indices)
        assert "hot" in index and len(index) == 3 and index.evicted == 3
        for key in ["hot", "once4", "once5"]:
            held = index.remove(key)
            assert held is not None
            sched.free_host(held)
    assert used(group) == {"kv": 0}


async def test_bad_use_is_refused_naming_it() -> None:
    with pytest.raises(ConfigurationError, match="eviction must be a kvtier.policies.HostEviction"):
        HostCacheIndex(object())  # type: ignore[arg-type]
    index = HostCacheIndex()
    with pytest.raises(ConfigurationError, match="call bind"):
        await index.reclaim("kv", "host", PS)
    with pytest.raises(ConfigurationError, match="needs a TransferScheduler"):
        index.bind(object())  # type: ignore[arg-type]
    index.insert("a", {"kv": torch.arange(PS)})
    with pytest.raises(ConfigurationError, match="already holds block 'a'"):
        index.insert("a", {"kv": torch.arange(PS)})
    with pytest.raises(ConfigurationError, match="HostCacheIndex holds no block 'b'"):
        index.pin("b")
    await index.reclaim("kv", "device", PS)  # the device tier is not the index's: nothing happens
    assert len(index) == 1
