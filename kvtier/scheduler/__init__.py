"""The scheduler: admission, lanes, handles, statistics.

`TransferScheduler` is the public face; see ``docs/architecture.md`` for what
each module owns.
"""

from kvtier.scheduler.admission import ReclaimHook
from kvtier.scheduler.bulk import BulkOperation, BulkResult
from kvtier.scheduler.config import SchedulerConfig
from kvtier.scheduler.handles import OperationHandle, OperationResult
from kvtier.scheduler.lanes import PRIORITY_MAX, PRIORITY_MIN
from kvtier.scheduler.scheduler import TransferScheduler
from kvtier.scheduler.statistics import (
    LATENCY_BUCKETS_S,
    DirectionStatistics,
    LaneLatency,
    LatencyHistogram,
    SchedulerStatistics,
)
from kvtier.scheduler.storage import (
    PrefetchHandle,
    PrefetchResult,
    RewriteKeys,
    StorageHandle,
    StorageStatistics,
    WriteStorageHandle,
    WriteStorageResult,
)
from kvtier.scheduler.store_calls import StoreCallStatistics

__all__ = [
    "BulkOperation",
    "BulkResult",
    "LATENCY_BUCKETS_S",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "DirectionStatistics",
    "LaneLatency",
    "LatencyHistogram",
    "OperationHandle",
    "OperationResult",
    "PrefetchHandle",
    "PrefetchResult",
    "ReclaimHook",
    "RewriteKeys",
    "SchedulerConfig",
    "SchedulerStatistics",
    "StorageHandle",
    "StorageStatistics",
    "StoreCallStatistics",
    "TransferScheduler",
    "WriteStorageHandle",
    "WriteStorageResult",
]
