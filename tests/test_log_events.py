"""kvtier's log events are a contract: docs/log-events.md is the table, `EVENTS`
the same table as data.

Each test drives some event kinds through a real scheduler (faults from
`FaultInjectingExecutor` and stores of the test's own, damage from
`MemoryStore.corrupt`), captures them with `structlog.testing.capture_logs`,
checks every captured event's level, fields and field types against the table,
and asserts the kinds it was written to produce. Together the tests drive every
row; the package's source is scanned for log calls, so an event in the code
but not in the table (or the other way round) fails.
"""

from __future__ import annotations

import ast
import logging
import re
import threading
from collections.abc import Collection, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import pages, wait_until

import kvtier
from kvtier import (
    OperationCancelled,
    PoolExhausted,
    SchedulerClosed,
    SchedulerConfig,
    TransferFailed,
    TransferScheduler,
)
from kvtier.scheduler.admission import Admission
from kvtier.storage import KeyNamespace, PageBlobs, StorageError, page_keys
from kvtier.testing import FaultInjectingExecutor, MemoryStore, full_attention_group, hybrid_group

PS = 4
ROOT = Path(__file__).resolve().parent.parent
LANES = {"backup", "load", "write_storage", "prefetch"}
Event = MutableMapping[str, Any]  # one captured event

# The contract: event -> (level, {field: type}); docs/log-events.md says the same.
EVENTS: dict[str, tuple[str, dict[str, str]]] = {
    "batch.dispatched": ("debug", {"batch": "int", "lane": "str", "operations": "int", "nbytes": "int"}),
    "batch.completed": ("debug", {
        "batch": "int", "lane": "str", "operations": "int", "nbytes": "int", "ok": "bool", "seconds": "float",
    }),
    "batch.failed": ("warning", {
        "batch": "int", "lane": "str", "operations": "int", "operation_ids": "list[int]", "error": "str",
    }),
    "operation.failed": ("warning", {"operation": "int", "lane": "str", "error": "str"}),
    "operation.cancelled": ("info", {"operation": "int", "lane": "str", "reason": "str"}),
    "operation.storage_failed": ("warning", {"operation": "int", "lane": "str", "error": "str"}),
    "operation.release_failed": ("error", {"operation": "int", "lane": "str", "error": "str"}),
    "allocation.rolled_back": ("info", {"tier": "str", "pools": "list[str]"}),
    "storage.pages_rejected": ("warning", {"batch": "int", "lane": "str", "pages": "int", "first": "list[dict]"}),
    "scheduler.closed": ("debug", {"rollbacks": "int"}),
    # The vLLM worker's (kvtier.integrations.vllm.worker). Driving them needs vLLM,
    # so here their levels and field names are checked against the code's calls.
    "vllm.store_failed": ("warning", {"job_id": "int", "error": "str"}),
    "vllm.write_through_failed": ("warning", {"error": "str"}),
    "vllm.load_refused": ("warning", {"blocks": "int", "error": "str"}),
    "vllm.load_failed": ("warning", {"blocks": "int", "error": "str"}),
    "vllm.load_not_stored": ("warning", {"job_id": "int", "blocks": "int"}),
    "vllm.store_load_failed": ("warning", {"blocks": "int", "error": "str"}),
    "vllm.worker.closed_with_error": ("warning", {"error": "str"}),
    "sealed_store.fault": ("warning", {"operation": "str", "pages": "int", "reason": "str", "store": "str",
                                       "storage_error": "bool"}),
    "sealed_store.pages_broken": ("warning", {"pool": "str", "pages": "int", "rules": "list[str]"}),
    "sealed_store.clear_unsupported": ("warning", {"store": "str"}),
    "sealed_store.close_failed": ("warning", {"error": "str"}),
    "sglang_storage.attached": ("info", {"store": "str", "namespace": "str", "layout": "str", "page_size": "int",
                                         "page_nbytes": "int"}),
    "sglang_storage.page_copy_failed": ("error", {"call": "str", "error": "str"}),
    "sglang_storage.bad_indices": ("error", {"call": "str", "keys": "int", "indices": "int", "page_size": "int"}),
    "sglang_storage.unsupported_policy": ("warning", {"pool": "str", "policy": "str"}),
    "sglang_storage.unknown_pool": ("error", {"pool": "str"}),
    "sglang_storage.bad_target": ("error", {"key": "str", "nbytes": "int"}),
    "sglang_storage.bad_values": ("error", {"keys": "int", "values": "int"}),
    "sglang_storage.land_failed": ("warning", {"start": "int", "error": "str"}),
    "file_store.evicted": ("info", {"directory": "str", "shard": "str", "pages": "int", "bytes": "int",
                                    "shard_bytes": "int", "shard_bound": "int"}),
    "sglang_storage.target_copy_failed": ("warning", {"pages": "int", "error": "str"}),
    "sglang_storage.call_failed": ("error", {"call": "str", "pages": "int", "error": "str"}),
    "config.option_renamed": ("warning", {"engine": "str", "old": "str", "new": "str"}),
}
# Events only read from the code: the rest are driven by the tests below.
# Driven elsewhere (vLLM's own process; tests/test_storage_sealed.py,
# tests/test_storage_bounded.py, tests/test_vllm_options.py and tests/sglang): checked against the code's calls only.
STATIC = {event for event in EVENTS
          if event.startswith(("vllm.", "sealed_store.", "sglang_storage.", "file_store.", "config."))}
