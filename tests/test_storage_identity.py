"""One page identity: what it holds, what it refuses, and the keys that derive from it."""

from __future__ import annotations

import dataclasses
import pickle
import re
import secrets
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from conftest import needs_redis_server, pages

from kvtier import TransferScheduler

from kvtier.errors import ConfigurationError
from kvtier.storage import EngineIdentity, EngineNamespace, KeyNamespace, PageIdentity, PlaneFormat, PoolFormat, Shard
from kvtier.pools import DevicePool, HostPool, PoolGroup
from kvtier.storage import FileStore, PageBlobs, PageCorrupted, RedisStore, StorageBackend, decode_page, encode_page, page_keys
from kvtier.testing import device_rows, hybrid_group
from kvtier.testing.redis_server import LocalRedisServer

# Roots of KeyNamespace.for_pool(hybrid_group(layout=...), pool, model="m", extra=["x=1"]) as kvtier
# gave them before the identity existed (computed from commit 0a65281): keys must not change.
FOR_POOL_PINS = {
    ("layer_first", "kv"): "1f7905351c6bcaacc5f6578ec248e03906abaf66d561a7ee28ffc3465622289c",
    ("layer_first", "swa"): "4763a6dbde4a31e63f6fee4fe54de6000c123eef2f463fe7f435414244f11968",
    ("layer_first", "state"): "6cd6a441f4e47263757786e0c4f22f374f8a6237bb4b973715a0dfe20c2b4700",
    ("layer_first", "tok"): "d1c932ba20d3018db8f7b2a47e58d284eab2faa9485396002f81f5853467f42f",
    # A page_first host pool stores the same bytes as a layer_first one (issue 44 A4): its keys
    # are layer_first's now (they were 0b94d439... and 1894d518... while the layout named them).
    ("page_first", "kv"): "1f7905351c6bcaacc5f6578ec248e03906abaf66d561a7ee28ffc3465622289c",
    ("page_first", "tok"): "d1c932ba20d3018db8f7b2a47e58d284eab2faa9485396002f81f5853467f42f",
}


@pytest.mark.parametrize(("layout", "pool"), sorted(FOR_POOL_PINS))
def test_kvtier_keys_are_the_ones_for_pool_always_gave(layout: str, pool: str) -> None:
    group = hybrid_group(layout=layout)  # type: ignore[arg-type]
    ident = PageIdentity.for_pool(group, pool, model="m", extra=["x=1"])
    assert ident.namespace().root().hex() == FOR_POOL_PINS[(layout, pool)]
    assert KeyNamespace.for_pool(group, pool, model="m", extra=["x=1"]) == ident.namespace()
    assert EngineIdentity("m", extra=("x=1",)).page_identity(group, pool) == ident


def test_the_identity_holds_each_pool_of_a_stored_page() -> None:
    group = hybrid_group()
    ident = PageIdentity.for_pool(group, "kv", model="m")
    assert [p.name for p in ident.pools] == ["kv", "c4"]  # the anchor, then its sidecars
    kv, c4 = ident.pools
    assert (kv.kind, kv.layout, kv.rows, kv.layers, kv.shard) == ("pool", "layer_first", 8, 4, None)
    assert kv.planes == (PlaneFormat((2, 8), "float32", 4),) * 2
    assert (c4.kind, c4.rows) == ("sidecar", 2) and c4.planes[0].format == "bfloat16"
    tok = PageIdentity.for_pool(group, "tok", model="m")
    assert tok.anchor.kind == "logical" and tok.anchor.planes == () and tok.anchor.layout == "none"
    # The layout recorded is the stored order, the same for either host layout.
    assert PageIdentity.for_pool(hybrid_group(layout="page_first"), "kv", model="m") == ident


def test_a_format_the_dtype_cannot_say_is_part_of_the_identity() -> None:
    group = hybrid_group()
    plain = PageIdentity.for_pool(group, "state", model="m")
    assert [p.format for p in plain.anchor.planes] == ["float32", "int8"]
    fp8 = PageIdentity.for_pool(group, "state", model="m", formats={"state": ["float32", "float8_e4m3fn"]})
    e5 = PageIdentity.for_pool(group, "state", model="m", formats={"state": ["float32", "float8_e5m2"]})
    assert len({plain.digest(), fp8.digest(), e5.digest()}) == 3
    assert len({plain.namespace().root(), fp8.namespace().root(), e5.namespace().root()}) == 3
    with pytest.raises(ConfigurationError, match=r"names 'bfloat16' \(2-byte elements\) for a plane held as int8"):
        PageIdentity.for_pool(group, "state", model="m", formats={"state": ["float32", "bfloat16"]})
    with pytest.raises(ConfigurationError, match=r"one format name or one per plane \(2 planes\)"):
        PageIdentity.for_pool(group, "state", model="m", formats={"state": ["float32"]})
    with pytest.raises(ConfigurationError, match=r"formats name pools \['nope'\]"):
        PageIdentity.for_pool(group, "state", model="m", formats={"nope": "uint8"})


def test_shards_are_decided_per_pool() -> None:
    group = hybrid_group()
    whole = PageIdentity.for_pool(group, "kv", model="m")
    side = PageIdentity.for_pool(group, "kv", model="m", shards={"c4": Shard(1, 2)})
    anchor = PageIdentity.for_pool(group, "kv", model="m", shards={"kv": Shard(1, 2)})
    other_rank = PageIdentity.for_pool(group, "kv", model="m", shards={"kv": Shard(0, 2)})
    assert side.anchor.shard is None and side.pool("c4").shard == Shard(1, 2)
    digests = {i.digest() for i in (whole, side, anchor, other_rank)}
    roots = {i.namespace().root() for i in (whole, side, anchor, other_rank)}
    assert len(digests) == 4 and len(roots) == 4
    # One shard of a world of one is the whole pool.
    assert PageIdentity.for_pool(group, "kv", model="m", shards={"kv": Shard(0, 1)}) == whole


def test_tags_bind_identity_and_pool() -> None:
    group = hybrid_group()
    a = PageIdentity.for_pool(group, "kv", model="m")
    b = PageIdentity.for_pool(group, "kv", model="n")
    assert len(a.tag("kv")) == 8
    assert len({a.tag("kv"), a.tag("c4"), b.tag("kv"), b.tag("c4")}) == 4
    assert a.tag("kv") == PageIdentity.for_pool(hybrid_group(seed=3), "kv", model="m").tag("kv")  # bytes do not matter
    with pytest.raises(ConfigurationError, match=r"pool 'swa' is not part of this page identity"):
        a.tag("swa")


