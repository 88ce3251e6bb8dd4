"""kvtier's counts on vLLM's ``/metrics``, the way vLLM's offloading connector reports its own.

vLLM's `OffloadingConnector` collects `OffloadingConnectorStats` from the
scheduler side (``manager.get_stats()``) and turns every name that the spec
declares (``OffloadingSpec.build_metric_definitions``) into a Prometheus
metric next to its own ``vllm:kv_offload_*``. kvtier's worker counts travel to
the scheduler side with the worker's per-step metadata (`KvtierWorkerMetadata`,
counts since the last step, summed over workers), and the manager hands them
on with its own gauge of host usage.

Counts are in vLLM blocks and bytes; Prometheus adds ``_total`` to counters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingMetricMetadata

from kvtier.policies import AdmissionStatistics

__all__ = [
    "METRICS", "HOST_USAGE", "STORE_RULES", "KvtierWorkerMetadata", "admission_counts", "metric_definitions",
    "worker_counts", "add_counts", "zero_counts",
]

PREFIX = "vllm:kv_offload_kvtier_"
HOST_USAGE = PREFIX + "host_usage_perc"

# count name (as the worker reports it) -> (metric name, label name or None, documentation)
METRICS: Mapping[str, tuple[str, str | None, str]] = {
    "blocks_stored": (PREFIX + "blocks_stored", None, "vLLM blocks backed up into kvtier's host tier."),
    "bytes_stored": (PREFIX + "bytes_stored", None, "Bytes backed up into kvtier's host tier."),
    "blocks_loaded": (PREFIX + "blocks_loaded", "source",
                      "vLLM blocks loaded back by kvtier, by source: host (kvtier's host tier) or store."),
    "bytes_loaded": (PREFIX + "bytes_loaded", "source", "Bytes loaded back by kvtier, by source: host or store."),
    "blocks_refused": (PREFIX + "blocks_refused", "reason",
                       "vLLM blocks whose bytes failed kvtier's checks (vLLM recomputed them), by reason: "
                       "host_verify, or store_<rule> (store_checksum, store_key, store_length, ...)."),
    "blocks_failed": (PREFIX + "blocks_failed", None,
                      "vLLM blocks kvtier could not load for another cause (a store miss, a failed copy); "
                      "vLLM recomputed them."),
    "blocks_written_through": (PREFIX + "blocks_written_through", None,
                               "vLLM blocks written through to kvtier's store (put, or found already stored)."),
    "write_through_errors": (PREFIX + "write_through_errors", None, "Write-throughs to kvtier's store that failed."),
    "stores_skipped": (PREFIX + "stores_skipped", "reason",
                       "vLLM blocks offered to kvtier's host tier that its store admission policy did not back up, "
                       "by reason (the frequency gate's: infrequent)."),
    "write_throughs_skipped": (PREFIX + "write_throughs_skipped", "reason",
                               "vLLM blocks backed up to kvtier's host tier that its store admission policy did not "
                               "write through to the store, by reason."),
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every metric kvtier reports, for `KvtierOffloadingSpec.build_metric_definitions`."""
    out: dict[str, OffloadingMetricMetadata] = {
        name: OffloadingCounterMetadata(documentation=doc, labelnames=(label,) if label else ())
        for name, label, doc in METRICS.values()
    }
    out[HOST_USAGE] = OffloadingGaugeMetadata(
        documentation="Fraction of kvtier's host blocks that hold a vLLM block (stored or being stored)."
    )
    return out


# The rules a stored block can break (`kvtier.storage.PageCorrupted.rule`, ``"identity"``
# for another engine's block, ``"decode"`` for another `StorageError`): blocks_refused's reasons.
STORE_RULES = ("checksum", "decode", "header", "identity", "key", "length", "pool", "pools", "version")


def zero_counts(*, verify: bool, store: bool, frequency_gate: bool) -> dict[str, int]:
    """Every count an engine of this configuration can report, at 0 (flat,
    see `worker_counts`): vLLM's Prometheus metrics carry engine labels, so a
    counter shows on ``/metrics`` only once a value was reported for it, and
    one that never moved would be missing instead of 0."""
    names = ["blocks_stored", "bytes_stored", "blocks_loaded|host", "bytes_loaded|host", "blocks_failed"]
    if verify:
        names.append("blocks_refused|host_verify")
    if store:
        names += ["blocks_loaded|store", "bytes_loaded|store", "blocks_written_through", "write_through_errors"]
        names += [f"blocks_refused|store_{rule}" for rule in STORE_RULES]
    if frequency_gate:
        names.append("stores_skipped|infrequent")
        if store:
            names.append("write_throughs_skipped|infrequent")
    return dict.fromkeys(names, 0)


def worker_counts(statistics: Mapping[str, Any]) -> dict[str, int]:
    """A worker's running totals (`KvtierOffloadingWorker.statistics`) as flat
    counts, ``"name"`` or ``"name|label value"``."""
    s, nbytes = statistics, int(statistics["block_bytes"])
    out = {
        "blocks_stored": s["blocks_stored"], "bytes_stored": s["blocks_stored"] * nbytes,
        "blocks_loaded|host": s["blocks_loaded_from_host"], "bytes_loaded|host": s["blocks_loaded_from_host"] * nbytes,
        "blocks_loaded|store": s["blocks_loaded_from_store"],
        "bytes_loaded|store": s["blocks_loaded_from_store"] * nbytes,
        "blocks_failed": s["blocks_failed"], "blocks_written_through": s["blocks_written_through"],
        "write_through_errors": s["write_through_errors"],
    }
    for reason, n in s["refused"].items():
        out[f"blocks_refused|{reason}"] = n
    return {k: int(v) for k, v in out.items()}


def admission_counts(statistics: AdmissionStatistics) -> dict[str, int]:
    """A `CountedAdmission`'s skips as flat counts (``stores_skipped|reason``
    for the host tier, ``write_throughs_skipped|reason`` for the store)."""
    names = {"host": "stores_skipped", "store": "write_throughs_skipped"}
    return {f"{names[tier]}|{reason}": n for (tier, reason), n in statistics.skipped.items()}


def add_counts(stats: OffloadingConnectorStats, counts: Mapping[str, int], *, zeros: bool = False) -> None:
    """Add flat counts (see `worker_counts`) to vLLM's stats as kvtier's
    counters; a count of 0 only with ``zeros`` (see `zero_counts`)."""
    for key, n in counts.items():
        if not n and not zeros:
            continue
        name, _, label = key.partition("|")
        metric, label_name, _ = METRICS[name]
        stats.increase_counter(metric, n, (label,) if label_name else ())


@dataclass
class KvtierWorkerMetadata(OffloadingWorkerMetadata):  # type: ignore[misc,unused-ignore]
    """vLLM's worker-to-scheduler metadata plus kvtier's counts since the last
    step (flat, see `worker_counts`), summed over workers."""

    kvtier: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: Any) -> Any:
        merged = super().aggregate(other)
        counts = dict(self.kvtier)
        for key, n in getattr(other, "kvtier", {}).items():
            counts[key] = counts.get(key, 0) + n
        return KvtierWorkerMetadata(
            completed_jobs=merged.completed_jobs, transfer_stats=merged.transfer_stats, kvtier=counts
        )
