"""A page is read only under the identity it was written with, in SGLang:
the true fp8 format (e4m3 and e5m2 are both ``uint8`` in SGLang's host pools),
the per-pool TP shard (a Mamba pool of an MLA model is sharded while its KV is
replicated), and the key pins for unchanged identities. Through SGLang's own
host pools, its published settings and its controller's storage paths, over a
file store and a real redis-server.

Needs SGLang (see test_sglang_storage.py for how the venv is built)."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

_SGLANG = importlib.util.find_spec("sglang")
if _SGLANG is not None and _SGLANG.origin is not None and importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(Path(__file__).parent / "stand_ins"))
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed; `make test-sglang` builds .venv-sglang with sglang==0.5.23")

import harness  # noqa: E402
from harness import (  # noqa: E402
    KVTIER, PAGE, Pools, backend_of, backup, make_mamba_pool, make_pools, needs_redis_server, page_hashes, pages_of,
    prefetch, sglang_settings, single_rank, tokens,
)
from kvtier.errors import ConfigurationError  # noqa: E402
from kvtier.integrations.sglang import KvtierHiCacheStorage, namespace_for, pool_shard  # noqa: E402
from kvtier.testing.redis_server import LocalRedisServer  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402

pytestmark = pytest.mark.sglang

STORES = ["file", pytest.param("redis", marks=needs_redis_server)]


@pytest.fixture(autouse=True)
def one_rank() -> Iterator[None]:
    with single_rank():
        yield


@pytest.fixture
def store_config(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], dict[str, Any]]:
    prefix = f"t{random.getrandbits(32):08x}:"

    def make(name: str) -> dict[str, Any]:
        if name == "file":
            return {**KVTIER, "store": "file", "store_path": str(tmp_path / "store")}
        server: LocalRedisServer = request.getfixturevalue("redis_server")
        return {**KVTIER, "store": "redis", "redis_url": server.url, "prefix": prefix, "timeout_s": 2.0}

    return make


@pytest.fixture
def controllers() -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(pools: Pools, extra: dict[str, Any], **settings: Any) -> Any:
        """A real HiCacheController attached while SGLang publishes ``settings``."""
        with sglang_settings(**settings):
            ctl = harness.controller(pools, extra)
        made.append(ctl)
        return ctl

    yield make
    for ctl in made:
        ctl.detach_storage_backend()


def fp8_pools(kind: str, fmt: torch.dtype) -> Pools:
    layout = "page_first"
    pools = make_pools(kind, layout, dtype=fmt)
    assert pools.host.dtype == torch.uint8  # SGLang holds fp8 KV as uint8: the tensor cannot say which
    return pools


# -- keys of unchanged identities are what they were ----------------------------------------


def test_keys_of_unchanged_identities_are_pinned(tmp_path: Path) -> None:
    """bf16 MHA on TP rank 1 of 2 and bf16 MLA (rank dropped): the labels and
    keys kvtier stored under before page identities, byte for byte; and a
    sidecar pool's key string and key."""
    key = "ab" * 32
    expected = {
        ("mha", "page_first"): ("462881fea79f21c8", "a8e5510c1d21479573ddaaa07152b0ec228463be6c2e9f4f4726909f1e35bbaa",
                                "swa|MHATokenToKVPoolHost|page_first|torch.bfloat16|768",
                                "fbadc1d7c9e4437fd9ff013eaf101586e14f1656c9a3783ad8e8b32899ad3a9f"),
        ("mla", "layer_first"): ("b63b3c13aa4e5f63", "631dc4abbbaf6d0e5f3f2ba238c01a58ab85a064fe46dfcb4471d7a6494e883d",
                                 "swa|MLATokenToKVPoolHost|layer_first|torch.bfloat16|576",
                                 "052dbf75ce7fe359d2d20694caa1f0c4b46397b5aa0c97c1995c9c2029a7e423"),
    }
    for (kind, layout), (label, kv_key, side_pool, side_key) in expected.items():
        pools = make_pools(kind, layout)
        config = harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path)}, model="tiny", tp_rank=1, tp_size=2)
        dummy = pools.host.get_dummy_flat_data_page()
        ns = namespace_for(config, pools.host, model="tiny", page_nbytes=dummy.numel() * dummy.element_size())
        assert (ns.label(), ns.key(key).hex()) == (label, kv_key)
        backend = KvtierHiCacheStorage(config)
        backend.register_mem_pool_host(pools.host)
        try:
            assert backend.namespace == ns
            backend.register_mem_host_pool_v2(pools.host, PoolName.SWA)
            pool = backend._pool(PoolName.SWA)
            assert pool is not None and pool.key_pool == side_pool
            assert ns.key(key, pool=side_pool).hex() == side_key
        finally:
            backend.close()