def test_engine_namespace_of_a_lone_pool_is_what_engine_namespace_gave() -> None:
    plane = PlaneFormat((576,), "bfloat16", 2)
    pool = PoolFormat("kv", "MLATokenToKVPoolHost", "layer_first", 64, 61, (plane,), Shard(1, 4))
    ident = PageIdentity("deepseek-v3", "sglang-hicache-v1", (pool,), extra=("pool=MLA", "page_bytes=9"))
    before = EngineNamespace(engine="sglang-hicache-v1", model="deepseek-v3", page_size=64, dtype="bfloat16",
                             layout="layer_first", tp_rank=1, tp_size=4, extra=("pool=MLA", "page_bytes=9"))
    assert ident.engine_namespace() == before
    assert before.key("abc").hex() == "6b08a6054caeed30703abae571f2534313e85d79db52013223e54bf50a12e8fc"


def test_every_field_is_validated_with_its_name_and_value() -> None:
    plane = PlaneFormat((2,), "float32", 4)
    pool = PoolFormat("kv", "pool", "layer_first", 4, 2, (plane,))
    cases = [
        (lambda: PageIdentity("", "kvtier", (pool,)), r"'model' must be a non-empty string; got ''"),
        (lambda: PageIdentity("m", "", (pool,)), r"'scheme' must be a non-empty string"),
        (lambda: PageIdentity("m", "kvtier", ()), r"'pools' must be a non-empty tuple"),
        (lambda: PageIdentity("m", "kvtier", (pool, pool)), r"must name each pool once; got \['kv', 'kv'\]"),
        (lambda: PageIdentity("m", "kvtier", (pool,), extra=("a", 1)), r"'extra' must be a tuple of strings"),  # type: ignore[arg-type]
        (lambda: PageIdentity("m", "kvtier", (pool,), version=0), r"'version' must be a positive integer; got 0"),
        (lambda: dataclasses.replace(pool, rows=0), r"'rows' must be a positive integer \(rows per page\); got 0"),
        (lambda: dataclasses.replace(pool, layers=-1), r"'layers' must be a non-negative integer; got -1"),
        (lambda: dataclasses.replace(pool, layout=""), r"'layout' must be a non-empty string"),
        (lambda: dataclasses.replace(pool, shard=(0, 2)), r"'shard' must be a Shard or None"),  # type: ignore[arg-type]
        (lambda: PlaneFormat((2,), "float8_e4m3fn", 2), r"'element_size' must be 1 for format 'float8_e4m3fn'"),
        (lambda: PlaneFormat((-1,), "uint8", 1), r"'shape' must be a tuple of non-negative integers"),
        (lambda: PlaneFormat((1,), "", 1), r"'format' must be a non-empty string"),
        (lambda: Shard(2, 2), r"'rank' must be an integer in 0..1 \(world=2\); got 2"),
        (lambda: Shard(0, 0), r"'world' must be a positive integer; got 0"),
        (lambda: EngineIdentity(""), r"'model' must be a non-empty string"),
        (lambda: EngineIdentity("m", shards={"kv": (0, 2)}), r"'shards' must map pool names to Shard"),  # type: ignore[dict-item]
    ]
    for make, message in cases:
        with pytest.raises(ConfigurationError, match=message):
            make()


def test_vllm_block_identity_gives_vllm_roots() -> None:
    ident = PageIdentity.for_vllm_block(model="m|float32", block_size=32, dtype="float32", num_layers=2,
                                        block_bytes=32768)
    assert ident.anchor.planes == (PlaneFormat((8192,), "float32", 4),)
    with pytest.raises(ConfigurationError, match=r"positive multiple of float32's 4-byte elements; got 32769"):
        PageIdentity.for_vllm_block(model="m", block_size=32, dtype="float32", num_layers=2, block_bytes=32769)
    with pytest.raises(ConfigurationError, match="one vLLM block pool"):
        PageIdentity.for_pool(hybrid_group(), "kv", model="m").vllm_root()


# -- through the scheduler and real stores: a page of another identity is a counted miss ----------

PS_WRITER, PS_READER = 4, 8
WAIT_S = 30


