"""MooncakeStore against a real mooncake_master on loopback TCP.

`make test` brings what it needs (scripts/ensure-mooncake: the
``mooncake-transfer-engine-non-cuda`` wheel into the venv, and libibverbs and
libnl unpacked into ``.venv/mooncake-libs`` when the system lacks them, on
LD_LIBRARY_PATH), so these tests run on a fresh machine. Run alone, they skip,
saying why, without the ``mooncake`` package, without the libraries it links
(plain ``pytest``, no LD_LIBRARY_PATH: ``ImportError: libibverbs.so.1``) or
without the ``mooncake_master`` it ships (tests/test_mooncake_skip.py checks it).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from kvtier.storage import (
    BLOB_HEADER_BYTES,
    PageBlobs,
    PageCorrupted,
    StorageError,
    decode_page,
    encode_page,
    page_members,
)
from kvtier.testing import hybrid_group

try:
    import mooncake.store as mooncake_store
except ImportError as exc:
    # Not only a missing package: the wheel links libibverbs and libnl, so a plain
    # `pytest` outside `make test` (no LD_LIBRARY_PATH) meets an ImportError that
    # names the library. pytest.importorskip skips ModuleNotFoundError only.
    pytest.skip(
        f"mooncake does not import ({type(exc).__name__}: {exc}); scripts/ensure-mooncake .venv, then "
        "LD_LIBRARY_PATH=.venv/mooncake-libs (`make test` does both)",
        allow_module_level=True,
    )
from kvtier.storage.mooncake_store import MooncakeStore


def _master_binary() -> str | None:
    found = shutil.which("mooncake_master")
    if found:
        return found
    import mooncake

    bundled = Path(mooncake.__file__).with_name("mooncake_master")
    return str(bundled) if os.access(bundled, os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Master:
    """A mooncake_master with its HTTP metadata server on free loopback ports."""

    def __init__(self, directory: Path) -> None:
        binary = _master_binary()
        if binary is None:
            pytest.skip("mooncake_master binary not found")
        rpc, http, metrics = _free_port(), _free_port(), _free_port()
        self.addrs = (f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata")
        with open(directory / "master.log", "wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                 "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
                 f"--metrics_port={metrics}"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 15
        for port in (rpc, http):
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError("mooncake_master did not come up") from None
                    time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    m = Master(tmp_path_factory.mktemp("mooncake"))
    yield m.addrs
    m.stop()


@pytest.fixture
async def store(master: tuple[str, str]) -> AsyncIterator[MooncakeStore]:
    async with MooncakeStore(*master, prefix=f"t{secrets.token_hex(4)}/", global_segment_size=64 << 20,
                             local_buffer_size=32 << 20) as s:
        yield s


POOLS = {"kv": 4096, "c4": 256}


def random_pages(n: int) -> list[PageBlobs]:
    return [PageBlobs(secrets.token_bytes(32), {k: os.urandom(v) for k, v in POOLS.items()}) for _ in range(n)]


async def test_mooncake_round_trip_per_page_and_no_partial_page(store: MooncakeStore) -> None:
    pages = random_pages(5)
    await store.put([pages[0], pages[2]])
    keys = [p.key for p in pages]
    assert await store.exists(keys) == [True, False, True, False, False]
    got = await store.get(keys, POOLS)
    assert got[0] == {k: bytes(v) for k, v in pages[0].blobs.items()}
    assert [g is not None for g in got] == [True, False, True, False, False]

    def fail(key: bytes) -> None:
        if key == pages[3].key:
            raise RuntimeError("injected")

    store.before_commit = fail
    with pytest.raises(StorageError, match="stopped before the commit of page"):
        await store.put(pages[1:])
    store.before_commit = None
    assert await store.exists(keys) == [True, True, True, False, False]
    assert [g is not None for g in await store.get(keys, POOLS)] == [True, True, True, False, False]

    # Host pool pages, byte-exact.
    a, b = hybrid_group(seed=1), hybrid_group(seed=2)
    await store.put([PageBlobs(b"page-kv-3", encode_page(a, "kv", 3, key=b"page-kv-3"))])
    (blobs,) = await store.get([b"page-kv-3"], list(page_members(a, "kv", 3)))
    assert blobs is not None
    decode_page(b, "kv", 9, blobs, key=b"page-kv-3")
    assert blobs == {k: bytes(v) for k, v in encode_page(b, "kv", 9, key=b"page-kv-3").items()}


@pytest.fixture
async def raw(master: tuple[str, str]) -> AsyncIterator[Any]:
    """A plain Mooncake client on the same cluster, for damaging pages behind the store's back."""
    client = mooncake_store.MooncakeDistributedStore()

    def setup() -> int:
        return int(client.setup("127.0.0.1", master[1], 16 << 20, 16 << 20, "tcp", "", master[0]))

    assert await anyio.to_thread.run_sync(setup) == 0
    yield client
    await anyio.to_thread.run_sync(client.close)


async def test_mooncake_damaged_pages_are_misses_or_caught_and_a_put_repairs_them(
    store: MooncakeStore, raw: Any
) -> None:
    """A malformed commit record or a lost blob: a miss. A flipped byte: present,
    and decode_page raises before writing a row. Putting the pages again
    (upsert) repairs all three."""
    a, b = hybrid_group(seed=1), hybrid_group(seed=2)
    keys = [secrets.token_bytes(32) for _ in range(4)]
    pages = [PageBlobs(k, encode_page(a, "kv", p, key=k)) for k, p in zip(keys, (1, 2, 3, 4))]
    await store.put(pages)
    pools = list(page_members(a, "kv", 1))
    flipped = bytearray(pages[2].blobs["kv"])
    flipped[BLOB_HEADER_BYTES + len(flipped) // 2] ^= 0xFF

    def damage() -> None:
        prefix = store.prefix
        assert raw.upsert_batch([f"{prefix}{keys[0].hex()}/c"], [b"not json"]) == 0
        assert raw.remove(f"{prefix}{keys[1].hex()}/b/c4") == 0
        assert raw.upsert_batch([f"{prefix}{keys[2].hex()}/b/kv"], [bytes(flipped)]) == 0

    await anyio.to_thread.run_sync(damage)
    assert await store.exists(keys) == [False, False, True, True]
    got = await store.get(keys, pools)
    assert [g is not None for g in got] == [False, False, True, True]
    assert got[2] is not None and got[2]["kv"] == bytes(flipped)
    with pytest.raises(PageCorrupted, match="the blob of pool 'kv' does not match its checksum") as err:
        decode_page(b, "kv", 9, got[2], key=keys[2])
    assert err.value.rule == "checksum"

    await store.put(pages)
    assert await store.exists(keys) == [True] * 4
    for blobs, page in zip(await store.get(keys, pools), pages):
        assert blobs == {n: bytes(v) for n, v in page.blobs.items()}
        decode_page(b, "kv", 9, blobs, key=page.key)


async def test_a_dead_master_is_a_storage_error(tmp_path: Path) -> None:
    m = await anyio.to_thread.run_sync(Master, tmp_path)
    try:
        async with MooncakeStore(*m.addrs, global_segment_size=16 << 20, local_buffer_size=16 << 20, timeout_s=20) as s:
            pages = random_pages(1)
            await s.put(pages)
            await anyio.to_thread.run_sync(m.stop)
            for call in (lambda: s.exists([pages[0].key]), lambda: s.get([pages[0].key], POOLS), lambda: s.put(pages)):
                with pytest.raises(StorageError, match="failed with code -"):
                    await call()
    finally:
        m.stop()
