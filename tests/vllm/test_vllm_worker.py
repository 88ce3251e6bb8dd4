"""The worker side without an engine: vLLM's specs handed to a `KvtierOffloadingWorker`
over plain int8 block tensors, as vLLM's CPU build registers them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm

BLOCKS, BLOCK_BYTES, LAYERS = 8, 256, 2


def kv_caches() -> Any:
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    torch.manual_seed(0)
    tensors = [torch.randint(-128, 127, (BLOCKS, BLOCK_BYTES), dtype=torch.int8) for _ in range(LAYERS)]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=BLOCK_BYTES) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=BLOCK_BYTES) for i in range(LAYERS)]],
    )


def device(blocks: list[int]) -> Any:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])


def wait_for(what: Any, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting for the worker")
        time.sleep(0.01)


def block(caches: Any, b: int) -> list[torch.Tensor]:
    return [t.tensor[b].clone() for t in caches.tensors]


def test_a_stored_block_the_staging_scheduler_refused_is_rewritten_by_the_next_write_through(
    tmp_path: Path,
) -> None:
    from kvtier.integrations.vllm import KvtierBlocks, KvtierOffloadingWorker, parse_options

    caches = kv_caches()
    keys = [bytes([i]) * 32 for i in range(2)]
    options = parse_options({"kvtier": {"store_path": str(tmp_path / "store")}})
    worker = KvtierOffloadingWorker(caches, host_blocks=4, options=options, staging_blocks=4)
    try:
        want = [block(caches, 0), block(caches, 1)]
        assert worker.submit_store(1, device([0, 1]), KvtierBlocks([0, 1], keys))
        wait_for(lambda: worker.counts.blocks_written_through == 2)
        # Damage the second stored block as a disk would: one byte flipped, same length.
        (data,) = (tmp_path / "store").rglob(f"{keys[1].hex()}.data")
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        data.write_bytes(bytes(raw))

        assert worker.submit_load(2, KvtierBlocks([-1, -1], keys), device([4, 5]))
        worker.wait({2})
        wait_for(lambda: bool(worker.get_finished()))
        assert worker.take_invalid_blocks() == {5}
        stats = worker.statistics()
        assert (stats["blocks_loaded_from_store"], stats["blocks_refused"], stats["blocks_failed"]) == (1, 1, 0)
        assert stats["refused"] == {"store_checksum": 1} and stats["keys_to_rewrite"] == 1, stats
        assert all(torch.equal(a, b) for a, b in zip(block(caches, 4), want[0], strict=True))

        # vLLM recomputes block 5 and stores it (a new host page): its write-through puts it again.
        caches.tensors[0].tensor[5].copy_(want[1][0])
        caches.tensors[1].tensor[5].copy_(want[1][1])
        assert worker.submit_store(3, device([5]), KvtierBlocks([2], [keys[1]]))
        wait_for(lambda: worker.counts.blocks_written_through == 3)
        assert worker.statistics()["keys_to_rewrite"] == 0
        assert worker.statistics()["scheduler"]["write_storage"]["bytes"] == 3 * worker.block_bytes
        assert data.read_bytes() != bytes(raw), "the damaged file was not rewritten"

        for b in (6, 7):
            caches.tensors[0].tensor[b].zero_()
            caches.tensors[1].tensor[b].zero_()
        assert worker.submit_load(4, KvtierBlocks([-1, -1], keys), device([6, 7]))
        worker.wait({4})
        wait_for(lambda: bool(worker.get_finished()))
        assert worker.take_invalid_blocks() == set()
        for b, w in zip((6, 7), want, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(block(caches, b), w, strict=True))
        assert worker.statistics()["blocks_loaded_from_store"] == 3
    finally:
        worker.shutdown()


@pytest.mark.parametrize("differs", ["dtype", "model"])
def test_a_block_another_engines_identity_stored_is_refused_and_rewritten(tmp_path: Path, differs: str) -> None:
    """vLLM's CPU build hands kvtier int8 block views whatever the KV dtype, so two
    engines of fp8_e4m3 and fp8_e5m2 blocks (or two models) have the same tensors:
    what tells their blocks apart is the block identity each worker's blobs carry
    (`StorageKeys.identity`). Under one storage key, B refuses A's block
    (``store_identity``), recomputes it, and its write-through replaces it."""
    from kvtier.integrations.vllm import KvtierBlocks, KvtierOffloadingWorker, parse_options
    from kvtier.integrations.vllm.loop import StorageKeys

    def identity(dtype: str, model: str) -> Any:
        return StorageKeys(model=model, block_size=32, dtype=dtype, num_layers=LAYERS,
                           block_bytes=LAYERS * BLOCK_BYTES).identity(0)

    caches_a, caches_b = kv_caches(), kv_caches()
    for t in caches_b.tensors:
        t.tensor.neg_()  # engine B's own bytes for the same tokens
    keys = [b"\x07" * 32]
    options = parse_options({"kvtier": {"store_path": str(tmp_path / "store")}})
    a = KvtierOffloadingWorker(caches_a, host_blocks=4, options=options, staging_blocks=4,
                               identity=identity("fp8_e4m3", "m"))
    b_ident = identity("fp8_e5m2", "m") if differs == "dtype" else identity("fp8_e4m3", "other-model")
    b = KvtierOffloadingWorker(caches_b, host_blocks=4, options=options, staging_blocks=4, identity=b_ident)
    try:
        assert a.submit_store(1, device([0]), KvtierBlocks([0], keys))
        wait_for(lambda: a.counts.blocks_written_through == 1)
        before = block(caches_b, 3)
        assert b.submit_load(2, KvtierBlocks([-1], keys), device([3]))
        b.wait({2})
        wait_for(lambda: bool(b.get_finished()))
        assert b.take_invalid_blocks() == {3}
        stats = b.statistics()
        assert stats["refused"] == {"store_identity": 1} and stats["keys_to_rewrite"] == 1, stats
        assert all(torch.equal(x, y) for x, y in zip(block(caches_b, 3), before, strict=True))  # untouched
        want = block(caches_b, 1)
        assert b.submit_store(3, device([1]), KvtierBlocks([1], keys))
        wait_for(lambda: b.counts.blocks_written_through == 1)
        assert b.submit_load(4, KvtierBlocks([-1], keys), device([5]))
        b.wait({4})
        wait_for(lambda: bool(b.get_finished()))
        assert b.take_invalid_blocks() == set()
        assert all(torch.equal(x, y) for x, y in zip(block(caches_b, 5), want, strict=True))
    finally:
        a.shutdown()
        b.shutdown()


def test_wait_all_returns_once_every_submitted_job_ended_and_its_blocks_are_counted() -> None:
    """A job's counts move on kvtier's thread when it ends; a reader of them right
    after vLLM's last step (the overhead benchmark) calls `wait_all` first."""
    from kvtier.integrations.vllm import KvtierBlocks, KvtierOffloadingWorker, parse_options

    caches = kv_caches()
    worker = KvtierOffloadingWorker(caches, host_blocks=8, options=parse_options({}), staging_blocks=4)
    try:
        want = [block(caches, b) for b in range(4)]
        for job, pair in enumerate(([0, 1], [2], [3]), start=1):
            assert worker.submit_store(job, device(pair), KvtierBlocks([b + 4 for b in pair], None))
        worker.wait_all()
        assert (worker.counts.stores, worker.counts.blocks_stored) == (3, 4)
        for b in range(4):
            for t in caches.tensors:
                t.tensor[b].zero_()
        assert worker.submit_load(4, KvtierBlocks([4, 5, 6, 7], None), device([0, 1, 2, 3]))
        worker.wait_all()
        assert worker.counts.blocks_loaded_from_host == 4
        assert sorted(r.job_id for r in worker.get_finished()) == [1, 2, 3, 4]
        for b in range(4):
            assert all(torch.equal(x, y) for x, y in zip(block(caches, b), want[b], strict=True))
    finally:
        worker.shutdown()


