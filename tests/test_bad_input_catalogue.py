"""A catalogue of bad input: every case is refused with an error that names the
value and the rule it broke, and changes nothing.

Cases cover pool registration (`add_pool`, `add_logical_pool`, `add_sidecar`),
`backup`, `load`, `free_host`, and configuration (`SchedulerConfig`,
`CpuExecutor`, `DevicePool`, `TransferScheduler`). Each asserts the error type,
searches the message for the value and for the rule separately, and compares
every pool's statistics (and the scheduler's, where one runs) before and after.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvtier import (
    ConfigurationError,
    CpuExecutor,
    InvalidIndices,
    KvtierError,
    NotFinished,
    SchedulerConfig,
    TransferScheduler,
    WrongType,
)
from kvtier.pools import DevicePool, PageAllocator, PoolGroup
from kvtier.scheduler import OperationHandle
from kvtier.testing import hybrid_group

PAGE = 8  # hybrid_group's page size


@dataclass(frozen=True)
class Case:
    """``call`` must raise ``error`` whose message matches ``value`` and ``rule``
    (regular expressions, searched separately); ``rule_id`` is the error's
    ``rule`` attribute where it has one."""

    call: Callable[..., Any]
    error: type[BaseException]
    value: str
    rule: str
    rule_id: str | None = None


def check_message(exc: BaseException, case: Case) -> None:
    text = str(exc)
    assert re.search(case.value, text), f"the message does not name the value {case.value!r}: {text!r}"
    assert re.search(case.rule, text), f"the message does not state the rule {case.rule!r}: {text!r}"
    if case.rule_id is not None:
        assert getattr(exc, "rule", None) == case.rule_id


def kv_layers(layers: int = 2, slots: int = 32, shape: tuple[int, ...] = (2, 8), dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> list[list[torch.Tensor]]:
    return [[torch.zeros((slots, *shape), dtype=dtype, device=device) for _ in "kv"] for _ in range(layers)]


# -- registration and construction ------------------------------------------------
#
# Each call gets a fresh, unfrozen hybrid_group ("kv", "swa", "c4", "swa_state",
# "state", "tok", "idx") and must leave its pools and statistics as they were.


def _frozen(group: PoolGroup) -> None:
    TransferScheduler(group)  # a scheduler freezes the group it uses
    group.add_pool("late", device=DevicePool(kv_layers()), page_size=PAGE, host_slots=32)


def _layers_with(layer: int, plane: int, tensor: torch.Tensor) -> list[list[torch.Tensor]]:
    layers = kv_layers()
    layers[layer][plane] = tensor
    return layers


REGISTRATION = {
    "add_pool: duplicate name": Case(
        lambda g: g.add_pool("kv", device=DevicePool(kv_layers()), page_size=PAGE, host_slots=32),
        ConfigurationError, r"pool 'kv'", r"is already registered",
    ),
    "add_pool: empty name": Case(
        lambda g: g.add_pool("", device=DevicePool(kv_layers()), page_size=PAGE, host_slots=32),
        ConfigurationError, r"got ''$", r"pool names are non-empty strings",
    ),
    "add_pool: host capacity of a partial page": Case(
        lambda g: g.add_pool("x", device=DevicePool(kv_layers()), page_size=PAGE, host_slots=20),
        ConfigurationError, r"got 20 slots", r"capacity must be a whole number of pages of 8 slots",
    ),
    "add_pool: zero host capacity": Case(
        lambda g: g.add_pool("x", device=DevicePool(kv_layers()), page_size=PAGE, host_slots=0),
        ConfigurationError, r"got 0$", r"pool 'x' capacity must be a positive int",
    ),
    "add_pool: negative page size": Case(
        lambda g: g.add_pool("x", device=DevicePool(kv_layers()), page_size=-4, host_slots=32),
        ConfigurationError, r"got -4$", r"pool 'x' page_size must be a positive int",
    ),
    "add_pool: unknown layout": Case(
        lambda g: g.add_pool("x", device=DevicePool(kv_layers()), page_size=PAGE, host_slots=32, layout="row_first"),
        ConfigurationError, r"got 'row_first'", r"layout must be one of \('layer_first', 'page_first'\)",
    ),
    "add_pool: device is not a DevicePool": Case(
        lambda g: g.add_pool("x", device=kv_layers(), page_size=PAGE, host_slots=32),
        ConfigurationError, r"got list", r"pool 'x' device must be a DevicePool",
    ),
    "add_pool: device smaller than a page": Case(
        lambda g: g.add_pool("x", device=DevicePool(kv_layers(slots=4)), page_size=PAGE, host_slots=32),
        ConfigurationError, r"device has 4 slots", r"fewer than one page of 8",
    ),
    "add_pool: device allocator with another page size": Case(
        lambda g: g.add_pool(
            "x", device=DevicePool(kv_layers(), allocator=PageAllocator(32, 4, name="x")),
            page_size=PAGE, host_slots=32,
        ),
        ConfigurationError, r"device allocator has page_size 4", r"the pool's page_size is 8",
    ),
    "add_pool: after a scheduler froze the group": Case(
        _frozen, ConfigurationError, r"cannot add pool 'late'", r"the group is in use by a scheduler",
    ),
    "add_logical_pool: zero device slots": Case(
        lambda g: g.add_logical_pool("t2", page_size=PAGE, host_slots=32, device_slots=0),
        ConfigurationError, r"got 0$", r"pool 't2' device_slots must be a positive int",
    ),
    "add_logical_pool: host capacity of a partial page": Case(
        lambda g: g.add_logical_pool("t2", page_size=PAGE, host_slots=12, device_slots=64),
        ConfigurationError, r"got 12 slots", r"capacity must be a whole number of pages of 8 slots",
    ),
    "add_sidecar: unknown source": Case(
        lambda g: g.add_sidecar("s", source="nope", rows_per_page=1, device=DevicePool(kv_layers())),
        ConfigurationError, r"source 'nope'", r"which is not registered; register the source first",
    ),
    "add_sidecar: source is a sidecar (no chains, no cycles)": Case(
        lambda g: g.add_sidecar("s", source="c4", rows_per_page=1, device=DevicePool(kv_layers())),
        ConfigurationError, r"from sidecar 'c4'", r"a sidecar's source must own slots",
    ),
    "add_sidecar: its own source (a cycle)": Case(
        lambda g: g.add_sidecar("s", source="s", rows_per_page=1, device=DevicePool(kv_layers())),
        ConfigurationError, r"sidecar 's'", r"cannot take its indices from itself",
    ),
    "add_sidecar: zero rows per page": Case(
        lambda g: g.add_sidecar("s", source="kv", rows_per_page=0, device=DevicePool(kv_layers())),
        ConfigurationError, r"got 0$", r"pool 's' rows_per_page must be a positive int",
    ),
    "add_sidecar: too few device rows for the source's pages": Case(
        lambda g: g.add_sidecar("s", source="kv", rows_per_page=4, device=DevicePool(kv_layers(slots=16))),
        ConfigurationError, r"got 16$", r"needs 32 device rows to cover source 'kv' \(8 pages x 4 rows\)",
    ),
    "DevicePool: plane shape differs between layers": Case(
        lambda g: DevicePool(_layers_with(1, 0, torch.zeros(32, 2, 4))),
        ConfigurationError, r"layer 1 plane 0 is \(2, 4\) torch.float32 per slot",
        r"layer 0 plane 0 is \(2, 8\) torch.float32",
    ),
    "DevicePool: plane dtype differs between layers": Case(
        lambda g: DevicePool(_layers_with(1, 1, torch.zeros(32, 2, 8, dtype=torch.bfloat16))),
        ConfigurationError, r"layer 1 plane 1 is \(2, 8\) torch.bfloat16 per slot",
        r"layer 0 plane 1 is \(2, 8\) torch.float32",
    ),
    "DevicePool: slot count differs between planes": Case(
        lambda g: DevicePool(_layers_with(1, 1, torch.zeros(16, 2, 8))),
        ConfigurationError, r"layer 1 plane 1 has 16 slots", r"layer 0 has 32",
    ),
    "DevicePool: a layer on another device (meta)": Case(
        lambda g: DevicePool(_layers_with(1, 0, torch.zeros(32, 2, 8, device="meta"))),
        ConfigurationError, r"layer 1 plane 0 is on meta", r"layer 0 is on cpu",
    ),
    "DevicePool: every layer on the meta device (no storage)": Case(
        lambda g: g.add_pool("x", device=DevicePool(kv_layers(device="meta")), page_size=PAGE, host_slots=32),
        ConfigurationError, r"on device meta", r"a pool's tensors must hold its rows",
    ),
    "DevicePool: layers with different numbers of planes": Case(
        lambda g: DevicePool([kv_layers()[0], kv_layers()[1][:1]]),
        ConfigurationError, r"layer 0 has 2, layer 1 has 1", r"layers must have the same planes",
    ),
    "DevicePool: layer_map names a pool layer that does not exist": Case(
        lambda g: DevicePool(kv_layers(), layer_map=[0, 5]),
        ConfigurationError, r"layer_map\[1\] .* got 5$", r"must be a pool layer in 0..1 or None",
    ),
    "DevicePool: layer_map names a pool layer twice": Case(
        lambda g: DevicePool(kv_layers(), layer_map=[0, 0]),
        ConfigurationError, r"names pool layer 0 twice", r"each pool layer moves with one transfer layer",
    ),
    "SchedulerConfig: zero batch bytes": Case(
        lambda g: SchedulerConfig(max_batch_bytes=0),
        ConfigurationError, r"max_batch_bytes .*got 0$", r"must be an int >= 1",
    ),
    "SchedulerConfig: negative queue bound": Case(
        lambda g: SchedulerConfig(max_queued_ops=-1),
        ConfigurationError, r"max_queued_ops .*got -1$", r"must be an int >= 1",
    ),
    "SchedulerConfig: a bool for a count": Case(
        lambda g: SchedulerConfig(max_batch_ops=True),  # type: ignore[arg-type]
        ConfigurationError, r"max_batch_ops .*got True$", r"must be an int >= 1",
    ),
    "SchedulerConfig: unknown on_close": Case(
        lambda g: SchedulerConfig(on_close="abort"),  # type: ignore[arg-type]
        ConfigurationError, r"got 'abort'", r"on_close must be 'drain' or 'cancel'",
    ),
    "CpuExecutor: zero torch threads": Case(
        lambda g: CpuExecutor(torch_threads=0),
        ValueError, r"got 0$", r"torch_threads must be an int >= 1",
    ),
    "TransferScheduler: not a PoolGroup": Case(
        lambda g: TransferScheduler({"kv": g["kv"]}),  # type: ignore[arg-type]
        TypeError, r"got dict", r"group must be a PoolGroup",
    ),
}


@pytest.mark.parametrize("case", list(REGISTRATION.values()), ids=list(REGISTRATION))
def test_bad_registration_or_configuration_changes_nothing(case: Case) -> None:
    group = hybrid_group()
    names, before = group.names, group.statistics()
    with pytest.raises(case.error) as info:
        case.call(group)
    check_message(info.value, case)
    assert group.names == names
    assert group.statistics() == before


def test_cpu_executor_refuses_a_bool_for_a_thread_count() -> None:
    with pytest.raises(ConfigurationError, match=r"torch_threads must be an int >= 1; got True"):
        CpuExecutor(torch_threads=True)  # type: ignore[arg-type]


# -- backup, load and free_host on a running scheduler ------------------------------
#
# The scheduler runs on hybrid_group() (no device allocators; kv, swa and tok
# have 64 device and 128 host slots in pages of 8; state has 16 device and 32
# host slots in pages of 1). `held` is a finished backup of kv page 0, swa page
# 0 and state slot 0 whose host pages the caller holds; `freed` one whose host
# pages were given back.


@dataclass
class Running:
    sched: TransferScheduler
    held: OperationHandle
    freed: OperationHandle


def kv(*pages: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


SchedulerCall = Callable[[Running], Awaitable[Any] | Any]

OPERATIONS = {
    # backup
    "backup: indices not starting on a page boundary": Case(
        lambda r: r.sched.backup({"kv": torch.arange(4, 12)}),
        InvalidIndices, r"got 8 device indices with a page at position 0 starting at 4",
        r"pool 'kv' needs whole pages of 8 slots starting on a page boundary", "page-aligned",
    ),
    "backup: a partial page": Case(
        lambda r: r.sched.backup({"kv": torch.arange(12)}),
        InvalidIndices, r"got 12 device indices starting at 0",
        r"pool 'kv' needs whole pages of 8 slots", "whole-pages",
    ),
    "backup: a page with a hole": Case(
        lambda r: r.sched.backup({"kv": torch.tensor([8, 9, 10, 11, 12, 13, 14, 16])}),
        InvalidIndices, r"a page at position 0 starting at 8", r"whole pages of 8 slots", "page-aligned",
    ),
    "backup: a page listed twice": Case(
        lambda r: r.sched.backup({"kv": kv(3, 3)}),
        InvalidIndices, r"repeat page 3 \(slots 24..31\)", r"each page may appear once per operation",
        "unique-pages",
    ),
    "backup: device index out of range": Case(
        lambda r: r.sched.backup({"kv": kv(8)}),
        InvalidIndices, r"got index 71", r"pool 'kv' has 64 device slots \(0..63\)", "in-range",
    ),
    "backup: negative device indices": Case(
        lambda r: r.sched.backup({"kv": torch.arange(-8, 0)}),
        InvalidIndices, r"got index -8", r"has 64 device slots \(0..63\)", "in-range",
    ),
    "backup: float indices": Case(
        lambda r: r.sched.backup({"kv": kv(1).float()}),
        InvalidIndices, r"got dtype torch.float32", r"device indices must be an integer tensor", "integer-dtype",
    ),
    "backup: bool indices": Case(
        lambda r: r.sched.backup({"state": torch.tensor([True])}),
        InvalidIndices, r"got dtype torch.bool", r"must be an integer tensor", "integer-dtype",
    ),
    "backup: indices on another device (meta)": Case(
        lambda r: r.sched.backup({"kv": kv(1).to("meta")}),
        InvalidIndices, r"got device meta", r"device indices must be a CPU tensor", "cpu-indices",
    ),
    "backup: two-dimensional indices": Case(
        lambda r: r.sched.backup({"kv": kv(1).reshape(1, PAGE)}),
        InvalidIndices, r"got shape \(1, 8\)", r"must be one-dimensional", "one-dimensional",
    ),
    "backup: indices that are not ints": Case(
        lambda r: r.sched.backup({"state": ["0"]}),
        InvalidIndices, r"got \['0'\]", r"device indices must be ints", "integer-dtype",
    ),
    "backup: no indices for a pool": Case(
        lambda r: r.sched.backup({"kv": torch.arange(0)}),
        InvalidIndices, r"got no device indices", r"an operation moves at least one page", "non-empty",
    ),
    "backup: unknown pool": Case(
        lambda r: r.sched.backup({"nope": kv(1)}),
        InvalidIndices, r"unknown pool 'nope'", r"known pools: \['c4', 'idx', 'kv', 'state', 'swa', 'swa_state', 'tok'\]",
        "known-pool",
    ),
    "backup: a sidecar named without its source": Case(
        lambda r: r.sched.backup({"c4": torch.arange(2, 4)}),
        InvalidIndices, r"pool 'c4' is a sidecar of 'kv'", r"its indices are derived, name 'kv' instead",
        "not-a-sidecar",
    ),
    "backup: a sidecar's rows that its source does not derive": Case(
        lambda r: r.sched.backup({"kv": kv(1), "c4": torch.arange(4, 6)}),
        InvalidIndices, r"pool 'c4' is a sidecar of 'kv'", r"must be the rows derived from 'kv''s pages",
        "derived-indices",
    ),
    "backup: no pools": Case(
        lambda r: r.sched.backup({}),
        InvalidIndices, r"got no device indices", r"an operation names at least one pool", "non-empty",
    ),
    "backup: not a mapping": Case(
        lambda r: r.sched.backup(kv(1)),
        InvalidIndices, r"got Tensor", r"must be a mapping of pool name to indices", "mapping",
    ),
    "backup_nowait: bad indices in a later pool": Case(
        lambda r: r.sched.backup_nowait({"kv": kv(1), "swa": kv(1), "tok": torch.arange(3, 11)}),
        InvalidIndices, r"pool 'tok' .*starting at 3", r"whole pages of 8 slots starting on a page boundary",
        "page-aligned",
    ),
    # load
    "load: host and device lengths differ": Case(
        lambda r: r.sched.load({"kv": r.held.host_indices["kv"]}, {"kv": kv(4, 5)}),
        InvalidIndices, r"pool 'kv' has 8 host indices and 16 device indices", r"they must be equal",
        "equal-lengths",
    ),
    "load: device indices for a pool without host indices": Case(
        lambda r: r.sched.load({"kv": r.held.host_indices["kv"]}, {"kv": kv(4), "swa": kv(4)}),
        InvalidIndices, r"pool 'swa'", r"has device indices but no host indices", "host-and-device",
    ),
    "load: host pages never backed up": Case(
        lambda r: r.sched.load({"kv": kv(9)}, {"kv": kv(4)}),
        InvalidIndices, r"pool 'kv' host page 9", r"is not allocated; an operation reads pages that a backup or prefetch filled",
        "host-pages-held",
    ),
    "load: host pages the caller freed": Case(
        lambda r: r.sched.load({"kv": r.freed.host_indices["kv"]}, {"kv": kv(4)}),
        InvalidIndices, r"pool 'kv' host page 1 ", r"is not allocated", "host-pages-held",
    ),
    "load: host index out of range": Case(
        lambda r: r.sched.load({"kv": kv(16)}, {"kv": kv(4)}),
        InvalidIndices, r"got index 135", r"pool 'kv' has 128 host slots \(0..127\)", "in-range",
    ),
    "load: misaligned device indices": Case(
        lambda r: r.sched.load({"kv": r.held.host_indices["kv"]}, {"kv": torch.arange(2, 10)}),
        InvalidIndices, r"device indices with a page at position 0 starting at 2",
        r"whole pages of 8 slots starting on a page boundary", "page-aligned",
    ),
    "load: no device indices and no device allocator": Case(
        lambda r: r.sched.load({"kv": r.held.host_indices["kv"]}),
        InvalidIndices, r"pool 'kv'", r"has no device allocator; pass its device_indices", "device-indices-needed",
    ),
    "load: a sidecar's host rows named directly": Case(
        lambda r: r.sched.load({"c4": r.held.host_indices["c4"]}, {"c4": torch.arange(2)}),
        InvalidIndices, r"pool 'c4' is a sidecar of 'kv'", r"its indices are derived", "not-a-sidecar",
    ),
    "load: host indices on the meta device": Case(
        lambda r: r.sched.load({"kv": r.held.host_indices["kv"].to("meta")}, {"kv": kv(4)}),
        InvalidIndices, r"got device meta", r"host indices must be a CPU tensor", "cpu-indices",
    ),
    # free_host
    "free_host: pages freed twice": Case(
        lambda r: r.sched.free_host({"kv": r.freed.host_indices["kv"]}),
        InvalidIndices, r"pool 'kv' host page 1 ", r"is not held; a page is freed once", "double-free",
    ),
    "free_host: pages never handed out": Case(
        lambda r: r.sched.free_host({"swa": kv(7)}),
        InvalidIndices, r"pool 'swa' host page 7 ", r"is not held", "double-free",
    ),
    "free_host: one bad pool frees nothing (all or nothing)": Case(
        lambda r: r.sched.free_host({"kv": r.held.host_indices["kv"], "swa": kv(7)}),
        InvalidIndices, r"pool 'swa' host page 7 ", r"a page is freed once", "double-free",
    ),
    "free_host: a partial page": Case(
        lambda r: r.sched.free_host({"kv": r.held.host_indices["kv"][:4]}),
        InvalidIndices, r"got 4 host indices starting at 0", r"whole pages of 8 slots", "whole-pages",
    ),
    "free_host: unknown pool": Case(
        lambda r: r.sched.free_host({"kvv": kv(0)}),
        InvalidIndices, r"unknown pool 'kvv'", r"known pools", "known-pool",
    ),
    "free_host: a sidecar named directly": Case(
        lambda r: r.sched.free_host({"idx": torch.tensor([0])}),
        InvalidIndices, r"pool 'idx' is a sidecar of 'tok'", r"name 'tok' instead", "not-a-sidecar",
    ),
    # not strided: a sparse tensor has int64 values, one dimension and a CPU
    # device, but no memory to read them from (torch raised its own errors)
    "backup: sparse indices": Case(
        lambda r: r.sched.backup({"kv": kv(1).to_sparse()}),
        InvalidIndices, r"got layout torch.sparse_coo", r"device indices must be a dense \(strided\) tensor",
        "strided-indices",
    ),
    "backup_many: sparse indices": Case(
        lambda r: r.sched.backup_many([{"kv": kv(1).to_sparse()}, {"kv": kv(2).to_sparse()}]),
        InvalidIndices, r"request 0: .*got layout torch.sparse_coo", r"must be a dense \(strided\) tensor",
        "strided-indices",
    ),
    "load: sparse host indices": Case(
        lambda r: r.sched.load({"kv": r.held.host_indices["kv"].to_sparse()}, {"kv": kv(4)}),
        InvalidIndices, r"got layout torch.sparse_coo", r"host indices must be a dense \(strided\) tensor",
        "strided-indices",
    ),
    "load_many: sparse device indices": Case(
        lambda r: r.sched.load_many([{"kv": r.held.host_indices["kv"]}], [{"kv": kv(4).to_sparse()}]),
        InvalidIndices, r"got layout torch.sparse_coo", r"device indices must be a dense \(strided\) tensor",
        "strided-indices",
    ),
    "free_host: sparse indices": Case(
        lambda r: r.sched.free_host({"kv": r.held.host_indices["kv"].to_sparse()}),
        InvalidIndices, r"got layout torch.sparse_coo", r"host indices must be a dense \(strided\) tensor",
        "strided-indices",
    ),
    # bulk calls take a list of requests
    "backup_many: one mapping instead of a list": Case(
        lambda r: r.sched.backup_many({"kv": kv(1)}),
        InvalidIndices, r"got one dict", r"backup_many takes a list of requests", "request-list",
    ),
    "backup_many: a set": Case(
        lambda r: r.sched.backup_many({("kv", 1)}),
        InvalidIndices, r"got set", r"takes a list of requests in order", "request-list",
    ),
    "backup_many: a request that is not a mapping": Case(
        lambda r: r.sched.backup_many([{"kv": kv(1)}, kv(2)]),
        InvalidIndices, r"requests 1 must be a mapping .*; got Tensor", r"mapping of pool name to indices",
        "request-list",
    ),
    "backup_many: float indices (the vectorised check's dtype rule)": Case(
        lambda r: r.sched.backup_many([{"kv": kv(1).float()}, {"kv": kv(2).float()}]),
        InvalidIndices, r"request 0: .*got dtype torch.float32", r"must be an integer tensor", "integer-dtype",
    ),
    "backup_many: a run of consecutive slots off the page boundary": Case(
        lambda r: r.sched.backup_many([{"kv": kv(2)}, {"kv": torch.arange(1, 1 + PAGE)}]),
        InvalidIndices, r"request 1: .*a page at position 0 starting at 1",
        r"whole pages of 8 slots starting on a page boundary", "page-aligned",
    ),
    # The one-slot fast paths (a lone one-page request, and a bulk call of one slot per request of a
    # pool of page size 1) refuse the long way, with the same messages.
    "backup: one slot past the end (page size 1)": Case(
        lambda r: r.sched.backup({"state": torch.tensor([16])}),
        InvalidIndices, r"got index 16", r"pool 'state' has 16 device slots \(0..15\)", "in-range",
    ),
    "backup: one negative slot (page size 1)": Case(
        lambda r: r.sched.backup({"state": torch.tensor([-1])}),
        InvalidIndices, r"got index -1", r"pool 'state' has 16 device slots", "in-range",
    ),
    "backup: one slot, two-dimensional (page size 1)": Case(
        lambda r: r.sched.backup({"state": torch.tensor([[3]])}),
        InvalidIndices, r"got shape \(1, 1\)", r"must be one-dimensional", "one-dimensional",
    ),
    "backup: one page, two-dimensional": Case(
        lambda r: r.sched.backup({"kv": kv(1).reshape(PAGE, 1)}),
        InvalidIndices, r"got shape \(8, 1\)", r"must be one-dimensional", "one-dimensional",
    ),
    "backup_many: one slot each, the second past the end": Case(
        lambda r: r.sched.backup_many([{"state": torch.tensor([3])}, {"state": torch.tensor([16])}]),
        InvalidIndices, r"request 1: .*got index 16", r"pool 'state' has 16 device slots", "in-range",
    ),
    "backup_many: one slot each, one negative": Case(
        lambda r: r.sched.backup_many([{"state": torch.tensor([-2])}, {"state": torch.tensor([5])}]),
        InvalidIndices, r"request 0: .*got index -2", r"pool 'state' has 16 device slots", "in-range",
    ),
    "backup_many: one slot each, one two-dimensional": Case(
        lambda r: r.sched.backup_many([{"state": torch.tensor([3])}, {"state": torch.tensor([[4]])}]),
        InvalidIndices, r"request 1: .*got shape \(1, 1\)", r"must be one-dimensional", "one-dimensional",
    ),
    "load_many: one mapping instead of a list": Case(
        lambda r: r.sched.load_many({"kv": r.held.host_indices["kv"]}),
        InvalidIndices, r"got one dict", r"load_many takes a list of host index mappings", "request-list",
    ),
    "load_many: device mappings as a set": Case(
        lambda r: r.sched.load_many([{"kv": r.held.host_indices["kv"]}], {("kv", 4)}),
        InvalidIndices, r"got set", r"takes a list of device index mappings in order", "request-list",
    ),
    # handles
    "layer_ready: a layer out of range": Case(
        lambda r: r.held.layer_ready(4),
        InvalidIndices, r"layer 4 is out of range", r"this group has transfer layers 0..3", "layer-in-range",
    ),
}


@pytest.mark.parametrize("case", list(OPERATIONS.values()), ids=list(OPERATIONS))
async def test_bad_operation_input_changes_nothing(case: Case) -> None:
    group = hybrid_group()
    async with TransferScheduler(group) as sched:
        state = torch.tensor([0])
        held = await sched.backup({"kv": kv(0), "swa": kv(0), "state": state})
        await held
        freed = await sched.backup({"kv": kv(1)})
        await freed
        sched.free_host({"kv": freed.host_indices["kv"]})
        running = Running(sched, held, freed)
        before, stats = group.statistics(), sched.statistics()
        with pytest.raises(case.error) as info:
            result = case.call(running)
            if isinstance(result, Awaitable):
                await result
        check_message(info.value, case)
        assert group.statistics() == before
        assert sched.statistics() == stats
        # The held pages are still the caller's: they load back.
        await (await sched.load({"kv": held.host_indices["kv"]}, {"kv": kv(6)}))


def test_the_catalogue_has_at_least_25_cases() -> None:
    assert len(REGISTRATION) + len(OPERATIONS) >= 25
    assert len(PUBLIC) + len(STORE_CALLS) >= 25


# -- the rest of the public API ------------------------------------------------------
#
# Every user mistake is a KvtierError (docs/troubleshooting.md says so): the
# calls below were plain ValueError / TypeError / KeyError / RuntimeError once.
# Type mistakes are `WrongType` (a ConfigurationError and a TypeError), so code
# that caught the builtin still does.


def _collector(labels: object) -> Any:
    from kvtier.metrics import KvtierCollector
    return KvtierCollector(TransferScheduler(hybrid_group()), labels=labels)  # type: ignore[arg-type]


def _unheld_pin() -> None:
    from kvtier.policies import HostCacheIndex
    HostCacheIndex().pin("b")


def _redis(**kwargs: Any) -> Any:
    from kvtier.storage import RedisStore
    return RedisStore("redis://127.0.0.1:1", **kwargs)  # nothing connects before the first call


def _keys(tokens: Any, **kwargs: Any) -> Any:
    from kvtier.storage import KeyNamespace, page_keys
    ns = KeyNamespace(model="m", pool="kv", page_size=4, dtype="bfloat16", layout="page_first")
    return page_keys(ns, tokens, **kwargs)


def _logical_pool_view() -> Any:
    group = PoolGroup()
    group.add_logical_pool("anchor", page_size=PAGE, host_slots=32, device_slots=64)
    return group["anchor"].host.layer_view(0, 0)


def _merge_orphan_sidecar() -> Any:
    from kvtier.pools import SidecarSpec
    from kvtier.transfers import PoolTransfer, merge_transfers
    sidecars = {"c4": SidecarSpec("kv", 4, 2)}  # source, page size, rows per page
    return merge_transfers([[PoolTransfer("c4", None, None, indices_from_pool="kv")]], sidecars)


PUBLIC = {
    "KvtierCollector: not a scheduler": Case(
        lambda: __import__("kvtier.metrics", fromlist=["KvtierCollector"]).KvtierCollector(object()),
        WrongType, r"got object$", r"scheduler must be a TransferScheduler",
    ),
    "KvtierCollector: a label kvtier uses": Case(
        lambda: _collector({"lane": "x"}), ConfigurationError, r"labels \['lane'\]", r"are kvtier's own",
    ),
    "KvtierCollector: a label name Prometheus refuses": Case(
        lambda: _collector({"engine-id": "0"}), ConfigurationError, r"got 'engine-id'$",
        r"label names match \[a-zA-Z_\]\[a-zA-Z0-9_\]\* and do not start with '__'",
    ),
    "KvtierCollector: a reserved label name": Case(
        lambda: _collector({"__name": "0"}), ConfigurationError, r"got '__name'$", r"do not start with '__'",
    ),
    "KvtierCollector: labels that are not a mapping": Case(
        lambda: _collector(["engine"]), WrongType, r"got list$", r"labels must be a mapping of label name to value",
    ),
    "RedisStore: zero timeout": Case(
        lambda: _redis(timeout_s=0), ConfigurationError, r"got 0$", r"timeout_s must be > 0 seconds",
    ),
    "RedisStore: a timeout that is not a number": Case(
        lambda: _redis(timeout_s="5"), ConfigurationError, r"got '5'$", r"timeout_s must be > 0 seconds",
    ),
    "RedisStore: a prefix with a hash tag": Case(
        lambda: _redis(prefix="{kv}"), ConfigurationError, r"got '\{kv\}'$", r"prefix must be a string and must not contain braces",
    ),
    "RedisStore: negative retries": Case(
        lambda: _redis(retries=-1), ConfigurationError, r"got -1$", r"retries must be an integer >= 0",
    ),
    "TransferScheduler: storage that is not a StorageBackend": Case(
        lambda: TransferScheduler(hybrid_group(), storage=object()),  # type: ignore[arg-type]
        WrongType, r"got object$", r"storage must be a StorageBackend",
    ),
    "HostCacheIndex.pin: a block it does not hold": Case(
        _unheld_pin, ConfigurationError, r"holds no block 'b'", r"pin a block it holds",
    ),
    "page_keys: a token that is not an int": Case(
        lambda: _keys([1, 2, "x", 4]), ConfigurationError, r"got 'x' at position 2", r"token ids must be integers",
    ),
    "page_keys: a short parent": Case(
        lambda: _keys([1, 2, 3, 4], parent=b"short"), ConfigurationError, r"got b'short'", r"parent must be a 32-byte page key",
    ),
    "PageBlobs: an empty key": Case(
        lambda: __import__("kvtier.storage", fromlist=["PageBlobs"]).PageBlobs(b"", {"kv": b"x"}),
        ConfigurationError, r"got b''", r"page keys are 1..256 bytes",
    ),
    "new_sealed: a negative size": Case(
        lambda: __import__("kvtier.storage.sealed", fromlist=["new_sealed"]).new_sealed(-1),
        ConfigurationError, r"got -1$", r"a sealed payload has an integer size >= 0",
    ),
    "get_logger: a name outside kvtier": Case(
        lambda: __import__("kvtier.logs", fromlist=["get_logger"]).get_logger("vllm"),
        ConfigurationError, r"got 'vllm'$", r"kvtier's logger names start with 'kvtier.'",
    ),
    "LogicalHostPool.layer_view: a pool without bytes": Case(
        _logical_pool_view, WrongType, r"logical pool 'anchor'", r"holds no bytes",
    ),
    "merge_transfers: a sidecar without its source": Case(
        _merge_orphan_sidecar, InvalidIndices, r"carries sidecar 'c4' without its source 'kv'",
        r"a sidecar's rows derive from its source's indices",
    ),
    "CudaExecutor: zero copies in flight": Case(
        lambda: __import__("kvtier.transfers.cuda", fromlist=["CudaExecutor"]).CudaExecutor(max_in_flight=0),
        ConfigurationError, r"got 0$", r"max_in_flight must be an int >= 1",
    ),
}


@pytest.mark.parametrize("case", list(PUBLIC.values()), ids=list(PUBLIC))
def test_bad_values_anywhere_in_the_public_api_are_kvtier_errors(case: Case) -> None:
    with pytest.raises(case.error) as info:
        case.call()
    assert isinstance(info.value, KvtierError), type(info.value).__mro__
    check_message(info.value, case)


def test_a_type_mistake_is_still_a_type_error() -> None:
    with pytest.raises(TypeError, match="group must be a PoolGroup; got dict"):
        TransferScheduler({})  # type: ignore[arg-type]
    assert issubclass(WrongType, ConfigurationError) and issubclass(WrongType, TypeError)
    assert issubclass(NotFinished, KvtierError) and issubclass(NotFinished, RuntimeError)


# Calls on a running scheduler with a store: refused before anything is queued.
STORE_CALLS = {
    "prefetch: an unknown policy": Case(
        lambda s: s.prefetch({"kv": [b"k" * 32]}, policy="wait-complete"),
        ConfigurationError, r"got 'wait-complete'$", r"prefetch policy must be one of \['best_effort', ",
    ),
    "prefetch: policy 'timeout' without timeout_s": Case(
        lambda s: s.prefetch({"kv": [b"k" * 32]}, policy="timeout"),
        ConfigurationError, r"got None$", r"prefetch policy 'timeout' needs timeout_s, a finite number > 0",
    ),
    "prefetch: timeout_s with another policy": Case(
        lambda s: s.prefetch({"kv": [b"k" * 32]}, timeout_s=1.0),
        ConfigurationError, r"got timeout_s=1.0 with policy 'best_effort'", r"timeout_s applies to policy 'timeout' only",
    ),
    "prefetch: all_pools that is not a bool": Case(
        lambda s: s.prefetch({"kv": [b"k" * 32]}, all_pools="yes"),
        WrongType, r"got 'yes'$", r"all_pools must be a bool",
    ),
    "backup: a priority past the range": Case(
        lambda s: s.backup({"kv": kv(1)}, priority=2**40),
        ConfigurationError, r"got 1099511627776$", r"priority must be an int in \[-2147483648, 2147483647\]",
    ),
    "backup: a fractional priority": Case(
        lambda s: s.backup({"kv": kv(1)}, priority=1.5),
        ConfigurationError, r"got 1.5$", r"priority must be an int in",
    ),
    "write_storage: a priority that is not an int": Case(
        lambda s: s.write_storage({"kv": kv(1)}, {"kv": [b"k" * 32]}, priority="high"),
        ConfigurationError, r"got 'high'$", r"priority must be an int in",
    ),
}


@pytest.mark.parametrize("case", list(STORE_CALLS.values()), ids=list(STORE_CALLS))
async def test_bad_call_options_are_kvtier_errors_and_change_nothing(case: Case) -> None:
    from kvtier.testing import MemoryStore
    group = hybrid_group()
    async with TransferScheduler(group, storage=MemoryStore()) as sched:
        before, stats = group.statistics(), sched.statistics()
        with pytest.raises(case.error) as info:
            await case.call(sched)
        assert isinstance(info.value, KvtierError)
        check_message(info.value, case)
        assert group.statistics() == before
        assert sched.statistics() == stats


async def test_a_result_asked_for_before_the_end_is_not_finished() -> None:
    import threading

    from kvtier.testing import FaultInjectingExecutor
    hold = threading.Event()
    async with TransferScheduler(hybrid_group(), executor=FaultInjectingExecutor(hold=hold)) as sched:
        one = await sched.backup({"kv": kv(0)})
        bulk = await sched.backup_arrays({"kv": kv(1, 2).reshape(2, PAGE)})
        with pytest.raises(NotFinished, match=rf"operation {one.id} has not ended; await it first"):
            one.outcome()
        with pytest.raises(NotFinished, match=r"the backup bulk call has not ended; await it first"):
            bulk.result()
        hold.set()
        await one
        await bulk
        assert one.host_indices["kv"].numel() == PAGE
        assert bulk.result().count == 2


def test_every_builtin_raise_left_in_the_package_says_why() -> None:
    """The audit stays done: a plain ValueError / TypeError / RuntimeError /
    KeyError left in kvtier (outside the bench and the test kit) is an internal
    invariant, and a comment at it (on the line or the few above) says why."""
    import pathlib
    root = pathlib.Path(kvtier_package_dir())
    bare = re.compile(r"raise (ValueError|TypeError|RuntimeError|KeyError)\b")
    unexplained = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("bench/", "testing/")):
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if bare.search(line) and not any("#" in above for above in lines[max(0, i - 5):i + 1]):
                unexplained.append(f"kvtier/{rel}:{i + 1}: {line.strip()}")
    assert not unexplained, "user mistakes get a KvtierError; an invariant says why:\n" + "\n".join(unexplained)


def kvtier_package_dir() -> str:
    import kvtier
    return str(__import__("pathlib").Path(kvtier.__file__).parent)
