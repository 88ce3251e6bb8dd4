"""Writes ``gpu_check.json``, the device check's one document, from what its stages left.

Standard library only, so that it runs whatever else is broken. Called by
``benchmarks/gpu_check.sh`` after every stage (``running``), at the end
(``done``) and from its signal trap (``interrupted``):

    python3 benchmarks/gpu_check_summary.py OUT_DIR running|done|interrupted ELAPSED_S

It reads ``OUT_DIR/stages.tsv`` (one line per finished stage: name, exit
status, seconds, log file), ``env.json`` (the probe), ``tests.xml`` (pytest's
JUnit report) and ``bench.json`` (benchmarks/gpu_check.py), and writes
``OUT_DIR/gpu_check.json`` atomically; at ``done`` it prints it too. A stage
that timed out (exit 124 or 137 from ``timeout``) says so. A document left with
status ``running`` means the check was killed: ``error`` names the stage that
was running. ``smoke.json`` marks a run without a device (``GPU_CHECK_DEVICE=cpu``):
status ``smoke-passed`` / ``smoke-failed``, and a missing CUDA is not a failure.

``--check-wheels DIR`` instead checks a wheel folder for the trip (pure-Python
wheels only, 64 MiB at most in all) and lists it.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

TIMED_OUT = (124, 137)
# What failing stages mean, in the order the check runs them.
REQUIRED = ("install", "probe", "tests", "bench")
CARRY_LIMIT = 64 << 20
LOG_TAIL_CHARS = 2000


def read_stages(out: Path) -> dict[str, dict[str, Any]]:
    stages: dict[str, dict[str, Any]] = {}
    path = out / "stages.tsv"
    if not path.exists():
        return stages
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) < 4:
            continue
        name, rc, seconds, log = parts[:4]
        note = parts[4] if len(parts) > 4 else ""
        code = int(rc) if rc.lstrip("-").isdigit() else None
        stages[name] = {"rc": code, "seconds": int(seconds) if seconds.isdigit() else None, "log": log,
                        "timed_out": code in TIMED_OUT, **({"note": note} if note else {})}
        if code not in (0, None) and (out / log).is_file():
            # The end of a failed stage's log, so the document alone says why.
            stages[name]["log_tail"] = (out / log).read_text(errors="replace")[-LOG_TAIL_CHARS:]
    return stages


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def read_tests(path: Path) -> dict[str, Any] | None:
    """Counts and failures from pytest's JUnit XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                text = (child.get("message") or "") + "\n" + (child.text or "")
                failures.append({"test": name, "kind": child.tag, "message": text.strip()[:1500]})
                break
            if child.tag == "skipped":
                outcome = "skipped"
        counts[outcome] += 1
    return {**counts, "failures": failures}


def first_error(stages: dict[str, dict[str, Any]], env: dict[str, Any] | None, tests: dict[str, Any] | None,
                bench: dict[str, Any] | None, state: str) -> tuple[list[str], str | None]:
    failed: list[str] = []
    reasons: list[str] = []
    for name in REQUIRED:
        s = stages.get(name)
        if s is None:
            continue
        if s.get("timed_out"):
            failed.append(name)
            reasons.append(f"stage {name!r} timed out after {s.get('seconds')} s (see {s.get('log')})")
        elif s.get("rc") not in (0, None):
            failed.append(name)
            note = f": {s['note']}" if s.get("note") else ""
            reasons.append(f"stage {name!r} exited {s.get('rc')}{note} (see {s.get('log')})")
    if env is not None and env.get("cuda_available") is False:
        if "cuda" not in failed:
            failed.insert(0, "cuda")
        reasons.insert(0, "CUDA is not available on this machine: torch.cuda.is_available() is False "
                          f"(torch {env.get('torch')}, built for CUDA {env.get('torch_cuda')}); tests and "
                          "benchmark not run")
    if tests is not None and (tests["failed"] or tests["errors"]) and "tests" not in failed:
        failed.append("tests")
        reasons.append(f"{tests['failed']} gpu tests failed, {tests['errors']} errors")
    if bench is not None and bench.get("status") not in ("ok", "running") and "bench" not in failed:
        failed.append("bench")
        reasons.append(f"benchmark status {bench.get('status')!r}: {[e.get('where') for e in bench.get('errors', [])]}")
    if state == "interrupted":
        failed.append("interrupted")
        reasons.append("the check was stopped by a signal (an outer timeout?) before it finished")
    return failed, (reasons[0] if reasons else None)


def summarize(out: Path, state: str, elapsed: int | None) -> dict[str, Any]:
    stages = read_stages(out)
    env = read_json(out / "env.json")
    tests = read_tests(out / "tests.xml")
    bench = read_json(out / "bench.json")
    smoke = (out / "smoke.json").exists()
    failed, error = first_error(stages, None if smoke else env, tests, bench, state)
    current = out / "current_stage"
    if state != "done" and current.exists():
        name, _, since = current.read_text().strip().partition("\t")
        where = f"stage {name!r} started at {since} s and had not finished when this was written"
        error = where if error is None or state == "interrupted" else f"{error}; {where}"
        if state == "interrupted" and name not in failed:
            failed.insert(0, name)
    finished = state == "done"
    ran_everything = all(name in stages for name in REQUIRED)
    ok = finished and not failed and ran_everything
    if not finished:
        status = state  # "running" read after the fact: the check was killed before it finished
    elif smoke:
        status = "smoke-passed" if ok else "smoke-failed"
    else:
        status = "passed" if ok else "failed"
    if finished and not failed and not ran_everything:
        error = f"stages missing: {[n for n in REQUIRED if n not in stages]}"
    doc: dict[str, Any] = {
        "ok": ok,
        "status": status,
        "failed": failed,
        "error": error,
        "elapsed_s": elapsed,
        "smoke": smoke,
        "env": env,
        "stages": stages,
        "tests": tests,
        "bench_summary": (bench or {}).get("summary"),
        "bench": bench,
        "files": sorted(p.name for p in out.iterdir() if p.is_file() and p.name != "gpu_check.json"),
    }
    return doc


def write(out: Path, doc: dict[str, Any]) -> Path:
    target = out / "gpu_check.json"
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, target)
    return target


def check_wheels(folder: Path) -> int:
    wheels = sorted(folder.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    impure = [w.name for w in wheels if not w.name.endswith("-none-any.whl")]
    for w in wheels:
        print(f"{w.stat().st_size:>10}  {w.name}")
    print(f"{total:>10}  in all ({len(wheels)} wheels)")
    if not wheels:
        print(f"no wheels in {folder}", file=sys.stderr)
        return 1
    if impure:
        print(f"not pure-Python (the GPU machine may not take them): {impure}", file=sys.stderr)
        return 1
    if total > CARRY_LIMIT:
        print(f"{total} bytes is over the {CARRY_LIMIT}-byte limit of what travels", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--check-wheels":
        return check_wheels(Path(argv[1]))
    if len(argv) != 3 or argv[1] not in ("running", "done", "interrupted"):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    doc = summarize(out, argv[1], int(argv[2]) if argv[2].isdigit() else None)
    target = write(out, doc)
    if argv[1] != "running":
        sys.stdout.write(target.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
