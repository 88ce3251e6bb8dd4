"""Sealed raw pages (`kvtier.storage.sealed`) and `SealedPageStore`, the
synchronous face on a store for engines that keep their own host memory.

Every round trip compares bytes; every damage is a miss, never another page's
bytes and never an exception into the caller's thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import needs_redis_server
from kvtier.errors import ConfigurationError
from kvtier.storage import (
    SEAL_HEADER_BYTES,
    EngineNamespace,
    FileStore,
    RedisStore,
    SealBroken,
    SealedPageStore,
    StorageBackend,
    UnsupportedPayload,
    new_sealed,
    open_sealed,
    seal,
    seal_in_place,
    seal_tensor,
)
from kvtier.testing import MemoryStore
from kvtier.testing.redis_server import LocalRedisCluster, LocalRedisServer

NS = EngineNamespace(engine="test", model="m", page_size=4, dtype="bfloat16", layout="page_first", tp_rank=0, tp_size=2)
KEY = NS.key("ab" * 32)


# -- seal / open ---------------------------------------------------------------


def test_seal_then_open_gives_the_payload_back_byte_for_byte() -> None:
    payload = bytes(range(256)) * 3
    blob = seal(KEY, payload, tag="kv")
    assert len(blob) == SEAL_HEADER_BYTES + len(payload)
    assert bytes(open_sealed(KEY, blob, tag="kv", nbytes=len(payload))) == payload
    assert bytes(open_sealed(KEY, bytes(blob), tag="kv")) == payload  # read-only bytes, as stores return


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_seal_tensor_seals_a_conjugate_or_negative_views_values(view: str) -> None:
    """A conjugate or negative view has no bytes of its own (a bit on the tensor):
    its values are sealed, as a copy of it would hold them (torch's byte view
    refuses such a tensor, which came out as torch's bare RuntimeError)."""
    base = torch.complex(torch.randn(3, 4), torch.randn(3, 4))
    t = base.conj() if view == "conj" else torch._neg_view(base)
    assert (t.is_conj() if view == "conj" else t.is_neg())
    blob = seal_tensor(KEY, t, tag="kv")
    back = torch.frombuffer(bytearray(open_sealed(KEY, blob, tag="kv")), dtype=torch.complex64).view(3, 4)
    assert torch.equal(back, t.resolve_conj().resolve_neg()) and not torch.equal(back, base)
    assert bytes(blob) == bytes(seal_tensor(KEY, t.clone(), tag="kv"))  # the same bytes as a materialised copy


def test_seal_tensor_copies_strided_tensors_in_c_order() -> None:
    t = torch.randn(3, 5, 7).to(torch.bfloat16).transpose(0, 2)  # not contiguous
    blob = seal_tensor(KEY, t, tag="kv")
    back = torch.frombuffer(bytearray(open_sealed(KEY, blob, tag="kv")), dtype=torch.bfloat16).view(t.shape)
    assert torch.equal(back.view(torch.int16), t.contiguous().view(torch.int16))


def test_new_sealed_and_seal_in_place_equal_seal() -> None:
    payload = torch.arange(64, dtype=torch.int32)
    blob = new_sealed(payload.numel() * 4)
    torch.frombuffer(blob, dtype=torch.int32, offset=SEAL_HEADER_BYTES).copy_(payload)
    seal_in_place(KEY, blob, tag="kv")
    assert blob == seal(KEY, payload.numpy().tobytes(), tag="kv")


@pytest.mark.parametrize(
    ("damage", "rule"),
    [
        (lambda b: b[:10], "header"),
        (lambda b: b"XXXX" + b[4:], "header"),
        (lambda b: b[:4] + b"\x03" + b[5:], "version"),
        (lambda b: b[:-1], "length"),
        (lambda b: b + b"\0", "length"),
        (lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], "checksum"),
        (lambda b: b[:24] + bytes([b[24] ^ 0x80]) + b[25:], "checksum"),
    ],
    ids=["short", "foreign", "version", "torn", "extended", "flipped", "checksum-byte"],
)
def test_open_names_the_rule_a_damaged_blob_breaks(damage: Callable[[bytes], bytes], rule: str) -> None:
    blob = bytes(seal(KEY, b"x" * 100, tag="kv"))
    with pytest.raises(SealBroken) as info:
        open_sealed(KEY, damage(blob), tag="kv")
    assert info.value.rule == rule
    assert info.value.key == KEY


