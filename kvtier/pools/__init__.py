"""Pools: allocation, host mirrors, the engine's device tensors, and the group of them."""

from kvtier.pools.allocator import AllocatorStatistics, PageAllocator, SlotAllocator
from kvtier.pools.device import DevicePool, PlaneSpec
from kvtier.pools.group import PoolGroup, PoolSpec, SidecarSpec
from kvtier.pools.host import HostPool, HostPoolStatistics, Layout, LogicalHostPool
from kvtier.pools.ownership import HostPageOwnership
from kvtier.pools.indices import (
    PageList,
    as_index_tensor,
    as_request_list,
    as_slot_tensor,
    page_numbers,
    slots_of_pages,
)

__all__ = [
    "AllocatorStatistics",
    "DevicePool",
    "HostPageOwnership",
    "HostPool",
    "HostPoolStatistics",
    "Layout",
    "LogicalHostPool",
    "PageAllocator",
    "PageList",
    "PlaneSpec",
    "PoolGroup",
    "PoolSpec",
    "SidecarSpec",
    "SlotAllocator",
    "as_index_tensor",
    "as_request_list",
    "as_slot_tensor",
    "page_numbers",
    "slots_of_pages",
]