# -- fp8: e4m3 and e5m2 are apart, though both are uint8 ------------------------------------


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_an_e5m2_engine_never_gets_an_e4m3_engines_pages(
    kind: str, store: str, store_config: Callable[[str], dict[str, Any]], controllers: Callable[..., Any]
) -> None:
    extra = store_config(store)
    e4m3_a, e4m3_b = fp8_pools(kind, torch.float8_e4m3fn), fp8_pools(kind, torch.float8_e4m3fn)
    e5m2 = fp8_pools(kind, torch.float8_e5m2)
    e4m3_a.fill(seed=40)
    writer = controllers(e4m3_a, extra, kv_cache_dtype="fp8_e4m3")
    same = controllers(e4m3_b, extra, kv_cache_dtype="fp8_e4m3")
    other = controllers(e5m2, extra, kv_cache_dtype="fp8_e5m2")
    prompt = tokens(4, seed=41)
    src = e4m3_a.host.alloc(4 * PAGE)
    assert backup(writer, src, prompt) == 4 * PAGE
    assert prefetch(other, prompt)[:2] == (0, 0)  # another format: never found
    found, landed, dst = prefetch(same, prompt)  # the same format: shared
    assert (found, landed) == (4, 4)
    for got, want in zip(pages_of(e4m3_b, dst), pages_of(e4m3_a, src)):
        assert torch.equal(got, want)
    formats = {backend_of(c).identity.anchor.planes[0].format for c in (writer, other)}  # type: ignore[union-attr]
    assert formats == {"float8_e4m3fn", "float8_e5m2"}


def test_an_e4m3_page_copied_under_an_e5m2_key_is_an_identity_miss(tmp_path: Path, controllers: Callable[..., Any]) -> None:
    """A copy tool's mistake: the e4m3 engine's file put where the e5m2
    engine's page would be. The blob's header carries its identity: refused
    (rule ``identity``), a counted miss, repaired by the next write."""
    extra = {**KVTIER, "store_path": str(tmp_path)}
    e4m3, e5m2 = fp8_pools("mha", torch.float8_e4m3fn), fp8_pools("mha", torch.float8_e5m2)
    e4m3.fill(seed=42)
    e5m2.fill(seed=43)
    ctl_a = controllers(e4m3, extra, kv_cache_dtype="fp8_e4m3")
    ctl_b = controllers(e5m2, extra, kv_cache_dtype="fp8_e5m2")
    prompt = tokens(1, seed=44)
    src = e4m3.host.alloc(PAGE)
    assert backup(ctl_a, src, prompt) == PAGE
    a, b = backend_of(ctl_a), backend_of(ctl_b)
    assert a.namespace is not None and b.namespace is not None and a.namespace.label() != b.namespace.label()
    (h,) = page_hashes(prompt)
    ka, kb = a.namespace.key(h).hex(), b.namespace.key(h).hex()
    target = tmp_path / b.namespace.label() / kb[:2]
    target.mkdir(parents=True, exist_ok=True)  # the store made its page directories when it opened
    copied = [f for f in (tmp_path / a.namespace.label() / ka[:2]).glob(f"{ka}.*")]
    assert {f.suffix for f in copied} == {".data"}  # FileStore: one file a page
    for f in copied:
        shutil.copy(f, target / f.name.replace(ka, kb))
    assert b.batch_exists([h]) == 1  # present whole: the file store sees a page
    assert b.batch_get_v1([h], torch.arange(8 * PAGE, 9 * PAGE)) == [False]
    assert b.statistics().broken == {"identity": 1}  # type: ignore[union-attr]
    own = e5m2.host.alloc(PAGE)
    assert backup(ctl_b, own, prompt) == PAGE  # the e5m2 engine's own backup writes its page over it
    assert b.batch_get_v1([h], torch.arange(9 * PAGE, 10 * PAGE)) == [True]
    assert torch.equal(e5m2.page(9 * PAGE), e5m2.page(int(own[0])))


def test_an_unexplained_uint8_kv_pool_is_refused_at_attach_naming_what_to_pass(tmp_path: Path) -> None:
    pools = fp8_pools("mha", torch.float8_e5m2)
    backend = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path)}))
    refusal = ("KvtierHiCacheStorage: host pool 'kv' (MHATokenToKVPoolHost) holds its KV as uint8, an fp8 cache "
               "whose format (e4m3 or e5m2) kvtier cannot tell ({}); set \"kv_cache_dtype\": \"fp8_e4m3\" or "
               "\"fp8_e5m2\" (the value given to --kv-cache-dtype) in --hicache-storage-backend-extra-config")
    with pytest.raises(ConfigurationError) as refused:
        backend.register_mem_pool_host(pools.host)
    assert str(refused.value) == refusal.format("SGLang published no --kv-cache-dtype in this process")
    assert backend.store is None
    with sglang_settings(kv_cache_dtype="bfloat16"):  # a setting that does not explain uint8
        with pytest.raises(ConfigurationError) as refused:
            KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path)})).register_mem_pool_host(pools.host)
    assert str(refused.value) == refusal.format("SGLang's --kv-cache-dtype is 'bfloat16'")
    # the extra-config key explains it; one that contradicts SGLang's setting is refused
    given = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path), "kv_cache_dtype": "fp8_e5m2"}))
    given.register_mem_pool_host(pools.host)
    try:
        assert given.identity is not None and given.identity.anchor.planes[0].format == "float8_e5m2"
    finally:
        given.close()
    with sglang_settings(kv_cache_dtype="fp8_e4m3"):
        contra = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path), "kv_cache_dtype": "fp8_e5m2"}))
        with pytest.raises(ConfigurationError) as refused:
            contra.register_mem_pool_host(pools.host)
        assert str(refused.value) == (
            "KvtierHiCacheStorage extra-config 'kv_cache_dtype'='fp8_e5m2' (float8_e5m2) contradicts SGLang's "
            "--kv-cache-dtype 'fp8_e4m3' (float8_e4m3fn) for host pool 'kv'; pass the value given to SGLang")
        assert contra.store is None


