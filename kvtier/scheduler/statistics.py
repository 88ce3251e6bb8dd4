"""Counters of the scheduler's lanes and their frozen statistics records.

`LaneCounters` is what a lane updates as operations end: a few integer
additions and list index increments per operation, nothing allocated. The
records (`DirectionStatistics`, `LaneLatency`, `LatencyHistogram`,
`SchedulerStatistics`) are frozen copies taken by `statistics()`.

Latencies are kept as histograms over fixed bucket bounds,
`LATENCY_BUCKETS_S`, for the operations that completed, in three stages:
*queued* (submitted, i.e. in the lane's queue, until its batch was taken),
*running* (its batch taken until it ended: copying, for a backup or a load)
and *total*. An operation ended before its batch was taken (a prefetch
stopped while queued) spent no time running.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtier.errors import ConfigurationError, OperationCancelled, SchedulerClosed
from kvtier.logs import get_logger
from kvtier.pools import HostPoolStatistics


__all__ = [
    "LATENCY_BUCKETS_S",
    "DirectionStatistics",
    "LaneCounters",
    "LaneLatency",
    "LatencyHistogram",
    "SchedulerStatistics",
    "StorageStatistics",
]

# Operation events keep the scheduler's logger name, where they were always logged.
log = get_logger("kvtier.scheduler")

LATENCY_BUCKETS_S: tuple[float, ...] = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)
"""Upper bounds (inclusive, in seconds) of the latency buckets; one more bucket
holds what lies past the last bound. From a small copy's tens of microseconds
to a slow store's seconds."""

# The same bounds in integer nanoseconds, which the lanes record.
_BOUNDS_NS: tuple[int, ...] = tuple(round(b * 1e9) for b in LATENCY_BUCKETS_S)
_BUCKETS = len(_BOUNDS_NS) + 1


class LaneCounters:
    """The live counts of one lane; `Lane.statistics` freezes them."""

    __slots__ = (
        "submitted", "completed", "failed", "cancelled", "bytes", "batches", "batched", "max_batch",
        "queued_ns", "running_ns", "total_ns", "sums_ns",
    )

    def __init__(self) -> None:
        self.submitted = self.completed = self.failed = self.cancelled = 0
        self.bytes = self.batches = self.batched = self.max_batch = 0
        # Per stage, operations per bucket (index i: at most _BOUNDS_NS[i], the
        # last: past every bound), and the sums of queued, running, total.
        self.queued_ns = [0] * _BUCKETS
        self.running_ns = [0] * _BUCKETS
        self.total_ns = [0] * _BUCKETS
        self.sums_ns = [0, 0, 0]

    def batch_taken(self, operations: int) -> None:
        self.batches += 1
        self.batched += operations
        self.max_batch = max(self.max_batch, operations)

    def ended(
        self, operation: int, lane: str, error: BaseException | None, nbytes: int, queued_ns: int, running_ns: int
    ) -> None:
        """Count (and log, unless it succeeded) the end of one operation; a
        completed one's stages go into the latency histograms."""
        if error is None:
            self.completed += 1
            self.bytes += nbytes
            total_ns = queued_ns + running_ns
            bounds = _BOUNDS_NS
            self.queued_ns[bisect_left(bounds, queued_ns)] += 1
            self.running_ns[bisect_left(bounds, running_ns)] += 1
            self.total_ns[bisect_left(bounds, total_ns)] += 1
            sums = self.sums_ns
            sums[0] += queued_ns
            sums[1] += running_ns
            sums[2] += total_ns
        elif isinstance(error, (OperationCancelled, SchedulerClosed)):
            self.cancelled += 1
            log.info("operation.cancelled", operation=operation, lane=lane, reason=type(error).__name__)
        else:
            self.failed += 1
            log.warning("operation.failed", operation=operation, lane=lane, error=str(error))

    def completed_many(self, operations: int, nbytes: int, queued_ns: int, running_ns: int) -> None:
        """Count ``operations`` that completed together (a bulk call's requests
        carried by one queue entry), ``nbytes`` in all, each with these stages."""
        self.completed += operations
        self.bytes += nbytes
        total_ns = queued_ns + running_ns
        bounds = _BOUNDS_NS
        self.queued_ns[bisect_left(bounds, queued_ns)] += operations
        self.running_ns[bisect_left(bounds, running_ns)] += operations
        self.total_ns[bisect_left(bounds, total_ns)] += operations
        sums = self.sums_ns
        sums[0] += queued_ns * operations
        sums[1] += running_ns * operations
        sums[2] += total_ns * operations

    def completed_each(self, queued_ns: list[int], running_ns: int) -> None:
        """Count ``len(queued_ns)`` operations that completed together, each
        queued its own time and running ``running_ns`` (lone requests that
        joined a queue entry; their bytes are counted with it)."""
        if not queued_ns:
            return
        n = len(queued_ns)
        self.completed += n
        bounds = _BOUNDS_NS
        q, t = self.queued_ns, self.total_ns
        total = 0
        for queued in queued_ns:
            q[bisect_left(bounds, queued)] += 1
            t[bisect_left(bounds, queued + running_ns)] += 1
            total += queued
        self.running_ns[bisect_left(bounds, running_ns)] += n
        sums = self.sums_ns
        sums[0] += total
        sums[1] += running_ns * n
        sums[2] += total + running_ns * n

    def latency(self) -> LaneLatency:
        """The latency histograms as they are now."""
        q, r, t = self.sums_ns
        return LaneLatency(
            queued=LatencyHistogram(LATENCY_BUCKETS_S, tuple(self.queued_ns), q * 1e-9),
            running=LatencyHistogram(LATENCY_BUCKETS_S, tuple(self.running_ns), r * 1e-9),
            total=LatencyHistogram(LATENCY_BUCKETS_S, tuple(self.total_ns), t * 1e-9),
        )


