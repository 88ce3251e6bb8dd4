"""Transfers that carry valid row counts per page (`PoolTransfer.valid`): only
the rows that hold data move, on the CPU path (`run_batch_copies`) and on the
plan the CUDA executor walks (`PoolCopy.plan`, `BatchPlan.layer_copies`), for
slot-owning pools and sidecars alike; every other row is left as it was.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from conftest import assert_rows_equal, rows, used, wipe
from kvtier import CorruptionDetected, InvalidIndices, SchedulerConfig, TransferScheduler
from kvtier.metrics import KvtierCollector
from kvtier.pools import PageList, PoolGroup
from kvtier.storage import BLOB_HEADER_BYTES, KeyNamespace, PageCorrupted, decode_page, encode_page, page_keys
from kvtier.testing import MemoryStore, hybrid_group
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


# ---------------------------------------------------------------------------
# through the scheduler: backup(valid_rows=), then load, verify mode and the store


def _pages(*ps: int, page_size: int = 8) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in ps])


# kv: 11 of 16 rows (page 2 of 2 holds 3); c4 (2 rows a kv page): 1 of 4; swa: 5 of 16 (page 2 empty).
VALID = {"kv": 11, "c4": 1, "swa": 5}


def _host_rows(group: PoolGroup, pool: str, idx: torch.Tensor) -> list[torch.Tensor]:
    host = group[pool].host
    return [host.layer_view(j, p)[idx].clone() for j in range(host.num_layers) for p in range(len(host.planes))]


def _zero_host(group: PoolGroup, seed: int | None = None) -> None:
    """Host pools start as uninitialised memory (NaNs compare unequal): zero
    them, or with ``seed`` fill them with random values."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    for spec in group:
        if spec.host.has_bytes:
            for p in range(len(spec.host.planes)):
                buf = spec.host.buffer(p)  # type: ignore[union-attr]
                if gen is None:
                    buf.zero_()
                else:
                    buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))


def _first(idx: torch.Tensor, pool: str) -> torch.Tensor:
    return idx[: VALID[pool]] if pool in VALID else idx


async def test_backup_with_rows_moves_only_them_and_so_does_every_later_step() -> None:

    group = hybrid_group()
    _zero_host(group)
    request = {"kv": _pages(0, 1), "swa": _pages(0, 1), "tok": _pages(0, 1), "state": torch.tensor([0])}
    owners = ("kv", "swa", "tok", "state")
    store = MemoryStore()
    async with TransferScheduler(group, config=SchedulerConfig(verify=True), storage=store) as sched:
        before = used(group)
        for bad, rule in (({"nope": 1}, "valid_rows names pool 'nope'"), ({"kv": 17}, r"int in 0\.\.16"),
                          ({"c4": -1}, r"int in 0\.\.4"), ({"tok": 3}, "valid_rows names pool 'tok'")):
            with pytest.raises(InvalidIndices, match=rule):
                await sched.backup(request, valid_rows=bad)
        assert used(group) == before and not any(group.valid_rows.values())

        host_before = {n: _host_rows(group, n, torch.arange(group[n].host.slots)) for n in ("kv", "swa", "c4")}
        b = await sched.backup(request, valid_rows=VALID)
        await b
        side = {n: b.device_indices[n] for n in ("c4", "swa_state", "idx", "state")}
        want = {n: rows(group, n, _first(i, n)) for n, i in {**request, **side}.items() if n != "tok"}
        slot = group["kv"].slot_nbytes
        moved = (11 * slot + 5 * group["swa"].slot_nbytes + 1 * group["c4"].slot_nbytes
                 + 2 * 3 * group["swa_state"].slot_nbytes + 2 * group["idx"].slot_nbytes
                 + group["state"].slot_nbytes)
        assert sched.executor.statistics().nbytes == moved  # type: ignore[attr-defined]
        assert sched.statistics().backup.bytes == moved  # the lane counts what moved too
        assert b.outcome().nbytes == b.nbytes == moved  # and so does the result
        # The host rows past the valid ones are as they were: not copied.
        for n in ("kv", "swa", "c4"):
            h = b.host_indices[n]
            after = _host_rows(group, n, h[VALID[n]:])
            assert_rows_equal(after, [t[h[VALID[n]:]] for t in host_before[n]])

        # Load into wiped device rows: the valid rows land, the others stay zero.
        wipe(group)
        dst = {"kv": _pages(3, 4), "swa": _pages(3, 4), "tok": _pages(3, 4), "state": torch.tensor([2])}
        load = await sched.load({n: b.host_indices[n] for n in owners}, dst)
        await load
        for n, w in want.items():
            idx = load.device_indices[n]
            assert_rows_equal(rows(group, n, _first(idx, n)), w)
            if n in VALID:
                assert all(bool((t == 0).all()) for t in rows(group, n, idx[VALID[n]:]))

        # Verify mode hashes the rows moved: a padding row may change, a valid one may not.
        view = group["kv"].host.layer_view(0, 0)
        pad, live = b.host_indices["kv"][VALID["kv"]], b.host_indices["kv"][VALID["kv"] - 1]
        view[pad] += 1
        await (await sched.load({n: b.host_indices[n] for n in owners}, dst))
        kept = view[live].clone()
        view[live] += 1
        with pytest.raises(CorruptionDetected):
            await (await sched.load({n: b.host_indices[n] for n in owners}, dst))
        view[live] = kept

        # The store keeps the valid rows only, and a prefetch lands exactly those.
        keys = {n: page_keys(KeyNamespace.for_pool(group, n, model="m"), list(range(16 if n != "state" else 1)))
                for n in owners}
        written = await (await sched.write_storage({n: b.host_indices[n] for n in owners}, keys))
        assert written.nbytes == moved  # the rows stored, as the rows moved
        kv_page = store.pages[keys["kv"][1]]
        assert len(kv_page["kv"]) - 40 == 3 * slot and len(kv_page["c4"]) == 40  # a header, no row
        sched.free_host({n: b.host_indices[n] for n in owners})
        assert not any(group.valid_rows.values())  # a page's counts go with it
        got = await (await sched.prefetch(keys, policy="wait_complete", all_pools=True))
        assert got.nbytes == moved  # the rows read back
        wipe(group)
        load = await sched.load(dict(got.host_indices), dst)
        await load
        for n, w in want.items():
            idx = load.device_indices[n]
            assert_rows_equal(rows(group, n, _first(idx, n)), w)
            if n in VALID:
                assert all(bool((t == 0).all()) for t in rows(group, n, idx[VALID[n]:]))
        sched.free_host(dict(got.host_indices))
    assert all(v in (0, None) for v in used(group).values())


