"""Array-native bulk input, parsed: many requests' indices as arrays, checked in numpy.

A bulk call (`TransferScheduler.backup_arrays` / `load_arrays`) names, per
slot-owning pool, the indices of all its requests at once: one flat 1-D array
with ``offsets[pool]`` (request ``i`` has ``flat[offsets[i]:offsets[i + 1]]``;
an empty range: it does not name the pool), or a 2-D ``[requests, slots]``
array when every request has as many of that pool. numpy arrays and CPU torch
tensors of an integer dtype are accepted; a tensor is read through its numpy
view (metadata, no torch operator).

`parse_pools` checks every pool's indices for all requests together (whole,
aligned pages in range, no page twice within a request) in a few numpy calls
per pool, and returns *page numbers* with *page offsets*: kvtier's own copy,
so the caller's arrays are never read again. The first request that breaks
a rule is found in numpy and re-checked alone by ``check_one`` (the single
call's check), so its `InvalidIndices` is the single call's, naming the
request. Pure: no awaits, no state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from kvtier.errors import InvalidIndices

__all__ = ["ArrayLike", "PoolArrays", "as_int64_array", "parse_pools", "parse_valid_rows"]

ArrayLike = Any  # np.ndarray | torch.Tensor | a sequence of ints

# Per pool: page numbers of every request one after the other, and page offsets (requests + 1).
PoolArrays = dict[str, tuple[np.ndarray, np.ndarray]]

_INT64_MAX = np.iinfo(np.int64).max


def as_int64_array(value: ArrayLike, *, what: str, pool: str | None = None) -> np.ndarray:
    """``value`` as an int64 numpy array (a view where it is one already).

    `InvalidIndices` for another dtype (rule ``integer-dtype``), a tensor off
    the CPU (``cpu-indices``) or a uint64 value past the int64 range
    (``int64-range``)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.layout is not torch.strided:
            raise InvalidIndices(
                f"{what} must be a dense CPU tensor or numpy array; got a tensor on {value.device} "
                f"({value.layout})", pool=pool, rule="cpu-indices",
            )
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype is torch.bool:
            raise InvalidIndices(f"{what} must hold integers; got dtype {value.dtype}", pool=pool,
                                 rule="integer-dtype")
        try:
            arr = value.numpy()
        except (TypeError, RuntimeError) as exc:
            raise InvalidIndices(f"{what} must hold integers numpy can read; got dtype {value.dtype}", pool=pool,
                                 rule="integer-dtype") from exc
    elif isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__"):
        raise InvalidIndices(f"{what} must be an integer array; got {type(value).__name__}", pool=pool,
                             rule="integer-dtype")
    else:
        arr = np.asarray(value)
        if arr.size == 0:
            arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidIndices(f"{what} must hold integers; got dtype {arr.dtype}", pool=pool, rule="integer-dtype")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
        raise InvalidIndices(f"{what} must fit in int64; got {int(arr.max())}", pool=pool, rule="int64-range")
    return arr.astype(np.int64, copy=False)


def _slot_offsets(name: str, flat: np.ndarray, given: ArrayLike | None, count: int | None) -> np.ndarray:
    """The slot offsets of one flat pool array, checked: ``count + 1`` of them,
    from 0 to its length, never decreasing."""
    what = f"offsets[{name!r}]"
    if given is None:
        raise InvalidIndices(
            f"pool {name!r} indices are one flat array; pass offsets[{name!r}] (one more than the requests: "
            "request i has flat[offsets[i]:offsets[i + 1]]), or a 2-D [requests, slots] array",
            pool=name, rule="offsets",
        )
    off = as_int64_array(given, what=what, pool=name)
    if off.ndim != 1 or off.size < 2 or (count is not None and off.size != count + 1):
        want = "requests + 1" if count is None else f"{count + 1}"
        raise InvalidIndices(f"{what} must be one-dimensional with {want} entries; got shape {off.shape}",
                             pool=name, rule="offsets")
    if off[0] != 0 or off[-1] != flat.size or bool((off[1:] < off[:-1]).any()):
        raise InvalidIndices(
            f"{what} must start at 0, never decrease and end at the flat array's length {flat.size}; "
            f"got {off[:8].tolist()}{'...' if off.size > 8 else ''} ending at {int(off[-1])}",
            pool=name, rule="offsets",
        )
    return off


