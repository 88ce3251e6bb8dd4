"""A test kit for kvtier and for engines that embed it.

* `FaultInjectingExecutor`: runs copies like `CpuExecutor`, and on request fails
  chosen batches, fails at a chosen layer or on a chosen pool's copy, fails
  batches at random (seeded, so a run is reproducible), delays copies, or holds
  a batch in flight until the test releases it. `FaultRecord` says what it did.
* Pool-group builders for common model shapes, with random device contents:
  `full_attention_group`, `sliding_window_group`, `hybrid_group`.
* `device_rows`: a copy of the rows a pool holds at some device indices, for
  byte-exact comparisons.
* `MemoryStore`: a `StorageBackend` in memory with seeded faults (a failing put
  may commit a prefix of its pages, each whole) and a gate that holds calls;
  `StoreFault` says what it did.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import anyio
import anyio.to_thread
import torch

from kvtier.pools import DevicePool, PageAllocator, PoolGroup
from kvtier.pools.host import Layout
from kvtier.storage.base import PageBlobs, check_keys, check_pools
from kvtier.storage.errors import StorageError, StorageTimeout
from kvtier.transfers import Batch, LayerProgress, run_batch_copies

__all__ = [
    "FaultInjectingExecutor",
    "FaultRecord",
    "InjectedFault",
    "MemoryStore",
    "StoreFault",
    "device_rows",
    "full_attention_group",
    "hybrid_group",
    "sliding_window_group",
]


class InjectedFault(RuntimeError):
    """The error a `FaultInjectingExecutor` raises where told to fail."""


@dataclass(frozen=True, slots=True)
class FaultRecord:
    """One fault a `FaultInjectingExecutor` injected.

    ``layer`` is the transfer layer it failed at (layers below it were copied);
    ``pool`` is the pool whose copy raised, layers below ``layer`` and pools
    before it in that layer having been copied (None: the whole layer failed
    before its first copy). ``drawn`` is True for a fault drawn at random.
    """

    batch: int
    operation_ids: tuple[int, ...]
    layer: int
    pool: str | None
    drawn: bool


class FaultInjectingExecutor:
    """A CPU executor with deterministic faults.

    Batches are numbered from 0 in the order this executor receives them.

    * ``fail_batches``: those batches fail.
    * ``fail_at_layer``: a failing batch copies layers below it, then raises
      (default 0: nothing copied).
    * ``fail_pool``: a failing batch raises on that pool's first copy instead
      (it must be in the batch, else the batch succeeds).
    * ``fail_probability``: each batch not in ``fail_batches`` fails with this
      probability, at a random transfer layer: either before that layer's first
      copy or at one random pool's copy within it (None and each pool of the
      batch equally likely), so earlier layers and pools have landed (a partial
      write). The draws for batch ``n`` depend only on ``seed`` and ``n``, so the
      same sequence of batches fails the same way in every run.
    * ``delay_s``: sleep this long in the worker before each batch; plus, with
      ``delay_jitter_s``, a seeded random extra in ``[0, delay_jitter_s)``.
    * ``hold``: a `threading.Event`; when set on the executor, each batch waits
      in the worker until the test sets it (for in-flight cancellation tests),
      at most ``hold_timeout_s`` seconds: a test that fails before it releases
      the batch then fails in seconds (the batch raises `InjectedFault`)
      instead of hanging in ``async with TransferScheduler``.

    Each batch waits for its fences (``after=``) before copying, as the
    `CopyExecutor` contract asks of every executor.

    ``faults`` lists a `FaultRecord` per fault injected (``faults_injected``
    counts them); ``history`` the direction and operation ids of every batch.
    Raises `ValueError` for a probability outside ``[0, 1]`` or a negative delay.
    """

    def __init__(
        self,
        *,
        fail_batches: Collection[int] = (),
        fail_at_layer: int = 0,
        fail_pool: str | None = None,
        fail_probability: float = 0.0,
        seed: int = 0,
        delay_s: float = 0.0,
        delay_jitter_s: float = 0.0,
        hold: threading.Event | None = None,
        hold_timeout_s: float = 30.0,
    ) -> None:
        if not hold_timeout_s > 0:
            raise ValueError(f"hold_timeout_s must be > 0 seconds; got {hold_timeout_s!r}")
        if not 0.0 <= fail_probability <= 1.0:
            raise ValueError(f"fail_probability must be in [0, 1]; got {fail_probability!r}")
        if delay_s < 0 or delay_jitter_s < 0:
            raise ValueError(
                f"delays must be >= 0 seconds; got delay_s={delay_s!r}, delay_jitter_s={delay_jitter_s!r}"
            )
        self.fail_batches = set(fail_batches)
        self.fail_at_layer = fail_at_layer
        self.fail_pool = fail_pool
        self.fail_probability = fail_probability
        self.seed = seed
        self.delay_s = delay_s
        self.delay_jitter_s = delay_jitter_s
        self.hold = hold
        self.hold_timeout_s = hold_timeout_s
        self.batches_seen = 0
        self.faults: list[FaultRecord] = []
        # (direction, operation ids) of every batch, in the order received.
        self.history: list[tuple[str, tuple[int, ...]]] = []
        self.started = threading.Event()  # set when a batch reaches the worker
        self._limiter = anyio.CapacityLimiter(1)

    @property
    def max_in_flight(self) -> int:
        return 1

    @property
    def faults_injected(self) -> int:
        return len(self.faults)

    async def execute(self, batch: Batch, progress: LayerProgress) -> None:
        number = self.batches_seen
        self.batches_seen += 1
        ids = tuple(i for op in batch.operations for i in op.request_ids)
        self.history.append((batch.direction.value, ids))
        await anyio.to_thread.run_sync(self._run, batch, progress, number, ids, limiter=self._limiter)

    def _run(self, batch: Batch, progress: LayerProgress, number: int, ids: tuple[int, ...]) -> None:
        self.started.set()
        if self.hold is not None and not self.hold.wait(self.hold_timeout_s):
            raise InjectedFault(f"batch {number} was held for {self.hold_timeout_s} s and never released")
        for fence in batch.fences:  # as every executor must (`CopyExecutor`): the copies wait for after=
            fence.synchronize()  # type: ignore[attr-defined]
        # A string seed hashes the same in every process (unlike hash()).
        rng = random.Random(f"kvtier-faults:{self.seed}:{number}")
        delay = self.delay_s + (rng.random() * self.delay_jitter_s if self.delay_jitter_s else 0.0)
        if delay:
            time.sleep(delay)
        plan = batch.plan()
        fault: FaultRecord | None = None
        if number in self.fail_batches:
            layer = 0 if self.fail_pool is not None else self.fail_at_layer
            fault = FaultRecord(number, ids, layer, self.fail_pool, drawn=False)
        elif self.fail_probability and rng.random() < self.fail_probability and plan.num_layers:
            names = sorted({c.name for c in plan.copies})
            pool = rng.choice([None, *names]) if names else None
            fault = FaultRecord(number, ids, rng.randrange(plan.num_layers), pool, drawn=True)
        if fault is None:
            run_batch_copies(batch, progress)  # the production copy path
            return
        for layer in range(plan.num_layers):
            if fault is not None and fault.pool is None and layer == fault.layer:
                self.faults.append(fault)
                raise InjectedFault(f"injected fault at layer {layer}")
            for c in plan.copies:
                # An explicit fail_pool fails on the pool's first copy; a drawn one
                # at its drawn layer, whether or not the pool has that layer.
                if fault is not None and c.name == fault.pool and (not fault.drawn or layer == fault.layer):
                    self.faults.append(FaultRecord(number, ids, layer, c.name, fault.drawn))
                    raise InjectedFault(f"injected fault in pool {c.name!r} at layer {layer}")
                j = c.device.pool_layer(layer)
                if j is None:
                    continue
                c.copy_pool_layers([j])
            progress.layer_done(layer)


def _random_layers(
    num_layers: int, slots: int, planes: list[tuple[int, ...]], dtype: torch.dtype, gen: torch.Generator
) -> list[list[torch.Tensor]]:
    def one(shape: tuple[int, ...]) -> torch.Tensor:
        if dtype.is_floating_point:
            return torch.randn((slots, *shape), generator=gen).to(dtype)
        return torch.randint(-100, 100, (slots, *shape), generator=gen, dtype=dtype)

    return [[one(shape) for shape in planes] for _ in range(num_layers)]


def full_attention_group(
    *,
    layers: int = 4,
    page_size: int = 4,
    device_slots: int = 64,
    host_slots: int = 128,
    heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    layout: Layout = "layer_first",
    device_allocator: bool = False,
    seed: int = 0,
) -> PoolGroup:
    """One ``kv`` pool with K and V planes on every layer."""
    gen = torch.Generator().manual_seed(seed)
    alloc = PageAllocator(device_slots, page_size, name="kv") if device_allocator else None
    group = PoolGroup()
    group.add_pool(
        "kv",
        device=DevicePool(_random_layers(layers, device_slots, [(heads, head_dim)] * 2, dtype, gen), allocator=alloc),
        page_size=page_size, host_slots=host_slots, layout=layout,
    )
    return group


def sliding_window_group(
    *,
    layers: int = 4,
    page_size: int = 4,
    device_slots: int = 64,
    host_slots: int = 128,
    dtype: torch.dtype = torch.float32,
    layout: Layout = "layer_first",
    seed: int = 0,
) -> PoolGroup:
    """Full attention (``kv``) on even layers, sliding window (``swa``) on odd ones."""
    gen = torch.Generator().manual_seed(seed)
    full = [t if t % 2 == 0 else None for t in range(layers)]
    window = [None if t % 2 == 0 else t for t in range(layers)]
    kv_map = [None if j is None else j // 2 for j in full]
    swa_map = [None if j is None else j // 2 for j in window]
    group = PoolGroup()
    group.add_pool(
        "kv", device=DevicePool(_random_layers((layers + 1) // 2, device_slots, [(2, 8)] * 2, dtype, gen), kv_map),
        page_size=page_size, host_slots=host_slots, layout=layout,
    )
    group.add_pool(
        "swa", device=DevicePool(_random_layers(layers // 2, device_slots, [(2, 8)] * 2, dtype, gen), swa_map),
        page_size=page_size, host_slots=host_slots, layout=layout,
    )
    return group


def hybrid_group(
    *,
    layers: int = 4,
    page_size: int = 8,
    device_slots: int = 64,
    host_slots: int = 128,
    ring: int = 3,
    state_slots: int = 16,
    layout: Layout = "layer_first",
    device_allocator: bool = False,
    seed: int = 0,
) -> PoolGroup:
    """Every pool kind:

    * ``kv``: full attention (K, V) on every layer;
    * ``swa``: sliding window (K, V) on even layers;
    * ``c4``: compressed KV, sidecar of ``kv``, ``page_size // 4`` rows per page, bf16;
    * ``swa_state``: ring-shaped state, sidecar of ``swa`` with ``ring`` rows per page;
    * ``state``: per-request recurrent state, its own pool of page size 1 (value and int8 scale planes);
    * ``tok``: a logical anchor (no bytes) driving ``idx``, an indexer sidecar of one row per page.

    With ``device_allocator``, ``kv``, ``swa``, ``state`` and ``tok`` get a device
    `PageAllocator` each (over all their device slots), so loads may leave out
    their device indices.
    """
    if page_size % 4:
        raise ValueError(f"hybrid_group needs a page_size divisible by 4; got {page_size}")
    gen = torch.Generator().manual_seed(seed)
    pages = device_slots // page_size
    even = [t // 2 if t % 2 == 0 else None for t in range(layers)]

    def alloc(name: str, slots: int, size: int) -> PageAllocator | None:
        return PageAllocator(slots, size, name=name) if device_allocator else None

    group = PoolGroup()
    group.add_pool(
        "kv",
        device=DevicePool(
            _random_layers(layers, device_slots, [(2, 8)] * 2, torch.float32, gen),
            allocator=alloc("kv", device_slots, page_size),
        ),
        page_size=page_size, host_slots=host_slots, layout=layout,
    )
    group.add_pool(
        "swa",
        device=DevicePool(
            _random_layers((layers + 1) // 2, device_slots, [(2, 8)] * 2, torch.float32, gen), even,
            allocator=alloc("swa", device_slots, page_size),
        ),
        page_size=page_size, host_slots=host_slots, layout=layout,
    )
    group.add_sidecar(
        "c4", source="kv", rows_per_page=page_size // 4,
        device=DevicePool(_random_layers(layers, pages * (page_size // 4), [(16,)], torch.bfloat16, gen)),
        layout=layout,
    )
    group.add_sidecar(
        "swa_state", source="swa", rows_per_page=ring,
        device=DevicePool(_random_layers((layers + 1) // 2, pages * ring, [(4,)], torch.float32, gen), even),
        layout=layout,
    )
    state_layers = [
        [
            torch.randn((state_slots, 4, 4), generator=gen),
            torch.randint(-128, 127, (state_slots, 4), generator=gen, dtype=torch.int8),
        ]
        for _ in range(layers)
    ]
    group.add_pool(
        "state", device=DevicePool(state_layers, allocator=alloc("state", state_slots, 1)),
        page_size=1, host_slots=state_slots * 2, layout=layout,
    )
    group.add_logical_pool(
        "tok", page_size=page_size, host_slots=host_slots, device_slots=device_slots,
        device_allocator=alloc("tok", device_slots, page_size),
    )
    group.add_sidecar(
        "idx", source="tok", rows_per_page=1,
        device=DevicePool(_random_layers(layers, pages, [(8,)], torch.float16, gen)),
        layout=layout,
    )
    return group


def device_rows(group: PoolGroup, pool: str, device_indices: torch.Tensor) -> list[list[torch.Tensor]]:
    """A copy of ``pool``'s rows at ``device_indices``, per pool layer and plane."""
    dev = group[pool].device
    if dev is None:
        return []
    return [
        [dev.tensor(j, p)[device_indices].clone() for p in range(len(dev.planes))]
        for j in range(dev.num_layers)
    ]


