"""Time to first token in vLLM's CPU build: a prefix served from kvtier's host
tier, against vLLM recomputing it and against vLLM's own device prefix cache.

    .venv-vllm/bin/python benchmarks/vllm_ttft.py [--prefix-blocks 1,4,12] [--repeats 3] [--json OUT]

A random-weight Llama is made locally (no download; ``--layers``, ``--hidden``
... set its size, about 107M parameters by default) and two engines run it,
each in a subprocess of this script (vLLM keeps process-wide state):

* vLLM alone: a prompt whose prefix nobody computed before (*recompute*), then
  a second prompt with the same prefix and another suffix (*device hit*: vLLM's
  own prefix cache).
* vLLM with kvtier's host tier (``KvtierConnector``): the first prompt (*kvtier
  miss*: recompute plus the store), then ``reset_prefix_cache()`` drops vLLM's
  device copy and the second prompt loads the prefix from kvtier (*host hit*).

Each prompt is ``n`` whole blocks of prefix plus ``--suffix`` tokens, one token
generated, with a request shorter than a block between the two (so that the
first one's store is submitted; see ``engine_run``; ``--back-to-back`` leaves
it out); a time is the wall time of that ``generate`` call, the median over
``--repeats`` prefixes (each new). Every request's cached tokens are checked:
a host-hit request must have loaded all ``n`` prefix blocks from kvtier, else
the script fails. It prints a markdown table; ``--json`` also writes the
figures. Time on a shared machine varies: read the ratios, measured in one run.
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


def make_model(path: Path, args: argparse.Namespace) -> int:
    """Save a random Llama of the asked size to ``path``; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.max_model_len,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return int(model.num_parameters())


