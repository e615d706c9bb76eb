"""An API front: another wire format served by the one chat-completions request flow.

OpenAI's Responses API (``responses_api.py``) and Anthropic's Messages API (``messages_api.py``)
are thin fronts over ``POST /v1/chat/completions``: each maps its request onto the internal
:class:`~services.gateway.openai_requests.ChatRequest` and turns the same
:class:`~services.gateway.choice.ChoiceEvent` values back into its own JSON and SSE events. The
flow itself (``completions._serve``: auth, rate limit, body budget, safety, admission, tokenize,
run, cleanup) is shared; a :class:`Front` plugs in what differs:

1. where the API key comes from (:meth:`Front.authorization`; Anthropic's ``x-api-key``);
2. the request parser (:meth:`Front.parse`), run once the body is read;
3. the renderer (:meth:`Front.renderer`), built around the chat renderer the flow prepared, so
   tool-call and reasoning parsing stay the chat path's own;
4. the SSE framing: typed ``event:`` lines, and no ``data: [DONE]`` at the end;
5. the error shape (:meth:`Front.error_response`), before and after the stream started.

A front is built per request (it may keep what its parser learnt for its renderer).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from aiohttp import web

from services.common.errors import TandemError
from services.gateway.http_errors import error_response
from services.gateway.openai_requests import ChatRequest
from services.gateway.openai_responses import JsonDict
from services.gateway.renderers import ChatRenderer, Renderer
from services.gateway.sse import SSEWriter, current_writer

logger = logging.getLogger(__name__)


class FrontRenderer(Renderer):
    """A renderer whose stream ends with the API's own closing events, usage among them."""

    def end_chunks(self, usage: Mapping[str, object]) -> list[JsonDict]:
        """The events after the last choice event (one, :meth:`usage_chunk`, by default)."""
        return [self.usage_chunk(usage)]


class Front(ABC):
    """One API surface over the chat flow (see the module docstring)."""

    endpoint: str = "chat"
    """The request log's ``endpoint`` field."""
    input_param: str = "messages"
    """The field an input safety block names."""

    def authorization(self, request: web.Request) -> str | None:
        """The ``Authorization`` header value the gateway's API keys are checked against."""
        return request.headers.get("Authorization")

    @abstractmethod
    def parse(self, body: object, served_models: Sequence[str]) -> ChatRequest:
        """The request as the chat flow's; InvalidArgumentError (400) / NotFoundError (404)."""

    @abstractmethod
    def renderer(
        self, chat: ChatRenderer, request: ChatRequest, prompt_tokens: int
    ) -> FrontRenderer:
        """This API's renderer, around the chat renderer the flow built for ``request`` (whose
        prompt is ``prompt_tokens`` long)."""

    def event_name(self, chunk: Mapping[str, object]) -> str | None:
        """The SSE ``event:`` name of a streamed chunk (its ``type``)."""
        kind = chunk.get("type")
        return kind if isinstance(kind, str) else None

    def rename(self, err: TandemError) -> TandemError:
        """``err`` with its ``param`` named as this API names the field (the chat flow's names
        by default)."""
        return err

    async def error_response(self, request: web.Request, err: TandemError) -> web.StreamResponse:
        """The answer for ``err``: a JSON error before the stream started, else an error event
        on it. The default is OpenAI's shape, as the error middleware writes it."""
        err = self.rename(err)
        level = logging.ERROR if err.http_status >= 500 else logging.INFO
        logger.log(level, "%s %s -> %d %s", request.method, request.path, err.http_status,
                   err.message)  # fmt: skip
        writer = current_writer(request)
        if writer is None or not writer.prepared:
            return self.json_error(err)
        try:
            await self.stream_error(writer, err)
        except ConnectionError:
            logger.debug("client gone before the stream error could be sent")
        return writer.response

    def json_error(self, err: TandemError) -> web.StreamResponse:
        """A JSON error response (OpenAI's shape by default)."""
        return error_response(err)

    async def stream_error(self, writer: SSEWriter, err: TandemError) -> None:
        """An error event after the 200 went out (OpenAI's ``error`` event by default)."""
        await writer.send_json({"type": "error", **err.to_openai()}, event="error")
