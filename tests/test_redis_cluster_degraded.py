"""Redis Cluster with one master down (``cluster-require-full-coverage no``):
the other masters' pages are still served byte-exact, the dead master's are
misses (also in a batch of its pages alone), writes that touch it fail naming
it, the store says which node, and through the scheduler a read that failed
is never a hit.

A cluster of three masters of its own (node timeout 500 ms, so the others
flag the dead one within a second or two); the seed node (``url``) stays up
and a non-seed master is killed, so an error that named the seed would be wrong.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import anyio.to_thread
import pytest
from conftest import NO_REDIS, needs_redis_server

redis_errors = pytest.importorskip("redis.exceptions")

from kvtier import TransferScheduler
from kvtier.storage import KeyNamespace, PageBlobs, RedisStore, StorageError, page_keys
from kvtier.testing import full_attention_group
from kvtier.testing.redis_server import LocalRedisCluster

pytestmark = needs_redis_server
POOLS = ["kv", "c4"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalRedisCluster]:
    if NO_REDIS is not None:
        pytest.skip(NO_REDIS)
    with LocalRedisCluster(tmp_path, masters=3, require_full_coverage=False, node_timeout_ms=500) as c:
        yield c


@pytest.fixture
def full_coverage_cluster(tmp_path: Path) -> Iterator[LocalRedisCluster]:
    if NO_REDIS is not None:
        pytest.skip(NO_REDIS)
    with LocalRedisCluster(tmp_path, masters=3, node_timeout_ms=500) as c:
        yield c


def random_pages(n: int) -> list[PageBlobs]:
    return [PageBlobs(secrets.token_bytes(32), {"kv": secrets.token_bytes(4096), "c4": secrets.token_bytes(512)})
            for _ in range(n)]


def wait_for(condition, what: str, limit_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit_s  # a bound on waiting, not a timing assertion
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {limit_s} s: {what}")
        time.sleep(0.05)


async def test_a_dead_master_costs_only_its_own_pages(cluster: LocalRedisCluster) -> None:
    pages = random_pages(24)
    dead = cluster.nodes[1]
    dead_name = f"127.0.0.1:{dead.port}"
    async with RedisStore(cluster.url, cluster=True, prefix="deg:", timeout_s=2.0) as rs:
        await rs.put(pages)
        node_of = [rs.client.get_node_from_key(rs._commit_key(p.key)).name for p in pages]
        on_dead = [name == dead_name for name in node_of]
        assert 0 < sum(on_dead) < len(pages), node_of  # the pages spread over the dead master and the others
        await anyio.to_thread.run_sync(dead.kill)
        want = [None if gone else p.blobs for p, gone in zip(pages, on_dead)]

        async def reads_hold() -> None:
            assert await rs.exists([p.key for p in pages]) == [not gone for gone in on_dead]
            assert await rs.get([p.key for p in pages], POOLS) == want  # the live masters' pages, byte-exact

        await reads_hold()  # at once, before the cluster noticed
        assert set(rs.node_errors) == {dead_name}
        # A write that touches the dead master fails naming it, not the seed; the
        # live masters' pages of the same batch are stored whole.
        more = random_pages(12)
        with pytest.raises(StorageError, match=f"redis node {dead_name} failed put") as info:
            await rs.put(more)
        assert f":{cluster.nodes[0].port}" not in str(info.value)
        more_on_dead = [rs.client.get_node_from_key(rs._commit_key(p.key)).name == dead_name for p in more]
        assert await rs.exists([p.key for p in more]) == [not gone for gone in more_on_dead]
        # A batch of the dead master's pages alone (a one-page prefetch) is misses
        # too, counted like the multi-node case: no error reaches the engine.
        only_dead = [p for p, gone in zip(pages, on_dead) if gone]
        before = rs.node_errors[dead_name]
        assert await rs.exists([only_dead[0].key]) == [False]
        assert await rs.get([only_dead[0].key], POOLS) == [None]
        assert await rs.exists([p.key for p in only_dead]) == [False] * len(only_dead)
        assert rs.node_errors[dead_name] == before + 3
        # Once the other masters flag it failed (the cluster stays ok without full coverage).
        await anyio.to_thread.run_sync(lambda: wait_for(lambda: cluster.failed_by_the_others(1), "fail flagged"))
        assert b"cluster_state:ok" in await anyio.to_thread.run_sync(cluster.nodes[0].command, "CLUSTER", "INFO")
        await reads_hold()


async def test_with_full_coverage_required_a_failed_master_fails_every_node_and_says_so(
    full_coverage_cluster: LocalRedisCluster,
) -> None:
    c = full_coverage_cluster
    async with RedisStore(c.url, cluster=True, prefix="full:", timeout_s=2.0) as rs:
        # Pages on every master, so every live master is one of the batch's nodes
        # (twelve random pages miss one master about once in 130 draws).
        pages = random_pages(12)
        while {rs.client.get_node_from_key(rs._commit_key(p.key)).port for p in pages} != {n.port for n in c.nodes}:
            pages = random_pages(12)
        await rs.put(pages)
        await anyio.to_thread.run_sync(c.nodes[2].kill)
        await anyio.to_thread.run_sync(lambda: wait_for(lambda: c.failed_by_the_others(2), "fail flagged"))
        live = c.nodes[:2]
        await anyio.to_thread.run_sync(lambda: wait_for(
            lambda: all(b"cluster_state:fail" in n.command("CLUSTER", "INFO") for n in live), "state fail on every node"
        ))
        # Every node of the batch failed (redis-py may have dropped the dead master's slots from its map by now).
        with pytest.raises(StorageError, match=r"failed get \((\d) of \1 nodes of the batch\)") as info:
            await rs.get([p.key for p in pages], POOLS)
        # The live masters answer CLUSTERDOWN (redis-py: ClusterDownError), the dead one nothing.
        assert all(f"127.0.0.1:{node.port}" in str(info.value) for node in live), info.value
        assert isinstance(info.value.__cause__, (redis_errors.ClusterDownError, redis_errors.ResponseError,
                                                 redis_errors.ConnectionError)), repr(info.value.__cause__)


class KillAfterLookup:
    """A RedisStore whose dead master is killed once ``exists`` has answered:
    the lookup found the page, the read that follows fails on that master."""

    def __init__(self, inner: RedisStore, kill) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.name, self.kill = inner, inner.name, kill
        self.armed = self.killed = False

    async def exists(self, keys):  # type: ignore[no-untyped-def]
        got = await self.inner.exists(keys)
        if self.armed and not self.killed:
            self.killed = True
            await anyio.to_thread.run_sync(self.kill)
        return got

    async def get(self, keys, pools):  # type: ignore[no-untyped-def]
        return await self.inner.get(keys, pools)

    async def put(self, pages):  # type: ignore[no-untyped-def]
        await self.inner.put(pages)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_through_the_scheduler_a_read_on_a_dead_master_is_a_miss_never_a_hit(
    cluster: LocalRedisCluster,
) -> None:
    """The lookup finds the page, then its master dies before the read: the
    prefetch succeeds with no page, counts a miss and no hit, and hands back
    no host slot (nothing un-read is marked done)."""
    ps = 4
    group = full_attention_group(page_size=ps)
    ns = KeyNamespace.for_pool(group, "kv", model="degraded")
    dead = cluster.nodes[1]
    dead_name = f"127.0.0.1:{dead.port}"
    async with RedisStore(cluster.url, cluster=True, prefix="sched:", timeout_s=2.0) as rs:
        rs_store = KillAfterLookup(rs, dead.kill)
        await rs.client.initialize()  # the slot map, to pick a key on the master that will die
        async with TransferScheduler(group, storage=rs_store) as sched:  # type: ignore[arg-type]
            # Write prompts until one's first page lives on the master that will die.
            for first in range(0, 4096, ps):
                keys = page_keys(ns, list(range(first, first + ps)))
                if rs.client.get_node_from_key(rs._commit_key(keys[0])).name == dead_name:
                    break
            else:
                raise AssertionError("no page key landed on the dead master")
            backup = await sched.backup({"kv": list(range(ps))})
            await backup
            await (await sched.write_storage(backup.host_indices, {"kv": keys}))
            sched.free_host(backup.host_indices)
            assert sched.statistics().pools["kv"].used_slots == 0

            rs_store.armed = True  # the next lookup finds the page, then its master dies
            fetch = await sched.prefetch({"kv": keys}, policy="wait_complete")
            got = await fetch
            assert rs_store.killed
            assert fetch.exception() is None
            assert got.pages.get("kv", 0) == 0 and got.host_indices == {}
            assert got.hit_pages.get("kv", 0) == 0  # the lookup saw it; cut where the read failed
            stats = sched.statistics()
            assert stats.storage is not None
            assert stats.storage.pages_hit == 0 and stats.storage.pages_missed == 1
            assert stats.prefetch.failed == 0 and stats.prefetch.completed == 1
            assert stats.pools["kv"].used_slots == 0  # the page taken for the read was given back
        assert rs.node_errors.get(dead_name, 0) >= 1
