"""The device check itself (benchmarks/gpu_check.sh, gpu_check.py, gpu_check_summary.py), on CPU.

A check that breaks on first contact with the GPU machine wastes its device
time, so its failure paths are tested here: no CUDA, a stage that timed out,
a signal mid-run, byte mismatches, deadline skips, skipped tests, and the whole
pipeline through its CPU smoke mode, once as it is and once with a planted
byte fault that the verdict must name in every case.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import tarfile
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
    """stages.tsv and env.json, and a clean benchmark document (tests that
    want another write their own)."""
    out.mkdir(exist_ok=True)
    (out / "stages.tsv").write_text("".join(f"{n}\t{rc}\t{s}\t{log}\t\n" for n, rc, s, log in lines))
    (out / "env.json").write_text(json.dumps({"cuda_available": True, "torch": "2.11.0"}))
    (out / "bench.json").write_text(json.dumps(bench_doc()))


def test_summary_says_which_stage_timed_out(tmp_path: Path) -> None:
    summary = load("gpu_check_summary")
    write_stages(tmp_path, ("install", 0, 2, "install.log"), ("probe", 0, 4, "probe.log"),
                 ("tests", 124, 100, "tests.log"), ("bench", 0, 150, "bench.log"))
    doc = summary.summarize(tmp_path, "done", 260)
    assert (doc["ok"], doc["status"], doc["failed"]) == (False, "failed", ["tests"])
    assert doc["error"] == "stage 'tests' timed out after 100 s (see tests.log)"
    assert doc["reasons"][1:] == ["tests: no JUnit report (tests.xml) was written"]
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


def test_the_wheel_check_takes_pure_wheels_and_the_gpu_machines_own_and_refuses_other_platforms(
    tmp_path: Path,
) -> None:
    summary = load("gpu_check_summary")
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"x" * 10)
    assert summary.check_wheels(tmp_path) == 0
    # xxhash's wheel for the GPU machine's CPython 3.12 on x86-64 travels too.
    (tmp_path / "xxhash-4.1.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl").write_bytes(b"x")
    assert summary.check_wheels(tmp_path) == 0
    for other in ("b-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", "c-1.0-cp312-cp312-manylinux_2_17_aarch64.whl",
                  "d-1.0-cp312-cp312-macosx_11_0_arm64.whl"):
        (tmp_path / other).write_bytes(b"x")
        assert summary.check_wheels(tmp_path) == 1, other
        (tmp_path / other).unlink()


def test_the_carried_wheel_list_brings_every_runtime_dependency_of_kvtier() -> None:
    """What kvtier imports at run time (pyproject's dependencies, less what
    the GPU machine has of its own) is in the list the GPU check carries."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].strip().lower().replace("_", "-") for d in deps}
    carried = {line.split("==")[0].strip().lower().replace("_", "-")
               for line in (root / "benchmarks" / "gpu_wheels.txt").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    # The GPU machine has its own torch (a CUDA build) and numpy (issue 22's inventory of it).
    theirs = {"torch", "numpy"}
    assert names - theirs <= carried, names - theirs - carried


def test_benchmark_pages_are_disjoint_and_whole() -> None:
    bench = load("gpu_check")
    src, dst = bench.disjoint_pages(64, 32, 16, seed=1)
    assert len(src) == len(dst) == 32 * 16
    assert not set(src.tolist()) & set(dst.tolist())
    assert all(int(p[0]) % 16 == 0 and torch.equal(p, torch.arange(int(p[0]), int(p[0]) + 16))
               for p in src.view(-1, 16))
    with pytest.raises(ValueError, match="need 2 \\* 33 disjoint pages; the pool has 64"):
        bench.disjoint_pages(64, 33, 16, seed=1)


def passing_stages(out: Path) -> None:
    write_stages(out, ("install", 0, 2, "install.log"), ("probe", 0, 4, "probe.log"), ("tests", 0, 30, "tests.log"),
                 ("bench", 0, 150, "bench.log"))


def junit(out: Path, *cases: str) -> None:
    """tests.xml with one test case per item: 'pass', 'skip' or 'fail'."""
    body = {"pass": "", "skip": '<skipped message="no"/>', "fail": '<failure message="boom">trace</failure>'}
    (out / "tests.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        + "".join(f'<testcase classname="tests.test_gpu" name="test_{i}">{body[c]}</testcase>'
                  for i, c in enumerate(cases))
        + "</testsuite></testsuites>")


