"""The records that describe a transfer: `PoolTransfer` and `CacheOperation`."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.pools import PageList

__all__ = ["CacheOperation", "Direction", "PoolTransfer"]


class Direction(str, enum.Enum):
    """BACKUP copies device -> host; LOAD copies host -> device."""

    BACKUP = "backup"
    LOAD = "load"


@dataclass(frozen=True, slots=True, eq=False)
class PoolTransfer:
    """The part of one operation that touches one pool.

    A transfer of a slot-owning pool carries its indices. A derived (sidecar)
    transfer carries none: ``indices_from_pool`` names its source, and its rows
    are derived at batch time from the source's merged indices.

    ``valid``: per page, how many rows from the page's start hold data; only
    those move (a partial last page, a window or buffer that does not fill its
    page, a sidecar page with fewer entries than rows). One count per page of
    ``host_indices`` (a `PageList`) for a slot-owning pool, one per page of
    the source for a derived transfer, each ``0 .. rows per page``. None (the
    default, and the hot path): every row of every page moves.
    """

    name: str
    host_indices: torch.Tensor | PageList | None
    device_indices: torch.Tensor | PageList | None
    indices_from_pool: str | None = None
    valid: Sequence[int] | None = None

    @property
    def derived(self) -> bool:
        return self.indices_from_pool is not None


@dataclass(frozen=True, slots=True, eq=False)
class CacheOperation:
    """One backup or load request, as the batching stage sees it."""

    id: int
    direction: Direction
    transfers: tuple[PoolTransfer, ...]
    priority: int
    nbytes: int
    # What the copies must wait for (an event-like object with `synchronize`
    # and, on CUDA, usable in `stream.wait_event`), captured at submission.
    fence: object | None = None
    # The ids of the requests of a bulk call this operation carries (None:
    # the operation is one request, ``id``).
    requests: tuple[int, ...] | None = None

    @property
    def request_ids(self) -> tuple[int, ...]:
        return (self.id,) if self.requests is None else self.requests
