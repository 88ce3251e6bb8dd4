"""kvtier.pools.indices: what becomes an int64 index tensor, what is refused, page numbers' edges,
slots of pages and the request lists of bulk calls."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

import kvtier.pools.indices as indices_module
from kvtier.errors import InvalidIndices
from kvtier.pools import PageList, as_index_tensor, as_request_list, as_slot_tensor, page_numbers, slots_of_pages

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


@pytest.mark.parametrize(
    ("values", "bad", "position"),
    [
        ([2**63], 2**63, 0),
        ([-(2**63) - 1], -(2**63) - 1, 0),
        ([2**70], 2**70, 0),
        ([0, 8, 2**64, 16], 2**64, 2),
        ([0, -(2**80), 3], -(2**80), 1),
    ],
)
def test_list_values_past_int64_are_refused_naming_the_value(values: list[int], bad: int, position: int) -> None:
    with pytest.raises(InvalidIndices, match=rf"got {bad} at position {position}") as info:
        as_index_tensor(values, pool="kv", side="host")
    err = info.value
    assert err.pool == "kv" and err.rule == "int64-range"
    assert str(err).startswith(f"pool 'kv' host indices must fit in int64 ({INT64_MIN}..{INT64_MAX})")


def test_list_values_at_the_int64_limits_are_kept_exactly() -> None:
    t = as_index_tensor([INT64_MIN, 0, INT64_MAX], pool="kv", side="device")
    assert t.dtype == torch.int64 and t.tolist() == [INT64_MIN, 0, INT64_MAX]


@pytest.mark.parametrize(
    ("values", "bad", "position"),
    [([2**63], 2**63, 0), ([0, 8, 2**64 - 1], 2**64 - 1, 2), ([1, 2**63 + 5, 2**63], 2**63 + 5, 1)],
)
def test_uint64_values_from_2_63_are_refused_not_wrapped(values: list[int], bad: int, position: int) -> None:
    t = torch.tensor(values, dtype=torch.uint64)
    with pytest.raises(InvalidIndices, match=rf"pool 'swa' device indices must fit in int64 .*got {bad} at position {position}") as info:
        as_index_tensor(t, pool="swa", side="device")
    assert info.value.pool == "swa" and info.value.rule == "int64-range"
    # A strided view is checked as well as a contiguous tensor.
    strided = torch.tensor([v for v in values for _ in range(2)], dtype=torch.uint64)[::2]
    with pytest.raises(InvalidIndices, match=rf"got {bad} at position {position}"):
        as_index_tensor(strided, pool="swa", side="device")


def test_uint64_values_below_2_63_convert_exactly() -> None:
    values = [0, 7, INT64_MAX]
    t = as_index_tensor(torch.tensor(values, dtype=torch.uint64), pool="kv", side="host")
    assert t.dtype == torch.int64 and t.tolist() == values


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8, torch.uint16, torch.uint32])
def test_narrower_integer_dtypes_convert_exactly_at_their_limits(dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    values = [info.min, 0, info.max]
    t = as_index_tensor(torch.tensor(values, dtype=dtype), pool="kv", side="host")
    assert t.dtype == torch.int64 and t.tolist() == values


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # creating a qint8 tensor warns
@pytest.mark.parametrize(
    "dtype", [torch.uint1, torch.uint4, torch.uint7, torch.int4, torch.bits8, torch.qint8, torch.float8_e4m3fn]
)
def test_integer_like_dtypes_without_a_conversion_are_refused_by_dtype(dtype: torch.dtype) -> None:
    t = torch.empty(4, dtype=dtype)
    with pytest.raises(InvalidIndices, match=rf"pool 'kv' host indices must be an integer tensor; got dtype {dtype}") as info:
        as_index_tensor(t, pool="kv", side="host")
    assert info.value.rule == "integer-dtype"


def test_int64_tensor_is_returned_as_is() -> None:
    t = torch.arange(16)
    assert as_index_tensor(t, pool="kv", side="host") is t


def test_int_subclasses_pass_and_bools_do_not() -> None:
    class Slot(int):
        pass

    assert as_index_tensor([Slot(3), 4], pool="kv", side="host").tolist() == [3, 4]
    with pytest.raises(InvalidIndices, match=r"pool 'kv' host indices must be ints; got \[0, True\]"):
        as_index_tensor([0, True], pool="kv", side="host")
    assert as_index_tensor([], pool="kv", side="host").tolist() == []


def test_an_empty_list_becomes_an_empty_int64_tensor() -> None:
    t = as_index_tensor([], pool="kv", side="host")
    assert t.dtype == torch.int64 and t.shape == (0,)


def test_a_list_past_int64_at_both_ends_names_the_first_bad_value() -> None:
    # INT64_MIN itself is in range: the value named is the one past INT64_MAX
    with pytest.raises(InvalidIndices) as info:
        as_index_tensor([INT64_MIN, 2**63], pool="kv", side="host")
    assert str(info.value).endswith(f"got {2**63} at position 1")


def test_non_int_values_are_named_by_the_first_eight() -> None:
    values: list[object] = [0, 1, 2, 3, 4, 5, 6, 7, "8", 9]
    with pytest.raises(InvalidIndices) as info:
        as_index_tensor(values, pool="kv", side="host")  # type: ignore[arg-type]
    assert str(info.value) == "pool 'kv' host indices must be ints; got [0, 1, 2, 3, 4, 5, 6, 7]"
    assert (info.value.pool, info.value.rule) == ("kv", "integer-dtype")


@pytest.mark.parametrize("value", [{0: 1}, 3, None])
def test_what_is_not_a_sequence_is_named_by_its_type(value: object) -> None:
    with pytest.raises(InvalidIndices) as info:
        as_index_tensor(value, pool="kv", side="device")  # type: ignore[arg-type]
    assert str(info.value) == (
        f"pool 'kv' device indices must be an integer tensor or a sequence of ints; got {type(value).__name__}"
    )
    assert (info.value.pool, info.value.rule) == ("kv", "integer-dtype")


def test_a_sparse_index_tensor_is_refused_by_layout() -> None:
    # a sparse int64 vector is one-dimensional and on the CPU, but its values are not
    # where a strided tensor's are: refused before anything reads it
    sparse = torch.tensor([0, 1, 2, 3]).to_sparse()
    assert sparse.dtype == torch.int64 and sparse.dim() == 1
    with pytest.raises(InvalidIndices) as info:
        as_index_tensor(sparse, pool="kv", side="host")
    assert str(info.value) == ("pool 'kv' host indices must be a dense (strided) tensor; got layout torch.sparse_coo "
                               "(make it dense with .to_dense())")
    assert (info.value.pool, info.value.rule) == ("kv", "strided-indices")


# -- page_numbers at its edges -------------------------------------------------------------


def test_a_slot_at_the_limit_is_out_of_range_and_named() -> None:
    for page_size, indices in ((1, [0, 8]), (4, [0, 1, 2, 3, 8, 9, 10, 11])):
        with pytest.raises(InvalidIndices) as info:
            page_numbers(torch.tensor(indices), page_size=page_size, limit=8, pool="kv", side="host")
        assert str(info.value) == f"pool 'kv' has 8 host slots (0..7); got index {indices[-1] if page_size == 1 else 11}"
        assert info.value.rule == "in-range"
    # a limit that is not whole pages: a page running past it is refused, its last slot named
    with pytest.raises(InvalidIndices, match=r"^pool 'kv' has 11 host slots \(0\.\.10\); got index 11$"):
        page_numbers(torch.tensor([8, 9, 10, 11]), page_size=4, limit=11, pool="kv", side="host")


def test_pages_of_two_slots_are_checked_and_numbered() -> None:
    assert page_numbers(torch.tensor([6, 7, 2, 3]), page_size=2, limit=8, pool="kv", side="host") == [3, 1]
    for bad in ([1, 2], [2, 4]):  # off a boundary; not consecutive
        with pytest.raises(InvalidIndices) as info:
            page_numbers(torch.tensor(bad), page_size=2, limit=8, pool="kv", side="host")
        assert info.value.rule == "page-aligned"
        assert str(info.value) == ("pool 'kv' needs whole pages of 2 slots starting on a page boundary; "
                                   f"got 2 host indices with a page at position 0 starting at {bad[0]}")


@pytest.mark.parametrize("page_size", [2, 4])
def test_the_vectorised_check_works_from_a_cold_cache(monkeypatch: pytest.MonkeyPatch, page_size: int) -> None:
    # above _PYTHON_CHECK_LIMIT indices the check runs in torch against a cached arange;
    # the first call for a page size (nothing cached yet) checks as well as later ones
    monkeypatch.setattr(indices_module, "_ARANGE_CACHE", {})
    num_pages = 800 // page_size
    good = slots_of_pages(list(range(num_pages)), page_size)
    bad = good.clone()
    bad[401], bad[400 + page_size] = bad[400 + page_size].item(), bad[401].item()  # page 400/ps not consecutive
    for _ in range(2):
        with pytest.raises(InvalidIndices) as info:
            page_numbers(bad, page_size=page_size, limit=800, pool="kv", side="host")
        assert info.value.rule == "page-aligned"
        assert str(info.value).endswith("with a page at position 400 starting at 400")
        assert page_numbers(good, page_size=page_size, limit=800, pool="kv", side="host") == list(range(num_pages))


# -- the pages a scheduler keeps as numbers ----------------------------------------------------


def test_a_page_list_counts_slots_and_makes_them_in_order() -> None:
    pages = PageList([5, 2], page_size=4)
    assert len(pages) == 8
    assert pages.slots().tolist() == [20, 21, 22, 23, 8, 9, 10, 11]
    assert as_slot_tensor(pages).tolist() == [20, 21, 22, 23, 8, 9, 10, 11]
    t = torch.arange(4)
    assert as_slot_tensor(t) is t


@pytest.mark.parametrize(
    ("pages", "page_size", "slots"),
    [([], 4, []), ([3], 1, [3]), ([0, 1, 2], 2, [0, 1, 2, 3, 4, 5]), ([2, 3, 4], 2, [4, 5, 6, 7, 8, 9]),
     ([4, 2, 3], 2, [8, 9, 4, 5, 6, 7]), ([1, 3], 2, [2, 3, 6, 7]), ([2, 1, 0], 1, [2, 1, 0]), ([0, 2, 1], 3,
     [0, 1, 2, 6, 7, 8, 3, 4, 5]), ([5, 6, 8], 1, [5, 6, 8])],
)
def test_slots_of_pages_are_each_page_s_slots_in_the_pages_order(
    pages: list[int], page_size: int, slots: list[int]
) -> None:
    out = slots_of_pages(pages, page_size)
    assert out.dtype == torch.int64 and out.tolist() == slots



@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    ("pages", "firsts"),
    [((), []), (range(0), []), ((3, 4), [3, 4]), (range(2, 5), [2, 3, 4]), ((5, 1), [5, 1])],
    ids=["empty tuple", "empty range", "tuple run", "range", "tuple"],
)
def test_slots_of_pages_of_any_sequence_of_ints_are_int64(pages: Sequence[int], firsts: list[int], page_size: int) -> None:
    # not only lists: a tuple or a range (empty ones too: numpy would make those float64) gives int64 slots
    out = slots_of_pages(pages, page_size)
    assert out.dtype == torch.int64
    assert out.tolist() == [f * page_size + i for f in firsts for i in range(page_size)]


# -- the request lists of bulk calls ------------------------------------------------------------


def test_a_request_list_is_a_list_of_mappings_in_order() -> None:
    a, b = {"kv": [0]}, {"kv": [1]}
    assert as_request_list([a, b], call="backup_many") == [a, b]
    assert as_request_list((a, b), call="backup_many") == [a, b]
    assert as_request_list([], call="backup_many") == []
    assert as_request_list([a, None], call="load_many", nones=True) == [a, None]


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ({"kv": [0]}, "backup_many takes a list of requests, one mapping of pool name to indices per request; "
                      "got one dict (wrap it in a list, or use the single-request call)"),
        ({frozenset({1})}, "backup_many takes a list of requests in order (one handle per request, in the same "
                           "order); got set"),
        ("kv", "backup_many takes a list of requests in order (one handle per request, in the same order); got str"),
        (7, "backup_many takes a list of requests in order (one handle per request, in the same order); got int"),
        ([{"kv": [0]}, [0]], "backup_many requests 1 must be a mapping of pool name to indices; got list"),
        ([{"kv": [0]}, None], "backup_many requests 1 must be a mapping of pool name to indices; got NoneType"),
    ],
)
def test_a_request_list_refusal_names_the_call_and_what_is_wrong(requests: object, message: str) -> None:
    with pytest.raises(InvalidIndices) as info:
        as_request_list(requests, call="backup_many")
    assert (str(info.value), info.value.rule) == (message, "request-list")


def test_a_request_list_with_nones_says_so_in_its_refusal() -> None:
    with pytest.raises(InvalidIndices) as info:
        as_request_list([None, "kv"], call="load_many", what="device index mappings", nones=True)
    assert str(info.value) == "load_many device index mappings 1 must be a mapping of pool name to indices or None; got str"
    assert info.value.rule == "request-list"


def test_indices_on_another_device_are_refused_naming_the_pool_and_the_device() -> None:
    on_meta = torch.zeros(4, dtype=torch.int64, device="meta")  # any device that is not the CPU
    with pytest.raises(InvalidIndices) as info:
        as_index_tensor(on_meta, pool="kv", side="host")
    assert str(info.value) == "pool 'kv' host indices must be a CPU tensor; got device meta"
    assert (info.value.pool, info.value.rule) == ("kv", "cpu-indices")
