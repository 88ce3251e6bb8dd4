"""The storage backend's calls, timed and their errors counted.

The scheduler wraps its backend in a `MeasuredStore`: each ``exists``,
``get`` and ``put`` call (one per batch or round, never per page) records
its latency in a histogram with the scheduler's buckets
(`LATENCY_BUCKETS_S`), and a call that raises counts once under its
operation and its error's class name (``StorageTimeout``, ``StorageError``,
...). The error itself goes on unchanged. `MeasuredStore.statistics` freezes
the counts; `kvtier.metrics` exports them.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvtier.scheduler.statistics import LATENCY_BUCKETS_S, LatencyHistogram
from kvtier.storage.base import PageBlobs, StorageBackend
from kvtier.storage.file_store import StoreUsage

__all__ = ["OPERATIONS", "MeasuredStore", "StoreCallStatistics"]

OPERATIONS = ("exists", "get", "put")
_BOUNDS_NS = tuple(round(b * 1e9) for b in LATENCY_BUCKETS_S)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoreCallStatistics:
    """Per operation (``exists``, ``get``, ``put``): the latency of every call,
    failed ones included, and the calls that raised, by error class name;
    ``usage``: what a bounded store holds and evicted (`FileStore.usage`), else None."""

    backend: str
    latency: Mapping[str, LatencyHistogram]
    errors: Mapping[tuple[str, str], int]
    usage: StoreUsage | None = None


class MeasuredStore:
    """A `StorageBackend` that times and counts the calls it passes to ``inner``."""

    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self._counts = {op: [0] * (len(_BOUNDS_NS) + 1) for op in OPERATIONS}
        self._sums_ns = dict.fromkeys(OPERATIONS, 0)
        self._errors: dict[tuple[str, str], int] = {}

    def __repr__(self) -> str:
        return f"<MeasuredStore of {self.inner!r}>"

    async def _timed(self, operation: str, call: Callable[[], Awaitable[T]]) -> T:
        start = time.perf_counter_ns()
        try:
            return await call()
        except BaseException as exc:
            if isinstance(exc, Exception):
                key = (operation, type(exc).__name__)
                self._errors[key] = self._errors.get(key, 0) + 1
            raise
        finally:
            took = time.perf_counter_ns() - start
            self._counts[operation][bisect_left(_BOUNDS_NS, took)] += 1
            self._sums_ns[operation] += took

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._timed("exists", lambda: self.inner.exists(keys))

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        return await self._timed("get", lambda: self.inner.get(keys, pools))

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        await self._timed("put", lambda: self.inner.put(pages))

    async def aclose(self) -> None:
        await self.inner.aclose()

    def statistics(self) -> StoreCallStatistics:
        return StoreCallStatistics(
            backend=self.name,
            latency={
                op: LatencyHistogram(LATENCY_BUCKETS_S, tuple(self._counts[op]), self._sums_ns[op] * 1e-9)
                for op in OPERATIONS
            },
            errors=dict(self._errors),
            usage=usage() if callable(usage := getattr(self.inner, "usage", None)) else None,
        )
