"""The exceptions kvtier raises.

Every error is a `KvtierError`. Messages name the value and the rule that it
broke; the parts are kept as attributes so that callers and tests can read them
without parsing text.
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "CorruptionDetected",
    "InvalidIndices",
    "KvtierError",
    "NotFinished",
    "OperationCancelled",
    "PoolExhausted",
    "SchedulerClosed",
    "SchedulerNotRunning",
    "TransferFailed",
    "WrongEventLoop",
    "WrongType",
]


class KvtierError(Exception):
    """Root of every error that kvtier raises on purpose."""


class InvalidIndices(KvtierError, ValueError):
    """Indices broke a rule (whole pages, range, lengths, ownership...).

    Raised before anything changed: no slot was taken or freed.
    """

    def __init__(self, message: str, *, pool: str | None = None, rule: str | None = None) -> None:
        super().__init__(message)
        self.pool = pool
        self.rule = rule


class ConfigurationError(KvtierError, ValueError):
    """A pool, a group, a configuration value or an argument broke its rule.

    Raised at registration, construction or the call, before anything changed.
    """


class WrongType(ConfigurationError, TypeError):
    """An argument of the wrong type, e.g. a scheduler that is not a
    `TransferScheduler`. A `ConfigurationError`, and a `TypeError` as it was
    before it had a class. Nothing changed."""


class PoolExhausted(KvtierError):
    """A pool had too few free slots, even after the reclaim hook ran.

    Every slot the operation had taken in other pools was freed again.
    """

    def __init__(self, pool: str, tier: str, needed: int, free: int) -> None:
        super().__init__(
            f"pool {pool!r} has too few free {tier} slots: needed {needed}, free {free}"
        )
        self.pool = pool
        self.tier = tier
        self.needed = needed
        self.free = free


class TransferFailed(KvtierError):
    """A copy failed; the cause is chained as ``__cause__``.

    The destination slots the failed operation had taken were freed.
    """

    def __init__(self, message: str, *, operation_ids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.operation_ids = operation_ids


class SchedulerClosed(KvtierError):
    """The caller closed the scheduler: it takes no new operations, and
    operations still queued when it closed without draining never ran."""


class SchedulerNotRunning(KvtierError, RuntimeError):
    """A scheduler was used outside the one run of its ``async with`` block:
    called before the block was entered, or entered a second time. Nothing
    changed. (A `RuntimeError` too, as it was before it had a class.)"""


class OperationCancelled(KvtierError):
    """The operation was cancelled through its handle; the slots it had taken
    were released once no copy used them any more."""


class CorruptionDetected(KvtierError):
    """In verify mode, host pages no longer match the checksums recorded when
    they were backed up. The load did not copy them: no wrong byte reached the
    device."""

    def __init__(self, pool: str, pages: list[int], *, operation_id: int) -> None:
        shown = pages[:16]
        more = f" and {len(pages) - 16} more" if len(pages) > 16 else ""
        super().__init__(
            f"pool {pool!r} host pages {shown}{more} do not match the checksums recorded at backup; "
            f"operation {operation_id} was not loaded"
        )
        self.pool = pool
        self.pages = pages
        self.operation_id = operation_id


class WrongEventLoop(KvtierError, RuntimeError):
    """A scheduler (or one of its handles) was called from a thread or an
    event loop other than the one running it. Nothing changed."""


class NotFinished(KvtierError, RuntimeError):
    """A result was asked for before its operation ended: await the handle
    first. (A `RuntimeError` too, as it was before it had a class.)"""
