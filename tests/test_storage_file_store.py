"""`FileStore`'s own contract, beyond what every backend shares (test_storage_backends.py):
what its errors name, its files' modes and stamps, writes the kernel cuts short, a
bounded store's ledgers as another process reads them, and what a count or a clear
leaves alone. Written against the survivors of the mutation run (docs/testing.md):
each test pins a behaviour a user or an operator meets, not a line.

Sync tests on purpose: they look at the files themselves, which an async test may
not do on its event loop (tests/conftest.py); the async API runs under `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier.storage.file_store as fs_module
from kvtier.errors import ConfigurationError
from kvtier.storage import FileStore, PageBlobs, StorageError
from kvtier.storage.file_store import SHARDS, page_header, parse_size


def key_in_shard(shard: int, second: int | None = None) -> bytes:
    """A random 32-byte key whose hex starts with ``shard``'s digit (and ``second``'s, if given)."""
    first = shard << 4 | (secrets.randbelow(16) if second is None else second)
    return bytes([first]) + secrets.token_bytes(31)


def a_page(key: bytes | None = None, nbytes: int = 100) -> PageBlobs:
    return PageBlobs(key or secrets.token_bytes(32), {"kv": secrets.token_bytes(nbytes)})


def file_of(store: FileStore, key: bytes) -> Path:
    h = key.hex()
    return store.directory / h[:2] / f"{h}.data"


def on_disk(page: PageBlobs) -> int:
    """A page file's size: its header and its blobs."""
    return len(page_header(page)) + page.nbytes


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


# -- what its errors name --------------------------------------------------------------


def test_a_directory_that_is_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("not a store")
    with pytest.raises(ConfigurationError) as e:
        FileStore(f)
    assert str(e.value) == (f"FileStore directory {str(f)!r} is a file, not a directory; give a directory, "
                            "or a path to create one at")
    below = f / "a" / "b"  # neither there yet: the nearest existing parent is the file
    with pytest.raises(ConfigurationError) as e:
        FileStore(below)
    assert str(e.value) == (f"FileStore directory {str(below)!r} cannot be created: {str(f)!r} is a file, not a "
                            "directory; give a directory, or a path to create one at")


