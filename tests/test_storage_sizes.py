"""Pages of every size in every backend: 0 bytes, 1 byte, large, and the largest.

SGLang's DeepSeek V4 anchor is a pool whose pages hold no bytes, and SGLang
stops a prefix at the first page it does not get back, so an empty page must
be stored, found and read back like any other, sealed and checked. Each test
runs over `FileStore`, `RedisStore`, `RedisStore` on a Redis Cluster and
`MooncakeStore` (real servers; each skips, saying why, where its server or
client is missing). Beyond a backend's bound a put is refused with an error
naming the size and the bound, before anything is sent.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

from conftest import needs_redis_server
from kvtier.errors import ConfigurationError
from kvtier.pools import DevicePool, PoolGroup
from kvtier.storage import (
    SEAL_HEADER_BYTES,
    EngineNamespace,
    FileStore,
    PageBlobs,
    RedisStore,
    SealedPageStore,
    StorageBackend,
    StorageError,
    seal,
)
from kvtier.testing.redis_server import LocalRedisCluster, LocalRedisServer

BACKENDS = ["file", pytest.param("redis", marks=needs_redis_server),
            pytest.param("redis-cluster", marks=needs_redis_server), "mooncake"]
LARGE = (4 << 20) + 3  # over RedisStore's 2 MiB pipeline: a page that goes alone


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A mooncake_master (skips as tests/test_storage_mooncake.py does where it cannot run)."""
    from test_storage_mooncake import Master  # skips the test where mooncake does not import

    master = Master(tmp_path_factory.mktemp("mooncake"))
    yield master.addrs
    master.stop()


@pytest.fixture(params=BACKENDS)
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., StorageBackend]:
    """A way to open a fresh store of each backend (keyword arguments go to its constructor)."""
    prefix = f"t{secrets.token_hex(4)}"
    if request.param == "file":
        return lambda **kw: FileStore(tmp_path / "store", **kw)
    if request.param == "redis":
        server: LocalRedisServer = request.getfixturevalue("redis_server")
        return lambda **kw: RedisStore(server.url, prefix=f"{prefix}:", **kw)
    if request.param == "redis-cluster":
        cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
        return lambda **kw: RedisStore(cluster.url, cluster=True, prefix=f"{prefix}:", **kw)
    from kvtier.storage.mooncake_store import MooncakeStore

    master = request.getfixturevalue("mooncake_master")
    return lambda **kw: MooncakeStore(*master, prefix=f"{prefix}/", **{
        "global_segment_size": 64 << 20, "local_buffer_size": 32 << 20, **kw})


@pytest.fixture
async def store(open_store: Callable[..., StorageBackend]) -> AsyncIterator[StorageBackend]:
    s = open_store()
    yield s
    await s.aclose()


def _bytes(n: int, seed: int) -> bytes:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


async def test_raw_blobs_of_0_1_and_many_bytes_round_trip(store: StorageBackend) -> None:
    """Pages whose blobs are 0 bytes (alone or beside others), 1 byte and
    large: found by exists, read back byte-exact, and each page whole."""
    shapes = [{"anchor": 0}, {"anchor": 0, "c4": 1}, {"kv": 1}, {"kv": LARGE, "c4": 0}, {"a": 0, "b": 0, "c": 7}]
    pages = [PageBlobs(secrets.token_bytes(32), {n: _bytes(k, i) for n, k in s.items()}) for i, s in enumerate(shapes)]
    await store.put(pages)
    missing = secrets.token_bytes(32)
    keys = [p.key for p in pages]
    assert await store.exists([*keys, missing]) == [True] * len(pages) + [False]
    for page in pages:
        (got,) = await store.get([page.key], list(page.blobs))
        assert got == {n: bytes(b) for n, b in page.blobs.items()}
        assert all(type(b) is bytes for b in got.values())
    # A pool the commit record does not name is a miss, empty pools included.
    assert await store.get([pages[0].key, missing], ["anchor", "c4"]) == [None, None]


