"""kvtier inside SGLang: `KvtierHiCacheStorage` built by SGLang's dynamic
backend factory, driven through SGLang's own host pools (every layout) and its
cache controller's storage methods, over a file store and a real redis-server.

Every test compares bytes: what SGLang's host pool holds after a prefetch is
what another host pool held when it was backed up, page for page.

They need SGLang (sglang==0.5.23, installed ``--no-deps`` with the pure
packages of tests/sglang/requirements.txt into ``.venv-sglang`` by ``make
test-sglang``); without it this module reports itself skipped, so ``make
test`` in kvtier's own venv passes. (No conftest.py here: tests/conftest.py
is imported by name by the suite's modules, and a second conftest module
would shadow it.)

torchvision: SGLang's config modules import it at module level, and the
wheels a resolver finds do not load against the CPU torch; where SGLang is
installed and no torchvision is, tests/sglang/stand_ins/torchvision (an
import-only stand-in whose every callable raises; its docstring says exactly
what and why) goes at the END of ``sys.path``, so a real torchvision wins.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

_SGLANG = importlib.util.find_spec("sglang")
# With tests/ on sys.path, tests/sglang is a namespace package named sglang
# (origin None); only a real sglang counts.
if _SGLANG is not None and _SGLANG.origin is not None and importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(Path(__file__).parent / "stand_ins"))
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed; `make test-sglang` builds .venv-sglang with sglang==0.5.23")

import harness  # noqa: E402
from harness import (  # noqa: E402
    KVTIER, LAYOUTS, PAGE, Pools, backend_of, backup, make_pools, needs_redis_server, page_hashes, pages_of, prefetch,
    single_rank, tokens, write_pages,
)
from kvtier.errors import ConfigurationError  # noqa: E402
from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402
from kvtier.testing.redis_server import LocalRedisCluster, LocalRedisServer  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageFailureInjector,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

pytestmark = pytest.mark.sglang

STORES = ["file", pytest.param("redis", marks=needs_redis_server)]
SHARED_STORES = [*STORES, pytest.param("cluster", marks=needs_redis_server)]


@pytest.fixture(autouse=True)
def one_rank() -> Iterator[None]:
    with single_rank():
        yield


@pytest.fixture
def store_config(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], dict[str, Any]]:
    """The extra config of one shared store, by name ('file' / 'redis'): every
    backend made from it (each as another SGLang process would) shares the store."""
    prefix = f"t{random.getrandbits(32):08x}:"

    def make(name: str) -> dict[str, Any]:
        if name == "file":
            return {**KVTIER, "store": "file", "store_path": str(tmp_path / "store")}
        if name == "cluster":
            cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
            return {**KVTIER, "store": "redis", "cluster": True, "redis_url": cluster.url, "prefix": prefix, "timeout_s": 5.0}
        server: LocalRedisServer = request.getfixturevalue("redis_server")
        return {**KVTIER, "store": "redis", "redis_url": server.url, "prefix": prefix, "timeout_s": 2.0}

    return make


@pytest.fixture
def controllers() -> Iterator[Callable[..., Any]]:
    """Real HiCacheControllers (storage threads running); all detached at teardown."""
    made: list[Any] = []

    def make(pools: Pools, extra: dict[str, Any], **kw: Any) -> Any:
        ctl = harness.controller(pools, extra, **kw)
        made.append(ctl)
        return ctl

    yield make
    for ctl in made:
        ctl.detach_storage_backend()


def assert_same_pages(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"page {i} differs"


# -- the factory ------------------------------------------------------------------


def test_sglangs_factory_builds_it_from_the_dynamic_extra_config(tmp_path: Path) -> None:
    pools = make_pools("mha", "page_first")
    extra = {**KVTIER, "store_path": str(tmp_path)}
    backend = StorageBackendFactory.create_backend("dynamic", harness.storage_config(pools, extra), pools.host)
    try:
        assert isinstance(backend, KvtierHiCacheStorage)
        backend.register_mem_pool_host(pools.host)
        assert backend.batch_exists(["0" * 64]) == 0
    finally:
        backend.close()


def test_bad_extra_config_fails_the_attach_naming_the_key(tmp_path: Path) -> None:
    pools = make_pools("mha", "page_first")
    for extra, message in [
        ({**KVTIER, "stroe": "file"}, r"does not know extra-config key\(s\) \['stroe'\]"),
        ({**KVTIER, "store": "s3"}, "store must be 'file', 'redis' or 'mooncake'; got 's3'"),
        ({**KVTIER, "timeout_s": 0}, r"timeout_s must be a number of seconds > 0 \(.*\); got 0"),
    ]:
        with pytest.raises(ConfigurationError, match=message):
            StorageBackendFactory.create_backend("dynamic", harness.storage_config(pools, extra), pools.host)
    with pytest.raises(ConfigurationError, match="needs the model's identity"):
        StorageBackendFactory.create_backend("dynamic", harness.storage_config(pools, KVTIER, model=""), pools.host)


# -- v1 round trips in every host-pool layout ----------------------------------------


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize(("kind", "layout"), LAYOUTS, ids=[f"{k}-{lay}" for k, lay in LAYOUTS])
def test_pages_round_trip_byte_for_byte_in_every_layout(
    kind: str, layout: str, store: str, store_config: Callable[[str], dict[str, Any]]
) -> None:
    a, b = make_pools(kind, layout), make_pools(kind, layout)
    a.fill(seed=1)
    b.fill(seed=2)
    extra = store_config(store)
    writer = StorageBackendFactory.create_backend("dynamic", harness.storage_config(a, extra), a.host)
    reader = StorageBackendFactory.create_backend("dynamic", harness.storage_config(b, extra), b.host)
    try:
        writer.register_mem_pool_host(a.host)
        reader.register_mem_pool_host(b.host)
        keys = page_hashes(tokens(5))
        src = torch.arange(4 * PAGE, 9 * PAGE)  # pages 4..8 of a
        dst = torch.cat([torch.arange(20 * PAGE, 22 * PAGE), torch.arange(10 * PAGE, 13 * PAGE)])  # scattered in b
        assert writer.batch_set_v1(keys, src) == [True] * 5
        assert reader.batch_exists(keys) == 5
        assert reader.batch_get_v1(keys, dst) == [True] * 5
        assert_same_pages(pages_of(b, dst), pages_of(a, src))
        # the legacy flat-page calls read the same bytes
        flat = reader.batch_get(keys, [b.host.get_dummy_flat_data_page() for _ in keys])
        assert all(f is not None for f in flat)
        assert_same_pages([f.view(torch.uint8) for f in flat if f is not None], pages_of(a, src))
    finally:
        writer.close()
        reader.close()


def test_the_legacy_calls_round_trip_flat_pages(tmp_path: Path) -> None:
    pools = make_pools("mha", "layer_first")
    backend = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path)}))
    backend.register_mem_pool_host(pools.host)
    try:
        pages = [torch.randn(pools.host.get_dummy_flat_data_page().shape).to(torch.bfloat16) for _ in range(3)]
        assert backend.batch_set(["a", "b", "c"], pages) is True
        assert backend.exists("b") and not backend.exists("d")
        got = backend.get("b", pools.host.get_dummy_flat_data_page())
        assert got is not None and torch.equal(got.view(torch.int16), pages[1].view(torch.int16))
        assert backend.batch_get(["a", "d"]) [1] is None
    finally:
        backend.close()


# -- SGLang's controller: two controllers share one store ------------------------------------


@pytest.mark.parametrize("store", SHARED_STORES)
@pytest.mark.parametrize("interface_v1", [1, 0], ids=["v1", "legacy"])
def test_two_controllers_share_a_prefix_through_one_store(
    store: str, interface_v1: int, store_config: Callable[[str], dict[str, Any]], controllers: Callable[..., Any]
) -> None:
    extra = {**store_config(store), "interface_v1": interface_v1}
    a, b = make_pools("mha", "page_first"), make_pools("mha", "page_first")
    a.fill(seed=3)
    ctl_a, ctl_b = controllers(a, extra), controllers(b, extra)
    prompt = tokens(6, seed=7)
    src = a.host.alloc(6 * PAGE)
    assert backup(ctl_a, src, prompt) == 6 * PAGE
    found, landed, dst = prefetch(ctl_b, prompt)
    assert (found, landed) == (6, 6)
    assert_same_pages(pages_of(b, dst), pages_of(a, src))
    # a prompt that shares the first 4 pages finds exactly those
    other = prompt[: 4 * PAGE] + tokens(2, seed=99)
    assert prefetch(ctl_b, other)[:2] == (4, 4)


def test_tp_shards_are_apart_and_mla_ranks_share(tmp_path: Path) -> None:
    extra = {**KVTIER, "store_path": str(tmp_path)}
    keys = page_hashes(tokens(2))
    for kind, shared in (("mha", False), ("mla", True)):
        pools = make_pools(kind, "layer_first")
        pools.fill(seed=4)
        rank0 = KvtierHiCacheStorage(harness.storage_config(pools, extra, tp_size=2, tp_rank=0))
        rank1 = KvtierHiCacheStorage(harness.storage_config(pools, extra, tp_size=2, tp_rank=1))
        rank0.register_mem_pool_host(pools.host)
        rank1.register_mem_pool_host(pools.host)
        try:
            assert rank0.batch_set_v1(keys, torch.arange(2 * PAGE)) == [True, True]
            assert rank1.batch_exists(keys) == (2 if shared else 0), kind
        finally:
            rank0.close()
            rank1.close()


# -- damage: a shorter prefix, never wrong bytes --------------------------------------------


def _file_of(root: Path, backend: KvtierHiCacheStorage, key: str) -> Path:
    assert backend.namespace is not None
    kv_key = backend.namespace.key(key).hex()
    return root / backend.namespace.label() / kv_key[:2] / f"{kv_key}.data"


def test_a_damaged_page_becomes_a_shorter_prefix(tmp_path: Path, controllers: Callable[..., Any]) -> None:
    extra = {**KVTIER, "store_path": str(tmp_path)}
    a, b = make_pools("mha", "page_first"), make_pools("mha", "page_first")
    a.fill(seed=5)
    ctl_a, ctl_b = controllers(a, extra), controllers(b, extra)
    prompt = tokens(5, seed=11)
    src = a.host.alloc(5 * PAGE)
    assert backup(ctl_a, src, prompt) == 5 * PAGE
    data = _file_of(tmp_path, backend_of(ctl_a), page_hashes(prompt)[2])
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit, same length: only a checksum sees it
    data.write_bytes(raw)
    found, landed, dst = prefetch(ctl_b, prompt)
    assert (found, landed) == (5, 2)  # present whole, but page 2 fails its seal
    assert_same_pages(pages_of(b, dst)[:2], pages_of(a, src)[:2])
    assert backend_of(ctl_b).statistics().broken == {"checksum": 1}  # type: ignore[union-attr]
    # writing the prefix again repairs it
    assert backup(ctl_a, src, prompt) == 5 * PAGE
    found, landed, dst = prefetch(ctl_b, prompt)
    assert (found, landed) == (5, 5)
    assert_same_pages(pages_of(b, dst), pages_of(a, src))


@needs_redis_server
def test_a_torn_or_spliced_redis_page_is_a_miss(store_config: Callable[[str], dict[str, Any]], controllers: Callable[..., Any]) -> None:
    import redis

    extra = store_config("redis")
    a, b = make_pools("mla", "page_first"), make_pools("mla", "page_first")
    a.fill(seed=6)
    ctl_a, ctl_b = controllers(a, extra), controllers(b, extra)
    prompt = tokens(4, seed=13)
    src = a.host.alloc(4 * PAGE)
    assert backup(ctl_a, src, prompt) == 4 * PAGE
    ns = backend_of(ctl_a).namespace
    assert ns is not None
    prefix = f"{extra['prefix']}{ns.label()}:"
    keys = [ns.key(h).hex() for h in page_hashes(prompt)]
    raw = redis.Redis.from_url(extra["redis_url"])
    # page 3 spliced from page 1 (same length, another key's seal); page 2 untouched
    raw.set(f"{prefix}{{{keys[3]}}}:b:kv", raw.get(f"{prefix}{{{keys[1]}}}:b:kv"))
    assert prefetch(ctl_b, prompt)[:2] == (4, 3)
    # page 1 cut short behind the store's back (its commit record still names the old length)
    blob = raw.get(f"{prefix}{{{keys[1]}}}:b:kv")
    raw.set(f"{prefix}{{{keys[1]}}}:b:kv", blob[:-8])
    found, landed, dst = prefetch(ctl_b, prompt)
    assert (found, landed) == (1, 1)
    assert_same_pages(pages_of(b, dst), pages_of(a, src)[:1])
    raw.close()


def test_sglangs_file_backend_hands_back_the_flipped_byte(tmp_path: Path) -> None:
    """The comparison the README reports: SGLang's built-in HiCacheFile stores
    raw bytes, so the same one-bit damage comes back as a successful read."""
    pools = make_pools("mha", "page_first")
    pools.fill(seed=8)
    extra = {"file_storage_path": str(tmp_path)}
    builtin = HiCacheFile(harness.storage_config(pools, extra))
    keys = page_hashes(tokens(1))
    page = pools.host.get_data_page(0, flat=True)
    assert builtin.batch_set(keys, [page])
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".bin"]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(raw)
    got = builtin.get(keys[0], pools.host.get_dummy_flat_data_page())
    assert got is not None  # a hit...
    assert not torch.equal(got.view(torch.uint8), page.contiguous().view(torch.uint8))  # ...with the flipped bit


# -- faults: misses, never exceptions, never wrong bytes -------------------------------------


def test_sglangs_failure_injector_corrupts_nothing(
    tmp_path: Path, controllers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's own HiCacheStorageFailureInjector, switched on as SGLang's tests
    do (its environment variable): the factory wraps kvtier's backend in it."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    extra = {**KVTIER, "store_path": str(tmp_path)}
    a, b = make_pools("mha", "layer_first", slots=256), make_pools("mha", "layer_first", slots=256)
    a.fill(seed=9)
    ctl_a, ctl_b = controllers(a, extra), controllers(b, extra)
    assert isinstance(ctl_a.storage_backend, HiCacheStorageFailureInjector)
    landed_any = 0
    for round_ in range(12):
        prompt = tokens(3, seed=100 + round_ % 4)  # four prompts, each backed up and fetched several times
        src = a.host.alloc(3 * PAGE)
        write_pages(a, src, seed=round_ % 4)  # the same prompt always has the same KV bytes, as in a model
        backup(ctl_a, src, prompt)
        found, landed, dst = prefetch(ctl_b, prompt)
        assert landed <= found
        # whatever landed is exactly what was backed up: the same prompt's pages are the same bytes
        assert_same_pages(pages_of(b, dst)[:landed], pages_of(a, src)[:landed])
        landed_any += landed
        a.host.free(src)
        if dst.numel():
            b.host.free(dst)
    assert landed_any > 0


@needs_redis_server
def test_a_killed_redis_server_corrupts_nothing(
    fresh_server: Callable[..., LocalRedisServer], controllers: Callable[..., Any]
) -> None:
    server = fresh_server()
    extra = {**KVTIER, "store": "redis", "redis_url": server.url, "timeout_s": 1.0}
    a, b = make_pools("mha", "page_first"), make_pools("mha", "page_first")
    a.fill(seed=10)
    ctl_a, ctl_b = controllers(a, extra), controllers(b, extra)
    prompt = tokens(4, seed=17)
    src = a.host.alloc(4 * PAGE)
    assert backup(ctl_a, src, prompt) == 4 * PAGE
    server.kill()
    assert prefetch(ctl_b, prompt)[:2] == (0, 0)  # a miss, not an exception in SGLang's thread
    assert backup(ctl_a, src, prompt) == 0
    assert backend_of(ctl_b).statistics().faults >= 1  # type: ignore[union-attr]
    server.start()  # empty again: nothing was persisted
    assert prefetch(ctl_b, prompt)[:2] == (0, 0)
    assert backup(ctl_a, src, prompt) == 4 * PAGE
    found, landed, dst = prefetch(ctl_b, prompt)
    assert (found, landed) == (4, 4)
    assert_same_pages(pages_of(b, dst), pages_of(a, src))


# -- upkeep ---------------------------------------------------------------------------------


@pytest.mark.parametrize("store", SHARED_STORES)
def test_clear_empties_this_namespace_and_get_stats_reports_batches(
    store: str, store_config: Callable[[str], dict[str, Any]]
) -> None:
    extra = store_config(store)
    pools = make_pools("mha", "page_first")
    pools.fill(seed=12)
    backend = KvtierHiCacheStorage(harness.storage_config(pools, extra, metrics=True))
    other = KvtierHiCacheStorage(harness.storage_config(pools, extra, model="another-model"))
    backend.register_mem_pool_host(pools.host)
    other.register_mem_pool_host(pools.host)
    try:
        keys = page_hashes(tokens(3))
        assert backend.batch_set_v1(keys, torch.arange(3 * PAGE)) == [True] * 3
        assert other.batch_set_v1(keys, torch.arange(3 * PAGE)) == [True] * 3
        assert backend.batch_get_v1(keys, torch.arange(8 * PAGE, 11 * PAGE)) == [True] * 3
        stats = backend.get_stats()
        assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3] and len(stats.prefetch_bandwidth) == 1
        assert backend.get_stats().prefetch_pgs == []  # samples are handed over once
        assert backend.clear() is True
        assert backend.batch_exists(keys) == 0
        assert other.batch_exists(keys) == 3  # another model's pages stay
    finally:
        backend.close()
        other.close()


def test_a_mismatched_index_count_is_a_miss_not_an_exception(tmp_path: Path) -> None:
    pools = make_pools("mha", "page_first")
    backend = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path)}))
    backend.register_mem_pool_host(pools.host)
    try:
        keys = page_hashes(tokens(2))
        assert backend.batch_set_v1(keys, torch.arange(PAGE + 1)) == [False, False]
        assert backend.batch_get_v1(keys, torch.arange(3)) == [False, False]
        assert backend.batch_exists(keys) == 0
    finally:
        backend.close()


@needs_redis_server
def test_the_readme_command_parses_and_its_backend_round_trips(request: pytest.FixtureRequest) -> None:
    """The README's `sglang serve` line, through SGLang's own argument parser
    and backend factory (pointed at the test's redis-server instead of 6379)."""
    import argparse
    import json
    import re
    import shlex

    from sglang.srt.server_args import ServerArgs

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (block,) = re.findall(r"```bash\n(sglang serve .*?)```", readme, re.S)
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:2] == ["sglang", "serve"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv[2:])
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    server: LocalRedisServer = request.getfixturevalue("redis_server")
    extra["redis_url"] = server.url
    pools = make_pools("mha", args.hicache_mem_layout)
    pools.fill(seed=21)
    backend = StorageBackendFactory.create_backend("dynamic", harness.storage_config(pools, extra), pools.host)
    assert isinstance(backend, KvtierHiCacheStorage)
    backend.register_mem_pool_host(pools.host)
    try:
        keys = page_hashes(tokens(2, seed=21))
        assert backend.batch_set_v1(keys, torch.arange(2 * PAGE)) == [True, True]
        before = pages_of(pools, torch.arange(2 * PAGE))
        assert backend.batch_get_v1(keys, torch.arange(6 * PAGE, 8 * PAGE)) == [True, True]
        assert_same_pages(pages_of(pools, torch.arange(6 * PAGE, 8 * PAGE)), before)
        backend.clear()
    finally:
        backend.close()


