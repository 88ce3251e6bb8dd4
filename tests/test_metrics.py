"""Latency histograms and storage page counters in `statistics()`, and their
Prometheus exposition through `kvtier.metrics.KvtierCollector`.

The statistics are checked against what the operations' own results say
(completed counts, seconds, pages written, hit and missed); the exposition is
scraped with prometheus_client's `generate_latest`, parsed back with its
parser, and checked sample by sample against `statistics()`.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio.to_thread
import pytest
from conftest import pages, wait_until
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvtier
import kvtier.metrics
from kvtier import OperationCancelled, TransferFailed, TransferScheduler
from kvtier.metrics import KvtierCollector
from kvtier.scheduler import LATENCY_BUCKETS_S, DirectionStatistics, LatencyHistogram, SchedulerStatistics
from kvtier.scheduler.statistics import LaneCounters
from kvtier.storage import KeyNamespace, StorageTimeout, page_keys
from kvtier.testing import FaultInjectingExecutor, MemoryStore, full_attention_group

PS = 4
LANES = ("backup", "load", "write_storage", "prefetch")
STAGES = ("queued", "running", "total")
Labels = frozenset[tuple[str, str]]


def keys_for(tokens: list[int]) -> list[bytes]:
    return page_keys(KeyNamespace(model="m", pool="kv", page_size=PS, dtype="f32", layout="layer_first"), tokens)


def scrape(registry: CollectorRegistry) -> dict[tuple[str, Labels], float]:
    """Every sample of ``registry``'s text exposition, parsed back."""
    text = generate_latest(registry).decode()
    out: dict[tuple[str, Labels], float] = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("kvtier_"), family.name
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"sample {key} exposed twice"
            out[key] = s.value
    return out


class Scraped:
    """Samples of one scrape, read by name and labels (the constant ones added)."""

    def __init__(self, samples: dict[tuple[str, Labels], float], **constant: str) -> None:
        self.samples = samples
        self.constant = constant

    def __call__(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset((self.constant | labels).items()))]

    def lanes(self) -> set[str]:
        return {v for _, labels in self.samples for k, v in labels if k == "lane"}


def check_lane(got: Scraped, lane: str, d: DirectionStatistics) -> None:
    assert got("kvtier_operations_submitted_total", lane=lane) == d.submitted
    for outcome in ("completed", "failed", "cancelled"):
        assert got("kvtier_operations_total", lane=lane, outcome=outcome) == getattr(d, outcome)
    assert got("kvtier_transferred_bytes_total", lane=lane) == d.bytes
    assert got("kvtier_batches_total", lane=lane) == d.batches
    assert got("kvtier_batched_operations_total", lane=lane) == d.operations_batched
    assert got("kvtier_queue_depth", lane=lane) == d.queue_depth
    assert got("kvtier_queue_depth_peak", lane=lane) == d.peak_queue_depth
    for stage in STAGES:
        h: LatencyHistogram = getattr(d.latency, stage)
        name = "kvtier_operation_latency_seconds"
        cumulative = 0
        for bound, n in zip(h.bounds, h.counts):
            cumulative += n
            assert got(f"{name}_bucket", lane=lane, stage=stage, le=repr(bound)) == cumulative
        assert got(f"{name}_bucket", lane=lane, stage=stage, le="+Inf") == h.count
        assert got(f"{name}_count", lane=lane, stage=stage) == h.count
        assert got(f"{name}_sum", lane=lane, stage=stage) == pytest.approx(h.sum_seconds, rel=1e-9, abs=1e-12)


def check_scrape(got: Scraped, s: SchedulerStatistics) -> None:
    for lane in got.lanes():
        check_lane(got, lane, getattr(s, lane))
    assert got("kvtier_batches_in_flight") == s.batches_in_flight
    assert got("kvtier_rollbacks_total") == s.rollbacks
    assert got("kvtier_deferred_host_frees") == s.deferred_host_frees
    for name, p in s.pools.items():
        assert p.used_slots is not None and p.free_slots is not None and p.page_size
        assert got("kvtier_host_pool_used_pages", pool=name) == p.used_slots // p.page_size
        assert got("kvtier_host_pool_free_pages", pool=name) == p.free_slots // p.page_size


