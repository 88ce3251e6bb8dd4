"""What leaves ``async with TransferScheduler(...)``: the block's own exception
as itself (not an ExceptionGroup), for a user's error, a kvtier error and a
cancellation; the scheduler is closed and its pools exact afterwards."""

from __future__ import annotations

import anyio
import pytest
from conftest import pages, used

from kvtier import ConfigurationError, SchedulerClosed, TransferScheduler
from kvtier.bench.measures import NoCopyExecutor  # copies nothing: no worker thread holds a batch for a while
from kvtier.scheduler.taskgroup import task_group
from kvtier.testing import full_attention_group


class Mine(ValueError):
    pass


async def test_a_users_exception_leaves_the_block_as_itself_with_its_cause() -> None:
    group = full_attention_group(page_size=4)
    cause = KeyError("why")
    with pytest.raises(Mine) as info:
        async with TransferScheduler(group) as sched:
            h = await sched.backup({"kv": pages(0, page_size=4)})
            await h
            raise Mine("the user's own") from cause
    assert type(info.value) is Mine and info.value.__cause__ is cause
    assert str(info.value) == "the user's own"
    with pytest.raises(SchedulerClosed):
        await sched.backup({"kv": pages(1, page_size=4)})
    assert used(group) == {"kv": 4}  # the backup's pages stay the caller's


async def test_a_second_scheduler_over_the_same_group_raises_configuration_error_plainly() -> None:
    group = full_attention_group(page_size=4)
    with pytest.raises(ConfigurationError, match="this PoolGroup is in use by"):
        async with TransferScheduler(group):
            async with TransferScheduler(group):
                pass  # pragma: no cover - never entered
    async with TransferScheduler(group) as again:  # the group is free again
        await (await again.backup({"kv": pages(0, page_size=4)}))


async def test_a_cancelled_block_is_caught_by_its_cancel_scope_and_nothing_leaks() -> None:
    group = full_attention_group(page_size=4)
    with anyio.CancelScope() as scope:
        async with TransferScheduler(group) as sched:
            h = await sched.backup({"kv": pages(0, page_size=4)})
            await h
            scope.cancel()
            await anyio.sleep(3600)
    assert scope.cancelled_caught
    with anyio.move_on_after(0) as timeout:
        async with TransferScheduler(group):
            await anyio.sleep(3600)
    assert timeout.cancelled_caught
    assert used(group) == {"kv": 4}


async def test_a_failing_task_beside_the_blocks_error_keeps_the_group() -> None:
    async def fail(*, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await anyio.sleep(0)
        raise RuntimeError("the task's")

    with pytest.raises(ExceptionGroup) as info:
        async with task_group() as tg:
            await tg.start(fail)
            try:
                await anyio.sleep(3600)
            finally:
                raise Mine("the block's")
    assert sorted(type(e).__name__ for e in info.value.exceptions) == ["Mine", "RuntimeError"]
    with pytest.raises(ExceptionGroup) as only_task:
        async with task_group() as tg:
            await tg.start(fail)
            await anyio.sleep(3600)
    assert [str(e) for e in only_task.value.exceptions] == ["the task's"]


async def test_a_closed_scheduler_and_its_pools_go_with_their_last_reference() -> None:
    """No reference cycle outlives the block (a lane's last carrier refers back to
    the lane): dropped, the group and its tensors are freed at once, not at the next
    full collection, which in an engine with a frozen heap may be a long pause or never."""
    import gc
    import weakref


    group = full_attention_group(page_size=4)
    ref = weakref.ref(group)
    gc.disable()
    try:
        async with TransferScheduler(group, NoCopyExecutor()) as sched:
            for h in [await sched.backup({"kv": pages(i, page_size=4)}) for i in range(3)]:
                await h
            h = await sched.load(h.host_indices, {"kv": pages(5, page_size=4)})
            await h
            for h in await sched.backup_many([{"kv": pages(i, page_size=4)} for i in range(6, 9)]):
                await h
        del sched, h, group
        assert ref() is None
    finally:
        gc.enable()