def test_a_load_stopped_at_a_refused_block_has_every_block_behind_it_rewritten(tmp_path: Path) -> None:
    """Every stored block damaged: the load refuses the first and reads none
    after it, vLLM recomputes them all, and the next write-through puts every
    one again (those behind were not read, so "already stored" proves nothing):
    afterwards each block reads back byte-exact."""
    from kvtier.integrations.vllm import KvtierBlocks, KvtierOffloadingWorker, parse_options

    caches = kv_caches()
    keys = [bytes([i + 1]) * 32 for i in range(3)]
    store = tmp_path / "store"
    worker = KvtierOffloadingWorker(caches, host_blocks=6, options=parse_options({"kvtier": {"store_path": str(store)}}),
                                    staging_blocks=4)
    try:
        want = [block(caches, b) for b in range(3)]
        assert worker.submit_store(1, device([0, 1, 2]), KvtierBlocks([0, 1, 2], keys))
        wait_for(lambda: worker.counts.blocks_written_through == 3)
        files = [next(store.rglob(f"{k.hex()}.data")) for k in keys]
        whole = [f.read_bytes() for f in files]
        for f in files:
            raw = bytearray(f.read_bytes())
            raw[len(raw) // 2] ^= 0x40
            f.write_bytes(bytes(raw))

        assert worker.submit_load(2, KvtierBlocks([-1, -1, -1], keys), device([4, 5, 6]))
        worker.wait({2})
        wait_for(lambda: bool(worker.get_finished()))
        assert worker.take_invalid_blocks() == {4, 5, 6}
        stats = worker.statistics()
        assert stats["refused"] == {"store_checksum": 1} and stats["blocks_failed"] == 2, stats
        assert stats["keys_to_rewrite"] == 3, stats

        # vLLM recomputes the three blocks (the same bytes) and stores them into new host pages.
        assert worker.submit_store(3, device([0, 1, 2]), KvtierBlocks([3, 4, 5], keys))
        wait_for(lambda: worker.counts.blocks_written_through == 6)
        assert worker.statistics()["keys_to_rewrite"] == 0
        assert [f.read_bytes() for f in files] == whole, "a block behind the refused one was not rewritten"

        for b in (4, 5, 6):
            for t in caches.tensors:
                t.tensor[b].zero_()
        assert worker.submit_load(4, KvtierBlocks([-1, -1, -1], keys), device([4, 5, 6]))
        worker.wait({4})
        wait_for(lambda: bool(worker.get_finished()))
        assert worker.take_invalid_blocks() == set()
        for b, w in zip((4, 5, 6), want, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(block(caches, b), w, strict=True))
    finally:
        worker.shutdown()


def kvtier_threads() -> list[str]:
    import threading

    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvtier-vllm"))


def test_a_worker_dropped_without_shutdown_ends_its_thread_and_frees_its_host_tier(tmp_path: Path) -> None:
    """DESIGN lesson 26: nothing of kvtier's (a thread target, an atexit hook)
    keeps a dropped worker alive; shutdown() lets go of the host tier even
    while a reference to the worker remains."""
    import gc
    import weakref

    from kvtier.integrations.vllm import KvtierBlocks, KvtierOffloadingWorker, live_workers, parse_options

    before = kvtier_threads()
    options = parse_options({"kvtier": {"store_path": str(tmp_path / "store")}})
    worker = KvtierOffloadingWorker(kv_caches(), host_blocks=4, options=options, staging_blocks=2)
    assert worker.submit_store(1, device([0, 1]), KvtierBlocks([0, 1], [b"\x01" * 32, b"\x02" * 32]))
    worker.wait_all()
    wait_for(lambda: worker.counts.blocks_written_through == 2)
    refs = [weakref.ref(worker), weakref.ref(worker.group["kv"].host)]
    assert worker.staging is not None
    refs.append(weakref.ref(worker.staging["kv"].host))
    assert kvtier_threads() == sorted([*before, "kvtier-vllm-worker"])
    del worker
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert kvtier_threads() == before and live_workers() == []

    kept = KvtierOffloadingWorker(kv_caches(), host_blocks=4, options=options, staging_blocks=2)
    host = weakref.ref(kept.group["kv"].host)
    kept.shutdown()
    gc.collect()
    assert host() is None and kvtier_threads() == before and live_workers() == []
    assert "shut down" in repr(kept) and kept.statistics()["host_blocks"] == 4


def test_the_managers_shutdown_and_a_dropped_store_client_end_the_lookup_thread(tmp_path: Path) -> None:
    import gc

    from kvtier.integrations.vllm import KvtierOffloadingManager, parse_options
    from kvtier.integrations.vllm.loop import StoreClient
    from kvtier.integrations.vllm.manager import StoreLookup

    before = kvtier_threads()
    options = parse_options({"kvtier": {"store_path": str(tmp_path / "store")}})
    client = StoreClient(options, timeout_s=5.0)
    manager = KvtierOffloadingManager(8, store=StoreLookup(client.exists, lambda k: k, close=client.close))
    assert not manager._store.contains(b"\x03" * 32)  # type: ignore[union-attr]
    assert kvtier_threads() == sorted([*before, "kvtier-vllm-lookup"])
    manager.shutdown()
    assert kvtier_threads() == before
    manager.shutdown()  # again: nothing left to end

    client = StoreClient(options, timeout_s=5.0)
    assert kvtier_threads() == sorted([*before, "kvtier-vllm-lookup"])
    del client
    gc.collect()
    assert kvtier_threads() == before
