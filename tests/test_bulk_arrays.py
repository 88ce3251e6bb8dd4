"""The array-native bulk calls (`backup_arrays`, `load_arrays`): one call, one
`BulkOperation` awaited once, a `BulkResult` of arrays. Round trips compare
the bytes; failures, cancellation, valid rows and named host pages keep their
per-request meaning; bad input names the request and changes nothing."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest
import torch
from conftest import assert_rows_equal, pages, rows, used, wait_until, wipe

from kvtier import InvalidIndices, SchedulerClosed, SchedulerConfig, TransferScheduler
from kvtier.scheduler import BulkResult
from kvtier.testing import FaultInjectingExecutor, full_attention_group, hybrid_group

PS = 8  # hybrid_group's page size


def flat(requests: list[list[int]], page_size: int = PS) -> tuple[np.ndarray, np.ndarray]:
    """The slots of each request's pages, one after the other, and the slot offsets."""
    slots = [np.arange(p * page_size, (p + 1) * page_size) for r in requests for p in r]
    off = np.cumsum([0] + [len(r) * page_size for r in requests])
    return (np.concatenate(slots) if slots else np.empty(0, dtype=np.int64)).astype(np.int64), off


def of(result: BulkResult, pool: str, i: int, *, host: bool = True) -> torch.Tensor:
    idx = (result.host_indices if host else result.device_indices)[pool]
    off = result.offsets[pool]
    return idx[int(off[i]):int(off[i + 1])]


@pytest.mark.parametrize("form", ["flat", "2d", "torch"])
async def test_backup_then_load_arrays_round_trip_every_pool_byte_exact(form: str) -> None:
    group = hybrid_group(device_allocator=True)
    reqs = [[0, 1], [2, 3], [4, 5]]
    kv, off = flat(reqs)
    state = np.array([[0], [1], [2]])  # one state slot per request: a 2-D array
    if form == "flat":
        indices, offsets = {"kv": kv, "state": state.reshape(-1)}, {"kv": off, "state": np.arange(4)}
    elif form == "2d":
        indices, offsets = {"kv": kv.reshape(3, -1), "state": state}, None
    else:
        indices, offsets = {"kv": torch.from_numpy(kv), "state": torch.from_numpy(state)}, {"kv": torch.from_numpy(off)}
    async with TransferScheduler(group) as sched:
        bulk = await sched.backup_arrays(indices, offsets)  # type: ignore[arg-type]
        result = await bulk
        assert result.all_ok and result.status.tolist() == [0, 0, 0] and result.count == 3
        assert set(result.host_indices) >= {"kv", "c4", "state"}
        dev = result.device_indices
        want = {name: rows(group, name, dev[name]) for name in dev}
        assert result.nbytes == sum(h.nbytes for h in bulk.handles())
        wipe(group)
        load = await sched.load_arrays(result.host_indices, result.offsets)  # sidecar entries as given
        got = await load
        assert got.all_ok
        for name, w in want.items():
            assert_rows_equal(rows(group, name, got.device_indices[name]), w)
        # Per request, the same slots as its own handle would give.
        for i, h in enumerate(load.handles()):
            assert torch.equal(h.device_indices["kv"], of(got, "kv", i, host=False))
        sched.free_host(result)
        group["kv"].device_allocator.free(got.device_indices["kv"])  # type: ignore[union-attr]
        group["state"].device_allocator.free(got.device_indices["state"])  # type: ignore[union-attr]
    assert all(v in (0, None) for v in used(group).values())


