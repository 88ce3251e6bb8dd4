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
        ({"kvtier": {"store_path": "/a", "store_max_bytes": "200 parsecs"}}, "store_max_bytes"),
        ({"kvtier": {"store_max_bytes": "200GiB"}}, "store_max_bytes"),
    ],
)
def test_bad_options_raise_naming_the_option(extra: dict[str, object], named: str) -> None:
    from kvtier.integrations.vllm import parse_options

    with pytest.raises(ConfigurationError, match=f"'{named}'"):
        parse_options(extra)


def test_store_max_bytes_bounds_the_file_store(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvtier.integrations.vllm import parse_options
    from kvtier.integrations.vllm.loop import open_store

    options = parse_options({"kvtier": {"store_path": str(tmp_path), "store_max_bytes": "2GiB"}})
    assert options.store_max_bytes == 2 << 30
    store = open_store(options)
    assert store is not None and store.max_bytes == 2 << 30  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "kvtier.host_bytes"),
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
            # A path under a regular file is refused when the store is made, before any probe.
            why = "FileStore directory .* is a file" if value.startswith(str(regular)) else \
                "writing and reading back a probe page failed"
            with pytest.raises(ConfigurationError, match=f"kvtier option '{name}'='{value}' names a store kvtier "
                                                         f"cannot use: {why}"):
                probe_store(parse_options({"kvtier": {name: value}}), timeout_s=5)
    good = tmp_path / "good"
    probe_store(parse_options({"kvtier": {"store_path": str(good)}}))
    probe_store(parse_options({"kvtier": {"store_path": str(good)}}))  # again, as a second engine would
    assert [p.name for p in good.rglob("*.data")] == [f"{PROBE_KEY.hex()}.data"]  # FileStore: one file a page
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


# -- tensor / pipeline parallel: one shard per worker -------------------------------------


def keys_of(world=None):  # type: ignore[no-untyped-def]
    from kvtier.integrations.vllm.loop import StorageKeys

    return StorageKeys(model="m|float32", block_size=32, dtype="float32", num_layers=2, block_bytes=32768, world=world)


def test_one_workers_keys_are_what_they_always_were_and_each_rank_has_its_own_otherwise() -> None:
    from kvtier.integrations.vllm.loop import ShardGeometry

    block = b"\x01" * 32 + b"\0\0\0\0"
    one = keys_of()
    # The key kvtier wrote before shards existed (computed with the code of that time):
    # stores written by a one-worker engine stay readable.
    assert one(block).hex() == "fc9de8d58601c20196351a363f1abd562d2ba6ebecb2f11844494861d34f393f"
    assert one.shards(one(block)) == [one(block)] and one.shard(one(block), 0) == one(block)
    tp2 = keys_of(ShardGeometry(world_size=2, tp_size=2))
    shards = tp2.shards(tp2(block))
    assert len(set(shards)) == 2 and tp2(block) not in shards and one(block) not in shards
    assert shards == [tp2.shard(tp2(block), 0), tp2.shard(tp2(block), 1)]
    assert keys_of(ShardGeometry(world_size=2, tp_size=2)).shards(tp2(block)) == shards  # another process agrees
    # Another cut of the same block (two pipeline stages) is another shard.
    pp2 = keys_of(ShardGeometry(world_size=2, pp_size=2))
    assert not set(pp2.shards(tp2(block))) & set(shards)
    with pytest.raises(ValueError, match="rank 2 is not a worker"):
        tp2.shard(tp2(block), 2)
    with pytest.raises(ValueError, match="rank 1 is not a worker"):
        one.shard(one(block), 1)
    with pytest.raises(ValueError, match="world_size=3 is not a multiple of tp_size x pp_size = 2"):
        ShardGeometry(world_size=3, tp_size=2)
    with pytest.raises(ValueError, match="tp_size must be an int >= 1; got 0"):
        ShardGeometry(tp_size=0)


def test_a_block_is_a_store_hit_only_when_every_ranks_shard_is_stored() -> None:
    from vllm.v1.kv_offload.base import LookupResult

    from kvtier.integrations.vllm.loop import ShardGeometry
    from kvtier.integrations.vllm.manager import KvtierOffloadingManager, StoreLookup

    keys = keys_of(ShardGeometry(world_size=2, tp_size=2))
    stored: set[bytes] = set()
    asked: list[list[bytes]] = []

    def exists(ks: list[bytes]) -> list[bool]:
        asked.append(list(ks))
        return [k in stored for k in ks]

    # Rank 0 stored blocks 0-3, rank 1 only blocks 0-1 (its write-through of 2-3 is late or lost).
    for i in range(4):
        stored.add(keys.shard(keys(key(i)), 0))
    for i in range(2):
        stored.add(keys.shard(keys(key(i)), 1))
    lookup = StoreLookup(exists, keys, shards=keys.shards)
    m = KvtierOffloadingManager(4, store=lookup)
    hits = [m.lookup(key(i), ctx()) is LookupResult.HIT for i in range(4)]
    assert hits == [True, True, False, False]  # the shortest prefix any rank holds
    assert asked[0] == keys.shards(keys(key(0)))  # one question per block, every rank's key in it
    assert lookup.shard_keys(key(3)) == keys.shards(keys(key(3)))
    # The load names the block's key; each worker derives its own shard's (worker.py).
    spec = m.prepare_load([key(0), key(1)], ctx())
    assert spec.storage_keys == [keys(key(0)), keys(key(1))]
    # Once rank 1's shard lands, the block is a hit.
    stored.add(keys.shard(keys(key(2)), 1))
    assert m.lookup(key(2), ctx()) is LookupResult.HIT
    # A store that answers with too few answers, or fails, is a miss.
    short = StoreLookup(lambda ks: [True], keys, shards=keys.shards)
    assert not short.contains(key(0))
    broken = StoreLookup(lambda ks: 1 / 0, keys, shards=keys.shards)
    assert not broken.contains(key(0)) and broken.errors == 1


