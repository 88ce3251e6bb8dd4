"""Carriers: the queue entries of the backup and load lanes.

Every backup and load request is carried: a bulk call's requests (a
`backup_many` / `load_many`) are cut, in order, into `Carrier`s of at most a
batch's bytes and 128 requests (`kvtier.scheduler.requests.carrier_bounds`); a
lone `backup` / `load` is a carrier of one request, and the lone requests
submitted after it, while it is still the lane's newest queued entry and has
room (same priority, no fence, within a batch's bytes and 128 requests),
join it (`Carrier.join`). A carrier is one queue entry, one `CacheOperation`
(its requests' pages one after the other, made once, when its batch is taken)
and one claim over all of them.

A carrier is a record, not a handle. It owns every transition of the requests
it carries, and their state lives in it, by request index: which ended early
(cancelled while queued, refused by verify mode) and with what, which were
asked to cancel while running, who waits for which, and the outcome of the
rest, one for all. The caller's handles (`OperationHandle`: the carrier, an
index, an id) only read it. One path ends a request however it ends:
`end_request` before the copies, `settle` (called by the lane's `finish`)
after them.

What each request is promised stays its own:

* it resolves once, with its own result or error; a batch that fails fails
  every request still open in it;
* a request cancelled while its carrier is queued ends at once and gives back
  what it took; the carrier then copies only the requests still open
  (`prepare`), so a page given back is never written again. One cancelled
  while its carrier runs ends after the copies, cancelled, and gives back what
  it took then;
* in verify mode a load whose host pages fail their checksums fails alone,
  before anything is copied;
* a backup's pages are written by its own request (the `HostPageOwnership`
  writer of a bulk call's pages is the carrier, by request: `writer_of` makes
  the request's handle only when a load waits on them): a load that waits on
  them learns that request's outcome.

`carry` and `carry_many` are the carry step of a submission (after parse and
admission): they make or join carriers and record a backup's requests as the
writers of their pages on the pages' `HostPageOwnership`. The only call a
carrier makes on admission is its one undo, `Admission.release`.

Each request counts as one operation in the lane's bound and statistics. No
reference cycle is made per request: the carrier keeps its requests' ids, not
their handles, and drops its batch's progress when it ends.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from kvtier.errors import InvalidIndices, NotFinished, OperationCancelled, SchedulerClosed
from kvtier.pools import HostPageOwnership, PageList, PoolGroup
from kvtier.transfers import eventloop
from kvtier.scheduler.admission import Admission
from kvtier.scheduler.claims import Claim
from kvtier.scheduler.handles import OperationHandle, OperationResult
from kvtier.scheduler.lanes import DONE, QUEUED, Lane, StepClock, cancelled
from kvtier.scheduler.requests import BytesPerPage, RequestPages, bytes_by_pool, carrier_bounds, rest_of_load
from kvtier.transfers import CacheOperation, Direction, LayerProgress, PoolTransfer

__all__ = ["Carrier", "CarrierContext", "carry", "carry_many", "new_operation"]

# Per pool (and sidecar): its requests' slots one after the other, their page offsets, slots per page.
_Slots = dict[str, tuple[np.ndarray, list[int], int]]

_now_ns = time.perf_counter_ns
_BACKUP = Direction.BACKUP

# The key of `settled_all`'s waiters among the requests' (indices are >= 0).
_ALL = -1

# Distinct per-pool page counts whose bytes-by-pool mappings a lane keeps.
_SHARED_LIMIT = 1024


@dataclass(eq=False)
class CarrierContext:
    """What every carrier of one lane shares: its lane and direction, the
    group, admission (whose `Admission.release` a carrier calls once, as it
    ends) and the pages' ownership records, bytes per page, the budget a
    carrier keeps to, and the id counters."""

    lane: Lane[Any]
    direction: Direction
    group: PoolGroup
    admission: Admission
    # Each slot-owning host pool's page ownership: a backup's carrier is the writer of its pages.
    owners: Mapping[str, HostPageOwnership]
    bytes_per_page: BytesPerPage
    max_bytes: int
    max_requests: int
    # The scheduler's request ids (every kind's) and carrier ids (both copy lanes').
    ids: Iterator[int]
    carrier_ids: Iterator[int]
    # Requests with the same pages per pool share one read-only bytes_per_pool.
    shared: dict[tuple[tuple[str, int], ...], Mapping[str, int]] = field(default_factory=dict)
    # Per slot-owning pool, bytes of one of its pages with its sidecars' rows.
    page_bytes: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.page_bytes = {name: own + sum(b for _, b in sides) for name, (own, sides) in self.bytes_per_page.items()}

    def bytes_of(self, counts: tuple[tuple[str, int], ...]) -> Mapping[str, int]:
        per_pool = self.shared.get(counts)
        if per_pool is None:
            if len(self.shared) >= _SHARED_LIMIT:
                self.shared.clear()
            per_pool = self.shared[counts] = MappingProxyType(bytes_by_pool(counts, self.bytes_per_page))
        return per_pool


class Carrier:
    """The queue entry of consecutive requests (see the module doc).

    ``requests``: their pages (`RequestPages`); ``ids[i]``: request ``i``'s
    id; ``allocated``: the pools whose device pages kvtier allocated (a
    load's), freed unless its request succeeds; ``count``: the requests it
    counts in its lane's bound (those not ended early, while it is queued).
    """

    __slots__ = (
        # What the lane reads and writes: the queue entry.
        "id", "kind", "priority", "nbytes", "count", "submitted_ns", "dispatched_ns", "ended_ns", "state",
        # What it carries.
        "ctx", "direction", "requests", "ids", "allocated", "claim", "fence", "operation", "progress",
        # The requests' own state, by index (None until needed).
        "_error", "_early", "_cancelled", "_futures", "_joined", "_layer_waiters", "_views", "_one_host", "_stale",
        "_split",
        "_partial",
    )

    def __init__(
        self, ctx: CarrierContext, op_id: int, requests: RequestPages, ids: list[int], *,
        priority: int, fence: object | None, allocated: frozenset[str],
    ) -> None:
        self.ctx = ctx
        self.id = op_id
        self.kind = ctx.lane.name
        self.direction = ctx.direction
        self.priority = priority
        self.requests = requests
        self.ids = ids
        self.count = requests.count
        self.allocated = allocated
        self.fence = fence
        self.nbytes = sum(len(p) * ctx.page_bytes[name] for name, p in requests.host.items())
        self.submitted_ns = time.perf_counter_ns()
        self.dispatched_ns = self.ended_ns = 0
        self.state = QUEUED  # the lane's view (`Entry.state`), written by the lane
        self.claim = self._claim_of(requests.host, requests.device, allocated)
        self.operation: CacheOperation | None = None
        self.progress: LayerProgress | None = None
        self._error: BaseException | None = None
        self._early: dict[int, tuple[BaseException, int]] = {}
        self._cancelled: set[int] | None = None
        # Per request, a future per task waiting for its end: each waiter's own,
        # so a cancelled waiter cancels nothing another waits on (no shield needed).
        self._futures: dict[int, list[eventloop.Future[None]]] | None = None
        self._joined: dict[int, int] | None = None  # index -> submission time of a request that joined
        self._layer_waiters: dict[int, list[eventloop.Future[None]]] | None = None
        # Per side (host or device), made when first read: the carrier's slot
        # arrays (never handed out), their handed copy, and which requests'
        # ranges of it were handed (each once; see indices_of).
        self._views: dict[bool, tuple[_Slots | None, dict[str, tuple[np.ndarray, list[int]]], bytearray]] = {}
        # The host side's views when they hold one pool (no sidecar): its name, handed array,
        # slot offsets and first-read marks, for `host_indices_of`.
        self._one_host: tuple[str, np.ndarray, list[int], bytearray] | None = None
        self._stale = False  # requests joined or ended since the operation was made
        self._split = False  # some request ended early: the claim is given back request by request
        # Per request with a partial host page (PoolGroup.valid_rows): its bytes by pool, as they
        # move; made with the operation (no page can lose its counts while the carrier holds it).
        self._partial: dict[int, Mapping[str, int]] | None = None

    def handles(self) -> list[OperationHandle]:
        """One handle per request, in order (made by the submitting call)."""
        return [OperationHandle(self, i, op_id) for i, op_id in enumerate(self.ids)]

    def _claim_of(
        self, host: dict[str, list[int]], device: Mapping[str, list[int]], allocated: frozenset[str]
    ) -> Claim:
        if self.direction is Direction.BACKUP:
            return Claim(writes=host)
        group = self.ctx.group
        return Claim(reads=host, device={name: PageList(device[name], group[name].page_size) for name in allocated})

    def start_writes(self, handles: list[OperationHandle] | None = None) -> None:
        """Record each request as the writer of its host pages (a backup's):
        ``handles[i]``, or without handles the carrier by request (`writer_of`)."""
        owners = self.ctx.owners
        offsets = self.requests.offsets
        for name, pages in self.requests.host.items():
            if handles is None:  # request i of this carrier writes pages[offsets[i]:offsets[i + 1]], no object each
                owners[name].start_parts(pages, offsets[name], self)
            else:
                owners[name].start_writes(pages, offsets[name], handles)

    def writer_of(self, index: int) -> OperationHandle:
        """Request ``index`` as the writer of its pages, made when a load waits on them."""
        return OperationHandle(self, index, self.ids[index])

    # -- what a request's handle reads ----------------------------------------------------------

    def bytes_of(self, index: int) -> Mapping[str, int]:
        partial = self._partial
        if partial is not None:
            exact = partial.get(index)
            if exact is not None:
                return exact
        offsets = self.requests.offsets
        if len(offsets) == 1:  # the common case, without a tuple per pool
            for name, off in offsets.items():
                return self.ctx.bytes_of(((name, off[index + 1] - off[index]),))
        return self.ctx.bytes_of(self.requests.counts(index))

    def done_of(self, index: int) -> bool:
        return self.state == DONE or index in self._early

    def state_of(self, index: int) -> str:
        return DONE if index in self._early else self.state

    def error_of(self, index: int) -> BaseException | None:
        early = self._early.get(index)
        if early is not None:
            return early[0]
        return self._error if self.state == DONE else None

    def cancel_requested(self, index: int) -> bool:
        return bool(self._cancelled and index in self._cancelled) or (
            index in self._early and isinstance(self._early[index][0], OperationCancelled))

    def submitted_of(self, index: int) -> int:
        joined = self._joined
        return joined.get(index, self.submitted_ns) if joined else self.submitted_ns

    def outcome(self, index: int, op_id: int) -> OperationResult:
        """Request ``index``'s result (its handle keeps the one it asked for), or raise its error."""
        if self._early:
            early = self._early.get(index)
            if early is not None:
                raise early[0]
        if self.state != DONE:
            raise NotFinished(f"operation {op_id} has not ended; await it first")
        if self._error is not None:
            raise self._error
        return OperationResult(self, index, op_id)

    def seconds_of(self, index: int) -> tuple[float, float, float]:
        """Request ``index``'s seconds queued, copying and in all (once it ended)."""
        early = self._early.get(index) if self._early else None
        ended = early[1] if early is not None else self.ended_ns
        submitted = self.submitted_of(index)
        start = self.dispatched_ns or ended
        return (start - submitted) * 1e-9, (ended - start) * 1e-9, (ended - submitted) * 1e-9

    async def settled(self, index: int) -> None:
        if self.done_of(index):
            return
        futures = self._futures
        if futures is None:
            futures = self._futures = {}
        future: eventloop.Future[None] = self.ctx.lane.new_future()
        waiting = futures.get(index)
        if waiting is None:
            futures[index] = [future]
        else:
            waiting.append(future)
        await future

    @property
    def ended(self) -> bool:
        """True once every request it carries has ended."""
        return self.state == DONE

    async def settled_all(self) -> None:
        """Return once every request it carries has ended (a bulk call's one wait)."""
        if self.state == DONE:
            return
        futures = self._futures
        if futures is None:
            futures = self._futures = {}
        future: eventloop.Future[None] = self.ctx.lane.new_future()
        futures.setdefault(_ALL, []).append(future)
        await future

    def fill_outcomes(self, status: np.ndarray, errors: dict[int, BaseException], base: int) -> None:
        """Once it ended: the code of request ``i`` in ``status[base + i]`` (0
        done, 1 failed, 2 cancelled) and its error in ``errors[base + i]``."""
        if self._error is None and not self._early:
            return
        for i in range(self.requests.count):
            error = self.error_of(i)
            if error is not None:
                # A cancelling close is the caller's doing, as a cancel is: not a failure.
                status[base + i] = 2 if isinstance(error, (OperationCancelled, SchedulerClosed)) else 1
                errors[base + i] = error

    def indices_of(self, index: int, *, host: bool) -> dict[str, torch.Tensor]:
        """Request ``index``'s slots by pool, sidecars included, as tensors
        the caller owns: nothing kvtier does later changes them, and no write
        to them changes a later read (see `kvtier.scheduler.handles`).

        Per side the carrier makes its requests' slots once, as one array per
        pool, the handed array, from its page lists (never handed out): a
        request's first read is a view of its range of the handed array
        (``torch.from_numpy`` of a numpy slice: no torch operator, so no
        release of the GIL), which no other read is given; a later read of the
        same request copies its range of an array the carrier makes again from
        its page lists for such reads (its own: never handed out)."""
        made = self._views.get(host)
        if made is None:
            # The handed arrays with each request's slot offsets (page offsets times slots per page).
            handed_now = {name: (a, off if k == 1 else [o * k for o in off])
                          for name, (a, off, k) in self._slot_arrays(host).items()}
            made = self._views[host] = (None, handed_now, bytearray(self.requests.count))
            if host and len(handed_now) == 1:  # one pool: every request names it
                for name, (slots, at) in handed_now.items():
                    self._one_host = (name, slots, at, made[2])
        own, handed, first = made
        if not first[index]:
            first[index] = 1
            if len(handed) == 1:  # the common case: one pool (and the request names it)
                for name, (slots, at) in handed.items():
                    a, b = at[index], at[index + 1]
                    if b > a:
                        return {name: torch.from_numpy(slots[a:b])}
            out: dict[str, torch.Tensor] = {}
            for name, (slots, at) in handed.items():
                a, b = at[index], at[index + 1]
                if b > a:  # a request that does not name the pool has none of it
                    out[name] = torch.from_numpy(slots[a:b])
            return out
        if own is None:  # a second read of some request: the carrier's own arrays, made once
            own = self._slot_arrays(host)
            self._views[host] = (own, handed, first)
        out = {}
        for name, (slots, off, per_page) in own.items():
            a, b = off[index] * per_page, off[index + 1] * per_page
            if b > a:
                out[name] = torch.from_numpy(slots[a:b].copy())
        return out

    def host_indices_of(self, index: int) -> dict[str, torch.Tensor]:
        """``indices_of(index, host=True)``, a one-pool carrier's first read of
        a request without the general path's lookups (what a handle's
        ``host_indices`` reads, once per request on the engine's hot path)."""
        one = self._one_host
        if one is not None:
            name, slots, at, first = one
            if not first[index]:
                first[index] = 1
                return {name: torch.from_numpy(slots[at[index]:at[index + 1]])}
        return self.indices_of(index, host=True)

    def host_pages_of(self, index: int) -> dict[str, list[int]]:
        """Request ``index``'s host page numbers by slot-owning pool (what `free_host` of its handle frees)."""
        return self.requests.pages_of(index, host=True)

    def _slot_arrays(self, host: bool) -> dict[str, tuple[np.ndarray, list[int], int]]:
        """Per pool (and sidecar) of the carrier: its requests' slots one after
        the other as an int64 array, the requests' page offsets, and slots per
        page. Made from the page numbers in Python: a numpy or torch operator
        would let the GIL go, a switch interval each beside a busy thread."""
        group = self.ctx.group
        requests = self.requests
        pages = requests.host if host else requests.device
        out: dict[str, tuple[np.ndarray, list[int], int]] = {}
        for name, off in requests.offsets.items():
            size = group[name].page_size
            mine = pages[name]
            slots = mine if size == 1 else [p * size + k for p in mine for k in range(size)]
            out[name] = (np.array(slots, dtype=np.int64), off, size)
            for side in group.sidecars_of(name):
                sidecar = side.sidecar
                assert sidecar is not None
                k = sidecar.rows_per_page
                rows = mine if k == 1 else [p * k + r for p in mine for r in range(k)]
                out[side.name] = (np.array(rows, dtype=np.int64), off, k)
        return out

    # -- layers -----------------------------------------------------------------------------------

    async def until_layer(self, index: int, layer: int, *, device_wait: bool, stream: object | None) -> None:
        num_layers = self.ctx.group.num_layers
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < num_layers:
            raise InvalidIndices(
                f"layer {layer!r} is out of range; this group has transfer layers 0..{num_layers - 1}",
                rule="layer-in-range",
            )
        while True:
            if self.done_of(index):
                self.outcome(index, self.ids[index])
                return
            progress = self.progress
            if progress is not None:
                progress.watched = True  # before reading progress: see LayerProgress
                events = progress.layer_events
                if device_wait and events is not None:
                    assert progress.default_stream is not None
                    target = stream if stream is not None else progress.default_stream()
                    target.wait_event(events[layer])  # type: ignore[attr-defined]
                    return
                if progress.layers_done > layer:
                    return
            waiters = self._layer_waiters
            if waiters is None:
                waiters = self._layer_waiters = {}
            future: eventloop.Future[None] = self.ctx.lane.new_future()
            waiters.setdefault(layer, []).append(future)
            await future

    @property
    def watched(self) -> bool:
        """Someone waits for a layer of one of its requests (`until_layer`)."""
        return bool(self._layer_waiters)

    def wake(self) -> None:
        """Progress was reported: wake the waiters of the layers that landed
        (all of them once device events are published)."""
        waiters = self._layer_waiters
        if not waiters:
            return
        progress = self.progress
        if progress is None or progress.layer_events is not None:
            self._wake_all_layers()
            return
        landed = progress.layers_done
        _wake_all([waiters.pop(layer) for layer in [layer for layer in waiters if layer < landed]])

    def _wake_all_layers(self) -> None:
        waiters, self._layer_waiters = self._layer_waiters, None
        if waiters:
            _wake_all(waiters.values())

    # -- lone requests join the newest queued carrier -------------------------------------------

    def join(
        self, host: dict[str, list[int]], device: dict[str, list[int]], ids: Iterator[int], priority: int,
        allocated: frozenset[str],
    ) -> OperationHandle | None:
        """Carry one more request (a lone `backup` or `load` submitted while
        this carrier is the lane's newest queued entry), or None when it does
        not fit: another priority or fence, past the batch budget, or a pool
        whose device pages one request allocates and another gave. The
        request's id is taken from ``ids`` once it fits."""
        ctx = self.ctx
        requests = self.requests
        if priority != self.priority or self.fence is not None or requests.count >= ctx.max_requests:
            return None
        offsets = requests.offsets
        if len(host) == 1 and len(offsets) == 1 and not allocated and not self.allocated:
            # The commonest: the pool the carrier's requests name, no device page allocated.
            ((name, pages),) = host.items()
            off = offsets.get(name)
            if off is not None:
                nbytes = len(pages) * ctx.page_bytes[name]
                if self.nbytes + nbytes > ctx.max_bytes:
                    return None
                index = requests.count
                own = requests.host[name]
                own += pages
                requests.device[name] += device[name]
                off.append(len(own))
                requests.count = index + 1
                return self._joined_one(index, nbytes, ids, host)
        if len(host) == 1:  # one pool, without a tuple per pool
            ((name, pages),) = host.items()
            if name in offsets and (name in self.allocated) != (name in allocated):
                return None
            nbytes = len(pages) * ctx.page_bytes[name]
        else:
            for name in host:
                if name in offsets and (name in self.allocated) != (name in allocated):
                    return None
            page_bytes = ctx.page_bytes
            nbytes = sum(len(pages) * page_bytes[name] for name, pages in host.items())
        if self.nbytes + nbytes > ctx.max_bytes:
            return None
        new = [name for name in allocated if name not in offsets] if allocated else None
        index = requests.count
        if len(host) == 1 and len(offsets) == 1 and name in offsets:
            own = requests.host[name]
            own += pages
            requests.device[name] += device[name]
            offsets[name].append(len(own))
            requests.count = index + 1
        else:
            requests.append(host, device)
        if new:
            for name in new:  # pools this request brings whose device pages kvtier allocated
                self.allocated |= {name}
                self.claim.device[name] = PageList(requests.device[name], ctx.group[name].page_size)
        return self._joined_one(index, nbytes, ids, host)

    def _joined_one(self, index: int, nbytes: int, ids: Iterator[int], host: dict[str, list[int]]) -> OperationHandle:
        """The rest of `join` once request ``index``'s pages are appended: its
        id, counts, join time and handle, and a backup's ownership record."""
        op_id = next(ids)
        self.ids.append(op_id)
        self.count += 1
        self.nbytes += nbytes
        joined = self._joined
        if joined is None:
            joined = self._joined = {}
        joined[index] = _now_ns()
        self._stale = True
        if self._views:
            self._views.clear()
            self._one_host = None
        handle = OperationHandle(self, index, op_id)
        if self.direction is _BACKUP:
            owners = self.ctx.owners
            for name, pages in host.items():
                owners[name].start_write(pages, handle)
        return handle

    # -- the requests' pages ----------------------------------------------------------------------

    def part_claim(self, index: int) -> Claim:
        """What request ``index`` holds, as a claim of its own."""
        host = self.requests.pages_of(index, host=True)
        if self.direction is Direction.BACKUP:
            return Claim(writes=host)
        device = self.requests.pages_of(index, host=False)
        return self._claim_of(host, device, self.allocated & device.keys())

    def live(self) -> list[int]:
        """The indices of the requests still open."""
        early = self._early
        n = self.requests.count
        return [i for i in range(n) if i not in early] if early else list(range(n))

    def ending_error(self, error: BaseException | None) -> BaseException | None:
        """What the carrier ends with (`Entry.ending_error`): ``error``. It is
        never cancelled whole; a request's accepted cancel wins in `settle`."""
        return error

    def request_ids(self) -> tuple[int, ...]:
        """The ids of the requests this carrier carries and has not ended."""
        early = self._early
        return tuple(op_id for i, op_id in enumerate(self.ids) if i not in early)

    def prepare(self) -> bool:
        """Make the operation of the requests still open (once, or again once
        some joined or ended early; the claim too is then made from those
        still open); False when none is open."""
        if self.state == DONE:
            return False
        if self.operation is not None and not self._stale:
            return True
        ctx = self.ctx
        self._stale = False
        if not self._split:  # the lists hold every request
            self.operation = new_operation(self.id, self.direction, self.requests.host, self.requests.device,
                                           ctx.group, ctx.bytes_per_page, self.priority, self.fence, tuple(self.ids))
            if ctx.group.valid_rows:  # pages with fewer valid rows: the lane counts the bytes that move
                self.nbytes = self.operation.nbytes
                self._partial = self._partial_bytes(range(self.requests.count))
            return True
        live = self.live()
        if not live:
            return False
        host, device = self.requests.of_requests(live)
        self.operation = new_operation(self.id, self.direction, host, device, ctx.group, ctx.bytes_per_page,
                                       self.priority, self.fence, tuple(self.ids[i] for i in live))
        self.claim = self._claim_of(host, device, self.allocated & host.keys())
        if ctx.group.valid_rows:
            self._partial = self._partial_bytes(live)
        return True

    def _partial_bytes(self, indices: Iterable[int]) -> dict[int, Mapping[str, int]] | None:
        """The bytes by pool of the requests of ``indices`` that name a
        partial host page: the valid rows of each page, sidecars included."""
        group = self.ctx.group
        valid_rows = group.valid_rows
        if not any(valid_rows.values()):
            return None
        bytes_per_page = self.ctx.bytes_per_page
        out: dict[int, Mapping[str, int]] = {}
        for i in indices:
            mine = self.requests.pages_of(i, host=True)
            per_pool: dict[str, int] = {}
            partial = False
            for name, pages in mine.items():
                own, sides = bytes_per_page[name]
                for pool, nbytes in ((name, own), *sides):
                    table = valid_rows.get(pool)
                    if table and any(p in table for p in pages):
                        rows = group[pool].page_size  # a sidecar's: its rows per source page
                        per_pool[pool] = sum(table.get(p, rows) for p in pages) * (nbytes // rows)
                        partial = True
                    else:
                        per_pool[pool] = len(pages) * nbytes
            if partial:
                out[i] = MappingProxyType(per_pool)
        return out or None

    # -- the ends of requests ------------------------------------------------------------------------

    def cancel(self, index: int) -> bool:
        """Cancel request ``index`` (see `OperationHandle.cancel`): a queued
        carrier lets it go now; a running one (the lane set RUNNING) ends it
        cancelled after the copies."""
        lane = self.ctx.lane
        lane.check_caller("cancel()")
        if self.done_of(index):
            return False
        if self.state == QUEUED:
            self.end_request(index, cancelled(self.ids[index]))
            lane.drop_request(self)
        else:
            if self._cancelled is None:
                self._cancelled = set()
            self._cancelled.add(index)
        return True

    def end_request(self, index: int, error: BaseException) -> None:
        """End one request before the copies (cancelled while queued, or its
        host pages failed their checksums): what it took goes back now, and the
        carrier no longer copies it."""
        if self.done_of(index):
            return
        self._stale = self._split = True
        lane = self.ctx.lane
        self.ctx.admission.release(self.part_claim(index), succeeded=False)
        now = time.perf_counter_ns()
        self._early[index] = (error, now)
        start = self.dispatched_ns or now
        lane.counters.ended(self.ids[index], lane.name, error, 0, start - self.submitted_of(index), now - start)
        if self._futures:
            _wake_all([self._futures.pop(index, [])])
        self._wake_all_layers()  # its layer waiters re-check

    def release(self, error: BaseException | None) -> None:
        """Give back what the open requests hold: each keeps its pages when
        the copies succeeded and it was not cancelled (the lane's work calls
        this once, as the carrier ends)."""
        admission = self.ctx.admission
        asked = self._cancelled
        if not self._split and not asked:
            admission.release(self.claim, succeeded=error is None)
            return
        self.claim.released = True
        for i in self.live():
            admission.release(self.part_claim(i), succeeded=error is None and not (asked and i in asked))

    def settle(self, result: object, error: BaseException | None, lane: Lane[Any] | None) -> None:
        """The carrier ended (`Lane.finish`, after `release`): every request
        still open ends with ``error`` (cancelled, if its cancel was accepted),
        counted in ``lane``'s counters unless it is None (a submission undone)."""
        now = self.ended_ns
        start = self.dispatched_ns or now
        early = self._early
        asked = self._cancelled
        if asked:
            for i in asked:
                if i not in early:
                    early[i] = (error_i := cancelled(self.ids[i]), now)
                    if lane is not None:
                        lane.counters.ended(self.ids[i], lane.name, error_i, 0, start - self.submitted_of(i), now - start)
        self._error = error
        if lane is not None:
            self._count(lane, error, start, now)
        self.progress = None  # breaks carrier -> progress -> wake -> carriers
        futures, self._futures = self._futures, None
        if futures:
            _wake_all(futures.values())
        self._wake_all_layers()

    def _count(self, lane: Lane[Any], error: BaseException | None, start: int, now: int) -> None:
        """Count the requests that ended with the carrier (the others were counted as they ended)."""
        counters = lane.counters
        early = self._early
        joined = self._joined
        running = now - start
        if error is not None:
            for i, op_id in enumerate(self.ids):
                if i not in early:
                    counters.ended(op_id, lane.name, error, 0, start - self.submitted_of(i), running)
            return
        if not early:  # every request completed: with the carrier, or each from when it joined
            together = self.requests.count - (len(joined) if joined else 0)
            counters.completed_many(together, self.nbytes, start - self.submitted_ns, running)
            if joined:
                counters.completed_each([start - t for t in joined.values()], running)
            return
        together = nbytes = 0
        for i, op_id in enumerate(self.ids):
            if i in early:
                continue
            if joined and i in joined:
                counters.ended(op_id, lane.name, None, sum(self.bytes_of(i).values()), start - joined[i], running)
            else:
                together += 1
                nbytes += sum(self.bytes_of(i).values())
        if together:
            counters.completed_many(together, nbytes, start - self.submitted_ns, running)

    def __repr__(self) -> str:
        return f"<Carrier {self.id} [{self.direction.value}, {self.state}, {self.count} requests, {self.nbytes} bytes]>"


# -- carrying: a lone request, or a bulk call's ------------------------------------------------


def carry(
    ctx: CarrierContext, host: dict[str, list[int]], device: dict[str, list[int]], priority: int,
    fence: object | None, allocated: frozenset[str],
) -> tuple[OperationHandle, Carrier | None]:
    """A lone request's handle, and the carrier to queue for it: none when
    the lane's newest queued carrier takes it (a few list appends), else a
    new carrier of one request, which the lone requests after it may join."""
    lane = ctx.lane
    last: Carrier | None = lane.newest_open() if fence is None else None
    if last is not None:
        handle = last.join(host, device, ctx.ids, priority, allocated)
        if handle is not None:
            lane.joined(last)
            return handle, None
    requests = RequestPages.one(host, device)
    op_id = next(ctx.ids)
    carrier = Carrier(ctx, next(ctx.carrier_ids), requests, [op_id], priority=priority, fence=fence, allocated=allocated)
    handle = OperationHandle(carrier, 0, op_id)
    if ctx.direction is Direction.BACKUP:
        carrier.start_writes([handle])
    return handle, carrier


async def carry_many(
    ctx: CarrierContext, requests: RequestPages, priority: int, fence: object | None,
    allocated: frozenset[str] | Sequence[frozenset[str]], *, want_handles: bool = True,
) -> tuple[list[Carrier], list[OperationHandle] | None]:
    """The carriers of a bulk call's requests (cut by `carrier_bounds`) and
    their handles, in order; the loop runs in between once a step has
    taken long enough. A backup's requests become the writers of their
    pages. A call cancelled meanwhile gives back every page it took."""
    common, each = (allocated, None) if isinstance(allocated, frozenset) else (frozenset[str](), allocated)
    bounds = carrier_bounds(requests.offsets, requests.count, ctx.bytes_per_page,
                            max_bytes=ctx.max_bytes, max_requests=ctx.max_requests, allocated=each)
    carriers: list[Carrier] = []
    handles: list[OperationHandle] = []
    clock = StepClock()
    ids = ctx.ids
    try:
        for a, b in bounds:
            own = requests.slice(a, b)
            pools = (common if each is None else each[a]) & own.host.keys()
            carrier = Carrier(ctx, next(ctx.carrier_ids), own, list(itertools.islice(ids, b - a)),
                              priority=priority, fence=fence, allocated=pools)
            carriers.append(carrier)
            if ctx.direction is Direction.BACKUP:  # a backup's requests write its pages (no handle each)
                carrier.start_writes()
            if want_handles:
                handles += carrier.handles()
            await clock.checkpoint()
    except BaseException as exc:
        for carrier in carriers:
            ctx.lane.abandon(carrier, exc)
        done = sum(c.count for c in carriers)
        if ctx.direction is Direction.BACKUP:
            ctx.admission.abandon_host({name: requests.host[name][off[done]:] for name, off in requests.offsets.items()})
        else:
            reads, owned = rest_of_load(requests.host, requests.device, requests.offsets, done, allocated)
            device = {name: PageList(p, ctx.group[name].page_size) for name, p in owned.items()}
            ctx.admission.release(Claim(reads=reads, device=device), succeeded=False)
        raise
    return carriers, handles if want_handles else None


def _wake_all(waiting: Iterable[list[eventloop.Future[None]]]) -> None:
    """Wake every waiter of ``waiting`` (each re-checks its condition)."""
    for futures in waiting:
        for future in futures:
            if not future.done():
                future.set_result(None)


def new_operation(
    op_id: int,
    direction: Direction,
    host: Mapping[str, list[int]],
    device: Mapping[str, list[int]],
    group: PoolGroup,
    bytes_per_page: BytesPerPage,
    priority: int,
    fence: object | None,
    requests: tuple[int, ...] | None = None,
) -> CacheOperation:
    """The `CacheOperation` of a backup or load of ``host`` / ``device``
    pages by pool (sidecars derived from their sources). Host pages that hold
    fewer valid rows than a page (`PoolGroup.valid_rows`) move only those."""
    if group.valid_rows:
        return _operation_of_valid_rows(op_id, direction, host, device, group, bytes_per_page, priority, fence,
                                        requests)
    transfers: list[PoolTransfer] = []
    nbytes = 0
    for name in sorted(host) if len(host) > 1 else host:
        size = group[name].page_size
        pages = len(host[name])
        transfers.append(PoolTransfer(name, PageList(host[name], size), PageList(device[name], size)))
        own, sidecars = bytes_per_page[name]
        nbytes += pages * own
        for side, side_bytes in sidecars:
            transfers.append(PoolTransfer(side, None, None, indices_from_pool=name))
            nbytes += pages * side_bytes
    return CacheOperation(op_id, direction, tuple(transfers), priority, nbytes, fence, requests)



def _operation_of_valid_rows(
    op_id: int,
    direction: Direction,
    host: Mapping[str, list[int]],
    device: Mapping[str, list[int]],
    group: PoolGroup,
    bytes_per_page: BytesPerPage,
    priority: int,
    fence: object | None,
    requests: tuple[int, ...] | None,
) -> CacheOperation:
    """`new_operation` once some host page holds fewer valid rows than a page:
    each transfer carries its count per page (`PoolTransfer.valid`) where one
    of its pages is partial, and the bytes count the rows that move."""
    valid_rows = group.valid_rows
    transfers: list[PoolTransfer] = []
    nbytes = 0
    for name in sorted(host) if len(host) > 1 else host:
        size = group[name].page_size
        pages = host[name]
        own, sidecars = bytes_per_page[name]
        valid = _valid_of(valid_rows.get(name), pages, size)
        transfers.append(PoolTransfer(name, PageList(pages, size), PageList(device[name], size), valid=valid))
        nbytes += len(pages) * own if valid is None else sum(valid) * (own // size)
        for side, side_bytes in sidecars:
            k = group[side].page_size
            valid = _valid_of(valid_rows.get(side), pages, k)
            transfers.append(PoolTransfer(side, None, None, indices_from_pool=name, valid=valid))
            nbytes += len(pages) * side_bytes if valid is None else sum(valid) * (side_bytes // k)
    return CacheOperation(op_id, direction, tuple(transfers), priority, nbytes, fence, requests)


def _valid_of(table: Mapping[int, int] | None, pages: list[int], size: int) -> list[int] | None:
    """Valid rows per page of ``pages`` (``size`` each when not in ``table``),
    or None when every page is whole."""
    if not table or not any(p in table for p in pages):
        return None
    return [table.get(p, size) for p in pages]
