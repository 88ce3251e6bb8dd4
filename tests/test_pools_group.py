"""DevicePool, HostPool, LogicalHostPool and PoolGroup registration."""

from __future__ import annotations

import re

import pytest
import torch

from kvtier.errors import ConfigurationError
from kvtier.pools import (
    DevicePool,
    HostPool,
    HostPoolStatistics,
    LogicalHostPool,
    PageAllocator,
    PlaneSpec,
    PoolGroup,
    SidecarSpec,
)


def kv_layers(num_layers: int = 2, slots: int = 32, heads: int = 2, dim: int = 4) -> list[list[torch.Tensor]]:
    """K and V planes per layer, ``[slots, heads, dim]`` float32."""
    return [
        [torch.randn(slots, heads, dim), torch.randn(slots, heads, dim)] for _ in range(num_layers)
    ]


def device(num_layers: int = 2, slots: int = 32, **kwargs: object) -> DevicePool:
    return DevicePool(kv_layers(num_layers, slots), **kwargs)  # type: ignore[arg-type]


# -- DevicePool ----------------------------------------------------------------


def test_device_pool_describes_its_tensors() -> None:
    layers = kv_layers(3, 16)
    d = DevicePool(layers)
    assert d.num_layers == 3
    assert d.slots == 16
    assert d.device == torch.device("cpu")
    assert d.planes == (PlaneSpec((2, 4), torch.float32), PlaneSpec((2, 4), torch.float32))
    assert d.tensor(2, 1) is layers[2][1]
    assert d.allocator is None
    assert repr(d) == (
        "<DevicePool [3 layers x 16 slots | (2, 4) torch.float32, (2, 4) torch.float32 | cpu]>"
    )


def test_device_pool_planes_count_mismatch() -> None:
    layers = kv_layers(3)
    layers[2] = layers[2][:1]
    with pytest.raises(
        ConfigurationError,
        match=r"^DevicePool layers must have the same planes; layer 0 has 2, layer 2 has 1$",
    ):
        DevicePool(layers)


def test_device_pool_plane_shape_mismatch() -> None:
    layers = kv_layers(2)
    layers[1][1] = torch.zeros(32, 2, 8)
    with pytest.raises(
        ConfigurationError,
        match=r"^DevicePool layer 1 plane 1 is \(2, 8\) torch\.float32 per slot; "
        r"layer 0 plane 1 is \(2, 4\) torch\.float32$",
    ):
        DevicePool(layers)


def test_device_pool_plane_dtype_mismatch() -> None:
    layers = kv_layers(3)
    layers[2][0] = torch.zeros(32, 2, 4, dtype=torch.bfloat16)
    with pytest.raises(
        ConfigurationError,
        match=r"^DevicePool layer 2 plane 0 is \(2, 4\) torch\.bfloat16 per slot; "
        r"layer 0 plane 0 is \(2, 4\) torch\.float32$",
    ):
        DevicePool(layers)


def test_device_pool_slot_count_mismatch() -> None:
    layers = kv_layers(2)
    layers[1][1] = torch.zeros(24, 2, 4)
    with pytest.raises(
        ConfigurationError, match=r"^DevicePool layer 1 plane 1 has 24 slots; layer 0 has 32$"
    ):
        DevicePool(layers)


def test_device_pool_slot_count_mismatch_within_layer_0() -> None:
    with pytest.raises(ConfigurationError, match=r"^DevicePool layer 0 plane 1 has 8 slots; layer 0 has 32$"):
        DevicePool([[torch.zeros(32, 4), torch.zeros(8, 4)]])


def test_device_pool_device_mismatch() -> None:
    layers = kv_layers(2)
    layers[1][0] = torch.zeros(32, 2, 4, device="meta")
    with pytest.raises(
        ConfigurationError, match=r"^DevicePool layer 1 plane 0 is on meta; layer 0 is on cpu$"
    ):
        DevicePool(layers)


def test_device_pool_non_tensor_plane_in_later_layer() -> None:
    layers: list[list[object]] = kv_layers(2)  # type: ignore[assignment]
    layers[1][1] = [[0.0]]
    with pytest.raises(
        ConfigurationError, match=r"^DevicePool layer 1 plane 1 must be a tensor; got list$"
    ):
        DevicePool(layers)  # type: ignore[arg-type]


@pytest.mark.parametrize("plane", [0, 1])
def test_device_pool_non_tensor_plane_in_layer_0(plane: int) -> None:
    layer0: list[object] = [torch.zeros(8, 4), torch.zeros(8, 4)]
    layer0[plane] = "not a tensor"
    with pytest.raises(ConfigurationError, match=rf"layer 0 plane {plane} must be a tensor; got str"):
        DevicePool([layer0])  # type: ignore[list-item]


def test_device_pool_rejects_zero_d_tensors() -> None:
    with pytest.raises(ConfigurationError, match=r"needs a slot dimension; got a 0-d tensor"):
        DevicePool([torch.tensor(1.0)])
    with pytest.raises(ConfigurationError, match=r"^DevicePool layer 1 plane 0 "):
        DevicePool([torch.zeros(8), torch.tensor(1.0)])


def test_device_pool_rejects_no_layers_and_empty_layer() -> None:
    with pytest.raises(ConfigurationError, match=r"needs at least one layer; got none"):
        DevicePool([])
    with pytest.raises(ConfigurationError, match=r"layer 0 has no planes"):
        DevicePool([[]])


def test_device_pool_bare_tensors_are_one_plane() -> None:
    layers = [torch.randn(16, 8, dtype=torch.float16) for _ in range(3)]
    d = DevicePool(layers)
    assert d.num_layers == 3
    assert d.planes == (PlaneSpec((8,), torch.float16),)
    assert d.tensor(1, 0) is layers[1]
    assert d.slot_nbytes == 3 * 8 * 2


def test_device_pool_layer_map_identity_default() -> None:
    d = device(3)
    assert d.layer_map == (0, 1, 2)
    assert [d.pool_layer(t) for t in range(5)] == [0, 1, 2, None, None]


def test_device_pool_layer_map_list_with_none() -> None:
    d = device(2, layer_map=[None, 1, None, 0])
    assert d.layer_map == (None, 1, None, 0)
    assert [d.pool_layer(t) for t in range(6)] == [None, 1, None, 0, None, None]


