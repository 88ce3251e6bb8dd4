"""Issue 30 point 7 for SGLang: over every field of a page's identity, two
engines that differ in that field alone never share a page, and engines equal
in every field do, byte for byte.

Each engine is SGLang's own device pool, its real host pool and its
`HiCacheStorageConfig`, with a `KvtierHiCacheStorage` attached as SGLang
attaches it; both engines of a pair name the same page keys (the worst case:
a key collision), over a FileStore and a real redis-server. The writer's
stored page is then copied in where the other engine looks for its own: the
page's header refuses it (a counted rejection), and the reader's host page is
left as it was.

Needs SGLang (see test_sglang_storage.py for how the venv is built)."""

from __future__ import annotations

import hashlib
import importlib.util
import random
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

_SGLANG = importlib.util.find_spec("sglang")
if _SGLANG is not None and _SGLANG.origin is not None and importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(Path(__file__).parent / "stand_ins"))
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed; `make test-sglang` builds .venv-sglang with sglang==0.5.23")

from harness import KVTIER, needs_redis_server, single_rank  # noqa: E402
from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402
from kvtier.testing.redis_server import LocalRedisServer  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

pytestmark = pytest.mark.sglang

N_PAGES = 3
FP8 = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


@dataclass(frozen=True)
class Engine:
    """What an SGLang engine's identity is made of; ``heads`` is the MHA head
    count, or for MLA the latent rank (with 8 rope dims a row of an MLA pool
    with ``heads=24`` is as many bytes as one of an MHA pool with 2 heads of 8)."""

    model: str = "tiny"
    kind: str = "mha"
    layout: str = "page_first"
    page: int = 4
    layers: int = 3
    heads: int = 2
    dtype: torch.dtype = torch.bfloat16
    tp: tuple[int, int] = (0, 1)
    pp: tuple[int, int] = (0, 1)
    cp: tuple[int, int] = (0, 1)
    dcp: tuple[int, int] = (0, 1)  # decode context parallel (MLA only): rank, size

    def row_nbytes(self) -> int:
        per_layer = 2 * self.heads * 8 if self.kind == "mha" else self.heads + 8
        return per_layer * self.layers * self.dtype.itemsize


MHA = Engine()
MLA = replace(MHA, kind="mla", heads=24)
assert MHA.row_nbytes() == MLA.row_nbytes()  # the pool class differs alone, not the bytes a page holds
TP2 = replace(MHA, tp=(0, 2))
E4M3 = replace(MHA, dtype=torch.float8_e4m3fn)
# Decode context parallel: each DCP rank of an MLA model holds every page's own token shard;
# SGLang's DCP groups are contiguous within TP, so TP ranks 0 and 2 of 4 are DCP rank 0 of 2.
DCP = replace(MLA, tp=(0, 4), dcp=(0, 2))

# (the field, engine A, engine B differing from A in that field alone)
APART = [
    ("model", MHA, replace(MHA, model="tiny-instruct")),
    ("pool class", MHA, MLA),
    ("layout", MHA, replace(MHA, layout="layer_first")),
    ("layout, MLA", MLA, replace(MLA, layout="page_first_direct")),
    ("page size", MHA, replace(MHA, page=8)),
    ("layers", MHA, replace(MHA, layers=4)),
    ("row shape", MHA, replace(MHA, heads=4)),
    ("dtype", MHA, replace(MHA, dtype=torch.float16)),
    ("fp8 format", E4M3, replace(E4M3, dtype=torch.float8_e5m2)),
    ("fp8 format, MLA", replace(MLA, dtype=torch.float8_e4m3fn), replace(MLA, dtype=torch.float8_e5m2)),
    ("fp8 against its uint8 bytes' twin", replace(MHA, dtype=torch.float16), replace(E4M3, heads=4)),
    ("tp rank (a sharded pool)", TP2, replace(TP2, tp=(1, 2))),
    ("tp world", TP2, replace(TP2, tp=(0, 4))),
    ("pp rank", replace(MHA, pp=(0, 2)), replace(MHA, pp=(1, 2))),
    ("pp world", replace(MHA, pp=(0, 2)), replace(MHA, pp=(0, 3))),
    ("cp rank", replace(MHA, cp=(0, 2)), replace(MHA, cp=(1, 2))),
    ("dcp rank", DCP, replace(DCP, tp=(1, 4), dcp=(1, 2))),
    ("dcp world", replace(MLA, tp=(0, 4)), DCP),
]
# Fields in a page's seal but not in its key: engines differing in one of them alone
# look their pages up under the same keys, and the seal refuses the other's.
# (The namespace keeps the fields keys had before page identities; the layer count
# is not among them, so an equal page size in bytes makes the keys coincide.)
SEALED_APART = [
    ("layers, pages of the same bytes", replace(MHA, layers=4, heads=2), replace(MHA, layers=2, heads=4)),
]
assert all(a.row_nbytes() == b.row_nbytes() for _, a, b in SEALED_APART)
# (what is the same, engine A, engine B with the same identity)
SHARED = [
    ("every field", MHA, MHA),
    ("every field, fp8 e5m2", replace(E4M3, dtype=torch.float8_e5m2), replace(E4M3, dtype=torch.float8_e5m2)),
    ("every field, TP rank 1 of 2", replace(TP2, tp=(1, 2)), replace(TP2, tp=(1, 2))),
    ("every field, PP and CP rank 1 of 2", replace(MHA, pp=(1, 2), cp=(1, 2)), replace(MHA, pp=(1, 2), cp=(1, 2))),
    ("an MLA cache across TP ranks (SGLang replicates it)", replace(MLA, tp=(0, 2)), replace(MLA, tp=(1, 2))),
    ("an MLA cache across the TP ranks of one DCP rank", DCP, replace(DCP, tp=(2, 4))),
]