# The items of storage.pages_rejected's ``first``.
REJECTED_PAGE: dict[str, str] = {"operation": "int", "pool": "str", "key": "str", "error": "str"}

# The kinds each test below asserts it captured: together, every row.
DRIVES = {
    "test_backups_and_loads_log_one_dispatched_and_one_completed_per_batch": {
        "batch.dispatched", "batch.completed", "scheduler.closed",
    },
    "test_failed_backups_and_loads_log_the_batch_then_each_operation": {
        "batch.dispatched", "batch.failed", "operation.failed", "batch.completed",
    },
    "test_cancels_log_the_operation_and_its_reason": {"operation.cancelled", "scheduler.closed"},
    "test_a_rollback_of_an_allocation_logs_its_tier_and_pools": {"allocation.rolled_back"},
    "test_storage_lanes_log_the_same_batch_events_and_rejected_pages_once_per_batch": {
        "batch.dispatched", "batch.completed", "storage.pages_rejected",
    },
    "test_storage_failures_log_the_batch_or_the_prefetch": {
        "batch.failed", "operation.failed", "operation.storage_failed",
    },
    "test_a_release_that_raises_is_logged_and_the_handle_still_resolves": {
        "operation.release_failed", "operation.failed",
    },
}


def conforms(value: object, kind: str) -> bool:
    """Whether ``value`` has the table's type ``kind`` (a bool is not an int)."""
    inner = re.fullmatch(r"list\[(\w+)\]", kind)
    if inner:
        return type(value) is list and all(conforms(v, inner.group(1)) for v in value)
    return type(value) is {"int": int, "float": float, "bool": bool, "str": str, "dict": dict}[kind]