def paged_group(*, page_size: int, seed: int, layers: int = 2, shape: tuple[int, ...] = (2, 8),
                dtype: torch.dtype = torch.bfloat16, layout: str = "layer_first", name: str = "kv",
                slots: int = 32) -> PoolGroup:
    """One pool of random rows (the same shapes whatever the page size)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(slots, *shape, generator=gen).to(dtype) if dtype.is_floating_point
               else torch.randint(0, 256, (slots, *shape), generator=gen).to(dtype) for _ in range(layers)]
    group = PoolGroup()
    group.add_pool(name, device=DevicePool(tensors), page_size=page_size, host_slots=slots,
                   layout=layout, pin_memory=False)  # type: ignore[arg-type]
    return group


def host_bytes(group: PoolGroup, pool: str = "kv") -> list[torch.Tensor]:
    host = group[pool].host
    assert isinstance(host, HostPool)
    return [host.buffer(p).reshape(-1).view(torch.uint8).clone() for p in range(len(host.planes))]  # NaN-safe


async def _store_page(sched: TransferScheduler, ps: int, key: bytes) -> tuple[int, int]:
    """Back up device page 0 and write it under ``key``: (pages written, pages present)."""
    with anyio.fail_after(WAIT_S):
        b = await sched.backup({"kv": pages(0, page_size=ps)})
        await b
        w = await (await sched.write_storage({"kv": b.host_indices["kv"]}, {"kv": [key]}))
    sched.free_host({"kv": b.host_indices["kv"]})
    return w.pages_written["kv"], w.pages_present["kv"]


async def test_a_page_of_another_page_size_is_a_miss_counted_identity_and_repaired(
    open_store: Callable[[], StorageBackend]
) -> None:
    """The issue's reproduction: an engine of page size 4 and one of page size 8
    store under one user-made key. The reader's prefetch finds the key, refuses
    the page by its identity (no row of it lands: the host pool is unchanged),
    counts it, and its own next write replaces it; then it hits, byte-exact."""
    key = b"user-doc-17:page-0"
    writer, reader = paged_group(page_size=PS_WRITER, seed=1), paged_group(page_size=PS_READER, seed=2)
    async with open_store() as store:
        async with TransferScheduler(writer, storage=store, identity=EngineIdentity("m")) as w:
            assert await _store_page(w, PS_WRITER, key) == (1, 0)
        async with TransferScheduler(reader, storage=store, identity=EngineIdentity("m")) as r:
            before = host_bytes(reader)
            with anyio.fail_after(WAIT_S):
                got = await (await r.prefetch({"kv": [key]}))
            assert (got.pages["kv"], got.hit_pages["kv"], got.complete) == (0, 0, False)  # the hit ends at it
            assert all(torch.equal(a, b) for a, b in zip(before, host_bytes(reader)))  # no row landed
            stats = r.statistics().storage
            assert stats is not None
            assert (stats.pages_rejected, stats.pages_rejected_by_rule, stats.keys_to_rewrite) == (1, {"identity": 1}, 1)
            # The store says present; the reader's write puts it again all the same.
            assert await store.exists([key]) == [True]
            assert await _store_page(r, PS_READER, key) == (1, 0)
            with anyio.fail_after(WAIT_S):
                got = await (await r.prefetch({"kv": [key]}, policy="wait_complete"))
                assert got.complete and got.pages["kv"] == 1
                dev = pages(1, page_size=PS_READER)  # another device page: the bytes come from the store
                load = await r.load(dict(got.host_indices), {"kv": dev})
                await load
            r.free_host(dict(got.host_indices))
            want = device_rows(reader, "kv", pages(0, page_size=PS_READER))
            have = device_rows(reader, "kv", dev)
            assert len(have) == len(want) == 2
            for a_layer, b_layer in zip(have, want):
                for a, b in zip(a_layer, b_layer):
                    assert torch.equal(a, b)
        # And the writer now refuses the reader's page in turn: never the other's rows.
        async with TransferScheduler(paged_group(page_size=PS_WRITER, seed=3), storage=store,
                                     identity=EngineIdentity("m")) as w2:
            with anyio.fail_after(WAIT_S):
                got = await (await w2.prefetch({"kv": [key]}))
            assert got.pages["kv"] == 0
            stats = w2.statistics().storage
            assert stats is not None and stats.pages_rejected_by_rule == {"identity": 1}


async def test_a_blob_of_format_2_is_a_miss_by_version_and_rewritten(open_store: Callable[[], StorageBackend]) -> None:
    """What kvtier stored before the identity (format 2: a pool tag of the name alone)."""
    import hashlib

    key = b"doc:0"
    group = paged_group(page_size=PS_READER, seed=4)
    async with open_store() as store, TransferScheduler(group, storage=store) as sched:
        assert await _store_page(sched, PS_READER, key) == (1, 0)
        (blobs,) = await store.get([key], ["kv"])
        assert blobs is not None
        old = bytearray(blobs["kv"])
        old[4] = 2
        old[16:24] = hashlib.blake2b(b"kv", digest_size=8, person=b"kvtier-pool").digest()
        await store.put([PageBlobs(key, {"kv": bytes(old)})])
        with anyio.fail_after(WAIT_S):
            got = await (await sched.prefetch({"kv": [key]}))
        assert got.pages["kv"] == 0
        stats = sched.statistics().storage
        assert stats is not None and stats.pages_rejected_by_rule == {"version": 1}
        assert await _store_page(sched, PS_READER, key) == (1, 0)
        with anyio.fail_after(WAIT_S):
            got = await (await sched.prefetch({"kv": [key]}))
        assert got.pages["kv"] == 1
        sched.free_host(dict(got.host_indices))


# -- property: engines that differ in one identity field never share a page; equal ones do --------

FIELDS = ("model", "scheme", "extra", "version", "name", "kind", "rows", "layers", "shape",
          "element_size", "format", "shard_rank", "shard_world", "cut")
# Choices that change no stored byte, so engines that differ in them alone share pages.
SHARED = ("same", "host_layout")


@dataclasses.dataclass(frozen=True)
class Engine:
    """An engine's choices: everything a PageIdentity of one pool holds."""

    model: str = "m"
    scheme: str = "kvtier"
    extra: tuple[str, ...] = ()
    version: int = 1
    name: str = "kv"
    kind: str | None = None  # None: the group's ("pool")
    layout: str = "layer_first"
    rows: int = 4
    layers: int = 2
    shape: tuple[int, ...] = (2, 4)
    element_size: int = 1  # uint8 or int16 planes
    format: str | None = None  # None: the dtype's name
    shard: tuple[int, int] | None = None
    cut: str = ""

    def group(self, seed: int) -> PoolGroup:
        dtype = torch.uint8 if self.element_size == 1 else torch.int16
        return paged_group(page_size=self.rows, seed=seed, layers=self.layers, shape=self.shape, dtype=dtype,
                           layout=self.layout, name=self.name, slots=16)

    def identity(self, group: PoolGroup) -> PageIdentity:
        shards = {self.name: Shard(*self.shard, cut=self.cut)} if self.shard is not None else {}
        formats = {self.name: self.format} if self.format is not None else {}
        ident = PageIdentity.for_pool(group, self.name, model=self.model, scheme=self.scheme, shards=shards,
                                      formats=formats, extra=self.extra)
        if self.kind is not None:
            ident = dataclasses.replace(ident, pools=(dataclasses.replace(ident.anchor, kind=self.kind),))
        return dataclasses.replace(ident, version=self.version) if self.version != 1 else ident


