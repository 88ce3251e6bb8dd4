"""The worker side: vLLM's KV blocks moved by a `TransferScheduler`.

vLLM hands the worker its KV cache as one int8 view per layer, ``[num_blocks,
bytes per block]`` (on CPU: the memory of the layer's ``[num_blocks,
num_kv_heads, block_size, 2 * head_dim]`` tensor; all layers are views into
one buffer). Those views are kvtier's `DevicePool` as they are, no copy:
``page_size=1``, one slot per vLLM block, so a vLLM block id is a kvtier
device slot and the manager's host block id is a kvtier host page.

The scheduler runs on its own event loop thread (`LoopThread`). vLLM's calls
only hand coroutines to it: `submit_store` and `submit_load` return at once,
`get_finished` reads what has ended, and only `wait` (vLLM's flush) blocks.

With a store, a second scheduler over a second `PoolGroup` (the same device
views, its own small host pool: the staging pool) reads blocks from the store
for loads, so that kvtier's own host allocation never takes a page the
manager may name. Stored blocks are written through from the host pages the
manager named, after the store job has been reported (the device blocks are
free to reuse by then; the host pages are kept until the write ends).

Per host page the worker orders its own operations: a store into a page waits
for every earlier operation on it (the last writer and the loads and
write-throughs that read it), then frees the page's previous life in kvtier
and writes the new one; a load waits for the page's last writer. A load
may be submitted while the store of its blocks is in flight (the manager
counts such blocks as hits); it then reads a page only if that page's last
successful store wrote the life the load names (`KvtierBlocks.lives`): a
store that failed, or that has not reached this worker, fails the block and
vLLM recomputes it, never reading the page's earlier bytes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, OffloadingWorker, TransferResult

from kvtier.errors import ConfigurationError, CorruptionDetected, KvtierError
from kvtier.integrations.vllm.groups import union_tensors
from kvtier.integrations.vllm.loop import LoopThread, open_store
from kvtier.integrations.vllm.manager import KvtierBlocks
from kvtier.integrations.vllm.options import KvtierOptions
from kvtier.logs import get_logger
from kvtier.pools import DevicePool, PoolGroup
from kvtier.scheduler import RewriteKeys, TransferScheduler
from kvtier.scheduler.config import SchedulerConfig
from kvtier.storage import StorageError
from kvtier.storage.identity import EngineIdentity, PageIdentity

__all__ = ["KvtierOffloadingWorker", "WorkerCounts", "device_pool", "live_workers"]

log = get_logger(__name__)

POOL = "kv"

# The reason kept in `RewriteKeys` for a stored block a load did not reach
# because it stopped at a block to rewrite before it (a refused one).
UNREAD = "unread"

_LIVE: weakref.WeakSet[KvtierOffloadingWorker] = weakref.WeakSet()


def live_workers() -> list[KvtierOffloadingWorker]:
    """The workers running in this process (for statistics and tests): not
    shut down, and still referenced (by vLLM) or running a job."""
    return [w for w in list(_LIVE) if not w._closed]


def device_pool(kv_caches: CanonicalKVCaches) -> DevicePool:
    """vLLM's per-layer block views as one `DevicePool` (one plane per tensor), no copy.

    With several KV cache groups (hybrid models) the pool spans the union of
    the groups' tensors: vLLM's groups share one block id space over tensors
    they overlay, so a block of any group is the same rows of those tensors
    (`kvtier.integrations.vllm.groups`). Raises `ConfigurationError` when
    vLLM registered no tensor or the tensors differ in block count.
    """
    used = union_tensors([[ref.tensor_idx for ref in refs] for refs in kv_caches.group_data_refs])
    tensors = [kv_caches.tensors[i].tensor for i in used]
    counts = {int(t.shape[0]) for t in tensors}
    if len(counts) != 1:
        raise ConfigurationError(
            f"kvtier needs every KV cache tensor to hold the same number of blocks; vLLM's hold {sorted(counts)}"
        )
    return DevicePool(tensors)


@dataclass(eq=False)
class WorkerCounts:
    """What the worker did, in vLLM blocks."""

    stores: int = 0
    blocks_stored: int = 0
    loads: int = 0
    blocks_loaded_from_host: int = 0
    blocks_loaded_from_store: int = 0
    blocks_refused: int = 0  # bytes that failed a check (verify mode, a damaged stored block): recomputed
    blocks_failed: int = 0  # other load failures (a store miss, a failed copy): recomputed too
    blocks_not_stored: int = 0  # of those: the page did not hold the life the load named (its store failed)
    blocks_written_through: int = 0
    write_through_errors: int = 0
    errors: list[str] = field(default_factory=list)
    # Per vLLM KV cache group id: blocks named by store and load jobs (a
    # sliding-window group's are only those vLLM's scheduler asks it to move).
    group_blocks_stored: dict[int, int] = field(default_factory=dict)
    group_blocks_loaded: dict[int, int] = field(default_factory=dict)

    def count_groups(self, into: dict[int, int], group_ids: tuple[int, ...], spec: GPULoadStoreSpec) -> None:
        sizes = getattr(spec, "group_sizes", None)
        if sizes is None or len(sizes) != len(group_ids):
            sizes = [len(spec.block_ids)] + [0] * (len(group_ids) - 1)
        for gid, n in zip(group_ids, sizes, strict=True):
            into[gid] = into.get(gid, 0) + int(n)

    # blocks_refused by reason: "host_verify" (verify mode, the host tier's
    # bytes changed), "store_<rule>" (a stored block broke `PageCorrupted`'s
    # rule: identity, checksum, length, key, pool, header, version, pools; or decode)
    refused: dict[str, int] = field(default_factory=dict)

    def refuse(self, reason: str, blocks: int) -> None:
        self.blocks_refused += blocks
        self.refused[reason] = self.refused.get(reason, 0) + blocks


class KvtierOffloadingWorker(OffloadingWorker):  # type: ignore[misc,unused-ignore]
    """vLLM's `OffloadingWorker` backed by kvtier (see the module docstring).

    Started at construction: returns once the scheduler runs, or raises the
    error that stopped it (a bad store, a size kvtier refuses).
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        host_blocks: int,
        options: KvtierOptions,
        staging_blocks: int,
        group_ids: tuple[int, ...] = (0,),
        group_kinds: dict[int, str] | None = None,
        block_bytes: int | None = None,
        rank: int = 0,
        shard: Callable[[bytes], bytes] | None = None,
        identity: PageIdentity | None = None,
    ) -> None:
        self.options = options
        self.group_ids = tuple(group_ids)  # vLLM's KV cache group ids, in the order of a job's group_sizes
        self.group_kinds = dict(group_kinds or {})  # group id -> vLLM's KVCacheSpec class name, where known
        # Tensor / pipeline parallel: this worker's rank, and a block's storage
        # key (as the scheduler side names it) to this rank's shard's key.
        self.rank = rank
        self._shard = shard
        # What this worker's stored blocks are (`StorageKeys.identity`): every
        # blob header binds it with the host pool's geometry, so a block another
        # engine (other model, dtype, block size, shard) stored is a miss.
        self.identity = EngineIdentity.of_pages(identity, POOL) if identity is not None else None
        device = device_pool(kv_caches)
        if len(kv_caches.group_data_refs) > 1 and block_bytes is not None and device.slot_nbytes != block_bytes:
            # The host tier was sized from vLLM's figure (cpu_bytes_to_use // block_bytes).
            raise ConfigurationError(
                f"kvtier moves a hybrid model's KV cache groups as one block of {device.slot_nbytes} bytes over "
                f"their tensors; vLLM sizes a block at {block_bytes} bytes (worker_kv_bytes_per_block), so the "
                "groups do not overlay one set of tensors and kvtier's host tier would not be the size asked for"
            )
        self.num_device_blocks = device.slots
        self.block_bytes = device.slot_nbytes
        self.host_blocks = host_blocks
        # The pools: the worker's while it runs; a worker shut down holds none
        # (an empty group), so a reference kept to it keeps no host memory.
        self.group = PoolGroup()
        self.group.add_pool(POOL, device=device, page_size=1, host_slots=host_blocks, pin_memory=False)
        self.staging: PoolGroup | None = None
        if options.has_store:
            self.staging = PoolGroup()
            self.staging.add_pool(POOL, device=DevicePool([device.tensor(j, 0) for j in range(device.num_layers)]),
                                  page_size=1, host_slots=staging_blocks, pin_memory=False)
        self.counts = WorkerCounts()
        self.rewrite_keys = RewriteKeys()  # the schedulers' record of stored blocks to put again
        self._finished: collections.deque[tuple[TransferResult, list[int]]] = collections.deque()
        self._reported_invalid: set[int] = set()
        self._jobs: dict[int, concurrent.futures.Future[None]] = {}
        self._held: set[int] = set()  # host pages whose current life is kvtier's (a backup wrote them)
        self._life: dict[int, int] = {}  # host page -> the manager's life its last successful store wrote
        self._writer: dict[int, asyncio.Future[Any]] = {}
        self._readers: dict[int, set[asyncio.Future[Any]]] = collections.defaultdict(set)
        self._closed = False
        self._lock = threading.Lock()
        self._loop = _WorkerLoop(options, self.group, self.staging, self.rewrite_keys, self.identity)
        self._loop.thread.start()
        # Closes the loop when vLLM shuts the worker down, when the worker is
        # collected without that (an engine dropped: DESIGN lesson 26), or at
        # exit; it holds the loop, never the worker.
        self._finalizer = weakref.finalize(self, self._loop.close)
        _LIVE.add(self)

    @property
    def _main(self) -> TransferScheduler | None:
        return self._loop.main

    @property
    def _staged(self) -> TransferScheduler | None:
        return self._loop.staged

    def _run(self, job_id: int, coro: Any) -> bool:
        if self._closed:
            coro.close()
            return False
        fut = self._loop.thread.submit(coro)
        with self._lock:
            self._jobs[job_id] = fut
        return True

    def _done(self, job_id: int, nbytes: int, seconds: float, invalid: list[int]) -> None:
        self._finished.append((TransferResult(job_id, True, nbytes, seconds), invalid))

    # -- vLLM's API -----------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: KvtierBlocks) -> bool:
        device, host = _block_pairs("store", job_id, src_spec, dst_spec)
        self.counts.count_groups(self.counts.group_blocks_stored, self.group_ids, src_spec)
        return self._run(job_id, self._store(job_id, device, host, self._shard_keys(dst_spec.storage_keys), dst_spec.lives))

    def submit_load(self, job_id: int, src_spec: KvtierBlocks, dst_spec: GPULoadStoreSpec) -> bool:
        device, host = _block_pairs("load", job_id, dst_spec, src_spec)
        self.counts.count_groups(self.counts.group_blocks_loaded, self.group_ids, dst_spec)
        return self._run(job_id, self._load(job_id, device, host, self._shard_keys(src_spec.storage_keys), src_spec.lives))

    def _shard_keys(self, keys: list[bytes] | None) -> list[bytes] | None:
        """The scheduler side's storage keys as this rank's shard keys (b"": a block on the host)."""
        shard = self._shard
        if keys is None or shard is None:
            return keys
        return [shard(k) if k else k for k in keys]

    def get_finished(self) -> list[TransferResult]:
        if not self._finished and self._jobs:
            # vLLM polls this once per engine step, and with nothing else to
            # run its step loop holds the GIL but for the switch interval
            # (5 ms), so each of a job's hops between kvtier's threads would
            # wait that long. Let them run now; this returns at once when
            # they have nothing to do.
            time.sleep(0)
        out = []
        while self._finished:
            result, invalid = self._finished.popleft()
            self._reported_invalid.update(invalid)
            out.append(result)
            with self._lock:
                self._jobs.pop(result.job_id, None)
        return out

    def take_invalid_blocks(self) -> set[int]:
        """Device blocks of finished loads that did not land (refused or
        failed): vLLM recomputes them (`KvtierConnector` reports them)."""
        out, self._reported_invalid = self._reported_invalid, set()
        return out

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            futures = [self._jobs[j] for j in job_ids if j in self._jobs]
        concurrent.futures.wait(futures)

    def wait_all(self) -> None:
        """Block until every job submitted so far has ended, so that `counts` and
        `statistics()` hold them all (a job's counts move when it ends, on kvtier's
        thread, not when vLLM submits it)."""
        with self._lock:
            futures = list(self._jobs.values())
        concurrent.futures.wait(futures)

    def shutdown(self) -> None:
        """Stop kvtier's loop thread (after the write-throughs in flight land)
        and let go of the host tier; idempotent. vLLM calls it when it shuts
        its connector down; a worker collected without it does the same."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        # Held no longer here: the host tier is freed once the loop let go too.
        self.group, self.staging = PoolGroup(), None
        self._loop.release()

    # -- statistics ---------------------------------------------------------------

    def statistics(self, *, schedulers: bool = True) -> dict[str, Any]:
        """Counts in blocks and (unless ``schedulers=False``) the schedulers'
        statistics, as plain data (JSON-able)."""
        def lanes(sched: TransferScheduler | None) -> dict[str, Any] | None:
            if sched is None:
                return None
            s = sched.statistics()
            return {
                lane: {"completed": d.completed, "failed": d.failed, "bytes": d.bytes}
                for lane, d in (("backup", s.backup), ("load", s.load), ("write_storage", s.write_storage),
                                ("prefetch", s.prefetch))
            }
        c = self.counts
        return {
            "rank": self.rank, "stores": c.stores, "blocks_stored": c.blocks_stored, "loads": c.loads,
            "blocks_loaded_from_host": c.blocks_loaded_from_host,
            "blocks_loaded_from_store": c.blocks_loaded_from_store,
            "blocks_refused": c.blocks_refused, "blocks_failed": c.blocks_failed,
            "blocks_not_stored": c.blocks_not_stored,
            "blocks_written_through": c.blocks_written_through, "write_through_errors": c.write_through_errors,
            "refused": dict(c.refused), "errors": list(c.errors[-8:]),
            "keys_to_rewrite": len(self.rewrite_keys),
            "groups": {
                str(gid): {"kind": self.group_kinds.get(gid), "blocks_stored": c.group_blocks_stored.get(gid, 0),
                           "blocks_loaded": c.group_blocks_loaded.get(gid, 0)}
                for gid in self.group_ids
            },
            "host_blocks": self.host_blocks,
            "block_bytes": self.block_bytes,
            "scheduler": lanes(self._main) if schedulers else None,
            "staging": lanes(self._staged) if schedulers else None,
        }

    def __repr__(self) -> str:
        c = self.counts
        return (
            f"<KvtierOffloadingWorker [blocks: {c.blocks_stored} stored, "
            f"{c.blocks_loaded_from_host + c.blocks_loaded_from_store} loaded, {c.blocks_refused} refused | "
            f"{len(self._held)} of {self.host_blocks} host blocks held{' | shut down' if self._closed else ''}]>"
        )

    # -- jobs (on the loop) ---------------------------------------------------------

    def _order_write(self, pages: list[int], me: asyncio.Future[Any]) -> list[asyncio.Future[Any]]:
        """Make ``me`` the writer of ``pages``; what it must wait for first."""
        before: set[asyncio.Future[Any]] = set()
        for p in pages:
            w = self._writer.get(p)
            if w is not None:
                before.add(w)
            before |= self._readers.pop(p, set())
            self._writer[p] = me
        def forget(f: asyncio.Future[Any]) -> None:
            for p in pages:
                if self._writer.get(p) is f:
                    del self._writer[p]
        me.add_done_callback(forget)
        before.discard(me)
        return list(before)

    def _order_read(self, pages: list[int], me: asyncio.Future[Any]) -> list[asyncio.Future[Any]]:
        """Make ``me`` a reader of ``pages``; the writers it must wait for."""
        before = {w for p in pages if (w := self._writer.get(p)) is not None}
        for p in pages:
            self._readers[p].add(me)

        def forget(f: asyncio.Future[Any]) -> None:
            for p in pages:
                readers = self._readers.get(p)
                if readers is not None:
                    readers.discard(f)
                    if not readers:
                        del self._readers[p]
        me.add_done_callback(forget)
        before.discard(me)
        return list(before)

    async def _store(
        self, job_id: int, device: np.ndarray, host: np.ndarray, keys: list[bytes] | None, lives: list[int] | None
    ) -> None:
        me = asyncio.current_task()
        assert me is not None and self._main is not None
        pages = host.tolist()
        start = time.perf_counter()
        await asyncio.gather(*self._order_write(pages, me), return_exceptions=True)
        nbytes = 0
        try:
            for p in pages:
                self._life.pop(p, None)
            again = [p for p in pages if p in self._held]
            if again:
                self._main.free_host({POOL: torch.tensor(again, dtype=torch.int64)})
                self._held.difference_update(again)
            host_t = torch.from_numpy(host)
            handle = await self._main.backup({POOL: torch.from_numpy(device)}, host_indices={POOL: host_t})
            result = await handle
            nbytes = result.nbytes
            self._held.update(pages)
            if lives is not None:
                self._life.update(zip(pages, lives, strict=True))
            self.counts.stores += 1
            self.counts.blocks_stored += len(pages)
        except KvtierError as exc:
            # vLLM has no failed store: the blocks stay unloadable garbage to
            # nobody, since a later load of them is refused by kvtier (pages
            # not held) and recomputed.
            self.counts.errors.append(f"store job {job_id}: {exc!r}")
            log.warning("vllm.store_failed", job_id=job_id, error=repr(exc))
        self._done(job_id, nbytes, time.perf_counter() - start, [])
        if keys is not None and nbytes and not all(keys):
            # b"": the scheduler side's store admission skipped that block's write-through.
            kept = [i for i, k in enumerate(keys) if k]
            host_t, pages, keys = host_t[kept], [pages[i] for i in kept], [keys[i] for i in kept]
        if keys and nbytes:
            task = asyncio.get_running_loop().create_task(self._write_through(host_t, pages, keys))
            # A reader of the pages from now on (no await in between), so that a
            # later store into them waits for it; the only writer is this job, done.
            self._order_read(pages, task)
            background = self._loop.background
            background.add(task)
            task.add_done_callback(background.discard)

    async def _write_through(self, host: torch.Tensor, pages: list[int], keys: list[bytes]) -> None:
        assert self._main is not None
        try:
            handle = await self._main.write_storage({POOL: host}, {POOL: keys})
            await handle
            self.counts.blocks_written_through += len(pages)
        except (KvtierError, StorageError) as exc:
            self.counts.write_through_errors += 1
            self.counts.errors.append(f"write-through: {exc!r}")
            log.warning("vllm.write_through_failed", error=repr(exc))

    async def _load(
        self, job_id: int, device: np.ndarray, host: np.ndarray, keys: list[bytes] | None, lives: list[int] | None
    ) -> None:
        me = asyncio.current_task()
        assert me is not None and self._main is not None
        start = time.perf_counter()
        on_host = host >= 0
        pages = host[on_host].tolist()
        await asyncio.gather(*self._order_read(pages, me), return_exceptions=True)
        parts = []
        not_stored: list[int] = []
        if lives is not None and pages:
            # After the page's writers: a page whose last successful store is
            # not the life this load names holds other bytes (the store failed
            # or never came); those blocks are recomputed.
            stale = np.array([self._life.get(p) != life for p, life in zip(host.tolist(), lives, strict=True)])
            stale &= on_host
            if stale.any():
                not_stored = device[stale].tolist()
                self.counts.blocks_failed += len(not_stored)
                self.counts.blocks_not_stored += len(not_stored)
                self.counts.errors.append(f"load job {job_id}: host pages {host[stale].tolist()} were not stored")
                log.warning("vllm.load_not_stored", job_id=job_id, blocks=len(not_stored))
                on_host &= ~stale
        if on_host.any():
            parts.append(self._load_from_host(host[on_host], device[on_host]))
        from_store = host < 0
        if from_store.any():
            store_keys = [k for k, h in zip(keys or [], host.tolist(), strict=True) if h < 0]
            parts.append(self._load_from_store(store_keys, device[from_store]))
        landed = await asyncio.gather(*parts)
        nbytes = sum(n for n, _ in landed)
        invalid = not_stored + [b for _, bad in landed for b in bad]
        self.counts.loads += 1
        self._done(job_id, nbytes, time.perf_counter() - start, invalid)

    async def _load_from_host(self, host: np.ndarray, device: np.ndarray) -> tuple[int, list[int]]:
        assert self._main is not None
        try:
            handle = await self._main.load({POOL: torch.from_numpy(host)}, {POOL: torch.from_numpy(device)})
            result = await handle
        except CorruptionDetected as exc:
            self.counts.refuse("host_verify", len(device))
            self.counts.errors.append(repr(exc))
            log.warning("vllm.load_refused", blocks=len(device), error=str(exc))
            return 0, device.tolist()
        except KvtierError as exc:
            self.counts.blocks_failed += len(device)
            self.counts.errors.append(repr(exc))
            log.warning("vllm.load_failed", blocks=len(device), error=repr(exc))
            return 0, device.tolist()
        self.counts.blocks_loaded_from_host += len(device)
        return result.nbytes, []

    async def _load_from_store(self, keys: list[bytes], device: np.ndarray) -> tuple[int, list[int]]:
        staged = self._staged
        if staged is None or len(keys) != len(device):
            self.counts.blocks_failed += len(device)
            return 0, device.tolist()
        got: dict[str, torch.Tensor] = {}
        n = 0
        nbytes = 0
        try:
            fetched = await (await staged.prefetch({POOL: keys}, policy="wait_complete"))
            got = dict(fetched.host_indices)
            n = fetched.pages.get(POOL, 0)
            if n:
                result = await (await staged.load({POOL: got[POOL]}, {POOL: torch.from_numpy(device[:n])}))
                nbytes = result.nbytes
        except (KvtierError, StorageError) as exc:
            self.counts.errors.append(f"load from store: {exc!r}")
            log.warning("vllm.store_load_failed", blocks=len(device), error=repr(exc))
            n = 0
        finally:
            staged.free_host(got)
        self.counts.blocks_loaded_from_store += n
        short = len(device) - n
        # The first block that did not come: refused when the staging
        # scheduler found its stored bytes bad (it is then in rewrite_keys,
        # which the next write-through of it reads), else missing or failed.
        reason = self.rewrite_keys.get(keys[n]) if short else None
        if reason is not None and reason != UNREAD:
            self.counts.refuse(f"store_{reason}", 1)
            self.counts.errors.append(f"load from store: block {keys[n].hex()} refused ({reason})")
            short -= 1
        if reason is not None:
            # The load stopped at a block to rewrite: the blocks behind it were
            # not read, so whether they are whole is not known (when one block
            # of a prefix is damaged, its neighbours often are too). vLLM
            # recomputes them all, and their write-through puts them again
            # instead of finding them "already stored": one pass heals the prefix.
            for key in keys[n + 1:]:
                if key not in self.rewrite_keys:
                    self.rewrite_keys.add(key, UNREAD)
        self.counts.blocks_failed += short
        return nbytes, device[n:].tolist()


class _WorkerLoop:
    """What kvtier's loop thread runs for one worker: its schedulers (and the
    store), until `close`. It holds no reference to the worker (the worker
    holds it), so a worker that vLLM drops is collected while the thread runs,
    and its finalizer closes this loop; a job running on the loop holds the
    worker only until it ends."""

    def __init__(
        self, options: KvtierOptions, group: PoolGroup, staging: PoolGroup | None, rewrite_keys: RewriteKeys,
        identity: EngineIdentity | None,
    ) -> None:
        self.options = options
        self.group: PoolGroup | None = group
        self.staging = staging
        self.rewrite_keys = rewrite_keys
        self.identity = identity
        self.main: TransferScheduler | None = None
        self.staged: TransferScheduler | None = None
        self.stop: asyncio.Event | None = None
        self.background: set[asyncio.Task[None]] = set()  # write-throughs in flight
        self.thread = LoopThread("kvtier-vllm-worker", self._serve)

    async def _serve(self, ready: Callable[[], None]) -> None:
        self.stop = asyncio.Event()
        group = self.group
        if group is None:
            raise ConfigurationError("kvtier's vLLM worker was shut down before its loop started")
        config = SchedulerConfig(verify=self.options.verify)
        async with contextlib.AsyncExitStack() as stack:
            store = open_store(self.options)
            if store is not None:
                await stack.enter_async_context(store)  # type: ignore[arg-type]
            # One record of stored blocks found bad for both schedulers: the
            # staging one refuses them, the main one writes them through, so
            # the next write-through of a refused block puts it again.
            self.main = await stack.enter_async_context(
                TransferScheduler(group, config=config, storage=store, rewrite_keys=self.rewrite_keys,
                                  identity=self.identity)
            )
            if self.staging is not None:
                self.staged = await stack.enter_async_context(
                    TransferScheduler(self.staging, config=config, storage=store, rewrite_keys=self.rewrite_keys,
                                      identity=self.identity)
                )
            ready()
            await self.stop.wait()
            while self.background:  # write-throughs still running: let them land before the store closes
                await asyncio.gather(*self.background, return_exceptions=True)
        # The loop ends: what it held goes now, not when a collection finds this object.
        self.main = self.staged = None
        self.release()

    def close(self) -> None:
        """Stop the loop and wait for it to end, unless called on the loop's own
        thread (a worker collected there: the loop then ends right after)."""
        loop, stop = self.thread.loop, self.stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self.thread.is_current():
            return
        error = self.thread.join(60.0)
        if error is not None:
            log.warning("vllm.worker.closed_with_error", error=repr(error))

    def release(self) -> None:
        """Let go of the pools (after `close`)."""
        self.group = self.staging = None


def _block_pairs(kind: str, job_id: int, device: GPULoadStoreSpec, host: KvtierBlocks) -> tuple[Any, Any]:
    """A job's device and host block ids (int64 arrays), as many of each, else `ValueError`."""
    d = np.asarray(device.block_ids, dtype=np.int64)
    h = np.asarray(host.host_block_ids, dtype=np.int64)
    if d.shape != h.shape:  # vLLM's job specs, not user input: a bug in kvtier's manager or vLLM if it fires
        raise ValueError(f"{kind} job {job_id} names {d.size} device blocks and {h.size} host blocks")
    return d, h
