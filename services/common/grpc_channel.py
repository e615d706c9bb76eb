"""Client side of Tandem's gRPC: channel options, opening channels, waiting for a service.

Every Tandem channel and server raises gRPC's message limits from the 4 MiB default to
:data:`DEFAULT_MAX_MESSAGE_BYTES` (64 MiB). The largest messages are KV chunks, which senders
keep at or below :data:`MAX_KV_CHUNK_BYTES` of data, and long prompts / big ModelInfo answers;
the gap leaves headroom for framing and for one oversized block. Both ends must agree: the
receiver's limit is the one that bites, so servers (``grpc_server``) and channels (here) share
the same default.

Keepalive: channels ping every 30 s even when idle, so a dead peer (a killed worker, a dropped
connection) surfaces as UNAVAILABLE within ~40 s instead of hanging a stream forever. Servers
permit pings this frequent (see ``grpc_server``). Reconnect backoff is capped at 1 s (gRPC's
default cap is 120 s): a worker that starts, or restarts, is reached within a second of
listening (a 5 s cap made a cold ``tandem up`` wait ~5 s more for each worker that loaded for
long), at the cost of one refused connection a second per channel to a dead peer.

Startup ordering uses :func:`wait_healthy`:
  1. open a channel to the address;
  2. call ``grpc.health.v1.Health/Check`` for the service until it answers SERVING
     (connection refused, NOT_SERVING and unknown-service answers are retried);
  3. give up with :class:`UnavailableError` after ``timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import UnavailableError
from services.common.internal_tls import InternalTls
from services.common.peer_roles import server_name

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 64 * MIB
"""Send and receive limit for every Tandem channel and server."""

MAX_KV_CHUNK_BYTES = 4 * MIB
"""Largest ``KVChunk.data`` a sender should produce (gRPC's own default limit, for scale)."""

KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
INITIAL_RECONNECT_BACKOFF_MS = 250
MAX_RECONNECT_BACKOFF_MS = 1_000


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, object]]:
    """gRPC channel arguments for Tandem clients: raised message limits and keepalive."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


def open_channel(
    address: str,
    *,
    tls: InternalTls,
    server_role: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``host:port`` with :func:`channel_options`.

    Mutual TLS with ``tls``'s identity (plaintext only for ``InternalTls.plaintext()``): the
    server's certificate must be signed by ``tls``'s CA and name ``server_role`` in ``tls``'s own
    trust domain (``<role>.<trust domain>.tandem.internal``: ``peer_roles.server_name``; None
    accepts any member of the deployment), whatever host ``address`` names. Opening is lazy: no
    connection is made until the first RPC (or :func:`wait_healthy`). Close it with
    ``await channel.close()``.
    """
    options = channel_options(max_message_bytes)
    if tls.insecure:
        return grpc.aio.insecure_channel(address, options=options)
    options.append(("grpc.ssl_target_name_override", server_name(server_role, tls.trust_domain)))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


async def wait_healthy(
    address: str,
    service: str = "",
    timeout: float = 30.0,
    *,
    poll_interval: float = 0.1,
    channel: grpc.aio.Channel | None = None,
    tls: InternalTls | None = None,
) -> None:
    """Return once ``address`` reports ``service`` SERVING ("" = the whole server).

    Args:
        address: ``host:port`` of the gRPC server.
        service: full service name, e.g. ``"tandem.v1.Decode"``, or "" for the server overall.
        timeout: seconds to keep trying.
        poll_interval: pause between attempts.
        channel: reuse this channel instead of opening (and closing) one.
        tls: the identity to open a channel with (required when ``channel`` is None).

    Raises:
        UnavailableError: not SERVING within ``timeout``; the message says what was last seen.
    """
    own = channel is None
    if channel is None:
        if tls is None:
            raise ValueError("wait_healthy needs a channel or a tls identity")
        chan = open_channel(address, tls=tls)
    else:
        chan = channel
    stub = health_pb2_grpc.HealthStub(chan)
    deadline = time.monotonic() + timeout
    last = "no answer"
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UnavailableError(
                    f"gRPC service {service or '(server)'!r} at {address} not healthy "
                    f"after {timeout:g}s (last: {last})"
                )
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service=service),
                    timeout=min(remaining, 2.0),
                    wait_for_ready=True,
                )
            except grpc.aio.AioRpcError as err:
                last = f"{err.code().name}: {err.details() or ''}".rstrip(": ")
            else:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            logger.debug("waiting for %s %r: %s", address, service, last)
            await asyncio.sleep(min(poll_interval, max(deadline - time.monotonic(), 0.0)))
    finally:
        if own:
            await chan.close()
