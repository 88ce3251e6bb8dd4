"""`kvtier.scheduler.carriers` and `kvtier.scheduler.lanes` as an engine sees
them: each request's handle reads its own state, timings, errors and bytes
from the carrier that carries it; the lane refuses what does not fit, naming
the bound; byte counts are exact integers; the ids an executor sees are the
requests'. (`test_bulk.py`, `test_scheduler.py` and `test_pinned_behaviours.py`
cover the carriers' round trips, failures and cancellation.)"""

from __future__ import annotations

import re
import threading
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from conftest import assert_rows_equal, pages, rows, used, wait_until, wipe

from kvtier import (
    InvalidIndices,
    NotFinished,
    OperationCancelled,
    SchedulerClosed,
    SchedulerConfig,
    TransferFailed,
    TransferScheduler,
)
from kvtier.bench.measures import NoCopyExecutor
from kvtier.errors import WrongEventLoop
from kvtier.testing import FaultInjectingExecutor, full_attention_group, hybrid_group

PS = 4


async def test_a_requests_seconds_are_its_own_time_queued_and_copying(gate: threading.Event) -> None:
    """The first backup's batch is held while it copies; the second waits in
    the queue meanwhile, and a lone backup submitted later joins its carrier.
    Each result's seconds are its own: queued from its own submission until
    its batch was taken, copying from then until it ended, total the two."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex) as sched:
        try:
            first = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            second = await sched.backup({"kv": pages(1, page_size=PS)})
            await anyio.sleep(0.15)
            joined = await sched.backup({"kv": pages(2, page_size=PS)})  # joins the second's carrier
            assert sched.statistics().backup.queue_depth == 2
            await anyio.sleep(0.05)
            gate.set()
            one, two, three = await first, await second, await joined
            assert len(ex.history) == 2 and ex.history[1][1] == (second.id, joined.id)
            for r in (one, two, three):
                assert 0 <= r.seconds_queued < 10 and 0 <= r.seconds_copying < 10
                assert r.seconds_total == pytest.approx(r.seconds_queued + r.seconds_copying, abs=1e-9)
            assert one.seconds_copying >= 0.15  # held while copying
            assert one.seconds_queued < 0.15
            assert two.seconds_queued >= 0.2  # queued behind the held batch
            assert 0.05 <= three.seconds_queued <= two.seconds_queued - 0.1  # from its own submission
            assert two.seconds_copying == three.seconds_copying  # one batch
            assert repr(two).startswith(f"OperationResult(id={second.id}, direction=")
            sched.free_host(one)
            sched.free_host(two)
            sched.free_host(three)
        finally:
            gate.set()


async def test_a_handle_reads_its_own_requests_state_and_cancel(gate: threading.Event) -> None:
    """In one carrier: a request cancelled while queued is done and cancelled
    at once, its neighbours still queued and not cancelled; in a running
    carrier a cancelled request reads cancel_requested (still running) and
    ends cancelled, the others complete."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex) as sched:
        try:
            first = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(3)])
            await wait_until(lambda: len(ex.history) == 1)
            queued = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(3, 6)])
            assert [h.state for h in queued] == ["queued"] * 3
            assert queued[1].cancel() and not queued[1].cancel()
            assert [h.state for h in queued] == ["queued", "done", "queued"]
            assert [h.cancel_requested for h in queued] == [False, True, False]
            assert [h.done() for h in queued] == [False, True, False]
            assert isinstance(queued[1].exception(), OperationCancelled)
            assert str(queued[1].exception()) == f"operation {queued[1].id} was cancelled"
            assert queued[0].exception() is None
            # The running carrier: a cancel is accepted, and ends it after the copies.
            assert [h.state for h in first] == ["running"] * 3
            assert first[2].cancel()
            assert [h.cancel_requested for h in first] == [False, False, True]
            assert [h.state for h in first] == ["running"] * 3 and not first[2].done()
            gate.set()
            for h in (*first[:2], queued[0], queued[2]):
                await h
            with pytest.raises(OperationCancelled, match=f"operation {first[2].id} was cancelled"):
                await first[2]
            assert [h.cancel_requested for h in first] == [False, False, True]
            assert [h.state for h in first] == ["done"] * 3
            for h in (*first[:2], queued[0], queued[2]):
                sched.free_host(h)
            assert used(group)["kv"] == 0
        finally:
            gate.set()


async def test_a_request_failed_by_verify_mode_is_not_read_as_cancelled() -> None:
    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group, config=SchedulerConfig(verify=True)) as sched:
        backed = [await sched.backup({"kv": pages(i, page_size=PS)}) for i in range(2)]
        for h in backed:
            await h
        view = group["kv"].host.layer_view(0, 0)
        view[int(backed[1].host_indices["kv"][0])] += 1  # request 1's host page changed
        loads = await sched.load_many([{"kv": h.host_indices["kv"]} for h in backed],
                                      device_indices=[{"kv": pages(4 + i, page_size=PS)} for i in range(2)])
        await loads[0]
        with pytest.raises(Exception) as info:
            await loads[1]
        assert not isinstance(info.value, OperationCancelled)
        assert [h.cancel_requested for h in loads] == [False, False]
        for h in backed:
            sched.free_host(h)


async def test_a_load_waiting_on_a_bulk_backups_request_is_told_which_request_failed(gate: threading.Event) -> None:
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex) as sched:
        try:
            device = torch.stack([pages(0, page_size=PS), pages(1, page_size=PS)])
            host = torch.stack([pages(5, page_size=PS), pages(6, page_size=PS)])
            bulk = await sched.backup_arrays({"kv": device}, host_indices={"kv": host})
            await wait_until(lambda: len(ex.history) == 1)
            ids = [h.id for h in bulk.handles()]
            assert bulk.cancel([1]) == 1
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    got: list[BaseException] = []

                    async def load() -> None:
                        try:
                            await sched.load({"kv": host[1]}, {"kv": pages(9, page_size=PS)})
                        except TransferFailed as exc:
                            got.append(exc)

                    tg.start_soon(load)
                    await anyio.sleep(0.02)
                    gate.set()
            assert len(got) == 1
            assert f"that backup {ids[1]} was writing" in str(got[0])
            assert isinstance(got[0].__cause__, OperationCancelled)
            result = await bulk
            assert result.status.tolist() == [0, 2]
            sched.free_host({"kv": host[0]})
            assert used(group)["kv"] == 0
        finally:
            gate.set()


async def test_layer_ready_refuses_a_layer_the_group_does_not_have_and_raises_a_failed_requests_error() -> None:
    group = full_attention_group(page_size=PS, layers=3)
    ex = FaultInjectingExecutor(fail_batches={0})
    async with TransferScheduler(group, ex) as sched:
        h = await sched.backup({"kv": pages(0, page_size=PS)})
        for bad in (3, -1, True, 1.0, "0"):
            with pytest.raises(InvalidIndices) as info:
                await h.layer_ready(bad)  # type: ignore[arg-type]
            assert info.value.rule == "layer-in-range"
            assert str(info.value) == f"layer {bad!r} is out of range; this group has transfer layers 0..2"
        with pytest.raises(TransferFailed):
            await h
        with pytest.raises(TransferFailed):
            await h.layer_ready(2)  # ended: the layer wait reports its request's own outcome
    assert used(group)["kv"] == 0


async def test_cancel_from_another_thread_is_refused_naming_the_call(gate: threading.Event) -> None:
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex) as sched:
        try:
            h = await sched.backup({"kv": pages(0, page_size=PS)})
            errors: list[BaseException] = []

            def other() -> None:
                try:
                    h.cancel()
                except WrongEventLoop as exc:
                    errors.append(exc)

            await anyio.to_thread.run_sync(other)
            assert len(errors) == 1 and str(errors[0]).startswith("cancel() was called from another thread")
            assert not h.cancel_requested
            gate.set()
            sched.free_host(await h)
        finally:
            gate.set()


# -- the lane's bound, for a submission that may not wait ----------------------------------------


async def test_backup_nowait_refuses_a_full_lane_naming_its_bound_and_takes_nothing(gate: threading.Event) -> None:
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex, SchedulerConfig(max_queued_ops=4, max_batch_ops=1)) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})  # taken, held
            await wait_until(lambda: len(ex.history) == 1)
            queued = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(1, 5)], priority=1)
            before = used(group)
            with pytest.raises(anyio.WouldBlock,
                               match=r"the backup lane holds 4 operations, its bound \(SchedulerConfig.max_queued_ops\)"):
                sched.backup_nowait({"kv": pages(5, page_size=PS)})
            assert used(group) == before  # its host page went back
            # A bulk submission waits for room for its two; two queued requests are cancelled:
            # the room is handed to the waiter, so a submission that may not wait finds none.
            waiting: list[Any] = []

            async def bulk() -> None:
                waiting.append(await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (6, 7)]))

            async with anyio.create_task_group() as tg:
                tg.start_soon(bulk)
                await anyio.sleep(0.02)
                assert not waiting
                assert queued[0].cancel() and queued[1].cancel()  # two places free, handed over
                with pytest.raises(anyio.WouldBlock):
                    sched.backup_nowait({"kv": pages(8, page_size=PS)})
                gate.set()
            for h in (held, *queued[2:], *waiting[0]):
                sched.free_host(await h)
            assert used(group)["kv"] == 0
        finally:
            gate.set()


# -- partial pages: exact integer byte counts, the requests' ids, the fence ----------------------


class _Event:
    """An event-like fence (``query`` and ``synchronize``) that counts the waits for it."""

    def __init__(self) -> None:
        self.waits = 0

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.waits += 1


async def test_a_backup_of_partial_pages_counts_exact_integer_bytes_and_carries_its_ids_and_fence() -> None:
    group = full_attention_group(page_size=PS)
    row = group["kv"].slot_nbytes
    fence = _Event()
    async with TransferScheduler(group) as sched:  # the CPU executor: it waits for the batch's fences
        hs = await sched.backup_many([{"kv": pages(0, 1, page_size=PS)}, {"kv": pages(2, page_size=PS)}],
                                     valid_rows=[{"kv": 5}, None], after=fence)
        results = [await h for h in hs]
        assert fence.waits >= 1  # the copies waited for the fence
        assert [r.nbytes for r in results] == [5 * row, 4 * row]
        assert all(type(r.nbytes) is int for r in results)
        assert all(type(n) is int for r in results for n in r.bytes_per_pool.values())
        stats = sched.statistics().backup
        assert stats.bytes == 9 * row and type(stats.bytes) is int
        for h in hs:
            sched.free_host(h)
    assert used(group)["kv"] == 0


