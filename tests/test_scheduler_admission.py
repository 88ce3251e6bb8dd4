"""TransferScheduler's ``store_admission``: the pages of `write_storage` a
`kvtier.policies.StoreAdmission` refuses are not written, and are counted.

Two engines share a `FileStore`: what engine A's policy let through comes
back byte-exact (``torch.equal``) in engine B; what it refused is absent from
the store; the counts (result, statistics, ``kvtier_storage_*`` metrics) are
exact.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import pytest
from conftest import used
from prometheus_client import CollectorRegistry
from test_metrics import Scraped, scrape
from test_storage_scheduler import (
    ANCHORS, assert_rows_equal, backup, baseline, engine, load_rows, page_nbytes, prefix_keys, prefix_rows, req_of,
)

from kvtier import ConfigurationError, TransferFailed, TransferScheduler
from kvtier.metrics import KvtierCollector
from kvtier.policies import FrequencyGate, StoreAll, Tier, make_admission
from kvtier.storage import FileStore

N, N_STATE = 3, 2
COUNTS = {"kv": N, "swa": N, "state": N_STATE, "tok": N}


async def stored(path: Path, keys: dict[str, list[bytes]]) -> list[bool]:
    """Whether each key (pool by pool) is in the store at ``path``."""
    store = FileStore(path)
    try:
        return await store.exists([k for p in ANCHORS for k in keys[p]])
    finally:
        await store.aclose()


class RefuseKeys:
    """Refuses the keys it was given (reason ``"listed"``), and records every offer."""

    def __init__(self, refused: set[bytes]) -> None:
        self.refused = refused
        self.offers: list[tuple[Hashable, str]] = []

    def admit(self, key: Hashable, tier: Tier) -> str | None:
        self.offers.append((key, tier))
        return "listed" if key in self.refused else None


async def test_refused_pages_are_not_written_and_admitted_ones_round_trip(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    keys = prefix_keys(a, N, N_STATE)
    # The last page of every pool is refused: the stored run from the first key is the rest.
    last = {ks[-1] for ks in keys.values()}
    policy = RefuseKeys(last)
    registry = CollectorRegistry()
    async with TransferScheduler(a, storage=FileStore(tmp_path), store_admission=policy) as sched:
        registry.register(KvtierCollector(sched))
        h = await backup(sched, req_of(N, N_STATE))
        host = {p: h.host_indices[p] for p in ANCHORS}
        result = await (await sched.write_storage(host, keys))
        assert policy.offers == [(k, "store") for p in keys for k in keys[p]]  # each page once, before any put
        assert dict(result.pages) == COUNTS
        assert dict(result.pages_skipped) == dict.fromkeys(ANCHORS, 1)
        assert dict(result.pages_written) == {p: n - 1 for p, n in COUNTS.items()}
        assert dict(result.pages_present) == dict.fromkeys(ANCHORS, 0)
        assert result.nbytes == sum((n - 1) * page_nbytes(a, p) for p, n in COUNTS.items()) > 0
        st = sched.statistics().storage
        assert st is not None
        assert (st.pages_written, st.pages_present, st.pages_skipped) == (sum(COUNTS.values()) - 4, 0, 4)
        assert dict(st.pages_skipped_by_reason) == {"listed": 4}
        got = Scraped(scrape(registry))
        assert got("kvtier_storage_write_pages_total", outcome="skipped") == 4
        assert got("kvtier_storage_write_pages_total", outcome="written") == st.pages_written
        assert got("kvtier_storage_write_skipped_pages_total", reason="listed") == 4
        # Skipped pages are absent from the store; written ones present.
        assert await stored(tmp_path, keys) == [k not in last for p in ANCHORS for k in keys[p]]
        written = {p: n - 1 for p, n in COUNTS.items()}
        want = prefix_rows(a, h.device_indices, written)
        sched.free_host(host)
    base_b = baseline(b)
    async with TransferScheduler(b, storage=FileStore(tmp_path)) as sched_b:
        res = await (await sched_b.prefetch(keys, policy="wait_complete"))
        assert dict(res.pages) == written and dict(res.hit_pages) == written
        assert_rows_equal(await load_rows(sched_b, b, res), want)
        sched_b.free_host(res.host_indices)
    assert used(b) == base_b


async def test_a_frequency_gate_writes_a_page_on_its_second_write(tmp_path: Path) -> None:
    a, b = engine(1), engine(2)
    keys = prefix_keys(a, N, N_STATE)
    gate = FrequencyGate(sightings=2, window=64, tier="store")
    async with TransferScheduler(a, storage=FileStore(tmp_path), store_admission=gate) as sched:
        h = await backup(sched, req_of(N, N_STATE))
        host = {p: h.host_indices[p] for p in ANCHORS}
        first = await (await sched.write_storage(host, keys))
        assert dict(first.pages_skipped) == COUNTS
        assert dict(first.pages_written) == dict.fromkeys(ANCHORS, 0) and first.nbytes == 0
        assert await stored(tmp_path, keys) == [False] * sum(COUNTS.values())  # nothing put
        second = await (await sched.write_storage(host, keys))
        assert dict(second.pages_written) == COUNTS and dict(second.pages_skipped) == dict.fromkeys(ANCHORS, 0)
        third = await (await sched.write_storage(host, keys))  # admitted, and found stored
        assert dict(third.pages_present) == COUNTS and dict(third.pages_written) == dict.fromkeys(ANCHORS, 0)
        st = sched.statistics().storage
        assert st is not None
        total = sum(COUNTS.values())
        assert (st.pages_skipped, st.pages_written, st.pages_present) == (total, total, total)
        assert dict(st.pages_skipped_by_reason) == {FrequencyGate.REASON: total}
        want = prefix_rows(a, h.device_indices, COUNTS)
        sched.free_host(host)
    async with TransferScheduler(b, storage=FileStore(tmp_path)) as sched_b:
        res = await (await sched_b.prefetch(keys, policy="wait_complete"))
        assert dict(res.pages) == COUNTS
        assert_rows_equal(await load_rows(sched_b, b, res), want)
        sched_b.free_host(res.host_indices)


async def test_without_a_policy_nothing_is_skipped(tmp_path: Path) -> None:
    a = engine(1)
    keys = prefix_keys(a, N, N_STATE)
    async with TransferScheduler(a, storage=FileStore(tmp_path), store_admission=StoreAll()) as sched:
        h = await backup(sched, req_of(N, N_STATE))
        host = {p: h.host_indices[p] for p in ANCHORS}
        result = await (await sched.write_storage(host, keys))
        assert dict(result.pages_written) == COUNTS and dict(result.pages_skipped) == dict.fromkeys(ANCHORS, 0)
        st = sched.statistics().storage
        assert st is not None and (st.pages_skipped, dict(st.pages_skipped_by_reason)) == (0, {})
        sched.free_host(host)


@pytest.mark.parametrize("bad, words", [
    (object(), "store_admission must be a kvtier.policies.StoreAdmission"),
    ("frequency", "got 'frequency'"),
    (FrequencyGate(2), "counts offers to the 'host' tier"),
])
def test_a_bad_store_admission_is_refused_naming_it(tmp_path: Path, bad: object, words: str) -> None:
    with pytest.raises(ConfigurationError, match=words.replace("(", r"\(").replace(".", r"\.")):
        TransferScheduler(engine(1), storage=FileStore(tmp_path), store_admission=bad)  # type: ignore[arg-type]


def test_a_store_admission_needs_a_storage_backend() -> None:
    with pytest.raises(ConfigurationError, match="needs a storage backend"):
        TransferScheduler(engine(1), store_admission=StoreAll())


async def test_a_policy_returning_a_bad_reason_fails_the_write_and_puts_nothing(tmp_path: Path) -> None:
    class Bad:
        def admit(self, key: Hashable, tier: Tier) -> str | None:
            return ""

    a = engine(1)
    keys = prefix_keys(a, N, N_STATE)
    async with TransferScheduler(a, storage=FileStore(tmp_path), store_admission=Bad()) as sched:
        h = await backup(sched, req_of(N, N_STATE))
        host = {p: h.host_indices[p] for p in ANCHORS}
        with pytest.raises(TransferFailed) as info:
            await (await sched.write_storage(host, keys))
        assert isinstance(info.value.__cause__, ConfigurationError)
        assert "non-empty reason string" in str(info.value.__cause__)
        assert await stored(tmp_path, keys) == [False] * sum(COUNTS.values())
        sched.free_host(host)
        assert used(a) == baseline(a)


def test_a_store_tier_gate_counts_store_offers_and_admits_host_ones() -> None:
    gate = FrequencyGate(sightings=2, window=4, tier="store")
    assert gate.admit(b"a", "store") == FrequencyGate.REASON
    assert gate.admit(b"a", "host") is None and gate.count(b"a") == 1  # not counted
    assert gate.admit(b"a", "store") is None
    assert make_admission("frequency", sightings=3, tier="store").tier == "store"  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match="tier must be one of \\['host', 'store'\\]; got 'disk'"):
        FrequencyGate(2, tier="disk")  # type: ignore[arg-type]
