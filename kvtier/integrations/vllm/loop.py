"""An asyncio event loop on its own thread, and the storage tier's keys
(`StorageKeys`, `ShardGeometry`: defined in `kvtier.integrations.vllm_keys`,
which needs no vLLM, and imported here).

vLLM calls its offloading API synchronously from its engine step. kvtier's
`TransferScheduler` lives on an event loop, so each side of the bridge runs
one on a daemon thread and hands it coroutines with
``asyncio.run_coroutine_threadsafe``: a call from vLLM's thread costs one
thread hop and never runs a copy on vLLM's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from kvtier.errors import ConfigurationError
from kvtier.storage import FileStore, PageBlobs, StorageBackend, StorageError
from kvtier.integrations.vllm.options import KvtierOptions
from kvtier.integrations.vllm_keys import ShardGeometry, StorageKeys  # vLLM-free: tested without vLLM

__all__ = ["LoopThread", "ShardGeometry", "StorageKeys", "StoreClient", "open_store", "probe_store"]

T = TypeVar("T")


class LoopThread:
    """One asyncio loop on a daemon thread, running ``main(ready)`` until it returns.

    ``main`` receives an `asyncio.Event`-like callable to call once it is
    serving; `start` waits for that (or for ``main`` to fail, re-raising its
    error on the caller's thread, so a bad configuration fails at engine start).
    """

    def __init__(self, name: str, main: Callable[[Callable[[], None]], Awaitable[None]]) -> None:
        self._main = main
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self._main(self._ready.set))
        except BaseException as exc:  # reported to whoever waits on start() or stop()
            self._error = exc
        finally:
            self._ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            self._main = _ended  # what main held (its object, through a bound method) is free to go

    def start(self, timeout_s: float = 60.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise ConfigurationError(f"kvtier's event loop thread did not start within {timeout_s} s")
        if self._error is not None:
            raise self._error

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; the future resolves on the loop's thread."""
        loop = self.loop
        if loop is None or loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise ConfigurationError("kvtier's event loop thread is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result on this thread."""
        return self.submit(coro).result(timeout_s)

    def is_current(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.current_thread() is self._thread

    def join(self, timeout_s: float) -> BaseException | None:
        """Wait for ``main`` to return; its error, if it failed."""
        self._thread.join(timeout_s)
        return self._error


async def _ended(ready: Callable[[], None]) -> None:
    """A `LoopThread`'s ``main`` once it ended."""


def open_store(options: KvtierOptions) -> StorageBackend | None:
    """The store the options name, unopened (call it on the loop that will use it)."""
    if options.store_path is not None:
        return FileStore(options.store_path, max_bytes=options.store_max_bytes)
    if options.redis_url is not None:
        from kvtier.storage import RedisStore

        store: StorageBackend = RedisStore(options.redis_url)
        return store
    return None


# One fixed page, the same bytes from every engine (puts are idempotent, so
# engines starting together never read another's probe as a mismatch). The
# key is no storage key of a block: those are BLAKE2b with kvtier-vllm's person.
PROBE_KEY = hashlib.blake2b(b"kvtier store probe", digest_size=32, person=b"kvtier-probe").digest()
PROBE_POOL = "probe"
PROBE_BYTES = b"kvtier store probe, format 1\n" * 8
PROBE_TIMEOUT_S = 10.0


async def _probe(store: StorageBackend) -> None:
    async with store:  # type: ignore[attr-defined]
        await store.put([PageBlobs(PROBE_KEY, {PROBE_POOL: PROBE_BYTES})])
        (present,) = await store.exists([PROBE_KEY])
        (got,) = await store.get([PROBE_KEY], [PROBE_POOL])
        if not present or got is None or bytes(got[PROBE_POOL]) != PROBE_BYTES:
            raise StorageError(f"{store.name}: a page just put did not read back whole", backend=store.name,
                               operation="probe")


def probe_store(options: KvtierOptions, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Put a probe page into the store the options name and read it back, so
    that a store that cannot work fails the engine's start, not its first
    write-through. Runs on a thread of its own (vLLM may call this from a
    thread with a running loop); returns at once without a store.

    Raises `ConfigurationError` naming the option and its value, with the
    store's error chained, when the put, the lookup or the read fails, the
    bytes differ, or it takes more than ``timeout_s`` (a store that does not answer).
    """
    if not options.has_store:
        return
    name, value = ("store_path", options.store_path) if options.store_path is not None else ("redis_url", options.redis_url)

    def run() -> None:
        store = open_store(options)
        assert store is not None
        asyncio.run(asyncio.wait_for(_probe(store), timeout_s))

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-probe") as pool:
        try:
            pool.submit(run).result()
        except ConfigurationError as exc:  # the store refused its settings when made (a path that is a file)
            raise ConfigurationError(f"kvtier option {name!r}={value!r} names a store kvtier cannot use: {exc}") from exc
        except (StorageError, OSError, TimeoutError) as exc:
            what = f"no answer within {timeout_s} s" if isinstance(exc, TimeoutError) else str(exc) or repr(exc)
            raise ConfigurationError(
                f"kvtier option {name!r}={value!r} names a store kvtier cannot use: writing and reading back "
                f"a probe page failed ({what})"
            ) from exc


class StoreClient:
    """A store opened on its own loop thread, asked synchronously.

    The scheduler side uses it for lookups: vLLM's ``lookup`` is a plain call,
    so ``exists`` waits for the answer, at most ``timeout_s`` (then raises
    ``TimeoutError``, which the lookup reads as a miss). `close` ends the
    thread; so does collecting the client (the thread holds only the store,
    not the client), and so does the interpreter's exit.
    """

    def __init__(self, options: KvtierOptions, *, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._open = _OpenStore(options)
        self._thread = LoopThread("kvtier-vllm-lookup", self._open.serve)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _close_store, self._thread, self._open)

    def exists(self, keys: list[bytes]) -> list[bool]:
        store = self._open.store
        if store is None:
            raise ConfigurationError("kvtier's store client is closed")
        return self._thread.call(store.exists(keys), self._timeout_s)

    def close(self) -> None:
        """End the store's thread (idempotent)."""
        self._finalizer()


class _OpenStore:
    """The store a `StoreClient` asks, open on the client's loop thread until stopped."""

    def __init__(self, options: KvtierOptions) -> None:
        self.options = options
        self.store: StorageBackend | None = None
        self.stop: asyncio.Event | None = None

    async def serve(self, ready: Callable[[], None]) -> None:
        store = open_store(self.options)
        if store is None:
            raise ConfigurationError("no store is configured (kvtier.store_path or kvtier.redis_url)")
        self.stop = asyncio.Event()
        async with store:  # type: ignore[attr-defined]
            self.store = store
            ready()
            await self.stop.wait()
        self.store = None


def _close_store(thread: LoopThread, open_store: _OpenStore) -> None:
    loop, stop = thread.loop, open_store.stop
    if loop is not None and stop is not None and not loop.is_closed():
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(stop.set)
    if not thread.is_current():
        thread.join(10.0)
