"""Every CPU copy path, byte for byte, and the order in which layers are reported.

The copy paths (`BatchPlan.copy_layers`): one call per row group across every
layer when the engine's tensors are one storage (`DevicePool.stacked`), a
``torch.stack`` across separate layer tensors into ``page_first`` host rows,
and per-layer copies; within each, slices, gathers straight into the
destination, scatters from consecutive source rows, and staged gathers
(`plan_rows`). References are computed here by plain indexing, layer by
layer, independently of the code under test.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.transfers.plan as plan_module
from kvtier.pools import DevicePool, PoolGroup
from kvtier.scheduler import TransferScheduler
from kvtier.transfers import (
    Batch,
    CacheOperation,
    CpuExecutor,
    Direction,
    LayerProgress,
    PoolCopy,
    PoolTransfer,
    apply_row_plan,
    plan_batch,
    plan_rows,
    process_calibrator,
    run_batch_copies,
)

LAYERS = 4
DEVICES = ("stacked_layer_first", "stacked_slot_first", "per_layer")
LAYOUTS = ("layer_first", "page_first")

# ---------------------------------------------------------------------------
# pools built the ways engines allocate them


def engine_tensors(
    kind: str, layers: int, slots: int, planes: Sequence[tuple[int, ...]], dtype: torch.dtype, gen: torch.Generator
) -> list[list[torch.Tensor]]:
    """Random per-layer, per-plane ``[slots, ...]`` tensors, allocated as ``kind``:

    * ``stacked_layer_first``: one ``[layers, slots, ...]`` tensor per plane;
    * ``stacked_slot_first``: one ``[slots, layers, ...]`` tensor per plane;
    * ``per_layer``: a separate tensor per layer and plane.
    """

    def rand(shape: tuple[int, ...]) -> torch.Tensor:
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen).to(dtype)
        return torch.randint(-100, 100, shape, generator=gen, dtype=dtype)

    if kind == "per_layer":
        return [[rand((slots, *shape)) for shape in planes] for _ in range(layers)]
    if kind == "stacked_layer_first":
        bufs = [rand((layers, slots, *shape)) for shape in planes]
        return [[b[j] for b in bufs] for j in range(layers)]
    assert kind == "stacked_slot_first"
    bufs = [rand((slots, layers, *shape)) for shape in planes]
    return [[b[:, j] for b in bufs] for j in range(layers)]


def make_group(device: str, layout: str, page_size: int, *, pages: int = 12, seed: int = 0) -> PoolGroup:
    """``kv`` (K and V, every layer), ``swa`` (every other transfer layer:
    a layer_map with None), and ``c4``, a sidecar of ``kv`` with 2 rows per
    page and a layer_map with None; each allocated as ``device``."""
    gen = torch.Generator().manual_seed(seed)
    slots = pages * page_size
    group = PoolGroup()
    kv = DevicePool(engine_tensors(device, LAYERS, slots, [(2, 8), (2, 8)], torch.bfloat16, gen))
    swa = DevicePool(
        engine_tensors(device, LAYERS // 2, slots, [(3,)], torch.float32, gen),
        layer_map=[0, None, 1, None],
    )
    c4 = DevicePool(
        engine_tensors(device, LAYERS - 1, pages * 2, [(4,)], torch.int16, gen),
        layer_map=[None, 0, 1, 2],
    )
    lay: Any = layout
    group.add_pool("kv", device=kv, page_size=page_size, host_slots=slots, layout=lay, pin_memory=False)
    group.add_pool("swa", device=swa, page_size=page_size, host_slots=slots, layout=lay, pin_memory=False)
    group.add_sidecar("c4", source="kv", rows_per_page=2, device=c4, layout=lay, pin_memory=False)
    for spec in group:
        assert spec.device is not None
        assert (spec.device.stacked(0) is not None) == (device != "per_layer")
        for p in range(len(spec.device.planes)):
            spec.host.buffer(p).zero_()  # type: ignore[union-attr]
    return group


def slots_of(pages: Sequence[int], page_size: int) -> torch.Tensor:
    return torch.tensor([p * page_size + i for p in pages for i in range(page_size)], dtype=torch.int64)


def sidecar_rows(pages: Sequence[int], k: int) -> torch.Tensor:
    return torch.tensor([p * k + i for p in pages for i in range(k)], dtype=torch.int64)


# Page choices: (host pages, device pages) per operation.
PATTERNS: dict[str, list[tuple[list[int], list[int]]]] = {
    # One operation, consecutive on both sides: one run.
    "contiguous": [([0, 1, 2, 3], [2, 3, 4, 5])],
    # Host pages one range, device pages scattered: gathers (backup), scatters (load).
    "scattered": [([0, 1, 2, 3, 4], [9, 2, 7, 0, 5])],
    # Both scattered, two operations merged: staged rows, short runs.
    "fragmented": [([5, 1], [3, 8]), ([9, 0, 7], [1, 11, 6])],
    # Runs of two pages between scattered pages.
    "mixed": [([0, 1, 2, 3, 6], [4, 5, 10, 11, 0])],
}


def operations(direction: Direction, spec: list[tuple[list[int], list[int]]], page_size: int) -> list[CacheOperation]:
    ops = []
    for i, (h, d) in enumerate(spec):
        transfers = (
            PoolTransfer("kv", slots_of(h, page_size), slots_of(d, page_size)),
            PoolTransfer("swa", slots_of(h, page_size), slots_of(d, page_size)),
            PoolTransfer("c4", None, None, indices_from_pool="kv"),
        )
        ops.append(CacheOperation(i, direction, transfers, 0, 0))
    return ops


def pool_rows(spec: list[tuple[list[int], list[int]]], page_size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(host rows, device rows) each pool moves, from the page lists."""
    h = [p for hp, _ in spec for p in hp]
    d = [p for _, dp in spec for p in dp]
    return {
        "kv": (slots_of(h, page_size), slots_of(d, page_size)),
        "swa": (slots_of(h, page_size), slots_of(d, page_size)),
        "c4": (sidecar_rows(h, 2), sidecar_rows(d, 2)),
    }


