"""`KvtierHiCacheStorage`: kvtier's stores as SGLang HiCache's L3 storage backend.

SGLang's dynamic backend factory builds it as ``cls(storage_config, kwargs)``;
the cache controller then registers its host pool (`register_mem_pool_host`)
and, with ``interface_v1`` set, calls `batch_exists`, `batch_get_v1` and
`batch_set_v1` from its prefetch and backup threads, with per-page SHA-256
hex keys that already chain the prefix.

What it adds to a plain byte store:

* every page is sealed (`kvtier.storage.sealed`): its xxh3-64 checksum covers
  the key, so a page whose bytes changed in the store, that is cut short, or
  that was copied in under another key is a miss for that page, and SGLang's
  prefetch stops there: a damaged page shortens the prefix instead of
  handing flipped bytes to the model;
* keys live in an `EngineNamespace` of the model, the TP shard (none for MLA,
  which every rank holds whole), the host pool's dtype, layout and page
  geometry, and the pipeline / context-parallel shard: pages written by
  another model, layout, dtype or shard are never found;
* storage faults (a dead Redis, a full disk, a timeout) are per-page misses
  (`kvtier.storage.SealedPageStore`), never an exception into SGLang's
  threads; a bad configuration fails at attach, naming the option.

The page bytes are what SGLang's host pool gives for one page
(``get_data_page(index)``), so every host-pool layout SGLang has a page copy
for works; the store runs on one kvtier event-loop thread per backend.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvtier.errors import ConfigurationError
from kvtier.logs import get_logger
from kvtier.storage import EngineNamespace, FileStore, SealedPageStore, SealedStoreStatistics, StorageBackend

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

__all__ = ["DEFAULT_FILE_PATH", "OPTIONS", "KvtierHiCacheStorage", "namespace_for"]

log = get_logger(__name__)

DEFAULT_FILE_PATH = "/tmp/kvtier-hicache"
"""Where the file store lives when ``path`` is not given."""

OPTIONS: Mapping[str, str] = {
    "store": "'file' (default), 'redis' or 'mooncake'",
    "path": f"file store directory (default {DEFAULT_FILE_PATH}); each namespace gets a subdirectory",
    "url": "Redis URL (default redis://127.0.0.1:6379/0)",
    "cluster": "true: the Redis URL names a node of a Redis Cluster",
    "prefix": "Redis / Mooncake key prefix (default 'kvtier:sglang:'); the namespace is appended",
    "timeout_s": "seconds a storage batch may take before it is answered with misses (default 10)",
    "model": "the model identity to key pages on (default: SGLang's model name)",
    "mooncake": "keyword arguments of kvtier.storage.MooncakeStore (master_server_addr, metadata_server, ...)",
}
"""The keys of ``--hicache-storage-backend-extra-config`` kvtier reads, besides the factory's own."""

_FACTORY_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})


