"""The SGLang extra config refuses what kvtier does not read, and names the
key a near miss meant: a misspelt key never starts an engine on defaults.

Needs SGLang (see test_sglang_storage.py); skipped without it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SGLANG = importlib.util.find_spec("sglang")
if _SGLANG is not None and _SGLANG.origin is not None and importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(Path(__file__).parent / "stand_ins"))
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed; `make test-sglang` builds .venv-sglang with sglang==0.5.23")

import harness  # noqa: E402
from harness import KVTIER, make_pools  # noqa: E402
from kvtier.errors import ConfigurationError  # noqa: E402
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
