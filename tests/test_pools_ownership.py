"""HostPageOwnership (typed arrays indexed by page) against a plain-Python model
of who writes, reads and holds each page: deferred frees, the exactly-once
free and the generations, on calls short enough for the element-wise path and
long enough for the numpy one, page lists and index arrays alike."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.errors import InvalidIndices
from kvtier.pools import PageAllocator
from kvtier.pools.ownership import BULK, HostPageOwnership


class Writer:
    """An in-flight operation's token (opaque to the record)."""

    made = 0

    def __init__(self) -> None:
        Writer.made += 1
        self.order = Writer.made


class Carrier:
    """A writer of many requests' pages (`HostPageOwnership.start_parts`): its
    requests' own writers, made when first asked for."""

    def __init__(self) -> None:
        self.made: dict[int, Writer] = {}

    def writer_of(self, index: int) -> Writer:
        return self.made.setdefault(index, Writer())


class OwnershipMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.sampled_from([8, 3 * BULK]), as_array=st.booleans())
    def setup(self, num_pages: int, as_array: bool) -> None:
        self.n = num_pages
        self.as_array = as_array
        self.alloc = PageAllocator(num_pages, 1, name="kv")
        self.own = HostPageOwnership(self.alloc)
        # the model
        self.writers: dict[int, Writer] = {}
        self.pages_of: dict[Writer, list[int]] = {}
        self.readers: dict[int, int] = {}
        self.pins: list[list[int]] = []
        self.deferred: set[int] = set()
        self.held: set[int] = set()  # the caller's (written and kept), deferred ones included
        self.lives = [0] * num_pages

    def arg(self, pages: list[int]) -> list[int] | np.ndarray:
        return np.asarray(pages, dtype=np.int64) if self.as_array else pages

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self.lives[p] += 1
            self.held.discard(p)

    @rule(count=st.integers(1, 2 * BULK), per_request=st.booleans())
    def write(self, count: int, per_request: bool) -> None:
        pages = self.alloc.try_alloc_pages(min(count, self.alloc.num_free_pages) or 1)
        if pages is None:
            return
        if per_request:  # a bulk backup: one writer per page
            writers = [Writer() for _ in pages]
            self.own.start_writes(self.arg(pages), list(range(len(pages) + 1)), writers)
            for p, w in zip(pages, writers):
                self.writers[p] = w
                self.pages_of[w] = [p]
        else:
            w = Writer()
            self.own.start_write(self.arg(pages), w)
            for p in pages:
                self.writers[p] = w
            self.pages_of[w] = list(pages)

    @rule(sizes=st.lists(st.integers(0, 3), min_size=1, max_size=BULK), whole=st.booleans())
    def write_parts(self, sizes: list[int], whole: bool) -> None:
        """A carrier of requests of 0 to 3 pages each; its requests end one by one or all at once."""
        total = sum(sizes)
        if not total or total > self.alloc.num_free_pages:
            return
        pages = self.alloc.try_alloc_pages(total)
        assert pages is not None
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        carrier = Carrier()
        self.own.start_parts(self.arg(pages), offsets, carrier)
        if whole:  # ended as one (a whole claim): the writer seen is each request's
            for i in range(len(sizes)):
                for p in pages[offsets[i]:offsets[i + 1]]:
                    self.writers[p] = carrier.writer_of(i)
            self.pages_of[Writer()] = list(pages)  # this key only names the claim
            return
        for i in range(len(sizes)):
            mine = pages[offsets[i]:offsets[i + 1]]
            if mine:
                w = carrier.writer_of(i)
                for p in mine:
                    self.writers[p] = w
                self.pages_of[w] = mine

    @precondition(lambda self: self.pages_of)
    @rule(data=st.data(), keep=st.booleans())
    def end_write(self, data: st.DataObject, keep: bool) -> None:
        w = data.draw(st.sampled_from(sorted(self.pages_of, key=lambda w: w.order)))
        pages = self.pages_of.pop(w)
        self.own.end_write(self.arg(pages), keep=keep)
        freed = []
        for p in pages:
            del self.writers[p]
            if not keep:
                self.deferred.discard(p)
                freed.append(p)
            elif p in self.deferred and p not in self.readers:
                self.deferred.discard(p)
                freed.append(p)
            else:
                self.held.add(p)
        self.release(freed)

    @precondition(lambda self: self.held - self.deferred)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        readable = sorted(self.held - self.deferred)
        pages = data.draw(st.lists(st.sampled_from(readable), min_size=1, max_size=2 * BULK))  # repeats too
        self.own.check_readable(self.arg(pages))
        self.own.pin(self.arg(pages))
        for p in pages:
            self.readers[p] = self.readers.get(p, 0) + 1
        self.pins.append(pages)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pages = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.own.unpin(self.arg(pages))
        freed = []
        for p in pages:
            self.readers[p] -= 1
            if not self.readers[p]:
                del self.readers[p]
                if p in self.deferred and p not in self.writers:
                    self.deferred.discard(p)
                    freed.append(p)
        self.release(freed)

    @precondition(lambda self: self.held - self.deferred)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held - self.deferred)), min_size=1,
                                   max_size=2 * BULK, unique=True))
        self.own.check_free(self.arg(pages))
        deferred = self.own.free(self.arg(pages))
        busy = [p for p in pages if p in self.readers or p in self.writers]
        assert deferred == len(busy)
        self.deferred.update(busy)
        self.release([p for p in pages if p not in busy])

    @rule(data=st.data())
    def refused(self, data: st.DataObject) -> None:
        """A page not handed out (free), or freed already (deferred), is refused
        by both checks, wherever it sits in a short or long list."""
        bad = sorted((set(range(self.n)) - self.held - set(self.writers)) | self.deferred)
        if not bad:
            return
        page = data.draw(st.sampled_from(bad))
        good = sorted(self.held - self.deferred)
        pages = data.draw(st.lists(st.sampled_from(good), max_size=2 * BULK, unique=True)) if good else []
        pages.insert(data.draw(st.integers(0, len(pages))), page)
        before = self.snapshot()
        with pytest.raises(InvalidIndices, match=f"host page {page} ") as err:
            self.own.check_free(self.arg(pages))
        assert err.value.rule == "double-free"
        with pytest.raises(InvalidIndices, match=f"host page {page} ") as err:
            self.own.check_readable(self.arg(pages))
        assert err.value.rule == "host-pages-held"
        assert self.snapshot() == before

    def snapshot(self) -> tuple[object, ...]:
        return (self.own.writers, self.own.readers, self.own.deferred, self.own.generations(list(range(self.n))))

    @invariant()
    def agrees(self) -> None:
        assert self.own.writers == self.writers
        assert self.own.readers == self.readers
        assert self.own.deferred == self.deferred
        assert self.own.deferred_count == len(self.deferred)
        assert self.own.writing == bool(self.writers)
        everything = list(range(self.n))
        assert self.own.generations(everything) == self.lives
        assert self.own.same_life(everything, self.lives)
        taken = {p for p in everything if self.alloc.is_taken(p)}
        assert taken == set(self.writers) | self.held  # a page is free, written, or the caller's
        seen = {self.writers[p] for p in self.writers}
        assert self.own.writers_of(everything) == seen


OwnershipMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
test_ownership_matches_the_model = OwnershipMachine.TestCase


def _walked(num_pages: int) -> tuple[int, int]:
    """What a collection visits of a record of ``num_pages`` pages (and its
    allocator's taken bytes) once every page was written, kept, read and freed
    (deferred, so every page has state): the tracked objects the record holds
    and the references the collector follows from them."""
    alloc = PageAllocator(num_pages, 1, name="kv")
    own = HostPageOwnership(alloc)
    pages = alloc.try_alloc_pages(num_pages)
    assert pages is not None
    own.start_write(pages, Writer())
    own.end_write(pages, keep=True)
    own.pin(pages)
    assert own.free(pages) == num_pages  # every page deferred (read)
    assert own.deferred_count == num_pages and not own.writing
    del pages
    held = [x for x in gc.get_referents(own) if x is not alloc and gc.is_tracked(x)]  # the allocator's list is its own
    return len(held), sum(len(gc.get_referents(x)) for x in held)


def test_a_million_page_record_costs_a_collection_no_more_than_a_small_one() -> None:
    assert _walked(1_000_000) == _walked(BULK)  # nothing per page


# -- one story told short (element by element) and long (numpy) -------------------------------

SIZES = pytest.mark.parametrize("n", [3, BULK, 2 * BULK + 5], ids=["short", "bulk", "long"])


