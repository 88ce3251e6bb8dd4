"""Handles and results of storage operations: `write_storage` and `prefetch`.

A storage operation moves whole pages between host slots and a
`StorageBackend`, keyed per anchor pool by page keys (see `kvtier.storage`).
It goes through the scheduler's queue like a backup or a load, in a lane of its
own (`StorageDirection`), and its handle is awaited the same way:
``await handle`` gives a `WriteStorageResult` or a `PrefetchResult`, or raises
the operation's error (`StorageError`, `StorageTimeout`, `TransferFailed`,
`OperationCancelled`, `SchedulerClosed`, `CorruptionDetected`).

A prefetch can end early without failing: `PrefetchHandle.stop` (policy
``best_effort``) or its deadline (policy ``timeout``) makes it hand back the
pages it completed, a prefix of the keys of each pool, and free the rest.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from kvtier.errors import OperationCancelled
from kvtier.pools import slots_of_pages

if TYPE_CHECKING:
    from kvtier.scheduler.storage_ops import StorageLanes

__all__ = [
    "PrefetchHandle",
    "PrefetchPolicy",
    "PrefetchResult",
    "StorageDirection",
    "StorageHandle",
    "WriteStorageHandle",
    "WriteStorageResult",
]

PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
PREFETCH_POLICIES: tuple[str, ...] = ("best_effort", "wait_complete", "timeout")

QUEUED, RUNNING, DONE = "queued", "running", "done"


class StorageDirection(str, enum.Enum):
    """WRITE copies host -> storage; PREFETCH copies storage -> host."""

    WRITE = "write_storage"
    PREFETCH = "prefetch"


@dataclass(frozen=True, slots=True)
class WriteStorageResult:
    """What a finished `write_storage` did, per anchor pool.

    ``pages_written`` were put by this operation; ``pages_present`` were
    already stored (by this engine or another), or put by another operation
    of the same batch that shares them (a common prefix), and not put again. ``nbytes`` counts
    the bytes put, sidecars included.
    """

    id: int
    pages: Mapping[str, int]
    pages_written: Mapping[str, int]
    pages_present: Mapping[str, int]
    nbytes: int
    seconds_queued: float
    seconds_total: float


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What a finished `prefetch` handed back, per anchor pool.

    ``pages[pool]`` pages are in host slots now, the first ``pages[pool]``
    keys of that pool, in key order; ``host_indices[pool]`` are their slots
    (pools with no page are left out, so it is empty when nothing was
    found), which the caller holds from now on: pass them to
    `TransferScheduler.load` and give them back with
    `TransferScheduler.free_host`, as after a backup. ``hit_pages`` is the
    run the prefetch set out to read: the longest run of stored pages from
    the first key as its lookup found it, cut short where a page was evicted
    (or could not be decoded) before it was read; every key when the
    prefetch ended before its lookup. ``requested_pages``: keys asked for.
    ``stopped`` is True when it ended (stop or deadline) before every page of
    ``hit_pages`` was in.
    """

    id: int
    host_indices: Mapping[str, torch.Tensor]
    pages: Mapping[str, int]
    hit_pages: Mapping[str, int]
    requested_pages: Mapping[str, int]
    stopped: bool
    nbytes: int
    seconds_queued: float
    seconds_total: float

    @property
    def complete(self) -> bool:
        """Every requested page of every pool is in host slots."""
        return all(self.pages[p] == n for p, n in self.requested_pages.items())