def changed(e: Engine, what: str, draw: st.DrawFn) -> Engine:
    """``e`` with field ``what`` alone changed (to a value the draw picks)."""
    one_byte = ("float8_e4m3fn", "float8_e5m2", "int8", "fp4x2")
    if what == "model":
        return dataclasses.replace(e, model=e.model + draw(st.sampled_from(["-r2", "@fp8", " "])))
    if what == "scheme":
        return dataclasses.replace(e, scheme=draw(st.sampled_from(["vllm", "sglang-hicache-v1", "custom"])))
    if what == "extra":
        return dataclasses.replace(e, extra=(*e.extra, draw(st.sampled_from(["rope=2", "pp=1/2", ""]))))
    if what == "version":
        return dataclasses.replace(e, version=e.version + draw(st.integers(1, 3)))
    if what == "name":
        return dataclasses.replace(e, name=draw(st.sampled_from(["kv2", "swa", "state"])))
    if what == "kind":
        return dataclasses.replace(e, kind=draw(st.sampled_from(["sidecar", "logical", "mamba"])))
    if what == "host_layout":
        return dataclasses.replace(e, layout="page_first" if e.layout == "layer_first" else "layer_first")
    if what == "rows":
        return dataclasses.replace(e, rows=draw(st.sampled_from([r for r in (1, 2, 4, 8) if r != e.rows])))
    if what == "layers":
        return dataclasses.replace(e, layers=e.layers + draw(st.sampled_from([-1, 1])) if e.layers > 1 else 2)
    if what == "shape":
        return dataclasses.replace(e, shape=draw(st.sampled_from([s for s in ((2, 4), (4, 2), (8,), (2, 2, 2))
                                                                 if s != e.shape])))
    if what == "element_size":
        return dataclasses.replace(e, element_size=3 - e.element_size, format=None)
    if what == "format":
        assert e.element_size == 1
        return dataclasses.replace(e, format=draw(st.sampled_from([f for f in one_byte if f != e.format])))
    if what == "shard_rank":
        assert e.shard is not None
        return dataclasses.replace(e, shard=((e.shard[0] + 1) % e.shard[1], e.shard[1]))
    if what == "shard_world":
        if e.shard is None:
            return dataclasses.replace(e, shard=(0, 2))
        return dataclasses.replace(e, shard=(e.shard[0], e.shard[1] + 1))
    assert what == "cut" and e.shard is not None
    return dataclasses.replace(e, cut=e.cut + "|tp=2")


@st.composite
def engine_pairs(draw: st.DrawFn, what: str) -> tuple[Engine, Engine]:
    e = Engine(
        model=draw(st.sampled_from(["llama-3-8b@abc", "m", "deepseek-v3|fp8"])),
        extra=tuple(draw(st.lists(st.sampled_from(["tp=0", "x=1"]), max_size=2))),
        layout=draw(st.sampled_from(["layer_first", "page_first"])),
        rows=draw(st.sampled_from([1, 2, 4, 8])),
        layers=draw(st.integers(1, 3)),
        shape=draw(st.sampled_from([(2, 4), (4, 2), (8,)])),
        element_size=draw(st.sampled_from([1, 2])),
        shard=draw(st.sampled_from([None, (0, 2), (1, 2), (2, 4)])),
    )
    if e.element_size == 1:
        e = dataclasses.replace(e, format=draw(st.sampled_from([None, "float8_e4m3fn", "float8_e5m2"])))
    if e.shard is not None:
        e = dataclasses.replace(e, cut=draw(st.sampled_from(["", "tp=2|pp=1"])))
    # The fields that exist only with another: a format override of one-byte
    # elements, a rank and a cut of a sharded pool.
    if what == "format" and e.element_size != 1:
        e = dataclasses.replace(e, element_size=1)
    if what in ("shard_rank", "cut") and e.shard is None:
        e = dataclasses.replace(e, shard=(1, 2))
    return e, (e if what == "same" else changed(e, what, draw))


def _through_store(make_store: Callable[[], StorageBackend], key: bytes, blobs: dict[str, bytearray],
                   pools: list[str]) -> dict[str, bytes] | None:
    async def run() -> dict[str, bytes] | None:
        async with make_store() as store:
            await store.put([PageBlobs(key, blobs)])
            (got,) = await store.get([key], pools)
            return None if got is None else {n: bytes(b) for n, b in got.items()}

    return anyio.run(run)


@pytest.fixture(scope="module", params=["file", pytest.param("redis", marks=needs_redis_server)])
def module_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[[], StorageBackend]:
    if request.param == "file":
        path = tmp_path_factory.mktemp("identity-store")
        return lambda: FileStore(path)
    server: LocalRedisServer = request.getfixturevalue("redis_server")
    prefix = f"p{secrets.token_hex(4)}:"
    return lambda: RedisStore(server.url, prefix=prefix, timeout_s=5.0)


@pytest.mark.parametrize("what", [*SHARED, *FIELDS])
@given(data=st.data(), seq=st.integers(0, 1 << 30))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_engines_differing_in_one_identity_field_never_share_a_page(
    module_store: Callable[[], StorageBackend], what: str, data: st.DataObject, seq: int
) -> None:
    """For every field of the identity: two engines that differ in it alone get
    different keys for the same tokens, and even under one (user-made) key the
    reader refuses the writer's page (no row written); engines equal in every
    field share it, byte-exact, through a real FileStore and redis-server."""
    a, b = data.draw(engine_pairs(what))
    ga, gb = a.group(seed=1), b.group(seed=2)
    ia, ib = a.identity(ga), b.identity(gb)
    tokens = list(range(8 * a.rows * b.rows))
    keys_a, keys_b = page_keys(ia.namespace(), tokens), page_keys(ib.namespace(), tokens)
    key = f"user-key-{seq}-{what}".encode()
    got = _through_store(module_store, key, encode_page(ga, a.name, 1, key=key, identity=ia), [b.name])
    before = host_bytes(gb, b.name)
    if what in SHARED:
        assert ia == ib and ia.digest() == ib.digest() and keys_a == keys_b
        assert got is not None
        assert decode_page(gb, b.name, 1, got, key=key, identity=ib) == {b.name: b.rows}
        ha, hb = ga[a.name].host, gb[b.name].host
        assert isinstance(ha, HostPool) and isinstance(hb, HostPool)
        for p in range(len(ha.planes)):
            for j in range(ha.num_layers):
                assert torch.equal(ha.layer_view(j, p)[a.rows:2 * a.rows], hb.layer_view(j, p)[b.rows:2 * b.rows])
        return
    assert ia != ib and ia.digest() != ib.digest()
    assert set(keys_a).isdisjoint(keys_b)  # different keys for the same tokens
    if got is None:  # another pool's name: the reader's blob is not even stored under the key
        assert a.name != b.name
    else:
        with pytest.raises(PageCorrupted) as err:
            decode_page(gb, b.name, 1, got, key=key, identity=ib)
        assert err.value.rule == "identity"
    after = host_bytes(gb, b.name)
    assert all(torch.equal(x, y) for x, y in zip(before, after))  # nothing of it landed


