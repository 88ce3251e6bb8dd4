"""`kvtier.scheduler.arrays`, the parse of a bulk call's index arrays, as its
callers see it: the page numbers and page offsets it returns (exact, and
kvtier's own copy), and every refusal an `InvalidIndices` naming the pool, the
rule and the value, made before anything is returned. The scheduler's bulk
calls (`backup_arrays`, `load_arrays`) reach it through `parse.py`; these tests
call it directly, with a ``check_one`` that records which request the bulk
check handed to the single call's check."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from conftest import used, wait_until

from kvtier import SchedulerConfig, TransferScheduler
from kvtier.errors import InvalidIndices, NotFinished
from kvtier.scheduler import BulkResult
from kvtier.scheduler.arrays import as_int64_array, parse_pools, parse_valid_rows
from kvtier.testing import FaultInjectingExecutor, full_attention_group, hybrid_group


class Refused(Exception):
    """What the test's ``check_one`` raises: the request and slots it was given."""

    def __init__(self, i: int, pool: str, slots: np.ndarray) -> None:
        super().__init__(i, pool)
        self.i, self.pool, self.slots = i, pool, slots.tolist()


def refuse(i: int, pool: str, slots: np.ndarray) -> None:
    raise Refused(i, pool, slots)


def parse(indices: Any, offsets: Any = None, *, size: int = 4, limit: int = 64, count: int | None = None,
          check_one: Any = refuse) -> tuple[dict[str, tuple[list[int], list[int]]], int]:
    names = list(indices) if isinstance(indices, dict) else []
    out, n = parse_pools(indices, offsets, page_sizes={k: size for k in names}, limits={k: limit for k in names},
                         check_one=check_one, count=count)
    return {k: (p.tolist(), o.tolist()) for k, (p, o) in out.items()}, n


def refused(rule: str, *words: str, pool: str | None = None) -> Any:
    """A context that expects `InvalidIndices` with ``rule`` and every word in
    its message (and, given ``pool``, naming that pool)."""

    class _Ctx:
        def __enter__(self) -> None:
            return None

        def __exit__(self, tp: Any, exc: Any, tb: Any) -> bool:
            assert isinstance(exc, InvalidIndices), f"expected InvalidIndices, got {exc!r}"
            assert exc.rule == rule, (exc.rule, str(exc))
            for w in words:
                assert w in str(exc), (w, str(exc))
            if pool is not None:
                assert exc.pool == pool, (exc.pool, str(exc))
            return True

    return _Ctx()


# -- as_int64_array ------------------------------------------------------------------------------


def test_an_int64_array_is_taken_as_it_is_and_other_integers_become_int64() -> None:
    a = np.arange(5, dtype=np.int64)
    assert as_int64_array(a, what="x") is a  # a view where it is one already: no copy
    for dtype in (np.int8, np.int32, np.uint16, np.uint64):
        got = as_int64_array(np.array([0, 3, 7], dtype=dtype), what="x")
        assert got.dtype == np.int64 and got.tolist() == [0, 3, 7]
    t = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    got = as_int64_array(t, what="x")
    assert got.dtype == np.int64 and got.tolist() == [[1, 2], [3, 4]]
    assert as_int64_array([5, 6], what="x").tolist() == [5, 6]
    empty = as_int64_array([], what="x")
    assert empty.dtype == np.int64 and empty.shape == (0,)
    assert as_int64_array((), what="x").dtype == np.int64
    big = np.array([2**63 - 1], dtype=np.uint64)  # the largest that fits
    assert as_int64_array(big, what="x").tolist() == [2**63 - 1]
    assert as_int64_array(np.array([], dtype=np.uint64), what="x").dtype == np.int64


