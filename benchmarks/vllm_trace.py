"""kvtier's store admission and host eviction policies on a trace, in vLLM's CPU build.

    .venv-vllm/bin/python benchmarks/vllm_trace.py [--prefixes 24] [--shares 0,0.5,0.9] [--repeats 3] [--json OUT]

The trace mixes *repeated* prompts, whose prefix (``--prefix-blocks`` whole
blocks) is drawn from ``--prefixes`` prefixes by a Zipf law (exponent
``--zipf``), with *one-shot* prompts whose prefix nobody sends again, at each
one-shot share of ``--shares``; every prompt ends in ``--suffix`` tokens of its
own and generates one token, sent one at a time. Each share runs
``--repeated`` repeated prompts (and as many one-shots as the share asks), with
new prefixes in each repeat. kvtier's host tier holds ``--host-share`` of the
repeated prefixes' blocks (smaller than the working set) and vLLM's device
cache a few prompts (``--device-blocks``), so most reuse must come from kvtier.
With ``--store`` (the default) blocks are also written through to a FileStore
and a miss on the host is looked up there.

Four engines, one per policy pair (store-all + LRU, frequency gate + LRU,
store-all + SLRU, gate + SLRU), each a subprocess of this script run on the
same traces; between runs kvtier's host tier, vLLM's prefix cache and the gate
are reset. Per share and pair, the medians over ``--repeats``:

* hit rate on repeated prefixes: cached prefix tokens over the prefix tokens
  of repeated prompts whose prefix was sent before in that run (a prefix's
  first time is a miss for every policy), and of those the part loaded from
  kvtier's host tier; overall: cached tokens over all prompt tokens;
* MiB copied to kvtier's host tier and written through to the store;
* time to first token (the ``generate`` call of one prompt, one token), median
  and p90, and throughput in prompt tokens per second of the run.

A random-weight Llama is made locally (no download). Prints a markdown table;
``--json`` also writes the figures. Timings on a shared machine vary: compare
the pairs of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from vllm_ttft import make_model  # noqa: E402

PAIRS = {
    "store-all + LRU": {"store_admission": "all", "host_eviction": "lru"},
    "gate + LRU": {"store_admission": "frequency", "host_eviction": "lru"},
    "store-all + SLRU": {"store_admission": "all", "host_eviction": "slru"},
    "gate + SLRU": {"store_admission": "frequency", "host_eviction": "slru"},
}


def trace(share: float, repeat: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """One run's prompts: ``repeated`` Zipf-drawn repeated prompts and one-shots mixed in at ``share``."""
    r = random.Random(f"{share}-{repeat}-{args['seed']}")
    block, vocab, n = args["block"], args["vocab"], args["prefixes"]
    tokens = args["prefix_blocks"] * block
    weights = [1.0 / (k + 1) ** args["zipf"] for k in range(n)]
    prefixes = [[r.randrange(1, vocab) for _ in range(tokens)] for _ in range(n)]
    one_shots = round(args["repeated"] * share / (1 - share)) if share < 1 else 0
    kinds = ["repeated"] * args["repeated"] + ["one-shot"] * one_shots
    r.shuffle(kinds)
    seen: set[int] = set()
    out = []
    for kind in kinds:
        suffix = [r.randrange(1, vocab) for _ in range(args["suffix"])]
        if kind == "one-shot":
            out.append({"ids": [r.randrange(1, vocab) for _ in range(tokens)] + suffix, "kind": kind, "reuse": False})
        else:
            (k,) = r.choices(range(n), weights)
            out.append({"ids": prefixes[k] + suffix, "kind": kind, "reuse": k in seen})
            seen.add(k)
    return out


# -- one engine (a subprocess) ---------------------------------------------------------


