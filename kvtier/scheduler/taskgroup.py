"""A task group whose block's own exception leaves as itself.

anyio wraps whatever leaves a task group in an `ExceptionGroup`, so a
`ValueError` raised by the user inside ``async with TransferScheduler(...)``
would reach them as "unhandled errors in a TaskGroup". `task_group` is anyio's
task group with one change: when the block raised and no task failed beside
it, the block's exception leaves as itself (traceback, cause and context
unchanged). When tasks failed too, the group leaves as anyio made it: every
error in it matters. Cancellation is never grouped, so it passes through as it is.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["task_group"]


@asynccontextmanager
async def task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    raised: list[BaseException] = []
    try:
        async with anyio.create_task_group() as tg:
            try:
                yield tg
            except BaseException as exc:
                raised.append(exc)
                raise
    except BaseExceptionGroup as group:
        body = raised[0] if raised else None
        _, others = group.split(lambda e: e is body)
        if body is None or others is not None:
            raise
    else:
        return
    # Raised outside the `except`, so that its __context__ stays what the block gave it.
    error = raised.pop()
    try:
        raise error
    finally:
        del error
