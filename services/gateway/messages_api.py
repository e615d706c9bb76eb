"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

``POST /v1/messages`` is a front (``front.py``) over the chat flow: the body is mapped onto a
chat request (``messages_request.py``), run as any chat completion is (auth, limits, safety,
admission, remote prefill, migration, cleanup on disconnect), and written back as a ``message``
or Anthropic's SSE events (``messages_renderer.py``). The API key may come in ``x-api-key`` (as
Anthropic's clients send it) or ``Authorization: Bearer``.

Errors on these routes are in Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}``, with the error type of the status (400 ``invalid_request_error``, 401
``authentication_error``, 404 ``not_found_error``, 413 ``request_too_large``, 429
``rate_limit_error``, 503 ``overloaded_error``, 500 ``api_error``); the message names the field.
After the stream started an error is an ``error`` event.

``count_tokens`` renders the conversation (system, messages, tools) through the chat template
exactly as a reply's prompt would be, on the tokenizer service, and answers ``{"input_tokens"}``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from aiohttp import web

from services.common.errors import TandemError
from services.common.pb import tokenizer_pb2
from services.gateway.client_limits import check_request_rate, client_id, read_body_in_budget
from services.gateway.completions import chat_template_input, serve_front
from services.gateway.front import Front
from services.gateway.http_errors import INTERNAL_ERROR_MESSAGE
from services.gateway.messages_renderer import MessagesRenderer, new_message_id
from services.gateway.messages_request import (
    MessagesRequest,
    messages_param,
    parse_messages_request,
)
from services.gateway.openai_requests import ChatRequest
from services.gateway.renderers import ChatRenderer
from services.gateway.request_log import RequestRecord
from services.gateway.sse import SSEWriter
from services.gateway.state import STATE_KEY, GatewayState

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "invalid_request_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


def anthropic_error(err: TandemError) -> dict[str, object]:
    """``{"type": "error", "error": {"type", "message"}}`` for ``err``."""
    kind = _ERROR_TYPES.get(err.http_status, "api_error")
    param = messages_param(err.param)
    message = err.message
    if err.http_status == 401 and err.code is None:  # no key at all: say where Anthropic's goes
        message = "x-api-key header is required (or Authorization: Bearer <key>)."
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_authorization(request: web.Request) -> str | None:
    """``x-api-key`` as a bearer token, else the ``Authorization`` header."""
    key = request.headers.get("x-api-key")
    return f"Bearer {key}" if key else request.headers.get("Authorization")


def anthropic_error_response(err: TandemError) -> web.Response:
    headers = {}
    retry_after = getattr(err, "retry_after", None)
    if isinstance(retry_after, (int, float)):
        headers["Retry-After"] = str(max(1, int(retry_after + 0.999)))
    return web.json_response(anthropic_error(err), status=err.http_status, headers=headers)


class MessagesFront(Front):
    """``POST /v1/messages`` over the chat flow, for one request."""

    endpoint = "messages"
    input_param = "messages"

    def __init__(self, record: RequestRecord, state: GatewayState) -> None:
        self._record = record
        self._state = state
        self._request: MessagesRequest | None = None

    def authorization(self, request: web.Request) -> str | None:
        return anthropic_authorization(request)

    def parse(self, body: object, served_models: Sequence[str]) -> ChatRequest:
        self._request = parse_messages_request(body, served_models=served_models)
        return self._request.chat

    def renderer(
        self, chat: ChatRenderer, request: ChatRequest, prompt_tokens: int
    ) -> MessagesRenderer:
        stops = self._request.stop_sequences if self._request is not None else ()
        return MessagesRenderer(chat=chat, message_id=self._record.request_id,
                                model=request.model, prompt_tokens=prompt_tokens,
                                stop_sequences=stops, model_info=self._state.model_info)  # fmt: skip

    def json_error(self, err: TandemError) -> web.StreamResponse:
        return anthropic_error_response(err)

    async def stream_error(self, writer: SSEWriter, err: TandemError) -> None:
        await writer.send_json(anthropic_error(err), event="error")


async def create_message(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages``."""
    state = request.app[STATE_KEY]
    record = RequestRecord(new_message_id(), "messages")
    return await serve_front(request, record, MessagesFront(record, state))


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: the prompt's length as a reply would see it."""
    state = request.app[STATE_KEY]
    try:
        with contextlib.ExitStack() as held:
            api_key = state.auth.check(anthropic_authorization(request))
            client = client_id(api_key, request)
            check_request_rate(state, client)
            info = await state.require_model_info()
            body = await read_body_in_budget(state, request, held, client)
            parsed = parse_messages_request(body, served_models=state.served_names,
                                            require_max_tokens=False)  # fmt: skip
            held.enter_context(state.admission.try_acquire(client))
            messages, tools_json = chat_template_input(parsed.chat, info.chat_template)
            call = tokenizer_pb2.TokenizeRequest(
                chat=tokenizer_pb2.ChatMessages(messages=messages), add_generation_prompt=True,
                tools_json=tools_json, context_length=1 << 30,
            )  # fmt: skip
            reply = await state.tokenizers.tokenize(call)
            return web.json_response({"input_tokens": len(reply.token_ids)})
    except TandemError as err:
        logger.info("%s %s -> %d %s", request.method, request.path, err.http_status, err.message)
        return anthropic_error_response(err)
    except ConnectionError:
        raise
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return anthropic_error_response(TandemError(INTERNAL_ERROR_MESSAGE))
