"""Attaching `KvtierHiCacheStorage` fails at start, not as misses later: every
extra-config value is type-checked and the store is probed (one small sealed
page put, read back and checked) when the controller registers its host pool.
Each refusal is a `ConfigurationError` naming the key and the value, through
SGLang's own factory and controller attach path, and leaves no store open.

Needs SGLang (see test_sglang_storage.py for how the venv is built)."""

from __future__ import annotations

import importlib.util
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_SGLANG = importlib.util.find_spec("sglang")
if _SGLANG is not None and _SGLANG.origin is not None and importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(Path(__file__).parent / "stand_ins"))
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed; `make test-sglang` builds .venv-sglang with sglang==0.5.23")

import harness  # noqa: E402
from harness import KVTIER, make_pools, needs_redis_server, single_rank  # noqa: E402
from kvtier.errors import ConfigurationError  # noqa: E402
from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402
from kvtier.testing.redis_server import LocalRedisServer  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.fixture(autouse=True)
def one_rank() -> Iterator[None]:
    with single_rank():
        yield


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once it is closed


def _attach(extra: dict[str, Any]) -> KvtierHiCacheStorage:
    """SGLang's attach: the factory builds the backend, then the host pool is registered."""
    pools = make_pools("mha", "page_first")
    backend = StorageBackendFactory.create_backend("dynamic", harness.storage_config(pools, extra), pools.host)
    assert isinstance(backend, KvtierHiCacheStorage)
    try:
        backend.register_mem_pool_host(pools.host)
    except BaseException:
        assert backend.store is None, "a refused attach left a store open"
        raise
    return backend


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cluster": "false"}, r"'cluster' must be true or false \(a JSON boolean, not a string\); got 'false'"),
        ({"store": "redis", "cluster": "false"}, r"'cluster' must be true or false .*; got 'false'"),
        ({"store": "redis", "cluster": 1}, r"'cluster' must be true or false .*; got 1"),
        ({"cluster": True}, r"'cluster' must be given only with store 'redis' \(store is 'file'\); got True"),
        ({"store_path": 5}, r"'store_path' must be a non-empty string; got 5"),
        ({"store_path": ""}, r"'store_path' must be a non-empty string; got ''"),
        ({"store": "redis", "prefix": 7}, r"'prefix' must be a non-empty string; got 7"),
        ({"store": "redis", "prefix": "a{b}"}, r"'prefix' must be a string without braces .*; got 'a\{b\}'"),
        ({"store": "redis", "redis_url": 6379}, r"'redis_url' must be a non-empty string; got 6379"),
        ({"store": "redis", "redis_url": "127.0.0.1:6379"}, r"'redis_url' must be a Redis URL .*; got '127.0.0.1:6379'"),
        ({"store": "file", "redis_url": "redis://x:1/0"}, r"'redis_url' must be given only with store 'redis' \(store is 'file'\)"),
        ({"model_identity": 3}, r"'model_identity' must be a non-empty string; got 3"),
        ({"timeout_s": float("inf")}, r"timeout_s must be a number of seconds > 0 \(finite, .*\); got inf"),
        ({"timeout_s": float("nan")}, r"timeout_s must be a number of seconds > 0 .*; got nan"),
        ({"timeout_s": "10"}, r"timeout_s must be a number of seconds > 0 .*; got '10'"),
        ({"timeout_s": True}, r"timeout_s must be a number of seconds > 0 .*; got True"),
        ({"kv_cache_dtype": "fp8"}, r"'kv_cache_dtype' must be one of \[.*'fp8_e4m3', 'fp8_e5m2'\] .*; got 'fp8'"),
        ({"mooncake": {"a": 1}}, r"'mooncake' must be given only with store 'mooncake' \(store is 'file'\)"),
        ({"store_max_bytes": "200 parsecs"}, r"'store_max_bytes' must be a number of bytes >= 1 or a size .*; got '200 parsecs'"),
        ({"store": "redis", "store_max_bytes": "2GiB"}, r"'store_max_bytes' must be given only with store 'file' \(store is 'redis'\)"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else "",
)
def test_a_value_kvtier_cannot_use_fails_the_attach_naming_key_and_value(
    extra: dict[str, Any], message: str, tmp_path: Path
) -> None:
    config = {**KVTIER, **extra}
    if config.get("store", "file") == "file" and "store_path" not in config:
        config["store_path"] = str(tmp_path / "store")
    with pytest.raises(ConfigurationError, match=message):
        _attach(config)