def test_device_pool_layer_map_dict() -> None:
    d = device(2, layer_map={3: 0, 1: 1})
    assert d.layer_map == (None, 1, None, 0)
    d = device(2, layer_map={0: 0, 1: 1, 4: None})
    assert d.layer_map == (0, 1, None, None, None)


def test_device_pool_pool_layer_negative_transfer_layer() -> None:
    d = device(2, layer_map=[None, 0, 1])
    assert d.pool_layer(-1) is None


@pytest.mark.parametrize(
    ("layer_map", "message"),
    [
        ([0, 0], r"^layer_map names pool layer 0 twice; each pool layer moves with one transfer layer$"),
        ({0: 1, 2: 1}, r"^layer_map names pool layer 1 twice"),
        ([0, 2], r"^layer_map\[1\] must be a pool layer in 0\.\.1 or None; got 2$"),
        ([-1, 0], r"^layer_map\[0\] must be a pool layer in 0\.\.1 or None; got -1$"),
        ([0, True], r"^layer_map\[1\] must be a pool layer in 0\.\.1 or None; got True$"),
        ({5: 3, 0: 0}, r"^layer_map\[5\] must be a pool layer in 0\.\.1 or None; got 3$"),
        ([0, None], r"^layer_map must name every pool layer exactly once; pool layers \[1\] are missing$"),
        ({}, r"pool layers \[0, 1\] are missing$"),
        ([], r"pool layers \[0, 1\] are missing$"),
        ({-1: 0, 0: 1}, r"^layer_map keys are transfer layers \(ints >= 0\); got -1$"),
        ({"0": 0, 1: 1}, r"^layer_map keys are transfer layers \(ints >= 0\); got '0'$"),
    ],
)
def test_device_pool_bad_layer_map(layer_map: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        device(2, layer_map=layer_map)


def test_device_pool_slot_nbytes() -> None:
    layers = [
        [torch.zeros(8, 2, 4, dtype=torch.float16), torch.zeros(8, 1, dtype=torch.float32)]
        for _ in range(3)
    ]
    d = DevicePool(layers)
    # per layer: 2*4*2 bytes + 1*4 bytes = 20; three layers
    assert d.slot_nbytes == 60
    assert [p.slot_nbytes for p in d.planes] == [16, 4]


def test_device_pool_allocator() -> None:
    alloc = PageAllocator(32, 4)
    assert device(allocator=alloc).allocator is alloc
    with pytest.raises(
        ConfigurationError,
        match=r"^DevicePool allocator must provide page_size, num_free_slots, try_alloc and free; got object$",
    ):
        device(allocator=object())


# -- DevicePool.stacked: overlapping layer views are never stacked ------------

# (layers, slots, plane shape): two layers (so a check that skips the layer
# dimension of one-layer-fewer is caught), one slot, odd and composite widths.
STACK_SHAPES = [(2, 4, (3,)), (3, 1, (2,)), (4, 5, (2, 4)), (2, 3, (4, 1, 3)), (5, 2, (7,))]


def _width(shape: tuple[int, ...]) -> int:
    w = 1
    for d in shape:
        w *= d
    return w


def _inner_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_width(shape[k + 1 :]) for k in range(len(shape)))


def layer_first_views(layers: int, slots: int, shape: tuple[int, ...], gap: int) -> list[torch.Tensor]:
    """Layer j as ``flat[j*step : j*step + n].view(slots, *shape)`` with
    ``step = n + gap`` (n: a layer's elements): -1 shares one element between
    consecutive layers, 0 is exactly adjacent, 1 leaves a gap."""
    n = slots * _width(shape)
    step = n + gap
    flat = torch.arange((layers - 1) * step + n, dtype=torch.float32)
    return [flat[j * step : j * step + n].view(slots, *shape) for j in range(layers)]


def slot_first_views(layers: int, slots: int, shape: tuple[int, ...], gap: int) -> list[torch.Tensor]:
    """``[slots, layers, ...]``-like: a slot's layers side by side, layer j of a
    slot ``w + gap`` elements after layer j-1 (w: a row's elements), slot rows
    exactly adjacent. gap -1: consecutive layers share one element per slot."""
    w = _width(shape)
    step = w + gap
    row = (layers - 1) * step + w
    flat = torch.arange(slots * row, dtype=torch.float32)
    return [flat.as_strided((slots, *shape), (row, *_inner_strides(shape)), j * step) for j in range(layers)]


ARRANGEMENTS = {"layer_first": layer_first_views, "slot_first": slot_first_views}


@pytest.mark.parametrize("arrangement", sorted(ARRANGEMENTS))
@pytest.mark.parametrize(("layers", "slots", "shape"), STACK_SHAPES)
def test_layer_views_overlapping_by_one_element_are_never_stacked(
    arrangement: str, layers: int, slots: int, shape: tuple[int, ...]
) -> None:
    views = ARRANGEMENTS[arrangement](layers, slots, shape, -1)
    # Each layer alone is a plain non-overlapping tensor; only neighbours share,
    # one element (per slot, slot-first).
    shared = set(views[0].flatten().tolist()) & set(views[1].flatten().tolist())
    assert len(shared) == (1 if arrangement == "layer_first" else slots)
    assert all(len(set(v.flatten().tolist())) == v.numel() for v in views)
    pool = DevicePool([[v] for v in views])
    assert pool.stacked(0) is None
    assert "stacked" not in repr(pool)
    # The same arrangement one element further apart is stacked: only the overlap differs.
    assert DevicePool(ARRANGEMENTS[arrangement](layers, slots, shape, 0)).stacked(0) is not None


