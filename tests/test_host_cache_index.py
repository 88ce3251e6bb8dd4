"""`kvtier.policies.HostCacheIndex` as a real `TransferScheduler`'s reclaim
hook: it frees victims in its policy's order, never a pinned block nor a page
it was not given, and what it keeps loads back byte-exact."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
from conftest import pages, used
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier import ConfigurationError, InvalidIndices, PoolExhausted, TransferScheduler, WrongEventLoop
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


# -- the index owns what it holds; every method happens whole or not at all ------------


async def test_the_index_keeps_its_own_copy_of_a_reused_buffer() -> None:
    """api.md: a caller may reuse its tensors as soon as a call returns. An
    engine that backs up through one buffer and reuses it must not make a
    later eviction free a page it never gave the index."""
    group = full_attention_group(host_slots=3 * PS, page_size=PS)
    index = HostCacheIndex(LruEviction())
    async with TransferScheduler(group, reclaim=index.reclaim) as sched:
        index.bind(sched)
        a = await sched.backup({"kv": pages(0, page_size=PS)})
        await a
        buffer = a.host_indices["kv"].clone()
        index.insert("a", {"kv": buffer})
        b = await sched.backup({"kv": pages(1, page_size=PS)})
        await b
        buffer.copy_(b.host_indices["kv"])  # the engine's buffer now names b's pages
        looked = index.lookup("a")
        assert looked is not None and torch.equal(looked["kv"], a.host_indices["kv"])
        looked["kv"].fill_(0)  # nor does a change to what lookup handed out reach the index
        assert index.evict(1) == ["a"]
        # a's pages were freed, b's are still the engine's: it frees them itself.
        sched.free_host({"kv": b.host_indices["kv"]})
        assert used(group) == {"kv": 0}


async def test_a_free_that_raises_changes_nothing_and_the_blocks_stay_evictable() -> None:
    group = full_attention_group(host_slots=4 * PS, page_size=PS)
    for eviction in (LruEviction(), SegmentedLruEviction(4)):
        index = HostCacheIndex(eviction)
        async with TransferScheduler(group, reclaim=index.reclaim) as sched:
            index.bind(sched)
            held = {}
            for key, page in (("a", 0), ("b", 1), ("c", 2)):
                h = await sched.backup({"kv": pages(page, page_size=PS)})
                await h
                held[key] = h.host_indices["kv"]
                index.insert(key, h.host_indices)
            sched.free_host({"kv": held["b"]})  # the engine freed b itself, behind the index
            with pytest.raises(InvalidIndices):
                index.evict(2)  # a and b: b's free fails, so a's is not done either
            assert ("a" in index, "b" in index, "c" in index, index.evicted) == (True, True, True, 0)
            assert used(group) == {"kv": 2 * PS}  # a's and c's pages are still allocated
            # Still in the policy's order: a is the first victim once b is given back.
            index.remove("b")
            assert index.evict(1) == ["a"] and used(group) == {"kv": PS}
            assert index.evict(1) == ["c"] and used(group) == {"kv": 0} and len(index) == 0


async def test_evict_from_another_thread_frees_nothing_and_keeps_every_block() -> None:
    group = full_attention_group(host_slots=2 * PS, page_size=PS)
    index = HostCacheIndex(LruEviction())
    async with TransferScheduler(group, reclaim=index.reclaim) as sched:
        index.bind(sched)
        h = await sched.backup({"kv": pages(0, page_size=PS)})
        await h
        index.insert("a", h.host_indices)
        with pytest.raises(WrongEventLoop):
            await anyio.to_thread.run_sync(index.evict, 1)
        assert "a" in index and used(group) == {"kv": PS}
        assert index.evict(1) == ["a"] and used(group) == {"kv": 0}


async def test_reclaim_evicts_the_shortfall_not_the_whole_need() -> None:
    """One page free, three needed: two blocks are evicted, not three."""
    group = full_attention_group(host_slots=5 * PS, page_size=PS)
    index = HostCacheIndex(LruEviction())
    async with TransferScheduler(group, reclaim=index.reclaim) as sched:
        index.bind(sched)
        for key in range(4):
            h = await sched.backup({"kv": pages(key, page_size=PS)})
            await h
            index.insert(key, h.host_indices)
        big = await sched.backup({"kv": pages(4, 5, 6, page_size=PS)})
        await big
        assert index.evicted == 2 and sorted(k for k in range(4) if k in index) == [2, 3]
        sched.free_host(big.host_indices)
        index.evict(2)
        assert used(group) == {"kv": 0}


class PageLedger:
    """The host pages of a pool, as a scheduler's `free_host` treats them:
    freeing checks every page first (held, not freed twice) and raises
    `InvalidIndices` changing nothing."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def free_host(self, host_indices: Mapping[str, Any]) -> None:
        slots = [int(s) for s in host_indices.get("kv", [])]
        bad = [s for s in slots if s not in self.held]
        if bad or len(set(slots)) != len(slots):
            raise InvalidIndices(f"slots {bad[:4]} are not held", pool="kv", rule="held")
        self.held -= set(slots)


