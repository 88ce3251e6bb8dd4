"""End to end: two engines share a conversation's cache through the storage tier.

Tiny transformers models with random float32 weights (the builder of
``test_e2e_hf.py``: fixed seed, nothing downloaded) hold one greedy two-turn
conversation, split across two engines that share nothing but a directory:

* Engine A (the model, a `PoolGroup`, a `TransferScheduler` and a `FileStore`
  on the shared directory) runs turn 1: prefill of the prompt, then greedy
  decoding. Its cache then holds a whole number of pages. `HFCacheBridge`
  writes it into device rows, the scheduler backs them up to the host and
  writes the host pages to the store, keyed by the conversation's token ids.
* Engine B (a second model instance with the same weights, and a group,
  scheduler and `FileStore` of its own on the same directory) receives only
  the conversation's token ids (the prompt, A's reply, the next user message).
  It computes the keys of the whole pages it does not need to recompute,
  prefetches them from the store, loads them into its device pools, rebuilds
  the model's cache layer by layer, and runs turn 2.

Tokens and logits of both turns must equal (``torch.equal``) those of the same
conversation run by one model that never offloads its cache (the same forward
calls on the same inputs, so bit-exact results are the claim). The reference
keeps that schedule on purpose: one prefill of the whole conversation rounds
differently (Llama, LFM2: about 1e-6 on the logits) and, for Bamba on
transformers' PyTorch Mamba path, gives materially different logits.

Keys. A page's key names every token up to the page's end (`page_keys` chains
them), and a KV page depends on exactly those tokens. The recurrent state
(pool ``state``, page size 1) of a hybrid model is the state after the whole
cached prefix, so it is keyed by the key of the prefix's last token, in the
state pool's namespace: the state after exactly the stored tokens, and after no
other prefix. A changed token in the first page therefore misses everything; one
changed in the last stored page still hits the pages before it, and misses the state.

Models: Llama (pool ``kv``), LFM2 (short-conv state + ``kv``) and Bamba
(Mamba-2 conv and SSM states + ``kv``).

Sliding windows. A Gemma-3 sliding layer keeps only its last ``WINDOW - 1``
tokens, so its pool (``swa``) stores the pages those rows fall in, and what a
page holds depends on where the prefix ENDS: for a 16-token prefix, window
page 2 holds only token 11; for the 12-token prefix, tokens 8-11. Those pages
are keyed by `window_keys` (each key names the whole prefix and the page's
place from the end), never by `page_keys`, under which the 12-token prefix
would find the 16-token prefix's page 2 "already stored" and read rows it lacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.15")

# The model builder, one-thread deterministic fixture and transcript helpers of
# the e2e tests next door (importable because pytest puts tests/ on sys.path).
from test_e2e_hf import (
    PAGE,
    VOCAB,
    WINDOW,
    Transcript,
    _build,
    assert_identical,
    deterministic,  # noqa: F401  (autouse fixture: one thread, deterministic kernels)
    model_named,
)

from kvtier import PoolGroup, PrefetchResult, TransferScheduler
from kvtier.integrations.hf import (
    HFCacheBridge,
    HFCacheLayout,
    SequenceSlots,
    cache_argument,
)
from kvtier.storage import FileStore, KeyNamespace, page_keys, window_keys

pytestmark = pytest.mark.e2e

PROMPT = 3 * PAGE  # turn 1's prompt: whole pages
REPLY = PAGE + 1  # forwards of turn 1: the cache then holds PROMPT + PAGE tokens, whole pages
USER = 2  # turn 2's user message: with A's last token, fewer than PAGE tokens to compute
GENERATE = 4  # forwards of turn 2
CACHED = PROMPT + REPLY - 1
assert CACHED % PAGE == 0
STORED_PAGES = CACHED // PAGE

# Pools of each model; the hybrids' ``state`` pool is keyed by the cached prefix's last token.
MODELS = {"llama": ("kv",), "lfm2": ("kv", "state"), "bamba": ("kv", "state")}


# -- the conversation -------------------------------------------------------


def conversation_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2024)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=gen)
    user = torch.randint(0, VOCAB, (1, USER), generator=gen)
    return prompt, user


def run_turn(model: torch.nn.Module, cache: object, ids: torch.Tensor, steps: int, out: Transcript) -> torch.Tensor:
    """Prefill ``ids`` and decode greedily: ``steps`` forward passes in all.
    Returns the last token (not in the cache yet)."""
    arg = cache_argument(model)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids, use_cache=True, **{arg: cache}).logits
            out.logits.append(logits.clone())
            ids = logits[:, -1:].argmax(-1)
            out.tokens.append(int(ids))
    return ids


def reference(model: torch.nn.Module) -> tuple[Transcript, Transcript]:
    """Both turns on one model whose cache never leaves it."""
    prompt, user = conversation_inputs()
    turn1, turn2 = Transcript(), Transcript()
    cache = transformers.DynamicCache(config=model.config)
    last = run_turn(model, cache, prompt, REPLY, turn1)
    run_turn(model, cache, torch.cat([last, user], dim=1), GENERATE, turn2)
    return turn1, turn2


# -- engines -----------------------------------------------------------------


@dataclass
class Engine:
    """One serving engine: its own model instance, pools, bridge and store."""

    model: torch.nn.Module
    layout: HFCacheLayout
    group: PoolGroup
    bridge: HFCacheBridge
    store: FileStore
    namespaces: dict[str, KeyNamespace] = field(default_factory=dict)

    @classmethod
    def start(cls, model: torch.nn.Module, name: str, directory: Path) -> Engine:
        layout = HFCacheLayout.probe(model, page_size=PAGE)
        per_seq = layout.slots_needed(PROMPT + REPLY + USER + GENERATE)
        # Room for a few sequences: the controls' prefetches take host pages too.
        group = PoolGroup()
        layout.add_pools(
            group,
            device_slots={p: 2 * n for p, n in per_seq.items()},
            host_slots={p: 4 * n for p, n in per_seq.items()},
        )
        # The model's identity: every engine that loads these weights uses the same string.
        namespaces = {p: KeyNamespace.for_pool(group, p, model=f"tiny-{name}-seed0") for p in layout.pools}
        return cls(model, layout, group, HFCacheBridge(layout, group), FileStore(directory), namespaces)

    def keys(self, tokens: list[int], cached: int) -> dict[str, list[bytes]]:
        """The keys of the first ``cached`` tokens (whole pages) of ``tokens``, per pool."""
        assert cached % PAGE == 0
        prefix = tokens[:cached]
        keys = {self.layout.kv_pool: page_keys(self.namespaces[self.layout.kv_pool], prefix)}
        if self.layout.state_pool in self.layout.pools:
            # Page size 1: one key per token; the state after the whole prefix
            # goes by the key of its last token.
            keys[self.layout.state_pool] = page_keys(self.namespaces[self.layout.state_pool], prefix)[-1:]
        return keys

    def scheduler(self) -> TransferScheduler:
        return TransferScheduler(self.group, storage=self.store)

    def assert_everything_freed(self, sched: TransferScheduler) -> None:
        stats = sched.statistics()
        for pool in self.layout.pools:
            alloc, dev = self.group[pool].device_allocator, self.group[pool].device
            assert alloc is not None and dev is not None
            assert alloc.num_free_slots == dev.slots, pool
            assert stats.pools[pool].used_slots == 0, pool


@dataclass
class EngineAResult:
    turn1: Transcript
    tokens: list[int]  # the conversation's token ids so far: the prompt and A's reply
    written: Mapping[str, int]
    present: Mapping[str, int]


def engine_a(a: Engine) -> EngineAResult:
    """Turn 1, then publish the conversation's cache to the store."""
    prompt, _ = conversation_inputs()
    turn1 = Transcript()
    cache = a.layout.new_cache()
    run_turn(a.model, cache, prompt, REPLY, turn1)
    tokens = prompt[0].tolist() + turn1.tokens
    seq_tokens = tokens[:CACHED]  # the last reply token is not in the cache yet

    async def publish() -> EngineAResult:
        async with a.store, a.scheduler() as sched:  # the store closes after the scheduler
            stored = a.bridge.store(cache)
            assert stored.num_tokens == CACHED
            backup = await sched.backup(stored.indices)
            await backup
            a.bridge.release(stored)
            host = {p: backup.host_indices[p] for p in a.layout.pools}
            keys = a.keys(seq_tokens, CACHED)
            for p in a.layout.pools:
                assert host[p].numel() == len(keys[p]) * a.layout.pool_page_size(p)
            write = await sched.write_storage(host, keys)
            result = await write
            sched.free_host(host)
            a.assert_everything_freed(sched)
        return EngineAResult(turn1, tokens, result.pages_written, result.pages_present)

    return anyio.run(publish)


