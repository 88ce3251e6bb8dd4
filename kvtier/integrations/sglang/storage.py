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
* every pool's pages have one `kvtier.storage.PageIdentity` (`pool_identity`):
  the model, the pool's class, layout and page geometry, its true element
  format (SGLang holds fp8 e4m3 and e5m2 alike as ``uint8``: the format comes
  from SGLang's --kv-cache-dtype, or the ``kv_cache_dtype`` key), its TP shard
  decided per pool as SGLang backs pools up (`pool_shard`: an MLA model's KV
  is shared by the ranks, its Mamba state is not), and the pipeline /
  context-parallel shard. Keys derive from it (unchanged where the identity
  is) and each sealed page's header carries its tag: pages written under
  another identity are never found, and one copied in anyway is a miss
  counted by rule ``identity``;
* a store admission policy (``store_admission``, `kvtier.policies`) may
  skip pages SGLang backs up: ``"frequency"`` writes a page only on its
  ``admission_sightings``-th backup, so a prompt seen once costs no store
  write; skips are counted by reason in `statistics`;
* storage faults (a dead Redis, a full disk, a timeout, a short answer) are
  per-page misses (`kvtier.storage.SealedPageStore`), and so is every other
  failure inside a call SGLang makes (bad indices, a page copy that raises,
  a call before attach): nothing raises into SGLang's threads, each call
  answers its neutral value (a miss, False, 0), logs an event and counts it
  (`HiCacheStorageStatistics`: a hit is a page that landed; misses, refusals
  and failures apart). A bad configuration fails at attach, naming the key
  and the value (a near miss of a known key names it), and so does a store
  that fails a probe page put and read back.

The page bytes are what SGLang's host pool gives for one page
(``get_data_page(index)``), so every host-pool layout SGLang has a page copy
for works; the store runs on one kvtier event-loop thread per backend.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvtier.errors import ConfigurationError
from kvtier.integrations.options import RENAMED, VOCABULARY, renamed_options
from kvtier.logs import get_logger
from kvtier.policies import CountedAdmission, check_admission_options, make_admission
from kvtier.storage import (
    EngineNamespace,
    FileStore,
    SealedPageStore,
    SealedStoreStatistics,
    StorageBackend,
    parse_size,
)
from kvtier.storage.errors import StorageError
from kvtier.storage.identity import PageIdentity, PlaneFormat, PoolFormat, Shard, element_format

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

__all__ = [
    "DEFAULT_FILE_PATH",
    "DEFAULT_REDIS_URL",
    "DSV4_KV_LAYOUTS",
    "KV_CACHE_DTYPES",
    "OPTIONS",
    "SCHEME",
    "HiCacheStorageStatistics",
    "KvtierHiCacheStorage",
    "dsv4_kv_layout",
    "kv_element_format",
    "namespace_for",
    "pool_identity",
    "pool_shard",
    "sidecar_key_pool",
]

log = get_logger(__name__)

DEFAULT_FILE_PATH = "/tmp/kvtier-hicache"
"""Where the file store lives when ``store_path`` is not given."""
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

OPTIONS: Mapping[str, str] = {
    "store": "'file' (default; 'redis' where redis_url is given), 'redis' or 'mooncake'",
    "store_path": f"file store directory (default {DEFAULT_FILE_PATH}); each namespace gets a subdirectory",
    "store_max_bytes": "bound each namespace's file store directory (bytes, or a size such as '200GiB'): least "
                       "recently read pages are evicted past it (default: no bound)",
    "redis_url": "Redis URL (default redis://127.0.0.1:6379/0)",
    "cluster": "true: the Redis URL names a node of a Redis Cluster",
    "prefix": "Redis / Mooncake key prefix (default 'kvtier:sglang:'); the namespace is appended",
    "timeout_s": "seconds a storage batch may take before it is answered with misses (default 10)",
    "model_identity": "the model identity to key pages on (default: SGLang's model name)",
    "dsv4_kv_layout": "DeepSeek V4: the device KV layout SGLang picked ('v4', 'v41' or 'v41_new'); default: SGLang's "
                      "own choice in this process (select_dsv4_kv_layout: SGLANG_DSV4_KV_LAYOUT and the GPU)",
    "kv_cache_dtype": "the fp8 format of a KV cache SGLang holds as uint8: 'fp8_e4m3' or 'fp8_e5m2' (as given to "
                      "--kv-cache-dtype), or a torch name ('float8_e4m3fn', 'float8_e4m3fnuz', 'float8_e5m2', "
                      "'float8_e5m2fnuz'); default: SGLang's own --kv-cache-dtype",
    "mooncake": "keyword arguments of kvtier.storage.MooncakeStore (master_server_addr, metadata_server, ...)",
    "store_admission": "which pages SGLang backs up are written: 'all' (default), 'frequency' (a page on its "
                       "admission_sightings-th backup), or 'module:factory' (an engine's own StoreAdmission)",
    "admission_sightings": "store_admission 'frequency': backups of a page before it is written (int >= 1, default 2)",
    "admission_window": "store_admission 'frequency': most recently backed-up pages counted (int >= 1, default 65536)",
}
"""The keys of ``--hicache-storage-backend-extra-config`` kvtier reads, besides the factory's own
(names and units: `kvtier.integrations.options.VOCABULARY`; old names: `RENAMED`)."""
if set(OPTIONS) != {name for name, option in VOCABULARY.items() if "sglang" in option.engines}:  # pragma: no cover
    raise ImportError("kvtier's SGLang options and kvtier.integrations.options.VOCABULARY disagree")

_FACTORY_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})
# Names other configurations give a kvtier option (SGLang's file backend and its
# storage config, kvtier's vLLM options), named in the refusal of the key.
_OTHER_BACKENDS_KEYS: Mapping[str, str] = {
    "file_storage_path": "store_path", "model_name": "model_identity", "redis": "redis_url",
}

_F = TypeVar("_F", bound=Callable[..., Any])
_READS = frozenset({"batch_get_v1", "batch_get_v2", "batch_get", "get"})
_WRITES = frozenset({"batch_set_v1", "batch_set_v2", "batch_set", "set"})


@dataclass(frozen=True, slots=True)
class HiCacheStorageStatistics(SealedStoreStatistics):
    """`KvtierHiCacheStorage.statistics`: the store's counters as SGLang saw them.

    Every page a read asked for is counted once: ``get_hits`` (it landed in
    SGLang's host pool, or was copied into SGLang's target tensor), ``get_misses``
    (not stored), ``get_refused`` (stored, refused by its seal: damage, a torn
    page, another identity; by rule in ``broken``) or ``get_failed`` (a store
    fault, a page read whole that could not land, or a call that failed before
    the store was asked). ``put_failed`` likewise counts pages that a fault or
    a failed call left unwritten. ``call_errors``: calls answered with their
    neutral value after an error (bad indices, an unknown pool, a page copy
    that raised, ...), by SGLang method name.
    """

    call_errors: dict[str, int] = field(default_factory=dict)