def _record(n: int, extra: int = 0) -> tuple[PageAllocator, HostPageOwnership, list[int]]:
    alloc = PageAllocator(n + extra, 1, name="kv")
    own = HostPageOwnership(alloc)
    pages = alloc.try_alloc_pages(n)
    assert pages is not None
    return alloc, own, pages


@SIZES
@pytest.mark.parametrize("as_array", [False, True], ids=["list", "array"])
def test_a_page_freed_while_written_and_read_goes_once_when_both_end(n: int, as_array: bool) -> None:
    alloc, own, pages = _record(n, extra=2)
    arg = (lambda ps: np.asarray(ps, dtype=np.int64)) if as_array else (lambda ps: list(ps))
    w = Writer()
    own.start_write(arg(pages), w)
    assert own.writing and own.writers == dict.fromkeys(pages, w) and own.writers_of(arg(pages)) == {w}
    assert own.writers_of(arg([n])) == set()  # a page no one writes
    assert own.free(arg(pages)) == n  # written: every free waits
    assert own.deferred == set(pages) and own.deferred_count == n
    assert own.generations(arg(pages)) == [0] * n
    before = own.generations(arg(pages))
    own.end_write(arg(pages), keep=True)  # kept, but the caller freed them meanwhile: they go now
    assert not own.writing and own.deferred == set() and own.deferred_count == 0
    assert alloc.num_free_pages == n + 2 and not any(alloc.is_taken(p) for p in pages)
    assert own.generations(arg(pages)) == [1] * n
    assert not own.same_life(arg(pages), before) and own.same_life(arg(pages), [1] * n)


@SIZES
@pytest.mark.parametrize("as_array", [False, True], ids=["list", "array"])
def test_a_page_freed_while_read_goes_with_its_last_reader(n: int, as_array: bool) -> None:
    alloc, own, pages = _record(n)
    arg = (lambda ps: np.asarray(ps, dtype=np.int64)) if as_array else (lambda ps: list(ps))
    own.start_write(arg(pages), Writer())
    own.end_write(arg(pages), keep=True)  # the caller holds them
    own.check_readable(arg(pages))
    own.pin(arg(pages))
    own.pin(arg(pages[:1]))  # the first page read twice
    assert own.readers == {p: 2 if p == pages[0] else 1 for p in pages}
    assert own.free(arg(pages)) == n
    for refuse in (own.check_free, own.check_readable):  # freed already: neither freed nor read again
        with pytest.raises(InvalidIndices, match=f"host page {pages[0]} ") as err:
            refuse(arg(pages))
        assert err.value.pool == "kv"
    own.unpin(arg(pages))  # every page but the first had its last reader
    assert own.readers == {pages[0]: 1} and own.deferred == {pages[0]} and own.deferred_count == 1
    assert own.generations(arg(pages)) == [0] + [1] * (n - 1)
    assert [alloc.is_taken(p) for p in pages] == [True] + [False] * (n - 1)
    own.unpin(arg(pages[:1]))
    assert own.readers == {} and own.deferred == set() and own.deferred_count == 0
    assert own.generations(arg(pages)) == [1] * n and alloc.num_free_pages == n
    with pytest.raises(KeyError):  # no reader left: a caller's bug, caught
        own.unpin(arg(pages))


@SIZES
def test_a_failed_write_gives_its_pages_back_once_and_drops_their_deferred_free(n: int) -> None:
    alloc, own, pages = _record(n)
    own.start_write(pages, Writer())
    own.pin(pages)  # read while written (a storage write of a page being refilled cannot happen; the record allows it)
    assert own.free(pages[:2]) == 2
    own.end_write(pages, keep=False)
    assert alloc.num_free_pages == n and own.deferred == set() and own.deferred_count == 0
    assert own.generations(pages) == [1] * n
    with pytest.raises(KeyError):  # ended already: no writer
        own.end_write(pages, keep=False)


