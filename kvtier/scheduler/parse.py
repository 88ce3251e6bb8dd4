"""Parse: the first step of every backup and load, before admission takes anything.

What the caller passed is checked and copied as values: `Parser.pages` turns
an index mapping into page numbers (pools known, whole aligned unique pages in
range), kvtier's own copy, so the caller's tensors are never read again and an
engine may reuse its page-table buffer the moment a call returns; sidecar
entries (as a backup handle's ``host_indices`` lists them) are accepted when
they equal what their source derives, and dropped. `Parser.bulk_pages` checks
many requests of the common shape at once (a few numpy calls per pool),
`Parser.many_pages` / `many_loads` a bulk call a slice at a time (letting the
loop run in between), `Parser.parse_arrays` the array-native form
(`kvtier.scheduler.arrays`). Each kind's own rules build on them:
`parse_backup` / `parse_load` (host and device pages as a pair, `check_pairs`),
`valid_counts` / `array_valid_counts` (a backup's ``valid_rows``).

Every check raises `InvalidIndices` naming the pool, the value and the rule
(`naming_request` adds the request of a bulk call), and changes nothing. The
scheduler's `Admission` is the `Parser` of its group; what it takes comes after.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from kvtier.errors import InvalidIndices
from kvtier.pools import PoolGroup, PoolSpec, as_index_tensor, as_request_list, page_numbers
from kvtier.scheduler.arrays import ArrayLike, PoolArrays, as_int64_array, parse_pools, parse_valid_rows
from kvtier.scheduler.lanes import StepClock
from kvtier.scheduler.requests import Pages, concatenated, extend
from kvtier.storage.pages import page_members

__all__ = ["IndexLike", "Parser", "naming_request", "storage_members"]

IndexLike = torch.Tensor | Sequence[int]

# Requests a bulk call checks at a time: each costs the loop a few microseconds.
_VALIDATE_SLICE = 128

# Read once: a module attribute each per request on the hot path otherwise.
_TENSOR, _INT64, _STRIDED = torch.Tensor, torch.int64, torch.strided


class Parser:
    """The parse step of every request of one `PoolGroup` (frozen): what the
    caller passed, checked and copied as values, before anything is taken.

    `pages` turns an index mapping into page numbers (pools known, whole
    aligned unique pages in range), kvtier's own copy: the caller's tensors
    are never read again, so an engine may reuse its page-table buffer the
    moment a call returns. Sidecar entries (as a backup handle's
    ``host_indices`` lists them) are accepted when they equal what their
    source derives, and dropped. `bulk_pages` checks many requests of the
    common shape at once; `parse_arrays` the array-native form. Each kind's
    own rules (`parse_backup`, `parse_load`, `valid_counts`, ...) build on
    them. Every check raises `InvalidIndices` naming the pool, the value and
    the rule, and changes nothing.
    """

    def __init__(self, group: PoolGroup) -> None:
        self.group = group
        # Per pool: its spec and the slot counts its indices must lie below,
        # read once (the group is frozen): an operation's check is dict lookups.
        self._specs: dict[str, PoolSpec] = {spec.name: spec for spec in group}
        self._limits: dict[str, dict[str, int]] = {
            "host": {spec.name: spec.host.slots for spec in group},
            "device": {spec.name: spec.device_slots for spec in group},
        }
        # Per slot-owning pool with host pages, the pools stored with its pages.
        self.storage_members = storage_members(group)

    def spec(self, name: object) -> PoolSpec:
        """The slot-owning pool ``name``; `InvalidIndices` for an unknown pool or a sidecar."""
        if not isinstance(name, str) or name not in self.group:
            raise InvalidIndices(
                f"unknown pool {name!r}; known pools: {sorted(self.group.names)}", rule="known-pool"
            )
        spec = self.group[name]
        if spec.sidecar is not None:
            raise InvalidIndices(
                f"pool {name!r} is a sidecar of {spec.sidecar.source!r}; its indices are derived, "
                f"name {spec.sidecar.source!r} instead",
                pool=name, rule="not-a-sidecar",
            )
        return spec

    def pages(
        self, indices: Mapping[str, IndexLike], *, side: str, allow_empty: bool = False
    ) -> dict[str, list[int]]:
        """Page numbers by slot-owning pool, checked (see the module doc).

        Raises `InvalidIndices` naming the pool, the value and the rule;
        nothing changes.
        """
        if type(indices) is dict and len(indices) == 1:
            one = self._one_page(indices, side)
            if one is not None:
                return one
        if type(indices) is not dict and not isinstance(indices, Mapping):
            raise InvalidIndices(
                f"{side} indices must be a mapping of pool name to indices; got {type(indices).__name__}",
                rule="mapping",
            )
        if not indices and not allow_empty:
            raise InvalidIndices(f"an operation names at least one pool; got no {side} indices", rule="non-empty")
        specs = self._specs
        limits = self._limits[side]
        out: dict[str, list[int]] = {}
        derived: list[tuple[str, list[int]]] | None = None
        for name, value in indices.items():
            spec = specs.get(name) if type(name) is str else None
            if spec is None:
                spec = self.spec(name)  # raises for an unknown pool
            if spec.sidecar is not None:
                if derived is None:
                    derived = []
                derived.append((name, self._pages_of(spec, value, side)))
                continue
            idx = as_index_tensor(value, pool=name, side=side)
            out[name] = page_numbers(idx, page_size=spec.page_size, limit=limits[name], pool=name, side=side)
        if derived:
            for name, rows in derived:
                self._check_derived(name, rows, out, side)
        return out

    def _one_page(self, indices: dict[str, IndexLike], side: str) -> dict[str, list[int]] | None:
        """`pages` of the commonest request, one page of one slot-owning pool
        as a 1-D int64 CPU tensor, checked in a few reads (its ``tolist`` is
        the only torch call, a metadata read); None for anything else, which
        `pages` then checks (and refuses) the long way."""
        for name, value in indices.items():
            spec = self._specs.get(name) if type(name) is str else None
            if (
                spec is None or spec.sidecar is not None or type(value) is not _TENSOR
                or value.dtype is not _INT64 or not value.is_cpu or value.layout is not _STRIDED
            ):
                return None
            values = value.tolist()
            size = spec.page_size
            # A list of ``size`` ints is a 1-D tensor's (a 0-d tensor gives an int, a 2-D one lists).
            if type(values) is not list or len(values) != size:
                return None
            first = values[0]
            if (
                type(first) is not int or first < 0 or first % size or first + size > self._limits[side][name]
                or (size > 1 and values != list(range(first, first + size)))
            ):
                return None
            return {name: [first // size]}
        return None

    def bulk_pages(
        self, requests: Sequence[Mapping[str, IndexLike]], *, side: str
    ) -> tuple[dict[str, list[int]], dict[str, list[int]]] | None:
        """The page numbers of many requests at once, or None when they are
        not all of the common shape; then check each with `pages`.

        The common shape: every request names the same slot-owning pools with
        one-dimensional int64 CPU tensors. Those are read with ``tolist``
        (no torch operator: a metadata read that keeps the GIL) and checked
        together in numpy: whole aligned pages in range, no page twice within
        a request (two requests may name the same page).
        Returns, per pool, the requests' pages one after the other and where
        each request's start (``offsets[pool][i]``, one more at the end).
        Whatever the vectorised check refuses is also left to `pages` (None),
        which raises the error of the first bad request.
        """
        if not requests:
            return {}, {}
        group = self.group
        first = requests[0]
        if not isinstance(first, dict) or not first:
            return None
        names = list(first)
        for name in names:
            spec = group[name] if isinstance(name, str) and name in group else None
            if spec is None or not spec.owns_slots:
                return None
        columns: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        tensor, int64 = torch.Tensor, torch.int64
        for request in requests:
            if type(request) is not dict or len(request) != len(names):
                return None
            for name, column in columns.items():
                value = request.get(name)
                if type(value) is not tensor or value.dtype is not int64 or not value.is_cpu:
                    return None
                column.append(value)
        pages: dict[str, list[int]] = {}
        offsets: dict[str, list[int]] = {}
        for name, column in columns.items():
            checked = _bulk_pages_of(group[name], column, side)
            if checked is None:
                return None
            pages[name], offsets[name] = checked
        return pages, offsets

    def _pages_of(self, spec: PoolSpec, value: IndexLike, side: str) -> list[int]:
        idx = as_index_tensor(value, pool=spec.name, side=side)
        limit = spec.host.slots if side == "host" else spec.device_slots
        return page_numbers(idx, page_size=spec.page_size, limit=limit, pool=spec.name, side=side)

    def _check_derived(self, name: str, rows: list[int], owners: Mapping[str, list[int]], side: str) -> None:
        """A sidecar entry is accepted when it is exactly what its source derives."""
        sidecar = self.group[name].sidecar
        assert sidecar is not None
        source = owners.get(sidecar.source)
        if source is None:
            raise InvalidIndices(
                f"pool {name!r} is a sidecar of {sidecar.source!r}; its indices are derived, "
                f"name {sidecar.source!r} instead",
                pool=name, rule="not-a-sidecar",
            )
        # A sidecar's "pages" are runs of rows_per_page rows: one per source page.
        if rows != source:
            raise InvalidIndices(
                f"pool {name!r} is a sidecar of {sidecar.source!r}; its {side} indices must be the rows "
                f"derived from {sidecar.source!r}'s pages (as a handle gives them), or left out; got rows of "
                f"pages {rows[:8]} for {sidecar.source!r} pages {source[:8]}",
                pool=name, rule="derived-indices",
            )

    def parse_load(
        self, host_indices: Mapping[str, IndexLike], device_indices: Mapping[str, IndexLike] | None
    ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """A load's host pages and the device pages it was given, checked as a pair."""
        host = self.pages(host_indices, side="host")
        given = self.pages(device_indices or {}, side="device", allow_empty=True)
        self.check_pairs(host, given, every_pool=False, what="a load names its host pages for every pool")
        return host, given

    def parse_backup(
        self, device_indices: Mapping[str, IndexLike], host_indices: Mapping[str, IndexLike] | None,
    ) -> tuple[dict[str, list[int]], dict[str, list[int]] | None]:
        """A backup's device pages, and the host pages it names (None: kvtier
        allocates them), checked as a pair."""
        device = self.pages(device_indices, side="device")
        named = None
        if host_indices is not None:
            named = self.pages(host_indices, side="host")
            self.check_pairs(named, device, every_pool=True, what="a backup into named host pages names both for every pool")
        return device, named

    def valid_counts(
        self, rows: Mapping[str, int], device: Mapping[str, list[int]]
    ) -> dict[str, tuple[str, list[int]]]:
        """A backup's ``valid_rows=`` as counts per page: pool -> (its slot owner,
        valid rows per page of the owner), only for pools with a partial page.
        `InvalidIndices` (rule ``valid-rows``) names the pool and the value."""
        if not isinstance(rows, Mapping):
            raise InvalidIndices(f"valid_rows must map pool names to row counts; got {type(rows).__name__}",
                                 rule="valid-rows")
        out: dict[str, tuple[str, list[int]]] = {}
        group = self.group
        for name, n in rows.items():
            spec = group[name] if name in group else None
            owner = None if spec is None else (spec.sidecar.source if spec.sidecar is not None else name)
            if spec is None or owner not in device or not spec.host.has_bytes:
                raise InvalidIndices(
                    f"valid_rows names pool {name!r}; it may name the pools with bytes of this backup and their "
                    f"sidecars ({sorted(n for o in device for n in self.storage_members.get(o, []))})",
                    pool=str(name), rule="valid-rows",
                )
            size = spec.page_size  # a sidecar's: its rows per source page
            assert owner is not None
            total = len(device[owner]) * size
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= total:
                raise InvalidIndices(
                    f"pool {name!r} has {total} rows in this backup; valid_rows[{name!r}] must be an int in 0..{total}, "
                    f"the rows from the first that hold data; got {n!r}",
                    pool=name, rule="valid-rows",
                )
            if n < total:
                out[name] = (owner, [min(size, max(0, n - i * size)) for i in range(len(device[owner]))])
        return out

    def check_pairs(
        self, host: Mapping[str, list[int]], device: Mapping[str, list[int]], *, every_pool: bool, what: str
    ) -> None:
        """`InvalidIndices` unless each pool of ``device`` has as many host
        pages; with ``every_pool`` also each pool of ``host`` device pages (a
        load may leave pools out of ``device``: kvtier allocates those)."""
        for name in _unpaired(host, device, every_pool):
            side, other = ("host", "device") if name in host else ("device", "host")
            raise InvalidIndices(
                f"pool {name!r} has {side} indices but no {other} indices; {what}",
                pool=name, rule="host-and-device",
            )
        for name, dev in device.items():
            if len(dev) != len(host[name]):
                size = self.group[name].page_size
                raise InvalidIndices(
                    f"pool {name!r} has {len(host[name]) * size} host indices and {len(dev) * size} device "
                    "indices; they must be equal",
                    pool=name, rule="equal-lengths",
                )

    def parse_arrays(
        self, indices: Mapping[str, ArrayLike], offsets: Mapping[str, ArrayLike] | None, *, side: str,
        count: int | None = None, allow_empty: bool = False,
    ) -> tuple[PoolArrays, int]:
        """`parse_pools` for this group: slot-owning pools, and sidecar
        entries accepted when they are exactly what their source derives."""
        if not isinstance(indices, Mapping):
            raise InvalidIndices(
                f"{side} indices must be a mapping of pool name to index arrays; got {type(indices).__name__}",
                rule="mapping",
            )
        group = self.group
        owners: dict[str, ArrayLike] = {}
        derived: list[str] = []
        for name in indices:
            if isinstance(name, str) and name in group and group[name].sidecar is not None:
                derived.append(name)
            else:
                owners[self.spec(name).name] = indices[name]
        if not owners and allow_empty and not derived:
            return {}, count or 0
        limits = {name: (group[name].host.slots if side == "host" else group[name].device_slots) for name in owners}

        def check_one(i: int, name: str, slots: np.ndarray) -> None:
            with naming_request(i):
                self.pages({name: torch.from_numpy(slots.copy())}, side=side)

        if offsets is not None:
            if not isinstance(offsets, Mapping):
                raise InvalidIndices(f"offsets must map pool names to offset arrays; got {type(offsets).__name__}",
                                     rule="offsets")
            # Offsets of a pool the indices do not name (a typo in a sidecar's key) would be ignored.
            extra = sorted(map(repr, offsets.keys() - indices.keys()))
            if extra:
                raise InvalidIndices(
                    f"offsets name pools {', '.join(extra)} that the {side} indices do not (they name "
                    f"{sorted(map(str, indices))}); every offsets key must be a pool of the indices",
                    rule="offsets",
                )
        out, count = parse_pools(owners, None if offsets is None else {k: v for k, v in offsets.items() if k in owners},
                                 page_sizes={name: group[name].page_size for name in owners}, limits=limits,
                                 check_one=check_one, count=count)
        for name in derived:
            sidecar = group[name].sidecar
            assert sidecar is not None
            source = out.get(sidecar.source)
            k = sidecar.rows_per_page
            got = as_int64_array(indices[name], what=f"pool {name!r} {side} indices", pool=name)
            if source is None or not np.array_equal(got.reshape(-1), _rows(source[0], k)):
                raise InvalidIndices(
                    f"pool {name!r} is a sidecar of {sidecar.source!r}; its {side} indices must be the rows derived "
                    f"from {sidecar.source!r}'s pages (as a result gives them), or left out",
                    pool=name, rule="derived-indices",
                )
        return {name: pa for name, pa in out.items() if pa[0].size}, count

    def check_array_pairs(self, host: PoolArrays, device: PoolArrays, *, every_pool: bool) -> None:
        """As `check_pairs`, per request: the same page counts in every pool both name."""
        for name in _unpaired(host, device, every_pool):
            side, other = ("host", "device") if name in host else ("device", "host")
            raise InvalidIndices(f"pool {name!r} has {side} indices but no {other} indices", pool=name,
                                 rule="host-and-device")
        for name, (_, dev_off) in device.items():
            host_off = host[name][1]
            if not np.array_equal(dev_off, host_off):
                i = int(np.flatnonzero(np.diff(dev_off) != np.diff(host_off))[0])
                size = self.group[name].page_size
                raise InvalidIndices(
                    f"request {i}: pool {name!r} has {int(host_off[i + 1] - host_off[i]) * size} host indices and "
                    f"{int(dev_off[i + 1] - dev_off[i]) * size} device indices; they must be equal",
                    pool=name, rule="equal-lengths",
                )

    def array_valid_counts(
        self, rows: Mapping[str, ArrayLike], device: PoolArrays, count: int
    ) -> dict[str, tuple[str, np.ndarray]]:
        """``valid_rows`` of `backup_arrays`, checked: pool -> (its slot owner,
        valid rows per request), for the pools with a partial page."""
        group = self.group
        totals: dict[str, np.ndarray] = {}
        owner_of: dict[str, str] = {}
        for owner, (_, off) in device.items():
            for name in self.storage_members.get(owner, ()):
                if name in group and group[name].host.has_bytes:
                    totals[name] = np.diff(off) * group[name].page_size
                    owner_of[name] = owner
        checked = parse_valid_rows(rows, count, totals)
        return {name: (owner_of[name], n) for name, n in checked.items() if bool((n < totals[name]).any())}

    # -- bulk calls' lists ------------------------------------------------------------------

    def backup_list(
        self, requests: Sequence[Mapping[str, IndexLike]], valid_rows: Sequence[Mapping[str, int] | None] | None,
    ) -> list[Mapping[str, IndexLike]]:
        """A `backup_many`'s requests as a list, and its ``valid_rows``: one
        mapping (or None) per request, or None."""
        requests = as_request_list(requests, call="backup_many")
        rows = valid_rows
        if rows is not None and (isinstance(rows, Mapping) or not isinstance(rows, Sequence)
                                 or len(rows) != len(requests)):
            raise InvalidIndices(
                f"backup_many takes valid_rows as one mapping (or None) per request, {len(requests)} of them; got "
                f"{type(rows).__name__}" + (f" of {len(rows)}" if isinstance(rows, Sequence) else ""),
                rule="valid-rows",
            )
        return requests

    def many_valid_counts(
        self, rows: Sequence[Mapping[str, int] | None] | None, device: Mapping[str, list[int]],
        offsets: Mapping[str, list[int]],
    ) -> list[tuple[int, dict[str, tuple[str, list[int]]]]]:
        """`valid_counts` of each request of a `backup_many` that gave ``valid_rows``
        (request index, counts), its error naming the request."""
        counts = []
        for i, given in enumerate(rows or ()):
            if given is not None:
                with naming_request(i):
                    mine = {name: p[off[i]:off[i + 1]] for name, p in device.items()
                            if (off := offsets[name])[i + 1] > off[i]}
                    counts.append((i, self.valid_counts(given, mine)))
        return counts

    def load_lists(
        self, host_indices: Sequence[Mapping[str, IndexLike]],
        device_indices: Sequence[Mapping[str, IndexLike] | None] | None,
    ) -> tuple[list[Mapping[str, IndexLike]], list[Mapping[str, IndexLike] | None] | None]:
        """A `load_many`'s host and device index mappings as lists, one of each per request."""
        hosts = as_request_list(host_indices, call="load_many", what="host index mappings")
        devices = None
        if device_indices is not None:
            devices = as_request_list(device_indices, call="load_many", what="device index mappings", nones=True)
        count = len(hosts)
        if devices is not None and len(devices) != count:
            raise InvalidIndices(
                f"load_many got {count} host index mappings and {len(devices)} device ones; "
                "give one per request, or none", rule="equal-lengths",
            )
        return hosts, devices

    def load_allocations(
        self, host: Mapping[str, list[int]], offsets: Mapping[str, list[int]],
        given_offsets: Mapping[str, list[int]], count: int,
    ) -> tuple[frozenset[str] | list[frozenset[str]], dict[str, int]]:
        """Per request of a `load_many`, the pools whose device pages kvtier
        allocates (those it gave none of): one set when it is the same for
        every request, else one per request; and the device slots that takes
        per pool."""
        specs = self._specs
        every = {name for name, off in given_offsets.items() if off == offsets[name]}
        allocated: frozenset[str] | list[frozenset[str]]
        if every == given_offsets.keys():
            allocated = frozenset(host.keys() - every)
            return allocated, {name: len(host[name]) * specs[name].page_size for name in allocated}
        allocated = [
            frozenset(name for name, off in offsets.items() if off[i + 1] > off[i] and not (
                name in given_offsets and given_offsets[name][i + 1] > given_offsets[name][i]))
            for i in range(count)
        ]
        needed: dict[str, int] = {}
        for i, pools in enumerate(allocated):
            for name in pools:
                off = offsets[name]
                needed[name] = needed.get(name, 0) + (off[i + 1] - off[i]) * specs[name].page_size
        return allocated, needed

    async def many_pages(self, requests: Sequence[Mapping[str, IndexLike]], side: str) -> Pages:
        """The pages of a bulk call's requests, one after the other, and their
        offsets (see `RequestPages`), checked a slice at a time; the loop runs
        in between once a step has taken long enough."""
        out: Pages = ({}, {})
        clock = StepClock()
        for start in range(0, len(requests), _VALIDATE_SLICE):
            await clock.checkpoint()
            part = requests[start:start + _VALIDATE_SLICE]
            got = self.bulk_pages(part, side=side)
            if got is None:
                each = []
                for i, request in enumerate(part, start):
                    with naming_request(i):
                        each.append(self.pages(request, side=side))
                got = concatenated(each)
            extend(out, start, got, len(part))
        return out

    async def many_loads(
        self, host_indices: Sequence[Mapping[str, IndexLike]],
        device_indices: Sequence[Mapping[str, IndexLike] | None] | None,
        check_readable: Callable[[Mapping[str, list[int]]], None],
    ) -> tuple[dict[str, list[int]], dict[str, list[int]], dict[str, list[int]], dict[str, list[int]]]:
        """A `load_many`'s host pages and offsets (as `many_pages`), and the
        device pages the requests gave with their offsets (a request that gave
        none of a pool has an empty range of it). ``check_readable``: admission's
        check that the caller holds the host pages, run a slice at a time so
        that the request it refuses is named."""
        host: Pages = ({}, {})
        given: Pages = ({}, {})
        clock = StepClock()
        for start in range(0, len(host_indices), _VALIDATE_SLICE):
            await clock.checkpoint()
            hosts = host_indices[start:start + _VALIDATE_SLICE]
            devices = None if device_indices is None else device_indices[start:start + _VALIDATE_SLICE]
            fast = self.bulk_pages(hosts, side="host")
            dev: Pages | None = ({}, {})
            if fast is not None and devices is not None:
                dev = self.bulk_pages(devices, side="device")  # type: ignore[arg-type]
                if dev is not None and any(fast[1].get(name) != off for name, off in dev[1].items()):
                    dev = None  # not one device page per host page: the slow path names the request
            if fast is not None and dev is not None:
                try:
                    check_readable(fast[0])
                except InvalidIndices:
                    dev = None
            if fast is None or dev is None:
                each_host, each_given = [], []
                for i, request in enumerate(hosts, start):
                    with naming_request(i):
                        pages, own = self.parse_load(request, None if devices is None else devices[i - start])
                        check_readable(pages)
                    each_host.append(pages)
                    each_given.append(own)
                fast, dev = concatenated(each_host), concatenated(each_given)
            extend(host, start, fast, len(hosts))
            extend(given, start, dev, len(hosts))
        return host[0], host[1], given[0], given[1]


