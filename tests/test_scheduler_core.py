"""The scheduler core's promises, one test (or a few) per class of bug.

Each of these failed on the scheduler before it had one lane runtime and one
admission path: a waiter that outlived its page, index tensors read late,
stored bytes not checked, two schedulers over one group, LIFO-ish
backpressure, an engine allocator's bad answer, calls from the wrong thread
or loop, bad priorities, sidecar entries handed back, verify mode lost with
its scheduler, a prefetch's hit rule.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from conftest import pages, rows, used, wait_until
from kvtier import (
    ConfigurationError,
    CorruptionDetected,
    InvalidIndices,
    PageAllocator,
    SchedulerConfig,
    TransferFailed,
    TransferScheduler,
    WrongEventLoop,
)
from kvtier.scheduler import PRIORITY_MAX, PRIORITY_MIN
from kvtier.storage import FileStore, KeyNamespace, page_keys
from kvtier.testing import FaultInjectingExecutor, MemoryStore, full_attention_group, hybrid_group

PS = 4  # page size of full_attention_group below


def one_page_group(**kw: Any):  # type: ignore[no-untyped-def]
    """A kv pool whose host tier holds a single page: a freed page is reused at once."""
    return full_attention_group(page_size=PS, host_slots=PS, **kw)


def keys_for(tokens: list[int], *, page_size: int = PS) -> list[bytes]:
    return page_keys(KeyNamespace(model="t", pool="kv", page_size=page_size, dtype="f32", layout="layer_first"), tokens)


async def checkpoints(n: int = 10) -> None:
    for _ in range(n):
        await anyio.lowlevel.checkpoint()


# -- a waiter that outlives its page -------------------------------------------------


@pytest.mark.parametrize("submit", ["backup", "backup_many", "backup_arrays"])
async def test_a_one_request_backup_is_the_writer_of_its_pages_in_every_pool(submit: str) -> None:
    # A carrier of one request records that request's handle as the writer of
    # its pages in one call: a load of any of its pools waits for it and learns
    # its failure, whether the request came alone, in a bulk call of one, or as
    # one row of arrays with handles asked for.
    gate = threading.Event()
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10, fail_batches={0})
    group = hybrid_group()
    request = {"kv": pages(1, page_size=8), "swa": pages(2, page_size=8), "state": torch.tensor([3])}
    async with TransferScheduler(group, executor=ex) as sched:
        if submit == "backup":
            h = await sched.backup(request)
        elif submit == "backup_many":
            (h,) = await sched.backup_many([request])
        else:
            bulk = await sched.backup_arrays({name: idx.numpy().reshape(1, -1) for name, idx in request.items()},
                                             handles=True)
            (h,) = bulk.handles()
        outcome: dict[str, BaseException | None] = {}

        async def load(pool: str) -> None:
            try:
                await (await sched.load({pool: h.host_indices[pool]}, {pool: request[pool]}))
                outcome[pool] = None
            except Exception as exc:
                outcome[pool] = exc

        async with anyio.create_task_group() as tg:
            for pool in request:
                tg.start_soon(load, pool)
            await checkpoints()
            assert outcome == {}  # every load waits for the backup
            gate.set()
        with pytest.raises(TransferFailed):
            await h
        assert set(outcome) == set(request)
        for pool, err in outcome.items():
            assert isinstance(err, TransferFailed), (pool, err)
        assert sched.statistics().load.completed == 0


@pytest.mark.parametrize("reader", ["load", "write_storage"])
async def test_a_reader_waiting_for_a_backup_never_touches_the_next_owner_of_its_page(reader: str) -> None:
    gate = threading.Event()
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = one_page_group()
    store = MemoryStore()
    target = pages(1, page_size=PS)
    before = rows(group, "kv", target)
    outcome: dict[str, Any] = {}
    try:
        async with TransferScheduler(group, executor=ex, storage=store) as sched:
            b1 = await sched.backup({"kv": pages(0, page_size=PS)})
            first_rows = rows(group, "kv", pages(0, page_size=PS))

            async def next_owner() -> None:
                await b1  # woken before the reader: takes the freed page first
                outcome["b2"] = sched.backup_nowait({"kv": pages(2, page_size=PS)})

            async def read() -> None:
                try:
                    if reader == "load":
                        outcome["read"] = await (await sched.load(b1.host_indices, {"kv": target}))
                    else:
                        outcome["read"] = await (await sched.write_storage(b1.host_indices, {"kv": keys_for([1] * PS)}))
                except Exception as exc:
                    outcome["read"] = exc

            async with anyio.create_task_group() as tg:
                tg.start_soon(next_owner)
                await checkpoints()
                tg.start_soon(read)
                await checkpoints()
                assert "read" not in outcome  # it waits for b1
                sched.free_host(b1.host_indices)  # deferred: b1 still writes the page
                gate.set()
            b2 = outcome["b2"]
            await b2
            assert b2.host_indices["kv"].tolist() == b1.host_indices["kv"].tolist()  # the same page number
            err = outcome["read"]
            assert isinstance(err, InvalidIndices), err
            assert err.rule == "page-generation" and err.pool == "kv"
            assert "were freed while the operation waited for their writer" in str(err)
            # Nothing of the next owner's bytes went anywhere.
            assert all(torch.equal(a, b) for a, b in zip(rows(group, "kv", target), before))
            assert store.pages == {}
            assert first_rows  # b1 held its own rows; b2 those of page 2
            sched.free_host(b2.host_indices)
    finally:
        gate.set()
    assert used(group)["kv"] == 0


# -- indices are values ---------------------------------------------------------------------


@pytest.mark.parametrize("mutation", ["other rows", "out of range"])
async def test_an_engine_may_reuse_its_index_buffer_right_after_submit(mutation: str) -> None:
    gate = threading.Event()
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS)
    src = pages(0, 1, page_size=PS)
    buffer = src.clone()  # the engine's page table
    want = rows(group, "kv", src)
    try:
        async with TransferScheduler(group, executor=ex) as sched:
            backup = await sched.backup({"kv": buffer})
            buffer.copy_(pages(5, 6, page_size=PS) if mutation == "other rows" else torch.full_like(buffer, 10**9))
            gate.set()
            await backup
            # The handle's tensors are the caller's: changing them changes nothing.
            handed = backup.host_indices["kv"]
            handed.fill_(0)
            assert backup.host_indices["kv"].tolist() == slot_list(0, 1)
            assert backup.device_indices["kv"].tolist() == src.tolist()
            dst = pages(9, 10, page_size=PS)
            target = dst.clone()
            load = await sched.load(backup.host_indices, {"kv": target})
            target.fill_(-1)
            await load
            got = rows(group, "kv", dst)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            sched.free_host(backup.host_indices)
    finally:
        gate.set()


def slot_list(*ps: int) -> list[int]:
    return pages(*ps, page_size=PS).tolist()


# -- stored bytes are checked ----------------------------------------------------------------


def damage_page(store: MemoryStore | FileStore, key: bytes, damage: str) -> None:
    """Damage one stored page of the kv-only group as a real store would lose it:
    a byte flipped at the same length, a data part gone, a commit record garbled."""
    if isinstance(store, MemoryStore):
        blob = store.pages[key]["kv"]
        if damage == "dropped part":
            store.drop_part(key, "kv")
        elif damage == "malformed record":
            store.malform(key)
        else:
            store.corrupt(key, "kv", {"first byte": 32, "middle byte": len(blob) // 2, "last byte": len(blob) - 1}[damage])
        return
    # FileStore's layout (its module doc): one file, <dir>/<hex[:2]>/<hex>.data: a header
    # (8 bytes of magic, the record's length in 4, the record), then the blobs; a
    # one-pool page's blob is the rest of the file.
    data = store.directory / key.hex()[:2] / f"{key.hex()}.data"
    raw = bytearray(data.read_bytes())
    start = 12 + int.from_bytes(raw[8:12], "little")
    if damage == "dropped part":
        data.unlink()
    elif damage == "malformed record":
        data.write_bytes(bytes(raw[:8]) + (9).to_bytes(4, "little") + b"{not json" + bytes(raw[start:]))
    else:
        blob = len(raw) - start
        raw[start + {"first byte": 32, "middle byte": blob // 2, "last byte": blob - 1}[damage]] ^= 0x40
        data.write_bytes(bytes(raw))


@pytest.mark.allow_blocking  # the test damages FileStore's files on the loop; kvtier does not block
@pytest.mark.parametrize("backend", ["memory", "file"])
@pytest.mark.parametrize("damage", ["first byte", "middle byte", "last byte", "dropped part", "malformed record"])
async def test_a_damaged_stored_page_is_a_miss_and_the_next_write_repairs_it(
    damage: str, backend: str, tmp_path: Path
) -> None:
    group = full_attention_group(page_size=PS)
    store: MemoryStore | FileStore = MemoryStore() if backend == "memory" else FileStore(tmp_path / "store")
    tokens = list(range(3 * PS))
    keys = keys_for(tokens)
    async with TransferScheduler(group, storage=store) as sched:
        b = await sched.backup({"kv": pages(0, 1, 2, page_size=PS)})
        await b
        w = await (await sched.write_storage(b.host_indices, {"kv": keys}))
        assert w.pages_written == {"kv": 3}
        damage_page(store, keys[1], damage)
        got = await (await sched.prefetch({"kv": keys}))
        assert got.pages == {"kv": 1}  # the page before the damaged one comes back
        loaded = await (await sched.load(got.host_indices, {"kv": pages(10, page_size=PS)}))
        assert loaded.nbytes > 0
        assert all(torch.equal(x, y) for x, y in zip(
            rows(group, "kv", pages(10, page_size=PS)), rows(group, "kv", pages(0, page_size=PS))
        ))
        sched.free_host(got.host_indices)
        stats = sched.statistics().storage
        assert stats is not None
        if damage.endswith("byte"):
            assert (stats.pages_rejected, stats.keys_to_rewrite) == (1, 1)
        # Writing the prefix again puts the damaged page again (and only it).
        again = await (await sched.write_storage(b.host_indices, {"kv": keys}))
        assert again.pages_written == {"kv": 1} and again.pages_present == {"kv": 2}
        assert sched.statistics().storage.keys_to_rewrite == 0  # type: ignore[union-attr]
        whole = await (await sched.prefetch({"kv": keys}))
        assert whole.pages == {"kv": 3}
        await (await sched.load(whole.host_indices, {"kv": pages(11, 12, 13, page_size=PS)}))
        assert all(torch.equal(x, y) for x, y in zip(
            rows(group, "kv", pages(11, 12, 13, page_size=PS)), rows(group, "kv", pages(0, 1, 2, page_size=PS))
        ))
        sched.free_host(whole.host_indices)
        sched.free_host(b.host_indices)
    await store.aclose()


@pytest.mark.allow_blocking  # the test damages FileStore's files on the loop; kvtier does not block
@pytest.mark.parametrize("shared", [True, False])
async def test_a_page_one_scheduler_refused_is_put_again_by_another_schedulers_write(
    shared: bool, tmp_path: Path
) -> None:
    # vLLM's worker reads stored blocks through one scheduler (its staging
    # pool) and writes them through another: a refusal seen by the reader
    # must make the writer put the page again, not trust ``exists``.
    from kvtier.scheduler import RewriteKeys

    store = FileStore(tmp_path / "store")
    keys = keys_for(list(range(3 * PS)))
    writer_group, reader_group = full_attention_group(page_size=PS), full_attention_group(page_size=PS)
    rewrite = RewriteKeys() if shared else None
    async with (
        TransferScheduler(writer_group, storage=store, rewrite_keys=rewrite) as writer,
        TransferScheduler(reader_group, storage=store, rewrite_keys=rewrite) as reader,
    ):
        b = await writer.backup({"kv": pages(0, 1, 2, page_size=PS)})
        await b
        assert (await (await writer.write_storage(b.host_indices, {"kv": keys}))).pages_written == {"kv": 3}
        damage_page(store, keys[1], "middle byte")
        got = await (await reader.prefetch({"kv": keys}))
        assert got.pages == {"kv": 1}
        reader.free_host(got.host_indices)
        if shared:
            assert rewrite == {keys[1]: "checksum"}
        again = await (await writer.write_storage(b.host_indices, {"kv": keys}))
        whole = await (await reader.prefetch({"kv": keys}))
        reader.free_host(whole.host_indices)
        if shared:
            assert (again.pages_written, again.pages_present) == ({"kv": 1}, {"kv": 2})
            assert whole.pages == {"kv": 3} and not rewrite
        else:
            # Each scheduler's own record: the writer trusts exists, the page stays bad.
            assert (again.pages_written, whole.pages) == ({"kv": 0}, {"kv": 1})
        writer.free_host(b.host_indices)
    await store.aclose()


async def test_rewrite_keys_keep_the_newest_and_refuse_a_bad_limit() -> None:
    from kvtier.scheduler import RewriteKeys

    keys = RewriteKeys(limit=2)
    for i, reason in enumerate(["checksum", "key", "length"]):
        keys.add(bytes([i]), reason)
    assert keys == {b"\x01": "key", b"\x02": "length"}
    keys.add(b"\x01", "checksum")  # seen again: now the newest
    keys.add(b"\x03", "key")
    assert list(keys) == [b"\x01", b"\x03"]
    with pytest.raises(ValueError, match="limit >= 1; got 0"):
        RewriteKeys(limit=0)
    with pytest.raises(TypeError, match="rewrite_keys must be a RewriteKeys; got dict"):
        TransferScheduler(full_attention_group(page_size=PS), storage=MemoryStore(), rewrite_keys={})  # type: ignore[arg-type]


async def test_a_prefetch_whose_first_key_is_missing_hits_nothing_and_reads_nothing() -> None:
    group = full_attention_group(page_size=PS)
    store = MemoryStore()
    keys = keys_for(list(range(2 * PS)))
    async with TransferScheduler(group, storage=store) as sched:
        b = await sched.backup({"kv": pages(0, 1, page_size=PS)})
        await b
        await (await sched.write_storage({"kv": b.host_indices["kv"][PS:]}, {"kv": keys[1:]}))
        sched.free_host(b.host_indices)
        store.hold(["get"])  # a read would wait here
        h = await sched.prefetch({"kv": keys})
        result = await h
        assert result.pages == {"kv": 0} and result.hit_pages == {"kv": 0}
        assert result.host_indices == {}
        assert store.waiting == []  # nothing was read from the store
        sched.free_host(result.host_indices)  # a miss hands back nothing: a no-op
        store.release()
    assert used(group)["kv"] == 0


# -- one scheduler per group -----------------------------------------------------------------


async def test_a_second_scheduler_over_a_group_in_use_is_refused() -> None:
    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group) as first:
        with pytest.raises(ConfigurationError, match="this PoolGroup is in use by <TransferScheduler open"):
            async with TransferScheduler(group):
                pass  # pragma: no cover
        b = await first.backup({"kv": pages(0, page_size=PS)})
        await b
    # Once the first has closed, another may use the group (and its held pages).
    async with TransferScheduler(group) as second:
        load = await second.load(b.host_indices, {"kv": pages(3, page_size=PS)})
        await load
        second.free_host(b.host_indices)
    assert used(group)["kv"] == 0


async def test_verify_mode_checksums_outlive_the_scheduler_that_recorded_them() -> None:
    group = full_attention_group(page_size=PS)
    config = SchedulerConfig(verify=True)
    async with TransferScheduler(group, config=config) as first:
        good = await first.backup({"kv": pages(0, page_size=PS)})
        bad = await first.backup({"kv": pages(1, page_size=PS)})
        await good
        await bad
    host = group["kv"].host
    host.layer_view(0, 0)[int(bad.host_indices["kv"][0])].view(torch.uint8)[-1] ^= 1  # type: ignore[union-attr]
    async with TransferScheduler(group, config=config) as second:
        await (await second.load(good.host_indices, {"kv": pages(4, page_size=PS)}))
        with pytest.raises(CorruptionDetected):
            await (await second.load(bad.host_indices, {"kv": pages(5, page_size=PS)}))
        second.free_host(good.host_indices)
        second.free_host(bad.host_indices)


# -- backpressure ---------------------------------------------------------------------------------


async def test_waiting_submitters_get_in_first_come_first_served() -> None:
    gate = threading.Event()
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS, host_slots=64 * PS)
    order: list[int] = []
    try:
        async with TransferScheduler(group, executor=ex, config=SchedulerConfig(max_queued_ops=2, max_batch_ops=1)) as sched:
            first = await sched.backup({"kv": pages(0, page_size=PS)})  # held in the executor
            await wait_until(ex.started.is_set)
            queued = [await sched.backup({"kv": pages(i, page_size=PS)}) for i in (1, 2)]  # the lane is full

            async def submit(i: int) -> None:
                h = await sched.backup({"kv": pages(i, page_size=PS)})
                order.append(i)
                await h

            async with anyio.create_task_group() as tg:
                for i in range(3, 11):
                    tg.start_soon(submit, i)
                    await checkpoints(3)
                assert order == []
                assert sched.statistics().backup.queue_depth == 2
                gate.set()
            assert order == list(range(3, 11))
            for h in [first, *queued]:
                await h
            history = [ids for direction, ids in ex.history if direction == "backup"]
            assert [i for ids in history for i in ids] == sorted(i for ids in history for i in ids)
    finally:
        gate.set()


# -- an engine allocator's answer is checked -----------------------------------------------------


class BadAllocator:
    """A device allocator whose answer breaks its contract in one way."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.page_size = PS
        self.num_free_slots = 64
        self.freed: list[torch.Tensor] = []

    def try_alloc(self, num_slots: int) -> Any:
        base = torch.arange(8 * PS, 8 * PS + num_slots)
        return {
            "too many": torch.arange(8 * PS, 8 * PS + num_slots + PS),
            "too few": base[:-1],
            "misaligned": base + 1,
            "duplicated": torch.cat([base[:PS], base[:PS]]) if num_slots == 2 * PS else base,
            "out of range": base + 10_000,
            "a list": base.tolist(),
            "floats": base.float(),
        }[self.answer]

    def free(self, indices: torch.Tensor) -> None:
        self.freed.append(indices)


