"""Pages of host pools as bytes, and back: the storage tier's wire format.

*Rows*: `pack_rows` gives ``count`` rows of one `HostPool` starting at row
``start``: for each plane in order, the ``[num_layers, count, *plane.shape]``
C-contiguous array of the plane's dtype, native byte order; `unpack_rows`
writes them back. The bytes do not depend on the pool's layout
(``layer_first`` and ``page_first`` pools give the same bytes for the same
rows), and there are ``count * host.slot_nbytes`` of them. No header, no check.

A stored *page* is one page of an anchor pool together with the rows each of
its sidecars derives from that page (``p*k .. p*k+k-1`` for page ``p``,
``k = rows_per_page``), stored under its page key: `encode_page` gives one
*blob* per pool with bytes (a logical anchor has none), each a
`BLOB_HEADER_BYTES` header and then the pool's rows as `pack_rows` gives
them. The header (little-endian) holds::

    0   4  b"KVTB", kvtier's blob tag
    4   1  blob format version (3)
    5   3  zero
    8   8  length of the rows that follow, in bytes
    16  8  the identity's tag for this pool: `PageIdentity.tag` (BLAKE2b-64 of
           the page identity's digest and the pool's name)
    24  8  the key's tag: xxh3-64 of the page key the blob was written under
    32  8  checksum: xxh3-64 over bytes 0..31, the page key, then the rows

The page identity (`kvtier.storage.identity`) is everything that gives the
rows their meaning: the model, the key scheme, and for each pool of the page
its role, kind, layout, rows per page, layer count, plane shapes, true
element formats and shard. `encode_page` / `decode_page` take it
(``identity=``; without one, the group's geometry under `ANONYMOUS_MODEL`),
so a page written by an engine of another page size, layout, format, shard
or model is refused by its tag (rule ``identity``) even under the same key.

A page whose rows do not all hold data (`PoolGroup.valid_rows`: a window
or buffer that does not fill its page, a sidecar page with fewer entries
than rows) stores only its valid rows, from the page's first: the length in
the header says how many (a whole number of rows, at most the page's), and
`decode_page` writes those rows and no other, and says how many it wrote.

So a blob is bound to what it claims to be: its identity and pool, its page
key and its rows (their count included: the length is in the checksummed
header). A blob copied under another key, or another page's blob spliced into
a page (a store bug, a migration, a copy tool), fails like a flipped byte; a
blob of format version 1 (a SHA-1 checksum over header and rows only, no key)
or 2 (a pool tag of the name alone, no identity) is refused by its version:
a miss, which the next write of the page replaces. `decode_page` checks every blob of the page (the
set of pools, tag, version, identity and pool, key, length, checksum) before it writes any
row, and raises `PageCorrupted` naming the pool and the rule when one fails:
bytes that do not belong to this page never reach a host pool, not even in
part. Both are plain synchronous functions that copy and hash memory, each
byte hashed once, right after it is copied (encode) or before (decode): run
them in a worker thread (the scheduler's executor thread), never on the event
loop.
"""

from __future__ import annotations

import struct
import warnings
import weakref
from collections.abc import Mapping

import torch
import xxhash

from kvtier.errors import ConfigurationError, InvalidIndices
from kvtier.pools import HostPool, LogicalHostPool, PoolGroup
from kvtier.storage.base import Buffer, check_key
from kvtier.storage.errors import PageCorrupted, StorageError
from kvtier.storage.identity import ANONYMOUS_MODEL, PageIdentity

__all__ = [
    "BLOB_HEADER_BYTES", "decode_page", "encode_page", "pack_rows", "page_identity", "page_members", "unpack_rows",
]

