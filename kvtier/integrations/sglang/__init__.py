"""kvtier as SGLang HiCache's L3 storage backend, loaded by SGLang's dynamic factory.

Use it without patching SGLang::

    sglang serve --model-path <model> --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
            "interface_v1": 1, "redis_url": "redis://127.0.0.1:6379/0"}'

`KvtierHiCacheStorage` serves SGLang's v1 interface (``batch_exists``,
``batch_get_v1`` / ``batch_set_v1`` against the registered host pool) and the
legacy calls over kvtier's `FileStore`, `RedisStore` (and Redis Cluster) or
`MooncakeStore`, and the v2 calls for hybrid models' sidecar pools
(``ALL_PAGES`` / ``TRAILING_PAGES`` / ``BLOCK_GROUPS`` hit policies); every page is sealed under its key
and its pool's identity (`pool_identity`: model, pool, geometry, true fp8
format, per-pool TP shard), so a damaged, torn or foreign page is a miss, and
storage faults are misses, never exceptions in SGLang's threads. The store is
probed at attach and every extra-config value type-checked (`OPTIONS` lists
the keys it reads): a bad one fails the attach, naming it.

Tested with sglang 0.5.23 on CPU (``make test-sglang``); importing this
module needs SGLang; ``import kvtier`` does not.
"""

from __future__ import annotations

try:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without sglang
    raise ImportError(
        "kvtier.integrations.sglang needs SGLang (tested with sglang==0.5.23; `make test-sglang` builds .venv-sglang)"
    ) from exc

from kvtier.integrations.sglang.storage import (
    DEFAULT_FILE_PATH,
    DEFAULT_REDIS_URL,
    DSV4_KV_LAYOUTS,
    KV_CACHE_DTYPES,
    OPTIONS,
    SCHEME,
    HiCacheStorageStatistics,
    KvtierHiCacheStorage,
    dsv4_kv_layout,
    kv_element_format,
    namespace_for,
    pool_identity,
    pool_shard,
    sidecar_key_pool,
)

__all__ = [
    "DEFAULT_FILE_PATH",
    "DEFAULT_REDIS_URL",
    "DSV4_KV_LAYOUTS",
    "KV_CACHE_DTYPES",
    "OPTIONS",
    "SCHEME",
    "HiCacheStorageStatistics",
    "KvtierHiCacheStorage",
    "dsv4_kv_layout",
    "kv_element_format",
    "namespace_for",
    "pool_identity",
    "pool_shard",
    "sidecar_key_pool",
]
