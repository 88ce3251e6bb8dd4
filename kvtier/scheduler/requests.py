"""Requests as values: the pages of consecutive requests, and where to cut them.

A queue entry of the backup or load lane (`kvtier.scheduler.carriers.Carrier`)
carries consecutive requests. Their pages are kept here as plain ints, per
pool one list with the requests' pages one after the other: request ``i`` has
``host[pool][offsets[pool][i]:offsets[pool][i + 1]]`` (an empty range: it does
not name the pool) and the device pages at the same places. Everything in
this module is a pure function of such values: no torch, no awaits, no state
but the lists themselves.

* `RequestPages`: one carrier's requests (append one, read one, the pages of
  the requests still open);
* `concatenated` / `extend`: many requests' page mappings laid end to end, as
  a bulk call validates them a slice at a time;
* `carrier_bounds`: where a bulk call's requests are cut into carriers (a
  batch's bytes and a carrier's request count at most, at least one each);
* `device_pages` / `rest_of_load`: a `load_many`'s device pages in request
  order, and what its requests from one on hold.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "BytesPerPage",
    "Pages",
    "RequestPages",
    "bytes_by_pool",
    "carrier_bounds",
    "concatenated",
    "device_pages",
    "extend",
    "rest_of_load",
]

# Per slot-owning pool: bytes of one of its pages, and (sidecar, bytes of the
# sidecar rows one page of it derives).
BytesPerPage = Mapping[str, tuple[int, tuple[tuple[str, int], ...]]]

# Pages by pool, one request after the other, and each request's offsets.
Pages = tuple[dict[str, list[int]], dict[str, list[int]]]


class RequestPages:
    """The host and device pages of ``count`` consecutive requests (see the module doc)."""

    __slots__ = ("host", "device", "offsets", "count")

    def __init__(
        self, host: dict[str, list[int]], device: dict[str, list[int]], offsets: dict[str, list[int]], count: int
    ) -> None:
        self.host = host
        self.device = device
        self.offsets = offsets
        self.count = count

    @classmethod
    def one(cls, host: dict[str, list[int]], device: Mapping[str, list[int]]) -> RequestPages:
        """The pages of one request."""
        return cls(host, {name: device[name] for name in host}, {name: [0, len(p)] for name, p in host.items()}, 1)

    def append(self, host: Mapping[str, list[int]], device: Mapping[str, list[int]]) -> None:
        """Add one request at the end (it may name pools the others do not)."""
        index = self.count
        for name in host:
            if name not in self.offsets:
                self.offsets[name] = [0] * (index + 1)
                self.host[name], self.device[name] = [], []
        for name, off in self.offsets.items():
            pages = host.get(name)
            if pages is not None:
                self.host[name] += pages
                self.device[name] += device[name]
            off.append(len(self.host[name]))
        self.count = index + 1

    def pages_of(self, index: int, *, host: bool) -> dict[str, list[int]]:
        """Request ``index``'s pages by pool (the pools it names)."""
        source = self.host if host else self.device
        return {name: source[name][off[index]:off[index + 1]]
                for name, off in self.offsets.items() if off[index + 1] > off[index]}

    def counts(self, index: int) -> tuple[tuple[str, int], ...]:
        """Request ``index``'s page count per pool it names."""
        return tuple((name, off[index + 1] - off[index]) for name, off in self.offsets.items()
                     if off[index + 1] > off[index])

    def of_requests(self, indices: Iterable[int]) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """The host and device pages of the requests ``indices``, one after the
        other, by pool (pools none of them names are left out)."""
        host: dict[str, list[int]] = {name: [] for name in self.host}
        device: dict[str, list[int]] = {name: [] for name in self.host}
        for i in indices:
            for name, off in self.offsets.items():
                a, b = off[i], off[i + 1]
                if b > a:
                    host[name] += self.host[name][a:b]
                    device[name] += self.device[name][a:b]
        host = {name: pages for name, pages in host.items() if pages}
        return host, {name: device[name] for name in host}

    def slice(self, a: int, b: int) -> RequestPages:
        """Requests ``a..b-1`` as a `RequestPages` of their own (pools they do not name left out)."""
        offsets, host, device = {}, {}, {}
        for name, off in self.offsets.items():
            lo, hi = off[a], off[b]
            if hi == lo:
                continue
            offsets[name] = [o - lo for o in off[a:b + 1]] if lo else off[a:b + 1]
            host[name] = self.host[name][lo:hi]
            device[name] = self.device[name][lo:hi]
        return RequestPages(host, device, offsets, b - a)


