"""Blocks whose store is still in flight, inside vLLM's CPU build.

A request that generates one token finishes in the step that computed its
prompt; vLLM submits the store of those blocks at the start of the next
step, after the scheduler has already looked up that step's new requests.
kvtier's lookup therefore sees the blocks while they are being stored. It
counts them as hits and the worker's load waits for the store to land.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from conftest import BLOCK, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PREFIX_BLOCKS = 3


def prompts() -> tuple[list[int], list[int]]:
    r = random.Random(23)
    prefix = [r.randrange(1, 500) for _ in range(PREFIX_BLOCKS * BLOCK)]
    return prefix + [r.randrange(1, 500) for _ in range(20)], prefix + [r.randrange(1, 500) for _ in range(20)]


def test_a_one_token_request_s_blocks_serve_the_next_request_with_outputs_equal_to_vllm_alone(
    model_dir: str, tmp_path: Path
) -> None:
    first, second = prompts()
    # The first request generates one token; vLLM then drops its own prefix
    # cache, so the second request's prefix can come only from kvtier.
    phases: list[dict[str, Any]] = [
        {"op": "generate", "prompts": [first], "max_tokens": 1},
        {"op": "reset"},
        {"op": "generate", "prompts": [second], "max_tokens": 4},
        {"op": "stats"},
    ]
    run = {"model": model_dir, "num_gpu_blocks": 10, "phases": phases}
    alone = run_engine({**run, "kv": None}, tmp_path, "alone")
    assert alone["returncode"] == 0, alone["log"][-3000:]
    kv = {"connector": "KvtierConnector", "extra": {"cpu_bytes_to_use": 8 << 20}}
    out = run_engine({**run, "kv": kv}, tmp_path, "kvtier")
    assert out["returncode"] == 0, out["log"][-3000:]

    def gen(result: dict[str, Any], i: int) -> dict[str, Any]:
        outputs: list[dict[str, Any]] = [p for p in result["phases"] if p["op"] == "generate"][i]["outputs"]
        return outputs[0]

    for i in (0, 1):
        got, want = gen(out, i), gen(alone, i)
        assert got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"], (i, got, want)
    assert gen(alone, 1)["num_cached_tokens"] == 0  # the control: vLLM alone recomputes the prefix
    assert gen(out, 1)["num_cached_tokens"] == PREFIX_BLOCKS * BLOCK, gen(out, 1)["num_cached_tokens"]
    (stats,) = next(p for p in out["phases"] if p["op"] == "stats")["workers"]
    assert stats["blocks_loaded_from_host"] == PREFIX_BLOCKS, stats
    assert stats["blocks_failed"] == stats["blocks_refused"] == 0, stats


# -- without an engine: the manager and the worker as plain objects ------------------


def ctx():  # type: ignore[no-untyped-def]
    from vllm.v1.kv_offload.base import ReqContext

    return ReqContext(req_id="r")


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def test_the_manager_offers_a_block_being_stored_naming_its_host_page_and_life() -> None:
    from vllm.v1.kv_offload.base import LookupResult

    from kvtier.integrations.vllm import KvtierOffloadingManager

    m = KvtierOffloadingManager(2)
    out = m.prepare_store([key(1), key(2)], ctx())
    assert out is not None
    store = out.store_spec
    assert m.lookup(key(1), ctx()) is LookupResult.HIT  # its store is in flight
    assert m.counts.in_flight_hits == 1
    load = m.prepare_load([key(1)], ctx())
    assert load.host_block_ids.tolist() == store.host_block_ids.tolist()[:1]
    assert load.lives == store.lives[:1] and len(set(store.lives)) == 2
    # The store of both failed while key 1 is read: key 2's host block is free
    # at once, key 1's once its load completes; neither is a hit any more.
    m.complete_store([key(1), key(2)], ctx(), success=False)
    assert m.lookup(key(1), ctx()) is LookupResult.MISS
    again = m.prepare_store([key(3), key(4)], ctx())
    assert again is None  # only one host block is free
    m.complete_load([key(1)], ctx())
    again = m.prepare_store([key(3), key(4)], ctx())
    assert again is not None and sorted(again.store_spec.host_block_ids.tolist()) == [0, 1]
    # A host block's next life never repeats an earlier one.
    assert set(again.store_spec.lives).isdisjoint(store.lives)


def _worker(monkeypatch: pytest.MonkeyPatch, fail_batches: set[int]):  # type: ignore[no-untyped-def]
    """A worker over two layers of 4 blocks of 64 bytes (random), 2 host
    blocks; its main scheduler's copies fail in ``fail_batches`` (numbered
    from 0 in the order they reach the executor)."""
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    import kvtier.integrations.vllm.worker as worker_module
    from kvtier.integrations.vllm import KvtierOffloadingWorker, parse_options
    from kvtier.scheduler import TransferScheduler
    from kvtier.testing import FaultInjectingExecutor

    fault = FaultInjectingExecutor(fail_batches=fail_batches)
    monkeypatch.setattr(worker_module, "TransferScheduler",
                        lambda group, **kw: TransferScheduler(group, executor=fault, **kw))
    torch.manual_seed(0)
    layers = [torch.randint(-128, 128, (4, 64), dtype=torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=64) for t in layers],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=64) for i in range(2)]],
    )
    worker = KvtierOffloadingWorker(caches, host_blocks=2, options=parse_options({}), staging_blocks=1)
    return worker, layers, fault


def _blocks(*ids: int):  # type: ignore[no-untyped-def]
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(list(ids), group_sizes=[len(ids)], block_indices=[0])


def _finish(worker, *jobs: int) -> set[int]:  # type: ignore[no-untyped-def]
    worker.wait(set(jobs))
    done = {r.job_id for r in worker.get_finished()}
    assert done == set(jobs), done
    invalid: set[int] = worker.take_invalid_blocks()
    return invalid


def test_a_load_submitted_while_its_store_is_in_flight_reads_what_the_store_wrote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from kvtier.integrations.vllm import KvtierOffloadingManager

    worker, layers, _ = _worker(monkeypatch, set())
    try:
        m = KvtierOffloadingManager(2)
        out = m.prepare_store([key(1)], ctx())
        assert out is not None
        want = [t[0].clone() for t in layers]
        # vLLM submits the store, then (same step) the load of that block:
        # the manager's lookup said HIT before the store completed.
        assert worker.submit_store(1, _blocks(0), out.store_spec)
        assert worker.submit_load(2, m.prepare_load([key(1)], ctx()), _blocks(3))
        assert _finish(worker, 1, 2) == set()
        assert all(torch.equal(t[3], w) for t, w in zip(layers, want, strict=True))
        assert worker.counts.blocks_loaded_from_host == 1
    finally:
        worker.shutdown()


def test_a_load_whose_in_flight_store_failed_fails_and_never_reads_the_page_s_previous_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from kvtier.integrations.vllm import KvtierOffloadingManager

    # Batch 0: key 1's store (lands); batch 1: key 2's store into the same
    # host page (fails).
    worker, layers, fault = _worker(monkeypatch, {1})
    try:
        m = KvtierOffloadingManager(1)
        first = m.prepare_store([key(1)], ctx())
        assert first is not None
        assert worker.submit_store(1, _blocks(0), first.store_spec)
        assert _finish(worker, 1) == set()
        m.complete_store([key(1)], ctx())
        second = m.prepare_store([key(2)], ctx())  # evicts key 1: the same host page, a new life
        assert second is not None and second.evicted_keys == [key(1)]
        assert second.store_spec.host_block_ids.tolist() == first.store_spec.host_block_ids.tolist()
        before = [t[3].clone() for t in layers]
        assert worker.submit_store(3, _blocks(1), second.store_spec)
        assert worker.submit_load(4, m.prepare_load([key(2)], ctx()), _blocks(3))
        assert _finish(worker, 3, 4) == {3}  # vLLM recomputes device block 3
        assert fault.faults_injected == 1
        assert all(torch.equal(t[3], b) for t, b in zip(layers, before, strict=True))
        assert worker.counts.blocks_failed == 1 and worker.counts.blocks_loaded_from_host == 0
        m.complete_load([key(2)], ctx())
        m.refuse([key(2)])  # what KvtierConnector does with the failed block
        # A load that reaches the worker before its block's store (vLLM
        # submits stores first; this is the guard) while the page still holds
        # an earlier life's bytes: it fails too, not reading them.
        third = m.prepare_store([key(7)], ctx())
        assert third is not None
        assert worker.submit_store(5, _blocks(2), third.store_spec)
        assert _finish(worker, 5) == set()
        m.complete_store([key(7)], ctx())
        fourth = m.prepare_store([key(8)], ctx())
        assert fourth is not None and fourth.evicted_keys == [key(7)]
        assert worker.submit_load(6, m.prepare_load([key(8)], ctx()), _blocks(3))
        assert _finish(worker, 6) == {3}
        assert worker.submit_store(7, _blocks(0), fourth.store_spec)
        assert _finish(worker, 7) == set()
        assert all(torch.equal(t[3], b) for t, b in zip(layers, before, strict=True))
        assert worker.counts.blocks_not_stored == 2
    finally:
        worker.shutdown()
