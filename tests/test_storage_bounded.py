"""A bounded `FileStore` (``max_bytes``): eviction of the least recently read
pages, per shard of the key space, shared by several processes.

The bound holds across processes because each shard's ledger is a file they
all update under a lock; eviction unlinks a page's one file, so a reader
sees a page whole or misses it, and never removes a page still being written.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import structlog
from structlog.testing import capture_logs

from kvtier.errors import ConfigurationError
from kvtier.storage import FileStore, PageBlobs, StorageError, StoreUsage, encode_page, parse_size
from kvtier.storage.file_store import SHARDS, page_header


def content(key: bytes, nbytes: int) -> bytes:
    """The bytes every writer of ``key`` puts: a page is a content address."""
    return hashlib.shake_128(key).digest(nbytes)


def page(key: bytes, nbytes: int) -> PageBlobs:
    return PageBlobs(key, {"kv": content(key, nbytes)})


def disk_bytes(page: PageBlobs) -> int:
    """What a page takes in a bounded store: its file, header and blobs."""
    return page.nbytes + len(page_header(page))


def shard0_key(i: int) -> bytes:
    """Keys whose first hex digit is 0: all in one shard."""
    return bytes([0x01]) + i.to_bytes(4, "big") + bytes(27)


def on_disk(directory: Path) -> int:
    """Apparent bytes of every page file (and temporary file) under ``directory``."""
    total = 0
    for sub in os.scandir(directory):
        if sub.is_dir() and len(sub.name) == 2:
            for f in os.scandir(sub.path):
                try:
                    total += f.stat().st_size
                except FileNotFoundError:
                    pass  # evicted while we looked
    return total


@pytest.mark.parametrize(
    ("value", "nbytes"),
    [(4096, 4096), ("200GiB", 200 << 30), ("512MB", 512 * 10**6), ("1.5 KiB", 1536), ("64k", 65536), ("7B", 7)],
)
def test_sizes_are_bytes_or_human_strings(value: object, nbytes: int) -> None:
    assert parse_size(value) == nbytes


@pytest.mark.parametrize("value", [0, -5, 1.5, True, "", "0.1", "12 parsecs", "GiB", "2 GiBs", "inf", [1]])
def test_a_bad_bound_is_refused_naming_it(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigurationError, match=f"FileStore max_bytes must be a number of bytes >= 1 or a size "
                                                 f"such as '200GiB' or '512MB' .*; got {re.escape(repr(value))}"):
        FileStore(tmp_path, max_bytes=value)  # type: ignore[arg-type]


@pytest.fixture
def info_logs() -> Iterator[None]:
    """kvtier's info events reach structlog's capture whatever an earlier test configured."""
    config, logger = structlog.get_config(), logging.getLogger("kvtier")
    level = logger.level
    logger.setLevel(logging.INFO)  # the standard library's level governs kvtier's events
    try:
        yield
    finally:
        logger.setLevel(level)
        structlog.configure(**config)


async def test_a_put_past_the_bound_evicts_the_least_recently_read_pages(tmp_path: Path, info_logs: None) -> None:
    """Ten pages fill shard 0's bound. A page read since (k0) is kept; the
    oldest unread ones go, down to 90% of the shard's bound, so one count of
    the shard pays for several puts. Usage and the eviction counter say so."""
    size = disk_bytes(page(shard0_key(0), 1000))
    async with FileStore(tmp_path, max_bytes=16 * 10 * size) as fs:
        pages = [page(shard0_key(i), 1000) for i in range(10)]
        with capture_logs() as logs:
            await fs.put(pages)  # under the bound: nothing evicted, nothing logged
        assert logs == []
        assert fs.usage() == StoreUsage(10 * size, 16 * 10 * size, 0, 0)
        now = time.time()

        def age() -> None:  # written one minute apart, k0 the oldest
            for i, p in enumerate(pages):
                os.utime(tmp_path / p.key.hex()[:2] / f"{p.key.hex()}.data", (now - 600 + 60 * i,) * 2)

        await anyio.to_thread.run_sync(age)
        assert (await fs.get([pages[0].key], ["kv"]))[0] == {"kv": pages[0].blobs["kv"]}  # k0: now the newest
        with capture_logs() as logs:
            await fs.put([page(shard0_key(10), 1000)])
        assert logs == [{"event": "file_store.evicted", "log_level": "info", "directory": str(tmp_path), "shard": "0",
                         "pages": 2, "bytes": 2 * size, "shard_bytes": 8 * size, "shard_bound": 10 * size}]
        kept = await fs.exists([p.key for p in pages] + [shard0_key(10)])
        # 11 pages' worth would pass the bound: evict down to 9 (90%) with the new one, so k1, k2 go.
        assert kept == [True, False, False] + [True] * 8
        usage = fs.usage()
        assert usage == StoreUsage(9 * size, 16 * 10 * size, 2, 2 * size), usage
        assert await anyio.to_thread.run_sync(on_disk, tmp_path) == 9 * size
        # The next put fits under the bound: no count, no eviction.
        await fs.put([page(shard0_key(11), 1000)])
        assert fs.usage() == StoreUsage(10 * size, 16 * 10 * size, 2, 2 * size)
        # Another shard has a bound of its own.
        other = page(bytes([0xF0]) + bytes(31), 1000)
        await fs.put([other])
        assert fs.usage() == StoreUsage(11 * size, 16 * 10 * size, 2, 2 * size)


async def test_a_page_over_a_shards_bound_is_refused_naming_both(tmp_path: Path) -> None:
    async with FileStore(tmp_path, max_bytes="64KiB") as fs:
        small, big = page(shard0_key(0), 100), page(shard0_key(1), 4096)
        with pytest.raises(StorageError, match=rf"page {big.key.hex()} is {disk_bytes(big)} bytes on disk .*; a "
                                               r"FileStore of max_bytes=65536 keeps pages up to a sixteenth of that "
                                               r"\(4096 bytes\): nothing of the batch was written") as err:
            await fs.put([small, big])
        assert err.value.operation == "put"
        assert await fs.exists([small.key, big.key]) == [False, False]


async def test_eviction_never_removes_a_page_still_being_written(tmp_path: Path) -> None:
    """A writer has written page A's temporary file and not yet renamed it
    into place when another process's put fills the shard: the temporary
    file stays (not a page yet), and A is whole once renamed."""
    size = disk_bytes(page(shard0_key(0), 1000))
    bound = 16 * 4 * size  # 4 pages per shard
    a = page(shard0_key(100), 1000)
    other = FileStore(tmp_path, max_bytes=bound)
    evicted: list[int] = []

    def meanwhile(key: bytes) -> None:
        if key == a.key:  # A's temporary file is written, not yet renamed into place
            anyio.from_thread.run(other.put, [page(shard0_key(i), 1000) for i in range(6)])
            evicted.append(other.evicted_pages)

    async with FileStore(tmp_path, max_bytes=bound, before_commit=meanwhile) as fs:
        await fs.put([a])
        assert evicted and evicted[0] >= 2  # the other writer did evict from this shard
        assert await fs.get([a.key], ["kv"]) == [{"kv": a.blobs["kv"]}]
    await other.aclose()


# -- several processes sharing one directory ------------------------------------------

PROCESSES, PAGES, PAGE_BYTES = 3, 160, 6000
BOUND = 16 * 8 * (PAGE_BYTES + 64)  # ~0.75 MiB: ~128 pages, against 480 written


def _key(proc: int, i: int) -> bytes:
    return hashlib.blake2b(f"{proc}/{i}".encode(), digest_size=32).digest()


def _writer(directory: str, proc: int, seed: int) -> tuple[int, int, int, int]:
    """(In a child process) put PAGES pages, each followed by a read of a few
    pages any process may have put; count reads that were whole, missed, or
    other bytes (torn). Also returns this process's evictions."""

    async def main() -> tuple[int, int, int, int]:
        rng = random.Random(seed)
        whole = missed = wrong = 0
        async with FileStore(directory, max_bytes=BOUND) as fs:
            for i in range(PAGES):
                await fs.put([page(_key(proc, i), PAGE_BYTES)])
                keys = [_key(rng.randrange(PROCESSES), rng.randrange(i + 1)) for _ in range(3)]
                for key, got in zip(keys, await fs.get(keys, ["kv"])):
                    if got is None:
                        missed += 1
                    elif got["kv"] == content(key, PAGE_BYTES):
                        whole += 1
                    else:
                        wrong += 1
            return whole, missed, wrong, fs.evicted_pages

    return anyio.run(main)


