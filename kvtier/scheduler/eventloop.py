"""The one seam between kvtier and the asyncio event loop.

Everything else in the scheduler is plain anyio; what needs asyncio itself
(futures, wake-ups from worker threads, timers, the loop a call came from)
goes through these functions. asyncio's own loop and uvloop are supported.
Under another anyio backend `running_loop` raises `ConfigurationError` naming
it, at ``async with TransferScheduler(...)``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

from kvtier.errors import ConfigurationError, WrongEventLoop

__all__ = [
    "Future",
    "Loop",
    "TimerHandle",
    "call_later",
    "check_caller",
    "new_future",
    "running_loop",
    "wait_future",
    "wake_from_thread",
]

Loop = asyncio.AbstractEventLoop
Future = asyncio.Future
TimerHandle = asyncio.TimerHandle


def _backend_name() -> str:
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
            return "trio"
        except RuntimeError:
            pass
    return "no asyncio event loop"


def running_loop() -> Loop:
    """The running asyncio loop; `ConfigurationError` under another backend."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise ConfigurationError(
            f"kvtier's scheduler runs on asyncio (or uvloop) through anyio; found {_backend_name()}: "
            "use anyio.run(..., backend='asyncio') or asyncio.run(...)"
        ) from None


def check_caller(loop: Loop | None, what: str) -> None:
    """Raise `WrongEventLoop` unless the caller runs on ``loop``'s thread,
    inside ``loop``: a scheduler is used from the loop that runs it."""
    try:
        current = asyncio.get_running_loop()
    except RuntimeError:
        current = None
    if current is not loop:
        where = "another thread (no running event loop)" if current is None else "another event loop"
        raise WrongEventLoop(
            f"{what} was called from {where}; a TransferScheduler is used only from the event loop "
            "that runs its `async with` block (from another thread, use "
            "asyncio.run_coroutine_threadsafe or loop.call_soon_threadsafe)"
        )


def new_future(loop: Loop) -> Future[Any]:
    return loop.create_future()


async def wait_future(future: Future[Any]) -> None:
    """Wait until ``future`` is done; cancelling the waiter leaves it alone."""
    if not future.done():
        await asyncio.shield(future)


def wake_from_thread(loop: Loop, callback: Callable[..., object], *args: object) -> None:
    """Run ``callback(*args)`` on ``loop`` soon; callable from any thread."""
    loop.call_soon_threadsafe(callback, *args)


def call_later(loop: Loop, delay: float, callback: Callable[[], object]) -> TimerHandle:
    return loop.call_later(delay, callback)
