"""`DeepseekV4CacheBridge` refuses what does not belong to its stack, and says why.

With a tiny random-weight transformers V4 model (no download): a cache of
another model (another window and rate) is refused by `restore` before any
layer is written, and by `store` even where the shapes coincide; a model cast
with ``model.to(torch.bfloat16)`` has bfloat16 overlap gates, and `store`'s
refusal says why the stack expects float32 and what to do, and doing it works.
Every refusal leaves the cache, the sequence, the device rows and both tiers'
accounting as they were.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.15")
pytest.importorskip("transformers.models.deepseek_v4")

from kvtier import ConfigurationError, PoolGroup
from kvtier.integrations.hf import DeepseekV4CacheBridge, SequenceSlots
from kvtier.presets import deepseek_v4

LAYER_TYPES = ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"]
VOCAB = 96


def config(window: int = 16, hca: int = 16) -> Any:
    c = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, sliding_window=window, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, index_topk=3, num_nextn_predict_layers=0, hc_mult=2,
        hc_sinkhorn_iters=3, layer_types=LAYER_TYPES,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca},
    )
    c._attn_implementation = "eager"
    return c


def model(c: Any) -> Any:
    torch.manual_seed(0)
    return transformers.DeepseekV4ForCausalLM(c).to(torch.float32).eval()


def bridge_for(c: Any, dtype: torch.dtype = torch.float32, **kwargs: Any) -> DeepseekV4CacheBridge:
    group = PoolGroup()
    stack, _ = deepseek_v4(c, group, page_size=16, tokens=256, requests=4, host_ratio=1.0, dtype=dtype, **kwargs)
    return DeepseekV4CacheBridge(stack, group)


def filled(m: Any, tokens: int) -> Any:
    cache = transformers.DynamicCache(config=m.config)
    with torch.no_grad():
        m(input_ids=torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(tokens)),
          use_cache=True, cache=cache)
    return cache


def snapshot(bridge: DeepseekV4CacheBridge) -> dict[str, Any]:
    """Free device slots per allocator, host accounting, and a copy of every device tensor."""
    group = bridge.group
    out: dict[str, Any] = {"host": group.statistics()}
    for plan in bridge.stack.plans:
        spec = group[plan.name]
        if spec.device_allocator is not None:
            out[f"free {plan.name}"] = spec.device_allocator.num_free_slots
        if spec.device is not None:
            out[f"rows {plan.name}"] = [spec.device.tensor(j, p).clone() for j in range(spec.device.num_layers)
                                        for p in range(len(spec.device.planes))]
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key.startswith("rows "):
            assert all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True)), key
        else:
            assert a[key] == b[key], key


def empty(cache: Any) -> bool:
    return not any(layer.is_initialized for layer in cache.layers)


def test_restore_refuses_a_cache_of_another_model_and_takes_nothing() -> None:
    """Window 32 and HCA rate 32 against the stack's 16 and 16: refused naming
    the layer, the value and the rule, before any layer is written."""
    c = config()
    m = model(c)
    bridge = bridge_for(c)
    source = filled(m, 40)
    seq = bridge.store(source)
    before = snapshot(bridge)
    other = transformers.DynamicCache(config=config(window=32, hca=32))  # new_cache refuses that config
    with pytest.raises(ConfigurationError, match=r"layer 0 \(heavily_compressed_attention\) is a cache for "
                                                 r"sliding_window 32; this stack's model has 16: the cache belongs "
                                                 r"to another model \(use bridge.new_cache\(config\)"):
        bridge.restore(seq, other)
    assert empty(other)
    rate_only = transformers.DynamicCache(config=config(hca=32))
    with pytest.raises(ConfigurationError, match=r"layer 0 \(heavily_compressed_attention\) is a cache for "
                                                 r"compress_rate 32; this stack's model has 16"):
        bridge.restore(seq, rate_only)
    assert empty(rate_only)
    # A cache whose last layer is not empty: the first two are not written either.
    partly = bridge.new_cache(c)
    partly.layers[2].lazy_initialization(torch.zeros(1, 1, 0, 32), torch.zeros(1, 1, 0, 32))
    with pytest.raises(ConfigurationError, match=r"layer 2 already holds keys; restore into an empty cache"):
        bridge.restore(seq, partly)
    assert not partly.layers[0].is_initialized and not partly.layers[1].is_initialized
    # A sequence of another window (another model's stack) is refused too.
    with pytest.raises(ConfigurationError, match=r"the sequence keeps a window of 31 tokens; 40 tokens in this "
                                                 r"stack's window of 16 keep 15"):
        bridge.restore(SequenceSlots(40, 31, seq.indices), bridge.new_cache(c))
    assert_same(snapshot(bridge), before)
    # Nothing was taken: the same sequence restores into the right cache, byte for byte.
    restored = bridge.restore(seq, bridge.new_cache(c))
    for t in range(len(LAYER_TYPES)):
        assert torch.equal(restored.layers[t].keys, source.layers[t].keys)
    for name in ("compressor", "indexer"):
        assert torch.equal(restored.layers[1].compressed_kv[name], source.layers[1].compressed_kv[name])
        assert torch.equal(restored.layers[1].overlap_gate[name], source.layers[1].overlap_gate[name])
    assert torch.equal(restored.layers[0].buffer_kv["compressor"], source.layers[0].buffer_kv["compressor"])
    bridge.release(seq)


def test_new_cache_refuses_another_models_config() -> None:
    bridge = bridge_for(config())
    with pytest.raises(ConfigurationError, match=r"the config has sliding_window=32; this stack was planned from 16: "
                                                 r"a cache of another model \(give new_cache the config the stack"):
        bridge.new_cache(config(window=32, hca=32))
    with pytest.raises(ConfigurationError, match=r"the config has compress_rates\['heavily_compressed_attention'\]=32; "
                                                 r"this stack was planned from 16"):
        bridge.new_cache(config(hca=32))
    wider = config()
    wider.head_dim = 64
    with pytest.raises(ConfigurationError, match=r"the config has head_dim=64; this stack was planned from 32"):
        bridge.new_cache(wider)
    assert empty(bridge.new_cache(config()))


def test_store_refuses_a_cache_of_another_model_even_where_the_shapes_agree() -> None:
    """Ten tokens fill a window of 16 and one of 32 alike and make no entry at
    rate 16 or 32: only the layers' own window and rate tell the models apart."""
    bridge = bridge_for(config())
    other = config(window=32, hca=32)
    cache = filled(model(other), 10)
    before = snapshot(bridge)
    with pytest.raises(ConfigurationError, match=r"layer 0 \(heavily_compressed_attention\) is a cache for "
                                                 r"sliding_window 32; this stack's model has 16"):
        bridge.store(cache)
    assert_same(snapshot(bridge), before)


