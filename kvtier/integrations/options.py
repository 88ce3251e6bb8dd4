"""One vocabulary for kvtier's options in vLLM's and SGLang's configurations.

An option that means the same in both engines has the same name in both,
and every name says its unit (``_bytes``, ``_blocks``, ``_s``) or takes a
kind (``store``: ``"file"``, ``"redis"``, ``"mooncake"``). A size in bytes is
a number of bytes or a size string (``"200GiB"``, `kvtier.storage.parse_size`).
`VOCABULARY` is the table docs/configuration.md shows (a test compares them);
each engine's parser (`kvtier.integrations.vllm.options`,
`kvtier.integrations.sglang.storage`) reads the names its engine has.

Names an engine used before this vocabulary (`RENAMED`) are read for one more
release: `renamed_options` maps each to its new name with one
``config.option_renamed`` warning, and refuses an option given under both
names. Pure: no engine import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigurationError
from kvtier.logs import get_logger

__all__ = ["ENGINES", "RENAMED", "VOCABULARY", "Option", "renamed_options"]

log = get_logger(__name__)

ENGINES = ("vllm", "sglang")


@dataclass(frozen=True, slots=True)
class Option:
    """One name of the vocabulary: its ``unit`` (what a value is), the
    ``engines`` that read it, and the names it ``replaces`` per engine."""

    unit: str
    engines: tuple[str, ...]
    replaces: Mapping[str, str]


_BOTH = ("vllm", "sglang")
_SIZE = "bytes or a size string"
VOCABULARY: Mapping[str, Option] = {
    "store": Option("'file', 'redis' or 'mooncake'", _BOTH, {}),
    "store_path": Option("directory", _BOTH, {"sglang": "path"}),
    "store_max_bytes": Option(_SIZE, _BOTH, {"sglang": "max_bytes"}),
    "redis_url": Option("redis://, rediss:// or unix:// URL", _BOTH, {"sglang": "url"}),
    "model_identity": Option("string", _BOTH, {"sglang": "model"}),
    "store_admission": Option("'all', 'frequency' or 'module:factory'", _BOTH, {}),
    "admission_sightings": Option("count (int >= 1)", _BOTH, {}),
    "admission_window": Option("count (int >= 1)", _BOTH, {}),
    "host_bytes": Option(_SIZE + ", over all workers", ("vllm",), {}),
    "host_blocks": Option("vLLM blocks, per worker", ("vllm",), {}),
    "staging_blocks": Option("vLLM blocks, per worker", ("vllm",), {}),
    "verify": Option("bool", ("vllm",), {}),
    "lookup_timeout_s": Option("seconds", ("vllm",), {}),
    "host_eviction": Option("'lru' or 'slru'", ("vllm",), {}),
    "cluster": Option("bool", ("sglang",), {}),
    "prefix": Option("string", ("sglang",), {}),
    "timeout_s": Option("seconds", ("sglang",), {}),
    "dsv4_kv_layout": Option("'v4', 'v41' or 'v41_new'", ("sglang",), {}),
    "kv_cache_dtype": Option("fp8 format name", ("sglang",), {}),
    "mooncake": Option("object of MooncakeStore arguments", ("sglang",), {}),
}
"""Every option name, with its unit, the engines that read it and the names it replaces."""

RENAMED: Mapping[str, Mapping[str, str]] = {
    engine: {old: new for new, option in VOCABULARY.items() for e, old in option.replaces.items() if e == engine}
    for engine in ENGINES
}
"""Per engine, each old option name and its new one (read for one release more)."""


def renamed_options(raw: Mapping[Any, Any], engine: str, where: str) -> dict[Any, Any]:
    """``raw`` with each of ``engine``'s old option names replaced by its new one.

    Logs one ``config.option_renamed`` warning per old name given. Raises
    `ConfigurationError` naming both when an option is given under its old
    and its new name (``where`` names the configuration in the message).
    """
    renames = RENAMED[engine]
    out: dict[Any, Any] = {}
    for key, value in raw.items():
        new = renames.get(key) if isinstance(key, str) else None
        if new is None:
            out[key] = value
            continue
        if new in raw:
            raise ConfigurationError(
                f"{where} gives both {key!r} and {new!r}: {key!r} is the old name of {new!r}; keep {new!r} alone"
            )
        log.warning("config.option_renamed", engine=engine, old=key, new=new)
        out[new] = value
    return out