def test_a_block_one_worker_failed_to_load_is_refused_once_whichever_worker_and_step_reported_it() -> None:
    from kvtier.integrations.vllm.connector import LoadJobs

    jobs = LoadJobs(2)
    jobs.add(7, {10: key(0), 11: key(1), 12: key(2)})
    jobs.add(8, {20: key(5)})
    # Step 1: rank 0 finished job 7 with every block loaded; job 8 on both ranks, clean.
    assert jobs.report({7: 1, 8: 2}, set()) == []
    assert len(jobs) == 1  # job 7 waits for rank 1
    # Step 2: rank 1 finished job 7 and failed block 11 (and so 12 after it).
    assert jobs.report({7: 1}, {11, 12}) == [key(1), key(2)]
    assert len(jobs) == 0
    # Both ranks failing the same block in one step name it once.
    jobs.add(9, {30: key(6)})
    assert jobs.report({9: 2}, {30}) == [key(6)]
    # A store job's completion (not a load kvtier tracks) is ignored.
    assert jobs.report({99: 2}, {30}) == []
    with pytest.raises(ValueError, match="num_workers must be an int >= 1; got 0"):
        LoadJobs(0)


def offloading_config(  # type: ignore[no-untyped-def]
    tmp: str | None = None, *, rank: int = 0, tp: int = 1, pp: int = 1, pcp: int = 1, dcp: int = 1,
    groups: tuple[tuple[str, ...], ...] = (("l0", "l1"),), block_bytes: int = 32768, extra=None,
):
    """vLLM's `OffloadingConfig` as its connector builds it: one group of
    ``groups``' layer names per group id, kvtier's ``extra`` (by default 4 host
    blocks and a FileStore at ``tmp``), the parallel geometry."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(tokens_per_block=32, layer_names=names, group_id=g)
                     for g, names in enumerate(groups)),
        worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=False, engine_id="e",
        extra_config={"kvtier": {"host_blocks": 4, "store_path": tmp}} if extra is None else extra,
        model=OffloadingModelConfig(name="m", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=tp * pp * pcp, tp_size=tp, pp_size=pp, pcp_size=pcp, dcp_size=dcp,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False,
        ),
    )


def test_the_spec_takes_a_store_with_tensor_and_pipeline_parallel_workers_and_refuses_context_parallel(
    tmp_path, monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    from kvtier.integrations.vllm import KvtierOffloadingSpec
    from kvtier.integrations.vllm import connector

    # A store needs KvtierConnector, which marks the specs it builds; here the test builds them.
    monkeypatch.setattr(connector._building, "active", True, raising=False)
    one = KvtierOffloadingSpec(offloading_config(str(tmp_path)))
    block = one.storage_keys(key(1))
    assert one.storage_keys.shards(block) == [block]
    specs = [KvtierOffloadingSpec(offloading_config(str(tmp_path), rank=r, tp=2, pp=2)) for r in range(4)]
    assert [s.rank for s in specs] == [0, 1, 2, 3]
    base = specs[0].storage_keys(key(1))
    # Every worker names a block as the scheduler side does, and its shard as the scheduler's lookup asks for it.
    assert all(s.storage_keys(key(1)) == base for s in specs)
    assert [s.storage_keys.shard(base, s.rank) for s in specs] == specs[0].storage_keys.shards(base)
    assert len(set(specs[0].storage_keys.shards(base))) == 4
    for cp in ({"pcp": 2}, {"dcp": 2}):
        with pytest.raises(ConfigurationError, match="'store_path' works with tensor and pipeline parallel workers, "
                           "not context parallel ones"):
            KvtierOffloadingSpec(offloading_config(str(tmp_path), tp=2, **cp))


def test_more_than_one_vllm_block_per_host_block_is_refused_naming_the_option(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from kvtier.integrations.vllm import KvtierOffloadingSpec

    config = offloading_config(str(tmp_path))
    config = dataclasses.replace(
        config, extra_config={"kvtier": {"host_blocks": 4}},
        cache=dataclasses.replace(config.cache, tokens_per_hash=32, blocks_per_chunk=2),
    )
    with pytest.raises(ConfigurationError, match="kvtier moves one vLLM block per host block; got blocks_per_chunk=2"):
        KvtierOffloadingSpec(config)


def test_a_request_whose_load_failed_stores_its_recomputed_blocks_again_from_the_first_failed_one() -> None:
    # vLLM moves a request's store position past the blocks it loads; a failed
    # block, recomputed, must be stored again (else the damaged copy stays).
    from types import SimpleNamespace

    from kvtier.integrations.vllm.connector import store_again

    keys = [key(i) for i in range(5)]
    group = SimpleNamespace(offload_keys=list(keys), next_stored_chunk_idx=5)
    stored_ahead = SimpleNamespace(offload_keys=list(keys), next_stored_chunk_idx=1)  # not past the failure
    other = SimpleNamespace(offload_keys=[key(9)], next_stored_chunk_idx=1)
    scheduler = SimpleNamespace(_req_status={
        "a": SimpleNamespace(group_states=(group, stored_ahead)),
        "b": SimpleNamespace(group_states=(other,)),
    })
    assert store_again(scheduler, {"a", "b", "gone"}, {keys[3], keys[2]}) == 1
    assert group.next_stored_chunk_idx == 2  # from block 2, the first failed one
    assert stored_ahead.next_stored_chunk_idx == 1 and other.next_stored_chunk_idx == 1
    assert store_again(SimpleNamespace(), {"a"}, {keys[2]}) == 0  # another scheduler layout: nothing moves
