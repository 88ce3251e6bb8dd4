"""kvtier's CPU copy of each `kvtier bench` throughput shape against every raw method, in one thread.

    python benchmarks/copy_methods.py [--reps 5] [--mib 64] [--only backup:per_layer]

For every shape of the bench's one-operation table (device allocation, host
layout, page size, contiguous or scattered device pages, direction) it builds
the bench's pools, then times, alternating (A B C, C B A, ...): each raw method
of `kvtier.bench.copies` that applies (planned beforehand, as the bench does)
and kvtier's copy of the same rows as its executor makes it (`PoolCopy`, planned
inside the timing, then `copy_pool_layers` over every layer) twice: with the
method a `CopyCalibrator` measured for the shape before the timed runs, and
with the fixed rules (``fixed``). It prints the raw best, kvtier's method,
the median GB/s of each, and kvtier's median over the raw best's (and the
fixed rules' beside it). No scheduler, no thread hand-offs: the copy path alone. On a shared machine repeat it and read the ratios, not the
absolute figures.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from kvtier.bench.copies import RowCopy, raw_methods_for
from kvtier.bench.core import DEVICE_SPARE, POOL, REALISTIC, build_pools, device_indices
from kvtier.scheduler import SchedulerConfig
from kvtier.transfers import CopyCalibrator, Direction, PoolCopy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64, help="bytes per copy, as the bench's --quick (64 MiB)")
    ap.add_argument("--only", default="", help="run the shapes whose key contains this")
    args = ap.parse_args()
    calibrator = CopyCalibrator()
    torch.set_num_threads(1)
    min_run_bytes = SchedulerConfig().min_run_bytes
    ratios: list[tuple[float, str]] = []
    fixed_ratios: list[tuple[float, str]] = []
    for device in ("stacked", "per_layer"):
        gen = torch.Generator().manual_seed(0)  # the bench's scattered pages
        for layout in ("layer_first", "page_first"):
            for ps in (1, 16, 64):
                pages = max(1, (args.mib << 20) // (ps * REALISTIC.slot_nbytes))
                device_pages = math.ceil(pages * DEVICE_SPARE)
                pools = build_pools(REALISTIC, ps, layout, device_pages * ps, pages * ps, device)
                dev = pools.group[POOL].device
                assert dev is not None
                for pattern in ("contiguous", "scattered"):
                    dev_idx = device_indices(pattern, pages, device_pages, ps, gen)
                    host_idx = torch.arange(pages * ps)  # a fresh pool's first pages
                    for direction in (Direction.BACKUP, Direction.LOAD):
                        key = f"{direction.value}:{device}:{layout}:{ps}:{pattern}"
                        if args.only not in key:
                            continue
                        backup = direction is Direction.BACKUP
                        src, dst = (dev_idx, host_idx) if backup else (host_idx, dev_idx)
                        rc = (RowCopy(pools.device, pools.host_side, src, dst) if backup
                              else RowCopy(pools.host_side, pools.device, src, dst))
                        rc.prepare()

                        def kvtier(src: torch.Tensor = src, dst: torch.Tensor = dst,
                                   direction: Direction = direction) -> None:
                            c = PoolCopy(POOL, pools.host, dev, direction, src, dst, min_run_bytes)  # noqa: B023
                            layers = range(REALISTIC.layers)
                            c.copy_pool_layers(layers, calibrator.choose(c, layers))

                        def fixed(src: torch.Tensor = src, dst: torch.Tensor = dst,
                                  direction: Direction = direction) -> None:
                            PoolCopy(POOL, pools.host, dev, direction, src, dst,  # noqa: B023
                                     min_run_bytes).copy_pool_layers(range(REALISTIC.layers))

                        kvtier()  # the shape's calibration, outside the timing

                        variants: dict[str, Callable[[], None]] = {
                            f"raw:{name}": partial(fn, rc) for name, fn in raw_methods_for(rc).items()}
                        variants["kvtier"] = kvtier
                        variants["fixed"] = fixed
                        times: dict[str, list[float]] = {name: [] for name in variants}
                        names = list(variants)
                        for r in range(args.reps):
                            for name in names if r % 2 == 0 else reversed(names):
                                t0 = time.perf_counter()
                                variants[name]()
                                times[name].append(time.perf_counter() - t0)
                        med = {name: statistics.median(t) for name, t in times.items()}
                        best = min((n for n in med if n.startswith("raw:")), key=med.__getitem__)
                        ratio = med[best] / med["kvtier"]
                        ratios.append((ratio, key))
                        fixed_ratios.append((med[best] / med["fixed"], key))
                        c = PoolCopy(POOL, pools.host, dev, direction, src, dst, min_run_bytes)
                        method = c.describe(calibrator.cached(c))
                        print(f"{key:42} raw {best[4:]:17} {rc.nbytes / med[best] / 1e9:5.2f} GB/s  "
                              f"kvtier {rc.nbytes / med['kvtier'] / 1e9:5.2f} GB/s  {ratio:4.2f}x  {method}  "
                              f"(fixed {fixed_ratios[-1][0]:4.2f}x)",
                              flush=True)
                del pools
    for label, rs in (("calibrated", ratios), ("fixed rules", fixed_ratios)):
        if rs:
            worst = min(rs)
            print(f"{label}: worst {worst[0]:.2f}x ({worst[1]}); median {statistics.median(r for r, _ in rs):.2f}x; "
                  f"{sum(r >= 0.9 for r, _ in rs)}/{len(rs)} at least 0.9x")


if __name__ == "__main__":
    main()
