#!/usr/bin/env bash
# kvtier's device check in one call, on a GPU machine as it is (see docs/gpu.md).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]    # OUT_DIR defaults to $OUT, else /tmp/kvtier-gpu-check
#
# 1. installs the pure-Python wheels carried in .gpu-wheels/ (`make gpu-wheels`
#    downloads them) into a scratch folder for the machine's own python3, which
#    keeps its own torch; kvtier itself is imported from this tree;
# 2. probes python, torch and CUDA (env.json); without CUDA it stops there;
# 3. runs the gpu tests (tests.log, tests.xml);
# 4. runs benchmarks/gpu_check.py (bench.json, bench.log).
#
# What comes back from a lent machine is cut (a few files, the end of stdout),
# so OUT_DIR holds at most 6 files: gpu_check.json (the whole result, compact),
# tests.log, tests.xml and logs.tar.gz (everything else), rewritten after every
# stage and every 15 s within one; stage logs live in a scratch folder until
# packed. Stdout is a line per stage and ends with the verdict block (under
# 2,000 characters: status, every reason, the headline ratios). Every stage runs under `timeout`, within
# GPU_CHECK_BUDGET_S seconds in all (default 290). Exit status 0 only when the
# verdict passed. GPU_CHECK_PLANT=bytes plants a byte fault in every copy the
# benchmark checks: the verdict must then fail, naming every case.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-${TMPDIR:-/tmp}/kvtier-gpu-check}}"
PY="${GPU_CHECK_PYTHON:-python3}"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.gpu-wheels}"
BUDGET="${GPU_CHECK_BUDGET_S:-290}"
TESTS_MAX_S="${GPU_CHECK_TESTS_S:-100}"
BENCH_MAX_S="${GPU_CHECK_BENCH_S:-250}"
REFRESH_S="${GPU_CHECK_REFRESH_S:-15}"
export GPU_CHECK_BUDGET_S="$BUDGET"
START=$(date +%s)

mkdir -p "$OUT_DIR" || { echo "cannot create $OUT_DIR" >&2; exit 2; }
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
rm -f "$OUT_DIR/gpu_check.json" "$OUT_DIR"/gpu_check.json.*.tmp "$OUT_DIR/tests.xml" "$OUT_DIR/tests.log" \
    "$OUT_DIR/logs.tar.gz" "$OUT_DIR"/.*.part
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvtier-gpu-work.XXXXXX")"
SITE="$(mktemp -d "${TMPDIR:-/tmp}/kvtier-gpu-site.XXXXXX")"
STAGES="$WORK/stages.tsv"
: > "$STAGES"

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( START + BUDGET - $(date +%s) )); }

# The last resort when even the summary script cannot run.
fallback_json() {
    printf '{"ok": false, "status": "%s", "failed": ["summary"], "error": "benchmarks/gpu_check_summary.py failed (see summary.log in logs.tar.gz)", "elapsed_s": %s}\n' \
        "$1" "$(elapsed)" > "$OUT_DIR/gpu_check.json"
    if [ "$1" != running ]; then
        printf '==== kvtier device check: %s (not ok) ====\nreasons (1):\n 1. the summary script failed; see summary.log in logs.tar.gz\n==== end of verdict ====\n' \
            "$(echo "$1" | tr a-z A-Z)"
    fi
}