def test_a_blob_copied_under_another_key_or_pool_is_broken() -> None:
    blob = seal(KEY, b"page", tag="kv")
    with pytest.raises(SealBroken, match="checksum") as info:
        open_sealed(NS.key("cd" * 32), blob, tag="kv")
    assert info.value.rule == "checksum"
    with pytest.raises(SealBroken) as info:
        open_sealed(KEY, blob, tag="swa")
    assert info.value.rule == "identity"
    with pytest.raises(SealBroken) as info:
        open_sealed(KEY, blob, tag="kv", nbytes=5)
    assert info.value.rule == "length"


@settings(max_examples=60, deadline=None)
@given(payload=st.binary(min_size=1, max_size=300), data=st.data())
def test_any_single_bit_flip_anywhere_is_caught(payload: bytes, data: st.DataObject) -> None:
    blob = bytearray(seal(KEY, payload, tag="kv"))
    bit = data.draw(st.integers(0, len(blob) * 8 - 1))
    blob[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(SealBroken):
        open_sealed(KEY, blob, tag="kv")


def test_seal_rejects_bad_keys_and_sizes() -> None:
    with pytest.raises(ValueError, match="page keys are 1..256 bytes"):
        seal(b"", b"x")
    with pytest.raises(ValueError, match="integer size >= 0"):
        new_sealed(-1)


# -- SealedPageStore ------------------------------------------------------------------


@pytest.fixture
def memory() -> Iterator[tuple[MemoryStore, SealedPageStore]]:
    store = MemoryStore()
    sealed = SealedPageStore(lambda: store, NS, timeout_s=5)
    yield store, sealed
    sealed.close()


def _payloads(n: int, nbytes: int = 512, seed: int = 0) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).numpy().tobytes() for _ in range(n)]


def test_pages_round_trip_byte_for_byte(memory: tuple[MemoryStore, SealedPageStore]) -> None:
    _, store = memory
    keys = [f"{i:064x}" for i in range(6)]
    data = _payloads(6)
    assert store.put(list(zip(keys, data))) == [True] * 6
    assert store.exists(keys + ["f" * 64]) == [True] * 6 + [False]
    assert store.prefix_length(keys[:3] + ["f" * 64] + keys[3:]) == 3
    got = store.get(keys, nbytes=512)
    assert [bytes(g) for g in got if g is not None] == data
    s = store.statistics()
    assert (s.put_pages, s.put_failed, s.get_hits, s.get_misses, s.faults) == (6, 0, 6, 0, 0)
    assert s.bytes_read == 6 * 512


