"""benchmarks/vllm_overhead.py at tiny sizes: kvtier and the script's reference
spec (vLLM's CPUOffloadingManager, plain torch copies) give vLLM alone's greedy
tokens and logprobs, bit for bit, also when every prefix block comes back from
their host tier into a zeroed KV cache; and one round of the measurement runs
with every store and load it counts (its timings are not checked here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "vllm_overhead.py"
PROMPT_BLOCKS = 3


def greedy(outputs: list[dict[str, Any]]) -> list[tuple[list[int], list[dict[str, float]]]]:
    return [(o["token_ids"], o["logprobs"]) for o in outputs]


def test_kvtier_and_the_reference_spec_give_vllm_alones_outputs_from_their_host_tiers_into_a_zeroed_cache(
    tmp_path: Path,
) -> None:
    out = tmp_path / "overhead.json"
    tiny = ["--check", "--rounds", "1", "--batch", "2", "--ttft-prompts", "2", "--max-tokens", "6",
            "--prompt-blocks", str(PROMPT_BLOCKS), "--suffix", "8", "--layers", "2", "--hidden", "64", "--heads", "2",
            "--intermediate", "128", "--vocab", "512"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), *tiny, "--json", str(out)], capture_output=True, text=True,
                          env=env, timeout=540, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    check = result["check"]["engines"]
    full = PROMPT_BLOCKS * 32
    alone = check["off"]
    assert [o["cached"] for o in alone["second"]] == [0, 0]  # vLLM alone recomputed after the reset
    assert greedy(alone["second"]) == greedy(alone["first"])  # ...so zeroing its cache changed nothing
    assert all(len(o["token_ids"]) == 6 and len(o["logprobs"]) == 6 for o in alone["first"])
    for name in ("kvtier", "reference"):
        engine = check[name]
        assert engine["zeroed_elements"] == alone["zeroed_elements"] > 0, name
        # Every full block of both prompts came from the host tier into a zeroed KV cache...
        assert [o["cached"] for o in engine["second"]] == [full, full], (name, engine["second"])
        assert engine["loaded_after_reset"] == 2 * PROMPT_BLOCKS, (name, engine)
        assert engine["stored"] >= 2 * PROMPT_BLOCKS, (name, engine)
        # ...and the outputs are vLLM alone's, token ids and logprobs equal.
        assert greedy(engine["first"]) == greedy(alone["first"]), name
        assert greedy(engine["second"]) == greedy(alone["first"]), name
    # One round of the measurement: the table has a row per engine, and the
    # script checked that every block was stored once and loaded after the reset.
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 3 and all(line.count("|") == 10 for line in rows), proc.stdout
    assert [line.split("|")[1].strip() for line in rows[2:]] == [
        "vLLM alone", "kvtier (KvtierConnector)", "reference (CPUOffloadingManager + torch copies)"]
    for name in ("kvtier", "reference"):
        (run,) = result["rounds"][name]
        assert run["batch"]["stored"] == 2 * PROMPT_BLOCKS and run["again"]["loaded"] == 2 * PROMPT_BLOCKS, run
        assert run["again"]["cached"] == [full, full], run
    (base,) = result["rounds"]["off"]
    assert base["again"]["cached"] == [0, 0] and base["batch"]["stored"] == 0, base
    assert result["figures"]["off"]["throughput_vs_off"]["median"] == 1.0
