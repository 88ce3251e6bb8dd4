"""Pages of 0 and 1 bytes through every read and write call of `KvtierHiCacheStorage`.

SGLang's DeepSeek V4 anchor (`LogicalHostPool`) has 0-byte pages, and a
one-layer, one-byte-row V4 paged pool has 1-byte pages: each is stored,
found and read back like any page (``batch_get_v1``, the legacy ``batch_get``
with and without a target, ``batch_get_v2``), and a damaged one is a miss.
SGLang's own host pool classes, unpinned; the backend built as SGLang's
factory builds it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_SGLANG = importlib.util.find_spec("sglang")
if _SGLANG is not None and _SGLANG.origin is not None and importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(Path(__file__).parent / "stand_ins"))
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed; `make test-sglang` builds .venv-sglang with sglang==0.5.23")

from harness import KVTIER, single_rank  # noqa: E402
from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, LogicalHostPool  # noqa: E402

pytestmark = pytest.mark.sglang

PAGE = 4


def _backend(path: Path) -> tuple[KvtierHiCacheStorage, LogicalHostPool, DeepSeekV4PagedHostPool]:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=True,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny",
        extra_config={**KVTIER, "store_path": str(path), "dsv4_kv_layout": "v4"},
    )
    anchor = LogicalHostPool(8 * PAGE, PAGE, layout="page_first")
    one_byte = DeepSeekV4PagedHostPool(
        pool_name="deepseek_v4_c128", device_buffers=[torch.zeros(8, 1, dtype=torch.uint8)], item_bytes=1,
        num_host_pages=8, slot_page_size=PAGE, layout="page_first", pin_memory=False,
    )
    assert anchor.get_dummy_flat_data_page().numel() == 0 and one_byte.get_dummy_flat_data_page().numel() == 1
    backend = KvtierHiCacheStorage(config, {})
    with single_rank():
        backend.register_mem_pool_host(anchor)
        backend.register_mem_host_pool_v2(one_byte, PoolName.DEEPSEEK_V4_C128)
    return backend, anchor, one_byte


def test_zero_byte_pages_round_trip_through_every_read(tmp_path: Path) -> None:
    backend, _, _ = _backend(tmp_path)
    try:
        keys = [f"{i:064x}" for i in range(3)]
        idx = torch.arange(3 * PAGE)
        assert backend.batch_set_v1(keys, idx) == [True] * 3
        assert backend.batch_exists(keys) == 3
        assert backend.batch_get_v1(keys, idx) == [True] * 3
        got = backend.batch_get(keys)  # legacy, no target: new (empty) tensors
        assert [None if g is None else g.numel() for g in got] == [0, 0, 0]
        targets = [torch.empty(0, dtype=torch.uint8) for _ in keys]  # what SGLang's legacy get passes
        assert all(g is t for g, t in zip(backend.batch_get(keys, targets), targets))
        assert backend.batch_set(["f" * 64], [torch.empty(0, dtype=torch.uint8)])
        assert backend.batch_get(["f" * 64])[0] is not None
        assert backend.batch_get(["e" * 64]) == [None]  # never stored: a miss, not an empty page
    finally:
        backend.close()


def test_one_byte_pages_round_trip_and_a_flipped_one_is_a_miss(tmp_path: Path) -> None:
    backend, _, pool = _backend(tmp_path)
    try:
        keys = [f"{i:064x}" for i in range(3)]
        for i in range(3):
            pool.set_from_flat_data_page(i * PAGE, torch.tensor([0xA0 + i], dtype=torch.uint8))
        name = PoolName.DEEPSEEK_V4_C128
        put = backend.batch_set_v2([PoolTransfer(name=name, host_indices=torch.arange(3 * PAGE), keys=keys)])
        assert put == {name: [True] * 3}
        got = backend.batch_get_v2([PoolTransfer(name=name, host_indices=torch.arange(3 * PAGE, 6 * PAGE), keys=keys)])
        assert got == {name: [True] * 3}
        assert [int(pool.get_data_page(s)[0]) for s in range(3 * PAGE, 6 * PAGE, PAGE)] == [0xA0, 0xA1, 0xA2]
        # One bit of the middle page's stored byte flipped: that page is a miss, the others land.
        store_key = backend.namespace.keys([keys[1]], pool=backend._pool(name).key_pool)[0].hex()
        data = tmp_path / backend.namespace.label() / store_key[:2] / f"{store_key}.data"
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0x01  # the payload's one byte is the blob's last
        data.write_bytes(raw)
        pool.set_from_flat_data_page(6 * PAGE, torch.tensor([0x55], dtype=torch.uint8))  # where page 1 lands
        got = backend.batch_get_v2([PoolTransfer(name=name, host_indices=torch.arange(5 * PAGE, 8 * PAGE), keys=keys)])
        assert got == {name: [True, False, True]}
        assert int(pool.get_data_page(6 * PAGE)[0]) == 0x55  # the flipped page wrote nothing
    finally:
        backend.close()


def test_a_sidecar_pool_without_page_copies_fails_the_attach_naming_it(tmp_path: Path) -> None:
    """A pool kvtier cannot store is refused when SGLang registers it, not left to miss on every read."""
    from harness import make_pools
    from kvtier.errors import ConfigurationError

    backend, _, _ = _backend(tmp_path)
    unified = make_pools("mha", "page_unified").host  # SGLang's MHA host pool in a layout without page copies
    with pytest.raises(ConfigurationError, match=r"cannot store SGLang host pool 'swa' \(MHATokenToKVPoolHost, "
                                                 r"layout 'page_unified'\): it has no page copies"):
        backend.register_mem_host_pool_v2(unified, PoolName.SWA)
    assert backend.store is None  # the refused attach holds no store
