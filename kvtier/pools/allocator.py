"""Page-granular slot allocation.

`PageAllocator` hands out whole pages of ``page_size`` consecutive slots and
takes them back. Both directions cost O(pages): the free pages live on a stack
and a byte per page records whether it is handed out, so a double free, a
foreign page or an out-of-range page is caught in O(1) per page and refused
before anything changes. A fresh allocator hands pages out in ascending order,
which keeps early allocations contiguous (cheap slice copies).

`SlotAllocator` is the seam for an engine's own device allocator.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from kvtier.errors import ConfigurationError, InvalidIndices
from kvtier.pools.indices import as_index_tensor, page_numbers, slots_of_pages

__all__ = ["AllocatorStatistics", "PageAllocator", "SlotAllocator"]


@runtime_checkable
class SlotAllocator(Protocol):
    """What kvtier needs from an allocator of device slots."""

    @property
    def page_size(self) -> int: ...

    @property
    def num_free_slots(self) -> int: ...

    def try_alloc(self, num_slots: int) -> torch.Tensor | None:
        """Whole pages worth ``num_slots`` slots, or None when short."""
        ...

    def free(self, indices: torch.Tensor) -> None:
        """Take back slots this allocator handed out."""
        ...


@dataclass(frozen=True, slots=True)
class AllocatorStatistics:
    page_size: int
    capacity_slots: int
    used_slots: int
    free_slots: int
    peak_used_slots: int
    allocations: int
    frees: int


def positive_int(name: str, what: str, value: object) -> int:
    """``value`` if it is a positive int, else `ConfigurationError`."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigurationError(f"pool {name!r} {what} must be a positive int; got {value!r}")
    return value


def check_capacity(name: str, capacity_slots: object, page_size: object) -> None:
    """Raise `ConfigurationError` unless both are positive ints and the capacity
    is a whole number of pages."""
    size = positive_int(name, "page_size", page_size)
    capacity = positive_int(name, "capacity", capacity_slots)
    if capacity % size:
        raise ConfigurationError(
            f"pool {name!r} capacity must be a whole number of pages of {size} slots; "
            f"got {capacity} slots"
        )