def test_several_processes_share_a_bound_and_never_read_a_torn_page(tmp_path: Path) -> None:
    """Three processes each write 160 pages (together ~3.75x the bound) into
    one bounded directory while reading each other's pages. On disk stays
    within the bound but for the pages in flight when a shard was counted
    (at most one per other process per shard); every read is byte-exact or a
    miss; they all evicted."""
    ctx = multiprocessing.get_context("fork")  # the children only do file I/O: no torch, no threads of the parent's
    with ctx.Pool(PROCESSES) as pool:
        running = [pool.apply_async(_writer, (str(tmp_path), p, p)) for p in range(PROCESSES)]
        peak = 0
        while not all(r.ready() for r in running):
            if tmp_path.is_dir():
                peak = max(peak, on_disk(tmp_path))
            time.sleep(0.01)
        results = [r.get(timeout=120) for r in running]
    slack = SHARDS * (PROCESSES - 1) * (PAGE_BYTES + 64)
    final = on_disk(tmp_path)
    assert final <= BOUND + slack and peak <= BOUND + slack, (final, peak, BOUND)
    assert final >= BOUND // 2, (final, BOUND)  # eviction frees down to 90% of a shard, not everything
    assert sum(r[2] for r in results) == 0, results  # never other bytes
    assert all(r[0] > 0 and r[1] > 0 and r[3] > 0 for r in results), results
    print(f"bound {BOUND}, peak on disk {peak} ({peak / BOUND:.3f}x), final {final} ({final / BOUND:.3f}x); "
          f"reads whole/missed/wrong, evictions per process: {results}")


async def test_a_bounded_store_round_trips_kvtier_pages(tmp_path: Path) -> None:
    """Encoded host pages, as the scheduler writes them, through a bounded store."""
    from kvtier.testing import hybrid_group

    group = hybrid_group(seed=3)
    key = bytes([0x2A]) * 32
    blobs = encode_page(group, "kv", 1, key=key)
    async with FileStore(tmp_path, max_bytes="1MiB") as fs:
        await fs.put([PageBlobs(key, blobs)])
        assert await fs.get([key], list(blobs)) == [{n: bytes(b) for n, b in blobs.items()}]
        stored = PageBlobs(key, blobs)
        assert fs.usage() == StoreUsage(disk_bytes(stored), 1 << 20, 0, 0)
        assert await fs.clear() == 1  # the ledgers go back to nothing, and are counted again at the next put
        assert fs.usage() == StoreUsage(0, 1 << 20, 0, 0)
        await fs.put([stored])
        assert fs.usage() == StoreUsage(disk_bytes(stored), 1 << 20, 0, 0)
