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

The per-page state is typed arrays indexed by page, not Python containers:
the writer (a token: the writer's ``id``, 0 for none), the number of readers,
the deferred-free flag and the generation. They are single objects the garbage
collector never walks (an ``array`` or ``bytearray`` holds no references), so a
pool of a million pages costs a collection nothing, however many operations
are in flight; only the in-flight writers themselves are kept by token. Calls
take page lists or index arrays; a long one runs in numpy on views of the same
memory, a short one in plain Python.

The record belongs to the `PoolGroup` (one per slot-owning pool), not to a
scheduler: it outlives any one scheduler. Only the event loop touches it;
worker threads never free.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvtier.errors import InvalidIndices
from kvtier.pools.allocator import PageAllocator

__all__ = ["HostPageOwnership"]

# From this many pages a call works on numpy views of the arrays; below it,
# element by element (a numpy call costs about a microsecond to start).
BULK = 48

Pages = Sequence[int] | npt.NDArray[np.integer[Any]]


def _index(pages: Pages) -> npt.NDArray[np.intp]:
    return np.asarray(pages, dtype=np.intp)


def _distinct(idx: npt.NDArray[np.intp]) -> int:
    """How many distinct pages ``idx`` names, in a Python set: numpy's unique
    sorts with the GIL let go, a switch interval beside a busy thread."""
    return len(set(idx.tolist()))


def _list(pages: Pages) -> list[int]:
    return pages.tolist() if isinstance(pages, np.ndarray) else list(pages)


def _short(pages: Pages) -> Sequence[int]:
    """``pages`` to walk element by element: Python ints (numpy's are not ints to the allocator)."""
    return pages.tolist() if isinstance(pages, np.ndarray) else pages


class PartedWriter(Protocol):
    """A writer of many requests' pages (`HostPageOwnership.start_parts`)."""

    def writer_of(self, index: int) -> object:
        """The writer of request ``index``'s pages, as a reader waits on it."""
        ...


class HostPageOwnership:
    """The ownership record of one slot-owning host pool (see the module doc)."""

    __slots__ = (
        "allocator", "name", "_writer", "_writer_np", "_tokens", "_token_pages", "_part", "_parted", "_readers",
        "_readers_np", "_reading", "_deferred", "_deferred_np", "_deferred_count", "_generation",
        "_generation_np", "_checksums", "_checksum_pools", "_valid_rows",
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
        n = allocator.num_pages
        # page -> the token of the in-flight operation writing it (0: none).
        self._writer = array("q", bytes(8 * n))
        # token -> the writer (an opaque object), and how many pages it still
        # writes when more than one (absent: one); a token is in ``_tokens``
        # exactly while a page has it.
        self._tokens: dict[int, object] = {}
        self._token_pages: dict[int, int] = {}
        # A writer of many requests' pages (a carrier: `start_parts`) names the
        # request writing each page: page -> that request's index; the writer
        # is asked for the request's own writer only when a reader waits.
        self._part = array("q", bytes(8 * n))
        self._parted: set[int] = set()  # the tokens of such writers
        # page -> number of in-flight operations reading it.
        self._readers = array("q", bytes(8 * n))
        self._reading = 0  # pages with a reader
        # 1 for a page the caller freed while it was busy.
        self._deferred = bytearray(n)
        self._deferred_count = 0
        # page -> how many times it went back to the allocator.
        self._generation = array("Q", bytes(8 * n))
        # numpy views of the same memory, for the long calls.
        self._writer_np = np.frombuffer(self._writer, dtype=np.int64)
        self._readers_np = np.frombuffer(self._readers, dtype=np.int64)
        self._deferred_np = np.frombuffer(self._deferred, dtype=np.uint8)
        self._generation_np = np.frombuffer(self._generation, dtype=np.uint64)
        # Verify mode's checksums (by pool and page of this pool) belong to one
        # life of a page: they go when the page does.
        self._checksums = checksums
        self._checksum_pools = checksum_pools
        # The valid row counts of partial pages (`PoolGroup.valid_rows`), of the same pools: one life too.
        self._valid_rows = valid_rows

    # -- what is in flight (for tests and statistics: snapshots) -------------------

    @property
    def writers(self) -> dict[int, object]:
        """page -> the operation writing it, a snapshot."""
        pages = np.flatnonzero(self._writer_np).tolist()
        return {p: self._writer_at(p) for p in pages}

    def _writer_at(self, page: int) -> object:
        token = self._writer[page]
        writer = self._tokens[token]
        if token in self._parted:
            parted: PartedWriter = writer  # type: ignore[assignment]
            return parted.writer_of(self._part[page])
        return writer

    @property
    def readers(self) -> dict[int, int]:
        """page -> how many operations read it, a snapshot."""
        pages = np.flatnonzero(self._readers_np).tolist()
        r = self._readers
        return {p: r[p] for p in pages}

    @property
    def deferred(self) -> set[int]:
        """The pages whose free waits for an operation, a snapshot."""
        return set(np.flatnonzero(self._deferred_np).tolist())

    @property
    def writing(self) -> bool:
        """Whether any page has a writer."""
        return len(self._tokens) != 0

    @property
    def deferred_count(self) -> int:
        return self._deferred_count

    # -- lives ----------------------------------------------------------------

    def generations(self, pages: Pages) -> list[int]:
        if len(pages) >= BULK:
            return self._generation_np[_index(pages)].tolist()  # type: ignore[no-any-return]
        if type(pages) is not list:
            pages = _short(pages)
        g = self._generation
        return [g[p] for p in pages]

    def same_life(self, pages: Pages, generations: Sequence[int]) -> bool:
        """True when no page of ``pages`` was freed since ``generations`` was read."""
        if len(pages) >= BULK:
            now = self._generation_np[_index(pages)]
            return bool(np.array_equal(now, np.asarray(generations, dtype=np.uint64)))
        if type(pages) is not list:
            pages = _short(pages)
        g = self._generation
        return all(g[p] == n for p, n in zip(pages, generations))

    def _release(self, pages: list[int]) -> None:
        """Give pages back to the allocator: the one place a page's life ends."""
        self.allocator.free_pages(pages)
        if len(pages) >= BULK:
            self._generation_np[_index(pages)] += np.uint64(1)
        else:
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

    def start_write(self, pages: Pages, writer: object) -> None:
        """Record ``writer`` as the writer of ``pages`` (none has a writer)."""
        n = len(pages)
        token = id(writer)
        if n == 1:  # the common case, kept short
            self._writer[pages[0]] = token
            if token in self._tokens:
                self._started(token, 1)
            else:
                self._tokens[token] = writer
            return
        if not n:
            return
        if n >= BULK:
            self._writer_np[_index(pages)] = token
        else:
            w = self._writer
            for p in pages:
                w[p] = token
        if token in self._tokens:
            self._started(token, n)
        else:
            self._tokens[token] = writer
            self._token_pages[token] = n

    def _started(self, token: int, pages: int) -> None:
        """``token``, already writing, writes ``pages`` more pages."""
        tp = self._token_pages
        tp[token] = tp.get(token, 1) + pages  # absent: one page

    def _ended(self, token: int, pages: int) -> None:
        """``token`` ended ``pages`` of its pages; gone with its last."""
        tp = self._token_pages
        left = tp.pop(token, 1) - pages  # absent: one page
        if left > 1:
            tp[token] = left
        elif not left:
            del self._tokens[token]
            if self._parted:
                self._parted.discard(token)

    def start_writes(self, pages: Pages, offsets: Sequence[int], writers: Sequence[object]) -> None:
        """Record ``writers[i]`` as the writer of ``pages[offsets[i]:offsets[i + 1]]`` (a bulk backup's requests)."""
        n = len(writers)
        if n == 1:  # a lone request: none of the checks below
            self.start_write(pages[offsets[0]:offsets[1]], writers[0])
            return
        tokens = [id(x) for x in writers]
        if len(offsets) == n + 1 and offsets[0] == 0 and offsets[-1] == n == len(pages) and all(
            b - a == 1 for a, b in zip(offsets, offsets[1:])
        ) and self._tokens.keys().isdisjoint(tokens) and len(set(tokens)) == n:
            # a page per request, each request its own writer: what a serving step's one-page backups are
            self._tokens.update(zip(tokens, writers))
            if n >= BULK:
                self._writer_np[_index(pages)] = tokens
            else:
                w = self._writer
                for p, t in zip(pages, tokens):
                    w[p] = t
            return
        for i, writer in enumerate(writers):
            self.start_write(pages[offsets[i]:offsets[i + 1]], writer)

    def start_parts(self, pages: Pages, offsets: Sequence[int], writer: PartedWriter) -> None:
        """Record request ``i`` of ``writer`` as the writer of
        ``pages[offsets[i]:offsets[i + 1]]``: one token for all of them (no
        object per request); `writers_of` asks ``writer.writer_of(i)``."""
        n = len(pages)
        if not n:
            return
        self.start_write(pages, writer)
        self._parted.add(id(writer))
        part = self._part
        if n >= BULK:
            counts = [b - a for a, b in zip(offsets, offsets[1:])]
            np.frombuffer(part, dtype=np.int64)[_index(pages)] = np.repeat(np.arange(len(counts)), counts)
            return
        for i in range(len(offsets) - 1):
            for p in pages[offsets[i]:offsets[i + 1]]:
                part[p] = i

    def end_write(self, pages: Pages, *, keep: bool) -> None:
        """The operation writing ``pages`` ended. ``keep``: it succeeded and the
        caller owns the pages (unless the caller freed them meanwhile)."""
        n = len(pages)
        if n == 1 and keep:  # the common case, kept short
            p = pages[0]
            w = self._writer
            t = w[p]
            if t and not self._deferred[p]:
                w[p] = 0
                if t in self._token_pages:
                    self._ended(t, 1)
                else:
                    del self._tokens[t]
                    if self._parted:
                        self._parted.discard(t)
                return
        if not n:
            return
        if n >= BULK:
            self._end_write_bulk(_index(pages), keep)
            return
        if type(pages) is not list:
            pages = _short(pages)
        w, d = self._writer, self._deferred
        free_now = []
        token = -1  # the writer of the pages just ended (none yet), and how many
        ended = 0
        for p in pages:
            t = w[p]
            if t != token:
                if not t:
                    raise KeyError(p)  # the page has no writer: a bug in the caller
                if ended:
                    self._ended(token, ended)
                token, ended = t, 0
            w[p] = 0
            ended += 1
            if d[p]:  # the caller freed it meanwhile: it goes now unless a reader holds it
                if not keep or not self._readers[p]:
                    d[p] = 0
                    self._deferred_count -= 1
                    free_now.append(p)
            elif not keep:
                free_now.append(p)
        self._ended(token, ended)
        if free_now:
            self._release(free_now)

    def _end_write_bulk(self, idx: npt.NDArray[np.intp], keep: bool) -> None:
        tokens = self._writer_np[idx]
        if not tokens.all():
            raise KeyError(int(idx[tokens == 0][0]))  # a page has no writer: a bug in the caller
        self._writer_np[idx] = 0
        if not self._token_pages:  # every writer writes one page: each token ends here
            t = self._tokens
            for token in tokens.tolist():
                del t[token]
            if self._parted:
                self._parted.difference_update(tokens.tolist())
        else:
            for token, c in Counter(tokens.tolist()).items():
                self._ended(token, c)
        deferred = self._deferred_np[idx].astype(bool)
        if keep:  # a deferred free happens now, unless a reader still holds the page
            go = idx[deferred & (self._readers_np[idx] == 0)]
            clear = go
        else:  # every page goes back, and no deferred free of it is left
            go = idx
            clear = idx[deferred]
        if len(clear):
            self._deferred_np[clear] = 0
            self._deferred_count -= len(clear)
        if len(go):
            self._release(go.tolist())

    def writers_of(self, pages: Pages) -> set[object]:
        if not self._tokens:
            return set()
        if len(pages) >= BULK:
            found = set(self._writer_np[_index(pages)].tolist())
        else:
            if type(pages) is not list:
                pages = _short(pages)
            w = self._writer
            found = {w[p] for p in pages}
        t, parted = self._tokens, self._parted
        if parted and not parted.isdisjoint(found):  # the requests' own writers, of the pages named
            if type(pages) is not list:
                pages = _short(pages)
            return {self._writer_at(p) for p in pages if self._writer[p]}
        return {t[token] for token in found if token}

    # -- readers (loads, storage writes) ----------------------------------------

    def check_readable(self, pages: Pages) -> None:
        """Raise `InvalidIndices` unless the caller holds every page."""
        if len(pages) >= BULK:
            first = self._first_refused(pages)
            if first is None:
                return
            pages = first
        if type(pages) is not list:
            pages = _short(pages)
        taken = self.allocator.is_taken
        d = self._deferred
        for p in pages:
            if not taken(p):
                raise InvalidIndices(
                    f"pool {self.name!r} host page {p} is not allocated; an operation reads pages "
                    "that a backup or prefetch filled and that were not freed",
                    pool=self.name,
                    rule="host-pages-held",
                )
            if d[p]:
                raise InvalidIndices(
                    f"pool {self.name!r} host page {p} was freed with free_host; an operation reads "
                    "pages that were not freed",
                    pool=self.name,
                    rule="host-pages-held",
                )

    def _first_refused(self, pages: Pages) -> list[int] | None:
        """For a long check: None when the caller holds every page (in range, allocated, not
        freed); else the first page that is not, which the walk of `check_readable` and
        `check_free` then names, as a short call's walk does."""
        idx = _index(pages)
        inside = (idx >= 0) & (idx < self.allocator.num_pages)
        taken, deferred = self.allocator.taken_np, self._deferred_np
        if inside.all() and taken[idx].all() and not deferred[idx].any():
            return None
        bad = ~inside
        held = idx[inside]
        bad[inside] = ~taken[held].astype(bool) | deferred[held].astype(bool)
        return [int(idx[np.argmax(bad)])]

    def pin(self, pages: Pages) -> None:
        if len(pages) == 1:  # the common case, kept short
            r = self._readers
            p = pages[0]
            c = r[p]
            if not c:
                self._reading += 1
            r[p] = c + 1
            return
        if len(pages) >= BULK:
            idx = _index(pages)
            rn = self._readers_np
            self._reading += _distinct(idx[rn[idx] == 0])
            np.add.at(rn, idx, 1)
            return
        if type(pages) is not list:
            pages = _short(pages)
        r = self._readers
        for p in pages:
            if not r[p]:
                self._reading += 1
            r[p] += 1

    def unpin(self, pages: Pages) -> None:
        if len(pages) == 1:  # the common case, kept short
            r = self._readers
            p = pages[0]
            left = r[p] - 1
            if left > 0:
                r[p] = left
                return
            if not left and not self._deferred[p]:
                r[p] = 0
                self._reading -= 1
                return
        if len(pages) >= BULK:
            self._unpin_bulk(_index(pages))
            return
        if type(pages) is not list:
            pages = _short(pages)
        r, d, w = self._readers, self._deferred, self._writer
        free_now = []
        for p in pages:
            left = r[p] - 1
            if left < 0:
                raise KeyError(p)  # the page has no reader: a bug in the caller
            r[p] = left
            if left:
                continue
            self._reading -= 1
            if d[p] and not w[p]:
                d[p] = 0
                self._deferred_count -= 1
                free_now.append(p)
        if free_now:
            self._release(free_now)

    def _unpin_bulk(self, idx: npt.NDArray[np.intp]) -> None:
        r = self._readers_np
        named = Counter(idx.tolist())  # the pages in the order first named, and their counts
        pages = np.fromiter(named.keys(), dtype=np.intp, count=len(named))
        left = r[pages] - np.fromiter(named.values(), dtype=np.intp, count=len(named))
        if (left < 0).any():
            raise KeyError(int(pages[np.argmax(left < 0)]))  # a page has no reader: a bug in the caller
        r[pages] = left
        ended = pages[left == 0]
        self._reading -= len(ended)
        go = ended[self._deferred_np[ended].astype(bool) & (self._writer_np[ended] == 0)]
        if len(go):
            self._deferred_np[go] = 0
            self._deferred_count -= len(go)
            # in the order first named, as the element-wise path frees them
            going = set(go.tolist())
            self._release([p for p in named if p in going])

    # -- the caller ---------------------------------------------------------------

    def check_free(self, pages: Pages) -> None:
        """Raise `InvalidIndices` unless the caller may free every page now."""
        if len(pages) >= BULK:
            first = self._first_refused(pages)
            if first is None:
                return
            pages = first
        if type(pages) is not list:
            pages = _short(pages)
        taken = self.allocator.is_taken
        d = self._deferred
        for p in pages:
            if not taken(p) or d[p]:
                raise InvalidIndices(
                    f"pool {self.name!r} host page {p} is not held; a page is freed once, "
                    "after a backup or prefetch handed it out",
                    pool=self.name,
                    rule="double-free",
                )

    def free(self, pages: Pages) -> int:
        """Free pages (checked with `check_free`); busy ones later. Returns how
        many pages were deferred."""
        if len(pages) >= BULK and (self._tokens or self._reading):
            idx = _index(pages)
            busy = (self._writer_np[idx] != 0) | (self._readers_np[idx] != 0)
            later = idx[busy]
            if len(later):
                self._mark_deferred(later)
                now = idx[~busy].tolist()
            else:
                now = idx.tolist()
            if now:
                self._release(now)
            return len(later)
        if not self._tokens and not self._reading:  # nothing in flight: every page goes now
            if len(pages):
                self._release(_list(pages))
            return 0
        if type(pages) is not list:
            pages = _short(pages)
        now = []
        deferred = 0
        w, r, d = self._writer, self._readers, self._deferred
        for p in pages:
            if w[p] or r[p]:
                if not d[p]:
                    d[p] = 1
                    self._deferred_count += 1
                deferred += 1
            else:
                now.append(p)
        if now:
            self._release(now)
        return deferred

    def _mark_deferred(self, idx: npt.NDArray[np.intp]) -> None:
        d = self._deferred_np
        self._deferred_count += _distinct(idx[d[idx] == 0])
        d[idx] = 1

    def abandon(self, pages: Pages) -> None:
        """Give back pages just taken from the allocator that no operation
        used yet (an allocation rolled back)."""
        self._release(_list(pages))
