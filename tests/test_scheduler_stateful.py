"""A Hypothesis state machine over TransferScheduler's slot accounting.

The scheduler runs on an event loop in a background thread (an anyio blocking
portal); each rule calls into that loop and returns once the loop is quiet.
Copies either finish inside the rule that submitted them, or, while the rules
hold the executor (`FaultInjectingExecutor.hold`), stay queued or in flight
until a `release` or `close` rule. So which operations share a batch, and so
which batches the executor's seeded random faults hit, is the same on every
run of an example, and Hypothesis can shrink a failure. Storage operations go
to a `MemoryStore` (seeded faults too): while the rules hold the executor they
hold the store's calls at its gate, and let them through one at a time (a
step, or one after another when released), each followed by what it sets off,
so their order is the same on every run as well.

A model on the test side says who owns every host page and every device page
that the device allocators hand out: free, an operation in flight, or the
caller. After every step the allocators must agree with it page for page; every
operation that ended must have ended as the model predicts (success with every
byte in place, or `TransferFailed` / `OperationCancelled` / `SchedulerClosed` /
`PoolExhausted`), and its handle resolved exactly once. At the end everything is
given back and every pool's free count must equal its capacity.

Storage keys are content addresses here too (a key names one source page), so
the model knows the bytes under every key (from the source rows, at set-up):
the store must hold exactly those, whole, but for the pages a rule damaged and
nothing put again since, and every page a prefetch hands back must hold them,
byte for byte. A prefetch holds one host page per key until its lookup, then
the hit pages, and hands back exactly the pages its result names; a write pins
the pages it reads.

The store damages pages (a byte flipped, a blob dropped, a record malformed):
the model knows which, and which keys the scheduler found bad and will put
again (or that it cannot tell, after operations that ran together). A prefetch
that ran alone must hand back exactly the run up to the first key missing,
known bad, or failing its checksum, and a write that ran alone must put exactly
the keys missing or known bad (repairing them) and find the others stored.

Index sets are values: the engine changes its index tensors and key lists
right after each call, and the tensors handles give it; every byte check uses
the model's record of what the call named. A page freed while a reader waits
for its backup and handed to the next backup the moment that one ends is a new
life: the reader fails and reads nothing from it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch
from blockbuster import BlockBuster, BlockingError
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvtier import (
    InvalidIndices,
    OperationCancelled,
    PoolExhausted,
    SchedulerClosed,
    SchedulerConfig,
    TransferFailed,
    TransferScheduler,
)
from kvtier.pools import PageAllocator, slots_of_pages
from kvtier.scheduler import (
    OperationHandle,
    OperationResult,
    PrefetchHandle,
    PrefetchResult,
    StorageHandle,
    WriteStorageHandle,
    WriteStorageResult,
)
from kvtier.scheduler.carriers import Carrier
from kvtier.scheduler.storage import StorageCarrier
from kvtier.storage import PageBlobs, StorageError, StorageTimeout, encode_page
from kvtier.testing import (
    FaultInjectingExecutor,
    FaultRecord,
    InjectedFault,
    MemoryStore,
    StoreCorruption,
    StoreFault,
    hybrid_group,
)

# -- the test kit's seeded faults, which the machine relies on ------------------


async def _run_batches(ex: FaultInjectingExecutor, n: int) -> None:
    group = hybrid_group()
    async with TransferScheduler(group, executor=ex, config=SchedulerConfig(max_batch_ops=1)) as sched:
        for i in range(n):
            idx = torch.arange(8 * (i % 8), 8 * (i % 8) + 8)
            h = await sched.backup({"kv": idx, "swa": idx, "tok": idx, "state": torch.tensor([i % 16])})
            try:
                await h
            except TransferFailed as exc:
                assert isinstance(exc.__cause__, InjectedFault)
                continue  # a failed backup gave its host pages back itself
            sched.free_host({name: h.host_indices[name] for name in ("kv", "swa", "tok", "state")})


async def test_random_faults_are_reproducible_from_the_seed() -> None:
    runs = []
    for seed in (7, 7, 8):
        ex = FaultInjectingExecutor(fail_probability=0.5, seed=seed)
        await _run_batches(ex, 24)
        runs.append(ex.faults)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert 0 < len(runs[0]) < 24
    # Faults land at random layers, and some at a pool's copy within a layer.
    assert len({f.layer for f in runs[0]}) > 1
    assert any(f.pool is not None for f in runs[0]) and any(f.pool is None for f in runs[0])
    assert all(f.drawn for f in runs[0])


async def test_explicit_faults_are_recorded_and_win_over_random_ones() -> None:
    ex = FaultInjectingExecutor(fail_batches={1}, fail_at_layer=2, fail_probability=0.0)
    await _run_batches(ex, 3)
    assert ex.faults == [FaultRecord(1, (2,), 2, None, drawn=False)]
    assert ex.faults_injected == 1
    every = FaultInjectingExecutor(fail_probability=1.0, seed=3)
    await _run_batches(every, 4)
    assert [f.batch for f in every.faults] == [0, 1, 2, 3]


def test_fault_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"fail_probability must be in \[0, 1\]; got 1.5"):
        FaultInjectingExecutor(fail_probability=1.5)
    with pytest.raises(ValueError, match="delays must be >= 0 seconds"):
        FaultInjectingExecutor(delay_jitter_s=-1.0)


async def _put_batches(store: MemoryStore, n: int) -> list[str]:
    out = []
    for i in range(n):
        pages = [PageBlobs(bytes([i, j]), {"kv": bytes([j]) * 8, "c4": bytes([i]) * 2}) for j in range(4)]
        try:
            await store.put(pages)
            out.append("ok")
        except StorageError as exc:
            out.append(f"{type(exc).__name__}:{store.faults[-1].published}")
    return out


async def test_memory_store_faults_are_reproducible_and_publish_whole_pages() -> None:
    runs = []
    for seed in (5, 5, 6):
        store = MemoryStore(fail_probability=0.5, seed=seed)
        runs.append((await _put_batches(store, 24), sorted(store.pages)))
    assert runs[0] == runs[1] and runs[0] != runs[2]
    store = MemoryStore(fail_probability=0.5, seed=5)
    await _put_batches(store, 24)
    kinds = {type(f.error) for f in store.faults}
    assert kinds == {StorageError, StorageTimeout}
    published = {f.published for f in store.faults}
    assert 0 in published and len(published) > 1
    for f in store.faults:
        assert [k in store.pages for k in f.keys] == [i < f.published for i in range(len(f.keys))]
    assert all(isinstance(f, StoreFault) for f in store.faults)
    # Whole pages only, and what was put comes back byte for byte.
    store.fail_probability = 0.0
    for key, blobs in store.pages.items():
        assert blobs == {"kv": bytes([key[1]]) * 8, "c4": bytes([key[0]]) * 2}
        assert await store.get([key], ["c4"]) == [{"c4": blobs["c4"]}]
    assert await store.get([b"missing"], ["kv"]) == [None]
    assert await store.get([next(iter(store.pages))], ["kv", "other"]) == [None]
    # The same call fails the same way whatever other calls came in between.
    a, b = MemoryStore(fail_probability=0.5, seed=9), MemoryStore(fail_probability=0.5, seed=9)
    keys = [[bytes([i])] for i in range(16)]
    got_a: list[list[bool] | None] = []
    got_b: list[list[bool] | None] = []
    for ks in keys:
        try:
            got_a.append(await a.exists(ks))
        except StorageError:
            got_a.append(None)
    for ks in reversed(keys):
        try:
            got_b.append(await b.exists(ks))
        except StorageError:
            got_b.append(None)
    assert got_a == got_b[::-1] and None in got_a
    await a.aclose()
    with pytest.raises(StorageError, match="closed"):
        await a.exists([b"x"])


async def test_memory_store_gate_holds_calls_until_stepped_or_released() -> None:
    store = MemoryStore()
    store.hold(("get", "put"))
    got: list[Any] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.put, [PageBlobs(b"k", {"kv": b"ab"})])
        assert await store.exists([b"k"]) == [False]  # exists is not held
        await anyio.wait_all_tasks_blocked()
        assert store.waiting == [("put", (b"k",))] and store.pages == {}

        async def get() -> None:
            got.append(await store.get([b"k"], ["kv"]))

        tg.start_soon(get)
        await anyio.wait_all_tasks_blocked()
        assert store.step() == ("put", (b"k",))
        await anyio.wait_all_tasks_blocked()
        assert store.pages == {b"k": {"kv": b"ab"}} and got == []
        store.release()
    assert got == [[{"kv": b"ab"}]] and store.waiting == [] and store.step() is None
    # A held call that is cancelled leaves the gate.
    store.hold()
    with anyio.move_on_after(0.01):
        await store.exists([b"k"])
    assert store.waiting == []
    with pytest.raises(ValueError, match="operations are"):
        store.hold(("delete",))
    with pytest.raises(ValueError, match="fail_probability"):
        MemoryStore(fail_probability=-0.1)
    assert store.faults == []


# -- the blocking-call detector around async scheduler tests (tests/conftest.py) --


async def test_a_sleep_on_the_loop_fails_a_scheduler_test(no_blocking_on_the_loop: BlockBuster | None) -> None:
    assert no_blocking_on_the_loop is not None  # active around every async test
    group = hybrid_group()
    # The executor sleeps in its worker thread: that is allowed.
    async with TransferScheduler(group, executor=FaultInjectingExecutor(delay_s=0.01)) as sched:
        h = await sched.backup({"kv": torch.arange(8)})
        with pytest.raises(BlockingError, match=r"Blocking call to time.sleep"):
            time.sleep(0.001)  # noqa: ASYNC251 - the point of the test
        with (
            pytest.raises(BlockingError, match=r"Blocking call to io.BufferedReader.read"),
            open(__file__, "rb") as f,  # noqa: ASYNC230 - the point of the test
        ):
            f.read()
        await h


async def test_a_blocking_reclaim_hook_fails_the_operation_and_rolls_back() -> None:
    group = hybrid_group(host_slots=8)  # one page of kv

    async def reclaim(pool: str, tier: str, slots_needed: int) -> None:
        time.sleep(0.001)  # noqa: ASYNC251 - an engine hook that blocks the serving loop

    async with TransferScheduler(group, reclaim=reclaim) as sched:
        held = await sched.backup({"kv": torch.arange(8)})
        await held
        before = group.statistics()
        with pytest.raises(BlockingError, match=r"time.sleep"):
            await sched.backup({"kv": torch.arange(8, 16), "swa": torch.arange(8, 16)})
        assert group.statistics() == before


# -- the model ------------------------------------------------------------------

PAGE = 8
OWNING = ("kv", "state", "swa", "tok")  # slot-owning pools of hybrid_group
SIDECARS = {"kv": ("c4",), "swa": ("swa_state",), "tok": ("idx",), "state": ()}
DEVICE_SLOTS = 64
# The engine's live cache that backups read: device pages it keeps for the whole
# run (taken from the device allocators first). Loads write only other pages, so
# these rows are the truth every round trip is compared against.
SOURCE_PAGES = {"kv": 3, "swa": 3, "tok": 3, "state": 4}
STEP_TIMEOUT_S = 20.0
CLOSE_AFTER_STEPS = 30
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# What the engine does with its index tensors and key lists once a call has
# returned: nothing, other valid values, or values out of every range.
REUSE = st.sampled_from(["keep", "other", "out-of-range"])


def page_size(pool: str) -> int:
    return 1 if pool == "state" else PAGE


def page_key(pool: str, source_page: int) -> bytes:
    """The storage key of the page holding source page ``source_page`` of
    ``pool``: keys are content addresses, so every writer of a key writes the
    same bytes, as with real page keys. A few keys per pool: some are stored
    already when a write or a prefetch names them."""
    return f"{pool}/{source_page}".encode()


def stored_run(stored: set[bytes] | dict[bytes, Any], keys: list[bytes]) -> int:
    """How many of ``keys``, from the first, are stored: a prefetch's hit."""
    n = 0
    while n < len(keys) and keys[n] in stored:
        n += 1
    return n


@dataclass(eq=False, kw_only=True)
class Op:
    handle: Any  # an OperationHandle; a PrefetchHandle for pages a prefetch handed back
    cancel: str = ""  # how cancel() found it: "queued" or "in_flight"
    settled: bool = False


@dataclass(eq=False, kw_only=True)
class Backup(Op):
    pages: dict[str, list[int]]  # host pages per slot-owning pool
    host: dict[str, torch.Tensor]  # host indices per slot-owning pool
    freed: set[str] = field(default_factory=set)  # pools the caller gave back with free_host
    ok: bool | None = None  # None while in flight
    # Per pool, the source device page whose bytes each host page holds (or will).
    src: dict[str, list[int]] = field(default_factory=dict)
    # Pages of freed pools went back and another backup was handed them at once
    # (free_then_reallocate): their bytes are that backup's now.
    reallocated: bool = False


