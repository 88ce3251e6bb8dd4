"""CudaExecutor's ordering logic, driven on CPU through a fake device backend.

`FakeGpu` models what a real device does and a naive fake would not:

* asynchronous work: an enqueued copy, gather or scatter lands only when an
  event recorded after it on its stream completes (at once with ``auto``, when
  the test says otherwise), so reading a destination too early sees stale
  bytes, and an op whose tensor was freed before it ran fails its stream;
* stream order: a stream runs its work in order and stops at a
  ``wait_event`` until that event completed; every enqueue is checked against
  earlier work on other streams (vector clocks, as a race checker does), and
  touching memory that unordered earlier work still reads or writes raises
  `MissingStreamWait` at once;
* memory kinds: the group's device tensors and what the backend allocates on
  the device are device memory; host pools and ``pinned_empty`` are pinned; a
  copy between the device and any other (pageable) host memory, or a strided
  host side, raises `PageableCopy`, because torch would silently make such a
  non-blocking copy synchronous.

Events are synchronized only from worker threads; the event loop's thread
gets an AssertionError.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

from conftest import assert_rows_equal, pages, rows, used, wait_until, wipe
from kvtier import ConfigurationError, DevicePool, PoolGroup, SchedulerConfig, TransferFailed, TransferScheduler
from kvtier.pools.host import HostPool, register_pinned
from kvtier.pools.device import PlaneSpec
from kvtier.testing import full_attention_group, hybrid_group
from kvtier.transfers.cuda import CudaExecutor
from kvtier.transfers.eventloop import WorkerThread
from kvtier.transfers.executor import Batch, LayerProgress
from kvtier.transfers.operation import Direction


class MissingStreamWait(RuntimeError):
    pass


class PageableCopy(RuntimeError):
    pass


class FreedTooEarly(RuntimeError):
    pass


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


class Operand:
    """A tensor an enqueued op touches, held by a weak reference to its root
    tensor (so that freeing it before the op ran is seen), with the bytes of
    its storage it covers (``rows``: only those rows of dimension 0)."""

    def __init__(self, t: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        root = _root(t)
        if root.dtype != t.dtype:
            raise AssertionError("the fake does not follow dtype views")
        self.ref = weakref.ref(root)
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()
        self.storage = t.untyped_storage().data_ptr()
        self.itemsize = t.element_size()
        self.rows = None if rows is None else rows.clone()
        self._bytes: torch.Tensor | None = None

    def tensor(self) -> torch.Tensor:
        root = self.ref()
        if root is None:
            raise FreedTooEarly("a tensor an enqueued op uses was freed before the op ran")
        return root.as_strided(self.size, self.stride, self.offset)

    def bytes(self) -> torch.Tensor:
        if self._bytes is None:
            idx = torch.tensor([self.offset])
            for n, st in zip(self.size, self.stride):
                idx = (idx[:, None] + torch.arange(n) * st).reshape(-1)
            if self.rows is not None:
                idx = idx.view(self.size[0], -1)[self.rows].reshape(-1)
            self._bytes = ((idx * self.itemsize)[:, None] + torch.arange(self.itemsize)).reshape(-1)
        return self._bytes

    def overlaps(self, other: Operand) -> bool:
        return self.storage == other.storage and bool(torch.isin(self.bytes(), other.bytes()).any())


class Op:
    def __init__(self, kind: str, stream: FakeStream, reads: Sequence[Operand], writes: Sequence[Operand],
                 run: Callable[[], None]) -> None:
        self.kind, self.stream, self.reads, self.writes, self.run = kind, stream, reads, writes, run
        self.index = 0
        self.clock: dict[FakeStream, int] = {}

    def conflicts(self, other: Op) -> bool:
        return any(w.overlaps(o) for w in self.writes for o in (*other.reads, *other.writes)) or any(
            r.overlaps(w) for r in self.reads for w in other.writes
        )


class FakeEvent:
    def __init__(self, gpu: FakeGpu, timing: bool = False) -> None:
        self.gpu = gpu
        self.timing = timing
        self.done = True  # as in CUDA, an event never recorded counts as complete
        self.released = False
        self.error: BaseException | None = None
        self.stream: FakeStream | None = None
        self.clock: dict[FakeStream, int] = {}
        self.tick = 0

    def record(self, stream: FakeStream | None = None) -> None:
        gpu = self.gpu
        with gpu.cond:
            stream = stream or gpu.current_stream()
            self.stream = stream
            self.done = False
            self.released = gpu.auto
            self.clock = dict(gpu.merged(stream.clock))
            gpu.ticks += 1
            self.tick = gpu.ticks
            stream.events.append(self)
            stream.items.append(("record", self))
            gpu.log.append(("record", stream.name, self))

    def query(self) -> bool:
        with self.gpu.cond:
            self.gpu.advance()
            if self.done:
                self.gpu.observed(self)
            return self.done

    def synchronize(self) -> None:
        gpu = self.gpu
        if threading.get_ident() == gpu.loop_thread:
            raise AssertionError("synchronize() on the event loop's thread blocks the loop")
        with gpu.cond:
            gpu.advance()
            if not gpu.cond.wait_for(lambda: self.done, timeout=10):
                raise AssertionError("the fake GPU's event never completed")
            gpu.observed(self)
            if self.error is not None:
                raise self.error

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.timing and end.timing):
            raise AssertionError("elapsed_time needs two timing events")
        return float(end.tick - self.tick)  # "milliseconds": one per enqueued item


class FakeStream:
    def __init__(self, gpu: FakeGpu, name: str) -> None:
        self.gpu = gpu
        self.name = name
        self.events: list[FakeEvent] = []
        self.items: deque[tuple[str, Any]] = deque()
        self.clock: dict[FakeStream, int] = {self: 0}
        self.error: BaseException | None = None
        gpu.all_streams.append(self)

    def wait_event(self, event: FakeEvent) -> None:
        gpu = self.gpu
        with gpu.cond:
            gpu.log.append(("wait", self.name, event))
            self.clock = gpu.merge(gpu.merged(self.clock), event.clock)
            self.items.append(("wait", event))

    def record_event(self) -> FakeEvent:
        ev = FakeEvent(self.gpu)
        ev.record(self)
        return ev

    def complete(self, n: int | None = None) -> None:
        """Let this stream's next ``n`` (default: all) events complete, FIFO,
        and run what they cover."""
        with self.gpu.cond:
            pending = [e for e in self.events if not e.released]
            for e in pending[: len(pending) if n is None else n]:
                e.released = True
            self.gpu.advance()

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class FakeGpu:
    """A `DeviceBackend` whose device is the CPU; see the module docstring."""

    def __init__(self, group: PoolGroup | None = None, *, auto: bool = True, fail_on_copy: int | None = None,
                 pin_host: bool = True, registrations: dict[int, int] | None = None) -> None:
        self.auto = auto
        # Host ranges registered one by one (address -> bytes), when a test
        # models cudaHostRegister: a copy's host side must lie inside one.
        self.registrations = registrations
        self.cond = threading.Condition(threading.RLock())
        self.loop_thread = threading.get_ident()
        self.log: list[tuple[Any, ...]] = []
        self.all_streams: list[FakeStream] = []
        self.streams: list[FakeStream] = []  # made by new_stream (the executor's)
        self.default = FakeStream(self, "compute")
        self._local = threading.local()
        self.threads: set[int] = set()
        self.copies = 0
        self.fail_on_copy = fail_on_copy
        self.ticks = 0
        self.host_clock: dict[FakeStream, int] = {}
        self.live: list[Op] = []  # enqueued ops the host has not seen complete
        self.device_storages: set[int] = set()
        self.pinned_storages: set[int] = set()
        if group is not None:
            self.adopt(group, pin_host=pin_host)

    # -- set-up ---------------------------------------------------------------

    def adopt(self, group: PoolGroup, *, pin_host: bool = True) -> None:
        """The group's device tensors are device memory; its host pools are
        pinned unless ``pin_host`` is False (as when registration was skipped)."""
        for spec in group:
            if spec.device is not None:
                for j in range(spec.device.num_layers):
                    for p in range(len(spec.device.planes)):
                        self.device_storages.add(spec.device.tensor(j, p).untyped_storage().data_ptr())
            if pin_host and spec.host.has_bytes:
                for p in range(len(spec.host.planes)):
                    self.pinned_storages.add(spec.host.buffer(p).untyped_storage().data_ptr())

    @asynccontextmanager
    async def completing(self) -> AsyncIterator[None]:
        """On exit, complete every event and go on at once: a test that fails
        while events are pending fails at once instead of leaving the
        executor waiting (it never returns before its copies complete)."""
        try:
            yield
        finally:
            with self.cond:
                self.auto = True
                for s in self.all_streams:
                    for e in s.events:
                        e.released = True
                self.advance()

    # -- clocks and execution (callers hold self.cond) ------------------------

    @staticmethod
    def merge(a: dict[FakeStream, int], b: dict[FakeStream, int]) -> dict[FakeStream, int]:
        out = dict(a)
        for s, n in b.items():
            out[s] = max(out.get(s, 0), n)
        return out

    def merged(self, clock: dict[FakeStream, int]) -> dict[FakeStream, int]:
        """What a stream knows once work enqueued now is ordered after what the
        host has seen complete."""
        return self.merge(clock, self.host_clock)

    def observed(self, event: FakeEvent) -> None:
        """The host saw ``event`` complete: everything before it is ordered
        before anything enqueued from now on."""
        self.host_clock = self.merge(self.host_clock, event.clock)
        self.live = [op for op in self.live if self.host_clock.get(op.stream, 0) < op.index]

    def enqueue(self, stream: FakeStream, op: Op) -> None:
        with self.cond:
            stream.clock = self.merged(stream.clock)
            stream.clock[stream] = stream.clock.get(stream, 0) + 1
            op.index, op.clock = stream.clock[stream], dict(stream.clock)
            for other in self.live:
                if other.stream is not stream and op.clock.get(other.stream, 0) < other.index and op.conflicts(other):
                    raise MissingStreamWait(
                        f"{op.kind} on stream {stream.name!r} touches memory that a {other.kind} enqueued earlier "
                        f"on stream {other.stream.name!r} may still use: a stream wait is missing"
                    )
            self.live.append(op)
            self.ticks += 1
            stream.items.append(("op", op))

    def advance(self) -> None:
        """Run every stream as far as its released events and waits allow."""
        moved = True
        while moved:
            moved = False
            for s in self.all_streams:
                while s.items:
                    kind, item = s.items[0]
                    if kind == "wait":
                        if not item.done:
                            break
                    elif kind == "op":
                        nxt = next((x for k, x in s.items if k == "record"), None)
                        if nxt is None or not (nxt.released or self.auto):
                            break
                        if s.error is None:
                            try:
                                item.run()
                            except BaseException as exc:  # a device error: the stream is broken
                                s.error = exc
                    else:
                        if not (item.released or self.auto):
                            break
                        item.error = s.error
                        item.done = True
                    s.items.popleft()
                    moved = True
        self.cond.notify_all()

    # -- DeviceBackend --------------------------------------------------------

    def new_stream(self) -> FakeStream:
        s = FakeStream(self, f"copy{len(self.streams)}")
        self.streams.append(s)
        return s

    def new_event(self, *, timing: bool = False) -> FakeEvent:
        return FakeEvent(self, timing)

    @contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        prev = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = prev

    def current_stream(self) -> FakeStream:
        s: FakeStream = getattr(self._local, "stream", self.default)
        return s

    def _kind(self, t: torch.Tensor) -> str:
        ptr = t.untyped_storage().data_ptr()
        return "device" if ptr in self.device_storages else "pinned" if ptr in self.pinned_storages else "pageable"

    def _record_op(self, kind: str, dst: torch.Tensor) -> None:
        self.threads.add(threading.get_ident())
        self.log.append((kind, self.current_stream().name, dst.data_ptr(), dst.numel() * dst.element_size()))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies += 1
        if self.fail_on_copy is not None and self.copies == self.fail_on_copy:
            raise RuntimeError("fake copy failure")
        kinds = (self._kind(dst), self._kind(src))
        if "device" not in kinds:
            raise PageableCopy(f"a copy between two host tensors ({kinds[1]} -> {kinds[0]}) went to the device")
        for t, k, side in ((dst, kinds[0], "destination"), (src, kinds[1], "source")):
            if k == "pageable":
                raise PageableCopy(f"non_blocking copy with a pageable host {side}: torch would copy synchronously")
            if k == "pinned" and not t.is_contiguous():
                raise PageableCopy(f"non_blocking copy with a strided host {side}: torch would stage it pageable")
            if k == "pinned" and self.registrations is not None:
                self._check_one_registration(t, side)
        w, r = Operand(dst), Operand(src)
        self.enqueue(self.current_stream(), Op("copy", self.current_stream(), [r], [w],
                                               lambda: w.tensor().copy_(r.tensor())))
        self._record_op("copy", dst)

    def _check_one_registration(self, t: torch.Tensor, side: str) -> None:
        """A host range that starts in one registration must end in it: the
        driver may take a range over two as pageable (synchronous)."""
        assert self.registrations is not None
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        for base, size in self.registrations.items():
            if base <= start < base + size:
                if end > base + size:
                    raise PageableCopy(f"non_blocking copy whose host {side} spans two registrations "
                                       f"(bytes {start - base}..{end - base} of a {size}-byte one)")
                return

    def gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = self.device_empty((len(index), *src.shape[1:]), src.dtype)
        s, i, o = Operand(src, rows=index), Operand(index), Operand(out)
        self.enqueue(self.current_stream(), Op("gather", self.current_stream(), [s, i], [o],
                                               lambda: o.tensor().copy_(s.tensor().index_select(0, i.tensor()))))
        self._record_op("gather", out)
        return out

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        d, i, s = Operand(dst, rows=index), Operand(index), Operand(src)
        self.enqueue(self.current_stream(), Op("scatter", self.current_stream(), [i, s], [d],
                                               lambda: d.tensor().index_copy_(0, i.tensor(), s.tensor())))
        self._record_op("scatter", dst)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        self.device_storages.add(out.untyped_storage().data_ptr())
        return out

    def device_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self.device_storages.add(out.untyped_storage().data_ptr())
        return out

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self.pinned_storages.add(out.untyped_storage().data_ptr())
        return out

    def unpin(self, group: PoolGroup) -> None:
        """The group's host pools are pageable from now on."""
        for spec in group:
            if spec.host.has_bytes:
                for p in range(len(spec.host.planes)):
                    self.pinned_storages.discard(spec.host.buffer(p).untyped_storage().data_ptr())

    # -- what a test's "forward pass" does ------------------------------------

    def launch(self, stream: FakeStream, fn: Callable[[], None], *, reads: Iterable[torch.Tensor] = (),
               writes: Iterable[torch.Tensor] = ()) -> None:
        """Enqueue ``fn`` as a kernel on ``stream`` that reads and writes these tensors."""
        self.enqueue(stream, Op("kernel", stream, [Operand(t) for t in reads], [Operand(t) for t in writes],
                                fn))