def prompts(blocks: int, block: int, suffix: int, repeat: int, vocab: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing a new ``blocks``-block prefix (seeded by size and repeat)."""
    r = random.Random(blocks * 1000 + repeat)
    prefix = [r.randrange(1, vocab) for _ in range(blocks * block)]
    return prefix + [r.randrange(1, vocab) for _ in range(suffix)], prefix + [r.randrange(1, vocab) for _ in range(suffix)]


# -- one engine (a subprocess) ---------------------------------------------------------


def engine_run(plan: dict[str, Any]) -> dict[str, Any]:
    """Run ``plan`` in one engine; per prefix size, the timings and cached tokens."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # kvtier's worker counts are then readable here
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kvtier = plan["kvtier"]
    transfer = None
    if kvtier:
        transfer = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"cpu_bytes_to_use": plan["host_bytes"]},
        )
    llm = LLM(
        model=plan["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        block_size=plan["block"], max_model_len=plan["max_model_len"], seed=0,
        distributed_executor_backend="uni", kv_transfer_config=transfer,
    )
    sampling = SamplingParams(max_tokens=1, temperature=0.0)

    def ttft(ids: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sampling, use_tqdm=False)
        return time.perf_counter() - start, int(out.num_cached_tokens)

    def loaded() -> int:
        from kvtier.integrations.vllm import live_workers

        return sum(w.counts.blocks_loaded_from_host for w in live_workers())

    block, suffix, vocab = plan["block"], plan["suffix"], plan["vocab"]
    # Warm-up: the first request of each length pays one-time costs (kernels
    # for its shapes), so each length runs once, on a prefix not used again.
    for blocks in plan["prefix_blocks"]:
        ttft(prompts(blocks, block, suffix, -1, vocab)[0])
    llm.reset_prefix_cache()
    filler = [random.Random(-2).randrange(1, vocab) for _ in range(min(8, block - 1))]
    rows: dict[str, Any] = {}
    for blocks in plan["prefix_blocks"]:
        runs = []
        for repeat in range(plan["repeats"]):
            first, second = prompts(blocks, block, suffix, repeat, vocab)
            t_first, c_first = ttft(first)
            # A request shorter than a block (nothing to store) between them:
            # vLLM submits a store at the engine step after the one that
            # computed it, so without this the host hit would also wait for
            # the first request's store (it would still hit).
            if plan["filler"]:
                ttft(filler)
            if kvtier:
                llm.reset_prefix_cache()  # vLLM's device copy goes; kvtier's host copy stays
            before = loaded()
            t_second, c_second = ttft(second)
            runs.append({"first_s": t_first, "first_cached": c_first, "second_s": t_second,
                         "second_cached": c_second, "second_loaded_blocks": loaded() - before})
        rows[str(blocks)] = runs
    return {"rows": rows}


# -- the parent: both engines, the table --------------------------------------------------


def run_child(plan: dict[str, Any], work: Path, name: str, timeout_s: float) -> dict[str, Any]:
    plan_path, out_path, log_path = work / f"{name}.json", work / f"{name}.out.json", work / f"{name}.log"
    plan_path.write_text(json.dumps(plan))
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, __file__, "--child", str(plan_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text()[-4000:]
        raise SystemExit(f"the {name} engine exited {proc.returncode}; log tail:\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def table(plan: dict[str, Any], alone: dict[str, Any], kv: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The markdown table and its rows; `SystemExit` if a host hit did not load its prefix."""
    block, suffix = plan["block"], plan["suffix"]
    lines = [
        "| prompt tokens | prefix blocks | recompute (vLLM alone) | device hit (vLLM's prefix cache) "
        "| kvtier miss (recompute + store) | host hit (kvtier) | host hit speed-up | device hit speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for blocks in plan["prefix_blocks"]:
        a, k = alone["rows"][str(blocks)], kv["rows"][str(blocks)]
        for run in k:
            if run["second_cached"] != blocks * block or run["second_loaded_blocks"] != blocks:
                raise SystemExit(f"a host hit of {blocks} blocks got {run['second_cached']} cached tokens and "
                                 f"{run['second_loaded_blocks']} blocks loaded from kvtier; expected all")
        for run in a:
            if run["first_cached"] != 0 or run["second_cached"] != blocks * block:
                raise SystemExit(f"vLLM alone cached {run['first_cached']} then {run['second_cached']} tokens "
                                 f"of a {blocks}-block prefix; expected 0 then all")
        row = {
            "prompt_tokens": blocks * block + suffix, "prefix_blocks": blocks,
            "recompute_ms": 1000 * statistics.median(r["first_s"] for r in a),
            "device_hit_ms": 1000 * statistics.median(r["second_s"] for r in a),
            "kvtier_miss_ms": 1000 * statistics.median(r["first_s"] for r in k),
            "host_hit_ms": 1000 * statistics.median(r["second_s"] for r in k),
            "host_loaded_blocks": [r["second_loaded_blocks"] for r in k],
            "runs": {"alone": a, "kvtier": k},
        }
        row["host_speedup"] = row["recompute_ms"] / row["host_hit_ms"]
        row["device_speedup"] = row["recompute_ms"] / row["device_hit_ms"]
        rows.append(row)
        lines.append(
            f"| {row['prompt_tokens']} | {blocks} | {row['recompute_ms']:.0f} ms | {row['device_hit_ms']:.0f} ms "
            f"| {row['kvtier_miss_ms']:.0f} ms | {row['host_hit_ms']:.0f} ms | {row['host_speedup']:.1f}x "
            f"| {row['device_speedup']:.1f}x |"
        )
    return "\n".join(lines), rows


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        plan = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(engine_run(plan)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-blocks", default="1,4,12", help="prefix sizes in blocks, comma-separated")
    ap.add_argument("--suffix", type=int, default=20, help="tokens after the prefix (default 20)")
    ap.add_argument("--block", type=int, default=128, help="vLLM's block size (a multiple of 32 on CPU)")
    ap.add_argument("--repeats", type=int, default=5, help="prefixes per size; the median is reported")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each engine (default 1)")
    ap.add_argument("--back-to-back", action="store_true",
                    help="no request between the two: the host hit then also waits for the first one's store")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine")
    args = ap.parse_args()
    blocks = [int(b) for b in args.prefix_blocks.split(",")]
    if not blocks or min(blocks) < 1 or args.block % 32 or args.suffix < 1 or args.repeats < 1:
        ap.error("prefix sizes >= 1 block, a block size that is a multiple of 32, --suffix and --repeats >= 1")
    args.max_model_len = -(-(max(blocks) * args.block + args.suffix + 1) // args.block) * args.block
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as tmp:
        work = Path(tmp)
        params = make_model(work / "model", args)
        plan = {
            "model": str(work / "model"), "block": args.block, "suffix": args.suffix, "vocab": args.vocab,
            "prefix_blocks": blocks, "repeats": args.repeats, "max_model_len": args.max_model_len,
            "host_bytes": 1 << 30, "filler": not args.back_to_back,
        }
        started = time.perf_counter()
        alone = run_child({**plan, "kvtier": False}, work, "alone", args.timeout)
        kv = run_child({**plan, "kvtier": True}, work, "kvtier", args.timeout)
        text, rows = table(plan, alone, kv)
        seconds = time.perf_counter() - started
    print(f"random Llama, {params / 1e6:.1f}M parameters ({args.layers} layers, hidden {args.hidden}), float32, "
          f"block {args.block}, {args.threads} thread(s), one token generated, median of {args.repeats}"
          f"{', back to back' if args.back_to_back else ''}; "
          f"load average {os.getloadavg()[0]:.1f}; {seconds:.0f} s\n")
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"parameters": params, "args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
