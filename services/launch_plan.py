"""The plan of ``tandem up``: which children to start, with which command lines and ports.

:func:`plan` turns a :class:`LaunchConfig` (the ``tandem up`` flags) into one :class:`ChildSpec`
per child process, in start order: its ``python -m services serve ...`` command line, the address
clients reach it at, its Prometheus URL and every port it binds. Overlapping or out-of-range ports
are refused by :func:`plan` and ports something else already holds by :func:`check_ports_free`,
both with a one-line error.

Why a module of its own: planning is pure (no process is started, nothing is supervised), so it is
checked in isolation and every configuration error surfaces before anything starts; starting,
watching and stopping the children is ``launcher.py``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.common import ports
from services.common.cpu_list import format_cpus
from services.common.errors import InvalidArgumentError, UnavailableError
from services.cpu_plan import Placement, plan_cpus, usable_cpus

logger = logging.getLogger(__name__)

GRPC_SERVICES = {
    "tokenizer": "tandem.v1.Tokenizer",
    "prefill": "tandem.v1.Prefill",
    "decode": "tandem.v1.Decode",
}
SERVICE_MODULES = {
    "tokenizer": "services.tokenizer.main",
    "prefill": "services.prefill.main",
    "decode": "services.decode.main",
    "gateway": "services.gateway.main",
}
MODES = ("disaggregated", "colocated")
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_STOP_TIMEOUT_S = 20.0
SHARED_CORES_PREFILL_QUEUE = 64
"""The gateway's ``--max-prefill-queue`` where prefill and decode workers share cores: a long
prompt then waits for the prefill pool rather than being prefilled by a decode worker."""


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """What ``tandem up`` starts; built from the flags by :func:`services.launcher.run`.

    ``mode``: ``disaggregated`` (prefill and decode pools; the gateway's conditional
    disaggregation decides per prompt) or ``colocated`` (decode workers only, each prefilling
    its own prompts; no prefill pool). ``num_decode`` 0 with prefill workers starts no decode
    pool: an embedding model's deployment, the prefill workers serving ``/v1/embeddings`` alone
    (the gateway gets ``--no-decode``; generation answers 503).
    ``threads``: per-role overrides of the CPU plan
    (``services/cpu_plan.py``); ``cpus``: the cores to plan over (default: this process's).
    ``restart``: start a child that dies after start-up again, with backoff (``launcher.py``).
    ``kv_transport``: every prefill and decode worker's ``--kv-transport`` (None: their default).
    ``tls_dir``: a directory of ``ca.pem`` and ``<role>.pem`` / ``<role>-key.pem``
    (``services/common/cert_authority.py``) whose role certificates every child gets as
    ``--tls-cert/--tls-key/--tls-ca``; ``insecure_internal`` passes ``--insecure-internal``
    instead. With neither, children get no TLS flags (their own environment decides).
    """

    model: str = "default"
    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    gateway: bool = True
    host: str = "127.0.0.1"
    gateway_port: int = ports.GATEWAY_HTTP_PORT
    gateway_metrics_port: int = ports.GATEWAY_METRICS_PORT
    tokenizer_port: int = ports.TOKENIZER_GRPC_PORT
    tokenizer_metrics_port: int = ports.TOKENIZER_METRICS_PORT
    prefill_port: int = ports.PREFILL_GRPC_PORT_BASE
    prefill_metrics_port: int = ports.PREFILL_METRICS_PORT_BASE
    decode_port: int = ports.DECODE_GRPC_PORT_BASE
    decode_metrics_port: int = ports.DECODE_METRICS_PORT_BASE
    dtype: str | None = None
    device: str | None = None
    kv_cache_gib: float | None = None
    num_blocks: int | None = None
    kv_cache_dtype: str | None = None
    kv_transport: str | None = None
    speculative: tuple[str, ...] = ()  # decode workers' speculative-decoding flags
    pooling: str | None = None  # prefill workers' --pooling (how /v1/embeddings pools)
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    chat_template: str | None = None  # the tokenizer's --chat-template FILE
    log_level: str = "INFO"
    threads: tuple[tuple[str, int], ...] = ()
    cpus: tuple[int, ...] | None = None
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S
    stop_timeout: float = DEFAULT_STOP_TIMEOUT_S
    restart: bool = True
    tls_dir: str | None = None
    insecure_internal: bool = False
    core_share: str | None = None  # the run's shared-cores file (cpu_plan.py), made by the launcher
    tensor_parallel_size: int = 1  # ranks per prefill and decode worker
    prefill_tensor_parallel_size: int | None = None  # None: tensor_parallel_size
    decode_tensor_parallel_size: int | None = None

    def width(self, service: str) -> int:
        """The tensor-parallel width of ``service``'s workers (``prefill`` / ``decode``)."""
        own = (self.prefill_tensor_parallel_size if service == "prefill"
               else self.decode_tensor_parallel_size)  # fmt: skip
        return self.tensor_parallel_size if own is None else own


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One planned child process.

    Attributes:
        name: ``tokenizer``, ``prefill-0``, ``decode-1``, ``gateway``.
        service: the ``tandem serve`` service it runs.
        argv: its full command line.
        address: where clients reach it (``host:port``; an ``http://`` URL for the gateway).
        metrics_url: its Prometheus endpoint.
        ports: every port it binds, with what for (for the free-port check).
        placement: a worker's threads and cores (None for the tokenizer and the gateway).
        env: extra environment variables of its process.
    """

    name: str
    service: str
    argv: tuple[str, ...]
    address: str
    metrics_url: str
    ports: tuple[tuple[int, str], ...] = field(default=())
    placement: Placement | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def grpc_service(self) -> str | None:
        """The full gRPC service name to health-check, or None (the gateway speaks HTTP)."""
        return GRPC_SERVICES.get(self.service)


def plan(config: LaunchConfig) -> list[ChildSpec]:
    """Every child to start, in start order; InvalidArgumentError on a config that cannot work."""
    if config.num_prefill < 0 or config.num_decode < 0:
        raise InvalidArgumentError("--prefill and --decode must be >= 0", param="prefill")
    if config.mode not in MODES:
        raise InvalidArgumentError(f"--mode must be one of {', '.join(MODES)}", param="mode")
    colocated = config.mode == "colocated"
    for flag, width in (("--tensor-parallel-size", config.tensor_parallel_size),
                        ("--prefill-tensor-parallel-size", config.width("prefill")),
                        ("--decode-tensor-parallel-size", config.width("decode"))):  # fmt: skip
        if width < 1:
            raise InvalidArgumentError(f"{flag} must be >= 1", param="tensor_parallel_size")
    if colocated and config.num_prefill:
        raise InvalidArgumentError("--mode colocated runs no prefill workers (drop --prefill)",
                                   param="prefill")  # fmt: skip
    gateway = config.gateway
    if gateway and importlib.util.find_spec(SERVICE_MODULES["gateway"]) is None:
        logger.warning("services/gateway/main.py is not installed; starting without the gateway")
        gateway = False
    embeddings_only = not colocated and config.num_decode == 0 and config.num_prefill > 0
    if gateway and not embeddings_only and (
            config.num_decode < 1 or (config.num_prefill < 1 and not colocated)):  # fmt: skip
        raise InvalidArgumentError(
            "the gateway needs at least one prefill and one decode worker "
            "(or --mode colocated, or --no-gateway; or --decode 0 for an embedding model)",
            param="prefill",
        )
    for service, count in (("prefill", config.num_prefill), ("decode", config.num_decode)):
        if count and importlib.util.find_spec(SERVICE_MODULES[service]) is None:
            raise UnavailableError(
                f"{SERVICE_MODULES[service]} is not installed; cannot start {service} workers "
                f"(pass --{service} 0)"
            )

    host = config.host
    client_host = _client_host(host)
    base = [sys.executable, "-m", "services", f"--log-level={config.log_level}", "serve"]

    def tls_flags(role: str) -> list[str]:
        if config.insecure_internal:
            return ["--insecure-internal"]
        if config.tls_dir is None:
            return []
        d = config.tls_dir
        return ["--tls-cert", os.path.join(d, f"{role}.pem"),
                "--tls-key", os.path.join(d, f"{role}-key.pem"),
                "--tls-ca", os.path.join(d, "ca.pem")]  # fmt: skip

    specs: list[ChildSpec] = []
    placements = plan_cpus(config.num_prefill, config.num_decode,
                           config.cpus if config.cpus is not None else usable_cpus(),
                           dict(config.threads), config.core_share)  # fmt: skip

    def grpc_child(name: str, service: str, port: int, metrics_port: int, extra: list[str]) -> None:
        placement = placements.get(name)
        placed: list[str] = []  # before ``extra``: --worker-args may override them
        if placement is not None:
            placed += ["--threads", str(placement.threads)]
            if placement.cpus is not None:
                placed += ["--cpus", format_cpus(placement.cpus)]
        argv = [*base, service, "--model", config.model, "--host", host,
                "--port", str(port), "--metrics-port", str(metrics_port), *placed,
                *tls_flags(service), *extra]  # fmt: skip
        specs.append(
            ChildSpec(
                name=name,
                service=service,
                argv=tuple(argv),
                address=_join(client_host, port),
                metrics_url=f"http://{_join(client_host, metrics_port)}/metrics",
                ports=((port, f"{name} gRPC"), (metrics_port, f"{name} metrics")),
                placement=placement,
                env=placement.env if placement is not None else {},
            )
        )

    template = ["--chat-template", config.chat_template] if config.chat_template else []
    grpc_child("tokenizer", "tokenizer", config.tokenizer_port, config.tokenizer_metrics_port,
               template)  # fmt: skip
    for service, count, port, metrics_port in (
        ("prefill", config.num_prefill, config.prefill_port, config.prefill_metrics_port),
        ("decode", config.num_decode, config.decode_port, config.decode_metrics_port),
    ):
        for i in range(count):
            name = f"{service}-{i}"
            extra = ["--worker-id", name, "--advertise-address", _join(client_host, port + i)]
            if service == "prefill" and config.num_decode:  # KV only to this run's decoders
                extra += ["--decode-members", ",".join(
                    _join(client_host, config.decode_port + j) for j in range(config.num_decode))]
            if config.dtype is not None:
                extra += ["--dtype", config.dtype]
            if config.device is not None:
                extra += ["--device", config.device]
            if config.kv_cache_gib is not None:
                extra += ["--kv-cache-gib", f"{config.kv_cache_gib:g}"]
            if config.num_blocks is not None:
                extra += ["--num-blocks", str(config.num_blocks)]
            if config.kv_cache_dtype is not None:
                extra += ["--kv-cache-dtype", config.kv_cache_dtype]
            if config.kv_transport is not None:
                extra += ["--kv-transport", config.kv_transport]
            if service == "decode":  # speculation is a decode step's business
                extra += list(config.speculative)
            if config.width(service) > 1:  # its ranks: processes it starts on its own cores
                extra += ["--tensor-parallel-size", str(config.width(service))]
            if service == "prefill" and config.pooling is not None:  # embeddings are prefill's
                extra += ["--pooling", config.pooling]
            grpc_child(name, service, port + i, metrics_port + i, [*extra, *config.worker_args])

    if gateway:
        argv = [*base, "gateway", "--host", host, "--port", str(config.gateway_port),
                "--metrics-port", str(config.gateway_metrics_port),
                "--model", config.model, "--tokenizer", specs[0].address,
                *tls_flags("gateway")]  # fmt: skip
        for spec in specs[1:]:
            argv += [f"--{spec.service}", spec.address]
        if colocated:
            argv.append("--no-prefill")
        elif shares_cores(config.num_prefill, config.num_decode, placements):
            # a decode worker prefilling beside a busy prefill worker has no core of its own to
            # do it on: it would take its streams' core (docs/benchmarks.md), so long prompts
            # wait in the prefill queue instead (--gateway-args can still set it)
            argv += ["--max-prefill-queue", str(SHARED_CORES_PREFILL_QUEUE)]
        if embeddings_only:  # an embedding model: its prefill workers serve /v1/embeddings
            argv.append("--no-decode")
        url = f"http://{_join(client_host, config.gateway_port)}"
        specs.append(
            ChildSpec(
                name="gateway",
                service="gateway",
                argv=(*argv, *config.gateway_args),
                address=url,
                metrics_url=f"http://{_join(client_host, config.gateway_metrics_port)}/metrics",
                ports=((config.gateway_port, "gateway HTTP"),
                       (config.gateway_metrics_port, "gateway metrics")),
            )
        )
    _check_distinct_ports(specs)
    return specs


def shares_cores(num_prefill: int, num_decode: int, placements: Mapping[str, Placement]) -> bool:
    """Whether prefill and decode workers run on the same cores (the CPU plan's second rule)."""
    return bool(num_prefill and num_decode) and any(p.cpus is None for p in placements.values())


def _check_distinct_ports(specs: Sequence[ChildSpec]) -> None:
    seen: dict[int, str] = {}
    for spec in specs:
        for port, what in spec.ports:
            if not 0 < port <= 65535:
                raise InvalidArgumentError(f"{what} port {port} is not in [1, 65535]", param="port")
            if port in seen:
                raise InvalidArgumentError(
                    f"port {port} is planned twice ({seen[port]} and {what}); move a port base",
                    param="port",
                )
            seen[port] = what


def check_ports_free(specs: Sequence[ChildSpec], host: str) -> None:
    """UnavailableError naming the first planned port something else already holds."""
    for spec in specs:
        for port, what in spec.ports:
            bind = _bind_host(host)
            family = socket.AF_INET6 if ":" in bind else socket.AF_INET
            try:
                with socket.create_server((bind, port), family=family):
                    pass
            except OSError as err:
                raise UnavailableError(
                    f"port {port} ({what}) on {host} is not available: "
                    f"{os.strerror(err.errno) if err.errno else err}"
                ) from err


def _client_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host)


def _bind_host(host: str) -> str:
    return host.strip("[]")


def _join(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
