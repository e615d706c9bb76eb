"""Start and stop a Tandem gRPC server: servicers + error interceptor + health + reflection.

Every service (tokenizer, prefill, decode) starts its server through :func:`start_grpc_server`
so they all behave alike for operators and for each other:

- the :class:`~services.common.grpc_errors.ErrorInterceptor` maps raised errors to status codes;
- message limits are raised to 64 MiB (KV chunks, long prompts), keepalive pings are allowed;
- ``grpc.health.v1.Health`` answers for every registered service and for "" (the server);
- server reflection lists the services, so ``grpcurl`` works without the ``.proto`` files;
- ``SO_REUSEPORT`` is off, so a second server on a busy port fails instead of sharing it;
- mutual TLS (``internal_tls``): the port requires a client certificate of the deployment's CA
  and :class:`~services.common.peer_roles.RoleInterceptor` checks the peer's role per RPC
  (plaintext without roles only for ``InternalTls.plaintext()``, ``--insecure-internal``);
- optionally (``health_port``) a second, plaintext server on another port that serves
  ``grpc.health.v1`` and nothing else, for probes that present no certificate (kubelet).

Lifecycle:
  1. ``handle = await start_grpc_server([(add_fn, servicer, name), ...], host=..., port=...)``
     registers everything, binds (port 0 picks a free port: read ``handle.port``), starts, and
     marks every service SERVING (or NOT_SERVING with ``serving=False``, e.g. until a model loads;
     then ``await handle.set_serving(True)``).
  2. The service runs until ``await handle.wait_for_termination()`` returns or it decides to stop.
  3. ``await handle.stop(grace)`` first reports NOT_SERVING (so routers stop sending new work),
     then stops gracefully: new RPCs are refused, in-flight ones get ``grace`` seconds, after which
     they are cancelled (their handlers see ``CancelledError`` and free what they hold).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import InvalidArgumentError, UnavailableError
from services.common.grpc_channel import DEFAULT_MAX_MESSAGE_BYTES
from services.common.grpc_errors import ErrorInterceptor
from services.common.internal_tls import InternalTls
from services.common.peer_roles import RoleInterceptor

logger = logging.getLogger(__name__)

DEFAULT_GRACE_SECONDS = 5.0

# Servers accept client keepalive pings this often (channels ping every 30 s; see grpc_channel).
MIN_CLIENT_PING_INTERVAL_MS = 10_000
SERVER_KEEPALIVE_TIME_MS = 60_000
SERVER_KEEPALIVE_TIMEOUT_MS = 20_000

AddServicerFn = Callable[[Any, Any], None]
ServicerSpec = tuple[AddServicerFn, object, str]
"""``(add_XServicer_to_server, servicer, full service name)``, e.g.
``(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer, "tandem.v1.Tokenizer")``.
The full name is also ``tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name``."""


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, object]]:
    """gRPC server arguments: raised message limits, keepalive, no port sharing."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", SERVER_KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]


@dataclass(slots=True)
class GrpcServerHandle:
    """A started server. Mutable only through its methods.

    Attributes:
        server: the underlying ``grpc.aio.Server``.
        host: the host it was bound on.
        port: the bound port (the real one when 0 was asked for).
        service_names: the registered application services (health/reflection excluded).
    """

    server: grpc.aio.Server
    host: str
    port: int
    service_names: tuple[str, ...]
    grace: float = DEFAULT_GRACE_SECONDS
    _health: health.aio.HealthServicer = field(
        default_factory=health.aio.HealthServicer, repr=False
    )
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None
    _stopped: bool = False

    @property
    def address(self) -> str:
        """``host:port`` for clients (IPv6 hosts bracketed; 0.0.0.0 / :: become 127.0.0.1)."""
        return _join(_client_host(self.host), self.port)

    async def set_serving(self, serving: bool) -> None:
        """Report every service (and the server, "") SERVING or NOT_SERVING to health checks."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self._health.set(name, status)

    async def wait_for_termination(self) -> None:
        """Block until the server stops."""
        await self.server.wait_for_termination()

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING first, then a graceful stop with ``grace`` seconds (default: ``self.grace``).

        Idempotent. After it returns no handler of this server is still running.
        """
        if self._stopped:
            return
        self._stopped = True
        await self._health.enter_graceful_shutdown()
        seconds = self.grace if grace is None else grace
        logger.info("stopping gRPC server on %s (grace %.1fs)", self.address, seconds)
        if self.health_server is not None:
            await self.health_server.stop(0)
        await self.server.stop(seconds)