def test_every_operation_that_fails_on_the_disk_says_which_store_and_what_it_was_doing(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    page = a_page()
    store.put_blocking([page])
    path = file_of(store, page.key)
    path.unlink()
    path.mkdir()  # a directory where the page file goes: opened, its read fails (EISDIR)
    (path / "x").write_bytes(b"")  # and not empty: nothing renames over it or unlinks it
    where = repr(str(store.directory))
    for operation, call in [
        ("exists", lambda: asyncio.run(store.exists([page.key]))),
        ("get", lambda: asyncio.run(store.get([page.key], ["kv"]))),
        ("put", lambda: asyncio.run(store.put([page]))),
        ("clear", lambda: asyncio.run(store.clear())),
        ("exists", lambda: store.exists_blocking([page.key])),
        ("get", lambda: store.get_blocking([page.key], ["kv"])),
        ("put", lambda: store.put_blocking([page])),
    ]:
        with pytest.raises(StorageError) as e:
            call()
        doing = fs_module._DOING[operation]
        assert str(e.value).startswith(f"file store {where} could not {doing}: "), (operation, str(e.value))
        assert (e.value.backend, e.value.operation) == ("file", operation), operation
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # the failed puts left no temporary file


def test_a_store_without_a_worker_thread_names_the_operation_too(tmp_path: Path) -> None:
    store = FileStore(tmp_path, io_thread=False)
    page = a_page()
    store.put_blocking([page])
    file_of(store, page.key).unlink()
    file_of(store, page.key).mkdir()
    with pytest.raises(StorageError) as e:
        asyncio.run(store.get([page.key], ["kv"]))
    assert (e.value.backend, e.value.operation) == ("file", "get")
    assert "could not read pages" in str(e.value)


def test_a_closed_store_refuses_every_call_naming_it(tmp_path: Path) -> None:
    store = FileStore(tmp_path)

    async def enter() -> None:
        async with store:
            pass

    asyncio.run(store.aclose())
    for operation, call in [
        ("open", lambda: asyncio.run(enter())),
        ("exists", lambda: asyncio.run(store.exists([b"k"]))),
        ("get", lambda: asyncio.run(store.get([b"k"], ["kv"]))),
        ("put", lambda: asyncio.run(store.put([a_page()]))),
        ("clear", lambda: asyncio.run(store.clear())),
        ("exists", lambda: store.exists_blocking([b"k"])),
        ("get", lambda: store.get_blocking([b"k"], ["kv"])),
        ("put", lambda: store.put_blocking([a_page()])),
        ("exists", lambda: store.exists_sized_blocking([b"k"], {"kv": 1})),
    ]:
        with pytest.raises(StorageError) as e:
            call()
        assert (str(e.value), e.value.backend, e.value.operation) == ("file store is closed", "file", operation)


def test_a_lookup_by_size_that_fails_on_the_disk_names_the_store_and_the_lookup(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    page = a_page()
    store.put_blocking([page])
    path = file_of(store, page.key)
    path.unlink()
    path.symlink_to(path.name)  # a link to itself: its stat fails (ELOOP), neither a page nor a miss
    with pytest.raises(StorageError) as e:
        store.exists_sized_blocking([page.key], {"kv": 1})
    doing = fs_module._DOING["exists"]
    assert str(e.value).startswith(f"file store {str(store.directory)!r} could not {doing}: ")
    assert (e.value.backend, e.value.operation) == ("file", "exists")


def test_a_put_begun_before_the_close_never_opens_the_ledgers_again(tmp_path: Path) -> None:
    """aclose may land while a blocking put is between its checks: the put then fails
    naming the closed store, and no ledger descriptor is left open."""
    store: FileStore

    def close_meanwhile(key: bytes) -> None:
        store._closed = True  # as aclose does, after the call's own check

    store = FileStore(tmp_path, max_bytes="1MiB", before_commit=close_meanwhile)
    with pytest.raises(StorageError) as e:
        store.put_blocking([a_page()])
    assert (str(e.value), e.value.backend, e.value.operation) == ("file store is closed", "file", "ledger")
    assert store._ledgers == []


def test_the_hook_that_stops_a_put_is_named_and_its_page_stays_invisible(tmp_path: Path) -> None:
    def die(key: bytes) -> None:
        raise RuntimeError("writer died")

    store = FileStore(tmp_path, before_commit=die)
    page = a_page()
    with pytest.raises(StorageError) as e:
        store.put_blocking([page])
    assert (e.value.backend, e.value.operation) == ("file", "put")
    assert str(e.value) == f"file store put stopped before the commit of page {page.key.hex()}: writer died"
    assert FileStore(tmp_path).exists_blocking([page.key]) == [False]


def test_a_page_over_a_sixteenth_of_the_bound_is_refused_and_one_of_exactly_that_is_kept(tmp_path: Path) -> None:
    page = a_page(nbytes=300)
    bound = on_disk(page)
    store = FileStore(tmp_path, max_bytes=bound * SHARDS)
    store.put_blocking([page])  # exactly a sixteenth: kept
    assert store.get_blocking([page.key], ["kv"]) == [page.blobs]
    big = a_page(nbytes=301)
    with pytest.raises(StorageError) as e:
        store.put_blocking([big])
    assert (e.value.backend, e.value.operation) == ("file", "put")
    assert f"{bound + 1} bytes on disk" in str(e.value) and f"({bound} bytes)" in str(e.value)


def test_repr_names_the_directory_fsync_and_a_bound(tmp_path: Path) -> None:
    assert repr(FileStore(tmp_path)) == f"<FileStore {str(tmp_path)!r} [fsync=False]>"
    assert FileStore(tmp_path).fsync is False  # the default: no fsync
    bounded = FileStore(tmp_path / "b", max_bytes=16_000, fsync=True)
    page = a_page()
    bounded.put_blocking([page])
    assert repr(bounded) == f"<FileStore {str(tmp_path / 'b')!r} [fsync=True, {on_disk(page)}/16000 bytes]>"


# -- parse_size -------------------------------------------------------------------------------


def test_parse_size_keeps_whole_numbers_exact_and_takes_one_byte() -> None:
    assert parse_size(1) == parse_size("1") == parse_size("1B") == 1
    exact = parse_size("9007199254740993")  # 2**53 + 1: a float would round it
    assert exact == 9007199254740993 and type(exact) is int
    assert parse_size("3GiB") == 3 << 30 and type(parse_size("3GiB")) is int
    assert parse_size("1.5KiB") == 1536
    with pytest.raises(ConfigurationError, match=r"^size must be a number of bytes >= 1 .*got '0.5'"):
        parse_size("0.5")
    with pytest.raises(ConfigurationError, match=r"^FileStore max_bytes must be .*got 'lots'"):
        FileStore("/tmp/unused-kvtier", max_bytes="lots")


# -- the files themselves ---------------------------------------------------------------------


def test_page_files_and_ledgers_take_the_usual_modes(tmp_path: Path, umask_022: None) -> None:
    store = FileStore(tmp_path, max_bytes="1MiB")
    pages = [a_page(key_in_shard(2, 0)), a_page(key_in_shard(2, 0))]  # the second into a directory made
    store.put_blocking(pages)
    assert {file_of(store, p.key).stat().st_mode & 0o777 for p in pages} == {0o644}  # 0o666 less the umask
    ledgers = sorted(tmp_path.glob(".kvtier-usage-*"))
    assert len(ledgers) == SHARDS and {p.stat().st_mode & 0o777 for p in ledgers} == {0o644}


def test_a_write_the_kernel_cuts_short_is_finished_and_the_page_lands_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.writev

    def at_most_7_bytes(fd: int, buffers: list[memoryview]) -> int:
        first = memoryview(buffers[0]).cast("B")
        return real(fd, [first[:7]] if first.nbytes else [first])

    monkeypatch.setattr(os, "writev", at_most_7_bytes)
    store = FileStore(tmp_path)
    pages = [a_page(nbytes=n) for n in (0, 1, 50, 1000)]
    store.put_blocking(pages)
    monkeypatch.undo()
    assert FileStore(tmp_path).get_blocking([p.key for p in pages], ["kv"]) == [p.blobs for p in pages]


def test_a_write_that_fails_leaves_no_temporary_file_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, buffers: object) -> int:
        raise OSError(28, "No space left on device")

    store = FileStore(tmp_path)
    page = a_page()
    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(StorageError, match="No space left on device") as e:
        store.put_blocking([page])
    monkeypatch.undo()
    assert e.value.operation == "put"
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_rename_that_fails_leaves_no_temporary_file(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    page = a_page()
    target = file_of(store, page.key)
    target.mkdir(parents=True)
    (target / "x").write_bytes(b"")  # a non-empty directory: the rename over it fails
    with pytest.raises(StorageError) as e:
        store.put_blocking([page])
    assert e.value.operation == "put"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_a_bounded_store_stamps_each_put_and_read_with_its_own_clock_to_the_nanosecond(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eviction order is the stamps' order, so a bounded store sets them itself (the
    kernel's own stamps may tie within a tick): each page file carries the store's clock
    at its put, then at its last read, to the nanosecond."""
    handed: list[int] = []

    def clock() -> int:  # long ago, and odd nanoseconds: no kernel stamp is one of these
        handed.append(1_000_000_000_000_000_001 + 7 * len(handed))
        return handed[-1]

    monkeypatch.setattr(fs_module.time, "time_ns", clock)
    store = FileStore(tmp_path, max_bytes="1GiB")
    pages = [a_page() for _ in range(5)]
    for p in pages:
        store.put_blocking([p])
    put_stamps = [file_of(store, p.key).stat().st_mtime_ns for p in pages]
    assert set(put_stamps) <= set(handed) and put_stamps == sorted(set(put_stamps))
    for p in reversed(pages):
        store.get_blocking([p.key], ["kv"])
    read_stamps = [file_of(store, p.key).stat().st_mtime_ns for p in reversed(pages)]
    assert set(read_stamps) <= set(handed) and read_stamps == sorted(set(read_stamps))
    assert min(read_stamps) > max(put_stamps)


def test_an_unbounded_store_leaves_a_read_pages_stamp_alone(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    page = a_page()
    store.put_blocking([page])
    os.utime(file_of(store, page.key), ns=(10**18, 10**18))
    assert store.get_blocking([page.key], ["kv"]) == [page.blobs]
    assert file_of(store, page.key).stat().st_mtime_ns == 10**18


def test_a_file_of_another_layout_with_a_well_formed_record_is_a_miss(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    page = a_page()
    store.put_blocking([page])
    path = file_of(store, page.key)
    raw = path.read_bytes()
    path.write_bytes(b"kvtpage2" + raw[8:])  # only the magic differs
    assert store.exists_blocking([page.key]) == [False]
    assert store.get_blocking([page.key], ["kv"]) == [None]


def test_a_page_whose_record_is_longer_than_the_first_read_round_trips(tmp_path: Path) -> None:
    blobs = {f"pool-{i:03d}-" + "x" * 40: secrets.token_bytes(i % 7) for i in range(120)}
    page = PageBlobs(secrets.token_bytes(32), blobs)
    assert len(page_header(page)) > fs_module._HEAD_READ
    store = FileStore(tmp_path)
    store.put_blocking([page])
    assert store.exists_blocking([page.key]) == [True]
    assert store.get_blocking([page.key], list(blobs)) == [blobs]
    path = file_of(store, page.key)
    with open(path, "r+b") as f:  # one byte short of its header: a miss
        f.truncate(len(page_header(page)) - 1)
    assert store.exists_blocking([page.key]) == [False]


def test_entering_makes_every_missing_page_directory_and_no_other(tmp_path: Path) -> None:
    (tmp_path / "00").mkdir()  # one already there: the rest are still made

    async def enter() -> None:
        async with FileStore(tmp_path):
            pass

    asyncio.run(enter())
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{i:02x}" for i in range(256)]


# -- a bounded store's ledgers, counts and evictions ------------------------------------------


def test_another_store_on_the_directory_reports_its_usage_from_the_ledgers(tmp_path: Path) -> None:
    writer = FileStore(tmp_path, max_bytes="1MiB")
    pages = [a_page(nbytes=n) for n in (10, 200, 3000)]
    writer.put_blocking(pages)
    total = sum(on_disk(p) for p in pages)
    assert writer.usage() is not None and writer.usage().used_bytes == total  # type: ignore[union-attr]
    reader = FileStore(tmp_path, max_bytes="1MiB")  # a second process, say: no ledger opened yet
    reader.exists_blocking([pages[0].key])
    assert reader.usage().used_bytes == total  # type: ignore[union-attr]
    assert FileStore(tmp_path).usage() is None  # unbounded: no gauge


def test_a_put_refreshes_the_usage_of_every_shard_with_what_other_stores_wrote(tmp_path: Path) -> None:
    mine = FileStore(tmp_path, max_bytes="1MiB")
    first, theirs, second = a_page(key_in_shard(3)), a_page(key_in_shard(5), nbytes=700), a_page(key_in_shard(3))
    mine.put_blocking([first])
    FileStore(tmp_path, max_bytes="1MiB").put_blocking([theirs])  # another process, say
    mine.put_blocking([second])
    assert mine.usage().used_bytes == on_disk(first) + on_disk(theirs) + on_disk(second)  # type: ignore[union-attr]


def test_a_page_directory_another_writer_makes_meanwhile_is_written_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's directory is missing when the put opens its temporary file, and
    another writer (a process putting a page of the same directory) makes it before
    this one does: the put goes on into it."""
    store = FileStore(tmp_path)
    page = a_page(key_in_shard(2, 9))
    opened = os.open
    raced: list[str] = []

    def racing_open(path: str, *args: object) -> int:
        directory = os.path.dirname(path)
        if str(path).endswith(".tmp") and not raced:
            raced.append(directory)
            os.makedirs(directory, exist_ok=True)  # the other writer, first
            raise FileNotFoundError(path)  # what this writer saw just before
        return opened(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(fs_module.os, "open", racing_open)
    store.put_blocking([page])
    monkeypatch.undo()
    assert raced == [str(tmp_path / "29")]
    assert store.get_blocking([page.key], ["kv"]) == [{"kv": bytes(page.blobs["kv"])}]


def test_one_count_pays_for_many_puts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counts: list[int] = []
    real = FileStore._count_and_evict

    def counted(self: FileStore, shard: int, incoming: int, own: str) -> int:
        counts.append(shard)
        return real(self, shard, incoming, own)

    monkeypatch.setattr(FileStore, "_count_and_evict", counted)
    store = FileStore(tmp_path, max_bytes="16MiB")
    for _ in range(6):
        store.put_blocking([a_page(key_in_shard(3))])
    assert counts == [3]  # the new ledger's first put counts the shard; the next five do not


def test_clear_answers_zero_for_a_store_never_written_and_resets_the_ledgers(tmp_path: Path) -> None:
    assert asyncio.run(FileStore(tmp_path / "never").clear()) == 0
    store = FileStore(tmp_path / "s", max_bytes="1MiB")
    store.put_blocking([a_page() for _ in range(4)])
    assert asyncio.run(store.clear()) == 4
    fresh = FileStore(tmp_path / "s", max_bytes="1MiB")
    fresh.exists_blocking([b"k"])
    assert fresh.usage().used_bytes == 0  # type: ignore[union-attr]
    for ledger in (tmp_path / "s").glob(".kvtier-usage-*"):
        assert struct.unpack("<qd", ledger.read_bytes()) == (0, 0.0)  # counted again at the next put


def test_clear_leaves_other_directories_and_files_alone(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put_blocking([a_page() for _ in range(3)])
    (tmp_path / "backups").mkdir()
    (tmp_path / "backups" / "old.data").write_bytes(b"someone's")
    (tmp_path / "ab").write_bytes(b"a file with a page directory's name")
    assert asyncio.run(store.clear()) == 3
    assert (tmp_path / "backups" / "old.data").read_bytes() == b"someone's"
    assert (tmp_path / "ab").is_file()


def test_a_count_finds_every_page_of_its_shard_whatever_else_lies_there(tmp_path: Path) -> None:
    """A count (here forced by a ledger older than ten minutes) walks all sixteen of a shard's
    directories: a missing one, another layout's record, someone's dotfile or other file, a
    fresh temporary file: none of them ends the walk early, and only the layout's stray
    records go."""
    store = FileStore(tmp_path, max_bytes="16MiB")
    # 40 pages beside the foreign files of "51": a walk that stopped at a foreign file
    # (in the directory's order, which the names decide) would miss some of them
    pages = [a_page(key_in_shard(5, second)) for second in range(1, 16) for _ in range(40 if second == 1 else 2)]
    store.put_blocking(pages)
    total = sum(on_disk(p) for p in pages)
    assert not (tmp_path / "50").exists()
    sub = tmp_path / "51"
    (sub / "feedbeef.commit").write_bytes(b"{}")  # an earlier layout's record
    (sub / ".notes").write_bytes(b"an operator's")  # not a store's file, however old
    (sub / "README").write_bytes(b"not a store's either")
    old = 10**18 // 1000  # long ago
    os.utime(sub / ".notes", ns=(old, old))
    ledger = tmp_path / ".kvtier-usage-5"
    ledger.write_bytes(struct.pack("<qd", 0, 0.0))  # never counted: the next put counts
    newcomer = a_page(key_in_shard(5, 1))
    store.put_blocking([newcomer])
    assert struct.unpack("<qd", ledger.read_bytes())[0] == total + on_disk(newcomer)
    assert not (sub / "feedbeef.commit").exists()
    assert (sub / ".notes").read_bytes() == b"an operator's" and (sub / "README").exists()
    assert store.usage().evicted_pages == 0  # type: ignore[union-attr]


def test_evictions_add_up_and_a_shard_emptied_by_one_holds_just_the_newcomer(tmp_path: Path) -> None:
    page = a_page(key_in_shard(7), nbytes=400)
    size = on_disk(page)
    store = FileStore(tmp_path, max_bytes=size * SHARDS)  # one page a shard
    store.put_blocking([page])
    for _ in range(2):
        store.put_blocking([a_page(key_in_shard(7), nbytes=400)])
    usage = store.usage()
    assert usage is not None and (usage.evicted_pages, usage.evicted_bytes) == (2, 2 * size)
    assert struct.unpack("<qd", (tmp_path / ".kvtier-usage-7").read_bytes())[0] == size


def test_unlink_says_whether_it_removed_the_file(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_bytes(b"12345")
    assert fs_module._unlink(f, 5) == 5
    assert fs_module._unlink(f, 5) == 0  # another process removed it first


def test_the_record_in_a_page_header_is_the_commit_record(tmp_path: Path) -> None:
    page = PageBlobs(b"k" * 32, {"b": b"12", "a": b"345"})
    header = page_header(page)
    magic, length = struct.unpack_from("<8sI", header)
    assert magic == b"kvtpage1" and len(header) == 12 + length
    assert json.loads(header[12:])["blobs"] == {"a": 3, "b": 2}


def test_a_count_that_finds_the_shard_exactly_full_with_the_newcomer_evicts_nothing(tmp_path: Path) -> None:
    """The bound is inclusive: a shard whose pages and newcomer add up to exactly its
    sixteenth keeps them all (the count is forced by a ledger that ran over)."""
    pages = [a_page(key_in_shard(9), nbytes=500) for _ in range(4)]
    size = on_disk(pages[0])
    store = FileStore(tmp_path, max_bytes=4 * size * SHARDS)
    store.put_blocking(pages[:3])
    ledger = tmp_path / ".kvtier-usage-9"
    counted_at = struct.unpack("<qd", ledger.read_bytes())[1]
    ledger.write_bytes(struct.pack("<qd", 4 * size, counted_at))  # over: the next put counts
    store.put_blocking([pages[3]])
    assert store.usage().evicted_pages == 0  # type: ignore[union-attr]
    assert store.exists_blocking([p.key for p in pages]) == [True] * 4
    assert struct.unpack("<qd", ledger.read_bytes())[0] == 4 * size


def test_a_bounded_stores_lookups_in_a_directory_never_written_create_nothing(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "empty", max_bytes="1MiB")
    assert store.exists_blocking([b"k" * 32]) == [False]
    assert store.get_blocking([b"k" * 32], ["kv"]) == [None]
    assert not (tmp_path / "empty").exists()
    assert store.usage() is not None and store.usage().used_bytes == 0  # type: ignore[union-attr]


def test_the_async_calls_of_one_store_run_one_at_a_time(tmp_path: Path) -> None:
    """One worker thread at a time serves a store's async calls (its limiter): calls
    gathered at once never overlap on the disk, so a burst does not fill anyio's
    thread pool with one store's file I/O."""
    import threading
    import time as clock

    running, most = [0], [0]
    lock = threading.Lock()

    def slow(key: bytes) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        clock.sleep(0.02)
        with lock:
            running[0] -= 1

    async def burst() -> None:
        async with FileStore(tmp_path, before_commit=slow) as store:
            await asyncio.gather(*(store.put([a_page()]) for _ in range(6)))
            assert len(await store.exists([b"k" * 32])) == 1

    asyncio.run(burst())
    assert most[0] == 1


def test_a_page_shorter_than_the_first_read_is_read_in_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """V4's 0-byte anchor pages and other small ones: a lookup or a read is one pread of the
    file, no fstat and no second pread; a larger page takes an fstat (lookup) and a pread
    a blob (read)."""
    store = FileStore(tmp_path)
    small, large = a_page(nbytes=0), a_page(nbytes=3 * fs_module._HEAD_READ)
    store.put_blocking([small, large])
    calls: list[str] = []
    real_pread, real_fstat = os.pread, os.fstat
    monkeypatch.setattr(os, "pread", lambda *a: calls.append("pread") or real_pread(*a))
    monkeypatch.setattr(os, "fstat", lambda *a: calls.append("fstat") or real_fstat(*a))
    assert store.exists_blocking([small.key]) == [True] and calls == ["pread"]
    calls.clear()
    assert store.get_blocking([small.key], ["kv"]) == [small.blobs] and calls == ["pread"]
    calls.clear()
    assert store.exists_blocking([large.key]) == [True] and calls == ["pread", "fstat"]
    calls.clear()
    assert store.get_blocking([large.key], ["kv"]) == [large.blobs] and calls == ["pread", "fstat", "pread"]


# -- the sized lookup: one stat a page ---------------------------------------------------


@pytest.mark.parametrize("lengths", [{"kv": 0}, {"kv": 1}, {"kv": 4096 * 3}, {"c4": 7, "kv": 0, "swa": 300}])
def test_a_sized_lookup_finds_exactly_the_pages_of_those_lengths(tmp_path: Path, lengths: dict[str, int]) -> None:
    store = FileStore(tmp_path)
    page = PageBlobs(secrets.token_bytes(32), {p: secrets.token_bytes(n) for p, n in lengths.items()})
    longer = PageBlobs(secrets.token_bytes(32), {p: secrets.token_bytes(n + 1) for p, n in lengths.items()})
    store.put_blocking([page, longer])
    missing = secrets.token_bytes(32)
    # Its answer is the full lookup's for every whole page and for a missing one.
    assert store.exists_sized_blocking([page.key, missing], lengths) == store.exists_blocking([page.key, missing]) \
        == [True, False]
    # A page stored whole with other lengths (one byte more a blob, one pool fewer) is not that page.
    assert store.exists_sized_blocking([longer.key], lengths) == [False]
    assert store.exists_sized_blocking([page.key], {**lengths, "extra": 0}) == [False]
    # Cut short by a byte or grown by one: not found.
    path = file_of(store, page.key)
    whole = path.read_bytes()
    path.write_bytes(whole[:-1])
    assert store.exists_sized_blocking([page.key], lengths) == [False]
    path.write_bytes(whole + b"\0")
    assert store.exists_sized_blocking([page.key], lengths) == [False]


def test_a_sized_lookup_stats_and_never_opens_and_finds_a_damaged_header_the_read_then_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weaker promise, written down: size alone. A header damaged in place (same
    size) is found by the sized lookup, not by the full one, and the read misses it."""
    store = FileStore(tmp_path)
    page = a_page(nbytes=64)
    store.put_blocking([page])
    path = file_of(store, page.key)
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0xFF  # the magic
    path.write_bytes(bytes(raw))
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    assert store.exists_sized_blocking([page.key], {"kv": 64}) == [True]
    assert opened == []
    assert store.exists_blocking([page.key]) == [False]
    assert store.get_blocking([page.key], ["kv"]) == [None]


@pytest.mark.parametrize("lengths", [{}, {"kv": -1}, {"kv": 1.0}, {"kv": True}, {"": 3}, {3: 3}, [("kv", 3)], None])
def test_a_sized_lookup_refuses_lengths_that_are_not_pool_sizes_naming_them(tmp_path: Path, lengths: object) -> None:
    store = FileStore(tmp_path)
    page = a_page()
    store.put_blocking([page])
    with pytest.raises(ConfigurationError, match="blob lengths are a non-empty mapping of pool names") as raised:
        store.exists_sized_blocking([page.key], lengths)  # type: ignore[arg-type]
    assert repr(lengths)[:20] in str(raised.value)
    assert store.exists_blocking([page.key]) == [True]


def test_a_sized_lookup_checks_its_keys_and_is_refused_on_a_closed_store(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(ConfigurationError, match="page keys are 1..256 bytes"):
        store.exists_sized_blocking(["a str"], {"kv": 1})  # type: ignore[list-item]
    asyncio.run(store.aclose())
    with pytest.raises(StorageError, match="closed"):
        store.exists_sized_blocking([b"k"], {"kv": 1})


def test_a_sized_lookup_of_a_bounded_store_refreshes_its_usage(tmp_path: Path) -> None:
    """A lookup on a bounded store keeps `usage` as fresh as the full lookup does:
    another process's put is seen within a second."""
    writer, reader = FileStore(tmp_path, max_bytes="1MiB"), FileStore(tmp_path, max_bytes="1MiB")
    page = a_page(nbytes=1000)
    writer.put_blocking([page])
    reader._usage_read_at = 0.0  # its last refresh long ago
    assert reader.exists_sized_blocking([page.key], {"kv": 1000}) == [True]
    usage = reader.usage()
    assert usage is not None and usage.used_bytes == on_disk(page)