async def test_a_failed_batch_fails_only_its_requests_and_gives_back_their_pages() -> None:
    group = full_attention_group(page_size=4)
    ex = FaultInjectingExecutor(fail_batches={1})
    kv, off = flat([[i] for i in range(6)], page_size=4)
    async with TransferScheduler(group, ex, SchedulerConfig(max_batch_ops=2)) as sched:
        want = [rows(group, "kv", pages(i, page_size=4)) for i in range(6)]
        result = await (await sched.backup_arrays({"kv": kv}, {"kv": off}))
        assert result.status.tolist() == [0, 0, 1, 1, 0, 0]
        assert set(result.errors) == {2, 3} and not result.ok[2:4].any()
        assert used(group)["kv"] == 4 * 4  # the failed requests' host pages went back
        wipe(group)
        ok = np.flatnonzero(result.ok)
        host = torch.cat([of(result, "kv", int(i)) for i in ok])
        dst = torch.cat([pages(10 + int(i), page_size=4) for i in ok])
        back = await (await sched.load_arrays({"kv": host.reshape(len(ok), -1)},
                                              device_indices={"kv": dst.reshape(len(ok), -1)}))
        assert back.all_ok
        for k, i in enumerate(ok):
            assert_rows_equal(rows(group, "kv", pages(10 + int(i), page_size=4)), want[int(i)])
        sched.free_host(result)  # frees the completed requests' pages only
        assert used(group)["kv"] == 0


async def test_cancelled_requests_end_cancelled_and_the_rest_land(gate: threading.Event) -> None:
    group = full_attention_group(page_size=4)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    kv, off = flat([[i] for i in range(6)], page_size=4)
    async with TransferScheduler(group, ex, SchedulerConfig(max_batch_ops=2)) as sched:
        want = [rows(group, "kv", pages(i, page_size=4)) for i in range(6)]
        first = await sched.backup_arrays({"kv": kv[:4]}, {"kv": off[:2]})  # holds the lane's runner
        bulk = await sched.backup_arrays({"kv": kv}, {"kv": off})
        assert bulk.cancel([1, 4]) == 2 and bulk.cancel([1]) == 0
        gate.set()
        await first
        result = await bulk
        assert result.status.tolist() == [0, 2, 0, 0, 2, 0]
        assert used(group)["kv"] == 4 * 4 + 4  # four kept, and the first call's page
        wipe(group)
        ok = np.flatnonzero(result.ok)
        back = await (await sched.load_arrays({"kv": torch.cat([of(result, "kv", int(i)) for i in ok])},
                                              {"kv": np.arange(len(ok) + 1) * 4},
                                              device_indices={"kv": np.arange(len(ok) * 4)}))
        assert back.all_ok
        for k, i in enumerate(ok):
            assert_rows_equal(rows(group, "kv", pages(k, page_size=4)), want[int(i)])
        sched.free_host(result)
        sched.free_host(await first)
        assert used(group)["kv"] == 0


async def test_bad_input_names_the_request_and_changes_nothing() -> None:
    group = hybrid_group()
    async with TransferScheduler(group) as sched:
        before = used(group)
        kv, off = flat([[0], [1], [2]])
        bad = kv.copy()
        bad[2 * PS:3 * PS] += 1  # request 2's page is not aligned
        with pytest.raises(InvalidIndices, match="request 2: .*page boundary") as info:
            await sched.backup_arrays({"kv": bad}, {"kv": off})
        assert info.value.rule == "page-aligned"
        dup = np.concatenate([kv[:PS], kv[:PS]])  # request 0 names page 0 twice
        with pytest.raises(InvalidIndices, match="request 0: .*repeat page 0"):
            await sched.backup_arrays({"kv": dup}, {"kv": np.array([0, 2 * PS])})
        # Two requests may name the same page (each its own backup).
        with pytest.raises(InvalidIndices, match="request 1: .*has 64 device slots"):
            await sched.backup_arrays({"kv": np.array([kv[:PS], kv[:PS] + 64 * 8])})
        with pytest.raises(InvalidIndices, match="offsets\\['kv'\\] must start at 0") as info:
            await sched.backup_arrays({"kv": kv}, {"kv": off + 1})
        with pytest.raises(InvalidIndices, match="pass offsets\\['kv'\\]"):
            await sched.backup_arrays({"kv": kv})
        with pytest.raises(InvalidIndices, match="request 1: an operation names at least one pool"):
            await sched.backup_arrays({"kv": kv[:PS]}, {"kv": np.array([0, PS, PS])})
        with pytest.raises(InvalidIndices, match="for 2 requests, another pool for 3"):
            await sched.backup_arrays({"kv": kv.reshape(3, -1), "state": np.array([[0], [1]])})
        with pytest.raises(InvalidIndices, match="must hold integers"):
            await sched.backup_arrays({"kv": kv.astype(np.float32).reshape(3, -1)})
        with pytest.raises(InvalidIndices, match="unknown pool 'nope'"):
            await sched.backup_arrays({"nope": kv.reshape(3, -1)})
        with pytest.raises(InvalidIndices, match="request 1: pool 'kv' has 8 rows .* got 9"):
            await sched.backup_arrays({"kv": kv.reshape(3, -1)}, valid_rows={"kv": [8, 9, 0]})
        with pytest.raises(InvalidIndices, match="host page 0 is not allocated"):
            await sched.load_arrays({"kv": kv.reshape(3, -1)})
        assert used(group) == before and not any(group.valid_rows.values())


