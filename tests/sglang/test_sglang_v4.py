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
            return {**base, "store": "file", "path": str(tmp_path / "kvtier")}
        server: LocalRedisServer = request.getfixturevalue("redis_server")
        return {**base, "store": "redis", "url": server.url, "prefix": prefix, "timeout_s": 5.0}

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
