"""The errors the storage tier raises.

A backend translates its client's exceptions at one boundary: a deadline that
passed is a `StorageTimeout`, every other failure of the store (refused or
dropped connection, I/O error, an error reply) is a `StorageError`, with the
client's exception chained as ``__cause__``. A malformed commit record is not
an error: the page reads as a miss (see `kvtier.storage.base`).

A stored page whose bytes do not pass `kvtier.storage.decode_page`'s checks (a
blob of another format or pool, of the wrong length, or whose checksum does not
match: bytes changed in the store) raises `PageCorrupted`, and nothing of it
was written.
"""

from __future__ import annotations

from kvtier.errors import KvtierError

__all__ = ["PageCorrupted", "StorageError", "StorageTimeout"]


class StorageError(KvtierError):
    """A storage backend failed: ``backend`` names it and ``operation`` says
    what it was doing (``"exists"``, ``"get"``, ``"put"``, ...).

    After a failed ``put`` some pages of the batch may have been published,
    each of them whole; the others are not visible. ``exists`` tells which.
    """

    def __init__(self, message: str, *, backend: str = "", operation: str = "") -> None:
        super().__init__(message)
        self.backend = backend
        self.operation = operation


class StorageTimeout(StorageError):
    """A storage backend did not answer within ``timeout_s`` seconds."""

    def __init__(self, message: str, *, backend: str = "", operation: str = "", timeout_s: float | None = None) -> None:
        super().__init__(message, backend=backend, operation=operation)
        self.timeout_s = timeout_s


class PageCorrupted(StorageError):
    """A stored page failed `decode_page`'s checks; no row of it was written.

    ``pool`` names the pool whose blob broke the rule (the anchor for a page
    whose set of blobs is wrong), ``rule`` which rule: ``"pools"`` (a blob
    missing or extra), ``"header"`` (no kvtier blob header: another format,
    or one written before blobs carried checksums), ``"version"`` (a blob
    format this kvtier does not read), ``"pool"`` (the blob holds another
    pool's rows), ``"key"`` (the blob was written under another page key:
    copied under this key, or spliced in from another page), ``"length"`` or
    ``"checksum"`` (the bytes changed in the store). ``anchor`` and ``page``
    name the page being decoded (its anchor pool and host page), ``key`` its
    storage key.
    ``operation`` is ``"decode"``.

    A page that raises this is unusable as stored; writing it again (a put of
    the same key) replaces it.
    """

    def __init__(
        self, message: str, *, pool: str, rule: str, anchor: str, page: int, key: bytes | None = None
    ) -> None:
        super().__init__(message, operation="decode")
        self.pool = pool
        self.rule = rule
        self.anchor = anchor
        self.page = page
        self.key = key
