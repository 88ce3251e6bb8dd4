"""Tests on a real CUDA device (marker ``gpu``; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from kvtier import DevicePool, PoolGroup, TransferFailed, TransferScheduler
from kvtier.transfers.cuda import CudaExecutor, TorchCudaBackend

pytestmark = pytest.mark.gpu


def cuda_group(layout: str, *, layers: int = 4, slots: int = 256, page_size: int = 16) -> PoolGroup:
    gen = torch.Generator(device="cuda").manual_seed(0)
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


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_round_trip_on_cuda_is_byte_exact(layout: str) -> None:
    group = cuda_group(layout)
    assert group["kv"].host.buffer(0).is_pinned()
    async with TransferScheduler(group) as sched:
        assert isinstance(sched.executor, CudaExecutor)
        src = pages(1, 2, 7, 9)
        b = await sched.backup({"kv": src})
        await b
        expected = {n: snapshot(group, n, i) for n, i in b.device_indices.items()}
        for spec in group:
            for j in range(spec.device.num_layers):
                for p in range(len(spec.device.planes)):
                    spec.device.tensor(j, p).zero_()
        load = await sched.load(b.host_indices, {"kv": pages(3, 4, 12, 5)})
        await load
        torch.cuda.synchronize()
        for name, rows in expected.items():
            got = snapshot(group, name, load.device_indices[name])
            assert all(torch.equal(a, b) for a, b in zip(rows, got))
    group.close()
    assert not group["kv"].host.buffer(0).is_pinned()


async def test_wait_layer_orders_a_compute_stream_after_the_layer() -> None:
    group = cuda_group("layer_first", layers=8)
    async with TransferScheduler(group) as sched:
        b = await sched.backup({"kv": pages(0, 1)})
        await b
        expected = snapshot(group, "kv", pages(0, 1))
        dst = pages(10, 11).cuda()
        compute = torch.cuda.Stream()
        load = await sched.load(b.host_indices, {"kv": pages(10, 11)})
        seen = []
        with torch.cuda.stream(compute):
            for layer in range(8):
                await load.wait_layer(layer, compute)
                seen.append(group["kv"].device.tensor(layer, 0)[dst].clone())
        compute.synchronize()
        await load
        for layer in range(8):
            assert torch.equal(seen[layer].cpu(), expected[2 * layer])


async def test_backup_after_a_stream_sees_what_that_stream_wrote() -> None:
    group = cuda_group("layer_first")
    forward = torch.cuda.Stream()
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
        bad = await sched.backup({"kv": pages(0)})
        with pytest.raises(TransferFailed):
            await bad
        assert group.statistics()["kv"].used_slots == 0
        ok = await sched.backup({"kv": pages(1)})
        await ok
        assert torch.equal(snapshot(group, "kv", pages(1))[0],
                           group["kv"].host.layer_view(0, 0)[ok.host_indices["kv"]])
