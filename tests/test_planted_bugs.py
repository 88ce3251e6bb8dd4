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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from types import SimpleNamespace

import anyio
import pytest
import torch
from conftest import pages, used

from kvtier import CorruptionDetected, InvalidIndices, SchedulerConfig, TransferScheduler
from kvtier.pools import PoolGroup
from kvtier.scheduler import verify
from kvtier.storage import KeyNamespace, PageBlobs, StorageError, page_keys
from kvtier.testing import MemoryStore, full_attention_group, hybrid_group

WAIT_S = 20
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
