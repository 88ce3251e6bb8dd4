"""Soak run: a long mixed workload with injected faults and cancellations.

    python benchmarks/soak.py --operations 100000
    python benchmarks/soak.py --seconds 600 --fail-probability 0.05 --seed 7

Concurrent "requests" on `kvtier.testing.hybrid_group` (every pool kind: kv,
swa, the c4 and swa_state sidecars, state, the tok anchor and its idx sidecar)
back their pages up, load them back (into device slots they allocate or that
kvtier allocates), sometimes evict the host copy while the load is still in
flight, and sometimes cancel what they submitted, queued or in flight. The
executor fails batches at random (seeded) at a random layer or pool; the host
pools are small enough that allocations run short now and then, and a reclaim
hook gets its chance.

Every load that succeeds is compared byte for byte with the rows it came from.
At the end every request has given back what it held, so every host and device
allocator must be empty again. Prints operations done, faults injected, leaked
slots, bytes mismatched and resident memory at start and end; exits 1 if any
slot leaked or any byte mismatched.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import structlog
import torch

from kvtier import (
    OperationCancelled,
    PoolExhausted,
    SchedulerConfig,
    TransferFailed,
    TransferScheduler,
)
from kvtier.pools import PageAllocator, PoolGroup, slots_of_pages
from kvtier.scheduler import OperationHandle
from kvtier.testing import FaultInjectingExecutor, hybrid_group

PAGE = 8
OWNING = ("kv", "state", "swa", "tok")
SIDECARS = {"kv": ("c4",), "swa": ("swa_state",), "tok": ("idx",), "state": ()}
# Which pools one request backs up: whole models and partial ones.
POOL_SETS = (("kv", "state", "swa", "tok"), ("kv", "state", "swa", "tok"), ("kv", "tok"), ("swa", "state"), ("state",))


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


@dataclass
class Tally:
    submitted: int = 0
    backups: int = 0
    loads: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    bytes_checked: int = 0
    bytes_mismatched: int = 0
    host_evicted_in_flight: int = 0


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
        self.tally = Tally()
        self.deadline = float("inf")

    def device_alloc(self, pool: str) -> PageAllocator:
        a = self.group[pool].device_allocator
        assert isinstance(a, PageAllocator)
        return a

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
        except TransferFailed:
            self.tally.outcomes["failed"] += 1
            return False
        except OperationCancelled:
            self.tally.outcomes["cancelled"] += 1
            return False
        self.tally.outcomes["completed"] += 1
        return True

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

    async def request(self, sched: TransferScheduler, worker: int) -> None:
        """One request's life, over and over: back up, load back, verify, evict."""
        rng = random.Random(f"{self.args.seed}:{worker}")
        # The request's live cache rows: reserved from the engine's device
        # allocators for the whole run, never written, so they are the truth.
        source = {p: self.device_alloc(p).try_alloc_pages(1) for p in OWNING}
        assert all(v is not None for v in source.values()), "device pools too small for the requests"
        try:
            while self.more():
                pools = rng.choice(POOL_SETS)
                device = {p: slots_of_pages(source[p], page_size(p)) for p in pools}  # type: ignore[arg-type]
                try:
                    backup = await sched.backup(device)
                except PoolExhausted:
                    self.tally.outcomes["exhausted"] += 1
                    continue
                self.tally.submitted += 1
                self.tally.backups += 1
                if not await self.settle(backup, rng):
                    continue  # a backup that did not succeed gave its host pages back
                host = {p: backup.host_indices[p] for p in pools}
                evicted = False
                for _ in range(rng.choice((0, 1, 1, 2))):
                    if evicted or not self.more():
                        break
                    evicted = await self.load(sched, rng, pools, host, backup)
                if not evicted:
                    sched.free_host(host)
        finally:
            for p, pages in source.items():
                if pages is not None:
                    self.device_alloc(p).free_pages(pages)

    async def load(
        self, sched: TransferScheduler, rng: random.Random, pools: tuple[str, ...],
        host: dict[str, torch.Tensor], backup: OperationHandle,
    ) -> bool:
        """Load some of ``pools`` back into fresh device slots and compare.
        Returns True if the host copy was evicted meanwhile."""
        chosen = tuple(p for p in pools if rng.random() < 0.7) or pools[:1]
        # Device slots: some the engine allocates itself, the rest kvtier does.
        mine: dict[str, list[int]] = {}
        for p in chosen:
            if rng.random() < 0.5:
                got = self.device_alloc(p).try_alloc_pages(1)
                if got is not None:
                    mine[p] = got
        try:
            load = await sched.load(
                {p: host[p] for p in chosen},
                {p: slots_of_pages(pages, page_size(p)) for p, pages in mine.items()},
            )
        except PoolExhausted:
            self.tally.outcomes["exhausted"] += 1
            for p, pages in mine.items():
                self.device_alloc(p).free_pages(pages)
            return False
        self.tally.submitted += 1
        self.tally.loads += 1
        evicted = rng.random() < 0.25
        if evicted:
            # Host eviction while the load may still read: kvtier defers the free.
            sched.free_host(host)
            self.tally.host_evicted_in_flight += 1
        if await self.settle(load, rng):
            self.compare(chosen, backup.device_indices, load.device_indices)
            for p in chosen:  # the caller owns every destination slot now
                self.device_alloc(p).free(load.device_indices[p])
        else:
            for p, pages in mine.items():  # kvtier freed only what it allocated
                self.device_alloc(p).free_pages(pages)
        return evicted

    async def run(self) -> tuple[int, dict[str, int]]:
        args = self.args
        self.deadline = time.monotonic() + args.seconds if args.seconds else float("inf")
        config = SchedulerConfig(max_batch_ops=args.max_batch_ops)
        async with TransferScheduler(self.group, executor=self.executor, config=config, reclaim=self.reclaim) as sched:
            async with anyio.create_task_group() as tg:
                for w in range(args.requests):
                    tg.start_soon(self.request, sched, w)
            stats = sched.statistics()
        leaked: dict[str, int] = {}
        for pool in OWNING:
            host = self.group[pool].host.allocator
            assert host is not None
            leaked[f"{pool} host"] = host.num_used_slots
            leaked[f"{pool} device"] = self.device_alloc(pool).num_used_slots
        leaked["deferred frees"] = stats.deferred_host_frees
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
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.operations is None:
        args.operations = sys.maxsize if args.seconds else 10_000
    if args.operations < 1 or args.requests < 1 or args.seconds < 0:
        ap.error("--operations and --requests must be >= 1 and --seconds >= 0")
    if not 0 <= args.fail_probability <= 1 or not 0 <= args.cancel_probability <= 1:
        ap.error("probabilities must be in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # Failed batches log warnings by design; a soak run reports counts instead.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    torch.set_num_threads(1)
    soak = Soak(args)
    rss_start = rss_mib()
    t0 = time.perf_counter()
    leaked, where = anyio.run(soak.run)
    seconds = time.perf_counter() - t0
    rss_end, rss_peak = rss_mib(), rss_mib("VmHWM")
    t = soak.tally
    o = t.outcomes
    print(f"soak: seed {args.seed}, {args.requests} concurrent requests, fail probability {args.fail_probability}, "
          f"cancel probability {args.cancel_probability}")
    done = t.submitted + o["exhausted"]
    print(f"operations done: {done} ({t.backups} backups and {t.loads} loads submitted, {o['exhausted']} refused "
          f"with PoolExhausted) in {seconds:.1f} s ({done / seconds:.0f} operations/s)")
    print(f"outcomes: {o['completed']} completed, {o['failed']} failed, {o['cancelled']} cancelled; "
          f"{t.host_evicted_in_flight} host evictions while a load was in flight")
    print(f"faults injected: {soak.executor.faults_injected} (in {soak.executor.batches_seen} batches)")
    print(f"leaked slots: {leaked}" + ("" if not leaked else f" {where}"))
    print(f"bytes mismatched: {t.bytes_mismatched} (of {t.bytes_checked} compared)")
    print(f"resident memory: start {rss_start:.1f} MiB, end {rss_end:.1f} MiB, peak {rss_peak:.1f} MiB")
    return 1 if leaked or t.bytes_mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
