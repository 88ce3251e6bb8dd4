"""Host pools: kvtier's CPU mirror of a device pool.

`HostPool` holds every plane of every layer of one pool in one buffer per plane,
in one of two layouts:

* ``layer_first``: ``[layers, slots, ...]``: a layer's slots are contiguous.
* ``page_first``: ``[slots, layers, ...]``: a slot's layers are contiguous.

An allocating host pool has a `PageAllocator` over its slots; a sidecar's host
pool has storage but no allocator (its rows follow its source's pages).
`LogicalHostPool` is the other way round: slot accounting and no bytes.
Buffers are pinned only when CUDA is available (pinning needs a CUDA runtime).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvtier.errors import ConfigurationError
from kvtier.pools.allocator import PageAllocator, check_capacity, positive_int
from kvtier.pools.device import PlaneSpec

__all__ = ["HostPool", "HostPoolStatistics", "Layout", "LogicalHostPool"]

Layout = Literal["layer_first", "page_first"]
LAYOUTS: tuple[Layout, ...] = ("layer_first", "page_first")


@dataclass(frozen=True, slots=True)
class HostPoolStatistics:
    """Usage of one host pool. Sidecars own no slots: their usage is None."""

    name: str
    kind: str
    layout: str | None
    page_size: int | None
    capacity_slots: int
    used_slots: int | None
    free_slots: int | None
    peak_used_slots: int | None
    nbytes: int


class HostPool:
    """Host storage for one pool: ``slots`` rows of every layer and plane."""

    kind = "pool"

    def __init__(
        self,
        name: str,
        *,
        planes: Sequence[PlaneSpec],
        num_layers: int,
        slots: int,
        page_size: int | None,
        layout: Layout = "layer_first",
        pin_memory: bool | None = None,
    ) -> None:
        if layout not in LAYOUTS:
            raise ConfigurationError(f"pool {name!r} layout must be one of {LAYOUTS}; got {layout!r}")
        positive_int(name, "host capacity", slots)
        positive_int(name, "number of layers", num_layers)
        if page_size is not None:
            check_capacity(name, slots, page_size)
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.name = name
        self.layout: Layout = layout
        self.planes = tuple(planes)
        self.num_layers = num_layers
        self.slots = slots
        self.page_size = page_size
        self.pinned = pin
        self.allocator = None if page_size is None else PageAllocator(slots, page_size, name=name)
        self._buffers = [
            torch.empty(
                (num_layers, slots, *p.shape) if layout == "layer_first" else (slots, num_layers, *p.shape),
                dtype=p.dtype,
                pin_memory=pin,
            )
            for p in self.planes
        ]

    has_bytes = True

    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot holds across every layer and plane."""
        return self.num_layers * sum(p.slot_nbytes for p in self.planes)

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_nbytes

    def layer_view(self, layer: int, plane: int) -> torch.Tensor:
        """``[slots, ...]`` view of one layer and plane (strided for page_first)."""
        buf = self._buffers[plane]
        return buf[layer] if self.layout == "layer_first" else buf[:, layer]

    def buffer(self, plane: int) -> torch.Tensor:
        """The whole buffer of one plane, in this pool's layout."""
        return self._buffers[plane]

    def statistics(self) -> HostPoolStatistics:
        alloc = self.allocator
        if alloc is None:
            return HostPoolStatistics(
                self.name, "sidecar", self.layout, None, self.slots, None, None, None, self.nbytes
            )
        s = alloc.statistics()
        return HostPoolStatistics(
            self.name, self.kind, self.layout, s.page_size, s.capacity_slots,
            s.used_slots, s.free_slots, s.peak_used_slots, self.nbytes,
        )

    def __repr__(self) -> str:
        if self.allocator is None:
            return f"<HostPool {self.name!r} [sidecar rows: {self.slots} | {self.layout}]>"
        a = self.allocator
        return (
            f"<HostPool {self.name!r} [pages: {a.num_pages - a.num_free_pages} used, "
            f"{a.num_free_pages} free | page_size={a.page_size}, {self.layout}]>"
        )


class LogicalHostPool:
    """An anchor pool: owns host slot accounting, holds no bytes.

    Its indices drive sidecars; copies to or from it are no-ops.
    """

    kind = "logical"
    has_bytes = False
    num_layers = 0
    planes: tuple[PlaneSpec, ...] = ()
    slot_nbytes = 0
    nbytes = 0
    layout = None
    pinned = False

    def __init__(self, name: str, *, page_size: int, slots: int) -> None:
        self.name = name
        self.allocator = PageAllocator(slots, page_size, name=name)
        self.page_size = page_size
        self.slots = slots

    def layer_view(self, layer: int, plane: int) -> torch.Tensor:
        raise TypeError(f"logical pool {self.name!r} holds no bytes; it has no layers to view")

    def statistics(self) -> HostPoolStatistics:
        s = self.allocator.statistics()
        return HostPoolStatistics(
            self.name, self.kind, None, s.page_size, s.capacity_slots,
            s.used_slots, s.free_slots, s.peak_used_slots, 0,
        )

    def __repr__(self) -> str:
        a = self.allocator
        return (
            f"<LogicalHostPool {self.name!r} [pages: {a.num_pages - a.num_free_pages} used, "
            f"{a.num_free_pages} free | page_size={a.page_size}]>"
        )