# -- ranks: the Mamba state of an MLA model is per rank, its KV shared ---------------------


def _mla_mamba_rank(rank: int, extra: dict[str, Any]) -> tuple[KvtierHiCacheStorage, Pools, Any]:
    kv = make_pools("mla", "page_first")
    mamba = make_mamba_pool()
    config = harness.storage_config(kv, extra, tp_rank=rank, tp_size=2)
    assert config.is_mla_model
    backend = KvtierHiCacheStorage(config)
    # as HybridCacheController attaches: the anchor, then every host pool group entry
    backend.register_mem_pool_host(kv.host)
    backend.register_mem_host_pool_v2(kv.host, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.on_host_pools_registered()
    return backend, kv, mamba


def _fill_mamba(host: Any, seed: int) -> None:
    dummy = host.get_dummy_flat_data_page()
    g = torch.Generator().manual_seed(seed)
    for slot in range(host.size):
        host.set_from_flat_data_page(slot, torch.randint(0, 256, dummy.shape, dtype=torch.uint8, generator=g))


@pytest.mark.parametrize("store", STORES)
def test_mla_with_mamba_on_two_ranks_shares_the_kv_and_keeps_each_ranks_state(
    store: str, store_config: Callable[[str], dict[str, Any]]
) -> None:
    extra = store_config(store)
    (r0, kv0, m0), (r1, kv1, m1) = _mla_mamba_rank(0, extra), _mla_mamba_rank(1, extra)
    try:
        kv0.fill(seed=50)
        _fill_mamba(m0, seed=51)
        _fill_mamba(m1, seed=52)
        keys = page_hashes(tokens(3, seed=53))
        # rank 0 is the MLA writer: KV and its Mamba state; rank 1 writes only its Mamba state
        # (HybridCacheController.should_backup under backup_skip), for the last page
        assert r0.batch_set_v1(keys, torch.arange(3 * PAGE)) == [True] * 3
        state = lambda k: PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([k]), keys=keys[2:])  # noqa: E731
        assert r0.batch_set_v2([state(1)]) == {PoolName.MAMBA: [True]}
        assert r1.batch_set_v2([state(2)]) == {PoolName.MAMBA: [True]}
        # the MLA KV is shared: rank 1 finds rank 0's pages and reads the same bytes
        assert r1.batch_exists(keys) == 3
        assert r1.batch_get_v1(keys, torch.arange(8 * PAGE, 11 * PAGE)) == [True] * 3
        for got, want in zip(pages_of(kv1, torch.arange(8 * PAGE, 11 * PAGE)), pages_of(kv0, torch.arange(3 * PAGE))):
            assert torch.equal(got, want)
        # each rank reads its own Mamba state back, never the other's
        for backend, host, src in ((r0, m0, 1), (r1, m1, 2)):
            want = host.get_data_page(src, flat=True).clone()
            assert backend.batch_get_v2([state(7)]) == {PoolName.MAMBA: [True]}
            assert torch.equal(host.get_data_page(7, flat=True), want)
        assert not torch.equal(m0.get_data_page(7, flat=True), m1.get_data_page(7, flat=True))
        # a rank without its own state finds none: its usable prefix stops where the state is missing
        r1_alone = [PoolTransfer(name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES, keys=keys[:1])]
        assert r1.batch_exists_v2(keys, r1_alone).kv_hit_pages == 3
        other = page_hashes(tokens(3, seed=54))
        assert r0.batch_set_v1(other, torch.arange(3 * PAGE)) == [True] * 3
        assert r1.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=other[2:])]) == {
            PoolName.MAMBA: [True]}
        only_r1 = [PoolTransfer(name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES, keys=other[:1])]
        assert r1.batch_exists_v2(other, only_r1).kv_hit_pages == 3
        assert r0.batch_exists_v2(other, only_r1).kv_hit_pages == 0  # rank 0 never reads rank 1's state
        assert r0.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([9]), keys=other[2:])]) == {
            PoolName.MAMBA: [False]}
    finally:
        r0.close()
        r1.close()