_HEADER = struct.Struct("<4sB3sQ8sQQ")
BLOB_HEADER_BYTES = _HEADER.size
"""Bytes of the header before a stored blob's rows (40)."""
_MAGIC = b"KVTB"
_FORMAT_VERSION = 3  # 3: the identity's tag; 2: the key's tag, xxh3-64 over header, key and rows (1: SHA-1/64, no key)
_DIGEST = struct.Struct("<Q")
_CHECKED = 32  # header bytes the checksum covers: all but the checksum itself
# The checksum: xxh3-64 (the ``xxhash`` package, which lets the GIL go while it
# hashes). Measured here with benchmarks/hash_speed.py (Intel Xeon, 2 cores shared
# with four other sessions' tests, Python 3.11, xxhash 4.1; 4 MiB buffer, best
# of 5, two runs): xxh3-64 12.5-26 GB/s, crc32c (google-crc32c 1.9, its C
# build) 4.2-5.9 GB/s, SHA-1 cut to 64 bits (the format before) 0.5-1.0 GB/s.
# A page is hashed on write and again on read, so the hash must cost far less
# than the store; xxh3 is also 64 bits wide (a change of any shape slips
# through with probability ~2**-64, not only bursts as with a 32-bit CRC). It
# guards against accidents, not against an attacker, as SHA-1/64 did.

# torch.frombuffer warns (once per process, then never again) when it wraps a
# read-only buffer such as the ``bytes`` a store returns; unpack_rows only
# reads from it. Take that one warning here, at import, where no other thread
# can race on the warnings filters.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)


def _check_rows(caller: str, host: HostPool, start: int, count: int) -> None:
    if not isinstance(host, (HostPool, LogicalHostPool)):
        raise ConfigurationError(f"{caller} needs a HostPool (a pool's .host); got {host!r:.80}")
    if not host.has_bytes:
        raise ConfigurationError(f"pool {host.name!r} holds no bytes; there is nothing to store")
    if isinstance(start, bool) or isinstance(count, bool) or not isinstance(start, int) or not isinstance(count, int):
        raise InvalidIndices(
            f"pool {host.name!r} rows need integer start and count; got start={start!r}, count={count!r}",
            pool=host.name, rule="integer rows",
        )
    if count < 1 or start < 0 or start + count > host.slots:
        raise InvalidIndices(
            f"pool {host.name!r} has rows 0..{host.slots - 1}; got {count} rows starting at {start}",
            pool=host.name, rule="rows in range",
        )


def _plane_rows(host: HostPool, plane: int, start: int, count: int) -> torch.Tensor:
    """``[num_layers, count, *shape]`` view of rows ``start..start+count-1``, as
    bytes (a trailing dimension of ``itemsize``): no copy, strided for page_first."""
    buf = host.buffer(plane)
    rows = buf[:, start:start + count] if host.layout == "layer_first" else buf[start:start + count].transpose(0, 1)
    # unsqueeze gives a last dimension of stride 1 whatever the plane's shape,
    # so viewing it as uint8 is always allowed and still aliases the buffer.
    return rows.unsqueeze(-1).view(torch.uint8)


def pack_rows(host: HostPool, start: int, count: int, out: bytearray | memoryview | None = None) -> bytearray | memoryview:
    """Rows ``start .. start+count-1`` of every layer and plane of ``host``, as
    raw bytes (no header: `encode_page` adds it).

    Writes into ``out`` (a writable buffer of exactly ``count * host.slot_nbytes``
    bytes) when given, else into a new ``bytearray``; returns the buffer.
    Raises `InvalidIndices` for rows out of range, `ConfigurationError` for
    ``host`` not a `HostPool`, a pool without bytes or an ``out`` of the wrong size.
    """
    _check_rows("pack_rows", host, start, count)
    nbytes = count * host.slot_nbytes
    buf = bytearray(nbytes) if out is None else out
    if len(memoryview(buf).cast("B")) != nbytes:
        raise ConfigurationError(f"pool {host.name!r}: {count} rows need a {nbytes}-byte buffer; got {len(memoryview(buf).cast('B'))}")
    dst = torch.frombuffer(buf, dtype=torch.uint8)
    offset = 0
    for p in range(len(host.planes)):
        src = _plane_rows(host, p, start, count)
        n = src.numel()
        dst[offset:offset + n].view(src.shape).copy_(src)
        offset += n
    return buf


