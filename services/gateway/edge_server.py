"""The gateway's listening socket: HTTPS, a header read timeout, a connection cap, and the rule
that an unauthenticated gateway listens on loopback only.

The gateway is the edge: the one place untrusted clients reach (docs/security.md). What a client
may hold there before it is even a request is bounded here; what a request may hold is bounded
by the handlers (body budget, admission, rate limits, ``max_tokens``, the SSE write timeout).

1. :func:`require_auth_beyond_loopback` — outside loopback the gateway refuses to start without
   API keys unless the operator says ``--allow-no-auth``;
2. :func:`https_context` — stdlib ``ssl`` server context from ``--https-cert/--https-key``
   (TLS 1.2+, ALPN ``http/1.1``); the names differ from the issue's ``--tls-*`` because those
   already name every service's *internal* mTLS identity, the gateway's included;
3. :func:`start_edge` — an aiohttp runner whose protocol factory (:class:`ConnectionCap`) answers
   503 and closes any connection past ``max_connections`` before reading from it, and arms an
   explicit first-header deadline on every connection it accepts (:class:`HeaderDeadline`): a
   connection whose first request header is not complete ``header_read_timeout_s`` after it was
   accepted is closed (with HTTPS, a connection still in its TLS handshake at the deadline is
   closed as soon as the handshake completes; asyncio bounds the handshake itself at 60 s).
   Later requests on a kept-alive connection are
   bounded by aiohttp's keep-alive timer, set to the same timeout, which aiohttp arms after each
   response. Why both: the keep-alive timer is all aiohttp offers, and some aiohttp versions do
   not start it before a connection's *first* request, so a client that connects and trickles a
   header (or sends nothing) would be held for ever; the deadline does not depend on that.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.common.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from services.gateway.config import GatewayConfig

logger = logging.getLogger(__name__)

_REFUSAL_LOG_EVERY_S = 10.0
_RECHECK_S = 0.5  # how often a connection still in its TLS handshake at its deadline is checked
_HANDSHAKE_BOUND_S = 75.0  # past asyncio's 60 s handshake timeout: it has failed or finished


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_auth_beyond_loopback(host: str, *, auth_enabled: bool, allow_no_auth: bool) -> None:
    """Refuse an unauthenticated gateway on a non-loopback address.

    Raises:
        FailedPreconditionError: ``host`` is not loopback, no API key is configured and
            ``allow_no_auth`` is False.
    """
    if auth_enabled or allow_no_auth or is_loopback(host):
        return
    raise FailedPreconditionError(
        f"the gateway would listen on {host or 'every interface'} with no API keys, so anyone who "
        "reaches it could use the model: give keys (--api-keys-file or TANDEM_API_KEYS), listen "
        "on loopback (--host 127.0.0.1), or pass --allow-no-auth (env TANDEM_ALLOW_NO_AUTH=1) "
        "if something in front of it authenticates clients",
        param="allow_no_auth",
    )


def https_context(cert: str, key: str) -> ssl.SSLContext:
    """A server TLS context for the certificate chain ``cert`` and its private key ``key``.

    Raises:
        InvalidArgumentError: a file is missing, unreadable, or not a matching PEM pair.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as err:
        raise InvalidArgumentError(
            f"cannot load the HTTPS certificate {cert} with key {key}: {err}", param="https_cert"
        ) from err
    context.set_alpn_protocols(["http/1.1"])
    return context


class _Refusal(asyncio.Protocol):
    """Answers one 503 (OpenAI's error shape) and closes, reading nothing."""

    _BODY = json.dumps({"error": {
        "message": "The server has too many open connections. Please retry shortly.",
        "type": "server_error", "param": None, "code": "server_overloaded"}}).encode()  # fmt: skip
    _RESPONSE = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
        + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
    )  # fmt: skip

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if isinstance(transport, asyncio.WriteTransport):
            transport.write(self._RESPONSE)
        transport.close()


