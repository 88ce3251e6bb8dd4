"""Transfers: operation records, merging, sidecar derivation, copy plans, executors."""

from kvtier.transfers.executor import (
    Batch,
    CopyExecutor,
    CpuExecutor,
    LayerProgress,
    capture_fence,
    run_batch_copies,
)
from kvtier.transfers.merge import MergedTransfer, TransferPart, derive_sidecar_indices, merge_transfers
from kvtier.transfers.operation import CacheOperation, Direction, PoolTransfer
from kvtier.transfers.plan import BatchPlan, CopyPlan, PoolCopy, apply_copy_plan, plan_batch, plan_copies

__all__ = [
    "Batch",
    "BatchPlan",
    "CacheOperation",
    "CopyExecutor",
    "CopyPlan",
    "CpuExecutor",
    "Direction",
    "LayerProgress",
    "MergedTransfer",
    "PoolCopy",
    "PoolTransfer",
    "TransferPart",
    "apply_copy_plan",
    "capture_fence",
    "derive_sidecar_indices",
    "merge_transfers",
    "plan_batch",
    "plan_copies",
    "run_batch_copies",
]