async def test_valid_rows_per_request_move_only_those_rows() -> None:
    group = hybrid_group()
    kv, off = flat([[0, 1], [2], [4, 5]])
    async with TransferScheduler(group) as sched:
        before = sched.executor.statistics().nbytes  # type: ignore[attr-defined]
        bulk = await sched.backup_arrays({"kv": kv}, {"kv": off}, valid_rows={"kv": [11, 8, 2], "c4": [0, 2, 4]})
        result = await bulk
        moved = sched.executor.statistics().nbytes - before  # type: ignore[attr-defined]
        slot, c4 = group["kv"].slot_nbytes, group["c4"].slot_nbytes
        assert moved == (11 + 8 + 2) * slot + (0 + 2 + 4) * c4 == result.nbytes
        assert result.bytes_per_pool["kv"] == 21 * slot
        want = [rows(group, "kv", torch.from_numpy(kv[a:a + n])) for a, n in zip(off[:-1], (11, 8, 2))]
        wipe(group)
        dst = {"kv": np.arange(kv.size)}
        back = await (await sched.load_arrays({"kv": result.host_indices["kv"]}, {"kv": off}, device_indices=dst))
        for i, n in enumerate((11, 8, 2)):
            got = of(back, "kv", i, host=False)
            assert_rows_equal(rows(group, "kv", got[:n]), want[i])
            assert all(bool((t == 0).all()) for t in rows(group, "kv", got[n:]))
        sched.free_host(result)
    assert not any(group.valid_rows.values())


async def test_named_host_pages_are_taken_all_or_nothing() -> None:
    group = full_attention_group(page_size=4)
    kv, off = flat([[0], [1]], page_size=4)
    async with TransferScheduler(group) as sched:
        taken = await (await sched.backup_arrays({"kv": kv}, {"kv": off}, host_indices={"kv": kv + 40}))
        assert torch.equal(taken.host_indices["kv"], torch.from_numpy(kv + 40))
        before = used(group)
        with pytest.raises(InvalidIndices, match="host") as info:  # page 10 is held: nothing is taken
            await sched.backup_arrays({"kv": kv}, {"kv": off}, host_indices={"kv": np.concatenate([kv[:4] + 80, kv[4:] + 40])})
        assert info.value.rule == "host-pages-free" and used(group) == before
        with pytest.raises(InvalidIndices, match="request 0: .*8 host indices and 4 device"):
            await sched.backup_arrays({"kv": np.arange(8).reshape(2, 4)}, host_indices={"kv": np.arange(16, 32).reshape(2, 8)})
        sched.free_host(taken)
        assert used(group)["kv"] == 0