def check(logs: Sequence[Event], expected: Collection[str]) -> dict[str, list[dict[str, Any]]]:
    """Check every captured event against the table; assert the ``expected``
    kinds are among them; return the events by kind."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for e in logs:
        name = e["event"]
        assert name in EVENTS, f"event {name!r} is not in the table"
        level, fields = EVENTS[name]
        assert e["log_level"] == level, (name, e["log_level"])
        got = {k: v for k, v in e.items() if k not in ("event", "log_level")}
        assert set(got) == set(fields), f"{name}: fields {sorted(got)}, the table says {sorted(fields)}"
        for field, kind in fields.items():
            assert conforms(got[field], kind), f"{name}.{field} = {got[field]!r} is not a {kind}"
        if "lane" in got:
            assert got["lane"] in LANES, got
        for item in got.get("first", []):
            assert set(item) == set(REJECTED_PAGE) and all(conforms(item[k], t) for k, t in REJECTED_PAGE.items())
        by_kind.setdefault(name, []).append(got)
    missing = set(expected) - set(by_kind)
    assert not missing, f"not logged: {sorted(missing)}"
    # One batch.completed per batch.dispatched, with the same batch, lane, count and bytes.
    sent = {e["batch"]: e for e in by_kind.get("batch.dispatched", [])}
    done = [e for e in by_kind.get("batch.completed", [])]
    assert len({e["batch"] for e in done}) == len(done)
    for e in done:
        assert {k: e[k] for k in ("batch", "lane", "operations", "nbytes")} == sent[e["batch"]]
    return by_kind


@pytest.fixture
def logs(kvtier_events: list[Event]) -> list[Event]:
    """Captured events, at every level whatever an earlier test configured."""
    return kvtier_events


def keys_for(tokens: list[int]) -> list[bytes]:
    return page_keys(KeyNamespace(model="m", pool="kv", page_size=PS, dtype="f32", layout="layer_first"), tokens)


# -- the table ----------------------------------------------------------------------


def test_the_docs_table_is_the_contract_the_tests_check() -> None:
    table: dict[str, tuple[str, dict[str, str]]] = {}
    for line in (ROOT / "docs" / "log-events.md").read_text().splitlines():
        row = re.fullmatch(r"\| `([\w.]+)` \| (\w+) \| (.*?) \| .* \|", line)
        if row:
            fields = dict(re.findall(r"`(\w+): ([\w\[\]]+)`", row.group(3)))
            table[row.group(1)] = (row.group(2), fields)
    assert table == EVENTS
    assert "`{operation: int, pool: str, key: str, error: str}`" in (ROOT / "docs" / "log-events.md").read_text()


def log_calls(tree: ast.Module) -> list[tuple[str, str, set[str]]]:
    """Every ``log.<level>("<event>", field=...)`` call in a module: (event, level, fields)."""
    calls = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "log"):
            continue
        first = node.args[0] if node.args else None
        assert isinstance(first, ast.Constant) and isinstance(first.value, str), (
            f"line {node.lineno}: a log call without a literal event"
        )
        assert len(node.args) == 1 and all(k.arg for k in node.keywords), f"line {node.lineno}: fields by name only"
        calls.append((first.value, node.func.attr, {str(k.arg) for k in node.keywords}))
    return calls


def test_every_event_the_package_logs_is_in_the_table_and_every_row_is_logged() -> None:
    """The table covers every event of the package (the scheduler's and the
    vLLM worker's), with its level and the names of its fields. Every module
    logs through `kvtier.logs.get_logger` (stdlib-governed, never configured
    by kvtier); only `kvtier.logs` touches structlog or `logging.getLogger`."""
    in_code: set[tuple[str, str]] = set()
    for path in Path(kvtier.__file__).parent.rglob("*.py"):
        text = path.read_text()
        assert "structlog.configure" not in text, f"{path}: the library never configures structlog"
        if path.name == "logs.py":
            continue
        assert "logging.getLogger" not in text and "import structlog" not in text, (
            f"{path}: kvtier logs through kvtier.logs.get_logger only"
        )
        loggers = re.findall(r"(\w+) = get_logger\((.*?)\)", text)
        if not loggers:
            continue
        # One logger per module, named `log`, under the `kvtier` name.
        assert [name for name, _ in loggers] == ["log"], path
        assert loggers[0][1] in ("__name__", '"kvtier.scheduler"'), path
        for event, level, fields in log_calls(ast.parse(text)):
            assert event in EVENTS, f"{path}: event {event!r} is not in the table"
            assert EVENTS[event][0] == level, (path, event, level)
            assert fields == set(EVENTS[event][1]), f"{path}: {event} logs {sorted(fields)}"
            in_code.add((event, level))
    assert in_code == {(event, level) for event, (level, _) in EVENTS.items()}


def test_no_field_shadows_a_log_record_attribute() -> None:
    """Fields travel as attributes of the standard library's record."""
    reserved = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
    assert not {f for _, fields in EVENTS.values() for f in fields} & reserved


def test_together_the_tests_drive_every_event_kind() -> None:
    assert set().union(*DRIVES.values()) == set(EVENTS) - STATIC
    assert set(DRIVES) <= {name for name in globals() if name.startswith("test_")}


# -- driving each kind --------------------------------------------------------------


async def test_backups_and_loads_log_one_dispatched_and_one_completed_per_batch(logs: list[Event]) -> None:
    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group) as sched:
        # Submitted without a wait between them: one batch of two.
        both = [sched.backup_nowait({"kv": pages(p, page_size=PS)}) for p in (0, 1)]
        for h in both:
            await h
        load = await sched.load(both[0].host_indices, {"kv": pages(8, page_size=PS)})
        await load
    by_kind = check(logs, DRIVES["test_backups_and_loads_log_one_dispatched_and_one_completed_per_batch"])
    sent = by_kind["batch.dispatched"]
    assert [(e["lane"], e["operations"], e["nbytes"]) for e in sent] == [
        ("backup", 2, both[0].nbytes + both[1].nbytes), ("load", 1, load.nbytes),
    ]
    assert all(e["ok"] and e["seconds"] >= 0 for e in by_kind["batch.completed"])
    assert by_kind["scheduler.closed"] == [{"rollbacks": 0}]
    assert not set(by_kind) - {"batch.dispatched", "batch.completed", "scheduler.closed"}


