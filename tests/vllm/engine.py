"""One vLLM engine run, as a subprocess of the tests (vLLM owns process-wide state).

    python engine.py RUN.json OUT.json

RUN.json: ``model`` (a directory), ``kv`` (None for no offloading, else
``{"connector": ..., "extra": {...}}``), ``num_gpu_blocks``, ``max_model_len``,
``multiprocessing`` (vLLM's V1 engine in its own process), and ``phases``: a list
of ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": n}``,
``{"op": "reset"}`` (drop vLLM's prefix cache, not kvtier's), ``{"op": "corrupt"}``
(flip every byte kvtier's host tier holds), ``{"op": "stats"}`` or
``{"op": "metrics"}`` (vLLM's ``vllm:kv_offload*`` Prometheus metrics; needs
``log_stats``: vLLM's stat loggers on).
``{"op": "shard_keys", "prompt": [ids...]}`` (for each full block of the
prompt, in order, the storage key of each rank's shard, hex; needs the engine
core in this process). Or, instead of
phases, ``bad_extras``: extra configs that must each fail at engine start.
``refused_kvs``: ``kv`` configs that must each fail to start in this process
before the run's own engine starts (``refused_starts`` in OUT.json, one error each);
a ``kv`` config's ``llm`` (and the run's) are more of ``LLM``'s arguments, such as
vLLM's ``kv_offloading_size``. Or ``lifetime``: ``{"engines": n, "prompts": [...],
"wait_s": s}``, engines made, used and dropped one after the other (``lifetime`` in
OUT.json: what each drop left, see `lifetime`).

OUT.json: engine start seconds, per phase the outputs (token ids, logprobs,
num_cached_tokens, seconds per request), and kvtier's worker statistics (with
parallel workers, asked of each worker process in rank order), and ``after_drop``:
what the process still runs once the engine was dropped. A failed start writes ``{"error": ...}``;
``bad_extras`` writes ``{"errors": [...]}``, one per config (None: it started).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(run_path: str, out_path: str) -> int:
    with open(run_path) as f:
        run = json.load(f)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if run.get("multiprocessing") else "0"
    import logging

    # kvtier's events go through the standard library: its info and up into this engine's log.
    logging.basicConfig(format="%(levelname)s %(name)s %(message)s")
    logging.getLogger("kvtier").setLevel(logging.INFO)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    def transfer_config(kv: dict | None) -> KVTransferConfig | None:
        if kv is None:
            return None
        ours = kv["connector"] == "KvtierConnector"
        return KVTransferConfig(
            kv_connector=kv["connector"],
            kv_connector_module_path="kvtier.integrations.vllm" if ours else None,
            kv_role="kv_both",
            kv_load_failure_policy="recompute" if ours else "fail",
            kv_connector_extra_config=kv["extra"],
        )
    tp, pp = run.get("tensor_parallel_size", 1), run.get("pipeline_parallel_size", 1)
    parallel = tp * pp > 1
    # vLLM's CPU model runner allocates the buffer a later pipeline stage
    # receives its inputs in only in its warm-up pass, which it runs only
    # when compiling: in eager mode a second stage fails its first step
    # (`assert self.intermediate_tensors is not None`). So pipeline parallel
    # engines compile (torch.compile; slower to start).
    eager = run.get("eager", pp == 1)

    def engine(kv: KVTransferConfig | None, **llm_args: object) -> LLM:
        # vLLM's own offloading flags: kv_offloading_size (GiB), kv_offloading_backend.
        llm_args = {**run.get("llm", {}), **llm_args}
        return LLM(
            model=run["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=eager,
            block_size=32,
            max_model_len=run.get("max_model_len", 256), seed=0,
            distributed_executor_backend="mp" if parallel else "uni",
            tensor_parallel_size=tp, pipeline_parallel_size=pp,
            num_gpu_blocks_override=run.get("num_gpu_blocks"), kv_transfer_config=kv,
            disable_log_stats=not run.get("log_stats", False), **llm_args,
        )

    out: dict = {"phases": []}
    if "bad_extras" in run:
        # Configurations that must fail at engine start, tried one after the
        # other in this process (an engine that fails to start leaves nothing).
        out["errors"] = []
        for extra in run["bad_extras"]:
            try:
                engine(transfer_config({**run["kv"], "extra": extra}))
            except Exception as exc:
                out["errors"].append(f"{type(exc).__name__}: {exc}")
            else:
                out["errors"].append(None)
        with open(out_path, "w") as f:
            json.dump(out, f)
        return 0
    if "lifetime" in run:
        out["lifetime"] = lifetime(run["lifetime"], lambda: engine(transfer_config(run["kv"])))
        with open(out_path, "w") as f:
            json.dump(out, f)
        return 0
    # Starts that must fail, in this process, before the run's own engine
    # (which must then start as if they had not happened).
    out["refused_starts"] = []
    for kv in run.get("refused_kvs", []):
        try:
            engine(transfer_config(kv), **kv.get("llm", {}))
        except Exception as exc:
            out["refused_starts"].append(f"{type(exc).__name__}: {exc}")
        else:
            out["refused_starts"].append(None)
    start = time.perf_counter()
    try:
        llm = engine(transfer_config(run.get("kv")))
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        with open(out_path, "w") as f:
            json.dump(out, f)
        return 3
    out["start_s"] = time.perf_counter() - start

    def workers():
        if run.get("multiprocessing") or parallel:
            return []
        from kvtier.integrations.vllm import live_workers
        return live_workers()

    def statistics() -> list:
        if parallel and not run.get("multiprocessing"):
            # Each worker process is asked for its own kvtier worker's statistics, in rank order.
            return [s for per_rank in llm.collective_rpc(_worker_statistics) for s in per_rank]
        return [w.statistics() for w in workers()]

    for phase in run["phases"]:
        op = phase["op"]
        record: dict = {"op": op}
        if op == "generate":
            sp = SamplingParams(max_tokens=phase.get("max_tokens", 8), temperature=0.0, logprobs=3, seed=0)
            outputs = []
            for ids in phase["prompts"]:
                t = time.perf_counter()
                (res,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
                seconds = time.perf_counter() - t
                comp = res.outputs[0]
                outputs.append({
                    "token_ids": list(comp.token_ids),
                    "logprobs": [{str(k): v.logprob for k, v in sorted(step.items())} for step in comp.logprobs],
                    "num_cached_tokens": res.num_cached_tokens,
                    "seconds": seconds,
                })
            record["outputs"] = outputs
        elif op == "reset":
            record["ok"] = llm.reset_prefix_cache()
        elif op == "corrupt":
            import torch

            n = 0
            for w in workers():
                host = w.group["kv"].host
                for p in range(len(host.planes)):
                    buf = host.buffer(p)
                    buf.view(-1).view(torch.uint8).bitwise_not_()
                    n += buf.numel()
            record["corrupted_elements"] = n
        elif op == "metrics":
            # vLLM's Prometheus metrics (what /metrics serves), kv offload ones only.
            record["metrics"] = [
                {"name": m.name, "labels": m.labels, "value": getattr(m, "value", None)}
                for m in llm.get_metrics() if m.name.startswith("vllm:kv_offload")
            ]
        elif op == "stats":
            record["workers"] = statistics()
        elif op == "shard_keys":
            from vllm.v1.kv_offload.base import make_offload_key
            from vllm.v1.request import Request

            from kvtier.integrations.vllm import KvtierOffloadingManager

            # vLLM's block hashes of the prompt, as its engine core computes them, in block order.
            core = llm.llm_engine.engine_core.engine_core
            request = Request("shard-keys", phase["prompt"], SamplingParams(max_tokens=1), None,
                              block_hasher=core.request_block_hasher)
            manager = core.scheduler.connector.connector_scheduler.manager
            assert isinstance(manager, KvtierOffloadingManager) and manager._store is not None
            keys = [make_offload_key(h, 0) for h in request.block_hashes]
            missing = [i for i, k in enumerate(keys) if k not in manager._blocks]
            assert not missing, f"blocks {missing} of the prompt are not kvtier's"
            record["blocks"] = [[s.hex() for s in manager._store.shard_keys(k)] for k in keys]
        else:
            raise ValueError(f"unknown phase op {op!r}")
        out["phases"].append(record)
    out["stats"] = statistics()
    del llm
    import gc

    gc.collect()
    out["after_drop"] = leftovers()
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


def _worker_refs() -> list:
    """Weak references to this process's kvtier workers and their host pools."""
    import weakref

    from kvtier.integrations.vllm import live_workers

    refs = []
    for w in live_workers():
        refs += [weakref.ref(w), weakref.ref(w.group["kv"].host)]
        if w.staging is not None:
            refs.append(weakref.ref(w.staging["kv"].host))
    return refs