def owner_of(group: PoolGroup, ptr: int) -> tuple[str, int] | None:
    """(pool, pool layer) whose device tensor holds address ``ptr``."""
    for spec in group:
        if spec.device is None:
            continue
        for j in range(spec.device.num_layers):
            for p in range(len(spec.device.planes)):
                t = spec.device.tensor(j, p)
                start = t.data_ptr()
                if start <= ptr < start + t.numel() * t.element_size():
                    return spec.name, j
    return None


# -- the executor on the fake -------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_the_cuda_executor_moves_only_the_valid_rows(layout: str) -> None:
    """A backup with ``valid_rows=`` (issue 25) and its load on the fake device: the
    valid rows round-trip, the rest of the destination is left alone, and the
    executor's bytes are those rows' (as on the CPU, tests/test_valid_rows.py)."""
    group = hybrid_group(layout=layout)
    gpu = FakeGpu(group)
    ex = CudaExecutor(backend=gpu)
    valid = {"kv": 19, "c4": 3, "swa": 5}  # kv: 3 of page 3, c4: 1 of page 2, swa: page 2 and 3 empty
    async with TransferScheduler(group, executor=ex) as sched:
        src = pages(1, 3, 4, page_size=8)
        req = {"kv": src, "swa": src, "tok": src, "state": torch.tensor([2, 5])}
        b = await sched.backup(req, valid_rows=valid)
        await b
        want = {n: rows(group, n, i[: valid.get(n, i.numel())]) for n, i in b.device_indices.items() if n != "tok"}
        wipe(group)
        dst = pages(6, 0, 7, page_size=8)
        load = await sched.load(b.host_indices, {"kv": dst, "swa": dst, "tok": dst, "state": torch.tensor([9, 1])})
        await load
        for name, expected in want.items():
            idx = load.device_indices[name]
            assert_rows_equal(rows(group, name, idx[: valid.get(name, idx.numel())]), expected)
            assert all(bool((t == 0).all()) for t in rows(group, name, idx[valid.get(name, idx.numel()):]))
        whole = sum(i.numel() * group[n].slot_nbytes for n, i in b.device_indices.items() if n != "tok")
        cut = sum((i.numel() - valid.get(n, i.numel())) * group[n].slot_nbytes
                  for n, i in b.device_indices.items() if n != "tok")
        assert sched.statistics().backup.bytes == sched.statistics().load.bytes == whole - cut


