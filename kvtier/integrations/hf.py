"""Move a Hugging Face `transformers` cache into kvtier pools and back.

A `transformers` model keeps a sequence's cache in a ``DynamicCache``: one
layer object per decoder layer. This module maps those layers onto kvtier pools,
with transfer layer ``t`` = decoder layer ``t`` in every pool, so that
``await handle.layer_ready(t)`` means decoder layer ``t`` is in place:

* full attention (``DynamicLayer``) -> pool ``kv``: one slot per token, planes
  K and V ``[kv_heads, head_dim]``, pages of ``page_size`` tokens;
* sliding window (``DynamicSlidingWindowLayer``) -> pool ``swa``: the same
  planes, but only the pages that overlap the tokens the layer still holds;
* conv / recurrent state (``LinearAttentionLayer``: Mamba, short conv, linear
  attention) -> pool ``state``: page size 1, one slot per sequence, each conv
  and recurrent state a plane.

A layer that holds attention and state (``LinearAttentionAndFullAttentionLayer``,
as in Falcon-H1) has rows in both pools; a ``DummyLayer`` has none. A
``DynamicIndexedLayer`` (DSA, as in DeepSeek-V3.2) also keeps indexer keys:
they go to ``kv_indexer``, a sidecar of ``kv`` with one row per token
(``rows_per_page = page_size``, so a token's indexer row is its kv slot).
Pool names are the caller's. Cache layers defined in a model's own module
(they carry state of their own) are refused, never moved in part.

DeepSeek V4's layers (``DeepseekV4HCACache`` / ``DeepseekV4CSACache``) have
compressors beside the window; `DeepseekV4CacheBridge` moves them into the
stack of `kvtier.presets.deepseek_v4` instead.

Tested (``tests/test_e2e_hf.py``, ``tests/test_e2e_models.py``,
``tests/test_e2e_v4.py``) with Llama, Gemma-3 text, LFM2, Bamba, Falcon-H1,
DeepSeek-V3.2, Qwen3-Next, GPT-OSS and DeepSeek V4 on transformers 5.15.0
and 5.24.0. Earlier releases keep hybrid models' state in other cache classes
(before 5.5) or behind another ``LinearAttentionLayer`` API (5.5 to 5.13),
which the bridge does not read.

Typical use::

    layout = HFCacheLayout.probe(model, page_size=16)     # shapes read off a real cache
    group = PoolGroup()
    layout.add_pools(group, device_slots={...}, host_slots={...})
    bridge = HFCacheBridge(layout, group)

    seq = bridge.store(cache)                     # device slots from the pools' allocators
    backup = await sched.backup(seq.indices)
    await backup
    bridge.release(seq)                           # the device rows may be reused
    ...
    load = await sched.load(backup.host_indices)  # fresh device slots
    await load
    cache = bridge.restore(seq.moved_to(load.device_indices))

Invariant: `restore` of what `store` wrote gives a cache whose tensors equal the
stored cache's bit for bit (same shapes, dtypes and lengths), so the model
computes the same logits from it. `transformers` is imported lazily: kvtier
imports without it, and only the functions that touch a cache need it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch

from kvtier.errors import ConfigurationError, InvalidIndices
from kvtier.pools import DevicePool, PageAllocator, PlaneSpec, PoolGroup
from kvtier.pools.host import Layout
from kvtier.presets import DeepseekV4Stack
from kvtier.scheduler.admission import give_back_device, take_device_now
from kvtier.transfers import derive_sidecar_indices

__all__ = [
    "DeepseekV4CacheBridge",
    "HFCacheBridge",
    "HFCacheLayout",
    "LayerSpec",
    "SequenceSlots",
    "StateSpec",
    "cache_argument",
]

Attention = Literal["full", "sliding"]


def _cache_utils() -> ModuleType:
    try:
        from transformers import cache_utils
    except ImportError as exc:  # pragma: no cover - exercised without transformers
        raise ImportError(
            "kvtier.integrations.hf needs `transformers`; install it with `pip install 'kvtier[hf]'`"
        ) from exc
    return cache_utils


def cache_argument(model: Any) -> str:
    """The name of the keyword that ``model.forward`` takes the cache by:
    ``"cache"`` (transformers 5) or ``"past_key_values"`` (older releases)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One conv or recurrent state of a layer: a plane of the state pool."""

    kind: Literal["conv", "recurrent"]
    state_idx: int
    plane: PlaneSpec


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What one decoder layer's cache holds, per sequence."""

    index: int
    cache_class: str
    attention: Attention | None = None
    kv_planes: tuple[PlaneSpec, PlaneSpec] | None = None  # K and V, per token
    sliding_window: int | None = None
    states: tuple[StateSpec, ...] = ()
    indexer_plane: PlaneSpec | None = None  # DSA indexer keys, per token (DynamicIndexedLayer)


@dataclass(frozen=True, slots=True)
class SequenceSlots:
    """Where one sequence's cache lies, and what `restore` needs besides the rows.

    ``indices`` maps each pool to whole pages of slots. The ``kv`` rows hold
    positions ``0 .. num_tokens-1`` in order; the ``swa`` rows start at the page
    of position ``num_tokens - window_tokens`` and hold the last
    ``window_tokens`` positions in order; ``state`` is one slot. The slots of a
    partial last page hold nothing that `restore` reads.
    """

    num_tokens: int
    window_tokens: int
    indices: Mapping[str, torch.Tensor]

    def moved_to(self, indices: Mapping[str, torch.Tensor]) -> SequenceSlots:
        """The same sequence at other slots (e.g. a load's ``device_indices``,
        or a backup's ``host_indices``). Pools other than this sequence's are ignored."""
        missing = sorted(set(self.indices) - set(indices))
        if missing:
            raise InvalidIndices(
                f"the sequence has rows in pools {sorted(self.indices)}; no indices given for {missing}",
                pool=missing[0], rule="every-pool",
            )
        for name, idx in self.indices.items():
            if indices[name].numel() != idx.numel():
                raise InvalidIndices(
                    f"pool {name!r} holds {idx.numel()} slots of this sequence; got {indices[name].numel()}",
                    pool=name, rule="equal-lengths",
                )
        return SequenceSlots(self.num_tokens, self.window_tokens, {n: indices[n] for n in self.indices})


