"""Merging the transfers of a batch, and deriving sidecar rows: pure functions.

Transfers are grouped by the key ``(name, indices_from_pool)`` and concatenated
in operation order; each merged transfer keeps, per operation, where its part
lies, so results and failures go back to the right operation. Sidecar rows are
derived from the *merged* indices of their source (lazy binding): for every
whole source page ``p``, rows ``p*k .. p*k+k-1``, read from the first index of
each page.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.pools import SidecarSpec, as_slot_tensor
from kvtier.transfers.operation import PoolTransfer

__all__ = ["MergedTransfer", "TransferPart", "derive_sidecar_indices", "merge_transfers"]

_ARANGE: dict[int, torch.Tensor] = {}


def derive_sidecar_indices(source_indices: torch.Tensor, page_size: int, rows_per_page: int) -> torch.Tensor:
    """Rows of a sidecar for whole source pages: ``p*k + (0..k-1)`` per page ``p``.

    The page of each group of ``page_size`` indices is read from its first index.
    """
    pages = source_indices[::page_size] // page_size
    if rows_per_page == 1:
        return pages
    offsets = _ARANGE.get(rows_per_page)
    if offsets is None:
        offsets = _ARANGE[rows_per_page] = torch.arange(rows_per_page, dtype=torch.int64)
    return (pages[:, None] * rows_per_page + offsets).reshape(-1)


@dataclass(frozen=True, slots=True)
class TransferPart:
    """Rows ``start:stop`` of a merged transfer belong to operation ``operation``
    (its position in the batch)."""

    operation: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True, eq=False)
class MergedTransfer:
    name: str
    indices_from_pool: str | None
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    parts: tuple[TransferPart, ...]

    @property
    def rows(self) -> int:
        return int(self.host_indices.numel())


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def merge_transfers(
    operations: Sequence[Sequence[PoolTransfer]],
    sidecars: Mapping[str, SidecarSpec],
) -> tuple[MergedTransfer, ...]:
    """Merge the transfers of ``operations`` (in batch order) by
    ``(name, indices_from_pool)``; derive sidecar rows from merged sources.

    Raises ValueError when a derived transfer's source is not in the batch or
    is not the sidecar's registered source.
    """
    owned: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], list[TransferPart]]] = {}
    derived: dict[tuple[str, str], list[int]] = {}
    for op_index, transfers in enumerate(operations):
        for t in transfers:
            if t.indices_from_pool is not None:
                derived.setdefault((t.name, t.indices_from_pool), []).append(op_index)
                continue
            assert t.host_indices is not None and t.device_indices is not None  # built so by the scheduler
            entry = owned.get(t.name)
            if entry is None:
                entry = owned[t.name] = ([], [], [])
            hosts, devices, parts = entry
            start = parts[-1].stop if parts else 0
            host = as_slot_tensor(t.host_indices)
            hosts.append(host)
            devices.append(as_slot_tensor(t.device_indices))
            parts.append(TransferPart(op_index, start, start + len(host)))

    merged = [
        MergedTransfer(name, None, _cat(h), _cat(d), tuple(p)) for name, (h, d, p) in owned.items()
    ]
    by_name = {m.name: m for m in merged}
    for (name, source), op_indices in derived.items():
        spec = sidecars.get(name)
        if spec is None or spec.source != source:
            raise ValueError(f"transfer {name!r} derives from {source!r}, which is not its registered source")
        src = by_name.get(source)
        wanted = set(op_indices)
        missing = wanted - {p.operation for p in src.parts} if src is not None else wanted
        if missing:
            raise ValueError(
                f"operation {min(missing)} carries sidecar {name!r} without its source {source!r}; "
                "a sidecar's rows derive from its source's indices in the same operation"
            )
        assert src is not None
        ps, k = spec.source_page_size, spec.rows_per_page
        if len(wanted) == len(src.parts):
            # Every operation of the source carries the sidecar: derive in one go.
            host = derive_sidecar_indices(src.host_indices, ps, k)
            device = derive_sidecar_indices(src.device_indices, ps, k)
            side_parts = tuple(TransferPart(p.operation, p.start // ps * k, p.stop // ps * k) for p in src.parts)
        else:
            carried = [p for p in src.parts if p.operation in wanted]
            host = _cat([derive_sidecar_indices(src.host_indices[p.start : p.stop], ps, k) for p in carried])
            device = _cat([derive_sidecar_indices(src.device_indices[p.start : p.stop], ps, k) for p in carried])
            offsets = list(itertools.accumulate(((p.stop - p.start) // ps * k for p in carried), initial=0))
            side_parts = tuple(TransferPart(p.operation, a, b) for p, a, b in zip(carried, offsets, offsets[1:]))
        merged.append(MergedTransfer(name, source, host, device, side_parts))
    return tuple(merged)
