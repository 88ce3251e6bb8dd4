"""What an engine pays for kvtier, in vLLM's CPU build: throughput and time to
first token on a workload with no reuse, kvtier on against off, beside a
minimal reference offloading spec written here (the lean in-engine floor).

    .venv-vllm/bin/python benchmarks/vllm_overhead.py [--rounds 5] [--json OUT]
    .venv-vllm/bin/python benchmarks/vllm_overhead.py --check [--json OUT]

Three engines run the same random-weight local Llama (made here, no download;
``--layers``, ``--hidden`` ... set its size), each in a subprocess of this
script (vLLM keeps process-wide state):

* *off*: vLLM alone;
* *kvtier*: ``KvtierConnector`` (``kvtier.integrations.vllm``), host tier only;
* *reference*: vLLM's ``OffloadingConnector`` with `ReferenceCpuSpec` below:
  vLLM's own ``CPUOffloadingManager`` on the scheduler side and, on the worker
  side, plain torch ``index_select`` / ``index_copy_`` between the engine's KV
  cache and one host tensor per KV cache tensor, on the engine's thread.

All three stay up together and take the rounds in turn (the order rotates each
round), so a change of the machine's load falls on every engine alike. Each
round sends every engine the same prompts, new in every round (random tokens:
no prompt shares a block with another, so nothing is ever reused):

* *TTFT, new prompt*: ``--ttft-prompts`` prompts, one at a time, one token
  each; the median ``generate`` time;
* *throughput*: one ``generate`` call of ``--batch`` prompts, ``--max-tokens``
  tokens each, then a request shorter than a block (so that vLLM submits the
  batch's last stores inside the timed span); prompt plus generated tokens over
  that wall time, and the CPU seconds the engine process spent (all threads;
  in parentheses, those of every thread but the engine's own: kvtier's, and
  the few vLLM alone has too);
* *TTFT, after a reset*: ``reset_prefix_cache()`` drops vLLM's device copy,
  then the TTFT prompts again, one at a time: vLLM alone recomputes them, the
  two offloading engines load every full block from their host tier (checked:
  the script fails if a block was not loaded).

Both host tiers hold ``--host-blocks`` blocks (default: 1.5 rounds' worth),
filled before the first round by a warm-up, so every measured store evicts.
The table gives per figure the median over ``--rounds`` and the median of the
per-round ratios to *off* (throughput, CPU, TTFT of a new prompt) or to
*reference* (TTFT after a reset), with their range over the rounds.
``--json`` also writes every round. Each engine process, all its threads
included, is pinned to ``--cpus`` (default: core 0; vLLM's own
``VLLM_CPU_OMP_THREADS_BIND`` binds only multiprocess workers, not this
in-process engine): kvtier's threads share the engine's core, so every cycle
they spend shows in the engine's throughput, as on a machine whose cores are
all busy. The CPU seconds are the better figure on a shared machine (another
process's time on the core is not counted). glibc's malloc thresholds are fixed
in every engine (``--malloc``, see `FIXED_MALLOC`): left adaptive, engines
doing the same work differed by up to 49,000 page faults per batch.

``--check`` (``tests/vllm/test_vllm_overhead_bench.py`` runs it at tiny sizes)
first sends two prompts through each engine, then ``reset_prefix_cache()``,
every byte of the engine's KV cache zeroed, and the same prompts again: the
offloading engines must load every full block from their host tier, and the
greedy tokens and logprobs must be vLLM alone's (else the script fails); it
prints the tokens and ``--json`` writes them (``check``) with their logprobs,
then runs the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vllm_ttft import make_model  # noqa: E402

ENGINES = ("off", "kvtier", "reference")
# glibc's malloc adapts its mmap threshold to what a process freed before, so
# two engine processes doing the same work could differ by tens of thousands of
# page faults per batch (torch's activations of a few MiB mapped and unmapped
# each step, or not), more than the 2% measured here. Fixed thresholds: those
# allocations stay in the heap, and every engine pays alike.
FIXED_MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
MODULE = Path(__file__).stem  # what vLLM imports the reference spec from (``spec_module_path``)


# -- the reference spec: vLLM's CPUOffloadingManager, plain torch copies --------------------


class ReferenceCopyWorker(OffloadingWorker):  # type: ignore[misc,unused-ignore]
    """Copies a job's blocks between the engine's KV cache tensors and one host
    tensor each, at once, on the engine's thread: ``index_select`` then
    ``index_copy_`` per tensor. Nothing runs in the background, so a job is
    finished when ``submit_*`` returns."""

    def __init__(self, kv_caches: CanonicalKVCaches, host_blocks: int) -> None:
        self.device = [t.tensor for t in kv_caches.tensors]
        # Zeroed (not empty): every host page is touched before the first store.
        self.host = [torch.zeros((host_blocks, int(t.shape[1])), dtype=t.dtype, device="cpu") for t in self.device]
        self.block_bytes = sum(int(t.shape[1]) * t.element_size() for t in self.device)
        self.blocks_stored = 0
        self.blocks_loaded = 0
        self.copy_s = 0.0  # seconds inside submit_store / submit_load
        self._finished: list[TransferResult] = []

    @staticmethod
    def _indices(device: GPULoadStoreSpec, host: LoadStoreSpec) -> tuple[torch.Tensor, torch.Tensor]:
        d = torch.from_numpy(np.asarray(device.block_ids, dtype=np.int64))
        h = torch.from_numpy(np.asarray(host.block_ids, dtype=np.int64))  # type: ignore[attr-defined]
        if d.shape != h.shape:
            raise ValueError(f"a job names {d.numel()} device blocks and {h.numel()} host blocks")
        return d, h

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        start = time.perf_counter()
        d, h = self._indices(src_spec, dst_spec)
        for dev, host in zip(self.device, self.host, strict=True):
            host.index_copy_(0, h, dev.index_select(0, d))
        self.blocks_stored += d.numel()
        seconds = time.perf_counter() - start
        self.copy_s += seconds
        self._finished.append(TransferResult(job_id, True, d.numel() * self.block_bytes, seconds))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        start = time.perf_counter()
        d, h = self._indices(dst_spec, src_spec)
        for dev, host in zip(self.device, self.host, strict=True):
            dev.index_copy_(0, d, host.index_select(0, h))
        self.blocks_loaded += d.numel()
        seconds = time.perf_counter() - start
        self.copy_s += seconds
        self._finished.append(TransferResult(job_id, True, d.numel() * self.block_bytes, seconds))
        return True

    def get_finished(self) -> list[TransferResult]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished inside its submit_*


class ReferenceCpuSpec(OffloadingSpec):  # type: ignore[misc,unused-ignore]
    """The lean in-engine floor: vLLM's own `CPUOffloadingManager` (LRU) and
    `ReferenceCopyWorker`. ``cpu_bytes_to_use`` sizes the host tier in whole
    blocks, as kvtier does. One KV cache group, one vLLM block per host block."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if len(config.groups) != 1 or self.blocks_per_chunk != 1:
            raise NotImplementedError(
                f"ReferenceCpuSpec moves one KV cache group, one vLLM block per host block; this engine has "
                f"{len(config.groups)} groups and blocks_per_chunk={self.blocks_per_chunk}"
            )
        block_bytes = int(config.worker_kv_bytes_per_block)
        raw = self.extra_config.get("cpu_bytes_to_use")
        if isinstance(raw, bool) or not isinstance(raw, int) or block_bytes < 1 or raw // block_bytes < 1:
            raise ValueError(f"cpu_bytes_to_use must be an int holding at least one block of {block_bytes} bytes; "
                             f"got {raw!r}")
        self.host_blocks = raw // block_bytes
        self._manager: CPUOffloadingManager | None = None
        self._worker: ReferenceCopyWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = CPUOffloadingManager(
                num_chunks=self.host_blocks, cache_policy="lru",
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = ReferenceCopyWorker(kv_caches, self.host_blocks)
        return self._worker


# -- one engine (a subprocess serving the parent's commands) ----------------------------------


def _zero_kv_caches(worker: Any) -> int:
    """Run on vLLM's worker (``collective_rpc``): zero every KV cache tensor; elements zeroed."""
    n = 0
    for t in worker.model_runner.kv_caches:
        t.zero_()
        n += t.numel()
    return n


def serve(plan: dict[str, Any], commands: IO[str], results: IO[str]) -> None:
    """Start the engine ``plan`` names, then answer one JSON command per line."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and its worker in this process
    if plan["cpus"]:
        os.sched_setaffinity(0, plan["cpus"])  # before any thread starts: every later thread inherits it
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.inputs import TokensPrompt

    engine, host_bytes = plan["engine"], plan["host_bytes"]
    transfer = None
    if engine == "kvtier":
        transfer = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"cpu_bytes_to_use": host_bytes},
        )
    elif engine == "reference":
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"spec_name": ReferenceCpuSpec.__name__, "spec_module_path": MODULE,
                                       "cpu_bytes_to_use": host_bytes},
        )
    started = time.perf_counter()
    llm = LLM(
        model=plan["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        block_size=plan["block"], max_model_len=plan["max_model_len"], seed=0,
        distributed_executor_backend="uni", kv_transfer_config=transfer,
    )
    start_s = time.perf_counter() - started

    def offload_worker() -> Any:
        if engine == "off":
            return None
        connector: Any = kv_transfer_state.get_kv_transfer_group()  # the OffloadingConnector
        return connector.connector_worker.worker

    def counts() -> dict[str, Any]:
        w = offload_worker()
        if w is None:
            return {"stored": 0, "loaded": 0, "copy_s": 0.0}
        if engine == "kvtier":  # kvtier copies on its own threads (other_threads_cpu_s)
            w.wait_all()  # a store vLLM submitted at the last step may still be copying
            return {"stored": w.counts.blocks_stored, "loaded": w.counts.blocks_loaded_from_host, "copy_s": 0.0}
        return {"stored": w.blocks_stored, "loaded": w.blocks_loaded, "copy_s": w.copy_s}

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    main_tid = threading.get_native_id()

    def other_threads_s() -> float:
        """CPU seconds of this process's threads but the engine's own (kvtier's), from the kernel's
        schedstat (nanoseconds; a thread that ended takes its time with it)."""
        total = 0
        for task in os.listdir("/proc/self/task"):
            if int(task) != main_tid:
                try:
                    total += int(Path(f"/proc/self/task/{task}/schedstat").read_text().split()[0])
                except (FileNotFoundError, ProcessLookupError):
                    pass
        return total / 1e9

    def generate(prompts: list[list[int]], max_tokens: int, logprobs: int | None = None) -> list[Any]:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, seed=0)
        requests: Any = [TokensPrompt(prompt_token_ids=p) for p in prompts]  # type: ignore[typeddict-item,unused-ignore]
        out: list[Any] = llm.generate(requests, sampling, use_tqdm=False)
        return out

    def one_by_one(prompts: list[list[int]], flush: list[int]) -> dict[str, Any]:
        before = counts()
        seconds, cached = [], []
        for p in prompts:
            t = time.perf_counter()
            (res,) = generate([p], 1)
            seconds.append(time.perf_counter() - t)
            cached.append(int(res.num_cached_tokens))
        generate([flush], 1)  # untimed: vLLM submits the last prompt's store at this request's step
        after = counts()
        return {"s": seconds, "cached": cached, "loaded": after["loaded"] - before["loaded"],
                "stored": after["stored"] - before["stored"]}

    def answer(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "ttft":
            return one_by_one(cmd["prompts"], cmd["flush"])
        if op == "batch":
            before, c0, o0, t0 = counts(), cpu_s(), other_threads_s(), time.perf_counter()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            outs = generate(cmd["prompts"], cmd["max_tokens"])
            generate([cmd["flush"]], 1)  # vLLM submits the batch's last stores at this request's step
            wall = time.perf_counter() - t0
            after = counts()  # after kvtier's last copies, so that their thread's CPU is counted below
            cpu, other = cpu_s() - c0, other_threads_s() - o0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            return {"s": wall, "cpu_s": cpu, "other_threads_cpu_s": other, "page_faults": faults, "generated": sum(len(o.outputs[0].token_ids) for o in outs),
                    "cached": sum(int(o.num_cached_tokens) for o in outs),
                    "stored": after["stored"] - before["stored"],
                    "engine_thread_copy_s": after["copy_s"] - before["copy_s"]}
        if op == "reset":
            return {"ok": bool(llm.reset_prefix_cache())}
        if op == "zero":
            return {"elements": sum(llm.collective_rpc(_zero_kv_caches))}
        if op == "generate":
            outs = generate(cmd["prompts"], cmd["max_tokens"], logprobs=3)
            return {"outputs": [{
                "token_ids": list(o.outputs[0].token_ids),
                "logprobs": [{str(k): v.logprob for k, v in sorted(step.items())} for step in o.outputs[0].logprobs],
                "cached": int(o.num_cached_tokens),
            } for o in outs]}
        if op == "counts":
            return counts()
        raise ValueError(f"unknown command {op!r}")

    results.write(json.dumps({"ready": True, "start_s": start_s}) + "\n")
    results.flush()
    for line in commands:
        try:
            reply = answer(json.loads(line))
        except Exception as exc:  # the parent stops the run and shows it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        results.write(json.dumps(reply) + "\n")
        results.flush()
    del llm


# -- the parent: three engines, the rounds, the table ------------------------------------------


class Engine:
    """One engine subprocess; `ask` sends a command and waits for its reply."""

    def __init__(self, name: str, plan: dict[str, Any], work: Path, env: dict[str, str], timeout_s: float) -> None:
        self.name, self.timeout_s = name, timeout_s
        self.log_path = work / f"{name}.log"
        plan_path = work / f"{name}.json"
        plan_path.write_text(json.dumps({**plan, "engine": name}))
        read_fd, write_fd = os.pipe()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--serve", str(plan_path), str(write_fd)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(write_fd,), text=True,
            )
        os.close(write_fd)
        self.results = os.fdopen(read_fd)
        ready = self._reply()
        self.start_s = float(ready["start_s"])

    def _reply(self) -> dict[str, Any]:
        line = self.results.readline()
        if not line:
            self.proc.wait(self.timeout_s)
            raise SystemExit(f"the {self.name} engine exited {self.proc.returncode}; log tail:\n"
                             f"{self.log_path.read_text()[-4000:]}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise SystemExit(f"the {self.name} engine failed: {reply['error']}; log tail:\n"
                             f"{self.log_path.read_text()[-2000:]}")
        return reply

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.results.close()


def new_prompts(seed: str, count: int, tokens: int, vocab: int) -> list[list[int]]:
    """``count`` prompts of random tokens (seeded by ``seed``): nothing in common."""
    r = random.Random(seed)
    return [[r.randrange(1, vocab) for _ in range(tokens)] for _ in range(count)]


def run_rounds(engines: dict[str, Engine], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    tokens = args.prompt_blocks * args.block + args.suffix
    flush = [1] * (args.block // 2)  # shorter than a block: nothing to store
    # Warm-up: the shapes' one-time costs, and both host tiers full.
    warm_batches = -(-args.host_blocks // (args.batch * args.prompt_blocks)) + 1
    for name, engine in engines.items():
        engine.ask("ttft", prompts=new_prompts("warm-ttft", args.ttft_prompts, tokens, args.vocab), flush=flush)
        for i in range(warm_batches):
            engine.ask("batch", prompts=new_prompts(f"warm-{i}", args.batch, tokens, args.vocab),
                       max_tokens=args.max_tokens, flush=flush)
        engine.ask("reset")
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(args.rounds):
        ttft_prompts = new_prompts(f"ttft-{r}", args.ttft_prompts, tokens, args.vocab)
        batch_prompts = new_prompts(f"batch-{r}", args.batch, tokens, args.vocab)
        for name in names[r % len(names):] + names[:r % len(names)]:
            e = engines[name]
            ttft = e.ask("ttft", prompts=ttft_prompts, flush=flush)
            batch = e.ask("batch", prompts=batch_prompts, max_tokens=args.max_tokens, flush=flush)
            e.ask("reset")
            again = e.ask("ttft", prompts=ttft_prompts, flush=flush)
            rounds[name].append({"ttft": ttft, "batch": batch, "again": again,
                                 "tokens": args.batch * tokens + batch["generated"]})
    return rounds


def check_rounds(rounds: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    """`SystemExit` if a prompt was reused, a batch stored nothing, or a host hit missed a block."""
    full = args.prompt_blocks * args.block
    for name, runs in rounds.items():
        for i, run in enumerate(runs):
            if any(run["ttft"]["cached"]) or run["batch"]["cached"]:
                raise SystemExit(f"{name}, round {i}: a new prompt found cached tokens "
                                 f"({run['ttft']['cached']}, batch {run['batch']['cached']})")
            if name == "off":
                if any(run["again"]["cached"]):
                    raise SystemExit(f"off, round {i}: cached tokens after a reset: {run['again']['cached']}")
                continue
            stored = [run["ttft"]["stored"], run["batch"]["stored"], run["again"]["stored"]]
            if stored != [args.ttft_prompts * args.prompt_blocks, args.batch * args.prompt_blocks, 0]:
                raise SystemExit(f"{name}, round {i}: the TTFT prompts, the batch and the TTFT prompts after the "
                                 f"reset stored {stored} blocks; expected every full block of every new prompt once")
            loaded = run["again"]["loaded"]
            if run["again"]["cached"] != [full] * args.ttft_prompts or loaded != args.ttft_prompts * args.prompt_blocks:
                raise SystemExit(f"{name}, round {i}: after the reset {run['again']['cached']} cached tokens and "
                                 f"{loaded} blocks loaded; expected {full} per prompt, all loaded")


def figures(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per engine: medians over the rounds, and per-round ratios (median, min, max)
    to off (throughput, CPU, new-prompt TTFT) and to reference (TTFT after a reset)."""

    def ttft(run: dict[str, Any], kind: str) -> float:
        return float(statistics.median(run[kind]["s"]))

    def per_round(name: str, base: str, value: Any) -> dict[str, Any]:
        ratios = [value(r) / value(b) for r, b in zip(rounds[name], rounds[base], strict=True)]
        return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}

    out: dict[str, dict[str, Any]] = {}
    for name, runs in rounds.items():
        out[name] = {
            "ttft_new_ms": statistics.median(1000 * ttft(r, "ttft") for r in runs),
            "ttft_again_ms": statistics.median(1000 * ttft(r, "again") for r in runs),
            "tokens_per_s": statistics.median(r["tokens"] / r["batch"]["s"] for r in runs),
            "cpu_ms_per_batch": statistics.median(1000 * r["batch"]["cpu_s"] for r in runs),
            "other_threads_cpu_ms_per_batch": statistics.median(1000 * r["batch"]["other_threads_cpu_s"] for r in runs),
            "engine_thread_copy_ms_per_batch": statistics.median(
                1000 * r["batch"]["engine_thread_copy_s"] for r in runs),
            "throughput_vs_off": per_round(name, "off", lambda r: r["tokens"] / r["batch"]["s"]),
            "cpu_vs_off": per_round(name, "off", lambda r: r["batch"]["cpu_s"]),
            "ttft_new_vs_off": per_round(name, "off", lambda r: ttft(r, "ttft")),
            "ttft_again_vs_reference": per_round(name, "reference", lambda r: ttft(r, "again")),
        }
    return out


LABELS = {"off": "vLLM alone", "kvtier": "kvtier (KvtierConnector)",
          "reference": "reference (CPUOffloadingManager + torch copies)"}


def change(ratio: dict[str, Any]) -> str:
    """A per-round ratio as a change: median, and the range over the rounds."""
    return f"{ratio['median'] - 1:+.1%} ({ratio['min'] - 1:+.0%}..{ratio['max'] - 1:+.0%})"


def table(f: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| engine | throughput | vs alone (range) | engine CPU per batch (other threads) | vs alone (range) "
        "| TTFT, new prompt "
        "| vs alone (range) | TTFT after a reset (alone: recompute; others: host hit) | vs reference (range) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ENGINES:
        x = f[name]
        again = x["ttft_again_vs_reference"]
        lines.append(
            f"| {LABELS[name]} | {x['tokens_per_s']:.0f} tokens/s | {change(x['throughput_vs_off'])} "
            f"| {x['cpu_ms_per_batch']:.0f} ms ({x['other_threads_cpu_ms_per_batch']:.1f} ms) "
            f"| {change(x['cpu_vs_off'])} | {x['ttft_new_ms']:.1f} ms "
            f"| {change(x['ttft_new_vs_off'])} | {x['ttft_again_ms']:.1f} ms "
            f"| {again['median']:.2f}x ({again['min']:.2f}..{again['max']:.2f}) |"
        )
    return "\n".join(lines)


def run_check(engines: dict[str, Engine], args: argparse.Namespace) -> dict[str, Any]:
    """Two prompts, then a reset and zeroed KV caches, then the same prompts:
    every engine's greedy tokens and logprobs, and what was loaded."""
    tokens = args.prompt_blocks * args.block + args.suffix
    prompts = new_prompts("check", 2, tokens, args.vocab)
    flush = [1] * (args.block // 2)
    out: dict[str, Any] = {}
    for name, e in engines.items():
        first = e.ask("generate", prompts=prompts, max_tokens=args.max_tokens)
        e.ask("batch", prompts=[flush], max_tokens=1, flush=flush)  # the last stores submitted and landed
        e.ask("reset")
        zeroed = e.ask("zero")["elements"]
        before = e.ask("counts")
        second = e.ask("generate", prompts=prompts, max_tokens=args.max_tokens)
        after = e.ask("counts")
        out[name] = {"first": first["outputs"], "second": second["outputs"], "zeroed_elements": zeroed,
                     "stored": after["stored"], "loaded_after_reset": after["loaded"] - before["loaded"]}
    return {"prompt_tokens": tokens, "full_block_tokens": args.prompt_blocks * args.block, "engines": out}


def check_outputs(check: dict[str, Any], args: argparse.Namespace) -> None:
    """`SystemExit` unless every engine gave vLLM alone's first outputs both
    times (token ids and logprobs) and each offloading engine loaded every
    full block after the reset."""

    def greedy(outputs: list[dict[str, Any]]) -> list[Any]:
        return [(o["token_ids"], o["logprobs"]) for o in outputs]

    engines = check["engines"]
    want = greedy(engines["off"]["first"])
    for name, r in engines.items():
        for phase in ("first", "second"):
            if greedy(r[phase]) != want:
                raise SystemExit(f"check: {name}'s {phase} outputs differ from vLLM alone's: "
                                 f"{[o['token_ids'] for o in r[phase]]} != {[t for t, _ in want]}")
        if name != "off":
            cached = [o["cached"] for o in r["second"]]
            if cached != [check["full_block_tokens"]] * len(cached) or r["loaded_after_reset"] != 2 * args.prompt_blocks:
                raise SystemExit(f"check: {name} got {cached} cached tokens and {r['loaded_after_reset']} blocks "
                                 f"from its host tier after the reset; expected every full block")


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        plan = json.loads(Path(sys.argv[2]).read_text())
        with os.fdopen(int(sys.argv[3]), "w") as results:
            serve(plan, sys.stdin, results)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds; medians over them (default 5)")
    ap.add_argument("--batch", type=int, default=32, help="prompts in the throughput batch (default 32)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per batch prompt (default 16)")
    ap.add_argument("--ttft-prompts", type=int, default=4, help="prompts sent one at a time per round (default 4)")
    ap.add_argument("--prompt-blocks", type=int, default=8, help="whole blocks per prompt (default 8)")
    ap.add_argument("--suffix", type=int, default=16, help="tokens after the whole blocks (default 16)")
    ap.add_argument("--host-blocks", type=int, default=0, help="each host tier's blocks (default 1.5 rounds' worth)")
    ap.add_argument("--block", type=int, default=32, help="vLLM's block size (a multiple of 32 on CPU)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each engine (default 1)")
    ap.add_argument("--cpus", default="0", help="cores each engine process is pinned to, comma-separated "
                    "(default 0; 'all': not pinned)")
    ap.add_argument("--malloc", choices=("fixed", "glibc"), default="fixed",
                    help="'fixed': glibc malloc thresholds fixed in every engine (GLIBC_TUNABLES, default); "
                         "'glibc': glibc's adaptive defaults")
    ap.add_argument("--check", action="store_true", help="first, the engines' greedy outputs (see above)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds an engine may take to exit")
    args = ap.parse_args()
    if (min(args.rounds, args.batch, args.max_tokens, args.ttft_prompts, args.prompt_blocks, args.suffix) < 1
            or args.block % 32 or args.host_blocks < 0):
        ap.error("counts and sizes >= 1, --host-blocks >= 0, a block size that is a multiple of 32")
    per_round = (args.ttft_prompts + args.batch) * args.prompt_blocks
    if not args.host_blocks:
        args.host_blocks = per_round * 3 // 2
    if args.host_blocks < per_round:
        ap.error(f"--host-blocks {args.host_blocks} holds less than a round's {per_round} blocks: "
                 "the TTFT prompts would be evicted before they are sent again")
    tokens = args.prompt_blocks * args.block + args.suffix
    args.max_model_len = -(-(tokens + args.max_tokens) // args.block) * args.block
    cpus = [] if args.cpus == "all" else [int(c) for c in args.cpus.split(",")]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.malloc == "fixed":
        env["GLIBC_TUNABLES"] = FIXED_MALLOC
    heads, head_dim = args.heads, args.hidden // args.heads
    block_bytes = 2 * args.layers * args.block * heads * head_dim * 4  # K and V, float32
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-overhead-") as tmp:
        work = Path(tmp)
        params = make_model(work / "model", args)
        plan = {"model": str(work / "model"), "block": args.block, "max_model_len": args.max_model_len,
                "host_bytes": args.host_blocks * block_bytes, "cpus": cpus}
        engines: dict[str, Engine] = {}
        try:
            for name in ENGINES:  # one at a time: starts do not overlap
                engines[name] = Engine(name, plan, work, env, args.timeout)
            check = run_check(engines, args) if args.check else None
            rounds = run_rounds(engines, args)
        finally:
            for e in engines.values():
                e.close()
    seconds = time.perf_counter() - started
    if check is not None:
        for name, r in check["engines"].items():
            print(f"check, {name}: {[o['token_ids'] for o in r['first']]} then "
                  f"{[o['token_ids'] for o in r['second']]}; cached after the reset "
                  f"{[o['cached'] for o in r['second']]}, blocks loaded {r['loaded_after_reset']}")
        if args.json is not None:  # what was compared, before a failure below
            args.json.write_text(json.dumps({"check": check}, indent=1))
        check_outputs(check, args)
    check_rounds(rounds, args)
    f = figures(rounds)
    print(f"random Llama, {params / 1e6:.1f}M parameters ({args.layers} layers, hidden {args.hidden}), float32, "
          f"block {args.block}; prompts of {tokens} tokens, all new; batch {args.batch} x {args.max_tokens} "
          f"tokens; {args.ttft_prompts} TTFT prompts per round; host tiers {args.host_blocks} blocks (full); "
          f"{args.threads} thread(s), pinned to cores {args.cpus}; median of {args.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.1f}; {seconds:.0f} s\n")
    print(table(f))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "parameters": params, "args": {k: str(v) for k, v in vars(args).items()},
            "start_s": {n: e.start_s for n, e in engines.items()}, "figures": f, "rounds": rounds, "check": check,
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
