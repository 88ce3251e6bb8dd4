"""`backup_many` / `load_many`: many operations in one call, each with its own
result or failure, admitted all or nothing."""

from __future__ import annotations

import itertools
import threading

import anyio
import anyio.lowlevel
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import pages, rows, used, wait_until, wipe
from kvtier import (
    InvalidIndices,
    OperationCancelled,
    PoolExhausted,
    SchedulerConfig,
    TransferFailed,
    TransferScheduler,
)
from kvtier.scheduler.admission import Admission
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
        with pytest.raises(PoolExhausted):  # 12 pages of 8
            await sched.backup_many([{"kv": pages(3 * i, 3 * i + 1, 3 * i + 2, page_size=PS)} for i in range(4)])
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


# -- requests carried together (kvtier.scheduler.carriers) ----------------------------------


async def test_a_request_cancelled_while_queued_gives_its_pages_back_at_once_and_they_are_not_written(
    gate: threading.Event,
) -> None:
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group, executor=ex) as sched:
        blocker = await sched.backup({"kv": pages(7, page_size=PS)})  # held in flight
        await wait_until(lambda: len(ex.history) == 1)
        bulk = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(3)])
        assert [h.state for h in bulk] == ["queued"] * 3
        victim = bulk[1]
        victim_host = victim.host_indices["kv"]
        assert victim.cancel() is True and victim.done()
        with pytest.raises(OperationCancelled):
            await victim
        assert used(group)["kv"] == 3 * PS  # the blocker's page and two of the bulk call's
        # The page is free now: whatever lands in it later is not the bulk call's.
        host = group["kv"].host
        views = [host.layer_view(j, p) for j in range(host.num_layers) for p in range(len(host.planes))]
        for v in views:
            v[victim_host] = 7
        gate.set()
        for h in (blocker, bulk[0], bulk[2]):
            await h
        assert ex.history[1][1] == (bulk[0].id, bulk[2].id)  # the carrier copied the two left
        assert all(bool((v[victim_host] == 7).all()) for v in views)
        for i in (0, 2):  # and those two byte-exact
            check = await sched.load(bulk[i].host_indices, {"kv": pages(12, page_size=PS)})
            await check
            want = rows(group, "kv", pages(i, page_size=PS))
            assert all(torch.equal(a, b) for a, b in zip(rows(group, "kv", pages(12, page_size=PS)), want, strict=True))
        for h in (blocker, bulk[0], bulk[2]):
            sched.free_host(h.host_indices)
        stats = sched.statistics().backup
        assert (stats.submitted, stats.completed, stats.cancelled) == (4, 3, 1)
    assert used(group)["kv"] == 0


async def test_cancelling_every_request_of_a_queued_carrier_leaves_the_lane_empty(gate: threading.Event) -> None:
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS)
    config = SchedulerConfig(max_queued_ops=3, max_batch_ops=1)
    async with TransferScheduler(group, executor=ex, config=config) as sched:
        blocker = await sched.backup({"kv": pages(7, page_size=PS)})
        await wait_until(lambda: len(ex.history) == 1)
        bulk = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(3)])
        with pytest.raises(anyio.WouldBlock):
            sched.backup_nowait({"kv": pages(5, page_size=PS)})  # three requests fill the bound
        assert bulk[0].cancel() and bulk[2].cancel()
        assert sched.statistics().backup.queue_depth == 1
        late = sched.backup_nowait({"kv": pages(5, page_size=PS)})  # a cancelled request's place is free
        assert bulk[1].cancel()
        assert sched.statistics().backup.queue_depth == 1 and used(group)["kv"] == 2 * PS
        gate.set()
        for h in (blocker, late):
            await h
            sched.free_host(h.host_indices)
        assert [h.exception().__class__ for h in bulk] == [OperationCancelled] * 3
        assert all(bulk[1].id not in ids for _, ids in ex.history)
    assert used(group)["kv"] == 0


async def test_a_request_cancelled_while_its_carrier_runs_ends_cancelled_after_the_copy(gate: threading.Event) -> None:
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group, executor=ex) as sched:
        bulk = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(2)])
        await wait_until(lambda: len(ex.history) == 1)
        assert [h.state for h in bulk] == ["running"] * 2
        assert bulk[0].cancel() is True and not bulk[0].done()
        gate.set()
        with pytest.raises(OperationCancelled):
            await bulk[0]
        await bulk[1]
        assert bulk[0].cancel() is False
        sched.free_host(bulk[1].host_indices)
    assert used(group)["kv"] == 0  # the cancelled request's page went back


