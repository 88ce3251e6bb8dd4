"""Which blocks a cache tier takes, and which it gives up: pure decision objects.

Two seams, each a `typing.Protocol` with two built-in policies:

* **Store admission** (`StoreAdmission`): asked once per block a tier is
  offered (``admit(key, tier)``, ``tier`` is ``"host"`` for a backup into the
  host tier, ``"store"`` for a write-through to a shared store), it returns
  None to store the block or a short reason to skip it. `StoreAll` stores every
  block (kvtier's behaviour before policies). `FrequencyGate` stores a block
  once its key has been offered ``sightings`` times while it stayed among the
  ``window`` most recently offered keys: a prompt seen once never costs a copy.
  `CountedAdmission` wraps any policy and counts its decisions by tier and
  reason (`AdmissionStatistics`, `kvtier.metrics.AdmissionCollector`).
* **Host eviction** (`HostEviction`): the order in which resident blocks are
  given up. `LruEviction` evicts the least recently used block.
  `SegmentedLruEviction` (SLRU) keeps a block reused at least once in a
  protected segment (80% of the capacity) and evicts from the probation
  segment of blocks never reused first, so a burst of one-shot blocks cycles
  through probation without flushing the reused ones.

`HostCacheIndex` is an engine's host cache index over one `TransferScheduler`
(block key -> its host pages) whose ``reclaim`` is the scheduler's reclaim
hook: it frees victims in a `HostEviction`'s order, never a pinned block.

Every method is O(1) per block (eviction: O(1) per block skipped or taken) on
plain dicts; none awaits; `HostCacheIndex` copies the index tensors it keeps
and hands out (one small clone per pool). The caller owns the blocks: a
policy only orders keys and never evicts a key the caller's ``evictable``
predicate refuses (pinned, being written or being read).

`make_admission` and `make_eviction` build them from option values, raising
`ConfigurationError` that names the option and the value.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast, runtime_checkable

from kvtier.errors import ConfigurationError

__all__ = [
    "ADMISSION_POLICIES",
    "EVICTION_POLICIES",
    "AdmissionStatistics",
    "CountedAdmission",
    "FrequencyGate",
    "HostCacheIndex",
    "HostEviction",
    "HostPageFreer",
    "LruEviction",
    "SegmentedLruEviction",
    "StoreAdmission",
    "StoreAll",
    "Tier",
    "check_admission_options",
    "make_admission",
    "make_eviction",
]

Tier = Literal["host", "store"]
TIERS: tuple[Tier, ...] = ("host", "store")

ADMISSION_POLICIES = ("all", "frequency")
"""Built-in store admission policy names (`make_admission`); ``"module:factory"`` names an engine's own."""
EVICTION_POLICIES = ("lru", "slru")
"""Built-in host eviction policy names (`make_eviction`)."""


# -- store admission ---------------------------------------------------------------


@runtime_checkable
class StoreAdmission(Protocol):
    """Decides whether a tier stores a block it is offered.

    ``admit`` is called once per offer of ``key`` to ``tier``; it returns None
    to store the block, else a short, stable reason (a metric label, so a small
    fixed set of strings) to skip it. It runs on the engine's scheduling path:
    keep it O(1) and free of I/O.
    """

    def admit(self, key: Hashable, tier: Tier) -> str | None: ...


class StoreAll:
    """Store every block offered (the default)."""

    def admit(self, key: Hashable, tier: Tier) -> str | None:
        return None

    def __repr__(self) -> str:
        return "<StoreAll>"