@pytest.mark.parametrize("answer", ["too many", "too few", "misaligned", "duplicated", "out of range", "a list", "floats"])
async def test_a_device_allocator_that_breaks_its_contract_is_refused_and_changes_nothing(answer: str) -> None:
    group = full_attention_group(page_size=PS)
    bad = BadAllocator(answer)
    # The pool's spec carries the engine's allocator; swap in the broken one.
    object.__setattr__(group["kv"], "device_allocator", bad)
    async with TransferScheduler(group) as sched:
        b = await sched.backup({"kv": pages(0, 1, page_size=PS)})
        await b
        before = group.ownership("kv").readers.copy()
        with pytest.raises(ConfigurationError, match="pool 'kv' device allocator") as info:
            await sched.load(b.host_indices)
        assert "kv" in str(info.value)
        assert group.ownership("kv").readers == before  # the pin was undone
        sched.free_host(b.host_indices)
    assert used(group)["kv"] == 0


# -- the caller's thread and loop ---------------------------------------------------------------


async def test_calls_from_another_thread_or_loop_are_refused_at_the_call() -> None:
    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group) as sched:
        b = await sched.backup({"kv": pages(0, page_size=PS)})
        await b
        before = used(group)

        def from_thread() -> list[BaseException]:
            errors: list[BaseException] = []
            for call in (
                lambda: sched.backup_nowait({"kv": pages(1, page_size=PS)}),
                lambda: sched.free_host(b.host_indices),
                b.cancel,
                lambda: asyncio.run(sched.backup({"kv": pages(1, page_size=PS)})),
                lambda: asyncio.run(_load(sched, b.host_indices)),
            ):
                try:
                    call()
                except BaseException as exc:
                    errors.append(exc)
            return errors

        errors = await anyio.to_thread.run_sync(from_thread)
        assert len(errors) == 5 and all(isinstance(e, WrongEventLoop) for e in errors), errors
        assert "another thread" in str(errors[0]) and "another event loop" in str(errors[3])
        assert used(group) == before
        sched.free_host(b.host_indices)


