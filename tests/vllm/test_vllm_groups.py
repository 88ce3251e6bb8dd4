"""Several KV cache groups (hybrid models), without an engine: the group check,
the device pool over the groups' tensors, storage keys per group, and a
worker round trip of two groups' blocks."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from kvtier.errors import ConfigurationError

pytestmark = pytest.mark.vllm

BLOCK_HASH = bytes(range(32))


def offload_key(block_hash: bytes, group: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return bytes(make_offload_key(block_hash, group))


def info(gid: int, kind: str) -> Any:
    from kvtier.integrations.vllm.groups import GroupInfo

    return GroupInfo(gid, kind, f"model.layers.{gid}.self_attn.attn", 2)


def test_a_hybrid_model_of_full_and_sliding_window_groups_passes_and_one_group_of_any_kind_too() -> None:
    from kvtier.integrations.vllm.groups import check_groups

    check_groups([info(0, "SlidingWindowSpec"), info(1, "FullAttentionSpec")])
    check_groups([info(0, "MambaSpec")])  # one group: taken as it is, as before hybrid support
    check_groups([])


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("MambaSpec", "its recurrent state reaches the offloading spec through vLLM's copy-on-write boundary"),
        ("ChunkedLocalAttentionSpec", "no model that vLLM's CPU build runs here has chunked local attention"),
        ("CrossAttentionSpec", "kvtier has no test of this kind of group inside vLLM"),
    ],
)
def test_a_hybrid_model_with_another_kind_of_group_is_refused_naming_the_group_and_what_is_missing(
    kind: str, why: str
) -> None:
    from kvtier.integrations.vllm.groups import check_groups

    with pytest.raises(ConfigurationError) as exc:
        check_groups([info(0, "FullAttentionSpec"), info(3, kind)])
    assert str(exc.value).startswith(
        "kvtier moves a hybrid model's KV cache groups when each is FullAttentionSpec or SlidingWindowSpec; "
        f"group 3 (layer 'model.layers.3.self_attn.attn', 2 layers) is {kind}: {why}"
    ), str(exc.value)


def test_group_infos_reads_vllm_s_kv_cache_config_in_the_offloading_connector_s_order() -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from kvtier.integrations.vllm.groups import GroupInfo, group_infos

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64)
    config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l2"], swa), KVCacheGroupSpec(["l1", "l3"], full)],
    )
    assert group_infos(config) == (GroupInfo(0, "SlidingWindowSpec", "l0", 2), GroupInfo(1, "FullAttentionSpec", "l1", 2))


def canonical(tensors: list[torch.Tensor], groups: list[list[int]]) -> Any:
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, tensors[i].shape[1]) for i in ids] for ids in groups],
    )


def test_the_device_pool_spans_the_union_of_the_groups_tensors_and_refuses_unequal_block_counts() -> None:
    from kvtier.integrations.vllm.worker import device_pool

    a, b, c = (torch.zeros(6, 64, dtype=torch.int8) for _ in range(3))
    # vLLM's hybrid allocator: groups overlay the same tensors (Gemma-2), or a
    # group with fewer layers overlays a prefix of them.
    pool = device_pool(canonical([a, b, c], [[0, 1, 2], [0, 1]]))
    assert pool.num_layers == 3 and pool.slots == 6
    assert device_pool(canonical([a, b], [[0], [1]])).num_layers == 2
    with pytest.raises(ConfigurationError, match=r"the same number of blocks; vLLM's hold \[4, 6\]"):
        device_pool(canonical([a, torch.zeros(4, 64, dtype=torch.int8)], [[0], [1]]))
    with pytest.raises(ConfigurationError, match="vLLM registered no KV cache tensors"):
        device_pool(canonical([a], [[], []]))


def test_a_worker_refuses_groups_whose_union_block_is_not_the_block_vllm_sized_the_host_tier_by() -> None:
    from kvtier.integrations.vllm.options import parse_options
    from kvtier.integrations.vllm.worker import KvtierOffloadingWorker

    a, b = (torch.zeros(6, 64, dtype=torch.int8) for _ in range(2))
    with pytest.raises(ConfigurationError, match="one block of 128 bytes over their tensors; vLLM sizes a block at 64"):
        KvtierOffloadingWorker(canonical([a, b], [[0], [1]]), host_blocks=2, options=parse_options({}),
                               staging_blocks=1, group_ids=(0, 1), block_bytes=64)


def storage_keys(groups: str = "") -> Any:
    from kvtier.integrations.vllm.loop import StorageKeys

    return StorageKeys(model="m|float32", block_size=32, dtype="float32", num_layers=2, block_bytes=65536,
                       groups=groups)


def test_storage_keys_differ_per_group_and_a_one_group_model_keeps_its_keys() -> None:
    from types import SimpleNamespace

    from kvtier.integrations.vllm.groups import group_layout

    one = storage_keys(group_layout([SimpleNamespace(group_id=0, tokens_per_block=32, layer_names=("l0", "l1"))]))
    # Pinned: the key kvtier 0.x gave this block before hybrid support (main at 5b976cf).
    assert one(offload_key(BLOCK_HASH, 0)).hex() == "e10ab6f98841d03cb1e269421a84adf5c50d021d84bc28961643e7f485511630"
    layout = group_layout([
        SimpleNamespace(group_id=0, tokens_per_block=32, layer_names=("l0", "l2")),
        SimpleNamespace(group_id=1, tokens_per_block=32, layer_names=("l1", "l3")),
    ])
    assert layout == "0:32:l0,l2;1:32:l1,l3"
    hybrid = storage_keys(layout)
    keys = {hybrid(offload_key(BLOCK_HASH, 0)), hybrid(offload_key(BLOCK_HASH, 1)), one(offload_key(BLOCK_HASH, 0))}
    assert len(keys) == 3  # per group, and another grouping is another namespace


def offloading_config(groups: int) -> Any:
    """vLLM's `OffloadingConfig` of ``groups`` one-layer groups and no store."""
    from test_vllm_manager import offloading_config as config

    return config(groups=tuple((f"l{g}",) for g in range(groups)), block_bytes=4096,
                  extra={"cpu_bytes_to_use": 1 << 20})


