"""kvtier inside vLLM's CPU build, end to end: each engine is a subprocess.

The baseline is the same engine without offloading, given the same requests
one at a time, so any difference in token ids or logprobs comes from the
bytes kvtier put back.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any

import pytest

from conftest import prompt_set, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

DEVICE_BLOCKS = 10  # 8 blocks for one request of max_model_len 256, so prefixes are evicted
PROMPTS = prompt_set()
GEN = {"op": "generate", "prompts": PROMPTS, "max_tokens": 6}
PHASES = [GEN, {"op": "reset"}, GEN]


def kvtier(extra: dict[str, Any] | None = None, **kv: Any) -> dict[str, Any]:
    return {"connector": "KvtierConnector", "extra": {"cpu_bytes_to_use": 32 << 20, **(extra or {})}, **kv}


def engine(model_dir: str, kv: dict[str, Any] | None, phases: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    return {"model": model_dir, "kv": kv, "num_gpu_blocks": DEVICE_BLOCKS, "phases": phases, **more}


def outputs(out: dict[str, Any], phase: int) -> list[dict[str, Any]]:
    generated = [p for p in out["phases"] if p["op"] == "generate"]
    result: list[dict[str, Any]] = generated[phase]["outputs"]
    return result


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"]


def cached(out: dict[str, Any], phase: int) -> list[int]:
    return [o["num_cached_tokens"] for o in outputs(out, phase)]


def timing(label: str, out: dict[str, Any]) -> str:
    per_request = [o["seconds"] for p in out["phases"] if p["op"] == "generate" for o in p["outputs"][1:]]
    return f"{label}: engine start {out['start_s']:.2f} s, request median {1000 * median(per_request):.1f} ms"


@pytest.fixture(scope="module")
def baseline(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = run_engine(engine(model_dir, None, PHASES), tmp_path_factory.mktemp("baseline"), "baseline")
    assert out["returncode"] == 0, out["log"][-3000:]
    return out


def test_outputs_equal_with_and_without_kvtier_after_reset_under_eviction_and_corruption_changes_them(
    model_dir: str, baseline: dict[str, Any], tmp_path: Path
) -> None:
    phases = [*PHASES, {"op": "stats"}, {"op": "reset"}, {"op": "corrupt"}, GEN]
    out = run_engine(engine(model_dir, kvtier(), phases), tmp_path, "kvtier")
    assert out["returncode"] == 0, out["log"][-3000:]
    for phase in (0, 1):
        for i, (got, want) in enumerate(zip(outputs(out, phase), outputs(baseline, phase), strict=True)):
            assert same(got, want), f"phase {phase} prompt {i}: {got['token_ids']} != {want['token_ids']}"
    # Under eviction (phase 0) and after vLLM dropped its prefix cache (phase 1),
    # kvtier served prefixes vLLM would have recomputed.
    assert sum(cached(out, 0)) > sum(cached(baseline, 0)), (cached(out, 0), cached(baseline, 0))
    assert all(n >= 3 * 32 for n in cached(out, 1)), cached(out, 1)
    (stats,) = next(p for p in out["phases"] if p["op"] == "stats")["workers"]
    served = sum(cached(out, 0)) + sum(cached(out, 1)) - sum(cached(baseline, 0)) - sum(cached(baseline, 1))
    assert stats["blocks_loaded_from_host"] * 32 >= served > 0, (stats, served)
    assert stats["scheduler"]["load"]["completed"] == stats["loads"] > 0
    assert stats["scheduler"]["load"]["bytes"] == stats["blocks_loaded_from_host"] * stats["block_bytes"]
    assert stats["blocks_refused"] == stats["blocks_failed"] == 0
    # The control: the same loads from a host tier whose bytes were flipped give other outputs.
    corrupted = outputs(out, 2)
    assert all(n > 0 for n in cached(out, 2)), cached(out, 2)
    changed = [i for i, (got, want) in enumerate(zip(corrupted, outputs(baseline, 1), strict=True)) if not same(got, want)]
    assert changed, "outputs did not change although every byte kvtier loaded was flipped"
    print(timing("without kvtier", baseline), "|", timing("with kvtier", out),
          f"| tokens served from kvtier: {served}")


def test_verify_mode_refuses_the_corrupted_load_and_vllm_recomputes(
    model_dir: str, baseline: dict[str, Any], tmp_path: Path
) -> None:
    # A short extra request at the end, so that vLLM's last step reports every count.
    phases = [GEN, {"op": "reset"}, {"op": "corrupt"}, GEN, {**GEN, "prompts": [[7] * 8], "max_tokens": 2},
              {"op": "stats"}, {"op": "metrics"}]
    out = run_engine(engine(model_dir, kvtier({"kvtier": {"verify": True}}), phases, log_stats=True), tmp_path,
                     "verify")
    assert out["returncode"] == 0, out["log"][-3000:]
    for phase in (0, 1):
        for i, (got, want) in enumerate(zip(outputs(out, phase), outputs(baseline, phase), strict=True)):
            assert same(got, want), f"phase {phase} prompt {i}: {got['token_ids']} != {want['token_ids']}"
    (stats,) = next(p for p in out["phases"] if p["op"] == "stats")["workers"]
    assert stats["blocks_refused"] > 0 and stats["refused"] == {"host_verify": stats["blocks_refused"]}, stats
    assert stats["scheduler"]["load"]["failed"] > 0, stats
    assert any("CorruptionDetected" in e for e in stats["errors"]), stats["errors"]
    # The same counts on vLLM's /metrics (its Prometheus registry), next to vLLM's own kv_offload ones.
    metrics = {(m["name"], tuple(sorted(m["labels"].items()))): m["value"]
               for p in out["phases"] if p["op"] == "metrics" for m in p["metrics"]}

    def metric(name: str, **labels: str) -> float:
        found = [v for (n, ls), v in metrics.items()
                 if n == f"vllm:kv_offload_kvtier_{name}" and set(labels.items()) <= set(ls)]
        assert len(found) == 1, (name, labels, sorted(metrics))
        return float(found[0])

    block = stats["block_bytes"]
    assert metric("blocks_stored") == stats["blocks_stored"] > 0
    assert metric("bytes_stored") == stats["blocks_stored"] * block
    assert metric("blocks_loaded", source="host") == stats["blocks_loaded_from_host"] > 0
    assert metric("bytes_loaded", source="host") == stats["blocks_loaded_from_host"] * block
    assert metric("blocks_refused", reason="host_verify") == stats["blocks_refused"]
    assert 0 < metric("host_usage_perc") <= 1
    # Counters that never moved are there, at 0 (vLLM shows a labelled metric only once a value came).
    assert metric("blocks_failed") == stats["blocks_failed"] == 0
    assert any(n == "vllm:kv_offload_store_bytes" for n, _ in metrics), sorted(metrics)  # vLLM's own, beside


def damage(files: list[Path]) -> dict[Path, bytes]:
    """Flip one byte in the middle of each file, as a bad disk would (same length)."""
    damaged = {}
    for path in files:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        path.write_bytes(bytes(raw))
        damaged[path] = bytes(raw)
    return damaged


def test_a_second_engine_process_finds_the_first_ones_prefix_and_a_damaged_store_is_repaired(
    model_dir: str, baseline: dict[str, Any], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    kv = kvtier({"kvtier": {"store_path": str(store)}})
    # Engine A runs in vLLM's multiprocess mode (scheduler and worker in an
    # engine-core process of their own) and writes its blocks through. With
    # pinned thread binding (conftest) it agrees with the baseline bit for bit.
    # With vLLM's stat loggers on: they run in the front-end process, which
    # must know kvtier's metrics although only the engine core built its spec.
    first = run_engine(engine(model_dir, kv, [GEN, {"op": "metrics"}], multiprocessing=True, log_stats=True),
                       tmp_path, "store-a")
    assert first["returncode"] == 0, first["log"][-3000:]
    written = [m for p in first["phases"] if p["op"] == "metrics" for m in p["metrics"]
               if m["name"] == "vllm:kv_offload_kvtier_blocks_written_through"]
    assert len(written) == 1 and written[0]["value"] > 0, written
    never = [m["value"] for p in first["phases"] if p["op"] == "metrics" for m in p["metrics"]
             if m["name"] == "vllm:kv_offload_kvtier_blocks_refused" and m["labels"].get("reason") == "store_checksum"]
    assert never == [0], never  # a counter that never moved is there, at 0
    # The engine core's process ended with the engine; nothing of kvtier's is left in this one.
    assert first["after_drop"] == {"threads": [], "workers": 0, "children": []}, first["after_drop"]
    for i, (got, want) in enumerate(zip(outputs(first, 0), outputs(baseline, 0), strict=True)):
        assert same(got, want), f"prompt {i}: {got['token_ids']} != {want['token_ids']}"
    assert sum(cached(first, 0)) > sum(cached(baseline, 0)), "multiprocess mode served nothing from kvtier"
    stored = list(store.rglob("*.data"))  # FileStore: one file a page
    assert stored, "engine A wrote nothing through to the store"
    # Engine B: a new process with an empty device cache and host tier.
    second = run_engine(engine(model_dir, kv, [GEN]), tmp_path, "store-b")
    assert second["returncode"] == 0, second["log"][-3000:]
    assert all(n >= 3 * 32 for n in cached(second, 0)), cached(second, 0)
    for i, (got, want) in enumerate(zip(outputs(second, 0), outputs(baseline, 0), strict=True)):
        assert same(got, want), f"prompt {i}: {got['token_ids']} != {want['token_ids']}"
    (stats,) = second["stats"]
    assert stats["blocks_loaded_from_store"] * 32 >= cached(second, 0)[0] > 0, stats
    assert stats["staging"]["prefetch"]["completed"] > 0, stats
    assert stats["blocks_refused"] == 0 and stats["refused"] == {}, stats
    # Every stored block damaged. A load stops at its first refused block;
    # the blocks behind it are not read, and vLLM recomputes them all: engine
    # C puts every one of them again (not only the refused ones, which a
    # write-through would otherwise find "already stored"), so one process
    # leaves the store whole, byte for byte what engine A wrote.
    whole = {p: p.read_bytes() for p in sorted(store.rglob("*.data"))}
    damaged = damage(list(whole))
    third = run_engine(engine(model_dir, kv, [GEN]), tmp_path, "store-c")
    assert third["returncode"] == 0, third["log"][-3000:]
    for i, (got, want) in enumerate(zip(outputs(third, 0), outputs(baseline, 0), strict=True)):
        assert same(got, want), f"engine C prompt {i}: {got['token_ids']} != {want['token_ids']}"
    (stats_c,) = third["stats"]
    assert set(stats_c["refused"]) == {"store_checksum"} and stats_c["blocks_refused"] > 0, stats_c
    assert stats_c["keys_to_rewrite"] == 0, stats_c
    still = [p for p, raw in damaged.items() if p.read_bytes() == raw]
    assert not still, f"{len(still)} of {len(damaged)} damaged blocks were not rewritten"
    changed = [p for p, raw in whole.items() if p.read_bytes() != raw]
    assert not changed, f"{len(changed)} of {len(whole)} rewritten blocks differ from what engine A stored"
    # Engine D, a new process: the repaired store serves every prefix, clean.
    fourth = run_engine(engine(model_dir, kv, [GEN]), tmp_path, "store-d")
    assert fourth["returncode"] == 0, fourth["log"][-3000:]
    assert cached(fourth, 0) == cached(second, 0), (cached(fourth, 0), cached(second, 0))
    for i, (got, want) in enumerate(zip(outputs(fourth, 0), outputs(baseline, 0), strict=True)):
        assert same(got, want), f"engine D prompt {i}: {got['token_ids']} != {want['token_ids']}"
    (stats_d,) = fourth["stats"]
    assert stats_d["blocks_refused"] == stats_d["blocks_failed"] == 0, stats_d
    assert stats_d["blocks_loaded_from_store"] == stats["blocks_loaded_from_store"], (stats_d, stats)
    print(f"store: engine A (multiprocess) wrote {len(stored)} blocks, {timing('start', first)}; "
          f"engine B served {cached(second, 0)} tokens per request, {stats['blocks_loaded_from_store']} blocks "
          f"from the store; " + timing("engine B", second) + f"; engine C refused {stats_c['refused']} and "
          f"rewrote {len(damaged)} blocks; engine D served {cached(fourth, 0)}")


def test_bad_configuration_fails_at_engine_start_naming_the_option(model_dir: str, tmp_path: Path) -> None:
    bad = {
        "host_blokcs": {"cpu_bytes_to_use": 32 << 20, "kvtier": {"host_blokcs": 64}},  # an unknown option
        "cpu_bytes_to_use": {"cpu_bytes_to_use": 1 << 62},  # more than the machine has
    }
    run = {**engine(model_dir, kvtier(), []), "bad_extras": list(bad.values())}
    out = run_engine(run, tmp_path, "bad")
    assert out["returncode"] == 0, out["log"][-3000:]
    for (named, _), error in zip(bad.items(), out["errors"], strict=True):
        assert error is not None, f"an engine with a bad {named!r} started"
        assert error.startswith("ConfigurationError") and f"'{named}'" in error, error


def test_refused_starts_leave_the_process_clean_for_a_valid_engine(
    model_dir: str, baseline: dict[str, Any], tmp_path: Path
) -> None:
    # Each refused start runs in the engine's own process, one after the other,
    # and then a valid kvtier engine starts there and serves as in a fresh process.
    regular = tmp_path / "a-file"
    regular.write_text("not a directory")
    plain = {"connector": "OffloadingConnector", "extra": {
        "cpu_bytes_to_use": 32 << 20, "spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
        "kvtier": {"verify": True},
    }}
    refused = {
        "kv_connector='KvtierConnector'": plain,
        "kvtier option 'store_path'='/proc/kvtier-store' names a store kvtier cannot use":
            kvtier({"kvtier": {"store_path": "/proc/kvtier-store"}}),
        f"kvtier option 'store_path'='{regular / 'store'}' names a store kvtier cannot use":
            kvtier({"kvtier": {"store_path": str(regular / "store")}}),
        "kvtier option 'redis_url'='redis://127.0.0.1:1/0' names a store kvtier cannot use":
            kvtier({"kvtier": {"redis_url": "redis://127.0.0.1:1/0"}}),
        "kvtier option 'verify' is at the top level of kv_connector_extra_config": kvtier({"verify": True}),
        "kv_connector_extra_config key 'kv_tier' is not 'kvtier'": kvtier({"kv_tier": {"verify": True}}),
    }
    run = {**engine(model_dir, kvtier(), [GEN]), "refused_kvs": list(refused.values())}
    out = run_engine(run, tmp_path, "refused-then-valid")
    assert out["returncode"] == 0, out["log"][-3000:]
    for message, error in zip(refused, out["refused_starts"], strict=True):
        assert error is not None and error.startswith("ConfigurationError") and message in error, (message, error)
    for i, (got, want) in enumerate(zip(outputs(out, 0), outputs(baseline, 0), strict=True)):
        assert same(got, want), f"prompt {i}: {got['token_ids']} != {want['token_ids']}"
    assert sum(cached(out, 0)) > sum(cached(baseline, 0)), "the valid engine served nothing from kvtier"
    (stats,) = out["stats"]
    assert stats["blocks_loaded_from_host"] > 0, stats


OFFLOADING_GIB = 1 / 128  # vLLM's --kv-offloading-size, in GiB: 8 MiB


def test_vllms_own_kv_offloading_size_sizes_kvtiers_host_tier_and_kvtiers_options_hold(
    model_dir: str, baseline: dict[str, Any], tmp_path: Path
) -> None:
    # vLLM renames kv_connector to its OffloadingConnector, keeps kvtier's module
    # path and sets cpu_bytes_to_use to the size: kvtier's connector answers, its
    # host tier is the size, and verify mode (a kvtier option) still refuses flipped bytes.
    sized = {"connector": "KvtierConnector", "extra": {"kvtier": {"verify": True}}}
    refused = {
        "vLLM's --kv-offloading-backend lmcache (kv_offloading_backend='lmcache') replaces kvtier's connector":
            {**sized, "llm": {"kv_offloading_size": OFFLOADING_GIB, "kv_offloading_backend": "lmcache"}},
        "kvtier option 'host_blocks'=64 and vLLM's --kv-offloading-size 0.0078125 (kv_offloading_size) both size":
            {"connector": "KvtierConnector", "extra": {"kvtier": {"host_blocks": 64}},
             "llm": {"kv_offloading_size": OFFLOADING_GIB}},
    }
    phases = [GEN, {"op": "reset"}, {"op": "corrupt"}, GEN, {"op": "stats"}]
    run = {**engine(model_dir, sized, phases), "llm": {"kv_offloading_size": OFFLOADING_GIB},
           "refused_kvs": list(refused.values())}
    out = run_engine(run, tmp_path, "offloading-size")
    assert out["returncode"] == 0, out["log"][-3000:]
    for message, error in zip(refused, out["refused_starts"], strict=True):
        assert error is not None and error.startswith("ConfigurationError") and message in error, (message, error)
    for phase in (0, 1):
        for i, (got, want) in enumerate(zip(outputs(out, phase), outputs(baseline, phase), strict=True)):
            assert same(got, want), f"phase {phase} prompt {i}: {got['token_ids']} != {want['token_ids']}"
    (stats,) = next(p for p in out["phases"] if p["op"] == "stats")["workers"]
    assert stats["host_blocks"] == int(OFFLOADING_GIB * (1 << 30)) // stats["block_bytes"] == 128, stats
    assert stats["blocks_loaded_from_host"] > 0 and stats["refused"].get("host_verify", 0) > 0, stats


def test_engines_made_and_dropped_in_one_process_leave_no_kvtier_thread_or_host_memory(
    model_dir: str, tmp_path: Path
) -> None:
    # Three engines, one after the other in one process, each with a store (a
    # lookup thread on the scheduler side, a staging pool) and verify mode,
    # each dropped with `del llm; gc.collect()` as tests and notebooks do.
    kv = kvtier({"kvtier": {"store_path": str(tmp_path / "store"), "verify": True}})
    run = {**engine(model_dir, kv, []), "lifetime": {"engines": 3, "prompts": PROMPTS[:2], "wait_s": 60}}
    out = run_engine(run, tmp_path, "lifetime")
    assert out["returncode"] == 0, out["log"][-3000:]
    drops, final = out["lifetime"]["drops"], out["lifetime"]["final"]
    assert len(drops) == 3
    for i, left in enumerate(drops):
        assert left["workers_while_running"] == 1 and left["objects"] == 3, (i, left)
        # The worker and its host pools (the host tier, the staging pool) are gone with the engine,
        # and so are its loop and lookup threads; a scheduler's copy thread ends once idle.
        assert left["objects_alive"] == 0 and left["workers"] == 0, (i, left)
        assert not [t for t in left["threads"] if t.startswith("kvtier-vllm")], (i, left)
    assert final == {"threads": [], "workers": 0, "children": []}, final
