"""kvtier on SGLang's hybrid SWA stack: ``SWAKVPool`` -> ``build_hybrid_swa_stack``
(SGLang's own host pool group and ``HybridCacheController``, its host pools
built unpinned as SGLang's own prefetch-corruption test kit builds them), with
kvtier attached by SGLang's dynamic backend factory.

A prompt's KV pages and its trailing sliding-window pages are backed up through
the controller's backup thread (``write_storage`` with the SWA transfer SGLang's
SWA component builds) and read back through its prefetch, IO and sync threads
into a second stack, byte for byte, and compared with SGLang's own
``HiCacheFile`` doing the same operations. One flipped byte in a stored SWA page
is a miss for that page in kvtier; ``HiCacheFile`` hands the flipped byte back.

Needs SGLang (see test_sglang_storage.py); skipped without it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

_SGLANG = importlib.util.find_spec("sglang")
if _SGLANG is not None and _SGLANG.origin is not None and importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(Path(__file__).parent / "stand_ins"))
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed; `make test-sglang` builds .venv-sglang with sglang==0.5.23")

from harness import KVTIER, PAGE, needs_redis_server, page_hashes, single_rank, tokens  # noqa: E402
from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402
from kvtier.integrations.sglang import storage as sglang_storage  # noqa: E402
from kvtier.storage import PageBlobs  # noqa: E402
from kvtier.testing.redis_server import LocalRedisServer  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402

pytestmark = pytest.mark.sglang

N_PAGES, WINDOW = 5, 2  # a prompt of 5 pages; the SWA pool keeps its last 2
WAIT_S = 60.0


class _Handle:
    rid = "req"


@pytest.fixture(autouse=True)
def one_rank() -> Iterator[None]:
    with single_rank():
        yield


@pytest.fixture
def stacks() -> Iterator[Callable[..., tuple[Any, Any]]]:
    """SGLang's hybrid SWA stacks (host pool group, controller); detached at teardown."""
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as assembler
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    made: list[Any] = []
    host_pool_cls = assembler.get_mha_host_pool_cls

    def unpinned(info: Any) -> Any:  # as SGLang's UnifiedRadixPrefetchCorruptionFixtures builds them
        cls = host_pool_cls(info)
        return lambda *a, **k: cls(*a, **{**k, "pin_memory": False})

    def make(backend: str, extra: dict[str, Any], *, seed: int) -> tuple[Any, Any]:
        set_global_server_args_for_scheduler(ServerArgs(
            model_path="dummy", page_size=PAGE, hicache_mem_layout="page_first", hicache_ratio=2.0,
            hicache_io_backend="direct"))
        kv = SWAKVPool(size=64, size_swa=64, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=8,
                       swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1], device="cpu")
        allocator = SWATokenToKVPoolAllocator(size=64, size_swa=64, page_size=PAGE, dtype=torch.bfloat16,
                                              device="cpu", kvcache=kv, need_sort=False)
        params = CacheInitParams(
            disable=False, req_to_token_pool=ReqToTokenPool(size=4, max_context_len=128, device="cpu",
                                                            enable_memory_saver=False),
            token_to_kv_pool_allocator=allocator, page_size=PAGE, tp_cache_group=None)
        full, swa = assembler._swa_layer_mappings(kv)
        with mock.patch.object(assembler, "get_mha_host_pool_cls", side_effect=unpinned):
            group, ctl = assembler.build_hybrid_swa_stack(
                params=params, full_kv_pool=kv.full_kv_pool, swa_kv_pool=kv.swa_kv_pool, full_layer_mapping=full,
                swa_layer_mapping=swa, load_cache_event=threading.Event(), storage_backend=backend, use_mla=False,
                model_name="tiny", storage_backend_extra_config=dict(extra))
        made.append(ctl)
        g = torch.Generator().manual_seed(seed)
        for entry in group.entries:
            buf = entry.host_pool.kv_buffer
            buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
        return group, ctl

    yield make
    for ctl in made:
        ctl.detach_storage_backend()