async def _load(sched: TransferScheduler, host: Any) -> Any:
    return await sched.load(host, {"kv": pages(2, page_size=PS)})


def test_another_anyio_backend_gets_a_configuration_error_naming_it() -> None:
    pytest.importorskip("trio")
    group = full_attention_group(page_size=PS)

    async def main() -> None:
        async with TransferScheduler(group):
            pass  # pragma: no cover

    with pytest.raises(ConfigurationError, match="found trio"):
        anyio.run(main, backend="trio")


def test_the_scheduler_runs_on_uvloop() -> None:
    pytest.importorskip("uvloop")
    group = hybrid_group()

    async def main() -> None:
        async with TransferScheduler(group, storage=MemoryStore()) as sched:
            src = {"kv": torch.arange(16), "state": torch.tensor([0])}
            want = {name: rows(group, name, idx) for name, idx in src.items()}
            b = await sched.backup(src)
            await b
            dst = {"kv": torch.arange(32, 48), "state": torch.tensor([5])}
            await (await sched.load(b.host_indices, dst))
            for name, idx in dst.items():
                assert all(torch.equal(x, y) for x, y in zip(rows(group, name, idx), want[name]))
            assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
            sched.free_host(b.host_indices)

    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})


# -- priorities -------------------------------------------------------------------------------------