@pytest.mark.parametrize(
    ("value", "rule", "words"),
    [
        pytest.param(torch.zeros(3, dtype=torch.float32), "integer-dtype",
                     ("offsets['kv'] must hold integers", "torch.float32"), id="float-tensor"),
        pytest.param(torch.zeros(3, dtype=torch.complex64), "integer-dtype",
                     ("must hold integers", "torch.complex64"), id="complex-tensor"),
        pytest.param(torch.zeros(3, dtype=torch.bool), "integer-dtype",
                     ("must hold integers", "torch.bool"), id="bool-tensor"),
        pytest.param(torch.zeros(3, dtype=torch.int64, device="meta"), "cpu-indices",
         ("offsets['kv'] must be a dense CPU tensor", "on meta", "torch.strided"), id="meta-tensor"),
        pytest.param(torch.zeros(3, dtype=torch.int64).to_sparse(), "cpu-indices",
                     ("dense CPU tensor", "torch.sparse_coo"), id="sparse-tensor"),
        pytest.param(np.zeros(3, dtype=np.float64), "integer-dtype",
                     ("offsets['kv'] must hold integers", "float64"), id="float-array"),
        pytest.param(np.zeros(3, dtype=bool), "integer-dtype", ("must hold integers", "bool"), id="bool-array"),
        pytest.param([0.5, 1.5], "integer-dtype", ("must hold integers", "float64"), id="float-list"),
        pytest.param("0123", "integer-dtype", ("offsets['kv'] must be an integer array", "got str"), id="str"),
        pytest.param(b"\x00\x01", "integer-dtype", ("must be an integer array", "got bytes"), id="bytes"),
        pytest.param({0: 1}, "integer-dtype", ("must be an integer array", "got dict"), id="dict"),
        pytest.param(7, "integer-dtype", ("must be an integer array", "got int"), id="int"),
        pytest.param(None, "integer-dtype", ("must be an integer array", "got NoneType"), id="none"),
        pytest.param(np.array([1, 2**63], dtype=np.uint64), "int64-range",
                     ("offsets['kv'] must fit in int64", str(2**63)), id="uint64-past-int64"),
        pytest.param(torch.tensor([2**63 + 5], dtype=torch.uint64), "int64-range",
                     ("must fit in int64", str(2**63 + 5)), id="uint64-tensor-past-int64"),
    ],
)
def test_what_is_not_an_integer_array_is_refused_naming_its_type(value: Any, rule: str, words: tuple[str, ...]) -> None:
    with refused(rule, *words):
        as_int64_array(value, what="offsets['kv']", pool="kv")
    try:
        as_int64_array(value, what="offsets['kv']", pool="kv")
    except InvalidIndices as exc:
        assert exc.pool == "kv"


def test_a_tensor_numpy_cannot_read_is_refused_as_not_integers() -> None:
    with warnings.catch_warnings():  # quantized tensors are deprecated; numpy cannot read them either way
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8)
    with refused("integer-dtype", "pool 'kv' indices must hold integers numpy can read", "torch.qint8"):
        as_int64_array(q, what="pool 'kv' indices", pool="kv")
    with pytest.raises(InvalidIndices) as info:
        as_int64_array(q, what="x", pool="kv")
    assert info.value.pool == "kv" and isinstance(info.value.__cause__, TypeError)


# -- parse_pools: page numbers and offsets --------------------------------------------------------


def test_flat_and_2d_indices_give_page_numbers_and_page_offsets() -> None:
    # Request 0: pages 2, 3; request 1: none of kv; request 2: page 5 (slots of 4-row pages).
    kv = np.concatenate([np.arange(8, 16), np.arange(20, 24)])
    state = np.array([[1], [0], [4]])  # one slot a page, a 2-D array: one row per request
    out, n = parse_pools({"kv": kv, "state": state}, {"kv": np.array([0, 8, 8, 12])},
                         page_sizes={"kv": 4, "state": 1}, limits={"kv": 64, "state": 8}, check_one=refuse)
    assert n == 3
    assert out["kv"][0].tolist() == [2, 3, 5] and out["kv"][1].tolist() == [0, 2, 2, 3]
    assert out["state"][0].tolist() == [1, 0, 4] and out["state"][1].tolist() == [0, 1, 2, 3]
    assert out["kv"][0].dtype == np.int64 and out["state"][1].dtype == np.int64
    # A 2-D array of several slots a request.
    got, n = parse({"kv": np.arange(16).reshape(2, 8)})
    assert n == 2 and got == {"kv": ([0, 1, 2, 3], [0, 2, 4])}
    # The count a caller gives is the one it must be.
    got, n = parse({"kv": np.arange(8)}, {"kv": [0, 4, 8]}, count=2)
    assert n == 2 and got == {"kv": ([0, 1], [0, 1, 2])}