def test_the_scheduler_takes_one_engine_identity_and_derives_each_pools(tmp_path: Path) -> None:
    group = hybrid_group()
    with pytest.raises(ConfigurationError, match=r"identity must be a kvtier.storage.EngineIdentity .*got 'm'"):
        TransferScheduler(group, identity="m")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"identity shards name pools \['nope'\]"):
        TransferScheduler(group, storage=FileStore(tmp_path), identity=EngineIdentity("m", shards={"nope": Shard(0, 2)}))
    engine = EngineIdentity("m", shards={"c4": Shard(1, 2)})
    sched = TransferScheduler(group, storage=FileStore(tmp_path), identity=engine)
    assert sched.page_identity("kv") == PageIdentity.for_pool(group, "kv", model="m", shards={"c4": Shard(1, 2)})
    assert sched.page_identity("tok").anchor.kind == "logical"
    with pytest.raises(ConfigurationError, match=r"pool 'c4' is not a pool whose pages are stored"):
        sched.page_identity("c4")
    plain = TransferScheduler(hybrid_group())
    assert plain.page_identity("kv").model == "kvtier:unnamed-model"


def test_encode_page_refuses_an_identity_of_other_pools() -> None:
    group = hybrid_group()
    with pytest.raises(ConfigurationError, match=r"holds pools \['swa', 'swa_state'\]; a page of pool 'kv' holds \['kv', 'c4'\]"):
        encode_page(group, "kv", 0, key=b"k", identity=PageIdentity.for_pool(group, "swa", model="m"))
    with pytest.raises(ConfigurationError, match="identity must be a PageIdentity"):
        encode_page(group, "kv", 0, key=b"k", identity="m")  # type: ignore[arg-type]


# -- every field refused by name, every derivation pinned (the mutants `make mutate` found surviving) --

_PLANE = PlaneFormat((2, 8), "bfloat16", 2)
_SURROGATE = "a\udc80"  # what os.fsdecode makes of a name that is not UTF-8
_NOT_UNICODE = "must be valid Unicode (encodable as UTF-8; surrogates not allowed at 1)"


def _pool(**fields: object) -> PoolFormat:
    base: dict[str, object] = {"name": "kv", "kind": "pool", "layout": "l", "rows": 16, "layers": 2,
                               "planes": (_PLANE,)}
    return PoolFormat(**{**base, **fields})  # type: ignore[arg-type]


def _page(**fields: object) -> PageIdentity:
    base: dict[str, object] = {"model": "m", "scheme": "s", "pools": (_pool(),)}
    return PageIdentity(**{**base, **fields})  # type: ignore[arg-type]


def _plane(**fields: object) -> PlaneFormat:
    base: dict[str, object] = {"shape": (2,), "format": "bfloat16", "element_size": 2}
    return PlaneFormat(**{**base, **fields})  # type: ignore[arg-type]


def _engine(**fields: object) -> EngineIdentity:
    return EngineIdentity(**{"model": "m", **fields})  # type: ignore[arg-type]


