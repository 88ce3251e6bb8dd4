"""SGLang's own DeepSeek V4 HiCache stack on CPU, for the tests here and
benchmarks/sglang_v4.py: its device pool (`DeepSeekV4TokenToKVPool`), its host
side and controller (`build_deepseek_v4_hicache_stack` -> `HostPoolGroup` +
`HybridCacheController`), a storage backend attached by SGLang's own factory,
and SGLang's own backup (``_page_backup``) and prefetch (``_storage_hit_query``
+ ``_page_transfer``) paths. Imported only where SGLang is.

What is not SGLang's: the server settings are published the way SGLang's dsv4
attention test kit publishes them (``override_server_args``); the V4 host
pools are built unpinned (SGLang pins them with cudaHostRegister, absent on a
CPU build of torch) by two subclasses that only force ``pin_memory=False``;
the token allocator is the two attributes the stack reads of it. The pool
transfers of an operation are the ones SGLang's V4 tree builds (its
``SidecarPoolSpec`` list in ``hybrid_pool_assembler``): the compressed and
indexer pools derived from the KV anchor, every page (``ALL_PAGES``); the SWA
window as its own trailing page; the compressor states derived from the SWA
pool, trailing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector, PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_context, get_parallel

import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as assembler

LAYERS = 3
RATIOS = [4, 128, 0]  # one C4 layer (with its indexer and states), one C128 layer, one SWA-only layer
SWA_WINDOW_PAGES = 1  # SGLang's V4 window (128 tokens) fits one page of 128 or 256

# SGLang's V4 sidecars: (pool, the pool its indices come from, hit policy), as its V4 tree declares them.
KV_DERIVED = (
    PoolName.DEEPSEEK_V4_C1, PoolName.DEEPSEEK_V4_C1_INDEXER, PoolName.DEEPSEEK_V4_C1_INDEXER_SCALE,
    PoolName.DEEPSEEK_V4_C2, PoolName.DEEPSEEK_V4_C2_INDEXER, PoolName.DEEPSEEK_V4_C2_INDEXER_SCALE,
    PoolName.DEEPSEEK_V4_C4, PoolName.DEEPSEEK_V4_C4_ROPE, PoolName.DEEPSEEK_V4_C4_INDEXER,
    PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE, PoolName.DEEPSEEK_V4_C128, PoolName.DEEPSEEK_V4_C128_ROPE,
)
SWA_DERIVED = (PoolName.DEEPSEEK_V4_C4_STATE, PoolName.DEEPSEEK_V4_C4_INDEXER_STATE, PoolName.DEEPSEEK_V4_C128_STATE)


# Named as SGLang's classes, since a host pool's class name is part of kvtier's page identity.
class DeepSeekV4PagedHostPool(assembler.DeepSeekV4PagedHostPool):  # type: ignore[misc,name-defined]
    """SGLang's V4 paged host pool, unpinned (no cudaHostRegister on a CPU torch)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        super().__init__(*args, **kwargs)


class DeepSeekV4StateHostPool(assembler.DeepSeekV4StateHostPool):  # type: ignore[misc,name-defined]
    """SGLang's V4 compressor-state host pool, unpinned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        super().__init__(*args, **kwargs)


@contextlib.contextmanager
def v4_settings(*, layout: str, tp_rank: int = 0, tp_size: int = 1) -> Iterator[None]:
    """SGLang's published settings for a V4 HiCache rank on CPU (as its dsv4 test kit publishes them)."""
    with get_parallel().override(tp_size=tp_size, tp_rank=tp_rank, pp_size=1, pp_rank=0, attn_dcp_size=1,
                                 attn_dcp_rank=0, attn_tp_size=tp_size, attn_tp_rank=tp_rank, attn_cp_size=1, attn_cp_rank=0,
                                 attn_dp_size=1, attn_dp_rank=0, moe_tp_size=tp_size, moe_tp_rank=tp_rank,
                                 moe_ep_size=1, moe_dp_size=1), \
            get_context().override_server_args(kv_cache_dtype="auto", device="cpu", hicache_mem_layout=layout,
                                               hicache_ratio=2.0, hicache_size=0, tp_size=tp_size, pp_size=1):
        yield


