"""Bad input is refused where it enters, as a `KvtierError` naming the value
(issue 44 A3): nothing deeper raises a bare `TypeError`, `AttributeError` or
`UnicodeEncodeError` later, and nothing changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import used

from kvtier import InvalidIndices, TransferScheduler
from kvtier.errors import ConfigurationError, KvtierError
from kvtier.storage import EngineIdentity, EngineNamespace, KeyNamespace, SealedPageStore, page_keys
from kvtier.storage.identity import Shard
from kvtier.storage.pages import decode_page, encode_page, unpack_rows
from kvtier.testing import MemoryStore, full_attention_group, hybrid_group

BAD = ["x", None, 3, 1.5]


async def test_offsets_of_a_pool_the_indices_do_not_name_are_refused() -> None:
    group = full_attention_group(page_size=4)
    kv, off = np.arange(8), np.array([0, 4, 8])
    async with TransferScheduler(group) as sched:
        for offsets in ({"kv": off, "kvv": off}, {"kv": off, "c4": off}):
            with pytest.raises(InvalidIndices, match=r"offsets name pools .*'(kvv|c4)'") as err:
                await sched.backup_arrays({"kv": kv}, offsets)
            assert err.value.rule == "offsets"
        with pytest.raises(InvalidIndices, match="offsets must map pool names"):
            await sched.backup_arrays({"kv": kv}, [off])  # type: ignore[arg-type]
        assert used(group) == {"kv": 0}
        done = await (await sched.backup_arrays({"kv": kv}, {"kv": off}))  # the same call, spelt right
        assert done.all_ok
        sched.free_host(done)


@pytest.mark.parametrize("bad", BAD)
def test_page_functions_refuse_a_wrong_type_naming_it(bad: object) -> None:
    group = hybrid_group()
    ns = KeyNamespace.for_pool(group, "kv", model="m")
    key = page_keys(ns, list(range(ns.page_size)))[0]
    blobs = encode_page(group, "kv", 0, key=key)
    host = group["kv"].host
    before = host.tensor(0, 0).clone() if hasattr(host, "tensor") else None
    calls = [
        lambda: page_keys(bad, [1] * 8),  # type: ignore[arg-type]
        lambda: unpack_rows(bad, 0, 1, b"x"),  # type: ignore[arg-type]
        lambda: unpack_rows(host, 0, 1, bad),  # type: ignore[arg-type]
        lambda: decode_page(group, "kv", 0, bad, key=key),  # type: ignore[arg-type]
    ]
    if bad is not None and not isinstance(bad, str):
        calls.append(lambda: page_keys(ns, bad))  # type: ignore[arg-type]
    if isinstance(bad, str) or bad is None:
        calls += [lambda: page_keys(ns, bad), lambda: page_keys(ns, "x" * 64)]  # type: ignore[arg-type]
    for call in calls:
        with pytest.raises(KvtierError) as err:
            call()
        assert repr(bad)[:20] in str(err.value) or "x" * 20 in str(err.value)
    assert blobs  # the page itself decodes (the refusals were of the arguments alone)
    assert decode_page(group, "kv", 0, blobs, key=key)
    if before is not None:
        assert torch.equal(host.tensor(0, 0), before)


def test_a_sealed_store_whose_opener_returns_no_store_fails_at_construction() -> None:
    ns = EngineNamespace(engine="test", model="m", page_size=4, dtype="bfloat16", layout="page_first",
                         tp_rank=0, tp_size=1)
    for opener in (lambda: object(), lambda: None, lambda: "redis://x"):
        with pytest.raises(ConfigurationError, match="must return a StorageBackend") as err:
            SealedPageStore(opener, ns, timeout_s=5)  # type: ignore[arg-type]
        assert "has no exists" in str(err.value)
    with pytest.raises(ConfigurationError, match="a callable returning a store; got 'redis://x'"):
        SealedPageStore("redis://x", ns)  # type: ignore[arg-type]
    store = SealedPageStore(lambda: MemoryStore(), ns, timeout_s=5)  # a store: accepted
    store.close()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"formats": {"kv": 8}}, "formats"),
        ({"formats": {"kv": ""}}, "formats"),
        ({"formats": {"kv": [8]}}, "formats"),
        ({"formats": {"kv": b"float8_e4m3fn"}}, "formats"),
        ({"formats": {"kv": None}}, "formats"),
        ({"model": "m\udcff"}, "model"),  # what os.fsdecode makes of a name that is not UTF-8
        ({"scheme": "s\ud800"}, "scheme"),
        ({"extra": ("ok", "x\udcfe")}, "extra"),
        ({"formats": {"kv\udcff": "float8_e4m3fn"}}, "formats"),
        ({"formats": {"kv": ("float8_e4m3fn", "f\udcff")}}, "formats"),
        ({"shards": {"kv\udcff": None}}, "shards"),
    ],
)
def test_engine_identity_refuses_a_bad_field_at_construction(kwargs: dict, field: str) -> None:  # type: ignore[type-arg]
    args = {"model": "m", **kwargs}
    with pytest.raises(ConfigurationError, match=f"field '{field}'"):
        EngineIdentity(**args)


def test_a_lone_surrogate_in_a_shard_cut_fails_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="field 'cut' must be valid Unicode"):
        Shard(0, 2, cut="tp=2\udcff")


def test_well_formed_identities_still_build() -> None:
    group = hybrid_group()
    ident = EngineIdentity("m-é", extra=("x",))  # any valid Unicode
    assert ident.page_identity(group, "kv").digest()
    assert EngineIdentity("m", formats={"kv": ("bfloat16",)}).formats == {"kv": ("bfloat16",)}
