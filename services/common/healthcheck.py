"""A container healthcheck: exit 0 when a Tandem service is healthy, 1 otherwise.

Docker and Compose run a command inside the container and read its exit status; the slim image
has no ``grpc_health_probe`` or ``curl``, so this module is that command::

    python -m services.common.healthcheck 127.0.0.1:50051 tandem.v1.Tokenizer   # gRPC health
    python -m services.common.healthcheck http://127.0.0.1:8000/health           # HTTP 2xx

A gRPC address is checked with ``grpc.health.v1.Health/Check`` (SERVING = healthy; the service
name is optional, "" asks about the whole server) over mutual TLS with ``--tls-cert/--tls-key/
--tls-ca`` (env ``TANDEM_TLS_*``: inside a service's container, that service's own certificate;
any role of the deployment may ask for health), or plaintext with ``--insecure-internal`` (also
what a ``--health-port`` answers); an ``http://`` URL with a GET that must answer 2xx. One line
goes to stderr on failure. Torch-free and quick: one RPC or one request, bounded by
``--timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

from services.common.errors import TandemError
from services.common.internal_tls import InternalTls, add_tls_arguments, tls_from_args

DEFAULT_TIMEOUT_S = 3.0


async def check_grpc(address: str, service: str, timeout: float, tls: InternalTls) -> str | None:
    """None when ``service`` at ``address`` is SERVING, else what was seen."""
    import grpc.aio
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.grpc_channel import open_channel

    async with open_channel(address, tls=tls) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.aio.AioRpcError as err:
            return f"{err.code().name}: {err.details() or ''}".rstrip(": ")
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def check_http(url: str, timeout: float) -> str | None:
    """None when ``GET url`` answers 2xx, else what was seen."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status = int(response.status)
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return str(getattr(err, "reason", err))
    return None if 200 <= status < 300 else f"HTTP {status}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.common.healthcheck", description=__doc__.splitlines()[0]
    )
    parser.add_argument("target", help="gRPC host:port, or an http:// URL")
    parser.add_argument(
        "service",
        nargs="?",
        default="",
        help="gRPC service name, e.g. tandem.v1.Decode (default: the server)",
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    add_tls_arguments(parser, health_port=False)
    args = parser.parse_args(argv)
    if args.target.startswith(("http://", "https://")):
        problem = check_http(args.target, args.timeout)
    else:
        try:
            tls = tls_from_args(args)
        except TandemError as err:
            problem = err.message
        else:
            problem = asyncio.run(check_grpc(args.target, args.service, args.timeout, tls))
    if problem is not None:
        print(
            f"unhealthy: {args.target} {args.service}: {problem}".replace("  ", " "),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