async def test_failed_backups_and_loads_log_the_batch_then_each_operation(logs: list[Event]) -> None:
    # Batches 0 and 2 (the backups) succeed; 1 (a backup) and 3 (a load) fail.
    group = full_attention_group(page_size=PS, device_allocator=True)
    ex = FaultInjectingExecutor(fail_batches={1, 3})
    async with TransferScheduler(group, executor=ex) as sched:
        ok = await sched.backup({"kv": pages(0, page_size=PS)})
        await ok
        bad_backup = await sched.backup({"kv": pages(1, page_size=PS)})
        with pytest.raises(TransferFailed):
            await bad_backup
        ok2 = await sched.backup({"kv": pages(2, page_size=PS)})
        await ok2
        bad_load = await sched.load(ok.host_indices)  # device slots from the allocator, given back on failure
        with pytest.raises(TransferFailed):
            await bad_load
        rollbacks = sched.statistics().rollbacks
    by_kind = check(logs, DRIVES["test_failed_backups_and_loads_log_the_batch_then_each_operation"])
    assert [(e["lane"], e["operation_ids"], e["operations"]) for e in by_kind["batch.failed"]] == [
        ("backup", [bad_backup.id], 1), ("load", [bad_load.id], 1),
    ]
    assert all("InjectedFault" in e["error"] for e in by_kind["batch.failed"])
    assert [(e["lane"], e["operation"]) for e in by_kind["operation.failed"]] == [
        ("backup", bad_backup.id), ("load", bad_load.id),
    ]
    assert [e["ok"] for e in by_kind["batch.completed"]] == [True, False, True, False]
    # The batch's failure, then its operation's, then the batch's end.
    order = [(e["event"], e.get("batch", e.get("operation"))) for e in logs]
    for batch, op in zip([e["batch"] for e in by_kind["batch.failed"]], (bad_backup.id, bad_load.id)):
        assert order.index(("batch.failed", batch)) < order.index(("operation.failed", op)) < order.index(
            ("batch.completed", batch)
        )
    # Giving back a failed load's device slots is no rollback.
    assert rollbacks == 0 and "allocation.rolled_back" not in by_kind


async def test_cancels_log_the_operation_and_its_reason(logs: list[Event]) -> None:
    group = full_attention_group(page_size=PS)
    hold = threading.Event()
    ex = FaultInjectingExecutor(hold=hold)
    try:
        async with TransferScheduler(group, executor=ex, config=SchedulerConfig(on_close="cancel")) as sched:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(lambda: len(ex.history) == 1)
            cancelled = await sched.backup({"kv": pages(1, page_size=PS)})
            assert cancelled.cancel()
            closed = await sched.backup({"kv": pages(2, page_size=PS)})
            hold.set()  # the held batch finishes as the block is left; the queued one is cancelled
    finally:
        hold.set()
    await held
    with pytest.raises(OperationCancelled):
        await cancelled
    with pytest.raises(SchedulerClosed):
        await closed
    by_kind = check(logs, DRIVES["test_cancels_log_the_operation_and_its_reason"])
    assert sorted((e["operation"], e["lane"], e["reason"]) for e in by_kind["operation.cancelled"]) == [
        (cancelled.id, "backup", "OperationCancelled"), (closed.id, "backup", "SchedulerClosed"),
    ]


