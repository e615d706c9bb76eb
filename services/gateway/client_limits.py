"""What every model-using route checks about a client before it does work, in one place for
``/v1/*`` (``completions.py``) and ``/tokenize`` / ``/detokenize`` (``token_routes.py``):

1. :func:`client_id` — who is counted by the rate limits: the API key's id, or, when
   authentication is off, ``ip:<peer address>`` (each anonymous client its own bucket; the peer
   address is the TCP peer, never a forwarded-for header a client could write itself);
2. :func:`check_request_rate` — one request against the client's request bucket (429);
3. :func:`read_body_in_budget` — the body read only once the body budget, and the client's
   share of it, hold it (``body_budget.py``); the lease is released when the request ends.
"""

from __future__ import annotations

import contextlib
import logging

from aiohttp import web

from services.gateway.auth import ANONYMOUS
from services.gateway.http_errors import read_json_body
from services.gateway.state import GatewayState

logger = logging.getLogger(__name__)


def client_id(api_key: str, request: web.Request) -> str:
    """The rate-limit bucket of a request authenticated as ``api_key``."""
    if api_key != ANONYMOUS:
        return api_key
    return f"ip:{request.remote or 'unknown'}"


def check_request_rate(state: GatewayState, client: str) -> None:
    """Count one request for ``client``; RateLimitError (429) when over its limit."""
    if state.rate_limiter is not None:
        state.rate_limiter.acquire(client)


async def read_body_in_budget(
    state: GatewayState, request: web.Request, held: contextlib.ExitStack, client: str
) -> object:
    """The JSON body, read after the body budget counted it against ``client``'s share
    (:func:`client_id`); the lease joins ``held``.

    Raises:
        RateLimitError: the budget or the client's share cannot hold the body now (429,
            nothing read).
        InvalidArgumentError / RequestTimeoutError / RequestTooLargeError: see
            :func:`~services.gateway.http_errors.read_json_body`.
    """
    held.enter_context(state.body_budget.reserve(request.content_length, client))
    return await read_json_body(request, timeout_s=state.config.body_read_timeout_s)
