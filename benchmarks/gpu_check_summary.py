"""Writes ``gpu_check.json``, the device check's one document, and prints its verdict.

Standard library only, so that it runs whatever else is broken. Called by
``benchmarks/gpu_check.sh`` after every stage (``running``), at the end
(``done``) and from its signal trap (``interrupted``):

    python3 benchmarks/gpu_check_summary.py WORK_DIR OUT_DIR running|done|interrupted ELAPSED_S

It reads, in ``WORK_DIR``, ``stages.tsv`` (one line per finished stage: name,
exit status, seconds, log file, note), ``env.json`` (the probe), ``tests.xml``
(pytest's JUnit report) and ``bench.json`` (benchmarks/gpu_check.py), and writes
``OUT_DIR/gpu_check.json`` (compact) atomically. At ``done`` and ``interrupted``
it prints the verdict block (under 2,000 characters: status, every reason, the
headline ratios, what lies in ``OUT_DIR``), which ends the check's stdout.

The verdict passes only when every stage ran and exited 0, and: the gpu tests
ran, none failed, not all skipped (unless ``smoke.json`` marks a run without a
device, ``GPU_CHECK_DEVICE=cpu``); the benchmark's document is complete, every
byte check passed, nothing was skipped for the deadline, no case raised. Each
reason that fails it is named, in ``reasons`` (``error`` is the first).

``--check-wheels DIR`` instead checks a wheel folder for the trip (pure-Python
wheels only, 64 MiB at most in all) and lists it; ``--fit-wheels DIR``, at the
install stage, which of them the python it runs on takes (a cp312 wheel does
not install on 3.11: said at install, not found out at the first import).
"""

from __future__ import annotations

import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

TIMED_OUT = (124, 137)
# What failing stages mean, in the order the check runs them.
REQUIRED = ("install", "probe", "tests", "bench")
CARRY_LIMIT = 64 << 20
LOG_TAIL_CHARS = 2000
VERDICT_CHARS = 1990
REASON_CHARS = 640
# What OUT_DIR holds at the end (benchmarks/gpu_check.sh packs the rest).
OUT_FILES = {
    "gpu_check.json": "this document, compact: verdict, env, stages, tests, the benchmark's whole document",
    "tests.log": "pytest -v -rA of the gpu tests",
    "tests.xml": "their JUnit report",
    "logs.tar.gz": "every stage's log, env.json, bench.json, stages.tsv, nvidia-smi.log",
}


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


def _names(xs: list[str], limit: int = 12) -> str:
    shown = ", ".join(xs[:limit])
    return shown + (f", and {len(xs) - limit} more" if len(xs) > limit else "")


def judge(stages: dict[str, dict[str, Any]], env: dict[str, Any] | None, tests: dict[str, Any] | None,
          bench: dict[str, Any] | None, state: str, smoke: bool) -> tuple[list[str], list[str]]:
    """(what failed, why: one sentence each), in the order the check runs."""
    failed: list[str] = []
    reasons: list[str] = []

    def fail(what: str, why: str) -> None:
        if what not in failed:
            failed.append(what)
        reasons.append(why)

    if not smoke and env is not None and env.get("cuda_available") is False:
        fail("cuda", "CUDA is not available on this machine: torch.cuda.is_available() is False "
                     f"(torch {env.get('torch')}, built for CUDA {env.get('torch_cuda')}); tests and "
                     "benchmark not run")
    bench_problems = list((bench or {}).get("problems") or [])
    for name in REQUIRED:
        s = stages.get(name)
        if s is None:
            continue
        if s.get("timed_out"):
            fail(name, f"stage {name!r} timed out after {s.get('seconds')} s (see {s.get('log')})")
        elif s.get("rc") not in (0, None) and not (name == "bench" and bench_problems):
            note = f": {s['note']}" if s.get("note") else ""
            fail(name, f"stage {name!r} exited {s.get('rc')}{note} (see {s.get('log')})")
    ran_tests = "tests" in stages and not stages["tests"].get("note", "").startswith("not run")
    if ran_tests:
        if tests is None:
            fail("tests", "tests: no JUnit report (tests.xml) was written")
        else:
            total = tests["passed"] + tests["failed"] + tests["errors"] + tests["skipped"]
            bad = [f["test"].rpartition("::")[2] for f in tests["failures"]]
            if tests["failed"] or tests["errors"]:
                fail("tests", f"tests: {tests['failed']} failed, {tests['errors']} errors of {total}: {_names(bad)}")
            if total == 0:
                fail("tests", "tests: no gpu test ran (the JUnit report holds none)")
            elif tests["skipped"] == total and not smoke:
                fail("tests", f"tests: all {total} gpu tests skipped (did pytest see the device?)")
    ran_bench = "bench" in stages and not stages["bench"].get("note", "").startswith("not run")
    if ran_bench:
        if bench is None:
            fail("bench", "bench: no document (bench.json) was written")
        elif bench.get("status") == "running":
            fail("bench", "bench: its document was left unfinished (status 'running'): killed mid-run")
        for p in bench_problems:
            fail(p.partition(":")[0] if p.partition(":")[0] in ("bytes", "deadline") else "bench", f"bench {p}")
        if bench is not None and bench.get("status") not in ("ok", "running") and not bench_problems:
            fail("bench", f"bench: status {bench.get('status')!r}")
    if state == "interrupted":
        fail("interrupted", "the check was stopped by a signal (an outer timeout?) before it finished")
    return failed, reasons


