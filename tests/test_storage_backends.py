"""FileStore and RedisStore: round trips, per-page results, no partial pages,
typed errors, and a Redis server killed mid-transfer.

Redis tests run against real ``redis-server`` processes that the fixtures start
on free loopback ports (`LocalRedisServer`); they skip only when the binary
(``apt-get install -y redis-server``) or redis-py (the ``redis`` extra) is missing.
"""

from __future__ import annotations

import importlib.util
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch
from conftest import assert_pages_equal, needs_redis_server, page_bytes, randomize_host

from kvtier.storage import (
    FileStore,
    KeyNamespace,
    PageBlobs,
    RedisStore,
    StorageBackend,
    StorageError,
    StorageTimeout,
    decode_page,
    encode_page,
    page_keys,
    page_members,
)
from kvtier.bench.redis import bench_storage
from kvtier.testing.redis_server import LocalRedisCluster, LocalRedisServer
from kvtier.testing import hybrid_group

try:
    import redis
    import redis.asyncio as aioredis
except ImportError:  # FileStore tests still run
    redis = None  # type: ignore[assignment]


# -- fixtures (the Redis servers come from conftest) ------------------------------------


@pytest.fixture(params=["file", pytest.param("redis", marks=needs_redis_server)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path | str, dict[str, str]]:
    """(kind, where, options) of a fresh store: a directory, or a Redis URL and a key prefix of its own."""
    if request.param == "file":
        return "file", tmp_path / "store", {}
    server: LocalRedisServer = request.getfixturevalue("redis_server")
    return "redis", server.url, {"prefix": f"t{secrets.token_hex(4)}:"}


@pytest.fixture
async def store(backend: tuple[str, Path | str, dict[str, str]]) -> AsyncIterator[StorageBackend]:
    kind, where, options = backend
    s = make_store(kind, where, **options)
    yield s
    await s.aclose()


def make_store(kind: str, where: Path | str, **kwargs: object) -> StorageBackend:
    """A second handle on the same store: another engine sharing it."""
    if kind == "file":
        return FileStore(where, **kwargs)  # type: ignore[arg-type]
    return RedisStore(str(where), **kwargs)  # type: ignore[arg-type]


# -- helpers --------------------------------------------------------------------


def raw_client(url: str) -> aioredis.Redis:
    """A plain redis-py client, for looking behind the store's back."""
    if importlib.util.find_spec("redis.driver_info") is None:
        return aioredis.Redis.from_url(url)
    # driver_info=None: no CLIENT SETINFO, so redis-py >= 7 does not read its
    # package metadata (file I/O) on the event loop for each connection.
    return aioredis.Redis.from_url(url, driver_info=None)




def random_pages(n: int, sizes: dict[str, int], seed: int = 0) -> list[PageBlobs]:
    gen = torch.Generator().manual_seed(seed)
    return [
        PageBlobs(
            secrets.token_bytes(32),
            {name: bytes(torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8).tolist()) for name, size in sizes.items()},
        )
        for _ in range(n)
    ]


POOLS = {"kv": 4096, "c4": 256}


# -- both backends ----------------------------------------------------------------


async def test_two_engines_share_pages_byte_exact_through_the_host_pools(store: StorageBackend) -> None:
    """Engine A encodes host pages of every anchor and puts them; engine B, with
    another layout's pools holding other bytes, gets and decodes them."""
    a, b = hybrid_group(layout="layer_first", seed=1), hybrid_group(layout="layer_first", seed=2)
    randomize_host(a, 10)
    randomize_host(b, 20)
    tokens = list(range(1000, 1000 + 5 * 8))
    plan = {"kv": [3, 4, 9], "swa": [0, 1, 2], "tok": [5, 6, 7]}
    for anchor, host_pages in plan.items():
        ns = KeyNamespace.for_pool(a, anchor, model="m")
        keys = page_keys(ns, tokens)[: len(host_pages)]
        puts = [PageBlobs(k, encode_page(a, anchor, p, key=k)) for k, p in zip(keys, host_pages)]
        await store.put(puts)
        assert await store.exists(keys) == [True] * len(keys)
        pools = list(page_members(a, anchor, 0))
        got = await store.get(keys, pools)
        for into, (blobs, src_page, key) in enumerate(zip(got, host_pages, keys)):
            assert blobs is not None
            decode_page(b, anchor, 10 + into, blobs, key=key)
            assert_pages_equal(page_bytes(a, anchor, src_page), page_bytes(b, anchor, 10 + into))


