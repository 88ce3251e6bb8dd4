"""Frozen statistics records of the scheduler."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.pools import HostPoolStatistics

__all__ = ["DirectionStatistics", "SchedulerStatistics"]


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