@SIZES
def test_requests_written_one_page_each_end_one_by_one(n: int) -> None:
    alloc, own, pages = _record(n)
    writers = [Writer() for _ in pages]
    own.start_writes(pages, list(range(n + 1)), writers)
    assert own.writers == dict(zip(pages, writers))
    assert own.writers_of(pages[:2]) == set(writers[:2])
    own.end_write(pages[:1], keep=True)
    assert own.writers == dict(zip(pages[1:], writers[1:])) and own.writing
    own.end_write(pages[1:], keep=False)
    assert not own.writing and own.writers == {}
    assert alloc.num_free_pages == n - 1 and alloc.is_taken(pages[0])


@SIZES
def test_requests_sharing_a_writer_or_several_pages_each_end_exactly(n: int) -> None:
    alloc, own, pages = _record(n + 2)
    shared = Writer()
    # two requests of one writer (offsets 0, 1, n+1): the writer writes every page until the last ends
    own.start_writes(pages, [0, 1, len(pages)], [shared, shared])
    assert own.writers == dict.fromkeys(pages, shared)
    own.end_write(pages[1:], keep=True)
    assert own.writers == {pages[0]: shared} and own.writing
    own.end_write(pages[:1], keep=True)
    assert not own.writing
    # a writer already writing starts more pages; its pages end in either order
    alloc.free_pages(pages)
    for first_ended in (pages[1:], pages[:1]):
        w = Writer()
        own.start_write(pages[:1], w)
        own.start_write(pages[1:], w)
        own.start_write([], w)  # nothing
        own.end_write(first_ended, keep=True)
        assert own.writing and own.writers == {p: w for p in pages if p not in first_ended}
        own.end_write([p for p in pages if p not in first_ended], keep=True)
        assert not own.writing and own.writers == {}
    # requests of distinct writers, one of them two pages long: each page its request's writer
    a, b = Writer(), Writer()
    own.start_writes(pages, [0, 1, len(pages)], [a, b])
    assert own.writers == {p: (a if i == 0 else b) for i, p in enumerate(pages)}
    own.end_write(pages, keep=True)
    assert not own.writing
    # one-page requests sharing a writer, and a writer already writing: all end exactly
    c = Writer()
    own.start_write(pages[2:3], c)
    own.start_writes(pages[:2], [0, 1, 2], [a, a])
    own.start_writes(pages[3:5], [0, 1, 2], [c, b])
    own.end_write(pages[:1], keep=True)
    assert own.writers == {pages[1]: a, pages[2]: c, pages[3]: c, pages[4]: b}
    own.end_write(pages[2:3], keep=True)
    own.end_write([pages[1], pages[3], pages[4]], keep=True)
    assert not own.writing and own.writers == {}


@SIZES
def test_a_carrier_s_requests_are_their_own_writers(n: int) -> None:
    alloc, own, pages = _record(n + 2)
    carrier = Carrier()
    offsets = [0, 1, 1, n + 2]  # request 1 has no page
    own.start_parts(pages, offsets, carrier)
    own.start_parts([], [0], carrier)  # nothing
    first, last = carrier.writer_of(0), carrier.writer_of(2)
    assert own.writers == {p: (first if i == 0 else last) for i, p in enumerate(pages)}
    assert own.writers_of(pages) == {first, last} and own.writers_of(pages[1:]) == {last}
    other = Writer()
    own.end_write(pages, keep=False)
    assert not own.writing and alloc.num_free_pages == n + 2
    # the carrier's token is gone with its pages: a plain writer reusing nothing sees itself
    pages2 = alloc.try_alloc_pages(1)
    assert pages2 is not None
    own.start_write(pages2, other)
    assert own.writers_of(pages2) == {other} and own.writers == {pages2[0]: other}


