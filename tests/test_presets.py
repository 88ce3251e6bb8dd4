"""Pool-stack presets: planning, sizing by ratio / bytes / slots, registration, and the V4 stack."""

from __future__ import annotations

import ast
import contextlib
import io
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier import ConfigurationError, DevicePool, PageAllocator, PoolGroup
from kvtier.pools import PlaneSpec
from kvtier.presets import (
    PoolPlan,
    PoolStack,
    anchor_with_sidecars,
    deepseek_v4,
    deepseek_v4_stack,
    shared_anchor,
)

F32, BF16 = torch.float32, torch.bfloat16
LAYERS = 4


def kv_stack(page: int = 16) -> PoolStack:
    """A full-attention pool with a compressed sidecar on two of its layers."""
    return anchor_with_sidecars(
        PoolPlan.pool("kv", page_size=page, planes=[PlaneSpec((2, 8), BF16)] * 2, layer_map=range(LAYERS)),
        [PoolPlan.sidecar("c4", source="kv", rows_per_page=page // 4, planes=[PlaneSpec((8,), BF16)],
                          layer_map=[0, None, 1, None])],
    )


def v4_config(**over: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        sliding_window=128, head_dim=64, index_head_dim=32, num_key_value_heads=1,
    )
    base.update(over)
    return SimpleNamespace(**base)


# -- bytes per page and the three sizings ------------------------------------


def test_page_bytes_count_the_sidecar_rows() -> None:
    stack = kv_stack()
    kv_row = LAYERS * 2 * (2 * 8 * 2)  # layers x (K, V) x heads x dim x bf16
    c4_row = 2 * 8 * 2
    assert stack.page_nbytes("kv") == 16 * kv_row + 4 * c4_row


def test_host_ratio_gives_ratio_times_device_pages_per_pool() -> None:
    stack = deepseek_v4_stack(v4_config())
    device = stack.device_pages_for(tokens=128 * 40, requests=8)
    host = stack.host_pages(device, host_ratio=2.5)
    assert host == {name: math.floor(2.5 * n) for name, n in device.items()}
    per_pool = stack.host_pages(device, host_ratio={n: (1 if n == "tok" else 3) for n in device})
    assert per_pool["tok"] == device["tok"] and per_pool["swa"] == 3 * device["swa"]


def test_host_bytes_split_in_the_device_stacks_proportions() -> None:
    stack = deepseek_v4_stack(v4_config())
    device = stack.device_pages_for(tokens=128 * 40, requests=8)
    total = stack.device_nbytes(device)
    budget = 3 * total + 12345
    host = stack.host_pages(device, host_bytes=budget)
    used = sum(host[n] * stack.page_nbytes(n) for n in host)
    assert used <= budget
    for name, pages in device.items():  # each pool gets its share, rounded down to whole pages
        assert host[name] == budget * pages // total >= 3 * pages