def test_returned_pages_are_kvtiers_own_copy_of_the_callers_array() -> None:
    flat = np.array([3, 1, 2], dtype=np.int64)
    out, _ = parse_pools({"state": flat}, {"state": np.array([0, 1, 3])}, page_sizes={"state": 1},
                         limits={"state": 8}, check_one=refuse)
    flat[:] = 7  # the engine reuses its buffer once the call returned
    assert out["state"][0].tolist() == [3, 1, 2]
    two_d = np.array([[8, 9, 10, 11]], dtype=np.int64)
    out, _ = parse_pools({"kv": two_d}, None, page_sizes={"kv": 4}, limits={"kv": 64}, check_one=refuse)
    two_d[:] = 0
    assert out["kv"][0].tolist() == [2]


def test_no_requests_and_empty_pools_parse_to_nothing() -> None:
    got, n = parse({"kv": np.empty((0, 4), dtype=np.int64)})
    assert n == 0 and got == {"kv": ([], [0])}
    # An empty flat pool beside a pool that names every request: page offsets of zeros.
    out, n = parse_pools({"kv": np.arange(8), "state": np.empty(0, dtype=np.int64)},
                         {"kv": [0, 4, 8], "state": [0, 0, 0]}, page_sizes={"kv": 4, "state": 1},
                         limits={"kv": 64, "state": 8}, check_one=refuse)
    assert n == 2 and out["state"][0].tolist() == [] and out["state"][1].tolist() == [0, 0, 0]
    assert out["state"][0].dtype == np.int64
    out, _ = parse_pools({"kv": np.arange(8), "c": np.empty(0, dtype=np.int64)},
                         {"kv": [0, 4, 8], "c": [0, 0, 0]}, page_sizes={"kv": 4, "c": 4},
                         limits={"kv": 64, "c": 64}, check_one=refuse)
    assert out["c"][1].tolist() == [0, 0, 0] and out["c"][1].dtype == np.int64  # page offsets: integers


def test_a_page_named_by_two_requests_is_accepted_and_twice_in_one_is_not() -> None:
    got, n = parse({"kv": np.concatenate([np.arange(4), np.arange(4)])}, {"kv": [0, 4, 8]})
    assert n == 2 and got == {"kv": ([0, 0], [0, 1, 2])}
    got, _ = parse({"s": np.array([3, 3, 5])}, {"s": [0, 1, 2, 3]}, size=1)
    assert got == {"s": ([3, 3, 5], [0, 1, 2, 3])}
    # Request 2 names page 1 twice (requests 0 and 1 share page 0 and page 1 between them).
    kv = np.concatenate([np.arange(0, 8), np.arange(0, 8), np.arange(12, 16), np.arange(4, 8), np.arange(4, 8)])
    with pytest.raises(Refused) as info:
        parse({"kv": kv}, {"kv": [0, 8, 16, 20, 28]})
    assert info.value.i == 3 and info.value.pool == "kv" and info.value.slots == [4, 5, 6, 7, 4, 5, 6, 7]
    with pytest.raises(Refused) as info:
        parse({"s": np.array([1, 2, 6, 2, 6, 9, 9])}, {"s": [0, 2, 3, 5, 7]}, size=1, limit=16)
    assert info.value.i == 3 and info.value.slots == [9, 9]


