"""`MooncakeStore`: pages in a Mooncake distributed store (experimental).

Needs ``pip install mooncake-transfer-engine-non-cuda`` (or the CUDA build)
and, on Debian, ``apt-get install libibverbs1`` (the wheel links against it even
for TCP), plus a running ``mooncake_master`` with its HTTP metadata server::

    mooncake_master --rpc_port=50051 --enable_http_metadata_server=true \\
        --http_metadata_server_host=127.0.0.1 --http_metadata_server_port=8080

Objects, for page key ``K`` (hex) under ``prefix``: ``<prefix>K/b/<pool>`` per
blob and ``<prefix>K/c`` for the commit record, written by a second batch call
once the blobs' batch succeeded; readers consult the commit record and check
every blob's length (a missing object reads as empty in Mooncake, and objects
are evicted one by one), so no partial page is ever visible (see
`kvtier.storage.base`). A malformed or foreign commit record is a miss.

``exists`` reads the commit records of the pages that have one (small
objects) and asks which of the blobs they name exist, one batch call each.
It does not check the blobs' lengths: Mooncake has no batched size query
(``get_size`` is a round trip to the master per object), and it stores and
evicts an object whole, never truncated, so a blob that exists has the
length it was written with; a blob of another length under our name (another
writer's format) is still caught by ``get``, which compares every length.

A blob of 0 bytes is not stored (Mooncake refuses an empty object): its
commit record says all there is of it (see `kvtier.storage.base`).

Every value of a batch call passes through the client's local buffer
(``local_buffer_size``): a value larger than it is refused by Mooncake
(code -600), and in a call whose values add up to more, the values after
the buffer filled are lost (a put fails, a read gets ``b""``). The buffer's
allocator rounds every value up to a size of four significant bits (a value of
``2**15 + 1`` bytes takes ``2**15 + 2**12``; measured against a mooncake_master:
two values adding up to the buffer but not to a multiple of those steps do not
fit together). So calls are cut to fit the buffer, counting each value's
rounded size, and a put of a blob over ``local_buffer_size`` is
refused before anything of its batch is sent, with a `StorageError` naming
the blob's size and the bound: ``local_buffer_size`` is the largest page blob
this store takes. A ``store`` passed in must have been set up with
``local_buffer_size`` as given here.

``put`` uses ``upsert_batch`` (insert or replace) where the client has it, so
putting a page again replaces a copy that was damaged in the store. Older
clients only have ``put_batch``, which keeps an object already stored under
its key: with them a damaged page stays damaged until Mooncake evicts it (or
someone removes it) and every read of it fails `decode_page`'s check.

The Mooncake client is synchronous: every batch runs in one worker thread
(one at a time), under ``timeout_s``; a call that overruns raises
`StorageTimeout` and is left to finish in its thread. The bytes live in the
memory segments that clients mount (``global_segment_size`` here): pages
outlive this process only if another client (another engine, or a dedicated
store service) holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from kvtier.errors import ConfigurationError
from kvtier.storage.base import (
    PageBlobs,
    assemble,
    check_keys,
    check_pools,
    check_value_sizes,
    decode_commit,
    encode_commit,
)
from kvtier.storage.errors import StorageError, StorageTimeout

__all__ = ["MooncakeStore"]

_T = TypeVar("_T")

# What a commit record may take in the local buffer, for cutting reads of them
# into calls that fit (a record is a few dozen bytes a pool).
_RECORD_BYTES = 1024


def _buffer_footprint(size: int) -> int:
    """The bytes a value of ``size`` bytes takes in the client's local buffer:
    its allocator rounds a size up to four significant bits (sizes under 16 are
    exact; 17 takes 18, ``2**16 - 100`` takes ``2**16``)."""
    step = 1 << max(size.bit_length() - 4, 0)
    return -(-size // step) * step


class MooncakeStore:
    """A `StorageBackend` over Mooncake's store (TCP or RDMA).

    ``master_server_addr`` (``host:port``) and ``metadata_server`` (e.g.
    ``http://127.0.0.1:8080/metadata``) name the cluster; ``local_hostname``
    is this client's address as the others reach it. Or pass a ready
    ``store`` (a set-up ``MooncakeDistributedStore``) that the caller owns.
    ``before_commit``: a fault-injection seam for tests, as in `FileStore`.
    Raises `ImportError` without the mooncake package; `StorageError` from the
    first call if the client cannot be set up.
    """

    name = "mooncake"

    def __init__(
        self,
        master_server_addr: str = "127.0.0.1:50051",
        metadata_server: str = "http://127.0.0.1:8080/metadata",
        *,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        global_segment_size: int = 512 << 20,
        local_buffer_size: int = 128 << 20,
        timeout_s: float = 30.0,
        prefix: str = "kvtier/",
        store: Any = None,
        before_commit: Callable[[bytes], None] | None = None,
    ) -> None:
        if store is None:
            import mooncake.store  # noqa: F401 - here, not at the first call: ImportError names the package
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigurationError(f"timeout_s must be > 0 seconds; got {timeout_s!r}")
        if isinstance(local_buffer_size, bool) or not isinstance(local_buffer_size, int) or local_buffer_size < 1:
            raise ConfigurationError(
                f"MooncakeStore local_buffer_size must be a positive integer of bytes; got {local_buffer_size!r}"
            )
        self.local_buffer_size = local_buffer_size
        self._setup_args = (local_hostname, metadata_server, global_segment_size, local_buffer_size,
                            protocol, device_name, master_server_addr)
        self.master_server_addr = master_server_addr
        self.timeout_s = float(timeout_s)
        self.prefix = prefix
        self.before_commit = before_commit
        self._store = store
        self._owned = store is None
        self._limiter = anyio.CapacityLimiter(1)
        self._closed = False

    def _commit_key(self, key: bytes) -> str:
        return f"{self.prefix}{key.hex()}/c"

    def _blob_key(self, key: bytes, pool: str) -> str:
        return f"{self.prefix}{key.hex()}/b/{pool}"

    # -- protocol -------------------------------------------------------------

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether its page is present: a well-formed commit record
        and every blob it names stored (lengths: see the module doc)."""
        keys = check_keys(keys)
        if not keys:
            return []

        def run(store: Any) -> list[bool]:
            hits = [k for k, c in zip(keys, self._is_exist(store, [self._commit_key(k) for k in keys], "exists")) if c]
            records = self._get_values(store, [(self._commit_key(k), _RECORD_BYTES) for k in hits])
            commits = {k: c for k, raw in zip(hits, records) if (c := decode_commit(raw)) is not None}
            blob_keys = [(k, self._blob_key(k, name)) for k, c in commits.items() for name, n in c.items() if n]
            found = self._is_exist(store, [b for _, b in blob_keys], "exists") if blob_keys else []
            whole = set(commits)
            for (k, _), here in zip(blob_keys, found):
                if not here:
                    whole.discard(k)
            return [k in whole for k in keys]

        return await self._run("exists", run)

    def _is_exist(self, store: Any, names: list[str], operation: str) -> list[bool]:
        """(Worker thread) whether each object exists; `StorageError` for a failed lookup."""
        codes = store.batch_is_exist(names)
        bad = [c for c in codes if c < 0]
        if bad:
            raise StorageError(f"mooncake is_exist failed with code {bad[0]}", backend=self.name, operation=operation)
        return [c == 1 for c in codes]

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        """For each key, its blobs for ``pools``, or None (see `StorageBackend.get`)."""
        keys, names = check_keys(keys), check_pools(pools)
        if not keys:
            return []

        def run(store: Any) -> list[dict[str, bytes] | None]:
            # get_batch reads a missing object, and any failure, as b"": ask
            # which commit records exist first, so a failure is an error (the
            # codes are negative) and misses move no bytes.
            codes = self._is_exist(store, [self._commit_key(k) for k in keys], "get")
            hits = [k for k, c in zip(keys, codes) if c]
            records = self._get_values(store, [(self._commit_key(k), _RECORD_BYTES) for k in hits])
            # Then the blobs the records name with bytes, in calls that fit the
            # buffer. The records' lengths tell a stored blob from a missing
            # (evicted) one, which reads as b"".
            commits = {k: decode_commit(raw) for k, raw in zip(hits, records)}
            wanted = [(k, p, n) for k, c in commits.items() if c is not None for p in names if (n := c.get(p))]
            values = self._get_values(store, [(self._blob_key(k, p), n) for k, p, n in wanted])
            blobs: dict[bytes, dict[str, bytes]] = {}
            for (k, p, _), value in zip(wanted, values):
                blobs.setdefault(k, {})[p] = value
            return [assemble(commits.get(k), blobs.get(k, {}), names) for k in keys]

        return await self._run("get", run)

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        """Store the blobs of every page, then the commit records, each in
        batch calls that fit the local buffer, replacing stored objects where
        the client can (see the module doc). Raises `StorageError` before
        sending anything for a blob over ``local_buffer_size``."""
        pages = list(pages)
        if not pages:
            return
        check_value_sizes(pages, self.local_buffer_size, self.name, "local_buffer_size")

        def run(store: Any) -> None:
            committed = pages
            keys, values = [], []
            for page in pages:
                for pool, data in page.blobs.items():
                    view = memoryview(data).cast("B")
                    if len(view):  # an empty blob is its commit record's length alone
                        keys.append(self._blob_key(page.key, pool))
                        values.append(view)
            write = getattr(store, "upsert_batch", None) or store.put_batch
            self._write(write, keys, values, "blobs")
            stopped: Exception | None = None
            if self.before_commit is not None:
                for i, page in enumerate(pages):
                    try:
                        self.before_commit(page.key)
                    except Exception as exc:  # noqa: BLE001 - any fault the hook injects
                        committed, stopped = pages[:i], exc
                        break
            if committed:
                self._write(write, [self._commit_key(p.key) for p in committed],
                            [memoryview(encode_commit(p)) for p in committed], "commit records")
            if stopped is not None:
                raise StorageError(
                    f"mooncake put stopped before the commit of page {pages[len(committed)].key.hex()}: {stopped}",
                    backend=self.name, operation="put",
                ) from stopped

        await self._run("put", run)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owned and self._store is not None:
            store, self._store = self._store, None
            await anyio.to_thread.run_sync(store.close, limiter=self._limiter)

    async def __aenter__(self) -> MooncakeStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<MooncakeStore {self.master_server_addr} [timeout={self.timeout_s:g}s, prefix={self.prefix!r}]>"

    # -- internals ------------------------------------------------------------

    def _client(self) -> Any:
        """The set-up client (worker thread only)."""
        if self._store is None:  # an owned client not set up yet: one passed in is kept to the end
            from mooncake.store import MooncakeDistributedStore  # imported by __init__

            store = MooncakeDistributedStore()
            rc = store.setup(*self._setup_args)
            if rc != 0:
                raise StorageError(
                    f"mooncake client setup against master {self.master_server_addr} failed with code {rc}",
                    backend=self.name, operation="setup",
                )
            self._store = store
        return self._store

    def _calls(self, sizes: list[int]) -> list[slice]:
        """Consecutive runs of values whose sizes, as the local buffer's allocator
        rounds them (`_buffer_footprint`), add up to at most the local buffer (each
        value is at most that: `check_value_sizes`)."""
        runs: list[slice] = []
        start = total = 0
        for i, size in enumerate(sizes):
            n = _buffer_footprint(size)
            if i > start and total + n > self.local_buffer_size:
                runs.append(slice(start, i))
                start, total = i, 0
            total += n
        if start < len(sizes):
            runs.append(slice(start, len(sizes)))
        return runs

    def _write(self, write: Callable[[list[str], list[memoryview]], int], keys: list[str],
               values: list[memoryview], what: str) -> None:
        """(Worker thread) ``write`` the values in calls that fit the local buffer."""
        for run in self._calls([len(v) for v in values]):
            rc = write(keys[run], values[run])
            if rc != 0:
                raise StorageError(f"mooncake put of {run.stop - run.start} {what} failed with code {rc}",
                                   backend=self.name, operation="put")

    def _get_values(self, store: Any, named: list[tuple[str, int]]) -> list[bytes]:
        """(Worker thread) the objects named, each ``(name, size)`` (at most that
        size), read in calls that fit the local buffer."""
        out: list[bytes] = []
        for run in self._calls([n for _, n in named]):
            out.extend(store.get_batch([name for name, _ in named[run]]))
        return out

    async def _run(self, operation: str, fn: Callable[[Any], _T]) -> _T:
        if self._closed:
            raise StorageError("mooncake store is closed", backend=self.name, operation=operation)
        try:
            with anyio.fail_after(self.timeout_s):
                return await anyio.to_thread.run_sync(
                    lambda: fn(self._client()), limiter=self._limiter, abandon_on_cancel=True
                )
        except TimeoutError as exc:
            raise StorageTimeout(
                f"mooncake did not answer {operation} within {self.timeout_s:g} s",
                backend=self.name, operation=operation, timeout_s=self.timeout_s,
            ) from exc
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(f"mooncake {operation} failed: {type(exc).__name__}: {exc}",
                               backend=self.name, operation=operation) from exc
