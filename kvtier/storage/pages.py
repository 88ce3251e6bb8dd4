"""Pages of host pools as bytes, and back: the storage tier's wire format.

A *blob* is ``count`` rows of one `HostPool` starting at row ``start``: for
each plane in order, the ``[num_layers, count, *plane.shape]`` C-contiguous
array of the plane's dtype, native byte order. The format does not depend on
the pool's layout (``layer_first`` and ``page_first`` pools give the same
bytes for the same rows), and its length is ``count * host.slot_nbytes``.

A stored *page* is one page of an anchor pool together with the rows each of
its sidecars derives from that page (``p*k .. p*k+k-1`` for page ``p``,
``k = rows_per_page``): `encode_page` gives one blob per pool with bytes (a
logical anchor has none), `decode_page` writes them back. Both are plain
synchronous functions that copy memory: run them in a worker thread (the
scheduler's executor thread), never on the event loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from kvtier.errors import ConfigurationError, InvalidIndices
from kvtier.pools import HostPool, PoolGroup
from kvtier.storage.base import Buffer
from kvtier.storage.errors import StorageError

__all__ = ["decode_page", "encode_page", "pack_rows", "page_members", "unpack_rows"]

# torch.frombuffer warns (once per process, then never again) when it wraps a
# read-only buffer such as the ``bytes`` a store returns; unpack_rows only
# reads from it. Take that one warning here, at import, where no other thread
# can race on the warnings filters.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)


def _check_rows(host: HostPool, start: int, count: int) -> None:
    if not getattr(host, "has_bytes", False):
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
    """Rows ``start .. start+count-1`` of every layer and plane of ``host``, as one blob.

    Writes into ``out`` (a writable buffer of exactly ``count * host.slot_nbytes``
    bytes) when given, else into a new ``bytearray``; returns the buffer.
    Raises `InvalidIndices` for rows out of range, `ConfigurationError` for a
    pool without bytes, `ValueError` for an ``out`` of the wrong size.
    """
    _check_rows(host, start, count)
    nbytes = count * host.slot_nbytes
    buf = bytearray(nbytes) if out is None else out
    if len(memoryview(buf).cast("B")) != nbytes:
        raise ValueError(f"pool {host.name!r}: {count} rows need a {nbytes}-byte buffer; got {len(memoryview(buf).cast('B'))}")
    dst = torch.frombuffer(buf, dtype=torch.uint8)
    offset = 0
    for p in range(len(host.planes)):
        src = _plane_rows(host, p, start, count)
        n = src.numel()
        dst[offset:offset + n].view(src.shape).copy_(src)
        offset += n
    return buf


def unpack_rows(host: HostPool, start: int, count: int, data: Buffer) -> None:
    """Write a blob made by `pack_rows` back into rows ``start .. start+count-1``.

    Byte-exact: every row of every layer and plane gets the bytes it had when
    packed. Raises `StorageError` (and writes nothing) when ``data`` is not
    ``count * host.slot_nbytes`` bytes long, `InvalidIndices` for rows out of range.
    """
    _check_rows(host, start, count)
    nbytes = count * host.slot_nbytes
    view = memoryview(data).cast("B")
    if len(view) != nbytes:
        raise StorageError(
            f"pool {host.name!r}: a blob of {count} rows must be {nbytes} bytes; got {len(view)}",
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


def encode_page(group: PoolGroup, pool: str, page: int) -> dict[str, bytearray | memoryview]:
    """One blob per pool with bytes for host page ``page`` of anchor ``pool``
    (the anchor's rows and each sidecar's derived rows). See `page_members`
    for the errors."""
    return {name: pack_rows(host, start, count) for name, (host, start, count) in page_members(group, pool, page).items()}


def decode_page(group: PoolGroup, pool: str, page: int, blobs: Mapping[str, Buffer]) -> None:
    """Write blobs made by `encode_page` into host page ``page`` of ``pool`` and
    its sidecars' rows. Checks every blob before writing any: raises
    `StorageError` if a pool's blob is missing, extra or of the wrong length,
    and then no row was written."""
    members = page_members(group, pool, page)
    if set(blobs) != set(members):
        raise StorageError(
            f"page {page} of pool {pool!r} needs blobs for {sorted(members)}; got {sorted(blobs)}",
            operation="decode",
        )
    for name, (host, _start, count) in members.items():
        got = len(memoryview(blobs[name]).cast("B"))
        if got != count * host.slot_nbytes:
            raise StorageError(
                f"pool {name!r}: a blob of {count} rows must be {count * host.slot_nbytes} bytes; got {got}",
                operation="decode",
            )
    for name, (host, start, count) in members.items():
        unpack_rows(host, start, count, blobs[name])
