"""What the caller holds for a backup or a load: `OperationHandle`, a promise.

A handle is a request's place in its queue entry (`kvtier.scheduler.carriers.Carrier`):
the carrier, the request's index there and its id (and its result, once asked
for). It changes nothing itself: every state, outcome and page it reports is
read from the carrier, and everything it asks for (cancel, a wait) goes to the
carrier, which owns the request's transitions. So a handle costs four
attribute stores, and no cycle: the carrier keeps its requests' ids, not their
handles or results.

``await handle`` returns an `OperationResult` (made when first asked for) or raises
the request's error (`TransferFailed`, `CorruptionDetected`,
`OperationCancelled`, `SchedulerClosed`).

``host_indices`` / ``device_indices`` are the engine's hot path: tensors over
one array of slots per pool and carrier, made the first time one of its
requests is read (numpy slices: no torch operator, which would let the GIL
go once per output). They are the caller's: nothing kvtier does later changes
them, and no write to them (through torch, numpy or ``.data``) changes what a
later read returns or what ``free_host`` frees: a request's first read is a
view of a copy that no other read is given, and every later read is a new
copy. ``free_host(handle)`` (or its result) frees the request's host pages
without handing a tensor back.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any, Protocol

import torch

from kvtier.transfers import Direction

__all__ = ["OperationHandle", "OperationResult", "Requests"]


class OperationResult:
    """What a finished operation moved and how long it took: a read-only record.

    It is made when first asked for (``await handle``), and cheaply: its figures
    are read from the operation's carrier when they are read.
    """

    __slots__ = ("_requests", "_index", "id")
    _requests: Requests
    _index: int
    id: int

    def __init__(self, requests: Requests, index: int, op_id: int) -> None:
        _set_requests(self, requests)
        _set_index(self, index)
        _set_id(self, op_id)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"OperationResult is read-only; cannot set {name!r}")

    @property
    def direction(self) -> Direction:
        return self._requests.direction

    @property
    def bytes_per_pool(self) -> Mapping[str, int]:
        """Bytes moved by pool, sidecars included (read-only)."""
        return self._requests.bytes_of(self._index)

    @property
    def nbytes(self) -> int:
        return sum(self._requests.bytes_of(self._index).values())

    @property
    def seconds_queued(self) -> float:
        """From submission until its batch was taken."""
        return self._requests.seconds_of(self._index)[0]

    @property
    def seconds_copying(self) -> float:
        """From its batch being taken until it ended."""
        return self._requests.seconds_of(self._index)[1]

    @property
    def seconds_total(self) -> float:
        return self._requests.seconds_of(self._index)[2]

    @property
    def host_pages(self) -> dict[str, list[int]]:
        """Its host page numbers by slot-owning pool (a new dict of new lists
        per read; ``free_host(result)`` frees them)."""
        return self._requests.host_pages_of(self._index)

    def _fields(self) -> tuple[object, ...]:
        return (self.id, self.direction, dict(self.bytes_per_pool), *self._requests.seconds_of(self._index))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OperationResult):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash((self.id, self.direction))

    def __repr__(self) -> str:
        queued, copying, total = self._requests.seconds_of(self._index)
        return (f"OperationResult(id={self.id}, direction={self.direction!r}, bytes_per_pool="
                f"{dict(self.bytes_per_pool)!r}, seconds_queued={queued!r}, seconds_copying={copying!r}, "
                f"seconds_total={total!r})")


# The slots' own setters (``__setattr__`` refuses): one descriptor call each,
# half the cost of ``object.__setattr__``, once per awaited request.
_slot: Mapping[str, Any] = OperationResult.__dict__
_set_requests, _set_index, _set_id = (_slot[name].__set__ for name in ("_requests", "_index", "id"))


class Requests(Protocol):
    """What owns the requests a handle stands for: a carrier
    (`kvtier.scheduler.carriers.Carrier`). A handle reads everything from it
    by its request index."""

    kind: str
    direction: Direction
    priority: int

    def bytes_of(self, index: int) -> Mapping[str, int]: ...
    def state_of(self, index: int) -> str: ...
    def done_of(self, index: int) -> bool: ...
    def error_of(self, index: int) -> BaseException | None: ...
    def cancel_requested(self, index: int) -> bool: ...
    def submitted_of(self, index: int) -> int: ...
    def seconds_of(self, index: int) -> tuple[float, float, float]: ...
    def cancel(self, index: int) -> bool: ...
    async def settled(self, index: int) -> None: ...
    def outcome(self, index: int, op_id: int) -> OperationResult: ...
    async def until_layer(self, index: int, layer: int, *, device_wait: bool, stream: object | None) -> None: ...
    def indices_of(self, index: int, *, host: bool) -> dict[str, torch.Tensor]: ...
    def host_indices_of(self, index: int) -> dict[str, torch.Tensor]: ...
    def host_pages_of(self, index: int) -> dict[str, list[int]]: ...


class OperationHandle:
    """A backup or a load in flight: await it, wait for its layers, cancel it.

    A handle resolves exactly once; awaiting again gives the same outcome.
    Cancelling the task that awaits a handle does not cancel the operation;
    `cancel` does.
    """

    __slots__ = ("_carrier", "_index", "id", "_result")

    def __init__(self, carrier: Requests, index: int, op_id: int) -> None:
        self._carrier = carrier
        self._index = index
        self.id = op_id
        # Made when first asked for, and kept here (the carrier keeps no
        # handle and no result: no cycle).
        self._result: OperationResult | None = None

    # -- what it is ----------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """The lane that runs it: ``"backup"`` or ``"load"``."""
        return self._carrier.kind

    @property
    def direction(self) -> Direction:
        return self._carrier.direction

    @property
    def priority(self) -> int:
        return self._carrier.priority

    @property
    def bytes_per_pool(self) -> Mapping[str, int]:
        """Bytes it moves by pool, sidecars included (read-only)."""
        return self._carrier.bytes_of(self._index)

    @property
    def nbytes(self) -> int:
        return sum(self._carrier.bytes_of(self._index).values())

    # -- where it stands -------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``"queued"``, ``"running"`` or ``"done"``."""
        return self._carrier.state_of(self._index)

    @property
    def queued(self) -> bool:
        return self._carrier.state_of(self._index) == "queued"

    @property
    def cancel_requested(self) -> bool:
        return self._carrier.cancel_requested(self._index)

    def done(self) -> bool:
        return self._carrier.done_of(self._index)

    def exception(self) -> BaseException | None:
        """The error the operation ended with (None while it runs, or on success)."""
        return self._carrier.error_of(self._index)

    @property
    def submitted_ns(self) -> int:
        """``time.perf_counter_ns()`` at submission."""
        return self._carrier.submitted_of(self._index)

    def cancel(self) -> bool:
        """Cancel the operation: the handle raises `OperationCancelled`. A
        queued operation is dropped at once (what it took is given back); a
        running one gives back what it holds once no copy uses it any more.
        Returns False when the operation had already finished."""
        return self._carrier.cancel(self._index)

    # -- waiting ------------------------------------------------------------------------------

    async def settled(self) -> None:
        """Return once the operation has ended, however it ended."""
        await self._carrier.settled(self._index)

    async def wait(self) -> OperationResult:
        """The same as ``await handle``."""
        await self._carrier.settled(self._index)
        return self.outcome()

    def __await__(self) -> Generator[Any, None, OperationResult]:
        result = self._result
        if result is None:
            carrier = self._carrier
            if not carrier.done_of(self._index):  # an ended handle is awaited without a coroutine
                yield from carrier.settled(self._index).__await__()
            result = self._result = carrier.outcome(self._index, self.id)
        return result

    def outcome(self) -> OperationResult:
        """The result of an ended operation, or raise its error."""
        result = self._result
        if result is None:
            result = self._result = self._carrier.outcome(self._index, self.id)
        return result

    async def layer_ready(self, layer: int) -> None:
        """Return once transfer layer ``layer`` of every pool is in place.

        Raises the operation's error if it failed or was cancelled.
        """
        await self._carrier.until_layer(self._index, layer, device_wait=False, stream=None)

    async def wait_layer(self, layer: int, stream: object | None = None) -> None:
        """Make ``stream`` (default: the current stream of the copy's device)
        wait on the device until transfer layer ``layer`` is in place, without
        a host sync. Returns once the wait is enqueued, which needs the batch to
        be enqueued on the copy stream. With an executor that has no device
        events (the CPU executor) this is `layer_ready`.
        """
        await self._carrier.until_layer(self._index, layer, device_wait=True, stream=stream)

    # -- its pages -----------------------------------------------------------------------------

    @property
    def host_indices(self) -> dict[str, torch.Tensor]:
        """Host slot indices of every pool, derived sidecars included (see the module doc)."""
        return self._carrier.host_indices_of(self._index)

    @property
    def device_indices(self) -> dict[str, torch.Tensor]:
        """Device slot indices of every pool, derived sidecars included (see the module doc)."""
        return self._carrier.indices_of(self._index, host=False)

    @property
    def host_pages(self) -> dict[str, list[int]]:
        """Host page numbers by slot-owning pool (a new dict of new lists per
        read; ``free_host(handle)`` frees them)."""
        return self._carrier.host_pages_of(self._index)

    def __repr__(self) -> str:
        return f"<OperationHandle {self.id} [{self.direction.value}, {self.state}, {self.nbytes} bytes]>"
