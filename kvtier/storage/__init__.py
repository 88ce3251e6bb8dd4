"""The storage tier: whole pages keyed by a chained prefix hash, below host memory.

* `page_keys` / `KeyNamespace`: the key of each whole page of a token prefix;
  `window_keys` for pools whose pages depend on where the prefix ends
  (sliding window, recurrent state).
* `encode_page` / `decode_page` (and `pack_rows` / `unpack_rows`): a page of
  an anchor pool and its sidecars' rows as one blob per pool, byte-exact.
* `StorageBackend`: batched async ``exists`` / ``get`` / ``put`` with per-page
  results and no partial publication; `FileStore` (local directory, the
  default) and `RedisStore` (Redis, Valkey, Redis Cluster; the ``redis`` extra).
* `StorageError` / `StorageTimeout`: what backends raise.
"""

from kvtier.storage.base import PageBlobs, StorageBackend
from kvtier.storage.errors import StorageError, StorageTimeout
from kvtier.storage.file_store import FileStore
from kvtier.storage.keys import KEY_BYTES, KeyNamespace, page_keys, window_keys
from kvtier.storage.pages import (
    decode_page,
    encode_page,
    pack_rows,
    page_members,
    unpack_rows,
)
from kvtier.storage.redis_store import RedisStore

__all__ = [
    "KEY_BYTES",
    "FileStore",
    "KeyNamespace",
    "PageBlobs",
    "RedisStore",
    "StorageBackend",
    "StorageError",
    "StorageTimeout",
    "decode_page",
    "encode_page",
    "pack_rows",
    "page_keys",
    "page_members",
    "unpack_rows",
    "window_keys",
]
