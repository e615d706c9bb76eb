"""Typed errors across gRPC: one server interceptor that turns exceptions into status codes, and
the client-side inverse.

Servicers just ``raise InvalidArgumentError(...)`` (or any :class:`TandemError`); they never call
``context.abort`` for expected failures. The interceptor wraps every handler, whatever its shape
(unary or streaming request, unary or streaming response, async generator or ``context.write``
style), so that:

1. a :class:`TandemError` becomes ``context.abort(StatusCode[err.grpc_code], err.message)`` with
   trailing metadata ``tandem-error-class`` / ``tandem-error-param`` / ``tandem-error-code`` so
   the client can rebuild the exact error (OpenAI's ``param`` survives the hop);
2. ``asyncio.CancelledError`` (client went away, deadline passed, server stopping) propagates, so
   the handler's ``finally`` blocks free what the request held;
3. an explicit ``context.abort(...)`` inside a handler passes through untouched;
4. a failed downstream RPC keeps its status (via :func:`status_to_error`), ``NotImplementedError``
   (the generated base servicer's default) becomes UNIMPLEMENTED;
5. any other exception is logged with its traceback and becomes INTERNAL with a one-line message;
   the server keeps serving.

Clients call :func:`status_to_error` on a caught ``grpc.aio.AioRpcError``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from services.common import errors
from services.common.errors import (
    AbortedError,
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    TandemError,
    UnavailableError,
)

logger = logging.getLogger(__name__)

ERROR_CLASS_KEY = "tandem-error-class"
ERROR_PARAM_KEY = "tandem-error-param"
ERROR_CODE_KEY = "tandem-error-code"

_MAX_INTERNAL_MESSAGE = 300

# Status code -> the typed error a client raises when the server sent no tandem-error-class.
_CODE_TO_ERROR: dict[grpc.StatusCode, type[TandemError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: UnavailableError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.CANCELLED: AbortedError,
}

Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def _error_classes() -> dict[str, type[TandemError]]:
    """Every TandemError subclass defined in services.common.errors, by class name."""
    found: dict[str, type[TandemError]] = {"TandemError": TandemError}
    for value in vars(errors).values():
        if isinstance(value, type) and issubclass(value, TandemError):
            found[value.__name__] = value
    return found


def _metadata_safe(value: str) -> bool:
    return value.isascii() and value.isprintable() and len(value) <= 256


def error_metadata(err: TandemError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that lets :func:`status_to_error` rebuild ``err`` on the client."""
    items = [(ERROR_CLASS_KEY, type(err).__name__)]
    if err.param is not None and _metadata_safe(err.param):
        items.append((ERROR_PARAM_KEY, err.param))
    if err.code is not None and _metadata_safe(err.code):
        items.append((ERROR_CODE_KEY, err.code))
    return tuple(items)


def status_code_of(err: TandemError) -> grpc.StatusCode:
    """The status code named by ``err.grpc_code`` (INTERNAL if the name is not a status code)."""
    try:
        return grpc.StatusCode[err.grpc_code]
    except KeyError:
        return grpc.StatusCode.INTERNAL


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    message = f"internal error ({type(exc).__name__})" + (f": {first}" if first else "")
    if len(message) > _MAX_INTERNAL_MESSAGE:
        message = message[: _MAX_INTERNAL_MESSAGE - 3] + "..."
    return message


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    """Abort the RPC for ``exc``; always raises (``context.abort`` raises AbortError).

    A failed downstream RPC (``AioRpcError``, e.g. prefill calling decode) keeps its meaning: it is
    converted with :func:`status_to_error` rather than reported as INTERNAL.
    """
    if isinstance(exc, grpc.aio.AioRpcError):
        exc = status_to_error(exc)
    if isinstance(exc, TandemError):
        code = status_code_of(exc)
        logger.info("%s failed: %s %s", method, code.name, exc.message)
        await context.abort(code, exc.message, trailing_metadata=error_metadata(exc))
    if isinstance(exc, NotImplementedError):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented")
    logger.error("%s raised an unexpected exception", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, _one_line(exc))


