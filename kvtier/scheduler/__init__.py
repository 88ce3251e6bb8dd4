"""The scheduler: queues, batching, handles, statistics."""

from kvtier.scheduler.config import SchedulerConfig
from kvtier.scheduler.handle import OperationHandle, OperationResult
from kvtier.scheduler.queue import LaneStatistics, OperationQueue
from kvtier.scheduler.scheduler import ReclaimHook, TransferScheduler
from kvtier.scheduler.statistics import DirectionStatistics, SchedulerStatistics
from kvtier.scheduler.storage_handle import (
    PrefetchHandle,
    PrefetchResult,
    StorageDirection,
    StorageHandle,
    WriteStorageHandle,
    WriteStorageResult,
)

__all__ = [
    "DirectionStatistics",
    "LaneStatistics",
    "OperationHandle",
    "OperationQueue",
    "OperationResult",
    "PrefetchHandle",
    "PrefetchResult",
    "ReclaimHook",
    "SchedulerConfig",
    "SchedulerStatistics",
    "StorageDirection",
    "StorageHandle",
    "TransferScheduler",
    "WriteStorageHandle",
    "WriteStorageResult",
]
