"""End to end: DeepSeek V4's real model code keeps its outputs when its cache goes through kvtier.

A tiny random-weight `DeepseekV4ForCausalLM` (HCA, CSA and sliding-only layers,
float32, fixed seed, nothing downloaded) holds multi-turn greedy conversations
on CPU. Between turns each conversation's cache is written into the V4 stack's
device rows (`kvtier.presets.deepseek_v4` + `DeepseekV4CacheBridge`), backed up
to the host, wiped from the device rows and from the model, loaded into fresh
slots and rebuilt layer by layer as each layer lands. Every token and logit
must equal (``torch.equal``) those of the run that never offloads: with small
rates (CSA 4, HCA 16, page 16) and with the real ones (4 and 128, page 256, so
``c128`` has two rows per page). Engine B continues engine A's conversation
from a shared `FileStore`, by token ids alone. Negative controls change one
``c4`` row, one indexer row, one ``c128`` row, the window, the CSA state and
the HCA buffer on the host: each changes the logits, and ``verify=True``
refuses each load.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import anyio
import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.15")
pytest.importorskip("transformers.models.deepseek_v4")

from kvtier import ConfigurationError, CorruptionDetected, PoolGroup, SchedulerConfig, TransferScheduler
from kvtier.integrations.hf import DeepseekV4CacheBridge, HFCacheLayout, SequenceSlots, cache_argument
from kvtier.presets import DeepseekV4Stack, deepseek_v4
from kvtier.scheduler import SchedulerStatistics
from kvtier.storage import EngineIdentity, FileStore
from kvtier.transfers import derive_sidecar_indices

pytestmark = pytest.mark.e2e

VOCAB = 96
GENERATE = 3
CONVERSATIONS = 2
LAYER_TYPES = [
    "heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
    "compressed_sparse_attention", "heavily_compressed_attention",
]


@dataclass(frozen=True)
class Setup:
    """One model shape and how its stack is paged."""

    csa: int
    hca: int
    page: int
    window: int
    turns: tuple[int, ...]  # user tokens per turn


IDENTITY = EngineIdentity("tiny-deepseek-v4")


SMALL = Setup(csa=4, hca=16, page=16, window=16, turns=(13, 7, 11))
REAL = Setup(csa=4, hca=128, page=256, window=16, turns=(100, 60, 40))


def build(setup: Setup) -> torch.nn.Module:
    config = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, sliding_window=setup.window, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, index_topk=3, num_nextn_predict_layers=0, hc_mult=2,
        hc_sinkhorn_iters=3, layer_types=LAYER_TYPES, initializer_range=0.2,
        compress_rates={"compressed_sparse_attention": setup.csa, "heavily_compressed_attention": setup.hca},
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.DeepseekV4ForCausalLM(config).to(torch.float32).eval()
    # position_bias starts at zero; random values make the gates (state) matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("position_bias"):
                p.normal_(0.0, 0.5)
    return model


_MODELS: dict[Setup, torch.nn.Module] = {}


def model_for(setup: Setup) -> torch.nn.Module:
    if setup not in _MODELS:
        _MODELS[setup] = build(setup)
    return _MODELS[setup]


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    """One thread and deterministic kernels: the comparisons are bit for bit."""
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


def user_turns(setup: Setup, conversation: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + conversation)
    return [torch.randint(0, VOCAB, (1, n), generator=gen) for n in setup.turns]


def run_turn(model: torch.nn.Module, cache: object, ids: torch.Tensor, out: Transcript) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(GENERATE):
            logits = model(input_ids=ids, use_cache=True, **{cache_argument(model): cache}).logits
            out.logits.append(logits.clone())
            ids = logits[:, -1:].argmax(-1)
            out.tokens.append(int(ids))
    return ids


def reference(model: torch.nn.Module, turns: list[torch.Tensor]) -> Transcript:
    out = Transcript()
    cache = transformers.DynamicCache(config=model.config)
    last = None
    for user in turns:
        last = run_turn(model, cache, user if last is None else torch.cat([last, user], dim=1), out)
    return out


Tamper = Callable[[PoolGroup, DeepseekV4Stack, dict[str, torch.Tensor]], None]


@dataclass
class Run:
    transcripts: dict[int, Transcript]
    stack: DeepseekV4Stack
    group: PoolGroup
    stats: SchedulerStatistics | None = None
    stored: list[SequenceSlots] = field(default_factory=list)
    nbytes: int = 0  # what the executor copied, backups and loads


def make_stack(model: torch.nn.Module, setup: Setup, group: PoolGroup,
               window_page_size: int | None = None) -> DeepseekV4Stack:
    tokens = sum(setup.turns) + len(setup.turns) * GENERATE
    # Room for every conversation twice: wiped rows stay taken until the load has fresh ones.
    stack, _ = deepseek_v4(
        model.config, group, page_size=setup.page, tokens=2 * CONVERSATIONS * tokens + setup.page,
        requests=2 * CONVERSATIONS, host_ratio=1.0, window_page_size=window_page_size,
    )
    return stack


def data_bytes(stack: DeepseekV4Stack, group: PoolGroup, num_tokens: int) -> dict[str, int]:
    """The bytes that hold data in a V4 cache of ``num_tokens`` tokens, per
    pool, counted from the token count (not from the stack's row counts)."""
    n = stack.lengths(num_tokens)
    rows = {"c4": n.c4_entries, "c4_indexer": n.c4_entries, "c128": n.c128_entries, "window": n.window_tokens,
            "c4_state": int(n.has_overlap), "c4_buffer": n.c4_buffered, "c128_buffer": n.c128_buffered}
    return {stack.pool(role): r * group[stack.pool(role)].slot_nbytes for role, r in rows.items()}


def offloaded(model: torch.nn.Module, setup: Setup, *, tamper: Tamper | None = None, tamper_turn: int = 0,
              config: SchedulerConfig | None = None, conversations: int = CONVERSATIONS,
              turns: int | None = None) -> Run:
    """The conversations with their caches offloaded between turns (the first
    ``turns`` turns of each). ``tamper`` runs once, for conversation 0, between
    the backup after turn ``tamper_turn`` and the load that follows."""
    group = PoolGroup()
    stack = make_stack(model, setup, group)
    bridge = DeepseekV4CacheBridge(stack, group)
    run = Run({}, stack, group)

    async def conversation(sched: TransferScheduler, c: int) -> None:
        out = run.transcripts[c] = Transcript()
        cache = bridge.new_cache(model.config)
        last = None
        host: dict[str, torch.Tensor] | None = None
        stored: SequenceSlots | None = None
        users = user_turns(setup, c)[:turns]
        for turn, user in enumerate(users):
            if host is not None and stored is not None:
                load = await sched.load(host)
                loaded = stored.moved_to(load.device_indices)
                bridge.release(stored)
                cache = bridge.new_cache(model.config)
                for t in range(bridge.num_layers):
                    await load.layer_ready(t)  # later layers are still landing
                    bridge.restore_layer(cache, loaded, t)
                await load
                sched.free_host(host)
                bridge.release(loaded)
            last = run_turn(model, cache, user if last is None else torch.cat([last, user], dim=1), out)
            if turn == len(users) - 1:
                break
            stored = bridge.store(cache)
            run.stored.append(stored)
            backup = await sched.backup(stored.indices, valid_rows=stack.valid_rows(stored.num_tokens))
            await backup
            host = {name: backup.host_indices[name] for name in stored.indices}
            for name, rows in bridge.rows(stored).items():  # the engine lost the rows
                dev = group[name].device
                assert dev is not None
                for j in range(dev.num_layers):
                    for p in range(len(dev.planes)):
                        dev.tensor(j, p)[rows] = 0
            cache.reset()
            if tamper is not None and c == 0 and turn == tamper_turn:
                tamper(group, stack, host)

    async def main() -> None:
        async with TransferScheduler(group, config=config) as sched:
            async with anyio.create_task_group() as tg:
                for c in range(conversations):
                    tg.start_soon(conversation, sched, c)
            run.stats = sched.statistics()
            run.nbytes = sched.executor.statistics().nbytes  # type: ignore[attr-defined]

    anyio.run(main)
    return run


def assert_identical(got: Transcript, want: Transcript) -> None:
    assert got.tokens == want.tokens
    assert len(got.logits) == len(want.logits)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert torch.equal(a, b), f"logits differ at step {step}"


# -- equality ------------------------------------------------------------------


@pytest.mark.parametrize("setup", [SMALL, REAL], ids=["small-rates", "real-rates"])
def test_offloaded_v4_conversations_match_bit_for_bit(setup: Setup) -> None:
    model = model_for(setup)
    want = {c: reference(model, user_turns(setup, c)) for c in range(CONVERSATIONS)}
    assert want[0].tokens != want[1].tokens
    run = offloaded(model, setup)
    for c in range(CONVERSATIONS):
        assert_identical(run.transcripts[c], want[c])

    stack = run.stack
    assert set(stack.names) == {"tok", "c4", "c4_indexer", "c128", "swa", "c4_state", "c4_buffer", "c128_buffer"}
    assert stack["c4"].page_size == setup.page // setup.csa
    assert stack["c128"].page_size == setup.page // setup.hca
    assert stack["c128"].layer_map == (0, None, None, None, 1)
    assert stack["c4"].layer_map == stack["c4_indexer"].layer_map == (None, 0, None, 1, None)
    assert stack["swa"].layer_map == (0, 1, 2, 3, 4)
    # What moved: the window in one page of its own size, whatever the anchor's page.
    for seq in run.stored:
        assert seq.indices["swa"].numel() == setup.window
        n = stack.lengths(seq.num_tokens)
        assert seq.indices["tok"].numel() == -(-seq.num_tokens // setup.page) * setup.page
        assert ("c128_buffer" in seq.indices) == (n.c128_buffered > 0)
    assert any(stack.lengths(s.num_tokens).c128_entries >= 1 for s in run.stored)  # c128 rows really moved
    # Every backup and load moved exactly the bytes that hold data, and the
    # lengths end mid-page in every pool that can (c4_state is one slot).
    assert run.nbytes == 2 * sum(sum(data_bytes(stack, run.group, s.num_tokens).values()) for s in run.stored)
    partial = {name for s in run.stored for name in stack.valid_rows(s.num_tokens)}
    assert partial == set(stack.names) - {"tok", "c4_state"}

    stats = run.stats
    assert stats is not None
    rounds = CONVERSATIONS * (len(setup.turns) - 1)
    assert stats.backup.completed == stats.load.completed == rounds
    assert stats.backup.failed == stats.load.failed == 0
    for name in stack.anchors:
        spec = run.group[name]
        assert stats.pools[name].used_slots == 0
        assert spec.device_allocator is not None and spec.device_allocator.num_free_slots == spec.device_slots


# -- storage: engine B continues A's conversation by token ids ---------------------


# window page 6: the window (15 rows) in 3 pages, and 32 tokens is not a multiple of lcm(16, 6) = 48.
@pytest.mark.parametrize("window_page", [None, 6], ids=["window-page-16", "window-page-6"])
def test_engine_b_continues_from_the_store_by_token_ids(tmp_path: Path, window_page: int | None) -> None:
    setup = SMALL
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, VOCAB, (1, 2 * setup.page), generator=gen)  # ends on an anchor page boundary
    follow = torch.randint(0, VOCAB, (1, 9), generator=gen)
    model_a = model_for(setup)
    model_b = build(setup)  # its own instance, same weights
    want = reference(model_a, [prompt, follow])

    tokens = prompt[0].tolist()
    first: list[torch.Tensor] = []

    async def engine_a() -> None:
        group = PoolGroup()
        stack = make_stack(model_a, setup, group, window_page)
        bridge = DeepseekV4CacheBridge(stack, group)
        cache = bridge.new_cache(model_a.config)
        with torch.no_grad():
            first.append(model_a(input_ids=prompt, use_cache=True, **{cache_argument(model_a): cache}).logits)
        keys = stack.storage_keys(group, tokens, identity=IDENTITY)
        # The keys of the model string are those of its identity (what KeyNamespace.for_pool gave).
        assert stack.storage_keys(group, tokens, model="tiny-deepseek-v4") == keys
        with pytest.raises(ValueError, match="ends on an anchor page boundary .* got 31 tokens: publish the first 16"):
            stack.storage_keys(group, tokens[:-1], model="tiny-deepseek-v4")
        with pytest.raises(ConfigurationError, match="needs one of model= .* and identity="):
            stack.storage_keys(group, tokens)
        async with FileStore(tmp_path) as store, TransferScheduler(group, storage=store, identity=IDENTITY) as sched:
            seq = bridge.store(cache)
            backup = await sched.backup(seq.indices, valid_rows=stack.valid_rows(seq.num_tokens))
            await backup
            host = {n: backup.host_indices[n] for n in seq.indices}
            written = await (await sched.write_storage(host, keys))
            assert sum(written.pages_written.values()) == sum(len(k) for k in keys.values())
            sched.free_host(host)
            bridge.release(seq)

    got = Transcript()

    async def engine_b() -> None:
        group = PoolGroup()
        stack = make_stack(model_b, setup, group, window_page)
        bridge = DeepseekV4CacheBridge(stack, group)
        async with FileStore(tmp_path) as store, TransferScheduler(group, storage=store, identity=IDENTITY) as sched:
            keys = stack.storage_keys(group, tokens, identity=IDENTITY)
            fetched = await (await sched.prefetch(keys, policy="wait_complete", all_pools=True))
            assert fetched.complete
            load = await sched.load(fetched.host_indices)
            seq = bridge.sequence(len(tokens), load.device_indices, prefetched=fetched)
            cache = bridge.new_cache(model_b.config)
            for t in range(bridge.num_layers):
                await load.layer_ready(t)
                bridge.restore_layer(cache, seq, t)
            await load
            sched.free_host(fetched.host_indices)
            bridge.release(seq)
        next_token = first[0][:, -1:].argmax(-1)
        run_turn(model_b, cache, torch.cat([next_token, follow], dim=1), got)

    anyio.run(engine_a)
    anyio.run(engine_b)
    assert torch.equal(first[0], want.logits[0])
    # The reference's turn 2 starts after its GENERATE decode steps of turn 1;
    # B continues right after the prompt, so compare with a reference that does the same.
    want_b = Transcript()
    cache = transformers.DynamicCache(config=model_a.config)
    with torch.no_grad():
        model_a(input_ids=prompt, use_cache=True, **{cache_argument(model_a): cache})
    run_turn(model_a, cache, torch.cat([first[0][:, -1:].argmax(-1), follow], dim=1), want_b)
    assert_identical(got, want_b)


# -- negative controls ---------------------------------------------------------


def _sidecar_row(role: str, entry: int) -> Tamper:
    """Change compressed entry ``entry`` of pool layer 0 of the ``role`` sidecar on the host."""

    def tamper(group: PoolGroup, stack: DeepseekV4Stack, host: dict[str, torch.Tensor]) -> None:
        name = stack.pool(role)
        rows = derive_sidecar_indices(host[stack.pool("anchor")], stack.page_size, stack[name].page_size)
        view = group[name].host.layer_view(0, 0)
        view[rows[entry]] = -4.0 * view[rows[entry]] + 1.0

    return tamper


def _pool_rows(role: str, plane: int, row: Callable[[torch.Tensor], torch.Tensor]) -> Tamper:
    def tamper(group: PoolGroup, stack: DeepseekV4Stack, host: dict[str, torch.Tensor]) -> None:
        name = stack.pool(role)
        view = group[name].host.layer_view(0, plane)
        view[row(host[name])] += 1.0

    return tamper


# control -> (the change, the turn after whose backup it is made, the pool verify names)
CONTROLS: dict[str, tuple[Tamper, int, str]] = {
    "c4-row": (_sidecar_row("c4", 1), 0, "c4"),
    "c4_indexer-row": (_sidecar_row("c4_indexer", 1), 0, "c4_indexer"),
    # After turn 0 the cache holds 15 tokens, no HCA entry yet at rate 16; after turn 1, 25.
    "c128-row": (_sidecar_row("c128", 0), 1, "c128"),
    "window-newest-token": (_pool_rows("window", 0, lambda idx: idx[SMALL.turns[0] + GENERATE - 2]), 0, "swa"),
    "c4_state-overlap": (_pool_rows("c4_state", 0, lambda idx: idx[0]), 0, "c4_state"),
    # After turn 1 (25 tokens) one token waits in the CSA buffer; turn 2's first window compresses it.
    "c4_buffer-row": (_pool_rows("c4_buffer", 0, lambda idx: idx[0]), 1, "c4_buffer"),
    # 15 HCA tokens wait in the buffer after turn 0; turn 1's first window compresses them.
    "c128_buffer-row": (_pool_rows("c128_buffer", 0, lambda idx: idx[3]), 0, "c128_buffer"),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_a_row_changed_on_the_host_changes_the_logits(control: str) -> None:
    tamper, at, _ = CONTROLS[control]
    model = model_for(SMALL)
    want = reference(model, user_turns(SMALL, 0)[: at + 2])
    run = offloaded(model, SMALL, tamper=tamper, tamper_turn=at, conversations=1, turns=at + 2)
    got = run.transcripts[0]
    first = (at + 1) * GENERATE  # the first forward on the reloaded, changed cache
    for step in range(first):
        assert torch.equal(got.logits[step], want.logits[step])
    a, b = got.logits[first], want.logits[first]
    assert not torch.equal(a, b)
    print(f"{control}: max abs logit difference {float((a - b).abs().max()):.4g}")


@pytest.mark.parametrize("control", list(CONTROLS))
def test_verify_mode_refuses_the_changed_rows(control: str) -> None:
    tamper, at, pool = CONTROLS[control]
    with pytest.raises(Exception) as caught:  # an ExceptionGroup from the task group
        offloaded(model_for(SMALL), SMALL, tamper=tamper, tamper_turn=at, config=SchedulerConfig(verify=True),
                  conversations=1, turns=at + 2)
    assert caught.group_contains(CorruptionDetected, match=repr(pool))


# -- refusals ------------------------------------------------------------------


def test_the_generic_bridge_refuses_a_v4_cache() -> None:
    """HFCacheBridge would move the window and drop the compressors: it says so instead."""
    with pytest.raises(ConfigurationError, match="DeepseekV4HCACache .* use DeepseekV4CacheBridge"):
        HFCacheLayout.probe(model_for(SMALL), page_size=SMALL.page)


def test_the_v4_bridge_refuses_another_models_cache() -> None:
    model = model_for(SMALL)
    group = PoolGroup()
    bridge = DeepseekV4CacheBridge(make_stack(model, SMALL, group), group)
    other = model_for(REAL)
    cache = transformers.DynamicCache(config=other.config)
    with torch.no_grad():
        other(input_ids=torch.zeros((1, 5), dtype=torch.long), use_cache=True, **{cache_argument(other): cache})
    free = {n: group[n].device_allocator.num_free_slots for n in bridge.stack.anchors}  # type: ignore[union-attr]
    # Same layer types, other rates: the layer's own rate gives it away, and nothing is taken.
    with pytest.raises(ConfigurationError, match="layer 0 .heavily_compressed_attention. is a cache for compress_rate "
                                                 "128; this stack's model has 16"):
        bridge.store(cache)
    # This model's cache with an entry count its length cannot make: refused too.
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 5), dtype=torch.long), use_cache=True, **{cache_argument(model): cache})
    cache.layers[0].entry_count["compressor"] = 1
    with pytest.raises(ConfigurationError, match="layer 0 compressor has 1 compressed entries; 5 tokens at rate 16 make 0"):
        bridge.store(cache)
    assert free == {n: group[n].device_allocator.num_free_slots for n in bridge.stack.anchors}  # type: ignore[union-attr]