async def test_an_executor_sees_the_ids_of_the_requests_a_batch_of_partial_pages_carries() -> None:
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor()
    async with TransferScheduler(group, ex) as sched:
        hs = await sched.backup_many([{"kv": pages(0, 1, page_size=PS)}, {"kv": pages(2, page_size=PS)}],
                                     valid_rows=[{"kv": 5}, None])
        for h in hs:
            sched.free_host(await h)
        assert ex.history == [("backup", tuple(h.id for h in hs))]


# -- lone requests joining a queued carrier --------------------------------------------------------


async def test_lone_backups_naming_other_pools_join_and_each_keeps_its_own_pages_writer_and_time(
    gate: threading.Event,
) -> None:
    """Behind a held batch: B names ``kv``; C names ``kv`` and ``state`` and
    joins B's carrier (a one-pool carrier takes a two-pool request); D names
    ``kv`` only and joins the now two-pool carrier. B's indices are read before
    the joins: later reads see every request's own slots. A load of C's pages
    waits for C, and learns C's own outcome (cancelled while queued). Bytes
    round-trip exactly; the lane counts each request once."""
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = hybrid_group()
    ps = group["kv"].page_size
    async with TransferScheduler(group, executor=ex) as sched:
        try:
            blocker = await sched.backup({"kv": pages(7, page_size=ps)})
            await wait_until(lambda: len(ex.history) == 1)
            b = await sched.backup({"kv": pages(0, page_size=ps)})
            b_host = b.host_indices["kv"].tolist()  # read before anyone joins
            await anyio.sleep(0.05)
            c = await sched.backup({"kv": pages(1, page_size=ps), "state": torch.tensor([3])})
            await anyio.sleep(0.05)
            d = await sched.backup({"kv": pages(2, 3, page_size=ps)})
            assert b._carrier is c._carrier is d._carrier  # type: ignore[attr-defined]
            stats = sched.statistics().backup
            assert stats.submitted == 4 and stats.queue_depth == 3 and stats.peak_queue_depth == 3
            assert b.host_indices["kv"].tolist() == b_host
            hosts = {h.id: {k: v.tolist() for k, v in h.host_indices.items()} for h in (b, c, d)}
            assert set(hosts[c.id]) == {"kv", "c4", "state"} and set(hosts[d.id]) == {"kv", "c4"}
            assert len(hosts[d.id]["kv"]) == 2 * ps and len(hosts[c.id]["state"]) == 1
            assert [h.host_pages for h in (b, c, d)] == [
                {"kv": [x // ps for x in hosts[h.id]["kv"][::ps]]} | (
                    {"state": hosts[h.id]["state"]} if "state" in hosts[h.id] else {})
                for h in (b, c, d)
            ]
            originals = {h.id: {n: rows(group, n, i) for n, i in h.device_indices.items()} for h in (b, c, d)}
            got: list[BaseException] = []

            async def load_c() -> None:
                try:
                    await sched.load({"kv": c.host_indices["kv"]}, {"kv": pages(6, page_size=ps)})
                except TransferFailed as exc:
                    got.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(load_c)
                await anyio.sleep(0.02)
                assert not got  # waits for C, its writer
                assert c.cancel()  # queued: C ends cancelled now, and its waiter learns it
            gate.set()
            assert len(got) == 1 and f"that backup {c.id} was writing" in str(got[0])
            for h in (blocker, b, d):
                await h
            with pytest.raises(OperationCancelled):
                await c
            assert [r.seconds_queued > 0 for r in (await b, await d)] == [True, True]
            assert (await b).seconds_queued - (await d).seconds_queued >= 0.09  # D queued from its own submission
            wipe(group)
            for h in (b, d):
                back = await sched.load(h.host_indices, h.device_indices)
                await back
                for n, want in originals[h.id].items():
                    assert_rows_equal(rows(group, n, h.device_indices[n]), want)
            for h in (blocker, b, d):
                sched.free_host(h)
            assert used(group) == {n: 0 if v is not None else None for n, v in used(group).items()}
        finally:
            gate.set()


async def _backed_up(
    sched: TransferScheduler, gate: threading.Event, requests: list[dict[str, torch.Tensor]],
) -> list[Any]:
    """``requests`` backed up one call each and done, the held executor's
    ``gate`` open meanwhile and closed again after."""
    gate.set()
    backed = [await sched.backup(r) for r in requests]
    for h in backed:
        await h
    gate.clear()
    return backed


async def test_a_lone_load_given_device_pages_never_joins_one_whose_pages_kvtier_allocates(
    gate: threading.Event,
) -> None:
    """Operations whose allocations differ are never merged: when their batch
    fails, kvtier frees the device pages it allocated and never the ones the
    engine gave."""
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS, device_allocator=True)
    alloc = group["kv"].device_allocator
    assert alloc is not None
    async with TransferScheduler(group, executor=ex) as sched:
        try:
            backed = await _backed_up(sched, gate, [{"kv": pages(i, page_size=PS)} for i in range(3)])
            seen = len(ex.history)
            given = alloc.try_alloc(3 * PS)  # the engine's own device slots
            assert given is not None
            blocker = await sched.load(backed[0].host_indices, {"kv": given[:PS]})
            await wait_until(lambda: len(ex.history) == seen + 1)
            free_before = alloc.num_free_slots
            allocated = await sched.load(backed[1].host_indices)  # kvtier allocates its device pages
            assert alloc.num_free_slots == free_before - PS
            engines = await sched.load(backed[2].host_indices, {"kv": given[PS:2 * PS]})
            assert engines._carrier is not allocated._carrier  # type: ignore[attr-defined]
            ex.fail_batches.add(seen + 1)  # the batch that takes both
            gate.set()
            await blocker
            for h in (allocated, engines):
                with pytest.raises(TransferFailed):
                    await h
            assert alloc.num_free_slots == free_before  # kvtier's pages back, the engine's untouched
            alloc.free(given)
            assert alloc.num_free_slots == free_before + 3 * PS
            for h in backed:
                sched.free_host(h)
        finally:
            gate.set()


async def test_a_lone_request_joins_only_within_the_batch_byte_budget(gate: threading.Event) -> None:
    """Two pages a batch: B and C (a page each) share a carrier, D (a third
    page) does not join it; no batch the executor sees carries more bytes than
    the budget; the byte counts are exact integers."""
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS)
    page = group["kv"].slot_nbytes * PS
    async with TransferScheduler(group, ex, SchedulerConfig(max_batch_bytes=2 * page)) as sched:
        try:
            blocker = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            b, c, d = [await sched.backup({"kv": pages(i, page_size=PS)}) for i in (1, 2, 3)]
            assert b._carrier is c._carrier is not d._carrier  # type: ignore[attr-defined]
            gate.set()
            for h in (blocker, b, c, d):
                await h
            assert [ids for _, ids in ex.history] == [(blocker.id,), (b.id, c.id), (d.id,)]
            stats = sched.statistics().backup
            assert stats.bytes == 4 * page and type(stats.bytes) is int
            assert stats.completed == 4 and stats.submitted == 4
            for h in (blocker, b, c, d):
                sched.free_host(h)
        finally:
            gate.set()


# -- waiting for a layer on the device ---------------------------------------------------------------


class _Stream:
    """A compute stream that records the events it was told to wait for."""

    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


async def test_wait_layer_waits_on_the_layers_event_once_published_and_layer_ready_for_the_copy() -> None:
    """An executor that publishes one event per layer (as a device executor
    does) before the copies land, then copies layer by layer behind gates:
    `wait_layer` returns as soon as the events are published, making the given
    stream (or the default one) wait for that layer's event; `layer_ready`
    still waits for the layer to land."""
    group = full_attention_group(layers=3, page_size=PS)
    gates = [threading.Event() for _ in range(4)]  # gates[3]: when the events are published
    default = _Stream()
    events = [f"layer {i} event" for i in range(3)]

    class EventExecutor:
        max_in_flight = 1

        async def execute(self, batch: Any, progress: Any) -> None:
            def run() -> None:
                from kvtier.transfers import apply_copy_plan

                plan = batch.plan()
                if not gates[3].wait(10):
                    raise RuntimeError("the events' gate was never released")
                progress.publish_events(events, lambda: default)
                for layer in range(plan.num_layers):
                    if not gates[layer].wait(10):
                        raise RuntimeError(f"layer {layer}'s gate was never released")
                    for src, dst, p in plan.layer_copies(layer):
                        apply_copy_plan(p, src, dst)
                    progress.layer_done(layer)

            await anyio.to_thread.run_sync(run)

    async with TransferScheduler(group, executor=EventExecutor()) as sched:
        try:
            h = await sched.backup({"kv": pages(0, page_size=PS)})
            mine = _Stream()
            done: list[str] = []

            async def device_wait(layer: int, stream: _Stream | None) -> None:
                await h.wait_layer(layer, stream)
                done.append(f"wait {layer}")

            async def ready(layer: int) -> None:
                await h.layer_ready(layer)
                done.append(f"ready {layer}")

            async with anyio.create_task_group() as tg:
                tg.start_soon(device_wait, 2, mine)
                tg.start_soon(device_wait, 1, None)
                tg.start_soon(ready, 0)
                await anyio.sleep(0.05)
                assert done == []  # nothing published, nothing landed
                gates[3].set()
                await wait_until(lambda: len(done) == 2)
                assert sorted(done) == ["wait 1", "wait 2"]  # before any layer landed
                assert mine.waited == ["layer 2 event"] and default.waited == ["layer 1 event"]
                await anyio.sleep(0.02)
                assert "ready 0" not in done
                gates[0].set()
                await wait_until(lambda: "ready 0" in done)
                gates[1].set()
                gates[2].set()
            await h
            sched.free_host(h)
        finally:
            for g in gates:
                g.set()


# -- a request's waiters, its log line, and what an executor sees of partial pages ---------------


