"""Prometheus metrics of a `TransferScheduler`, for an engine's ``/metrics``.

`KvtierCollector` turns ``sched.statistics()`` into ``kvtier_*`` metric
families each time it is collected (scraped), so nothing is counted twice and
the scheduler's hot path does no extra work::

    from prometheus_client import REGISTRY
    from kvtier.metrics import KvtierCollector

    REGISTRY.register(KvtierCollector(sched))

Needs ``prometheus_client`` (``pip install 'kvtier[prometheus]'``). This
module imports without it; `KvtierCollector` raises `ImportError` naming the
extra. Collecting only reads counters, so it may run in another thread
(prometheus_client's HTTP server): the values of one scrape may then be a few
operations apart, never torn.

Metrics (``lane`` is ``backup``, ``load``, ``write_storage``, ``prefetch``;
the storage lanes and ``kvtier_storage_*`` only with a storage backend):

* ``kvtier_operations_submitted_total{lane}``, ``kvtier_operations_total{lane,
  outcome}`` (``completed``, ``failed``, ``cancelled``),
  ``kvtier_transferred_bytes_total{lane}`` (completed operations),
  ``kvtier_batches_total{lane}``, ``kvtier_batched_operations_total{lane}``;
* ``kvtier_operation_latency_seconds{lane, stage}``: a histogram per lane and
  stage (``queued``, ``running``, ``total``) of completed operations, buckets
  `kvtier.scheduler.LATENCY_BUCKETS_S`;
* ``kvtier_queue_depth{lane}``, ``kvtier_queue_depth_peak{lane}``,
  ``kvtier_batches_in_flight``, ``kvtier_rollbacks_total``,
  ``kvtier_deferred_host_frees``;
* ``kvtier_host_pool_used_pages{pool}``, ``kvtier_host_pool_free_pages{pool}``
  for each slot-owning host pool;
* ``kvtier_storage_prefetch_pages_total{outcome}`` (``hit``, ``missed``,
  ``stopped``: each page a completed prefetch asked for, once),
  ``kvtier_storage_rejected_pages_total``,
  ``kvtier_storage_write_pages_total{outcome}`` (``written``, ``present``,
  ``skipped``: refused by the scheduler's ``store_admission``),
  ``kvtier_storage_write_skipped_pages_total{reason}`` (the skipped pages by
  the reason the policy gave; a series once a reason was given),
  ``kvtier_storage_keys_to_rewrite``;
* capacity: ``kvtier_host_pool_capacity_bytes{pool}``,
  ``kvtier_host_pool_used_bytes{pool}`` (pools that hold bytes; a sidecar's
  usage follows its source's pages) and ``kvtier_host_pool_usage_ratio{pool}``
  (0 to 1, like vLLM's ``vllm:kv_offload_cpu_cache_usage_perc``);
* the store's own calls: ``kvtier_storage_call_latency_seconds{operation}``
  (``exists``, ``get``, ``put``; failed calls included) and
  ``kvtier_storage_errors_total{operation, kind}`` (``kind``: the error's class,
  e.g. ``StorageTimeout``; ``StorageError`` and ``StorageTimeout`` are there at
  0 for every operation from the first scrape, other classes once raised);
* a bounded store's size (`kvtier.storage.FileStore` with ``max_bytes``):
  ``kvtier_storage_used_bytes`` and ``kvtier_storage_capacity_bytes``, and what
  this process evicted, ``kvtier_storage_evicted_pages_total`` and
  ``kvtier_storage_evicted_bytes_total``;
* ``kvtier_info{version, storage}`` and ``kvtier_pool_info{pool, kind,
  page_size, layout, source}``, each with the value 1.

`AdmissionCollector` does the same for a store admission policy
(`kvtier.policies.CountedAdmission`): ``kvtier_store_admission_offered_total{tier}``,
``kvtier_store_admission_admitted_total{tier}`` and
``kvtier_store_admission_skipped_total{tier, reason}`` (``tier``: ``host`` or ``store``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from kvtier import __version__
from kvtier.errors import ConfigurationError, WrongType
from kvtier.policies import CountedAdmission
from kvtier.scheduler import LatencyHistogram, SchedulerStatistics, TransferScheduler

# Why prometheus_client cannot be imported, or None.
_missing: ImportError | None = None
if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector
else:
    try:
        from prometheus_client.registry import Collector
    except ImportError as exc:  # the extra is missing: KvtierCollector() says so
        Collector = object
        _missing = exc

__all__ = ["AdmissionCollector", "KvtierCollector"]

LANES = ("backup", "load", "write_storage", "prefetch")
STAGES = ("queued", "running", "total")
# The classes a backend's call raises on purpose (`kvtier.storage.StorageError`
# and its `StorageTimeout`): kvtier_storage_errors_total has these at 0 from the first scrape.
STORAGE_ERROR_KINDS = ("StorageError", "StorageTimeout")
_OWN_LABELS = frozenset({
    "lane", "outcome", "stage", "pool", "le", "operation", "kind", "version", "storage", "page_size", "layout", "source",
    "reason",
})
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _constant_labels(labels: object, own: frozenset[str]) -> dict[str, str]:
    """``labels`` as a dict of str -> str, else `WrongType` (not a mapping) or
    `ConfigurationError` naming the label: Prometheus label names match
    ``[a-zA-Z_][a-zA-Z0-9_]*`` and do not start with ``__`` (reserved), and
    ``own`` are kvtier's. Checked here, not at the first scrape."""
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise WrongType(f"labels must be a mapping of label name to value; got {type(labels).__name__}")
    for name in labels:
        if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ConfigurationError(
                f"label names match [a-zA-Z_][a-zA-Z0-9_]* and do not start with '__' (Prometheus); got {name!r}"
            )
    clash = sorted(own & set(labels))
    if clash:
        raise ConfigurationError(f"labels {clash} are kvtier's own; choose other names for constant labels")
    return {name: str(value) for name, value in labels.items()}


