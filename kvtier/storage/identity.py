"""Page identity: everything that gives a stored page's bytes their meaning, as one value.

A stored page is only worth reading by an engine that would have written the
same bytes for the same tokens. `PageIdentity` is that condition, whole:

* ``model``: the engine's model identity, as the engine gives it (name,
  revision, quantisation, anything else that changes the cache);
* ``scheme``: the key scheme, i.e. the engine whose keys these are
  (``"kvtier"`` for kvtier's own `page_keys`, ``"vllm"``, an SGLang scheme);
* ``pools``: one `PoolFormat` per pool whose rows the stored page holds (the
  anchor first, then its sidecars by name): role (name), kind, layout (the
  order of the stored rows: `STORED_ORDER` for every kvtier host pool, since
  ``layer_first`` and ``page_first`` pools store the same bytes), rows
  per page, layer count, each plane's row shape, **true** element format and
  element size (``float8_e4m3fn`` and ``float8_e5m2`` are different formats
  even where both are held as ``uint8``: the caller names the format where
  the tensor cannot say it), and the pool's shard (`Shard`: rank and world)
  when the pool is sharded, decided per pool (None: every rank holds the
  same rows);
* ``extra``: further strings the caller wants covered; ``version``: the
  identity's format version (`IDENTITY_VERSION`).

What derives from it:

* `PageIdentity.digest` (32 bytes) and `PageIdentity.tag` (8 bytes per pool):
  the tag is what a stored blob's header carries (`kvtier.storage.pages`,
  blob format 3), so a page read under another identity is refused
  (`PageCorrupted` rule ``identity``: a miss, repaired by the next write),
  even where a user-made key is the same;
* the key roots: `PageIdentity.namespace` (kvtier's `KeyNamespace`, what
  `KeyNamespace.for_pool` gives), `PageIdentity.engine_namespace` (the
  `EngineNamespace` of an engine that hashes its own keys, e.g. SGLang) and
  `PageIdentity.vllm_root` (the root of vLLM's storage keys). Where the
  identity is what it was before this module, the keys are byte-identical to
  the ones each place built by hand before (pinned in the tests).

The key roots live here too, below both of their users: `KeyNamespace` (and
`KEY_BYTES`), whose root starts the chains of `kvtier.storage.keys`, and
`EngineNamespace`, which turns an engine's own page keys into kvtier keys for
`kvtier.storage.sealed`. This module imports neither of those: keys and sealed
pages read the identity, never the other way round.

`EngineIdentity` is what an engine knows that its tensors cannot say (the
model string, per-pool shards and formats, extras): `TransferScheduler`
takes it once (``identity=``) and derives each anchor pool's `PageIdentity`
from its `PoolGroup` (`EngineIdentity.page_identity`).

Everything here is pure and deterministic across processes (no ``hash()``).
Bad input raises `ConfigurationError` naming the field and the value.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier.errors import ConfigurationError

if TYPE_CHECKING:
    from kvtier.pools import PoolGroup

__all__ = [
    "ANONYMOUS_MODEL",
    "IDENTITY_VERSION",
    "KEY_BYTES",
    "EngineIdentity",
    "EngineNamespace",
    "KeyNamespace",
    "PageIdentity",
    "PlaneFormat",
    "PoolFormat",
    "Shard",
    "element_format",
    "vllm_block_key",
    "vllm_shard_key",
]

IDENTITY_VERSION = 1
"""The identity's format version (mixed into `PageIdentity.digest`)."""

ANONYMOUS_MODEL = "kvtier:unnamed-model"
"""The model string of a scheduler given no `EngineIdentity`: its pages are
still bound to their geometry and formats, but not to a model."""

_PERSON_DIGEST = b"kvtier-ident"
_PERSON_TAG = b"kvtier-idtag"

KEY_BYTES = 32
"""Length of a page key in bytes."""

