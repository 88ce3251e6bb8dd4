"""Soak run: a long mixed workload with injected faults and cancellations.

    python benchmarks/soak.py --operations 100000
    python benchmarks/soak.py --seconds 600 --fail-probability 0.05 --seed 7
    python benchmarks/soak.py --storage-fraction 0      # no storage tier

Concurrent "requests" on `kvtier.testing.hybrid_group` (every pool kind: kv,
swa, the c4 and swa_state sidecars, state, the tok anchor and its idx sidecar)
back their pages up, load them back (into device slots they allocate or that
kvtier allocates), sometimes evict the host copy while the load is still in
flight, and sometimes cancel what they submitted, queued or in flight. The
executor fails batches at random (seeded) at a random layer or pool; the host
pools are small enough that allocations run short now and then, and a reclaim
hook gets its chance.

The storage tier is a shared `kvtier.testing.MemoryStore` with seeded faults
(`StorageError` / `StorageTimeout`; a failing put publishes a prefix of its
pages), stalls (calls held at its gate for a few milliseconds) and evictions
(the soak drops stored pages, even while a prefetch looks them up). Each
request's pages have one key per pool (its own rows are its "prompt"), so the
bytes stored under every key are known. Requests write their backed-up pages
to the store (sometimes before the backup finished, sometimes evicting the
host copy while the write reads it, sometimes cancelling), and prefetch runs
of other requests' keys with every policy (``best_effort`` stopped at a random
moment, ``wait_complete``, ``timeout``), cancel some, and then load the pages
they got, write them back or free them.

The store also damages pages, as a shared one can: each page it commits is
damaged with ``--corrupt-probability`` (a byte flipped, a blob lost, its record
spoiled: `MemoryStore`'s ``corrupt_probability``), and requests damage random
stored pages between rounds (those three, and a page of another key copied
under a key or one blob spliced in from another page). Prefetches must refuse what fails its checksum (a
miss), and a write of a key that a read found bad, or whose record is gone,
puts it again (a repair). Since timing decides whether a random round reads a
damaged page before a write repairs it, a closing round (faults off) damages a
few stored pages (a byte flipped, a key swap, a blob splice) and requires each to be rejected, repaired by a
write and read back byte-exact. Now and then a round frees its backup's pages while a
load or write of them waits for the backup, and backs up another request's
rows the moment it ends (the allocator may hand it the freed page numbers): the
waiting reader must fail, never read the new owner's bytes. And the engine
changes its index tensors, key lists and the tensors handles gave it right
after each call (``--reuse-probability``): operations move what the call named.

Every load that succeeds is compared byte for byte with the rows it came from;
every prefetched page is compared byte for byte, in host memory and again on
the device when loaded, with the rows of the request whose key it was; at the
end every page in the store is too, but for the pages still damaged. Every
prefetch result is checked against
the documented contract (a prefix of each pool's keys, the caller holding
exactly ``host_indices``, ``stopped`` and ``wait_complete`` semantics, a
cancelled handle raising `OperationCancelled`; a prefetch that fails after a
`stop` that returned True is counted apart, a known deviation, see
`Soak.prefetch`). At the end every request has
given back what it held, so every host and device allocator must be empty
again. Prints operations done, faults injected, storage outcomes, store damage
(pages damaged, rejected, repaired), free-then-reallocate outcomes, leaked
slots, wrong bytes found, contract violations and resident memory at start and
end; exits 1 if any slot leaked, any byte was wrong or any contract was broken
(a backup or load failing without an injected fault is one).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import torch

from kvtier import (
    InvalidIndices,
    OperationCancelled,
    PoolExhausted,
    PrefetchResult,
    SchedulerConfig,
    TransferFailed,
    TransferScheduler,
    WriteStorageHandle,
    WriteStorageResult,
)
from kvtier.pools import PageAllocator, PoolGroup, slots_of_pages
from kvtier.scheduler import OperationHandle, SchedulerStatistics
from kvtier.storage import (
    BLOB_HEADER_BYTES,
    KeyNamespace,
    PageBlobs,
    StorageError,
    StorageTimeout,
    encode_page,
    page_keys,
)
from kvtier.testing import FaultInjectingExecutor, InjectedFault, MemoryStore, hybrid_group

PAGE = 8
OWNING = ("kv", "state", "swa", "tok")
SIDECARS = {"kv": ("c4",), "swa": ("swa_state",), "tok": ("idx",), "state": ()}
# Which pools one request backs up: whole models and partial ones.
POOL_SETS = (("kv", "state", "swa", "tok"), ("kv", "state", "swa", "tok"), ("kv", "tok"), ("swa", "state"), ("state",))
POLICIES = ("best_effort", "wait_complete", "timeout")
# Keys of "requests" that never run: a prefetch of one never finds it.
COLD_KEYS = 4

# A load's byte check: the pools it loaded and the device indices it wrote
# (taken from the handle when it was submitted).
Check = Callable[[tuple[str, ...], dict[str, torch.Tensor]], None]


def page_size(pool: str) -> int:
    return 1 if pool == "state" else PAGE


def rss_mib(field_name: str = "VmRSS") -> float:
    """Resident memory of this process from /proc/self/status, in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class SoakStore(MemoryStore):
    """A `MemoryStore` that knows which of its pages are damaged right now.

    Damage (drawn at put time with ``corrupt_probability``, or asked for with
    `corrupt` / `drop_part` / `malform`) is recorded with the page it hit
    (its blob dict); a put of the key replaces that dict, which repairs it.
    ``repairs`` counts puts that replaced a damaged page.
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.damaged: dict[bytes, dict[str, bytes]] = {}
        self.repairs = 0
        self._noted = 0

    def note_damage(self) -> None:
        """Record the damage logged since the last call (synchronously after it happened)."""
        for c in self.corruptions[self._noted:]:
            page = self.pages.get(c.key)
            if page is not None:
                self.damaged[c.key] = page
        self._noted = len(self.corruptions)

    def is_damaged(self, key: bytes) -> bool:
        page = self.damaged.get(key)
        if page is None:
            return False
        if self.pages.get(key) is not page:  # put again (or evicted) since
            del self.damaged[key]
            return False
        return True

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        pages = list(pages)
        try:
            await super().put(pages)
        finally:
            # Nothing ran between the commit and here (MemoryStore.put commits
            # synchronously after its gate), so the damage drawn is this put's.
            for page in pages:
                old = self.damaged.get(page.key)
                if old is not None and self.pages.get(page.key) is not old:
                    del self.damaged[page.key]
                    self.repairs += 1
            self.note_damage()


@dataclass
class Tally:
    submitted: int = 0
    backups: int = 0
    loads: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    bytes_checked: int = 0
    bytes_mismatched: int = 0
    host_evicted_in_flight: int = 0
    # Free-then-reallocate: readers of a backup's pages that the request freed
    # while they waited, the next backup submitted as the backup ended.
    realloc_readers: int = 0
    realloc_outcomes: Counter[str] = field(default_factory=Counter)
    realloc_same_pages: int = 0  # the next backup was handed some of the freed page numbers
    # Index tensors and key lists changed after the call that took them returned.
    buffers_reused: int = 0
    handle_tensors_changed: int = 0


@dataclass
class StorageTally:
    writes: int = 0  # submitted (handles returned)
    write_outcomes: Counter[str] = field(default_factory=Counter)
    write_refused: int = 0  # eager writes whose backup failed: TransferFailed at submission
    write_abandoned: int = 0  # submissions cancelled while waiting for the backup
    host_evicted_while_writing: int = 0
    pages_written: int = 0
    pages_present: int = 0
    prefetches: int = 0
    prefetch_outcomes: Counter[str] = field(default_factory=Counter)
    policies: Counter[str] = field(default_factory=Counter)
    stop_calls: int = 0  # stop() that returned True
    # stop() returned True, yet the prefetch ended with every hit page (its last
    # round was being written, or kvtier did not heed the stop: see prefetch()).
    stop_unheeded: int = 0
    pages_requested: int = 0
    pages_hit: int = 0  # the runs the lookups found (PrefetchResult.hit_pages)
    pages_fetched: int = 0  # handed back (PrefetchResult.pages)
    prefetched_loads: int = 0
    evictions: int = 0
    stalls: int = 0
    store_faults: Counter[str] = field(default_factory=Counter)  # by operation
    store_timeouts: int = 0
    bytes_checked: int = 0  # prefetched pages, in host memory and loaded to the device
    bytes_mismatched: int = 0
    store_pages_checked: int = 0
    store_bytes_checked: int = 0
    store_bytes_mismatched: int = 0
    store_pages_damaged_at_end: int = 0  # skipped by the store check: allowed to differ
    damage_between_rounds: Counter[str] = field(default_factory=Counter)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.group: PoolGroup = hybrid_group(
            page_size=PAGE,
            device_slots=args.requests * 2 * PAGE,
            host_slots=max(1, int(args.requests * args.host_fraction)) * PAGE,
            state_slots=args.requests * 2,
            device_allocator=True,
            seed=args.seed,
        )
        self.executor = FaultInjectingExecutor(fail_probability=args.fail_probability, seed=args.seed)
        self.store: SoakStore | None = (
            SoakStore(fail_probability=args.storage_fail_probability, seed=args.seed,
                      corrupt_probability=args.corrupt_probability)
            if args.storage_fraction > 0 else None
        )
        self.tally = Tally()
        self.storage = StorageTally()
        self.violations: list[str] = []
        self.closing: Counter[str] = Counter()  # the closing damage round's outcomes
        self.deadline = float("inf")
        # Each request's live cache rows: reserved from the engine's device
        # allocators for the whole run, never written, so they are the truth.
        self.sources: list[dict[str, list[int]]] = []
        for _ in range(args.requests):
            got = {p: self.device_alloc(p).try_alloc_pages(1) for p in OWNING}
            assert all(v is not None for v in got.values()), "device pools too small for the requests"
            self.sources.append(got)  # type: ignore[arg-type]
        # One key per request and pool (a one-page "prompt" of the request's
        # number), and the bytes stored under it: the stored form of the
        # request's source rows, taken now, before anything can write a row.
        namespaces = {p: KeyNamespace.for_pool(self.group, p, model="kvtier-soak", extra=(str(args.seed),)) for p in OWNING}
        self.keys = {
            p: [page_keys(namespaces[p], [w] * page_size(p))[0] for w in range(args.requests + COLD_KEYS)]
            for p in OWNING
        }
        self.owner = {k: (w, p) for p, ks in self.keys.items() for w, k in enumerate(ks)}
        self.expected = {
            (w, p): {name: self.device_blob(name, rows) for name, rows in self.device_members(p, src[p][0]).items()}
            for w, src in enumerate(self.sources) for p in OWNING
        }
        self.ever_evicted: set[bytes] = set()
        self.final: SchedulerStatistics | None = None  # the scheduler's statistics as it closed

    def device_alloc(self, pool: str) -> PageAllocator:
        a = self.group[pool].device_allocator
        assert isinstance(a, PageAllocator)
        return a

    def violation(self, message: str) -> None:
        self.violations.append(message)

    def more(self) -> bool:
        # Refused operations count too: a leak that starves a pool must end the
        # run with a report, not spin on PoolExhausted.
        done = self.tally.submitted + self.tally.outcomes["exhausted"]
        return done < self.args.operations and time.monotonic() < self.deadline

    async def reclaim(self, pool: str, tier: str, slots_needed: int) -> None:
        # The engine's eviction runs elsewhere; give the other requests a turn
        # to hand pages back before kvtier retries.
        await anyio.lowlevel.checkpoint()

    async def settle(self, handle: OperationHandle, rng: random.Random) -> bool:
        """Maybe cancel ``handle``; await it; count the outcome. True on success."""
        if rng.random() < self.args.cancel_probability:
            if rng.random() < 0.5:
                await anyio.lowlevel.checkpoint()  # let it reach the executor first, sometimes
            handle.cancel()
        try:
            await handle
        except TransferFailed as exc:
            self.tally.outcomes["failed"] += 1
            if not isinstance(exc.__cause__, InjectedFault):
                # Only the executor's injected faults fail a copy here (an index
                # the engine changed after the call must not be what is copied).
                self.violation(f"operation {handle.id} failed without an injected fault: {exc!r} (cause {exc.__cause__!r})")
            return False
        except OperationCancelled:
            self.tally.outcomes["cancelled"] += 1
            return False
        self.tally.outcomes["completed"] += 1
        return True

    # -- byte checks -------------------------------------------------------------

    def compare(self, pools: tuple[str, ...], src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> None:
        for pool in pools:
            for name in (pool, *SIDECARS[pool]):
                dev = self.group[name].device
                if dev is None:
                    continue
                for j in range(dev.num_layers):
                    for p in range(len(dev.planes)):
                        t = dev.tensor(j, p)
                        a, b = t[src[name]], t[dst[name]]
                        self.tally.bytes_checked += a.numel() * a.element_size()
                        if not torch.equal(a, b):
                            self.tally.bytes_mismatched += int((a != b).sum()) * a.element_size()

    def source_rows(self, source: Mapping[str, list[int]]) -> dict[str, torch.Tensor]:
        """Device rows of a request's source pages, its sidecars' rows included,
        by pool name: what a backup of them reads."""
        return {
            name: slots_of_pages(pages, self.group[name].page_size)
            for pool, pages in source.items() for name in (pool, *SIDECARS[pool])
        }

    def check_against(self, rows: dict[str, torch.Tensor]) -> Check:
        """A load's check: its device rows against ``rows``, the rows its backup
        read (the soak's record, not what the caller's tensors say now)."""
        return lambda chosen, dst: self.compare(chosen, rows, dst)

    def device_members(self, pool: str, page: int) -> dict[str, torch.Tensor]:
        """Device rows of page ``page`` of anchor ``pool`` and its sidecars' rows
        for it, by pool name (as `kvtier.storage.page_members` for the host)."""
        out: dict[str, torch.Tensor] = {}
        if self.group[pool].device is not None:  # not the logical tok
            out[pool] = slots_of_pages([page], page_size(pool))
        for name in sorted(SIDECARS[pool]):
            k = self.group[name].page_size  # a sidecar's rows per page
            out[name] = torch.arange(page * k, page * k + k, dtype=torch.int64)
        return out

    def device_blob(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Device ``rows`` of ``name`` in the stored form (per plane, the
        ``[layers, rows, *shape]`` array), as uint8."""
        dev = self.group[name].device
        assert dev is not None
        return torch.cat([
            torch.stack([dev.tensor(j, p)[rows] for j in range(dev.num_layers)]).reshape(-1).view(torch.uint8)
            for p in range(len(dev.planes))
        ])

    def check_bytes(self, got: torch.Tensor, want: torch.Tensor, where: str) -> None:
        s = self.storage
        n = want.numel()
        if where == "store":
            s.store_bytes_checked += n
        else:
            s.bytes_checked += n
        if got.shape == want.shape and torch.equal(got, want):
            return
        bad = n if got.shape != want.shape else int((got != want).sum())
        if where == "store":
            s.store_bytes_mismatched += bad
        else:
            s.bytes_mismatched += bad

    def expected_of(self, key: bytes) -> dict[str, torch.Tensor] | None:
        w, pool = self.owner[key]
        return self.expected.get((w, pool))

    def check_prefetched_host(self, keys: Mapping[str, list[bytes]], result: PrefetchResult) -> None:
        """Every page ``result`` hands back, in host memory, against its key's rows."""
        for pool, slots in result.host_indices.items():
            pages = (slots[:: page_size(pool)] // page_size(pool)).tolist()
            for i, page in enumerate(pages):
                want = self.expected_of(keys[pool][i])
                if want is None:
                    self.violation(f"prefetch {result.id}: pool {pool!r} page {i} has a key never written")
                    continue
                blobs = encode_page(self.group, pool, page, key=keys[pool][i])
                if set(blobs) != set(want):
                    self.violation(f"prefetch {result.id}: pool {pool!r} page holds {sorted(blobs)}, not {sorted(want)}")
                    continue
                for name, blob in blobs.items():
                    self.check_bytes(torch.frombuffer(blob, dtype=torch.uint8)[BLOB_HEADER_BYTES:], want[name], "prefetch")

    def check_prefetched_load(self, keys: Mapping[str, list[bytes]]) -> Check:
        """A load's check: its device rows, page by page, against the keys' rows."""
        def check(chosen: tuple[str, ...], dst: dict[str, torch.Tensor]) -> None:
            for pool in chosen:
                for i in range(len(dst[pool]) // page_size(pool)):
                    want = self.expected_of(keys[pool][i])
                    assert want is not None  # checked in host memory before
                    for name in want:
                        k = page_size(pool) if name == pool else self.group[name].page_size
                        self.check_bytes(self.device_blob(name, dst[name][i * k:(i + 1) * k]), want[name], "prefetch")
        return check

    def check_store(self) -> None:
        """Every page in the store holds the rows of its key's request, but for
        the pages damaged (and not put again since), which may differ."""
        assert self.store is not None
        for key, blobs in self.store.pages.items():
            if self.store.is_damaged(key):
                self.storage.store_pages_damaged_at_end += 1
                continue
            self.storage.store_pages_checked += 1
            want = self.expected_of(key) if key in self.owner else None
            if want is None or set(blobs) != set(want):
                self.violation(f"the store holds key {key.hex()[:16]} that no request wrote, or the wrong pools")
                continue
            for name, blob in blobs.items():
                self.check_bytes(torch.frombuffer(bytearray(blob), dtype=torch.uint8)[BLOB_HEADER_BYTES:], want[name], "store")

    # -- backups and loads ---------------------------------------------------

    async def request(self, sched: TransferScheduler, worker: int) -> None:
        """One request's life, over and over: back up, load back, verify, evict;
        or write to the store, or prefetch from it."""
        rng = random.Random(f"{self.args.seed}:{worker}")
        source = self.sources[worker]
        storage = self.store is not None
        try:
            while self.more():
                if storage and rng.random() < self.args.damage_probability:
                    self.damage(rng)  # between rounds: the store changes a page
                if storage and rng.random() < self.args.storage_fraction:
                    await self.prefetch(sched, rng)
                    continue
                pools = rng.choice(POOL_SETS)
                device = {p: slots_of_pages(source[p], page_size(p)) for p in pools}
                try:
                    backup = await sched.backup(device)
                except PoolExhausted:
                    self.tally.outcomes["exhausted"] += 1
                    continue
                self.tally.submitted += 1
                self.tally.backups += 1
                # The soak's record; a clone, as an engine keeps one: two reads of a handle may share memory.
                host = {p: backup.host_indices[p].clone() for p in pools}
                rows = self.source_rows({p: source[p] for p in pools})
                self.reuse(rng, device, side="device")  # the engine's page table, reused at once
                changed = self.change_handle_tensors(rng, backup)
                if not backup.done() and rng.random() < self.args.realloc_probability:
                    await self.free_then_reallocate(sched, rng, worker, pools, host, backup, rows)
                    continue
                write: tuple[WriteStorageHandle, dict[str, list[bytes]]] | None = None
                writing = storage and rng.random() < self.args.storage_fraction
                if writing and rng.random() < 0.3 and not backup.done():
                    # Write before the backup finished: kvtier waits for it.
                    write = await self.write_eager(sched, rng, worker, pools, host, backup)
                    writing = False
                if not await self.settle(backup, rng):
                    if write is not None:
                        self.violation(f"write_storage {write[0].id} of failed backup {backup.id}'s pages was accepted")
                        await self.settle_write(rng, *write)
                    continue  # a backup that did not succeed gave its host pages back
                if changed:
                    self.check_handle_tensors(backup, host, rows)
                if writing:
                    write = await self.write(sched, rng, worker, pools, host)
                evicted = False
                if write is not None and rng.random() < 0.2:
                    # Host eviction while the write may still read: kvtier defers the free.
                    sched.free_host(host)
                    self.storage.host_evicted_while_writing += 1
                    evicted = True
                check = self.check_against(rows)
                for _ in range(rng.choice((0, 1, 1, 2))):
                    if evicted or not self.more():
                        break
                    evicted = await self.load(sched, rng, pools, host, check)
                if write is not None:
                    await self.settle_write(rng, *write)
                if not evicted:
                    sched.free_host(host)
        finally:
            for p, pages in source.items():
                self.device_alloc(p).free_pages(pages)

    async def load(
        self, sched: TransferScheduler, rng: random.Random, pools: tuple[str, ...],
        host: dict[str, torch.Tensor], check: Check,
    ) -> bool:
        """Load some of ``pools`` back into fresh device slots and ``check`` them.
        Returns True if the host copy was evicted meanwhile."""
        chosen = tuple(p for p in pools if rng.random() < 0.7) or pools[:1]
        # Device slots: some the engine allocates itself, the rest kvtier does.
        mine: dict[str, list[int]] = {}
        for p in chosen:
            if rng.random() < 0.5:
                got = self.device_alloc(p).try_alloc_pages(len(host[p]) // page_size(p))
                if got is not None:
                    mine[p] = got
        # The engine's buffers: it reuses them once the call returned.
        host_buffer = {p: host[p].clone() for p in chosen}
        device_buffer = {p: slots_of_pages(pages, page_size(p)) for p, pages in mine.items()}
        try:
            load = await sched.load(host_buffer, device_buffer)
        except PoolExhausted:
            self.tally.outcomes["exhausted"] += 1
            for p, pages in mine.items():
                self.device_alloc(p).free_pages(pages)
            return False
        self.tally.submitted += 1
        self.tally.loads += 1
        dst = {n: t.clone() for n, t in load.device_indices.items()}  # the soak's record of where the rows go
        self.reuse(rng, host_buffer, side="host")
        self.reuse(rng, device_buffer, side="device")
        changed = self.change_handle_tensors(rng, load)
        evicted = rng.random() < 0.25
        if evicted:
            # Host eviction while the load may still read: kvtier defers the free.
            sched.free_host(host)
            self.tally.host_evicted_in_flight += 1
        if await self.settle(load, rng):
            check(chosen, dst)
            if changed:
                self.check_handle_tensors(load, {p: host[p] for p in chosen}, dst)
            for p in chosen:  # the caller owns every destination slot now
                self.device_alloc(p).free(dst[p])
        else:
            for p, pages in mine.items():  # kvtier freed only what it allocated
                self.device_alloc(p).free_pages(pages)
        return evicted

    # -- the engine reuses its buffers -----------------------------------------

    def reuse(self, rng: random.Random, tensors: Mapping[str, torch.Tensor], *, side: str) -> None:
        """Maybe change index tensors a call took, right after it returned (the
        engine's page-table buffers): to other whole pages, or to values out of
        every range. The operation must move the rows they named at the call."""
        if not tensors or rng.random() >= self.args.reuse_probability:
            return
        self.tally.buffers_reused += 1
        for pool, t in tensors.items():
            if rng.random() < 0.5:
                spec = self.group[pool]
                t.copy_((t + page_size(pool)) % (spec.host.slots if side == "host" else spec.device_slots))
            else:
                t.fill_(1 << 40)
                t[::2] = -1

    def reuse_keys(self, rng: random.Random, keys: Mapping[str, list[bytes]]) -> None:
        """Maybe change key lists a storage call took, right after it returned."""
        if rng.random() >= self.args.reuse_probability:
            return
        self.tally.buffers_reused += 1
        for pool, ks in keys.items():
            if rng.random() < 0.5:
                ks.reverse()
                ks.append(self.keys[pool][-1])  # a key nobody writes
            else:
                ks[:] = [b""] * len(ks)

    def change_handle_tensors(self, rng: random.Random, handle: OperationHandle) -> bool:
        """Maybe scribble over the index tensors a handle handed out: the caller may."""
        if rng.random() >= self.args.reuse_probability:
            return False
        self.tally.handle_tensors_changed += 1
        for t in (*handle.host_indices.values(), *handle.device_indices.values()):
            t.fill_(-1)
        return True

    def check_handle_tensors(
        self, handle: OperationHandle, host: Mapping[str, torch.Tensor], device: Mapping[str, torch.Tensor]
    ) -> None:
        """The handle still gives the indices it had, whatever was done to the tensors it gave before."""
        got_host, got_device = handle.host_indices, handle.device_indices
        for pool, t in host.items():
            if not torch.equal(got_host[pool], t):
                self.violation(f"operation {handle.id}: host_indices of {pool!r} changed after the caller changed a copy")
        for name, t in device.items():
            if name in got_device and not torch.equal(got_device[name], t):
                self.violation(f"operation {handle.id}: device_indices of {name!r} changed after the caller changed a copy")

    # -- free, then reallocate, while a reader waits -------------------------------

    async def free_then_reallocate(
        self, sched: TransferScheduler, rng: random.Random, worker: int, pools: tuple[str, ...],
        host: dict[str, torch.Tensor], backup: OperationHandle, rows: dict[str, torch.Tensor],
    ) -> None:
        """A load or write_storage of ``backup``'s pages waits for it; the
        request frees the pages meanwhile (kvtier defers that), and the moment
        the backup ends, before the waiting reader runs, it backs up another
        request's rows, which the allocator hands the freed page numbers. The
        reader must fail (`InvalidIndices`; `TransferFailed` if the backup
        failed) unless it was admitted before the free; what it loads or
        stores is checked byte for byte against this request's rows."""
        t = self.tally
        t.realloc_readers += 1
        other = self.sources[(worker + 1) % self.args.requests]
        write = self.store is not None and rng.random() < 0.5
        indices, keys = self.write_keys(rng, worker, pools, host)
        chosen = tuple(indices)
        side_rng = random.Random(rng.random())  # the other tasks' own draws
        got: dict[str, Any] = {}

        async def reallocate() -> None:
            await backup.settled()
            # Nothing is awaited from here to backup_nowait: the next backup
            # takes the freed pages before the reader (woken after this task) looks.
            try:
                nxt = sched.backup_nowait({p: slots_of_pages(other[p], page_size(p)) for p in pools})
            except (PoolExhausted, anyio.WouldBlock):
                t.realloc_outcomes["next backup refused"] += 1
                return
            t.submitted += 1
            t.backups += 1
            taken = {p: nxt.host_indices[p] for p in pools}
            t.realloc_same_pages += any(set(taken[p].tolist()) & set(host[p].tolist()) for p in pools)
            if await self.settle(nxt, side_rng):
                sched.free_host(taken)

        async def read() -> None:
            try:
                if write:
                    asked = {p: list(k) for p, k in keys.items()}
                    got["write"] = await sched.write_storage({p: x.clone() for p, x in indices.items()}, asked)
                    self.reuse_keys(side_rng, asked)
                else:
                    got["load"] = load = await sched.load({p: host[p].clone() for p in chosen})
                    got["dst"] = load.device_indices
            except (InvalidIndices, TransferFailed, PoolExhausted) as exc:
                got["error"] = exc
            finally:
                got["returned"] = True

        async with anyio.create_task_group() as tg:
            tg.start_soon(reallocate)
            await anyio.lowlevel.checkpoint()  # it waits for the backup before the reader does
            tg.start_soon(read)
            await anyio.lowlevel.checkpoint()  # the reader is admitted, or waits for the backup
            admitted = "returned" in got
            if not (backup.done() and backup.exception() is not None):
                sched.free_host(host)  # deferred while the backup writes the pages
        ok = await self.settle(backup, side_rng)  # done by now
        error = got.get("error")
        if isinstance(error, InvalidIndices):
            t.realloc_outcomes["refused (InvalidIndices)"] += 1
            if error.rule not in ("page-generation", "host-pages-held"):
                self.violation(f"a reader of freed pages was refused with rule {error.rule!r}: {error}")
        elif isinstance(error, TransferFailed):
            t.realloc_outcomes["failed (TransferFailed)"] += 1
            if ok:
                self.violation(f"a reader of backup {backup.id}'s pages raised {error!r}, but the backup completed")
        elif isinstance(error, PoolExhausted):
            t.outcomes["exhausted"] += 1
        else:
            # Admitted: it reads this request's rows (checked), never the next backup's.
            t.realloc_outcomes["admitted before the free" if admitted else "admitted while the free was pending"] += 1
            if not ok:
                self.violation(f"a reader of backup {backup.id}'s pages was admitted, but the backup failed")
            t.submitted += 1
            if write:
                self.storage.writes += 1
                await self.settle_write(side_rng, got["write"], keys)
            else:
                t.loads += 1
                if await self.settle(got["load"], side_rng):
                    self.check_against(rows)(chosen, got["dst"])
                    for p in chosen:
                        self.device_alloc(p).free(got["dst"][p])

    # -- the storage tier ----------------------------------------------------

    def damage(self, rng: random.Random) -> None:
        """The shared store damages a stored page: a byte of one blob flipped
        (first, middle, last or any), a blob lost, its commit record spoiled,
        another page of the same pools copied under its key (key swap), or one
        blob replaced by another page's blob of the same pool (blob splice)."""
        store = self.store
        assert store is not None
        if not store.pages:
            return
        keys = list(store.pages)
        key = rng.choice(keys)
        blobs = store.pages[key]
        kind = rng.choice(("flip", "flip", "drop", "malform", "swap", "splice"))
        pool = rng.choice(sorted(blobs)) if blobs else None
        others = [k for k in keys if k != key and set(store.pages[k]) == set(blobs)] if kind in ("swap", "splice") else []
        if kind == "flip" and pool is not None and blobs[pool]:
            n = len(blobs[pool])
            store.corrupt(key, pool, rng.choice((0, n // 2, n - 1, rng.randrange(n))))
        elif kind == "drop" and pool is not None:
            store.drop_part(key, pool)
        elif kind == "swap" and others:
            store.swap(key, rng.choice(others))
        elif kind == "splice" and others and pool is not None:
            store.splice(key, pool, rng.choice(others))
        else:
            kind = "malform"
            store.malform(key)
        store.note_damage()
        self.storage.damage_between_rounds[kind] += 1

    async def progress(self) -> None:
        """A line a second on a terminal while the requests run (cancelled with them)."""
        t0 = time.monotonic()
        while True:
            await anyio.sleep(1.0)
            done = self.tally.submitted + self.tally.outcomes["exhausted"]
            total = "" if self.args.operations == sys.maxsize else f" of {self.args.operations}"
            print(f"[{time.monotonic() - t0:6.1f} s] soak: {done}{total} operations, "
                  f"{len(self.violations)} violations", file=sys.stderr, flush=True)

    async def closing_damage_round(self, sched: TransferScheduler, pages: int = 3) -> None:
        """Once the requests are done, with faults off: damage a few stored
        pages that read back whole (in turn a byte flipped, another page of the
        same pools copied under the key, one blob spliced in from another
        page), prefetch each (it must be a miss, counted as rejected,
        and its key marked to rewrite), write it again from its request's rows
        (it must be put although present, which repairs it), and prefetch it
        again (it must come back byte-exact). The random rounds reach these
        paths only when timing lets them; this round reaches them every run."""
        store = self.store
        assert store is not None
        self.executor.fail_probability = 0.0
        store.fail_probability = store.corrupt_probability = 0.0
        # Batches of operations the requests gave up on (cancelled in flight)
        # may still run: one could repair a flipped page, or read it, before
        # the round's own prefetch. Start from an idle scheduler.
        with anyio.fail_after(30):
            while (st := sched.statistics()).batches_in_flight or any(
                    lane.queue_depth for lane in (st.backup, st.load, st.write_storage, st.prefetch)):
                await anyio.sleep(0.001)
        c = self.closing
        candidates = [k for k in sorted(store.pages) if self.owner[k][0] < self.args.requests
                      and not store.is_damaged(k) and all(store.pages[k].values())]
        j = 0
        for key in candidates:
            if j == pages:
                break
            w, pool = self.owner[key]
            # A key the scheduler still has to rewrite (a read rejected it while a
            # write repaired it: the rejection landed last) is a miss already;
            # damage only pages that read back whole now.
            check = await self.closing_prefetch(sched, pool, key)
            if check.host_indices:
                sched.free_host(dict(check.host_indices))
            if check.pages.get(pool) != 1:
                continue
            j += 1
            blobs = store.pages[key]
            name = sorted(blobs)[0]
            before = sched.statistics().storage
            assert before is not None
            # A flipped byte, then another page of the same pools copied under
            # the key, then one of its blobs taken from another page: the last
            # two pass their own checksums, and only the key binding refuses them.
            kind = ("flip", "swap", "splice")[(j - 1) % 3]
            others = [k for k in sorted(store.pages) if k != key and set(store.pages[k]) == set(blobs)
                      and store.pages[k] != blobs]
            if kind != "flip" and not others:
                kind = "flip"
            if kind == "flip":
                store.corrupt(key, name, len(blobs[name]) // 2)
            elif kind == "swap":
                store.swap(key, others[0])
            else:
                store.splice(key, name, others[0])
            store.note_damage()
            c["damaged"] += 1
            c[kind] += 1
            got = await self.closing_prefetch(sched, pool, key)
            after = sched.statistics().storage
            assert after is not None
            if got.pages.get(pool, 0) or after.pages_rejected != before.pages_rejected + 1:
                self.violation(f"closing round: a damaged page ({kind}) of {pool!r} (blob {name!r} of {len(blobs[name])} bytes) was handed back ({dict(got.pages)} of {dict(got.hit_pages)} hit) or not "
                               f"counted as rejected ({before.pages_rejected} -> {after.pages_rejected})")
                if got.host_indices:
                    sched.free_host(dict(got.host_indices))
                continue
            c["rejected"] += 1
            backup = await sched.backup({pool: slots_of_pages(self.sources[w][pool], page_size(pool))})
            await backup
            self.tally.submitted += 1
            self.tally.backups += 1
            self.tally.outcomes["completed"] += 1
            repairs = store.repairs
            written = await (await sched.write_storage({pool: backup.host_indices[pool]}, {pool: [key]}))
            self.tally.submitted += 1
            self.storage.writes += 1
            self.storage.write_outcomes["done"] += 1
            sched.free_host({pool: backup.host_indices[pool]})
            if written.pages_written.get(pool) != 1 or store.repairs != repairs + 1 or store.is_damaged(key):
                self.violation(f"closing round: the write of a rejected key of {pool!r} did not repair it "
                               f"(written {written.pages_written}, repairs {repairs} -> {store.repairs})")
                continue
            c["repaired"] += 1
            again = await self.closing_prefetch(sched, pool, key)
            if again.pages.get(pool) != 1:
                self.violation(f"closing round: the repaired page of {pool!r} was not found ({again.pages})")
            else:
                checked = self.storage.bytes_checked
                self.check_prefetched_host({pool: [key]}, again)
                c["read back"] += self.storage.bytes_checked > checked
            if again.host_indices:
                sched.free_host(dict(again.host_indices))

    async def closing_prefetch(self, sched: TransferScheduler, pool: str, key: bytes) -> PrefetchResult:
        result = await (await sched.prefetch({pool: [key]}, policy="wait_complete"))
        self.tally.submitted += 1
        self.storage.prefetches += 1
        self.storage.policies["wait_complete"] += 1
        self.storage.prefetch_outcomes["complete" if result.complete else "short hit"] += 1
        return result

    def evict(self, rng: random.Random, keys: list[bytes] | None = None) -> None:
        """Drop a stored page (one of ``keys``, or any): the store's eviction."""
        assert self.store is not None
        candidates = [k for k in keys if k in self.store.pages] if keys is not None else list(self.store.pages)
        if candidates:
            key = rng.choice(candidates)
            del self.store.pages[key]
            self.ever_evicted.add(key)
            self.storage.evictions += 1

    def write_keys(
        self, rng: random.Random, worker: int, pools: tuple[str, ...], host: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, list[bytes]]]:
        chosen = tuple(p for p in pools if rng.random() < 0.8) or pools[:1]
        return {p: host[p] for p in chosen}, {p: [self.keys[p][worker]] for p in chosen}

    async def write(
        self, sched: TransferScheduler, rng: random.Random, worker: int, pools: tuple[str, ...],
        host: Mapping[str, torch.Tensor],
    ) -> tuple[WriteStorageHandle, dict[str, list[bytes]]]:
        indices, keys = self.write_keys(rng, worker, pools, host)
        asked, buffers = {p: list(k) for p, k in keys.items()}, {p: x.clone() for p, x in indices.items()}
        handle = await sched.write_storage(buffers, asked)
        self.reuse(rng, buffers, side="host")
        self.reuse_keys(rng, asked)
        self.tally.submitted += 1
        self.storage.writes += 1
        return handle, keys

    async def write_eager(
        self, sched: TransferScheduler, rng: random.Random, worker: int, pools: tuple[str, ...],
        host: Mapping[str, torch.Tensor], backup: OperationHandle,
    ) -> tuple[WriteStorageHandle, dict[str, list[bytes]]] | None:
        """A write of pages ``backup`` still writes: kvtier waits for it, and
        refuses (TransferFailed) if it fails. Sometimes given up while waiting."""
        indices, keys = self.write_keys(rng, worker, pools, host)
        abandon = rng.random() < 0.1
        handle = None
        with anyio.CancelScope() as scope:
            if abandon:
                scope.cancel()
            try:
                handle = await sched.write_storage({p: x.clone() for p, x in indices.items()}, {p: list(k) for p, k in keys.items()})
            except TransferFailed:
                self.storage.write_refused += 1
                if not backup.done():
                    self.violation(f"write_storage refused while backup {backup.id} was still running")
                return None
        if handle is None:
            self.storage.write_abandoned += 1
            return None
        if not backup.done():
            self.violation(f"write_storage accepted before backup {backup.id} finished")
        self.tally.submitted += 1
        self.storage.writes += 1
        return handle, keys

    async def settle_write(self, rng: random.Random, handle: WriteStorageHandle, keys: dict[str, list[bytes]]) -> None:
        assert self.store is not None
        s = self.storage
        cancelled = False
        if rng.random() < self.args.cancel_probability:
            if rng.random() < 0.5:
                await anyio.lowlevel.checkpoint()
            cancelled = handle.cancel()
        try:
            result = await handle
        except OperationCancelled:
            s.write_outcomes["cancelled"] += 1
            if not cancelled:
                self.violation(f"write_storage {handle.id} raised OperationCancelled, but was not cancelled")
            return
        except StorageError as exc:
            s.write_outcomes["failed"] += 1
            if cancelled:
                self.violation(f"write_storage {handle.id} was cancelled, but raised {type(exc).__name__}")
            return
        except Exception as exc:  # noqa: BLE001 - a soak counts what it did not expect
            s.write_outcomes["other error"] += 1
            self.violation(f"write_storage {handle.id} raised {exc!r}")
            return
        s.write_outcomes["done"] += 1
        if cancelled:
            self.violation(f"write_storage {handle.id} was cancelled (cancel() returned True), but completed")
        self.check_write_result(result, keys)

    def check_write_result(self, result: WriteStorageResult, keys: dict[str, list[bytes]]) -> None:
        assert self.store is not None
        for pool, ks in keys.items():
            n = result.pages.get(pool)
            w, p = result.pages_written.get(pool, -1), result.pages_present.get(pool, -1)
            if n != len(ks) or w < 0 or p < 0 or w + p != n:
                self.violation(f"write_storage {result.id} pool {pool!r}: pages {n}, written {w}, present {p} "
                               f"for {len(ks)} keys")
            self.storage.pages_written += max(w, 0)
            self.storage.pages_present += max(p, 0)
            for key in ks:
                if key not in self.store.pages and key not in self.ever_evicted:
                    self.violation(f"write_storage {result.id} completed, but key {key.hex()[:16]} is not stored")

    async def prefetch(self, sched: TransferScheduler, rng: random.Random) -> None:
        """Prefetch a run of other requests' keys per pool, stop or cancel it
        maybe, check what came, then load it, write it back or free it."""
        assert self.store is not None
        s = self.storage
        pools = rng.choice(POOL_SETS)
        keys: dict[str, list[bytes]] = {}
        for p in pools:
            workers = rng.sample(range(self.args.requests), min(self.args.requests, rng.randint(1, 3)))
            if rng.random() < 0.1:  # a page nobody wrote ends the run there
                workers.insert(rng.randrange(len(workers) + 1), self.args.requests + rng.randrange(COLD_KEYS))
            keys[p] = [self.keys[p][w] for w in workers]
        policy = rng.choice(POLICIES)
        timeout_s = rng.uniform(0.0005, 0.02) if policy == "timeout" else None
        if rng.random() < 0.1:
            self.evict(rng)
        asked = {p: list(k) for p, k in keys.items()}  # the engine's lists, reused once the call returned
        try:
            handle = await sched.prefetch(asked, policy=policy, timeout_s=timeout_s)
        except PoolExhausted:
            self.tally.outcomes["exhausted"] += 1
            return
        self.reuse_keys(rng, asked)
        self.tally.submitted += 1
        s.prefetches += 1
        s.policies[policy] += 1
        if rng.random() < 0.1:
            self.evict(rng, [k for ks in keys.values() for k in ks])  # while its lookup or read may run
        cancelled = stopped = False
        r = rng.random()
        if r < self.args.cancel_probability:
            if rng.random() < 0.5:
                await anyio.lowlevel.checkpoint()
            cancelled = handle.cancel()
        elif r < 0.5 and policy != "wait_complete":
            for _ in range(rng.randrange(5)):
                await anyio.lowlevel.checkpoint()
            stopped = handle.stop()
            s.stop_calls += stopped
        elif r < 0.55 and policy == "wait_complete":
            try:
                handle.stop()
                self.violation(f"stop() of wait_complete prefetch {handle.id} did not raise ValueError")
            except ValueError:
                pass
        try:
            result = await handle
        except OperationCancelled:
            s.prefetch_outcomes["cancelled"] += 1
            if not cancelled:
                self.violation(f"prefetch {handle.id} raised OperationCancelled, but was not cancelled")
            return
        except StorageError as exc:
            s.prefetch_outcomes["failed"] += 1
            if cancelled:
                self.violation(f"prefetch {handle.id} was cancelled, but raised {type(exc).__name__}")
            if stopped:
                # stop() returned True: `await handle` must give the pages done so far.
                s.prefetch_outcomes["failed after stop()"] += 1
                self.violation(f"prefetch {handle.id}: stop() returned True, then it raised {exc!r}")
            return
        except Exception as exc:  # noqa: BLE001 - a soak counts what it did not expect
            s.prefetch_outcomes["other error"] += 1
            self.violation(f"prefetch {handle.id} raised {exc!r}")
            return
        if cancelled:
            self.violation(f"prefetch {handle.id} was cancelled (cancel() returned True), but completed")
        self.check_prefetch_result(handle.id, policy, keys, result)
        if result.stopped:
            s.prefetch_outcomes["stopped early"] += 1
            s.prefetch_outcomes["stopped by stop()" if stopped else "stopped by its deadline"] += 1
            if not stopped and policy != "timeout":
                self.violation(f"prefetch {handle.id} ({policy}) stopped early, but nothing stopped it")
        else:
            s.prefetch_outcomes["complete" if result.complete else "short hit"] += 1
            s.stop_unheeded += stopped
        s.pages_requested += sum(result.requested_pages.values())
        s.pages_hit += sum(result.hit_pages.values())
        s.pages_fetched += sum(result.pages.values())
        if not result.host_indices:
            return
        self.check_prefetched_host(keys, result)
        host = dict(result.host_indices)
        held = tuple(host)
        if rng.random() < 0.1:
            # Write them back: stored already (unless evicted since), so mostly skipped.
            indices = {p: host[p] for p in held}
            wkeys = {p: keys[p][: result.pages[p]] for p in held}
            buffers, asked = {p: x.clone() for p, x in indices.items()}, {p: list(k) for p, k in wkeys.items()}
            write = await sched.write_storage(buffers, asked)
            self.reuse(rng, buffers, side="host")
            self.reuse_keys(rng, asked)
            self.tally.submitted += 1
            s.writes += 1
            await self.settle_write(rng, write, wkeys)
        evicted = False
        check = self.check_prefetched_load(keys)
        for _ in range(rng.choice((0, 1, 1, 2))):
            if evicted or not self.more():
                break
            s.prefetched_loads += 1
            evicted = await self.load(sched, rng, held, host, check)
        if not evicted:
            sched.free_host(host)

    def check_prefetch_result(
        self, op: int, policy: str, keys: Mapping[str, list[bytes]], result: PrefetchResult
    ) -> None:
        def bad(what: str) -> None:
            self.violation(f"prefetch {op} ({policy}): {what}; {result!r:.300}")

        if result.id != op:
            bad("result of another operation")
        if dict(result.requested_pages) != {p: len(k) for p, k in keys.items()}:
            bad("requested_pages differ from the keys")
        if set(result.pages) != set(keys) or set(result.hit_pages) != set(keys):
            bad("pages or hit_pages name other pools")
            return
        for p, ks in keys.items():
            n, hit = result.pages[p], result.hit_pages[p]
            if not 0 <= n <= hit <= len(ks):
                bad(f"pool {p!r}: not 0 <= pages {n} <= hit {hit} <= requested {len(ks)}")
            if (p in result.host_indices) != (n > 0):
                bad(f"pool {p!r}: host_indices {'has' if p in result.host_indices else 'lacks'} it with {n} pages")
            elif n and len(result.host_indices[p]) != n * page_size(p):
                bad(f"pool {p!r}: {len(result.host_indices[p])} host slots for {n} pages")
            cold = [i for i, k in enumerate(ks) if self.owner[k][0] >= self.args.requests]
            if cold and n > cold[0]:
                bad(f"pool {p!r}: {n} pages though key {cold[0]} was never written")
        if set(result.host_indices) - set(keys):
            bad("host_indices name other pools")
        if result.stopped != any(result.pages[p] < result.hit_pages[p] for p in keys):
            bad("stopped disagrees with pages < hit_pages")
        if policy == "wait_complete" and result.stopped:
            bad("a wait_complete prefetch stopped early")
        if result.complete != all(result.pages[p] == len(k) for p, k in keys.items()):
            bad("complete disagrees with pages == requested")

    def count_store_faults(self) -> None:
        """Move the store's fault log into the tally. Each logged error keeps its
        traceback, and with it the frames of the failed batch (its handles and
        blobs): kept for the whole run, they would grow resident memory by a few
        KiB per fault and hide what kvtier itself holds on to."""
        assert self.store is not None
        for f in self.store.faults:
            self.storage.store_faults[f.operation] += 1
            self.storage.store_timeouts += isinstance(f.error, StorageTimeout)
        self.store.faults.clear()

    async def stalls(self) -> None:
        """Now and then hold the store's calls at its gate for a few milliseconds
        (all of them, or one operation's), letting some through one by one."""
        assert self.store is not None
        rng = random.Random(f"{self.args.seed}:stalls")
        try:
            while True:
                await anyio.sleep(rng.uniform(0.002, 0.03))
                self.count_store_faults()
                self.store.hold(rng.choice((("exists",), ("get",), ("put",), ("exists", "get", "put"))))
                self.storage.stalls += 1
                for _ in range(rng.randrange(4)):
                    await anyio.sleep(rng.uniform(0.0005, 0.003))
                    self.store.step()
                self.store.release()
        finally:
            self.store.release()

    # -- the run -------------------------------------------------------------

    async def run(self) -> tuple[int, dict[str, int]]:
        args = self.args
        self.deadline = time.monotonic() + args.seconds if args.seconds else float("inf")
        config = SchedulerConfig(max_batch_ops=args.max_batch_ops, storage_chunk_bytes=args.storage_chunk_bytes)
        async with TransferScheduler(
            self.group, executor=self.executor, config=config, reclaim=self.reclaim, storage=self.store
        ) as sched:
            async with anyio.create_task_group() as outer:
                if self.store is not None:
                    outer.start_soon(self.stalls)
                if not args.quiet and sys.stderr.isatty():
                    outer.start_soon(self.progress)
                async with anyio.create_task_group() as tg:
                    for w in range(args.requests):
                        tg.start_soon(self.request, sched, w)
                outer.cancel_scope.cancel()
            if self.store is not None:
                await self.closing_damage_round(sched)
            stats = sched.statistics()
        self.final = stats
        leaked: dict[str, int] = {}
        for pool in OWNING:
            host = self.group[pool].host.allocator
            assert host is not None
            leaked[f"{pool} host"] = host.num_used_slots
            leaked[f"{pool} device"] = self.device_alloc(pool).num_used_slots
        leaked["deferred frees"] = stats.deferred_host_frees
        if self.store is not None:
            leaked["held store calls"] = len(self.store.waiting)
            self.count_store_faults()
            self.check_store()
            s = self.storage
            for name, lane, mine in (
                ("write_storage", stats.write_storage, (s.writes, s.write_outcomes["done"],
                                                        s.write_outcomes["failed"] + s.write_outcomes["other error"],
                                                        s.write_outcomes["cancelled"])),
                ("prefetch", stats.prefetch, (s.prefetches, sum(s.prefetch_outcomes[k] for k in ("complete", "short hit", "stopped early")),
                                              s.prefetch_outcomes["failed"] + s.prefetch_outcomes["other error"],
                                              s.prefetch_outcomes["cancelled"])),
            ):
                theirs = (lane.submitted, lane.completed, lane.failed, lane.cancelled)
                if theirs != mine:
                    self.violation(f"{name} statistics (submitted, completed, failed, cancelled) {theirs}, "
                                   f"the soak counted {mine}")
                if lane.queue_depth:
                    self.violation(f"{name} lane still has {lane.queue_depth} queued")
        return sum(leaked.values()), leaked


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--operations", type=int, default=None,
                    help="stop after this many operations, those refused with PoolExhausted included "
                         "(default 10000, or no limit with --seconds)")
    ap.add_argument("--seconds", type=float, default=0.0, help="stop after this many seconds (default: no time limit)")
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests (default 64)")
    ap.add_argument("--fail-probability", type=float, default=0.05, help="chance a batch fails (default 0.05)")
    ap.add_argument("--cancel-probability", type=float, default=0.05, help="chance an operation is cancelled (default 0.05)")
    ap.add_argument("--host-fraction", type=float, default=0.75,
                    help="host pages per pool as a fraction of the requests: below 1 makes allocations run short")
    ap.add_argument("--max-batch-ops", type=int, default=64, help="SchedulerConfig.max_batch_ops (default 64)")
    ap.add_argument("--storage-fraction", type=float, default=0.25,
                    help="chance a request's round is a prefetch from the store, and that a backup is also written "
                         "to it (default 0.25; 0 runs without a storage tier)")
    ap.add_argument("--storage-fail-probability", type=float, default=0.05,
                    help="chance a store call fails, half of them as timeouts (default 0.05)")
    ap.add_argument("--corrupt-probability", type=float, default=0.05,
                    help="chance a page the store commits is damaged at once (a byte flipped, a blob lost or its "
                         "record spoiled: MemoryStore corrupt_probability; default 0.05)")
    ap.add_argument("--damage-probability", type=float, default=0.02,
                    help="chance a request damages a random stored page between its rounds (default 0.02)")
    ap.add_argument("--realloc-probability", type=float, default=0.05,
                    help="chance a round frees its backup's pages while a load or write of them waits for the backup, "
                         "and backs up other rows the moment it ends (default 0.05)")
    ap.add_argument("--reuse-probability", type=float, default=0.2,
                    help="chance the engine changes index tensors or key lists right after a call took them, or the "
                         "tensors a handle gave it (default 0.2)")
    ap.add_argument("--storage-chunk-bytes", type=int, default=8192,
                    help="SchedulerConfig.storage_chunk_bytes: small, so reads and writes take several rounds "
                         "(default 8192)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true",
                    help="no progress lines while it runs (they go to a terminal only anyway)")
    args = ap.parse_args(argv)
    if args.operations is None:
        args.operations = sys.maxsize if args.seconds else 10_000
    if args.operations < 1 or args.requests < 1 or args.seconds < 0 or args.storage_chunk_bytes < 1:
        ap.error("--operations, --requests and --storage-chunk-bytes must be >= 1 and --seconds >= 0")
    for name in ("fail_probability", "cancel_probability", "storage_fraction", "storage_fail_probability",
                 "corrupt_probability", "damage_probability", "realloc_probability", "reuse_probability"):
        if not 0 <= getattr(args, name) <= 1:
            ap.error("probabilities and fractions must be in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # Failed batches log warnings by design; a soak run reports counts instead.
    logging.getLogger("kvtier").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    soak = Soak(args)
    rss_start = rss_mib()
    t0 = time.perf_counter()
    leaked, where = anyio.run(soak.run)
    seconds = time.perf_counter() - t0
    rss_end, rss_peak = rss_mib(), rss_mib("VmHWM")
    t = soak.tally
    o = t.outcomes
    s = soak.storage
    print(f"soak: seed {args.seed}, {args.requests} concurrent requests, fail probability {args.fail_probability}, "
          f"cancel probability {args.cancel_probability}, storage fraction {args.storage_fraction}, "
          f"storage fail probability {args.storage_fail_probability if soak.store is not None else '-'}")
    done = t.submitted + o["exhausted"]
    print(f"operations done: {done} ({t.backups} backups, {t.loads} loads, {s.writes} storage writes and "
          f"{s.prefetches} prefetches submitted, {o['exhausted']} refused with PoolExhausted) in {seconds:.1f} s "
          f"({done / seconds:.0f} operations/s)")
    print(f"outcomes: {o['completed']} completed, {o['failed']} failed, {o['cancelled']} cancelled; "
          f"{t.host_evicted_in_flight} host evictions while a load was in flight")
    print(f"faults injected: {soak.executor.faults_injected} (in {soak.executor.batches_seen} batches)")
    if soak.store is not None:
        w, p = s.write_outcomes, s.prefetch_outcomes
        print(f"storage writes: {w['done']} done, {w['failed']} failed, {w['cancelled']} cancelled "
              f"({s.pages_written} pages written, {s.pages_present} already present); {s.write_refused} refused "
              f"(their backup failed), {s.write_abandoned} abandoned while waiting for their backup, "
              f"{s.host_evicted_while_writing} host evictions while a write was in flight")
        print(f"prefetches: {p['complete']} complete, {p['short hit']} shorter (a key missing), "
              f"{p['stopped early']} stopped early ({p['stopped by stop()']} by stop(), {p['stopped by its deadline']} "
              f"by their deadline), {p['failed']} failed, {p['cancelled']} cancelled; "
              f"policies {dict(sorted(s.policies.items()))}")
        print(f"prefetch stops: {s.stop_calls} stop() calls that returned True; after {s.stop_unheeded} of them every "
              f"hit page came anyway (the stop landed during the last round), after {p['failed after stop()']} the prefetch failed")
        print(f"prefetched pages: {s.pages_fetched} handed back of {s.pages_hit} hit and {s.pages_requested} "
              f"requested; {s.prefetched_loads} loads of prefetched pages")
        faults = s.store_faults
        print(f"storage faults injected: {faults.total()} ({s.store_timeouts} timeouts; "
              f"{', '.join(f'{n} in {op}' for op, n in sorted(faults.items())) or 'none'}) in {soak.store.calls} "
              f"calls; {s.stalls} stalls, {s.evictions} evictions")
        print(f"storage bytes mismatched: {s.bytes_mismatched} (of {s.bytes_checked} prefetched bytes compared); "
              f"store {s.store_bytes_mismatched} (of {s.store_bytes_checked} bytes in {s.store_pages_checked} pages)")
        damage = Counter(c.kind for c in soak.store.corruptions)
        drawn = sum(c.drawn for c in soak.store.corruptions)
        assert soak.final is not None and soak.final.storage is not None
        st = soak.final.storage
        print(f"store damage: {len(soak.store.corruptions)} pages damaged ({drawn} as the store committed them, "
              f"{len(soak.store.corruptions) - drawn} between rounds; {damage['flip']} flipped, {damage['drop']} dropped, "
              f"{damage['malform']} malformed, {damage['swap']} swapped under another key, {damage['splice']} spliced); {st.pages_rejected} pages rejected by prefetches, "
              f"{soak.store.repairs} repaired by writes, {st.keys_to_rewrite} keys still to rewrite, "
              f"{s.store_pages_damaged_at_end} pages still damaged at the end (not compared)")
        c = soak.closing
        print(f"closing damage round: {c['damaged']} pages damaged ({c['flip']} flipped, {c['swap']} swapped, "
              f"{c['splice']} spliced), {c['rejected']} rejected by prefetches, "
              f"{c['repaired']} repaired by writes, {c['read back']} read back byte-exact")
    r = t.realloc_outcomes
    print(f"free-then-reallocate: {t.realloc_readers} readers waited for a backup whose pages were freed "
          f"({t.realloc_same_pages} times the next backup was handed the freed page numbers): "
          f"{r['refused (InvalidIndices)']} refused (InvalidIndices), {r['failed (TransferFailed)']} failed "
          f"(TransferFailed), {r['admitted before the free']} admitted before the free, "
          f"{r['admitted while the free was pending']} admitted while it was pending; "
          f"{r['next backup refused']} next backups refused")
    print(f"index buffers reused after submit: {t.buffers_reused} calls' index tensors or key lists changed, "
          f"{t.handle_tensors_changed} handles' index tensors changed")
    print(f"leaked slots: {leaked}" + ("" if not leaked else f" {where}"))
    mismatched = t.bytes_mismatched + s.bytes_mismatched + s.store_bytes_mismatched
    compared = t.bytes_checked + s.bytes_checked + s.store_bytes_checked
    print(f"wrong bytes found: {mismatched} (of {compared} bytes checked: {t.bytes_checked} in device loads, "
          f"{s.bytes_checked} in prefetched pages, {s.store_bytes_checked} in stored pages)")
    print(f"bytes mismatched: {mismatched} (of {compared} compared)")
    print(f"contract violations: {len(soak.violations)}")
    for v in soak.violations[:10]:
        print(f"  violation: {v}")
    print(f"resident memory: start {rss_start:.1f} MiB, end {rss_end:.1f} MiB, peak {rss_peak:.1f} MiB")
    return 1 if leaked or mismatched or soak.violations else 0


if __name__ == "__main__":
    sys.exit(main())
