"""A storage request as values: its page keys and a prefetch's options, checked.

Pure functions, the first step of a `write_storage` or `prefetch`: they read
what the caller passed, change nothing, and either return kvtier's own copy
(lists of ``bytes`` keys by anchor pool) or raise `InvalidIndices` /
`ValueError` naming the value and the rule. Admission (host pages) and the
carrier come after them.

* `parse_keys`: one sequence of 1..`MAX_KEY_BYTES`-byte keys per anchor pool
  whose pages hold bytes; a write's keys match its pages one for one and
  name each page once (`check_one_page_per_key`); a prefetch names at least
  one pool, each with at least one key.
* `check_prefetch_options`: the policy, its ``timeout_s`` and ``all_pools``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from kvtier.errors import ConfigurationError, InvalidIndices, WrongType
from kvtier.storage.base import MAX_KEY_BYTES

__all__ = ["PREFETCH_POLICIES", "PrefetchPolicy", "check_one_page_per_key", "check_prefetch_options", "parse_keys"]

PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
PREFETCH_POLICIES: tuple[str, ...] = ("best_effort", "wait_complete", "timeout")


def check_prefetch_options(policy: object, timeout_s: object, all_pools: object) -> None:
    """`ConfigurationError` (a `ValueError`) unless ``policy`` is one of `PREFETCH_POLICIES`,
    ``timeout_s`` a finite number > 0 exactly when the policy is
    ``"timeout"`` (None otherwise), and ``all_pools`` a bool."""
    if policy not in PREFETCH_POLICIES:
        raise ConfigurationError(f"prefetch policy must be one of {list(PREFETCH_POLICIES)}; got {policy!r}")
    if policy == "timeout":
        if (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
            or not math.isfinite(timeout_s) or timeout_s <= 0
        ):
            raise ConfigurationError(f"prefetch policy 'timeout' needs timeout_s, a finite number > 0; got {timeout_s!r}")
    elif timeout_s is not None:
        raise ConfigurationError(
            f"timeout_s applies to policy 'timeout' only; got timeout_s={timeout_s!r} with policy {policy!r}"
        )
    if not isinstance(all_pools, bool):
        raise WrongType(f"all_pools must be a bool; got {all_pools!r}")


def parse_keys(
    keys: Mapping[str, Sequence[bytes]],
    members: Mapping[str, list[str]],
    *,
    counts: Mapping[str, int] | None = None,
    anchor: Callable[[object], object] | None = None,
) -> dict[str, list[bytes]]:
    """``keys`` as lists of valid keys, kvtier's own copy.

    ``members``: per slot-owning pool, the pools whose bytes are stored with
    its pages (`kvtier.scheduler.storage.storage_members`); a pool with none
    has nothing to store. ``counts``: a write's pages per pool (its host
    pages, already checked), which the keys must match one for one; None for
    a prefetch, whose pools are the keys' own: each is checked with
    ``anchor`` (the rule every kind's pool names go by, `Admission.spec`:
    known, not a sidecar) and needs at least one key.
    """
    if not isinstance(keys, Mapping):
        raise InvalidIndices(
            f"keys must be a mapping of pool name to page keys; got {type(keys).__name__}", rule="mapping"
        )
    if counts is None:
        if not keys:
            raise InvalidIndices("a prefetch names at least one pool; got no keys", rule="non-empty")
        if anchor is not None:
            for name in keys:
                anchor(name)
    elif set(keys) != set(counts):
        raise InvalidIndices(
            f"keys must name the same pools as the host indices ({sorted(counts)}); got {sorted(map(str, keys))}",
            rule="same-pools",
        )
    out: dict[str, list[bytes]] = {}
    for name in keys:
        if not members.get(name):
            raise InvalidIndices(
                f"pool {name!r} and its sidecars hold no bytes; there is nothing to store",
                pool=name, rule="pool-has-bytes",
            )
        value = keys[name]
        if isinstance(value, (bytes, str)) or not isinstance(value, Sequence):
            raise InvalidIndices(
                f"pool {name!r} needs a sequence of page keys (bytes); got {type(value).__name__}",
                pool=name, rule="page-keys",
            )
        listed = list(value)
        if counts is None and not listed:
            raise InvalidIndices(f"pool {name!r} needs at least one page key; got none", pool=name, rule="page-keys")
        if counts is not None and len(listed) != counts[name]:
            raise InvalidIndices(
                f"pool {name!r} names {counts[name]} pages and {len(listed)} keys; one key per page",
                pool=name, rule="one-key-per-page",
            )
        for i, key in enumerate(listed):
            if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
                raise InvalidIndices(
                    f"pool {name!r} key {i} must be 1..{MAX_KEY_BYTES} bytes; got {key!r:.80}",
                    pool=name, rule="page-keys",
                )
        out[name] = listed
    if counts is not None:
        # A write stores one page per key; a prefetch may read a key twice
        # (both host pages get its bytes), and a key of another pool is a miss.
        check_one_page_per_key(out)
    return out


def check_one_page_per_key(keys: Mapping[str, list[bytes]]) -> None:
    """Refuse a key named twice in one call, in one pool or in two.

    A key names one page of one pool: the store holds one page under it, and
    ``exists`` answers per key, not per pool. Keys from `kvtier.storage.page_keys`
    never repeat (the chain covers the prefix, the namespace the pool), so a
    repeat is a caller's mistake; stored as asked, one of the two pages would
    be reported written or present and be a miss ever after. Raises
    `InvalidIndices` naming the key, both places and the rule; nothing is
    changed (callers check before they take anything).
    """
    seen: dict[bytes, tuple[str, int]] = {}
    for pool, listed in keys.items():
        for i, key in enumerate(listed):
            first = seen.setdefault(key, (pool, i))
            if first != (pool, i):
                where = f"page {first[1]} of pool {first[0]!r} and page {i} of pool {pool!r}"
                raise InvalidIndices(
                    f"key {key.hex()} names {where}; one key names one page of one pool (keys from page_keys "
                    f"or window_keys, whose namespace covers the pool, never repeat)",
                    pool=pool, rule="one-page-per-key",
                )
