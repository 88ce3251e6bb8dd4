"""Host pools: kvtier's CPU mirror of a device pool.

`HostPool` holds every plane of every layer of one pool in one buffer per plane,
in one of two layouts:

* ``layer_first``: ``[layers, slots, ...]``: a layer's slots are contiguous.
* ``page_first``: ``[slots, layers, ...]``: a slot's layers are contiguous.

An allocating host pool has a `PageAllocator` over its slots; a sidecar's host
pool has storage but no allocator (its rows follow its source's pages).
`LogicalHostPool` is the other way round: slot accounting and no bytes.
Buffers are pinned only when CUDA is available (pinning needs a CUDA runtime),
and without torch's power-of-two rounding of pinned allocations: the buffer is
allocated as plain host memory, then registered with ``cudaHostRegister`` in
chunks of at most 1 GiB; `HostPool.close` (or garbage collection) unregisters it.

Every buffer starts on a host page boundary and owns whole pages (`aligned_empty`
over-allocates and offsets), so no two registrations ever share a page. Chunk
boundaries fall on page and row boundaries (`registration_chunk_bytes`), and
`HostPool.registration_cuts` names the rows where one registration ends and the
next begins: a direct copy is split there, so that none spans two registrations.
"""

from __future__ import annotations

import math
import mmap
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from kvtier.errors import ConfigurationError, WrongType
from kvtier.pools.allocator import PageAllocator, check_capacity, positive_int
from kvtier.pools.device import PlaneSpec

__all__ = ["HostPool", "HostPoolStatistics", "Layout", "LogicalHostPool", "aligned_empty",
           "registration_chunk_bytes"]

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


PIN_CHUNK_BYTES = 1 << 30
HOST_PAGE_BYTES = max(4096, mmap.PAGESIZE)


def aligned_empty(shape: Sequence[int], dtype: torch.dtype, align: int = HOST_PAGE_BYTES) -> torch.Tensor:
    """An uninitialised contiguous host tensor whose first byte is on an
    ``align``-byte boundary and whose last page belongs to it alone.

    torch's host allocator aligns large buffers to 64 bytes only, so two
    buffers may share a page, and so would their ``cudaHostRegister``
    registrations. This over-allocates by one page plus the rounding and
    returns a view at the first aligned byte; the view keeps the whole
    allocation alive.
    """
    if align <= 0 or align & (align - 1):
        raise ConfigurationError(f"align must be a power of two; got {align!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    padded = -(-nbytes // align) * align
    raw = torch.empty(padded + align, dtype=torch.uint8)
    offset = -raw.data_ptr() % align
    return raw[offset : offset + nbytes].view(dtype).view(tuple(shape))


def registration_chunk_bytes(row_bytes: int, limit: int = PIN_CHUNK_BYTES, page: int = HOST_PAGE_BYTES) -> int:
    """The largest chunk of at most ``limit`` bytes that is a whole number of
    host pages and of ``row_bytes``-byte rows, so that chunk boundaries fall
    between rows and on page boundaries; one such unit when even that is over
    ``limit`` (rows of an odd size).
    """
    unit = math.lcm(row_bytes, page)
    return max(1, limit // unit) * unit


class PinningRuntime(Protocol):
    """The CUDA runtime calls that page-lock host memory (``cudaHostRegister``
    and ``cudaHostUnregister``, returning the CUDA error code), and a way to
    clear the thread's last CUDA error after a failed call."""

    def register(self, ptr: int, size: int) -> int: ...
    def unregister(self, ptr: int) -> int: ...
    def clear_error(self, code: int) -> None: ...


class TorchPinningRuntime:
    """`PinningRuntime` on ``torch.cuda.cudart()``."""

    def register(self, ptr: int, size: int) -> int:
        return int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))  # type: ignore[no-untyped-call]

    def unregister(self, ptr: int) -> int:
        return int(torch.cuda.cudart().cudaHostUnregister(ptr))  # type: ignore[no-untyped-call]

    def clear_error(self, code: int) -> None:
        """Reset the calling thread's last CUDA error after a failed call.

        The CUDA runtime keeps a failed call's code as the thread's last error
        until something reads it, and torch reads it after every kernel launch:
        left alone, a failed ``cudaHostRegister`` would surface as the error of
        some unrelated later kernel. torch binds no ``cudaGetLastError``, but a
        kernel launch reads it (and so resets it) and raises it: launch a tiny
        one and swallow exactly that error. Any other error is raised.
        """
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        text = str(cudart.cudaGetErrorString(cudart.cudaError(code)))
        try:
            torch.ones(1, device="cuda")
        except RuntimeError as exc:
            if text not in str(exc):
                raise


