"""End to end: real transformers models keep their outputs when their cache goes through kvtier.

Tiny models built from configs with random float32 weights (fixed seed, nothing
downloaded) hold multi-turn greedy conversations on CPU. Between turns each
conversation's cache is written into `DevicePool` rows (the stand-in for GPU
memory) by `kvtier.integrations.hf`, backed up to the host through the
`TransferScheduler`, wiped from the device rows and from the model, then loaded
into fresh device slots and rebuilt, layer by layer as each layer lands, before
the next turn. Tokens and logits must equal (``torch.equal``) those of the same
conversations run without offloading. Two conversations run at once, so the
scheduler merges their operations.

Models (one per cache kind):

* Llama: full attention only -> pool ``kv``.
* Gemma-3 text: sliding-window and full layers -> ``kv`` and ``swa``; ``swa`` holds
  only the pages inside the window.
* LFM2: short-conv layers and full attention -> ``state`` (page size 1, the conv
  state as a plane) and ``kv``.
* Bamba: Mamba-2 layers and full attention -> ``state`` (conv and SSM states as
  planes) and ``kv``.
* Falcon-H1: attention and Mamba-2 side by side in every layer -> each layer has
  rows in both ``kv`` and ``state``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # models are built from configs: nothing may be downloaded
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import anyio
import pytest
import torch

# 5.15: hybrid models keep conv/SSM state in the cache's LinearAttentionLayer (dict per
# state) and LFM2 reads that state on multi-token turns; earlier 5.x releases do not.
transformers = pytest.importorskip("transformers", minversion="5.15")

from kvtier import CorruptionDetected, PoolGroup, SchedulerConfig, TransferScheduler
from kvtier.integrations.hf import (
    HFCacheBridge,
    HFCacheLayout,
    SequenceSlots,
    cache_argument,
)
from kvtier.scheduler import SchedulerStatistics

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
PAGE = 4
TURNS = (7, 5, 9)  # user tokens per turn; every cache ends mid-page
GENERATE = 4  # greedy tokens per turn
CONVERSATIONS = 2
VOCAB = 96
WINDOW = 6  # Gemma-3 sliding window: its sliding layers keep the last 5 tokens


# -- models ------------------------------------------------------------------


def _build(name: str) -> torch.nn.Module:
    t = transformers
    small = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2}
    if name == "llama":
        config = t.LlamaConfig(num_hidden_layers=3, initializer_range=0.2, **small)
        cls = t.LlamaForCausalLM
    elif name == "gemma3":
        config = t.Gemma3TextConfig(
            num_hidden_layers=4, head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            initializer_range=0.2, **small,
        )
        cls = t.Gemma3ForCausalLM
    elif name == "lfm2":
        config = t.Lfm2Config(
            num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"],
            block_multiple_of=16, initializer_range=0.2, **small,
        )
        cls = t.Lfm2ForCausalLM
    elif name == "bamba":
        config = t.BambaConfig(
            num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
            mamba_n_groups=1, mamba_chunk_size=8, mamba_expand=2, initializer_range=0.2, **small,
        )
        cls = t.BambaForCausalLM
    elif name == "falcon_h1":
        config = t.FalconH1Config(
            num_hidden_layers=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
            mamba_n_groups=1, mamba_chunk_size=8, mamba_expand=1, initializer_range=0.2, **small,
        )
        cls = t.FalconH1ForCausalLM
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


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    """Deterministic kernels on one thread: multi-threaded CPU matmuls are not
    reproducible bit for bit from run to run (a fresh process's first forward
    pass sometimes rounds differently), and the comparisons here need that."""
    before = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.set_num_threads(before[1])


# -- conversations -----------------------------------------------------------


@dataclass
class Transcript:
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def user_turns(conversation: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + conversation)
    return [torch.randint(0, VOCAB, (1, n), generator=gen) for n in TURNS]


def run_turn(model: torch.nn.Module, cache: object, ids: torch.Tensor, out: Transcript) -> torch.Tensor:
    """Prefill ``ids`` and decode `GENERATE` tokens greedily; return the last
    token (the next turn's first input: it is not in the cache yet)."""
    arg = cache_argument(model)
    with torch.no_grad():
        for _ in range(GENERATE):
            logits = model(input_ids=ids, use_cache=True, **{arg: cache}).logits
            out.logits.append(logits.clone())
            ids = logits[:, -1:].argmax(-1)
            out.tokens.append(int(ids))
    return ids


def reference(model: torch.nn.Module, conversation: int) -> Transcript:
    """The conversation with the cache kept in the model the whole time."""
    out = Transcript()
    cache = transformers.DynamicCache(config=model.config)
    last = None
    for user in user_turns(conversation):
        ids = user if last is None else torch.cat([last, user], dim=1)
        last = run_turn(model, cache, ids, out)
    return out


Tamper = Callable[[PoolGroup, SequenceSlots, dict[str, torch.Tensor]], None]


@dataclass
class OffloadRun:
    transcripts: dict[int, Transcript]
    stats: SchedulerStatistics | None
    group: PoolGroup
    layout: HFCacheLayout
    kv_pages_seen: list[int] = field(default_factory=list)
    swa_pages_seen: list[int] = field(default_factory=list)


def wipe(group: PoolGroup, bridge: HFCacheBridge, seq: SequenceSlots) -> None:
    """Zero the sequence's device rows in every pool, sidecars included (the engine lost them)."""
    for name, idx in bridge.rows(seq).items():
        dev = group[name].device
        assert dev is not None
        for j in range(dev.num_layers):
            for p in range(len(dev.planes)):
                dev.tensor(j, p)[idx] = 0


def offloaded(
    model: torch.nn.Module, *, tamper: Tamper | None = None, config: SchedulerConfig | None = None
) -> OffloadRun:
    """Every conversation, with its cache offloaded to the host between turns.

    ``tamper`` runs once, for conversation 0, between its first backup and the
    load that follows, with the host indices of that backup.
    """
    layout = HFCacheLayout.probe(model, page_size=PAGE)
    tokens = sum(TURNS) + len(TURNS) * GENERATE
    per_conv = layout.slots_needed(tokens)
    group = PoolGroup()
    # Room for each conversation's rows twice: the wiped rows stay taken until
    # the load has its fresh slots, so a load never lands where the backup read.
    layout.add_pools(
        group,
        device_slots={p: 2 * CONVERSATIONS * n for p, n in per_conv.items()},
        host_slots={p: 2 * CONVERSATIONS * n for p, n in per_conv.items()},
    )
    bridge = HFCacheBridge(layout, group)
    run = OffloadRun({}, None, group, layout)

    async def conversation(sched: TransferScheduler, c: int) -> None:
        out = run.transcripts[c] = Transcript()
        cache = layout.new_cache()
        last = None
        host: dict[str, torch.Tensor] | None = None
        stored: SequenceSlots | None = None
        for turn, user in enumerate(user_turns(c)):
            if host is not None and stored is not None:
                load = await sched.load(host)
                loaded = stored.moved_to(load.device_indices)
                for name, idx in loaded.indices.items():
                    assert not set(idx.tolist()) & set(stored.indices[name].tolist()), "load reused the rows"
                bridge.release(stored)
                cache = layout.new_cache()
                for t in range(layout.num_layers):
                    await load.layer_ready(t)  # later layers are still landing
                    bridge.restore_layer(cache, loaded, t)
                await load
                sched.free_host(host)
                bridge.release(loaded)  # the model's cache owns copies now
            ids = user if last is None else torch.cat([last, user], dim=1)
            last = run_turn(model, cache, ids, out)
            if turn == len(TURNS) - 1:
                break
            stored = bridge.store(cache)
            run.kv_pages_seen.append(stored.indices.get(layout.kv_pool, torch.empty(0)).numel() // PAGE)
            run.swa_pages_seen.append(stored.indices.get(layout.swa_pool, torch.empty(0)).numel() // PAGE)
            backup = await sched.backup(stored.indices)
            await backup
            host = {name: backup.host_indices[name] for name in stored.indices}
            wipe(group, bridge, stored)
            cache.reset()
            del cache
            if tamper is not None and c == 0 and turn == 0:
                tamper(group, stored, host)

    async def main() -> None:
        async with TransferScheduler(group, config=config) as sched:
            async with anyio.create_task_group() as tg:
                for c in range(CONVERSATIONS):
                    tg.start_soon(conversation, sched, c)
            run.stats = sched.statistics()

    anyio.run(main)
    return run


def assert_identical(got: Transcript, want: Transcript) -> None:
    assert got.tokens == want.tokens
    assert len(got.logits) == len(want.logits)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b), f"logits differ at step {step}"


# -- tests -------------------------------------------------------------------

EXPECTED_POOLS = {
    "llama": ("kv",),
    "gemma3": ("kv", "swa"),
    "lfm2": ("kv", "state"),
    "bamba": ("kv", "state"),
    "falcon_h1": ("kv", "state"),
}


@pytest.mark.parametrize("name", list(EXPECTED_POOLS))
def test_offloaded_conversations_match_bit_for_bit(name: str) -> None:
    model = model_named(name)
    want = {c: reference(model, c) for c in range(CONVERSATIONS)}
    assert want[0].tokens != want[1].tokens  # the conversations differ
    run = offloaded(model)
    assert run.layout.pools == EXPECTED_POOLS[name]
    for c in range(CONVERSATIONS):
        assert_identical(run.transcripts[c], want[c])

    stats = run.stats
    assert stats is not None
    rounds = CONVERSATIONS * (len(TURNS) - 1)
    assert stats.backup.completed == stats.load.completed == rounds
    assert stats.backup.failed == stats.load.failed == 0
    # The scheduler merged the conversations' operations into shared batches.
    assert stats.backup.batches < stats.backup.completed
    assert stats.load.batches < stats.load.completed
    assert stats.load.max_operations_per_batch >= 2
    # Every host and device slot was given back.
    for pool in run.layout.pools:
        spec = run.group[pool]
        assert spec.device is not None and spec.device_allocator is not None
        assert stats.pools[pool].used_slots == 0
        assert spec.device_allocator.num_free_slots == spec.device.slots


def _same(a: object, b: object) -> bool:
    """Equal values: tensors by dtype, device, shape and every element; containers item by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.device == b.device and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def assert_restores_every_field(model: torch.nn.Module) -> None:
    """A cache after a prefill and two decode steps, stored through the bridge
    and restored into a fresh cache, equals the original in every attribute of
    every layer. A field the bridge does not restore shows here by name (say a
    token counter a transformers release adds, which the model takes its
    positions from), not only as tokens that drift a turn later."""
    layout = HFCacheLayout.probe(model, page_size=PAGE)
    slots = layout.slots_needed(2 * PAGE * 4)
    group = PoolGroup()
    layout.add_pools(group, device_slots=dict(slots), host_slots=dict(slots))
    bridge = HFCacheBridge(layout, group)
    cache = layout.new_cache()
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for _ in range(3):
            ids = model(input_ids=ids, use_cache=True, **{cache_argument(model): cache}).logits[:, -1:].argmax(-1)
    assert_same_layers(bridge.restore(bridge.store(cache)), cache)


def assert_same_layers(restored: Any, cache: Any) -> None:
    """Every attribute of every layer of ``restored`` equals ``cache``'s, by name."""
    assert len(restored.layers) == len(cache.layers)
    for i, (want, got) in enumerate(zip(cache.layers, restored.layers)):
        assert type(got) is type(want)
        fields, fields_got = vars(want), vars(got)
        assert fields.keys() == fields_got.keys(), f"layer {i} ({type(want).__name__})"
        differ = [k for k in fields if not _same(fields[k], fields_got[k])]
        assert not differ, f"layer {i} ({type(want).__name__}): {differ} not restored"
    assert _same(restored.get_seq_length(), cache.get_seq_length())


@pytest.mark.parametrize("name", list(EXPECTED_POOLS))
def test_a_restored_cache_equals_the_stored_one_in_every_field(name: str) -> None:
    assert_restores_every_field(model_named(name))


def restored_with_a_layer_counting_one_more() -> BaseException:
    """What restoring a stored 5-token Llama sequence raises while
    `DynamicLayer` counts one token more than it holds (as a field the bridge
    did not restore would make it count: transformers 5.25's linear layers' was
    such a field)."""
    from kvtier import ConfigurationError

    model = model_named("llama")
    layout = HFCacheLayout.probe(model, page_size=PAGE)
    group = PoolGroup()
    layout.add_pools(group, device_slots={"kv": 16}, host_slots={"kv": 16})
    bridge = HFCacheBridge(layout, group)
    cache = layout.new_cache()
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 5), dtype=torch.long), use_cache=True, **{cache_argument(model): cache})
    seq = bridge.store(cache)
    layer = transformers.cache_utils.DynamicLayer
    counted = layer.get_seq_length
    layer.get_seq_length = lambda self: counted(self) + 1
    try:
        bridge.restore(seq)
    except ConfigurationError as exc:
        return exc
    finally:
        layer.get_seq_length = counted
    raise AssertionError("the restore was not refused")


