"""vLLM's storage keys derive from the block's page identity: engines that differ in
one field of it never share a block's key; equal ones always do (unit level, no engine).

`kvtier.integrations.vllm_keys` needs no vLLM, so these run in ``make test``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

BLOCK_HASH = b"\x01" * 32


@dataclasses.dataclass(frozen=True)
class Block:
    model: str = "m|float32"
    block_size: int = 32
    dtype: str = "float32"
    num_layers: int = 2
    block_bytes: int = 32768
    groups: str = ""
    world: tuple[int, int, int] = (1, 1, 1)  # world_size, tp_size, pp_size

    def keys(self) -> Any:
        from kvtier.integrations.vllm_keys import ShardGeometry, StorageKeys

        w, tp, pp = self.world
        return StorageKeys(model=self.model, block_size=self.block_size, dtype=self.dtype, num_layers=self.num_layers,
                           block_bytes=self.block_bytes, groups=self.groups,
                           world=ShardGeometry(world_size=w, tp_size=tp, pp_size=pp))


def test_keys_are_the_ones_vllm_blocks_always_had() -> None:
    """Computed with the code before the identity (commit 0a65281): stores stay readable."""
    tp = Block(world=(4, 2, 2)).keys()
    assert tp(BLOCK_HASH).hex() == "187ff8adac0e114f7beef959e785dff02044d88de4a380a003a96308d0ce6ca9"
    assert [k.hex() for k in tp.shards(tp(BLOCK_HASH))] == [
        "d7b72983dbe42c09427241c953566d28034a80a8fe5ac0aa2a5a992096ffa8f5",
        "1a0bca6f21313a42a300670ae864e481a465293ce8aa6e135d1ac434ee19607a",
        "23bf387300593126cebeea0e59bb862742146f0200303ebdc14883416c624b7a",
        "1f99975fc589e5335c9c7aa80ebbf6a4e9709c691d66ca3565e48039b66ad7e9",
    ]
    grouped = Block(model="m", block_size=16, dtype="bfloat16", num_layers=3, block_bytes=65536,
                    groups="0:full:1-2").keys()
    assert grouped(b"\x02" * 32).hex() == "1c11e83a3bf566e412694466691ecdcc32933a3dc3bc5fd06981f3f268277998"


def _changed(b: Block, what: str) -> Block:
    return {
        "model": lambda: dataclasses.replace(b, model=b.model + "-r2"),
        "block_size": lambda: dataclasses.replace(b, block_size=b.block_size * 2),
        "dtype": lambda: dataclasses.replace(b, dtype={"float32": "fp8_e4m3", "fp8_e4m3": "fp8_e5m2"}.get(b.dtype, "float32")),
        "num_layers": lambda: dataclasses.replace(b, num_layers=b.num_layers + 1),
        "block_bytes": lambda: dataclasses.replace(b, block_bytes=b.block_bytes * 2),
        "groups": lambda: dataclasses.replace(b, groups=b.groups + "|1:swa:3"),
        "world": lambda: dataclasses.replace(b, world=(b.world[0] * 2, b.world[1] * 2, b.world[2])),
        "cut": lambda: dataclasses.replace(b, world=(b.world[0], b.world[0], 1) if b.world[1] != b.world[0]
                                           else (b.world[0], 1, b.world[0])),
    }[what]()


@pytest.mark.parametrize("what", ["model", "block_size", "dtype", "num_layers", "block_bytes", "groups", "world", "cut"])
@given(base=st.builds(
    Block,
    model=st.sampled_from(["m|float32", "Qwen/Qwen3-0.6B|bfloat16"]),
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from(["float32", "fp8_e4m3", "fp8_e5m2"]),
    num_layers=st.integers(1, 4),
    block_bytes=st.sampled_from([4096, 32768]),
    groups=st.sampled_from(["", "0:full:1-2"]),
    world=st.sampled_from([(1, 1, 1), (2, 2, 1), (4, 2, 2)]),
), rank=st.integers(0, 7))
@settings(max_examples=25, deadline=None)
def test_blocks_differing_in_one_field_never_share_a_key(what: str, base: Block, rank: int) -> None:
    if what == "cut" and base.world[0] == 1:
        base = dataclasses.replace(base, world=(4, 2, 2))
    other = _changed(base, what)
    a, b = base.keys(), other.keys()
    ka, kb = a(BLOCK_HASH), b(BLOCK_HASH)
    shards_a, shards_b = set(a.shards(ka)), set(b.shards(kb))
    assert shards_a.isdisjoint(shards_b), f"{what}: a shard key is shared"
    ra, rb = rank % base.world[0], rank % other.world[0]
    assert a.identity(ra) != b.identity(rb) and a.identity(ra).digest() != b.identity(rb).digest()
    # Equal in every field: the same keys, in another process as in this one.
    again = dataclasses.replace(base).keys()
    assert again(BLOCK_HASH) == ka and again.shards(ka) == a.shards(ka) and again.identity(ra) == a.identity(ra)


def test_each_rank_is_its_own_shard_of_the_identity() -> None:
    from kvtier.storage import Shard

    keys = Block(world=(4, 2, 2)).keys()
    assert [keys.identity(r).anchor.shard for r in range(4)] == [Shard(r, 4, "tp=2|pp=2") for r in range(4)]
    assert Block().keys().identity(0).anchor.shard is None  # one worker: the whole block
    with pytest.raises(ValueError, match=r"rank 4 is not a worker"):
        keys.identity(4)


def test_one_worker_stores_a_block_under_the_blocks_own_key() -> None:
    """One worker (no TP or PP): the shard's key is the block's key, as before
    shards existed, and a one-group model's keys are those of ``groups=""``."""
    from kvtier.integrations.vllm_keys import StorageKeys

    keys = Block().keys()
    key = keys(BLOCK_HASH)
    assert keys.shard(key, 0) == key and keys.shards(key) == [key]
    b = Block()
    plain = StorageKeys(model=b.model, block_size=b.block_size, dtype=b.dtype, num_layers=b.num_layers,
                        block_bytes=b.block_bytes)  # no groups, no world: vLLM's one-group, one-worker engine
    assert plain(BLOCK_HASH) == key and plain.identity(0) == keys.identity(0)


