"""Where kvtier's events go: the standard library decides (`kvtier.logs`).

Quiet by default (nothing on stdout, nothing below warning anywhere), levels
and handlers of the ``kvtier`` loggers apply, records carry their fields, and
an application's structlog configuration formats them. The plain path (no
structlog configured) runs in a fresh interpreter: tests in this process
configure structlog.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import structlog
from conftest import pages
from structlog.testing import capture_logs

from kvtier import TransferFailed, TransferScheduler
from kvtier.logs import get_logger
from kvtier.testing import FaultInjectingExecutor, full_attention_group

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = textwrap.dedent(
    """
    import json, logging, sys
    import anyio, torch
    from kvtier import TransferFailed, TransferScheduler
    from kvtier.testing import FaultInjectingExecutor, full_attention_group

    async def traffic():
        ex = FaultInjectingExecutor(fail_batches={1})
        async with TransferScheduler(full_attention_group(page_size=4), executor=ex) as sched:
            ok = await sched.backup({"kv": torch.arange(0, 4)})
            await ok
            bad = await sched.backup({"kv": torch.arange(4, 8)})
            try:
                await bad
            except TransferFailed:
                pass

    anyio.run(traffic)  # nothing configured
    sys.stdout.flush(); sys.stderr.write("--- basicConfig(WARNING)\\n"); sys.stderr.flush()
    logging.basicConfig(level=logging.WARNING)
    anyio.run(traffic)
    sys.stderr.write("--- kvtier at DEBUG, JSON to stdout\\n"); sys.stderr.flush()

    class Json(logging.Formatter):
        def format(self, record):
            return json.dumps({"logger": record.name, "level": record.levelname, "message": record.getMessage(),
                               "event": record.event, "lane": getattr(record, "lane", None)})

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(Json())
    kvtier = logging.getLogger("kvtier")
    kvtier.addHandler(handler)
    kvtier.setLevel(logging.DEBUG)
    kvtier.propagate = False
    anyio.run(traffic)
    """
)


# structlog is optional: kvtier logs the same without it (it is not even imported
# unless the application imported it), and a later import of it changes nothing.
WITHOUT_STRUCTLOG = "import sys; sys.modules['structlog'] = None  # import structlog raises ImportError\n"
NOT_IMPORTED = (
    "import sys, kvtier, kvtier.scheduler, kvtier.storage\n"
    "assert 'structlog' not in sys.modules, 'kvtier imported structlog'\n"
)


@pytest.mark.parametrize("prelude", ["", WITHOUT_STRUCTLOG, NOT_IMPORTED], ids=["plain", "no-structlog", "not-imported"])
def test_quiet_by_default_and_the_standard_library_routes_every_event(prelude: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", prelude + PROGRAM], capture_output=True, text=True, cwd=ROOT, timeout=60, check=True,
    )
    default, basic, routed = out.stderr.split("--- ")
    # Nothing configured: the two warnings, on stderr (the last-resort handler); nothing else.
    assert [line.split(" ")[0] for line in default.splitlines()] == ["batch.failed", "operation.failed"]
    assert default.startswith("batch.failed batch=2 lane='backup' operations=1 operation_ids=[2] error=")
    # basicConfig(WARNING): the same two, under their logger's name; no debug event.
    assert [line.split(":")[:3] for line in basic.splitlines()[1:]] == [
        ["WARNING", "kvtier.scheduler", "batch.failed batch=2 lane='backup' operations=1 operation_ids=[2] error=\"InjectedFault('injected fault at layer 0')\""],
        ["WARNING", "kvtier.scheduler", "operation.failed operation=2 lane='backup' error='batch 2 (backup, 1 operations) failed"],
    ]
    assert routed.splitlines() == ["kvtier at DEBUG, JSON to stdout"]
    # Only the application's own handler wrote to stdout: every event, fields as record attributes.
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["logger"], r["level"], r["event"], r["lane"]) for r in records] == [
        ("kvtier.scheduler", "DEBUG", "batch.dispatched", "backup"),
        ("kvtier.scheduler", "DEBUG", "batch.completed", "backup"),
        ("kvtier.scheduler", "DEBUG", "batch.dispatched", "backup"),
        ("kvtier.scheduler", "WARNING", "batch.failed", "backup"),
        ("kvtier.scheduler", "WARNING", "operation.failed", "backup"),
        ("kvtier.scheduler", "DEBUG", "batch.completed", "backup"),
        ("kvtier.scheduler.scheduler", "DEBUG", "scheduler.closed", None),
    ]
    assert records[0]["message"] == "batch.dispatched batch=1 lane='backup' operations=1 nbytes=2048"


@pytest.fixture
def structlog_configured():  # type: ignore[no-untyped-def]
    config = structlog.get_config()
    yield
    structlog.configure(**config)


async def traffic() -> None:
    ex = FaultInjectingExecutor(fail_batches={1})
    async with TransferScheduler(full_attention_group(page_size=4), executor=ex) as sched:
        await (await sched.backup({"kv": pages(0, page_size=4)}))
        with pytest.raises(TransferFailed):
            await (await sched.backup({"kv": pages(1, page_size=4)}))


async def test_capture_logs_sees_what_the_standard_library_level_lets_through(
    caplog: pytest.LogCaptureFixture, structlog_configured: None,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    with capture_logs() as warnings:
        await traffic()
    caplog.set_level(logging.DEBUG, logger="kvtier")
    with capture_logs() as everything:
        await traffic()
    assert [e["event"] for e in warnings] == ["batch.failed", "operation.failed"]
    assert [e["event"] for e in everything] == [
        "batch.dispatched", "batch.completed", "batch.dispatched", "batch.failed", "operation.failed",
        "batch.completed", "scheduler.closed",
    ]
    assert everything[0] == {"event": "batch.dispatched", "log_level": "debug", "batch": 1, "lane": "backup",
                             "operations": 1, "nbytes": everything[0]["nbytes"]}


async def test_structlog_users_processors_format_kvtier_events_on_the_stdlib_handler(
    structlog_configured: None,
) -> None:
    """structlog's documented stdlib recipe: processors end in
    ProcessorFormatter.wrap_for_formatter; the handler renders JSON."""
    structlog.configure(
        processors=[structlog.stdlib.add_log_level, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
    )
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Collect()
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processor=structlog.processors.JSONRenderer()))
    kvtier_logger = logging.getLogger("kvtier")
    kvtier_logger.addHandler(handler)
    kvtier_logger.setLevel(logging.INFO)
    try:
        await traffic()
    finally:
        kvtier_logger.removeHandler(handler)
        kvtier_logger.setLevel(logging.NOTSET)
    events = [json.loads(line) for line in lines]
    assert [(e["event"], e["level"]) for e in events] == [("batch.failed", "warning"), ("operation.failed", "warning")]
    assert events[0]["lane"] == "backup" and events[0]["operation_ids"] == [2]


def test_logger_names_stay_under_kvtier() -> None:
    assert get_logger("kvtier.storage").stdlib is logging.getLogger("kvtier.storage")
    with pytest.raises(ValueError, match="kvtier's logger names start with 'kvtier.'; got 'vllm'"):
        get_logger("vllm")