@dataclass
class EngineBResult:
    turn2: Transcript
    requested: Mapping[str, int]
    hit: Mapping[str, int]
    fetched: Mapping[str, int]
    complete: bool
    controls: dict[str, tuple[Mapping[str, int], Mapping[str, int]]]  # name -> (hit_pages, pages)


async def restore_from_store(
    b: Engine, sched: TransferScheduler, keys: dict[str, list[bytes]], cached: int, window_held: int
) -> tuple[PrefetchResult, Any]:
    """Prefetch ``keys``, load them and rebuild the model cache of the first
    ``cached`` tokens layer by layer (``window_held`` of them in the sliding
    layers); every slot is given back. The cache is None when the prefetch
    did not bring every page."""
    got = await (await sched.prefetch(keys, policy="wait_complete"))
    if not got.complete:  # the caller's asserts say what was missing
        if got.host_indices:
            sched.free_host(got.host_indices)
        return got, None
    load = await sched.load(got.host_indices)
    seq = SequenceSlots(cached, window_held, {p: load.device_indices[p] for p in b.layout.pools})
    cache = b.layout.new_cache()
    for t in range(b.layout.num_layers):
        await load.layer_ready(t)
        b.bridge.restore_layer(cache, seq, t)
    await load
    sched.free_host(got.host_indices)
    b.bridge.release(seq)  # the model's cache holds copies
    return got, cache


