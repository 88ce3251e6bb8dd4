"""`FileStore`'s one-file layout: a page file cut short anywhere is a miss, a
writer's leftover temporary file is never read and is cleaned, an earlier
layout's files read as misses, and two processes rewriting one page never
give a reader a torn one."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import anyio
import pytest

from kvtier.storage import FileStore, PageBlobs, StorageError
from kvtier.storage.file_store import page_header

KEY = bytes([0x3C]) + bytes(range(1, 32))
PAGE = PageBlobs(KEY, {"c4": bytes(range(256)) * 3, "kv": bytes(range(255, -1, -1)) * 8})


def page_file(directory: Path, key: bytes = KEY) -> Path:
    return directory / key.hex()[:2] / f"{key.hex()}.data"


def temp_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/.*.tmp"))


# A page file shorter than the store's first read (4096 bytes: read whole at once, its
# size known without an fstat) and one longer (its size from fstat, its blobs read apart).
LARGE_PAGE = PageBlobs(KEY, {"c4": bytes(range(256)) * 3, "kv": bytes(range(255, -1, -1)) * 64})


@pytest.mark.allow_blocking  # the test writes and damages files on the loop; kvtier does not block
@pytest.mark.parametrize("page", [PAGE, LARGE_PAGE], ids=["within-first-read", "past-first-read"])
async def test_a_page_file_cut_short_anywhere_is_a_miss_and_a_put_repairs_it(tmp_path: Path, page: PageBlobs) -> None:
    """Cut at every boundary of the header (magic, length, record) and of the
    blobs, and one byte either side of each: exists is False and get None for
    every pool; a byte too many is a miss too. A put makes the page whole."""
    PAGE = page  # noqa: N806 - the test reads as before for either size
    assert (len(page_header(PAGE)) + PAGE.nbytes < 4096) == (page is not LARGE_PAGE)
    header = page_header(PAGE)
    c4, kv = len(PAGE.blobs["c4"]), len(PAGE.blobs["kv"])
    whole = header + PAGE.blobs["c4"] + PAGE.blobs["kv"]
    boundaries = [0, 8, 12, len(header), len(header) + c4, len(whole)]
    cuts = sorted({b + d for b in boundaries for d in (-1, 0, 1) if 0 <= b + d < len(whole)})
    async with FileStore(tmp_path, io_thread=False) as fs:
        await fs.put([PAGE])
        path = page_file(tmp_path)
        assert path.read_bytes() == whole  # the layout docs/storage.md describes
        assert len(header) == 12 + int.from_bytes(header[8:12], "little") and header[:8] == b"kvtpage1"
        for damaged in [whole[:cut] for cut in cuts] + [whole + b"\0"]:
            path.write_bytes(damaged)
            assert await fs.exists([KEY]) == [False], len(damaged)
            assert await fs.get([KEY], ["c4", "kv"]) == [None], len(damaged)
            assert await fs.get([KEY], ["c4"]) == [None], len(damaged)
        await fs.put([PAGE])
        assert await fs.get([KEY], ["kv", "c4"]) == [{"kv": PAGE.blobs["kv"], "c4": PAGE.blobs["c4"]}]
        assert c4 and kv and temp_files(tmp_path) == []


@pytest.mark.allow_blocking  # the test writes and damages files on the loop; kvtier does not block
async def test_a_crashed_writers_temporary_file_is_never_read_and_is_cleaned(tmp_path: Path) -> None:
    """A writer that dies before its rename (``before_commit`` raising stands
    for it) leaves a whole temporary file: the page is a miss. A bounded
    store's count leaves a young one alone (a put may be in flight) and
    removes one ten minutes old; ``clear`` removes any."""

    def die(key: bytes) -> None:
        raise RuntimeError("injected: the writer died before its rename")

    async with FileStore(tmp_path, before_commit=die) as crashed:
        with pytest.raises(StorageError, match="stopped before the commit of page"):
            await crashed.put([PAGE])
    [tmp] = temp_files(tmp_path)
    assert tmp.read_bytes() == page_header(PAGE) + PAGE.blobs["c4"] + PAGE.blobs["kv"]
    async with FileStore(tmp_path) as reader:
        assert await reader.exists([KEY]) == [False]
        assert await reader.get([KEY], ["c4", "kv"]) == [None]
    other = PageBlobs(bytes([0x3D]) + bytes(31), {"kv": b"x" * 100})  # the same shard (first hex digit 3)
    async with FileStore(tmp_path, max_bytes="1MiB") as bounded:  # a fresh ledger: its first put counts the shard
        await bounded.put([other])
        assert temp_files(tmp_path) == [tmp]  # young: left alone
    old = time.time() - 601
    os.utime(tmp, (old, old))
    for ledger in tmp_path.glob(".kvtier-usage-*"):
        ledger.unlink()  # so the next put counts the shard again
    another = PageBlobs(bytes([0x3E]) + bytes(31), {"kv": b"y" * 100})
    async with FileStore(tmp_path, max_bytes="1MiB") as bounded:
        await bounded.put([another])
        assert temp_files(tmp_path) == []
        usage = bounded.usage()
        assert usage is not None and usage.used_bytes == 2 * (100 + len(page_header(other)))  # other, another
    async with FileStore(tmp_path, before_commit=die) as crashed:
        with pytest.raises(StorageError):
            await crashed.put([PAGE])
    async with FileStore(tmp_path) as fs:
        assert len(temp_files(tmp_path)) == 1
        assert await fs.clear() == 2  # the page files (other, another); the stray goes too
        assert temp_files(tmp_path) == [] and list(tmp_path.glob("*/*")) == []


@pytest.mark.allow_blocking  # the test writes and damages files on the loop; kvtier does not block
async def test_an_earlier_layouts_page_is_a_miss_rewritten_and_its_record_cleaned(tmp_path: Path) -> None:
    """The two-file layout (bare blobs in ``.data``, a ``.commit`` record beside
    it) reads as a miss; a put replaces the data file; a bounded store's count
    removes the old record, and ``clear`` any."""
    data, commit = page_file(tmp_path), page_file(tmp_path).with_suffix(".commit")
    data.parent.mkdir()
    data.write_bytes(PAGE.blobs["c4"] + PAGE.blobs["kv"])
    commit.write_bytes(b'{"v":2,"blobs":{"c4":768,"kv":2048}}')
    async with FileStore(tmp_path, max_bytes="1MiB") as fs:
        assert await fs.exists([KEY]) == [False]
        assert await fs.get([KEY], ["kv"]) == [None]
        await fs.put([PAGE])  # a fresh ledger: the put counts the shard, which removes the old record
        assert not commit.exists()
        assert await fs.get([KEY], ["kv", "c4"]) == [{"kv": PAGE.blobs["kv"], "c4": PAGE.blobs["c4"]}]
        usage = fs.usage()
        # The count found the old data file, which the put then replaced: a ledger runs over, never
        # under, until the shard's next count.
        assert usage is not None and usage.used_bytes == PAGE.nbytes + (PAGE.nbytes + len(page_header(PAGE)))
    commit.write_bytes(b"{}")
    async with FileStore(tmp_path) as fs:
        assert await fs.clear() == 1
    assert not commit.exists() and not data.exists()


# -- two processes rewriting one page ---------------------------------------------------

VERSIONS = {w: PageBlobs(KEY, {"c4": bytes([w]) * (3000 + 1000 * w), "kv": bytes([w + 10]) * (40000 + 9000 * w)})
            for w in (1, 2)}  # two versions of one page, of different lengths: a mix of them is a torn read
WRITES = 150


def _rewrite(directory: str, writer: int, max_bytes: str | None) -> None:
    async def main() -> None:
        async with FileStore(directory, max_bytes=max_bytes, io_thread=False) as fs:
            for _ in range(WRITES):
                await fs.put([VERSIONS[writer]])

    anyio.run(main)


@pytest.mark.parametrize("max_bytes", [None, "64MiB"])
def test_two_processes_rewriting_one_page_never_give_a_torn_read(tmp_path: Path, max_bytes: str | None) -> None:
    """Two writer processes put two different versions of one key over and
    over while this process reads it: every read is one version whole, byte
    for byte, and the page is never missing once written."""
    ctx = multiprocessing.get_context("fork")  # the children only do file I/O
    writers = [ctx.Process(target=_rewrite, args=(str(tmp_path), w, max_bytes)) for w in (1, 2)]

    async def read_while_written() -> dict[int, int]:
        seen = {1: 0, 2: 0}
        async with FileStore(tmp_path, max_bytes=max_bytes, io_thread=False) as fs:
            while any(w.is_alive() for w in writers) or not sum(seen.values()):
                [got] = await fs.get([KEY], ["c4", "kv"])
                if got is None:
                    assert not sum(seen.values()), "a page read before went missing"
                    continue
                version = [w for w, p in VERSIONS.items() if got == dict(p.blobs)]
                assert version, ({n: len(b) for n, b in got.items()}, {n: b[:1] for n, b in got.items()})
                seen[version[0]] += 1
        return seen

    for w in writers:
        w.start()
    try:
        seen = anyio.run(read_while_written)
    finally:
        for w in writers:
            w.join(60)
    assert [w.exitcode for w in writers] == [0, 0]
    assert sum(seen.values()) > 0, seen
    assert temp_files(tmp_path) == []
