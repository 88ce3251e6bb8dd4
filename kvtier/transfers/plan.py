"""Copy plans: how a merged transfer's rows become copies. Pure functions.

Two plans describe the same rows:

* `CopyPlan` (`plan_copies`): index runs consecutive on both sides and at
  least ``min_run`` rows long become slice copies, the remaining rows one
  gather/scatter, per layer and plane. The CUDA executor walks it.
* `RowPlan` (`plan_rows`): one copy call per group of rows, for the CPU copy
  path (`BatchPlan.copy_layers`). Rows consecutive in the *destination* go in
  one call straight into it: a slice when the source rows are consecutive
  too, else ``index_select(..., out=destination)`` (one pass; measured as
  fast as slice copies of the runs inside it, up to 1 MiB runs). Rows left
  over go in one ``index_copy_`` per group consecutive in the source, and the
  rest through a staging gather and one ``index_copy_``.

A call pays off when it moves enough (``min_rows``): that crossover depends on
the method. `plan_batch` derives it from ``min_run_bytes`` (per layer and
plane, the meaning of `SchedulerConfig.min_run_bytes`): per-layer copies need
``min_run_bytes`` per call (measured crossover 16-32 KiB); copies that span
every layer of a stacked pool need ``min_run_bytes / STACKED_RUN_DIVISOR`` per
layer (measured 2-8 KiB: one call then moves every layer's rows).

`BatchPlan.copy_layers` copies a range of transfer layers of every pool: one
call per row group across all those layers when both sides of a pool are
stacked (`DevicePool.stacked`, `HostPool.stacked`), else per layer.

How kvtier copies a pool's rows on the CPU is a `CopyMethod`: a path (``span``
across stacked layers, ``stack`` into a ``page_first`` host, ``layers``) and a
rule grouping rows into calls (``fixed``: the thresholds above; ``runs``: a
slice per run; ``one``: as few calls as possible). `PoolCopy.candidates` lists
those that apply, all writing the same bytes; the CPU executor copies with the
one `kvtier.transfers.calibration` measured fastest for the copy's shape on
this machine. The fixed rules (`PoolCopy.path`), the fallback when calibration
is off, were chosen from measurements against the benchmark's raw methods
(`kvtier.bench.copies`; re-run with ``benchmarks/copy_methods.py --fixed``):
``span`` when both sides are stacked, ``stack`` for a backup of separate layer
tensors into a ``page_first`` host, else ``layers``; within each, the
`RowPlan`'s thresholds above. Every path moves rows as the widest element their layout
allows (`wide_rows`: 2 KiB bf16 rows as 16-byte elements), which doubles the
speed of scatters and lifts gathers ~20%; `torch.stack` alone runs at the
dtype's own width (faster there).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import TypeVar

import numpy as np
import torch

from kvtier.errors import ConfigurationError
from kvtier.pools import DevicePool, HostPool, LogicalHostPool, PoolGroup
from kvtier.transfers.merge import MergedTransfer, merge_transfers
from kvtier.transfers.operation import CacheOperation, Direction

_T = TypeVar("_T")

__all__ = [
    "STACKED_RUN_DIVISOR",
    "STACK_RUN_FACTOR",
    "WIDE_LAYER_RUN_FACTOR",
    "COPY_ROW_RULES",
    "BatchPlan",
    "CopyMethod",
    "CopyPlan",
    "PoolCopy",
    "RowPlan",
    "apply_copy_plan",
    "apply_row_plan",
    "plan_batch",
    "plan_copies",
    "plan_rows",
    "wide_rows",
]

# Copies that span every layer amortise a call over the layers: the slice/gather
# crossover per layer is this much lower than for per-layer copies (measured,
# 32 layers of 2 KiB rows, torch 2.13 CPU: 2-8 KiB against 16-32 KiB).
STACKED_RUN_DIVISOR = 4
# With a watcher on the layers, `run_batch_copies` copies groups of layers
# that move at least this much each (~3 ms here), so a waiter gets layer t
# about one group after it landed, and the calls per row group stay few.
LAYER_GROUP_BYTES = 8 << 20
# A ``torch.stack`` of a run across separate layer tensors into page_first host
# rows (written in order) against a per-layer gather (measured, 2 KiB rows):
# even at 32 KiB runs, ahead from 128 KiB (+10-40%). A stacked run also splits
# the gathers around it, so only runs of 8 x min_run_bytes (128 KiB) are stacked.
STACK_RUN_FACTOR = 8
# Per-layer copies whose rows move as wide elements (`wide_rows`): a scatter
# or gather of a layer's rows runs at about slice speed, so a run consecutive
# in the destination gets a call of its own only from this many times
# ``min_run_bytes`` (measured, 32 layers of 2 KiB rows, torch 2.13 CPU: one
# wide scatter of 64-row runs 5.1 GB/s against 4.8 for a slice per run; at
# 16-row runs 4.9 against 3.4).
WIDE_LAYER_RUN_FACTOR = 16


@dataclass(frozen=True, slots=True, eq=False)
class CopyPlan:
    """``runs``: ``(src_start, dst_start, length)`` slice copies; then rows
    ``gather_src`` of the source go to rows ``gather_dst`` of the destination."""

    runs: tuple[tuple[int, int, int], ...]
    gather_src: torch.Tensor | None
    gather_dst: torch.Tensor | None

    @property
    def rows(self) -> int:
        gathered = 0 if self.gather_src is None else int(self.gather_src.numel())
        return sum(r[2] for r in self.runs) + gathered


def plan_copies(src: torch.Tensor, dst: torch.Tensor, *, min_run: int = 1) -> CopyPlan:
    """Plan copying rows ``src[i] -> dst[i]`` for every i.

    Maximal runs consecutive on both sides of at least ``min_run`` rows become
    slices; the rest is gathered. Rows keep their pairing whatever the split.
    """
    n = int(src.numel())
    if n == 0:
        return CopyPlan((), None, None)
    if src.device.type == "cpu" and dst.device.type == "cpu":
        return _plan_copies_numpy(src.numpy(), dst.numpy(), min_run)
    if n == 1:
        if min_run <= 1:
            s, d = int(src[0]), int(dst[0])
            return CopyPlan(((s, d, 1),), None, None)
        return CopyPlan((), src, dst)
    step = (src[1:] - src[:-1] == 1) & (dst[1:] - dst[:-1] == 1)
    bounds = [0, *((~step).nonzero().flatten() + 1).tolist(), n]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    is_long = [length >= min_run for length in lengths]
    heads = [a for a, keep in zip(bounds, is_long) if keep]
    runs = tuple(
        zip(src[heads].tolist(), dst[heads].tolist(), [m for m, keep in zip(lengths, is_long) if keep])
    )
    if len(heads) == len(lengths):
        return CopyPlan(runs, None, None)
    short_rows = torch.tensor([not keep for keep in is_long]).repeat_interleave(torch.tensor(lengths))
    return CopyPlan(runs, src[short_rows], dst[short_rows])


def _plan_copies_numpy(src: np.ndarray, dst: np.ndarray, min_run: int) -> CopyPlan:
    """`plan_copies` of CPU indices, in numpy: the executor's thread plans
    with the GIL held (a torch operator lets it go, a switch interval beside
    a busy Python thread)."""
    n = src.size
    if n == 1:
        if min_run <= 1:
            return CopyPlan(((int(src[0]), int(dst[0]), 1),), None, None)
        return CopyPlan((), torch.from_numpy(src), torch.from_numpy(dst))
    step = (np.diff(src) == 1) & (np.diff(dst) == 1)
    bounds = [0, *(np.flatnonzero(~step) + 1).tolist(), n]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    is_long = [length >= min_run for length in lengths]
    heads = [a for a, keep in zip(bounds, is_long) if keep]
    runs = tuple(zip(src[heads].tolist(), dst[heads].tolist(), [m for m, keep in zip(lengths, is_long) if keep]))
    if len(heads) == len(lengths):
        return CopyPlan(runs, None, None)
    short_rows = np.repeat(~np.array(is_long), lengths)
    return CopyPlan(runs, torch.from_numpy(src[short_rows]), torch.from_numpy(dst[short_rows]))


def apply_copy_plan(plan: CopyPlan, src: torch.Tensor, dst: torch.Tensor, *, non_blocking: bool = False) -> None:
    """Copy rows of ``src`` into ``dst`` as ``plan`` says (dimension 0 is rows)."""
    for s, d, n in plan.runs:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)
    if plan.gather_src is not None:
        assert plan.gather_dst is not None
        dst.index_copy_(0, plan.gather_dst, src.index_select(0, plan.gather_src))


@dataclass(frozen=True, slots=True, eq=False)
class RowPlan:
    """Copy calls for rows ``src[i] -> dst[i]`` along a slot dimension.

    * ``slices``: ``(src_start, dst_start, n)``: a slice copy;
    * ``gathers``: ``(dst_start, n, src_rows)``: ``index_select`` of the
      source rows straight into ``n`` consecutive destination rows;
    * ``scatters``: ``(src_start, n, dst_rows)``: ``index_copy_`` of ``n``
      consecutive source rows;
    * ``staged``: ``(src_rows, dst_rows)``: a gather into a temporary, then
      one ``index_copy_``.

    The groups are disjoint and together hold every row exactly once.
    """

    slices: tuple[tuple[int, int, int], ...]
    gathers: tuple[tuple[int, int, torch.Tensor], ...]
    scatters: tuple[tuple[int, int, torch.Tensor], ...]
    staged: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def calls(self) -> int:
        """Copy calls per application (a staged group counts two)."""
        return len(self.slices) + len(self.gathers) + len(self.scatters) + (2 if self.staged is not None else 0)

    @property
    def rows(self) -> int:
        staged = 0 if self.staged is None else int(self.staged[0].numel())
        return (
            sum(s[2] for s in self.slices) + sum(g[1] for g in self.gathers)
            + sum(s[1] for s in self.scatters) + staged
        )


_NO_ROWS = RowPlan((), (), (), None)


class _Rows:
    """One side's indices and the positions where a group of consecutive
    values breaks (``idx[i] != idx[i-1] + 1``).

    Found in numpy over the tensor's own memory: no torch operator (each
    costs ~5 us warm and 25-85 us right after a large copy has flushed the
    caches, which is when the executor plans), and ~30 us at 512 rows
    against ~95 us for the same loop over Python lists."""

    __slots__ = ("breaks", "tensor", "values")

    def __init__(self, idx: torch.Tensor) -> None:
        self.tensor = idx
        self.values = idx.numpy()
        self.breaks: list[int] = (np.flatnonzero(np.diff(self.values) != 1) + 1).tolist()

    def at(self, positions: list[int]) -> list[int]:
        return self.values[positions].tolist()  # type: ignore[no-any-return]


def _sides(src: torch.Tensor, dst: torch.Tensor) -> tuple[_Rows, _Rows]:
    return _Rows(src), _Rows(dst)


def _groups(breaks: list[int], n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the groups that ``breaks`` cut ``0..n`` into."""
    bounds = [0, *breaks, n]
    return list(zip(bounds[:-1], bounds[1:]))


