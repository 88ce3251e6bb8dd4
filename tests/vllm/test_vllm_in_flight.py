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