async def test_verify_mode_fails_only_the_request_whose_host_pages_changed() -> None:
    from kvtier import CorruptionDetected

    group = full_attention_group(page_size=PS, device_allocator=True)
    src = [pages(i, page_size=PS) for i in range(3)]
    want = [rows(group, "kv", s) for s in src]
    async with TransferScheduler(group, config=SchedulerConfig(verify=True)) as sched:
        backups = await sched.backup_many([{"kv": s} for s in src])
        for b in backups:
            await b
        hosts = [b.host_indices for b in backups]
        group["kv"].host.layer_view(0, 0)[hosts[1]["kv"][0]] += 1  # request 1's host copy changed
        wipe(group)
        loads = await sched.load_many(hosts)
        with pytest.raises(CorruptionDetected):
            await loads[1]
        for i in (0, 2):
            await loads[i]
            dev = loads[i].device_indices["kv"]
            assert all(torch.equal(a, b) for a, b in zip(rows(group, "kv", dev), want[i], strict=True))
            group["kv"].device.allocator.free(dev)
        for h in hosts:
            sched.free_host(h)
        assert sched.statistics().load.failed == 1
    assert group["kv"].device.allocator.num_free_slots == group["kv"].device_slots  # request 1's slots too


async def test_requests_split_into_carriers_by_the_batch_budget_and_count_one_by_one() -> None:
    group = full_attention_group(page_size=PS)
    page_nbytes = PS * group["kv"].slot_nbytes
    ex = FaultInjectingExecutor()
    config = SchedulerConfig(max_batch_bytes=3 * page_nbytes, max_batch_ops=64)
    async with TransferScheduler(group, executor=ex, config=config) as sched:
        src = [pages(i, page_size=PS) for i in range(7)]
        want = [rows(group, "kv", s) for s in src]
        handles = await sched.backup_many([{"kv": s} for s in src])
        results = [await h for h in handles]
        assert [r.nbytes for r in results] == [page_nbytes] * 7
        assert [len(ids) for _, ids in ex.history] == [3, 3, 1]
        assert [i for _, ids in ex.history for i in ids] == [h.id for h in handles]
        stats = sched.statistics().backup
        assert (stats.submitted, stats.completed, stats.batches, stats.operations_batched) == (7, 7, 3, 7)
        assert stats.latency.total.count == 7
        wipe(group)
        dst = [pages(8 + i, page_size=PS) for i in range(7)]
        loads = await sched.load_many([h.host_indices for h in handles], [{"kv": d} for d in dst])
        for load, d, w in zip(loads, dst, want):
            await load
            assert all(torch.equal(a, b) for a, b in zip(rows(group, "kv", d), w, strict=True))
        assert [len(ids) for direction, ids in ex.history if direction == "load"] == [3, 3, 1]
        for h in handles:
            sched.free_host(h.host_indices)


async def test_load_many_mixes_requests_that_give_device_pages_with_ones_kvtier_allocates() -> None:
    group = hybrid_group(device_allocator=True)
    ps = group["kv"].page_size
    src = [{"kv": pages(i, page_size=ps), "swa": pages(i, page_size=ps)} for i in range(3)]
    want = [{p: rows(group, p, idx) for p, idx in r.items()} for r in src]
    async with TransferScheduler(group) as sched:
        backups = await sched.backup_many(src)
        for b in backups:
            await b
        wipe(group)
        given = group["kv"].device.allocator.try_alloc(ps)
        assert given is not None
        devices = [None, {"kv": given}, {}]
        loads = await sched.load_many([b.host_indices for b in backups], devices)
        for load, w in zip(loads, want):
            await load
            dev = load.device_indices
            for pool in ("kv", "swa"):
                assert all(torch.equal(a, b) for a, b in zip(rows(group, pool, dev[pool]), w[pool], strict=True))
        assert torch.equal(loads[1].device_indices["kv"], given)
        for load, b in zip(loads, backups):
            sched.free_host(b.host_indices)
            for pool in ("kv", "swa"):
                group[pool].device.allocator.free(load.device_indices[pool])
    assert used(group)["kv"] == 0


