"""Backups into host pages the engine names (`backup(..., host_indices=...)`).

An engine that keeps its own host block table (vLLM's offloading manager picks
the host block ids) tells kvtier where to write. kvtier's rules still hold:
the pages must be free, a page written again is a new life (a reader that
waited for the old one never reads the new bytes), and bad input changes
nothing.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import assert_pages_equal, page_bytes, pages, rows, used, wipe
from kvtier import InvalidIndices, PageAllocator, TransferScheduler
from kvtier.pools import slots_of_pages
from kvtier.storage import KeyNamespace, page_keys
from kvtier.testing import FaultInjectingExecutor, MemoryStore, full_attention_group, hybrid_group

PS = 4


def host_rows(group: Any, pool: str, idx: torch.Tensor) -> list[torch.Tensor]:
    host = group[pool].host
    return [host.layer_view(j, p)[idx].clone() for j in range(host.num_layers) for p in range(len(host.planes))]


async def test_a_backup_writes_exactly_the_named_host_pages_and_loads_back_byte_exact() -> None:
    group = full_attention_group(page_size=PS)
    src = pages(1, 2, page_size=PS)
    want = rows(group, "kv", src)
    named = pages(9, 5, page_size=PS)  # not the pages kvtier would pick (0, 1)
    async with TransferScheduler(group) as sched:
        b = await sched.backup({"kv": src}, host_indices={"kv": named})
        await b
        assert torch.equal(b.host_indices["kv"], named)
        assert all(torch.equal(x, y) for x, y in zip(host_rows(group, "kv", named), want, strict=True))
        wipe(group)
        dst = pages(7, 3, page_size=PS)
        await (await sched.load(b.host_indices, {"kv": dst}))
        assert all(torch.equal(x, y) for x, y in zip(rows(group, "kv", dst), want, strict=True))
        # kvtier's own allocation never hands out a named page while it is held.
        other = await sched.backup({"kv": pages(0, page_size=PS)})
        await other
        assert set(other.host_indices["kv"].tolist()).isdisjoint(named.tolist())
        sched.free_host(b.host_indices)
        sched.free_host(other.host_indices)
    assert used(group)["kv"] == 0


async def test_named_pages_bring_their_sidecars_and_accept_a_handles_host_indices() -> None:
    group = hybrid_group(device_allocator=True)
    ps = group["kv"].page_size
    async with TransferScheduler(group) as sched:
        first = await sched.backup({"kv": pages(0, page_size=ps)})
        await first
        want = page_bytes(group, "kv", int(first.host_indices["kv"][0]) // ps)
        sched.free_host(first.host_indices)
        # The engine names page 6, with the c4 rows a handle would list for it.
        named = {"kv": pages(6, page_size=ps)}
        again = await sched.backup({"kv": pages(0, page_size=ps)}, host_indices=named)
        await again
        assert set(again.host_indices) == {"kv", "c4"}
        assert_pages_equal(page_bytes(group, "kv", 6), want)
        sched.free_host(again.host_indices)
        rewritten = await sched.backup({"kv": pages(0, page_size=ps)}, host_indices=dict(again.host_indices))
        await rewritten
        assert_pages_equal(page_bytes(group, "kv", 6), want)
        sched.free_host(rewritten.host_indices)
    assert all(n == 0 for name, n in used(group).items() if n is not None and group[name].host.allocator is not None)


@pytest.mark.parametrize("nowait", [False, True])
async def test_a_named_page_that_is_taken_is_refused_in_every_pool_and_nothing_changes(nowait: bool) -> None:
    group = hybrid_group()
    ps = group["kv"].page_size
    async with TransferScheduler(group) as sched:
        held = await sched.backup({"swa": pages(1, page_size=ps)})
        await held
        taken = int(held.host_indices["swa"][0]) // ps
        before = used(group)
        free_list = list(group["kv"].host.allocator._free)  # the order kvtier would hand pages out
        device = {"kv": pages(0, page_size=ps), "swa": pages(2, page_size=ps)}
        named = {"kv": pages(4, page_size=ps), "swa": pages(taken, page_size=ps)}
        with pytest.raises(InvalidIndices) as err:
            if nowait:
                sched.backup_nowait(device, host_indices=named)
            else:
                await sched.backup(device, host_indices=named)
        assert err.value.rule == "host-pages-free" and err.value.pool == "swa"
        assert f"page {taken}" in str(err.value)
        assert used(group) == before  # kv's page 4 was not taken either
        assert group["kv"].host.allocator._free == free_list
        sched.free_host(held.host_indices)


@pytest.mark.parametrize(
    ("device", "host", "rule"),
    [
        ({"kv": [0, 1]}, {"kv": [0, 1], "swa": [0, 1]}, "host-and-device"),
        ({"kv": [0, 1], "swa": [0, 1]}, {"kv": [0, 1]}, "host-and-device"),
        ({"kv": [0, 1]}, {"kv": [0, 1, 2]}, "equal-lengths"),
        ({"kv": [0]}, {"kv": [5, 5]}, None),  # a page twice: refused by the index checks
        ({"kv": [0]}, {"kv": [10_000]}, None),  # past the host pool
        ({"kv": [0]}, {"c4": [0]}, "not-a-sidecar"),
    ],
)
async def test_bad_named_host_pages_raise_naming_the_rule_and_change_nothing(
    device: dict[str, list[int]], host: dict[str, list[int]], rule: str | None
) -> None:
    group = hybrid_group()
    ps = group["kv"].page_size
    dev = {p: slots_of_pages(v, ps) for p, v in device.items()}
    named = {p: slots_of_pages(v, ps) for p, v in host.items()}
    async with TransferScheduler(group) as sched:
        before = used(group)
        with pytest.raises(InvalidIndices) as err:
            await sched.backup(dev, host_indices=named)
        if rule is not None:
            assert err.value.rule == rule
        assert used(group) == before
        assert sched.statistics().backup.submitted == 0


async def test_a_reader_of_a_page_the_engine_names_again_never_reads_the_new_bytes() -> None:
    # The interleaving of the scheduler core's first bug, with the engine choosing
    # the page: a load waits for backup A of page P; the caller frees P (deferred);
    # A ends, P is freed, and the engine names P at once for another request's
    # backup B. The load must refuse (P's life changed), never copy B's rows.
    hold = threading.Event()
    ex = FaultInjectingExecutor(hold=hold, hold_timeout_s=10)
    group = full_attention_group(page_size=PS)
    P = pages(3, page_size=PS)
    target = pages(10, page_size=PS)
    before = rows(group, "kv", target)
    outcome: dict[str, Any] = {}
    try:
        async with TransferScheduler(group, executor=ex) as sched:
            a = await sched.backup({"kv": pages(0, page_size=PS)}, host_indices={"kv": P})

            async def next_owner() -> None:
                await a
                outcome["b"] = sched.backup_nowait({"kv": pages(2, page_size=PS)}, host_indices={"kv": P})

            async def read() -> None:
                try:
                    outcome["load"] = await (await sched.load({"kv": P}, {"kv": target}))
                except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                    outcome["load"] = exc

            async with anyio.create_task_group() as tg:
                tg.start_soon(next_owner)
                await anyio.sleep(0.01)
                tg.start_soon(read)
                await anyio.sleep(0.01)
                sched.free_host({"kv": P})  # deferred: A still writes P
                hold.set()
            await outcome["b"]
            assert isinstance(outcome["load"], InvalidIndices), outcome["load"]
            assert outcome["load"].rule == "page-generation"
            assert all(torch.equal(x, y) for x, y in zip(rows(group, "kv", target), before, strict=True))
            assert all(torch.equal(x, y) for x, y in
                       zip(host_rows(group, "kv", P), rows(group, "kv", pages(2, page_size=PS)), strict=True))
            sched.free_host({"kv": P})
    finally:
        hold.set()
    assert used(group)["kv"] == 0


async def test_a_page_freed_while_a_load_reads_it_can_be_named_once_the_load_ends() -> None:
    hold = threading.Event()
    ex = FaultInjectingExecutor(hold=hold, hold_timeout_s=10)
    group = full_attention_group(page_size=PS)
    P = pages(2, page_size=PS)
    try:
        async with TransferScheduler(group, executor=ex) as sched:
            hold.set()
            await (await sched.backup({"kv": pages(0, page_size=PS)}, host_indices={"kv": P}))
            want = rows(group, "kv", pages(0, page_size=PS))
            hold.clear()
            load = await sched.load({"kv": P}, {"kv": pages(5, page_size=PS)})
            sched.free_host({"kv": P})  # deferred: the load reads P
            with pytest.raises(InvalidIndices) as err:
                sched.backup_nowait({"kv": pages(1, page_size=PS)}, host_indices={"kv": P})
            assert err.value.rule == "host-pages-free"
            hold.set()
            await load
            assert all(torch.equal(x, y) for x, y in zip(rows(group, "kv", pages(5, page_size=PS)), want, strict=True))
            again = await sched.backup({"kv": pages(1, page_size=PS)}, host_indices={"kv": P})
            await again
            sched.free_host(again.host_indices)
    finally:
        hold.set()
    assert used(group)["kv"] == 0


# -- the allocator ------------------------------------------------------------------


def test_take_pages_refuses_taken_and_repeated_pages_and_changes_nothing() -> None:
    a = PageAllocator(32, 4, name="kv")
    a.take_pages([5, 2])
    assert a.is_taken(5) and a.is_taken(2) and a.num_free_pages == 6
    for bad, rule in (([1, 5], "host-pages-free"), ([1, 1], "unique-pages"), ([8], "in-range"), ([-1], "in-range")):
        state = (list(a._free), a.num_free_pages)
        with pytest.raises(InvalidIndices) as err:
            a.take_pages(bad)
        assert err.value.rule == rule
        assert (list(a._free), a.num_free_pages) == state
        assert not a.is_taken(1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "take", "free"]), st.integers(0, 2**16)), max_size=60))
def test_take_alloc_and_free_in_any_order_hand_every_page_out_at_most_once(steps: list[tuple[str, int]]) -> None:
    n = 16
    a = PageAllocator(n, 1, name="kv")
    held: set[int] = set()
    for op, x in steps:
        free = sorted(set(range(n)) - held)
        if op == "alloc":
            got = a.try_alloc_pages(1 + x % 3)
            if got is None:
                assert len(free) < 1 + x % 3
                continue
            assert held.isdisjoint(got) and len(set(got)) == len(got)
            held.update(got)
        elif op == "take" and free:
            chosen = [free[x % len(free)]] + ([free[(x // 7) % len(free)]] if x % 2 else [])
            chosen = list(dict.fromkeys(chosen))
            a.take_pages(chosen)
            held.update(chosen)
        elif op == "free" and held:
            gone = sorted(held)[x % len(held):][:2]
            a.free_pages(gone)
            held.difference_update(gone)
        assert a.num_free_pages == n - len(held)
        assert all(a.is_taken(p) == (p in held) for p in range(n))
        assert sorted(a._free) == sorted(set(range(n)) - held)


async def test_a_page_a_storage_write_still_reads_can_be_named_once_the_write_ends() -> None:
    # The load case above, with the other reader kind: write_storage pins the page too.
    store = MemoryStore()
    group = full_attention_group(page_size=PS)
    P = pages(2, page_size=PS)
    async with TransferScheduler(group, storage=store) as sched:
        await (await sched.backup({"kv": pages(0, page_size=PS)}, host_indices={"kv": P}))
        store.hold(("put",))
        ns = KeyNamespace(model="t", pool="kv", page_size=PS, dtype="f32", layout="layer_first")
        write = await sched.write_storage({"kv": P}, {"kv": page_keys(ns, [1] * PS)})
        with anyio.fail_after(5):
            while not store.waiting:
                await anyio.sleep(0.001)  # the write is at the store, reading P
        sched.free_host({"kv": P})  # deferred: the write reads P
        with pytest.raises(InvalidIndices) as err:
            sched.backup_nowait({"kv": pages(1, page_size=PS)}, host_indices={"kv": P})
        assert err.value.rule == "host-pages-free"
        store.release()
        await write
        again = await sched.backup({"kv": pages(1, page_size=PS)}, host_indices={"kv": P})
        await again
        assert all(torch.equal(x, y) for x, y in
                   zip(host_rows(group, "kv", P), rows(group, "kv", pages(1, page_size=PS)), strict=True))
        sched.free_host(again.host_indices)
    assert used(group)["kv"] == 0
