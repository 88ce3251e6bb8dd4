"""`backup_many` / `load_many`: many operations in one call, each with its own
result or failure, admitted all or nothing."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from conftest import pages, rows, used, wipe
from kvtier import InvalidIndices, PoolExhausted, SchedulerConfig, TransferFailed, TransferScheduler
from kvtier.testing import FaultInjectingExecutor, full_attention_group, hybrid_group

PS = 4


async def test_many_backups_and_loads_round_trip_each_request_byte_exact() -> None:
    group = hybrid_group(device_allocator=True)
    ps = group["kv"].page_size
    requests = [{"kv": pages(i, page_size=ps), "swa": pages(i + 1, page_size=ps)} for i in range(0, 6, 2)]
    want = [{p: rows(group, p, idx) for p, idx in r.items()} for r in requests]
    want_c4 = [rows(group, "c4", torch.arange(i * ps // 4, (i + 1) * ps // 4)) for i in range(0, 6, 2)]
    async with TransferScheduler(group) as sched:
        backups = await sched.backup_many(requests)
        assert len(backups) == len(requests) and len({b.id for b in backups}) == len(backups)
        results = [await b for b in backups]
        assert all(r.nbytes == b.nbytes for r, b in zip(results, backups))
        hosts = [b.host_indices for b in backups]
        seen = [int(x) for h in hosts for x in h["kv"]]
        assert len(seen) == len(set(seen))  # every request got its own host pages
        wipe(group)
        loads = await sched.load_many(hosts)
        for load, w, wc in zip(loads, want, want_c4):
            await load
            dev = load.device_indices
            for pool in ("kv", "swa"):
                assert all(torch.equal(a, b) for a, b in zip(rows(group, pool, dev[pool]), w[pool], strict=True))
            assert all(torch.equal(a, b) for a, b in zip(rows(group, "c4", dev["c4"]), wc, strict=True))
        for load, host in zip(loads, hosts):
            sched.free_host(host)
            for pool in ("kv", "swa"):
                group[pool].device.allocator.free(load.device_indices[pool])
        stats = sched.statistics()
        assert stats.backup.completed == stats.load.completed == len(requests)
        assert stats.backup.batches < len(requests)  # they went together
    assert used(group)["kv"] == 0 and used(group)["swa"] == 0


@pytest.mark.parametrize("which", ["backup_many", "load_many"])
async def test_a_bad_request_names_its_place_and_nothing_is_taken(which: str) -> None:
    group = full_attention_group(page_size=PS, device_allocator=True)
    async with TransferScheduler(group) as sched:
        held = await sched.backup_many([{"kv": pages(0, page_size=PS)}, {"kv": pages(1, page_size=PS)}])
        for h in held:
            await h
        before = used(group)
        dev_before = group["kv"].device.allocator.num_free_slots
        with pytest.raises(InvalidIndices) as err:
            if which == "backup_many":
                await sched.backup_many([{"kv": pages(2, page_size=PS)}, {"kv": torch.tensor([1, 2])}])
            else:
                await sched.load_many([held[0].host_indices, {"kv": pages(30, page_size=PS)}])
        assert str(err.value).startswith("request 1: ") and err.value.pool == "kv"
        assert used(group) == before and group["kv"].device.allocator.num_free_slots == dev_before
        stats = sched.statistics()
        assert stats.backup.submitted == 2 and stats.load.submitted == 0
        for h in held:
            sched.free_host(h.host_indices)


async def test_a_short_pool_or_too_many_requests_take_nothing() -> None:
    group = full_attention_group(page_size=PS, host_slots=8 * PS)
    config = SchedulerConfig(max_queued_ops=4)
    async with TransferScheduler(group, config=config) as sched:
        with pytest.raises(PoolExhausted):
            await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(9)])
        assert used(group)["kv"] == 0
        with pytest.raises(ValueError, match="exceed the backup lane's bound of 4"):
            await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(5)])
        assert used(group)["kv"] == 0 and sched.statistics().backup.submitted == 0
        assert await sched.backup_many([]) == []


async def test_a_failed_batch_fails_exactly_the_requests_it_carried() -> None:
    ex = FaultInjectingExecutor(fail_batches={0})
    group = full_attention_group(page_size=PS)
    config = SchedulerConfig(max_batch_ops=3)
    async with TransferScheduler(group, executor=ex, config=config) as sched:
        handles = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(6)])
        outcomes = []
        for h in handles:
            try:
                await h
                outcomes.append("ok")
            except TransferFailed:
                outcomes.append("failed")
        assert outcomes == ["failed"] * 3 + ["ok"] * 3
        for h in handles[3:]:
            sched.free_host(h.host_indices)
    assert used(group)["kv"] == 0  # the failed requests gave their host pages back


async def test_a_bulk_call_waits_for_room_for_all_in_turn_and_a_cancelled_one_gives_everything_back() -> None:
    hold = threading.Event()
    ex = FaultInjectingExecutor(hold=hold, hold_timeout_s=10)
    group = full_attention_group(page_size=PS)
    config = SchedulerConfig(max_queued_ops=4, max_batch_ops=1)
    order: list[str] = []
    try:
        async with TransferScheduler(group, executor=ex, config=config) as sched:
            first = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(4)])
            # One batch of one is held in flight, three stay queued: one place free.

            async def bulk() -> None:
                got = await sched.backup_many([{"kv": pages(10 + i, page_size=PS)} for i in range(3)])
                order.append("bulk")
                for h in got:
                    await h
                    sched.free_host(h.host_indices)

            async def single() -> None:
                h = await sched.backup({"kv": pages(13, page_size=PS)})
                order.append("single")
                await h
                sched.free_host(h.host_indices)

            async with anyio.create_task_group() as tg:
                tg.start_soon(bulk)
                await anyio.sleep(0.02)
                tg.start_soon(single)  # room for one now, but the bulk call is first in line
                await anyio.sleep(0.02)
                assert order == []
                # A bulk call cancelled while it waits gives its host pages back.
                with anyio.move_on_after(0.02):
                    await sched.backup_many([{"kv": pages(14, page_size=PS)}])
                hold.set()
            assert order == ["bulk", "single"]
            for h in first:
                await h
                sched.free_host(h.host_indices)
    finally:
        hold.set()
    assert used(group)["kv"] == 0


async def test_load_many_waits_for_the_backups_still_writing_its_pages() -> None:
    hold = threading.Event()
    ex = FaultInjectingExecutor(hold=hold, hold_timeout_s=10)
    group = full_attention_group(page_size=PS)
    src = [pages(i, page_size=PS) for i in range(3)]
    want = [rows(group, "kv", s) for s in src]
    dst = [pages(8 + i, page_size=PS) for i in range(3)]
    try:
        async with TransferScheduler(group, executor=ex) as sched:
            backups = await sched.backup_many([{"kv": s} for s in src])
            with anyio.fail_after(5):
                async with anyio.create_task_group() as tg:
                    got: list = []

                    async def load() -> None:
                        got.extend(await sched.load_many([b.host_indices for b in backups], [{"kv": d} for d in dst]))

                    tg.start_soon(load)
                    await anyio.sleep(0.02)
                    assert got == []  # waiting for the backups
                    hold.set()
            for load, w, d in zip(got, want, dst):
                await load
                assert all(torch.equal(a, b) for a, b in zip(rows(group, "kv", d), w, strict=True))
            for b in backups:
                sched.free_host(b.host_indices)
    finally:
        hold.set()
    assert used(group)["kv"] == 0


async def test_a_bulk_call_waiting_for_room_when_the_scheduler_closes_gives_everything_back() -> None:
    hold = threading.Event()
    ex = FaultInjectingExecutor(hold=hold, hold_timeout_s=10)
    group = full_attention_group(page_size=PS)
    config = SchedulerConfig(max_queued_ops=2, max_batch_ops=1, on_close="cancel")
    outcome: dict[str, BaseException] = {}

    async def bulk(sched: TransferScheduler) -> None:
        try:
            await sched.backup_many([{"kv": pages(5 + i, page_size=PS)} for i in range(2)])
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcome["bulk"] = exc

    try:
        async with anyio.create_task_group() as tg:
            async with TransferScheduler(group, executor=ex, config=config) as sched:
                first = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(2)])
                await anyio.sleep(0.02)  # one held in flight, one queued: room for one
                tg.start_soon(bulk, sched)
                await anyio.sleep(0.02)
                assert used(group)["kv"] == 4 * PS  # the bulk call's pages are reserved while it waits
                hold.set()
            # Leaving `async with` (on_close="cancel") refused the waiting bulk call.
    finally:
        hold.set()
    assert type(outcome["bulk"]).__name__ == "SchedulerClosed"
    for h in first:
        if h.exception() is None:
            sched.free_host(h.host_indices)
    assert used(group)["kv"] == 0


async def test_load_many_refuses_when_a_backup_it_waits_for_fails_and_pins_nothing() -> None:
    hold = threading.Event()
    ex = FaultInjectingExecutor(hold=hold, hold_timeout_s=10, fail_batches={1})
    group = full_attention_group(page_size=PS)
    try:
        async with TransferScheduler(group, executor=ex) as sched:
            hold.set()
            ok = await sched.backup({"kv": pages(3, page_size=PS)})
            await ok  # batch 0: completes
            hold.clear()
            doomed = await sched.backup({"kv": pages(0, page_size=PS)})  # batch 1: held, then fails
            with anyio.fail_after(5):
                async with anyio.create_task_group() as tg:
                    got: dict[str, BaseException] = {}

                    async def load() -> None:
                        try:
                            await sched.load_many([doomed.host_indices, ok.host_indices],
                                                  [{"kv": pages(8, page_size=PS)}, {"kv": pages(9, page_size=PS)}])
                        except TransferFailed as exc:
                            got["error"] = exc

                    tg.start_soon(load)
                    await anyio.sleep(0.02)
                    hold.set()
            assert "error" in got
            with pytest.raises(TransferFailed):
                await doomed
            await ok
            assert sched.statistics().load.submitted == 0
            sched.free_host(ok.host_indices)  # not pinned: freed at once, not deferred
            assert sched.statistics().deferred_host_frees == 0
    finally:
        hold.set()
    assert used(group)["kv"] == 0
