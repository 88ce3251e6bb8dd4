"""What the scheduler costs the engine's thread, counted (never timed): the
reference cycles it leaves per operation, the torch operators it runs on the
loop per operation, how the handles read their pages, and the import graph of
`kvtier.scheduler` (no circle, so an index's path goes down)."""

from __future__ import annotations

import ast
import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import pages
from kvtier import TransferScheduler
from kvtier.bench.core import NoCopyExecutor
from kvtier import OperationCancelled, PrefetchResult
from kvtier.testing import MemoryStore, full_attention_group, hybrid_group

SCHEDULER = Path(__file__).resolve().parent.parent / "kvtier" / "scheduler"


async def run_ops(sched: TransferScheduler, path: str, requests: list[dict[str, torch.Tensor]]) -> list[Any]:
    if path == "single":
        handles = [await sched.backup(r) for r in requests]
    else:
        handles = await sched.backup_many(requests)
    for h in handles:
        await h
    return [h.host_indices for h in handles]


@pytest.mark.parametrize("path", ["single", "bulk"])
async def test_operations_leave_no_cyclic_garbage(path: str) -> None:
    n = 10_000
    group = full_attention_group(page_size=1, device_slots=n, host_slots=n, layers=1)
    requests = [{"kv": idx} for idx in torch.split(torch.arange(n), 1)]
    async with TransferScheduler(group, NoCopyExecutor()) as sched:
        await run_ops(sched, path, requests[:256])  # warm-up: the lanes' first batches
        sched.free_host({"kv": torch.arange(256)})
        gc.collect()
        gc.disable()
        try:
            got = await run_ops(sched, path, requests)
            found = gc.collect()
        finally:
            gc.enable()
        assert found == 0, f"{found} objects in reference cycles after {n:,} operations ({path} path)"
        sched.free_host({"kv": torch.cat([h["kv"] for h in got])})


async def test_storage_operations_leave_no_cyclic_garbage() -> None:
    """Storage carriers too: a write, prefetches of every policy (a deadline
    armed and dropped, a stop), a cancel while queued; handles read, results
    kept. The carrier keeps no handle, and its timer goes with its end."""
    n = 64
    group = full_attention_group(page_size=1, device_slots=n, host_slots=4 * n, layers=1)
    store = MemoryStore()
    keys = [b"key-%d" % i for i in range(n)]
    async with TransferScheduler(group, NoCopyExecutor(), storage=store) as sched:
        backed = await sched.backup({"kv": torch.arange(n)})
        await backed
        host = backed.host_indices

        async def storage_ops() -> list[Any]:
            kept: list[Any] = [await (await sched.write_storage(host, {"kv": keys}))]
            for policy, timeout in (("best_effort", None), ("wait_complete", None), ("timeout", 60.0)):
                kept.append(await (await sched.prefetch({"kv": keys[:8]}, policy=policy, timeout_s=timeout)))
            stopped = await sched.prefetch({"kv": keys[:8]})
            assert stopped.stop() and stopped.queued is False
            kept.append(await stopped)
            cancelled = await sched.write_storage(host, {"kv": keys})
            assert cancelled.cancel() and cancelled.done()
            # Read, not raised: a raised error's traceback holds the awaiting frame,
            # a cycle of Python's making (the error is kept for a second await).
            assert isinstance(cancelled.exception(), OperationCancelled)
            return kept

        for r in await storage_ops():  # warm-up: the lanes' first batches
            if isinstance(r, PrefetchResult):
                sched.free_host(r)
        gc.collect()
        gc.disable()
        try:
            kept = await storage_ops()
            found = gc.collect()
        finally:
            gc.enable()
        assert found == 0, f"{found} objects in reference cycles after storage operations"
        assert [r.pages_written["kv"] for r in kept[:1]] == [0]  # stored by the warm-up's write
        assert [dict(r.pages) for r in kept[1:]] == [{"kv": 8}] * 3 + [{"kv": 0}]
        for r in kept[1:]:
            sched.free_host(r)


@pytest.mark.parametrize("path", ["single", "bulk"])
async def test_loads_leave_no_cyclic_garbage(path: str) -> None:
    """The load lane's carriers too: device pages given, results and indices read."""
    n = 4_000
    group = full_attention_group(page_size=1, device_slots=n, host_slots=n, layers=1)
    async with TransferScheduler(group, NoCopyExecutor()) as sched:
        held = await run_ops(sched, "bulk", [{"kv": idx} for idx in torch.split(torch.arange(n), 1)])
        hosts = [{"kv": h["kv"]} for h in held]
        devices = [{"kv": idx} for idx in torch.split(torch.arange(n), 1)]

        async def loads(count: int) -> list[Any]:
            if path == "single":
                handles = [await sched.load(hosts[i], devices[i]) for i in range(count)]
            else:
                handles = await sched.load_many(hosts[:count], devices[:count])
            for h in handles:
                await h
            return [h.device_indices for h in handles]

        await loads(256)  # warm-up
        gc.collect()
        gc.disable()
        try:
            await loads(n)
            found = gc.collect()
        finally:
            gc.enable()
        assert found == 0, f"{found} objects in reference cycles after {n:,} loads ({path} path)"
        sched.free_host({"kv": torch.arange(n)})