async def test_a_closed_scheduler_ends_the_cuda_executors_threads_and_a_next_one_starts_them_again() -> None:
    """The enqueuing and waiting threads end with the scheduler (no thread of
    kvtier's outlives it; tests/test_worker_threads.py says why); the same
    executor then serves another scheduler, byte-exact."""
    group = hybrid_group(layout="page_first")
    gpu = FakeGpu(group)
    ex = CudaExecutor(backend=gpu)

    def cuda_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("kvtier-cuda-") and t.is_alive()}

    before = cuda_threads()
    for round_ in range(2):
        async with TransferScheduler(group, executor=ex) as sched:
            src = pages(1, 3, page_size=8)
            want = rows(group, "kv", src)
            b = await sched.backup({"kv": src})
            await b
            mine = cuda_threads() - before
            assert {t.name for t in mine} == {"kvtier-cuda-backup-enqueue", "kvtier-cuda-backup-wait"}
            wipe(group)
            await (await sched.load(b.host_indices, {"kv": src}))
            assert_rows_equal(rows(group, "kv", src), want)
            sched.free_host(b.host_indices)
        for t in mine:
            await anyio.to_thread.run_sync(t.join, 5.0)  # a thread left idle would wait 30 s
        assert not (cuda_threads() - before), f"round {round_}: threads left after the close"


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_round_trip_through_the_cuda_executor_is_byte_exact(layout: str) -> None:
    group = hybrid_group(layout=layout)
    gpu = FakeGpu(group)
    ex = CudaExecutor(backend=gpu)
    async with TransferScheduler(group, executor=ex) as sched:
        src = pages(1, 3, 4, page_size=8)  # a run and a lone page
        req = {"kv": src, "swa": src, "tok": src, "state": torch.tensor([2, 5])}
        b = await sched.backup(req)
        await b
        before = {n: rows(group, n, i) for n, i in b.device_indices.items() if n != "tok"}
        wipe(group)
        dst = pages(6, 0, 7, page_size=8)
        # The handle's host indices as they are, derived sidecars included.
        load = await sched.load(b.host_indices, {"kv": dst, "swa": dst, "tok": dst, "state": torch.tensor([9, 1])})
        await load
        assert set(load.device_indices) == set(b.device_indices)
        for name, expected in before.items():
            assert_rows_equal(rows(group, name, load.device_indices[name]), expected)
    assert threading.get_ident() not in gpu.threads  # never enqueued on the loop


async def test_one_event_per_layer_recorded_after_every_pools_copies_of_that_layer() -> None:
    group = hybrid_group()
    gpu = FakeGpu(group)
    ex = CudaExecutor(backend=gpu)
    async with TransferScheduler(group, executor=ex) as sched:
        src = pages(0, 2, page_size=8)
        b = await sched.backup({"kv": src, "swa": src, "tok": src, "state": torch.tensor([0])})
        await b
        gpu.log.clear()
        load = await sched.load({n: b.host_indices[n] for n in ("kv", "swa", "tok", "state")},
                                {"kv": src, "swa": src, "tok": src, "state": torch.tensor([3])})
        await load
    records = [i for i, e in enumerate(gpu.log) if e[0] == "record"]
    assert len(records) == group.num_layers
    start = 0
    for layer, end in enumerate(records):
        touched = {owner_of(group, e[2]) for e in gpu.log[start:end] if e[0] in ("copy", "scatter")}
        touched.discard(None)
        expected = {
            (spec.name, spec.device.pool_layer(layer))
            for spec in group
            if spec.device is not None and spec.device.pool_layer(layer) is not None
        }
        assert touched == expected, f"layer {layer}"
        start = end + 1