@pytest.mark.parametrize("priority", [float("nan"), 1.5, True, PRIORITY_MAX + 1, PRIORITY_MIN - 1, "1", None])
async def test_a_bad_priority_is_refused_and_changes_nothing(priority: Any) -> None:
    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group) as sched:
        before = used(group)
        for call in (
            lambda: sched.backup({"kv": pages(0, page_size=PS)}, priority=priority),
        ):
            with pytest.raises(ValueError, match=r"priority must be an int in \[-2147483648, 2147483647\]"):
                await call()
        with pytest.raises(ValueError, match="priority must be an int"):
            sched.backup_nowait({"kv": pages(0, page_size=PS)}, priority=priority)
        assert used(group) == before
        assert sched.statistics().backup.submitted == 0


async def test_the_priority_range_ends_are_accepted() -> None:
    group = full_attention_group(page_size=PS)
    async with TransferScheduler(group) as sched:
        for p in (PRIORITY_MIN, PRIORITY_MAX):
            h = await sched.backup({"kv": pages(0, page_size=PS)}, priority=p)
            await h
            sched.free_host(h.host_indices)


# -- what a handle hands back can be passed back ---------------------------------------------------


async def test_a_backups_host_indices_with_sidecars_go_back_to_load_write_and_free_host() -> None:
    group = hybrid_group()
    store = MemoryStore()
    async with TransferScheduler(group, storage=store) as sched:
        src = {"kv": torch.arange(16), "tok": torch.arange(8)}
        b = await sched.backup(src)
        await b
        host = b.host_indices
        assert set(host) > set(src)  # the sidecars are listed too
        dst = {"kv": torch.arange(40, 56), "tok": torch.arange(24, 32)}
        load = await sched.load(host, dst)
        await load
        moved = [name for name in load.device_indices if group[name].device is not None]
        assert len(moved) >= 3  # kv and the sidecars of kv and tok
        for name in moved:
            assert all(torch.equal(x, y) for x, y in zip(
                rows(group, name, load.device_indices[name]), rows(group, name, b.device_indices[name])
            ))
        ns = {name: KeyNamespace.for_pool(group, name, model="t") for name in src}
        keys = {name: page_keys(ns[name], list(range(len(src[name])))) for name in src}
        w = await (await sched.write_storage(host, keys))
        assert sum(w.pages_written.values()) == 3
        # A sidecar entry that its source does not derive is refused.
        wrong = dict(host)
        side = next(n for n in host if n not in src)
        wrong[side] = wrong[side] + 1000
        with pytest.raises(InvalidIndices):
            sched.free_host(wrong)
        sched.free_host(host)
        sched.free_host({})  # nothing to give back: a no-op
    assert all(v in (0, None) for v in used(group).values())


