"""Behaviours that were right but pinned by no test (issue 44, part B): each
test here was seen to fail with a fault planted in the code it guards (the
plant is named in its docstring), then the plant was removed."""

from __future__ import annotations

import asyncio

import anyio
import numpy as np
import pytest
import torch
from conftest import pages, randomize_host, used, wait_until
from test_storage_scheduler import (
    backup_and_store,
    prefix_keys,
    baseline,
    engine,
    load_rows,
    prefix_rows,
)

from kvtier import InvalidIndices, TransferScheduler
from kvtier.storage import PageBlobs, PageCorrupted, PageIdentity, StorageError, decode_page, encode_page, page_keys
from kvtier.storage.identity import PlaneFormat, PoolFormat
from kvtier.storage.pages import BLOB_HEADER_BYTES
from kvtier.testing import MemoryStore, full_attention_group, hybrid_group

# -- a prefetch never counts a refused page as done ----------------------------------------


@pytest.mark.parametrize("damage", ["checksum", "identity"])
async def test_a_prefetch_hands_back_only_pages_whose_bytes_it_wrote(damage: str) -> None:
    """Page 1 of 3 is refused (a flipped row byte; or written by an engine of
    another model under the same key). The prefetch hands back page 0 only,
    and its bytes are the writer's; page 1's slot, which still holds what was
    there before (stale bytes), is never handed back as done.
    Plant: ``h.done_pages[pool] = start + ok + (bad is not None)`` in `_fetch_one`."""
    store = MemoryStore()
    a, b = engine(1), engine(2)
    async with TransferScheduler(a, storage=store) as sched_a:
        stored = await backup_and_store(sched_a, a, 3, pools=("kv",))
        want = prefix_rows(a, stored.device, {"kv": 1})
        sched_a.free_host(stored.host)
    key = stored.keys["kv"][1]
    blobs = {n: bytearray(v) for n, v in (await store.get([key], ["kv", "c4"]))[0].items()}  # type: ignore[union-attr]
    if damage == "checksum":
        blobs["kv"][BLOB_HEADER_BYTES + 5] ^= 0x40
    else:
        other = engine(1)  # the same rows, under another model's identity
        ident = PageIdentity.for_pool(other, "kv", model="another-model")
        blobs = {n: bytearray(v) for n, v in encode_page(other, "kv", 1, key=key, identity=ident).items()}
    await store.put([PageBlobs(key, {n: bytes(v) for n, v in blobs.items()})])
    base = baseline(b)
    async with TransferScheduler(b, storage=store) as sched:
        res = await (await sched.prefetch(stored.keys, policy="wait_complete"))
        assert dict(res.pages) == {"kv": 1} and res.host_indices["kv"].numel() == b["kv"].page_size
        got = await load_rows(sched, b, res)
        for name, layers in want.items():
            for gl, wl in zip(got[name], layers, strict=True):
                assert all(torch.equal(x, y) for x, y in zip(gl, wl, strict=True)), name
        assert sched.statistics().storage.pages_rejected_by_rule == {damage: 1}
        sched.free_host(res.host_indices)
    assert used(b) == base


# -- index arrays are checked in full ----------------------------------------------------


@pytest.mark.parametrize(
    ("offsets", "rule_match"),
    [
        ([4, 8, 16], "start at 0|offsets"),  # does not start at 0
        ([0, 12, 8, 16], "decrease|offsets"),  # decreases
        ([0, 8, 12], "end|offsets|length"),  # ends before the array's end
        ([0, 8, 20], "end|offsets|length"),  # ends after it
    ],
)
async def test_bulk_offsets_are_checked_in_full(offsets: list[int], rule_match: str) -> None:
    """Plant: drop one of the offsets checks in `arrays._slot_offsets`."""
    group = full_attention_group(page_size=4)
    kv = np.arange(16)
    async with TransferScheduler(group) as sched:
        with pytest.raises(InvalidIndices, match=rule_match):
            await sched.backup_arrays({"kv": kv}, {"kv": np.array(offsets)})
        assert used(group) == {"kv": 0}


async def test_every_slot_of_a_bulk_call_is_checked_against_the_pool_size() -> None:
    """Only the last request names a slot past the pool's end.
    Plant: check the first request's slots only, or each request's first page."""
    group = full_attention_group(page_size=4)
    slots = group["kv"].device_slots
    async with TransferScheduler(group) as sched:
        kv = np.concatenate([np.arange(0, 8), np.arange(slots - 4, slots), np.arange(slots, slots + 4)])
        with pytest.raises(InvalidIndices, match=f"request 2|{slots}"):
            await sched.backup_arrays({"kv": kv}, {"kv": np.array([0, 8, 12, 16])})
        assert used(group) == {"kv": 0}


