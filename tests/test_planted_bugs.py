"""Edges that one-line bugs hid behind (issue 21, point 6), each pinned by an
explicit case rather than left to a lucky draw: verify mode's checksum sees
bytes moved within a page (rows swapped, a layer's bytes swapped with
another's) and skips a pool without checksums instead of stopping there; a
bulk load pairs each request's own host and device counts; a stored run ends
at the first gap; a failed prefetch reports no page done; a batch takes
operations that fill its byte budget exactly; the Prometheus ``+Inf`` bucket
counts operations past the last bound; a V4 prefix with exactly one CSA entry
has overlap state. Every wait has a deadline (conftest's, and
``anyio.fail_after`` here), so a bug that leaves a handle unresolved fails in
seconds.

Issue 30's scheduler classes (point 6), each planted once and seen to fail
here: a lone joined request's offsets in its carrier, a handle's cached
result dropped, the byte split of a bulk call, the sidecar check of a load
request, `StepClock` resetting its time, a layer waiter never woken (fails
within ``LAYER_WAIT_S``) and a lane bound that spins on the loop's thread
(fails within ``LANE_DEADLINE_S``, pytest-timeout's signal: no await there).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Sequence
from types import SimpleNamespace

import anyio
import pytest
import torch
from conftest import assert_rows_equal, pages, rows, used, wait_until, wipe

from kvtier.bench.core import NoCopyExecutor
from kvtier import CorruptionDetected, InvalidIndices, SchedulerConfig, TransferFailed, TransferScheduler
from kvtier.pools import PoolGroup
from kvtier.scheduler import verify
from kvtier.storage import KeyNamespace, PageBlobs, StorageError, page_keys
from kvtier.testing import FaultInjectingExecutor, MemoryStore, full_attention_group, hybrid_group

WAIT_S = 20
# pytest-timeout's limit for the tests whose bug could spin the loop's thread
# (a lane's batch bound): no await there, so only a signal ends it.
LANE_DEADLINE_S = 20
LAYER_WAIT_S = 5
PS = 8  # hybrid_group's page size


def kv(*ps: int) -> torch.Tensor:
    return pages(*ps, page_size=PS)


# -- verify mode's checksum ------------------------------------------------------------


def _randomize(group: PoolGroup, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for spec in group:
        host = spec.host
        for p in range(len(host.planes)):
            buf = host.buffer(p)  # type: ignore[union-attr]
            if buf.dtype.is_floating_point:
                buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
            else:
                buf.copy_(torch.randint(-100, 100, buf.shape, generator=gen).to(buf.dtype))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("move", ["rows", "layers"])
def test_bytes_moved_within_a_page_change_its_checksum(layout: str, move: str) -> None:
    """Two rows of a page swapped, or the page's bytes of layer 0 swapped with
    layer 1's: every byte value is still there, so a sum that does not weigh
    position (or weighs every position alike) sees nothing. xxh3 over the
    page in memory order sees both."""
    group = hybrid_group(layout=layout)  # type: ignore[arg-type]
    if group["kv"].host.num_layers < 2:
        pytest.skip("needs two layers")
    _randomize(group, 3)
    page = 5
    before = verify.record(group, {"kv": [page, page + 1]})
    host = group["kv"].host
    rows = slice(page * PS, (page + 1) * PS)
    for plane in range(len(host.planes)):
        a, b = host.layer_view(0, plane), host.layer_view(1, plane)
        if move == "rows":
            first, second = a[page * PS].clone(), a[page * PS + 3].clone()
            assert not torch.equal(first, second)
            a[page * PS], a[page * PS + 3] = second, first
        else:
            assert not torch.equal(a[rows], b[rows])
            saved = a[rows].clone()
            a[rows] = b[rows]
            b[rows] = saved
    assert verify.mismatches(before, group, {"kv": [page, page + 1]}) == ("kv", [page])
    # Moving them back restores the checksum: it is of the bytes, nothing else.
    for plane in range(len(host.planes)):
        a, b = host.layer_view(0, plane), host.layer_view(1, plane)
        if move == "rows":
            first, second = a[page * PS].clone(), a[page * PS + 3].clone()
            a[page * PS], a[page * PS + 3] = second, first
        else:
            saved = a[rows].clone()
            a[rows] = b[rows]
            b[rows] = saved
    assert verify.mismatches(before, group, {"kv": [page, page + 1]}) is None


def test_a_pool_without_checksums_is_skipped_not_the_end_of_the_check() -> None:
    """kv's pages have no checksum (written while verify mode was off), swa's
    do and one changed: the check must go past kv and its sidecar to swa."""
    group = hybrid_group()
    _randomize(group, 4)
    owners = {"kv": [2], "swa": [3]}
    assert [p for p, _ in verify.pools_with_bytes(group, owners)][0] == "kv"  # kv is looked at first
    store = verify.record(group, {"swa": [3]})
    group["swa"].host.layer_view(0, 0)[3 * PS] += 1
    assert verify.mismatches(store, group, owners) == ("swa", [3])
    assert verify.corrupted(store, group, [{"kv": [2]}, owners]) == [(1, "swa", [3])]


async def test_verify_mode_fails_a_load_whose_page_had_two_rows_swapped() -> None:
    group = hybrid_group()
    async with TransferScheduler(group, config=SchedulerConfig(verify=True)) as sched:
        with anyio.fail_after(WAIT_S):
            b = await sched.backup({"kv": kv(1)})
            await b
        view = group["kv"].host.layer_view(0, 0)
        first = int(b.host_indices["kv"][0])
        top, bottom = view[first].clone(), view[first + 1].clone()
        view[first], view[first + 1] = bottom, top
        with anyio.fail_after(WAIT_S):
            load = await sched.load({"kv": b.host_indices["kv"]}, {"kv": kv(4)})
            with pytest.raises(CorruptionDetected) as err:
                await load
        assert err.value.pool == "kv"
        sched.free_host({"kv": b.host_indices["kv"]})


# -- bulk loads pair each request's own counts ---------------------------------------------


async def test_load_many_with_equal_totals_but_other_counts_per_request_is_refused() -> None:
    """Host counts (2, 1) and device counts (1, 2): the same three pages in all,
    so a check of the totals (or of which pools are named) passes, and request
    0 would write the device page request 1 named."""
    group = hybrid_group()
    async with TransferScheduler(group) as sched:
        with anyio.fail_after(WAIT_S):
            b = await sched.backup({"kv": kv(0, 1, 2)})
            await b
        h = b.host_indices["kv"]
        before = used(group)
        with pytest.raises(InvalidIndices, match=r"request 0: pool 'kv' has 16 host indices and 8 device indices; "
                                                 r"they must be equal") as err:
            await sched.load_many([{"kv": h[:2 * PS]}, {"kv": h[2 * PS:]}], [{"kv": kv(4)}, {"kv": kv(5, 6)}])
        assert err.value.rule == "equal-lengths"
        assert used(group) == before
        assert sched.statistics().load.submitted == 0
        sched.free_host({"kv": h})


# -- the storage lanes' counts ------------------------------------------------------------


def _keys(group: PoolGroup, n: int) -> list[bytes]:
    return page_keys(KeyNamespace.for_pool(group, "kv", model="m"), list(range(n * PS)))


async def _store(sched: TransferScheduler, keys: list[bytes], positions: Sequence[int]) -> None:
    with anyio.fail_after(WAIT_S):
        b = await sched.backup({"kv": kv(*range(len(keys)))})
        await b
        host = b.host_indices["kv"]
        chosen = torch.cat([host[i * PS:(i + 1) * PS] for i in positions])
        await (await sched.write_storage({"kv": chosen}, {"kv": [keys[i] for i in positions]}))
    sched.free_host({"kv": host})


async def test_a_stored_run_ends_at_the_first_gap_whatever_is_stored_after_it() -> None:
    group = hybrid_group()
    store = MemoryStore()
    async with TransferScheduler(group, storage=store) as sched:
        keys = _keys(group, 4)
        await _store(sched, keys, [0, 2, 3])  # page 1 missing: three stored, one run of one
        store.hold(("get",))
        with anyio.fail_after(WAIT_S):
            h = await sched.prefetch({"kv": keys}, policy="wait_complete")
            while not store.waiting:
                await anyio.sleep(0.001)
            # The lookup's answer, before any read could shorten it: one page, and only it is read.
            assert h.hit_pages == {"kv": 1}
            assert store.waiting == [("get", (keys[0],))]
            store.release()
            result = await h
        assert dict(result.hit_pages) == {"kv": 1} == dict(result.pages) == h.hit_pages
        stats = sched.statistics().storage
        assert stats is not None and (stats.pages_hit, stats.pages_missed, stats.pages_stopped) == (1, 3, 0)
        sched.free_host(dict(result.host_indices))


class FailingSecondGet:
    """A `MemoryStore` whose second ``get`` raises."""

    name = "failing"

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.gets = 0

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await self.inner.exists(keys)

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        self.gets += 1
        if self.gets == 2:
            raise StorageError("the second get fails", backend=self.name, operation="get")
        return await self.inner.get(keys, pools)

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        await self.inner.put(pages)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_prefetch_that_fails_after_some_rounds_reports_no_page_done() -> None:
    group = hybrid_group()
    store = FailingSecondGet(MemoryStore())
    async with TransferScheduler(group, storage=store, config=SchedulerConfig(storage_chunk_bytes=1)) as sched:
        base = used(group)
        keys = _keys(group, 3)
        await _store(sched, keys, [0, 1, 2])
        with anyio.fail_after(WAIT_S):
            h = await sched.prefetch({"kv": keys}, policy="wait_complete")
            with pytest.raises(StorageError, match="the second get fails"):
                await h
        assert store.gets == 2  # one round of one page read, then the failure
        assert dict(h.pages_done) == {"kv": 0}  # its pages were freed with the failure
        assert used(group) == base


# -- a batch takes what fills its byte budget exactly -------------------------------------


@pytest.mark.timeout(LANE_DEADLINE_S)
async def test_operations_that_fill_the_byte_budget_exactly_share_one_batch() -> None:
    group = full_attention_group(page_size=4)
    async with TransferScheduler(group) as sched:
        with anyio.fail_after(WAIT_S):
            await (await sched.backup({"kv": pages(0, page_size=4)}))
        one = sched.statistics().backup.bytes
    assert one > 0
    for budget, batches in ((2 * one, 1), (2 * one - 1, 2)):
        group = full_attention_group(page_size=4)
        async with TransferScheduler(group, config=SchedulerConfig(max_batch_bytes=budget)) as sched:
            with anyio.fail_after(WAIT_S):
                # Other priorities: two queue entries (a lone request joins the
                # newest queued carrier only at its own priority).
                a = sched.backup_nowait({"kv": pages(0, page_size=4)}, priority=1)
                b = sched.backup_nowait({"kv": pages(1, page_size=4)}, priority=0)
                await a
                await b
            d = sched.statistics().backup
            assert (d.batches, d.operations_batched, d.bytes) == (batches, 2, 2 * one), budget


# -- the +Inf bucket counts operations past the last bound ---------------------------------


def test_the_inf_bucket_counts_operations_slower_than_every_bound() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.metrics import KvtierCollector
    from kvtier.scheduler import LATENCY_BUCKETS_S
    from kvtier.scheduler.statistics import LaneCounters

    counters = LaneCounters()
    past = round(LATENCY_BUCKETS_S[-1] * 1e9) * 10
    counters.ended(1, "load", None, 0, queued_ns=1, running_ns=1)
    counters.ended(2, "load", None, 0, queued_ns=past, running_ns=1)  # slower than every bound
    latency = counters.latency()
    assert latency.queued.counts[-1] == 1
    group = full_attention_group(page_size=4)
    sched = TransferScheduler(group)
    real = sched.statistics()
    crafted = dataclasses.replace(real, load=dataclasses.replace(real.load, latency=latency))
    sched.statistics = lambda: crafted  # type: ignore[method-assign]
    registry = CollectorRegistry()
    registry.register(KvtierCollector(sched))
    samples = {
        (s.name, s.labels.get("le")): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
        if s.labels.get("lane") == "load" and s.labels.get("stage") == "queued"
    }
    name = "kvtier_operation_latency_seconds"
    assert samples[(f"{name}_bucket", repr(LATENCY_BUCKETS_S[-1]))] == 1
    assert samples[(f"{name}_bucket", "+Inf")] == 2 == samples[(f"{name}_count", None)]


# -- V4: one CSA entry is enough for overlap state ------------------------------------------


def test_a_v4_prefix_with_exactly_one_csa_entry_has_overlap_state() -> None:
    from kvtier.presets import deepseek_v4_stack

    csa, hca, sliding = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
    config = SimpleNamespace(layer_types=[sliding, csa, hca], compress_rates={csa: 4, hca: 16}, sliding_window=16,
                             head_dim=8, index_head_dim=4, num_key_value_heads=1)
    stack = deepseek_v4_stack(config)
    assert [stack.lengths(n).has_overlap for n in (1, 3, 4, 5, 7, 8)] == [False, False, True, True, True, True]
    assert (stack.lengths(4).c4_entries, stack.lengths(4).c4_buffered) == (1, 0)


# -- scheduler classes of issue 30, point 6 ---------------------------------------------------


async def test_lone_requests_that_join_one_carrier_each_get_their_own_pages_back(gate: threading.Event) -> None:
    """Lone backups submitted while the lane's newest carrier is queued join it:
    one pool alone (the fast path), a pool the carrier lacks, and two pools.
    Each handle gives exactly its own pages, and each loads its own bytes back."""
    group = hybrid_group()
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    requests = [
        {"kv": kv(0)}, {"kv": kv(1, 2)}, {"kv": kv(3)},  # kv alone: the carrier's one pool
        {"state": torch.tensor([0])},  # a pool the carrier does not have yet
        {"kv": kv(4, 5), "state": torch.tensor([1])}, {"kv": kv(6)},
    ]
    async with TransferScheduler(group, ex) as sched:
        with anyio.fail_after(WAIT_S):
            holder = await sched.backup({"kv": kv(7)})  # its batch holds the lane's runner
            await wait_until(lambda: holder.state == "running")
            handles = [await sched.backup(r) for r in requests]
            gate.set()
            await holder
            for h in handles:
                await h
        assert len(ex.history) == 2, ex.history  # the lone requests rode one carrier
        want = [{n: rows(group, n, i) for n, i in r.items()} for r in requests]
        for h, r in zip(handles, requests):
            host = h.host_indices
            assert {n for n in host if n in r} == set(r)
            assert all(host[n].numel() == r[n].numel() for n in r), (host, r)
            assert h.bytes_per_pool == {n: b for n, b in h.bytes_per_pool.items()} and h.nbytes == h.outcome().nbytes
        wipe(group)
        for h, w, r in zip(handles, want, requests):
            with anyio.fail_after(WAIT_S):
                await (await sched.load({n: h.host_indices[n] for n in r}, r))
            for n, rows_before in w.items():
                assert_rows_equal(rows(group, n, r[n]), rows_before)
        for h in (holder, *handles):
            sched.free_host(h)
    assert all(v in (0, None) for v in used(group).values())


async def test_awaiting_a_handle_again_gives_the_same_result() -> None:
    group = full_attention_group(page_size=4)
    async with TransferScheduler(group) as sched:
        with anyio.fail_after(WAIT_S):
            lone = await sched.backup({"kv": pages(0, page_size=4)})
            many = await sched.backup_many([{"kv": pages(i, page_size=4)} for i in (1, 2)])
            for h in (lone, *many):
                first = await h
                assert (await h) is first and h.outcome() is first and (await h.wait()) is first
        sched.free_host(lone)
        for h in many:
            sched.free_host(h)


@pytest.mark.timeout(LANE_DEADLINE_S)  # a broken bound that loops on the loop fails here, not at 120 s
@pytest.mark.parametrize("pools", [("kv",), ("kv", "state")])
async def test_a_bulk_call_is_cut_into_batches_that_keep_the_byte_budget(pools: tuple[str, ...]) -> None:
    """Seven requests of one page per pool, a budget of three requests' bytes
    (or of three and a bit): every batch holds at most the budget, so three
    batches of 3, 3 and 1 requests, whichever way the call was cut."""
    group = hybrid_group(state_slots=16)
    requests = [{"kv": kv(i), **({"state": torch.tensor([i])} if "state" in pools else {})} for i in range(7)]
    probe = hybrid_group(state_slots=16)
    async with TransferScheduler(probe) as sched:
        with anyio.fail_after(WAIT_S):
            one = (await (await sched.backup(requests[0]))).nbytes
    for budget in (3 * one, 4 * one - 1):
        group = hybrid_group(state_slots=16)
        ex = FaultInjectingExecutor()
        async with TransferScheduler(group, ex, SchedulerConfig(max_batch_bytes=budget)) as sched:
            with anyio.fail_after(WAIT_S):
                handles = await sched.backup_many(requests)
                for h in handles:
                    await h
                bulk = await (await sched.backup_arrays(
                    {n: torch.cat([r[n] for r in requests]).reshape(7, -1) for n in pools}))
            assert [len(ids) for _, ids in ex.history] == [3, 3, 1, 3, 3, 1], (budget, ex.history)
            assert sched.statistics().backup.bytes == 14 * one
            assert bulk.all_ok
            for h in handles:
                sched.free_host(h)
            sched.free_host(bulk)


async def test_a_load_whose_sidecar_entry_is_not_what_its_source_derives_is_refused() -> None:
    group = hybrid_group()
    async with TransferScheduler(group) as sched:
        with anyio.fail_after(WAIT_S):
            b = await sched.backup({"kv": kv(0, 1)})
            await b
        host = b.host_indices
        assert "c4" in host
        before = used(group)
        wrong = host["c4"].flip(0)  # the same rows in another order: another page's rows first
        shifted = host["c4"] + host["c4"].numel()  # rows of other pages
        for bad in (wrong, shifted, host["c4"][:-1]):
            with pytest.raises(InvalidIndices) as info:
                await sched.load({"kv": host["kv"], "c4": bad}, {"kv": kv(2, 3)})
            assert info.value.rule in ("derived-indices", "page-aligned", "whole-pages"), info.value
            with pytest.raises(InvalidIndices):
                await sched.load_many([{"kv": host["kv"], "c4": bad}], [{"kv": kv(2, 3)}])
            with pytest.raises(InvalidIndices):
                await sched.load_arrays({"kv": host["kv"][None], "c4": bad[None]}, device_indices={"kv": kv(2, 3)[None]})
        assert used(group) == before
        with anyio.fail_after(WAIT_S):  # what the handle gave is accepted as it is
            await (await sched.load({"kv": host["kv"], "c4": host["c4"]}, {"kv": kv(2, 3)}))
        sched.free_host(b)


async def test_a_long_bulk_call_lets_the_loop_run_while_it_works() -> None:
    """A bulk call slices its checks and carriers (`StepClock`): another task
    runs while it works, not only once it returns."""
    n = 16_000
    group = full_attention_group(page_size=1, device_slots=n, host_slots=n, layers=1)
    requests = [{"kv": idx} for idx in torch.split(torch.arange(n), 1)]
    ticks = 0
    working = False
    seen_while_working = 0

    async def ticker() -> None:
        nonlocal ticks, seen_while_working
        while True:
            await anyio.sleep(0)
            ticks += 1
            seen_while_working += working

    async with TransferScheduler(group, NoCopyExecutor()) as sched:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.sleep(0)
            working = True
            with anyio.fail_after(WAIT_S):
                handles = await sched.backup_many(requests)
            working = False
            tg.cancel_scope.cancel()
        assert seen_while_working >= 2, seen_while_working
        with anyio.fail_after(WAIT_S):
            for h in handles:
                await h
        sched.free_host({"kv": torch.arange(n)})


async def test_a_layer_waiter_wakes_once_its_layer_lands_and_a_failed_one_raises() -> None:
    """Every layer's waiter returns (a broken waiter fails here within
    LAYER_WAIT_S instead of hanging), after the end as before it, and a
    failed load's waiter raises its error."""
    group = full_attention_group(page_size=4, layers=4)
    ex = FaultInjectingExecutor(fail_batches={2}, fail_at_layer=2)
    async with TransferScheduler(group, ex) as sched:
        with anyio.fail_after(WAIT_S):
            b = await sched.backup({"kv": pages(0, 1, page_size=4)})
            await b
        for attempt in range(2):  # batch 1 succeeds, batch 2 fails at layer 2
            load = await sched.load(b.host_indices, {"kv": pages(4, 5, page_size=4)})
            raised = []
            for layer in reversed(range(group.num_layers)) if attempt == 0 else range(group.num_layers):
                with anyio.fail_after(LAYER_WAIT_S):
                    try:
                        await load.layer_ready(layer)
                    except TransferFailed:
                        raised.append(layer)
            # Layers past the fault never land; those before it may have been awaited before the end.
            assert raised == [] if attempt == 0 else {2, 3} <= set(raised), raised
            with anyio.fail_after(LAYER_WAIT_S):
                await load.settled()
                for layer in range(group.num_layers):  # after the end: at once, or its error
                    if load.exception() is None:
                        await load.layer_ready(layer)
                    else:
                        with pytest.raises(TransferFailed):
                            await load.layer_ready(layer)
        sched.free_host(b)
