"""The storage protocol: batched, async, per-page results, no partial pages.

A stored page is one page of an anchor pool with the rows its sidecars derive
from it: one *blob* per pool with bytes (see `kvtier.storage.pages`), under one
page key (see `kvtier.storage.keys`). A backend stores it as

1. one object per blob, then
2. a *commit record* last, which names each blob and its length.

Readers consult the commit record only: `StorageBackend.exists` is true and
`StorageBackend.get` returns the blobs only for a page whose commit record is
stored, and `get` also checks that every blob it returns is present with the
length the record names (a blob evicted or deleted on its own reads as a miss,
never as a short page). So a page is visible whole or not at all, whatever
failed in between: a crash, a dropped connection, a timeout, a cancellation.
Blobs whose commit never landed are unreachable garbage; putting the page
again overwrites them.

Keys are content addresses (the chained hash of the prefix in a namespace), so
two writers of one key write the same page: puts are idempotent and need no lock.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvtier.storage.errors import StorageError

__all__ = [
    "Buffer",
    "PageBlobs",
    "StorageBackend",
    # For backend implementations:
    "assemble",
    "check_key",
    "check_keys",
    "check_pools",
    "decode_commit",
    "encode_commit",
]

Buffer = bytes | bytearray | memoryview

_COMMIT_VERSION = 1
MAX_KEY_BYTES = 256


@dataclass(frozen=True, slots=True)
class PageBlobs:
    """One page to store: its key and one blob per pool (pool name -> bytes).

    Raises `ValueError` for a key that is not 1..256 bytes, no blobs, or a pool
    name that is not a non-empty string.
    """

    key: bytes
    blobs: Mapping[str, Buffer]

    def __post_init__(self) -> None:
        check_key(self.key)
        if not self.blobs:
            raise ValueError(f"page {self.key.hex()} has no blobs; a stored page needs at least one pool")
        for name in self.blobs:
            if not isinstance(name, str) or not name:
                raise ValueError(f"page {self.key.hex()}: pool names are non-empty strings; got {name!r}")

    @property
    def nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.blobs.values())


@runtime_checkable
class StorageBackend(Protocol):
    """A store of whole pages by key. Every method takes a batch and answers per page.

    Implementations: `FileStore`, `RedisStore`. Errors are `StorageError`, and
    `StorageTimeout` when a deadline passed; the cause is chained.
    """

    name: str
    """A short label for logs and error messages, e.g. ``"redis"``."""

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether its page is stored whole (its commit record is)."""
        ...

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        """For each key, the page's blob for every pool in ``pools``, or None.

        None when the page is not stored, or its commit record does not name
        one of ``pools``, or a blob is missing or not the length its commit
        record names. Never a partial page.
        """
        ...

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        """Store every page: its blobs first, its commit record last.

        On success every page is visible. On failure raises `StorageError`;
        the pages of the batch that were committed are whole, the rest invisible.
        """
        ...

    async def aclose(self) -> None:
        """Release connections or threads; the store is unusable afterwards."""
        ...


def check_key(key: object) -> bytes:
    """``key`` if it is a valid page key; `ValueError` naming it otherwise."""
    if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"page keys are 1..{MAX_KEY_BYTES} bytes; got {key!r:.80}")
    return key


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """The keys as a list, each checked by `check_key`."""
    return [check_key(k) for k in keys]


def check_pools(pools: Collection[str]) -> list[str]:
    """The pool names as a list: at least one, each a non-empty string."""
    names = list(pools)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"get needs at least one pool name (non-empty strings); got {names!r}")
    return names


def encode_commit(page: PageBlobs) -> bytes:
    """The commit record of ``page``: the format version and each blob's length."""
    record = {"v": _COMMIT_VERSION, "blobs": {name: memoryview(b).nbytes for name, b in sorted(page.blobs.items())}}
    return json.dumps(record, separators=(",", ":")).encode()


def decode_commit(data: bytes, *, backend: str, key: bytes) -> dict[str, int]:
    """Blob lengths by pool from a commit record; `StorageError` if malformed."""
    try:
        record = json.loads(data)
        blobs = record["blobs"]
        if record.get("v") != _COMMIT_VERSION or not isinstance(blobs, dict):
            raise ValueError(record.get("v"))
        return {str(k): int(v) for k, v in blobs.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise StorageError(
            f"{backend}: commit record of page {key.hex()} is malformed: {data[:80]!r}",
            backend=backend, operation="get",
        ) from exc


def assemble(
    commit: dict[str, int] | None, blobs: Mapping[str, bytes | None], pools: Sequence[str]
) -> dict[str, bytes] | None:
    """The page a reader may see: every requested blob present with its committed length, else None."""
    if commit is None:
        return None
    out: dict[str, bytes] = {}
    for name in pools:
        data = blobs.get(name)
        if data is None or name not in commit or len(data) != commit[name]:
            return None
        out[name] = data
    return out