@dataclass
class V4Stack:
    """One rank's V4 stack: SGLang's device pool, host pool group and controller."""

    device: Any
    group: Any
    ctl: Any
    page_size: int
    layout: str
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def pools(self) -> dict[str, Any]:
        """Every host pool with bytes, by SGLang pool name (the logical anchor has none)."""
        return {str(e.name): e.host_pool for e in self.group.entries if e.name != PoolName.KV}

    @property
    def anchor(self) -> Any:
        return self.group.anchor_entry.host_pool

    def settings(self) -> contextlib.AbstractContextManager[None]:
        return v4_settings(layout=self.layout, tp_rank=self.tp_rank, tp_size=self.tp_size)

    def backend(self) -> Any:
        b = self.ctl.storage_backend
        return b._backend if isinstance(b, HiCacheStorageFailureInjector) else b

    def close(self) -> None:
        with self.settings():
            with contextlib.suppress(Exception):
                self.ctl.detach_storage_backend()


def build_v4_stack(
    backend: str, extra: dict[str, Any] | None, *, page_size: int = 256, layout: str = "page_first",
    tp_rank: int = 0, tp_size: int = 1, model: str = "dsv4-tiny", kv_layout: Any = None,
    ratios: list[int] | None = None, kv_source_layers: tuple[int, ...] = (), device_pages: int = 8,
) -> V4Stack:
    """SGLang's V4 device pool and ``build_deepseek_v4_hicache_stack`` with
    ``backend`` (``"dynamic"`` for kvtier through SGLang's factory, ``"file"``
    for HiCacheFile) and ``extra`` as --hicache-storage-backend-extra-config;
    ``ratios`` / ``kv_source_layers``: each layer's compression ratio and the
    V4.1 layers owning ratio-1/2 storage (default: one C4, one C128 and one SWA-only layer)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    ratios = list(RATIOS if ratios is None else ratios)
    slots = device_pages * page_size  # the host pools hold twice as many (hicache_ratio 2)
    with v4_settings(layout=layout, tp_rank=tp_rank, tp_size=tp_size):
        layout_kwargs = {} if kv_layout is None else {"kv_layout": kv_layout}
        device = DeepSeekV4TokenToKVPool(
            max_num_reqs=4, swa_size=slots, c4_size=page_size, c128_size=page_size, c4_state_pool_size=4,
            c128_state_pool_size=4, page_size=page_size, swa_page_size=page_size, dtype=torch.float8_e4m3fn,
            c4_state_dtype=torch.bfloat16, c128_state_dtype=torch.bfloat16, qk_nope_head_dim=448,
            qk_rope_head_dim=64, indexer_head_dim=128, layer_num=len(ratios), device="cpu", enable_memory_saver=False,
            compression_ratios=ratios, full_size=slots, start_layer=0, end_layer=len(ratios),
            kv_source_layers=list(kv_source_layers), **layout_kwargs,
        )
        allocator = SimpleNamespace(get_kvcache=lambda: device, page_size=page_size,
                                    swa_attn_allocator=SimpleNamespace(alloc=None, free=None))
        params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                                 page_size=page_size)
        saved = assembler.DeepSeekV4PagedHostPool, assembler.DeepSeekV4StateHostPool
        assembler.DeepSeekV4PagedHostPool, assembler.DeepSeekV4StateHostPool = DeepSeekV4PagedHostPool, DeepSeekV4StateHostPool
        try:
            group, ctl = assembler.build_deepseek_v4_hicache_stack(
                params=params, kvcache=device, load_cache_event=threading.Event(), storage_backend=backend,
                model_name=model, storage_backend_extra_config=dict(extra or {}),
            )
        finally:
            assembler.DeepSeekV4PagedHostPool, assembler.DeepSeekV4StateHostPool = saved
    return V4Stack(device, group, ctl, page_size, layout, tp_rank, tp_size)


def hashes(stack: V4Stack, tokens: list[int]) -> list[str]:
    return list(get_storage_hash_str(tokens, None, page_size=stack.page_size))


def tokens(stack: V4Stack, n_pages: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 30000, (n_pages * stack.page_size,), generator=g).tolist()


def _trailing(pool: str) -> bool:
    """Whether SGLang moves ``pool`` as the window's trailing page (the SWA pool and the states derived from it)."""
    return pool == str(PoolName.SWA) or PoolName(pool) in SWA_DERIVED