async def test_negative_valid_rows_and_a_cancel_of_count_are_refused() -> None:
    group = hybrid_group(device_allocator=True)
    ps = group["kv"].page_size
    kv = np.arange(2 * ps)
    async with TransferScheduler(group) as sched:
        with pytest.raises(InvalidIndices):
            await sched.backup_arrays({"kv": kv}, {"kv": np.array([0, ps, 2 * ps])},
                                      valid_rows={"kv": np.array([ps, -1])})
        assert used(group)["kv"] == 0
        bulk = await sched.backup_arrays({"kv": kv}, {"kv": np.array([0, ps, 2 * ps])})
        with pytest.raises(InvalidIndices):
            bulk.cancel([2])  # requests are 0 and 1: 2 == count is out of range
        result = await bulk
        assert result.all_ok
        sched.free_host(result)


# -- BulkResult arrays never share memory with kvtier's state ------------------------------


async def test_bulk_result_arrays_are_the_callers_on_every_read() -> None:
    """Writes to every array a result hands out (first read and later reads,
    host and device, offsets and status) change nothing kvtier reads later:
    another read, what free_host(result) frees, a load from the result.
    Plant: hand the carrier's own array on the first read (no copy)."""
    group = hybrid_group(device_allocator=True)
    ps = group["kv"].page_size
    kv = np.arange(4 * ps)
    async with TransferScheduler(group) as sched:
        result = await (await sched.backup_arrays({"kv": kv}, {"kv": np.arange(5) * ps}))
        first = {side: getattr(result, side) for side in ("host_indices", "device_indices")}
        snapshot = {side: {p: t.clone() for p, t in arrays.items()} for side, arrays in first.items()}
        for arrays in first.values():
            for t in arrays.values():
                t.fill_(0)  # the caller scribbles on what it was handed
        for side, arrays in snapshot.items():
            again = getattr(result, side)
            for p, t in arrays.items():
                assert torch.equal(again[p], t), (side, p)
                assert again[p].data_ptr() != first[side][p].data_ptr()
                again[p].fill_(0)  # a later read is the caller's too
            third = getattr(result, side)
            assert all(torch.equal(third[p], t) for p, t in arrays.items()), side
        kept = {p: [int(x) for x in off] for p, off in result.offsets.items()}
        for off in result.offsets.values():
            try:
                off[0] = 5
            except (ValueError, RuntimeError):
                pass  # read-only: not the caller's to change, which is as good
        assert {p: [int(x) for x in o] for p, o in result.offsets.items()} == kept
        assert not result.status.flags.writeable
        # The sidecar's offsets name the sidecar's own rows (k per kv page).
        k = group["c4"].sidecar.rows_per_page  # type: ignore[union-attr]
        assert [int(x) for x in result.offsets["c4"]] == [i * k for i in range(5)]
        assert [int(x) for x in result.offsets["kv"]] == [i * ps for i in range(5)]
        held = used(group)["kv"]
        sched.free_host(result)  # frees kvtier's record, whatever was written to the arrays
        assert used(group)["kv"] == held - 4 * ps


# -- the identity digest keeps field boundaries -------------------------------------------


def _identity(model: str, extra: tuple[str, ...], name: str = "kv", fmt: str = "bfloat16") -> PageIdentity:
    pool = PoolFormat(name=name, kind="pool", layout="layer_first", rows=4, layers=1,
                      planes=(PlaneFormat((8,), fmt, 2),))
    return PageIdentity(model=model, scheme="kvtier", pools=(pool,), extra=extra)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (("ab", "c"), ("a", "bc")),  # the same characters, the boundary moved
        (("ab|c",), ("ab", "c")),  # a separator inside a field
        (("", "x"), ("x", "")),
        (("abc",), ("a", "b", "c")),
    ],
)
def test_the_identity_digest_keeps_field_boundaries(one: tuple[str, ...], other: tuple[str, ...]) -> None:
    """Plant: hash the fields joined without their lengths."""
    a, b = _identity("m", one), _identity("m", other)
    assert a.digest() != b.digest() and a.tag("kv") != b.tag("kv")
    assert a.namespace().root() != b.namespace().root()


def test_model_and_extra_do_not_run_together() -> None:
    assert _identity("ab", ("c",)).digest() != _identity("a", ("bc",)).digest()
    assert _identity("m", (), name="kv1").digest() != _identity("m", ("1",), name="kv").digest()


# -- a stored page's checksum covers its whole header and its key --------------------------