def test_several_pools_go_in_one_store_call_each_bound_to_its_pool() -> None:
    """put_pools / exists_pools / get_pools: one store call each for every pool,
    answered per pool, byte-exact; a key stored in one pool is not found in
    another; a store fault answers every pool with misses."""

    class Counting(MemoryStore):
        counted: dict[str, int] = {}

        async def exists(self, keys):  # type: ignore[no-untyped-def]
            self.counted["exists"] = self.counted.get("exists", 0) + 1
            return await super().exists(keys)

        async def put(self, pages):  # type: ignore[no-untyped-def]
            self.counted["put"] = self.counted.get("put", 0) + 1
            return await super().put(pages)

    mem = Counting()
    a, b = _payloads(2, 64, seed=1), _payloads(3, 16, seed=2)
    with SealedPageStore(lambda: mem, NS, timeout_s=5) as store:
        assert store.put_pools([("swa", list(zip("xy", a)), None), ("c4", list(zip("xyz", b)), b"c4-tag-8")]) == [
            [True] * 2, [True] * 3]
        assert mem.counted == {"put": 1}
        assert store.exists_pools([("swa", ["x", "z"]), ("c4", ["x", "y", "z"]), ("kv", ["x"])]) == [
            [True, False], [True] * 3, [False]]
        assert mem.counted == {"put": 1, "exists": 1}
        got = store.get_pools([("swa", ["x", "y"], 64, None), ("c4", ["z", "x"], 16, b"c4-tag-8"),
                               ("c4", ["x"], 16, None)])  # the c4 page under the default tag: an identity miss
        assert [[None if g is None else bytes(g) for g in pool] for pool in got] == [a, [b[2], b[0]], [None]]
        s = store.statistics()
        assert (s.get_pages, s.get_hits, s.get_refused, s.broken) == (5, 4, 1, {"identity": 1})
        mem.fail_probability = 1.0
        assert store.get_pools([("swa", ["x"], None, None), ("c4", ["x"], None, b"c4-tag-8")]) == [[None], [None]]
        assert store.exists_pools([("swa", ["x"]), ("c4", ["x"])]) == [[False], [False]]
        assert store.put_pools([("swa", [("q", b"1")], None), ("c4", [("q", b"2")], None)]) == [[False], [False]]
        assert store.statistics().faults == 3


def test_tensor_payloads_are_copied_from_where_they_lie(memory: tuple[MemoryStore, SealedPageStore]) -> None:
    _, store = memory
    pages = torch.randn(2, 4, 3, 8).to(torch.bfloat16)
    views = [pages[:, i] for i in range(4)]  # strided, as a layer-first host pool's page is
    assert store.put([(f"k{i}", v) for i, v in enumerate(views)]) == [True] * 4
    for i, got in enumerate(store.get([f"k{i}" for i in range(4)])):
        assert got is not None
        back = torch.frombuffer(bytearray(got), dtype=torch.bfloat16).view(views[i].shape)
        assert torch.equal(back.view(torch.int16), views[i].contiguous().view(torch.int16))


def test_a_damaged_page_is_a_miss_and_a_put_repairs_it(memory: tuple[MemoryStore, SealedPageStore]) -> None:
    mem, store = memory
    keys, data = ["a", "b", "c"], _payloads(3)
    store.put(list(zip(keys, data)))
    mem.corrupt(NS.key("b"), "kv", SEAL_HEADER_BYTES + 7)
    got = store.get(keys)
    assert got[1] is None and bytes(got[0] or b"") == data[0] and bytes(got[2] or b"") == data[2]
    assert store.exists(keys) == [True, True, True]  # present whole; only get reads the bytes
    assert store.statistics().broken == {"checksum": 1}
    store.put([("b", data[1])])
    assert bytes(store.get(["b"])[0] or b"") == data[1]


def test_a_page_spliced_in_under_another_key_is_a_miss(memory: tuple[MemoryStore, SealedPageStore]) -> None:
    mem, store = memory
    store.put([("a", b"A" * 64), ("b", b"B" * 64)])
    mem.pages[NS.key("b")] = dict(mem.pages[NS.key("a")])  # a copy tool's mistake
    assert store.get(["a", "b"])[1] is None
    other = SealedPageStore(lambda: mem, EngineNamespace(engine="test", model="other", page_size=4, dtype="bfloat16", layout="page_first"))
    try:
        mem.pages[other.namespace.key("a")] = dict(mem.pages[NS.key("a")])  # another model's namespace
        assert other.get(["a"]) == [None]
        assert other.statistics().broken == {"identity": 1}  # refused by its identity tag, before the checksum
    finally:
        other.close()


