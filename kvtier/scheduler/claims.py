"""Claims: what one operation holds until it ends, as a record.

Admission fills a claim (`kvtier.scheduler.admission`: the pages it reserved,
pinned or allocated), the operation's carrier holds it down the lanes
(`kvtier.scheduler.carriers`, `kvtier.scheduler.storage`), and
`Admission.release` gives it back, exactly once. A record below all three, so
that none of them calls another to make one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.pools import PageList

__all__ = ["Claim"]


class Claim:
    """What one operation holds until it ends.

    ``writes``: host pages it writes (a backup's, a prefetch's), by pool;
    ``reads``: host pages it reads, pinned (a load's, a storage write's);
    ``device``: device slots kvtier allocated for it (a load's), freed
    unless it succeeds. `Admission.release` gives all of it back, once.
    """

    __slots__ = ("writes", "reads", "device", "released")

    def __init__(
        self,
        *,
        writes: dict[str, list[int]] | None = None,
        reads: dict[str, list[int]] | None = None,
        device: dict[str, PageList] | None = None,
    ) -> None:
        self.writes = writes or {}
        self.reads = reads or {}
        self.device = device or {}
        self.released = False