def test_a_bf16_cast_models_gates_are_refused_saying_why_and_the_advice_works() -> None:
    c = config()
    m = model(c).to(torch.bfloat16)
    bridge = bridge_for(c, dtype=torch.bfloat16)
    cache = filled(m, 21)  # 5 CSA entries: the overlap exists
    before = snapshot(bridge)
    with pytest.raises(ConfigurationError) as err:
        bridge.store(cache)
    message = str(err.value)
    assert message.startswith("layer 1 compressor overlap_gate is (4, 32) torch.bfloat16 per sequence; the stack "
                              "expects (4, 32) torch.float32: V4 keeps position_bias in float32")
    assert "as model.to(torch.bfloat16) does" in message and "cast position_bias back to float32" in message
    assert_same(snapshot(bridge), before)
    # Doing what it says: position_bias back in float32, and the same cache shape stores.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("position_bias"):
                p.data = p.data.float()
    cache = filled(m, 21)
    seq = bridge.store(cache)
    restored = bridge.restore(seq, bridge.new_cache(c))
    assert torch.equal(restored.layers[1].overlap_gate["indexer"], cache.layers[1].overlap_gate["indexer"])
    assert restored.layers[1].overlap_gate["indexer"].dtype == torch.float32
    bridge.release(seq)


def test_a_stack_planned_in_another_dtype_is_refused_naming_the_dtype_to_plan() -> None:
    c = config()
    m = model(c)
    bridge = bridge_for(c, dtype=torch.bfloat16)
    cache = filled(m, 21)
    with pytest.raises(ConfigurationError, match=r"layer 0 window keys is \(15, 32\) torch.float32 per sequence; the "
                                                 r"stack expects \(15, 32\) torch.bfloat16; plan the stack with the "
                                                 r"model's cache dtype \(deepseek_v4\(..., dtype=torch.float32\)\)"):
        bridge.store(cache)


def test_pools_renamed_by_role_round_trip_through_the_bridge() -> None:
    """The bridge finds pools by role: names of the caller's own work alike."""
    c = config()
    roles = {"anchor": "tokens", "c4": "csa", "c4_indexer": "csa_indexer", "c128": "hca", "window": "window",
             "c4_state": "csa_state", "c4_buffer": "csa_buffer", "c128_buffer": "hca_buffer"}
    bridge = bridge_for(c, roles=roles)
    assert set(bridge.stack.names) == set(roles.values())
    source = filled(model(c), 40)  # 10 CSA entries, 2 HCA entries, 8 HCA tokens buffered
    seq = bridge.store(source)
    assert set(seq.indices) == {"tokens", "window", "csa_state", "hca_buffer"}
    restored = bridge.restore(seq, bridge.new_cache(c))
    for t, layer in enumerate(source.layers):
        assert torch.equal(restored.layers[t].keys, layer.keys)
    assert torch.equal(restored.layers[0].compressed_kv["compressor"], source.layers[0].compressed_kv["compressor"])
    assert torch.equal(restored.layers[0].buffer_gate["compressor"], source.layers[0].buffer_gate["compressor"])
    assert torch.equal(restored.layers[1].compressed_kv["indexer"], source.layers[1].compressed_kv["indexer"])
    assert torch.equal(restored.layers[1].overlap_kv["indexer"], source.layers[1].overlap_kv["indexer"])
    bridge.release(seq)


def test_a_restored_cache_equals_the_stored_one_in_every_field() -> None:
    """Every attribute of every layer, by name: a field the bridge does not
    restore (a counter a transformers release adds) shows here, not as tokens
    that drift a turn later."""
    from test_e2e_hf import assert_same_layers

    c = config()
    bridge = bridge_for(c)
    source = filled(model(c), 40)  # 10 CSA entries, 2 HCA entries, 8 HCA tokens buffered
    seq = bridge.store(source)
    assert_same_layers(bridge.restore(seq, bridge.new_cache(c)), source)
    bridge.release(seq)
