"""PageAllocator accounting and the index-set rules of kvtier.pools.indices."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.errors import ConfigurationError, InvalidIndices
from kvtier.pools import PageAllocator, SlotAllocator, as_index_tensor, page_numbers, slots_of_pages
from kvtier.pools.indices import _PYTHON_CHECK_LIMIT

# -- stateful model of PageAllocator ------------------------------------------


class PageAllocatorMachine(RuleBasedStateMachine):
    """Drives a PageAllocator against a plain-Python model of who holds which page."""

    @initialize(page_size=st.sampled_from([1, 4, 16]), num_pages=st.integers(1, 24))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.ps = page_size
        self.num_pages = num_pages
        self.alloc = PageAllocator(num_pages * page_size, page_size, name="kv")
        self.held: list[list[int]] = []  # live allocations, as the allocator returned them
        self.ever_allocated: set[int] = set()
        self.model_free = num_pages
        self.model_peak = 0
        self.model_allocations = 0
        self.model_frees = 0

    def held_pages(self) -> set[int]:
        return {p for a in self.held for p in a}

    def assert_refused_without_change(self, pages: list[int], rule_name: str) -> None:
        before = self.alloc.statistics()
        taken_before = [self.alloc.is_taken(p) for p in range(self.num_pages)]
        with pytest.raises(InvalidIndices) as info:
            self.alloc.free_pages(pages)
        assert info.value.rule == rule_name
        assert info.value.pool == "kv"
        assert self.alloc.statistics() == before
        assert [self.alloc.is_taken(p) for p in range(self.num_pages)] == taken_before

    @rule(n=st.integers(1, 10))
    def alloc_pages(self, n: int) -> None:
        before = self.alloc.statistics()
        pages = self.alloc.try_alloc_pages(n)
        if n > self.model_free:
            assert pages is None
            assert self.alloc.statistics() == before
            return
        assert pages is not None
        assert len(pages) == n
        assert all(0 <= p < self.num_pages for p in pages)
        assert len(set(pages)) == n
        assert not set(pages) & self.held_pages(), "a held page was handed out again"
        assert all(self.alloc.is_taken(p) for p in pages)
        self.held.append(pages)
        self.ever_allocated.update(pages)
        self.model_free -= n
        self.model_allocations += 1
        self.model_peak = max(self.model_peak, self.num_pages - self.model_free)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), as_slots=st.booleans())
    def free_some(self, data: st.DataObject, as_slots: bool) -> None:
        chosen = data.draw(
            st.lists(st.sampled_from(range(len(self.held))), min_size=1, unique=True), label="chosen"
        )
        pages = [p for i in chosen for p in self.held[i]]
        pages = data.draw(st.permutations(pages), label="order")
        if as_slots:
            self.alloc.free(slots_of_pages(pages, self.ps))
        else:
            self.alloc.free_pages(pages)
        assert not any(self.alloc.is_taken(p) for p in pages)
        self.held = [a for i, a in enumerate(self.held) if i not in set(chosen)]
        self.model_free += len(pages)
        self.model_frees += 1

    @precondition(lambda self: len(self.held_pages()) < self.num_pages)
    @rule(data=st.data(), with_held=st.booleans())
    def double_free(self, data: st.DataObject, with_held: bool) -> None:
        """Freeing a page not held (freed before, or never handed out) is refused,
        and a held page listed with it is not freed either (all or nothing)."""
        not_held = sorted(set(range(self.num_pages)) - self.held_pages())
        bad = data.draw(st.sampled_from(not_held), label="bad page")
        pages = [bad]
        if with_held and self.held:
            pages = [data.draw(st.sampled_from(sorted(self.held_pages())), label="held page"), bad]
        self.assert_refused_without_change(pages, "double-free")

    @precondition(lambda self: len(self.ever_allocated) < self.num_pages)
    @rule(data=st.data())
    def free_never_allocated(self, data: st.DataObject) -> None:
        never = sorted(set(range(self.num_pages)) - self.ever_allocated)
        page = data.draw(st.sampled_from(never), label="never allocated")
        self.assert_refused_without_change([page], "double-free")

    @rule(page=st.one_of(st.integers(-5, -1), st.integers(0, 5)))
    def free_out_of_range(self, page: int) -> None:
        if page >= 0:
            page += self.num_pages  # 0..5 past the last page
        self.assert_refused_without_change([page], "in-range")

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_page_twice_in_one_call(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(sorted(self.held_pages())), label="held page")
        self.assert_refused_without_change([page, page], "unique-pages")

    @precondition(lambda self: len(self.held_pages()) < self.num_pages)
    @rule(data=st.data())
    def take_named(self, data: st.DataObject) -> None:
        """The engine names free pages (`take_pages`): exactly those are taken,
        and no later allocation hands one of them out again."""
        free = sorted(set(range(self.num_pages)) - self.held_pages())
        pages = data.draw(st.lists(st.sampled_from(free), min_size=1, unique=True), label="named free pages")
        self.alloc.take_pages(pages)
        assert all(self.alloc.is_taken(p) for p in pages)
        assert self.alloc.taken_np.tolist() == [int(p in self.held_pages() | set(pages)) for p in range(self.num_pages)]
        self.held.append(pages)
        self.ever_allocated.update(pages)
        self.model_free -= len(pages)
        self.model_allocations += 1
        self.model_peak = max(self.model_peak, self.num_pages - self.model_free)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def take_a_taken_page(self, data: st.DataObject) -> None:
        """Naming a taken page, alone or among free ones, takes nothing."""
        taken = data.draw(st.sampled_from(sorted(self.held_pages())), label="taken page")
        free = sorted(set(range(self.num_pages)) - self.held_pages())
        pages = data.draw(st.permutations([taken, *free[:2]]), label="order")
        before = self.alloc.statistics()
        with pytest.raises(InvalidIndices) as info:
            self.alloc.take_pages(pages)
        assert (info.value.rule, info.value.pool) == ("host-pages-free", "kv")
        assert self.alloc.statistics() == before
        assert not any(self.alloc.is_taken(p) for p in free)

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "alloc"):
            return
        s = self.alloc.statistics()
        assert s.used_slots + s.free_slots == s.capacity_slots == self.num_pages * self.ps
        assert s.free_slots == self.model_free * self.ps == self.alloc.num_free_slots
        assert self.alloc.num_free_pages == self.model_free
        assert s.used_slots == len(self.held_pages()) * self.ps == self.alloc.num_used_slots
        assert s.peak_used_slots >= s.used_slots
        assert s.peak_used_slots == self.model_peak * self.ps
        assert (s.allocations, s.frees) == (self.model_allocations, self.model_frees)
        held = self.held_pages()
        assert sum(len(a) for a in self.held) == len(held), "a page is held twice"
        assert [self.alloc.is_taken(p) for p in range(self.num_pages)] == [
            p in held for p in range(self.num_pages)
        ]


PageAllocatorMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPageAllocatorStateful = PageAllocatorMachine.TestCase


# -- PageAllocator unit tests -------------------------------------------------


def test_page_allocator_satisfies_slot_allocator_protocol() -> None:
    assert isinstance(PageAllocator(16, 4), SlotAllocator)


def test_fresh_allocator_hands_out_ascending_consecutive_pages() -> None:
    a = PageAllocator(64, 4, name="kv")
    assert a.try_alloc_pages(3) == [0, 1, 2]
    assert a.try_alloc_pages(2) == [3, 4]
    assert a.try_alloc(8).tolist() == list(range(20, 28))


def test_lowest_freed_page_is_reused_first() -> None:
    a = PageAllocator(32, 4)
    a.try_alloc_pages(6)
    a.free_pages([2, 4])
    assert a.try_alloc_pages(1) == [2]
    assert a.try_alloc_pages(1) == [4]
    assert a.try_alloc_pages(1) == [6]


def test_try_alloc_returns_slots_of_whole_pages() -> None:
    a = PageAllocator(64, 4, name="kv")
    a.try_alloc_pages(1)
    slots = a.try_alloc(12)
    assert slots is not None
    assert slots.dtype == torch.int64
    assert slots.dim() == 1
    assert slots.tolist() == list(range(4, 16))
    assert page_numbers(slots, page_size=4, limit=64, pool="kv", side="x") == [1, 2, 3]
    assert a.num_used_slots == 16


def test_try_alloc_of_non_page_multiple_raises() -> None:
    a = PageAllocator(64, 4, name="kv")
    before = a.statistics()
    with pytest.raises(
        InvalidIndices, match=r"pool 'kv' allocates whole pages of 4 slots; got a request for 6 slots"
    ) as info:
        a.try_alloc(6)
    assert info.value.rule == "whole-pages"
    assert info.value.pool == "kv"
    assert a.statistics() == before


@pytest.mark.parametrize("n", [0, -1])
def test_try_alloc_pages_of_no_pages_raises(n: int) -> None:
    a = PageAllocator(16, 4, name="kv")
    with pytest.raises(InvalidIndices, match=rf"allocation needs at least one page; got {n}") as info:
        a.try_alloc_pages(n)
    assert info.value.rule == "non-empty"
    assert a.num_free_pages == 4


def test_alloc_more_than_free_returns_none_and_changes_nothing() -> None:
    a = PageAllocator(32, 4, name="kv")
    a.try_alloc_pages(5)
    before = a.statistics()
    assert a.try_alloc_pages(4) is None
    assert a.try_alloc(16) is None
    assert a.statistics() == before
    assert a.try_alloc_pages(3) == [5, 6, 7]
    assert a.num_free_slots == 0


@pytest.mark.parametrize("bad", [0, -4, 4.0, "16", None, True])
def test_capacity_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"pool 'kv' capacity must be a positive int; got "):
        PageAllocator(bad, 4, name="kv")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -4, 4.0, "4", None, True])
def test_page_size_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"pool 'kv' page_size must be a positive int; got "):
        PageAllocator(16, bad, name="kv")  # type: ignore[arg-type]


def test_capacity_must_be_whole_pages() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"pool 'kv' capacity must be a whole number of pages of 4 slots; got 18 slots",
    ):
        PageAllocator(18, 4, name="kv")


@pytest.mark.parametrize(
    ("slots", "rule"),
    [
        ([5, 6, 7, 8], "page-aligned"),  # starts off a boundary
        ([4, 5, 7, 6], "page-aligned"),  # not consecutive inside the page
        ([4, 5, 6], "whole-pages"),
        ([], "non-empty"),
        ([64, 65, 66, 67], "in-range"),
        ([4, 5, 6, 7, 4, 5, 6, 7], "unique-pages"),
    ],
)
def test_free_of_bad_slot_tensor_raises_and_frees_nothing(slots: list[int], rule: str) -> None:
    a = PageAllocator(64, 4, name="kv")
    a.try_alloc_pages(4)
    before = a.statistics()
    with pytest.raises(InvalidIndices) as info:
        a.free(torch.tensor(slots, dtype=torch.int64))
    assert info.value.rule == rule
    assert info.value.pool == "kv"
    assert "freed" in str(info.value)
    assert a.statistics() == before
    assert all(a.is_taken(p) for p in range(4))


def test_free_accepts_a_list_and_an_int32_tensor() -> None:
    a = PageAllocator(16, 4)
    a.try_alloc_pages(4)
    a.free([0, 1, 2, 3])
    a.free(torch.arange(8, 12, dtype=torch.int32))
    assert not a.is_taken(0) and not a.is_taken(2)
    assert a.is_taken(1) and a.is_taken(3)
    assert a.statistics().frees == 2


def test_is_taken_is_false_out_of_range() -> None:
    a = PageAllocator(8, 4)
    a.try_alloc_pages(2)
    assert a.is_taken(0) and a.is_taken(1)
    assert not a.is_taken(-1)
    assert not a.is_taken(2)


def test_free_pages_error_messages() -> None:
    a = PageAllocator(16, 4, name="kv")
    a.try_alloc_pages(2)
    with pytest.raises(InvalidIndices, match=r"pool 'kv' has 4 pages \(0\.\.3\); cannot free page 4"):
        a.free_pages([4])
    with pytest.raises(
        InvalidIndices, match=r"pool 'kv' page 3 is not allocated; a page is freed once"
    ):
        a.free_pages([0, 3])
    with pytest.raises(InvalidIndices, match=r"pool 'kv' free lists a page twice: \[1, 1\]"):
        a.free_pages([1, 1])
    assert a.is_taken(0) and a.is_taken(1)


def test_take_pages_refusals_name_the_pool_the_page_and_the_rule() -> None:
    a = PageAllocator(16, 4, name="kv")
    a.take_pages([2])
    cases: list[tuple[Any, str, str]] = [
        ([2], "pool 'kv' page 2 is taken; an operation writes named host pages only when they are free "
              "(free_host them first; a page still read or written is free once that operation ends)",
         "host-pages-free"),
        ([4], "pool 'kv' has 4 pages (0..3); cannot take page 4", "in-range"),
        ([0, 1, 0], "pool 'kv' names a page twice: [0, 0, 1]", "unique-pages"),
        ("01", "pool 'kv' takes a sequence of page numbers (ints); got str", "page-numbers"),
        ([1, 1.0], "pool 'kv' page numbers are ints; got 1.0 (float) among [1, 1.0]", "page-numbers"),
    ]
    for pages, message, rule_name in cases:
        with pytest.raises(InvalidIndices) as info:
            a.take_pages(pages)
        assert (str(info.value), info.value.rule, info.value.pool) == (message, rule_name, "kv")
        with pytest.raises(InvalidIndices) as info:
            a.check_takeable(pages)
        assert str(info.value) == message
    assert a.taken_np.tolist() == [0, 0, 1, 0]
    assert a.statistics().allocations == 1


def test_free_pages_refusals_name_the_pool_the_page_and_the_rule() -> None:
    a = PageAllocator(160, 4, name="kv")
    a.try_alloc_pages(40)
    many = list(range(20)) + [3]  # a page twice in a long list: the message lists the first 16, sorted
    cases: list[tuple[Any, str, str]] = [
        (torch.tensor([0]), "pool 'kv' frees a sequence of page numbers (ints); got Tensor", "page-numbers"),
        ([*range(10), "x"], "pool 'kv' page numbers are ints; got 'x' (str) among [0, 1, 2, 3, 4, 5, 6, 7]",
         "page-numbers"),
        (many, f"pool 'kv' free lists a page twice: {sorted(many)[:16]}", "unique-pages"),
        ([-1], "pool 'kv' has 40 pages (0..39); cannot free page -1", "in-range"),
        ([39, 39], "pool 'kv' free lists a page twice: [39, 39]", "unique-pages"),
    ]
    for pages, message, rule_name in cases:
        with pytest.raises(InvalidIndices) as info:
            a.free_pages(pages)
        assert (str(info.value), info.value.rule, info.value.pool) == (message, rule_name, "kv")
    assert a.num_free_pages == 0
    a.free_pages([5])
    with pytest.raises(InvalidIndices) as info:
        a.free_pages([4, 5])  # freed already: and 4 stays allocated
    assert str(info.value) == "pool 'kv' page 5 is not allocated; a page is freed once, after it was handed out"
    assert (info.value.rule, a.num_free_pages, a.is_taken(4)) == ("double-free", 1, True)


def test_refusals_of_freed_slots_name_the_pool_and_the_freed_side() -> None:
    a = PageAllocator(16, 4, name="kv")
    a.try_alloc_pages(4)
    with pytest.raises(InvalidIndices) as info:
        a.free(torch.tensor([0.0, 1.0]))
    assert str(info.value) == "pool 'kv' freed indices must be an integer tensor; got dtype torch.float32"
    assert info.value.pool == "kv"
    with pytest.raises(InvalidIndices) as info:
        a.free(torch.tensor([1, 2, 3, 4]))
    assert str(info.value) == ("pool 'kv' needs whole pages of 4 slots starting on a page boundary; "
                               "got 4 freed indices with a page at position 0 starting at 1")
    with pytest.raises(InvalidIndices) as info:
        a.try_alloc_pages(0)
    assert info.value.pool == "kv"


def test_an_unnamed_allocator_names_the_empty_pool() -> None:
    a = PageAllocator(8, 4)
    assert repr(a) == "<PageAllocator '' [pages: 0 used, 2 free | page_size=4]>"
    with pytest.raises(InvalidIndices, match=r"^pool '' has 2 pages"):
        a.free_pages([2])


def test_taken_np_shows_the_taken_pages() -> None:
    a = PageAllocator(32, 4)
    a.try_alloc_pages(3)
    a.take_pages([6])
    a.free_pages([1])
    assert a.taken_np.tolist() == [1, 0, 1, 0, 0, 0, 1, 0]
    assert a.statistics().allocations == 2  # an allocation by count and one by name


def test_taking_named_pages_of_a_fresh_allocator_leaves_the_rest_allocatable() -> None:
    # take_pages removes a named page from the middle of the free stack: every other
    # page is still handed out exactly once, the lowest first
    for named in ([0], [7], [3, 5], [7, 0, 4]):
        a = PageAllocator(32, 4)
        a.take_pages(named)
        rest = a.try_alloc_pages(8 - len(named))
        assert rest is not None and sorted(rest) == sorted(set(range(8)) - set(named)), named
        assert a.try_alloc_pages(1) is None
        stats = a.statistics()
        assert (stats.used_slots, stats.peak_used_slots, stats.allocations) == (32, 32, 2)


def test_statistics_and_repr() -> None:
    a = PageAllocator(32, 4, name="kv")
    assert repr(a) == "<PageAllocator 'kv' [pages: 0 used, 8 free | page_size=4]>"
    a.try_alloc_pages(3)
    a.try_alloc_pages(2)
    a.free_pages([0, 1, 2])
    s = a.statistics()
    assert (s.page_size, s.capacity_slots, s.used_slots, s.free_slots) == (4, 32, 8, 24)
    assert (s.peak_used_slots, s.allocations, s.frees) == (20, 2, 1)
    assert repr(a) == "<PageAllocator 'kv' [pages: 2 used, 6 free | page_size=4]>"
    assert (a.capacity, a.num_pages, a.page_size) == (32, 8, 4)


# -- page_numbers ------------------------------------------------------------

PS = 4
SMALL = 8  # pages: 32 indices, the Python path
LARGE = 160  # pages: 640 indices, the torch path
LIMIT = 4 * 1024
assert SMALL * PS <= _PYTHON_CHECK_LIMIT < LARGE * PS


def _pages(n: int, start: int = 0) -> list[int]:
    return [s for p in range(start, start + n) for s in range(p * PS, p * PS + PS)]


def _numbers(values: list[int], limit: int = LIMIT) -> list[int]:
    return page_numbers(torch.tensor(values, dtype=torch.int64), page_size=PS, limit=limit, pool="kv", side="source")


@pytest.fixture(params=[SMALL, LARGE], ids=["python-path", "torch-path"])
def num_pages(request: pytest.FixtureRequest) -> int:
    return request.param


def test_page_numbers_of_valid_pages(num_pages: int) -> None:
    values = _pages(num_pages, start=3)
    assert _numbers(values) == list(range(3, 3 + num_pages))
    # reorder whole pages: the page order is kept
    pages = [values[i : i + PS] for i in range(0, len(values), PS)][::-1]
    assert _numbers([s for p in pages for s in p]) == list(range(3 + num_pages - 1, 2, -1))


def test_page_numbers_empty() -> None:
    with pytest.raises(
        InvalidIndices, match=r"^pool 'kv' got no source indices; an operation moves at least one page$"
    ) as info:
        _numbers([])
    assert (info.value.rule, info.value.pool) == ("non-empty", "kv")


def test_page_numbers_not_whole_pages(num_pages: int) -> None:
    values = _pages(num_pages, start=2)[:-1]
    n = len(values)
    with pytest.raises(
        InvalidIndices,
        match=rf"^pool 'kv' needs whole pages of 4 slots starting on a page boundary; "
        rf"got {n} source indices starting at 8$",
    ) as info:
        _numbers(values)
    assert (info.value.rule, info.value.pool) == ("whole-pages", "kv")


def test_page_numbers_misaligned_page(num_pages: int) -> None:
    values = _pages(num_pages)
    k = num_pages - 2  # a late page, shifted by one slot
    values[k * PS : (k + 1) * PS] = [v + 1 for v in values[k * PS : (k + 1) * PS]]
    with pytest.raises(
        InvalidIndices,
        match=rf"^pool 'kv' needs whole pages of 4 slots starting on a page boundary; "
        rf"got {len(values)} source indices with a page at position {k * PS} starting at {k * PS + 1}$",
    ) as info:
        _numbers(values)
    assert (info.value.rule, info.value.pool) == ("page-aligned", "kv")


def test_page_numbers_non_consecutive_within_page(num_pages: int) -> None:
    values = _pages(num_pages)
    k = num_pages // 2
    values[k * PS + 2], values[k * PS + 3] = values[k * PS + 3], values[k * PS + 2]
    with pytest.raises(
        InvalidIndices,
        match=rf"page at position {k * PS} starting at {k * PS}$",
    ) as info:
        _numbers(values)
    assert (info.value.rule, info.value.pool) == ("page-aligned", "kv")


def test_page_numbers_gap_within_page(num_pages: int) -> None:
    values = _pages(num_pages)
    values[PS + 1] = values[PS + 1] + 100  # page 1: 4, 105, 6, 7
    with pytest.raises(InvalidIndices, match=rf"page at position {PS} starting at {PS}$") as info:
        _numbers(values)
    assert info.value.rule == "page-aligned"


def test_page_numbers_negative_page(num_pages: int) -> None:
    values = _pages(num_pages, start=1)
    values[PS : 2 * PS] = [-8, -7, -6, -5]  # an aligned page, below zero
    with pytest.raises(
        InvalidIndices, match=r"^pool 'kv' has 4096 source slots \(0\.\.4095\); got index -8$"
    ) as info:
        _numbers(values)
    assert (info.value.rule, info.value.pool) == ("in-range", "kv")


def test_page_numbers_page_at_limit(num_pages: int) -> None:
    limit = (num_pages + 1) * PS
    values = _pages(num_pages)
    values[:PS] = list(range(limit, limit + PS))  # first page is the one past the end
    with pytest.raises(
        InvalidIndices,
        match=rf"^pool 'kv' has {limit} source slots \(0\.\.{limit - 1}\); got index {limit + PS - 1}$",
    ) as info:
        _numbers(values, limit=limit)
    assert (info.value.rule, info.value.pool) == ("in-range", "kv")
    # the last page below the limit is fine
    assert _numbers(_pages(num_pages, start=1), limit=limit)[-1] == num_pages


def test_page_numbers_limit_not_a_page_multiple() -> None:
    """A device pool may have a partial last page; naming it is out of range."""
    with pytest.raises(InvalidIndices, match=r"has 10 source slots \(0\.\.9\); got index 11$") as info:
        _numbers([8, 9, 10, 11], limit=10)
    assert info.value.rule == "in-range"


def test_page_numbers_duplicate_page(num_pages: int) -> None:
    values = _pages(num_pages)
    values[-PS:] = list(range(3 * PS, 4 * PS))  # last page repeats page 3
    with pytest.raises(
        InvalidIndices,
        match=r"^pool 'kv' source indices repeat page 3 \(slots 12\.\.15\); each page may appear once per operation$",
    ) as info:
        _numbers(values)
    assert (info.value.rule, info.value.pool) == ("unique-pages", "kv")


def test_page_numbers_page_size_one() -> None:
    idx = torch.tensor([5, 0, 3], dtype=torch.int64)
    assert page_numbers(idx, page_size=1, limit=6, pool="p", side="s") == [5, 0, 3]
    with pytest.raises(InvalidIndices, match=r"repeat page 3 \(slots 3\.\.3\)"):
        page_numbers(torch.tensor([3, 1, 3]), page_size=1, limit=6, pool="p", side="s")
    big = torch.arange(600, dtype=torch.int64).flip(0)
    assert page_numbers(big, page_size=1, limit=600, pool="p", side="s") == list(range(599, -1, -1))


# -- as_index_tensor ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_as_index_tensor_rejects_float_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(
        InvalidIndices, match=rf"^pool 'kv' device indices must be an integer tensor; got dtype {re.escape(str(dtype))}$"
    ) as info:
        as_index_tensor(torch.zeros(4, dtype=dtype), pool="kv", side="device")
    assert (info.value.rule, info.value.pool) == ("integer-dtype", "kv")


def test_as_index_tensor_rejects_bool_dtype() -> None:
    with pytest.raises(InvalidIndices, match=r"got dtype torch\.bool$") as info:
        as_index_tensor(torch.ones(4, dtype=torch.bool), pool="kv", side="host")
    assert info.value.rule == "integer-dtype"


@pytest.mark.parametrize("shape", [(2, 4), (), (1, 1, 4)])
def test_as_index_tensor_rejects_other_ranks(shape: tuple[int, ...]) -> None:
    with pytest.raises(
        InvalidIndices,
        match=rf"^pool 'kv' host indices must be one-dimensional; got shape {re.escape(str(shape))}$",
    ) as info:
        as_index_tensor(torch.zeros(shape, dtype=torch.int64), pool="kv", side="host")
    assert (info.value.rule, info.value.pool) == ("one-dimensional", "kv")


def test_as_index_tensor_rejects_non_cpu_tensor() -> None:
    with pytest.raises(InvalidIndices, match=r"must be a CPU tensor; got device meta$") as info:
        as_index_tensor(torch.zeros(4, dtype=torch.int64, device="meta"), pool="kv", side="host")
    assert info.value.rule == "cpu-indices"


@pytest.mark.parametrize("value", [[4, 5, 6, 7], (0, 1), range(8, 12)])
def test_as_index_tensor_accepts_int_sequences(value: object) -> None:
    t = as_index_tensor(value, pool="kv", side="host")  # type: ignore[arg-type]
    assert t.dtype == torch.int64
    assert t.dim() == 1
    assert t.tolist() == list(value)  # type: ignore[call-overload]


@pytest.mark.parametrize("value", [[4, 5.0, 6, 7], [0, True], [1, "2"]])
def test_as_index_tensor_rejects_sequences_with_non_ints(value: list[object]) -> None:
    with pytest.raises(InvalidIndices, match=r"^pool 'kv' host indices must be ints; got ") as info:
        as_index_tensor(value, pool="kv", side="host")  # type: ignore[arg-type]
    assert (info.value.rule, info.value.pool) == ("integer-dtype", "kv")


@pytest.mark.parametrize("value", ["0123", b"\x00\x01", 5, {1, 2}])
def test_as_index_tensor_rejects_non_sequences(value: object) -> None:
    with pytest.raises(InvalidIndices, match=r"must be an integer tensor or a sequence of ints; got ") as info:
        as_index_tensor(value, pool="kv", side="host")  # type: ignore[arg-type]
    assert info.value.rule == "integer-dtype"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_as_index_tensor_converts_narrow_ints_to_int64(dtype: torch.dtype) -> None:
    t = as_index_tensor(torch.tensor([0, 1, 2, 3], dtype=dtype), pool="kv", side="host")
    assert t.dtype == torch.int64
    assert t.tolist() == [0, 1, 2, 3]


def test_as_index_tensor_keeps_int64_tensor() -> None:
    src = torch.tensor([4, 5, 6, 7], dtype=torch.int64)
    assert as_index_tensor(src, pool="kv", side="host") is src


# -- page_numbers . slots_of_pages round trip --------------------------------


@st.composite
def page_sets(draw: st.DrawFn) -> tuple[list[int], int, int]:
    page_size = draw(st.sampled_from([1, 4, 16]))
    boundary = _PYTHON_CHECK_LIMIT // page_size  # pages that still take the Python path
    large = draw(st.booleans())
    n = draw(st.integers(boundary + 1, boundary + 48) if large else st.integers(1, boundary))
    extra = draw(st.integers(0, 64))
    rnd = draw(st.randoms(use_true_random=False))
    pages = rnd.sample(range(n + extra), n)  # distinct, shuffled
    return pages, page_size, (n + extra) * page_size


@settings(max_examples=60, deadline=None)
@given(page_sets())
def test_page_numbers_inverts_slots_of_pages(case: tuple[list[int], int, int]) -> None:
    pages, page_size, limit = case
    slots = slots_of_pages(pages, page_size)
    assert slots.dtype == torch.int64
    assert slots.numel() == len(pages) * page_size
    assert slots[::page_size].tolist() == [p * page_size for p in pages]
    assert page_numbers(slots, page_size=page_size, limit=limit, pool="kv", side="host") == pages


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_round_trip_covers_both_paths(page_size: int) -> None:
    for n in (_PYTHON_CHECK_LIMIT // page_size, _PYTHON_CHECK_LIMIT // page_size + 1):
        pages = list(range(n))[::-1]
        slots = slots_of_pages(pages, page_size)
        assert page_numbers(slots, page_size=page_size, limit=n * page_size, pool="kv", side="h") == pages


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda a: a.take_pages([True]), r"page numbers are ints; got True \(bool\)"),
        (lambda a: a.take_pages([1.0]), r"page numbers are ints; got 1.0 \(float\)"),
        (lambda a: a.take_pages(3), r"takes a sequence of page numbers \(ints\); got int"),
        (lambda a: a.take_pages(torch.tensor([1])), r"takes a sequence of page numbers \(ints\); got Tensor"),
        (lambda a: a.free_pages([False]), r"page numbers are ints; got False \(bool\)"),
        (lambda a: a.try_alloc_pages(True), r"needs an int page count; got True \(bool\)"),
        (lambda a: a.try_alloc_pages(1.0), r"needs an int page count; got 1.0 \(float\)"),
        (lambda a: a.try_alloc(8.0), r"needs an int slot count; got 8.0 \(float\)"),
        (lambda a: a.try_alloc(True), r"needs an int slot count; got True \(bool\)"),
    ],
)
def test_bools_and_floats_are_refused_and_nothing_is_taken(call: Any, match: str) -> None:
    """take_pages([True]) took page 1 and try_alloc_pages(True) a page; floats
    failed deep inside. Now each is refused naming the value and the rule."""
    a = PageAllocator(64, 8, name="kv")
    a.take_pages([0])
    before = a.statistics()
    with pytest.raises(InvalidIndices, match=match) as err:
        call(a)
    assert err.value.rule in ("page-numbers", "integer-count") and err.value.pool == "kv"
    assert a.statistics() == before and not a.is_taken(1)


class _Page(int):
    """An int subclass (an ``IntEnum``'s members are ones): a page number as any int is."""


def test_pages_named_in_any_sequence_of_ints_are_taken_and_freed_as_a_list_is() -> None:
    # the pages are a Sequence[int]: a tuple or a range as a list, an int subclass as an int
    a = PageAllocator(32, 4, name="kv")
    a.take_pages((1, 2))
    a.take_pages(range(5, 7))
    a.check_takeable((0, _Page(3)))
    a.take_pages([_Page(7)])
    assert a.taken_np.tolist() == [0, 1, 1, 0, 0, 1, 1, 1]
    a.free_pages((2, 1))
    a.free_pages(range(5, 7))
    a.free_pages([_Page(7)])
    assert a.taken_np.tolist() == [0] * 8
    stats = a.statistics()
    assert (stats.used_slots, stats.peak_used_slots, stats.allocations, stats.frees) == (0, 20, 3, 3)
    got = a.try_alloc_pages(8)
    assert got is not None and sorted(got) == list(range(8))  # every page once
