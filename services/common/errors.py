"""Typed errors that every layer raises instead of ``assert`` or bare exceptions.

Each error knows the gRPC status code and the OpenAI-style HTTP status/type it maps to, so one
gRPC interceptor and one HTTP error handler turn any of them into a clean response. ``param``
names the offending request field (OpenAI's ``error.param``).
"""

from __future__ import annotations


class TandemError(Exception):
    """Base class. Subclasses set the status mappings; ``message`` is shown to the user."""

    grpc_code: str = "INTERNAL"  # a ``grpc.StatusCode`` member name; kept as text to stay grpc-free
    http_status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict[str, object]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidArgumentError(TandemError):
    """Malformed or out-of-range input (HTTP 400, gRPC INVALID_ARGUMENT)."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    error_type = "invalid_request_error"


class NotFoundError(TandemError):
    """An unknown model, request id or resource (HTTP 404, gRPC NOT_FOUND)."""

    grpc_code = "NOT_FOUND"
    http_status = 404
    error_type = "invalid_request_error"


class ResourceExhaustedError(TandemError):
    """No room: KV blocks, admission queue, rate limit (HTTP 429, gRPC RESOURCE_EXHAUSTED)."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    error_type = "rate_limit_error"


WORKER_UNHEALTHY = "worker_unhealthy"
"""The code of the :class:`UnavailableError` a worker answers once its engine step failed
(``services/engine/runtime/worker_health.py``); the gateway reads it as the worker being down and
migrates the stream (``services/gateway/worker_errors.py``)."""


class UnavailableError(TandemError):
    """A dependency is down or not ready (HTTP 503, gRPC UNAVAILABLE)."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    error_type = "service_unavailable"


class FailedPreconditionError(TandemError):
    """The request does not fit the server's state, e.g. a KV layout from another model."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 400
    error_type = "invalid_request_error"


class PermissionDeniedError(TandemError):
    """An authenticated service asked another for something it may not do, e.g. KV for a
    request it holds no reservation for (gRPC PERMISSION_DENIED). It is between services: an HTTP
    client that meets it (services of one deployment refusing each other) sees a server error,
    502, never a 403 about its own rights."""

    grpc_code = "PERMISSION_DENIED"
    http_status = 502
    error_type = "server_error"


class DataLossError(TandemError):
    """Transferred data failed its checksum (gRPC DATA_LOSS)."""

    grpc_code = "DATA_LOSS"
    http_status = 502
    error_type = "server_error"


class AbortedError(TandemError):
    """The request was aborted or cancelled while in flight (gRPC ABORTED)."""

    grpc_code = "ABORTED"
    http_status = 499
    error_type = "server_error"


class ModelLoadError(TandemError):
    """A model path that does not exist, a corrupt file, or an unsupported architecture."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 500
    error_type = "server_error"