class FrequencyGate:
    """Store a block on its ``sightings``-th offer within a bounded window.

    Counts offers to the host tier per key among the ``window`` most recently
    offered distinct keys (an insertion-ordered dict: a new key beyond the
    bound drops the key offered longest ago, with its count). An offer whose
    count reaches ``sightings`` is admitted, and so is every later one while
    the key stays in the window, so a reused block evicted from the host comes
    back at once. A key the window dropped starts again at one.

    ``tier`` is the tier whose offers it counts (``"host"`` by default); an
    offer to the other tier is admitted, because there it follows the counted
    tier's decision: with ``tier="host"`` (the vLLM integration) only blocks
    admitted to the host are written through, so the gate admits them there.
    Where the store is the only tier kvtier decides for (`TransferScheduler`'s
    ``store_admission``, the SGLang backend), use ``tier="store"``: each
    ``write_storage`` of a key is then one offer. Memory: at most ``window``
    keys and counts.

    Raises `ConfigurationError` for ``sightings`` < 1, ``window`` < 1,
    values that are not ints, or a ``tier`` other than ``"host"`` / ``"store"``.
    """

    REASON = "infrequent"

    def __init__(self, sightings: int = 2, window: int = 65536, *, tier: Tier = "host") -> None:
        for name, value in (("sightings", sightings), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"FrequencyGate {name} must be an int >= 1; got {value!r}")
        if tier not in TIERS:
            raise ConfigurationError(f"FrequencyGate tier must be one of {list(TIERS)}; got {tier!r}")
        self.sightings = sightings
        self.window = window
        self.tier = tier
        # key -> offers seen while in the window; order: least recently offered first.
        self._counts: OrderedDict[Hashable, int] = OrderedDict()
        self.peak_tracked = 0

    def admit(self, key: Hashable, tier: Tier) -> str | None:
        if tier != self.tier:
            return None
        counts = self._counts
        n = counts.get(key)
        if n is None:
            if len(counts) >= self.window:
                counts.popitem(last=False)
            n = counts[key] = 1
            if len(counts) > self.peak_tracked:
                self.peak_tracked = len(counts)
        else:
            counts.move_to_end(key)
            if n < self.sightings:
                n = counts[key] = n + 1
        return None if n >= self.sightings else self.REASON

    def count(self, key: Hashable) -> int:
        """Offers of ``key`` the window holds (0: not tracked)."""
        return self._counts.get(key, 0)

    def __len__(self) -> int:
        return len(self._counts)

    def clear(self) -> None:
        self._counts.clear()

    def __repr__(self) -> str:
        return (f"<FrequencyGate [tracked: {len(self._counts)} of {self.window} | sightings={self.sightings}, "
                f"tier={self.tier}]>")


@dataclass(frozen=True, slots=True)
class AdmissionStatistics:
    """Decisions of a `CountedAdmission` since it was made.

    ``offered[tier]`` and ``admitted[tier]`` count blocks; ``skipped`` maps
    ``(tier, reason)`` to blocks skipped for that reason.
    """

    policy: str
    offered: Mapping[str, int]
    admitted: Mapping[str, int]
    skipped: Mapping[tuple[str, str], int]


class CountedAdmission:
    """A `StoreAdmission` with its decisions counted (by tier and reason).

    Raises `ConfigurationError` when ``policy`` has no callable ``admit``, and
    from ``admit`` when the policy returns something other than None or a
    non-empty string (the reason becomes a metric label).
    """

    def __init__(self, policy: StoreAdmission) -> None:
        if not callable(getattr(policy, "admit", None)):
            raise ConfigurationError(f"a store admission policy needs an admit(key, tier) method; got {policy!r}")
        self.policy = policy
        self._offered: dict[str, int] = dict.fromkeys(TIERS, 0)
        self._admitted: dict[str, int] = dict.fromkeys(TIERS, 0)
        self._skipped: dict[tuple[str, str], int] = {}

    def admit(self, key: Hashable, tier: Tier) -> bool:
        """Whether ``tier`` stores ``key``; counts the decision."""
        reason = self.policy.admit(key, tier)
        self._offered[tier] += 1
        if reason is None:
            self._admitted[tier] += 1
            return True
        if not isinstance(reason, str) or not reason:
            raise ConfigurationError(
                f"store admission policy {self.policy!r} must return None or a non-empty reason string; "
                f"got {reason!r}"
            )
        self._skipped[tier, reason] = self._skipped.get((tier, reason), 0) + 1
        return False

    @property
    def stores_all(self) -> bool:
        return isinstance(self.policy, StoreAll)

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            policy=type(self.policy).__name__, offered=dict(self._offered), admitted=dict(self._admitted),
            skipped=dict(self._skipped),
        )

    def __repr__(self) -> str:
        skipped = sum(self._skipped.values())
        return f"<CountedAdmission {self.policy!r} [offered: {sum(self._offered.values())}, skipped: {skipped}]>"


