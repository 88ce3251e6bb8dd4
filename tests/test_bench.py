"""The benchmark runs end to end and writes a complete JSON document.

Timings belong to the benchmark, never to tests: nothing here checks a speed,
only that every figure is there and is a positive number. The raw baselines
are also checked byte for byte, since "raw best" is only a fair bar if every
candidate copies the same rows.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import anyio
import pytest
import structlog
import torch

from kvtier.__main__ import main as _cli_main
from kvtier.bench.core import MODES, REALISTIC, build_pools, fit_shape, many_ops_shapes
from kvtier.bench.copies import (
    RAW_METHODS,
    Ceiling,
    RowCopy,
    Side,
    index_runs,
    raw_methods_for,
)


def cli_main(argv: list[str]) -> int:
    """The CLI, leaving structlog as it found it: the CLI configures logging
    (a filter at WARNING) for the whole process, which would hide the events
    that other test files capture."""
    config = structlog.get_config()
    try:
        return _cli_main(argv)
    finally:
        structlog.configure(**config)


def _positive(value: object, where: str) -> None:
    assert isinstance(value, (int, float)) and not isinstance(value, bool), where
    assert math.isfinite(value) and value > 0, f"{where} = {value!r}"


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("bench") / "out.json"
    assert cli_main(["bench", "--tiny", "--quiet", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_json_has_every_section(doc: dict) -> None:
    assert set(doc) >= {"meta", "throughput", "burst", "loop_lag", "callbacks", "overhead", "scaling", "loop",
                        "targets"}
    assert doc["meta"]["mode"] == "tiny"
    assert doc["meta"]["many_ops_scaled_down"] is True
    _positive(doc["meta"]["seconds"], "meta.seconds")
    sections = doc["meta"]["section_seconds"]
    assert list(sections) == ["floor", "one_op", "many_ops", "burst", "overhead", "scaling", "loop", "storage"]
    assert all(v > 0 for v in sections.values()) and sum(sections.values()) <= doc["meta"]["seconds"]


def test_loop_section_reports_the_engine_thread_cost(doc: dict) -> None:
    lp = doc["loop"]
    assert lp["operations"] == doc["meta"]["settings"]["loop_ops"]
    assert set(lp["per_op"]) == {f"{e}:{p}" for e in ("noop", "cpu") for p in ("single", "bulk", "arrays")}
    for label, x in lp["per_op"].items():
        for key in ("loop_cpu_us", "wall_us"):
            _positive(x[key]["median"], f"loop.per_op.{label}.{key}")
    assert set(lp["step_share"]) == {f"{p}:{n}" for p in ("single", "bulk", "arrays") for n in (64, 128, 256)}
    for k, v in lp["step_share"].items():
        # the share is the step's loop CPU over 20 ms, as reported
        assert v["share"] == pytest.approx(v["loop_cpu_ms"] / 20.0), k
    assert set(lp["lone_loop_cpu_us"]) == {"noop", "cpu"}
    assert set(lp["cyclic_garbage_per_op"]) == {"single", "bulk", "arrays"}
    for label, c in lp["counts"].items():
        assert c["batches"] >= 1, label
        _positive(c["loop_turns_per_op"], f"loop.counts.{label}.loop_turns_per_op")
        # an operation's path runs no torch operator on the loop (metadata reads of the caller's
        # tensor only); the carrier's tensors are made once for all its requests
        assert c["torch_ops_per_op"] == 0 and c["torch_ops_per_batch"] == 0, (label, c)
        assert c["torch_calls_per_op"] >= c["torch_ops_per_op"], (label, c)
    assert set(lp["counts"]) == {f"{e}:{p}" for e in ("noop", "cpu")
                                 for p in ("single", "bulk", "arrays", "lone", "load_single", "load_bulk")}
    assert lp["counts"]["cpu:bulk"]["thread_hops_per_op"] > 0  # a batch hops to the executor's thread and back
    # The array-native path runs no torch call at all on the loop (numpy input, numpy checks).
    assert lp["counts"]["noop:arrays"]["torch_calls_per_op"] == 0, lp["counts"]["noop:arrays"]
    ms = lp["many_submitters"]
    assert ms["kvtier_us_per_op"] == pytest.approx(ms["loop_cpu_us_per_op"] - ms["spawn_only_us_per_op"])
    assert ms["ratio"] == pytest.approx(max(ms["kvtier_us_per_op"], 0) / ms["one_task_loop_cpu_us_per_op"])
    b = lp["busy_thread"]
    assert b["lone_intervals"] == pytest.approx(b["lone_ms"]["median"] / b["switch_interval_ms"])
    for path in ("single", "bulk"):  # the lean floor, beside kvtier in the same run
        x = lp["lean"][path]
        _positive(x["lean_loop_cpu_us"], f"loop.lean.{path}.lean_loop_cpu_us")
        assert x["ratio"] == pytest.approx(x["kvtier_loop_cpu_us"] / x["lean_loop_cpu_us"]), path
    _positive(lp["lean"]["hop_loop_cpu_us"]["median"], "loop.lean.hop_loop_cpu_us")
    lone = lp["lean"]["lone_loop_cpu_us"]  # the floor under kvtier's lone row, beside it in the target's detail
    assert 0 < lone["min"] <= lone["median"] <= lone["max"]
    lone_target = next(t for t in doc["targets"] if t["key"] == "lone_loop_cpu")
    assert f"the lean scheduler's lone backup {lone['median']:.1f} us" in lone_target["detail"]
    # The same lean backup with its copy handed to a worker thread: it pays a hop, so it costs more.
    copying = lp["lean"]["lone_copying_loop_cpu_us"]
    assert 0 < copying["min"] <= copying["median"] <= copying["max"]
    assert copying["median"] > lone["median"]
    assert f"copying in a worker thread as CpuExecutor does {copying['median']:.1f} us" in lone_target["detail"]
    assert b["cpu_bulk_intervals"] == pytest.approx(b["cpu_bulk_ms"]["median"] / b["switch_interval_ms"])
    keys = {t["key"] for t in doc["targets"]}
    assert keys >= {"loop_cpu_single", "loop_cpu_bulk", "loop_cpu_arrays", "lone_loop_cpu", "step_share_single", "step_share_bulk",
                    "cyclic_garbage", "many_submitters", "busy_lone", "busy_bulk"}


def test_loop_section_counts_the_objects_the_collector_walks(doc: dict) -> None:
    g = doc["loop"]["gc_objects"]
    ops = g["operations"]
    assert ops == max(doc["meta"]["settings"]["scaling_counts"][0], doc["meta"]["settings"]["loop_ops"])
    assert set(g["paths"]) == {"single", "bulk", "arrays"}
    for path, x in g["paths"].items():
        q = x["queued"]
        # the handles and their list, or one bulk operation, are the caller's
        assert q["returned_per_op"] == pytest.approx((ops + 1) / ops if path != "arrays" else 1 / ops), path
        assert q["kvtier_objects_per_op"] == pytest.approx(q["objects_per_op"] - q["returned_per_op"]), path
        assert q["references_per_op"] > 0 and x["full_collection_ms"]["idle"] > 0, path
    # the array-native path makes no object per request: a handle each is what the others hand out
    arrays = g["paths"]["arrays"]["queued"]["objects_per_op"]
    for path in ("single", "bulk"):
        assert arrays < g["paths"][path]["queued"]["objects_per_op"] - 0.5, (path, g["paths"])


def test_throughput_rows_cover_every_scenario(doc: dict) -> None:
    s = doc["meta"]["settings"]
    one = {(r["direction"], r["device"], r["layout"], r["page_size"], r["pattern"])
           for r in doc["throughput"] if r["group"] == "one_op"}
    many = {(r["direction"], r["device"], r["layout"], r["page_size"], r["pattern"])
            for r in doc["throughput"] if r["group"] == "many_ops"}
    assert set(s["devices"]) == {"stacked", "per_layer"}
    assert one == {(d, dev, lay, ps, pat) for d in s["one_op_directions"] for dev in s["devices"]
                   for lay in s["layouts"] for ps in s["page_sizes"] for pat in s["patterns"]}
    # --tiny: 64 pages of page 16 at 32x8x128 do not fit its 1 MiB budget; page 1 runs scaled down.
    assert doc["meta"]["many_ops_page_sizes_left_out"] == [16]
    assert set(s["one_op_directions"]) == set(s["many_ops_directions"]) == {"backup", "load"}
    assert many == {(d, dev, lay, 1, pat) for d in s["many_ops_directions"] for dev in s["many_devices"]
                    for lay in s["layouts"] for pat in s["patterns"]}


def test_throughput_figures_are_positive(doc: dict) -> None:
    for r in doc["throughput"]:
        where = f"{r['group']} {r['direction']} {r['layout']} {r['page_size']} {r['pattern']}"
        many = r["group"] == "many_ops"
        kv = {"kvtier_one"} | ({"kvtier_many", "kvtier_bulk", "kvtier_arrays"} if many else set())
        names = {"ceiling", f"raw:{r['raw_best_method']}"} | kv | {f"{k}_worker" for k in kv}
        assert names <= set(r["variants"]), where
        assert r["raw_best_method"] in RAW_METHODS
        # kvtier's own choice (the copy calibration times the candidates on this machine, so
        # any of them may win): span only when the device is stacked, stack only for a backup
        # into page_first host rows.
        path = r["kvtier_method"].split("/")[0]
        eligible = {"layers"} | ({"span"} if r["device"] == "stacked" else set()) | (
            {"stack"} if r["direction"] == "backup" and r["layout"] == "page_first" else set())
        assert path in eligible, (where, r["kvtier_method"])
        all_layers = {"slices_all_layers", "staged_all_layers", "gather_all_layers"}
        expected = set(RAW_METHODS) - (set() if r["device"] == "stacked" else all_layers)
        if r["layout"] != "page_first" or r["direction"] == "load":
            expected.discard("stack_all_layers")  # only into a page_first destination
        assert set(r["raw_selection"]) == expected, where
        # Every method is timed or says why not; the finalists were timed.
        timed = {m for m, f in r["raw_selection"].items() if "skipped" not in f}
        assert all(isinstance(f["skipped"], str) for m, f in r["raw_selection"].items() if m not in timed)
        assert r["raw_best_method"] in r["raw_finalists"] and set(r["raw_finalists"]) <= timed, where
        for name, v in r["variants"].items():
            assert len(v["seconds"]) == doc["meta"]["settings"]["reps"]
            for key in ("median_s", "min_s", "max_s", "gbps_median", "gbps_min", "gbps_max"):
                _positive(v[key], f"{where} {name} {key}")
        for key, ratio in r["ratios"].items():
            for part in ("median", "paired_min", "paired_max"):
                _positive(ratio[part], f"{where} {key} {part}")
        # The raw best waited for from the loop: its copy plus the hand-offs, never less than the copy alone.
        best = r["raw_best_method"]
        in_thread, from_loop = r["variants"][f"raw:{best}"], r["variants"][f"raw:{best}_from_loop"]
        assert all(w >= t for w, t in zip(from_loop["seconds"], in_thread["seconds"])), where
        assert r["ratios"]["raw_best_from_loop_vs_raw_best"]["median"] == pytest.approx(
            in_thread["median_s"] / from_loop["median_s"])
        for name in ("kvtier_many", "kvtier_bulk", "kvtier_arrays"):
            assert (f"{name}_vs_raw_best" in r["ratios"]) == many
            assert (f"{name}_worker_vs_raw_best" in r["ratios"]) == many
        assert ("kvtier_bulk_vs_kvtier_many" in r["ratios"]) == many
        assert "kvtier_one_worker_vs_raw_best" in r["ratios"]
        _positive(r["nbytes"], where)
        assert r["host_indices_stable"] is True, where
        if many:
            n = doc["meta"]["settings"]["many_ops"]
            ops = r["operations"]
            assert ops["kvtier_many"] == ops["kvtier_bulk"] == ops["kvtier_arrays"] == r["pages"] == n
            assert r["bulk_calls"] == 1  # 64 requests fit one backup_many / load_many
            for name in ("kvtier_many", "kvtier_bulk", "kvtier_arrays"):
                assert r[f"{name}_batches_per_run"] >= 1, where


def test_burst_lag_and_overhead_figures(doc: dict) -> None:
    b = doc["burst"]
    for name in ("idle", "burst"):
        assert b[name]["samples"] >= 1
        for key in ("p50_ms", "p99_ms", "max_ms"):
            _positive(b[name][key], f"burst.{name}.{key}")
    _positive(b["batch_copy_ms_median"], "burst.batch_copy_ms_median")
    lag = doc["loop_lag"]["during_kvtier"]
    assert lag["ticks"] > 0
    _positive(lag["max_ms"], "loop_lag.max_ms")
    assert set(doc["loop_lag"]["gc_during_kvtier"]) == {"gen0", "gen1", "gen2", "over_10ms"}
    longest = doc["loop_lag"]["gc_longest"]
    assert longest is None or (longest["ms"] >= 0 and longest["generation"] in (0, 1, 2)
                               and longest["label"].split(":")[0] in ("one_op", "many_ops", "burst", "overhead"))
    assert doc["loop_lag"]["during_burst"]["ticks"] > 0
    o = doc["overhead"]
    for key in ("noop_us_per_op", "cpu_us_per_op", "sequential_round_trip_us"):
        _positive(o[key]["median"], f"overhead.{key}")


def test_overhead_has_single_and_bulk_backups_and_loads(doc: dict) -> None:
    o = doc["overhead"]
    n = o["operations"]
    assert n == doc["meta"]["settings"]["overhead_ops"]
    for executor in ("noop", "cpu"):
        for direction in ("backup", "load"):
            for path in ("single", "bulk"):
                x = o["us_per_op"][executor][direction][path]
                assert len(x["values"]) == doc["meta"]["settings"]["reps"]
                _positive(x["median"], f"overhead {executor} {direction} {path}")
                assert o["batches_per_run"][f"{executor}:{direction}:{path}"] >= 1
    for direction in ("backup", "load"):
        assert o["raw"][direction]["method"] in RAW_METHODS
        _positive(o["raw"][direction]["copy_s"]["median_s"], f"overhead raw {direction}")
        assert set(o["cpu_minus_raw_us_per_op"][direction]) == {"single", "bulk"}
    # One backup_many / load_many call takes the whole run into one batch.
    assert o["max_requests_per_bulk_call"] >= n
    assert o["batches_per_run"]["noop:backup:bulk"] == o["batches_per_run"]["noop:load:bulk"] == 1


def test_scaling_has_three_counts_both_paths_and_an_unfrozen_run(doc: dict) -> None:
    sc = doc["scaling"]
    s = doc["meta"]["settings"]
    counts = s["scaling_counts"]
    assert len(counts) == 3 and sc["counts"] == counts
    assert sc["max_queued_ops"] >= max(counts)  # all of them queued at once
    assert [(r["path"], r["operations"]) for r in sc["rows"]] == [(p, n) for n in counts
                                                                  for p in ("single", "bulk", "arrays")]
    for r in sc["rows"]:
        where = f"scaling {r['path']} {r['operations']}"
        assert len(r["us_per_op"]["values"]) == s["scaling_reps"]
        _positive(r["us_per_op"]["median"], where)
        _positive(r["submit_us_per_op"]["median"], where)
        assert r["submit_us_per_op"]["median"] <= r["us_per_op"]["median"], where  # a part of the whole
        rss = r["rss_bytes_per_op"]
        assert rss is None or math.isfinite(rss["median"]), where
        assert r["batches_per_run"] >= 1 and r["collections_per_run"] >= 0
        assert set(r["gc"]) == {"gen0", "gen1", "gen2", "over_10ms"}
        assert set(r["callbacks"]["owners"]) == {"kvtier", "bench", "other"}
    for path in ("single", "bulk", "arrays"):
        flat = sc["flat"][path]
        assert len(flat["us_per_op"]) == 3 and flat["max_over_min"] >= 1.0
    # The run froze the heap after set-up, as engines do; one more run shows the heap unfrozen.
    assert s["gc_freeze"] is True and sc["gc_frozen"] is True and sc["gc_frozen_run"] is None
    unfrozen = sc["gc_unfrozen_run"]
    assert unfrozen["operations"] == s["scaling_freeze_count"] and unfrozen["path"] == "single"
    assert unfrozen["frozen"] == f"scaling:single:{s['scaling_freeze_count']}"
    _positive(unfrozen["us_per_op"]["median"], "unfrozen run")
    al = sc["allocator"]
    assert [r["pool_pages"] for r in al["rows"]] == s["allocator_pool_pages"]
    for r in al["rows"]:
        for key in ("alloc_one", "free_one", "alloc_bulk", "free_bulk"):
            _positive(r[f"{key}_ns_per_page"], f"allocator {r['pool_pages']} {key}")
    assert al["rows"][0]["alloc_one_vs_smallest"] == 1.0
    _positive(al["worst_vs_smallest"], "allocator worst")


def test_callbacks_are_timed_and_named(doc: dict) -> None:
    cb = doc["callbacks"]
    d = cb["during_kvtier"]
    assert d["callbacks"] > 0 and set(d["owners"]) == {"kvtier", "bench", "other"}
    labels = set(doc["loop_lag"]["by_run"]) | {r["label"] for r in doc["scaling"]["rows"]}
    for owner, x in d["owners"].items():
        if x is None:
            continue
        assert 0 <= x["longest_ms"] <= x["longest_gross_ms"], owner
        assert isinstance(x["name"], str) and x["name"], owner
        assert x["over_1ms"] >= 0
    assert set(cb["by_section"]) >= {"one_op", "many_ops", "burst", "overhead", "scaling"}
    assert sum(x["callbacks"] for x in cb["by_section"].values()) == d["callbacks"]
    assert labels  # the runs the longest callbacks name are runs of this document
    import asyncio

    assert asyncio.events.Handle._run.__qualname__ == "Handle._run"  # the wrapper was taken off again


def test_targets_have_a_verdict(doc: dict) -> None:
    keys = [t["key"] for t in doc["targets"]]
    assert keys == ["one_op_vs_raw_best", "bulk_vs_raw_best", "arrays_vs_raw_best", "single_vs_raw_best", "overhead_bulk",
                    "overhead_single", "burst_p99", "burst_loop_lag_p99", "longest_callback", "gc_pause",
                    "scaling_single", "scaling_bulk", "scaling_arrays", "scaling_gc_pause", "loop_cpu_single", "loop_cpu_bulk", "loop_cpu_arrays", "lone_loop_cpu",
                    "step_share_single", "step_share_bulk", "step_share_arrays", "cyclic_garbage", "gc_objects_per_op",
                    "gc_objects_per_page", "many_submitters",
                    "lean_single", "lean_bulk", "busy_lone", "busy_bulk"]
    one_op = doc["targets"][0]  # beside it, the floor: the raw best waited for from the loop, no scheduler
    floor = min(r["ratios"]["raw_best_from_loop_vs_raw_best"]["median"] for r in doc["throughput"]
                if r["group"] == "one_op")
    assert f"(its hand-offs, no scheduler) worst {floor:.2f}x" in one_op["detail"]
    for t in doc["targets"]:
        assert isinstance(t["passed"], bool)
        # A collection or a callback may not have happened at all: zero is a value there.
        assert isinstance(t["value"], (int, float)) and math.isfinite(t["value"]) and t["value"] >= 0, t["key"]
        if t["key"] == "cyclic_garbage":
            assert t["bound"] == 0
        else:
            _positive(t["bound"], t["key"])
        assert t["higher_is_better"] == t["key"].endswith("_vs_raw_best"), t["key"]
        assert t["passed"] == (t["value"] >= t["bound"] if t["higher_is_better"] else t["value"] <= t["bound"]), t["key"]


def test_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: dict) -> None:
    from kvtier.bench.report import format_report

    text = format_report(doc)
    for heading in ("Throughput, one operation", "one-page operations submitted concurrently", "N bulk ops GB/s",
                    "Latency of a one-page load", "Event-loop lag", "during the backup bursts",
                    "Event-loop callbacks", "longest kvtier callback by section", "Scheduler overhead",
                    "backup bulk", "load single", "Scaling:", "per-operation time, largest over smallest",
                    "frozen:", "PageAllocator", "collections over 10 ms", "The engine's thread",
                    "share of a 20 ms step", "beside a busy Python thread", "Targets"):
        assert heading in text, heading
    assert text.count("PASS") + text.count("FAIL") >= len(doc["targets"])
    pytest.importorskip("matplotlib")
    from kvtier.bench.report import plot

    out = tmp_path / "plot.png"
    plot(doc, str(out))
    assert out.stat().st_size > 0


def test_plot_without_matplotlib_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli_main(["bench", "--tiny", "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'kvtier[plot]'" in capsys.readouterr().err


@pytest.mark.parametrize("method", sorted(RAW_METHODS))
@pytest.mark.parametrize("src_layout", ["layer_first", "page_first", "per_layer"])
@pytest.mark.parametrize("dst_layout", ["layer_first", "page_first", "per_layer"])
@pytest.mark.parametrize("pattern", ["contiguous", "scattered_src", "scattered_dst", "scattered_both"])
def test_raw_methods_copy_exactly_the_rows(method: str, src_layout: str, dst_layout: str, pattern: str) -> None:
    gen = torch.Generator().manual_seed(1)
    layers, slots, rows = 3, 24, 8

    def side(layout: str, fill: bool) -> Side:
        def make(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.randn(shape, generator=gen) if fill else torch.zeros(shape)

        if layout == "per_layer":
            return Side.per_layer(tuple(tuple(make((slots, 2, 4)) for _ in range(layers)) for _ in range(2)))
        shape = (layers, slots, 2, 4) if layout == "layer_first" else (slots, layers, 2, 4)
        return Side(tuple(make(shape) for _ in range(2)), layout)

    src, dst = side(src_layout, True), side(dst_layout, False)
    scattered = torch.randperm(slots, generator=gen)[:rows]
    src_idx = scattered if pattern in ("scattered_src", "scattered_both") else torch.arange(4, 4 + rows)
    dst_idx = (torch.randperm(slots, generator=gen)[:rows] if pattern in ("scattered_dst", "scattered_both")
               else torch.arange(2, 2 + rows))
    copy = RowCopy(src, dst, src_idx, dst_idx)
    if method not in raw_methods_for(copy):
        pytest.skip(f"{method} does not apply from {src_layout} to {dst_layout}")
    copy.prepare()
    RAW_METHODS[method](copy)
    for p in range(2):
        for layer in range(layers):
            s, d = src.layer(p, layer), dst.layer(p, layer)
            assert torch.equal(d[dst_idx], s[src_idx])
            untouched = torch.ones(slots, dtype=torch.bool)
            untouched[dst_idx] = False
            assert not d[untouched].any()


def test_index_runs_and_ceiling() -> None:
    src = torch.tensor([4, 5, 6, 9, 10, 2])
    dst = torch.tensor([0, 1, 2, 3, 5, 6])
    assert index_runs(src, dst) == [(4, 0, 3), (9, 3, 1), (10, 5, 1), (2, 6, 1)]
    c = Ceiling(1024)
    c()
    assert c.nbytes == 1024


def test_fit_shape_scales_layers_then_heads_then_head_dim() -> None:
    assert fit_shape(1, 1 << 30).label == "32x8x128 bf16"
    assert fit_shape(2000, 32 << 20).label == "4x8x128 bf16"
    assert fit_shape(32_000, 32 << 20).label == "1x2x128 bf16"
    assert fit_shape(128_000, 32 << 20).label == "1x1x64 bf16"


def test_many_ops_run_at_the_realistic_shape_where_they_fit() -> None:
    # Full: 10,000 one-page operations of 128 KiB (1.22 GiB per side) fit; pages of 16 and 64 do not.
    assert many_ops_shapes(MODES["full"]) == ([(1, REALISTIC)], [16, 64])
    assert many_ops_shapes(MODES["quick"]) == ([(1, REALISTIC)], [16, 64])
    kept, left_out = many_ops_shapes(MODES["tiny"])
    assert [ps for ps, _ in kept] == [1] and left_out == [16]


@pytest.mark.parametrize("device", ["stacked", "per_layer"])
def test_bench_pools_expose_a_stacked_view_only_for_stacked_devices(device: str) -> None:
    pools = build_pools(fit_shape(1, 1 << 16), 1, "page_first", device_slots=8, host_slots=4, device=device)
    dev = pools.group["kv"].device
    assert dev is not None
    assert (dev.stacked(0) is not None) == (device == "stacked") == pools.device.stacked
    for j in range(dev.num_layers):
        for p in range(2):
            assert dev.tensor(j, p) is pools.group["kv"].device.tensor(j, p)
            assert pools.device.layer(p, j).data_ptr() == dev.tensor(j, p).data_ptr()


# -- the storage section ----------------------------------------------------------

STORAGE_VARIANTS = {"raw", "raw+copy", "store", "scheduler"}
STORAGE_RATIOS = {"raw_copy_vs_raw", "store_vs_raw", "scheduler_vs_raw", "scheduler_vs_raw_copy", "scheduler_vs_store"}


def _redis_missing() -> str | None:
    from kvtier.bench.storage import redis_unavailable

    return redis_unavailable(None)


def _check_storage_part(part: dict, reps: int, where: str) -> None:
    assert part["skipped"] is None, where
    assert part["verified"] is True, where
    for phase in ("write", "read"):
        assert set(part[phase]["variants"]) == STORAGE_VARIANTS, where
        for name, v in part[phase]["variants"].items():
            assert len(v["seconds"]) == reps, f"{where} {phase} {name}"
            for key in ("median_s", "gbps_median", "gbps_min", "gbps_max"):
                _positive(v[key], f"{where} {phase} {name} {key}")
        assert set(part[phase]["ratios"]) == STORAGE_RATIOS, where
        for key, ratio in part[phase]["ratios"].items():
            for bound in ("median", "paired_min", "paired_max"):
                _positive(ratio[bound], f"{where} {phase} {key} {bound}")
    assert set(part["loop_lag"]) == STORAGE_VARIANTS, where
    assert part["scheduler_batches"]["write"] >= reps and part["scheduler_batches"]["read"] >= reps, where


def test_storage_section(doc: dict) -> None:
    st = doc["storage"]
    s = doc["meta"]["settings"]
    assert st["skipped"] is None
    setup = st["setup"]
    assert setup["pages"] == s["storage_pages"] and setup["reps"] == s["reps"]
    assert set(setup["blob_nbytes"]) == {"kv", "c4"}
    assert setup["page_nbytes"] == sum(setup["blob_nbytes"].values())
    assert setup["nbytes"] == setup["pages"] * setup["page_nbytes"]
    _positive(st["seconds"], "storage.seconds")
    _check_storage_part(st["file"], s["reps"], "file")
    missing = _redis_missing()
    if missing is not None:
        assert st["redis"] == {"skipped": missing}
    else:
        _check_storage_part(st["redis"], s["reps"], "redis")
        assert st["redis"]["server"].endswith("a throwaway local redis-server")
    # Storage runs stay out of the issue-5 lag figures.
    assert not any(label.startswith("storage:") for label in doc["loop_lag"]["by_run"])
    from kvtier.bench.report import format_report

    text = format_report(doc)
    assert "Storage tier:" in text and "write GB/s" in text
    if missing is not None:
        assert f"redis: skipped: {missing}" in text


async def _run_storage(settings, redis_url: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    """The storage section alone, on the test's loop: with the blocking-call
    detector on, so the bench and kvtier's storage path never block the loop."""
    import asyncio

    import anyio.to_thread

    from kvtier.bench.core import LoopLagMonitor
    from kvtier.bench.storage import run_storage

    monitor = LoopLagMonitor(asyncio.get_running_loop(), settings.ticker_interval_s)
    monitor.start()
    try:
        return await run_storage(settings, monitor, redis_url=redis_url)
    finally:
        await anyio.to_thread.run_sync(monitor.close)