async def test_backup_many_takes_rows_per_request() -> None:

    group = hybrid_group()
    reqs = [{"kv": _pages(0, 1)}, {"kv": _pages(2)}, {"kv": _pages(4, 5)}]
    async with TransferScheduler(group) as sched:
        with pytest.raises(InvalidIndices, match="request 1: .*int in 0\\.\\.8"):
            await sched.backup_many(reqs, valid_rows=[None, {"kv": 9}, None])
        with pytest.raises(InvalidIndices, match="one mapping .* per request, 3 of them"):
            await sched.backup_many(reqs, valid_rows=[None])
        assert used(group)["kv"] == 0
        want = [rows(group, "kv", r["kv"][:n]) for r, n in zip(reqs, (11, 8, 2))]
        before = sched.executor.statistics().nbytes  # type: ignore[attr-defined]
        handles = await sched.backup_many(reqs, valid_rows=[{"kv": 11, "c4": 0}, None, {"kv": 2}])
        for h in handles:
            await h
        c4 = group["c4"].slot_nbytes
        moved = sched.executor.statistics().nbytes - before  # type: ignore[attr-defined]
        assert moved == (11 + 8 + 2) * group["kv"].slot_nbytes + (0 + 2 + 4) * c4
        # Each result counts the rows its own request moved, and they add up to what moved.
        kv_slot = group["kv"].slot_nbytes
        results = [h.outcome() for h in handles]
        for r, (n, m) in zip(results, ((11, 0), (8, 2), (2, 4))):
            assert r.bytes_per_pool["kv"] == n * kv_slot and r.bytes_per_pool["c4"] == m * c4
        assert sum(r.nbytes for r in results) == moved == sum(h.nbytes for h in handles)
        wipe(group)
        loads = await sched.load_many([{"kv": h.host_indices["kv"]} for h in handles],
                                      [{"kv": d} for d in (_pages(1, 3), _pages(6), _pages(0, 7))])
        for load, w, n in zip(loads, want, (11, 8, 2)):
            await load
            assert load.outcome().bytes_per_pool["kv"] == n * kv_slot  # a load moves the valid rows only
            assert_rows_equal(rows(group, "kv", load.device_indices["kv"][:n]), w)
            assert all(bool((t == 0).all()) for t in rows(group, "kv", load.device_indices["kv"][n:]))
        for h in handles:
            sched.free_host({"kv": h.host_indices["kv"]})
    assert not any(group.valid_rows.values())