async def test_a_bulk_call_is_awaited_once_and_asked_for_handles_only() -> None:
    group = full_attention_group(page_size=4)
    kv, off = flat([[i] for i in range(3)], page_size=4)
    async with TransferScheduler(group) as sched:
        bulk = await sched.backup_arrays({"kv": kv.reshape(3, -1)})
        with anyio.fail_after(10):
            result = await bulk
        assert bulk.done() and (await bulk) is result
        handles = bulk.handles()
        assert [h.done() for h in handles] == [True] * 3
        for i, h in enumerate(handles):
            assert torch.equal(h.host_indices["kv"], of(result, "kv", i))
        # Handed arrays are the caller's: a write changes no later read.
        first = result.host_indices["kv"]
        want = first.clone()
        first.numpy()[:] = -1
        assert torch.equal(result.host_indices["kv"], want)
        sched.free_host(result)
        assert used(group)["kv"] == 0


async def test_a_failed_load_batch_frees_the_device_slots_it_allocated_and_keeps_the_host_pages() -> None:
    group = full_attention_group(page_size=4, device_allocator=True)
    ex = FaultInjectingExecutor(fail_batches={4})  # the backup takes batches 0..2, the load 3..5
    kv, off = flat([[i] for i in range(6)], page_size=4)
    async with TransferScheduler(group, ex, SchedulerConfig(max_batch_ops=2)) as sched:
        want = [rows(group, "kv", pages(i, page_size=4)) for i in range(6)]
        backed = await (await sched.backup_arrays({"kv": kv}, {"kv": off}))
        assert backed.all_ok
        alloc = group["kv"].device_allocator
        assert alloc is not None
        free_before = alloc.num_free_slots
        wipe(group)
        loaded = await (await sched.load_arrays(backed.host_indices, backed.offsets))
        assert loaded.status.tolist() == [0, 0, 1, 1, 0, 0]
        assert alloc.num_free_slots == free_before - 4 * 4  # the failed requests' device slots went back
        ok = (0, 1, 4, 5)
        for i in ok:
            assert_rows_equal(rows(group, "kv", of(loaded, "kv", i, host=False)), want[i])
        alloc.free(torch.cat([of(loaded, "kv", i, host=False) for i in ok]))
        sched.free_host(loaded)  # a load's result: every request's host pages, failed or not
        assert used(group)["kv"] == 0


async def test_a_bulk_call_cancelled_while_it_waits_for_room_takes_nothing(gate: threading.Event) -> None:
    group = full_attention_group(page_size=1, host_slots=64, device_slots=64)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    async with TransferScheduler(group, ex, SchedulerConfig(max_queued_ops=4, max_batch_ops=2)) as sched:
        first = await sched.backup_arrays({"kv": np.arange(4).reshape(4, 1)})  # fills the lane
        before = used(group)
        with anyio.move_on_after(0.2) as scope:
            await sched.backup_arrays({"kv": np.arange(4, 8).reshape(4, 1)})
        assert scope.cancelled_caught
        assert used(group) == before  # its pages went back
        gate.set()
        sched.free_host(await first)
        assert used(group)["kv"] == 0


async def test_a_cancelling_close_reports_the_queued_requests_cancelled(gate: threading.Event) -> None:
    """on_close="cancel" ends a bulk call's queued requests: the caller closed
    the scheduler, no request failed, so they read as cancelled (status 2),
    their error SchedulerClosed, and their host pages come back."""
    group = full_attention_group(page_size=4)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    kv, off = flat([[i] for i in range(4)], page_size=4)
    try:
        async with TransferScheduler(group, ex, SchedulerConfig(max_batch_ops=1, on_close="cancel")) as sched:
            first = await sched.backup_arrays({"kv": kv[:4]}, {"kv": off[:2]})  # holds the lane's runner
            await wait_until(lambda: sched.statistics().backup.batches == 1)
            bulk = await sched.backup_arrays({"kv": kv}, {"kv": off})
            gate.set()  # the held batch ends; nothing else is taken before the close below
    finally:
        gate.set()
    result = await bulk
    assert result.status.tolist() == [BulkResult.CANCELLED] * 4
    assert all(isinstance(e, SchedulerClosed) for e in result.errors.values()) and len(result.errors) == 4
    assert (await first).all_ok
    sched.free_host(await first)
    assert used(group)["kv"] == 0