def test_identity_tags_bind_a_blob_to_what_its_bytes_mean() -> None:
    tag_a, tag_b = b"\x01" * 8, b"\x02" * 8  # two identities' tags (PageIdentity.tag)
    blob = seal(KEY, b"page", tag=tag_a)
    assert bytes(open_sealed(KEY, blob, tag=tag_a)) == b"page"
    with pytest.raises(SealBroken, match="another identity tag") as info:
        open_sealed(KEY, blob, tag=tag_b)
    assert info.value.rule == "identity"
    with pytest.raises(ValueError, match="identity tag is 8 bytes"):
        seal(KEY, b"page", tag=b"short")
    old = bytearray(blob)
    old[4] = 1  # a version-1 blob (its tag was the pool name): a miss, rewritten by the next put
    with pytest.raises(SealBroken) as info:
        open_sealed(KEY, old, tag=tag_a)
    assert info.value.rule == "version"


def test_a_page_put_with_one_identity_tag_is_an_identity_miss_under_another(
    memory: tuple[MemoryStore, SealedPageStore],
) -> None:
    _, store = memory
    assert store.put([("a", b"A" * 16)], tag=b"\x01" * 8) == [True]
    assert store.get(["a"], tag=b"\x02" * 8) == [None]
    assert store.get(["a"]) == [None]  # the default tag (namespace and pool) is another identity too
    assert store.statistics().broken == {"identity": 2}
    assert bytes(store.get(["a"], tag=b"\x01" * 8)[0] or b"") == b"A" * 16


def test_store_faults_are_misses_never_exceptions() -> None:
    mem = MemoryStore(fail_probability=1.0)
    with SealedPageStore(lambda: mem, NS, timeout_s=5) as store:
        assert store.put([("a", b"x")]) == [False]
        assert store.exists(["a", "b"]) == [False, False]
        assert store.get(["a"]) == [None]
        assert store.statistics().faults == 3


class _ShortStore(MemoryStore):
    """A store with a bug: while ``short``, it answers one entry fewer than it was asked."""

    short = True

    async def exists(self, keys):  # type: ignore[no-untyped-def]
        found = await super().exists(keys)
        return found[:-1] if self.short else found

    async def get(self, keys, pools):  # type: ignore[no-untyped-def]
        got = await super().get(keys, pools)
        return got[:-1] if self.short else got


def test_every_page_read_is_counted_once_hit_miss_refused_or_failed() -> None:
    mem = _ShortStore()
    with SealedPageStore(lambda: mem, NS, timeout_s=5) as store:
        assert store.put([(k, b"x" * 8) for k in "abc"]) == [True] * 3
        # an answer of another length is a fault: never matched up page by page
        assert store.exists(["a", "b"]) == [False, False]
        assert store.get(["a", "b"]) == [None, None]
        mem.short = False
        mem.corrupt(NS.key("b"), "kv", SEAL_HEADER_BYTES + 1)
        assert [p is not None for p in store.get(["a", "b", "z"], nbytes=8)] == [True, False, False]
        s = store.statistics()
        assert (s.get_pages, s.get_hits, s.get_misses, s.get_refused, s.get_failed) == (5, 1, 1, 1, 2)
        assert s.faults == 2 and s.broken == {"checksum": 1}


def test_a_store_dropped_without_close_ends_its_thread() -> None:
    import gc

    stores = [SealedPageStore(MemoryStore, NS, timeout_s=5, thread_name="kvtier-dropped") for _ in range(3)]
    threads = [t for t in threading.enumerate() if t.name == "kvtier-dropped"]
    assert len(threads) == 3 and all(s.put([("a", b"x")]) == [True] for s in stores)
    del stores
    gc.collect()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def test_a_store_that_does_not_answer_is_a_miss_within_the_timeout() -> None:
    mem = MemoryStore()
    with SealedPageStore(lambda: mem, NS, timeout_s=0.2) as store:
        store.put([("a", b"x" * 8)])
        mem.hold(["get"])
        assert store.get(["a"]) == [None]
        mem.release()
        assert bytes(store.get(["a"])[0] or b"") == b"x" * 8
        assert store.statistics().faults == 1