async def test_a_load_waiting_on_a_bulk_backup_learns_its_own_requests_outcome(gate: threading.Event) -> None:
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group, executor=ex) as sched:
        bulk = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(2)])
        await wait_until(lambda: len(ex.history) == 1)
        bulk[0].cancel()  # running: ends cancelled after the copy
        got: dict[str, object] = {}

        async def load(i: int) -> None:
            try:
                got[str(i)] = await sched.load(bulk[i].host_indices, {"kv": pages(10 + i, page_size=PS)})
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                got[str(i)] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(load, 0)
            tg.start_soon(load, 1)
            await anyio.sleep(0.02)
            assert got == {}  # both wait for their writers
            gate.set()
        assert isinstance(got["0"], TransferFailed) and "did not complete" in str(got["0"])
        await got["1"]  # type: ignore[misc]
        sched.free_host(bulk[1].host_indices)
    assert used(group)["kv"] == 0


async def test_a_load_waiting_on_an_array_backup_without_handles_learns_its_own_requests_outcome(
    gate: threading.Event,
) -> None:
    # backup_arrays makes no handle per request: its carrier writes the pages, by request
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group, executor=ex) as sched:
        device = torch.stack([pages(0, page_size=PS), pages(1, page_size=PS)])
        host = torch.stack([pages(5, page_size=PS), pages(6, page_size=PS)])  # named, so the loads can name them
        bulk = await sched.backup_arrays({"kv": device}, host_indices={"kv": host})
        assert bulk._handles is None  # none made
        await wait_until(lambda: len(ex.history) == 1)
        assert bulk.cancel([0]) == 1  # running: ends cancelled after the copy
        got: dict[str, object] = {}

        async def load(i: int) -> None:
            try:
                got[str(i)] = await sched.load({"kv": host[i]}, {"kv": pages(10 + i, page_size=PS)})
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                got[str(i)] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(load, 0)
            tg.start_soon(load, 1)
            await anyio.sleep(0.02)
            assert got == {}  # both wait for their writers
            gate.set()
        assert isinstance(got["0"], TransferFailed) and "did not complete" in str(got["0"])
        await got["1"]  # type: ignore[misc]
        result = await bulk
        assert result.ok.tolist() == [False, True]  # request 0 cancelled, request 1 done
        sched.free_host({"kv": host[1]})
    assert used(group)["kv"] == 0


@settings(max_examples=300, deadline=None)
@given(
    page_size=st.sampled_from([1, 4]),
    requests=st.lists(st.lists(st.integers(-2, 70), min_size=0, max_size=12), min_size=1, max_size=6),
    whole_pages=st.booleans(),
)
def test_the_vectorised_check_of_many_requests_agrees_with_checking_each(
    page_size: int, requests: list[list[int]], whole_pages: bool
) -> None:
    """`Admission.bulk_pages` checks many requests at once; it must accept
    exactly what `Admission.pages` accepts of each, with the same pages, and
    refuse (None: `pages` then names the bad request) the rest."""
    group = full_attention_group(page_size=page_size)  # 16 pages
    admission = Admission(group)
    if whole_pages:  # mostly valid: runs of whole pages, some repeated or out of range
        requests = [[q * page_size + k for q in r[: 3] for k in range(page_size)] for r in requests]
    tensors = [{"kv": torch.tensor(r, dtype=torch.int64)} for r in requests]
    each: list[list[int]] | None = []
    try:
        each = [admission.pages(t, side="device")["kv"] for t in tensors]
    except InvalidIndices:
        each = None
    got = admission.bulk_pages(tensors, side="device")
    if each is None:
        assert got is None
    else:  # valid int64 tensors take the vectorised path
        assert got is not None
        pages_, offsets = got
        assert pages_["kv"] == [p for e in each for p in e]
        assert offsets["kv"] == [0, *itertools.accumulate(len(e) for e in each)]