class StorageHandle:
    """The live state of one storage operation; the scheduler drives it.

    ``_keys[pool]`` are the page keys of anchor ``pool``; ``_host_pages[pool]``
    the host pages, key by key (written by a prefetch, read by a write).
    """

    __slots__ = (
        "id", "direction", "priority", "nbytes", "_lanes", "_state", "_cancel_requested",
        "_keys", "_host_pages", "_finished", "_result", "_error", "_t_submit", "_t_dispatch",
    )

    def __init__(
        self,
        op_id: int,
        direction: StorageDirection,
        lanes: StorageLanes,
        finished: asyncio.Future[None],
        *,
        keys: dict[str, list[bytes]],
        host_pages: dict[str, list[int]],
        nbytes: int,
        priority: int,
    ) -> None:
        self.id = op_id
        self.direction = direction
        self.priority = priority
        self.nbytes = nbytes
        self._lanes = lanes
        self._state = QUEUED
        self._cancel_requested = False
        self._keys = keys
        self._host_pages = host_pages
        self._finished = finished
        self._result: Any = None
        self._error: BaseException | None = None
        self._t_submit = time.perf_counter()
        self._t_dispatch = 0.0

    @property
    def queued(self) -> bool:
        return self._state == QUEUED

    def done(self) -> bool:
        return self._state == DONE

    def cancel(self) -> bool:
        """Cancel the operation: the handle raises `OperationCancelled`. A
        queued one is dropped at once; a running one stops at its next step
        (a prefetch frees every page it took; a write stops putting, and the
        pages it already put stay stored, each whole). Returns False when the
        operation had already finished."""
        if self._state == DONE:
            return False
        self._cancel_requested = True
        self._end_early()
        return True

    def _end_early(self) -> None:
        """A stop or cancel was asked for (and recorded): a queued operation
        ends now, a running one at its next step."""
        if self._state == QUEUED:
            self._lanes._cancel_queued_storage(self)
        else:
            self._interrupt()

    def _interrupt(self) -> None:
        """Stop the running operation at its next step (overridden by prefetch)."""

    async def _settled(self) -> None:
        if not self._finished.done():
            await asyncio.shield(self._finished)

    def _resolve(self, result: object, error: BaseException | None) -> None:
        self._state = DONE
        self._result = result
        self._error = error
        self._finished.set_result(None)

    def _outcome(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    async def wait(self) -> Any:
        """The same as ``await handle``."""
        await self._settled()
        return self._outcome()

    def __await__(self) -> Generator[Any, None, Any]:
        return self.wait().__await__()

    def __repr__(self) -> str:
        pages = sum(len(p) for p in self._keys.values())
        return f"<{type(self).__name__} {self.id} [{self.direction.value}, {self._state}, {pages} pages]>"


class WriteStorageHandle(StorageHandle):
    """Handle of a `write_storage`; ``await`` gives a `WriteStorageResult`."""

    __slots__ = ()

    async def wait(self) -> WriteStorageResult:
        await self._settled()
        result: WriteStorageResult = self._outcome()
        return result


class PrefetchHandle(StorageHandle):
    """Handle of a `prefetch`; ``await`` gives a `PrefetchResult`.

    ``_hits[pool]``: pages still wanted (the hit run, once looked up; every
    key before that); ``_done[pool]``: pages in host slots so far, a prefix.
    """

    __slots__ = ("all_pools", "policy", "_hits", "_done", "_looked_up", "_stop_requested", "_scope", "_timer")

    def __init__(self, *args: Any, policy: str, all_pools: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.policy = policy
        self.all_pools = all_pools
        self._hits = {pool: len(keys) for pool, keys in self._keys.items()}
        self._done = dict.fromkeys(self._keys, 0)
        self._looked_up = False
        self._stop_requested = False
        self._scope: Any = None  # the anyio.CancelScope of the running fetch
        self._timer: asyncio.TimerHandle | None = None

    async def wait(self) -> PrefetchResult:
        await self._settled()
        result: PrefetchResult = self._outcome()
        return result

    @property
    def pages_done(self) -> Mapping[str, int]:
        """Pages of each pool in host slots so far (a prefix of its keys)."""
        return dict(self._done)

    @property
    def hit_pages(self) -> Mapping[str, int] | None:
        """Pages of each pool the prefetch is reading (the stored run from the
        first key), once its lookup ran; None before. With `pages_done`, what
        an engine needs to decide whether to wait or `stop`."""
        return dict(self._hits) if self._looked_up else None

    def stop(self) -> bool:
        """End the prefetch now and hand back the pages it completed (policy
        ``best_effort`` or ``timeout``). A page being written into host slots
        at this moment is finished first; a read from the store in flight is
        abandoned (a `FileStore` read, which runs in a worker thread, is
        waited for and its pages not used). ``await handle`` then gives the
        `PrefetchResult`. Returns False when the prefetch had already finished.

        Raises `ValueError` for policy ``wait_complete`` (it hands back every
        hit page or fails; use `cancel` to give up on it).
        """
        if self.policy == "wait_complete":
            raise ValueError(
                f"prefetch {self.id} has policy 'wait_complete', which does not stop early; "
                "use cancel(), or policy 'best_effort' or 'timeout'"
            )
        if self._state == DONE:
            return False
        self._stop_requested = True
        self._end_early()
        return True

    def _interrupt(self) -> None:
        if self._scope is not None:
            self._scope.cancel()  # its fetch finishes the handle once out of the scope
        else:
            # Its batch is still looking keys up: nothing writes its pages yet.
            error = OperationCancelled(f"operation {self.id} was cancelled") if self._cancel_requested else None
            self._lanes._finish_storage(self, error=error)

    def _result_now(self) -> PrefetchResult:
        """The result for the pages done so far (the scheduler calls this once, at the end)."""
        group = self._lanes.group
        host = {
            pool: slots_of_pages(self._host_pages[pool][:n], group[pool].page_size)
            for pool, n in self._done.items() if n
        }
        nbytes = sum(n * self._lanes._page_nbytes(pool) for pool, n in self._done.items())
        now = time.perf_counter()
        start = self._t_dispatch or now
        return PrefetchResult(
            self.id, host, dict(self._done), dict(self._hits),
            {pool: len(k) for pool, k in self._keys.items()},
            stopped=any(self._done[p] < self._hits[p] for p in self._done),
            nbytes=nbytes, seconds_queued=start - self._t_submit, seconds_total=now - self._t_submit,
        )
