"""The DeepSeek V4 pool stack, planned from the model's config.

A V4 decoder layer is one of three types (``config.layer_types``): sliding
attention only; CSA (compressed sparse attention, rate ``r4``, with a
lightning indexer); HCA (heavily compressed attention, rate ``r128``). Every
layer keeps a sliding window of the last ``sliding_window - 1`` tokens
(shared-KV MQA: K = V, one head); CSA and HCA layers also keep compressed
entries, one per ``rate`` source tokens (entry ``i`` covers tokens
``[i*rate, (i+1)*rate)``), and the compressor state of the tokens not yet
compressed. The stack (each pool under its role's default name):

==============  =======  ===========================================================
pool            kind     rows
==============  =======  ===========================================================
``tok``         logical  one slot per token position, pages of ``page_size``; no bytes
``c4``          sidecar  of ``tok``: CSA compressed KV, ``page_size / r4`` rows per page
``c4_indexer``  sidecar  of ``tok``: CSA indexer keys, ``page_size / r4`` rows per page
``c128``        sidecar  of ``tok``: HCA compressed KV, ``page_size / r128`` rows per page
``swa``         pool     the window: its last tokens in order from row 0 of its first
                         page, pages of ``window_page_size`` (its own, not the anchor's)
``c4_state``    pool     page size 1, CSA layers: the compressor's and the indexer's
                         overlaps (``r4`` rows each); taken once an entry exists
``c4_buffer``   pool     CSA layers: one row per buffered (not yet compressed) token,
                         the compressor's and the indexer's kv and gate; pages of
                         ``r4 - 1`` rows, taken only while ``N % r4`` tokens wait
``c128_buffer`` pool     HCA layers: one row per buffered (not yet compressed) token,
                         pages of ``buffer_page_size``, so a sequence moves only the
                         pages its ``N % r128`` buffered tokens fill
==============  =======  ===========================================================

The names are role names, not rates: ``c4`` is the CSA role and ``c128`` the
HCA role (V4 ships rates 4 and 128), whatever rates the config has; at rates
8 / 32, ``c4`` holds rate-8 entries, ``page_size / 8`` rows per anchor page.
``repr(stack)`` shows the rates. Rename pools with ``roles=``
(``roles={"c4": "c8", ...}``); the bridge finds them by role
(`DeepseekV4Stack.pool`). A sidecar's `PoolPlan.rows_per_page` (also its
``page_size`` field) counts rows per anchor page, not tokens.

The sidecars use ``layer_map`` None on the layers without such a compressor;
pools that no layer needs are left out (a config without HCA layers has no
``c128``). The window, the state and the buffer hold what is valid for a
prefix that ends exactly where it ends: store them under
`kvtier.storage.window_keys`, the anchor's whole pages under
`kvtier.storage.page_keys`. All the ints (entry counts, buffer lengths, whether
overlaps exist) follow from the number of tokens; `DeepseekV4Stack.lengths`
says how.

The config is read by attribute (``layer_types``, ``compress_rates``,
``sliding_window``, ``head_dim``, ``index_head_dim``, ``num_key_value_heads``),
so nothing here imports transformers. `kvtier.integrations.hf.DeepseekV4CacheBridge`
moves a transformers V4 cache into and out of these pools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from kvtier.errors import ConfigurationError
from kvtier.pools import DevicePool, PlaneSpec, PoolGroup, SlotAllocator
from kvtier.pools.host import Layout
from kvtier.presets.stack import PoolPlan, PoolStack, Ratio, StackSizes, refuse_retired

if TYPE_CHECKING:
    from kvtier.storage.identity import EngineIdentity

__all__ = ["DeepseekV4Lengths", "DeepseekV4Stack", "deepseek_v4", "deepseek_v4_stack"]

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# Role -> default pool name. The roles are fixed (the bridge looks pools up by
# role); the pool names are the caller's (``roles=``).
DEFAULT_ROLES = {
    "anchor": "tok", "c4": "c4", "c4_indexer": "c4_indexer", "c128": "c128",
    "window": "swa", "c4_state": "c4_state", "c4_buffer": "c4_buffer", "c128_buffer": "c128_buffer",
}
# Spellings retired before 1.0, refused with the new one named (no silent aliases).
RETIRED_KEYWORDS = {"names": "roles= (a role -> pool name mapping; `names` is the tuple of pool names)"}
_RETIRED_ATTRIBUTES = {"role": "stack.roles.get(role) (or stack.pool(role), which raises when no layer needs it)"}
# The planes of c4_state and of c4_buffer, in this order, per compressor ("compressor", "indexer").
C4_STATE_PLANES = ("overlap_kv", "overlap_gate")
C4_BUFFER_PLANES = ("buffer_kv", "buffer_gate")


@dataclass(frozen=True, slots=True)
class DeepseekV4Lengths:
    """What a V4 cache of ``num_tokens`` tokens holds (every int follows from N)."""

    num_tokens: int
    window_tokens: int  # min(N, sliding_window - 1)
    c4_entries: int  # N // r4
    c4_buffered: int  # N % r4
    c128_entries: int  # N // r128
    c128_buffered: int  # N % r128

    @property
    def has_overlap(self) -> bool:
        """CSA overlaps exist once a window has been compressed."""
        return self.c4_entries >= 1


class DeepseekV4Stack(PoolStack):
    """The V4 pools of one model, with the facts a bridge needs.

    Built by `deepseek_v4_stack`; ``roles`` maps the roles (``anchor``,
    ``c4``, ``c4_indexer``, ``c128``, ``window``, ``c4_state``,
    ``c128_buffer``) to pool names, only for the pools this config needs;
    ``names`` (as for every `PoolStack`) is the tuple of pool names.
    """

    def __init__(
        self,
        plans: list[PoolPlan],
        *,
        roles: Mapping[str, str],
        layer_types: tuple[str, ...],
        page_size: int,
        window_page_size: int,
        buffer_page_size: int,
        csa_rate: int,
        hca_rate: int,
        sliding_window: int,
        head_dim: int,
        index_head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(plans)
        self.roles = dict(roles)
        self.layer_types = layer_types
        self.page_size = page_size
        self.window_page_size = window_page_size
        self.buffer_page_size = buffer_page_size
        self.csa_rate = csa_rate
        self.hca_rate = hca_rate
        self.sliding_window = sliding_window
        self.head_dim = head_dim
        self.index_head_dim = index_head_dim
        self.dtype = dtype

    def pool(self, role: str) -> str:
        """The pool that plays ``role``; `ConfigurationError` when this config has none."""
        name = self.roles.get(role)
        if name is None:
            raise ConfigurationError(f"this V4 config has no {role!r} pool (its layers need {sorted(self.roles)})")
        return name

    if not TYPE_CHECKING:  # hidden from type checkers: a typo stays a static error

        def __getattr__(self, attr: str) -> Any:
            # Only called for attributes that do not exist: name the new spelling of a retired one.
            if attr in _RETIRED_ATTRIBUTES:
                raise AttributeError(
                    f"DeepseekV4Stack.{attr} is gone; use {_RETIRED_ATTRIBUTES[attr]}", name=attr, obj=self
                )
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}", name=attr, obj=self)

    def lengths(self, num_tokens: int) -> DeepseekV4Lengths:
        n = num_tokens
        return DeepseekV4Lengths(
            n, min(n, self.sliding_window - 1), n // self.csa_rate, n % self.csa_rate,
            n // self.hca_rate, n % self.hca_rate,
        )

    def slots_needed(self, num_tokens: int) -> dict[str, int]:
        """Device slots per slot-owning pool for one sequence of ``num_tokens``
        tokens (pools it has nothing in are left out: a buffer that holds no
        token takes no page, nor the CSA overlaps before the first entry)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ConfigurationError(f"a sequence needs at least one token; got num_tokens={num_tokens!r}")
        n = self.lengths(num_tokens)
        out = {self.roles["anchor"]: _ceil(n.num_tokens, self.page_size) * self.page_size}
        out[self.roles["window"]] = _ceil(n.window_tokens, self.window_page_size) * self.window_page_size
        if "c4_state" in self.roles and n.has_overlap:
            out[self.roles["c4_state"]] = 1
        if "c4_buffer" in self.roles and n.c4_buffered:
            out[self.roles["c4_buffer"]] = self.csa_rate - 1
        if "c128_buffer" in self.roles and n.c128_buffered:
            out[self.roles["c128_buffer"]] = _ceil(n.c128_buffered, self.buffer_page_size) * self.buffer_page_size
        return out

    def device_pages_for(self, *, tokens: int, requests: int) -> dict[str, int]:
        """Device pages for ``tokens`` token slots shared by up to ``requests``
        sequences in flight: the anchor gets ``ceil(tokens / page_size)`` pages,
        every per-sequence pool room for ``requests`` sequences at their largest."""
        tokens = _positive("tokens", tokens)
        requests = _positive("requests", requests)
        out = {self.roles["anchor"]: _ceil(tokens, self.page_size)}
        out[self.roles["window"]] = requests * _ceil(self.sliding_window - 1, self.window_page_size)
        if "c4_state" in self.roles:
            out[self.roles["c4_state"]] = requests
        if "c4_buffer" in self.roles:
            out[self.roles["c4_buffer"]] = requests
        if "c128_buffer" in self.roles:
            out[self.roles["c128_buffer"]] = requests * _ceil(self.hca_rate - 1, self.buffer_page_size)
        return out

    def storage_keys(
        self,
        group: PoolGroup,
        tokens: Sequence[int] | torch.Tensor,
        *,
        model: str | None = None,
        extra: Sequence[str] = (),
        identity: EngineIdentity | None = None,
    ) -> dict[str, list[bytes]]:
        """The storage keys of the prefix ``tokens`` (token ids), per slot-owning
        pool, for `TransferScheduler.write_storage` and ``prefetch``: the
        anchor's pages under `kvtier.storage.page_keys` (each names the tokens
        up to its end), and every pool whose rows belong to the prefix that
        ends exactly here (the window, the CSA overlaps and buffers, the HCA
        buffer: the pools `slots_needed` names) under
        `kvtier.storage.prefix_keys` chained on the anchor's last key. So any
        prefix that ends on an anchor page boundary is published and found,
        whatever the window's page size. Each pool's namespace is its
        `PageIdentity`'s (`kvtier.storage.identity`) in ``group``: pass the
        `EngineIdentity` the scheduler has (``identity=``), or ``model`` (and
        ``extra``) to name the weights, as in `KeyNamespace`.

        Raises `ValueError` for a prefix that does not end on an anchor page
        boundary (the partial last page has no key; publish the whole pages
        before it) and as `page_keys` for bad token ids; `ConfigurationError`
        unless exactly one of ``model`` and ``identity`` is given.
        """
        from kvtier.storage.identity import EngineIdentity
        from kvtier.storage.keys import page_keys, prefix_keys  # imported here: presets need no storage

        if (model is None) == (identity is None):
            raise ConfigurationError(
                f"storage_keys needs one of model= (a string) and identity= (an EngineIdentity); got "
                f"model={model!r}, identity={identity!r:.80}"
            )
        engine = identity if identity is not None else EngineIdentity(str(model))
        n = len(tokens)
        if n < self.page_size or n % self.page_size:
            raise ConfigurationError(
                f"a V4 prefix is stored when it ends on an anchor page boundary (page_size {self.page_size}); got "
                f"{n} tokens: publish the first {n // self.page_size * self.page_size}"
            )
        anchor = self.roles["anchor"]
        keys = {anchor: page_keys(engine.page_identity(group, anchor, extra=extra).namespace(), tokens)}
        end = keys[anchor][-1]
        for name, slots in self.slots_needed(n).items():
            if name != anchor:
                ns = engine.page_identity(group, name, extra=extra).namespace()
                keys[name] = prefix_keys(ns, end, slots // self[name].page_size)
        return keys

    def valid_rows(self, num_tokens: int) -> dict[str, int]:
        """Rows that hold data, per pool whose slots for ``num_tokens`` tokens
        (`slots_needed`, sidecars: the rows the anchor's pages derive) are not
        all used: what ``backup(..., valid_rows=)`` takes, so that a backup, a load
        and a stored page move exactly those. The compressed entries (``N //
        rate`` of a sidecar's rows: a partial last anchor page, or a page with
        no entry yet), the window (``min(N, sliding_window - 1)`` rows of its
        pages), the CSA and HCA buffers (``N % rate`` rows)."""
        slots = self.slots_needed(num_tokens)
        n = self.lengths(num_tokens)
        anchor_pages = slots[self.roles["anchor"]] // self.page_size
        held = {"window": n.window_tokens, "c4_buffer": n.c4_buffered, "c128_buffer": n.c128_buffered}
        entries = {"c4": n.c4_entries, "c4_indexer": n.c4_entries, "c128": n.c128_entries}
        out = {}
        for role, name in self.roles.items():
            if role in entries:
                total, used = anchor_pages * self[name].page_size, entries[role]
            elif role in held and name in slots:
                total, used = slots[name], held[role]
            else:
                continue
            if used < total:
                out[name] = used
        return out

    def __repr__(self) -> str:
        # The rates beside the pool names: the names are roles (c4 is CSA's pool at any rate).
        rates = [f"{kind} rate {rate}" for kind, role, rate in
                 (("CSA", "c4", self.csa_rate), ("HCA", "c128", self.hca_rate)) if role in self.roles]
        head = f"<{type(self).__name__} "
        return head + (", ".join(rates) or "no compressed layers") + " " + super().__repr__().removeprefix(head)


def deepseek_v4_stack(
    config: Any,
    *,
    page_size: int | None = None,
    window_page_size: int | None = None,
    buffer_page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    roles: Mapping[str, str] | None = None,
    **retired: NoReturn,
) -> DeepseekV4Stack:
    """Plan the V4 stack of ``config`` (a ``DeepseekV4Config`` or anything with its attributes).

    ``page_size`` (anchor tokens per page) defaults to the largest compress
    rate in use (128 for V4's 4 / 128; the CSA rate when no layer is HCA; 1
    when no layer compresses) and must be a multiple of every rate in use; ``window_page_size``
    defaults to ``sliding_window``, so one page holds the whole window;
    ``dtype`` is the cache's dtype (the model's: the overlap gates are float32
    whatever it is, as the model keeps ``position_bias`` in float32).
    ``roles`` maps a role (a key of ``DEFAULT_ROLES``) to the pool name that
    plays it, for the roles you rename.

    Raises `ConfigurationError` naming the value and the rule for a config
    that is not V4-shaped or a page size that breaks a rate; `TypeError`
    naming the new spelling for a retired keyword (``names=``: ``roles=``).
    """
    refuse_retired("deepseek_v4_stack", retired, RETIRED_KEYWORDS)
    named = dict(DEFAULT_ROLES)
    for role, name in (roles or {}).items():
        if role not in named:
            raise ConfigurationError(f"unknown V4 pool role {role!r}; roles are {sorted(named)}")
        named[role] = name
    if len(set(named.values())) != len(named):
        raise ConfigurationError(f"V4 pool names must differ; got {named}")
    layer_types = tuple(getattr(config, "layer_types", None) or ())
    if not layer_types:
        raise ConfigurationError("the config has no layer_types; a DeepSeek V4 config lists one type per layer")
    bad = sorted({t for t in layer_types if t not in (SLIDING, CSA, HCA)})
    if bad:
        raise ConfigurationError(f"layer_types holds {bad}; DeepSeek V4 layers are {SLIDING}, {CSA} or {HCA}")
    rates = dict(getattr(config, "compress_rates", None) or {})
    used = {t for t in layer_types if t != SLIDING}
    for t in used:
        _positive(f"compress_rates[{t!r}]", rates.get(t))
    csa_rate = int(rates.get(CSA, 0)) if CSA in used else 0
    hca_rate = int(rates.get(HCA, 0)) if HCA in used else 0
    window = _positive("sliding_window", getattr(config, "sliding_window", None))
    if window < 2:
        raise ConfigurationError(f"sliding_window must be >= 2 (the window keeps sliding_window - 1 tokens); got {window}")
    if getattr(config, "num_key_value_heads", 1) != 1:
        raise ConfigurationError(
            f"DeepSeek V4 is shared-KV MQA with one KV head; the config has num_key_value_heads="
            f"{config.num_key_value_heads!r}"
        )
    head_dim = _positive("head_dim", getattr(config, "head_dim", None))
    index_head_dim = _positive("index_head_dim", getattr(config, "index_head_dim", None)) if csa_rate else 0
    largest = max(csa_rate, hca_rate, 1)
    page = largest if page_size is None else _positive("page_size", page_size)
    for t, rate in ((CSA, csa_rate), (HCA, hca_rate)):
        if rate and page % rate:
            raise ConfigurationError(
                f"page_size {page} must be a multiple of every compress rate, so that an anchor page holds "
                f"whole compressed entries; the {t} rate is {rate}"
            )
    win_page = window if window_page_size is None else _positive("window_page_size", window_page_size)
    buf_page = _positive("buffer_page_size", buffer_page_size)
    if not isinstance(dtype, torch.dtype):
        raise ConfigurationError(f"dtype must be a torch.dtype; got {dtype!r}")
    gate_dtype = torch.promote_types(dtype, torch.float32)

    def layer_map(kinds: set[str]) -> tuple[int | None, ...]:
        out: list[int | None] = []
        j = 0
        for t in layer_types:
            out.append(j if t in kinds else None)
            j += t in kinds
        return tuple(out)

    def planes(*shapes: tuple[tuple[int, ...], torch.dtype]) -> list[PlaneSpec]:
        return [PlaneSpec(s, d) for s, d in shapes]

    r = named
    plans = [PoolPlan.logical(r["anchor"], page_size=page)]
    active = {"anchor": r["anchor"], "window": r["window"]}
    csa, hca = layer_map({CSA}), layer_map({HCA})
    if csa_rate:
        k = page // csa_rate
        plans.append(PoolPlan.sidecar(r["c4"], source=r["anchor"], rows_per_page=k,
                                      planes=planes(((head_dim,), dtype)), layer_map=csa))
        plans.append(PoolPlan.sidecar(r["c4_indexer"], source=r["anchor"], rows_per_page=k,
                                      planes=planes(((index_head_dim,), dtype)), layer_map=csa))
        active.update(c4=r["c4"], c4_indexer=r["c4_indexer"], c4_state=r["c4_state"], c4_buffer=r["c4_buffer"])
    if hca_rate:
        plans.append(PoolPlan.sidecar(r["c128"], source=r["anchor"], rows_per_page=page // hca_rate,
                                      planes=planes(((head_dim,), dtype)), layer_map=hca))
        active.update(c128=r["c128"], c128_buffer=r["c128_buffer"])
    plans.append(PoolPlan.pool(r["window"], page_size=win_page, planes=planes(((head_dim,), dtype)),
                               layer_map=layer_map({SLIDING, CSA, HCA})))
    if csa_rate:
        state, buffer = [], []
        for width in (head_dim, index_head_dim):  # the compressor's, then the indexer's
            state += [((csa_rate, width), dtype), ((csa_rate, width), gate_dtype)]
            buffer += [((2 * width,), dtype), ((2 * width,), dtype)]
        plans.append(PoolPlan.pool(r["c4_state"], page_size=1, planes=planes(*state), layer_map=csa))
        # One page holds the most a CSA buffer keeps (r4 - 1 tokens; one row at rate 2).
        plans.append(PoolPlan.pool(r["c4_buffer"], page_size=max(1, csa_rate - 1), planes=planes(*buffer),
                                   layer_map=csa))
    if hca_rate:
        plans.append(PoolPlan.pool(r["c128_buffer"], page_size=buf_page,
                                   planes=planes(((head_dim,), dtype), ((head_dim,), dtype)), layer_map=hca))
    return DeepseekV4Stack(
        plans, roles=active, layer_types=layer_types, page_size=page, window_page_size=win_page,
        buffer_page_size=buf_page, csa_rate=csa_rate or 1, hca_rate=hca_rate or 1, sliding_window=window,
        head_dim=head_dim, index_head_dim=index_head_dim, dtype=dtype,
    )


def deepseek_v4(
    config: Any,
    group: PoolGroup,
    *,
    device_pages: Mapping[str, int] | None = None,
    tokens: int | None = None,
    requests: int | None = None,
    devices: Mapping[str, DevicePool] | None = None,
    allocators: Mapping[str, SlotAllocator] | None = None,
    host_ratio: Ratio | None = None,
    host_bytes: int | None = None,
    host_slots: Mapping[str, int] | None = None,
    page_size: int | None = None,
    window_page_size: int | None = None,
    buffer_page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    roles: Mapping[str, str] | None = None,
    layout: Layout = "layer_first",
    device: torch.device | str | None = None,
    pin_memory: bool | None = None,
    **retired: NoReturn,
) -> tuple[DeepseekV4Stack, StackSizes]:
    """Plan the V4 stack of ``config`` and register it in ``group``: one call
    for `deepseek_v4_stack` then `PoolStack.register`, taking what both take.

    Device sizes: ``device_pages`` per slot-owning pool, or ``tokens`` and
    ``requests`` (`DeepseekV4Stack.device_pages_for`), or the engine's own
    ``devices`` and ``allocators`` (an engine that owns its token allocator
    passes ``allocators={stack.pool("anchor"): ...}``). Host sizes: exactly
    one of ``host_ratio``, ``host_bytes``, ``host_slots`` (see
    `PoolStack.host_pages`). Planning (``page_size``, ``window_page_size``,
    ``buffer_page_size``, ``dtype``, ``roles``) as `deepseek_v4_stack`.
    Returns the stack and what was registered. Raises `ConfigurationError`
    and registers nothing on bad input; `TypeError` naming the new spelling
    for a retired keyword.
    """
    refuse_retired("deepseek_v4", retired, RETIRED_KEYWORDS)
    stack = deepseek_v4_stack(config, page_size=page_size, window_page_size=window_page_size,
                              buffer_page_size=buffer_page_size, dtype=dtype, roles=roles)
    if (tokens is None) != (requests is None):
        raise ConfigurationError(f"give tokens and requests together; got tokens={tokens!r}, requests={requests!r}")
    if tokens is not None and requests is not None:
        if device_pages is not None:
            raise ConfigurationError("give device_pages or tokens and requests, not both")
        device_pages = stack.device_pages_for(tokens=tokens, requests=requests)
    sizes = stack.register(
        group, device_pages=device_pages, devices=devices, allocators=allocators, host_ratio=host_ratio,
        host_bytes=host_bytes, host_slots=host_slots, layout=layout, device=device, pin_memory=pin_memory,
    )
    return stack, sizes


def _positive(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f"{what} must be a positive int; got {value!r}")
    return value


def _ceil(a: int, b: int) -> int:
    return -(-a // b)