async def test_a_layer_wait_on_a_request_cancelled_while_queued_raises_its_cancel_at_once(
    gate: threading.Event,
) -> None:
    """The request ended early, inside a carrier that is still queued: its
    layer waits (before and after the cancel) end with its own
    OperationCancelled, while its neighbour in the carrier stays queued."""
    group = full_attention_group(page_size=PS, layers=3)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            a, b = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (1, 2)])
            seen: list[BaseException] = []

            async def wait_layer() -> None:
                try:
                    await a.layer_ready(1)
                except OperationCancelled as exc:
                    seen.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_layer)
                await anyio.sleep(0.02)  # waiting on layer 1 of a queued request
                assert a.cancel()
                with anyio.fail_after(2):
                    await wait_until(lambda: bool(seen))
            assert str(seen[0]) == f"operation {a.id} was cancelled"
            with pytest.raises(OperationCancelled, match=f"operation {a.id} was cancelled"):
                with anyio.fail_after(2):
                    await a.layer_ready(0)  # after the cancel: at once
            assert b.state == "queued"
            gate.set()
            sched.free_host(await held)
            sched.free_host(await b)
        finally:
            gate.set()
    assert used(group)["kv"] == 0


async def test_a_bulk_call_and_a_handle_of_its_awaited_together_both_wake(gate: threading.Event) -> None:
    """One carrier, two kinds of waiter: a task awaiting a request's handle,
    then the bulk call itself; the carrier's end wakes both."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    kv = np.arange(3 * PS, dtype=np.int64).reshape(3, PS)
    async with TransferScheduler(group, ex) as sched:
        try:
            bulk = await sched.backup_arrays({"kv": kv}, handles=True)
            await wait_until(lambda: len(ex.history) == 1)
            done: list[Any] = []

            async def one() -> None:
                done.append(await bulk.handles()[1])

            async with anyio.create_task_group() as tg:
                tg.start_soon(one)
                await anyio.sleep(0.02)  # the handle's waiter is registered first
                with anyio.move_on_after(0.05):
                    await bulk  # the bulk call's waiter joins it, then is cancelled here
                gate.set()
                with anyio.fail_after(2):
                    result = await bulk
            assert result.all_ok and len(done) == 1 and done[0].id == bulk.handles()[1].id
            sched.free_host(result)
        finally:
            gate.set()
    assert used(group)["kv"] == 0


async def test_a_request_cancelled_while_queued_is_logged_with_its_id_and_lane(
    gate: threading.Event, caplog: pytest.LogCaptureFixture,
) -> None:
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    caplog.set_level("INFO", logger="kvtier.scheduler")
    async with TransferScheduler(group, ex) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            a, b = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (1, 2)])
            caplog.clear()
            assert b.cancel()
            lines = [r.getMessage() for r in caplog.records if "operation.cancelled" in r.getMessage()]
            assert len(lines) == 1 and _logged(lines[0], b.id, "backup"), lines
            stats = sched.statistics().backup
            assert stats.cancelled == 1 and stats.failed == 0
            gate.set()
            sched.free_host(await held)
            sched.free_host(await a)
        finally:
            gate.set()


async def test_a_refused_nowait_submission_is_not_counted(gate: threading.Event) -> None:
    """backup_nowait refused by a full lane raises WouldBlock to its caller and
    counts nowhere: not submitted, not failed, not cancelled."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex, SchedulerConfig(max_queued_ops=2, max_batch_ops=1)) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            queued = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (1, 2)], priority=1)
            before = sched.statistics().backup
            with pytest.raises(anyio.WouldBlock):
                sched.backup_nowait({"kv": pages(3, page_size=PS)})
            after = sched.statistics().backup
            assert (after.submitted, after.failed, after.cancelled, after.completed) == (
                before.submitted, before.failed, before.cancelled, before.completed) == (3, 0, 0, 0)
            gate.set()
            for h in (held, *queued):
                sched.free_host(await h)
        finally:
            gate.set()
    assert used(group)["kv"] == 0


def _logged(line: str, op_id: int, lane: str) -> bool:
    """Whether a log line names operation ``op_id`` and ``lane`` (plain or
    structlog's rendering: ``operation=3 lane='backup'`` or ``lane=backup operation=3``)."""
    return bool(re.search(rf"\boperation={op_id}\b", line)) and bool(re.search(rf"\blane='?{lane}\b", line))


class _Recording(FaultInjectingExecutor):
    """Records the id, direction, priority and bytes of every operation it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[object, ...]] = []

    async def execute(self, batch: Any, progress: Any) -> None:
        self.ops += [(op.id, op.direction, op.priority, op.nbytes) for op in batch.operations]
        await super().execute(batch, progress)


@pytest.mark.parametrize("partial", [False, True], ids=["whole-pages", "partial-pages"])
async def test_an_executor_sees_the_same_operation_fields_for_partial_pages(partial: bool) -> None:
    """A backup and a load of pages with fewer valid rows (a sidecar's
    included) reach the executor as their whole-page twins do: the
    direction, priority and an int id; the bytes, an exact int, the valid
    rows' only."""
    group = hybrid_group(page_size=8)
    kv_row, c4_row = group["kv"].slot_nbytes, group["c4"].slot_nbytes
    ex = _Recording()
    rows = {"kv": 11, "c4": 1} if partial else None
    async with TransferScheduler(group, ex) as sched:
        h = await sched.backup({"kv": pages(0, 1, page_size=8)}, priority=7, valid_rows=rows)
        r = await h
        (op_id, direction, priority, nbytes), = ex.ops
        assert type(op_id) is int and direction.value == "backup" and priority == 7
        want = (11 * kv_row + 1 * c4_row) if partial else (16 * kv_row + 4 * c4_row)
        assert nbytes == want and type(nbytes) is int
        assert r.nbytes == want
        stats = sched.statistics().backup
        assert stats.bytes == want and type(stats.bytes) is int
        host = {"kv": torch.tensor([p * 8 + k for p in r.host_pages["kv"] for k in range(8)])}
        load = await sched.load(host, device_indices={"kv": pages(4, 5, page_size=8)}, priority=-3)
        await load
        (_, direction, priority, nbytes) = ex.ops[1]
        assert direction.value == "load" and priority == -3 and nbytes == want and type(nbytes) is int
        assert type(sched.statistics().load.bytes) is int
        sched.free_host(h)
    assert used(group)["kv"] == 0


async def test_a_lone_load_kvtier_allocates_for_never_joins_one_given_device_pages(gate: threading.Event) -> None:
    """The other order of the test above: the queued carrier's request gave
    its device pages, the lone load after it has kvtier allocate them. They
    never share a carrier, and a failed batch frees only kvtier's pages."""
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS, device_allocator=True)
    alloc = group["kv"].device_allocator
    assert alloc is not None
    async with TransferScheduler(group, executor=ex) as sched:
        try:
            backed = await _backed_up(sched, gate, [{"kv": pages(i, page_size=PS)} for i in range(3)])
            seen = len(ex.history)
            given = alloc.try_alloc(2 * PS)
            assert given is not None
            blocker = await sched.load(backed[0].host_indices, {"kv": given[:PS]})
            await wait_until(lambda: len(ex.history) == seen + 1)
            free_before = alloc.num_free_slots
            engines = await sched.load(backed[1].host_indices, {"kv": given[PS:]})
            allocated = await sched.load(backed[2].host_indices)  # kvtier allocates its device pages
            assert alloc.num_free_slots == free_before - PS
            assert allocated._carrier is not engines._carrier  # type: ignore[attr-defined]
            ex.fail_batches.add(seen + 1)
            gate.set()
            await blocker
            for h in (engines, allocated):
                with pytest.raises(TransferFailed):
                    await h
            assert alloc.num_free_slots == free_before  # kvtier's page back, the engine's untouched
            alloc.free(given)
            for h in backed:
                sched.free_host(h)
        finally:
            gate.set()


async def test_each_joined_request_is_timed_from_its_own_submission(gate: threading.Event) -> None:
    """Two lone backups join one queued carrier at different times: each
    one's time queued runs from its own submission, not the carrier's or
    the other's."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex) as sched:
        try:
            first = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            carrier = await sched.backup({"kv": pages(1, page_size=PS)})
            await anyio.sleep(0.15)
            early = await sched.backup({"kv": pages(2, page_size=PS)})  # joins
            await anyio.sleep(0.15)
            late = await sched.backup({"kv": pages(3, page_size=PS)})  # joins too
            assert sched.statistics().backup.queue_depth == 3
            await anyio.sleep(0.05)
            gate.set()
            results = [await h for h in (first, carrier, early, late)]
            assert ex.history[1][1] == (carrier.id, early.id, late.id)
            _, c, e, late_q = (r.seconds_queued for r in results)
            assert c >= 0.3 and 0 <= late_q <= e - 0.1 and e <= c - 0.1, (c, e, late_q)  # sleeps only overshoot
            for r in results:
                sched.free_host(r)
        finally:
            gate.set()
    assert used(group)["kv"] == 0


async def test_a_queued_storage_write_cancelled_ends_cancelled_and_leaves_the_queue() -> None:
    """The storage lanes' entries end early through the lane too: a write
    queued behind held ones, cancelled, ends with OperationCancelled at once,
    the lane's depth drops by it, and it never reaches the store."""
    from kvtier.storage import KeyNamespace, page_keys
    from kvtier.testing import MemoryStore

    group = full_attention_group(page_size=PS)
    store = MemoryStore()
    ns = KeyNamespace(model="t", pool="kv", page_size=PS, dtype="f32", layout="layer_first")
    async with TransferScheduler(group, storage=store, config=SchedulerConfig(storage_batches_in_flight=1)) as sched:
        backed = [await sched.backup({"kv": pages(i, page_size=PS)}) for i in range(2)]
        for h in backed:
            await h
        store.hold(("put",))
        try:
            running = await sched.write_storage(backed[0].host_indices, {"kv": page_keys(ns, [1] * PS)})
            await wait_until(lambda: sched.statistics().write_storage.batches == 1)
            queued = await sched.write_storage(backed[1].host_indices, {"kv": page_keys(ns, [2] * PS)})
            assert sched.statistics().write_storage.queue_depth == 1
            assert queued.cancel()
            assert sched.statistics().write_storage.queue_depth == 0
            with anyio.fail_after(2):
                with pytest.raises(OperationCancelled):
                    await queued
            assert sched.statistics().write_storage.cancelled == 1
        finally:
            store.release()
        await running
        assert len(store.pages) == 1  # the cancelled write put nothing
        for h in backed:
            sched.free_host(h)
    assert used(group)["kv"] == 0


