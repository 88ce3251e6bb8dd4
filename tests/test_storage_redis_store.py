"""`RedisStore` (`kvtier.storage.redis_store`) as a caller and an operator see it:
the keys it writes, how it cuts a batch into pipelines, what it refuses and how
it says so, its repr, `clear`, and what a closed store or a foreign key does.

The mirror of ``kvtier/storage/redis_store.py`` for `make mutate`: each test
pins something a caller sees (the bytes and keys in Redis, the commands each
pipeline carries, an error's type and message) against one ``redis-server``
per module, so a change that alters it fails here. The backend contract
shared with `FileStore` is in `test_storage_backends.py`; a cluster with a
master down in `test_redis_cluster_degraded.py`.
"""

from __future__ import annotations

import asyncio
import secrets
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from conftest import needs_redis_server

from kvtier.errors import ConfigurationError
from kvtier.storage import PageBlobs, RedisStore, StorageError, StorageTimeout
from kvtier.storage.base import encode_commit
from kvtier.testing.redis_server import LocalRedisCluster, LocalRedisServer

redis = pytest.importorskip("redis")
import redis.asyncio as aioredis  # noqa: E402
import redis.exceptions as redis_errors  # noqa: E402

from kvtier.storage import redis_store  # noqa: E402

pytestmark = needs_redis_server


# -- helpers --------------------------------------------------------------------------------


def _raw(url: str) -> aioredis.Redis:
    """A plain client, for looking behind the store's back (no CLIENT SETINFO)."""
    return aioredis.Redis.from_url(url, **redis_store.CLIENT_OPTIONS)


def _prefix() -> str:
    return f"t{secrets.token_hex(4)}:"


def _page(n: int = 0, **blobs: bytes) -> PageBlobs:
    return PageBlobs(bytes([n]) * 32, blobs or {"kv": bytes([n + 1]) * 64, "c4": bytes([n + 2]) * 16})


def _as_read(page: PageBlobs) -> dict[str, bytes]:
    return {name: bytes(data) for name, data in page.blobs.items()}


class _Pipelines:
    """Every pipeline a store sends: its commands (name and key) in order."""

    def __init__(self) -> None:
        self.sent: list[list[tuple[str, bytes]]] = []

    def names(self) -> list[list[str]]:
        return [[c for c, _ in p] for p in self.sent]

    def sizes(self) -> list[int]:
        return [len(p) for p in self.sent]

    def take(self) -> list[list[tuple[str, bytes]]]:
        sent, self.sent = self.sent, []
        return sent


@pytest.fixture
def pipelines(monkeypatch: pytest.MonkeyPatch) -> _Pipelines:
    seen = _Pipelines()
    execute = aioredis.client.Pipeline.execute

    async def counted(self: aioredis.client.Pipeline, raise_on_error: bool = True) -> list[object]:
        seen.sent.append([(str(args[0]), bytes(args[1])) for args, _ in self.command_stack])
        return await execute(self, raise_on_error=raise_on_error)

    monkeypatch.setattr(aioredis.client.Pipeline, "execute", counted)
    return seen


@pytest.fixture
async def raw(redis_server: LocalRedisServer) -> AsyncIterator[aioredis.Redis]:
    client = _raw(redis_server.url)
    yield client
    await client.aclose()


# -- construction: what is refused, and how it says so --------------------------------------


@pytest.mark.parametrize("bad", [0, -1.0, True, "5", float("nan"), None])
def test_a_timeout_that_is_not_seconds_above_zero_is_refused_naming_it(redis_server: LocalRedisServer, bad: object) -> None:
    with pytest.raises(ConfigurationError) as refused:
        RedisStore(redis_server.url, timeout_s=bad)  # type: ignore[arg-type]
    assert str(refused.value) == f"timeout_s must be > 0 seconds; got {bad!r}"


@pytest.mark.parametrize("bad", [0, -2, False, "10"])
def test_a_ttl_that_is_not_seconds_above_zero_is_refused_naming_it(redis_server: LocalRedisServer, bad: object) -> None:
    with pytest.raises(ConfigurationError) as refused:
        RedisStore(redis_server.url, ttl_s=bad)  # type: ignore[arg-type]
    assert str(refused.value) == f"ttl_s must be None or > 0 seconds; got {bad!r}"


@pytest.mark.parametrize("bad", ["{x}", "a{", "}b", 7, b"kv:"])
def test_a_prefix_that_is_not_a_string_or_has_braces_is_refused(redis_server: LocalRedisServer, bad: object) -> None:
    with pytest.raises(ConfigurationError) as refused:
        RedisStore(redis_server.url, prefix=bad)  # type: ignore[arg-type]
    assert str(refused.value) == (
        "prefix must be a string and must not contain braces (they would change the cluster hash tag); "
        f"got {bad!r}")


@pytest.mark.parametrize("setting", ["max_connections", "max_pipeline_bytes", "max_pipeline_pages",
                                     "max_pipeline_commands"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "3"])
