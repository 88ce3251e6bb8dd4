"""Bytes a DeepSeek V4 backup moves against the bytes that hold data.

For each geometry it builds the V4 stack (`kvtier.presets.deepseek_v4`), takes
the device slots a sequence of N tokens needs, backs them up through a real
`TransferScheduler` and counts the bytes the executor's copy plans move
(`BatchPlan.nbytes`: rows planned x row bytes, every pool, every layer):

* ``data``: the bytes that hold data, from N alone: ``N // rate`` compressed
  entries per sidecar, ``min(N, sliding_window - 1)`` window rows, the CSA
  overlaps once an entry exists, ``N % rate`` buffered tokens per buffer;
* ``before``: what kvtier moved before transfers carried valid rows (main up
  to issue 25): every row of every page a sequence takes, in that layout
  (one ``c4_state`` slot with ``r4 - 1`` buffer rows, always), computed
  from the slot sizes; run this script on that code (``PYTHONPATH=<old
  tree>``) and its ``now`` column measures the same figure;
* ``now``: measured, with ``valid_rows=stack.valid_rows(N)`` when the stack has it.

Then, for every N from one anchor page to four, the largest padding
(``now / data - 1``) and whether any byte beyond the data moved. Nothing
here needs a GPU or transformers. Usage::

    PYTHONPATH=. python benchmarks/v4_bytes.py            # the table
    PYTHONPATH=. python benchmarks/v4_bytes.py --markdown # for docs/deepseek_v4.md
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import anyio
import torch

from kvtier import PoolGroup, TransferScheduler
from kvtier.presets import deepseek_v4
from kvtier.scheduler.admission import give_back_device, take_device_now
from kvtier.transfers import CpuExecutor

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: tuple[str, ...]
    csa: int
    hca: int
    page: int
    window: int
    head_dim: int
    index_head_dim: int
    dtype: torch.dtype
    lengths: tuple[int, ...]  # the table's rows

    def config(self) -> Any:
        rates = {CSA: self.csa} | ({HCA: self.hca} if HCA in self.layers else {})
        return SimpleNamespace(layer_types=list(self.layers), compress_rates=rates, sliding_window=self.window,
                               head_dim=self.head_dim, index_head_dim=self.index_head_dim, num_key_value_heads=1)


V4_LAYERS = (HCA, CSA, SLIDING, CSA, HCA, CSA)
GEOMETRIES = [
    Geometry("rates 4/128 (V4), page 256, window 128, head 512, bf16", V4_LAYERS, 4, 128, 256, 128, 512, 128,
             torch.bfloat16, (256, 301, 555, 700)),
    Geometry("rates 4/16, page 16, window 16, head 32, f32 (the e2e tests)", V4_LAYERS, 4, 16, 16, 16, 32, 16,
             torch.float32, (3, 16, 25, 41)),
    Geometry("rate 2, no HCA, page 64, window 24, head 64, bf16", (CSA, SLIDING, CSA), 2, 0, 64, 24, 64, 32,
             torch.bfloat16, (45, 99, 151)),
    Geometry("rates 8/32, page 64, window 48, head 64, f32", V4_LAYERS, 8, 32, 64, 48, 64, 32,
             torch.float32, (101, 173, 241)),
    Geometry("rates 4/64, page 128, window 40, head 64, f32", V4_LAYERS, 4, 64, 128, 40, 64, 32,
             torch.float32, (101, 230, 333)),
    Geometry("rates 8/128, page 512, window 100, head 64, f32", V4_LAYERS, 8, 128, 512, 100, 64, 32,
             torch.float32, (299, 421, 700)),
]


class CountingExecutor(CpuExecutor):
    """A `CpuExecutor` that adds up the bytes its batches' copy plans move."""

    def __init__(self) -> None:
        super().__init__()
        self.copied = 0

    async def execute(self, batch: Any, progress: Any) -> None:
        await super().execute(batch, progress)
        self.copied += batch.plan().nbytes


def _role(stack: Any, role: str) -> str | None:
    return stack.roles.get(role)