async def test_a_large_bulk_call_is_checked_in_slices_and_names_the_bad_request() -> None:
    group = full_attention_group(page_size=1, device_slots=2048, host_slots=4096, layers=1)
    n = 1500  # three validation slices
    requests: list[dict[str, object]] = [{"kv": torch.tensor([i])} for i in range(n)]
    requests[700] = {"kv": [700]}  # a list: its slice is checked request by request
    async with TransferScheduler(group, config=SchedulerConfig(max_queued_ops=n)) as sched:
        bad = list(requests)
        bad[1100] = {"kv": torch.tensor([1100, 1100])}
        with pytest.raises(InvalidIndices, match="^request 1100: ") as err:
            await sched.backup_many(bad)  # type: ignore[arg-type]
        assert err.value.rule == "unique-pages" and used(group)["kv"] == 0
        want = rows(group, "kv", torch.arange(n))
        handles = await sched.backup_many(requests)  # type: ignore[arg-type]
        for h in handles:
            await h
        assert [int(h.device_indices["kv"]) for h in handles] == list(range(n))
        wipe(group)
        loads = await sched.load_many([h.host_indices for h in handles], [{"kv": torch.tensor([i])} for i in range(n)])
        for ld in loads:
            await ld
        assert all(torch.equal(a, b) for a, b in zip(rows(group, "kv", torch.arange(n)), want, strict=True))
        for h in handles:
            sched.free_host(h.host_indices)
    assert used(group)["kv"] == 0


@pytest.mark.parametrize("turns", range(0, 22, 3))
async def test_a_bulk_call_cancelled_at_any_turn_of_the_loop_gives_everything_back(turns: int) -> None:
    group = full_attention_group(page_size=1, device_slots=2048, host_slots=4096, layers=1, device_allocator=True)
    n = 1100
    async with TransferScheduler(group, config=SchedulerConfig(max_queued_ops=2 * n)) as sched:
        held = await sched.backup_many([{"kv": torch.tensor([i])} for i in range(n)])
        for h in held:
            await h
        for which in ("backup_many", "load_many"):
            before = sched.statistics()
            got: list = []
            with anyio.CancelScope() as scope:

                async def cancel_after_turns() -> None:
                    for _ in range(turns):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_after_turns)
                    if which == "backup_many":
                        got = await sched.backup_many([{"kv": torch.tensor([i])} for i in range(n)])
                    else:
                        got = await sched.load_many([h.host_indices for h in held])
            if got:  # it got in before the cancel: every request runs
                for h in got:
                    await h
                    if which == "backup_many":
                        sched.free_host(h.host_indices)
                    else:
                        group["kv"].device.allocator.free(h.device_indices["kv"])
            after = sched.statistics()
            lane = after.backup if which == "backup_many" else after.load
            assert lane.queue_depth == 0 and lane.submitted == lane.completed
            assert after.pools["kv"].used_slots == before.pools["kv"].used_slots
            assert group["kv"].device.allocator.num_free_slots == 2048
        for h in held:
            sched.free_host(h.host_indices)
        assert sched.statistics().deferred_host_frees == 0  # no load left a page pinned
    assert used(group)["kv"] == 0


async def test_lone_requests_in_a_burst_share_a_carrier_of_their_priority_and_stay_byte_exact(
    gate: threading.Event,
) -> None:
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS, device_allocator=True)
    src = [pages(i, page_size=PS) for i in range(6)]
    want = [rows(group, "kv", s) for s in src]
    async with TransferScheduler(group, executor=ex) as sched:
        blocker = await sched.backup({"kv": pages(9, page_size=PS)})
        await wait_until(lambda: len(ex.history) == 1)
        first = [await sched.backup({"kv": s}) for s in src[:3]]
        urgent = await sched.backup({"kv": src[3]}, priority=1)
        late = sched.backup_nowait({"kv": src[4]})  # the newest entry is the urgent one's: a new carrier
        fenced = await sched.backup({"kv": src[5]}, after=_Fence())  # a fence never joins
        assert sched.statistics().backup.queue_depth == 6
        gate.set()
        done = [blocker, *first, urgent, late, fenced]
        for h in done:
            await h
        carriers = [h._carrier for h in (*first, urgent, late, fenced)]  # type: ignore[attr-defined]
        assert carriers[0] is carriers[1] is carriers[2]
        assert len({id(c) for c in carriers[2:]}) == 4
        assert [h.id for h in done] == list(range(1, 8))  # ids as submitted, none skipped
        assert [i for _, ids in ex.history[1:] for i in ids] == [urgent.id, *(h.id for h in first), late.id,
                                                                 fenced.id]
        wipe(group)
        loads = [await sched.load(h.host_indices) for h in (*first, urgent, late, fenced)]
        given = await sched.load(first[0].host_indices, {"kv": pages(15, page_size=PS)})  # gives its pages
        for load, w in zip(loads, want):
            await load
            assert all(torch.equal(a, b) for a, b in zip(rows(group, "kv", load.device_indices["kv"]), w,
                                                          strict=True))
            group["kv"].device.allocator.free(load.device_indices["kv"])
        await given
        assert all(torch.equal(a, b) for a, b in zip(rows(group, "kv", pages(15, page_size=PS)), want[0],
                                                      strict=True))
        for h in done:
            sched.free_host(h.host_indices)
        stats = sched.statistics()
        assert stats.backup.completed == 7 and stats.load.completed == 7
        assert stats.backup.latency.total.count == 7
    assert used(group)["kv"] == 0
    assert group["kv"].device.allocator.num_free_slots == group["kv"].device_slots