class HeaderDeadline:
    """Closes a connection whose first request header is not complete within ``timeout_s`` of
    its accept.

    :meth:`watch` arms a timer for a newly made protocol (aiohttp's ``RequestHandler``);
    :attr:`middleware`, the application's outermost middleware, marks the protocol once a
    request reached the handlers (its header was parsed whole), and the timer then does
    nothing. Only public aiohttp API is used (``request.protocol``, the protocol's
    ``transport``). A protocol is held only until its timer fires.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._waiting: set[asyncio.BaseProtocol] = set()
        self.closed = 0  # connections closed for want of a header, for tests and logs

    def watch(self, protocol: asyncio.BaseProtocol) -> None:
        """Arm the deadline for a connection whose protocol was just made."""
        self._waiting.add(protocol)
        asyncio.get_running_loop().call_later(self.timeout_s, self._expire, protocol)

    def _expire(self, protocol: asyncio.BaseProtocol, waited: float = 0.0) -> None:
        if protocol not in self._waiting:
            return
        transport = getattr(protocol, "transport", None)
        if transport is None and waited < _HANDSHAKE_BOUND_S:
            # still in its TLS handshake (the protocol has no transport until it completes):
            # look again shortly, and close it then if its deadline has passed
            waited += self.timeout_s if waited == 0.0 else _RECHECK_S
            asyncio.get_running_loop().call_later(_RECHECK_S, self._expire, protocol, waited)
            return
        self._waiting.discard(protocol)
        if transport is not None and not transport.is_closing():
            self.closed += 1
            logger.debug("closed a connection that sent no whole request header in %gs",
                         self.timeout_s)  # fmt: skip
            transport.close()

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Marks the request's connection as past its first header."""
        self._waiting.discard(request.protocol)
        return await handler(request)


HEADER_DEADLINE_KEY = web.AppKey("header_deadline", HeaderDeadline)


class ConnectionCap:
    """A protocol factory: aiohttp's request handler while fewer than ``limit`` connections
    are open, else :class:`_Refusal`. Every accepted connection gets a first-header
    ``deadline`` when one is given."""

    def __init__(self, server: web.Server, limit: int,
                 deadline: HeaderDeadline | None = None) -> None:  # fmt: skip
        self._server = server
        self._limit = limit
        self._deadline = deadline
        self._refused = 0
        self._logged_at = 0.0

    def __call__(self) -> asyncio.Protocol:
        if len(self._server.connections) < self._limit:
            protocol = self._server()
            if self._deadline is not None:
                self._deadline.watch(protocol)
            return protocol
        self._refused += 1
        now = time.monotonic()
        if now - self._logged_at >= _REFUSAL_LOG_EVERY_S:
            logger.warning("refused %d connection(s): %d open is the cap (--max-connections)",
                           self._refused, self._limit)  # fmt: skip
            self._logged_at, self._refused = now, 0
        return _Refusal()


class EdgeRunner(web.AppRunner):
    """An AppRunner whose sites accept connections through a :class:`ConnectionCap`."""

    def __init__(self, app: web.Application, *, max_connections: int,
                 deadline: HeaderDeadline | None = None, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(app, **kwargs)
        self._max_connections = max_connections
        self._deadline = deadline

    @property
    def server(self) -> Any:  # what sites hand to loop.create_server: a protocol factory
        inner = super().server
        if inner is None:
            return None
        return ConnectionCap(inner, self._max_connections, self._deadline)


async def start_edge(
    app: web.Application, config: GatewayConfig, *, shutdown_grace: float = 10.0
) -> tuple[web.AppRunner, str]:
    """Start serving ``app`` as ``config`` says; return the runner (``cleanup()`` it) and the
    base URL clients use (the bound port, when ``config.port`` is 0).

    Raises:
        InvalidArgumentError: the HTTPS files cannot be loaded.
        UnavailableError: the address could not be bound.
    """
    ssl_context = None
    if config.https_cert is not None and config.https_key is not None:
        ssl_context = https_context(config.https_cert, config.https_key)
    deadline = HeaderDeadline(config.edge.header_read_timeout_s)
    app.middlewares.insert(0, deadline.middleware)  # outermost: marks before anything can fail
    app[HEADER_DEADLINE_KEY] = deadline
    runner = EdgeRunner(
        app, max_connections=config.edge.max_connections, deadline=deadline, access_log=None,
        shutdown_timeout=shutdown_grace, keepalive_timeout=config.edge.header_read_timeout_s,
    )  # fmt: skip
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as err:
        await runner.cleanup()
        raise UnavailableError(f"could not listen on {config.host}:{config.port}: {err}") from err
    scheme = "https" if ssl_context is not None else "http"
    host = config.host if config.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return runner, f"{scheme}://{host}:{site.port}"
