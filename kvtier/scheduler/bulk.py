"""What an array-native bulk call hands back: `BulkOperation`, awaited once, and its `BulkResult`.

A `TransferScheduler.backup_arrays` / `load_arrays` call carries its
requests in carriers, as `backup_many` does, but hands back one object for
all of them. ``await bulk`` returns once every request has ended, however it
ended, and never raises for a request: the `BulkResult` says per request
(``status``: 0 done, 1 failed, 2 cancelled, by its handle or by a cancelling
close; ``errors``) and gives the host
and device indices of all requests as one flat tensor per pool (sidecars
included) with ``offsets`` in the same form as the call's.

Handed arrays are the caller's: the first read of ``host_indices`` /
``device_indices`` is the result's one copy (made once per call, not per
request), never handed again; every later read is a new copy. No write to
them changes a later read or what ``free_host(result)`` frees.

Per-request `OperationHandle`s exist only when asked for (`BulkOperation.handles`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Generator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from kvtier.errors import InvalidIndices, NotFinished
from kvtier.pools import PoolGroup
from kvtier.scheduler.carriers import Carrier
from kvtier.scheduler.handles import OperationHandle
from kvtier.scheduler.requests import RequestPages
from kvtier.transfers import Direction

__all__ = ["BulkOperation", "BulkResult"]

OK, FAILED, CANCELLED = 0, 1, 2


class BulkResult:
    """How each request of a bulk call ended, and the indices of all of them (see the module doc)."""

    OK = OK
    FAILED = FAILED
    CANCELLED = CANCELLED

    __slots__ = ("direction", "count", "status", "errors", "_requests", "_group", "_carriers", "_starts", "_views")

    def __init__(
        self, direction: Direction, requests: RequestPages, group: PoolGroup, carriers: Sequence[Carrier],
        starts: list[int],
    ) -> None:
        self.direction = direction
        self.count = requests.count
        status = np.zeros(requests.count, dtype=np.int8)
        errors: dict[int, BaseException] = {}
        for carrier, base in zip(carriers, starts):
            carrier.fill_outcomes(status, errors, base)
        status.flags.writeable = False
        self.status: np.ndarray = status
        self.errors: Mapping[int, BaseException] = MappingProxyType(errors)
        self._requests = requests
        self._group = group
        self._carriers = carriers
        self._starts = starts
        self._views: dict[bool, dict[str, np.ndarray]] = {}

    @property
    def ok(self) -> np.ndarray:
        """Per request: True where it completed (a new array per read)."""
        ok: np.ndarray = self.status == OK
        return ok

    @property
    def all_ok(self) -> bool:
        return not self.errors

    # -- indices --------------------------------------------------------------------------------

    def _arrays(self, host: bool) -> dict[str, np.ndarray]:
        """Per pool and sidecar: every request's slots one after the other (the result's own)."""
        group = self._group
        requests = self._requests
        pages_by_pool = requests.host if host else requests.device
        out: dict[str, np.ndarray] = {}
        for name in requests.offsets:
            pages = np.array(pages_by_pool[name], dtype=np.int64)
            out[name] = _slots(pages, group[name].page_size)
            for side in group.sidecars_of(name):
                assert side.sidecar is not None
                out[side.name] = _slots(pages, side.sidecar.rows_per_page)
        return out

    def _indices(self, host: bool) -> dict[str, torch.Tensor]:
        made = self._views.get(host)
        if made is None:  # the first read: the one copy of the result's own arrays, never handed again
            own = self._views[host] = self._arrays(host)
            return {name: torch.from_numpy(a.copy()) for name, a in own.items()}
        return {name: torch.from_numpy(a.copy()) for name, a in made.items()}

    @property
    def host_indices(self) -> dict[str, torch.Tensor]:
        """Host slots of every request by pool, sidecars included, one after
        the other (request ``i``: ``[offsets[pool][i]:offsets[pool][i + 1]]``).
        A failed or cancelled backup's range names pages that are no longer its."""
        return self._indices(True)

    @property
    def device_indices(self) -> dict[str, torch.Tensor]:
        """Device slots of every request by pool, sidecars included (as `host_indices`)."""
        return self._indices(False)

    @property
    def offsets(self) -> dict[str, torch.Tensor]:
        """Per pool and sidecar, where each request's slots start (requests + 1 entries; new per read)."""
        group = self._group
        out: dict[str, torch.Tensor] = {}
        for name, off in self._requests.offsets.items():
            page_off = np.array(off, dtype=np.int64)
            out[name] = torch.from_numpy(page_off * group[name].page_size)
            for side in group.sidecars_of(name):
                assert side.sidecar is not None
                out[side.name] = torch.from_numpy(page_off * side.sidecar.rows_per_page)
        return out

    @property
    def host_pages(self) -> dict[str, list[int]]:
        """The host page numbers the caller holds after the call, by pool:
        every request's for a load, the completed requests' for a backup
        (``free_host(result)`` frees them)."""
        requests = self._requests
        if self.direction is Direction.LOAD or not self.errors:
            return {name: list(pages) for name, pages in requests.host.items()}
        ok = [i for i in range(self.count) if i not in self.errors]
        host, _ = requests.of_requests(ok)
        return host

    # -- bytes ----------------------------------------------------------------------------------

    @property
    def bytes_per_pool(self) -> Mapping[str, int]:
        """Bytes the completed requests moved, by pool, sidecars included
        (the valid rows only, for partial pages)."""
        out: dict[str, int] = {}
        for carrier, base in zip(self._carriers, self._starts):
            for i in range(carrier.requests.count):
                if base + i in self.errors:
                    continue
                for name, n in carrier.bytes_of(i).items():
                    out[name] = out.get(name, 0) + n
        return MappingProxyType(out)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_per_pool.values())

    def __repr__(self) -> str:
        failed = int((self.status == FAILED).sum())
        cancelled = int((self.status == CANCELLED).sum())
        return (f"<BulkResult [{self.direction.value}, {self.count} requests: {self.count - failed - cancelled} done, "
                f"{failed} failed, {cancelled} cancelled]>")


