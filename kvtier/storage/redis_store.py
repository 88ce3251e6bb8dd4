"""`RedisStore`: pages in Redis or Valkey, through redis-py's asyncio client.

Needs the ``redis`` extra (``pip install 'kvtier[redis]'``, redis-py >= 5).

Keys, for page key ``K`` (hex) under ``prefix`` (default ``kvtier:``)::

    kvtier:{K}:c          commit record (JSON: blob lengths)
    kvtier:{K}:b:<pool>   one blob per pool

Each batch is sent as non-transactional pipelines of whole pages, each
closed once it holds ``max_pipeline_bytes`` of blobs (so at most one page
over it) or before it would pass ``max_pipeline_commands`` commands (a page
with more goes alone), one after the other; in each, every page's blob
``SET``s precede its commit ``SET``. Lookups and reads are cut the same way:
redis-py parses a pipeline's replies in one step of the event loop when they
have all arrived, ~8 us each in pure Python, so the command bound is the
bound on that step (an ``exists`` of 1,024 stored pages in one pipeline held
the loop 20-25 ms). Redis runs one connection's commands in the order sent, and a command
cut short by a dropped connection is never run, so a page's commit record
exists only once all of its blobs do: a killed server, a dropped connection,
a timeout or a cancelled put leaves some pages whole and the rest invisible,
never a partial page (see `kvtier.storage.base`). ``get`` reads a page's
commit record and blobs in the same pipeline and returns the page only if
every blob is there with the committed length, so a blob evicted on its own
(``maxmemory`` policies, ``ttl_s``) reads as a miss. ``exists`` checks the
same without moving the blobs: it reads the commit records and the ``STRLEN``
of each blob they name, in one pipeline when the blobs are the ones the last
lookup saw (the usual case: a store holds pages of a few anchors), else in a
second one for the rest. A malformed or foreign commit record (not ours, or
a key of another type) is a miss for its page, not an error. A put ``SET``s
every key anew, so it replaces a page that was damaged in the store. A blob
of 0 bytes is not stored: its commit record says all there is of it (see
`kvtier.storage.base`).

The largest value Redis takes is its ``proto-max-bulk-len`` (512 MiB unless
configured); a put of a blob over ``max_value_bytes`` (default the same) is
refused before anything of its batch is sent, with a `StorageError` naming
the blob's size and the bound. Set ``max_value_bytes`` to the server's
setting where it differs.

Connections come from a `redis.asyncio.BlockingConnectionPool` of
``max_connections`` (a caller waits up to ``timeout_s`` for a free one).
``timeout_s`` bounds connecting, sending a pipeline and waiting for each
reply; a deadline that passes raises `StorageTimeout`, and any other failure
(refused or dropped connection, error reply) `StorageError`, the redis-py
exception chained. Failed commands are retried ``retries`` times (default 0:
the caller decides).

Redis Cluster: pass ``cluster=True`` with the URL of any node
(``RedisStore("redis://node1:7000", cluster=True)``), or pass your own
``redis.asyncio.cluster.RedisCluster`` (or ``redis.asyncio.Redis``) client
instead of a URL; the store then uses it as is and does not close it. A
page's keys share the hash tag ``{K}``, so they live on one node and its
blobs still precede its commit there; different pages spread over the cluster.
Each call sends every master its own pages (all masters at once), so a master
that fails costs only its pages: they read as misses (counted in
`RedisStore.node_errors`), also when a batch holds only its pages (a one-page
prefetch); a put that touches it stores the others' pages and raises
`StorageError` naming it; a read raises only when the cluster as a whole
refuses (``CLUSTERDOWN``, or every master failed).
Run the cluster with ``cluster-require-full-coverage no``, or one failed
master stops the whole cluster (``CLUSTERDOWN``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import urllib.parse

import anyio
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from typing import Any

from kvtier.errors import ConfigurationError
from kvtier.storage.base import (
    PageBlobs,
    assemble,
    check_keys,
    check_pools,
    check_value_sizes,
    decode_commit,
    encode_commit,
    is_present,
)
from kvtier.storage.errors import StorageError, StorageTimeout

try:
    import redis
    import redis.asyncio as aioredis
    import redis.exceptions as redis_errors
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    # What a redis-py call raises when the store fails: its RedisClusterException
    # (no slot map to build, a slot no node covers) is not a RedisError.
    _REDIS_FAILURES: tuple[type[BaseException], ...] = (
        redis_errors.RedisError, redis_errors.RedisClusterException, OSError)
except ImportError:  # pragma: no cover - exercised only without the extra
    aioredis = None  # type: ignore[assignment]
    _REDIS_FAILURES = (OSError,)

CLIENT_OPTIONS: dict[str, Any] = {}
"""Keyword arguments kvtier gives every redis-py client it opens (the benchmark's raw client too)."""
if aioredis is not None:
    try:
        from redis.driver_info import DriverInfo
    except ImportError:  # redis-py < 7 reads its version once, at import
        pass
    else:
        # Otherwise redis-py >= 7 looks its version up in the installed
        # packages' metadata (file I/O) each time it opens a connection, on
        # the event loop. Its module attribute holds the same string.
        CLIENT_OPTIONS["driver_info"] = DriverInfo(name="redis-py", lib_version=redis.__version__)

__all__ = ["RedisStore"]

DEFAULT_URL = "redis://127.0.0.1:6379/0"

DEFAULT_PIPELINE_BYTES = 2 << 20
"""Bytes of blobs per put pipeline. Sending a pipeline copies all of it on the
event loop (redis-py joins the command buffers; asyncio's transport buffers
what the socket does not take at once): measured on 2 busy cores, 64 MiB
pipelines stalled the loop for ~230 ms, 4 MiB ones ~13 ms, 1-2 MiB ones no
more than the idle loop's own p99 (~5 ms there), with the same throughput."""

DEFAULT_MAX_VALUE_BYTES = 512 << 20
"""Redis's default ``proto-max-bulk-len``: the largest value it accepts."""

DEFAULT_PIPELINE_COMMANDS = 48
"""Commands per pipeline. A pipeline's replies are parsed in one step of the
event loop once they have arrived (redis-py reads buffered replies without
yielding): measured on 2 shared cores, ~8 us per reply with redis-py's
Python parser, so 48 keep that step near 0.4 ms (with the next pipeline's
commands packed in the same step), at one round trip per 16 three-blob pages."""

_GUESSED_BLOBS = 8
"""At most this many blob names, from the last lookup, that `RedisStore.exists`
asks the lengths of in its first pipeline."""


def _positive_seconds(value: object) -> bool:
    """Whether ``value`` is a number of seconds > 0 (not a bool, not NaN)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


class RedisStore:
    """A `StorageBackend` over Redis, Valkey or Redis Cluster.

    ``url_or_client``: a ``redis://`` / ``rediss://`` / ``unix://`` URL, or a
    ready ``redis.asyncio`` client (``Redis`` or ``RedisCluster``) that the
    caller owns. ``timeout_s``: see the module doc. ``ttl_s``: expire pages
    after this many seconds (None: keep them until Redis evicts them).
    ``max_value_bytes``: the largest blob a put sends (the server's
    ``proto-max-bulk-len``); a larger one is refused (see the module doc).
    ``before_commit``: a fault-injection seam for tests; called with each
    page's key after its blobs are queued in the pipeline and before its commit;
    if it raises, what was queued so far is sent (that page's blobs land, its
    commit does not) and the put raises `StorageError`.

    Raises `ImportError` without redis-py, `ValueError` for bad settings.
    Use as ``async with RedisStore(...) as store:`` or call `aclose`.
    """

    name = "redis"

    def __init__(
        self,
        url_or_client: str | Any = DEFAULT_URL,
        *,
        timeout_s: float = 5.0,
        max_connections: int = 16,
        cluster: bool = False,
        prefix: str = "kvtier:",
        ttl_s: float | None = None,
        max_pipeline_bytes: int = DEFAULT_PIPELINE_BYTES,
        max_pipeline_pages: int = 1024,
        max_pipeline_commands: int = DEFAULT_PIPELINE_COMMANDS,
        retries: int = 0,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        before_commit: Callable[[bytes], None] | None = None,
    ) -> None:
        if aioredis is None:
            raise ImportError("RedisStore needs redis-py: pip install 'kvtier[redis]'")
        if not _positive_seconds(timeout_s):
            raise ConfigurationError(f"timeout_s must be > 0 seconds; got {timeout_s!r}")
        if ttl_s is not None and not _positive_seconds(ttl_s):
            raise ConfigurationError(f"ttl_s must be None or > 0 seconds; got {ttl_s!r}")
        if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
            raise ConfigurationError(
                f"prefix must be a string and must not contain braces (they would change the cluster hash tag); got {prefix!r}"
            )
        for label, value in (("max_connections", max_connections), ("max_pipeline_bytes", max_pipeline_bytes),
                             ("max_pipeline_pages", max_pipeline_pages),
                             ("max_pipeline_commands", max_pipeline_commands)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{label} must be a positive integer; got {value!r}")
        if isinstance(max_value_bytes, bool) or not isinstance(max_value_bytes, int) or max_value_bytes < 1:
            raise ConfigurationError(f"RedisStore max_value_bytes must be a positive integer; got {max_value_bytes!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigurationError(f"retries must be an integer >= 0; got {retries!r}")
        self.timeout_s = float(timeout_s)
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.prefix = prefix.encode()
        self.max_pipeline_bytes = max_pipeline_bytes
        self.max_pipeline_pages = max_pipeline_pages
        self.max_pipeline_commands = max_pipeline_commands
        self.max_value_bytes = max_value_bytes
        self.before_commit = before_commit
        self._closed = False
        self._pool: Any = None
        # Bytes of the last page put or read: sizes get pipelines.
        self._page_nbytes: int | None = None
        # Pools the commit records of the last lookup named: exists asks their
        # blobs' lengths with the records, saving a round trip when they match.
        self._blob_names: tuple[str, ...] = ()
        # Redis Cluster: per master ("host:port"), the calls it failed while the others answered.
        self.node_errors: dict[str, int] = {}
        if isinstance(url_or_client, str):
            self._owned = True
            self.url = _redact(url_or_client)
            common: dict[str, Any] = {
                "socket_timeout": timeout_s,
                "socket_connect_timeout": timeout_s,
                "retry": Retry(NoBackoff(), retries),
                **CLIENT_OPTIONS,
            }
            try:
                if cluster:
                    # require_full_coverage=False: a slot no master serves costs its own pages
                    # (misses, a failed put), not every call (redis-py's default refuses to map
                    # a cluster with a gap); a cluster that requires coverage refuses by itself
                    self.client: Any = RedisCluster.from_url(
                        url_or_client, max_connections=max_connections, require_full_coverage=False, **common
                    )
                else:
                    self._pool = aioredis.BlockingConnectionPool.from_url(
                        url_or_client, max_connections=max_connections, timeout=timeout_s, **common
                    )
                    self.client = aioredis.Redis(connection_pool=self._pool)
            except ValueError as exc:  # redis-py's parse_url: no scheme, a bad port or db
                raise ConfigurationError(
                    f"RedisStore url {self.url!r} is not a Redis URL (redis://HOST:PORT/DB, rediss://..., "
                    f"unix://PATH): {exc}"
                ) from exc
        else:
            self._owned = False
            self.url = repr(url_or_client)
            self.client = url_or_client

    # -- keys -----------------------------------------------------------------

    def _commit_key(self, key: bytes) -> bytes:
        return b"%s{%s}:c" % (self.prefix, key.hex().encode())

    def _blob_key(self, key: bytes, pool: str) -> bytes:
        return b"%s{%s}:b:%s" % (self.prefix, key.hex().encode(), pool.encode())

    # -- protocol -------------------------------------------------------------

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether its page is present (see `StorageBackend.exists`):
        a well-formed commit record, and every blob it names stored with its length."""
        keys = check_keys(keys)
        async with self._translate("exists"):
            if isinstance(self.client, RedisCluster):
                return await self._by_node("exists", keys, False, self._exists_keys)
            return await self._exists_keys(keys)

    async def _exists_keys(self, keys: list[bytes]) -> list[bool]:
        out: list[bool] = []
        while len(out) < len(keys):
            # The guess can change with each chunk's answers: sized per chunk.
            chunk = self._pages_per_pipeline(1 + len(self._blob_names))
            out.extend(await self._exists_chunk(keys[len(out):len(out) + chunk]))
        return out

    def _pages_per_pipeline(self, per_page: int) -> int:
        """Pages of ``per_page`` commands each that one pipeline holds: at most
        ``max_pipeline_pages`` and ``max_pipeline_commands`` (one page at least)."""
        return max(1, min(self.max_pipeline_pages, self.max_pipeline_commands // per_page))

    async def _exists_chunk(self, keys: list[bytes]) -> list[bool]:
        guess = self._blob_names
        per_page = 1 + len(guess)
        async with self.client.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.get(self._commit_key(k))
                for name in guess:
                    # 0 for a missing key, as for an empty blob (a kvtier blob never is: it has a header)
                    pipe.strlen(self._blob_key(k, name))
            replies = await pipe.execute(raise_on_error=False)
        commits: list[dict[str, int] | None] = []
        lengths: list[dict[str, int | None]] = []
        for i in range(len(keys)):
            raw, *sizes = (_reply(r) for r in replies[i * per_page:(i + 1) * per_page])
            commits.append(decode_commit(raw))
            lengths.append(dict(zip(guess, sizes)))
        unasked = [(i, name) for i, c in enumerate(commits) if c is not None for name, n in c.items()
                   if n and name not in lengths[i]]
        for start in range(0, len(unasked), self.max_pipeline_commands):
            part = unasked[start:start + self.max_pipeline_commands]
            async with self.client.pipeline(transaction=False) as pipe:
                for i, name in part:
                    pipe.strlen(self._blob_key(keys[i], name))
                for (i, name), n in zip(part, await pipe.execute(raise_on_error=False)):
                    lengths[i][name] = _reply(n)
        named = sorted({name for c in commits if c is not None for name in c})
        if named:
            self._blob_names = tuple(named[:_GUESSED_BLOBS])
        return [is_present(c, n) for c, n in zip(commits, lengths)]

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        """For each key, its blobs for ``pools``, or None (see `StorageBackend.get`).

        The commit record and the blobs are read in one pipeline per chunk of pages.
        """
        keys, names = check_keys(keys), check_pools(pools)
        async with self._translate("get"):
            if isinstance(self.client, RedisCluster):
                return await self._by_node("get", keys, None, lambda part: self._get_keys(part, names))
            return await self._get_keys(keys, names)

    async def _get_keys(self, keys: list[bytes], names: list[str]) -> list[dict[str, bytes] | None]:
        out: list[dict[str, bytes] | None] = []
        per_page = 1 + len(names)
        start = 0
        while start < len(keys):
            batch = keys[start:start + self._get_chunk(per_page)]
            start += len(batch)
            async with self.client.pipeline(transaction=False) as pipe:
                for k in batch:
                    pipe.get(self._commit_key(k))
                    for name in names:
                        pipe.get(self._blob_key(k, name))
                replies = await pipe.execute(raise_on_error=False)
            for i in range(len(batch)):
                commit_raw, *blobs = (_reply(r) for r in replies[i * per_page:(i + 1) * per_page])
                page = assemble(decode_commit(commit_raw), dict(zip(names, blobs)), names)
                if page is not None:
                    self._page_nbytes = sum(len(b) for b in page.values())
                out.append(page)
        return out

    def _get_chunk(self, per_page: int) -> int:
        """Pages per get pipeline: about max_pipeline_bytes of replies, judged by
        the last page seen (one page while none has been): big replies read
        slower than a few small ones (measured ~0.6x at 128 MiB vs 2 MiB).
        At most `_pages_per_pipeline` pages."""
        most = self._pages_per_pipeline(per_page)
        if self._page_nbytes is None:
            return 1
        # Pages until the bound is reached (ceiling): pages of 1.1 MiB go two to
        # a 2 MiB pipeline, not one, halving the round trips.
        return max(1, min(most, -(-self.max_pipeline_bytes // max(1, self._page_nbytes))))

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        """Store every page, each page's blobs before its commit (see the module
        doc). Raises `StorageError` before sending anything for a blob over
        ``max_value_bytes``."""
        pages = list(pages)
        check_value_sizes(pages, self.max_value_bytes, self.name, "max_value_bytes")
        async with self._translate("put"):
            if isinstance(self.client, RedisCluster):
                by_key = {p.key: p for p in pages}
                await self._by_node("put", [p.key for p in pages], None,
                                    lambda part: self._put_pages([by_key[k] for k in part]))
                return
            await self._put_pages(pages)

    async def _put_pages(self, pages: list[PageBlobs]) -> list[None]:
        for chunk in self._chunks(pages):
            await self._put_chunk(chunk)
        return [None] * len(pages)

    # -- Redis Cluster: one node's failure is its pages' ------------------------

    async def _by_node(
        self, operation: str, keys: list[bytes], miss: Any, run: Callable[[list[bytes]], Awaitable[list[Any]]]
    ) -> list[Any]:
        """``run`` over the keys of each master, all masters at once.

        A master that fails (down, unreachable, refusing its slots) makes its
        pages misses (``miss``) for exists and get, and is counted in
        `node_errors`; the other masters' pages are answered as usual, and a
        batch whose pages all live on the failed master (a one-page prefetch)
        is all misses the same way. For a put when any master failed (its pages
        are not stored), or a read that the whole cluster refused (see
        `_cluster_down`), raises `StorageError` (`StorageTimeout` when each
        failure was a timeout) naming the failed nodes.
        """
        await self.client.initialize()  # a no-op once the slot map is known
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            try:
                node = self.client.get_node_from_key(self._commit_key(key))
            except redis_errors.SlotNotCoveredError:  # its master left the client's slot map: its call fails below
                node = None
            groups.setdefault(node.name if node is not None else "no node for its slot", []).append(i)
        out = [miss] * len(keys)
        failed: dict[str, BaseException] = {}
        other: list[BaseException] = []

        async def one(name: str, idx: list[int]) -> None:
            try:
                got = await run([keys[i] for i in idx])
            except _REDIS_FAILURES as exc:
                failed[name] = exc
                return
            except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
                other.append(exc)
                return
            for i, value in zip(idx, got):
                out[i] = value

        async with anyio.create_task_group() as tg:
            for name, idx in groups.items():
                tg.start_soon(one, name, idx)
        if other:
            raise other[0]
        for name in failed:
            self.node_errors[name] = self.node_errors.get(name, 0) + 1
        if failed and (operation == "put" or self._cluster_down(failed)):
            nodes = ", ".join(sorted(failed))
            first = next(iter(failed.values()))
            what = f"redis node {nodes} failed {operation} ({len(failed)} of {len(groups)} nodes of the batch)"
            if all(isinstance(e, (redis_errors.TimeoutError, TimeoutError)) for e in failed.values()):
                raise StorageTimeout(
                    f"{what}: no answer within {self.timeout_s:g} s", backend=self.name, operation=operation,
                    timeout_s=self.timeout_s,
                ) from first
            raise StorageError(f"{what}: {type(first).__name__}: {first}", backend=self.name,
                               operation=operation) from first
        return out

    def _cluster_down(self, failed: dict[str, BaseException]) -> bool:
        """Whether a read's failures are the cluster's, not one master's: a node
        answered ``CLUSTERDOWN`` (full coverage required and a master flagged
        failed), or every master the client knows failed. Then there is no
        store to miss in, and the read raises. "CLUSTERDOWN Hash slot not
        served" is not the cluster's: one slot has no master (a cluster that
        does not require full coverage), and only that master's pages miss."""
        if any((isinstance(e, redis_errors.ClusterDownError) or "CLUSTERDOWN" in str(e))
               and "Hash slot not served" not in str(e) for e in failed.values()):
            return True
        masters = {node.name for node in self.client.get_primaries()}
        return masters <= failed.keys()

    async def clear(self) -> int:
        """Delete every key under this store's prefix (``SCAN`` + ``UNLINK``, on
        every node of a cluster); how many pages had a commit record. Other
        prefixes are left alone, so give each namespace its own prefix."""
        pattern = _glob_escape(self.prefix) + b"*"
        pages = 0
        async with self._translate("clear"):
            batch: list[bytes] = []
            async for name in self.client.scan_iter(match=pattern, count=1000):
                batch.append(name)
                pages += name.endswith(b":c")
                if len(batch) >= 512:
                    await self._unlink(batch)
                    batch = []
            if batch:
                await self._unlink(batch)
        return pages

    async def _unlink(self, names: list[bytes]) -> None:
        # redis-py's cluster client splits a multi-key UNLINK by hash slot itself
        # (its pipeline does not queue UNLINK: it would never be sent).
        await self.client.unlink(*names)

    async def aclose(self) -> None:
        """Close the connections this store opened (not a client passed in)."""
        if self._closed:
            return
        self._closed = True
        if self._owned:
            # Closing only drops sockets; a failure there leaves nothing to undo.
            with contextlib.suppress(Exception):
                await self.client.aclose()  # redis-py >= 5.0.1 (kvtier needs 5.0.8): close() is deprecated
            if self._pool is not None:
                with contextlib.suppress(Exception):
                    await self._pool.disconnect()

    async def __aenter__(self) -> RedisStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        ttl = "none" if self.ttl_ms is None else f"{self.ttl_ms / 1000:g}s"
        return f"<RedisStore {self.url} [timeout={self.timeout_s:g}s, ttl={ttl}, prefix={self.prefix.decode()!r}]>"

    # -- internals ------------------------------------------------------------

    def _chunks(self, pages: list[PageBlobs]) -> Iterator[list[PageBlobs]]:
        """Split a batch into pipelines of whole pages: each closed once it
        reaches max_pipeline_bytes (so by at most one page over it), at
        max_pipeline_pages, or before the next page's commands (its blobs and
        commit) would take it over max_pipeline_commands. Lazily: sizing 1,024
        pages at once held the loop ~1 ms; now each pipeline sizes its own."""
        current: list[PageBlobs] = []
        size = commands = 0
        for page in pages:
            n = page.nbytes
            self._page_nbytes = n
            page_commands = len(page.blobs) + 1
            if current and (size >= self.max_pipeline_bytes or len(current) >= self.max_pipeline_pages
                            or commands + page_commands > self.max_pipeline_commands):
                yield current
                current, size, commands = [], 0, 0
            current.append(page)
            size += n
            commands += page_commands
        if current:
            yield current

    async def _put_chunk(self, pages: list[PageBlobs]) -> None:
        px = self.ttl_ms
        stopped: BaseException | None = None
        stopped_at = b""
        async with self.client.pipeline(transaction=False) as pipe:
            for page in pages:
                for pool, data in page.blobs.items():
                    view = memoryview(data).cast("B")
                    if len(view):  # an empty blob is its commit record's length alone
                        pipe.set(self._blob_key(page.key, pool), view, px=px)
                if self.before_commit is not None:
                    try:
                        self.before_commit(page.key)
                    except Exception as exc:  # noqa: BLE001 - any fault the hook injects
                        stopped, stopped_at = exc, page.key
                        break
                pipe.set(self._commit_key(page.key), encode_commit(page), px=px)
            await pipe.execute()
        if stopped is not None:
            raise StorageError(
                f"redis put stopped before the commit of page {stopped_at.hex()}: {stopped}",
                backend=self.name, operation="put",
            ) from stopped

    @contextlib.asynccontextmanager
    async def _translate(self, operation: str) -> AsyncIterator[None]:
        """The one place redis-py's exceptions become kvtier's."""
        if self._closed:
            raise StorageError("redis store is closed", backend=self.name, operation=operation)
        _require_asyncio()
        try:
            yield
        except StorageError:
            raise
        except (redis_errors.TimeoutError, TimeoutError) as exc:
            raise StorageTimeout(
                f"redis {self.url} did not answer {operation} within {self.timeout_s:g} s: {exc}",
                backend=self.name, operation=operation, timeout_s=self.timeout_s,
            ) from exc
        except _REDIS_FAILURES as exc:
            raise StorageError(
                f"redis {self.url} failed {operation}: {type(exc).__name__}: {exc}",
                backend=self.name, operation=operation,
            ) from exc


def _require_asyncio() -> None:
    """`ConfigurationError` unless an asyncio loop runs: redis-py's client is
    asyncio's (the scheduler refuses other anyio backends the same way)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        found = "no asyncio event loop"
        trio = sys.modules.get("trio")
        if trio is not None:
            with contextlib.suppress(RuntimeError):
                trio.lowlevel.current_task()
                found = "trio"
        raise ConfigurationError(
            f"RedisStore runs on asyncio (or uvloop): redis-py's client is asyncio's; found {found}: "
            "use anyio.run(..., backend='asyncio') or asyncio.run(...), or FileStore, which runs on any "
            "anyio backend"
        ) from None


def _reply(value: Any) -> Any:
    """A pipeline reply (read with ``raise_on_error=False``): a key of another
    type than ours (``WRONGTYPE``: foreign data under our name) reads as
    missing; any other error reply is raised, for `RedisStore._translate`."""
    if isinstance(value, redis_errors.ResponseError) and str(value).startswith("WRONGTYPE"):
        return None
    if isinstance(value, Exception):  # an error reply, or a node's failure a cluster pipeline handed back
        raise value
    return value


def _glob_escape(prefix: bytes) -> bytes:
    """``prefix`` as a literal in a Redis ``MATCH`` pattern."""
    return bytes(b for ch in prefix for b in ((92, ch) if ch in b"*?[]\\" else (ch,)))


def _redact(url: str) -> str:
    """The URL without its password, for messages and repr."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable redis url>"
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
