"""Hand-written torch copies of a set of cache rows: the benchmark's baselines.

A `Side` is one end of a copy: per plane either one buffer, ``layer_first``
``[layers, slots, ...]`` or ``page_first`` ``[slots, layers, ...]`` (a device
pool whose per-layer tensors are views of one ``[layers, slots, ...]`` buffer
is a ``layer_first`` side, which is what lets a copy span all layers at once),
or ``per_layer``: a separate tensor per layer, as most engines allocate (no
copy can span the layers then). A `RowCopy` moves rows ``src_idx[i]`` of every
layer and plane of its source to rows ``dst_idx[i]`` of its destination; its
runs (consecutive on both sides) and whether either index set is one
contiguous range are worked out once, in `RowCopy.__init__`, outside any
timing: a hand-written copy knows its indices.

`RAW_METHODS` are the candidates for "raw best", each a plain function of a
`RowCopy`; `raw_methods_for` keeps those that apply to a copy's two sides
(a copy across all layers needs both sides in one buffer per plane). Every
one of them writes the same bytes (tests check it).
`Ceiling` is one contiguous ``copy_`` of the same number of bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "RAW_METHODS",
    "Ceiling",
    "RowCopy",
    "Side",
    "copy_gather_all_layers",
    "copy_index_per_layer",
    "copy_slices",
    "copy_slices_all_layers",
    "copy_stack_all_layers",
    "copy_staged_all_layers",
    "index_runs",
    "raw_methods_for",
]

LAYOUTS = ("layer_first", "page_first", "per_layer")


@dataclass(frozen=True, slots=True, eq=False)
class Side:
    """One end of a copy. ``layer_first``/``page_first``: ``planes`` holds one
    buffer per plane; ``per_layer``: ``layers`` holds, per plane, a separate
    ``[slots, ...]`` tensor per layer (see `Side.per_layer`)."""

    planes: tuple[torch.Tensor, ...]
    layout: str
    layers: tuple[tuple[torch.Tensor, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}; got {self.layout!r}")
        if (self.layout == "per_layer") != bool(self.layers):
            raise ValueError("a per_layer side has per-layer tensors and no plane buffers; other sides the reverse")

    @classmethod
    def per_layer(cls, layers: tuple[tuple[torch.Tensor, ...], ...]) -> Side:
        """A side of separate tensors: ``layers[plane][layer]`` is ``[slots, ...]``."""
        return cls((), "per_layer", layers)

    @property
    def stacked(self) -> bool:
        """Whether every plane is one buffer (a copy can span all layers)."""
        return self.layout != "per_layer"

    @property
    def num_planes(self) -> int:
        return len(self.layers) if self.layers else len(self.planes)

    @property
    def slot_dim(self) -> int:
        return 1 if self.layout == "layer_first" else 0

    @property
    def num_layers(self) -> int:
        if self.layers:
            return len(self.layers[0])
        return int(self.planes[0].shape[1 - self.slot_dim])

    def layer(self, plane: int, layer: int) -> torch.Tensor:
        """``[slots, ...]`` rows of one layer and plane (strided for page_first)."""
        if self.layers:
            return self.layers[plane][layer]
        buf = self.planes[plane]
        return buf[layer] if self.layout == "layer_first" else buf[:, layer]

    def span(self, plane: int, start: int, n: int) -> torch.Tensor:
        """Rows ``start:start+n`` of every layer, as a ``[layers, n, ...]`` view
        (stacked sides only)."""
        buf = self.planes[plane]
        if self.layout == "layer_first":
            return buf[:, start : start + n]
        return buf[start : start + n].transpose(0, 1)


def index_runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal ``(src_start, dst_start, length)`` runs consecutive on both sides."""
    n = int(src.numel())
    if n == 0:
        return []
    if n == 1:
        return [(int(src[0]), int(dst[0]), 1)]
    step = (src[1:] - src[:-1] == 1) & (dst[1:] - dst[:-1] == 1)
    bounds = [0, *((~step).nonzero().flatten() + 1).tolist(), n]
    heads = bounds[:-1]
    return list(zip(src[heads].tolist(), dst[heads].tolist(), [b - a for a, b in zip(bounds[:-1], bounds[1:])]))