def check_admission_options(name: object, sightings: object = None, window: object = None) -> None:
    """Check store admission option values without importing anything.

    Raises `ConfigurationError` naming the option and the value: a name that
    is neither built in nor ``"module:factory"``, ``admission_sightings`` /
    ``admission_window`` given for a policy other than ``"frequency"``, or one
    that is not an int >= 1.
    """
    if not isinstance(name, str) or not (name in ADMISSION_POLICIES or _factory_path(name) is not None):
        raise ConfigurationError(
            f"option 'store_admission' must be one of {list(ADMISSION_POLICIES)} or 'module:factory'; got {name!r}"
        )
    for option, value in (("admission_sightings", sightings), ("admission_window", window)):
        if value is None:
            continue
        if name != "frequency":
            raise ConfigurationError(
                f"option {option!r} applies to store_admission='frequency' only; store_admission is {name!r}"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"option {option!r} must be an int >= 1; got {value!r}")


def _factory_path(name: str) -> tuple[str, str] | None:
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        return None
    return module_name, attr


def make_admission(
    name: str = "all", *, sightings: int | None = None, window: int | None = None, tier: Tier = "host"
) -> StoreAdmission:
    """A store admission policy from option values.

    ``name``: ``"all"`` (`StoreAll`), ``"frequency"`` (`FrequencyGate` with
    ``sightings``, default 2, ``window``, default 65536, counting offers to
    ``tier``), or
    ``"package.module:factory"``: an engine's own; ``factory()``, called with
    no arguments, must return an object with ``admit(key, tier)``. Raises
    `ConfigurationError` naming the option and the value (see
    `check_admission_options`), also for a factory that cannot be imported or
    returns no policy.
    """
    check_admission_options(name, sightings, window)
    if name == "all":
        return StoreAll()
    if name == "frequency":
        return FrequencyGate(2 if sightings is None else sightings, 65536 if window is None else window, tier=tier)
    path = _factory_path(name)
    assert path is not None  # checked above
    module_name, attr = path
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"option 'store_admission'={name!r} cannot be imported: {exc}") from exc
    policy = factory() if callable(factory) else None
    if not callable(getattr(policy, "admit", None)):
        raise ConfigurationError(
            f"option 'store_admission'={name!r}: {attr}() must return an object with admit(key, tier); "
            f"got {policy!r}"
        )
    return cast(StoreAdmission, policy)


# -- host eviction -------------------------------------------------------------------


@runtime_checkable
class HostEviction(Protocol):
    """The order in which a tier gives up its resident blocks.

    The caller tells it every block that becomes resident (``insert``), every
    use of a resident block (``access``: a hit, a load, a re-offer), and every
    block it drops on its own (``remove``). ``victims(n, evictable)`` picks up
    to ``n`` keys that ``evictable`` accepts, removes them from the policy and
    returns them in eviction order; it never returns a key ``evictable``
    refuses, and returns fewer than ``n`` only when fewer are evictable.
    """

    def insert(self, key: Hashable) -> None: ...

    def access(self, key: Hashable) -> None: ...

    def remove(self, key: Hashable) -> None: ...

    def victims(self, n: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]: ...

    def clear(self) -> None: ...

    def __len__(self) -> int: ...


def _pick(order: OrderedDict[Hashable, None], n: int, evictable: Callable[[Hashable], bool],
          out: list[Hashable]) -> None:
    """Add up to ``n`` evictable keys of ``order`` (oldest first) to ``out``, leaving ``order`` as it is."""
    if n <= 0:
        return
    start = len(out)
    for key in order:
        if evictable(key):
            out.append(key)
            if len(out) - start == n:
                break


def _take(order: OrderedDict[Hashable, None], n: int, evictable: Callable[[Hashable], bool],
          out: list[Hashable]) -> None:
    """Move up to ``n`` evictable keys of ``order`` (oldest first) to ``out``."""
    start = len(out)
    _pick(order, n, evictable, out)
    for key in out[start:]:
        del order[key]


