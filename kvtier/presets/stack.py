"""Pool stacks: a model's pools planned once, sized like engines size them, registered in one call.

A `PoolStack` is a plain description of pools (`PoolPlan`: name, kind, planes,
layer map, page size, source) with no tensors. It answers what each pool
costs per page and sizes the host tier the three ways engines do:

* ``host_ratio``: host pages = ratio x device pages, per slot-owning pool
  (one ratio for all, or one per pool); sidecars follow their source;
* ``host_bytes``: one budget for the whole stack, split in the proportions of
  the device stack (every pool gets the same host/device ratio, so a pool's
  share is its bytes per page, sidecar rows included, times its pages);
* ``host_slots``: slots per slot-owning pool, as `PoolGroup.add_pool` takes them.

`PoolStack.register` then registers every pool in a `PoolGroup`, with the
engine's own `DevicePool`\\ s where given (checked against the plan) and
zeroed tensors otherwise. Sizes are checked before anything is allocated or
registered: a bad size raises `ConfigurationError` naming the pool, the
value and the rule, and the group is left as it was.

Two generic shapes come ready-made: `anchor_with_sidecars` (one slot-owning
pool whose pages drive sidecars) and `shared_anchor` (a logical anchor whose
slot numbers several byte pools share, one row per slot).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvtier.errors import ConfigurationError, WrongType
from kvtier.pools import DevicePool, PageAllocator, PlaneSpec, PoolGroup, SlotAllocator
from kvtier.pools.host import LAYOUTS, Layout

__all__ = [
    "PoolPlan",
    "PoolStack",
    "StackSizes",
    "anchor_with_sidecars",
    "shared_anchor",
]

Kind = Literal["pool", "logical", "sidecar"]
Ratio = float | int | Mapping[str, float | int]


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """One pool of a stack, before any tensor exists.

    ``page_size`` is slots (token positions) per page for a pool or a logical
    pool. A sidecar has no pages of its own: its ``page_size`` field holds
    its rows per page of its source, which `rows_per_page` names (as
    `PoolGroup` does; at V4's rate 8 and page 64, ``c4`` has 8 rows per
    anchor page, not pages of 8 tokens). ``str(plan)`` says which.
    ``layer_map`` maps transfer layer -> pool layer (or None); a logical pool
    has none.
    """

    name: str
    kind: Kind
    page_size: int
    planes: tuple[PlaneSpec, ...] = ()
    layer_map: tuple[int | None, ...] = ()
    source: str | None = None

    @classmethod
    def pool(cls, name: str, *, page_size: int, planes: Sequence[PlaneSpec],
             layer_map: Sequence[int | None]) -> PoolPlan:
        return cls(name, "pool", page_size, tuple(planes), tuple(layer_map))

    @classmethod
    def logical(cls, name: str, *, page_size: int) -> PoolPlan:
        return cls(name, "logical", page_size)

    @classmethod
    def sidecar(cls, name: str, *, source: str, rows_per_page: int, planes: Sequence[PlaneSpec],
                layer_map: Sequence[int | None]) -> PoolPlan:
        return cls(name, "sidecar", rows_per_page, tuple(planes), tuple(layer_map), source)

    @property
    def owns_slots(self) -> bool:
        return self.kind != "sidecar"

    @property
    def rows_per_page(self) -> int:
        """Rows of this pool in one page of the pool that owns its slots: a
        sidecar's rows per source page, a pool's page size (one row per
        slot), 0 for a logical pool (it holds no rows)."""
        return 0 if self.kind == "logical" else self.page_size

    def __str__(self) -> str:
        if self.kind == "logical":
            return f"{self.name}: logical, {_per_page(self.page_size)}, no bytes"
        planes = ", ".join(f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}" for p in self.planes)
        where = (f"sidecar of {self.source}, {self.page_size} rows per {self.source} page"
                 if self.kind == "sidecar" else f"pool, {_per_page(self.page_size)}")
        return f"{self.name}: {where}, {self.num_layers} of {len(self.layer_map)} layers, planes [{planes}]"

    @property
    def num_layers(self) -> int:
        """Pool layers: the transfer layers that map to one."""
        return sum(1 for j in self.layer_map if j is not None)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot (one row) across the pool's layers and planes."""
        return self.num_layers * sum(p.slot_nbytes for p in self.planes)


