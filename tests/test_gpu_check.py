"""The device check itself (benchmarks/gpu_check.sh, gpu_check.py, gpu_check_summary.py), on CPU.

A check that breaks on first contact with the GPU machine wastes its device
time, so its failure paths are tested here: no CUDA, a stage that timed out,
a signal mid-run, and the benchmark's own logic through its CPU smoke mode.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the check runs for real")


def load(name: str) -> ModuleType:
    qualified = f"benchmarks_{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    spec = importlib.util.spec_from_file_location(qualified, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def write_stages(out: Path, *lines: tuple[str, int, int, str]) -> None:
    out.mkdir(exist_ok=True)
    (out / "stages.tsv").write_text("".join(f"{n}\t{rc}\t{s}\t{log}\t\n" for n, rc, s, log in lines))
    (out / "env.json").write_text(json.dumps({"cuda_available": True, "torch": "2.11.0"}))


def test_summary_says_which_stage_timed_out(tmp_path: Path) -> None:
    summary = load("gpu_check_summary")
    write_stages(tmp_path, ("install", 0, 2, "install.log"), ("probe", 0, 4, "probe.log"),
                 ("tests", 124, 100, "tests.log"), ("bench", 0, 150, "bench.log"))
    doc = summary.summarize(tmp_path, "done", 260)
    assert (doc["ok"], doc["status"], doc["failed"]) == (False, "failed", ["tests"])
    assert doc["error"] == "stage 'tests' timed out after 100 s (see tests.log)"
    assert doc["stages"]["tests"]["timed_out"] and not doc["stages"]["bench"]["timed_out"]


def test_summary_carries_the_end_of_a_failed_stages_log(tmp_path: Path) -> None:
    summary = load("gpu_check_summary")
    write_stages(tmp_path, ("install", 0, 2, "install.log"), ("probe", 0, 4, "probe.log"),
                 ("tests", 4, 3, "tests.log"), ("bench", 0, 9, "bench.log"))
    (tmp_path / "tests.log").write_text("x" * 5000 + "ImportError while loading conftest")
    (tmp_path / "bench.log").write_text("fine")
    doc = summary.summarize(tmp_path, "done", 20)
    tail = doc["stages"]["tests"]["log_tail"]
    assert len(tail) == 2000 and tail.endswith("ImportError while loading conftest")
    assert "log_tail" not in doc["stages"]["bench"]
    assert doc["error"] == "stage 'tests' exited 4 (see tests.log)"


def test_summary_of_a_check_still_running_names_the_stage_it_is_in(tmp_path: Path) -> None:
    summary = load("gpu_check_summary")
    write_stages(tmp_path, ("install", 0, 2, "install.log"), ("probe", 0, 4, "probe.log"))
    (tmp_path / "current_stage").write_text("tests\t6\n")
    doc = summary.summarize(tmp_path, "running", 30)
    assert (doc["ok"], doc["status"]) == (False, "running")
    assert doc["error"] == "stage 'tests' started at 6 s and had not finished when this was written"


def test_summary_reads_failures_from_the_junit_report(tmp_path: Path) -> None:
    summary = load("gpu_check_summary")
    write_stages(tmp_path, ("install", 0, 2, "i"), ("probe", 0, 4, "p"), ("tests", 1, 9, "t"), ("bench", 0, 9, "b"))
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu" name="test_a"/>'
        '<testcase classname="tests.test_gpu" name="test_b"><failure message="assert False">trace</failure></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c"><skipped message="no"/></testcase>'
        "</testsuite></testsuites>"
    )
    doc = summary.summarize(tmp_path, "done", 20)
    t = doc["tests"]
    assert (t["passed"], t["failed"], t["skipped"], t["errors"]) == (1, 1, 1, 0)
    assert t["failures"] == [{"test": "tests.test_gpu::test_b", "kind": "failure", "message": "assert False\ntrace"}]
    assert doc["failed"] == ["tests"] and not doc["ok"]


def test_the_wheel_check_refuses_platform_wheels(tmp_path: Path) -> None:
    summary = load("gpu_check_summary")
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"x" * 10)
    assert summary.check_wheels(tmp_path) == 0
    (tmp_path / "b-1.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"x")
    assert summary.check_wheels(tmp_path) == 1


def test_benchmark_pages_are_disjoint_and_whole() -> None:
    bench = load("gpu_check")
    src, dst = bench.disjoint_pages(64, 32, 16, seed=1)
    assert len(src) == len(dst) == 32 * 16
    assert not set(src.tolist()) & set(dst.tolist())
    assert all(int(p[0]) % 16 == 0 and torch.equal(p, torch.arange(int(p[0]), int(p[0]) + 16))
               for p in src.view(-1, 16))
    with pytest.raises(ValueError, match="need 2 \\* 33 disjoint pages; the pool has 64"):
        bench.disjoint_pages(64, 33, 16, seed=1)


def run_check(out: Path, **env: str) -> subprocess.Popen[bytes]:
    empty = out.parent / "no-wheels"
    empty.mkdir(exist_ok=True)
    full_env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(empty), **env}
    return subprocess.Popen(["bash", str(SCRIPT), str(out)], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_the_check_without_cuda_writes_a_document_saying_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_check(out)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    doc = json.loads((out / "gpu_check.json").read_text())
    assert json.loads(stdout) == doc  # what it prints is the document
    assert doc["ok"] is False and doc["status"] == "failed"
    assert doc["failed"][0] == "cuda" and "install" in doc["failed"]  # no wheels carried either
    assert doc["error"].startswith("CUDA is not available on this machine")
    assert doc["env"]["cuda_available"] is False
    assert "no wheels in" in (out / "install.log").read_text()


def test_a_signal_mid_run_leaves_a_document_naming_the_stage(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_check(out, GPU_CHECK_DEVICE="cpu")
    try:
        deadline = time.monotonic() + 90
        while not (out / "current_stage").exists() or "tests" not in (out / "current_stage").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "the check never reached its tests"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143
    doc = json.loads((out / "gpu_check.json").read_text())
    assert (doc["ok"], doc["status"]) == (False, "interrupted")
    assert doc["failed"][:1] == ["tests"] and "interrupted" in doc["failed"]
    assert doc["error"].startswith("stage 'tests' started at")


def test_the_benchmark_smoke_run_on_cpu_measures_every_case_byte_exactly(tmp_path: Path) -> None:
    target = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--json", str(target)], capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    doc = json.loads(proc.stdout)  # stdout is the JSON and nothing else
    assert doc == json.loads(target.read_text())
    assert (doc["status"], doc["errors"], doc["skipped"]) == ("ok", [], [])
    cases = doc["kvtier"]
    assert {(c["layout"], c["page_size"], c["device_tensors"]) for c in cases} == {
        (lay, p, k) for lay in ("layer_first", "page_first") for p in (1, 16, 64) for k in ("per_layer", "stacked")
    }
    assert all(c["bytes_match"] for c in cases)
    assert all(c[op]["vs_raw_large"] > 0 and c[op]["vs_raw_same_copy_size"] > 0 for c in cases for op in ("backup", "load"))
    assert [r["copy_bytes"] for r in doc["raw"]["chunked"]] == [2 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20]
    assert doc["load_under_backup_burst"]["idle_ms"]["n"] == 20
    assert doc["loop"]["ticks"] > 0
    assert doc["summary"]["bytes_match_all"] is True and doc["summary"]["cases_ok"] == 12
    # The bulk path next to the single one, backups and loads, every load path byte-exact.
    many = doc["many_ops"]
    assert {(c["layout"], c["device_tensors"]) for c in many} == {
        (lay, k) for lay in ("layer_first", "page_first") for k in ("per_layer", "stacked")
    }
    for c in many:
        assert c["bytes_match"] == {"one": True, "single": True, "bulk": True}
        for op in ("backup", "load"):
            assert set(c[op]) == {"one", "single", "bulk"}
            assert all(c[op][p]["us_per_op"] > 0 and c[op][p]["vs_raw_large"] > 0 for p in c[op])
            assert c[op]["one"]["vs_one_op"] == 1.0
    assert doc["summary"]["many_ops_bytes_match_all"] is True
    # The scaling table: three counts, both paths.
    scaling = doc["scaling"]
    assert [(r["path"], r["operations"]) for r in scaling["rows"]] == [
        (p, n) for n in (64, 128, 256) for p in ("single", "bulk")]
    assert all(r["us_per_op"] > 0 and r["batches"] >= 1 for r in scaling["rows"])
    assert set(scaling["max_over_min"]) == {"single", "bulk"} and all(v >= 1 for v in scaling["max_over_min"].values())
    assert len(doc["summary"]["scaling_us_per_op"]) == 6
    # Every callback of the timed runs was timed; the loop is left as it was.
    assert doc["callbacks"]["callbacks"] > 0 and set(doc["callbacks"]["owners"]) == {"kvtier", "bench", "other"}
    assert set(doc["gc"]) >= {"gen0", "gen1", "gen2", "over_10ms", "longest"}
