"""Every gateway failure becomes an OpenAI-shaped JSON error: ``{"error": {message, type, param,
code}}`` with the status OpenAI uses (docs/errors.md).

1. :func:`read_json_body` turns a request body into JSON or a 400/408/413 TandemError
   (invalid UTF-8 or an escaped unpaired surrogate, malformed JSON, NaN/Infinity literals,
   nesting too deep to parse, a body over ``client_max_size``, a body that does not arrive
   within ``--body-read-timeout``: a slow client is answered 408 with ``Connection: close``,
   having held no admission slot and no worker, since bodies are read before either is taken).
2. :func:`error_middleware` catches, per request:

   - :class:`TandemError` -> its own status and body (``Retry-After`` when it has
     ``retry_after``);
   - aiohttp's 413 -> code ``request_too_large``; unknown routes -> OpenAI's 404
     ``Invalid URL (METHOD /path)``; other aiohttp HTTP errors keep their status;
   - raw JSON / UTF-8 decoding errors -> 400;
   - anything else -> 500 with a fixed message (the traceback only goes to the log).

   If the handler had already started an SSE stream, the status can no longer change: the error
   is sent as an in-stream error event followed by ``[DONE]``. Client disconnects pass through
   untouched (aiohttp logs them quietly).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from services.common.errors import InvalidArgumentError, TandemError
from services.gateway.sse import current_writer

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

INTERNAL_ERROR_MESSAGE = (
    "The server had an error while processing your request. Sorry about that!"
)
JSON_ERROR_MESSAGE = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
    "using your HTTP library correctly. The OpenAI API expects a JSON payload, but what was sent "
    "was not valid JSON.)"
)


class RequestTooLargeError(TandemError):
    """The body exceeds the gateway's limit (HTTP 413)."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 413
    error_type = "invalid_request_error"


class RequestTimeoutError(TandemError):
    """The body did not arrive in time (HTTP 408); the connection is closed after the answer."""

    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 408
    error_type = "invalid_request_error"


class HTTPStatusError(TandemError):
    """An aiohttp HTTP error (404, 405, ...) re-shaped as an OpenAI error with its status."""

    error_type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        status: int,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.http_status = status
        self.headers: Mapping[str, str] = headers or {}


def error_response(err: TandemError) -> web.Response:
    """The JSON error response for ``err``: status ``err.http_status``, body ``err.to_openai()``."""
    headers: dict[str, str] = {}
    retry_after = getattr(err, "retry_after", None)
    if isinstance(retry_after, (int, float)):
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    if isinstance(err, HTTPStatusError):
        headers.update(err.headers)
    response = web.json_response(err.to_openai(), status=err.http_status, headers=headers)
    if isinstance(err, RequestTimeoutError):
        # "Connection: close"; aiohttp still reads and drops what is left of the body for a
        # while (lingering close), so the client reads this answer instead of a reset.
        response.force_close()
    return response


# A JSON string escape of a UTF-16 surrogate; only a paired one makes a character.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


async def read_json_body(request: web.Request, *, timeout_s: float | None = None) -> object:
    """The request body as JSON, or InvalidArgumentError (400) / RequestTimeoutError (408, the
    whole body not read within ``timeout_s``) / RequestTooLargeError (413)."""
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise _too_large(request) from exc
    except TimeoutError as exc:
        raise RequestTimeoutError(
            f"The request body did not arrive within {timeout_s:g} seconds.",
            code="request_timeout",
        ) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(
            "The request body is not valid UTF-8.", code="invalid_encoding"
        ) from exc
    try:
        body = json.loads(text, parse_constant=_reject_constant)
        if _SURROGATE_ESCAPE.search(text):
            json.dumps(body, ensure_ascii=False).encode("utf-8")  # lone surrogates cannot
    except RecursionError as exc:
        raise InvalidArgumentError(
            "We could not parse the JSON body of your request: it is nested too deeply.",
            code="invalid_json",
        ) from exc
    except UnicodeEncodeError as exc:  # would fail later, encoding a gRPC message
        raise InvalidArgumentError(
            "The request body is not valid Unicode: it escapes an unpaired UTF-16 surrogate "
            "(\\ud800-\\udfff).",
            code="invalid_encoding",
        ) from exc
    except ValueError as exc:  # json.JSONDecodeError, or a NaN / Infinity literal
        raise InvalidArgumentError(JSON_ERROR_MESSAGE, code="invalid_json") from exc
    return body


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Convert every failure of ``handler`` into an OpenAI-shaped error (see module docstring)."""
    try:
        return await handler(request)
    except ConnectionError:  # the client went away (incl. sse.ClientDisconnected): no answer
        raise
    except TandemError as err:
        return await _respond(request, err)
    except web.HTTPRequestEntityTooLarge:
        return await _respond(request, _too_large(request))
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and the like are responses, not errors
            raise
        return await _respond(request, _from_http_exception(request, exc))
    except UnicodeDecodeError:
        err = InvalidArgumentError("The request body is not valid UTF-8.", code="invalid_encoding")
        return await _respond(request, err)
    except json.JSONDecodeError:
        err = InvalidArgumentError(JSON_ERROR_MESSAGE, code="invalid_json")
        return await _respond(request, err)
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return await _respond(request, TandemError(INTERNAL_ERROR_MESSAGE), logged=True)


async def _respond(
    request: web.Request, err: TandemError, *, logged: bool = False
) -> web.StreamResponse:
    if not logged:
        level = logging.ERROR if err.http_status >= 500 else logging.INFO
        logger.log(
            level, "%s %s -> %d %s", request.method, request.path, err.http_status, err.message
        )
    writer = current_writer(request)
    if writer is None or not writer.prepared:
        return error_response(err)
    # Headers already went out with 200: end the stream with an error event instead.
    try:
        await writer.send_error(err)
        if not writer.done:
            await writer.send_done()
    except ConnectionError:
        logger.debug("client gone before the stream error could be sent")
    return writer.response


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> HTTPStatusError:
    if exc.status == 404:
        return HTTPStatusError(f"Invalid URL ({request.method} {request.path})", status=404)
    if exc.status == 405:
        allow = exc.headers.get("Allow")
        return HTTPStatusError(
            f"Method {request.method} is not allowed for {request.path}",
            status=405,
            code="method_not_allowed",
            headers={"Allow": allow} if allow else None,
        )
    return HTTPStatusError(exc.text or exc.reason, status=exc.status)


def _too_large(request: web.Request) -> RequestTooLargeError:
    return RequestTooLargeError(
        f"The request body is too large: the limit is {request.client_max_size} bytes.",
        code="request_too_large",
    )


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")