def test_a_bound_that_is_not_a_positive_integer_is_refused_naming_it(
    redis_server: LocalRedisServer, setting: str, bad: object
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        RedisStore(redis_server.url, **{setting: bad})  # type: ignore[arg-type]
    assert str(refused.value) == f"{setting} must be a positive integer; got {bad!r}"


@pytest.mark.parametrize("bad", [0, -1, True, 1.0])
def test_a_max_value_bytes_that_is_not_a_positive_integer_is_refused(redis_server: LocalRedisServer, bad: object) -> None:
    with pytest.raises(ConfigurationError) as refused:
        RedisStore(redis_server.url, max_value_bytes=bad)  # type: ignore[arg-type]
    assert str(refused.value) == f"RedisStore max_value_bytes must be a positive integer; got {bad!r}"


@pytest.mark.parametrize("bad", [-1, True, 1.0, "1"])
def test_retries_that_are_not_a_count_are_refused(redis_server: LocalRedisServer, bad: object) -> None:
    with pytest.raises(ConfigurationError) as refused:
        RedisStore(redis_server.url, retries=bad)  # type: ignore[arg-type]
    assert str(refused.value) == f"retries must be an integer >= 0; got {bad!r}"


async def test_the_smallest_settings_are_accepted_and_work(redis_server: LocalRedisServer) -> None:
    """Each bound at 1 (and retries 0, a timeout and ttl below a second) is a
    working store: the lower ends of the checks are not off by one."""
    page = _page(1)
    async with RedisStore(redis_server.url, prefix=_prefix(), timeout_s=0.5, ttl_s=0.5, max_connections=1,
                          max_pipeline_bytes=1, max_pipeline_pages=1, max_pipeline_commands=1,
                          max_value_bytes=64, retries=0) as rs:
        await rs.put([page])
        assert await rs.get([page.key], ["kv", "c4"]) == [_as_read(page)]
        assert await rs.exists([page.key]) == [True]
        assert rs.timeout_s == 0.5 and rs.ttl_ms == 500


def test_the_store_gives_redis_py_its_connection_bounds_and_defaults(redis_server: LocalRedisServer) -> None:
    """The connections a store opens are bounded as it was told: its pool holds
    ``max_connections`` and a call waits ``timeout_s`` for a free one; by
    default 16 connections, 5 s and pipelines of 1,024 pages at most. A
    ``max_value_bytes`` of one byte is a bound like any other."""
    told = RedisStore(redis_server.url, max_connections=3, timeout_s=2)
    assert (told._pool.max_connections, told._pool.timeout) == (3, 2)
    default = RedisStore(redis_server.url)
    assert (default._pool.max_connections, default._pool.timeout, default.max_pipeline_pages) == (16, 5.0, 1024)
    assert RedisStore(redis_server.url, max_value_bytes=1).max_value_bytes == 1


async def test_a_cluster_store_gives_each_master_its_connection_bound(three_masters: LocalRedisCluster) -> None:
    async with RedisStore(three_masters.url, cluster=True, max_connections=3) as rs:
        assert rs.client.nodes_manager.connection_kwargs["max_connections"] == 3


async def test_closing_a_store_leaves_a_client_it_was_given_open(redis_server: LocalRedisServer) -> None:
    """A store over the caller's client never closes that client: only what it opened."""
    client = _raw(redis_server.url)
    closed: list[str] = []

    async def aclose() -> None:
        closed.append("aclose")

    client.aclose = aclose  # type: ignore[method-assign]
    try:
        async with RedisStore(client, prefix=_prefix()) as rs:
            await rs.put([_page(1)])
        assert closed == []
    finally:
        del client.aclose
        await client.aclose()


@pytest.mark.parametrize("closing", ["works", "the client fails", "the pool fails"])
async def test_closing_a_store_closes_the_client_it_opened_with_redis_pys_aclose(
    redis_server: LocalRedisServer, closing: str,
) -> None:
    """A store that opened its connections closes its client with ``aclose``
    (not redis-py's deprecated ``close``) and then its pool; a client or a pool
    that fails to close does not make ``aclose`` raise (the pool still goes)."""
    rs = RedisStore(redis_server.url, prefix=_prefix())
    await rs.put([_page(1)])
    calls: list[str] = []
    real_aclose, real_disconnect = rs.client.aclose, rs._pool.disconnect

    async def aclose() -> None:
        calls.append("client")
        if closing == "the client fails":
            raise RuntimeError("the socket is gone")
        await real_aclose()

    async def disconnect() -> None:
        calls.append("pool")
        await real_disconnect()
        if closing == "the pool fails":
            raise RuntimeError("the socket is gone")

    rs.client.aclose = aclose
    rs._pool.disconnect = disconnect
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        await rs.aclose()
    assert calls == ["client", "pool"]
    await rs.aclose()  # a second close does nothing
    assert calls == ["client", "pool"]


def test_without_redis_py_the_store_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_store, "aioredis", None)
    with pytest.raises(ImportError) as missing:
        RedisStore()
    assert str(missing.value) == "RedisStore needs redis-py: pip install 'kvtier[redis]'"


