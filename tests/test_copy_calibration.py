"""Copy calibration: every candidate method is byte-exact, and the choice is cached as documented.

Property tests copy random rows of random pools with each `CopyMethod` of
`PoolCopy.candidates` and compare every byte of the destination against a
reference made by plain indexing. The calibrator's tests assert behaviour
only (a shape is measured once, the key, the cache file, the fallback),
never a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.transfers.calibration as calibration
from kvtier.errors import ConfigurationError
from kvtier.pools import DevicePool, HostPool, PoolGroup
from kvtier.scheduler import TransferScheduler
from kvtier.transfers import CopyCalibrator, CopyMethod, CpuExecutor, Direction, PoolCopy, shape_key

ROWS = {  # dtype -> per-plane row shape
    torch.bfloat16: (2, 8),  # 32-byte rows: moved as 16-byte elements
    torch.float32: (3,),  # 12-byte rows: 4-byte elements
    torch.int8: (5,),  # 5-byte rows: bytes
}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def build(device: str, layout: str, layers: int, page_size: int, dev_pages: int, host_pages: int,
          dtype: torch.dtype, seed: int) -> tuple[DevicePool, HostPool]:
    """One pool of two planes with random bytes on both sides, the device
    allocated as ``device`` (``stacked``: ``[layers, slots, ...]`` per plane;
    ``slot_first``: ``[slots, layers, ...]``; ``per_layer``)."""
    gen = torch.Generator().manual_seed(seed)
    row = ROWS[dtype]
    slots = dev_pages * page_size

    def rand(shape: tuple[int, ...]) -> torch.Tensor:
        """Random bytes (any bit pattern, NaNs included: compared as bytes)."""
        raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=gen, dtype=torch.uint8)
        return raw.view(dtype)

    if device == "per_layer":
        tensors = [[rand((slots, *row)) for _ in range(2)] for _ in range(layers)]
    elif device == "stacked":
        bufs = [rand((layers, slots, *row)) for _ in range(2)]
        tensors = [[b[j] for b in bufs] for j in range(layers)]
    else:
        bufs = [rand((slots, layers, *row)) for _ in range(2)]
        tensors = [[b[:, j] for b in bufs] for j in range(layers)]
    group = PoolGroup()
    host = group.add_pool("kv", device=DevicePool(tensors), page_size=page_size, host_slots=host_pages * page_size,
                          layout=layout, pin_memory=False)  # type: ignore[arg-type]
    for p in range(2):
        b = host.buffer(p)
        b.copy_(rand(tuple(b.shape)))
    dev = group["kv"].device
    assert dev is not None
    return dev, host


def pages_to_rows(pages: list[int], page_size: int) -> torch.Tensor:
    return torch.tensor([p * page_size + i for p in pages for i in range(page_size)], dtype=torch.int64)


def sides(copy: PoolCopy) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Per layer and plane: (source tensors, destination tensors)."""
    dev = [[copy.device.tensor(j, p) for p in range(2)] for j in range(copy.device.num_layers)]
    host = [[copy.host.layer_view(j, p) for p in range(2)] for j in range(copy.device.num_layers)]
    return (dev, host) if copy.direction is Direction.BACKUP else (host, dev)


def reference(copy: PoolCopy, layers: list[int]) -> list[list[torch.Tensor]]:
    """The destination after the copy of ``layers``, by plain indexing."""
    src, dst = sides(copy)
    out = []
    for j in range(copy.device.num_layers):
        row = []
        for p in range(2):
            want = dst[j][p].clone()
            if j in layers:
                want[copy.dst_rows] = src[j][p][copy.src_rows]
            row.append(want)
        out.append(row)
    return out


def restore(copy: PoolCopy, saved: list[list[torch.Tensor]]) -> None:
    dst = sides(copy)[1]
    for j, row in enumerate(saved):
        for p, t in enumerate(row):
            dst[j][p].copy_(t)


def assert_destination(copy: PoolCopy, want: list[list[torch.Tensor]], label: object) -> None:
    dst = sides(copy)[1]
    for j, row in enumerate(want):
        for p, t in enumerate(row):
            assert torch.equal(as_bytes(dst[j][p]), as_bytes(t)), (label, j, p)


