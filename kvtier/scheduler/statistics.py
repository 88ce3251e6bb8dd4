"""Frozen statistics records of the scheduler."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from kvtier.errors import OperationCancelled, SchedulerClosed
from kvtier.pools import HostPoolStatistics

if TYPE_CHECKING:
    from kvtier.scheduler.storage import StorageStatistics

__all__ = ["DirectionStatistics", "LaneCounters", "SchedulerStatistics"]

# Operation events keep the scheduler's logger name, where they were always logged.
log = structlog.get_logger("kvtier.scheduler")


class LaneCounters:
    """The live counts of one lane; `Lane.statistics` freezes them."""

    __slots__ = ("submitted", "completed", "failed", "cancelled", "bytes", "batches", "batched", "max_batch")

    def __init__(self) -> None:
        self.submitted = self.completed = self.failed = self.cancelled = 0
        self.bytes = self.batches = self.batched = self.max_batch = 0

    def batch_taken(self, operations: int) -> None:
        self.batches += 1
        self.batched += operations
        self.max_batch = max(self.max_batch, operations)

    def ended(self, operation: int, lane: str, error: BaseException | None, nbytes: int) -> None:
        """Count (and log, unless it succeeded) the end of one operation."""
        if error is None:
            self.completed += 1
            self.bytes += nbytes
        elif isinstance(error, (OperationCancelled, SchedulerClosed)):
            self.cancelled += 1
            log.info("operation.cancelled", operation=operation, lane=lane, reason=type(error).__name__)
        else:
            self.failed += 1
            log.warning("operation.failed", operation=operation, lane=lane, error=str(error))


@dataclass(frozen=True, slots=True)
class DirectionStatistics:
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

    @property
    def operations_per_batch(self) -> float:
        return self.operations_batched / self.batches if self.batches else 0.0


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
    # With a storage backend: stored pages refused at read, keys to rewrite.
    storage: StorageStatistics | None = None