def parse_pools(
    indices: Mapping[str, ArrayLike],
    offsets: Mapping[str, ArrayLike] | None,
    *,
    page_sizes: Mapping[str, int],
    limits: Mapping[str, int],
    check_one: Callable[[int, str, np.ndarray], None],
    count: int | None = None,
) -> tuple[PoolArrays, int]:
    """Page numbers and page offsets of every pool for all requests, and the
    request count (every pool's must agree; ``count``: the one it must be).

    ``check_one(i, pool, slots)`` raises the single call's `InvalidIndices`
    for request ``i``'s slots of ``pool``; it is called only for the first
    request found to break a rule. Raises `InvalidIndices`; changes nothing.
    """
    if not isinstance(indices, Mapping) or not indices:
        raise InvalidIndices(
            f"a bulk call takes a non-empty mapping of pool name to index arrays; got {indices!r:.80}",
            rule="mapping" if not isinstance(indices, Mapping) else "non-empty",
        )
    if offsets is not None and not isinstance(offsets, Mapping):
        raise InvalidIndices(f"offsets must map pool names to offset arrays; got {type(offsets).__name__}",
                             rule="offsets")
    extra = sorted(map(str, (offsets or {}).keys() - indices.keys()))
    if extra:
        raise InvalidIndices(f"offsets name pools {extra} that the indices do not", rule="offsets")
    out: PoolArrays = {}
    for name, value in indices.items():
        size, limit = page_sizes[name], limits[name]
        arr = as_int64_array(value, what=f"pool {name!r} indices", pool=name)
        given = None if offsets is None else offsets.get(name)
        if arr.ndim == 2:
            if given is not None:
                raise InvalidIndices(f"pool {name!r} indices are 2-D (a row per request); they take no offsets",
                                     pool=name, rule="offsets")
            n, m = arr.shape
            flat = arr.reshape(-1)
            off = np.arange(n + 1, dtype=np.int64) * m
        elif arr.ndim == 1:
            flat = arr
            off = _slot_offsets(name, flat, given, count)
        else:
            raise InvalidIndices(f"pool {name!r} indices must be 1-D (with offsets) or 2-D; got shape {arr.shape}",
                                 pool=name, rule="one-dimensional")
        n = off.size - 1
        if count is None:
            count = n
        elif n != count:
            raise InvalidIndices(f"pool {name!r} has indices for {n} requests, another pool for {count}; "
                                 "every pool names each request (an empty range where it has none)",
                                 pool=name, rule="equal-lengths")
        lengths = np.diff(off)
        bad = np.flatnonzero(lengths % size) if size > 1 else np.empty(0, dtype=np.int64)
        if bad.size:
            i = int(bad[0])
            check_one(i, name, flat[off[i]:off[i + 1]])
        pages, page_off = _pages(name, flat, off, lengths, size, limit, check_one)
        out[name] = (pages, page_off)
    assert count is not None
    named = np.zeros(count, dtype=bool)
    for _, page_off in out.values():
        named |= np.diff(page_off) > 0
    if count and not bool(named.all()):
        i = int(np.flatnonzero(~named)[0])
        raise InvalidIndices(f"request {i}: an operation names at least one pool; got no indices",
                             rule="non-empty")
    return out, count


def _pages(
    name: str, flat: np.ndarray, off: np.ndarray, lengths: np.ndarray, size: int, limit: int,
    check_one: Callable[[int, str, np.ndarray], None],
) -> tuple[np.ndarray, np.ndarray]:
    def first_bad(positions: np.ndarray) -> None:
        i = int(np.searchsorted(off, positions[0], side="right")) - 1
        check_one(i, name, flat[off[i]:off[i + 1]])
        raise AssertionError(f"request {i}'s check passed what the bulk check refused")  # pragma: no cover

    if not flat.size:
        return np.empty(0, dtype=np.int64), off // size
    out_of_range = np.flatnonzero((flat < 0) | (flat >= limit))
    if out_of_range.size:
        first_bad(out_of_range)
    if size > 1:
        rows = flat.reshape(-1, size)
        firsts = rows[:, 0]
        wrong = (firsts % size != 0) | (rows != firsts[:, None] + np.arange(size)).any(axis=1)
        if bool(wrong.any()):
            first_bad(np.flatnonzero(wrong)[:1] * size)
        pages = firsts // size
    else:
        pages = flat.copy()  # kvtier's own: the caller's array is never read again
    page_off = off // size
    # A page twice: refused only within one request. A Python set, not
    # np.unique: numpy sorts with the GIL let go (see `kvtier.pools.ownership`).
    if len(set(pages.tolist())) != pages.size:
        owner = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths // size)
        key = owner * (limit // size + 1) + pages
        order = np.argsort(key, kind="stable")
        same = np.flatnonzero(key[order][1:] == key[order][:-1])
        if same.size:
            first_bad(np.array([int(page_off[owner[order[same[0]]]]) * size]))
    return pages, page_off


def parse_valid_rows(
    rows: Mapping[str, ArrayLike], count: int, totals: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """``valid_rows[pool]``: per request, how many rows of ``pool`` hold data
    (as `TransferScheduler.backup`'s ``valid_rows=``), checked against
    ``totals[pool]`` (the rows each request has). `InvalidIndices` (rule
    ``valid-rows``) names the pool and the first bad request."""
    if not isinstance(rows, Mapping):
        raise InvalidIndices(f"valid_rows must map pool names to arrays of row counts; got {type(rows).__name__}",
                             rule="valid-rows")
    out: dict[str, np.ndarray] = {}
    for name, value in rows.items():
        if name not in totals:
            raise InvalidIndices(
                f"valid_rows names pool {name!r}; it may name the pools with bytes of this call and their "
                f"sidecars ({sorted(totals)})", pool=str(name), rule="valid-rows",
            )
        got = as_int64_array(value, what=f"valid_rows[{name!r}]", pool=name)
        total = totals[name]
        if got.shape != (count,):
            raise InvalidIndices(f"valid_rows[{name!r}] needs one count per request ({count}); got shape {got.shape}",
                                 pool=name, rule="valid-rows")
        bad = np.flatnonzero((got < 0) | (got > total))
        if bad.size:
            i = int(bad[0])
            raise InvalidIndices(
                f"request {i}: pool {name!r} has {int(total[i])} rows in this request; valid_rows[{name!r}][{i}] "
                f"must be in 0..{int(total[i])}, the rows from the first that hold data; got {int(got[i])}",
                pool=name, rule="valid-rows",
            )
        out[name] = got
    return out