def engine_b(b: Engine, tokens: list[int]) -> EngineBResult:
    """Turn 2 from the token ids alone: the cache comes from the store."""
    # The largest whole-page prefix that leaves at least one token to compute
    # (the next token's logits need a forward pass).
    cached = (len(tokens) - 1) // PAGE * PAGE
    keys = b.keys(tokens, cached)

    async def serve() -> EngineBResult:
        async with b.store, b.scheduler() as sched:
            got, cache = await restore_from_store(b, sched, keys, cached, 0)
            if cache is None:
                return EngineBResult(Transcript(), got.requested_pages, got.hit_pages, got.pages, False, {})

            turn2 = Transcript()
            run_turn(b.model, cache, torch.tensor([tokens[cached:]]), GENERATE, turn2)

            # Negative controls: the same conversation with one token changed.
            controls = {}
            for name, position in (("first page", 1), ("last stored page", cached - 1)):
                other = list(tokens)
                other[position] = (other[position] + 1) % VOCAB
                miss = await (await sched.prefetch(b.keys(other, cached), policy="wait_complete"))
                if miss.host_indices:
                    sched.free_host(miss.host_indices)
                controls[name] = (miss.hit_pages, miss.pages)
            b.assert_everything_freed(sched)
        return EngineBResult(turn2, got.requested_pages, got.hit_pages, got.pages, got.complete, controls)

    return anyio.run(serve)