@dataclass(frozen=True, slots=True)
class LatencyHistogram:
    """How long operations took at one stage.

    ``counts[i]`` operations took at most ``bounds[i]`` seconds and more than
    ``bounds[i - 1]``; the last count, one past the bounds, those that took
    longer than every bound. ``sum_seconds`` is their total time.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum_seconds: float

    @property
    def count(self) -> int:
        """Operations recorded."""
        return sum(self.counts)

    def quantile(self, q: float) -> float:
        """An upper bound of the ``q`` quantile: the smallest bucket bound that
        at least ``q`` of the operations took no longer than; ``math.inf`` when
        those lie past the last bound, 0.0 with no operation. `ConfigurationError`
        (a `ValueError`) unless ``0 <= q <= 1``."""
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= q <= 1.0:
            raise ConfigurationError(f"a quantile is in [0, 1]; got {q!r}")
        n = self.count
        if not n:
            return 0.0
        seen = 0
        for bound, c in zip(self.bounds, self.counts):
            seen += c
            if seen >= q * n:
                return bound
        return math.inf


_NO_TIMES = LatencyHistogram(LATENCY_BUCKETS_S, (0,) * _BUCKETS, 0.0)


@dataclass(frozen=True, slots=True)
class LaneLatency:
    """The latency histograms of one lane's completed operations: time in
    the queue, running (copying, for backups and loads), and both."""

    queued: LatencyHistogram = _NO_TIMES
    running: LatencyHistogram = _NO_TIMES
    total: LatencyHistogram = _NO_TIMES


@dataclass(frozen=True, slots=True)
class DirectionStatistics:
    """One lane's counts. ``bytes`` counts completed operations' bytes;
    ``latency`` holds their latency histograms."""

    submitted: int
    completed: int
    failed: int
    cancelled: int
    bytes: int
    batches: int
    operations_batched: int
    max_operations_per_batch: int
    queue_depth: int
    peak_queue_depth: int
    latency: LaneLatency = LaneLatency()

    @property
    def operations_per_batch(self) -> float:
        return self.operations_batched / self.batches if self.batches else 0.0


@dataclass(frozen=True, slots=True)
class StorageStatistics:
    """Pages through the storage backend, counted by anchor-pool page (a
    page's sidecar rows travel with it).

    * ``pages_rejected``: stored pages read that failed their checksum or did
      not fit (each a miss); ``keys_to_rewrite``: their keys not yet put again;
      ``pages_rejected_by_rule``: the same pages by the rule they broke (a
      `PageCorrupted` rule: ``"identity"`` for a page another engine's
      identity wrote, ``"checksum"``, ``"key"``, ``"version"``...; ``"decode"``
      for another `StorageError`).
    * Completed prefetches, each requested page counted once:
      ``pages_hit`` were read into host slots, ``pages_missed`` were not
      stored (or the hit ended before them: evicted after the lookup, a
      rejected page, or another pool short with ``all_pools``, which then cuts
      every pool to nothing), and
      ``pages_stopped`` were stored but left unread by a stop or a deadline.
      A prefetch that failed or was cancelled counts in none of them.
    * ``pages_written``: pages put by `write_storage` (whatever then became
      of the operation); after a put that failed part way, the pages of it
      the store holds (one ``exists`` lookup: a Redis at its memory limit, a
      full disk, a failed cluster master), none after a `StorageTimeout`
      (the store is not answering; they may be stored); ``pages_present``: pages a write found stored, or
      that another write of its batch put, and did not put again.
    * ``pages_skipped``: pages of `write_storage` that the scheduler's store
      admission policy refused (not put, not looked up);
      ``pages_skipped_by_reason``: the same pages by the reason it gave
      (`kvtier.policies.FrequencyGate`: ``"infrequent"``).
    """

    pages_rejected: int
    keys_to_rewrite: int
    pages_hit: int
    pages_missed: int
    pages_stopped: int
    pages_written: int
    pages_present: int
    pages_rejected_by_rule: Mapping[str, int] = field(default_factory=dict)
    pages_skipped: int = 0
    pages_skipped_by_reason: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    backup: DirectionStatistics
    load: DirectionStatistics
    write_storage: DirectionStatistics
    prefetch: DirectionStatistics
    rollbacks: int
    batches_in_flight: int
    deferred_host_frees: int
    pools: Mapping[str, HostPoolStatistics]
    # With a storage backend: its page counters (hits, misses, rejections, writes).
    storage: StorageStatistics | None = None