@st.composite
def copies(draw: st.DrawFn) -> tuple[PoolCopy, list[int]]:
    device = draw(st.sampled_from(["stacked", "slot_first", "per_layer"]))
    layout = draw(st.sampled_from(["layer_first", "page_first"]))
    layers = draw(st.integers(1, 3))
    page_size = draw(st.sampled_from([1, 2, 4]))
    dtype = draw(st.sampled_from(sorted(ROWS, key=str)))
    dev_pages, host_pages = 10, 8
    n = draw(st.integers(1, host_pages))
    pattern = draw(st.sampled_from(["contiguous", "random", "runs"]))
    if pattern == "contiguous":
        d0, h0 = draw(st.integers(0, dev_pages - n)), draw(st.integers(0, host_pages - n))
        dev, host = list(range(d0, d0 + n)), list(range(h0, h0 + n))
    elif pattern == "random":
        dev = draw(st.permutations(range(dev_pages)))[:n]
        host = draw(st.permutations(range(host_pages)))[:n]
    else:  # pairs of pages consecutive on both sides, in a random order
        order = draw(st.permutations(range(host_pages // 2)))[: max(1, n // 2)]
        host = [q for o in order for q in (2 * o, 2 * o + 1)]
        dev = [q + 1 for q in host]
    direction = draw(st.sampled_from([Direction.BACKUP, Direction.LOAD]))
    dev_pool, host_pool = build(device, layout, layers, page_size, dev_pages, host_pages, dtype,
                                draw(st.integers(0, 2**16)))
    dev_rows, host_rows = pages_to_rows(dev, page_size), pages_to_rows(host, page_size)
    src, dst = (dev_rows, host_rows) if direction is Direction.BACKUP else (host_rows, dev_rows)
    min_run_bytes = draw(st.sampled_from([0, 64, 1 << 20]))
    copy = PoolCopy("kv", host_pool, dev_pool, direction, src, dst, min_run_bytes)
    subset = draw(st.sampled_from(["all", "first", "range"]))
    chosen = list(range(layers)) if subset == "all" or layers == 1 else [0] if subset == "first" else [layers - 2,
                                                                                                      layers - 1]
    return copy, chosen


@settings(max_examples=60, deadline=None)
@given(copies())
def test_every_candidate_method_is_byte_exact(case: tuple[PoolCopy, list[int]]) -> None:
    copy, layers = case
    saved = [[t.clone() for t in row] for row in sides(copy)[1]]
    src_before = [[t.clone() for t in row] for row in sides(copy)[0]]
    want = reference(copy, layers)
    assert copy.candidates and copy.candidates[0] == CopyMethod(copy.path, "fixed")
    for method in (None, *copy.candidates):
        restore(copy, saved)
        copy.copy_pool_layers(layers, method)
        assert_destination(copy, want, method)
        for j, row in enumerate(sides(copy)[0]):  # the source is only read
            for p, t in enumerate(row):
                assert torch.equal(as_bytes(t), as_bytes(src_before[j][p]))
    # Calibrating writes the copy's own bytes to its own rows, nothing else;
    # the copy with the chosen method then lands every byte.
    restore(copy, saved)
    cal = CopyCalibrator(sample_bytes=64, rounds=2)
    method = cal.choose(copy, layers)
    dst = sides(copy)[1]
    for j, row in enumerate(want):
        for p, t in enumerate(row):
            landed = as_bytes(dst[j][p])
            # every row holds either its old bytes or its final ones
            old_or_new = ((landed == as_bytes(saved[j][p])) | (landed == as_bytes(t))).all()
            assert bool(old_or_new), (j, p)
    copy.copy_pool_layers(layers, method)
    assert_destination(copy, want, ("calibrated", method))
    # The executor's way: trials copy disjoint samples of the first rows, the
    # chosen method the rest; every byte lands, whatever the sample size.
    for sample_bytes in (1, 100, 1 << 20):
        restore(copy, saved)
        CopyCalibrator(sample_bytes=sample_bytes).copy(copy, layers)
        assert_destination(copy, want, ("calibrator.copy", sample_bytes))


def pool_copy(direction: Direction = Direction.BACKUP, *, rows_from: int = 0, device: str = "stacked",
              layout: str = "layer_first", pages: int = 4) -> PoolCopy:
    dev_pool, host_pool = build(device, layout, 4, 4, 16, 16, torch.bfloat16, 1)
    dev = pages_to_rows(list(range(rows_from, rows_from + pages))[::-1], 4)  # scattered device pages
    host = pages_to_rows(list(range(pages)), 4)
    src, dst = (dev, host) if direction is Direction.BACKUP else (host, dev)
    return PoolCopy("kv", host_pool, dev_pool, direction, src, dst, 0)


def test_a_shape_is_calibrated_once_then_its_choice_is_reused() -> None:
    cal = CopyCalibrator()
    first = pool_copy()
    method = cal.choose(first, range(4))  # type: ignore[arg-type]
    assert method in first.candidates
    assert cal.statistics().calibrations == 1
    # Other rows of the same shape: the held choice, no new measurement.
    same = pool_copy(rows_from=8)
    assert shape_key(same) == shape_key(first)
    assert cal.choose(same, list(range(4))) == method
    assert cal.cached(same) == method
    assert cal.statistics().calibrations == 1
    # Another shape (a load) is measured once too.
    load = pool_copy(Direction.LOAD)
    cal.choose(load, list(range(4)))
    cal.choose(load, list(range(4)))
    assert cal.statistics().calibrations == 2 and cal.statistics().choices == 2
    # A group of layers never starts a calibration; it uses a held choice.
    fresh = pool_copy(pages=2)
    assert shape_key(fresh) != shape_key(first)
    assert cal.choose(fresh, [0, 1]) is None and cal.statistics().calibrations == 2


def test_the_shape_key_reads_as_documented() -> None:
    copy = pool_copy()
    threads = torch.get_num_threads()
    assert shape_key(copy) == (f"backup|stacked|layer_first|bfloat16,bfloat16|32,32|L4|page4|rows16|run4|rows|range|"
                               f"t{threads}")
    contiguous = PoolCopy("kv", copy.host, copy.device, Direction.LOAD, pages_to_rows([0, 1, 2], 4),
                          pages_to_rows([5, 6, 7], 4), 0)
    assert shape_key(contiguous) == (f"load|stacked|layer_first|bfloat16,bfloat16|32,32|L4|page4|rows16|run16|"
                                     f"range|range|t{threads}")
    per_layer = pool_copy(device="per_layer", layout="page_first")
    assert shape_key(per_layer).startswith("backup|separate|page_first|")


def test_the_cache_file_survives_a_new_process(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    cal = CopyCalibrator(cache_path=path)
    copy = pool_copy()
    method = cal.choose(copy, list(range(4)))
    data = json.loads(path.read_text())
    assert data["key"] == calibration.machine_key()
    assert data["choices"] == {shape_key(copy): str(method)}
    program = textwrap.dedent(f"""
        import sys
        import torch
        torch.set_num_threads({torch.get_num_threads()})  # the key holds it; earlier tests may have changed ours
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_copy_calibration import pool_copy
        from kvtier.transfers import process_calibrator
        cal = process_calibrator()
        copy = pool_copy()
        print(cal.cached(copy), cal.choose(copy, list(range(4))), cal.statistics().calibrations,
              cal.statistics().loaded)
    """)
    env = {**os.environ, "KVTIER_COPY_CALIBRATION_CACHE": str(path)}
    env.pop("KVTIER_COPY_CALIBRATION", None)
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent.parent)
    assert out.stdout.split() == [str(method), str(method), "0", "1"]


@pytest.mark.parametrize("damage", ["other torch", "other machine", "corrupt", "not json object", "bad method"])
def test_a_cache_file_of_another_key_or_corrupt_is_ignored_and_replaced(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "calibration.json"
    copy = pool_copy()
    good: dict[str, Any] = {"key": calibration.machine_key(), "choices": {shape_key(copy): "layers:runs"}}
    if damage == "other torch":
        good["key"] = {**good["key"], "torch": "0.0.1"}
    elif damage == "other machine":
        good["key"] = {**good["key"], "host": good["key"]["host"] + "-elsewhere"}
    if damage == "corrupt":
        path.write_bytes(b"\x00{not json")
    elif damage == "not json object":
        path.write_text("[1, 2]")
    elif damage == "bad method":
        good["choices"] = {shape_key(copy): "warp:drive"}
        path.write_text(json.dumps(good))
    else:
        path.write_text(json.dumps(good))
    cal = CopyCalibrator(cache_path=path)
    assert cal.cached(copy) is None
    assert cal.statistics().loaded == 0
    method = cal.choose(copy, list(range(4)))
    assert cal.statistics().calibrations == 1
    data = json.loads(path.read_text())  # rewritten under this machine's key
    assert data["key"] == calibration.machine_key() and data["choices"] == {shape_key(copy): str(method)}


def test_a_matching_cache_file_is_used_without_measuring(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    copy = pool_copy()
    path.write_text(json.dumps({"key": calibration.machine_key(), "choices": {shape_key(copy): "layers:one"}}))
    cal = CopyCalibrator(cache_path=path)
    assert cal.choose(copy, list(range(4))) == CopyMethod("layers", "one")
    assert cal.statistics().calibrations == 0 and cal.statistics().loaded == 1


def test_without_calibration_the_fixed_rules_choose(monkeypatch: pytest.MonkeyPatch) -> None:
    copy = pool_copy()
    off = CopyCalibrator(enabled=False)
    assert off.choose(copy, list(range(4))) is None and off.cached(copy) is None
    assert off.statistics().calibrations == 0
    assert CpuExecutor(calibrate=False).calibrator is None
    mine = CopyCalibrator()
    assert CpuExecutor(calibrator=mine).calibrator is mine
    # The environment turns the process-wide calibrator off.
    monkeypatch.setattr(calibration, "_PROCESS", None)
    monkeypatch.setenv("KVTIER_COPY_CALIBRATION", "0")
    executor = CpuExecutor()
    assert executor.calibrator is not None and not executor.calibrator.enabled
    assert executor.calibrator.choose(copy, list(range(4))) is None
    # ... and the label names the fixed rules' method.
    assert executor.calibrator.label(copy) == copy.describe()


def test_calibration_rejects_bad_settings() -> None:
    with pytest.raises(ConfigurationError, match="sample_bytes must be an int >= 1; got 0"):
        CopyCalibrator(sample_bytes=0)
    with pytest.raises(ConfigurationError, match="budget_s must be a number >= 0; got -1"):
        CopyCalibrator(budget_s=-1)
    with pytest.raises(ConfigurationError, match="rounds must be an int >= 1; got 0"):
        CopyCalibrator(rounds=0)


def test_copy_method_names_parse_back() -> None:
    for path, rows in [("span", "one"), ("layers", "runs"), ("stack", "fixed")]:
        assert CopyMethod.parse(str(CopyMethod(path, rows))) == CopyMethod(path, rows)
    assert CopyMethod.parse("stack:one") is None and CopyMethod.parse("span") is None


async def test_a_calibrated_executor_round_trips_byte_exact() -> None:
    dev_pool, _ = build("per_layer", "page_first", 3, 4, 16, 16, torch.bfloat16, 7)
    group = PoolGroup()
    group.add_pool("kv", device=dev_pool, page_size=4, host_slots=64, layout="page_first", pin_memory=False)
    cal = CopyCalibrator()
    device_rows = pages_to_rows([9, 2, 3, 4, 12], 4)
    before = [[dev_pool.tensor(j, p).clone() for p in range(2)] for j in range(3)]
    async with TransferScheduler(group, CpuExecutor(calibrator=cal)) as sched:
        h = await sched.backup({"kv": device_rows})
        await h
        host_rows = h.host_indices["kv"]
        for j in range(3):
            for p in range(2):
                dev_pool.tensor(j, p).zero_()
        await (await sched.load({"kv": host_rows}, {"kv": device_rows}))
    for j in range(3):
        for p in range(2):
            got, want = dev_pool.tensor(j, p), before[j][p]
            assert torch.equal(as_bytes(got[device_rows]), as_bytes(want[device_rows]))
    assert cal.statistics().calibrations == 2  # the backup's shape and the load's