def test_max_bytes_bounds_each_namespaces_file_store(tmp_path: Path) -> None:
    backend = _attach({**KVTIER, "store_path": str(tmp_path), "store_max_bytes": "1GiB"})
    try:
        assert backend.store is not None and backend.store.store.max_bytes == 1 << 30  # type: ignore[attr-defined]
    finally:
        backend.close()


def test_infinity_from_the_json_of_the_command_line_is_refused_not_an_overflow(tmp_path: Path) -> None:
    """``--hicache-storage-backend-extra-config '{"timeout_s": Infinity}'``:
    Python's json reads Infinity as float('inf'), which raised OverflowError
    from threading inside the first call."""
    import json

    extra = json.loads(json.dumps({**KVTIER, "store_path": str(tmp_path)}).rstrip("}") + ', "timeout_s": Infinity}')
    assert extra["timeout_s"] == float("inf")
    with pytest.raises(ConfigurationError, match=r"timeout_s .*; got inf"):
        _attach(extra)


def test_a_regular_file_as_path_fails_the_attach_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "not-a-directory"
    path.write_bytes(b"x")
    with pytest.raises(ConfigurationError, match=rf"'store_path' must be a directory .*it is a file; got '{path}'"):
        _attach({**KVTIER, "store_path": str(path)})
    assert path.read_bytes() == b"x"  # changed nothing


def test_a_path_the_store_cannot_write_fails_the_probe_naming_it(tmp_path: Path) -> None:
    """A directory kvtier cannot create its namespace in: the probe's put fails at attach."""
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "sub").write_bytes(b"")  # a file where the store wants a directory
    with pytest.raises(ConfigurationError, match=r"store 'file', 'store_path'=.*sub/deeper"):
        _attach({**KVTIER, "store_path": str(locked / "sub" / "deeper")})


def test_a_redis_url_on_a_closed_port_fails_the_attach_naming_it() -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    with pytest.raises(ConfigurationError, match=rf"cannot use store 'redis', 'redis_url'='{url}', 'cluster'=False: "
                                                 r"writing and reading back a probe page failed"):
        _attach({**KVTIER, "store": "redis", "redis_url": url, "timeout_s": 2.0})


@needs_redis_server
def test_cluster_on_a_plain_redis_server_fails_the_attach_naming_it(request: pytest.FixtureRequest) -> None:
    server: LocalRedisServer = request.getfixturevalue("redis_server")
    with pytest.raises(ConfigurationError, match=rf"store 'redis', 'redis_url'='{server.url}', 'cluster'=True"):
        _attach({**KVTIER, "store": "redis", "redis_url": server.url, "cluster": True, "timeout_s": 2.0})


@needs_redis_server
def test_the_attach_probe_leaves_one_small_page_and_the_store_serves(request: pytest.FixtureRequest) -> None:
    import redis

    server: LocalRedisServer = request.getfixturevalue("redis_server")
    prefix = "attach-probe:"
    backend = _attach({**KVTIER, "store": "redis", "redis_url": server.url, "prefix": prefix})
    try:
        stats = backend.statistics()
        assert stats is not None and stats.faults == 0
        raw = redis.Redis.from_url(server.url)
        names = [k for k in raw.scan_iter(f"{prefix}*")]
        assert len(names) == 2 and sum(n.endswith(b":b:probe") for n in names) == 1  # commit record + one blob
        assert len(raw.get(next(n for n in names if n.endswith(b":b:probe"))) or b"") < 256  # small
        raw.close()
        assert backend.batch_exists(["0" * 64]) == 0
    finally:
        backend.close()


def test_sglangs_controller_attach_raises_the_refusal(tmp_path: Path) -> None:
    """Through HiCacheController's own attach (``--hicache-storage-backend dynamic``),
    which wraps a backend's error in its own ValueError, the refusal chained."""
    pools = make_pools("mha", "page_first")
    with pytest.raises(ValueError, match=r"Failed to create storage backend: .*'cluster' must be true or false .*; got 'false'") as info:
        harness.controller(pools, {**KVTIER, "store": "redis", "cluster": "false"})
    assert isinstance(info.value.__cause__, ConfigurationError)
