from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvtier.pools import PoolGroup


def wipe(group: PoolGroup) -> None:
    """Zero every device tensor of every pool (the engine lost the rows)."""
    for spec in group:
        if spec.device is None:
            continue
        for j in range(spec.device.num_layers):
            for p in range(len(spec.device.planes)):
                spec.device.tensor(j, p).zero_()


def rows(group: PoolGroup, pool: str, idx: torch.Tensor) -> list[torch.Tensor]:
    dev = group[pool].device
    assert dev is not None
    return [dev.tensor(j, p)[idx].clone() for j in range(dev.num_layers) for p in range(len(dev.planes))]


def assert_rows_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        assert torch.equal(x, y)


def used(group: PoolGroup) -> dict[str, int | None]:
    return {name: s.used_slots for name, s in group.statistics().items()}


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """An event that holds executor batches; always released at teardown."""
    ev = threading.Event()
    yield ev
    ev.set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA: skip them cleanly without it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
