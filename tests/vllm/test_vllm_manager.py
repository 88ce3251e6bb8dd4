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


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"verify": True}, "kvtier option 'verify' is at the top level of kv_connector_extra_config"),
        ({"store_path": "/x"}, "put it under the 'kvtier' key: {'kvtier': {'store_path': ...}}"),
        ({"host_block": 8}, "'host_block' \\(kvtier option 'host_blocks'\\?\\) is at the top level"),
        ({"redis_uri": "redis://x"}, "'redis_uri' \\(kvtier option 'redis_url'\\?\\)"),
    ],
)
def test_kvtier_options_at_the_top_level_are_refused_saying_where_they_go(
    extra: dict[str, object], message: str
) -> None:
    from kvtier.integrations.vllm import parse_options

    with pytest.raises(ConfigurationError, match=message):
        parse_options({"cpu_bytes_to_use": 1 << 20, **extra})
    # vLLM's own keys at the top level are vLLM's, even when close to a kvtier option's name.
    from kvtier.integrations.vllm.options import VLLM_KEYS

    assert parse_options({k: 1 for k in VLLM_KEYS}).verify is False


def _unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_a_store_that_cannot_take_a_probe_page_is_refused_naming_the_option(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os

    from kvtier.integrations.vllm import parse_options
    from kvtier.integrations.vllm.loop import PROBE_KEY, probe_store

    regular = tmp_path / "a-file"
    regular.write_text("not a directory")
    bad = {
        "store_path": ["/proc/kvtier-store", str(regular / "store")],
        "redis_url": [f"redis://127.0.0.1:{_unused_port()}/0"],  # nothing listens there
    }
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        bad["store_path"].append(str(locked / "store"))
    for name, values in bad.items():
        for value in values:
            with pytest.raises(ConfigurationError, match=f"kvtier option '{name}'='{value}' names a store kvtier "
                                                         "cannot use: writing and reading back a probe page failed"):
                probe_store(parse_options({"kvtier": {name: value}}), timeout_s=5)
    good = tmp_path / "good"
    probe_store(parse_options({"kvtier": {"store_path": str(good)}}))
    probe_store(parse_options({"kvtier": {"store_path": str(good)}}))  # again, as a second engine would
    assert [p.name for p in good.rglob("*.commit")] == [f"{PROBE_KEY.hex()}.commit"]
    probe_store(parse_options({}))  # no store: nothing to probe


def test_a_worker_connector_that_failed_after_vllm_kept_it_is_released() -> None:
    from vllm.distributed.kv_transfer import kv_transfer_state

    from kvtier.integrations.vllm.connector import release_vllm_connector

    class Agent:
        def __init__(self, spec: object) -> None:
            self.connector_worker = type("W", (), {"spec": spec})()
            self.closed = False

        def shutdown(self) -> None:
            self.closed = True

    spec, other = object(), object()
    assert not kv_transfer_state.has_kv_transfer_group()
    try:
        kv_transfer_state._KV_CONNECTOR_AGENT = agent = Agent(other)  # type: ignore[assignment]
        release_vllm_connector(spec)  # type: ignore[arg-type]
        assert kv_transfer_state.get_kv_transfer_group() is agent  # another spec's connector: left alone
        kv_transfer_state._KV_CONNECTOR_AGENT = agent = Agent(spec)  # type: ignore[assignment]
        release_vllm_connector(spec)  # type: ignore[arg-type]
        assert not kv_transfer_state.has_kv_transfer_group() and agent.closed
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
