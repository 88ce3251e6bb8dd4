"""`SchedulerConfig`: the scheduler's knobs, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtier.errors import ConfigurationError

__all__ = ["SchedulerConfig"]

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How the scheduler batches and queues.

    * ``max_batch_bytes``: a batch takes queued operations until this many bytes
      (at least one operation), so a load waits at most one batch behind a burst.
    * ``max_batch_ops``: and at most this many operations (requests: a
      queue entry carries up to 128 of them, see `kvtier.scheduler.carriers`).
    * ``max_queued_ops``: bound of each lane (load, backup); a full lane makes
      ``await backup(...)``/``load(...)`` wait, and ``backup_nowait`` raise.
    * ``min_run_bytes``: a group of rows gets its own copy call (a slice, a
      gather into consecutive destination rows, or a scatter from consecutive
      source rows) when it moves at least this many bytes per layer and plane;
      smaller leftovers are gathered through a staging buffer. Copies that span
      every layer of a stacked pool use a quarter of it. Measured on a 2-core
      CPU (torch 2.13, bf16): crossovers of 16-32 KiB per layer and 2-8 KiB
      across 32 layers.
    * ``on_close``: leaving ``async with`` either ``"drain"``s what is queued or
      ``"cancel"``s it (those handles raise `SchedulerClosed`).
    * ``storage_chunk_bytes``: `write_storage` and `prefetch` move pages to
      and from the store in rounds of about this many bytes (at least one
      page): a prefetch that stops early keeps every round it completed, and
      waits at most for the round being written into host memory.
    * ``storage_batches_in_flight``: batches of each storage lane that run at
      once (one fetching or putting while the next one's lookup runs).
    * ``prefetches_in_flight``: prefetches of one batch that read from the
      store at the same time.
    * ``verify``: record a checksum per host page and pool at backup, and check
      it before a load copies (and before a storage write reads); a mismatch
      fails that operation with `CorruptionDetected` and copies nothing of
      it. The checksums belong to the host pages (`PoolGroup.checksums`), so
      they outlive one scheduler. Costs a read of the bytes on the host per
      operation, in a worker thread.
    """

    max_batch_bytes: int = 64 * MiB
    max_batch_ops: int = 4096
    max_queued_ops: int = 16384
    min_run_bytes: int = 16 * 1024
    on_close: Literal["drain", "cancel"] = "drain"
    verify: bool = False
    storage_chunk_bytes: int = 4 * MiB
    storage_batches_in_flight: int = 2
    prefetches_in_flight: int = 8

    def __post_init__(self) -> None:
        for field in ("max_batch_bytes", "max_batch_ops", "max_queued_ops", "min_run_bytes", "storage_chunk_bytes",
                      "storage_batches_in_flight", "prefetches_in_flight"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"SchedulerConfig.{field} must be an int >= 1; got {value!r}")
        if not isinstance(self.verify, bool):
            raise ConfigurationError(f"SchedulerConfig.verify must be a bool; got {self.verify!r}")
        if self.on_close not in ("drain", "cancel"):
            raise ConfigurationError(
                f"SchedulerConfig.on_close must be 'drain' or 'cancel'; got {self.on_close!r}"
            )