# -- v2: sidecar pools (hybrid models) -----------------------------------------------------


def test_v2_sidecar_pages_round_trip_and_stay_apart_from_the_kv_pages(tmp_path: Path) -> None:
    kv, swa = make_pools("mha", "page_first"), make_pools("mha", "layer_first")
    kv.fill(seed=30)
    swa.fill(seed=31)
    backend = KvtierHiCacheStorage(harness.storage_config(kv, {**KVTIER, "store_path": str(tmp_path)}))
    backend.register_mem_pool_host(kv.host)
    backend.register_mem_host_pool_v2(swa.host, PoolName.SWA)
    try:
        keys = page_hashes(tokens(3, seed=30))
        src = torch.arange(3 * PAGE)
        assert backend.batch_set_v1(keys, src) == [True] * 3
        put = backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=src[PAGE:], keys=keys[1:])])
        assert put == {PoolName.SWA: [True, True]}
        before = pages_of(swa, src[PAGE:])
        dst = torch.arange(10 * PAGE, 12 * PAGE)
        got = backend.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=dst, keys=keys[1:])])
        assert got == {PoolName.SWA: [True, True]}
        assert_same_pages(pages_of(swa, dst), before[:2])
        # a KV page is not a sidecar page: same key, another pool's seal
        assert backend.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=dst[:PAGE], keys=keys[:1])]) == {
            PoolName.SWA: [False]
        }
        # an unregistered pool, or a wrong index count, is a miss
        assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=dst[:PAGE], keys=keys[:1])]) == {
            PoolName.MAMBA: [False]
        }
        assert backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=dst[:3], keys=keys[:1])]) == {
            PoolName.SWA: [False]
        }
    finally:
        backend.close()


