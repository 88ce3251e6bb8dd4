"""How fast each candidate checksum for stored pages runs here, in GB/s on one core.

Stored pages (`kvtier.storage.pages`) and verify mode hash every byte they
move; this is the figure behind choosing xxh3-64. Best of ``--repeat`` runs
over a ``--mib`` buffer. crc32c is measured when ``google-crc32c`` is
installed (it is not a kvtier dependency).

    python benchmarks/hash_speed.py [--mib 4] [--repeat 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Callable

import xxhash


def rate(fn: Callable[[bytes], object], data: bytes, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(data)
        best = min(best, time.perf_counter() - t0)
    return len(data) / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    data = os.urandom(args.mib << 20)
    candidates: dict[str, Callable[[bytes], object]] = {
        "xxh3-64 (xxhash)": xxhash.xxh3_64_intdigest,
        "sha1/64 (hashlib)": lambda b: hashlib.sha1(b, usedforsecurity=False).digest()[:8],
    }
    try:
        import google_crc32c

        candidates["crc32c (google-crc32c)"] = google_crc32c.value
    except ImportError:
        pass
    for name, fn in candidates.items():
        print(f"{name:24s} {rate(fn, data, args.repeat):6.2f} GB/s")


if __name__ == "__main__":
    main()
