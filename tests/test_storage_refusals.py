"""What a stored or verified page refuses, tested by behaviour (issue 30, point 6).

Each test here is written against a class of bug that once slipped through the
suite: a checksum that covers only part of the header or leaves the key out, a
relaxed length check in `decode_page`, verify's page loop stopping early, and
the rest of a prefetch delivered after a refused page. None reads the code it
guards: they forge, cut and flip bytes as a faulty store or copy tool would,
and compare what lands with the rows that were stored.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

import anyio
import pytest
import torch
import xxhash
from conftest import assert_pages_equal, page_bytes, randomize_host, used

from kvtier import CorruptionDetected, SchedulerConfig, TransferScheduler
from kvtier.errors import ConfigurationError
from kvtier.pools import HostPool, PoolGroup
from kvtier.storage import (
    BLOB_HEADER_BYTES,
    FileStore,
    KeyNamespace,
    PageBlobs,
    PageCorrupted,
    PageIdentity,
    StorageBackend,
    decode_page,
    encode_page,
    page_keys,
)
from kvtier.storage.base import check_blob_lengths
from kvtier.testing import device_rows, hybrid_group

KEY = b"page-key"
SRC, DST = 3, 9  # host pages written from and decoded into


@pytest.fixture
def groups() -> tuple[PoolGroup, PoolGroup]:
    a, b = hybrid_group(seed=1), hybrid_group(seed=2)
    randomize_host(a, 11)
    randomize_host(b, 12)
    return a, b


def reseal(blob: bytes | bytearray, key: bytes, *, length: int | None = None, rows: bytes | None = None) -> bytes:
    """A blob with its header's length and rows replaced and its checksum made
    valid again, as the format defines it (xxh3-64 over header bytes 0..31, the
    key, then the rows): what a writer with a bug would store."""
    body = bytes(blob[BLOB_HEADER_BYTES:]) if rows is None else rows
    header = bytearray(blob[:BLOB_HEADER_BYTES])
    header[8:16] = (len(body) if length is None else length).to_bytes(8, "little")
    h = xxhash.xxh3_64(bytes(header[:32]))
    h.update(key)
    h.update(body)
    header[32:40] = h.intdigest().to_bytes(8, "little")
    return bytes(header) + body


def refused(group: PoolGroup, blobs: dict[str, bytes], *, key: bytes = KEY) -> PageCorrupted:
    """Decode ``blobs`` into page DST of kv; it must be refused with nothing written."""
    before = page_bytes(group, "kv", DST)
    neighbours = page_bytes(group, "kv", DST + 1)
    with pytest.raises(PageCorrupted) as err:
        decode_page(group, "kv", DST, blobs, key=key)
    assert_pages_equal(before, page_bytes(group, "kv", DST))
    assert_pages_equal(neighbours, page_bytes(group, "kv", DST + 1))
    return err.value


# -- the checksum covers the whole header and the key ---------------------------------------


@pytest.mark.parametrize("pool", ["kv", "c4"])
@pytest.mark.parametrize("position", range(BLOB_HEADER_BYTES))
def test_every_header_byte_changed_is_refused(groups: tuple[PoolGroup, PoolGroup], pool: str, position: int) -> None:
    a, b = groups
    blobs = {n: bytes(v) for n, v in encode_page(a, "kv", SRC, key=KEY).items()}
    bad = bytearray(blobs[pool])
    bad[position] ^= 0x01
    err = refused(b, {**blobs, pool: bytes(bad)})
    assert err.pool == pool


@pytest.mark.parametrize("field", ["identity tag", "key tag", "both tags"])
def test_tags_forged_to_the_readers_are_refused_by_the_checksum(groups: tuple[PoolGroup, PoolGroup], field: str) -> None:
    """A blob of another identity or key whose 64-bit tags were rewritten to what
    the reader expects (a forged or colliding tag) still fails: the checksum
    covers every header byte, the tags included, and hashes the writer's key."""
    a, b = groups
    writer = PageIdentity.for_pool(a, "kv", model="writer")
    theirs = {n: bytes(v) for n, v in encode_page(a, "kv", SRC, key=b"their-key", identity=writer).items()}
    expected = encode_page(b, "kv", DST, key=KEY)  # what the reader expects, tags and all
    forged = {}
    for name, blob in theirs.items():
        bad = bytearray(blob)
        if field in ("identity tag", "both tags"):
            bad[16:24] = expected[name][16:24]
        if field in ("key tag", "both tags"):
            bad[24:32] = expected[name][24:32]
        forged[name] = bytes(bad)
    err = refused(b, forged)
    assert err.rule == ("checksum" if field == "both tags" else {"identity tag": "key", "key tag": "identity"}[field])