def data_bytes(stack: Any, group: PoolGroup, n: int) -> int:
    ln = stack.lengths(n)
    rows = {"c4": ln.c4_entries, "c4_indexer": ln.c4_entries, "c128": ln.c128_entries, "window": ln.window_tokens,
            "c128_buffer": ln.c128_buffered}
    out = sum(r * group[name].slot_nbytes for role, r in rows.items() if (name := _role(stack, role)))
    if _role(stack, "c4_state"):
        state = group[stack.roles["c4_state"]]
        overlap = sum(p.slot_nbytes for p in state.host.planes if p.shape[0] == stack.csa_rate) * state.host.num_layers
        buffer = state.slot_nbytes - overlap if not _role(stack, "c4_buffer") else 0
        row = group[stack.roles["c4_buffer"]].slot_nbytes if _role(stack, "c4_buffer") else buffer // (stack.csa_rate - 1)
        out += overlap * ln.has_overlap + row * ln.c4_buffered
    return out


def before_bytes(stack: Any, group: PoolGroup, n: int) -> int:
    """Every row of every page the layout before issue 25 took for N tokens."""
    ln = stack.lengths(n)
    pages = -(-n // stack.page_size)
    out = sum(pages * group[name].page_size * group[name].slot_nbytes
              for role in ("c4", "c4_indexer", "c128") if (name := _role(stack, role)))
    win = group[stack.roles["window"]]
    out += -(-ln.window_tokens // win.page_size) * win.page_size * win.slot_nbytes
    if _role(stack, "c4_state"):  # one slot: overlaps and r4 - 1 buffer rows, whatever they held
        out += group[stack.roles["c4_state"]].slot_nbytes
        if _role(stack, "c4_buffer"):
            out += (stack.csa_rate - 1) * group[stack.roles["c4_buffer"]].slot_nbytes
    if _role(stack, "c128_buffer") and ln.c128_buffered:
        buf = group[stack.roles["c128_buffer"]]
        out += -(-ln.c128_buffered // buf.page_size) * buf.page_size * buf.slot_nbytes
    return out


async def measure(g: Geometry, lengths: list[int]) -> dict[int, tuple[int, int, int]]:
    """N -> (data, before, now) bytes of one backup of N tokens."""
    group = PoolGroup()
    stack, _ = deepseek_v4(g.config(), group, page_size=g.page, tokens=max(lengths) + g.page, requests=1,
                           host_ratio=1.0, dtype=g.dtype, pin_memory=False)
    executor = CountingExecutor()
    out = {}
    async with TransferScheduler(group, executor=executor) as sched:
        for n in lengths:
            taken = take_device_now(group, stack.slots_needed(n))
            rows = {"valid_rows": stack.valid_rows(n)} if hasattr(stack, "valid_rows") else {}
            start = executor.copied
            backup = await sched.backup({name: p.slots() for name, p in taken.items()}, **rows)
            await backup
            out[n] = (data_bytes(stack, group, n), before_bytes(stack, group, n), executor.copied - start)
            sched.free_host({name: backup.host_indices[name] for name in taken})
            give_back_device(group, taken)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--sweep-pages", type=int, default=4, help="check every N from 1 to this many anchor pages")
    args = parser.parse_args()
    kb = lambda b: f"{b / 1000:.1f} KB"  # noqa: E731
    pad = lambda moved, data: f"{100 * (moved / data - 1):.0f}%" if data else "-"  # noqa: E731
    head = ("geometry", "N", "holding data", "before: moved", "padding", "now: moved", "padding")
    rows, sweeps = [], []
    for g in GEOMETRIES:
        got = anyio.run(measure, g, list(g.lengths))
        for n, (data, before, now) in got.items():
            rows.append((g.name, str(n), kb(data), kb(before), pad(before, data), kb(now), pad(now, data)))
        sweep = anyio.run(measure, g, list(range(g.page, args.sweep_pages * g.page + 1)))
        worst = max((now / data - 1, n) for n, (data, _, now) in sweep.items())
        worst_before = max((before / data - 1, n) for n, (data, before, _) in sweep.items())
        extra = sum(now - data for data, _, now in sweep.values())
        sweeps.append((g.name, f"{g.page}..{args.sweep_pages * g.page}", f"{100 * worst_before[0]:.0f}% (N={worst_before[1]})",
                       f"{100 * worst[0]:.1f}% (N={worst[1]})", str(extra)))
    sweep_head = ("geometry", "every N in", "worst padding before", "worst padding now", "bytes beyond the data, all N")
    for header, body in ((head, rows), (sweep_head, sweeps)):
        if args.markdown:
            print("| " + " | ".join(header) + " |")
            print("|" + "---|" * len(header))
            for r in body:
                print("| " + " | ".join(r) + " |")
        else:
            widths = [max(len(x) for x in col) for col in zip(header, *body)]
            for r in (header, *body):
                print("  ".join(x.ljust(w) for x, w in zip(r, widths)))
        print()


if __name__ == "__main__":
    main()
