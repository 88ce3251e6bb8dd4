"""`MooncakeStore`'s own logic (kvtier/storage/mooncake_store.py): its object
names, the calls it cuts to fit the client's local buffer, the answers of the
client's calls it reads, 0-byte blobs, upsert versus ``put_batch``, the commit
hook, its errors, timeouts and lifecycle.

These tests drive the store over `StandInMooncakeClient`, a small in-process
stand-in for the methods of ``mooncake.store.MooncakeDistributedStore`` that
kvtier calls — not Mooncake. Its behaviour is the real client's, as its
docstrings say and as measured against a ``mooncake_master`` (what each method
answers is written beside it), and `test_the_cases_agree_with_a_real_mooncake_master`
runs every case of ``CASES`` against a real master and client where they can run
(``make test``), so a difference between the stand-in and Mooncake fails there.
The faults (failed codes, exceptions, a client that stops answering, a failed
setup) are the stand-in's alone. tests/test_storage_mooncake.py keeps the tests
against a real master (damage by another client, a master that dies).

Being in-process, these run in well under a second, so the mutation run
(scripts/mutate.py, ``storage.mooncake_store``) uses them; it leaves out the
real-master cross-check (``-k "not real_mooncake"``).
"""

from __future__ import annotations

import array
import contextlib
import math
import secrets
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import anyio
import anyio.to_thread
import pytest

from kvtier.errors import ConfigurationError
from kvtier.storage import PageBlobs, StorageError, StorageTimeout
from kvtier.storage.base import encode_commit
from kvtier.storage.mooncake_store import MooncakeStore

# The local buffer of the cases' clients: small, so that cutting calls to fit it is cheap to see.
BUF = 64 << 10


def _allocated(n: int) -> int:
    """What a value of n bytes takes in the real client's local buffer, as measured:
    its allocator rounds sizes up to four significant bits (2**16 - 100 takes 2**16,
    2**15 + 1 takes 2**15 + 2**12, under 16 bytes exact)."""
    if n < 16:
        return n
    unit = 2 ** (n.bit_length() - 4)
    return (n + unit - 1) // unit * unit


class StandInMooncakeClient:
    """A stand-in, in this process, for the methods of Mooncake's
    ``MooncakeDistributedStore`` that `MooncakeStore` calls. Not Mooncake: one
    dict of objects, with the answers the real client gives (measured against a
    mooncake_master, and cross-checked by the real-master test below).

    Faults for tests: ``exist_codes`` (the answer of every ``batch_is_exist``),
    ``put_codes`` (the answers of the next put calls, in turn), ``raises`` (an
    exception every call raises), ``gate`` (an event every call waits on),
    ``setup_code`` (what ``setup`` answers)."""

    def __init__(self, local_buffer_size: int = BUF) -> None:
        self.local_buffer_size = local_buffer_size
        self.objects: dict[str, bytes] = {}
        self.setups: list[tuple[Any, ...]] = []
        self.closes = 0
        self.exist_codes: list[int] | None = None
        self.put_codes: list[int] = []
        self.raises: Exception | None = None
        self.gate: threading.Event | None = None
        self.setup_code = 0
        self._lock = threading.Lock()
        self.active = self.most_active = 0

    # setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
    #       protocol, rdma_devices, master_server_addr) -> int: 0 when set up
    def setup(self, local_hostname: str, metadata_server: str, global_segment_size: int, local_buffer_size: int,
              protocol: str, rdma_devices: str, master_server_addr: str) -> int:
        self.setups.append((local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
                            rdma_devices, master_server_addr))
        self.local_buffer_size = local_buffer_size
        return self.setup_code

    def close(self) -> int:
        self.closes += 1
        return 0

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            if self.gate is not None:
                self.gate.wait()
            time.sleep(0.002)  # long enough for a second thread to overlap, were two let in
            if self.raises is not None:
                raise self.raises
            yield
        finally:
            with self._lock:
                self.active -= 1

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """1 where an object is stored, 0 where not, a negative code for a failed lookup; [] for []."""
        with self._call():
            if self.exist_codes is not None:
                return list(self.exist_codes)
            return [1 if k in self.objects else 0 for k in keys]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """Each object's bytes, b"" for a missing one. The values pass through the
        local buffer in order, each at its allocated size: one that no longer fits
        in what is left reads b"" (later ones that fit still read). ``get_batch([])`` answers ``[b""]``."""
        with self._call():
            if not keys:
                return [b""]
            out, left = [], self.local_buffer_size
            for k in keys:
                value = self.objects.get(k, b"")
                if _allocated(len(value)) <= left:
                    out.append(value)
                    left -= _allocated(len(value))
                else:
                    out.append(b"")
            return out

    def _put(self, keys: list[str], values: list[Any], replace: bool) -> int:
        with self._call():
            if self.put_codes:
                return self.put_codes.pop(0)
            # the real client stores a view's first len() bytes: all of it only for a view of bytes
            data = [bytes(memoryview(v).cast("B"))[: len(memoryview(v))] for v in values]
            # -600: an empty value, or values over the local buffer (alone or their allocated sizes
            # added up); nothing of the call is stored
            if any(not d for d in data) or sum(_allocated(len(d)) for d in data) > self.local_buffer_size:
                return -600
            for k, d in zip(keys, data):
                if replace or k not in self.objects:
                    self.objects[k] = d
            return 0

    def put_batch(self, keys: list[str], values: list[Any]) -> int:
        """0 when stored; an object already under a key is kept (not replaced)."""
        return self._put(keys, values, replace=False)

    def upsert_batch(self, keys: list[str], values: list[Any]) -> int:
        """0 when stored; insert or replace."""
        return self._put(keys, values, replace=True)


