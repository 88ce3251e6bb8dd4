"""as_index_tensor: what becomes an int64 index tensor, and what is refused."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import InvalidIndices
from kvtier.pools import as_index_tensor

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
