"""Device check for a CUDA machine: runs the ``gpu`` tests, then measures.

Prints one JSON document:

* ``tests``: exit code and summary line of ``pytest -m gpu``;
* ``raw_pinned_gbps``: one large pinned host<->device ``copy_`` (the ceiling);
* ``kvtier``: end-to-end load and backup bandwidth through the scheduler for
  ``page_first`` and ``layer_first`` pools at page sizes 1, 16 and 64, with
  scattered pages, as GB/s and as a ratio of the raw ceiling;
* ``loop_max_stall_ms``: the event loop's longest stall (a 1 ms ticker) while
  those transfers ran.

Usage: ``python benchmarks/gpu_check.py [--quick]`` (about 1-3 minutes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtier import DevicePool, PoolGroup, SchedulerConfig, TransferScheduler  # noqa: E402


def run_gpu_tests() -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    return {"exit_code": out.returncode, "summary": lines[-1] if lines else out.stderr[-500:]}


def raw_pinned(nbytes: int, reps: int) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    res = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        res[name] = nbytes / statistics.median(times) / 1e9
    return res


class Ticker:
    """Measures how late a 1 ms sleep on the loop wakes up."""

    def __init__(self) -> None:
        self.max_stall = 0.0
        self.running = True

    async def run(self) -> None:
        while self.running:
            t = time.perf_counter()
            await anyio.sleep(0.001)
            self.max_stall = max(self.max_stall, time.perf_counter() - t - 0.001)


async def kvtier_case(layout: str, page_size: int, *, layers: int, slots: int, move_frac: float,
                      reps: int) -> dict[str, object]:
    planes = [(8, 128)] * 2
    tensors = [[torch.randn((slots, *s), device="cuda").to(torch.bfloat16) for s in planes] for _ in range(layers)]
    group = PoolGroup()
    group.add_pool("kv", device=DevicePool(tensors), page_size=page_size, host_slots=slots, layout=layout)
    npages = slots // page_size
    moved = max(1, int(npages * move_frac))
    gen = torch.Generator().manual_seed(page_size)
    src_pages = torch.randperm(npages, generator=gen)[:moved]
    dst_pages = torch.randperm(npages, generator=gen)[:moved]
    offs = torch.arange(page_size)
    src = (src_pages[:, None] * page_size + offs).reshape(-1)
    dst = (dst_pages[:, None] * page_size + offs).reshape(-1)
    nbytes = len(src) * group["kv"].slot_nbytes
    cfg = SchedulerConfig(max_batch_bytes=1 << 40)
    backup_t, load_t = [], []
    async with TransferScheduler(group, config=cfg) as sched:
        for _ in range(reps):
            t = time.perf_counter()
            b = await sched.backup({"kv": src})
            await b
            backup_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            ld = await sched.load(b.host_indices, {"kv": dst})
            await ld
            load_t.append(time.perf_counter() - t)
            ok = all(
                torch.equal(tensors[j][p][dst.cuda()], tensors[j][p][src.cuda()])
                for j in (0, layers - 1) for p in range(2)
            )
            sched.free_host(b.host_indices)
    group.close()
    return {
        "layout": layout, "page_size": page_size, "bytes": nbytes, "pages": moved,
        "backup_gbps": nbytes / statistics.median(backup_t) / 1e9,
        "load_gbps": nbytes / statistics.median(load_t) / 1e9,
        "bytes_match": ok,
    }


async def measure(args: argparse.Namespace) -> dict[str, object]:
    ticker = Ticker()
    results = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker.run)
        for layout in ("page_first", "layer_first"):
            for page_size in (1, 16, 64):
                try:
                    results.append(await kvtier_case(
                        layout, page_size, layers=args.layers, slots=args.slots,
                        move_frac=0.5, reps=args.reps,
                    ))
                except Exception as exc:  # keep measuring the other cases
                    results.append({"layout": layout, "page_size": page_size, "error": repr(exc)})
        ticker.running = False
    return {"cases": results, "loop_max_stall_ms": ticker.max_stall * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller pools, fewer repetitions")
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args()
    args.layers = 16 if args.quick else 32
    args.slots = 4096 if args.quick else 8192  # 32 layers x 8192 slots x 4 KiB = 1 GiB per side
    args.reps = 3 if args.quick else 5
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 2
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    if not args.skip_tests:
        report["tests"] = run_gpu_tests()
    raw = raw_pinned(1 << 30, args.reps)
    report["raw_pinned_gbps"] = raw
    kv = anyio.run(measure, args)
    for case in kv["cases"]:  # type: ignore[union-attr]
        if "error" not in case:
            case["backup_vs_raw"] = case["backup_gbps"] / raw["d2h"]
            case["load_vs_raw"] = case["load_gbps"] / raw["h2d"]
    report["kvtier"] = kv["cases"]
    report["loop_max_stall_ms"] = kv["loop_max_stall_ms"]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