def test_a_closed_store_answers_misses(memory: tuple[MemoryStore, SealedPageStore]) -> None:
    _, store = memory
    store.put([("a", b"x")])
    store.close()
    assert store.get(["a"]) == [None] and store.exists(["a"]) == [False] and store.put([("a", b"x")]) == [False]


def test_a_store_that_cannot_open_fails_at_start() -> None:
    def broken() -> StorageBackend:
        raise OSError("no such device")

    with pytest.raises(ConfigurationError, match="could not open the store for 'test': no such device"):
        SealedPageStore(broken, NS)


def test_a_store_that_does_not_open_in_time_fails_at_start_saying_so() -> None:
    class Hangs(MemoryStore):
        async def __aenter__(self) -> Hangs:
            await asyncio.sleep(30)
            return self

    with pytest.raises(ConfigurationError) as e:
        SealedPageStore(Hangs, NS, timeout_s=0.2)
    assert str(e.value) == "could not open the store for 'test': it did not open within timeout_s=0.2 s"


def test_many_engine_threads_share_one_loop_thread(memory: tuple[MemoryStore, SealedPageStore]) -> None:
    _, store = memory
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(10):
                key = f"t{t}-{i}"
                payload = bytes([t, i]) * 32
                assert store.put([(key, payload)]) == [True]
                assert bytes(store.get([key])[0] or b"") == payload
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert store.statistics().get_hits == 40


