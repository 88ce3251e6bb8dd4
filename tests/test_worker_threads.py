"""kvtier's own threads (`WorkerThread`, the executors' copy threads): what
they hold once a call is answered, and that a closed scheduler leaves none
running.

Why it matters: a thread of kvtier's still inside torch when the interpreter
exits aborts the process ("terminate called without an active exception":
torch releases the GIL around its work, and a daemon thread that takes it back
during finalization is ended from inside a C++ destructor). One example of the
docs aborted that way once at exit in `make test`, after its scheduler had
closed: the copy thread outlived the scheduler by 30 s and freed the batch's
tensors after it had answered. So a call's arguments are dropped in the thread
before the caller resumes, and a scheduler ends its executor's threads when it
closes.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
from conftest import assert_rows_equal, pages, rows, wipe

from kvtier import TransferScheduler
from kvtier.testing import full_attention_group
from kvtier.transfers import CpuExecutor
from kvtier.transfers.eventloop import WorkerThread


class Payload:
    """Something a call takes, whose end a weak reference shows."""


def _copy_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "kvtier-cpu-copies"}


async def _ended(threads: set[threading.Thread]) -> bool:
    """Whether every one of ``threads`` ends within 5 s (joined off the loop):
    a stopped thread returns at once, one left idle waits 30 s for work."""
    for t in threads:
        await anyio.to_thread.run_sync(t.join, 5.0)
    return not any(t.is_alive() for t in threads)


async def test_a_calls_arguments_are_dropped_in_the_thread_before_its_caller_resumes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The thread is held right after it has handed the answer to the loop, so
    # the caller resumes while the thread can do nothing more: whatever it
    # still refers to then, it would drop later, racing the caller.
    loop = asyncio.get_running_loop()
    handed_over = loop.call_soon_threadsafe
    release = threading.Event()

    def answer_then_hold(*args: Any, **kwargs: Any) -> Any:
        handle = handed_over(*args, **kwargs)
        if threading.current_thread().name == "kvtier-test-held":
            release.wait(5.0)
        return handle

    monkeypatch.setattr(loop, "call_soon_threadsafe", answer_then_hold)
    worker = WorkerThread("kvtier-test-held")
    try:
        payload = Payload()
        ref = weakref.ref(payload)
        assert await worker.run(lambda p: type(p).__name__, payload) == "Payload"
        del payload
        assert ref() is None, "the worker thread still held the call's argument after answering"
    finally:
        release.set()
    await worker.stop()


async def test_a_failed_calls_arguments_go_with_its_error_not_with_the_thread() -> None:
    worker = WorkerThread("kvtier-test-worker")

    def fail(p: Payload) -> None:
        raise LookupError("no")

    payload = Payload()
    ref = weakref.ref(payload)
    with pytest.raises(LookupError, match="no") as info:
        await worker.run(fail, payload)
    del payload, info
    await anyio.sleep(0)  # the loop step that resumed this task holds the future until it ends
    gc.collect()  # the error's traceback and the call's future refer to each other
    assert ref() is None
    await worker.stop()


async def test_stop_ends_the_thread_after_the_calls_queued_before_it_and_a_later_call_starts_another() -> None:
    worker = WorkerThread("kvtier-test-stop", idle_s=60.0)
    await worker.stop()  # no thread yet: nothing to do
    ran: list[int] = []
    gate = threading.Event()

    def slow(i: int) -> int:
        gate.wait(5.0)
        ran.append(i)
        return i

    threads: list[threading.Thread] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run, slow, 1)
        await anyio.sleep(0.01)
        threads = [t for t in threading.enumerate() if t.name == "kvtier-test-stop" and t.is_alive()]
        stopping = anyio.Event()

        async def stop() -> None:
            await worker.stop()
            stopping.set()

        tg.start_soon(stop)
        await anyio.sleep(0.05)
        assert not stopping.is_set(), "stop returned while a call queued before it still ran"
        gate.set()
    assert ran == [1]
    assert len(threads) == 1 and await _ended(set(threads))
    assert await worker.run(lambda: threading.current_thread().name) == "kvtier-test-stop"
    later = [t for t in threading.enumerate() if t.name == "kvtier-test-stop" and t.is_alive()]
    assert later and later[0] is not threads[0]
    await worker.stop()
    assert await _ended(set(later))


async def test_a_closed_scheduler_leaves_no_copy_thread_running() -> None:
    before = _copy_threads()
    group = full_attention_group(page_size=4)
    async with TransferScheduler(group) as sched:
        h = await sched.backup({"kv": pages(0, page_size=4)})
        await h
        mine = _copy_threads() - before
        assert mine, "the backup ran in no copy thread"
    assert await _ended(mine)


async def test_a_scheduler_left_by_an_error_leaves_no_copy_thread_running() -> None:
    before = _copy_threads()
    group = full_attention_group(page_size=4)
    with pytest.raises(KeyError):
        async with TransferScheduler(group) as sched:
            await (await sched.backup({"kv": pages(0, page_size=4)}))
            mine = _copy_threads() - before
            raise KeyError("the engine's")
    assert mine and await _ended(mine)


async def test_an_executor_shared_by_schedulers_one_after_another_copies_for_each() -> None:
    executor = CpuExecutor()
    for n in range(2):  # the second scheduler's batches start the thread the first one's close ended
        group = full_attention_group(page_size=4)
        device = group["kv"].device
        assert device is not None
        gen = torch.Generator().manual_seed(n)
        for j in range(device.num_layers):
            for p in range(len(device.planes)):
                t = device.tensor(j, p)
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        src = pages(0, 1, page_size=4)
        want = rows(group, "kv", src)
        async with TransferScheduler(group, executor) as sched:
            h = await sched.backup({"kv": src})
            await h
            wipe(group)
            await (await sched.load(h.host_indices, {"kv": src}))
            assert_rows_equal(rows(group, "kv", src), want)
    assert executor.statistics().batches == 4
