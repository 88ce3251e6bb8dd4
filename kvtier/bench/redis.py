"""Storage throughput: `RedisStore` next to a raw redis-py pipeline of the same bytes.

``python -m kvtier.bench.redis [--url redis://...] [--pages N] [--page-kib K]``
prints the dict `bench_storage` returns, as JSON. Without ``--url`` it starts a
throwaway ``redis-server`` (`LocalRedisServer`) and stops it afterwards.

Each repetition runs the store and the raw pipeline on the same blobs, in
alternating order (store first on even repetitions, raw first on odd ones), so
a warming cache or a noisy neighbour biases neither; figures are medians.
Keys of each repetition are unlinked afterwards, outside the timed part.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from kvtier.storage.base import PageBlobs
from kvtier.storage.redis_store import CLIENT_OPTIONS, DEFAULT_PIPELINE_BYTES, RedisStore

__all__ = ["bench_storage", "main"]


async def bench_storage(
    url: str | None = None,
    *,
    pages: int = 128,
    page_bytes: int = 1 << 20,
    sidecar_fraction: float = 0.125,
    repeats: int = 5,
    max_pipeline_bytes: int = DEFAULT_PIPELINE_BYTES,
) -> dict[str, Any]:
    """Put and get ``pages`` pages of ``page_bytes`` each (a ``kv`` blob and a
    ``c4`` sidecar blob of ``sidecar_fraction`` of the page) through
    `RedisStore`, and the same blobs through a raw pipeline of ``SET``/``GET``
    in chunks of the same size; ``repeats`` alternating repetitions.

    Returns GB/s medians (``store_put_gbps``, ``raw_put_gbps``, ``put_ratio``,
    and the same for get), the per-repetition seconds, and the setup.
    Against ``url`` it only touches keys under a random prefix, and deletes them.
    """
    if pages < 1 or page_bytes < 2 or repeats < 1 or not 0 < sidecar_fraction < 1:
        raise ValueError("bench_storage needs pages >= 1, page_bytes >= 2, repeats >= 1, 0 < sidecar_fraction < 1")
    import redis
    import redis.asyncio as aioredis

    server = None
    tmp: tempfile.TemporaryDirectory[str] | None = None
    if url is None:
        from kvtier.testing.redis_server import LocalRedisServer

        tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-")
        server = LocalRedisServer(Path(tmp.name))
        await anyio.to_thread.run_sync(server.start)
        url = server.url
    side = max(1, int(page_bytes * sidecar_fraction))
    sizes = {"kv": page_bytes - side, "c4": side}
    payload = memoryview(bytearray(os.urandom(pages * page_bytes)))
    blobs = []
    for i in range(pages):
        base = i * page_bytes
        blobs.append({"kv": payload[base:base + sizes["kv"]], "c4": payload[base + sizes["kv"]:base + page_bytes]})
    total = pages * page_bytes
    samples: dict[str, list[float]] = {k: [] for k in ("store_put", "raw_put", "store_get", "raw_get")}
    raw = aioredis.Redis.from_url(url, **CLIENT_OPTIONS)
    try:
        for rep in range(repeats):
            prefix = f"kvbench{secrets.token_hex(4)}:"
            pstore = RedisStore(raw, prefix=prefix + "s:", max_pipeline_bytes=max_pipeline_bytes, timeout_s=60.0)
            entries = [PageBlobs(secrets.token_bytes(32), b) for b in blobs]
            keys = [e.key for e in entries]
            raw_keys = [[f"{prefix}r:{k.hex()}:{pool}".encode() for pool in sizes] for k in keys]
            order = ("store", "raw") if rep % 2 == 0 else ("raw", "store")
            for who in order:
                t0 = time.perf_counter()
                if who == "store":
                    await pstore.put(entries)
                else:
                    await raw_put(raw, raw_keys, blobs, max_pipeline_bytes)
                samples[f"{who}_put"].append(time.perf_counter() - t0)
            for who in order:
                t0 = time.perf_counter()
                if who == "store":
                    got = await pstore.get(keys, list(sizes))
                    if any(g is None for g in got):
                        raise RuntimeError("bench: a stored page read back as a miss")
                else:
                    await raw_get(raw, raw_keys, page_bytes, max_pipeline_bytes)
                samples[f"{who}_get"].append(time.perf_counter() - t0)
            await pstore.aclose()
            await unlink(raw, prefix)
    finally:
        await raw.aclose()
        if server is not None:
            await anyio.to_thread.run_sync(server.stop)
        if tmp is not None:
            tmp.cleanup()

    def gbps(key: str) -> float:
        return total / statistics.median(samples[key]) / 1e9

    result: dict[str, Any] = {
        "pages": pages,
        "page_bytes": page_bytes,
        "blob_bytes": sizes,
        "total_bytes": total,
        "repeats": repeats,
        "max_pipeline_bytes": max_pipeline_bytes,
        "redis_py": redis.__version__,
        "hiredis": has_hiredis(),
        "store_put_gbps": gbps("store_put"),
        "raw_put_gbps": gbps("raw_put"),
        "store_get_gbps": gbps("store_get"),
        "raw_get_gbps": gbps("raw_get"),
        "seconds": samples,
    }
    result["put_ratio"] = result["store_put_gbps"] / result["raw_put_gbps"]
    result["get_ratio"] = result["store_get_gbps"] / result["raw_get_gbps"]
    return result


async def raw_put(client: Any, keys: list[list[bytes]], blobs: list[dict[str, memoryview]], limit: int) -> None:
    pipe = client.pipeline(transaction=False)
    size = 0
    for names, page in zip(keys, blobs):
        for name, data in zip(names, page.values()):
            pipe.set(name, data)
            size += len(data)
        if size >= limit:
            await pipe.execute()
            size = 0
    await pipe.execute()


async def raw_get(client: Any, keys: list[list[bytes]], page_bytes: int, limit: int) -> list[bytes | None]:
    """GET every name, pages per pipeline until ``limit`` bytes are reached
    (as `RedisStore` does); the replies in order."""
    per_chunk = max(1, -(-limit // page_bytes))
    out: list[bytes | None] = []
    for start in range(0, len(keys), per_chunk):
        pipe = client.pipeline(transaction=False)
        for names in keys[start:start + per_chunk]:
            for name in names:
                pipe.get(name)
        out += await pipe.execute()
    return out


async def unlink(client: Any, prefix: str) -> None:
    names = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
    for start in range(0, len(names), 1000):
        await client.unlink(*names[start:start + 1000])


def has_hiredis() -> bool:
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.redis", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a Redis to use (default: start a throwaway redis-server)")
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--page-kib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pipeline-kib", type=int, default=DEFAULT_PIPELINE_BYTES >> 10)
    args = parser.parse_args(argv)
    result = anyio.run(lambda: bench_storage(
        args.url, pages=args.pages, page_bytes=args.page_kib << 10, repeats=args.repeats,
        max_pipeline_bytes=args.pipeline_kib << 10,
    ))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