def _transfers(stack: V4Stack, swa_host: torch.Tensor | None, swa_keys: list[str]) -> list[PoolTransfer]:
    """The pool transfers SGLang's V4 tree gives an operation (module docstring)."""
    names = {e.name for e in stack.group.entries}
    out = [PoolTransfer(name=n, indices_from_pool=PoolName.KV, hit_policy=PoolHitPolicy.ALL_PAGES)
           for n in KV_DERIVED if n in names]
    if PoolName.SWA in names:
        out.append(PoolTransfer(name=PoolName.SWA, host_indices=swa_host, keys=list(swa_keys),
                                hit_policy=PoolHitPolicy.TRAILING_PAGES))
        out += [PoolTransfer(name=n, indices_from_pool=PoolName.SWA, hit_policy=PoolHitPolicy.TRAILING_PAGES)
                for n in SWA_DERIVED if n in names]
    return out


@dataclass
class Backed:
    """A prefix backed up: its tokens, keys, and each pool's page bytes as written."""

    tokens: list[int]
    keys: list[str]
    kv_host: torch.Tensor
    swa_host: torch.Tensor
    pages: dict[str, list[torch.Tensor]]  # pool -> its pages in prefix order (trailing pools: the window)
    completed_tokens: int = 0
    seconds: float = 0.0  # SGLang's backup call alone
    cpu_seconds: float = 0.0  # the CPU time of the thread that made it (time.thread_time)

    @property
    def nbytes(self) -> int:
        """Bytes of every pool's pages of this prefix."""
        return sum(p.numel() for pages in self.pages.values() for p in pages)


def _page_bytes(host: Any, start: int) -> torch.Tensor:
    return host.get_data_page(start, flat=True).contiguous().view(torch.uint8).clone()


def fill_and_backup(stack: V4Stack, n_pages: int, seed: int, *, data_seed: int | None = None) -> Backed:
    """Random bytes (depending on ``data_seed``, default ``seed``, and the page's place) in every pool's
    host pages for an ``n_pages`` prefix, then SGLang's backup of it
    (``HybridCacheController._page_backup``: every sidecar's ``batch_set_v2``,
    then the KV anchor's pages)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import StorageOperation

    ps = stack.page_size
    toks = tokens(stack, n_pages, seed)
    keys = hashes(stack, toks)
    with stack.settings():
        kv_host = stack.group.alloc(n_pages * ps, pool=PoolName.KV)
        swa_host = stack.group.alloc(SWA_WINDOW_PAGES * ps, pool=PoolName.SWA)
        assert kv_host is not None and swa_host is not None, "V4 host pools are full"
        pages: dict[str, list[torch.Tensor]] = {}
        g = torch.Generator().manual_seed(seed if data_seed is None else data_seed)
        for name, host in stack.pools.items():
            starts = swa_host[::ps].tolist() if _trailing(name) else kv_host[::ps].tolist()
            dummy = host.get_dummy_flat_data_page()
            pages[name] = []
            for s in starts:
                data = torch.randint(0, 256, dummy.shape, generator=g, dtype=torch.uint8)
                host.set_from_flat_data_page(int(s), data.view(dummy.dtype))
                pages[name].append(_page_bytes(host, int(s)))
        op = StorageOperation(kv_host, toks, hash_value=keys,
                              pool_transfers=_transfers(stack, swa_host, keys[-SWA_WINDOW_PAGES:]))
        begin, cpu = time.perf_counter(), time.thread_time()
        stack.ctl._page_backup(op)
        seconds, cpu = time.perf_counter() - begin, time.thread_time() - cpu
        done = int(op.completed_tokens)
    return Backed(toks, keys, kv_host, swa_host, pages, done, seconds, cpu)


def release(stack: V4Stack, *held: Backed | Fetched) -> None:
    """Hand the host slots of backed-up or fetched prefixes back to SGLang's host pools."""
    with stack.settings():
        for h in held:
            if h.kv_host is not None and h.kv_host.numel():
                stack.group.free(h.kv_host, pool=PoolName.KV)
            if h.swa_host is not None and h.swa_host.numel():
                stack.group.free(h.swa_host, pool=PoolName.SWA)


@dataclass
class Fetched:
    """What SGLang's prefetch path got: pages its hit query found, KV pages
    that landed, and each pool's page bytes where they land (zeros where not read)."""

    found: int
    landed: int
    pages: dict[str, list[torch.Tensor]]
    kv_host: torch.Tensor | None = None
    swa_host: torch.Tensor | None = None
    seconds: float = 0.0  # SGLang's hit query and page transfer alone
    cpu_seconds: float = 0.0  # the CPU time of the thread that made them (time.thread_time)


