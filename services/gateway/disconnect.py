"""Noticing that an HTTP client went away while its handler waits on the backend.

aiohttp's production runners do not cancel a handler when its client disconnects
(``handler_cancellation=False``), so a handler blocked on a gRPC stream would keep the request's
work alive on the workers. :func:`watch_disconnect` returns a task that completes when the
client's connection closes; handlers race every backend wait against it (``RequestRun``) and
cancel it when they are done. It works before and after an SSE stream started, for streamed and
non-streamed requests alike.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

POLL_S = 0.1


def client_gone(request: web.Request) -> bool:
    """Whether the client's connection is closed (or closing)."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _wait_gone(request: web.Request, poll_s: float) -> None:
    while not client_gone(request):
        await asyncio.sleep(poll_s)


def watch_disconnect(request: web.Request, *, poll_s: float = POLL_S) -> asyncio.Task[None]:
    """A task that finishes when ``request``'s client disconnects; cancel it when done."""
    return asyncio.create_task(_wait_gone(request, poll_s), name="tandem-disconnect-watch")