def test_host_slots_are_taken_as_given() -> None:
    stack = kv_stack()
    assert stack.host_pages({"kv": 4}, host_slots={"kv": 160}) == {"kv": 10}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"host_ratio": 0}, "pool 'kv' host_ratio must be a positive finite number; got 0"),
        ({"host_ratio": -1.0}, "pool 'kv' host_ratio must be a positive finite number; got -1.0"),
        ({"host_ratio": float("nan")}, "pool 'kv' host_ratio must be a positive finite number; got nan"),
        ({"host_ratio": True}, "pool 'kv' host_ratio must be a positive finite number; got True"),
        ({"host_ratio": 0.1}, r"pool 'kv': host_ratio 0.1 x 4 device pages gives no whole host page"),
        ({"host_bytes": 0}, r"host_bytes \(the whole stack's host budget\) must be a positive int; got 0"),
        ({"host_bytes": -5}, r"host_bytes \(the whole stack's host budget\) must be a positive int; got -5"),
        ({"host_bytes": 100}, r"pool 'kv': host_bytes 100 split over the stack .* one page of every pool needs"),
        ({"host_slots": {"kv": 0}}, "pool 'kv' host_slots must be a positive int; got 0"),
        ({"host_slots": {"kv": 24}}, "pool 'kv' host_slots must be a whole number of pages of 16 slots; got 24"),
        ({"host_slots": {}}, r"pool 'kv' needs an entry in host_slots"),
        ({"host_slots": {"kv": 16, "c4": 4}}, "host_slots names pool 'c4', which this stack cannot take there"),
        ({}, "exactly one of host_ratio, host_bytes, host_slots; got none"),
        ({"host_ratio": 1, "host_bytes": 10**9}, r"got \['host_ratio', 'host_bytes'\]"),
    ],
)
def test_bad_sizes_name_the_pool_and_the_value(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        kv_stack().host_pages({"kv": 4}, **kwargs)


def test_host_bytes_too_small_for_one_page_of_every_pool_says_how_much() -> None:
    stack = deepseek_v4_stack(v4_config())
    device = stack.device_pages_for(tokens=128 * 40, requests=8)
    need = -(-stack.device_nbytes(device) // min(device.values()))
    with pytest.raises(ConfigurationError, match=f"needs host_bytes >= {need}"):
        stack.host_pages(device, host_bytes=need - 1)
    assert min(stack.host_pages(device, host_bytes=need).values()) >= 1


@pytest.mark.parametrize("pages", [0, -2, 1.5, None])
def test_bad_device_pages_are_refused(pages: Any) -> None:
    with pytest.raises(ConfigurationError, match=f"pool 'kv' device_pages must be a positive int; got {pages!r}"):
        kv_stack().host_pages({"kv": pages}, host_ratio=1)


# -- registration ----------------------------------------------------------------


def test_register_builds_every_pool_and_reports_its_bytes() -> None:
    group = PoolGroup()
    sizes = kv_stack().register(group, device_pages={"kv": 4}, host_ratio=2)
    assert sizes.device_pages == {"kv": 4} and sizes.host_pages == {"kv": 8}
    assert group["kv"].host.slots == 8 * 16 and group["c4"].host.slots == 8 * 4
    assert group["c4"].sidecar is not None and group["c4"].sidecar.rows_per_page == 4
    assert sizes.host_nbytes == {"kv": group["kv"].host.nbytes, "c4": group["c4"].host.nbytes}
    assert sizes.total_host_nbytes == 8 * kv_stack().page_nbytes("kv")


def test_register_takes_the_engines_own_tensors() -> None:
    kv_layers = [[torch.zeros(64, 2, 8, dtype=BF16) for _ in "kv"] for _ in range(LAYERS)]
    engine_kv = DevicePool(kv_layers, allocator=PageAllocator(64, 16, name="kv"))
    group = PoolGroup()
    sizes = kv_stack().register(group, devices={"kv": engine_kv}, host_ratio=1)
    assert group["kv"].device is engine_kv
    assert sizes.device_pages == {"kv": 4}
    assert group["kv"].device.tensor(0, 0) is kv_layers[0][0]  # type: ignore[union-attr]
    with pytest.raises(ConfigurationError, match="pool 'kv': give its device allocator once.*got both"):
        kv_stack().register(PoolGroup(), devices={"kv": engine_kv}, allocators={"kv": PageAllocator(64, 16)},
                            host_ratio=1)


def test_register_refuses_tensors_that_do_not_match_the_plan_and_registers_nothing() -> None:
    wrong = DevicePool([[torch.zeros(64, 2, 4, dtype=BF16) for _ in "kv"] for _ in range(LAYERS)],
                       allocator=PageAllocator(64, 16, name="kv"))
    group = PoolGroup()
    with pytest.raises(ConfigurationError, match=r"pool 'kv' has planes .*\(2, 4\).*the stack plans .*\(2, 8\)"):
        kv_stack().register(group, devices={"kv": wrong}, host_ratio=1)
    assert len(group) == 0
    with pytest.raises(ConfigurationError, match="no whole host page"):
        kv_stack().register(group, device_pages={"kv": 4}, host_ratio=0.1)
    assert len(group) == 0
    with pytest.raises(ConfigurationError, match="layout must be one of .*; got 'bogus'"):
        deepseek_v4_stack(v4_config()).register(
            group, device_pages={"tok": 4, "swa": 1, "c4_state": 1, "c4_buffer": 1, "c128_buffer": 8}, host_ratio=1,
            layout="bogus",  # type: ignore[arg-type]
        )
    assert len(group) == 0


def test_shared_anchor_members_use_the_anchors_own_slot_numbers() -> None:
    stack = shared_anchor("tok", page_size=8, members={
        "latent": ([PlaneSpec((16,), BF16)], [0, 1]),
        "indexer": ([PlaneSpec((4,), F32)], [0, 1]),
    })
    group = PoolGroup()
    stack.register(group, device_pages={"tok": 3}, host_ratio=2)
    assert group["tok"].kind == "logical"
    for name in ("latent", "indexer"):
        assert group[name].sidecar is not None and group[name].sidecar.rows_per_page == 8  # type: ignore[union-attr]
        assert group[name].device_slots == group["tok"].device_slots == 24
    assert stack.page_nbytes("tok") == 8 * (2 * 16 * 2 + 2 * 4 * 4)


def test_stack_plans_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="sidecar 'c4' names source 'kv', which must be a pool or a logical"):
        PoolStack([PoolPlan.sidecar("c4", source="kv", rows_per_page=4, planes=[PlaneSpec((8,), F32)], layer_map=[0])])
    with pytest.raises(ConfigurationError, match="pool 'a' is planned twice"):
        PoolStack([PoolPlan.logical("a", page_size=4), PoolPlan.logical("a", page_size=4)])
    with pytest.raises(ConfigurationError, match="pool 'x' page_size must be a positive int; got 0"):
        PoolStack([PoolPlan.logical("x", page_size=0)])


# -- the V4 stack ---------------------------------------------------------------


def test_v4_stack_from_the_config() -> None:
    stack = deepseek_v4_stack(v4_config(), page_size=256, dtype=BF16)
    assert stack.names == ("tok", "c4", "c4_indexer", "c128", "swa", "c4_state", "c4_buffer", "c128_buffer")
    assert stack["tok"].kind == "logical" and stack["tok"].page_size == 256
    assert stack["c4"].page_size == stack["c4_indexer"].page_size == 64 and stack["c128"].page_size == 2
    assert stack["c4"].layer_map == (None, 0, None, 1)
    assert stack["c128"].layer_map == stack["c128_buffer"].layer_map == (0, None, None, None)
    assert stack["swa"].layer_map == (0, 1, 2, 3) and stack["swa"].page_size == 128
    assert stack["c4"].planes == (PlaneSpec((64,), BF16),) and stack["c4_indexer"].planes == (PlaneSpec((32,), BF16),)
    # Overlaps hold rate rows; overlap gates are float32. Buffers: a row per token, a page of rate - 1.
    assert [p.shape for p in stack["c4_state"].planes] == [(4, 64), (4, 64), (4, 32), (4, 32)]
    assert stack["c4_state"].planes[1].dtype == F32 and stack["c4_state"].planes[0].dtype == BF16
    assert [p.shape for p in stack["c4_buffer"].planes] == [(128,), (128,), (64,), (64,)]
    assert stack["c4_buffer"].page_size == 3 and stack["c4_buffer"].planes[1].dtype == BF16


def test_a_sidecars_page_size_reads_as_rows_per_anchor_page() -> None:
    """At rates 8 / 32 and page 64 the role-named c4 holds 8 rate-8 entries per
    anchor page: rows_per_page and the plan's string say rows, not tokens."""
    rates = {"compressed_sparse_attention": 8, "heavily_compressed_attention": 32}
    stack = deepseek_v4_stack(v4_config(compress_rates=rates, sliding_window=16), page_size=64)
    assert stack["c4"].rows_per_page == stack["c4"].page_size == 8 and stack["c128"].rows_per_page == 2
    assert (stack["tok"].rows_per_page, stack["swa"].rows_per_page) == (0, 16)
    assert str(stack["c4"]) == "c4: sidecar of tok, 8 rows per tok page, 2 of 4 layers, planes [(64,) float32]"
    assert str(stack["tok"]) == "tok: logical, pages of 64 slots, no bytes"
    assert str(stack["c4_state"]).startswith("c4_state: pool, pages of 1 slot, 2 of 4 layers, planes [(8, 64) float32")
    assert str(stack["c4_buffer"]).startswith("c4_buffer: pool, pages of 7 slots, 2 of 4 layers, planes [(128,) float32")
    assert repr(stack).startswith("<DeepseekV4Stack CSA rate 8, HCA rate 32 [tok:logical page 64; c4:sidecar<-tok 8 rows/page;")
    # A page's bytes count each pool's rows per page: 8 + 8 + 2 sidecar rows, no bytes of tok's own.
    row = {n: stack[n].slot_nbytes for n in ("c4", "c4_indexer", "c128")}
    assert stack.page_nbytes("tok") == 8 * row["c4"] + 8 * row["c4_indexer"] + 2 * row["c128"]


def test_v4_default_page_is_the_largest_rate_in_use() -> None:
    assert deepseek_v4_stack(v4_config()).page_size == 128
    csa_only = deepseek_v4_stack(v4_config(layer_types=["compressed_sparse_attention", "sliding_attention"]))
    assert csa_only.page_size == 4 and repr(csa_only).startswith("<DeepseekV4Stack CSA rate 4 [")
    sliding = deepseek_v4_stack(v4_config(layer_types=["sliding_attention"]))
    assert sliding.page_size == 1 and sliding.names == ("tok", "swa")


def test_v4_sequence_sizes_follow_from_the_token_count() -> None:
    stack = deepseek_v4_stack(v4_config(), page_size=128, window_page_size=32)
    n = stack.lengths(300)
    assert (n.window_tokens, n.c4_entries, n.c4_buffered, n.c128_entries, n.c128_buffered) == (127, 75, 0, 2, 44)
    # 3 anchor pages; the window in 4 pages of 32 rows; one state slot; 44 buffered HCA tokens in 3 pages of 16.
    assert stack.slots_needed(300) == {"tok": 384, "swa": 128, "c4_state": 1, "c128_buffer": 48}
    assert "c128_buffer" not in stack.slots_needed(256)  # nothing buffered: no page moves
    assert stack.slots_needed(302) == {"tok": 384, "swa": 128, "c4_state": 1, "c4_buffer": 3, "c128_buffer": 48}
    assert stack.slots_needed(3) == {"tok": 128, "swa": 32, "c4_buffer": 3, "c128_buffer": 16}  # no entry, no overlap
    # What holds data of those: entries of partial anchor pages, the window, the buffers.
    assert stack.valid_rows(302) == {"c4": 75, "c4_indexer": 75, "c128": 2, "swa": 127, "c4_buffer": 2,
                                     "c128_buffer": 46}
    # At 3 tokens the sidecar pages hold no entry (0 rows move); the CSA buffer page is full.
    assert stack.valid_rows(3) == {"c4": 0, "c4_indexer": 0, "c128": 0, "swa": 3, "c128_buffer": 3}


def test_v4_without_hca_layers_has_no_hca_pools() -> None:
    stack = deepseek_v4_stack(v4_config(layer_types=["compressed_sparse_attention", "sliding_attention"]))
    assert stack.names == ("tok", "c4", "c4_indexer", "swa", "c4_state", "c4_buffer")
    assert stack.page_size == 4  # the largest rate in use
    with pytest.raises(ConfigurationError, match="this V4 config has no 'c128' pool"):
        stack.pool("c128")


def test_v4_roles_rename_pools_and_the_old_spellings_are_refused_naming_the_new() -> None:
    stack = deepseek_v4_stack(v4_config(), roles={"anchor": "tokens", "window": "window"})
    assert stack.names[0] == "tokens" and "window" in stack.names and "swa" not in stack.names
    assert stack.roles["anchor"] == "tokens" and stack.pool("window") == "window"
    with pytest.raises(ConfigurationError, match=r"unknown V4 pool role 'kv'; roles are \['anchor', "):
        deepseek_v4_stack(v4_config(), roles={"kv": "x"})
    # `names` is the tuple of pool names, as on every PoolStack and PoolGroup; the mapping is `roles`.
    with pytest.raises(TypeError, match=r"deepseek_v4_stack\(\) no longer takes names=; use roles="):
        deepseek_v4_stack(v4_config(), names={"anchor": "tokens"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"deepseek_v4_stack\(\) got an unexpected keyword argument 'page'"):
        deepseek_v4_stack(v4_config(), page=16)  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match=r"DeepseekV4Stack.role is gone; use stack.roles.get\(role\)"):
        stack.role("c4")  # type: ignore[attr-defined]
    assert not hasattr(stack, "role") and not hasattr(stack, "no_such_thing")


@pytest.mark.parametrize(
    ("over", "kwargs", "match"),
    [
        ({}, {"page_size": 192}, "page_size 192 must be a multiple of every compress rate.*heavily_compressed_attention rate is 128"),
        ({}, {"page_size": 0}, "page_size must be a positive int; got 0"),
        ({}, {"window_page_size": -1}, "window_page_size must be a positive int; got -1"),
        ({"layer_types": ["full_attention"]}, {}, r"layer_types holds \['full_attention'\]"),
        ({"num_key_value_heads": 8}, {}, "num_key_value_heads=8"),
        ({"sliding_window": 1}, {}, "sliding_window must be >= 2"),
        ({"compress_rates": {"compressed_sparse_attention": 4}}, {},
         "compress_rates\\['heavily_compressed_attention'\\] must be a positive int; got None"),
    ],
)
def test_v4_bad_configs_are_refused(over: dict[str, Any], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        deepseek_v4_stack(v4_config(**over), **kwargs)


def test_v4_preset_registers_a_group_sized_by_ratio() -> None:
    group = PoolGroup()
    stack, sizes = deepseek_v4(v4_config(), group, tokens=128 * 16, requests=4, host_ratio=2)
    assert set(group.names) == set(stack.names)
    assert sizes.device_pages == {"tok": 16, "swa": 4, "c4_state": 4, "c4_buffer": 4, "c128_buffer": 32}
    assert sizes.host_pages == {name: 2 * n for name, n in sizes.device_pages.items()}
    assert group["c128"].host.slots == 32 * 1 and group["c4"].host.slots == 32 * 32
    rows = {r["pool"]: r for r in stack.describe(group)}
    assert rows["tok"]["host_bytes"] == 0 and rows["c4"]["host_bytes"] == group["c4"].host.nbytes
    assert (rows["c4"]["rows_per_page"], rows["tok"]["rows_per_page"], rows["swa"]["rows_per_page"]) == (32, 0, 128)


def test_v4_preset_takes_what_planning_and_register_take() -> None:
    """One call, deepseek_v4, for deepseek_v4_stack + stack.register: every
    keyword either takes is one deepseek_v4 takes, with the same default."""
    import inspect

    from kvtier.presets import DeepseekV4Stack

    preset = inspect.signature(deepseek_v4).parameters
    for func, skip in ((deepseek_v4_stack, {"config", "retired"}), (DeepseekV4Stack.register, {"self", "group", "retired"})):
        for name, param in inspect.signature(func).parameters.items():
            if name in skip:
                continue
            assert name in preset, f"deepseek_v4 does not take {func.__qualname__}'s {name}="
            assert preset[name].default == param.default, name
            assert preset[name].kind is inspect.Parameter.KEYWORD_ONLY, name


def test_v4_preset_registers_with_an_engines_anchor_allocator_and_renamed_roles() -> None:
    tokens = PageAllocator(128 * 8, 128, name="tokens")
    group = PoolGroup()
    stack, sizes = deepseek_v4(v4_config(), group, allocators={"tokens": tokens}, roles={"anchor": "tokens"},
                               device_pages={"tokens": 8, "swa": 2, "c4_state": 2, "c4_buffer": 2, "c128_buffer": 16}, host_ratio=1)
    assert group["tokens"].device_allocator is tokens and stack.pool("anchor") == "tokens"
    assert sizes.device_pages["tokens"] == 8 and group["c4"].device_slots == 8 * 32
    with pytest.raises(ConfigurationError, match=r"allocators names pool 'tok', which this stack cannot take there"):
        deepseek_v4(v4_config(), PoolGroup(), allocators={"tok": tokens}, roles={"anchor": "tokens"},
                    device_pages={"tokens": 8, "swa": 2, "c4_state": 2, "c4_buffer": 2, "c128_buffer": 16}, host_ratio=1)
    with pytest.raises(TypeError, match=r"deepseek_v4\(\) no longer takes names=; use roles="):
        deepseek_v4(v4_config(), PoolGroup(), names={"anchor": "tokens"}, host_ratio=1)  # type: ignore[arg-type]


def test_presets_all_names_what_it_exports() -> None:
    import kvtier.presets as presets

    assert sorted(presets.__all__) == sorted(
        n for n, v in vars(presets).items()
        if not n.startswith("_") and getattr(v, "__module__", "").startswith("kvtier.presets")
    )
    # The presets never import transformers: they read a config's attributes.
    code = "import sys; sys.modules['transformers'] = None; import kvtier.presets as p; print(p.deepseek_v4_stack)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr


def test_v4_stack_takes_an_engines_sidecar_tensors_and_anchor_allocator() -> None:
    stack = deepseek_v4_stack(v4_config(), page_size=128)
    plan = stack["c4"]
    tokens_alloc = PageAllocator(128 * 8, 128, name="tok")
    c4_layers = [[torch.zeros(8 * 32, 64)] for _ in range(plan.num_layers)]  # 8 anchor pages x 32 rows
    group = PoolGroup()
    sizes = stack.register(
        group, devices={"c4": DevicePool(c4_layers, plan.layer_map)}, allocators={"tok": tokens_alloc},
        device_pages={"tok": 8, "swa": 2, "c4_state": 2, "c4_buffer": 2, "c128_buffer": 16}, host_ratio=1,
    )
    assert group["tok"].device_allocator is tokens_alloc
    assert group["c4"].device is not None and group["c4"].device.tensor(1, 0) is c4_layers[1][0]
    assert sizes.host_pages["tok"] == 8
    short = [[torch.zeros(8 * 32 - 1, 64)] for _ in range(plan.num_layers)]
    with pytest.raises(ConfigurationError, match="sidecar 'c4' needs 256 device rows to cover 'tok'"):
        stack.register(PoolGroup(), devices={"c4": DevicePool(short, plan.layer_map)},
                       device_pages={"tok": 8, "swa": 2, "c4_state": 2, "c4_buffer": 2, "c128_buffer": 16}, host_ratio=1)


# -- registration is all or nothing under allocation failure ------------------


def test_register_that_fails_to_allocate_a_later_pool_registers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second byte pool's host allocation fails: the first pool (already
    registered) goes again, its pinned registration released, and the error
    is a ConfigurationError naming the pool and the bytes asked for. The same
    stack then registers in the same group."""
    import kvtier.pools.group as group_module

    stack = kv_stack()
    real = group_module.HostPool
    calls: list[str] = []

    def failing(name: str, **kwargs: Any) -> Any:
        calls.append(name)
        if name == "c4":
            raise MemoryError()
        return real(name, **kwargs)

    group = PoolGroup()
    monkeypatch.setattr(group_module, "HostPool", failing)
    with pytest.raises(ConfigurationError, match=r"pool 'c4': could not allocate 16384 bytes of host memory "
                                                 r"\(512 host rows\): MemoryError; size the host tier smaller") as err:
        stack.register(group, device_pages={"kv": 64}, host_ratio=2)
    assert isinstance(err.value.__cause__, MemoryError)
    assert calls == ["kv", "c4"] and group.names == ()  # kv was registered, and went again
    monkeypatch.setattr(group_module, "HostPool", real)
    sizes = stack.register(group, device_pages={"kv": 64}, host_ratio=2)
    assert group.names == ("kv", "c4") and sizes.host_pages == {"kv": 128}


def test_v4_with_a_host_tier_too_large_to_allocate_says_which_pool_and_how_many_bytes() -> None:
    group = PoolGroup()
    with pytest.raises(ConfigurationError, match=r"pool 'tok': could not allocate \d+ bytes of host memory "
                                                 r"\(the allocator of \d+ host pages") as err:
        deepseek_v4(v4_config(), group, tokens=128 * 16, requests=4, host_ratio=1e12)
    assert isinstance(err.value.__cause__, MemoryError)
    assert group.names == ()


def test_remove_pool_is_the_undo_of_registration() -> None:
    group = PoolGroup()
    kv_stack().register(group, device_pages={"kv": 4}, host_ratio=1)
    with pytest.raises(ConfigurationError, match=r"pool 'kv' still has sidecars \['c4'\]; remove them first"):
        group.remove_pool("kv")
    group.remove_pool("c4")
    assert group.sidecars_of("kv") == ()
    group.remove_pool("kv")
    assert group.names == ()
    with pytest.raises(ConfigurationError, match=r"pool 'kv' is not registered"):
        group.remove_pool("kv")
    kv_stack().register(group, device_pages={"kv": 4}, host_ratio=1)
    group.freeze()
    with pytest.raises(ConfigurationError, match=r"cannot remove pool 'c4': the group is in use by a scheduler"):
        group.remove_pool("c4")


# -- docs/deepseek_v4.md's examples ---------------------------------------------

PRINTS = re.compile(r"<!-- prints: (.*) -->\n")


def test_the_v4_docs_programs_run_and_print_what_they_say() -> None:
    """Every ```python block of docs/deepseek_v4.md is a program that runs (in
    a namespace of its own) and prints each ``<!-- prints: ... -->`` line after its
    fence as a whole line, or starts with a ``# Fragment`` line and parses, as
    tests/test_readme.py holds README's."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "deepseek_v4.md").read_text()
    programs = checked = 0
    for m in re.finditer(r"^```python\n(.*?)^```\n", text, re.S | re.M):
        code = m[1]
        if code.startswith("# Fragment"):  # a visible first line, as tests/test_readme.py reads it
            ast.parse(code)
            continue
        want, end = [], m.end()
        while said := PRINTS.match(text, end):
            want.append(said[1])
            end = said.end()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"docs/deepseek_v4.md:{text.count(chr(10), 0, m.start()) + 2}", "exec"), {})
        lines = printed.getvalue().splitlines()
        for line in want:
            assert line in lines, f"{line!r} not printed; got {lines}"
        programs += 1
        checked += len(want)
    assert programs >= 1 and checked >= 3