class _Fence:
    """An event-like ``after=`` that is always complete."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


async def test_a_bulk_call_on_a_pool_without_bytes_is_carried_too() -> None:
    """A logical anchor holds no bytes of its own: its requests weigh nothing in the batch budget."""
    from kvtier import PoolGroup

    group = PoolGroup()
    group.add_logical_pool("tok", page_size=PS, host_slots=16 * PS, device_slots=16 * PS)
    async with TransferScheduler(group, config=SchedulerConfig(max_batch_bytes=1)) as sched:
        handles = await sched.backup_many([{"tok": pages(i, page_size=PS)} for i in range(5)])
        results = [await h for h in handles]
        assert [r.nbytes for r in results] == [0] * 5
        for h in handles:
            sched.free_host(h.host_indices)
    assert used(group)["tok"] == 0


async def test_a_load_cancelled_while_queued_gives_its_device_pages_back_and_they_are_not_written(
    gate: threading.Event,
) -> None:
    """The load side of the queued-cancel case: the device pages kvtier took for
    the request go back at once, and the carrier never writes into them."""
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS, device_allocator=True)
    alloc = group["kv"].device.allocator
    src = [pages(i, page_size=PS) for i in range(3)]
    want = [rows(group, "kv", s) for s in src]
    gate.set()
    async with TransferScheduler(group, executor=ex) as sched:
        backups = await sched.backup_many([{"kv": s} for s in src])
        for b in backups:
            await b
        blocker_host = await sched.backup({"kv": pages(9, page_size=PS)})
        await blocker_host
        gate.clear()
        blocker = await sched.load(blocker_host.host_indices, {"kv": pages(14, page_size=PS)})  # held in flight
        await wait_until(lambda: any(direction == "load" for direction, _ in ex.history))
        free_before = alloc.num_free_slots
        loads = await sched.load_many([b.host_indices for b in backups])
        victim = loads[1]
        victim_device = victim.device_indices["kv"]
        assert victim.cancel() and victim.done()
        assert alloc.num_free_slots == free_before - 2 * PS  # the victim's slots are back
        dev = group["kv"].device
        views = [dev.tensor(j, p) for j in range(dev.num_layers) for p in range(len(dev.planes))]
        for v in views:
            v[victim_device] = 7
        gate.set()
        for h in (blocker, loads[0], loads[2]):
            await h
        assert all(bool((v[victim_device] == 7).all()) for v in views)
        for i in (0, 2):
            got = rows(group, "kv", loads[i].device_indices["kv"])
            assert all(torch.equal(a, b) for a, b in zip(got, want[i], strict=True))
            alloc.free(loads[i].device_indices["kv"])
        for h in (*backups, blocker_host):
            sched.free_host(h.host_indices)
        assert sched.statistics().load.cancelled == 1
    assert used(group)["kv"] == 0 and alloc.num_free_slots == group["kv"].device_slots


async def test_lone_backups_on_a_pool_without_bytes_join_a_carrier() -> None:
    from kvtier import PoolGroup

    group = PoolGroup()
    group.add_logical_pool("tok", page_size=PS, host_slots=16 * PS, device_slots=16 * PS)
    async with TransferScheduler(group, config=SchedulerConfig(max_batch_bytes=1)) as sched:
        handles = [sched.backup_nowait({"tok": pages(i, page_size=PS)}) for i in range(4)]
        assert len({id(h._carrier) for h in handles}) == 1  # type: ignore[attr-defined]
        assert [(await h).nbytes for h in handles] == [0] * 4
        for h in handles:
            sched.free_host(h.host_indices)
    assert used(group)["tok"] == 0


@pytest.mark.parametrize("ending", ["success", "cancelled while queued", "failed batch"])
async def test_a_lone_load_that_brings_a_new_allocated_pool_to_a_carrier_gives_its_device_pages_back(
    gate: threading.Event, ending: str
) -> None:
    """The first lone load names only ``kv`` (device pages given); the second
    names only ``swa`` and lets kvtier allocate its device pages, and joins the
    same queued carrier. Whatever ends it, what kvtier allocated for it is the
    caller's on success and back in the allocator otherwise; bytes exact."""
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = hybrid_group(device_allocator=True)
    ps = group["kv"].page_size
    alloc = group["swa"].device.allocator
    assert alloc is not None
    async with TransferScheduler(group, executor=ex) as sched:
        gate.set()
        kv_backup = await sched.backup({"kv": pages(0, page_size=ps)})
        swa_backup = await sched.backup({"swa": pages(1, page_size=ps)})
        await kv_backup
        await swa_backup
        want = rows(group, "swa", pages(1, page_size=ps))
        gate.clear()
        seen = len(ex.history)
        blocker = await sched.load({"kv": kv_backup.host_indices["kv"]}, {"kv": pages(6, page_size=ps)})
        await wait_until(lambda: len(ex.history) == seen + 1)  # the load lane's batch in flight, held
        first = await sched.load({"kv": kv_backup.host_indices["kv"]}, {"kv": pages(5, page_size=ps)})
        free_before = alloc.num_free_slots
        second = await sched.load({"swa": swa_backup.host_indices["swa"]})
        assert second._carrier is first._carrier  # type: ignore[attr-defined]  # joined
        assert alloc.num_free_slots == free_before - ps
        if ending == "cancelled while queued":
            assert second.cancel()
            assert alloc.num_free_slots == free_before
        elif ending == "failed batch":
            ex.fail_batches.add(seen + 1)  # the carrier's batch
        gate.set()
        await blocker
        for h in (first, second):
            with anyio.fail_after(10):
                await h.settled()
        if ending == "success":
            await second
            dev = second.device_indices["swa"]
            assert all(torch.equal(a, b) for a, b in zip(rows(group, "swa", dev), want, strict=True))
            alloc.free(dev)
        else:
            assert second.exception() is not None
        assert alloc.num_free_slots == free_before
        for h in (kv_backup, swa_backup):
            sched.free_host(h.host_indices)
    assert used(group)["kv"] == 0 and used(group)["swa"] == 0