def test_the_spec_takes_several_groups_only_as_kvtier_connector_checked_them() -> None:
    from kvtier.integrations.vllm import connector
    from kvtier.integrations.vllm.connector import KvtierOffloadingSpec

    with pytest.raises(ConfigurationError) as exc:
        KvtierOffloadingSpec(offloading_config(2))
    assert str(exc.value) == (
        "kvtier moves a model of several KV cache groups (this one has 2) only under "
        "kv_connector='KvtierConnector' (kv_connector_module_path='kvtier.integrations.vllm'), which "
        "checks each group's kind; vLLM's plain OffloadingConnector tells the spec no group's kind"
    )
    token = connector._CHECKED_GROUPS.set((info(0, "SlidingWindowSpec"), info(1, "FullAttentionSpec")))
    try:
        spec = KvtierOffloadingSpec(offloading_config(2))
        with pytest.raises(ConfigurationError, match=r"names KV cache groups \[0, 1, 2\]; KvtierConnector checked \[0, 1\]"):
            KvtierOffloadingSpec(offloading_config(3))
    finally:
        connector._CHECKED_GROUPS.reset(token)
    assert spec.group_ids == (0, 1) and spec.group_kinds == {0: "SlidingWindowSpec", 1: "FullAttentionSpec"}
    assert spec.storage_keys(offload_key(BLOCK_HASH, 0)) != spec.storage_keys(offload_key(BLOCK_HASH, 1))
    assert KvtierOffloadingSpec(offloading_config(1)).group_ids == (0,)  # one group needs no check


def test_the_manager_keeps_each_groups_block_of_one_hash_apart_in_one_host_space() -> None:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier.integrations.vllm import KvtierOffloadingManager

    ctx = ReqContext(req_id="r")
    m = KvtierOffloadingManager(2)
    swa, full = offload_key(BLOCK_HASH, 0), offload_key(BLOCK_HASH, 1)
    out = m.prepare_store([full], ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    assert m.lookup(full, ctx) is LookupResult.HIT and m.lookup(swa, ctx) is LookupResult.MISS
    out = m.prepare_store([full, swa], ctx)  # only the group not held yet is stored
    assert out is not None and out.keys_to_store == [swa] and out.evicted_keys == []
    m.complete_store(out.keys_to_store, ctx)
    assert m.prepare_load([swa, full], ctx).host_block_ids.tolist() == [1, 0]


def wait_for(worker: Any, job_id: int) -> Any:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for result in worker.get_finished():
            if result.job_id == job_id:
                return result
        time.sleep(0.01)
    raise AssertionError(f"job {job_id} did not finish")


def test_a_worker_stores_and_loads_two_groups_blocks_of_one_job_byte_exact() -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier.integrations.vllm.manager import KvtierBlocks
    from kvtier.integrations.vllm.options import parse_options
    from kvtier.integrations.vllm.worker import KvtierOffloadingWorker

    torch.manual_seed(0)
    # Two tensors (two layers per group) that both groups overlay, as Gemma-2's.
    tensors = [torch.randint(-128, 127, (8, 256), dtype=torch.int8) for _ in range(2)]
    worker = KvtierOffloadingWorker(
        canonical(tensors, [[0, 1], [0, 1]]), host_blocks=6, options=parse_options({}), staging_blocks=1,
        group_ids=(0, 1), group_kinds={0: "SlidingWindowSpec", 1: "FullAttentionSpec"}, block_bytes=2 * 256,
    )
    try:
        # The sliding-window group moves its window (blocks 5, 6), the full one its prefix (1, 2, 3).
        blocks = [5, 6, 1, 2, 3]
        want = [t[blocks].clone() for t in tensors]
        spec = GPULoadStoreSpec(blocks, group_sizes=[2, 3], block_indices=[2, 0])
        assert worker.submit_store(1, spec, KvtierBlocks([4, 0, 1, 2, 3]))
        assert wait_for(worker, 1).success
        for t in tensors:
            t.zero_()
        assert worker.submit_load(2, KvtierBlocks([4, 0, 1, 2, 3]), spec)
        result = wait_for(worker, 2)
        assert result.success and result.transfer_size == 5 * 2 * 256
        for t, w in zip(tensors, want, strict=True):
            assert torch.equal(t[blocks], w)
            assert not t[[0, 4, 7]].any()  # blocks no job named are untouched
        groups = worker.statistics()["groups"]
        assert groups == {
            "0": {"kind": "SlidingWindowSpec", "blocks_stored": 2, "blocks_loaded": 2},
            "1": {"kind": "FullAttentionSpec", "blocks_stored": 3, "blocks_loaded": 3},
        }
    finally:
        worker.shutdown()


def test_kvtier_connector_refuses_a_mamba_hybrid_before_vllm_builds_anything() -> None:
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from kvtier.integrations.vllm import KvtierConnector

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    mamba = MambaSpec(block_size=32, shapes=((4, 64),), dtypes=(torch.float32,))
    config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["attn.0"], full), KVCacheGroupSpec(["mixer.1", "mixer.2"], mamba)],
    )
    extra: dict[str, Any] = {"cpu_bytes_to_use": 1 << 20}
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    )
    with pytest.raises(ConfigurationError, match=r"group 1 \(layer 'mixer.1', 2 layers\) is MambaSpec: its recurrent"):
        KvtierConnector(vllm_config, None, config)