async def _backed_up_then_held(
    sched: TransferScheduler, ex: FaultInjectingExecutor, gate: threading.Event, ps: int, n: int,
) -> tuple[list[Any], list[dict[str, torch.Tensor]], Any]:
    """``n`` backups of a kv page and a state row, done; then a load held by
    ``gate`` (the blocker), and every batch after it set to fail. Returns the
    backups, each one's kv and state host indices, and the blocker."""
    requests = [{"kv": pages(i, page_size=ps), "state": torch.tensor([i])} for i in range(n)]
    backed = await _backed_up(sched, gate, requests)
    host = [{k: v for k, v in h.host_indices.items() if k in ("kv", "state")} for h in backed]
    seen = len(ex.history)
    blocker = await sched.load({"kv": host[0]["kv"]}, {"kv": pages(7, page_size=ps)})
    await wait_until(lambda: len(ex.history) == seen + 1)
    ex.fail_batches.update(range(seen + 1, seen + 10))
    return backed, host, blocker


@pytest.mark.parametrize("slack", [False, True], ids=["budget-exact", "budget-with-slack"])
async def test_lone_loads_of_two_pools_join_by_allocation_and_budget_and_a_failure_frees_only_kvtiers_pages(
    gate: threading.Event, slack: bool,
) -> None:
    """A queued load whose kv device pages kvtier allocates (A) takes a lone
    load of kv and state, both allocated by kvtier (B), up to the batch's
    bytes exactly; a third allocated load (C) is past the budget and starts a
    carrier of its own; a fourth that gives its own device pages (D) never
    joins C. (The budget: A and B's bytes exactly, or with room for less than
    C's.) B names state before kv. All their batches fail: kvtier frees every device page it
    allocated, kv's and state's, and none that the engine gave."""
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = hybrid_group(device_allocator=True)
    ps = group["kv"].page_size
    kv_alloc, state_alloc = group["kv"].device_allocator, group["state"].device_allocator
    assert kv_alloc is not None and state_alloc is not None
    kv_page, state_page = ps * group["kv"].slot_nbytes, group["state"].slot_nbytes
    kv_page += sum(g.page_size * g.slot_nbytes for g in (group["c4"],))  # kv's sidecar rows move with it
    budget = 2 * kv_page + state_page + (kv_page - 1 if slack else 0)
    async with TransferScheduler(group, ex, SchedulerConfig(max_batch_bytes=budget)) as sched:
        try:
            backed, host, blocker = await _backed_up_then_held(sched, ex, gate, ps, 5)
            kv_free, state_free = kv_alloc.num_free_slots, state_alloc.num_free_slots
            a = await sched.load({"kv": host[1]["kv"]})
            b = await sched.load({"state": host[2]["state"], "kv": host[2]["kv"]})
            c = await sched.load({"kv": host[3]["kv"]})
            given_kv, given_state = kv_alloc.try_alloc(ps), state_alloc.try_alloc(1)
            assert given_kv is not None and given_state is not None
            d = await sched.load(host[4], {"kv": given_kv, "state": given_state})
            carriers = [h._carrier for h in (a, b, c, d)]  # type: ignore[attr-defined]
            assert carriers[0] is carriers[1]  # joined: the same allocation, within the budget
            assert carriers[2] is not carriers[0]  # past the budget
            assert carriers[3] is not carriers[2]  # kv given, where C's kvtier allocates
            assert kv_alloc.num_free_slots == kv_free - 4 * ps and state_alloc.num_free_slots == state_free - 2
            gate.set()
            first = await blocker
            for h in (a, b, c, d):
                with pytest.raises(TransferFailed):
                    await h
            assert kv_alloc.num_free_slots == kv_free - ps and state_alloc.num_free_slots == state_free - 1
            kv_alloc.free(given_kv)
            state_alloc.free(given_state)
            stats = sched.statistics().load
            assert stats.bytes == first.nbytes and type(stats.bytes) is int and stats.failed == 4
            for h in backed:
                sched.free_host(h)
        finally:
            gate.set()


async def test_a_waiter_cancelled_before_its_turn_passes_the_room_on_and_the_bound_holds(gate: threading.Event) -> None:
    """Bound 3, full. A bulk call of three waits for room, a lone backup
    behind it for one. A queued request is cancelled: one place, not enough
    for the bulk call. The bulk call is cancelled: the place goes to the lone
    backup at once; the lane is full again (a submission that may not wait is
    refused), its peak never past the bound; once it drained, it takes three
    again."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex, SchedulerConfig(max_queued_ops=3, max_batch_ops=1)) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            queued = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (1, 2, 3)])
            got: dict[str, Any] = {}
            bulk_scope = anyio.CancelScope()

            async def bulk() -> None:
                with bulk_scope:
                    got["bulk"] = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (4, 5, 6)])

            async def lone() -> None:
                got["lone"] = await sched.backup({"kv": pages(7, page_size=PS)})

            async with anyio.create_task_group() as tg:
                tg.start_soon(bulk)
                await anyio.sleep(0.02)
                tg.start_soon(lone)
                await anyio.sleep(0.02)
                assert not got
                assert queued[0].cancel()  # one place: the bulk call, first in line, needs three
                await anyio.sleep(0.02)
                assert not got
                bulk_scope.cancel()
                with anyio.fail_after(2):
                    await wait_until(lambda: "lone" in got)
            assert "bulk" not in got
            stats = sched.statistics().backup
            assert stats.queue_depth == 3 and stats.peak_queue_depth == 3
            with pytest.raises(anyio.WouldBlock):
                sched.backup_nowait({"kv": pages(8, page_size=PS)})
            gate.set()
            for h in (held, *queued[1:], got["lone"]):
                sched.free_host(await h)
            await wait_until(lambda: sched.statistics().backup.queue_depth == 0)
            again = [sched.backup_nowait({"kv": pages(i, page_size=PS)}) for i in (9, 10, 11)]  # room for three
            for h in again:
                sched.free_host(await h)
            assert sched.statistics().backup.peak_queue_depth == 3
        finally:
            gate.set()
    assert used(group)["kv"] == 0


async def test_a_carrier_whose_requests_all_ended_early_gives_back_nothing_again(gate: threading.Event) -> None:
    """A and B share a queued carrier. A is cancelled: its host page goes
    back, and a backup of another priority (its own carrier) takes it. B is
    cancelled: the carrier ends with nothing left to give back; the later
    backup's page stays its own, and its failure frees it exactly once."""
    group = full_attention_group(page_size=PS, host_slots=3 * PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            a, b = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (1, 2)])
            assert a._carrier is b._carrier  # type: ignore[attr-defined]
            page_a = a.host_indices["kv"].tolist()
            assert a.cancel()
            d = await sched.backup({"kv": pages(3, page_size=PS)}, priority=1)
            assert d.host_indices["kv"].tolist() == page_a  # the page A gave back
            assert b.cancel()
            assert used(group)["kv"] == 2 * PS  # held's and D's
            ex.fail_batches.add(1)  # D's batch
            gate.set()
            sched.free_host(await held)
            with pytest.raises(TransferFailed):
                await d
            assert used(group)["kv"] == 0
            again = await sched.backup({"kv": pages(4, page_size=PS)})
            sched.free_host(await again)
            assert used(group)["kv"] == 0
        finally:
            gate.set()


async def test_a_bulk_call_past_the_lanes_bound_is_refused_naming_the_bound_and_the_way_out() -> None:
    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group, config=SchedulerConfig(max_queued_ops=2)) as sched:
        with pytest.raises(ValueError) as info:
            await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(3)])
        assert str(info.value) == ("3 operations in one call exceed the backup lane's bound of 2 "
                                   "(SchedulerConfig.max_queued_ops); submit them in smaller groups")
        assert used(group)["kv"] == 0


async def test_a_cancel_accepted_while_running_is_logged_with_its_id_and_lane_and_copies_are_timed(
    gate: threading.Event, caplog: pytest.LogCaptureFixture,
) -> None:
    """Two requests in one running carrier: the one cancelled while its
    copies run ends cancelled after them and is logged with its own id and
    lane; the other completes, and the lane's latency counts its copying
    time (held for 0.15 s) as running, not as queued."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    caplog.set_level("INFO", logger="kvtier.scheduler")
    async with TransferScheduler(group, ex) as sched:
        try:
            a, b = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (0, 1)])
            await wait_until(lambda: len(ex.history) == 1)
            assert b.cancel() and b.cancel_requested
            await anyio.sleep(0.15)
            caplog.clear()
            gate.set()
            sched.free_host(await a)
            with pytest.raises(OperationCancelled):
                await b
            lines = [r.getMessage() for r in caplog.records if "operation.cancelled" in r.getMessage()]
            assert len(lines) == 1 and _logged(lines[0], b.id, "backup"), lines
            latency = sched.statistics().backup.latency
            assert latency.running.sum_seconds >= 0.15 and latency.queued.sum_seconds < 0.15
        finally:
            gate.set()
    assert used(group)["kv"] == 0


async def test_a_load_cancelled_while_queued_gives_back_the_device_pages_kvtier_allocated_for_it(
    gate: threading.Event,
) -> None:
    """Its device pages, not the page numbers of its host pages: the engine's
    own device pages (taken first, so the numbers overlap) stay the engine's."""
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS, device_allocator=True)
    alloc = group["kv"].device_allocator
    assert alloc is not None
    async with TransferScheduler(group, executor=ex) as sched:
        try:
            backed = await _backed_up(sched, gate, [{"kv": pages(i, page_size=PS)} for i in range(3)])
            given = alloc.try_alloc(3 * PS)  # device pages 0..2: the host pages' numbers too
            assert given is not None
            seen = len(ex.history)
            blocker = await sched.load(backed[0].host_indices, {"kv": given[:PS]})
            await wait_until(lambda: len(ex.history) == seen + 1)
            free_before = alloc.num_free_slots
            a, b = await sched.load_many([{"kv": backed[1].host_indices["kv"]}, {"kv": backed[2].host_indices["kv"]}])
            assert alloc.num_free_slots == free_before - 2 * PS
            assert a.cancel()
            assert alloc.num_free_slots == free_before - PS
            gate.set()
            await blocker
            done = await b
            assert done.nbytes > 0
            alloc.free(b.device_indices["kv"])  # the engine frees what kvtier allocated for b
            alloc.free(given)  # and its own pages, every one still its own
            assert alloc.num_free_slots == free_before + 3 * PS
            for h in backed:
                sched.free_host(h)
        finally:
            gate.set()


