"""Under trio: what refuses does so with the scheduler's error, what works works.

The scheduler and `RedisStore` (redis-py's client is asyncio's) raise
`ConfigurationError` naming trio and the fix; `FileStore` and the test kit's
`MemoryStore` run on any anyio backend and round-trip pages byte-exact.
(`MooncakeStore` runs its client in worker threads through anyio as
`FileStore` does; its own tests need the mooncake package.)
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from conftest import needs_redis_server

from kvtier import ConfigurationError, TransferScheduler
from kvtier.storage import FileStore, PageBlobs, StorageBackend
from kvtier.testing import MemoryStore, full_attention_group
from kvtier.testing.redis_server import LocalRedisServer

pytest.importorskip("trio")

PAGES = [PageBlobs(bytes([i]) * 32, {"kv": bytes(range(i, i + 64)), "c4": bytes([i]) * 16}) for i in range(3)]


def under_trio(fn):  # type: ignore[no-untyped-def]
    return anyio.run(fn, backend="trio")


def test_the_scheduler_refuses_trio_naming_it() -> None:
    async def main() -> None:
        async with TransferScheduler(full_attention_group(page_size=4)):
            pass  # pragma: no cover - never entered

    with pytest.raises(ConfigurationError, match="found trio: use anyio.run\\(..., backend='asyncio'\\)"):
        under_trio(main)


@needs_redis_server
def test_redis_store_refuses_trio_with_the_same_error_before_any_io(redis_server: LocalRedisServer) -> None:
    from kvtier.storage import RedisStore

    async def main(operation: str) -> None:
        async with RedisStore(redis_server.url, prefix="trio:") as rs:
            if operation == "exists":
                await rs.exists([b"k" * 32])
            elif operation == "get":
                await rs.get([b"k" * 32], ["kv"])
            else:
                await rs.put(PAGES)

    for operation in ("exists", "get", "put"):
        with pytest.raises(ConfigurationError, match="RedisStore runs on asyncio .*found trio: use anyio.run"):
            under_trio(lambda: main(operation))
    # Nothing was written: the same store under asyncio finds none of the pages.

    async def check() -> list[bool]:
        async with RedisStore(redis_server.url, prefix="trio:") as rs:
            return await rs.exists([p.key for p in PAGES])

    assert anyio.run(check) == [False, False, False]


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_file_and_memory_stores_work_under_trio_byte_exact(kind: str, tmp_path: Path) -> None:
    async def main() -> tuple[list[bool], list[dict[str, bytes] | None]]:
        store: StorageBackend = FileStore(tmp_path) if kind == "file" else MemoryStore()
        try:
            await store.put(PAGES[:2])
            return await store.exists([p.key for p in PAGES]), await store.get([p.key for p in PAGES], ["kv", "c4"])
        finally:
            await store.aclose()

    present, got = under_trio(main)
    assert present == [True, True, False]
    assert got == [PAGES[0].blobs, PAGES[1].blobs, None]
