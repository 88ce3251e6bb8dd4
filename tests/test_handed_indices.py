"""Index tensors a handle hands out are the caller's (issue 30, point 4).

Nine in-place writes an engine might make to a tensor it was handed
(through torch, through numpy, through ``.data``) must change neither what
the handle's next read returns nor what a `free_host` of that next read (or
of the handle itself) frees. Single and bulk paths, host and device sides.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import numpy as np
import pytest
import torch
from conftest import pages

from kvtier import TransferScheduler
from kvtier.storage import KeyNamespace, page_keys
from kvtier.testing import MemoryStore, full_attention_group, hybrid_group

WAIT_S = 20


def _np_item(t: torch.Tensor) -> None:
    np.asarray(t)[0] = 99


def _data_rebind(t: torch.Tensor) -> None:
    t.data = torch.full_like(t, 7)


def _data_item(t: torch.Tensor) -> None:
    t.data[0] = 99


def _numpy_sub(t: torch.Tensor) -> None:
    t.numpy()[:] -= 4


def _from_numpy_sub(t: torch.Tensor) -> None:
    torch.from_numpy(t.numpy()).sub_(4)


def _item(t: torch.Tensor) -> None:
    t[0] = 99


def _fill(t: torch.Tensor) -> None:
    t.fill_(-1)


def _unsqueeze(t: torch.Tensor) -> None:
    t.unsqueeze_(0)


def _set(t: torch.Tensor) -> None:
    t.set_(torch.zeros(3, dtype=t.dtype))


WRITES: dict[str, Callable[[torch.Tensor], None]] = {
    "np.asarray(t)[0]=v": _np_item,
    "t.data=other": _data_rebind,
    "t.data[0]=v": _data_item,
    "t.numpy()[:]-=4": _numpy_sub,
    "from_numpy(t.numpy()).sub_": _from_numpy_sub,
    "t[0]=v": _item,
    "t.fill_": _fill,
    "t.unsqueeze_": _unsqueeze,
    "t.set_": _set,
}


def _snapshot(indices: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in indices.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("path", ["single", "bulk"])
@pytest.mark.parametrize("write", list(WRITES))
async def test_a_write_to_handed_host_indices_changes_no_later_read_nor_what_free_host_frees(
    path: str, write: str
) -> None:
    group = hybrid_group()
    ps = group["kv"].page_size
    requests = [{"kv": pages(i, 2 * i + 1, page_size=ps)} for i in range(3)] if path == "bulk" else [
        {"kv": pages(0, 3, page_size=ps)}]
    async with TransferScheduler(group) as sched:
        with anyio.fail_after(WAIT_S):
            if path == "single":
                handles = [await sched.backup(requests[0])]
            else:
                handles = await sched.backup_many(requests)
            for h in handles:
                await h
        target = handles[0]
        want = _snapshot(target.host_indices)
        others = [_snapshot(h.host_indices) for h in handles[1:]]
        for t in target.host_indices.values():
            WRITES[write](t)
        for h in handles:  # the bulk path's first reads of the others are views too
            for t in h.host_indices.values():
                WRITES[write](t)
        assert _same(target.host_indices, want), write
        assert all(_same(h.host_indices, o) for h, o in zip(handles[1:], others))
        kv = group["kv"].host.allocator
        assert kv is not None
        before = kv.num_free_slots
        sched.free_host(target.host_indices)
        # Exactly the handle's pages went back: its kv pages, none of another's.
        assert kv.num_free_slots == before + want["kv"].numel()
        for h, o in zip(handles[1:], others):
            sched.free_host(h)  # a handle itself frees its pages
        assert kv.num_free_slots == group["kv"].host.slots


@pytest.mark.parametrize("path", ["single", "bulk"])
@pytest.mark.parametrize("write", list(WRITES))
async def test_a_write_to_handed_device_indices_changes_no_later_read(path: str, write: str) -> None:
    group = full_attention_group(page_size=4, device_allocator=True)
    async with TransferScheduler(group) as sched:
        with anyio.fail_after(WAIT_S):
            backups = await sched.backup_many([{"kv": pages(i, page_size=4)} for i in range(3)])
            for h in backups:
                await h
            hosts = [{"kv": h.host_indices["kv"]} for h in backups]
            loads = [await sched.load(hosts[0])] if path == "single" else await sched.load_many(hosts)
            for h in loads:
                await h
        wants = [_snapshot(h.device_indices) for h in loads]
        for h in loads:
            for t in h.device_indices.values():
                WRITES[write](t)
        assert all(_same(h.device_indices, w) for h, w in zip(loads, wants)), write
        for h in backups:
            sched.free_host(h)


@pytest.mark.parametrize("path", ["single", "bulk"])
@pytest.mark.parametrize("write", list(WRITES))
async def test_a_write_to_the_first_read_changes_no_later_read(path: str, write: str) -> None:
    """A request's first read is a view of the carrier's handed array; the later reads
    come from kvtier's own record, never from that array."""
    group = full_attention_group(page_size=4)
    requests = [{"kv": pages(i, page_size=4)} for i in range(3)]
    async with TransferScheduler(group) as sched:
        with anyio.fail_after(WAIT_S):
            handles = ([await sched.backup(r) for r in requests] if path == "single"
                       else await sched.backup_many(requests))
            for h in handles:
                await h
        firsts = [h.host_indices for h in handles]
        wants = [_snapshot(f) for f in firsts]
        for f in firsts:
            for t in f.values():
                WRITES[write](t)
        assert all(_same(h.host_indices, w) for h, w in zip(handles, wants)), write
        for h in handles:
            sched.free_host(h)
        assert group["kv"].host.allocator.num_free_slots == group["kv"].host.slots  # type: ignore[union-attr]


async def test_two_reads_of_one_handle_share_no_memory() -> None:
    group = full_attention_group(page_size=4)
    async with TransferScheduler(group) as sched:
        handles = await sched.backup_many([{"kv": pages(i, page_size=4)} for i in range(2)])
        for h in handles:
            await h
        a, b = handles[0].host_indices["kv"], handles[0].host_indices["kv"]
        assert not np.shares_memory(a.numpy(), b.numpy())
        c = handles[1].host_indices["kv"]
        assert not np.shares_memory(a.numpy(), c.numpy())
        assert torch.equal(a, b)
        for h in handles:
            sched.free_host(h.outcome())  # a result frees its operation's pages too
        assert group["kv"].host.allocator.num_free_slots == group["kv"].host.slots  # type: ignore[union-attr]


async def test_free_host_takes_a_prefetch_result_and_a_bulk_result() -> None:
    group = full_attention_group(page_size=4)
    store = MemoryStore()
    keys = {"kv": page_keys(KeyNamespace.for_pool(group, "kv", model="m"), list(range(8)))}
    async with TransferScheduler(group, storage=store) as sched:
        with anyio.fail_after(WAIT_S):
            b = await sched.backup({"kv": pages(0, 1, page_size=4)})
            await (await sched.write_storage(b.host_indices, keys))
            got = await (await sched.prefetch(keys, policy="wait_complete"))
            bulk = await (await sched.backup_arrays({"kv": np.arange(8).reshape(2, 4)}))
        kv = group["kv"].host.allocator
        assert kv is not None and kv.num_free_slots == group["kv"].host.slots - 3 * 8  # two pages each
        for held in (got, bulk, b):
            sched.free_host(held)
        assert kv.num_free_slots == group["kv"].host.slots
