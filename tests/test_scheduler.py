"""End-to-end behaviour of TransferScheduler on CPU."""

from __future__ import annotations

import logging
import threading

import anyio
import pytest
import torch
from structlog.testing import capture_logs

from conftest import assert_rows_equal, pages, rows, used, wait_until, wipe
from kvtier import (
    InvalidIndices,
    OperationCancelled,
    PoolExhausted,
    SchedulerClosed,
    SchedulerConfig,
    TransferFailed,
    TransferScheduler,
)
from kvtier.testing import (
    FaultInjectingExecutor,
    InjectedFault,
    full_attention_group,
    hybrid_group,
    sliding_window_group,
)


HYBRID_POOLS = ("kv", "swa", "state", "tok")


def hybrid_request(first_page: int, npages: int = 2, page_size: int = 8) -> dict[str, torch.Tensor]:
    """Device indices of one request across every slot-owning pool of hybrid_group."""
    idx = pages(*range(first_page, first_page + npages), page_size=page_size)
    return {"kv": idx, "swa": idx, "tok": idx, "state": torch.tensor([first_page % 16])}


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_round_trip_every_pool_kind_is_byte_exact(layout: str) -> None:
    group = hybrid_group(layout=layout)
    async with TransferScheduler(group) as sched:
        req = hybrid_request(1)
        h = await sched.backup(req)
        await h
        dev = h.device_indices
        assert set(dev) == {"kv", "swa", "state", "tok", "c4", "swa_state", "idx"}
        before = {name: rows(group, name, idx) for name, idx in dev.items() if name != "tok"}
        wipe(group)
        fresh = hybrid_request(5)
        fresh["state"] = torch.tensor([9])
        load = await sched.load({name: h.host_indices[name] for name in req}, fresh)
        await load
        after = load.device_indices
        # Sidecar rows follow the fresh source pages.
        assert torch.equal(after["c4"], torch.arange(5 * 2, 7 * 2))
        assert torch.equal(after["swa_state"], torch.arange(5 * 3, 7 * 3))
        assert torch.equal(after["idx"], torch.tensor([5, 6]))
        for name, expected in before.items():
            assert_rows_equal(rows(group, name, after[name]), expected)


async def test_sliding_window_layers_are_mapped_to_their_pools() -> None:
    group = sliding_window_group()
    async with TransferScheduler(group) as sched:
        idx = pages(2, 3, page_size=4)
        h = await sched.backup({"kv": idx, "swa": idx})
        await h
        kv_before, swa_before = rows(group, "kv", idx), rows(group, "swa", idx)
        wipe(group)
        dst = pages(7, page_size=4)
        dst = pages(7, 8, page_size=4)
        await (await sched.load(h.host_indices, {"kv": dst, "swa": dst}))
        assert_rows_equal(rows(group, "kv", dst), kv_before)
        assert_rows_equal(rows(group, "swa", dst), swa_before)


async def test_concurrent_operations_are_merged_into_batches() -> None:
    group = hybrid_group(device_slots=256, host_slots=512, state_slots=64)
    ex = FaultInjectingExecutor(delay_s=0.01)
    async with TransferScheduler(group, executor=ex) as sched:
        handles = [sched.backup_nowait(hybrid_request(p, npages=1)) for p in range(32)]
        results = [await h for h in handles]
        stats = sched.statistics().backup
    assert stats.completed == 32
    assert stats.batches < 32
    assert stats.operations_per_batch > 1
    assert any(len(ids) > 1 for _, ids in ex.history)
    # Every operation's bytes landed where its handle says.
    for h, r in zip(handles, results):
        assert r.nbytes == h.nbytes
        for name in ("kv", "c4"):
            host = group[name].host
            dev = group[name].device
            for j in range(dev.num_layers):
                assert torch.equal(
                    host.layer_view(j, 0)[h.host_indices[name]], dev.tensor(j, 0)[h.device_indices[name]]
                )


