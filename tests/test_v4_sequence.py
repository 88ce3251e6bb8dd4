"""`DeepseekV4CacheBridge.sequence` refuses index sets that do not line up
with the token count (DESIGN lesson 22): a missing pool, another size (too
few or too many slots), a pool this length does not use, a tensor that is not
1-D integer, or a prefetch that was cut short or holds another length. No
model is needed: the bridge only reads the stack and the group."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier import InvalidIndices, PoolGroup, PrefetchResult
from kvtier.integrations.hf import DeepseekV4CacheBridge
from kvtier.presets import deepseek_v4

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def bridge() -> DeepseekV4CacheBridge:
    config = SimpleNamespace(
        layer_types=[SLIDING, CSA, HCA], compress_rates={CSA: 4, HCA: 16}, sliding_window=16,
        head_dim=8, index_head_dim=4, num_key_value_heads=1,
    )
    group = PoolGroup()
    stack, _ = deepseek_v4(config, group, tokens=256, requests=4, host_ratio=1.0)
    return DeepseekV4CacheBridge(stack, group)


def slots(n: int, first: int = 0) -> torch.Tensor:
    return torch.arange(first, first + n)


def indices_for(b: DeepseekV4CacheBridge, num_tokens: int) -> dict[str, torch.Tensor]:
    return {name: slots(n) for name, n in b.stack.slots_needed(num_tokens).items()}


def result(pages: dict[str, int], requested: dict[str, int] | None = None) -> PrefetchResult:
    requested = dict(pages) if requested is None else requested
    return PrefetchResult(0, {}, pages, dict(pages), requested, stopped=False, nbytes=0,
                          seconds_queued=0.0, seconds_total=0.0)


def test_a_set_that_lines_up_is_taken() -> None:
    b = bridge()
    assert b.stack.slots_needed(32) == {"tok": 32, "swa": 16, "c4_state": 1}
    assert b.stack.slots_needed(40) == {"tok": 48, "swa": 16, "c4_state": 1, "c128_buffer": 16}
    for n in (32, 40):
        seq = b.sequence(n, {**indices_for(b, n), "c4": slots(4)})  # a sidecar is ignored
        assert seq.num_tokens == n and sorted(seq.indices) == sorted(b.stack.slots_needed(n))
    seq = b.sequence(32, indices_for(b, 32), prefetched=result({"tok": 2, "swa": 1, "c4_state": 1}))
    assert seq.window_tokens == 15


@pytest.mark.parametrize(("pool", "delta"), [("tok", 16), ("tok", -16), ("swa", 16), ("c4_state", 1), ("c4_state", -1)])
def test_another_size_is_refused_too_many_slots_as_too_few(pool: str, delta: int) -> None:
    b = bridge()
    idx = indices_for(b, 32)
    want = idx[pool].numel()
    idx[pool] = slots(want + delta)
    with pytest.raises(InvalidIndices, match=rf"pool '{pool}' holds {want} slots of a 32-token sequence; "
                                             rf"got {want + delta}") as err:
        b.sequence(32, idx)
    assert (err.value.pool, err.value.rule) == (pool, "slots-needed")


def test_a_missing_pool_and_a_pool_of_another_length_are_refused() -> None:
    b = bridge()
    idx = indices_for(b, 32)
    del idx["c4_state"]
    with pytest.raises(InvalidIndices, match=r"pool 'c4_state' holds 1 slots of a 32-token sequence; got none"):
        b.sequence(32, idx)
    # 40 tokens buffer 8 in HCA; 32 buffer none: the buffer's pages say these are 40 tokens' indices.
    idx = {**indices_for(b, 40), "tok": slots(32)}
    with pytest.raises(InvalidIndices, match=r"pool 'c128_buffer' holds nothing of a 32-token sequence; got 16 "
                                             r"slots for it \(indices of a sequence of another length\)") as err:
        b.sequence(32, idx)
    assert (err.value.pool, err.value.rule) == ("c128_buffer", "slots-needed")


@pytest.mark.parametrize("bad", [torch.arange(32).reshape(2, 16), torch.arange(32, dtype=torch.float32),
                                 torch.ones(32, dtype=torch.bool), list(range(32))])
def test_an_index_set_that_is_not_a_1d_integer_tensor_is_refused(bad: Any) -> None:
    b = bridge()
    with pytest.raises(InvalidIndices, match=r"pool 'tok' indices must be a 1-D integer tensor") as err:
        b.sequence(32, {**indices_for(b, 32), "tok": bad})
    assert err.value.rule == "index-tensor"


def test_a_prefetch_cut_short_or_of_another_length_is_refused() -> None:
    """The issue's case: 128 anchor slots restored with a window and state
    prefetched for 192 tokens. Sizes alone cannot tell (the window is one page
    and the state one slot either way); the prefetch's pages can."""
    b = bridge()
    idx = indices_for(b, 32)
    short = result({"tok": 2, "swa": 1, "c4_state": 0}, {"tok": 2, "swa": 1, "c4_state": 1})
    with pytest.raises(InvalidIndices, match=r"needs a complete prefetch; this one handed back") as err:
        b.sequence(32, idx, prefetched=short)
    assert err.value.rule == "prefetch-complete"
    longer = result({"tok": 3, "swa": 1, "c4_state": 1})  # 48 tokens' pages, loaded onto 32 tokens' slots
    with pytest.raises(InvalidIndices, match=r"pool 'tok' holds 32 slots of a 32-token sequence; the prefetch "
                                             r"handed back 3 pages of 16 slots") as err:
        b.sequence(32, idx, prefetched=longer)
    assert (err.value.pool, err.value.rule) == ("tok", "prefetch-lengths")