# -- the edges of the entry counts ------------------------------------------------


@pytest.mark.parametrize("tokens", [3, 4, 5, 16, 17])
def test_a_prefix_at_the_edges_of_the_csa_and_hca_entries_round_trips(tokens: int) -> None:
    """No entry yet (3), exactly one CSA entry (4: overlap state exists from the
    first entry on), one past it (5), exactly one HCA entry (16) and one past
    (17): store, restore into a new cache, and the next tokens' logits match
    the original cache's bit for bit."""
    setup = SMALL
    model = model_for(setup)
    group = PoolGroup()
    bridge = DeepseekV4CacheBridge(make_stack(model, setup, group), group)
    gen = torch.Generator().manual_seed(tokens)
    prompt = torch.randint(0, VOCAB, (1, tokens), generator=gen)
    follow = torch.randint(0, VOCAB, (1, 3), generator=gen)
    cache = bridge.new_cache(model.config)
    with torch.no_grad():
        model(input_ids=prompt, use_cache=True, **{cache_argument(model): cache})
    assert (bridge.stack.lengths(tokens).c4_entries >= 1) == bridge.stack.lengths(tokens).has_overlap
    seq = bridge.store(cache)
    restored = bridge.restore(seq, bridge.new_cache(model.config))
    bridge.release(seq)
    with torch.no_grad():
        want = model(input_ids=follow, use_cache=True, **{cache_argument(model): cache}).logits
        got = model(input_ids=follow, use_cache=True, **{cache_argument(model): restored}).logits
    assert torch.equal(got, want)


def test_rows_that_hold_no_data_are_not_moved_nor_checked() -> None:
    """After turn 0 (15 tokens) the window page's row 15, the c4 page's row 3
    (3 entries) and the c128 page (no entry at rate 16) hold no data: changed
    on the host, they change no logit, and verify mode loads without a word,
    for they are neither copied nor hashed."""

    def tamper(group: PoolGroup, stack: DeepseekV4Stack, host: dict[str, torch.Tensor]) -> None:
        _pool_rows("window", 0, lambda idx: idx[SMALL.window - 1])(group, stack, host)
        _sidecar_row("c4", 3)(group, stack, host)
        _sidecar_row("c128", 0)(group, stack, host)

    model = model_for(SMALL)
    want = reference(model, user_turns(SMALL, 0)[:2])
    run = offloaded(model, SMALL, tamper=tamper, tamper_turn=0, config=SchedulerConfig(verify=True),
                    conversations=1, turns=2)
    assert_identical(run.transcripts[0], want)