# -- an in-memory storage backend with seeded faults ------------------------------

# This section's public record; listed here so that __all__ stays true.
__all__ += ["StoreCorruption"]


@dataclass(frozen=True, slots=True)
class StoreFault:
    """One fault a `MemoryStore` injected: the ``operation`` (``"exists"``,
    ``"get"`` or ``"put"``) and the keys of the call, how many pages of a put
    were committed before it raised (``published``, the first ones; 0 for the
    other operations), and the error it raised (the very object the caller got).
    """

    operation: str
    keys: tuple[bytes, ...]
    published: int
    error: StorageError


@dataclass(frozen=True, slots=True)
class StoreCorruption:
    """One stored page a `MemoryStore` damaged, as a shared store can.

    ``kind`` is ``"flip"`` (byte ``position`` of pool ``pool``'s blob inverted:
    same length, so ``exists`` and ``get`` still see the page and return the
    changed bytes; `decode_page` catches it), ``"drop"`` (pool ``pool``'s blob
    lost: the page is a miss) or ``"malform"`` (its commit record replaced by
    one no reader accepts: a miss; ``pool`` and ``position`` are None),
    ``"swap"`` (the whole page stored under key ``source`` copied under
    ``key``: present, and `decode_page` refuses it by its key tag) or
    ``"splice"`` (pool ``pool``'s blob of page ``source`` copied into page
    ``key``: the same). ``drawn`` is True for a fault drawn at put time
    (``corrupt_probability``), False for one a test asked for. A later put of
    the key replaces the page.
    """

    key: bytes
    kind: str
    pool: str | None
    position: int | None
    drawn: bool
    source: bytes | None = None