async def test_storage_skips_redis_without_a_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from dataclasses import replace

    monkeypatch.setenv("KVTIER_REDIS_SERVER", str(tmp_path / "no-redis-server"))
    settings = MODES["tiny"]
    st = await _run_storage(settings)
    assert st["skipped"] is None
    assert st["redis"]["skipped"].startswith("redis-server not found")
    _check_storage_part(st["file"], settings.reps, "file")
    # An unreachable --redis-url: skipped too, and the bench goes on.
    st = await _run_storage(replace(settings, storage_backends=("redis",)), redis_url="redis://127.0.0.1:1/0")
    assert "does not answer" in st["redis"]["skipped"]
    assert "file" not in st
    assert await _run_storage(replace(settings, storage=False)) == {"skipped": "--no-storage"}


def test_storage_skips_redis_without_redis_py(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from kvtier.bench.storage import redis_unavailable

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "redis" else real(name, *a))
    assert redis_unavailable("redis://127.0.0.1:6379/0") == "redis-py is not installed (pip install 'kvtier[redis]')"


async def test_storage_against_a_redis_url(tmp_path: Path) -> None:
    from dataclasses import replace

    import anyio.to_thread

    missing = await anyio.to_thread.run_sync(_redis_missing)
    if missing is not None:
        pytest.skip(missing)
    from kvtier.testing.redis_server import LocalRedisServer

    settings = replace(MODES["tiny"], storage_backends=("redis",))
    server = LocalRedisServer(tmp_path / "redis")
    await anyio.to_thread.run_sync(server.start)
    try:
        st = await _run_storage(settings, redis_url=server.url)
        # Every key of the run was deleted.
        assert (await anyio.to_thread.run_sync(server.command, "DBSIZE")).strip() == b":0"
    finally:
        await anyio.to_thread.run_sync(server.stop)
    _check_storage_part(st["redis"], settings.reps, "redis")
    assert st["redis"]["server"].endswith("--redis-url")