@pytest.mark.parametrize(
    ("kv", "offsets", "bad", "slots"),
    [
        # out of range: negative, at the limit (64 slots), and only in the last request
        ([0, 1, 2, 3, -4, -3, -2, -1], [0, 4, 8], 1, [-4, -3, -2, -1]),
        ([0, 1, 2, 3, 4, 5, 6, 7, 64, 65, 66, 67], [0, 4, 8, 12], 2, [64, 65, 66, 67]),
        ([60, 61, 62, 63, 0, 1, 2, 3], [0, 4, 8], None, None),  # 63 is the last slot: fine
        # not on a page boundary, or not one page's consecutive rows
        ([0, 1, 2, 3, 5, 6, 7, 8], [0, 4, 8], 1, [5, 6, 7, 8]),
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 10], [0, 8, 12], 1, [8, 9, 11, 10]),
        ([0, 1, 2, 3, 4, 4, 6, 7], [0, 8], 0, [0, 1, 2, 3, 4, 4, 6, 7]),
        # not whole pages: request 1 has 6 slots
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 4, 10], 1, [4, 5, 6, 7, 8, 9]),
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 2, 12], 0, [0, 1]),
    ],
)
def test_the_first_request_breaking_a_rule_goes_to_the_single_check(
    kv: list[int], offsets: list[int], bad: int | None, slots: list[int] | None,
) -> None:
    if bad is None:
        got, _ = parse({"kv": np.array(kv)}, {"kv": offsets})
        assert got["kv"][0] == [15, 0]
        return
    with pytest.raises(Refused) as info:
        parse({"kv": np.array(kv)}, {"kv": offsets})
    assert (info.value.i, info.value.pool, info.value.slots) == (bad, "kv", slots)


def test_a_bulk_refusal_the_single_check_passes_is_an_error_not_a_pass() -> None:
    # check_one must raise for the request it is given: one that returns is a bug, not a pass.
    with pytest.raises(AssertionError, match="request 1's check passed"):
        parse({"kv": np.array([0, 1, 2, 3, 64, 65, 66, 67])}, {"kv": [0, 4, 8]}, check_one=lambda *a: None)


def test_one_slot_pages_are_checked_for_range_only() -> None:
    got, n = parse({"s": np.array([7, 0, 3])}, {"s": [0, 1, 3]}, size=1, limit=8)
    assert n == 2 and got == {"s": ([7, 0, 3], [0, 1, 3])}
    with pytest.raises(Refused) as info:
        parse({"s": np.array([7, 0, 8])}, {"s": [0, 1, 3]}, size=1, limit=8)
    assert (info.value.i, info.value.slots) == (1, [0, 8])


def test_two_slot_pages_are_whole_aligned_pages_like_any_other() -> None:
    # The smallest page of more than one slot: page numbers, not slots, come back.
    got, n = parse({"kv": np.array([0, 1, 6, 7, 2, 3])}, {"kv": [0, 4, 6]}, size=2, limit=8)
    assert n == 2 and got == {"kv": ([0, 3, 1], [0, 2, 3])}
    with pytest.raises(Refused) as info:  # a page's rows out of order
        parse({"kv": np.array([0, 1, 3, 2])}, {"kv": [0, 2, 4]}, size=2, limit=8)
    assert (info.value.i, info.value.slots) == (1, [3, 2])
    with pytest.raises(Refused) as info:  # not on a page boundary
        parse({"kv": np.array([1, 2])}, {"kv": [0, 2]}, size=2, limit=8)
    assert (info.value.i, info.value.slots) == (0, [1, 2])
    # Request 0 has three slots: not whole pages, though the flat array cut in
    # pairs would read as pages 0 and 1.
    with pytest.raises(Refused) as info:
        parse({"kv": np.array([0, 1, 2, 3])}, {"kv": [0, 3, 4]}, size=2, limit=8)
    assert (info.value.i, info.value.slots) == (0, [0, 1, 2])


