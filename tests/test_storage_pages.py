"""Host-pool pages as blobs and back: byte-exact, for both layouts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigurationError, InvalidIndices
from kvtier.pools import HostPool, PoolGroup
from kvtier.storage import (
    BLOB_HEADER_BYTES,
    PageCorrupted,
    PageIdentity,
    StorageError,
    decode_page,
    encode_page,
    pack_rows,
    page_members,
    unpack_rows,
)
from kvtier.testing import hybrid_group

LAYOUTS = ["layer_first", "page_first"]
KEY = b"page-key"  # the page key every blob here is sealed and read under


def randomize(group: PoolGroup, seed: int) -> None:
    """Random bytes in every host buffer (NaN and denormal patterns included)."""
    gen = torch.Generator().manual_seed(seed)
    for spec in group:
        host = spec.host
        if not isinstance(host, HostPool):
            continue
        for p in range(len(host.planes)):
            flat = host.buffer(p).reshape(-1).view(torch.uint8)
            flat.copy_(torch.randint(0, 256, flat.shape, generator=gen, dtype=torch.uint8))


def rows_bytes(host: HostPool, start: int, count: int) -> list[torch.Tensor]:
    """Rows of every layer and plane as uint8, via layer_view (the pools' public view)."""
    return [
        host.layer_view(j, p)[start:start + count].contiguous().view(torch.uint8).clone()
        for p in range(len(host.planes))
        for j in range(host.num_layers)
    ]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("src_layout", LAYOUTS)
@pytest.mark.parametrize("dst_layout", LAYOUTS)
def test_every_pool_round_trips_byte_exact(src_layout: str, dst_layout: str) -> None:
    src, dst = hybrid_group(layout=src_layout), hybrid_group(layout=dst_layout)  # type: ignore[arg-type]
    randomize(src, 1)
    randomize(dst, 2)
    for anchor, page, into in (("kv", 3, 11), ("swa", 0, 15), ("state", 5, 30), ("tok", 7, 2)):
        # The layout is part of a page's identity; the rows' byte order is not:
        # a reader told the writer's identity decodes into either layout.
        ident = PageIdentity.for_pool(src, anchor, model="m")
        blobs = encode_page(src, anchor, page, key=KEY, identity=ident)
        decode_page(dst, anchor, into, blobs, key=KEY, identity=ident)
        for name, (host, start, count) in page_members(src, anchor, page).items():
            dhost, dstart, dcount = page_members(dst, anchor, into)[name]
            assert count == dcount
            assert_same(rows_bytes(host, start, count), rows_bytes(dhost, dstart, dcount))


def test_a_page_covers_the_anchor_and_its_sidecars_rows() -> None:
    g = hybrid_group(page_size=8, ring=3)
    members = {n: (start, count) for n, (_h, start, count) in page_members(g, "kv", 5).items()}
    assert members == {"kv": (40, 8), "c4": (10, 2)}
    assert {n: (s, c) for n, (_h, s, c) in page_members(g, "swa", 2).items()} == {"swa": (16, 8), "swa_state": (6, 3)}
    # A logical anchor holds no bytes: only its sidecar is stored.
    assert {n: (s, c) for n, (_h, s, c) in page_members(g, "tok", 4).items()} == {"idx": (4, 1)}


def test_blob_format_does_not_depend_on_the_layout() -> None:
    lf, pf = hybrid_group(layout="layer_first"), hybrid_group(layout="page_first")
    randomize(lf, 3)
    ident = PageIdentity.for_pool(lf, "kv", model="m")
    decode_page(pf, "kv", 1, encode_page(lf, "kv", 1, key=KEY, identity=ident), key=KEY, identity=ident)
    assert bytes(encode_page(lf, "kv", 1, key=KEY, identity=ident)["kv"]) == bytes(
        encode_page(pf, "kv", 1, key=KEY, identity=ident)["kv"])
    # The identity each derives on its own is the same: a reader of the other
    # layout takes the writer's page as it is, byte-exact.
    assert PageIdentity.for_pool(pf, "kv", model="m") == ident
    randomize(pf, 4)
    decode_page(pf, "kv", 2, encode_page(lf, "kv", 1, key=KEY), key=KEY)
    for name, rows in (("kv", 8), ("c4", 2)):
        a, b = lf[name].host, pf[name].host
        got, want = rows_bytes(b, 2 * rows, rows), rows_bytes(a, rows, rows)
        assert len(got) == len(want) > 0 and all(torch.equal(x, y) for x, y in zip(got, want))


@given(layout=st.sampled_from(LAYOUTS), start=st.integers(0, 127), count=st.integers(1, 128), seed=st.integers(0, 99))
@settings(max_examples=30, deadline=None)
def test_pack_unpack_any_rows(layout: str, start: int, count: int, seed: int) -> None:
    g = hybrid_group(layout=layout)  # type: ignore[arg-type]
    randomize(g, seed)
    host = g["kv"].host
    assert isinstance(host, HostPool)
    count = min(count, host.slots - start)
    before = rows_bytes(host, start, count)
    blob = bytes(pack_rows(host, start, count))
    assert len(blob) == count * host.slot_nbytes
    randomize(g, seed + 1)
    unpack_rows(host, start, count, blob)
    assert_same(before, rows_bytes(host, start, count))


def test_pack_into_a_callers_buffer() -> None:
    g = hybrid_group(layout="page_first")
    randomize(g, 4)
    host = g["state"].host
    assert isinstance(host, HostPool)
    out = bytearray(2 * host.slot_nbytes)
    assert pack_rows(host, 6, 2, out) is out
    assert bytes(out) == bytes(pack_rows(host, 6, 2))
    with pytest.raises(ValueError, match=f"need a {2 * host.slot_nbytes}-byte buffer; got 3"):
        pack_rows(host, 6, 2, bytearray(3))


def test_a_blob_is_a_header_and_the_raw_rows() -> None:
    g = hybrid_group(layout="page_first")
    randomize(g, 6)
    for name, (host, start, count) in page_members(g, "kv", 3).items():
        blob = bytes(encode_page(g, "kv", 3, key=KEY)[name])
        assert len(blob) == BLOB_HEADER_BYTES + count * host.slot_nbytes
        assert blob[:4] == b"KVTB"
        assert blob[BLOB_HEADER_BYTES:] == bytes(pack_rows(host, start, count))


def test_bad_blobs_are_refused_and_nothing_is_written() -> None:
    g = hybrid_group()
    randomize(g, 5)
    blobs = encode_page(g, "kv", 2, key=KEY)
    before = {n: rows_bytes(h, s, c) for n, (h, s, c) in page_members(g, "kv", 4).items()}
    short = {"kv": blobs["kv"], "c4": bytes(blobs["c4"])[:-1]}
    with pytest.raises(
        PageCorrupted,
        match=r"page 4 of pool 'kv' \(key 706167652d6b6579\): the blob of pool 'c4' must hold up to 2 rows of 128 bytes \(256 bytes\) after its 40-byte header, "
              r"a whole number of them; its header says 256 and it holds 255",
    ) as err:
        decode_page(g, "kv", 4, short, key=KEY)
    assert (err.value.pool, err.value.rule, err.value.anchor, err.value.page) == ("c4", "length", "kv", 4)
    assert isinstance(err.value, StorageError) and err.value.operation == "decode"
    with pytest.raises(PageCorrupted, match=r"needs blobs for \['c4', 'kv'\]; got \['kv'\] \(missing \['c4'\]\)") as err:
        decode_page(g, "kv", 4, {"kv": blobs["kv"]}, key=KEY)
    assert (err.value.pool, err.value.rule) == ("kv", "pools")
    with pytest.raises(PageCorrupted, match=r"\(extra \['swa'\]\)"):
        decode_page(g, "kv", 4, {**blobs, "swa": blobs["kv"]}, key=KEY)
    for n, (h, s, c) in page_members(g, "kv", 4).items():
        assert_same(before[n], rows_bytes(h, s, c))


def test_bad_pages_and_pools_are_refused() -> None:
    g = hybrid_group(host_slots=128, page_size=8)
    with pytest.raises(InvalidIndices, match=r"pool 'kv' has host pages 0..15; got page 16"):
        encode_page(g, "kv", 16, key=KEY)
    with pytest.raises(ConfigurationError, match="'c4' is a sidecar"):
        encode_page(g, "c4", 0, key=KEY)
    host = g["kv"].host
    assert isinstance(host, HostPool)
    with pytest.raises(InvalidIndices, match=r"rows 0..127; got 4 rows starting at 126"):
        pack_rows(host, 126, 4)
    with pytest.raises(ConfigurationError, match="holds no bytes"):
        pack_rows(g["tok"].host, 0, 8)  # type: ignore[arg-type]
