"""Admission: what an operation takes, and the one undo.

Every operation kind comes through here after its parse step
(`kvtier.scheduler.parse.Parser`, which `Admission` is: its checks are
what admission's own callers name, e.g. `free_host`) and before it is carried:

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
* `record_valid` / `record_array_valid` record a backup's partial host pages
  (`PoolGroup.valid_rows`) once it has them.
* `release` gives back what a `Claim` holds, exactly once, for success,
  failure, cancellation and a submission that never reached its lane alike.

Only the event loop calls these; none of them blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TypeGuard

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
from kvtier.scheduler.claims import Claim
from kvtier.scheduler.parse import IndexLike, Parser

__all__ = ["Admission", "Claim", "IndexLike", "ReclaimHook", "Writer", "give_back_device", "take_device_now"]

log = get_logger("kvtier.scheduler")


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


class Admission(Parser):
    """Reservations, pins and their undo for one `PoolGroup`, after the
    request's parse step (the `Parser` of the same group)."""

    def __init__(self, group: PoolGroup, reclaim: ReclaimHook | None = None) -> None:
        group.freeze()
        super().__init__(group)
        self._reclaim = reclaim
        # Each slot-owning host pool's page ownership (`PoolGroup.ownership`):
        # a carrier records itself there as the writer of the pages it carries.
        self.owners: dict[str, HostPageOwnership] = {
            spec.name: group.ownership(spec.name)
            for spec in group
            if spec.owns_slots and spec.host.allocator is not None
        }
        self.rollbacks = 0

    def check_device_allocators(self, pools: Iterable[str]) -> None:
        """`InvalidIndices` unless every pool of ``pools`` has a device allocator."""
        for name in pools:
            _allocator(self.group[name])

    def record_valid(self, counts: Mapping[str, tuple[str, list[int]]], host: Mapping[str, list[int]]) -> None:
        """Record the partial pages of a backup's host pages (`PoolGroup.valid_rows`)."""
        valid_rows = self.group.valid_rows
        for name, (owner, per_page) in counts.items():
            size = self.group[name].page_size
            table = valid_rows.setdefault(name, {})
            for page, n in zip(host[owner], per_page):
                if n < size:
                    table[page] = n

    def record_array_valid(
        self, counts: Mapping[str, tuple[str, np.ndarray]], host: Mapping[str, list[int]],
        offsets: Mapping[str, list[int]],
    ) -> None:
        """Record the partial pages of a `backup_arrays`' host pages (`PoolGroup.valid_rows`)."""
        valid_rows = self.group.valid_rows
        for name, (owner, n) in counts.items():
            size = self.group[name].page_size
            off = np.array(offsets[owner], dtype=np.int64)
            per_request = np.diff(off)
            position = np.arange(int(off[-1]), dtype=np.int64) - np.repeat(off[:-1], per_request)
            valid = np.clip(np.repeat(n, per_request) - position * size, 0, size)
            partial = np.flatnonzero(valid < size)
            if partial.size:
                pages = host[owner]
                table = valid_rows.setdefault(name, {})
                for k, v in zip(partial.tolist(), valid[partial].tolist()):
                    table[pages[k]] = v

    # -- host slots -----------------------------------------------------------------

    def host_now(self, device: Mapping[str, list[int]]) -> dict[str, list[int]] | None:
        """`reserve_host`'s first try for a backup of one pool's ``device``
        pages, without a coroutine: as many free host pages, or None (nothing
        taken) when it names more pools or the pool is short; `reserve_host`
        then does the rest."""
        if len(device) == 1:
            for name, pages in device.items():
                got = self.owners[name].allocator.try_alloc_pages(len(pages))
                if got is not None:
                    return {name: got}
        return None

    async def reserve_host(self, wanted: Mapping[str, int]) -> dict[str, list[int]]:
        """``wanted[pool]`` free host pages of every pool, or none at all
        (reclaim hook once per short pool)."""
        if len(wanted) == 1:  # one pool: nothing to roll back, nothing to sort
            for name, npages in wanted.items():
                alloc = self.owners[name].allocator
                got = alloc.try_alloc_pages(npages)
                if got is not None:
                    return {name: got}
        taken: dict[str, list[int]] = {}
        try:
            for name, npages in sorted(wanted.items()):
                alloc = self.owners[name].allocator
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
                alloc = self.owners[name].allocator
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
        owners = self.owners
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
            self.owners[name].abandon(taken[name])
        if taken:
            self.rollbacks += 1
            log.info("allocation.rolled_back", tier="host", pools=list(taken))

    def shorten_writes(self, claim: Claim, pool: str, keep: int) -> None:
        """Only the first ``keep`` pages of ``pool`` will be written: give the others back now."""
        pages = claim.writes[pool]
        if keep < len(pages):
            self.owners[pool].end_write(pages[keep:], keep=False)
            claim.writes[pool] = pages[:keep]

    # -- readers ----------------------------------------------------------------

    def check_readable(self, pages: Mapping[str, list[int]]) -> None:
        for name, p in pages.items():
            self.owners[name].check_readable(p)

    def pin_now(self, pages: Mapping[str, list[int]]) -> bool:
        """`acquire_reads` without a coroutine when no page of these pools has
        a writer (nothing to wait for, so no life can change): check and pin,
        True. False, with nothing pinned, when some page has a writer:
        `acquire_reads` then waits. Raises as `acquire_reads` does for pages
        the caller does not hold."""
        self.check_readable(pages)
        owners = self.owners
        for name in pages:
            if owners[name].writing:
                return False
        for name, p in pages.items():
            owners[name].pin(p)
        return True

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
        owners = self.owners
        if not any(owners[name].writing for name in pages):  # nothing to wait for: no life can change
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
            owner = self.owners[name]
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
        owners = self.owners
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
            self.owners[name].check_free(p)
        for name, p in pages.items():
            self.owners[name].free(p)

    @property
    def deferred_frees(self) -> int:
        return sum(o.deferred_count for o in self.owners.values())


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