async def test_loads_go_ahead_of_queued_backups(gate: threading.Event) -> None:
    group = full_attention_group(device_slots=64, host_slots=256)
    ex = FaultInjectingExecutor(hold=gate)
    cfg = SchedulerConfig(max_batch_ops=1)
    gate.set()
    async with TransferScheduler(group, executor=ex, config=cfg) as sched:
        first = await sched.backup({"kv": pages(0, page_size=4)})
        await first
        gate.clear()
        blocker = await sched.backup({"kv": pages(1, page_size=4)})
        await wait_until(lambda: len(ex.history) == 2)  # in flight, held
        later = [await sched.backup({"kv": pages(2 + i, page_size=4)}) for i in range(3)]
        load = await sched.load(first.host_indices, {"kv": pages(10, page_size=4)})
        gate.set()
        for h in (blocker, *later, load):
            await h
    order = [ids[0] for _, ids in ex.history]
    assert order == [first.id, blocker.id, load.id, *(h.id for h in later)]


async def test_byte_budget_splits_a_burst() -> None:
    group = full_attention_group(device_slots=64, host_slots=256)
    one_page = 4 * group["kv"].slot_nbytes
    cfg = SchedulerConfig(max_batch_bytes=3 * one_page)
    ex = FaultInjectingExecutor(delay_s=0.005)
    async with TransferScheduler(group, executor=ex, config=cfg) as sched:
        hs = [sched.backup_nowait({"kv": pages(p, page_size=4)}) for p in range(12)]
        for h in hs:
            await h
    sizes = [len(ids) for _, ids in ex.history]
    assert sum(sizes) == 12
    assert max(sizes) == 3


async def test_priority_orders_a_lane(gate: threading.Event) -> None:
    group = full_attention_group()
    ex = FaultInjectingExecutor(hold=gate)
    async with TransferScheduler(group, executor=ex, config=SchedulerConfig(max_batch_ops=1)) as sched:
        blocker = await sched.backup({"kv": pages(0, page_size=4)})
        await wait_until(lambda: len(ex.history) == 1)
        low = await sched.backup({"kv": pages(1, page_size=4)}, priority=0)
        high = await sched.backup({"kv": pages(2, page_size=4)}, priority=5)
        mid = await sched.backup({"kv": pages(3, page_size=4)}, priority=1)
        gate.set()
        for h in (blocker, low, high, mid):
            await h
    assert [ids[0] for _, ids in ex.history] == [blocker.id, high.id, mid.id, low.id]