@contextmanager
def naming_request(index: int) -> Iterator[None]:
    """An `InvalidIndices` raised for one request of a bulk call names its place."""
    try:
        yield
    except InvalidIndices as exc:
        raise InvalidIndices(f"request {index}: {exc}", pool=exc.pool, rule=exc.rule) from exc


def storage_members(group: PoolGroup) -> dict[str, list[str]]:
    """Per slot-owning pool, the pools with bytes stored with its pages."""
    out = {}
    for spec in group:
        if spec.owns_slots and spec.host.allocator is not None:
            pages = spec.host.slots // spec.page_size
            out[spec.name] = list(page_members(group, spec.name, 0)) if pages else []
    return out


def _rows(pages: np.ndarray, k: int) -> np.ndarray:
    """The rows ``p*k .. p*k+k-1`` of every page ``p`` (a sidecar's, derived from its source's pages)."""
    return pages if k == 1 else (pages[:, None] * k + np.arange(k, dtype=np.int64)).reshape(-1)


def _bulk_pages_of(
    spec: PoolSpec, values: list[torch.Tensor], side: str
) -> tuple[list[int], list[int]] | None:
    """`Parser.bulk_pages` for one pool: the pages of every request and
    their offsets, or None when any request breaks a rule. The requests' CPU
    tensors are read with ``tolist`` (a metadata read: no torch operator, so
    the GIL is kept, where a ``torch.cat`` and its numpy view were two
    operators per pool and 128 requests) and checked as the array-native bulk
    call checks its arrays (`kvtier.scheduler.arrays.parse_pools`), in numpy.
    Whatever is not one-dimensional (a nested list, a scalar), a sparse or
    nested tensor included, is left to `Parser.pages` (None)."""
    try:
        lists = [v.tolist() for v in values]
        lengths = [len(slots) for slots in lists]  # a 0-d tensor's int has none
        if spec.page_size == 1 and lengths.count(1) == len(lengths):  # one slot each: checked in plain Python
            return _one_slot_pages(spec, [slots[0] for slots in lists], side)
        flat = np.array(list(itertools.chain.from_iterable(lists)), dtype=np.int64)
    except (RuntimeError, TypeError, ValueError):  # no storage (sparse, nested), ragged or scalar
        return None
    if min(lengths) == 0 or flat.ndim != 1 or flat.size != sum(lengths):
        return None
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    name = spec.name
    limit = spec.host.slots if side == "host" else spec.device_slots
    try:
        parsed, _ = parse_pools({name: flat}, {name: offsets}, page_sizes={name: spec.page_size},
                                limits={name: limit}, check_one=_refuse)
    except InvalidIndices:
        return None
    pages, page_offsets = parsed[name]
    return pages.tolist(), page_offsets.tolist()


