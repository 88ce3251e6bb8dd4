"""`FileStore`: pages in a directory on local disk, the embedded default.

Layout under ``directory``: one file a page, ::

    ab/abcdef...0123.data     the page file: a header, then the page's blobs,
                              one after the other, in the order of their pool
                              names (sorted)

The header is 8 bytes of magic (``kvtpage1``: this layout), the length of the
record that follows (4 bytes, little-endian) and the record (the commit record
of `kvtier.storage.base`: JSON, the format version and the blob lengths by
pool). A page is present when its file starts with the magic and a
well-formed record and is exactly as long as header and blobs add up to
(`exists` opens the file, reads the header and stats it; `get` checks the
same; `exists_sized_blocking` only stats it, against the size a page of
the lengths it is given has); anything else (a file cut short at any point, another layout's file,
no file) is a miss, and a put replaces it.

One file a page, as few as a page can have: file creation, not copying
bytes, is what a put costs on a local disk, so header and blobs share one.
The file is written to a temporary name in the same directory
(``.<name>.<tag>.tmp``) and renamed into place (``os.replace``, atomic on
POSIX): a reader sees the whole old file, the whole new one, or none, never
a torn one, so no reader sees a partial page (see `kvtier.storage.base`).
That holds across a crash of the writing process, which leaves at most a
temporary file: nothing reads it, and a bounded store removes it when it is
ten minutes old (`FileStore.clear` removes it at once). With ``fsync=True``
it also holds across a power loss: the file is fsynced before the rename and
its directory after. The page checksum of a sealed store catches damage
inside a file of the right length, as before.

Files of the earlier layout (a ``.data`` file of bare blobs beside a
``.commit`` record) read as misses: their data file has no magic. kvtier
writes a missed page again, which replaces that data file; a bounded store's
count removes the leftover ``.commit`` records, `FileStore.clear` too.
(Reading them as well would cost every miss a second open; a store of the
earlier layout misses once instead.)

All file I/O runs in a worker thread, one thread hop per batch; the event
loop never blocks on the disk (``io_thread=False`` runs it on a loop that
serves the store alone, one hop less). An engine's own thread can skip the
hops: `exists_blocking`, `get_blocking` and `put_blocking` (`BlockingStore`)
and `exists_sized_blocking` (`SizedLookup`) run the same operations where they are called, as `SealedPageStore` does for
SGLang's threads; calls from several threads at once are safe. Several
processes may share a directory.

**A bounded store** (``max_bytes``: bytes, or a size such as ``"200GiB"`` or
``"512MB"``): pages are evicted, least recently used first, so that the
page files (their apparent sizes) stay within the bound.
The directory is cut in 16 shards by the first hex digit of the key (keys
are hashes: the shards fill alike), each allowed a sixteenth of the bound,
with a small ledger file (``.kvtier-usage-<digit>``: its bytes, and when it
was last counted) that every process sharing the directory updates under an
exclusive ``flock`` when it renames a page into place there (the rename is
made under the lock). A put that would take its shard over the bound first
evicts from that shard: it counts the shard's files (one directory scan of a
sixteenth of the store, which also corrects the ledger) and removes its
least recently used pages down to 90% of the shard's bound, so one scan pays
for many puts. A read records a page's use in its file's mtime (``os.utime``
on the open file, to the nanosecond; a put sets it too), which every process
sees. A ledger is also counted again when it is ten minutes old.

Eviction is one unlink a page: a reader that opened the file before reads it
whole, one after misses. A page being written is never evicted: until its
rename it is a temporary file, left alone for ten minutes, and the rename
happens under the shard's lock, so an evictor never removes a page it did
not count (one a put has just replaced). A page over a sixteenth of the
bound cannot be stored: its put raises `StorageError` naming its size and
the bound, before anything is written. How near the bound: a shard's ledger
counts every page when it is renamed into place, and a count finds the
temporary files of puts in flight as well, which those puts add again when
they land (so the ledger runs over, never under, until the next count); the
disk itself holds, beyond the bound, the temporary files of the puts in
flight, about one page per process writing into a shard.
`FileStore.usage` gives the bytes stored (the ledgers' sum) and this
process's evictions.

Without ``max_bytes`` nothing is evicted: the directory grows until the
caller deletes pages (`FileStore.clear` removes them all). Give every
process sharing a bounded directory the same bound.
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import math
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread

from kvtier.storage.base import (
    PageBlobs,
    assemble,
    check_blob_lengths,
    check_keys,
    check_pools,
    commit_record,
    decode_commit,
    encode_commit,
)
from kvtier.errors import ConfigurationError
from kvtier.logs import get_logger
from kvtier.storage.errors import StorageError

__all__ = ["FileStore", "StoreUsage", "parse_size"]

log = get_logger(__name__)

SHARDS = 16
"""A bounded store's shards: keys by their first hex digit, each with a sixteenth of the bound."""
_LEDGER = struct.Struct("<qd")  # a shard's bytes on disk, and when they were last counted (time.time())
_LOW_WATER = 0.9  # an eviction frees its shard down to this fraction of the shard's bound
_RECOUNT_S = 600.0  # a ledger older than this is counted again at the next put into its shard
_ORPHAN_AGE_S = 600.0  # a temporary file (a put in flight, or one that died) is left alone this long
_USAGE_REFRESH_S = 1.0  # how often a lookup or read refreshes `usage` from the ledgers
_MAGIC = b"kvtpage1"  # a page file's first bytes: this layout
_PREFIX = struct.Struct("<8sI")  # the magic, then the length of the record that follows
_HEAD_READ = 4096  # a lookup reads a page file's header in one call of this many bytes (headers are far smaller)
_MAX_RECORD = 1 << 20  # a record longer than this is not one of ours (a damaged length): a miss
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_pid = [os.getpid()]  # this process's id, in temporary names: asked once, not once a put (a fork asks again)
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def parse_size(value: object, what: str = "size") -> int:
    """A number of bytes from an int (``200 << 30``) or a string: a number
    and a unit, ``B``, ``KB``/``MB``/``GB``/``TB`` (powers of 1000),
    ``KiB``/``MiB``/``GiB``/``TiB`` or ``K``/``M``/``G``/``T`` (powers of
    1024), in any case: ``"200GiB"``, ``"512MB"``, ``"1.5 TiB"``.

    Raises `ConfigurationError` naming ``what`` and the value for anything
    else, or a size under one byte."""
    n: float | int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        m = _SIZE.fullmatch(value)
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if m and unit is not None:
            n = float(m.group(1)) * unit if "." in m.group(1) else int(m.group(1)) * unit
    if n is None or not n >= 1 or not math.isfinite(n):
        raise ConfigurationError(
            f"{what} must be a number of bytes >= 1 or a size such as '200GiB' or '512MB' "
            f"(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB); got {value!r}"
        )
    return int(n)


