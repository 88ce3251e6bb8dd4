"""`make mutate`: mutmut (3.8) over kvtier's storage, pools, scheduler data paths,
policies and the engines' identity code, one module at a time, and the report.

    python scripts/mutate.py run [MODULE ...]      # mutmut per module (all when none named)
    python scripts/mutate.py report [MODULE ...]   # the per-module table, checked against the baseline
    python scripts/mutate.py show [MODULE ...]     # the diff of each survivor not justified
    python scripts/mutate.py list                  # the modules, their files and tests

``run``, ``report`` and ``show`` take ``--only GLOB ...`` with one module: its
mutants whose names match a glob, and no other (a narrower run where the whole
module would not fit the time there is; its report says nothing of the rest).

Each module runs in a work directory of its own, ``.mutmut/<module>/`` (ignored by git
and by pytest): links to ``kvtier``, ``tests``, ``benchmarks`` and ``examples`` and a ``pyproject.toml`` whose
``[tool.mutmut]`` section names the module's files and the tests that exercise them.
mutmut copies the tree into ``mutants/`` there, runs the selected tests once to learn
which tests reach which function, then runs those tests against every mutant in a
forked process. Results stay there, so a second run only retests functions that changed.

A survivor is either killed by a test or justified: ``tests/mutation-baseline.json``
names it (the mutant's name, as ``mutmut show`` takes it) with the reason it is
equivalent. ``report`` exits 1 when a survivor (or a mutant that no test reaches, or
one left unchecked) is neither, or when a justified mutant no longer exists or is now
killed (the baseline must stay true).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutmut"
BASELINE = ROOT / "tests" / "mutation-baseline.json"

# Every test gets this long under a mutant (pyproject's 120 s is for the suite): a
# mutant that makes a test wait forever is a failure with a name, not a hang.
TEST_TIMEOUT_S = 20


@dataclass(frozen=True)
class Module:
    """One mutation target: files to mutate, the tests that exercise them, and
    optionally the functions (mutant name globs) when only part of a file is in scope."""

    name: str
    files: tuple[str, ...]
    tests: tuple[str, ...]
    functions: tuple[str, ...] = ()
    venv: str = ""  # "" is the interpreter running this script; "sglang" the SGLang venv
    extra_pytest: tuple[str, ...] = field(default=())
    # An async test's deadline under this module's mutants (tests/conftest.py's
    # KVTIER_TEST_DEADLINE_S; 0: the suite's). A mutant that leaves a waiter unwoken fails
    # at the deadline: the scheduler's tests end in well under a second, and at 30 s each
    # of their hanging mutants cost most of a minute.
    deadline_s: int = 0
    # Each test's limit under this module's mutants (pytest-timeout; 0: TEST_TIMEOUT_S).
    # A mutant that makes a lane spin on the loop never reaches the async deadline; with
    # pytest's -x the first test to spin ends the mutant's run at this limit.
    test_timeout_s: int = 0


# The tests of each module are the files that mirror it (and the pinned-behaviour
# tests that reach it); mutmut runs, for each mutant, only those of them that call
# the mutated function. In the order of value: a survivor in storage is wrong bytes.
_PINNED = "tests/test_pinned_behaviours.py"
MODULES: tuple[Module, ...] = (
    Module("storage.keys", ("kvtier/storage/keys.py",), ("tests/test_storage_keys.py", _PINNED)),
    Module("storage.identity", ("kvtier/storage/identity.py",),
           ("tests/test_storage_identity.py", "tests/test_storage_keys.py", _PINNED)),
    Module("storage.sealed", ("kvtier/storage/sealed.py",), ("tests/test_storage_sealed.py", _PINNED)),
    Module("storage.pages", ("kvtier/storage/pages.py",),
           ("tests/test_storage_pages.py", "tests/test_storage_checksums.py", "tests/test_storage_integrity.py",
            "tests/test_valid_rows.py",
            _PINNED)),
    Module("storage.file_store", ("kvtier/storage/file_store.py",),
           ("tests/test_storage_file_layout.py", "tests/test_storage_backends.py", "tests/test_storage_bounded.py",
            "tests/test_storage_blocking.py", "tests/test_storage_sizes.py", "tests/test_storage_refusals.py",
            "tests/test_storage_file_store.py")),
    # the cluster variants of the store tests start a three-master Redis Cluster for each
    # mutant (seconds a mutant on a loaded machine) and pin nothing of the sealed store that
    # the memory, file and single-server variants do not
    Module("storage.sealed_store", ("kvtier/storage/sealed_store.py",),
           ("tests/test_storage_sealed.py", "tests/test_storage_sizes.py", "tests/test_storage_blocking.py",
            "tests/test_pinned_faults.py", "tests/test_refused_at_entry.py", "tests/test_storage_sealed_store.py"),
           extra_pytest=("-k", "not cluster")),
    # test_storage_redis_store.py mirrors the module against one redis-server per session;
    # the benchmark's test (a timing run) reaches it only through put/get, which the others cover
    Module("storage.redis_store", ("kvtier/storage/redis_store.py",),
           ("tests/test_storage_redis_store.py", "tests/test_storage_backends.py",
            "tests/test_redis_cluster_degraded.py"),
           extra_pytest=("-k", "not bench_storage")),
    # the storage benchmark's test (a timing run against Redis) reaches base.py only through the
    # stores, which the other tests cover; on a loaded machine its connections time out
    Module("storage.base", ("kvtier/storage/base.py", "kvtier/storage/errors.py"),
           ("tests/test_storage_backends.py", "tests/test_storage_refusals.py"),
           extra_pytest=("-k", "not bench_storage")),
    # Its real-master tests (test_storage_mooncake.py, the cross-check in the mirror file) start a
    # mooncake_master: seconds a mutant. The mirror file's cases run against an in-process stand-in
    # of the client, which that cross-check holds to the real client's answers in `make test`.
    Module("storage.mooncake_store", ("kvtier/storage/mooncake_store.py",), ("tests/test_storage_mooncake_store.py",),
           extra_pytest=("-k", "not real_mooncake")),
    Module("pools.allocator", ("kvtier/pools/allocator.py", "kvtier/pools/indices.py"),
           ("tests/test_pools_allocator.py", "tests/test_pools_indices.py")),
    Module("pools.group", ("kvtier/pools/group.py", "kvtier/pools/host.py", "kvtier/pools/device.py"),
           # pinned registration (a fake CUDA runtime) and the stacked views are tested where they are used
           ("tests/test_pools_group.py", "tests/test_pools_allocator.py", "tests/test_cuda_executor.py",
            "tests/test_copy_paths.py")),
    Module("pools.ownership", ("kvtier/pools/ownership.py",), ("tests/test_pools_ownership.py",)),
    # The scheduler's tests run in seconds; the stateful ones (test_scheduler_stateful.py, a
    # minute of Hypothesis state machines) and the cost tests (garbage and import checks) stay out.
    Module("scheduler.arrays", ("kvtier/scheduler/arrays.py", "kvtier/scheduler/bulk.py"),
           ("tests/test_scheduler_arrays.py", "tests/test_bulk_arrays.py", "tests/test_bulk.py",
            "tests/test_handed_indices.py", "tests/test_refused_at_entry.py", "tests/test_bad_input_catalogue.py",
            _PINNED), deadline_s=5),
    Module("scheduler.carriers", ("kvtier/scheduler/carriers.py", "kvtier/scheduler/lanes.py"),
           ("tests/test_scheduler_carriers.py", "tests/test_scheduler_core.py", "tests/test_scheduler.py",
            "tests/test_bulk.py", "tests/test_bulk_arrays.py", "tests/test_handed_indices.py",
            "tests/test_valid_rows.py", "tests/test_verify.py", "tests/test_storage_cancel.py", _PINNED),
           deadline_s=5, test_timeout_s=5),
    Module("policies", ("kvtier/policies.py",),
           ("tests/test_policies.py", "tests/test_host_cache_index.py", "tests/test_scheduler_admission.py")),
    # vLLM's block keys: StorageKeys (the identity a worker's blocks are stored under) and
    # ShardGeometry, in a module that needs no vLLM, so the main venv runs them; the
    # functions they call (vllm_block_key, vllm_shard_key, for_vllm_block) are storage.identity's.
    Module("vllm.identity", ("kvtier/integrations/vllm_keys.py",), ("tests/test_vllm_keys.py",)),
    # SGLang's identity code needs sglang (`make test-sglang` builds .venv-sglang).
    Module("sglang.identity", ("kvtier/integrations/sglang/storage.py",),
           ("tests/sglang/test_sglang_identity.py", "tests/sglang/test_sglang_identity_fields.py",
            "tests/sglang/test_sglang_v4.py"),
           functions=tuple(f"kvtier.integrations.sglang.storage.x_{f}__mutmut_*" for f in (
               "_sglang_kv_cache_dtype", "_platform_fp8", "kv_element_format",
               "pool_shard", "pool_identity", "namespace_for", "sidecar_key_pool", "_is_dsv4_paged",
               "_sglang_dsv4_selection", "dsv4_kv_layout")),
           venv="sglang"),
)

BY_NAME = {m.name: m for m in MODULES}


def _select(names: list[str]) -> list[Module]:
    if not names:
        return list(MODULES)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"mutate: unknown module(s) {unknown}; known: {[m.name for m in MODULES]}")
    return [BY_NAME[n] for n in names]


def _toml_list(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def _pyproject(module: Module) -> str:
    """The repository's pyproject.toml with a [tool.mutmut] section for ``module``."""
    text = (ROOT / "pyproject.toml").read_text()
    # no:unraisableexception: its gc.collect() at the end of every session costs a
    # forked mutant run most of a second over torch's heap, and reports nothing a kill needs
    pytest_args = ["-p", "no:cacheprovider", "-p", "no:unraisableexception", f"--timeout={module.test_timeout_s or TEST_TIMEOUT_S}",
                   *module.extra_pytest]
    section = "\n".join(
        [
            "",
            "[tool.mutmut]",
            'source_paths = ["kvtier"]',
            # tests that run a benchmark or an example read them from the tree
            'also_copy = ["benchmarks", "examples"]',
            f"only_mutate = {_toml_list(module.files)}",
            f"pytest_add_cli_args_test_selection = {_toml_list(module.tests)}",
            f"pytest_add_cli_args = {_toml_list(pytest_args)}",
            # a mutant's tests may take this many times their clean time (plus a second) in CPU
            "timeout_multiplier = 10.0",
            # the work directory is not the repository: git cannot say what changed
            "use_git_change_detection = false",
            "",
        ]
    )
    return text + section