def register_pinned(
    t: torch.Tensor, chunk_bytes: int = PIN_CHUNK_BYTES, runtime: PinningRuntime | None = None
) -> weakref.finalize:  # type: ignore[type-arg]
    """Page-lock ``t``'s memory with ``cudaHostRegister``, in chunks of at most
    ``chunk_bytes`` (so that no single registration is huge).

    Returns a finalizer that unregisters every chunk: called by
    `HostPool.close`, or when ``t`` is collected. If CUDA refuses a chunk,
    raises RuntimeError naming the chunk and the CUDA error, after
    unregistering the chunks it had registered and clearing the thread's last
    CUDA error: nothing stays registered and no error is left for a later call.
    """
    rt: PinningRuntime = runtime if runtime is not None else TorchPinningRuntime()
    base = t.data_ptr()
    size = t.numel() * t.element_size()
    done: list[int] = []
    for offset in range(0, size, chunk_bytes):
        n = min(chunk_bytes, size - offset)
        err = rt.register(base + offset, n)
        if err != 0:
            _unregister(rt, done)
            rt.clear_error(err)
            # Not input kvtier can check: CUDA refused memory the caller's sizes allowed (a KvtierError
            # would claim a rule was broken); a RuntimeError, as torch's own CUDA failures are.
            raise RuntimeError(
                f"cudaHostRegister of {n} bytes at offset {offset} of a {size}-byte host buffer "
                f"failed with CUDA error {err}; nothing of the buffer stays registered"
            )
        done.append(base + offset)
    return weakref.finalize(t, _unregister, rt, done)


def _unregister(rt: PinningRuntime, pointers: list[int]) -> None:
    failed = 0
    for ptr in pointers:
        err = rt.unregister(ptr)
        if err != 0:
            failed = err
    pointers.clear()
    if failed:
        rt.clear_error(failed)


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
        pin_chunk_bytes: int | None = None,
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
            aligned_empty(
                (num_layers, slots, *p.shape) if layout == "layer_first" else (slots, num_layers, *p.shape),
                p.dtype,
            )
            for p in self.planes
        ]
        self._pins: list[weakref.finalize] = []  # type: ignore[type-arg]
        # Per plane, per layer: the rows of the layer view where a registration
        # chunk ends (empty where none does, or where the view is strided).
        self._cuts: list[list[tuple[int, ...]]] = [[()] * num_layers for _ in self.planes]
        if pin:
            limit = PIN_CHUNK_BYTES if pin_chunk_bytes is None else pin_chunk_bytes
            positive_int(name, "pin chunk bytes", limit)
            try:
                for i, (b, p) in enumerate(zip(self._buffers, self.planes)):
                    chunk = registration_chunk_bytes(p.slot_nbytes, limit)
                    self._pins.append(register_pinned(b, chunk))
                    self._cuts[i] = self._chunk_cuts(b, p.slot_nbytes, chunk)
            except BaseException:
                self.close()  # all or nothing: no plane stays registered
                raise
        self.slot_nbytes = num_layers * sum(p.slot_nbytes for p in self.planes)
        """Bytes one slot holds across every layer and plane."""

    def _chunk_cuts(self, buf: torch.Tensor, row_bytes: int, chunk: int) -> list[tuple[int, ...]]:
        if self.layout != "layer_first" and self.num_layers != 1:
            return [()] * self.num_layers  # strided layer views: never copied directly
        total_rows = buf.numel() * buf.element_size() // row_bytes
        rows_per_chunk = chunk // row_bytes
        boundaries = range(rows_per_chunk, total_rows, rows_per_chunk)  # in rows of the whole buffer
        return [tuple(b - j * self.slots for b in boundaries if 0 < b - j * self.slots < self.slots)
                for j in range(self.num_layers)]

    def registration_cuts(self, layer: int, plane: int) -> tuple[int, ...]:
        """Rows ``r`` of ``layer_view(layer, plane)`` where one pinned
        registration ends and the next begins (row ``r`` starts the next),
        ascending; empty when the view lies in one registration, is not
        pinned, or is strided (``page_first`` with several layers)."""
        return self._cuts[plane][layer]

    def close(self) -> None:
        """Unregister pinned memory now (the buffers stay readable, unpinned)."""
        for unregister in self._pins:
            unregister()
        self._pins = []
        self._cuts = [[()] * self.num_layers for _ in self.planes]

    has_bytes = True

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

    def stacked(self, plane: int) -> torch.Tensor:
        """``[layers, slots, ...]`` view of one plane whatever the layout
        (strided for page_first), as `DevicePool.stacked` gives the device's."""
        buf = self._buffers[plane]
        return buf if self.layout == "layer_first" else buf.transpose(0, 1)

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
        raise WrongType(f"logical pool {self.name!r} holds no bytes; it has no layers to view")

    def registration_cuts(self, layer: int, plane: int) -> tuple[int, ...]:
        """None: a logical pool registers no memory."""
        return ()

    def close(self) -> None:
        """Nothing to release: a logical pool holds no memory."""

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