def bench_doc(**extra: object) -> dict[str, object]:
    return {"status": "ok", "errors": [], "skipped": [], "problems": [], "plant": None,
            "checks": {"checks": 8, "passed": 8, "failed": [], "failed_cases": []}, **extra}


def test_summary_passes_only_a_complete_clean_run(tmp_path: Path) -> None:
    summary = load("gpu_check_summary")
    passing_stages(tmp_path)
    junit(tmp_path, "pass", "pass", "skip")
    (tmp_path / "bench.json").write_text(json.dumps(bench_doc()))
    doc = summary.summarize(tmp_path, "done", 200)
    assert (doc["ok"], doc["status"], doc["failed"], doc["reasons"]) == (True, "passed", [], [])


def test_summary_fails_on_byte_mismatches_naming_the_cases(tmp_path: Path) -> None:
    summary = load("gpu_check_summary")
    passing_stages(tmp_path)
    write_stages(tmp_path, ("install", 0, 2, "i"), ("probe", 0, 4, "p"), ("tests", 0, 9, "t"), ("bench", 1, 9, "b"))
    junit(tmp_path, "pass")
    problem = "bytes: 2 of 8 checks failed in 2 cases: layer_first/p16/stacked, many_ops/page_first/per_layer"
    (tmp_path / "bench.json").write_text(json.dumps(bench_doc(status="failed", problems=[problem])))
    doc = summary.summarize(tmp_path, "done", 200)
    assert (doc["ok"], doc["status"], doc["failed"]) == (False, "failed", ["bytes"])
    assert doc["reasons"] == [f"bench {problem}"]  # the specific reason, not "stage 'bench' exited 1"


def test_summary_fails_on_a_deadline_skip_and_on_bench_errors(tmp_path: Path) -> None:
    summary = load("gpu_check_summary")
    passing_stages(tmp_path)
    junit(tmp_path, "pass")
    problems = ["deadline: skipped scaling", "errors in: many_ops/page_first/stacked"]
    (tmp_path / "bench.json").write_text(json.dumps(bench_doc(status="failed", problems=problems)))
    doc = summary.summarize(tmp_path, "done", 280)
    assert doc["failed"] == ["deadline", "bench"]
    assert doc["reasons"] == ["bench deadline: skipped scaling", "bench errors in: many_ops/page_first/stacked"]


def test_summary_fails_when_every_gpu_test_skipped_or_none_ran(tmp_path: Path) -> None:
    summary = load("gpu_check_summary")
    passing_stages(tmp_path)
    (tmp_path / "bench.json").write_text(json.dumps(bench_doc()))
    junit(tmp_path, "skip", "skip")
    doc = summary.summarize(tmp_path, "done", 100)
    assert doc["failed"] == ["tests"]
    assert doc["reasons"] == ["tests: all 2 gpu tests skipped (did pytest see the device?)"]
    junit(tmp_path)
    assert summary.summarize(tmp_path, "done", 100)["reasons"] == [
        "tests: no gpu test ran (the JUnit report holds none)"]
    (tmp_path / "tests.xml").unlink()
    assert summary.summarize(tmp_path, "done", 100)["reasons"] == ["tests: no JUnit report (tests.xml) was written"]
    # A smoke run has no device: its gpu tests skip by design.
    junit(tmp_path, "skip", "skip")
    (tmp_path / "smoke.json").write_text("{}")
    assert summary.summarize(tmp_path, "done", 100)["status"] == "smoke-passed"


def test_summary_fails_when_the_benchmark_left_no_or_an_unfinished_document(tmp_path: Path) -> None:
    summary = load("gpu_check_summary")
    passing_stages(tmp_path)
    junit(tmp_path, "pass")
    (tmp_path / "bench.json").unlink()
    assert summary.summarize(tmp_path, "done", 100)["reasons"] == ["bench: no document (bench.json) was written"]
    (tmp_path / "bench.json").write_text(json.dumps(bench_doc(status="running")))
    assert summary.summarize(tmp_path, "done", 100)["reasons"] == [
        "bench: its document was left unfinished (status 'running'): killed mid-run"]