class MemoryStore:
    """A `StorageBackend` in a dict, with seeded faults and a gate, for tests.

    ``pages`` maps each committed key to its blobs (pool name -> bytes); a put
    commits page by page, so a reader sees a page whole or not at all.

    * ``fail_probability``: each call fails with this probability, raising
      `StorageError` or `StorageTimeout` (even odds). A failing put first
      commits a random prefix of its pages (none to all), each whole. The draw
      for a call depends only on ``seed``, the operation, its keys and how many
      calls with the same operation and keys came before it, not on the order
      in which concurrent callers make different calls: the same calls fail the
      same way in every run.
    * ``delay_s``: sleep this long (on the event loop) in every call.
    * Damaged pages, as a shared store shows them (`StoreCorruption`):
      `corrupt` flips a byte of a stored blob, `drop_part` loses a blob,
      `malform` spoils a page's commit record, `swap` copies another page
      under a key and `splice` another page's blob into a page (a store bug,
      a migration or a copy tool: bytes that pass their own checksum but
      belong to another key). With ``corrupt_probability``,
      each page a put commits is, with that probability, given a flip, a
      drop or a malform (kind, pool and position drawn too), from ``seed``, the key and
      how many puts of that key came before: the same puts damage the same
      pages the same way in every run, and a put that repairs a page draws
      anew. ``corruptions`` lists a `StoreCorruption` per page damaged.
    * `hold` makes calls of the given operations wait at a gate until `step`
      lets the oldest one through or `release` lets all through; ``waiting``
      lists the held calls. Call these on the store's event loop.

    ``faults`` lists a `StoreFault` per fault injected; ``calls`` counts calls.
    After `aclose` every call raises `StorageError`. Raises `ValueError` for a
    probability outside ``[0, 1]`` or a negative delay.

    A page is present when its key is in ``pages`` and, once `drop_part` or
    `malform` damaged it, its commit record (kept aside, with the blob lengths
    of the page as it was put) still holds and names every blob with its
    length; a put of the key clears the damage. Tests may add, replace and
    delete entries of ``pages`` directly: a replaced entry is undamaged.
    """

    name = "memory"

    def __init__(
        self,
        *,
        fail_probability: float = 0.0,
        seed: int = 0,
        delay_s: float = 0.0,
        corrupt_probability: float = 0.0,
    ) -> None:
        if not 0.0 <= fail_probability <= 1.0:
            raise ValueError(f"fail_probability must be in [0, 1]; got {fail_probability!r}")
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0 seconds; got {delay_s!r}")
        if isinstance(corrupt_probability, bool) or not 0.0 <= corrupt_probability <= 1.0:
            raise ValueError(f"corrupt_probability must be in [0, 1]; got {corrupt_probability!r}")
        self.fail_probability = fail_probability
        self.seed = seed
        self.delay_s = delay_s
        self.corrupt_probability = corrupt_probability
        self.pages: dict[bytes, dict[str, bytes]] = {}
        self.faults: list[StoreFault] = []
        self.corruptions: list[StoreCorruption] = []
        self.calls = 0
        self._seen: dict[tuple[str, bytes], int] = {}
        # Commit records of damaged pages only: the page's blob dict they belong
        # to (an entry of ``pages`` replaced since makes the record stale), and
        # its blob lengths as put, or None for a malformed record. An undamaged
        # page's blobs are its record.
        self._records: dict[bytes, tuple[dict[str, bytes], dict[str, int] | None]] = {}
        self._puts: dict[bytes, int] = {}  # puts per key, for corrupt_probability draws
        self._held: frozenset[str] = frozenset()
        self._gate: list[tuple[str, tuple[bytes, ...], anyio.Event]] = []
        self._closed = False

    # -- the gate ---------------------------------------------------------------

    def hold(self, operations: Collection[str] = ("exists", "get", "put")) -> None:
        """Hold calls of ``operations`` (from now on) until `step` or `release`."""
        unknown = set(operations) - {"exists", "get", "put"}
        if unknown:
            raise ValueError(f"operations are 'exists', 'get' and 'put'; got {sorted(unknown)}")
        self._held = frozenset(operations)

    def release(self) -> None:
        """Let every held call go, and hold no more."""
        self._held = frozenset()
        gate, self._gate = self._gate, []
        for _, _, event in gate:
            event.set()

    def step(self) -> tuple[str, tuple[bytes, ...]] | None:
        """Let the oldest held call go; its operation and keys (None if none waits)."""
        if not self._gate:
            return None
        operation, keys, event = self._gate.pop(0)
        event.set()
        return operation, keys

    @property
    def waiting(self) -> list[tuple[str, tuple[bytes, ...]]]:
        """The held calls, oldest first: (operation, keys)."""
        return [(operation, keys) for operation, keys, _ in self._gate]

    # -- damaged pages ------------------------------------------------------------

    def corrupt(self, key: bytes, pool: str, position: int) -> StoreCorruption:
        """Invert byte ``position`` of pool ``pool``'s stored blob of page ``key``
        (same length: the page stays present and reads back changed).

        Raises `ValueError` for a page not stored, a pool it has no blob for, or
        a position outside the blob.
        """
        blob = self._blob(key, pool)
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < len(blob):
            raise ValueError(
                f"position must be an integer in 0..{len(blob) - 1}, within the {len(blob)}-byte blob of pool "
                f"{pool!r} of page {key.hex()}; got {position!r}"
            )
        return self._flip(key, pool, position, drawn=False)

    def drop_part(self, key: bytes, pool: str) -> StoreCorruption:
        """Lose pool ``pool``'s blob of page ``key`` (as an eviction of one object
        would): the page is a miss until put again. Raises `ValueError` for a
        page not stored or a pool it has no blob for."""
        self._blob(key, pool)
        return self._drop(key, pool, drawn=False)

    def malform(self, key: bytes) -> StoreCorruption:
        """Replace page ``key``'s commit record by one no reader accepts: the page
        is a miss until put again. Raises `ValueError` for a page not stored."""
        self._page(key)
        return self._malform(key, drawn=False)

    def swap(self, key: bytes, source: bytes) -> StoreCorruption:
        """Store page ``source``'s blobs under ``key`` too (its commit record
        with them): page ``key`` is present and holds another key's bytes.
        Raises `ValueError` for a page not stored or ``source == key``."""
        self._page(key)
        page = self._page(source)
        if source == key:
            raise ValueError(f"swap needs another page than {key.hex()} to copy under it")
        self.pages[key] = dict(page)
        self._records.pop(key, None)
        return self._damaged(StoreCorruption(key, "swap", None, None, False, source))

    def splice(self, key: bytes, pool: str, source: bytes) -> StoreCorruption:
        """Replace pool ``pool``'s blob of page ``key`` by page ``source``'s blob
        of that pool (one ``SET`` in a key-value store). Raises `ValueError`
        for a page not stored, a pool either page has no blob for, or
        ``source == key``."""
        self._blob(key, pool)
        blob = self._blob(source, pool)
        if source == key:
            raise ValueError(f"splice needs another page than {key.hex()} to take pool {pool!r}'s blob from")
        self._keep_record(key)
        self.pages[key][pool] = blob
        return self._damaged(StoreCorruption(key, "splice", pool, None, False, source))

    def _page(self, key: bytes) -> dict[str, bytes]:
        page = self.pages.get(key) if isinstance(key, bytes) else None
        if page is None:
            shown = key.hex() if isinstance(key, bytes) else repr(key)
            raise ValueError(f"memory store holds no page {shown}; only a stored page can be damaged")
        return page

    def _blob(self, key: bytes, pool: str) -> bytes:
        page = self._page(key)
        if pool not in page:
            raise ValueError(f"page {key.hex()} has no blob for pool {pool!r} (it has {sorted(page)})")
        return page[pool]

    def _record(self, key: bytes) -> tuple[dict[str, bytes], dict[str, int] | None] | None:
        """The damaged page's commit record, if it still belongs to ``pages[key]``."""
        entry = self._records.get(key)
        return entry if entry is not None and entry[0] is self.pages.get(key) else None

    def _keep_record(self, key: bytes) -> None:
        """Set the page's commit record aside (its blobs' lengths) before a fault changes them."""
        if self._record(key) is None:
            page = self.pages[key]
            self._records[key] = (page, {name: len(blob) for name, blob in page.items()})

    def _flip(self, key: bytes, pool: str, position: int, *, drawn: bool) -> StoreCorruption:
        blob = bytearray(self.pages[key][pool])
        blob[position] ^= 0xFF
        self.pages[key][pool] = bytes(blob)
        return self._damaged(StoreCorruption(key, "flip", pool, position, drawn))

    def _drop(self, key: bytes, pool: str, *, drawn: bool) -> StoreCorruption:
        self._keep_record(key)
        del self.pages[key][pool]
        return self._damaged(StoreCorruption(key, "drop", pool, None, drawn))

    def _malform(self, key: bytes, *, drawn: bool) -> StoreCorruption:
        self._records[key] = (self.pages[key], None)
        return self._damaged(StoreCorruption(key, "malform", None, None, drawn))

    def _damaged(self, record: StoreCorruption) -> StoreCorruption:
        self.corruptions.append(record)
        return record

    def _draw_corruption(self, key: bytes) -> None:
        """Maybe damage the page a put just committed (``corrupt_probability``)."""
        n = self._puts.get(key, 0)
        self._puts[key] = n + 1
        rng = random.Random(f"kvtier-store-corrupt:{self.seed}:{key.hex()}:{n}")
        if rng.random() >= self.corrupt_probability:
            return
        page = self.pages[key]
        kind = rng.choice(("flip", "drop", "malform"))
        pool = rng.choice(sorted(page))
        if kind == "flip" and page[pool]:
            self._flip(key, pool, rng.randrange(len(page[pool])), drawn=True)
        elif kind == "malform":
            self._malform(key, drawn=True)
        else:  # "drop", or a flip of an empty blob, which has no byte to flip
            self._drop(key, pool, drawn=True)

    def _present(self, key: bytes) -> dict[str, bytes] | None:
        """The page's blobs if it is present (see the class doc), else None."""
        page = self.pages.get(key)
        entry = self._record(key)
        if page is None or entry is None:
            return page
        record = entry[1]
        if record is None or any(name not in page or len(page[name]) != n for name, n in record.items()):
            return None
        return page

    # -- protocol ---------------------------------------------------------------

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether its page is present (committed and not damaged
        by `drop_part` or `malform`)."""
        keys = check_keys(keys)
        await self._enter("exists", keys)
        self._draw("exists", keys)
        return [self._present(k) is not None for k in keys]

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        """For each key, its blobs for ``pools``, or None (see `StorageBackend.get`)."""
        keys, names = check_keys(keys), check_pools(pools)
        await self._enter("get", keys)
        self._draw("get", keys)
        out: list[dict[str, bytes] | None] = []
        for k in keys:
            page = self._present(k)
            out.append(None if page is None or not set(names) <= set(page) else {n: page[n] for n in names})
        return out

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        """Commit every page, in order (a fault may commit a prefix first),
        replacing a stored page and any damage it had; with
        ``corrupt_probability``, maybe damage each page committed."""
        pages = list(pages)
        keys = [p.key for p in pages]
        await self._enter("put", keys)
        fault = self._draw("put", keys, pages=len(pages), raise_it=False)
        for page in pages[: len(pages) if fault is None else fault.published]:
            self.pages[page.key] = {n: bytes(memoryview(b).cast("B")) for n, b in page.blobs.items()}
            self._records.pop(page.key, None)
            if self.corrupt_probability:
                self._draw_corruption(page.key)
        if fault is not None:
            raise fault.error

    async def clear(self) -> int:
        """Drop every page (and any damage recorded on it); how many pages were stored."""
        await self._enter("clear", [])
        count = len(self.pages)
        self.pages.clear()
        self._records.clear()
        return count

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> MemoryStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        damaged = f", {len(self.corruptions)} pages damaged" if self.corruptions else ""
        return f"<MemoryStore [{len(self.pages)} pages, {len(self.faults)} faults{damaged}]>"

    # -- inside -------------------------------------------------------------------

    async def _enter(self, operation: str, keys: Sequence[bytes]) -> None:
        if operation in self._held:
            entry = (operation, tuple(keys), anyio.Event())
            self._gate.append(entry)
            try:
                await entry[2].wait()
            finally:
                if entry in self._gate:  # cancelled while held
                    self._gate.remove(entry)
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        if self._closed:
            raise StorageError("memory store is closed", backend=self.name, operation=operation)
        self.calls += 1

    def _draw(
        self, operation: str, keys: Sequence[bytes], *, pages: int = 0, raise_it: bool = True
    ) -> StoreFault | None:
        """The fault drawn for this call, if any: raised, or (``raise_it=False``,
        for a put, which commits its prefix first) returned."""
        digest = hashlib.blake2b(digest_size=16)
        for k in keys:
            digest.update(len(k).to_bytes(2, "little"))
            digest.update(k)
        signature = (operation, digest.digest())
        n = self._seen.get(signature, 0)
        self._seen[signature] = n + 1
        if not self.fail_probability:
            return None
        rng = random.Random(f"kvtier-store:{self.seed}:{operation}:{signature[1].hex()}:{n}")
        if rng.random() >= self.fail_probability:
            return None
        published = rng.randint(0, pages) if operation == "put" else 0
        timeout = rng.random() < 0.5
        message = f"memory store: injected {'timeout' if timeout else 'fault'} in {operation} of {len(keys)} keys"
        error: StorageError = (
            StorageTimeout(message, backend=self.name, operation=operation, timeout_s=0.0) if timeout
            else StorageError(message, backend=self.name, operation=operation)
        )
        fault = StoreFault(operation, tuple(keys), published, error)
        self.faults.append(fault)
        if raise_it:
            raise error
        return fault
