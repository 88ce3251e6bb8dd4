"""Page keys: chained, prefix-closed, namespaced, whole pages only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigurationError
from kvtier.storage import KEY_BYTES, KeyNamespace, page_keys, prefix_keys, window_keys
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


# Keys of a namespace with an ``extra`` field, for pages, a window and a prefix pool,
# pinned in full: every constant of the derivation (the personalisation strings,
# the byte order and width of every length and place, the order of the parts) is
# part of the stored format, as in test_keys_are_stable_across_releases.
NS_EXTRA = KeyNamespace(model="llama-3-8b@abc123", pool="kv", page_size=4, dtype="bfloat16", layout="page_first",
                        extra=("tp=2",))
GOLDEN_ROOT = "390e5f6cf44239351eb8a9ac4597f84715a341c50e656813188edb6c55ab7962"
GOLDEN_PAGES = [
    "94deb5d5aef52ebdaea02d5b2423f57645eebc4b16f7a09beefa54e1cdbf86de",
    "f8c04d832e71abbc7f104aca79813e5c0e711306c2cb3a385f2e29a7cbef3653",
    "281740977925352e8866cbaa9b5afb69e02b9852704ad97341189cff6b829cce",
]
GOLDEN_WINDOW = [  # window_keys(NS_EXTRA, tokens[:12], 2)
    "8e24ac944cc5d973382c2d463a0d5c3333cdde037af1704fb83aa36a76f6e2df",
    "d20d698c923180f10d4fa57b9f1f7757f16c934b5f76085c25312f9927ce4fee",
]
GOLDEN_PREFIX = [  # prefix_keys(NS_EXTRA, the third page's key, 2)
    "8dcd9de3b82349a448c8a10766e8bdebbab00c121fc6d1eadd6376eb929bd736",
    "01427228b44346ffffe61d2730c109cde0cbe99535123de189624114f53af463",
]


def test_every_kind_of_key_is_stable_across_releases() -> None:
    tokens = list(range(100, 113))  # three whole pages and one token over
    assert NS_EXTRA.root().hex() == GOLDEN_ROOT
    keys = page_keys(NS_EXTRA, tokens)
    assert [k.hex() for k in keys] == GOLDEN_PAGES
    assert [k.hex() for k in window_keys(NS_EXTRA, tokens[:12], 2)] == GOLDEN_WINDOW
    assert [k.hex() for k in prefix_keys(NS_EXTRA, keys[-1], 2)] == GOLDEN_PREFIX


def test_prefix_keys_name_the_prefix_end_the_pool_and_the_place() -> None:
    tokens = list(range(100, 124))
    keys = page_keys(NS, tokens)
    p = prefix_keys(NS, keys[-1], 3)
    assert len(p) == 3 and len(set(p)) == 3 and all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in p)
    assert prefix_keys(NS, keys[-1], 3) == p  # pure
    assert not set(p) & set(keys)
    # Counted from the end: the last two of three are the two of two.
    assert prefix_keys(NS, keys[-1], 2) == p[1:]
    assert prefix_keys(NS, keys[-1], 1) == p[2:]
    # Another prefix end, or another pool's namespace: no key in common.
    assert not set(prefix_keys(NS, keys[-2], 3)) & set(p)
    other = dataclasses.replace(NS, pool="state")
    assert not set(prefix_keys(other, keys[-1], 3)) & set(p)


@pytest.mark.parametrize("end", [b"short", "a" * KEY_BYTES, None, bytes(KEY_BYTES + 1)])
def test_prefix_keys_need_a_page_key_as_the_end(end: object) -> None:
    with pytest.raises(ConfigurationError, match=r"prefix_keys needs end, the 32-byte page key of the prefix's last page; got"):
        prefix_keys(NS, end, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("pages", [0, -1, 1.5, True, "2"])
def test_prefix_keys_need_a_positive_page_count(pages: object) -> None:
    with pytest.raises(ConfigurationError, match=f"prefix_keys needs pages, a positive integer; got {pages!r}"):
        prefix_keys(NS, bytes(KEY_BYTES), pages)  # type: ignore[arg-type]


def test_one_page_windows_and_one_token_pages_are_allowed() -> None:
    """A recurrent state is a one-token page kept for one page: both 1s are valid."""
    state = KeyNamespace(model="m", pool="state", page_size=1, dtype="float32", layout="page_first")
    assert len(page_keys(state, [5, 6, 7])) == 3
    assert window_keys(NS, list(range(8)), 1) == window_keys(NS, list(range(8)), 2)[1:]
    assert prefix_keys(NS, bytes(KEY_BYTES), 1) == prefix_keys(NS, bytes(KEY_BYTES), 2)[1:]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pool": ""}, "key namespace field 'pool' must be a non-empty string; got ''"),
        ({"dtype": 3}, "key namespace field 'dtype' must be a non-empty string; got 3"),
        ({"page_size": "4"}, "key namespace page_size must be a positive integer; got '4'"),
        ({"page_size": True}, "key namespace page_size must be a positive integer; got True"),
        ({"extra": ["tp=0"]}, r"key namespace extra must be a tuple of strings; got \['tp=0'\]"),
        ({"extra": ("tp=0", 1)}, r"key namespace extra must be a tuple of strings; got \('tp=0', 1\)"),
    ],
    ids=["pool", "dtype", "page_size-str", "page_size-bool", "extra-list", "extra-int"],
)
def test_namespace_refuses_each_bad_field_by_name(fields: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"model": "m", "pool": "kv", "page_size": 4, "dtype": "x", "layout": "y"}
    with pytest.raises(ConfigurationError, match=message):
        KeyNamespace(**{**base, **fields})  # type: ignore[arg-type]
    # Empty dtype and layout are allowed (a pool of no planes has neither).
    KeyNamespace(model="m", pool="kv", page_size=4, dtype="", layout="")


def test_namespace_for_pool_passes_shards_and_formats_on() -> None:
    from kvtier.storage.identity import PageIdentity, Shard

    group = hybrid_group()
    shards = {"kv": Shard(1, 2)}
    formats = {"kv": "int32"}  # float32 planes holding 4-byte integers
    plain = KeyNamespace.for_pool(group, "kv", model="m")
    sharded = KeyNamespace.for_pool(group, "kv", model="m", shards=shards)
    formatted = KeyNamespace.for_pool(group, "kv", model="m", formats=formats)
    assert sharded == PageIdentity.for_pool(group, "kv", model="m", shards=shards).namespace() != plain
    assert formatted == PageIdentity.for_pool(group, "kv", model="m", formats=formats).namespace() != plain
    assert sharded.root() != formatted.root()


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (5, "token ids must be a sequence of ints or a 1-D integer tensor; got 5"),
        (None, "token ids must be a sequence of ints or a 1-D integer tensor; got None"),
        ("abcd", "token ids must be a sequence of ints or a 1-D integer tensor; got 'abcd'"),
        (torch.ones(8, dtype=torch.bool), r"1-D integer tensor; got torch.bool of shape \(8,\)"),
        (torch.zeros(2, 4, dtype=torch.int64), r"1-D integer tensor; got torch.int64 of shape \(2, 4\)"),
    ],
    ids=["int", "None", "str", "bool-tensor", "2-D-tensor"],
)
def test_page_keys_refuse_what_is_not_token_ids(tokens: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        page_keys(NS, tokens)  # type: ignore[arg-type]


def test_page_keys_need_a_namespace() -> None:
    with pytest.raises(ConfigurationError, match=r"page_keys needs a KeyNamespace \(KeyNamespace.for_pool\(...\)\); got 'kv'"):
        page_keys("kv", [1, 2, 3, 4])  # type: ignore[arg-type]


def test_the_int64_range_is_inclusive_and_the_first_bad_token_is_named() -> None:
    lo, hi = -(1 << 63), (1 << 63) - 1
    assert len(page_keys(NS, [lo, hi, 0, 0])) == 1
    with pytest.raises(ConfigurationError, match=r"int64 range; got 9223372036854775808 at position 1"):
        page_keys(NS, [lo, 1 << 63, 0, 0])
    with pytest.raises(ConfigurationError, match=r"int64 range; got -9223372036854775809 at position 1"):
        page_keys(NS, [hi, lo - 1, 0, 0])
