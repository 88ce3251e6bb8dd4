"""Tests on a real CUDA device (marker ``gpu``; skipped without CUDA).

kvtier's copy streams are ordered after the engine's work only by fences:
every backup here passes ``after=`` the stream that wrote its rows (the
default stream, which filled the pools), and every load ``after=`` the stream
that last touched its destination rows.
"""

from __future__ import annotations

import anyio
import anyio.to_thread
import pytest
import torch

from kvtier import DevicePool, PoolGroup, TransferFailed, TransferScheduler
from kvtier.pools.device import PlaneSpec
from kvtier.pools.host import HostPool, register_pinned
from kvtier.transfers.cuda import CudaExecutor, TorchCudaBackend

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def cuda_initialised() -> None:
    """CUDA's lazy start-up (seconds, files read) happens here, outside any event loop."""
    torch.cuda.init()
    torch.ones(1, device="cuda").add_(1)
    torch.cuda.synchronize()


def cuda_group(layout: str, *, layers: int = 4, slots: int = 256, page_size: int = 16,
               stacked: bool = False) -> PoolGroup:
    gen = torch.Generator(device="cuda").manual_seed(0)
    if stacked:  # one [layers, slots, ...] tensor per plane, handed over as layer slices
        planes = [torch.randn((layers, slots, 2, 64), device="cuda", generator=gen).to(torch.bfloat16)
                  for _ in range(2)]
        tensors = [[planes[0][j], planes[1][j]] for j in range(layers)]
    else:
        tensors = [
            [torch.randn((slots, 2, 64), device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2)]
            for _ in range(layers)
        ]
    group = PoolGroup()
    group.add_pool("kv", device=DevicePool(tensors), page_size=page_size, host_slots=slots * 2, layout=layout)
    group.add_sidecar(
        "c4", source="kv", rows_per_page=page_size // 4,
        device=DevicePool([[torch.randn((slots // 4, 32), device="cuda", generator=gen)] for _ in range(layers)]),
        layout=layout,
    )
    return group


def pages(*ps: int, page_size: int = 16) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in ps])


def snapshot(group: PoolGroup, name: str, idx: torch.Tensor) -> list[torch.Tensor]:
    dev = group[name].device
    assert dev is not None
    i = idx.to(dev.device)
    return [dev.tensor(j, p)[i].cpu() for j in range(dev.num_layers) for p in range(len(dev.planes))]


def zero_devices(group: PoolGroup) -> None:
    for spec in group:
        if spec.device is not None:
            for j in range(spec.device.num_layers):
                for p in range(len(spec.device.planes)):
                    spec.device.tensor(j, p).zero_()


@pytest.mark.parametrize("stacked", [False, True], ids=["per_layer", "stacked"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_round_trip_on_cuda_is_byte_exact(layout: str, stacked: bool) -> None:
    group = cuda_group(layout, stacked=stacked)
    assert group["kv"].host.buffer(0).is_pinned()
    async with TransferScheduler(group) as sched:
        assert isinstance(sched.executor, CudaExecutor)
        src = pages(1, 2, 7, 9)  # a run and lone pages
        b = await sched.backup({"kv": src}, after=torch.cuda.current_stream())
        await b
        expected = {n: snapshot(group, n, i) for n, i in b.device_indices.items()}
        zero_devices(group)
        # The handle's host indices as they are (the derived c4 included); the
        # load waits for the zeroing on the default stream.
        load = await sched.load(b.host_indices, {"kv": pages(3, 4, 12, 5)}, after=torch.cuda.current_stream())
        await load
        for name, rows in expected.items():
            got = snapshot(group, name, load.device_indices[name])
            assert len(got) == len(rows)
            assert all(torch.equal(a, b) for a, b in zip(rows, got)), name
    group.close()
    assert not group["kv"].host.buffer(0).is_pinned()


async def test_wait_layer_orders_a_compute_stream_after_the_layer() -> None:
    group = cuda_group("layer_first", layers=8)
    async with TransferScheduler(group) as sched:
        b = await sched.backup({"kv": pages(0, 1)}, after=torch.cuda.current_stream())
        await b
        expected = snapshot(group, "kv", pages(0, 1))
        dst = pages(10, 11).cuda()
        compute = torch.cuda.Stream()
        load = await sched.load(b.host_indices, {"kv": pages(10, 11)}, after=torch.cuda.current_stream())
        seen = []
        with torch.cuda.stream(compute):
            for layer in range(8):
                await load.wait_layer(layer, compute)
                seen.append(group["kv"].device.tensor(layer, 0)[dst].clone())
        await anyio.to_thread.run_sync(compute.synchronize)
        await load
        for layer in range(8):
            assert torch.equal(seen[layer].cpu(), expected[2 * layer])


async def test_wait_layer_without_a_stream_waits_on_the_calling_threads_current_stream() -> None:
    group = cuda_group("layer_first", layers=2)
    async with TransferScheduler(group) as sched:
        b = await sched.backup({"kv": pages(0)}, after=torch.cuda.current_stream())
        await b
        expected = snapshot(group, "kv", pages(0))
        dst = pages(6).cuda()
        compute = torch.cuda.Stream()
        load = await sched.load(b.host_indices, {"kv": pages(6)}, after=torch.cuda.current_stream())
        with torch.cuda.stream(compute):  # the loop thread's current stream is now `compute`
            await load.wait_layer(1)
            seen = group["kv"].device.tensor(1, 0)[dst].clone()
        await anyio.to_thread.run_sync(compute.synchronize)
        await load
        assert torch.equal(seen.cpu(), expected[2])


async def test_backup_after_a_stream_sees_what_that_stream_wrote() -> None:
    group = cuda_group("layer_first")
    forward = torch.cuda.Stream()
    forward.wait_stream(torch.cuda.current_stream())  # after the pools were filled
    idx = pages(3).cuda()
    with torch.cuda.stream(forward):
        torch.cuda._sleep(50_000_000)  # a slow "forward pass"
        for j in range(4):
            group["kv"].device.tensor(j, 0)[idx] = 7.0
    async with TransferScheduler(group) as sched:
        b = await sched.backup({"kv": pages(3)}, after=forward)
        await b
        host = group["kv"].host
        for j in range(4):
            assert bool((host.layer_view(j, 0)[b.host_indices["kv"]] == 7.0).all())


async def test_a_failing_copy_leaves_the_streams_usable() -> None:
    class Failing(TorchCudaBackend):
        calls = 0

        def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
            Failing.calls += 1
            if Failing.calls == 2:
                raise RuntimeError("injected copy failure")
            super().copy(dst, src)

    group = cuda_group("layer_first")
    async with TransferScheduler(group, executor=CudaExecutor(backend=Failing())) as sched:
        bad = await sched.backup({"kv": pages(0)}, after=torch.cuda.current_stream())
        with pytest.raises(TransferFailed):
            await bad
        assert group.statistics()["kv"].used_slots == 0
        ok = await sched.backup({"kv": pages(1)}, after=torch.cuda.current_stream())
        await ok
        assert torch.equal(snapshot(group, "kv", pages(1))[0],
                           group["kv"].host.layer_view(0, 0)[ok.host_indices["kv"]])


async def test_timing_reports_device_time() -> None:
    group = cuda_group("page_first")
    ex = CudaExecutor(timing=True)
    async with TransferScheduler(group, executor=ex) as sched:
        b = await sched.backup({"kv": pages(1, 5)}, after=torch.cuda.current_stream())
        await b
    s = ex.statistics()
    assert s.batches == 1 and s.device_seconds is not None and s.device_seconds > 0


def test_a_host_pool_over_one_gib_is_pinned_in_chunks_end_to_end() -> None:
    # 1.25 GiB: two cudaHostRegister chunks. Every chunk is registered (CUDA
    # refuses to register any part of it again, and accepts it once unregistered),
    # and a non-blocking copy from the second chunk lands.
    slots = (5 << 30) // 4 // 4096
    pool = HostPool("big", planes=[PlaneSpec((4096,), torch.uint8)], num_layers=1, slots=slots, page_size=16)
    buf = pool.buffer(0)
    assert buf.numel() > 1 << 30 and buf.is_pinned()
    chunk_rows = (1 << 30) // 4096
    for row in (0, chunk_rows - 16, chunk_rows, slots - 16):
        with pytest.raises(RuntimeError, match="failed with CUDA error"):
            register_pinned(buf[0, row : row + 16])
    buf[0, slots - 8 :] = 5
    dev = torch.empty((8, 4096), dtype=torch.uint8, device="cuda")
    dev.copy_(buf[0, slots - 8 :], non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert bool((dev == 5).all())
    pool.close()
    assert not buf.is_pinned()
    register_pinned(buf[0, slots - 16 :])()  # unregistered whole: the tail registers again


def test_a_refused_registration_leaves_no_cuda_error_behind() -> None:
    t = torch.empty(1 << 20, dtype=torch.uint8)
    release = register_pinned(t)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 1048576 bytes at offset 0"):
        register_pinned(t)  # already registered: CUDA refuses
    # The next kernel launches would raise the refusal if it were still the
    # thread's last CUDA error.
    x = torch.ones(4, device="cuda") * 2
    assert float(x.sum().item()) == 8.0
    release()
    assert not t.is_pinned()


class CountingBackend(TorchCudaBackend):
    """Counts the executor's copies, gathers and scatters."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"copy": 0, "gather": 0, "scatter": 0}

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.calls["copy"] += 1
        super().copy(dst, src)

    def gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        self.calls["gather"] += 1
        return super().gather(src, index)

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        self.calls["scatter"] += 1
        super().scatter(dst, index, src)


def wide_cuda_group(layout: str, layers: int, *, stacked: bool = False, slots: int = 256) -> PoolGroup:
    """One kv pool of 2 KiB rows (8 x 128 bf16) a plane: a page of 16 slots is a 32 KiB run, over
    SchedulerConfig.min_run_bytes (16 KiB), so whole pages are copied directly."""
    gen = torch.Generator(device="cuda").manual_seed(layers)
    if stacked:
        planes = [torch.randn((layers, slots, 8, 128), device="cuda", generator=gen).to(torch.bfloat16)
                  for _ in range(2)]
        tensors = [[planes[0][j], planes[1][j]] for j in range(layers)]
    else:
        tensors = [[torch.randn((slots, 8, 128), device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2)]
                   for _ in range(layers)]
    group = PoolGroup()
    group.add_pool("kv", device=DevicePool(tensors), page_size=16, host_slots=slots, layout=layout)
    return group


@pytest.mark.parametrize("stacked", [False, True], ids=["per_layer", "stacked"])
@pytest.mark.parametrize("layout, layers", [("layer_first", 4), ("page_first", 1)])
async def test_long_runs_take_the_direct_path_on_cuda_both_ways(layout: str, layers: int, stacked: bool) -> None:
    group = wide_cuda_group(layout, layers, stacked=stacked)
    host = group["kv"].host
    assert host.buffer(0).data_ptr() % 4096 == 0 and host.buffer(0).is_pinned()
    backend = CountingBackend()
    async with TransferScheduler(group, executor=CudaExecutor(backend=backend)) as sched:
        src = pages(1, 2, 7)  # a run of two pages and a lone page
        b = await sched.backup({"kv": src}, after=torch.cuda.current_stream())
        await b
        assert backend.calls == {"copy": 2 * layers * 2, "gather": 0, "scatter": 0}
        expected = snapshot(group, "kv", src)
        stored = [host.layer_view(j, p)[b.host_indices["kv"]] for j in range(layers) for p in range(2)]
        assert all(torch.equal(a, e) for a, e in zip(stored, expected))
        zero_devices(group)
        dst = pages(9, 3, 12)  # host rows 0..47 are consecutive: three runs
        load = await sched.load(b.host_indices, {"kv": dst}, after=torch.cuda.current_stream())
        await load
        assert backend.calls == {"copy": (2 + 3) * layers * 2, "gather": 0, "scatter": 0}
        got = snapshot(group, "kv", dst)
        assert all(torch.equal(a, e) for a, e in zip(got, expected))
    group.close()


async def test_a_run_across_a_registration_chunk_on_cuda_is_split_and_byte_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.pools.host as host_module

    monkeypatch.setattr(host_module, "PIN_CHUNK_BYTES", 64 << 10)  # 32 rows of 2 KiB a registration
    group = wide_cuda_group("layer_first", 2)
    host = group["kv"].host
    buf = host.buffer(0)
    assert buf.data_ptr() % 4096 == 0
    assert host.registration_cuts(0, 0)[:2] == (32, 64)
    assert buf[0, 31].is_pinned() and buf[0, 32].is_pinned()  # both sides of the first cut registered
    backend = CountingBackend()
    async with TransferScheduler(group, executor=CudaExecutor(backend=backend)) as sched:
        src = pages(0, 1, 2, 3)  # rows 0..63 on the host: across the cut at row 32
        b = await sched.backup({"kv": src}, after=torch.cuda.current_stream())
        await b
        assert torch.equal(b.host_indices["kv"], torch.arange(64))
        expected = snapshot(group, "kv", src)
        zero_devices(group)
        load = await sched.load(b.host_indices, {"kv": pages(8, 9, 10, 11)}, after=torch.cuda.current_stream())
        await load
        got = snapshot(group, "kv", pages(8, 9, 10, 11))
        assert all(torch.equal(a, e) for a, e in zip(got, expected))
    # Split at row 32 each way: two copies per layer and plane, not one.
    assert backend.calls == {"copy": 2 * 2 * 2 * 2, "gather": 0, "scatter": 0}
    group.close()
    assert not buf.is_pinned()