async def test_free_host_of_nothing_is_a_no_op() -> None:
    group = full_attention_group(page_size=PS, host_slots=2 * PS)
    async with TransferScheduler(group) as sched:
        before = (used(group), sched.statistics().deferred_host_frees)
        sched.free_host({})
        assert (used(group), sched.statistics().deferred_host_frees) == before
    # After close too: the pages belong to the group.
    alloc = group["kv"].host.allocator
    assert isinstance(alloc, PageAllocator) and alloc.num_free_pages == 2


async def test_a_freed_place_wakes_exactly_one_waiting_submitter() -> None:
    gate = threading.Event()
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS, host_slots=512 * PS)
    waiting = 200
    try:
        async with TransferScheduler(group, executor=ex, config=SchedulerConfig(max_queued_ops=2)) as sched:
            await sched.backup({"kv": pages(0, page_size=PS)})  # held in the executor
            await wait_until(ex.started.is_set)
            queued = [await sched.backup({"kv": pages(i, page_size=PS)}) for i in (1, 2)]
            async with anyio.create_task_group() as tg:
                for i in range(waiting):
                    tg.start_soon(sched.backup, {"kv": pages((3 + i) % 16, page_size=PS)})
                await checkpoints(20)
                loop = asyncio.get_running_loop()
                scheduled: list[object] = []
                original = loop.call_soon

                def counting(callback: Any, *args: Any, **kw: Any) -> Any:
                    scheduled.append(callback)
                    return original(callback, *args, **kw)

                loop.call_soon = counting  # type: ignore[method-assign]
                try:
                    queued[0].cancel()  # one place frees up
                finally:
                    loop.call_soon = original  # type: ignore[method-assign]
                # The cancelled handle's own waiters aside, one submitter is woken, not all of them.
                assert len(scheduled) <= 2, f"{len(scheduled)} wake-ups for one freed place"
                await checkpoints(20)
                assert sched.statistics().backup.queue_depth == 2
                gate.set()
    finally:
        gate.set()


