"""`PoolGroup`: the named pools of one model, registered once.

Three kinds of pool:

* a *pool* (`add_pool`): device tensors, a host mirror and a host allocator;
* a *logical* pool (`add_logical_pool`): an anchor with slot accounting and no bytes;
* a *sidecar* (`add_sidecar`): device tensors and a host mirror but no allocator;
  for every whole page ``p`` of its source it uses rows ``p*k .. p*k+k-1``
  (``k = rows_per_page``) on the host and the device side alike.

A sidecar's source owns slots (a pool or a logical pool); a sidecar of a sidecar
is refused, so no cycle can form. Registration checks everything it can and
raises `ConfigurationError` naming the mismatch, registering nothing.

The group also keeps what belongs to its host pages rather than to whichever
scheduler moves them: the ownership record of each slot-owning pool (who
writes or reads a page now, and which life of the page it is) and verify
mode's checksums. At most one scheduler uses a group at a time (`attach`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvtier.errors import ConfigurationError
from kvtier.pools.allocator import SlotAllocator, check_capacity, positive_int
from kvtier.pools.device import DevicePool
from kvtier.pools.host import LAYOUTS, HostPool, HostPoolStatistics, Layout, LogicalHostPool
from kvtier.pools.ownership import HostPageOwnership

__all__ = ["PoolGroup", "PoolSpec", "SidecarSpec"]


@dataclass(frozen=True, slots=True)
class SidecarSpec:
    """How a sidecar derives its rows: ``k`` rows per page of ``source``."""

    source: str
    source_page_size: int
    rows_per_page: int


@dataclass(frozen=True, slots=True, eq=False)
class PoolSpec:
    """One registered pool.

    ``page_size`` and ``device_slots`` bound the indices an operation may name;
    for a sidecar they describe its rows (``page_size`` = ``rows_per_page``).
    """

    name: str
    kind: str  # "pool" | "logical" | "sidecar"
    host: HostPool | LogicalHostPool
    device: DevicePool | None
    page_size: int
    device_slots: int
    device_allocator: SlotAllocator | None
    sidecar: SidecarSpec | None = None

    @property
    def owns_slots(self) -> bool:
        return self.sidecar is None

    @property
    def slot_nbytes(self) -> int:
        return self.host.slot_nbytes


class PoolGroup:
    """The pools of one model, by name. Frozen once a scheduler uses it."""

    def __init__(self) -> None:
        self._pools: dict[str, PoolSpec] = {}
        self._num_layers = 0
        self._sidecars_of: dict[str, list[PoolSpec]] = {}
        self._frozen = False
        self._ownership: dict[str, HostPageOwnership] = {}
        self._user: object | None = None
        # Verify mode's record: checksum by pool (sidecars too) and page of
        # the slot-owning pool, written when bytes land in host pages.
        self.checksums: dict[str, dict[int, int]] = {}
        # The pages whose rows do not all hold data: by pool (sidecars too) and
        # page of the slot-owning pool, how many rows from the page's start do
        # (a pool's rows for that page: ``page_size``, or ``rows_per_page`` for
        # a sidecar). Written when a backup that names valid rows is taken or a
        # stored partial page lands; a page absent is whole. Copies, verify
        # mode and stored pages move and hash only those rows. Each page's
        # count goes when the page does.
        self.valid_rows: dict[str, dict[int, int]] = {}

    # -- registration -------------------------------------------------------

    def add_pool(
        self,
        name: str,
        *,
        device: DevicePool,
        page_size: int,
        host_slots: int,
        layout: Layout = "layer_first",
        pin_memory: bool | None = None,
    ) -> HostPool:
        """Register a pool with bytes and its own host allocator.

        ``host_slots`` is this pool's own host capacity (a whole number of pages).
        """
        self._check_new(name)
        check_capacity(name, host_slots, page_size)
        self._check_device(name, device, layout)
        if device.slots < page_size:
            raise ConfigurationError(
                f"pool {name!r} device has {device.slots} slots, fewer than one page of {page_size}"
            )
        if device.allocator is not None and device.allocator.page_size != page_size:
            raise ConfigurationError(
                f"pool {name!r} device allocator has page_size {device.allocator.page_size}; "
                f"the pool's page_size is {page_size}"
            )
        host = HostPool(
            name, planes=device.planes, num_layers=device.num_layers, slots=host_slots,
            page_size=page_size, layout=layout, pin_memory=pin_memory,
        )
        self._register(PoolSpec(name, "pool", host, device, page_size, device.slots, device.allocator))
        return host

    def add_logical_pool(
        self,
        name: str,
        *,
        page_size: int,
        host_slots: int,
        device_slots: int,
        device_allocator: SlotAllocator | None = None,
    ) -> LogicalHostPool:
        """Register an anchor that owns host slots but no bytes.

        ``device_slots`` bounds the device indices operations may name for it.
        """
        self._check_new(name)
        check_capacity(name, host_slots, page_size)
        positive_int(name, "device_slots", device_slots)
        if device_allocator is not None and device_allocator.page_size != page_size:
            raise ConfigurationError(
                f"pool {name!r} device allocator has page_size {device_allocator.page_size}; "
                f"the pool's page_size is {page_size}"
            )
        host = LogicalHostPool(name, page_size=page_size, slots=host_slots)
        self._register(PoolSpec(name, "logical", host, None, page_size, device_slots, device_allocator))
        return host

    def add_sidecar(
        self,
        name: str,
        *,
        source: str,
        rows_per_page: int,
        device: DevicePool,
        layout: Layout = "layer_first",
        pin_memory: bool | None = None,
    ) -> HostPool:
        """Register a sidecar whose rows derive from ``source``'s pages.

        Its host mirror holds ``rows_per_page`` rows for every host page of the
        source; its device tensors must hold as many rows for every whole device
        page of the source.
        """
        self._check_new(name)
        positive_int(name, "rows_per_page", rows_per_page)
        if source == name:
            raise ConfigurationError(f"sidecar {name!r} cannot take its indices from itself")
        src = self._pools.get(source)
        if src is None:
            raise ConfigurationError(
                f"sidecar {name!r} names source {source!r}, which is not registered; "
                f"register the source first (known: {sorted(self._pools)})"
            )
        if src.sidecar is not None:
            raise ConfigurationError(
                f"sidecar {name!r} cannot take its indices from sidecar {source!r}; "
                "a sidecar's source must own slots (a pool or a logical pool)"
            )
        self._check_device(name, device, layout)
        need_device = (src.device_slots // src.page_size) * rows_per_page
        if device.slots < need_device:
            raise ConfigurationError(
                f"sidecar {name!r} needs {need_device} device rows to cover source {source!r} "
                f"({src.device_slots // src.page_size} pages x {rows_per_page} rows); "
                f"got {device.slots}"
            )
        host_rows = (src.host.slots // src.page_size) * rows_per_page
        host = HostPool(
            name, planes=device.planes, num_layers=device.num_layers, slots=host_rows,
            page_size=None, layout=layout, pin_memory=pin_memory,
        )
        spec = SidecarSpec(source, src.page_size, rows_per_page)
        self._register(PoolSpec(name, "sidecar", host, device, rows_per_page, device.slots, None, spec))
        self._sidecars_of.setdefault(source, []).append(self._pools[name])
        return host

    def _check_new(self, name: str) -> None:
        if self._frozen:
            raise ConfigurationError(
                f"cannot add pool {name!r}: the group is in use by a scheduler; register every pool first"
            )
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"pool names are non-empty strings; got {name!r}")
        if name in self._pools:
            raise ConfigurationError(f"pool {name!r} is already registered")

    @staticmethod
    def _check_device(name: str, device: object, layout: str) -> None:
        if not isinstance(device, DevicePool):
            raise ConfigurationError(
                f"pool {name!r} device must be a DevicePool; got {type(device).__name__}"
            )
        if layout not in LAYOUTS:
            raise ConfigurationError(f"pool {name!r} layout must be one of {LAYOUTS}; got {layout!r}")

    def _register(self, spec: PoolSpec) -> None:
        self._pools[spec.name] = spec
        self._count_layers()

    def _count_layers(self) -> None:
        # Read on every batch: counted when the pools change, not per read.
        self._num_layers = max((len(p.device.layer_map) for p in self._pools.values() if p.device), default=0)

    def remove_pool(self, name: str) -> None:
        """Unregister pool ``name`` and release its host memory's pinned
        registration (the undo of an ``add_*`` call, e.g. when registering a
        stack fails half way). Its sidecars must be removed first.

        Raises `ConfigurationError` once a scheduler uses the group, for an
        unknown pool, or for a pool that still has sidecars.
        """
        if self._frozen:
            raise ConfigurationError(f"cannot remove pool {name!r}: the group is in use by a scheduler")
        spec = self._pools.get(name) if isinstance(name, str) else None
        if spec is None:
            raise ConfigurationError(f"pool {name!r} is not registered (known: {sorted(self._pools)})")
        sidecars = self._sidecars_of.get(name)
        if sidecars:
            raise ConfigurationError(
                f"pool {name!r} still has sidecars {sorted(s.name for s in sidecars)}; remove them first"
            )
        spec.host.close()
        del self._pools[name]
        self._count_layers()
        self._sidecars_of.pop(name, None)
        if spec.sidecar is not None:
            rest = [s for s in self._sidecars_of.get(spec.sidecar.source, []) if s.name != name]
            if rest:
                self._sidecars_of[spec.sidecar.source] = rest
            else:
                self._sidecars_of.pop(spec.sidecar.source, None)

    def freeze(self) -> None:
        """Refuse further registration (a scheduler relies on the pools)."""
        if not self._pools:
            raise ConfigurationError("a PoolGroup needs at least one pool before it is used")
        if not self._frozen:
            self._ownership = {
                spec.name: HostPageOwnership(
                    spec.host.allocator, checksums=self.checksums,
                    checksum_pools=(spec.name, *(side.name for side in self.sidecars_of(spec.name))),
                    valid_rows=self.valid_rows,
                )
                for spec in self._pools.values()
                if spec.owns_slots and spec.host.allocator is not None
            }
        self._frozen = True

    def ownership(self, name: str) -> HostPageOwnership:
        """The ownership record of slot-owning pool ``name`` (the group is frozen)."""
        return self._ownership[name]

    def attach(self, user: object) -> None:
        """Mark the group as used by ``user`` (a scheduler), freezing it.

        Raises `ConfigurationError` while another user is attached: two
        schedulers over one group would each hand out pages the other still
        reads or writes.
        """
        self.freeze()
        if self._user is not None and self._user is not user:
            raise ConfigurationError(
                f"this PoolGroup is in use by {self._user!r}; one scheduler uses a group at a time "
                "(leave its `async with` block first)"
            )
        self._user = user

    def detach(self, user: object) -> None:
        """Undo `attach` (a no-op for anyone but the attached user)."""
        if self._user is user:
            self._user = None

    # -- lookup -------------------------------------------------------------

    def __getitem__(self, name: str) -> PoolSpec:
        return self._pools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._pools

    def __iter__(self) -> Iterator[PoolSpec]:
        return iter(self._pools.values())

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._pools)

    def sidecars_of(self, name: str) -> tuple[PoolSpec, ...]:
        return tuple(self._sidecars_of.get(name, ()))

    @property
    def num_layers(self) -> int:
        """Number of transfer layers: the longest layer map of any pool."""
        return self._num_layers

    def close(self) -> None:
        """Release the host pools' pinned memory registrations."""
        for spec in self._pools.values():
            spec.host.close()

    def statistics(self) -> dict[str, HostPoolStatistics]:
        return {name: p.host.statistics() for name, p in self._pools.items()}

    def __repr__(self) -> str:
        kinds = ", ".join(f"{p.name}:{p.kind}" for p in self._pools.values())
        return f"<PoolGroup [{kinds}]>"