async def test_room_handed_to_waiters_is_counted_until_they_are_in(gate: threading.Event) -> None:
    """Bound 2, full, three lone backups waiting. Two queued requests are
    cancelled one after the other, before the first woken waiter ran: each
    place goes to one waiter, the third keeps waiting, the lane never holds
    more than two; the third gives up, and the full lane still refuses a
    submission that may not wait."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex, SchedulerConfig(max_queued_ops=2, max_batch_ops=1)) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            queued = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (1, 2)])
            got: dict[int, Any] = {}
            third = anyio.CancelScope()

            async def waiter(i: int) -> None:
                with third if i == 5 else anyio.CancelScope():
                    got[i] = await sched.backup({"kv": pages(i, page_size=PS)}, priority=i)  # no joining

            async with anyio.create_task_group() as tg:
                for i in (3, 4, 5):
                    tg.start_soon(waiter, i)
                    await anyio.sleep(0.01)
                assert not got
                assert queued[0].cancel() and queued[1].cancel()  # in one step: no waiter ran between
                await anyio.sleep(0.05)
                assert sorted(got) == [3, 4]
                stats = sched.statistics().backup
                assert stats.queue_depth == 2 and stats.peak_queue_depth == 2
                third.cancel()
            assert 5 not in got
            with pytest.raises(anyio.WouldBlock):
                sched.backup_nowait({"kv": pages(6, page_size=PS)})
            gate.set()
            for h in (held, got[3], got[4]):
                sched.free_host(await h)
        finally:
            gate.set()
    assert used(group)["kv"] == 0


async def test_a_submission_finds_no_room_that_was_handed_to_a_waiter(gate: threading.Event) -> None:
    """Bound 2, full, one lone backup waiting. A queued request is cancelled:
    its place is handed to the waiter. A backup submitted in the same step,
    before the waiter ran, finds the lane full (the handed place is counted)
    and waits; the lane never holds more than two."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex, SchedulerConfig(max_queued_ops=2, max_batch_ops=1)) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            queued = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (1, 2)])
            got: list[Any] = []

            async def waiter() -> None:
                got.append(await sched.backup({"kv": pages(3, page_size=PS)}, priority=3))

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.sleep(0.02)
                assert queued[0].cancel()  # the place goes to the waiter, which has not run yet
                late: list[Any] = []
                with anyio.move_on_after(0.1):
                    late.append(await sched.backup({"kv": pages(4, page_size=PS)}, priority=4))
                assert not late  # it waited: no room
            assert len(got) == 1
            stats = sched.statistics().backup
            assert stats.queue_depth == 2 and stats.peak_queue_depth == 2
            gate.set()
            for h in (held, queued[1], got[0]):
                sched.free_host(await h)
        finally:
            gate.set()
    assert used(group)["kv"] == 0


@pytest.mark.parametrize("how", ["cancelled", "closed"])
async def test_a_load_waiting_on_a_backup_whose_submission_never_queued_fails_naming_why(
    how: str, gate: threading.Event,
) -> None:
    """A backup into named host pages waits for room in a full lane; a load of
    those pages waits for that writer. The backup's submission is cancelled
    (or the scheduler closes with on_close="cancel"): it never queued, and the
    load fails with `TransferFailed` whose cause says why: the submission's
    cancel (`OperationCancelled` naming the operation, never the task's own
    cancellation) or `SchedulerClosed`."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    named = {"kv": pages(9, page_size=PS)}
    got: dict[str, BaseException] = {}
    config = SchedulerConfig(max_queued_ops=1, max_batch_ops=1, on_close="cancel")
    scope = anyio.CancelScope()

    async def backup(sched: TransferScheduler) -> None:
        with scope:
            try:
                await sched.backup({"kv": pages(2, page_size=PS)}, host_indices=named)
            except SchedulerClosed as exc:
                got["backup"] = exc
            except BaseException as exc:
                got["backup"] = exc
                raise

    async def load(sched: TransferScheduler) -> None:
        try:
            await sched.load(named, {"kv": pages(3, page_size=PS)})
        except TransferFailed as exc:
            got["load"] = exc

    async def release_once_refused() -> None:
        await wait_until(lambda: "backup" in got)
        gate.set()

    try:
        async with anyio.create_task_group() as tg:
            async with TransferScheduler(group, ex, config) as sched:
                held = await sched.backup({"kv": pages(0, page_size=PS)})
                await wait_until(lambda: len(ex.history) == 1)
                queued = await sched.backup({"kv": pages(1, page_size=PS)})  # the lane is full
                tg.start_soon(backup, sched)
                await anyio.sleep(0.02)
                tg.start_soon(load, sched)
                await anyio.sleep(0.02)
                assert not got  # the backup waits for room, the load for its writer
                if how == "cancelled":
                    scope.cancel()
                    with anyio.fail_after(2):
                        await wait_until(lambda: "load" in got)
                    gate.set()
                    for h in (held, queued):
                        sched.free_host(await h)
                else:
                    tg.start_soon(release_once_refused)
    finally:
        gate.set()
    cause = got["load"].__cause__
    if how == "cancelled":
        assert isinstance(cause, OperationCancelled), repr(cause)
        assert re.fullmatch(r"submission of operation \d+ was cancelled", str(cause)), str(cause)
        assert "(OperationCancelled)" in str(got["load"])
    else:
        assert isinstance(got["backup"], SchedulerClosed) and cause is got["backup"], (got, cause)
        assert str(got["backup"]) == "the scheduler closed while this submission waited for room"
        assert "(SchedulerClosed)" in str(got["load"])
        error = queued.exception()  # still queued when the scheduler closed (on_close="cancel")
        assert isinstance(error, SchedulerClosed) and str(error) == (
            f"operation {queued.id} was still queued when the scheduler closed"), error
    # Nothing of the refused backup stays taken (the first backup's page is its
    # caller's when it completed before the close ended it).
    kept = PS if how == "closed" and held.exception() is None else 0
    assert used(group)["kv"] == kept


@pytest.mark.parametrize("path", ["single", "bulk"])
async def test_each_requests_bytes_are_the_pools_it_names_in_a_carrier_of_several_pools(path: str) -> None:
    """A request's ``bytes_per_pool`` (its handle's and its result's) names the
    pools it moves, sidecars included, with their exact bytes, whatever else
    its carrier holds: a request naming ``kv`` and ``state`` counts both, one
    naming one of them counts only that one, alone or beside the others."""
    group = hybrid_group()
    ps = group["kv"].page_size
    kv = {"kv": pages(0, page_size=ps)}
    state = {"state": pages(1, page_size=1)}
    async with TransferScheduler(group) as sched:
        alone = {}
        for name, request in (("kv", kv), ("state", state)):
            h = await sched.backup(request)
            alone[name] = dict((await h).bytes_per_pool)
            sched.free_host(h)
        assert set(alone["kv"]) == {"kv", "c4"} and set(alone["state"]) == {"state"}, alone
        assert all(n > 0 for b in alone.values() for n in b.values()), alone
        both = {**alone["kv"], **alone["state"]}
        requests = [kv, {**kv, **state}, state]
        wants = [alone["kv"], both, alone["state"]]
        if path == "bulk":
            handles = await sched.backup_many(requests)
        else:
            handles = [await sched.backup(r) for r in requests]
        moved = sched.executor.statistics().nbytes  # type: ignore[attr-defined]
        for h, want in zip(handles, wants, strict=True):
            result = await h
            assert dict(h.bytes_per_pool) == want and dict(result.bytes_per_pool) == want, (h, want)
            assert h.nbytes == result.nbytes == sum(want.values())
            sched.free_host(h)
        # and what the executor copied is what the requests say they moved
        assert sched.executor.statistics().nbytes - moved == sum(h.nbytes for h in handles)  # type: ignore[attr-defined]
    assert all(n in (0, None) for n in used(group).values())


@pytest.mark.parametrize("slice_s", [0.0, 60.0])
async def test_a_batch_of_many_carriers_ends_over_many_loop_steps_and_the_next_starts_in_its_own(
    monkeypatch: pytest.MonkeyPatch, slice_s: float,
) -> None:
    """Ending a batch is sliced by loop steps, never one long callback: with
    the slice made 0 s, every carrier of a batch ends in a step of its own, and
    the next batch is taken in a later step than its predecessor's last end
    (counted with a task that bumps a counter once per loop iteration). And no
    turn is taken that the slice does not need: with a slice nothing reaches
    (60 s), a batch's carriers all end in one step, and the next batch is
    taken in that step."""
    import asyncio

    from kvtier.scheduler import lanes

    monkeypatch.setattr(lanes, "FINISH_SLICE_S", slice_s)
    n, per_batch = 2048, 1024  # two batches of 8 carriers (128 requests each)
    group = full_attention_group(page_size=1, device_slots=n, host_slots=n, layers=1)
    requests = [{"kv": idx} for idx in torch.split(torch.arange(n), 1)]
    turn = 0
    running = True

    async def ticker() -> None:
        nonlocal turn
        while running:
            turn += 1
            await asyncio.sleep(0)

    async with TransferScheduler(group, NoCopyExecutor(), SchedulerConfig(max_batch_ops=per_batch)) as sched:
        lane = sched._lanes["backup"]
        ends: list[tuple[int, int]] = []  # (batch, loop turn) per carrier ended
        taken: list[int] = []  # loop turn per batch taken
        run_batch, finish = lane._work.run, lane.finish

        async def run(batch: int, handles: list[Any], on: Any, clock: Any) -> None:
            taken.append(turn)
            await run_batch(batch, handles, on, clock)

        def ended(handle: Any, *, error: BaseException | None = None) -> None:
            ends.append((len(taken), turn))
            finish(handle, error=error)

        monkeypatch.setattr(lane._work, "run", run)
        monkeypatch.setattr(lane, "finish", ended)
        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        handles = await sched.backup_many(requests)
        for h in handles:
            await h
        running = False
        await tick
        assert len(taken) == 2 and len(ends) == 16, (taken, ends)
        for batch in (1, 2):
            turns = [t for b, t in ends if b == batch]
            if slice_s:
                assert len(turns) == 8 and len(set(turns)) == 1, turns  # the whole batch in one step
            else:
                assert len(turns) == 8 and len(set(turns)) == 8, turns  # one carrier per step
        if not slice_s:
            assert taken[1] > max(t for b, t in ends if b == 1), (taken, ends)
        else:  # no turn taken between them either: the next batch is taken in the same step
            assert taken[1] == max(t for b, t in ends if b == 1), (taken, ends)
        sched.free_host({"kv": torch.cat([h.host_indices["kv"] for h in handles])})


class EngineAllocator:
    """An engine's own device allocator (not kvtier's `PageAllocator`, so kvtier
    hands back slots, not page numbers): here one over a `PageAllocator`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.page_size = inner.page_size

    @property
    def num_free_slots(self) -> int:
        return int(self.inner.num_free_slots)

    def try_alloc(self, num_slots: int) -> torch.Tensor | None:
        return self.inner.try_alloc(num_slots)  # type: ignore[no-any-return]

    def free(self, indices: torch.Tensor) -> None:
        self.inner.free(indices)