@dataclass(frozen=True, slots=True)
class StackSizes:
    """What `PoolStack.register` registered: pages and bytes per pool.

    Slot-owning pools have device and host pages of their own; a sidecar's
    entries are its source's pages (its rows are ``pages x rows_per_page``).
    """

    device_pages: Mapping[str, int]
    host_pages: Mapping[str, int]
    host_nbytes: Mapping[str, int]

    @property
    def total_host_nbytes(self) -> int:
        return sum(self.host_nbytes.values())


class PoolStack:
    """An ordered set of `PoolPlan`\\ s: sources before their sidecars.

    Raises `ConfigurationError` for a repeated name, a sidecar whose source is
    not planned before it or is itself a sidecar, a pool or sidecar without
    planes or layers, or a page size that is not a positive int.
    """

    def __init__(self, plans: Sequence[PoolPlan]) -> None:
        self.plans: tuple[PoolPlan, ...] = tuple(plans)
        if not self.plans:
            raise ConfigurationError("a pool stack needs at least one pool; got none")
        seen: dict[str, PoolPlan] = {}
        for plan in self.plans:
            if not isinstance(plan.name, str) or not plan.name:
                raise ConfigurationError(f"pool names are non-empty strings; got {plan.name!r}")
            if plan.name in seen:
                raise ConfigurationError(f"pool {plan.name!r} is planned twice")
            _positive(plan.name, "page_size" if plan.owns_slots else "rows_per_page", plan.page_size)
            if plan.kind != "logical" and (not plan.planes or plan.num_layers == 0):
                raise ConfigurationError(
                    f"pool {plan.name!r} holds bytes, so it needs planes and at least one layer; "
                    f"got {len(plan.planes)} planes on {plan.num_layers} layers"
                )
            if plan.kind == "sidecar":
                src = seen.get(plan.source or "")
                if src is None or not src.owns_slots:
                    raise ConfigurationError(
                        f"sidecar {plan.name!r} names source {plan.source!r}, which must be a pool or a "
                        f"logical pool planned before it (planned: {list(seen)})"
                    )
            seen[plan.name] = plan
        self._by_name = seen

    # -- what the stack holds ---------------------------------------------------

    def __getitem__(self, name: str) -> PoolPlan:
        try:
            return self._by_name[name]
        except KeyError:
            raise ConfigurationError(f"unknown pool {name!r}; this stack has {list(self._by_name)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    @property
    def anchors(self) -> tuple[str, ...]:
        """The slot-owning pools (pools and logical pools), in plan order."""
        return tuple(p.name for p in self.plans if p.owns_slots)

    def sidecars_of(self, name: str) -> tuple[PoolPlan, ...]:
        return tuple(p for p in self.plans if p.source == name)

    @property
    def num_layers(self) -> int:
        """Transfer layers: the longest layer map."""
        return max((len(p.layer_map) for p in self.plans), default=0)

    def page_nbytes(self, name: str) -> int:
        """Bytes of one page of slot-owning pool ``name``, with the rows its sidecars derive from it."""
        plan = self[name]
        if not plan.owns_slots:
            raise ConfigurationError(f"pool {name!r} is a sidecar of {plan.source!r}; its bytes count in its source's pages")
        sidecars = sum(s.rows_per_page * s.slot_nbytes for s in self.sidecars_of(name))
        return plan.rows_per_page * plan.slot_nbytes + sidecars

    # -- sizing -------------------------------------------------------------------

    def device_nbytes(self, device_pages: Mapping[str, int]) -> int:
        """Bytes of the device stack with ``device_pages`` pages per slot-owning pool."""
        pages = self._device_pages(device_pages)
        return sum(pages[n] * self.page_nbytes(n) for n in self.anchors)

    def host_pages(
        self,
        device_pages: Mapping[str, int],
        *,
        host_ratio: Ratio | None = None,
        host_bytes: int | None = None,
        host_slots: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        """Host pages per slot-owning pool, from exactly one of the three sizings.

        Raises `ConfigurationError` naming the pool and the value when a size
        is not a positive number, when none or several sizings are given, or
        when a pool would get no whole page.
        """
        pages = self._device_pages(device_pages)
        given = [n for n, v in (("host_ratio", host_ratio), ("host_bytes", host_bytes),
                                ("host_slots", host_slots)) if v is not None]
        if len(given) != 1:
            raise ConfigurationError(
                f"size the host tier with exactly one of host_ratio, host_bytes, host_slots; got {given or 'none'}"
            )
        out: dict[str, int] = {}
        if host_slots is not None:
            for name in self.anchors:
                if name not in host_slots:
                    raise ConfigurationError(f"pool {name!r} needs an entry in host_slots; got {sorted(host_slots)}")
                slots = _positive(name, "host_slots", host_slots[name])
                size = self[name].page_size
                if slots % size:
                    raise ConfigurationError(
                        f"pool {name!r} host_slots must be a whole number of pages of {size} slots; got {slots}"
                    )
                out[name] = slots // size
            _no_strangers("host_slots", host_slots, self.anchors)
            return out
        if host_ratio is not None:
            ratios = self._ratios(host_ratio)
            for name in self.anchors:
                out[name] = math.floor(ratios[name] * pages[name])
                if out[name] < 1:
                    raise ConfigurationError(
                        f"pool {name!r}: host_ratio {ratios[name]!r} x {pages[name]} device pages gives no whole "
                        f"host page; a pool needs at least one (ratio >= {1 / pages[name]:.6g})"
                    )
            return out
        assert host_bytes is not None
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes <= 0:
            raise ConfigurationError(f"host_bytes (the whole stack's host budget) must be a positive int; got {host_bytes!r}")
        budget = host_bytes
        total = sum(pages[n] * self.page_nbytes(n) for n in self.anchors)
        if total == 0:
            raise ConfigurationError("host_bytes cannot size a stack that holds no bytes; use host_ratio or host_slots")
        for name in self.anchors:
            # floor(budget * pages / total) in integers: no float rounding at page edges.
            out[name] = budget * pages[name] // total
            if out[name] < 1:
                need = -(-total // min(pages.values()))
                raise ConfigurationError(
                    f"pool {name!r}: host_bytes {budget} split over the stack ({total} device bytes) gives it "
                    f"no whole page; one page of every pool needs host_bytes >= {need}"
                )
        return out

    def _device_pages(self, device_pages: Mapping[str, int]) -> dict[str, int]:
        if not isinstance(device_pages, Mapping):
            raise ConfigurationError(f"device_pages must map pool names to page counts; got {type(device_pages).__name__}")
        out = {}
        for name in self.anchors:
            if name not in device_pages:
                raise ConfigurationError(
                    f"pool {name!r} needs an entry in device_pages; got {sorted(device_pages)}"
                )
            out[name] = _positive(name, "device_pages", device_pages[name])
        _no_strangers("device_pages", device_pages, self.anchors)
        return out

    def _ratios(self, host_ratio: Ratio) -> dict[str, float]:
        if isinstance(host_ratio, Mapping):
            _no_strangers("host_ratio", host_ratio, self.anchors)
            missing = [n for n in self.anchors if n not in host_ratio]
            if missing:
                raise ConfigurationError(f"pool {missing[0]!r} needs an entry in host_ratio; got {sorted(host_ratio)}")
            return {n: _positive_ratio(n, host_ratio[n]) for n in self.anchors}
        return {n: _positive_ratio(n, host_ratio) for n in self.anchors}

    # -- registration -----------------------------------------------------------

    def register(
        self,
        group: PoolGroup,
        *,
        device_pages: Mapping[str, int] | None = None,
        devices: Mapping[str, DevicePool] | None = None,
        allocators: Mapping[str, SlotAllocator] | None = None,
        host_ratio: Ratio | None = None,
        host_bytes: int | None = None,
        host_slots: Mapping[str, int] | None = None,
        layout: Layout = "layer_first",
        device: torch.device | str | None = None,
        pin_memory: bool | None = None,
    ) -> StackSizes:
        """Register every pool of the stack in ``group``, host tier sized by
        ``host_ratio``, ``host_bytes`` or ``host_slots`` (exactly one).

        ``devices``: the engine's own `DevicePool` for some or all byte pools;
        each must have the plan's planes and layer map, and a slot-owning one
        its device allocator (or an entry in ``allocators``). Pools left out get
        zeroed tensors on ``device`` with a `PageAllocator`, sized by
        ``device_pages`` (for a sidecar, from its source's pages). A logical
        anchor's device slots are ``device_pages[name] x page_size``, handed
        out by ``allocators[name]`` or a new `PageAllocator`.

        Everything is checked before any tensor is allocated or any pool
        registered; raises `ConfigurationError` and leaves ``group`` unchanged.
        """
        if layout not in LAYOUTS:
            raise ConfigurationError(f"layout must be one of {LAYOUTS}; got {layout!r}")
        devices = dict(devices or {})
        allocators = dict(allocators or {})
        _no_strangers("devices", devices, [p.name for p in self.plans if p.kind != "logical"])
        _no_strangers("allocators", allocators, self.anchors)
        pages = dict(device_pages or {})
        for name in self.anchors:
            plan = self[name]
            dev = devices.get(name)
            if dev is not None:
                self._check_device(plan, dev)
                have = dev.slots // plan.page_size
                if name in pages and pages[name] != have:
                    raise ConfigurationError(
                        f"pool {name!r}: device_pages says {pages[name]}, its DevicePool holds {have} pages"
                    )
                pages[name] = have
                if (dev.allocator is None) == (name not in allocators):
                    raise ConfigurationError(
                        f"pool {name!r}: give its device allocator once, on its DevicePool or in allocators; "
                        f"got {'neither' if dev.allocator is None else 'both'}"
                    )
        for plan in self.plans:
            if plan.kind == "sidecar" and plan.name in devices:
                self._check_device(plan, devices[plan.name])
                need = self._device_pages(pages)[plan.source or ""] * plan.rows_per_page
                if devices[plan.name].slots < need:
                    raise ConfigurationError(
                        f"sidecar {plan.name!r} needs {need} device rows to cover {plan.source!r}'s device pages; "
                        f"its DevicePool has {devices[plan.name].slots}"
                    )
        host = self.host_pages(pages, host_ratio=host_ratio, host_bytes=host_bytes, host_slots=host_slots)
        taken = [n for n in self.names if n in group]
        if taken:
            raise ConfigurationError(f"pool {taken[0]!r} is already registered in the group")
        pages = self._device_pages(pages)

        registered: list[str] = []
        try:
            for plan in self.plans:
                self._register_one(group, plan, pages, host, devices, allocators, layout, device, pin_memory)
                registered.append(plan.name)
        except BaseException:
            # All or nothing: what this call registered goes again, sidecars
            # before their sources (the reverse of plan order).
            for name in reversed(registered):
                group.remove_pool(name)
            raise
        return StackSizes(
            device_pages=dict(pages), host_pages=dict(host),
            host_nbytes={n: group[n].host.nbytes for n in self.names},
        )

    @staticmethod
    def _register_one(
        group: PoolGroup, plan: PoolPlan, pages: Mapping[str, int], host: Mapping[str, int],
        devices: Mapping[str, DevicePool], allocators: Mapping[str, SlotAllocator], layout: Layout,
        device: torch.device | str | None, pin_memory: bool | None,
    ) -> None:
        """Allocate and register one pool; an allocation that fails raises
        `ConfigurationError` naming the pool, the memory and the bytes asked for."""
        src = plan.name if plan.owns_slots else (plan.source or "")
        if plan.kind == "logical":
            slots = host[plan.name] * plan.page_size
            # No rows, but an allocator: a list, an array and a byte per page (~45 bytes a page).
            with _allocating(plan.name, "host", host[plan.name] * 45,
                             f"the allocator of {host[plan.name]} host pages, about 45 bytes a page"):
                group.add_logical_pool(
                    plan.name, page_size=plan.page_size, host_slots=slots,
                    device_slots=pages[plan.name] * plan.page_size,
                    device_allocator=allocators.get(plan.name)
                    or PageAllocator(pages[plan.name] * plan.page_size, plan.page_size, name=plan.name),
                )
            return
        rows = pages[src] * plan.rows_per_page
        dev = devices.get(plan.name)
        if dev is None:
            with _allocating(plan.name, "device", rows * plan.slot_nbytes, f"{rows} device rows"):
                alloc = PageAllocator(rows, plan.page_size, name=plan.name) if plan.owns_slots else None
                dev = _zeros(plan, rows, device, alloc)
        elif plan.owns_slots and dev.allocator is None:
            dev = DevicePool([[dev.tensor(j, p) for p in range(len(dev.planes))] for j in range(dev.num_layers)],
                             dev.layer_map, allocators[plan.name])
        if plan.kind == "pool":
            slots = host[plan.name] * plan.page_size
            with _allocating(plan.name, "host", slots * plan.slot_nbytes, f"{slots} host slots"):
                group.add_pool(plan.name, device=dev, page_size=plan.page_size, host_slots=slots,
                               layout=layout, pin_memory=pin_memory)
        else:
            slots = host[src] * plan.rows_per_page
            with _allocating(plan.name, "host", slots * plan.slot_nbytes, f"{slots} host rows"):
                group.add_sidecar(plan.name, source=src, rows_per_page=plan.rows_per_page, device=dev,
                                  layout=layout, pin_memory=pin_memory)

    @staticmethod
    def _check_device(plan: PoolPlan, dev: DevicePool) -> None:
        if not isinstance(dev, DevicePool):
            raise ConfigurationError(f"pool {plan.name!r} device must be a DevicePool; got {type(dev).__name__}")
        if dev.planes != plan.planes:
            raise ConfigurationError(f"pool {plan.name!r} has planes {dev.planes}; the stack plans {plan.planes}")
        have = list(dev.layer_map) + [None] * (len(plan.layer_map) - len(dev.layer_map))
        want = list(plan.layer_map) + [None] * (len(dev.layer_map) - len(plan.layer_map))
        if have != want:
            raise ConfigurationError(
                f"pool {plan.name!r} has layer map {list(dev.layer_map)}; the stack plans {list(plan.layer_map)}"
            )

    def describe(self, group: PoolGroup) -> list[dict[str, object]]:
        """One row per pool as registered in ``group``: kind, page size (for a
        sidecar: rows per source page, also as ``rows_per_page``), source,
        device and host slots (rows for a sidecar) and host bytes."""
        rows: list[dict[str, object]] = []
        for plan in self.plans:
            spec = group[plan.name]
            rows.append({
                "pool": plan.name, "kind": plan.kind, "page_size": plan.page_size,
                "rows_per_page": plan.rows_per_page, "source": plan.source,
                "layers": plan.num_layers, "device_slots": spec.device_slots, "host_slots": spec.host.slots,
                "host_bytes": spec.host.nbytes,
            })
        return rows

    def __repr__(self) -> str:
        parts = "; ".join(
            f"{p.name}:{p.kind}" + (f"<-{p.source} {p.page_size} rows/page" if p.source else f" page {p.page_size}")
            for p in self.plans
        )
        return f"<{type(self).__name__} [{parts}]>"


def anchor_with_sidecars(anchor: PoolPlan, sidecars: Sequence[PoolPlan]) -> PoolStack:
    """A slot-owning ``anchor`` (a pool with bytes, or a logical pool) whose
    pages drive ``sidecars`` (each with ``source`` = the anchor).

    Raises `ConfigurationError` when the anchor is a sidecar or a sidecar
    names another source.
    """
    if not anchor.owns_slots:
        raise ConfigurationError(f"the anchor {anchor.name!r} must own slots (a pool or a logical pool), not a sidecar")
    for side in sidecars:
        if side.kind != "sidecar" or side.source != anchor.name:
            raise ConfigurationError(
                f"pool {side.name!r} must be a sidecar of {anchor.name!r}; got a {side.kind} of {side.source!r}"
            )
    return PoolStack([anchor, *sidecars])


def shared_anchor(
    name: str,
    *,
    page_size: int,
    members: Mapping[str, tuple[Sequence[PlaneSpec], Sequence[int | None]]],
) -> PoolStack:
    """A logical anchor ``name`` whose slot numbers every member pool shares:
    each member is a sidecar with one row per anchor slot (``rows_per_page =
    page_size``), so anchor slot ``s`` is row ``s`` of every member.

    ``members`` maps a pool name to its planes and layer map. This is the
    shape of full-attention KV beside indexer keys or a latent cache that use
    the same page table.
    """
    _positive(name, "page_size", page_size)
    if not members:
        raise ConfigurationError(f"shared anchor {name!r} needs at least one member pool; got none")
    return PoolStack([
        PoolPlan.logical(name, page_size=page_size),
        *(PoolPlan.sidecar(m, source=name, rows_per_page=page_size, planes=planes, layer_map=lmap)
          for m, (planes, lmap) in members.items()),
    ])


def _per_page(size: int) -> str:
    return f"pages of {size} slots" if size != 1 else "pages of 1 slot"


def _positive(pool: str, what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigurationError(f"pool {pool!r} {what} must be a positive int; got {value!r}")
    return value


def _positive_ratio(pool: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"pool {pool!r} host_ratio must be a positive finite number; got {value!r}")
    return float(value)


def _no_strangers(what: str, given: Mapping[str, object], known: Sequence[str]) -> None:
    strangers = sorted(set(given) - set(known))
    if strangers:
        raise ConfigurationError(
            f"{what} names pool {strangers[0]!r}, which this stack cannot take there (it may: {list(known)})"
        )


@contextlib.contextmanager
def _allocating(pool: str, memory: str, nbytes: int, what: str) -> Iterator[None]:
    """Translate a failed allocation (``MemoryError``, or torch's
    ``RuntimeError`` / ``torch.OutOfMemoryError``) into `ConfigurationError`
    naming the pool and the bytes asked for."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:
        raise ConfigurationError(
            f"pool {pool!r}: could not allocate {nbytes} bytes of {memory} memory ({what}): "
            f"{type(exc).__name__}{': ' + str(exc).splitlines()[0] if str(exc) else ''}; size the "
            f"{'host tier smaller (host_ratio, host_bytes or host_slots)' if memory == 'host' else 'device pools smaller'}"
        ) from exc


def _zeros(plan: PoolPlan, rows: int, device: torch.device | str | None,
           allocator: SlotAllocator | None) -> DevicePool:
    # One tensor per plane holding every layer, passed as per-layer views: the
    # DevicePool is then `stacked`, so a copy can cover all layers at once.
    planes = [torch.zeros((plan.num_layers, rows, *p.shape), dtype=p.dtype, device=device) for p in plan.planes]
    tensors = [[plane[j] for plane in planes] for j in range(plan.num_layers)]
    return DevicePool(tensors, list(plan.layer_map), allocator)


def refuse_retired(func: str, given: Mapping[str, object], retired: Mapping[str, str]) -> None:
    """Raise `WrongType` (a `TypeError`) for keywords that ``func`` does not take: a retired
    spelling names its new one (no silent alias); any other reads as Python's own."""
    for key in given:
        if key in retired:
            raise WrongType(f"{func}() no longer takes {key}=; use {retired[key]}")
        raise WrongType(f"{func}() got an unexpected keyword argument {key!r}")
