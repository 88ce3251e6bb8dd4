"""Who owns each host page while operations are in flight.

Every page of a slot-owning host pool is at every moment in exactly one of:
free (in the allocator), written by one in-flight backup, or held by the caller
(possibly read by in-flight loads). A page the caller frees while an operation
still reads or writes it is not reused: the free is *deferred* until that
operation ends. A backup that fails gives its pages back itself, and any
deferred free of them is dropped, so a page is freed exactly once.
Only the event loop touches this state; worker threads never free.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.errors import InvalidIndices
from kvtier.pools import PageAllocator

__all__ = ["HostPageOwnership"]


class HostPageOwnership:
    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.name = allocator.name
        # page -> the in-flight backup writing it (an opaque token).
        self.writers: dict[int, object] = {}
        # page -> number of in-flight loads reading it.
        self.readers: dict[int, int] = {}
        # pages the caller freed while they were busy.
        self.deferred: set[int] = set()

    # -- backups ------------------------------------------------------------

    def start_write(self, pages: Sequence[int], writer: object) -> None:
        for p in pages:
            self.writers[p] = writer

    def end_write(self, pages: Sequence[int], *, keep: bool) -> None:
        """The backup writing ``pages`` ended. ``keep``: it succeeded and the
        caller owns the pages (unless the caller freed them meanwhile)."""
        free_now = []
        for p in pages:
            del self.writers[p]
            if not keep:
                self.deferred.discard(p)
                free_now.append(p)
            elif p in self.deferred and p not in self.readers:
                self.deferred.discard(p)
                free_now.append(p)
        if free_now:
            self.allocator.free_pages(free_now)

    def writers_of(self, pages: Sequence[int]) -> set[object]:
        w = self.writers
        if not w:
            return set()
        return {w[p] for p in pages if p in w}

    # -- loads --------------------------------------------------------------

    def check_readable(self, pages: Sequence[int]) -> None:
        """Raise `InvalidIndices` unless the caller holds every page."""
        taken = self.allocator.is_taken
        for p in pages:
            if not taken(p):
                raise InvalidIndices(
                    f"pool {self.name!r} host page {p} is not allocated; a load reads pages "
                    "that a backup filled and that were not freed",
                    pool=self.name,
                    rule="host-pages-held",
                )
            if p in self.deferred:
                raise InvalidIndices(
                    f"pool {self.name!r} host page {p} was freed with free_host; a load reads "
                    "pages that were not freed",
                    pool=self.name,
                    rule="host-pages-held",
                )

    def pin(self, pages: Sequence[int]) -> None:
        r = self.readers
        for p in pages:
            r[p] = r.get(p, 0) + 1

    def unpin(self, pages: Sequence[int]) -> None:
        r = self.readers
        free_now = []
        for p in pages:
            left = r[p] - 1
            if left:
                r[p] = left
                continue
            del r[p]
            if p in self.deferred and p not in self.writers:
                self.deferred.discard(p)
                free_now.append(p)
        if free_now:
            self.allocator.free_pages(free_now)

    # -- the caller's free --------------------------------------------------

    def check_free(self, pages: Sequence[int]) -> None:
        """Raise `InvalidIndices` unless the caller may free every page now."""
        taken = self.allocator.is_taken
        for p in pages:
            if not taken(p) or p in self.deferred:
                raise InvalidIndices(
                    f"pool {self.name!r} host page {p} is not held; a page is freed once, "
                    "after a backup handed it out",
                    pool=self.name,
                    rule="double-free",
                )

    def free(self, pages: Sequence[int]) -> int:
        """Free pages (checked with `check_free`); busy ones later. Returns how
        many pages were deferred."""
        now = []
        deferred = 0
        for p in pages:
            if p in self.writers or p in self.readers:
                self.deferred.add(p)
                deferred += 1
            else:
                now.append(p)
        if now:
            self.allocator.free_pages(now)
        return deferred

    @property
    def busy_pages(self) -> int:
        return len(self.writers) + len(self.readers)
