"""CudaExecutor's ordering logic, driven on CPU through a fake device backend."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import pytest
import torch

from conftest import assert_rows_equal, pages, rows, used, wait_until, wipe
from kvtier import TransferFailed, TransferScheduler
from kvtier.testing import full_attention_group, hybrid_group
from kvtier.transfers.cuda import CudaExecutor


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.done = False
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.gpu.current
        self.stream = stream
        stream.events.append(self)
        self.gpu.log.append(("record", stream.name, self))
        if self.gpu.auto:
            self.done = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("the executor must never synchronize")


class FakeStream:
    def __init__(self, gpu: FakeGpu, name: str) -> None:
        self.gpu = gpu
        self.name = name
        self.events: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.gpu.log.append(("wait", self.name, event))

    def record_event(self) -> FakeEvent:
        ev = FakeEvent(self.gpu)
        ev.record(self)
        return ev

    def complete(self, n: int | None = None) -> None:
        """Complete this stream's next ``n`` (default: all) events, FIFO."""
        pending = [e for e in self.events if not e.done]
        for e in pending[: len(pending) if n is None else n]:
            e.done = True


class FakeGpu:
    """A DeviceBackend whose 'device' is the CPU: ops run at once, events
    complete when the test says (or at once with ``auto``)."""

    def __init__(self, *, auto: bool = True, fail_on_copy: int | None = None) -> None:
        self.auto = auto
        self.log: list[tuple[Any, ...]] = []
        self.streams: list[FakeStream] = []
        self.default = FakeStream(self, "compute")
        self.current = self.default
        self.threads: set[int] = set()
        self.copies = 0
        self.fail_on_copy = fail_on_copy

    @asynccontextmanager
    async def completing(self) -> AsyncIterator[None]:
        """On exit, complete every event and go on at once: a test that fails
        while events are pending fails at once instead of leaving the
        executor polling (it never returns before its copies complete)."""
        try:
            yield
        finally:
            self.auto = True
            for stream in (self.default, *self.streams):
                stream.complete()

    def new_stream(self) -> FakeStream:
        s = FakeStream(self, f"copy{len(self.streams)}")
        self.streams.append(s)
        return s

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    @contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        prev, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = prev

    def current_stream(self) -> FakeStream:
        return self.current

    def _op(self, kind: str, dst: torch.Tensor) -> None:
        self.threads.add(threading.get_ident())
        self.log.append((kind, self.current.name, dst.data_ptr(), dst.numel() * dst.element_size()))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies += 1
        if self.fail_on_copy is not None and self.copies == self.fail_on_copy:
            raise RuntimeError("fake copy failure")
        self._op("copy", dst)
        dst.copy_(src)

    def gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = src.index_select(0, index)
        self._op("gather", out)
        return out

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        self._op("scatter", dst)
        dst.index_copy_(0, index, src)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


def owner_of(group, ptr: int) -> tuple[str, int] | None:
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


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_round_trip_through_the_cuda_executor_is_byte_exact(layout: str) -> None:
    group = hybrid_group(layout=layout)
    gpu = FakeGpu()
    ex = CudaExecutor(backend=gpu, poll_interval_s=0)
    async with TransferScheduler(group, executor=ex) as sched:
        src = pages(1, 3, 4, page_size=8)  # a run and a lone page
        req = {"kv": src, "swa": src, "tok": src, "state": torch.tensor([2, 5])}
        b = await sched.backup(req)
        await b
        before = {n: rows(group, n, i) for n, i in b.device_indices.items() if n != "tok"}
        wipe(group)
        dst = pages(6, 0, 7, page_size=8)
        load = await sched.load(
            {n: b.host_indices[n] for n in req}, {"kv": dst, "swa": dst, "tok": dst, "state": torch.tensor([9, 1])}
        )
        await load
        for name, expected in before.items():
            assert_rows_equal(rows(group, name, load.device_indices[name]), expected)
    assert threading.get_ident() not in gpu.threads  # never enqueued on the loop


async def test_one_event_per_layer_recorded_after_every_pools_copies_of_that_layer() -> None:
    group = hybrid_group()
    gpu = FakeGpu()
    ex = CudaExecutor(backend=gpu, poll_interval_s=0)
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
    gpu = FakeGpu()
    ex = CudaExecutor(backend=gpu, poll_interval_s=0)
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
    gpu = FakeGpu()
    ex = CudaExecutor(backend=gpu, poll_interval_s=0, max_in_flight=2)
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
    gpu = FakeGpu()
    ex = CudaExecutor(backend=gpu, poll_interval_s=0)
    async with TransferScheduler(group, executor=ex) as sched:
        b = await sched.backup({"kv": pages(0, page_size=4)})
        await b
        load = await sched.load(b.host_indices, {"kv": pages(3, page_size=4)})
        await load
    copy_streams = {e[1] for e in gpu.log if e[0] in ("copy", "scatter", "gather")}
    assert copy_streams == {"copy0", "copy1"}
    assert ex.stream(load.direction) is not ex.stream(b.direction)


async def test_fences_are_waited_for_on_the_copy_stream_before_any_copy() -> None:
    group = full_attention_group()
    gpu = FakeGpu()
    ex = CudaExecutor(backend=gpu, poll_interval_s=0)
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
        load = await sched.load(b.host_indices, {"kv": pages(2, page_size=4)}, after=explicit)
        await load
        assert ("wait", ex.stream(load.direction).name, explicit) in gpu.log
        with pytest.raises(TypeError, match="after= takes a stream or an event"):
            await sched.load(b.host_indices, {"kv": pages(2, page_size=4)}, after=3)


async def test_a_failing_copy_fails_the_batch_frees_slots_and_leaves_streams_usable() -> None:
    group = full_attention_group()
    gpu = FakeGpu(fail_on_copy=3)
    ex = CudaExecutor(backend=gpu, poll_interval_s=0)
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


async def test_execute_does_not_return_before_the_copies_complete_even_when_cancelled() -> None:
    group = full_attention_group()
    gpu = FakeGpu(auto=False)
    ex = CudaExecutor(backend=gpu, poll_interval_s=0)
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