def test_the_per_pool_shard_follows_what_sglang_backs_up_per_rank() -> None:
    """For an MLA model on TP rank 1 (``backup_skip``: not the MLA writer),
    SGLang's own HybridCacheController.should_backup says which pools this
    rank backs up; exactly those keep the rank in their identity."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    class Rank1:  # what should_backup reads of its controller
        backup_skip = True
        storage_backend_type = "dynamic"
        mem_pool_host = type("Host", (), {"entry_map": {}})()

    mla = make_pools("mla", "page_first")
    config = harness.storage_config(mla, KVTIER, tp_rank=1, tp_size=2)
    pools = {PoolName.KV: mla.host, PoolName.INDEXER: mla.host, PoolName.SWA: mla.host, PoolName.MAMBA: make_mamba_pool()}
    for name, host in pools.items():
        backs_up = HybridCacheController.should_backup(Rank1(), PoolTransfer(name=name))  # type: ignore[arg-type]
        shard = pool_shard(config, str(name), host)
        assert (shard is not None) == backs_up, name
        assert shard is None or (shard.rank, shard.world) == (1, 2)
    # an MHA host pool (a draft's heads, split across ranks) keeps its rank even where
    # SGLang writes it from rank 0 only: rank 1 then misses instead of reading rank 0's heads
    assert pool_shard(config, str(PoolName.DRAFT), make_pools("mha", "page_first").host) is not None


# -- BLOCK_GROUPS never gates the KV hit ---------------------------------------------------


def test_block_groups_report_their_leading_complete_groups_and_never_gate_the_kv_hit(tmp_path: Path) -> None:
    kv, blocks = make_pools("mha", "page_first"), make_pools("mla", "page_first")
    kv.fill(seed=60)
    blocks.fill(seed=61)
    backend = KvtierHiCacheStorage(harness.storage_config(kv, {**KVTIER, "store_path": str(tmp_path)}))
    backend.register_mem_pool_host(kv.host)
    backend.register_mem_host_pool_v2(blocks.host, PoolName.DEEPSEEK_V4_C4)
    try:
        keys = page_hashes(tokens(6, seed=62))
        assert backend.batch_set_v1(keys, torch.arange(6 * PAGE)) == [True] * 6
        # groups of 2 keys, each covering 2 FULL pages: groups 0 and 1 whole, group 2 has one of its keys
        for i in (0, 1, 2, 3, 5):
            put = backend.batch_set_v2([PoolTransfer(name=PoolName.DEEPSEEK_V4_C4,
                                                     host_indices=torch.arange(i * PAGE, (i + 1) * PAGE), keys=[keys[i]])])
            assert put == {PoolName.DEEPSEEK_V4_C4: [True]}
        plain = backend.batch_exists_v2(keys, [])
        transfer = PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, hit_policy=PoolHitPolicy.BLOCK_GROUPS, keys=keys,
                                block_pages=2, group_pages=2)
        got = backend.batch_exists_v2(keys, [transfer])
        assert (got.kv_hit_pages, got.restorable_prefix_pages) == (plain.kv_hit_pages, plain.restorable_prefix_pages) == (
            6, [1, 2, 3, 4, 5, 6])
        assert got.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.DEEPSEEK_V4_C4: 4}
        # a geometry that is not two positive integers: no hits for that pool, the KV hit unchanged
        bad = PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, hit_policy=PoolHitPolicy.BLOCK_GROUPS, keys=keys)
        got = backend.batch_exists_v2(keys, [bad])
        assert got.kv_hit_pages == 6 and PoolName.DEEPSEEK_V4_C4 not in got.extra_pool_hit_pages
        # the verdict is capped at the KV hit
        short = backend.batch_exists_v2(keys[:3], [transfer])
        assert short.kv_hit_pages == 3 and short.extra_pool_hit_pages[PoolName.DEEPSEEK_V4_C4] == 3
    finally:
        backend.close()


@pytest.mark.parametrize("store", STORES)
def test_sglangs_hybrid_controller_on_two_mla_ranks_never_reads_the_other_ranks_state(
    store: str, store_config: Callable[[str], dict[str, Any]]
) -> None:
    """Two real HybridCacheControllers, TP ranks 0 and 1 of an MLA model with a
    Mamba pool: SGLang's own backup path writes the KV from rank 0 and each
    rank's Mamba state from that rank; SGLang's own hit query then finds, on
    each rank, the shared KV and only that rank's state."""
    extra = store_config(store)
    made = []
    try:
        for rank in (0, 1):
            kv, mamba = make_pools("mla", "page_first"), make_mamba_pool()
            made.append((harness.hybrid_controller(kv, mamba, extra, tp_rank=rank, tp_size=2), kv, mamba))
        (c0, kv0, m0), (c1, kv1, m1) = made
        assert (c0.backup_skip, c1.backup_skip) == (False, True)  # rank 0 is the MLA writer
        kv0.fill(seed=70)
        _fill_mamba(m0, seed=71)
        _fill_mamba(m1, seed=72)
        both, only_r1 = tokens(3, seed=73), tokens(3, seed=74)
        src = kv0.host.alloc(3 * PAGE)
        harness.hybrid_backup(c0, src, both, state_slot=1)
        harness.hybrid_backup(c1, src, both, state_slot=2)
        harness.hybrid_backup(c1, src, only_r1, state_slot=3)  # rank 1 alone: its state, and (backup_skip) no KV
        assert harness.hybrid_hit_query(c1, only_r1) == 0  # no KV without rank 0's backup
        b0, b1 = backend_of(c0), backend_of(c1)
        assert b0.batch_set_v1(page_hashes(only_r1), src) == [True] * 3  # the KV of only_r1, from rank 0, no state
        assert harness.hybrid_hit_query(c0, both) == 3 and harness.hybrid_hit_query(c1, both) == 3
        assert harness.hybrid_hit_query(c1, only_r1) == 3
        assert harness.hybrid_hit_query(c0, only_r1) == 0  # rank 0 never takes rank 1's state for its own
        # the bytes: each rank's state comes back as it was written on that rank
        last = page_hashes(both)[-1:]
        for backend, host, slot in ((b0, m0, 1), (b1, m1, 2)):
            got = backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([9]), keys=last)])
            assert got == {PoolName.MAMBA: [True]}
            assert torch.equal(host.get_data_page(9, flat=True), host.get_data_page(slot, flat=True))
        assert b1.batch_get_v1(page_hashes(both), torch.arange(8 * PAGE, 11 * PAGE)) == [True] * 3
        for got_page, want in zip(pages_of(kv1, torch.arange(8 * PAGE, 11 * PAGE)), pages_of(kv0, src)):
            assert torch.equal(got_page, want)
    finally:
        for ctl, _, _ in made:
            ctl.detach_storage_backend()