def test_any_header_byte_changed_or_another_key_is_refused() -> None:
    """Every byte of a blob's header, changed alone, makes the page refused
    (no row written); so does the same blob read under another key.

    Each header field is guarded twice: by its own check (magic, version,
    reserved bytes, length, identity tag, key tag) and by the checksum, which
    covers the whole header and the key. A plant that leaves a field or the
    key out of the checksum is therefore still refused by the field's own
    check (seen: this test passes with it); a plant that drops a field check
    is refused by the checksum (seen: passes too). Only both at once let a
    changed byte through, which this test then catches."""
    group = hybrid_group(seed=1)
    ns_keys = page_keys(PageIdentity.for_pool(group, "kv", model="m").namespace(), list(range(16)))
    key, other_key = ns_keys[0], ns_keys[1]
    blobs = encode_page(group, "kv", 0, key=key)
    reader = hybrid_group(seed=2)
    randomize_host(reader, 3)
    before = reader["kv"].host.buffer(0).reshape(-1).view(torch.uint8).clone()
    for pool, blob in blobs.items():
        for i in range(BLOB_HEADER_BYTES):
            bad = {n: bytearray(v) for n, v in blobs.items()}
            bad[pool][i] ^= 0x01
            with pytest.raises(PageCorrupted):
                decode_page(reader, "kv", 0, {n: bytes(v) for n, v in bad.items()}, key=key)
    with pytest.raises(PageCorrupted) as err:
        decode_page(reader, "kv", 0, blobs, key=other_key)
    assert err.value.rule in ("key", "checksum")
    assert torch.equal(reader["kv"].host.buffer(0).reshape(-1).view(torch.uint8), before)  # nothing written
    assert decode_page(reader, "kv", 0, blobs, key=key) == {"kv": 8, "c4": 2}  # the page itself is good



# -- a sidecar's element format is in its page's identity; a short exists is refused ------------


def test_a_sidecars_element_format_is_in_the_identity_and_the_keys() -> None:
    """c4 (kv's sidecar) held as bf16 but named float16 by one engine: its kv
    pages get other keys, and a page of one is refused by the other.
    Plant: apply ``formats`` to the anchor pool only."""
    group = hybrid_group(seed=1)
    plain = PageIdentity.for_pool(group, "kv", model="m")
    named = PageIdentity.for_pool(group, "kv", model="m", formats={"c4": "float16"})
    assert named.pool("c4").planes[0].format == "float16"
    assert plain.digest() != named.digest() and plain.namespace().root() != named.namespace().root()
    key = page_keys(plain.namespace(), list(range(8)))[0]
    with pytest.raises(PageCorrupted) as err:
        decode_page(hybrid_group(seed=2), "kv", 0, encode_page(group, "kv", 0, key=key, identity=plain),
                    key=key, identity=named)
    assert err.value.rule == "identity"


class ShortExists(MemoryStore):
    """A store that answers ``exists`` with one result too few (a broken backend)."""

    async def exists(self, keys):  # type: ignore[no-untyped-def, override]
        return (await super().exists(keys))[:-1]


async def test_a_store_answering_exists_with_too_few_results_is_refused() -> None:
    """Plant: drop the length check in `_StorageWork.exists` (zip would then
    pair the answers with the wrong keys, or leave the last keys unlooked)."""
    store = ShortExists()
    group = engine(1)
    async with TransferScheduler(group, storage=store) as sched:
        base = baseline(group)
        b = await sched.backup({"kv": pages(0, 1, page_size=group["kv"].page_size)})
        await b
        keys = prefix_keys(group, 2, pools=("kv",))
        for call in (lambda: sched.write_storage({"kv": b.host_indices["kv"]}, keys), lambda: sched.prefetch(keys)):
            with pytest.raises(StorageError, match="exists answered 1 results for 2 keys"):
                await (await call())  # type: ignore[operator]
        assert await MemoryStore.exists(store, keys["kv"]) == [False, False]  # nothing was put
        sched.free_host(b.host_indices)
        assert used(group) == base


# -- vLLM's block keys change with the layer count, the TP cut and the rank ---------------------