class Operators(TorchFunctionMode):
    """Counts the torch operators called on this thread (not metadata reads)."""

    metadata = frozenset({"__get__", "dim", "numel", "tolist", "size", "__len__"})

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name not in self.metadata:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["single", "bulk"])
async def test_an_operations_path_on_the_loop_runs_no_torch_operator_per_operation(path: str) -> None:
    """Validation reads the caller's tensor (metadata and ``tolist``); page
    numbers are ints; a carrier makes its slot tensors once for all its
    requests, so reading every handle's ``host_indices`` adds no operator per
    operation either."""
    n = 512
    group = full_attention_group(page_size=1, device_slots=n, host_slots=n, layers=1)
    requests = [{"kv": idx} for idx in torch.split(torch.arange(n), 1)]
    async with TransferScheduler(group, NoCopyExecutor()) as sched:
        await run_ops(sched, path, requests[:64])
        sched.free_host({"kv": torch.arange(64)})
        counted = Operators()
        with counted:
            got = await run_ops(sched, path, requests)
        carriers = -(-n // 128)
        # A few per carrier (its slot tensor, the views) and per 128 checked requests.
        assert len(counted.ops) <= 12 * carriers, counted.ops
        sched.free_host({"kv": torch.cat([h["kv"] for h in got])})


async def _backups(sched: TransferScheduler, path: str, requests: list[dict[str, torch.Tensor]]) -> list[Any]:
    """The backups of ``requests`` by ``path`` (single: an await backup()
    each; bulk: one backup_many; lone: each submitted, awaited and read before
    the next), every handle awaited and its ``host_indices`` read."""
    if path == "lone":
        out = []
        for r in requests:
            h = await sched.backup(r)
            await h
            out.append(h.host_indices)
        return out
    return await run_ops(sched, path, requests)


async def _loads(
    sched: TransferScheduler, path: str, hosts: list[dict[str, torch.Tensor]],
    devices: list[dict[str, torch.Tensor]] | None,
) -> list[Any]:
    """Loads of ``hosts`` (into ``devices``, or into pages of the pool's
    allocator when None) by ``path``, every handle awaited and its
    ``device_indices`` read."""
    if path == "bulk":
        handles = await sched.load_many(hosts, devices)
    elif path == "single":
        handles = [await sched.load(h, None if devices is None else devices[i]) for i, h in enumerate(hosts)]
    else:
        out = []
        for i, h in enumerate(hosts):
            one = await sched.load(h, None if devices is None else devices[i])
            await one
            out.append(one.device_indices)
        return out
    for h in handles:
        await h
    return [h.device_indices for h in handles]


@pytest.mark.parametrize("executor", ["noop", "cpu"])
@pytest.mark.parametrize("path", ["single", "bulk", "lone"])
@pytest.mark.parametrize("device", ["given", "allocated"])
async def test_backups_and_loads_run_no_torch_operator_on_the_loop(path: str, executor: str, device: str) -> None:
    """Every hot path, counted on the loop's thread from the first submission
    until every handle is awaited and its indices read: the single path (an
    ``await backup()`` / ``load()`` each), the bulk path (``backup_many`` /
    ``load_many``) and the lone path (one operation at a time), with the
    executor that copies nothing and with `CpuExecutor` (whose copies run in
    its worker thread, which this mode does not see). Checks read the caller's
    tensors (metadata and ``tolist``), host and device pages are numbers
    (kvtier's `PageAllocator` gives page numbers for the allocated ones), and
    the handed indices are numpy arrays seen through ``torch.from_numpy``: no
    operator at all, per operation or per batch."""
    from kvtier.transfers import CpuExecutor

    n = 256 if path == "lone" else 512
    group = full_attention_group(page_size=1, device_slots=n, host_slots=n, layers=1,
                                 device_allocator=device == "allocated")
    requests = [{"kv": idx} for idx in torch.split(torch.arange(n), 1)]
    made = NoCopyExecutor() if executor == "noop" else CpuExecutor()
    async with TransferScheduler(group, made) as sched:
        await _backups(sched, path, requests[:16])  # warm-up
        sched.free_host({"kv": torch.arange(16)})
        counted = Operators()
        with counted:
            backed = await _backups(sched, path, requests)
        assert counted.ops == [], counted.ops
        hosts = [{"kv": h["kv"]} for h in backed]
        devices = None if device == "allocated" else requests
        counted = Operators()
        with counted:
            loaded = await _loads(sched, path, hosts, devices)
        assert counted.ops == [], counted.ops
        got = torch.cat([d["kv"] for d in loaded])
        assert sorted(got.tolist()) == list(range(n))  # every device slot once
        if device == "allocated":
            allocator = group["kv"].device_allocator
            assert allocator is not None
            allocator.free(got)
        sched.free_host({"kv": torch.cat([h["kv"] for h in hosts])})


@pytest.mark.parametrize("given", ["numpy", "torch"])
async def test_the_array_bulk_path_runs_no_torch_operator_on_the_loop(given: str) -> None:
    """`backup_arrays` then `load_arrays` of its result, results and indices
    read: checks, allocation, carriers and results are numpy and ints. A torch
    tensor given is read through its numpy view (``Tensor.numpy``: metadata,
    no kernel), once per array given."""
    n = 512
    group = full_attention_group(page_size=1, device_slots=n, host_slots=n, layers=1)
    device = np.arange(n).reshape(n, 1)
    dst = np.arange(n)
    if given == "torch":
        device, dst = torch.from_numpy(device), torch.from_numpy(dst)
    async with TransferScheduler(group, NoCopyExecutor()) as sched:
        sched.free_host(await (await sched.backup_arrays({"kv": np.arange(64).reshape(64, 1)})))  # warm-up
        counted = Operators()
        with counted:
            backed = await (await sched.backup_arrays({"kv": device}))
            host, offsets = backed.host_indices, backed.offsets
            loaded = await (await sched.load_arrays({"kv": host["kv"]}, {"kv": offsets["kv"]},
                                                    device_indices={"kv": dst}))
            got = loaded.device_indices["kv"]
        assert backed.all_ok and loaded.all_ok and torch.equal(got, torch.arange(n))
        views = [op for op in counted.ops if op == "numpy"]
        assert [op for op in counted.ops if op != "numpy"] == [], counted.ops
        # The result's host indices and offsets given back (the offsets read for both sides), and the caller's own.
        assert len(views) == (3 if given == "numpy" else 5), counted.ops
        sched.free_host(backed)


SORTS = ("unique", "sort", "argsort", "isin", "lexsort")


@pytest.mark.parametrize("path", ["single", "bulk", "arrays"])
async def test_the_hot_paths_sort_nothing_on_the_loop(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy lets the GIL go while it sorts (``np.unique`` of 2,000 pages:
    tens of microseconds), and beside a busy Python thread each such call
    costs the loop a switch interval (5 ms) to get it back. So the bulk
    checks (no page twice in a request), ownership (writers ended, pages
    pinned and freed) and every other step of a backup, a load of it and a
    free of the pages, counted on the loop's thread, run no numpy sort:
    distinct values are found with a Python set."""
    import threading

    n = 2048
    group = full_attention_group(page_size=1, device_slots=n, host_slots=2 * n, layers=1)
    requests = [{"kv": idx} for idx in torch.split(torch.arange(n), 1)]
    calls: list[str] = []
    loop_thread = threading.get_ident()
    for name in SORTS:
        real = getattr(np, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            if threading.get_ident() == loop_thread:
                calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(np, name, counted)
    async with TransferScheduler(group, NoCopyExecutor()) as sched:
        if path == "arrays":
            backed = await (await sched.backup_arrays({"kv": np.arange(n).reshape(n, 1)}))
            host = backed.host_indices["kv"]
            loaded = await (await sched.load_arrays({"kv": host}, {"kv": backed.offsets["kv"]},
                                                    device_indices={"kv": np.arange(n)}))
            assert backed.all_ok and loaded.all_ok
            sched.free_host({"kv": torch.from_numpy(np.asarray(host))})
        else:
            hosts = [h["kv"] for h in await run_ops(sched, path, requests)]
            if path == "bulk":
                handles = await sched.load_many([{"kv": h} for h in hosts], requests)
            else:
                handles = [await sched.load({"kv": h}, r) for h, r in zip(hosts, requests, strict=True)]
            for h in handles:
                await h
            sched.free_host({"kv": torch.cat(hosts)})
        assert sched.statistics().pools["kv"].free_slots == 2 * n  # every page back
    assert calls == [], calls


# torch.stack writes page_first host rows too (a calibrated backup may choose it).
COPIES = frozenset({"copy_", "index_select", "index_copy_", "index_put_", "take", "__setitem__", "stack"})


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("path", ["lone", "bulk"])
async def test_the_copy_thread_runs_only_copies_as_torch_operators(
    path: str, layout: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In `CpuExecutor`'s thread too every torch operator lets the GIL go (a
    switch interval beside a busy thread), so a batch's plan makes its slot
    tensors in numpy and keeps its views (a page_first host's stacked view is
    a transpose) from one batch to the next: what is left are the copies, and
    views by indexing (``__getitem__``, no operator). Counted in the thread for
    a lone backup and a bulk one, and the bytes compared."""
    from kvtier.transfers import CpuExecutor, cpu

    n = 512
    group = full_attention_group(page_size=1, device_slots=n, host_slots=n, layers=4, layout=layout)
    seen: list[list[str]] = []
    run = cpu.run_batch_copies

    def counted(batch: Any, progress: Any, *calibrator: Any) -> None:
        with Operators() as ops:
            run(batch, progress, *calibrator)
        seen.append([op for op in ops.ops if op not in ("__getitem__", "numpy")])

    monkeypatch.setattr(cpu, "run_batch_copies", counted)
    requests = [{"kv": idx} for idx in torch.split(torch.arange(n), 1)]
    async with TransferScheduler(group, CpuExecutor()) as sched:
        await _backups(sched, path, requests[:4])  # warm-up: the views made once
        sched.free_host({"kv": torch.arange(4)})
        seen.clear()
        hosts = await _backups(sched, path, requests if path == "bulk" else requests[:8])
        assert seen and all(ops and set(ops) <= COPIES for ops in seen), seen
        host = group["kv"].host
        for r, h in zip(requests, hosts):
            for j in range(4):
                for p in range(2):
                    assert torch.equal(host.layer_view(j, p)[h["kv"]], group["kv"].device.tensor(j, p)[r["kv"]])
        sched.free_host({"kv": torch.cat([h["kv"] for h in hosts])})


async def test_host_indices_share_one_array_per_carrier_and_stay_right_after_the_caller_changes_them() -> None:
    group = hybrid_group()
    ps = group["kv"].page_size
    async with TransferScheduler(group) as sched:
        handles = await sched.backup_many([{"kv": pages(i, page_size=ps)} for i in range(3)])
        for h in handles:
            await h
        first = handles[1].host_indices
        want = {name: t.clone() for name, t in first.items()}
        assert set(first) == {"kv", "c4"}
        # Over one array per pool and carrier: the requests' slots one after the other.
        ps_bytes = ps * first["kv"].element_size()
        assert first["kv"].data_ptr() == handles[0].host_indices["kv"].data_ptr() + ps_bytes
        for t in first.values():
            t.fill_(-1)  # the caller's to change ...
        first["kv"].unsqueeze_(0)
        again = handles[1].host_indices  # ... and the handle still gives what it had
        assert set(again) == set(want) and all(torch.equal(again[k], want[k]) for k in want)
        assert all(torch.equal(a, b) for a, b in zip(handles[0].host_indices["kv"], pages(0, page_size=ps)))
        sched.free_host({"kv": torch.cat([h.host_indices["kv"] for h in handles])})


def scheduler_imports() -> dict[str, set[str]]:
    """Module of `kvtier.scheduler` -> the modules of it that it imports,
    type-only imports included."""
    names = {p.stem for p in SCHEDULER.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        tree = ast.parse((SCHEDULER / f"{name}.py").read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("kvtier.scheduler."):
                    deps.add(node.module.split(".")[2])
                elif node.module == "kvtier.scheduler":
                    deps |= {a.name for a in node.names if a.name in names}
        graph[name] = deps & names
    return graph


def test_no_import_circle_inside_the_scheduler() -> None:
    graph = scheduler_imports()
    assert {"carriers", "handles", "requests", "lanes", "admission", "storage", "storage_keys"} <= set(graph)
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", "import circle: " + " -> ".join(path + [node])
        state[node] = "open"
        for dep in sorted(graph[node]):
            visit(dep, path + [node])
        state[node] = "done"
        order.append(node)

    for node in sorted(graph):
        visit(node, [])
    # The pure modules import nothing of the scheduler; handles only promise.
    assert graph["requests"] == set() and graph["handles"] == set() and graph["storage_keys"] == set()
    # The lane knows one entry type, a protocol of its own: no carrier's module.
    assert graph["lanes"] == {"statistics"}


@pytest.mark.parametrize("module", ["lanes", "carriers", "device", "storage"])
def test_the_lane_and_its_entries_read_no_private_state_but_their_own(module: str) -> None:
    """Every underscore name these modules read or write is their own
    (``self._x``): an entry's state is public (`Entry`), a cancel or a stop is
    the carrier's to make (write_storage and prefetch included), and the
    lanes' works ask carriers, not their fields."""
    tree = ast.parse((SCHEDULER / f"{module}.py").read_text())
    foreign = [
        (node.lineno, ast.unparse(node)) for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]
    assert foreign == []
