"""The Responses API's output: one ``response`` object, or its typed SSE events, from the chat
renderer's output (``chat_deltas.py``).

Output items, in the order the reply produced them: ``reasoning`` (``--reasoning-parser``'s
thinking, as ``reasoning_text`` content), ``message`` (one ``output_text`` part) and
``function_call`` (``call_id``, ``name``, ``arguments``). A stream, as OpenAI sends it (every
event with its ``type`` and a ``sequence_number`` counting from 0):

1. ``response.created``, ``response.in_progress`` (the response, ``in_progress``, no output);
2. per item: ``response.output_item.added``; for a message or reasoning item
   ``response.content_part.added``, ``response.output_text.delta`` (``reasoning_text.delta``)
   ..., ``response.output_text.done``, ``response.content_part.done``; for a call
   ``response.function_call_arguments.delta`` ..., ``response.function_call_arguments.done``;
   then ``response.output_item.done`` with the whole item;
3. ``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` (or the
   content filter) cut the reply (``incomplete_details.reason``), with the usage; a failure
   after the stream started ends it with ``response.failed`` instead.

The finished response (and the conversation through it) goes to ``on_done`` once, which stores
it when the request asked to.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from services.common.errors import TandemError
from services.gateway.chat_deltas import Step, chunk_steps, response_steps
from services.gateway.choice import ChoiceEvent
from services.gateway.front import FrontRenderer
from services.gateway.openai_responses import JsonDict
from services.gateway.renderers import ChatRenderer

_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
OnDone = Callable[[JsonDict, JsonDict], None]
"""Called with the finished response and the assistant turn it adds to the conversation."""


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def responses_usage(usage: Mapping[str, Any]) -> JsonDict:
    """Chat usage as the Responses API reports it."""
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


class ResponsesRenderer(FrontRenderer):
    """One response (the fronts serve one choice), from the chat renderer's output."""

    def __init__(
        self, *, chat: ChatRenderer, response_id: str, model: str, echo: Mapping[str, Any],
        on_done: OnDone,
    ) -> None:  # fmt: skip
        super().__init__(request_id=response_id, model=model, n=1, logprobs=False)
        self._chat = chat
        self._echo = dict(echo)
        self._on_done = on_done
        self._seq = 0
        self._output: list[JsonDict] = []
        self._open: JsonDict | None = None  # the item being written
        self._text = ""  # the open item's text (a message's or reasoning's)
        self._finish: str | None = None
        self._final: JsonDict | None = None

    # ---- the response object ---------------------------------------------------------------
    def _object(self, status: str, usage: JsonDict | None = None) -> JsonDict:
        incomplete = _INCOMPLETE.get(self._finish or "") if status == "incomplete" else None
        return {
            "id": self.request_id, "object": "response", "created_at": self.created,
            "status": status, "background": False, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model, "output": copy.deepcopy(self._output),
            "reasoning": {"effort": None, "summary": None}, "usage": usage, **self._echo,
        }  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> JsonDict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    # ---- the Renderer interface ------------------------------------------------------------
    def add(self, event: ChoiceEvent) -> None:
        self._chat.add(event)

    def start_chunks(self) -> list[JsonDict]:
        return [self._event("response.created", response=self._object("in_progress")),
                self._event("response.in_progress", response=self._object("in_progress"))]  # fmt: skip

    def event_chunks(self, event: ChoiceEvent) -> list[JsonDict]:
        out: list[JsonDict] = []
        for chunk in self._chat.event_chunks(event):
            for step in chunk_steps(chunk):
                out += self._step(step)
        return out

    def usage_chunk(self, usage: Mapping[str, object]) -> JsonDict:
        final = self._finished(usage)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return self._event(kind, response=final)

    def end_chunks(self, usage: Mapping[str, object]) -> list[JsonDict]:
        return [*self._close(), self.usage_chunk(usage)]

    def response(self, usage: Mapping[str, object]) -> JsonDict:
        for step in response_steps(self._chat.response(usage)):
            self._step(step)
        return self._finished(usage)

    def failed_chunk(self, err: TandemError) -> JsonDict:
        """``response.failed`` for an error after the stream started."""
        self._close()
        failed = self._object("failed")
        code = "server_error" if err.http_status >= 500 else (err.code or err.error_type)
        failed["error"] = {"code": code, "message": err.message}
        return self._event("response.failed", response=failed)

    # ---- items -----------------------------------------------------------------------------
    def _finished(self, usage: Mapping[str, object]) -> JsonDict:
        if self._final is None:
            self._close()
            status = "incomplete" if self._finish in _INCOMPLETE else "completed"
            self._final = self._object(status, responses_usage(usage))
            self._on_done(self._final, self._assistant_turn())
        return self._final

    def _assistant_turn(self) -> JsonDict:
        """What this reply adds to the conversation, as a chat message."""
        text = "".join(p["text"] for item in self._output if item["type"] == "message"
                       for p in item["content"])  # fmt: skip
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self._output if item["type"] == "function_call"]  # fmt: skip
        turn: JsonDict = {"role": "assistant", "content": text}
        if calls:
            turn["tool_calls"] = calls
        return turn

    def _step(self, step: Step) -> list[JsonDict]:
        if step.kind in ("reasoning", "text"):
            kind = "reasoning" if step.kind == "reasoning" else "message"
            out = [] if self._open is not None and self._open["type"] == kind else self._begin(kind)
            self._text += step.text
            delta = "response.reasoning_text.delta" if kind == "reasoning" else \
                "response.output_text.delta"  # fmt: skip
            extra = {} if kind == "reasoning" else {"logprobs": []}
            return out + [self._event(delta, **self._where(), content_index=0, delta=step.text,
                                      **extra)]  # fmt: skip
        if step.kind == "call":
            out = self._begin("function_call", call_id=step.call_id, name=step.name)
            return out + self._arguments(step.text)
        if step.kind == "arguments":
            return self._arguments(step.text)
        self._finish = step.text
        if not self._output:  # an empty reply is still a message, as OpenAI's
            return self._begin("message") + self._close()
        return self._close()

    def _where(self) -> JsonDict:
        """The open item's id and index (the open item is always the last one)."""
        item = self._open if self._open is not None else self._output[-1]
        return {"item_id": item["id"], "output_index": len(self._output) - 1}

    def _begin(self, kind: str, **call: str) -> list[JsonDict]:
        out = self._close()
        item: JsonDict
        if kind == "message":
            item = {"id": _item_id("msg"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}  # fmt: skip
        elif kind == "reasoning":
            item = {"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}  # fmt: skip
        else:
            item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call["call_id"], "name": call["name"], "arguments": ""}  # fmt: skip
        self._open, self._text = item, ""
        self._output.append(item)
        out.append(self._event("response.output_item.added", output_index=len(self._output) - 1,
                               item=copy.deepcopy(item)))  # fmt: skip
        if kind != "function_call":
            out.append(self._event("response.content_part.added", **self._where(),
                                   content_index=0, part=self._part(kind, "")))  # fmt: skip
        return out

    def _arguments(self, text: str) -> list[JsonDict]:
        if not text or self._open is None or self._open["type"] != "function_call":
            return []
        self._open["arguments"] += text
        return [self._event("response.function_call_arguments.delta", **self._where(),
                            delta=text)]  # fmt: skip

    @staticmethod
    def _part(kind: str, text: str) -> JsonDict:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _close(self) -> list[JsonDict]:
        """Finish the open item: its ``.done`` events, then ``response.output_item.done``."""
        item = self._open
        if item is None:
            return []
        where = self._where()
        status = "incomplete" if self._finish in _INCOMPLETE else "completed"
        out: list[JsonDict] = []
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", **where,
                                   name=item["name"], arguments=item["arguments"]))  # fmt: skip
        else:
            kind = item["type"]
            part = self._part(kind, self._text)
            done = "response.reasoning_text.done" if kind == "reasoning" else \
                "response.output_text.done"  # fmt: skip
            extra = {} if kind == "reasoning" else {"logprobs": []}
            out.append(self._event(done, **where, content_index=0, text=self._text, **extra))
            out.append(self._event("response.content_part.done", **where, content_index=0,
                                   part=part))  # fmt: skip
            item["content"] = [part]
        item["status"] = status
        out.append(self._event("response.output_item.done", output_index=where["output_index"],
                               item=copy.deepcopy(item)))  # fmt: skip
        self._open, self._text = None, ""
        return out