def test_the_verdict_stays_under_2000_characters_whatever_the_reasons(tmp_path: Path) -> None:
    summary = load("gpu_check_summary")
    passing_stages(tmp_path)
    junit(tmp_path, *["fail"] * 40)
    many = [f"errors in: {'x' * 900}"] + [f"bytes: case {i} " + "y" * 200 for i in range(30)]
    (tmp_path / "bench.json").write_text(json.dumps(bench_doc(status="failed", problems=many)))
    doc = summary.summarize(tmp_path, "done", 100)
    assert len(doc["reasons"]) == 32
    text = summary.verdict(doc)
    assert len(text) < 2000
    assert text.startswith("==== kvtier device check: FAILED (not ok) ====")
    assert text.rstrip().endswith("==== end of verdict ====")
    assert " 1. tests: 40 failed" in text and "more in gpu_check.json" in text


def run_check(out: Path, **env: str) -> subprocess.Popen[bytes]:
    empty = out.parent / "no-wheels"
    empty.mkdir(exist_ok=True)
    full_env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(empty), **env}
    return subprocess.Popen(["bash", str(SCRIPT), str(out)], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def verdict_block(stdout: str) -> str:
    """The verdict block, read from the last 2,000 characters only (all that
    may come back of a long output)."""
    tail = stdout[-2000:]
    start = tail.index("==== kvtier device check: ")
    assert tail.rstrip().endswith("==== end of verdict ====")
    return tail[start:]


OUT_FILES = {"gpu_check.json", "tests.log", "tests.xml", "logs.tar.gz"}


def assert_out_comes_back(out: Path, at_least: set[str] = OUT_FILES) -> None:
    """At most 6 plain files, no folders: all of it comes back from a lent machine."""
    entries = list(out.iterdir())
    assert len(entries) <= 6 and all(p.is_file() for p in entries), sorted(p.name for p in entries)
    assert at_least <= {p.name for p in entries} <= OUT_FILES


@pytest.mark.build
def test_the_check_without_cuda_writes_a_document_saying_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_check(out)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    doc = json.loads((out / "gpu_check.json").read_text())
    block = verdict_block(stdout.decode())
    assert block.startswith("==== kvtier device check: FAILED")
    assert doc["ok"] is False and doc["status"] == "failed"
    assert doc["failed"][0] == "cuda" and "install" in doc["failed"]  # no wheels carried either
    assert doc["error"].startswith("CUDA is not available on this machine")
    assert " 1. CUDA is not available on this machine" in block
    assert doc["env"]["cuda_available"] is False
    with tarfile.open(out / "logs.tar.gz") as tar:
        install_log = tar.extractfile("./install.log")
        assert install_log is not None and b"no wheels in" in install_log.read()


@pytest.mark.build
def test_a_signal_mid_run_leaves_a_document_naming_the_stage(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_check(out, GPU_CHECK_DEVICE="cpu", GPU_CHECK_WHEELS="none")
    try:
        deadline = time.monotonic() + 90
        while True:  # the document says a stage is running once the tests have started
            assert proc.poll() is None and time.monotonic() < deadline, "the check never reached its tests"
            try:
                doc = json.loads((out / "gpu_check.json").read_text())
            except (OSError, ValueError):
                doc = {}
            if "stage 'tests' started at" in (doc.get("error") or ""):
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143
    doc = json.loads((out / "gpu_check.json").read_text())
    assert (doc["ok"], doc["status"]) == (False, "interrupted")
    assert doc["failed"][:1] == ["tests"] and "interrupted" in doc["failed"]
    assert doc["error"].startswith("stage 'tests' started at")
    assert verdict_block(stdout.decode()).startswith("==== kvtier device check: INTERRUPTED")
    # Stopped as the tests started: no JUnit report yet, perhaps no log either.
    assert_out_comes_back(out, {"gpu_check.json", "logs.tar.gz"})


MAIN_CASES = {f"{lay}/p{p}/{k}" for lay in ("layer_first", "page_first") for p in (1, 16, 64)
              for k in ("per_layer", "stacked")}
MANY_CASES = {f"many_ops/{lay}/{k}" for lay in ("layer_first", "page_first") for k in ("per_layer", "stacked")}
EVERY_CASE = MAIN_CASES | MANY_CASES | {"burst", "scaling"}


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, Path]]:
    """The whole check on CPU, as it is and with GPU_CHECK_PLANT=bytes: (exit status, stdout, OUT)."""
    started = {}
    for name, extra in (("clean", {}), ("planted", {"GPU_CHECK_PLANT": "bytes"})):  # side by side: half the wait
        out = tmp_path_factory.mktemp(name) / "out"
        started[name] = (run_check(out, GPU_CHECK_DEVICE="cpu", GPU_CHECK_WHEELS="none", **extra), out)
    runs = {}
    for name, (proc, out) in started.items():
        stdout, _ = proc.communicate(timeout=240)
        runs[name] = (proc.returncode, stdout.decode(), out)
    return runs


