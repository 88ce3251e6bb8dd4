"""kvtier's store with tensor parallel workers (TP=2 on vLLM's CPU build).

Each engine runs the engine core in the test's subprocess and its two
workers in processes of their own (vLLM's ``mp`` backend), each pinned to one
core (``VLLM_CPU_OMP_THREADS_BIND``), so that the runs with and without kvtier
compute with the same threads. Three engine runs: vLLM alone, engine A
writing a FileStore, and engine B, a new process, reading it after one rank's
shard of one block was damaged. Pipeline parallel (PP=2) has a test of its
own, run with ``KVTIER_VLLM_PP=1`` (its engines compile at start).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conftest import BLOCK, prompt_set, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TP = 2
PROMPTS = prompt_set()  # doc 0, 1, 2, then each again; 3 shared blocks each
FIRST, REST = PROMPTS[:1], PROMPTS[1:]


def engine(model_dir: str, kv: dict[str, Any] | None, phases: list[dict[str, Any]]) -> dict[str, Any]:
    # Each of the two workers pinned to a core of its own (conftest.run_engine's ``threads_bind``).
    return {"model": model_dir, "kv": kv, "num_gpu_blocks": 10, "tensor_parallel_size": TP, "phases": phases,
            "threads_bind": "0|1"}


def generate(prompts: list[list[int]]) -> dict[str, Any]:
    return {"op": "generate", "prompts": prompts, "max_tokens": 6}


def outputs(out: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for p in out["phases"] if p["op"] == "generate" for o in p["outputs"]]


def check_same(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    for i, (g, w) in enumerate(zip(outputs(got), outputs(want), strict=True)):
        assert g["token_ids"] == w["token_ids"], f"{what}, prompt {i}: {g['token_ids']} != {w['token_ids']}"
        assert g["logprobs"] == w["logprobs"], f"{what}, prompt {i}: logprobs differ"


def test_a_tp2_store_is_found_by_a_new_process_and_one_ranks_damaged_shard_is_recomputed_on_all(
    model_dir: str, tmp_path: Path
) -> None:
    phases = [generate(FIRST), generate(REST)]
    baseline = run_engine(engine(model_dir, None, phases), tmp_path, "tp-baseline")
    assert baseline["returncode"] == 0, baseline["log"][-3000:]

    store = tmp_path / "store"
    kv = {"connector": "KvtierConnector", "extra": {"kvtier": {"host_bytes": 64 << 20, "store_path": str(store)}}}
    # Engine A: the blocks of the first prompt (doc 0), each rank's shard key of each, then the rest.
    first = run_engine(engine(model_dir, kv, [generate(FIRST), {"op": "shard_keys", "prompt": FIRST[0]}, generate(REST)]), tmp_path, "tp-a")
    assert first["returncode"] == 0, first["log"][-3000:]
    check_same(first, baseline, "engine A")
    (doc0,) = [p["blocks"] for p in first["phases"] if p["op"] == "shard_keys"]
    assert len(doc0) == len(FIRST[0]) // BLOCK and all(len(set(shards)) == TP for shards in doc0), doc0
    stats_a = first["stats"]
    assert [s["rank"] for s in stats_a] == [0, 1], stats_a
    assert all(s["blocks_written_through"] > 0 and s["write_through_errors"] == 0 for s in stats_a), stats_a
    for shards in doc0:  # every rank wrote its own shard of every block
        assert all((store / k[:2] / f"{k}.data").exists() for k in shards), shards  # FileStore: one file a page

    # Damage rank 1's shard of doc 0's second block (its length unchanged, so it still "exists").
    data = store / doc0[1][1][:2] / f"{doc0[1][1]}.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))

    second = run_engine(engine(model_dir, kv, [generate(FIRST), generate(REST)]), tmp_path, "tp-b")
    assert second["returncode"] == 0, second["log"][-3000:]
    check_same(second, baseline, "engine B")
    cached = [o["num_cached_tokens"] for o in outputs(second)]
    # Docs 1 and 2 (prompts 1 and 2): every rank's shards found, the whole prefix loaded.
    assert all(n >= 3 * BLOCK for n in cached[1:3]), cached
    # Doc 0's first prompt: rank 1 refused block 1 (and so the 2 blocks after it); vLLM
    # recomputed those 3 blocks (96 tokens) on both ranks, rank 0 having loaded them all.
    # (Its num_cached_tokens still counts the 4 blocks asked for: vLLM sets it first.)
    assert "Recovered from KV load failure: 1 request(s) rescheduled (96 tokens affected)" in second["log"]
    # Doc 0's second prompt: rank 1's report reached kvtier's scheduler side, which had
    # vLLM store the recomputed blocks again, so the whole prefix loads from the host tier.
    assert cached[3] == 4 * BLOCK, cached
    # And rank 1's write-through put its shard again: the damaged bytes are gone from the store.
    assert data.read_bytes() != bytes(raw)
    rank0, rank1 = second["stats"]
    assert (rank0["rank"], rank1["rank"]) == (0, 1)
    # Rank 1 refused the damaged shard (its checksum) and failed the 2 blocks after it.
    assert rank0["blocks_failed"] + rank0["blocks_refused"] == 0, rank0
    assert rank1["refused"] == {"store_checksum": 1} and rank1["blocks_failed"] == 2, rank1
    assert rank0["blocks_loaded_from_store"] > rank1["blocks_loaded_from_store"] > 0, (rank0, rank1)
    print(f"TP=2 store: engine B cached tokens per prompt {cached}; rank 0 loaded "
          f"{rank0['blocks_loaded_from_store']} blocks from the store, rank 1 {rank1['blocks_loaded_from_store']} "
          f"(the damaged shard refused, {rank1['blocks_failed']} after it failed)")


@pytest.mark.skipif(
    os.environ.get("KVTIER_VLLM_PP") != "1",
    reason="KVTIER_VLLM_PP=1 runs it: vLLM's CPU build runs pipeline stages only compiled (engine.py says why), "
    "2-4 min per engine start on 2 cores",
)
def test_a_pp2_store_is_found_by_a_new_process(model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two pipeline stages, one layer each, so two engine runs: A computes one prompt per
    # prefix with nothing loaded (vLLM's own computation) and writes the store; B, a new
    # process, loads every prefix from it.
    import conftest

    monkeypatch.setattr(conftest, "ENGINE_TIMEOUT_S", 600)  # torch.compile at start
    cold = PROMPTS[:3]  # one prompt per prefix
    store = tmp_path / "store"
    kv = {"connector": "KvtierConnector", "extra": {"kvtier": {"host_bytes": 64 << 20, "store_path": str(store)}}}
    run = {**engine(model_dir, kv, [generate(cold)]), "tensor_parallel_size": 1, "pipeline_parallel_size": 2}
    first = run_engine(run, tmp_path, "pp-a")
    assert first["returncode"] == 0, first["log"][-3000:]
    assert [o["num_cached_tokens"] for o in outputs(first)] == [0, 0, 0]
    stats_a = first["stats"]
    assert [s["rank"] for s in stats_a] == [0, 1], stats_a
    assert all(s["blocks_written_through"] == 3 * 4 for s in stats_a), stats_a  # 4 blocks a prompt, each stage
    second = run_engine(run, tmp_path, "pp-b")
    assert second["returncode"] == 0, second["log"][-3000:]
    check_same(second, first, "engine B")
    cached = [o["num_cached_tokens"] for o in outputs(second)]
    assert all(n >= 3 * BLOCK for n in cached), cached
    assert [s["blocks_loaded_from_store"] for s in second["stats"]] == [sum(cached) // BLOCK] * 2, second["stats"]
    print(f"PP=2 store: engine B cached tokens per prompt {cached}; start A {first['start_s']:.0f} s, "
          f"B {second['start_s']:.0f} s")