async def test_a_submitter_cancelled_while_waiting_for_room_leaves_the_line() -> None:
    gate = threading.Event()
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    group = full_attention_group(page_size=PS, host_slots=16 * PS)
    try:
        async with TransferScheduler(group, executor=ex, config=SchedulerConfig(max_queued_ops=1)) as sched:
            held = await sched.backup({"kv": pages(0, page_size=PS)})
            await wait_until(ex.started.is_set)
            queued = await sched.backup({"kv": pages(1, page_size=PS)})  # the lane is full
            with anyio.move_on_after(0.05) as scope:
                await sched.backup({"kv": pages(2, page_size=PS)})
            assert scope.cancelled_caught
            assert used(group)["kv"] == 2 * PS  # the cancelled submission gave its slots back
            queued.cancel()  # room again: nobody waits, so a nowait submission gets in
            h = sched.backup_nowait({"kv": pages(3, page_size=PS)})
            gate.set()
            for x in (held, h):
                await x
                sched.free_host(x.host_indices)
    finally:
        gate.set()
    assert used(group)["kv"] == 0


async def test_a_verify_checksum_lives_as_long_as_its_page() -> None:
    group = full_attention_group(page_size=PS, host_slots=PS)  # one host page: reused at once
    async with TransferScheduler(group, config=SchedulerConfig(verify=True)) as first:
        b = await first.backup({"kv": pages(0, page_size=PS)})
        await b
        page = int(b.host_indices["kv"][0]) // PS
        assert page in group.checksums["kv"]
        first.free_host(b.host_indices)
        assert page not in group.checksums["kv"]  # the checksum went with the page's life
    # Another scheduler, without verify, fills the page with other rows...
    async with TransferScheduler(group) as plain:
        other = await plain.backup({"kv": pages(3, page_size=PS)})
        await other
    # ...which a verifying scheduler then loads: nothing was recorded for this
    # life, so nothing stale is held against it.
    async with TransferScheduler(group, config=SchedulerConfig(verify=True)) as third:
        await (await third.load(other.host_indices, {"kv": pages(7, page_size=PS)}))
        assert all(torch.equal(x, y) for x, y in zip(
            rows(group, "kv", pages(7, page_size=PS)), rows(group, "kv", pages(3, page_size=PS))
        ))
        third.free_host(other.host_indices)
