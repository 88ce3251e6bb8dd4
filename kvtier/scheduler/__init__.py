"""The scheduler: queues, batching, handles, statistics."""

from kvtier.scheduler.config import SchedulerConfig
from kvtier.scheduler.handle import OperationHandle, OperationResult
from kvtier.scheduler.queue import LaneStatistics, OperationQueue
from kvtier.scheduler.scheduler import ReclaimHook, TransferScheduler
from kvtier.scheduler.statistics import DirectionStatistics, SchedulerStatistics

__all__ = [
    "DirectionStatistics",
    "LaneStatistics",
    "OperationHandle",
    "OperationQueue",
    "OperationResult",
    "ReclaimHook",
    "SchedulerConfig",
    "SchedulerStatistics",
    "TransferScheduler",
]