class Recorder:
    """The client `MooncakeStore` sees: forwards to a stand-in or a real client,
    recording each batch call (method, names, sizes of the values put).
    ``upsert=False`` hides ``upsert_batch``, as an older client lacks it."""

    def __init__(self, client: Any, *, upsert: bool = True) -> None:
        self.client = client
        self.upsert = upsert
        self.calls: list[tuple[str, list[str], list[int]]] = []

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls.append(("batch_is_exist", list(keys), []))
        return list(self.client.batch_is_exist(keys))

    def get_batch(self, keys: list[str]) -> list[bytes]:
        self.calls.append(("get_batch", list(keys), []))
        return list(self.client.get_batch(keys))

    def put_batch(self, keys: list[str], values: list[Any]) -> int:
        self.calls.append(("put_batch", list(keys), [memoryview(v).nbytes for v in values]))
        return int(self.client.put_batch(keys, values))

    def _upsert_batch(self, keys: list[str], values: list[Any]) -> int:
        self.calls.append(("upsert_batch", list(keys), [memoryview(v).nbytes for v in values]))
        return int(self.client.upsert_batch(keys, values))

    def __getattr__(self, name: str) -> Any:
        if name == "upsert_batch" and self.upsert:
            return self._upsert_batch
        raise AttributeError(name)

    def shape(self) -> list[tuple[str, int]]:
        """Each call's method and how many names it carried."""
        return [(m, len(names)) for m, names, _ in self.calls]

    async def damage(self, name: str, value: bytes) -> None:
        """Write an object behind the store's back (not recorded), from a worker thread."""
        assert await anyio.to_thread.run_sync(self.client.upsert_batch, [name], [value]) == 0


Open = Callable[..., Awaitable[tuple[MooncakeStore, Recorder]]]


def page(sizes: dict[str, int]) -> PageBlobs:
    return PageBlobs(secrets.token_bytes(32), {n: secrets.token_bytes(k) for n, k in sizes.items()})


def whole(p: PageBlobs) -> dict[str, bytes]:
    return {n: bytes(b) for n, b in p.blobs.items()}


# -- the cases: run against the stand-in here, and against a real master below --------


async def case_names_and_sizes(open_store: Open) -> None:
    """Blobs of 0, 1, 7 and exactly local_buffer_size bytes round-trip byte-exact;
    a blob of 0 bytes is no object (its commit record says it all); objects are
    named <prefix><key hex>/b/<pool> and <prefix><key hex>/c."""
    store, client = await open_store()
    ints = PageBlobs(secrets.token_bytes(32), {"kv": memoryview(array.array("i", range(-5, 5)))})
    pages = [page({"anchor": 0}), page({"anchor": 0, "c4": 1}), page({"kv": BUF}), page({"kv": 7, "c4": 0}), ints]
    missing = secrets.token_bytes(32)
    await store.put(pages)
    put_names = [n for m, names, _ in client.calls if m == "upsert_batch" for n in names]
    p = store.prefix
    assert put_names == [f"{p}{pages[1].key.hex()}/b/c4", f"{p}{pages[2].key.hex()}/b/kv",
                         f"{p}{pages[3].key.hex()}/b/kv", f"{p}{ints.key.hex()}/b/kv",
                         *(f"{p}{q.key.hex()}/c" for q in pages)]
    keys = [q.key for q in pages]
    assert await store.exists([*keys, missing]) == [True] * 5 + [False]
    got = await store.get([*keys, missing], ["anchor", "c4", "kv"])
    assert got == [None] * 6  # no page has all three pools
    # a blob of 4-byte elements is stored whole (the client takes a view's len(), not its bytes)
    assert await store.get([ints.key], ["kv"]) == [{"kv": array.array("i", range(-5, 5)).tobytes()}]
    for q in pages:
        (blobs,) = await store.get([q.key], list(q.blobs))
        assert blobs == whole(q)
        assert blobs is not None and all(type(b) is bytes for b in blobs.values())
    got = await store.get([pages[3].key, missing, pages[1].key], ["c4"])
    assert got == [{"c4": b""}, None, {"c4": bytes(pages[1].blobs["c4"])}]


