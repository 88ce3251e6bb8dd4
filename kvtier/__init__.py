"""kvtier: move pages of an LLM's attention cache between GPU and host memory.

The names most users need are re-exported here; the subpackages `kvtier.pools`,
`kvtier.transfers` and `kvtier.scheduler` hold the rest.
"""

from kvtier.errors import (
    ConfigurationError,
    CorruptionDetected,
    InvalidIndices,
    KvtierError,
    NotFinished,
    OperationCancelled,
    PoolExhausted,
    SchedulerClosed,
    SchedulerNotRunning,
    TransferFailed,
    WrongEventLoop,
    WrongType,
)
from kvtier.pools import DevicePool, HostPool, LogicalHostPool, PageAllocator, PoolGroup
from kvtier.scheduler import (
    BulkOperation,
    BulkResult,
    OperationHandle,
    OperationResult,
    PrefetchHandle,
    PrefetchResult,
    SchedulerConfig,
    TransferScheduler,
    WriteStorageHandle,
    WriteStorageResult,
)
from kvtier.transfers import CopyExecutor, CpuExecutor, Direction

__version__ = "0.1.0"

__all__ = [
    "BulkOperation",
    "BulkResult",
    "ConfigurationError",
    "CorruptionDetected",
    "CopyExecutor",
    "CpuExecutor",
    "DevicePool",
    "Direction",
    "HostPool",
    "InvalidIndices",
    "KvtierError",
    "LogicalHostPool",
    "NotFinished",
    "OperationCancelled",
    "OperationHandle",
    "OperationResult",
    "PageAllocator",
    "PoolExhausted",
    "PoolGroup",
    "PrefetchHandle",
    "PrefetchResult",
    "SchedulerClosed",
    "SchedulerConfig",
    "SchedulerNotRunning",
    "TransferFailed",
    "TransferScheduler",
    "WriteStorageHandle",
    "WriteStorageResult",
    "WrongEventLoop",
    "WrongType",
]
