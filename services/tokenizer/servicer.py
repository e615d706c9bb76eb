"""The ``tandem.v1.Tokenizer`` gRPC servicer: templating, encoding with context fitting,
streaming detokenization and the model's tokenizer facts, over one loaded :class:`Tokenizer`.

The servicer is a thin adapter: the policies live in the library (``chat_template.py``,
``context_window.py``, ``detokenizer.py``) and errors are raised as typed
:class:`~services.common.errors.TandemError` s, which the server's error interceptor turns into
gRPC status codes (INVALID_ARGUMENT for everything a caller can get wrong here).

Tokenize (docs/request-lifecycle.md, step 3):
  1. Take the raw ``text`` (encoded with ``add_special_tokens`` as asked) or render the ``chat``
     messages with the model's chat template (``add_generation_prompt`` as asked, ``tools_json``
     as ``tools`` and ``chat_template_kwargs_json`` as more variables; the template writes its
     own special tokens, so none are added on encoding).
  2. Fit the context: ``context_length`` 0 means the model's. ``max_tokens`` 0 is read as 1 (the
     prompt must leave room for at least one generated token). With ``truncate`` on a chat, the
     sliding window of :func:`~services.tokenizer.context_window.fit_chat` drops the oldest whole
     turns and reports ``dropped_messages``; otherwise (and for raw text, which is never altered)
     a prompt that does not fit is INVALID_ARGUMENT naming the context length.
  3. When neither the request nor the model knows a context length, nothing is checked.
  Encoding runs in a worker thread so that long prompts never stall the streams of others.

Detokenize (one bidirectional stream per generated sequence):
  1. The first message must be a ``config``; it builds an
     :class:`~services.tokenizer.detokenizer.IncrementalDetokenizer` (stop strings,
     ``skip_special_tokens``, prompt ids for context). Anything else first is INVALID_ARGUMENT,
     and so is a second config.
  2. Each ``ids`` message is answered with exactly one response holding the text that became
     final (possibly empty: half a UTF-8 character or the start of a stop string is held back).
  3. When a stop string completes, the response carries ``stopped`` and ``stop_string`` (its text
     ends before the stop string) and the server ends the stream.
  4. When the client half-closes first, one last response flushes the held-back text.

GetModelInfo answers from the loaded tokenizer; ``model_fingerprint`` is whatever the caller
computed at start-up (see ``main.py``), empty when unknown.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc.aio

from services.common.errors import InvalidArgumentError
from services.common.protocol import PROTOCOL_VERSION
from services.common.pb import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.context_window import fit_chat, fit_prompt
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
"""``"tandem.v1.Tokenizer"``: the name health checks and reflection use."""


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Serves one model's tokenizer (see the module docstring for each RPC's contract).

    Args:
        tokenizer: the loaded tokenizer.
        model_fingerprint: the model-shape hash reported by GetModelInfo ("" when unknown).
        served_name: the name reported by GetModelInfo; the tokenizer's model name by default.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        model_fingerprint: str = "",
        served_name: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._fingerprint = model_fingerprint
        self._name = served_name or tokenizer.name

    # ------------------------------------------------------------------------------ Tokenize

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        return await asyncio.to_thread(self.tokenize, request)

    def tokenize(self, request: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        """The synchronous body of Tokenize (also handy in-process)."""
        kind = request.WhichOneof("input")
        context_length = request.context_length or self._tokenizer.context_length or 0
        max_tokens = max(int(request.max_tokens), 1)
        if kind == "text":
            ids = self._tokenizer.encode(
                request.text, add_special_tokens=request.add_special_tokens
            )
            if context_length:
                fit_prompt(ids, max_tokens=max_tokens, context_length=context_length)
            elif not ids:
                raise InvalidArgumentError(
                    "the prompt must contain at least one token", param="prompt"
                )
            return tokenizer_pb2.TokenizeResponse(token_ids=ids, prompt_text=request.text)
        if kind == "chat":
            messages = [_message_dict(m) for m in request.chat.messages]
            return self._tokenize_chat(
                messages,
                tools=_tools(request.tools_json),
                template_kwargs=_template_kwargs(request.chat_template_kwargs_json),
                add_generation_prompt=request.add_generation_prompt,
                max_tokens=max_tokens,
                context_length=context_length,
                truncate=request.truncate,
            )
        raise InvalidArgumentError("a TokenizeRequest needs text or chat", param="input")

    def _tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[Any] | None,
        add_generation_prompt: bool,
        max_tokens: int,
        context_length: int,
        truncate: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tokenizer_pb2.TokenizeResponse:
        encoder = _RecordingChatEncoder(self._tokenizer, add_generation_prompt, tools,
                                        template_kwargs)  # fmt: skip
        if truncate and context_length:
            fitted = fit_chat(
                encoder, messages, max_tokens=max_tokens, context_length=context_length
            )
            return tokenizer_pb2.TokenizeResponse(
                token_ids=fitted.token_ids,
                dropped_messages=fitted.dropped_messages,
                prompt_text=encoder.text_of(fitted.token_ids),
            )
        ids = encoder.encode_chat(messages)
        if context_length:
            try:
                fit_prompt(ids, max_tokens=max_tokens, context_length=context_length)
            except InvalidArgumentError as err:
                param = "messages" if err.param == "prompt" else err.param
                raise InvalidArgumentError(err.message, param=param, code=err.code) from None
        return tokenizer_pb2.TokenizeResponse(token_ids=ids, prompt_text=encoder.text_of(ids))

    # ------------------------------------------------------------------------------ Detokenize

    async def Detokenize(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        detokenizer: IncrementalDetokenizer | None = None
        async for request in request_iterator:
            kind = request.WhichOneof("kind")
            if detokenizer is None:
                if kind != "config":
                    raise InvalidArgumentError(
                        "the first Detokenize message must be a config", param="config"
                    )
                detokenizer = self._new_detokenizer(request.config)
                continue
            if kind != "ids":
                raise InvalidArgumentError(
                    "a Detokenize stream takes one config, first, then token ids only",
                    param="config",
                )
            delta = detokenizer.push(list(request.ids.token_ids))
            if delta.stopped:
                yield tokenizer_pb2.DetokenizeResponse(
                    text=delta.text, stopped=True, stop_string=delta.stop_string or ""
                )
                return
            yield tokenizer_pb2.DetokenizeResponse(text=delta.text)
        if detokenizer is None:
            return  # the client closed without sending anything: nothing to answer
        text = detokenizer.flush()
        yield tokenizer_pb2.DetokenizeResponse(
            text=text,
            stopped=detokenizer.stopped,
            stop_string=detokenizer.stop_string or "",
        )

    def _new_detokenizer(self, config: tokenizer_pb2.DetokenizeConfig) -> IncrementalDetokenizer:
        prompt_ids = list(config.prompt_token_ids)
        vocab = self._tokenizer.vocab_size
        bad = next((i for i in prompt_ids if i >= vocab), None)
        if bad is not None:
            raise InvalidArgumentError(
                f"prompt token id {bad} is outside the vocabulary [0, {vocab})",
                param="prompt_token_ids",
            )
        return IncrementalDetokenizer(
            self._tokenizer,
            skip_special_tokens=config.skip_special_tokens,
            stop=list(config.stop),
            prompt_token_ids=prompt_ids,
        )

    # ------------------------------------------------------------------------------ GetModelInfo

    async def GetModelInfo(
        self, request: tokenizer_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.ModelInfo:
        return self.model_info()

    def model_info(self) -> tokenizer_pb2.ModelInfo:
        """The ModelInfo message for the loaded tokenizer."""
        tok = self._tokenizer
        info = tokenizer_pb2.ModelInfo(
            name=self._name,
            vocab_size=tok.vocab_size,
            eos_token_ids=list(tok.eos_token_ids),
            special_tokens=dict(tok.special_tokens),
            context_length=tok.context_length or 0,
            chat_template=tok.chat_template or "",
            model_fingerprint=self._fingerprint,
            protocol_version=PROTOCOL_VERSION,
        )
        if tok.bos_token_id is not None:
            info.bos_token_id = tok.bos_token_id
        if tok.pad_token_id is not None:
            info.pad_token_id = tok.pad_token_id
        return info


class _RecordingChatEncoder:
    """A :class:`~services.tokenizer.context_window.ChatEncoder` that applies the request's
    ``add_generation_prompt`` and remembers the text behind each encoding, so the prompt text
    that survived truncation can be returned with its ids."""

    __slots__ = ("_tokenizer", "_add_generation_prompt", "_tools", "_kwargs", "_texts")

    def __init__(self, tokenizer: Tokenizer, add_generation_prompt: bool,
                 tools: list[Any] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> None:  # fmt: skip
        self._tokenizer = tokenizer
        self._add_generation_prompt = add_generation_prompt
        self._tools = tools
        self._kwargs = dict(template_kwargs or {})
        self._texts: dict[tuple[int, ...], str] = {}

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Render and encode ``messages``; the request's generation-prompt flag always wins."""
        extra = dict(self._kwargs)
        if self._tools:
            extra["tools"] = self._tools
        text = self._tokenizer.apply_chat_template(messages, self._add_generation_prompt, **extra)
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        self._texts[tuple(ids)] = text
        return ids

    def text_of(self, ids: Sequence[int]) -> str:
        """The rendered text that encoded to ``ids``."""
        return self._texts[tuple(ids)]


