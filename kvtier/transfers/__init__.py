"""Transfers: operation records, merging, sidecar derivation, copy plans, executors.

The executor seam (`CopyExecutor`, `Batch`, `LayerProgress`) is in
`kvtier.transfers.executor`; the CPU executor in `kvtier.transfers.cpu`; the
CUDA one in `kvtier.transfers.cuda` (imported on its own, not re-exported here).
"""

from kvtier.transfers.calibration import CalibrationStatistics, CopyCalibrator, process_calibrator, shape_key
from kvtier.transfers.cpu import CpuExecutor, CpuExecutorStatistics, run_batch_copies
from kvtier.transfers.executor import Batch, CopyExecutor, LayerProgress, capture_fence
from kvtier.transfers.merge import MergedTransfer, TransferPart, derive_sidecar_indices, merge_transfers
from kvtier.transfers.operation import CacheOperation, Direction, PoolTransfer
from kvtier.transfers.plan import (
    BatchPlan,
    CopyMethod,
    CopyPlan,
    PoolCopy,
    RowPlan,
    apply_copy_plan,
    apply_row_plan,
    plan_batch,
    plan_copies,
    plan_rows,
    wide_rows,
)

__all__ = [
    "Batch",
    "BatchPlan",
    "CacheOperation",
    "CalibrationStatistics",
    "CopyCalibrator",
    "CopyMethod",
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
    "process_calibrator",
    "run_batch_copies",
    "shape_key",
    "wide_rows",
]