async def case_calls_fit_the_buffer(open_store: Open) -> None:
    """Values go in as few calls as fit the local buffer, in order, each counted at
    the size the buffer's allocator rounds it to (four significant bits): a run
    that fills the buffer exactly is one call; the value that would overflow it
    starts the next; two values whose bytes add up to the buffer but whose rounded
    sizes do not (2**15 + 1 takes 2**15 + 2**12) go in two calls."""
    store, client = await open_store()
    # 34816 takes 36864 (four significant bits, not five): with 30720 it overflows the buffer
    sizes = [BUF - 100, BUF // 2, BUF // 2, BUF // 2 + 1, BUF // 2 - 1, BUF - 4096, 4096, 34816, 30720]
    pages = [page({"kv": n}) for n in sizes]
    await store.put(pages)
    assert client.shape() == [("upsert_batch", 1), ("upsert_batch", 2), ("upsert_batch", 1), ("upsert_batch", 1),
                              ("upsert_batch", 2), ("upsert_batch", 1), ("upsert_batch", 1), ("upsert_batch", 9)]
    assert [s for _, _, s in client.calls[:7]] == [[BUF - 100], [BUF // 2, BUF // 2], [BUF // 2 + 1],
                                                   [BUF // 2 - 1], [BUF - 4096, 4096], [34816], [30720]]
    client.calls.clear()
    keys = [q.key for q in pages]
    got = await store.get(keys, ["kv"])
    assert got == [whole(q) for q in pages]
    # one lookup, the nine records (1 KiB each at most) in one call, the blobs as they were put
    assert client.shape() == [("batch_is_exist", 9), ("get_batch", 9), ("get_batch", 1), ("get_batch", 2),
                              ("get_batch", 1), ("get_batch", 1), ("get_batch", 2), ("get_batch", 1),
                              ("get_batch", 1)]
    client.calls.clear()
    assert await store.exists(keys) == [True] * 9
    assert client.shape() == [("batch_is_exist", 9), ("get_batch", 9), ("batch_is_exist", 9)]


async def case_thirds_of_the_buffer(open_store: Open) -> None:
    """Three values of half the buffer: two calls (the sizes add up across a call)."""
    store, client = await open_store()
    pages = [page({"kv": BUF // 2}) for _ in range(3)]
    await store.put(pages)
    assert client.shape() == [("upsert_batch", 2), ("upsert_batch", 1), ("upsert_batch", 3)]
    assert await store.get([q.key for q in pages], ["kv"]) == [whole(q) for q in pages]


async def case_a_tiny_buffer(open_store: Open) -> None:
    """A buffer smaller than a commit record's allowance (1 KiB): each record is read in
    a call of its own, and every page still reads back whole."""
    store, client = await open_store(local_buffer_size=256)
    pages = [page({"kv": 200, "c4": 0}) for _ in range(3)]
    await store.put(pages)
    client.calls.clear()
    keys = [q.key for q in pages]
    assert await store.get(keys, ["kv", "c4"]) == [whole(q) for q in pages]
    assert client.shape() == [("batch_is_exist", 3)] + [("get_batch", 1)] * 6
    client.calls.clear()
    assert await store.exists(keys) == [True] * 3
    assert client.shape() == [("batch_is_exist", 3)] + [("get_batch", 1)] * 3 + [("batch_is_exist", 3)]


async def case_over_the_buffer_is_refused_whole(open_store: Open) -> None:
    """A blob one byte over local_buffer_size: a StorageError naming its size and the
    bound, and nothing of the batch sent."""
    store, client = await open_store()
    pages = [page({"kv": 10}), page({"kv": 5, "big": BUF + 1})]
    with pytest.raises(StorageError, match=rf"the blob of pool 'big' of page {pages[1].key.hex()} is {BUF + 1} bytes; "
                       rf"this mooncake store takes values up to local_buffer_size={BUF}") as err:
        await store.put(pages)
    assert (err.value.backend, err.value.operation) == ("mooncake", "put")
    assert client.calls == []
    assert await store.exists([q.key for q in pages]) == [False, False]


async def case_empty_calls(open_store: Open) -> None:
    """Nothing asked, nothing sent."""
    store, client = await open_store()
    assert await store.exists([]) == []
    assert await store.get([], ["kv"]) == []
    await store.put([])
    assert client.calls == []


async def case_only_empty_blobs(open_store: Open) -> None:
    """A page of 0-byte blobs only: no blob object, found by its commit record alone
    (exists asks about no blob)."""
    store, client = await open_store()
    p = page({"a": 0, "b": 0})
    await store.put([p])
    assert client.shape() == [("upsert_batch", 1)]
    client.calls.clear()
    assert await store.exists([p.key]) == [True]
    assert client.shape() == [("batch_is_exist", 1), ("get_batch", 1)]
    assert await store.get([p.key], ["b", "a"]) == [{"b": b"", "a": b""}]


async def case_misses(open_store: Open) -> None:
    """What reads as a miss: no commit record, a record that is not one (or names
    no blob), a record whose blob is not stored; a blob of another length is
    present to exists (which does not read lengths) but a miss to get. A pool the
    record does not name is a miss."""
    store, client = await open_store()
    good, bad_record, empty_record, lost, short = (page({"kv": 40, "c4": 3}) for _ in range(5))
    await store.put([good, bad_record, empty_record, short])
    p = store.prefix
    await client.damage(f"{p}{bad_record.key.hex()}/c", b"not json")
    await client.damage(f"{p}{empty_record.key.hex()}/c", b'{"v":1,"blobs":{}}')
    await client.damage(f"{p}{lost.key.hex()}/c", encode_commit(lost))  # its blobs were never stored
    await client.damage(f"{p}{short.key.hex()}/b/kv", bytes(short.blobs["kv"])[:39])
    keys = [q.key for q in (good, bad_record, empty_record, lost, short)]
    assert await store.exists(keys) == [True, False, False, False, True]
    assert await store.get(keys, ["kv", "c4"]) == [whole(good), None, None, None, None]
    assert await store.get(keys, ["c4"]) == [{"c4": bytes(good.blobs["c4"])}, None, None, None,
                                            {"c4": bytes(short.blobs["c4"])}]
    assert await store.get([good.key], ["kv", "other"]) == [None]


async def case_a_lost_blob_among_several(open_store: Open) -> None:
    """exists checks every blob a record names: one lost among three is a miss."""
    store, client = await open_store()
    lost = page({"a": 5, "b": 6, "c": 7})
    await client.damage(f"{store.prefix}{lost.key.hex()}/c", encode_commit(lost))
    await client.damage(f"{store.prefix}{lost.key.hex()}/b/a", bytes(lost.blobs["a"]))
    await client.damage(f"{store.prefix}{lost.key.hex()}/b/c", bytes(lost.blobs["c"]))
    kept = page({"a": 5})
    await store.put([kept])
    assert await store.exists([lost.key, kept.key]) == [False, True]
    assert await store.get([lost.key, kept.key], ["a"]) == [{"a": bytes(lost.blobs["a"])}, whole(kept)]


async def case_put_again_replaces(open_store: Open) -> None:
    """upsert_batch: putting a page again replaces a damaged copy."""
    store, client = await open_store()
    p = page({"kv": 32})
    await store.put([p])
    damaged = b"\xff" * 32
    await client.damage(f"{store.prefix}{p.key.hex()}/b/kv", damaged)
    assert await store.get([p.key], ["kv"]) == [{"kv": damaged}]
    await store.put([p])
    assert await store.get([p.key], ["kv"]) == [whole(p)]
    assert {m for m, _, _ in client.calls if m.endswith("_batch") and m != "get_batch"} == {"upsert_batch"}


async def case_put_batch_keeps(open_store: Open) -> None:
    """A client without upsert_batch: put_batch, which keeps an object already stored
    (the damaged copy stays), and stores new pages."""
    store, client = await open_store(upsert=False)
    p, q = page({"kv": 32}), page({"kv": 9})
    await store.put([p])
    damaged = b"\xff" * 32
    await client.damage(f"{store.prefix}{p.key.hex()}/b/kv", damaged)
    await store.put([p, q])
    assert await store.get([p.key, q.key], ["kv"]) == [{"kv": damaged}, whole(q)]
    assert {m for m, _, _ in client.calls if m != "get_batch" and m != "batch_is_exist"} == {"put_batch"}


async def case_the_commit_hook_stops_the_put(open_store: Open) -> None:
    """before_commit raising for a page: the pages before it are committed, it and the
    later ones are not (their blobs were sent), and the error names it; the hook is not
    called again after its first fault."""
    store, client = await open_store()
    pages = [page({"kv": 8}) for _ in range(5)]
    seen: list[bytes] = []

    def hook(key: bytes) -> None:
        seen.append(key)
        if key in (pages[2].key, pages[4].key):
            raise RuntimeError("injected")

    store.before_commit = hook
    with pytest.raises(StorageError, match=rf"^mooncake put stopped before the commit of page {pages[2].key.hex()}: "
                       r"injected$") as err:
        await store.put(pages)
    assert isinstance(err.value.__cause__, RuntimeError)
    assert (err.value.backend, err.value.operation) == ("mooncake", "put")
    assert seen == [q.key for q in pages[:3]]
    assert client.shape() == [("upsert_batch", 5), ("upsert_batch", 2)]
    assert await store.exists([q.key for q in pages]) == [True, True, False, False, False]
    store.before_commit = None
    await store.put(pages)
    assert await store.get([q.key for q in pages], ["kv"]) == [whole(q) for q in pages]


async def case_the_hook_at_the_first_page(open_store: Open) -> None:
    """A fault at the first page commits nothing (no commit call at all)."""
    store, client = await open_store()
    pages = [page({"kv": 8}) for _ in range(2)]

    def hook(key: bytes) -> None:
        raise ValueError("first")

    store.before_commit = hook
    with pytest.raises(StorageError, match=f"commit of page {pages[0].key.hex()}: first"):
        await store.put(pages)
    assert client.shape() == [("upsert_batch", 2)]
    assert await store.exists([q.key for q in pages]) == [False, False]


async def case_small_values_fill_the_buffer(open_store: Open) -> None:
    """Values under 16 bytes take exactly their size: seventeen of 15 bytes and one of
    1 fill a 256-byte buffer in one call."""
    store, client = await open_store(local_buffer_size=256)
    pages = [page({"kv": 15}) for _ in range(17)] + [page({"kv": 1})]
    await store.put(pages)
    assert client.shape()[0] == ("upsert_batch", 18)
    assert await store.get([q.key for q in pages], ["kv"]) == [whole(q) for q in pages]


async def case_the_client_answers(open_store: Open) -> None:
    """The client's own answers to puts of these sizes, the stand-in's as the real
    one's: what fits the buffer is stored (0), what does not is refused whole (-600)."""
    for buffer, table in ((BUF, [([BUF], 0), ([BUF // 2, BUF // 2], 0), ([BUF - 4096, 4096], 0),
                                 ([BUF // 2 - 1, BUF // 2 + 1], -600), ([BUF - 8, 8], -600), ([BUF + 1], -600),
                                 ([34816, 30720], -600), ([5, 0], -600)]),
                          (256, [([15] * 17 + [1], 0), ([15] * 17 + [2], -600), ([17] * 15, -600),
                                 ([16] * 16, 0)])):
        _, client = await open_store(local_buffer_size=buffer)
        for sizes, code in table:
            names = [f"answers/{secrets.token_hex(8)}" for _ in sizes]

            def put(names: list[str] = names, sizes: list[int] = sizes) -> tuple[int, list[int]]:
                rc = client.client.put_batch(names, [b"v" * n for n in sizes])
                return rc, client.client.batch_is_exist(names)

            rc, stored = await anyio.to_thread.run_sync(put)
            assert (rc, stored) == (code, [1 if code == 0 else 0] * len(sizes)), (buffer, sizes)
    # reads: a value that no longer fits what is left of the buffer reads b"", later ones that fit
    # still read; no names at all read one b""
    _, client = await open_store()
    a, b, c = (f"answers/{secrets.token_hex(8)}" for _ in range(3))
    values = {a: b"a" * (BUF // 2 + 1), b: b"b" * (BUF // 2), c: b"c" * 9}

    def read() -> list[list[bytes]]:
        for name, value in values.items():
            assert client.client.put_batch([name], [value]) == 0
        return [list(client.client.get_batch(names)) for names in ([a, b, c], [b, a, c], [b, b], [b, c, b], [])]

    assert await anyio.to_thread.run_sync(read) == [[values[a], b"", values[c]], [values[b], b"", values[c]],
                                                   [values[b], values[b]], [values[b], values[c], b""], [b""]]


CASES: tuple[Callable[[Open], Awaitable[None]], ...] = (
    case_small_values_fill_the_buffer, case_the_client_answers,
    case_names_and_sizes, case_calls_fit_the_buffer, case_thirds_of_the_buffer, case_a_tiny_buffer,
    case_over_the_buffer_is_refused_whole, case_empty_calls, case_only_empty_blobs, case_misses,
    case_a_lost_blob_among_several, case_put_again_replaces, case_put_batch_keeps,
    case_the_commit_hook_stops_the_put, case_the_hook_at_the_first_page,
)


@contextlib.asynccontextmanager
async def stand_in_stores() -> AsyncIterator[Open]:
    opened: list[MooncakeStore] = []

    async def open_store(*, local_buffer_size: int = BUF, upsert: bool = True) -> tuple[MooncakeStore, Recorder]:
        client = Recorder(StandInMooncakeClient(local_buffer_size), upsert=upsert)
        store = MooncakeStore(store=client, local_buffer_size=local_buffer_size, prefix=f"t{secrets.token_hex(4)}/")
        opened.append(store)
        return store, client

    try:
        yield open_store
    finally:
        for s in opened:
            await s.aclose()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
async def test_case_with_the_stand_in(case: Callable[[Open], Awaitable[None]]) -> None:
    async with stand_in_stores() as open_store:
        await case(open_store)


async def test_the_cases_agree_with_a_real_mooncake_master(tmp_path: Any) -> None:
    """Every case above against a real mooncake_master and client (skips where
    Mooncake cannot run, as tests/test_storage_mooncake.py does): the stand-in
    answers as the real client does wherever the cases look."""
    from test_storage_mooncake import Master, mooncake_store  # skips without mooncake

    master = await anyio.to_thread.run_sync(Master, tmp_path)
    clients: dict[int, Any] = {}  # one real client per buffer size (each store has a prefix of its own)

    async def open_store(*, local_buffer_size: int = BUF, upsert: bool = True) -> tuple[MooncakeStore, Recorder]:
        real = clients.get(local_buffer_size)
        if real is None:
            real = mooncake_store.MooncakeDistributedStore()

            def setup() -> int:
                return int(real.setup("127.0.0.1", master.addrs[1], 16 << 20, local_buffer_size, "tcp", "",
                                      master.addrs[0]))

            assert await anyio.to_thread.run_sync(setup) == 0
            clients[local_buffer_size] = real
        client = Recorder(real, upsert=upsert)
        return MooncakeStore(store=client, local_buffer_size=local_buffer_size,
                             prefix=f"t{secrets.token_hex(4)}/"), client

    try:
        for case in CASES:
            try:
                await case(open_store)
            except BaseException as exc:
                exc.add_note(f"in {case.__name__}, against a real mooncake_master")
                raise
    finally:
        for real in clients.values():
            await anyio.to_thread.run_sync(real.close)
        await anyio.to_thread.run_sync(master.stop)


# -- the stand-in's faults: what a failing client makes of each operation ----------------


@pytest.fixture
async def stand_in() -> AsyncIterator[tuple[MooncakeStore, StandInMooncakeClient]]:
    client = StandInMooncakeClient()
    store = MooncakeStore(store=client, local_buffer_size=BUF, timeout_s=5)
    yield store, client
    if client.gate is not None:
        client.gate.set()
    await store.aclose()


@pytest.mark.parametrize("operation", ["exists", "get"])
async def test_a_failed_lookup_is_a_storage_error_naming_the_first_failed_code(
    stand_in: tuple[MooncakeStore, StandInMooncakeClient], operation: str
) -> None:
    store, client = stand_in
    p = page({"kv": 4})
    await store.put([p])
    client.exist_codes = [1, -704, -1]
    call = store.exists([p.key] * 3) if operation == "exists" else store.get([p.key] * 3, ["kv"])
    with pytest.raises(StorageError, match=r"^mooncake is_exist failed with code -704$") as err:
        await call
    assert (err.value.backend, err.value.operation) == ("mooncake", operation)


async def test_a_failed_blob_lookup_in_exists_is_a_storage_error(
    stand_in: tuple[MooncakeStore, StandInMooncakeClient]
) -> None:
    """The second lookup (of the blobs) fails: an error, not a miss."""
    store, client = stand_in
    p = page({"kv": 4})
    await store.put([p])
    answers = iter([[1], [-1]])
    real_lookup = client.batch_is_exist
    client.batch_is_exist = lambda keys: (real_lookup(keys), next(answers))[1]  # type: ignore[method-assign]
    with pytest.raises(StorageError, match="is_exist failed with code -1") as err:
        await store.exists([p.key])
    assert (err.value.backend, err.value.operation) == ("mooncake", "exists")


@pytest.mark.parametrize(("codes", "message"), [
    ([-600], r"^mooncake put of 2 blobs failed with code -600$"),
    ([0, -700], r"^mooncake put of 2 commit records failed with code -700$"),
    ([1], r"^mooncake put of 2 blobs failed with code 1$"),
])
async def test_a_failed_put_is_a_storage_error_naming_the_call(
    stand_in: tuple[MooncakeStore, StandInMooncakeClient], codes: list[int], message: str
) -> None:
    """A put call that answers anything but 0: what it carried and the code; when the
    blobs' call failed, no commit record is sent."""
    store, client = stand_in
    pages = [page({"kv": 4}), page({"kv": 5})]
    client.put_codes = list(codes)
    with pytest.raises(StorageError, match=message) as err:
        await store.put(pages)
    assert (err.value.backend, err.value.operation) == ("mooncake", "put")
    assert client.put_codes == []
    assert await store.exists([q.key for q in pages]) == [False, False]


async def test_a_failed_put_in_a_later_call_stops_the_put(
    stand_in: tuple[MooncakeStore, StandInMooncakeClient]
) -> None:
    """The second call of blobs fails: its count is named, no commit is sent."""
    store, client = stand_in
    pages = [page({"kv": BUF // 2}) for _ in range(3)]
    client.put_codes = [0, -600]
    with pytest.raises(StorageError, match=r"^mooncake put of 1 blobs failed with code -600$"):
        await store.put(pages)
    assert not any(name.endswith("/c") for name in client.objects)


@pytest.mark.parametrize("operation", ["exists", "get", "put"])
async def test_a_client_that_raises_is_a_storage_error(
    stand_in: tuple[MooncakeStore, StandInMooncakeClient], operation: str
) -> None:
    store, client = stand_in
    p = page({"kv": 4})
    client.raises = RuntimeError("connection reset")
    calls = {"exists": lambda: store.exists([p.key]), "get": lambda: store.get([p.key], ["kv"]),
             "put": lambda: store.put([p])}
    with pytest.raises(StorageError, match=rf"^mooncake {operation} failed: RuntimeError: connection reset$") as err:
        await calls[operation]()
    assert (err.value.backend, err.value.operation) == ("mooncake", operation)
    assert err.value.__cause__ is client.raises


async def test_a_client_that_stops_answering_times_out_promptly() -> None:
    """timeout_s bounds every call; the call is left to finish in its thread."""
    client = StandInMooncakeClient()
    client.gate = threading.Event()
    store = MooncakeStore(store=client, local_buffer_size=BUF, timeout_s=0.25)
    # a mutant that waits for the thread must not hang the test: the gate opens after 3 s
    opener = threading.Timer(3.0, client.gate.set)
    opener.start()
    try:
        start = time.monotonic()
        with pytest.raises(StorageTimeout, match=r"^mooncake did not answer get within 0.25 s$") as err:
            await store.get([b"k" * 32], ["kv"])
        assert time.monotonic() - start < 2.0
        assert (err.value.backend, err.value.operation, err.value.timeout_s) == ("mooncake", "get", 0.25)
    finally:
        opener.cancel()
        client.gate.set()
        await store.aclose()


async def test_one_call_at_a_time() -> None:
    """The client is called from one worker thread at a time, however many operations run."""
    client = StandInMooncakeClient()
    store = MooncakeStore(store=client, local_buffer_size=BUF)
    pages = [page({"kv": 64}) for _ in range(4)]
    async with anyio.create_task_group() as tg:
        for q in pages:
            tg.start_soon(store.put, [q])
    async with anyio.create_task_group() as tg:
        for q in pages:
            tg.start_soon(store.get, [q.key], ["kv"])
            tg.start_soon(store.exists, [q.key])
    assert client.most_active == 1
    assert await store.get([q.key for q in pages], ["kv"]) == [whole(q) for q in pages]


# -- a client the store sets up and owns --------------------------------------------------


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[StandInMooncakeClient]:
    """``mooncake.store.MooncakeDistributedStore`` as the stand-in: the clients made."""
    made: list[StandInMooncakeClient] = []

    def factory() -> StandInMooncakeClient:
        client = StandInMooncakeClient(local_buffer_size=0)
        made.append(client)
        return client

    package, module = types.ModuleType("mooncake"), types.ModuleType("mooncake.store")
    module.MooncakeDistributedStore = factory  # type: ignore[attr-defined]
    package.store = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mooncake", package)
    monkeypatch.setitem(sys.modules, "mooncake.store", module)
    return made


async def test_the_owned_client_is_set_up_once_with_the_defaults_and_closed_once(
    made: list[StandInMooncakeClient]
) -> None:
    store = MooncakeStore()
    assert made == []  # nothing is set up before the first call
    assert repr(store) == "<MooncakeStore 127.0.0.1:50051 [timeout=30s, prefix='kvtier/']>"
    p = page({"kv": 3})
    await store.put([p])
    assert await store.get([p.key], ["kv"]) == [whole(p)]
    (client,) = made
    assert client.setups == [("127.0.0.1", "http://127.0.0.1:8080/metadata", 512 << 20, 128 << 20, "tcp", "",
                              "127.0.0.1:50051")]
    assert sorted(client.objects) == [f"kvtier/{p.key.hex()}/b/kv", f"kvtier/{p.key.hex()}/c"]
    async with store as entered:
        assert entered is store
    assert client.closes == 1
    await store.aclose()
    assert client.closes == 1
    for operation, call in (("exists", lambda: store.exists([p.key])), ("get", lambda: store.get([p.key], ["kv"])),
                            ("put", lambda: store.put([p]))):
        with pytest.raises(StorageError, match=r"^mooncake store is closed$") as err:
            await call()
        assert (err.value.backend, err.value.operation) == ("mooncake", operation)
    assert len(made) == 1


async def test_the_setup_arguments_are_passed_in_mooncakes_order(made: list[StandInMooncakeClient]) -> None:
    store = MooncakeStore("10.0.0.1:7000", "http://10.0.0.1:9/metadata", local_hostname="10.0.0.2", protocol="rdma",
                          device_name="mlx5_0", global_segment_size=3 << 20, local_buffer_size=5 << 20,
                          timeout_s=7, prefix="p/")
    assert repr(store) == "<MooncakeStore 10.0.0.1:7000 [timeout=7s, prefix='p/']>"
    assert await store.exists([b"k"]) == [False]
    assert made[0].setups == [("10.0.0.2", "http://10.0.0.1:9/metadata", 3 << 20, 5 << 20, "rdma", "mlx5_0",
                               "10.0.0.1:7000")]
    await store.aclose()


async def test_a_failed_setup_is_a_storage_error_and_the_next_call_tries_again(
    made: list[StandInMooncakeClient]
) -> None:
    def failing() -> StandInMooncakeClient:
        client = StandInMooncakeClient()
        client.setup_code = -1 if not made else 0
        made.append(client)
        return client

    sys.modules["mooncake.store"].MooncakeDistributedStore = failing  # type: ignore[attr-defined]
    store = MooncakeStore("10.0.0.1:7000")
    with pytest.raises(StorageError, match=r"^mooncake client setup against master 10.0.0.1:7000 failed with code -1$"
                       ) as err:
        await store.exists([b"k"])
    assert (err.value.backend, err.value.operation) == ("mooncake", "setup")
    assert await store.exists([b"k"]) == [False]
    assert len(made) == 2 and made[1].setups != []
    await store.aclose()
    assert (made[0].closes, made[1].closes) == (0, 1)


async def test_closing_a_store_never_set_up_sets_up_nothing(made: list[StandInMooncakeClient]) -> None:
    store = MooncakeStore()
    await store.aclose()
    assert made == []
    with pytest.raises(StorageError, match="closed"):
        await store.put([page({"kv": 1})])
    assert made == []


async def test_a_client_passed_in_is_the_callers_to_close() -> None:
    client = StandInMooncakeClient()
    async with MooncakeStore(store=client, local_buffer_size=BUF) as store:
        p = page({"kv": 3})
        await store.put([p])
    assert client.closes == 0 and client.setups == []
    with pytest.raises(StorageError, match=r"^mooncake store is closed$"):
        await store.exists([p.key])


def test_without_mooncake_the_store_cannot_be_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ImportError):
        MooncakeStore()
    assert MooncakeStore(store=StandInMooncakeClient()).local_buffer_size == 128 << 20


@pytest.mark.parametrize("value", [True, 0, -1.0, "5", None, math.nan])
def test_timeout_s_must_be_a_positive_number(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=rf"^timeout_s must be > 0 seconds; got {value!r}$"):
        MooncakeStore(store=StandInMooncakeClient(), timeout_s=value)


@pytest.mark.parametrize("value", [True, 0, -1, 1.5, "8", None])
def test_local_buffer_size_must_be_a_positive_int(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^MooncakeStore local_buffer_size must be a positive integer of "
                       rf"bytes; got {value!r}$".replace("(", r"\(")):
        MooncakeStore(store=StandInMooncakeClient(), local_buffer_size=value)


def test_the_smallest_settings_are_taken() -> None:
    store = MooncakeStore(store=StandInMooncakeClient(), local_buffer_size=1, timeout_s=0.5)
    assert (store.local_buffer_size, store.timeout_s, type(store.timeout_s)) == (1, 0.5, float)
    assert repr(MooncakeStore(store=StandInMooncakeClient(), timeout_s=2)).endswith("[timeout=2s, prefix='kvtier/']>")


async def test_the_commit_hook_given_at_construction_is_used() -> None:
    client = StandInMooncakeClient()
    seen: list[bytes] = []
    store = MooncakeStore(store=client, local_buffer_size=BUF, before_commit=seen.append)
    p = page({"kv": 3})
    await store.put([p])
    assert seen == [p.key] and await store.exists([p.key]) == [True]


async def test_closing_waits_for_the_call_in_flight(made: list[StandInMooncakeClient]) -> None:
    """aclose closes the owned client in the same one-at-a-time worker: never under a
    call still running in it."""
    store = MooncakeStore()
    assert await store.exists([b"k"]) == [False]  # set up
    (client,) = made
    client.gate = threading.Event()
    closed_while_active: list[int] = []
    real_close = client.close

    def close() -> int:
        closed_while_active.append(client.active)
        return real_close()

    client.close = close  # type: ignore[method-assign]
    opener = threading.Timer(3.0, client.gate.set)  # a mutant that closes at once must not hang
    opener.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.get, [b"k"], ["kv"])
            await anyio.sleep(0.1)  # the get is in the client, held at the gate
            assert client.active == 1
            tg.start_soon(store.aclose)
            await anyio.sleep(0.1)
            client.gate.set()
    finally:
        opener.cancel()
        client.gate.set()
    assert closed_while_active == [0] and client.closes == 1