async def test_exists_and_get_agree_on_empty_blobs_and_lost_ones(store: StorageBackend) -> None:
    """An empty blob is whole by its commit record alone (Redis answers
    STRLEN 0 and Mooncake reads b"" for a missing key, and Mooncake stores no
    empty object): exists and get agree that the page is there, before and
    after its empty blob's key is gone. A lost blob with bytes is a miss in both."""
    page = PageBlobs(secrets.token_bytes(32), {"anchor": b"", "c4": b"xyz"})
    await store.put([page])
    whole = [{"anchor": b"", "c4": b"xyz"}]
    assert (await store.exists([page.key]), await store.get([page.key], ["anchor", "c4"])) == ([True], whole)
    if isinstance(store, RedisStore):
        await store.client.delete(_redis_blob(store, page.key, "anchor"))  # as an eviction would
        assert (await store.exists([page.key]), await store.get([page.key], ["anchor", "c4"])) == ([True], whole)
    await _lose_blob(store, page.key, "c4")
    assert (await store.exists([page.key]), await store.get([page.key], ["anchor", "c4"])) == ([False], [None])


def _redis_blob(store: RedisStore, key: bytes, pool: str) -> str:
    return f"{store.prefix.decode()}{{{key.hex()}}}:b:{pool}"


async def _lose_blob(store: StorageBackend, key: bytes, pool: str) -> None:
    """Remove one blob behind the store's back, as an eviction would."""
    if isinstance(store, FileStore):  # one data file holds every blob
        await anyio.Path(store.directory / key.hex()[:2] / f"{key.hex()}.data").unlink()
    elif isinstance(store, RedisStore):
        assert await store.client.delete(_redis_blob(store, key, pool)) == 1
    else:
        name = f"{store.prefix}{key.hex()}/b/{pool}"  # type: ignore[attr-defined]
        client: Any = store._store  # type: ignore[attr-defined]
        assert await anyio.to_thread.run_sync(lambda: client.remove(name, True)) == 0  # force: a read leases it


NS = EngineNamespace(engine="test", model="m", page_size=4, dtype="uint8", layout="page_first")


@pytest.mark.parametrize("nbytes", [0, 1, LARGE])
def test_sealed_pages_of_0_1_and_many_bytes_round_trip_and_damage_is_a_miss(
    open_store: Callable[..., StorageBackend], nbytes: int
) -> None:
    """Through `SealedPageStore` (SGLang's face on a store): the payload comes
    back as it was put, an empty one as an empty view; a copy of it that
    was flipped, truncated or moved in under another key is a miss."""
    with SealedPageStore(open_store, NS, timeout_s=30) as sealed:
        payload = _bytes(nbytes, 5)
        assert sealed.put([("page", payload), ("other", payload)]) == [True, True]
        assert sealed.exists(["page"]) == [True]
        (got,) = sealed.get(["page"], nbytes=nbytes)
        assert got is not None and bytes(got) == payload and len(got) == nbytes
        key = NS.key("page")
        blob = bytes(seal(key, payload, tag=sealed.pool_tag("kv")))
        assert len(blob) == SEAL_HEADER_BYTES + nbytes
        flipped = bytearray(blob)
        flipped[-1] ^= 0x01  # the last byte: the header's checksum for an empty page
        moved = bytes(seal(NS.key("other"), payload, tag=sealed.pool_tag("kv")))
        for damaged, rule in ((bytes(flipped), "checksum"), (blob[:-1], "header" if not nbytes else "length"),
                              (moved, "checksum")):
            _put_raw(sealed, key, damaged)
            assert sealed.exists(["page"]) == [True]
            assert sealed.get(["page"]) == [None], rule
        assert sealed.statistics().broken == {"checksum": 2, "header" if not nbytes else "length": 1}
        assert sealed.put([("page", payload)]) == [True]  # a put repairs it
        (got,) = sealed.get(["page"])
        assert got is not None and bytes(got) == payload


def _put_raw(sealed: SealedPageStore, key: bytes, blob: bytes) -> None:
    """Store ``blob`` under ``key`` as it is: bytes the store changed behind kvtier's back."""

    async def put() -> None:
        await sealed.store.put([PageBlobs(key, {"kv": blob})])

    # On the store's own loop thread: redis-py's client is bound to that loop.
    asyncio.run_coroutine_threadsafe(put(), sealed._loop).result(30)


# -- the largest page -------------------------------------------------------------