def test_a_page_twice_is_found_in_the_request_that_repeats_it_among_many() -> None:
    """Against a reference that checks each request alone: many requests of
    few pages each (more requests than the pool has pages, so the same page
    numbers recur across requests at every distance), a repeat within a
    request refused as the first such request, pages shared between requests
    accepted and returned in order."""
    rng = np.random.default_rng(44)
    for _ in range(300):
        size = int(rng.choice([1, 2, 4]))
        n_pages = int(rng.integers(2, 7))
        count = int(rng.integers(1, 16))
        requests = [list(rng.integers(0, n_pages, size=int(rng.integers(1, 4)))) for _ in range(count)]
        if rng.random() < 0.6:  # most draws: no repeat within a request, only across them
            requests = [list(dict.fromkeys(r)) for r in requests]
        flat = np.array([p * size + k for r in requests for p in r for k in range(size)], dtype=np.int64)
        offsets = np.cumsum([0] + [len(r) * size for r in requests])
        repeats = [i for i, r in enumerate(requests) if len(set(r)) != len(r)]
        if repeats:
            with pytest.raises(Refused) as info:
                parse({"kv": flat}, {"kv": offsets}, size=size, limit=n_pages * size)
            i = repeats[0]
            assert info.value.i == i, (requests, info.value.i)
            assert info.value.slots == flat[offsets[i]:offsets[i + 1]].tolist()
        else:
            got, n = parse({"kv": flat}, {"kv": offsets}, size=size, limit=n_pages * size)
            assert n == count
            assert got["kv"] == ([int(p) for r in requests for p in r], np.cumsum([0] + [len(r) for r in requests]).tolist())


# -- parse_pools: refusals ------------------------------------------------------------------------


def test_what_is_not_a_non_empty_mapping_is_refused() -> None:
    with refused("mapping", "a bulk call takes a non-empty mapping", "[1, 2]"):
        parse([1, 2])  # type: ignore[arg-type]
    with refused("non-empty", "non-empty mapping", "{}"):
        parse({})
    with refused("offsets", "offsets must map pool names to offset arrays", "got list"):
        parse({"kv": np.arange(8)}, [0, 8])
    with refused("offsets", "offsets name pools ['c4', 'zz'] that the indices do not"):
        parse({"kv": np.arange(8)}, {"zz": [0, 8], "kv": [0, 8], "c4": [0, 8]})


def test_offsets_are_required_for_flat_arrays_and_refused_for_2d_ones() -> None:
    with refused("offsets", "pool 'kv' indices are one flat array; pass offsets['kv'] (one more than the requests: "
                 "request i has flat[offsets[i]:offsets[i + 1]]), or a 2-D [requests, slots] array", pool="kv"):
        parse({"kv": np.arange(8)})
    with refused("offsets", "pool 'kv' indices are one flat array"):
        parse({"kv": np.arange(8)}, {})
    with refused("offsets", "pool 'kv' indices are 2-D (a row per request); they take no offsets", pool="kv"):
        parse({"kv": np.arange(8).reshape(2, 4)}, {"kv": [0, 4, 8]})
    with refused("one-dimensional", "pool 'kv' indices must be 1-D (with offsets) or 2-D", "(2, 2, 2)"):
        parse({"kv": np.arange(8).reshape(2, 2, 2)})
    with refused("one-dimensional", "got shape ()"):
        parse({"kv": np.array(4)})
    try:
        parse({"kv": np.arange(8).reshape(2, 2, 2)})
    except InvalidIndices as exc:
        assert exc.pool == "kv"


@pytest.mark.parametrize(
    ("offsets", "count", "words"),
    [
        ([[0, 8]], None, ("offsets['kv'] must be one-dimensional with requests + 1 entries", "(1, 2)")),
        ([8], None, ("requests + 1 entries", "got shape (1,)")),
        ([], None, ("requests + 1 entries", "got shape (0,)")),
        ([0, 4, 8], 3, ("one-dimensional with 4 entries", "got shape (3,)")),
        ([0, 8], 2, ("with 3 entries", "(2,)")),
        ([4, 8], None, ("must start at 0, never decrease and end at the flat array's length 8", "got [4, 8] ending at 8")),
        ([0, 4], None, ("length 8", "got [0, 4] ending at 4")),
        ([0, 12], None, ("ending at 12",)),
        ([0, 6, 4, 8], None, ("never decrease", "got [0, 6, 4, 8] ending at 8")),
        ([0, 1, 2, 3, 4, 5, 6, 7, 9, 8], None, ("got [0, 1, 2, 3, 4, 5, 6, 7]... ending at 8",)),
        ([0, 1, 2, 3, 4, 6, 5, 8], None, ("got [0, 1, 2, 3, 4, 6, 5, 8] ending at 8",)),
        # nine entries: the first eight are shown, and "..." says there are more
        ([0, 1, 2, 3, 4, 5, 6, 7, 9], None, ("got [0, 1, 2, 3, 4, 5, 6, 7]... ending at 9",)),
    ],
)
def test_offsets_are_checked_in_full_and_named(offsets: list[Any], count: int | None, words: tuple[str, ...]) -> None:
    with refused("offsets", *words):
        parse({"kv": np.arange(8)}, {"kv": np.array(offsets, dtype=np.int64)}, count=count, size=1)
    if offsets == [0, 1, 2, 3, 4, 6, 5, 8]:
        assert "..." not in _message(lambda: parse({"kv": np.arange(8)}, {"kv": np.array(offsets)}, size=1))
    try:
        parse({"kv": np.arange(8)}, {"kv": np.array(offsets, dtype=np.int64)}, count=count, size=1)
    except InvalidIndices as exc:
        assert exc.pool == "kv"


