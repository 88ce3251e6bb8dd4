"""The storage tier: whole pages keyed by a chained prefix hash, below host memory.

* `PageIdentity` (`kvtier.storage.identity`): everything that gives a stored
  page's bytes their meaning (model, key scheme, each pool's geometry, true
  element formats and shard); keys derive from it and every blob's header
  carries its tag. `EngineIdentity`: what the engine adds (model, shards, formats).
* `page_keys` / `KeyNamespace`: the key of each whole page of a token prefix;
  `window_keys` for pools whose pages depend on where the prefix ends
  (sliding window, recurrent state); `prefix_keys` for those at every
  boundary of another pool's pages (V4's window and buffers per anchor page).
* `encode_page` / `decode_page`: a page of an anchor pool and its sidecars'
  rows as one checksummed blob per pool, byte-exact; `decode_page` raises
  `PageCorrupted` and writes nothing for a page whose bytes changed in the
  store. `pack_rows` / `unpack_rows` are the raw row codecs beneath.
* `StorageBackend`: batched async ``exists`` / ``get`` / ``put`` with per-page
  results and no partial publication; `FileStore` (local directory, the
  default; ``max_bytes`` bounds it, evicting least recently read pages:
  `StoreUsage`, `parse_size`), `RedisStore` (Redis, Valkey, Redis Cluster; the ``redis`` extra)
  and `MooncakeStore` (experimental; needs the mooncake package).
  `BlockingStore`: a store that also answers on the caller's thread (`FileStore`);
  `SizedLookup`: one that can also find a page by its size alone (`FileStore`: a stat).
* `StorageError` / `StorageTimeout` / `PageCorrupted`: what backends and
  `decode_page` raise.
* For engines that keep their own host memory (`kvtier.storage.sealed`,
  `kvtier.storage.sealed_store`): `EngineNamespace` (kvtier keys from keys
  the engine already hashed), `seal` / `seal_tensor` / `open_sealed` (raw page
  bytes with an xxh3-64 checksum bound to the key; `SealBroken`), and
  `SealedPageStore`, a synchronous face on any store for the engine's own
  threads, where a fault or a broken seal is a per-page miss.

`RedisStore` and `MooncakeStore` are imported on first use, so importing
kvtier never imports redis-py or mooncake.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtier.storage.base import BlockingStore, PageBlobs, SizedLookup, StorageBackend
from kvtier.storage.errors import PageCorrupted, StorageError, StorageTimeout
from kvtier.storage.file_store import FileStore, StoreUsage, parse_size
from kvtier.storage.identity import EngineIdentity, PageIdentity, PlaneFormat, PoolFormat, Shard
from kvtier.storage.keys import KEY_BYTES, KeyNamespace, page_keys, prefix_keys, window_keys
from kvtier.storage.sealed import (
    SEAL_HEADER_BYTES,
    EngineNamespace,
    SealBroken,
    UnsupportedPayload,
    new_sealed,
    open_sealed,
    seal,
    seal_in_place,
    seal_tensor,
)
from kvtier.storage.sealed_store import ClearableStore, SealedPageStore, SealedStoreStatistics
from kvtier.storage.pages import (
    BLOB_HEADER_BYTES,
    decode_page,
    encode_page,
    pack_rows,
    page_members,
    unpack_rows,
)

if TYPE_CHECKING:
    from kvtier.storage.mooncake_store import MooncakeStore
    from kvtier.storage.redis_store import RedisStore

__all__ = [
    "BLOB_HEADER_BYTES",
    "KEY_BYTES",
    "SEAL_HEADER_BYTES",
    "BlockingStore",
    "ClearableStore",
    "EngineIdentity",
    "EngineNamespace",
    "FileStore",
    "KeyNamespace",
    "MooncakeStore",
    "PageBlobs",
    "PageCorrupted",
    "PageIdentity",
    "PlaneFormat",
    "PoolFormat",
    "RedisStore",
    "SealBroken",
    "SealedPageStore",
    "SealedStoreStatistics",
    "Shard",
    "SizedLookup",
    "StorageBackend",
    "StorageError",
    "StorageTimeout",
    "StoreUsage",
    "UnsupportedPayload",
    "decode_page",
    "encode_page",
    "new_sealed",
    "open_sealed",
    "pack_rows",
    "page_keys",
    "page_members",
    "parse_size",
    "prefix_keys",
    "seal",
    "seal_in_place",
    "seal_tensor",
    "unpack_rows",
    "window_keys",
]

_LAZY = {"MooncakeStore": "kvtier.storage.mooncake_store", "RedisStore": "kvtier.storage.redis_store"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later look-ups skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
