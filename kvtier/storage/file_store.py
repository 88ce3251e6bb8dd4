"""`FileStore`: pages in a directory on local disk, the embedded default.

Layout under ``directory``::

    ab/abcdef...0123.commit   the commit record (JSON: blob lengths by pool)
    ab/abcdef...0123.data     the page's blobs, one after the other, in the
                              order of their pool names (sorted)

A page is present when its commit record is well-formed and its data file is
as long as the record's blob lengths add up to (`exists` reads the record
and stats the data file; `get` checks the same); a malformed record, a
missing or truncated data file is a miss. A put replaces both files.

Two files per page, as few as a page with a separate commit can have: file
creation, not copying bytes, is what a put costs on a local disk (measured
0.26-0.5 ms per file against 0.14 ms to write 1 MiB), so the blobs share one.
Every file is written to a temporary name in the same directory and renamed
into place (``os.replace``, atomic on POSIX), so no reader ever sees a torn
file; a page's data file is renamed into place before its commit record, and
readers consult the commit record (and check the data file's length against
it), so no reader sees a partial page either (see `kvtier.storage.base`). That holds across a crash of the writing
process. With ``fsync=True`` it also holds across a power loss: blobs are
fsynced (and their directory) before the commit record is written.

All file I/O runs in a worker thread, one thread hop per batch; the event
loop never blocks on the disk. Several processes may share a directory.
Nothing is evicted: the directory grows until the caller deletes pages
(`FileStore.clear` removes them all).
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread

from kvtier.storage.base import (
    PageBlobs,
    assemble,
    check_keys,
    check_pools,
    decode_commit,
    encode_commit,
)
from kvtier.errors import ConfigurationError
from kvtier.storage.errors import StorageError

__all__ = ["FileStore"]

_T = TypeVar("_T")


class FileStore:
    """A `StorageBackend` over a local directory (created if missing).

    ``fsync``: make published pages survive a power loss (slower puts).
    ``before_commit``: a fault-injection seam for tests; called with each
    page's key after its blobs are in place and before its commit record is
    written. If it raises, the put stops there and raises `StorageError`
    (that page's blobs stay on disk, uncommitted and invisible).
    The directory is created (with its parents) by the first put. Raises
    `ConfigurationError` when ``directory``, or a parent of it, is a file.
    """

    name = "file"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fsync: bool = False,
        before_commit: Callable[[bytes], None] | None = None,
    ) -> None:
        self.directory = Path(directory)
        _check_directory(self.directory)
        self.fsync = fsync
        self.before_commit = before_commit
        self._limiter = anyio.CapacityLimiter(1)
        self._closed = False

    # -- paths ----------------------------------------------------------------

    def _page_dir(self, key: bytes) -> Path:
        return self.directory / key.hex()[:2]

    def _commit_path(self, key: bytes) -> Path:
        return self._page_dir(key) / f"{key.hex()}.commit"

    def _data_path(self, key: bytes) -> Path:
        return self._page_dir(key) / f"{key.hex()}.data"

    # -- protocol -------------------------------------------------------------

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether its page is present (see `StorageBackend.exists`):
        a well-formed commit record, and a data file of the length it records."""
        keys = check_keys(keys)
        return await self._run("exists", lambda: [self._exists_one(k) for k in keys])

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        """For each key, its blobs for ``pools``, or None (see `StorageBackend.get`)."""
        keys, names = check_keys(keys), check_pools(pools)
        return await self._run("get", lambda: [self._get_one(k, names) for k in keys])

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        """Write every page: blobs first, then its commit record (see the module doc)."""
        pages = list(pages)
        await self._run("put", lambda: self._put_all(pages))

    async def clear(self) -> int:
        """Remove every page in the directory (and stray temporary files); how
        many pages had a commit record. Commit records go first, so a reader
        meanwhile sees a miss, never a partial page. Files that are not a
        store's (other names) are left alone."""
        return await self._run("clear", self._clear_all)

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> FileStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<FileStore {str(self.directory)!r} [fsync={self.fsync}]>"

    # -- worker-thread side ---------------------------------------------------

    async def _run(self, operation: str, fn: Callable[[], _T]) -> _T:
        if self._closed:
            raise StorageError("file store is closed", backend=self.name, operation=operation)
        try:
            return await anyio.to_thread.run_sync(fn, limiter=self._limiter)
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(
                f"file store {str(self.directory)!r} could not {_DOING[operation]}: {exc}",
                backend=self.name, operation=operation,
            ) from exc

    def _read_commit(self, key: bytes) -> dict[str, int] | None:
        """The page's blob lengths from its commit record; None if missing or malformed."""
        try:
            return decode_commit(self._commit_path(key).read_bytes())
        except FileNotFoundError:
            return None

    def _exists_one(self, key: bytes) -> bool:
        commit = self._read_commit(key)
        if commit is None:
            return False
        try:
            size = self._data_path(key).stat().st_size
        except FileNotFoundError:
            return False
        # One data file holds every blob: it is whole when its size is theirs added up.
        return size == sum(commit.values())

    def _get_one(self, key: bytes, pools: list[str]) -> dict[str, bytes] | None:
        commit = self._read_commit(key)
        if commit is None or any(name not in commit for name in pools):
            return None
        wanted = set(pools)
        blobs: dict[str, bytes | None] = {}
        try:
            with open(self._data_path(key), "rb") as f:
                if os.fstat(f.fileno()).st_size != sum(commit.values()):
                    return None  # truncated or replaced on its own: never a short page
                for name in sorted(commit):
                    if name in wanted:
                        blobs[name] = f.read(commit[name])
                    else:
                        f.seek(commit[name], os.SEEK_CUR)
        except FileNotFoundError:
            return None
        return assemble(commit, blobs, pools)

    def _put_all(self, pages: list[PageBlobs]) -> None:
        for page in pages:
            directory = self._page_dir(page.key)
            directory.mkdir(parents=True, exist_ok=True)
            self._write_atomic(self._data_path(page.key), *(page.blobs[name] for name in sorted(page.blobs)))
            if self.fsync:
                _fsync_dir(directory)
            if self.before_commit is not None:
                try:
                    self.before_commit(page.key)
                except Exception as exc:
                    raise StorageError(
                        f"file store put stopped before the commit of page {page.key.hex()}: {exc}",
                        backend=self.name, operation="put",
                    ) from exc
            self._write_atomic(self._commit_path(page.key), encode_commit(page))
            if self.fsync:
                _fsync_dir(directory)

    def _clear_all(self) -> int:
        if not self.directory.is_dir():
            return 0
        subdirs = [d for d in self.directory.iterdir() if d.is_dir() and len(d.name) == 2]
        pages = 0
        for suffix in (".commit", ".data"):
            for d in subdirs:
                for f in d.glob(f"*{suffix}"):
                    f.unlink(missing_ok=True)
                    pages += suffix == ".commit"
        for d in subdirs:
            for f in d.glob(".*.tmp"):
                f.unlink(missing_ok=True)
            try:
                d.rmdir()
            except OSError:
                pass  # not empty: someone else's files, or a page put meanwhile
        return pages

    def _write_atomic(self, path: Path, *parts: bytes | bytearray | memoryview) -> None:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.writelines(parts)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


# What each operation does, for "file store ... could not <it>".
_DOING = {"exists": "look pages up", "get": "read pages", "put": "write pages", "clear": "clear its pages"}


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