@pytest.mark.parametrize("gap", [0, 1])
@pytest.mark.parametrize("arrangement", sorted(ARRANGEMENTS))
@pytest.mark.parametrize(("layers", "slots", "shape"), STACK_SHAPES)
def test_adjacent_or_spaced_layer_views_are_stacked_on_their_own_memory(
    arrangement: str, layers: int, slots: int, shape: tuple[int, ...], gap: int
) -> None:
    views = ARRANGEMENTS[arrangement](layers, slots, shape, gap)
    pool = DevicePool(views)
    stacked = pool.stacked(0)
    assert stacked is not None and stacked.shape == (layers, slots, *shape)
    for j in range(layers):
        t = pool.tensor(j, 0)
        assert stacked[j].data_ptr() == t.data_ptr() and stacked[j].stride() == t.stride()
        assert torch.equal(stacked[j], t)
    stacked[layers - 1, slots - 1].fill_(-1.0)  # the very memory of the engine's last row
    assert bool((pool.tensor(layers - 1, 0)[slots - 1] == -1.0).all())
    assert sum(int((v == -1.0).sum()) for v in views) == _width(shape)  # and nothing else


def test_a_size_one_dimension_never_keeps_layers_from_stacking() -> None:
    """A dimension of size 1 addresses one element whatever its stride, so it
    cannot make two elements share memory: layers whose views have one (with a
    stride that no contiguous tensor would have: 2, inside the last dimension's
    extent, or 0) are stacked as plain ones are, on their own memory."""
    slots, width = 3, 4
    for odd_stride in (2, 0):
        flat = torch.arange(2 * slots * width, dtype=torch.float32)
        views = [flat.as_strided((slots, 1, width), (width, odd_stride, 1), j * slots * width) for j in range(2)]
        pool = DevicePool([[v] for v in views])
        stacked = pool.stacked(0)
        assert stacked is not None and stacked.shape == (2, slots, 1, width), odd_stride
        for j, v in enumerate(views):
            assert stacked[j].data_ptr() == v.data_ptr() and torch.equal(stacked[j], v)
        assert "stacked" in repr(pool)


def test_an_empty_layer_map_names_every_pool_layer_missing() -> None:
    for layers in (1, 3):
        for empty in ({}, []):
            message = f"layer_map must name every pool layer exactly once; pool layers {list(range(layers))} are missing"
            with pytest.raises(ConfigurationError, match=f"^{re.escape(message)}$"):
                device(num_layers=layers, layer_map=empty)


# -- HostPool ------------------------------------------------------------------

PLANES = (PlaneSpec((2, 4), torch.float32), PlaneSpec((3,), torch.int8))


def host(layout: str = "layer_first", *, slots: int = 64, page_size: int | None = 16) -> HostPool:
    return HostPool(
        "kv", planes=PLANES, num_layers=3, slots=slots, page_size=page_size, layout=layout  # type: ignore[arg-type]
    )


def test_host_pool_layer_first_buffer_shape() -> None:
    h = host("layer_first")
    assert h.buffer(0).shape == (3, 64, 2, 4)
    assert h.buffer(1).shape == (3, 64, 3)
    assert h.buffer(0).dtype == torch.float32
    assert h.buffer(1).dtype == torch.int8
    assert h.layer_view(2, 0).shape == (64, 2, 4)
    assert h.layer_view(2, 0).is_contiguous()


def test_host_pool_page_first_buffer_shape() -> None:
    h = host("page_first")
    assert h.buffer(0).shape == (64, 3, 2, 4)
    assert h.buffer(1).shape == (64, 3, 3)
    assert h.layer_view(1, 1).shape == (64, 3)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_pool_layer_view_writes_land_in_buffer(layout: str) -> None:
    h = host(layout)
    for p in (0, 1):
        h.buffer(p).zero_()
    value = torch.arange(8, dtype=torch.float32).reshape(2, 4) + 1
    h.layer_view(2, 0)[37] = value
    h.layer_view(1, 1)[5] = torch.tensor([7, 8, 9], dtype=torch.int8)

    b0, b1 = h.buffer(0), h.buffer(1)
    if layout == "layer_first":
        assert torch.equal(b0[2, 37], value)
        assert torch.equal(b1[1, 5], torch.tensor([7, 8, 9], dtype=torch.int8))
    else:
        assert torch.equal(b0[37, 2], value)
        assert torch.equal(b1[5, 1], torch.tensor([7, 8, 9], dtype=torch.int8))
    # nothing else changed
    assert int(b0.count_nonzero()) == 8
    assert int(b1.count_nonzero()) == 3


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_pool_statistics(layout: str) -> None:
    h = host(layout)
    assert h.allocator is not None
    h.allocator.try_alloc_pages(2)
    h.allocator.free_pages([1])
    slot_nbytes = 3 * (2 * 4 * 4 + 3 * 1)
    assert h.slot_nbytes == slot_nbytes
    assert h.nbytes == 64 * slot_nbytes
    assert h.statistics() == HostPoolStatistics(
        name="kv", kind="pool", layout=layout, page_size=16, capacity_slots=64,
        used_slots=16, free_slots=48, peak_used_slots=32, nbytes=64 * slot_nbytes,
    )


def test_host_pool_repr() -> None:
    h = host("page_first")
    assert repr(h) == "<HostPool 'kv' [pages: 0 used, 4 free | page_size=16, page_first]>"
    assert h.allocator is not None
    h.allocator.try_alloc_pages(3)
    assert repr(h) == "<HostPool 'kv' [pages: 3 used, 1 free | page_size=16, page_first]>"
    assert repr(host("layer_first", slots=8, page_size=4)) == (
        "<HostPool 'kv' [pages: 0 used, 2 free | page_size=4, layer_first]>"
    )


def test_host_pool_without_page_size_is_sidecar_storage() -> None:
    h = host("layer_first", slots=10, page_size=None)
    assert h.allocator is None
    assert repr(h) == "<HostPool 'kv' [sidecar rows: 10 | layer_first]>"
    s = h.statistics()
    assert (s.kind, s.layout, s.page_size, s.capacity_slots) == ("sidecar", "layer_first", None, 10)
    assert (s.used_slots, s.free_slots, s.peak_used_slots) == (None, None, None)
    assert s.nbytes == 10 * h.slot_nbytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning default follows CUDA")
def test_host_pool_not_pinned_without_cuda() -> None:
    h = host()
    assert h.pinned is False
    assert not h.buffer(0).is_pinned()


