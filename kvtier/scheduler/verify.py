"""Verify mode: a checksum per host page and pool, recorded at backup and
checked before a load copies anything.

For a slot-owning pool a page is its ``page_size`` host rows; for a sidecar it
is the ``rows_per_page`` rows that one source page maps to; of a page that
holds fewer valid rows (`PoolGroup.valid_rows`), only those: the checksum
covers the rows a copy moves, and the count is part of what it binds. The checksum is
xxh3-64 (the ``xxhash`` package, as stored pages use) over the page's bytes
of every plane and layer in one stream, in the pool's memory order, read in
place (no copy): a changed byte, two rows swapped within the page or a layer's
bytes swapped with another's all change it (but with probability ~2**-64).
These functions read host memory and run in a worker thread, never on the
event loop.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping, Sequence

import torch
import xxhash

from kvtier.pools import HostPool, PoolGroup

__all__ = ["corrupted", "mismatches", "page_checksums", "pools_with_bytes", "record"]


def pools_with_bytes(group: PoolGroup, owners: Iterable[str]) -> list[tuple[str, str]]:
    """``(pool, owner)`` for every pool holding bytes that moves with ``owners``:
    the owner itself (unless it is a logical pool) and its sidecars."""
    out = []
    for owner in owners:
        if group[owner].host.has_bytes:
            out.append((owner, owner))
        out.extend((side.name, owner) for side in group.sidecars_of(owner))
    return out


def page_checksums(group: PoolGroup, pool: str, pages: list[int]) -> list[int]:
    """One checksum per page of ``pool``'s host rows (pages of its slot owner):
    xxh3-64 over the page's rows of each plane, layer by layer for
    ``layer_first`` (one run of rows per layer) and at once for ``page_first``
    (a page's rows hold every layer)."""
    spec = group[pool]
    k = spec.page_size  # rows_per_page for a sidecar
    host = spec.host
    if not isinstance(host, HostPool):  # a logical pool: no bytes, nothing to hash
        return [0] * len(pages)
    buffers = [host.buffer(plane) for plane in range(len(host.planes))]
    layer_first = host.layout == "layer_first"
    views = [_bytes_of(buf) if buf.is_contiguous() else None for buf in buffers]
    valid = group.valid_rows.get(pool)
    full = k
    out = []
    for page in pages:
        h = xxhash.xxh3_64()
        start = page * full
        k = full if not valid else valid.get(page, full)
        if k != full:
            h.update(k.to_bytes(8, "little"))  # a page cut shorter or longer does not hash alike
        for buf, whole in zip(buffers, views):
            if whole is None:  # not one block of memory: slice in torch (a copy per run)
                if layer_first:
                    for layer in range(buf.shape[0]):
                        h.update(_bytes_of(buf[layer, start:start + k]))
                else:
                    h.update(_bytes_of(buf[start:start + k]))
                continue
            # One block: the page's runs are byte ranges of it, sliced without a torch call.
            size = buf.element_size()
            if layer_first:  # [layers, slots, ...]: one run of k rows per layer
                layer_bytes, row_bytes = buf.stride(0) * size, buf.stride(1) * size
                first, n = start * row_bytes, k * row_bytes
                for layer in range(buf.shape[0]):
                    at = layer * layer_bytes + first
                    h.update(whole[at:at + n])
            else:  # [slots, layers, ...]: the page's rows hold every layer, one run
                row_bytes = buf.stride(0) * size
                h.update(whole[start * row_bytes:(start + k) * row_bytes])
        out.append(h.intdigest())
    return out


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of CPU tensor ``t`` in memory order: in place when it is
    contiguous (a host pool's runs of rows are), else from a contiguous copy
    that the view keeps alive."""
    if not t.is_contiguous():
        t = t.contiguous()
    n = t.numel() * t.element_size()
    if not n:
        return memoryview(b"")
    raw = (ctypes.c_char * n).from_address(t.data_ptr())
    raw._kvtier_keep = t  # type: ignore[attr-defined]  # the view must not outlive the tensor
    return memoryview(raw).cast("B")


def record(group: PoolGroup, host_pages: Mapping[str, list[int]]) -> dict[str, dict[int, int]]:
    """Checksums of an operation's pages, by pool and page."""
    return {
        pool: dict(zip(host_pages[owner], page_checksums(group, pool, host_pages[owner])))
        for pool, owner in pools_with_bytes(group, host_pages)
    }


def mismatches(
    store: Mapping[str, Mapping[int, int]], group: PoolGroup, host_pages: Mapping[str, list[int]]
) -> tuple[str, list[int]] | None:
    """The first pool whose pages differ from ``store`` and those pages, or None.

    Only pages with a recorded checksum are checked: a page written while
    verify mode was off (by another scheduler over the group) has none, and a
    page's checksum goes when the page is freed (`HostPageOwnership`)."""
    for pool, owner in pools_with_bytes(group, host_pages):
        expected = store.get(pool, {})
        pages = [p for p in host_pages[owner] if p in expected]
        if not pages:
            continue
        now = page_checksums(group, pool, pages)
        bad = [p for p, c in zip(pages, now) if expected[p] != c]
        if bad:
            return pool, bad
    return None


def corrupted(
    store: Mapping[str, Mapping[int, int]], group: PoolGroup, operations: Sequence[Mapping[str, list[int]]]
) -> list[tuple[int, str, list[int]]]:
    """The operations (given by their host pages) whose pages no longer match
    ``store``: each as its index in ``operations``, the first pool that
    differs and its pages."""
    found = []
    for index, host_pages in enumerate(operations):
        bad = mismatches(store, group, host_pages)
        if bad is not None:
            found.append((index, *bad))
    return found