def test_heap_frozen_after_set_up_by_default(doc: dict) -> None:
    from kvtier.bench.core import parse_args
    from kvtier.bench.report import format_report

    assert parse_args([]).gc_freeze is True and parse_args(["--gc-freeze"]).gc_freeze is True
    assert parse_args(["--no-gc-freeze"]).gc_freeze is False
    lag = doc["loop_lag"]
    # torch and kvtier imported: far more than a handful of objects were frozen before the first section
    assert lag["gc_frozen"] is True and lag["gc_frozen_objects"] > 10_000
    gc_target = next(t for t in doc["targets"] if t["key"] == "gc_pause")
    assert f"heap frozen after set-up ({lag['gc_frozen_objects']:,} objects)" in gc_target["detail"]
    assert "heap frozen after set-up with gc.freeze(), as engines run" in format_report(doc)
    scaling = next(t for t in doc["targets"] if t["key"] == "scaling_gc_pause")
    assert "; heap frozen after set-up (unfrozen, the single path's" in scaling["detail"]


def test_scaling_unfrozen_run_has_a_frozen_row() -> None:
    """--no-gc-freeze: the scaling table's extra run is the frozen one, and the heap is left unfrozen.
    (On a loop of its own, as the CLI runs it: the section reads /proc as a benchmark may.)"""
    import asyncio
    import gc
    from dataclasses import replace

    from kvtier.bench.core import Bench, LoopLagMonitor
    from kvtier.bench.report import _scaling_block

    settings = replace(MODES["tiny"], gc_freeze=False, scaling_counts=(16, 32, 64), scaling_freeze_count=16)

    async def scaling() -> dict:
        monitor = LoopLagMonitor(asyncio.get_running_loop(), settings.ticker_interval_s)
        monitor.start()
        try:
            return await Bench(settings, monitor, lambda _: None).scaling()
        finally:
            monitor.close()

    sc = asyncio.run(scaling())
    assert sc["gc_frozen"] is False and sc["gc_unfrozen_run"] is None
    frozen = sc["gc_frozen_run"]
    assert frozen["operations"] == 16 and frozen["unfrozen"] == "scaling:single:16"
    assert gc.get_freeze_count() == 0  # the heap was thawed again after the frozen run
    assert any(line.startswith("  frozen: the same 16 single operations") for line in _scaling_block(sc))