@pytest.mark.parametrize("layout", ["page-first", "LAYER_FIRST", None])
def test_host_pool_bad_layout(layout: object) -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"^pool 'kv' layout must be one of \('layer_first', 'page_first'\); got ",
    ):
        host(layout)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"slots": 0}, r"pool 'kv' host capacity must be a positive int; got 0"),
        ({"num_layers": 0}, r"pool 'kv' number of layers must be a positive int; got 0"),
        ({"slots": 60}, r"pool 'kv' capacity must be a whole number of pages of 16 slots; got 60 slots"),
        ({"page_size": 0}, r"pool 'kv' page_size must be a positive int; got 0"),
    ],
)
def test_host_pool_bad_sizes(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"planes": PLANES, "num_layers": 3, "slots": 64, "page_size": 16}
    args.update(kwargs)
    with pytest.raises(ConfigurationError, match=message):
        HostPool("kv", **args)  # type: ignore[arg-type]


def test_logical_host_pool() -> None:
    h = LogicalHostPool("anchor", page_size=4, slots=32)
    assert (h.has_bytes, h.nbytes, h.slot_nbytes, h.num_layers, h.layout) == (False, 0, 0, 0, None)
    h.allocator.try_alloc_pages(3)
    assert h.statistics() == HostPoolStatistics(
        name="anchor", kind="logical", layout=None, page_size=4, capacity_slots=32,
        used_slots=12, free_slots=20, peak_used_slots=12, nbytes=0,
    )
    assert repr(h) == "<LogicalHostPool 'anchor' [pages: 3 used, 5 free | page_size=4]>"
    with pytest.raises(TypeError, match=r"logical pool 'anchor' holds no bytes"):
        h.layer_view(0, 0)
    with pytest.raises(ConfigurationError, match=r"whole number of pages of 4 slots; got 30 slots"):
        LogicalHostPool("anchor", page_size=4, slots=30)


# -- PoolGroup -----------------------------------------------------------------


def test_add_pool() -> None:
    g = PoolGroup()
    dev = device(2, 32)
    h = g.add_pool("kv", device=dev, page_size=4, host_slots=64, layout="page_first")
    assert isinstance(h, HostPool)
    assert (h.slots, h.page_size, h.layout, h.num_layers) == (64, 4, "page_first", 2)
    assert h.planes == dev.planes
    assert h.buffer(0).shape == (64, 2, 2, 4)
    spec = g["kv"]
    assert (spec.name, spec.kind, spec.page_size, spec.device_slots) == ("kv", "pool", 4, 32)
    assert spec.host is h and spec.device is dev
    assert spec.device_allocator is None
    assert spec.owns_slots and spec.sidecar is None
    assert spec.slot_nbytes == h.slot_nbytes == dev.slot_nbytes
    assert "kv" in g and len(g) == 1 and g.names == ("kv",)
    assert [s.name for s in g] == ["kv"]


def test_add_pool_with_device_allocator() -> None:
    g = PoolGroup()
    alloc = PageAllocator(32, 4, name="kv-device")
    g.add_pool("kv", device=device(2, 32, allocator=alloc), page_size=4, host_slots=16)
    assert g["kv"].device_allocator is alloc


def test_add_logical_pool() -> None:
    g = PoolGroup()
    alloc = PageAllocator(64, 8)
    h = g.add_logical_pool("anchor", page_size=8, host_slots=32, device_slots=64, device_allocator=alloc)
    assert isinstance(h, LogicalHostPool)
    assert (h.slots, h.page_size) == (32, 8)
    spec = g["anchor"]
    assert (spec.kind, spec.page_size, spec.device_slots) == ("logical", 8, 64)
    assert spec.device is None and spec.device_allocator is alloc
    assert spec.owns_slots
    assert spec.slot_nbytes == 0


def test_add_sidecar_of_pool() -> None:
    g = PoolGroup()
    g.add_pool("kv", device=device(2, 32), page_size=4, host_slots=64)
    sc_dev = DevicePool([torch.zeros(16, 3) for _ in range(2)])  # 8 device pages x 2 rows
    h = g.add_sidecar("idx", source="kv", rows_per_page=2, device=sc_dev, layout="page_first")
    # host rows: 64 host slots / 4 per page = 16 pages, x 2 rows
    assert h.slots == 32
    assert h.allocator is None
    assert h.layout == "page_first"
    assert h.buffer(0).shape == (32, 2, 3)
    spec = g["idx"]
    assert (spec.kind, spec.page_size, spec.device_slots) == ("sidecar", 2, 16)
    assert spec.sidecar == SidecarSpec(source="kv", source_page_size=4, rows_per_page=2)
    assert not spec.owns_slots
    assert spec.device_allocator is None
    assert g.sidecars_of("kv") == (spec,)
    assert g.sidecars_of("idx") == ()
    assert g.sidecars_of("nope") == ()


def test_add_sidecar_of_logical_pool() -> None:
    g = PoolGroup()
    g.add_logical_pool("anchor", page_size=16, host_slots=48, device_slots=64)
    h = g.add_sidecar("state", source="anchor", rows_per_page=1, device=DevicePool([torch.zeros(4, 8)]))
    assert h.slots == 3  # 48 / 16 host pages x 1 row
    assert g["state"].sidecar == SidecarSpec("anchor", 16, 1)
    assert g.sidecars_of("anchor") == (g["state"],)


