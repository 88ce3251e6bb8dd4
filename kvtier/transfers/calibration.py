"""Copy calibration: the fastest `CopyMethod` per copy shape, measured on this machine.

`CopyCalibrator.choose` is called by the CPU executor's worker thread (never
on the event loop) before it copies a pool's rows. The first time a *shape*
(`shape_key`: device allocation, host layout, direction, dtypes and row bytes,
layers, page size, rows and runs as powers of two, whether each side is one
range, torch's thread count) is seen, it times every distinct candidate of
`PoolCopy.candidates` on samples of the copy itself (each trial copies about
``sample_bytes``: every row of a range of layers, or whole pages of one
layer's rows when a layer moves more; disjoint samples while they last, into
the copy's own destination rows: nothing else is touched), in alternating
rounds, and keeps the fastest by its best trial
(the fixed rules' own method unless another is at least `CALIBRATION_MARGIN`
faster); `CopyCalibrator.copy` then copies
only the rows the trials did not reach. Two rounds always run (a trial
slowed by another thread counts only when its other one was too); a third
starts only while the calibration has spent less than ``budget_s``: with the
defaults (2 MiB, 20 ms, at most 3 rounds) one shape costs a few
milliseconds, and about 30 ms at worst, once per process. Every candidate writes the same bytes,
so the choice changes speed only, never a result.

Choices are cached per calibrator (the process-wide one: `process_calibrator`)
and, with a ``cache_path``, in a JSON file that a later process reads back:
its ``key`` names the machine (host name, architecture, CPU model, CPU count)
and the torch version, and a file whose key differs, or that cannot be read,
is ignored (and replaced on the next save). Environment: ``KVTIER_COPY_CALIBRATION=0``
turns the process-wide calibrator off (the fixed rules then choose);
``KVTIER_COPY_CALIBRATION_CACHE=PATH`` gives it a cache file.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.errors import ConfigurationError
from kvtier.transfers.plan import CopyMethod, PoolCopy

__all__ = [
    "CALIBRATION_BUDGET_S",
    "CALIBRATION_MARGIN",
    "CALIBRATION_ROUNDS",
    "CALIBRATION_SAMPLE_BYTES",
    "CACHE_FORMAT",
    "CalibrationStatistics",
    "CopyCalibrator",
    "machine_key",
    "process_calibrator",
    "shape_key",
]

# Bytes one trial copies (all layers and planes of a sample of the rows).
CALIBRATION_SAMPLE_BYTES = 2 << 20
# Rounds of trials start only while a shape's calibration has spent less than this.
CALIBRATION_BUDGET_S = 0.020
CALIBRATION_ROUNDS = 3
# Another method replaces the fixed rules' only when its best trial is at least
# this much faster: a timing on a shared machine moves by more than the
# methods' own differences, and the fixed rules were measured to be near the best.
CALIBRATION_MARGIN = 0.10
# Bumped whenever the shape key or the method names change meaning.
CACHE_FORMAT = 1


def _pow2(n: int) -> int:
    """``n`` rounded to the power of two at or above it (0 stays 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def shape_key(copy: PoolCopy) -> str:
    """The shape of ``copy`` that a calibrated choice is kept for, as text:
    ``direction|device|host layout|dtypes|row bytes|layers|page|rows|run|src|dst|threads``,
    e.g. ``backup|stacked|layer_first|bfloat16,bfloat16|2048,2048|L32|page16|rows512|run16|range|range|t1``.
    ``rows`` is the row count and ``run`` the mean run consecutive on both
    sides, each rounded up to a power of two; ``src``/``dst`` say whether that
    side's rows are one ascending range; ``t`` is torch's intra-op thread count."""
    src = copy.src_rows.numpy()
    dst = copy.dst_rows.numpy()
    n = int(src.size)
    if n > 1:
        s_break = src[1:] - src[:-1] != 1
        d_break = dst[1:] - dst[:-1] != 1
        runs = 1 + int(np.count_nonzero(s_break | d_break))
        src_range, dst_range = not s_break.any(), not d_break.any()
    else:
        runs, src_range, dst_range = n, True, True
    return (f"{_static_key(copy)}|rows{_pow2(n)}|run{_pow2(max(1, n // max(1, runs)))}|"
            f"{'range' if src_range else 'rows'}|{'range' if dst_range else 'rows'}|t{torch.get_num_threads()}")


# The part of a key fixed by the pools and the direction, made once per pool pair.
_STATIC: weakref.WeakKeyDictionary[object, dict[tuple[int, str], str]] = weakref.WeakKeyDictionary()


def _static_key(copy: PoolCopy) -> str:
    memo = _STATIC.get(copy.device)
    if memo is None:
        memo = _STATIC.setdefault(copy.device, {})
    k = (id(copy.host), copy.direction.value)
    text = memo.get(k)
    if text is None:
        planes = copy.device.planes
        text = memo[k] = "|".join((
            copy.direction.value,
            "stacked" if copy.stacked is not None else "separate",
            copy.host.layout,
            ",".join(str(p.dtype).removeprefix("torch.") for p in planes),
            ",".join(str(p.slot_nbytes) for p in planes),
            f"L{copy.device.num_layers}",
            f"page{copy.host.page_size}",
        ))
    return text


def machine_key() -> dict[str, Any]:
    """What a cache file's choices were measured on: this machine and torch."""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.partition(":")[2].strip()
                    break
    except OSError:
        pass
    return {
        "format": CACHE_FORMAT,
        "host": platform.node(),
        "machine": platform.machine(),
        "cpu": model,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }


@dataclass(frozen=True, slots=True)
class CalibrationStatistics:
    """What a `CopyCalibrator` did: shapes calibrated in this process (and
    their seconds in total), shapes whose choice came from the cache file,
    and choices held now."""

    calibrations: int
    seconds: float
    loaded: int
    choices: int


class CopyCalibrator:
    """Chooses each copy's `CopyMethod` by timing the candidates, once per shape.

    ``enabled=False`` makes `choose` return None (the fixed rules copy).
    ``cache_path``: a JSON file of choices to read at first use and to
    rewrite (atomically) after each new calibration. Thread-safe: the cache is
    shared by every executor that uses this calibrator; two threads meeting a
    new shape at once may both calibrate it (the later choice stays). Raises
    `ConfigurationError` for a ``sample_bytes`` < 1, a negative ``budget_s``
    or ``rounds`` < 1.
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        cache_path: str | os.PathLike[str] | None = None,
        sample_bytes: int = CALIBRATION_SAMPLE_BYTES,
        budget_s: float = CALIBRATION_BUDGET_S,
        rounds: int = CALIBRATION_ROUNDS,
    ) -> None:
        if not isinstance(sample_bytes, int) or sample_bytes < 1:
            raise ConfigurationError(f"sample_bytes must be an int >= 1; got {sample_bytes!r}")
        if not isinstance(budget_s, (int, float)) or budget_s < 0:
            raise ConfigurationError(f"budget_s must be a number >= 0; got {budget_s!r}")
        if not isinstance(rounds, int) or rounds < 1:
            raise ConfigurationError(f"rounds must be an int >= 1; got {rounds!r}")
        self.enabled = enabled
        self.cache_path = None if cache_path is None else Path(cache_path)
        self.sample_bytes = sample_bytes
        self.budget_s = float(budget_s)
        self.rounds = rounds
        self._choices: dict[str, str] = {}
        self._lock = threading.Lock()
        self._disk_read = self.cache_path is None
        self._calibrations = 0
        self._seconds = 0.0
        self._loaded = 0

    def cached(self, copy: PoolCopy) -> CopyMethod | None:
        """The choice held for ``copy``'s shape (memory or cache file), or
        None; never measures."""
        if not self.enabled or not copy.candidates:
            return None
        self._read_disk()
        name = self._choices.get(shape_key(copy))
        method = None if name is None else CopyMethod.parse(name)
        return method if method in copy.candidates else None

    def label(self, copy: PoolCopy) -> str:
        """The method this calibrator copies ``copy``'s rows with, as
        `PoolCopy.describe` writes it: its held choice for their shape (looked
        up, never measured here), else the fixed rules'."""
        return copy.describe(self.cached(copy))

    def choose(self, copy: PoolCopy, layers: Sequence[int]) -> CopyMethod | None:
        """The method to copy ``copy``'s pool layers ``layers`` with: the
        shape's held choice, or, for a shape seen the first time in a copy of
        every pool layer, the fastest candidate measured now (which writes
        samples of the copy's own bytes into its destination rows). None when
        disabled or on a non-CPU device (the fixed rules copy). Call it in the
        thread that copies, never on the event loop."""
        return self._choose(copy, layers)[0]

    def copy(self, copy: PoolCopy, layers: Sequence[int]) -> None:
        """Copy ``copy``'s pool layers ``layers`` with the method `choose`
        gives. A calibration's trials copy parts of the copy itself (`_units`),
        disjoint while they last: only the parts they did not reach are
        copied afterwards, so measuring a large copy costs little more than
        the copy."""
        method, rest = self._choose(copy, layers)
        if rest is None:
            copy.copy_pool_layers(layers, method)
            return
        for part, part_layers in rest:
            part.copy_pool_layers(part_layers, method)

    def _choose(
        self, copy: PoolCopy, layers: Sequence[int]
    ) -> tuple[CopyMethod | None, list[tuple[PoolCopy, list[int]]] | None]:
        """`choose`, and after a calibration the parts of the copy its trials
        did not reach (None: copy it all)."""
        if not self.enabled or not copy.candidates:
            return None, None
        if len(copy.candidates) == 1:
            return copy.candidates[0], None
        self._read_disk()
        key = shape_key(copy)
        name = self._choices.get(key)
        if name is not None:
            method = CopyMethod.parse(name)
            return (method if method in copy.candidates else None), None
        if len(layers) != copy.device.num_layers:
            return None, None  # a group of layers: calibrated on the next whole copy
        start = time.perf_counter()
        method, rest = self._calibrate(copy, sorted(layers))
        seconds = time.perf_counter() - start
        with self._lock:
            self._calibrations += 1
            self._seconds += seconds
            if method is not None:
                self._choices[key] = str(method)
        if method is not None:
            self._write_disk()
        return method, rest

    def _units(self, copy: PoolCopy, layers: list[int]) -> list[tuple[int, int, int, int]]:
        """The copy cut into trial samples ``(first layer, end layer, first
        row, end row)`` (positions in ``layers`` and in the copy's rows), in
        order: every row of a range of layers moving about ``sample_bytes``
        (at least two layers where there are, so paths across layers run as
        they will); when one layer alone moves over four samples, whole pages
        of rows of one layer."""
        n = copy.rows
        count = len(layers)
        row_layer = max(1, copy.host.slot_nbytes // max(1, copy.host.num_layers))
        layer_bytes = n * row_layer
        if layer_bytes <= 4 * self.sample_bytes or count == 1:
            k = max(1, min(count, self.sample_bytes // layer_bytes))
            if count > 1:
                k = max(2, k)
            if layer_bytes <= 4 * self.sample_bytes:
                bounds = list(range(0, count, k))
                if count - bounds[-1] < k and len(bounds) > 1 and k > 1 and count - bounds[-1] < 2:
                    bounds.pop()  # no group of one layer at the end
                ends = [*bounds[1:], count]
                return [(lo, hi, 0, n) for lo, hi in zip(bounds, ends)]
        page = max(1, copy.host.page_size or 1)
        chunk = max(page, self.sample_bytes // row_layer // page * page)
        return [(j, j + 1, a, min(a + chunk, n)) for j in range(count) for a in range(0, n, chunk)]

    def _calibrate(
        self, copy: PoolCopy, layers: list[int]
    ) -> tuple[CopyMethod | None, list[tuple[PoolCopy, list[int]]] | None]:
        """Time each distinct candidate on samples of the copy (`_units`);
        the fastest by its best trial (the fixed rules' unless another beats
        it by `CALIBRATION_MARGIN`), and the parts the trials left to copy
        (None: all of it, after a failed trial)."""
        # Candidates whose plans make the same calls are timed once.
        distinct: dict[str, CopyMethod] = {}
        for m in copy.candidates:
            distinct.setdefault(copy.describe(m), m)
        methods = list(distinct.values())
        if len(methods) == 1:
            return methods[0], None
        units = self._units(copy, layers)
        parts: dict[tuple[int, int], PoolCopy] = {(0, copy.rows): copy}

        def part(a: int, b: int) -> PoolCopy:
            p = parts.get((a, b))
            if p is None:
                p = parts[a, b] = copy.rows_between(a, b)
            return p

        best: dict[CopyMethod, float] = {}
        failed = False
        began = time.perf_counter()
        trial = 0
        for r in range(self.rounds):
            if r > 1 and time.perf_counter() - began >= self.budget_s:
                break
            for m in methods if r % 2 == 0 else reversed(methods):
                lo, hi, a, b = units[trial % len(units)]
                trial += 1
                sample, sample_layers = part(a, b), layers[lo:hi]
                t0 = time.perf_counter()
                try:
                    sample.copy_pool_layers(sample_layers, m)
                except Exception:  # noqa: BLE001 - a method that cannot run here is no candidate
                    best[m] = math.inf
                    failed = True
                    continue
                best[m] = min(best.get(m, math.inf), time.perf_counter() - t0)
        fastest = min(methods, key=lambda m: best.get(m, math.inf))
        if best.get(fastest, math.inf) == math.inf:
            return None, None
        fixed = best.get(methods[0], math.inf)  # the fixed rules' method comes first
        if best[fastest] > fixed * (1 - CALIBRATION_MARGIN):
            fastest = methods[0]  # not clearly faster: keep what the fixed rules chose
        if failed:
            return fastest, None
        # What the trials left: the units after the last one they copied, the
        # rest of a layer's rows and then whole layers in one range.
        if trial >= len(units):
            return fastest, []
        lo, hi, a, b = units[trial]
        rest: list[tuple[PoolCopy, list[int]]] = []
        if a > 0:
            rest.append((part(a, copy.rows), layers[lo:hi]))
            lo = hi
        if lo < len(layers):
            rest.append((copy, layers[lo:]))
        return fastest, rest

    def _read_disk(self) -> None:
        if self._disk_read:
            return
        with self._lock:
            if self._disk_read:
                return
            self._disk_read = True
            choices = _read_cache(self.cache_path) if self.cache_path is not None else {}
            for key, name in choices.items():
                self._choices.setdefault(key, name)
            self._loaded = len(choices)

    def _write_disk(self) -> None:
        path = self.cache_path
        if path is None:
            return
        with self._lock:
            merged = {**_read_cache(path), **self._choices}
            data = {"key": machine_key(), "choices": dict(sorted(merged.items()))}
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=1)
                os.replace(tmp, path)
            except OSError:
                pass  # a cache that cannot be written only costs the next process a calibration

    def statistics(self) -> CalibrationStatistics:
        return CalibrationStatistics(self._calibrations, self._seconds, self._loaded, len(self._choices))

    def __repr__(self) -> str:
        state = "on" if self.enabled else "off"
        return (f"<CopyCalibrator [{state} | {len(self._choices)} shapes, {self._calibrations} calibrated "
                f"in {self._seconds * 1e3:.1f} ms | cache={self.cache_path}]>")


def _read_cache(path: Path) -> dict[str, str]:
    """The choices in ``path`` when its key is this machine's and torch's, else none."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(data, dict) or data.get("key") != machine_key():
        return {}
    choices = data.get("choices")
    if not isinstance(choices, dict):
        return {}
    return {k: v for k, v in choices.items()
            if isinstance(k, str) and isinstance(v, str) and CopyMethod.parse(v) is not None}


_PROCESS: CopyCalibrator | None = None
_PROCESS_LOCK = threading.Lock()


def process_calibrator() -> CopyCalibrator:
    """The calibrator every `CpuExecutor` uses unless given one: made on first
    use from the environment (``KVTIER_COPY_CALIBRATION=0`` turns it off,
    ``KVTIER_COPY_CALIBRATION_CACHE=PATH`` names its cache file)."""
    global _PROCESS
    if _PROCESS is None:
        with _PROCESS_LOCK:
            if _PROCESS is None:
                enabled = os.environ.get("KVTIER_COPY_CALIBRATION", "1").strip().lower() not in ("0", "off", "false", "no")
                _PROCESS = CopyCalibrator(enabled=enabled,
                                          cache_path=os.environ.get("KVTIER_COPY_CALIBRATION_CACHE") or None)
    return _PROCESS