@pytest.mark.parametrize("url", ["127.0.0.1:6379", "redis://127.0.0.1:notaport/0", "http://h/0"])
def test_a_url_that_is_not_a_redis_url_is_refused_naming_the_forms(url: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        RedisStore(url)
    text = str(refused.value)
    assert text.startswith(f"RedisStore url {url!r} is not a Redis URL (redis://HOST:PORT/DB, rediss://..., "
                           "unix://PATH): ")
    assert isinstance(refused.value.__cause__, ValueError)


def test_a_password_never_shows_in_the_url_the_store_names() -> None:
    for url, shown in [
        ("redis://user:hunter2@10.0.0.1:6380/0", "redis://user:***@10.0.0.1:6380/0"),
        ("redis://:hunter2@cache/1", "redis://:***@cache/1"),
        ("redis://user@cache:7000/0", "redis://user@cache:7000/0"),
        ("redis://cache:7000/0", "redis://cache:7000/0"),
        ("unix://:hunter2@/run/redis.sock", "unix://:***@/run/redis.sock"),  # a socket: no host to name
    ]:
        rs = RedisStore(url)
        assert rs.url == shown and "hunter2" not in repr(rs)
    with pytest.raises(ConfigurationError) as refused:
        RedisStore("redis://u:hunter2@[::1/0")
    assert "hunter2" not in str(refused.value) and "'<unparsable redis url>'" in str(refused.value)


def test_the_repr_names_url_timeout_ttl_and_prefix(redis_server: LocalRedisServer) -> None:
    url = redis_server.url
    assert repr(RedisStore(url, timeout_s=2, prefix="a:")) == f"<RedisStore {url} [timeout=2s, ttl=none, prefix='a:']>"
    assert repr(RedisStore(url, timeout_s=0.25, ttl_s=90.5)) == (
        f"<RedisStore {url} [timeout=0.25s, ttl=90.5s, prefix='kvtier:']>")
    assert RedisStore(url, timeout_s=2).timeout_s == 2.0 and isinstance(RedisStore(url, timeout_s=2).timeout_s, float)
    assert RedisStore(url).timeout_s == 5.0  # the default a batch waits before it is answered with misses


# -- the keys and values it writes -----------------------------------------------------------


async def test_a_page_is_a_commit_record_and_one_key_per_blob_under_its_hash_tag(
    redis_server: LocalRedisServer, raw: aioredis.Redis
) -> None:
    page = _page(3)
    async with RedisStore(redis_server.url, prefix="tag:") as rs:
        await rs.put([page])
    h = page.key.hex()
    assert sorted(await raw.keys("tag:*")) == sorted([f"tag:{{{h}}}:c".encode(), f"tag:{{{h}}}:b:kv".encode(),
                                                       f"tag:{{{h}}}:b:c4".encode()])
    assert await raw.get(f"tag:{{{h}}}:c") == encode_commit(page)
    assert await raw.get(f"tag:{{{h}}}:b:kv") == bytes(page.blobs["kv"])
    assert await raw.get(f"tag:{{{h}}}:b:c4") == bytes(page.blobs["c4"])
    for name in await raw.keys("tag:*"):
        assert await raw.pttl(name) == -1  # no ttl_s: kept until Redis evicts them


async def test_the_default_prefix_is_kvtier(redis_server: LocalRedisServer, raw: aioredis.Redis) -> None:
    page = _page(4)
    async with RedisStore(redis_server.url) as rs:
        await rs.put([page])
        try:
            assert await raw.exists(f"kvtier:{{{page.key.hex()}}}:c") == 1
        finally:
            await rs.clear()


async def test_ttl_s_expires_every_key_of_a_page_and_rounds_up_to_a_millisecond(
    redis_server: LocalRedisServer, raw: aioredis.Redis
) -> None:
    page = _page(5)
    async with RedisStore(redis_server.url, prefix="ttl:", ttl_s=30) as rs:
        await rs.put([page])
        assert rs.ttl_ms == 30_000
    ttls = [await raw.pttl(name) for name in await raw.keys("ttl:*")]
    assert len(ttls) == 3 and all(25_000 < t <= 30_000 for t in ttls), ttls
    assert RedisStore(redis_server.url, ttl_s=0.0001).ttl_ms == 1
    assert RedisStore(redis_server.url, ttl_s=2.0009).ttl_ms == 2000


async def test_an_empty_blob_is_only_its_commit_record(redis_server: LocalRedisServer, raw: aioredis.Redis) -> None:
    page = PageBlobs(b"\x09" * 32, {"anchor": b"", "kv": b"k" * 8})
    async with RedisStore(redis_server.url, prefix="empty:") as rs:
        await rs.put([page])
        assert sorted(await raw.keys("empty:*")) == sorted(
            [f"empty:{{{page.key.hex()}}}:c".encode(), f"empty:{{{page.key.hex()}}}:b:kv".encode()])
        assert await rs.exists([page.key]) == [True]
        assert await rs.get([page.key], ["anchor", "kv"]) == [{"anchor": b"", "kv": b"k" * 8}]


async def test_a_put_sets_every_key_anew_replacing_a_damaged_page(
    redis_server: LocalRedisServer, raw: aioredis.Redis
) -> None:
    page = _page(6)
    async with RedisStore(redis_server.url, prefix="again:") as rs:
        await rs.put([page])
        await raw.set(f"again:{{{page.key.hex()}}}:b:kv", b"short")
        assert await rs.get([page.key], ["kv"]) == [None] and await rs.exists([page.key]) == [False]
        await rs.put([page])
        assert await rs.get([page.key], ["kv", "c4"]) == [_as_read(page)]


async def test_a_blob_over_max_value_bytes_is_refused_before_anything_is_sent(
    redis_server: LocalRedisServer, raw: aioredis.Redis, pipelines: _Pipelines
) -> None:
    small, big = _page(7), PageBlobs(b"\x08" * 32, {"kv": b"x" * 65})
    async with RedisStore(redis_server.url, prefix="big:", max_value_bytes=64) as rs:
        with pytest.raises(StorageError) as refused:
            await rs.put([small, big])
        assert "is 65 bytes; this redis store takes values up to max_value_bytes=64" in str(refused.value)
        assert pipelines.sent == [] and await raw.keys("big:*") == []
        await rs.put([PageBlobs(b"\x08" * 32, {"kv": b"x" * 64})])  # at the bound: taken
        assert await rs.exists([b"\x08" * 32]) == [True]


# -- how a batch is cut into pipelines --------------------------------------------------------


async def test_put_pipelines_close_at_the_byte_bound_by_at_most_one_page(
    redis_server: LocalRedisServer, pipelines: _Pipelines
) -> None:
    pages = [_page(i, kv=bytes([i]) * 100) for i in range(7)]  # 2 commands a page
    async with RedisStore(redis_server.url, prefix=_prefix(), max_pipeline_bytes=250) as rs:
        await rs.put(pages)
        # 100 + 100 = 200 < 250: a third page goes in (300 >= 250), then the pipeline closes
        assert pipelines.sizes() == [6, 6, 2]
        assert await rs.get([p.key for p in pages], ["kv"]) == [_as_read(p) for p in pages]
    async with RedisStore(redis_server.url, prefix=_prefix(), max_pipeline_bytes=200) as rs:
        pipelines.take()
        await rs.put(pages)
        assert pipelines.sizes() == [4, 4, 4, 2]  # 200 reached: closed at two pages
    async with RedisStore(redis_server.url, prefix=_prefix(), max_pipeline_bytes=201) as rs:
        pipelines.take()
        await rs.put(pages)
        assert pipelines.sizes() == [6, 6, 2]  # 200 < 201: every pipeline takes a third page


async def test_put_pipelines_hold_at_most_max_pipeline_pages(redis_server: LocalRedisServer, pipelines: _Pipelines) -> None:
    pages = [_page(i) for i in range(5)]
    async with RedisStore(redis_server.url, prefix=_prefix(), max_pipeline_pages=2) as rs:
        await rs.put(pages)
        assert pipelines.sizes() == [6, 6, 3]


async def test_put_pipelines_fill_up_to_max_pipeline_commands_exactly(
    redis_server: LocalRedisServer, pipelines: _Pipelines
) -> None:
    """Pages of three commands (two blobs and the commit) under a bound of six
    commands: two pages a pipeline, the bound reached exactly, never passed."""
    pages = [_page(i) for i in range(5)]
    async with RedisStore(redis_server.url, prefix=_prefix(), max_pipeline_commands=6) as rs:
        await rs.put(pages)
        assert pipelines.sizes() == [6, 6, 3]
        pipelines.take()
        await rs.put(pages[:1])
        assert pipelines.sizes() == [3]
        assert await rs.get([p.key for p in pages], ["kv", "c4"]) == [_as_read(p) for p in pages]


async def test_a_put_pipeline_holds_each_pages_blobs_before_its_commit(
    redis_server: LocalRedisServer, pipelines: _Pipelines
) -> None:
    pages = [_page(i) for i in range(2)]
    async with RedisStore(redis_server.url, prefix="ord:") as rs:
        await rs.put(pages)
    (sent,) = pipelines.sent
    assert [(c, k.split(b"}")[1]) for c, k in sent] == [("SET", b":b:kv"), ("SET", b":b:c4"), ("SET", b":c")] * 2
    assert [k.split(b"{")[1].split(b"}")[0] for _, k in sent] == [p.key.hex().encode() for p in pages for _ in range(3)]


async def test_get_pipelines_are_sized_by_the_last_page_seen(
    redis_server: LocalRedisServer, pipelines: _Pipelines
) -> None:
    """The first read goes a page at a time (no page seen yet); then enough pages
    to reach ``max_pipeline_bytes`` (rounded up), at most the command bound."""
    pages = [_page(i, kv=bytes([i]) * 100) for i in range(7)]
    keys = [p.key for p in pages]
    async with RedisStore(redis_server.url, prefix=_prefix(), max_pipeline_bytes=250) as writer:
        await writer.put(pages)
        url, prefix = redis_server.url, writer.prefix.decode()
    async with RedisStore(url, prefix=prefix, max_pipeline_bytes=250) as rs:
        pipelines.take()
        assert await rs.get(keys, ["kv"]) == [_as_read(p) for p in pages]
        # 2 commands a page; the first pipeline one page, then ceil(250 / 100) = 3 pages
        assert pipelines.sizes() == [2, 6, 6]
        pipelines.take()
        assert await rs.get(keys, ["kv"]) == [_as_read(p) for p in pages]
        assert pipelines.sizes() == [6, 6, 2]
        pipelines.take()
        missing = [bytes([0xEE]) * 32] * 4
        assert await rs.get(missing, ["kv"]) == [None] * 4  # a miss leaves the size as it was
        assert pipelines.sizes() == [6, 2]
    async with RedisStore(url, prefix=prefix, max_pipeline_bytes=250, max_pipeline_commands=4) as rs:
        await rs.put(pages[:1])  # a put sizes reads too
        pipelines.take()
        assert await rs.get(keys, ["kv"]) == [_as_read(p) for p in pages]
        assert pipelines.sizes() == [4, 4, 4, 2]
    async with RedisStore(url, prefix=prefix, max_pipeline_bytes=300) as rs:
        await rs.put(pages[:1])
        pipelines.take()
        assert await rs.get(keys, ["kv"]) == [_as_read(p) for p in pages]
        assert pipelines.sizes() == [6, 6, 2]  # exactly 300 / 100: three pages, not four


async def test_get_pipelines_take_a_page_past_the_byte_bound_alone_and_count_an_empty_page_as_one_byte(
    redis_server: LocalRedisServer, pipelines: _Pipelines
) -> None:
    """A page bigger than ``max_pipeline_bytes`` is read one to a pipeline; a
    page of no bytes (an anchor page) counts as one byte, so that many of them
    share a pipeline."""
    big = [_page(i, kv=bytes([i]) * 100) for i in range(3)]
    empty = [_page(10 + i, kv=b"") for i in range(5)]
    async with RedisStore(redis_server.url, prefix=_prefix(), max_pipeline_bytes=50) as rs:
        await rs.put(big)  # a put sizes reads too
        pipelines.take()
        assert await rs.get([p.key for p in big], ["kv"]) == [_as_read(p) for p in big]
        assert pipelines.sizes() == [2, 2, 2]
    async with RedisStore(redis_server.url, prefix=_prefix(), max_pipeline_bytes=4) as rs:
        await rs.put(empty)
        pipelines.take()
        assert await rs.get([p.key for p in empty], ["kv"]) == [_as_read(p) for p in empty]
        assert pipelines.sizes() == [8, 2]  # four pages of 2 commands, then one


async def test_an_exists_asks_the_blob_lengths_it_can_guess_in_the_same_pipeline(
    redis_server: LocalRedisServer, pipelines: _Pipelines
) -> None:
    """The first lookup reads the commit records, then the lengths they name;
    later ones ask the lengths of the pools the last one saw with the records."""
    pages = [_page(i) for i in range(3)]
    keys = [p.key for p in pages]
    async with RedisStore(redis_server.url, prefix=_prefix()) as rs:
        await rs.put(pages)
        pipelines.take()
        assert await rs.exists(keys) == [True] * 3
        assert pipelines.names() == [["GET"] * 3, ["STRLEN"] * 6]
        pipelines.take()
        assert await rs.exists(keys + [b"\xee" * 32]) == [True, True, True, False]
        assert pipelines.names() == [["GET", "STRLEN", "STRLEN"] * 4]
        assert [k.rsplit(b":", 1)[1] for _, k in pipelines.sent[0][:3]] == [b"c", b"c4", b"kv"]  # sorted names
        pipelines.take()
        assert await rs.exists([b"\xee" * 32]) == [False]  # nothing found: the guess stays
        assert await rs.exists(keys[:1]) == [True]
        assert pipelines.names() == [["GET", "STRLEN", "STRLEN"]] * 2


async def test_an_exists_guesses_at_most_eight_blobs_and_asks_the_rest_after(
    redis_server: LocalRedisServer, pipelines: _Pipelines
) -> None:
    page = PageBlobs(b"\x01" * 32, {f"p{i:02d}": bytes([i + 1]) * 4 for i in range(10)})
    async with RedisStore(redis_server.url, prefix=_prefix()) as rs:
        await rs.put([page])
        await rs.exists([page.key])
        pipelines.take()
        assert await rs.exists([page.key]) == [True]
        (first, rest) = pipelines.sent
        assert [c for c, _ in first] == ["GET"] + ["STRLEN"] * 8
        assert [k.rsplit(b":", 1)[1] for _, k in first[1:]] == [f"p{i:02d}".encode() for i in range(8)]
        assert [k.rsplit(b":", 1)[1] for _, k in rest] == [b"p08", b"p09"]


async def test_an_exists_does_not_ask_the_length_of_an_empty_blob(
    redis_server: LocalRedisServer, pipelines: _Pipelines
) -> None:
    page = PageBlobs(b"\x02" * 32, {"anchor": b"", "kv": b"k" * 8})
    async with RedisStore(redis_server.url, prefix=_prefix()) as rs:
        await rs.put([page])
        pipelines.take()
        assert await rs.exists([page.key]) == [True]
        assert [[k.rsplit(b":", 1)[1] for _, k in p] for p in pipelines.sent] == [[b"c"], [b"kv"]]


async def test_exists_pipelines_stay_within_the_command_bound_with_the_guess(
    redis_server: LocalRedisServer, pipelines: _Pipelines
) -> None:
    pages = [_page(i) for i in range(5)]
    keys = [p.key for p in pages]
    async with RedisStore(redis_server.url, prefix=_prefix(), max_pipeline_commands=7) as rs:
        await rs.put(pages)
        pipelines.take()
        assert await rs.exists(keys) == [True] * 5
        # no guess: 7 records in one pipeline would do, 5 pages; then 10 lengths, 7 a pipeline
        # (the guess, two names, is learnt from the first chunk: the later chunks use it)
        assert pipelines.sizes() == [5, 7, 3]
        pipelines.take()
        assert await rs.exists(keys) == [True] * 5
        assert pipelines.sizes() == [6, 6, 3]  # 3 commands a page, two pages a pipeline
    async with RedisStore(redis_server.url, prefix=_prefix(), max_pipeline_commands=2) as rs:
        await rs.put(pages[:2])
        await rs.exists(keys[:1])
        pipelines.take()
        assert await rs.exists(keys[:2]) == [True, True]
        assert pipelines.names() == [["GET", "STRLEN", "STRLEN"]] * 2  # one page at least


# -- what a lookup and a read refuse -----------------------------------------------------------


async def test_a_key_of_another_type_under_a_pages_name_is_a_miss(
    redis_server: LocalRedisServer, raw: aioredis.Redis
) -> None:
    pages = [_page(i) for i in range(3)]
    async with RedisStore(redis_server.url, prefix="type:") as rs:
        await rs.put(pages)
        await rs.exists([pages[0].key])
        h1, h2 = pages[1].key.hex(), pages[2].key.hex()
        await raw.delete(f"type:{{{h1}}}:b:kv")
        await raw.rpush(f"type:{{{h1}}}:b:kv", b"x")  # a foreign list where a blob belongs
        await raw.delete(f"type:{{{h2}}}:c")
        await raw.hset(f"type:{{{h2}}}:c", "v", "1")  # a foreign hash where the commit belongs
        assert await rs.exists([p.key for p in pages]) == [True, False, False]
        assert await rs.get([p.key for p in pages], ["kv", "c4"]) == [_as_read(pages[0]), None, None]
    async with RedisStore(redis_server.url, prefix="type:") as fresh:  # no guess: the lengths asked after
        assert await fresh.exists([p.key for p in pages]) == [True, False, False]


async def test_an_error_reply_other_than_wrongtype_fails_the_call_naming_it(
    redis_server: LocalRedisServer, raw: aioredis.Redis
) -> None:
    """A server that refuses a command (here an ACL without STRLEN) is a store
    that cannot answer, not a miss."""
    user = f"u{secrets.token_hex(4)}"
    await raw.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "+@all", "-strlen")  # type: ignore[no-untyped-call]
    host, port = redis_server.url.split("//")[1].split("/")[0].split(":")
    url = f"redis://{user}:pw@{host}:{port}/0"
    page = _page(9)
    try:
        async with RedisStore(url, prefix=_prefix()) as rs:
            await rs.put([page])
            assert await rs.get([page.key], ["kv", "c4"]) == [_as_read(page)]
            with pytest.raises(StorageError) as failed:
                await rs.exists([page.key])
    finally:
        await raw.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]
    assert not isinstance(failed.value, StorageTimeout)
    assert str(failed.value).startswith(f"redis redis://{user}:***@{host}:{port}/0 failed exists: NoPermissionError: ")
    assert (failed.value.backend, failed.value.operation) == ("redis", "exists")
    assert isinstance(failed.value.__cause__, redis_errors.NoPermissionError)