def unpack_rows(host: HostPool, start: int, count: int, data: Buffer) -> None:
    """Write bytes made by `pack_rows` back into rows ``start .. start+count-1``
    (raw rows, no header: `decode_page` checks and strips it).

    Byte-exact: every row of every layer and plane gets the bytes it had when
    packed. Raises `StorageError` (and writes nothing) when ``data`` is not
    ``count * host.slot_nbytes`` bytes long, `InvalidIndices` for rows out of range.
    """
    _check_rows("unpack_rows", host, start, count)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ConfigurationError(f"unpack_rows needs data as bytes (a buffer pack_rows made); got {data!r:.80}")
    nbytes = count * host.slot_nbytes
    view = memoryview(data).cast("B")
    if len(view) != nbytes:
        raise StorageError(
            f"pool {host.name!r}: {count} rows are {nbytes} bytes; got {len(view)}",
            operation="decode",
        )
    src = torch.frombuffer(view, dtype=torch.uint8)
    offset = 0
    for p in range(len(host.planes)):
        dst = _plane_rows(host, p, start, count)
        n = dst.numel()
        dst.copy_(src[offset:offset + n].view(dst.shape))
        offset += n


def page_members(group: PoolGroup, pool: str, page: int) -> dict[str, tuple[HostPool, int, int]]:
    """The pools with bytes that page ``page`` of anchor ``pool`` covers:
    name -> (host pool, first row, row count). The anchor comes first (absent
    for a logical pool), then its sidecars by name.

    Raises `ConfigurationError` for an unknown pool or a sidecar, `InvalidIndices`
    for a page outside the anchor's host slots.
    """
    if pool not in group:
        raise ConfigurationError(f"pool {pool!r} is not registered (known: {sorted(group.names)})")
    anchor = group[pool]
    if anchor.sidecar is not None:
        raise ConfigurationError(f"pool {pool!r} is a sidecar; its rows are stored with its source {anchor.sidecar.source!r}")
    pages = anchor.host.slots // anchor.page_size
    if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < pages:
        raise InvalidIndices(
            f"pool {pool!r} has host pages 0..{pages - 1}; got page {page!r}", pool=pool, rule="page in range"
        )
    members: dict[str, tuple[HostPool, int, int]] = {}
    if isinstance(anchor.host, HostPool):
        members[pool] = (anchor.host, page * anchor.page_size, anchor.page_size)
    for side in sorted(group.sidecars_of(pool), key=lambda s: s.name):
        k = side.page_size  # a sidecar's page_size is its rows_per_page
        if isinstance(side.host, HostPool):  # always: sidecars hold bytes
            members[side.name] = (side.host, page * k, k)
    return members


_ANONYMOUS: weakref.WeakKeyDictionary[PoolGroup, dict[str, tuple[tuple[str, ...], PageIdentity]]] = (
    weakref.WeakKeyDictionary()
)


def page_identity(group: PoolGroup, pool: str, identity: PageIdentity | None = None) -> PageIdentity:
    """The identity of anchor ``pool``'s stored pages: ``identity`` once checked
    to hold the pools a page of ``pool`` holds, else the group's geometry under
    `ANONYMOUS_MODEL`. Raises `ConfigurationError` for an identity of other
    pools (or not a `PageIdentity`), and as `PageIdentity.for_pool`."""
    if identity is None:
        # Derived once per group and pool (a pool's record never changes once
        # registered; a sidecar added later changes the group's names).
        cache = _ANONYMOUS.setdefault(group, {})
        hit = cache.get(pool)
        if hit is not None and hit[0] == group.names:
            return hit[1]
        derived = PageIdentity.for_pool(group, pool, model=ANONYMOUS_MODEL)
        cache[pool] = (group.names, derived)
        return derived
    if not isinstance(identity, PageIdentity):
        raise ConfigurationError(f"identity must be a PageIdentity (kvtier.storage.identity); got {identity!r:.80}")
    if pool not in group:
        raise ConfigurationError(f"pool {pool!r} is not registered (known: {sorted(group.names)})")
    names = tuple(p.name for p in identity.pools)
    want = (pool, *sorted(s.name for s in group.sidecars_of(pool)))
    if names != want:
        raise ConfigurationError(
            f"the page identity of anchor {identity.anchor.name!r} holds pools {list(names)}; a page of pool "
            f"{pool!r} holds {list(want)}"
        )
    return identity


