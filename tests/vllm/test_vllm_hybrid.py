"""Hybrid models inside vLLM's CPU build: every KV cache group through kvtier.

Gemma-2 (sliding window and full attention, alternating: two groups) and
Gemma-3 (three sliding-window layers to one full: four groups), tiny and
random, made here. Per family one engine without offloading and one with
kvtier, given the same requests one at a time: outputs (token ids and
logprobs) must be identical after vLLM's prefix cache is dropped under
eviction, and kvtier must have served tokens vLLM alone recomputed, through
every group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import BLOCK, prompt_set, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

WINDOW = 2 * BLOCK  # the sliding window, shorter than every prompt's prefix
# Three prompts of 4 whole blocks and 8 tokens, asked twice, interleaved (0 1 2 0 1 2): with
# few device blocks vLLM has evicted a prompt's blocks before it repeats. Each
# repeat is the whole prompt, since vLLM stores a sliding-window group's
# blocks only at the boundaries a later lookup can reach (a prompt's end).
PROMPTS = [p[: 4 * BLOCK + 8] for p in prompt_set(seed=3, docs=3, per_doc=1)] * 2
GEN = {"op": "generate", "prompts": PROMPTS, "max_tokens": 6}
PHASES = [GEN, {"op": "reset"}, GEN, {"op": "stats"}]
# Few enough device blocks that a prefix is evicted before it repeats.
FAMILIES = {"gemma2": {"num_gpu_blocks": 16}, "gemma3": {"num_gpu_blocks": 28}}
MAX_MODEL_LEN = 192


def tiny_model(family: str, path: Path) -> str:
    import torch

    torch.manual_seed(0)
    common: dict[str, Any] = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, sliding_window=WINDOW,
    )
    if family == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        Gemma2ForCausalLM(Gemma2Config(**common)).save_pretrained(path, safe_serialization=True)
    else:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        layers = ["sliding_attention"] * 3 + ["full_attention"]
        Gemma3ForCausalLM(Gemma3TextConfig(**common, layer_types=layers)).save_pretrained(
            path, safe_serialization=True
        )
    return str(path)


def outputs(out: dict[str, Any], phase: int) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = [p for p in out["phases"] if p["op"] == "generate"][phase]["outputs"]
    return result


def cached(out: dict[str, Any], phase: int) -> list[int]:
    return [o["num_cached_tokens"] for o in outputs(out, phase)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_hybrid_model_gives_identical_outputs_and_kvtier_serves_every_group(
    family: str, tmp_path: Path
) -> None:
    model = tiny_model(family, tmp_path / family)
    run = {"model": model, "max_model_len": MAX_MODEL_LEN, "phases": PHASES, **FAMILIES[family]}
    # With verify mode and a FileStore: every block checksummed and written through.
    options = {"verify": True, "store_path": str(tmp_path / "store")}
    kv = {"connector": "KvtierConnector", "extra": {"cpu_bytes_to_use": 32 << 20, "kvtier": options}}
    base = run_engine({**run, "kv": None}, tmp_path, f"{family}-baseline")
    assert base["returncode"] == 0, base["log"][-3000:]
    out = run_engine({**run, "kv": kv}, tmp_path, f"{family}-kvtier")
    assert out["returncode"] == 0, out["log"][-3000:]
    for phase in (0, 1):
        for i, (got, want) in enumerate(zip(outputs(out, phase), outputs(base, phase), strict=True)):
            assert got["token_ids"] == want["token_ids"], f"{family} phase {phase} prompt {i}"
            assert got["logprobs"] == want["logprobs"], f"{family} phase {phase} prompt {i}"
    # Under eviction (the repeats in phase 0) and after vLLM dropped its prefix
    # cache (phase 1), kvtier served the prompts' 4 blocks that vLLM alone recomputed.
    assert cached(base, 0)[3:] != [4 * BLOCK] * 3, cached(base, 0)  # vLLM had evicted some
    assert cached(out, 0) == [0] * 3 + [4 * BLOCK] * 3, cached(out, 0)
    assert cached(base, 1) == [0] * 3 + cached(base, 0)[3:], cached(base, 1)
    assert cached(out, 1) == [4 * BLOCK] * 6, cached(out, 1)
    (stats,) = next(p for p in out["phases"] if p["op"] == "stats")["workers"]
    assert stats["blocks_loaded_from_host"] > 0 and stats["blocks_refused"] == stats["blocks_failed"] == 0, stats
    groups = stats["groups"]
    kinds = {g["kind"] for g in groups.values()}
    assert kinds == {"FullAttentionSpec", "SlidingWindowSpec"}, groups
    assert len(groups) == {"gemma2": 2, "gemma3": 4}[family], groups
    # Every group's blocks went out and came back; a sliding-window group
    # moved only the blocks its window holds, fewer than a full-attention one.
    assert all(g["blocks_stored"] > 0 and g["blocks_loaded"] > 0 for g in groups.values()), groups
    full = [g for g in groups.values() if g["kind"] == "FullAttentionSpec"]
    sliding = [g for g in groups.values() if g["kind"] == "SlidingWindowSpec"]
    assert max(g["blocks_loaded"] for g in sliding) < min(g["blocks_loaded"] for g in full), groups
    assert stats["blocks_loaded_from_host"] == sum(g["blocks_loaded"] for g in groups.values()), stats
    assert stats["blocks_written_through"] == stats["blocks_stored"] > 0 and not stats["errors"], stats
    if family == "gemma2":
        # A new engine process, empty device cache and host tier, same store:
        # every group's blocks come from the store, under their own keys.
        second = run_engine({**run, "kv": kv, "phases": [GEN]}, tmp_path, f"{family}-store")
        assert second["returncode"] == 0, second["log"][-3000:]
        assert cached(second, 0) == [4 * BLOCK] * 6, cached(second, 0)
        for i, (got, want) in enumerate(zip(outputs(second, 0), outputs(base, 0), strict=True)):
            assert got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"], f"store prompt {i}"
        (again,) = second["stats"]
        assert again["blocks_loaded_from_store"] > 0 and again["blocks_failed"] == 0, again
        assert all(g["blocks_loaded"] > 0 for g in again["groups"].values()), again["groups"]
    print(f"{family}: cached tokens {cached(out, 0)} + {cached(out, 1)} with kvtier, "
          f"{cached(base, 0)} + {cached(base, 1)} without; "
          f"groups {groups}")