def close_to(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


async def test_statistics_and_their_scrape_agree_with_what_the_operations_did() -> None:
    group = full_attention_group(page_size=PS)
    store = MemoryStore()
    hold = threading.Event()
    ex = FaultInjectingExecutor(fail_batches={1}, hold=hold)
    hold.set()
    tokens = list(range(3 * PS))
    keys = keys_for(tokens)
    results: dict[str, list] = {lane: [] for lane in LANES}  # type: ignore[type-arg]
    registry = CollectorRegistry()
    async with TransferScheduler(group, executor=ex, storage=store) as sched:
        registry.register(KvtierCollector(sched, labels={"engine": "e0"}))
        kept = await sched.backup({"kv": pages(0, 1, 2, page_size=PS)})
        results["backup"].append(await kept)
        bad = await sched.backup({"kv": pages(3, page_size=PS)})  # the executor's batch 1 fails
        with pytest.raises(TransferFailed):
            await bad
        # One backup held in the worker, one queued and cancelled; a scrape
        # from another thread (as an HTTP server makes it) meanwhile.
        hold.clear()
        held = await sched.backup({"kv": pages(4, page_size=PS)})
        await wait_until(lambda: len(ex.history) == 3)  # in the executor, held
        queued = await sched.backup({"kv": pages(5, page_size=PS)})
        assert queued.cancel()
        during = Scraped(await anyio.to_thread.run_sync(scrape, registry), engine="e0")
        assert during("kvtier_batches_in_flight") == 1 and during("kvtier_queue_depth", lane="backup") == 0
        hold.set()
        results["backup"].append(await held)
        with pytest.raises(OperationCancelled):
            await queued
        results["load"].append(await (await sched.load(kept.host_indices, {"kv": pages(10, 11, 12, page_size=PS)})))

        for _ in range(2):  # the second finds every page stored
            results["write_storage"].append(await (await sched.write_storage(kept.host_indices, {"kv": keys})))
        store.corrupt(keys[2], "kv", 40)  # a byte of the third page's rows: rejected at read
        unknown = keys_for([t + 1000 for t in tokens])[:2]
        for ks in (keys, unknown):
            got = await (await sched.prefetch({"kv": ks}))
            sched.free_host(got.host_indices)
            results["prefetch"].append(got)
        store.hold(("exists",))
        stopped = await sched.prefetch({"kv": keys})
        await wait_until(lambda: bool(store.waiting))
        assert stopped.stop()
        results["prefetch"].append(await stopped)
        store.release()
        for h in (kept, held):
            sched.free_host(h.host_indices)

        s = sched.statistics()
        check_scrape(Scraped(scrape(registry), engine="e0"), s)

    assert {lane: getattr(s, lane).completed for lane in LANES} == {lane: len(r) for lane, r in results.items()}
    assert (s.backup.failed, s.backup.cancelled) == (1, 1)
    for lane in LANES:
        d: DirectionStatistics = getattr(s, lane)
        assert d.bytes == sum(r.nbytes for r in results[lane])
        lat = d.latency
        assert lat.queued.count == lat.running.count == lat.total.count == d.completed
        # Each completed operation's result and the histograms read the same clock.
        assert close_to(lat.total.sum_seconds, sum(r.seconds_total for r in results[lane]))
        assert close_to(lat.queued.sum_seconds, sum(r.seconds_queued for r in results[lane]))
        assert close_to(lat.running.sum_seconds, lat.total.sum_seconds - lat.queued.sum_seconds)
    assert close_to(s.load.latency.running.sum_seconds, sum(r.seconds_copying for r in results["load"]))

    st = s.storage
    assert st is not None
    writes = results["write_storage"]
    assert st.pages_written == sum(w.pages_written["kv"] for w in writes) == len(keys)
    assert st.pages_present == sum(w.pages_present["kv"] for w in writes) == len(keys)
    prefetches = results["prefetch"]
    assert st.pages_hit == sum(r.pages["kv"] for r in prefetches)
    assert st.pages_missed == sum(r.requested_pages["kv"] - r.hit_pages["kv"] for r in prefetches)
    assert st.pages_stopped == sum(r.hit_pages["kv"] - r.pages["kv"] for r in prefetches)
    # The corrupted page and the unknown keys missed; the stopped prefetch read nothing.
    assert (st.pages_hit, st.pages_missed, st.pages_stopped, st.pages_rejected) == (2, 1 + 2, 3, 1)

    # After the scheduler closed: the same counts, and the storage families.
    final = Scraped(scrape(registry), engine="e0")
    check_scrape(final, sched.statistics())
    assert final.lanes() == set(LANES)
    assert final("kvtier_storage_rejected_pages_total") == st.pages_rejected
    assert final("kvtier_storage_keys_to_rewrite") == st.keys_to_rewrite == 1
    for outcome, n in (("hit", st.pages_hit), ("missed", st.pages_missed), ("stopped", st.pages_stopped)):
        assert final("kvtier_storage_prefetch_pages_total", outcome=outcome) == n
    assert final("kvtier_storage_write_pages_total", outcome="written") == st.pages_written
    assert final("kvtier_storage_write_pages_total", outcome="present") == st.pages_present
    await store.aclose()


async def test_without_storage_only_the_device_lanes_and_no_storage_metrics_are_exposed() -> None:
    group = full_attention_group(page_size=PS)
    registry = CollectorRegistry()
    async with TransferScheduler(group) as sched:
        registry.register(KvtierCollector(sched))
        h = await sched.backup({"kv": pages(0, page_size=PS)})
        await h
        got = Scraped(scrape(registry))
        check_scrape(got, sched.statistics())
    assert got.lanes() == {"backup", "load"}
    assert not [name for name, _ in got.samples if name.startswith("kvtier_storage")]
    assert got("kvtier_host_pool_used_pages", pool="kv") == 1


def test_a_latency_on_a_bucket_bound_counts_in_that_bucket() -> None:
    counters = LaneCounters()
    bounds_ns = [round(b * 1e9) for b in LATENCY_BUCKETS_S]
    for ns in bounds_ns:
        counters.ended(1, "load", None, 0, queued_ns=ns, running_ns=1)
    lat = counters.latency()
    n = len(bounds_ns)
    # Queued exactly on each bound: one per bucket, none past the last.
    assert lat.queued.counts == (1,) * n + (0,)
    # One nanosecond more in total: each lands in the next bucket.
    assert lat.total.counts == (0,) + (1,) * n
    assert lat.running.counts == (n,) + (0,) * n
    assert lat.queued.sum_seconds == pytest.approx(sum(LATENCY_BUCKETS_S))
    assert lat.queued.quantile(0.5) == LATENCY_BUCKETS_S[(n - 1) // 2]
    assert lat.total.quantile(1.0) == math.inf
    assert LaneCounters().latency().total.quantile(0.99) == 0.0
    with pytest.raises(ValueError, match=r"a quantile is in \[0, 1\]; got 1.5"):
        lat.total.quantile(1.5)
    # Failed and cancelled operations count as such, not in the histograms.
    counters.ended(2, "load", TransferFailed("x"), 0, queued_ns=5, running_ns=5)
    counters.ended(3, "load", OperationCancelled("y"), 0, queued_ns=5, running_ns=5)
    assert counters.latency().total.count == counters.completed == n
    assert (counters.failed, counters.cancelled) == (1, 1)


async def test_constant_labels_may_not_take_kvtier_s_own_names() -> None:
    async with TransferScheduler(full_attention_group(page_size=PS)) as sched:
        with pytest.raises(ValueError, match=r"labels \['lane'\] are kvtier's own"):
            KvtierCollector(sched, labels={"lane": "x"})
        with pytest.raises(TypeError, match="scheduler must be a TransferScheduler; got dict"):
            KvtierCollector({})  # type: ignore[arg-type]


@pytest.fixture
def without_prometheus(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """prometheus_client made unimportable (as when the extra is not installed)."""
    for name in [n for n in sys.modules if n == "prometheus_client" or n.startswith("prometheus_client.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    yield


async def test_without_prometheus_client_the_module_imports_and_the_collector_names_the_extra(
    without_prometheus: None,
) -> None:
    # A fresh copy of kvtier.metrics, loaded while prometheus_client cannot be imported.
    spec = importlib.util.spec_from_file_location("kvtier_metrics_bare", Path(kvtier.metrics.__file__))
    assert spec is not None and spec.loader is not None
    bare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bare)
    async with TransferScheduler(full_attention_group(page_size=PS)) as sched:
        with pytest.raises(ImportError, match=r"pip install 'kvtier\[prometheus\]'"):
            bare.KvtierCollector(sched)
    from kvtier.policies import CountedAdmission, StoreAll

    with pytest.raises(ImportError, match=r"pip install 'kvtier\[prometheus\]'"):
        bare.AdmissionCollector(CountedAdmission(StoreAll()))
    assert bare.__all__ == ["AdmissionCollector", "KvtierCollector"]



def test_requests_counted_together_fill_the_histograms_as_one_at_a_time_would() -> None:
    """`LaneCounters.completed_many` / `completed_each` (a carrier's requests,
    submitted with it or joining it later) give exactly the counts and sums of
    `ended` called once per request."""
    queued = [10_000, 30_000, 30_000, 2_000_000, 20_000_000_000]  # the last past every bound
    running = 70_000
    one_by_one, together = LaneCounters(), LaneCounters()
    for q in queued:
        one_by_one.ended(1, "backup", None, 0, q, running)
    one_by_one.ended(1, "backup", None, 4096, 5_000, running)
    one_by_one.ended(1, "backup", None, 0, 5_000, running)
    together.completed_each(queued, running)
    together.completed_many(2, 4096, 5_000, running)
    assert together.latency() == one_by_one.latency()
    assert (together.completed, together.bytes) == (one_by_one.completed, one_by_one.bytes) == (7, 4096)


# -- capacity, the store's calls, info ---------------------------------------------------


async def test_host_usage_in_bytes_and_as_a_ratio_per_pool_sidecars_following_their_source() -> None:
    from kvtier.testing import hybrid_group

    group = hybrid_group()  # kv (c4), swa (swa_state), state, tok (idx); 128 host slots, pages of 8
    registry = CollectorRegistry()
    async with TransferScheduler(group) as sched:
        registry.register(KvtierCollector(sched, labels={"engine": "0"}))
        h = await sched.backup({"kv": pages(0, 1, 2, page_size=8), "tok": pages(0, page_size=8)})
        await h
        got = Scraped(scrape(registry), engine="0")
        s = sched.statistics().pools
    kv = s["kv"]
    assert kv.used_slots == 24 and kv.capacity_slots == 128
    assert got("kvtier_host_pool_usage_ratio", pool="kv") == 24 / 128
    assert got("kvtier_host_pool_capacity_bytes", pool="kv") == kv.nbytes > 0
    assert got("kvtier_host_pool_used_bytes", pool="kv") == kv.nbytes * 24 // 128
    # c4 is kv's sidecar: 3 of kv's 16 pages, so 3/16 of c4's bytes.
    c4 = s["c4"]
    assert got("kvtier_host_pool_usage_ratio", pool="c4") == 24 / 128
    assert got("kvtier_host_pool_used_bytes", pool="c4") == round(c4.nbytes * 3 / 16)
    assert got("kvtier_host_pool_usage_ratio", pool="swa") == 0
    # tok holds no bytes: a ratio, no byte figures; its sidecar idx has bytes.
    assert got("kvtier_host_pool_usage_ratio", pool="tok") == 8 / s["tok"].capacity_slots
    assert ("kvtier_host_pool_capacity_bytes", frozenset({("engine", "0"), ("pool", "tok")})) not in got.samples
    assert got("kvtier_host_pool_used_bytes", pool="idx") == round(s["idx"].nbytes * 8 / s["tok"].capacity_slots)
    # Info: the version and no store; one row per pool with its shape.
    assert got("kvtier_info", version=kvtier.__version__, storage="") == 1
    assert got("kvtier_pool_info", pool="c4", kind="sidecar", page_size="2", layout="layer_first", source="kv") == 1
    assert got("kvtier_pool_info", pool="tok", kind="logical", page_size="8", layout="", source="") == 1


class FlakyStore(MemoryStore):
    """A `MemoryStore` whose next ``get`` calls raise `StorageTimeout`."""

    def __init__(self) -> None:
        super().__init__()
        self.counted = {"exists": 0, "get": 0, "put": 0}
        self.failing_gets = 0

    async def exists(self, keys):  # type: ignore[no-untyped-def]
        self.counted["exists"] += 1
        return await super().exists(keys)

    async def get(self, keys, pools):  # type: ignore[no-untyped-def]
        self.counted["get"] += 1
        if self.failing_gets:
            self.failing_gets -= 1
            raise StorageTimeout("no answer in 0.1 s", backend=self.name, operation="get", timeout_s=0.1)
        return await super().get(keys, pools)

    async def put(self, pages):  # type: ignore[no-untyped-def]
        self.counted["put"] += 1
        await super().put(pages)


async def test_the_stores_calls_are_timed_and_their_errors_counted_by_kind() -> None:
    store = FlakyStore()
    keys = keys_for(list(range(2 * PS)))
    registry = CollectorRegistry()
    async with TransferScheduler(full_attention_group(page_size=PS), storage=store) as sched:
        registry.register(KvtierCollector(sched))
        b = await sched.backup({"kv": pages(0, 1, page_size=PS)})
        await b
        await (await sched.write_storage(b.host_indices, {"kv": keys}))
        ok = await (await sched.prefetch({"kv": keys}, policy="wait_complete"))
        sched.free_host(ok.host_indices)
        store.failing_gets = 1
        with pytest.raises(StorageTimeout):
            await (await sched.prefetch({"kv": keys}, policy="wait_complete"))
        sched.free_host(b.host_indices)
        got = Scraped(scrape(registry))
        calls = sched.store_call_statistics()
    await store.aclose()
    assert calls is not None and calls.backend == store.name
    assert {op: h.count for op, h in calls.latency.items()} == store.counted
    assert store.counted["get"] >= 2 and store.counted["put"] >= 1
    for op, n in store.counted.items():
        assert got("kvtier_storage_call_latency_seconds_count", operation=op) == n
        assert got("kvtier_storage_call_latency_seconds_bucket", operation=op, le="+Inf") == n
        assert got("kvtier_storage_call_latency_seconds_sum", operation=op) == pytest.approx(
            calls.latency[op].sum_seconds, rel=1e-9, abs=1e-12
        )
    assert calls.errors == {("get", "StorageTimeout"): 1}
    assert got("kvtier_storage_errors_total", operation="get", kind="StorageTimeout") == 1
    assert got("kvtier_info", version=kvtier.__version__, storage=store.name) == 1


async def test_storage_error_series_exist_at_zero_before_the_first_error() -> None:
    """Prometheus' advice for labelled counters: the known kinds are exported at 0
    from the first scrape, so rate() and an alert on them see a series at once."""
    from kvtier.storage import StorageError

    assert kvtier.metrics.STORAGE_ERROR_KINDS == (StorageError.__name__, StorageTimeout.__name__)
    registry = CollectorRegistry()
    async with TransferScheduler(full_attention_group(page_size=PS), storage=MemoryStore()) as sched:
        registry.register(KvtierCollector(sched))
        got = scrape(registry)
    errors = {labels: v for (name, labels), v in got.items() if name == "kvtier_storage_errors_total"}
    want = {(("kind", kind), ("operation", op)) for op in ("exists", "get", "put")
            for kind in ("StorageError", "StorageTimeout")}
    assert {tuple(sorted(labels)) for labels in errors} == want, errors
    assert set(errors.values()) == {0.0}


async def test_a_bounded_stores_size_and_evictions_are_exported(tmp_path: Path) -> None:
    """A bounded FileStore: its bytes, its bound and this process's evictions,
    as `FileStore.usage` says; an unbounded store exports none of them."""
    from kvtier.storage import FileStore

    group = full_attention_group(page_size=PS)
    page_nbytes = group["kv"].host.slot_nbytes * PS
    store = FileStore(tmp_path / "bounded", max_bytes=16 * 3 * page_nbytes)  # about 2 pages a shard
    registry = CollectorRegistry()
    async with TransferScheduler(group, storage=store) as sched:
        registry.register(KvtierCollector(sched))
        for first in range(0, 24, 4):  # 24 pages: every shard's bound is passed somewhere
            b = await sched.backup({"kv": pages(*range(4), page_size=PS)})
            await b
            await (await sched.write_storage(b.host_indices, {"kv": keys_for(list(range(first * PS, (first + 4) * PS)))}))
            sched.free_host(b.host_indices)
        got = Scraped(scrape(registry))
    usage = store.usage()
    await store.aclose()
    assert usage is not None and usage.evicted_pages > 0 and 0 < usage.used_bytes <= usage.max_bytes
    assert got("kvtier_storage_used_bytes") == usage.used_bytes
    assert got("kvtier_storage_capacity_bytes") == 16 * 3 * page_nbytes
    assert got("kvtier_storage_evicted_pages_total") == usage.evicted_pages
    assert got("kvtier_storage_evicted_bytes_total") == usage.evicted_bytes > 0
    registry = CollectorRegistry()
    async with TransferScheduler(full_attention_group(page_size=PS), storage=FileStore(tmp_path / "unbounded")) as sched:
        registry.register(KvtierCollector(sched))
        names = {name for name, _ in scrape(registry)}
    assert not {n for n in names if "used_bytes" in n and "storage" in n or "evicted" in n}, names