def _keep(
    src: torch.Tensor, dst: torch.Tensor, groups: list[tuple[int, int]], keep: list[bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the groups marked in ``keep``, in order."""
    mask = torch.tensor(keep).repeat_interleave(torch.tensor([b - a for a, b in groups]))
    return src[mask], dst[mask]


def plan_rows(src: torch.Tensor, dst: torch.Tensor, *, min_rows: int = 1, split_rows: int | None = None) -> RowPlan:
    """Plan copying rows ``src[i] -> dst[i]`` (int64 CPU tensors) in few calls.

    1. Each maximal group of rows consecutive in ``dst`` of at least
       ``min_rows`` rows (or the only group) is one call: a slice if its
       source rows are consecutive too, else a gather straight into it. With
       ``split_rows``, runs of at least that many rows consecutive in the
       source too are slices of their own inside such a group, and the rows
       between them gathers. (`PoolCopy` no longer asks for it: with rows as
       wide elements one gather beat strided slices of 32-128 KiB runs
       across stacked layers, 6.4 against 5.9 GB/s.)
    2. Of the rows left, each group consecutive in ``src`` of at least
       ``min_rows`` rows (or the only group) is one ``index_copy_``.
    3. The rest is gathered into a temporary and scattered in one go.
    """
    n = int(src.numel())
    if n == 0:
        return _NO_ROWS
    s_rows, d_rows = _sides(src, dst)
    groups = _groups(d_rows.breaks, n)
    whole = len(groups) == 1
    taken = [whole or b - a >= min_rows for a, b in groups]
    slices: list[tuple[int, int, int]] = []
    gathers: list[tuple[int, int, torch.Tensor]] = []
    if any(taken):
        chosen = [g for g, t in zip(groups, taken) if t]
        heads = [a for a, _ in chosen]
        s_breaks = s_rows.breaks
        k = 0  # s_breaks[k]: the first source break after the group's start
        for (a, b), s, d in zip(chosen, s_rows.at(heads), d_rows.at(heads)):
            while k < len(s_breaks) and s_breaks[k] <= a:
                k += 1
            if k == len(s_breaks) or s_breaks[k] >= b:
                slices.append((s, d, b - a))
            elif split_rows is None:
                gathers.append((d, b - a, src[a:b]))
            else:
                _split_group(src, a, b, d, s_rows, k, split_rows, slices, gathers)
        if len(chosen) == len(groups):
            return RowPlan(tuple(slices), tuple(gathers), (), None)
        src, dst = _keep(src, dst, groups, [not t for t in taken])
        n = int(src.numel())
        s_rows = _sides(src, dst)[0]
    groups = _groups(s_rows.breaks, n)
    whole = len(groups) == 1
    taken = [whole or b - a >= min_rows for a, b in groups]
    scatters: tuple[tuple[int, int, torch.Tensor], ...] = ()
    if any(taken):
        chosen = [g for g, t in zip(groups, taken) if t]
        starts = s_rows.at([a for a, _ in chosen])
        scatters = tuple((s, b - a, dst[a:b]) for (a, b), s in zip(chosen, starts))
        if len(chosen) == len(groups):
            return RowPlan(tuple(slices), tuple(gathers), scatters, None)
    return RowPlan(tuple(slices), tuple(gathers), scatters, _keep(src, dst, groups, [not t for t in taken]))


def _split_group(
    src: torch.Tensor, a: int, b: int, d: int, s_rows: _Rows, k: int, split_rows: int,
    slices: list[tuple[int, int, int]], gathers: list[tuple[int, int, torch.Tensor]],
) -> None:
    """Rows ``a..b-1`` (consecutive in the destination from row ``d``):
    source runs of at least ``split_rows`` rows as slices, the rows between
    them as gathers. ``s_rows.breaks[k]`` is the first source break after ``a``."""
    breaks = s_rows.breaks
    bounds = [a]
    while k < len(breaks) and breaks[k] < b:
        bounds.append(breaks[k])
        k += 1
    bounds.append(b)
    runs = list(zip(bounds[:-1], bounds[1:]))
    starts = s_rows.at([x for x, _ in runs])
    pending = a  # first row not yet planned
    for (x, y), s in zip(runs, starts):
        if y - x < split_rows:
            continue
        if x > pending:
            gathers.append((d + pending - a, x - pending, src[pending:x]))
        slices.append((s, d + x - a, y - x))
        pending = y
    if b > pending:
        gathers.append((d + pending - a, b - pending, src[pending:b]))


# Row elements as wide as a row's bytes and both tensors' strides allow: the
# same bytes, fewer elements. torch's CPU index kernels (``index_copy_``,
# ``index_put_``) cost per element: a 2 KiB bf16 row scattered as 128
# complex128 elements instead of 1,024 bf16 ones moves 2x faster (measured,
# torch 2.13 CPU, 512 rows x 32 layers: 2.6-3.1 against 5.6-6.6 GB/s); gathers
# lose little. A copy of any dtype moves its bits unchanged.
_WIDE_DTYPES = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16}
# Slices (``copy_``) are the exception: torch's copy kernel moves complex128
# elements slower than 8-byte ones (measured, torch 2.13 CPU, 512 rows of 2
# KiB x 32 layers across stacked layers: 3.72 against 3.15 ms, 4-byte and bf16
# 3.11-3.14; into page_first rows 3.83 against 3.72), so slices move at most
# this wide.
_SLICE_WIDTH = 8


def _row_width(t: torch.Tensor, dim: int) -> int:
    """The widest element (bytes) whose view of ``t`` keeps dimensions
    ``0..dim`` and makes each row one dimension; 0 when the row's dimensions
    are not one contiguous block."""
    size = t.element_size()
    expected = 1
    for n, stride in zip(reversed(t.shape[dim + 1 :]), reversed(t.stride()[dim + 1 :])):
        if n != 1 and stride != expected:
            return 0
        expected *= n
    row = expected * size
    outer = [stride * size for stride in t.stride()[: dim + 1]]
    offset = t.storage_offset() * size
    for width in _WIDE_DTYPES:
        if row % width == 0 and offset % width == 0 and all(o % width == 0 for o in outer) \
                and t.data_ptr() % width == 0:
            return width
    return size


def _as_width(t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """``t`` with each row (the dimensions after ``dim``) one dimension of
    ``width``-byte elements; ``width`` from `_row_width` of ``t``, or less.
    Unchanged for a width no wider than ``t``'s elements."""
    if width <= t.element_size() or t.numel() == 0:
        return t
    outer = t.shape[: dim + 1]
    row = t.numel() // math.prod(outer)
    return t.as_strided((*outer, row), (*t.stride()[: dim + 1], 1)).view(_WIDE_DTYPES[width])


def wide_rows(src: torch.Tensor, dst: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``src`` and ``dst`` (rows along ``dim``) as views of the same bytes
    with each row one dimension of the widest element both allow (see
    `_WIDE_DTYPES`); unchanged where a row is not one contiguous block or the
    two differ in dtype."""
    if src.dtype != dst.dtype or src.dim() != dst.dim():
        return src, dst
    width = min(_row_width(src, dim), _row_width(dst, dim))
    return _as_width(src, dim, width), _as_width(dst, dim, width)


# Wide views of the pools' tensors, made once per pool (the views keep no
# pool alive: the pool holds the tensors they view).
_WIDE: weakref.WeakKeyDictionary[object, dict[tuple[object, ...], object]] = weakref.WeakKeyDictionary()


def _memo(owner: object, key: tuple[object, ...], make: Callable[[], _T]) -> _T:
    memo = _WIDE.get(owner)
    if memo is None:
        memo = _WIDE.setdefault(owner, {})
    try:
        return memo[key]  # type: ignore[return-value]
    except KeyError:
        value = make()
        memo[key] = value
        return value


def _calls(plan: RowPlan) -> str:
    """``plan``'s calls as words: ``1 slice, 2 gathers, 1 staged``."""
    parts = [(len(plan.slices), "slice"), (len(plan.gathers), "gather"), (len(plan.scatters), "scatter"),
             (1 if plan.staged is not None else 0, "staged")]
    return ", ".join(f"{n} {word}{'s' if n > 1 and word != 'staged' else ''}" for n, word in parts if n) or "nothing"


def apply_row_plan(plan: RowPlan, src: torch.Tensor, dst: torch.Tensor, dim: int = 0) -> None:
    """Copy rows of ``src`` into ``dst`` as ``plan`` says; ``dim`` is the slot
    dimension (0 for one layer, 1 for a ``[layers, slots, ...]`` span). Rows
    move as wide elements where their layout allows (`wide_rows`)."""
    if dim not in (0, 1):
        raise ConfigurationError(f"the slot dimension is 0 (one layer) or 1 (a span of layers); got {dim}")
    src, dst = wide_rows(src, dst, dim)
    _apply_rows(plan, src, dst, dim)


def _apply_rows(
    plan: RowPlan, src: torch.Tensor, dst: torch.Tensor, dim: int,
    slice_src: torch.Tensor | None = None, slice_dst: torch.Tensor | None = None,
) -> None:
    """``plan``'s calls from ``src`` into ``dst``; its slices from ``slice_src``
    into ``slice_dst`` where given (the same bytes at `_SLICE_WIDTH`)."""
    if plan.slices and slice_src is not None and slice_dst is not None:
        _apply_slices(plan.slices, slice_src, slice_dst, dim)
    elif plan.slices:
        _apply_slices(plan.slices, src, dst, dim)
    # Basic slicing, not narrow(): ~1 us against ~1.7 us a view, paid twice per
    # slice copy, thousands of times for small pages copied layer by layer.
    if dim == 0:
        for d, n, rows in plan.gathers:
            torch.index_select(src, 0, rows, out=dst[d : d + n])
        for s, n, rows in plan.scatters:
            dst.index_copy_(0, rows, src[s : s + n])
    else:
        for d, n, rows in plan.gathers:
            torch.index_select(src, dim, rows, out=dst[:, d : d + n])
        for s, n, rows in plan.scatters:
            dst.index_copy_(dim, rows, src[:, s : s + n])
    if plan.staged is not None:
        src_rows, dst_rows = plan.staged
        dst.index_copy_(dim, dst_rows, src.index_select(dim, src_rows))


def _apply_slices(slices: Sequence[tuple[int, int, int]], src: torch.Tensor, dst: torch.Tensor, dim: int) -> None:
    if dim == 0:
        for s, d, n in slices:
            dst[d : d + n].copy_(src[s : s + n])
    else:
        for s, d, n in slices:
            dst[:, d : d + n].copy_(src[:, s : s + n])


# How a `CopyMethod` groups rows into calls (`PoolCopy.row_plan`): the fixed
# rules' crossovers (``fixed``), a slice per run consecutive on both sides
# (``runs``), or as few calls as the rows allow (``one``).
COPY_ROW_RULES = ("fixed", "runs", "one")


@dataclass(frozen=True, slots=True)
class CopyMethod:
    """One way to copy a pool's rows on the CPU: a ``path`` (``span``: one
    call per row group across stacked layers; ``stack``: runs stacked across
    layers into ``page_first`` host rows; ``layers``: layer by layer) and how
    its rows are grouped into calls (``rows``, one of `COPY_ROW_RULES`).
    Written ``path:rows``, e.g. ``span:one``."""

    path: str
    rows: str

    def __str__(self) -> str:
        return f"{self.path}:{self.rows}"

    @classmethod
    def parse(cls, text: str) -> CopyMethod | None:
        """The method written ``text``, or None when it names none."""
        path, _, rows = text.partition(":")
        if path not in ("span", "stack", "layers") or rows not in COPY_ROW_RULES:
            return None
        if path == "stack" and rows == "one":
            return None
        return cls(path, rows)


@dataclass(frozen=True, eq=False)
class PoolCopy:
    """The copies of one merged transfer: host rows <-> device rows of one pool.

    ``src_rows``/``dst_rows`` and the plans are oriented by direction: the
    source is the device for a backup and the host for a load. Plans are made
    on first use, in the thread that copies.
    """

    name: str
    host: HostPool
    device: DevicePool
    direction: Direction
    src_rows: torch.Tensor
    dst_rows: torch.Tensor
    min_run_bytes: int = 0

    @property
    def rows(self) -> int:
        return int(self.src_rows.numel())

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row of the pool's widest plane, in one layer."""
        return max(p.slot_nbytes for p in self.device.planes)

    def _min_rows(self, divisor: int, factor: int = 1) -> int:
        return max(1, -(-self.min_run_bytes * factor // (divisor * self.row_nbytes)))

    @cached_property
    def plan(self) -> CopyPlan:
        """Runs and one gather per layer and plane (the CUDA executor's plan)."""
        return plan_copies(self.src_rows, self.dst_rows, min_run=self._min_rows(1))

    @cached_property
    def wide(self) -> bool:
        """Whether every plane's rows move as elements wider than its dtype's
        (`wide_rows`): then per-layer index copies run at slice speed, and
        only runs of `WIDE_LAYER_RUN_FACTOR` x ``min_run_bytes`` get a call
        of their own."""
        return all(w > p.dtype.itemsize for w, p in zip(self.widths, self.device.planes))

    @cached_property
    def layer_plan(self) -> RowPlan:
        """Calls for one layer's ``[slots, ...]`` tensors."""
        factor = WIDE_LAYER_RUN_FACTOR if self.wide else 1
        return plan_rows(self.src_rows, self.dst_rows, min_rows=self._min_rows(1, factor))

    @cached_property
    def span_plan(self) -> RowPlan:
        """Calls for ``[layers, slots, ...]`` spans of stacked pools: rows
        consecutive in the destination in one call (a strided slice when the
        source rows are consecutive too, else one gather, which beats
        slicing the runs inside it: 6.4 against 5.9 GB/s at 32-128 KiB runs
        per layer, measured)."""
        return plan_rows(self.src_rows, self.dst_rows, min_rows=self._min_rows(STACKED_RUN_DIVISOR))

    @cached_property
    def stacked(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...] | None:
        """Per plane ``(src, dst)`` ``[layers, slots, ...]`` views, or None
        when the device's layers are not one storage."""
        dev = [self.device.stacked(p) for p in range(len(self.device.planes))]
        if any(v is None for v in dev):
            return None
        h = self.host
        # Memoized: a page_first host's stacked view is a transpose, a torch
        # operator that lets the GIL go (a switch interval beside a busy thread).
        host = [_memo(h, ("stacked", p), partial(h.stacked, p)) for p in range(len(self.device.planes))]
        backup = self.direction is Direction.BACKUP
        return tuple((d, h) if backup else (h, d) for d, h in zip(dev, host))  # type: ignore[misc]

    @cached_property
    def stack_plan(self) -> tuple[tuple[tuple[int, int, int], ...], RowPlan]:
        """Runs of at least ``STACK_RUN_FACTOR * min_run_bytes`` per layer,
        each one ``torch.stack`` across every layer into ``page_first`` host
        rows, and a per-layer `RowPlan` of the other rows."""
        runs = plan_copies(self.src_rows, self.dst_rows, min_run=self._min_rows(1) * STACK_RUN_FACTOR)
        if runs.gather_src is None or runs.gather_dst is None:
            return runs.runs, _NO_ROWS
        factor = WIDE_LAYER_RUN_FACTOR if self.wide else 1
        return runs.runs, plan_rows(runs.gather_src, runs.gather_dst, min_rows=self._min_rows(1, factor))

    @cached_property
    def path(self) -> str:
        """Which copy path the fixed rules take for every layer at once:
        ``span`` (one call per row group across the layers, both sides
        stacked), ``stack`` (runs stacked across separate layer tensors into
        ``page_first`` host rows, the rest per layer), ``layers`` (per layer),
        or ``device`` (a non-CPU device: the `CopyPlan` per layer)."""
        if self.device.device.type != "cpu":
            return "device"
        if self.stacked is not None and self.device.num_layers > 1:
            return "span"
        if (self.direction is Direction.BACKUP and self.host.layout == "page_first"
                and self.device.num_layers > 1):
            return "stack"
        return "layers"

    @cached_property
    def candidates(self) -> tuple[CopyMethod, ...]:
        """Every `CopyMethod` that can copy all of this pool's layers, the
        fixed rules' own first (empty on a non-CPU device). Each writes the
        same bytes; only their speed differs (`kvtier.transfers.calibration`
        times them)."""
        if self.path == "device":
            return ()
        fixed = CopyMethod(self.path, "fixed")
        out = [fixed]
        paths = ["layers"]
        if self.device.num_layers > 1:
            if self.stacked is not None:
                paths.insert(0, "span")
            if self.direction is Direction.BACKUP and self.host.layout == "page_first":
                paths.append("stack")
        for path in paths:
            for rows in COPY_ROW_RULES if path != "stack" else ("fixed", "runs"):
                m = CopyMethod(path, rows)
                if m != fixed:
                    out.append(m)
        return tuple(out)

    def row_plan(self, method: CopyMethod) -> RowPlan:
        """The `RowPlan` of ``method`` (for ``stack``: of the rows it leaves
        to per-layer copies), made once per copy."""
        plans = self._plans
        plan = plans.get(method)
        if plan is not None:
            return plan
        if method.path == "stack":
            plan = self._stack_plan(method.rows)[1]
        elif method.rows == "fixed":
            plan = self.span_plan if method.path == "span" else self.layer_plan
        elif method.rows == "runs":
            # Every run consecutive on both sides a slice of its own.
            plan = plan_rows(self.src_rows, self.dst_rows, min_rows=1, split_rows=1)
        else:
            # As few calls as the rows allow: one gather, scatter or staged copy.
            plan = plan_rows(self.src_rows, self.dst_rows, min_rows=self.rows + 1)
        plans[method] = plan
        return plan

    @cached_property
    def _plans(self) -> dict[CopyMethod, RowPlan]:
        return {}

    def _stack_plan(self, rows: str) -> tuple[tuple[tuple[int, int, int], ...], RowPlan]:
        if rows == "fixed":
            return self.stack_plan
        return self._stack_every_run

    @cached_property
    def _stack_every_run(self) -> tuple[tuple[tuple[int, int, int], ...], RowPlan]:
        """Every run consecutive on both sides one ``torch.stack``."""
        return plan_copies(self.src_rows, self.dst_rows, min_run=1).runs, _NO_ROWS

    def describe(self, method: CopyMethod | None = None) -> str:
        """``method`` (default: the fixed rules' path) as a short label: the
        path, the row element width in bytes and the calls of its plan, e.g.
        ``span/16B: 1 gather`` or ``stack/2B: 1 stack``."""
        path = self.path if method is None else method.path
        if path == "device":
            p = self.plan
            return f"device: {len(p.runs)} slices" + (", 1 gather" if p.gather_src is not None else "")
        method = method or CopyMethod(path, "fixed")
        width = max(self.widths) if self.widths else 0
        if path == "stack":
            runs, rest = self._stack_plan(method.rows)
            size = self.device.planes[0].dtype.itemsize
            text = f"stack/{size}B: {len(runs)} stack{'s' if len(runs) != 1 else ''}"
            return text + (f", layers/{width}B: {_calls(rest)}" if rest.rows else "")
        return f"{path}/{width}B: {_calls(self.row_plan(method))}"

    def copy_pool_layers(self, layers: Sequence[int], method: CopyMethod | None = None) -> None:
        """Copy pool layers ``layers`` (distinct) of every plane with
        ``method`` (one of `candidates`; default or not applicable to these
        layers: the fixed rules). ``span`` copies one call per row group across
        the layers (both sides stacked, the layers one range); ``stack`` (a
        backup of every layer into a ``page_first`` host) copies runs in one
        ``torch.stack`` each (writing host rows in order), the rest per layer;
        ``layers`` copies layer by layer. Every method writes the same bytes."""
        if not layers:
            return
        if self.device.device.type != "cpu":
            # Gathers need the index where the tensor is: plain per-layer copies.
            for j in layers:
                for p in range(len(self.device.planes)):
                    host, dev = self.host.layer_view(j, p), self.device.tensor(j, p)
                    if self.direction is Direction.BACKUP:
                        apply_copy_plan(self.plan, dev, host)
                    else:
                        apply_copy_plan(self.plan, host, dev)
            return
        if method is not None and not self._applies(method, layers):
            method = None
        if method is None:
            method = self._fixed_for(layers)
        if method.path == "span":
            self._copy_span(self.row_plan(method), min(layers), max(layers))
            return
        plan = self.row_plan(method)
        if method.path == "stack":
            # The stacks at the dtype's own width: measured faster than wide
            # elements (5.9 against 5.3 GB/s); the rest per layer, wide.
            self._copy_stacks(self._stack_plan(method.rows)[0], min(layers), max(layers))
            if not plan.rows:
                return
        self._copy_layers(plan, layers)

    def rows_between(self, start: int, stop: int) -> PoolCopy:
        """The copy of rows ``start..stop-1`` of this one (in its order)."""
        return PoolCopy(self.name, self.host, self.device, self.direction, self.src_rows[start:stop],
                        self.dst_rows[start:stop], self.min_run_bytes)

    def tail(self, start: int) -> PoolCopy:
        """The copy of this one's rows from ``start`` on."""
        return self.rows_between(start, self.rows)

    def _fixed_for(self, layers: Sequence[int]) -> CopyMethod:
        """The fixed rules' method for ``layers``: as `path`, where it applies."""
        if len(layers) > 1 and self.stacked is not None:
            if max(layers) - min(layers) + 1 == len(layers):
                return CopyMethod("span", "fixed")
            return CopyMethod("layers", "fixed")
        if len(layers) > 1 and self._applies(CopyMethod("stack", "fixed"), layers):
            return CopyMethod("stack", "fixed")
        return CopyMethod("layers", "fixed")

    def _applies(self, method: CopyMethod, layers: Sequence[int]) -> bool:
        """Whether ``method`` can copy ``layers``: ``span`` and ``stack``
        need them to be one range (any length), ``span`` both sides stacked,
        ``stack`` a backup into a ``page_first`` host."""
        if method.path == "layers":
            return True
        if max(layers) - min(layers) + 1 != len(layers):
            return False
        if method.path == "span":
            return self.stacked is not None
        return method.path == "stack" and self.direction is Direction.BACKUP and self.host.layout == "page_first"

    def _copy_span(self, plan: RowPlan, lo: int, hi: int) -> None:
        backup = self.direction is Direction.BACKUP
        widths = self.widths
        for p in range(len(self.device.planes)):
            w = widths[p]
            dev, host = self._device_stacked(p, w), self._host_stacked(p, w)
            src, dst = (dev, host) if backup else (host, dev)
            if plan.slices and w > _SLICE_WIDTH:
                sdev, shost = self._device_stacked(p, _SLICE_WIDTH), self._host_stacked(p, _SLICE_WIDTH)
                ssrc, sdst = (sdev, shost) if backup else (shost, sdev)
                _apply_rows(plan, src[lo : hi + 1], dst[lo : hi + 1], 1, ssrc[lo : hi + 1], sdst[lo : hi + 1])
            else:
                _apply_rows(plan, src[lo : hi + 1], dst[lo : hi + 1], 1)

    def _copy_stacks(self, runs: tuple[tuple[int, int, int], ...], lo: int, hi: int) -> None:
        """Each run of layers ``lo..hi`` one ``torch.stack`` into the host rows."""
        every = lo == 0 and hi == self.device.num_layers - 1
        for p in range(len(self.device.planes)):
            tensors = [self.device.tensor(j, p) for j in range(lo, hi + 1)]
            buf = self.host.buffer(p) if every else self.host.buffer(p)[:, lo : hi + 1]
            for s, d, n in runs:
                torch.stack([t[s : s + n] for t in tensors], 1, out=buf[d : d + n])

    def _copy_layers(self, plan: RowPlan, layers: Sequence[int]) -> None:
        backup = self.direction is Direction.BACKUP
        widths = self.widths
        for p in range(len(self.device.planes)):
            w = widths[p]
            devs, hosts = self._device_layers(p, w), self._host_layers(p, w)
            if plan.slices and w > _SLICE_WIDTH:
                sdevs, shosts = self._device_layers(p, _SLICE_WIDTH), self._host_layers(p, _SLICE_WIDTH)
                for j in layers:
                    if backup:
                        _apply_rows(plan, devs[j], hosts[j], 0, sdevs[j], shosts[j])
                    else:
                        _apply_rows(plan, hosts[j], devs[j], 0, shosts[j], sdevs[j])
                continue
            for j in layers:
                if backup:
                    _apply_rows(plan, devs[j], hosts[j], 0)
                else:
                    _apply_rows(plan, hosts[j], devs[j], 0)

    @cached_property
    def widths(self) -> tuple[int, ...]:
        """Per plane, the widest element (bytes) that every view of both
        sides this copy may use allows (see `wide_rows`); worked out once per
        pool."""
        return tuple(min(self._device_width(p), self._host_width(p)) for p in range(len(self.device.planes)))

    def _device_width(self, p: int) -> int:
        def make() -> int:
            d = self.device
            views = [(d.tensor(j, p), 0) for j in range(d.num_layers)]
            stacked = d.stacked(p)
            if stacked is not None:
                views.append((stacked, 1))
            return min(_row_width(t, dim) for t, dim in views)

        return _memo(self.device, ("width", p), make)

    def _host_width(self, p: int) -> int:
        def make() -> int:
            h = self.host
            views = [(h.layer_view(j, p), 0) for j in range(h.num_layers)]
            views += [(h.stacked(p), 1), (h.buffer(p), 1)]
            return min(_row_width(t, dim) for t, dim in views)

        return _memo(self.host, ("width", p), make)

    def _device_layers(self, p: int, width: int) -> list[torch.Tensor]:
        """Every layer of plane ``p`` at ``width``-byte elements (one lookup a batch)."""
        d = self.device
        return _memo(d, ("layers", p, width),
                     lambda: [_as_width(d.tensor(j, p), 0, width) for j in range(d.num_layers)])

    def _host_layers(self, p: int, width: int) -> list[torch.Tensor]:
        h = self.host
        return _memo(h, ("layers", p, width),
                     lambda: [_as_width(h.layer_view(j, p), 0, width) for j in range(h.num_layers)])

    def _device_stacked(self, p: int, width: int) -> torch.Tensor:
        """``[layers, slots, ...]`` of plane ``p`` at ``width``-byte elements."""
        def make() -> torch.Tensor:
            t = self.device.stacked(p)
            assert t is not None  # the span path runs only for stacked pools
            return _as_width(t, 1, width)

        return _memo(self.device, ("stacked", p, width), make)

    def _host_stacked(self, p: int, width: int) -> torch.Tensor:
        return _memo(self.host, ("stacked", p, width), lambda: _as_width(self.host.stacked(p), 1, width))


@dataclass(frozen=True, slots=True, eq=False)
class BatchPlan:
    direction: Direction
    num_layers: int
    merged: tuple[MergedTransfer, ...]
    copies: tuple[PoolCopy, ...]

    def layer_copies(self, layer: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, CopyPlan]]:
        """``(src, dst, plan)`` for every pool and plane that transfer ``layer`` moves."""
        backup = self.direction is Direction.BACKUP
        for c in self.copies:
            j = c.device.pool_layer(layer)
            if j is None:
                continue
            for p in range(len(c.device.planes)):
                host = c.host.layer_view(j, p)
                dev = c.device.tensor(j, p)
                yield (dev, host, c.plan) if backup else (host, dev, c.plan)

    def copy_layers(
        self, start: int, stop: int, copies: Sequence[PoolCopy] | None = None,
        copy: Callable[[PoolCopy, Sequence[int]], None] | None = None,
    ) -> None:
        """Copy transfer layers ``start..stop-1`` of ``copies`` (default: every
        pool), byte for byte as `layer_copies` would; every layer of the range
        has landed when it returns, none of them before. ``copy(pool_copy,
        pool_layers)`` copies each pool (e.g. `CopyCalibrator.copy`, with the
        method measured fastest); without it the fixed rules choose."""
        for c in self.copies if copies is None else copies:
            pool_layers = [j for t in range(start, stop) if (j := c.device.pool_layer(t)) is not None]
            if copy is None or not pool_layers:
                c.copy_pool_layers(pool_layers)
            else:
                copy(c, pool_layers)

    def layer_group(self) -> int:
        """Transfer layers per group when someone waits on layers: groups of
        at least `LAYER_GROUP_BYTES` (all layers for a small batch)."""
        if self.num_layers <= 1:
            return 1
        per_layer = max(1, self.nbytes // self.num_layers)
        return max(1, min(self.num_layers, -(-LAYER_GROUP_BYTES // per_layer)))

    @property
    def nbytes(self) -> int:
        return sum(c.rows * c.host.slot_nbytes for c in self.copies)


def plan_batch(
    direction: Direction,
    operations: Sequence[CacheOperation],
    group: PoolGroup,
    *,
    min_run_bytes: int = 0,
) -> BatchPlan:
    """Merge the operations' transfers, derive sidecar rows and plan the copies.

    ``min_run_bytes`` (per layer and plane, rows of the pool's widest plane)
    sets the crossovers: in `CopyPlan` a run becomes a slice copy when it
    moves at least that much, 0 making every run a slice; in `RowPlan` a
    group of rows gets its own call when it moves that much per layer (a
    `STACKED_RUN_DIVISOR`-th of it for copies across stacked layers).
    """
    sidecars = {p.name: p.sidecar for p in group if p.sidecar is not None}
    merged = merge_transfers([op.transfers for op in operations], sidecars)
    copies = []
    for m in merged:
        spec = group[m.name]
        if isinstance(spec.host, LogicalHostPool) or spec.device is None:
            continue  # an anchor without bytes: nothing to copy
        if not m.rows:
            continue  # every row cut by its valid counts (`PoolTransfer.valid`): nothing holds data
        if direction is Direction.BACKUP:
            src, dst = m.device_indices, m.host_indices
        else:
            src, dst = m.host_indices, m.device_indices
        copies.append(PoolCopy(m.name, spec.host, spec.device, direction, src, dst, min_run_bytes))
    return BatchPlan(direction, group.num_layers, merged, tuple(copies))
