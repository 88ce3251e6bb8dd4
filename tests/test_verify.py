"""Verify mode: corruption of host memory is detected before a load copies,
and a host page's checksum sees any one byte of its rows change."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_rows_equal, rows, used, wipe
from kvtier import CorruptionDetected, SchedulerConfig, TransferScheduler
from kvtier.pools import DevicePool, PoolGroup
from kvtier.scheduler import verify
from kvtier.testing import hybrid_group


def pages(*ps: int, page_size: int = 8) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in ps])


def request(*ps: int, state: int) -> dict[str, torch.Tensor]:
    idx = pages(*ps)
    return {"kv": idx, "swa": idx, "tok": idx, "state": torch.tensor([state])}


@pytest.mark.parametrize("carrier", ["shared", "own"])
@pytest.mark.parametrize(("pool", "layout"), [("kv", "layer_first"), ("c4", "page_first"), ("idx", "layer_first"), ("state", "page_first")])
async def test_corrupted_host_page_fails_the_load_and_copies_nothing(pool: str, layout: str, carrier: str) -> None:
    """The corrupted load shares its queue entry with the good one (joined),
    or has its own (another priority): either way none of its bytes reach the
    device, and the good load is exact."""
    group = hybrid_group(layout=layout)
    async with TransferScheduler(group, config=SchedulerConfig(verify=True)) as sched:
        good = await sched.backup(request(0, state=0))
        bad = await sched.backup(request(1, 2, state=1))
        await good
        await bad
        expected = {n: rows(group, n, i) for n, i in good.device_indices.items() if n != "tok"}
        # Behind kvtier's back: flip one value in the second page the bad op holds.
        host_rows = bad.host_indices[pool]
        victim = host_rows[-1]
        view = group[pool].host.layer_view(0, 0)
        view[victim] = view[victim] + 1 if view.dtype.is_floating_point else view[victim] ^ 1
        wipe(group)
        owners = ("kv", "swa", "tok", "state")
        bad_load = await sched.load({n: bad.host_indices[n] for n in owners}, request(5, 6, state=5))
        good_load = await sched.load({n: good.host_indices[n] for n in owners}, request(3, state=3),
                                     priority=0 if carrier == "shared" else 1)
        assert (good_load._carrier is bad_load._carrier) == (carrier == "shared")  # type: ignore[attr-defined]
        with pytest.raises(CorruptionDetected) as info:
            await bad_load
        await good_load
        err = info.value
        owner_page_size = 1 if pool == "state" else 8
        owner = {"c4": "kv", "idx": "tok"}.get(pool, pool)
        expected_page = int(bad.host_indices[owner][-1]) // owner_page_size
        assert err.pool == pool and err.pages == [expected_page]
        assert f"pool {pool!r} host pages [{expected_page}]" in str(err)
        # Nothing of the corrupted load reached the device; the good one is exact.
        for name in ("kv", "swa"):
            assert bool((rows(group, name, pages(5, 6))[0] == 0).all())
        for name, want in expected.items():
            assert_rows_equal(rows(group, name, good_load.device_indices[name]), want)
        assert sched.statistics().load.failed == 1
        sched.free_host({n: bad.host_indices[n] for n in owners})
        sched.free_host({n: good.host_indices[n] for n in owners})
    assert all(v in (0, None) for v in used(group).values())


async def test_verify_mode_round_trips_clean_pages() -> None:
    group = hybrid_group()
    async with TransferScheduler(group, config=SchedulerConfig(verify=True)) as sched:
        b = await sched.backup(request(0, 4, state=2))
        await b
        before = {n: rows(group, n, i) for n, i in b.device_indices.items() if n != "tok"}
        wipe(group)
        load = await sched.load({n: b.host_indices[n] for n in ("kv", "swa", "tok", "state")}, request(2, 7, state=9))
        await load
        for name, want in before.items():
            assert_rows_equal(rows(group, name, load.device_indices[name]), want)


# -- page_checksums: one flipped byte changes its page's checksum, no other ----

LAYOUTS = ("layer_first", "page_first")
PAGES = [4, 0, 2, 5, 1, 3]  # out of order: a checksum must follow its page
VICTIM = 2


def odd_rows_group(layout: str) -> PoolGroup:
    """Pools whose rows are not whole 32-bit words.

    * ``odd``: page_size 3, uint8 x5 and bf16 x3 rows (15 and 18 bytes a page);
    * ``odd_side``: its sidecar, one uint8 x3 row per page (3 bytes a page);
    * ``rows3``: page_size 4, uint8 x3 and bf16 x1 rows (12 and 8 bytes a page:
      whole words, but rows end inside a word);
    * ``rows3_side``: its sidecar, two rows per page of uint8 x7 and fp16 x3.
    """

    def device(layers: int, slots: int, planes: list[tuple[tuple[int, ...], torch.dtype]]) -> DevicePool:
        return DevicePool([[torch.zeros((slots, *shape), dtype=dtype) for shape, dtype in planes] for _ in range(layers)])

    group = PoolGroup()
    group.add_pool("odd", device=device(2, 6, [((5,), torch.uint8), ((3,), torch.bfloat16)]),
                   page_size=3, host_slots=24, layout=layout)  # type: ignore[arg-type]
    group.add_sidecar("odd_side", source="odd", rows_per_page=1, device=device(3, 2, [((3,), torch.uint8)]),
                      layout=layout)  # type: ignore[arg-type]
    group.add_pool("rows3", device=device(2, 8, [((3,), torch.uint8), ((1,), torch.bfloat16)]),
                   page_size=4, host_slots=32, layout=layout)  # type: ignore[arg-type]
    group.add_sidecar("rows3_side", source="rows3", rows_per_page=2,
                      device=device(2, 4, [((7,), torch.uint8), ((3,), torch.float16)]),
                      layout=layout)  # type: ignore[arg-type]
    return group


def random_host_bytes(group: PoolGroup, seed: int = 0) -> None:
    """Fill every host buffer with random bytes (host pools start uninitialised)."""
    gen = torch.Generator().manual_seed(seed)
    for spec in group:
        if not spec.host.has_bytes:
            continue
        for p in range(len(spec.host.planes)):
            raw = spec.host.buffer(p).view(torch.uint8)  # type: ignore[union-attr]
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def page_bytes(group: PoolGroup, pool: str, page: int, layer: int, plane: int) -> list[torch.Tensor]:
    """Each host row of ``page`` in ``pool`` at (layer, plane), as a writable uint8 view."""
    spec = group[pool]
    view = spec.host.layer_view(layer, plane)
    first = page * spec.page_size  # rows_per_page for a sidecar
    return [view[r].reshape(-1).view(torch.uint8) for r in range(first, first + spec.page_size)]


def flip(group: PoolGroup, pool: str, page: int, layer: int, plane: int, where: str) -> None:
    """Flip every bit of one byte of ``page``'s rows: the first, the middle or the
    last byte of the page's bytes, or the last byte of its first row."""
    rows = page_bytes(group, pool, page, layer, plane)
    width = rows[0].numel()
    total = width * len(rows)
    k = {"first": 0, "middle": total // 2, "last": total - 1, "end of first row": width - 1}[where]
    byte = rows[k // width][k % width : k % width + 1]
    byte.bitwise_xor_(0xFF)


def owners(group: PoolGroup) -> dict[str, list[int]]:
    return {spec.name: list(PAGES) for spec in group if spec.owns_slots}


CHECKSUM_CASES = [
    # pool, builder: rows of whole words (kv, c4, idx, state) or not (the rest)
    ("kv", "hybrid"),  # slot-owning, float32 rows
    ("c4", "hybrid"),  # sidecar, bf16 rows, 2 rows a page
    ("idx", "hybrid"),  # sidecar of a logical anchor, fp16 rows
    ("state", "hybrid"),  # page_size 1; an int8 x4 plane is one word a page
    ("odd", "odd"),
    ("odd_side", "odd"),
    ("rows3", "odd"),
    ("rows3_side", "odd"),
]


def build(kind: str, layout: str) -> PoolGroup:
    group = hybrid_group(layout=layout) if kind == "hybrid" else odd_rows_group(layout)  # type: ignore[arg-type]
    random_host_bytes(group)
    return group


@pytest.mark.parametrize("where", ["first", "middle", "last", "end of first row"])
@pytest.mark.parametrize("spot", ["first layer and plane", "last layer and plane"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("pool", "kind"), CHECKSUM_CASES)
def test_one_flipped_byte_changes_that_page_checksum_only(pool: str, kind: str, layout: str, spot: str, where: str) -> None:
    group = build(kind, layout)
    host = group[pool].host
    layer, plane = (0, 0) if spot.startswith("first") else (host.num_layers - 1, len(host.planes) - 1)
    before = verify.page_checksums(group, pool, PAGES)
    assert len(set(before)) == len(PAGES)  # random pages differ, so the test can see a swap
    flip(group, pool, VICTIM, layer, plane, where)
    after = verify.page_checksums(group, pool, PAGES)
    assert [p for p, b, a in zip(PAGES, before, after) if b != a] == [VICTIM]
    flip(group, pool, VICTIM, layer, plane, where)  # flipped back, the checksum is as it was
    assert verify.page_checksums(group, pool, PAGES) == before


@pytest.mark.parametrize("where", ["first", "middle", "last", "end of first row"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("pool", "kind"), CHECKSUM_CASES)
def test_mismatches_names_the_pool_and_page_of_one_flipped_byte(pool: str, kind: str, layout: str, where: str) -> None:
    group = build(kind, layout)
    host_pages = owners(group)
    store = verify.record(group, host_pages)
    assert verify.mismatches(store, group, host_pages) is None
    host = group[pool].host
    flip(group, pool, VICTIM, host.num_layers - 1, len(host.planes) - 1, where)
    assert verify.mismatches(store, group, host_pages) == (pool, [VICTIM])
    now = verify.record(group, host_pages)
    changed = [(name, page) for name in store for page in store[name] if now[name][page] != store[name][page]]
    assert changed == [(pool, VICTIM)]
    # What a scheduler's load of the other pages would check is clean.
    others = {name: [p for p in pages if p != VICTIM] for name, pages in host_pages.items()}
    assert verify.mismatches(store, group, others) is None