@pytest.mark.parametrize("state_allocator", ["kvtier", "engine"])
async def test_a_carrier_joined_by_a_request_bringing_a_new_allocated_pool_keeps_refusing_given_pages(
    gate: threading.Event, state_allocator: str,
) -> None:
    """A (kvtier allocates kv) is joined by B (kvtier allocates kv and, new to
    the carrier, state): the carrier now allocates both. E gives its kv device
    pages and lets kvtier allocate state: it never joins (kv's allocation
    differs). All three fail: kvtier frees every device page it allocated,
    kv's and state's (state's allocator kvtier's own, or the engine's), and
    not E's own kv pages."""
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = hybrid_group(device_allocator=True)
    if state_allocator == "engine":
        # The pool's spec carries the engine's allocator; swap one in.
        object.__setattr__(group["state"], "device_allocator", EngineAllocator(group["state"].device_allocator))
    ps = group["kv"].page_size
    kv_alloc, state_alloc = group["kv"].device_allocator, group["state"].device_allocator
    assert kv_alloc is not None and state_alloc is not None
    async with TransferScheduler(group, ex) as sched:
        try:
            backed, host, blocker = await _backed_up_then_held(sched, ex, gate, ps, 3)
            kv_free, state_free = kv_alloc.num_free_slots, state_alloc.num_free_slots
            a = await sched.load({"kv": host[1]["kv"]})
            b = await sched.load({"kv": host[2]["kv"], "state": host[2]["state"]})
            given_kv = kv_alloc.try_alloc(ps)
            assert given_kv is not None
            e = await sched.load(host[0], {"kv": given_kv})
            carriers = [h._carrier for h in (a, b, e)]  # type: ignore[attr-defined]
            assert carriers[0] is carriers[1] and carriers[2] is not carriers[0]
            gate.set()
            await blocker
            for h in (a, b, e):
                with pytest.raises(TransferFailed):
                    await h
            assert kv_alloc.num_free_slots == kv_free - ps and state_alloc.num_free_slots == state_free
            kv_alloc.free(given_kv)
            for h in backed:
                sched.free_host(h)
        finally:
            gate.set()


@pytest.mark.parametrize("kv_allocator", ["kvtier", "engine"])
async def test_a_failed_load_many_frees_the_device_pages_kvtier_allocated_for_each_request_and_no_given_one(
    kv_allocator: str,
) -> None:
    """`load_many` where one request gives its kv device pages and the others
    let kvtier allocate them: requests whose allocations differ are never in
    one carrier, and when every batch fails, kvtier frees exactly the device
    pages it allocated (kv's and swa's; kv's allocator kvtier's or the
    engine's), never the engine's."""
    group = hybrid_group(device_allocator=True)
    if kv_allocator == "engine":
        object.__setattr__(group["kv"], "device_allocator", EngineAllocator(group["kv"].device_allocator))
    ps = group["kv"].page_size
    ex = FaultInjectingExecutor()
    src = [{"kv": pages(i, page_size=ps), "swa": pages(i, page_size=ps)} for i in range(3)]
    async with TransferScheduler(group, ex) as sched:
        backups = await sched.backup_many(src)
        for b in backups:
            await b
        seen = len(ex.history)
        ex.fail_batches.update(range(seen, seen + 10))
        kv_alloc, swa_alloc = group["kv"].device_allocator, group["swa"].device_allocator
        assert kv_alloc is not None and swa_alloc is not None
        given = kv_alloc.try_alloc(ps)
        assert given is not None
        kv_free, swa_free = kv_alloc.num_free_slots, swa_alloc.num_free_slots
        loads = await sched.load_many([b.host_indices for b in backups], [None, {"kv": given}, {}])
        carriers = [h._carrier for h in loads]  # type: ignore[attr-defined]
        assert carriers[1] is not carriers[0] and carriers[1] is not carriers[2], carriers
        for h in loads:
            with pytest.raises(TransferFailed):
                await h
        assert kv_alloc.num_free_slots == kv_free and swa_alloc.num_free_slots == swa_free
        kv_alloc.free(given)
        for b in backups:
            sched.free_host(b)
    assert used(group)["kv"] == 0


@pytest.mark.parametrize("direction", ["backup", "load", "load, the engine's allocator"])
async def test_a_bulk_call_cancelled_while_its_carriers_are_made_gives_back_everything(
    direction: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bulk call cut into a carrier a request (max_batch_ops=1), with the
    loop's slice made 0 s so that making its carriers yields after each one,
    is cancelled after its second carrier: the call ends by that cancellation
    alone, nothing was queued or counted, and everything it took comes back
    (a backup's host pages; a load's device pages kvtier allocated, from
    kvtier's allocator or the engine's, and its host pages' pins). The same
    calls then go through whole."""
    from kvtier.scheduler import carriers as carriers_module
    from kvtier.scheduler import lanes

    group = hybrid_group(device_allocator=True)
    if direction.endswith("allocator"):
        object.__setattr__(group["kv"], "device_allocator", EngineAllocator(group["kv"].device_allocator))
        direction = "load"
    ps = group["kv"].page_size
    n = 4
    src = [{"kv": pages(i, page_size=ps)} for i in range(n)]
    made: list[Any] = []
    scope = anyio.CancelScope()
    real = carriers_module.Carrier.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        made.append(self)
        if len(made) == 2:
            scope.cancel()  # lands at the next checkpoint: after the second carrier

    async with TransferScheduler(group, config=SchedulerConfig(max_batch_ops=1)) as sched:
        backups = await sched.backup_many(src) if direction == "load" else []
        for b in backups:
            await b
        kv_alloc = group["kv"].device_allocator
        assert kv_alloc is not None
        before = (used(group)["kv"], kv_alloc.num_free_slots, sched.statistics().backup.submitted,
                  sched.statistics().load.submitted)

        async def call() -> list[Any]:
            if direction == "backup":
                return await sched.backup_many(src)
            return await sched.load_many([b.host_indices for b in backups])

        monkeypatch.setattr(lanes, "FINISH_SLICE_S", 0.0)
        monkeypatch.setattr(carriers_module.Carrier, "__init__", counted)
        with scope:
            await call()
        assert scope.cancelled_caught and len(made) == 2, (scope.cancelled_caught, made)
        monkeypatch.undo()
        after = (used(group)["kv"], kv_alloc.num_free_slots, sched.statistics().backup.submitted,
                 sched.statistics().load.submitted)
        assert after == before, (before, after)
        # Nothing stays pinned or written: the same call goes through, and the pages free.
        handles = await call()
        for h in handles:
            await h
        if direction == "load":
            for h in handles:
                kv_alloc.free(h.device_indices["kv"])
            for b in backups:
                sched.free_host(b)
        else:
            for h in handles:
                sched.free_host(h)
    assert used(group)["kv"] == 0


class HostFence:
    """An ``after=`` event on the host: its copy may start once it is released."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def query(self) -> bool:
        return self.released.is_set()

    def synchronize(self) -> None:
        assert self.released.wait(10), "the fence was never released"


async def test_a_lone_backup_copies_after_its_fence_the_rows_as_they_are_then() -> None:
    """A lone backup with ``after=`` (the forward pass still writing its rows)
    copies once the fence is passed: the host gets the rows as the pass left
    them, not as they were at submission."""
    group = full_attention_group(page_size=PS)
    idx = pages(0, page_size=PS)
    device = group["kv"].device
    assert device is not None

    def write(value: float) -> None:
        for j in range(device.num_layers):
            for p in range(len(device.planes)):
                device.tensor(j, p)[idx] = value

    fence = HostFence()
    write(1.0)
    async with TransferScheduler(group) as sched:
        try:
            h = await sched.backup({"kv": idx}, after=fence)
            await anyio.sleep(0.05)
            assert not h.done()  # waiting for the pass
            write(2.0)  # the pass ends ...
            fence.released.set()  # ... and says so
            await h
        finally:
            fence.released.set()
        want = rows(group, "kv", idx)
        wipe(group)
        await (await sched.load(h.host_indices, {"kv": idx}))
        got = rows(group, "kv", idx)
        assert all(bool((t == 2.0).all()) for t in want)
        assert_rows_equal(got, want)
        sched.free_host(h)
    assert used(group)["kv"] == 0


@pytest.mark.parametrize("path", ["single", "bulk"])
async def test_indices_of_pages_of_two_slots_are_each_pages_slots(path: str) -> None:
    """Page size 2: a handle's host and device indices are the slots of its
    pages (2p and 2p + 1 for page p), in a carrier of one request or of
    several, and they load back byte-exact."""
    group = full_attention_group(page_size=2)
    src = [pages(i, page_size=2) for i in (3, 0, 5)]
    want = [rows(group, "kv", s) for s in src]
    async with TransferScheduler(group) as sched:
        if path == "bulk":
            handles = await sched.backup_many([{"kv": s} for s in src])
        else:
            handles = [await sched.backup({"kv": s}) for s in src]
        for h, s in zip(handles, src, strict=True):
            await h
            (page,) = h.host_pages["kv"]
            assert h.host_indices["kv"].tolist() == [2 * page, 2 * page + 1]
            assert torch.equal(h.device_indices["kv"], s)
        wipe(group)
        for h, s, w in zip(handles, src, want, strict=True):
            await (await sched.load(h.host_indices, {"kv": s}))
            assert_rows_equal(rows(group, "kv", s), w)
            sched.free_host(h)


async def test_asking_a_queued_request_for_its_outcome_names_it_and_a_cancelled_one_is_settled_at_once(
    gate: threading.Event,
) -> None:
    """Behind a held batch, A and B share a queued carrier: ``outcome()`` of A
    raises `NotFinished` naming it; B cancelled ends at once (its carrier stays
    queued for A) and ``settled()`` returns without waiting for the carrier."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            a = await sched.backup({"kv": pages(1, page_size=PS)})
            b = await sched.backup({"kv": pages(2, page_size=PS)})
            assert a._carrier is b._carrier  # type: ignore[attr-defined]
            with pytest.raises(NotFinished, match=rf"^operation {a.id} has not ended; await it first$"):
                a.outcome()
            assert b.cancel()
            with anyio.fail_after(1):
                await b.settled()
            assert b.done() and not a.done()
            gate.set()
            for h in (held, a):
                sched.free_host(await h)
        finally:
            gate.set()
    assert used(group)["kv"] == 0


async def test_the_priority_bounds_themselves_are_accepted_without_waiting() -> None:
    from kvtier.scheduler import PRIORITY_MAX, PRIORITY_MIN

    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group) as sched:
        for i, priority in enumerate((PRIORITY_MIN, PRIORITY_MAX)):
            h = sched.backup_nowait({"kv": pages(i, page_size=PS)}, priority=priority)
            assert h.priority == priority
            sched.free_host(await h)
        with pytest.raises(ValueError, match="priority"):
            sched.backup_nowait({"kv": pages(3, page_size=PS)}, priority=PRIORITY_MAX + 1)
    assert used(group)["kv"] == 0


@pytest.mark.parametrize("waiting", ["for room", "handed room"])
async def test_a_lone_backup_never_joins_a_queued_carrier_ahead_of_a_waiting_submitter(
    waiting: str, gate: threading.Event,
) -> None:
    """A lone backup that could join the queued carrier (same priority, room
    in the carrier) does not while another submission waits for room (a bulk
    call, FIFO), nor into room that was handed to a waiter that has not run
    yet: it waits its turn, and the lane never holds more than its bound."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    bound = 3 if waiting == "for room" else 2
    async with TransferScheduler(group, ex, SchedulerConfig(max_queued_ops=bound)) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            queued = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (1, 2)])  # one carrier
            got: list[Any] = []

            async def waiter() -> None:
                if waiting == "for room":  # two places asked, one free
                    got.extend(await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (3, 4)]))
                else:  # the lane is full; priority 1: never joins
                    got.append(await sched.backup({"kv": pages(3, page_size=PS)}, priority=1))

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.sleep(0.02)
                assert not got
                if waiting == "handed room":
                    assert queued[0].cancel()  # its place goes to the waiter, which has not run yet
                late: list[Any] = []
                with anyio.move_on_after(0.1):
                    late.append(await sched.backup({"kv": pages(5, page_size=PS)}))
                assert not late  # it waited
                stats = sched.statistics().backup
                assert stats.peak_queue_depth <= bound
                gate.set()
            for h in (held, *queued, *got):
                if h.exception() is None:
                    sched.free_host(await h)
        finally:
            gate.set()
    assert used(group)["kv"] == 0


