"""Merging the transfers of a batch, and deriving sidecar rows: pure functions.

Transfers are grouped by the key ``(name, indices_from_pool)`` and concatenated
in operation order; each merged transfer keeps, per operation, where its part
lies, so results and failures go back to the right operation. Sidecar rows are
derived from the *merged* indices of their source (lazy binding): for every
whole source page ``p``, rows ``p*k .. p*k+k-1``, read from the first index of
each page.

Transfers that carry ``valid`` row counts (`PoolTransfer.valid`) are cut last,
after every sidecar is derived: of each page only its first ``valid`` rows
stay, on both sides alike, and the parts' offsets count the rows that stay.
Without any, nothing is cut and nothing is paid.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import InvalidIndices
from kvtier.pools import PageList, SidecarSpec, as_slot_tensor, slots_of_pages
from kvtier.transfers.operation import PoolTransfer

__all__ = ["MergedTransfer", "TransferPart", "cut_to_valid", "derive_sidecar_indices", "merge_transfers"]

_ARANGE: dict[int, torch.Tensor] = {}


def derive_sidecar_indices(source_indices: torch.Tensor, page_size: int, rows_per_page: int) -> torch.Tensor:
    """Rows of a sidecar for whole source pages: ``p*k + (0..k-1)`` per page ``p``.

    The page of each group of ``page_size`` indices is read from its first index.
    """
    pages = source_indices[::page_size] // page_size
    if rows_per_page == 1:
        return pages
    offsets = _ARANGE.get(rows_per_page)
    if offsets is None:
        offsets = _ARANGE[rows_per_page] = torch.arange(rows_per_page, dtype=torch.int64)
    return (pages[:, None] * rows_per_page + offsets).reshape(-1)


@dataclass(frozen=True, slots=True)
class TransferPart:
    """Rows ``start:stop`` of a merged transfer belong to operation ``operation``
    (its position in the batch)."""

    operation: int
    start: int
    stop: int


class MergedTransfer:
    """The rows of one pool (or one sidecar) that a batch copies, with where
    each operation's part lies: ``operations[i]`` owns rows
    ``offsets[i]:offsets[i + 1]``. `parts` gives them as `TransferPart` records
    (made on demand: a batch of 512 operations builds no record per operation)."""

    __slots__ = ("name", "indices_from_pool", "host_indices", "device_indices", "operations", "offsets")

    def __init__(
        self, name: str, indices_from_pool: str | None, host_indices: torch.Tensor, device_indices: torch.Tensor,
        operations: Sequence[int], offsets: Sequence[int],
    ) -> None:
        self.name = name
        self.indices_from_pool = indices_from_pool
        self.host_indices = host_indices
        self.device_indices = device_indices
        self.operations = operations
        self.offsets = offsets

    @property
    def parts(self) -> tuple[TransferPart, ...]:
        o = self.offsets
        return tuple(TransferPart(op, o[i], o[i + 1]) for i, op in enumerate(self.operations))

    @property
    def rows(self) -> int:
        return int(self.host_indices.numel())

    def __repr__(self) -> str:
        return f"<MergedTransfer {self.name!r} [{self.rows} rows of {len(self.operations)} operations]>"


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class _Pool:
    """A pool's merged transfer while it is being built.

    While every piece is a `PageList` of one page size (what the scheduler
    builds), both sides are kept as lists of page numbers and made into
    tensors once, at the end: no tensor per operation. A tensor piece (a
    caller of the executor API) turns both sides into lists of tensors.
    """

    __slots__ = ("host_pages", "device_pages", "page_size", "host_tensors", "device_tensors", "operations", "offsets")

    def __init__(self, page_size: int) -> None:
        self.host_pages: list[int] | None = []
        self.device_pages: list[int] = []
        self.page_size = page_size
        self.host_tensors: list[torch.Tensor] = []
        self.device_tensors: list[torch.Tensor] = []
        self.operations: list[int] = []
        self.offsets = [0]

    def add_tensors(self, host: torch.Tensor | PageList, device: torch.Tensor | PageList) -> int:
        if self.host_pages is not None:
            if self.host_pages:
                self.host_tensors.append(slots_of_pages(self.host_pages, self.page_size))
                self.device_tensors.append(slots_of_pages(self.device_pages, self.page_size))
            self.host_pages = None
        h = as_slot_tensor(host)
        self.host_tensors.append(h)
        self.device_tensors.append(as_slot_tensor(device))
        return int(h.numel())

    def merged(self, name: str) -> MergedTransfer:
        if self.host_pages is not None:
            host = slots_of_pages(self.host_pages, self.page_size)
            device = slots_of_pages(self.device_pages, self.page_size)
        else:
            host, device = _cat(self.host_tensors), _cat(self.device_tensors)
        return MergedTransfer(name, None, host, device, self.operations, self.offsets)

    def sidecar_rows(self, m: MergedTransfer, source_page_size: int, k: int, carried: Sequence[int] | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Host and device rows of a sidecar (``k`` rows per source page) for
        the parts ``carried`` (indices into the parts; all when None)."""
        ps, o = source_page_size, self.offsets
        if self.host_pages is not None and self.page_size == ps:
            if carried is None:
                return slots_of_pages(self.host_pages, k), slots_of_pages(self.device_pages, k)
            runs = [(o[i] // ps, o[i + 1] // ps) for i in carried]
            return (slots_of_pages([q for a, b in runs for q in self.host_pages[a:b]], k),
                    slots_of_pages([q for a, b in runs for q in self.device_pages[a:b]], k))
        if carried is None:
            return derive_sidecar_indices(m.host_indices, ps, k), derive_sidecar_indices(m.device_indices, ps, k)
        return (_cat([derive_sidecar_indices(m.host_indices[o[i]:o[i + 1]], ps, k) for i in carried]),
                _cat([derive_sidecar_indices(m.device_indices[o[i]:o[i + 1]], ps, k) for i in carried]))


def merge_transfers(
    operations: Sequence[Sequence[PoolTransfer]],
    sidecars: Mapping[str, SidecarSpec],
) -> tuple[MergedTransfer, ...]:
    """Merge the transfers of ``operations`` (in batch order) by
    ``(name, indices_from_pool)``; derive sidecar rows from merged sources.

    Raises ValueError when a derived transfer's source is not in the batch or
    is not the sidecar's registered source.
    """
    owned: dict[str, _Pool] = {}
    derived: dict[tuple[str, str], list[int]] = {}
    valid: dict[tuple[str, str | None], dict[int, Sequence[int]]] | None = None
    for op_index, transfers in enumerate(operations):
        for t in transfers:
            if t.valid is not None:
                if t.indices_from_pool is None and not isinstance(t.host_indices, PageList):
                    raise InvalidIndices(
                        f"transfer {t.name!r} carries valid row counts per page; its indices must be PageLists"
                    )
                if valid is None:
                    valid = {}
                valid.setdefault((t.name, t.indices_from_pool), {})[op_index] = t.valid
            if t.indices_from_pool is not None:
                derived.setdefault((t.name, t.indices_from_pool), []).append(op_index)
                continue
            h, d = t.host_indices, t.device_indices
            assert h is not None and d is not None  # built so by the scheduler
            pool = owned.get(t.name)
            if pool is None:
                pool = owned[t.name] = _Pool(h.page_size if isinstance(h, PageList) else 0)
            pages = pool.host_pages
            if (pages is not None and type(h) is PageList and type(d) is PageList
                    and h.page_size == d.page_size == pool.page_size):
                pages.extend(h.pages)
                pool.device_pages.extend(d.pages)
                n = len(h.pages) * pool.page_size
            else:
                n = pool.add_tensors(h, d)
            pool.operations.append(op_index)
            pool.offsets.append(pool.offsets[-1] + n)

    merged = []
    built: dict[str, tuple[MergedTransfer, _Pool]] = {}
    for name, pool in owned.items():
        m = pool.merged(name)
        merged.append(m)
        built[name] = (m, pool)
    for (name, source), op_indices in derived.items():
        spec = sidecars.get(name)
        if spec is None or spec.source != source:
            raise InvalidIndices(f"transfer {name!r} derives from {source!r}, which is not its registered source")
        entry = built.get(source)
        wanted = set(op_indices)
        missing = wanted - set(entry[0].operations) if entry is not None else wanted
        if missing:
            raise InvalidIndices(
                f"operation {min(missing)} carries sidecar {name!r} without its source {source!r}; "
                "a sidecar's rows derive from its source's indices in the same operation"
            )
        assert entry is not None
        src, pool = entry
        ps, k = spec.source_page_size, spec.rows_per_page
        if len(wanted) == len(src.operations):
            # Every operation of the source carries the sidecar: derive in one go.
            host, device = pool.sidecar_rows(src, ps, k, None)
            side_ops: Sequence[int] = src.operations
            side_offsets: Sequence[int] = [x // ps * k for x in src.offsets]
        else:
            carried = [i for i, op in enumerate(src.operations) if op in wanted]
            host, device = pool.sidecar_rows(src, ps, k, carried)
            o = src.offsets
            side_ops = [src.operations[i] for i in carried]
            side_offsets = list(itertools.accumulate(((o[i + 1] - o[i]) // ps * k for i in carried), initial=0))
        merged.append(MergedTransfer(name, source, host, device, side_ops, side_offsets))
    if valid is not None:
        for i, m in enumerate(merged):
            counts = valid.get((m.name, m.indices_from_pool))
            if counts is not None:
                if m.indices_from_pool is None:
                    per_page = owned[m.name].page_size
                else:
                    per_page = sidecars[m.name].rows_per_page
                merged[i] = cut_to_valid(m, counts, per_page)
    return tuple(merged)


def cut_to_valid(m: MergedTransfer, valid: Mapping[int, Sequence[int]], rows_per_page: int) -> MergedTransfer:
    """``m`` with only the rows that hold data: of the parts of the operations
    in ``valid`` (operation -> count per page of ``rows_per_page`` rows), the
    first ``valid[op][j]`` rows of page ``j``; the other parts whole.

    Raises ValueError for a count per page that is not an int in
    ``0 .. rows_per_page``, or a number of counts that is not the part's pages.
    """
    o = m.offsets
    keep: list[int] = []
    offsets = [0]
    for i, op in enumerate(m.operations):
        a, b = o[i], o[i + 1]
        counts = valid.get(op)
        if counts is None:
            keep.extend(range(a, b))
        else:
            if len(counts) * rows_per_page != b - a:
                raise InvalidIndices(
                    f"transfer {m.name!r} of operation {op} has {(b - a) // rows_per_page} pages of "
                    f"{rows_per_page} rows and {len(counts)} valid row counts; one count per page"
                )
            for j, n in enumerate(counts):
                if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= rows_per_page:
                    raise InvalidIndices(
                        f"transfer {m.name!r} page {j} of operation {op}: valid rows must be an int in "
                        f"0..{rows_per_page}; got {n!r}"
                    )
                start = a + j * rows_per_page
                keep.extend(range(start, start + n))
        offsets.append(len(keep))
    if len(keep) == m.rows:
        return m
    rows = torch.tensor(keep, dtype=torch.int64)
    return MergedTransfer(m.name, m.indices_from_pool, m.host_indices[rows], m.device_indices[rows],
                          m.operations, offsets)