def summarize(work: Path, state: str, elapsed: int | None) -> dict[str, Any]:
    stages = read_stages(work)
    env = read_json(work / "env.json")
    tests = read_tests(work / "tests.xml")
    bench = read_json(work / "bench.json")
    smoke = (work / "smoke.json").exists()
    failed, reasons = judge(stages, env, tests, bench, state, smoke)
    current = work / "current_stage"
    if state != "done" and current.exists():
        name, _, since = current.read_text().strip().partition("\t")
        where = f"stage {name!r} started at {since} s and had not finished when this was written"
        reasons.insert(0, where) if state == "interrupted" else reasons.append(where)
        if state == "interrupted" and name not in failed:
            failed.insert(0, name)
    finished = state == "done"
    missing = [n for n in REQUIRED if n not in stages]
    if finished and missing:
        failed.append("stages")
        reasons.append(f"stages missing: {missing}")
    ok = finished and not failed
    if not finished:
        status = state  # "running" read after the fact: the check was killed before it finished
    elif smoke:
        status = "smoke-passed" if ok else "smoke-failed"
    else:
        status = "passed" if ok else "failed"
    doc: dict[str, Any] = {
        "ok": ok,
        "status": status,
        "failed": failed,
        "error": reasons[0] if reasons else None,
        "reasons": reasons,
        "elapsed_s": elapsed,
        "smoke": smoke,
        "plant": (bench or {}).get("plant"),
        "env": env,
        "stages": stages,
        "tests": tests,
        "bench_summary": (bench or {}).get("summary"),
        "bench": bench,
        "files": OUT_FILES,
    }
    return doc


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)


def _span(r: dict[str, Any] | None) -> str:
    r = r or {}
    return f"{_fmt(r.get('min'))}..{_fmt(r.get('median'))}..{_fmt(r.get('max'))}"


def verdict(doc: dict[str, Any], budget_s: str = "290") -> str:
    """The block that ends the check's stdout: under 2,000 characters whatever
    the document holds (reasons are clipped, then dropped, before it grows)."""
    env = doc.get("env") or {}
    head = [f"==== kvtier device check: {doc['status'].upper()} ({'ok' if doc['ok'] else 'not ok'}) ===="]
    head.append(f"elapsed {doc.get('elapsed_s')} s of {budget_s} | {env.get('device') or 'no device'} | torch "
                f"{env.get('torch')} CUDA {env.get('torch_cuda')} | plant {doc.get('plant')}")
    t = doc.get("tests")
    tail = []
    if t is not None:
        tail.append(f"tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
                    f"{t['skipped']} skipped")
    s = doc.get("bench_summary")
    if s:
        tail.append(f"bytes: {s.get('bytes_checks')} checks, failed in {len(s.get('bytes_failed_cases') or [])} "
                    "cases")
        tail.append(f"kvtier / raw replay of its own copies (registered memory), min..median..max over "
                    f"{s.get('cases_ok')} cases:")
        for op in ("backup", "load"):
            tail.append(f"  {op:<6} end-to-end {_span(s.get(f'{op}_vs_raw_same_copies_wall'))}   DMA "
                        f"{_span(s.get(f'{op}_vs_raw_same_copies_dma'))}   vs raw large copy "
                        f"{_span(s.get(f'{op}_vs_raw_large'))}")
        raw = s.get("raw_large_gbps") or {}
        load = s.get("small_load_p50_ms") or {}
        tail.append(f"raw large copy GB/s h2d {_fmt(raw.get('h2d'))} d2h {_fmt(raw.get('d2h'))} | one-page load p50 ms "
                    f"idle {_fmt(load.get('idle'))} in burst {_fmt(load.get('during_burst'))} | loop stall max "
                    f"{_fmt(s.get('loop_max_stall_ms'))} ms")
    tail.append("OUT: " + ", ".join(doc.get("files") or OUT_FILES) + " (details: gpu_check.json)")
    tail.append("==== end of verdict ====")
    reasons = [r if len(r) <= REASON_CHARS else r[: REASON_CHARS - 3] + "..." for r in doc.get("reasons") or []]
    while True:
        body = [f"reasons ({len(doc.get('reasons') or [])}):" if reasons or doc.get("reasons") else "reasons: none"]
        body += [f" {i + 1}. {r}" for i, r in enumerate(reasons)]
        if len(reasons) < len(doc.get("reasons") or []):
            body.append(f" ... {len(doc['reasons']) - len(reasons)} more in gpu_check.json")
        text = "\n".join(head + body + tail) + "\n"
        if len(text) <= VERDICT_CHARS or not reasons:
            return text[:VERDICT_CHARS]
        reasons = reasons[:-1]


