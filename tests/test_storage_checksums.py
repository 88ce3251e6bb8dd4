"""Pages damaged in a shared store (DESIGN lesson 18): a flipped byte is caught
by `decode_page` before any row is written, a lost blob or a malformed commit
record reads as a miss (never an error that fails the batch), and putting the
page again repairs it. For FileStore, RedisStore (real ``redis-server``) and
MemoryStore; tests/test_storage_mooncake.py does the same for Mooncake.
"""

from __future__ import annotations

import importlib.util
import json
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from conftest import assert_pages_equal, needs_redis_server, page_bytes, randomize_host
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.pools import PoolGroup
from kvtier.storage import (
    BLOB_HEADER_BYTES,
    FileStore,
    PageBlobs,
    PageCorrupted,
    RedisStore,
    StorageBackend,
    StorageError,
    decode_page,
    encode_page,
    pack_rows,
    page_members,
)
from kvtier.storage.base import decode_commit
from kvtier.storage.file_store import _MAGIC, _PREFIX
from kvtier.testing.redis_server import LocalRedisServer
from kvtier.testing import MemoryStore, StoreCorruption, hybrid_group, sliding_window_group

try:
    import redis.asyncio as aioredis
except ImportError:  # FileStore and MemoryStore tests still run
    aioredis = None  # type: ignore[assignment]


# -- groups and rows ---------------------------------------------------------------




@pytest.fixture
def groups() -> tuple[PoolGroup, PoolGroup]:
    """Engine A (the writer) and engine B (the reader), holding other bytes."""
    a, b = hybrid_group(seed=1), hybrid_group(seed=2)
    randomize_host(a, 10)
    randomize_host(b, 20)
    return a, b


SRC_PAGE, DST_PAGE = 3, 9  # host page of "kv" written by A, and the one B reads into
MEMBERS = ("kv", "c4")  # the anchor and its sidecar: both blobs of a "kv" page
KEY = b"the-page-key"  # the key of the pages the wire-format tests seal and read


# -- each backend, and how to damage it behind the store's back ---------------------


def _file_header(data: bytes | bytearray) -> tuple[dict[str, int], int]:
    """A FileStore page file's blob lengths (its header's record) and where its blobs start."""
    magic, length = _PREFIX.unpack_from(data)
    assert magic == _MAGIC
    return json.loads(data[_PREFIX.size:_PREFIX.size + length])["blobs"], _PREFIX.size + length