@pytest.mark.parametrize(
    "backend",
    ["memory", "file", pytest.param("redis", marks=needs_redis_server), pytest.param("cluster", marks=needs_redis_server)],
)
def test_clear_removes_this_stores_pages_only(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    def opener(scope: str) -> Callable[[], StorageBackend]:
        if backend == "memory":
            mem = MemoryStore()
            return lambda: mem
        if backend == "file":
            return lambda: FileStore(tmp_path / scope)
        if backend == "cluster":
            cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
            return lambda: RedisStore(cluster.url, cluster=True, prefix=f"clear-{scope}:")
        server: LocalRedisServer = request.getfixturevalue("redis_server")
        return lambda: RedisStore(server.url, prefix=f"clear-{scope}:")

    mine = SealedPageStore(opener("a"), NS)
    theirs = SealedPageStore(opener("b"), NS)
    try:
        for s in (mine, theirs):
            s.put([(f"k{i}", b"p" * 16) for i in range(40)])  # spread over a cluster's nodes
        assert mine.clear() is True
        assert mine.exists([f"k{i}" for i in range(40)]) == [False] * 40
        assert theirs.exists([f"k{i}" for i in range(40)]) == [True] * 40
        mine.put([("k0", b"q" * 16)])  # still usable after a clear
        assert bytes(mine.get(["k0"])[0] or b"") == b"q" * 16
    finally:
        mine.close()
        theirs.close()


@needs_redis_server
def test_a_killed_redis_server_is_misses_then_hits_again(fresh_server: Callable[..., LocalRedisServer]) -> None:
    server = fresh_server()
    with SealedPageStore(lambda: RedisStore(server.url, timeout_s=1.0), NS, timeout_s=5) as store:
        assert store.put([("a", b"A" * 32)]) == [True]
        server.kill()
        assert store.get(["a"]) == [None]
        assert store.exists(["a"]) == [False]
        assert store.put([("b", b"B" * 32)]) == [False]
        assert store.statistics().faults == 3
        server.start()  # a fresh, empty server on the same port
        assert store.put([("b", b"B" * 32)]) == [True]
        assert bytes(store.get(["b"])[0] or b"") == b"B" * 32


# -- lifecycle and bad input -------------------------------------------------------


def _wait_for(condition: Callable[[], bool], what: str, within_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {within_s} s")
        time.sleep(0.01)


def _call_in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("operation", ["get", "exists", "put"])
def test_close_ends_a_call_in_flight_at_once_as_a_miss(operation: str) -> None:
    """A call waiting on a store that does not answer ends when the store is
    closed, long before ``timeout_s`` (here 300 s; the bound below is 60 s)."""
    mem = MemoryStore()
    store = SealedPageStore(lambda: mem, NS, timeout_s=300)
    assert store.put([("a", b"x" * 8)]) == [True]
    mem.hold([operation])
    calls: dict[str, Callable[[], object]] = {
        "get": lambda: store.get(["a"]),
        "exists": lambda: store.exists(["a"]),
        "put": lambda: store.put([("b", b"y" * 8)]),
    }
    thread, out = _call_in_thread(calls[operation])
    _wait_for(lambda: bool(mem.waiting), "the call reaching the store")
    store.close()
    thread.join(60)
    assert not thread.is_alive(), "close() left the call in flight blocked"
    assert out == [{"get": [None], "exists": [False], "put": [False]}[operation]]
    assert store.statistics().faults == 1
    assert store.get(["a"]) == [None]  # closed: misses from now on


class _StuckInAThread:
    """A store whose reads block in a worker thread until ``gate`` is set: not
    even cancelling the loop's task frees its caller (anyio's to_thread waits)."""

    name = "stuck"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    async def exists(self, keys: object) -> list[bool]:
        import anyio.to_thread

        self.entered.set()
        await anyio.to_thread.run_sync(self.gate.wait)
        return [False] * len(keys)  # type: ignore[arg-type]

    get = exists  # type: ignore[assignment]

    async def put(self, pages: object) -> None:
        return None

    async def aclose(self) -> None:
        return None


def test_close_ends_a_call_blocked_in_a_store_thread_at_once() -> None:
    stuck = _StuckInAThread()
    store = SealedPageStore(lambda: stuck, NS, timeout_s=300)  # type: ignore[arg-type, return-value]
    try:
        thread, out = _call_in_thread(lambda: store.exists(["a", "b"]))
        assert stuck.entered.wait(30)
        store.close()
        thread.join(60)
        assert not thread.is_alive(), "close() left the call in flight blocked"
        assert out == [[False, False]]
    finally:
        stuck.gate.set()


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0, -1.0, "5", True, None, 1e300])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused_naming_it(timeout: object) -> None:
    opened: list[MemoryStore] = []
    import re

    with pytest.raises(ConfigurationError, match=rf"timeout_s must be a finite number of seconds > 0 .*; got {re.escape(repr(timeout))}"):
        SealedPageStore(lambda: opened.append(MemoryStore()) or opened[-1], NS, timeout_s=timeout)  # type: ignore[arg-type]
    assert opened == []  # refused before anything opened


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        ("a str", "str"),
        (12, "int"),
        ([1, 2, 3], "list"),
        (None, "NoneType"),
        (torch.empty(4, device="meta"), "tensor on meta"),
        (memoryview(bytes(range(16)))[::2], "memoryview that is not contiguous"),
    ],
    ids=["str", "int", "list", "none", "meta-tensor", "strided-memoryview"],
)
def test_an_unsupported_put_payload_is_refused_naming_it_and_nothing_is_stored(
    memory: tuple[MemoryStore, SealedPageStore], payload: object, named: str
) -> None:
    from kvtier.errors import KvtierError
    from kvtier.storage.sealed import UnsupportedPayload

    mem, store = memory
    with pytest.raises(UnsupportedPayload, match=rf"payload 1 \(key 'bad'\): the payload is a {named}") as info:
        store.put([("good", b"g" * 8), ("bad", payload)])  # type: ignore[list-item]
    assert isinstance(info.value, KvtierError) and isinstance(info.value, TypeError)
    assert mem.pages == {} and store.exists(["good"]) == [False]  # nothing of the batch was stored
    assert store.statistics().put_pages == 0