def prefetch(stack: V4Stack, toks: list[int]) -> Fetched:
    """SGLang's V4 prefetch path: ``_storage_hit_query`` (``batch_exists_v2``
    over the anchor and every sidecar), host slots for the hit in the KV
    anchor and the SWA window (taken from SGLang's host pool group here,
    where its scheduler takes them), then ``_page_transfer`` (the anchor's pages with
    its KV-derived sidecars, then the SWA window and its states, which SGLang
    reads only when the whole KV prefix landed)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation

    ps = stack.page_size

    class _Handle:
        rid = "req"

    with stack.settings():
        op = PrefetchOperation(_Handle(), toks,  # type: ignore[arg-type]
                               pool_transfers=_transfers(stack, None, ["__placeholder__"] * SWA_WINDOW_PAGES))
        begin, cpu = time.perf_counter(), time.thread_time()
        hit_keys, hit_tokens = stack.ctl._storage_hit_query(op)
        seconds, cpu = time.perf_counter() - begin, time.thread_time() - cpu
        found = hit_tokens // ps
        if not found:
            return Fetched(0, 0, {})
        op.hash_value = hit_keys
        op.storage_hit_count = hit_tokens
        op.host_indices = stack.group.alloc(found * ps, pool=PoolName.KV)
        swa_host = stack.group.alloc(SWA_WINDOW_PAGES * ps, pool=PoolName.SWA)
        for t in op.pool_transfers or []:
            if t.name == PoolName.SWA:
                t.host_indices = swa_host
        # Every landing page starts zeroed: a page that is not read stays visibly unread.
        for name, host in stack.pools.items():
            for s in (swa_host if _trailing(name) else op.host_indices)[::ps].tolist():
                host.set_from_flat_data_page(int(s), torch.zeros_like(host.get_dummy_flat_data_page()))
        begin, cpu_begin = time.perf_counter(), time.thread_time()
        kv_landed = _transfer(stack, op)
        seconds, cpu = seconds + time.perf_counter() - begin, cpu + time.thread_time() - cpu_begin
        pages: dict[str, list[torch.Tensor]] = {}
        for name, host in stack.pools.items():
            starts = (swa_host if _trailing(name) else op.host_indices)[::ps].tolist()
            pages[name] = [_page_bytes(host, int(s)) for s in starts]
    return Fetched(found, kv_landed, pages, op.host_indices, swa_host, seconds, cpu)


def _transfer(stack: V4Stack, op: Any) -> int:
    """SGLang's ``_page_transfer`` for a hybrid operation: the KV prefix (with its
    KV-derived sidecars) and then, only after the whole prefix, the trailing sidecars."""
    from sglang.srt.managers.cache_controller import HiCacheController as Base

    with stack.group.layout_lease():
        kv_completed = Base._page_transfer(stack.ctl, op)
        stack.ctl._page_transfer_sidecar(op, kv_completed)
    return int(kv_completed)


def page_file(stack: V4Stack, root: str, pool: str, key: str) -> str:
    """Where ``pool``'s page under SGLang key ``key`` lies in a file store:
    kvtier's FileStore under ``root`` (``"dynamic"``) or HiCacheFile's ``root``."""
    import os

    backend = stack.backend()
    if hasattr(backend, "namespace"):  # kvtier
        key_pool = backend._pool(PoolName(pool)).key_pool if pool != str(PoolName.KV) else "kv"
        name = backend.namespace.keys([key], pool=key_pool)[0].hex()
        return os.path.join(root, backend.namespace.label(), name[:2], f"{name}.data")
    stored = key if pool == str(PoolName.KV) else f"{key}.{pool}"
    return os.path.join(root, f"{stored}{backend.config_suffix}.bin")


def page_blob(stack: V4Stack, pool: str, key: str) -> bytes:
    """Where ``pool``'s page under SGLang key ``key`` lies in kvtier's Redis store: the blob's Redis key."""
    backend = stack.backend()
    key_pool = backend._pool(PoolName(pool)).key_pool if pool != str(PoolName.KV) else "kv"
    return backend.store.store._blob_key(backend.namespace.keys([key], pool=key_pool)[0], key_pool)


def verdicts(got: Fetched, backed: Backed) -> dict[str, list[str]]:
    """Each pool's landed pages as ``"exact"`` (the page backed up), ``"unread"``
    (still the zeros the prefetch laid down) or ``"WRONG"`` (anything else)."""
    out: dict[str, list[str]] = {}
    for name, pages in got.pages.items():
        want = backed.pages[name]
        out[name] = ["exact" if torch.equal(a, b) else "unread" if not a.any() else "WRONG"
                     for a, b in zip(pages, want[:len(pages)])]
    return out