# Bumped when the key derivation or the stored page format changes, so that a
# new kvtier never reads an old one's pages as its own. v2: every blob carries
# a header and a checksum (`kvtier.storage.pages`). Not bumped for blob format
# 2 (the key's tag, xxh3-64): a page of format 1 is found under its key, refused
# by its version (a miss) and put again by the next write, which repairs it.
_KEY_VERSION = b"kvtier-page-key-v2"
_NAMESPACE_VERSION = b"kvtier-engine-ns-v1"


STORED_ORDER = "layer_first"
"""The order of a stored page's rows whatever its host pool's layout: layer
by layer, each layer's rows in order (`kvtier.storage.pages.pack_rows` reads
a ``page_first`` pool through a transposed view, so both host layouts store
the same bytes). `PageIdentity.for_pool` records it as every kvtier pool's
``layout``, so engines whose host pools differ in layout share their pages."""


def _is_int(value: object, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


def _bad(what: str, name: str, value: object, rule: str) -> ConfigurationError:
    return ConfigurationError(f"{what} field {name!r} {rule}; got {value!r}")


def _check_text(what: str, name: str, value: object, texts: Iterable[str]) -> None:
    """`ConfigurationError` unless every string of ``texts`` (field ``name`` of
    ``what``) is valid Unicode, i.e. encodes as UTF-8, as the digest needs: a
    lone surrogate (what ``os.fsdecode`` makes of a name that is not UTF-8)
    fails here, at construction, not at the first page."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _bad(what, name, value, f"must be valid Unicode (encodable as UTF-8; {exc.reason} at {exc.start})") from None


def element_format(dtype: torch.dtype) -> str:
    """The format name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def _torch_itemsize(fmt: str) -> int | None:
    """The element size of a format that names a torch dtype, else None."""
    dtype = getattr(torch, fmt, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


@dataclass(frozen=True, slots=True)
class Shard:
    """Which part of a pool's rows this process holds: shard ``rank`` of
    ``world`` ranks. ``cut`` says how the world is cut where that changes
    the shard's bytes (vLLM: ``"tp=2|pp=1"``); empty by default.

    Raises `ConfigurationError` for a world that is not a positive integer or a
    rank outside ``0 .. world-1``.
    """

    rank: int
    world: int
    cut: str = ""

    def __post_init__(self) -> None:
        if not _is_int(self.world, 1):
            raise _bad("shard", "world", self.world, "must be a positive integer")
        if not _is_int(self.rank, 0) or self.rank >= self.world:
            raise _bad("shard", "rank", self.rank, f"must be an integer in 0..{self.world - 1} (world={self.world})")
        if not isinstance(self.cut, str):
            raise _bad("shard", "cut", self.cut, "must be a string")
        _check_text("shard", "cut", self.cut, (self.cut,))


@dataclass(frozen=True, slots=True)
class PlaneFormat:
    """One plane of a pool's row: its shape (after the row dimension), its
    true element format and its element size in bytes.

    ``format`` is the element format the bytes hold, which may differ from the
    tensor's dtype (an fp8 cache held as ``uint8``: ``"float8_e4m3fn"``). A
    format that names a torch dtype must have that dtype's element size.
    Raises `ConfigurationError` naming the field and the value.
    """

    shape: tuple[int, ...]
    format: str
    element_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or not all(_is_int(d, 0) for d in self.shape):
            raise _bad("plane", "shape", self.shape, "must be a tuple of non-negative integers")
        if not isinstance(self.format, str) or not self.format:
            raise _bad("plane", "format", self.format, "must be a non-empty string")
        _check_text("plane", "format", self.format, (self.format,))
        if not _is_int(self.element_size, 1):
            raise _bad("plane", "element_size", self.element_size, "must be a positive integer")
        size = _torch_itemsize(self.format)
        if size is not None and size != self.element_size:
            raise _bad("plane", "element_size", self.element_size,
                       f"must be {size} for format {self.format!r} (torch's element size of that dtype)")

    @property
    def row_nbytes(self) -> int:
        n = self.element_size
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class PoolFormat:
    """What one pool's part of a stored page is: ``name`` (its role), ``kind``
    (``"pool"``, ``"logical"``, ``"sidecar"``, or an engine's word), ``layout``,
    ``rows`` per page, ``layers``, its ``planes`` and its ``shard`` (None when
    every rank holds the same rows; a `Shard` of a world of one is None).

    Raises `ConfigurationError` naming the field and the value.
    """

    name: str
    kind: str
    layout: str
    rows: int
    layers: int
    planes: tuple[PlaneFormat, ...]
    shard: Shard | None = None

    def __post_init__(self) -> None:
        for name in ("name", "kind", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise _bad("pool format", name, value, "must be a non-empty string")
            _check_text("pool format", name, value, (value,))
        if not _is_int(self.rows, 1):
            raise _bad("pool format", "rows", self.rows, "must be a positive integer (rows per page)")
        if not _is_int(self.layers, 0):
            raise _bad("pool format", "layers", self.layers, "must be a non-negative integer")
        if not isinstance(self.planes, tuple) or not all(isinstance(p, PlaneFormat) for p in self.planes):
            raise _bad("pool format", "planes", self.planes, "must be a tuple of PlaneFormat")
        if self.shard is not None and not isinstance(self.shard, Shard):
            raise _bad("pool format", "shard", self.shard, "must be a Shard or None")
        if self.shard is not None and self.shard.world == 1:
            object.__setattr__(self, "shard", None)  # one shard of one is the whole

    def _parts(self) -> list[str]:
        parts = [self.name, self.kind, self.layout, str(self.rows), str(self.layers), str(len(self.planes))]
        for p in self.planes:
            parts += ["x".join(map(str, p.shape)) or "scalar", p.format, str(p.element_size)]
        s = self.shard
        parts.append("replicated" if s is None else f"shard={s.rank}/{s.world}|{s.cut}")
        return parts


@dataclass(frozen=True, slots=True)
class PageIdentity:
    """Everything that must match for a stored page to be read as this
    engine's (see the module doc). ``pools[0]`` is the anchor, the pool whose
    page keys name the page; the others are the rows stored with it.

    Frozen and hashable; `digest` is computed once. Raises
    `ConfigurationError` naming the field and the value.
    """

    model: str
    scheme: str
    pools: tuple[PoolFormat, ...]
    extra: tuple[str, ...] = ()
    version: int = IDENTITY_VERSION
    _digest: bytes = field(default=b"", init=False, repr=False, compare=False)
    _tags: dict[str, bytes] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model", "scheme"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise _bad("page identity", name, value, "must be a non-empty string")
        if (not isinstance(self.pools, tuple) or not self.pools
                or not all(isinstance(p, PoolFormat) for p in self.pools)):
            raise _bad("page identity", "pools", self.pools, "must be a non-empty tuple of PoolFormat (anchor first)")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise _bad("page identity", "pools", names, "must name each pool once")
        if not isinstance(self.extra, tuple) or not all(isinstance(e, str) for e in self.extra):
            raise _bad("page identity", "extra", self.extra, "must be a tuple of strings")
        if not _is_int(self.version, 1):
            raise _bad("page identity", "version", self.version, "must be a positive integer")
        _check_text("page identity", "model", self.model, (self.model,))
        _check_text("page identity", "scheme", self.scheme, (self.scheme,))
        _check_text("page identity", "extra", self.extra, self.extra)
        h = hashlib.blake2b(digest_size=32, person=_PERSON_DIGEST)
        parts = [str(self.version), self.model, self.scheme, str(len(self.pools))]
        for p in self.pools:
            parts += p._parts()
        parts += [str(len(self.extra)), *self.extra]
        for part in parts:
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        digest = h.digest()
        object.__setattr__(self, "_digest", digest)
        object.__setattr__(self, "_tags", {p.name: _tag(digest, p.name) for p in self.pools})

    # -- builders ---------------------------------------------------------------

    @classmethod
    def for_pool(
        cls,
        group: PoolGroup,
        pool: str,
        *,
        model: str,
        scheme: str = "kvtier",
        shards: Mapping[str, Shard | None] | None = None,
        formats: Mapping[str, str | Sequence[str]] | None = None,
        extra: Iterable[str] = (),
    ) -> PageIdentity:
        """The identity of anchor ``pool``'s stored pages in ``group``: the anchor
        and each of its sidecars (by name), their geometry read from the host
        pools. ``shards[name]``: that pool's shard (absent: replicated).
        ``formats[name]``: the true element format of each of that pool's planes
        (one string for every plane, or one per plane) where the dtype does not
        say it (fp8 held as ``uint8``); it must have the dtype's element size.

        Raises `ConfigurationError` for an unknown pool, a sidecar as ``pool``
        (a sidecar is stored with its source), a shard or format for a pool not
        in the group, a format list of the wrong length or a format of another
        element size than the tensor's.
        """
        if pool not in group:
            raise ConfigurationError(f"pool {pool!r} is not registered (known: {sorted(group.names)})")
        anchor = group[pool]
        if anchor.sidecar is not None:
            raise ConfigurationError(
                f"pool {pool!r} is a sidecar of {anchor.sidecar.source!r}; its pages are stored with "
                f"its source's, so key the source"
            )
        shards = dict(shards or {})
        formats = dict(formats or {})
        for what, named in (("shards", set(shards)), ("formats", set(formats))):
            unknown = sorted(named - set(group.names))
            if unknown:
                raise ConfigurationError(
                    f"identity {what} name pools {unknown} that are not registered (known: {sorted(group.names)})"
                )
        members = [anchor, *sorted(group.sidecars_of(pool), key=lambda s: s.name)]
        records = []
        for spec in members:
            host = spec.host
            planes = host.planes
            given = formats.get(spec.name)
            if given is None:
                names = [element_format(p.dtype) for p in planes]
            else:
                names = [given] * len(planes) if isinstance(given, str) else list(given)
                if len(names) != len(planes) or not all(isinstance(n, str) and n for n in names):
                    raise ConfigurationError(
                        f"identity formats[{spec.name!r}] must be one format name or one per plane "
                        f"({len(planes)} planes); got {given!r}"
                    )
            plane_formats = []
            for plane, fmt in zip(planes, names):
                size = plane.dtype.itemsize
                known = _torch_itemsize(fmt)
                if known is not None and known != size:
                    raise ConfigurationError(
                        f"identity formats[{spec.name!r}] names {fmt!r} ({known}-byte elements) for a plane "
                        f"held as {element_format(plane.dtype)} ({size}-byte elements)"
                    )
                plane_formats.append(PlaneFormat(tuple(plane.shape), fmt, size))
            shard = shards.get(spec.name)
            records.append(PoolFormat(
                name=spec.name, kind=spec.kind, layout=STORED_ORDER if host.layout else "none", rows=spec.page_size,
                layers=host.num_layers, planes=tuple(plane_formats), shard=shard,
            ))
        return cls(model=model, scheme=scheme, pools=tuple(records), extra=tuple(extra))

    @classmethod
    def for_vllm_block(
        cls,
        *,
        model: str,
        block_size: int,
        dtype: str,
        num_layers: int,
        block_bytes: int,
        groups: str = "",
        shard: Shard | None = None,
    ) -> PageIdentity:
        """The identity of a vLLM block as vLLM's offloading config describes it:
        ``block_size`` tokens, ``num_layers`` layers, ``block_bytes`` bytes of
        element format ``dtype`` (one plane: the block's bytes over every layer),
        the KV cache groups' layout (`group_layout`; empty for one group) and
        this worker's `Shard` of the world (None: one worker).

        Raises `ConfigurationError` for a block size that does not divide into
        elements of ``dtype``, and as the records do.
        """
        fmt = str(dtype).removeprefix("torch.")
        size = _torch_itemsize(fmt) or 1
        if not _is_int(block_bytes, 1) or block_bytes % size:
            raise ConfigurationError(
                f"vLLM block_bytes must be a positive multiple of {fmt}'s {size}-byte elements; got {block_bytes!r}"
            )
        record = PoolFormat(
            name="vllm-kv", kind="vllm-block", layout="vllm-cpu-block", rows=block_size, layers=num_layers,
            planes=(PlaneFormat((block_bytes // size,), fmt, size),), shard=shard,
        )
        return cls(model=model, scheme="vllm", pools=(record,), extra=(f"groups={groups}",) if groups else ())

    # -- what derives from it ---------------------------------------------------

    @property
    def anchor(self) -> PoolFormat:
        """The anchor pool's record (``pools[0]``)."""
        return self.pools[0]

    def digest(self) -> bytes:
        """32 bytes that change with any field (BLAKE2b, length-prefixed fields)."""
        return self._digest

    def tag(self, pool: str) -> bytes:
        """The 8-byte tag a stored blob of ``pool`` carries in its header: the
        identity's digest and the pool's name, so a blob is refused under
        another identity and in another pool's place alike.

        Raises `ConfigurationError` for a pool the identity does not hold.
        """
        tag = self._tags.get(pool)
        if tag is None:
            raise ConfigurationError(
                f"pool {pool!r} is not part of this page identity (pools: {[p.name for p in self.pools]})"
            )
        return tag

    def pool(self, name: str) -> PoolFormat:
        """The record of pool ``name``; `ConfigurationError` if it is not held."""
        for p in self.pools:
            if p.name == name:
                return p
        raise ConfigurationError(f"pool {name!r} is not part of this page identity (pools: {[p.name for p in self.pools]})")

    def namespace(self) -> KeyNamespace:
        """kvtier's `KeyNamespace` for `page_keys` of this identity's anchor.

        The fields are those `KeyNamespace.for_pool` always filled (so keys of
        an unsharded ``"kvtier"`` identity without format overrides are what
        they were), plus a string per sharded pool, the scheme where it is not
        ``"kvtier"`` and the version where it is not 1.
        """
        dtypes, layouts, shapes, shards = [], [], [], []
        for p in self.pools:
            dtypes.append(f"{p.name}=" + ",".join(pl.format for pl in p.planes))
            layouts.append(f"{p.name}={p.layout}")
            shapes.append(
                f"{p.name}:{p.kind}:rows={p.rows}:layers={p.layers}:planes="
                + ",".join("x".join(map(str, pl.shape)) or "scalar" for pl in p.planes)
            )
            if p.shard is not None:
                shards.append(f"{p.name}:shard={p.shard.rank}/{p.shard.world}" + (f"|{p.shard.cut}" if p.shard.cut else ""))
        tail = [*shards]
        if self.scheme != "kvtier":
            tail.append(f"scheme={self.scheme}")
        if self.version != IDENTITY_VERSION:
            tail.append(f"identity-version={self.version}")
        return KeyNamespace(
            model=self.model, pool=self.anchor.name, page_size=self.anchor.rows,
            dtype=";".join(dtypes), layout=";".join(layouts), extra=(*shapes, *tail, *self.extra),
        )

    def engine_namespace(self) -> EngineNamespace:
        """The `EngineNamespace` of an engine that hashes its own page keys:
        ``engine`` is the scheme; page size, dtype (the anchor's plane formats,
        comma-joined) and layout are the anchor's; the TP rank and size are the
        anchor's shard (rank 0 of 1 when replicated); ``extra`` is the
        identity's, plus a string for each sidecar and each sidecar's shard
        (none for a lone pool, so its keys are what `EngineNamespace` gave)."""
        a = self.anchor
        shard = a.shard
        more = []
        for p in self.pools[1:]:
            more.append("|".join(["side", *p._parts()]))
        if self.version != IDENTITY_VERSION:
            more.append(f"identity-version={self.version}")
        return EngineNamespace(
            engine=self.scheme, model=self.model, page_size=a.rows,
            dtype=",".join(pl.format for pl in a.planes), layout=a.layout,
            tp_rank=0 if shard is None else shard.rank, tp_size=1 if shard is None else shard.world,
            extra=(*self.extra, *more),
        )

    def vllm_root(self) -> bytes:
        """The root of vLLM's storage keys (`kvtier.integrations.vllm_keys.StorageKeys`)
        for an identity made by `for_vllm_block`: the same bytes as before this
        module. The anchor's shard is not in it: a block's key names every
        shard, and each worker derives its shard's key from it."""
        a = self.anchor
        if self.scheme != "vllm" or len(self.pools) != 1 or len(a.planes) != 1:
            raise ConfigurationError(
                f"vllm_root needs an identity of one vLLM block pool (PageIdentity.for_vllm_block); "
                f"got scheme {self.scheme!r} with pools {[p.name for p in self.pools]}"
            )
        plane = a.planes[0]
        extra = [f"layers={a.layers}", f"block_bytes={plane.row_nbytes}", *self.extra]
        if self.version != IDENTITY_VERSION:
            extra.append(f"identity-version={self.version}")
        return KeyNamespace(
            model=self.model, pool=a.name, page_size=a.rows, dtype=plane.format, layout=a.layout, extra=tuple(extra),
        ).root()


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """Everything that must match for two engines to share a page.

    ``model`` identifies the weights (name and revision, plus anything else that
    changes the cache: tensor-parallel rank, quantisation, RoPE scaling...);
    ``pool`` is the anchor pool's name; ``page_size`` its page size in tokens;
    ``dtype`` and ``layout`` describe the stored bytes. ``extra`` holds any
    further strings the caller wants covered. `for_pool` fills every field
    from a `PoolGroup`, covering the anchor's sidecars too.

    Raises `ConfigurationError` for an empty model or pool name or a page size
    that is not a positive integer.
    """

    model: str
    pool: str
    page_size: int
    dtype: str
    layout: str
    extra: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("model", "pool", "dtype", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or (name in ("model", "pool") and not value):
                raise ConfigurationError(f"key namespace field {name!r} must be a non-empty string; got {value!r}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1:
            raise ConfigurationError(f"key namespace page_size must be a positive integer; got {self.page_size!r}")
        if not isinstance(self.extra, tuple) or not all(isinstance(e, str) for e in self.extra):
            raise ConfigurationError(f"key namespace extra must be a tuple of strings; got {self.extra!r}")

    @classmethod
    def for_pool(
        cls,
        group: PoolGroup,
        pool: str,
        *,
        model: str,
        extra: Iterable[str] = (),
        shards: Mapping[str, Shard | None] | None = None,
        formats: Mapping[str, str | Sequence[str]] | None = None,
    ) -> KeyNamespace:
        """The namespace of ``pool``'s pages together with its sidecars:
        ``PageIdentity.for_pool(group, pool, model=..., extra=..., shards=...,
        formats=...).namespace()``, which covers each pool a stored page
        holds: name, kind, rows per page, layer count, plane shapes, element formats (``formats[name]`` where the dtype does
        not say it: fp8 held as ``uint8``), layout and shard (``shards[name]``).
        Raises `ConfigurationError` if ``pool`` is not registered or is itself
        a sidecar (a sidecar is stored with its source), and as
        `PageIdentity.for_pool` for a bad shard or format.
        """
        return PageIdentity.for_pool(group, pool, model=model, extra=extra, shards=shards, formats=formats).namespace()

    def root(self) -> bytes:
        """The chain's starting value: a digest of every field.

        Fields are length-prefixed, so no two different namespaces encode alike.
        """
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvtier-ns")
        h.update(_KEY_VERSION)
        for part in (self.model, self.pool, str(self.page_size), self.dtype, self.layout, *self.extra):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        h.update(len(self.extra).to_bytes(8, "little"))
        return h.digest()


@dataclass(frozen=True, slots=True)
class EngineNamespace:
    """Everything that must match for two engine processes to share a page.

    ``engine`` names the engine and its key scheme (``"sglang"``); ``model``
    the weights (name, revision, quantisation); ``tp_rank`` / ``tp_size`` the
    shard of the cache this process holds (use rank 0 of size 1 for a cache
    every rank holds whole, such as MLA's); ``dtype`` and ``layout`` describe
    the payload bytes; ``page_size`` is tokens per page. ``extra`` holds any
    further strings to cover (pipeline stage, context-parallel rank, ...).

    Raises `ConfigurationError` naming the field for an empty engine or
    model, a non-string dtype or layout, a page size that is not a positive
    integer, or a rank outside ``0 .. tp_size-1``.
    """

    engine: str
    model: str
    page_size: int
    dtype: str
    layout: str
    tp_rank: int = 0
    tp_size: int = 1
    extra: tuple[str, ...] = field(default=())
    _root: bytes = field(init=False, repr=False, compare=False, default=b"")  # `root`, computed once

    def __post_init__(self) -> None:
        for name in ("engine", "model", "dtype", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or (name in ("engine", "model") and not value):
                raise ConfigurationError(f"engine namespace field {name!r} must be a non-empty string; got {value!r}")
        for name in ("page_size", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"engine namespace {name} must be a positive integer; got {value!r}")
        rank = self.tp_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.tp_size:
            raise ConfigurationError(
                f"engine namespace tp_rank must be an integer in 0..{self.tp_size - 1} (tp_size={self.tp_size}); got {rank!r}"
            )
        if not isinstance(self.extra, tuple) or not all(isinstance(e, str) for e in self.extra):
            raise ConfigurationError(f"engine namespace extra must be a tuple of strings; got {self.extra!r}")
        object.__setattr__(self, "_root", self._digest())

    def root(self) -> bytes:
        """A 32-byte digest of every field (length-prefixed: no two namespaces encode alike)."""
        return self._root

    def _digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvtier-engns")
        h.update(_NAMESPACE_VERSION)
        parts = (self.engine, self.model, str(self.page_size), self.dtype, self.layout,
                 str(self.tp_rank), str(self.tp_size), *self.extra)
        for part in parts:
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        h.update(len(self.extra).to_bytes(8, "little"))
        return h.digest()

    def label(self) -> str:
        """A short printable form of `root` (16 hex digits), e.g. for a store prefix or directory."""
        return self.root()[:8].hex()

    def key(self, engine_key: str | bytes, *, pool: str = "kv") -> bytes:
        """The 32-byte kvtier page key of ``engine_key`` (the engine's own hash of
        the page and its prefix) for ``pool``'s payload, in this namespace.

        Raises `ValueError` for an empty key, or one that is neither ``str`` nor ``bytes``.
        """
        return self.keys([engine_key], pool=pool)[0]

    def keys(self, engine_keys: Iterable[str | bytes], *, pool: str = "kv") -> list[bytes]:
        """`key` for each of ``engine_keys``, in order."""
        base = _engine_key_hash(self._root, pool)
        out: list[bytes] = []
        for k in engine_keys:
            data = k.encode("utf-8") if isinstance(k, str) else k
            if not isinstance(data, bytes) or not data:
                raise ConfigurationError(f"engine page keys are non-empty str or bytes; got {k!r:.80}")
            h = base.copy()
            h.update(data)
            out.append(h.digest())
        return out


@functools.lru_cache(maxsize=256)
def _engine_key_hash(root: bytes, pool: str) -> hashlib.blake2b:
    """The hash of `EngineNamespace.keys` with the namespace's root and the pool
    in it, kept per (root, pool): each key copies it (never updates it) and
    adds its own bytes, half the cost of hashing root and pool again a key."""
    tag = pool.encode("utf-8")
    h = hashlib.blake2b(root, digest_size=KEY_BYTES, person=b"kvtier-engkey")
    h.update(len(tag).to_bytes(8, "little"))
    h.update(tag)
    return h


def vllm_block_key(root: bytes, offload_key: bytes) -> bytes:
    """The storage key of vLLM offload key ``offload_key`` (block hash + group
    index) under ``root`` (`PageIdentity.vllm_root`): every shard's name for it."""
    h = hashlib.blake2b(digest_size=32, person=b"kvtier-vllm")
    h.update(root)
    h.update(offload_key)
    return h.digest()


def vllm_shard_key(storage_key: bytes, shard: Shard | None) -> bytes:
    """The key of ``shard``'s part of the block stored under ``storage_key``:
    ``storage_key`` itself without a shard (one worker); else BLAKE2b of the key,
    the world, its cut and the rank, so that a shard cut differently is never read."""
    if shard is None:
        return storage_key
    h = hashlib.blake2b(digest_size=32, person=b"kvtier-vllm-rk")
    h.update(storage_key)
    h.update(f"world={shard.world}|{shard.cut}|rank={shard.rank}".encode())
    return h.digest()


def _tag(digest: bytes, pool: str) -> bytes:
    h = hashlib.blake2b(digest, digest_size=8, person=_PERSON_TAG)
    h.update(pool.encode("utf-8"))
    return h.digest()


@dataclass(frozen=True, slots=True, eq=False)
class EngineIdentity:
    """What an engine knows about its cache that its tensors cannot say:
    ``model`` (its model identity, as given), ``scheme`` (its key scheme),
    ``shards`` (pool name -> `Shard`, for each pool that is sharded; absent:
    replicated), ``formats`` (pool name -> true element format(s), where the
    dtype does not say it) and ``extra`` strings. `TransferScheduler` takes
    one (``identity=``) and derives each anchor's `PageIdentity` from its group.

    Raises `ConfigurationError` naming the field and the value.
    """

    model: str
    scheme: str = "kvtier"
    shards: Mapping[str, Shard | None] = field(default_factory=dict)
    formats: Mapping[str, str | Sequence[str]] = field(default_factory=dict)
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("model", "scheme"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise _bad("engine identity", name, value, "must be a non-empty string")
        if not isinstance(self.shards, Mapping) or not all(
            isinstance(k, str) and (v is None or isinstance(v, Shard)) for k, v in self.shards.items()
        ):
            raise _bad("engine identity", "shards", self.shards, "must map pool names to Shard (or None)")
        if not isinstance(self.formats, Mapping) or not all(
            isinstance(k, str) and (
                (isinstance(v, str) and v)
                or (isinstance(v, Sequence) and not isinstance(v, (str, bytes)) and v
                    and all(isinstance(n, str) and n for n in v))
            )
            for k, v in self.formats.items()
        ):
            raise _bad("engine identity", "formats", self.formats,
                       "must map pool names to a format name or a sequence of them, one per plane (non-empty strings)")
        if not isinstance(self.extra, tuple) or not all(isinstance(e, str) for e in self.extra):
            raise _bad("engine identity", "extra", self.extra, "must be a tuple of strings")
        for name, texts in (
            ("model", (self.model,)), ("scheme", (self.scheme,)), ("shards", self.shards),
            ("formats", [t for k, v in self.formats.items() for t in (k, *((v,) if isinstance(v, str) else v))]),
            ("extra", self.extra),
        ):
            _check_text("engine identity", name, getattr(self, name), texts)
        object.__setattr__(self, "shards", dict(self.shards))
        object.__setattr__(self, "formats", {k: v if isinstance(v, str) else tuple(v) for k, v in self.formats.items()})

    @classmethod
    def of_pages(cls, identity: PageIdentity, pool: str) -> EngineIdentity:
        """The engine identity of a scheduler whose pool ``pool`` holds the pages
        ``identity`` describes in an engine's own terms (a vLLM block,
        `PageIdentity.for_vllm_block`): its model and scheme, its anchor's shard
        as ``pool``'s, and its digest as an extra string, so that every blob
        header binds the engine's description and kvtier's pool geometry both."""
        shard = identity.anchor.shard
        return cls(
            identity.model, scheme=identity.scheme, shards={pool: shard} if shard is not None else {},
            extra=(f"{identity.scheme}-identity={identity.digest().hex()}",),
        )

    def page_identity(self, group: PoolGroup, pool: str, *, extra: Iterable[str] = ()) -> PageIdentity:
        """`PageIdentity.for_pool` of anchor ``pool`` with this engine's fields
        (``extra`` appended to the engine's)."""
        return PageIdentity.for_pool(
            group, pool, model=self.model, scheme=self.scheme, shards=self.shards, formats=self.formats,
            extra=(*self.extra, *extra),
        )