def test_vllm_block_keys_change_with_layers_cut_and_rank() -> None:
    """The identity code vLLM's connector uses, reached without vLLM (`make
    test-vllm` exercises it inside vLLM). Plant: leave the layer count out of
    `vllm_root`, or the cut or the rank out of `vllm_shard_key`."""
    from kvtier.storage.identity import Shard, vllm_block_key, vllm_shard_key

    def root(layers: int = 4) -> bytes:
        return PageIdentity.for_vllm_block(model="m", block_size=16, dtype="bfloat16", num_layers=layers,
                                           block_bytes=4096).vllm_root()

    offload_key = bytes(range(40))
    assert root(4) != root(5)
    assert vllm_block_key(root(4), offload_key) != vllm_block_key(root(5), offload_key)
    block = vllm_block_key(root(), offload_key)
    shards = [Shard(0, 2, cut="tp=2|pp=1"), Shard(1, 2, cut="tp=2|pp=1"), Shard(0, 2, cut="tp=1|pp=2"),
              Shard(0, 4, cut="tp=4|pp=1")]
    keys = [vllm_shard_key(block, s) for s in shards]
    assert len(set(keys)) == len(keys) and block not in keys
    assert vllm_shard_key(block, None) == block  # one worker: the block's key itself
    # The shard is also in the block's page identity, whose tag each stored blob carries.
    tags = {PageIdentity.for_vllm_block(model="m", block_size=16, dtype="bfloat16", num_layers=4, block_bytes=4096,
                                        shard=s).digest() for s in shards}
    assert len(tags) == len(shards)


# -- a bulk call's byte counts with failures are exact ------------------------------------------


async def test_a_bulk_calls_bytes_per_pool_count_the_completed_requests_exactly() -> None:
    """Requests of 1, 2 and 3 kv pages (with their c4 rows), one of them
    failed by the executor: the bytes per pool are exactly the completed ones'.
    Plant: count a failed request's bytes too."""
    from kvtier import SchedulerConfig
    from kvtier.testing import FaultInjectingExecutor

    group = hybrid_group(device_allocator=True)
    ps = group["kv"].page_size
    sizes = [1, 2, 3]
    kv = np.arange(sum(sizes) * ps)
    off = np.cumsum([0, *sizes]) * ps
    ex = FaultInjectingExecutor(fail_batches={1})
    async with TransferScheduler(group, ex, SchedulerConfig(max_batch_ops=1)) as sched:
        result = await (await sched.backup_arrays({"kv": kv}, {"kv": off}))
        ok = [i for i in range(3) if result.status[i] == result.OK]
        assert len(ok) == 2 and len(result.errors) == 1
        k = group["c4"].sidecar.rows_per_page  # type: ignore[union-attr]
        want = {
            "kv": sum(sizes[i] for i in ok) * ps * group["kv"].slot_nbytes,
            "c4": sum(sizes[i] for i in ok) * k * group["c4"].slot_nbytes,
        }
        assert dict(result.bytes_per_pool) == want and result.nbytes == sum(want.values())
        sched.free_host(result)
        assert used(group)["kv"] == 0


# -- a lane's room handed to a submitter cancelled meanwhile comes back -------------------------


async def test_room_handed_to_a_submitter_cancelled_meanwhile_comes_back(gate) -> None:  # type: ignore[no-untyped-def]
    """A full lane (bound 1): C waits for room; B's cancel hands B's place to
    C, and C's task is cancelled in the same step, before it takes the place.
    The place comes back: D is queued at once. Plant: forget to give back the
    room reserved for a cancelled waiter (`Lane.put_many`)."""
    from kvtier import SchedulerConfig
    from kvtier.testing import FaultInjectingExecutor


    group = full_attention_group(page_size=4)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    try:
        async with TransferScheduler(group, ex, SchedulerConfig(max_queued_ops=1, max_batch_ops=1)) as sched:
            a = await sched.backup({"kv": pages(0, page_size=4)})
            await wait_until(ex.started.is_set)  # a is in flight, the queue is empty
            b = await sched.backup({"kv": pages(1, page_size=4)})  # the queue is full
            # A task of asyncio's own: its cancel lands even though the room
            # handed to it has already woken it (an anyio scope would let it run on).
            c = asyncio.ensure_future(sched.backup({"kv": pages(2, page_size=4)}))
            await wait_until(lambda: used(group)["kv"] == 12)  # C took its host page and waits for room
            await anyio.sleep(0.01)
            assert b.cancel() is True  # hands B's place to C ...
            c.cancel()  # ... cancelled before it takes it
            with pytest.raises(asyncio.CancelledError):
                await c
            assert used(group)["kv"] == 4  # B's page and C's are back
            with anyio.fail_after(5):
                d = await sched.backup({"kv": pages(3, page_size=4)})
            gate.set()
            await a
            await d
            sched.free_host(a.host_indices)
            sched.free_host(d.host_indices)
            assert used(group)["kv"] == 0
    finally:
        gate.set()


# -- a failed writer's deferred pages are freed exactly once, on both paths -------------------