async def test_a_server_that_is_gone_fails_each_call_naming_the_operation(redis_server: LocalRedisServer) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with RedisStore(f"redis://127.0.0.1:{port}/0", timeout_s=2) as rs:
        for operation, call in [("exists", rs.exists([b"k"])), ("get", rs.get([b"k"], ["kv"])),
                                ("put", rs.put([_page(1)])), ("clear", rs.clear())]:
            with pytest.raises(StorageError) as failed:
                await call
            assert not isinstance(failed.value, StorageTimeout)
            assert str(failed.value).startswith(f"redis redis://127.0.0.1:{port}/0 failed {operation}: ConnectionError")
            assert failed.value.operation == operation and failed.value.backend == "redis"


async def test_a_silent_server_is_a_storage_timeout_naming_the_bound(fresh_server: Any) -> None:
    server: LocalRedisServer = await asyncio.to_thread(fresh_server)
    async with RedisStore(server.url, prefix=_prefix(), timeout_s=0.3) as rs:
        await rs.put([_page(1)])
        server.pause()
        try:
            with pytest.raises(StorageTimeout) as failed:
                await rs.get([_page(1).key], ["kv"])
        finally:
            server.resume()
    assert str(failed.value).startswith(f"redis {server.url} did not answer get within 0.3 s: ")
    assert (failed.value.operation, failed.value.timeout_s) == ("get", 0.3)