@pytest.mark.parametrize("seed", range(6))
def test_v2_hit_policies_agree_with_sglangs_file_backend(tmp_path: Path, seed: int) -> None:
    """The same pages present (random gaps) in kvtier and in SGLang's own
    HiCacheFile: batch_exists_v2 gives the same usable prefix, per-pool hits
    and restorable lengths for ALL_PAGES and TRAILING_PAGES pools."""
    rng = random.Random(seed)
    kv, swa, idx = make_pools("mha", "page_first"), make_pools("mha", "page_first"), make_pools("mla", "page_first")
    for p in (kv, swa, idx):
        p.fill(seed=seed)
    ours = KvtierHiCacheStorage(harness.storage_config(kv, {**KVTIER, "store_path": str(tmp_path / "kvtier")}))
    theirs = HiCacheFile(harness.storage_config(kv, {"file_storage_path": str(tmp_path / "builtin")}))
    for b in (ours, theirs):
        b.register_mem_pool_host(kv.host)
        b.register_mem_host_pool_v2(kv.host, PoolName.KV)
        b.register_mem_host_pool_v2(swa.host, PoolName.SWA)
        b.register_mem_host_pool_v2(idx.host, PoolName.INDEXER)
    try:
        n = 8
        keys = page_hashes(tokens(n, seed=seed))
        kv_upto = rng.randint(0, n)
        ours.batch_set_v1(keys[:kv_upto], torch.arange(kv_upto * PAGE))
        theirs.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=torch.arange(kv_upto * PAGE), keys=keys[:kv_upto])])
        for name in (PoolName.SWA, PoolName.INDEXER):
            have = [i for i in range(n) if rng.random() < 0.7]
            for b in (ours, theirs):
                for i in have:
                    b.batch_set_v2([PoolTransfer(name=name, host_indices=torch.arange(i * PAGE, (i + 1) * PAGE), keys=[keys[i]])])
        transfers = [
            PoolTransfer(name=PoolName.INDEXER, hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer(name=PoolName.SWA, hit_policy=PoolHitPolicy.TRAILING_PAGES, keys=keys[:2]),
        ]
        a, b = ours.batch_exists_v2(keys, transfers), theirs.batch_exists_v2(keys, transfers)
        assert (a.kv_hit_pages, a.restorable_prefix_pages) == (b.kv_hit_pages, list(b.restorable_prefix_pages or []))
        assert {str(k): v for k, v in a.extra_pool_hit_pages.items()} == {str(k): v for k, v in b.extra_pool_hit_pages.items()}
    finally:
        ours.close()


def test_the_integrations_all_names_what_it_exports() -> None:
    """As tests/test_public_api.py checks the other public modules (it cannot import this one without SGLang)."""
    import types

    import kvtier.integrations.sglang as module

    assert all(hasattr(module, n) for n in module.__all__)
    public = {
        n for n, v in vars(module).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
        and (getattr(v, "__module__", "") or "").startswith("kvtier.integrations.sglang")
    }
    assert public <= set(module.__all__) and {"KvtierHiCacheStorage", "OPTIONS"} <= set(module.__all__)


def test_a_layout_without_page_copies_fails_the_attach_naming_it(tmp_path: Path) -> None:
    pools = make_pools("mha", "page_unified")
    backend = KvtierHiCacheStorage(harness.storage_config(pools, {**KVTIER, "store_path": str(tmp_path)}))
    with pytest.raises(ConfigurationError, match="layout 'page_unified' does not have"):
        backend.register_mem_pool_host(pools.host)
    assert backend.store is None


def test_the_torchvision_stand_in_only_imports() -> None:
    """Where the stand-in is in use, SGLang's imports of torchvision succeed and
    anything called from it raises, so no image code runs on it silently."""
    import torchvision

    if not str(getattr(torchvision, "__version__", "")).endswith("kvtier.stand.in"):
        pytest.skip("a real torchvision is installed")
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import pil_to_tensor

    assert "BICUBIC" in repr(InterpolationMode.BICUBIC)
    with pytest.raises(RuntimeError, match="import-only stand-in"):
        pil_to_tensor(None)
    with pytest.raises(RuntimeError, match="torchvision.io.decode_image was called"):
        __import__("torchvision.io", fromlist=["decode_image"]).decode_image(b"")