def bytes_by_pool(counts: Iterable[tuple[str, int]], bytes_per_page: BytesPerPage) -> dict[str, int]:
    """Bytes by pool (sidecars included) of ``counts`` pages per slot-owning pool."""
    out = {}
    for name, n in counts:
        if n:
            own, sides = bytes_per_page[name]
            out[name] = n * own
            for side, side_bytes in sides:
                out[side] = n * side_bytes
    return out


def carrier_bounds(
    offsets: Mapping[str, list[int]], count: int, bytes_per_page: BytesPerPage, *,
    max_bytes: int, max_requests: int, allocated: Sequence[frozenset[str]] | None = None,
) -> list[tuple[int, int]]:
    """Where ``count`` requests (their offsets as in `RequestPages`) are cut,
    in order, into carriers: ``(a, b)`` for requests ``a..b-1``, each of at
    most ``max_bytes`` (at least one request) and ``max_requests`` requests.
    ``allocated``: per request, the pools whose device pages kvtier allocates;
    a carrier's requests share theirs."""
    page_bytes = [(off, own + sum(b for _, b in sides)) for off, (own, sides) in
                  ((off, bytes_per_page[name]) for name, off in offsets.items())]
    bounds = []
    b = 0
    while b < count:
        a, total = b, 0
        if len(page_bytes) == 1 and allocated is None:  # one pool: its offsets are the cumulative sizes
            off, page = page_bytes[0]
            last = min(a + max_requests, count)
            fit = last if not page else bisect_right(off, off[a] + max_bytes // page, a, last + 1) - 1
            b = max(a + 1, fit)
        else:
            while b < count and b - a < max_requests:
                size = sum((off[b + 1] - off[b]) * page for off, page in page_bytes)
                if b > a and (total + size > max_bytes or (allocated is not None and allocated[b] != allocated[a])):
                    break
                total += size
                b += 1
        bounds.append((a, b))
    return bounds


def concatenated(each: Sequence[Mapping[str, list[int]]]) -> Pages:
    """Requests' pages by pool, one after the other, and where each request
    starts; a request that does not name a pool has none of it."""
    names = sorted({name for pages in each for name in pages})
    pages: dict[str, list[int]] = {name: [] for name in names}
    offsets: dict[str, list[int]] = {name: [0] for name in names}
    for request in each:
        for name in names:
            own = request.get(name)
            if own:
                pages[name] += own
            offsets[name].append(len(pages[name]))
    return pages, offsets


def extend(out: Pages, before: int, more: Pages, count: int) -> None:
    """Append ``more`` (the pages and offsets of ``count`` requests) to
    ``out``, which holds those of the ``before`` requests ahead of them."""
    pages, offsets = out
    for name in more[0].keys() | pages.keys():
        if name not in pages:
            pages[name], offsets[name] = [], [0] * (before + 1)
        base = len(pages[name])
        own = more[1].get(name)
        if own is None:
            offsets[name].extend([base] * count)
        else:
            offsets[name].extend([base + o for o in own[1:]])
            pages[name].extend(more[0][name])


def device_pages(
    offsets: Mapping[str, list[int]], given: Mapping[str, list[int]], given_offsets: Mapping[str, list[int]],
    owned: Mapping[str, list[int]], count: int,
) -> dict[str, list[int]]:
    """A `load_many`'s device pages by pool, in request order: the pages each
    request gave, and the allocated ``owned`` ones, in turn, for the rest."""
    device: dict[str, list[int]] = {}
    for name, off in offsets.items():
        mine = given_offsets.get(name)
        if mine is None:
            device[name] = owned[name]
        elif mine == off:
            device[name] = given[name]
        else:
            pages: list[int] = []
            at = 0
            for i in range(count):
                a, b = mine[i], mine[i + 1]
                if b > a:
                    pages += given[name][a:b]
                else:
                    n = off[i + 1] - off[i]
                    pages += owned[name][at:at + n]
                    at += n
            device[name] = pages
    return device


def rest_of_load(
    host: Mapping[str, list[int]], device: Mapping[str, list[int]], offsets: Mapping[str, list[int]], done: int,
    allocated: frozenset[str] | Sequence[frozenset[str]],
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """What a `load_many`'s requests from ``done`` on hold: their pinned host
    pages, and the device pages kvtier allocated for them, by pool."""
    owned: dict[str, list[int]] = {}
    for name, off in offsets.items():
        if isinstance(allocated, frozenset):
            rest = device[name][off[done]:] if name in allocated else []
        else:
            rest = [p for i in range(done, len(allocated)) if name in allocated[i]
                    for p in device[name][off[i]:off[i + 1]]]
        if rest:
            owned[name] = rest
    return {name: host[name][off[done]:] for name, off in offsets.items()}, owned