@SIZES
def test_a_page_s_checksums_and_valid_rows_go_with_its_life(n: int) -> None:
    alloc = PageAllocator(n, 1, name="kv")
    checksums: dict[str, dict[int, int]] = {"kv": {}, "side": {}, "other": {}}
    valid_rows: dict[str, dict[int, int]] = {"kv": {}}
    own = HostPageOwnership(alloc, checksums=checksums, checksum_pools=("kv", "side"), valid_rows=valid_rows)
    pages = alloc.try_alloc_pages(n)
    assert pages is not None
    for table in (*checksums.values(), valid_rows["kv"]):
        table.update(dict.fromkeys(pages, 7))
    assert own.free(pages[1:]) == 0  # nothing in flight: they go now, and their records with them
    assert checksums["kv"] == {pages[0]: 7} == checksums["side"] == valid_rows["kv"]
    assert checksums["other"] == dict.fromkeys(pages, 7)  # not this pool's
    own.abandon(pages[:1])  # an allocation rolled back: its page goes the same way
    assert checksums["kv"] == {} == valid_rows["kv"] and alloc.num_free_pages == n
    assert own.generations(pages) == [1] * n


@SIZES
def test_a_page_not_held_is_refused_by_name_wherever_it_sits(n: int) -> None:
    alloc, own, pages = _record(n, extra=1)
    own.start_write(pages, Writer())
    own.end_write(pages, keep=True)
    spare = n  # never handed out
    for bad, why in ((spare, "is not allocated; an operation reads pages that a backup or prefetch filled and "
                             "that were not freed"),
                     (-1, "is not allocated; an operation reads pages that a backup or prefetch filled and "
                          "that were not freed"),
                     (n + 1, "is not allocated; an operation reads pages that a backup or prefetch filled and "
                             "that were not freed")):
        for at in (0, n - 1, n):
            named = [*pages[:at], bad, *pages[at:]]
            with pytest.raises(InvalidIndices) as err:
                own.check_readable(named)
            assert str(err.value) == f"pool 'kv' host page {bad} {why}"
            assert (err.value.pool, err.value.rule) == ("kv", "host-pages-held")
            with pytest.raises(InvalidIndices) as err:
                own.check_free(named)
            assert str(err.value) == (f"pool 'kv' host page {bad} is not held; a page is freed once, after a backup "
                                      "or prefetch handed it out")
            assert (err.value.pool, err.value.rule) == ("kv", "double-free")
    own.check_readable(pages)
    own.check_free(pages)
    own.pin(pages[-1:])
    assert own.free(pages[-1:]) == 1
    with pytest.raises(InvalidIndices) as err:
        own.check_readable(pages)
    assert str(err.value) == (f"pool 'kv' host page {pages[-1]} was freed with free_host; an operation reads "
                              "pages that were not freed")
    assert (err.value.pool, err.value.rule) == ("kv", "host-pages-held")


@SIZES
def test_a_held_page_read_and_unpinned_stays_the_caller_s(n: int) -> None:
    alloc, own, pages = _record(n)
    own.start_write(pages, Writer())
    own.end_write(pages, keep=True)
    own.pin(pages)
    own.unpin(pages)
    assert own.readers == {} and all(alloc.is_taken(p) for p in pages) and own.generations(pages) == [0] * n
    assert own.free(pages) == 0  # nothing reads them now: they go at once
    assert alloc.num_free_pages == n


@SIZES
def test_an_unpin_or_end_without_its_pin_or_writer_names_the_page(n: int) -> None:
    alloc, own, pages = _record(n, extra=1)
    spare = n
    own.start_write(pages, Writer())
    own.pin(pages)
    with pytest.raises(KeyError) as err:
        own.unpin([*pages, spare])  # every page but the last had its reader
    assert err.value.args == (spare,)
    with pytest.raises(KeyError) as err:
        own.end_write([*pages, spare], keep=True)
    assert err.value.args == (spare,)


def test_readers_are_counted_exactly_when_a_long_unpin_ends_none_of_its_pages() -> None:
    alloc, own, pages = _record(2 * BULK + 1)
    own.start_write(pages, Writer())
    own.end_write(pages, keep=True)
    lone, many = pages[:1], pages[1:]
    own.pin(lone)
    own.pin(many)
    own.pin(many)
    own.unpin(many)  # every page still read once: no read ended
    assert own.free(lone) == 1  # lone is read: its free waits
    assert own.deferred == set(lone)
    own.unpin(lone)
    assert own.deferred == set() and not alloc.is_taken(lone[0])


