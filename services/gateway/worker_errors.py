"""What a worker's failed RPC means for the client, and for routing.

The gateway sees typed errors (``status_to_error``); most keep their meaning for the client, but
some say more about the worker than about the request:

1. UNAVAILABLE produced by gRPC itself (connection refused or lost; no ``tandem-error-class``
   metadata), or a stream gRPC reports "Stream removed" when its connection died mid-call: the
   worker is down. So is UNAVAILABLE with the code ``worker_unhealthy``: the worker's engine step
   failed and it reported itself unhealthy (``services/engine/runtime/engine_loop.py``), failing
   its streams so that they move. :class:`WorkerDown` tells the choice to mark it down in the
   router and, if nothing was sent yet, retry elsewhere; a stream already under way migrates.
2. NOT_FOUND from Generate (the KV never arrived), FAILED_PRECONDITION (the workers disagree on
   the model or KV layout) and ABORTED (the worker stopped the request itself): a server-side
   problem, answered 503 rather than 404 / 400 / 499.
3. Everything else (400 bad input, 429 a full KV cache, 502 corrupt data, 500) as is.
"""

from __future__ import annotations

import grpc
import grpc.aio

from services.common.errors import (
    WORKER_UNHEALTHY,
    AbortedError,
    FailedPreconditionError,
    NotFoundError,
    TandemError,
    UnavailableError,
)
from services.common.grpc_errors import is_transport_failure
from services.gateway.router import WorkerState


class WorkerDown(Exception):
    """A worker answered UNAVAILABLE: the router should stop using it; maybe retry."""

    def __init__(self, worker: WorkerState, error: TandemError) -> None:
        super().__init__(error.message)
        self.worker = worker
        self.error = error


def worker_error(err: TandemError, worker: WorkerState) -> Exception:
    """What a worker's failure means for the client.

    Unreachable -> :class:`WorkerDown` (mark it down, maybe retry). Bad input (400) and a full
    cache (429) keep their meaning. Anything else is the server's problem, not the request's:
    NOT_FOUND from Generate (the KV never arrived), FAILED_PRECONDITION (workers disagree on the
    model), ABORTED (the worker stopped it) become 503, DATA_LOSS stays 502, INTERNAL 500.
    """
    if isinstance(err, UnavailableError) and (
        _is_unavailable_status(err) or err.code == WORKER_UNHEALTHY
    ):
        return WorkerDown(worker, err)
    if isinstance(err, (NotFoundError, FailedPreconditionError, AbortedError)):
        role = worker.client.role
        return UnavailableError(f"{role} worker {worker.address}: {err.message}")
    return err


def _is_unavailable_status(err: UnavailableError) -> bool:
    """Whether ``err`` means the worker cannot be reached: an UNAVAILABLE status that gRPC itself
    produced (connection refused or lost), not one the worker's code raised (those carry
    ``tandem-error-class`` metadata), nor a deadline."""
    cause = err.__cause__
    return isinstance(cause, grpc.aio.AioRpcError) and is_transport_failure(cause)