def _prepare(module: Module) -> Path:
    work = WORK / module.name
    work.mkdir(parents=True, exist_ok=True)
    for name in ("kvtier", "tests", "benchmarks", "examples"):
        link = work / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name)
    pyproject = work / "pyproject.toml"
    text = _pyproject(module)
    if not pyproject.exists() or pyproject.read_text() != text:
        pyproject.write_text(text)
    return work


def _interpreter(module: Module, interpreters: dict[str, str]) -> str | None:
    """The module's interpreter, as an absolute path: mutmut runs in the module's work
    directory, where `make mutate`'s ``--python sglang=.venv-sglang/bin/python`` names nothing."""
    if not module.venv:
        return sys.executable
    given = interpreters.get(module.venv)
    return None if given is None else os.path.abspath(given)


_RUN_MUTMUT = "import sys; from mutmut.__main__ import cli; sys.argv[0] = 'mutmut'; cli()"


def _call(args: list[str], **kwargs: Any) -> int:
    """``subprocess.call`` in a process group of its own, whose leftovers are killed
    when it returns: a mutant's test session ended by a limit (SIGKILL, or a stuck
    test ending its process) never ran its fixtures' teardown, and the servers they
    started (redis-server, mooncake_master) would run on."""
    proc = subprocess.Popen(args, start_new_session=True, **kwargs)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing left in the group