# -- the test ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_second_engine_continues_the_conversation_from_the_store(name: str, tmp_path: Path) -> None:
    model = model_named(name)
    want1, want2 = reference(model)

    shared = tmp_path / "store"
    a = Engine.start(model, name, shared)
    # Engine B: its own model instance, built the same way (same seed, same weights).
    b = Engine.start(_build(name), name, shared)
    assert b.model is not a.model
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb), ka
    assert a.layout.pools == b.layout.pools == MODELS[name]
    assert a.namespaces == b.namespaces  # same model and pools: same keys for the same tokens

    published = engine_a(a)
    assert_identical(published.turn1, want1)
    stored = {p: STORED_PAGES if p == a.layout.kv_pool else 1 for p in MODELS[name]}
    assert dict(published.written) == stored
    assert dict(published.present) == dict.fromkeys(MODELS[name], 0)

    _, user = conversation_inputs()
    served = engine_b(b, published.tokens + user[0].tolist())  # the next user message arrives at B
    # Every page engine A stored, and nothing else, was asked for, found and read.
    assert dict(served.requested) == dict(served.hit) == dict(served.fetched) == stored
    assert served.complete
    # Turn 2, computed by engine B on the cache engine A computed, is bit for bit
    # the turn of the model that never let its cache go.
    assert_identical(served.turn2, want2)

    # One token changed in the first page: every key differs, nothing is found.
    nothing = dict.fromkeys(MODELS[name], 0)
    hit, pages = served.controls["first page"]
    assert dict(hit) == dict(pages) == nothing
    # One token changed in the last stored page: the pages before it still hit;
    # that page and the state (after a prefix that was never computed) do not.
    hit, pages = served.controls["last stored page"]
    partial = nothing | {a.layout.kv_pool: STORED_PAGES - 1}
    assert dict(hit) == dict(pages) == partial


# -- sliding window: stored pages that depend on where the prefix ends -------

LONG, SHORT = 4 * PAGE, 3 * PAGE  # two prefixes of one prompt, whole pages each
NEW = 3  # tokens of B's request after the cached prefix


def window_prompt() -> list[int]:
    return torch.randint(0, VOCAB, (LONG,), generator=torch.Generator().manual_seed(7)).tolist()


def window_pages(e: Engine, n: int) -> int:
    """Pages of the ``swa`` pool that hold a ``n``-token prefix's window (n whole pages)."""
    return e.layout.slots_needed(n)[e.layout.swa_pool] // PAGE


def window_pool_keys(e: Engine, prefix: list[int]) -> dict[str, list[bytes]]:
    """``kv``: one `page_keys` key per page; ``swa``: `window_keys` of the pages the window holds."""
    assert len(prefix) % PAGE == 0
    kv, swa = e.layout.kv_pool, e.layout.swa_pool
    return {
        kv: page_keys(e.namespaces[kv], prefix),
        swa: window_keys(e.namespaces[swa], prefix, window_pages(e, len(prefix))),
    }


@dataclass
class Published:
    keys: dict[str, list[bytes]]
    written: dict[str, int]
    present: dict[str, int]


def publish_prefixes(a: Engine, prompt: list[int], lengths: tuple[int, ...]) -> list[Published]:
    """Engine A computes each prefix of ``prompt`` on a fresh cache and publishes it, in order.

    A prefix is prefilled in chunks that end at each of the shorter ``lengths``
    (16 tokens: 12, then 4), so its first rows are bit for bit those of the
    shorter prefix: one 16-token forward rounds the rows of tokens 0-11 of the
    full-attention layer differently (about 1e-6), and the shorter prefix would
    then find, correctly, those kv pages, which are not the reference's bits.
    """
    arg = cache_argument(a.model)

    async def publish() -> list[Published]:
        out = []
        async with a.store, a.scheduler() as sched:
            for n in lengths:
                prefix = prompt[:n]
                ends = sorted({m for m in lengths if m < n} | {n})
                cache = a.layout.new_cache()
                with torch.no_grad():
                    for start, end in zip([0, *ends], ends):
                        a.model(input_ids=torch.tensor([prefix[start:end]]), use_cache=True, **{arg: cache})
                stored = a.bridge.store(cache)
                assert (stored.num_tokens, stored.window_tokens) == (n, min(n, WINDOW - 1))
                backup = await sched.backup(stored.indices)
                await backup
                a.bridge.release(stored)
                host = {p: backup.host_indices[p] for p in a.layout.pools}
                keys = window_pool_keys(a, prefix)
                for p in a.layout.pools:
                    assert host[p].numel() == len(keys[p]) * PAGE, p
                result = await (await sched.write_storage(host, keys))
                sched.free_host(host)
                out.append(Published(keys, dict(result.pages_written), dict(result.pages_present)))
            a.assert_everything_freed(sched)
        return out

    return anyio.run(publish)