def write(out: Path, doc: dict[str, Any]) -> Path:
    target = out / "gpu_check.json"
    tmp = out / f"gpu_check.json.{os.getpid()}.tmp"  # the script may refresh from two processes
    tmp.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    os.replace(tmp, target)
    return target


_FOR_GPU_MACHINE = re.compile(r"-cp312-cp312-(manylinux[\w.]*x86_64)\.whl$")


def check_wheels(folder: Path) -> int:
    wheels = sorted(folder.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    # Pure-Python wheels, and binary ones built for the GPU machine's Python
    # (CPython 3.12, x86-64 manylinux): xxhash, kvtier's checksums.
    impure = [w.name for w in wheels if not (w.name.endswith("-none-any.whl") or _FOR_GPU_MACHINE.search(w.name))]
    for w in wheels:
        print(f"{w.stat().st_size:>10}  {w.name}")
    print(f"{total:>10}  in all ({len(wheels)} wheels)")
    if not wheels:
        print(f"no wheels in {folder}", file=sys.stderr)
        return 1
    if impure:
        print(f"neither pure-Python nor built for CPython 3.12 on x86-64 manylinux (the GPU machine "
              f"may not take them): {impure}", file=sys.stderr)
        return 1
    if total > CARRY_LIMIT:
        print(f"{total} bytes is over the {CARRY_LIMIT}-byte limit of what travels", file=sys.stderr)
        return 1
    return 0


def wheel_misfit(name: str, python: tuple[int, int], machine: str) -> str | None:
    """Why the wheel file ``name`` does not install on CPython ``python`` on
    ``machine`` (``x86_64``, ...), or None when it does. Tags as in PEP 427:
    ``NAME-VERSION[-BUILD]-PYTHON-ABI-PLATFORM.whl``, each a ``.``-joined set."""
    parts = name[: -len(".whl")].split("-")
    if len(parts) < 5:
        return f"{name}: not a wheel file name (NAME-VERSION-PYTHON-ABI-PLATFORM.whl)"
    pythons, abis, platforms = (set(t.split(".")) for t in parts[-3:])
    here = f"cp{python[0]}{python[1]}"

    def takes(tag: str) -> bool:
        if tag in ("py3", f"py{python[0]}{python[1]}", here):
            return True
        # A stable-ABI wheel (cp38-abi3) installs on that CPython and every later one.
        return tag.startswith("cp3") and tag[3:].isdigit() and "abi3" in abis and int(tag[3:]) <= python[1]

    if not any(takes(t) for t in pythons):
        built = ", ".join(sorted(f"CPython {t[2]}.{t[3:]}" if t.startswith("cp") else t for t in pythons))
        return f"{name} is built for {built}; this python is {python[0]}.{python[1]}: it would not import"
    if not any(pl == "any" or pl.endswith(f"_{machine}") for pl in platforms):
        return f"{name} is built for {', '.join(sorted(platforms))}; this machine is {machine}"
    return None


def fit_wheels(folder: Path) -> int:
    """For the install stage: ``fits PATH`` for each wheel this python takes,
    then one line per wheel it does not, saying why; exit 1 if any does not."""
    import platform

    python = (sys.version_info[0], sys.version_info[1])
    misfits = []
    for w in sorted(folder.glob("*.whl")):
        why = wheel_misfit(w.name, python, platform.machine())
        if why is None:
            print(f"fits {w}")
        else:
            misfits.append(why)
    for why in misfits:
        print(f"does not fit: {why}")
    return 1 if misfits else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--check-wheels":
        return check_wheels(Path(argv[1]))
    if len(argv) == 2 and argv[0] == "--fit-wheels":
        return fit_wheels(Path(argv[1]))
    if len(argv) != 4 or argv[2] not in ("running", "done", "interrupted"):
        print(__doc__, file=sys.stderr)
        return 2
    work, out, state = Path(argv[0]), Path(argv[1]), argv[2]
    doc = summarize(work, state, int(argv[3]) if argv[3].isdigit() else None)
    write(out, doc)
    if state != "running":
        sys.stdout.write(verdict(doc, os.environ.get("GPU_CHECK_BUDGET_S", "290")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