def test_a_long_free_counts_deferred_pages_besides_those_deferred_before() -> None:
    alloc, own, pages = _record(2 * BULK)
    own.start_write(pages, Writer())
    own.end_write(pages, keep=True)
    own.pin(pages)
    assert own.free(pages[:1]) == 1
    assert own.free(pages[1:]) == 2 * BULK - 1
    assert own.deferred_count == 2 * BULK == len(own.deferred)


def test_one_page_writers_and_a_one_page_carrier_end_in_one_long_call() -> None:
    alloc, own, pages = _record(BULK + 1)
    carrier = Carrier()
    own.start_parts(pages[:1], [0, 1], carrier)
    writers = [Writer() for _ in pages[1:]]
    own.start_writes(pages[1:], list(range(BULK + 1)), writers)
    assert own.writers_of(pages[:2]) == {carrier.writer_of(0), writers[0]}
    own.end_write(pages, keep=False)
    assert not own.writing and own.writers == {} and alloc.num_free_pages == BULK + 1
    again = alloc.try_alloc_pages(1)
    assert again is not None
    w = Writer()
    own.start_write(again, w)
    assert own.writers_of(again) == {w}


def test_a_read_page_s_free_waits_however_its_reads_were_counted() -> None:
    # reads pinned one page at a time, in short lists and in one long call count together:
    # while a page is read its free waits; once nothing is read, a free goes at once
    alloc, own, pages = _record(3 * BULK + 1)
    own.start_write(pages, Writer())
    own.end_write(pages, keep=True)
    singles, pairs, longs, idle = pages[:BULK], pages[BULK:2 * BULK], pages[2 * BULK:3 * BULK], pages[-1]
    for p in singles:
        own.pin([p])
    for i in range(0, BULK, 2):
        own.pin(pairs[i:i + 2])
    own.pin(longs)
    own.unpin(singles)  # in one long call
    assert own.free(pairs[:1]) == 1 and alloc.is_taken(pairs[0])
    own.unpin(pairs)  # the deferred page goes with its last reader
    assert not alloc.is_taken(pairs[0])
    assert own.free(longs[:1]) == 1 and alloc.is_taken(longs[0])
    for p in longs[:-1]:  # one at a time
        own.unpin([p])
    assert not alloc.is_taken(longs[0]) and own.readers == {longs[-1]: 1}
    assert own.free(longs[-1:]) == 1 and alloc.is_taken(longs[-1])
    own.unpin(longs[-1:])
    assert not alloc.is_taken(longs[-1]) and own.readers == {} and own.deferred == set()
    assert own.free([idle]) == 0 and not alloc.is_taken(idle)


def test_a_single_page_ends_as_a_list_of_pages_does() -> None:
    alloc, own, pages = _record(3)
    p, q, spare = pages[0], pages[1], 2
    own.start_write([p], Writer())
    assert own.free([p]) == 1  # freed while written
    own.end_write([p], keep=True)  # kept: the deferred free happens now
    assert not alloc.is_taken(p) and own.deferred == set() and own.generations([p]) == [1]
    own.start_write([q], Writer())
    own.end_write([q], keep=True)
    assert alloc.is_taken(q) and not own.writing
    with pytest.raises(KeyError) as err:
        own.end_write([spare], keep=True)
    assert err.value.args == (spare,)


def test_a_long_free_while_others_are_in_flight_frees_the_idle_pages_now() -> None:
    alloc, own, pages = _record(2 * BULK + 1)
    busy, idle, more = pages[:1], pages[1:BULK + 1], pages[BULK + 1:]
    own.start_write(pages, Writer())
    own.end_write(idle + more, keep=True)  # the caller holds these; the first page is still written
    assert own.free(idle) == 0  # none of them busy: all go now
    assert not any(alloc.is_taken(p) for p in idle) and own.generations(idle) == [1] * BULK
    own.pin(more[:1])
    assert own.free(more) == 1  # one read: it waits, the rest go now
    assert [alloc.is_taken(p) for p in more] == [True] + [False] * (len(more) - 1)
    # a second life of the same pages: generations count every release
    alloc.take_pages(idle)
    own.abandon(idle)
    assert own.generations(idle) == [2] * BULK