def test_a_stored_partial_page_holds_its_valid_rows_bound_by_its_checksum() -> None:

    src, dst = hybrid_group(seed=1), hybrid_group(seed=2)
    for g in (src, dst):
        g.freeze()
    _zero_host(src, seed=3)
    _zero_host(dst)
    src.valid_rows.update({"kv": {3: 5}, "c4": {3: 0}})  # page 3 of kv: 5 of 8 rows; its c4 rows: none
    key = b"k" * 32
    blobs = encode_page(src, "kv", 3, key=key)
    slot = src["kv"].slot_nbytes
    assert len(blobs["kv"]) == BLOB_HEADER_BYTES + 5 * slot and len(blobs["c4"]) == BLOB_HEADER_BYTES
    before = _host_rows(dst, "kv", torch.arange(24, 32))
    assert decode_page(dst, "kv", 3, {n: bytes(b) for n, b in blobs.items()}, key=key) == {"kv": 5, "c4": 0}
    after = _host_rows(dst, "kv", torch.arange(24, 32))
    want = _host_rows(src, "kv", torch.arange(24, 29))
    for a, b, w in zip(after, before, want):
        assert torch.equal(a[:5], w) and torch.equal(a[5:], b[5:])  # the valid rows, and nothing else
    # One row fewer: the length in the header is checksummed, the row count with it.
    cut = bytearray(blobs["kv"][: BLOB_HEADER_BYTES + 4 * slot])
    with pytest.raises(PageCorrupted) as info:
        decode_page(dst, "kv", 3, {"kv": bytes(cut), "c4": bytes(blobs["c4"])}, key=key)
    assert info.value.rule == "length"
    cut[8:16] = (4 * slot).to_bytes(8, "little")
    with pytest.raises(PageCorrupted) as info:
        decode_page(dst, "kv", 3, {"kv": bytes(cut), "c4": bytes(blobs["c4"])}, key=key)
    assert info.value.rule == "checksum"
    half = bytearray(blobs["kv"][: BLOB_HEADER_BYTES + 5 * slot - 1])  # not a whole number of rows
    half[8:16] = (5 * slot - 1).to_bytes(8, "little")
    with pytest.raises(PageCorrupted, match="a whole number of them"):
        decode_page(dst, "kv", 3, {"kv": bytes(half), "c4": bytes(blobs["c4"])}, key=key)


async def test_every_byte_count_is_the_valid_rows_bytes() -> None:
    """Backup, load, write_storage and prefetch of partial pages: each handle,
    each result, each lane's ``bytes`` and the Prometheus collector's
    transferred bytes are the bytes of the valid rows, not of whole pages."""
    group = hybrid_group()
    _zero_host(group)
    valid = {"kv": 11, "c4": 1}  # kv: 11 of 16 rows; c4 (kv's sidecar, 2 rows a page): 1 of 4
    moved = sum(n * group[pool].slot_nbytes for pool, n in valid.items())
    assert moved < 2 * (8 * group["kv"].slot_nbytes + 2 * group["c4"].slot_nbytes)  # partial, truly
    store = MemoryStore()
    registry = CollectorRegistry()
    async with TransferScheduler(group, storage=store) as sched:
        registry.register(KvtierCollector(sched))
        backup = await sched.backup({"kv": _pages(0, 1)}, valid_rows=valid)
        await backup
        host = {"kv": backup.host_indices["kv"]}
        load = await sched.load(host, {"kv": _pages(3, 4)})
        await load
        keys = {"kv": page_keys(KeyNamespace.for_pool(group, "kv", model="m"), list(range(16)))}
        write = await sched.write_storage(host, keys)
        await write
        again = await sched.write_storage(host, keys)  # every page is stored: nothing is put
        assert (await again).nbytes == again.nbytes == 0
        sched.free_host(host)
        prefetch = await sched.prefetch(keys, policy="wait_complete", all_pools=True)
        await prefetch
        handles = {"backup": backup, "load": load, "write_storage": write, "prefetch": prefetch}
        assert {lane: h.outcome().nbytes for lane, h in handles.items()} == dict.fromkeys(handles, moved)
        assert {lane: h.nbytes for lane, h in handles.items()} == dict.fromkeys(handles, moved)
        s = sched.statistics()
        assert {lane: getattr(s, lane).bytes for lane in handles} == dict.fromkeys(handles, moved)
        scraped = {lane: registry.get_sample_value("kvtier_transferred_bytes_total", {"lane": lane})
                   for lane in handles}
        assert scraped == dict.fromkeys(handles, float(moved))
        sched.free_host(dict(prefetch.outcome().host_indices))
    assert not any(group.valid_rows.values())