def _slots(pages: np.ndarray, size: int) -> np.ndarray:
    if size == 1:
        return pages
    return (pages[:, None] * size + np.arange(size, dtype=np.int64)).reshape(-1)


class BulkOperation:
    """The requests of one array-native bulk call in flight: await it once
    for a `BulkResult`; cancel requests; ask for per-request handles."""

    __slots__ = ("kind", "direction", "count", "_carriers", "_starts", "_requests", "_group", "_handles", "_result")

    def __init__(
        self, kind: str, direction: Direction, carriers: list[Carrier], requests: RequestPages, group: PoolGroup,
        handles: list[OperationHandle] | None,
    ) -> None:
        self.kind = kind
        self.direction = direction
        self.count = requests.count
        self._carriers = carriers
        starts, at = [], 0
        for carrier in carriers:
            starts.append(at)
            at += carrier.requests.count
        self._starts = starts
        self._requests = requests
        self._group = group
        self._handles = handles
        self._result: BulkResult | None = None

    def done(self) -> bool:
        """True once every request has ended."""
        return all(c.ended for c in self._carriers)

    async def settled(self) -> None:
        """Return once every request has ended, however it ended."""
        for carrier in self._carriers:
            await carrier.settled_all()

    def __await__(self) -> Generator[Any, None, BulkResult]:
        for carrier in self._carriers:
            if not carrier.ended:
                yield from carrier.settled_all().__await__()
        return self.result()

    def result(self) -> BulkResult:
        """The `BulkResult` of the ended call (made once); `NotFinished` (a `RuntimeError`) before it ended."""
        result = self._result
        if result is None:
            if not self.done():
                raise NotFinished(f"the {self.kind} bulk call has not ended; await it first")
            result = self._result = BulkResult(self.direction, self._requests, self._group, self._carriers,
                                               self._starts)
        return result

    def _place(self, index: int) -> tuple[Carrier, int]:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < self.count:
            raise InvalidIndices(f"request {index!r} is not one of this call's 0..{self.count - 1}", rule="request")
        k = bisect_right(self._starts, int(index)) - 1
        return self._carriers[k], int(index) - self._starts[k]

    def cancel(self, requests: Sequence[int] | np.ndarray | None = None) -> int:
        """Cancel the requests ``requests`` (all of them by default), as
        `OperationHandle.cancel` each; returns how many were still open."""
        if requests is None:
            accepted = 0
            for carrier in self._carriers:
                for i in range(carrier.requests.count):
                    accepted += carrier.cancel(i)
            return accepted
        places = [self._place(i) for i in requests]
        return sum(carrier.cancel(i) for carrier, i in places)

    def handles(self) -> list[OperationHandle]:
        """One `OperationHandle` per request, in order (made when first asked for)."""
        if self._handles is None:
            self._handles = [h for carrier in self._carriers for h in carrier.handles()]
        return list(self._handles)

    def __repr__(self) -> str:
        return f"<BulkOperation [{self.kind}, {self.count} requests, {'done' if self.done() else 'running'}]>"
