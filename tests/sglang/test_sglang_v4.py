"""kvtier as the HiCache storage of SGLang's own DeepSeek V4 stack, on CPU.

SGLang's `DeepSeekV4TokenToKVPool`, `build_deepseek_v4_hicache_stack` (the
`LogicalHostPool` anchor, whose pages are 0 bytes, and every V4 sidecar host
pool it builds: SWA, C4, C4_INDEXER, C128, C4 state, C4 indexer state) and its
`HybridCacheController`, with kvtier attached through SGLang's dynamic backend
factory (tests/sglang/v4_harness.py says what is not SGLang's). Each case runs
the same operations against SGLang's own HiCacheFile and compares: every page
of every pool that kvtier hands back is the byte-exact page backed up, and
where a page in the store is damaged kvtier misses exactly there.
"""

from __future__ import annotations

import importlib.util
import os
import random
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

import v4_harness as v4  # noqa: E402
from harness import KVTIER, needs_redis_server  # noqa: E402
from kvtier.testing.redis_server import LocalRedisServer  # noqa: E402

pytestmark = pytest.mark.sglang

ALL_V4_POOLS = {"swa", "deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c4_state",
                "deepseek_v4_c4_indexer_state", "deepseek_v4_c128"}


@pytest.fixture
def stacks() -> Iterator[Callable[..., v4.V4Stack]]:
    """SGLang V4 stacks (storage threads running); all detached at teardown."""
    made: list[v4.V4Stack] = []

    def make(backend: str, extra: dict[str, Any] | None, **kw: Any) -> v4.V4Stack:
        stack = v4.build_v4_stack(backend, extra, **kw)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.close()


@pytest.fixture
def kvtier_config(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str, bool], dict[str, Any]]:
    prefix = f"t{random.getrandbits(32):08x}:"

    def make(store: str, v1: bool = True) -> dict[str, Any]:
        base = {**KVTIER, "interface_v1": int(v1)}
        if store == "file":
            return {**base, "store": "file", "store_path": str(tmp_path / "kvtier")}
        server: LocalRedisServer = request.getfixturevalue("redis_server")
        return {**base, "store": "redis", "redis_url": server.url, "prefix": prefix, "timeout_s": 5.0}

    return make


def file_config(tmp_path: Path) -> dict[str, Any]:
    return {"file_storage_path": str(tmp_path / "hicache-file"), "interface_v1": 1}


def assert_pages(got: v4.Fetched, backed: v4.Backed, n_kv: int) -> None:
    """Every pool's landed pages are the backed-up ones: the first ``n_kv``
    pages of each KV-derived pool, and the trailing window of the others."""
    assert set(got.pages) == set(backed.pages)
    for name, pages in got.pages.items():
        want = backed.pages[name]
        if len(want) == len(backed.keys):  # KV-derived: a page per prefix page
            want = want[:n_kv]
            pages = pages[:n_kv]
        for i, (a, b) in enumerate(zip(pages, want, strict=True)):
            assert torch.equal(a, b), f"pool {name!r} page {i} differs"


STORES = ["file", pytest.param("redis", marks=needs_redis_server)]


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("v1", [True, False], ids=["interface_v1", "legacy"])
def test_every_v4_pool_comes_back_byte_exact_like_hicache_file(
    stacks: Callable[..., v4.V4Stack], kvtier_config: Callable[..., dict[str, Any]], tmp_path: Path,
    store: str, v1: bool,
) -> None:
    writer = stacks("dynamic", kvtier_config(store, v1))
    assert set(writer.pools) == ALL_V4_POOLS
    backed = v4.fill_and_backup(writer, 3, seed=1)
    reader = stacks("dynamic", kvtier_config(store, v1))
    got = v4.prefetch(reader, backed.tokens)
    assert (got.found, got.landed) == (3, 3)
    assert_pages(got, backed, 3)

    # SGLang's own file backend, same operations, same answer.
    file_writer = stacks("file", file_config(tmp_path))
    file_backed = v4.fill_and_backup(file_writer, 3, seed=1)
    file_got = v4.prefetch(stacks("file", file_config(tmp_path)), file_backed.tokens)
    assert (file_got.found, file_got.landed) == (3, 3)
    assert_pages(file_got, file_backed, 3)


