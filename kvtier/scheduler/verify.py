"""Verify mode: a checksum per host page and pool, recorded at backup and
checked before a load copies anything.

For a slot-owning pool a page is its ``page_size`` host rows; for a sidecar it
is the ``rows_per_page`` rows that one source page maps to. The checksum covers
every layer and plane, and weighs each 32-bit word by its position, so a
changed, swapped or shifted word changes it. These functions read host memory
and run in a worker thread, never on the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from kvtier.pools import PoolGroup

__all__ = ["corrupted", "mismatches", "page_checksums", "pools_with_bytes", "record"]

_WEIGHTS: dict[int, torch.Tensor] = {}


def _weights(n: int) -> torch.Tensor:
    w = _WEIGHTS.get(n)
    if w is None:
        w = _WEIGHTS[n] = torch.arange(1, n + 1, dtype=torch.int64) * 2654435761
    return w


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
    """One checksum per page of ``pool``'s host rows (pages of its slot owner)."""
    spec = group[pool]
    rows_per_page = spec.page_size  # rows_per_page for a sidecar
    host = spec.host
    offsets = torch.arange(rows_per_page)
    rows = (torch.tensor(pages, dtype=torch.int64)[:, None] * rows_per_page + offsets).reshape(-1)
    total = torch.zeros(len(pages), dtype=torch.int64)
    for layer in range(host.num_layers):
        for plane in range(len(host.planes)):
            data = host.layer_view(layer, plane).index_select(0, rows).contiguous()
            words = data.view(torch.uint8).reshape(len(pages), -1)
            if words.shape[1] % 4 == 0:
                words = words.view(torch.int32)
            words = words.to(torch.int64)
            page_sum = (words * _weights(words.shape[1])).sum(dim=1)
            total = total * 1000003 + page_sum  # int64 arithmetic wraps; fine for a checksum
    return total.tolist()


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