class KvtierCollector(Collector):
    """A prometheus_client collector of one scheduler's statistics.

    ``labels``: constant labels added to every sample, e.g. ``{"engine": "0"}``
    when one process runs several schedulers. Raises `ImportError` without
    prometheus_client, `WrongType` (a `TypeError`) for something other than
    a scheduler, and `ConfigurationError` (a `ValueError`) for a label name
    that Prometheus refuses or kvtier uses itself (``lane``, ``outcome``,
    ``stage``, ``pool``, ``le``, ...).
    """

    def __init__(self, scheduler: TransferScheduler, *, labels: Mapping[str, str] | None = None) -> None:
        if _missing is not None:
            raise ImportError(
                "kvtier.metrics needs prometheus_client; install it with pip install 'kvtier[prometheus]'"
            ) from _missing
        if not isinstance(scheduler, TransferScheduler):
            raise WrongType(f"scheduler must be a TransferScheduler; got {type(scheduler).__name__}")
        extra = _constant_labels(labels, _OWN_LABELS)
        self._scheduler = scheduler
        calls = scheduler.store_call_statistics()
        self._storage_name = "" if calls is None else calls.backend
        self._names = list(extra)
        self._values = [str(v) for v in extra.values()]

    def describe(self) -> Iterator[Metric]:
        """The same families as `collect` (a registry checks names with it)."""
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        """The metric families of ``scheduler.statistics()`` now."""
        return iter(self._families(self._scheduler.statistics()))

    def _families(self, s: SchedulerStatistics) -> list[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        names, values = self._names, self._values

        def counter(name: str, doc: str, *labels: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=[*names, *labels])

        def gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=[*names, *labels])

        lanes = [(lane, getattr(s, lane)) for lane in (LANES if s.storage is not None else LANES[:2])]
        submitted = counter("kvtier_operations_submitted", "Operations queued in a lane", "lane")
        ended = counter("kvtier_operations", "Operations ended, by outcome", "lane", "outcome")
        moved = counter("kvtier_transferred_bytes", "Bytes moved by completed operations", "lane")
        batches = counter("kvtier_batches", "Batches a lane took", "lane")
        batched = counter("kvtier_batched_operations", "Operations in the batches a lane took", "lane")
        latency = HistogramMetricFamily(
            "kvtier_operation_latency_seconds",
            "Seconds completed operations spent queued, running (copying or storage I/O), in total",
            labels=[*names, "lane", "stage"],
        )
        depth = gauge("kvtier_queue_depth", "Operations queued in a lane", "lane")
        peak = gauge("kvtier_queue_depth_peak", "Most operations ever queued in a lane at once", "lane")
        for lane, d in lanes:
            submitted.add_metric([*values, lane], d.submitted)
            for outcome, n in (("completed", d.completed), ("failed", d.failed), ("cancelled", d.cancelled)):
                ended.add_metric([*values, lane, outcome], n)
            moved.add_metric([*values, lane], d.bytes)
            batches.add_metric([*values, lane], d.batches)
            batched.add_metric([*values, lane], d.operations_batched)
            for stage in STAGES:
                h: LatencyHistogram = getattr(d.latency, stage)
                latency.add_metric([*values, lane, stage], _buckets(h), h.sum_seconds)
            depth.add_metric([*values, lane], d.queue_depth)
            peak.add_metric([*values, lane], d.peak_queue_depth)
        in_flight = gauge("kvtier_batches_in_flight", "Batches running in every lane")
        in_flight.add_metric(values, s.batches_in_flight)
        rollbacks = counter("kvtier_rollbacks", "Allocations rolled back because a pool was short")
        rollbacks.add_metric(values, s.rollbacks)
        deferred = gauge("kvtier_deferred_host_frees", "Host page frees waiting for operations that still use the pages")
        deferred.add_metric(values, s.deferred_host_frees)
        used = gauge("kvtier_host_pool_used_pages", "Pages of a host pool in use", "pool")
        free = gauge("kvtier_host_pool_free_pages", "Pages of a host pool free", "pool")
        for name, p in s.pools.items():
            if p.used_slots is None or p.free_slots is None or not p.page_size:
                continue  # a sidecar: its rows follow its source's pages
            used.add_metric([*values, name], p.used_slots // p.page_size)
            free.add_metric([*values, name], p.free_slots // p.page_size)
        capacity_b = gauge("kvtier_host_pool_capacity_bytes", "Bytes of a host pool (pinned host memory)", "pool")
        used_b = gauge("kvtier_host_pool_used_bytes", "Bytes of a host pool in use", "pool")
        usage = gauge("kvtier_host_pool_usage_ratio", "Fraction of a host pool's slots in use, 0 to 1", "pool")
        group = self._scheduler.group
        for name, p in s.pools.items():
            spec = group[name]
            owner = s.pools[spec.sidecar.source] if spec.sidecar is not None else p  # a sidecar follows its source
            if owner.used_slots is None or not owner.capacity_slots:
                continue
            ratio = owner.used_slots / owner.capacity_slots
            usage.add_metric([*values, name], ratio)
            if p.nbytes:  # a logical pool holds no bytes
                capacity_b.add_metric([*values, name], p.nbytes)
                used_b.add_metric([*values, name], round(p.nbytes * ratio))
        info = gauge("kvtier_info", "kvtier's version and storage backend; the value is 1", "version", "storage")
        info.add_metric([*values, __version__, self._storage_name], 1)
        pool_info = gauge("kvtier_pool_info", "A registered pool: kind, page size, host layout; the value is 1",
                          "pool", "kind", "page_size", "layout", "source")
        for spec in group:
            layout = getattr(spec.host, "layout", None) or ""
            source = spec.sidecar.source if spec.sidecar is not None else ""
            pool_info.add_metric([*values, spec.name, spec.kind, str(spec.page_size), layout, source], 1)
        families: list[Metric] = [
            submitted, ended, moved, batches, batched, latency, depth, peak, in_flight, rollbacks, deferred, used, free,
            capacity_b, used_b, usage, info, pool_info,
        ]
        calls = self._scheduler.store_call_statistics()
        if calls is not None:
            call_latency = HistogramMetricFamily(
                "kvtier_storage_call_latency_seconds",
                "Seconds each call to the storage backend took (failed calls included)",
                labels=[*names, "operation"],
            )
            for operation, h in calls.latency.items():
                call_latency.add_metric([*values, operation], _buckets(h), h.sum_seconds)
            errors = counter("kvtier_storage_errors", "Calls to the storage backend that raised, by error class",
                             "operation", "kind")
            # The known kinds start at 0 for every operation, so that rate() and
            # alerts see the series before the first error (Prometheus' advice
            # for labelled counters); another class appears once it is raised.
            counts = {(operation, kind): 0 for operation in calls.latency for kind in STORAGE_ERROR_KINDS}
            counts.update(calls.errors)
            for (operation, kind), n in sorted(counts.items()):
                errors.add_metric([*values, operation, kind], n)
            families += [call_latency, errors]
            if calls.usage is not None:
                u = calls.usage
                used_s = gauge("kvtier_storage_used_bytes", "Bytes a bounded store holds (every process's pages)")
                used_s.add_metric(values, u.used_bytes)
                capacity_s = gauge("kvtier_storage_capacity_bytes", "The bound of a bounded store, in bytes")
                capacity_s.add_metric(values, u.max_bytes)
                evicted = counter("kvtier_storage_evicted_pages", "Pages this process evicted from a bounded store")
                evicted.add_metric(values, u.evicted_pages)
                evicted_b = counter("kvtier_storage_evicted_bytes", "Bytes of the pages this process evicted")
                evicted_b.add_metric(values, u.evicted_bytes)
                families += [used_s, capacity_s, evicted, evicted_b]
        st = s.storage
        if st is not None:
            prefetched = counter(
                "kvtier_storage_prefetch_pages", "Pages completed prefetches asked for: read, not stored, left unread",
                "outcome",
            )
            for outcome, n in (("hit", st.pages_hit), ("missed", st.pages_missed), ("stopped", st.pages_stopped)):
                prefetched.add_metric([*values, outcome], n)
            rejected = counter("kvtier_storage_rejected_pages", "Stored pages refused at read (checksum, format)")
            rejected.add_metric(values, st.pages_rejected)
            written = counter("kvtier_storage_write_pages",
                              "Pages of writes: put, found already stored, or skipped by store admission", "outcome")
            written.add_metric([*values, "written"], st.pages_written)
            written.add_metric([*values, "present"], st.pages_present)
            written.add_metric([*values, "skipped"], st.pages_skipped)
            skipped = counter("kvtier_storage_write_skipped_pages",
                              "Pages of writes the store admission policy refused, by reason", "reason")
            for reason, n in sorted(st.pages_skipped_by_reason.items()):
                skipped.add_metric([*values, reason], n)
            rewrite = gauge("kvtier_storage_keys_to_rewrite", "Keys of refused pages not yet put again")
            rewrite.add_metric(values, st.keys_to_rewrite)
            families += [prefetched, rejected, written, skipped, rewrite]
        return families

    def __repr__(self) -> str:
        return f"<KvtierCollector of {self._scheduler!r}>"


class AdmissionCollector(Collector):
    """A prometheus_client collector of a `CountedAdmission`'s decisions.

    ``labels``: constant labels on every sample. Raises `ImportError` without
    prometheus_client, `WrongType` (a `TypeError`) for something other than a
    `CountedAdmission`, and `ConfigurationError` (a `ValueError`) for a label
    name that Prometheus refuses or kvtier uses itself.
    """

    def __init__(self, admission: CountedAdmission, *, labels: Mapping[str, str] | None = None) -> None:
        if _missing is not None:
            raise ImportError(
                "kvtier.metrics needs prometheus_client; install it with pip install 'kvtier[prometheus]'"
            ) from _missing
        if not isinstance(admission, CountedAdmission):
            raise WrongType(f"admission must be a CountedAdmission; got {type(admission).__name__}")
        extra = _constant_labels(labels, frozenset({"tier", "reason"}))
        self._admission = admission
        self._names = list(extra)
        self._values = [str(v) for v in extra.values()]

    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        s = self._admission.statistics()
        names, values = self._names, self._values
        offered = CounterMetricFamily("kvtier_store_admission_offered", "Blocks offered to a tier's store admission",
                                      labels=[*names, "tier"])
        admitted = CounterMetricFamily("kvtier_store_admission_admitted", "Blocks a tier's store admission stored",
                                       labels=[*names, "tier"])
        skipped = CounterMetricFamily("kvtier_store_admission_skipped",
                                      "Blocks a tier's store admission did not store, by reason",
                                      labels=[*names, "tier", "reason"])
        for tier, n in s.offered.items():
            offered.add_metric([*values, tier], n)
            admitted.add_metric([*values, tier], s.admitted[tier])
        for (tier, reason), n in sorted(s.skipped.items()):
            skipped.add_metric([*values, tier, reason], n)
        return iter([offered, admitted, skipped])

    def __repr__(self) -> str:
        return f"<AdmissionCollector of {self._admission!r}>"


def _buckets(h: LatencyHistogram) -> list[tuple[str, float]]:
    """prometheus_client's cumulative buckets of a histogram."""
    out: list[tuple[str, float]] = []
    seen = 0
    for bound, n in zip(h.bounds, h.counts):
        seen += n
        out.append((repr(bound), seen))
    out.append(("+Inf", seen + h.counts[-1]))
    return out