@pytest.mark.parametrize("order", ["anchor-first", "sidecar-first"])
def test_an_unexplained_uint8_sidecar_fails_the_attach_in_either_order(tmp_path: Path, order: str) -> None:
    """A bf16 anchor with an fp8 (uint8) sidecar and no setting that says which
    fp8: refused while SGLang attaches, whichever pool it registers first,
    never later inside a batch call on SGLang's threads."""
    kv, swa = make_pools("mha", "page_first"), fp8_pools("mha", torch.float8_e5m2)
    backend = KvtierHiCacheStorage(harness.storage_config(kv, {**KVTIER, "store_path": str(tmp_path)}))
    with pytest.raises(ConfigurationError, match=r"host pool 'swa' \(MHATokenToKVPoolHost\) holds its KV as uint8"):
        if order == "anchor-first":
            backend.register_mem_pool_host(kv.host)
            backend.register_mem_host_pool_v2(swa.host, PoolName.SWA)
        else:
            backend.register_mem_host_pool_v2(swa.host, PoolName.SWA)
            backend.register_mem_pool_host(kv.host)
    assert backend.store is None  # the refused attach left no store open


# -- a draft model's pools: --speculative-draft-kv-cache-dtype -----------------------------------


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_draft_pool_takes_its_fp8_format_from_the_draft_flag(kind: str) -> None:
    """A speculative draft's host pools hold their fp8 KV as uint8 too, and SGLang
    gives the draft its own --speculative-draft-kv-cache-dtype: an e5m2 draft beside
    an e4m3 target is keyed e5m2 (its pages never read as the target's format)."""
    from kvtier.integrations.sglang.storage import kv_element_format

    host = fp8_pools(kind, torch.float8_e4m3fn).host
    with sglang_settings(kv_cache_dtype="fp8_e4m3", speculative_draft_kv_cache_dtype="fp8_e5m2"):
        assert [kv_element_format(host, p) for p in ("kv", "draft", "draft_swa", "draft_indexer")] == [
            "float8_e4m3fn", "float8_e5m2", "float8_e5m2", "float8_e5m2"]
        with pytest.raises(ConfigurationError) as refused:
            kv_element_format(host, "draft", kv_cache_dtype="fp8_e4m3")
        assert str(refused.value) == (
            "KvtierHiCacheStorage extra-config 'kv_cache_dtype'='fp8_e4m3' (float8_e4m3fn) contradicts SGLang's "
            "--speculative-draft-kv-cache-dtype 'fp8_e5m2' (float8_e5m2) for host pool 'draft'; pass the value "
            "given to SGLang")
    with sglang_settings(kv_cache_dtype="fp8_e5m2", speculative_draft_kv_cache_dtype="auto"):
        assert kv_element_format(host, "draft") == "float8_e5m2"  # "auto": the draft follows --kv-cache-dtype
    with sglang_settings(kv_cache_dtype="bfloat16", speculative_draft_kv_cache_dtype="auto"):
        with pytest.raises(ConfigurationError) as refused:  # a uint8 draft pool no flag explains
            kv_element_format(host, "draft")
        assert "SGLang's --kv-cache-dtype is 'bfloat16'" in str(refused.value)


def test_the_namespace_of_a_kv_pool_is_its_kv_identity_with_the_format_given() -> None:
    """namespace_for keys pool "kv" and takes the extra-config kv_cache_dtype: with no
    SGLang setting published, the format given alone decides (e4m3 and e5m2 apart)."""
    from kvtier.integrations.sglang.storage import pool_identity

    pools = fp8_pools("mha", torch.float8_e4m3fn)
    config = harness.storage_config(pools, KVTIER)
    nbytes = 4096
    spaces = {fmt: namespace_for(config, pools.host, model="tiny", page_nbytes=nbytes, kv_cache_dtype=fmt)
              for fmt in ("fp8_e4m3", "fp8_e5m2")}
    assert spaces["fp8_e4m3"] != spaces["fp8_e5m2"]
    assert spaces["fp8_e5m2"] == pool_identity(config, pools.host, "kv", model="tiny", page_nbytes=nbytes,
                                               kv_cache_dtype="fp8_e5m2").engine_namespace()