async def start_grpc_server(
    servicers: Sequence[ServicerSpec],
    *,
    tls: InternalTls,
    host: str = "0.0.0.0",
    port: int = 0,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    grace: float = DEFAULT_GRACE_SECONDS,
    serving: bool = True,
    health_port: int | None = None,
) -> GrpcServerHandle:
    """Build, bind and start a ``grpc.aio`` server for ``servicers``; see the module lifecycle.

    Args:
        servicers: ``(add_fn, servicer, full_service_name)`` triples.
        host: interface to bind ("0.0.0.0" all IPv4, "127.0.0.1" local only, "[::]" IPv6).
        port: TCP port; 0 picks a free one (read it from the handle).
        max_message_bytes: send/receive limit (clients should use the same, see grpc_channel).
        grace: default seconds in-flight RPCs get on :meth:`GrpcServerHandle.stop`.
        serving: initial health status of every service.
        tls: this server's identity; mutual TLS and per-RPC roles unless it is plaintext.
        health_port: also serve health alone, in plaintext, on this port (0: a free one).

    Raises:
        InvalidArgumentError: no servicers, a duplicate service name, or a bad port.
        UnavailableError: the address could not be bound (port in use, bad host).
    """
    names = tuple(name for _, _, name in servicers)
    if not names:
        raise InvalidArgumentError("start_grpc_server needs at least one servicer")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"duplicate service names in {names}")
    if not tls.insecure and not (tls.cert_pem and tls.key_pem and tls.ca_pem):
        raise InvalidArgumentError(
            "a gRPC server needs an internal TLS identity (--tls-cert/--tls-key/--tls-ca, or "
            "--insecure-internal)", param="tls")
    if not 0 <= port <= 65535:
        raise InvalidArgumentError(f"port must be in [0, 65535], got {port}", param="port")

    interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor()]
    if not tls.insecure:
        interceptors.insert(0, RoleInterceptor(tls.trust_domain))
    server = grpc.aio.server(interceptors=interceptors, options=server_options(max_message_bytes))
    for add_fn, servicer, _ in servicers:
        add_fn(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )

    bound = _bind(server, host, port, None if tls.insecure else tls.server_credentials())
    health_server = None
    health_bound = None
    if health_port is not None:
        health_server = grpc.aio.server(options=server_options(max_message_bytes))
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_bound = _bind(health_server, host, health_port, None)

    handle = GrpcServerHandle(
        server=server,
        host=host,
        port=bound,
        service_names=names,
        grace=grace,
        _health=health_servicer,
        health_server=health_server,
        health_port=health_bound,
    )
    await handle.set_serving(serving)
    await server.start()
    if health_server is not None:
        await health_server.start()
        logger.info("plaintext gRPC health (only) on %s", _join(host, health_bound or 0))
    logger.info("gRPC server listening on %s serving %s (%s)", _join(host, bound),
                ", ".join(names), "PLAINTEXT" if tls.insecure else "mutual TLS")  # fmt: skip
    return handle


def _bind(server: grpc.aio.Server, host: str, port: int,
          credentials: grpc.ServerCredentials | None) -> int:  # fmt: skip
    """Bind ``server`` (TLS with ``credentials``, else plaintext); the port bound."""
    bind = _join(host, port)
    try:
        if credentials is None:
            bound = server.add_insecure_port(bind)
        else:
            bound = server.add_secure_port(bind, credentials)
    except RuntimeError as err:  # grpcio >= 1.5x raises; older versions return 0
        raise UnavailableError(f"could not bind gRPC server to {bind}: {err}") from err
    if bound == 0:
        raise UnavailableError(f"could not bind gRPC server to {bind} (port in use?)")
    return bound


def _join(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def _client_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    return host