async def test_a_bulk_call_that_reaches_the_queue_after_the_scheduler_closed_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `backup_many` still making its carriers (yielding after each) when
    the scheduler's block is left is refused as it queues them: `SchedulerClosed`
    saying the scheduler is closed, and every host page it took comes back."""
    from kvtier.scheduler import carriers as carriers_module
    from kvtier.scheduler import lanes

    group = full_attention_group(page_size=PS)
    made: list[Any] = []
    real = carriers_module.Carrier.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(lanes, "FINISH_SLICE_S", 0.0)
    monkeypatch.setattr(carriers_module.Carrier, "__init__", counted)
    got: list[BaseException] = []

    async def bulk(sched: TransferScheduler) -> None:
        try:
            await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(4)])
        except SchedulerClosed as exc:
            got.append(exc)

    async with anyio.create_task_group() as tg:
        async with TransferScheduler(group, config=SchedulerConfig(max_batch_ops=1)) as sched:
            tg.start_soon(bulk, sched)
            while not made:  # a loop turn at a time: the call makes one carrier a turn
                await anyio.lowlevel.checkpoint()
            assert len(made) == 1
            # leaving the block closes the scheduler while the call makes its other carriers
    assert len(got) == 1 and len(made) == 4, (got, made)
    assert str(got[0]) == "the scheduler is closed; it takes no new operations"
    assert used(group)["kv"] == 0
    assert sched.statistics().backup.submitted == 0


async def test_a_lanes_largest_batch_is_counted() -> None:
    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group) as sched:
        handles = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in range(3)])
        for h in handles:
            sched.free_host(await h)
        stats = sched.statistics().backup
        assert stats.batches == 1 and stats.max_operations_per_batch == 3 and stats.operations_per_batch == 3.0, stats
    assert used(group)["kv"] == 0


async def test_a_bulk_backup_with_a_fence_still_waits_for_it_after_one_request_is_cancelled(
    gate: threading.Event,
) -> None:
    """A `backup_many(after=fence)` queued behind a held batch loses one request
    to a cancel: the others still copy only once the fence is passed, and get
    the rows as the pass left them."""
    group = full_attention_group(page_size=PS)
    device = group["kv"].device
    assert device is not None
    src = [pages(i, page_size=PS) for i in (1, 2, 3)]

    def write(value: float) -> None:
        for j in range(device.num_layers):
            for p in range(len(device.planes)):
                for idx in src:
                    device.tensor(j, p)[idx] = value

    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    fence = HostFence()
    write(1.0)
    async with TransferScheduler(group, ex) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            handles = await sched.backup_many([{"kv": idx} for idx in src], after=fence)
            assert handles[0].cancel()
            gate.set()
            await held
            await anyio.sleep(0.05)
            assert not any(h.done() for h in handles[1:])  # waiting for the pass
            write(2.0)
            fence.released.set()
            for h in handles[1:]:
                await h
            for h in handles[1:]:
                host = group["kv"].host
                assert all(bool((host.layer_view(j, p)[h.host_indices["kv"]] == 2.0).all())
                           for j in range(host.num_layers) for p in range(len(host.planes)))
            for h in (held, *handles[1:]):
                sched.free_host(h)
        finally:
            gate.set()
            fence.released.set()
    assert used(group)["kv"] == 0


async def test_a_verified_bulk_backup_that_lost_a_request_records_the_others_checksums(gate: threading.Event) -> None:
    """Verify mode: a `backup_many` behind a held batch loses one request to a
    cancel; the others complete, their pages' checksums are recorded, and a
    load of them checks those: a clean page loads, a page changed behind
    kvtier's back is refused."""
    from kvtier import CorruptionDetected

    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex, SchedulerConfig(verify=True)) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            handles = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (1, 2, 3)])
            assert handles[0].cancel()
            gate.set()
            for h in (held, *handles[1:]):
                await h
            want = rows(group, "kv", pages(2, page_size=PS))
            view = group["kv"].host.layer_view(0, 0)
            victim = handles[2].host_indices["kv"][0]
            view[victim] = view[victim] + 1  # behind kvtier's back
            wipe(group)
            await (await sched.load(handles[1].host_indices, {"kv": pages(2, page_size=PS)}))
            assert_rows_equal(rows(group, "kv", pages(2, page_size=PS)), want)
            with pytest.raises(CorruptionDetected):
                await (await sched.load(handles[2].host_indices, {"kv": pages(3, page_size=PS)}))
            for h in (held, *handles[1:]):
                sched.free_host(h)
        finally:
            gate.set()
    assert used(group)["kv"] == 0


async def test_requests_of_partial_pages_keep_their_exact_bytes_when_one_beside_them_is_cancelled(
    gate: threading.Event,
) -> None:
    """A `backup_many` of partial pages (valid_rows) loses one request to a
    cancel while queued: each other request's bytes stay the rows it moves,
    as when none was cancelled."""
    group = hybrid_group()
    ps = group["kv"].page_size
    reqs = [{"kv": pages(i, page_size=ps)} for i in range(3)]
    valid = [{"kv": 3}, {"kv": 5}, None]
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex) as sched:
        try:
            gate.set()
            whole = await sched.backup_many(reqs, valid_rows=valid)
            want = [dict((await h).bytes_per_pool) for h in whole]
            for h in whole:
                sched.free_host(h)
            gate.clear()
            held = await sched.backup({"kv": pages(5, page_size=ps)})
            await wait_until(lambda: len(ex.history) == 2)
            handles = await sched.backup_many(reqs, valid_rows=valid)
            assert handles[0].cancel()
            gate.set()
            for h, w in zip(handles[1:], want[1:], strict=True):
                result = await h
                assert dict(result.bytes_per_pool) == w and dict(h.bytes_per_pool) == w, (result, w)
            for h in (held, *handles[1:]):
                sched.free_host(h)
        finally:
            gate.set()
    assert used(group)["kv"] == 0