@dataclass
class Backend:
    kind: str
    store: StorageBackend
    where: Path | str
    prefix: str = ""

    async def flip(self, key: bytes, pool: str, position: int) -> None:
        """Invert byte ``position`` of pool's stored blob (same length)."""
        if self.kind == "memory":
            assert isinstance(self.store, MemoryStore)
            self.store.corrupt(key, pool, position)
        elif self.kind == "file":
            # The page file holds its header, then the blobs one after the other, in pool-name order.
            data = bytearray(await self._file(key, "data").read_bytes())
            lengths, start = _file_header(data)
            offset = start + sum(n for name, n in lengths.items() if name < pool) + position
            data[offset] ^= 0xFF
            await self._file(key, "data").write_bytes(bytes(data))
        else:
            async with self._raw() as raw:
                name = self._redis_key(key, f"b:{pool}")
                old = await raw.getrange(name, position, position)
                assert isinstance(old, bytes) and len(old) == 1
                await raw.setrange(name, position, bytes([old[0] ^ 0xFF]))

    async def drop(self, key: bytes, pool: str) -> None:
        """Lose a data part of the page, as an eviction or a clean-up would."""
        if self.kind == "memory":
            assert isinstance(self.store, MemoryStore)
            self.store.drop_part(key, pool)
        elif self.kind == "file":
            await self._file(key, "data").unlink()  # the one data part a FileStore page has
        else:
            async with self._raw() as raw:
                assert await raw.delete(self._redis_key(key, f"b:{pool}")) == 1

    async def write_commit(self, key: bytes, record: bytes) -> None:
        """Replace the page's commit record by ``record`` (file and redis only)."""
        if self.kind == "file":  # the page file's header, its length field with it
            data = await self._file(key, "data").read_bytes()
            blobs = data[_file_header(data)[1]:]
            await self._file(key, "data").write_bytes(_PREFIX.pack(_MAGIC, len(record)) + record + blobs)
        else:
            async with self._raw() as raw:
                await raw.set(self._redis_key(key, "c"), record)

    async def swap(self, key: bytes, source: bytes) -> None:
        """Copy page ``source`` (every blob and its commit record) under ``key``,
        as a copy tool or a migration that mixed two names up would."""
        if self.kind == "memory":
            assert isinstance(self.store, MemoryStore)
            self.store.swap(key, source)
        elif self.kind == "file":  # one file: its header is the commit record
            await self._file(key, "data").write_bytes(await self._file(source, "data").read_bytes())
        else:
            async with self._raw() as raw:
                for pool in MEMBERS:
                    data = await raw.get(self._redis_key(source, f"b:{pool}"))
                    assert isinstance(data, bytes)
                    await raw.set(self._redis_key(key, f"b:{pool}"), data)
                record = await raw.get(self._redis_key(source, "c"))
                assert isinstance(record, bytes)
                await raw.set(self._redis_key(key, "c"), record)

    async def splice(self, key: bytes, pool: str, source: bytes) -> None:
        """Replace pool ``pool``'s blob of page ``key`` by page ``source``'s (one
        ``SET`` in Redis; the same bytes written over the file's part)."""
        if self.kind == "memory":
            assert isinstance(self.store, MemoryStore)
            self.store.splice(key, pool, source)
        elif self.kind == "file":
            data = bytearray(await self._file(key, "data").read_bytes())
            lengths, start = _file_header(data)
            offset = start + sum(n for name, n in lengths.items() if name < pool)
            other = await self._file(source, "data").read_bytes()
            data[offset:offset + lengths[pool]] = other[offset:offset + lengths[pool]]
            await self._file(key, "data").write_bytes(bytes(data))
        else:
            async with self._raw() as raw:
                blob = await raw.get(self._redis_key(source, f"b:{pool}"))
                assert isinstance(blob, bytes)
                await raw.set(self._redis_key(key, f"b:{pool}"), blob)

    def _file(self, key: bytes, suffix: str) -> anyio.Path:
        return anyio.Path(Path(self.where) / key.hex()[:2] / f"{key.hex()}.{suffix}")

    def _redis_key(self, key: bytes, part: str) -> str:
        return f"{self.prefix}{{{key.hex()}}}:{part}"

    def _raw(self) -> aioredis.Redis:
        return raw_client(str(self.where))


@pytest.fixture(params=["file", pytest.param("redis", marks=needs_redis_server), "memory"])
def new_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """(Sync: the Redis server fixture starts a process, off the event loop.)"""
    if request.param == "file":
        return Backend("file", FileStore(tmp_path / "store"), tmp_path / "store")
    if request.param == "memory":
        return Backend("memory", MemoryStore(), "")
    server: LocalRedisServer = request.getfixturevalue("redis_server")
    prefix = f"t{secrets.token_hex(4)}:"
    return Backend("redis", RedisStore(server.url, prefix=prefix), server.url, prefix)


@pytest.fixture
async def backend(new_backend: Backend) -> AsyncIterator[Backend]:
    yield new_backend
    await new_backend.store.aclose()


async def put_page(store: StorageBackend, group: PoolGroup, page: int) -> bytes:
    key = secrets.token_bytes(32)
    await store.put([PageBlobs(key, encode_page(group, "kv", page, key=key))])
    return key


async def read_page(store: StorageBackend, key: bytes) -> dict[str, bytes] | None:
    (blobs,) = await store.get([key], MEMBERS)
    return blobs


async def assert_repaired(b: Backend, key: bytes, a: PoolGroup, dst: PoolGroup) -> None:
    """Put the page again: it is present, and decodes byte-exact."""
    await b.store.put([PageBlobs(key, encode_page(a, "kv", SRC_PAGE, key=key))])
    assert await b.store.exists([key]) == [True]
    blobs = await read_page(b.store, key)
    assert blobs is not None
    assert blobs == {n: bytes(v) for n, v in encode_page(a, "kv", SRC_PAGE, key=key).items()}
    await anyio.to_thread.run_sync(lambda: decode_page(dst, "kv", DST_PAGE, blobs, key=key))
    assert_pages_equal(page_bytes(a, "kv", SRC_PAGE), page_bytes(dst, "kv", DST_PAGE))


# -- through every backend ---------------------------------------------------------


