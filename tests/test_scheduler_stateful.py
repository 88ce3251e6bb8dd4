"""A Hypothesis state machine over TransferScheduler's slot accounting.

The scheduler runs on an event loop in a background thread (an anyio blocking
portal); each rule calls into that loop and returns once the loop is quiet.
Copies either finish inside the rule that submitted them, or, while the rules
hold the executor (`FaultInjectingExecutor.hold`), stay queued or in flight
until a `release` or `close` rule. So which operations share a batch, and so
which batches the executor's seeded random faults hit, is the same on every
run of an example, and Hypothesis can shrink a failure.

A model on the test side says who owns every host page and every device page
that the device allocators hand out: free, an operation in flight, or the
caller. After every step the allocators must agree with it page for page; every
operation that ended must have ended as the model predicts (success with every
byte in place, or `TransferFailed` / `OperationCancelled` / `SchedulerClosed` /
`PoolExhausted`), and its handle resolved exactly once. At the end everything is
given back and every pool's free count must equal its capacity.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
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
from kvtier.scheduler import OperationHandle, OperationResult
from kvtier.testing import (
    FaultInjectingExecutor,
    FaultRecord,
    InjectedFault,
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


def page_size(pool: str) -> int:
    return 1 if pool == "state" else PAGE


@dataclass(eq=False, kw_only=True)
class Op:
    handle: OperationHandle
    cancel: str = ""  # how cancel() found it: "queued" or "in_flight"
    settled: bool = False


@dataclass(eq=False, kw_only=True)
class Backup(Op):
    pages: dict[str, list[int]]  # host pages per slot-owning pool
    host: dict[str, torch.Tensor]  # host indices per slot-owning pool
    freed: set[str] = field(default_factory=set)  # pools the caller gave back with free_host
    ok: bool | None = None  # None while in flight


@dataclass(eq=False, kw_only=True)
class Load(Op):
    backup: Backup
    pools: tuple[str, ...]
    dest: dict[str, list[int]]  # device pages per pool
    explicit: frozenset[str]  # pools whose device pages the caller allocated


@dataclass(eq=False, kw_only=True)
class Submission:
    """A load of a backup's pages, submitted while that backup was in flight:
    `load` waits for the backup before it takes anything."""

    backup: Backup
    pools: tuple[str, ...]
    dest: dict[str, list[int]]  # all allocated by the caller
    done: anyio.Event
    result: OperationHandle | BaseException | None = None
    settled: bool = False


# Resolutions per handle object, counted while the state machine runs. The
# handle is kept too, so that its id() is not reused by a later handle.
RESOLUTIONS: dict[int, tuple[OperationHandle, int]] = {}


def resolutions(handle: OperationHandle) -> int:
    return RESOLUTIONS.get(id(handle), (handle, 0))[1]


@contextmanager
def counting_resolutions() -> Iterator[None]:
    """Count `OperationHandle._resolve` calls per handle in ``RESOLUTIONS``."""
    original = OperationHandle._resolve

    def counted(self: OperationHandle, result: Any, error: Any) -> None:
        RESOLUTIONS[id(self)] = (self, resolutions(self) + 1)
        original(self, result, error)

    OperationHandle._resolve = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        OperationHandle._resolve = original  # type: ignore[method-assign]


class SchedulerMachine(RuleBasedStateMachine):
    """Rules: backup (wait or nowait, any subset of pools), load (into device
    pages the caller or kvtier allocates, maybe evicting the host copy at once),
    load of a backup still in flight, free_host, a second free_host, cancel,
    hold / release the executor, fail the next batch, evict device pages, close,
    submit after close. The reclaim hook (when drawn) evicts what the caller holds.
    """

    def __init__(self) -> None:
        super().__init__()
        RESOLUTIONS.clear()  # ids of the last example's handles may be reused
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
                reclaim=self._reclaim if self.with_reclaim else None,
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

    def reads_pending(self, b: Backup, pool: str) -> bool:
        return any(ld.backup is b and pool in ld.pools and not ld.settled for ld in self.loads)

    def expected_host(self, pool: str) -> tuple[set[int], int]:
        """Host pages of ``pool`` that are taken, and how many of them the caller
        freed while an operation still used them (deferred)."""
        taken: set[int] = set()
        deferred = 0
        for b in self.backups:
            pages = b.pages.get(pool)
            if not pages or b.ok is False:
                continue
            in_use = b.ok is None or self.reads_pending(b, pool)
            if pool in b.freed:
                if not in_use:
                    continue
                deferred += len(pages)
            assert taken.isdisjoint(pages), f"model gave host pages of {pool!r} to two backups"
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

    def lane_full(self, direction: str) -> bool:
        queued = sum(
            1 for op in self.pending_ops()
            if op.handle.queued and op.handle.direction.value == direction
        )
        return queued >= self.config.max_queued_ops

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
    )
    def setup(
        self, host_pages: int, state_slots: int, with_reclaim: bool, on_close: str,
        max_batch_ops: int, max_queued_ops: int, fail_probability: float, seed: int, layout: str,
    ) -> None:
        self.group = hybrid_group(
            host_slots=host_pages * PAGE, state_slots=state_slots, device_slots=DEVICE_SLOTS,
            layout=layout, device_allocator=True, seed=seed,  # type: ignore[arg-type]
        )
        self.ex = FaultInjectingExecutor(hold=self.gate, fail_probability=fail_probability, seed=seed)
        self.config = SchedulerConfig(
            max_batch_ops=max_batch_ops, max_queued_ops=max_queued_ops, on_close=on_close,  # type: ignore[arg-type]
        )
        self.with_reclaim = with_reclaim
        self.source = {p: self.device_alloc(p).try_alloc_pages(n) or [] for p, n in SOURCE_PAGES.items()}
        self.capacity = {p: self.host_alloc(p).num_pages for p in OWNING}
        self.sched_future, self.sched = self.portal.start_task(self._run_scheduler)
        self.started = True

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
        if op_id in failed:
            return TransferFailed
        if op.cancel == "in_flight":
            return OperationCancelled
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
        self.note(f"{op.handle.direction.value} ended: {expected.__name__ if expected else 'ok'}")
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
        self.note(f"load after a backup in flight: {type(result).__name__}")
        if s.backup.ok is False:
            assert isinstance(result, TransferFailed), f"expected TransferFailed, got {result!r}"
            assert "did not complete" in str(result)
        elif self.closing:
            assert isinstance(result, SchedulerClosed), f"expected SchedulerClosed, got {result!r}"
        elif s.backup.freed & set(s.pools):
            assert isinstance(result, InvalidIndices), f"expected InvalidIndices, got {result!r}"
        else:
            assert isinstance(result, OperationHandle), f"expected a handle, got {result!r}"
            self.loads.append(Load(
                handle=result, backup=s.backup, pools=s.pools, dest=s.dest, explicit=frozenset(s.dest),
            ))
            return
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
        host, dev = b.handle.host_indices, b.handle.device_indices
        for pool in b.pages:
            for name in (pool, *SIDECARS[pool]):
                if self.group[name].device is None:
                    continue
                for x, y in zip(self._rows(name, host[name], host=True), self._rows(name, dev[name], host=False)):
                    assert torch.equal(x, y), f"backup {b.handle.id}: host rows of {name!r} differ from the device"

    def _check_load_bytes(self, ld: Load) -> None:
        src, dst = ld.backup.handle.device_indices, ld.handle.device_indices
        for pool in ld.pools:
            assert torch.equal(dst[pool], slots_of_pages(ld.dest[pool], page_size(pool)))
            for name in (pool, *SIDECARS[pool]):
                if self.group[name].device is None:
                    continue
                for x, y in zip(self._rows(name, src[name], host=False), self._rows(name, dst[name], host=False)):
                    assert torch.equal(x, y), f"load {ld.handle.id}: rows of {name!r} did not round-trip"

    # -- the check after every step ----------------------------------------------

    async def _check(self) -> None:
        await self.settle()
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
            pending = [op for op in self.pending_ops() if op.handle.direction.value == direction]
            assert lane.queue_depth == sum(1 for op in pending if op.handle.queued)
            assert lane.submitted == lane.completed + lane.failed + lane.cancelled + len(pending)
        if not self.holding:
            assert not self.pending_ops(), "operations left in flight with the executor released"

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
    )
    def backup(self, pools: set[str], first: int, npages: int, nowait: bool, priority: int) -> None:
        self.call(self._backup, self.request(pools, first, npages), nowait, priority)

    async def _backup(self, idx: dict[str, torch.Tensor], nowait: bool, priority: int) -> None:
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
        assert set(handle.host_indices) == {n for p in idx for n in (p, *SIDECARS[p])}
        pages = {p: [int(v) // page_size(p) for v in handle.host_indices[p][:: page_size(p)]] for p in idx}
        self.backups.append(Backup(handle=handle, pages=pages, host={p: handle.host_indices[p] for p in idx}))
        await self._after_submit(handle)

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
        self.call(self._load, b, tuple(sorted(pools)), explicit, tuple(sorted(evict)))

    async def _load(self, b: Backup, pools: tuple[str, ...], explicit: set[str], evict: tuple[str, ...]) -> None:
        dest: dict[str, list[int]] = {}
        for pool in sorted(explicit):
            got = self.device_alloc(pool).try_alloc_pages(len(b.pages[pool]))
            if got is not None:
                dest[pool] = got
        full = self.lane_full("load")
        handle: OperationHandle | None = None
        device = {p: slots_of_pages(pages, page_size(p)) for p, pages in dest.items()}
        try:
            with anyio.move_on_after(0.02 if full else STEP_TIMEOUT_S):
                handle = await self.sched.load({p: b.host[p] for p in pools}, device)
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
        if evict:
            self._free_host(b, evict)
        await self._after_submit(handle)

    def backups_in_flight(self) -> list[Backup]:
        return [b for b in self.backups if b.ok is None and set(b.pages) - b.freed]

    @precondition(lambda self: self.holding and not self.closed and self.backups_in_flight())
    @rule(data=st.data())
    def load_while_backing_up(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.backups_in_flight()), label="backup")
        pools = data.draw(st.sets(st.sampled_from(sorted(set(b.pages) - b.freed)), min_size=1), label="pools")
        s = self.call(self._reserve_for_load, b, tuple(sorted(pools)))
        if s is None:
            return
        # From this thread: the portal starts tasks for callers outside its loop.
        self.portal.start_task_soon(self._submit, s)
        self.call(self._waits_for_backup, s)

    async def _reserve_for_load(self, b: Backup, pools: tuple[str, ...]) -> Submission | None:
        dest: dict[str, list[int]] = {}
        for pool in pools:
            got = self.device_alloc(pool).try_alloc_pages(len(b.pages[pool]))
            if got is None:
                for p, pages in dest.items():
                    self.device_alloc(p).free_pages(pages)
                return None
            dest[pool] = got
        s = Submission(backup=b, pools=pools, dest=dest, done=anyio.Event())
        self.subs.append(s)
        return s

    async def _submit(self, s: Submission) -> None:
        try:
            s.result = await self.sched.load(
                {p: s.backup.host[p] for p in s.pools},
                {p: slots_of_pages(pages, page_size(p)) for p, pages in s.dest.items()},
            )
        except Exception as exc:  # noqa: BLE001 - settle() checks it
            s.result = exc
        finally:
            s.done.set()

    async def _waits_for_backup(self, s: Submission) -> None:
        await self._quiet()
        assert not s.done.is_set(), f"a load did not wait for the backup writing its pages: {s.result!r}"

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
    @rule()
    def hold(self) -> None:
        self.gate.clear()
        self.holding = True

    @precondition(lambda self: self.holding and not self.closed)
    @rule()
    def release(self) -> None:
        self.call(self._release)

    async def _release(self) -> None:
        self.gate.set()
        await self._wait_for_everything()
        self.holding = False

    async def _wait_for_everything(self) -> None:
        while True:
            waiting = [s for s in self.subs if not s.settled]
            for s in waiting:
                await s.done.wait()
            for op in self.pending_ops():
                await self._outcome(op.handle)
            await self.settle()
            if not self.pending_ops() and not [s for s in self.subs if not s.settled]:
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
        self.close_requested.set()
        # Let a held batch go only once the scheduler has closed its queue, so
        # which operations were still queued is decided by the rules alone.
        while not repr(self.sched).startswith("<TransferScheduler closed"):
            await anyio.lowlevel.checkpoint()
        self.gate.set()
        await self.scheduler_exited.wait()
        await self._wait_for_everything()

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
        held = self.held_backups()
        if held:
            b = held[0]
            pool = min(set(b.pages) - b.freed)
            with pytest.raises(SchedulerClosed):
                await self.sched.load({pool: b.host[pool]})
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
            self.gate.set()
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
        for lane in (s.backup, s.load):
            assert lane.queue_depth == 0
            assert lane.submitted == lane.completed + lane.failed + lane.cancelled
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
    out = subprocess.run(
        [sys.executable, str(SOAK), "--operations", "2000", "--fail-probability", "0.2", "--seed", "3"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert int(lines["operations done"].split()[0]) >= 2000  # requests in flight may finish theirs
    assert lines["leaked slots"] == "0"
    assert lines["bytes mismatched"].startswith("0 (of ")
    assert int(lines["faults injected"].split()[0]) > 0
    assert "resident memory" in lines