@pytest.mark.parametrize("npages", [2, 64])  # the element-wise path, and the bulk one (48 pages and more)
async def test_a_failed_backups_pages_freed_meanwhile_go_back_exactly_once(gate, npages: int) -> None:  # type: ignore[no-untyped-def]
    """The caller frees a backup's host pages while it writes them (the free
    is deferred); the backup fails. Its pages go back once: none is left
    marked for a later free, so the next backup of every page keeps them all.
    Plant: leave the deferred marks of a failed writer's pages set
    (`HostPageOwnership._end_write_bulk`, or the element-wise loop)."""
    from kvtier import SchedulerConfig, TransferFailed
    from kvtier.testing import FaultInjectingExecutor


    group = full_attention_group(page_size=4, host_slots=npages * 4, device_slots=npages * 4)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10, fail_batches={0})
    every = pages(*range(npages), page_size=4)
    try:
        async with TransferScheduler(group, ex, SchedulerConfig(max_batch_bytes=1 << 40)) as sched:
            h = await sched.backup({"kv": every})
            await wait_until(ex.started.is_set)
            sched.free_host(h.host_indices)  # deferred: the backup still writes them
            assert sched.statistics().deferred_host_frees == npages
            gate.set()
            with pytest.raises(TransferFailed):
                await h
            assert used(group) == {"kv": 0} and sched.statistics().deferred_host_frees == 0
            again = await sched.backup({"kv": every})  # takes every host page again
            await again
            assert used(group) == {"kv": npages * 4}  # all kept: none freed by a stale mark
            assert len(set(again.host_indices["kv"].tolist())) == npages * 4
            sched.free_host(again.host_indices)
            assert used(group) == {"kv": 0}
    finally:
        gate.set()


# -- a sidecar added after the first encode gets a fresh identity ------------------------------


def test_a_sidecar_added_after_the_first_encode_is_in_the_next_pages_identity() -> None:
    """Plant: reuse the anonymous identity derived for the group's first page
    of ``kv`` whatever pools the group holds now (`pages.page_identity`'s cache)."""
    from kvtier.pools import DevicePool

    group = full_attention_group(page_size=4)
    key = page_keys(PageIdentity.for_pool(group, "kv", model="m").namespace(), list(range(4)))[0]
    before = encode_page(group, "kv", 0, key=key)
    assert sorted(before) == ["kv"]
    group.add_sidecar("c4", source="kv", rows_per_page=1,
                      device=DevicePool([torch.zeros(64, 8, dtype=torch.bfloat16)]))
    after = encode_page(group, "kv", 0, key=key)
    assert sorted(after) == ["c4", "kv"]
    # The kv blob's identity tag changed with the pools the page holds: the old page is refused.
    assert bytes(after["kv"][16:24]) != bytes(before["kv"][16:24])
    with pytest.raises(PageCorrupted):
        decode_page(group, "kv", 0, {**before, "c4": after["c4"]}, key=key)


# -- a request ended early inside a carrier wakes everything awaiting it ------------------------


async def test_a_request_cancelled_inside_a_queued_carrier_wakes_every_waiter_at_once(gate) -> None:  # type: ignore[no-untyped-def]
    """Three lone backups ride one queued carrier; the middle one is cancelled
    while its carrier is still queued (behind a held batch). Every task
    awaiting it wakes now with OperationCancelled, not when the carrier ends.
    Plant: `Carrier.end_request` does not wake the request's waiters."""
    from kvtier import OperationCancelled
    from kvtier.testing import FaultInjectingExecutor


    group = full_attention_group(page_size=4)
    ex = FaultInjectingExecutor(hold=gate, hold_timeout_s=10)
    woke: list[str] = []
    try:
        async with TransferScheduler(group, ex) as sched:
            holder = await sched.backup({"kv": pages(9, page_size=4)})
            await wait_until(lambda: holder.state == "running")
            handles = [await sched.backup({"kv": pages(i, page_size=4)}) for i in range(3)]
            target = handles[1]

            async def wait_on(how: str) -> None:
                with pytest.raises(OperationCancelled):
                    await (target if how == "await" else target.wait())
                woke.append(how)

            async with anyio.create_task_group() as tg:
                for how in ("await", "wait", "await"):
                    tg.start_soon(wait_on, how)
                await anyio.sleep(0.01)
                assert target.cancel() is True
                with anyio.fail_after(5):  # the carrier stays queued: only the cancel can wake them
                    await wait_until(lambda: len(woke) == 3)
            assert not handles[0].done() and not handles[2].done()
            gate.set()
            for h in (holder, handles[0], handles[2]):
                await h
                sched.free_host(h)
        assert len(ex.history) == 2  # the three rode one carrier
        assert used(group) == {"kv": 0}
    finally:
        gate.set()
