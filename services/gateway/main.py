"""``tandem serve gateway``: the OpenAI-compatible HTTP front door (torch-free).

Flags say where the backend services are (``--tokenizer``, ``--prefill`` and ``--decode``, each
repeatable or comma-separated, a DNS name standing for every replica; ``--no-prefill`` for
none), which prompts go to the
prefill pool (``prefill_policy.py``) and how requests are limited; API keys come from
``--api-keys-file`` and/or the ``TANDEM_API_KEYS`` environment variable (comma-separated), read
here in :func:`run`, never at import time. Outside loopback the gateway refuses to start without
keys unless ``--allow-no-auth``; ``--https-cert/--https-key`` serve HTTPS (``edge_server.py``).

Run loop:
  1. build the application (``app.build_app``) and bind ``--host:--port`` (``edge_server.start_edge``:
     TLS, header read timeout, connection cap), and Prometheus ``/metrics`` on its own
     ``--metrics-port`` (default 9102, like the workers' metrics ports: never the API's port,
     which clients reach; ``--metrics-host`` binds another interface, e.g. 127.0.0.1);
  2. serve until SIGINT / SIGTERM;
  3. shut down gracefully: in-flight requests get ``--shutdown-grace`` seconds, then their
     handlers are cancelled and each aborts its work on the workers; channels are closed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from aiohttp import web

from services.common import ports
from services.common.metrics import MetricsHttpServer, serve_metrics_http
from services.common.internal_tls import add_tls_arguments, tls_from_args
from services.gateway.auth import ApiKeyAuth
from services.gateway.prefill_policy import (
    DEFAULT_MAX_PREFILL_QUEUE,
    DEFAULT_REMOTE_PREFILL_MIN_TOKENS,
    PrefillPolicy,
)
from services.gateway.config import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_DEFAULT_MAX_TOKENS,
    DEFAULT_HEADER_READ_TIMEOUT_S,
    DEFAULT_MAX_BODY_MEMORY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_SSE_WRITE_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_IN_FLIGHT_PER_CLIENT,
    DEFAULT_KV_LOAD_WEIGHT,
    DEFAULT_KV_OVERLAP_WEIGHT,
    DEFAULT_MAX_MIGRATIONS,
    DEFAULT_DECODE_ADMISSION_TIMEOUT_S,
    DEFAULT_RESPONSE_STORE_MAX_ENTRIES,
    DEFAULT_RESPONSE_STORE_TTL_S,
    BackendTimeouts,
    EdgeLimits,
    GatewayConfig,
    RoutingWeights,
)
from services.gateway.edge_server import is_loopback as is_loopback_host
from services.gateway.edge_server import require_auth_beyond_loopback, start_edge
from services.gateway.reasoning import REASONING_PARSERS
from services.gateway.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

API_KEYS_ENV = "TANDEM_API_KEYS"
ALLOW_NO_AUTH_ENV = "TANDEM_ALLOW_NO_AUTH"
HTTPS_CERT_ENV = "TANDEM_HTTPS_CERT"
HTTPS_KEY_ENV = "TANDEM_HTTPS_KEY"
DEFAULT_TOKENIZER = f"127.0.0.1:{ports.TOKENIZER_GRPC_PORT}"
DEFAULT_PREFILL = f"127.0.0.1:{ports.prefill_grpc_port(0)}"
DEFAULT_DECODE = f"127.0.0.1:{ports.decode_grpc_port(0)}"
_TIMEOUTS = BackendTimeouts()


def _max_tokens_default(value: str) -> int | None:
    """``--default-max-tokens``: a positive count, or ``context`` (None: the context left)."""
    if value == "context":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'context', got {value!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on")
    parser.add_argument("--port", type=int, default=ports.GATEWAY_HTTP_PORT, help="HTTP port")
    parser.add_argument("--metrics-port", type=int, default=ports.GATEWAY_METRICS_PORT,
                        help="Prometheus /metrics port, separate from the API's (default "
                             f"{ports.GATEWAY_METRICS_PORT}; 0 picks a free one; -1 disables)")
    parser.add_argument("--metrics-host", default=None,
                        help="interface /metrics listens on (default: --host)")
    edge = parser.add_argument_group("the edge: HTTPS, auth and per-client limits "
                                     "(docs/security.md)")  # fmt: skip
    edge.add_argument("--https-cert", default=env(HTTPS_CERT_ENV) or None, metavar="PEM",
                      help=f"serve HTTPS with this certificate chain (env {HTTPS_CERT_ENV}; "
                           "--tls-* name the internal mTLS identity instead)")
    edge.add_argument("--https-key", default=env(HTTPS_KEY_ENV) or None, metavar="PEM",
                      help=f"the HTTPS private key (env {HTTPS_KEY_ENV})")
    edge.add_argument("--allow-no-auth", action="store_true",
                      default=env(ALLOW_NO_AUTH_ENV, "") not in ("", "0", "false"),
                      help="start without API keys on a non-loopback --host (refused otherwise); "
                           f"for a gateway behind something that authenticates (env "
                           f"{ALLOW_NO_AUTH_ENV}=1)")
    edge.add_argument("--default-max-tokens", type=_max_tokens_default,
                      default=DEFAULT_DEFAULT_MAX_TOKENS, metavar="N|context",
                      help="max_tokens of a chat request that gives none; 'context': until the "
                           "context is full, as OpenAI (default %(default)s)")
    edge.add_argument("--max-tokens-limit", type=int, default=None, metavar="N",
                      help="largest max_tokens a request may ask for; more is answered 400 "
                           "(default: only the context bounds it)")
    edge.add_argument("--rate-limit-tpm", type=float, default=None, metavar="TOKENS",
                      help="model tokens per minute per API key (per IP address without auth): "
                           "prompt plus max_tokens charged at admission, the unused part given "
                           "back at the end (default: unlimited)")
    edge.add_argument("--header-read-timeout", type=float, default=DEFAULT_HEADER_READ_TIMEOUT_S,
                      help="seconds a connection may take to send a whole request header, new "
                           "or kept alive (default %(default)s)")
    edge.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                      help="open client connections at once; more are answered 503 and closed "
                           "(default %(default)s)")
    edge.add_argument("--sse-write-timeout", type=float, default=DEFAULT_SSE_WRITE_TIMEOUT_S,
                      help="seconds a streaming client may take to accept one write before it "
                           "is dropped and its request aborted (default %(default)s)")
    edge.add_argument("--max-body-memory", type=int, default=DEFAULT_MAX_BODY_MEMORY_BYTES,
                      metavar="BYTES",
                      help="request-body bytes held at once, all clients together; more get "
                           "429 (default %(default)s)")
    edge.add_argument("--grammar-workers", type=int, default=2, metavar="N",
                      help="processes that compile structured-output constraints (JSON schema, "
                           "regex, grammar) off the event loop (default %(default)s)")
    edge.add_argument("--grammar-timeout", type=float, default=10.0, metavar="SECONDS",
                      help="seconds one constraint may take to compile; slower ones get 400 "
                           "grammar_too_complex (default %(default)s)")
    edge.add_argument("--max-body-memory-per-client", type=int, default=None, metavar="BYTES",
                      help="of --max-body-memory, the bytes one client (an API key; an address "
                           "without keys) may hold at once; more get 429 client_body_budget "
                           "(default: an eighth of --max-body-memory, at least --max-body-bytes)")
    parser.add_argument(
        "--tokenizer",
        action="append",
        default=None,
        metavar="ADDR",
        help=f"tokenizer service host:port; repeat or comma-separate for a pool (a call that "
        f"fails on one replica is retried on another; default {DEFAULT_TOKENIZER})",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        default=None,
        metavar="ADDR",
        help=f"prefill worker host:port; repeat or comma-separate for a pool "
        f"(default {DEFAULT_PREFILL})",
    )
    parser.add_argument(
        "--no-prefill",
        action="store_true",
        help="no prefill pool: decode workers prefill every prompt (tandem up --mode colocated)",
    )
    parser.add_argument(
        "--no-decode",
        action="store_true",
        help="no decode pool: the prefill workers serve /v1/embeddings alone (an embedding "
        "model; tandem up --decode 0); generation answers 503",
    )
    parser.add_argument(
        "--remote-prefill-min-tokens",
        type=int,
        default=DEFAULT_REMOTE_PREFILL_MIN_TOKENS,
        help="prompts this long or longer go to a prefill worker, shorter ones are prefilled by "
        "their decode worker; 0 sends every prompt to the prefill pool (default %(default)s; "
        "see services/gateway/prefill_policy.py)",
    )
    parser.add_argument(
        "--max-prefill-queue",
        type=int,
        default=DEFAULT_MAX_PREFILL_QUEUE,
        help="a prompt is prefilled locally when the least-loaded prefill worker already has "
        "this many requests (default %(default)s)",
    )
    parser.add_argument(
        "--kv-overlap-weight",
        type=float,
        default=DEFAULT_KV_OVERLAP_WEIGHT,
        help="KV-aware routing: weight of a prompt block a worker would have to prefill (not in "
        "its prefix cache); 0 routes by load alone (default %(default)s; see "
        "services/gateway/router.py)",
    )
    parser.add_argument(
        "--kv-load-weight",
        type=float,
        default=DEFAULT_KV_LOAD_WEIGHT,
        help="KV-aware routing: weight of one request already on a worker, in prompt blocks "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--max-migrations",
        type=int,
        default=DEFAULT_MAX_MIGRATIONS,
        help="times a stream may move to another decode worker when its worker dies mid-stream "
        "(0: end the stream with an error event; default %(default)s)",
    )
    parser.add_argument(
        "--decode-admission-timeout",
        type=float,
        default=DEFAULT_DECODE_ADMISSION_TIMEOUT_S,
        help="seconds a request prefilled remotely waits for a decode worker to reserve room for "
        "its KV (every one full) before it is answered 503 decode_capacity; 0 answers at once "
        "(default %(default)s; see services/gateway/decode_admission.py)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=None,
        metavar="ADDR",
        help=f"decode worker host:port; repeat or comma-separate for a pool "
        f"(default {DEFAULT_DECODE})",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) clients use (default: the tokenizer service's)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="default | PATH: vocabulary used to print logprob tokens as text "
        "(default: 'token_id:<id>')",
    )
    parser.add_argument(
        "--safety-policy",
        default=None,
        metavar="PATH|off",
        help="content policy JSON file, or 'off' (default: the shipped policy)",
    )
    parser.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help=f"file with one API key per line (also: env {API_KEYS_ENV})",
    )
    parser.add_argument(
        "--rate-limit-rpm",
        type=float,
        default=None,
        help="requests per minute per API key (per IP address without auth; "
        "default: unlimited)",
    )
    parser.add_argument(
        "--rate-limit-burst",
        type=float,
        default=None,
        help="requests a key may send at once (default: one second's worth)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=DEFAULT_MAX_IN_FLIGHT,
        help="requests served at once; more get 429 (default %(default)s)",
    )
    parser.add_argument(
        "--max-in-flight-per-client",
        type=int,
        default=None,
        help="of those, at most this many from one client (an API key, or one address without "
        f"keys); more get 429 client_concurrency (default: {DEFAULT_MAX_IN_FLIGHT_PER_CLIENT} "
        "per API key when keys are configured, no cap without keys)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body; larger get 413 (default %(default)s)",
    )
    parser.add_argument(
        "--body-read-timeout",
        type=float,
        default=DEFAULT_BODY_READ_TIMEOUT_S,
        help="seconds a request body may take to arrive after its headers; slower clients get "
        "408 and are disconnected (default %(default)s)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="auto",
        help="the model's tool-call format: hermes (Qwen2.5/Qwen3, Hermes), llama3_json, "
        "mistral, qwen3_coder, pythonic (Llama 3.2/4), deepseek_v3; auto reads the chat template",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default="none",
        help="split the reply's <think>...</think> into reasoning_content: qwen3 (the reply may "
        "open a think block), deepseek_r1 (the template opened it)",
    )
    parser.add_argument(
        "--response-store-ttl",
        type=float,
        default=DEFAULT_RESPONSE_STORE_TTL_S,
        metavar="SECONDS",
        help="how long a Responses-API response stored with store: true stays retrievable and "
        "continuable with previous_response_id (in memory; default %(default)s)",
    )
    parser.add_argument(
        "--response-store-max-entries",
        type=int,
        default=DEFAULT_RESPONSE_STORE_MAX_ENTRIES,
        metavar="N",
        help="at most this many stored responses; the oldest is evicted first, 0 stores none "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--no-truncate",
        action="store_true",
        help="answer 400 for chats longer than the context instead of dropping the oldest turns",
    )
    parser.add_argument(
        "--stats-interval",
        type=float,
        default=1.0,
        help="seconds between worker load and tokenizer health polls (default %(default)s)",
    )
    parser.add_argument(
        "--resolve-interval",
        type=float,
        default=5.0,
        help="seconds between re-resolutions of tokenizers and workers given by DNS name; every "
        "address a name has is a replica (default %(default)s)",
    )
    parser.add_argument(
        "--prefill-timeout",
        type=float,
        default=_TIMEOUTS.prefill_s,
        help="seconds one prefill may take (default %(default)s)",
    )
    parser.add_argument(
        "--kv-wait-timeout",
        type=float,
        default=_TIMEOUTS.wait_for_kv_s,
        help="seconds decode waits for a request's KV (default %(default)s)",
    )
    parser.add_argument(
        "--generate-idle-timeout",
        type=float,
        default=_TIMEOUTS.generate_idle_s,
        help="longest silence of a decode stream (default %(default)s)",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds in-flight requests get at shutdown (default %(default)s)",
    )
    add_tls_arguments(parser, health_port=False)


def _addresses(values: list[str] | None, default: str) -> tuple[str, ...]:
    items = [a.strip() for v in (values or [default]) for a in v.split(",")]
    return tuple(a for a in items if a)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The :class:`GatewayConfig` for parsed flags (validated)."""
    return GatewayConfig(
        tokenizer_addresses=_addresses(args.tokenizer, DEFAULT_TOKENIZER),
        prefill_addresses=() if args.no_prefill else _addresses(args.prefill, DEFAULT_PREFILL),
        decode_addresses=() if args.no_decode else _addresses(args.decode, DEFAULT_DECODE),
        host=args.host,
        port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        metrics_host=args.metrics_host,
        served_model_names=tuple(args.served_model_name or ()),
        safety_policy=args.safety_policy,
        rate_limit_rpm=args.rate_limit_rpm,
        rate_limit_burst=args.rate_limit_burst,
        rate_limit_tpm=args.rate_limit_tpm,
        default_max_tokens=args.default_max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        https_cert=args.https_cert,
        https_key=args.https_key,
        edge=EdgeLimits(
            header_read_timeout_s=args.header_read_timeout,
            max_connections=args.max_connections,
            sse_write_timeout_s=args.sse_write_timeout,
            max_body_memory_bytes=args.max_body_memory,
            max_body_memory_per_client_bytes=args.max_body_memory_per_client,
        ),
        max_in_flight=args.max_in_flight,
        max_in_flight_per_client=args.max_in_flight_per_client,
        max_body_bytes=args.max_body_bytes,
        body_read_timeout_s=args.body_read_timeout,
        grammar_workers=args.grammar_workers,
        grammar_timeout_s=args.grammar_timeout,
        stats_interval_s=args.stats_interval,
        resolve_interval_s=args.resolve_interval,
        truncate_chats=not args.no_truncate,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        vocab_model=args.model,
        max_migrations=args.max_migrations,
        response_store_ttl_s=args.response_store_ttl,
        response_store_max_entries=args.response_store_max_entries,
        decode_admission_timeout_s=args.decode_admission_timeout,
        routing=RoutingWeights(args.kv_overlap_weight, args.kv_load_weight),
        prefill_policy=PrefillPolicy(
            remote_min_tokens=args.remote_prefill_min_tokens,
            max_prefill_queue=args.max_prefill_queue,
        ),
        timeouts=BackendTimeouts(
            prefill_s=args.prefill_timeout,
            wait_for_kv_s=args.kv_wait_timeout,
            generate_idle_s=args.generate_idle_timeout,
        ),
        tls=tls_from_args(args),
    ).validate()


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    auth = ApiKeyAuth.from_sources(args.api_keys_file, os.environ.get(API_KEYS_ENV))
    require_auth_beyond_loopback(config.host, auth_enabled=auth.enabled,
                                 allow_no_auth=args.allow_no_auth)  # fmt: skip
    if not auth.enabled and not is_loopback_host(config.host):
        logger.warning("no API keys and --allow-no-auth: anyone who reaches %s:%d can use the "
                       "model", config.host, config.port)  # fmt: skip
    asyncio.run(_main(config, auth, args.shutdown_grace))
    return 0


async def _main(config: GatewayConfig, auth: ApiKeyAuth, shutdown_grace: float) -> None:
    from services.gateway.app import build_app

    # Built inside the running loop: grpc.aio channels belong to the loop they are created in.
    app = build_app(config, auth=auth)
    await serve(app, config, shutdown_grace=shutdown_grace)


async def serve(app: web.Application, config: GatewayConfig, *, shutdown_grace: float = 10.0) -> None:
    """Serve ``app`` as ``config`` says until SIGINT or SIGTERM, then shut down gracefully.

    Raises:
        InvalidArgumentError: the HTTPS files cannot be loaded.
        UnavailableError: the address could not be bound.
    """
    from services.gateway.state import STATE_KEY

    runner, url = await start_edge(app, config, shutdown_grace=shutdown_grace)
    metrics_http: MetricsHttpServer | None = None
    try:
        if config.metrics_port is not None:
            metrics_http = await serve_metrics_http(app[STATE_KEY].metrics,
                                                    config.metrics_host or config.host,
                                                    config.metrics_port)  # fmt: skip
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        logger.info("gateway listening on %s", url)
        await stop.wait()
        logger.info("gateway shutting down")
    finally:
        if metrics_http is not None:
            await metrics_http.close()
        await runner.cleanup()