def engine_run(plan: dict[str, Any]) -> dict[str, Any]:
    """Every share and repeat of ``plan`` through one engine with one policy pair."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # kvtier's manager and worker are then in this process
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm import live_workers
    from kvtier.policies import CountedAdmission, make_admission

    options = {"host_blocks": plan["host_blocks"], **plan["pair"]}
    if plan["store_path"]:
        options["store_path"] = plan["store_path"]
    if plan.get("redis_url"):
        options["redis_url"] = plan["redis_url"]
    transfer = KVTransferConfig(
        kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config={"kvtier": options},
    )
    llm = LLM(
        model=plan["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        block_size=plan["block"], max_model_len=plan["max_model_len"], seed=0, distributed_executor_backend="uni",
        num_gpu_blocks_override=plan["device_blocks"], kv_transfer_config=transfer,
    )
    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
    (worker,) = live_workers()
    sampling = SamplingParams(max_tokens=1, temperature=0.0)

    def counts() -> dict[str, int]:
        c = worker.counts
        return {"stored": c.blocks_stored, "written": c.blocks_written_through,
                "from_host": c.blocks_loaded_from_host, "from_store": c.blocks_loaded_from_store,
                "failed": c.blocks_failed + c.blocks_refused}

    def generate(ids: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sampling, use_tqdm=False)
        return time.perf_counter() - start, int(out.num_cached_tokens)

    def settled(read: Any) -> dict[str, int]:
        """The counts once the run's last stores and write-throughs landed: a
        request shorter than a block (nothing to store) makes vLLM submit the
        last prompt's store, then the counts must hold still for 0.3 s."""
        generate([1] * (plan["block"] // 2))
        last, still = read(), time.monotonic()
        while time.monotonic() - still < 0.3:
            time.sleep(0.05)
            now = read()
            if now != last:
                last, still = now, time.monotonic()
        return last

    warm = random.Random(-1)
    for _ in range(3):  # one-time costs of the shapes, on prompts not used again
        generate([warm.randrange(1, plan["vocab"]) for _ in range(plan["prefix_blocks"] * plan["block"] + plan["suffix"])])
    runs: dict[str, list[dict[str, Any]]] = {}
    for share in plan["shares"]:
        for repeat in range(plan["repeats"]):
            llm.reset_prefix_cache(reset_connector=True)  # vLLM's device cache and kvtier's host tier
            manager.admission = CountedAdmission(make_admission(
                plan["pair"]["store_admission"], sightings=plan["sightings"], window=plan["window"],
            ) if plan["pair"]["store_admission"] == "frequency" else make_admission("all"))
            before = counts()
            requests = []
            start = time.perf_counter()
            for req in trace(share, repeat, plan):
                seconds, cached = generate(req["ids"])
                requests.append({"kind": req["kind"], "reuse": req["reuse"], "tokens": len(req["ids"]),
                                 "cached": cached, "s": seconds})
            wall = time.perf_counter() - start
            after = settled(counts)
            skipped = manager.admission.statistics().skipped
            runs.setdefault(str(share), []).append({
                "requests": requests, "wall_s": wall, "counts": {k: after[k] - before[k] for k in after},
                "skipped": {f"{t}:{r}": n for (t, r), n in skipped.items()},
            })
    return {"runs": runs, "block_bytes": worker.block_bytes}


# -- the parent: every pair, the table ---------------------------------------------------


def run_child(plan: dict[str, Any], work: Path, name: str, timeout_s: float) -> dict[str, Any]:
    plan_path, out_path, log_path = work / f"{name}.json", work / f"{name}.out.json", work / f"{name}.log"
    plan_path.write_text(json.dumps(plan))
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, __file__, "--child", str(plan_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if proc.returncode != 0 or not out_path.exists():
        raise SystemExit(f"the {name!r} engine exited {proc.returncode}; log tail:\n{log_path.read_text()[-4000:]}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


FIGURES = ("hit_repeated", "hit_overall", "host_share_of_loads", "mib_to_host", "mib_to_store", "ttft_median_ms",
           "ttft_p90_ms", "tokens_per_s", "requests", "failed_blocks")
"""What `summarize` gives per run, and `table` the median of."""


def summarize(run: dict[str, Any], prefix_tokens: int, block_bytes: int) -> dict[str, Any]:
    """One run's figures (see the module docstring)."""
    reqs = run["requests"]
    reuse = [r for r in reqs if r["reuse"]]
    reuse_tokens = len(reuse) * prefix_tokens
    c = run["counts"]
    times = sorted(r["s"] for r in reqs)
    loaded = c["from_host"] + c["from_store"]
    return {
        "hit_repeated": sum(min(r["cached"], prefix_tokens) for r in reuse) / reuse_tokens if reuse_tokens else 0.0,
        "hit_overall": sum(r["cached"] for r in reqs) / sum(r["tokens"] for r in reqs),
        "host_share_of_loads": c["from_host"] / loaded if loaded else 0.0,
        "mib_to_host": c["stored"] * block_bytes / 2**20,
        "mib_to_store": c["written"] * block_bytes / 2**20,
        "ttft_median_ms": 1000 * statistics.median(times),
        "ttft_p90_ms": 1000 * times[min(len(times) - 1, int(0.9 * len(times)))],
        "tokens_per_s": sum(r["tokens"] for r in reqs) / run["wall_s"],
        "requests": len(reqs),
        "failed_blocks": c["failed"],
        "blocks": dict(c),
    }


def table(plan: dict[str, Any], results: dict[str, dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    prefix_tokens = plan["prefix_blocks"] * plan["block"]
    lines = [
        "| one-shot share | policies | hit rate, repeated prefixes | of which from host | hit rate, overall "
        "| MiB to host | MiB to store | TTFT median | TTFT p90 | prompt tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for share in plan["shares"]:
        for name, result in results.items():
            per_run = [summarize(run, prefix_tokens, result["block_bytes"]) for run in result["runs"][str(share)]]
            row: dict[str, Any] = {"share": share, "policies": name,
                                   **{k: statistics.median(r[k] for r in per_run) for k in FIGURES},
                                   "runs": per_run}
            rows.append(row)
            lines.append(
                f"| {share:.0%} | {name} | {row['hit_repeated']:.1%} | {row['host_share_of_loads']:.0%} "
                f"| {row['hit_overall']:.1%} | {row['mib_to_host']:.1f} | {row['mib_to_store']:.1f} "
                f"| {row['ttft_median_ms']:.1f} ms | {row['ttft_p90_ms']:.1f} ms | {row['tokens_per_s']:.0f} |"
            )
    return "\n".join(lines), rows


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        plan = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(engine_run(plan)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", type=int, default=24, help="distinct repeated prefixes (Zipf-drawn)")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent over the prefixes (default 1.0)")
    ap.add_argument("--prefix-blocks", type=int, default=4, help="blocks per prefix (default 4)")
    ap.add_argument("--suffix", type=int, default=16, help="tokens after the prefix, new in every prompt")
    ap.add_argument("--repeated", type=int, default=60, help="repeated prompts per run (default 60)")
    ap.add_argument("--shares", default="0,0.5,0.9", help="one-shot shares, comma-separated, each in [0, 1)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per share; medians are reported")
    ap.add_argument("--host-share", type=float, default=0.5,
                    help="kvtier's host tier as a share of the repeated prefixes' blocks (default 0.5)")
    ap.add_argument("--device-blocks", type=int, default=0,
                    help="vLLM's device cache in blocks (default: two prompts' worth)")
    ap.add_argument("--sightings", type=int, default=2, help="the gate's admission_sightings (default 2)")
    ap.add_argument("--window", type=int, default=65536, help="the gate's admission_window (default 65536)")
    ap.add_argument("--no-store", dest="store", action="store_false", help="host tier only, no FileStore")
    ap.add_argument("--redis-maxmemory", type=int, default=0, metavar="MIB",
                    help="instead of a FileStore, a redis-server of this many MiB that evicts (allkeys-lru), "
                         "a fresh one per pair: a store under capacity")
    ap.add_argument("--block", type=int, default=32, help="vLLM's block size (a multiple of 32 on CPU)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each engine (default 1)")
    ap.add_argument("--pairs", default=",".join(PAIRS), help="policy pairs to run, comma-separated")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine")
    args = ap.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    pairs = [p.strip() for p in args.pairs.split(",")]
    if (not shares or not all(0 <= s < 1 for s in shares) or args.prefixes < 1 or args.prefix_blocks < 1
            or args.repeated < 1 or args.repeats < 1 or args.block % 32 or not 0 < args.host_share
            or args.suffix < 1 or any(p not in PAIRS for p in pairs)):
        ap.error(f"shares in [0, 1), positive sizes, a block size that is a multiple of 32, pairs among {list(PAIRS)}")
    prompt_tokens = args.prefix_blocks * args.block + args.suffix
    max_model_len = -(-(prompt_tokens + 1) // args.block) * args.block
    per_prompt = max_model_len // args.block
    host_blocks = max(1, round(args.host_share * args.prefixes * args.prefix_blocks))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    with tempfile.TemporaryDirectory(prefix="kvtier-trace-") as tmp:
        work = Path(tmp)
        params = make_model(work / "model", argparse.Namespace(**{**vars(args), "max_model_len": max_model_len}))
        plan: dict[str, Any] = {
            "model": str(work / "model"), "block": args.block, "suffix": args.suffix, "vocab": args.vocab,
            "prefixes": args.prefixes, "zipf": args.zipf, "prefix_blocks": args.prefix_blocks,
            "repeated": args.repeated, "shares": shares, "repeats": args.repeats, "seed": args.seed,
            "max_model_len": max_model_len, "device_blocks": args.device_blocks or 2 * per_prompt,
            "host_blocks": host_blocks, "sightings": args.sightings, "window": args.window,
        }
        started = time.perf_counter()
        results = {}
        for i, name in enumerate(pairs):
            pair = dict(PAIRS[name])
            if pair["store_admission"] == "frequency":
                pair.update(admission_sightings=args.sightings, admission_window=args.window)
            store = work / f"store-{i}"
            store.mkdir()
            if args.redis_maxmemory:
                from kvtier.testing.redis_server import LocalRedisServer

                extra = ("--maxmemory", f"{args.redis_maxmemory}mb", "--maxmemory-policy", "allkeys-lru")
                with LocalRedisServer(store, extra_args=extra) as redis:
                    results[name] = run_child({**plan, "pair": pair, "store_path": None, "redis_url": redis.url},
                                              work, f"pair-{i}", args.timeout)
                continue
            results[name] = run_child({**plan, "pair": pair, "store_path": str(store) if args.store else None},
                                      work, f"pair-{i}", args.timeout)
        if args.json is not None:  # the raw runs first, so that a failure below loses nothing
            args.json.with_suffix(".raw.json").write_text(json.dumps({"plan": plan, "results": results}))
        text, rows = table(plan, results)
        seconds = time.perf_counter() - started
    store_kind = (f"Redis of {args.redis_maxmemory} MiB (allkeys-lru)" if args.redis_maxmemory
                  else "FileStore" if args.store else "no store")
    print(f"random Llama, {params / 1e6:.1f}M parameters ({args.layers} layers, hidden {args.hidden}), float32, "
          f"block {args.block}; {args.prefixes} prefixes of {args.prefix_blocks} blocks (Zipf {args.zipf}), "
          f"{args.repeated} repeated prompts per run; host tier {host_blocks} blocks, device {plan['device_blocks']}; "
          f"{store_kind}; gate: {args.sightings} sightings, window {args.window}; "
          f"median of {args.repeats}; load average {os.getloadavg()[0]:.1f}; {seconds:.0f} s\n")
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"parameters": params, "plan": plan, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