async def test_a_flipped_byte_anywhere_in_any_blob_is_caught_before_any_row_is_written(
    backend: Backend, groups: tuple[PoolGroup, PoolGroup]
) -> None:
    """The first, middle and last byte of the rows of the anchor's and the
    sidecar's blob: the page still looks present (same lengths), decode_page
    raises PageCorrupted naming the pool, B's host rows keep their bytes, and
    a put of the key overwrites the damaged copy."""
    a, dst = groups
    key = await put_page(backend.store, a, SRC_PAGE)
    for pool in MEMBERS:
        host, _start, count = page_members(a, "kv", SRC_PAGE)[pool]
        rows = count * host.slot_nbytes
        for position in (BLOB_HEADER_BYTES, BLOB_HEADER_BYTES + rows // 2, BLOB_HEADER_BYTES + rows - 1):
            await backend.flip(key, pool, position)
            assert await backend.store.exists([key]) == [True]  # same length: only reading tells
            blobs = await read_page(backend.store, key)
            assert blobs is not None
            stored = bytes(encode_page(a, "kv", SRC_PAGE, key=key)[pool])
            assert blobs[pool] != stored and len(blobs[pool]) == len(stored)
            before = page_bytes(dst, "kv", DST_PAGE)
            with pytest.raises(PageCorrupted, match=f"the blob of pool '{pool}' does not match its checksum") as err:
                decode_page(dst, "kv", DST_PAGE, blobs, key=key)
            assert (err.value.pool, err.value.rule, err.value.anchor, err.value.page, err.value.key) == (
                pool, "checksum", "kv", DST_PAGE, key)
            assert key.hex() in str(err.value)
            assert_pages_equal(before, page_bytes(dst, "kv", DST_PAGE))
            await assert_repaired(backend, key, a, dst)
            randomize_host(dst, position)  # other bytes again, so the next repair is seen


async def test_a_lost_data_part_is_a_miss_and_a_put_repairs_it(
    backend: Backend, groups: tuple[PoolGroup, PoolGroup]
) -> None:
    a, dst = groups
    for pool in MEMBERS:
        lost, kept = await put_page(backend.store, a, SRC_PAGE), await put_page(backend.store, a, SRC_PAGE + 1)
        await backend.drop(lost, pool)
        assert await backend.store.exists([lost, kept]) == [False, True]
        got = await backend.store.get([lost, kept], MEMBERS)
        assert got[0] is None
        assert got[1] == {n: bytes(v) for n, v in encode_page(a, "kv", SRC_PAGE + 1, key=kept).items()}
        await assert_repaired(backend, lost, a, dst)


async def test_a_page_copied_under_another_key_is_refused_by_its_key_and_a_put_repairs_it(
    backend: Backend, groups: tuple[PoolGroup, PoolGroup]
) -> None:
    """Key swap: page ``other`` (another prefix's, well-formed, its own
    checksums intact) is stored under ``key``. The store sees a present page
    of the right lengths; decode_page refuses it (rule "key", the first blob it
    checks) before writing any row, and a put of ``key`` repairs it."""
    a, dst = groups
    key, other = await put_page(backend.store, a, SRC_PAGE), await put_page(backend.store, a, SRC_PAGE + 1)
    await backend.swap(key, other)
    assert await backend.store.exists([key, other]) == [True, True]
    blobs = await read_page(backend.store, key)
    assert blobs == {n: bytes(v) for n, v in encode_page(a, "kv", SRC_PAGE + 1, key=other).items()}
    before = page_bytes(dst, "kv", DST_PAGE)
    with pytest.raises(PageCorrupted, match=r"the blob of pool '(kv|c4)' was written under another page key") as err:
        decode_page(dst, "kv", DST_PAGE, blobs, key=key)
    assert (err.value.rule, err.value.key, err.value.anchor, err.value.page) == ("key", key, "kv", DST_PAGE)
    assert_pages_equal(before, page_bytes(dst, "kv", DST_PAGE))
    decode_page(dst, "kv", DST_PAGE, blobs, key=other)  # under its own key the same bytes are fine
    assert_pages_equal(page_bytes(a, "kv", SRC_PAGE + 1), page_bytes(dst, "kv", DST_PAGE))
    randomize_host(dst, 77)
    await assert_repaired(backend, key, a, dst)


@pytest.mark.parametrize("pool", MEMBERS)
async def test_another_pages_blob_spliced_into_a_page_is_refused_and_a_put_repairs_it(
    backend: Backend, groups: tuple[PoolGroup, PoolGroup], pool: str
) -> None:
    """Blob splice: one blob of page ``key`` replaced by the same pool's blob of
    page ``other`` (same length, a valid blob of its own). decode_page names
    that pool and rule "key", writes no row of the page (the other blob is
    good), and a put repairs it."""
    a, dst = groups
    key, other = await put_page(backend.store, a, SRC_PAGE), await put_page(backend.store, a, SRC_PAGE + 2)
    await backend.splice(key, pool, other)
    assert await backend.store.exists([key]) == [True]
    blobs = await read_page(backend.store, key)
    assert blobs is not None
    good = {n: bytes(v) for n, v in encode_page(a, "kv", SRC_PAGE, key=key).items()}
    assert blobs[pool] == bytes(encode_page(a, "kv", SRC_PAGE + 2, key=other)[pool]) != good[pool]
    assert all(blobs[n] == good[n] for n in MEMBERS if n != pool)
    before = page_bytes(dst, "kv", DST_PAGE)
    with pytest.raises(PageCorrupted, match=rf"the blob of pool '{pool}' was written under another page key") as err:
        decode_page(dst, "kv", DST_PAGE, blobs, key=key)
    assert (err.value.pool, err.value.rule, err.value.key) == (pool, "key", key)
    assert key.hex() in str(err.value)
    assert_pages_equal(before, page_bytes(dst, "kv", DST_PAGE))
    await assert_repaired(backend, key, a, dst)


def test_the_key_is_covered_by_the_checksum_not_only_by_its_tag(groups: tuple[PoolGroup, PoolGroup]) -> None:
    """A blob whose key tag was rewritten to the reader's key (a 64-bit tag
    forged, or a tag collision) still fails: the checksum hashed the writer's key."""
    a, dst = groups
    other, key = b"writer-key", b"reader-key"
    blobs = {n: bytearray(v) for n, v in encode_page(a, "kv", SRC_PAGE, key=other).items()}
    tag = encode_page(a, "kv", SRC_PAGE, key=key)["kv"][24:32]
    for blob in blobs.values():
        blob[24:32] = tag
    before = page_bytes(dst, "kv", DST_PAGE)
    with pytest.raises(PageCorrupted, match="does not match its checksum") as err:
        decode_page(dst, "kv", DST_PAGE, blobs, key=key)
    assert err.value.rule == "checksum"
    assert_pages_equal(before, page_bytes(dst, "kv", DST_PAGE))


def test_a_page_of_format_version_1_is_refused_by_its_version(groups: tuple[PoolGroup, PoolGroup]) -> None:
    """What kvtier stored before this format (header of 32 bytes, SHA-1/64 over
    header and rows, no key): refused by version, before any other check."""
    import hashlib
    import struct

    a, dst = groups
    old = {}
    for name, (host, start, count) in page_members(a, "kv", SRC_PAGE).items():
        rows = bytes(pack_rows(host, start, count))
        tag = bytes(encode_page(a, "kv", SRC_PAGE, key=KEY)[name][16:24])
        header = struct.pack("<4sB3sQ8s", b"KVTB", 1, bytes(3), len(rows), tag)
        old[name] = header + hashlib.sha1(header + rows).digest()[:8] + rows
    before = page_bytes(dst, "kv", DST_PAGE)
    with pytest.raises(PageCorrupted, match=r"has blob format version 1; this kvtier reads version 3 "
                                            r"\(an older kvtier's page: a miss") as err:
        decode_page(dst, "kv", DST_PAGE, old, key=KEY)
    assert err.value.rule == "version"
    assert_pages_equal(before, page_bytes(dst, "kv", DST_PAGE))


BAD_RECORDS = [
    b"",
    b"not json",
    b"\xff\xfe\x00",  # not UTF-8
    b"[1, 2]",
    b'{"v": 1}',  # no blobs
    b'{"v": 1, "blobs": {}}',
    b'{"v": 2, "blobs": {"kv": 4136, "c4": 296}}',  # another version
    b'{"v": 1, "blobs": {"kv": "4136", "c4": 296}}',  # a length that is not an integer
    b'{"v": 1, "blobs": {"kv": -1, "c4": 296}}',
    b'{"v": 1, "blobs": {"kv": true, "c4": 296}}',
    b'{"v": 1, "blobs": {"": 4136}}',
    b'{"v": 1, "blobs": {"kv": 4135, "c4": 296}}',  # well-formed, but not the stored length
]
MISSING_BLOB = b'{"v": 1, "blobs": {"kv": 4136, "c4": 296, "swa": 10}}'
"""Well-formed, but names a blob that is not there: the page is not present
(exists checks every blob named), and a get that asks for it is a miss (a get
checks the blobs it returns)."""


async def test_a_malformed_or_foreign_commit_record_is_a_miss_not_an_error(
    backend: Backend, groups: tuple[PoolGroup, PoolGroup]
) -> None:
    """The damaged page is a miss (exists False, get None); the other pages of
    the same batch are answered as usual; a put repairs it."""
    a, dst = groups
    records: list[bytes | None] = [None] if backend.kind == "memory" else [*BAD_RECORDS, MISSING_BLOB]
    for record in records:
        pools = (*MEMBERS, "swa") if record == MISSING_BLOB else MEMBERS
        bad, good = await put_page(backend.store, a, SRC_PAGE), await put_page(backend.store, a, SRC_PAGE + 1)
        if record is None:
            assert isinstance(backend.store, MemoryStore)
            backend.store.malform(bad)
        else:
            await backend.write_commit(bad, record)
        assert await backend.store.exists([good, bad, good]) == [True, False, True], record
        assert (await backend.store.get([good], MEMBERS))[0] is not None
        assert await backend.store.get([bad, bad], pools) == [None, None], record
        if record != MISSING_BLOB:
            assert await backend.store.get([bad], ["kv"]) == [None]
        await assert_repaired(backend, bad, a, dst)


def test_a_commit_record_decodes_alike_every_time_and_each_caller_gets_its_own_lengths() -> None:
    """Records are decoded once and remembered (every page of a pool has the same
    one): each caller still gets a dict of its own, and a bad record stays a miss
    however often it comes, from bytes or any other buffer."""
    record = b'{"v":1,"blobs":{"c4":296,"kv":4136}}'
    first = decode_commit(record)
    assert first == {"c4": 296, "kv": 4136}
    first["kv"] = 0  # a caller that changes its answer changes nobody else's
    assert decode_commit(bytearray(record)) == decode_commit(memoryview(record)) == {"c4": 296, "kv": 4136}
    for bad in [*BAD_RECORDS[:-1], b'{"v": 1, "blobs": {"1": 5, "": 2}}']:
        assert decode_commit(bad) is None and decode_commit(bad) is None, bad


def raw_client(url: str) -> aioredis.Redis:
    """A plain redis-py client, for looking behind the store's back (no CLIENT
    SETINFO, so redis-py >= 7 reads no package metadata on the event loop)."""
    if importlib.util.find_spec("redis.driver_info") is None:
        return aioredis.Redis.from_url(url)
    return aioredis.Redis.from_url(url, driver_info=None)


@needs_redis_server
async def test_redis_keys_of_another_type_are_misses(redis_server: LocalRedisServer) -> None:
    """Foreign data under our names (a list for a commit record, a hash for a
    blob: WRONGTYPE replies) is a miss for that page, not a failed batch."""
    a = hybrid_group(seed=1)
    prefix = f"t{secrets.token_hex(4)}:"
    async with RedisStore(redis_server.url, prefix=prefix) as rs:
        keys = [secrets.token_bytes(32) for _ in range(3)]
        await rs.put([PageBlobs(k, encode_page(a, "kv", p, key=k)) for k, p in zip(keys, (1, 2, 3))])
        raw = raw_client(redis_server.url)
        try:
            await raw.delete(f"{prefix}{{{keys[0].hex()}}}:c")
            await raw.rpush(f"{prefix}{{{keys[0].hex()}}}:c", b"x")
            await raw.delete(f"{prefix}{{{keys[1].hex()}}}:b:c4")
            await raw.hset(f"{prefix}{{{keys[1].hex()}}}:b:c4", "f", "v")
        finally:
            await raw.aclose()
        assert await rs.exists(keys) == [False, False, True]
        got = await rs.get(keys, MEMBERS)
        assert [g is not None for g in got] == [False, False, True]
        await rs.put([PageBlobs(k, encode_page(a, "kv", p, key=k)) for k, p in zip(keys, (1, 2, 3))])
        assert await rs.exists(keys) == [True, True, True]


@needs_redis_server
async def test_redis_exists_asks_the_blobs_a_record_names_beyond_the_last_lookups(
    redis_server: LocalRedisServer,
) -> None:
    """exists guesses the blob names from the last lookup; pages of another
    anchor (other pools) are still checked blob by blob."""
    a = hybrid_group(seed=1)
    prefix = f"t{secrets.token_hex(4)}:"
    async with RedisStore(redis_server.url, prefix=prefix) as rs:
        kv, swa = secrets.token_bytes(32), secrets.token_bytes(32)
        await rs.put([PageBlobs(kv, encode_page(a, "kv", 1, key=kv)), PageBlobs(swa, encode_page(a, "swa", 1, key=swa))])
        assert await rs.exists([kv]) == [True]  # now guesses kv and c4
        raw = raw_client(redis_server.url)
        try:
            await raw.delete(f"{prefix}{{{swa.hex()}}}:b:swa_state")
        finally:
            await raw.aclose()
        assert await rs.exists([kv, swa]) == [True, False]
        assert await rs.exists([swa, kv]) == [False, True]


# -- the wire format itself ----------------------------------------------------------


def test_a_blob_in_the_format_before_checksums_is_refused(groups: tuple[PoolGroup, PoolGroup]) -> None:
    """Raw rows without a header (what kvtier stored before blobs had one)."""
    a, dst = groups
    old = {n: bytes(pack_rows(h, s, c)) for n, (h, s, c) in page_members(a, "kv", SRC_PAGE).items()}
    before = page_bytes(dst, "kv", DST_PAGE)
    with pytest.raises(PageCorrupted, match=r"the blob of pool '(kv|c4)' does not start with kvtier's blob header "
                                            r"b'KVTB'.*written before blobs carried checksums") as err:
        decode_page(dst, "kv", DST_PAGE, old, key=KEY)
    assert err.value.rule == "header"
    assert_pages_equal(before, page_bytes(dst, "kv", DST_PAGE))


def test_a_blob_of_another_pool_is_refused(groups: tuple[PoolGroup, PoolGroup]) -> None:
    a, dst = groups
    blobs = encode_page(a, "kv", SRC_PAGE, key=KEY)
    before = page_bytes(dst, "kv", DST_PAGE)
    with pytest.raises(PageCorrupted, match=r"the blob of pool 'kv' holds the rows of pool 'c4' \(tag ") as err:
        decode_page(dst, "kv", DST_PAGE, {"kv": blobs["c4"], "c4": blobs["kv"]}, key=KEY)
    assert (err.value.pool, err.value.rule) == ("kv", "pool")
    assert_pages_equal(before, page_bytes(dst, "kv", DST_PAGE))
    # A page of another anchor, of the same length: in a sliding-window model
    # "kv" and "swa" pages have the same shape, but not the same rows.
    sw_a, sw_b = sliding_window_group(seed=1), sliding_window_group(seed=2)
    swa = encode_page(sw_a, "swa", 1, key=KEY)
    assert len(swa["swa"]) == len(encode_page(sw_a, "kv", 1, key=KEY)["kv"])
    before = page_bytes(sw_b, "kv", 2)
    # Another anchor's page is another page identity (its pool records differ).
    with pytest.raises(PageCorrupted, match=r"the blob of pool 'kv' was written under another page identity") as err:
        decode_page(sw_b, "kv", 2, {"kv": swa["swa"]}, key=KEY)
    assert (err.value.pool, err.value.rule) == ("kv", "identity")
    assert_pages_equal(before, page_bytes(sw_b, "kv", 2))


def test_each_header_field_has_its_rule(groups: tuple[PoolGroup, PoolGroup]) -> None:
    a, dst = groups
    blobs = {n: bytes(v) for n, v in encode_page(a, "kv", SRC_PAGE, key=KEY).items()}

    def with_byte(pool: str, position: int, value: int) -> dict[str, bytes]:
        blob = bytearray(blobs[pool])
        blob[position] = value
        return {**blobs, pool: bytes(blob)}

    cases = [
        (with_byte("c4", 0, ord("k")), "header", r"does not start with kvtier's blob header"),
        (with_byte("c4", 4, 1), "version", r"has blob format version 1; this kvtier reads version 3 \(an older kvtier's page"),
        (with_byte("c4", 4, 2), "version", r"has blob format version 2; this kvtier reads version 3 \(an older kvtier's page"),
        (with_byte("c4", 4, 4), "version", r"has blob format version 4; this kvtier reads version 3$"),
        (with_byte("c4", 17, blobs["c4"][17] ^ 1), "identity", r"was written under another page identity"),
        (with_byte("c4", 6, 1), "header", r"reserved header bytes b'\\x00\\x01\\x00'; they must be zero"),
        (with_byte("c4", 9, 0), "length", r"its header says 0 and it holds 256"),
        (with_byte("c4", 33, blobs["c4"][33] ^ 1), "checksum", r"does not match its checksum"),
        (with_byte("c4", 25, blobs["c4"][25] ^ 1), "key", r"was written under another page key"),
        ({**blobs, "c4": blobs["c4"][:3]}, "header", r"\(got .*, 3 bytes\)"),
        ({**blobs, "c4": blobs["c4"][:20]}, "header", r"is 20 bytes, shorter than kvtier's 40-byte blob header"),
        ({**blobs, "c4": blobs["c4"] + b"\0"}, "length", r"its header says 256 and it holds 257"),
    ]
    before = page_bytes(dst, "kv", DST_PAGE)
    for bad, rule, message in cases:
        with pytest.raises(PageCorrupted, match=message) as err:
            decode_page(dst, "kv", DST_PAGE, bad, key=KEY)
        assert (err.value.pool, err.value.rule) == ("c4", rule)
    assert_pages_equal(before, page_bytes(dst, "kv", DST_PAGE))
    decode_page(dst, "kv", DST_PAGE, blobs, key=KEY)  # the undamaged page decodes
    assert_pages_equal(page_bytes(a, "kv", SRC_PAGE), page_bytes(dst, "kv", DST_PAGE))


_A = hybrid_group(seed=1)
randomize_host(_A, 30)
_BLOBS = {n: bytes(v) for n, v in encode_page(_A, "tok", 2, key=KEY).items()}  # one small blob: "idx"
_KV = {n: bytes(v) for n, v in encode_page(_A, "swa", 2, key=KEY).items()}


@given(data=st.data(), xor=st.integers(1, 255))
@settings(max_examples=300, deadline=None)
def test_any_single_byte_change_anywhere_is_caught(data: st.DataObject, xor: int) -> None:
    page = data.draw(st.sampled_from([("tok", _BLOBS), ("swa", _KV)]))
    anchor, blobs = page
    pool = data.draw(st.sampled_from(sorted(blobs)))
    position = data.draw(st.integers(0, len(blobs[pool]) - 1))
    blob = bytearray(blobs[pool])
    blob[position] ^= xor
    dst = hybrid_group(seed=3)
    before = page_bytes(dst, anchor, 5)
    with pytest.raises(PageCorrupted) as err:
        decode_page(dst, anchor, 5, {**blobs, pool: bytes(blob)}, key=KEY)
    assert err.value.pool == pool
    assert_pages_equal(before, page_bytes(dst, anchor, 5))


# -- MemoryStore's damage, by hand and drawn --------------------------------------------


async def test_memory_store_damage_is_recorded_and_validated() -> None:
    a = hybrid_group(seed=1)
    store = MemoryStore()
    key = await put_page(store, a, 1)
    n = len(store.pages[key]["c4"])
    assert store.corrupt(key, "c4", n - 1) == StoreCorruption(key, "flip", "c4", n - 1, drawn=False)
    assert store.drop_part(key, "kv") == StoreCorruption(key, "drop", "kv", None, drawn=False)
    assert store.malform(key) == StoreCorruption(key, "malform", None, None, drawn=False)
    assert [c.kind for c in store.corruptions] == ["flip", "drop", "malform"]
    assert "3 pages damaged" in repr(store)
    with pytest.raises(ValueError, match=r"position must be an integer in 0..295, within the 296-byte blob "
                                         r"of pool 'c4' of page .*; got 296"):
        store.corrupt(key, "c4", n)
    with pytest.raises(ValueError, match=r"got -1"):
        store.corrupt(key, "c4", -1)
    with pytest.raises(ValueError, match=r"has no blob for pool 'kv' \(it has \['c4'\]\)"):
        store.corrupt(key, "kv", 0)  # dropped
    with pytest.raises(ValueError, match=r"holds no page 6b"):
        store.drop_part(b"k", "kv")
    with pytest.raises(ValueError, match=r"holds no page 6b"):
        store.malform(b"k")
    for bad in (-0.1, 1.5, True):
        with pytest.raises(ValueError, match=r"corrupt_probability must be in \[0, 1\]; got"):
            MemoryStore(corrupt_probability=bad)
    assert await store.exists([key]) == [False]
    # An entry of ``pages`` replaced directly (as some tests do) is undamaged.
    store.pages[key] = {n: bytes(v) for n, v in encode_page(a, "kv", 1, key=key).items()}
    assert await store.exists([key]) == [True]


async def _soak_puts(store: MemoryStore, group: PoolGroup, rounds: int) -> list[bytes]:
    keys = [bytes([i]) * 32 for i in range(40)]
    for _ in range(rounds):
        await store.put([PageBlobs(k, encode_page(group, "kv", i % 16, key=k)) for i, k in enumerate(keys)])
    return keys


async def test_drawn_damage_is_seeded_and_each_kind_is_seen_as_a_real_store_shows_it() -> None:
    a = hybrid_group(seed=1)
    runs = []
    for _ in range(2):
        store = MemoryStore(corrupt_probability=0.5, seed=7)
        keys = await _soak_puts(store, a, 1)
        runs.append((store.corruptions, {k: dict(v) for k, v in store.pages.items()}))
    assert runs[0] == runs[1]  # the same puts damage the same pages the same way
    corruptions = runs[0][0]
    assert {c.kind for c in corruptions} == {"flip", "drop", "malform"}
    assert all(c.drawn for c in corruptions)
    assert len({c.key for c in corruptions}) == len(corruptions)  # at most one fault per put of a page
    damaged = {c.key: c for c in corruptions}
    present = await store.exists(keys)
    got = await store.get(keys, MEMBERS)
    for i, (k, here, blobs) in enumerate(zip(keys, present, got)):
        fault = damaged.get(k)
        if fault is None or fault.kind == "flip":
            assert here and blobs is not None
            dst = hybrid_group(seed=2)
            if fault is None:
                decode_page(dst, "kv", 0, blobs, key=k)
                assert_pages_equal(page_bytes(a, "kv", i % 16), page_bytes(dst, "kv", 0))
            else:
                with pytest.raises(PageCorrupted) as err:
                    decode_page(dst, "kv", 0, blobs, key=k)
                assert err.value.pool == fault.pool
        else:
            assert not here and blobs is None
    # Another seed damages other pages.
    other = MemoryStore(corrupt_probability=0.5, seed=8)
    await _soak_puts(other, a, 1)
    assert other.corruptions != corruptions
    # Putting again replaces the damaged copies and draws anew: a page damaged
    # before and not this time is whole again, byte-exact.
    await _soak_puts(store, a, 1)
    assert store.corruptions[: len(corruptions)] == corruptions
    again = {c.key for c in store.corruptions[len(corruptions):]}
    repaired = [i for i, k in enumerate(keys) if k in damaged and k not in again]
    assert repaired
    present = await store.exists([keys[i] for i in repaired])
    assert present == [True] * len(repaired)
    for i, blobs in zip(repaired, await store.get([keys[i] for i in repaired], MEMBERS)):
        assert blobs == {n: bytes(v) for n, v in encode_page(a, "kv", i % 16, key=keys[i]).items()}


async def test_damage_draws_leave_the_fault_draws_and_the_default_store_as_they_were() -> None:
    """corrupt_probability draws from a stream of its own: a store with it
    fails the same calls the same way as one without; and the default store
    damages nothing."""
    a = hybrid_group(seed=1)
    plain = MemoryStore(fail_probability=0.5, seed=5)
    damaging = MemoryStore(fail_probability=0.5, seed=5, corrupt_probability=0.3)
    for store in (plain, damaging):
        for _ in range(6):
            try:
                await _soak_puts(store, a, 1)
            except StorageError:
                pass  # injected; compared below
    assert len(plain.faults) >= 2
    assert [(f.operation, f.keys, f.published, type(f.error)) for f in plain.faults] == [
        (f.operation, f.keys, f.published, type(f.error)) for f in damaging.faults]
    assert sorted(plain.pages) == sorted(damaging.pages)
    assert plain.corruptions == [] and damaging.corruptions
    assert repr(plain) == f"<MemoryStore [{len(plain.pages)} pages, {len(plain.faults)} faults]>"
    keys = sorted(plain.pages)
    assert await plain.exists(keys) == [True] * len(keys)


# -- importing kvtier ------------------------------------------------------------------


def test_importing_kvtier_imports_neither_redis_nor_mooncake() -> None:
    code = (
        "import sys, kvtier, kvtier.storage, kvtier.testing\n"
        "assert not [m for m in sys.modules if m == 'redis' or m.startswith(('redis.', 'mooncake'))], "
        "sorted(m for m in sys.modules if 'redis' in m)\n"
        "from kvtier.storage import RedisStore, MooncakeStore\n"
        "assert RedisStore.__module__ == 'kvtier.storage.redis_store', RedisStore\n"
        "assert MooncakeStore.__module__ == 'kvtier.storage.mooncake_store', MooncakeStore\n"
        "import kvtier.storage as s\n"
        "assert set(s.__all__) <= set(dir(s))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