class LruEviction:
    """Least recently used first (kvtier's host tier before policies)."""

    def __init__(self, capacity: int | None = None) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self, n: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        out: list[Hashable] = []
        _take(self._order, n, evictable, out)
        return out

    def candidates(self, n: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        """What `victims` would return, without removing anything."""
        out: list[Hashable] = []
        _pick(self._order, n, evictable, out)
        return out

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __repr__(self) -> str:
        return f"<LruEviction [{len(self._order)} blocks]>"


class SegmentedLruEviction:
    """Segmented LRU (SLRU): a probation and a protected segment, each LRU.

    A block enters probation. Its first reuse (``access``) moves it to the
    protected segment; once that holds more than ``protected`` blocks (80% of
    ``capacity`` by default) its least recently used block goes back to the
    most recently used end of probation. Victims come from probation first
    (least recently used first), then from the protected segment. So a block
    used once can never push out a block used twice while probation has an
    evictable one: a scan of one-shot prompts churns probation only.
    SLRU is Karedla, Love and Wherry's (IEEE Computer, 1994) and the main
    region of W-TinyLFU (Einziger, Friedman and Manes, ACM ToS 2017; the
    Caffeine cache); unlike ARC it keeps no ghost lists, so its state is the
    resident blocks alone, and pinned blocks are simply skipped.

    Raises `ConfigurationError` for a ``capacity`` < 1 or a ``protected_share``
    outside (0, 1).
    """

    def __init__(self, capacity: int, protected_share: float = 0.8) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigurationError(f"SLRU needs a capacity of at least one block; got {capacity!r}")
        if isinstance(protected_share, bool) or not isinstance(protected_share, (int, float)) \
                or not 0 < protected_share < 1:
            raise ConfigurationError(f"SLRU protected_share must be a number in (0, 1); got {protected_share!r}")
        self.capacity = capacity
        self.protected = max(1, int(capacity * protected_share))
        self._probation: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first
        self._protected: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        self._probation[key] = None
        self._probation.move_to_end(key)

    def access(self, key: Hashable) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        if key not in self._probation:
            return
        del self._probation[key]
        self._protected[key] = None
        if len(self._protected) > self.protected:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    def remove(self, key: Hashable) -> None:
        if key in self._probation:
            del self._probation[key]
        else:
            self._protected.pop(key, None)

    def victims(self, n: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        out: list[Hashable] = []
        _take(self._probation, n, evictable, out)
        _take(self._protected, n - len(out), evictable, out)
        return out

    def candidates(self, n: int, evictable: Callable[[Hashable], bool]) -> list[Hashable]:
        """What `victims` would return, without removing anything."""
        out: list[Hashable] = []
        _pick(self._probation, n, evictable, out)
        _pick(self._protected, n - len(out), evictable, out)
        return out

    def segment(self, key: Hashable) -> str | None:
        """``"probation"``, ``"protected"`` or None (not resident)."""
        return "probation" if key in self._probation else "protected" if key in self._protected else None

    def clear(self) -> None:
        self._probation.clear()
        self._protected.clear()

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected

    def __repr__(self) -> str:
        return (f"<SegmentedLruEviction [probation: {len(self._probation)}, protected: {len(self._protected)} "
                f"of {self.protected}]>")


def make_eviction(name: str, capacity: int) -> HostEviction:
    """A host eviction policy by option value: ``"lru"`` or ``"slru"``.

    Raises `ConfigurationError` naming the option ``host_eviction`` and the value.
    """
    if name == "lru":
        return LruEviction(capacity)
    if name == "slru":
        return SegmentedLruEviction(capacity)
    raise ConfigurationError(f"option 'host_eviction' must be one of {list(EVICTION_POLICIES)}; got {name!r}")


# -- host eviction for an engine that drives TransferScheduler itself ------------------


class HostPageFreer(Protocol):
    """What `HostCacheIndex` needs of a scheduler: `TransferScheduler.free_host`."""

    def free_host(self, host_indices: Mapping[str, Any]) -> None: ...


def _owned(idx: Any) -> Any:
    """A copy of one pool's host slots that nobody else holds: a tensor's
    clone, an array's copy, or a list of ints."""
    if hasattr(idx, "clone"):
        return idx.clone()
    if hasattr(idx, "copy") and hasattr(idx, "tolist"):
        return idx.copy()
    return [int(i) for i in idx]


class HostCacheIndex:
    """An engine's host cache index over one `TransferScheduler`: block key ->
    the host pages it holds there, given up in ``eviction``'s order.

    The engine `insert`\\ s a block after its backup (the ``host_indices`` of
    the backup's handle or result, which the engine holds), `lookup`\\ s it
    for a hit (a use, which the policy counts) and `pin`\\ s it while it
    loads from those pages or writes them to the store. `reclaim` is the
    scheduler's reclaim hook (``TransferScheduler(group, reclaim=index.reclaim)``,
    then `bind` the scheduler): when host pages of a pool run short it frees
    victims with ``free_host`` until enough slots of that pool are free (the
    shortfall only: slots free already count), or no evictable block holds
    that pool. It keeps its own copy of the indices it is given and hands
    out copies, so an engine may reuse its buffers. Every method happens
    whole or changes nothing: an eviction frees its victims in one
    ``free_host`` call, and when that raises (pages the engine freed itself,
    a call from the wrong thread) every block stays held and evictable. It never frees a pinned block, nor any
    page it was not given: named host pages of a backup that the engine did
    not insert, and pages of blocks it `remove`\\ d, stay the engine's. A page
    an in-flight operation still uses is freed when that operation ends (the
    scheduler defers it), never under it.

    Runs on the scheduler's loop thread: every call is a few dict operations
    plus the policy's O(1) work. ``eviction`` defaults to `LruEviction`.
    """

    def __init__(self, eviction: HostEviction | None = None) -> None:
        if eviction is not None and not all(
            callable(getattr(eviction, m, None)) for m in ("insert", "access", "remove", "victims")
        ):
            raise ConfigurationError(
                f"eviction must be a kvtier.policies.HostEviction (insert/access/remove/victims); got {eviction!r:.80}"
            )
        self.eviction: HostEviction = eviction if eviction is not None else LruEviction()
        self._blocks: dict[Hashable, dict[str, Any]] = {}
        self._slots: dict[Hashable, dict[str, int]] = {}  # per block, slots per pool
        self._pins: dict[Hashable, int] = {}
        self._freer: HostPageFreer | None = None
        self.evicted = 0  # blocks freed by reclaim or evict

    def bind(self, scheduler: HostPageFreer) -> None:
        """The scheduler whose host pages this index frees (once it exists:
        its constructor takes `reclaim`)."""
        if not callable(getattr(scheduler, "free_host", None)):
            raise ConfigurationError(f"HostCacheIndex.bind needs a TransferScheduler (free_host); got {scheduler!r:.80}")
        self._freer = scheduler

    def insert(self, key: Hashable, host_indices: Mapping[str, Any]) -> None:
        """Hold ``host_indices`` (pool -> host slots, a backup's) for ``key``:
        the index keeps its own copy, so the caller may reuse its tensors as
        soon as this returns. `ConfigurationError` for a key already held
        (nothing changes)."""
        if key in self._blocks:
            raise ConfigurationError(f"HostCacheIndex already holds block {key!r:.80}; remove or evict it first")
        pages = {pool: _owned(idx) for pool, idx in host_indices.items()}
        slots = {pool: len(idx) for pool, idx in pages.items()}
        self.eviction.insert(key)  # first: a policy that raises leaves the index as it was
        self._blocks[key] = pages
        self._slots[key] = slots

    def lookup(self, key: Hashable) -> Mapping[str, Any] | None:
        """The host pages of ``key`` (a use, counted by the policy), or None:
        a copy, the caller's to keep or change."""
        pages = self._blocks.get(key)
        if pages is None:
            return None
        self.eviction.access(key)
        return {pool: _owned(idx) for pool, idx in pages.items()}

    def pin(self, key: Hashable) -> None:
        """Keep ``key`` from eviction until as many `unpin` calls (a load or a
        store write of its pages in flight). `ConfigurationError` for a key not held."""
        if key not in self._blocks:
            raise ConfigurationError(f"HostCacheIndex holds no block {key!r:.80}; pin a block it holds (insert it first)")
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: Hashable) -> None:
        n = self._pins.get(key, 0)
        if n <= 1:
            self._pins.pop(key, None)
        else:
            self._pins[key] = n - 1

    def remove(self, key: Hashable) -> Mapping[str, Any] | None:
        """Forget ``key`` without freeing: its host pages go back to the caller."""
        pages = self._blocks.get(key)
        if pages is not None:
            self.eviction.remove(key)
            del self._blocks[key], self._slots[key]
            self._pins.pop(key, None)
        return pages

    def _freer_or_raise(self) -> HostPageFreer:
        freer = self._freer
        if freer is None:
            raise ConfigurationError("HostCacheIndex has no scheduler to free pages with: call bind(scheduler) first")
        return freer

    def _free(self, keys: list[Hashable], taken: bool) -> None:
        """Free the pages of ``keys`` in one `free_host` call (all or nothing)
        and forget them. ``taken``: the policy gave them up already (`victims`);
        else they are removed from it once freed. When the free raises
        (`InvalidIndices`: the engine freed some itself; `WrongEventLoop`: the
        wrong thread), nothing was freed: every key stays held and, when the
        policy had given it up, goes back to it (at its most recent end for a
        policy without ``candidates``), and the error goes on up."""
        if not keys:
            return
        freer = self._freer_or_raise()
        merged: dict[str, list[int]] = {}
        for key in keys:
            for pool, idx in self._blocks[key].items():
                merged.setdefault(pool, []).extend(idx.tolist() if hasattr(idx, "tolist") else idx)
        try:
            freer.free_host(merged)
        except BaseException:
            if taken:
                for key in keys:
                    self.eviction.insert(key)
            raise
        for key in keys:
            if not taken:
                self.eviction.remove(key)
            del self._blocks[key], self._slots[key]
        self.evicted += len(keys)

    def _choose(self, n: int, evictable: Callable[[Hashable], bool]) -> tuple[list[Hashable], bool]:
        """Up to ``n`` victims in the policy's order, and whether the policy gave them up already."""
        candidates = getattr(self.eviction, "candidates", None)
        if candidates is not None:
            return list(candidates(n, evictable)), False
        return self.eviction.victims(n, evictable), True

    def evict(self, n: int) -> list[Hashable]:
        """Free up to ``n`` unpinned blocks in the policy's order; their keys.
        All or nothing (see `_free`)."""
        self._freer_or_raise()
        keys, taken = self._choose(n, lambda k: k not in self._pins)
        self._free(keys, taken)
        return keys

    async def reclaim(self, pool: str, tier: str, slots_needed: int) -> None:
        """The scheduler's reclaim hook: free victims holding host slots of
        ``pool`` until ``slots_needed`` slots of it are free (those free
        already count: only the shortfall is evicted; device tier: nothing).
        All or nothing (see `_free`)."""
        if tier != "host":
            return
        self._freer_or_raise()
        slots = self._slots
        short = slots_needed - self._free_slots(pool)
        chosen: list[Hashable] = []
        seen: set[Hashable] = set()
        taken = False
        while short > 0:
            picked, taken = self._choose(
                1, lambda k: k not in self._pins and k not in seen and slots[k].get(pool, 0) > 0
            )
            if not picked:
                break
            seen.add(picked[0])
            chosen.append(picked[0])
            short -= slots[picked[0]][pool]
        self._free(chosen, taken)

    def _free_slots(self, pool: str) -> int:
        """Free host slots of ``pool`` in the bound scheduler's group (0 when it has none to read)."""
        group = getattr(self._freer, "group", None)
        try:
            return int(group[pool].host.allocator.num_free_slots)  # type: ignore[index]
        except (AttributeError, KeyError, TypeError):
            return 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __repr__(self) -> str:
        return f"<HostCacheIndex [{len(self._blocks)} blocks, {len(self._pins)} pinned] {self.eviction!r}>"
