"""The storage protocol: batched, async, per-page results, no partial pages.

A stored page is one page of an anchor pool with the rows its sidecars derive
from it: one *blob* per pool with bytes (see `kvtier.storage.pages`), under one
page key (see `kvtier.storage.keys`). A backend stores it as

1. one object per blob, then
2. a *commit record* last, which names each blob and its length.

A page is *present* only when its commit record is stored and well-formed (a
record this format reads: `decode_commit`) and every blob it names is stored
with the length it names. `StorageBackend.exists` is true and
`StorageBackend.get` returns the blobs only for a present page, so a blob
evicted, deleted or truncated on its own, or a malformed or foreign commit
record, reads as a miss for that page (never as a short page, never as an
error that fails the batch). So a page is visible whole or not at all,
whatever failed in between: a crash, a dropped connection, a timeout, a
cancellation. Blobs whose commit never landed are unreachable garbage.

A blob of 0 bytes (SGLang's DeepSeek V4 anchor pages hold none) is whole by
its commit record alone: `assemble` gives it as ``b""`` and `is_present`
takes it as there whatever the store holds under its name, so a backend
need not store it (Mooncake cannot: it refuses empty objects) and a store
that answers a missing key like an empty one (Redis ``STRLEN``, Mooncake's
``get_batch``) cannot make ``exists`` and ``get`` disagree about it.

Bytes changed in place (same length) cannot be seen without reading them:
each blob carries a checksum that `kvtier.storage.decode_page` checks, raising
`PageCorrupted`. A `put` always overwrites what is stored under its keys
(blobs first, commit record last), so putting a page again repairs it.

Keys are content addresses (the chained hash of the prefix in a namespace), so
two writers of one key write the same page: puts are idempotent and need no lock.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvtier.errors import ConfigurationError
from kvtier.storage.errors import StorageError

__all__ = [
    "BlockingStore",
    "Buffer",
    "PageBlobs",
    "SizedLookup",
    "StorageBackend",
    # For backend implementations:
    "assemble",
    "check_blob_lengths",
    "check_key",
    "check_keys",
    "check_pools",
    "check_value_sizes",
    "commit_record",
    "decode_commit",
    "encode_commit",
    "is_present",
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
            raise ConfigurationError(f"page {self.key.hex()} has no blobs; a stored page needs at least one pool")
        for name in self.blobs:
            if not isinstance(name, str) or not name:
                raise ConfigurationError(f"page {self.key.hex()}: pool names are non-empty strings; got {name!r}")

    @property
    def nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.blobs.values())


@runtime_checkable
class StorageBackend(Protocol):
    """A store of whole pages by key. Every method takes a batch and answers per page.

    Implementations: `FileStore`, `RedisStore`, `MooncakeStore` (and
    `kvtier.testing.MemoryStore`). Errors are `StorageError`, and
    `StorageTimeout` when a deadline passed; the cause is chained. A page
    that is damaged in the store is a miss, not an error (see the module doc).
    """

    name: str
    """A short label for logs and error messages, e.g. ``"redis"``."""

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether its page is present: its commit record is
        well-formed and every blob it names is stored with the length it names."""
        ...

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        """For each key, the page's blob for every pool in ``pools``, or None.

        None when the page is not stored, or its commit record is malformed
        or does not name one of ``pools``, or a blob is missing or not the
        length its commit record names. Never a partial page. The bytes are
        returned as stored: `decode_page` checks their checksums.
        """
        ...

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        """Store every page: its blobs first, its commit record last,
        replacing whatever was stored under its key (so a put repairs a page
        that is damaged in the store).

        On success every page is visible. On failure raises `StorageError`;
        the pages of the batch that were committed are whole, the rest invisible.
        """
        ...

    async def aclose(self) -> None:
        """Release connections or threads; the store is unusable afterwards."""
        ...


