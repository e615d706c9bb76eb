"""Server-Sent Events over an aiohttp ``StreamResponse``, in OpenAI's streaming format.

Lifecycle of one streamed response:

1. ``await writer.prepare(request)`` sends the 200 and the SSE headers (``text/event-stream``,
   ``Cache-Control: no-cache``, ``X-Accel-Buffering: no`` so proxies do not buffer).
2. ``await writer.send_json(chunk)`` per chunk: ``data: {compact json}\\n\\n`` (with
   ``event=name``, preceded by ``event: name\\n``).
3. On a failure after the headers went out, ``await writer.send_error(err)``: an event
   ``data: {"error": {...}}\\n\\n`` as vLLM sends mid-stream (the status line cannot change).
4. ``await writer.send_done()``: ``data: [DONE]\\n\\n``; then return ``writer.response`` from the
   handler (aiohttp finishes the chunked body).

A client that stops reading without closing (its socket buffers fill, and a write waits for
room) is treated as gone once one write has waited ``write_timeout_s``: the connection is
aborted and the send raises :class:`ClientDisconnected`, so the request loses its admission slot
and its KV is freed like any other disconnect.

If the client has gone away, every send raises :class:`ClientDisconnected` (a
``ConnectionResetError``, which aiohttp treats as a quiet premature disconnect); the caller
catches it to cancel the request's work everywhere (docs/request-lifecycle.md, step 12). aiohttp's runners do not cancel
handlers on disconnect by default (``handler_cancellation=False``), so a caller waiting on a
backend between sends races it against :meth:`SSEWriter.wait_disconnected`. With handler
cancellation turned on, the handler sees ``CancelledError`` instead: put cleanup in ``finally``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from services.common.errors import TandemError

logger = logging.getLogger(__name__)

SSE_HEADERS: Mapping[str, str] = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
    "Connection": "keep-alive",
}


class ClientDisconnected(ConnectionResetError):
    """The HTTP client closed the connection; stop producing and release the request."""


class SSEWriter:
    """Writes SSE events to one client and notices when it disconnects."""

    def __init__(
        self, *, headers: Mapping[str, str] | None = None, write_timeout_s: float | None = None
    ) -> None:
        self._write_timeout_s = write_timeout_s
        self._response = web.StreamResponse(status=200)
        self._response.headers.update(SSE_HEADERS)
        if headers:
            self._response.headers.update(headers)
        self._request: web.Request | None = None
        self._done = False

    @property
    def response(self) -> web.StreamResponse:
        return self._response

    @property
    def prepared(self) -> bool:
        return self._response.prepared

    @property
    def done(self) -> bool:
        """Whether ``[DONE]`` was sent."""
        return self._done

    async def prepare(self, request: web.Request) -> web.StreamResponse:
        """Send the status line and SSE headers; register this writer on the request so the
        error middleware can end the stream with an error event if the handler raises."""
        self._request = request
        self._check_connected()
        request[SSE_WRITER_KEY] = self
        try:
            await self._response.prepare(request)
        except ConnectionError as exc:
            raise ClientDisconnected("client disconnected before the stream started") from exc
        return self._response

    async def send_json(self, obj: object, *, event: str | None = None) -> None:
        """``data: {compact json}\\n\\n``; with ``event``, an ``event: <name>`` line first (the
        typed events of OpenAI's Responses API and Anthropic's Messages API)."""
        payload = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        head = f"event: {event}\n" if event else ""
        await self._write(f"{head}data: {payload}\n\n")

    async def send_done(self) -> None:
        """``data: [DONE]\\n\\n``, the end-of-stream marker of OpenAI and vLLM."""
        await self._write("data: [DONE]\n\n")
        self._done = True

    async def send_error(self, err: TandemError) -> None:
        """An in-stream error event: ``data: {"error": {message, type, param, code}}\\n\\n``."""
        await self.send_json(err.to_openai())

    async def send_comment(self, text: str = "keep-alive") -> None:
        """An SSE comment line (ignored by clients), useful as a heartbeat while waiting."""
        await self._write(f": {text}\n\n")

    def is_disconnected(self) -> bool:
        request = self._request
        if request is None:
            return False
        transport = request.transport
        return transport is None or transport.is_closing()

    async def wait_disconnected(self, *, poll_s: float = 0.1) -> None:
        """Return once the client has disconnected (poll; cancel this when the stream ends)."""
        while not self.is_disconnected():
            await asyncio.sleep(poll_s)

    async def _write(self, text: str) -> None:
        if not self.prepared:
            raise RuntimeError("SSEWriter.prepare() must be awaited before sending")
        self._check_connected()
        try:
            async with asyncio.timeout(self._write_timeout_s):
                await self._response.write(text.encode("utf-8"))
        except ConnectionError as exc:  # includes aiohttp's ClientConnectionResetError
            raise ClientDisconnected("client disconnected") from exc
        except TimeoutError as exc:
            self._drop()
            logger.info("dropped a streaming client that stopped reading for %gs",
                        self._write_timeout_s)  # fmt: skip
            raise ClientDisconnected("client stopped reading") from exc

    def _drop(self) -> None:
        """Abort the connection: its unsent buffer is discarded, the socket closed."""
        transport = self._request.transport if self._request is not None else None
        if transport is not None:
            transport.abort()

    def _check_connected(self) -> None:
        if self.is_disconnected():
            raise ClientDisconnected("client disconnected")


def _writer_key() -> Any:
    """A typed request key where aiohttp has them (3.12+), else a plain string."""
    request_key = getattr(web, "RequestKey", None)
    if request_key is None:
        return "tandem_sse_writer"
    return request_key("tandem_sse_writer", SSEWriter)


SSE_WRITER_KEY: Any = _writer_key()


def current_writer(request: web.Request) -> SSEWriter | None:
    """The writer that started streaming on ``request``, if any."""
    writer = request.get(SSE_WRITER_KEY)
    return writer if isinstance(writer, SSEWriter) else None