def pages(host: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    return [host.get_data_page(int(s), flat=True).contiguous().view(torch.uint8).clone() for s in indices[::PAGE]]


def backup(group: Any, ctl: Any, prompt: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A backup through the controller's backup thread, with the SWA transfer
    SGLang's SWA component builds (its trailing pages, ``TRAILING_PAGES``):
    (KV tokens written, KV host indices, SWA host indices)."""
    hashes = page_hashes(prompt)
    kv_idx = group.get_pool(PoolName.KV).alloc(N_PAGES * PAGE)
    swa_idx = group.get_pool(PoolName.SWA).alloc(WINDOW * PAGE)
    ctl.write_storage(kv_idx, prompt, hash_value=hashes, extra_pools=[PoolTransfer(
        name=PoolName.SWA, host_indices=swa_idx, keys=hashes[-WINDOW:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    op = ctl.ack_backup_queue.get(timeout=WAIT_S)
    return int(op.completed_tokens), kv_idx, swa_idx


def prefetch(group: Any, ctl: Any, prompt: list[int]) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    """SGLang's prefetch path for a prompt with its SWA window: the hit query
    (prefetch thread), host buffers as the scheduler allocates them, the page
    transfer (IO thread) and the acks (sync thread). Returns (KV pages found,
    KV pages landed, SWA pages landed, KV host indices, SWA host indices)."""
    op = ctl.prefetch(_Handle(), prompt, extra_pools=[PoolTransfer(
        name=PoolName.SWA, keys=["__placeholder__"] * WINDOW, hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert ctl.prefetch_hit_queue.get(timeout=WAIT_S) is op
    found = op.storage_hit_count // PAGE
    if not found:
        return 0, 0, 0, torch.empty(0), torch.empty(0)
    op.host_indices = ctl.alloc_prefetch_host_buffers(op, found * PAGE)
    op.pool_transfers[0].host_indices = group.get_pool(PoolName.SWA).alloc(WINDOW * PAGE)
    ctl.prefetch_buffer.put(op)
    kv_tokens, swa_pages = 0, 0
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=WAIT_S)
        if ack.completed_tokens is not None:
            kv_tokens = ack.completed_tokens
        if ack.pool_hits is not None:
            swa_pages = ack.pool_hits.get(PoolName.SWA.value, 0)
        if ack.completed_req:
            break
    return found, kv_tokens // PAGE, swa_pages, op.host_indices, op.pool_transfers[0].host_indices


def flip_stored_swa_page(backend: KvtierHiCacheStorage, key: str) -> None:
    """Flip one byte of the stored blob of SWA page ``key``, as a bad disk or a
    copy tool would: through a store opened the way the backend opens its own."""
    assert backend.namespace is not None
    pool = backend._pools[PoolName.SWA.value].key_pool
    page_key = backend.namespace.key(key, pool=pool)

    async def flip() -> None:
        store = sglang_storage._open_store(backend.options, backend.namespace.label())  # type: ignore[union-attr]
        async with store:
            (got,) = await store.get([page_key], [pool])
            assert got is not None
            blob = bytearray(got[pool])
            blob[len(blob) // 2] ^= 0x01
            await store.put([PageBlobs(page_key, {pool: bytes(blob)})])

    asyncio.run(flip())


@pytest.mark.parametrize("interface_v1", [1, 0], ids=["v1", "legacy"])
@pytest.mark.parametrize("store", ["file", pytest.param("redis", marks=needs_redis_server)])
def test_kv_and_swa_pages_come_back_byte_exact_as_with_hicache_file(
    store: str, interface_v1: int, stacks: Callable[..., tuple[Any, Any]], tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    if store == "file":
        extra: dict[str, Any] = {**KVTIER, "interface_v1": interface_v1, "store_path": str(tmp_path / "kvtier")}
    else:
        server: LocalRedisServer = request.getfixturevalue("redis_server")
        extra = {**KVTIER, "interface_v1": interface_v1, "store": "redis", "redis_url": server.url,
                 "prefix": f"swa{interface_v1}:", "timeout_s": 5.0}
    prompt = tokens(N_PAGES, seed=70)
    results = {}
    for name, backend, config in (("kvtier", "dynamic", extra),
                                  ("HiCacheFile", "file", {"file_storage_path": str(tmp_path / "builtin")})):
        writer, w_ctl = stacks(backend, config, seed=71)
        reader, r_ctl = stacks(backend, config, seed=72)
        written, kv_src, swa_src = backup(writer, w_ctl, prompt)
        assert written == N_PAGES * PAGE, name
        found, kv_landed, swa_landed, kv_dst, swa_dst = prefetch(reader, r_ctl, prompt)
        assert (found, kv_landed, swa_landed) == (N_PAGES, N_PAGES, WINDOW), name
        kv, swa = reader.get_pool(PoolName.KV), reader.get_pool(PoolName.SWA)
        results[name] = (pages(kv, kv_dst), pages(swa, swa_dst))
        expected = (pages(writer.get_pool(PoolName.KV), kv_src), pages(writer.get_pool(PoolName.SWA), swa_src))
        for got, want in zip(results[name], expected):
            assert all(torch.equal(x, y) for x, y in zip(got, want)), name
        if name == "kvtier":
            stats = r_ctl.storage_backend.statistics()
            assert stats.get_hits == N_PAGES + WINDOW and stats.get_failed == stats.get_refused == 0


def test_a_flipped_byte_in_a_swa_page_is_a_miss_there_and_hicache_file_hands_it_over(
    stacks: Callable[..., tuple[Any, Any]], tmp_path: Path,
) -> None:
    prompt = tokens(N_PAGES, seed=73)
    hashes = page_hashes(prompt)
    # kvtier: the window's first page flipped; the KV prefix is whole, the SWA window is not
    writer, w_ctl = stacks("dynamic", {**KVTIER, "store_path": str(tmp_path / "kvtier")}, seed=74)
    reader, r_ctl = stacks("dynamic", {**KVTIER, "store_path": str(tmp_path / "kvtier")}, seed=75)
    assert backup(writer, w_ctl, prompt)[0] == N_PAGES * PAGE
    flip_stored_swa_page(w_ctl.storage_backend, hashes[-WINDOW])
    found, kv_landed, swa_landed, _, _ = prefetch(reader, r_ctl, prompt)
    assert (found, kv_landed, swa_landed) == (N_PAGES, N_PAGES, 0)
    stats = r_ctl.storage_backend.statistics()
    assert stats.broken == {"checksum": 1} and stats.get_refused == 1 and stats.get_hits == N_PAGES + 1
    # HiCacheFile: the same byte flipped in its file, read back as a hit
    builtin = tmp_path / "builtin"
    writer, w_ctl = stacks("file", {"file_storage_path": str(builtin)}, seed=74)
    reader, r_ctl = stacks("file", {"file_storage_path": str(builtin)}, seed=75)
    _, _, swa_src = backup(writer, w_ctl, prompt)
    (path,) = [p for p in builtin.iterdir() if p.name.startswith(f"{hashes[-WINDOW]}.swa")]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(raw)
    found, kv_landed, swa_landed, _, swa_dst = prefetch(reader, r_ctl, prompt)
    assert (found, kv_landed, swa_landed) == (N_PAGES, N_PAGES, WINDOW)  # a hit...
    swa = reader.get_pool(PoolName.SWA)
    assert not torch.equal(pages(swa, swa_dst)[0], pages(writer.get_pool(PoolName.SWA), swa_src)[0])  # ...wrong bytes