async def test_layers_are_signalled_only_as_their_events_complete_and_wait_layer_waits_on_device() -> None:
    group = full_attention_group(layers=3)
    gpu = FakeGpu(group)
    ex = CudaExecutor(backend=gpu)
    async with TransferScheduler(group, executor=ex) as sched, gpu.completing():
        b = await sched.backup({"kv": pages(0, page_size=4)})
        await b
        gpu.auto = False
        load = await sched.load(b.host_indices, {"kv": pages(5, page_size=4)})
        load_stream = ex.stream(load.direction)
        await wait_until(lambda: len(load_stream.events) == 3)
        compute = FakeStream(gpu, "forward")
        await load.wait_layer(1, compute)
        assert ("wait", "forward", load_stream.events[1]) in gpu.log
        ready: list[int] = []

        async def watch(i: int) -> None:
            await load.layer_ready(i)
            ready.append(i)

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(watch, i)
            await anyio.sleep(0.01)
            assert ready == []
            load_stream.complete(1)
            await wait_until(lambda: ready == [0])
            await anyio.sleep(0.01)
            assert ready == [0] and not load.done()
            load_stream.complete()
        await load
        assert sorted(ready) == [0, 1, 2]
        await load.wait_layer(2)  # done: returns at once, no device wait needed


async def test_batches_complete_in_fifo_order_per_stream() -> None:
    group = full_attention_group()
    gpu = FakeGpu(group)
    ex = CudaExecutor(backend=gpu, max_in_flight=2)
    async with TransferScheduler(group, executor=ex) as sched, gpu.completing():
        b = await sched.backup({"kv": pages(0, 1, page_size=4)})
        await b
        gpu.auto = False
        first = await sched.load({"kv": b.host_indices["kv"][:4]}, {"kv": pages(4, page_size=4)})
        stream = ex.stream(first.direction)
        await wait_until(lambda: len(stream.events) == 4)
        second = await sched.load({"kv": b.host_indices["kv"][4:]}, {"kv": pages(5, page_size=4)})
        await wait_until(lambda: len(stream.events) == 8)  # both enqueued: two in flight
        stream.complete(4)
        await first
        assert not second.done()
        stream.complete()
        await second


async def test_backups_and_loads_use_separate_streams() -> None:
    group = full_attention_group()
    gpu = FakeGpu(group)
    ex = CudaExecutor(backend=gpu)
    async with TransferScheduler(group, executor=ex) as sched:
        b = await sched.backup({"kv": pages(0, page_size=4)})
        await b
        load = await sched.load(b.host_indices, {"kv": pages(3, page_size=4)})
        await load
    copy_streams = {e[1] for e in gpu.log if e[0] in ("copy", "scatter", "gather")}
    assert copy_streams == {"copy0", "copy1"}
    assert ex.stream(load.direction) is not ex.stream(b.direction)


async def test_a_batch_hops_threads_once_out_and_once_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # DESIGN: hop threads once per batch. Out: one hand-off from the loop's
    # thread to the direction's enqueuing thread (which passes the batch on to
    # its waiting thread itself); back: one call_soon_threadsafe. No anyio
    # to_thread round trip (a loop turn and a limiter each, twice per batch before).
    group = full_attention_group()
    gpu = FakeGpu(group)
    ex = CudaExecutor(backend=gpu)
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    counts = {"out": 0, "passed_on": 0, "back": 0, "to_thread": 0}
    submit, threadsafe, to_thread = WorkerThread.submit, loop.call_soon_threadsafe, anyio.to_thread.run_sync

    def counting_submit(self: WorkerThread, *args: Any) -> None:
        counts["out" if threading.get_ident() == loop_thread else "passed_on"] += 1
        submit(self, *args)

    def counting_threadsafe(*args: Any, **kwargs: Any) -> Any:
        counts["back"] += 1
        return threadsafe(*args, **kwargs)

    async def counting_to_thread(*args: Any, **kwargs: Any) -> Any:
        counts["to_thread"] += 1
        return await to_thread(*args, **kwargs)

    async with TransferScheduler(group, executor=ex) as sched:
        warm = await sched.backup({"kv": pages(0, page_size=4)})
        await warm
        before = ex.statistics().batches
        monkeypatch.setattr(WorkerThread, "submit", counting_submit)
        monkeypatch.setattr(loop, "call_soon_threadsafe", counting_threadsafe)
        monkeypatch.setattr(anyio.to_thread, "run_sync", counting_to_thread)
        try:
            for i in range(1, 4):
                b = await sched.backup({"kv": pages(i, page_size=4)})
                await b
                load = await sched.load(b.host_indices, {"kv": pages(i + 4, page_size=4)})
                await load
        finally:
            monkeypatch.undo()
        batches = ex.statistics().batches - before
    assert batches == 6
    assert counts == {"out": batches, "passed_on": batches, "back": batches, "to_thread": 0}
    assert_rows_equal(rows(group, "kv", pages(5, 6, 7, page_size=4)), rows(group, "kv", pages(1, 2, 3, page_size=4)))


async def test_a_load_is_enqueued_and_completes_while_a_backup_is_still_being_enqueued() -> None:
    group = full_attention_group()
    gate = threading.Event()
    gate.set()

    class SlowBackups(FakeGpu):
        def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
            if self.current_stream() is ex.stream(Direction.BACKUP):
                gate.wait(10)  # holds the backup's enqueuing thread while the gate is shut
            super().copy(dst, src)

    gpu = SlowBackups(group)
    ex = CudaExecutor(backend=gpu)
    try:
        async with TransferScheduler(group, executor=ex) as sched:
            first = await sched.backup({"kv": pages(0, page_size=4)})
            await first
            gate.clear()
            burst = await sched.backup({"kv": pages(1, 2, page_size=4)})
            load = await sched.load(first.host_indices, {"kv": pages(7, page_size=4)})
            with anyio.fail_after(5):
                await load
            assert not burst.done()
            gate.set()
            await burst
            assert_rows_equal(rows(group, "kv", pages(7, page_size=4)), rows(group, "kv", pages(0, page_size=4)))
    finally:
        gate.set()


async def test_fences_are_waited_for_on_the_copy_stream_before_any_copy() -> None:
    group = full_attention_group()
    gpu = FakeGpu(group)
    ex = CudaExecutor(backend=gpu)
    forward = FakeStream(gpu, "forward")
    async with TransferScheduler(group, executor=ex) as sched:
        b = await sched.backup({"kv": pages(0, page_size=4)}, after=forward)
        await b
        fence = forward.events[0]  # captured at submission: an event on the forward stream
        log = gpu.log
        wait_at = log.index(("wait", ex.stream(b.direction).name, fence))
        first_copy = next(i for i, e in enumerate(log) if e[0] in ("copy", "gather"))
        assert wait_at < first_copy
        explicit = FakeEvent(gpu)
        explicit.record(forward)
        load = await sched.load(b.host_indices, {"kv": pages(2, page_size=4)}, after=explicit)
        await load
        assert ("wait", ex.stream(load.direction).name, explicit) in gpu.log
        with pytest.raises(TypeError, match="after= takes a stream or an event"):
            await sched.load(b.host_indices, {"kv": pages(2, page_size=4)}, after=3)


