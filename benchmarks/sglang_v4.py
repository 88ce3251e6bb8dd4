"""kvtier against SGLang's HiCacheFile on SGLang's own DeepSeek V4 HiCache stack, on CPU.

Run in the SGLang venv (``make test-sglang`` builds it)::

    .venv-sglang/bin/python benchmarks/sglang_v4.py [--prefixes 16] [--pages 4] [--page-size 256] [--quick]

Both backends sit behind SGLang's own V4 stack (its ``DeepSeekV4TokenToKVPool``,
``build_deepseek_v4_hicache_stack`` and ``HybridCacheController``, built as
tests/sglang/v4_harness.py builds them: three layers, one C4 with its indexer
and compressor states, one C128, the SWA window) and store into a local
directory: kvtier's FileStore through SGLang's dynamic backend factory, and
HiCacheFile. For each of ``--prefixes`` prompts of ``--pages`` pages, SGLang's
backup (``_page_backup``: every V4 pool's pages, then the KV anchor's) is timed
on one stack, and SGLang's prefetch of it (``_storage_hit_query`` and the page
transfer of every pool) on another. Pages are counted as SGLang moves them:
every pool's page of every prefix page (the 0-byte KV anchor pages included),
bytes as their sum. Each backend's rates are the best of ``--rounds`` rounds
(the machine may be loaded), the backend that goes first alternating by
round; the ratio is kvtier's rate over HiCacheFile's, in the same run. Every prefetched page is checked byte-exact against its backup.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(ROOT / "tests" / "sglang" / "stand_ins"))  # see its docstring
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "sglang")]  # this checkout's kvtier, and the V4 stack builder

import torch  # noqa: E402
import v4_harness as v4  # noqa: E402

KVTIER = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
          "class_name": "KvtierHiCacheStorage", "interface_v1": 1}


def _pages_moved(backed: v4.Backed) -> int:
    """Pages SGLang moves for one prefix: a KV anchor page and each pool's pages."""
    return len(backed.keys) + sum(len(p) for p in backed.pages.values())


def run_backend(backend: str, extra: dict[str, Any], *, prefixes: int, pages: int, page_size: int,
                layout: str, seed: int) -> dict[str, float]:
    """One round: back up ``prefixes`` prompts on one stack, prefetch them on
    another; seconds, pages and bytes of each direction."""
    device_pages = max(8, pages)
    writer = v4.build_v4_stack(backend, extra, page_size=page_size, layout=layout, device_pages=device_pages)
    reader = v4.build_v4_stack(backend, extra, page_size=page_size, layout=layout, device_pages=device_pages)
    out = {"backup_s": 0.0, "prefetch_s": 0.0, "pages": 0.0, "bytes": 0.0}
    try:
        for i in range(prefixes):
            backed = v4.fill_and_backup(writer, pages, seed=seed + i)
            got = v4.prefetch(reader, backed.tokens)
            if (got.found, got.landed) != (pages, pages):
                raise SystemExit(f"{backend}: prefix {i} came back {got.landed} of {pages} pages")
            for name, landed in got.pages.items():
                for j, (a, b) in enumerate(zip(landed, backed.pages[name])):
                    if not torch.equal(a, b):
                        raise SystemExit(f"{backend}: pool {name!r} page {j} of prefix {i} differs")
            out["backup_s"] += backed.seconds
            out["prefetch_s"] += got.seconds
            out["pages"] += _pages_moved(backed)
            out["bytes"] += backed.nbytes
            v4.release(writer, backed)
            v4.release(reader, got)
    finally:
        writer.close()
        reader.close()
    return out


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Each backend's best pages/s and bytes/s of backup and prefetch over ``args.rounds`` rounds."""
    best: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        # Each round alternates which backend goes first (the disk's writeback of one
        # backend's files, and warm caches, then weigh on both alike).
        for name in ("kvtier", "HiCacheFile")[:: 1 if r % 2 == 0 else -1]:
            root = Path(tempfile.mkdtemp(prefix=f"kvtier-bench-v4-{name}-"))
            try:
                if name == "kvtier":
                    backend, extra = "dynamic", {**KVTIER, "store_path": str(root)}
                else:
                    backend, extra = "file", {"file_storage_path": str(root), "interface_v1": 1}
                got = run_backend(backend, extra, prefixes=args.prefixes, pages=args.pages,
                                  page_size=args.page_size, layout=args.layout, seed=1000 * r)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            rates = {
                "backup_pages_s": got["pages"] / got["backup_s"], "backup_bytes_s": got["bytes"] / got["backup_s"],
                "prefetch_pages_s": got["pages"] / got["prefetch_s"],
                "prefetch_bytes_s": got["bytes"] / got["prefetch_s"],
            }
            mine = best.setdefault(name, dict.fromkeys(rates, 0.0))
            for k, v in rates.items():
                mine[k] = max(mine[k], v)
    return best


def report(best: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    lines = [f"SGLang DeepSeek V4 stack on CPU: {args.prefixes} prefixes x {args.pages} pages of {args.page_size} "
             f"tokens, host layout {args.layout}, best of {args.rounds} round(s)",
             f"{'':14}{'backup pages/s':>16}{'backup MB/s':>14}{'prefetch pages/s':>18}{'prefetch MB/s':>15}"]
    for name, r in best.items():
        lines.append(f"{name:14}{r['backup_pages_s']:16.0f}{r['backup_bytes_s'] / 1e6:14.1f}"
                     f"{r['prefetch_pages_s']:18.0f}{r['prefetch_bytes_s'] / 1e6:15.1f}")
    k, f = best["kvtier"], best["HiCacheFile"]
    lines.append(f"{'kvtier / file':14}{k['backup_pages_s'] / f['backup_pages_s']:15.2f}x{'':14}"
                 f"{k['prefetch_pages_s'] / f['prefetch_pages_s']:17.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--pages", type=int, default=4, help="pages a prefix (default 4)")
    parser.add_argument("--page-size", type=int, default=256, choices=(128, 256))
    parser.add_argument("--layout", default="page_first", choices=("page_first", "layer_first"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 prefixes of 2 pages, one round: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.prefixes, args.pages, args.rounds = 2, 2, 1
    for flag in ("prefixes", "pages", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1; got {getattr(args, flag)}")
    print(report(measure(args), args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
