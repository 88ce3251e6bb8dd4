"""Which of vLLM's KV cache groups kvtier moves, and over which tensors.

A hybrid model (Gemma-2: sliding window + full attention) has several KV
cache groups. vLLM's offloading API already does the per-group work: its
scheduler asks, per group, for the blocks that group holds (a sliding-window
group only its window, at the boundaries a later load can reach), puts the
group index in each offload key (block hash + 4 bytes of group index), and
hands the worker one job whose device blocks are the groups' blocks, group
after group, in the same order as the job's keys.

What is left to kvtier is where a group's block lives. vLLM's hybrid
allocator gives every group one block id space over tensors that the groups
overlay (a block id is owned by one group at a time), so a block of any group
is the same rows of those tensors. kvtier therefore moves every group through
one device pool over the union of the groups' tensors, with one host page
space and one LRU in the manager: a host block holds a block of any group, and
the group index in the key keeps their pages and storage keys apart. Rows of a
tensor that the owning group has no layer in are unused by every group while
that group owns the block, so moving them is harmless.

Refused, with `ConfigurationError` (`check_groups`): in a model of several
groups, any group that is not full attention or a sliding window; see
`UNSUPPORTED` for what each kind lacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigurationError

__all__ = ["SUPPORTED", "UNSUPPORTED", "GroupInfo", "check_groups", "group_infos", "group_layout", "union_tensors"]

# vLLM's KVCacheSpec class names kvtier moves in a model of several groups.
SUPPORTED = ("FullAttentionSpec", "SlidingWindowSpec")

# What is missing for the kinds vLLM 0.32 may offload but kvtier refuses.
UNSUPPORTED = {
    "MambaSpec": (
        "its recurrent state reaches the offloading spec through vLLM's copy-on-write boundary hand-offs "
        "(boundary_state_offloads, partial-tail store jobs keyed per request boundary), in padded state pages; "
        "kvtier has no test of that path against vLLM's CPU build, so it does not move them"
    ),
    "ChunkedLocalAttentionSpec": (
        "no model that vLLM's CPU build runs here has chunked local attention (Llama-4), so kvtier has no test "
        "that its blocks come back exact"
    ),
}
_OTHER = "kvtier has no test of this kind of group inside vLLM"


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """One offloaded KV cache group: vLLM's group id, its spec class, its first layer."""

    group_id: int
    kind: str
    first_layer: str
    num_layers: int


def group_infos(kv_cache_config: Any) -> tuple[GroupInfo, ...]:
    """The groups vLLM's offloading connector moves, in its order (the offload keys' group ids)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids

    out = []
    for gid in get_offloading_group_ids(kv_cache_config):
        group = kv_cache_config.kv_cache_groups[gid]
        names = list(group.layer_names)
        out.append(GroupInfo(gid, type(group.kv_cache_spec).__name__, names[0] if names else "", len(names)))
    return tuple(out)


def check_groups(groups: Sequence[GroupInfo]) -> None:
    """Refuse a model of several groups with a group kvtier does not move.

    One group is taken as it is (whatever its kind, as before hybrid
    support). Raises `ConfigurationError` naming the group, its kind and
    what is missing; changes nothing.
    """
    if len(groups) <= 1:
        return
    for g in groups:
        if g.kind in SUPPORTED:
            continue
        why = UNSUPPORTED.get(g.kind, _OTHER)
        raise ConfigurationError(
            f"kvtier moves a hybrid model's KV cache groups when each is {' or '.join(SUPPORTED)}; "
            f"group {g.group_id} (layer {g.first_layer!r}, {g.num_layers} layers) is {g.kind}: {why}"
        )


def union_tensors(group_tensor_ids: Sequence[Sequence[int]]) -> list[int]:
    """The tensors a block of any group spans, in vLLM's tensor order.

    ``group_tensor_ids[g]``: the tensor indices of group ``g``'s layers.
    Raises `ConfigurationError` when no group names a tensor.
    """
    used = sorted({i for ids in group_tensor_ids for i in ids})
    if not used:
        raise ConfigurationError("vLLM registered no KV cache tensors")
    return used


def group_layout(groups: Sequence[Any]) -> str:
    """The storage namespace's word for a model's groups (vLLM's `OffloadingGroupConfig`s):
    each group's id, tokens per block and layer names, in order. Empty for one
    group, so a one-group model's storage keys stay what they were."""
    if len(groups) <= 1:
        return ""
    return ";".join(
        f"{g.group_id}:{g.tokens_per_block}:{','.join(g.layer_names)}" for g in groups
    )
