"""The SGLang extra config refuses what kvtier does not read, and names the
key a near miss meant: a misspelt key never starts an engine on defaults.

Needs SGLang (see test_sglang_storage.py); skipped without it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

_SGLANG = importlib.util.find_spec("sglang")
if _SGLANG is not None and _SGLANG.origin is not None and importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(Path(__file__).parent / "stand_ins"))
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed; `make test-sglang` builds .venv-sglang with sglang==0.5.23")

import harness  # noqa: E402
from harness import KVTIER, make_pools  # noqa: E402
from kvtier.errors import ConfigurationError  # noqa: E402
from kvtier.integrations.options import RENAMED, VOCABULARY  # noqa: E402
from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize(("key", "meant"), [
    ("stroe", "store"), ("Store", "store"), ("time-out_s", "timeout_s"), ("timeout", "timeout_s"),
    ("urls", "redis_url"), ("kv_cache_dtypes", "kv_cache_dtype"), ("Interface_V1", "interface_v1"),
    ("admission-sightings", "admission_sightings"), ("file_storage_path", "store_path"), ("redis-url", "redis_url"),
    ("model_name", "model_identity"), ("Path", "store_path"), ("URL", "redis_url"), ("store_paths", "store_path"),
])
def test_a_near_miss_of_a_known_key_is_refused_naming_it(key: str, meant: str) -> None:
    pools = make_pools("mha", "page_first")
    with pytest.raises(ConfigurationError, match=rf"key\(s\) \['{key}'\] \(did you mean '{meant}' for '{key}'\?\)"):
        StorageBackendFactory.create_backend("dynamic", harness.storage_config(pools, {**KVTIER, key: 1}), pools.host)


def test_an_unknown_key_with_nothing_near_is_refused_listing_the_keys() -> None:
    pools = make_pools("mha", "page_first")
    with pytest.raises(ConfigurationError, match=r"key\(s\) \['banana'\]; it reads \[") as info:
        StorageBackendFactory.create_backend("dynamic", harness.storage_config(pools, {**KVTIER, "banana": 1}), pools.host)
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("key", ["kvtier", "KVTier", "kv_tier", "kvtiers"])
def test_options_nested_under_a_kvtier_key_are_refused_saying_where_they_go(key: str) -> None:
    pools = make_pools("mha", "page_first")
    with pytest.raises(ConfigurationError, match=rf"\['{key}'\] \(kvtier's options go at the top level, beside "
                                                 rf"'backend_name', not under '{key}'\)"):
        StorageBackendFactory.create_backend(
            "dynamic", harness.storage_config(pools, {**KVTIER, key: {"store": "redis"}}), pools.host)


# -- one vocabulary (docs/configuration.md) ------------------------------------------------


@pytest.fixture
def logs(kvtier_warnings: list[Any]) -> list[Any]:
    return kvtier_warnings


def test_the_vocabularys_names_are_what_sglang_reads() -> None:
    from kvtier.integrations.sglang.storage import OPTIONS

    assert set(OPTIONS) == {name for name, o in VOCABULARY.items() if "sglang" in o.engines}
    assert RENAMED["sglang"] == {"path": "store_path", "url": "redis_url", "model": "model_identity",
                                 "max_bytes": "store_max_bytes"}


def test_the_new_names_are_read_and_log_nothing(tmp_path: Path, logs: list[Any]) -> None:
    """store_path / store_max_bytes / model_identity open that store; redis_url
    alone means the Redis store (no "store" needed)."""
    pools = make_pools("mha", "page_first")
    extra = {**KVTIER, "store_path": str(tmp_path), "store_max_bytes": "1GiB", "model_identity": "tiny@rev"}
    backend = KvtierHiCacheStorage(harness.storage_config(pools, extra))
    try:
        backend.register_mem_pool_host(pools.host)
        assert backend.model == "tiny@rev"
        assert backend.store is not None and backend.store.store.max_bytes == 1 << 30  # type: ignore[attr-defined]
        assert os.listdir(tmp_path), "the file store is not under store_path"
    finally:
        backend.close()
    redis = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "redis_url": "redis://127.0.0.1:1/0"}))
    assert redis.options["store"] == "redis" and redis.options["redis_url"] == "redis://127.0.0.1:1/0"
    assert logs == []


def test_the_old_names_are_read_with_one_renamed_event_each(tmp_path: Path, logs: list[Any]) -> None:
    pools = make_pools("mha", "page_first")
    extra = {**KVTIER, "path": str(tmp_path), "max_bytes": "1GiB", "model": "tiny@rev"}
    backend = KvtierHiCacheStorage(harness.storage_config(pools, extra))
    try:
        backend.register_mem_pool_host(pools.host)
        assert backend.model == "tiny@rev"
        assert backend.options["store_path"] == str(tmp_path) and backend.options["store_max_bytes"] == 1 << 30
        assert backend.store is not None and backend.store.store.max_bytes == 1 << 30  # type: ignore[attr-defined]
        assert os.listdir(tmp_path), "the file store is not under the old 'path'"
    finally:
        backend.close()
    assert sorted((e["event"], e["log_level"], e["engine"], e["old"], e["new"]) for e in logs) == [
        ("config.option_renamed", "warning", "sglang", "max_bytes", "store_max_bytes"),
        ("config.option_renamed", "warning", "sglang", "model", "model_identity"),
        ("config.option_renamed", "warning", "sglang", "path", "store_path"),
    ]
    logs.clear()
    url = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store": "redis", "url": "redis://h:1/0"}))
    assert url.options["redis_url"] == "redis://h:1/0" and "url" not in url.options
    assert [(e["old"], e["new"]) for e in logs] == [("url", "redis_url")]


@pytest.mark.parametrize(("old", "new", "value"), [
    ("path", "store_path", "/tmp/x"), ("url", "redis_url", "redis://h:1/0"), ("model", "model_identity", "m"),
    ("max_bytes", "store_max_bytes", "1GiB"),
])
def test_an_option_under_its_old_and_new_name_is_refused_naming_both(
    old: str, new: str, value: str, logs: list[Any]
) -> None:
    pools = make_pools("mha", "page_first")
    with pytest.raises(ConfigurationError, match=rf"gives both '{old}' and '{new}': '{old}' is the old name of "
                                                 rf"'{new}'; keep '{new}' alone"):
        KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, old: value, new: value}))
    assert logs == []