_REFUSED: list[tuple[Callable[[], object], str]] = [
    (lambda: Shard(0, 0), "shard field 'world' must be a positive integer; got 0"),
    (lambda: Shard(0, True), "shard field 'world' must be a positive integer; got True"),
    (lambda: Shard(0, "2"), "shard field 'world' must be a positive integer; got '2'"),
    (lambda: Shard(-1, 2), "shard field 'rank' must be an integer in 0..1 (world=2); got -1"),
    (lambda: Shard(2, 2), "shard field 'rank' must be an integer in 0..1 (world=2); got 2"),
    (lambda: Shard(True, 2), "shard field 'rank' must be an integer in 0..1 (world=2); got True"),
    (lambda: Shard("0", 2), "shard field 'rank' must be an integer in 0..1 (world=2); got '0'"),
    (lambda: Shard(0, 2, cut=3), "shard field 'cut' must be a string; got 3"),
    (lambda: Shard(0, 2, cut=_SURROGATE), f"shard field 'cut' {_NOT_UNICODE}; got 'a\\udc80'"),
    (lambda: _plane(shape=[2]), "plane field 'shape' must be a tuple of non-negative integers; got [2]"),
    (lambda: _plane(shape=(2, -1)), "plane field 'shape' must be a tuple of non-negative integers; got (2, -1)"),
    (lambda: _plane(shape=(True,)), "plane field 'shape' must be a tuple of non-negative integers; got (True,)"),
    (lambda: _plane(format=""), "plane field 'format' must be a non-empty string; got ''"),
    (lambda: _plane(format=2), "plane field 'format' must be a non-empty string; got 2"),
    (lambda: _plane(format=_SURROGATE), f"plane field 'format' {_NOT_UNICODE}; got 'a\\udc80'"),
    (lambda: _plane(format="x", element_size=0), "plane field 'element_size' must be a positive integer; got 0"),
    (lambda: _plane(format="x", element_size=True), "plane field 'element_size' must be a positive integer; got True"),
    (lambda: _plane(element_size=4),
     "plane field 'element_size' must be 2 for format 'bfloat16' (torch's element size of that dtype); got 4"),
    (lambda: _pool(name=""), "pool format field 'name' must be a non-empty string; got ''"),
    (lambda: _pool(kind=3), "pool format field 'kind' must be a non-empty string; got 3"),
    (lambda: _pool(layout=""), "pool format field 'layout' must be a non-empty string; got ''"),
    (lambda: _pool(kind=_SURROGATE), f"pool format field 'kind' {_NOT_UNICODE}; got 'a\\udc80'"),
    (lambda: _pool(rows=0), "pool format field 'rows' must be a positive integer (rows per page); got 0"),
    (lambda: _pool(rows=True), "pool format field 'rows' must be a positive integer (rows per page); got True"),
    (lambda: _pool(layers=-1), "pool format field 'layers' must be a non-negative integer; got -1"),
    (lambda: _pool(layers=False), "pool format field 'layers' must be a non-negative integer; got False"),
    (lambda: _pool(planes=[_PLANE]), f"pool format field 'planes' must be a tuple of PlaneFormat; got [{_PLANE!r}]"),
    (lambda: _pool(planes=(_PLANE, 1)), f"pool format field 'planes' must be a tuple of PlaneFormat; got ({_PLANE!r}, 1)"),
    (lambda: _pool(shard="0/2"), "pool format field 'shard' must be a Shard or None; got '0/2'"),
    (lambda: _page(model=""), "page identity field 'model' must be a non-empty string; got ''"),
    (lambda: _page(scheme=None), "page identity field 'scheme' must be a non-empty string; got None"),
    (lambda: _page(pools=()), "page identity field 'pools' must be a non-empty tuple of PoolFormat (anchor first); got ()"),
    (lambda: _page(pools=[_pool()]),
     f"page identity field 'pools' must be a non-empty tuple of PoolFormat (anchor first); got [{_pool()!r}]"),
    (lambda: _page(pools=(_pool(), "c4")),
     f"page identity field 'pools' must be a non-empty tuple of PoolFormat (anchor first); got ({_pool()!r}, 'c4')"),
    (lambda: _page(pools=(_pool(), _pool(kind="sidecar"))),
     "page identity field 'pools' must name each pool once; got ['kv', 'kv']"),
    (lambda: _page(extra=["x"]), "page identity field 'extra' must be a tuple of strings; got ['x']"),
    (lambda: _page(extra=("x", 1)), "page identity field 'extra' must be a tuple of strings; got ('x', 1)"),
    (lambda: _page(version=0), "page identity field 'version' must be a positive integer; got 0"),
    (lambda: _page(version=True), "page identity field 'version' must be a positive integer; got True"),
    (lambda: _page(model=_SURROGATE), f"page identity field 'model' {_NOT_UNICODE}; got 'a\\udc80'"),
    (lambda: _page(scheme=_SURROGATE), f"page identity field 'scheme' {_NOT_UNICODE}; got 'a\\udc80'"),
    (lambda: _page(extra=("x", _SURROGATE)), f"page identity field 'extra' {_NOT_UNICODE}; got ('x', 'a\\udc80')"),
    (lambda: _engine(model=""), "engine identity field 'model' must be a non-empty string; got ''"),
    (lambda: _engine(scheme=""), "engine identity field 'scheme' must be a non-empty string; got ''"),
    (lambda: _engine(shards=[]), "engine identity field 'shards' must map pool names to Shard (or None); got []"),
    (lambda: _engine(shards={"kv": "0/2"}),
     "engine identity field 'shards' must map pool names to Shard (or None); got {'kv': '0/2'}"),
    (lambda: _engine(shards={1: None}), "engine identity field 'shards' must map pool names to Shard (or None); got {1: None}"),
    *[
        (lambda f=f: _engine(formats=f),  # type: ignore[misc]
         "engine identity field 'formats' must map pool names to a format name or a sequence of them, one per "
         f"plane (non-empty strings); got {f!r}")
        for f in ([], {"kv": 8}, {"kv": ""}, {"kv": []}, {"kv": ("a", "")}, {"kv": ("a", 1)}, {"kv": b"ab"}, {1: "a"})
    ],
    (lambda: _engine(extra=["x"]), "engine identity field 'extra' must be a tuple of strings; got ['x']"),
    (lambda: _engine(extra=("x", 2)), "engine identity field 'extra' must be a tuple of strings; got ('x', 2)"),
    (lambda: _engine(model=_SURROGATE), f"engine identity field 'model' {_NOT_UNICODE}; got 'a\\udc80'"),
    (lambda: _engine(scheme=_SURROGATE), f"engine identity field 'scheme' {_NOT_UNICODE}; got 'a\\udc80'"),
    (lambda: _engine(shards={_SURROGATE: None}), f"engine identity field 'shards' {_NOT_UNICODE}; got {{'a\\udc80': None}}"),
    (lambda: _engine(formats={_SURROGATE: "x"}), f"engine identity field 'formats' {_NOT_UNICODE}; got {{'a\\udc80': 'x'}}"),
    (lambda: _engine(formats={"kv": _SURROGATE}), f"engine identity field 'formats' {_NOT_UNICODE}; got {{'kv': 'a\\udc80'}}"),
    (lambda: _engine(formats={"kv": ("x", _SURROGATE)}),
     f"engine identity field 'formats' {_NOT_UNICODE}; got {{'kv': ('x', 'a\\udc80')}}"),
    (lambda: _engine(extra=(_SURROGATE,)), f"engine identity field 'extra' {_NOT_UNICODE}; got ('a\\udc80',)"),
]


def _id(message: str) -> str:
    """A test id of plain characters (mutmut passes ids on pytest's command line)."""
    return re.sub(r"\W+", "-", message).strip("-")