# -- a closed store, another event loop ----------------------------------------------------------


async def test_a_closed_store_refuses_every_call_and_closes_once(redis_server: LocalRedisServer) -> None:
    rs = RedisStore(redis_server.url, prefix=_prefix())
    await rs.put([_page(1)])
    await rs.aclose()
    await rs.aclose()  # idempotent
    for operation, call in [("exists", rs.exists([b"k"])), ("get", rs.get([b"k"], ["kv"])),
                            ("put", rs.put([_page(1)])), ("clear", rs.clear())]:
        with pytest.raises(StorageError) as refused:
            await call
        assert str(refused.value) == "redis store is closed"
        assert (refused.value.backend, refused.value.operation) == ("redis", operation)


async def test_closing_drops_the_stores_own_connections_never_a_callers_client(
    redis_server: LocalRedisServer, raw: aioredis.Redis
) -> None:
    async def clients() -> int:
        return len([c for c in (await raw.client_list()) if c.get("name") != "watcher"])

    await raw.client_setname("watcher")
    before = await clients()
    rs = RedisStore(redis_server.url, prefix=_prefix())
    await rs.put([_page(1)])
    assert await clients() == before + 1
    await rs.aclose()
    for _ in range(100):
        if await clients() == before:
            break
        await asyncio.sleep(0.01)
    assert await clients() == before
    caller = _raw(redis_server.url)
    try:
        async with RedisStore(caller, prefix=_prefix()) as rs:
            await rs.put([_page(2)])
            assert rs.url == repr(caller)
        assert await caller.ping()  # not closed: the caller owns it
    finally:
        await caller.aclose()


