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
    docs = (PATH.parents[3] / "docs" / "configuration.md").read_text()
    assert f"(default `min(host blocks, {options.DEFAULT_STAGING_BLOCKS})`)" in docs


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


# -- one vocabulary (docs/configuration.md) ------------------------------------------------


def test_the_vocabularys_names_and_units_are_what_vllm_reads(options: ModuleType) -> None:
    """Every name the vocabulary gives vLLM is an option here, and each size
    takes bytes or a size string: kvtier's vLLM names are the vocabulary's, so
    no option of vLLM's is renamed (SGLang's are, tests/sglang)."""
    from kvtier.integrations.options import RENAMED, VOCABULARY

    assert set(options.OPTIONS) == {n for n, o in VOCABULARY.items() if "vllm" in o.engines}
    assert RENAMED["vllm"] == {}
    got = options.parse_options({"kvtier": {
        "store": "file", "store_path": "/tmp/kv", "store_max_bytes": "2GiB", "model_identity": "m@1",
        "host_bytes": "1MiB", "staging_blocks": 4,
    }})
    assert (got.store_path, got.store_max_bytes, got.model_identity, got.host_bytes, got.staging_blocks) == (
        "/tmp/kv", 2 << 30, "m@1", 1 << 20, 4)
    assert options.parse_options({"kvtier": {"store": "redis", "redis_url": "redis://h:1/0"}}).redis_url == "redis://h:1/0"
    assert options.parse_options({"kvtier": {"host_bytes": 3 << 20}}).host_bytes == 3 << 20


@pytest.mark.parametrize(("kvtier", "message"), [
    ({"store": "file"}, r"kvtier option 'store'='file' needs kvtier option 'store_path'"),
    ({"store": "file", "redis_url": "redis://h:1/0"}, r"'store'='file' needs kvtier option 'store_path' \(not 'redis_url'\)"),
    ({"store": "redis", "store_path": "/x"}, r"'store'='redis' needs kvtier option 'redis_url' \(not 'store_path'\)"),
    ({"store": "mooncake"}, r"'store' must be 'file' or 'redis' \(kvtier's vLLM integration has no Mooncake store\)"),
    ({"host_bytes": "8 parsecs"}, r"kvtier option 'host_bytes' must be a number of bytes >= 1 or a size .*'8 parsecs'"),
    ({"host_bytes": 0}, r"kvtier option 'host_bytes' must be a number of bytes >= 1"),
    ({"host_bytes": "1GiB", "host_blocks": 8}, r"'host_bytes'='1GiB' and 'host_blocks'=8 both size kvtier's host tier"),
])
def test_a_store_kind_or_host_size_kvtier_cannot_use_is_refused_naming_it(
    options: ModuleType, kvtier: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        options.parse_options({"kvtier": kvtier})


def test_host_sizes_are_totals_over_workers_and_take_size_strings(options: ModuleType) -> None:
    """``kvtier.host_bytes`` is over all workers, as --kv-offloading-size;
    vLLM's ``cpu_bytes_to_use`` takes a size string too; with several workers
    it is refused (kvtier read it per worker, vLLM a total), naming what to give."""
    host = options.parse_options({"kvtier": {"host_bytes": "8MiB"}})
    assert options.host_blocks(host, {}, BLOCK) == 128
    assert options.host_blocks(host, {}, BLOCK, workers=2) == 64
    none = options.parse_options({})
    assert options.host_blocks(none, {"cpu_bytes_to_use": "8MiB"}, BLOCK) == 128
    assert options.host_blocks(none, {"cpu_bytes_to_use": float(8 << 20)}, BLOCK) == 128
    with pytest.raises(ConfigurationError, match=r"option 'cpu_bytes_to_use'=8388608 with 2 vLLM workers is ambiguous: "
                                                 r".* give kvtier.host_bytes .* or kvtier.host_blocks"):
        options.host_blocks(none, {"cpu_bytes_to_use": 8 << 20}, BLOCK, workers=2)
    # --kv-offloading-size wrote cpu_bytes_to_use itself: that is the flag's size, never ambiguous.
    assert options.host_blocks(none, {"cpu_bytes_to_use": 8 << 20}, BLOCK, offloading_size=1 / 128, workers=2) == 64
    with pytest.raises(ConfigurationError, match=r"kvtier option 'host_bytes'=8388608 and vLLM's cpu_bytes_to_use=1024 "
                                                 r"both size kvtier's host tier; give one"):
        options.host_blocks(host, {"cpu_bytes_to_use": 1024}, BLOCK)
    with pytest.raises(ConfigurationError, match=r"kvtier option 'host_bytes'=8388608 and vLLM's --kv-offloading-size "
                                                 r"1 \(kv_offloading_size\) both size"):
        options.host_blocks(host, {}, BLOCK, offloading_size=1.0)
    with pytest.raises(ConfigurationError, match=r"'host_bytes'=65536 \(bytes over 2 workers\) gives each worker 32768 "
                                                 r"bytes, which hold no vLLM block of 65536 bytes; give at least 131072"):
        options.host_blocks(options.parse_options({"kvtier": {"host_bytes": BLOCK}}), {}, BLOCK, workers=2)
    with pytest.raises(ConfigurationError, match=r"option 'cpu_bytes_to_use' must be a number of bytes >= 1 or a size"):
        options.host_blocks(none, {"cpu_bytes_to_use": "lots"}, BLOCK)


def test_host_blocks_beside_cpu_bytes_to_use_still_wins_as_before(options: ModuleType) -> None:
    """Earlier releases documented host_blocks "instead of cpu_bytes_to_use"
    and took both: that configuration keeps working, over several workers too."""
    blocks = options.parse_options({"kvtier": {"host_blocks": 8}})
    assert options.host_blocks(blocks, {"cpu_bytes_to_use": 1 << 30}, BLOCK, workers=2) == 8


def test_an_sglang_name_from_before_the_vocabulary_is_refused_naming_the_new_one(options: ModuleType) -> None:
    """vLLM never read SGLang's old names: they are unknown here, and the
    refusal names the one vocabulary's name."""
    with pytest.raises(ConfigurationError, match=r"unknown kvtier option 'path' in kv_connector_extra_config\['kvtier'\] "
                                                 r"\(did you mean 'store_path'\? 'path' is an old name of it\)"):
        options.parse_options({"kvtier": {"path": "/x"}})
    with pytest.raises(ConfigurationError, match=r"unknown kvtier option 'banana' in kv_connector_extra_config\['kvtier'\]; "):
        options.parse_options({"kvtier": {"banana": 1}})