def _as_range(idx: torch.Tensor) -> int | None:
    """The first index when ``idx`` is one ascending contiguous range, else None."""
    n = int(idx.numel())
    first = int(idx[0])
    if n == 1 or bool((idx == torch.arange(first, first + n, dtype=idx.dtype)).all()):
        return first
    return None


class RowCopy:
    """Rows ``src_idx[i] -> dst_idx[i]`` of every layer and plane, planned once."""

    def __init__(self, src: Side, dst: Side, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
        if src_idx.numel() != dst_idx.numel() or src_idx.numel() == 0:
            raise ValueError(f"need equal, non-zero index counts; got {src_idx.numel()} and {dst_idx.numel()}")
        if src.num_planes != dst.num_planes or src.num_layers != dst.num_layers:
            raise ValueError("source and destination need the same planes and layers")
        self.src = src
        self.dst = dst
        self.src_idx = src_idx.to(torch.int64).contiguous()
        self.dst_idx = dst_idx.to(torch.int64).contiguous()
        self.rows = int(src_idx.numel())
        self.runs = index_runs(self.src_idx, self.dst_idx)
        self.src_start = _as_range(self.src_idx)
        self.dst_start = _as_range(self.dst_idx)
        # Staging for gathers across all layers, in the source's own order.
        self._staging: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        per_row = 0
        for p in range(self.src.num_planes):
            row = self.src.layer(p, 0)[0]
            per_row += row.numel() * row.element_size()
        return self.rows * self.src.num_layers * per_row

    def staging(self, plane: int) -> torch.Tensor:
        """A reusable buffer for one plane's gathered rows (allocated on first use)."""
        buf = self.src.planes[plane]
        shape = list(buf.shape)
        shape[self.src.slot_dim] = self.rows
        key = (tuple(shape), buf.dtype)
        st = self._staging.get(key)
        if st is None:
            st = self._staging[key] = torch.empty(shape, dtype=buf.dtype)
        return st

    def prepare(self) -> None:
        """Allocate and touch staging buffers, so no timed run pays for them
        (only the methods across all layers use them)."""
        if self.src.stacked and self.dst.stacked:
            for p in range(self.src.num_planes):
                self.staging(p).zero_()


def copy_slices(c: RowCopy) -> None:
    """One ``copy_`` per run, layer and plane."""
    for layer in range(c.src.num_layers):
        for p in range(c.src.num_planes):
            s, d = c.src.layer(p, layer), c.dst.layer(p, layer)
            for a, b, n in c.runs:
                d[b : b + n].copy_(s[a : a + n])


def copy_slices_all_layers(c: RowCopy) -> None:
    """One strided ``copy_`` per run and plane, covering every layer at once."""
    for p in range(c.src.num_planes):
        for a, b, n in c.runs:
            c.dst.span(p, b, n).copy_(c.src.span(p, a, n))


def copy_index_per_layer(c: RowCopy) -> None:
    """Per layer and plane: ``index_select`` (or a slice when the source rows
    are one range) and ``index_copy_`` (or a slice ``copy_``, straight into the
    destination with ``out=`` when its rows are one range)."""
    n = c.rows
    for layer in range(c.src.num_layers):
        for p in range(c.src.num_planes):
            s, d = c.src.layer(p, layer), c.dst.layer(p, layer)
            if c.src_start is not None:
                gathered = s[c.src_start : c.src_start + n]
                if c.dst_start is not None:
                    d[c.dst_start : c.dst_start + n].copy_(gathered)
                else:
                    d.index_copy_(0, c.dst_idx, gathered)
            elif c.dst_start is not None:
                # Strided (page_first) rows too: out= writes them in place, in one pass.
                torch.index_select(s, 0, c.src_idx, out=d[c.dst_start : c.dst_start + n])
            else:
                d.index_copy_(0, c.dst_idx, s.index_select(0, c.src_idx))


def copy_staged_all_layers(c: RowCopy) -> None:
    """Per plane: gather every layer's rows into a staging buffer in one
    ``index_select`` (skipped when the source rows are one range), then one
    strided ``copy_`` (destination rows one range) or one ``index_copy_``."""
    n = c.rows
    for p in range(c.src.num_planes):
        if c.src_start is not None:
            gathered = c.src.span(p, c.src_start, n)  # [layers, n, ...]
        else:
            st = torch.index_select(c.src.planes[p], c.src.slot_dim, c.src_idx, out=c.staging(p))
            gathered = st if c.src.layout == "layer_first" else st.transpose(0, 1)
        if c.dst_start is not None:
            c.dst.span(p, c.dst_start, n).copy_(gathered)
        elif c.dst.layout == "layer_first":
            c.dst.planes[p].index_copy_(1, c.dst_idx, gathered)
        else:
            c.dst.planes[p].index_copy_(0, c.dst_idx, gathered.transpose(0, 1))


def copy_gather_all_layers(c: RowCopy) -> None:
    """Per plane, one pass over every layer: ``index_select`` straight into
    the destination rows when they are one range (``out=``), ``index_copy_``
    straight from the source rows when those are one range, else through a
    staging buffer as `copy_staged_all_layers`."""
    n = c.rows
    if c.dst_start is None and c.src_start is None:
        copy_staged_all_layers(c)
        return
    for p in range(c.src.num_planes):
        if c.dst_start is not None:
            out = c.dst.span(p, c.dst_start, n)
            if c.src_start is not None:
                out.copy_(c.src.span(p, c.src_start, n))
            else:
                src = c.src.planes[p] if c.src.layout == "layer_first" else c.src.planes[p].transpose(0, 1)
                torch.index_select(src, 1, c.src_idx, out=out)
        else:
            assert c.src_start is not None
            dst = c.dst.planes[p] if c.dst.layout == "layer_first" else c.dst.planes[p].transpose(0, 1)
            dst.index_copy_(1, c.dst_idx, c.src.span(p, c.src_start, n))


def copy_stack_all_layers(c: RowCopy) -> None:
    """Into a ``page_first`` destination: per run and plane, one ``torch.stack``
    of every layer's source rows, writing the destination rows in order."""
    layers = range(c.src.num_layers)
    for p in range(c.src.num_planes):
        buf = c.dst.planes[p]
        sources = [c.src.layer(p, layer) for layer in layers]
        for a, b, n in c.runs:
            torch.stack([s[a : a + n] for s in sources], 1, out=buf[b : b + n])


RAW_METHODS: dict[str, Callable[[RowCopy], None]] = {
    "slices": copy_slices,
    "slices_all_layers": copy_slices_all_layers,
    "index_per_layer": copy_index_per_layer,
    "staged_all_layers": copy_staged_all_layers,
    "gather_all_layers": copy_gather_all_layers,
    "stack_all_layers": copy_stack_all_layers,
}


def raw_methods_for(c: RowCopy) -> dict[str, Callable[[RowCopy], None]]:
    """The `RAW_METHODS` that apply to ``c``'s sides: those across all layers
    need one buffer per plane on both sides; ``stack_all_layers`` a
    ``page_first`` destination."""
    both = c.src.stacked and c.dst.stacked
    out = {}
    for name, fn in RAW_METHODS.items():
        if name in ("slices_all_layers", "staged_all_layers", "gather_all_layers") and not both:
            continue
        if name == "stack_all_layers" and c.dst.layout != "page_first":
            continue
        out[name] = fn
    return out


class Ceiling:
    """One contiguous ``copy_`` of ``nbytes`` bytes between two touched buffers."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        self._dst = torch.empty(nbytes, dtype=torch.uint8).zero_()

    def __call__(self) -> None:
        self._dst.copy_(self._src)