async def test_results_are_per_page_in_order(store: StorageBackend) -> None:
    pages = random_pages(4, POOLS)
    await store.put([pages[0], pages[2]])
    keys = [p.key for p in pages] + [pages[0].key]
    assert await store.exists(keys) == [True, False, True, False, True]
    got = await store.get(keys, ["kv", "c4"])
    assert [g is not None for g in got] == [True, False, True, False, True]
    for g, p in ((got[0], pages[0]), (got[2], pages[2]), (got[4], pages[0])):
        assert g == {name: bytes(data) for name, data in p.blobs.items()}
    # A subset of the pools is fine; a pool the page was not stored with is a miss.
    only_kv = await store.get([pages[0].key], ["kv"])
    assert only_kv == [{"kv": pages[0].blobs["kv"]}]
    assert await store.get([pages[0].key], ["kv", "swa"]) == [None]
    assert await store.exists([]) == []
    assert await store.get([], ["kv"]) == []
    await store.put([])


async def test_put_is_idempotent(store: StorageBackend) -> None:
    pages = random_pages(3, POOLS, seed=1)
    await store.put(pages)
    await store.put(pages)
    got = await store.get([p.key for p in pages], POOLS)
    assert got == [{n: bytes(d) for n, d in p.blobs.items()} for p in pages]


async def test_bad_arguments_are_refused_before_any_io(store: StorageBackend) -> None:
    with pytest.raises(ValueError, match="page keys are 1..256 bytes"):
        await store.exists([b""])
    with pytest.raises(ValueError, match="at least one pool name"):
        await store.get([b"k"], [])
    with pytest.raises(ValueError, match="has no blobs"):
        PageBlobs(b"k", {})


# -- no partial publication --------------------------------------------------------


async def test_a_failure_between_blobs_and_commit_publishes_nothing_of_that_page(
    backend: tuple[str, Path | str, dict[str, str]],
) -> None:
    kind, where, options = backend
    pages = random_pages(5, POOLS, seed=2)

    def fail_third(key: bytes) -> None:
        if key == pages[2].key:
            raise RuntimeError("injected: writer died before the commit")

    faulty = make_store(kind, where, before_commit=fail_third, **options)
    reader = make_store(kind, where, **options)  # another engine
    try:
        with pytest.raises(StorageError, match="stopped before the commit of page") as err:
            await faulty.put(pages)
        assert isinstance(err.value.__cause__, RuntimeError)
        # It names the store, the call and the page it stopped at.
        assert (err.value.backend, err.value.operation) == (faulty.name, "put"), (err.value.backend, err.value.operation)
        assert f"stopped before the commit of page {pages[2].key.hex()}: injected" in str(err.value)
        keys = [p.key for p in pages]
        assert await reader.exists(keys) == [True, True, False, False, False]
        got = await reader.get(keys, POOLS)
        assert [g is not None for g in got] == [True, True, False, False, False]
        # The failed page's blobs did land: only its commit is missing.
        assert await _raw_blob_present(kind, where, options, pages[2].key, "kv")
        # Writing it again publishes it whole.
        await reader.put(pages)
        assert await reader.get(keys, POOLS) == [{n: bytes(d) for n, d in p.blobs.items()} for p in pages]
    finally:
        await faulty.aclose()
        await reader.aclose()


async def _raw_blob_present(kind: str, where: Path | str, options: dict[str, str], key: bytes, pool: str) -> bool:
    if kind == "file":  # one file holds every pool's blob: its temporary file, never renamed into place
        page_dir = anyio.Path(where) / key.hex()[:2]
        return [p async for p in page_dir.glob(f".{key.hex()}.data.*.tmp")] != [] and not await (
            page_dir / f"{key.hex()}.data").exists()
    client = raw_client(str(where))
    try:
        return bool(await client.exists(f"{options['prefix']}{{{key.hex()}}}:b:{pool}"))
    finally:
        await client.aclose()