def _wrap_unary_response(behavior: Behavior, method: str) -> Behavior:
    """Wrap a handler that returns one response (or, for streams, writes via context.write)."""

    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            result = behavior(request, context)
            if inspect.isawaitable(result):
                result = await result
            return result
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - the point: every error becomes a status
            await _abort_for(exc, context, method)

    return wrapper


def _wrap_stream_response(behavior: Behavior, method: str) -> Behavior:
    """Wrap an async-generator (or plain iterator) handler of a server-streaming RPC."""

    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            result = behavior(request, context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:
                for item in result:
                    yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort_for(exc, context, method)

    return wrapper


def _wrap_streaming(behavior: Behavior, method: str) -> Behavior:
    """Wrap a server-streaming behavior, keeping its style.

    grpc.aio treats an async generator as "yield the responses" and a coroutine function as "the
    handler writes with ``context.write`` and returns None"; the wrapper must be of the same kind.
    """
    if inspect.isasyncgenfunction(behavior) or not inspect.iscoroutinefunction(behavior):
        return _wrap_stream_response(behavior, method)
    return _wrap_unary_response(behavior, method)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by any handler to gRPC statuses (see the module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        return rewrap_handler(
            handler,
            lambda behavior, streaming: (_wrap_streaming if streaming else _wrap_unary_response)(
                behavior, method
            ),
        )


def rewrap_handler(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior, bool], Behavior]
) -> grpc.RpcMethodHandler:
    """``handler`` with its behavior replaced by ``wrap(behavior, response_streaming)``, for
    each of gRPC's four call shapes (what a server interceptor that wraps handlers needs)."""
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True), **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, False), **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, True), **kwargs)
    return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), **kwargs)


def is_transport_failure(e: grpc.aio.AioRpcError) -> bool:
    """Whether gRPC itself failed the call because the peer cannot be reached or its connection
    died: UNAVAILABLE, or UNKNOWN "Stream removed" (what gRPC core reports for a stream whose
    connection was torn down mid-call), without the ``tandem-error-class`` metadata a Tandem
    server attaches to every error it raises."""
    code = e.code()
    broken = code == grpc.StatusCode.UNAVAILABLE or (
        code == grpc.StatusCode.UNKNOWN and (e.details() or "").startswith("Stream removed")
    )
    return broken and ERROR_CLASS_KEY not in _metadata_dict(e.trailing_metadata())


def status_to_error(e: grpc.aio.AioRpcError) -> TandemError:
    """The typed error a client should raise for a failed RPC.

    Uses the server's ``tandem-error-class`` trailing metadata when present (exact class, ``param``
    and ``code``); otherwise maps the status code: UNAVAILABLE, DEADLINE_EXCEEDED and a stream
    torn down with its connection (:func:`is_transport_failure`) become
    :class:`UnavailableError`, CANCELLED and ABORTED :class:`AbortedError`, unknown codes a plain
    :class:`TandemError` (INTERNAL).
    """
    code = e.code()
    details = e.details() or ""
    metadata = _metadata_dict(e.trailing_metadata())
    cls = _error_classes().get(metadata.get(ERROR_CLASS_KEY, ""))
    if cls is None:
        cls = UnavailableError if is_transport_failure(e) else _CODE_TO_ERROR.get(code, TandemError)
    name = code.name if code is not None else "UNKNOWN"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"deadline exceeded: {details}" if details else "deadline exceeded"
    else:
        message = details or name.lower().replace("_", " ")
    return cls(
        message,
        param=metadata.get(ERROR_PARAM_KEY),
        code=metadata.get(ERROR_CODE_KEY),
    )


def _metadata_dict(metadata: Sequence[tuple[str, str | bytes]] | None) -> dict[str, str]:
    found: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            found[key] = value
    return found
