"""Validation of slot index sets, as pure functions.

An index set names whole pages: its length is a multiple of ``page_size``, every
page starts on a page boundary and runs over ``page_size`` consecutive slots, no
page appears twice, and every slot lies in ``[0, limit)``. Anything else raises
`InvalidIndices` naming the pool, the value and the rule, before any state changes.
Indices become int64 tensors first (`as_index_tensor`): a value outside the
int64 range is refused there, never wrapped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.errors import InvalidIndices

__all__ = ["PageList", "as_index_tensor", "as_request_list", "as_slot_tensor", "page_numbers", "slots_of_pages"]

# Up to this many indices the checks run as plain Python over a list, which is
# cheaper than a handful of torch ops (~5 us each); above it, torch vectorises.
_PYTHON_CHECK_LIMIT = 512

_ARANGE_CACHE: dict[int, torch.Tensor] = {}

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

# The integer dtypes that convert to int64 with ``.to``. The sub-byte ones
# (torch.uint1..7, int1..7), the quantized and the bits dtypes have no such
# conversion; torch would raise NotImplementedError or RuntimeError.
_INTEGER_DTYPES = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64}
)


def _arange(n: int) -> torch.Tensor:
    cached = _ARANGE_CACHE.get(n)
    if cached is None:
        cached = _ARANGE_CACHE[n] = torch.arange(n, dtype=torch.int64)
    return cached


def as_index_tensor(value: torch.Tensor | Sequence[int], *, pool: str, side: str) -> torch.Tensor:
    """Return ``value`` as a one-dimensional int64 CPU tensor, with the same values.

    Accepts a dense (strided) tensor of an integer dtype (int8..int64,
    uint8..uint64) or a sequence of ints. Raises `InvalidIndices` for another
    dtype, another device, another layout (a sparse or other non-strided
    tensor) or another rank (rules ``integer-dtype``, ``cpu-indices``,
    ``strided-indices``, ``one-dimensional``), and for a value outside the int64 range (``int64-range``:
    a list entry past it, or a uint64 entry of 2**63 or more), which would
    otherwise overflow or wrap to a negative slot.
    """
    if (
        type(value) is torch.Tensor and value.dtype is torch.int64 and value.dim() == 1 and value.is_cpu
        and value.layout is torch.strided
    ):
        return value  # the common case, checked in ~1 us
    if isinstance(value, torch.Tensor):
        if value.dtype not in _INTEGER_DTYPES:
            raise InvalidIndices(
                f"pool {pool!r} {side} indices must be an integer tensor; got dtype {value.dtype}",
                pool=pool,
                rule="integer-dtype",
            )
        if value.device.type != "cpu":
            raise InvalidIndices(
                f"pool {pool!r} {side} indices must be a CPU tensor; got device {value.device}",
                pool=pool,
                rule="cpu-indices",
            )
        if value.layout is not torch.strided:
            raise InvalidIndices(
                f"pool {pool!r} {side} indices must be a dense (strided) tensor; got layout {value.layout} "
                f"(make it dense with .to_dense())",
                pool=pool,
                rule="strided-indices",
            )
        if value.dim() != 1:
            raise InvalidIndices(
                f"pool {pool!r} {side} indices must be one-dimensional; got shape {tuple(value.shape)}",
                pool=pool,
                rule="one-dimensional",
            )
        if value.dtype == torch.int64:
            return value
        if value.dtype == torch.uint64:
            # torch has no comparison or max for uint64 on CPU; the same bits as
            # int64 are negative exactly where the value is 2**63 or more.
            signed = value.view(torch.int64)
            over = signed < 0
            if bool(over.any()):
                k = int(over.nonzero()[0, 0])
                raise _out_of_int64(pool, side, k, int(signed[k]) + 2**64)
            return signed
        return value.to(torch.int64)  # (u)int8..32: every value fits
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidIndices(
            f"pool {pool!r} {side} indices must be an integer tensor or a sequence of ints; "
            f"got {type(value).__name__}",
            pool=pool,
            rule="integer-dtype",
        )
    values = list(value)
    # Plain ints pass on their types alone (~4x cheaper than isinstance per
    # value); int subclasses other than bool take the slow test.
    if not set(map(type, values)) <= {int} and not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise InvalidIndices(
            f"pool {pool!r} {side} indices must be ints; got {values[:8]!r}",
            pool=pool,
            rule="integer-dtype",
        )
    if values:
        low = min(values)
        high = max(values)
        if low < _INT64_MIN or high > _INT64_MAX:
            bad = low if low < _INT64_MIN else high
            raise _out_of_int64(pool, side, values.index(bad), bad)
    return torch.tensor(values, dtype=torch.int64)


def as_request_list(requests: object, *, call: str, what: str = "requests", nones: bool = False) -> list[Any]:
    """The requests of a bulk call (``backup_many``, ``load_many``) as a list.

    ``requests`` must be a list or tuple (any non-string sequence) of
    mappings, one per request, in order (with ``nones``, None entries too).
    Raises `InvalidIndices` (rule ``request-list``) for a lone mapping (one
    request: wrap it in a list, or call the single form), a set (no order,
    so no handle could be matched to its request), a string, anything else
    that is not a sequence, or an entry that is not a mapping; nothing is
    changed.
    """
    if isinstance(requests, Mapping):
        raise InvalidIndices(
            f"{call} takes a list of {what}, one mapping of pool name to indices per request; got one "
            f"{type(requests).__name__} (wrap it in a list, or use the single-request call)",
            rule="request-list",
        )
    if isinstance(requests, (Set, str, bytes)) or not isinstance(requests, Sequence):
        raise InvalidIndices(
            f"{call} takes a list of {what} in order (one handle per request, in the same order); got "
            f"{type(requests).__name__}",
            rule="request-list",
        )
    out = list(requests)
    for i, request in enumerate(out):
        if type(request) is not dict and not isinstance(request, Mapping) and not (nones and request is None):
            raise InvalidIndices(
                f"{call} {what} {i} must be a mapping of pool name to indices"
                f"{' or None' if nones else ''}; got {type(request).__name__}",
                rule="request-list",
            )
    return out


def _out_of_int64(pool: str, side: str, position: int, value: int) -> InvalidIndices:
    return InvalidIndices(
        f"pool {pool!r} {side} indices must fit in int64 ({_INT64_MIN}..{_INT64_MAX}); "
        f"got {value} at position {position}",
        pool=pool,
        rule="int64-range",
    )


def page_numbers(
    indices: torch.Tensor, *, page_size: int, limit: int, pool: str, side: str
) -> list[int]:
    """Check that ``indices`` (1-D int64) are whole, aligned, unique pages in
    ``[0, limit)`` and return their page numbers in order.

    Raises `InvalidIndices` naming the first offending value and the rule.
    """
    n = indices.numel()
    if n == 0:
        raise InvalidIndices(
            f"pool {pool!r} got no {side} indices; an operation moves at least one page",
            pool=pool,
            rule="non-empty",
        )
    if n % page_size:
        raise InvalidIndices(
            f"pool {pool!r} needs whole pages of {page_size} slots starting on a page boundary; "
            f"got {n} {side} indices starting at {int(indices[0])}",
            pool=pool,
            rule="whole-pages",
        )
    if page_size == 1 and n <= _PYTHON_CHECK_LIMIT:  # every slot is a page: only range and uniqueness
        firsts = indices.tolist()
    elif n <= _PYTHON_CHECK_LIMIT:
        firsts = _check_pages_python(indices.tolist(), page_size, pool, side)
    else:
        firsts = _check_pages_torch(indices, page_size, pool, side)
    low = min(firsts)
    high = max(firsts) + page_size - 1
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise InvalidIndices(
            f"pool {pool!r} has {limit} {side} slots (0..{limit - 1}); got index {bad}",
            pool=pool,
            rule="in-range",
        )
    pages = firsts if page_size == 1 else [f // page_size for f in firsts]
    if len(pages) > 1 and len(set(pages)) != len(pages):
        seen: set[int] = set()
        dup = next(p for p in pages if p in seen or seen.add(p))  # type: ignore[func-returns-value]
        raise InvalidIndices(
            f"pool {pool!r} {side} indices repeat page {dup} (slots {dup * page_size}.."
            f"{dup * page_size + page_size - 1}); each page may appear once per operation",
            pool=pool,
            rule="unique-pages",
        )
    return pages


def _misaligned(pool: str, side: str, page_size: int, n: int, position: int, value: int) -> InvalidIndices:
    return InvalidIndices(
        f"pool {pool!r} needs whole pages of {page_size} slots starting on a page boundary; "
        f"got {n} {side} indices with a page at position {position} starting at {value}",
        pool=pool,
        rule="page-aligned",
    )


def _check_pages_python(values: list[int], page_size: int, pool: str, side: str) -> list[int]:
    firsts = values[::page_size]
    for k, first in enumerate(firsts):
        if first % page_size:
            raise _misaligned(pool, side, page_size, len(values), k * page_size, first)
        if page_size > 1 and values[k * page_size : (k + 1) * page_size] != list(
            range(first, first + page_size)
        ):
            raise _misaligned(pool, side, page_size, len(values), k * page_size, first)
    return firsts


def _check_pages_torch(indices: torch.Tensor, page_size: int, pool: str, side: str) -> list[int]:
    pages = indices.reshape(-1, page_size)
    firsts = pages[:, 0]
    bad = firsts.remainder(page_size) != 0
    if page_size > 1:
        bad |= (pages != firsts[:, None] + _arange(page_size)).any(dim=1)
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        raise _misaligned(pool, side, page_size, indices.numel(), k * page_size, int(firsts[k]))
    return firsts.tolist()


def slots_of_pages(pages: Sequence[int], page_size: int) -> torch.Tensor:
    """The slot indices (int64) of ``pages``, page after page.

    Made in numpy and seen through ``torch.from_numpy``: a torch operator
    lets the GIL go, which beside a busy Python thread costs the executor's
    thread a switch interval each (numpy keeps it for arrays this small)."""
    first, last = (pages[0], pages[-1]) if pages else (0, -1)
    if last - first == len(pages) - 1 and pages == list(range(first, last + 1)):
        # One ascending run (what a fresh allocator hands out): an arange is ~3x cheaper.
        return torch.from_numpy(np.arange(first * page_size, (last + 1) * page_size, dtype=np.int64))
    a = np.array(pages, dtype=np.int64)
    if page_size == 1:
        return torch.from_numpy(a)
    return torch.from_numpy((a[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1))


@dataclass(frozen=True, slots=True, eq=False)
class PageList:
    """Whole pages by number: slot indices not yet made into a tensor.

    The scheduler keeps freshly allocated host pages in this form so that no
    torch op runs on the event loop per operation; `slots` makes the tensor
    where it is needed (in the executor's thread, or when a caller asks).
    """

    pages: list[int]
    page_size: int

    def __len__(self) -> int:
        return len(self.pages) * self.page_size

    def slots(self) -> torch.Tensor:
        return slots_of_pages(self.pages, self.page_size)


def as_slot_tensor(indices: torch.Tensor | PageList) -> torch.Tensor:
    """``indices`` as an int64 tensor of slots."""
    return indices.slots() if isinstance(indices, PageList) else indices