def snapshot(group: PoolGroup, side: str) -> dict[tuple[str, int, int], torch.Tensor]:
    out = {}
    for s in group:
        assert s.device is not None
        for j in range(s.device.num_layers):
            for p in range(len(s.device.planes)):
                t = s.device.tensor(j, p) if side == "device" else s.host.layer_view(j, p)
                out[s.name, j, p] = t.clone()
    return out


def assert_same(got: dict[tuple[str, int, int], torch.Tensor], want: dict[tuple[str, int, int], torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, expected in want.items():
        assert got[key].dtype == expected.dtype
        assert torch.equal(got[key], expected), key


def run(group: PoolGroup, direction: Direction, spec: list[tuple[list[int], list[int]]], page_size: int,
        min_run_bytes: int) -> None:
    batch = Batch(1, direction, operations(direction, spec, page_size), group, min_run_bytes=min_run_bytes)
    progress = LayerProgress(batch.num_layers)
    run_batch_copies(batch, progress)
    assert progress.layers_done == LAYERS


# ---------------------------------------------------------------------------
# byte-exact round trips through every path


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
# 1: every group of rows its own call; 16 KiB: the scheduler's default; 1 GiB: gathers and staging only.
@pytest.mark.parametrize("min_run_bytes", [1, 16 * 1024, 1 << 30])
def test_backup_then_load_is_byte_exact(
    device: str, layout: str, page_size: int, pattern: str, min_run_bytes: int
) -> None:
    group = make_group(device, layout, page_size)
    spec = PATTERNS[pattern]
    moved = pool_rows(spec, page_size)
    dev_before = snapshot(group, "device")

    host_want = snapshot(group, "host")
    for (name, j, p), t in host_want.items():
        h, d = moved[name]
        t[h] = dev_before[name, j, p][d]
    run(group, Direction.BACKUP, spec, page_size, min_run_bytes)
    assert_same(snapshot(group, "host"), host_want)  # every host row, moved or not
    assert_same(snapshot(group, "device"), dev_before)  # a backup only reads the device

    # Load back, into a wiped device: the moved rows return, nothing else changes.
    for s in group:
        assert s.device is not None
        for j in range(s.device.num_layers):
            for p in range(len(s.device.planes)):
                s.device.tensor(j, p).zero_()
    dev_want = {key: torch.zeros_like(t) for key, t in dev_before.items()}
    for (name, j, p), t in dev_want.items():
        _, d = moved[name]
        t[d] = dev_before[name, j, p][d]
    run(group, Direction.LOAD, spec, page_size, min_run_bytes)
    assert_same(snapshot(group, "device"), dev_want)
    assert_same(snapshot(group, "host"), host_want)  # a load only reads the host


def _plans(
    group: PoolGroup, direction: Direction, pattern: str, page_size: int, min_run_bytes: int
) -> dict[str, PoolCopy]:
    plan = plan_batch(direction, operations(direction, PATTERNS[pattern], page_size), group,
                      min_run_bytes=min_run_bytes)
    return {c.name: c for c in plan.copies}


def test_the_paths_above_are_the_ones_meant() -> None:
    """The round trips above go through each kind of call (so a planner that
    quietly staged everything would not pass unnoticed)."""
    # Stacked backup of scattered pages into a host range: one gather across all layers.
    kv = _plans(make_group("stacked_layer_first", "layer_first", 16), Direction.BACKUP, "scattered", 16, 16384)["kv"]
    assert kv.stacked is not None
    assert (len(kv.span_plan.slices), len(kv.span_plan.gathers)) == (0, 1) and kv.span_plan.calls == 1
    # The load of those pages: one slice per page where a page (16 rows of 32 bytes) is
    # worth a call across the layers (min_run_bytes / STACKED_RUN_DIVISOR = 256 bytes) ...
    kv = _plans(make_group("stacked_layer_first", "layer_first", 16), Direction.LOAD, "scattered", 16, 1024)["kv"]
    assert len(kv.span_plan.slices) == 5 and kv.span_plan.calls == 5
    # ... while per layer (1024 bytes) it is not: one scatter from the host range.
    assert (len(kv.layer_plan.slices), len(kv.layer_plan.scatters)) == (0, 1)
    # Page size 1: one-row pages are not worth a call each, one scatter from the host range.
    kv = _plans(make_group("per_layer", "layer_first", 1), Direction.LOAD, "scattered", 1, 16384)["kv"]
    assert kv.stacked is None
    assert (len(kv.layer_plan.slices), len(kv.layer_plan.scatters)) == (0, 1) and kv.layer_plan.staged is None
    # Both sides scattered: staged.
    kv = _plans(make_group("per_layer", "page_first", 1), Direction.BACKUP, "fragmented", 1, 16384)["kv"]
    assert kv.layer_plan.staged is not None
    # Separate layer tensors into a page_first host: long runs are stacked across layers.
    kv = _plans(make_group("per_layer", "page_first", 64), Direction.BACKUP, "contiguous", 64, 1024)["kv"]
    runs, rest = kv.stack_plan
    assert runs == ((128, 0, 256),) and rest.rows == 0
    # Sidecar rows derive from kv's pages, and follow the same paths.
    c4 = _plans(make_group("stacked_slot_first", "page_first", 16), Direction.BACKUP, "mixed", 16, 1)["c4"]
    assert c4.stacked is not None and c4.span_plan.rows == 10


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
async def test_scheduler_round_trip_with_the_cpu_executor(device: str, layout: str) -> None:
    page_size = 16
    group = make_group(device, layout, page_size, pages=16)
    dev_pages = [7, 2, 3, 12, 0]
    dev = slots_of(dev_pages, page_size)
    want = {name: [group[name].device.tensor(j, p)[rows].clone()  # type: ignore[union-attr]
                   for j in range(group[name].device.num_layers)  # type: ignore[union-attr]
                   for p in range(len(group[name].device.planes))]  # type: ignore[union-attr]
            for name, rows in (("kv", dev), ("swa", dev), ("c4", sidecar_rows(dev_pages, 2)))}
    executor = CpuExecutor()
    async with TransferScheduler(group, executor=executor) as sched:
        b = await sched.backup({"kv": dev, "swa": dev})
        await b
        for s in group:
            for j in range(s.device.num_layers):  # type: ignore[union-attr]
                for p in range(len(s.device.planes)):  # type: ignore[union-attr]
                    s.device.tensor(j, p).zero_()  # type: ignore[union-attr]
        target_pages = [1, 4, 5, 6, 15]
        target = slots_of(target_pages, page_size)
        host = {name: b.host_indices[name] for name in ("kv", "swa")}  # c4's rows derive from kv's
        load = await sched.load(host, {"kv": target, "swa": target})
        await load
    stats = executor.statistics()
    assert stats.batches == 2
    assert stats.nbytes == b.nbytes + load.nbytes
    assert 0 < stats.max_batch_seconds <= stats.worker_seconds
    for name, rows in (("kv", target), ("swa", target), ("c4", sidecar_rows(target_pages, 2))):
        d = group[name].device
        assert d is not None
        got = [d.tensor(j, p)[rows] for j in range(d.num_layers) for p in range(len(d.planes))]
        assert all(torch.equal(a, b) for a, b in zip(got, want[name], strict=True)), name


# ---------------------------------------------------------------------------
# layer reporting


class CheckingProgress(LayerProgress):
    """Checks, inside each ``layer_done(t)``, that transfer layer t of every
    pool holds its final bytes, and records the calls."""

    def __init__(self, group: PoolGroup, direction: Direction, want: dict[tuple[str, int, int], torch.Tensor],
                 moved: dict[str, tuple[torch.Tensor, torch.Tensor]], watched: bool) -> None:
        super().__init__(group.num_layers)
        self.group = group
        self.direction = direction
        self.want = want
        self.moved = moved
        self.watched = watched
        self.calls: list[int] = []
        self.next_layer_landed: list[bool] = []

    def _landed(self, t: int) -> bool:
        ok = True
        for s in self.group:
            assert s.device is not None
            j = s.device.pool_layer(t)
            if j is None:
                continue
            h, d = self.moved[s.name]
            for p in range(len(s.device.planes)):
                if self.direction is Direction.BACKUP:
                    got = s.host.layer_view(j, p)[h]
                else:
                    got = s.device.tensor(j, p)[d]
                ok = ok and torch.equal(got, self.want[s.name, j, p])
        return ok

    def layer_done(self, layer: int) -> None:
        assert self._landed(layer), f"layer {layer} reported before its bytes landed"
        self.calls.append(layer)
        if layer + 1 < self.num_layers:
            self.next_layer_landed.append(self._landed(layer + 1))
        super().layer_done(layer)


def _reporting_case(device: str, layout: str, direction: Direction) -> tuple[PoolGroup, Batch, CheckingProgress]:
    page_size = 16
    group = make_group(device, layout, page_size)
    spec = PATTERNS["mixed"]
    moved = pool_rows(spec, page_size)
    if direction is Direction.LOAD:
        # Host rows to load: fill the host from a backup first, then wipe the device.
        run(group, Direction.BACKUP, spec, page_size, 16384)
        for s in group:
            for j in range(s.device.num_layers):  # type: ignore[union-attr]
                for p in range(len(s.device.planes)):  # type: ignore[union-attr]
                    s.device.tensor(j, p).zero_()  # type: ignore[union-attr]
        want = {(s.name, j, p): s.host.layer_view(j, p)[moved[s.name][0]].clone()
                for s in group for j in range(s.device.num_layers)  # type: ignore[union-attr]
                for p in range(len(s.device.planes))}  # type: ignore[union-attr]
    else:
        want = {(s.name, j, p): s.device.tensor(j, p)[moved[s.name][1]].clone()  # type: ignore[union-attr]
                for s in group for j in range(s.device.num_layers)  # type: ignore[union-attr]
                for p in range(len(s.device.planes))}  # type: ignore[union-attr]
    batch = Batch(2, direction, operations(direction, spec, page_size), group, min_run_bytes=16384)
    return group, batch, CheckingProgress(group, direction, want, moved, watched=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", [Direction.BACKUP, Direction.LOAD])
@pytest.mark.parametrize("group_bytes", [None, 1, 8000])
def test_each_layer_is_reported_once_in_order_after_its_bytes_landed(
    device: str, layout: str, direction: Direction, group_bytes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``None``: nobody watches, every layer is copied at once and reported
    after; 1: watched, groups of one layer; 8000: watched, groups of two."""
    if group_bytes is not None:
        monkeypatch.setattr("kvtier.transfers.plan.LAYER_GROUP_BYTES", group_bytes)
    _, batch, progress = _reporting_case(device, layout, direction)
    progress.watched = group_bytes is not None
    if group_bytes == 8000:
        assert batch.plan().layer_group() == 2  # 22,640 bytes in 4 layers: two per 8,000
    run_batch_copies(batch, progress)
    assert progress.calls == list(range(LAYERS))
    assert progress.layers_done == LAYERS
    if group_bytes is None:
        # Copied at once: each next layer had landed too.
        assert progress.next_layer_landed == [True] * (LAYERS - 1)
    elif group_bytes == 1:
        # One layer per group: the next layer lands only after this one was reported.
        # (Transfer layer 1 of this group moves kv and c4: not yet there at layer 0's report.)
        assert progress.next_layer_landed == [False] * (LAYERS - 1)
    else:
        assert progress.next_layer_landed == [True, False, True]


def test_watched_is_read_before_each_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor decides before each group whether to copy layer by layer
    (someone waits) or the rest at once: here the waiter is gone after
    layer 0, so layers 1..3 are copied together and reported after."""
    monkeypatch.setattr("kvtier.transfers.plan.LAYER_GROUP_BYTES", 1)
    _, batch, progress = _reporting_case("stacked_layer_first", "page_first", Direction.BACKUP)
    progress.watched = True
    original = progress.layer_done

    def layer_done(layer: int) -> None:
        original(layer)
        progress.watched = False

    progress.layer_done = layer_done  # type: ignore[method-assign]
    run_batch_copies(batch, progress)
    assert progress.calls == list(range(LAYERS))
    assert progress.next_layer_landed == [False, True, True]


# ---------------------------------------------------------------------------
# stacked views


def test_stacked_view_of_layer_first_and_slot_first_storage() -> None:
    buf = torch.randn(3, 10, 2, 4)
    pool = DevicePool([buf[j] for j in range(3)])
    view = pool.stacked(0)
    assert view is not None and view.data_ptr() == buf.data_ptr() and torch.equal(view, buf)
    slot_first = torch.randn(10, 3, 2, 4)
    pool = DevicePool([slot_first[:, j] for j in range(3)])
    view = pool.stacked(0)
    assert view is not None and view.shape == (3, 10, 2, 4) and torch.equal(view, slot_first.transpose(0, 1))
    view[1, 2] = 7.0  # the very memory of the engine's tensors
    assert bool((pool.tensor(1, 0)[2] == 7.0).all())


def test_stacked_view_of_k_and_v_in_one_buffer() -> None:
    buf = torch.randn(3, 2, 10, 5)  # [layers, K/V, slots, ...]
    pool = DevicePool([[buf[j, 0], buf[j, 1]] for j in range(3)])
    assert torch.equal(pool.stacked(0), buf[:, 0])  # type: ignore[arg-type]
    assert torch.equal(pool.stacked(1), buf[:, 1])  # type: ignore[arg-type]
    assert "stacked" in repr(pool)


def test_no_stacked_view_where_layers_are_not_one_evenly_spaced_storage() -> None:
    assert DevicePool([torch.randn(10, 4) for _ in range(3)]).stacked(0) is None  # separate allocations
    buf = torch.randn(4, 10, 4)
    assert DevicePool([buf[0], buf[2], buf[3]]).stacked(0) is None  # uneven spacing
    assert DevicePool([buf[1], buf[0]]).stacked(0) is None  # descending
    assert DevicePool([buf[0], buf[0]]).stacked(0) is None  # the same layer twice
    flat = torch.randn(100)
    overlapping = [flat[2 * j : 2 * j + 20].view(10, 2) for j in range(4)]  # layer j+1 starts inside layer j
    assert DevicePool(overlapping).stacked(0) is None
    mixed = DevicePool([[buf[j], torch.randn(10, 4)] for j in range(3)])
    assert mixed.stacked(0) is not None and mixed.stacked(1) is None
    assert "stacked" not in repr(mixed)


def test_one_layer_and_sliced_slots_stack_too() -> None:
    one = torch.randn(10, 3)
    view = DevicePool([one]).stacked(0)
    assert view is not None and view.shape == (1, 10, 3) and view.data_ptr() == one.data_ptr()
    buf = torch.randn(3, 12, 4)
    view = DevicePool([buf[j, :10] for j in range(3)]).stacked(0)  # fewer slots than the buffer has
    assert view is not None and torch.equal(view, buf[:, :10])


def test_host_pool_stacked_view_whatever_the_layout() -> None:
    for layout in LAYOUTS:
        group = make_group("per_layer", layout, 1)
        host = group["kv"].host
        view = host.stacked(0)  # type: ignore[union-attr]
        assert view.shape[0] == LAYERS
        for j in range(LAYERS):
            assert view[j].data_ptr() == host.layer_view(j, 0).data_ptr()
            assert view[j].stride() == host.layer_view(j, 0).stride()


# ---------------------------------------------------------------------------
# plan_rows, property-based


@st.composite
def row_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    src_slots = draw(st.integers(1, 48))
    dst_slots = draw(st.integers(1, 48))
    n = draw(st.integers(0, min(src_slots, dst_slots)))

    def pick(slots: int) -> list[int]:
        how = draw(st.sampled_from(["range", "pages", "random"]))
        if how == "range":
            start = draw(st.integers(0, slots - n))
            return list(range(start, start + n))
        if how == "pages":
            size = draw(st.sampled_from([1, 2, 4]))
            pages = draw(st.permutations(range(slots // size)))
            out = list(itertools.chain.from_iterable(range(p * size, p * size + size) for p in pages))
            out += [x for x in draw(st.permutations(range(slots))) if x not in out]
            return out[:n]
        return list(draw(st.permutations(range(slots))))[:n]

    return torch.tensor(pick(src_slots), dtype=torch.int64), torch.tensor(pick(dst_slots), dtype=torch.int64)


@settings(max_examples=200, deadline=None)
@given(
    rows=row_pairs(), min_rows=st.sampled_from([1, 2, 3, 8, 1000]),
    seed=st.integers(0, 2**16), split_rows=st.sampled_from([None, 1, 2, 4]),
)
def test_plan_rows_moves_every_row_once_and_exactly(
    rows: tuple[torch.Tensor, torch.Tensor], min_rows: int, seed: int, split_rows: int | None
) -> None:
    src_idx, dst_idx = rows
    plan = plan_rows(src_idx, dst_idx, min_rows=min_rows, split_rows=split_rows)
    pairs = [(s + i, d + i) for s, d, n in plan.slices for i in range(n)]
    pairs += [(s, d + i) for d, n, rows_ in plan.gathers for i, s in enumerate(rows_.tolist())]
    pairs += [(s + i, d) for s, n, rows_ in plan.scatters for i, d in enumerate(rows_.tolist())]
    if plan.staged is not None:
        pairs += list(zip(plan.staged[0].tolist(), plan.staged[1].tolist()))
    assert sorted(pairs) == sorted(zip(src_idx.tolist(), dst_idx.tolist()))
    assert plan.rows == len(pairs)
    assert all(n == len(r) for _, n, r in plan.gathers + plan.scatters)
    gen = torch.Generator().manual_seed(seed)
    n_src = int(src_idx.max()) + 1 if len(src_idx) else 1
    n_dst = int(dst_idx.max()) + 3 if len(dst_idx) else 1
    for dim in (0, 1):
        shape_src = (n_src, 3) if dim == 0 else (2, n_src, 3)
        src = torch.randn(shape_src, generator=gen)
        dst = torch.randn((n_dst, 3) if dim == 0 else (2, n_dst, 3), generator=gen)
        want = dst.clone()
        if dim == 0:
            want[dst_idx] = src[src_idx]
        else:
            want[:, dst_idx] = src[:, src_idx]
        apply_row_plan(plan, src, dst, dim)
        assert torch.equal(dst, want)


def test_plan_rows_groups_by_destination_then_source() -> None:
    # Destination one range, source scattered with a run inside: one gather (no split).
    p = plan_rows(torch.tensor([5, 6, 7, 1, 2, 9]), torch.arange(6), min_rows=4)
    assert p.slices == () and len(p.gathers) == 1 and p.gathers[0][:2] == (0, 6)
    # With split_rows, a long source run inside it is a slice of its own, the rows around it gathers.
    p = plan_rows(torch.tensor([9, 5, 6, 7, 1, 2]), torch.arange(6), min_rows=4, split_rows=3)
    assert p.slices == ((5, 1, 3),)
    assert [(d, n, r.tolist()) for d, n, r in p.gathers] == [(0, 1, [9]), (4, 2, [1, 2])]
    # A run long enough is a slice; the short destination groups left form one source range: a scatter.
    p = plan_rows(torch.arange(6), torch.tensor([5, 6, 7, 1, 2, 9]), min_rows=3)
    assert p.slices == ((0, 5, 3),)
    assert len(p.scatters) == 1 and p.scatters[0][:2] == (3, 3) and p.scatters[0][2].tolist() == [1, 2, 9]
    # Nothing consecutive anywhere: one staged gather.
    p = plan_rows(torch.tensor([4, 8, 12, 0]), torch.tensor([1, 9, 3, 7]), min_rows=2)
    assert p.staged is not None and p.calls == 2
    # A single row, or a single group, is one call whatever min_rows says.
    assert plan_rows(torch.tensor([3]), torch.tensor([8]), min_rows=100).slices == ((3, 8, 1),)
    assert plan_rows(torch.tensor([]), torch.tensor([]), min_rows=1).rows == 0
    with pytest.raises(ValueError, match="slot dimension is 0"):
        apply_row_plan(plan_rows(torch.tensor([0]), torch.tensor([0])), torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), 2)


# ---------------------------------------------------------------------------
# every copy method kvtier may choose, property-based against a reference gather

# Row shapes and dtypes: rows of 32, 64 and 256 bytes (16-byte elements), 8
# (8-byte), 12 (4-byte: no wider than float32 itself), 6 and 3 (the dtype's own).
ROW_KINDS: list[tuple[tuple[int, ...], torch.dtype]] = [
    ((2, 8), torch.bfloat16), ((4, 4), torch.float32), ((2, 1, 64), torch.uint8), ((4,), torch.int16),
    ((3,), torch.float32), ((3,), torch.int16), ((3,), torch.int8),
]


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Any bit pattern (NaNs and signalling NaNs included), as ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=gen, dtype=torch.uint8)
    return raw.view(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@st.composite
def copy_cases(draw: st.DrawFn) -> dict[str, Any]:
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    dev_pages = draw(st.integers(2, 10))
    host_pages = draw(st.integers(2, 10))
    n = draw(st.integers(1, min(dev_pages, host_pages)))
    how = draw(st.sampled_from(["range", "random"]))
    dev = list(range(n)) if how == "range" else draw(st.permutations(range(dev_pages)))[:n]
    how = draw(st.sampled_from(["range", "random"]))
    host = list(range(host_pages - n, host_pages)) if how == "range" else draw(st.permutations(range(host_pages)))[:n]
    return {
        "device": draw(st.sampled_from(DEVICES)), "layout": draw(st.sampled_from(LAYOUTS)),
        "layers": draw(st.sampled_from([1, 3])), "page_size": page_size,
        "dev_pages": dev_pages, "host_pages": host_pages, "dev": dev, "host": host,
        "kv": draw(st.sampled_from(ROW_KINDS)), "side": draw(st.sampled_from(ROW_KINDS)),
        "valid": draw(st.none() | st.lists(st.integers(0, page_size), min_size=n, max_size=n)),
        "min_run_bytes": draw(st.sampled_from([0, 1, 64, 16 * 1024, 1 << 30])),
        "group": draw(st.sampled_from([0, 1, 2])), "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=150, deadline=None)
@given(case=copy_cases())
def test_every_chosen_copy_method_moves_the_bytes_a_reference_gather_moves(case: dict[str, Any]) -> None:
    """Random pools (row widths that allow wide elements and ones that do
    not, every device allocation and host layout), random pages, a sidecar,
    valid row counts, both directions, and layer groups of 0 (all at once), 1
    or 2 layers: after the copy every destination row holds the bytes of its
    source row (by plain indexing, layer by layer) and nothing else changed."""
    gen = torch.Generator().manual_seed(case["seed"])
    ps, layers = case["page_size"], case["layers"]
    (kv_row, kv_dtype), (side_row, side_dtype) = case["kv"], case["side"]

    def tensors(slots: int, row: tuple[int, ...], dtype: torch.dtype) -> list[list[torch.Tensor]]:
        if case["device"] == "per_layer":
            return [[random_bytes((slots, *row), dtype, gen)] for _ in range(layers)]
        if case["device"] == "stacked_layer_first":
            buf = random_bytes((layers, slots, *row), dtype, gen)
            return [[buf[j]] for j in range(layers)]
        buf = random_bytes((slots, layers, *row), dtype, gen)
        return [[buf[:, j]] for j in range(layers)]

    group = PoolGroup()
    group.add_pool("kv", device=DevicePool(tensors(case["dev_pages"] * ps, kv_row, kv_dtype)), page_size=ps,
                   host_slots=case["host_pages"] * ps, layout=case["layout"], pin_memory=False)
    group.add_sidecar("side", source="kv", rows_per_page=2,
                      device=DevicePool(tensors(case["dev_pages"] * 2, side_row, side_dtype)),
                      layout=case["layout"], pin_memory=False)
    for s in group:
        s.host.buffer(0).copy_(random_bytes(tuple(s.host.buffer(0).shape), s.host.buffer(0).dtype, gen))  # type: ignore[union-attr]
    dev_pages, host_pages, valid = case["dev"], case["host"], case["valid"]
    from kvtier.pools import PageList

    counts = valid if valid is not None else [ps] * len(dev_pages)
    want_rows = {
        "kv": ([h * ps + i for h, c in zip(host_pages, counts) for i in range(c)],
               [d * ps + i for d, c in zip(dev_pages, counts) for i in range(c)]),
        "side": (sidecar_rows(host_pages, 2).tolist(), sidecar_rows(dev_pages, 2).tolist()),
    }
    for direction in (Direction.BACKUP, Direction.LOAD):
        transfers = (
            PoolTransfer("kv", PageList(list(host_pages), ps), PageList(list(dev_pages), ps),
                         valid=None if valid is None else tuple(valid)),
            PoolTransfer("side", None, None, indices_from_pool="kv"),
        )
        before = {(s.name, j, side): (s.device.tensor(j, 0) if side == "device"  # type: ignore[union-attr]
                                      else s.host.layer_view(j, 0)).clone()
                  for s in group for j in range(layers) for side in ("device", "host")}
        plan = plan_batch(direction, [CacheOperation(0, direction, transfers, 0, 0)], group,
                          min_run_bytes=case["min_run_bytes"])
        step = case["group"] or layers
        for start in range(0, layers, step):
            plan.copy_layers(start, min(layers, start + step))
        for s in group:
            host_rows, dev_rows = (torch.tensor(r, dtype=torch.int64) for r in want_rows[s.name])
            for j in range(layers):
                dev_t = s.device.tensor(j, 0)  # type: ignore[union-attr]
                host_t = s.host.layer_view(j, 0)
                if direction is Direction.BACKUP:
                    want, got, src = before[s.name, j, "host"].clone(), host_t, before[s.name, j, "device"]
                    want[host_rows] = src[dev_rows]
                    assert torch.equal(as_bytes(dev_t), as_bytes(before[s.name, j, "device"]))
                else:
                    want, got, src = before[s.name, j, "device"].clone(), dev_t, before[s.name, j, "host"]
                    want[dev_rows] = src[host_rows]
                    assert torch.equal(as_bytes(host_t), as_bytes(before[s.name, j, "host"]))
                assert torch.equal(as_bytes(got), as_bytes(want)), (s.name, j, direction, [process_calibrator().label(c) for c in plan.copies])


def test_wide_rows_are_views_of_the_same_bytes_at_the_widest_element() -> None:
    t = torch.zeros(4, 6, 2, 8, dtype=torch.bfloat16)  # 32-byte rows
    s, d = plan_module.wide_rows(t, t, 1)
    assert s.dtype == torch.complex128 and s.shape == (4, 6, 2) and s.data_ptr() == t.data_ptr()
    # page_first as [layers, slots, ...]: strided slots, rows still one block
    pf = torch.zeros(6, 4, 2, 8, dtype=torch.bfloat16).transpose(0, 1)
    assert plan_module.wide_rows(pf, pf, 1)[0].dtype == torch.complex128
    # 12-byte rows: as wide as float32 already is, unchanged
    f = torch.zeros(5, 3)
    assert plan_module.wide_rows(f, f, 0)[0] is f
    # rows that are not one block (a strided last dimension) stay as they are
    odd = torch.zeros(5, 16, dtype=torch.bfloat16)[:, ::2]
    assert plan_module.wide_rows(odd, odd, 0)[0] is odd
    # the narrower side decides: 8-byte-aligned rows of 24 bytes
    a = torch.zeros(5, 12, dtype=torch.int16)
    assert plan_module.wide_rows(a, a, 0)[0].dtype == torch.int64
    # writes through the wide view land in the original tensor
    src = torch.arange(64, dtype=torch.int16).reshape(4, 16)
    dst = torch.zeros(4, 16, dtype=torch.int16)
    plan_module.apply_row_plan(plan_rows(torch.tensor([3, 1]), torch.tensor([0, 2])), src, dst, 0)
    assert torch.equal(dst[0], src[3]) and torch.equal(dst[2], src[1]) and not dst[1].any()


def test_the_method_label_names_the_path_width_and_calls() -> None:
    group = make_group("stacked_layer_first", "layer_first", 16)
    kv = _plans(group, Direction.BACKUP, "scattered", 16, 16384)["kv"]
    assert kv.describe() == "span/16B: 1 gather"
    kv = _plans(make_group("per_layer", "layer_first", 1), Direction.LOAD, "scattered", 1, 16384)["kv"]
    assert kv.describe() == "layers/16B: 1 scatter"
    swa = _plans(make_group("per_layer", "layer_first", 1), Direction.LOAD, "scattered", 1, 16384)["swa"]
    assert swa.describe().startswith("layers/4B: ")  # 12-byte float32 rows: no wider element
    kv = _plans(make_group("per_layer", "page_first", 64), Direction.BACKUP, "contiguous", 64, 1024)["kv"]
    assert kv.describe() == "stack/2B: 1 stack"
