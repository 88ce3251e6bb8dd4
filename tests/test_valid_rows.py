"""Transfers that carry valid row counts per page (`PoolTransfer.valid`): only
the rows that hold data move, on the CPU path (`run_batch_copies`) and on the
plan the CUDA executor walks (`PoolCopy.plan`, `BatchPlan.layer_copies`), for
slot-owning pools and sidecars alike; every other row is left as it was.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.pools import PageList
from kvtier.transfers import (
    Batch,
    CacheOperation,
    Direction,
    LayerProgress,
    PoolTransfer,
    TransferPart,
    apply_copy_plan,
    merge_transfers,
    plan_batch,
    run_batch_copies,
)
from test_copy_paths import DEVICES, LAYERS, LAYOUTS, assert_same, make_group, snapshot
from test_transfers import SIDECARS, by_key


def slots_of(pages: list[int], size: int, valid: list[int] | None = None) -> torch.Tensor:
    counts = valid or [size] * len(pages)
    return torch.tensor([p * size + i for p, n in zip(pages, counts) for i in range(n)], dtype=torch.int64)


def test_merge_cuts_pages_to_their_valid_rows_and_counts_parts_in_rows_kept() -> None:
    ops = [
        [PoolTransfer("kv", PageList([0, 1], 4), PageList([5, 6], 4), valid=(4, 1)),
         PoolTransfer("c4", None, None, indices_from_pool="kv", valid=(2, 0))],
        [PoolTransfer("kv", PageList([7], 4), PageList([2], 4)),  # no counts: whole
         PoolTransfer("c4", None, None, indices_from_pool="kv")],
        [PoolTransfer("kv", PageList([3], 4), PageList([9], 4), valid=(0,)),
         PoolTransfer("c4", None, None, indices_from_pool="kv", valid=(1,))],
    ]
    merged = by_key(merge_transfers(ops, SIDECARS))
    kv, c4 = merged["kv", None], merged["c4", "kv"]
    assert torch.equal(kv.host_indices, torch.tensor([0, 1, 2, 3, 4, 28, 29, 30, 31]))
    assert torch.equal(kv.device_indices, torch.tensor([20, 21, 22, 23, 24, 8, 9, 10, 11]))
    assert kv.parts == (TransferPart(0, 0, 5), TransferPart(1, 5, 9), TransferPart(2, 9, 9))
    # c4: 2 rows per kv page; op 0 keeps page 0's two rows and none of page 1's.
    assert torch.equal(c4.host_indices, torch.tensor([0, 1, 14, 15, 6]))
    assert torch.equal(c4.device_indices, torch.tensor([10, 11, 4, 5, 18]))
    assert c4.parts == (TransferPart(0, 0, 2), TransferPart(1, 2, 4), TransferPart(2, 4, 5))


def test_merge_without_counts_is_untouched() -> None:
    ops = [[PoolTransfer("kv", PageList([0, 1], 4), PageList([5, 6], 4))]]
    (m,) = merge_transfers(ops, SIDECARS)
    assert m.rows == 8 and m.parts == (TransferPart(0, 0, 8),)


@pytest.mark.parametrize(("valid", "rule"), [((4,), "one count per page"), ((4, 5), r"0\.\.4; got 5"),
                                             ((4, -1), r"0\.\.4; got -1"), ((4, True), "got True")])
def test_merge_refuses_bad_counts(valid: tuple[int, ...], rule: str) -> None:
    ops = [[PoolTransfer("kv", PageList([0, 1], 4), PageList([5, 6], 4), valid=valid)]]
    with pytest.raises(ValueError, match=rule):
        merge_transfers(ops, SIDECARS)


def test_merge_refuses_counts_on_tensor_indices() -> None:
    t = torch.arange(4)
    with pytest.raises(ValueError, match="must be PageLists"):
        merge_transfers([[PoolTransfer("kv", t, t, valid=(4,))]], SIDECARS)


# Per operation: kv (host pages, device pages, valid), swa valid, c4 valid (2 rows a kv page).
SPEC = [
    ([0, 1, 2], [9, 2, 7], [16, 16, 5], [16, 16, 0], [2, 1, 0]),
    ([5], [4], [3], [16], [0]),
    ([6, 8], [0, 1], [16, 16], [16, 9], [2, 2]),
]


def _ops(direction: Direction) -> list[CacheOperation]:
    ops = []
    for i, (h, d, kv, swa, c4) in enumerate(SPEC):
        transfers = (
            PoolTransfer("kv", PageList(h, 16), PageList(d, 16), valid=kv),
            PoolTransfer("swa", PageList(h, 16), PageList(d, 16), valid=swa),
            PoolTransfer("c4", None, None, indices_from_pool="kv", valid=c4),
        )
        ops.append(CacheOperation(i, direction, transfers, 0, 0))
    return ops


def _moved() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for name, at, size in (("kv", 2, 16), ("swa", 3, 16), ("c4", 4, 2)):
        out[name] = (torch.cat([slots_of(s[0], size, s[at]) for s in SPEC]),  # type: ignore[arg-type]
                     torch.cat([slots_of(s[1], size, s[at]) for s in SPEC]))  # type: ignore[arg-type]
    return out


def _wipe_device(group: object) -> None:
    for s in group:  # type: ignore[attr-defined]
        for j in range(s.device.num_layers):
            for p in range(len(s.device.planes)):
                s.device.tensor(j, p).zero_()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("path", ["cpu", "cuda-plan"])
def test_only_valid_rows_move_both_ways(device: str, layout: str, path: str) -> None:
    group = make_group(device, layout, 16)
    moved = _moved()
    dev_before = snapshot(group, "device")
    host_want = snapshot(group, "host")
    for (name, j, p), t in host_want.items():
        h, d = moved[name]
        t[h] = dev_before[name, j, p][d]

    def run(direction: Direction) -> int:
        batch = Batch(1, direction, _ops(direction), group, min_run_bytes=16 * 1024)
        if path == "cpu":
            progress = LayerProgress(batch.num_layers)
            run_batch_copies(batch, progress)
            assert progress.layers_done == LAYERS
        else:  # what CudaExecutor walks: one CopyPlan per pool, per layer and plane
            for layer in range(batch.num_layers):
                for src, dst, plan in batch.plan().layer_copies(layer):
                    apply_copy_plan(plan, src, dst)
        return sum(c.rows for c in batch.plan().copies)

    rows = run(Direction.BACKUP)
    assert rows == sum(int(h.numel()) for h, _ in moved.values())
    assert_same(snapshot(group, "host"), host_want)  # the padding rows of the host stay as they were
    assert_same(snapshot(group, "device"), dev_before)

    _wipe_device(group)
    dev_want = {key: torch.zeros_like(t) for key, t in dev_before.items()}
    for (name, j, p), t in dev_want.items():
        _, d = moved[name]
        t[d] = dev_before[name, j, p][d]
    run(Direction.LOAD)
    assert_same(snapshot(group, "device"), dev_want)


def test_a_pool_with_no_valid_row_is_not_copied_at_all() -> None:
    group = make_group("per_layer", "layer_first", 16)
    op = CacheOperation(0, Direction.BACKUP, (
        PoolTransfer("kv", PageList([0], 16), PageList([1], 16), valid=(3,)),
        PoolTransfer("c4", None, None, indices_from_pool="kv", valid=(0,)),
    ), 0, 0)
    plan = plan_batch(Direction.BACKUP, [op], group)
    assert [(c.name, c.rows) for c in plan.copies] == [("kv", 3)]
    assert plan.nbytes == 3 * group["kv"].slot_nbytes