def leftovers() -> dict:
    """What this process still runs after its engine was dropped: kvtier's
    threads, kvtier's vLLM workers, child processes (vLLM's engine core)."""
    import threading

    import psutil

    from kvtier.integrations.vllm import live_workers

    children = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "multiprocessing.resource_tracker" not in command:  # Python's, for the life of this process
            children.append(command)
    return {
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("kvtier")),
        "workers": len(live_workers()),
        "children": children,
    }


def lifetime(spec: dict, make: object) -> dict:
    """Make, use and drop ``spec["engines"]`` engines one after the other in
    this process (``del llm; gc.collect()``); after each drop, what is left
    (`leftovers`) and whether its kvtier workers and their host pools are
    still alive (weak references, taken while the engine ran). Then wait up
    to ``spec["wait_s"]`` for kvtier's idle threads to end (the copy thread
    of a scheduler ends 30 s after its last batch)."""
    import gc
    import threading
    import time

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm import live_workers

    drops = []
    for i in range(spec["engines"]):
        llm = make()  # type: ignore[operator]
        sp = SamplingParams(max_tokens=2, temperature=0.0)
        for prompt in spec["prompts"]:
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
        refs = _worker_refs()
        running = len(live_workers())
        del llm
        gc.collect()
        drops.append({"workers_while_running": running, "objects": len(refs),
                      "objects_alive": sum(r() is not None for r in refs), **leftovers()})
    end = time.monotonic() + spec.get("wait_s", 60)
    while time.monotonic() < end and any(t.name.startswith("kvtier") for t in threading.enumerate()):
        time.sleep(0.5)
    return {"drops": drops, "final": leftovers()}


def _worker_statistics(worker: object) -> list:
    """Run in a worker process (``collective_rpc``): its kvtier workers' statistics."""
    from kvtier.integrations.vllm import live_workers

    return [w.statistics() for w in live_workers()]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