@pytest.mark.parametrize(("make", "message"), _REFUSED, ids=[_id(m) for _, m in _REFUSED])
def test_each_identity_record_refuses_each_bad_field_with_its_name_value_and_rule(
    make: Callable[[], object], message: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        make()
    assert str(refused.value) == message


def test_identity_records_take_the_bounds_of_every_field() -> None:
    assert Shard(0, 1).rank == 0 and Shard(1, 2).rank == 1
    assert _plane(shape=(), format="x", element_size=1).row_nbytes == 1  # a scalar plane, a 1-byte format
    assert _plane(shape=(0, 3), format="custom", element_size=3).row_nbytes == 0
    assert _pool(layers=0, rows=1, planes=()).layers == 0
    assert _pool(shard=Shard(0, 1)).shard is None  # one shard of one is the whole pool
    assert _pool(shard=Shard(1, 2)).shard == Shard(1, 2)
    assert _page(version=1, extra=()).version == 1
    engine = _engine(formats={"kv": ["float8_e4m3fn", "uint8"], "c4": "float8_e5m2"}, shards={"kv": None})
    assert engine.formats == {"kv": ("float8_e4m3fn", "uint8"), "c4": "float8_e5m2"}
    shards = {"kv": Shard(0, 2)}
    engine = _engine(shards=shards)
    shards["kv"] = Shard(1, 2)  # the engine holds its own copy
    assert engine.shards == {"kv": Shard(0, 2)}


# An identity using every field: two pools (a scalar plane, a sidecar), shards
# with and without a cut, extra strings and a version other than 1. Its digest,
# tags, namespaces and vLLM keys are stored formats, pinned byte for byte.
_ANCHOR = PoolFormat("kv", "pool", "layer-by-layer", 16, 4,
                     (PlaneFormat((2, 8), "bfloat16", 2), PlaneFormat((), "float8_e4m3fn", 1)), Shard(1, 2, cut="tp=2"))
_SIDE = PoolFormat("c4", "sidecar", "layer-by-layer", 4, 4, (PlaneFormat((0,), "uint8", 1),), Shard(0, 2))


def _full() -> PageIdentity:
    """Made in each test, not at import: what it derives is what the code under test derives now."""
    return PageIdentity("m@rev", "sg", (_ANCHOR, _SIDE), extra=("x=1", "y"), version=2)


def test_a_full_identity_derives_the_same_bytes_in_every_release() -> None:
    full = _full()
    assert full.digest().hex() == "388f1850c783ada06aec1fd4b318c52f7f016697dc75a9436bac6a31546de8d9"
    assert full.tag("kv").hex() == "19bf1e61c8f55178"
    assert full.tag("c4").hex() == "8b7206b0110c823e"
    assert full.anchor is _ANCHOR and full.pool("c4") is _SIDE
    assert full.namespace() == KeyNamespace(
        model="m@rev", pool="kv", page_size=16, dtype="kv=bfloat16,float8_e4m3fn;c4=uint8",
        layout="kv=layer-by-layer;c4=layer-by-layer",
        extra=("kv:pool:rows=16:layers=4:planes=2x8,scalar", "c4:sidecar:rows=4:layers=4:planes=0",
               "kv:shard=1/2|tp=2", "c4:shard=0/2", "scheme=sg", "identity-version=2", "x=1", "y"),
    )
    assert full.engine_namespace() == EngineNamespace(
        engine="sg", model="m@rev", page_size=16, dtype="bfloat16,float8_e4m3fn", layout="layer-by-layer",
        tp_rank=1, tp_size=2,
        extra=("x=1", "y", "side|c4|sidecar|layer-by-layer|4|4|1|0|uint8|1|shard=0/2|", "identity-version=2"),
    )
    # Version 1, the scheme "kvtier", no shard: none of those strings.
    plain = PageIdentity("m@rev", "kvtier", (_pool(),))
    assert plain.digest().hex() == "2f3904a62721c9497a5b5ba64d04c09b1fa80562d87c620ec5ddaa4e681f9648"
    assert plain.namespace().extra == ("kv:pool:rows=16:layers=2:planes=2x8",)
    assert plain.engine_namespace() == EngineNamespace(
        engine="kvtier", model="m@rev", page_size=16, dtype="bfloat16", layout="l", tp_rank=0, tp_size=1, extra=())


def test_a_pool_or_tag_the_identity_does_not_hold_is_refused_by_name() -> None:
    full = _full()
    with pytest.raises(ConfigurationError) as refused:
        full.tag("swa")
    assert str(refused.value) == "pool 'swa' is not part of this page identity (pools: ['kv', 'c4'])"
    with pytest.raises(ConfigurationError) as refused:
        full.pool("swa")
    assert str(refused.value) == "pool 'swa' is not part of this page identity (pools: ['kv', 'c4'])"


def test_vllm_block_identity_root_and_keys_are_stable_across_releases() -> None:
    from kvtier.storage.identity import vllm_block_key, vllm_shard_key

    shard = Shard(1, 2, cut="tp=2|pp=1")
    block = PageIdentity.for_vllm_block(model="m", block_size=16, dtype="torch.bfloat16", num_layers=2,
                                        block_bytes=4096, groups="g0", shard=shard)
    assert block.anchor == PoolFormat("vllm-kv", "vllm-block", "vllm-cpu-block", 16, 2,
                                      (PlaneFormat((2048,), "bfloat16", 2),), shard)
    assert block.scheme == "vllm" and block.extra == ("groups=g0",)
    assert block.digest().hex() == "e8a7dfc0763a76a5bad605194aa47d6acd464624ad42de25dede4e8c210d4241"
    root = block.vllm_root()
    assert root.hex() == "23774e417ab39d81726babcb8fbebebc5225c6fb265b8128442697716238d434"
    key = vllm_block_key(root, b"offload-key")
    assert key.hex() == "7c132b60280ee63b5064b376de24c2a43e759fd3cb059dfeadf4f33c86560070"
    assert vllm_shard_key(key, shard).hex() == "d1031654b439c734d22032567db7a6e68506f6ab8f200f43e3860e2f75dcf322"
    assert vllm_shard_key(key, None) == key
    # One group: no extra string; the version joins the root where it is not 1.
    one = PageIdentity.for_vllm_block(model="m", block_size=16, dtype="bfloat16", num_layers=2, block_bytes=4096)
    assert one.extra == () and one.anchor.shard is None
    assert dataclasses.replace(one, version=2).vllm_root() != one.vllm_root()
    engine = EngineIdentity.of_pages(block, "kv")
    assert (engine.model, engine.scheme, engine.shards, engine.formats) == ("m", "vllm", {"kv": shard}, {})
    assert engine.extra == (f"vllm-identity={block.digest().hex()}",)
    assert EngineIdentity.of_pages(one, "kv").shards == {}


@pytest.mark.parametrize(
    ("dtype", "block_bytes", "message"),
    [
        ("bfloat16", 3, "vLLM block_bytes must be a positive multiple of bfloat16's 2-byte elements; got 3"),
        ("bfloat16", 0, "vLLM block_bytes must be a positive multiple of bfloat16's 2-byte elements; got 0"),
        ("fp8_custom", True, "vLLM block_bytes must be a positive multiple of fp8_custom's 1-byte elements; got True"),
    ],
    ids=["bfloat16-3", "bfloat16-0", "custom-True"],
)
def test_vllm_block_bytes_must_divide_into_elements(dtype: str, block_bytes: object, message: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        PageIdentity.for_vllm_block(model="m", block_size=16, dtype=dtype, num_layers=2, block_bytes=block_bytes)  # type: ignore[arg-type]
    assert str(refused.value) == message
    # A format torch does not name counts in bytes: one byte is a whole block.
    assert PageIdentity.for_vllm_block(model="m", block_size=1, dtype="fp8_custom", num_layers=1,
                                       block_bytes=1).anchor.planes == (PlaneFormat((1,), "fp8_custom", 1),)


def test_vllm_root_needs_one_vllm_block_pool() -> None:
    with pytest.raises(ConfigurationError) as refused:
        _full().vllm_root()
    assert str(refused.value) == ("vllm_root needs an identity of one vLLM block pool (PageIdentity.for_vllm_block); "
                                  "got scheme 'sg' with pools ['kv', 'c4']")
    for not_vllm in (_page(scheme="vllm", pools=(_pool(planes=(_PLANE, _PLANE)),)), _page(scheme="sg"),
                     _page(scheme="vllm", pools=(_pool(), _pool(name="c4")))):
        with pytest.raises(ConfigurationError, match="vllm_root needs an identity of one vLLM block pool"):
            not_vllm.vllm_root()


def test_engine_identity_page_identity_passes_every_field_on() -> None:
    group = hybrid_group()
    engine = EngineIdentity("m", scheme="sg", shards={"kv": Shard(1, 2)}, formats={"kv": "int32"}, extra=("e",))
    assert engine.page_identity(group, "kv", extra=("more",)) == PageIdentity.for_pool(
        group, "kv", model="m", scheme="sg", shards={"kv": Shard(1, 2)}, formats={"kv": "int32"}, extra=("e", "more"))
    assert engine.page_identity(group, "kv").extra == ("e",)


def test_sidecars_join_the_identity_in_name_order_whatever_the_order_they_were_registered_in() -> None:
    group = hybrid_group()  # registers kv's sidecar c4
    group.add_sidecar("a2", source="kv", rows_per_page=2, device=DevicePool([torch.zeros(16, 4) for _ in range(4)]))
    assert [p.name for p in PageIdentity.for_pool(group, "kv", model="m").pools] == ["kv", "a2", "c4"]


@pytest.mark.parametrize("given", [("float32", ""), ("float32", 4), ("float32",)], ids=["empty", "int", "too-few"])
def test_for_pool_refuses_formats_that_are_not_one_name_per_plane(given: object) -> None:
    with pytest.raises(ConfigurationError) as refused:
        PageIdentity.for_pool(hybrid_group(), "kv", model="m", formats={"kv": given})  # type: ignore[dict-item]
    assert str(refused.value) == f"identity formats['kv'] must be one format name or one per plane (2 planes); got {given!r}"


# -- EngineNamespace: the keys of engines that bring their own page keys (SealedPageStore) --


def test_every_namespace_field_changes_every_key() -> None:
    base = dict(engine="sglang", model="m", page_size=64, dtype="bfloat16", layout="page_first", tp_rank=1, tp_size=2)
    variants = [
        {"engine": "vllm"}, {"model": "m2"}, {"page_size": 32}, {"dtype": "float16"},
        {"layout": "layer_first"}, {"tp_rank": 0}, {"tp_size": 4}, {"extra": ("pp=1",)},
    ]
    ref = EngineNamespace(**base).keys(["k1", "k2"])  # type: ignore[arg-type]
    assert ref == EngineNamespace(**base).keys(["k1", "k2"])  # type: ignore[arg-type]
    for change in variants:
        other = EngineNamespace(**{**base, **change}).keys(["k1", "k2"])  # type: ignore[arg-type]
        assert set(other).isdisjoint(ref), change
    ns = EngineNamespace(**base)  # type: ignore[arg-type]
    assert ns.key("k1", pool="kv") != ns.key("k1", pool="swa")
    assert ns.key("k1") == ns.key(b"k1") and len(ns.key("k1")) == 32


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model": ""}, "field 'model' must be a non-empty string"),
        ({"page_size": 0}, "page_size must be a positive integer; got 0"),
        ({"tp_rank": 2}, r"tp_rank must be an integer in 0..1 \(tp_size=2\); got 2"),
        ({"dtype": None}, "field 'dtype' must be a non-empty string; got None"),
        ({"extra": ["x"]}, "extra must be a tuple of strings"),
    ],
)
def test_bad_namespace_fields_are_named(fields: dict[str, object], message: str) -> None:
    base: dict[str, object] = dict(engine="e", model="m", page_size=4, dtype="d", layout="l", tp_rank=0, tp_size=2)
    with pytest.raises(ConfigurationError, match=message):
        EngineNamespace(**{**base, **fields})  # type: ignore[arg-type]
    ns = EngineNamespace(**base)  # type: ignore[arg-type]
    for empty in ("", b""):
        with pytest.raises(ConfigurationError) as refused:
            ns.key(empty)
        assert str(refused.value) == f"engine page keys are non-empty str or bytes; got {empty!r}"