def test_bad_offsets_arrays_are_refused_naming_the_pool() -> None:
    with refused("integer-dtype", "offsets['kv'] must hold integers", "float64", pool="kv"):
        parse({"kv": np.arange(8)}, {"kv": np.array([0.0, 8.0])})
    with refused("int64-range", "offsets['kv'] must fit in int64", pool="kv"):
        parse({"kv": np.arange(8)}, {"kv": np.array([0, 2**63], dtype=np.uint64)})


def test_index_arrays_that_are_not_integers_are_refused_naming_the_pool() -> None:
    with refused("integer-dtype", "pool 'kv' indices must hold integers; got dtype float64", pool="kv"):
        parse({"kv": np.zeros(8)}, {"kv": [0, 8]})
    with refused("integer-dtype", "pool 'c4' indices must be an integer array; got str", pool="c4"):
        parse({"kv": np.arange(8).reshape(2, 4), "c4": "0123"})


def _message(call: Any) -> str:
    try:
        call()
    except InvalidIndices as exc:
        return str(exc)
    raise AssertionError("not refused")


def test_every_pool_names_the_same_requests() -> None:
    with refused("equal-lengths", "pool 'b' has indices for 3 requests, another pool for 2; "
                 "every pool names each request (an empty range where it has none)", pool="b"):
        parse({"a": np.arange(8), "b": np.arange(12).reshape(3, 4)}, {"a": [0, 4, 8]})
    with refused("offsets", "offsets['b'] must be one-dimensional with 3 entries; got shape (4,)"):
        parse({"a": np.arange(8), "b": np.arange(12)}, {"a": [0, 4, 8], "b": [0, 4, 8, 12]})
    with refused("equal-lengths", "pool 'kv' has indices for 2 requests, another pool for 3"):
        parse({"kv": np.arange(8).reshape(2, 4)}, count=3)
    with pytest.raises(InvalidIndices) as info:
        parse({"a": np.arange(8), "b": np.arange(12).reshape(3, 4)}, {"a": [0, 4, 8]})
    assert info.value.pool == "b"


def test_a_request_that_names_no_pool_is_refused_by_its_place() -> None:
    with refused("non-empty", "request 1: an operation names at least one pool; got no indices"):
        parse({"a": np.arange(8), "b": np.arange(4)}, {"a": [0, 4, 4, 8], "b": [0, 0, 0, 4]})
    with refused("non-empty", "request 0:"):
        parse({"a": np.arange(4)}, {"a": [0, 0, 4]})
    # Each request names some pool, none names both: accepted.
    got, n = parse({"a": np.arange(4), "b": np.arange(4, 8)}, {"a": [0, 4, 4], "b": [0, 0, 4]})
    assert n == 2 and got == {"a": ([0], [0, 1, 1]), "b": ([1], [0, 0, 1])}


# -- parse_valid_rows -----------------------------------------------------------------------------


