"""A test kit for kvtier and for engines that embed it.

* `FaultInjectingExecutor`: runs copies like `CpuExecutor`, and on request fails
  chosen batches, fails at a chosen layer or on a chosen pool's copy, delays
  copies, or holds a batch in flight until the test releases it.
* Pool-group builders for common model shapes, with random device contents:
  `full_attention_group`, `sliding_window_group`, `hybrid_group`.
* `device_rows`: a copy of the rows a pool holds at some device indices, for
  byte-exact comparisons.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection

import anyio
import anyio.to_thread
import torch

from kvtier.pools import DevicePool, PageAllocator, PoolGroup
from kvtier.pools.host import Layout
from kvtier.transfers import Batch, LayerProgress, apply_copy_plan

__all__ = [
    "FaultInjectingExecutor",
    "InjectedFault",
    "device_rows",
    "full_attention_group",
    "hybrid_group",
    "sliding_window_group",
]


class InjectedFault(RuntimeError):
    """The error a `FaultInjectingExecutor` raises where told to fail."""


class FaultInjectingExecutor:
    """A CPU executor with deterministic faults.

    Batches are numbered from 0 in the order this executor receives them.

    * ``fail_batches``: those batches fail.
    * ``fail_at_layer``: a failing batch copies layers below it, then raises
      (default 0: nothing copied).
    * ``fail_pool``: a failing batch raises on that pool's first copy instead
      (it must be in the batch, else the batch succeeds).
    * ``delay_s``: sleep this long in the worker before each batch.
    * ``hold``: a `threading.Event`; when set on the executor, each batch waits
      in the worker until the test sets it (for in-flight cancellation tests).
    """

    def __init__(
        self,
        *,
        fail_batches: Collection[int] = (),
        fail_at_layer: int = 0,
        fail_pool: str | None = None,
        delay_s: float = 0.0,
        hold: threading.Event | None = None,
    ) -> None:
        self.fail_batches = set(fail_batches)
        self.fail_at_layer = fail_at_layer
        self.fail_pool = fail_pool
        self.delay_s = delay_s
        self.hold = hold
        self.batches_seen = 0
        self.faults_injected = 0
        # (direction, operation ids) of every batch, in the order received.
        self.history: list[tuple[str, tuple[int, ...]]] = []
        self.started = threading.Event()  # set when a batch reaches the worker
        self._limiter = anyio.CapacityLimiter(1)

    @property
    def max_in_flight(self) -> int:
        return 1

    async def execute(self, batch: Batch, progress: LayerProgress) -> None:
        number = self.batches_seen
        self.batches_seen += 1
        self.history.append((batch.direction.value, tuple(op.id for op in batch.operations)))
        fail = number in self.fail_batches
        await anyio.to_thread.run_sync(self._run, batch, progress, fail, limiter=self._limiter)

    def _run(self, batch: Batch, progress: LayerProgress, fail: bool) -> None:
        self.started.set()
        if self.hold is not None:
            self.hold.wait()
        if self.delay_s:
            time.sleep(self.delay_s)
        plan = batch.plan()
        backup = plan.direction.value == "backup"
        for layer in range(plan.num_layers):
            if fail and self.fail_pool is None and layer == self.fail_at_layer:
                self.faults_injected += 1
                raise InjectedFault(f"injected fault at layer {layer}")
            for c in plan.copies:
                if fail and c.name == self.fail_pool:
                    self.faults_injected += 1
                    raise InjectedFault(f"injected fault in pool {c.name!r} at layer {layer}")
                j = c.device.pool_layer(layer)
                if j is None:
                    continue
                for p in range(len(c.device.planes)):
                    host, dev = c.host.layer_view(j, p), c.device.tensor(j, p)
                    src, dst = (dev, host) if backup else (host, dev)
                    apply_copy_plan(c.plan, src, dst)
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
    seed: int = 0,
) -> PoolGroup:
    """Every pool kind:

    * ``kv``: full attention (K, V) on every layer;
    * ``swa``: sliding window (K, V) on even layers;
    * ``c4``: compressed KV, sidecar of ``kv``, ``page_size // 4`` rows per page, bf16;
    * ``swa_state``: ring-shaped state, sidecar of ``swa`` with ``ring`` rows per page;
    * ``state``: per-request recurrent state, its own pool of page size 1 (value and int8 scale planes);
    * ``tok``: a logical anchor (no bytes) driving ``idx``, an indexer sidecar of one row per page.
    """
    if page_size % 4:
        raise ValueError(f"hybrid_group needs a page_size divisible by 4; got {page_size}")
    gen = torch.Generator().manual_seed(seed)
    pages = device_slots // page_size
    even = [t // 2 if t % 2 == 0 else None for t in range(layers)]
    group = PoolGroup()
    group.add_pool(
        "kv", device=DevicePool(_random_layers(layers, device_slots, [(2, 8)] * 2, torch.float32, gen)),
        page_size=page_size, host_slots=host_slots, layout=layout,
    )
    group.add_pool(
        "swa",
        device=DevicePool(_random_layers((layers + 1) // 2, device_slots, [(2, 8)] * 2, torch.float32, gen), even),
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
        "state", device=DevicePool(state_layers), page_size=1, host_slots=state_slots * 2, layout=layout,
    )
    group.add_logical_pool("tok", page_size=page_size, host_slots=host_slots, device_slots=device_slots)
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
