"""`RewriteKeys` shared across threads: vLLM's worker and every scheduler over
one store share one, and a scheduler's loop thread adds to it while another's
looks up and pops. At its bound, adds from many threads must never raise and
the bound must hold."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from kvtier.scheduler import RewriteKeys


@pytest.fixture
def tight_switching() -> Iterator[None]:
    """Switch threads as often as CPython allows, so interleavings inside `add` happen."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _hammer(keys: RewriteKeys, threads: int, per_thread: int, *, pop: bool) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        start.wait()
        try:
            for i in range(per_thread):
                key = t.to_bytes(2, "little") + i.to_bytes(4, "little")
                keys.add(key, "checksum")
                if len(keys) > keys.limit:
                    raise AssertionError(f"RewriteKeys holds {len(keys)} keys over its limit {keys.limit}")
                if pop and i % 3 == 0:
                    keys.pop(key, None)  # a write of the key put it again
                keys.get(key)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not any(w.is_alive() for w in workers), "a thread did not finish"
    return errors


@pytest.mark.parametrize("pop", [False, True], ids=["add", "add-and-pop"])
def test_many_threads_adding_at_the_bound_never_raise_and_the_bound_holds(tight_switching: None, pop: bool) -> None:
    keys = RewriteKeys(limit=4)
    errors = _hammer(keys, threads=8, per_thread=3000, pop=pop)
    assert errors == []
    assert 0 < len(keys) <= 4
    assert set(keys.values()) == {"checksum"}


def test_the_newest_keys_are_kept_when_threads_are_done(tight_switching: None) -> None:
    keys = RewriteKeys(limit=16)
    assert _hammer(keys, threads=4, per_thread=500, pop=False) == []
    keys.add(b"last", "length")  # one more, from this thread: the newest stays
    assert len(keys) == 16 and list(keys)[-1] == b"last" and keys[b"last"] == "length"