async def test_exhaustion_rolls_back_every_pool(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier")  # allocation.rolled_back is an info event
    group = hybrid_group(state_slots=4)  # 8 host state slots
    async with TransferScheduler(group) as sched:
        held = [await sched.backup({"state": torch.tensor([i % 4])}) for i in range(8)]
        for h in held:
            await h
        before = used(group)
        with capture_logs() as logs, pytest.raises(PoolExhausted) as info:
            await sched.backup(hybrid_request(0) | {"state": torch.tensor([0])})
        assert info.value.pool == "state" and info.value.needed == 1 and info.value.free == 0
        assert "pool 'state'" in str(info.value) and "needed 1, free 0" in str(info.value)
        # kv, swa and tok sort before state: they were taken, then freed again.
        assert used(group) == before
        assert sched.statistics().rollbacks == 1
        assert any(e["event"] == "allocation.rolled_back" for e in logs)


async def test_reclaim_hook_frees_space_and_allocation_is_retried_once() -> None:
    group = full_attention_group(host_slots=8)  # two pages
    calls: list[tuple[str, str, int]] = []
    held: list = []

    async def reclaim(pool: str, tier: str, slots_needed: int) -> None:
        calls.append((pool, tier, slots_needed))
        if held:
            sched.free_host(held.pop(0).host_indices)

    async with TransferScheduler(group, reclaim=reclaim) as sched:
        for p in range(2):
            h = await sched.backup({"kv": pages(p, page_size=4)})
            await h
            held.append(h)
        third = await sched.backup({"kv": pages(2, page_size=4)})
        await third
        assert calls == [("kv", "host", 4)]
        # Nothing left to reclaim: the retry fails and nothing stays taken.
        held.clear()
        before = used(group)
        with pytest.raises(PoolExhausted):
            await sched.backup({"kv": pages(3, 4, page_size=4)})
        assert len(calls) == 2
        assert used(group) == before


async def test_failed_copy_fails_only_its_batch_and_frees_its_slots() -> None:
    group = full_attention_group()
    ex = FaultInjectingExecutor(fail_batches={1}, fail_at_layer=2)
    async with TransferScheduler(group, executor=ex) as sched:
        ok = await sched.backup({"kv": pages(0, page_size=4)})
        await ok
        before = used(group)
        with capture_logs() as logs:
            bad = await sched.backup({"kv": pages(1, page_size=4)})
            with pytest.raises(TransferFailed) as info:
                await bad
        assert isinstance(info.value.__cause__, InjectedFault)
        assert info.value.operation_ids == (bad.id,)
        assert used(group) == before
        assert any(e["event"] == "operation.failed" for e in logs)
        # The scheduler goes on serving; awaiting again gives the same error.
        after = await sched.backup({"kv": pages(2, page_size=4)})
        await after
        with pytest.raises(TransferFailed):
            await bad
        s = sched.statistics().backup
        assert (s.completed, s.failed) == (2, 1)


async def test_failed_load_frees_the_device_slots_kvtier_allocated() -> None:
    group = full_attention_group(device_allocator=True, device_slots=32)
    ex = FaultInjectingExecutor(fail_batches={1})
    alloc = group["kv"].device_allocator
    async with TransferScheduler(group, executor=ex) as sched:
        b = await sched.backup({"kv": pages(0, page_size=4)})
        await b
        free_before = alloc.num_free_slots
        load = await sched.load(b.host_indices)
        assert alloc.num_free_slots == free_before - 4
        with pytest.raises(TransferFailed):
            await load
        assert alloc.num_free_slots == free_before
        ok = await sched.load(b.host_indices)
        await ok
        got = ok.device_indices["kv"]
        assert alloc.num_free_slots == free_before - 4  # now the caller's
        assert_rows_equal(rows(group, "kv", got), rows(group, "kv", pages(0, page_size=4)))


async def test_cancel_queued_leaves_no_trace(gate: threading.Event) -> None:
    group = full_attention_group()
    ex = FaultInjectingExecutor(hold=gate)
    async with TransferScheduler(group, executor=ex) as sched:
        first = await sched.backup({"kv": pages(0, page_size=4)})
        await wait_until(lambda: len(ex.history) == 1)
        before = used(group)
        queued = await sched.backup({"kv": pages(1, page_size=4)})
        assert used(group)["kv"] == before["kv"] + 4
        assert queued.cancel() is True
        assert used(group) == before
        assert sched.statistics().backup.queue_depth == 0
        with pytest.raises(OperationCancelled):
            await queued
        gate.set()
        await first
    assert [ids for _, ids in ex.history] == [(first.id,)]
    assert queued.cancel() is False


async def test_cancel_in_flight_releases_after_the_copies(gate: threading.Event) -> None:
    group = full_attention_group()
    ex = FaultInjectingExecutor(hold=gate)
    async with TransferScheduler(group, executor=ex) as sched:
        before = used(group)
        h = await sched.backup({"kv": pages(0, page_size=4)})
        await wait_until(ex.started.is_set)
        assert h.cancel() is True
        await anyio.sleep(0.01)
        assert used(group)["kv"] == before["kv"] + 4  # copies still own the slots
        gate.set()
        with pytest.raises(OperationCancelled):
            await h
        assert used(group) == before
        assert sched.statistics().backup.cancelled == 1


async def test_cancelled_submission_waiting_for_room_rolls_back(gate: threading.Event) -> None:
    group = full_attention_group()
    ex = FaultInjectingExecutor(hold=gate)
    async with TransferScheduler(group, executor=ex, config=SchedulerConfig(max_queued_ops=1)) as sched:
        a = await sched.backup({"kv": pages(0, page_size=4)})
        await wait_until(lambda: len(ex.history) == 1)
        b = await sched.backup({"kv": pages(1, page_size=4)})  # fills the lane
        before = used(group)
        with pytest.raises(anyio.WouldBlock):
            sched.backup_nowait({"kv": pages(2, page_size=4)})
        assert used(group) == before
        with anyio.move_on_after(0.05) as scope:
            await sched.backup({"kv": pages(2, page_size=4)})
        assert scope.cancelled_caught
        assert used(group) == before
        gate.set()
        await a
        await b


async def test_drain_on_close_completes_queued_work() -> None:
    group = full_attention_group(host_slots=256)
    ex = FaultInjectingExecutor(delay_s=0.005)
    async with TransferScheduler(group, executor=ex, config=SchedulerConfig(max_batch_ops=2)) as sched:
        hs = [sched.backup_nowait({"kv": pages(p, page_size=4)}) for p in range(10)]
    assert all(h.done() for h in hs)
    for h in hs:
        await h
    with pytest.raises(SchedulerClosed):
        await sched.backup({"kv": pages(0, page_size=4)})
    with pytest.raises(SchedulerClosed):
        sched.backup_nowait({"kv": pages(0, page_size=4)})


async def test_cancel_on_close_fails_queued_work_with_scheduler_closed(gate: threading.Event) -> None:
    group = full_attention_group(host_slots=256)
    ex = FaultInjectingExecutor(hold=gate)
    cfg = SchedulerConfig(on_close="cancel", max_batch_ops=1)
    before = used(group)
    async with TransferScheduler(group, executor=ex, config=cfg) as sched:
        first = sched.backup_nowait({"kv": pages(0, page_size=4)})
        await wait_until(lambda: len(ex.history) == 1)
        rest = [sched.backup_nowait({"kv": pages(p, page_size=4)}) for p in range(1, 5)]
        gate.set()
    await first
    for h in rest:
        with pytest.raises(SchedulerClosed):
            await h
    assert used(group)["kv"] == before["kv"] + 4


async def test_load_waits_for_the_backup_writing_its_pages(gate: threading.Event) -> None:
    group = full_attention_group()
    ex = FaultInjectingExecutor(hold=gate)
    async with TransferScheduler(group, executor=ex) as sched:
        src = pages(3, page_size=4)
        expected = rows(group, "kv", src)
        b = await sched.backup({"kv": src})
        await wait_until(ex.started.is_set)
        loaded = []

        async def load() -> None:
            h = await sched.load(b.host_indices, {"kv": pages(9, page_size=4)})
            await h
            loaded.append(h)

        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            await anyio.sleep(0.02)
            assert sched.statistics().load.submitted == 0  # still waiting for the backup
            gate.set()
        assert_rows_equal(rows(group, "kv", pages(9, page_size=4)), expected)


async def test_load_of_a_failed_backups_pages_raises(gate: threading.Event) -> None:
    group = full_attention_group()
    ex = FaultInjectingExecutor(hold=gate, fail_batches={0})
    async with TransferScheduler(group, executor=ex) as sched:
        b = await sched.backup({"kv": pages(0, page_size=4)})
        await wait_until(ex.started.is_set)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                async def release() -> None:
                    await anyio.sleep(0.02)
                    gate.set()
                tg.start_soon(release)
                with pytest.raises(TransferFailed, match="did not complete"):
                    await sched.load(b.host_indices, {"kv": pages(5, page_size=4)})
        assert used(group)["kv"] == 0


async def test_free_host_is_deferred_while_a_load_reads(gate: threading.Event) -> None:
    group = full_attention_group()
    ex = FaultInjectingExecutor()
    async with TransferScheduler(group, executor=ex) as sched:
        b = await sched.backup({"kv": pages(0, 1, page_size=4)})
        await b
        ex.hold = gate
        gate.clear()
        ex.started.clear()
        load = await sched.load(b.host_indices, {"kv": pages(6, 7, page_size=4)})
        await wait_until(ex.started.is_set)
        sched.free_host(b.host_indices)
        assert used(group)["kv"] == 8  # still read by the load
        assert sched.statistics().deferred_host_frees == 2
        with pytest.raises(InvalidIndices, match="not held"):
            sched.free_host(b.host_indices)  # a second free is refused
        gate.set()
        await load
        assert used(group)["kv"] == 0
        assert sched.statistics().deferred_host_frees == 0
        with pytest.raises(InvalidIndices, match="not allocated"):
            await sched.load(b.host_indices, {"kv": pages(6, 7, page_size=4)})


async def test_free_host_during_a_backup_is_applied_when_it_ends(gate: threading.Event) -> None:
    group = full_attention_group()
    ex = FaultInjectingExecutor(hold=gate)
    async with TransferScheduler(group, executor=ex) as sched:
        b = await sched.backup({"kv": pages(0, page_size=4)})
        await wait_until(ex.started.is_set)
        sched.free_host(b.host_indices)
        assert used(group)["kv"] == 4
        gate.set()
        await b
        assert used(group)["kv"] == 0


async def test_free_host_of_a_failed_backup_frees_once(gate: threading.Event) -> None:
    group = full_attention_group()
    ex = FaultInjectingExecutor(hold=gate, fail_batches={0})
    async with TransferScheduler(group, executor=ex) as sched:
        b = await sched.backup({"kv": pages(0, page_size=4)})
        await wait_until(ex.started.is_set)
        sched.free_host(b.host_indices)
        gate.set()
        with pytest.raises(TransferFailed):
            await b
        assert used(group)["kv"] == 0
        s = group["kv"].host.allocator.statistics()
        assert s.frees == 1


async def test_layer_ready_resolves_layer_by_layer() -> None:
    group = full_attention_group(layers=3)
    gates = [threading.Event() for _ in range(3)]

    class SteppedExecutor:
        max_in_flight = 1

        async def execute(self, batch, progress) -> None:
            def run() -> None:
                plan = batch.plan()
                for layer in range(plan.num_layers):
                    # Bounded: a gate never released fails the batch, not the suite.
                    if not gates[layer].wait(30):
                        raise RuntimeError(f"layer {layer}'s gate was never released")
                    for src, dst, p in plan.layer_copies(layer):
                        from kvtier.transfers import apply_copy_plan
                        apply_copy_plan(p, src, dst)
                    progress.layer_done(layer)

            await anyio.to_thread.run_sync(run)

    async with TransferScheduler(group, executor=SteppedExecutor()) as sched:
        try:
            for g in gates:
                g.set()
            b = await sched.backup({"kv": pages(0, page_size=4)})
            await b
            for g in gates:
                g.clear()
            expected = rows(group, "kv", pages(0, page_size=4))
            wipe(group)
            dst = pages(2, page_size=4)
            load = await sched.load(b.host_indices, {"kv": dst})
            ready: list[int] = []

            async def watch(i: int) -> None:
                await load.layer_ready(i)
                ready.append(i)

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(watch, i)
                await anyio.sleep(0.02)
                assert ready == []
                gates[0].set()
                await wait_until(lambda: ready == [0])
                kv0 = group["kv"].device.tensor(0, 0)
                assert torch.equal(kv0[dst], expected[0])
                assert not load.done()
                await anyio.sleep(0.02)
                assert ready == [0]
                gates[1].set()
                gates[2].set()
        finally:
            # Released before the scheduler waits for its copies: a failure above
            # fails the test instead of holding the executor's thread forever.
            for g in gates:
                g.set()
        assert sorted(ready) == [0, 1, 2]
        await load
        await load.layer_ready(2)  # after completion it returns at once
        with pytest.raises(InvalidIndices, match="layer 3 is out of range"):
            await load.layer_ready(3)


async def test_layer_ready_raises_when_the_operation_failed() -> None:
    group = full_attention_group()
    ex = FaultInjectingExecutor(fail_batches={1}, fail_at_layer=1)
    async with TransferScheduler(group, executor=ex) as sched:
        b = await sched.backup({"kv": pages(0, page_size=4)})
        await b
        load = await sched.load(b.host_indices, {"kv": pages(4, page_size=4)})
        with pytest.raises(TransferFailed):
            await load.layer_ready(3)


@pytest.mark.parametrize(
    ("indices", "error", "match"),
    [
        ({}, InvalidIndices, "at least one pool"),
        ({"nope": torch.arange(4)}, InvalidIndices, "unknown pool 'nope'"),
        ({"c4": torch.arange(2)}, InvalidIndices, "sidecar of 'kv'"),
        ({"kv": torch.arange(2, 10)}, InvalidIndices, "whole pages of 8 slots starting on a page boundary"),
        ({"kv": torch.arange(12)}, InvalidIndices, "whole pages of 8 slots"),
        ({"kv": torch.arange(8).float()}, InvalidIndices, "integer tensor; got dtype torch.float32"),
        ({"kv": torch.cat([torch.arange(8), torch.arange(8)])}, InvalidIndices, "repeat page 0"),
        ({"kv": torch.arange(64, 72)}, InvalidIndices, "has 64 device slots"),
        ({"state": torch.tensor([16])}, InvalidIndices, "has 16 device slots"),
    ],
)
async def test_bad_backup_input_changes_nothing(indices, error, match) -> None:
    group = hybrid_group()
    async with TransferScheduler(group) as sched:
        before = group.statistics()
        with pytest.raises(error, match=match):
            await sched.backup(indices)
        with pytest.raises(error, match=match):
            sched.backup_nowait(indices)
        assert group.statistics() == before
        assert sched.statistics().backup.submitted == 0


async def test_bad_load_input_changes_nothing() -> None:
    group = full_attention_group()
    async with TransferScheduler(group) as sched:
        b = await sched.backup({"kv": pages(0, 1, page_size=4)})
        await b
        before = group.statistics()
        host = b.host_indices["kv"]
        with pytest.raises(InvalidIndices, match="8 host indices and 4 device indices"):
            await sched.load({"kv": host}, {"kv": pages(3, page_size=4)})
        with pytest.raises(InvalidIndices, match="no device allocator"):
            await sched.load({"kv": host})
        with pytest.raises(InvalidIndices, match="host page 5 is not allocated"):
            await sched.load({"kv": pages(5, page_size=4)}, {"kv": pages(3, page_size=4)})
        assert group.statistics() == before
        assert sched.statistics().load.submitted == 0


async def test_statistics_and_repr_read_as_status() -> None:
    group = full_attention_group()
    async with TransferScheduler(group) as sched:
        await (await sched.backup({"kv": pages(0, page_size=4)}))
        s = sched.statistics()
        assert s.backup.submitted == s.backup.completed == 1
        assert s.backup.bytes == 4 * group["kv"].slot_nbytes
        assert s.pools["kv"].used_slots == 4
        assert "done: 0 load, 1 backup" in repr(sched)
        assert repr(group["kv"].host) == "<HostPool 'kv' [pages: 1 used, 31 free | page_size=4, layer_first]>"


async def test_a_scheduler_is_not_usable_before_entering_or_twice() -> None:
    group = full_attention_group()
    sched = TransferScheduler(group)
    with pytest.raises(RuntimeError, match="not running"):
        await sched.backup({"kv": pages(0, page_size=4)})
    async with sched:
        pass
    with pytest.raises(RuntimeError, match="runs once"):
        async with sched:
            pass