def test_on_rocm_every_fp8_cache_is_sglangs_platform_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang on ROCm keeps every fp8 KV cache in its platform's fp8 (e4m3fnuz): the
    identity names that format, not the flag's (a ROCm page is never read as CUDA's)."""
    import sglang.kernels.ops.quantization.fp8_kernel as fp8_kernel
    import sglang.srt.utils as sglang_utils
    from kvtier.integrations.sglang.storage import kv_element_format

    host = fp8_pools("mha", torch.float8_e4m3fn).host
    with sglang_settings(kv_cache_dtype="fp8_e4m3"):
        assert kv_element_format(host, "kv") == "float8_e4m3fn"
        monkeypatch.setattr(sglang_utils, "is_hip", lambda: True)
        monkeypatch.setattr(fp8_kernel, "fp8_dtype", torch.float8_e4m3fnuz, raising=False)
        assert kv_element_format(host, "kv") == "float8_e4m3fnuz"
        assert kv_element_format(host, "kv", kv_cache_dtype="fp8_e4m3") == "float8_e4m3fnuz"
        # an e5m2 flag too: SGLang's ROCm cache is its platform fp8 whatever the flag said
        assert kv_element_format(host, "kv", kv_cache_dtype="fp8_e5m2") == "float8_e4m3fnuz"
    with sglang_settings(kv_cache_dtype="fp8_e5m2"):
        assert kv_element_format(host, "kv") == "float8_e4m3fnuz"
    assert kv_element_format(host, "kv", kv_cache_dtype="fp8_e5m2") == "float8_e4m3fnuz"  # given alone
    # torch's own name of a format is that format: no platform rule applies to it
    assert kv_element_format(host, "kv", kv_cache_dtype="float8_e5m2") == "float8_e5m2"


# -- a sidecar's true element format and the Mamba state's dtypes are in their identity ------


def _engine_with(tmp_path: Path, pool: PoolName, host: Any, kv_cache_dtype: str | None = None) -> KvtierHiCacheStorage:
    """A bf16 MHA anchor over the test's one file store, with ``host`` as sidecar ``pool``."""
    kv = make_pools("mha", "page_first")
    extra = {**KVTIER, "store_path": str(tmp_path / "store")}
    if kv_cache_dtype is not None:
        extra["kv_cache_dtype"] = kv_cache_dtype
    backend = KvtierHiCacheStorage(harness.storage_config(kv, extra))
    backend.register_mem_pool_host(kv.host)
    backend.register_mem_host_pool_v2(host, pool)
    return backend


def test_an_fp8_sidecar_of_another_format_never_gets_the_pages(tmp_path: Path) -> None:
    """Two engines equal but for the fp8 format of their SWA sidecar (both
    ``uint8`` in SGLang's host pool): the e5m2 engine never finds the e4m3
    engine's SWA pages, under its own keys or under the writer's (its key pool
    names the format, its seal the identity); an engine of the same format
    reads them byte for byte."""
    pools = {fmt: fp8_pools("mha", dtype) for fmt, dtype in (
        ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e4m3 again", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2))}
    pools["fp8_e4m3"].fill(seed=80)
    pools["fp8_e5m2"].fill(seed=81)
    pools["fp8_e4m3 again"].fill(seed=82)
    made = {name: _engine_with(tmp_path, PoolName.SWA, p.host, kv_cache_dtype=name.split()[0])
            for name, p in pools.items()}
    try:
        writer, same, other = made["fp8_e4m3"], made["fp8_e4m3 again"], made["fp8_e5m2"]
        assert writer.namespace == other.namespace  # the anchors are equal: only the sidecar differs
        key_pools = {name: b._pool(PoolName.SWA).key_pool for name, b in made.items()}  # type: ignore[union-attr]
        assert key_pools["fp8_e4m3"] == key_pools["fp8_e4m3 again"] == (
            "swa|MHATokenToKVPoolHost|page_first|torch.uint8|384|format=float8_e4m3fn")
        assert key_pools["fp8_e5m2"] == "swa|MHATokenToKVPoolHost|page_first|torch.uint8|384|format=float8_e5m2"
        keys = page_hashes(tokens(2, seed=83))
        put = writer.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(2 * PAGE), keys=keys)])
        assert put == {PoolName.SWA: [True, True]}
        dst = torch.arange(8 * PAGE, 10 * PAGE)
        before = pages_of(pools["fp8_e5m2"], dst)
        got = other.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=dst, keys=keys)])
        assert got == {PoolName.SWA: [False, False]}
        assert [torch.equal(a, b) for a, b in zip(pages_of(pools["fp8_e5m2"], dst), before)] == [True, True]
        got = same.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=dst, keys=keys)])
        assert got == {PoolName.SWA: [True, True]}
        for a, b in zip(pages_of(pools["fp8_e4m3 again"], dst), pages_of(pools["fp8_e4m3"], torch.arange(2 * PAGE))):
            assert torch.equal(a, b)
        # The e5m2 engine's seal refuses the e4m3 pages even under its own key pool's name.
        other._pools[str(PoolName.SWA)] = dataclasses.replace(other._pool(PoolName.SWA), key_pool=key_pools["fp8_e4m3"])  # type: ignore[arg-type]
        got = other.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=dst, keys=keys)])
        assert got == {PoolName.SWA: [False, False]} and other.statistics().broken == {"identity": 2}
        assert [torch.equal(a, b) for a, b in zip(pages_of(pools["fp8_e5m2"], dst), before)] == [True, True]
    finally:
        for b in made.values():
            b.close()


MAMBA_DTYPES = {
    "bf16 conv, f32 temporal": (torch.bfloat16, torch.float32),
    "f16 conv": (torch.float16, torch.float32),  # the same bytes a state as the first
    "bf16 temporal": (torch.bfloat16, torch.bfloat16),
    "f16 temporal, bf16 conv": (torch.bfloat16, torch.float16),  # the same bytes as the one before
}