def test_valid_rows_are_checked_against_each_requests_rows() -> None:
    totals = {"kv": np.array([8, 4, 0]), "c4": np.array([2, 1, 0])}
    got = parse_valid_rows({"kv": [8, 1, 0]}, 3, totals)
    assert list(got) == ["kv"] and got["kv"].tolist() == [8, 1, 0] and got["kv"].dtype == np.int64
    assert parse_valid_rows({}, 3, totals) == {}
    with refused("valid-rows", "valid_rows must map pool names to arrays of row counts", "got list"):
        parse_valid_rows([1, 2], 3, totals)  # type: ignore[arg-type]
    with refused("valid-rows", "valid_rows names pool 'state'", "['c4', 'kv']"):
        parse_valid_rows({"state": [1, 1, 1]}, 3, totals)
    with refused("valid-rows", "valid_rows['kv'] needs one count per request (3); got shape (2,)"):
        parse_valid_rows({"kv": [1, 1]}, 3, totals)
    with refused("valid-rows", "(3); got shape (1, 3)"):
        parse_valid_rows({"kv": [[1, 1, 0]]}, 3, totals)
    with refused("valid-rows", "request 1: pool 'kv' has 4 rows in this request", "valid_rows['kv'][1]",
                 "must be in 0..4", "got 5"):
        parse_valid_rows({"kv": [8, 5, 0]}, 3, totals)
    with refused("valid-rows", "request 2: pool 'kv' has 0 rows", "got -1"):
        parse_valid_rows({"kv": [8, 4, -1]}, 3, totals)
    with refused("valid-rows", "request 0: pool 'c4' has 2 rows", "must be in 0..2", "got 3"):
        parse_valid_rows({"kv": [8, 4, 0], "c4": [3, -1, 0]}, 3, totals)
    with refused("integer-dtype", "valid_rows['kv'] must hold integers"):
        parse_valid_rows({"kv": [1.0, 1.0, 0.0]}, 3, totals)
    for rows, pool in (({"state": [1, 1, 1]}, "state"), ({"kv": [1, 1]}, "kv"), ({"kv": [8, 5, 0]}, "kv"),
                       ({"kv": [1.0, 1.0, 0.0]}, "kv")):
        with pytest.raises(InvalidIndices) as info:
            parse_valid_rows(rows, 3, totals)
        assert info.value.pool == pool


# -- BulkOperation and BulkResult, as an engine sees them -----------------------------------------


def _flat(requests: list[list[int]], page_size: int) -> tuple[np.ndarray, np.ndarray]:
    slots = [np.arange(p * page_size, (p + 1) * page_size) for r in requests for p in r]
    return np.concatenate(slots).astype(np.int64), np.cumsum([0] + [len(r) * page_size for r in requests])


async def test_a_bulk_operation_while_queued_and_once_ended(gate: threading.Event) -> None:
    """Before it ended: `result()` is `NotFinished` naming the call, the repr
    says running; `cancel()` of every request counts those still open (a
    second: none), `cancel(requests)` refuses what is not a request of the
    call by name, before cancelling anything; afterwards the result says
    cancelled for exactly those requests."""
    group = full_attention_group(page_size=4)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    kv, off = _flat([[i] for i in range(6)], 4)
    # one request a carrier (a batch's bytes are one page), so the requests span carriers
    config = SchedulerConfig(max_batch_ops=1, max_batch_bytes=group["kv"].slot_nbytes * 4)
    async with TransferScheduler(group, ex, config) as sched:
        try:
            first = await sched.backup_arrays({"kv": kv[:4]}, {"kv": off[:2]})  # holds the lane's runner
            await wait_until(lambda: sched.statistics().backup.batches == 1)
            bulk = await sched.backup_arrays({"kv": kv}, {"kv": off})
            assert not bulk.done() and bulk.count == 6 and bulk.kind == "backup"
            assert repr(bulk) == "<BulkOperation [backup, 6 requests, running]>"
            with pytest.raises(NotFinished, match="the backup bulk call has not ended; await it first"):
                bulk.result()
            for bad in (True, 6, -1, "1", 1.0, None):
                with refused("request", f"request {bad!r} is not one of this call's 0..5"):
                    bulk.cancel([0, bad])  # refused as a whole: request 0 is not cancelled
            assert bulk.cancel([np.int64(5), 4]) == 2  # numpy integers are requests
            assert bulk.cancel([4]) == 0
            assert bulk.cancel() == 4 and bulk.cancel() == 0
            gate.set()
            result = await bulk
            assert bulk.done() and repr(bulk) == "<BulkOperation [backup, 6 requests, done]>"
            assert bulk.result() is result
            assert result.status.tolist() == [BulkResult.CANCELLED] * 6
            assert repr(result) == "<BulkResult [backup, 6 requests: 0 done, 0 failed, 6 cancelled]>"
            assert all(not p for p in result.host_pages.values())  # a backup: the completed requests' only
            sched.free_host(await first)
            assert used(group)["kv"] == 0
        finally:
            gate.set()  # before the close, which waits for the held batch