def test_the_probe_round_trips_one_page_and_names_a_store_that_cannot_work(
    memory: tuple[MemoryStore, SealedPageStore],
) -> None:
    from kvtier.storage import StorageError

    mem, store = memory
    store.probe()
    assert len(mem.pages) == 1  # one small page, in the namespace's probe pool
    ((pools),) = mem.pages.values()
    assert set(pools) == {"probe"}
    with SealedPageStore(lambda: MemoryStore(fail_probability=1.0), NS, timeout_s=5) as failing:
        with pytest.raises(StorageError, match="the probe page failed"):
            failing.probe()
    held = MemoryStore()
    with SealedPageStore(lambda: held, NS, timeout_s=0.3) as silent:
        held.hold(["put"])
        with pytest.raises(StorageError, match=r"no answer within 0\.3 s"):
            silent.probe()
        _wait_for(lambda: not held.waiting, "the probe's put being cancelled, not left held")


# -- the sealed format pinned, every refusal by its message (the mutants `make mutate` found surviving) --

_KEY = bytes(range(32))


def test_a_sealed_blob_is_the_same_bytes_in_every_release() -> None:
    """Header (magic, version, three zero bytes, payload length, the tag's digest,
    the checksum over the key's length, the key, the header and the payload), then the payload."""
    blob = seal(_KEY, b"\xffpayload", tag="kv")
    assert blob.hex() == ("4b565453" "02" "000000" "0800000000000000" "315ea5777716fb9e" "ccefbe24142b6c62"
                          "ff7061796c6f6164")
    assert bytes(seal_tensor(_KEY, torch.tensor(list(b"\xffpayload"), dtype=torch.uint8), tag="kv")) == bytes(blob)
    in_place = new_sealed(8)
    in_place[SEAL_HEADER_BYTES:] = b"\xffpayload"
    seal_in_place(_KEY, in_place, tag="kv")
    assert bytes(in_place) == bytes(blob)
    payload = open_sealed(_KEY, bytes(blob), tag="kv", nbytes=8)
    assert payload.format == "B" and payload[0] == 0xFF and bytes(payload) == b"\xffpayload"


def test_the_default_tag_is_the_empty_string_everywhere() -> None:
    for blob in (seal(_KEY, b"abc"), seal_tensor(_KEY, torch.tensor([1, 2], dtype=torch.int16))):
        assert bytes(open_sealed(_KEY, blob, tag="")) == bytes(open_sealed(_KEY, blob))
        with pytest.raises(SealBroken) as refused:
            open_sealed(_KEY, blob, tag="kv")
        assert refused.value.rule == "identity"
    blob = new_sealed(0)
    seal_in_place(_KEY, blob)
    assert bytes(open_sealed(_KEY, blob, tag="")) == b""
    assert bytes(seal(_KEY, b"", tag="")) == bytes(blob)  # an empty payload is a whole blob


def test_a_tensor_is_sealed_in_c_order_whatever_its_strides() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous
    assert bytes(open_sealed(_KEY, seal_tensor(_KEY, t), nbytes=48)) == t.contiguous().numpy().tobytes()
    assert bytes(open_sealed(_KEY, seal_tensor(_KEY, torch.ones(2, dtype=torch.bfloat16)))) == b"\x80\x3f" * 2


def _opened(blob: bytes, **kw: object) -> SealBroken:
    with pytest.raises(SealBroken) as refused:
        open_sealed(_KEY, blob, **kw)  # type: ignore[arg-type]
    assert refused.value.key == _KEY and refused.value.operation == "open"
    return refused.value


