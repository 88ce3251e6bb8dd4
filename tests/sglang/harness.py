"""SGLang's own objects on CPU, for the tests here: device and host pools in
every layout, storage configs, and real ``HiCacheController`` s attached to a
storage backend through SGLang's factory. Imported only where SGLang is."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageFailureInjector,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

PAGE = 4
LAYERS = 3
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
LAYOUTS = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]

def _why_no_redis() -> str | None:
    import importlib.util

    from kvtier.testing.redis_server import find_redis_server

    if importlib.util.find_spec("redis") is None:
        return "redis-py is not installed"
    if find_redis_server() is None:
        return "redis-server binary not found (apt-get install -y redis-server)"
    return None


needs_redis_server = pytest.mark.skipif(_why_no_redis() is not None, reason=_why_no_redis() or "")

KVTIER = {
    "backend_name": "kvtier",
    "module_path": "kvtier.integrations.sglang",
    "class_name": "KvtierHiCacheStorage",
    "interface_v1": 1,
}


@contextlib.contextmanager
def single_rank(tp_rank: int = 0, tp_size: int = 1) -> Iterator[None]:
    """SGLang's parallel context for one process of ``tp_size`` (no process groups)."""
    with get_parallel().override(tp_size=tp_size, tp_rank=tp_rank, pp_size=1, pp_rank=0,
                                 attn_dcp_size=1, attn_dcp_rank=0):
        yield


@dataclass
class Pools:
    kind: str
    device: Any
    host: Any

    def fill(self, seed: int) -> None:
        """Random values (finite: byte comparisons then hold for every copy path) in the whole host pool."""
        g = torch.Generator().manual_seed(seed)
        buf = self.host.kv_buffer
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))

    def page(self, start: int) -> torch.Tensor:
        """The page at host slot ``start`` as bytes (a copy)."""
        return self.host.get_data_page(start, flat=True).contiguous().view(torch.uint8).clone()


def write_pages(pools: Pools, host_indices: torch.Tensor, seed: int) -> None:
    """Write pages that depend only on ``seed`` and their place in the prefix at ``host_indices``."""
    dummy = pools.host.get_dummy_flat_data_page()
    for i, start in enumerate(host_indices[::PAGE].tolist()):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        pools.host.set_from_flat_data_page(int(start), torch.randn(dummy.shape, generator=g).to(dummy.dtype))


def make_pools(kind: str, layout: str, *, slots: int = 64, dtype: torch.dtype = torch.bfloat16) -> Pools:
    """A CPU device pool and SGLang's host pool for it, ``layout`` as given, not pinned."""
    if kind == "mha":
        device = MHATokenToKVPool(slots, PAGE, dtype, 2, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
        host = MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=device.size, start_layer=0, end_layer=LAYERS,
        )
    else:
        device = MLATokenToKVPool(slots, PAGE, dtype, 16, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
        host = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=device.size, start_layer=0, end_layer=LAYERS,
            target_layer_num=device.layer_num, override_kv_cache_dim=device.kv_cache_dim,
        )
    return Pools(kind, device, host)


def storage_config(pools: Pools, extra: dict[str, Any], *, model: str = "tiny", tp_rank: int = 0,
                   tp_size: int = 1, metrics: bool = False) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=pools.kind == "mla", enable_storage_metrics=metrics,
        is_page_first_layout=pools.host.layout == "page_first", model_name=model, extra_config=dict(extra),
    )


class _Allocator:
    """What HiCacheController reads of SGLang's token allocator: the device pool."""

    def __init__(self, device: Any) -> None:
        self._device = device

    def get_kvcache(self) -> Any:
        return self._device


def controller(pools: Pools, extra: dict[str, Any], *, model: str = "tiny") -> HiCacheController:
    """A real HiCacheController whose storage backend SGLang's factory builds
    from ``extra`` (``--hicache-storage-backend dynamic``); its storage threads run."""
    return HiCacheController(
        _Allocator(pools.device), pools.host, PAGE, None, threading.Event(),
        storage_backend="dynamic", model_name=model, storage_backend_extra_config=dict(extra),
    )


def page_hashes(tokens: list[int]) -> list[str]:
    """SGLang's storage keys for ``tokens``: per-page SHA-256 hex, chained."""
    return list(get_storage_hash_str(tokens, None, page_size=PAGE))


def backup(ctl: HiCacheController, host_indices: torch.Tensor, tokens: list[int]) -> int:
    """SGLang's backup path (``_page_backup``) for ``tokens`` at ``host_indices``; tokens written."""
    op = StorageOperation(host_indices, tokens, hash_value=page_hashes(tokens))
    ctl._page_backup(op)
    return int(op.completed_tokens)