def _ceil_to(n: int, size: int) -> int:
    return -(-n // size) * size


@pytest.mark.parametrize(("page_size", "window_page_size", "buffer_page_size"), [(16, 16, 16), (32, 8, 4), (48, 4, 2)])
def test_the_slots_a_sequence_needs_follow_the_pools_rules_at_every_length(
    page_size: int, window_page_size: int, buffer_page_size: int
) -> None:
    """For every length: the anchor's whole pages, the window's last
    ``sliding_window - 1`` tokens in its own pages, the CSA overlaps once an
    entry exists, one CSA buffer page while ``N % r4`` tokens wait, and the
    HCA buffer pages its ``N % r128`` tokens fill (module doc of
    `kvtier.presets.deepseek_v4`); `sequence` takes exactly those and refuses
    one page more or less of any."""
    config = SimpleNamespace(
        layer_types=[SLIDING, CSA, HCA], compress_rates={CSA: 4, HCA: 16}, sliding_window=16,
        head_dim=8, index_head_dim=4, num_key_value_heads=1,
    )
    group = PoolGroup()
    stack, _ = deepseek_v4(config, group, tokens=256, requests=4, host_ratio=1.0, page_size=page_size,
                           window_page_size=window_page_size, buffer_page_size=buffer_page_size)
    b = DeepseekV4CacheBridge(stack, group)
    for n in range(1, 100):
        want = {"tok": _ceil_to(n, page_size), "swa": _ceil_to(min(n, 15), window_page_size)}
        if n >= 4:
            want["c4_state"] = 1
        if n % 4:
            want["c4_buffer"] = 3
        if n % 16:
            want["c128_buffer"] = _ceil_to(n % 16, buffer_page_size)
        assert stack.slots_needed(n) == want, n
        idx = {name: slots(k) for name, k in want.items()}
        assert b.sequence(n, idx).num_tokens == n
        for name, k in want.items():
            step = group[name].page_size
            for other in (k - step, k + step):
                with pytest.raises(InvalidIndices, match=f"pool {name!r}"):
                    b.sequence(n, {**idx, name: slots(other)})