def test_checksums_of_a_page_without_an_entry_are_left_alone() -> None:
    alloc = PageAllocator(4, 1, name="kv")
    checksums: dict[str, dict[int, int]] = {"kv": {0: 1}}
    own = HostPageOwnership(alloc, checksums=checksums, checksum_pools=("kv",), valid_rows={"kv": {}})
    pages = alloc.try_alloc_pages(2)
    assert pages == [0, 1]
    own.free([1])  # no entry for page 1: nothing to drop
    own.free([0])
    assert checksums == {"kv": {}}


def test_a_writer_of_several_pages_that_starts_more_ends_with_its_last_page() -> None:
    alloc, own, pages = _record(4)
    w = Writer()
    own.start_write(pages[:2], w)
    own.start_write(pages[2:], w)
    own.end_write(pages[:3], keep=True)
    assert own.writing and own.writers == {pages[3]: w}
    own.end_write(pages[3:], keep=True)
    assert not own.writing


def test_writers_of_an_index_array_name_a_carrier_s_requests() -> None:
    alloc, own, pages = _record(4)
    carrier = Carrier()
    own.start_parts(pages, [0, 2, 4], carrier)
    assert own.writers_of(np.asarray(pages[2:], dtype=np.int64)) == {carrier.writer_of(1)}


def test_a_single_page_read_twice_is_read_until_its_second_unpin() -> None:
    alloc, own, pages = _record(3)
    own.start_write(pages, Writer())
    own.end_write(pages, keep=True)
    p = pages[0]
    own.pin([p])
    own.pin([p])
    own.unpin([p])
    assert own.readers == {p: 1}
    assert own.free([p]) == 1  # still read: it waits
    own.unpin([p])
    assert own.readers == {} and not alloc.is_taken(p)
    with pytest.raises(KeyError) as err:
        own.unpin([pages[1]])  # never read
    assert err.value.args == (pages[1],) and own.readers == {}


@pytest.mark.parametrize("pinned", ["one by one", "as a list"])
def test_the_other_page_of_two_read_waits_after_the_first_is_unpinned(pinned: str) -> None:
    alloc, own, pages = _record(3)
    own.start_write(pages, Writer())
    own.end_write(pages, keep=True)
    a, b = pages[:2]
    if pinned == "one by one":
        own.pin([a])
        own.pin([b])
    else:
        own.pin([a, b])
    own.unpin([a])
    assert own.free([b]) == 1 and alloc.is_taken(b)  # b is still read
    assert own.free([a]) == 0 and not alloc.is_taken(a)


def test_writers_of_a_long_index_array_name_a_carrier_s_requests() -> None:
    alloc, own, pages = _record(2 * BULK)
    carrier = Carrier()
    own.start_parts(pages, [0, BULK, 2 * BULK], carrier)
    assert own.writers_of(np.asarray(pages[BULK:], dtype=np.int64)) == {carrier.writer_of(1)}
    assert own.writers_of(np.asarray(pages, dtype=np.int64)) == {carrier.writer_of(0), carrier.writer_of(1)}


@pytest.mark.parametrize("ended", ["one page", "a short list"])
def test_reads_still_held_keep_their_pages_frees_waiting_after_other_reads_end(ended: str) -> None:
    alloc, own, pages = _record(BULK + 3)
    own.start_write(pages, Writer())
    own.end_write(pages, keep=True)
    a, b, c, held = pages[0], pages[1], pages[2], pages[3:]
    for p in (a, b, c):
        own.pin([p])
    own.pin(held)
    own.pin(held)  # read twice
    if ended == "one page":
        own.unpin([a])
        own.unpin([b])
    else:
        own.unpin([a, b])
    own.unpin([*held, c])  # c's read ends; every held page is still read once
    assert own.readers == dict.fromkeys(held, 1)
    assert own.free(held[:1]) == 1 and alloc.is_taken(held[0])


