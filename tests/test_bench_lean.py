"""The lean floor the benchmark races kvtier against (`kvtier.bench.lean`) keeps
the promises it claims: checks before any change, all-or-nothing pages, a page
not reused while written, results that do not alias its state (its pages live in Python lists)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.bench.lean import LeanScheduler


async def test_the_lean_scheduler_hands_out_distinct_pages_and_refuses_bad_input_unchanged() -> None:
    async with LeanScheduler({"kv": (8, 4)}, num_layers=3) as lean:
        handles = await lean.backup_many([{"kv": torch.tensor([0, 1])}, {"kv": torch.tensor([5])}])
        for h in handles:
            await h
        got = [h.host_indices["kv"] for h in handles]
        assert sorted(torch.cat(got).tolist()) == [0, 1, 2]
        for bad, rule in (({"kv": torch.tensor([8])}, "in \\[0, 8\\)"), ({"kv": torch.tensor([2, 2])}, "twice"),
                          ({"sw": torch.tensor([0])}, "unknown pool")):
            with pytest.raises(ValueError, match=rule):
                await lean.backup(bad)
        with pytest.raises(MemoryError, match="2 pages asked, 1 free"):
            await lean.backup({"kv": torch.tensor([3, 4])})
        last = await lean.backup({"kv": torch.tensor([6])})  # the one free page is still there
        await last
        assert last.host_indices["kv"].tolist() == [3]
        lean.free_host({"kv": torch.cat(got[1:] + [last.host_indices["kv"]])})
        again = await lean.backup({"kv": torch.tensor([7, 6])})
        await again
        assert sorted(again.host_indices["kv"].tolist()) == [2, 3]


async def test_a_page_being_written_cannot_be_freed() -> None:
    async with LeanScheduler({"kv": (4, 4)}, num_layers=1) as lean:
        h = await lean.backup({"kv": torch.tensor([0])})
        with pytest.raises(ValueError, match="still being written"):
            lean.free_host({"kv": h.host_indices["kv"]})
        await h
        lean.free_host({"kv": h.host_indices["kv"]})


async def test_the_copying_lean_scheduler_moves_each_batch_in_its_worker_thread() -> None:
    # The floor under kvtier's lone copying row copies for real: the bytes of
    # each request's slots land in its host pages, in another thread.
    device = torch.arange(6 * 4, dtype=torch.uint8).reshape(6, 4)
    host = torch.zeros(8, 4, dtype=torch.uint8)
    threads = set()

    def copy(slots: dict[str, list[int]], pages: dict[str, list[int]]) -> None:
        threads.add(threading.get_ident())
        host[torch.tensor(pages["kv"])] = device[torch.tensor(slots["kv"])]

    async with LeanScheduler({"kv": (6, 8)}, num_layers=2, copy=copy) as lean:
        handles = [await lean.backup({"kv": torch.tensor(s)}) for s in ([4, 1], [5])]
        handles += await lean.backup_many([{"kv": torch.tensor([0])}, {"kv": torch.tensor([2, 3])}])
        for h in handles:
            await h
        for h, slots in zip(handles, ([4, 1], [5], [0], [2, 3])):
            assert torch.equal(host[h.host_indices["kv"]], device[torch.tensor(slots)])
    assert threads and threading.get_ident() not in threads
