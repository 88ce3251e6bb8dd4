"""`DevicePool`: a wrapper around the engine's own cache tensors for one pool.

kvtier never allocates device cache memory; it reads and writes the tensors the
engine hands over. A pool has layers; each layer has one or more planes (K and
V, or a value and its scale), each a tensor indexed by slot in dimension 0.
``layer_map[t]`` names the pool layer that transfer layer ``t`` moves, or None
when the pool has nothing at that transfer layer.

When the engine allocated a plane of every layer in one tensor (``[layers,
slots, ...]`` or ``[slots, layers, ...]``) and passed its layer slices, the
slices share one storage at a constant layer stride: `DevicePool.stacked`
then gives a ``[layers, slots, ...]`` view of that plane, which lets a copy
cover every layer in one call. Separate per-layer allocations have none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigurationError
from kvtier.pools.allocator import SlotAllocator

__all__ = ["DevicePool", "PlaneSpec"]


@dataclass(frozen=True, slots=True)
class PlaneSpec:
    """Shape (after the slot dimension) and dtype of one plane of a layer."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def slot_nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


LayerMapInput = Sequence[int | None] | Mapping[int, int | None] | None


class DevicePool:
    """The engine's tensors for one pool, validated for shape, dtype and device.

    Raises `ConfigurationError` when layers disagree on their planes, when the
    planes disagree on the slot count or device, when they are on the ``meta``
    device (no storage to copy), or when ``layer_map`` does not name every pool
    layer exactly once.
    """

    def __init__(
        self,
        layers: Sequence[Sequence[torch.Tensor] | torch.Tensor],
        layer_map: LayerMapInput = None,
        allocator: SlotAllocator | None = None,
    ) -> None:
        norm = [[layer] if isinstance(layer, torch.Tensor) else list(layer) for layer in layers]
        if not norm:
            raise ConfigurationError("DevicePool needs at least one layer; got none")
        for i, layer in enumerate(norm):
            if not layer:
                raise ConfigurationError(f"DevicePool layer {i} has no planes; each layer needs at least one tensor")
            for p, t in enumerate(layer):
                if not isinstance(t, torch.Tensor):
                    raise ConfigurationError(
                        f"DevicePool layer {i} plane {p} must be a tensor; got {type(t).__name__}"
                    )
                if t.dim() < 1:
                    raise ConfigurationError(
                        f"DevicePool layer {i} plane {p} needs a slot dimension; got a 0-d tensor"
                    )
                if 0 in t.shape[1:]:
                    # Every copy plan and stored page divides by a row's bytes.
                    raise ConfigurationError(
                        f"DevicePool layer {i} plane {p} of shape {tuple(t.shape)} holds 0 bytes per slot; a pool "
                        f"without bytes is a logical pool (PoolGroup.add_logical_pool)"
                    )
        num_planes = len(norm[0])
        first = norm[0][0]
        slots = first.shape[0]
        planes = tuple(PlaneSpec(tuple(t.shape[1:]), t.dtype) for t in norm[0])
        for i, layer in enumerate(norm):
            if len(layer) != num_planes:
                raise ConfigurationError(
                    f"DevicePool layers must have the same planes; layer 0 has {num_planes}, "
                    f"layer {i} has {len(layer)}"
                )
            for p, t in enumerate(layer):
                spec = PlaneSpec(tuple(t.shape[1:]), t.dtype)
                if spec != planes[p]:
                    raise ConfigurationError(
                        f"DevicePool layer {i} plane {p} is {spec.shape} {spec.dtype} per slot; "
                        f"layer 0 plane {p} is {planes[p].shape} {planes[p].dtype}"
                    )
                if t.shape[0] != slots:
                    raise ConfigurationError(
                        f"DevicePool layer {i} plane {p} has {t.shape[0]} slots; layer 0 has {slots}"
                    )
                if t.device != first.device:
                    raise ConfigurationError(
                        f"DevicePool layer {i} plane {p} is on {t.device}; layer 0 is on {first.device}"
                    )
        if first.device.type == "meta":
            # Meta tensors have shapes but no storage: every copy would fail at batch time.
            raise ConfigurationError(
                "DevicePool tensors are on device meta, which holds no data; "
                "a pool's tensors must hold its rows (a CPU or CUDA device)"
            )
        self._layers = norm
        self._stacked = tuple(_stacked_view([layer[p] for layer in norm]) for p in range(num_planes))
        self._planes = planes
        self._slots = int(slots)
        self.device = first.device
        self.layer_map = _normalise_layer_map(layer_map, len(norm))
        if allocator is not None and not isinstance(allocator, SlotAllocator):
            raise ConfigurationError(
                f"DevicePool allocator must provide page_size, num_free_slots, try_alloc and free; "
                f"got {type(allocator).__name__}"
            )
        self.allocator = allocator

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def planes(self) -> tuple[PlaneSpec, ...]:
        return self._planes

    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot holds across every layer and plane."""
        return self.num_layers * sum(p.slot_nbytes for p in self._planes)

    def pool_layer(self, transfer_layer: int) -> int | None:
        """The pool layer that ``transfer_layer`` moves, or None."""
        if 0 <= transfer_layer < len(self.layer_map):
            return self.layer_map[transfer_layer]
        return None

    def tensor(self, layer: int, plane: int) -> torch.Tensor:
        """The engine's tensor for pool ``layer``, ``plane``: ``[slots, ...]``."""
        return self._layers[layer][plane]

    def stacked(self, plane: int) -> torch.Tensor | None:
        """``[layers, slots, ...]``: every layer of ``plane`` as one view, or None.

        Not None only when the layer tensors are views of one storage with
        the same shape and strides at a constant, positive layer stride, and
        the stacked view overlaps nowhere; then ``stacked(p)[j]`` is the very
        memory of ``tensor(j, p)``. Separate per-layer allocations give None.
        """
        return self._stacked[plane]

    def __repr__(self) -> str:
        planes = ", ".join(f"{p.shape} {p.dtype}" for p in self._planes)
        stacked = ", stacked" if all(v is not None for v in self._stacked) else ""
        return f"<DevicePool [{self.num_layers} layers x {self._slots} slots | {planes} | {self.device}{stacked}]>"