@needs_redis_server
async def test_redis_refuses_a_blob_over_its_bulk_bound_naming_both(fresh_server: Callable[..., LocalRedisServer]) -> None:
    """Redis refuses a value over proto-max-bulk-len (512 MiB unless set): a
    blob of exactly the bound round-trips; one byte more is refused by kvtier
    before anything is sent, naming the size and the bound."""
    server = await anyio.to_thread.run_sync(fresh_server)
    await anyio.to_thread.run_sync(lambda: server.command("CONFIG", "SET", "proto-max-bulk-len", str(1 << 20)))
    at, over = PageBlobs(b"at-the-bound", {"kv": _bytes(1 << 20, 1)}), PageBlobs(b"over", {"kv": _bytes((1 << 20) + 1, 2)})
    async with RedisStore(server.url, max_value_bytes=1 << 20) as rs:
        await rs.put([at])
        assert await rs.get([at.key], ["kv"]) == [{"kv": at.blobs["kv"]}]
        with pytest.raises(StorageError, match=r"blob of pool 'kv' of page 6f766572 is 1048577 bytes; this redis "
                                               r"store takes values up to max_value_bytes=1048576") as err:
            await rs.put([at, over])
        assert err.value.operation == "put"
        assert await rs.exists([over.key]) == [False]
    with pytest.raises(ConfigurationError, match="RedisStore max_value_bytes must be a positive integer; got 0"):
        RedisStore(server.url, max_value_bytes=0)


async def test_mooncake_refuses_a_blob_over_its_buffer_and_splits_batches_to_fit(
    mooncake_master: tuple[str, str],
) -> None:
    """Mooncake copies every value of a batch call through the client's local
    buffer: a blob of exactly its size round-trips, one byte more is refused
    naming both, and a batch larger than the buffer is cut into calls that fit
    (in one call, every value after the buffer filled was lost: a miss)."""
    from kvtier.storage.mooncake_store import MooncakeStore

    bound = 4 << 20
    async with MooncakeStore(*mooncake_master, prefix=f"t{secrets.token_hex(4)}/", global_segment_size=64 << 20,
                             local_buffer_size=bound) as ms:
        at = PageBlobs(b"at-the-bound", {"kv": _bytes(bound, 1)})
        many = [PageBlobs(secrets.token_bytes(32), {"kv": _bytes(1 << 20, i), "c4": _bytes(7, i)}) for i in range(10)]
        await ms.put([at, *many])
        keys = [at.key, *(p.key for p in many)]
        assert await ms.exists(keys) == [True] * 11
        got = await ms.get(keys, ["kv"])
        assert got == [{"kv": bytes(p.blobs["kv"])} for p in [at, *many]]
        over = PageBlobs(b"over", {"kv": _bytes(bound + 1, 2)})
        with pytest.raises(StorageError, match=r"blob of pool 'kv' of page 6f766572 is 4194305 bytes; this mooncake "
                                               r"store takes values up to local_buffer_size=4194304"):
            await ms.put([over])
        assert await ms.exists([over.key]) == [False]
    with pytest.raises(ConfigurationError, match="MooncakeStore local_buffer_size must be a positive integer of "
                                                 "bytes; got 0"):
        MooncakeStore(*mooncake_master, local_buffer_size=0)


# -- pools without bytes ---------------------------------------------------------------


def test_a_device_pool_whose_rows_hold_no_bytes_is_refused_naming_it() -> None:
    """A pool of 0-byte rows is an anchor without bytes: a logical pool
    (`PoolGroup.add_logical_pool`). As a pool of bytes every copy and every
    page of it would divide by its row size."""
    with pytest.raises(ConfigurationError, match=r"DevicePool layer 0 plane 0 of shape \(16, 0\) holds 0 bytes per "
                                                 r"slot; a pool without bytes is a logical pool"):
        DevicePool([torch.zeros(16, 0)])
    group = PoolGroup()
    with pytest.raises(ConfigurationError, match="holds 0 bytes per slot"):
        group.add_pool("empty", device=DevicePool([[torch.zeros(16, 2), torch.zeros(16, 2, 0)]]), page_size=4,
                       host_slots=16)
    assert "empty" not in group


def test_file_store_on_a_regular_file_is_refused_at_construction(tmp_path: Path) -> None:
    path = tmp_path / "a-file"
    path.write_bytes(b"not a directory")
    with pytest.raises(ConfigurationError, match=re.escape(f"FileStore directory {str(path)!r} is a file, not a directory;")):
        FileStore(path)
    with pytest.raises(ConfigurationError, match=re.escape(f"cannot be created: {str(path)!r} is a file, not a directory")):
        FileStore(path / "below")
    assert os.path.isfile(path)