def test_outside_an_asyncio_loop_every_call_says_asyncio_is_needed(redis_server: LocalRedisServer) -> None:
    rs = RedisStore(redis_server.url, prefix=_prefix())
    for call in (rs.exists([b"k"]), rs.get([b"k"], ["kv"]), rs.put([_page(1)]), rs.clear()):
        with pytest.raises(ConfigurationError) as refused:
            call.send(None)  # run without any event loop
        assert str(refused.value) == (
            "RedisStore runs on asyncio (or uvloop): redis-py's client is asyncio's; found no asyncio event loop: "
            "use anyio.run(..., backend='asyncio') or asyncio.run(...), or FileStore, which runs on any "
            "anyio backend")
        assert refused.value.__cause__ is None and refused.value.__suppress_context__


def test_under_trio_a_call_names_trio(redis_server: LocalRedisServer) -> None:
    trio = pytest.importorskip("trio")
    rs = RedisStore(redis_server.url, prefix=_prefix())
    with pytest.raises(ConfigurationError, match="; found trio: use anyio.run"):
        trio.run(rs.exists, [b"k"])


# -- clear ------------------------------------------------------------------------------------


async def test_clear_removes_its_prefixs_keys_only_and_counts_pages(
    redis_server: LocalRedisServer, raw: aioredis.Redis
) -> None:
    mine, theirs = _prefix(), _prefix()
    pages = [_page(i) for i in range(4)]
    async with RedisStore(redis_server.url, prefix=mine) as rs, RedisStore(redis_server.url, prefix=theirs) as other:
        await rs.put(pages)
        await other.put(pages[:2])
        await raw.set(f"{mine}{{{'ab' * 32}}}:b:kv", b"orphan blob")  # a blob without its commit
        assert await rs.clear() == 4
        assert await raw.keys(f"{mine}*") == []
        assert await other.exists([p.key for p in pages]) == [True, True, False, False]
        assert await rs.clear() == 0


@pytest.mark.parametrize("special", ["*", "?", "[x]", "\\"])
async def test_clear_reads_its_prefix_literally(
    redis_server: LocalRedisServer, raw: aioredis.Redis, special: str
) -> None:
    """A prefix holding a glob character clears its own keys, never another
    prefix the pattern would match."""
    tag = secrets.token_hex(3)
    mine, theirs = f"{tag}{special}:", f"{tag}x:"
    page = _page(1)
    async with RedisStore(redis_server.url, prefix=mine) as rs, RedisStore(redis_server.url, prefix=theirs) as other:
        await rs.put([page])
        await other.put([page])
        assert await rs.clear() == 1
        assert await rs.exists([page.key]) == [False] and await other.exists([page.key]) == [True]
        await other.clear()


