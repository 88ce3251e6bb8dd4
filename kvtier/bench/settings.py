"""What one benchmark run measures: the pools' geometry (`Shape`, `REALISTIC`,
`TINY`, `fit_shape`) and the sizes and counts of a run (`Settings`, one per
mode in `MODES`: ``full``, ``quick``, ``tiny``).

Plain values, read by every section of the benchmark (`kvtier.bench.core`,
`kvtier.bench.storage`, ...); this module imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = ["MODES", "REALISTIC", "TINY", "MiB", "Settings", "Shape", "fit_shape", "many_ops_shapes"]

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Shape:
    """A KV pool's geometry: K and V planes of ``[heads, head_dim]`` per layer."""

    layers: int
    heads: int
    head_dim: int
    dtype_name: str = "bfloat16"

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)  # type: ignore[no-any-return]

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot across every layer and both planes."""
        return self.layers * 2 * self.heads * self.head_dim * self.dtype.itemsize

    @property
    def label(self) -> str:
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(self.dtype_name, self.dtype_name)
        return f"{self.layers}x{self.heads}x{self.head_dim} {short}"


REALISTIC = Shape(layers=32, heads=8, head_dim=128)
# Rows of 64 bytes: the copies are negligible, the scheduler's work is not.
TINY = Shape(layers=32, heads=1, head_dim=16)


def fit_shape(slots: int, budget_bytes: int, base: Shape = REALISTIC) -> Shape:
    """``base`` scaled down until ``slots`` slots fit ``budget_bytes``: halve
    the layers, then the heads, then the head dim (not below 16)."""
    s = base
    while slots * s.slot_nbytes > budget_bytes:
        if s.layers > 1:
            s = replace(s, layers=s.layers // 2)
        elif s.heads > 1:
            s = replace(s, heads=s.heads // 2)
        elif s.head_dim > 16:
            s = replace(s, head_dim=s.head_dim // 2)
        else:
            break
    return s


def many_ops_shapes(settings: Settings) -> tuple[list[tuple[int, Shape]], list[int]]:
    """Page sizes of the many-operations scenario with their shape, and the
    page sizes left out: ``many_ops`` pages must fit ``many_budget_bytes`` at
    the realistic shape; page size 1 always runs, scaled down if need be."""
    kept, left_out = [], []
    for ps in settings.many_page_sizes:
        slots = settings.many_ops * ps
        if slots * REALISTIC.slot_nbytes <= settings.many_budget_bytes:
            kept.append((ps, REALISTIC))
        elif ps == 1:
            kept.append((ps, fit_shape(slots, settings.many_budget_bytes)))
        else:
            left_out.append(ps)
    return kept, left_out


@dataclass(frozen=True, slots=True)
class Settings:
    """Sizes and counts of one benchmark run (see `MODES`)."""

    mode: str
    reps: int
    selection_rounds: int
    layouts: tuple[str, ...]
    page_sizes: tuple[int, ...]
    patterns: tuple[str, ...]
    one_op_directions: tuple[str, ...]
    one_op_bytes: int
    many_ops: int
    many_page_sizes: tuple[int, ...]
    many_budget_bytes: int
    burst_bytes: int
    burst_op_pages: int
    burst_page_size: int
    latency_samples: int
    overhead_ops: int
    sequential_ops: int
    torch_threads: int = 1
    seed: int = 0
    checkpoint_every: int = 32
    ticker_interval_s: float = 0.001
    # gc.freeze() once set up, as engines do after start-up (`--no-gc-freeze`: not).
    gc_freeze: bool = True
    floor_s: float = 1.0
    devices: tuple[str, ...] = ("stacked", "per_layer")
    many_devices: tuple[str, ...] = ("stacked", "per_layer")
    many_ops_directions: tuple[str, ...] = ("backup", "load")
    # The scaling table (`Bench.scaling`): this many one-page operations
    # queued at once, single and bulk path, ``scaling_reps`` alternating
    # repetitions; one more run of ``scaling_freeze_count`` single operations
    # with the heap the other way (unfrozen when the run is frozen, see
    # `gc_freeze`). The allocator's cost per page at each of
    # ``allocator_pool_pages`` pool sizes, over ``allocator_ops`` pages.
    scaling_counts: tuple[int, ...] = (10_000, 50_000, 100_000)
    scaling_reps: int = 3
    scaling_freeze_count: int = 100_000
    allocator_pool_pages: tuple[int, ...] = (10_000, 1_000_000)
    allocator_ops: int = 10_000
    # The storage tier (`kvtier.bench.storage`): pages of a kv pool of
    # ``storage_shape`` (page size ``storage_page_size``, 1 MiB at the realistic
    # shape) with a c4 sidecar (an eighth more), written and read back.
    storage: bool = True
    storage_backends: tuple[str, ...] = ("redis", "file")
    storage_pages: int = 128
    storage_page_size: int = 8
    storage_shape: Shape = REALISTIC
    storage_layout: str = "layer_first"
    # The loop-CPU section (`kvtier.bench.loop`): this many one-page
    # operations per run, ``loop_reps`` alternating repetitions, and
    # ``loop_busy_reps`` runs beside a busy Python thread.
    loop_ops: int = 2_000
    loop_reps: int = 5
    loop_busy_reps: int = 3

    @property
    def many_ops_nominal(self) -> int:
        return 10_000


_LAYOUTS = ("layer_first", "page_first")
_PAGES = (1, 16, 64)
_PATTERNS = ("contiguous", "scattered")

MODES: dict[str, Settings] = {
    "full": Settings(
        mode="full", reps=7, selection_rounds=2, layouts=_LAYOUTS, page_sizes=_PAGES, patterns=_PATTERNS,
        one_op_directions=("backup", "load"), one_op_bytes=256 * MiB, many_ops=10_000,
        # 10,000 pages of 128 KiB: 1.22 GiB per side (peak ~7 GiB with the
        # device, the ceiling's two buffers and the raw methods' staging).
        many_page_sizes=_PAGES, many_budget_bytes=1280 * MiB,
        burst_bytes=512 * MiB, burst_op_pages=4, burst_page_size=16,
        latency_samples=200, overhead_ops=10_000, sequential_ops=500, floor_s=3.0,
    ),
    "quick": Settings(
        mode="quick", reps=3, selection_rounds=1, layouts=_LAYOUTS, page_sizes=_PAGES, patterns=_PATTERNS,
        one_op_directions=("backup", "load"), one_op_bytes=64 * MiB, many_ops=2_000,
        many_page_sizes=_PAGES, many_budget_bytes=256 * MiB,
        burst_bytes=256 * MiB, burst_op_pages=4, burst_page_size=16,
        latency_samples=40, overhead_ops=2_000, sequential_ops=200,
        # 250 MiB per run: one device allocation keeps --quick under a minute.
        many_devices=("per_layer",), many_ops_directions=("backup",),
        storage_pages=32,
        scaling_reps=1, scaling_freeze_count=10_000, loop_reps=3,
    ),
    # For the test suite: every code path, tiny sizes, seconds.
    "tiny": Settings(
        mode="tiny", reps=1, selection_rounds=1, layouts=_LAYOUTS, page_sizes=(1, 16), patterns=_PATTERNS,
        one_op_directions=("backup", "load"), one_op_bytes=2 * MiB, many_ops=64,
        many_page_sizes=(1, 16), many_budget_bytes=1 * MiB, burst_bytes=8 * MiB, burst_op_pages=1, burst_page_size=16,
        latency_samples=4, overhead_ops=128, sequential_ops=16, floor_s=0.2,
        storage_pages=4, storage_shape=TINY,
        scaling_counts=(64, 128, 256), scaling_reps=1, scaling_freeze_count=64,
        allocator_pool_pages=(1_000, 100_000), allocator_ops=500,
        loop_ops=64, loop_reps=1, loop_busy_reps=1,
    ),
}