@dataclass(eq=False, kw_only=True)
class Load(Op):
    backup: Backup
    pools: tuple[str, ...]
    dest: dict[str, list[int]]  # device pages per pool
    explicit: frozenset[str]  # pools whose device pages the caller allocated


@dataclass(eq=False, kw_only=True)
class Submission:
    """A load (or a write_storage) of a backup's pages, submitted while that
    backup was in flight: it waits for the backup before it takes anything."""

    backup: Backup
    pools: tuple[str, ...]
    dest: dict[str, list[int]]  # all allocated by the caller
    done: anyio.Event
    write: bool = False  # a write_storage of every page of ``pools``
    faults_before: int = 0  # (a write) the store's faults when it was submitted
    reuse: str = "keep"  # what the engine does with its index buffers once the call returned
    # (a load) the rows of its device pages before it: a load that fails leaves them alone.
    before: list[torch.Tensor] = field(default_factory=list)
    result: OperationHandle | WriteStorageHandle | BaseException | None = None
    settled: bool = False


@dataclass(eq=False, kw_only=True)
class StorageOp:
    cancel: str = ""  # how cancel() found it: "queued" or "in_flight"
    queued_at_close: bool = False
    running_at_close: bool = False  # a cancelling close may end it (SchedulerClosed) or it finished first
    faults_before: int = 0  # the store's faults when it was submitted: its own come after
    settled: bool = False


@dataclass(eq=False, kw_only=True)
class Write(StorageOp):
    handle: WriteStorageHandle
    held: Backup  # whose host pages it reads
    pages: dict[str, list[int]]  # host pages per pool, a subset of held.pages
    keys: dict[str, list[bytes]]
    # Submitted with nothing in flight: per pool, how many pages it puts (at
    # least, at most), and the keys it must put (missing, or known bad).
    predicted: dict[str, tuple[int, int]] | None = None
    must_put: set[bytes] = field(default_factory=set)


@dataclass(eq=False, kw_only=True)
class Prefetch(StorageOp):
    handle: PrefetchHandle
    keys: dict[str, list[bytes]]
    src: dict[str, list[int]]  # the source page each key names
    pages: dict[str, list[int]]  # the host pages it took, key by key
    policy: str
    # The keys stored when it looked them up; None until then (it holds every page).
    hit: dict[str, int] | None = None
    seen: set[bytes] = field(default_factory=set)  # stored keys before it could look up
    stopped: dict[str, int] | None = None  # pages_done when stop() was called
    stop_hit: dict[str, int] | None = None  # its hits then (all keys before the lookup)
    # Submitted with nothing in flight (not holding): it ran to its end inside
    # its rule, so the model predicts its result from the store as it was.
    sequential: bool = False
    # Keys damaged when it was submitted or while it ran: only at one of these
    # may its run end short of what its lookup found.
    damaged: set[bytes] = field(default_factory=set)
    # Keys that looked stored (present, not suspect) at the last check before its lookup.
    seen_ok: set[bytes] = field(default_factory=set)
    # (sequential) per pool, what it may hand back (`SchedulerMachine.read_runs`),
    # and the scheduler's count of rejected pages before it.
    predicted: dict[str, set[tuple[int, bool]]] | None = None
    rejected_before: int = 0


# Resolutions per request, counted while the state machine runs: a storage
# handle by its id(), a backup's or load's request by its carrier's id() and
# its index there (`kvtier.scheduler.carriers`: the carrier owns its requests'
# ends). What is counted is kept too, so that its id() is not reused later.
RESOLUTIONS: dict[object, tuple[object, int]] = {}
# Per request (see `resolution_key`): what the engine does the moment it
# resolves, before any task waiting for it wakes (free_then_reallocate submits
# a backup there).
AFTER_RESOLVE: dict[object, Callable[[], None]] = {}


def resolution_key(handle: OperationHandle | StorageHandle) -> object:
    if isinstance(handle, OperationHandle):
        return (id(handle._carrier), handle._index)
    return id(handle._carrier)


def resolutions(handle: OperationHandle | StorageHandle) -> int:
    return RESOLUTIONS.get(resolution_key(handle), (handle, 0))[1]


def _resolved(key: object, keep: object) -> None:
    RESOLUTIONS[key] = (keep, RESOLUTIONS.get(key, (keep, 0))[1] + 1)
    hook = AFTER_RESOLVE.pop(key, None)
    if hook is not None:
        hook()  # synchronous, on the loop: waiters were only scheduled so far


@contextmanager
def counting_resolutions() -> Iterator[None]:
    """Count the resolutions of every request in ``RESOLUTIONS``: storage
    operations through `StorageCarrier.settle`, a carrier's requests through the two
    ways a carrier ends them (`Carrier.end_request` before its copies,
    `Carrier.settle` after them)."""
    settle_handle, settle_carrier, end_request = StorageCarrier.settle, Carrier.settle, Carrier.end_request

    def handle_settled(self: StorageCarrier, result: Any, error: Any, lane: Any) -> None:
        settle_handle(self, result, error, lane)
        _resolved(id(self), self)

    def carrier_settled(self: Carrier, result: Any, error: Any, lane: Any) -> None:
        still_open = [i for i in range(self.requests.count) if i not in self._early]
        settle_carrier(self, result, error, lane)
        for i in still_open:
            _resolved((id(self), i), self)

    def request_ended(self: Carrier, index: int, error: BaseException) -> None:
        was_open = not self.done_of(index)
        end_request(self, index, error)
        if was_open:
            _resolved((id(self), index), self)

    StorageCarrier.settle = handle_settled  # type: ignore[method-assign]
    Carrier.settle = carrier_settled  # type: ignore[method-assign]
    Carrier.end_request = request_ended  # type: ignore[method-assign]
    try:
        yield
    finally:
        StorageCarrier.settle = settle_handle  # type: ignore[method-assign]
        Carrier.settle = settle_carrier  # type: ignore[method-assign]
        Carrier.end_request = end_request  # type: ignore[method-assign]
        AFTER_RESOLVE.clear()


async def _release_store(store: MemoryStore) -> None:
    store.release()