# Copy what OUT_DIR keeps, and pack the rest (small files, a fraction of a second).
pack() {
    local f
    for f in tests.log tests.xml; do
        [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT_DIR/.$f.part" && mv -f "$OUT_DIR/.$f.part" "$OUT_DIR/$f"
    done
    tar -czf "$WORK.$BASHPID.tgz" -C "$WORK" . 2>/dev/null && mv -f "$WORK.$BASHPID.tgz" "$OUT_DIR/logs.tar.gz"
    rm -f "$WORK.$BASHPID.tgz"
}

summarize() {  # running | done | interrupted
    if ! timeout -k 2 20 "$PY" "$ROOT/benchmarks/gpu_check_summary.py" "$WORK" "$OUT_DIR" "$1" "$(elapsed)" \
            > "$WORK/verdict.txt" 2> "$WORK/summary.log"; then
        fallback_json "$1" > "$WORK/verdict.txt"
    fi
    pack
    if [ "$1" != running ]; then
        cat "$WORK/verdict.txt"
    fi
}

record() {  # name rc seconds log [note]
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >> "$STAGES"
    echo "[$(printf '%4d' "$(elapsed)") s] $1: exit $2 after $3 s${5:+ ($5)}"
    summarize running
}

# stage NAME LIMIT_S LOG COMMAND...: run under timeout, record, return its status.
# The command runs in the background and is waited for, so that a signal to
# this script is handled at once (bash defers traps while a foreground child runs).
CHILD=
TICKER=
stop_ticker() {
    if [ -n "$TICKER" ]; then
        touch "$WORK/.stop"
        wait "$TICKER" 2>/dev/null
        rm -f "$WORK/.stop"
        TICKER=
    fi
}
stage() {
    local name=$1 limit=$2 log=$3 t0 rc
    shift 3
    if [ "$limit" -lt 5 ]; then
        record "$name" 124 0 "$log" "no time left in the ${BUDGET} s budget"
        return 124
    fi
    printf '%s\t%s\n' "$name" "$(elapsed)" > "$WORK/current_stage"
    summarize running
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$WORK/$log" 2>&1 &
    CHILD=$!
    # Refresh OUT_DIR every REFRESH_S (15) s while the stage runs: a run killed outright
    # (SIGKILL, no trap) still leaves the logs and bench.json so far.
    # It stops only between refreshes (stop_ticker), so that no two write at once.
    (
        trap - TERM INT
        n=0
        while [ ! -e "$WORK/.stop" ]; do
            sleep 1
            n=$((n + 1))
            if [ "$n" -ge "$REFRESH_S" ] && [ ! -e "$WORK/.stop" ]; then summarize running; n=0; fi
        done
    ) > /dev/null 2>&1 &
    TICKER=$!
    wait "$CHILD"
    rc=$?
    stop_ticker
    CHILD=
    rm -f "$WORK/current_stage"
    record "$name" "$rc" $(( $(date +%s) - t0 )) "$log"
    return $rc
}

cleanup() { stop_ticker; rm -rf "$SITE" "$WORK" "$WORK".*.tgz "$OUT_DIR"/.*.part "$OUT_DIR"/gpu_check.json.*.tmp; }
on_signal() {
    trap - TERM INT
    stop_ticker
    if [ -n "$CHILD" ]; then
        kill -TERM "$CHILD" 2>/dev/null  # timeout passes it on to the stage's command
        wait "$CHILD" 2>/dev/null
    fi
    record interrupted 143 0 - "signal received after $(elapsed) s"
    summarize interrupted
    cleanup
    exit 143
}
trap on_signal TERM INT
trap cleanup EXIT

export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$ROOT"

# GPU_CHECK_DEVICE=cpu: the whole pipeline without a device, as a smoke test of
# the check itself (the gpu tests skip; the benchmark's figures mean nothing).
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
if [ "$DEVICE" = cpu ]; then
    printf '{"smoke": true}\n' > "$WORK/smoke.json"
fi

# -- 1. what the machine is, and the wheels -----------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 20 nvidia-smi > "$WORK/nvidia-smi.log" 2>&1
else
    echo "nvidia-smi not found" > "$WORK/nvidia-smi.log"
fi

install_wheels() {
    shopt -s nullglob
    local all=("$WHEELS"/*.whl)
    shopt -u nullglob
    if [ ${#all[@]} -eq 0 ]; then
        echo "no wheels in $WHEELS: run 'make gpu-wheels' where a package index is reachable, and carry .gpu-wheels"
        return 3
    fi
    # Which wheels this python takes: a wheel built for another CPython (cp312 on
    # 3.11) would be unpacked below and fail at its first import; say so here.
    local report fit_rc line wheels=()
    report="$("$PY" "$ROOT/benchmarks/gpu_check_summary.py" --fit-wheels "$WHEELS")"
    fit_rc=$?
    while IFS= read -r line; do
        case "$line" in
            "fits "*) wheels+=("${line#fits }") ;;
            ?*) echo "$line" ;;
        esac
    done <<< "$report"
    echo "installing ${#wheels[@]} of ${#all[@]} wheels into $SITE (python $("$PY" -c 'import sys; print(sys.version.split()[0])'))"
    if [ ${#wheels[@]} -gt 0 ] && ! "$PY" -m pip install --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}"; then
        # pip missing or refusing: a pure-Python wheel is a zip of importable files.
        echo "pip failed; unpacking the wheels instead"
        "$PY" - "$SITE" "${wheels[@]}" <<'EOF'
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
    print("unpacked", w)
EOF
    fi
    if [ "$fit_rc" -ne 0 ]; then
        echo "install: $((${#all[@]} - ${#wheels[@]})) carried wheel(s) do not fit this python (above): carry wheels built for it, or set GPU_CHECK_PYTHON to a python they fit"
        return 4
    fi
}
export -f install_wheels
export PY WHEELS SITE WORK ROOT
if [ "$WHEELS" = none ]; then
    # GPU_CHECK_WHEELS=none: the python in use has every package already (a CPU venv).
    record install 0 0 - "skipped: GPU_CHECK_WHEELS=none"
else
    stage install 60 install.log bash -c install_wheels
fi

# -- 2. python, torch, CUDA ---------------------------------------------------
probe() {
    "$PY" - "$WORK/env.json" <<'EOF'
import importlib, json, os, sys
doc = {"python": sys.version.split()[0], "executable": sys.executable}
def version(mod):
    try:
        m = importlib.import_module(mod)
        return getattr(m, "__version__", "present"), getattr(m, "__file__", None)
    except Exception as exc:
        return None, repr(exc)
doc["packages"] = {m: version(m)[0] for m in ("anyio", "structlog", "pytest", "pytest_asyncio", "blockbuster", "redis", "hypothesis", "uvloop")}
try:
    import torch
    doc["torch"] = torch.__version__
    doc["torch_cuda"] = torch.version.cuda
    doc["cuda_available"] = bool(torch.cuda.is_available())
    if doc["cuda_available"]:
        doc["device"] = torch.cuda.get_device_name(0)
        doc["device_count"] = torch.cuda.device_count()
        free, total = torch.cuda.mem_get_info()
        doc["device_memory_gib"] = {"free": free / 2**30, "total": total / 2**30}
except Exception as exc:
    doc["torch_error"] = repr(exc)
    doc["cuda_available"] = None
kv_version, kv_file = version("kvtier")
doc["kvtier"] = {"version": kv_version, "from": kv_file}
json.dump(doc, open(sys.argv[1], "w"), indent=2)
print(json.dumps(doc, indent=2))
sys.exit(0 if doc.get("cuda_available") is not None and kv_version else 1)
EOF
}
export -f probe
stage probe 60 probe.log bash -c probe
cuda=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('cuda_available'))" "$WORK/env.json" 2>/dev/null)

if [ "$cuda" = "True" ] || [ "$DEVICE" = cpu ]; then
    # -- 3. the gpu tests -----------------------------------------------------
    limit=$(left)
    [ "$limit" -gt "$TESTS_MAX_S" ] && limit=$TESTS_MAX_S
    # Only the plugins the suite needs: whatever else the machine's python3 has
    # installed (hypothesis's, say, built for an older pytest) stays out.
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 stage tests "$limit" tests.log "$PY" -m pytest \
        -p pytest_asyncio.plugin -p pytest_timeout -p no:cacheprovider -o timeout=60 -v -rA \
        --junitxml="$WORK/tests.xml" -m gpu tests/test_gpu.py

    # -- 4. the benchmark -----------------------------------------------------
    limit=$(( $(left) - 15 ))
    [ "$limit" -gt "$BENCH_MAX_S" ] && limit=$BENCH_MAX_S
    stage bench "$limit" bench.log "$PY" benchmarks/gpu_check.py --device "$DEVICE" --json "$WORK/bench.json" \
        --deadline-s $(( limit > 30 ? limit - 20 : limit / 2 ))
else
    record tests 0 0 - "not run: no CUDA device, or torch did not import (see env.json)"
    record bench 0 0 - "not run: no CUDA device, or torch did not import (see env.json)"
fi

# -- 5. the document ----------------------------------------------------------
summarize done
ok=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('ok'))" "$OUT_DIR/gpu_check.json" 2>/dev/null)
[ "$ok" = "True" ]