def _pools(e: Engine) -> Any:
    """SGLang's CPU device pool and its real host pool (not pinned) for ``e``."""
    if e.kind == "mha":
        device = MHATokenToKVPool(64, e.page, e.dtype, e.heads, 8, e.layers, "cpu", False, start_layer=0, end_layer=e.layers)
        return MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 2.0, 0, e.page, e.layout, pin_memory=False, device="cpu",
            device_capacity_tokens=device.size, start_layer=0, end_layer=e.layers,
        )
    device = MLATokenToKVPool(64, e.page, e.dtype, e.heads, 8, e.layers, "cpu", False, start_layer=0, end_layer=e.layers)
    return MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, e.page, e.layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device.size, start_layer=0, end_layer=e.layers,
        target_layer_num=device.layer_num, override_kv_cache_dim=device.kv_cache_dim,
    )


def _fill(host: Any, seed: int) -> None:
    buf = host.kv_buffer.view(torch.uint8)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))


def _page(host: Any, start: int) -> torch.Tensor:
    return host.get_data_page(start, flat=True).contiguous().view(torch.uint8).clone()


@pytest.fixture(autouse=True)
def one_rank() -> Iterator[None]:
    with single_rank():
        yield


@pytest.fixture
def prefix() -> str:
    """The test's own Redis key prefix (the server is the module's)."""
    return f"t{random.getrandbits(32):08x}:"