def test_a_length_cut_with_its_rows_is_refused_by_the_checksum(groups: tuple[PoolGroup, PoolGroup]) -> None:
    """The rows cut by one row and the header's length lowered to match: a
    partial page by its shape, but the checksum covered the length and the rows."""
    a, b = groups
    blobs = {n: bytes(v) for n, v in encode_page(a, "kv", SRC, key=KEY).items()}
    row = b["kv"].host.slot_nbytes
    bad = bytearray(blobs["kv"][:-row])
    bad[8:16] = (len(bad) - BLOB_HEADER_BYTES).to_bytes(8, "little")
    err = refused(b, {**blobs, "kv": bytes(bad)})
    assert (err.pool, err.rule) == ("kv", "checksum")


def test_a_page_copied_under_another_key_is_refused(groups: tuple[PoolGroup, PoolGroup]) -> None:
    a, b = groups
    blobs = {n: bytes(v) for n, v in encode_page(a, "kv", SRC, key=b"another-page").items()}
    err = refused(b, blobs)
    assert err.rule == "key"
    decode_page(b, "kv", DST, blobs, key=b"another-page")  # where it was written, it is whole
    assert_pages_equal(page_bytes(a, "kv", SRC), page_bytes(b, "kv", DST))


# -- the stored length is checked exactly -----------------------------------------------------


@pytest.mark.parametrize("case", ["one row more", "not whole rows", "bytes past its length", "fewer bytes than its length",
                                  "one byte more", "one byte less"])