class HFCacheLayout:
    """Which pools a model's cache needs, with the planes and layer map of each.

    Build it from a filled cache (`from_cache`) or a model (`probe`). Raises
    `ConfigurationError` when the layers of one pool disagree on their planes
    (a `DevicePool` needs the same planes on every layer) or when a layer is of
    a kind the bridge cannot move (static, quantized or indexed layers).
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec],
        *,
        page_size: int,
        config: Any = None,
        kv_pool: str = "kv",
        swa_pool: str = "swa",
        state_pool: str = "state",
        indexer_pool: str = "kv_indexer",
    ) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ConfigurationError(f"page_size must be a positive int; got {page_size!r}")
        if len({kv_pool, swa_pool, state_pool, indexer_pool}) != 4:
            raise ConfigurationError(
                f"pool names must differ; got kv={kv_pool!r}, swa={swa_pool!r}, state={state_pool!r}, "
                f"indexer={indexer_pool!r}"
            )
        self.layers = tuple(layers)
        if not self.layers:
            raise ConfigurationError("the cache has no layers")
        self.page_size = page_size
        self.config = config
        self.kv_pool, self.swa_pool, self.state_pool = kv_pool, swa_pool, state_pool
        self._members: dict[str, list[LayerSpec]] = {kv_pool: [], swa_pool: [], state_pool: []}
        for spec in self.layers:
            if spec.attention is not None and spec.kv_planes is None:
                raise ConfigurationError(f"layer {spec.index} has {spec.attention} attention but no K/V planes")
            if spec.attention == "sliding" and (spec.sliding_window is None or spec.sliding_window < 2):
                raise ConfigurationError(
                    f"layer {spec.index} is a sliding-window layer; its window must be an int >= 2, "
                    f"got {spec.sliding_window!r}"
                )
            if spec.attention == "full":
                self._members[kv_pool].append(spec)
            elif spec.attention == "sliding":
                self._members[swa_pool].append(spec)
            if spec.states:
                self._members[state_pool].append(spec)
        self._planes: dict[str, tuple[PlaneSpec, ...]] = {}
        for pool, members in self._members.items():
            if not members:
                continue
            first = members[0]
            for spec in members[1:]:
                if _pool_planes(spec, pool == state_pool) != _pool_planes(first, pool == state_pool):
                    raise ConfigurationError(
                        f"pool {pool!r}: layer {spec.index} holds {_describe(spec, pool == state_pool)} per "
                        f"{'sequence' if pool == state_pool else 'token'}, layer {first.index} holds "
                        f"{_describe(first, pool == state_pool)}; a pool needs the same planes on every layer"
                    )
            self._planes[pool] = _pool_planes(first, pool == state_pool)
        windows = {spec.sliding_window for spec in self._members[swa_pool] if spec.sliding_window is not None}
        if len(windows) > 1:
            raise ConfigurationError(
                f"pool {swa_pool!r}: sliding layers have windows {sorted(windows)}; one pool needs one window"
            )
        self.sliding_window: int | None = windows.pop() if windows else None
        # DSA indexer keys: a sidecar of the kv pool with one row per token
        # (rows_per_page = page_size), so a token's indexer row is its kv slot.
        self.indexer_pool = indexer_pool
        indexed = [spec for spec in self.layers if spec.indexer_plane is not None]
        for spec in indexed:
            if spec.attention != "full":
                raise ConfigurationError(
                    f"layer {spec.index} has indexer keys beside {spec.attention} attention; the bridge moves "
                    "them beside full attention only"
                )
            if spec.indexer_plane != indexed[0].indexer_plane:
                raise ConfigurationError(
                    f"pool {indexer_pool!r}: layer {spec.index} holds indexer keys {spec.indexer_plane}, layer "
                    f"{indexed[0].index} holds {indexed[0].indexer_plane}; a pool needs the same planes on every layer"
                )
        self._members[indexer_pool] = indexed
        if indexed and indexed[0].indexer_plane is not None:
            self._planes[indexer_pool] = (indexed[0].indexer_plane,)

    # -- construction ----------------------------------------------------------

    @classmethod
    def from_cache(cls, cache: Any, *, page_size: int, config: Any = None, **pool_names: str) -> HFCacheLayout:
        """Read the layout off a cache that has seen at least one token.

        ``config`` (the model's config) lets `new_cache` build empty caches.
        """
        cu = _cache_utils()
        unsupported = _classes(cu, "BaseQuantizedLayer")
        indexed = _classes(cu, "DynamicIndexedLayer")
        dummy = _classes(cu, "DummyLayer")
        linear = _classes(cu, "LinearAttentionCacheLayerMixin")
        specs = []
        for t, layer in enumerate(cache.layers):
            name = type(layer).__name__
            attention: Attention | None = None
            kv_planes = None
            window = None
            indexer_plane = None
            states: list[StateSpec] = []
            if isinstance(layer, dummy):
                specs.append(LayerSpec(t, name))
                continue
            if type(layer).__module__ != cu.__name__:
                # A layer class from a modeling file carries state of its own
                # (e.g. DeepSeek V4's compressors) that these pools would drop.
                hint = "; use DeepseekV4CacheBridge" if name.startswith("DeepseekV4") else ""
                raise ConfigurationError(
                    f"layer {t} is a {name} from {type(layer).__module__}, a cache layer with state of its own "
                    f"that HFCacheBridge does not move{hint}"
                )
            if isinstance(layer, cu.CacheLayerMixin):
                if not isinstance(layer, cu.DynamicLayer) or isinstance(layer, unsupported):
                    raise ConfigurationError(
                        f"layer {t} is a {name}; the bridge moves DynamicCache layers (full, sliding, "
                        "indexed, linear-attention), not static or quantized ones"
                    )
                if not layer.is_initialized or layer.keys is None or layer.keys.dim() != 4:
                    raise ConfigurationError(
                        f"layer {t} ({name}) holds no keys yet; run the model on at least one token first"
                    )
                if getattr(layer, "record_past", False):
                    raise ConfigurationError(f"layer {t} ({name}) records past states; the bridge needs it off")
                k, v = layer.keys, layer.values
                kv_planes = (PlaneSpec((k.shape[1], k.shape[3]), k.dtype), PlaneSpec((v.shape[1], v.shape[3]), v.dtype))
                if getattr(layer, "is_sliding", False):
                    attention, window = "sliding", int(layer.sliding_window)
                else:
                    attention = "full"
                if isinstance(layer, indexed):
                    x = layer.indexer_keys
                    if not layer.is_indexer_initialized or x is None or x.dim() != 3:
                        raise ConfigurationError(f"layer {t} ({name}) holds no indexer keys yet; run the model first")
                    if getattr(layer, "indexer_position_ids", None) is not None:
                        raise ConfigurationError(
                            f"layer {t} ({name}) keeps indexer position ids, which the bridge does not move"
                        )
                    indexer_plane = PlaneSpec((x.shape[-1],), x.dtype)
            if isinstance(layer, linear):
                if getattr(layer, "record_past", False):
                    raise ConfigurationError(f"layer {t} ({name}) records past states; the bridge needs it off")
                for i in range(layer.number_of_states):
                    if layer.is_conv_states_initialized[i]:
                        x = layer.conv_states[i]
                        states.append(StateSpec("conv", i, PlaneSpec(tuple(x.shape[1:]), x.dtype)))
                    if layer.is_recurrent_states_initialized[i]:
                        x = layer.recurrent_states[i]
                        states.append(StateSpec("recurrent", i, PlaneSpec(tuple(x.shape[1:]), x.dtype)))
                if not states:
                    raise ConfigurationError(
                        f"layer {t} ({name}) holds no state yet; run the model on at least one token first"
                    )
            if attention is None and not states:
                raise ConfigurationError(f"layer {t} is a {name}, a cache layer the bridge does not know")
            specs.append(LayerSpec(t, name, attention, kv_planes, window, tuple(states), indexer_plane))
        return cls(specs, page_size=page_size, config=config, **pool_names)

    @classmethod
    def probe(cls, model: Any, *, page_size: int, tokens: int = 2, **pool_names: str) -> HFCacheLayout:
        """Run ``model`` once on ``tokens`` dummy tokens and read the layout off its cache."""
        cu = _cache_utils()
        cache = cu.DynamicCache(config=model.config)
        ids = torch.zeros((1, tokens), dtype=torch.long, device=model.device)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{cache_argument(model): cache})
        return cls.from_cache(cache, page_size=page_size, config=model.config, **pool_names)

    # -- what the pools look like ---------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def pools(self) -> tuple[str, ...]:
        """The pools this model uses, in the order kv, swa, state."""
        return tuple(p for p in (self.kv_pool, self.swa_pool, self.state_pool) if self._members[p])

    @property
    def sidecars(self) -> tuple[str, ...]:
        """Sidecar pools of this model: the indexer keys' (of the kv pool), if any layer has them."""
        return (self.indexer_pool,) if self._members[self.indexer_pool] else ()

    def planes(self, pool: str) -> tuple[PlaneSpec, ...]:
        """Per-slot planes of ``pool``: K, V for attention pools; the states for the state pool."""
        return self._planes[self._known(pool)]

    def layer_map(self, pool: str) -> list[int | None]:
        """Transfer layer (= decoder layer) -> layer of ``pool``, or None."""
        members = {spec.index: j for j, spec in enumerate(self._members[self._known(pool)])}
        return [members.get(t) for t in range(self.num_layers)]

    def pool_page_size(self, pool: str) -> int:
        return 1 if self._known(pool) == self.state_pool else self.page_size

    def slots_needed(self, num_tokens: int, window_tokens: int | None = None) -> dict[str, int]:
        """Slots per pool for one sequence of ``num_tokens`` tokens whose sliding
        layers hold the last ``window_tokens`` (by default what transformers keeps:
        ``min(num_tokens, sliding_window - 1)``)."""
        ps = self.page_size
        out: dict[str, int] = {}
        if self._members[self.kv_pool]:
            out[self.kv_pool] = -(-num_tokens // ps) * ps
        if self._members[self.swa_pool]:
            assert self.sliding_window is not None
            held = min(num_tokens, self.sliding_window - 1) if window_tokens is None else window_tokens
            first, last = (num_tokens - held) // ps, (num_tokens - 1) // ps
            out[self.swa_pool] = (last - first + 1) * ps
        if self._members[self.state_pool]:
            out[self.state_pool] = 1
        return out

    def add_pools(
        self,
        group: PoolGroup,
        *,
        device_slots: Mapping[str, int],
        host_slots: Mapping[str, int],
        layout: Layout = "layer_first",
        device: torch.device | str | None = None,
        pin_memory: bool | None = None,
    ) -> dict[str, DevicePool]:
        """Allocate zeroed device tensors for every pool this model uses, with a
        `PageAllocator` each, and register them in ``group``.

        An engine that has its own cache tensors builds its `DevicePool`\\ s from
        `planes` and `layer_map` instead. Raises `ConfigurationError` when a pool
        has no entry in ``device_slots`` or ``host_slots``.
        """
        out = {}
        for pool in self.pools:
            for what, sizes in (("device_slots", device_slots), ("host_slots", host_slots)):
                if pool not in sizes:
                    raise ConfigurationError(f"pool {pool!r} needs an entry in {what}; got {sorted(sizes)}")
            slots, ps = device_slots[pool], self.pool_page_size(pool)
            tensors = [
                [torch.zeros((slots, *p.shape), dtype=p.dtype, device=device) for p in self.planes(pool)]
                for _ in self._members[pool]
            ]
            dev = DevicePool(tensors, self.layer_map(pool), PageAllocator(slots, ps, name=pool))
            group.add_pool(
                pool, device=dev, page_size=ps, host_slots=host_slots[pool], layout=layout, pin_memory=pin_memory,
            )
            out[pool] = dev
        for side in self.sidecars:
            rows = device_slots[self.kv_pool]
            tensors = [[torch.zeros((rows, *p.shape), dtype=p.dtype, device=device) for p in self.planes(side)]
                       for _ in self._members[side]]
            dev = DevicePool(tensors, self.layer_map(side))
            group.add_sidecar(side, source=self.kv_pool, rows_per_page=self.page_size, device=dev, layout=layout,
                              pin_memory=pin_memory)
            out[side] = dev
        return out

    def new_cache(self) -> Any:
        """An empty ``DynamicCache`` for this model (needs the ``config``)."""
        if self.config is None:
            raise ConfigurationError(
                "this layout has no model config; pass cache= to restore, or build the layout with config="
            )
        return _cache_utils().DynamicCache(config=self.config)

    def _known(self, pool: str) -> str:
        if pool not in self._members:
            raise ConfigurationError(f"unknown pool {pool!r}; this layout has {list(self._members)}")
        return pool

    def __repr__(self) -> str:
        parts = [
            f"{p}: {len(self._members[p])} layers, page_size={self.pool_page_size(p)}" for p in self.pools
        ]
        window = f", window={self.sliding_window}" if self.sliding_window else ""
        return f"<HFCacheLayout [{self.num_layers} layers | {'; '.join(parts)}{window}]>"


class HFCacheBridge:
    """Copies sequences between transformers caches and a `PoolGroup`'s device rows.

    The group must hold this layout's pools with matching planes and layer maps
    (as `HFCacheLayout.add_pools` registers them); raises `ConfigurationError`
    otherwise. The bridge never touches host pools: moving rows between tiers
    is the scheduler's job.
    """

    def __init__(self, layout: HFCacheLayout, group: PoolGroup) -> None:
        for pool in layout.pools:
            if pool not in group:
                raise ConfigurationError(f"pool {pool!r} is not in the group; register it first (add_pools)")
            spec = group[pool]
            dev = spec.device
            if dev is None or spec.sidecar is not None:
                raise ConfigurationError(f"pool {pool!r} must be a pool with device tensors, not a {spec.kind}")
            if dev.planes != layout.planes(pool):
                raise ConfigurationError(
                    f"pool {pool!r} has planes {dev.planes}; the cache needs {layout.planes(pool)}"
                )
            want = layout.layer_map(pool)
            have = [dev.pool_layer(t) for t in range(layout.num_layers)]
            if have != want:
                raise ConfigurationError(f"pool {pool!r} has layer map {have}; the cache needs {want}")
            if spec.page_size != layout.pool_page_size(pool):
                raise ConfigurationError(
                    f"pool {pool!r} has page_size {spec.page_size}; the layout needs {layout.pool_page_size(pool)}"
                )
        for side in layout.sidecars:
            side_spec = group[side] if side in group else None
            if side_spec is None or side_spec.sidecar is None or side_spec.sidecar.source != layout.kv_pool \
                    or side_spec.sidecar.rows_per_page != layout.page_size:
                raise ConfigurationError(
                    f"pool {side!r} must be a sidecar of {layout.kv_pool!r} with {layout.page_size} rows per page "
                    "(one per token); register it with add_pools"
                )
            assert side_spec.device is not None
            if side_spec.device.planes != layout.planes(side):
                raise ConfigurationError(
                    f"pool {side!r} has planes {side_spec.device.planes}; the cache needs {layout.planes(side)}"
                )
            have = [side_spec.device.pool_layer(t) for t in range(layout.num_layers)]
            if have != layout.layer_map(side):
                raise ConfigurationError(f"pool {side!r} has layer map {have}; the cache needs {layout.layer_map(side)}")
        self.layout = layout
        self.group = group

    # -- cache -> device rows ------------------------------------------------

    def store(
        self,
        cache: Any,
        *,
        batch_index: int = 0,
        device_indices: Mapping[str, torch.Tensor] | None = None,
    ) -> SequenceSlots:
        """Write sequence ``batch_index`` of ``cache`` into device rows.

        Slots come from ``device_indices`` (whole pages, as many as
        `HFCacheLayout.slots_needed` says) or, for pools left out of it, from
        the pools' device allocators, all or nothing: a short pool frees what was
        taken and raises `PoolExhausted`. Raises `ConfigurationError` when the
        cache does not match the layout. The cache is not changed.
        """
        layout = self.layout
        num_tokens, window_tokens = self._lengths(cache)
        needed = layout.slots_needed(num_tokens, window_tokens)
        given = dict(device_indices or {})
        for name, idx in given.items():
            if name not in needed or idx.numel() != needed[name]:
                raise InvalidIndices(
                    f"pool {name!r} needs {needed.get(name, 0)} device slots for {num_tokens} tokens; "
                    f"got {idx.numel()}",
                    pool=name, rule="slots-needed",
                )
        # Device slots through the scheduler's admission rules: sorted pools, all
        # or nothing, the engine allocator's answer checked.
        pages = take_device_now(self.group, {n: s for n, s in needed.items() if n not in given})
        taken = {name: p.slots() for name, p in pages.items()}
        seq = SequenceSlots(num_tokens, window_tokens, given | taken)
        try:
            with torch.no_grad():
                for spec in layout.layers:
                    self._store_layer(cache.layers[spec.index], spec, seq, batch_index)
        except BaseException:
            give_back_device(self.group, pages)
            raise
        return seq

    def _lengths(self, cache: Any) -> tuple[int, int]:
        layout = self.layout
        if len(cache.layers) != layout.num_layers:
            raise ConfigurationError(f"the cache has {len(cache.layers)} layers; the layout has {layout.num_layers}")
        full, cumulative, held = set(), set(), set()
        for spec in layout.layers:
            layer = cache.layers[spec.index]
            if type(layer).__name__ != spec.cache_class:
                raise ConfigurationError(
                    f"layer {spec.index} is a {type(layer).__name__}; the layout expects a {spec.cache_class}"
                )
            if spec.attention is not None and (not layer.is_initialized or layer.keys is None):
                raise ConfigurationError(f"layer {spec.index} holds no keys; store a cache that saw tokens")
            for st in spec.states:
                ready = layer.is_conv_states_initialized if st.kind == "conv" else layer.is_recurrent_states_initialized
                if not ready[st.state_idx]:
                    raise ConfigurationError(
                        f"layer {spec.index} holds no {st.kind} state {st.state_idx}; store a cache that saw tokens"
                    )
            if spec.indexer_plane is not None and (
                layer.indexer_keys is None or layer.indexer_keys.shape[1] != layer.keys.shape[-2]
            ):
                raise ConfigurationError(
                    f"layer {spec.index} holds indexer keys for "
                    f"{'no' if layer.indexer_keys is None else layer.indexer_keys.shape[1]} tokens and K/V for "
                    f"{layer.keys.shape[-2]}; store a cache after a whole forward pass"
                )
            if spec.attention == "full":
                full.add(layer.keys.shape[-2])
            elif spec.attention == "sliding":
                cumulative.add(int(layer.cumulative_length))
                held.add(layer.keys.shape[-2])
        lengths = full | cumulative
        if len(lengths) > 1 or len(held) > 1:
            raise ConfigurationError(
                f"the cache's layers disagree on their length (tokens seen {sorted(lengths)}, "
                f"window held {sorted(held)}); store a cache after a whole forward pass"
            )
        num_tokens = lengths.pop() if lengths else 0
        window_tokens = held.pop() if held else 0
        if (full or cumulative) and num_tokens < 1:
            raise ConfigurationError("the cache holds no tokens; there is nothing to store")
        return num_tokens, window_tokens

    def _store_layer(self, layer: Any, spec: LayerSpec, seq: SequenceSlots, b: int) -> None:
        layout = self.layout
        if spec.attention is not None:
            pool = layout.kv_pool if spec.attention == "full" else layout.swa_pool
            dev, j = self._device(pool, spec.index)
            rows = self._token_rows(pool, seq)
            # [batch, heads, tokens, dim] -> rows [tokens, heads, dim]
            dev.tensor(j, 0)[rows] = layer.keys[b].transpose(0, 1)
            dev.tensor(j, 1)[rows] = layer.values[b].transpose(0, 1)
            if spec.indexer_plane is not None:
                # One sidecar row per token: the rows are the kv slots themselves.
                side, i = self._device(layout.indexer_pool, spec.index)
                side.tensor(i, 0)[rows] = layer.indexer_keys[b]
        if spec.states:
            dev, j = self._device(layout.state_pool, spec.index)
            slot = seq.indices[layout.state_pool][0]
            for p, st in enumerate(spec.states):
                src = layer.conv_states if st.kind == "conv" else layer.recurrent_states
                dev.tensor(j, p)[slot] = src[st.state_idx][b]

    # -- device rows -> cache ------------------------------------------------

    def restore(self, seq: SequenceSlots, cache: Any = None) -> Any:
        """Rebuild the sequence from its device rows into ``cache`` (an empty
        cache of this model; by default `HFCacheLayout.new_cache`) and return it.

        The cache owns fresh tensors: the device rows may be released afterwards.
        """
        cache = self.layout.new_cache() if cache is None else cache
        for t in range(self.layout.num_layers):
            self.restore_layer(cache, seq, t)
        return cache

    def restore_layer(self, cache: Any, seq: SequenceSlots, layer: int) -> None:
        """Rebuild decoder layer ``layer`` only, e.g. right after
        ``await load.layer_ready(layer)``, while later layers still load."""
        layout = self.layout
        if not 0 <= layer < layout.num_layers or len(cache.layers) != layout.num_layers:
            raise ConfigurationError(
                f"layer {layer} of a cache with {len(cache.layers)} layers; the layout has {layout.num_layers}"
            )
        spec = layout.layers[layer]
        target = cache.layers[layer]
        if type(target).__name__ != spec.cache_class:
            raise ConfigurationError(
                f"layer {layer} is a {type(target).__name__}; the layout expects a {spec.cache_class}"
            )
        if spec.attention is not None and target.is_initialized:
            raise ConfigurationError(f"layer {layer} already holds keys; restore into an empty cache")
        # States first, as a forward pass makes them: the first state a layer
        # takes sets its dtype and device (and moves its token counter there).
        if spec.states:
            dev, j = self._device(layout.state_pool, layer)
            slot = seq.indices[layout.state_pool][0]
            for p, st in enumerate(spec.states):
                x = dev.tensor(j, p)[slot].unsqueeze(0)
                i = st.state_idx
                if st.kind == "conv":
                    target.lazy_initialization(conv_states=x, state_idx=i, conv_kernel_size=x.shape[-1])
                    target.conv_states[i].copy_(x)
                else:
                    target.lazy_initialization(recurrent_states=x, state_idx=i)
                    target.recurrent_states[i].copy_(x)
                target.has_previous_state[i] = True
        if spec.attention is not None:
            pool = layout.kv_pool if spec.attention == "full" else layout.swa_pool
            dev, j = self._device(pool, layer)
            rows = self._token_rows(pool, seq)
            # rows [tokens, heads, dim] -> [1, heads, tokens, dim], contiguous like torch.cat's result
            keys = dev.tensor(j, 0)[rows].transpose(0, 1).unsqueeze(0).contiguous()
            values = dev.tensor(j, 1)[rows].transpose(0, 1).unsqueeze(0).contiguous()
            target.lazy_initialization(keys, values)
            target.keys, target.values = keys, values
            if spec.indexer_plane is not None:
                side, i = self._device(layout.indexer_pool, layer)
                x = side.tensor(i, 0)[rows].unsqueeze(0).contiguous()
                target.lazy_initialization_indexer(x)
                target.indexer_keys = x
        _restore_token_counts(target, seq.num_tokens)
        _check_restored_length(target, layer, seq.num_tokens)

    # -- slots -----------------------------------------------------------------

    def rows(self, seq: SequenceSlots) -> dict[str, torch.Tensor]:
        """Every device row ``seq`` occupies, per pool, its sidecars' rows included (e.g. to wipe them)."""
        out = dict(seq.indices)
        for side in self.layout.sidecars:
            if self.layout.kv_pool in seq.indices:
                out[side] = seq.indices[self.layout.kv_pool]  # one row per kv slot
        return out

    def release(self, seq: SequenceSlots) -> None:
        """Give the sequence's device slots back to the pools' device allocators
        (pools without one are left alone: their slots are the engine's)."""
        for name, idx in seq.indices.items():
            alloc = self.group[name].device_allocator
            if alloc is not None:
                alloc.free(idx)

    def _device(self, pool: str, layer: int) -> tuple[DevicePool, int]:
        return _device_layer(self.group, pool, layer)

    def _token_rows(self, pool: str, seq: SequenceSlots) -> torch.Tensor:
        """The slots of a sequence's tokens in an attention pool, in position order."""
        idx = seq.indices[pool]
        if pool == self.layout.kv_pool:
            return idx[: seq.num_tokens]
        start = (seq.num_tokens - seq.window_tokens) % self.layout.page_size
        return idx[start : start + seq.window_tokens]

    def __repr__(self) -> str:
        return f"<HFCacheBridge {self.layout!r}>"


# A cache layer's counts of the tokens it has seen, where it keeps one: an int
# or a 0-d tensor. ``cumulative_length``: sliding-window layers (they hold only
# the window) and DeepSeek V4's; ``cumulative_length_linear``: linear-attention
# layers from transformers 5.25 on. `get_seq_length` returns them, and models
# take their positions from it.
_TOKEN_COUNTS = ("cumulative_length", "cumulative_length_linear")


def _restore_token_counts(target: Any, num_tokens: int) -> None:
    """Set every count of tokens seen that ``target`` keeps to ``num_tokens``
    (after its states and keys: their first one moves a counter to its device).
    A tensor is filled in place, so it keeps its device and static address."""
    for name in _TOKEN_COUNTS:
        count = getattr(target, name, None)
        if isinstance(count, torch.Tensor):
            count.fill_(num_tokens)
        elif count is not None:
            setattr(target, name, num_tokens)


def _check_restored_length(target: Any, layer: int, num_tokens: int) -> None:
    """A restored layer reports the sequence's length, where it reports one
    that can be read without waiting for a device: else the model would take
    wrong positions from it, silently (a counter this bridge does not know,
    from a newer transformers)."""
    length = getattr(target, "get_seq_length", None)
    if length is None:
        return
    n = length()
    if isinstance(n, torch.Tensor):
        if n.device.type != "cpu":
            return  # reading it would wait for the device
        n = int(n)
    if n != num_tokens:
        raise ConfigurationError(
            f"layer {layer} ({type(target).__name__}) reports {n} tokens after its restore, the sequence has "
            f"{num_tokens}: this transformers keeps a count kvtier's bridge does not restore; see "
            "docs/compatibility.md for the versions kvtier was tested with"
        )


def _classes(module: ModuleType, *names: str) -> tuple[Any, ...]:
    """The classes of ``module`` among ``names`` that this transformers release has."""
    return tuple(c for c in (getattr(module, n, None) for n in names) if isinstance(c, type))


def _pool_planes(spec: LayerSpec, state: bool) -> tuple[PlaneSpec, ...]:
    if state:
        return tuple(st.plane for st in spec.states)
    assert spec.kv_planes is not None
    return spec.kv_planes


def _describe(spec: LayerSpec, state: bool) -> str:
    if state:
        return ", ".join(f"{st.kind}[{st.state_idx}] {st.plane.shape} {st.plane.dtype}" for st in spec.states)
    assert spec.kv_planes is not None
    k, v = spec.kv_planes
    return f"K {k.shape} {k.dtype}, V {v.shape} {v.dtype}"


# -- DeepSeek V4 ---------------------------------------------------------------

_V4_CLASSES = {
    "sliding_attention": "DynamicSlidingWindowLayer",
    "compressed_sparse_attention": "DeepseekV4CSACache",
    "heavily_compressed_attention": "DeepseekV4HCACache",
}
_COMPRESSORS = ("compressor", "indexer")
_GATE_DTYPE = (
    ": V4 keeps position_bias in float32 (transformers' _keep_in_fp32_modules_strict), so the overlap gates "
    "(gate + position_bias) are float32 whatever the model's dtype, and the stack plans them so; this cache's are "
    "{got}, so position_bias was cast, as model.to({got}) does. Load the model in that dtype instead "
    "(from_pretrained(..., dtype=...) or _from_config(config, dtype=...) keep position_bias float32), or cast "
    "position_bias back to float32 after .to()"
)


class DeepseekV4CacheBridge:
    """Copies sequences between transformers DeepSeek V4 caches and the V4
    stack's device rows (`kvtier.presets.deepseek_v4`).

    What moves, for a sequence of N tokens (every int follows from N):

    * the anchor's pages (``ceil(N / page_size)`` of them) and, through them,
      the compressed entries ``0 .. N//rate - 1`` of every CSA compressor,
      CSA indexer and HCA compressor: entry ``e`` lands in sidecar row
      ``page(e // k) * k + e % k``, the rule kvtier's sidecars use;
    * the window (the last ``min(N, sliding_window - 1)`` tokens' K, which is
      V) in order from row 0 of the window pool's pages;
    * the CSA buffers (``N % r4`` rows, one per token, compressor and indexer
      side by side) in a ``c4_buffer`` page and the overlaps (once an entry
      exists) in one ``c4_state`` slot; the HCA buffer (``N % r128`` rows) one
      row per token in ``c128_buffer`` pages (a buffer that is empty takes none).

    `DeepseekV4Stack.valid_rows` says which of those rows hold data: pass it
    to the backup (``sched.backup(seq.indices, valid_rows=stack.valid_rows(seq.num_tokens))``)
    and the backup, every load of its host pages and every stored page move
    exactly those rows.

    Transfer layer ``t`` is decoder layer ``t`` in every pool, so
    ``await load.layer_ready(t)`` then `restore_layer` (t) rebuilds layer t
    while later layers still land. The group must hold the stack's pools as
    `DeepseekV4Stack.register` registers them; raises `ConfigurationError`
    otherwise. The bridge never touches host pools.
    """

    def __init__(self, stack: DeepseekV4Stack, group: PoolGroup) -> None:
        if not isinstance(stack, DeepseekV4Stack):
            raise ConfigurationError(f"the bridge needs a DeepseekV4Stack (kvtier.presets.deepseek_v4_stack); got {stack!r}")
        for plan in stack.plans:
            if plan.name not in group:
                raise ConfigurationError(f"pool {plan.name!r} is not in the group; register the stack first")
            spec = group[plan.name]
            if spec.kind != plan.kind or spec.page_size != plan.page_size:
                raise ConfigurationError(
                    f"pool {plan.name!r} is a {spec.kind} with page size {spec.page_size}; the stack plans a "
                    f"{plan.kind} with {plan.page_size}"
                )
            if plan.kind != "logical":
                dev = spec.device
                assert dev is not None
                if dev.planes != plan.planes:
                    raise ConfigurationError(f"pool {plan.name!r} has planes {dev.planes}; the stack plans {plan.planes}")
                have = [dev.pool_layer(t) for t in range(len(plan.layer_map))]
                if have != list(plan.layer_map):
                    raise ConfigurationError(
                        f"pool {plan.name!r} has layer map {have}; the stack plans {list(plan.layer_map)}"
                    )
            if plan.source is not None and (spec.sidecar is None or spec.sidecar.source != plan.source):
                raise ConfigurationError(f"pool {plan.name!r} must be a sidecar of {plan.source!r}")
        self.stack = stack
        self.group = group

    @property
    def num_layers(self) -> int:
        return len(self.stack.layer_types)

    # -- cache -> device rows ------------------------------------------------

    def store(self, cache: Any, *, batch_index: int = 0) -> SequenceSlots:
        """Write sequence ``batch_index`` of ``cache`` into device rows, slots
        from the pools' device allocators (all or nothing: `PoolExhausted`,
        nothing kept). Raises `ConfigurationError` when the cache is not this
        model's or was not left by a whole forward pass. The cache is not changed."""
        num_tokens = self._check(cache, batch_index)
        stack = self.stack
        pages = take_device_now(self.group, stack.slots_needed(num_tokens))
        seq = SequenceSlots(num_tokens, stack.lengths(num_tokens).window_tokens,
                            {name: p.slots() for name, p in pages.items()})
        try:
            with torch.no_grad():
                for t in range(self.num_layers):
                    self._store_layer(cache.layers[t], t, seq, batch_index)
        except BaseException:
            give_back_device(self.group, pages)
            raise
        return seq

    def _check(self, cache: Any, b: int) -> int:
        stack = self.stack
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != self.num_layers:
            raise ConfigurationError(
                f"the cache has {len(layers) if layers is not None else 'no'} layers; the V4 stack has {self.num_layers}"
            )
        seen: set[int] = set()
        for t in range(self.num_layers):
            layer = layers[t]
            self._check_layer_config(layer, t)
            if not layer.is_initialized or layer.keys is None:
                raise ConfigurationError(f"layer {t} holds no keys; store a cache that saw tokens")
            if getattr(layer, "record_past", False):
                raise ConfigurationError(f"layer {t} records past states; the bridge needs it off")
            seen.add(int(layer.cumulative_length))
        if len(seen) != 1:
            raise ConfigurationError(
                f"the cache's layers disagree on the tokens seen ({sorted(seen)}); store after a whole forward pass"
            )
        n = seen.pop()
        if n < 1:
            raise ConfigurationError("the cache holds no tokens; there is nothing to store")
        if not 0 <= b < layers[0].keys.shape[0]:
            raise ConfigurationError(f"batch_index {b} is outside the cache's batch of {layers[0].keys.shape[0]}")
        ln = stack.lengths(n)
        for t, kind in enumerate(stack.layer_types):
            layer = layers[t]
            keys, values = layer.keys, layer.values
            self._expect(t, "window keys", keys[b, 0] if keys.dim() == 4 else keys,
                         (ln.window_tokens, stack.head_dim), stack.dtype)
            if keys.shape[1] != 1:
                raise ConfigurationError(f"layer {t} holds {keys.shape[1]} KV heads; DeepSeek V4 keeps one")
            if values is not keys and not torch.equal(values, keys):
                raise ConfigurationError(f"layer {t} holds values that differ from its keys; V4 shares K and V")
            if kind == "sliding_attention":
                continue
            csa = kind == "compressed_sparse_attention"
            rate = stack.csa_rate if csa else stack.hca_rate
            for name in _COMPRESSORS if csa else _COMPRESSORS[:1]:
                width = stack.index_head_dim if name == "indexer" else stack.head_dim
                entries, buffered = n // rate, n % rate
                if layer.entry_count[name] != entries:
                    raise ConfigurationError(
                        f"layer {t} {name} has {layer.entry_count[name]} compressed entries; {n} tokens at rate "
                        f"{rate} make {entries}"
                    )
                self._expect(t, f"{name} compressed_kv", layer.compressed_kv[name], (entries, width), stack.dtype, b)
                plane = 2 * width if csa else width
                self._expect(t, f"{name} buffer_kv", layer.buffer_kv[name], (buffered, plane), stack.dtype, b)
                self._expect(t, f"{name} buffer_gate", layer.buffer_gate[name], (buffered, plane), stack.dtype, b)
                if csa:
                    has = layer.overlap_kv[name] is not None
                    if has != (entries >= 1):
                        raise ConfigurationError(
                            f"layer {t} {name} {'has' if has else 'has no'} overlap state with {entries} entries; "
                            "a whole forward pass leaves one exactly when an entry exists"
                        )
                    if has:
                        self._expect(t, f"{name} overlap_kv", layer.overlap_kv[name], (rate, width), stack.dtype, b)
                        gate = torch.promote_types(stack.dtype, torch.float32)
                        self._expect(t, f"{name} overlap_gate", layer.overlap_gate[name], (rate, width), gate, b,
                                     why=_GATE_DTYPE if gate == torch.float32 else "")
        return n

    @staticmethod
    def _expect(t: int, what: str, x: Any, shape: tuple[int, ...], dtype: torch.dtype, b: int | None = None,
                *, why: str = "") -> None:
        if not isinstance(x, torch.Tensor):
            raise ConfigurationError(f"layer {t} has no {what}; store a cache left by a whole forward pass")
        row = x if b is None else x[b]
        if tuple(row.shape) != shape or row.dtype != dtype:
            hint = ""
            if tuple(row.shape) == shape:  # only the dtype differs
                hint = why.format(got=row.dtype) if why else (
                    f"; plan the stack with the model's cache dtype (deepseek_v4(..., dtype={row.dtype}))"
                )
            raise ConfigurationError(
                f"layer {t} {what} is {tuple(row.shape)} {row.dtype} per sequence; the stack expects {shape} {dtype}"
                + hint
            )

    def _check_layer_config(self, layer: Any, t: int) -> None:
        """Layer ``t`` of a cache was made for this stack's model: its class,
        its window and its compress rate (an empty layer knows both)."""
        stack = self.stack
        kind = stack.layer_types[t]
        if type(layer).__name__ != _V4_CLASSES[kind]:
            raise ConfigurationError(
                f"layer {t} is a {type(layer).__name__}; a {kind} layer keeps a {_V4_CLASSES[kind]}"
            )
        want = {"sliding_window": stack.sliding_window}
        if kind != "sliding_attention":
            want["compress_rate"] = stack.csa_rate if kind == "compressed_sparse_attention" else stack.hca_rate
        for attr, value in want.items():
            have = getattr(layer, attr, None)
            if have != value:
                raise ConfigurationError(
                    f"layer {t} ({kind}) is a cache for {attr} {have!r}; this stack's model has {value}: the cache "
                    "belongs to another model (use bridge.new_cache(config) with the config the stack was "
                    "planned from)"
                )

    def _store_layer(self, layer: Any, t: int, seq: SequenceSlots, b: int) -> None:
        stack = self.stack
        ln = stack.lengths(seq.num_tokens)
        dev, j = self._device(stack.pool("window"), t)
        dev.tensor(j, 0)[seq.indices[stack.pool("window")][: ln.window_tokens]] = layer.keys[b, 0]
        kind = stack.layer_types[t]
        if kind == "compressed_sparse_attention":
            for name, role in zip(_COMPRESSORS, ("c4", "c4_indexer")):
                dev, j = self._device(stack.pool(role), t)
                dev.tensor(j, 0)[self._entry_rows(role, seq, ln.c4_entries)] = layer.compressed_kv[name][b]
            for i, name in enumerate(_COMPRESSORS):
                if ln.c4_buffered:
                    dev, j = self._device(stack.pool("c4_buffer"), t)
                    rows = seq.indices[stack.pool("c4_buffer")][: ln.c4_buffered]
                    dev.tensor(j, 2 * i)[rows] = layer.buffer_kv[name][b]
                    dev.tensor(j, 2 * i + 1)[rows] = layer.buffer_gate[name][b]
                if ln.has_overlap:
                    dev, j = self._device(stack.pool("c4_state"), t)
                    slot = seq.indices[stack.pool("c4_state")][0]
                    dev.tensor(j, 2 * i)[slot] = layer.overlap_kv[name][b]
                    dev.tensor(j, 2 * i + 1)[slot] = layer.overlap_gate[name][b]
        elif kind == "heavily_compressed_attention":
            dev, j = self._device(stack.pool("c128"), t)
            dev.tensor(j, 0)[self._entry_rows("c128", seq, ln.c128_entries)] = layer.compressed_kv["compressor"][b]
            if ln.c128_buffered:
                dev, j = self._device(stack.pool("c128_buffer"), t)
                rows = seq.indices[stack.pool("c128_buffer")][: ln.c128_buffered]
                dev.tensor(j, 0)[rows] = layer.buffer_kv["compressor"][b]
                dev.tensor(j, 1)[rows] = layer.buffer_gate["compressor"][b]

    # -- device rows -> cache ------------------------------------------------

    def new_cache(self, config: Any) -> Any:
        """An empty ``DynamicCache`` of the model (V4's layers come from
        ``config``), for `restore` or a first forward pass.

        Raises `ConfigurationError` naming the field when ``config`` is not the
        one the stack was planned from (its layer types, window, compress
        rates or head sizes differ): a cache of another model."""
        stack = self.stack
        want: dict[str, object] = {
            "layer_types": stack.layer_types, "sliding_window": stack.sliding_window, "head_dim": stack.head_dim,
        }
        if stack.index_head_dim:
            want["index_head_dim"] = stack.index_head_dim
        for field, value in want.items():
            have = getattr(config, field, None)
            if (tuple(have) if field == "layer_types" and have is not None else have) != value:
                raise ConfigurationError(
                    f"the config has {field}={have!r}; this stack was planned from {value!r}: a cache of another "
                    "model (give new_cache the config the stack was planned from)"
                )
        rates = dict(getattr(config, "compress_rates", None) or {})
        for kind, rate in (("compressed_sparse_attention", stack.csa_rate),
                           ("heavily_compressed_attention", stack.hca_rate)):
            if kind in stack.layer_types and rates.get(kind) != rate:
                raise ConfigurationError(
                    f"the config has compress_rates[{kind!r}]={rates.get(kind)!r}; this stack was planned from "
                    f"{rate}: a cache of another model (give new_cache the config the stack was planned from)"
                )
        return _cache_utils().DynamicCache(config=config)

    def restore(self, seq: SequenceSlots, cache: Any) -> Any:
        """Rebuild every layer of ``seq`` into the empty ``cache`` (from
        `new_cache`) and return it.

        Everything is checked before the first layer is written: raises
        `ConfigurationError` when ``cache`` is not an empty cache of this
        stack's model (its layer count, classes, ``sliding_window`` and
        compress rates) or ``seq`` holds another window, and `InvalidIndices`
        when ``seq``'s slots do not line up with its token count (as
        `sequence`); then the cache, ``seq`` and every pool are as they were.
        """
        self._check_restore(cache, seq)
        for t in range(self.num_layers):
            self.restore_layer(cache, seq, t)
        return cache

    def _check_restore(self, cache: Any, seq: SequenceSlots) -> None:
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != self.num_layers:
            raise ConfigurationError(
                f"the cache has {len(layers) if layers is not None else 'no'} layers; the V4 stack has {self.num_layers}"
            )
        for t in range(self.num_layers):
            self._check_layer_config(layers[t], t)
            if layers[t].is_initialized:
                raise ConfigurationError(f"layer {t} already holds keys; restore into an empty cache")
        window = self.stack.lengths(seq.num_tokens).window_tokens
        if seq.window_tokens != window:
            raise ConfigurationError(
                f"the sequence keeps a window of {seq.window_tokens} tokens; {seq.num_tokens} tokens in this stack's "
                f"window of {self.stack.sliding_window} keep {window} (a sequence of another model's stack)"
            )
        self.sequence(seq.num_tokens, seq.indices)

    def restore_layer(self, cache: Any, seq: SequenceSlots, layer: int) -> None:
        """Rebuild decoder layer ``layer`` of an empty V4 cache from ``seq``'s
        device rows (fresh tensors: the rows may be released afterwards), e.g.
        right after ``await load.layer_ready(layer)``."""
        stack = self.stack
        if not 0 <= layer < self.num_layers or len(getattr(cache, "layers", ())) != self.num_layers:
            raise ConfigurationError(
                f"layer {layer} of a cache with {len(getattr(cache, 'layers', ()))} layers; the stack has {self.num_layers}"
            )
        kind = stack.layer_types[layer]
        target = cache.layers[layer]
        self._check_layer_config(target, layer)
        if target.is_initialized:
            raise ConfigurationError(f"layer {layer} already holds keys; restore into an empty cache")
        ln = stack.lengths(seq.num_tokens)
        dev, j = self._device(stack.pool("window"), layer)
        keys = dev.tensor(j, 0)[seq.indices[stack.pool("window")][: ln.window_tokens]].unsqueeze(0).unsqueeze(0)
        target.lazy_initialization(keys, keys)
        target.keys = target.values = keys  # one tensor: V4 shares K and V
        _restore_token_counts(target, seq.num_tokens)
        if kind == "compressed_sparse_attention":
            for name, role in zip(_COMPRESSORS, ("c4", "c4_indexer")):
                dev, j = self._device(stack.pool(role), layer)
                target.compressed_kv[name] = dev.tensor(j, 0)[self._entry_rows(role, seq, ln.c4_entries)].unsqueeze(0)
                target.entry_count[name] = ln.c4_entries
            for i, name in enumerate(_COMPRESSORS):
                width = stack.index_head_dim if name == "indexer" else stack.head_dim
                if ln.c4_buffered:
                    dev, j = self._device(stack.pool("c4_buffer"), layer)
                    rows = seq.indices[stack.pool("c4_buffer")][: ln.c4_buffered]
                    target.buffer_kv[name] = dev.tensor(j, 2 * i)[rows].unsqueeze(0)
                    target.buffer_gate[name] = dev.tensor(j, 2 * i + 1)[rows].unsqueeze(0)
                else:
                    target.buffer_kv[name] = keys.new_empty((1, 0, 2 * width))
                    target.buffer_gate[name] = keys.new_empty((1, 0, 2 * width))
                if ln.has_overlap:
                    dev, j = self._device(stack.pool("c4_state"), layer)
                    slot = seq.indices[stack.pool("c4_state")][0]
                    target.overlap_kv[name] = dev.tensor(j, 2 * i)[slot].unsqueeze(0).clone()
                    target.overlap_gate[name] = dev.tensor(j, 2 * i + 1)[slot].unsqueeze(0).clone()
        elif kind == "heavily_compressed_attention":
            dev, j = self._device(stack.pool("c128"), layer)
            rows = self._entry_rows("c128", seq, ln.c128_entries)
            target.compressed_kv["compressor"] = dev.tensor(j, 0)[rows].unsqueeze(0)
            target.entry_count["compressor"] = ln.c128_entries
            width = stack.head_dim
            if ln.c128_buffered:
                dev, j = self._device(stack.pool("c128_buffer"), layer)
                rows = seq.indices[stack.pool("c128_buffer")][: ln.c128_buffered]
                target.buffer_kv["compressor"] = dev.tensor(j, 0)[rows].unsqueeze(0)
                target.buffer_gate["compressor"] = dev.tensor(j, 1)[rows].unsqueeze(0)
            else:
                target.buffer_kv["compressor"] = keys.new_empty((1, 0, width))
                target.buffer_gate["compressor"] = keys.new_empty((1, 0, width))

    # -- slots -----------------------------------------------------------------

    def sequence(
        self, num_tokens: int, indices: Mapping[str, torch.Tensor], *, prefetched: Any = None
    ) -> SequenceSlots:
        """The sequence of ``num_tokens`` tokens at ``indices`` (e.g. a load's
        ``device_indices`` after a prefetch by token ids): the pools and sizes
        `DeepseekV4Stack.slots_needed` says.

        ``prefetched``: the `~kvtier.PrefetchResult` the indices were loaded
        from, if any; then it must be complete and hold, in every pool, the
        pages of exactly this sequence (a result of another length, or one
        cut short, holds a window and state that belong to other tokens).

        Raises `InvalidIndices` (naming the pool and the rule) when a pool is
        missing, an index tensor is not 1-D integer or has another size, a
        slot-owning pool of the stack that this length does not use is given
        (an HCA buffer for a length with none buffered: indices of another
        length), or ``prefetched`` does not line up. Sidecars are ignored
        (their rows follow the anchor's).
        """
        needed = self.stack.slots_needed(num_tokens)
        for name, slots in needed.items():
            got = indices.get(name)
            if got is not None and (
                not isinstance(got, torch.Tensor) or got.dim() != 1
                or got.dtype.is_floating_point or got.dtype.is_complex or got.dtype == torch.bool
            ):
                what = f"{got.dtype} of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
                raise InvalidIndices(
                    f"pool {name!r} indices must be a 1-D integer tensor; got {what}", pool=name, rule="index-tensor",
                )
            if got is None or got.numel() != slots:
                raise InvalidIndices(
                    f"pool {name!r} holds {slots} slots of a {num_tokens}-token sequence; "
                    f"got {'none' if got is None else got.numel()}",
                    pool=name, rule="slots-needed",
                )
        for plan in self.stack.plans:
            if plan.source is None and plan.name in indices and plan.name not in needed:
                raise InvalidIndices(
                    f"pool {plan.name!r} holds nothing of a {num_tokens}-token sequence; got "
                    f"{indices[plan.name].numel()} slots for it (indices of a sequence of another length)",
                    pool=plan.name, rule="slots-needed",
                )
        if prefetched is not None:
            self._check_prefetched(num_tokens, needed, prefetched)
        return SequenceSlots(num_tokens, self.stack.lengths(num_tokens).window_tokens,
                             {name: indices[name] for name in needed})

    def _check_prefetched(self, num_tokens: int, needed: Mapping[str, int], result: Any) -> None:
        pages = dict(getattr(result, "pages", {}))
        if not getattr(result, "complete", False):
            raise InvalidIndices(
                f"a {num_tokens}-token sequence needs a complete prefetch; this one handed back {pages} of "
                f"{dict(getattr(result, 'requested_pages', {}))} pages (a result cut short holds no whole sequence)",
                rule="prefetch-complete",
            )
        for name, slots in needed.items():
            size = self.stack[name].page_size
            if pages.get(name, 0) * size != slots:
                raise InvalidIndices(
                    f"pool {name!r} holds {slots} slots of a {num_tokens}-token sequence; the prefetch handed back "
                    f"{pages.get(name, 0)} pages of {size} slots",
                    pool=name, rule="prefetch-lengths",
                )

    def rows(self, seq: SequenceSlots) -> dict[str, torch.Tensor]:
        """Every device row ``seq`` occupies, per pool with bytes, the sidecar
        rows its anchor pages derive included (e.g. to wipe them)."""
        out = {}
        for plan in self.stack.plans:
            if plan.kind == "pool" and plan.name in seq.indices:
                out[plan.name] = seq.indices[plan.name]
            elif plan.source is not None and plan.source in seq.indices:
                src = self.stack[plan.source]
                out[plan.name] = derive_sidecar_indices(seq.indices[plan.source], src.page_size, plan.page_size)
        return out

    def release(self, seq: SequenceSlots) -> None:
        """Give the sequence's device slots back to the pools' device allocators."""
        for name, idx in seq.indices.items():
            alloc = self.group[name].device_allocator
            if alloc is not None:
                alloc.free(idx)

    def _entry_rows(self, role: str, seq: SequenceSlots, entries: int) -> torch.Tensor:
        """Sidecar rows of compressed entries ``0 .. entries-1``: entry ``e`` is
        row ``e % k`` of the anchor's page ``e // k``."""
        stack = self.stack
        plan = stack[stack.pool(role)]
        k = plan.page_size
        anchor = seq.indices[stack.pool("anchor")]
        pages = anchor[:: stack.page_size] // stack.page_size
        e = torch.arange(entries, dtype=torch.int64)
        return pages[e // k] * k + e % k

    def _device(self, pool: str, layer: int) -> tuple[DevicePool, int]:
        return _device_layer(self.group, pool, layer)

    def __repr__(self) -> str:
        return f"<DeepseekV4CacheBridge {self.stack!r}>"


def _device_layer(group: PoolGroup, pool: str, layer: int) -> tuple[DevicePool, int]:
    """Pool ``pool``'s device tensors and its layer for transfer layer ``layer`` (a bridge's own pools have both)."""
    dev = group[pool].device
    assert dev is not None
    j = dev.pool_layer(layer)
    assert j is not None
    return dev, j
