"""The gateway's GET endpoints besides metrics: ``/v1/models``, ``/health`` and ``/ready``.

- ``/health`` is liveness: 200 while the process serves HTTP, whatever the backend does, so an
  orchestrator never restarts a healthy gateway because a worker is down.
- ``/ready`` is readiness: 200 only when the tokenizer service answers SERVING, the model's facts
  are known, and at least one decode worker and (when a prefill pool is configured) one prefill
  worker are healthy (from the router's polls); otherwise 503. Both answers carry the per-dependency details as JSON.
- ``/v1/models`` lists the served model names and ``/v1/models/{model}`` shows one
  (authenticated like every ``/v1`` route).
"""

from __future__ import annotations

import logging
from typing import cast

from aiohttp import web

from services.common.errors import NotFoundError

from services.gateway.backend import Role
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


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    tokenizer_status = await state.backend.tokenizer.health()
    if tokenizer_status == "SERVING" and state.model_info is None:
        try:
            await state.require_model_info()
        except Exception:
            logger.debug("model info not available for /ready", exc_info=True)
    router = state.router
    problems: list[str] = []
    if tokenizer_status != "SERVING":
        problems.append(f"tokenizer: {tokenizer_status}")
    elif state.model_info is None:
        problems.append("tokenizer: model info not available")
    roles: tuple[Role, ...] = ("prefill", "decode") if router.workers("prefill") else ("decode",)
    for role in roles:
        if router.healthy_count(role) == 0:
            problems.append(f"{role}: no healthy worker")
    body = {
        "status": "ready" if not problems else "not_ready",
        "problems": problems,
        "model": state.served_names[0] if state.served_names else None,
        "tokenizer": {"address": state.backend.tokenizer.address, "status": tokenizer_status},
        "prefill": [router.describe(w) for w in router.workers("prefill")],
        "decode": [router.describe(w) for w in router.workers("decode")],
        "in_flight": state.admission.in_flight,
    }
    return web.json_response(body, status=200 if not problems else 503)
