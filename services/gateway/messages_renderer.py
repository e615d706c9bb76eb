"""Anthropic's Messages API output: one ``message`` object, or its SSE events, from the chat
renderer's output (``chat_deltas.py``).

Content blocks, in the order the reply produced them: ``thinking`` (``--reasoning-parser``'s
split), ``text`` and ``tool_use`` (``id`` ``toolu_...``, ``name``, ``input`` as an object). A
stream, as Anthropic sends it:

1. ``message_start`` (the message, no content, ``stop_reason`` null), then one ``ping``;
2. per block: ``content_block_start``, ``content_block_delta`` ... (``thinking_delta``,
   ``text_delta`` or ``input_json_delta``), ``content_block_stop``;
3. ``message_delta`` (``stop_reason``, ``stop_sequence``, usage), ``message_stop``.

``stop_reason``: ``tool_use`` when the reply called a tool, ``max_tokens`` when ``max_tokens``
cut it, ``refusal`` for the content filter, ``stop_sequence`` (with ``stop_sequence``) when one
of the request's stop sequences ended it, else ``end_turn``. The workers do not say which stop
string matched, so the request asks for logprobs when it has stop sequences: a reply that
stopped on anything but an end-of-turn token stopped on a stop sequence, the one found at the
end of the tokens' text (the first one given when the gateway renders tokens as ids).

Usage follows Anthropic's split: ``input_tokens`` are the prompt tokens not read from the prefix
cache, ``cache_read_input_tokens`` the ones that were.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from services.common.pb import tokenizer_pb2
from services.gateway.chat_deltas import Step, chunk_steps, response_steps
from services.gateway.choice import ChoiceEvent
from services.gateway.front import FrontRenderer
from services.gateway.openai_responses import JsonDict, TokenLogprob
from services.gateway.renderers import ChatRenderer

_STOP_REASONS = {"length": "max_tokens", "content_filter": "refusal"}
_TOKEN_ID = "token_id:"


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id(call_id: str) -> str:
    """The chat path's ``call_...`` id as Anthropic spells tool-use ids."""
    return "toolu_" + call_id.removeprefix("call_")


class MessagesRenderer(FrontRenderer):
    """One message (the fronts serve one choice), from the chat renderer's output."""

    def __init__(
        self, *, chat: ChatRenderer, message_id: str, model: str, prompt_tokens: int,
        stop_sequences: Sequence[str], model_info: tokenizer_pb2.ModelInfo | None,
    ) -> None:  # fmt: skip
        super().__init__(request_id=message_id, model=model, n=1, logprobs=False)
        self._chat = chat
        self._prompt_tokens = prompt_tokens
        self._stops = tuple(stop_sequences)
        self._eos = set(model_info.eos_token_ids) if model_info is not None else set()
        self._special = dict(model_info.special_tokens) if model_info is not None else {}
        self._tokens: list[TokenLogprob] = []
        self._blocks: list[JsonDict] = []
        self._open: JsonDict | None = None
        self._arguments = ""  # the open tool_use block's input, as JSON text
        self._finish: str | None = None

    # ---- the Renderer interface ------------------------------------------------------------
    def add(self, event: ChoiceEvent) -> None:
        self._tokens.extend(event.logprobs)
        self._chat.add(event)

    def start_chunks(self) -> list[JsonDict]:
        usage = {"input_tokens": self._prompt_tokens, "output_tokens": 0,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}  # fmt: skip
        message = {**self._message([], None, None), "usage": usage}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def event_chunks(self, event: ChoiceEvent) -> list[JsonDict]:
        self._tokens.extend(event.logprobs)
        out: list[JsonDict] = []
        for chunk in self._chat.event_chunks(event):
            for step in chunk_steps(chunk):
                out += self._step(step)
        return out

    def usage_chunk(self, usage: Mapping[str, object]) -> JsonDict:
        reason, sequence = self._stop_reason()
        return {"type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {**_usage(usage), "cache_creation_input_tokens": 0}}  # fmt: skip

    def end_chunks(self, usage: Mapping[str, object]) -> list[JsonDict]:
        return [*self._close(), self.usage_chunk(usage), {"type": "message_stop"}]

    def response(self, usage: Mapping[str, object]) -> JsonDict:
        for step in response_steps(self._chat.response(usage)):
            self._step(step)
        self._close()
        reason, sequence = self._stop_reason()
        return {**self._message(self._blocks, reason, sequence),
                "usage": {**_usage(usage), "cache_creation_input_tokens": 0}}

    def _message(
        self, content: list[JsonDict], reason: str | None, sequence: str | None
    ) -> JsonDict:
        return {"id": self.request_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content, "stop_reason": reason,
                "stop_sequence": sequence}  # fmt: skip

    # ---- blocks ----------------------------------------------------------------------------
    def _step(self, step: Step) -> list[JsonDict]:
        if step.kind in ("reasoning", "text"):
            kind = "thinking" if step.kind == "reasoning" else "text"
            out = [] if self._open is not None and self._open["type"] == kind else self._begin(
                {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                else {"type": "text", "text": ""})  # fmt: skip
            block = self._blocks[-1]
            block[kind] += step.text
            delta = {"type": f"{kind}_delta", kind: step.text}
            return out + [self._delta(delta)]
        if step.kind == "call":
            out = self._begin({"type": "tool_use", "id": tool_use_id(step.call_id),
                               "name": step.name, "input": {}})  # fmt: skip
            return out + self._input(step.text)
        if step.kind == "arguments":
            return self._input(step.text)
        self._finish = step.text
        return self._close()

    def _begin(self, block: JsonDict) -> list[JsonDict]:
        out = self._close()
        self._open, self._arguments = block, ""
        self._blocks.append(block)
        start = {"type": "content_block_start", "index": len(self._blocks) - 1,
                 "content_block": dict(block)}  # fmt: skip
        return [*out, start]

    def _delta(self, delta: JsonDict) -> JsonDict:
        return {"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta}

    def _input(self, text: str) -> list[JsonDict]:
        if not text or self._open is None or self._open["type"] != "tool_use":
            return []
        self._arguments += text
        return [self._delta({"type": "input_json_delta", "partial_json": text})]

    def _close(self) -> list[JsonDict]:
        block = self._open
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = _object(self._arguments)
        self._open = None
        return [{"type": "content_block_stop", "index": len(self._blocks) - 1}]

    # ---- why it stopped --------------------------------------------------------------------
    def _stop_reason(self) -> tuple[str, str | None]:
        if any(b["type"] == "tool_use" for b in self._blocks) and self._finish in (
                "stop", "tool_calls"):  # fmt: skip
            return "tool_use", None
        if self._finish in _STOP_REASONS:
            return _STOP_REASONS[self._finish], None
        if self._finish == "stop" and self._stops and self._tokens:
            if self._token_id(self._tokens[-1].token) not in self._eos:
                return "stop_sequence", self._matched_stop()
        return "end_turn", None

    def _token_id(self, text: str) -> int | None:
        if text.startswith(_TOKEN_ID) and text[len(_TOKEN_ID):].isdigit():
            return int(text[len(_TOKEN_ID):])
        return self._special.get(text)

    def _matched_stop(self) -> str:
        tail = "".join(t.token for t in self._tokens[-64:])
        found = [(tail.rfind(s) + len(s), s) for s in self._stops if s in tail]
        return max(found)[1] if found else self._stops[0]


def _object(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the ``input`` object (``{}`` when they are not one)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(usage: Mapping[str, Any]) -> JsonDict:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"] - cached,
            "output_tokens": usage["completion_tokens"], "cache_read_input_tokens": cached}