@pytest.mark.parametrize("ending", ["success", "cancelled while queued", "failed batch"])
async def test_a_lone_backup_that_brings_a_new_pool_to_a_carrier_gives_its_host_pages_back(
    gate: threading.Event, ending: str
) -> None:
    """The backup side of the case above: the first lone backup names only
    ``kv``, the second only ``swa`` and joins the same queued carrier. Its host
    pages are its own: the caller's on success, back in the pool otherwise."""
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = hybrid_group()
    ps = group["kv"].page_size
    async with TransferScheduler(group, executor=ex) as sched:
        seen = len(ex.history)
        blocker = await sched.backup({"kv": pages(7, page_size=ps)})  # the backup lane's batch, held
        await wait_until(lambda: len(ex.history) == seen + 1)
        first = await sched.backup({"kv": pages(0, page_size=ps)})
        second = await sched.backup({"swa": pages(1, page_size=ps)})
        assert second._carrier is first._carrier  # type: ignore[attr-defined]  # joined
        assert used(group)["swa"] == ps
        if ending == "cancelled while queued":
            assert second.cancel()
            assert used(group)["swa"] == 0
        elif ending == "failed batch":
            ex.fail_batches.add(seen + 1)  # the carrier's batch
        gate.set()
        await blocker
        for h in (first, second):
            with anyio.fail_after(10):
                await h.settled()
        if ending == "success":
            await second
            want = rows(group, "swa", pages(1, page_size=ps))
            wipe(group)
            load = await sched.load(second.host_indices, {"swa": pages(3, page_size=ps)})
            await load
            got = rows(group, "swa", pages(3, page_size=ps))
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            sched.free_host(second.host_indices)
        else:
            assert second.exception() is not None
        assert used(group)["swa"] == 0
        for h in (blocker, first):
            if h.exception() is None:
                sched.free_host(h.host_indices)
    assert used(group)["kv"] == 0 and used(group)["swa"] == 0