def _stacked_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``tensors`` (one plane's layers) as one ``[layers, ...]`` view of their
    shared storage, or None when they are not evenly spaced views of one."""
    first = tensors[0]
    if len(tensors) == 1:
        return first.unsqueeze(0)
    base = int(first.storage_offset())
    step = int(tensors[1].storage_offset()) - base
    if step <= 0:
        return None
    storage = first.untyped_storage().data_ptr()
    for j, t in enumerate(tensors):
        if (
            t.untyped_storage().data_ptr() != storage
            or t.shape != first.shape
            or t.stride() != first.stride()
            or t.storage_offset() != base + j * step
        ):
            return None
    shape = (len(tensors), *(int(n) for n in first.shape))
    strides = (step, *(int(st) for st in first.stride()))
    if not _non_overlapping(shape, strides):
        return None
    return first.as_strided(shape, strides, base)


def _non_overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True when no two elements of a strided view share memory (a sufficient
    test: each stride, smallest first, exceeds the extent of the smaller ones)."""
    dims = sorted((st, n) for n, st in zip(shape, strides) if n > 1)
    extent = 0
    for stride, n in dims:
        if stride <= extent:
            return False
        extent += stride * (n - 1)
    return True


def _normalise_layer_map(layer_map: LayerMapInput, num_layers: int) -> tuple[int | None, ...]:
    if layer_map is None:
        return tuple(range(num_layers))
    if isinstance(layer_map, Mapping):
        bad_keys = [k for k in layer_map if not isinstance(k, int) or isinstance(k, bool) or k < 0]
        if bad_keys:
            raise ConfigurationError(
                f"layer_map keys are transfer layers (ints >= 0); got {bad_keys[0]!r}"
            )
        size = max(layer_map, default=-1) + 1
        entries: list[int | None] = [layer_map.get(t) for t in range(size)]
    else:
        entries = list(layer_map)
    seen: set[int] = set()
    for t, j in enumerate(entries):
        if j is None:
            continue
        if not isinstance(j, int) or isinstance(j, bool) or not 0 <= j < num_layers:
            raise ConfigurationError(
                f"layer_map[{t}] must be a pool layer in 0..{num_layers - 1} or None; got {j!r}"
            )
        if j in seen:
            raise ConfigurationError(
                f"layer_map names pool layer {j} twice; each pool layer moves with one transfer layer"
            )
        seen.add(j)
    if len(seen) != num_layers:
        missing = sorted(set(range(num_layers)) - seen)
        raise ConfigurationError(
            f"layer_map must name every pool layer exactly once; pool layers {missing} are missing"
        )
    return tuple(entries)
