"""End to end: the wider model matrix through `HFCacheBridge`, bit for bit.

The same multi-turn test as `test_e2e_hf` (two conversations x three turns;
after each turn the cache is backed up, wiped from the device rows and the
model, and loaded into fresh slots, layer by layer), on the other cache kinds
transformers ships, each a tiny random-weight config:

* DeepSeek-V3.2 (``deepseek_v32``): MLA latent cache (K = the normalised
  latent, V = the rotated key part, per token) in ``kv``, and the DSA indexer
  keys in ``kv_indexer``, a sidecar of ``kv`` with one row per token
  (``rows_per_page = page_size``);
* Qwen3-Next (``qwen3_next``): gated delta-net layers (conv and recurrent
  state) in ``state`` beside full attention in ``kv``;
* GPT-OSS (``gpt_oss``): sliding-window and full layers alternating, in
  ``swa`` and ``kv``.

DeepSeek V4 has its own bridge and tests (`test_e2e_v4`). Caches the bridge
cannot move (static and quantized layers) are refused with a clear error.
"""

from __future__ import annotations

import os
from collections.abc import Callable

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.15")

from test_e2e_hf import (  # the multi-turn harness, shared
    CONVERSATIONS,
    GENERATE,
    PAGE,
    VOCAB,
    assert_identical,
    assert_restores_every_field,
    deterministic,  # noqa: F401  (autouse fixture: one thread, deterministic kernels)
    offloaded,
    reference,
)

from kvtier import ConfigurationError, DevicePool, PageAllocator, PoolGroup
from kvtier.integrations.hf import HFCacheBridge, HFCacheLayout, SequenceSlots

pytestmark = pytest.mark.e2e

SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "initializer_range": 0.2}


def _build(name: str) -> torch.nn.Module:
    t = transformers
    if name == "deepseek_v32":
        config = t.DeepseekV32Config(
            num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=16,
            index_topk=4, **dict(SMALL, num_key_value_heads=4),
        )
        cls = t.DeepseekV32ForCausalLM
    elif name == "qwen3_next":
        config = t.Qwen3NextConfig(
            num_hidden_layers=4, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"], **SMALL,
        )
        cls = t.Qwen3NextForCausalLM
    elif name == "gpt_oss":
        config = t.GptOssConfig(
            num_hidden_layers=4, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"], **SMALL,
        )
        cls = t.GptOssForCausalLM
    else:
        raise ValueError(name)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model: torch.nn.Module = cls(config).to(torch.float32).eval()
    return model


_MODELS: dict[str, torch.nn.Module] = {}


def model_named(name: str) -> torch.nn.Module:
    if name not in _MODELS:
        _MODELS[name] = _build(name)
    return _MODELS[name]


MATRIX = {
    # model: (pools, sidecars, layer map of each pool)
    "deepseek_v32": (("kv",), ("kv_indexer",), {"kv": [0, 1, 2], "kv_indexer": [0, 1, 2]}),
    "qwen3_next": (("kv", "state"), (), {"kv": [None, None, 0, None], "state": [0, 1, None, 2]}),
    "gpt_oss": (("kv", "swa"), (), {"kv": [None, 0, None, 1], "swa": [0, None, 1, None]}),
}


@pytest.mark.parametrize("name", list(MATRIX))
def test_model_matrix_conversations_match_bit_for_bit(name: str) -> None:
    model = model_named(name)
    want = {c: reference(model, c) for c in range(CONVERSATIONS)}
    assert want[0].tokens != want[1].tokens
    run = offloaded(model)
    pools, sidecars, maps = MATRIX[name]
    assert run.layout.pools == pools
    assert run.layout.sidecars == sidecars
    for pool, lmap in maps.items():
        assert run.layout.layer_map(pool) == lmap
    for c in range(CONVERSATIONS):
        assert_identical(run.transcripts[c], want[c])
    stats = run.stats
    assert stats is not None
    assert stats.backup.completed == stats.load.completed == CONVERSATIONS * 2
    assert stats.backup.failed == stats.load.failed == 0


@pytest.mark.parametrize("name", list(MATRIX))
def test_a_restored_cache_equals_the_stored_one_in_every_field(name: str) -> None:
    assert_restores_every_field(model_named(name))


def test_dsa_indexer_keys_are_used_after_the_load() -> None:
    """One indexer row changed on the host changes which tokens DSA attends to, so the logits."""
    model = model_named("deepseek_v32")
    want = reference(model, 0)
    run = offloaded(model, tamper=_indexer_row(3))
    got = run.transcripts[0]
    for step in range(GENERATE):
        assert torch.equal(got.logits[step], want.logits[step])
    a, b = got.logits[GENERATE], want.logits[GENERATE]
    assert not torch.equal(a, b)
    print(f"deepseek_v32 kv_indexer row: max abs logit difference {float((a - b).abs().max()):.4g}")


def _indexer_row(token: int) -> Callable[[PoolGroup, SequenceSlots, dict[str, torch.Tensor]], None]:
    def tamper(group: PoolGroup, seq: SequenceSlots, host: dict[str, torch.Tensor]) -> None:
        # One row per kv slot: the host row of token ``token`` is its kv host slot.
        view = group["kv_indexer"].host.layer_view(0, 0)
        row = host["kv"][token]
        view[row] = -8.0 * view[row]

    return tamper


def test_static_caches_are_refused_with_a_clear_error() -> None:
    model = model_named("gpt_oss")
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 3), dtype=torch.long), use_cache=True, cache=cache)
    with pytest.raises(ConfigurationError, match="layer 0 is a StaticSlidingWindowLayer; the bridge moves DynamicCache"):
        HFCacheLayout.from_cache(cache, page_size=PAGE)


def test_the_indexer_sidecar_must_be_registered() -> None:
    layout = HFCacheLayout.probe(model_named("deepseek_v32"), page_size=PAGE)
    group = PoolGroup()
    kv = DevicePool([[torch.zeros(16, *p.shape, dtype=p.dtype) for p in layout.planes("kv")] for _ in range(3)],
                    allocator=PageAllocator(16, PAGE, name="kv"))
    group.add_pool("kv", device=kv, page_size=PAGE, host_slots=16)
    with pytest.raises(ConfigurationError, match="pool 'kv_indexer' must be a sidecar of 'kv' with 4 rows per page"):
        HFCacheBridge(layout, group)
