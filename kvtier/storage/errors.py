"""The errors the storage tier raises.

A backend translates its client's exceptions at one boundary: a deadline that
passed is a `StorageTimeout`, every other failure of the store (refused or
dropped connection, I/O error, an error reply, a malformed record) is a
`StorageError`, with the client's exception chained as ``__cause__``.
"""

from __future__ import annotations

from kvtier.errors import KvtierError

__all__ = ["StorageError", "StorageTimeout"]


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
