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
