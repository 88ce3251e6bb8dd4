"""Admission: what an operation may name, what it takes, and the one undo.

Every operation kind comes through here before it is queued:

* `Admission.pages` checks an index mapping (pools known, whole aligned
  unique pages in range) and returns *page numbers*, kvtier's own copy: the
  caller's tensors are never read again, so an engine may reuse its
  page-table buffer the moment a call returns. Sidecar entries (as a backup
  handle's ``host_indices`` lists them) are accepted when they equal what
  their source derives, and dropped.
* `reserve_host` / `reserve_device` take slots in every pool, sorted by name,
  all or nothing: a short pool awaits the reclaim hook once (the ``wait``
  form) and is retried, else every slot taken is given back and
  `PoolExhausted` raised. What an engine's own `SlotAllocator` returns is
  checked (`ConfigurationError` for a bad answer).
* `acquire_reads` makes an operation a reader of host pages: it waits for the
  pages' writers, **re-checks after every wait that each page is still the
  life it was at submission** (`HostPageOwnership` generations), then pins.
  A page freed meanwhile fails the operation with `InvalidIndices`; it never
  reads a new owner's bytes.
* `release` gives back what a `Claim` holds, exactly once, for success,
  failure, cancellation and a submission that never reached its lane alike.

Only the event loop calls these; none of them blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeGuard

import numpy as np
import torch

from kvtier.errors import ConfigurationError, InvalidIndices, PoolExhausted, TransferFailed
from kvtier.logs import get_logger
from kvtier.pools import (
    HostPageOwnership,
    PageAllocator,
    PageList,
    PoolGroup,
    PoolSpec,
    SlotAllocator,
    as_index_tensor,
    page_numbers,
)
from kvtier.scheduler.arrays import parse_pools

__all__ = ["Admission", "Claim", "ReclaimHook", "Writer", "give_back_device", "take_device_now"]

log = get_logger("kvtier.scheduler")

IndexLike = torch.Tensor | Sequence[int]


class ReclaimHook(Protocol):
    """The engine's eviction hook: try to free ``slots_needed`` slots of
    ``pool`` on ``tier`` ("host" or "device"). kvtier retries once after it."""

    async def __call__(self, pool: str, tier: str, slots_needed: int) -> None: ...


class Writer(Protocol):
    """An in-flight operation that writes host pages (a backup, a prefetch)."""

    id: int
    kind: str

    async def settled(self) -> None: ...

    def exception(self) -> BaseException | None: ...


class Claim:
    """What one operation holds until it ends.

    ``writes``: host pages it writes (a backup's, a prefetch's), by pool;
    ``reads``: host pages it reads, pinned (a load's, a storage write's);
    ``device``: device slots kvtier allocated for it (a load's), freed
    unless it succeeds. `Admission.release` gives all of it back, once.
    """

    __slots__ = ("writes", "reads", "device", "released")

    def __init__(
        self,
        *,
        writes: dict[str, list[int]] | None = None,
        reads: dict[str, list[int]] | None = None,
        device: dict[str, PageList] | None = None,
    ) -> None:
        self.writes = writes or {}
        self.reads = reads or {}
        self.device = device or {}
        self.released = False


class Admission:
    """Validation, reservations and their undo for one `PoolGroup`."""

    def __init__(self, group: PoolGroup, reclaim: ReclaimHook | None = None) -> None:
        group.freeze()
        self.group = group
        self._reclaim = reclaim
        # Per pool: its spec and the slot counts its indices must lie below,
        # read once (the group is frozen): an operation's check is dict lookups.
        self._specs: dict[str, PoolSpec] = {spec.name: spec for spec in group}
        self._limits: dict[str, dict[str, int]] = {
            "host": {spec.name: spec.host.slots for spec in group},
            "device": {spec.name: spec.device_slots for spec in group},
        }
        self._owners: dict[str, HostPageOwnership] = {
            spec.name: group.ownership(spec.name)
            for spec in group
            if spec.owns_slots and spec.host.allocator is not None
        }
        self.rollbacks = 0

    # -- validation ---------------------------------------------------------------

    def spec(self, name: object) -> PoolSpec:
        """The slot-owning pool ``name``; `InvalidIndices` for an unknown pool or a sidecar."""
        if not isinstance(name, str) or name not in self.group:
            raise InvalidIndices(
                f"unknown pool {name!r}; known pools: {sorted(self.group.names)}", rule="known-pool"
            )
        spec = self.group[name]
        if spec.sidecar is not None:
            raise InvalidIndices(
                f"pool {name!r} is a sidecar of {spec.sidecar.source!r}; its indices are derived, "
                f"name {spec.sidecar.source!r} instead",
                pool=name, rule="not-a-sidecar",
            )
        return spec

    def pages(
        self, indices: Mapping[str, IndexLike], *, side: str, allow_empty: bool = False
    ) -> dict[str, list[int]]:
        """Page numbers by slot-owning pool, checked (see the module doc).

        Raises `InvalidIndices` naming the pool, the value and the rule;
        nothing changes.
        """
        if type(indices) is not dict and not isinstance(indices, Mapping):
            raise InvalidIndices(
                f"{side} indices must be a mapping of pool name to indices; got {type(indices).__name__}",
                rule="mapping",
            )
        if not indices and not allow_empty:
            raise InvalidIndices(f"an operation names at least one pool; got no {side} indices", rule="non-empty")
        specs = self._specs
        limits = self._limits[side]
        out: dict[str, list[int]] = {}
        derived: list[tuple[str, list[int]]] | None = None
        for name, value in indices.items():
            spec = specs.get(name) if type(name) is str else None
            if spec is None:
                spec = self.spec(name)  # raises for an unknown pool
            if spec.sidecar is not None:
                if derived is None:
                    derived = []
                derived.append((name, self._pages_of(spec, value, side)))
                continue
            idx = as_index_tensor(value, pool=name, side=side)
            out[name] = page_numbers(idx, page_size=spec.page_size, limit=limits[name], pool=name, side=side)
        if derived:
            for name, rows in derived:
                self._check_derived(name, rows, out, side)
        return out

    def bulk_pages(
        self, requests: Sequence[Mapping[str, IndexLike]], *, side: str
    ) -> tuple[dict[str, list[int]], dict[str, list[int]]] | None:
        """The page numbers of many requests at once, or None when they are
        not all of the common shape; then check each with `pages`.

        The common shape: every request names the same slot-owning pools with
        one-dimensional int64 CPU tensors. Those are read with ``tolist``
        (no torch operator: a metadata read that keeps the GIL) and checked
        together in numpy: whole aligned pages in range, no page twice within
        a request (two requests may name the same page).
        Returns, per pool, the requests' pages one after the other and where
        each request's start (``offsets[pool][i]``, one more at the end).
        Whatever the vectorised check refuses is also left to `pages` (None),
        which raises the error of the first bad request.
        """
        if not requests:
            return {}, {}
        group = self.group
        first = requests[0]
        if not isinstance(first, dict) or not first:
            return None
        names = list(first)
        for name in names:
            spec = group[name] if isinstance(name, str) and name in group else None
            if spec is None or not spec.owns_slots:
                return None
        columns: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        tensor, int64 = torch.Tensor, torch.int64
        for request in requests:
            if type(request) is not dict or len(request) != len(names):
                return None
            for name, column in columns.items():
                value = request.get(name)
                if type(value) is not tensor or value.dtype is not int64 or not value.is_cpu:
                    return None
                column.append(value)
        pages: dict[str, list[int]] = {}
        offsets: dict[str, list[int]] = {}
        for name, column in columns.items():
            checked = _bulk_pages_of(group[name], column, side)
            if checked is None:
                return None
            pages[name], offsets[name] = checked
        return pages, offsets

    def check_device_allocators(self, pools: Iterable[str]) -> None:
        """`InvalidIndices` unless every pool of ``pools`` has a device allocator."""
        for name in pools:
            _allocator(self.group[name])

    def _pages_of(self, spec: PoolSpec, value: IndexLike, side: str) -> list[int]:
        idx = as_index_tensor(value, pool=spec.name, side=side)
        limit = spec.host.slots if side == "host" else spec.device_slots
        return page_numbers(idx, page_size=spec.page_size, limit=limit, pool=spec.name, side=side)

    def _check_derived(self, name: str, rows: list[int], owners: Mapping[str, list[int]], side: str) -> None:
        """A sidecar entry is accepted when it is exactly what its source derives."""
        sidecar = self.group[name].sidecar
        assert sidecar is not None
        source = owners.get(sidecar.source)
        if source is None:
            raise InvalidIndices(
                f"pool {name!r} is a sidecar of {sidecar.source!r}; its indices are derived, "
                f"name {sidecar.source!r} instead",
                pool=name, rule="not-a-sidecar",
            )
        # A sidecar's "pages" are runs of rows_per_page rows: one per source page.
        if rows != source:
            raise InvalidIndices(
                f"pool {name!r} is a sidecar of {sidecar.source!r}; its {side} indices must be the rows "
                f"derived from {sidecar.source!r}'s pages (as a handle gives them), or left out; got rows of "
                f"pages {rows[:8]} for {sidecar.source!r} pages {source[:8]}",
                pool=name, rule="derived-indices",
            )

    # -- host slots -----------------------------------------------------------------

    async def reserve_host(self, wanted: Mapping[str, int]) -> dict[str, list[int]]:
        """``wanted[pool]`` free host pages of every pool, or none at all
        (reclaim hook once per short pool)."""
        if len(wanted) == 1:  # one pool: nothing to roll back, nothing to sort
            for name, npages in wanted.items():
                alloc = self._owners[name].allocator
                got = alloc.try_alloc_pages(npages)
                if got is not None:
                    return {name: got}
        taken: dict[str, list[int]] = {}
        try:
            for name, npages in sorted(wanted.items()):
                alloc = self._owners[name].allocator
                got = alloc.try_alloc_pages(npages)
                if got is None and self._reclaim is not None:
                    await self._reclaim(name, "host", npages * alloc.page_size)
                    got = alloc.try_alloc_pages(npages)
                if got is None:
                    raise PoolExhausted(name, "host", npages * alloc.page_size, alloc.num_free_slots)
                taken[name] = got
        except BaseException:
            self._undo_host(taken)  # synchronous: no cancellation can interrupt it
            raise
        return taken

    def try_reserve_host(self, wanted: Mapping[str, int]) -> dict[str, list[int]]:
        """`reserve_host` without waiting: a short pool raises `PoolExhausted` now."""
        taken: dict[str, list[int]] = {}
        try:
            for name, npages in sorted(wanted.items()):
                alloc = self._owners[name].allocator
                got = alloc.try_alloc_pages(npages)
                if got is None:
                    raise PoolExhausted(name, "host", npages * alloc.page_size, alloc.num_free_slots)
                taken[name] = got
        except BaseException:
            self._undo_host(taken)
            raise
        return taken

    def take_host(self, named: Mapping[str, list[int]]) -> None:
        """Take the host pages the caller named (each free), in every pool or
        in none: `InvalidIndices` (rule ``host-pages-free``) changes nothing."""
        owners = self._owners
        for name, pages in named.items():
            owners[name].allocator.check_takeable(pages)
        for name, pages in named.items():
            owners[name].allocator.take_pages(pages)

    def abandon_host(self, taken: Mapping[str, list[int]]) -> None:
        """Give back host pages a bulk call reserved and no operation holds
        yet (the call was cancelled): a rollback."""
        self._undo_host({name: pages for name, pages in taken.items() if pages})

    def _undo_host(self, taken: Mapping[str, list[int]]) -> None:
        for name in reversed(list(taken)):
            self._owners[name].abandon(taken[name])
        if taken:
            self.rollbacks += 1
            log.info("allocation.rolled_back", tier="host", pools=list(taken))

    def start_write_pages(self, pages: Mapping[str, list[int]], writer: object) -> None:
        """Record ``writer`` as the writer of ``pages``."""
        for name, p in pages.items():
            self._owners[name].start_write(p, writer)

    def start_part_writes(self, pool: str, pages: list[int], offsets: list[int], writers: list[Any]) -> None:
        """Record ``writers[i]`` as the writer of ``pages[offsets[i]:offsets[i + 1]]`` (a bulk backup's requests)."""
        table = self._owners[pool].writers
        if offsets[-1] == len(writers) and len(offsets) == len(writers) + 1 and offsets[0] == 0 and all(
            b - a == 1 for a, b in zip(offsets, offsets[1:])
        ):  # a page per request: what a serving step's one-page backups are
            table.update(zip(pages, writers))
            return
        for i, writer in enumerate(writers):
            for p in pages[offsets[i]:offsets[i + 1]]:
                table[p] = writer

    def shorten_writes(self, claim: Claim, pool: str, keep: int) -> None:
        """Only the first ``keep`` pages of ``pool`` will be written: give the others back now."""
        pages = claim.writes[pool]
        if keep < len(pages):
            self._owners[pool].end_write(pages[keep:], keep=False)
            claim.writes[pool] = pages[:keep]

    # -- readers ----------------------------------------------------------------

    def check_readable(self, pages: Mapping[str, list[int]]) -> None:
        for name, p in pages.items():
            self._owners[name].check_readable(p)

    async def acquire_reads(self, pages: Mapping[str, list[int]], still_open: Callable[[], object]) -> None:
        """Wait for the writers of ``pages``, check they are still the pages
        that were named, and pin them (see the module doc). ``still_open`` is
        called after every wait that ended well, before the checks: it raises
        when the caller may not go on (the scheduler closed meanwhile).

        Raises `TransferFailed` when a writer did not complete, and
        `InvalidIndices` when a page is not held or was freed (a new life)
        while this waited; then nothing is pinned.
        """
        self.check_readable(pages)
        owners = self._owners
        if not any(owners[name].writers for name in pages):  # nothing to wait for: no life can change
            for name, p in pages.items():
                owners[name].pin(p)
            return
        lives = {name: owners[name].generations(p) for name, p in pages.items()}
        while True:
            writers: set[object] = set()
            for name, p in pages.items():
                writers |= owners[name].writers_of(p)
            if not writers:
                break
            for w in writers:
                writer: Writer = w  # type: ignore[assignment]
                await writer.settled()
                error = writer.exception()
                if error is not None:
                    raise TransferFailed(
                        f"the operation reads host pages that {writer.kind} {writer.id} was writing, and that "
                        f"{writer.kind} did not complete ({type(error).__name__})"
                    ) from error
                still_open()
                self._check_lives(pages, lives)
        self._check_lives(pages, lives)
        self.check_readable(pages)
        for name, p in pages.items():
            owners[name].pin(p)

    def _check_lives(self, pages: Mapping[str, list[int]], lives: Mapping[str, list[int]]) -> None:
        for name, p in pages.items():
            owner = self._owners[name]
            if not owner.same_life(p, lives[name]):
                now = owner.generations(p)
                changed = [page for page, a, b in zip(p, lives[name], now) if a != b]
                raise InvalidIndices(
                    f"pool {name!r} host pages {changed[:16]} were freed while the operation waited for "
                    "their writer (a page freed and reused is a new life); it reads nothing from them",
                    pool=name, rule="page-generation",
                )

    # -- device slots ---------------------------------------------------------------

    async def reserve_device(self, wanted: Mapping[str, int]) -> dict[str, PageList]:
        """``wanted[pool]`` device slots from each pool's allocator, sorted by
        name, all or nothing (reclaim hook once per short pool)."""
        taken: dict[str, PageList] = {}
        try:
            for name, slots in sorted(wanted.items()):
                spec = self.group[name]
                got = _try_device(spec, slots)
                if got is None and self._reclaim is not None:
                    await self._reclaim(name, "device", slots)
                    got = _try_device(spec, slots)
                if got is None:
                    raise _device_exhausted(spec, slots)
                taken[name] = got
        except BaseException:
            give_back_device(self.group, taken)
            if taken:
                self.rollbacks += 1
                log.info("allocation.rolled_back", tier="device", pools=list(taken))
            raise
        return taken

    # -- the end ----------------------------------------------------------------------

    def release(self, claim: Claim, *, succeeded: bool, kept: Mapping[str, int] | None = None) -> None:
        """Give back what ``claim`` holds: the one undo, called once per claim.

        Written pages are the caller's when the operation succeeded (the first
        ``kept[pool]`` of each pool when ``kept`` is given, every page
        otherwise); the rest go back to their pools. Read pages are unpinned.
        Device slots kvtier allocated stay with the caller only on success.
        """
        if claim.released:
            return
        claim.released = True
        owners = self._owners
        for name, pages in claim.writes.items():
            n = (len(pages) if kept is None else min(kept.get(name, 0), len(pages))) if succeeded else 0
            if n:
                owners[name].end_write(pages[:n], keep=True)
            if n < len(pages):
                owners[name].end_write(pages[n:], keep=False)
        for name, pages in claim.reads.items():
            owners[name].unpin(pages)
        if not succeeded:
            give_back_device(self.group, claim.device)

    def free_host(self, indices: Mapping[str, IndexLike]) -> None:
        """The caller gives host pages back; all or nothing (see `TransferScheduler.free_host`)."""
        self.free_pages(self.pages(indices, side="host", allow_empty=True))

    def free_pages(self, pages: Mapping[str, list[int]]) -> None:
        """`free_host` of page numbers by slot-owning pool (a handle's own); all or nothing."""
        for name, p in pages.items():
            self._owners[name].check_free(p)
        for name, p in pages.items():
            self._owners[name].free(p)

    @property
    def deferred_frees(self) -> int:
        return sum(len(o.deferred) for o in self._owners.values())


def _bulk_pages_of(
    spec: PoolSpec, values: list[torch.Tensor], side: str
) -> tuple[list[int], list[int]] | None:
    """`Admission.bulk_pages` for one pool: the pages of every request and
    their offsets, or None when any request breaks a rule. The requests' CPU
    tensors are read with ``tolist`` (a metadata read: no torch operator, so
    the GIL is kept, where a ``torch.cat`` and its numpy view were two
    operators per pool and 128 requests) and checked as the array-native bulk
    call checks its arrays (`kvtier.scheduler.arrays.parse_pools`), in numpy.
    Whatever is not one-dimensional (a nested list, a scalar), a sparse or
    nested tensor included, is left to `Admission.pages` (None)."""
    try:
        lists = [v.tolist() for v in values]
        lengths = [len(slots) for slots in lists]  # a 0-d tensor's int has none
        flat = np.array(list(itertools.chain.from_iterable(lists)), dtype=np.int64)
    except (RuntimeError, TypeError, ValueError):  # no storage (sparse, nested), ragged or scalar
        return None
    if min(lengths) == 0 or flat.ndim != 1 or flat.size != sum(lengths):
        return None
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    name = spec.name
    limit = spec.host.slots if side == "host" else spec.device_slots
    try:
        parsed, _ = parse_pools({name: flat}, {name: offsets}, page_sizes={name: spec.page_size},
                                limits={name: limit}, check_one=_refuse)
    except InvalidIndices:
        return None
    pages, page_offsets = parsed[name]
    return pages.tolist(), page_offsets.tolist()


def _refuse(index: int, pool: str, slots: object) -> None:
    """The vectorised check found a bad request: `Admission.pages` names it."""
    raise InvalidIndices(f"request {index} of pool {pool!r} breaks a rule", pool=pool)


# -- device allocation, shared with the model bridges ------------------------------------


def take_device_now(group: PoolGroup, wanted: Mapping[str, int]) -> dict[str, PageList]:
    """Device slots from each pool's allocator now, sorted by name, all or
    nothing: `PoolExhausted` (nothing kept) when one is short,
    `InvalidIndices` for a pool without an allocator, `ConfigurationError`
    when an allocator's answer breaks its contract."""
    taken: dict[str, PageList] = {}
    try:
        for name, slots in sorted(wanted.items()):
            spec = group[name]
            got = _try_device(spec, slots)
            if got is None:
                raise _device_exhausted(spec, slots)
            taken[name] = got
    except BaseException:
        give_back_device(group, taken)
        if taken:
            log.info("allocation.rolled_back", tier="device", pools=list(taken))
        raise
    return taken


def give_back_device(group: PoolGroup, taken: Mapping[str, PageList]) -> None:
    """Free device slots kvtier took, in reverse order (a failed load's
    slots, too: not a rollback, so nothing is logged here)."""
    for name in reversed(list(taken)):
        spec = group[name]
        alloc = spec.device_allocator
        assert alloc is not None
        if _own_pages(alloc, spec):
            alloc.free_pages(taken[name].pages)
        else:
            alloc.free(taken[name].slots())


def _allocator(spec: PoolSpec) -> SlotAllocator:
    alloc = spec.device_allocator
    if alloc is None:
        raise InvalidIndices(
            f"pool {spec.name!r} has no device allocator; pass its device_indices",
            pool=spec.name, rule="device-indices-needed",
        )
    return alloc


def _own_pages(alloc: SlotAllocator, spec: PoolSpec) -> TypeGuard[PageAllocator]:
    """True when ``alloc`` is kvtier's `PageAllocator` over pages of the pool's
    own size, within its device slots: its page numbers are the pool's."""
    return type(alloc) is PageAllocator and alloc.page_size == spec.page_size and alloc.capacity <= spec.device_slots


def _device_exhausted(spec: PoolSpec, slots: int) -> PoolExhausted:
    return PoolExhausted(spec.name, "device", slots, _allocator(spec).num_free_slots)


def _try_device(spec: PoolSpec, slots: int) -> PageList | None:
    """``slots`` device slots of ``spec`` from its allocator as page numbers,
    or None when it is short. The allocator's answer is checked: exactly
    ``slots`` slots, an integer CPU tensor of whole aligned unique pages in the
    pool's range; anything else raises `ConfigurationError` naming the pool,
    the value and the rule (the answer itself is not freed: an allocator that
    broke its contract cannot be trusted to take it back). kvtier's own
    `PageAllocator` of the pool's pages is asked for page numbers instead: no
    tensor is made, so no torch operator runs on the loop."""
    alloc = _allocator(spec)
    if _own_pages(alloc, spec) and slots % spec.page_size == 0:
        pages = alloc.try_alloc_pages(slots // spec.page_size)
        return None if pages is None else PageList(pages, spec.page_size)
    got = alloc.try_alloc(slots)
    if got is None:
        return None
    name = spec.name
    if not isinstance(got, torch.Tensor):
        raise ConfigurationError(
            f"pool {name!r} device allocator returned a {type(got).__name__} for {slots} slots; "
            "try_alloc returns an integer tensor of exactly that many slots, or None"
        )
    if got.dim() != 1 or got.numel() != slots:
        raise ConfigurationError(
            f"pool {name!r} device allocator returned {got.numel()} slots (shape {tuple(got.shape)}) "
            f"for a request of {slots}; try_alloc returns exactly the slots asked for"
        )
    try:
        idx = as_index_tensor(got, pool=name, side="allocated device")
        pages = page_numbers(idx, page_size=spec.page_size, limit=spec.device_slots, pool=name, side="allocated device")
    except InvalidIndices as exc:
        raise ConfigurationError(f"pool {name!r} device allocator broke its contract: {exc}") from exc
    return PageList(pages, spec.page_size)