@pytest.mark.build
def test_the_cpu_smoke_run_passes_and_everything_comes_back(smoke_runs: dict[str, tuple[int, str, Path]]) -> None:
    rc, stdout, out = smoke_runs["clean"]
    block = verdict_block(stdout)
    assert rc == 0, block
    assert block.startswith("==== kvtier device check: SMOKE-PASSED (ok) ====") and "reasons: none" in block
    assert len(block) < 2000 and "end-to-end" in block
    assert_out_comes_back(out)
    doc = json.loads((out / "gpu_check.json").read_text())
    assert (doc["ok"], doc["status"], doc["reasons"]) == (True, "smoke-passed", [])
    assert doc["tests"]["failed"] == 0 and doc["tests"]["skipped"] > 0
    bench = doc["bench"]
    assert (bench["status"], bench["errors"], bench["skipped"], bench["problems"]) == ("ok", [], [], [])
    checks = bench["checks"]
    assert set(checks["cases"]) == EVERY_CASE and checks["failed"] == [] and checks["passed"] == checks["checks"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./bench.json", "./bench.log", "./env.json", "./stages.tsv", "./probe.log"} <= names


@pytest.mark.build
def test_the_smoke_benchmark_checks_every_repetition_and_reports_both_baselines(
        smoke_runs: dict[str, tuple[int, str, Path]]) -> None:
    bench = json.loads((smoke_runs["clean"][2] / "gpu_check.json").read_text())["bench"]
    reps = bench["sizes"]["reps"]
    cases = bench["kvtier"]
    assert {f"{c['layout']}/p{c['page_size']}/{c['device_tensors']}" for c in cases} == MAIN_CASES
    for c in cases:
        for op, direction in (("backup", "d2h"), ("load", "h2d")):
            same = c[op]["raw_same_copies"]
            # The raw baseline replays exactly the copies kvtier issued.
            assert same["copies"] == c[op]["copies"] > 0 and same["bytes"] == c[op]["copy_bytes"]["total"] > 0
            assert c[op]["wall_ms"] > 0 and c[op]["vs_raw_same_copies_wall"] > 0
            assert c[op]["dma_ms"] is None  # no device: no DMA time
    # Direct copies where runs are long enough (page 64: 2 KiB rows x 64 = 4 x min_run... per layer copy)
    # Every repetition (the warm-up, the timed ones and the DMA one) checked, backups and loads.
    total = bench["checks"]["checks"]
    per_main_case = 2 * (reps + 2)
    per_many_case = 2 * 3 * (reps + 1)
    burst = 2 + reps * (2 + bench["sizes"]["burst_backups"])
    scaling = 2 * len(bench["sizes"]["scaling_counts"]) * bench["sizes"]["scaling_reps"]
    assert total == 12 * per_main_case + 4 * per_many_case + burst + scaling
    assert bench["load_under_backup_burst"]["idle_ms"]["n"] == 20
    assert [(r["path"], r["operations"]) for r in bench["scaling"]["rows"]] == [
        (p, n) for n in (64, 128, 256) for p in ("single", "bulk")]
    many = bench["many_ops"]
    assert {f"many_ops/{c['layout']}/{c['device_tensors']}" for c in many} == MANY_CASES
    for c in many:
        for op in ("backup", "load"):
            assert all(c[op][p]["us_per_op"] > 0 for p in ("one", "single", "bulk"))
            assert c[op]["one"]["vs_one_op"] == 1.0
    assert bench["callbacks"]["callbacks"] > 0


@pytest.mark.build
def test_a_planted_byte_fault_fails_the_check_naming_every_case(smoke_runs: dict[str, tuple[int, str, Path]]) -> None:
    rc, stdout, out = smoke_runs["planted"]
    block = verdict_block(stdout)
    assert rc == 1
    assert block.startswith("==== kvtier device check: SMOKE-FAILED (not ok) ====") and "plant bytes" in block
    assert_out_comes_back(out)
    doc = json.loads((out / "gpu_check.json").read_text())
    assert (doc["ok"], doc["status"], doc["failed"]) == (False, "smoke-failed", ["bytes"])
    checks = doc["bench"]["checks"]
    assert checks["passed"] == 0 and len(checks["failed"]) == checks["checks"] > 0  # every check caught its plant
    assert set(checks["failed_cases"]) == EVERY_CASE
    assert all(case in doc["reasons"][0] for case in EVERY_CASE)
    assert all(case in block for case in EVERY_CASE)  # named where the cut output still shows it


def test_an_unknown_plant_is_refused_by_name(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--plant", "bits"], capture_output=True, timeout=60)
    assert proc.returncode == 2
    assert "--plant (or GPU_CHECK_PLANT) must be one of ('bytes',); got 'bits'" in proc.stderr.decode()


def test_a_benchmark_out_of_time_fails_naming_what_it_skipped(tmp_path: Path) -> None:
    target = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--deadline-s", "0", "--json", str(target)], capture_output=True, timeout=120)
    assert proc.returncode == 1
    doc = json.loads(target.read_text())
    assert doc["status"] == "failed"
    skipped = {x["what"] for x in doc["skipped"]}
    assert skipped == MAIN_CASES | MANY_CASES | {"load_under_backup_burst", "scaling"}
    assert doc["problems"][0] == "bytes: no byte check ran"
    assert doc["problems"][1].startswith("deadline: skipped layer_first/p1/per_layer, ")
    stdout = proc.stdout.decode()
    assert stdout.startswith("gpu_check.py: status failed") and "- deadline: skipped" in stdout
    assert len(stdout) < 2000  # the document went to --json, not to stdout


def test_a_carried_wheel_for_another_python_is_named_at_install() -> None:
    summary = load("gpu_check_summary")
    xx = "xxhash-3.5.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
    assert summary.wheel_misfit(xx, (3, 12), "x86_64") is None
    why = summary.wheel_misfit(xx, (3, 11), "x86_64")
    assert why == f"{xx} is built for CPython 3.12; this python is 3.11: it would not import"
    assert "aarch64" in summary.wheel_misfit(xx, (3, 12), "aarch64")
    for fits in ("structlog-26.1.0-py3-none-any.whl", "a-1.0-py2.py3-none-any.whl",
                 "b-1.0-cp38-abi3-manylinux_2_17_x86_64.whl"):
        assert summary.wheel_misfit(fits, (3, 11), "x86_64") is None, fits


@pytest.mark.build
def test_the_install_stage_fails_naming_a_wheel_that_does_not_fit_this_python(tmp_path: Path) -> None:
    out = tmp_path / "out"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    minor = sys.version_info[1]
    bad = f"fake-1.0-cp3{minor + 1}-cp3{minor + 1}-manylinux_2_17_x86_64.whl"
    (wheels / bad).write_bytes(b"not a zip")
    proc = run_check(out, GPU_CHECK_WHEELS=str(wheels))
    proc.communicate(timeout=300)
    doc = json.loads((out / "gpu_check.json").read_text())
    assert "install" in doc["failed"], doc["failed"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        install_log = tar.extractfile("./install.log")
        assert install_log is not None
        text = install_log.read().decode()
    assert f"{bad} is built for CPython 3.{minor + 1}; this python is 3.{minor}: it would not import" in text, text
    assert "do not fit this python" in text, text