def _unpaired(host: Mapping[str, object], device: Mapping[str, object], every_pool: bool) -> list[str]:
    """The pools ``device`` names and ``host`` does not (with ``every_pool``, and the reverse)."""
    if device.keys() == host.keys() if every_pool else device.keys() <= host.keys():
        return []  # the common case, without a list made per side
    return [n for n in device if n not in host] + ([n for n in host if n not in device] if every_pool else [])


def _one_slot_pages(spec: PoolSpec, slots: list[int], side: str) -> tuple[list[int], list[int]] | None:
    """`_bulk_pages_of` where every request names one slot of a pool of page
    size 1: each slot is its page, so the rules left are ints in range (a
    page named by two requests is allowed). Two C-speed passes over a list,
    where the numpy check costs tens of microseconds per call whatever its
    size. None for anything else (an element that is a list: a 2-D tensor)."""
    low, high = min(slots), max(slots)  # TypeError (caught by the caller) for ints beside lists
    limit = spec.host.slots if side == "host" else spec.device_slots
    if type(low) is not int or type(high) is not int or low < 0 or high >= limit:
        return None
    return slots, list(range(len(slots) + 1))


def _refuse(index: int, pool: str, slots: object) -> None:
    """The vectorised check found a bad request: `Parser.pages` names it."""
    raise InvalidIndices(f"request {index} of pool {pool!r} breaks a rule", pool=pool)