class IndexModel(RuleBasedStateMachine):
    """HostCacheIndex (LRU) against a model: blocks in least-recently-used
    order, pins counted, pages held. Every call either fully happens or
    changes nothing, also when the engine freed a block behind its back."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = PageLedger()
        self.index = HostCacheIndex(LruEviction())
        self.index.bind(self.ledger)
        self.order: list[int] = []  # least recently used first
        self.pages: dict[int, list[int]] = {}
        self.pins: dict[int, int] = {}
        self.next_slot = 0
        self.buffer = torch.zeros(PS, dtype=torch.int64)  # the engine's reused buffer

    @rule(key=st.integers(0, 7))
    def insert(self, key: int) -> None:
        if key in self.pages:
            with pytest.raises(ConfigurationError):
                self.index.insert(key, {"kv": self.buffer})
            return
        slots = list(range(self.next_slot, self.next_slot + PS))
        self.next_slot += PS
        self.ledger.held |= set(slots)
        self.buffer.copy_(torch.tensor(slots))
        self.index.insert(key, {"kv": self.buffer})
        self.pages[key] = slots
        self.order.append(key)

    @rule(key=st.integers(0, 7))
    def lookup(self, key: int) -> None:
        got = self.index.lookup(key)
        if key not in self.pages:
            assert got is None
            return
        assert got is not None and got["kv"].tolist() == self.pages[key]
        self.order.remove(key)
        self.order.append(key)

    @rule(key=st.integers(0, 7))
    def pin(self, key: int) -> None:
        if key not in self.pages:
            with pytest.raises((KeyError, ConfigurationError)):  # KeyError before issue 43.7's audit
                self.index.pin(key)
            return
        self.index.pin(key)
        self.pins[key] = self.pins.get(key, 0) + 1

    @rule(key=st.integers(0, 7))
    def unpin(self, key: int) -> None:
        self.index.unpin(key)
        if self.pins.get(key, 0) > 1:
            self.pins[key] -= 1
        else:
            self.pins.pop(key, None)

    @rule(key=st.integers(0, 7))
    def remove(self, key: int) -> None:
        got = self.index.remove(key)
        if key not in self.pages:
            assert got is None
            return
        assert got is not None and got["kv"].tolist() == self.pages.pop(key)
        self.order.remove(key)
        self.pins.pop(key, None)
        self.ledger.held -= set(got["kv"].tolist())  # the engine frees what it took back

    @rule(key=st.integers(0, 7))
    def engine_frees_behind_the_index(self, key: int) -> None:
        if key in self.pages:
            self.ledger.held -= set(self.pages[key])

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        want = [k for k in self.order if k not in self.pins][:n]
        if any(not set(self.pages[k]) <= self.ledger.held for k in want):
            with pytest.raises(InvalidIndices):
                self.index.evict(n)
            return  # nothing changed
        assert self.index.evict(n) == want
        for k in want:
            self.ledger.held -= set(self.pages.pop(k))
            self.order.remove(k)

    @invariant()
    def agrees(self) -> None:
        assert sorted(k for k in range(8) if k in self.index) == sorted(self.pages)
        assert len(self.index) == len(self.pages)
        unpinned = [k for k in self.order if k not in self.pins]
        eviction = self.index.eviction
        assert isinstance(eviction, LruEviction)
        assert eviction.candidates(8, lambda k: k not in self.pins) == unpinned


TestIndexModel = IndexModel.TestCase
TestIndexModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# -- pins and SLRU, pinned by behaviour (issue 44 B) ------------------------------------------


class Pools:
    """Host pages of several pools, freed as `free_host` does (all or nothing)."""

    def __init__(self) -> None:
        self.held: set[tuple[str, int]] = set()
        self.next = 0

    def take(self, *pools: str) -> dict[str, list[int]]:
        out = {}
        for pool in pools:
            out[pool] = list(range(self.next, self.next + PS))
            self.held |= {(pool, s) for s in out[pool]}
            self.next += PS
        return out

    def free_host(self, host_indices: Mapping[str, Any]) -> None:
        slots = {(pool, int(s)) for pool, idx in host_indices.items() for s in idx}
        if not slots <= self.held:
            raise InvalidIndices("not held", rule="held")
        self.held -= slots


def test_pins_are_counted() -> None:
    """Two pins, one unpin: still pinned. Plant: `unpin` forgets every pin."""
    pools = Pools()
    index = HostCacheIndex(LruEviction())
    index.bind(pools)
    index.insert("a", pools.take("kv"))
    index.insert("b", pools.take("kv"))
    index.pin("a")
    index.pin("a")
    index.unpin("a")
    assert index.evict(2) == ["b"] and "a" in index
    index.unpin("a")
    assert index.evict(1) == ["a"] and not pools.held


def test_slru_demotes_its_least_recent_protected_block_and_keeps_it_evictable() -> None:
    """Plant: demote the most recent protected block, or drop the demoted one."""
    slru = SegmentedLruEviction(4, protected_share=0.5)  # two protected places
    pools = Pools()
    index = HostCacheIndex(slru)
    index.bind(pools)
    for key in "abcd":
        index.insert(key, pools.take("kv"))
    for key in "abc":  # a reuse each: a, b protected; c pushes the least recent (a) back
        index.lookup(key)
    assert [slru.segment(k) for k in "abcd"] == ["probation", "protected", "protected", "probation"]
    # Probation first, least recent first; the demoted a went back at its most recent end.
    assert index.evict(2) == ["d", "a"]
    assert index.evict(2) == ["b", "c"] and not pools.held and len(index) == 0


async def test_reclaim_frees_only_blocks_that_hold_the_short_pool() -> None:
    """An older block without the short pool is left alone.
    Plant: reclaim picks victims without looking at their pools."""
    pools = Pools()
    index = HostCacheIndex(LruEviction())
    index.bind(pools)
    index.insert("kv-only", pools.take("kv"))
    index.insert("both", pools.take("kv", "swa"))
    index.insert("swa-only", pools.take("swa"))
    await index.reclaim("swa", "host", PS)
    assert ("kv-only" in index, "both" in index, "swa-only" in index) == (True, False, True)
    await index.reclaim("swa", "device", PS)  # the device tier: not the index's
    assert len(index) == 2


# -- the index over an eviction policy of the engine's own, and its edges ------------------------


class Freer:
    """What the index frees with: records each free_host call (and may refuse)."""

    def __init__(self, free_slots: int | None = None) -> None:
        self.calls: list[dict[str, list[int]]] = []
        self.refuse = False
        if free_slots is not None:  # a group whose kv pool has this many free host slots
            allocator = type("A", (), {"num_free_slots": free_slots})()
            host = type("H", (), {"allocator": allocator})()
            self.group = {"kv": type("S", (), {"host": host})()}

    def free_host(self, host_indices: Mapping[str, Any]) -> None:
        if self.refuse:
            raise InvalidIndices("refused")
        self.calls.append({pool: list(idx) for pool, idx in host_indices.items()})


class FifoEviction:
    """An engine's own policy with no `candidates`: victims leave it when chosen."""

    def __init__(self) -> None:
        self.order: list[Any] = []

    def insert(self, key: Any) -> None:
        if key in self.order:
            self.order.remove(key)
        self.order.append(key)

    def access(self, key: Any) -> None:
        pass

    def remove(self, key: Any) -> None:
        self.order.remove(key)

    def victims(self, n: int, evictable: Any) -> list[Any]:
        out = [k for k in self.order if evictable(k)][:n]
        for k in out:
            self.order.remove(k)
        return out

    def clear(self) -> None:
        self.order.clear()

    def __len__(self) -> int:
        return len(self.order)