@dataclass(frozen=True, slots=True)
class StoreUsage:
    """What a bounded store holds: ``used_bytes`` on disk as of this store's
    last operation (every process's pages), its bound ``max_bytes``, and the
    pages and bytes this process evicted since it opened the store."""

    used_bytes: int
    max_bytes: int
    evicted_pages: int
    evicted_bytes: int

_T = TypeVar("_T")


class FileStore:
    """A `StorageBackend` over a local directory (created if missing).

    ``fsync``: make published pages survive a power loss (slower puts).
    ``max_bytes``: bound the store (bytes, or a size string: `parse_size`),
    evicting least recently read pages (see the module doc); None (the
    default): never evict.
    ``before_commit``: a fault-injection seam for tests; called with each
    page's key once its temporary file is written, before it is renamed into
    place. If it raises, the put stops there and raises `StorageError`, as
    if the writer had died: that page's temporary file stays on disk, a
    stray, invisible to readers.
    ``io_thread``: True (the default) runs the file I/O in a worker thread,
    so the event loop never waits on the disk; False runs it on the calling
    loop's own thread, one thread round trip less a batch, for a loop that
    serves this store alone and whose callers wait on it anyway (a
    `SealedPageStore`'s: its callers' timeouts still hold, and its calls were
    one at a time all the same).
    The directory is created (with its parents) by the first put. Raises
    `ConfigurationError` when ``directory``, or a parent of it, is a file, and
    for a ``max_bytes`` that is not a size, naming it.
    """

    name = "file"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fsync: bool = False,
        max_bytes: int | str | None = None,
        before_commit: Callable[[bytes], None] | None = None,
        io_thread: bool = True,
    ) -> None:
        self.max_bytes = None if max_bytes is None else parse_size(max_bytes, "FileStore max_bytes")
        self.directory = Path(directory)
        self._root = os.fspath(self.directory)
        _check_directory(self.directory)
        # Temporary names: this store's random tag, the process and a count (no random draw per file).
        self._tmp_tag = secrets.token_hex(4)
        self._tmp_count = itertools.count()
        self.fsync = fsync
        self.before_commit = before_commit
        self.io_thread = io_thread
        self._limiter = anyio.CapacityLimiter(1)
        self._closed = False
        # A bounded store's ledger files, opened at first use. They are used, and closed, only under
        # _ledger_lock: blocking calls may come from several threads (flock does not exclude threads
        # that share a file descriptor, and `aclose` must not close one in use).
        self._ledger_lock = threading.Lock()
        self._ledgers: list[int] = []
        self._shard_used = [0] * SHARDS  # each shard's ledger as last read here
        self._usage_read_at = 0.0
        self.evicted_pages = 0
        self.evicted_bytes = 0

    # -- paths ----------------------------------------------------------------

    def _page_dir(self, key: bytes) -> Path:
        return self.directory / key.hex()[:2]

    def _data_path(self, key: bytes) -> str:
        h = key.hex()
        return f"{self._root}/{h[:2]}/{h}.data"

    # -- protocol -------------------------------------------------------------

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether its page is present (see `StorageBackend.exists`):
        a page file with a well-formed header, as long as the header says."""
        keys = check_keys(keys)
        return await self._run("exists", lambda: self._refreshed([self._exists_one(k) for k in keys]))

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        """For each key, its blobs for ``pools``, or None (see `StorageBackend.get`)."""
        keys, names = check_keys(keys), check_pools(pools)
        return await self._run("get", lambda: self._refreshed([self._get_one(k, names) for k in keys]))

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        """Write every page: a temporary file renamed into place (see the module doc)."""
        pages = list(pages)
        await self._run("put", lambda: self._put_all(pages))

    # -- BlockingStore: the same, on the calling thread (never an event loop's) ------

    def exists_blocking(self, keys: Sequence[bytes]) -> list[bool]:
        """`exists`, run on the calling thread."""
        keys = check_keys(keys)
        return self._call("exists", lambda: self._refreshed([self._exists_one(k) for k in keys]))

    def get_blocking(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        """`get`, run on the calling thread."""
        keys, names = check_keys(keys), check_pools(pools)
        return self._call("get", lambda: self._refreshed([self._get_one(k, names) for k in keys]))

    def put_blocking(self, pages: Sequence[PageBlobs]) -> None:
        """`put`, run on the calling thread."""
        pages = list(pages)
        self._call("put", lambda: self._put_all(pages))

    def exists_sized_blocking(self, keys: Sequence[bytes], lengths: Mapping[str, int]) -> list[bool]:
        """`SizedLookup.exists_sized_blocking`, on the calling thread: for each
        key, whether its page file is as long as header and blobs of ``lengths``
        add up to (one ``stat`` a page; `exists` also reads the header)."""
        keys = check_keys(keys)
        size = _page_file_size(tuple(sorted(check_blob_lengths(lengths).items())))
        return self._call("exists", lambda: self._refreshed([self._sized_one(k, size) for k in keys]))

    async def clear(self) -> int:
        """Remove every page file in the directory (and stray temporary files,
        and an earlier layout's commit records); how many page files there
        were. Each goes in one unlink, so a reader meanwhile sees a miss or a
        whole page. Files that are not a store's (other names) are left alone."""
        return await self._run("clear", self._clear_all)

    def usage(self) -> StoreUsage | None:
        """A bounded store's bytes on disk (as of its last operation) and this
        process's evictions; None for an unbounded store. No I/O: safe from
        any thread, the event loop's included."""
        if self.max_bytes is None:
            return None
        return StoreUsage(sum(self._shard_used), self.max_bytes, self.evicted_pages, self.evicted_bytes)

    async def aclose(self) -> None:
        self._closed = True
        if self._ledgers:
            def close() -> None:
                with self._ledger_lock:  # after the calls using them
                    ledgers, self._ledgers = self._ledgers, []
                    for fd in ledgers:
                        os.close(fd)

            await anyio.to_thread.run_sync(close, limiter=self._limiter)  # after the call in flight, if any

    async def __aenter__(self) -> FileStore:
        """Make the page directories now (one for each first byte of a key, 256),
        so that no put pays for one; a put still makes one that is missing
        (`clear` removes them)."""
        await self._run("open", self._make_page_dirs)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        bound = "" if self.max_bytes is None else f", {sum(self._shard_used)}/{self.max_bytes} bytes"
        return f"<FileStore {str(self.directory)!r} [fsync={self.fsync}{bound}]>"

    # -- worker-thread side ---------------------------------------------------

    async def _run(self, operation: str, fn: Callable[[], _T]) -> _T:
        if self._closed:
            raise StorageError("file store is closed", backend=self.name, operation=operation)
        if not self.io_thread:
            return self._call(operation, fn)  # the loop serves this store alone (see io_thread)
        return await anyio.to_thread.run_sync(self._call, operation, fn, limiter=self._limiter)

    def _call(self, operation: str, fn: Callable[[], _T]) -> _T:
        """``fn()`` where it is called, its OS errors as `StorageError`."""
        if self._closed:
            raise StorageError("file store is closed", backend=self.name, operation=operation)
        try:
            return fn()
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(
                f"file store {str(self.directory)!r} could not {_DOING[operation]}: {exc}",
                backend=self.name, operation=operation,
            ) from exc

    # The worker side calls the OS directly (os.open / os.pread / os.writev), not
    # Python's buffered files: those add an fstat, an ioctl and an lseek to every
    # open. A lookup is an open, a read of the header, an fstat and a close.

    def _make_page_dirs(self) -> None:
        try:
            for first in range(256):
                os.makedirs(f"{self._root}/{first:02x}", exist_ok=True)
        except OSError:
            pass  # a read-only directory (an engine that only reads) is still a store; a put says what failed

    def _read_header(self, fd: int) -> tuple[dict[str, int], int, bytes | None] | None:
        """(An open page file) its blob lengths, where its blobs start and, for a
        file shorter than the first read, the whole file; None unless its
        header is whole and the file as long as it says."""
        head = os.pread(fd, _HEAD_READ, 0)
        if len(head) < _PREFIX.size:
            return None
        magic, length = _PREFIX.unpack_from(head)
        end = _PREFIX.size + length
        if magic != _MAGIC or length > _MAX_RECORD:
            return None  # not a page file of this layout (an earlier version's data file, say)
        # A read that stopped short of _HEAD_READ met the end of the file: the file is in
        # hand and its size known (a small page, as V4's anchor pages are: no fstat, no second read).
        whole = head if len(head) < _HEAD_READ else None
        if end > len(head):  # a record longer than the first read (many pools): read it whole
            head = os.pread(fd, end, 0)
            if len(head) < end:
                return None
        record = decode_commit(head[_PREFIX.size:end])
        # One file holds header and blobs: it is whole when its size is theirs added up.
        if record is None:
            return None
        size = len(whole) if whole is not None else os.fstat(fd).st_size
        if size != end + sum(record.values()):
            return None
        return record, end, whole

    def _open(self, key: bytes) -> int | None:
        try:
            return os.open(self._data_path(key), os.O_RDONLY | _CLOEXEC)
        except FileNotFoundError:
            return None

    def _exists_one(self, key: bytes) -> bool:
        fd = self._open(key)
        if fd is None:
            return False
        try:
            return self._read_header(fd) is not None
        finally:
            os.close(fd)

    def _sized_one(self, key: bytes, size: int) -> bool:
        try:
            return os.stat(self._data_path(key)).st_size == size
        except FileNotFoundError:
            return False

    def _get_one(self, key: bytes, pools: list[str]) -> dict[str, bytes] | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            header = self._read_header(fd)
            if header is None:
                return None
            commit, offset, whole = header
            if any(name not in commit for name in pools):
                return None
            wanted = set(pools)
            blobs: dict[str, bytes | None] = {}
            for name in sorted(commit):
                if name in wanted:
                    n = commit[name]
                    # A short read is a miss (assemble).
                    blobs[name] = os.pread(fd, n, offset) if whole is None else whole[offset:offset + n]
                offset += commit[name]
            page = assemble(commit, blobs, pools)
            if page is not None and self.max_bytes is not None:
                # Its last use, for eviction (every process sees it), on the open file: one
                # evicted meanwhile is read whole all the same, and its stamp goes with it.
                now = time.time_ns()
                os.utime(fd, ns=(now, now))
        finally:
            os.close(fd)
        return page

    def _put_all(self, pages: list[PageBlobs]) -> None:
        headers = [page_header(page) for page in pages]
        if self.max_bytes is not None:
            bound = self.max_bytes // SHARDS
            for page, header in zip(pages, headers):
                if page.nbytes + len(header) > bound:
                    raise StorageError(
                        f"page {page.key.hex()} is {page.nbytes + len(header)} bytes on disk (its blobs and "
                        f"header); a FileStore of max_bytes={self.max_bytes} keeps pages up to a sixteenth of that "
                        f"({bound} bytes): nothing of the batch was written",
                        backend=self.name, operation="put",
                    )
        if self.max_bytes is None:
            for page, header in zip(pages, headers):
                self._put_one(page, header)
            return
        with self._ledger_lock:
            try:
                for page, header in zip(pages, headers):
                    self._put_one(page, header)
            finally:
                try:
                    self._read_usage()
                except OSError:
                    pass  # a gauge: the put's own outcome is what the caller needs

    def _put_one(self, page: PageBlobs, header: bytes) -> None:
        path = self._data_path(page.key)
        tmp = self._write_temp(path, header, *(page.blobs[name] for name in sorted(page.blobs)))
        leave = False  # the temporary file stays only where a writer "died" (before_commit)
        try:
            if self.before_commit is not None:
                try:
                    self.before_commit(page.key)
                except Exception as exc:
                    leave = True  # like a writer that died here: its temporary file stays, a stray (module doc)
                    raise StorageError(
                        f"file store put stopped before the commit of page {page.key.hex()}: {exc}",
                        backend=self.name, operation="put",
                    ) from exc
            if self.max_bytes is None:
                os.replace(tmp, path)
            else:
                # Counted and renamed into place under the shard's lock: an evictor
                # never counts on that room, nor unlinks the page it just replaced.
                self._reserve(int(page.key.hex()[0], 16), page.nbytes + len(header), tmp, path)
        except BaseException:
            if not leave:
                _discard(tmp)
            raise
        if self.fsync:
            _fsync_dir(self._page_dir(page.key))

    # -- a bounded store's ledgers and eviction (worker thread) ----------------------

    def _ledger(self, shard: int) -> int:
        """(Under _ledger_lock) ``shard``'s ledger file, the ledgers opened at first use."""
        if self._closed:  # a call that began before `aclose`: never open the ledgers again
            raise StorageError("file store is closed", backend=self.name, operation="ledger")
        if not self._ledgers:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._ledgers = [os.open(self.directory / f".kvtier-usage-{h:x}", os.O_RDWR | os.O_CREAT, 0o644)
                             for h in range(SHARDS)]
        return self._ledgers[shard]

    def _reserve(self, shard: int, size: int, tmp: str, path: str) -> None:
        """Under ``shard``'s lock: evict from the shard first when ``size``
        more bytes would pass its bound, rename ``tmp`` into place at ``path``
        and add ``size`` to the shard's ledger."""
        assert self.max_bytes is not None
        fd = self._ledger(shard)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            raw = os.pread(fd, _LEDGER.size, 0)
            used, counted_at = _LEDGER.unpack(raw) if len(raw) == _LEDGER.size else (0, 0.0)
            if used + size > self.max_bytes // SHARDS or time.time() - counted_at > _RECOUNT_S:
                used, counted_at = self._count_and_evict(shard, size, os.path.basename(tmp)), time.time()
            os.replace(tmp, path)
            used += size
            os.pwrite(fd, _LEDGER.pack(used, counted_at), 0)
            self._shard_used[shard] = used
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _count_and_evict(self, shard: int, incoming: int, own: str) -> int:
        """(Under ``shard``'s lock) its bytes on disk, counted from its files
        (but ``own``, the temporary file of the put that counts), after
        evicting its least recently used pages down to `_LOW_WATER` of its
        bound when ``incoming`` more would pass the bound."""
        assert self.max_bytes is not None
        bound = self.max_bytes // SHARDS
        pages: list[tuple[int, str, int]] = []  # (mtime_ns, path, size) of each page file
        stray: list[tuple[str, int, int]] = []  # temporary files
        total = 0
        for sub in range(SHARDS):
            try:
                entries = list(os.scandir(f"{self._root}/{shard:x}{sub:x}"))
            except FileNotFoundError:
                continue
            for entry in entries:
                name = entry.name
                if name == own:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # evicted or renamed meanwhile
                if name.endswith(".data"):
                    pages.append((st.st_mtime_ns, entry.path, st.st_size))
                elif name.endswith(".commit"):
                    _discard(entry.path)  # an earlier layout's record: nothing reads it (module doc)
                    continue
                elif name.startswith(".") and name.endswith(".tmp"):
                    stray.append((entry.path, st.st_mtime_ns, st.st_size))
                else:
                    continue  # not a store's file
                total += st.st_size
        old = time.time_ns() - int(_ORPHAN_AGE_S * 1e9)
        for path, mtime, size in stray:
            if mtime < old:  # a put that died before its rename
                total -= _unlink(Path(path), size)
        low = int(bound * _LOW_WATER)
        if total + incoming <= bound:
            return total
        evicted = evicted_bytes = 0
        for mtime, path, size in sorted(pages):  # oldest use first
            if total + incoming <= low:
                break
            freed = _unlink(Path(path), size)  # one unlink: a reader that opened it first reads it whole
            total -= freed
            evicted += 1
            evicted_bytes += freed
        self.evicted_pages += evicted
        self.evicted_bytes += evicted_bytes
        log.info("file_store.evicted", directory=str(self.directory), shard=f"{shard:x}", pages=evicted,
                 bytes=evicted_bytes, shard_bytes=total, shard_bound=bound)
        return max(0, total)

    def _read_usage(self) -> None:
        """(Under _ledger_lock) every shard's ledger, as `usage` reports them (no flock: a gauge)."""
        if not self._ledgers and not (self.directory / ".kvtier-usage-0").exists():
            return
        for shard in range(SHARDS):
            raw = os.pread(self._ledger(shard), _LEDGER.size, 0)
            if len(raw) == _LEDGER.size:
                self._shard_used[shard] = _LEDGER.unpack(raw)[0]
        self._usage_read_at = time.monotonic()

    def _refreshed(self, result: _T) -> _T:
        """``result``, after refreshing `usage` if that is older than a second (a bounded store's lookups and reads)."""
        if self.max_bytes is not None and time.monotonic() - self._usage_read_at > _USAGE_REFRESH_S:
            with self._ledger_lock:
                self._read_usage()
        return result

    def _clear_all(self) -> int:
        if not self.directory.is_dir():
            return 0
        subdirs = [d for d in self.directory.iterdir() if d.is_dir() and len(d.name) == 2]
        pages = 0
        for d in subdirs:
            for f in d.glob("*.data"):
                pages += _unlink(f, 1)
            for pattern in ("*.commit", ".*.tmp"):  # an earlier layout's records; strays
                for f in d.glob(pattern):
                    f.unlink(missing_ok=True)
            try:
                d.rmdir()
            except OSError:
                pass  # not empty: someone else's files, or a page put meanwhile
        if self.max_bytes is not None:
            with self._ledger_lock:
                for shard in range(SHARDS):  # counted again at the next put into each shard
                    fd = self._ledger(shard)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    try:
                        os.pwrite(fd, _LEDGER.pack(0, 0.0), 0)
                    finally:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                    self._shard_used[shard] = 0
        return pages

    def _write_temp(self, path: str, *parts: bytes | bytearray | memoryview) -> str:
        """Write ``parts`` to a new temporary file beside ``path``; its name.
        A bounded store stamps it with the time, to the nanosecond: its first
        use (the kernel stamps files with a clock of its ticks, which would tie
        the pages of a burst); the rename keeps it."""
        directory, name = os.path.split(path)
        tmp = f"{directory}/.{name}.{self._tmp_tag}{_pid[0]:x}-{next(self._tmp_count):x}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileNotFoundError:  # the page's directory is not there yet (or a clear removed it)
            os.makedirs(directory, exist_ok=True)
            fd = os.open(tmp, flags, 0o666)
        try:
            try:
                views = [memoryview(part).cast("B") for part in parts]
                left = sum(v.nbytes for v in views)
                while left:  # one call unless the kernel writes less
                    done = os.writev(fd, views)
                    left -= done
                    while done:
                        n = min(done, views[0].nbytes)
                        views[0], done = views[0][n:], done - n
                        if not views[0].nbytes:
                            views.pop(0)
                    views = [v for v in views if v.nbytes]
                if self.max_bytes is not None:
                    now = time.time_ns()
                    os.utime(fd, ns=(now, now))
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            _discard(tmp)
            raise
        return tmp


def page_header(page: PageBlobs) -> bytes:
    """A page file's header: the magic, the record's length and the record
    (`encode_commit`: the format version and each blob's length)."""
    record = encode_commit(page)
    return _PREFIX.pack(_MAGIC, len(record)) + record


@functools.lru_cache(maxsize=256)
def _page_file_size(lengths: tuple[tuple[str, int], ...]) -> int:
    """How long the page file of a page whose blobs have ``lengths`` is: its
    header (`page_header`) and its blobs. Remembered: a pool's pages share one."""
    return _PREFIX.size + len(commit_record(dict(lengths))) + sum(n for _, n in lengths)


def _discard(path: str) -> None:
    """Remove ``path`` if it is there (a temporary file, a stray record)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink(path: Path, size: int) -> int:
    """Remove ``path``; ``size`` if it was there, else 0 (another process removed it)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return size


# What each operation does, for "file store ... could not <it>".
_DOING = {
    "open": "make its page directories", "exists": "look pages up", "get": "read pages", "put": "write pages",
    "clear": "clear its pages",
}


def _check_directory(directory: Path) -> None:
    """`ConfigurationError` naming ``directory`` when it or its nearest existing
    parent is not a directory. A stat or two, once, where the store is made
    (tests/conftest.py allows them on an event loop)."""
    for path in (directory, *directory.parents):
        try:
            mode = os.stat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet (or below a file: its parent says)
        except OSError:
            return  # unreadable: the first operation says why
        if stat.S_ISDIR(mode):
            return
        where = "is a file" if path == directory else f"cannot be created: {str(path)!r} is a file"
        raise ConfigurationError(
            f"FileStore directory {str(directory)!r} {where}, not a directory; give a directory, or a path "
            f"to create one at"
        )


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