@runtime_checkable
class BlockingStore(Protocol):
    """A store that can also answer on the caller's own thread, as plain blocking calls.

    For a caller that is a thread of its own, not an event loop (an engine's
    storage thread, through `kvtier.storage.SealedPageStore`): the same
    operations and answers as `StorageBackend`'s, with the same errors, run
    where they are called, so no thread hop is paid a batch. Implemented by
    `FileStore` (a local disk answers in microseconds; a hop to another thread
    and back costs more than a page's lookup). Calls may come from several
    threads at once. Never call these from an event loop: they block it.
    """

    def exists_blocking(self, keys: Sequence[bytes]) -> list[bool]:
        """`StorageBackend.exists`, on the calling thread."""
        ...

    def get_blocking(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        """`StorageBackend.get`, on the calling thread."""
        ...

    def put_blocking(self, pages: Sequence[PageBlobs]) -> None:
        """`StorageBackend.put`, on the calling thread."""
        ...


@runtime_checkable
class SizedLookup(Protocol):
    """A `BlockingStore` that can also look a page up by its size alone: one
    metadata call a page and no read (`FileStore`: one ``stat``), where
    `BlockingStore.exists_blocking` reads the page's commit record.

    For a caller that knows how long a whole page's blobs are (an engine's
    page bytes, sealed: `kvtier.storage.SealedPageStore`) and reads every page
    it finds anyway, checking it then: a lookup only decides how much to ask
    for, and the read decides what lands.
    """

    def exists_sized_blocking(self, keys: Sequence[bytes], lengths: Mapping[str, int]) -> list[bool]:
        """For each key, whether a page is stored that takes the room a page whose
        blobs have ``lengths`` (pool -> bytes) takes, on the calling thread.

        Weaker than ``exists``: a page of that size whose commit record or
        bytes are damaged is found (its read is a miss: ``get`` checks the
        record, `kvtier.storage.decode_page` or the seal the bytes); a page
        stored whole with other lengths is not. Raises `ConfigurationError`
        for ``lengths`` that are not a non-empty mapping of pool names to
        integers >= 0, and errors as ``exists`` does."""
        ...


def check_key(key: object) -> bytes:
    """``key`` if it is a valid page key; `ValueError` naming it otherwise."""
    if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ConfigurationError(f"page keys are 1..{MAX_KEY_BYTES} bytes; got {key!r:.80}")
    return key


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """The keys as a list, each checked by `check_key`."""
    return [check_key(k) for k in keys]


def check_pools(pools: Collection[str]) -> list[str]:
    """The pool names as a list: at least one, each a non-empty string."""
    names = list(pools)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigurationError(f"get needs at least one pool name (non-empty strings); got {names!r}")
    return names


def check_value_sizes(pages: Sequence[PageBlobs], bound: int, backend: str, setting: str) -> None:
    """`StorageError` naming the first blob of ``pages`` over ``bound`` bytes
    (the largest value ``backend`` takes, set by its ``setting``), its size and the bound."""
    for page in pages:
        for name, data in page.blobs.items():
            n = memoryview(data).nbytes
            if n > bound:
                raise StorageError(
                    f"the blob of pool {name!r} of page {page.key.hex()} is {n} bytes; this {backend} store takes "
                    f"values up to {setting}={bound}: nothing of the batch was sent",
                    backend=backend, operation="put",
                )


def encode_commit(page: PageBlobs) -> bytes:
    """The commit record of ``page``: the format version and each blob's length."""
    return commit_record({name: memoryview(b).nbytes for name, b in page.blobs.items()})


def commit_record(lengths: Mapping[str, int]) -> bytes:
    """The commit record of a page whose blobs have ``lengths`` (pool -> bytes),
    as `encode_commit` writes it (so its length is known before the page is)."""
    record = {"v": _COMMIT_VERSION, "blobs": dict(sorted(lengths.items()))}
    return json.dumps(record, separators=(",", ":")).encode()


def check_blob_lengths(lengths: object) -> dict[str, int]:
    """``lengths`` as a dict, if it is a non-empty mapping of pool names
    (non-empty strings) to integers >= 0; `ConfigurationError` naming it otherwise."""
    if (
        not isinstance(lengths, Mapping) or not lengths
        or not all(isinstance(n, str) and n for n in lengths)
        or not all(type(v) is int and v >= 0 for v in lengths.values())
    ):
        raise ConfigurationError(
            f"blob lengths are a non-empty mapping of pool names to integers >= 0; got {lengths!r:.80}"
        )
    return dict(lengths)


def decode_commit(data: bytes | None) -> dict[str, int] | None:
    """Blob lengths by pool from a commit record, or None when there is no
    record (``None`` or empty) or it is not one this format wrote: not JSON,
    another version, no blobs, a pool name that is not a non-empty string, or
    a length that is not an integer >= 0. A caller reads None as a miss."""
    if not data:
        return None
    lengths = _decoded(data if type(data) is bytes else bytes(data))
    return None if lengths is None else dict(lengths)


@functools.lru_cache(maxsize=1024)
def _decoded(data: bytes) -> tuple[tuple[str, int], ...] | None:
    """`decode_commit`'s work, remembered: the pages of one pool have one record
    (the same blob lengths), so a lookup or read decodes JSON once, not once a page."""
    try:
        record = json.loads(data)
    except (ValueError, TypeError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(record, dict) or record.get("v") != _COMMIT_VERSION:
        return None
    blobs = record.get("blobs")
    if not isinstance(blobs, dict) or not blobs:
        return None
    for name, length in blobs.items():
        if not isinstance(name, str) or not name or isinstance(length, bool) or not isinstance(length, int) or length < 0:
            return None
    return tuple(blobs.items())


def assemble(
    commit: dict[str, int] | None, blobs: Mapping[str, bytes | None], pools: Sequence[str]
) -> dict[str, bytes] | None:
    """The page a reader may see: every requested blob present with its
    committed length (a committed 0-byte blob is ``b""`` whatever ``blobs``
    holds for it: see the module doc), else None."""
    if commit is None:
        return None
    out: dict[str, bytes] = {}
    for name in pools:
        length = commit.get(name)
        if length == 0:
            out[name] = b""
            continue
        data = blobs.get(name)
        if data is None or length is None or len(data) != length:
            return None
        out[name] = data
    return out


def is_present(commit: dict[str, int] | None, lengths: Mapping[str, int | None]) -> bool:
    """Whether a page is present: its commit record is well-formed (not None)
    and every blob it names has, in ``lengths`` (pool -> stored length, None
    or absent for a missing blob), the length it names; a 0-byte blob needs
    no entry (see the module doc)."""
    return commit is not None and all(not n or lengths.get(name) == n for name, n in commit.items())
