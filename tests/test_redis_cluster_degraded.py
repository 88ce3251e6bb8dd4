"""Redis Cluster with one master down (``cluster-require-full-coverage no``):
the other masters' pages are still served byte-exact, the dead master's are
misses, writes that touch it fail naming it, and the store says which node.

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

from kvtier.storage import PageBlobs, RedisStore, StorageError
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
        # A lookup of the dead master's pages alone has no live node to answer: an error naming it.
        with pytest.raises(StorageError, match=f"redis node {dead_name} failed exists \\(1 of 1 nodes"):
            await rs.exists([p.key for p, gone in zip(pages, on_dead) if gone])
        # Once the other masters flag it failed (the cluster stays ok without full coverage).
        await anyio.to_thread.run_sync(lambda: wait_for(lambda: cluster.failed_by_the_others(1), "fail flagged"))
        assert b"cluster_state:ok" in await anyio.to_thread.run_sync(cluster.nodes[0].command, "CLUSTER", "INFO")
        await reads_hold()


async def test_with_full_coverage_required_a_failed_master_fails_every_node_and_says_so(
    full_coverage_cluster: LocalRedisCluster,
) -> None:
    c = full_coverage_cluster
    pages = random_pages(12)
    async with RedisStore(c.url, cluster=True, prefix="full:", timeout_s=2.0) as rs:
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