async def test_a_bulk_results_status_is_int8_read_only_and_its_repr_counts_each_end(gate: threading.Event) -> None:
    group = full_attention_group(page_size=4)
    ex = FaultInjectingExecutor(fail_batches={2}, hold=gate, hold_timeout_s=10)
    kv, off = _flat([[i] for i in range(5)], 4)
    async with TransferScheduler(group, ex, SchedulerConfig(max_batch_ops=2)) as sched:
        try:
            first = await sched.backup_arrays({"kv": kv[:4]}, {"kv": off[:2]})  # batch 0, held
            await wait_until(lambda: sched.statistics().backup.batches == 1)
            bulk = await sched.backup_arrays({"kv": kv}, {"kv": off})  # batches 1 (0, 1), 2 (2, 3), 3 (4)
            assert bulk.cancel([1]) == 1
            gate.set()
            result = await bulk
            assert result.status.dtype == np.int8
            assert result.status.tolist() == [0, 2, 1, 1, 0]
            assert result.ok.tolist() == [True, False, False, False, True] and not result.all_ok
            with pytest.raises(ValueError):
                result.status[0] = 1  # read-only: the caller's reads cannot rewrite how a request ended
            assert repr(result) == "<BulkResult [backup, 5 requests: 2 done, 2 failed, 1 cancelled]>"
            host = result.host_indices["kv"].tolist()
            assert result.host_pages == {"kv": [host[0] // 4, host[16] // 4]}  # requests 0 and 4 completed
            assert result.bytes_per_pool == {"kv": 2 * 4 * group["kv"].slot_nbytes}
            sched.free_host(result)
            sched.free_host(await first)
            assert used(group)["kv"] == 0
        finally:
            gate.set()  # before the close, which waits for the held batch


async def test_a_bulk_results_device_and_host_indices_are_each_their_own_side() -> None:
    """Device slots named by the call are handed back as device indices, the
    host pages kvtier chose as host indices, sidecars derived from each: the
    two sides differ here, so neither stands for the other."""
    group = hybrid_group(device_allocator=True)
    ps = group["kv"].page_size
    k = group["c4"].sidecar.rows_per_page  # type: ignore[union-attr]
    dev_pages = [[7, 3], [5]]
    kv, off = _flat(dev_pages, ps)
    async with TransferScheduler(group) as sched:
        result = await (await sched.backup_arrays({"kv": kv}, {"kv": off}))
        assert result.all_ok
        host_pages = result.host_pages["kv"]
        assert len(host_pages) == 3 and host_pages != [7, 3, 5]
        assert result.device_indices["kv"].tolist() == kv.tolist()
        assert result.device_indices["kv"].dtype == torch.int64
        assert result.host_indices["kv"].tolist() == [p * ps + r for p in host_pages for r in range(ps)]
        assert result.device_indices["c4"].tolist() == [p * k + r for p in (7, 3, 5) for r in range(k)]
        assert result.host_indices["c4"].tolist() == [p * k + r for p in host_pages for r in range(k)]
        assert result.offsets["kv"].tolist() == [0, 2 * ps, 3 * ps]
        assert result.offsets["c4"].tolist() == [0, 2 * k, 3 * k]
        # A second read of each side: equal, and not the same memory.
        again = result.device_indices
        assert again["kv"].tolist() == kv.tolist() and again["c4"].tolist() == result.device_indices["c4"].tolist()
        assert result.host_indices["kv"].tolist() == [p * ps + r for p in host_pages for r in range(ps)]
        sched.free_host(result)
        assert used(group)["kv"] == 0
