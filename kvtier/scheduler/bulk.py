"""Carriers: backups and loads carried, many requests to a queue entry.

A serving step that evicts or loads many prefixes should not pay for each of
them what a lone operation pays: its own queue entry, `CacheOperation`, claim,
merge and completion. A bulk call instead splits its requests, in order, into
`Carrier`s of at most a batch's bytes and operations. A carrier is one queue
entry and one `CacheOperation` whose pages are its requests' pages one after
the other, with one claim over all of them; each request is a `BulkPart`, an
`OperationHandle` like any other, which reads its pages and its layer progress
from its carrier.

A lone `backup` / `load` is a carrier of one request; the lone requests
submitted after it, while it is still the lane's newest queued entry and has
room (same priority, no fence, within a batch's bytes and 128 requests),
join it (`Carrier.join`) instead of queueing their own. So lone operations
submitted in a burst cost little more than a bulk call's requests, and the
carrier's `CacheOperation` is rebuilt once, when its batch is taken.

What each request is promised stays its own:

* it resolves once, with its own result or error. A carrier's batch that
  fails fails every request it carries, as it fails every operation of a
  batch of lone operations;
* `BulkPart.cancel` of a request whose carrier is still queued ends it at
  once and gives back what it took; the carrier then copies only the requests
  still open (`Carrier.refresh`), so a page given back is never written again.
  A request whose carrier runs ends after the copies, cancelled, and what it
  took is given back then, as for a running lone operation;
* in verify mode a load whose host pages fail their checksums fails alone,
  before anything is copied;
* a backup's pages are written by its own request (`HostPageOwnership`
  writers are parts): a load that waits on them learns that request's outcome.

Each request counts as one operation in the lane's bound and statistics.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from kvtier.pools import PageList, PoolGroup
from kvtier.scheduler.admission import Admission, Claim
from kvtier.scheduler.device import OperationHandle, OperationResult, new_operation, slots_by_pool
from kvtier.scheduler.lanes import DONE, QUEUED, Lane
from kvtier.transfers import CacheOperation, Direction

__all__ = ["BulkPart", "Carrier", "carriers_of"]

BytesPerPage = Mapping[str, tuple[int, tuple[tuple[str, int], ...]]]


class BulkPart(OperationHandle):
    """One request a `Carrier` carries, of a bulk call or a lone call: the
    handle the caller holds (see the module doc)."""

    __slots__ = ("_carrier", "_index")

    def __init__(self, carrier: Carrier, index: int, op_id: int, bytes_per_pool: Mapping[str, int]) -> None:
        # Not OperationHandle.__init__: a part's operation, claim and progress
        # are its carrier's (`_copies`).
        self.id = op_id
        self.kind = carrier.kind
        self.priority = carrier.priority
        self.nbytes = sum(bytes_per_pool.values())
        self.submitted_ns = carrier.submitted_ns
        self.dispatched_ns = 0
        self.ended_ns = 0
        self.count = 1
        self._lane = carrier.lane
        self._state = QUEUED
        self._cancel_requested = False
        self._future = None
        self._result = None
        self._error = None
        self.direction = carrier.direction
        self.bytes_per_pool = bytes_per_pool
        self._group = carrier._group
        self._carrier = carrier
        self._index = index

    @property
    def state(self) -> str:
        return DONE if self._state == DONE else self._carrier._state

    @property
    def queued(self) -> bool:
        return self.state == QUEUED

    def _copies(self) -> OperationHandle:
        return self._carrier

    def _indices(self, *, host: bool) -> dict[str, torch.Tensor]:
        return slots_by_pool(self._group, self._carrier.pages_of(self._index, host=host))

    def cancel(self) -> bool:
        self._lane.check_caller("cancel()")
        if self._state == DONE:
            return False
        self._cancel_requested = True
        carrier = self._carrier
        if carrier._state == QUEUED:
            carrier.end_part(self, Lane.cancelled(self), self._lane)
            self._lane.drop_request(carrier)
        return True

    def outcome(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._result is None and self._state == DONE:  # made when first asked for
            start = self.dispatched_ns or self.ended_ns
            self._result = OperationResult(
                self.id, self.direction, self.bytes_per_pool,
                seconds_queued=(start - self.submitted_ns) * 1e-9,
                seconds_copying=(self.ended_ns - start) * 1e-9,
                seconds_total=(self.ended_ns - self.submitted_ns) * 1e-9,
            )
        return self._result

    def _resolved(self) -> None:
        """Layer waiters wait on the carrier; it wakes them."""

    def __repr__(self) -> str:
        return f"<OperationHandle {self.id} [{self.direction.value}, {self.state}, {self.nbytes} bytes, bulk]>"


class Carrier(OperationHandle):
    """The queue entry of consecutive requests of one bulk call (see the module doc).

    ``host[pool]`` / ``device[pool]``: the requests' pages one after the
    other; request ``i`` has ``[offsets[pool][i], offsets[pool][i + 1])``
    (an empty range: it does not name the pool). ``allocated``: the pools
    whose device pages kvtier allocated (a load's), freed unless its request
    succeeds.
    """

    __slots__ = ("parts", "host", "device", "offsets", "allocated", "_admission", "_bytes_per_page", "_fence",
                 "_stale", "_split", "_shared", "_joined")

    carries_parts = True

    def __init__(
        self,
        lane: Lane[Any],
        op_id: int,
        direction: Direction,
        host: dict[str, list[int]],
        device: dict[str, list[int]],
        offsets: dict[str, list[int]],
        part_ids: range,
        group: PoolGroup,
        admission: Admission,
        bytes_per_page: BytesPerPage,
        priority: int,
        fence: object | None,
        allocated: frozenset[str] = frozenset(),
    ) -> None:
        op, nbytes = _operation(op_id, direction, host, device, group, bytes_per_page, priority, fence,
                                tuple(part_ids))
        super().__init__(lane, op, self._claim_of(direction, host, device, allocated, group), group, nbytes)
        self.host, self.device, self.offsets, self.allocated = host, device, offsets, allocated
        self._admission = admission
        self._bytes_per_page = bytes_per_page
        self._fence = fence
        self._stale = self._split = self._joined = False  # see refresh / release / join
        # Requests with the same pages per pool share one read-only bytes_per_pool.
        self._shared: dict[tuple[tuple[str, int], ...], Mapping[str, int]] = {}
        parts = []
        if len(offsets) == 1:  # the common case, without a tuple per request
            ((name, off),) = offsets.items()
            for i, part_id in enumerate(part_ids):
                parts.append(BulkPart(self, i, part_id, self._bytes_of(((name, off[i + 1] - off[i]),))))
        else:
            for i, part_id in enumerate(part_ids):
                counts = tuple((name, off[i + 1] - off[i]) for name, off in offsets.items())
                parts.append(BulkPart(self, i, part_id, self._bytes_of(counts)))
        self.parts = parts
        self.count = len(parts)

    def _bytes_of(self, counts: tuple[tuple[str, int], ...]) -> Mapping[str, int]:
        per_pool = self._shared.get(counts)
        if per_pool is None:
            per_pool = self._shared[counts] = MappingProxyType(_bytes_by_pool(counts, self._bytes_per_page))
        return per_pool

    # -- lone requests join the newest queued carrier -----------------------------------------

    def join(
        self, host: dict[str, list[int]], device: dict[str, list[int]], ids: Iterator[int], priority: int,
        allocated: frozenset[str], *, max_bytes: int, max_requests: int,
    ) -> BulkPart | None:
        """Carry one more request (a lone `backup` or `load` submitted while
        this carrier is the lane's newest queued entry), or None when it does
        not fit: another priority or fence, past the batch budget, or a pool
        whose device pages one request allocates and another gave. The
        request's id is taken from ``ids`` once it fits."""
        if priority != self.priority or self._fence is not None or self.count >= max_requests:
            return None
        for name in host:
            if name in self.offsets and (name in self.allocated) != (name in allocated):
                return None
        counts = tuple((name, len(pages)) for name, pages in host.items())
        per_pool = self._bytes_of(counts)
        nbytes = sum(per_pool.values())
        if self.nbytes + nbytes > max_bytes:
            return None
        index = len(self.parts)
        for name in host:
            if name not in self.offsets:
                self.offsets[name] = [0] * (index + 1)
                self.host[name], self.device[name] = [], []
                if name in allocated:
                    self.allocated |= {name}
                    self.claim.device[name] = PageList(self.device[name], self._group[name].page_size)
        for name, off in self.offsets.items():
            pages = host.get(name)
            if pages is not None:
                self.host[name] += pages
                self.device[name] += device[name]
            off.append(len(self.host[name]))
        part = BulkPart(self, index, next(ids), per_pool)
        part.submitted_ns = time.perf_counter_ns()
        self.parts.append(part)
        self.count += 1
        self.nbytes += nbytes
        self._stale = self._joined = True
        if self.direction is Direction.BACKUP:
            self._admission.start_write_pages(host, part)
        return part

    @staticmethod
    def _claim_of(
        direction: Direction, host: dict[str, list[int]], device: Mapping[str, list[int]],
        allocated: frozenset[str], group: PoolGroup,
    ) -> Claim:
        if direction is Direction.BACKUP:
            return Claim(writes=host)
        return Claim(reads=host, device={name: PageList(device[name], group[name].page_size) for name in allocated})

    # -- the requests' pages ----------------------------------------------------------------

    def pages_of(self, index: int, *, host: bool) -> dict[str, list[int]]:
        source = self.host if host else self.device
        return {name: source[name][off[index]:off[index + 1]]
                for name, off in self.offsets.items() if off[index + 1] > off[index]}

    def part_claim(self, index: int) -> Claim:
        host = self.pages_of(index, host=True)
        if self.direction is Direction.BACKUP:
            return Claim(writes=host)
        device = self.pages_of(index, host=False)
        return self._claim_of(self.direction, host, device, self.allocated & device.keys(), self._group)

    def live_parts(self) -> list[BulkPart]:
        return [p for p in self.parts if p._state != DONE]

    def request_ids(self) -> tuple[int, ...]:
        return tuple(p.id for p in self.parts if p._state != DONE)

    def start_writes(self) -> None:
        """Record each request as the writer of its host pages (a backup's)."""
        for name, pages in self.host.items():
            self._admission.start_part_writes(name, pages, self.offsets[name], self.parts)

    # -- requests that end early --------------------------------------------------------------

    def end_part(self, part: BulkPart, error: BaseException, lane: Lane[Any]) -> None:
        """End one request before the copies (cancelled while queued, or its
        host pages failed their checksums): what it took goes back now, and the
        carrier no longer copies it."""
        if part._state == DONE:
            return
        self._stale = self._split = True
        self._admission.release(self.part_claim(part._index), succeeded=False)
        part._state = DONE
        part.dispatched_ns = self.dispatched_ns
        now = part.ended_ns = time.perf_counter_ns()
        start = part.dispatched_ns or now
        lane.counters.ended(part.id, lane.name, error, 0, start - part.submitted_ns, now - start)
        part._resolve(None, error)
        self.wake()  # its layer waiters wait on the carrier

    def refresh(self) -> bool:
        """Rebuild the operation from the requests carried, once some joined
        (the claim holds them already) or ended early (the claim too is
        rebuilt from those still open); False when none is open."""
        if not self._stale:
            return True
        if not self._split:  # requests only joined: the lists hold every one of them
            self._stale = False
            self.operation = _operation(self.id, self.direction, self.host, self.device, self._group,
                                        self._bytes_per_page, self.priority, self._fence,
                                        tuple(p.id for p in self.parts))[0]
            return True
        live = self.live_parts()
        if not live:
            return False
        self._stale = False
        host: dict[str, list[int]] = {name: [] for name in self.host}
        device: dict[str, list[int]] = {name: [] for name in self.host}
        for part in live:
            i = part._index
            for name, off in self.offsets.items():
                a, b = off[i], off[i + 1]
                host[name] += self.host[name][a:b]
                device[name] += self.device[name][a:b]
        host = {name: pages for name, pages in host.items() if pages}
        device = {name: device[name] for name in host}
        self.operation = _operation(self.id, self.direction, host, device, self._group, self._bytes_per_page,
                                    self.priority, self._fence, tuple(p.id for p in live))[0]
        self.claim = self._claim_of(self.direction, host, device, self.allocated & host.keys(), self._group)
        return True

    # -- the end ---------------------------------------------------------------------------------

    def release(self, error: BaseException | None) -> None:
        """Give back what the open requests hold: each keeps its pages when
        the copies succeeded and it was not cancelled."""
        admission = self._admission
        if not self._split and not any(p._cancel_requested for p in self.parts):
            admission.release(self.claim, succeeded=error is None)
            return
        self.claim.released = True
        for part in self.live_parts():
            admission.release(self.part_claim(part._index), succeeded=error is None and not part._cancel_requested)

    def _end_parts(self, lane: Lane[Any], error: BaseException | None, *, count: bool) -> None:
        now = self.ended_ns
        start = self.dispatched_ns or now
        queued, running = start - self.submitted_ns, now - start
        completed = nbytes = 0
        for part in self.parts:
            if part._state == DONE:
                continue
            own = Lane.cancelled(part) if part._cancel_requested else error
            part._state = DONE
            part.dispatched_ns = self.dispatched_ns
            part.ended_ns = now
            if own is None and not self._joined:
                completed += 1
                nbytes += part.nbytes
            elif count:  # its own submission time (a lone request that joined), or it failed
                lane.counters.ended(part.id, lane.name, own, part.nbytes if own is None else 0,
                                    start - part.submitted_ns, running)
            part._resolve(None, own)
        if count and completed:
            lane.counters.completed_many(completed, nbytes, queued, running)

    def __repr__(self) -> str:
        return f"<Carrier {self.id} [{self.direction.value}, {self.state}, {self.count} requests, {self.nbytes} bytes]>"


def _bytes_by_pool(counts: tuple[tuple[str, int], ...], bytes_per_page: BytesPerPage) -> dict[str, int]:
    out = {}
    for name, n in counts:
        if n:
            own, sides = bytes_per_page[name]
            out[name] = n * own
            for side, side_bytes in sides:
                out[side] = n * side_bytes
    return out


def _operation(
    op_id: int, direction: Direction, host: Mapping[str, list[int]], device: Mapping[str, list[int]],
    group: PoolGroup, bytes_per_page: BytesPerPage, priority: int, fence: object | None, requests: tuple[int, ...],
) -> tuple[CacheOperation, dict[str, int]]:
    return new_operation(
        op_id, direction,
        {name: PageList(pages, group[name].page_size) for name, pages in host.items()},
        {name: PageList(device[name], group[name].page_size) for name in host},
        group, bytes_per_page, priority, fence, requests,
    )


def carriers_of(
    lane: Lane[Any],
    direction: Direction,
    host: dict[str, list[int]],
    device: dict[str, list[int]],
    offsets: dict[str, list[int]],
    requests: int,
    carrier_ids: Iterator[int],
    ids: Iterator[int],
    group: PoolGroup,
    admission: Admission,
    bytes_per_page: BytesPerPage,
    *,
    priority: int,
    fence: object | None,
    max_bytes: int,
    max_ops: int,
    allocated: frozenset[str] | Sequence[frozenset[str]] = frozenset(),
) -> Iterator[Carrier]:
    """Split ``requests`` requests (their pages and offsets as in `Carrier`),
    in order, into carriers, made as they are asked for, of at most
    ``max_bytes`` (at least one request each) and ``max_ops`` requests. ``allocated``: the pools whose device
    pages kvtier allocated, for every request or for each (a carrier's
    requests share theirs). Carriers take their ids from ``carrier_ids``,
    requests theirs from ``ids``."""
    page_bytes = [(off, own + sum(b for _, b in sides)) for off, (own, sides) in
                  ((off, bytes_per_page[name]) for name, off in offsets.items())]
    common, each = (allocated, None) if isinstance(allocated, frozenset) else (frozenset[str](), allocated)
    b = 0
    while b < requests:
        # The most requests from a on that fit the budget, at least one.
        a, total = b, 0
        if len(page_bytes) == 1 and each is None:  # one pool: its offsets are the cumulative sizes
            off, page = page_bytes[0]
            last = min(a + max_ops, requests)
            fit = last if not page else bisect_right(off, off[a] + max_bytes // page, a, last + 1) - 1
            b = max(a + 1, fit)
        else:
            while b < requests and b - a < max_ops:
                size = sum((off[b + 1] - off[b]) * page for off, page in page_bytes)
                if b > a and (total + size > max_bytes or (each is not None and each[b] != each[a])):
                    break
                total += size
                b += 1
        own_offsets = {}
        chunk_host, chunk_device = {}, {}
        for name, off in offsets.items():
            lo, hi = off[a], off[b]
            if hi == lo:
                continue
            own_offsets[name] = [o - lo for o in off[a:b + 1]]
            chunk_host[name] = host[name][lo:hi]
            chunk_device[name] = device[name][lo:hi]
        carrier_id = next(carrier_ids)
        first = next(ids)
        for _ in range(b - a - 1):
            next(ids)
        yield Carrier(
            lane, carrier_id, direction, chunk_host, chunk_device, own_offsets, range(first, first + b - a),
            group, admission, bytes_per_page, priority, fence,
            (common if each is None else each[a]) & chunk_host.keys(),
        )

