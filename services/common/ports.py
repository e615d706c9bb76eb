"""Default ports of every Tandem process, in one place (flags and env override them).

==============  ==========================  ==========================
process         gRPC / HTTP                 Prometheus ``/metrics``
==============  ==========================  ==========================
gateway         HTTP 8000                   9102
tokenizer       gRPC 50051                  9101
prefill ``i``   gRPC 50061 + i              9111 + i
decode ``i``    gRPC 50071 + i              9121 + i
==============  ==========================  ==========================

Up to :data:`MAX_WORKERS_PER_ROLE` (10) prefill and 10 decode workers fit on one host with these
defaults (i = 0..9); more need explicit ports. Metrics start at 9101 to leave 9100 to the
Prometheus node exporter. Every process serves ``/metrics`` on a port of its own, never on a port
clients use, so a NetworkPolicy can open metrics to the monitoring namespace alone. All values are defaults only; nothing here is read from the environment.
"""

from __future__ import annotations

from services.common.errors import InvalidArgumentError

GATEWAY_HTTP_PORT = 8000
TOKENIZER_GRPC_PORT = 50051
PREFILL_GRPC_PORT_BASE = 50061
DECODE_GRPC_PORT_BASE = 50071

TOKENIZER_METRICS_PORT = 9101
GATEWAY_METRICS_PORT = 9102
PREFILL_METRICS_PORT_BASE = 9111
DECODE_METRICS_PORT_BASE = 9121

MAX_WORKERS_PER_ROLE = 10


def _check_index(index: int) -> None:
    if not 0 <= index < MAX_WORKERS_PER_ROLE:
        raise InvalidArgumentError(
            f"worker index must be in [0, {MAX_WORKERS_PER_ROLE}) to use default ports, got "
            f"{index}; pass explicit ports for more workers",
            param="index",
        )


def prefill_grpc_port(index: int = 0) -> int:
    """Default gRPC port of prefill worker ``index``."""
    _check_index(index)
    return PREFILL_GRPC_PORT_BASE + index


def decode_grpc_port(index: int = 0) -> int:
    """Default gRPC port of decode worker ``index``."""
    _check_index(index)
    return DECODE_GRPC_PORT_BASE + index


def prefill_metrics_port(index: int = 0) -> int:
    """Default metrics port of prefill worker ``index``."""
    _check_index(index)
    return PREFILL_METRICS_PORT_BASE + index


def decode_metrics_port(index: int = 0) -> int:
    """Default metrics port of decode worker ``index``."""
    _check_index(index)
    return DECODE_METRICS_PORT_BASE + index