async def test_a_rollback_of_an_allocation_logs_its_tier_and_pools(logs: list[Event]) -> None:
    # 8 host state slots and 4 device state slots, each pool with a device allocator.
    group = hybrid_group(state_slots=4, device_allocator=True)
    async with TransferScheduler(group) as sched:
        four = await sched.backup({"state": torch.tensor([0, 1, 2, 3])})
        await four
        await (await sched.load(four.host_indices))  # keeps every device state slot
        one = await sched.backup({"kv": pages(0, page_size=8), "state": torch.tensor([0])})
        await one
        with pytest.raises(PoolExhausted):  # kv's device slots are taken, then state is short
            await sched.load(one.host_indices)
        three = await sched.backup({"state": torch.tensor([0, 1, 2])})  # host state is full now
        await three
        with pytest.raises(PoolExhausted):  # kv's host slots are taken, then state is short
            await sched.backup({"kv": pages(1, page_size=8), "state": torch.tensor([1])})
        rollbacks = sched.statistics().rollbacks
    by_kind = check(logs, DRIVES["test_a_rollback_of_an_allocation_logs_its_tier_and_pools"])
    assert by_kind["allocation.rolled_back"] == [{"tier": "device", "pools": ["kv"]}, {"tier": "host", "pools": ["kv"]}]
    assert rollbacks == 2
    assert by_kind["scheduler.closed"] == [{"rollbacks": rollbacks}]


async def test_storage_lanes_log_the_same_batch_events_and_rejected_pages_once_per_batch(
    logs: list[Event],
) -> None:
    group = full_attention_group(page_size=PS)
    store = MemoryStore()
    keys = keys_for(list(range(3 * PS)))
    other = keys_for(list(range(100, 100 + 3 * PS)))
    one_batch_at_a_time = SchedulerConfig(storage_batches_in_flight=1)
    async with TransferScheduler(group, storage=store, config=one_batch_at_a_time) as sched:
        b = await sched.backup({"kv": pages(0, 1, 2, page_size=PS)})
        await b
        w = await sched.write_storage(b.host_indices, {"kv": keys})
        w2 = await sched.write_storage(b.host_indices, {"kv": other})
        await w
        await w2
        store.corrupt(keys[1], "kv", 40)
        store.corrupt(other[0], "kv", 40)
        # While a first prefetch's lookup is held, two more queue: one batch
        # of two, each meeting a damaged page.
        store.hold(("exists",))
        first = await sched.prefetch({"kv": keys_for(list(range(500, 500 + PS)))})
        await wait_until(lambda: len(store.waiting) == 1)
        p1 = await sched.prefetch({"kv": keys})
        p2 = await sched.prefetch({"kv": other})
        store.release()
        await first
        r1, r2 = await p1, await p2
        sched.free_host(r1.host_indices)
        sched.free_host(b.host_indices)
    await store.aclose()
    by_kind = check(logs, DRIVES["test_storage_lanes_log_the_same_batch_events_and_rejected_pages_once_per_batch"])
    sent = {(e["lane"], e["operations"], e["nbytes"]) for e in by_kind["batch.dispatched"]}
    # A prefetch is dispatched with the bytes of every page it asked for (an
    # upper bound: a stored page's length is known when it is read); its
    # handle's nbytes becomes what it read when it ends (the first one missed).
    page = group["kv"].host.slot_nbytes * PS
    assert ("prefetch", 1, page) in sent and ("prefetch", 2, 6 * page) in sent
    assert (first.nbytes, p1.nbytes, p2.nbytes) == (0, page, 0)
    assert {e["lane"] for e in by_kind["batch.dispatched"]} == LANES - {"load"}
    assert sum(e["operations"] for e in by_kind["batch.dispatched"] if e["lane"] == "write_storage") == 2
    rejected = by_kind["storage.pages_rejected"]
    assert len(rejected) == 1 and rejected[0]["lane"] == "prefetch" and rejected[0]["pages"] == 2
    assert sorted((f["operation"], f["pool"], f["key"]) for f in rejected[0]["first"]) == [
        (p1.id, "kv", keys[1].hex()), (p2.id, "kv", other[0].hex()),
    ]
    assert (r1.pages, r2.pages) == ({"kv": 1}, {"kv": 0})


