"""Store admission and host eviction in vLLM's integration: the manager and the
options as plain objects, then every policy pair in an engine, whose outputs
must equal vLLM's alone bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import prompt_set, run_engine
from kvtier.errors import ConfigurationError

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def ctx():  # type: ignore[no-untyped-def]
    from vllm.v1.kv_offload.base import ReqContext

    return ReqContext(req_id="r")


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def offer(manager, *ids: int, complete: bool = True) -> list[bytes]:  # type: ignore[no-untyped-def]
    """Offer blocks as vLLM's scheduler does; the keys the manager took."""
    out = manager.prepare_store([key(i) for i in ids], ctx())
    assert out is not None
    if complete:
        manager.complete_store(out.keys_to_store, ctx())
    return list(out.keys_to_store)


def skips(manager) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The skip counters of vLLM's stats since the last call, as vLLM's logger reduces them."""
    return {k: v for k, v in manager.get_stats().reduce().items() if "skipped" in k}


# -- the manager -----------------------------------------------------------------------


def test_the_gate_backs_up_a_block_on_its_second_offer_and_counts_the_skips_on_vllms_metrics() -> None:
    from vllm.v1.kv_offload.base import LookupResult

    from kvtier.integrations.vllm import KvtierOffloadingManager
    from kvtier.policies import FrequencyGate

    m = KvtierOffloadingManager(4, admission=FrequencyGate(sightings=2, window=16))
    assert offer(m, 1, 2) == []  # first offers: skipped, no host block taken
    assert m.lookup(key(1), ctx()) is LookupResult.MISS and len(m._free) == 4
    assert offer(m, 1, 3) == [key(1)]  # 1 is offered a second time: stored; 3 is new
    assert m.lookup(key(1), ctx()) is LookupResult.HIT
    assert skips(m) == {"vllm:kv_offload_kvtier_stores_skipped:('infrequent',)": 3}
    assert skips(m) == {}  # counted once: only what is new since the last call
    assert "admission=FrequencyGate, eviction=LruEviction" in repr(m)


def test_an_offer_refused_for_want_of_room_is_not_counted_as_a_sighting() -> None:
    from kvtier.integrations.vllm import KvtierOffloadingManager
    from kvtier.policies import FrequencyGate

    gate = FrequencyGate(sightings=2, window=16)
    m = KvtierOffloadingManager(1, admission=gate)
    offer(m, 1)
    offer(m, 1, complete=False)  # stored, but its store is in flight: not evictable
    assert m.prepare_store([key(2)], ctx()) is None  # vLLM offers it again next step
    assert gate.count(key(2)) == 0


def test_a_policy_that_admits_the_host_but_not_the_store_skips_only_the_write_through() -> None:
    from kvtier.integrations.vllm.manager import KvtierOffloadingManager, StoreLookup

    class HostOnlyForOdd:
        def admit(self, k: bytes, tier: str) -> str | None:
            return "odd" if tier == "store" and k[7] % 2 else None

    lookup = StoreLookup(lambda keys: [False] * len(keys), lambda k: b"s" + k)
    m = KvtierOffloadingManager(4, store=lookup, admission=HostOnlyForOdd())
    out = m.prepare_store([key(1), key(2)], ctx())
    assert out is not None and out.keys_to_store == [key(1), key(2)]
    assert out.store_spec.storage_keys == [b"", b"s" + key(2)]  # b"": the worker does not write it through
    assert skips(m) == {"vllm:kv_offload_kvtier_write_throughs_skipped:('odd',)": 1}


def test_slru_in_the_host_tier_keeps_reused_blocks_through_one_shot_blocks_and_never_evicts_a_read_one() -> None:
    from kvtier.integrations.vllm import KvtierOffloadingManager

    def survivors(eviction: str) -> set[int]:
        m = KvtierOffloadingManager(5, eviction=eviction)
        offer(m, 1, 2)
        m.prepare_load([key(1)], ctx())  # 1 is read by a request...
        m.complete_load([key(1)], ctx())
        offer(m, 2)  # ... and 2 computed again by another: both reused
        reading = m.prepare_load([key(1)], ctx())
        for i in range(100, 110):  # one-shot blocks, two at a time
            offer(m, i, i + 50)
        assert reading.host_block_ids.size == 1 and 1 in {int.from_bytes(k[:8], "big") for k in m._blocks}
        m.complete_load([key(1)], ctx())
        return {i for i in (1, 2) if key(i) in m._blocks}

    assert survivors("slru") == {1, 2}
    assert survivors("lru") == {1}  # 1 only because it was being read


MANAGER_OPS = st.lists(
    st.tuples(st.sampled_from(["offer", "complete", "fail", "load", "loaded", "refuse", "touch"]),
              st.lists(st.integers(0, 9), min_size=1, max_size=3)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["lru", "slru"]), st.sampled_from([1, 2]), MANAGER_OPS)
def test_under_any_calls_no_block_in_flight_or_read_is_evicted_and_the_idle_count_holds(
    eviction: str, sightings: int, ops: list[tuple[str, list[int]]]
) -> None:
    from kvtier.integrations.vllm import KvtierOffloadingManager
    from kvtier.policies import FrequencyGate

    m = KvtierOffloadingManager(4, admission=FrequencyGate(sightings, 8), eviction=eviction)
    storing: set[bytes] = set()
    reading: list[bytes] = []
    for op, ids in ops:
        keys = [key(i) for i in ids]
        if op == "offer":
            busy = storing | set(reading)
            out = m.prepare_store(keys, ctx())
            if out is not None:
                assert not busy & set(out.evicted_keys), (busy, out.evicted_keys)
                storing |= set(out.keys_to_store)
                storing -= set(out.evicted_keys)
        elif op in ("complete", "fail"):
            done = [k for k in keys if k in storing]
            m.complete_store(done, ctx(), success=op == "complete")
            storing -= set(done)
        elif op == "load":
            held = [k for k in keys if k in m._blocks]
            if held:
                m.prepare_load(held, ctx())
                reading += held
        elif op == "loaded" and reading:
            m.complete_load([reading.pop(0)], ctx())
        elif op == "refuse":
            m.refuse([k for k in keys if k in m._blocks])
            storing -= set(keys)
        elif op == "touch":
            m.touch(keys, ctx())
        assert m._idle == m._evictable(), (op, ids)
        assert len(m.eviction) == len(m._blocks)
        assert len(m._free) + len(m._blocks) + len(m._draining) == 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"store_admission": "lfu"}, "'store_admission' must be one of \\['all', 'frequency'\\] .*got 'lfu'"),
        ({"store_admission": "frequency", "admission_sightings": 0}, "'admission_sightings' must be an int >= 1; got 0"),
        ({"store_admission": "frequency", "admission_window": 0}, "'admission_window' must be an int >= 1; got 0"),
        ({"store_admission": "frequency", "admission_window": "8"}, "'admission_window' must be an int >= 1; got '8'"),
        ({"store_admission": "frequency", "admission_sightings": None}, "'admission_sightings' must be an int >= 1"),
        ({"admission_sightings": 3}, "'admission_sightings' applies to store_admission='frequency' only"),
        ({"host_eviction": "arc"}, "'host_eviction' must be one of \\['lru', 'slru'\\]; got 'arc'"),
        ({"host_eviction": 1}, "'host_eviction' must be one of \\['lru', 'slru'\\]; got 1"),
    ],
)
def test_bad_policy_options_raise_naming_the_option_and_value(extra: dict[str, object], message: str) -> None:
    from kvtier.integrations.vllm import parse_options

    with pytest.raises(ConfigurationError, match=message):
        parse_options({"kvtier": extra})


def test_policy_options_parse_and_a_factory_that_cannot_be_imported_fails_the_spec() -> None:
    from kvtier.integrations.vllm import parse_options
    from kvtier.integrations.vllm.connector import KvtierOffloadingSpec

    got = parse_options({"kvtier": {"store_admission": "frequency", "admission_sightings": 3, "host_eviction": "slru"}})
    assert (got.store_admission, got.admission_sightings, got.admission_window, got.host_eviction) == (
        "frequency", 3, None, "slru")
    from test_vllm_manager import offloading_config  # the manager tests' config helper

    with pytest.raises(ConfigurationError, match="'store_admission'='no_such_module:policy' cannot be imported"):
        KvtierOffloadingSpec(offloading_config(extra={"kvtier": {"host_blocks": 4,
                                                                 "store_admission": "no_such_module:policy"}}))


# -- every policy pair in an engine ------------------------------------------------------

DEVICE_BLOCKS = 10
PROMPTS = prompt_set()
GEN = {"op": "generate", "prompts": PROMPTS, "max_tokens": 6}
PHASES = [GEN, {"op": "reset"}, GEN]
PAIRS = [("all", "lru"), ("frequency", "lru"), ("all", "slru"), ("frequency", "slru")]


def outputs(out: dict[str, Any], phase: int) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = [p for p in out["phases"] if p["op"] == "generate"][phase]["outputs"]
    return result


@pytest.fixture(scope="module")
def baseline(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run = {"model": model_dir, "kv": None, "num_gpu_blocks": DEVICE_BLOCKS, "phases": PHASES}
    out = run_engine(run, tmp_path_factory.mktemp("policies-baseline"), "baseline")
    assert out["returncode"] == 0, out["log"][-3000:]
    return out


@pytest.mark.parametrize(("admission", "eviction"), PAIRS)
def test_outputs_equal_vllm_alone_with_every_policy_pair(
    model_dir: str, baseline: dict[str, Any], tmp_path: Path, admission: str, eviction: str
) -> None:
    # A host tier of 16 blocks: the prompts have 24 full blocks (12 of them shared prefixes), so store-all evicts.
    options = {"host_blocks": 16, "store_admission": admission, "host_eviction": eviction}
    kv = {"connector": "KvtierConnector", "extra": {"kvtier": options}}
    phases = [*PHASES, {**GEN, "prompts": [[7] * 8], "max_tokens": 2}, {"op": "stats"}, {"op": "metrics"}]
    run = {"model": model_dir, "kv": kv, "num_gpu_blocks": DEVICE_BLOCKS, "phases": phases, "log_stats": True}
    out = run_engine(run, tmp_path, f"{admission}-{eviction}")
    assert out["returncode"] == 0, out["log"][-3000:]
    for phase in (0, 1):
        for i, (got, want) in enumerate(zip(outputs(out, phase), outputs(baseline, phase), strict=True)):
            assert got["token_ids"] == want["token_ids"], f"phase {phase} prompt {i}"
            assert got["logprobs"] == want["logprobs"], f"phase {phase} prompt {i}"
    (stats,) = next(p for p in out["phases"] if p["op"] == "stats")["workers"]
    # kvtier served some prefix after vLLM dropped its own copies, so the outputs compared include loaded bytes.
    assert stats["blocks_loaded_from_host"] > 0 and stats["blocks_failed"] == stats["blocks_refused"] == 0, stats
    assert sum(o["num_cached_tokens"] for o in outputs(out, 1)) > 0
    skipped = sum(m["value"] for p in out["phases"] if p["op"] == "metrics" for m in p["metrics"]
                  if m["name"] == "vllm:kv_offload_kvtier_stores_skipped")
    if admission == "frequency":
        assert skipped > 0  # the suffix blocks, seen once, were not backed up
    else:
        assert skipped == 0


def test_the_worker_writes_through_only_the_blocks_the_manager_named_a_storage_key_for(tmp_path: Path) -> None:
    from test_vllm_worker import device, kv_caches, wait_for

    from kvtier.integrations.vllm import KvtierBlocks, KvtierOffloadingWorker, parse_options

    caches = kv_caches()
    keys = [b"", bytes([1]) * 32, b""]  # b"": the store admission skipped that block's write-through
    options = parse_options({"kvtier": {"store_path": str(tmp_path / "store")}})
    worker = KvtierOffloadingWorker(caches, host_blocks=4, options=options, staging_blocks=4)
    try:
        assert worker.submit_store(1, device([0, 1, 2]), KvtierBlocks([0, 1, 2], keys))
        wait_for(lambda: worker.counts.blocks_written_through == 1)
        worker.wait({1})
        assert worker.counts.blocks_stored == 3  # all three are on the host
        stored = sorted(p.name for p in (tmp_path / "store").rglob("*.data"))
        assert stored == [f"{keys[1].hex()}.data"], stored
        assert worker.statistics()["scheduler"]["write_storage"]["bytes"] == worker.block_bytes
    finally:
        worker.shutdown()