def test_engine_thread_bounds_of_issue_45(doc: dict) -> None:
    targets = {t["key"]: t for t in doc["targets"]}
    assert targets["longest_callback"]["bound"] == 0.5
    assert targets["loop_cpu_bulk"]["bound"] == 2.0
    assert (targets["busy_lone"]["bound"], targets["busy_bulk"]["bound"]) == (2.0, 10.0)
    # A lone operation is held to the lean scheduler's lone backup copying in a thread, measured in the same run.
    lone = targets["lone_loop_cpu"]
    assert lone["bound"] == doc["loop"]["lean"]["lone_copying_loop_cpu_us"]["median"]
    assert lone["passed"] == (lone["value"] <= lone["bound"])
    kv = doc["callbacks"]["during_kvtier"]["owners"]["kvtier"]
    if kv is not None:
        assert 0 <= kv["over_1ms"] <= kv["over_half_ms"]
        assert 0 <= kv["longest_cpu_ms"] <= kv["longest_by_cpu"]["cpu_ms"]
        assert f"its loop-thread CPU {kv['longest_cpu_ms']:.2f} ms" in targets["longest_callback"]["detail"]


def test_the_longest_collection_carries_its_threads_cpu(doc: dict) -> None:
    from kvtier.bench.measures import longest_collection

    runs = {"a": [(0, 0.001), (2, 0.020)], "b": [(1, 0.005)]}
    cpu = {"a": [0.0009, 0.004], "b": [0.005]}
    assert longest_collection(runs, cpu) == {"ms": 20.0, "generation": 2, "label": "a", "cpu_ms": 4.0}
    assert "cpu_ms" not in longest_collection(runs)  # type: ignore[operator]
    gl = doc["loop_lag"]["gc_longest"]
    if gl is not None:
        assert 0 <= gl["cpu_ms"]
        gc_target = next(t for t in doc["targets"] if t["key"] == "gc_pause")
        assert f"(its thread's CPU {gl['cpu_ms']:.2f} ms)" in gc_target["detail"]


