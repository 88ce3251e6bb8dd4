"""The scheduler side and the options, without an engine: plain objects."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigurationError

pytestmark = pytest.mark.vllm


def ctx():  # type: ignore[no-untyped-def]
    from vllm.v1.kv_offload.base import ReqContext

    return ReqContext(req_id="r")


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def stored(manager, *ids: int) -> list[int]:  # type: ignore[no-untyped-def]
    out = manager.prepare_store([key(i) for i in ids], ctx())
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx())
    return out.store_spec.host_block_ids.tolist()


def test_the_manager_names_distinct_host_blocks_and_evicts_the_least_recently_used_idle_one() -> None:
    from vllm.v1.kv_offload.base import LookupResult

    from kvtier.integrations.vllm import KvtierOffloadingManager

    m = KvtierOffloadingManager(3)
    assert sorted(stored(m, 1, 2, 3)) == [0, 1, 2]
    assert m.lookup(key(1), ctx()) is LookupResult.HIT
    m.touch([key(1)], ctx())  # 2 is now the oldest
    load = m.prepare_load([key(3)], ctx())  # 3 is being read: not evictable
    out = m.prepare_store([key(4)], ctx())
    assert out is not None and out.evicted_keys == [key(2)]
    assert m.lookup(key(2), ctx()) is LookupResult.MISS
    assert m.lookup(key(4), ctx()) is LookupResult.HIT  # storing: the load would wait for the store
    # Full of blocks that are read or being stored: a further store is refused, nothing evicted.
    m.touch([key(1)], ctx())
    m.prepare_load([key(1)], ctx())
    assert m.prepare_store([key(5)], ctx()) is None
    m.complete_load([key(3)], ctx())
    assert load.offload_keys == [key(3)]


def test_a_refused_block_is_dropped_and_its_host_block_waits_for_its_readers() -> None:
    from vllm.v1.kv_offload.base import LookupResult

    from kvtier.integrations.vllm import KvtierOffloadingManager

    m = KvtierOffloadingManager(1)
    (host,) = stored(m, 1)
    m.prepare_load([key(1)], ctx())
    m.refuse([key(1)])
    assert m.lookup(key(1), ctx()) is LookupResult.MISS
    assert m.prepare_store([key(2)], ctx()) is None  # the one host block is still read
    m.complete_load([key(1)], ctx())
    assert stored(m, 2) == [host]


def test_store_hits_are_offered_without_a_host_block_and_not_again_once_refused() -> None:
    from vllm.v1.kv_offload.base import LookupResult

    from kvtier.integrations.vllm.manager import KvtierOffloadingManager, StoreLookup

    in_store = {key(7)}
    lookup = StoreLookup(lambda keys: [k in {b"s" + x for x in in_store} for k in keys], lambda k: b"s" + k)
    m = KvtierOffloadingManager(2, store=lookup)
    assert m.lookup(key(7), ctx()) is LookupResult.HIT
    assert m.lookup(key(8), ctx()) is LookupResult.MISS
    spec = m.prepare_load([key(7)], ctx())
    assert spec.host_block_ids.tolist() == [-1] and spec.storage_keys == [b"s" + key(7)]
    m.complete_load([key(7)], ctx())
    m.refuse([key(7)])
    assert m.lookup(key(7), ctx()) is LookupResult.MISS


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"kvtier": {"verfy": True}}, "verfy"),
        ({"kvtier": {"host_blocks": 0}}, "host_blocks"),
        ({"kvtier": {"verify": "yes"}}, "verify"),
        ({"kvtier": {"store_path": "/a", "redis_url": "redis://x"}}, "store_path"),
        ({"kvtier": {"redis_url": "http://x"}}, "redis_url"),
        ({"kvtier": "verify"}, "kvtier"),
    ],
)
def test_bad_options_raise_naming_the_option(extra: dict[str, object], named: str) -> None:
    from kvtier.integrations.vllm import parse_options

    with pytest.raises(ConfigurationError, match=f"'{named}'"):
        parse_options(extra)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1000}, "'cpu_bytes_to_use'=1000 holds no vLLM block of 4096 bytes"),
        ({"cpu_bytes_to_use": 1 << 62}, "'cpu_bytes_to_use' asks for"),
        ({"kvtier": {"host_blocks": 1 << 50}}, "'kvtier.host_blocks' asks for"),
    ],
)
def test_host_sizes_that_cannot_work_raise_naming_the_option(extra: dict[str, object], message: str) -> None:
    from kvtier.integrations.vllm.options import host_blocks, parse_options

    with pytest.raises(ConfigurationError, match=message):
        host_blocks(parse_options(extra), extra, 4096)
    assert host_blocks(parse_options({"cpu_bytes_to_use": 10 * 4096 + 1}), {"cpu_bytes_to_use": 10 * 4096 + 1}, 4096) == 10