def _never_raises(neutral: Callable[[Mapping[str, Any]], Any]) -> Callable[[_F], _F]:
    """SGLang calls the backend from its prefetch and backup threads: an
    exception there ends a request's prefetch or backup with a traceback
    instead of a miss. The decorated method answers ``neutral(arguments)``
    instead (an answer of the shape SGLang expects: misses, False, 0), logs
    ``sglang_storage.call_failed`` and counts it (`KvtierHiCacheStorage.statistics`)."""

    def wrap(method: _F) -> _F:
        signature = inspect.signature(method)
        call = method.__name__

        @functools.wraps(method)
        def guarded(self: KvtierHiCacheStorage, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the one boundary between SGLang's threads and kvtier
                try:
                    arguments: Mapping[str, Any] = signature.bind(self, *args, **kwargs).arguments
                    answer = neutral(arguments)
                    pages = _pages_of(arguments)
                except Exception:  # noqa: BLE001 - arguments SGLang never sends: the emptiest answer
                    answer, pages = neutral({}), 0
                self._failed(call, pages, f"{type(exc).__name__}: {exc}")
                return answer

        return guarded  # type: ignore[return-value]

    return wrap


def _count(items: Any) -> int:
    return len(items) if isinstance(items, Sized) and not isinstance(items, (str, bytes)) else 0


def _pages_of(arguments: Mapping[str, Any]) -> int:
    """The pages a call asked for: its keys, or its transfers' keys."""
    if "keys" in arguments:
        return _count(arguments["keys"])
    if "key" in arguments:
        return 1
    transfers = arguments.get("transfers")
    return sum(_count(getattr(t, "keys", None)) for t in transfers) if isinstance(transfers, list) else 0


def _no_pages(arguments: Mapping[str, Any], answer: Any) -> list[Any]:
    return [answer] * _count(arguments.get("keys"))


def _no_pool_pages(arguments: Mapping[str, Any]) -> dict[str, list[bool]]:
    transfers = arguments.get("transfers")
    if not isinstance(transfers, list):
        return {}
    return {t.name: [False] * _count(getattr(t, "keys", None)) for t in transfers if hasattr(t, "name")}


class KvtierHiCacheStorage(HiCacheStorage):  # type: ignore[misc,unused-ignore]  # Any where sglang is not installed
    """SGLang's ``HiCacheStorage`` over a kvtier store, every page sealed.

    Built by SGLang's factory as ``KvtierHiCacheStorage(storage_config, kwargs)``;
    the store opens, and is probed, when the controller registers its host
    pool (that pool's identity is the namespace). Raises
    `ConfigurationError` for an unknown option or a value it cannot use,
    naming the key and the value, and from `register_mem_pool_host` when the
    store cannot be opened or fails the probe.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.options = _parse_options(storage_config.extra_config or {})
        model = self.options.get("model_identity") or storage_config.model_name
        if not model:
            raise ConfigurationError(
                "KvtierHiCacheStorage needs the model's identity to key pages on: SGLang passed no model name; "
                "set \"model_identity\" in --hicache-storage-backend-extra-config"
            )
        self.model = str(model)
        # Asked once per page of a backup, keyed (key pool, SGLang's key), tier "store"; SGLang's
        # backup thread is the only caller, the lock keeps a second one (an engine's own) safe.
        self.admission = CountedAdmission(make_admission(
            self.options["store_admission"], sightings=self.options.get("admission_sightings"),
            window=self.options.get("admission_window"), tier="store",
        ))
        self._admission_lock = threading.Lock()
        self.store: SealedPageStore | None = None
        self.namespace: EngineNamespace | None = None
        self.identity: PageIdentity | None = None  # the KV pages' (the anchor's)
        self.page_size = 0
        self.page_nbytes = 0
        self._dtype: torch.dtype | None = None
        self._kv_tag = b""
        self._pools: dict[str, _Pool] = {}
        self._samples_lock = threading.Lock()  # SGLang's prefetch and backup threads add samples
        # What SGLang's calls met beyond the store's own counts (`statistics`), under _counts_lock.
        self._counts_lock = threading.Lock()
        self._call_errors: dict[str, int] = {}
        self._not_landed = 0  # pages the store handed back whole that did not reach SGLang
        self._reads_failed = 0  # pages of reads that failed before the store was asked
        self._writes_failed = 0  # the same for writes
        self._samples: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [],
                                                 "prefetch_bandwidth": [], "backup_bandwidth": []}

    # -- attach --------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool, open the store in this pool's namespace and
        probe it (one small sealed page put, read back and checked).

        Raises `ConfigurationError` for a host pool without page copies, a
        ``uint8`` KV pool whose fp8 format SGLang's settings do not say (and
        ``kv_cache_dtype`` does not), and a store that cannot be opened or
        fails the probe, naming the options that chose it. After a refusal
        the backend holds no store.
        """
        super().register_mem_pool_host(mem_pool_host)
        if self.store is not None:
            self.store.close()
            self.store = None
        self.identity = self.namespace = None
        self._pools.clear()  # every pool's keys are in this anchor's namespace
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
        page_nbytes = dummy.numel() * dummy.element_size()
        identity = pool_identity(self.storage_config, host, str(PoolName.KV), model=self.model,
                                 page_nbytes=page_nbytes, kv_cache_dtype=self.options.get("kv_cache_dtype"))
        namespace = identity.engine_namespace()
        options, label = self.options, namespace.label()
        try:
            store = SealedPageStore(
                lambda: _open_store(options, label), namespace,
                timeout_s=float(options["timeout_s"]), thread_name=f"kvtier-hicache-{label}",
            )
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"KvtierHiCacheStorage could not open {_store_options(options)}: {exc.__cause__ or exc}"
            ) from exc
        try:
            store.probe()
        except StorageError as exc:
            store.close()
            raise ConfigurationError(
                f"KvtierHiCacheStorage cannot use {_store_options(options)}: writing and reading back a probe "
                f"page failed ({exc})"
            ) from exc
        self.page_size = int(host.page_size)
        self.page_nbytes = page_nbytes
        self._dtype = dummy.dtype
        self.identity, self.namespace, self._kv_tag = identity, namespace, identity.tag(str(PoolName.KV))
        try:
            for name in list(getattr(self, "registered_pools", {})):
                self._pool(name)  # pools SGLang registered first: an unexplained format fails the attach here
        except ConfigurationError:
            store.close()
            self.identity = self.namespace = None
            raise
        self.store = store
        log.info("sglang_storage.attached", store=store.store.name, namespace=label,
                 layout=getattr(host, "layout", None), page_size=self.page_size, page_nbytes=self.page_nbytes)

    def _require_store(self) -> SealedPageStore:
        if self.store is None:
            raise ConfigurationError("KvtierHiCacheStorage has no host pool yet: SGLang calls register_mem_pool_host first")
        return self.store

    # -- v1: pages straight from and into the registered host pool --------------

    @_never_raises(lambda a: 0)
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, are stored whole (the bytes are checked by the get)."""
        return self._require_store().prefix_length(keys, nbytes=self.page_nbytes) if keys else 0

    @_never_raises(lambda a: _no_pages(a, False))
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Read each page into the host pool at ``host_indices[i * page_size]``;
        for each, whether it landed. A missing, damaged or foreign page, or a
        storage fault, is False and writes nothing into its host page."""
        store = self._require_store()
        starts = self._page_starts(keys, host_indices, "batch_get_v1")
        if starts is None:
            return [False] * len(keys)
        begin = time.perf_counter()
        payloads = store.get(keys, nbytes=self.page_nbytes, tag=self._kv_tag)
        host, dtype = self.mem_pool_host, self._dtype
        out = self._landed([p is not None and _land(host, dtype, start, p) for start, p in zip(starts, payloads)],
                           payloads)
        self._sample("prefetch", sum(out), sum(out) * self.page_nbytes, time.perf_counter() - begin)
        return out

    @_never_raises(lambda a: _no_pages(a, False))
    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the host pool's page at ``host_indices[i * page_size]`` under each key;
        for each, whether it is stored. A fault is False for the batch."""
        store = self._require_store()
        starts = self._page_starts(keys, host_indices, "batch_set_v1")
        if starts is None:
            return [False] * len(keys)
        host = self.mem_pool_host
        begin = time.perf_counter()
        admitted = self._admitted("kv", keys)
        try:
            # flat=False: the page as a (possibly strided) view; sealing copies it once.
            pages = [(k, host.get_data_page(s, flat=False)) for k, s, ok in zip(keys, starts, admitted) if ok]
        except Exception as exc:  # noqa: BLE001 - never an exception into SGLang's backup thread
            log.error("sglang_storage.page_copy_failed", call="batch_set_v1", error=f"{type(exc).__name__}: {exc}")
            self._count_failed("batch_set_v1", len(keys))
            return [False] * len(keys)
        put = store.put(pages, tag=self._kv_tag) if pages else []
        self._sample("backup", sum(put), sum(put) * self.page_nbytes, time.perf_counter() - begin)
        return _with_skips(admitted, put)

    def _admitted(self, key_pool: str, keys: Sequence[str]) -> list[bool]:
        """Whether the store admission policy writes each page of ``key_pool`` (counted)."""
        admission = self.admission
        if admission.stores_all:
            return [True] * len(keys)
        with self._admission_lock:
            return [admission.admit((key_pool, k), "store") for k in keys]

    def _page_starts(
        self, keys: Sequence[str], host_indices: torch.Tensor | None, call: str, page_size: int | None = None
    ) -> list[int] | None:
        size = self.page_size if page_size is None else page_size
        n = int(host_indices.numel()) if isinstance(host_indices, torch.Tensor) else -1
        if not isinstance(host_indices, torch.Tensor) or n != len(keys) * size or (n and host_indices.dim() != 1):
            log.error("sglang_storage.bad_indices", call=call, keys=len(keys), indices=n, page_size=size)
            self._count_failed(call, len(keys))
            return None
        return [int(i) for i in host_indices[::size].tolist()] if keys else []

    def _landed(self, landed: list[bool], payloads: Sequence[memoryview | None]) -> list[bool]:
        """``landed``, after counting the pages the store handed back that did not land."""
        lost = sum(p is not None for p in payloads) - sum(landed)
        if lost:
            with self._counts_lock:
                self._not_landed += lost
        return landed

    def _count_failed(self, call: str, pages: int) -> None:
        """Count one call that failed (answered with its neutral value) and its pages."""
        with self._counts_lock:
            self._call_errors[call] = self._call_errors.get(call, 0) + 1
            if call in _READS:
                self._reads_failed += pages
            elif call in _WRITES:
                self._writes_failed += pages

    def _failed(self, call: str, pages: int, error: str) -> None:
        log.error("sglang_storage.call_failed", call=call, pages=pages, error=error)
        self._count_failed(call, pages)

    def _as_page(self, payload: memoryview) -> torch.Tensor:
        assert self._dtype is not None
        return _as_page(payload, self._dtype)

    # -- v2: sidecar pools of hybrid models (SWA, Mamba state, DSA indexer, ...) ---------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take one more of SGLang's host pools (a sidecar), stored under its own
        identity: its pool, geometry, true element format and, where SGLang
        backs it up per TP rank, the rank. Raises `ConfigurationError` as
        `register_mem_pool_host` does for a ``uint8`` KV pool whose fp8 format is unknown."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._pools.pop(str(host_pool_name), None)
        if self.identity is not None:
            try:
                self._pool(host_pool_name)  # an unexplained format fails the attach, not a later call
            except ConfigurationError:
                self.close()  # the attach fails: leave nothing open behind it
                self.store = None
                raise

    def _pool(self, name: Any) -> _Pool | None:
        """A registered pool's storage form; None if SGLang registered none by that name."""
        key = str(name)
        pool = self._pools.get(key)
        if pool is not None:
            return pool
        host = getattr(self, "registered_pools", {}).get(name)
        if host is None and key == str(PoolName.KV):
            host = self.mem_pool_host
        if host is None or self.identity is None:
            return None
        try:
            dummy = host.get_dummy_flat_data_page()
            nbytes = dummy.numel() * dummy.element_size()
            host.get_data_page(0, flat=False)
        except Exception as exc:
            raise ConfigurationError(
                f"KvtierHiCacheStorage cannot store SGLang host pool {key!r} ({type(host).__name__}, layout "
                f"{getattr(host, 'layout', None)!r}): it has no page copies (get_data_page / "
                f"get_dummy_flat_data_page: {type(exc).__name__}: {exc})"
            ) from exc
        if host is self.mem_pool_host and key == str(PoolName.KV):
            # The anchor's own pages keep v1's key pool, "kv": the namespace holds their identity.
            pool = _Pool(host, "kv", self._kv_tag, nbytes, dummy.dtype)
        else:
            identity = pool_identity(self.storage_config, host, key, model=self.model, page_nbytes=nbytes,
                                     kv_cache_dtype=self.options.get("kv_cache_dtype"),
                                     dsv4_layout=self.options.get("dsv4_kv_layout"))
            pool = _Pool(host, sidecar_key_pool(self.identity, identity, dummy.dtype, nbytes), identity.tag(key),
                         nbytes, dummy.dtype)
        self._pools[key] = pool
        return pool

    @_never_raises(lambda a: PoolTransferResult(0, {}, []))
    def batch_exists_v2(
        self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest usable prefix over the KV pages and every sidecar pool,
        by each pool's hit policy (``ALL_PAGES``: every page up to the KV hit;
        ``TRAILING_PAGES``: the last ``len(transfer.keys)`` pages before the
        cut), with the prefix lengths every pool can restore. A pool that is not
        registered has no hits (and gates the prefix as its policy says).

        ``BLOCK_GROUPS`` pools never gate the KV hit (SGLang's contract for that
        policy): each reports, as its own verdict, the pages its leading
        complete groups cover: its keys (``transfer.keys``) taken
        ``group_pages`` at a time from the span start, each whole group stored
        covering ``block_pages`` FULL pages, capped at the KV hit. A group
        geometry that is not two positive integers gives that pool no hits."""
        store = self._require_store()
        kv_pages = store.prefix_length(keys, nbytes=self.page_nbytes) if keys else 0
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        transfers = pool_transfers or []
        # Every sidecar's pages up to the KV hit, looked up in one store call.
        lookups: dict[int, tuple[_Pool, list[str]]] = {}
        for i, transfer in enumerate(transfers if kv_pages else []):
            pool = self._pool(transfer.name)
            if pool is None:
                continue
            if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                group_keys = self._block_groups_keys(transfer, kv_pages)
                if group_keys:
                    lookups[i] = pool, group_keys
            else:
                lookups[i] = pool, keys[:kv_pages]
        # Each pool's pages looked up by their size (`SealedPageStore.exists_pools`): a stat a page on a FileStore.
        found = dict(zip(lookups, store.exists_pools(
            [(pool.key_pool, k, pool.nbytes) for pool, k in lookups.values()]))) if lookups else {}
        for i, transfer in enumerate(transfers):
            if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS and i in found:
                covered = _block_groups_covered(transfer, found[i], kv_pages)
                if covered:
                    hit_count[transfer.name] = covered
        for i, transfer in enumerate(transfers):
            if not restorable:
                break
            if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                continue
            present = found.get(i, [False] * kv_pages)
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

    def _block_groups_keys(self, transfer: PoolTransfer, kv_pages: int) -> list[str]:
        """The keys of a ``BLOCK_GROUPS`` pool's groups that can cover pages up to
        the KV hit (none for a group geometry that is not two positive integers)."""
        block, group = transfer.block_pages, transfer.group_pages
        keys = list(transfer.keys or [])
        if not keys or not kv_pages:
            return []
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (block, group)):
            log.warning("sglang_storage.unsupported_policy", pool=str(transfer.name),
                        policy=f"{transfer.hit_policy} with block_pages={block!r}, group_pages={group!r}")
            return []
        wanted = min(len(keys) // group, -(-kv_pages // block))  # groups past the KV hit cover nothing
        return keys[:wanted * group]

    @_never_raises(_no_pool_pages)
    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages (``keys``) into its pool's host pages (``host_indices``);
        for each pool, whether each page landed. A pool whose transfer fails
        is all False; the others go on. Every pool's pages are read in one store call."""
        return self._transfers(transfers, write=False)

    @_never_raises(_no_pool_pages)
    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Store each transfer's host pages under its keys; for each pool, whether
        each page is stored. Every pool's pages are written in one store call."""
        return self._transfers(transfers, write=True)

    def _transfers(self, transfers: list[PoolTransfer], *, write: bool) -> dict[str, list[bool]]:
        """A v2 call: each pool planned on its own (a pool that fails is all
        False, logged, counted), then one store call for every planned pool."""
        call = "batch_set_v2" if write else "batch_get_v2"
        store = self._require_store()
        begin = time.perf_counter()
        out: dict[str, list[bool]] = {}
        planned: list[_Planned] = []
        for transfer in transfers:
            keys = list(transfer.keys or [])
            try:
                plan = self._plan(transfer, keys, call, write=write)
            except Exception as exc:  # noqa: BLE001 - one pool's failure is that pool's misses
                self._failed(call, len(keys), f"pool {str(transfer.name)!r}: {type(exc).__name__}: {exc}")
                plan = None
            if plan is None:
                out[transfer.name] = [False] * len(keys)
            else:
                planned.append(plan)
        moved: list[tuple[_Pool, int]] = []  # each pool's pages stored or landed, for `get_stats`
        if write:
            written = store.put_pools([(p.pool.key_pool, p.items, p.pool.tag) for p in planned])
            for plan, put in zip(planned, written):
                out[plan.name] = _with_skips(plan.admitted, put)
                moved.append((plan.pool, sum(put)))
        else:
            read = store.get_pools([(p.pool.key_pool, p.keys, p.pool.nbytes, p.pool.tag) for p in planned])
            for plan, payloads in zip(planned, read):
                host, dtype = plan.pool.host, plan.pool.dtype
                out[plan.name] = landed = self._landed(
                    [p is not None and _land(host, dtype, s, p) for s, p in zip(plan.starts, payloads)], payloads)
                moved.append((plan.pool, sum(landed)))
        self._sample("backup" if write else "prefetch", sum(n for _, n in moved),
                     sum(n * pool.nbytes for pool, n in moved), time.perf_counter() - begin)
        return out

    def _plan(self, transfer: PoolTransfer, keys: list[str], call: str, *, write: bool) -> _Planned | None:
        """One pool's part of a v2 call, ready for the store; None (logged, counted) if it cannot go."""
        pool = self._pool(transfer.name)
        if pool is None:
            log.error("sglang_storage.unknown_pool", pool=str(transfer.name))
            self._count_failed(call, len(keys))
            return None
        host = pool.host
        starts = self._page_starts(keys, transfer.host_indices, call, int(getattr(host, "page_size", 1) or 1))
        if starts is None:
            return None
        if not write:
            return _Planned(transfer.name, pool, keys, starts, [], [])
        admitted = self._admitted(pool.key_pool, keys)
        try:
            items = [(k, host.get_data_page(s, flat=False)) for k, s, ok in zip(keys, starts, admitted) if ok]
        except Exception as exc:  # noqa: BLE001 - never an exception into SGLang's backup thread
            log.error("sglang_storage.page_copy_failed", call=call, error=f"{type(exc).__name__}: {exc}")
            self._count_failed(call, len(keys))
            return None
        return _Planned(transfer.name, pool, keys, starts, admitted, items)

    # -- the legacy interface: flat page tensors ----------------------------------

    @_never_raises(lambda a: False)
    def exists(self, key: str) -> bool:
        return self._require_store().exists([key])[0]

    @_never_raises(lambda a: None)
    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    @_never_raises(lambda a: _no_pages(a, None))
    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        """Each page as a flat tensor (copied into ``target_locations[i]`` when
        given, else a new tensor), or None for a miss of any kind."""
        if target_locations is not None and len(target_locations) != len(keys):
            log.error("sglang_storage.bad_values", keys=len(keys), values=len(target_locations))
            self._count_failed("batch_get", len(keys))
            return [None] * len(keys)
        begin = time.perf_counter()
        payloads = self._require_store().get(keys, nbytes=self.page_nbytes, tag=self._kv_tag)
        out: list[torch.Tensor | None] = []
        errors: list[str] = []
        for i, payload in enumerate(payloads):
            target = None if target_locations is None else target_locations[i]
            out.append(None if payload is None else self._hand_over(keys[i], payload, target, errors))
        if errors:
            log.warning("sglang_storage.target_copy_failed", pages=len(errors), error=errors[0])
        self._landed([t is not None for t in out], payloads)
        landed = sum(t is not None for t in out)
        self._sample("prefetch", landed, landed * self.page_nbytes, time.perf_counter() - begin)
        return out

    def _hand_over(self, key: str, payload: memoryview, target: Any, errors: list[str]) -> torch.Tensor | None:
        """A page read whole as SGLang's legacy get wants it: copied into
        ``target`` (a tensor of one page's bytes), or a new tensor; None if it
        cannot be (a copy that raised is added to ``errors``)."""
        try:
            page = self._as_page(payload)
            if target is None:
                return page.clone()
            nbytes = target.numel() * target.element_size()
            if nbytes != self.page_nbytes:
                log.error("sglang_storage.bad_target", key=key, nbytes=nbytes)
                return None
            target.view(-1).view(torch.uint8).copy_(page.view(torch.uint8))
            return target  # type: ignore[no-any-return]
        except Exception as exc:  # noqa: BLE001 - a page that cannot be handed over is a miss
            errors.append(f"page {key!r:.80}: {type(exc).__name__}: {exc}")
            return None

    @_never_raises(lambda a: False)
    def set(self, key: str, value: Any | None = None, target_location: Any | None = None, target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    @_never_raises(lambda a: False)
    def batch_set(
        self, keys: list[str], values: Any | None = None, target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> bool:
        """Store each flat page tensor of ``values``; whether all are stored
        (or skipped by the store admission policy, see `_with_skips`)."""
        if values is None or len(values) != len(keys):
            log.error("sglang_storage.bad_values", keys=len(keys), values=-1 if values is None else len(values))
            self._count_failed("batch_set", len(keys))
            return False
        begin = time.perf_counter()
        admitted = self._admitted("kv", keys)
        pages = [(k, v) for k, v, ok in zip(keys, values, admitted) if ok]
        put = self._require_store().put(pages, tag=self._kv_tag) if pages else []
        self._sample("backup", sum(put), sum(put) * self.page_nbytes, time.perf_counter() - begin)
        return all(put)

    # -- upkeep -----------------------------------------------------------------------

    @_never_raises(lambda a: False)
    def clear(self) -> bool:  # type: ignore[override,unused-ignore]  # SGLang's base returns None; its file backend a bool
        """Remove every page of this backend's namespace (its directory or key prefix)."""
        return self._require_store().clear()

    @_never_raises(lambda a: None)
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

    def statistics(self) -> HiCacheStorageStatistics:
        """kvtier's counters (`HiCacheStorageStatistics`): pages that landed,
        misses, refusals by rule and failures apart, store faults, failed
        calls, and pages the store admission policy skipped (by reason).
        Before a host pool is registered, only failed calls are counted."""
        decisions = self.admission.statistics()
        skipped = {reason: n for (tier, reason), n in decisions.skipped.items() if tier == "store"}
        s = self.store.statistics() if self.store is not None else _NO_STORE
        with self._counts_lock:
            lost, reads, writes = self._not_landed, self._reads_failed, self._writes_failed
            errors = dict(self._call_errors)
        fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
        fields.update(
            get_pages=s.get_pages + reads, get_hits=s.get_hits - lost, get_failed=s.get_failed + lost + reads,
            put_pages=s.put_pages + writes, put_failed=s.put_failed + writes,
            put_skipped=sum(skipped.values()), put_skipped_by_reason=skipped,
        )
        return HiCacheStorageStatistics(**fields, call_errors=errors)

    def close(self) -> None:
        """Close the store and its loop thread (SGLang calls this on detach)."""
        if self.store is not None:
            self.store.close()

    def _sample(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        """One call's sample for `get_stats`: the pages it moved (every pool's) and,
        when they hold bytes, its GB/s (V4's anchor pages have none: no rate)."""
        if self.storage_config.enable_storage_metrics and pages:
            with self._samples_lock:
                self._samples[f"{kind}_pgs"].append(pages)
                if nbytes:
                    self._samples[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def __repr__(self) -> str:
        return f"<KvtierHiCacheStorage model={self.model!r} {self.store!r}>"


_NO_STORE = SealedStoreStatistics(
    exists_pages=0, exists_found=0, get_pages=0, get_hits=0, get_misses=0, put_pages=0, put_failed=0,
    bytes_read=0, bytes_written=0, faults=0, broken={},
)


def _block_groups_covered(transfer: PoolTransfer, present: list[bool], kv_pages: int) -> int:
    """FULL pages a ``BLOCK_GROUPS`` pool's leading complete groups cover (at most
    ``kv_pages``), from whether each of its looked-up group keys is stored."""
    block, group = int(transfer.block_pages), int(transfer.group_pages)
    wanted, groups = len(present) // group, 0
    while groups < wanted and all(present[groups * group:(groups + 1) * group]):
        groups += 1
    return min(groups * block, kv_pages)


def _with_skips(admitted: list[bool], put: list[bool]) -> list[bool]:
    """The answer to SGLang for each page: the put's result, True for a page
    the store admission policy skipped.

    True, because SGLang's controller reads a False from a backup as a
    failure: ``_page_backup`` logs "pages failed" and abandons the rest of
    that backup (the batches after it are never offered), and the hybrid
    controller's backup-skip rank zeroes the operation's completed tokens.
    A True is only counted in its backed-up-tokens metric; nothing in SGLang
    records a page as stored from it (a prefetch asks `batch_exists`, which
    answers from the store). So a skip, a decision rather than a fault, keeps
    the rest of the backup going and stays a miss for readers.
    """
    if all(admitted):
        return put
    landed = iter(put)
    return [next(landed) if ok else True for ok in admitted]


def _as_page(payload: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A stored page's bytes as a flat ``dtype`` tensor over them (no copy).

    A page may have no bytes (SGLang's DeepSeek V4 anchor, `LogicalHostPool`,
    has 0-byte pages: DESIGN lesson 24); ``torch.frombuffer`` refuses an
    empty buffer, so that page is an empty tensor."""
    if not payload.nbytes:
        empty = _EMPTY_PAGES.get(dtype)
        if empty is None:  # one a dtype (SGLang's page copies only read it): a V4 prefix has one a page
            empty = _EMPTY_PAGES[dtype] = torch.empty(0, dtype=torch.uint8).view(dtype)
        return empty
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype)


_EMPTY_PAGES: dict[torch.dtype, torch.Tensor] = {}


def _land(host: Any, dtype: torch.dtype | None, start: int, payload: memoryview) -> bool:
    """Write one page into ``host`` at slot ``start``; False (logged) if SGLang's page copy refuses it."""
    try:
        assert dtype is not None
        host.set_from_flat_data_page(start, _as_page(payload, dtype))
    except Exception as exc:  # noqa: BLE001 - a page that cannot land is a miss, not a crash of SGLang's thread
        log.warning("sglang_storage.land_failed", start=start, error=f"{type(exc).__name__}: {exc}")
        return False
    return True


SCHEME = "sglang-hicache-v1"
"""The key scheme of SGLang's page keys (per-page SHA-256 hex, chained), as stored by kvtier."""

_FP8 = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
KV_CACHE_DTYPES: Mapping[str, str] = {
    "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", **{name: name for name in _FP8},
}
"""The ``kv_cache_dtype`` values kvtier takes, each with the element format it
means (SGLang's spellings go through SGLang's platform rule: on ROCm every fp8
cache is SGLang's ``fp8_dtype``)."""

# SGLang's --kv-cache-dtype values that leave a KV cache held as uint8, with the
# format SGLang gives it (mem_cache/kv_cache_dtype.py, configure_kv_cache_dtype):
# "auto" reaches fp8 only through a checkpoint whose quantisation asks FP8 KV,
# which SGLang then holds as e4m3; mxfp8 is e4m3 too.
_SGLANG_FP8: Mapping[str, str] = {
    "auto": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "mxfp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
}
_DRAFT_POOLS = frozenset({"draft", "draft_swa", "draft_indexer"})


@dataclass(frozen=True, slots=True)
class _Planned:
    """One pool's part of a v2 call, planned: its keys, host page starts and,
    for a write, which pages the admission policy let through and their page views."""

    name: Any
    pool: _Pool
    keys: list[str]
    starts: list[int]
    admitted: list[bool]
    items: list[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class _Pool:
    """A registered host pool as stored: the pool string its keys and seals
    use, its identity tag, its page bytes and the dtype SGLang's page copies take."""

    host: Any
    key_pool: str
    tag: bytes
    nbytes: int
    dtype: torch.dtype


def _sglang_kv_cache_dtype(pool: str) -> tuple[str | None, str]:
    """SGLang's --kv-cache-dtype in this process (its ``model`` config bag;
    for a draft pool --speculative-draft-kv-cache-dtype where set), and the
    flag's name; None where SGLang published no settings in this process."""
    try:
        from sglang.srt.runtime_context import get_model, get_spec

        if pool in _DRAFT_POOLS:
            draft = get_spec().speculative_draft_kv_cache_dtype
            if isinstance(draft, str) and draft != "auto":
                return draft, "--speculative-draft-kv-cache-dtype"
        value = get_model().kv_cache_dtype
    except Exception:  # noqa: BLE001 - not published (a backend built outside SGLang's server)
        return None, "--kv-cache-dtype"
    return (value if isinstance(value, str) else None), "--kv-cache-dtype"


def _platform_fp8(fmt: str) -> str:
    """SGLang's fp8 rule for this platform: on ROCm every fp8 cache is its ``fp8_dtype``."""
    from sglang.srt.utils import is_hip

    if not is_hip():
        return fmt
    from sglang.kernels.ops.quantization.fp8_kernel import fp8_dtype

    return element_format(fp8_dtype)


def kv_element_format(host: Any, pool: str, *, kv_cache_dtype: str | None = None) -> str:
    """The true element format of ``host``'s KV bytes.

    SGLang keeps both fp8 KV formats (e4m3, e5m2) as ``uint8`` in its MHA and
    MLA host pools, so for those the format comes from SGLang's own settings
    (--kv-cache-dtype, as published in this process) or ``kv_cache_dtype``
    (the extra-config key); any other pool's dtype says it (another host
    pool class's ``uint8`` is that class's own packing, and its class is part
    of the identity). Raises `ConfigurationError` when a ``uint8`` KV pool's
    format is said by neither, or when the two disagree, naming both.
    """
    dtype = getattr(host, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigurationError(f"SGLang host pool {pool!r} ({type(host).__name__}) has no torch dtype; got {dtype!r}")
    if dtype != torch.uint8 or type(host) not in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):
        return element_format(dtype)
    given = None if kv_cache_dtype is None else KV_CACHE_DTYPES[kv_cache_dtype]
    if given is not None and kv_cache_dtype in ("fp8_e4m3", "fp8_e5m2"):
        given = _platform_fp8(given)
    setting, flag = _sglang_kv_cache_dtype(pool)
    said = _SGLANG_FP8.get(setting) if setting is not None else None
    if said is not None:
        said = _platform_fp8(said)
    if given is not None and said is not None and given != said:
        raise ConfigurationError(
            f"KvtierHiCacheStorage extra-config 'kv_cache_dtype'={kv_cache_dtype!r} ({given}) contradicts "
            f"SGLang's {flag} {setting!r} ({said}) for host pool {pool!r}; pass the value given to SGLang"
        )
    fmt = given or said
    if fmt is None:
        where = f"SGLang's {flag} is {setting!r}" if setting is not None else "SGLang published no --kv-cache-dtype in this process"
        raise ConfigurationError(
            f"KvtierHiCacheStorage: host pool {pool!r} ({type(host).__name__}) holds its KV as uint8, an fp8 cache "
            f"whose format (e4m3 or e5m2) kvtier cannot tell ({where}); set \"kv_cache_dtype\": \"fp8_e4m3\" or "
            f"\"fp8_e5m2\" (the value given to --kv-cache-dtype) in --hicache-storage-backend-extra-config"
        )
    return fmt


def pool_shard(config: HiCacheStorageConfig, pool: str, host: Any) -> Shard | None:
    """This rank's shard of ``pool``, or None where every TP rank holds it whole.

    Decided per pool, as SGLang decides what to back up per rank: an MLA
    model's caches (``config.is_mla_model``, which SGLang sets for every
    rank-replicated cache) are written by one rank and read by all, except
    the Mamba state, which is TP-sharded even where the MLA KV is replicated
    (``HybridCacheController.should_backup`` backs it up on every rank), and
    an MHA host pool (a draft's, whose heads are split across ranks).
    Every pool of any other model is sharded by the TP rank.
    """
    replicated = bool(config.is_mla_model) and pool != str(PoolName.MAMBA) and not isinstance(host, MHATokenToKVPoolHost)
    if replicated or int(config.tp_size) <= 1:
        return None
    return Shard(int(config.tp_rank), int(config.tp_size))


def pool_identity(
    config: HiCacheStorageConfig, host: Any, pool: str, *, model: str, page_nbytes: int,
    kv_cache_dtype: str | None = None, dsv4_layout: str | None = None,
) -> PageIdentity:
    """The `PageIdentity` of ``host``'s pages (SGLang pool ``pool``) for this rank.

    One pool: its class, layout, page size, layers, the page's bytes and true
    element format (`kv_element_format`), its shard (`pool_shard`), and the
    pipeline / context-parallel shard of this process; for a DeepSeek V4 paged
    pool the row format of its pages too (`dsv4_kv_layout`; ``dsv4_layout``:
    the extra-config ``dsv4_kv_layout``). Raises `ConfigurationError` as those do.
    """
    fmt = kv_element_format(host, pool, kv_cache_dtype=kv_cache_dtype)
    if type(host).__name__ == "MambaPoolHost":
        # Pages are every state tensor's bytes, flattened: name what they hold.
        fmt = f"conv={element_format(host.conv_dtype)};temporal={element_format(host.temporal_dtype)}"
    size = getattr(torch, fmt).itemsize if isinstance(getattr(torch, fmt, None), torch.dtype) else 1
    extra = [f"pool={type(host).__name__}", f"page_bytes={page_nbytes}"]
    if _is_dsv4_paged(host):
        extra.append(f"dsv4_kv={dsv4_kv_layout(host, pool, given=dsv4_layout)}")
    if config.pp_size > 1:
        extra.append(f"pp={config.pp_rank}/{config.pp_size}")
    if config.attn_cp_size > 1:
        extra.append(f"cp={config.attn_cp_rank}/{config.attn_cp_size}")
    if getattr(config, "dcp_size", 1) > 1:
        extra.append(f"dcp={config.dcp_rank}/{config.dcp_size}")
    record = PoolFormat(
        name=pool, kind=type(host).__name__, layout=str(getattr(host, "layout", "") or "none"),
        rows=int(host.page_size), layers=int(getattr(host, "layer_num", 0) or 0),
        planes=(PlaneFormat((page_nbytes // size,), fmt, size),), shard=pool_shard(config, pool, host),
    )
    return PageIdentity(model=model, scheme=SCHEME, pools=(record,), extra=tuple(extra))


def namespace_for(
    config: HiCacheStorageConfig, host: Any, *, model: str, page_nbytes: int, kv_cache_dtype: str | None = None,
) -> EngineNamespace:
    """The namespace of ``host``'s KV pages for this SGLang rank: the
    `PageIdentity.engine_namespace` of `pool_identity` (pool ``"kv"``).

    MLA caches (every TP rank holds the whole page) are keyed without the TP
    rank, so the ranks share pages; other models key each TP shard apart.
    Pipeline and context-parallel shards are always apart. The element format
    is the true one (e4m3 and e5m2 fp8 caches apart, though both are ``uint8``).
    """
    return pool_identity(config, host, str(PoolName.KV), model=model, page_nbytes=page_nbytes,
                         kv_cache_dtype=kv_cache_dtype).engine_namespace()


def sidecar_key_pool(anchor: PageIdentity, sidecar: PageIdentity, dtype: torch.dtype, nbytes: int) -> str:
    """The pool string a sidecar's page keys (and seals) use in the anchor's
    namespace: the pool, its class, layout, page dtype and bytes (as before
    identities, so unchanged pools keep their keys), then the true element
    format where the dtype does not say it and the pool's shard where the
    anchor's namespace does not carry it (a Mamba pool of an MLA model)."""
    record = sidecar.anchor
    (plane,) = record.planes
    parts = [record.name, record.kind, record.layout, str(dtype), str(nbytes)]
    if plane.format != element_format(dtype) and record.kind != "MambaPoolHost":
        parts.append(f"format={plane.format}")
    shard, anchor_shard = record.shard, anchor.anchor.shard
    if shard is not None and shard != anchor_shard:
        parts.append(f"tp={shard.rank}/{shard.world}")
    parts += [e for e in sidecar.extra if e.startswith("dsv4_kv=")]  # V4 row formats of equal page sizes apart
    return "|".join(parts)


DSV4_KV_LAYOUTS = ("v4", "v41", "v41_new")
"""SGLang's DeepSeek V4 main-cache layouts (its ``KVLayout``: V4, V41, V41_NEW), the ``dsv4_kv_layout`` values."""


def _is_dsv4_paged(host: Any) -> bool:
    try:
        from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool
    except ImportError:  # an SGLang without DeepSeek V4
        return False
    return isinstance(host, DeepSeekV4PagedHostPool)


def _sglang_dsv4_selection() -> tuple[tuple[str, str | None] | None, str]:
    """SGLang's own choice of the V4 layout in this process (``select_dsv4_kv_layout``,
    as its KV cache configurator calls it), or None and why it cannot be made here."""
    try:
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import select_dsv4_kv_layout

        layout, option = select_dsv4_kv_layout()
    except Exception as exc:  # noqa: BLE001 - SGLang asserts its GPU requirements
        return None, f"{type(exc).__name__}: {exc}"
    return (str(layout.value), option), ""


def dsv4_kv_layout(host: Any, pool: str, *, given: str | None = None) -> str:
    """The row format of a DeepSeek V4 paged host pool's pages, as kvtier keys them.

    SGLang lays V4 pages out by hardware (``select_dsv4_kv_layout``): V4
    (448 fp8 nope + 64 bf16 rope + scales, 584 bytes a token), V41 (512 fp8,
    a page's data rows then its scale rows) or V41_NEW (the same 528 bytes a
    token, each token's scales after its data): V41 and V41_NEW pages have
    the same size in the SWA, C4 and indexer pools (C128's pad apart) and
    differ in where each byte is, so a page of one read as the other is
    wrong bytes. The answer is the main layout,
    with SGLang's compressed-cache option (SGLANG_DSV4_COMPRESSED_KV_LAYOUT)
    where set, e.g. ``"v41_new"`` or ``"v41+compressed=fp4"``.

    ``given`` (extra-config ``dsv4_kv_layout``) or SGLang's own choice in
    this process says it; raises `ConfigurationError` naming the pool when
    neither can (SGLang's choice fails here and nothing is given), when the
    two disagree, or when the SWA pool's geometry is not that layout's.
    """
    selected, why = _sglang_dsv4_selection()
    said, option = selected if selected is not None else (None, None)
    if given is not None and said is not None and given != said:
        raise ConfigurationError(
            f"KvtierHiCacheStorage extra-config 'dsv4_kv_layout'={given!r} contradicts SGLang's own choice "
            f"{said!r} in this process (select_dsv4_kv_layout) for host pool {pool!r}; give the layout SGLang uses"
        )
    layout = given or said
    if layout is None:
        raise ConfigurationError(
            f"KvtierHiCacheStorage cannot key DeepSeek V4 host pool {pool!r}: its page row format is SGLang's V4 KV "
            f"layout, which SGLang's select_dsv4_kv_layout cannot tell in this process ({why}); set "
            f"\"dsv4_kv_layout\": one of {list(DSV4_KV_LAYOUTS)} in --hicache-storage-backend-extra-config"
        )
    if pool == str(PoolName.SWA):
        from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

        want = KVLayout(layout).page_bytes(int(host.slot_page_size))
        if int(host.item_bytes) != want or bool(host.page_aligned_only) != (layout != "v4"):
            raise ConfigurationError(
                f"KvtierHiCacheStorage: DeepSeek V4 host pool {pool!r} holds {host.item_bytes}-byte rows "
                f"(page_aligned_only={host.page_aligned_only}), not SGLang's {layout!r} layout ({want}-byte rows); "
                f"set \"dsv4_kv_layout\" to the layout SGLang built the cache with"
            )
    return layout if option in (None, "auto") else f"{layout}+compressed={option}"


def _refuse(key: str, value: Any, rule: str) -> ConfigurationError:
    return ConfigurationError(
        f"KvtierHiCacheStorage extra-config {key!r} must be {rule}; got {value!r}"
    )


def _parse_options(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The extra-config keys kvtier reads, each type-checked: a value it
    cannot use raises `ConfigurationError` naming the key and the value."""
    if not isinstance(extra, Mapping):
        raise ConfigurationError(f"KvtierHiCacheStorage extra-config must be a JSON object; got {extra!r}")
    unknown = sorted(set(extra) - _FACTORY_KEYS - set(OPTIONS) - set(RENAMED["sglang"]), key=str)
    if unknown:
        hints = [f"{_near_key(key)!r} for {key!r}" for key in unknown if _near_key(key) is not None]
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        nested = [k for k in unknown if isinstance(k, str) and k.lower().replace("-", "").replace("_", "") in ("kvtier", "kvtiers")]
        if nested:
            hint += f" (kvtier's options go at the top level, beside 'backend_name', not under {nested[0]!r})"
        raise ConfigurationError(
            f"KvtierHiCacheStorage does not know extra-config key(s) {unknown}{hint}; it reads {sorted(OPTIONS)}"
        )
    options = {k: v for k, v in renamed_options(extra, "sglang", "KvtierHiCacheStorage extra-config").items()
               if k in OPTIONS}
    store = options.setdefault("store", "redis" if "redis_url" in options else "file")
    if store not in ("file", "redis", "mooncake"):
        raise ConfigurationError(f"KvtierHiCacheStorage store must be 'file', 'redis' or 'mooncake'; got {store!r}")
    timeout = options.setdefault("timeout_s", 10.0)
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
            or not 0 < timeout <= threading.TIMEOUT_MAX):
        raise ConfigurationError(
            f"KvtierHiCacheStorage timeout_s must be a number of seconds > 0 (finite, at most "
            f"{threading.TIMEOUT_MAX:g}); got {timeout!r}"
        )
    for key in ("store_path", "redis_url", "prefix", "model_identity"):
        value = options.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise _refuse(key, value, "a non-empty string")
    if "cluster" in options and not isinstance(options["cluster"], bool):
        raise _refuse("cluster", options["cluster"], "true or false (a JSON boolean, not a string)")
    if "cluster" in options and store != "redis":
        raise _refuse("cluster", options["cluster"], f"given only with store 'redis' (store is {store!r})")
    if store != "redis" and "redis_url" in options:
        raise _refuse("redis_url", options["redis_url"], f"given only with store 'redis' (store is {store!r})")
    if store != "file" and "store_path" in options:
        raise _refuse("store_path", options["store_path"], f"given only with store 'file' (store is {store!r})")
    if "store_max_bytes" in options:
        if store != "file":
            raise _refuse("store_max_bytes", options["store_max_bytes"],
                          f"given only with store 'file' (store is {store!r})")
        options["store_max_bytes"] = parse_size(options["store_max_bytes"],
                                                "KvtierHiCacheStorage extra-config 'store_max_bytes'")
    prefix = options.get("prefix")
    if prefix is not None and ("{" in prefix or "}" in prefix):
        raise _refuse("prefix", prefix, "a string without braces (they would change Redis Cluster hash tags)")
    url = options.get("redis_url")
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        raise _refuse("redis_url", url, "a Redis URL (redis://, rediss:// or unix://)")
    path = options.get("store_path")
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise _refuse("store_path", path, "a directory (or a path to create one at); it is a file")
    if "mooncake" in options and not isinstance(options["mooncake"], dict):
        raise ConfigurationError(f"KvtierHiCacheStorage mooncake must be an object of MooncakeStore arguments; got {options['mooncake']!r}")
    if "mooncake" in options and store != "mooncake":
        raise _refuse("mooncake", options["mooncake"], f"given only with store 'mooncake' (store is {store!r})")
    dsv4 = options.get("dsv4_kv_layout")
    if dsv4 is not None and dsv4 not in DSV4_KV_LAYOUTS:
        raise _refuse("dsv4_kv_layout", dsv4, f"one of {list(DSV4_KV_LAYOUTS)} (SGLang's DeepSeek V4 KV layouts)")
    fmt = options.get("kv_cache_dtype")
    if fmt is not None and fmt not in KV_CACHE_DTYPES:
        raise _refuse("kv_cache_dtype", fmt, f"one of {sorted(KV_CACHE_DTYPES)} (SGLang's --kv-cache-dtype)")
    admission = options.setdefault("store_admission", "all")
    try:
        check_admission_options(admission, options.get("admission_sightings"), options.get("admission_window"))
    except ConfigurationError as exc:
        raise ConfigurationError(f"KvtierHiCacheStorage extra-config: {exc}") from None
    return options


def _near_key(key: Any) -> str | None:
    """The known key an unknown one is a near miss of (case, ``-`` for ``_``,
    a typo, another backend's name for the same option), or None."""
    if not isinstance(key, str):
        return None
    known = sorted(set(OPTIONS) | _FACTORY_KEYS)
    folded = key.strip().lower().replace("-", "_")
    if folded in known:
        return folded
    if folded in _OTHER_BACKENDS_KEYS:
        return _OTHER_BACKENDS_KEYS[folded]
    if folded in RENAMED["sglang"]:  # an old name in another case: "Path", "URL"
        return RENAMED["sglang"][folded]
    renamed = RENAMED["sglang"]
    close = difflib.get_close_matches(folded, known + sorted(renamed), n=1, cutoff=0.75)
    return renamed.get(close[0], close[0]) if close else None


def _store_options(options: Mapping[str, Any]) -> str:
    """The options that name the store, as an operator wrote them (for an error message)."""
    store = options["store"]
    if store == "file":
        return f"store 'file', 'store_path'={options.get('store_path', DEFAULT_FILE_PATH)!r}"
    if store == "redis":
        return (f"store 'redis', 'redis_url'={options.get('redis_url', DEFAULT_REDIS_URL)!r}, "
                f"'cluster'={options.get('cluster', False)!r}")
    return f"store 'mooncake', 'mooncake'={options.get('mooncake', {})!r}"


def _open_store(options: Mapping[str, Any], label: str) -> StorageBackend:
    """The store the options name, scoped to the namespace ``label`` (so `clear` clears only it)."""
    store = options["store"]
    if store == "file":
        # Opened on the SealedPageStore's own loop thread, which serves this store alone:
        # the file I/O runs there, one thread round trip less for each of SGLang's calls.
        return FileStore(os.path.join(str(options.get("store_path", DEFAULT_FILE_PATH)), label),
                         max_bytes=options.get("store_max_bytes"), io_thread=False)
    prefix = f"{options.get('prefix', 'kvtier:sglang:')}{label}:"
    if store == "redis":
        from kvtier.storage import RedisStore

        redis: StorageBackend = RedisStore(
            options.get("redis_url", DEFAULT_REDIS_URL), cluster=options.get("cluster", False),
            prefix=prefix, timeout_s=float(options["timeout_s"]),
        )
        return redis
    from kvtier.storage import MooncakeStore

    mooncake: StorageBackend = MooncakeStore(**{"prefix": prefix.replace(":", "/"), **options.get("mooncake", {})})
    return mooncake