def test_callback_stats_keep_the_longest_by_wall_and_by_loop_cpu() -> None:
    from kvtier.bench.measures import CallbackStats, callback_summary

    async def preempted() -> None: ...
    async def busy() -> None: ...

    stats = CallbackStats()
    stats.note(preempted, 2e-3, 0.0, 0.3e-3)  # long on the wall clock, little of it the loop's own CPU
    stats.note(busy, 0.8e-3, 0.1e-3, 0.75e-3)  # shorter, nearly all CPU (a collection of 0.1 ms inside)
    kv = next(x for x in callback_summary({"run": stats})["owners"].values() if x is not None)
    assert kv["name"].startswith("test_callback_stats_keep_the_longest_by_wall_and_by_loop_cpu.<locals>.preempted")
    assert kv["longest_ms"] == pytest.approx(2.0) and kv["longest_cpu_ms"] == pytest.approx(0.3)
    by_cpu = kv["longest_by_cpu"]
    assert by_cpu["name"].startswith("test_callback_stats_keep_the_longest_by_wall_and_by_loop_cpu.<locals>.busy")
    assert by_cpu["cpu_ms"] == pytest.approx(0.65) and by_cpu["wall_ms"] == pytest.approx(0.7)
    assert (kv["over_half_ms"], kv["over_1ms"]) == (2, 1)


