"""What verify mode costs per backup and per load, as a ratio to the copy alone.

The same pages (a ``kv`` pool, 32 layers x 8 KV heads x 128 dims, bf16 K and
V: 128 KiB a slot) are backed up and loaded back through a `TransferScheduler`
with ``SchedulerConfig(verify=False)`` and ``verify=True``, in alternating
repetitions; the ratio is verify's time over the plain time, medians. Verify
mode hashes each page's host rows with xxh3-64 after a backup and before a
load (`kvtier.scheduler.verify`), in the executor's worker thread.

    python benchmarks/verify_cost.py [--pages 64] [--page-size 16] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
import torch

from kvtier import SchedulerConfig, TransferScheduler
from kvtier.pools import DevicePool, PoolGroup


def group_of(layers: int, slots: int, page_size: int) -> PoolGroup:
    group = PoolGroup()
    tensors = [[torch.randn(slots, 8, 128).to(torch.bfloat16) for _ in "kv"] for _ in range(layers)]
    group.add_pool("kv", device=DevicePool(tensors), page_size=page_size, host_slots=slots)
    return group


async def one(group: PoolGroup, verify: bool, slots: int) -> tuple[float, float]:
    """Seconds for one backup of every slot, then one load of them back."""
    idx = torch.arange(slots)
    async with TransferScheduler(group, config=SchedulerConfig(verify=verify)) as sched:
        t0 = time.perf_counter()
        b = await sched.backup({"kv": idx})
        await b
        t1 = time.perf_counter()
        ld = await sched.load({"kv": b.host_indices["kv"]}, {"kv": idx})
        await ld
        t2 = time.perf_counter()
        sched.free_host({"kv": b.host_indices["kv"]})
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    slots = args.pages * args.page_size
    group = group_of(args.layers, slots, args.page_size)
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for rep in range(args.reps + 1):
        for verify in ((False, True) if rep % 2 else (True, False)):
            got = anyio.run(one, group, verify, slots)
            if rep:  # the first round warms up
                times[verify].append(got)
    nbytes = slots * group["kv"].slot_nbytes
    for i, what in enumerate(("backup", "load")):
        plain = statistics.median(t[i] for t in times[False])
        checked = statistics.median(t[i] for t in times[True])
        print(f"{what:6s} {nbytes / 2**20:7.1f} MiB: plain {nbytes / plain / 1e9:5.2f} GB/s, verify "
              f"{nbytes / checked / 1e9:5.2f} GB/s, verify/plain time {checked / plain:4.2f}x")


if __name__ == "__main__":
    main()
