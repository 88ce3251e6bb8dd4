"""kvtier against SGLang's HiCacheFile on SGLang's own DeepSeek V4 HiCache stack, on CPU.

Run in the SGLang venv (``make test-sglang`` builds it)::

    .venv-sglang/bin/python benchmarks/sglang_v4.py [--prefixes 16] [--pages 4] [--page-size 256] [--torch-threads 1] [--quick]

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
round; the ratios are kvtier's rate over HiCacheFile's, in the same run: best
over best, and each round's (the two minutes apart at most) with their median.
The CPU time of the thread that made SGLang's calls is reported beside the wall
rates: a disk's writeback swings wall times by several times from one minute to
the next, CPU time far less. Every prefetched page is checked byte-exact against its backup.

Torch runs one intra-op thread during the run unless ``--torch-threads`` says
otherwise: SGLang's copy of each page into its host pool (the same call for
both backends) otherwise goes to torch's thread pool, whose hand-offs on a
two-core machine swung one backend's prefetch CPU by up to three times from
one process to the next.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
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
    another; seconds (wall, and CPU of the calling thread), pages and bytes of each direction."""
    device_pages = max(8, pages)
    writer = v4.build_v4_stack(backend, extra, page_size=page_size, layout=layout, device_pages=device_pages)
    reader = v4.build_v4_stack(backend, extra, page_size=page_size, layout=layout, device_pages=device_pages)
    out = dict.fromkeys(("backup_s", "backup_cpu_s", "prefetch_s", "prefetch_cpu_s", "pages", "bytes"), 0.0)
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
            out["backup_cpu_s"] += backed.cpu_seconds
            out["prefetch_s"] += got.seconds
            out["prefetch_cpu_s"] += got.cpu_seconds
            out["pages"] += _pages_moved(backed)
            out["bytes"] += backed.nbytes
            v4.release(writer, backed)
            v4.release(reader, got)
    finally:
        writer.close()
        reader.close()
    return out


BACKENDS = ("kvtier", "HiCacheFile")


def measure(args: argparse.Namespace) -> list[dict[str, dict[str, float]]]:
    """Each round's figures for each backend: pages/s and bytes/s of backup and
    prefetch, and the calling thread's CPU ms a prefix."""
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        # Each round alternates which backend goes first (the disk's writeback of one
        # backend's files, and warm caches, then weigh on both alike).
        this: dict[str, dict[str, float]] = {}
        for name in BACKENDS[:: 1 if r % 2 == 0 else -1]:
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
            this[name] = {
                "backup_pages_s": got["pages"] / got["backup_s"], "backup_bytes_s": got["bytes"] / got["backup_s"],
                "prefetch_pages_s": got["pages"] / got["prefetch_s"],
                "prefetch_bytes_s": got["bytes"] / got["prefetch_s"],
                "backup_cpu_ms": 1e3 * got["backup_cpu_s"] / args.prefixes,
                "prefetch_cpu_ms": 1e3 * got["prefetch_cpu_s"] / args.prefixes,
            }
        rounds.append(this)
    return rounds


def report(rounds: list[dict[str, dict[str, float]]], args: argparse.Namespace) -> str:
    """Each backend's best rates over the rounds, its median CPU a prefix, and
    kvtier over HiCacheFile: each round's ratio (the two ran minutes apart at
    most, on the same disk) and their median."""
    def best(name: str, k: str) -> float:
        return max(r[name][k] for r in rounds)

    def cpu(name: str, k: str) -> float:
        return statistics.median(r[name][k] for r in rounds)

    lines = [f"SGLang DeepSeek V4 stack on CPU: {args.prefixes} prefixes x {args.pages} pages of {args.page_size} "
             f"tokens, host layout {args.layout}, {args.rounds} round(s), torch threads {torch.get_num_threads()}; "
             f"rates: the best round; CPU: the median round's, of the thread that made SGLang's calls",
             f"{'':14}{'backup pages/s':>16}{'backup MB/s':>14}{'CPU ms/prefix':>15}"
             f"{'prefetch pages/s':>18}{'prefetch MB/s':>15}{'CPU ms/prefix':>15}"]
    for name in BACKENDS:
        lines.append(f"{name:14}{best(name, 'backup_pages_s'):16.0f}{best(name, 'backup_bytes_s') / 1e6:14.1f}"
                     f"{cpu(name, 'backup_cpu_ms'):15.2f}{best(name, 'prefetch_pages_s'):18.0f}"
                     f"{best(name, 'prefetch_bytes_s') / 1e6:15.1f}{cpu(name, 'prefetch_cpu_ms'):15.2f}")
    ratios = {k: [r["kvtier"][k] / r["HiCacheFile"][k] for r in rounds] for k in ("backup_pages_s", "prefetch_pages_s")}
    lines.append(f"{'kvtier / file':14}{best('kvtier', 'backup_pages_s') / best('HiCacheFile', 'backup_pages_s'):15.2f}x"
                 f"{'':29}{best('kvtier', 'prefetch_pages_s') / best('HiCacheFile', 'prefetch_pages_s'):17.2f}x"
                 "   (best over best)")
    for label, k in (("backup", "backup_pages_s"), ("prefetch", "prefetch_pages_s")):
        each = ", ".join(f"{x:.2f}" for x in ratios[k])
        lines.append(f"kvtier / file, {label} by round: {each}; median {statistics.median(ratios[k]):.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--pages", type=int, default=4, help="pages a prefix (default 4)")
    parser.add_argument("--page-size", type=int, default=256, choices=(128, 256))
    parser.add_argument("--layout", default="page_first", choices=("page_first", "layer_first"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 prefixes of 2 pages, one round: a smoke run")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch's intra-op threads during the run (default 1; 0: torch's own default)")
    args = parser.parse_args(argv)
    if args.quick:
        args.prefixes, args.pages, args.rounds = 2, 2, 1
    for flag in ("prefixes", "pages", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1; got {getattr(args, flag)}")
    if args.torch_threads < 0:
        parser.error(f"--torch-threads must be >= 0; got {args.torch_threads}")
    threads = torch.get_num_threads()
    try:
        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        print(report(measure(args), args))
    finally:
        torch.set_num_threads(threads)  # a caller's process (a test) keeps its own
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