def test_a_policy_without_candidates_gives_its_victims_up_and_gets_them_back_when_the_free_fails() -> None:
    policy = FifoEviction()
    index = HostCacheIndex(policy)  # type: ignore[arg-type]
    freer = Freer()
    index.bind(freer)  # type: ignore[arg-type]
    for key, slot in (("a", 0), ("b", 4), ("c", 8)):
        index.insert(key, {"kv": [slot, slot + 1]})
    index.pin("a")
    assert index.evict(1) == ["b"]  # oldest unpinned, in the policy's order
    assert freer.calls == [{"kv": [4, 5]}] and policy.order == ["a", "c"] and "b" not in index
    freer.refuse = True
    with pytest.raises(InvalidIndices):
        index.evict(2)
    assert policy.order == ["a", "c"] and "c" in index and index.evicted == 1  # given back, still held
    freer.refuse = False
    index.unpin("a")
    assert index.evict(5) == ["a", "c"] and freer.calls[-1] == {"kv": [0, 1, 8, 9]}
    assert len(index) == 0 and index.evicted == 3


async def test_reclaim_with_a_policy_without_candidates_frees_only_the_shortfall_of_that_pool() -> None:
    policy = FifoEviction()
    index = HostCacheIndex(policy)  # type: ignore[arg-type]
    freer = Freer(free_slots=1)
    index.bind(freer)  # type: ignore[arg-type]
    index.insert("swa-only", {"swa": [0, 1]})
    index.insert("a", {"kv": [0], "swa": [2]})
    index.insert("b", {"kv": [1, 2]})
    index.insert("c", {"kv": [3]})
    await index.reclaim("kv", "host", 4)  # 1 free, 3 short: a (1 slot) and b (2 slots)
    assert freer.calls == [{"kv": [0, 1, 2], "swa": [2]}]
    assert policy.order == ["swa-only", "c"] and sorted(k for k in ("swa-only", "a", "b", "c") if k in index) == ["c", "swa-only"]