def encode_page(
    group: PoolGroup, pool: str, page: int, *, key: bytes, identity: PageIdentity | None = None
) -> dict[str, bytearray]:
    """One blob per pool with bytes for host page ``page`` of anchor ``pool``
    (the anchor's rows and each sidecar's derived rows), each with its header
    and checksum bound to ``key``, the page key it is stored under, and to
    ``identity`` (see `page_identity`; the module doc). Deterministic: the
    same rows, key and identity give the same bytes.
    Raises `ValueError` for a key that is not 1..256 bytes; see `page_members`
    and `page_identity` for the other errors."""
    check_key(key)
    ident = page_identity(group, pool, identity)
    valid_rows = group.valid_rows
    out = {}
    for name, (host, start, count) in page_members(group, pool, page).items():
        table = valid_rows.get(name) if valid_rows else None
        out[name] = _seal(ident.tag(name), host, start, count if not table else table.get(page, count), key)
    return out


def decode_page(
    group: PoolGroup,
    pool: str,
    page: int,
    blobs: Mapping[str, Buffer],
    *,
    key: bytes,
    identity: PageIdentity | None = None,
) -> dict[str, int]:
    """Write blobs made by `encode_page` into host page ``page`` of ``pool`` and
    its sidecars' rows, byte-exact. ``key`` is the page key the blobs were
    read under, ``identity`` the page identity this engine reads them as (see
    `page_identity`). Returns the rows written per pool: a blob of a partial
    page fills only its valid rows, from the page's first; the caller records
    the counts (`PoolGroup.valid_rows`) so that the page then moves only those.

    Checks every blob before writing any row, and raises `PageCorrupted` (no
    row written) when the page has a blob missing or extra, or a blob has no
    kvtier header, another format version, another identity's tag (written
    by an engine of another model, page size, layout, format or shard: rule
    ``identity``), another pool's tag, another key's tag (a blob written under
    another key: copied or spliced in), the wrong length, or a checksum that
    does not match its header, ``key`` and rows.
    `ValueError` for a bad ``key``; `StorageError` for ``blobs`` that is not a
    mapping of pool name to bytes; `page_members`'s and `page_identity`'s
    errors for a bad pool, page or identity.
    """
    check_key(key)
    if not isinstance(blobs, Mapping):
        raise StorageError(
            f"decode_page needs blobs as a mapping of pool name to bytes (as a store's get returns); "
            f"got {type(blobs).__name__} {blobs!r:.80}",
            operation="decode",
        )
    members = page_members(group, pool, page)
    ident = page_identity(group, pool, identity)
    where = f"page {page} of pool {pool!r} (key {key.hex()})"
    if set(blobs) != set(members):
        missing, extra = sorted(set(members) - set(blobs)), sorted(set(blobs) - set(members), key=repr)
        raise PageCorrupted(
            f"{where} needs blobs for {sorted(members)}; got {sorted(blobs, key=repr)}"
            + (f" (missing {missing})" if missing else "") + (f" (extra {extra})" if extra else ""),
            pool=pool, rule="pools", anchor=pool, page=page, key=key,
        )
    rows = {
        name: _checked_rows(name, host.slot_nbytes, count, blobs[name], ident, where=where, anchor=pool, page=page,
                            key=key)
        for name, (host, _start, count) in members.items()
    }
    written = {}
    for name, (host, start, _count) in members.items():
        n = len(rows[name]) // host.slot_nbytes
        if n:
            unpack_rows(host, start, n, rows[name])
        written[name] = n
    return written