def test_open_sealed_names_each_rule_and_what_it_found() -> None:
    good = bytes(seal(_KEY, b"payload", tag="kv"))
    prefix = "sealed page 0001020304050607: "
    e = _opened(good[:SEAL_HEADER_BYTES - 1], tag="kv")
    assert (e.rule, str(e)) == ("header", prefix + f"{SEAL_HEADER_BYTES - 1} bytes is shorter than the "
                                f"{SEAL_HEADER_BYTES}-byte header")
    assert bytes(open_sealed(_KEY, seal(_KEY, b""))) == b""  # exactly a header is a whole (empty) blob
    e = _opened(b"KVTX" + good[4:], tag="kv")
    assert (e.rule, str(e)) == ("header", prefix + "no sealed-blob tag (starts b'KVTX'): another format")
    e = _opened(good[:4] + b"\x09" + good[5:], tag="kv")
    assert (e.rule, str(e)) == ("version", prefix + "format version 9; this kvtier reads 2")
    e = _opened(good + b"x", tag="kv")
    assert (e.rule, str(e)) == ("length", prefix + "header says 7 payload bytes; 8 are stored")
    e = _opened(good, tag="kv", nbytes=6)
    assert (e.rule, str(e)) == ("length", prefix + "payload of 7 bytes; the caller expects 6")
    e = _opened(good[:-1] + b"X", tag="kv")
    assert (e.rule, str(e)) == ("checksum", prefix + "checksum does not match (bytes changed, or sealed under another key)")


@pytest.mark.parametrize("nbytes", [-1, "3", 1.0, True])
def test_new_sealed_needs_a_size(nbytes: object) -> None:
    with pytest.raises(ConfigurationError) as refused:
        new_sealed(nbytes)  # type: ignore[arg-type]
    assert str(refused.value) == f"a sealed payload has an integer size >= 0; got {nbytes!r}"


def test_seal_in_place_needs_a_writable_blob_with_room_for_the_header() -> None:
    with pytest.raises(ConfigurationError) as refused:
        seal_in_place(_KEY, bytearray(3))
    assert str(refused.value) == (f"seal_in_place needs a writable blob of at least {SEAL_HEADER_BYTES} bytes "
                                  "(from new_sealed); got a writable blob of 3 bytes")
    with pytest.raises(ConfigurationError) as refused:
        seal_in_place(_KEY, memoryview(bytes(SEAL_HEADER_BYTES + 4)))  # type: ignore[arg-type]
    assert str(refused.value) == (f"seal_in_place needs a writable blob of at least {SEAL_HEADER_BYTES} bytes "
                                  f"(from new_sealed); got a read-only blob of {SEAL_HEADER_BYTES + 4} bytes")


def test_a_tag_that_is_neither_text_nor_a_digest_is_refused() -> None:
    with pytest.raises(ConfigurationError) as refused:
        seal(_KEY, b"x", tag=7)  # type: ignore[arg-type]
    assert str(refused.value) == "a sealed blob's tag is a string or 8 bytes; got 7"


def test_unsupported_payloads_name_their_type() -> None:
    with pytest.raises(UnsupportedPayload) as refused:
        seal_tensor(_KEY, [1, 2])  # type: ignore[arg-type]
    assert (str(refused.value), refused.value.value_type) == ("seal_tensor seals a tensor; got a list", "list")
    with pytest.raises(UnsupportedPayload) as refused:
        seal_tensor(_KEY, torch.empty(4, device="meta"))
    assert refused.value.value_type == "Tensor" and str(refused.value).startswith("the payload is a tensor on meta: ")
    with pytest.raises(UnsupportedPayload) as refused:
        seal(_KEY, 3)  # type: ignore[arg-type]
    assert refused.value.value_type == "int" and str(refused.value).startswith("the payload is a int: ")
    with pytest.raises(UnsupportedPayload) as refused:
        seal(_KEY, memoryview(bytearray(8))[::2])
    assert refused.value.value_type == "memoryview"
    assert str(refused.value).startswith("the payload is a memoryview that is not contiguous (shape (4,), strides (2,)): ")