async def test_clear_unlinks_in_batches_of_512(
    redis_server: LocalRedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages = [PageBlobs(i.to_bytes(32, "big"), {"kv": b"v"}) for i in range(300)]  # 600 keys
    batches: list[int] = []
    async with RedisStore(redis_server.url, prefix=_prefix()) as rs:
        unlink = rs.client.unlink

        async def counted(*names: bytes) -> int:
            batches.append(len(names))
            return await unlink(*names)  # type: ignore[no-any-return]

        monkeypatch.setattr(rs.client, "unlink", counted)
        await rs.put(pages)
        assert await rs.clear() == 300
        assert batches == [512, 88]
        assert await rs.exists([pages[0].key, pages[-1].key]) == [False, False]


# -- Redis Cluster --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_masters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """Three masters that go on serving their own slots while one is silent (a
    master paused past the node timeout on a loaded machine leaves the others
    up for the next test)."""
    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"), masters=3, require_full_coverage=False) as c:
        yield c


async def test_a_cluster_call_sends_each_master_its_own_pages(three_masters: LocalRedisCluster) -> None:
    pages = [_page(i) for i in range(12)]
    async with RedisStore(three_masters.url, cluster=True, prefix=_prefix()) as rs:
        await rs.put(pages)
        assert await rs.exists([p.key for p in pages]) == [True] * 12
        assert await rs.get([p.key for p in pages] + [b"\xee" * 32], ["kv", "c4"]) == [
            _as_read(p) for p in pages] + [None]
        assert rs.node_errors == {}
        nodes = {rs.client.get_node_from_key(rs._commit_key(p.key)).name for p in pages}
        assert len(nodes) >= 2
        assert await rs.clear() == 12


async def test_a_silent_master_costs_its_pages_as_misses_and_fails_a_put_as_a_timeout(
    three_masters: LocalRedisCluster,
) -> None:
    """One master paused (it keeps its sockets, answers nothing) for less than the
    cluster's node timeout: reads answer the other masters' pages and miss its
    own, counted per call; a put touching it raises `StorageTimeout` naming it
    and the share of the batch's nodes; the others' pages of that put land."""
    pages = [_page(i) for i in range(12)]
    async with RedisStore(three_masters.url, cluster=True, prefix=_prefix(), timeout_s=0.5) as rs:
        await rs.put(pages)
        node_of = [rs.client.get_node_from_key(rs._commit_key(p.key)).name for p in pages]
        silent = three_masters.nodes[next(i for i, n in enumerate(three_masters.nodes)
                                          if f"127.0.0.1:{n.port}" in node_of[1:] and f"127.0.0.1:{n.port}" != node_of[0])]
        silent_name = f"127.0.0.1:{silent.port}"
        on_silent = [name == silent_name for name in node_of]
        more = [_page(100 + i) for i in range(12)]
        silent.pause()
        try:
            assert await rs.exists([p.key for p in pages]) == [not s for s in on_silent]
            assert await rs.get([p.key for p in pages], ["kv", "c4"]) == [
                None if s else _as_read(p) for p, s in zip(pages, on_silent)]
            assert rs.node_errors == {silent_name: 2}
            only = [p.key for p, s in zip(pages, on_silent) if s]
            assert await rs.get(only, ["kv"]) == [None] * len(only)
            assert rs.node_errors == {silent_name: 3}
            with pytest.raises(StorageTimeout) as failed:
                await rs.put(more)
        finally:
            silent.resume()
        more_nodes = {rs.client.get_node_from_key(rs._commit_key(p.key)).name for p in more}
        assert str(failed.value) == (
            f"redis node {silent_name} failed put (1 of {len(more_nodes)} nodes of the batch): no answer within 0.5 s")
        assert (failed.value.operation, failed.value.timeout_s, failed.value.backend) == ("put", 0.5, "redis")
        assert rs.node_errors == {silent_name: 4}
        more_on_silent = [rs.client.get_node_from_key(rs._commit_key(p.key)).name == silent_name for p in more]
        assert await rs.exists([p.key for p in more]) == [not s for s in more_on_silent]
        assert await rs.clear() == 12 + sum(not s for s in more_on_silent)


async def test_every_master_silent_fails_a_read_naming_them_all(three_masters: LocalRedisCluster) -> None:
    """No master answering is no store to miss in: the read raises, a
    `StorageTimeout` naming every node, where one silent master was misses."""
    pages = [_page(i) for i in range(12)]
    async with RedisStore(three_masters.url, cluster=True, prefix=_prefix(), timeout_s=0.5) as rs:
        await rs.put(pages)
        names = sorted(f"127.0.0.1:{n.port}" for n in three_masters.nodes)
        assert {rs.client.get_node_from_key(rs._commit_key(p.key)).name for p in pages} == set(names)
        for node in three_masters.nodes:
            node.pause()
        try:
            with pytest.raises(StorageTimeout) as failed:
                await rs.get([p.key for p in pages], ["kv"])
        finally:
            for node in three_masters.nodes:
                node.resume()
        assert str(failed.value) == (
            f"redis node {', '.join(names)} failed get (3 of 3 nodes of the batch): no answer within 0.5 s")
        assert rs.node_errors == {name: 1 for name in names}
        for node in three_masters.nodes:
            node.pause()
        try:
            with pytest.raises(StorageTimeout, match=r"failed exists \(3 of 3 nodes of the batch\)") as failed:
                await rs.exists([p.key for p in pages])
        finally:
            for node in three_masters.nodes:
                node.resume()
        assert failed.value.operation == "exists"
        assert await rs.get([pages[0].key], ["kv"]) == [{"kv": bytes(pages[0].blobs["kv"])}]
        await rs.clear()


@pytest.mark.parametrize("refusal", ["ClusterDownError", "error reply"])
async def test_a_master_saying_clusterdown_fails_the_read_though_the_others_answer(
    three_masters: LocalRedisCluster, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """``CLUSTERDOWN`` from any master (redis-py's `ClusterDownError`, or an
    error reply that names it) means the cluster refuses: the read raises
    instead of missing that master's pages. (Not "CLUSTERDOWN Hash slot not
    served", one slot's state: `test_a_slot_that_no_master_serves_...`.)"""
    pages = [_page(i) for i in range(12)]
    async with RedisStore(three_masters.url, cluster=True, prefix=_prefix()) as rs:
        await rs.put(pages)
        victim = rs.client.get_node_from_key(rs._commit_key(pages[0].key)).name
        error = (redis_errors.ClusterDownError("The cluster is down") if refusal == "ClusterDownError"
                 else redis_errors.ResponseError("CLUSTERDOWN The cluster is down"))
        read = rs._get_keys

        async def refusing(keys: list[bytes], names: list[str]) -> list[dict[str, bytes] | None]:
            if rs.client.get_node_from_key(rs._commit_key(keys[0])).name == victim:
                raise error
            return await read(keys, names)

        monkeypatch.setattr(rs, "_get_keys", refusing)
        with pytest.raises(StorageError) as failed:
            await rs.get([p.key for p in pages], ["kv"])
        assert str(failed.value) == (
            f"redis node {victim} failed get (1 of 3 nodes of the batch): {type(error).__name__}: {error}")
        assert not isinstance(failed.value, StorageTimeout)
        assert (failed.value.backend, failed.value.operation) == ("redis", "get")
        assert failed.value.__cause__ is error
        await rs.clear()


async def test_clear_scans_a_thousand_keys_a_round_trip(redis_server: LocalRedisServer) -> None:
    """On a database of its own (so the count is of this test's keys), 600 keys
    take one or two SCAN round trips (Redis's default count, 10, would take ~60)."""
    url = redis_server.url.rsplit("/", 1)[0] + "/7"
    pages = [PageBlobs(i.to_bytes(32, "big"), {"kv": b"v"}) for i in range(300)]
    async with RedisStore(url, prefix=_prefix()) as rs:
        await rs.client.flushdb()
        await rs.put(pages)
        scans: list[object] = []
        scan = rs.client.scan

        async def counted(*args: Any, **kwargs: Any) -> Any:
            scans.append(kwargs.get("count"))
            return await scan(*args, **kwargs)

        rs.client.scan = counted  # type: ignore[method-assign]
        assert await rs.clear() == 300
        assert 1 <= len(scans) <= 2
        assert await rs.client.dbsize() == 0