async def test_a_failing_copy_fails_the_batch_frees_slots_and_leaves_streams_usable() -> None:
    group = full_attention_group()
    gpu = FakeGpu(group, fail_on_copy=3)
    ex = CudaExecutor(backend=gpu)
    async with TransferScheduler(group, executor=ex) as sched:
        before = used(group)
        bad = await sched.backup({"kv": pages(0, page_size=4)})
        with pytest.raises(TransferFailed) as info:
            await bad
        assert "fake copy failure" in str(info.value.__cause__)
        assert used(group) == before
        # What was enqueued before the failure was waited for: a tail event.
        stream = ex.stream(bad.direction)
        assert stream.events and all(e.done for e in stream.events)
        ok = await sched.backup({"kv": pages(1, page_size=4)})
        await ok
        host, dev = group["kv"].host, group["kv"].device
        for j in range(dev.num_layers):
            assert torch.equal(host.layer_view(j, 0)[ok.host_indices["kv"]], dev.tensor(j, 0)[pages(1, page_size=4)])
    s = ex.statistics()
    assert (s.batches, s.failed_batches, s.device_seconds) == (2, 1, None)


async def test_execute_does_not_return_before_the_copies_complete_even_when_cancelled() -> None:
    group = full_attention_group()
    gpu = FakeGpu(group, auto=False)
    ex = CudaExecutor(backend=gpu)
    async with TransferScheduler(group, executor=ex) as sched, gpu.completing():
        h = await sched.backup({"kv": pages(0, page_size=4)})
        stream = ex.stream(h.direction)
        await wait_until(lambda: len(stream.events) == group.num_layers)
        assert h.cancel()
        await anyio.sleep(0.01)
        assert used(group)["kv"] == 4  # the copy may still write these host rows
        stream.complete()
        with pytest.raises(Exception, match="cancelled"):
            await h
        assert used(group)["kv"] == 0


async def test_a_page_first_backup_places_each_layer_as_its_event_completes() -> None:
    # Lone pages of a page_first host go through staging and a host scatter;
    # the scatter of layer 0 must not wait for the copies of later layers.
    group = full_attention_group(layout="page_first")
    gpu = FakeGpu(group, auto=False)
    ex = CudaExecutor(backend=gpu)
    src = pages(2, 5, page_size=4)
    async with TransferScheduler(group, executor=ex) as sched, gpu.completing():
        b = await sched.backup({"kv": src})
        stream = ex.stream(b.direction)
        await wait_until(lambda: len(stream.events) == group.num_layers)
        host, dev = group["kv"].host, group["kv"].device
        dst = b.host_indices["kv"]

        def placed(j: int) -> bool:
            return torch.equal(host.layer_view(j, 0)[dst], dev.tensor(j, 0)[src])

        assert not placed(0)  # nothing landed yet
        stream.complete(1)
        await wait_until(lambda: placed(0))
        assert not any(placed(j) for j in range(1, group.num_layers)) and not b.done()
        stream.complete()
        await b
        assert all(placed(j) for j in range(group.num_layers))


async def test_timing_reports_device_time_per_batch() -> None:
    group = full_attention_group()
    gpu = FakeGpu(group)
    ex = CudaExecutor(backend=gpu, timing=True)
    async with TransferScheduler(group, executor=ex) as sched:
        b = await sched.backup({"kv": pages(0, 3, page_size=4)})
        await b
    s = ex.statistics()
    assert (s.batches, s.failed_batches, s.nbytes) == (1, 0, 8 * group["kv"].slot_nbytes)
    assert s.device_seconds is not None and s.device_seconds > 0
    assert s.max_device_seconds == s.device_seconds and s.enqueue_seconds > 0


def test_max_in_flight_must_be_a_positive_int() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"max_in_flight must be an int >= 1; got {bad!r}"):
            CudaExecutor(backend=FakeGpu(), max_in_flight=bad)  # type: ignore[arg-type]


# -- what the fake catches: each a planted bug --------------------------------


class SignalsBeforeTheEvent(CudaExecutor):
    """Planted bug: reports every layer before waiting for any event."""

    def _finish(self, job: Any, progress: LayerProgress) -> None:
        for layer in range(len(job.events)):
            progress.layer_done(layer)
        super()._finish(job, progress)


async def test_fake_catches_a_read_before_the_layer_event_completes() -> None:
    for executor in (CudaExecutor, SignalsBeforeTheEvent):
        group = full_attention_group()
        gpu = FakeGpu(group)
        ex = executor(backend=gpu)
        src, dst = pages(1, page_size=4), pages(9, page_size=4)
        async with TransferScheduler(group, executor=ex) as sched, gpu.completing():
            b = await sched.backup({"kv": src})
            await b
            expected = rows(group, "kv", src)
            wipe(group)
            gpu.auto = False
            load = await sched.load(b.host_indices, {"kv": dst})
            stream = ex.stream(load.direction)
            if executor is CudaExecutor:
                await wait_until(lambda: len(stream.events) == group.num_layers)
                with anyio.move_on_after(0.05) as waited:
                    await load.layer_ready(0)
                assert waited.cancelled_caught  # not reported before its event completed
                stream.complete(1)
            await load.layer_ready(0)
            got = group["kv"].device.tensor(0, 0)[dst]
            if executor is CudaExecutor:
                assert torch.equal(got, expected[0])
            else:  # reported before its event: the rows have not landed
                assert not torch.equal(got, expected[0]) and not got.any()
            stream.complete()
            await load
            assert_rows_equal(rows(group, "kv", dst), expected)


class DropsBuffersEarly(CudaExecutor):
    """Planted bug: lets go of staging and index tensors once enqueued."""

    def _enqueue(self, batch: Batch, stream: Any) -> Any:
        job = super()._enqueue(batch, stream)
        job.keep_alive.clear()
        return job


async def test_fake_catches_staging_freed_before_its_copy_ran() -> None:
    group = full_attention_group()
    gpu = FakeGpu(group)
    async with TransferScheduler(group, executor=DropsBuffersEarly(backend=gpu)) as sched:
        b = await sched.backup({"kv": pages(1, page_size=4)})  # lone page: gathered into staging
        with pytest.raises(TransferFailed) as info:
            await b
        assert isinstance(info.value.__cause__, FreedTooEarly)
    group = full_attention_group()
    gpu = FakeGpu(group)
    async with TransferScheduler(group, executor=CudaExecutor(backend=gpu)) as sched:
        b = await sched.backup({"kv": pages(1, page_size=4)})
        await b  # the same batch, its buffers held: accepted
        host, dev = group["kv"].host, group["kv"].device
        assert torch.equal(host.layer_view(0, 0)[b.host_indices["kv"]], dev.tensor(0, 0)[pages(1, page_size=4)])