@pytest.mark.parametrize("pages_of_carrier", [1, 2])
def test_a_carriers_mark_goes_with_its_last_page(pages_of_carrier: int) -> None:
    # a writer object can come back as a plain writer (CPython reuses the ids of dead
    # objects; here the same object makes the reuse certain): it is then its own writer
    alloc, own, pages = _record(3)
    carrier = Carrier()
    own.start_parts(pages[:pages_of_carrier], [0, pages_of_carrier], carrier)
    own.end_write(pages[:pages_of_carrier], keep=True)
    assert not own.writing
    own.start_write(pages[2:], carrier)
    assert own.writers_of(pages[2:]) == {carrier} and own.writers == {pages[2]: carrier}


def test_pages_as_a_tuple_are_walked_as_a_list_is() -> None:
    # `Pages` is any sequence of ints: a tuple takes the same element-wise path as a list
    alloc, own, pages = _record(6)
    w = Writer()
    written = tuple(pages[:3])
    own.start_write(written, w)
    assert own.writers_of(written) == {w} and own.generations(written) == [0, 0, 0]
    assert own.same_life(written, (0, 0, 0))
    assert own.free(written[:2]) == 2  # written: the free waits
    own.end_write(written, keep=True)  # the two freed go now, the third is the caller's
    assert [alloc.is_taken(p) for p in written] == [False, False, True]
    assert own.generations(written) == [1, 1, 0] and not own.same_life(written, (0, 0, 0))
    held = (written[2], *pages[3:])
    own.check_readable(held)
    own.check_free(held)
    own.pin(held)
    alloc.take_pages(list(pages[:2]))
    own.start_write(tuple(pages[:2]), Writer())  # a writer in flight: the free below walks its pages
    assert own.free(held[:2]) == 2 and own.readers == dict.fromkeys(held, 1)
    own.unpin(held)
    assert [alloc.is_taken(p) for p in held] == [False, False, True, True]
    with pytest.raises(InvalidIndices, match=f"host page {held[0]} is not held"):
        own.check_free(held)
    with pytest.raises(InvalidIndices, match=f"host page {held[0]} is not allocated"):
        own.check_readable(held)


def test_a_request_without_pages_among_one_page_requests_writes_nothing() -> None:
    # offsets that repeat (a request that names no page of this pool) are not one page per request
    alloc, own, pages = _record(4)
    a, b, c = Writer(), Writer(), Writer()
    own.start_writes(pages[:2], [0, 0, 2], [a, b])  # a has no page here, b both
    assert own.writers == dict.fromkeys(pages[:2], b) and own.writers_of(pages[:1]) == {b}
    own.start_writes(pages[2:], [0, 2, 2], [c, a])  # c both, a none
    assert own.writers == {**dict.fromkeys(pages[:2], b), **dict.fromkeys(pages[2:], c)}
    own.end_write(pages, keep=True)
    assert not own.writing and own.writers == {}
    own.start_writes([], [0], [])  # no request: nothing
    own.start_writes(pages[:0], [0, 0], [a])  # one request without a page: nothing
    assert not own.writing and own.writers == {}


@pytest.mark.parametrize("n", [BULK - 2, BULK - 1, BULK, 2 * BULK])
@pytest.mark.parametrize("check", ["check_free", "check_readable"])
def test_a_check_names_the_first_page_it_refuses_at_every_length(n: int, check: str) -> None:
    # a page not held named before a page out of range (and before a negative one): the error names
    # the first, as it would for a short list; every page beside them is held
    alloc, own, pages = _record(n - 2, extra=1)
    not_held = n - 2  # the spare page, never handed out
    why = {"check_free": "is not held", "check_readable": "is not allocated"}[check]
    for late in (n + 5, -1):
        named = [pages[0], not_held, *pages[1:], late]
        assert len(named) == n
        with pytest.raises(InvalidIndices, match=f"host page {not_held} {why}"):
            getattr(own, check)(named)
        with pytest.raises(InvalidIndices, match=f"host page {not_held} {why}"):
            getattr(own, check)(np.asarray(named, dtype=np.int64))
        # the page out of range named first is the one named
        with pytest.raises(InvalidIndices, match=f"host page {late} {why}"):
            getattr(own, check)([late, *named[:-1]])