async def test_a_key_whose_slot_the_client_lost_is_grouped_apart_and_missed(
    three_masters: LocalRedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py drops a failed master's slots from its map (`SlotNotCoveredError`
    for their keys): those pages go to a group of their own, "no node for its
    slot", whose failure is misses for them and fails a put naming it."""
    pages = [_page(i) for i in range(6)]
    async with RedisStore(three_masters.url, cluster=True, prefix=_prefix()) as rs:
        await rs.put(pages)
        lost = rs._commit_key(pages[0].key)
        locate, read = rs.client.get_node_from_key, rs._get_keys

        def mapped(key: bytes, *args: Any, **kwargs: Any) -> Any:
            if key == lost:
                raise redis_errors.SlotNotCoveredError("slot not covered")
            return locate(key, *args, **kwargs)

        async def reading(keys: list[bytes], names: list[str]) -> list[dict[str, bytes] | None]:
            if pages[0].key in keys:  # the group's call fails (its master is gone)
                raise redis_errors.ConnectionError("connection refused")
            return await read(keys, names)

        monkeypatch.setattr(rs.client, "get_node_from_key", mapped)
        assert await rs.get([p.key for p in pages], ["kv", "c4"]) == [_as_read(p) for p in pages]  # still read
        monkeypatch.setattr(rs, "_get_keys", reading)
        assert await rs.get([p.key for p in pages], ["kv", "c4"]) == [None] + [_as_read(p) for p in pages[1:]]
        assert rs.node_errors == {"no node for its slot": 1}
        monkeypatch.setattr(rs, "_put_pages", lambda part: reading([p.key for p in part], []))
        with pytest.raises(StorageError, match=r"^redis node no node for its slot failed put \(1 of \d nodes"):
            await rs.put(pages[:1])
        monkeypatch.undo()
        await rs.clear()


async def test_a_cluster_that_nobody_answers_fails_every_call_as_a_storage_error() -> None:
    # redis-py's cluster client raises its own exceptions (RedisClusterException,
    # not a RedisError) when it cannot build a slot map: they are the store's errors too.
    async with RedisStore("redis://127.0.0.1:1/0", cluster=True, timeout_s=1) as rs:
        calls = {"exists": lambda: rs.exists([bytes(32)]), "get": lambda: rs.get([bytes(32)], ["kv"]),
                 "put": lambda: rs.put([_page(1)]), "clear": rs.clear}
        for operation, call in calls.items():
            with pytest.raises(StorageError, match="Redis Cluster cannot be connected") as failed:
                await call()
            assert failed.value.operation == operation and failed.value.backend == "redis"
            assert isinstance(failed.value.__cause__, redis_errors.RedisClusterException)


async def test_a_slot_that_no_master_serves_costs_its_pages_as_misses_not_the_read(tmp_path: Any) -> None:
    """A cluster that does not require full coverage, one slot unassigned (a master
    gone with its slots deleted, or never given them): a read misses the pages of
    that slot's group and reads the rest, whether the client's slot map still names
    a master for it (the master answers "CLUSTERDOWN Hash slot not served", which is
    one slot's state, not the cluster's) or not (a store opened afterwards, whose
    map lacks the slot). A put there fails as a `StorageError`."""
    cluster = LocalRedisCluster(tmp_path, masters=3, require_full_coverage=False)
    await asyncio.to_thread(cluster.start)
    try:
        pages = [_page(i) for i in range(12)]
        prefix = _prefix()
        async with RedisStore(cluster.url, cluster=True, prefix=prefix) as rs:
            await rs.put(pages)
            lost = rs._commit_key(pages[0].key)
            owner = rs.client.get_node_from_key(lost).name
            on_owner = [rs.client.get_node_from_key(rs._commit_key(p.key)).name == owner for p in pages]
            for node in cluster.nodes:
                await asyncio.to_thread(node.command, "CLUSTER", "DELSLOTS", str(rs.client.keyslot(lost)))
            got = await rs.get([p.key for p in pages], ["kv", "c4"])
            assert got == [None if mine else _as_read(p) for p, mine in zip(pages, on_owner)]
            assert await rs.exists([p.key for p in pages]) == [not mine for mine in on_owner]
            assert rs.node_errors == {owner: 2}
            with pytest.raises(StorageError, match="Hash slot not served"):
                await rs.put(pages[:1])
        async with RedisStore(cluster.url, cluster=True, prefix=prefix) as fresh:
            got = await fresh.get([p.key for p in pages], ["kv", "c4"])
            assert got == [None] + [_as_read(p) for p in pages[1:]]
            assert await fresh.exists([p.key for p in pages]) == [False] + [True] * 11
            assert fresh.node_errors == {"no node for its slot": 2}
            with pytest.raises(StorageError, match="no node for its slot"):
                await fresh.put(pages[:1])
    finally:
        await asyncio.to_thread(cluster.stop)


async def test_an_error_that_is_not_the_stores_passes_through_a_cluster_call(
    three_masters: LocalRedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages = [_page(i) for i in range(6)]
    async with RedisStore(three_masters.url, cluster=True, prefix=_prefix()) as rs:
        await rs.put(pages)
        read = rs._get_keys
        bug = RuntimeError("a bug, not a store failure")

        async def buggy(keys: list[bytes], names: list[str]) -> list[dict[str, bytes] | None]:
            if pages[0].key in keys:
                raise bug
            return await read(keys, names)

        monkeypatch.setattr(rs, "_get_keys", buggy)
        with pytest.raises(RuntimeError) as raised:
            await rs.get([p.key for p in pages], ["kv"])
        assert raised.value is bug and rs.node_errors == {}
        monkeypatch.undo()
        await rs.clear()


def test_throwaway_servers_take_ports_a_cluster_bus_can_follow() -> None:
    """A cluster node also listens on its port + 10000, so redis-server refuses a
    cluster port above 55535; the throwaway servers never draw one (the
    kernel's ephemeral range reaches 60999)."""
    from kvtier.testing import redis_server as servers

    assert servers.MAX_PORT == 55535
    assert max(servers._free_port() for _ in range(300)) <= servers.MAX_PORT