def test_no_storage_and_redis_url_flags() -> None:
    from kvtier.bench.core import parse_args

    args = parse_args(["--no-storage", "--redis-url", "redis://127.0.0.1:6379/0"])
    assert args.no_storage and args.redis_url == "redis://127.0.0.1:6379/0"
    assert not parse_args([]).no_storage and parse_args([]).redis_url is None


def test_storage_block_when_skipped(doc: dict) -> None:
    from kvtier.bench.report import format_report

    text = format_report(doc | {"storage": {"skipped": "--no-storage"}})
    assert "Storage tier: skipped: --no-storage" in text
    old = {k: v for k, v in doc.items() if k != "storage"}  # a document from before the section
    assert "Storage tier" not in format_report(old)


def test_report_of_a_document_from_before_the_bulk_path(doc: dict) -> None:
    from kvtier.bench.report import format_report

    o = doc["overhead"]
    old = {k: v for k, v in doc.items() if k not in ("scaling", "callbacks")}
    old["overhead"] = {k: v for k, v in o.items() if k not in ("us_per_op", "cpu_minus_raw_us_per_op", "raw",
                                                                "batches_per_run", "max_requests_per_bulk_call")}
    old["overhead"]["max_requests_per_bulk_call"] = 0
    text = format_report(old)
    assert "Scheduler overhead" in text and "Scaling:" not in text and "Event-loop callbacks" not in text