def prefetch(ctl: HiCacheController, tokens: list[int]) -> tuple[int, int, torch.Tensor]:
    """SGLang's prefetch path: ``_storage_hit_query`` (what storage says it
    has), host slots for the hit, ``_page_transfer`` into them. Returns
    (pages the query found, pages that landed, the host indices)."""
    op = PrefetchOperation("req", tokens)
    hashes, hit_tokens = ctl._storage_hit_query(op)
    op.hash_value = hashes
    found = hit_tokens // PAGE
    if not found:
        return 0, 0, torch.empty(0, dtype=torch.int64)
    op.host_indices = ctl.mem_pool_host.alloc(found * PAGE)
    landed = ctl._page_transfer(op)
    return found, landed, op.host_indices


@contextlib.contextmanager
def sglang_settings(**fields: Any) -> Iterator[None]:
    """SGLang's published server settings (its ``override_server_args``, as
    SGLang's own tests use), e.g. ``kv_cache_dtype="fp8_e5m2"``, with one rank."""
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args(**fields), single_rank():
        yield


def make_mamba_pool(*, layers: int = 2, slots: int = 16, conv: torch.dtype = torch.bfloat16,
                    temporal: torch.dtype = torch.float32) -> Any:
    """SGLang's own Mamba host pool (page size 1: one state per page), not pinned."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 4, 8, dtype=temporal), conv=(torch.zeros(layers, slots, 3, 16, dtype=conv),)
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")


def hybrid_controller(kv: Pools, mamba: Any, extra: dict[str, Any], *, tp_rank: int, tp_size: int,
                      model: str = "tiny") -> Any:
    """A real HybridCacheController over SGLang's HostPoolGroup of ``kv`` (the
    anchor) and a Mamba host pool, as TP rank ``tp_rank`` of ``tp_size`` (no
    process groups): SGLang attaches the backend and registers both pools."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    group = HostPoolGroup([
        PoolEntry(PoolName.KV, kv.host, kv.device, lambda i: i, is_primary_index_anchor=True),
        PoolEntry(PoolName.MAMBA, mamba, None, lambda i: i),
    ])
    with single_rank(tp_rank=tp_rank, tp_size=tp_size):
        return HybridCacheController(
            _Allocator(kv.device), group, PAGE, None, threading.Event(),
            storage_backend="dynamic", model_name=model, storage_backend_extra_config=dict(extra),
        )


def hybrid_backup(ctl: Any, host_indices: torch.Tensor, tokens: list[int], state_slot: int) -> Any:
    """SGLang's hybrid backup path (``_page_backup``: KV on the MLA writer rank,
    the Mamba state on every rank, as ``should_backup`` says) for ``tokens``,
    with the state of the last page at Mamba slot ``state_slot``."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import StorageOperation as HybridOperation

    hashes = page_hashes(tokens)
    op = HybridOperation(host_indices, tokens, hash_value=hashes, pool_transfers=[PoolTransfer(
        name=PoolName.MAMBA, host_indices=torch.tensor([state_slot]), keys=hashes[-1:],
        hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    with single_rank(tp_rank=ctl.storage_config.tp_rank, tp_size=ctl.storage_config.tp_size):
        ctl._page_backup(op)
    return op


def hybrid_hit_query(ctl: Any, tokens: list[int]) -> int:
    """SGLang's hybrid hit query (``_storage_hit_query``, through ``batch_exists_v2``)
    with the Mamba state as a trailing pool; the KV pages it reports usable."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation as HybridPrefetch

    class _Handle:
        rid = "req"

    op = HybridPrefetch(_Handle(), tokens, pool_transfers=[PoolTransfer(  # type: ignore[arg-type]
        name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES, keys=page_hashes(tokens)[-1:])])
    _, hit_tokens = ctl._storage_hit_query(op)
    return int(hit_tokens) // PAGE


def backend_of(ctl: Any) -> Any:
    """The `KvtierHiCacheStorage` behind a controller (SGLang's failure injector unwrapped)."""
    b = ctl.storage_backend
    return b._backend if isinstance(b, HiCacheStorageFailureInjector) else b


def tokens(n_pages: int, seed: int = 0) -> list[int]:
    """``n_pages`` pages of random token ids, the same for the same seed."""
    r = random.Random(seed)
    return [r.randrange(1, 30000) for _ in range(n_pages * PAGE)]


def pages_of(pools: Pools, host_indices: torch.Tensor) -> list[torch.Tensor]:
    """The host pages that start at every ``PAGE``-th of ``host_indices``."""
    return [pools.page(int(s)) for s in host_indices[::PAGE].tolist()]