def test_the_hit_query_over_a_file_store_stats_each_page_and_opens_none(
    stacks: Callable[..., v4.V4Stack], kvtier_config: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's hit query knows each pool's page size: kvtier looks every page
    up by its size (a stat, as HiCacheFile's lookup is), never opening a page
    file; the read that follows checks every page. A page one byte short is
    not found."""
    writer = stacks("dynamic", kvtier_config("file"))
    backed = v4.fill_and_backup(writer, 3, seed=2)
    reader = stacks("dynamic", kvtier_config("file"))
    backend = reader.backend()
    opened: list[str] = []
    looking = [False]
    real_open, real_exists = os.open, backend.batch_exists_v2

    def exists_v2(*a: Any, **k: Any) -> Any:
        looking[0] = True
        try:
            return real_exists(*a, **k)
        finally:
            looking[0] = False

    monkeypatch.setattr(os, "open", lambda *a, **k: (looking[0] and opened.append(str(a[0]))) or real_open(*a, **k))
    monkeypatch.setattr(backend, "batch_exists_v2", exists_v2)
    got = v4.prefetch(reader, backed.tokens)
    assert (got.found, got.landed) == (3, 3)
    assert_pages(got, backed, 3)
    assert [p for p in opened if p.endswith(".data")] == []
    # A C4 page one byte short: the hit query stops the prefix at it, and a prefix
    # shorter than the whole has no SWA window stored, so nothing is restorable.
    path = v4.page_file(writer, str(Path(kvtier_config("file")["store_path"])), "deepseek_v4_c4", backed.keys[1])
    Path(path).write_bytes(Path(path).read_bytes()[:-1])
    assert v4.prefetch(stacks("dynamic", kvtier_config("file")), backed.tokens).found == 0
    assert_pages(got, backed, 3)


@pytest.mark.parametrize("v1", [True, False], ids=["interface_v1", "legacy"])
def test_get_stats_counts_every_v4_pools_pages_and_bytes(
    stacks: Callable[..., v4.V4Stack], kvtier_config: Callable[..., dict[str, Any]], v1: bool,
) -> None:
    """SGLang's storage metrics (``get_stats``) after its own V4 backup and
    prefetch: the pages of every pool SGLang moved, not only the anchor's, and
    a rate for each call that moved bytes (the anchor's pages hold none, so its
    calls give pages but no rate)."""
    writer, reader = stacks("dynamic", kvtier_config("file", v1)), stacks("dynamic", kvtier_config("file", v1))
    for stack in (writer, reader):
        stack.backend().storage_config.enable_storage_metrics = True
    backed = v4.fill_and_backup(writer, 3, seed=7)
    got = v4.prefetch(reader, backed.tokens)
    assert (got.found, got.landed) == (3, 3)
    moved = len(backed.keys) + sum(len(pages) for pages in backed.pages.values())  # the benchmark's count
    for kind, stats in (("backup", writer.backend().get_stats()), ("prefetch", reader.backend().get_stats())):
        pgs, rates = getattr(stats, f"{kind}_pgs"), getattr(stats, f"{kind}_bandwidth")
        assert sum(pgs) == moved, (kind, pgs)
        assert len(rates) == len(pgs) - 1 and all(r > 0 for r in rates), (kind, pgs, rates)  # the anchor's call: no rate


# -- damage: kvtier misses exactly there; HiCacheFile, for the record ---------------------------------

KV_DERIVED_POOLS = ["kv", "deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c128"]
TRAILING_POOLS = ["swa", "deepseek_v4_c4_state", "deepseek_v4_c4_indexer_state"]


def _damage(path: str, how: str, foreign: str | None = None) -> None:
    raw = bytearray(Path(path).read_bytes())
    if how == "flip":
        # One bit, same length, in the middle of the page's bytes (past the header of
        # kvtier's page file, docs/storage.md): only a checksum sees it.
        start = 12 + int.from_bytes(raw[8:12], "little") if raw[:8] == b"kvtpage1" else 0
        raw[start + (len(raw) - start) // 2] ^= 0x01
    elif how == "truncate":
        del raw[-1]
    else:  # "foreign": another model's page under this page's name
        assert foreign is not None
        raw = bytearray(Path(foreign).read_bytes())
    Path(path).write_bytes(raw)


def _damage_redis(url: str, blob_key: bytes, how: str, foreign: bytes | None = None) -> None:
    """`_damage` of a page's blob in kvtier's Redis store (through a client of the test's own)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        raw = bytearray(client.get(blob_key) or b"")
        assert raw, f"no blob under {blob_key!r}"
        if how == "flip":
            raw[len(raw) // 2] ^= 0x01  # past the seal's header: only the checksum sees it
        elif how == "truncate":
            del raw[-1]
        else:
            assert foreign is not None
            raw = bytearray(client.get(foreign) or b"")
        client.set(blob_key, bytes(raw))
    finally:
        client.close()


def _damaged_run(stacks: Callable[..., v4.V4Stack], backend: str, extra: dict[str, Any], root: Path | None,
                 pool: str, how: str) -> tuple[int, int, dict[str, list[str]]]:
    """Back up a 3-page prefix, damage ``pool``'s page (page 1 of a KV-derived
    pool, the window page of a trailing one) in the file store under ``root``
    or, without one, in kvtier's Redis store; prefetch it from a second stack:
    (pages found, KV pages landed, each pool's page verdicts)."""
    writer = stacks(backend, extra)
    backed = v4.fill_and_backup(writer, 3, seed=4)
    key = backed.keys[1] if pool in KV_DERIVED_POOLS else backed.keys[-1]
    other = None
    if how == "foreign":
        other = stacks(backend, extra, model="another-model")
        other_backed = v4.fill_and_backup(other, 3, seed=4, data_seed=40)  # same tokens and keys, other bytes
        assert other_backed.keys == backed.keys
    if root is None:
        _damage_redis(extra["redis_url"], v4.page_blob(writer, pool, key), how, other and v4.page_blob(other, pool, key))
    else:
        _damage(v4.page_file(writer, str(root), pool, key), how, other and v4.page_file(other, str(root), pool, key))
    got = v4.prefetch(stacks(backend, extra), backed.tokens)
    return got.found, got.landed, v4.verdicts(got, backed)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize(("pool", "how"), [
    *[(p, "flip") for p in KV_DERIVED_POOLS + TRAILING_POOLS],
    ("kv", "truncate"), ("deepseek_v4_c4", "truncate"), ("swa", "truncate"),
    ("deepseek_v4_c4", "foreign"), ("deepseek_v4_c4_state", "foreign"),
])
def test_a_damaged_v4_page_is_a_miss_exactly_there(
    stacks: Callable[..., v4.V4Stack], kvtier_config: Callable[..., dict[str, Any]], tmp_path: Path,
    store: str, pool: str, how: str,
) -> None:
    root = tmp_path / "kvtier" if store == "file" else None
    found, landed, pages = _damaged_run(stacks, "dynamic", kvtier_config(store), root, pool, how)
    assert "WRONG" not in str(pages), pages  # never a wrong byte, in any pool
    if how == "truncate":
        # The store does not hold the page whole, so the hit query already stops
        # the prefix there; a shorter prefix has no stored SWA window (only the
        # prefix's last page has one), so nothing is restorable and nothing is read.
        assert (found, landed, pages) == (0, 0, {})
    elif pool in KV_DERIVED_POOLS:
        # The prefix stops at the damaged page: page 0 whole in every KV-derived
        # pool, and SGLang never reads the window (it waits for the whole prefix).
        assert landed == 1, (found, landed, pages)
        for name in KV_DERIVED_POOLS[1:]:
            assert pages[name][0] == "exact", (name, pages)
        for name in TRAILING_POOLS:
            assert pages[name] == ["unread"], (name, pages)
    else:
        # The whole KV prefix lands; only the damaged window pool is absent.
        assert (found, landed) == (3, 3)
        for name, verdict in pages.items():
            assert verdict == (["unread"] if name == pool else ["exact"] * len(verdict)), (name, pages)


# What SGLang's own HiCacheFile does with the same damage, recorded (docs/sglang.md quotes it):
# a flipped bit or another model's page comes back as a hit with the wrong bytes, the whole prefix
# "landed"; a truncated page is a short read that raises inside HiCacheFile's get, which SGLang's
# transfer catches, dropping the whole batch: nothing lands. (damaged page's verdict, KV pages landed of 3)
HICACHE_FILE = {"flip": ("WRONG", 3), "foreign": ("WRONG", 3), "truncate": ("unread", 0)}


@pytest.mark.parametrize(("pool", "how"), [("deepseek_v4_c4", "flip"), ("swa", "flip"),
                                           ("deepseek_v4_c4", "truncate"), ("deepseek_v4_c4", "foreign")])
def test_hicache_file_with_the_same_damage(
    stacks: Callable[..., v4.V4Stack], tmp_path: Path, pool: str, how: str,
) -> None:
    root = tmp_path / "hicache-file"
    found, landed, pages = _damaged_run(stacks, "file", {"file_storage_path": str(root), "interface_v1": 1}, root,
                                        pool, how)
    damaged = pages[pool][1] if pool in KV_DERIVED_POOLS else pages[pool][0]
    assert found == 3 and (damaged, landed) == HICACHE_FILE[how], (found, landed, pages)


# -- geometry: page sizes, host layouts, TP ----------------------------------------------------------


@pytest.mark.parametrize("page_size", [128, 256])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_every_page_size_and_host_layout_round_trips_like_hicache_file(
    stacks: Callable[..., v4.V4Stack], tmp_path: Path, page_size: int, layout: str,
) -> None:
    for backend, extra in (("dynamic", {**KVTIER, "store_path": str(tmp_path / "kvtier")}), ("file", file_config(tmp_path))):
        writer = stacks(backend, extra, page_size=page_size, layout=layout)
        backed = v4.fill_and_backup(writer, 2, seed=page_size)
        got = v4.prefetch(stacks(backend, extra, page_size=page_size, layout=layout), backed.tokens)
        assert (got.found, got.landed) == (2, 2), backend
        assert_pages(got, backed, 2)


def test_tp_ranks_share_the_rank_replicated_v4_pages(stacks: Callable[..., v4.V4Stack], tmp_path: Path) -> None:
    """SGLang backs V4 pages up on TP rank 0 only (its backup skip for rank-replicated
    caches); rank 1 reads rank 0's pages of every pool, byte-exact, like HiCacheFile."""
    for backend, extra in (("dynamic", {**KVTIER, "store_path": str(tmp_path / "kvtier")}), ("file", file_config(tmp_path))):
        rank0 = stacks(backend, extra, tp_rank=0, tp_size=2)
        rank1 = stacks(backend, extra, tp_rank=1, tp_size=2)
        assert rank1.ctl.backup_skip and not rank0.ctl.backup_skip
        skipped = v4.fill_and_backup(rank1, 2, seed=7)  # rank 1 writes nothing...
        assert v4.prefetch(rank0, skipped.tokens).found == 0, backend
        backed = v4.fill_and_backup(rank0, 2, seed=8)  # ...rank 0 writes every pool
        got = v4.prefetch(rank1, backed.tokens)
        assert (got.found, got.landed) == (2, 2), backend
        assert_pages(got, backed, 2)


# -- V4 device layouts: equal page sizes, different rows ------------------------------------------------


def test_v41_and_v41_new_pages_are_never_read_as_each_other(
    stacks: Callable[..., v4.V4Stack], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's V41 (a page's data rows, then its scale rows) and V41_NEW (each
    token's scales after its data) store 528 bytes a token in pages of the same
    size in every pool but C128: kvtier keys them apart, so a V41_NEW reader finds none of
    a V41 writer's pages (HiCacheFile hands them over). The layout comes from
    SGLang's SGLANG_DSV4_KV_LAYOUT, which on a CPU (no SM100) SGLang itself
    cannot resolve, so ``dsv4_kv_layout`` says it."""
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")  # SGLang's own setting; on this CPU it cannot select it
    extra = {**KVTIER, "store_path": str(tmp_path / "kvtier")}
    writer = stacks("dynamic", {**extra, "dsv4_kv_layout": "v41"}, kv_layout=KVLayout.V41)
    same = stacks("dynamic", {**extra, "dsv4_kv_layout": "v41"}, kv_layout=KVLayout.V41)
    other = stacks("dynamic", {**extra, "dsv4_kv_layout": "v41_new"}, kv_layout=KVLayout.V41_NEW)
    sizes = [{n: p.get_dummy_flat_data_page().numel() for n, p in s.pools.items() if n != "deepseek_v4_c128"}
             for s in (writer, other)]
    assert sizes[0] == sizes[1]  # the same page sizes in every pool but C128 (2-token pages pad apart)
    backed = v4.fill_and_backup(writer, 2, seed=9)
    got = v4.prefetch(same, backed.tokens)
    assert (got.found, got.landed) == (2, 2)
    assert_pages(got, backed, 2)
    assert v4.prefetch(other, backed.tokens).found == 0
    # Not only through C128's size: each same-size paged pool's pages are keyed apart. (The compressor
    # states are SGLang's state dtype whatever the KV layout: those pages are shared.)
    for name in [n for n in sizes[0] if not n.endswith("_state")]:
        key = backed.keys[-1:]
        assert same.backend().store.exists(key, pool=same.backend()._pool(name).key_pool) == [True], name
        assert other.backend().store.exists(key, pool=other.backend()._pool(name).key_pool) == [False], name

    file_writer = stacks("file", file_config(tmp_path), kv_layout=KVLayout.V41)
    file_backed = v4.fill_and_backup(file_writer, 2, seed=9)
    file_got = v4.prefetch(stacks("file", file_config(tmp_path), kv_layout=KVLayout.V41_NEW), file_backed.tokens)
    assert file_got.found == 2  # HiCacheFile: the V41 rows, handed to a V41_NEW cache


def test_a_v4_pool_kvtier_cannot_key_is_refused_at_attach_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No silent never-hit: a V4.1 stack whose layout neither SGLang (here) nor the
    extra config can say, or a layout the pools do not have, fails the attach."""
    from kvtier.errors import ConfigurationError
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    extra = {**KVTIER, "store_path": str(tmp_path / "kvtier")}
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")
    with pytest.raises(ConfigurationError, match=r"DeepSeek V4 host pool 'swa'.*dsv4_kv_layout") as err:
        v4.build_v4_stack("dynamic", extra, kv_layout=KVLayout.V41)
    assert "cannot tell in this process (AssertionError: " in str(err.value) or \
        "cannot tell in this process (ValueError: " in str(err.value)  # SGLang's own reason, by its type
    monkeypatch.delenv("SGLANG_DSV4_KV_LAYOUT")  # SGLang now says v4...
    with pytest.raises(ConfigurationError, match=r"'dsv4_kv_layout'='v41' contradicts SGLang's own choice 'v4'"):
        v4.build_v4_stack("dynamic", {**extra, "dsv4_kv_layout": "v41"}, kv_layout=KVLayout.V41)
    with pytest.raises(ConfigurationError, match=r"host pool 'swa' holds 135168-byte rows.*not SGLang's 'v4' layout"):
        v4.build_v4_stack("dynamic", extra, kv_layout=KVLayout.V41)  # ...but the pools are V4.1
    with pytest.raises(ConfigurationError, match=r"'dsv4_kv_layout' must be one of \['v4', 'v41', 'v41_new'\]"):
        v4.build_v4_stack("dynamic", {**extra, "dsv4_kv_layout": "V4.1"})


def test_v41_pools_come_back_byte_exact_like_hicache_file(
    stacks: Callable[..., v4.V4Stack], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepSeek V4.1's own pools (the ratio-1 and ratio-2 latents and their
    indexers, SGLang's C1 / C2 pools) beside V4's, in SGLang's V41 layout."""
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")
    geometry = {"kv_layout": KVLayout.V41, "ratios": [4, 128, 0, 1, 2], "kv_source_layers": (3, 4)}
    for backend, extra in (("dynamic", {**KVTIER, "store_path": str(tmp_path / "kvtier"), "dsv4_kv_layout": "v41"}),
                           ("file", file_config(tmp_path))):
        writer = stacks(backend, extra, **geometry)
        assert set(writer.pools) == ALL_V4_POOLS | {"deepseek_v4_c1", "deepseek_v4_c1_indexer", "deepseek_v4_c2",
                                                    "deepseek_v4_c2_indexer"}
        backed = v4.fill_and_backup(writer, 2, seed=12)
        got = v4.prefetch(stacks(backend, extra, **geometry), backed.tokens)
        assert (got.found, got.landed) == (2, 2), backend
        assert_pages(got, backed, 2)


# -- benchmarks/sglang_v4.py ---------------------------------------------------------------------------


def test_the_v4_benchmark_runs_and_reports_both_backends(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/sglang_v4.py --quick``: both backends back up and prefetch
    on SGLang's V4 stack (every page checked byte-exact), rates and the ratio printed."""
    import importlib.util as iu

    spec = iu.spec_from_file_location("sglang_v4_bench", Path(__file__).parents[2] / "benchmarks" / "sglang_v4.py")
    assert spec is not None and spec.loader is not None
    bench = iu.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    assert bench.main(["--quick", "--page-size", "128"]) == 0
    assert torch.get_num_threads() == threads  # set to one for the run, then given back
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "torch threads 1;" in lines[0], out
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:4]}
    assert set(rows) == {"kvtier", "HiCacheFile"}, out
    for name in rows:  # backup pages/s, MB/s, CPU ms a prefix; the same for prefetch
        assert len(rows[name]) == 6 and all(float(v) > 0 for v in rows[name]), out
    ratio = lines[4].split()
    assert ratio[:3] == ["kvtier", "/", "file"] and all(float(v.rstrip("x")) > 0 for v in ratio[3:5]), out
    for line, what in zip(lines[5:7], ("backup", "prefetch")):  # one round: its ratio is the median
        by_round, median = line.split(": ")[1].split("; median ")
        assert line.startswith(f"kvtier / file, {what} by round") and float(by_round) == float(median.rstrip("x")) > 0, out


def test_sglangs_compressed_cache_option_is_part_of_a_v4_pages_row_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang pairs its V4 main cache with a compressed-cache layout of its own
    choosing (SGLANG_DSV4_COMPRESSED_KV_LAYOUT): the row format kvtier keys a V4
    pool's pages by names that option, so pages of one option are never read as
    another's."""
    from kvtier.integrations.sglang.storage import dsv4_kv_layout

    extra = {**KVTIER, "store_path": str(tmp_path / "kvtier")}
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    plain = v4.build_v4_stack("dynamic", extra)
    monkeypatch.setenv("SGLANG_DSV4_COMPRESSED_KV_LAYOUT", "fp8")
    fp8 = v4.build_v4_stack("dynamic", extra)
    try:
        swa = plain.pools["swa"]
        with plain.settings():
            assert dsv4_kv_layout(swa, "swa") == "v4+compressed=fp8"
            assert dsv4_kv_layout(swa, "swa", given="v4") == "v4+compressed=fp8"  # given agrees with SGLang's v4
            monkeypatch.setenv("SGLANG_DSV4_COMPRESSED_KV_LAYOUT", "auto")
            assert dsv4_kv_layout(swa, "swa") == "v4"
        keyed = [s.backend()._pool("swa").key_pool for s in (plain, fp8)]
        assert keyed[0].endswith("|dsv4_kv=v4") and keyed[1].endswith("|dsv4_kv=v4+compressed=fp8")
    finally:
        plain.close()
        fp8.close()


def test_a_swa_pool_whose_row_alignment_is_not_the_layouts_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The V4.1 layouts align rows to pages and V4 does not: a SWA pool of the right
    row size but the other alignment is not that layout either."""
    from types import SimpleNamespace

    from kvtier.errors import ConfigurationError
    from kvtier.integrations.sglang.storage import dsv4_kv_layout
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")  # SGLang cannot select it on this CPU: the given one decides
    want = KVLayout("v41").page_bytes(256)
    host = SimpleNamespace(slot_page_size=256, item_bytes=want, page_aligned_only=True)
    assert dsv4_kv_layout(host, "swa", given="v41") == "v41"
    host.page_aligned_only = False
    with pytest.raises(ConfigurationError) as err:
        dsv4_kv_layout(host, "swa", given="v41")
    assert str(err.value).startswith(f"KvtierHiCacheStorage: DeepSeek V4 host pool 'swa' holds {want}-byte rows "
                                     f"(page_aligned_only=False), not SGLang's 'v41' layout ({want}-byte rows)")
