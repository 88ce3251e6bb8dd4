"""The pure parts of kvtier.transfers: sidecar derivation, merging, copy plans,
batch plans, and the layer-by-layer copy loop that executors run.

References are computed here from page lists, independently of the code under
test; every test that moves bytes compares whole tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.pools import DevicePool, PoolGroup, SidecarSpec
from kvtier.transfers import (
    Batch,
    BatchPlan,
    CacheOperation,
    CopyPlan,
    Direction,
    LayerProgress,
    MergedTransfer,
    PoolTransfer,
    TransferPart,
    apply_copy_plan,
    derive_sidecar_indices,
    merge_transfers,
    plan_batch,
    plan_copies,
    run_batch_copies,
)

# ---------------------------------------------------------------------------
# helpers


def slots(pages: Sequence[int], page_size: int) -> torch.Tensor:
    """Slot indices of ``pages``, page after page (independent of kvtier)."""
    return torch.tensor([p * page_size + i for p in pages for i in range(page_size)], dtype=torch.int64)


def sidecar_rows(pages: Sequence[int], k: int) -> torch.Tensor:
    """Rows ``p*k .. p*k+k-1`` for each page ``p``, the index-map rule."""
    return torch.tensor([p * k + j for p in pages for j in range(k)], dtype=torch.int64)


def pairs(plan: CopyPlan) -> list[tuple[int, int]]:
    """Every ``(src_row, dst_row)`` pair the plan copies, in plan order."""
    out = [(s + i, d + i) for s, d, n in plan.runs for i in range(n)]
    if plan.gather_src is not None:
        assert plan.gather_dst is not None
        out += list(zip(plan.gather_src.tolist(), plan.gather_dst.tolist()))
    return out


def by_key(merged: Sequence[MergedTransfer]) -> dict[tuple[str, str | None], MergedTransfer]:
    out = {(m.name, m.indices_from_pool): m for m in merged}
    assert len(out) == len(merged), "merge produced two transfers with the same key"
    return out


# ---------------------------------------------------------------------------
# derive_sidecar_indices


def test_derive_compressed_kv_lines_up_with_slot_over_ratio() -> None:
    # Compressed KV, ratio r = 4, page_size 16: k = 16 / 4 = 4 rows per page and
    # the compressed slot of loc is loc // 4.
    page_size, ratio = 16, 4
    src = slots([3, 0, 7, 1], page_size)
    got = derive_sidecar_indices(src, page_size, page_size // ratio)
    assert torch.equal(got, torch.unique_consecutive(src // ratio))
    assert torch.equal(got, sidecar_rows([3, 0, 7, 1], 4))
    assert got.dtype == torch.int64


def test_derive_one_row_per_page_is_the_page_number() -> None:
    src = slots([5, 2, 9], 8)
    got = derive_sidecar_indices(src, 8, 1)
    assert torch.equal(got, torch.tensor([5, 2, 9]))


def test_derive_ring_state_of_size_r() -> None:
    # Ring state of size R: state slot = (loc // page) * R + loc % R. With
    # page >= R, each page covers its R state rows exactly once.
    page_size, ring = 8, 3
    pages = [4, 1, 6]
    src = slots(pages, page_size)
    got = derive_sidecar_indices(src, page_size, ring)
    expected = []
    for p in pages:
        locs = src[(src // page_size) == p]
        expected += sorted({int(loc) // page_size * ring + int(loc) % ring for loc in locs})
    assert got.tolist() == expected
    assert torch.equal(got, sidecar_rows(pages, ring))


def test_derive_reads_the_first_index_of_each_page() -> None:
    page_size = 4
    src = slots([2, 0, 5], page_size)
    base = derive_sidecar_indices(src, page_size, 3)
    # Only the first index of each page is read: the others do not matter.
    scrambled = src.clone()
    for start in range(0, src.numel(), page_size):
        scrambled[start + 1 : start + page_size] = 999
    assert torch.equal(derive_sidecar_indices(scrambled, page_size, 3), base)
    assert torch.equal(base, sidecar_rows([2, 0, 5], 3))


def test_derive_empty_source_gives_no_rows() -> None:
    got = derive_sidecar_indices(torch.empty(0, dtype=torch.int64), 4, 3)
    assert got.numel() == 0


page_lists = st.lists(st.integers(0, 63), max_size=8, unique=True)


@settings(max_examples=80, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    k=st.integers(1, 5),
    a=page_lists,
    b=page_lists,
)
def test_derive_distributes_over_concatenation(page_size: int, k: int, a: list[int], b: list[int]) -> None:
    sa, sb = slots(a, page_size), slots(b, page_size)
    whole = derive_sidecar_indices(torch.cat([sa, sb]), page_size, k)
    parts = torch.cat([derive_sidecar_indices(sa, page_size, k), derive_sidecar_indices(sb, page_size, k)])
    assert torch.equal(whole, parts)
    assert torch.equal(whole, sidecar_rows(a + b, k))


# ---------------------------------------------------------------------------
# merge_transfers

SIDECARS = {
    "c4": SidecarSpec("kv", 4, 2),
    "one": SidecarSpec("kv", 4, 1),
    "st": SidecarSpec("swa", 2, 3),
}
PAGE_SIZE = {"kv": 4, "swa": 2}


def owned(name: str, host_pages: list[int], dev_pages: list[int]) -> PoolTransfer:
    ps = PAGE_SIZE[name]
    return PoolTransfer(name, slots(host_pages, ps), slots(dev_pages, ps))


def derived(name: str) -> PoolTransfer:
    return PoolTransfer(name, None, None, indices_from_pool=SIDECARS[name].source)


def test_merge_groups_by_name_in_operation_order() -> None:
    ops = [
        [owned("kv", [0, 1], [5, 6]), owned("swa", [3], [0])],
        [owned("swa", [1, 2], [7, 4])],
        [owned("kv", [4], [2])],
    ]
    merged = by_key(merge_transfers(ops, SIDECARS))
    assert set(merged) == {("kv", None), ("swa", None)}

    kv = merged["kv", None]
    assert torch.equal(kv.host_indices, slots([0, 1, 4], 4))
    assert torch.equal(kv.device_indices, slots([5, 6, 2], 4))
    assert kv.parts == (TransferPart(0, 0, 8), TransferPart(2, 8, 12))
    assert kv.rows == 12

    swa = merged["swa", None]
    assert torch.equal(swa.host_indices, slots([3, 1, 2], 2))
    assert torch.equal(swa.device_indices, slots([0, 7, 4], 2))
    assert swa.parts == (TransferPart(0, 0, 2), TransferPart(1, 2, 6))

    # Slicing by each part gives back exactly that operation's indices.
    for m in (kv, swa):
        for part in m.parts:
            (t,) = [t for t in ops[part.operation] if t.name == m.name]
            assert torch.equal(m.host_indices[part.start : part.stop], t.host_indices)
            assert torch.equal(m.device_indices[part.start : part.stop], t.device_indices)


def test_merge_single_operation_keeps_its_indices() -> None:
    t = owned("kv", [3, 1], [0, 2])
    (m,) = merge_transfers([[t]], SIDECARS)
    assert m.indices_from_pool is None
    assert torch.equal(m.host_indices, t.host_indices)
    assert torch.equal(m.device_indices, t.device_indices)
    assert m.parts == (TransferPart(0, 0, 8),)


def test_merge_derives_sidecar_from_merged_source_and_scales_parts() -> None:
    ops = [
        [owned("kv", [0, 1], [5, 6]), derived("c4")],
        [owned("kv", [7], [2]), derived("c4")],
    ]
    merged = by_key(merge_transfers(ops, SIDECARS))
    c4 = merged["c4", "kv"]
    assert c4.indices_from_pool == "kv"
    # k / page_size = 2 / 4: 8 source slots -> 4 rows, 4 -> 2.
    assert c4.parts == (TransferPart(0, 0, 4), TransferPart(1, 4, 6))
    assert torch.equal(c4.host_indices, sidecar_rows([0, 1, 7], 2))
    assert torch.equal(c4.device_indices, sidecar_rows([5, 6, 2], 2))
    assert c4.rows == 6
    # The source itself is untouched by the derivation.
    assert torch.equal(merged["kv", None].host_indices, slots([0, 1, 7], 4))


def test_merge_sidecar_on_some_operations_only() -> None:
    ops = [
        [owned("kv", [0, 1], [5, 6]), derived("c4")],
        [owned("kv", [3], [4])],  # carries kv, not c4
        [owned("kv", [7], [2]), derived("c4")],
    ]
    c4 = by_key(merge_transfers(ops, SIDECARS))["c4", "kv"]
    assert c4.parts == (TransferPart(0, 0, 4), TransferPart(2, 4, 6))
    assert torch.equal(c4.host_indices, sidecar_rows([0, 1, 7], 2))
    assert torch.equal(c4.device_indices, sidecar_rows([5, 6, 2], 2))


def test_merge_same_sidecar_name_from_another_source_is_refused() -> None:
    # "c4" is registered as derived from "kv": a "c4" derived from "swa" must not
    # merge with it (nor be derived from swa's indices).
    ops = [
        [owned("kv", [0], [1]), owned("swa", [0], [1]), derived("c4")],
        [owned("swa", [2], [3]), PoolTransfer("c4", None, None, indices_from_pool="swa")],
    ]
    with pytest.raises(ValueError, match=r"'c4' derives from 'swa', which is not its registered source"):
        merge_transfers(ops, SIDECARS)


def test_merge_unregistered_sidecar_is_refused() -> None:
    ops = [[owned("kv", [0], [1]), PoolTransfer("ghost", None, None, indices_from_pool="kv")]]
    with pytest.raises(ValueError, match=r"'ghost' derives from 'kv', which is not its registered source"):
        merge_transfers(ops, SIDECARS)


def test_merge_sidecar_without_its_source_in_the_batch_is_refused() -> None:
    ops = [[owned("swa", [0], [1]), derived("c4")]]
    with pytest.raises(ValueError, match=r"operation 0 carries sidecar 'c4' without its source 'kv'"):
        merge_transfers(ops, SIDECARS)


@pytest.mark.parametrize("other_carries_sidecar", [True, False], ids=["dropped", "torch-error"])
def test_merge_sidecar_without_its_source_in_its_operation_is_refused(other_carries_sidecar: bool) -> None:
    first = [owned("kv", [0], [1])] + ([derived("c4")] if other_carries_sidecar else [])
    ops = [first, [owned("swa", [0], [1]), derived("c4")]]  # op 1: c4 but no kv
    with pytest.raises(ValueError, match=r"'c4'"):
        merge_transfers(ops, SIDECARS)


def test_merge_empty_batch() -> None:
    assert merge_transfers([], SIDECARS) == ()
    assert merge_transfers([[], []], SIDECARS) == ()


@st.composite
def batches(draw: st.DrawFn) -> list[dict[str, tuple[list[int], list[int]] | None]]:
    """Operations as ``{pool: (host_pages, device_pages)}``; sidecars map to None."""
    n_ops = draw(st.integers(1, 6))
    ops = []
    for _ in range(n_ops):
        op: dict[str, tuple[list[int], list[int]] | None] = {}
        for name in ("kv", "swa"):
            if draw(st.booleans()):
                n = draw(st.integers(1, 4))
                pages = st.lists(st.integers(0, 15), min_size=n, max_size=n, unique=True)
                op[name] = (draw(pages), draw(pages))
        for name, spec in SIDECARS.items():
            if spec.source in op and draw(st.booleans()):
                op[name] = None
        ops.append(op)
    return ops


@settings(max_examples=100, deadline=None)
@given(batch=batches(), data=st.data())
def test_merge_parts_give_back_every_operations_indices(
    batch: list[dict[str, tuple[list[int], list[int]] | None]], data: st.DataObject
) -> None:
    ops = []
    for op in batch:
        transfers = [derived(n) if pages is None else owned(n, *pages) for n, pages in op.items()]
        ops.append(data.draw(st.permutations(transfers)))
    merged = by_key(merge_transfers(ops, SIDECARS))

    expected_keys = {(n, SIDECARS[n].source if n in SIDECARS else None) for op in batch for n in op}
    assert set(merged) == expected_keys

    for m in merged.values():
        assert m.host_indices.numel() == m.device_indices.numel() == m.rows
        # Parts tile the merged rows in operation order.
        assert [p.operation for p in m.parts] == sorted(p.operation for p in m.parts)
        assert m.parts[0].start == 0 and m.parts[-1].stop == m.rows
        assert all(a.stop == b.start for a, b in zip(m.parts, m.parts[1:]))

    for i, op in enumerate(batch):
        for name in ("kv", "swa", *SIDECARS):
            if name in SIDECARS:
                key: tuple[str, str | None] = (name, SIDECARS[name].source)
            else:
                key = (name, None)
            m = merged.get(key)
            mine = [] if m is None else [p for p in m.parts if p.operation == i]
            if name not in op:
                assert mine == []
                continue
            assert m is not None and len(mine) == 1
            (part,) = mine
            if name in SIDECARS:
                src_pages = op[SIDECARS[name].source]
                assert src_pages is not None
                k = SIDECARS[name].rows_per_page
                host, dev = sidecar_rows(src_pages[0], k), sidecar_rows(src_pages[1], k)
            else:
                pages = op[name]
                assert pages is not None
                host, dev = slots(pages[0], PAGE_SIZE[name]), slots(pages[1], PAGE_SIZE[name])
            assert torch.equal(m.host_indices[part.start : part.stop], host)
            assert torch.equal(m.device_indices[part.start : part.stop], dev)


# ---------------------------------------------------------------------------
# plan_copies / apply_copy_plan


def test_plan_turns_runs_consecutive_on_both_sides_into_slices() -> None:
    src = torch.tensor([0, 1, 2, 10, 11, 5])
    dst = torch.tensor([4, 5, 6, 20, 21, 9])
    plan = plan_copies(src, dst)
    assert plan.runs == ((0, 4, 3), (10, 20, 2), (5, 9, 1))
    assert plan.gather_src is None and plan.gather_dst is None
    assert plan.rows == 6


def test_plan_consecutive_on_one_side_only_is_not_a_run() -> None:
    plan = plan_copies(torch.tensor([0, 1, 2]), torch.tensor([0, 2, 4]))
    assert plan.runs == ((0, 0, 1), (1, 2, 1), (2, 4, 1))
    plan = plan_copies(torch.tensor([0, 1, 2]), torch.tensor([0, 2, 4]), min_run=2)
    assert plan.runs == ()
    assert plan.gather_src is not None and plan.gather_dst is not None
    assert plan.gather_src.tolist() == [0, 1, 2] and plan.gather_dst.tolist() == [0, 2, 4]


def test_plan_min_run_splits_long_runs_from_gathered_rows() -> None:
    src = torch.tensor([0, 1, 2, 10, 5, 6, 30])
    dst = torch.tensor([4, 5, 6, 20, 9, 10, 1])
    plan = plan_copies(src, dst, min_run=3)
    assert plan.runs == ((0, 4, 3),)
    assert plan.gather_src is not None and plan.gather_dst is not None
    assert plan.gather_src.tolist() == [10, 5, 6, 30]
    assert plan.gather_dst.tolist() == [20, 9, 10, 1]
    assert plan.rows == 7

    plan = plan_copies(src, dst, min_run=2)
    assert plan.runs == ((0, 4, 3), (5, 9, 2))
    assert plan.gather_src is not None and plan.gather_src.tolist() == [10, 30]


def test_plan_no_rows() -> None:
    empty = torch.empty(0, dtype=torch.int64)
    plan = plan_copies(empty, empty)
    assert plan.runs == () and plan.gather_src is None and plan.gather_dst is None
    assert plan.rows == 0
    src, dst = torch.randn(4, 3), torch.randn(4, 3)
    before = dst.clone()
    apply_copy_plan(plan, src, dst)
    assert torch.equal(dst, before)


@pytest.mark.parametrize("min_run", [1, 2])
def test_plan_one_row(min_run: int) -> None:
    plan = plan_copies(torch.tensor([7]), torch.tensor([3]), min_run=min_run)
    assert plan.rows == 1
    assert pairs(plan) == [(7, 3)]
    if min_run == 1:
        assert plan.runs == ((7, 3, 1),) and plan.gather_src is None
    else:
        assert plan.runs == ()
    src = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    dst = torch.zeros(5, 3)
    expected = dst.clone()
    expected[3] = src[7]
    apply_copy_plan(plan, src, dst)
    assert torch.equal(dst, expected)


@st.composite
def index_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """Source rows (any, repeats allowed) and distinct destination rows of 64.

    Built from blocks so that runs consecutive on both sides are common.
    """
    block = draw(st.sampled_from([1, 2, 3, 4, 8]))
    nblocks = 64 // block
    n = draw(st.integers(0, nblocks))
    dst_blocks = draw(st.permutations(range(nblocks)))[:n]
    if draw(st.booleans()):
        dst_blocks = sorted(dst_blocks)
    dst = [b * block + i for b in dst_blocks for i in range(block)]
    if draw(st.booleans()):
        src_blocks = draw(st.lists(st.integers(0, nblocks - 1), min_size=n, max_size=n))
        if draw(st.booleans()):
            src_blocks = sorted(src_blocks)
        src = [b * block + i for b in src_blocks for i in range(block)]
    else:
        src = draw(st.lists(st.integers(0, 63), min_size=len(dst), max_size=len(dst)))
    return torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)


@settings(max_examples=100, deadline=None)
@given(idx=index_pairs(), min_run=st.sampled_from([1, 2, 4, 64]), seed=st.integers(0, 2**16))
def test_applied_plan_equals_reference_indexing(
    idx: tuple[torch.Tensor, torch.Tensor], min_run: int, seed: int
) -> None:
    src_idx, dst_idx = idx
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(64, 2, 3, generator=g)
    dst = torch.randn(64, 2, 3, generator=g)
    expected = dst.clone()
    expected[dst_idx] = src[src_idx]

    plan = plan_copies(src_idx, dst_idx, min_run=min_run)
    assert plan.rows == len(src_idx)
    # Every row keeps its pairing, whatever the split; no row is copied twice.
    assert sorted(pairs(plan)) == sorted(zip(src_idx.tolist(), dst_idx.tolist()))
    assert all(n >= min_run for _, _, n in plan.runs)
    if min_run == 1:
        assert plan.gather_src is None
        # Runs are maximal: no run continues the previous one on both sides.
        for (s0, d0, n0), (s1, d1, _) in zip(plan.runs, plan.runs[1:]):
            assert not (s0 + n0 == s1 and d0 + n0 == d1)

    apply_copy_plan(plan, src, dst)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("min_run", [1, 3])
def test_apply_plan_into_a_page_first_host_view(min_run: int) -> None:
    S, L, D = 24, 3, 5
    layer = 1
    g = torch.Generator().manual_seed(0)
    src = torch.randn(16, D, generator=g)
    buf = torch.randn(S, L, D, generator=g)
    dst = buf[:, layer]
    assert not dst.is_contiguous()
    src_idx = torch.tensor([0, 1, 2, 3, 9, 4, 5, 12])
    dst_idx = torch.tensor([20, 21, 22, 23, 0, 8, 9, 3])
    expected = buf.clone()
    expected[dst_idx, layer] = src[src_idx]

    plan = plan_copies(src_idx, dst_idx, min_run=min_run)
    apply_copy_plan(plan, src, dst)
    assert torch.equal(buf, expected)  # other layers untouched

    # And reading from a strided view back into a contiguous tensor.
    back = torch.zeros(16, D)
    expected_back = back.clone()
    expected_back[src_idx] = buf[dst_idx, layer]
    apply_copy_plan(plan_copies(dst_idx, src_idx, min_run=min_run), dst, back)
    assert torch.equal(back, expected_back)
    assert torch.equal(back[src_idx], src[src_idx])


# ---------------------------------------------------------------------------
# plan_batch / run_batch_copies with a real PoolGroup

LAYERS, SLOTS, PS = 3, 32, 4


def make_group(layout: str = "layer_first", seed: int = 0) -> PoolGroup:
    """kv (2 planes, every layer), swa (no layer at t=1), c4 (sidecar of kv,
    k=2), anchor (logical) and state (sidecar of anchor, only at t=1)."""
    g = torch.Generator().manual_seed(seed)
    group = PoolGroup()
    kv = DevicePool(
        [[torch.randn(SLOTS, 2, 3, generator=g), torch.randn(SLOTS, 2, 3, generator=g)] for _ in range(LAYERS)]
    )
    swa = DevicePool(
        [torch.randn(SLOTS, 5, generator=g).to(torch.bfloat16) for _ in range(2)], layer_map=[0, None, 1]
    )
    c4 = DevicePool([torch.randn(SLOTS // PS * 2, 4, generator=g).half() for _ in range(LAYERS)])
    state = DevicePool([torch.randint(-1000, 1000, (SLOTS // PS * 2, 6), generator=g)], layer_map=[None, 0])
    group.add_pool("kv", device=kv, page_size=PS, host_slots=SLOTS, layout=layout, pin_memory=False)  # type: ignore[arg-type]
    group.add_pool("swa", device=swa, page_size=PS, host_slots=SLOTS, layout=layout, pin_memory=False)  # type: ignore[arg-type]
    group.add_sidecar("c4", source="kv", rows_per_page=2, device=c4, layout=layout, pin_memory=False)  # type: ignore[arg-type]
    group.add_logical_pool("anchor", page_size=PS, host_slots=SLOTS, device_slots=SLOTS)
    group.add_sidecar("state", source="anchor", rows_per_page=2, device=state, layout=layout, pin_memory=False)  # type: ignore[arg-type]
    for spec in group:
        if spec.device is not None:
            for p in range(len(spec.device.planes)):
                spec.host.buffer(p).zero_()  # type: ignore[union-attr]
    return group


# Per operation: pool -> (host pages, device pages) for slot-owning pools.
BACKUP_OPS = [
    {"kv": ([0, 1], [1, 2]), "swa": ([5], [3]), "anchor": ([2, 3], [0, 1])},
    {"kv": ([7], [5]), "anchor": ([0], [6])},
    {"swa": ([2, 3], [7, 4])},
]
SIDECAR_OF = {"c4": "kv", "state": "anchor"}


def make_ops(direction: Direction, spec_ops: list[dict[str, tuple[list[int], list[int]]]]) -> list[CacheOperation]:
    ops = []
    for i, op in enumerate(spec_ops):
        transfers = []
        for name, (h, d) in op.items():
            transfers.append(PoolTransfer(name, slots(h, PS), slots(d, PS)))
            for side, src in SIDECAR_OF.items():
                if src == name:
                    transfers.append(PoolTransfer(side, None, None, indices_from_pool=name))
        ops.append(CacheOperation(i, direction, tuple(transfers), 0, 0))
    return ops


def expected_indices(spec_ops: list[dict[str, tuple[list[int], list[int]]]]) -> dict[str, tuple[list[int], list[int]]]:
    """Merged (host, device) rows per pool with bytes, computed from pages."""
    out: dict[str, tuple[list[int], list[int]]] = {}
    for op in spec_ops:
        for name, (h, d) in op.items():
            if name != "anchor":
                hs, ds = out.setdefault(name, ([], []))
                hs += slots(h, PS).tolist()
                ds += slots(d, PS).tolist()
            for side, src in SIDECAR_OF.items():
                if src == name:
                    hs, ds = out.setdefault(side, ([], []))
                    hs += sidecar_rows(h, 2).tolist()
                    ds += sidecar_rows(d, 2).tolist()
    return out


def test_plan_batch_skips_logical_pools_and_orients_backup() -> None:
    group = make_group()
    plan = plan_batch(Direction.BACKUP, make_ops(Direction.BACKUP, BACKUP_OPS), group)
    assert isinstance(plan, BatchPlan)
    assert plan.num_layers == LAYERS
    # The anchor is merged (it drives "state") but has no bytes to copy.
    assert ("anchor", None) in by_key(plan.merged)
    assert sorted(c.name for c in plan.copies) == ["c4", "kv", "state", "swa"]
    exp = expected_indices(BACKUP_OPS)
    for c in plan.copies:
        h, d = exp[c.name]
        assert c.host is group[c.name].host and c.device is group[c.name].device
        assert sorted(pairs(c.plan)) == sorted(zip(d, h))  # device -> host


def test_plan_batch_orients_load_host_to_device() -> None:
    group = make_group()
    plan = plan_batch(Direction.LOAD, make_ops(Direction.LOAD, BACKUP_OPS), group)
    exp = expected_indices(BACKUP_OPS)
    for c in plan.copies:
        h, d = exp[c.name]
        assert sorted(pairs(c.plan)) == sorted(zip(h, d))  # host -> device


def _describe(group: PoolGroup, t: torch.Tensor) -> tuple[str, str, int, int]:
    """Which pool/side/layer/plane a yielded tensor is (by storage and stride)."""
    for spec in group:
        if spec.device is None:
            continue
        for j in range(spec.device.num_layers):
            for p in range(len(spec.device.planes)):
                dev = spec.device.tensor(j, p)
                if t is dev:
                    return (spec.name, "device", j, p)
                view = spec.host.layer_view(j, p)
                if t.data_ptr() == view.data_ptr() and t.stride() == view.stride() and t.shape == view.shape:
                    return (spec.name, "host", j, p)
    raise AssertionError("layer_copies yielded a tensor of no pool")


@pytest.mark.parametrize("direction", [Direction.BACKUP, Direction.LOAD])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_layer_copies_yield_every_pool_plane_at_its_layer(direction: Direction, layout: str) -> None:
    group = make_group(layout)
    plan = plan_batch(direction, make_ops(direction, BACKUP_OPS), group)
    plans = {c.name: c.plan for c in plan.copies}
    src_side, dst_side = ("device", "host") if direction is Direction.BACKUP else ("host", "device")
    seen: dict[int, list[tuple[str, int, int]]] = {}
    for t in range(LAYERS):
        for src, dst, copy_plan in plan.layer_copies(t):
            sname, sside, sj, sp = _describe(group, src)
            dname, dside, dj, dp = _describe(group, dst)
            assert (sname, sj, sp) == (dname, dj, dp)
            assert (sside, dside) == (src_side, dst_side)
            assert copy_plan is plans[sname]
            seen.setdefault(t, []).append((sname, sj, sp))
    assert sorted(seen[0]) == [("c4", 0, 0), ("kv", 0, 0), ("kv", 0, 1), ("swa", 0, 0)]
    # swa has no layer at t=1; state has its only layer there.
    assert sorted(seen[1]) == [("c4", 1, 0), ("kv", 1, 0), ("kv", 1, 1), ("state", 0, 0)]
    # state's layer_map ends before t=2; swa's second layer moves with t=2.
    assert sorted(seen[2]) == [("c4", 2, 0), ("kv", 2, 0), ("kv", 2, 1), ("swa", 1, 0)]


def test_batch_plan_nbytes_is_rows_times_slot_bytes() -> None:
    group = make_group()
    plan = plan_batch(Direction.BACKUP, make_ops(Direction.BACKUP, BACKUP_OPS), group)
    # Slot bytes, from the shapes above: kv 3 layers x 2 planes x 2*3 float32,
    # swa 2 layers x 5 bfloat16, c4 3 layers x 4 float16, state 1 layer x 6 int64.
    slot_bytes = {"kv": 3 * 2 * 6 * 4, "swa": 2 * 5 * 2, "c4": 3 * 4 * 2, "state": 6 * 8}
    for name, nb in slot_bytes.items():
        assert group[name].slot_nbytes == nb
    rows = {name: len(h) for name, (h, _) in expected_indices(BACKUP_OPS).items()}
    assert rows == {"kv": 12, "swa": 12, "c4": 6, "state": 6}
    assert plan.nbytes == sum(rows[n] * slot_bytes[n] for n in rows)
    assert plan.nbytes == sum(c.plan.rows * c.host.slot_nbytes for c in plan.copies)


def _host_snapshot(group: PoolGroup) -> dict[tuple[str, int, int], torch.Tensor]:
    return {
        (s.name, j, p): s.host.layer_view(j, p).clone()
        for s in group
        if s.device is not None
        for j in range(s.device.num_layers)
        for p in range(len(s.device.planes))
    }


def _device_snapshot(group: PoolGroup) -> dict[tuple[str, int, int], torch.Tensor]:
    return {
        (s.name, j, p): s.device.tensor(j, p).clone()
        for s in group
        if s.device is not None
        for j in range(s.device.num_layers)
        for p in range(len(s.device.planes))
    }


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
# 0: every run is a slice copy; 1 MiB: every row is gathered.
@pytest.mark.parametrize("min_run_bytes", [0, 1 << 20])
def test_run_batch_copies_backup_then_load_is_byte_exact(layout: str, min_run_bytes: int) -> None:
    group = make_group(layout)
    exp = expected_indices(BACKUP_OPS)
    dev_before = _device_snapshot(group)
    host_expected = _host_snapshot(group)
    for (name, j, p), view in host_expected.items():
        h, d = exp.get(name, ([], []))
        view[h] = dev_before[name, j, p][d]

    batch = Batch(1, Direction.BACKUP, make_ops(Direction.BACKUP, BACKUP_OPS), group, min_run_bytes=min_run_bytes)
    progress = LayerProgress(batch.num_layers)
    run_batch_copies(batch, progress)
    assert progress.layers_done == LAYERS

    for key, view in _host_snapshot(group).items():
        assert torch.equal(view, host_expected[key]), key
    for key, t in _device_snapshot(group).items():
        assert torch.equal(t, dev_before[key]), key  # a backup only reads the device

    # Load back into other device rows of a wiped device.
    load_ops = [
        {"kv": ([0, 1], [6, 7]), "swa": ([5], [0]), "anchor": ([2, 3], [4, 5])},
        {"kv": ([7], [3]), "anchor": ([0], [2])},
        {"swa": ([2, 3], [1, 2])},
    ]
    for s in group:
        if s.device is not None:
            for j in range(s.device.num_layers):
                for p in range(len(s.device.planes)):
                    s.device.tensor(j, p).zero_()
    load_exp = expected_indices(load_ops)
    host_now = _host_snapshot(group)
    dev_expected = _device_snapshot(group)
    for (name, j, p), t in dev_expected.items():
        h, d = load_exp.get(name, ([], []))
        t[d] = host_now[name, j, p][h]

    batch = Batch(2, Direction.LOAD, make_ops(Direction.LOAD, load_ops), group, min_run_bytes=min_run_bytes)
    progress = LayerProgress(batch.num_layers)
    run_batch_copies(batch, progress)
    assert progress.layers_done == LAYERS
    for key, t in _device_snapshot(group).items():
        assert torch.equal(t, dev_expected[key]), key
    # The round trip: loaded rows equal the rows originally backed up.
    kv_dev = group["kv"].device
    assert kv_dev is not None
    for j in range(LAYERS):
        for p in range(2):
            assert torch.equal(kv_dev.tensor(j, p)[slots([6, 7, 3], PS)], dev_before["kv", j, p][slots([1, 2, 5], PS)])
    st_dev = group["state"].device
    assert st_dev is not None
    assert torch.equal(st_dev.tensor(0, 0)[sidecar_rows([4, 5, 2], 2)], dev_before["state", 0, 0][sidecar_rows([0, 1, 6], 2)])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_run_batch_copies_notifies_each_layer_in_order_when_watched(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Groups of one layer (every group moves at least 1 byte): with a watcher,
    # layer n is copied only after layer n-1 was reported.
    monkeypatch.setattr("kvtier.transfers.plan.LAYER_GROUP_BYTES", 1)
    group = make_group(layout)
    kv_dev, kv_host = group["kv"].device, group["kv"].host
    assert kv_dev is not None
    h, d = slots([0, 1, 7], PS), slots([1, 2, 5], PS)
    calls: list[int] = []
    landed: list[bool] = []

    def notify() -> None:
        n = progress.layers_done
        calls.append(n)
        # Layers 0..n-1 are in place when layer n-1 is reported; layer n is not yet.
        landed.append(
            all(torch.equal(kv_host.layer_view(j, 0)[h], kv_dev.tensor(j, 0)[d]) for j in range(n))
            and (n == LAYERS or not torch.equal(kv_host.layer_view(n, 0)[h], kv_dev.tensor(n, 0)[d]))
        )

    batch = Batch(1, Direction.BACKUP, make_ops(Direction.BACKUP, BACKUP_OPS), group)
    progress = LayerProgress(batch.num_layers, notify)
    progress.watched = True
    run_batch_copies(batch, progress)
    assert calls == [1, 2, 3]
    assert landed == [True, True, True]
    assert progress.layers_done == LAYERS


def test_run_batch_copies_does_not_notify_when_unwatched() -> None:
    group = make_group()
    calls: list[int] = []
    batch = Batch(1, Direction.BACKUP, make_ops(Direction.BACKUP, BACKUP_OPS), group)
    progress = LayerProgress(batch.num_layers, lambda: calls.append(progress.layers_done))
    run_batch_copies(batch, progress)
    assert calls == []
    assert progress.layers_done == LAYERS
    kv_dev = group["kv"].device
    assert kv_dev is not None
    for j in range(LAYERS):
        assert torch.equal(group["kv"].host.layer_view(j, 1)[slots([0, 1, 7], PS)], kv_dev.tensor(j, 1)[slots([1, 2, 5], PS)])


def test_plan_batch_turns_the_byte_threshold_into_a_run_length() -> None:
    from kvtier.testing import full_attention_group

    group = full_attention_group(page_size=4, heads=2, head_dim=8)  # fp32 rows: 64 bytes per plane
    src = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15])  # runs of 4 and 8 slots
    op = CacheOperation(1, Direction.BACKUP, (PoolTransfer("kv", src.clone(), src),), 0, 0)
    # 512 bytes = 8 rows of 64 bytes: the 8-slot run is a slice, the 4-slot run is gathered.
    plan = plan_batch(Direction.BACKUP, [op], group, min_run_bytes=512).copies[0].plan
    assert plan.runs == ((8, 8, 8),)
    assert plan.gather_src is not None and plan.gather_src.tolist() == [0, 1, 2, 3]
    every_run = plan_batch(Direction.BACKUP, [op], group, min_run_bytes=0).copies[0].plan
    assert every_run.runs == ((0, 0, 4), (8, 8, 8)) and every_run.gather_src is None
