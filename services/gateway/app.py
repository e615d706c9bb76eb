"""The gateway's aiohttp application: routes, middleware, and the start-up / shutdown of what
the handlers share.

:func:`build_app` wires a :class:`~services.gateway.state.GatewayState` from a
:class:`~services.gateway.config.GatewayConfig` into a ``web.Application``:

- ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``
  (``embeddings.py``), ``GET /v1/models[/{model}]``,
  OpenAI's Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``:
  ``responses_api.py``), Anthropic's Messages API (``POST /v1/messages[/count_tokens]``:
  ``messages_api.py``),
  ``POST /tokenize``, ``POST /detokenize``, ``GET /version`` (vLLM's), ``GET /openapi.json``
  (``openapi.py``), ``GET /`` (the playground), ``GET /health``, ``GET /ready`` (Prometheus
  ``GET /metrics`` is not here: ``main.serve`` serves it on ``--metrics-port``, a port of its own
  that clients of the API need not reach);
- the OpenAI error middleware (every failure is ``{"error": {...}}`` with OpenAI's status);
- ``client_max_size`` = ``max_body_bytes``, so larger bodies are refused with 413;
- requests that are not valid HTTP are logged as one rate-limited WARNING line instead of an
  ERROR traceback each (``malformed_http_log.py``).

Lifecycle (aiohttp signals):

1. start-up: resolve the tokenizer and worker entries given by DNS name (``membership.py``);
   check every tokenizer replica's health and poll every worker once (so the first request can
   be routed), then keep both up to date in the background; ask the tokenizer pool for the
   model's facts (in the background until a replica answers, so the gateway may start before
   its backend);
2. shutdown: stop polling, give in-flight cleanup (aborts) a moment, close the gRPC channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from services.common.metrics import TandemMetrics
from services.gateway.auth import ApiKeyAuth
from services.gateway.backend import Backend
from services.gateway.body_budget import BodyBudget
from services.gateway.grammar_pool import GrammarPool
from services.gateway.completions import chat_completions, completions
from services.gateway.config import DEFAULT_MAX_IN_FLIGHT_PER_CLIENT, GatewayConfig
from services.gateway.embeddings import embeddings
from services.gateway.http_errors import error_middleware
from services.gateway.rate_limit import AdmissionLimiter, RateLimiter
from services.gateway.membership import Membership
from services.gateway.messages_api import count_tokens, create_message
from services.gateway.openapi import openapi_route
from services.gateway.playground import playground
from services.gateway.malformed_http_log import MalformedHttpLogFilter
from services.gateway.malformed_http_log import attach as attach_log_filter
from services.gateway.malformed_http_log import detach as detach_log_filter
from services.gateway.response_store import RESPONSE_STORE_KEY, ResponseStore
from services.gateway.responses_api import create_response, delete_response, get_response
from services.gateway.router import Router
from services.gateway.safety import SafetyPolicy, load_policy
from services.gateway.state import STATE_KEY, GatewayState
from services.gateway.status_routes import health, model, models, ready
from services.gateway.token_routes import detokenize, tokenize, version_route
from services.gateway.tokenizer_pool import TokenizerPool

logger = logging.getLogger(__name__)

_WATCH_KEY = web.AppKey("tandem_model_info_watch", asyncio.Task)
_LOG_FILTER_KEY = web.AppKey("tandem_malformed_http_log", MalformedHttpLogFilter)


def build_state(
    config: GatewayConfig,
    *,
    auth: ApiKeyAuth | None = None,
    policy: SafetyPolicy | None = None,
    metrics: TandemMetrics | None = None,
) -> GatewayState:
    """The shared objects for ``config`` (channels open lazily; nothing is contacted yet)."""
    config.validate()
    backend = Backend(config)
    rate_limiter = None
    if config.rate_limit_rpm is not None:
        burst = config.rate_limit_burst
        if burst is None:
            burst = max(1.0, config.rate_limit_rpm / 60.0)
        rate_limiter = RateLimiter(config.rate_limit_rpm, burst)
    token_limiter = None
    if config.rate_limit_tpm is not None:  # a minute's worth at once: one big request fits
        token_limiter = RateLimiter(config.rate_limit_tpm, config.rate_limit_tpm, unit="tokens")
    metrics = metrics if metrics is not None else TandemMetrics()
    router = Router(backend.prefill, backend.decode, interval_s=config.stats_interval_s,
                    weights=config.routing, metrics=metrics)
    tokenizers = TokenizerPool(backend.tokenizers, interval_s=config.stats_interval_s)
    auth = auth if auth is not None else ApiKeyAuth(())
    per_client = config.max_in_flight_per_client
    if per_client is None and auth.enabled:  # tenants: one key's flood leaves the others room
        per_client = DEFAULT_MAX_IN_FLIGHT_PER_CLIENT
    membership = Membership(
        backend, router,
        {"tokenizer": config.tokenizer_addresses, "prefill": config.prefill_addresses,
         "decode": config.decode_addresses},
        tokenizers=tokenizers, interval_s=config.resolve_interval_s,
    )  # fmt: skip
    return GatewayState(
        config=config,
        backend=backend,
        tokenizers=tokenizers,
        router=router,
        membership=membership,
        policy=policy if policy is not None else load_policy(config.safety_policy),
        auth=auth,
        rate_limiter=rate_limiter,
        token_limiter=token_limiter,
        body_budget=BodyBudget(config.edge.max_body_memory_bytes, config.max_body_bytes,
                               config.edge.max_body_memory_per_client_bytes),
        admission=AdmissionLimiter(config.max_in_flight, per_client),
        grammars=GrammarPool(config.grammar_workers, config.grammar_timeout_s),
        metrics=metrics,
    )


def build_app(
    config: GatewayConfig,
    *,
    auth: ApiKeyAuth | None = None,
    policy: SafetyPolicy | None = None,
    metrics: TandemMetrics | None = None,
) -> web.Application:
    """The gateway application for ``config`` (see the module docstring).

    Call it inside the event loop that will serve the app: its gRPC channels (``grpc.aio``)
    belong to the loop they are created in.
    """
    state = build_state(config, auth=auth, policy=policy, metrics=metrics)
    app = web.Application(middlewares=[error_middleware], client_max_size=config.max_body_bytes)
    app[STATE_KEY] = state
    app[RESPONSE_STORE_KEY] = ResponseStore(ttl_s=config.response_store_ttl_s,
                                            max_entries=config.response_store_max_entries)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version_route)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/openapi.json", openapi_route)
    app.router.add_get("/", playground)
    app.on_startup.append(_start)
    app.on_shutdown.append(_shutdown)
    app.on_cleanup.append(_cleanup)
    return app


async def _start(app: web.Application) -> None:
    state = app[STATE_KEY]
    app[_LOG_FILTER_KEY] = MalformedHttpLogFilter()
    attach_log_filter(app[_LOG_FILTER_KEY])
    await state.membership.start()
    await asyncio.gather(state.tokenizers.start(), state.router.start())
    app[_WATCH_KEY] = asyncio.create_task(state.watch_model_info(), name="tandem-model-info")
    logger.info(
        "gateway backends: tokenizer %s, prefill %s, decode %s",
        ",".join(state.config.tokenizer_addresses),
        ",".join(state.config.prefill_addresses),
        ",".join(state.config.decode_addresses),
    )


async def _shutdown(app: web.Application) -> None:
    state = app[STATE_KEY]
    watch = app.get(_WATCH_KEY)
    if watch is not None:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    await state.membership.stop()
    await state.tokenizers.stop()
    await state.router.stop()


async def _cleanup(app: web.Application) -> None:
    state = app[STATE_KEY]
    if _LOG_FILTER_KEY in app:
        detach_log_filter(app[_LOG_FILTER_KEY])
    await state.drain()
    await state.grammars.close()
    await state.backend.close()