class PageAllocator:
    """Whole-page allocator over ``capacity_slots`` slots.

    Invariant: every page is either on ``_free`` exactly once (at index
    ``_where[page]``) and marked 0 in ``_taken``, or off it and marked 1. Pages
    are handed out by count (`try_alloc_pages`) or by name (`take_pages`, when
    the engine chooses them).
    """

    def __init__(self, capacity_slots: int, page_size: int, *, name: str = "") -> None:
        check_capacity(name, capacity_slots, page_size)
        self.name = name
        self._page_size = page_size
        self._num_pages = capacity_slots // page_size
        # A stack whose top is the lowest page: fresh pools allocate ascending runs.
        self._free: list[int] = list(range(self._num_pages - 1, -1, -1))
        self._taken = bytearray(self._num_pages)
        # The same bytes as numpy (read-only use: checks of many pages at once).
        self.taken_np: npt.NDArray[np.uint8] = np.frombuffer(self._taken, dtype=np.uint8)
        # Where each free page sits on ``_free``, so that `take_pages` removes
        # a named page in O(1) (swap with the top); stale for taken pages.
        self._where = array("q", range(self._num_pages - 1, -1, -1))
        self._peak_used_pages = 0
        self._allocations = 0
        self._frees = 0

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def capacity(self) -> int:
        """Capacity in slots."""
        return self._num_pages * self._page_size

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_free_slots(self) -> int:
        return len(self._free) * self._page_size

    @property
    def num_used_slots(self) -> int:
        return (self._num_pages - len(self._free)) * self._page_size

    def is_taken(self, page: int) -> bool:
        return 0 <= page < self._num_pages and self._taken[page] == 1

    def try_alloc_pages(self, num_pages: int) -> list[int] | None:
        """Take ``num_pages`` pages, or return None (changing nothing) when short.
        Raises `InvalidIndices` for a count that is not a positive int (a bool
        or a float included)."""
        if type(num_pages) is not int:
            self._check_count("page count", num_pages)
        if num_pages <= 0:
            raise InvalidIndices(
                f"pool {self.name!r} allocation needs at least one page; got {num_pages}",
                pool=self.name,
                rule="non-empty",
            )
        if num_pages > len(self._free):
            return None
        pages = self._free[-num_pages:]
        del self._free[-num_pages:]
        pages.reverse()
        taken = self._taken
        for p in pages:
            taken[p] = 1
        used = self._num_pages - len(self._free)
        if used > self._peak_used_pages:
            self._peak_used_pages = used
        self._allocations += 1
        return pages

    def free_pages(self, pages: Sequence[int]) -> None:
        """Give pages back. All or nothing: a page out of range, not handed out,
        or listed twice raises `InvalidIndices` and nothing is freed."""
        self._check_named(pages, taking=False)
        taken = self._taken
        free, where = self._free, self._where
        for p in reversed(pages):  # in reverse, so the lowest freed page is reused first
            taken[p] = 0
            where[p] = len(free)
            free.append(p)
        self._frees += 1

    def take_pages(self, pages: Sequence[int]) -> None:
        """Take the named free pages (the engine chose them). All or nothing:
        a page out of range, already taken, or listed twice raises
        `InvalidIndices` and nothing is taken. O(1) per page."""
        self.check_takeable(pages)
        taken = self._taken
        free, where = self._free, self._where
        for p in pages:
            i = where[p]
            last = free.pop()
            if last != p:
                free[i] = last
                where[last] = i
            taken[p] = 1
        used = self._num_pages - len(free)
        if used > self._peak_used_pages:
            self._peak_used_pages = used
        self._allocations += 1

    def check_takeable(self, pages: Sequence[int]) -> None:
        """Raise `InvalidIndices` unless `take_pages` would take every page."""
        self._check_named(pages, taking=True)

    def _check_named(self, pages: Sequence[int], *, taking: bool) -> None:
        """Pages named to take (each must be free) or to free (each must be
        taken): in range, in the right state, none twice."""
        taken = self._taken
        n = self._num_pages
        if type(pages) is not list and (isinstance(pages, (str, bytes, torch.Tensor)) or not isinstance(pages, Sequence)):
            raise InvalidIndices(
                f"pool {self.name!r} {'take' if taking else 'free'}s a sequence of page numbers (ints); "
                f"got {type(pages).__name__}",
                pool=self.name, rule="page-numbers",
            )
        for p in pages:
            if type(p) is not int and (isinstance(p, bool) or not isinstance(p, int)):
                raise InvalidIndices(
                    f"pool {self.name!r} page numbers are ints; got {p!r} ({type(p).__name__}) among {list(pages)[:8]!r}",
                    pool=self.name, rule="page-numbers",
                )
            if not 0 <= p < n:
                raise InvalidIndices(
                    f"pool {self.name!r} has {n} pages (0..{n - 1}); cannot {'take' if taking else 'free'} page {p}",
                    pool=self.name,
                    rule="in-range",
                )
            if taking and taken[p]:
                raise InvalidIndices(
                    f"pool {self.name!r} page {p} is taken; an operation writes named host pages only "
                    "when they are free (free_host them first; a page still read or written is free "
                    "once that operation ends)",
                    pool=self.name,
                    rule="host-pages-free",
                )
            if not taking and not taken[p]:
                raise InvalidIndices(
                    f"pool {self.name!r} page {p} is not allocated; a page is freed once, "
                    "after it was handed out",
                    pool=self.name,
                    rule="double-free",
                )
        if len(pages) > 1 and len(set(pages)) != len(pages):
            raise InvalidIndices(
                f"pool {self.name!r} {'names' if taking else 'free lists'} a page twice: {sorted(pages)[:16]}",
                pool=self.name,
                rule="unique-pages",
            )

    def try_alloc(self, num_slots: int) -> torch.Tensor | None:
        """Slots of whole pages worth ``num_slots``, or None when short."""
        if type(num_slots) is not int:
            self._check_count("slot count", num_slots)
        if num_slots % self._page_size:
            raise InvalidIndices(
                f"pool {self.name!r} allocates whole pages of {self._page_size} slots; "
                f"got a request for {num_slots} slots",
                pool=self.name,
                rule="whole-pages",
            )
        pages = self.try_alloc_pages(num_slots // self._page_size)
        return None if pages is None else slots_of_pages(pages, self._page_size)

    def free(self, indices: torch.Tensor) -> None:
        """Give back slots (whole pages); see `free_pages`."""
        idx = as_index_tensor(indices, pool=self.name, side="freed")
        self.free_pages(
            page_numbers(idx, page_size=self._page_size, limit=self.capacity, pool=self.name, side="freed")
        )

    def _check_count(self, what: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidIndices(
                f"pool {self.name!r} allocation needs an int {what}; got {value!r} ({type(value).__name__})",
                pool=self.name, rule="integer-count",
            )

    def statistics(self) -> AllocatorStatistics:
        used = self.num_used_slots
        return AllocatorStatistics(
            page_size=self._page_size,
            capacity_slots=self.capacity,
            used_slots=used,
            free_slots=self.capacity - used,
            peak_used_slots=self._peak_used_pages * self._page_size,
            allocations=self._allocations,
            frees=self._frees,
        )

    def __repr__(self) -> str:
        used = self._num_pages - len(self._free)
        return (
            f"<PageAllocator {self.name!r} [pages: {used} used, {len(self._free)} free | "
            f"page_size={self._page_size}]>"
        )
