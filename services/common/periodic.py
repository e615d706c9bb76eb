"""A coroutine run every few seconds in a background task, until stopped.

The gateway's worker-stats poll and its DNS re-resolution both need "do this every N seconds,
log a failure and go on, stop cleanly": one small class instead of the same loop twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class Periodic:
    """Runs ``fn()`` every ``interval_s`` seconds (the first run one interval after
    :meth:`start`); an exception is logged with ``what`` and the next run still happens."""

    def __init__(self, fn: Callable[[], Awaitable[object]], interval_s: float, what: str) -> None:
        self._fn = fn
        self._interval_s = interval_s
        self._what = what
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"tandem-{self._what}")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._fn()
            except Exception:
                logger.exception("%s failed", self._what)

    async def stop(self) -> None:
        """Cancel the task and wait for it (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