@pytest.mark.parametrize(("a", "b"), [("bf16 conv, f32 temporal", "f16 conv"), ("bf16 temporal", "f16 temporal, bf16 conv")])
def test_a_mamba_state_of_other_dtypes_is_never_read(tmp_path: Path, a: str, b: str) -> None:
    """Two engines whose Mamba pools differ in one state dtype alone (a page
    of the same bytes): the reader never takes the writer's state (its seal
    names the dtypes: a counted identity refusal), and its slot is left as it
    was; an engine of the same dtypes reads the state byte for byte."""
    pools = {name: make_mamba_pool(conv=MAMBA_DTYPES[name][0], temporal=MAMBA_DTYPES[name][1]) for name in (a, b)}
    twin = make_mamba_pool(conv=MAMBA_DTYPES[a][0], temporal=MAMBA_DTYPES[a][1])
    assert {p.get_dummy_flat_data_page().numel() for p in pools.values()} == {twin.get_dummy_flat_data_page().numel()}
    for seed, host in enumerate((*pools.values(), twin)):
        _fill_mamba(host, seed=90 + seed)
    writer, reader, same = (_engine_with(tmp_path, PoolName.MAMBA, h) for h in (pools[a], pools[b], twin))
    try:
        identities = [e.identity.anchor for e in (writer, reader)]  # type: ignore[union-attr]
        assert identities[0] == identities[1]  # equal KV anchors: one namespace
        assert writer._pool(PoolName.MAMBA).key_pool == reader._pool(PoolName.MAMBA).key_pool  # type: ignore[union-attr]
        keys = page_hashes(tokens(1, seed=94))
        state = lambda slot: [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=keys)]  # noqa: E731
        assert writer.batch_set_v2(state(1)) == {PoolName.MAMBA: [True]}
        was = pools[b].get_data_page(7, flat=True).clone()
        assert reader.batch_get_v2(state(7)) == {PoolName.MAMBA: [False]}
        assert reader.statistics().broken == {"identity": 1}
        assert torch.equal(pools[b].get_data_page(7, flat=True), was)
        assert same.batch_get_v2(state(7)) == {PoolName.MAMBA: [True]}
        assert torch.equal(twin.get_data_page(7, flat=True), pools[a].get_data_page(1, flat=True))
    finally:
        for e in (writer, reader, same):
            e.close()


def test_the_keys_and_seal_of_a_mamba_state_are_pinned(tmp_path: Path) -> None:
    """A Mamba pool (no ``layer_num``; its page: every state tensor's bytes)
    beside an MLA anchor, TP rank 1 of 2: the key pool (as before identities)
    and the identity tag each stored state carries, byte for byte, so states
    stored by this release stay readable."""
    kv, mamba = make_pools("mla", "page_first"), make_mamba_pool()
    backend = KvtierHiCacheStorage(harness.storage_config(kv, {**KVTIER, "store_path": str(tmp_path)}, model="tiny",
                                                          tp_rank=1, tp_size=2))
    backend.register_mem_pool_host(kv.host)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    try:
        pool = backend._pool(PoolName.MAMBA)
        assert pool is not None and pool.key_pool == "mamba|MambaPoolHost|page_first|torch.uint8|448|tp=1/2"
        assert pool.tag.hex() == "e1b9c96907b3b6c7"
    finally:
        backend.close()


def test_an_sglang_without_deepseek_v4_keys_its_pools_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """An SGLang release without DeepSeek V4's host pool (no
    ``DeepSeekV4PagedHostPool`` to import): every other pool's identity is what
    it is with V4 present, never a V4 row format asked of it."""
    import sglang.srt.mem_cache.memory_pool_host as memory_pool_host
    from kvtier.integrations.sglang.storage import pool_identity

    pools = make_pools("mha", "page_first")
    config = harness.storage_config(pools, KVTIER)
    with_v4 = pool_identity(config, pools.host, "swa", model="tiny", page_nbytes=768)
    monkeypatch.delattr(memory_pool_host, "DeepSeekV4PagedHostPool")
    without = pool_identity(config, pools.host, "swa", model="tiny", page_nbytes=768)
    assert without == with_v4 and without.digest() == with_v4.digest()
    assert not [e for e in without.extra if e.startswith("dsv4_kv=")]


def test_a_host_pool_without_a_torch_dtype_is_refused_naming_it() -> None:
    from kvtier.integrations.sglang.storage import kv_element_format

    host = make_pools("mha", "page_first").host
    host.dtype = "bf16"  # an engine's own pool class that keeps a name, not a torch dtype
    with pytest.raises(ConfigurationError) as refused:
        kv_element_format(host, "swa")
    assert str(refused.value) == "SGLang host pool 'swa' (MHATokenToKVPoolHost) has no torch dtype; got 'bf16'"
    del host.dtype  # a pool class with no dtype at all
    assert not hasattr(host, "dtype")
    with pytest.raises(ConfigurationError) as refused:
        kv_element_format(host, "swa")
    assert str(refused.value) == "SGLang host pool 'swa' (MHATokenToKVPoolHost) has no torch dtype; got None"


