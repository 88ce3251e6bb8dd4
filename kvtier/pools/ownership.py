"""Who owns each host page while operations are in flight, and which life of
the page it is.

Every page of a slot-owning host pool is at every moment in exactly one of:
free (in the allocator), written by one in-flight operation (a backup or a
prefetch), or held by the caller (possibly read by in-flight loads and
storage writes). A page the caller frees while an operation still reads or
writes it is not reused: the free is *deferred* until that operation ends. An
operation that wrote a page and did not succeed gives the page back itself, and
any deferred free of it is dropped, so a page is freed exactly once.

A page number is not an identity: a page freed and handed out again is a new
*life* of the same number. ``generation(p)`` changes every time page ``p``
goes back to the allocator, so a reader that waited (for the page's writer)
can tell whether it still names the life it was submitted for
(`same_life`). Every free goes through this record, so no free can miss the
generation.

The record belongs to the `PoolGroup` (one per slot-owning pool), not to a
scheduler: it outlives any one scheduler. Only the event loop touches it;
worker threads never free.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvtier.errors import InvalidIndices
from kvtier.pools.allocator import PageAllocator

__all__ = ["HostPageOwnership"]


class HostPageOwnership:
    """The ownership record of one slot-owning host pool (see the module doc)."""

    __slots__ = (
        "allocator", "name", "writers", "readers", "deferred", "_generation", "_checksums", "_checksum_pools",
        "_valid_rows",
    )

    def __init__(
        self,
        allocator: PageAllocator,
        *,
        checksums: dict[str, dict[int, int]] | None = None,
        checksum_pools: tuple[str, ...] = (),
        valid_rows: dict[str, dict[int, int]] | None = None,
    ) -> None:
        self.allocator = allocator
        self.name = allocator.name
        # page -> the in-flight operation writing it (an opaque token).
        self.writers: dict[int, object] = {}
        # page -> number of in-flight operations reading it.
        self.readers: dict[int, int] = {}
        # pages the caller freed while they were busy.
        self.deferred: set[int] = set()
        # page -> how many times it went back to the allocator.
        self._generation = array("Q", bytes(8 * allocator.num_pages))
        # Verify mode's checksums (by pool and page of this pool) belong to one
        # life of a page: they go when the page does.
        self._checksums = checksums
        self._checksum_pools = checksum_pools
        # The valid row counts of partial pages (`PoolGroup.valid_rows`), of the same pools: one life too.
        self._valid_rows = valid_rows

    # -- lives ----------------------------------------------------------------

    def generations(self, pages: Sequence[int]) -> list[int]:
        g = self._generation
        return [g[p] for p in pages]

    def same_life(self, pages: Sequence[int], generations: Sequence[int]) -> bool:
        """True when no page of ``pages`` was freed since ``generations`` was read."""
        g = self._generation
        return all(g[p] == n for p, n in zip(pages, generations))

    def _release(self, pages: list[int]) -> None:
        """Give pages back to the allocator: the one place a page's life ends."""
        self.allocator.free_pages(pages)
        g = self._generation
        for p in pages:
            g[p] += 1
        for record in (self._checksums, self._valid_rows):
            if record:
                for pool in self._checksum_pools:
                    table = record.get(pool)
                    if table:
                        for p in pages:
                            table.pop(p, None)

    # -- writers (backups, prefetches) ------------------------------------------

    def start_write(self, pages: Sequence[int], writer: object) -> None:
        for p in pages:
            self.writers[p] = writer

    def end_write(self, pages: Sequence[int], *, keep: bool) -> None:
        """The operation writing ``pages`` ended. ``keep``: it succeeded and the
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
            self._release(free_now)

    def writers_of(self, pages: Sequence[int]) -> set[object]:
        w = self.writers
        if not w:
            return set()
        return {w[p] for p in pages if p in w}

    # -- readers (loads, storage writes) ----------------------------------------

    def check_readable(self, pages: Sequence[int]) -> None:
        """Raise `InvalidIndices` unless the caller holds every page."""
        taken = self.allocator.is_taken
        for p in pages:
            if not taken(p):
                raise InvalidIndices(
                    f"pool {self.name!r} host page {p} is not allocated; an operation reads pages "
                    "that a backup or prefetch filled and that were not freed",
                    pool=self.name,
                    rule="host-pages-held",
                )
            if p in self.deferred:
                raise InvalidIndices(
                    f"pool {self.name!r} host page {p} was freed with free_host; an operation reads "
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
            self._release(free_now)

    # -- the caller ---------------------------------------------------------------

    def check_free(self, pages: Sequence[int]) -> None:
        """Raise `InvalidIndices` unless the caller may free every page now."""
        taken = self.allocator.is_taken
        for p in pages:
            if not taken(p) or p in self.deferred:
                raise InvalidIndices(
                    f"pool {self.name!r} host page {p} is not held; a page is freed once, "
                    "after a backup or prefetch handed it out",
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
            self._release(now)
        return deferred

    def abandon(self, pages: Sequence[int]) -> None:
        """Give back pages just taken from the allocator that no operation
        used yet (an allocation rolled back)."""
        self._release(list(pages))

