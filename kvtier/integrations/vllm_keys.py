"""vLLM's storage keys: the key of a block in the storage tier, and of each
worker's shard of it.

Pure code over kvtier's page identities, without vLLM: the vLLM integration
(`kvtier.integrations.vllm`, which needs vLLM to import) uses it, and kvtier's
own tests reach it in a venv without vLLM, so a change that lets two engines'
blocks share a key fails ``make test``, not only ``make test-vllm``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.storage.identity import PageIdentity, Shard, vllm_block_key, vllm_shard_key

__all__ = ["ShardGeometry", "StorageKeys"]


class StorageKeys:
    """Storage keys for vLLM's offload keys (block hash + group index).

    vLLM's block hash already chains the whole token prefix (and, with its
    default sha256, agrees across processes), so a block's storage key is
    BLAKE2b of a namespace root and that hash. The root is the vLLM block's
    `PageIdentity` (`PageIdentity.for_vllm_block`: the model's identity, the
    block size, the KV dtype, the layer count and the block's byte size), so
    another model's or layout's bytes are never found.

    Each KV cache group's blocks get their own keys: the offload key ends in
    the group index. For a model of several groups, ``groups`` (each group's
    id, token span and layers, `group_layout`) joins the root, so a different
    grouping of the same model is another namespace; a one-group model passes
    none and keeps the keys it always had.

    With tensor or pipeline parallelism (``world``) each worker holds its own
    shard of a block, stored under its own key (`shard`); the scheduler side
    names a block by its key and each worker derives its shard's
    (`identity(rank)` is worker ``rank``'s identity, its `Shard` included).
    """

    def __init__(
        self, *, model: str, block_size: int, dtype: str, num_layers: int, block_bytes: int,
        groups: str = "", world: ShardGeometry | None = None,
    ) -> None:
        self.world = world or ShardGeometry()
        self._block = (model, block_size, dtype, num_layers, block_bytes, groups)
        self._root = self.identity(0).vllm_root()  # the same for every rank

    def identity(self, rank: int) -> PageIdentity:
        """Worker ``rank``'s block identity (its shard of the world; none with one worker)."""
        world = self.world
        # Ranks come from vLLM's own workers, not from user input: a bug if this fires.
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world.world_size:
            raise ValueError(f"rank {rank!r} is not a worker of {world}; ranks are 0 to {world.world_size - 1}")
        shard = Shard(rank, world.world_size, cut=world.cut) if world.world_size > 1 else None
        model, block_size, dtype, num_layers, block_bytes, groups = self._block
        return PageIdentity.for_vllm_block(
            model=model, block_size=block_size, dtype=dtype, num_layers=num_layers, block_bytes=block_bytes,
            groups=groups, shard=shard,
        )

    def __call__(self, offload_key: bytes) -> bytes:
        return vllm_block_key(self._root, offload_key)

    def shard(self, storage_key: bytes, rank: int) -> bytes:
        """The key of worker ``rank``'s shard of the block stored under ``storage_key``.

        With one worker that is ``storage_key`` itself (the keys of an engine
        without tensor or pipeline parallelism are what they always were);
        else BLAKE2b of the key, the geometry and the rank, so that engines of
        another geometry never read a shard cut differently.
        """
        world = self.world
        # Ranks come from vLLM's own workers, not from user input: a bug if this fires.
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world.world_size:
            raise ValueError(f"rank {rank!r} is not a worker of {world}; ranks are 0 to {world.world_size - 1}")
        shard = Shard(rank, world.world_size, cut=world.cut) if world.world_size > 1 else None
        return vllm_shard_key(storage_key, shard)

    def shards(self, storage_key: bytes) -> list[bytes]:
        """Every worker's shard key of one block, in rank order."""
        return [self.shard(storage_key, r) for r in range(self.world.world_size)]


@dataclass(frozen=True, slots=True)
class ShardGeometry:
    """How vLLM's workers cut a block: one shard per worker (rank), for
    ``world_size`` workers from ``tp_size`` x ``pp_size`` (x context parallel)."""

    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        # Built from vLLM's parallel config, which vLLM validated: an invariant, not user input.
        for name in ("world_size", "tp_size", "pp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        if self.world_size % (self.tp_size * self.pp_size):  # vLLM validated its config: an invariant
            raise ValueError(
                f"world_size={self.world_size} is not a multiple of tp_size x pp_size = {self.tp_size * self.pp_size}"
            )

    @property
    def tag(self) -> str:
        return f"world={self.world_size}|{self.cut}"

    @property
    def cut(self) -> str:
        """How the world is cut (a `Shard`'s ``cut``)."""
        return f"tp={self.tp_size}|pp={self.pp_size}"
