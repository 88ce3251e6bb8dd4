"""Copy plans: how a merged transfer's rows become copies. Pure functions.

Index runs that are consecutive on both sides and at least ``min_run`` rows long
(`plan_batch` derives it from a byte threshold) become slice copies (one ``copy_`` per run, layer and plane); the remaining rows
become one gather/scatter per layer and plane. `plan_batch` turns the operations
of a batch into a `BatchPlan`: plain data that an executor walks layer by layer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvtier.pools import DevicePool, HostPool, LogicalHostPool, PoolGroup
from kvtier.transfers.merge import MergedTransfer, merge_transfers
from kvtier.transfers.operation import CacheOperation, Direction

__all__ = ["BatchPlan", "CopyPlan", "PoolCopy", "apply_copy_plan", "plan_batch", "plan_copies"]


@dataclass(frozen=True, slots=True, eq=False)
class CopyPlan:
    """``runs``: ``(src_start, dst_start, length)`` slice copies; then rows
    ``gather_src`` of the source go to rows ``gather_dst`` of the destination."""

    runs: tuple[tuple[int, int, int], ...]
    gather_src: torch.Tensor | None
    gather_dst: torch.Tensor | None

    @property
    def rows(self) -> int:
        gathered = 0 if self.gather_src is None else int(self.gather_src.numel())
        return sum(r[2] for r in self.runs) + gathered


def plan_copies(src: torch.Tensor, dst: torch.Tensor, *, min_run: int = 1) -> CopyPlan:
    """Plan copying rows ``src[i] -> dst[i]`` for every i.

    Maximal runs consecutive on both sides of at least ``min_run`` rows become
    slices; the rest is gathered. Rows keep their pairing whatever the split.
    """
    n = int(src.numel())
    if n == 0:
        return CopyPlan((), None, None)
    if n == 1:
        if min_run <= 1:
            s, d = int(src[0]), int(dst[0])
            return CopyPlan(((s, d, 1),), None, None)
        return CopyPlan((), src, dst)
    step = (src[1:] - src[:-1] == 1) & (dst[1:] - dst[:-1] == 1)
    bounds = [0, *((~step).nonzero().flatten() + 1).tolist(), n]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    is_long = [length >= min_run for length in lengths]
    heads = [a for a, keep in zip(bounds, is_long) if keep]
    runs = tuple(
        zip(src[heads].tolist(), dst[heads].tolist(), [m for m, keep in zip(lengths, is_long) if keep])
    )
    if len(heads) == len(lengths):
        return CopyPlan(runs, None, None)
    short_rows = torch.tensor([not keep for keep in is_long]).repeat_interleave(torch.tensor(lengths))
    return CopyPlan(runs, src[short_rows], dst[short_rows])


def apply_copy_plan(plan: CopyPlan, src: torch.Tensor, dst: torch.Tensor, *, non_blocking: bool = False) -> None:
    """Copy rows of ``src`` into ``dst`` as ``plan`` says (dimension 0 is rows)."""
    for s, d, n in plan.runs:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)
    if plan.gather_src is not None:
        assert plan.gather_dst is not None
        dst.index_copy_(0, plan.gather_dst, src.index_select(0, plan.gather_src))


@dataclass(frozen=True, slots=True, eq=False)
class PoolCopy:
    """The copies of one merged transfer: host rows <-> device rows of one pool.

    ``plan`` is oriented by direction: its source is the device for a backup and
    the host for a load.
    """

    name: str
    host: HostPool
    device: DevicePool
    plan: CopyPlan


@dataclass(frozen=True, slots=True, eq=False)
class BatchPlan:
    direction: Direction
    num_layers: int
    merged: tuple[MergedTransfer, ...]
    copies: tuple[PoolCopy, ...]

    def layer_copies(self, layer: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, CopyPlan]]:
        """``(src, dst, plan)`` for every pool and plane that transfer ``layer`` moves."""
        backup = self.direction is Direction.BACKUP
        for c in self.copies:
            j = c.device.pool_layer(layer)
            if j is None:
                continue
            for p in range(len(c.device.planes)):
                host = c.host.layer_view(j, p)
                dev = c.device.tensor(j, p)
                yield (dev, host, c.plan) if backup else (host, dev, c.plan)

    @property
    def nbytes(self) -> int:
        return sum(c.plan.rows * c.host.slot_nbytes for c in self.copies)


def plan_batch(
    direction: Direction,
    operations: Sequence[CacheOperation],
    group: PoolGroup,
    *,
    min_run_bytes: int = 0,
) -> BatchPlan:
    """Merge the operations' transfers, derive sidecar rows and plan the copies.

    A run becomes a slice copy when it moves at least ``min_run_bytes`` per
    layer and plane (rows of the pool's widest plane); 0 makes every run a slice.
    """
    sidecars = {p.name: p.sidecar for p in group if p.sidecar is not None}
    merged = merge_transfers([op.transfers for op in operations], sidecars)
    copies = []
    for m in merged:
        spec = group[m.name]
        if isinstance(spec.host, LogicalHostPool) or spec.device is None:
            continue  # an anchor without bytes: nothing to copy
        row_bytes = max(p.slot_nbytes for p in spec.device.planes)
        min_run = max(1, -(-min_run_bytes // row_bytes))
        if direction is Direction.BACKUP:
            plan = plan_copies(m.device_indices, m.host_indices, min_run=min_run)
        else:
            plan = plan_copies(m.host_indices, m.device_indices, min_run=min_run)
        copies.append(PoolCopy(m.name, spec.host, spec.device, plan))
    return BatchPlan(direction, group.num_layers, merged, tuple(copies))