def test_an_mha_draft_pool_of_an_mla_model_is_read_only_by_its_own_rank(tmp_path: Path) -> None:
    """An MLA model's KV is one page for every TP rank, but a draft's MHA host
    pool holds each rank's own heads: TP rank 1 never reads rank 0's draft
    pages (its key pool and seal name its rank); rank 0 reads its own back."""
    made, drafts = [], []
    try:
        for rank in (0, 1):
            kv, draft = make_pools("mla", "page_first"), make_pools("mha", "page_first")
            draft.fill(seed=100 + rank)
            backend = KvtierHiCacheStorage(harness.storage_config(kv, {**KVTIER, "store_path": str(tmp_path)},
                                                                  tp_rank=rank, tp_size=2))
            backend.register_mem_pool_host(kv.host)
            backend.register_mem_host_pool_v2(draft.host, PoolName.DRAFT)
            made.append(backend)
            drafts.append(draft)
        r0, r1 = made
        assert r0.namespace == r1.namespace  # the MLA KV: one namespace for both ranks
        assert [b._pool(PoolName.DRAFT).key_pool for b in made] == [  # type: ignore[union-attr]
            f"draft|MHATokenToKVPoolHost|page_first|torch.bfloat16|768|tp={r}/2" for r in (0, 1)]
        keys = page_hashes(tokens(2, seed=102))
        transfer = lambda idx: [PoolTransfer(name=PoolName.DRAFT, host_indices=idx, keys=keys)]  # noqa: E731
        assert r0.batch_set_v2(transfer(torch.arange(2 * PAGE))) == {PoolName.DRAFT: [True, True]}
        dst = torch.arange(8 * PAGE, 10 * PAGE)
        before = pages_of(drafts[1], dst)
        assert r1.batch_get_v2(transfer(dst)) == {PoolName.DRAFT: [False, False]}
        assert [torch.equal(a, b) for a, b in zip(pages_of(drafts[1], dst), before)] == [True, True]
        assert r0.batch_get_v2(transfer(dst)) == {PoolName.DRAFT: [True, True]}
        for a, b in zip(pages_of(drafts[0], dst), pages_of(drafts[0], torch.arange(2 * PAGE))):
            assert torch.equal(a, b)
    finally:
        for b in made:
            b.close()


def test_an_sglang_without_decode_context_parallel_keys_as_one_dcp_rank() -> None:
    """An SGLang release whose storage config has no ``dcp_size`` / ``dcp_rank``
    (before decode context parallel): every pool is keyed as with one DCP rank."""
    from kvtier.integrations.sglang.storage import pool_identity

    pools = make_pools("mla", "page_first")
    config = harness.storage_config(pools, KVTIER, tp_rank=1, tp_size=2)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if not f.name.startswith("dcp_")}
    older = type("HiCacheStorageConfig", (), fields)()  # the config as such a release builds it
    assert not hasattr(older, "dcp_size")
    for pool in ("kv", "swa"):
        assert (pool_identity(older, pools.host, pool, model="tiny", page_nbytes=576)
                == pool_identity(config, pools.host, pool, model="tiny", page_nbytes=576)), pool


def test_the_seals_of_a_single_rank_engine_are_pinned(tmp_path: Path) -> None:
    """One TP rank (no shard): the identity tags every stored KV and SWA page
    carries, byte for byte, so pages stored by this release stay readable."""
    pools = make_pools("mha", "page_first")
    backend = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path)}))
    backend.register_mem_pool_host(pools.host)
    backend.register_mem_host_pool_v2(pools.host, PoolName.SWA)
    try:
        assert backend.identity is not None and backend.identity.anchor.shard is None
        assert (backend._pool(PoolName.KV).tag.hex(), backend._pool(PoolName.SWA).tag.hex()) == (  # type: ignore[union-attr]
            "70595fdb308a4ca5", "4531f8de3883bdc8")
    finally:
        backend.close()


class _OwnHostPool:
    """An engine's own host pool class: SGLang's page copies (of the pool it
    wraps) and nothing more, no ``layout`` or ``layer_num``."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.dtype, self.page_size = inner.dtype, inner.page_size

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return self._inner.get_dummy_flat_data_page()  # type: ignore[no-any-return]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self._inner.get_data_page(index, flat=flat)  # type: ignore[no-any-return]

    def set_from_flat_data_page(self, index: int, data: torch.Tensor) -> None:
        self._inner.set_from_flat_data_page(index, data)


def test_a_host_pool_without_a_layout_is_stored_under_pinned_keys(tmp_path: Path) -> None:
    """A sidecar pool of a class that has page copies but no ``layout`` (nor
    ``layer_num``): stored and read back byte for byte, under the key pool and
    seal tag of a pool of layout "none", pinned so its pages stay readable."""
    own = make_pools("mha", "page_first")
    own.fill(seed=110)
    host = _OwnHostPool(own.host)
    assert not hasattr(host, "layout") and not hasattr(host, "layer_num")
    backend = _engine_with(tmp_path, PoolName.SWA, host)
    try:
        pool = backend._pool(PoolName.SWA)
        assert pool is not None and pool.key_pool == "swa|_OwnHostPool|none|torch.bfloat16|768"
        assert pool.tag.hex() == "18d5bb64e8cbfd20"
        keys = page_hashes(tokens(2, seed=111))
        transfer = lambda idx: [PoolTransfer(name=PoolName.SWA, host_indices=idx, keys=keys)]  # noqa: E731
        assert backend.batch_set_v2(transfer(torch.arange(2 * PAGE))) == {PoolName.SWA: [True, True]}
        dst = torch.arange(8 * PAGE, 10 * PAGE)
        assert backend.batch_get_v2(transfer(dst)) == {PoolName.SWA: [True, True]}
        for a, b in zip(pages_of(own, dst), pages_of(own, torch.arange(2 * PAGE))):
            assert torch.equal(a, b)
    finally:
        backend.close()