async def test_fake_catches_a_pageable_host_source() -> None:
    # A host pool that is not page-locked, copied directly (runs, min_run_bytes=1).
    group = full_attention_group()
    gpu = FakeGpu(group)
    config = SchedulerConfig(min_run_bytes=1)
    async with TransferScheduler(group, executor=CudaExecutor(backend=gpu), config=config) as sched:
        b = await sched.backup({"kv": pages(1, 2, page_size=4)})
        await b
        gpu.unpin(group)
        with pytest.raises(TransferFailed) as info:
            await (await sched.load(b.host_indices, {"kv": pages(5, 6, page_size=4)}))
        assert isinstance(info.value.__cause__, PageableCopy)
        assert "pageable host source" in str(info.value.__cause__)

    # Staging in pageable memory: a page_first load's host-to-device copy.
    class PageableStaging(FakeGpu):
        pageable = False

        def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype) if self.pageable else super().pinned_empty(shape, dtype)

    group = full_attention_group(layout="page_first")
    gpu = PageableStaging(group)
    async with TransferScheduler(group, executor=CudaExecutor(backend=gpu)) as sched:
        b = await sched.backup({"kv": pages(1, page_size=4)})
        await b
        load = await sched.load(b.host_indices, {"kv": pages(3, page_size=4)})
        await load  # through pinned staging: accepted
        assert_rows_equal(rows(group, "kv", pages(3, page_size=4)), rows(group, "kv", pages(1, page_size=4)))
        gpu.pageable = True
        with pytest.raises(TransferFailed) as info:
            await (await sched.load(b.host_indices, {"kv": pages(4, page_size=4)}))
        assert "pageable host source" in str(info.value.__cause__)


def test_fake_refuses_a_strided_host_side() -> None:
    gpu = FakeGpu()
    host = gpu.pinned_empty((4, 3), torch.float32)
    dev = gpu.device_empty((3, 4), torch.float32)
    with pytest.raises(PageableCopy, match="strided host source"):
        gpu.copy(dev, host.t())


class IgnoresFences(CudaExecutor):
    """Planted bug: never makes the copy stream wait for ``after=``."""

    @staticmethod
    def _wait_for_fences(batch: Batch, stream: Any) -> None:
        pass


async def test_fake_catches_a_missing_stream_wait() -> None:
    src = pages(3, page_size=4)
    for executor, after, caught in ((CudaExecutor, True, False), (CudaExecutor, False, True),
                                    (IgnoresFences, True, True)):
        group = full_attention_group()
        gpu = FakeGpu(group)
        forward = FakeStream(gpu, "forward")
        dev = group["kv"].device
        layer0 = dev.tensor(0, 0)
        # The "forward pass" writes the rows about to be backed up, on its own stream.
        gpu.launch(forward, lambda: layer0.index_fill_(0, src, 7.0), writes=[layer0])
        async with TransferScheduler(group, executor=executor(backend=gpu)) as sched, gpu.completing():
            b = await sched.backup({"kv": src}, after=forward if after else None)
            if caught:
                with pytest.raises(TransferFailed) as info:
                    await b
                assert isinstance(info.value.__cause__, MissingStreamWait)
            else:
                await b
                assert bool((group["kv"].host.layer_view(0, 0)[b.host_indices["kv"]] == 7.0).all())


async def test_fake_catches_a_compute_stream_reading_a_layer_without_waiting_for_it() -> None:
    group = full_attention_group(layers=2)
    gpu = FakeGpu(group)
    ex = CudaExecutor(backend=gpu)
    dst = pages(6, page_size=4)
    async with TransferScheduler(group, executor=ex) as sched, gpu.completing():
        b = await sched.backup({"kv": pages(0, page_size=4)})
        await b
        gpu.auto = False
        load = await sched.load(b.host_indices, {"kv": dst})
        stream = ex.stream(load.direction)
        await wait_until(lambda: len(stream.events) == 2)
        compute = FakeStream(gpu, "forward")
        layer1 = group["kv"].device.tensor(1, 0)
        with pytest.raises(MissingStreamWait, match="a stream wait is missing"):
            gpu.launch(compute, lambda: None, reads=[layer1[24:28]])
        await load.wait_layer(1, compute)
        gpu.launch(compute, lambda: None, reads=[layer1[24:28]])  # ordered now: accepted
        stream.complete()
        await load


# -- pinned host memory, chunked ------------------------------------------------


class FakeCudart:
    """`PinningRuntime` that records calls; refuses the ``fail_at``-th register."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: dict[int, int] = {}
        self.calls = 0
        self.cleared: list[int] = []

    def register(self, ptr: int, size: int) -> int:
        self.calls += 1
        if self.calls == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered[ptr] = size
        return 0

    def unregister(self, ptr: int) -> int:
        return 0 if self.registered.pop(ptr, None) is not None else 1

    def clear_error(self, code: int) -> None:
        self.cleared.append(code)


def test_register_pinned_covers_a_buffer_larger_than_a_chunk_in_chunks() -> None:
    t = torch.empty(10_000, dtype=torch.uint8)
    rt = FakeCudart()
    release = register_pinned(t, chunk_bytes=4096, runtime=rt)
    base = t.data_ptr()
    assert rt.registered == {base: 4096, base + 4096: 4096, base + 8192: 10_000 - 8192}
    release()
    assert rt.registered == {} and rt.cleared == []


def test_a_refused_chunk_unregisters_the_others_and_clears_the_cuda_error() -> None:
    t = torch.empty(10_000, dtype=torch.uint8)
    rt = FakeCudart(fail_at=2)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 4096 bytes at offset 4096 of a 10000-byte "
                                           "host buffer failed with CUDA error 2"):
        register_pinned(t, chunk_bytes=4096, runtime=rt)
    assert rt.registered == {} and rt.cleared == [2]


class _CudartBinding:
    """What ``torch.cuda.cudart()`` binds, as a fake: the calls made, the codes to return."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.calls: list[tuple[object, ...]] = []

    def cudaHostRegister(self, ptr: object, size: object, flags: object) -> object:  # noqa: N802 - CUDA's name
        self.calls.append(("register", ptr, size, flags))
        return _Code(self.code)

    def cudaHostUnregister(self, ptr: object) -> object:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return _Code(self.code)

    def cudaError(self, code: object) -> object:  # noqa: N802
        self.calls.append(("error", code))
        return ("cudaError", code)

    def cudaGetErrorString(self, error: object) -> str:  # noqa: N802
        self.calls.append(("string", error))
        return f"invalid argument ({error[1]})"  # type: ignore[index]