@pytest.mark.parametrize(("source_host_slots", "page_size", "k"), [(64, 4, 1), (64, 4, 4), (32, 16, 3), (8, 8, 5)])
def test_sidecar_host_rows_follow_source_pages(source_host_slots: int, page_size: int, k: int) -> None:
    g = PoolGroup()
    g.add_pool("kv", device=device(1, 32), page_size=page_size, host_slots=source_host_slots)
    h = g.add_sidecar("sc", source="kv", rows_per_page=k, device=DevicePool([torch.zeros(32 // page_size * k, 2)]))
    assert h.slots == (source_host_slots // page_size) * k
    assert h.statistics().capacity_slots == h.slots


def test_sidecars_of_lists_every_sidecar_in_order() -> None:
    g = PoolGroup()
    g.add_pool("kv", device=device(1, 16), page_size=4, host_slots=16)
    g.add_pool("other", device=device(1, 16), page_size=4, host_slots=16)
    g.add_sidecar("b", source="kv", rows_per_page=1, device=DevicePool([torch.zeros(4, 1)]))
    g.add_sidecar("a", source="kv", rows_per_page=1, device=DevicePool([torch.zeros(4, 1)]))
    g.add_sidecar("c", source="other", rows_per_page=1, device=DevicePool([torch.zeros(4, 1)]))
    assert [s.name for s in g.sidecars_of("kv")] == ["b", "a"]
    assert [s.name for s in g.sidecars_of("other")] == ["c"]
    assert g.names == ("kv", "other", "b", "a", "c")


def _group_with_kv() -> PoolGroup:
    g = PoolGroup()
    g.add_pool("kv", device=device(2, 32), page_size=4, host_slots=64)
    return g


def _assert_unchanged(g: PoolGroup, names: tuple[str, ...]) -> None:
    assert g.names == names
    assert len(g) == len(names)


def test_duplicate_name() -> None:
    g = _group_with_kv()
    with pytest.raises(ConfigurationError, match=r"^pool 'kv' is already registered$"):
        g.add_pool("kv", device=device(), page_size=4, host_slots=64)
    with pytest.raises(ConfigurationError, match=r"^pool 'kv' is already registered$"):
        g.add_logical_pool("kv", page_size=4, host_slots=64, device_slots=32)
    with pytest.raises(ConfigurationError, match=r"^pool 'kv' is already registered$"):
        g.add_sidecar("kv", source="kv", rows_per_page=1, device=device())
    _assert_unchanged(g, ("kv",))


@pytest.mark.parametrize("name", ["", None, 3])
def test_bad_pool_name(name: object) -> None:
    g = PoolGroup()
    with pytest.raises(ConfigurationError, match=r"^pool names are non-empty strings; got "):
        g.add_logical_pool(name, page_size=4, host_slots=16, device_slots=16)  # type: ignore[arg-type]
    assert len(g) == 0


def test_sidecar_of_unknown_source() -> None:
    g = _group_with_kv()
    with pytest.raises(
        ConfigurationError,
        match=r"^sidecar 'idx' names source 'nope', which is not registered; "
        r"register the source first \(known: \['kv'\]\)$",
    ):
        g.add_sidecar("idx", source="nope", rows_per_page=1, device=device())
    _assert_unchanged(g, ("kv",))
    assert g.sidecars_of("nope") == ()


def test_sidecar_of_a_sidecar() -> None:
    g = _group_with_kv()
    g.add_sidecar("idx", source="kv", rows_per_page=1, device=DevicePool([torch.zeros(8, 2)]))
    with pytest.raises(
        ConfigurationError,
        match=r"^sidecar 'idx2' cannot take its indices from sidecar 'idx'; "
        r"a sidecar's source must own slots \(a pool or a logical pool\)$",
    ):
        g.add_sidecar("idx2", source="idx", rows_per_page=1, device=DevicePool([torch.zeros(64, 2)]))
    _assert_unchanged(g, ("kv", "idx"))
    assert g.sidecars_of("idx") == ()


def test_sidecar_naming_itself() -> None:
    g = _group_with_kv()
    with pytest.raises(ConfigurationError, match=r"^sidecar 'loop' cannot take its indices from itself$"):
        g.add_sidecar("loop", source="loop", rows_per_page=1, device=device())
    _assert_unchanged(g, ("kv",))


def test_sidecar_with_too_few_device_rows() -> None:
    g = _group_with_kv()  # 32 device slots / 4 = 8 pages
    with pytest.raises(
        ConfigurationError,
        match=r"^sidecar 'idx' needs 16 device rows to cover source 'kv' \(8 pages x 2 rows\); got 15$",
    ):
        g.add_sidecar("idx", source="kv", rows_per_page=2, device=DevicePool([torch.zeros(15, 2)]))
    _assert_unchanged(g, ("kv",))
    assert g.sidecars_of("kv") == ()
    # exactly enough rows is fine
    g.add_sidecar("idx", source="kv", rows_per_page=2, device=DevicePool([torch.zeros(16, 2)]))
    assert g["idx"].device_slots == 16


def test_sidecar_device_rows_count_whole_source_pages() -> None:
    g = PoolGroup()
    g.add_logical_pool("anchor", page_size=4, host_slots=16, device_slots=10)  # 2 whole pages
    with pytest.raises(ConfigurationError, match=r"needs 6 device rows .*\(2 pages x 3 rows\); got 5$"):
        g.add_sidecar("sc", source="anchor", rows_per_page=3, device=DevicePool([torch.zeros(5, 1)]))
    g.add_sidecar("sc", source="anchor", rows_per_page=3, device=DevicePool([torch.zeros(6, 1)]))
    assert g["sc"].host.slots == 12


@pytest.mark.parametrize("rows", [0, -1, 1.0, None])
def test_sidecar_rows_per_page_must_be_positive_int(rows: object) -> None:
    g = _group_with_kv()
    with pytest.raises(ConfigurationError, match=r"^pool 'idx' rows_per_page must be a positive int; got "):
        g.add_sidecar("idx", source="kv", rows_per_page=rows, device=device())  # type: ignore[arg-type]
    _assert_unchanged(g, ("kv",))


def test_sidecar_device_and_layout_checked() -> None:
    g = _group_with_kv()
    with pytest.raises(ConfigurationError, match=r"^pool 'idx' device must be a DevicePool; got Tensor$"):
        g.add_sidecar("idx", source="kv", rows_per_page=1, device=torch.zeros(8))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"^pool 'idx' layout must be one of"):
        g.add_sidecar("idx", source="kv", rows_per_page=1, device=device(), layout="rows")  # type: ignore[arg-type]
    _assert_unchanged(g, ("kv",))


def test_device_allocator_page_size_mismatch() -> None:
    g = PoolGroup()
    dev = device(2, 32, allocator=PageAllocator(32, 8))
    with pytest.raises(
        ConfigurationError,
        match=r"^pool 'kv' device allocator has page_size 8; the pool's page_size is 4$",
    ):
        g.add_pool("kv", device=dev, page_size=4, host_slots=64)
    with pytest.raises(
        ConfigurationError,
        match=r"^pool 'anchor' device allocator has page_size 16; the pool's page_size is 4$",
    ):
        g.add_logical_pool(
            "anchor", page_size=4, host_slots=64, device_slots=32, device_allocator=PageAllocator(32, 16)
        )
    _assert_unchanged(g, ())


@pytest.mark.parametrize(
    ("host_slots", "page_size", "message"),
    [
        (30, 4, r"^pool 'kv' capacity must be a whole number of pages of 4 slots; got 30 slots$"),
        (0, 4, r"^pool 'kv' capacity must be a positive int; got 0$"),
        (64, 0, r"^pool 'kv' page_size must be a positive int; got 0$"),
    ],
)
def test_host_slots_must_be_whole_pages(host_slots: int, page_size: int, message: str) -> None:
    g = PoolGroup()
    with pytest.raises(ConfigurationError, match=message):
        g.add_pool("kv", device=device(), page_size=page_size, host_slots=host_slots)
    with pytest.raises(ConfigurationError, match=message):
        g.add_logical_pool("kv", page_size=page_size, host_slots=host_slots, device_slots=32)
    _assert_unchanged(g, ())


def test_add_pool_device_smaller_than_a_page() -> None:
    g = PoolGroup()
    with pytest.raises(
        ConfigurationError, match=r"^pool 'kv' device has 8 slots, fewer than one page of 16$"
    ):
        g.add_pool("kv", device=device(2, 8), page_size=16, host_slots=64)
    with pytest.raises(ConfigurationError, match=r"^pool 'kv' device must be a DevicePool; got list$"):
        g.add_pool("kv", device=kv_layers(), page_size=4, host_slots=64)  # type: ignore[arg-type]
    _assert_unchanged(g, ())


def test_add_logical_pool_device_slots_must_be_positive() -> None:
    g = PoolGroup()
    with pytest.raises(ConfigurationError, match=r"^pool 'a' device_slots must be a positive int; got 0$"):
        g.add_logical_pool("a", page_size=4, host_slots=16, device_slots=0)
    _assert_unchanged(g, ())


def test_add_after_freeze() -> None:
    g = _group_with_kv()
    g.freeze()
    message = r"^cannot add pool '{}': the group is in use by a scheduler; register every pool first$"
    with pytest.raises(ConfigurationError, match=message.format("kv2")):
        g.add_pool("kv2", device=device(), page_size=4, host_slots=64)
    with pytest.raises(ConfigurationError, match=message.format("a")):
        g.add_logical_pool("a", page_size=4, host_slots=16, device_slots=16)
    with pytest.raises(ConfigurationError, match=message.format("idx")):
        g.add_sidecar("idx", source="kv", rows_per_page=1, device=DevicePool([torch.zeros(8, 1)]))
    _assert_unchanged(g, ("kv",))


def test_freeze_of_empty_group() -> None:
    g = PoolGroup()
    with pytest.raises(ConfigurationError, match=r"^a PoolGroup needs at least one pool before it is used$"):
        g.freeze()
    # still open for registration
    g.add_logical_pool("a", page_size=4, host_slots=16, device_slots=16)
    g.freeze()
    assert g.names == ("a",)


def test_num_layers_is_longest_layer_map() -> None:
    g = PoolGroup()
    assert g.num_layers == 0
    g.add_logical_pool("anchor", page_size=4, host_slots=16, device_slots=16)
    assert g.num_layers == 0  # logical pools have no layers
    g.add_pool("kv", device=device(2, 32), page_size=4, host_slots=64)
    assert g.num_layers == 2
    g.add_pool("swa", device=device(2, 32, layer_map=[None, 0, None, None, 1]), page_size=4, host_slots=16)
    assert g.num_layers == 5
    g.add_sidecar("idx", source="kv", rows_per_page=1, device=DevicePool([torch.zeros(8, 1)], layer_map={2: 0}))
    assert g.num_layers == 5


def test_statistics_keys_and_kinds() -> None:
    g = PoolGroup()
    g.add_pool("kv", device=device(2, 32), page_size=4, host_slots=64)
    g.add_logical_pool("anchor", page_size=8, host_slots=32, device_slots=32)
    g.add_sidecar("idx", source="kv", rows_per_page=2, device=DevicePool([torch.zeros(16, 1)]))
    g["kv"].host.allocator.try_alloc_pages(3)  # type: ignore[union-attr]
    stats = g.statistics()
    assert list(stats) == ["kv", "anchor", "idx"]
    assert {n: s.kind for n, s in stats.items()} == {"kv": "pool", "anchor": "logical", "idx": "sidecar"}
    assert all(isinstance(s, HostPoolStatistics) for s in stats.values())
    assert (stats["kv"].used_slots, stats["kv"].free_slots) == (12, 52)
    assert stats["anchor"].nbytes == 0
    assert stats["idx"].capacity_slots == 32 and stats["idx"].used_slots is None
    assert repr(g) == "<PoolGroup [kv:pool, anchor:logical, idx:sidecar]>"


def test_a_groups_transfer_layers_follow_its_pools() -> None:
    # The count is kept as pools come and go, not recomputed per read.
    group = PoolGroup()
    assert group.num_layers == 0
    group.add_pool("short", device=device(2), page_size=4, host_slots=8)
    assert group.num_layers == 2
    group.add_pool("long", device=device(5), page_size=4, host_slots=8)
    assert group.num_layers == 5
    group.remove_pool("long")
    assert group.num_layers == 2
    group.remove_pool("short")
    assert group.num_layers == 0


# -- removal, freezing and the users of a group ----------------------------------------------


def _group_with_two_sidecars() -> PoolGroup:
    g = PoolGroup()
    g.add_pool("kv", device=device(2, 32), page_size=4, host_slots=16)
    g.add_sidecar("a", source="kv", rows_per_page=1, device=DevicePool([torch.zeros(8, 2)]))
    g.add_sidecar("b", source="kv", rows_per_page=1, device=DevicePool([torch.zeros(8, 2)]))
    return g


def test_removing_a_sidecar_keeps_its_siblings_and_its_anchor_goes_last() -> None:
    g = _group_with_two_sidecars()
    with pytest.raises(ConfigurationError) as refused:
        g.remove_pool("kv")
    assert str(refused.value) == "pool 'kv' still has sidecars ['a', 'b']; remove them first"
    g.remove_pool("a")
    assert [s.name for s in g.sidecars_of("kv")] == ["b"] and g.names == ("kv", "b")
    with pytest.raises(ConfigurationError) as refused:
        g.remove_pool("kv")
    assert str(refused.value) == "pool 'kv' still has sidecars ['b']; remove them first"
    g.remove_pool("b")
    assert g.sidecars_of("kv") == ()
    g.remove_pool("kv")
    assert g.names == ()
    for name in ("kv", 3):
        with pytest.raises(ConfigurationError) as refused:
            g.remove_pool(name)  # type: ignore[arg-type]
        assert str(refused.value) == f"pool {name!r} is not registered (known: [])"
    # a pool added again under a removed name starts with no sidecars
    g.add_pool("a", device=device(2, 32), page_size=4, host_slots=16)
    assert g.sidecars_of("a") == ()
    g.freeze()
    with pytest.raises(ConfigurationError) as refused:
        g.remove_pool("a")
    assert str(refused.value) == "cannot remove pool 'a': the group is in use by a scheduler"


def test_a_frozen_groups_pages_drop_their_checksums_and_valid_rows_when_freed() -> None:
    # verify mode's checksums and the valid rows of partial pages belong to one life of a
    # page, for the anchor and its sidecars: freed through the group's record, they go
    g = _group_with_two_sidecars()
    assert (g.checksums, g.valid_rows) == ({}, {})
    g.freeze()
    own = g.ownership("kv")
    assert own.name == "kv" and own.allocator is g["kv"].host.allocator
    pages = own.allocator.try_alloc_pages(2)
    assert pages is not None
    for pool in ("kv", "a", "b"):
        g.checksums[pool] = dict.fromkeys(pages, 1)
        g.valid_rows[pool] = dict.fromkeys(pages, 3)
    own.free(pages[:1])
    for pool in ("kv", "a", "b"):
        assert g.checksums[pool] == {pages[1]: 1} and g.valid_rows[pool] == {pages[1]: 3}, pool


def test_one_user_at_a_time_and_detach_by_another_is_a_no_op() -> None:
    g = PoolGroup()
    g.add_pool("kv", device=device(2, 32), page_size=4, host_slots=16)
    first, second = object(), object()
    g.attach(first)
    g.attach(first)  # again by the same user: fine
    with pytest.raises(ConfigurationError, match=r"^this PoolGroup is in use by <object object at 0x[0-9a-f]+>; one "
                       r"scheduler uses a group at a time \(leave its `async with` block first\)$"):
        g.attach(second)
    g.detach(second)  # not the user: nothing
    with pytest.raises(ConfigurationError, match="in use by"):
        g.attach(second)
    g.detach(first)
    g.attach(second)
    with pytest.raises(ConfigurationError, match="is in use by a scheduler"):  # frozen by its first user for good
        g.add_pool("more", device=device(2, 32), page_size=4, host_slots=16)


def test_host_pools_and_their_allocators_carry_the_pool_name() -> None:
    g = _group_with_two_sidecars()
    g.add_logical_pool("anchor", page_size=8, host_slots=32, device_slots=32)
    assert [g[n].host.name for n in ("kv", "a", "anchor")] == ["kv", "a", "anchor"]
    assert g["kv"].host.allocator.name == "kv"  # type: ignore[union-attr]
    assert g["a"].device is not None and g["a"].device.slots == 8


def test_a_device_pool_refuses_no_layers_empty_rows_and_meta_tensors_by_name() -> None:
    cases: list[tuple[list[list[torch.Tensor]], str]] = [
        ([], "DevicePool needs at least one layer; got none"),
        ([[torch.zeros(8, 0)]], "DevicePool layer 0 plane 0 of shape (8, 0) holds 0 bytes per slot; a pool "
                                "without bytes is a logical pool (PoolGroup.add_logical_pool)"),
        ([[torch.zeros(8, 2, 0)]], "DevicePool layer 0 plane 0 of shape (8, 2, 0) holds 0 bytes per slot; a pool "
                                   "without bytes is a logical pool (PoolGroup.add_logical_pool)"),
        ([[torch.zeros(8, 2, device="meta")]], "DevicePool tensors are on device meta, which holds no data; "
                                               "a pool's tensors must hold its rows (a CPU or CUDA device)"),
    ]
    for layers, message in cases:
        with pytest.raises(ConfigurationError) as refused:
            DevicePool(layers)
        assert str(refused.value) == message


def test_a_device_pool_of_exactly_one_page_is_a_pool() -> None:
    g = PoolGroup()
    g.add_pool("kv", device=device(2, 4), page_size=4, host_slots=8)
    assert g["kv"].device is not None and g["kv"].device.slots == 4


def test_removing_a_pool_by_something_that_is_not_a_name_is_refused_by_name() -> None:
    g = PoolGroup()
    g.add_pool("kv", device=device(2, 32), page_size=4, host_slots=16)
    for name in (["kv"], None):
        with pytest.raises(ConfigurationError) as refused:
            g.remove_pool(name)  # type: ignore[arg-type]
        assert str(refused.value) == f"pool {name!r} is not registered (known: ['kv'])"
    assert g.names == ("kv",)


def test_aligned_host_buffers_take_any_power_of_two() -> None:
    from kvtier.pools.host import aligned_empty

    for align in (1, 2, 64, 4096):
        t = aligned_empty((3, 5), torch.float32, align)
        assert t.shape == (3, 5) and t.is_contiguous() and t.data_ptr() % align == 0
    for bad in (0, -4, 3, 6, 12):
        with pytest.raises(ConfigurationError) as refused:
            aligned_empty((4,), torch.float32, bad)
        assert str(refused.value) == f"align must be a power of two; got {bad!r}"


def test_host_pools_close_twice_and_name_their_statistics_and_allocators() -> None:
    g = _group_with_two_sidecars()
    g.add_logical_pool("anchor", page_size=8, host_slots=32, device_slots=32)
    assert g["anchor"].host.allocator.name == "anchor"  # type: ignore[union-attr]
    stats = g.statistics()
    assert [stats[n].name for n in ("kv", "a", "anchor")] == ["kv", "a", "anchor"]
    host = g["kv"].host
    assert isinstance(host, HostPool)
    host.close()
    host.close()  # again: nothing left to unregister
    assert host.buffer(0).numel() > 0  # the buffers stay readable


def test_layers_are_stacked_only_when_they_are_evenly_spaced_views_of_one_storage() -> None:
    one = torch.arange(2 * 8 * 2, dtype=torch.float32).reshape(2, 8, 2)
    stacked = DevicePool([one[0], one[1]])
    view = stacked.stacked(0)
    assert view is not None and torch.equal(view, one)
    assert repr(stacked).endswith(", stacked]>")
    a, b = torch.zeros(16, 2), torch.ones(16, 2)
    apart = DevicePool([a[0:8], b[8:16]])  # the offsets of one storage, but two storages
    assert apart.stacked(0) is None and not repr(apart).endswith(", stacked]>")
    same = DevicePool([a[0:8], a[0:8]])  # one view twice: not two layers of one buffer
    assert same.stacked(0) is None


# -- HostPool.registration_cuts: where one pinned registration ends in a layer view ----


class CountingPinning:
    """A `PinningRuntime` that records registrations (address -> bytes) instead of calling CUDA."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}

    def register(self, ptr: int, size: int) -> int:
        self.registered[ptr] = size
        return 0

    def unregister(self, ptr: int) -> int:
        self.registered.pop(ptr)
        return 0

    def clear_error(self, code: int) -> None:
        raise AssertionError(f"nothing failed, yet error {code} was cleared")


def pinned_pool(monkeypatch: pytest.MonkeyPatch, rt: CountingPinning, **kwargs: object) -> HostPool:
    import kvtier.pools.host as host_module

    monkeypatch.setattr(host_module, "TorchPinningRuntime", lambda: rt)
    return HostPool("kv", planes=[PlaneSpec((64,), torch.uint8)], page_size=1, pin_memory=True,  # type: ignore[arg-type]
                    pin_chunk_bytes=host_module.HOST_PAGE_BYTES, **kwargs)


def cuts_from_registrations(pool: HostPool, rt: CountingPinning, row_bytes: int = 64) -> list[tuple[int, ...]]:
    """Per layer: the rows of its view where a registration other than the one holding
    the view's first row begins (from the registrations' addresses, not from HostPool)."""
    base = pool.buffer(0).data_ptr()
    starts = sorted((ptr - base) // row_bytes for ptr in rt.registered)
    return [tuple(r - j * pool.slots for r in starts if j * pool.slots < r < (j + 1) * pool.slots)
            for j in range(pool.num_layers)]


@pytest.mark.parametrize("slot_rows", [0, -1])
def test_registration_cuts_are_the_rows_where_a_registration_begins(
    monkeypatch: pytest.MonkeyPatch, slot_rows: int
) -> None:
    """Registrations of one host page (64 rows of 64 bytes here). With 128 slots a
    registration ends exactly where layer 1 begins: that is no cut in either view
    (layer 0 ends there, layer 1 starts with a fresh registration). With 127 slots
    layer 1 begins one row before a registration ends: its cut is at row 1."""
    import kvtier.pools.host as host_module

    rows = host_module.HOST_PAGE_BYTES // 64
    rt = CountingPinning()
    pool = pinned_pool(monkeypatch, rt, num_layers=2, slots=2 * rows + slot_rows)
    cuts = [pool.registration_cuts(j, 0) for j in range(2)]
    assert cuts == cuts_from_registrations(pool, rt)
    assert cuts == ([(rows,), (rows,)] if slot_rows == 0 else [(rows,), (1, rows + 1)])
    pool.close()
    assert rt.registered == {} and [pool.registration_cuts(j, 0) for j in range(2)] == [(), ()]


def test_page_first_layer_views_have_no_cuts_unless_there_is_one_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A page_first layer view with several layers is strided (never copied directly):
    no cuts, though its buffer is registered in chunks; with one layer it is the buffer."""
    import kvtier.pools.host as host_module

    rows = host_module.HOST_PAGE_BYTES // 64
    rt = CountingPinning()
    pool = pinned_pool(monkeypatch, rt, num_layers=3, slots=2 * rows, layout="page_first")
    assert len(rt.registered) == 6
    assert [pool.registration_cuts(j, 0) for j in range(3)] == [(), (), ()]
    pool.close()
    one = pinned_pool(monkeypatch, rt, num_layers=1, slots=3 * rows, layout="page_first")
    assert one.registration_cuts(0, 0) == (rows, 2 * rows) == cuts_from_registrations(one, rt)[0]
    one.close()


def test_a_sidecar_is_pinned_as_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """add_sidecar(pin_memory=True) page-locks the sidecar's host rows (here through a
    recording runtime: no CUDA on this machine, where the default would not pin)."""
    rt = CountingPinning()
    import kvtier.pools.host as host_module

    monkeypatch.setattr(host_module, "TorchPinningRuntime", lambda: rt)
    g = PoolGroup()
    g.add_pool("kv", device=device(1, 32), page_size=4, host_slots=64)
    h = g.add_sidecar("sc", source="kv", rows_per_page=2, device=DevicePool([torch.zeros(16, 8)]), pin_memory=True)
    assert h.pinned
    assert rt.registered == {h.buffer(0).data_ptr(): h.buffer(0).numel() * h.buffer(0).element_size()}
    plain = g.add_sidecar("sc2", source="kv", rows_per_page=2, device=DevicePool([torch.zeros(16, 8)]),
                          pin_memory=False)
    assert not plain.pinned and len(rt.registered) == 1
    g.close()
    assert rt.registered == {}


def test_one_element_layers_side_by_side_are_stacked() -> None:
    """The smallest layer stride there is, one element: layers of one slot of one
    element, adjacent, are stacked as any adjacent layers are."""
    flat = torch.arange(3, dtype=torch.float32)
    views = [flat[j : j + 1] for j in range(3)]
    stacked = DevicePool([[v] for v in views]).stacked(0)
    assert stacked is not None and stacked.shape == (3, 1) and stacked.stride() == (1, 1)
    assert stacked.data_ptr() == flat.data_ptr() and torch.equal(stacked.flatten(), flat)
