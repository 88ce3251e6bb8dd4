"""kvtier's options in vLLM's ``kv_connector_extra_config``, without vLLM.

``kvtier.integrations.vllm`` needs vLLM to import; its options module does
not (plain data, kvtier's errors and policies), so ``make test`` loads that
file on its own and checks what an engine would refuse at start.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvtier import ConfigurationError

PATH = Path(__file__).resolve().parent.parent / "kvtier" / "integrations" / "vllm" / "options.py"


@pytest.fixture(scope="module")
def options() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvtier_vllm_options_alone", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("key", ["kv_tier", "KVTier", "kvtiers", "kv-tier", "Kv_Tiers", "kvteir"])
def test_a_near_miss_of_the_kvtier_key_is_refused_naming_it(options: ModuleType, key: str) -> None:
    extra = {"cpu_bytes_to_use": 1 << 20, key: {"store_path": "/tmp/x", "verify": True}}
    with pytest.raises(ConfigurationError, match=f"key '{key}' is not 'kvtier'.*rename '{key}' to 'kvtier'"):
        options.parse_options(extra)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"settings": {"verify": True}}, "key 'settings' holds a mapping that neither vLLM nor kvtier reads"),
        ({"redis": "redis://127.0.0.1:6379/0"}, "key 'redis' is neither vLLM's nor kvtier's"),
        ({"store": "/var/cache/kvtier"}, "kvtier option 'store' is at the top level"),  # a kvtier option now
        ({"kvtier_verify": True}, "key 'kvtier_verify' is not 'kvtier'|key 'kvtier_verify' is neither"),
        ({"file-storage": "/x"}, "key 'file-storage' is neither vLLM's nor kvtier's"),
    ],
)
def test_a_top_level_key_holding_kvtier_settings_is_refused_naming_it(
    options: ModuleType, extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        options.parse_options({"cpu_bytes_to_use": 1 << 20, **extra})


def test_vllms_own_keys_and_kvtiers_container_pass(options: ModuleType) -> None:
    # Every key vLLM 0.32's offloading connector reads, dict-valued or close to a kvtier word
    # (store_threshold, eviction_policy, secondary_tiers), is vLLM's; the container is kvtier's.
    extra = {k: {"any": 1} for k in options.VLLM_KEYS}
    extra["kvtier"] = {"verify": True, "store_path": "/tmp/x"}
    parsed = options.parse_options(extra)
    assert parsed.verify is True and parsed.store_path == "/tmp/x"
    assert options.stray_keys(extra) == []


def test_a_kvtier_option_at_the_top_level_keeps_its_own_message(options: ModuleType) -> None:
    with pytest.raises(ConfigurationError, match="kvtier option 'redis_url' is at the top level"):
        options.parse_options({"redis_url": "redis://x"})


def test_the_staging_blocks_help_states_the_default_the_spec_uses(options: ModuleType) -> None:
    assert f"min(host blocks, {options.DEFAULT_STAGING_BLOCKS})" in options.OPTIONS["staging_blocks"]
    docs = (PATH.parents[3] / "docs" / "vllm.md").read_text()
    assert f"default: `min(host blocks, {options.DEFAULT_STAGING_BLOCKS})`" in docs


BLOCK = 64 << 10


def test_vllms_kv_offloading_size_sizes_each_workers_host_tier_as_vllm_defines_it(options: ModuleType) -> None:
    none = options.parse_options({})
    # GiB over all of vLLM's workers: 1/128 GiB = 8 MiB = 128 blocks of 64 KiB; two workers get half each.
    assert options.host_blocks(none, {"cpu_bytes_to_use": 1 << 23}, BLOCK, offloading_size=1 / 128) == 128
    assert options.host_blocks(none, {}, BLOCK, offloading_size=1 / 128, workers=2) == 64
    with pytest.raises(ConfigurationError, match=r"kvtier option 'host_blocks'=8 and vLLM's --kv-offloading-size 1 "):
        options.host_blocks(options.parse_options({"kvtier": {"host_blocks": 8}}), {}, BLOCK, offloading_size=1.0)
    with pytest.raises(ConfigurationError, match=r"--kv-offloading-size 1e-06 .* gives each worker 1073 bytes, which "
                                                 r"hold no vLLM block of 65536 bytes"):
        options.host_blocks(none, {}, BLOCK, offloading_size=1e-6)
    with pytest.raises(ConfigurationError, match=r"option '--kv-offloading-size 1e\+09' asks for"):
        options.host_blocks(none, {}, BLOCK, offloading_size=1e9)
    with pytest.raises(ConfigurationError, match="or vLLM's --kv-offloading-size"):
        options.host_blocks(none, {}, BLOCK)