class KvtierHiCacheStorage(HiCacheStorage):  # type: ignore[misc,unused-ignore]  # Any where sglang is not installed
    """SGLang's ``HiCacheStorage`` over a kvtier store, every page sealed.

    Built by SGLang's factory as ``KvtierHiCacheStorage(storage_config, kwargs)``;
    the store opens when the controller registers its host pool (the pool's
    dtype, layout and page geometry are part of the namespace). Raises
    `ConfigurationError` for an unknown option or a value it cannot use,
    naming it, and when the store cannot be opened.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.options = _parse_options(storage_config.extra_config or {})
        model = self.options.get("model") or storage_config.model_name
        if not model:
            raise ConfigurationError(
                "KvtierHiCacheStorage needs the model's identity to key pages on: SGLang passed no model name; "
                "set \"model\" in --hicache-storage-backend-extra-config"
            )
        self.model = str(model)
        self.store: SealedPageStore | None = None
        self.namespace: EngineNamespace | None = None
        self.page_size = 0
        self.page_nbytes = 0
        self._dtype: torch.dtype | None = None
        self._geometry: dict[str, tuple[Any, str, int, torch.dtype]] = {}
        self._samples_lock = threading.Lock()  # SGLang's prefetch and backup threads add samples
        self._samples: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [],
                                                 "prefetch_bandwidth": [], "backup_bandwidth": []}

    # -- attach --------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool and open the store in this pool's namespace."""
        super().register_mem_pool_host(mem_pool_host)
        if self.store is not None:
            self.store.close()
            self.store = None
        self._geometry.pop(str(PoolName.KV), None)
        host = mem_pool_host
        try:
            dummy = host.get_dummy_flat_data_page()
            host.get_data_page(0, flat=False)
        except Exception as exc:
            raise ConfigurationError(
                f"KvtierHiCacheStorage stores pages through SGLang's page copies (get_data_page / "
                f"set_from_flat_data_page), which {type(host).__name__} with layout "
                f"{getattr(host, 'layout', None)!r} does not have: {exc} (use --hicache-mem-layout "
                f"layer_first, page_first, page_first_direct or page_head)"
            ) from exc
        self.page_size = int(host.page_size)
        self.page_nbytes = dummy.numel() * dummy.element_size()
        self._dtype = dummy.dtype
        self.namespace = namespace_for(self.storage_config, host, model=self.model, page_nbytes=self.page_nbytes)
        options, label = self.options, self.namespace.label()
        self.store = SealedPageStore(
            lambda: _open_store(options, label), self.namespace,
            timeout_s=float(options.get("timeout_s", 10.0)), thread_name=f"kvtier-hicache-{label}",
        )
        log.info("sglang_storage.attached", store=self.store.store.name, namespace=label,
                 layout=getattr(host, "layout", None), page_size=self.page_size, page_nbytes=self.page_nbytes)

    def _require_store(self) -> SealedPageStore:
        if self.store is None:
            raise ConfigurationError("KvtierHiCacheStorage has no host pool yet: SGLang calls register_mem_pool_host first")
        return self.store

    # -- v1: pages straight from and into the registered host pool --------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, are stored whole (the bytes are checked by the get)."""
        return self._require_store().prefix_length(keys) if keys else 0

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Read each page into the host pool at ``host_indices[i * page_size]``;
        for each, whether it landed. A missing, damaged or foreign page, or a
        storage fault, is False and writes nothing into its host page."""
        starts = self._page_starts(keys, host_indices, "batch_get_v1")
        if starts is None:
            return [False] * len(keys)
        begin = time.perf_counter()
        payloads = self._require_store().get(keys, nbytes=self.page_nbytes)
        host, dtype = self.mem_pool_host, self._dtype
        out = [p is not None and _land(host, dtype, start, p) for start, p in zip(starts, payloads)]
        self._sample("prefetch", sum(out), time.perf_counter() - begin)
        return out

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the host pool's page at ``host_indices[i * page_size]`` under each key;
        for each, whether it is stored. A fault is False for the batch."""
        starts = self._page_starts(keys, host_indices, "batch_set_v1")
        if starts is None:
            return [False] * len(keys)
        host = self.mem_pool_host
        begin = time.perf_counter()
        try:
            # flat=False: the page as a (possibly strided) view; sealing copies it once.
            pages = [(k, host.get_data_page(s, flat=False)) for k, s in zip(keys, starts)]
        except Exception as exc:  # noqa: BLE001 - never an exception into SGLang's backup thread
            log.error("sglang_storage.page_copy_failed", call="batch_set_v1", error=f"{type(exc).__name__}: {exc}")
            return [False] * len(keys)
        out = self._require_store().put(pages)
        self._sample("backup", sum(out), time.perf_counter() - begin)
        return out

    def _page_starts(
        self, keys: Sequence[str], host_indices: torch.Tensor | None, call: str, page_size: int | None = None
    ) -> list[int] | None:
        size = self.page_size if page_size is None else page_size
        n = 0 if host_indices is None else int(host_indices.numel())
        if host_indices is None or n != len(keys) * size:
            log.error("sglang_storage.bad_indices", call=call, keys=len(keys), indices=n, page_size=size)
            return None
        return [int(i) for i in host_indices[::size].tolist()] if keys else []

    def _as_page(self, payload: memoryview) -> torch.Tensor:
        assert self._dtype is not None
        return _as_page(payload, self._dtype)

    # -- v2: sidecar pools of hybrid models (SWA, Mamba state, DSA indexer, ...) ---------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take one more of SGLang's host pools (a sidecar), stored under its own tag."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._geometry.pop(str(host_pool_name), None)

    def _pool(self, name: Any) -> tuple[Any, str, int, torch.dtype] | None:
        """(host pool, tag, page bytes, dtype) of a registered pool; None if SGLang registered none by that name."""
        key = str(name)
        if key in self._geometry:
            return self._geometry[key]
        host = getattr(self, "registered_pools", {}).get(name)
        if host is None and key == str(PoolName.KV):
            host = self.mem_pool_host
        if host is None:
            return None
        dummy = host.get_dummy_flat_data_page()
        nbytes = dummy.numel() * dummy.element_size()
        # The tag a sidecar page is sealed under: its pool and that pool's page geometry.
        # (The anchor's own pages keep v1's tag, "kv": the namespace already holds its geometry.)
        if host is self.mem_pool_host and key == str(PoolName.KV):
            tag = "kv"
        else:
            tag = f"{key}|{type(host).__name__}|{getattr(host, 'layout', None)}|{dummy.dtype}|{nbytes}"
        self._geometry[key] = (host, tag, nbytes, dummy.dtype)
        return self._geometry[key]

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest usable prefix over the KV pages and every sidecar pool,
        by each pool's hit policy (``ALL_PAGES``: every page up to the KV hit;
        ``TRAILING_PAGES``: the last ``len(transfer.keys)`` pages before the
        cut), with the prefix lengths every pool can restore. A pool that is not
        registered, or a policy this backend does not serve (``BLOCK_GROUPS``), has no hits."""
        store = self._require_store()
        kv_pages = store.prefix_length(keys) if keys else 0
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            pool = self._pool(transfer.name)
            present = store.exists(keys[:kv_pages], pool=pool[1]) if pool is not None else [False] * kv_pages
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                pool_restorable = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_restorable = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - trailing):n])}
                boundary = max(pool_restorable, default=0)
            else:
                log.warning("sglang_storage.unsupported_policy", pool=str(transfer.name), policy=str(transfer.hit_policy))
                pool_restorable, boundary = set(), 0
            if boundary:
                hit_count[transfer.name] = boundary
            restorable = [n for n in restorable if n in pool_restorable]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages (``keys``) into its pool's host pages (``host_indices``);
        for each pool, whether each page landed."""
        return {t.name: self._transfer(t, write=False) for t in transfers}

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Store each transfer's host pages under its keys; for each pool, whether each page is stored."""
        return {t.name: self._transfer(t, write=True) for t in transfers}

    def _transfer(self, transfer: PoolTransfer, *, write: bool) -> list[bool]:
        keys = list(transfer.keys or [])
        pool = self._pool(transfer.name)
        if pool is None:
            log.error("sglang_storage.unknown_pool", pool=str(transfer.name))
            return [False] * len(keys)
        host, tag, nbytes, dtype = pool
        call = "batch_set_v2" if write else "batch_get_v2"
        starts = self._page_starts(keys, transfer.host_indices, call, int(getattr(host, "page_size", 1) or 1))
        if starts is None:
            return [False] * len(keys)
        store = self._require_store()
        if write:
            try:
                pages = [(k, host.get_data_page(s, flat=False)) for k, s in zip(keys, starts)]
            except Exception as exc:  # noqa: BLE001 - never an exception into SGLang's backup thread
                log.error("sglang_storage.page_copy_failed", call=call, error=f"{type(exc).__name__}: {exc}")
                return [False] * len(keys)
            return store.put(pages, pool=tag)
        payloads = store.get(keys, pool=tag, nbytes=nbytes)
        return [p is not None and _land(host, dtype, s, p) for s, p in zip(starts, payloads)]

    # -- the legacy interface: flat page tensors ----------------------------------

    def exists(self, key: str) -> bool:
        return self._require_store().exists([key])[0]

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        """Each page as a flat tensor (copied into ``target_locations[i]`` when
        given, else a new tensor), or None for a miss of any kind."""
        payloads = self._require_store().get(keys, nbytes=self.page_nbytes)
        out: list[torch.Tensor | None] = []
        for i, payload in enumerate(payloads):
            if payload is None:
                out.append(None)
                continue
            page = self._as_page(payload)
            target = None if target_locations is None else target_locations[i]
            if target is None:
                out.append(page.clone())
            elif target.numel() * target.element_size() != self.page_nbytes:
                log.error("sglang_storage.bad_target", key=keys[i], nbytes=target.numel() * target.element_size())
                out.append(None)
            else:
                target.view(-1).view(torch.uint8).copy_(page.view(torch.uint8))
                out.append(target)
        return out

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None, target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any | None = None, target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> bool:
        """Store each flat page tensor of ``values``; whether all are stored."""
        if values is None or len(values) != len(keys):
            log.error("sglang_storage.bad_values", keys=len(keys), values=None if values is None else len(values))
            return False
        return all(self._require_store().put(list(zip(keys, values))))

    # -- upkeep -----------------------------------------------------------------------

    def clear(self) -> bool:  # type: ignore[override,unused-ignore]  # SGLang's base returns None; its file backend a bool
        """Remove every page of this backend's namespace (its directory or key prefix)."""
        return self.store.clear() if self.store is not None else False

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` with the samples since the last call
        (pages and GB/s per batch), or None when SGLang's metrics are off."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._samples_lock:
            samples = {name: values[:] for name, values in self._samples.items()}
            for values in self._samples.values():
                values.clear()
        return StorageMetrics(**samples)

    def statistics(self) -> SealedStoreStatistics | None:
        """kvtier's counters: hits, misses, pages whose seal broke (by rule), faults."""
        return self.store.statistics() if self.store is not None else None

    def close(self) -> None:
        """Close the store and its loop thread (SGLang calls this on detach)."""
        if self.store is not None:
            self.store.close()

    def _sample(self, kind: str, pages: int, seconds: float) -> None:
        if self.storage_config.enable_storage_metrics and pages:
            with self._samples_lock:
                self._samples[f"{kind}_pgs"].append(pages)
                self._samples[f"{kind}_bandwidth"].append(pages * self.page_nbytes / max(seconds, 1e-9) / 1e9)

    def __repr__(self) -> str:
        return f"<KvtierHiCacheStorage model={self.model!r} {self.store!r}>"


def _as_page(payload: memoryview, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype)


def _land(host: Any, dtype: torch.dtype | None, start: int, payload: memoryview) -> bool:
    """Write one page into ``host`` at slot ``start``; False (logged) if SGLang's page copy refuses it."""
    try:
        assert dtype is not None
        host.set_from_flat_data_page(start, _as_page(payload, dtype))
    except Exception as exc:  # noqa: BLE001 - a page that cannot land is a miss, not a crash of SGLang's thread
        log.warning("sglang_storage.land_failed", start=start, error=f"{type(exc).__name__}: {exc}")
        return False
    return True


def namespace_for(config: HiCacheStorageConfig, host: Any, *, model: str, page_nbytes: int) -> EngineNamespace:
    """The namespace of ``host``'s pages for this SGLang rank.

    MLA caches (``config.is_mla_model``: every TP rank holds the whole page)
    are keyed without the TP rank, so the ranks share pages; other models key
    each TP shard apart. Pipeline and context-parallel shards are always apart.
    """
    replicated = bool(config.is_mla_model)
    extra = [f"pool={type(host).__name__}", f"page_bytes={page_nbytes}"]
    if config.pp_size > 1:
        extra.append(f"pp={config.pp_rank}/{config.pp_size}")
    if config.attn_cp_size > 1:
        extra.append(f"cp={config.attn_cp_rank}/{config.attn_cp_size}")
    if getattr(config, "dcp_size", 1) > 1:
        extra.append(f"dcp={config.dcp_rank}/{config.dcp_size}")
    return EngineNamespace(
        engine="sglang-hicache-v1",
        model=model,
        page_size=int(host.page_size),
        dtype=str(host.dtype).removeprefix("torch."),
        layout=str(getattr(host, "layout", "")),
        tp_rank=0 if replicated else int(config.tp_rank),
        tp_size=1 if replicated else int(config.tp_size),
        extra=tuple(extra),
    )


def _parse_options(extra: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(extra) - _FACTORY_KEYS - set(OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"KvtierHiCacheStorage does not know extra-config key(s) {unknown}; it reads {sorted(OPTIONS)}"
        )
    options = {k: v for k, v in extra.items() if k in OPTIONS}
    store = options.setdefault("store", "file")
    if store not in ("file", "redis", "mooncake"):
        raise ConfigurationError(f"KvtierHiCacheStorage store must be 'file', 'redis' or 'mooncake'; got {store!r}")
    timeout = options.get("timeout_s", 10.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigurationError(f"KvtierHiCacheStorage timeout_s must be a number of seconds > 0; got {timeout!r}")
    if "mooncake" in options and not isinstance(options["mooncake"], dict):
        raise ConfigurationError(f"KvtierHiCacheStorage mooncake must be an object of MooncakeStore arguments; got {options['mooncake']!r}")
    return options


def _open_store(options: Mapping[str, Any], label: str) -> StorageBackend:
    """The store the options name, scoped to the namespace ``label`` (so `clear` clears only it)."""
    store = options["store"]
    if store == "file":
        return FileStore(os.path.join(str(options.get("path", DEFAULT_FILE_PATH)), label))
    prefix = f"{options.get('prefix', 'kvtier:sglang:')}{label}:"
    if store == "redis":
        from kvtier.storage import RedisStore

        redis: StorageBackend = RedisStore(
            str(options.get("url", "redis://127.0.0.1:6379/0")), cluster=bool(options.get("cluster", False)),
            prefix=prefix, timeout_s=float(options.get("timeout_s", 10.0)),
        )
        return redis
    from kvtier.storage import MooncakeStore

    mooncake: StorageBackend = MooncakeStore(**{"prefix": prefix.replace(":", "/"), **options.get("mooncake", {})})
    return mooncake
