"""CpuExecutor: copies in a worker thread without leaving torch's thread count changed there."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import pytest
import torch

from kvtier.pools import PoolGroup, slots_of_pages
from kvtier.testing import full_attention_group
from kvtier.transfers import Batch, CacheOperation, CpuExecutor, Direction, LayerProgress, PoolTransfer

PAGE_SIZE = 4


def backup_batch(group: PoolGroup, fence: object | None = None) -> Batch:
    host = slots_of_pages([0, 1], PAGE_SIZE)
    device = slots_of_pages([3, 5], PAGE_SIZE)
    op = CacheOperation(1, Direction.BACKUP, (PoolTransfer("kv", host, device),), 0, 0, fence)
    return Batch(1, Direction.BACKUP, [op], group)


def count_in_a_fresh_thread() -> int:
    """torch's thread count in a thread that never ran torch before: the
    process-wide default that `torch.set_num_threads` also sets."""
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    t.start()
    t.join()
    return out[0]


def ident_and_count() -> tuple[int, int]:
    return threading.get_ident(), torch.get_num_threads()


class FailingFence:
    def synchronize(self) -> None:
        raise RuntimeError("the fence's stream failed")


async def test_cpu_executor_leaves_torch_thread_counts_as_they_were() -> None:
    main_before = torch.get_num_threads()
    _, worker_before = await anyio.to_thread.run_sync(ident_and_count)
    fresh_before = await anyio.to_thread.run_sync(count_in_a_fresh_thread)
    threads = 1 if worker_before != 1 else 2  # a count that differs from the worker's
    group = full_attention_group(page_size=PAGE_SIZE)
    batch = backup_batch(group)
    seen: list[tuple[int, int]] = []
    progress = LayerProgress(batch.num_layers, wake=lambda: seen.append(ident_and_count()))
    progress.watched = True  # so the executor's thread reports each layer to `wake`

    await CpuExecutor(torch_threads=threads).execute(batch, progress)

    assert progress.layers_done == batch.num_layers
    workers = {ident for ident, _ in seen}
    assert len(workers) == 1 and all(n == threads for _, n in seen)  # the copies ran at torch_threads
    assert threading.get_ident() not in workers  # off the loop's thread
    _, worker_after = await anyio.to_thread.run_sync(ident_and_count)
    assert worker_after == worker_before
    assert torch.get_num_threads() == main_before
    assert await anyio.to_thread.run_sync(count_in_a_fresh_thread) == fresh_before
    h = slots_of_pages([0, 1], PAGE_SIZE)
    d = slots_of_pages([3, 5], PAGE_SIZE)
    for j in range(group["kv"].host.num_layers):
        for p in range(2):
            assert torch.equal(group["kv"].host.layer_view(j, p)[h], group["kv"].device.tensor(j, p)[d])  # type: ignore[union-attr]


async def test_cpu_executor_restores_the_thread_count_when_a_batch_fails() -> None:
    _, worker_before = await anyio.to_thread.run_sync(ident_and_count)
    fresh_before = await anyio.to_thread.run_sync(count_in_a_fresh_thread)
    threads = 1 if worker_before != 1 else 2
    group = full_attention_group(page_size=PAGE_SIZE)
    batch = backup_batch(group, fence=FailingFence())
    executor = CpuExecutor(torch_threads=threads)
    with pytest.raises(RuntimeError, match="the fence's stream failed"):
        await executor.execute(batch, LayerProgress(batch.num_layers))
    assert executor.statistics().batches == 1
    _, worker_after = await anyio.to_thread.run_sync(ident_and_count)
    assert worker_after == worker_before
    assert await anyio.to_thread.run_sync(count_in_a_fresh_thread) == fresh_before


async def test_cpu_executor_runs_batches_on_one_thread_of_its_own_that_ends_when_idle() -> None:
    group = full_attention_group(page_size=PAGE_SIZE)
    executor = CpuExecutor()
    executor._worker._idle_s = 0.05  # what the test waits for; the default is seconds
    threads: list[str] = []
    for _ in range(3):
        batch = backup_batch(group)
        progress = LayerProgress(batch.num_layers, wake=lambda: threads.append(threading.current_thread().name))
        progress.watched = True
        await executor.execute(batch, progress)
    assert set(threads) == {"kvtier-cpu-copies"} and len(threads) == 3 * batch.num_layers
    worker = executor._worker._thread
    assert worker is not None and worker.is_alive()
    with anyio.fail_after(10):  # this executor's thread ends (other tests' executors may keep theirs a while)
        while worker.is_alive():
            await anyio.sleep(0.01)
    assert executor._worker._thread is None
    await executor.execute(backup_batch(group), LayerProgress(batch.num_layers))  # starts again
    assert executor.statistics().batches == 4


async def test_cpu_executor_finishes_the_copies_of_a_cancelled_caller_before_returning() -> None:
    group = full_attention_group(page_size=PAGE_SIZE)
    executor = CpuExecutor()
    started, release = threading.Event(), threading.Event()
    landed: list[int] = []

    def wake() -> None:
        started.set()
        release.wait(10)
        landed.append(1)

    batch = backup_batch(group)
    progress = LayerProgress(batch.num_layers, wake=wake)
    progress.watched = True
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(executor.execute, batch, progress)
            await anyio.to_thread.run_sync(started.wait, 10)
            scope.cancel()
            release.set()
    # The cancelled execute returned only after every layer was copied and reported.
    assert len(landed) == batch.num_layers and progress.layers_done == batch.num_layers


def test_cpu_executor_lives_in_transfers_cpu_and_is_exported_where_it_was() -> None:
    import kvtier
    import kvtier.transfers as transfers
    import kvtier.transfers.cpu as cpu
    import kvtier.transfers.executor as executor

    for name in ("CpuExecutor", "CpuExecutorStatistics", "run_batch_copies"):
        assert getattr(transfers, name) is getattr(cpu, name) and name in transfers.__all__
        assert not hasattr(executor, name)
    for name in ("Batch", "CopyExecutor", "LayerProgress", "capture_fence"):
        assert getattr(transfers, name) is getattr(executor, name) and name in transfers.__all__
    assert kvtier.CpuExecutor is cpu.CpuExecutor
    assert isinstance(cpu.CpuExecutor(), executor.CopyExecutor)


async def test_run_in_worker_runs_on_the_thread_that_copies_and_counts_no_batch() -> None:
    """The benchmark times its baselines through `run_in_worker`: they must
    run on the very thread kvtier's copies run on, and not count as batches."""
    group = full_attention_group(page_size=PAGE_SIZE)
    executor = CpuExecutor()
    copier: list[int] = []
    batch = backup_batch(group)
    progress = LayerProgress(batch.num_layers, wake=lambda: copier.append(threading.get_ident()))
    progress.watched = True
    await executor.execute(batch, progress)
    ident, _ = await executor.run_in_worker(ident_and_count)
    assert set(copier) == {ident} and ident != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        await executor.run_in_worker(lambda: 1 // 0)
    assert executor.statistics().batches == 1