class _Code:
    """An enum-like return code (cudart returns `cudaError` values, which `int()` reads)."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __int__(self) -> int:
        return self.code


def _fake_cuda(
    monkeypatch: pytest.MonkeyPatch, binding: _CudartBinding, launch_error: str | None
) -> list[tuple[tuple[int, ...], str | None]]:
    """Route `TorchPinningRuntime`'s torch calls to ``binding``; a tiny CUDA kernel launch
    raises ``launch_error`` (the last error it reads) or succeeds. Returns the launches."""
    import types

    import kvtier.pools.host as host_module

    launches: list[tuple[tuple[int, ...], str | None]] = []

    def ones(*shape: int, device: str | None = None) -> torch.Tensor:
        launches.append((shape, device))
        if launch_error is not None:
            raise RuntimeError(launch_error)
        return torch.ones(*shape)

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(cudart=lambda: binding), ones=ones)
    monkeypatch.setattr(host_module, "torch", fake)
    return launches


def test_torch_pinning_runtime_calls_cuda_with_the_pointer_size_and_default_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtier.pools.host import TorchPinningRuntime

    binding = _CudartBinding(code=0)
    _fake_cuda(monkeypatch, binding, None)
    rt = TorchPinningRuntime()
    assert rt.register(4096, 8192) == 0 and type(rt.register(4096, 8192)) is int
    assert rt.unregister(4096) == 0
    assert binding.calls == [("register", 4096, 8192, 0), ("register", 4096, 8192, 0), ("unregister", 4096)]
    binding.code = 11  # CUDA's code comes back as the int it is
    assert rt.register(1, 2) == 11 and rt.unregister(1) == 11


def test_torch_pinning_runtime_clears_exactly_the_failed_calls_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed registration leaves its code as the thread's last CUDA error: a
    tiny kernel launch reads (and resets) it, and raises it, which is swallowed;
    a launch that raises another error is not."""
    from kvtier.pools.host import TorchPinningRuntime

    binding = _CudartBinding()
    launches = _fake_cuda(monkeypatch, binding, "CUDA error: invalid argument (1)")
    TorchPinningRuntime().clear_error(1)
    assert launches == [((1,), "cuda")]  # one element: the smallest kernel there is
    assert binding.calls == [("error", 1), ("string", ("cudaError", 1))]
    launches = _fake_cuda(monkeypatch, binding, "CUDA error: out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        TorchPinningRuntime().clear_error(1)
    launches = _fake_cuda(monkeypatch, binding, None)  # nothing left to read: nothing raised
    TorchPinningRuntime().clear_error(1)
    assert launches == [((1,), "cuda")]


def test_host_pool_pinning_is_all_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = FakeCudart(fail_at=3)
    import kvtier.pools.host as host_module

    monkeypatch.setattr(host_module, "TorchPinningRuntime", lambda: rt)
    monkeypatch.setattr(host_module, "PIN_CHUNK_BYTES", 1 << 12)
    # Two planes of 16 KiB, four chunks each: the third chunk of plane 0 is refused.
    with pytest.raises(RuntimeError, match="at offset 8192 of a 16384-byte host buffer failed with CUDA error 2"):
        HostPool("kv", planes=[PlaneSpec((64,), torch.uint8)] * 2, num_layers=2, slots=128, page_size=4,
                 pin_memory=True)
    assert rt.registered == {} and rt.cleared == [2]
    rt.fail_at = 7  # the third chunk of plane 1: plane 0, registered whole, is let go too
    rt.calls = 0
    with pytest.raises(RuntimeError, match="at offset 8192 of a 16384-byte"):
        HostPool("kv", planes=[PlaneSpec((64,), torch.uint8)] * 2, num_layers=2, slots=128, page_size=4,
                 pin_memory=True)
    assert rt.registered == {} and rt.cleared == [2, 2]
    rt.fail_at = None
    pool = HostPool("kv", planes=[PlaneSpec((64,), torch.uint8)] * 2, num_layers=2, slots=128, page_size=4,
                    pin_memory=True)
    assert len(rt.registered) == 8
    pool.close()
    assert rt.registered == {}


def test_an_unregistration_cuda_refuses_is_cleared_and_the_others_still_go() -> None:
    # cudaHostUnregister of one chunk fails (the engine unregistered it itself): the
    # other chunks are still unregistered and the thread's CUDA error is cleared
    t = torch.empty(10_000, dtype=torch.uint8)
    rt = FakeCudart()
    release = register_pinned(t, chunk_bytes=4096, runtime=rt)
    rt.registered.pop(t.data_ptr() + 4096)  # gone behind kvtier's back
    release()
    assert rt.registered == {} and rt.cleared == [1]
    clean = register_pinned(torch.empty(100, dtype=torch.uint8), chunk_bytes=4096, runtime=rt)
    clean()
    assert rt.cleared == [1]  # nothing failed: nothing to clear


def test_host_pool_pin_chunk_bytes_are_checked_and_used(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.pools.host as host_module

    rt = FakeCudart()
    monkeypatch.setattr(host_module, "TorchPinningRuntime", lambda: rt)
    for bad in (0, -4096, 1.5):
        with pytest.raises(ConfigurationError) as refused:
            HostPool("kv", planes=[PlaneSpec((64,), torch.uint8)], num_layers=2, slots=128, page_size=4,
                     pin_memory=True, pin_chunk_bytes=bad)  # type: ignore[arg-type]
        assert str(refused.value) == f"pool 'kv' pin chunk bytes must be a positive int; got {bad!r}"
    pool = HostPool("kv", planes=[PlaneSpec((64,), torch.uint8)], num_layers=2, slots=128, page_size=4,
                    pin_memory=True, pin_chunk_bytes=8192)
    assert sorted(rt.registered.values()) == [8192, 8192]  # 16 KiB in chunks of the size given
    pool.close()
    assert rt.registered == {}


# -- the direct path, registration chunks, aligned buffers ------------------------


class ShortRuns(CudaExecutor):
    """Planted bug: every direct run copy leaves out its last row."""

    def _route(self, c: Any, job: Any) -> Any:
        route = super()._route(c, job)
        return type(route)(tuple((s, d, n - 1) for s, d, n in route.runs), route.src, route.dst, route.dev_src,
                           route.dev_dst)


class IgnoresRegistrationCuts(CudaExecutor):
    """Planted bug: copies runs whole, across registration boundaries."""

    def _load_rows(self, route: Any, host: torch.Tensor, dev: torch.Tensor, job: Any,
                   cuts: tuple[int, ...] = ()) -> None:
        super()._load_rows(route, host, dev, job, ())

    def _backup_rows(self, route: Any, host: torch.Tensor, dev: torch.Tensor, job: Any, scatters: Any,
                     cuts: tuple[int, ...] = ()) -> None:
        super()._backup_rows(route, host, dev, job, scatters, ())


ROW = (8, 128)  # 4 KiB a row of one plane in float32: a page of 8 rows is a 32 KiB run, over min_run_bytes


def wide_group(layout: str, layers: int, *, pin: bool = False, slots: int = 64) -> PoolGroup:
    gen = torch.Generator().manual_seed(layers)
    tensors = [[torch.randn((slots, *ROW), generator=gen) for _ in range(2)] for _ in range(layers)]
    group = PoolGroup()
    group.add_pool("kv", device=DevicePool(tensors), page_size=8, host_slots=2 * slots, layout=layout,
                   pin_memory=pin or None)
    return group


def copies_by_kind(gpu: FakeGpu, stream: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in gpu.log:
        if e[0] in ("copy", "gather", "scatter") and e[1] == stream:
            out[e[0]] = out.get(e[0], 0) + 1
    return out


@pytest.mark.parametrize("layout, layers", [("layer_first", 3), ("page_first", 1)])
async def test_long_runs_take_the_direct_path_both_ways_byte_exact(layout: str, layers: int) -> None:
    # A run of two pages and a lone page (64 and 32 KiB per layer and plane):
    # one direct copy each, per layer and plane, nothing staged; the same
    # test fails an executor that copies a run one row short.
    src, dst = pages(1, 2, 5, page_size=8), pages(6, 0, 3, page_size=8)
    for executor in (CudaExecutor, ShortRuns):
        group = wide_group(layout, layers)
        gpu = FakeGpu(group)
        ex = executor(backend=gpu)
        async with TransferScheduler(group, executor=ex) as sched:
            before = rows(group, "kv", src)
            b = await sched.backup({"kv": src})
            await b
            host = group["kv"].host
            stored = [host.layer_view(j, p)[b.host_indices["kv"]] for j in range(layers) for p in range(2)]
            wipe(group)
            load = await sched.load(b.host_indices, {"kv": dst})
            await load
            after = rows(group, "kv", dst)
        backup_stream, load_stream = ex.stream(Direction.BACKUP).name, ex.stream(Direction.LOAD).name
        # Host rows 0..23 are consecutive: the load's three device pages are three runs.
        assert copies_by_kind(gpu, backup_stream) == {"copy": 2 * layers * 2}
        assert copies_by_kind(gpu, load_stream) == {"copy": 3 * layers * 2}
        exact = [torch.equal(a, e) for a, e in zip(stored, before)] + [torch.equal(a, e) for a, e in zip(after, before)]
        if executor is CudaExecutor:
            assert all(exact)
        else:
            assert not any(exact)  # every layer and plane of both copies is a row short


@pytest.mark.parametrize("layout, layers", [("layer_first", 2), ("page_first", 1)])
async def test_a_run_across_a_registration_chunk_is_split_there(monkeypatch: pytest.MonkeyPatch, layout: str,
                                                                 layers: int) -> None:
    import kvtier.pools.host as host_module

    rt = FakeCudart()
    monkeypatch.setattr(host_module, "TorchPinningRuntime", lambda: rt)
    monkeypatch.setattr(host_module, "PIN_CHUNK_BYTES", 64 << 10)  # 16 rows of 4 KiB a registration
    src, dst = pages(0, 1, 2, 3, page_size=8), pages(4, 5, 6, 7, page_size=8)  # 32 rows: across row 16
    for executor in (CudaExecutor, IgnoresRegistrationCuts):
        group = wide_group(layout, layers, pin=True)
        host = group["kv"].host
        assert host.registration_cuts(0, 0)[:2] == (16, 32)
        gpu = FakeGpu(group, registrations=rt.registered)
        ex = executor(backend=gpu)
        async with TransferScheduler(group, executor=ex) as sched:
            before = rows(group, "kv", src)
            b = await sched.backup({"kv": src})
            if executor is IgnoresRegistrationCuts:
                with pytest.raises(TransferFailed) as info:
                    await b
                assert isinstance(info.value.__cause__, PageableCopy)
                assert "spans two registrations" in str(info.value.__cause__)
                group.close()
                continue
            await b
            assert torch.equal(b.host_indices["kv"], torch.arange(32))  # host rows 0..31: across the cut
            wipe(group)
            load = await sched.load(b.host_indices, {"kv": dst})
            await load
            assert_rows_equal(rows(group, "kv", dst), before)
            # Split at row 16 both ways: two copies per layer and plane instead of one.
            assert copies_by_kind(gpu, ex.stream(Direction.BACKUP).name) == {"copy": 2 * layers * 2}
            assert copies_by_kind(gpu, ex.stream(Direction.LOAD).name) == {"copy": 2 * layers * 2}
            # A run that starts on a cut (host row 32) and crosses two (48, 64): three copies.
            gpu.log.clear()
            src2 = pages(0, 1, 2, 3, 4, 5, page_size=8)
            before2 = rows(group, "kv", src2)
            b2 = await sched.backup({"kv": src2})
            await b2
            assert torch.equal(b2.host_indices["kv"], torch.arange(32, 80))
            assert copies_by_kind(gpu, ex.stream(Direction.BACKUP).name) == {"copy": 3 * layers * 2}
            wipe(group)
            await (await sched.load(b2.host_indices, {"kv": src2}))
            assert_rows_equal(rows(group, "kv", src2), before2)
        group.close()
        assert rt.registered == {}


def shared_pages(registrations: dict[int, int], page: int) -> list[tuple[int, int]]:
    """Pairs of registrations (by address) that touch a common host page."""
    spans = sorted((base // page, (base + size - 1) // page, base) for base, size in registrations.items())
    return [(a[2], b[2]) for a, b in zip(spans, spans[1:]) if b[0] <= a[1]]


def test_host_buffers_and_their_registrations_start_on_a_page_and_share_none(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.pools.host as host_module

    page = host_module.HOST_PAGE_BYTES
    rt = FakeCudart()
    monkeypatch.setattr(host_module, "TorchPinningRuntime", lambda: rt)
    monkeypatch.setattr(host_module, "PIN_CHUNK_BYTES", 5 * page + 100)  # not a whole number of pages or rows
    planes = [PlaneSpec((25,), torch.float32), PlaneSpec((3,), torch.bfloat16)]  # 100- and 6-byte rows

    def pools() -> list[HostPool]:
        return [HostPool(f"p{i}", planes=planes, num_layers=3, slots=1600, page_size=16, pin_memory=True)
                for i in range(3)]

    made = pools()
    assert all(pool.buffer(p).data_ptr() % page == 0 for pool in made for p in range(len(planes)))
    assert len(rt.registered) == 3 * (5 + 3) and all(base % page == 0 for base in rt.registered)
    assert shared_pages(rt.registered, page) == []
    # Chunks of lcm(row, page) bytes (over the limit, one such unit): 1024 rows
    # of 100 bytes, 2048 of 6; the cuts are where they end, in each layer's rows.
    assert [made[0].registration_cuts(j, 0) for j in range(3)] == [(1024,), (448, 1472), (896,)]
    assert [made[0].registration_cuts(j, 1) for j in range(3)] == [(), (448,), (896,)]
    for pool in made:
        pool.close()
    assert rt.registered == {} and made[0].registration_cuts(1, 0) == ()

    # Planted bug: buffers carved one after another out of one allocation, as
    # torch's allocator may place them: their registrations then share pages.
    block = torch.empty(4 << 20, dtype=torch.uint8)
    used = [0]

    def packed(shape: Any, dtype: torch.dtype, align: int = page) -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        t = block[used[0] : used[0] + n].view(dtype).view(tuple(shape))
        used[0] += -(-n // 64) * 64
        return t

    monkeypatch.setattr(host_module, "aligned_empty", packed)
    made = pools()
    assert shared_pages(rt.registered, page) != []
    for pool in made:
        pool.close()


def test_registration_chunks_are_whole_pages_and_whole_rows() -> None:
    from kvtier.pools.host import aligned_empty, registration_chunk_bytes

    assert registration_chunk_bytes(4096, 1 << 30, 4096) == 1 << 30
    assert registration_chunk_bytes(100, 1 << 20, 4096) == 10 * 102400  # lcm(100, 4096) = 102400
    assert registration_chunk_bytes(3 << 20, 1 << 20, 4096) == 3 << 20  # one row over the limit: one unit
    t = aligned_empty((3, 5), torch.bfloat16, align=1 << 16)
    assert t.data_ptr() % (1 << 16) == 0 and t.shape == (3, 5) and t.is_contiguous()
    with pytest.raises(ValueError, match="align must be a power of two; got 3000"):
        aligned_empty((4,), torch.uint8, align=3000)
