"""Transfers: operation records, merging, sidecar derivation, copy plans, executors."""

from kvtier.transfers.executor import (
    Batch,
    CopyExecutor,
    CpuExecutor,
    CpuExecutorStatistics,
    LayerProgress,
    capture_fence,
    run_batch_copies,
)
from kvtier.transfers.merge import MergedTransfer, TransferPart, derive_sidecar_indices, merge_transfers
from kvtier.transfers.operation import CacheOperation, Direction, PoolTransfer
from kvtier.transfers.plan import (
    BatchPlan,
    CopyPlan,
    PoolCopy,
    RowPlan,
    apply_copy_plan,
    apply_row_plan,
    plan_batch,
    plan_copies,
    plan_rows,
)

__all__ = [
    "Batch",
    "BatchPlan",
    "CacheOperation",
    "CopyExecutor",
    "CopyPlan",
    "CpuExecutor",
    "CpuExecutorStatistics",
    "Direction",
    "LayerProgress",
    "MergedTransfer",
    "PoolCopy",
    "PoolTransfer",
    "RowPlan",
    "TransferPart",
    "apply_copy_plan",
    "apply_row_plan",
    "capture_fence",
    "derive_sidecar_indices",
    "merge_transfers",
    "plan_batch",
    "plan_copies",
    "plan_rows",
    "run_batch_copies",
]