class FailingStore:
    """A `MemoryStore` whose ``get`` or ``put`` raises while told to."""

    name = "failing"

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.fail: set[str] = set()

    def _check(self, operation: str) -> None:
        if operation in self.fail:
            raise StorageError(f"{operation} refused by the test", backend=self.name, operation=operation)

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await self.inner.exists(keys)

    async def get(self, keys: Sequence[bytes], pools: Collection[str]) -> list[dict[str, bytes] | None]:
        self._check("get")
        return await self.inner.get(keys, pools)

    async def put(self, pages: Sequence[PageBlobs]) -> None:
        self._check("put")
        await self.inner.put(pages)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_storage_failures_log_the_batch_or_the_prefetch(logs: list[Event]) -> None:
    group = full_attention_group(page_size=PS)
    store = FailingStore()
    keys = keys_for(list(range(2 * PS)))
    async with TransferScheduler(group, storage=store) as sched:
        b = await sched.backup({"kv": pages(0, 1, page_size=PS)})
        await b
        store.fail = {"put"}
        bad_write = await sched.write_storage(b.host_indices, {"kv": keys})
        with pytest.raises(StorageError):
            await bad_write
        store.fail = set()
        await (await sched.write_storage(b.host_indices, {"kv": keys}))
        store.fail = {"get"}
        bad_read = await sched.prefetch({"kv": keys})
        with pytest.raises(StorageError):
            await bad_read
        sched.free_host(b.host_indices)
    await store.aclose()
    by_kind = check(logs, DRIVES["test_storage_failures_log_the_batch_or_the_prefetch"])
    assert [(e["lane"], e["operation_ids"]) for e in by_kind["batch.failed"]] == [("write_storage", [bad_write.id])]
    assert [(e["lane"], e["operation"]) for e in by_kind["operation.storage_failed"]] == [("prefetch", bad_read.id)]
    assert "refused by the test" in by_kind["operation.storage_failed"][0]["error"]
    assert [(e["lane"], e["operation"]) for e in by_kind["operation.failed"]] == [
        ("write_storage", bad_write.id), ("prefetch", bad_read.id),
    ]
    # The prefetch's batch itself went on: it completed.
    assert [e["ok"] for e in by_kind["batch.completed"] if e["lane"] == "prefetch"] == [True]


async def test_a_release_that_raises_is_logged_and_the_handle_still_resolves(
    logs: list[Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    group = full_attention_group(page_size=PS)
    release = Admission.release
    broken: list[object] = []

    def release_or_raise(self: Admission, claim: Any, **kwargs: Any) -> None:
        if claim in broken:
            raise RuntimeError("release broke")
        release(self, claim, **kwargs)

    monkeypatch.setattr(Admission, "release", release_or_raise)
    async with TransferScheduler(group) as sched:
        ok = await sched.backup({"kv": pages(0, page_size=PS)})
        await ok
        load = await sched.load(ok.host_indices, {"kv": pages(8, page_size=PS)})
        broken.append(load._carrier.claim)  # type: ignore[attr-defined]  # the claim its queue entry holds
        with pytest.raises(RuntimeError, match="release broke"):
            await load
        monkeypatch.setattr(Admission, "release", release)
        sched.free_host(ok.host_indices)
    by_kind = check(logs, DRIVES["test_a_release_that_raises_is_logged_and_the_handle_still_resolves"])
    assert by_kind["operation.release_failed"] == [
        {"operation": load.id, "lane": "load", "error": "RuntimeError('release broke')"}
    ]
    assert [e["operation"] for e in by_kind["operation.failed"]] == [load.id]