@pytest.fixture
def engines(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> Iterator[Callable[[str, Engine], Any]]:
    """``make(store, e)``: a `KvtierHiCacheStorage` attached to ``e``'s host
    pool over the test's one FileStore directory or one Redis key prefix."""
    made: list[KvtierHiCacheStorage] = []

    def make(store: str, e: Engine) -> Any:
        if store == "file":
            extra: dict[str, Any] = {**KVTIER, "store": "file", "store_path": str(tmp_path / "store")}
        else:
            server: LocalRedisServer = request.getfixturevalue("redis_server")
            extra = {**KVTIER, "store": "redis", "redis_url": server.url, "prefix": prefix, "timeout_s": 2.0}
        if e.dtype in FP8:
            extra["kv_cache_dtype"] = FP8[e.dtype]  # SGLang's host pool holds either fp8 as uint8
        host = _pools(e)
        config = HiCacheStorageConfig(
            tp_rank=e.tp[0], tp_size=e.tp[1], pp_rank=e.pp[0], pp_size=e.pp[1], attn_cp_rank=e.cp[0],
            attn_cp_size=e.cp[1], is_mla_model=e.kind == "mla", enable_storage_metrics=False,
            is_page_first_layout=e.layout == "page_first", model_name=e.model, extra_config=extra,
            dcp_rank=e.dcp[0], dcp_size=e.dcp[1], logical_page_size=e.page * e.dcp[1],
        )
        backend = KvtierHiCacheStorage(config)
        made.append(backend)
        backend.register_mem_pool_host(host)
        return backend, host

    yield make
    for backend in made:
        backend.close()


KEYS = [hashlib.sha256(b"page %d" % i).hexdigest() for i in range(N_PAGES)]  # SGLang's keys are SHA-256 hex


def _write(make: Callable[[str, Engine], Any], store: str, e: Engine) -> tuple[Any, Any]:
    writer, host = make(store, e)
    _fill(host, seed=7)
    assert writer.batch_set_v1(KEYS, torch.arange(N_PAGES * e.page)) == [True] * N_PAGES
    return writer, host


def _copy_in(store: str, writer: Any, reader: Any, request: pytest.FixtureRequest) -> None:
    """Copy each of ``writer``'s stored pages to where ``reader`` looks for
    its own page of that key (a copy tool's mistake, or a forger's)."""
    pairs = [(writer.namespace.key(k).hex(), reader.namespace.key(k).hex()) for k in KEYS]
    if store == "file":
        root = Path(request.getfixturevalue("tmp_path")) / "store"
        for ka, kb in pairs:
            target = root / reader.namespace.label() / kb[:2]
            target.mkdir(parents=True, exist_ok=True)
            copied = list(root.rglob(f"{ka}.*"))
            assert {f.suffix for f in copied} == {".data"}  # FileStore: one file a page
            for f in copied:
                shutil.copy(f, target / f.name.replace(ka, kb))
        return
    import redis

    server: LocalRedisServer = request.getfixturevalue("redis_server")
    client = redis.Redis.from_url(server.url)
    try:
        for ka, kb in pairs:
            prefix = request.getfixturevalue("prefix")
            names = client.keys(f"{prefix}{writer.namespace.label()}:{{{ka}}}:*".encode())
            assert len(names) == 2, names  # the commit record and the page's one blob
            for name in names:
                new = name.replace(ka.encode(), kb.encode())
                new = new.replace(writer.namespace.label().encode(), reader.namespace.label().encode())
                client.set(new, client.get(name))
    finally:
        client.close()


@pytest.mark.parametrize("store", ["file", pytest.param("redis", marks=needs_redis_server)])
@pytest.mark.parametrize(("field", "a", "b"), APART, ids=[f for f, _, _ in APART])
def test_engines_differing_in_one_field_never_share_a_page(
    field: str, a: Engine, b: Engine, store: str, engines: Callable[[str, Engine], Any], request: pytest.FixtureRequest
) -> None:
    writer, _ = _write(engines, store, a)
    reader, host = engines(store, b)
    _fill(host, seed=8)
    dst = torch.arange(4 * b.page * N_PAGES, 5 * b.page * N_PAGES)  # host slots past what any engine wrote
    before = [_page(host, int(s)) for s in dst[:: b.page].tolist()]
    assert reader.batch_exists(KEYS) == 0
    assert reader.batch_get_v1(KEYS, dst) == [False] * N_PAGES
    # The writer's stored pages copied in under the reader's own keys: each
    # read, refused by its header (rule "identity"), and counted.
    _copy_in(store, writer, reader, request)
    assert reader.batch_get_v1(KEYS, dst) == [False] * N_PAGES
    assert reader.statistics().broken == {"identity": N_PAGES}, field
    for s, was in zip(dst[:: b.page].tolist(), before):
        assert torch.equal(_page(host, int(s)), was), field  # no byte of the writer's landed
    assert reader.identity.digest() != writer.identity.digest(), field


@pytest.mark.parametrize("store", ["file", pytest.param("redis", marks=needs_redis_server)])
@pytest.mark.parametrize(("same", "a", "b"), SHARED, ids=[s for s, _, _ in SHARED])
def test_engines_equal_in_every_field_share_every_page_byte_exact(
    same: str, a: Engine, b: Engine, store: str, engines: Callable[[str, Engine], Any]
) -> None:
    writer, src_host = _write(engines, store, a)
    reader, host = engines(store, b)
    _fill(host, seed=8)
    dst = torch.arange(4 * b.page * N_PAGES, 5 * b.page * N_PAGES)
    assert reader.batch_exists(KEYS) == N_PAGES
    assert reader.batch_get_v1(KEYS, dst) == [True] * N_PAGES
    for i in range(N_PAGES):
        assert torch.equal(_page(host, int(dst[i * b.page])), _page(src_host, i * a.page)), (same, i)
    assert reader.identity.digest() == writer.identity.digest() and reader.namespace == writer.namespace, same


@pytest.mark.parametrize("store", ["file", pytest.param("redis", marks=needs_redis_server)])
@pytest.mark.parametrize(("field", "a", "b"), SEALED_APART, ids=[f for f, _, _ in SEALED_APART])
def test_engines_differing_in_a_sealed_field_never_read_each_others_pages(
    field: str, a: Engine, b: Engine, store: str, engines: Callable[[str, Engine], Any]
) -> None:
    writer, _ = _write(engines, store, a)
    reader, host = engines(store, b)
    _fill(host, seed=8)
    dst = torch.arange(4 * b.page * N_PAGES, 5 * b.page * N_PAGES)
    before = [_page(host, int(s)) for s in dst[:: b.page].tolist()]
    assert reader.batch_get_v1(KEYS, dst) == [False] * N_PAGES
    # found under the same key and refused by its seal, or (keys apart) not found
    assert reader.statistics().broken in ({"identity": N_PAGES}, {}), field
    for s, was in zip(dst[:: b.page].tolist(), before):
        assert torch.equal(_page(host, int(s)), was), field  # no byte of the writer's landed
    assert reader.identity.digest() != writer.identity.digest(), field