@pytest.mark.parametrize("rank", [4, -1, True, 1.0, "1"])
def test_a_rank_outside_the_world_is_refused_naming_it(rank: Any) -> None:
    """Ranks come from vLLM's workers: one that is not a worker of the world
    (out of range, or not an int: a bool is not a rank) is a bug, refused
    by both the identity and the shard key."""
    keys = Block(world=(4, 2, 2)).keys()
    key = keys(BLOCK_HASH)
    message = (f"rank {rank!r} is not a worker of ShardGeometry(world_size=4, tp_size=2, pp_size=2); "
               "ranks are 0 to 3")
    for call in (lambda: keys.identity(rank), lambda: keys.shard(key, rank)):
        with pytest.raises(ValueError) as refused:
            call()
        assert str(refused.value) == message


@pytest.mark.parametrize(("world", "message"), [
    ((0, 1, 1), "world_size must be an int >= 1; got 0"),
    ((2, True, 1), "tp_size must be an int >= 1; got True"),
    ((2, 1, 2.0), "pp_size must be an int >= 1; got 2.0"),
    ((2, "2", 1), "tp_size must be an int >= 1; got '2'"),
    ((6, 2, 2), "world_size=6 is not a multiple of tp_size x pp_size = 4"),
    ((2, 4, 1), "world_size=2 is not a multiple of tp_size x pp_size = 4"),
])
def test_a_geometry_vllm_would_not_build_is_refused_naming_it(world: tuple[Any, Any, Any], message: str) -> None:
    from kvtier.integrations.vllm_keys import ShardGeometry

    w, tp, pp = world
    with pytest.raises(ValueError) as refused:
        ShardGeometry(world_size=w, tp_size=tp, pp_size=pp)
    assert str(refused.value) == message