def _message_dict(message: common_pb2.ChatMessage) -> dict[str, Any]:
    """A chat message as templates see it (transformers' form): optional ``name`` and
    ``tool_call_id``, and an assistant turn's ``tool_calls`` with their arguments as objects."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
            for c in message.tool_calls
        ]  # fmt: skip
    return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _tools(tools_json: str) -> list[Any] | None:
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except ValueError as err:
        raise InvalidArgumentError(f"tools_json is not JSON: {err}", param="tools") from err
    if not isinstance(tools, list):
        raise InvalidArgumentError("tools_json must be a JSON array", param="tools")
    return tools


_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt")


def _template_kwargs(kwargs_json: str) -> dict[str, Any] | None:
    """The request's extra template variables (vLLM's ``chat_template_kwargs``); the variables
    the request sets itself cannot be overridden."""
    if not kwargs_json:
        return None
    try:
        kwargs = json.loads(kwargs_json)
    except ValueError as err:
        raise InvalidArgumentError(f"chat_template_kwargs is not JSON: {err}",
                                   param="chat_template_kwargs") from err  # fmt: skip
    if not isinstance(kwargs, dict):
        raise InvalidArgumentError("chat_template_kwargs must be a JSON object",
                                   param="chat_template_kwargs")  # fmt: skip
    taken = [key for key in _TEMPLATE_OWN if key in kwargs]
    if taken:
        raise InvalidArgumentError(f"chat_template_kwargs cannot set {taken[0]!r}",
                                   param="chat_template_kwargs")  # fmt: skip
    return kwargs
