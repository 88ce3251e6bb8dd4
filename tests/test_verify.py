"""Verify mode: corruption of host memory is detected before a load copies."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_rows_equal, rows, used, wipe
from kvtier import CorruptionDetected, SchedulerConfig, TransferScheduler
from kvtier.testing import hybrid_group


def pages(*ps: int, page_size: int = 8) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in ps])


def request(*ps: int, state: int) -> dict[str, torch.Tensor]:
    idx = pages(*ps)
    return {"kv": idx, "swa": idx, "tok": idx, "state": torch.tensor([state])}


@pytest.mark.parametrize(("pool", "layout"), [("kv", "layer_first"), ("c4", "page_first"), ("idx", "layer_first"), ("state", "page_first")])
async def test_corrupted_host_page_fails_the_load_and_copies_nothing(pool: str, layout: str) -> None:
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
        good_load = await sched.load({n: good.host_indices[n] for n in owners}, request(3, state=3))
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
