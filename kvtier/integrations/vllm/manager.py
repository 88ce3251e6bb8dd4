"""The scheduler side: which vLLM blocks kvtier holds, and where.

`KvtierOffloadingManager` runs in vLLM's scheduler (a different process from
the worker in vLLM's multiprocess modes), so it shares no memory with the
worker: it picks the host block ids itself and names them in the specs it
hands out. The worker then writes exactly those kvtier host pages
(``backup(..., host_indices=...)``). One host block is one kvtier host page
(``page_size=1``, one vLLM block each).

Each offload key (vLLM's block hash + group index) is in one of two states:
*storing* (a store job is writing it) and *ready*. Both are hits: a load of
a storing block names the host page the store is writing, and the worker
runs it after that store (it orders a page's reads after its last write).
Each host block handed to a store gets a new *life* number, named in the
store's spec and in every load of it; the worker loads a page only when
its last successful store wrote that life, so a load whose store failed
(or never reached the worker) fails and vLLM recomputes the block, instead
of reading the page's previous bytes. Which ready block goes first when the
host tier is full is the eviction policy's choice (`kvtier.policies`: LRU by
default, or segmented LRU); a block is evicted only when it is ready and no
load reads it. Which offered blocks are stored at all is the store admission
policy's (every one by default, or after a number of offers): a block it skips
is neither backed up nor written through, and vLLM recomputes it when it
comes back. With a store configured,
a key missing on the host is looked up in the store; a hit is loaded by the
worker from the store, through a staging pool, without taking a host block
here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from kvtier.errors import ConfigurationError
from kvtier.policies import CountedAdmission, HostEviction, StoreAdmission, StoreAll, make_eviction

__all__ = ["KvtierBlocks", "KvtierOffloadingManager", "StoreLookup"]


class KvtierBlocks(LoadStoreSpec):  # type: ignore[misc,unused-ignore]
    """Where a job's blocks are on kvtier's side, in the job's key order.

    ``host_block_ids[i]`` is the host page of block ``i``, or -1 when block
    ``i`` is read from the store under ``storage_keys[i]``. ``lives[i]``: the
    life of host page ``i`` that a store writes, or that a load must find
    there (see the module docstring; -1 for a block read from the store,
    None when the scheduler side names none). For a store job,
    ``storage_keys`` (when a store is configured) are the keys to write
    through under. ``offload_keys``: vLLM's keys of a load's blocks, so that
    the scheduler side can drop a block whose load kvtier refused. Sent from
    the scheduler to the worker, so plain data only.
    """

    def __init__(
        self, host_block_ids: list[int], storage_keys: list[bytes] | None = None,
        offload_keys: list[bytes] | None = None, lives: list[int] | None = None,
    ) -> None:
        self.host_block_ids: npt.NDArray[np.int32] = np.array(host_block_ids, dtype=np.int32)
        for name, keys in (("storage", storage_keys), ("offload", offload_keys), ("life", lives)):
            if keys is not None and len(keys) != len(host_block_ids):  # kvtier's manager builds these: an invariant
                raise ValueError(f"{len(keys)} {name} keys for {len(host_block_ids)} blocks; they pair one to one")
        self.storage_keys = storage_keys
        self.offload_keys = offload_keys
        self.lives = lives

    def __repr__(self) -> str:
        from_store = int((self.host_block_ids < 0).sum())
        return f"<KvtierBlocks host={self.host_block_ids.tolist()} from_store={from_store}>"


class StoreLookup:
    """Whether the store holds a key, asked synchronously from vLLM's scheduler.

    ``exists`` is a callable taking the keys and returning one bool each (the
    spec wires it to a store on its own event loop thread). A key found once
    is remembered (stores are written, not rewritten, under a key); a miss
    is asked again next time, since another engine may write it meanwhile.

    ``shards`` (tensor / pipeline parallel engines): a block's storage key to
    the keys of every worker's shard (`StorageKeys.shards`). A block is a hit
    only when every shard is stored, so the prefix vLLM loads is the shortest
    any worker has; asking here, where vLLM's scheduler asks, needs no
    exchange between the workers. None: one worker, the block's key is its
    shard's.
    """

    def __init__(
        self, exists: Any, keys: Any, shards: Callable[[bytes], list[bytes]] | None = None,
        close: Callable[[], None] | None = None,
    ) -> None:
        self._exists = exists
        self._close = close
        self._keys = keys
        self._shards = shards
        self._found: dict[bytes, None] = {}
        self.lookups = 0
        self.errors = 0

    def storage_key(self, offload_key: bytes) -> bytes:
        key: bytes = self._keys(offload_key)
        return key

    def shard_keys(self, offload_key: bytes) -> list[bytes]:
        """The keys a block is stored under: one per worker, in rank order."""
        key = self.storage_key(offload_key)
        return [key] if self._shards is None else self._shards(key)

    def contains(self, offload_key: bytes) -> bool:
        key = self.storage_key(offload_key)
        if key in self._found:
            return True
        self.lookups += 1
        asked = [key] if self._shards is None else self._shards(key)
        try:
            answers = list(self._exists(asked))
        except Exception:
            self.errors += 1  # a store that cannot answer is a miss: vLLM computes the block
            return False
        hit = len(answers) == len(asked) and all(answers)
        if hit:
            self._found[key] = None
            if len(self._found) > 1 << 20:
                self._found.pop(next(iter(self._found)))
        return hit

    def forget(self, offload_key: bytes) -> None:
        self._found.pop(self.storage_key(offload_key), None)

    def close(self) -> None:
        """Release what answers the lookups (the spec's store client and its thread); idempotent."""
        close, self._close = self._close, None
        if close is not None:
            close()


@dataclass(eq=False, slots=True)
class _Block:
    host: int
    life: int
    ready: bool = False
    readers: int = 0


@dataclass(eq=False)
class _Counts:
    lookups: int = 0
    host_hits: int = 0
    in_flight_hits: int = 0  # host hits on blocks whose store had not completed yet
    store_hits: int = 0
    stored: int = 0
    evicted: int = 0
    store_refused: int = 0
    refused: int = 0
    loads: dict[str, int] = field(default_factory=lambda: {"host": 0, "store": 0})


class KvtierOffloadingManager(OffloadingManager):  # type: ignore[misc,unused-ignore]
    """vLLM's `OffloadingManager` over ``num_blocks`` host blocks of kvtier.

    ``store``: a `StoreLookup` when a store is configured, else None.
    ``admission``: the `StoreAdmission` asked before a block is backed up
    (tier ``"host"``) and, with a store, before it is written through
    (``"store"``); default `StoreAll`. ``eviction``: ``"lru"``, ``"slru"`` or
    a `HostEviction`; it is told every resident block, every use (a load, a
    re-offer of a held block, vLLM's ``touch``) and every drop.
    """

    def __init__(
        self, num_blocks: int, *, store: StoreLookup | None = None, admission: StoreAdmission | None = None,
        eviction: str | HostEviction = "lru", zero_counts: dict[str, int] | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigurationError(f"the host tier needs at least one block; got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._store = store
        self.admission = CountedAdmission(admission if admission is not None else StoreAll())
        self.eviction: HostEviction = make_eviction(eviction, num_blocks) if isinstance(eviction, str) else eviction
        self._blocks: dict[bytes, _Block] = {}  # resident blocks; their order is the eviction policy's
        self._skips_reported: dict[str, int] = {}  # admission skips already handed to vLLM's stats
        # Blocks of _blocks that are ready and read by no load: what eviction may take.
        self._idle = 0
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._loading_from_store: dict[bytes, int] = {}
        # Keys whose load kvtier refused (changed bytes, a vanished stored
        # block): not offered from the store again, so vLLM computes them.
        self._refused: dict[bytes, None] = {}
        self._draining: dict[bytes, _Block] = {}  # dropped blocks whose loads have not completed
        self._lives = 0  # the last life handed to a store (never reset: an old life never matches again)
        self.counts = _Counts()
        # The workers' counts since vLLM last asked for stats (kvtier.integrations.vllm.metrics).
        self._worker_counts: dict[str, int] = {}
        # Every count this engine can report, handed to vLLM at 0 with the first stats (metrics.zero_counts).
        self._zero_counts: dict[str, int] = dict(zero_counts or {})

    # -- lookups and loads -------------------------------------------------------

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        self.counts.lookups += 1
        block = self._blocks.get(key)
        if block is not None:
            # Storing counts too: the worker runs the load after the store,
            # and fails it (vLLM recomputes) if the store did not land.
            self.counts.host_hits += 1
            self.counts.in_flight_hits += not block.ready
            return LookupResult.HIT
        if block is None and self._store is not None and key not in self._refused and self._store.contains(key):
            self.counts.store_hits += 1
            return LookupResult.HIT
        return LookupResult.MISS

    def prepare_load(self, keys: Collection[bytes], req_context: ReqContext) -> KvtierBlocks:
        host: list[int] = []
        storage: list[bytes] = []
        lives: list[int] = []
        for key in keys:
            block = self._blocks.get(key)
            if block is not None:
                self._idle -= block.ready and not block.readers
                block.readers += 1
                self.eviction.access(key)
                host.append(block.host)
                lives.append(block.life)
                storage.append(b"")
                self.counts.loads["host"] += 1
            elif self._store is not None:
                # A store hit: the worker reads it into its staging pool.
                self._loading_from_store[key] = self._loading_from_store.get(key, 0) + 1
                host.append(-1)
                lives.append(-1)
                storage.append(self._store.storage_key(key))
                self.counts.loads["store"] += 1
            else:  # vLLM broke its contract (load only what lookup() found): a bug, not user input
                raise KeyError(f"block {key.hex()} is not held by kvtier; vLLM loads only blocks lookup() found")
        return KvtierBlocks(host, storage if self._store is not None else None, offload_keys=list(keys), lives=lives)

    def touch(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        for key in keys:
            if key in self._blocks:
                self.eviction.access(key)

    def complete_load(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        for key in keys:
            block = self._blocks.get(key) or self._draining.get(key)
            if block is not None and block.readers > 0:
                block.readers -= 1
                if not block.readers and block.ready and self._blocks.get(key) is block:
                    self._idle += 1
                if not block.readers and self._draining.pop(key, None) is block:
                    self._free.append(block.host)
                continue
            n = self._loading_from_store.get(key, 0)
            if n > 1:
                self._loading_from_store[key] = n - 1
            elif n == 1:
                del self._loading_from_store[key]

    def refuse(self, keys: Collection[bytes]) -> None:
        """Drop blocks whose load did not land: vLLM recomputes them, and a
        later store of them writes a fresh host copy."""
        for key in keys:
            self.counts.refused += 1
            block = self._blocks.pop(key, None)
            if block is not None:
                self.eviction.remove(key)
                self._idle -= block.ready and not block.readers
                if block.readers:
                    self._draining[key] = block
                else:
                    self._free.append(block.host)
            self._refused[key] = None
            if len(self._refused) > 1 << 16:
                self._refused.pop(next(iter(self._refused)))

    # -- stores ------------------------------------------------------------------

    def prepare_store(self, keys: Collection[bytes], req_context: ReqContext) -> PrepareStoreOutput | None:
        offered = list(dict.fromkeys(keys))
        candidates = [key for key in offered if key not in self._blocks and key not in self._draining]
        short = len(candidates) - len(self._free)
        if short > 0 and self._idle < short:
            # vLLM offers these blocks again next step: asked before any
            # admission, so that a refused offer is not counted as a sighting.
            self.counts.store_refused += 1
            return None
        for key in offered:
            if key in self._blocks:
                self.eviction.access(key)  # a request computed this block again: a use of the host copy
        admission = self.admission
        new = [key for key in candidates if admission.admit(key, "host")]
        evicted = self._make_room(len(new))
        if evicted is None:  # pragma: no cover - _evictable() said there was room
            raise RuntimeError("kvtier's host tier found fewer evictable blocks than it counted")
        host = []
        lives = []
        for key in new:
            self._lives += 1
            block = _Block(self._free.pop(), self._lives)
            self._blocks[key] = block
            self.eviction.insert(key)
            host.append(block.host)
            lives.append(block.life)
        storage = None
        if self._store is not None:
            # b"": not written through (the worker skips it).
            storage = [self._store.storage_key(k) if admission.admit(k, "store") else b"" for k in new]
        return PrepareStoreOutput(
            keys_to_store=new, store_spec=KvtierBlocks(host, storage, lives=lives), evicted_keys=evicted
        )

    def _evictable(self) -> int:
        """Counted the slow way (tests check ``_idle`` against it)."""
        return sum(1 for b in self._blocks.values() if b.ready and not b.readers)

    def _is_evictable(self, key: Hashable) -> bool:
        block = self._blocks.get(key)  # type: ignore[call-overload]
        return block is not None and block.ready and not block.readers

    def _make_room(self, needed: int) -> list[bytes] | None:
        """Evict idle blocks, in the eviction policy's order, until ``needed``
        are free; None (and nothing evicted) when even that is not enough."""
        short = needed - len(self._free)
        if short <= 0:
            return []
        if self._idle < short:
            return None
        victims: list[bytes] = self.eviction.victims(short, self._is_evictable)  # type: ignore[assignment]
        if len(victims) != short:  # kvtier's own policies (options name them): a bug if it fires
            raise RuntimeError(f"kvtier's host eviction policy {self.eviction!r} gave {len(victims)} of {short} "
                               "evictable blocks")
        for key in victims:
            self._free.append(self._blocks.pop(key).host)
        self._idle -= len(victims)
        self.counts.evicted += len(victims)
        return victims

    def complete_store(self, keys: Collection[bytes], req_context: ReqContext, success: bool = True) -> None:
        for key in keys:
            block = self._blocks.get(key)
            if block is None or block.ready:
                continue
            if success:
                block.ready = True
                self._idle += not block.readers
                self._refused.pop(key, None)
                self.eviction.insert(key)  # evictable from now on: as recent as its store
                self.counts.stored += 1
            else:
                self._drop(key)

    def _drop(self, key: bytes) -> None:
        """Forget ``key``'s block; its host block is free once its loads complete."""
        block = self._blocks.pop(key)
        self.eviction.remove(key)
        self._idle -= block.ready and not block.readers
        if block.readers:
            self._draining[key] = block
        else:
            self._free.append(block.host)

    # -- requests and the rest ---------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[Any]:
        return ()

    # -- metrics (vLLM's /metrics) ---------------------------------------------------

    def report_worker(self, counts: dict[str, int]) -> None:
        """Add the workers' counts of one step (`KvtierWorkerMetadata.kvtier`)."""
        for key, n in counts.items():
            self._worker_counts[key] = self._worker_counts.get(key, 0) + n

    def get_stats(self) -> Any:
        """vLLM's `OffloadingConnectorStats` since the last call: the workers'
        counts and the share of host blocks in use (see `metrics`)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        from kvtier.integrations.vllm.metrics import HOST_USAGE, add_counts, admission_counts

        stats = OffloadingConnectorStats()
        if self._zero_counts:
            add_counts(stats, self._zero_counts, zeros=True)
            self._zero_counts = {}
        add_counts(stats, self._worker_counts)
        self._worker_counts = {}
        skips = admission_counts(self.admission.statistics())
        add_counts(stats, {k: n - self._skips_reported.get(k, 0) for k, n in skips.items()})
        self._skips_reported = skips
        stats.set_gauge(HOST_USAGE, len(self._blocks) / self.num_blocks)
        return stats

    def shutdown(self) -> None:
        """vLLM's scheduler shuts its connector down: the store lookups' thread ends."""
        if self._store is not None:
            self._store.close()

    def reset_cache(self) -> None:
        # vLLM flushes every in-flight job before the next step's transfers;
        # the worker waits for any old operation on a host page before it
        # writes that page again, so the ids may be handed out at once.
        self._blocks.clear()
        self._idle = 0
        self.eviction.clear()
        self._draining.clear()
        self._loading_from_store.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def __repr__(self) -> str:
        ready = sum(b.ready for b in self._blocks.values())
        return (
            f"<KvtierOffloadingManager [blocks: {ready} ready, {len(self._blocks) - ready} storing, "
            f"{len(self._free)} free | store={'yes' if self._store is not None else 'no'}, "
            f"admission={type(self.admission.policy).__name__}, eviction={type(self.eviction).__name__}]>"
        )