def test_engine_namespace_roots_and_keys_are_the_same_in_every_release() -> None:
    # made inside the test: a namespace made at import would be digested before a
    # mutant under `make mutate` is active, and pin nothing
    ens = EngineNamespace(engine="sglang", model="m", page_size=64, dtype="bfloat16", layout="page_first",
                           tp_rank=1, tp_size=2, extra=("pp=0",))
    assert ens.root().hex() == "fa4a75b44d6cd19f5e7af9378807e2f91377342292323480c7e6c06d28b05555"
    assert ens.label() == "fa4a75b44d6cd19f"
    assert [k.hex() for k in ens.keys(["abc", b"\x01\x02"], pool="c4")] == [
        "96cb40214754998308a4c08b64f4b6b70eafdf7b31c0b64c6044468c6ad9b777",
        "d745f31072c177464e9147e3cfc8a953a59be74e8a970caccf90435ea0b0bae3",
    ]
    assert ens.keys(["abc"]) == ens.keys(["abc"], pool="kv") == [ens.key("abc")] != ens.keys(["abc"], pool="c4")
    # Asked again after another pool's and another namespace's keys (each pool's hash is
    # kept, never shared or changed by a key), and from a namespace pickled: the same keys.
    EngineNamespace(engine="sglang", model="other", page_size=64, dtype="bfloat16", layout="page_first").keys(["abc"], pool="c4")
    again = pickle.loads(pickle.dumps(ens))
    assert [k.hex() for k in again.keys(["abc"], pool="c4") + ens.keys(["abc"], pool="c4")] == [
        "96cb40214754998308a4c08b64f4b6b70eafdf7b31c0b64c6044468c6ad9b777"] * 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model": ""}, "engine namespace field 'model' must be a non-empty string; got ''"),
        ({"engine": ""}, "engine namespace field 'engine' must be a non-empty string; got ''"),
        ({"page_size": "64"}, "engine namespace page_size must be a positive integer; got '64'"),
        ({"tp_size": 0}, "engine namespace tp_size must be a positive integer; got 0"),
        ({"tp_rank": "0"}, r"engine namespace tp_rank must be an integer in 0..1 \(tp_size=2\); got '0'"),
        ({"tp_rank": 2}, r"engine namespace tp_rank must be an integer in 0..1 \(tp_size=2\); got 2"),
    ],
    ids=["model", "engine", "page_size", "tp_size", "tp_rank-str", "tp_rank-2"],
)
def test_engine_namespace_refuses_each_bad_field_by_name(fields: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"engine": "e", "model": "m", "page_size": 64, "dtype": "", "layout": "", "tp_size": 2}
    with pytest.raises(ConfigurationError, match=message):
        EngineNamespace(**{**base, **fields})  # type: ignore[arg-type]
