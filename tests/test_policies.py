"""kvtier.policies: each policy's decisions against a plain reference model.

The models keep lists and time stamps where the policies keep ordered dicts,
so an ordering slip in either shows as a difference.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigurationError
from kvtier.policies import (
    AdmissionStatistics,
    CountedAdmission,
    FrequencyGate,
    HostEviction,
    LruEviction,
    SegmentedLruEviction,
    StoreAdmission,
    StoreAll,
    check_admission_options,
    make_admission,
    make_eviction,
)

KEYS = st.integers(0, 11)


# -- store admission -------------------------------------------------------------------


class GateModel:
    """The frequency gate as a list of [key, count], least recently offered first."""

    def __init__(self, sightings: int, window: int) -> None:
        self.sightings, self.window = sightings, window
        self.entries: list[list[int]] = []

    def admit(self, key: int) -> bool:
        for i, (k, n) in enumerate(self.entries):
            if k == key:
                del self.entries[i]
                self.entries.append([key, min(n + 1, self.sightings)])
                return n + 1 >= self.sightings
        if len(self.entries) == self.window:
            del self.entries[0]
        self.entries.append([key, 1])
        return self.sightings <= 1


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.lists(st.tuples(KEYS, st.sampled_from(["host", "store"])),
                                                      max_size=80))
def test_the_frequency_gate_admits_exactly_what_the_model_admits(
    sightings: int, window: int, offers: list[tuple[int, Any]]
) -> None:
    gate, model = FrequencyGate(sightings, window), GateModel(sightings, window)
    for key, tier in offers:
        got = gate.admit(key, tier)
        if tier == "store":
            assert got is None  # a write-through follows the host decision
            continue
        assert (got is None) == model.admit(key), (key, model.entries)
        assert got in (None, FrequencyGate.REASON)
        assert len(gate) == len(model.entries) <= window
        assert {k: n for k, n in model.entries} == {k: gate.count(k) for k, _ in model.entries}
    assert gate.peak_tracked <= window


def test_a_block_offered_once_is_skipped_and_stored_on_its_second_offer_and_after() -> None:
    gate = FrequencyGate(sightings=2, window=2)
    assert gate.admit(b"a", "host") == "infrequent"
    assert gate.admit(b"a", "host") is None
    assert gate.admit(b"a", "host") is None  # stays admitted while in the window
    gate.admit(b"b", "host")
    gate.admit(b"c", "host")  # the window of 2 drops a, the least recently offered
    assert gate.count(b"a") == 0
    assert gate.admit(b"a", "host") == "infrequent"


def test_counted_admission_counts_decisions_by_tier_and_reason() -> None:
    counted = CountedAdmission(FrequencyGate(2, 8))
    decisions = [counted.admit(k, "host") for k in (b"a", b"b", b"a")] + [counted.admit(b"a", "store")]
    assert decisions == [False, False, True, True]
    assert counted.statistics() == AdmissionStatistics(
        policy="FrequencyGate", offered={"host": 3, "store": 1}, admitted={"host": 1, "store": 1},
        skipped={("host", "infrequent"): 2},
    )
    assert CountedAdmission(StoreAll()).admit(b"x", "host") is True


def test_an_engines_own_policy_is_a_plain_object_and_its_reasons_must_be_strings() -> None:
    class EvenOnly:
        def admit(self, key: Any, tier: Any) -> str | None:
            return None if key % 2 == 0 else "odd"

    assert isinstance(EvenOnly(), StoreAdmission)
    counted = CountedAdmission(EvenOnly())
    assert [counted.admit(k, "store") for k in range(4)] == [True, False, True, False]
    assert counted.statistics().skipped == {("store", "odd"): 2}

    class Bad:
        def admit(self, key: Any, tier: Any) -> Any:
            return False

    with pytest.raises(ConfigurationError, match="must return None or a non-empty reason string; got False"):
        CountedAdmission(Bad()).admit(1, "host")
    with pytest.raises(ConfigurationError, match="needs an admit"):
        CountedAdmission(object())  # type: ignore[arg-type]


def make_even_only() -> StoreAdmission:
    class EvenOnly:
        def admit(self, key: Any, tier: Any) -> str | None:
            return None if key % 2 == 0 else "odd"

    return EvenOnly()


def test_make_admission_builds_each_policy_and_an_engines_own_by_module_path() -> None:
    assert isinstance(make_admission("all"), StoreAll)
    gate = make_admission("frequency", sightings=3, window=9)
    assert isinstance(gate, FrequencyGate) and (gate.sightings, gate.window) == (3, 9)
    own = make_admission(f"{__name__}:make_even_only")
    assert own.admit(2, "host") is None and own.admit(3, "host") == "odd"


@pytest.mark.parametrize(
    ("name", "sightings", "window", "message"),
    [
        ("frequency", 0, None, "option 'admission_sightings' must be an int >= 1; got 0"),
        ("frequency", None, 0, "option 'admission_window' must be an int >= 1; got 0"),
        ("frequency", "2", None, "option 'admission_sightings' must be an int >= 1; got '2'"),
        ("frequency", True, None, "option 'admission_sightings' must be an int >= 1; got True"),
        ("frequency", None, 2.5, "option 'admission_window' must be an int >= 1; got 2.5"),
        ("all", 2, None, "option 'admission_sightings' applies to store_admission='frequency' only"),
        ("lfu", None, None, "option 'store_admission' must be one of \\['all', 'frequency'\\] .*got 'lfu'"),
        (3, None, None, "option 'store_admission' must be one of .*got 3"),
        ("no.such.module:f", None, None, "option 'store_admission'='no.such.module:f' cannot be imported"),
        ("kvtier.policies:ADMISSION_POLICIES", None, None, "must return an object with admit"),
    ],
)
def test_bad_admission_options_raise_naming_the_option_and_value(
    name: Any, sightings: Any, window: Any, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        make_admission(name, sightings=sightings, window=window)


def test_the_gate_refuses_bad_arguments_and_the_option_check_imports_nothing() -> None:
    with pytest.raises(ConfigurationError, match="FrequencyGate sightings must be an int >= 1; got 0"):
        FrequencyGate(0)
    with pytest.raises(ConfigurationError, match="FrequencyGate window must be an int >= 1; got 0"):
        FrequencyGate(2, 0)
    check_admission_options("no.such.module:f")  # well formed: importing it is make_admission's job


# -- host eviction ---------------------------------------------------------------------


class LruModel:
    """LRU as time stamps: victims are the evictable keys with the oldest stamps."""

    def __init__(self) -> None:
        self.stamp: dict[int, int] = {}
        self.t = 0

    def touch(self, key: int) -> None:
        self.t += 1
        self.stamp[key] = self.t

    def insert(self, key: int) -> None:
        self.touch(key)

    def access(self, key: int) -> None:
        if key in self.stamp:
            self.touch(key)

    def remove(self, key: int) -> None:
        self.stamp.pop(key, None)

    def victims(self, n: int, evictable: Any) -> list[int]:
        out = sorted((k for k in self.stamp if evictable(k)), key=self.stamp.__getitem__)[:n]
        for k in out:
            del self.stamp[k]
        return out


class SlruModel:
    """SLRU as (segment, stamp) per key: probation by stamp, then protected by stamp."""

    def __init__(self, protected: int) -> None:
        self.protected = protected
        self.seg: dict[int, tuple[str, int]] = {}
        self.t = 0

    def _put(self, key: int, segment: str) -> None:
        self.t += 1
        self.seg[key] = (segment, self.t)

    def insert(self, key: int) -> None:
        self._put(key, "protected" if self.seg.get(key, ("",))[0] == "protected" else "probation")

    def access(self, key: int) -> None:
        if key not in self.seg:
            return
        self._put(key, "protected")
        members = sorted((s[1], k) for k, s in self.seg.items() if s[0] == "protected")
        if len(members) > self.protected:
            self._put(members[0][1], "probation")

    def remove(self, key: int) -> None:
        self.seg.pop(key, None)

    def victims(self, n: int, evictable: Any) -> list[int]:
        order = sorted((k for k in self.seg if evictable(k)),
                       key=lambda k: (self.seg[k][0] == "protected", self.seg[k][1]))[:n]
        for k in order:
            del self.seg[k]
        return order


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), KEYS),
        st.tuples(st.just("access"), KEYS),
        st.tuples(st.just("remove"), KEYS),
        st.tuples(st.just("pin"), KEYS),
        st.tuples(st.just("unpin"), KEYS),
        st.tuples(st.just("victims"), st.integers(0, 4)),
    ),
    max_size=120,
)


def run_against(policy: HostEviction, model: Any, ops: list[tuple[str, int]]) -> None:
    resident: set[int] = set()
    pinned: set[int] = set()

    def evictable(key: Any) -> bool:
        return key not in pinned

    for op, arg in ops:
        if op == "insert":
            # The caller's contract: insert a new block, or again when its store completes.
            policy.insert(arg)
            model.insert(arg)
            resident.add(arg)
        elif op in ("access", "remove"):
            getattr(policy, op)(arg)
            getattr(model, op)(arg)
            if op == "remove":
                resident.discard(arg)
        elif op == "pin":
            pinned.add(arg)
        elif op == "unpin":
            pinned.discard(arg)
        else:
            got = policy.victims(arg, evictable)
            want = model.victims(arg, evictable)
            assert got == want, (got, want)
            assert not pinned & set(got)  # a pinned block is never a victim
            assert len(got) == min(arg, len(resident - pinned))
            resident -= set(got)
        assert len(policy) == len(resident)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_lru_evicts_exactly_what_the_time_stamp_model_evicts_and_never_a_pinned_block(
    ops: list[tuple[str, int]],
) -> None:
    run_against(LruEviction(), LruModel(), ops)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), OPS)
def test_slru_evicts_exactly_what_the_segment_model_evicts_and_never_a_pinned_block(
    capacity: int, ops: list[tuple[str, int]],
) -> None:
    policy = SegmentedLruEviction(capacity)
    run_against(policy, SlruModel(policy.protected), ops)


def test_slru_keeps_reused_blocks_through_a_scan_of_one_shot_blocks_where_lru_loses_them() -> None:
    def survivors(policy: HostEviction) -> set[int]:
        resident: list[int] = []
        for k in range(4):  # four blocks, each reused once
            policy.insert(k)
            policy.access(k)
            resident.append(k)
        for k in range(100, 140):  # a scan of one-shot blocks through a host of 6
            if len(resident) == 6:
                (victim,) = policy.victims(1, lambda _: True)
                resident.remove(victim)  # type: ignore[arg-type]
            policy.insert(k)
            resident.append(k)
        return set(resident) & set(range(4))

    assert survivors(SegmentedLruEviction(6)) == {0, 1, 2, 3}
    assert survivors(LruEviction()) == set()


def test_make_eviction_by_name_and_bad_names_and_sizes_raise() -> None:
    assert isinstance(make_eviction("lru", 4), LruEviction)
    slru = make_eviction("slru", 10)
    assert isinstance(slru, SegmentedLruEviction) and slru.protected == 8
    with pytest.raises(ConfigurationError, match="option 'host_eviction' must be one of \\['lru', 'slru'\\]; got 'arc'"):
        make_eviction("arc", 4)
    with pytest.raises(ConfigurationError, match="SLRU needs a capacity of at least one block; got 0"):
        SegmentedLruEviction(0)
    with pytest.raises(ConfigurationError, match="protected_share must be a number in \\(0, 1\\); got 1"):
        SegmentedLruEviction(4, 1)
    assert "probation: 0" in repr(SegmentedLruEviction(4))


def test_the_admission_collector_exposes_the_counted_decisions_by_tier_and_reason() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.metrics import AdmissionCollector

    counted = CountedAdmission(FrequencyGate(2, 8))
    for k in (b"a", b"b", b"a"):
        counted.admit(k, "host")
    counted.admit(b"a", "store")
    registry = CollectorRegistry()
    registry.register(AdmissionCollector(counted, labels={"engine": "0"}))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples if s.name.endswith("_total")
    }
    assert samples == {
        ("kvtier_store_admission_offered_total", (("engine", "0"), ("tier", "host"))): 3,
        ("kvtier_store_admission_offered_total", (("engine", "0"), ("tier", "store"))): 1,
        ("kvtier_store_admission_admitted_total", (("engine", "0"), ("tier", "host"))): 1,
        ("kvtier_store_admission_admitted_total", (("engine", "0"), ("tier", "store"))): 1,
        ("kvtier_store_admission_skipped_total", (("engine", "0"), ("reason", "infrequent"), ("tier", "host"))): 2,
    }
    with pytest.raises(ValueError, match="labels \\['tier'\\] are kvtier's own"):
        AdmissionCollector(counted, labels={"tier": "x"})
    with pytest.raises(TypeError, match="must be a CountedAdmission; got FrequencyGate"):
        AdmissionCollector(FrequencyGate())  # type: ignore[arg-type]


# -- defaults, names and edges --------------------------------------------------------------


def test_the_defaults_are_store_all_and_a_gate_of_two_sightings_in_65536_keys() -> None:
    assert isinstance(make_admission(), StoreAll) and repr(make_admission()) == "<StoreAll>"
    for gate in (make_admission("frequency"), FrequencyGate()):
        assert isinstance(gate, FrequencyGate)
        assert (gate.sightings, gate.window, gate.tier, gate.peak_tracked) == (2, 65536, "host", 0)
    assert repr(FrequencyGate()) == "<FrequencyGate [tracked: 0 of 65536 | sightings=2, tier=host]>"
    assert isinstance(make_eviction("lru", 5), LruEviction)


@pytest.mark.parametrize("name", ["mod:", ":factory", "nocolon", "mod:factory:extra", "mod::factory"])
def test_a_factory_path_needs_one_module_and_one_name(name: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        check_admission_options(name)
    assert str(refused.value) == (
        f"option 'store_admission' must be one of ['all', 'frequency'] or 'module:factory'; got {name!r}"
    )


def test_a_factory_path_names_its_module_before_the_first_colon() -> None:
    check_admission_options("kvtier.policies:StoreAll")
    assert isinstance(make_admission("kvtier.policies:StoreAll"), StoreAll)


@pytest.mark.parametrize(("option", "value"), [("sightings", 0), ("window", 0)])
def test_admission_options_of_one_are_the_least(option: str, value: int) -> None:
    make_admission("frequency", **{option: 1})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=rf"^option 'admission_{option}' must be an int >= 1; got 0$"):
        make_admission("frequency", **{option: value})  # type: ignore[arg-type]


def test_a_gate_admits_on_exactly_its_nth_sighting_and_tracks_its_peak() -> None:
    gate = FrequencyGate(3, window=2, tier="store")
    assert [gate.admit("a", "store") for _ in range(4)] == ["infrequent", "infrequent", None, None]
    assert gate.count("a") == 3 and gate.peak_tracked == 1
    gate.admit("b", "store")
    gate.admit("c", "store")  # the window holds two keys: a (offered longest ago) goes
    assert (gate.count("a"), gate.count("b"), gate.count("c"), gate.peak_tracked, len(gate)) == (0, 1, 1, 2, 2)
    with pytest.raises(ConfigurationError, match=r"^FrequencyGate sightings must be an int >= 1; got True$"):
        FrequencyGate(True)
    with pytest.raises(ConfigurationError, match=r"^FrequencyGate window must be an int >= 1; got 2.0$"):
        FrequencyGate(2, 2.0)  # type: ignore[arg-type]


def test_counted_admission_counts_each_decision_and_refuses_an_empty_reason() -> None:
    counted = CountedAdmission(FrequencyGate(2, tier="store"))
    assert repr(counted) == "<CountedAdmission <FrequencyGate [tracked: 0 of 65536 | sightings=2, tier=store]> [offered: 0, skipped: 0]>"
    assert [counted.admit(k, "store") for k in ("a", "a", "a", "b")] == [False, True, True, False]
    stats = counted.statistics()
    assert (stats.offered["store"], stats.admitted["store"], stats.skipped) == (4, 2, {("store", "infrequent"): 2})
    assert repr(counted).endswith("[offered: 4, skipped: 2]>")

    class Empty:
        def admit(self, key: object, tier: str) -> str:
            return ""

    with pytest.raises(ConfigurationError, match=r"must return None or a non-empty reason string; got ''$"):
        CountedAdmission(Empty()).admit("a", "host")  # type: ignore[arg-type]


def test_lru_and_slru_know_their_resident_keys() -> None:
    lru = LruEviction()
    slru = SegmentedLruEviction(4)
    for policy in (lru, slru):
        policy.insert("a")
        assert "a" in policy and "b" not in policy
    slru.access("a")  # protected now
    assert "a" in slru and slru.segment("a") == "protected" and slru.segment("b") is None


def test_slru_sizes_its_segments_and_refuses_bad_options_by_name() -> None:
    slru = SegmentedLruEviction(10, protected_share=0.25)
    assert (slru.capacity, slru.protected) == (10, 2)
    assert SegmentedLruEviction(1, protected_share=0.5).protected == 1  # at least one block protected
    for bad in (0, True, 2.0):
        with pytest.raises(ConfigurationError, match=rf"^SLRU needs a capacity of at least one block; got {bad!r}$"):
            SegmentedLruEviction(bad)  # type: ignore[arg-type]
    for share in (0, 0.0, 1, True, "0.5"):
        with pytest.raises(ConfigurationError, match=r"^SLRU protected_share must be a number in \(0, 1\); got "):
            SegmentedLruEviction(4, protected_share=share)  # type: ignore[arg-type]


def test_slru_counts_both_segments_and_removes_from_either() -> None:
    slru = SegmentedLruEviction(10, protected_share=0.5)
    for k in "abcd":
        slru.insert(k)
    slru.access("a")
    slru.access("b")
    assert len(slru) == 4
    slru.remove("a")  # from the protected segment
    slru.remove("c")  # from probation
    assert len(slru) == 2 and "a" not in slru and slru.segment("b") == "protected"
    slru.remove("zz")  # not resident: nothing


def test_slru_keeps_its_protected_segment_in_recency_order() -> None:
    slru = SegmentedLruEviction(10, protected_share=0.2)  # two protected
    for k in "abc":
        slru.insert(k)
        slru.access(k)  # a, b protected; c pushes a (least recent) back to probation
    assert [slru.segment(k) for k in "abc"] == ["probation", "protected", "protected"]
    slru.access("b")  # b most recent in protected
    slru.insert("c")  # re-inserting a protected key keeps it protected, most recent
    slru.insert("d")
    slru.access("d")  # d protected: b is now the least recent protected and goes back
    assert [slru.segment(k) for k in "abcd"] == ["probation", "probation", "protected", "protected"]
    assert slru.candidates(4, lambda k: True) == ["a", "b", "c", "d"]
    assert slru.candidates(3, lambda k: True) == ["a", "b", "c"]  # the protected segment tops up only the rest
    assert slru.victims(3, lambda k: k != "b") == ["a", "c", "d"]
    assert slru.victims(3, lambda k: True) == ["b"]
