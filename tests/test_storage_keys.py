"""Page keys: chained, prefix-closed, namespaced, whole pages only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigurationError
from kvtier.storage import KEY_BYTES, KeyNamespace, page_keys, window_keys
from kvtier.testing import hybrid_group

NS = KeyNamespace(model="llama-3-8b@abc123", pool="kv", page_size=4, dtype="bfloat16", layout="page_first")
tokens_st = st.lists(st.integers(min_value=0, max_value=(1 << 31) - 1), max_size=40)


@given(tokens=tokens_st, cut=st.integers(min_value=0, max_value=40))
@settings(deadline=None)  # timings belong in benchmarks; CI machines are busy
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens: list[int], cut: int) -> None:
    full = page_keys(NS, tokens)
    assert page_keys(NS, tokens[:cut]) == full[: min(cut, len(tokens)) // NS.page_size]


@given(tokens=tokens_st)
@settings(deadline=None)  # timings belong in benchmarks; CI machines are busy
def test_only_whole_pages_get_keys(tokens: list[int]) -> None:
    keys = page_keys(NS, tokens)
    assert len(keys) == len(tokens) // NS.page_size
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    # The tokens of a partial last page do not matter.
    whole = len(tokens) - len(tokens) % NS.page_size
    assert page_keys(NS, tokens[:whole] + [7] * (len(tokens) - whole)) == keys


@given(tokens=st.lists(st.integers(0, 1000), min_size=4, max_size=40), data=st.data())
@settings(deadline=None)  # timings belong in benchmarks; CI machines are busy
def test_a_token_change_at_page_i_changes_keys_i_onwards_only(tokens: list[int], data: st.DataObject) -> None:
    pages = len(tokens) // NS.page_size
    if pages == 0:
        return
    pos = data.draw(st.integers(0, pages * NS.page_size - 1))
    changed = list(tokens)
    changed[pos] += 1
    i = pos // NS.page_size
    a, b = page_keys(NS, tokens), page_keys(NS, changed)
    assert a[:i] == b[:i]
    assert all(x != y for x, y in zip(a[i:], b[i:]))


@given(tokens=st.lists(st.integers(0, 50_000), min_size=4, max_size=24))
@settings(max_examples=50, deadline=None)
def test_any_namespace_field_change_changes_every_key(tokens: list[int]) -> None:
    changes = {
        "model": "llama-3-8b@def456",
        "pool": "swa",
        "page_size": 2,
        "dtype": "float16",
        "layout": "layer_first",
        "extra": ("tp=1/2",),
    }
    base = page_keys(NS, tokens)
    seen = {NS.root()}
    for field, value in changes.items():
        other = dataclasses.replace(NS, **{field: value})  # type: ignore[arg-type]
        keys = page_keys(other, tokens)
        assert not set(keys) & set(base), f"changing {field} kept a key"
        assert other.root() not in seen
        seen.add(other.root())


def test_fields_are_length_prefixed_so_shifting_text_between_them_misses() -> None:
    a = KeyNamespace(model="ab", pool="c", page_size=4, dtype="x", layout="y")
    b = KeyNamespace(model="a", pool="bc", page_size=4, dtype="x", layout="y")
    assert a.root() != b.root()
    assert KeyNamespace("m", "p", 4, "d", "l", ("a", "b")).root() != KeyNamespace("m", "p", 4, "d", "l", ("ab",)).root()


@given(tokens=tokens_st, split_pages=st.integers(0, 10))
@settings(deadline=None)  # timings belong in benchmarks; CI machines are busy
def test_parent_continues_the_chain(tokens: list[int], split_pages: int) -> None:
    cut = min(split_pages * NS.page_size, len(tokens) - len(tokens) % NS.page_size)
    head = page_keys(NS, tokens[:cut])
    tail = page_keys(NS, tokens[cut:], parent=head[-1] if head else None)
    assert head + tail == page_keys(NS, tokens)


def test_tensor_and_list_give_the_same_keys() -> None:
    ids = list(range(100, 117))
    for dtype in (torch.int64, torch.int32):
        assert page_keys(NS, torch.tensor(ids, dtype=dtype)) == page_keys(NS, ids)


def test_keys_are_stable_across_releases() -> None:
    """The derivation is a stored format: changing it (or the blob format) must
    bump _KEY_VERSION. v2 since blobs carry a header and a checksum."""
    keys = page_keys(NS, list(range(8)))
    assert [k.hex()[:16] for k in keys] == GOLDEN


GOLDEN = ["5138a6f4f1ed4080", "75cb699944c880eb"]


def test_bad_tokens_and_parents_are_rejected_with_the_value() -> None:
    with pytest.raises(ValueError, match=r"got 'x' at position 5"):
        page_keys(NS, [1, 2, 3, 4, 5, "x", 7, 8])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"int64 range; got 9223372036854775808 at position 0"):
        page_keys(NS, [1 << 63, 0, 0, 0])
    with pytest.raises(ValueError, match="1-D integer tensor"):
        page_keys(NS, torch.zeros(8))
    with pytest.raises(ValueError, match="32-byte page key"):
        page_keys(NS, [1, 2, 3, 4], parent=b"short")


def test_namespace_validates_its_fields() -> None:
    with pytest.raises(ConfigurationError, match="'model' must be a non-empty string"):
        KeyNamespace(model="", pool="kv", page_size=4, dtype="x", layout="y")
    with pytest.raises(ConfigurationError, match="page_size must be a positive integer; got 0"):
        KeyNamespace(model="m", pool="kv", page_size=0, dtype="x", layout="y")


def test_namespace_for_pool_covers_sidecars_layout_and_dtypes() -> None:
    lf = hybrid_group(layout="layer_first")
    pf = hybrid_group(layout="page_first")
    kv = KeyNamespace.for_pool(lf, "kv", model="m")
    assert kv.pool == "kv" and kv.page_size == 8
    assert "c4=bfloat16" in kv.dtype  # the sidecar is part of the stored page
    # The host layout stores the same bytes (layer by layer): it names no other namespace.
    assert KeyNamespace.for_pool(pf, "kv", model="m") == kv
    roots = {
        KeyNamespace.for_pool(lf, "kv", model="m").root(),
        KeyNamespace.for_pool(lf, "kv", model="other").root(),
        KeyNamespace.for_pool(lf, "swa", model="m").root(),
        KeyNamespace.for_pool(lf, "tok", model="m").root(),
        KeyNamespace.for_pool(lf, "kv", model="m", extra=["tp=0"]).root(),
        KeyNamespace.for_pool(hybrid_group(page_size=16), "kv", model="m").root(),
    }
    assert len(roots) == 6
    with pytest.raises(ConfigurationError, match="'c4' is a sidecar of 'kv'"):
        KeyNamespace.for_pool(lf, "c4", model="m")
    with pytest.raises(ConfigurationError, match="'nope' is not registered"):
        KeyNamespace.for_pool(lf, "nope", model="m")


def test_window_keys_name_the_prefix_end_as_well_as_the_page() -> None:
    tokens = list(range(100, 124))  # 6 pages of 4
    keys = page_keys(NS, tokens)
    w = window_keys(NS, tokens, 2)
    assert len(w) == 2 and all(len(k) == KEY_BYTES for k in w)
    assert w == window_keys(NS, torch.tensor(tokens), 2)  # pure: the same prefix, the same keys
    assert not set(w) & set(keys)  # never a page key
    # Page 4 as the window's first page of a 6-page prefix, and as the last page
    # of a 5-page prefix: different rows kept, so different keys.
    shorter = window_keys(NS, tokens[:20], 2)
    assert shorter[1] != w[0]
    assert not set(shorter) & set(w)
    # A window cached mid-page holds other rows than at the page boundary before
    # it, so it has no keys: it is refused rather than named like the shorter one.
    with pytest.raises(ValueError, match="whole pages of 4 tokens .* got 26 tokens"):
        window_keys(NS, tokens + [7, 8], 2)
    # Chains from a parent like page_keys.
    assert window_keys(NS, tokens[8:], 2, parent=keys[1]) == w
    assert window_keys(NS, tokens, 10) == window_keys(NS, tokens, 6)  # at most the whole pages
    assert len(window_keys(NS, tokens, 10)) == 6
    assert window_keys(NS, [], 2) == []
    # Any namespace field changes them.
    other = KeyNamespace(model="m2", pool=NS.pool, page_size=NS.page_size, dtype=NS.dtype, layout=NS.layout)
    assert not set(window_keys(other, tokens, 2)) & set(w)


@pytest.mark.parametrize("pages", [0, -1, 1.5, True, "2"])
def test_window_keys_need_a_positive_page_count(pages: object) -> None:
    with pytest.raises(ValueError, match=f"window_keys needs pages, a positive integer; got {pages!r}"):
        window_keys(NS, [1, 2, 3, 4], pages)  # type: ignore[arg-type]