def test_a_length_other_than_whole_rows_of_the_page_is_refused(groups: tuple[PoolGroup, PoolGroup], case: str) -> None:
    """Blobs with a valid checksum over a wrong length (a writer's bug): more
    rows than the page has (they would land in the next page), a length that
    is not whole rows, and a blob longer or shorter than its header says."""
    a, b = groups
    blobs = {n: bytes(v) for n, v in encode_page(a, "kv", SRC, key=KEY).items()}
    rows = blobs["kv"][BLOB_HEADER_BYTES:]
    row = b["kv"].host.slot_nbytes
    bad = {
        "one row more": lambda: reseal(blobs["kv"], KEY, rows=rows + rows[:row]),
        "not whole rows": lambda: reseal(blobs["kv"], KEY, rows=rows[:-row // 2]),
        "bytes past its length": lambda: reseal(blobs["kv"], KEY) + b"\0" * row,
        "fewer bytes than its length": lambda: reseal(blobs["kv"], KEY, length=len(rows) + row, rows=rows),
        "one byte more": lambda: reseal(blobs["kv"], KEY, rows=rows + b"\0"),
        "one byte less": lambda: reseal(blobs["kv"], KEY, rows=rows[:-1]),
    }[case]()
    err = refused(b, {**blobs, "kv": bad})
    assert (err.pool, err.rule) == ("kv", "length")
    # A partial page of whole rows, resealed, is what a partial page is: accepted.
    assert decode_page(b, "kv", DST, {**blobs, "kv": reseal(blobs["kv"], KEY, rows=rows[:-row])}, key=KEY)["kv"] == 7


def test_decode_page_refuses_blobs_that_are_not_a_mapping(groups: tuple[PoolGroup, PoolGroup]) -> None:
    from kvtier.storage import StorageError

    a, b = groups
    blobs = encode_page(a, "kv", SRC, key=KEY)
    before = page_bytes(b, "kv", DST)
    with pytest.raises(StorageError, match=r"decode_page needs blobs as a mapping of pool name to bytes .*got list"):
        decode_page(b, "kv", DST, list(blobs.values()), key=KEY)  # type: ignore[arg-type]
    assert_pages_equal(before, page_bytes(b, "kv", DST))


# -- verify mode checks every page, to the last byte of the last one -------------------------

PS = 8


def _pages(*ps: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in ps])


def _flip_last_byte(group: PoolGroup, pool: str, row: int) -> None:
    """Flip the last byte of host row ``row`` of ``pool``'s last layer and plane."""
    host = group[pool].host
    assert isinstance(host, HostPool)
    view = host.layer_view(host.num_layers - 1, len(host.planes) - 1)[row]
    flat = view.reshape(-1).view(torch.uint8) if view.dim() else view.reshape(1).view(torch.uint8)
    flat[-1] ^= 0xFF


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("pool", ["kv", "c4"])
@pytest.mark.parametrize("direction", ["load", "write_storage"])
async def test_verify_detects_damage_in_the_last_page_of_a_multi_page_operation(
    tmp_path: Path, layout: str, pool: str, direction: str
) -> None:
    group = hybrid_group(layout=layout, device_allocator=True)  # type: ignore[arg-type]
    cfg = SchedulerConfig(verify=True)
    async with FileStore(tmp_path) as store, TransferScheduler(group, config=cfg, storage=store) as sched:
        b = await sched.backup({"kv": _pages(0, 1, 2, 3)})
        await b
        host = b.host_indices["kv"]
        last_page = int(host[-1]) // PS
        k = group["c4"].page_size
        row = int(host[-1]) if pool == "kv" else last_page * k + k - 1  # the page's last row
        _flip_last_byte(group, pool, row)
        if direction == "load":
            handle = await sched.load({"kv": host})
        else:
            keys = page_keys(KeyNamespace.for_pool(group, "kv", model="m"), list(range(4 * PS)))
            handle = await sched.write_storage({"kv": host}, {"kv": keys})
        with anyio.fail_after(30), pytest.raises(CorruptionDetected) as err:
            await handle
        assert (err.value.pool, err.value.pages) == (pool, [last_page])
        if direction == "write_storage":
            assert await store.exists(keys) == [False] * 4  # nothing of it reached the store
        sched.free_host({"kv": host})


# -- a refused page ends the prefetch there: pages before it byte-exact, none after ---------


@pytest.mark.parametrize("chunk_pages", [1, 2, 16], ids=["a-round-a-page", "two-a-round", "one-round"])
@pytest.mark.parametrize("damaged", [0, 2, 4])
async def test_pages_after_a_refused_page_are_not_delivered(
    open_store: Callable[[], StorageBackend], chunk_pages: int, damaged: int
) -> None:
    group = hybrid_group(seed=5, device_allocator=True)
    page_nbytes = PS * group["kv"].host.slot_nbytes + group["c4"].page_size * group["c4"].host.slot_nbytes
    cfg = SchedulerConfig(storage_chunk_bytes=chunk_pages * page_nbytes)
    keys = page_keys(KeyNamespace.for_pool(group, "kv", model="m"), list(range(5 * PS)))
    async with open_store() as store, TransferScheduler(group, config=cfg, storage=store) as sched:
        base = used(group)
        device = _pages(0, 1, 2, 3, 4)
        want = device_rows(group, "kv", device)
        with anyio.fail_after(30):
            b = await sched.backup({"kv": device})
            await b
            await (await sched.write_storage({"kv": b.host_indices["kv"]}, {"kv": keys}))
        sched.free_host({"kv": b.host_indices["kv"]})
        (blobs,) = await store.get([keys[damaged]], ["kv", "c4"])
        assert blobs is not None
        flipped = bytearray(blobs["c4"])
        flipped[-1] ^= 0x01  # the last byte of the page's last blob
        await store.put([PageBlobs(keys[damaged], {**blobs, "c4": bytes(flipped)})])
        with anyio.fail_after(30):
            got = await (await sched.prefetch({"kv": keys}, policy="wait_complete"))
        assert got.pages["kv"] == damaged and got.hit_pages["kv"] == damaged and not got.complete
        stats = sched.statistics().storage
        assert stats is not None and stats.pages_rejected_by_rule == {"checksum": 1}
        if damaged:
            host = got.host_indices["kv"]
            assert len(host) == damaged * PS
            with anyio.fail_after(30):
                load = await sched.load({"kv": host})
                await load
            have = device_rows(group, "kv", load.device_indices["kv"])
            for have_layer, want_layer in zip(have, want, strict=True):
                for x, y in zip(have_layer, want_layer, strict=True):
                    assert torch.equal(x.view(torch.uint8), y[:damaged * PS].view(torch.uint8))
            sched.free_host({"kv": host})
            alloc = group["kv"].device_allocator
            assert alloc is not None
            alloc.free(load.device_indices["kv"])
        else:
            assert "kv" not in got.host_indices
        assert used(group) == base  # the pages after the refused one went back to the pool


# -- the storage errors' fields, and the value-size bound of the stores that have one ----------


def test_storage_errors_carry_their_backend_operation_and_page() -> None:
    from kvtier.storage import PageCorrupted, StorageError, StorageTimeout

    plain = StorageError("it failed")
    assert (str(plain), plain.backend, plain.operation) == ("it failed", "", "")
    named = StorageError("it failed", backend="redis", operation="get")
    assert (named.backend, named.operation) == ("redis", "get")
    late = StorageTimeout("too slow", backend="redis", operation="put", timeout_s=2.5)
    assert (str(late), late.backend, late.operation, late.timeout_s) == ("too slow", "redis", "put", 2.5)
    assert isinstance(late, StorageError)
    default = StorageTimeout("too slow")
    assert (default.backend, default.operation, default.timeout_s) == ("", "", None)
    bad = PageCorrupted("bad bytes", pool="swa", rule="checksum", anchor="kv", page=7, key=b"k" * 32)
    assert (str(bad), bad.operation, bad.backend) == ("bad bytes", "decode", "")
    assert (bad.pool, bad.rule, bad.anchor, bad.page, bad.key) == ("swa", "checksum", "kv", 7, b"k" * 32)
    assert PageCorrupted("x", pool="kv", rule="pools", anchor="kv", page=0).key is None


def test_a_blob_over_the_value_bound_is_named_and_one_at_it_passes() -> None:
    from kvtier.storage import PageBlobs, StorageError
    from kvtier.storage.base import check_value_sizes

    key = bytes(range(32))
    pages = [PageBlobs(key, {"kv": bytes(16), "swa": bytes(8)})]
    check_value_sizes(pages, 16, "redis", "max_value_bytes")  # at the bound: taken
    with pytest.raises(StorageError) as refused:
        check_value_sizes(pages, 15, "redis", "max_value_bytes")
    assert str(refused.value) == (f"the blob of pool 'kv' of page {key.hex()} is 16 bytes; this redis store takes "
                                  "values up to max_value_bytes=15: nothing of the batch was sent")
    assert (refused.value.backend, refused.value.operation) == ("redis", "put")


def test_the_page_format_helpers_at_their_edges() -> None:
    from kvtier.errors import ConfigurationError
    from kvtier.storage import PageBlobs
    from kvtier.storage.base import MAX_KEY_BYTES, assemble, check_key, check_pools, decode_commit, encode_commit

    # keys of 1..256 bytes
    assert check_key(b"k" * MAX_KEY_BYTES) == b"k" * MAX_KEY_BYTES
    for bad in (b"", b"k" * (MAX_KEY_BYTES + 1), "k"):
        with pytest.raises(ConfigurationError, match=r"^page keys are 1\.\.256 bytes; got "):
            check_key(bad)
    # pool names: at least one, each a non-empty string
    assert check_pools(("kv", "swa")) == ["kv", "swa"]
    for bad_names in ([], [""], ["kv", 3]):
        with pytest.raises(ConfigurationError) as refused:
            check_pools(bad_names)  # type: ignore[arg-type]
        assert str(refused.value) == f"get needs at least one pool name (non-empty strings); got {bad_names!r}"
    key = bytes(32)
    for bad_name in ("", 3):
        with pytest.raises(ConfigurationError) as refused:
            PageBlobs(key, {"kv": b"x", bad_name: b"y"})  # type: ignore[dict-item]
        assert str(refused.value) == f"page {key.hex()}: pool names are non-empty strings; got {bad_name!r}"
    # the commit record: its bytes are the stored format (compact JSON, pools sorted)
    page = PageBlobs(key, {"swa": b"ab", "kv": b"abcd", "v4": b""})
    record = encode_commit(page)
    assert record == b'{"v":1,"blobs":{"kv":4,"swa":2,"v4":0}}'
    for form in (record, bytearray(record), memoryview(record)):
        assert decode_commit(form) == {"kv": 4, "swa": 2, "v4": 0}
    # a committed 0-byte blob is b"" whatever the store holds under it; the pools after it still count
    lengths = decode_commit(record)
    assert assemble(lengths, {"kv": b"abcd", "swa": b"ab", "v4": b"junk"}, ["v4", "kv", "swa"]) == {
        "v4": b"", "kv": b"abcd", "swa": b"ab"}
    assert assemble(lengths, {"kv": b"abcd"}, ["v4", "kv"]) == {"v4": b"", "kv": b"abcd"}
    assert assemble(lengths, {"kv": b"abc", "swa": b"ab"}, ["v4", "kv"]) is None  # a short blob: a miss


@pytest.mark.parametrize(
    "lengths",
    [None, [("kv", 1)], {}, {"": 1}, {1: 1}, {"kv": -1}, {"kv": 1.0}, {"kv": True}, {"kv": "1"}, {"kv": 1, "c4": -2}],
    ids=["none", "pairs", "empty", "empty-name", "int-name", "negative", "float", "bool", "str", "second-bad"],
)
def test_blob_lengths_of_a_lookup_by_size_are_refused_naming_the_value_and_the_rule(lengths: object) -> None:
    with pytest.raises(ConfigurationError) as e:
        check_blob_lengths(lengths)
    assert str(e.value) == (
        f"blob lengths are a non-empty mapping of pool names to integers >= 0; got {lengths!r:.80}"
    )


def test_blob_lengths_of_a_lookup_by_size_come_back_as_a_dict_of_their_own() -> None:
    given = {"kv": 0, "c4": 4096}
    got = check_blob_lengths(MappingProxyType(given))
    assert got == given and type(got) is dict
    got["kv"] = 7
    assert given["kv"] == 0  # a copy: the caller's mapping is not the one handed back