def test_describe_callback_names_the_owner() -> None:
    import asyncio
    from functools import partial

    from kvtier.bench import core
    from kvtier.scheduler import lanes

    assert core.describe_callback(core.trim_heap) == ("bench", "trim_heap (kvtier/bench/core.py)")
    owner, name = core.describe_callback(partial(lanes.Lane.__init__))
    assert owner == "kvtier" and name.startswith("Lane.__init__ (kvtier/scheduler/lanes.py")
    assert core.describe_callback(print) == ("other", "print")
    assert core.describe_callback(lambda: None)[0] == "other"

    async def run() -> tuple[tuple[str, str], tuple[str, str]]:
        tasks: list[asyncio.Task[object]] = []

        async def body() -> None:
            tasks.append(asyncio.current_task())  # type: ignore[arg-type]
            await asyncio.sleep(0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(body)
            await asyncio.sleep(0)  # the task's first step ran; it waits in sleep(0)
            # A task step is one of the task's bound methods: named after the
            # task's first coroutine below anyio's wrapper.
            step = core.describe_callback(tasks[0].cancel)
        return step, core.describe_callback(tasks[0].cancel)

    step, finished = asyncio.run(run())
    assert step[0] == "other" and "body" in step[1] and "test_bench.py" in step[1]
    assert finished[0] == "other" and finished[1].endswith("body (its last step)")


def test_allocator_costs_compare_pool_sizes() -> None:
    from kvtier.bench.core import allocator_costs

    out = allocator_costs((64, 4096), 32, 2)
    assert [r["pool_pages"] for r in out["rows"]] == [64, 4096] and out["operations"] == 32
    assert all(r[f"{k}_ns_per_page"] > 0 for r in out["rows"]
               for k in ("alloc_one", "free_one", "alloc_bulk", "free_bulk"))
    with pytest.raises(ValueError, match="65 pages do not fit the smallest pool, of 64 pages"):
        allocator_costs((64, 4096), 65, 1)


def test_torch_calls_is_a_lower_bound_per_method() -> None:
    from kvtier.bench.core import torch_calls

    pools = build_pools(fit_shape(1, 1 << 16), 1, "page_first", device_slots=16, host_slots=8, device="per_layer")
    copy = RowCopy(pools.device, pools.host_side, torch.tensor([0, 2, 4, 6]), torch.arange(4))
    layers, planes = pools.device.num_layers, 2
    assert len(copy.runs) == 4
    assert torch_calls("slices", copy) == 3 * 4 * layers * planes
    assert torch_calls("stack_all_layers", copy) == 4 * planes * (layers + 1)
    assert torch_calls("index_per_layer", copy) == 2 * layers * planes
    assert torch_calls("gather_all_layers", copy) == 2 * planes


def test_check_exits_1_naming_the_missed_targets_and_0_when_all_pass(
    doc: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """`bench --check` over the tiny run's own figures, with its targets set to pass or fail."""
    import copy

    import kvtier.bench.core as core

    def run_with(passed: list[bool]) -> tuple[int, str]:
        canned = copy.deepcopy(doc)
        for target, ok in zip(canned["targets"], passed, strict=True):
            target["passed"] = ok

        async def run_bench(*args: object, **kwargs: object) -> dict:
            return canned

        monkeypatch.setattr(core, "run_bench", run_bench)
        rc = cli_main(["bench", "--tiny", "--quiet", "--check"])
        return rc, capsys.readouterr().err

    n = len(doc["targets"])
    assert run_with([True] * n) == (0, "")
    rc, err = run_with([False] + [True] * (n - 1))
    first = doc["targets"][0]["key"]
    assert rc == 1 and err == f"kvtier bench --check: 1 of {n} targets missed: {first}\n"
    # Without --check a miss is reported and the exit status stays 0.
    monkeypatch.setattr(core, "run_bench", lambda *a, **k: _canned(doc))
    assert cli_main(["bench", "--tiny", "--quiet"]) == 0


async def _canned(doc: dict) -> dict:
    return {**doc, "targets": [{**t, "passed": False} for t in doc["targets"]]}


def test_no_column_claims_a_ceiling_that_the_raw_copy_beats(doc: dict) -> None:
    """The contiguous copy_ of the same bytes is a reference, not a bound: runs
    that fit the cache copy tensors the previous runs left there, and the raw
    best then beats it (seen up to 3.17x). A row where it does must not sit
    under a column that calls it a ceiling."""
    from kvtier.bench.report import format_report

    d = copy.deepcopy(doc)
    row = d["throughput"][0]
    best = row["variants"][f"raw:{row['raw_best_method']}"]
    row["variants"]["ceiling"] = {**best, **{k: best[k] / 3 for k in ("gbps_median", "gbps_min", "gbps_max")}}
    text = format_report(d)
    headers = [line for line in text.splitlines() if line.startswith("dir ")]
    assert len(headers) == 2, headers  # one operation, many operations
    for head in headers:
        assert "ceiling" not in head.lower(), head
        titles = re.split(r"\s{2,}", head.strip())
        assert "contiguous GB/s" in titles, titles
        assert titles[-2:] == ["raw/contig", "kvtier method"], titles
    assert "not a bound" in text


def test_table_headers_keep_two_spaces_between_columns(doc: dict) -> None:
    """Every column title stands apart: "operations us/op" read as one column."""
    from kvtier.bench.report import format_report

    lines = format_report(doc).splitlines()
    one, many = (line for line in lines if line.startswith("dir "))
    assert re.split(r"\s{2,}", one.strip()) == [
        "dir", "device", "layout", "page", "pattern", "contiguous GB/s", "raw best GB/s", "raw method",
        "kvtier 1 op GB/s", "kvtier/raw", "in worker/raw", "raw/contig", "kvtier method"]
    assert re.split(r"\s{2,}", many.strip()) == [
        "dir", "device", "layout", "page", "pattern", "shape", "KiB/op", "contiguous GB/s", "raw best GB/s",
        "raw method", "kvtier 1 op GB/s", "N single ops GB/s", "batches", "single/raw", "in worker/raw",
        "N bulk ops GB/s", "batches", "bulk/raw", "N array ops GB/s", "arrays/raw", "raw/contig", "kvtier method"]
    scaling = next(line for line in lines if line.strip().startswith("path ") and "RSS B/op" in line)
    assert re.split(r"\s{2,}", scaling.strip()) == [
        "path", "queued", "us/op", "submit us/op", "RSS B/op", "batches", "collections", "gen 2 (longest ms)",
        "longest kvtier callback ms"]


@pytest.mark.parametrize("case", ["closed", "not-a-url", "no-storage"])
def test_an_unusable_redis_url_is_refused_before_the_bench_runs(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 and one line naming the URL and why, before any scenario runs (it
    used to run the whole bench, 66-70 s, and exit 0 with the Redis part skipped)."""
    import socket

    from kvtier.bench.core import main

    pytest.importorskip("redis")
    with socket.socket() as s:  # a loopback port nothing listens on (bound, then released)
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    args = ["--tiny", "--quiet", "--redis-url", "not-a-url" if case == "not-a-url" else url]
    if case == "no-storage":
        args.append("--no-storage")
    assert main(args) == 2
    out = capsys.readouterr()
    assert out.out == ""  # no scenario ran, no report
    (line,) = out.err.splitlines()
    assert line.startswith(f"kvtier bench: --redis-url {args[3]} cannot be used: "), line
    if case == "no-storage":
        assert line.endswith("--no-storage leaves out the storage section it is for")