async def test_reclaim_frees_nothing_when_the_pool_has_room_or_the_tier_is_the_device() -> None:
    index = HostCacheIndex(LruEviction())
    freer = Freer(free_slots=2)
    index.bind(freer)  # type: ignore[arg-type]
    index.insert("a", {"kv": [0]})
    await index.reclaim("kv", "host", 2)
    await index.reclaim("kv", "device", 50)
    assert freer.calls == [] and "a" in index
    await index.reclaim("kv", "host", 3)
    assert freer.calls == [{"kv": [0]}]


async def test_reclaim_without_a_readable_group_evicts_the_whole_need() -> None:
    # a freer with no group: no free slots are known, so the need is the shortfall
    index = HostCacheIndex(LruEviction())
    freer = Freer()
    index.bind(freer)  # type: ignore[arg-type]
    for key, slot in (("a", 0), ("b", 1), ("c", 2)):
        index.insert(key, {"kv": [slot]})
    await index.reclaim("kv", "host", 1)
    assert freer.calls == [{"kv": [0]}] and ("a" in index, "b" in index) == (False, True)


def test_pins_count_and_a_removed_block_forgets_its_pins() -> None:
    index = HostCacheIndex(LruEviction())
    freer = Freer()
    index.bind(freer)  # type: ignore[arg-type]
    index.insert("a", {"kv": [0]})
    index.insert("b", {"kv": [1]})
    for _ in range(3):
        index.pin("a")
    index.unpin("a")
    index.unpin("a")
    assert index.evict(2) == ["b"]  # a: pinned once more
    index.unpin("b")  # never pinned: nothing
    assert repr(index) == "<HostCacheIndex [1 blocks, 1 pinned] <LruEviction [1 blocks]>>"
    assert index.remove("a") == {"kv": [0]}
    assert repr(index).startswith("<HostCacheIndex [0 blocks, 0 pinned]")
    index.insert("a", {"kv": [0]})  # held again: a new block, not pinned
    assert index.evict(1) == ["a"]


def test_an_unbound_index_says_how_to_bind_it() -> None:
    index = HostCacheIndex()
    index.insert("a", {"kv": [0]})
    with pytest.raises(ConfigurationError) as refused:
        index.evict(1)
    assert str(refused.value) == "HostCacheIndex has no scheduler to free pages with: call bind(scheduler) first"


def test_the_index_keeps_and_hands_back_its_own_copy_of_each_kind_of_indices() -> None:
    import numpy as np

    index = HostCacheIndex(LruEviction())
    array = np.array([4, 5], dtype=np.int64)
    numbers = [np.int64(8), np.int64(9)]  # an engine's list of numpy ints
    tensor = torch.tensor([12, 13])
    index.insert("a", {"kv": array, "swa": numbers, "c4": tensor})
    array[0], numbers[0], tensor[0] = -1, -1, -1  # the engine reuses its buffers
    got = index.lookup("a")
    assert got is not None
    assert isinstance(got["kv"], np.ndarray) and got["kv"].tolist() == [4, 5]
    assert got["swa"] == [8, 9] and all(type(i) is int for i in got["swa"])  # plain ints: free_host takes them
    assert isinstance(got["c4"], torch.Tensor) and got["c4"].tolist() == [12, 13]
    got["kv"][0] = -7  # the caller's copy: the index's own is untouched
    again = index.lookup("a")
    assert again is not None and again["kv"].tolist() == [4, 5]


async def test_reclaim_frees_every_evictable_block_when_they_cannot_cover_the_need() -> None:
    index = HostCacheIndex(LruEviction())
    freer = Freer(free_slots=0)
    index.bind(freer)  # type: ignore[arg-type]
    index.insert("a", {"kv": [0]})
    index.insert("b", {"kv": [1, 2]})
    index.insert("p", {"kv": [3]})
    index.pin("p")
    await index.reclaim("kv", "host", 50)  # short of 50: a and b are all it may free
    assert freer.calls == [{"kv": [0, 1, 2]}] and list(k for k in "abp" if k in index) == ["p"]