async def test_a_lanes_latency_and_bytes_are_its_completed_requests_own(
    gate: threading.Event, kvtier_warnings: list[Any],
) -> None:
    """The lane's counts add up its completed requests' own figures, however
    they ended together: the latency sums (queued, running, total) are the sums
    of the results' seconds, each request queued from its own submission (one
    that joined later, later), and the bytes are theirs; a cancelled request
    counts in neither. A failed batch logs each of its requests, by id and
    lane."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex) as sched:
        try:
            done: list[Any] = []
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            a = await sched.backup({"kv": pages(1, page_size=PS)})
            await anyio.sleep(0.02)
            b = await sched.backup({"kv": pages(2, 3, page_size=PS)})  # joins A, later
            c = await sched.backup({"kv": pages(4, page_size=PS)})  # joins, then is cancelled
            assert a._carrier is b._carrier is c._carrier  # type: ignore[attr-defined]
            assert c.cancel()
            assert sched.statistics().batches_in_flight == 1  # the held one
            trio = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (11, 12, 13)])
            assert trio[0].cancel()  # two left that end together
            gate.set()
            for h in (held, a, b, *trio[1:]):
                done.append(await h)
            d = await sched.backup({"kv": pages(5, page_size=PS)})
            e = await sched.backup({"kv": pages(6, page_size=PS)})  # joins D: every request completes
            many = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (7, 8)])
            for h in (d, e, *many):
                done.append(await h)
            assert done[2].seconds_queued < done[1].seconds_queued  # B joined later
            assert sched.statistics().batches_in_flight == 0
            stats = sched.statistics().backup
            assert stats.completed == len(done) == 9 and stats.cancelled == 2
            assert stats.bytes == sum(r.nbytes for r in done)
            lat = stats.latency
            for hist, seconds in ((lat.queued, [r.seconds_queued for r in done]),
                                  (lat.running, [r.seconds_copying for r in done]),
                                  (lat.total, [r.seconds_total for r in done])):
                assert hist.count == len(done)
                assert hist.sum_seconds == pytest.approx(sum(seconds), rel=1e-9, abs=1e-9), (hist, seconds)
            for r in done:
                sched.free_host(r)
            ex.fail_batches.add(ex.batches_seen)
            failing = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (9, 10)])
            for h in failing:
                with pytest.raises(TransferFailed):
                    await h
            failed = [e for e in kvtier_warnings if e["event"] == "operation.failed"]
            assert sorted((e["operation"], e["lane"]) for e in failed) == sorted((h.id, "backup") for h in failing)
            (batch,) = [e for e in kvtier_warnings if e["event"] == "batch.failed"]
            assert {k: batch[k] for k in ("lane", "operations", "operation_ids")} == {
                "lane": "backup", "operations": 2, "operation_ids": [h.id for h in failing]}, batch
            assert type(batch["batch"]) is int and "injected fault" in batch["error"], batch
            for h in failing:
                assert str(h.exception()).startswith(f"batch {batch['batch']} (backup, 2 operations) failed: ")
        finally:
            gate.set()
    assert used(group)["kv"] == 0


class BrokenFreeAllocator(EngineAllocator):
    """An engine allocator whose ``free`` fails (the engine tore its pool down)."""

    def free(self, indices: torch.Tensor) -> None:
        raise RuntimeError("the engine's allocator is gone")


async def test_a_release_that_fails_is_logged_per_request_and_the_requests_still_end(
    kvtier_warnings: list[Any],
) -> None:
    """A failed `load_many` whose device pages kvtier allocated from an engine
    allocator that refuses them back: every request still ends (with the
    batch's failure), and each is logged as ``operation.release_failed`` with
    its id, its lane and the allocator's error."""
    group = full_attention_group(page_size=PS, device_allocator=True)
    object.__setattr__(group["kv"], "device_allocator", BrokenFreeAllocator(group["kv"].device_allocator))
    ex = FaultInjectingExecutor()
    async with TransferScheduler(group, ex) as sched:
        backups = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (0, 1)])
        for b in backups:
            await b
        ex.fail_batches.add(ex.batches_seen)
        loads = await sched.load_many([b.host_indices for b in backups])
        for h in loads:
            with anyio.fail_after(5), pytest.raises(TransferFailed):
                await h
        logged = [e for e in kvtier_warnings if e["event"] == "operation.release_failed"]
        assert sorted((e["operation"], e["lane"]) for e in logged) == sorted((h.id, "load") for h in loads), logged
        assert all("the engine's allocator is gone" in e["error"] for e in logged), logged
        for b in backups:
            sched.free_host(b)


async def test_an_executor_sees_each_batch_numbered_as_the_lane_logs_it(kvtier_events: list[Any]) -> None:
    """`Batch.id` (what an engine's own executor can name a batch by) is the
    number the lane logs the batch under: distinct ints, in dispatch order."""
    seen: list[Any] = []

    class Recording(NoCopyExecutor):
        async def execute(self, batch: Any, progress: Any) -> None:
            seen.append(batch.id)
            await super().execute(batch, progress)

    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group, Recording()) as sched:
        fresh = sched.statistics()
        assert (fresh.backup.submitted, fresh.backup.queue_depth, fresh.backup.peak_queue_depth,
                fresh.batches_in_flight) == (0, 0, 0, 0)
        for i in range(3):
            sched.free_host(await (await sched.backup({"kv": pages(i, page_size=PS)})))
    logged = [e["batch"] for e in kvtier_events if e["event"] == "batch.dispatched"]
    assert seen == logged and len(set(seen)) == 3 and all(type(b) is int for b in seen), (seen, logged)
    assert seen == sorted(seen)
    # Each batch's end is logged under its number, with what it carried and how it went.
    sent = {e["batch"]: e for e in kvtier_events if e["event"] == "batch.dispatched"}
    ended = [e for e in kvtier_events if e["event"] == "batch.completed"]
    assert [e["batch"] for e in ended] == seen
    for e in ended:
        assert {k: e[k] for k in ("lane", "operations", "nbytes")} == {
            k: sent[e["batch"]][k] for k in ("lane", "operations", "nbytes")} == {
            "lane": "backup", "operations": 1, "nbytes": sent[e["batch"]]["nbytes"]}
        assert e["nbytes"] > 0 and e["ok"] is True and type(e["seconds"]) is float and 0 <= e["seconds"] < 10, e


async def test_a_batch_interrupted_by_the_blocks_error_ends_its_requests_cancelled_naming_it() -> None:
    """The scheduler's block left with an error while a batch's executor waits
    (a cancellable wait, no copy in flight): its requests end with
    `OperationCancelled` naming the batch, never as done."""
    started = anyio.Event()

    class Waiting(NoCopyExecutor):
        async def execute(self, batch: Any, progress: Any) -> None:
            started.set()
            await anyio.sleep_forever()

    group = full_attention_group(page_size=PS)
    handles: list[Any] = []
    with pytest.raises(RuntimeError, match="the engine stopped"):
        async with TransferScheduler(group, Waiting()) as sched:
            handles = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (0, 1)])
            await started.wait()
            raise RuntimeError("the engine stopped")
    for h in handles:
        assert h.done()
        error = h.exception()
        assert isinstance(error, OperationCancelled), error
        assert re.fullmatch(r"batch \d+ was interrupted by cancellation", str(error)), str(error)


async def test_a_batch_of_several_queue_entries_is_logged_with_all_their_requests_and_bytes(
    gate: threading.Event, kvtier_events: list[Any],
) -> None:
    """Two lone backups of different priorities (two queue entries) taken in
    one batch: ``batch.dispatched`` counts both requests and both one's bytes,
    as ``batch.completed`` does."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            a = await sched.backup({"kv": pages(1, page_size=PS)}, priority=1)
            b = await sched.backup({"kv": pages(2, 3, page_size=PS)}, priority=2)
            assert a._carrier is not b._carrier  # type: ignore[attr-defined]
            gate.set()
            results = [await h for h in (held, a, b)]
            want = {"lane": "backup", "operations": 2, "nbytes": results[1].nbytes + results[2].nbytes}
            for name in ("batch.dispatched", "batch.completed"):
                got = [{k: e[k] for k in want} for e in kvtier_events if e["event"] == name]
                assert want in got, (name, got)
            for r in results:
                sched.free_host(r)
        finally:
            gate.set()


async def test_batches_in_flight_counts_each_batch_an_executor_runs_at_once() -> None:
    """An executor that runs two batches at once: both count as in flight until
    they end, then none."""
    release = anyio.Event()
    running: list[int] = []

    class TwoAtOnce(NoCopyExecutor):
        @property
        def max_in_flight(self) -> int:
            return 2

        async def execute(self, batch: Any, progress: Any) -> None:
            running.append(batch.id)
            await release.wait()
            await super().execute(batch, progress)

    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group, TwoAtOnce(), SchedulerConfig(max_batch_ops=1)) as sched:
        handles = [await sched.backup({"kv": pages(i, page_size=PS)}, priority=i) for i in range(2)]
        await wait_until(lambda: len(running) == 2)
        assert sched.statistics().batches_in_flight == 2
        release.set()
        for h in handles:
            sched.free_host(await h)
        assert sched.statistics().batches_in_flight == 0


@pytest.mark.parametrize(("bound", "want"), [("ops", [3, 1]), ("bytes", [3, 1]), ("bytes, less", [2, 2])])
async def test_a_batch_takes_queue_entries_up_to_its_bounds_exactly(
    bound: str, want: list[int], gate: threading.Event,
) -> None:
    """Four queue entries of one request each (four priorities) behind a held
    batch: a batch takes them while its operation count and bytes stay within
    `max_batch_ops` / `max_batch_bytes`, an entry that reaches the bound
    exactly included, one past it left for the next batch. A cancelled entry
    at the queue's head is passed over, not taken."""
    group = full_attention_group(page_size=PS)
    page = PS * group["kv"].slot_nbytes
    config = {"ops": SchedulerConfig(max_batch_ops=3), "bytes": SchedulerConfig(max_batch_bytes=3 * page),
              "bytes, less": SchedulerConfig(max_batch_bytes=3 * page - 1)}[bound]
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex, config) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            doomed = await sched.backup({"kv": pages(9, page_size=PS)}, priority=9)  # the head of the queue
            handles = [await sched.backup({"kv": pages(i, page_size=PS)}, priority=5 - i) for i in range(1, 5)]
            assert doomed.cancel()
            gate.set()
            for h in (held, *handles):
                sched.free_host(await h)
            assert [len(ids) for _, ids in ex.history[1:]] == want, ex.history
            assert sched.statistics().backup.batches == 1 + len(want)
        finally:
            gate.set()
    assert used(group)["kv"] == 0


async def test_a_batch_never_takes_an_entry_whose_requests_would_pass_the_operation_bound(
    gate: threading.Event,
) -> None:
    """Queue entries of two requests each (bulk calls) under `max_batch_ops`=3:
    the second entry would make four, so each batch takes one."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex, SchedulerConfig(max_batch_ops=3)) as sched:
        try:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            first = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (1, 2)], priority=2)
            second = await sched.backup_many([{"kv": pages(i, page_size=PS)} for i in (3, 4)], priority=1)
            gate.set()
            for h in (held, *first, *second):
                sched.free_host(await h)
            assert [len(ids) for _, ids in ex.history[1:]] == [2, 2], ex.history
            assert sched.statistics().backup.max_operations_per_batch == 2
        finally:
            gate.set()
    assert used(group)["kv"] == 0


async def test_the_fault_injecting_executor_holds_a_load_until_its_fence(gate: threading.Event) -> None:
    """`FaultInjectingExecutor` keeps the `CopyExecutor` contract for loads too:
    a load with ``after=`` writes nothing to its device rows before the fence
    is passed."""
    group = full_attention_group(page_size=PS)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    fence = HostFence()
    async with TransferScheduler(group, ex) as sched:
        try:
            (backed,) = await _backed_up(sched, gate, [{"kv": pages(0, page_size=PS)}])
            gate.set()
            want = rows(group, "kv", pages(0, page_size=PS))
            wipe(group)
            load = await sched.load(backed.host_indices, {"kv": pages(1, page_size=PS)}, after=fence)
            await anyio.sleep(0.05)
            assert not load.done()
            assert all(bool((t == 0).all()) for t in rows(group, "kv", pages(1, page_size=PS)))
            fence.released.set()
            await load
            assert_rows_equal(rows(group, "kv", pages(1, page_size=PS)), want)
            sched.free_host(backed)
        finally:
            gate.set()
            fence.released.set()
    assert used(group)["kv"] == 0