def run(modules: list[Module], interpreters: dict[str, str], max_children: int) -> int:
    failed = 0
    for module in modules:
        python = _interpreter(module, interpreters)
        if python is None:
            print(f"== mutate {module.name}: skipped, it needs --python {module.venv}=PATH "
                  f"(make test-{module.venv} builds that venv)", flush=True)
            continue
        work = _prepare(module)
        fresh = not _results(module)  # no verdicts yet: this run tries every mutant
        env = dict(os.environ)
        # torch's thread pools are not fork-safe and the machine is shared
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MKL_NUM_THREADS", "1")
        # tests/conftest.py: Hypothesis without shrinking or a database, a fixed seed,
        # capped examples, and the other tests first (docs/testing.md, "The hour")
        env["KVTIER_MUTATION"] = "1"
        if module.deadline_s:
            env["KVTIER_TEST_DEADLINE_S"] = str(module.deadline_s)
        base = [python, "-c", _RUN_MUTMUT, "run", "--max-children", str(max_children)]
        args = [*base, *module.functions]
        if module.functions and not fresh:
            # mutmut reruns every mutant a name or glob matches: name only those without a
            # verdict (new or changed code) and the survivors the baseline does not justify
            justified_now = _load_json(BASELINE, {}).get(module.name, {})
            pending = [k for k, c in _results(module).items()
                       if c is None or ((c in _SURVIVED or c in _NO_TESTS) and k not in justified_now)]
            if not pending:
                print(f"== mutate {module.name}: nothing to retest", flush=True)
                continue
            args = [*base, *pending]
        log = work / "mutmut.log"
        print(f"== mutate {module.name}: {' '.join(module.files)} (mutmut's output: {log.relative_to(ROOT)})",
              flush=True)
        start = time.monotonic()
        with log.open("w") as out:
            rc = _call(args, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
            # mutmut keeps a survivor's verdict when tests are added; name the
            # survivors to have them retested against the tests as they are now.
            justified = _load_json(BASELINE, {}).get(module.name, {})
            results = _results(module)
            retest = [k for k, c in results.items() if (c in _SURVIVED or c in _NO_TESTS) and k not in justified]
            if rc == 0 and retest and not module.functions and not fresh:  # fresh: just tested
                print(f"== mutate {module.name}: retesting {len(retest)} survivors", flush=True)
                rc = _call(base + retest, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
            # A kill of a mutant the baseline justifies as equivalent contradicts it, and a
            # test over its limit on a loaded machine ends a mutant the same way: retest
            # those once. A kill that stands is the report's to name (remove the entry).
            contradicted = [k for k, c in results.items() if (c in _KILLED or c in _TIMEOUT) and k in justified]
            if rc == 0 and contradicted:
                print(f"== mutate {module.name}: retesting {len(contradicted)} justified mutants that were killed",
                      flush=True)
                rc = _call(base + contradicted, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
        wall = time.monotonic() - start
        print(f"== mutate {module.name}: mutmut exited {rc} after {wall:.0f} s", flush=True)
        if rc != 0:
            print(log.read_text()[-3000:], file=sys.stderr)
        if rc != 0:
            failed += 1
            continue
        timings = _load_json(WORK / "timings.json", {})  # again: another run may have written since
        record = timings.setdefault(module.name, {})
        record.update({"wall_s": round(wall), "date": time.strftime("%Y-%m-%d"), "commit": _commit()})
        if fresh:
            record["full_wall_s"] = round(wall)
        (WORK / "timings.json").write_text(json.dumps(timings, indent=2, sort_keys=True) + "\n")
    return 1 if failed else 0


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvtier", "tests"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("+" if dirty else "")


def _load_json(path: Path, default: object) -> dict:  # type: ignore[type-arg]
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except FileNotFoundError:
        return default  # type: ignore[return-value]


# mutmut's exit codes (mutmut/stats.py status_by_exit_code)
_KILLED = {1, 3}
_TIMEOUT = {36, -24, 24, 152, 255}
_SURVIVED = {0}
_NO_TESTS = {5, 33}


def _results(module: Module) -> dict[str, int | None]:
    """mutant name -> mutmut's exit code, for the mutants in the module's scope."""
    out: dict[str, int | None] = {}
    for path in module.files:
        meta = WORK / module.name / "mutants" / (path + ".meta")
        data = _load_json(meta, {})
        for key, code in data.get("exit_code_by_key", {}).items():
            if module.functions and not any(fnmatch.fnmatch(key, g) for g in module.functions):
                continue
            out[key] = code
    return out


def report(modules: list[Module], markdown: bool, interpreters: dict[str, str]) -> int:
    baseline: dict[str, dict[str, str]] = _load_json(BASELINE, {})
    timings = _load_json(WORK / "timings.json", {})
    rows = []
    problems: list[str] = []
    for module in modules:
        results = _results(module)
        justified_here = baseline.get(module.name, {})
        if not results:
            if _interpreter(module, interpreters) is None:  # make mutate skipped it too
                print(f"{module.name}: not run, it needs --python {module.venv}=PATH", file=sys.stderr)
            else:  # a report that passes says every module was measured
                problems.append(f"{module.name}: no results (make mutate MUTATE_MODULES={module.name})")
            continue
        killed = sum(1 for c in results.values() if c in _KILLED)
        timeouts = sum(1 for c in results.values() if c in _TIMEOUT)
        justified = 0
        for key, code in sorted(results.items()):
            if code in _KILLED or code in _TIMEOUT:
                if key in justified_here:
                    problems.append(f"{key}: justified in the baseline but now killed; remove it")
                continue
            if key in justified_here and (code in _SURVIVED or code in _NO_TESTS):  # no tests: code no test here can run (CUDA)
                justified += 1
                continue
            status = ("survived" if code in _SURVIVED else "no tests" if code in _NO_TESTS
                      else "not checked" if code is None else f"exit code {code}")
            problems.append(f"{key}: {status}, neither killed nor justified")
        for key in sorted(set(justified_here) - set(results)):
            problems.append(f"{key}: justified in the baseline but no such mutant")
        total = len(results)
        score = 100.0 * (killed + timeouts) / total
        t = timings.get(module.name, {})
        rows.append((module.name, total, killed, justified, timeouts, score, t.get("full_wall_s"), t.get("wall_s"),
                     t.get("date", ""), t.get("commit", "")))
    def minutes(seconds: int | None) -> str:
        return "" if seconds is None else f"{seconds // 60} min {seconds % 60:02d} s"

    if markdown:
        print("| module | mutants | killed | survived, justified | timeouts | killed % | full run | last run | date | commit |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
        for name, total, killed, justified, timeouts, score, full, last, date, commit in rows:
            print(f"| `{name}` | {total} | {killed} | {justified} | {timeouts} | {score:.1f} | {minutes(full)} "
                  f"| {minutes(last)} | {date} | {commit} |")
    else:
        print(f"{'module':24} {'mutants':>7} {'killed':>7} {'justif':>7} {'timeout':>7} {'score':>7} {'full s':>7} {'last s':>7}")
        for name, total, killed, justified, timeouts, score, full, last, _, _ in rows:
            print(f"{name:24} {total:7} {killed:7} {justified:7} {timeouts:7} {score:6.1f}% {full or '':>7} {last or '':>7}")
    for p in problems:
        print(f"UNEXPLAINED {p}", file=sys.stderr)
    return 1 if problems else 0


def show(modules: list[Module], interpreters: dict[str, str]) -> int:
    """mutmut's diff of every survivor that the baseline does not justify."""
    baseline: dict[str, dict[str, str]] = _load_json(BASELINE, {})
    for module in modules:
        python = _interpreter(module, interpreters)
        if python is None:
            continue
        justified = baseline.get(module.name, {})
        for key, code in sorted(_results(module).items()):
            if code is None or code in _KILLED or code in _TIMEOUT or key in justified:
                continue  # None: not checked yet
            subprocess.call([python, "-c", _RUN_MUTMUT, "show", key], cwd=WORK / module.name)
    return 0


def _narrowed(modules: list[Module], only: list[str]) -> list[Module]:
    """``modules`` with ``--only``'s globs as the one module's functions."""
    if not only:
        return modules
    if len(modules) != 1:
        raise SystemExit("mutate: --only narrows one module; name exactly one")
    return [dataclasses.replace(modules[0], functions=tuple(only))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run mutmut on the named modules (all when none)")
    p_run.add_argument("modules", nargs="*")
    p_run.add_argument("--python", action="append", default=[], metavar="VENV=PATH",
                       help="the interpreter for modules that need an engine's venv, e.g. sglang=.venv-sglang/bin/python")
    p_run.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    only_help = "only the mutants whose names match one of these globs (one module)"
    p_run.add_argument("--only", nargs="+", default=[], metavar="GLOB", help=only_help)
    p_report = sub.add_parser("report", help="the per-module table; exit 1 on an unexplained survivor")
    p_report.add_argument("modules", nargs="*")
    p_report.add_argument("--markdown", action="store_true")
    p_report.add_argument("--python", action="append", default=[], metavar="VENV=PATH",
                          help="as for run: a module that needs a venv not given is not required to have results")
    p_report.add_argument("--only", nargs="+", default=[], metavar="GLOB", help=only_help)
    p_show = sub.add_parser("show", help="the diff of each survivor the baseline does not justify")
    p_show.add_argument("modules", nargs="*")
    p_show.add_argument("--python", action="append", default=[], metavar="VENV=PATH")
    p_show.add_argument("--only", nargs="+", default=[], metavar="GLOB", help=only_help)
    sub.add_parser("list", help="the modules")
    args = parser.parse_args(argv)
    if args.command == "list":
        for m in MODULES:
            print(f"{m.name}: {' '.join(m.files)} <- {' '.join(m.tests)}" + (f" [{m.venv}]" if m.venv else ""))
        return 0
    modules = _narrowed(_select(args.modules), args.only)
    interpreters = dict(item.split("=", 1) for item in args.python)  # --python VENV=PATH ...
    if args.command == "run":
        return run(modules, interpreters, args.max_children)
    if args.command == "show":
        return show(modules, interpreters)
    return report(modules, args.markdown, interpreters)


if __name__ == "__main__":
    sys.exit(main())
