"""Cancel and close against a store that stopped answering.

A real redis-server is paused (SIGSTOP: the kernel keeps its socket, nobody
answers) while a `write_storage` or a `prefetch` waits on it. A `cancel()`,
a `stop()` and a cancelling close (``on_close="cancel"``) end the operation
at once with its documented outcome (`OperationCancelled`, a result,
`SchedulerClosed`), give back every host page it held, and the store's late
answer, once the server resumes, changes nothing. "At once" is asserted as
the behaviour it is: the call returns long before the store's own timeout
(a bound of a quarter of it, far above the expected milliseconds).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.to_thread
import pytest
from conftest import needs_redis_server, used
from test_storage_scheduler import (
    ANCHORS,
    HookedStore,
    assert_rows_equal,
    backup,
    backup_and_store,
    baseline,
    engine,
    load_rows,
    prefix_keys,
    prefix_rows,
    req_of,
)

from kvtier import OperationCancelled, SchedulerClosed, SchedulerConfig, TransferScheduler
from kvtier.storage import RedisStore
from kvtier.testing.redis_server import LocalRedisServer

pytestmark = needs_redis_server

STORE_TIMEOUT_S = 20.0
PROMPT_S = STORE_TIMEOUT_S / 4  # far above the expected; far below the store's timeout


@pytest.fixture
def own_redis(fresh_server: Callable[..., LocalRedisServer]) -> LocalRedisServer:
    return fresh_server()


def paused_on(server: LocalRedisServer, op: str, call: int = 1) -> tuple[HookedStore, anyio.Event]:
    """A RedisStore on ``server`` whose ``op`` call number ``call`` pauses the server first."""
    paused = anyio.Event()

    async def pause(n: int, _keys: list[bytes]) -> None:
        if n == call:
            await anyio.to_thread.run_sync(server.pause)
            paused.set()

    store = HookedStore(RedisStore(server.url, timeout_s=STORE_TIMEOUT_S), **{op: pause})  # type: ignore[arg-type]
    return store, paused


@pytest.mark.parametrize("op", ["exists", "put"])
async def test_cancel_of_a_write_waiting_on_a_stopped_redis_ends_it_at_once(
    own_redis: LocalRedisServer, op: str
) -> None:
    group = engine(1)
    store, paused = paused_on(own_redis, op)
    try:
        async with TransferScheduler(group, storage=store) as sched:
            base = baseline(group)
            b = await backup(sched, req_of(2, pools=("kv",)))
            h = await sched.write_storage(b.host_indices, prefix_keys(group, 2, pools=("kv",)))
            await paused.wait()
            await anyio.sleep(0.05)  # the call is sent; its answer cannot come
            with anyio.fail_after(PROMPT_S):
                assert h.cancel() is True
                with pytest.raises(OperationCancelled):
                    await h
            sched.free_host(b.host_indices)
            assert used(group) == base
            await anyio.to_thread.run_sync(own_redis.resume)  # the late answer arrives now
            await anyio.sleep(0.1)
            assert used(group) == base
            # The store works again for the next write, byte-exact.
            again = await backup_and_store(sched, group, 2, pools=("kv",))
            assert again.result.pages_written["kv"] + again.result.pages_present["kv"] == 2
            sched.free_host(again.host)
    finally:
        await anyio.to_thread.run_sync(own_redis.resume)
        await store.aclose()


async def stored_prefix(server: LocalRedisServer, npages: int) -> tuple[dict[str, list[bytes]], dict]:  # type: ignore[type-arg]
    """Engine 1 stores ``npages`` kv pages; their keys and device rows."""
    a = engine(1)
    writer = RedisStore(server.url, timeout_s=STORE_TIMEOUT_S)
    try:
        async with TransferScheduler(a, storage=writer) as sched:
            stored = await backup_and_store(sched, a, npages, pools=("kv",))
            return stored.keys, prefix_rows(a, stored.device, {"kv": npages})
    finally:
        await writer.aclose()


@pytest.mark.parametrize("op", ["exists", "get"])
async def test_cancel_of_a_prefetch_waiting_on_a_stopped_redis_ends_it_at_once(
    own_redis: LocalRedisServer, op: str
) -> None:
    keys, want = await stored_prefix(own_redis, 3)
    group = engine(2)
    store, paused = paused_on(own_redis, op)
    try:
        async with TransferScheduler(group, storage=store) as sched:
            base = baseline(group)
            h = await sched.prefetch(keys)
            await paused.wait()
            await anyio.sleep(0.05)
            with anyio.fail_after(PROMPT_S):
                assert h.cancel() is True
                with pytest.raises(OperationCancelled):
                    await h
            assert used(group) == base
            await anyio.to_thread.run_sync(own_redis.resume)  # the late answer arrives now
            await anyio.sleep(0.1)
            assert used(group) == base
            again = await (await sched.prefetch(keys, policy="wait_complete"))
            assert again.complete
            assert_rows_equal(await load_rows(sched, group, again), want)
            sched.free_host(again.host_indices)
    finally:
        await anyio.to_thread.run_sync(own_redis.resume)
        await store.aclose()


async def test_a_cancelling_close_ends_storage_operations_waiting_on_a_stopped_redis(
    own_redis: LocalRedisServer,
) -> None:
    """on_close="cancel" while a write waits on a put and a prefetch on a read
    of a paused server: the block is left at once, both end with
    SchedulerClosed (not the store's timeout) and every host page comes back."""
    keys, _ = await stored_prefix(own_redis, 2)
    group = engine(2)
    store, paused = paused_on(own_redis, "get")
    config = SchedulerConfig(on_close="cancel")
    try:
        with anyio.fail_after(PROMPT_S):
            async with TransferScheduler(group, storage=store, config=config) as sched:
                base = baseline(group)
                b = await backup(sched, req_of(2, pools=("kv",)))
                pre = await sched.prefetch(keys)
                await paused.wait()
                write = await sched.write_storage(b.host_indices, prefix_keys(group, 2, pools=("kv",), prompt=7))
                await anyio.sleep(0.05)  # the write's lookup is sent too; no answer comes
                assert not write.done() and not pre.done()
        for h in (write, pre):
            with pytest.raises(SchedulerClosed):
                await h
        sched.free_host(b.host_indices)  # a closed scheduler still takes back host pages
        assert used(group) == base
    finally:
        await anyio.to_thread.run_sync(own_redis.resume)
        await store.aclose()
