"""Chat and text completions differ only in how choices are written on the wire; this module
holds that difference, so one request flow (``completions.py``) serves both endpoints.

A :class:`Renderer` turns :class:`~services.gateway.choice.ChoiceEvent` values into OpenAI
chunks (streaming) or accumulates them into the final object (non-streaming), using the
builders of ``openai_responses``. It keeps per-choice state: chat sends the ``role`` delta once,
completions continue ``text_offset`` across chunks and may echo the prompt first.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.gateway.choice import ChoiceEvent
from services.gateway.prompt_logprobs import PromptLogprob, echo_logprobs, vllm_prompt_logprobs
from services.gateway.reasoning import ReasoningSplitter, split_reasoning
from services.gateway.tool_calls import (
    CallDelta,
    StreamDelta,
    Tool,
    new_parser,
    parse_calls,
)
from services.gateway.openai_responses import (
    ChatChoice,
    CompletionChoice,
    JsonDict,
    TokenLogprob,
    chat_completion_chunk,
    chat_completion_response,
    chat_logprobs,
    chat_usage_chunk,
    completion_chunk,
    completion_logprobs,
    completion_response,
    completion_usage_chunk,
)


@dataclass(slots=True)
class _Accumulated:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None  # prompt_logprobs.py
    # completions: text_offset of the next token = echo length + the tokens' text so far. Counted
    # from the tokens, not from the streamed text: the safety hold-back releases text and tokens
    # in different chunks.
    offset: int = 0


class Renderer(ABC):
    """Writes one request's choices in one endpoint's format."""

    def __init__(self, *, request_id: str, model: str, n: int, logprobs: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self._choices = [_Accumulated() for _ in range(n)]

    def add(self, event: ChoiceEvent) -> None:
        """Accumulate an event for the non-streamed response."""
        acc = self._choices[event.index]
        acc.text += event.text
        acc.logprobs.extend(event.logprobs)
        if event.finish_reason is not None:
            acc.finish_reason = event.finish_reason
        if event.prompt_logprobs is not None:
            acc.prompt_logprobs = event.prompt_logprobs

    @abstractmethod
    def start_chunks(self) -> list[JsonDict]:
        """Chunks sent when the stream opens (one per choice, or none)."""

    @abstractmethod
    def event_chunks(self, event: ChoiceEvent) -> list[JsonDict]:
        """Chunks for one event: its text (with logprobs), then its finish reason if any."""

    @abstractmethod
    def usage_chunk(self, usage: Mapping[str, object]) -> JsonDict:
        """The trailing usage-only chunk (``stream_options.include_usage``)."""

    @abstractmethod
    def response(self, usage: Mapping[str, object]) -> JsonDict:
        """The non-streamed response object from everything :meth:`add` saw."""


_CUT = ("length", "content_filter")  # replies that end where they were cut, not where they chose


class ChatRenderer(Renderer):
    """``chat.completion`` / ``chat.completion.chunk``; with ``tool_format`` (tools active), the
    model's tool-call text becomes ``tool_calls`` and such a choice finishes with
    ``"tool_calls"`` (a reply cut by ``max_tokens`` keeps its complete calls and ``"length"``).
    Streamed as vLLM streams them: a call's id and name in one delta, then its arguments in
    fragments as the model writes them (``tool_parsers/base.py``)."""

    def __init__(self, *, request_id: str, model: str, n: int, logprobs: bool,
                 tool_format: str | None = None, reasoning: str | None = None,
                 tools: Sequence[Tool] = ()) -> None:  # fmt: skip
        super().__init__(request_id=request_id, model=model, n=n, logprobs=logprobs)
        self.tool_format = tool_format
        self.tools = tuple(tools)
        self.reasoning = reasoning if reasoning != "none" else None
        self._parsers = [new_parser(tool_format, tools) for _ in range(n)] if tool_format else []
        self._thinking = [ReasoningSplitter(self.reasoning) for _ in range(n)] if self.reasoning else []

    def _chunk(self, index: int, **fields: Any) -> JsonDict:
        return chat_completion_chunk(
            request_id=self.request_id, model=self.model, created=self.created, index=index,
            **fields,
        )  # fmt: skip

    def start_chunks(self) -> list[JsonDict]:
        return [self._chunk(i, role="assistant", content="") for i in range(len(self._choices))]

    def event_chunks(self, event: ChoiceEvent) -> list[JsonDict]:
        chunks: list[JsonDict] = []
        text = event.text
        if self._thinking:  # reasoning first; the tool parser sees the answer only
            splitter = self._thinking[event.index]
            thought, text = splitter.feed(text)
            if event.finish_reason is not None:
                more_thought, more_text = splitter.finish()
                thought, text = thought + more_thought, text + more_text
            if thought:
                chunks.append(self._chunk(event.index, reasoning_content=thought))
        calls: list[CallDelta] = []
        if self._parsers:
            parser = self._parsers[event.index]
            delta = parser.feed(text)
            if event.finish_reason is not None:
                rest = parser.finish(truncated=event.finish_reason in _CUT)
                delta = StreamDelta(delta.content + rest.content, delta.calls + rest.calls)
            text, calls = delta.content, delta.calls
        if text or event.logprobs:
            lp = chat_logprobs(event.logprobs) if self.logprobs else None
            chunks.append(self._chunk(event.index, content=text, logprobs=lp))
        chunks += [self._chunk(event.index, tool_calls=[_call_delta(c)]) for c in calls]
        if event.finish_reason is not None:
            reason = event.finish_reason
            if self._parsers and self._parsers[event.index].calls and reason == "stop":
                reason = "tool_calls"
            chunks.append(self._chunk(event.index, finish_reason=reason))
        return chunks

    def usage_chunk(self, usage: Mapping[str, object]) -> JsonDict:
        return chat_usage_chunk(
            request_id=self.request_id, model=self.model, created=self.created, usage=usage
        )

    def response(self, usage: Mapping[str, object]) -> JsonDict:
        choices = []
        for i, acc in enumerate(self._choices):
            text, calls, thought = acc.text, [], None
            if self.reasoning:
                thought, text = split_reasoning(text, self.reasoning)
            reason = acc.finish_reason or "stop"
            if self.tool_format:
                text, calls = parse_calls(text, self.tool_format, self.tools,
                                          truncated=reason in _CUT)  # fmt: skip
            choices.append(ChatChoice(
                index=i, text=text,
                finish_reason="tool_calls" if calls and reason == "stop" else reason,
                logprobs=chat_logprobs(acc.logprobs) if self.logprobs else None,
                tool_calls=[c.to_openai() for c in calls],
                reasoning=thought,
            ))  # fmt: skip
        body = chat_completion_response(
            request_id=self.request_id,
            model=self.model,
            created=self.created,
            choices=choices,
            usage=usage,
        )
        scored = self._choices[0].prompt_logprobs if self._choices else None
        if scored is not None:  # vLLM's place on chat: the response's top level
            body["prompt_logprobs"] = vllm_prompt_logprobs(scored)
        return body


def _call_delta(call: CallDelta) -> JsonDict:
    """One ``delta.tool_calls`` entry: the head (id, type, name, empty arguments) or a
    fragment of the arguments."""
    if call.id is not None:
        return {"index": call.index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
    return {"index": call.index, "function": {"arguments": call.arguments}}


class CompletionRenderer(Renderer):
    """``text_completion`` (streamed and not), with optional prompt echo."""

    def __init__(
        self, *, request_id: str, model: str, n: int, logprobs: bool, echo_text: str | None
    ) -> None:
        super().__init__(request_id=request_id, model=model, n=n, logprobs=logprobs)
        self.echo_text = echo_text

    def _chunk(self, index: int, **fields: Any) -> JsonDict:
        return completion_chunk(
            request_id=self.request_id, model=self.model, created=self.created, index=index,
            **fields,
        )  # fmt: skip

    def start_chunks(self) -> list[JsonDict]:
        if not self.echo_text:
            return []
        for acc in self._choices:
            acc.offset = len(self.echo_text)
        return [self._chunk(i, text=self.echo_text) for i in range(len(self._choices))]

    def event_chunks(self, event: ChoiceEvent) -> list[JsonDict]:
        acc = self._choices[event.index]
        chunks: list[JsonDict] = []
        if event.text or event.logprobs:
            lp = None
            if self.logprobs:
                lp = completion_logprobs(event.logprobs, text_offset_start=acc.offset)
            acc.offset += sum(len(t.token) for t in event.logprobs)
            chunks.append(self._chunk(event.index, text=event.text, logprobs=lp))
        if event.finish_reason is not None:
            chunks.append(self._chunk(event.index, finish_reason=event.finish_reason))
        return chunks

    def usage_chunk(self, usage: Mapping[str, object]) -> JsonDict:
        return completion_usage_chunk(
            request_id=self.request_id, model=self.model, created=self.created, usage=usage
        )

    def response(self, usage: Mapping[str, object]) -> JsonDict:
        prefix = self.echo_text or ""
        choices = [
            CompletionChoice(
                index=i,
                text=prefix + acc.text,
                finish_reason=acc.finish_reason or "stop",
                logprobs=self._logprobs(acc, prefix),
            )
            for i, acc in enumerate(self._choices)
        ]
        body = completion_response(
            request_id=self.request_id,
            model=self.model,
            created=self.created,
            choices=choices,
            usage=usage,
        )
        for choice, acc in zip(body["choices"], self._choices):  # type: ignore[call-overload]
            if acc.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(acc.prompt_logprobs)
        return body

    def _logprobs(self, acc: _Accumulated, prefix: str) -> JsonDict | None:
        """The choice's ``logprobs``: the completion's, after the prompt's when echoed."""
        if not self.logprobs:
            return None
        if prefix and acc.prompt_logprobs is not None:
            return echo_logprobs(acc.prompt_logprobs, acc.logprobs, len(prefix))
        return completion_logprobs(acc.logprobs, text_offset_start=len(prefix))
