"""`KvtierHiCacheStorage`'s ``store_admission``: pages SGLang backs up that the
policy refuses are not written, SGLang's backup goes on past them, and the
skips are counted by reason.

Driven through SGLang's own cache controller (``_page_backup`` and the
prefetch path, harness.py); every page that comes back is compared byte for
byte with the host pool it was backed up from.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

_SGLANG = importlib.util.find_spec("sglang")
if _SGLANG is not None and _SGLANG.origin is not None and importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(Path(__file__).parent / "stand_ins"))
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed; `make test-sglang` builds .venv-sglang with sglang==0.5.23")

import harness  # noqa: E402
from harness import (  # noqa: E402
    KVTIER, PAGE, Pools, backup, make_pools, page_hashes, pages_of, prefetch, single_rank, tokens,
)
from kvtier.errors import ConfigurationError  # noqa: E402
from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402
from kvtier.policies import FrequencyGate  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.fixture(autouse=True)
def one_rank() -> Iterator[None]:
    with single_rank():
        yield


@pytest.fixture
def controllers() -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(pools: Pools, extra: dict[str, Any]) -> Any:
        ctl = harness.controller(pools, extra)
        made.append(ctl)
        return ctl

    yield make
    for ctl in made:
        ctl.detach_storage_backend()


def assert_same_pages(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"page {i} differs"


def test_bad_admission_options_fail_the_attach_naming_the_key_and_value(tmp_path: Path) -> None:
    pools = make_pools("mha", "page_first")
    base = {**KVTIER, "store_path": str(tmp_path)}
    for extra, message in [
        ({"store_admission": "lfu"}, r"'store_admission' must be one of \['all', 'frequency'\].*; got 'lfu'"),
        ({"store_admission": 2}, r"'store_admission' must be .*; got 2"),
        ({"store_admission": "frequency", "admission_sightings": 0}, r"'admission_sightings' must be an int >= 1; got 0"),
        ({"store_admission": "frequency", "admission_window": "8"}, r"'admission_window' must be an int >= 1; got '8'"),
        ({"store_admission": "frequency", "admission_sightings": True}, r"'admission_sightings' .*; got True"),
        ({"admission_sightings": 3}, r"'admission_sightings' applies to store_admission='frequency' only"),
        ({"store_admission": "no_such_module_kvtier:make"}, r"'store_admission'='no_such_module_kvtier:make' cannot be"),
    ]:
        with pytest.raises(ConfigurationError, match=message):
            StorageBackendFactory.create_backend("dynamic", harness.storage_config(pools, {**base, **extra}), pools.host)


@pytest.mark.parametrize("interface_v1", [1, 0], ids=["v1", "legacy"])
def test_a_frequency_gate_writes_a_page_on_its_second_backup(
    tmp_path: Path, interface_v1: int, controllers: Callable[..., Any]
) -> None:
    extra = {**KVTIER, "store_path": str(tmp_path / "store"), "interface_v1": interface_v1,
             "store_admission": "frequency", "admission_sightings": 2}
    a, b = make_pools("mha", "page_first"), make_pools("mha", "page_first")
    a.fill(seed=3)
    ctl_a, ctl_b = controllers(a, extra), controllers(b, extra)
    writer = ctl_a.storage_backend
    assert isinstance(writer, KvtierHiCacheStorage)
    gate = writer.admission.policy
    assert isinstance(gate, FrequencyGate) and (gate.sightings, gate.tier) == (2, "store")
    prompt = tokens(6, seed=7)
    src = a.host.alloc(6 * PAGE)
    # First backup: every page skipped, reported done (SGLang goes on), nothing stored.
    assert backup(ctl_a, src, prompt) == 6 * PAGE
    assert prefetch(ctl_b, prompt)[:2] == (0, 0)
    stats = writer.statistics()
    assert stats is not None
    assert (stats.put_pages, stats.put_skipped, stats.put_skipped_by_reason) == (0, 6, {"infrequent": 6})
    # A prompt sharing the first 4 pages: those are on their second backup, the 2 new ones skipped.
    other = prompt[: 4 * PAGE] + tokens(2, seed=99)
    src_other = torch.cat([src[: 4 * PAGE], a.host.alloc(2 * PAGE)])
    assert backup(ctl_a, src_other, other) == 6 * PAGE
    found, landed, dst = prefetch(ctl_b, other)
    assert (found, landed) == (4, 4)
    assert_same_pages(pages_of(b, dst), pages_of(a, src[: 4 * PAGE]))
    stats = writer.statistics()
    assert stats is not None
    assert (stats.put_pages, stats.put_skipped, stats.put_skipped_by_reason) == (4, 8, {"infrequent": 8})
    # The first prompt again: its last 2 pages are now on their second backup.
    assert backup(ctl_a, src, prompt) == 6 * PAGE
    found, landed, dst = prefetch(ctl_b, prompt)
    assert (found, landed) == (6, 6)
    assert_same_pages(pages_of(b, dst), pages_of(a, src))
    decisions = writer.admission.statistics()
    assert (decisions.offered["store"], decisions.admitted["store"]) == (18, 10)


def test_by_default_every_page_is_written_and_nothing_is_counted(tmp_path: Path) -> None:
    pools = make_pools("mha", "layer_first")
    pools.fill(seed=5)
    backend = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path)}))
    backend.register_mem_pool_host(pools.host)
    try:
        keys = page_hashes(tokens(3, seed=5))
        assert backend.batch_set_v1(keys, torch.arange(3 * PAGE)) == [True] * 3
        stats = backend.statistics()
        assert stats is not None and (stats.put_pages, stats.put_skipped, stats.put_skipped_by_reason) == (3, 0, {})
        assert backend.batch_exists(keys) == 3
    finally:
        backend.close()


def test_v2_sidecar_pages_are_gated_apart_from_the_kv_pages(tmp_path: Path) -> None:
    kv, swa = make_pools("mha", "page_first"), make_pools("mha", "layer_first")
    kv.fill(seed=30)
    swa.fill(seed=31)
    extra = {**KVTIER, "store_path": str(tmp_path), "store_admission": "frequency"}
    backend = KvtierHiCacheStorage(harness.storage_config(kv, extra))
    backend.register_mem_pool_host(kv.host)
    backend.register_mem_host_pool_v2(swa.host, PoolName.SWA)
    try:
        keys = page_hashes(tokens(2, seed=30))
        src = torch.arange(2 * PAGE)
        dst = torch.arange(10 * PAGE, 12 * PAGE)

        def set_swa() -> dict[str, list[bool]]:
            return backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=src, keys=keys)])

        def get_swa() -> dict[str, list[bool]]:
            return backend.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=dst, keys=keys)])

        assert backend.batch_set_v1(keys, src) == [True, True]  # skipped: reported done
        assert backend.batch_exists(keys) == 0
        # The KV pages' sighting is not the SWA pages': still their first.
        assert set_swa() == {PoolName.SWA: [True, True]}
        assert get_swa() == {PoolName.SWA: [False, False]}
        assert set_swa() == {PoolName.SWA: [True, True]}  # second: written
        assert get_swa() == {PoolName.SWA: [True, True]}
        assert_same_pages(pages_of(swa, dst), pages_of(swa, src))
        assert backend.batch_exists(keys) == 0  # the KV pages were offered once
        stats = backend.statistics()
        assert stats is not None and (stats.put_pages, stats.put_skipped) == (2, 4)
    finally:
        backend.close()