async def test_a_torn_page_reads_as_a_miss(backend: tuple[str, Path | str, dict[str, str]]) -> None:
    """A blob lost on its own (evicted, deleted, truncated) never yields a short page."""
    kind, where, options = backend
    pages = random_pages(3, POOLS, seed=3)
    async with make_store(kind, where, **options) as st:  # type: ignore[attr-defined]
        await st.put(pages)
        if kind == "file":
            data = anyio.Path(Path(where) / pages[0].key.hex()[:2] / f"{pages[0].key.hex()}.data")
            await data.unlink()  # as a cleanup of old files would
            data = anyio.Path(Path(where) / pages[1].key.hex()[:2] / f"{pages[1].key.hex()}.data")
            await data.write_bytes((await data.read_bytes())[:-1])  # truncated
        else:
            raw = raw_client(str(where))
            await raw.delete(f"{options['prefix']}{{{pages[0].key.hex()}}}:b:c4")  # as an eviction would
            await raw.set(f"{options['prefix']}{{{pages[1].key.hex()}}}:b:kv", b"short")
            await raw.aclose()
        # exists checks the blobs' lengths against the commit record too, not the record alone.
        assert await st.exists([p.key for p in pages]) == [False, False, True]
        assert [g is not None for g in await st.get([p.key for p in pages], POOLS)] == [False, False, True]


@needs_redis_server
async def test_a_cancelled_put_leaves_only_whole_pages(redis_server: LocalRedisServer) -> None:
    pages = random_pages(48, {"kv": 256 << 10, "c4": 16 << 10}, seed=4)
    async with RedisStore(redis_server.url, prefix="cancel:", max_pipeline_bytes=1 << 20) as rs:
        with anyio.move_on_after(0.05) as scope:
            await rs.put(pages)
        keys = [p.key for p in pages]
        present = await rs.exists(keys)
        got = await rs.get(keys, POOLS)
        for p, here, g in zip(pages, present, got):
            assert (g is not None) == here
            if here:
                assert g == {n: bytes(d) for n, d in p.blobs.items()}
        if not scope.cancelled_caught:
            assert all(present)  # a put that was not cancelled wrote every page
        # A cancel may land after the last pipeline was answered (a loaded machine): then every
        # page is there, and that is whole pages too; only torn or half-committed pages are wrong.


# -- FileStore specifics -------------------------------------------------------------


