"""kvtier's loggers: structlog-shaped calls, governed by the standard library.

Every kvtier module logs through ``log = get_logger(name)`` with a name under
``kvtier`` (``kvtier.scheduler``, ``kvtier.integrations.vllm.worker``, ...).
The contract a caller can rely on:

- Levels and handlers are the standard library's. An event is emitted only when
  ``logging.getLogger(name).isEnabledFor(level)``; with nothing configured that
  is warning and up, which Python's last-resort handler writes to stderr.
  Nothing kvtier logs ever reaches stdout on its own, and a disabled level costs
  one cached level check (no processors, no formatting).
- structlog is optional and kvtier never imports it: an application that
  configured structlog has imported it, so kvtier looks in ``sys.modules``.
- kvtier never configures structlog or the standard library. When the
  application has configured structlog (`structlog.is_configured()`), an
  enabled event runs through the application's own processors and their output
  goes to the standard library logger, as `structlog.stdlib.BoundLogger` does;
  so `structlog.testing.capture_logs()` sees kvtier's events, and the recipe
  ending in `structlog.stdlib.ProcessorFormatter.wrap_for_formatter` works.
- Otherwise the record's message reads ``event key=value ...`` and the record
  carries ``event`` and every field as attributes (``record.lane``, ...), which
  JSON formatters pick up as extras.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from kvtier.errors import ConfigurationError

__all__ = ["KvtierLogger", "get_logger"]


class _Message:
    """An event rendered as ``event key=value ...`` only when a handler formats it."""

    __slots__ = ("event", "fields")

    def __init__(self, event: str, fields: dict[str, Any]) -> None:
        self.event = event
        self.fields = fields

    def __str__(self) -> str:
        return " ".join([self.event, *(f"{k}={v!r}" for k, v in self.fields.items())])


class KvtierLogger:
    """A module's logger: ``log.debug("batch.dispatched", batch=3, ...)``.

    Wraps the standard library logger of the same name (`stdlib`); see the
    module docstring for where an event goes.
    """

    __slots__ = ("stdlib",)

    def __init__(self, name: str) -> None:
        self.stdlib = logging.getLogger(name)

    def __repr__(self) -> str:
        return f"<KvtierLogger {self.stdlib.name!r} [{logging.getLevelName(self.stdlib.getEffectiveLevel())}]>"

    def _emit(self, level: int, method: str, event: str, fields: dict[str, Any]) -> None:
        if not self.stdlib.isEnabledFor(level):
            return
        structlog: Any = sys.modules.get("structlog")  # imported by the application, or not at all
        if structlog is not None and structlog.is_configured():
            # The application's processors, read per call: capture_logs() swaps them in place.
            processors = structlog.get_config()["processors"]
            bound = structlog.stdlib.BoundLogger(self.stdlib, processors, {})
            getattr(bound, method)(event, **fields)
            return
        self.stdlib.log(level, _Message(event, fields), extra={"event": event, **fields}, stacklevel=3)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, "debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, "info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, "warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, "error", event, fields)


def get_logger(name: str) -> KvtierLogger:
    """The logger for ``name``, which must be ``kvtier`` or under it.

    Raises `ConfigurationError` (a `ValueError`) for another name: every kvtier event is governed by
    the ``kvtier`` logger's level and handlers.
    """
    if name != "kvtier" and not name.startswith("kvtier."):
        raise ConfigurationError(f"kvtier's logger names start with 'kvtier.'; got {name!r}")
    return KvtierLogger(name)