def test_a_restore_that_leaves_a_layer_another_length_is_refused() -> None:
    # The restore says so instead of the model taking wrong positions from the layer.
    error = restored_with_a_layer_counting_one_more()
    assert str(error).startswith("layer 0 (DynamicLayer) reports 6 tokens after its restore, the sequence has 5")


def test_sliding_pool_holds_only_the_window() -> None:
    run = offloaded(model_named("gemma3"))
    layout = run.layout
    assert layout.sliding_window == WINDOW
    held = WINDOW - 1
    # Pages that overlap the last `held` tokens: at most ceil(held / PAGE) + 1, however long the cache.
    assert max(run.swa_pages_seen) <= -(-held // PAGE) + 1
    assert run.kv_pages_seen[-1] > max(run.swa_pages_seen)
    assert layout.layer_map("swa") == [0, 1, None, 2]
    assert layout.layer_map("kv") == [None, None, 0, None]


def _corrupt_page(pool: str, page: Callable[[int], int], plane: int = 0) -> Tamper:
    """Alter one page of ``pool`` on the host: one plane of pool layer 0."""

    def tamper(group: PoolGroup, seq: SequenceSlots, host: dict[str, torch.Tensor]) -> None:
        size = group[pool].page_size
        p = page(host[pool].numel() // size)
        rows = host[pool][p * size : (p + 1) * size]
        view = group[pool].host.layer_view(0, plane)
        view[rows] += 1.0

    return tamper


@pytest.mark.parametrize(
    ("name", "pool", "page", "plane"),
    [
        ("llama", "kv", lambda n: 0, 0),  # K of the first tokens, which every later token attends to
        ("gemma3", "swa", lambda n: n - 1, 1),  # V of the newest tokens, inside the window
        ("lfm2", "state", lambda n: 0, 0),  # the conv state
        ("bamba", "state", lambda n: 0, 1),  # the SSM state
    ],
    ids=["llama-kv", "gemma3-swa", "lfm2-state-conv", "bamba-state-ssm"],
)
def test_a_page_altered_on_the_host_changes_the_logits(
    name: str, pool: str, page: Callable[[int], int], plane: int
) -> None:
    """The check above is real: one page altered in transit changes the next turn's logits."""
    model = model_named(name)
    want = {c: reference(model, c) for c in range(CONVERSATIONS)}
    run = offloaded(model, tamper=_corrupt_page(pool, page, plane))
    got = run.transcripts[0]
    first_after = GENERATE  # the first forward of turn 2 reads the reloaded cache
    for step in range(first_after):
        assert torch.equal(got.logits[step], want[0].logits[step])
    assert not torch.equal(got.logits[first_after], want[0].logits[first_after])
    assert_identical(run.transcripts[1], want[1])  # the other conversation is untouched


def test_verify_mode_refuses_the_altered_page_before_the_model_reads_it() -> None:
    """With ``SchedulerConfig(verify=True)`` kvtier itself catches the same alteration:
    the load fails with `CorruptionDetected` naming the pool, and copies nothing."""
    with pytest.raises(Exception) as caught:  # an ExceptionGroup from the task group
        offloaded(model_named("llama"), tamper=_corrupt_page("kv", lambda n: 0), config=SchedulerConfig(verify=True))
    assert caught.group_contains(CorruptionDetected, match="'kv'")


def test_restore_refuses_another_models_cache() -> None:
    from kvtier import ConfigurationError

    llama, gemma = model_named("llama"), model_named("gemma3")
    layout = HFCacheLayout.probe(gemma, page_size=PAGE)
    group = PoolGroup()
    layout.add_pools(group, device_slots={"kv": 16, "swa": 16}, host_slots={"kv": 16, "swa": 16})
    bridge = HFCacheBridge(layout, group)
    cache = transformers.DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(input_ids=torch.zeros((1, 3), dtype=torch.long), use_cache=True, **{cache_argument(llama): cache})
    with pytest.raises(ConfigurationError, match="the cache has 3 layers; the layout has 4"):
        bridge.store(cache)


def test_kvtier_imports_without_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import kvtier, kvtier.integrations.hf as hf\n"
        "try:\n"
        "    hf.HFCacheLayout.from_cache(object(), page_size=4)\n"
        "except ImportError as e:\n"
        "    print('needs:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'kvtier[hf]'" in out.stdout