async def test_file_store_io_errors_are_storage_errors(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    fs = FileStore(blocker)
    await anyio.Path(blocker).write_bytes(b"")  # after the store was made: refused at the first put
    with pytest.raises(StorageError, match=f"file store '{blocker}' could not write pages: ") as err:
        await fs.put(random_pages(1, POOLS))
    assert isinstance(err.value.__cause__, OSError)
    await fs.aclose()
    with pytest.raises(StorageError, match="closed"):
        await fs.exists([b"k"])


async def test_file_store_leaves_no_temporary_files(tmp_path: Path) -> None:
    fs = FileStore(tmp_path, fsync=True)
    await fs.put(random_pages(3, POOLS, seed=5))
    names = [p.name async for p in anyio.Path(tmp_path).rglob("*") if await p.is_file()]
    assert len(names) == 3  # one file per page
    assert sorted(n.rsplit(".", 1)[1] for n in names) == ["data"] * 3


# -- Redis specifics -----------------------------------------------------------------


@needs_redis_server
async def test_a_silent_redis_server_raises_storage_timeout(fresh_server: Callable[..., LocalRedisServer]) -> None:
    server = await anyio.to_thread.run_sync(fresh_server)
    pages = random_pages(2, POOLS, seed=6)
    async with RedisStore(server.url, timeout_s=0.3) as rs:
        await rs.put(pages[:1])
        server.pause()  # SIGSTOP: the kernel keeps the socket, nobody answers
        try:
            for call in (lambda: rs.exists([pages[0].key]), lambda: rs.get([pages[0].key], POOLS), lambda: rs.put(pages[1:])):
                with anyio.fail_after(3):
                    with pytest.raises(StorageTimeout, match="did not answer .* within 0.3 s") as err:
                        await call()
                assert err.value.timeout_s == 0.3
        finally:
            server.resume()
        # The same store recovers once the server answers again.
        assert await rs.exists([pages[0].key]) == [True]


@needs_redis_server
async def test_killing_redis_mid_put_fails_typed_and_publishes_no_partial_page(
    fresh_server: Callable[..., LocalRedisServer],
) -> None:
    """A persistent server (AOF, fsync always: what was applied before the kill
    is replayed after it, in order) is SIGKILLed while a large pipelined put
    runs, once some pages are committed. The put fails with StorageError; the
    next call too (between batches). After a restart on the same directory,
    every page whose commit survived is whole and byte-exact, and the rest are
    invisible (exists False, get None), even though blobs of some landed."""
    server: LocalRedisServer = await anyio.to_thread.run_sync(lambda: fresh_server(persistent=True))
    pages = random_pages(160, {"kv": 192 << 10, "c4": 24 << 10}, seed=7)
    keys = [p.key for p in pages]
    outcome: list[StorageError] = []
    async with RedisStore(server.url, timeout_s=5.0, prefix="kill:", max_pipeline_bytes=8 << 20) as rs:
        watcher = raw_client(server.url)

        async def put() -> None:
            try:
                await rs.put(pages)
            except StorageError as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(put)
            # Kill once the first page is committed and the last one is not.
            with anyio.fail_after(10):
                while not await watcher.exists(f"kill:{{{keys[0].hex()}}}:c"):
                    await anyio.sleep(0.001)
            assert not await watcher.exists(f"kill:{{{keys[-1].hex()}}}:c"), "put finished before the kill"
            await anyio.to_thread.run_sync(server.kill)
        await watcher.aclose()
        assert len(outcome) == 1, "the put did not fail"
        assert not isinstance(outcome[0], StorageTimeout)
        assert isinstance(outcome[0].__cause__, redis.exceptions.ConnectionError)
        with pytest.raises(StorageError, match="failed exists"):
            await rs.exists(keys[:1])  # between batches: refused, typed

        await anyio.to_thread.run_sync(server.start)  # same port, same AOF
        present = await rs.exists(keys)
        got = await rs.get(keys, POOLS)
        raw = raw_client(server.url)
        orphan_blobs = sum([await raw.exists(f"kill:{{{k.hex()}}}:b:kv") for k, here in zip(keys, present) if not here])
        await raw.aclose()
    committed = sum(present)
    assert 1 <= committed < len(pages)
    for p, here, g in zip(pages, present, got):
        if here:
            assert g == {n: bytes(d) for n, d in p.blobs.items()}
        else:
            assert g is None
    # Recorded for the report; not asserted since the kill may fall between pages.
    print(f"kill test: {committed} of {len(pages)} pages committed, {orphan_blobs} uncommitted pages had blobs")


@needs_redis_server
async def test_redis_errors_are_typed(redis_server: LocalRedisServer) -> None:
    dead = f"redis://127.0.0.1:{_closed_port()}/0"
    async with RedisStore(dead, timeout_s=1.0) as rs:
        with pytest.raises(StorageError, match="failed exists: ConnectionError") as err:
            await rs.exists([b"k"])
        assert not isinstance(err.value, StorageTimeout)
    # A commit record that is not ours is a miss for its page, not an error
    # (tests/test_storage_checksums.py covers every backend).
    async with RedisStore(redis_server.url, prefix="bad:") as rs:
        raw = raw_client(redis_server.url)
        await raw.set(f"bad:{{{b'k'.hex()}}}:c", b"not json")
        await raw.aclose()
        assert await rs.get([b"k"], ["kv"]) == [None]
        assert await rs.exists([b"k"]) == [False]
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RedisStore(redis_server.url, timeout_s=0)
    with pytest.raises(ValueError, match="must not contain braces"):
        RedisStore(redis_server.url, prefix="{x}")


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@needs_redis_server
async def test_a_callers_client_and_redis_cluster_work_through_the_same_store(
    redis_server: LocalRedisServer, fresh_server: Callable[..., LocalRedisServer]
) -> None:
    pages = random_pages(6, POOLS, seed=8)
    expect = [{n: bytes(d) for n, d in p.blobs.items()} for p in pages]
    client = raw_client(redis_server.url)
    async with RedisStore(client, prefix="own:") as rs:
        await rs.put(pages)
        assert await rs.get([p.key for p in pages], POOLS) == expect
    assert await client.ping()  # the store did not close a client it does not own
    await client.aclose()

    cluster = await anyio.to_thread.run_sync(lambda: fresh_server(cluster=True))
    async with RedisStore(cluster.url, cluster=True) as rs:
        await rs.put(pages)
        assert await rs.exists([p.key for p in pages]) == [True] * 6
        assert await rs.get([p.key for p in pages], POOLS) == expect
    # A page's keys share a hash slot, so its blobs and commit live on one node.
    raw = raw_client(cluster.url)
    slots = {await raw.execute_command(  # type: ignore[no-untyped-call]
        "CLUSTER", "KEYSLOT", f"kvtier:{{{pages[0].key.hex()}}}:{s}") for s in ("c", "b:kv", "b:c4")}
    await raw.aclose()
    assert len(slots) == 1


@needs_redis_server
async def test_a_three_master_redis_cluster_spreads_pages_over_its_nodes_byte_exact(
    redis_cluster: LocalRedisCluster,
) -> None:
    pages = random_pages(24, POOLS, seed=11)
    expect = [{n: bytes(d) for n, d in p.blobs.items()} for p in pages]
    missing = secrets.token_bytes(32)
    async with RedisStore(redis_cluster.url, cluster=True, prefix="spread:") as rs:
        await rs.put(pages)
        assert await rs.exists([p.key for p in pages] + [missing]) == [True] * 24 + [False]
        assert await rs.get([p.key for p in pages], POOLS) == expect
        assert await rs.get([missing, pages[0].key], POOLS) == [None, expect[0]]
    # Each page lives whole on one node (its keys share a hash tag), and the
    # 24 pages spread over the three masters.
    per_node = []
    for node in redis_cluster.nodes:
        raw = raw_client(node.url)
        per_node.append(len([k async for k in raw.scan_iter(match="spread:*")]))
        await raw.aclose()
    assert sum(per_node) == 24 * (1 + len(POOLS)) and sum(1 for n in per_node if n) >= 2, per_node
    assert all(n % (1 + len(POOLS)) == 0 for n in per_node), per_node


def test_local_redis_server_reports_a_missing_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_REDIS_SERVER", str(tmp_path / "no-such-redis-server"))
    with pytest.raises(FileNotFoundError, match="apt-get install redis-server"):
        LocalRedisServer(tmp_path).start()


_WRITER = """
import random, sys
import anyio
from kvtier.storage import FileStore, PageBlobs

rng = random.Random(int(sys.argv[2]))
pages = [PageBlobs(rng.randbytes(32), {"kv": rng.randbytes(192 << 10), "c4": rng.randbytes(24 << 10)}) for _ in range(int(sys.argv[3]))]
print("ready", flush=True)
anyio.run(FileStore(sys.argv[1], fsync=True).put, pages)
"""


def test_killing_a_file_store_writer_mid_put_publishes_no_partial_page(tmp_path: Path) -> None:
    """A writer process is SIGKILLed during a put, once some pages are
    committed: every page whose file is in place is whole and byte-exact,
    the rest are invisible, and no temporary file is mistaken for a page."""
    import random
    import subprocess
    import sys
    import time

    seed, n = 11, 96
    rng = random.Random(seed)
    pages = [PageBlobs(rng.randbytes(32), {"kv": rng.randbytes(192 << 10), "c4": rng.randbytes(24 << 10)}) for _ in range(n)]
    commit = [tmp_path / p.key.hex()[:2] / f"{p.key.hex()}.data" for p in pages]  # renamed into place: committed
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(seed), str(n)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 20
        while not commit[2].exists():
            assert proc.poll() is None, "the writer exited early"
            assert time.monotonic() < deadline, "the writer committed nothing"
            time.sleep(0.001)
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not commit[-1].exists(), "the put finished before the kill"

    async def check() -> tuple[list[bool], list[dict[str, bytes] | None]]:
        fs = FileStore(tmp_path)
        keys = [p.key for p in pages]
        return await fs.exists(keys), await fs.get(keys, POOLS)

    present, got = anyio.run(check)
    assert 3 <= sum(present) < n
    for p, here, g in zip(pages, present, got):
        assert (g == {k: bytes(v) for k, v in p.blobs.items()}) if here else g is None


@needs_redis_server
async def test_bench_storage_reports_store_and_raw_figures(redis_server: LocalRedisServer) -> None:
    r = await bench_storage(redis_server.url, pages=4, page_bytes=64 << 10, repeats=2)
    assert r["total_bytes"] == 4 * (64 << 10)
    for k in ("store_put_gbps", "raw_put_gbps", "store_get_gbps", "raw_get_gbps", "put_ratio", "get_ratio"):
        assert r[k] > 0
    assert all(len(v) == 2 for v in r["seconds"].values())
    # It cleaned up after itself.
    raw = raw_client(redis_server.url)
    assert [k async for k in raw.scan_iter(match="kvbench*")] == []
    await raw.aclose()


# -- RedisStore: no pipeline holds more replies than one loop step should parse ------------


@needs_redis_server
@pytest.mark.parametrize("bound", [7, 48])
async def test_no_redis_pipeline_passes_max_pipeline_commands(
    redis_server: LocalRedisServer, monkeypatch: pytest.MonkeyPatch, bound: int
) -> None:
    """redis-py parses a pipeline's replies in one step of the event loop once they
    have arrived, so an exists of 1,024 stored pages in one pipeline held the loop
    20-25 ms. Every pipeline of put, exists and get stays within the bound, a put's
    pages whole (each page's blobs with its commit, in one pipeline), and the pages
    come back byte for byte."""
    sizes: list[int] = []
    pages_seen: list[set[bytes]] = []
    execute = aioredis.client.Pipeline.execute

    async def counted(self: aioredis.client.Pipeline, raise_on_error: bool = True) -> list[object]:
        sizes.append(len(self.command_stack))
        # The page of each command: its key's hash tag (the page key in hex).
        pages_seen.append({bytes(args[1]).split(b"{")[1].split(b"}")[0] for args, _ in self.command_stack})
        return await execute(self, raise_on_error=raise_on_error)

    monkeypatch.setattr(aioredis.client.Pipeline, "execute", counted)
    pages = random_pages(300, {"kv": 64, "c4": 16}, seed=7)
    keys = [p.key for p in pages]
    async with RedisStore(redis_server.url, prefix=f"cmd{secrets.token_hex(4)}:", max_pipeline_commands=bound) as rs:
        await rs.put(pages)
        put_sizes, sizes[:] = list(sizes), []
        put_pages, pages_seen[:] = list(pages_seen), []
        present = await rs.exists(keys)
        exists_sizes, sizes[:] = list(sizes), []
        got = await rs.get(keys, POOLS)
        get_sizes = list(sizes)
    assert present == [True] * len(pages)
    assert got == [{n: bytes(d) for n, d in p.blobs.items()} for p in pages]
    for what, seen in (("put", put_sizes), ("exists", exists_sizes), ("get", get_sizes)):
        assert seen and max(seen) <= bound, (what, max(seen), bound)
    # Whole pages: no page's keys are split over two put pipelines; 3 commands a page.
    assert sum(put_sizes) == 3 * len(pages)
    assert sum(len(s) for s in put_pages) == len(pages)
    assert min(put_sizes) >= 3 and all(s % 3 == 0 for s in put_sizes)


@needs_redis_server
async def test_a_page_with_more_commands_than_the_bound_goes_alone_and_whole(
    redis_server: LocalRedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []
    execute = aioredis.client.Pipeline.execute

    async def counted(self: aioredis.client.Pipeline, raise_on_error: bool = True) -> list[object]:
        sizes.append(len(self.command_stack))
        return await execute(self, raise_on_error=raise_on_error)

    monkeypatch.setattr(aioredis.client.Pipeline, "execute", counted)
    pages = random_pages(5, {"kv": 64, "c4": 16}, seed=8)  # 3 commands a page, over a bound of 2
    async with RedisStore(redis_server.url, prefix=f"one{secrets.token_hex(4)}:", max_pipeline_commands=2) as rs:
        await rs.put(pages)
        assert sizes == [3] * len(pages)
        assert await rs.get([p.key for p in pages], POOLS) == [{n: bytes(d) for n, d in p.blobs.items()} for p in pages]
    with pytest.raises(ValueError, match="max_pipeline_commands must be a positive integer; got 0"):
        RedisStore(redis_server.url, max_pipeline_commands=0)
