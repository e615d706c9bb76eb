"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

``POST`` is a front (``front.py``) over the chat flow: the body is mapped onto a chat request
(``responses_request.py``), run as any chat completion is (auth, limits, safety, admission,
remote prefill, migration, cleanup on disconnect), and written back as a ``response`` object or
its typed SSE events (``responses_renderer.py``). Errors keep OpenAI's shape, naming the
Responses API's fields; one after the stream started is a ``response.failed`` event.

With ``store`` (true unless the body says false, as OpenAI's default is) the finished response
and its conversation are kept in the gateway's bounded store (``response_store.py``): ``GET``
returns it, ``DELETE`` forgets it, and a request naming it in ``previous_response_id`` continues
that conversation. A stored response is visible only to the API key that created it.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

from aiohttp import web

from services.common.errors import NotFoundError, TandemError
from services.gateway.client_limits import check_request_rate, client_id
from services.gateway.completions import serve_front
from services.gateway.front import Front
from services.gateway.openai_requests import ChatRequest
from services.gateway.openai_responses import JsonDict
from services.gateway.renderers import ChatRenderer
from services.gateway.request_log import RequestRecord
from services.gateway.response_store import RESPONSE_STORE_KEY, ResponseStore
from services.gateway.responses_renderer import ResponsesRenderer
from services.gateway.responses_request import (
    Message,
    ResponsesRequest,
    parse_responses_request,
    responses_param,
)
from services.gateway.sse import SSEWriter
from services.gateway.state import STATE_KEY


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


class ResponsesFront(Front):
    """``POST /v1/responses`` over the chat flow, for one request."""

    endpoint = "responses"
    input_param = "input"

    def __init__(self, store: ResponseStore, record: RequestRecord) -> None:
        self._store = store
        self._record = record  # its api_key is set (authenticated) before parse() runs
        self._request: ResponsesRequest | None = None
        self._renderer: ResponsesRenderer | None = None

    def parse(self, body: object, served_models: Sequence[str]) -> ChatRequest:
        self._request = parse_responses_request(body, served_models=served_models,
                                                history=self._history)  # fmt: skip
        return self._request.chat

    def _history(self, response_id: str) -> Sequence[Message] | None:
        entry = self._store.get(response_id, owner=self._record.api_key)
        return None if entry is None else [dict(m) for m in entry.conversation]

    def renderer(
        self, chat: ChatRenderer, request: ChatRequest, prompt_tokens: int
    ) -> ResponsesRenderer:
        parsed = self._request
        if parsed is None:  # the flow calls parse() first
            raise RuntimeError("renderer() before parse()")
        self._renderer = ResponsesRenderer(chat=chat, response_id=self._record.request_id,
                                           model=request.model, echo=parsed.echo,
                                           on_done=self._done)  # fmt: skip
        return self._renderer

    def _done(self, response: JsonDict, turn: JsonDict) -> None:
        parsed = self._request
        if parsed is not None and parsed.store:
            self._store.put(self._record.request_id, response, [*parsed.conversation, turn],
                            owner=self._record.api_key)  # fmt: skip

    def rename(self, err: TandemError) -> TandemError:
        old, err.param = err.param, responses_param(err.param)
        if old and err.param and old != err.param:
            err.message = err.message.replace(f"'{old}'", f"'{err.param}'")
        return err

    async def stream_error(self, writer: SSEWriter, err: TandemError) -> None:
        if self._renderer is None:
            await super().stream_error(writer, err)
            return
        event = self._renderer.failed_chunk(err)
        await writer.send_json(event, event=str(event["type"]))


async def create_response(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``."""
    record = RequestRecord(new_response_id(), "responses")
    return await serve_front(request, record, ResponsesFront(request.app[RESPONSE_STORE_KEY],
                                                             record))  # fmt: skip


def _owner(request: web.Request) -> str:
    """Authenticate (401) and count the request against its client's rate limit (429)."""
    state = request.app[STATE_KEY]
    api_key = state.auth.check(request.headers.get("Authorization"))
    check_request_rate(state, client_id(api_key, request))
    return api_key


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id",
                         code="response_not_found")  # fmt: skip


async def get_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{response_id}``: a stored response, as it was returned."""
    response_id = request.match_info["response_id"]
    entry = request.app[RESPONSE_STORE_KEY].get(response_id, owner=_owner(request))
    if entry is None:
        raise _not_found(response_id)
    return web.json_response(entry.response)


async def delete_response(request: web.Request) -> web.Response:
    """``DELETE /v1/responses/{response_id}``: forget a stored response."""
    response_id = request.match_info["response_id"]
    if not request.app[RESPONSE_STORE_KEY].delete(response_id, owner=_owner(request)):
        raise _not_found(response_id)
    body: Mapping[str, object] = {"id": response_id, "object": "response", "deleted": True}
    return web.json_response(body)