class SchedulerMachine(RuleBasedStateMachine):
    """Rules: backup (wait or nowait, any subset of pools), load (into device
    pages the caller or kvtier allocates, maybe evicting the host copy at once),
    load of a backup still in flight, free_host, a second free_host, cancel,
    hold / release the executor, fail the next batch, evict device pages, close,
    submit after close. The reclaim hook (when drawn) evicts what the caller holds.

    Storage (a `MemoryStore` with seeded faults): write_storage of held pages
    (backed up or prefetched; some of their keys stored already), write_storage
    of a backup still in flight, prefetch (any policy; keys some stored, some
    not), stop a prefetch, cancel a storage operation, and step the store: while
    the rules hold the executor they hold the store too, either every call or
    only reads and puts (lookups pass), and a step lets one held call through.
    Host pages that prefetches hand back are held like a backup's: loaded,
    written, freed. Every page a prefetch hands back holds the bytes written
    under its key, byte for byte.

    Damage and lives: damage a stored page (flip its first, middle, last or any
    byte, drop a blob, malform its record), damage-read-repair (a held page's
    key damaged, prefetched, written back), free-then-reallocate (a load or
    write waits for a backup, its pages are freed, and the next backup takes
    them as the backup ends). Backups, loads, writes and prefetches change the
    caller's index tensors and key lists once submitted.
    """

    def __init__(self) -> None:
        super().__init__()
        RESOLUTIONS.clear()  # ids of the last example's handles may be reused
        AFTER_RESOLVE.clear()
        # Blocking calls made on the scheduler's loop (the portal's thread) fail
        # the step; this thread runs no loop and may wait for it.
        self.detector = BlockBuster()
        self.detector.activate()
        try:
            self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
            self.portal = self._portal_cm.__enter__()
        except BaseException:
            self.detector.deactivate()
            raise
        self.gate = threading.Event()
        self.gate.set()
        self.holding = False
        self.closed = False
        self.closing = False
        self.started = False
        self.backups: list[Backup] = []
        self.loads: list[Load] = []
        self.subs: list[Submission] = []
        self.writes: list[Write] = []
        self.prefetches: list[Prefetch] = []
        self.expected: dict[bytes, dict[str, bytes]] = {}  # the bytes of each key (its source rows)
        # Stored pages the rules damaged, and the page (its blob dict) they
        # damaged: a put of the key replaces that dict, which repairs it.
        self.damage: dict[bytes, tuple[str, dict[str, bytes]]] = {}
        # Keys the scheduler found bad and will put again: True / False, or
        # None where the model cannot tell (an operation that may or may not
        # have found or repaired it ended while others ran, or failed).
        self.suspect: dict[bytes, bool | None] = {}
        self.hook_errors: list[BaseException] = []
        self.store_mode = ""  # while holding: "all" calls held, or "reads" (get and put; lookups pass)
        self.device_held: dict[str, list[list[int]]] = {p: [] for p in OWNING}
        self.reclaims: list[tuple[str, str, int]] = []
        self._events: list[str] = []
        self.steps = 0

    # -- plumbing -------------------------------------------------------------

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        async def timed() -> Any:
            with anyio.fail_after(STEP_TIMEOUT_S):
                return await fn(*args)

        try:
            return self.portal.call(timed)
        finally:
            # Hypothesis records events in the thread that runs the test only.
            for name in self._events:
                event(name)
            self._events.clear()

    def note(self, name: str) -> None:
        """Record a Hypothesis event (from any thread; reported after the call)."""
        self._events.append(name)

    async def _run_scheduler(self, *, task_status: anyio.abc.TaskStatus[TransferScheduler]) -> None:
        self.close_requested = anyio.Event()
        self.scheduler_exited = anyio.Event()
        try:
            async with TransferScheduler(
                self.group, executor=self.ex, config=self.config,
                reclaim=self._reclaim if self.with_reclaim else None, storage=self.store,
            ) as sched:
                task_status.started(sched)
                await self.close_requested.wait()
        finally:
            self.scheduler_exited.set()

    @staticmethod
    async def _quiet() -> None:
        # Let the batching loop take what it can take now: a few loop turns
        # (it needs two or three), no waiting on threads.
        for _ in range(8):
            await anyio.lowlevel.checkpoint()

    async def _storage_quiet(self) -> None:
        """`_quiet`, and wait for the storage lanes' worker threads (pages
        encoded for a put, decoded after a get): afterwards every storage
        operation is queued, held at the store's gate, or done."""
        limiter = anyio.to_thread.current_default_thread_limiter()
        idle = 0
        while idle < 2:
            await self._quiet()
            if limiter.borrowed_tokens:
                idle = 0
                await anyio.sleep(0.0005)
            else:
                idle += 1

    def host_alloc(self, pool: str) -> PageAllocator:
        a = self.group[pool].host.allocator
        assert isinstance(a, PageAllocator)
        return a

    def device_alloc(self, pool: str) -> PageAllocator:
        a = self.group[pool].device_allocator
        assert isinstance(a, PageAllocator)
        return a

    # -- what the model says ---------------------------------------------------

    def pending_ops(self) -> list[Op]:
        return [op for op in (*self.backups, *self.loads) if not op.settled]

    def pending_storage(self) -> list[Write | Prefetch]:
        ops: list[Write | Prefetch] = [w for w in self.writes if not w.settled]
        return ops + self.pending_prefetches()

    def pending_prefetches(self) -> list[Prefetch]:
        return [p for p in self.prefetches if not p.settled]

    def reads_pending(self, b: Backup, pool: str) -> bool:
        return any(ld.backup is b and pool in ld.pools and not ld.settled for ld in self.loads)

    def pages_read(self, b: Backup, pool: str) -> set[int]:
        """Pages of ``b``'s ``pool`` that an operation in flight reads."""
        if self.reads_pending(b, pool):
            return set(b.pages[pool])
        return {pg for w in self.writes if w.held is b and not w.settled for pg in w.pages.get(pool, ())}

    def expected_host(self, pool: str) -> tuple[set[int], int]:
        """Host pages of ``pool`` that are taken, and how many of them the caller
        freed while an operation still used them (deferred)."""
        taken: set[int] = set()
        deferred = 0
        for b in self.backups:
            pages = b.pages.get(pool)
            if not pages or b.ok is False:
                continue
            if b.ok is None:
                in_use = set(pages)
            else:
                in_use = self.pages_read(b, pool)
            if pool in b.freed:
                pages = [pg for pg in pages if pg in in_use]
                deferred += len(pages)
            assert taken.isdisjoint(pages), f"model gave host pages of {pool!r} to two backups"
            taken.update(pages)
        for p in self.pending_prefetches():
            if pool not in p.pages:
                continue
            pages = p.pages[pool]
            if p.hit is not None:  # it freed the pages past its hit when it looked its keys up
                pages = pages[: p.hit[pool]]
            assert taken.isdisjoint(pages), f"model gave host pages of {pool!r} to a prefetch and another"
            taken.update(pages)
        return taken, deferred

    def expected_device(self, pool: str) -> set[int]:
        taken = set(self.source[pool])
        lists = [*self.device_held[pool]]
        lists += [ld.dest[pool] for ld in self.loads if not ld.settled and pool in ld.dest]
        lists += [s.dest[pool] for s in self.subs if not s.settled and pool in s.dest]
        for pages in lists:
            assert taken.isdisjoint(pages), f"model gave device pages of {pool!r} twice"
            taken.update(pages)
        return taken

    def host_free_pages(self, pool: str) -> int:
        return self.host_alloc(pool).num_pages - len(self.expected_host(pool)[0])

    # -- the store and the scheduler's suspects, as the model sees them ------------

    def damage_of(self, key: bytes) -> str | None:
        """How a rule damaged the stored page ``key``: None when it is undamaged
        or was put again since (a put replaces the page's blob dict)."""
        d = self.damage.get(key)
        if d is None:
            return None
        if self.store.pages.get(key) is not d[1]:
            del self.damage[key]
            return None
        return d[0]

    def stored(self, key: bytes) -> bool:
        """What the store's ``exists`` says: committed, its commit record whole."""
        return key in self.store.pages and self.damage_of(key) not in ("drop", "malform")

    def looks_stored(self, key: bytes, unsure: Collection[bytes] = ()) -> bool | None:
        """What the scheduler's lookup says: stored, and not a key whose bytes
        it found bad (None: the model cannot tell, as for the keys ``unsure``)."""
        if not self.stored(key):
            return False
        bad = self.suspect.get(key, False)
        return None if bad is None or key in unsure else not bad

    def lookup_runs(self, keys: list[bytes], unsure: Collection[bytes] = ()) -> set[int]:
        """The hits a lookup of ``keys`` may find now."""
        out = set()
        for i, k in enumerate(keys):
            seen = self.looks_stored(k, unsure)
            if seen is not True:
                out.add(i)
                if seen is False:
                    return out
        out.add(len(keys))
        return out

    def read_runs(self, keys: list[bytes]) -> set[tuple[int, bool]]:
        """What a prefetch of ``keys`` that runs alone may hand back: (pages,
        whether the page that ended the run failed its checksum). The hit ends
        at the first key the lookup misses; the pages read end at the first
        one whose bytes were flipped."""
        out = set()
        for i, k in enumerate(keys):
            seen = self.looks_stored(k)
            if seen is not True:
                out.add((i, False))
                if seen is False:
                    return out
            if self.damage_of(k) == "flip":
                out.add((i, True))
                return out
        out.add((len(keys), False))
        return out

    def write_range(self, keys: list[bytes]) -> tuple[int, int]:
        """How many of ``keys`` a write that runs alone puts (the others it
        finds stored): at least, at most. A key known bad is put again."""
        lo = hi = 0
        seen: set[bytes] = set()
        for k in keys:
            if k in seen:
                continue  # put once, by its first page; the others count it present
            seen.add(k)
            stored = self.looks_stored(k)
            lo += stored is False
            hi += stored is not True
        return lo, hi

    def unsure(self, keys: Any, *, was: tuple[bool | None, ...]) -> None:
        """Keys whose suspect state was one of ``was`` may have changed: unknown now."""
        for k in keys:
            if self.suspect.get(k, False) in was:
                self.suspect[k] = None

    def lane_full(self, direction: str) -> bool:
        return not self.lane_room(direction, 1)

    def lane_room(self, direction: str, need: int) -> bool:
        """Whether the lane has room for ``need`` more operations now."""
        queued = sum(
            1 for op in (*self.pending_ops(), *self.pending_storage())
            if op.handle.queued and op.handle.kind == direction
        )
        return queued + need <= self.config.max_queued_ops

    # -- set-up ----------------------------------------------------------------

    @initialize(
        host_pages=st.integers(2, 6),
        state_slots=st.integers(5, 8),
        with_reclaim=st.booleans(),
        on_close=st.sampled_from(["drain", "cancel"]),
        max_batch_ops=st.sampled_from([1, 2, 64]),
        max_queued_ops=st.sampled_from([2, 64]),
        fail_probability=st.sampled_from([0.0, 0.1, 0.3]),
        seed=st.integers(0, 2**16),
        layout=st.sampled_from(["layer_first", "page_first"]),
        store_fail_probability=st.sampled_from([0.0, 0.1, 0.3]),
        storage_chunk_bytes=st.sampled_from([1, 4 << 20]),  # a page per round, or all at once
        stored_before=st.sets(st.sampled_from([(p, i) for p in OWNING for i in range(SOURCE_PAGES[p])])),
    )
    def setup(
        self, host_pages: int, state_slots: int, with_reclaim: bool, on_close: str,
        max_batch_ops: int, max_queued_ops: int, fail_probability: float, seed: int, layout: str,
        store_fail_probability: float, storage_chunk_bytes: int, stored_before: set[tuple[str, int]],
    ) -> None:
        self.group = hybrid_group(
            host_slots=host_pages * PAGE, state_slots=state_slots, device_slots=DEVICE_SLOTS,
            layout=layout, device_allocator=True, seed=seed,  # type: ignore[arg-type]
        )
        self.ex = FaultInjectingExecutor(hold=self.gate, fail_probability=fail_probability, seed=seed)
        self.store = MemoryStore(fail_probability=store_fail_probability, seed=seed)
        self.config = SchedulerConfig(
            max_batch_ops=max_batch_ops, max_queued_ops=max_queued_ops, on_close=on_close,  # type: ignore[arg-type]
            storage_chunk_bytes=storage_chunk_bytes,
        )
        self.with_reclaim = with_reclaim
        self.source = {p: self.device_alloc(p).try_alloc_pages(n) or [] for p, n in SOURCE_PAGES.items()}
        self.capacity = {p: self.host_alloc(p).num_pages for p in OWNING}
        for pool in OWNING:
            for d in self.source[pool]:
                self.expected[page_key(pool, d)] = self._source_blobs(pool, d, page_key(pool, d))
        for pool, i in sorted(stored_before):
            self._store_as_another_engine(pool, self.source[pool][i])
        self.sched_future, self.sched = self.portal.start_task(self._run_scheduler)
        self.started = True

    def _source_blobs(self, pool: str, source_page: int, key: bytes) -> dict[str, bytes]:
        """The stored form of source page ``source_page`` of ``pool``: the bytes
        its key names, from the device rows (which nothing writes). Its rows go
        through host page 0 of each pool (free at set-up), encoded as a write
        encodes them."""
        for name in (pool, *SIDECARS[pool]):
            spec = self.group[name]
            dev = spec.device
            if dev is None:
                continue
            k = spec.page_size  # a sidecar's rows per page
            for j in range(dev.num_layers):
                for plane in range(len(dev.planes)):
                    spec.host.layer_view(j, plane)[:k] = dev.tensor(j, plane)[source_page * k : (source_page + 1) * k]
        return {name: bytes(b) for name, b in encode_page(self.group, pool, 0, key=key).items()}

    def _store_as_another_engine(self, pool: str, source_page: int) -> None:
        """Put source page ``source_page`` of ``pool`` into the store under its
        key, as another engine would have."""
        key = page_key(pool, source_page)
        self.store.pages[key] = dict(self.expected[key])

    # -- the reclaim hook: the engine evicts what it holds, oldest first ----------

    async def _reclaim(self, pool: str, tier: str, slots_needed: int) -> None:
        self.note(f"reclaim hook: {tier}")
        self.reclaims.append((pool, tier, slots_needed))
        pages_needed = slots_needed // page_size(pool)
        if tier == "host":
            for b in list(self.backups):
                if self.host_free_pages(pool) >= pages_needed:
                    return
                if b.ok is False or pool not in b.pages or pool in b.freed:
                    continue
                self._free_host(b, tuple(p for p in b.pages if p not in b.freed))
        else:
            held = self.device_held[pool]
            while held and self.device_alloc(pool).num_free_pages < pages_needed:
                self.device_alloc(pool).free_pages(held.pop(0))

    def _free_host(self, b: Backup, pools: tuple[str, ...]) -> None:
        self.sched.free_host({p: b.host[p] for p in pools})
        b.freed.update(pools)

    # -- settling what ended ---------------------------------------------------

    def ran_in(self) -> dict[int, int]:
        return {op_id: n for n, (_, ids) in enumerate(self.ex.history) for op_id in ids}

    def expected_error(self, op: Op, ran: dict[int, int], failed: set[int]) -> type[BaseException] | None:
        op_id = op.handle.id
        if op_id not in ran:
            if op.cancel == "queued":
                return OperationCancelled
            if self.closing and self.config.on_close == "cancel":
                return SchedulerClosed
            raise AssertionError(f"operation {op_id} ended without running and nobody cancelled it")
        assert op.cancel != "queued", f"operation {op_id} ran although it was cancelled while queued"
        if op.cancel == "in_flight":
            return OperationCancelled  # an accepted cancel wins over a failed batch
        if op_id in failed:
            return TransferFailed
        return None

    async def _outcome(self, handle: OperationHandle) -> OperationResult | BaseException:
        try:
            return await handle
        except Exception as exc:  # noqa: BLE001 - the outcome is what we check
            return exc

    async def settle(self) -> None:
        """Check and record every operation that ended since the last step."""
        progress = True
        while progress:
            progress = False
            for op in self.pending_ops():
                if op.handle.done():
                    await self._settle_op(op)
                    progress = True
            # After the ops: a load that waited for a backup ends after it.
            for s in self.subs:
                if not s.settled and s.done.is_set():
                    await self._settle_submission(s)
                    progress = True
            for w in self.writes:
                if not w.settled and w.handle.done():
                    await self._settle_write(w)
                    progress = True
            for p in self.prefetches:
                if not p.settled and p.handle.done():
                    await self._settle_prefetch(p)
                    progress = True

    async def _settle_op(self, op: Op) -> None:
        ran = self.ran_in()
        failed = {i for f in self.ex.faults for i in f.operation_ids}
        outcome = await self._outcome(op.handle)
        again = await self._outcome(op.handle)
        assert again is outcome, "awaiting a handle twice gave two outcomes"
        n = resolutions(op.handle)
        assert n == 1, f"handle {op.handle.id} resolved {n} times"
        assert op.handle.cancel() is False
        expected = self.expected_error(op, ran, failed)
        self.note(f"{op.handle.kind} ended: {expected.__name__ if expected else 'ok'}")
        if expected is None:
            assert isinstance(outcome, OperationResult), f"operation {op.handle.id}: {outcome!r}"
        else:
            assert isinstance(outcome, expected), f"operation {op.handle.id}: expected {expected.__name__}, got {outcome!r}"
            if isinstance(outcome, TransferFailed):
                assert isinstance(outcome.__cause__, InjectedFault)
                assert op.handle.id in outcome.operation_ids
        op.settled = True
        if isinstance(op, Backup):
            op.ok = expected is None
            if op.ok:
                self._check_backup_bytes(op)
                for pool in op.pages:  # the model's record of the pages, whatever the caller did to its tensors
                    for name in (pool, *SIDECARS[pool]):
                        assert torch.equal(op.handle.device_indices[name], self.source_slots(op, pool, name))
                        assert torch.equal(op.handle.host_indices[name], self.host_slots(op, pool, name))
        else:
            assert isinstance(op, Load)
            if expected is None:
                self._check_load_bytes(op)
                await op.handle.layer_ready(self.group.num_layers - 1)
                for pool, pages in op.dest.items():
                    self.device_held[pool].append(pages)
            else:
                with pytest.raises(expected):
                    await op.handle.layer_ready(0)
                for pool in op.explicit:
                    self.device_alloc(pool).free_pages(op.dest[pool])

    async def _settle_submission(self, s: Submission) -> None:
        s.settled = True
        assert s.backup.settled, "a load that waited for a backup ended before the backup"
        result = s.result
        self.note(f"{'write_storage' if s.write else 'load'} after a backup in flight: {type(result).__name__}")
        if s.backup.ok is False:
            assert isinstance(result, TransferFailed), f"expected TransferFailed, got {result!r}"
            assert "did not complete" in str(result)
        elif self.closing:
            assert isinstance(result, SchedulerClosed), f"expected SchedulerClosed, got {result!r}"
        elif s.backup.freed & set(s.pools):
            # Freed while it waited (and maybe handed to another backup at once):
            # a new life of those pages, which it must not read.
            assert isinstance(result, InvalidIndices), f"expected InvalidIndices, got {result!r}"
            assert result.rule in ("page-generation", "host-pages-held"), f"unexpected rule: {result!r}"
            if s.backup.reallocated:
                self.note("reader refused the next life of its pages")
        elif s.write:
            assert isinstance(result, WriteStorageHandle), f"expected a handle, got {result!r}"
            b = s.backup
            read = {p: list(b.pages[p]) for p in s.pools}
            keys = {p: [page_key(p, d) for d in b.src[p]] for p in s.pools}
            self._expect_bytes(read, keys)
            self.writes.append(Write(handle=result, held=b, pages=read, keys=keys, faults_before=s.faults_before))
            return
        else:
            assert isinstance(result, OperationHandle), f"expected a handle, got {result!r}"
            self.loads.append(Load(
                handle=result, backup=s.backup, pools=s.pools, dest=s.dest, explicit=frozenset(s.dest),
            ))
            return
        # It failed before it took anything: its device pages hold what they held.
        for x, y in zip(s.before, self._dest_rows(s.dest), strict=True):
            assert torch.equal(x, y), "a load that failed wrote its device pages"
        for pool, pages in s.dest.items():
            self.device_alloc(pool).free_pages(pages)

    def _rows(self, pool: str, idx: torch.Tensor, *, host: bool) -> list[torch.Tensor]:
        spec = self.group[pool]
        dev = spec.device
        assert dev is not None
        out = []
        for j in range(dev.num_layers):
            for p in range(len(dev.planes)):
                t = spec.host.layer_view(j, p) if host else dev.tensor(j, p)
                out.append(t[idx].clone())
        return out

    def _check_backup_bytes(self, b: Backup) -> None:
        """The host pages hold the source rows the backup named when it was
        submitted (the model's record, not what the caller's tensors say now)."""
        for pool in b.pages:
            if b.reallocated and pool in b.freed:
                continue  # handed to another backup at once: its bytes now
            for name in (pool, *SIDECARS[pool]):
                if self.group[name].device is None:
                    continue
                host, src = self.host_slots(b, pool, name), self.source_slots(b, pool, name)
                for x, y in zip(self._rows(name, host, host=True), self._rows(name, src, host=False)):
                    assert torch.equal(x, y), f"backup {b.handle.id}: host rows of {name!r} differ from the source rows"

    def host_slots(self, b: Backup, pool: str, name: str) -> torch.Tensor:
        """Host rows of ``name`` (``pool`` or a sidecar) of ``b``'s host pages of ``pool``."""
        return slots_of_pages(b.pages[pool], self.group[name].page_size)

    def source_slots(self, b: Backup, pool: str, name: str) -> torch.Tensor:
        """Device rows of ``name`` (``pool`` or a sidecar) of the source pages
        whose bytes ``b``'s host pages of ``pool`` hold."""
        return slots_of_pages(b.src[pool], self.group[name].page_size)

    def _check_load_bytes(self, ld: Load) -> None:
        """The device pages hold the source rows of the host pages the load
        named (the model's record: the caller may have changed its tensors)."""
        dst, host = ld.handle.device_indices, ld.handle.host_indices
        for pool in ld.pools:
            for name in (pool, *SIDECARS[pool]):
                rows = slots_of_pages(ld.dest[pool], self.group[name].page_size)
                assert torch.equal(dst[name], rows), f"load {ld.handle.id}: device indices of {name!r} changed"
                assert torch.equal(host[name], self.host_slots(ld.backup, pool, name))
                if self.group[name].device is None:
                    continue
                src = self.source_slots(ld.backup, pool, name)
                for x, y in zip(self._rows(name, src, host=False), self._rows(name, rows, host=False)):
                    assert torch.equal(x, y), f"load {ld.handle.id}: rows of {name!r} did not round-trip"

    # -- storage: settling, and the bytes under each key --------------------------

    def _expect_bytes(self, pages: dict[str, list[int]], keys: dict[str, list[bytes]]) -> None:
        """Host ``pages`` hold the bytes of their ``keys`` (what a write reads)."""
        for pool, pgs in pages.items():
            for page, key in zip(pgs, keys[pool]):
                blobs = {name: bytes(b) for name, b in encode_page(self.group, pool, page, key=key).items()}
                assert self.expected[key] == blobs, f"host page {page} of {pool!r} does not hold the bytes of key {key!r}"

    def injected(self, op: StorageOp, outcome: object) -> bool:
        """``outcome`` is a fault the store injected since ``op`` was submitted."""
        return isinstance(outcome, StorageError) and any(
            f.error is outcome for f in self.store.faults[op.faults_before:]
        )

    def closed_while_running(self, op: StorageOp, outcome: object) -> bool:
        """``op`` ran when the scheduler closed cancelling, and the close ended it."""
        return op.running_at_close and self.config.on_close == "cancel" and isinstance(outcome, SchedulerClosed)

    def storage_cancelled(self, op: StorageOp) -> type[BaseException] | None:
        if op.cancel == "queued":
            return OperationCancelled
        if op.queued_at_close and self.config.on_close == "cancel":
            return SchedulerClosed
        if op.cancel == "in_flight":
            return OperationCancelled
        return None

    async def _settled_once(self, handle: StorageHandle) -> object:
        outcome = await self._outcome(handle)  # type: ignore[arg-type]
        again = await self._outcome(handle)  # type: ignore[arg-type]
        assert again is outcome, "awaiting a handle twice gave two outcomes"
        n = resolutions(handle)
        assert n == 1, f"handle {handle.id} resolved {n} times"
        assert handle.cancel() is False
        return outcome

    async def _settle_write(self, w: Write) -> None:
        outcome = await self._settled_once(w.handle)
        w.settled = True
        expected = self.storage_cancelled(w)
        self.note(f"write_storage ended: {type(outcome).__name__}")
        every = [k for ks in w.keys.values() for k in ks]
        if expected is None and self.closed_while_running(w, outcome):
            expected = SchedulerClosed
        if expected is not None:
            assert isinstance(outcome, expected), f"write {w.handle.id}: expected {expected.__name__}, got {outcome!r}"
            self.unsure(every, was=(True,))  # it may have put some of them
            return
        if self.injected(w, outcome):
            self.unsure(every, was=(True,))
            return  # pages it put before the fault are stored whole (checked with the store)
        assert isinstance(outcome, WriteStorageResult), f"write {w.handle.id}: {outcome!r}"
        assert dict(outcome.pages) == {p: len(k) for p, k in w.keys.items()}
        for pool, keys in w.keys.items():
            assert outcome.pages_written[pool] + outcome.pages_present[pool] == len(keys)
            missing = [k for k in keys if k not in self.store.pages]
            assert not missing, f"write {w.handle.id} succeeded but {missing} are not stored"
        if w.predicted is None:
            self.unsure(every, was=(True,))
            return
        for pool, (lo, hi) in w.predicted.items():
            n = outcome.pages_written[pool]
            assert lo <= n <= hi, (
                f"write {w.handle.id} {pool!r} put {n} pages and found {outcome.pages_present[pool]} stored; "
                f"the model says it puts {lo}..{hi} of {w.keys[pool]} (missing, or found bad by a prefetch)"
            )
        for k in every:  # found stored and sound, or put now
            self.suspect[k] = False
        for k in w.must_put:
            assert self.stored(k) and self.damage_of(k) is None, f"write {w.handle.id} did not repair key {k!r}"

    async def _settle_prefetch(self, p: Prefetch) -> None:
        outcome = await self._settled_once(p.handle)
        p.settled = True
        expected = self.storage_cancelled(p)
        self.note(f"prefetch ended: {type(outcome).__name__}{' (stopped)' if p.stopped is not None else ''}")
        # A flipped key it read may have been found bad (and one it found bad
        # put again by a write meanwhile): unless it ran alone, who knows.
        everyone = {k for ks in p.keys.values() for k in ks}
        if expected is None and p.stopped is None and self.closed_while_running(p, outcome):
            expected = SchedulerClosed
        if expected is not None:
            assert isinstance(outcome, expected), f"prefetch {p.handle.id}: expected {expected.__name__}, got {outcome!r}"
            self.unsure(everyone & p.damaged, was=(False,))
            return
        if p.stopped is None and self.injected(p, outcome):
            self.unsure(everyone & p.damaged, was=(False,))
            return  # every page it took is free again (checked with the allocators)
        assert isinstance(outcome, PrefetchResult), f"prefetch {p.handle.id}: {outcome!r}"
        r = outcome
        assert r.id == p.handle.id
        assert dict(r.requested_pages) == {q: len(k) for q, k in p.keys.items()}
        if p.stopped is not None:
            assert p.stop_hit is not None
            assert dict(r.pages) == p.stopped, f"stopped prefetch {r.id}: pages {dict(r.pages)}, done {p.stopped}"
            assert dict(r.hit_pages) == p.stop_hit
            assert r.stopped == any(r.pages[q] < r.hit_pages[q] for q in p.keys)
            self.unsure(everyone & p.damaged, was=(False,))
        elif p.predicted is not None:
            self._settle_sequential_prefetch(p, r)
        else:
            for q, keys in p.keys.items():
                hit = r.hit_pages[q]
                if p.hit is not None:
                    # Its lookup as the model saw it, cut short only where a page was damaged.
                    assert hit <= p.hit[q], f"prefetch {r.id} {q!r}: hit {hit}, model {p.hit[q]}"
                    assert hit == p.hit[q] or keys[hit] in p.damaged, (
                        f"prefetch {r.id} {q!r}: hit {hit} ends at key {keys[hit]!r}, which nothing damaged; "
                        f"its lookup found {p.hit[q]}"
                    )
                else:  # looked up while other operations ran: between what was sound then and stored now
                    lo = stored_run({k for k in p.seen_ok if k not in p.damaged}, keys)
                    hi = stored_run(self.store.pages, keys)
                    assert lo <= hit <= hi, f"prefetch {r.id} {q!r}: hit {hit} not in [{lo}, {hi}]"
            assert dict(r.pages) == dict(r.hit_pages) and not r.stopped
            self.unsure(everyone & p.damaged, was=(False,))
        n = dict(r.pages)
        self.note(f"prefetch: {'no page' if not any(n.values()) else 'every key' if r.complete else 'some pages'} handed back")
        assert set(r.host_indices) == {q for q, k in n.items() if k}
        for q, k in n.items():
            if not k:
                continue
            assert torch.equal(r.host_indices[q], slots_of_pages(p.pages[q][:k], page_size(q)))
            for page, key in zip(p.pages[q][:k], p.keys[q]):
                got = {name: bytes(b) for name, b in encode_page(self.group, q, page, key=key).items()}
                assert got == self.expected[key], f"prefetch {r.id}: host page {page} of {q!r} differs from key {key!r}"
        if any(n.values()):
            self.backups.append(Backup(
                handle=p.handle, pages={q: p.pages[q][:k] for q, k in n.items() if k},
                host={q: t.clone() for q, t in r.host_indices.items()}, src={q: p.src[q][:k] for q, k in n.items() if k},
                ok=True, settled=True,
            ))

    def _settle_sequential_prefetch(self, p: Prefetch, r: PrefetchResult) -> None:
        """A prefetch that ran alone: its result is what the store and the
        scheduler's suspects said when it was submitted (`read_runs`)."""
        assert p.predicted is not None
        rejected_lo = rejected_hi = 0
        for q, keys in p.keys.items():
            n = r.pages[q]
            flags = {bad for m, bad in p.predicted[q] if m == n}
            assert flags, (
                f"prefetch {r.id} {q!r} handed back {n} pages of {keys}; the model says one of "
                f"{sorted(m for m, _ in p.predicted[q])} (the first key missing, found bad, or failing its checksum)"
            )
            rejected_lo += min(flags)
            rejected_hi += max(flags)
            for k in keys[:n]:
                self.suspect[k] = False  # the lookup found it sound, and its bytes passed
            if n < len(keys) and self.stored(keys[n]):
                # Stored, yet the run ended: found bad before, or now.
                self.suspect[keys[n]] = True
                self.note(f"prefetch: a {'flipped' if self.damage_of(keys[n]) == 'flip' else 'bad'} page ended the hit")
            elif n < len(keys) and self.damage_of(keys[n]) is not None:
                self.note("prefetch: a dropped or malformed page ended the hit")
        assert r.hit_pages == r.pages and not r.stopped
        s = self.sched.statistics().storage
        assert s is not None
        delta = s.pages_rejected - p.rejected_before
        assert rejected_lo <= delta <= rejected_hi, (
            f"prefetch {r.id}: the scheduler rejected {delta} pages; the model says {rejected_lo}..{rejected_hi}"
        )

    # -- the check after every step ----------------------------------------------

    def in_doubt(self) -> tuple[set[bytes], set[bytes]]:
        """Keys that storage operations in flight may have found bad (a
        prefetch reading a damaged page), and keys known bad they may have
        put again (a write)."""
        finding = {
            k for p in self.pending_prefetches() for k in p.damaged if self.suspect.get(k, False) is False
        }
        putting = {
            k for w in self.writes if not w.settled for ks in w.keys.values() for k in ks if self.suspect.get(k) is True
        }
        return finding, putting

    async def _check(self) -> None:
        await self.settle()
        finding, putting = self.in_doubt()
        for p in self.pending_prefetches():
            if p.hit is not None:
                # Reading: a round that found a page gone or failing its
                # checksum ends the hit there, and frees the pages past it.
                now = p.handle.hit_pages
                assert now is not None
                for q, k in p.keys.items():
                    if now[q] != p.hit[q]:
                        assert now[q] < p.hit[q], f"prefetch {p.handle.id} {q!r}: hit grew from {p.hit[q]} to {now[q]}"
                        assert k[now[q]] in p.damaged, (
                            f"prefetch {p.handle.id} {q!r}: hit cut to {now[q]} at key {k[now[q]]!r}, which nothing damaged"
                        )
                        assert p.handle.pages_done[q] <= now[q]
                        self.note("prefetch: a damaged page ended the hit while reading")
                p.hit = dict(now)
                continue
            if self.holding and self.store_mode == "reads" and not p.handle.queued:
                # Dispatched in the last step, and lookups pass the store's
                # gate: it looked its keys up then (puts stay held, so nothing
                # was stored since; damage is a step of its own).
                looked = p.handle.hit_pages
                assert looked is not None, f"prefetch {p.handle.id} was dispatched but did not look its keys up"
                for q, k in p.keys.items():
                    runs = self.lookup_runs(k, finding | putting)
                    assert looked[q] in runs, f"prefetch {p.handle.id} {q!r}: hit {looked[q]}, the model says {sorted(runs)}"
                p.hit = dict(looked)
                if any(p.hit[q] < len(k) for q, k in p.keys.items()):
                    self.note("prefetch: pages past the hit freed at lookup")
            else:
                p.seen = set(self.store.pages)
                p.seen_ok = {k for ks in p.keys.values() for k in ks if self.looks_stored(k, finding | putting) is True}
        deferred = 0
        for pool in OWNING:
            alloc = self.host_alloc(pool)
            want, d = self.expected_host(pool)
            deferred += d
            have = {p for p in range(alloc.num_pages) if alloc.is_taken(p)}
            assert have == want, (
                f"host pool {pool!r}: taken pages {sorted(have)}, the model says {sorted(want)} "
                f"(leaked {sorted(have - want)}, lost {sorted(want - have)})"
            )
            assert alloc.num_free_pages == alloc.num_pages - len(want)
            dalloc = self.device_alloc(pool)
            dwant = self.expected_device(pool)
            dhave = {p for p in range(dalloc.num_pages) if dalloc.is_taken(p)}
            assert dhave == dwant, (
                f"device pool {pool!r}: taken pages {sorted(dhave)}, the model says {sorted(dwant)}"
            )
        s = self.sched.statistics()
        assert s.deferred_host_frees == deferred
        if deferred:
            self.note("deferred host frees")
        if s.rollbacks:
            self.note("allocation rolled back")
        for direction, lane in (("backup", s.backup), ("load", s.load)):
            pending = [op for op in self.pending_ops() if op.handle.kind == direction]
            assert lane.queue_depth == sum(1 for op in pending if op.handle.queued)
            assert lane.submitted == lane.completed + lane.failed + lane.cancelled + len(pending)
        for direction, lane in (("write_storage", s.write_storage), ("prefetch", s.prefetch)):
            pending_storage = [op for op in self.pending_storage() if op.handle.kind == direction]
            assert lane.queue_depth == sum(1 for op in pending_storage if op.handle.queued)
            assert lane.submitted == lane.completed + lane.failed + lane.cancelled + len(pending_storage)
        # The store holds whole pages, each with the bytes of its key, but for
        # the pages the rules damaged (and nothing put again since).
        for key, blobs in self.store.pages.items():
            assert key in self.expected, f"the store holds key {key!r}, which no write named"
            if self.damage_of(key) is None:
                assert blobs == self.expected[key], f"the store holds other bytes under key {key!r}"
        # The keys the scheduler will put again: those the model knows, give or
        # take the ones an operation in flight may find bad or put meanwhile.
        assert s.storage is not None
        known = sum(1 for v in self.suspect.values() if v is True)
        unknown = sum(1 for v in self.suspect.values() if v is None)
        low, high = known - len(putting), known + unknown + len(finding)
        assert low <= s.storage.keys_to_rewrite <= high, (
            f"the scheduler will put {s.storage.keys_to_rewrite} keys again; the model says {low}..{high}"
        )
        if not self.holding:
            assert not self.pending_ops(), "operations left in flight with the executor released"
            assert not self.pending_storage(), "storage operations left in flight with the store released"
            assert not self.store.waiting

    @invariant()
    def accounting_is_exact(self) -> None:
        self.steps += 1
        if self.started:
            self.call(self._check)

    # -- rules -----------------------------------------------------------------

    def request(self, pools: set[str], first: int, npages: int) -> dict[str, torch.Tensor]:
        """Device indices of source pages of ``pools``."""
        out = {}
        for pool in sorted(pools):
            src = self.source[pool]
            n = min(npages, len(src))
            start = min(first, len(src) - n)
            out[pool] = slots_of_pages(src[start : start + n], page_size(pool))
        return out

    @precondition(lambda self: self.started and not self.closed)
    @rule(
        pools=st.sets(st.sampled_from(OWNING), min_size=1),
        first=st.integers(0, 3),
        npages=st.integers(1, 2),
        nowait=st.booleans(),
        priority=st.integers(0, 2),
        reuse=REUSE,
    )
    def backup(self, pools: set[str], first: int, npages: int, nowait: bool, priority: int, reuse: str) -> None:
        self.call(self._backup, self.request(pools, first, npages), nowait, priority, reuse)

    async def _backup(self, idx: dict[str, torch.Tensor], nowait: bool, priority: int, reuse: str = "keep") -> None:
        need = {p: t.numel() // page_size(p) for p, t in idx.items()}
        short = [p for p in sorted(idx) if self.host_free_pages(p) < need[p]]
        full = self.lane_full("backup")
        before = len(self.reclaims)
        handle: OperationHandle | None = None
        try:
            if nowait:
                handle = self.sched.backup_nowait(idx, priority=priority)
            else:
                with anyio.move_on_after(0.02 if full else STEP_TIMEOUT_S):
                    handle = await self.sched.backup(idx, priority=priority)
        except PoolExhausted as exc:
            self.note("backup: PoolExhausted")
            assert short, f"PoolExhausted with room in every pool: {exc}"
            assert exc.tier == "host" and exc.needed == need[exc.pool] * page_size(exc.pool)
            assert exc.free == self.host_free_pages(exc.pool) * page_size(exc.pool) < exc.needed
            if nowait or not self.with_reclaim:
                assert exc.pool == short[0] and len(self.reclaims) == before
            else:
                assert (exc.pool, "host", exc.needed) in self.reclaims[before:]
            return
        except anyio.WouldBlock:
            self.note("backup: lane full, WouldBlock")
            assert nowait and full and not short
            return
        if not short:
            assert len(self.reclaims) == before, "the reclaim hook ran with room in every pool"
        elif nowait or not self.with_reclaim:
            raise AssertionError(f"backup succeeded although {short} were short")
        if handle is None:  # waited for room in a full lane and gave up: rolled back
            self.note("backup: gave up waiting for room")
            assert full and not nowait
            return
        assert not full, "a backup went into a full lane"
        self._record_backup(handle, idx, reuse)
        await self._after_submit(handle)

    def _record_backup(self, handle: OperationHandle, idx: dict[str, torch.Tensor], reuse: str) -> None:
        assert set(handle.host_indices) == {n for p in idx for n in (p, *SIDECARS[p])}
        pages = {p: [int(v) // page_size(p) for v in handle.host_indices[p][:: page_size(p)]] for p in idx}
        src = {p: [int(v) // page_size(p) for v in idx[p][:: page_size(p)]] for p in idx}
        self.backups.append(Backup(handle=handle, pages=pages, host={p: handle.host_indices[p].clone() for p in idx}, src=src))
        self.reuse_indices(idx, reuse, side="device")
        if reuse != "keep":
            self.reuse_handle_indices(handle)

    @precondition(lambda self: self.started and not self.closed)
    @rule(
        requests=st.lists(
            st.tuples(st.sets(st.sampled_from(OWNING), min_size=1), st.integers(0, 3), st.integers(1, 2)),
            min_size=1, max_size=3,
        ),
        priority=st.integers(0, 2),
        reuse=REUSE,
    )
    def backup_many(self, requests: list[tuple[set[str], int, int]], priority: int, reuse: str) -> None:
        self.call(self._backup_many, [self.request(*r) for r in requests], priority, reuse)

    async def _backup_many(self, idxs: list[dict[str, torch.Tensor]], priority: int, reuse: str) -> None:
        """A bulk backup: all or nothing, then each request is a backup of its own."""
        need: dict[str, int] = {}
        for idx in idxs:
            for p, t in idx.items():
                need[p] = need.get(p, 0) + t.numel() // page_size(p)
        short = [p for p in sorted(need) if self.host_free_pages(p) < need[p]]
        full = not self.lane_room("backup", len(idxs))
        before = len(self.reclaims)
        handles: list[OperationHandle] | None = None
        try:
            with anyio.move_on_after(0.02 if full else STEP_TIMEOUT_S):
                handles = await self.sched.backup_many(idxs, priority=priority)
        except PoolExhausted as exc:
            self.note("backup_many: PoolExhausted")
            assert short, f"PoolExhausted with room in every pool: {exc}"
            assert exc.tier == "host" and exc.needed == need[exc.pool] * page_size(exc.pool)
            if not self.with_reclaim:
                assert exc.pool == short[0] and len(self.reclaims) == before
            return
        except ValueError as exc:
            self.note("backup_many: more requests than the lane's bound")
            assert len(idxs) > self.config.max_queued_ops, f"ValueError within the bound: {exc}"
            return
        assert len(idxs) <= self.config.max_queued_ops
        if not short:
            assert len(self.reclaims) == before, "the reclaim hook ran with room in every pool"
        elif not self.with_reclaim:
            raise AssertionError(f"backup_many succeeded although {short} were short")
        if handles is None:
            self.note("backup_many: gave up waiting for room")
            assert full
            return
        assert not full, "a bulk backup went into a lane without room for it"
        assert len(handles) == len(idxs) and len({h.id for h in handles}) == len(idxs)
        self.note(f"backup_many: {len(idxs)} requests")
        for handle, idx in zip(handles, idxs):
            self._record_backup(handle, idx, reuse)
        for handle in handles:
            await self._after_submit(handle)

    # -- the engine reuses its buffers once a call returned ------------------------

    def reuse_indices(self, tensors: dict[str, torch.Tensor], how: str, *, side: str) -> None:
        """Change the index tensors an engine passed to a call that returned
        (its page-table buffers): the operation must still move the rows they
        named then."""
        if how == "keep":
            return
        self.note(f"reuse {side} index buffers: {how}")
        for pool, t in tensors.items():
            if how == "other":  # other whole pages in range
                spec = self.group[pool]
                limit = spec.host.slots if side == "host" else spec.device_slots
                t.copy_((t + page_size(pool)) % limit)
            else:
                t.fill_(1 << 40)
                t[::2] = -1

    def reuse_keys(self, keys: dict[str, list[bytes]], how: str) -> None:
        """Change the key lists an engine passed to a storage call that returned."""
        if how == "keep":
            return
        for pool, ks in keys.items():
            if how == "other":  # other keys the model knows
                ks.reverse()
                ks.insert(0, page_key(pool, self.source[pool][-1]))
            else:
                ks[:] = [b""] * len(ks)

    @staticmethod
    def reuse_handle_indices(handle: OperationHandle) -> None:
        """Change the tensors a handle handed out: the caller may, and the
        handle keeps giving the values it had. (Two reads may share memory:
        tensors over one array per carrier; the model clones what it keeps.)"""
        for t in (*handle.host_indices.values(), *handle.device_indices.values()):
            t.fill_(-7)

    async def _after_submit(self, handle: OperationHandle) -> None:
        if self.holding:
            await self._quiet()
        else:
            await self._outcome(handle)

    def held_backups(self) -> list[Backup]:
        return [b for b in self.backups if b.ok and set(b.pages) - b.freed]

    @precondition(lambda self: self.started and not self.closed and self.held_backups())
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.held_backups()), label="backup")
        held = sorted(set(b.pages) - b.freed)
        pools = data.draw(st.sets(st.sampled_from(held), min_size=1), label="pools")
        explicit = data.draw(st.sets(st.sampled_from(sorted(pools))), label="caller allocates")
        # The engine may evict the host copy as soon as the load is submitted.
        evict = data.draw(st.sets(st.sampled_from(held)), label="free_host right after")
        reuse = data.draw(REUSE, label="reuse the buffers")
        self.call(self._load, b, tuple(sorted(pools)), explicit, tuple(sorted(evict)), reuse)

    async def _load(
        self, b: Backup, pools: tuple[str, ...], explicit: set[str], evict: tuple[str, ...], reuse: str
    ) -> None:
        dest: dict[str, list[int]] = {}
        for pool in sorted(explicit):
            got = self.device_alloc(pool).try_alloc_pages(len(b.pages[pool]))
            if got is not None:
                dest[pool] = got
        full = self.lane_full("load")
        handle: OperationHandle | None = None
        device = {p: slots_of_pages(pages, page_size(p)) for p, pages in dest.items()}
        host = {p: b.host[p].clone() for p in pools}  # the engine's buffer, which it reuses
        try:
            with anyio.move_on_after(0.02 if full else STEP_TIMEOUT_S):
                handle = await self.sched.load(host, device)
        except PoolExhausted as exc:
            self.note("load: PoolExhausted on the device")
            assert exc.tier == "device" and exc.pool in pools and exc.pool not in dest
            assert exc.free == self.device_alloc(exc.pool).num_free_slots < exc.needed
        if handle is None:
            for pool, pages in dest.items():
                self.device_alloc(pool).free_pages(pages)
            return
        assert not full, "a load went into a full lane"
        got = handle.device_indices
        for pool in pools:
            if pool not in dest:
                dest[pool] = [int(v) // page_size(pool) for v in got[pool][:: page_size(pool)]]
        self.loads.append(Load(handle=handle, backup=b, pools=pools, dest=dest, explicit=frozenset(device)))
        self.reuse_indices(host, reuse, side="host")
        self.reuse_indices(device, reuse, side="device")
        if reuse != "keep":
            self.reuse_handle_indices(handle)
        if evict:
            self._free_host(b, evict)
        await self._after_submit(handle)

    @precondition(lambda self: self.started and not self.closed and self.held_backups())
    @rule(data=st.data())
    def load_many(self, data: st.DataObject) -> None:
        held_backups = self.held_backups()
        chosen = data.draw(st.lists(st.sampled_from(held_backups), min_size=1, max_size=3, unique=True), label="backups")
        requests = []
        for b in chosen:
            held = sorted(set(b.pages) - b.freed)
            pools = data.draw(st.sets(st.sampled_from(held), min_size=1), label="pools")
            explicit = data.draw(st.sets(st.sampled_from(sorted(pools))), label="caller allocates")
            requests.append((b, tuple(sorted(pools)), explicit))
        evict = data.draw(st.booleans(), label="free_host right after")
        self.call(self._load_many, requests, evict)

    async def _load_many(self, requests: list[tuple[Backup, tuple[str, ...], set[str]]], evict: bool) -> None:
        """A bulk load: device pages allocated all or nothing, then each request is a load of its own."""
        dests: list[dict[str, list[int]]] = []
        for b, _pools, explicit in requests:
            dest = {}
            for pool in sorted(explicit):
                got = self.device_alloc(pool).try_alloc_pages(len(b.pages[pool]))
                if got is not None:
                    dest[pool] = got
            dests.append(dest)
        full = not self.lane_room("load", len(requests))
        hosts = [{p: b.host[p].clone() for p in pools} for b, pools, _ in requests]
        devices = [{p: slots_of_pages(pages, page_size(p)) for p, pages in dest.items()} for dest in dests]
        handles: list[OperationHandle] | None = None
        try:
            with anyio.move_on_after(0.02 if full else STEP_TIMEOUT_S):
                handles = await self.sched.load_many(hosts, devices)
        except PoolExhausted as exc:
            self.note("load_many: PoolExhausted on the device")
            assert exc.tier == "device"
            assert any(exc.pool in pools and exc.pool not in dest for (_, pools, _), dest in zip(requests, dests))
        except ValueError:
            self.note("load_many: more requests than the lane's bound")
            assert len(requests) > self.config.max_queued_ops
        if handles is None:
            for dest in dests:
                for pool, pages in dest.items():
                    self.device_alloc(pool).free_pages(pages)
            return
        assert not full, "a bulk load went into a lane without room for it"
        assert len(handles) == len(requests)
        self.note(f"load_many: {len(requests)} requests")
        for handle, (b, pools, _), dest, device in zip(handles, requests, dests, devices):
            got = handle.device_indices
            for pool in pools:
                if pool not in dest:
                    dest[pool] = [int(v) // page_size(pool) for v in got[pool][:: page_size(pool)]]
            self.loads.append(Load(handle=handle, backup=b, pools=pools, dest=dest, explicit=frozenset(device)))
        if evict:
            b, pools, _ = requests[0]
            self._free_host(b, pools)
        for handle in handles:
            await self._after_submit(handle)

    def backups_in_flight(self) -> list[Backup]:
        return [b for b in self.backups if b.ok is None and set(b.pages) - b.freed]

    @precondition(lambda self: self.holding and not self.closed and self.backups_in_flight())
    @rule(data=st.data())
    def load_while_backing_up(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.backups_in_flight()), label="backup")
        pools = data.draw(st.sets(st.sampled_from(sorted(set(b.pages) - b.freed)), min_size=1), label="pools")
        s = self.call(self._reserve_for_load, b, tuple(sorted(pools)), data.draw(REUSE, label="reuse the buffers"))
        if s is None:
            return
        # From this thread: the portal starts tasks for callers outside its loop.
        self.portal.start_task_soon(self._submit, s)
        self.call(self._waits_for_backup, s)

    async def _reserve_for_load(self, b: Backup, pools: tuple[str, ...], reuse: str = "keep") -> Submission | None:
        dest: dict[str, list[int]] = {}
        for pool in pools:
            got = self.device_alloc(pool).try_alloc_pages(len(b.pages[pool]))
            if got is None:
                for p, pages in dest.items():
                    self.device_alloc(p).free_pages(pages)
                return None
            dest[pool] = got
        s = Submission(backup=b, pools=pools, dest=dest, done=anyio.Event(), reuse=reuse,
                       before=self._dest_rows(dest))
        self.subs.append(s)
        return s

    def _dest_rows(self, dest: dict[str, list[int]]) -> list[torch.Tensor]:
        """The rows a load into device pages ``dest`` would write, as they are now."""
        out: list[torch.Tensor] = []
        for pool in sorted(dest):
            for name in (pool, *SIDECARS[pool]):
                if self.group[name].device is not None:
                    out += self._rows(name, slots_of_pages(dest[pool], self.group[name].page_size), host=False)
        return out

    async def _submit(self, s: Submission) -> None:
        b = s.backup
        host = {p: b.host[p].clone() for p in s.pools}  # the engine's buffers, which it reuses
        try:
            if s.write:
                keys = {p: [page_key(p, d) for d in b.src[p]] for p in s.pools}
                s.result = await self.sched.write_storage(host, keys)
                self.reuse_keys(keys, s.reuse)
            else:
                device = {p: slots_of_pages(pages, page_size(p)) for p, pages in s.dest.items()}
                s.result = await self.sched.load(host, device)
                self.reuse_indices(device, s.reuse, side="device")
            self.reuse_indices(host, s.reuse, side="host")
        except Exception as exc:  # noqa: BLE001 - settle() checks it
            s.result = exc
        finally:
            s.done.set()

    async def _waits_for_backup(self, s: Submission) -> None:
        await self._quiet()
        kind = "write_storage" if s.write else "load"
        assert not s.done.is_set(), f"a {kind} did not wait for the backup writing its pages: {s.result!r}"

    @precondition(lambda self: self.holding and not self.closed and self.backups_in_flight())
    @rule(data=st.data())
    def write_while_backing_up(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.backups_in_flight()), label="backup")
        pools = data.draw(st.sets(st.sampled_from(sorted(set(b.pages) - b.freed)), min_size=1), label="pools")
        s = self.call(self._new_write_submission, b, tuple(sorted(pools)), data.draw(REUSE, label="reuse the buffers"))
        self.portal.start_task_soon(self._submit, s)
        self.call(self._waits_for_backup, s)

    @precondition(lambda self: self.holding and not self.closed and self.backups_in_flight())
    @rule(data=st.data())
    def free_then_reallocate(self, data: st.DataObject) -> None:
        """A load or write_storage waits for the backup writing its pages; the
        engine frees those pages (deferred: the backup still writes them), the
        backup ends, and at that very moment (before the waiting reader runs)
        the engine backs up other rows, which the allocator hands the same page
        numbers. The reader must fail (`InvalidIndices`, or `TransferFailed` /
        `SchedulerClosed`), never read the new backup's bytes."""
        b = data.draw(st.sampled_from(self.backups_in_flight()), label="backup")
        held = sorted(set(b.pages) - b.freed)
        pools = tuple(sorted(data.draw(st.sets(st.sampled_from(held), min_size=1), label="pools")))
        freed = tuple(sorted(set(pools) | data.draw(st.sets(st.sampled_from(held)), label="also free")))
        write = data.draw(st.booleans(), label="write_storage (else load)")
        reuse = data.draw(REUSE, label="reuse the buffers")
        # Ended by a release, or by closing the scheduler (once the run is long enough).
        close = self.steps > CLOSE_AFTER_STEPS and data.draw(st.booleans(), label="close to end the backup")
        s = self.call(self._new_write_submission if write else self._reserve_for_load, b, pools, reuse)
        if s is None:
            return
        self.portal.start_task_soon(self._submit, s)
        self.call(self._waits_for_backup, s)
        self.call(self._free_host_async, b, freed)
        # The next backup: the same number of pages of the freed pools, other source rows.
        idx = {}
        for pool in freed:
            src = self.source[pool]
            idx[pool] = slots_of_pages([src[(src.index(d) + 1) % len(src)] for d in b.src[pool]], page_size(pool))
        AFTER_RESOLVE[resolution_key(b.handle)] = lambda: self._reallocate(b, idx)
        if close:
            self.close()
        else:
            self.release()
        assert resolution_key(b.handle) not in AFTER_RESOLVE, "the backup never resolved"
        errors, self.hook_errors = self.hook_errors, []
        if errors:
            raise errors[0]

    def _reallocate(self, b: Backup, idx: dict[str, torch.Tensor]) -> None:
        """(On the loop, as ``b`` resolves) back ``idx`` up now."""
        try:
            try:
                handle = self.sched.backup_nowait(idx)
            except (PoolExhausted, anyio.WouldBlock, SchedulerClosed) as exc:
                self.note(f"next backup refused: {type(exc).__name__}")
                assert not isinstance(exc, SchedulerClosed) or self.closing, repr(exc)
                # b's freed pages went back (b failed: all of them), so they fit.
                assert not isinstance(exc, PoolExhausted), f"the pages that {b.handle.id} freed did not come back: {exc}"
                return
            pages = {p: [int(v) // page_size(p) for v in handle.host_indices[p][:: page_size(p)]] for p in idx}
            src = {p: [int(v) // page_size(p) for v in idx[p][:: page_size(p)]] for p in idx}
            self.backups.append(Backup(handle=handle, pages=pages, host={p: handle.host_indices[p].clone() for p in idx}, src=src))
            same = any(set(pages[p]) & set(b.pages[p]) for p in idx)
            b.reallocated = b.reallocated or same
            # The pages a batch gives back all go back before its operations
            # resolve: the next backup may also be handed a page that another
            # operation of that batch held and the caller freed. That page's
            # bytes are the next backup's now, as they are for ``b``'s.
            for other in self.backups:
                if other is not b and any(set(pages[p]) & set(other.pages.get(p, ())) for p in other.freed & idx.keys()):
                    other.reallocated = True
            self.note(f"next backup {'given the freed pages' if same else 'given other pages'}")
        except BaseException as exc:  # noqa: BLE001 - raised by the rule, not into the scheduler
            self.hook_errors.append(exc)

    async def _new_write_submission(self, b: Backup, pools: tuple[str, ...], reuse: str = "keep") -> Submission:
        s = Submission(backup=b, pools=pools, dest={}, done=anyio.Event(), write=True,
                       faults_before=len(self.store.faults), reuse=reuse)
        self.subs.append(s)
        return s

    # -- storage rules ---------------------------------------------------------------

    async def _after_storage_submit(self, handle: StorageHandle) -> None:
        if self.holding:
            await self._storage_quiet()
        else:
            await self._outcome(handle)  # type: ignore[arg-type]

    @precondition(lambda self: self.started and not self.closed and self.held_backups())
    @rule(data=st.data())
    def write_storage(self, data: st.DataObject) -> None:
        # Often pages whose keys are damaged or found bad: a write repairs them.
        held = self.held_backups()
        fixing = [b for b in held if any(self.needs_repair(p, d) for p in set(b.pages) - b.freed for d in b.src[p])]
        b = data.draw(st.sampled_from((fixing or held) + held), label="held pages")
        pools = data.draw(st.sets(st.sampled_from(sorted(set(b.pages) - b.freed)), min_size=1), label="pools")
        chosen = {}
        for p in sorted(pools):
            every = list(range(len(b.pages[p])))
            bad = [i for i in every if self.needs_repair(p, b.src[p][i])] or every
            chosen[p] = data.draw(st.lists(st.sampled_from(bad + every), min_size=1, unique=True), label=f"{p} pages")
        self.call(self._write_storage, b, chosen, data.draw(REUSE, label="reuse the buffers"))

    async def _write_storage(self, b: Backup, chosen: dict[str, list[int]], reuse: str) -> None:
        pages = {p: [b.pages[p][i] for i in idx] for p, idx in chosen.items()}
        keys = {p: [page_key(p, b.src[p][i]) for i in idx] for p, idx in chosen.items()}
        self._expect_bytes(pages, keys)
        if any(k in self.store.pages for ks in keys.values() for k in ks):
            self.note("write_storage: some keys stored already")
        every = [k for ks in keys.values() for k in ks]
        if len(set(every)) != len(every):
            # Two held pages of one key (a prefetch read it twice): one key names
            # one stored page, so the write is refused before it pins anything.
            with pytest.raises(InvalidIndices, match="one key names one page of one pool"):
                await self.sched.write_storage({p: slots_of_pages(pg, page_size(p)) for p, pg in pages.items()}, keys)
            self.note("write_storage: a key given twice is refused")
            return
        if any(self.damage_of(k) is not None or self.suspect.get(k, False) is not False for k in every):
            self.note("write_storage: a damaged or suspect key")
        predicted = None if self.holding else {p: self.write_range(k) for p, k in keys.items()}
        must_put = set() if self.holding else {k for k in every if self.looks_stored(k) is False}
        full = self.lane_full("write_storage")
        faults_before = len(self.store.faults)
        handle: WriteStorageHandle | None = None
        host = {p: slots_of_pages(pg, page_size(p)) for p, pg in pages.items()}
        asked = {p: list(k) for p, k in keys.items()}
        with anyio.move_on_after(0.02 if full else STEP_TIMEOUT_S):
            handle = await self.sched.write_storage(host, asked)
        if handle is None:  # waited for room in a full lane and gave up: unpinned
            self.note("write_storage: gave up waiting for room")
            assert full
            return
        assert not full, "a write_storage went into a full lane"
        self.reuse_indices(host, reuse, side="host")
        self.reuse_keys(asked, reuse)
        self.writes.append(Write(
            handle=handle, held=b, pages=pages, keys=keys, faults_before=faults_before,
            predicted=predicted, must_put=must_put,
        ))
        if any(self.suspect.get(k) for k in must_put):
            self.note("write_storage: puts a key found bad again")
        elif any(self.damage_of(k) for k in must_put):
            self.note("write_storage: puts a dropped or malformed key again")
        await self._after_storage_submit(handle)

    # Once something is stored: a prefetch of nothing stored is one of its cases.
    @precondition(lambda self: self.started and not self.closed and self.store.pages)
    @rule(data=st.data())
    def prefetch(self, data: st.DataObject) -> None:
        pools = data.draw(st.permutations(OWNING), label="pool order")
        pools = [p for p in pools if data.draw(st.booleans(), label=f"prefetch {p}")] or [pools[0]]
        src = {}
        for p in pools:
            # Mostly keys that are stored (so that it has pages to read), some
            # damaged or found bad, some not stored.
            stored = [d for d in self.source[p] if page_key(p, d) in self.store.pages]
            bad = [d for d in stored if self.needs_repair(p, d)]
            # (One strategy over a weighted list: cheaper to draw than a one_of.)
            key = st.sampled_from((stored or self.source[p]) + (bad or stored or self.source[p]) + self.source[p])
            src[p] = data.draw(st.lists(key, min_size=1, max_size=3), label=f"{p} source pages")
        policy = data.draw(st.sampled_from(PREFETCH_POLICIES), label="policy")
        self.call(self._prefetch, src, policy, data.draw(REUSE, label="reuse the key lists"))

    async def _prefetch(self, src: dict[str, list[int]], policy: str, reuse: str) -> None:
        keys = {p: [page_key(p, d) for d in ds] for p, ds in src.items()}
        need = {p: len(k) for p, k in keys.items()}
        short = [p for p in sorted(need) if self.host_free_pages(p) < need[p]]
        full = self.lane_full("prefetch")
        before = len(self.reclaims)
        seen, faults_before = set(self.store.pages), len(self.store.faults)
        # Run alone (nothing in flight), it hands back what the store holds now.
        predicted = None if self.holding else {p: self.read_runs(k) for p, k in keys.items()}
        stats = self.sched.statistics().storage
        assert stats is not None
        rejected_before = stats.pages_rejected
        handle: PrefetchHandle | None = None
        asked = {p: list(k) for p, k in keys.items()}  # the engine's lists, which it reuses
        try:
            with anyio.move_on_after(0.02 if full else STEP_TIMEOUT_S):
                # A deadline far away: policy "timeout" stops on stop() here, never by itself.
                handle = await self.sched.prefetch(asked, policy=policy, timeout_s=3600.0 if policy == "timeout" else None)
        except PoolExhausted as exc:
            self.note("prefetch: PoolExhausted")
            assert short, f"PoolExhausted with room in every pool: {exc}"
            assert exc.tier == "host" and exc.needed == need[exc.pool] * page_size(exc.pool)
            assert exc.free == self.host_free_pages(exc.pool) * page_size(exc.pool) < exc.needed
            if not self.with_reclaim:
                assert exc.pool == short[0] and len(self.reclaims) == before
            else:
                assert (exc.pool, "host", exc.needed) in self.reclaims[before:]
            return
        if not short:
            assert len(self.reclaims) == before, "the reclaim hook ran with room in every pool"
        elif not self.with_reclaim:
            raise AssertionError(f"prefetch succeeded although {short} were short")
        else:
            self.note("prefetch: the reclaim hook made room")
        if handle is None:  # waited for room in a full lane and gave up: every page freed
            self.note("prefetch: gave up waiting for room")
            assert full
            return
        assert not full, "a prefetch went into a full lane"
        # Which free pages it took is the scheduler's choice (the allocators
        # must then agree that exactly these are taken).
        pages = {p: list(handle._carrier.claim.writes[p]) for p in keys}
        assert {p: len(pg) for p, pg in pages.items()} == need
        self.reuse_keys(asked, reuse)
        every = {k for ks in keys.values() for k in ks}
        doubt = set().union(*self.in_doubt())
        self.prefetches.append(Prefetch(
            handle=handle, keys=keys, src=src, pages=pages, policy=policy, seen=seen, faults_before=faults_before,
            sequential=not self.holding, damaged={k for k in every if self.damage_of(k) is not None},
            seen_ok={k for k in every if self.looks_stored(k, doubt) is True},
            predicted=predicted, rejected_before=rejected_before,
        ))
        await self._after_storage_submit(handle)

    def _steps_first(self, data: st.DataObject) -> int:
        """How many held store calls to let through before stopping or
        cancelling (so that some pages are done then): the store_step rule,
        folded in, which makes those cases likelier."""
        if self.store_mode != "reads" or not self.store.waiting:
            return 0
        return data.draw(st.integers(0, 3), label="store steps first")

    async def _step_store(self, steps: int) -> None:
        for _ in range(steps):
            if self.store.step() is None:
                return
            await self._storage_quiet()
            await self.settle()

    @precondition(lambda self: self.started and self.pending_prefetches())
    @rule(data=st.data())
    def stop_prefetch(self, data: st.DataObject) -> None:
        steps = self._steps_first(data)
        if steps:
            self.call(self._step_store, steps)
            self.call(self._check)
            if not self.pending_prefetches():
                return
        p = data.draw(st.sampled_from(self.pending_prefetches()), label="prefetch")
        self.call(self._stop_prefetch, p)

    async def _stop_prefetch(self, p: Prefetch) -> None:
        h = p.handle
        if p.policy == "wait_complete":
            with pytest.raises(ValueError, match="has policy 'wait_complete', which does not stop early"):
                h.stop()
            return
        was_queued, done = h.queued, dict(h.pages_done)
        assert h.stop() is True
        p.stopped = done
        p.stop_hit = dict(p.hit) if p.hit is not None else {q: len(k) for q, k in p.keys.items()}
        self.note(f"stop prefetch: {'queued' if was_queued else 'in flight'}{', some pages done' if any(done.values()) else ''}")
        if was_queued:
            assert h.done(), "a queued prefetch was not dropped at once"
        await self._storage_quiet()
        assert h.done(), "a stopped prefetch did not end"

    @precondition(lambda self: self.started and self.pending_storage())
    @rule(data=st.data())
    def cancel_storage(self, data: st.DataObject) -> None:
        steps = self._steps_first(data)
        if steps:
            self.call(self._step_store, steps)
            self.call(self._check)
            if not self.pending_storage():
                return
        op = data.draw(st.sampled_from(self.pending_storage()), label="storage operation")
        self.call(self._cancel_storage, op)

    async def _cancel_storage(self, op: Write | Prefetch) -> None:
        h = op.handle
        was_queued = h.queued
        assert h.cancel() is True
        progress = isinstance(op, Prefetch) and any(op.handle.pages_done.values())
        self.note(f"cancel {h.kind}: {'queued' if was_queued else 'in flight'}{', some pages done' if progress else ''}")
        if was_queued:
            assert h.done(), "a queued storage operation was not dropped at once"
        op.cancel = "queued" if was_queued else "in_flight"
        await self._storage_quiet()
        if isinstance(op, Prefetch):
            assert h.done(), "a cancelled prefetch did not end"

    # Lookups pass in "reads" mode only: a prefetch that is not queued has looked up.
    @precondition(lambda self: self.holding and not self.closed and self.store_mode == "reads" and self.store.waiting)
    @rule()
    def store_step(self) -> None:
        self.call(self._store_step)

    async def _store_step(self) -> None:
        call = self.store.step()
        assert call is not None
        self.note(f"store: step {call[0]}")
        await self._storage_quiet()

    # -- a shared store that damages what it holds ------------------------------------

    def damageable(self) -> list[bytes]:
        return sorted(k for k in self.store.pages if self.damage_of(k) is None)

    def needs_repair(self, pool: str, source_page: int) -> bool:
        """The key of this source page is damaged in the store, or the scheduler may think so."""
        key = page_key(pool, source_page)
        return self.damage_of(key) is not None or self.suspect.get(key, False) is not False

    @precondition(lambda self: self.started and not self.closed and self.store.pages)
    @rule(data=st.data())
    def damage_store(self, data: st.DataObject) -> None:
        """The store changes a page: a byte of one blob flipped (header or rows),
        a blob lost, or the page's commit record spoiled; maybe while a
        prefetch has looked the page up and not read it yet."""
        # Often a page that the engine holds too (so that a write may repair it).
        every = self.damageable()
        if not every:
            return
        held = sorted({page_key(p, d) for b in self.held_backups() for p in b.pages for d in b.src[p]} & set(every))
        key = data.draw(st.sampled_from((held or every) + every), label="stored page")
        self.call(self._damage_store, key, *self._draw_damage(data, key))

    def _draw_damage(self, data: st.DataObject, key: bytes) -> tuple[str, str | None, int | None]:
        kind = data.draw(st.sampled_from(["flip", "flip", "drop", "malform"]), label="damage")
        blobs = self.store.pages[key]
        pool = None if kind == "malform" else data.draw(st.sampled_from(sorted(blobs)), label="blob")
        position = None
        if kind == "flip":
            assert pool is not None
            n = len(blobs[pool])
            where = data.draw(st.sampled_from(["first", "middle", "last", "random"]), label="byte")
            position = {"first": 0, "middle": n // 2, "last": n - 1}.get(where)
            if position is None:
                position = data.draw(st.integers(0, n - 1), label="position")
        return kind, pool, position

    def repairable(self) -> list[tuple[Backup, str, int]]:
        """(backup, pool, page) the engine holds whose key is stored, in pools
        with a host page free for a prefetch of it."""
        out = []
        room = {pool: self.host_free_pages(pool) > 0 for pool in OWNING}
        for b in self.held_backups():
            for pool in sorted(set(b.pages) - b.freed):
                if not room[pool]:
                    continue
                out += [(b, pool, i) for i, d in enumerate(b.src[pool]) if page_key(pool, d) in self.store.pages]
        return out

    # (Cheap preconditions: they run before every step.)
    @precondition(lambda self: self.started and not self.closed and not self.holding and self.store.pages)
    @rule(data=st.data())
    def damage_read_repair(self, data: st.DataObject) -> None:
        """The store damages a page the engine holds too (unless it is damaged
        already), a prefetch of its key runs into it, and a write of the held
        page follows: a write puts a page its lookup misses, and one a read
        found bad, again (the generic rules, in the order that repairs)."""
        candidates = self.repairable()
        if not candidates:
            return
        b, pool, i = data.draw(st.sampled_from(candidates), label="held page")
        d = b.src[pool][i]
        key = page_key(pool, d)
        if self.damage_of(key) is None:
            self.call(self._damage_store, key, *self._draw_damage(data, key))
        self.call(self._prefetch, {pool: [d]}, "wait_complete", "keep")
        self.call(self.settle)
        if b in self.held_backups() and pool not in b.freed:
            self.call(self._write_storage, b, {pool: [i]}, "keep")

    async def _damage_store(self, key: bytes, kind: str, pool: str | None, position: int | None) -> None:
        store = self.store
        before = len(store.corruptions)
        if kind == "flip":
            assert pool is not None and position is not None
            record = store.corrupt(key, pool, position)
        elif kind == "drop":
            assert pool is not None
            record = store.drop_part(key, pool)
        else:
            record = store.malform(key)
        assert record == StoreCorruption(key, kind, pool, position, drawn=False)
        assert store.corruptions[before:] == [record]
        self.damage[key] = (kind, store.pages[key])
        for p in self.pending_prefetches():
            if any(key in ks for ks in p.keys.values()):
                p.damaged.add(key)
                self.note(f"store: {kind} while a prefetch of the page is in flight")
        self.note(f"store: {kind}")

    @precondition(lambda self: self.started and any(b.ok is not False and set(b.pages) - b.freed for b in self.backups))
    @rule(data=st.data())
    def free_host(self, data: st.DataObject) -> None:
        live = [b for b in self.backups if b.ok is not False and set(b.pages) - b.freed]
        b = data.draw(st.sampled_from(live), label="backup")
        pools = data.draw(st.sets(st.sampled_from(sorted(set(b.pages) - b.freed)), min_size=1), label="pools")
        self.call(self._free_host_async, b, tuple(sorted(pools)))

    async def _free_host_async(self, b: Backup, pools: tuple[str, ...]) -> None:
        self._free_host(b, pools)

    def freed_again(self) -> list[tuple[Backup, str]]:
        """(backup, pool) whose pages went back (or will when an operation ends)
        and are not someone else's now: freeing them is a double free."""
        out = []
        for b in self.backups:
            for pool, pages in b.pages.items():
                if b.ok is False or pool in b.freed:
                    others = set()
                    for o in self.backups:
                        if o is not b and o.ok is not False and pool in o.pages:
                            others.update(o.pages[pool])
                    for pf in self.pending_prefetches():
                        others.update(pf.pages.get(pool, ()))
                    if others.isdisjoint(pages):
                        out.append((b, pool))
        return out

    @precondition(lambda self: self.started and self.freed_again())
    @rule(data=st.data())
    def free_host_twice(self, data: st.DataObject) -> None:
        b, pool = data.draw(st.sampled_from(self.freed_again()), label="freed")
        self.call(self._free_twice, b, pool)

    async def _free_twice(self, b: Backup, pool: str) -> None:
        before = self.group.statistics()
        with pytest.raises(InvalidIndices, match=r"host page \d+ is not held; a page is freed once") as info:
            self.sched.free_host({pool: b.host[pool]})
        assert info.value.rule == "double-free" and info.value.pool == pool
        assert self.group.statistics() == before

    @precondition(lambda self: self.started and self.pending_ops())
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        # Handles that ended are checked to refuse cancel() when they settle.
        op = data.draw(st.sampled_from(self.pending_ops()), label="operation")
        self.call(self._cancel, op.handle)

    async def _cancel(self, handle: OperationHandle) -> None:
        op = next(op for op in (*self.backups, *self.loads) if op.handle is handle)
        was_done, was_queued = handle.done(), handle.queued
        assert handle.cancel() is (not was_done)
        if was_done:
            return
        self.note(f"cancel: {'done' if was_done else 'queued' if was_queued else 'in flight'}")
        if was_queued:
            assert handle.done(), "a queued operation was not dropped at once"
            op.cancel = op.cancel or "queued"
        else:
            op.cancel = op.cancel or "in_flight"
        await self._quiet()

    @precondition(lambda self: self.started and not self.closed and not self.holding)
    @rule(store_mode=st.sampled_from(["all", "reads"]))
    def hold(self, store_mode: str) -> None:
        self.gate.clear()
        self.holding = True
        self.store_mode = store_mode
        self.call(self._hold_store)

    async def _hold_store(self) -> None:
        self.store.hold(("exists", "get", "put") if self.store_mode == "all" else ("get", "put"))

    @precondition(lambda self: self.holding and not self.closed)
    @rule()
    def release(self) -> None:
        self.call(self._release)

    async def _release(self) -> None:
        self.gate.set()
        await self._wait_for_transfers()
        await self._drain_store()
        await self._wait_for_everything()
        self.holding = False
        self.store_mode = ""

    async def _wait_for_transfers(self) -> None:
        """Wait for the backups and loads (and the loads waiting for a backup);
        storage operations wait at the store's gate meanwhile."""
        while True:
            for s in [s for s in self.subs if not s.settled and not s.write]:
                await s.done.wait()
            for op in self.pending_ops():
                await self._outcome(op.handle)
            await self.settle()
            if not self.pending_ops() and not [s for s in self.subs if not s.settled and not s.write]:
                return

    async def _drain_store(self) -> None:
        """Let the store's held calls through one at a time, each followed by
        what it sets off, then stop holding: storage operations end in the same
        order on every run, so what a lookup finds stored and which calls the
        store's seeded faults hit are the same too."""
        await self._storage_quiet()
        await self.settle()
        while self.store.step() is not None:
            await self._storage_quiet()
            await self.settle()
        self.store.release()

    async def _wait_for_everything(self) -> None:
        while True:
            waiting = [s for s in self.subs if not s.settled]
            for s in waiting:
                await s.done.wait()
            for op in self.pending_ops():
                await self._outcome(op.handle)
            for sop in self.pending_storage():
                await self._outcome(sop.handle)  # type: ignore[arg-type]
            await self.settle()
            if not self.pending_ops() and not self.pending_storage() and not [s for s in self.subs if not s.settled]:
                return

    @precondition(lambda self: self.holding and not self.closed and self.ex.batches_seen not in self.ex.fail_batches)
    @rule()
    def fail_next_batch(self) -> None:
        self.call(self._fail_next_batch)

    async def _fail_next_batch(self) -> None:
        self.ex.fail_batches.add(self.ex.batches_seen)

    @precondition(lambda self: self.started and any(self.device_held.values()))
    @rule(pool=st.sampled_from(OWNING))
    def evict_device(self, pool: str) -> None:
        if self.device_held[pool]:
            self.call(self._evict_device, pool)

    async def _evict_device(self, pool: str) -> None:
        self.device_alloc(pool).free_pages(self.device_held[pool].pop(0))

    # Closing ends the interesting part of a run: give the other rules room first.
    @precondition(lambda self: self.started and not self.closed and self.steps > CLOSE_AFTER_STEPS)
    @rule()
    def close(self) -> None:
        self.call(self._close)
        self.sched_future.result(timeout=STEP_TIMEOUT_S)  # the scheduler's own errors
        self.closed = True
        self.holding = False

    async def _close(self) -> None:
        self.closing = True
        for op in self.pending_storage():
            op.queued_at_close = op.handle.queued
            op.running_at_close = not op.handle.queued and not op.handle.done()
        self.close_requested.set()
        # Let a held batch go only once the scheduler has closed its queue, so
        # which operations were still queued is decided by the rules alone.
        while not repr(self.sched).startswith("<TransferScheduler closed"):
            await anyio.lowlevel.checkpoint()
        self.gate.set()
        await self._wait_for_transfers()
        await self._drain_store()
        await self.scheduler_exited.wait()
        await self._wait_for_everything()
        self.store_mode = ""

    @precondition(lambda self: self.closed)
    @rule(nowait=st.booleans())
    def submit_after_close(self, nowait: bool) -> None:
        self.call(self._submit_after_close, nowait)

    async def _submit_after_close(self, nowait: bool) -> None:
        before = self.group.statistics()
        idx = self.request({"kv"}, 0, 1)
        with pytest.raises(SchedulerClosed, match="the scheduler is closed; it takes no new operations"):
            if nowait:
                self.sched.backup_nowait(idx)
            else:
                await self.sched.backup(idx)
        with pytest.raises(SchedulerClosed):
            await self.sched.prefetch({"kv": [page_key("kv", self.source["kv"][0])]})
        held = self.held_backups()
        if held:
            b = held[0]
            pool = min(set(b.pages) - b.freed)
            with pytest.raises(SchedulerClosed):
                await self.sched.load({pool: b.host[pool]})
            with pytest.raises(SchedulerClosed):
                await self.sched.write_storage({pool: b.host[pool]}, {pool: [page_key(pool, d) for d in b.src[pool]]})
        assert self.group.statistics() == before

    # -- the end -----------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if self.started:
                if not self.closed:
                    self.close()
                self.call(self._check)
                self.call(self._give_everything_back)
        finally:
            # A failed step may leave a batch held by the gate or the store:
            # let everything go and cancel what is left, so that a failure is
            # reported at once instead of hanging the portal's exit.
            AFTER_RESOLVE.clear()
            self.gate.set()
            store = getattr(self, "store", None)
            if store is not None:
                self.portal.call(_release_store, store)
            self.portal.call(self.portal.stop, True)
            self._portal_cm.__exit__(None, None, None)
            self.detector.deactivate()

    async def _give_everything_back(self) -> None:
        for b in self.backups:
            left = tuple(p for p in b.pages if p not in b.freed)
            if b.ok and left:
                self._free_host(b, left)
        for pool in OWNING:
            for pages in self.device_held[pool]:
                self.device_alloc(pool).free_pages(pages)
            self.device_held[pool].clear()
            self.device_alloc(pool).free_pages(self.source[pool])
        for pool in OWNING:
            host, dev = self.host_alloc(pool), self.device_alloc(pool)
            assert host.num_free_slots == host.capacity, f"host pool {pool!r} leaked {host.num_used_slots} slots"
            assert dev.num_free_slots == dev.capacity, f"device pool {pool!r} leaked {dev.num_used_slots} slots"
        s = self.sched.statistics()
        assert s.deferred_host_frees == 0 and s.batches_in_flight == 0
        for lane in (s.backup, s.load, s.write_storage, s.prefetch):
            assert lane.queue_depth == 0
            assert lane.submitted == lane.completed + lane.failed + lane.cancelled
        assert not self.store.waiting
        for stats in s.pools.values():
            if stats.used_slots is not None:
                assert stats.used_slots == 0 and stats.free_slots == stats.capacity_slots


STATEFUL_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# A passing run takes ~15-25 s on two cores. A bug is found within seconds, but
# shrinking it to a short example can take up to Hypothesis's own limit of five
# minutes, which the suite's default timeout would cut short.
@pytest.mark.timeout(600)
def test_scheduler_slot_accounting_state_machine() -> None:
    with counting_resolutions():
        run_state_machine_as_test(SchedulerMachine, settings=STATEFUL_SETTINGS)


# -- the soak script, briefly ------------------------------------------------------

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def test_a_short_soak_run_leaks_nothing_and_every_byte_matches() -> None:
    # ~1 s of soaking (3 s with the start), the storage tier included.
    out = subprocess.run(
        [sys.executable, str(SOAK), "--operations", "2000", "--fail-probability", "0.2",
         "--storage-fail-probability", "0.1", "--seed", "3"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(line.strip().split(": ", 1) for line in out.stdout.splitlines())
    assert int(lines["operations done"].split()[0]) >= 2000  # requests in flight may finish theirs
    assert lines["leaked slots"] == "0"
    assert lines["bytes mismatched"].startswith("0 (of ")
    assert lines["contract violations"] == "0"
    assert int(lines["faults injected"].split()[0]) > 0
    assert "resident memory" in lines
    # The storage tier was exercised: writes, prefetches that handed pages back
    # (compared byte for byte) and ones that stopped early, and store faults.
    assert int(lines["storage writes"].split()[0]) > 0
    prefetched = lines["prefetched pages"].split()
    assert int(prefetched[0]) > 0
    assert int(lines["prefetches"].split(" stopped early")[0].split()[-1]) > 0
    mismatched = lines["storage bytes mismatched"].split()
    assert mismatched[0] == "0" and int(mismatched[2]) > 0
    assert int(lines["storage faults injected"].split()[0]) > 0
    # No wrong byte anywhere (device loads, prefetched pages, stored pages),
    # while the store damaged pages, prefetches rejected some and writes
    # repaired some, readers of freed pages waited as they were reallocated,
    # and the engine changed its index buffers after submitting.
    wrong = re.fullmatch(r"(\d+) \(of (\d+) bytes checked: (\d+) in device loads, (\d+) in prefetched pages, "
                         r"(\d+) in stored pages\)", lines["wrong bytes found"])
    assert wrong is not None, lines["wrong bytes found"]
    assert wrong[1] == "0" and all(int(n) > 0 for n in wrong.groups()[1:])
    damage = re.match(r"(\d+) pages damaged .*?; (\d+) pages rejected by prefetches, (\d+) repaired by writes",
                      lines["store damage"])
    assert damage is not None, lines["store damage"]
    assert all(int(n) > 0 for n in damage.groups()), lines["store damage"]
    # Whatever the timing let the random rounds reach, the closing round
    # flipped stored pages, and every one was rejected, repaired and read back.
    closing = re.fullmatch(r"(\d+) pages damaged \((\d+) flipped, (\d+) swapped, (\d+) spliced\), (\d+) rejected by "
                           r"prefetches, (\d+) repaired by writes, (\d+) read back byte-exact", lines["closing damage round"])
    assert closing is not None, lines["closing damage round"]
    damaged, flipped, swapped, spliced, *outcomes = (int(n) for n in closing.groups())
    assert flipped > 0 and swapped > 0 and spliced > 0, lines["closing damage round"]
    assert outcomes == [damaged] * 3 and damaged == flipped + swapped + spliced, lines["closing damage round"]
    realloc = re.match(r"(\d+) readers waited .*?: (\d+) refused \(InvalidIndices\)", lines["free-then-reallocate"])
    assert realloc is not None and all(int(n) > 0 for n in realloc.groups()), lines["free-then-reallocate"]
    assert int(lines["index buffers reused after submit"].split()[0]) > 0