def continue_from_store(b: Engine, tokens: list[int], cached: int) -> EngineBResult:
    """Engine B: the first ``cached`` tokens from the store, then ``tokens[cached:]`` and greedy decoding."""
    keys = window_pool_keys(b, tokens[:cached])

    async def serve() -> EngineBResult:
        async with b.store, b.scheduler() as sched:
            got, cache = await restore_from_store(b, sched, keys, cached, min(cached, WINDOW - 1))
            if cache is None:
                return EngineBResult(Transcript(), got.requested_pages, got.hit_pages, got.pages, False, {})
            turn = Transcript()
            run_turn(b.model, cache, torch.tensor([tokens[cached:]]), GENERATE, turn)
            b.assert_everything_freed(sched)
        return EngineBResult(turn, got.requested_pages, got.hit_pages, got.pages, True, {})

    return anyio.run(serve)


def test_sliding_window_pages_of_a_longer_prefix_are_not_read_as_a_shorter_ones(tmp_path: Path) -> None:
    """A publishes the 16-token prefix, then the 12-token one; B continues from
    the 12-token prefix loaded from the store, bit for bit like the model that
    never let its cache go. Window page 2 of the 16-token prefix holds only
    token 11; stored under the page's `page_keys` key it would be "already
    present" for the 12-token prefix, whose window also needs tokens 8-10."""
    model = model_named("gemma3")
    prompt = window_prompt()
    request = prompt[:SHORT + NEW]  # B's request: the 12 cached tokens and 3 new ones

    # The reference: the same forward calls on a cache that stays in the model.
    want = Transcript()
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt[:SHORT]]), use_cache=True, **{cache_argument(model): cache})
    run_turn(model, cache, torch.tensor([request[SHORT:]]), GENERATE, want)

    shared = tmp_path / "store"
    a = Engine.start(model, "gemma3", shared)
    b = Engine.start(_build("gemma3"), "gemma3", shared)
    assert b.model is not a.model
    assert a.layout.pools == b.layout.pools == ("kv", "swa")
    assert a.layout.sliding_window == WINDOW
    # The windows: pages 2-3 of the 16-token prefix, pages 1-2 of the 12-token one.
    assert window_pages(a, LONG) == window_pages(a, SHORT) == 2

    long, short = publish_prefixes(a, prompt, (LONG, SHORT))  # the order that used to break
    served = continue_from_store(b, request, SHORT)
    assert served.complete, (served.requested, served.hit, served.fetched)
    # Every page of the 12-token prefix was asked for, found and read...
    stored = {"kv": SHORT // PAGE, "swa": 2}
    assert dict(served.requested) == dict(served.hit) == dict(served.fetched) == stored
    # ... and B's continuation is the reference's, tokens and logits.
    assert_identical(served.turn2, want)

    # Why: the kv pages of the shorter prefix are the longer one's first three
    # (same tokens, same rows: found, not rewritten), but no window key is
    # shared, so every window page of the 12-token prefix was written, none
    # skipped as "already present".
    assert short.keys["kv"] == long.keys["kv"][: SHORT // PAGE]
    assert not set(short.keys["swa"]) & set(long.keys["swa"])
    assert long.written == {"kv": LONG // PAGE, "swa": 2} and long.present == {"kv": 0, "swa": 0}
    assert short.written == {"kv": 0, "swa": 2} and short.present == {"kv": SHORT // PAGE, "swa": 0}
