"""The one seam between kvtier and the asyncio event loop.

Everything else in kvtier is plain anyio; what needs asyncio itself (futures,
wake-ups from worker threads, timers, the loop a call came from, and
`WorkerThread`, a persistent thread that answers on the loop) goes through
this module. asyncio's own loop and uvloop are supported. Under another anyio
backend `running_loop` raises `ConfigurationError` naming it, at
``async with TransferScheduler(...)``.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from kvtier.errors import ConfigurationError, WrongEventLoop

__all__ = [
    "Future",
    "Loop",
    "TimerHandle",
    "WorkerThread",
    "call_later",
    "check_caller",
    "on_loop",
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


def on_loop(loop: Loop | None) -> bool:
    """True when the caller runs inside ``loop`` (on its thread): `check_caller`'s
    test alone, without a raise to set up, for the hot paths (one C call)."""
    return _get_running_loop() is loop


_get_running_loop = asyncio._get_running_loop  # None outside a running loop (no exception to catch)


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


T = TypeVar("T")


class WorkerThread:
    """A thread of its own that runs the functions handed to it, one at a
    time, in order, and answers each on the loop that handed it over.

    `run` costs one hand-off out (a queue put) and one back
    (``call_soon_threadsafe``) and no extra turn of the loop: what a batch of
    copies needs, where a shared pool (``anyio.to_thread``) adds a loop turn
    and a limiter per call. The thread starts on the first call and ends once
    it has been idle for ``idle_s`` seconds or at `stop` (a later call starts
    it again), so an executor left unused holds no thread.

    A call's function and arguments are dropped in the thread before its
    caller is answered: what the call held is freed there, never by this
    thread after the caller has moved on (at interpreter exit, a daemon thread
    still freeing tensors inside torch aborts the process).
    """

    def __init__(self, name: str, *, idle_s: float = 5.0) -> None:
        self.name = name
        self._idle_s = idle_s
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Loop, Future[Any] | None]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the thread; its result or its error. Cancelling the
        caller does not abandon the call: it returns once ``fn`` has returned
        (the cancellation reaches the caller at its next checkpoint)."""
        loop = asyncio.get_running_loop()
        future: Future[T] = loop.create_future()
        self.submit(loop, future, fn, *args)
        with anyio.CancelScope(shield=True):  # the future is this call's own: no asyncio.shield
            await future
        return future.result()

    async def stop(self) -> None:
        """End the thread once the calls queued before this one have run (a
        call queued later keeps it, and a later call starts a new one);
        returns at once when no thread runs. Not abandoned on cancellation,
        as `run`."""
        with self._lock:
            if self._thread is None:
                return
            loop = asyncio.get_running_loop()
            future: Future[None] = loop.create_future()
            self._queue.put((_STOP, (), loop, future))
        with anyio.CancelScope(shield=True):
            await future

    def submit(self, loop: Loop, future: Future[Any] | None, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` from any thread (the loop's or another
        `WorkerThread`'s): its result or error settles ``future`` on ``loop``.

        With ``future`` None nobody is answered: ``fn`` then answers someone
        itself (say by submitting the rest of the work, with the future, to a
        second `WorkerThread`), so a chain of threads costs the loop one
        hand-off out and one back. Such an ``fn`` must not raise: its error
        would be dropped."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
            self._queue.put((fn, args, loop, future))

    def _serve(self) -> None:
        get = self._queue.get
        while True:
            try:
                fn, args, loop, future = get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            ending = fn is _STOP
            if ending:
                with self._lock:
                    ending = self._queue.empty()
                    if ending:
                        self._thread = None
                result, error = None, None
            else:
                try:
                    result, error = fn(*args), None
                except BaseException as exc:  # handed to the caller, whatever it is
                    result, error = None, exc
            # What the call held goes here, before its caller resumes; its future
            # and answer go to the loop in a box the loop empties, so that this
            # thread never holds the last reference to them either.
            del fn, args
            if future is not None:
                answer = [future, result, error]
                del future, result, error
                try:
                    loop.call_soon_threadsafe(_settle, answer)
                except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                    pass
                del answer
            else:
                del future, result, error
            del loop
            if ending:
                return


def _STOP() -> None:
    """The queue entry that asks a `WorkerThread` to end (`WorkerThread.stop`)."""


def _settle(answer: list[Any]) -> None:
    """(On the loop) ``answer`` is ``[future, result, error]``: settles the
    future and empties the list (see `WorkerThread._serve`)."""
    future, result, error = answer
    answer.clear()
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