def _key_tag(key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(key)


def _checksum(header: memoryview, key: bytes, rows: memoryview) -> int:
    h = xxhash.xxh3_64(header)
    h.update(key)
    h.update(rows)
    return h.intdigest()


def _seal(tag: bytes, host: HostPool, start: int, count: int, key: bytes) -> bytearray:
    """A pool's blob (``tag``: the identity's tag for it): header, then its rows packed right behind it (one copy)."""
    nbytes = count * host.slot_nbytes
    blob = bytearray(BLOB_HEADER_BYTES + nbytes)
    view = memoryview(blob)
    if count:  # a page with no valid row of this pool: a header alone
        pack_rows(host, start, count, view[BLOB_HEADER_BYTES:])
    _HEADER.pack_into(blob, 0, _MAGIC, _FORMAT_VERSION, bytes(3), nbytes, tag, _key_tag(key), 0)
    _DIGEST.pack_into(blob, _CHECKED, _checksum(view[:_CHECKED], key, view[BLOB_HEADER_BYTES:]))
    return blob


def _checked_rows(
    name: str,
    row_nbytes: int,
    count: int,
    data: Buffer,
    identity: PageIdentity,
    *,
    where: str,
    anchor: str,
    page: int,
    key: bytes,
) -> memoryview:
    """The rows of pool ``name``'s blob (at most ``count`` rows of
    ``row_nbytes`` each: a page's valid rows), once every check passed."""
    view = memoryview(data).cast("B")

    def corrupted(rule: str, detail: str) -> PageCorrupted:
        return PageCorrupted(f"{where}: the blob of pool {name!r} {detail}", pool=name, rule=rule,
                             anchor=anchor, page=page, key=key)

    if len(view) < 5 or view[:4] != _MAGIC:
        raise corrupted(
            "header",
            f"does not start with kvtier's blob header {_MAGIC!r} (got {bytes(view[:8])!r}, {len(view)} bytes): "
            f"a blob of another format, or one written before blobs carried checksums",
        )
    version = view[4]
    if version != _FORMAT_VERSION:
        older = " (an older kvtier's page: a miss, which the next write of it replaces)" if version < _FORMAT_VERSION else ""
        raise corrupted("version", f"has blob format version {version}; this kvtier reads version {_FORMAT_VERSION}{older}")
    if len(view) < BLOB_HEADER_BYTES:
        raise corrupted("header", f"is {len(view)} bytes, shorter than kvtier's {BLOB_HEADER_BYTES}-byte blob header")
    _magic, _version, zero, length, tag, key_tag, digest = _HEADER.unpack_from(view)
    if zero != bytes(3):
        raise corrupted("header", f"has reserved header bytes {zero!r}; they must be zero")
    expected = identity.tag(name)
    if tag != expected:
        other = next((p.name for p in identity.pools if p.name != name and identity.tag(p.name) == tag), None)
        if other is not None:
            raise corrupted("pool", f"holds the rows of pool {other!r} (tag {tag.hex()}, expected {expected.hex()})")
        raise corrupted(
            "identity",
            f"was written under another page identity (tag {tag.hex()}, expected {expected.hex()} for model "
            f"{identity.model!r}, scheme {identity.scheme!r}, {identity.pool(name).rows} rows per page): an engine "
            f"of another model, page size, element format or shard wrote it",
        )
    if key_tag != _key_tag(key):
        raise corrupted(
            "key",
            f"was written under another page key (key tag {key_tag:016x}, expected {_key_tag(key):016x}): "
            f"another page's bytes, copied under this key or spliced into this page",
        )
    nbytes = count * row_nbytes
    if length > nbytes or length % row_nbytes or len(view) != BLOB_HEADER_BYTES + length:
        raise corrupted(
            "length",
            f"must hold up to {count} rows of {row_nbytes} bytes ({nbytes} bytes) after its {BLOB_HEADER_BYTES}-byte "
            f"header, a whole number of them; its header says {length} and it holds {len(view) - BLOB_HEADER_BYTES}",
        )
    rows = view[BLOB_HEADER_BYTES:]
    actual = _checksum(view[:_CHECKED], key, rows)
    if actual != digest:
        raise corrupted("checksum", f"does not match its checksum (stored {digest:016x}, computed {actual:016x}): "
                                    f"its bytes changed in the store")
    return rows
