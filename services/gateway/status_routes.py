"""The gateway's GET endpoints besides metrics: ``/v1/models``, ``/health`` and ``/ready``.

- ``/health`` is liveness: 200 while the process serves HTTP, whatever the backend does, so an
  orchestrator never restarts a healthy gateway because a worker is down.
- ``/ready`` is readiness: 200 when the gateway can serve, that is when at least one tokenizer
  replica is healthy and serves the model, the model's facts are known, and at least one decode
  worker is healthy (all from the background health checks, so a hung replica never makes the
  probe itself time out; a replica never checked yet is checked now); otherwise 503. Prefill
  workers are not needed: without a healthy one, decode workers prefill prompts themselves
  (``prefill_policy.py``), so a prefill pool that is configured but down is a *warning*, not a
  problem. A gateway with no decode pool (``--no-decode``: an embedding model's prefill workers
  serve ``/v1/embeddings`` alone) is ready when a prefill worker is healthy. Both answers carry
  every replica's details as JSON: ``problems`` (why not ready), ``warnings`` (what is
  degraded), ``tokenizer``, ``prefill`` and ``decode`` (one entry per replica, ``healthy`` and,
  when it is not, ``error``), ``model`` and ``in_flight``. Those details name internal addresses,
  worker errors and cache statistics, so when API keys are configured only a caller with a valid
  key sees them; anyone else (a load balancer's or kubelet's probe sends no key) gets the bare
  ``{"status": ...}`` with the same status code, and a *wrong* key gets the usual 401. With no
  keys configured (``--allow-no-auth``) everyone is the operator and sees the details.
- ``/v1/models`` lists the served model names and ``/v1/models/{model}`` shows one
  (authenticated like every ``/v1`` route).
"""

from __future__ import annotations

import logging
from typing import cast

from aiohttp import web

from services.common.errors import NotFoundError
from services.gateway.openai_responses import JsonDict, ModelCard, models_response
from services.gateway.state import STATE_KEY

logger = logging.getLogger(__name__)


async def _cards(request: web.Request) -> list[ModelCard]:
    state = request.app[STATE_KEY]
    state.auth.check(request.headers.get("Authorization"))
    if not state.config.served_model_names or state.model_info is not None:
        await state.require_model_info()  # the names come from it, or it is cheap: known
    context = state.model_info.context_length if state.model_info is not None else 0
    return [
        ModelCard(id=name, created=state.created, max_model_len=context or None)
        for name in state.served_names
    ]


async def models(request: web.Request) -> web.Response:
    return web.json_response(models_response(await _cards(request)))


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: one card, or OpenAI's 404."""
    name = request.match_info["model"]
    for card in await _cards(request):
        if card.id == name:
            entries = cast(list[JsonDict], models_response([card])["data"])
            return web.json_response(entries[0])
    raise NotFoundError(
        f"The model `{name}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def _may_see_details(request: web.Request) -> bool:
    """Whether ``/ready`` may show this caller its details: auth is off, or the caller sent a
    valid key. A wrong key raises the 401 (a probe that sends none is not refused)."""
    auth = request.app[STATE_KEY].auth
    if not auth.enabled:
        return True
    header = request.headers.get("Authorization")
    if header is None:
        return False
    auth.check(header)
    return True


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    details = _may_see_details(request)
    tokenizers, router = state.tokenizers, state.router
    await tokenizers.poll_new()
    if tokenizers.healthy_count() and state.model_info is None:
        try:
            await state.require_model_info()
        except Exception:
            logger.debug("model info not available for /ready", exc_info=True)
    problems: list[str] = []
    warnings: list[str] = []
    replicas = tokenizers.replicas()
    if tokenizers.healthy_count() == 0:
        seen = "; ".join(f"{r.address}: {r.describe().get('error', r.status)}" for r in replicas)
        problems.append(f"tokenizer: no healthy replica (of {len(replicas)}): {seen}")
    elif state.model_info is None:
        problems.append("tokenizer: model info not available")
    if not router.workers("decode"):  # prefill workers alone: an embedding model's deployment
        if router.healthy_count("prefill") == 0:
            problems.append("prefill: no healthy worker (and no decode pool)")
    elif router.healthy_count("decode") == 0:
        problems.append("decode: no healthy worker")
    pools = router.workers("decode") and router.workers("prefill")
    if pools and router.healthy_count("prefill") == 0:
        warnings.append("prefill: no healthy worker; decode workers prefill every prompt")
    status = 200 if not problems else 503
    if not details:
        return web.json_response({"status": "ready" if not problems else "not_ready"},
                                 status=status)
    body = {
        "status": "ready" if not problems else "not_ready",
        "problems": problems,
        "warnings": warnings,
        "model": state.served_names[0] if state.served_names else None,
        "tokenizer": tokenizers.describe(),
        "prefill": [router.describe(w) for w in router.workers("prefill")],
        "decode": [router.describe(w) for w in router.workers("decode")],
        "in_flight": state.admission.in_flight,
    }
    return web.json_response(body, status=status)
