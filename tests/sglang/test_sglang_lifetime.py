"""A `KvtierHiCacheStorage` dropped without ``close()`` leaves nothing behind.

SGLang's detach closes its backend "best-effort" and notes that some backends
rely on garbage collection; its own storage test kit makes backends and never
closes them. Each backend owns one store loop thread (`SealedPageStore`): a
dropped backend must not keep it, nor its store's connections.

Needs SGLang (see test_sglang_storage.py); skipped without it.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

_SGLANG = importlib.util.find_spec("sglang")
if _SGLANG is not None and _SGLANG.origin is not None and importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(Path(__file__).parent / "stand_ins"))
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed; `make test-sglang` builds .venv-sglang with sglang==0.5.23")

import harness  # noqa: E402
from harness import KVTIER, PAGE, make_pools, needs_redis_server, page_hashes, single_rank, tokens  # noqa: E402
from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

pytestmark = pytest.mark.sglang


def kvtier_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvtier-")}


def assert_ended(threads: set[threading.Thread]) -> None:
    for t in threads:
        t.join(30)  # the finalizer stops the loop; its thread closes it and ends
    assert [t.name for t in threads if t.is_alive()] == []


@pytest.mark.parametrize("store", ["file", pytest.param("redis", marks=needs_redis_server)])
def test_dropped_backends_release_their_threads(store: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if store == "file":
        extra: dict[str, Any] = {**KVTIER, "store_path": str(tmp_path)}
    else:
        extra = {**KVTIER, "store": "redis", "redis_url": request.getfixturevalue("redis_server").url, "prefix": "lifetime:"}
    before = kvtier_threads()
    pools = make_pools("mha", "page_first")
    pools.fill(seed=60)
    keys = page_hashes(tokens(2, seed=60))
    with single_rank():
        for i in range(4):  # as SGLang's factory makes them, used, never closed
            backend = StorageBackendFactory.create_backend("dynamic", harness.storage_config(pools, extra), pools.host)
            assert isinstance(backend, KvtierHiCacheStorage)
            backend.register_mem_pool_host(pools.host)
            assert backend.batch_set_v1(keys, torch.arange(2 * PAGE)) == [True, True]
            assert backend.batch_exists(keys) == 2
    made = kvtier_threads() - before
    assert len(made) == 1  # the last one is still referenced by `backend`
    del backend
    gc.collect()
    assert_ended(made)
    # the store is whole: a new backend reads what the dropped ones wrote
    with single_rank():
        reader = KvtierHiCacheStorage(harness.storage_config(pools, extra))
        reader.register_mem_pool_host(pools.host)
        try:
            assert reader.batch_get_v1(keys, torch.arange(8 * PAGE, 10 * PAGE)) == [True, True]
        finally:
            reader.close()
    assert_ended(kvtier_threads() - before)


def test_a_closed_backend_then_dropped_is_released_once(tmp_path: Path) -> None:
    before = kvtier_threads()
    pools = make_pools("mha", "page_first")
    with single_rank():
        backend = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path)}))
        backend.register_mem_pool_host(pools.host)
        # SGLang attaches again (register once more): the first store is closed, not leaked
        backend.register_mem_pool_host(pools.host)
    assert len(kvtier_threads() - before) == 1
    backend.close()
    backend.close()
    del backend
    gc.collect()
    assert_ended(kvtier_threads() - before)
