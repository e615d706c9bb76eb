"""The OpenAI wire format, outbound: response, chunk, usage and logprob builders.

Responses are plain ``dict`` objects with OpenAI's exact field names, ready for ``json.dumps``;
the official ``openai`` SDK's pydantic models accept them (see tests/test_gateway_response_builders.py).
The inbound half (request parsing) is ``openai_requests.py``.

Logprobs equal to ``-inf`` / NaN are clamped to :data:`LOGPROB_FLOOR` (``-9999.0``) so the JSON
stays valid, as vLLM does.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SYSTEM_FINGERPRINT = "fp_tandem"
LOGPROB_FLOOR = -9999.0

JsonDict = dict[str, object]


# --------------------------------------------------------------------------- response types


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One alternative token at a position. ``token_bytes`` overrides ``token.encode()``."""

    token: str
    logprob: float
    token_bytes: bytes | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token at a position, its logprob and the most likely alternatives."""

    token: str
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()
    token_bytes: bytes | None = None


@dataclass(frozen=True, slots=True)
class ChatChoice:
    """One finished chat choice; ``logprobs`` comes from :func:`chat_logprobs`."""

    index: int
    text: str
    finish_reason: str
    logprobs: Mapping[str, object] | None = None
    tool_calls: Sequence[Mapping[str, object]] = ()  # OpenAI tool_call objects; content may be ""
    reasoning: str | None = None  # reasoning_content (a --reasoning-parser split it off)


@dataclass(frozen=True, slots=True)
class CompletionChoice:
    """One finished completion choice; ``logprobs`` comes from :func:`completion_logprobs`."""

    index: int
    text: str
    finish_reason: str
    logprobs: Mapping[str, object] | None = None


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One entry of ``GET /v1/models``."""

    id: str
    created: int
    owned_by: str = "tandem"
    max_model_len: int | None = None


# --------------------------------------------------------------------------- response builders


def new_chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> JsonDict:
    """OpenAI's ``usage`` object, with cached prompt tokens under ``prompt_tokens_details``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> JsonDict:
    """Chat ``choice.logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], ...}``."""
    return {
        "content": [
            {
                "token": t.token,
                "logprob": _safe_logprob(t.logprob),
                "bytes": _token_bytes(t.token, t.token_bytes),
                "top_logprobs": [
                    {
                        "token": top.token,
                        "logprob": _safe_logprob(top.logprob),
                        "bytes": _token_bytes(top.token, top.token_bytes),
                    }
                    for top in t.top_logprobs
                ],
            }
            for t in tokens
        ],
        "refusal": None,
    }


def completion_logprobs(tokens: Sequence[TokenLogprob], *, text_offset_start: int = 0) -> JsonDict:
    """Completions ``choice.logprobs``: parallel ``tokens``/``token_logprobs``/... lists.

    ``text_offset`` counts characters from ``text_offset_start`` (a stream continues at
    ``text_offset_start + sum(len(t.token))`` in its next chunk).
    """
    offsets: list[int] = []
    offset = text_offset_start
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [_safe_logprob(t.logprob) for t in tokens],
        "top_logprobs": [
            {top.token: _safe_logprob(top.logprob) for top in t.top_logprobs} for t in tokens
        ],
        "text_offset": offsets,
    }


def chat_completion_response(
    *,
    request_id: str,
    model: str,
    choices: Sequence[ChatChoice],
    usage: Mapping[str, object] | None,
    created: int | None = None,
    system_fingerprint: str | None = SYSTEM_FINGERPRINT,
) -> JsonDict:
    """A non-streamed ``chat.completion`` object."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": _created(created),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": _message(c),
                "logprobs": None if c.logprobs is None else dict(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "system_fingerprint": system_fingerprint,
        "usage": None if usage is None else dict(usage),
    }


def _message(choice: ChatChoice) -> JsonDict:
    """A choice's assistant message: its text, and its tool calls when it made any (content
    null when the reply was only calls, as OpenAI sends it)."""
    message: JsonDict = {"role": "assistant", "content": choice.text, "refusal": None}
    if choice.reasoning is not None:
        message["reasoning_content"] = choice.reasoning
    if choice.tool_calls:
        message["content"] = choice.text or None
        message["tool_calls"] = [dict(c) for c in choice.tool_calls]
    return message


def chat_completion_chunk(
    *,
    request_id: str,
    model: str,
    created: int,
    index: int = 0,
    role: str | None = None,
    content: str | None = None,
    tool_calls: Sequence[Mapping[str, object]] | None = None,
    reasoning_content: str | None = None,
    finish_reason: str | None = None,
    logprobs: Mapping[str, object] | None = None,
    usage: Mapping[str, object] | None = None,
    system_fingerprint: str | None = SYSTEM_FINGERPRINT,
) -> JsonDict:
    """One ``chat.completion.chunk`` with a single choice delta.

    The first chunk of a choice carries ``role="assistant", content=""``; the last has
    ``finish_reason`` and an empty delta. All chunks of one stream share ``request_id`` and
    ``created``.
    """
    delta: JsonDict = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = [dict(c) for c in tool_calls]
    if reasoning_content is not None:
        delta["reasoning_content"] = reasoning_content
    chunk = _chunk_head(request_id, model, created, "chat.completion.chunk", system_fingerprint)
    chunk["choices"] = [
        {
            "index": index,
            "delta": delta,
            "logprobs": None if logprobs is None else dict(logprobs),
            "finish_reason": finish_reason,
        }
    ]
    if usage is not None:
        chunk["usage"] = dict(usage)
    return chunk


def chat_usage_chunk(
    *,
    request_id: str,
    model: str,
    created: int,
    usage: Mapping[str, object],
    system_fingerprint: str | None = SYSTEM_FINGERPRINT,
) -> JsonDict:
    """The final chunk sent when ``stream_options.include_usage`` is set: no choices, usage."""
    return _usage_chunk(
        request_id, model, created, "chat.completion.chunk", usage, system_fingerprint
    )


def _usage_chunk(
    request_id: str,
    model: str,
    created: int,
    object_name: str,
    usage: Mapping[str, object],
    system_fingerprint: str | None,
) -> JsonDict:
    chunk = _chunk_head(request_id, model, created, object_name, system_fingerprint)
    chunk["choices"] = []
    chunk["usage"] = dict(usage)
    return chunk


def completion_response(
    *,
    request_id: str,
    model: str,
    choices: Sequence[CompletionChoice],
    usage: Mapping[str, object] | None,
    created: int | None = None,
    system_fingerprint: str | None = SYSTEM_FINGERPRINT,
) -> JsonDict:
    """A non-streamed ``text_completion`` object."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": _created(created),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": None if c.logprobs is None else dict(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "system_fingerprint": system_fingerprint,
        "usage": None if usage is None else dict(usage),
    }


def completion_chunk(
    *,
    request_id: str,
    model: str,
    created: int,
    index: int = 0,
    text: str = "",
    finish_reason: str | None = None,
    logprobs: Mapping[str, object] | None = None,
    usage: Mapping[str, object] | None = None,
    system_fingerprint: str | None = SYSTEM_FINGERPRINT,
) -> JsonDict:
    """One streamed ``text_completion`` chunk (same object name as the non-streamed one)."""
    chunk = _chunk_head(request_id, model, created, "text_completion", system_fingerprint)
    chunk["choices"] = [
        {
            "index": index,
            "text": text,
            "logprobs": None if logprobs is None else dict(logprobs),
            "finish_reason": finish_reason,
        }
    ]
    if usage is not None:
        chunk["usage"] = dict(usage)
    return chunk


def completion_usage_chunk(
    *,
    request_id: str,
    model: str,
    created: int,
    usage: Mapping[str, object],
    system_fingerprint: str | None = SYSTEM_FINGERPRINT,
) -> JsonDict:
    """The final completions chunk for ``stream_options.include_usage``: no choices, usage."""
    return _usage_chunk(request_id, model, created, "text_completion", usage, system_fingerprint)


def models_response(models: Sequence[ModelCard]) -> JsonDict:
    """``GET /v1/models``: ``{"object": "list", "data": [model, ...]}``."""
    data: list[JsonDict] = []
    for m in models:
        entry: JsonDict = {
            "id": m.id,
            "object": "model",
            "created": m.created,
            "owned_by": m.owned_by,
        }
        if m.max_model_len is not None:
            entry["max_model_len"] = m.max_model_len
        data.append(entry)
    return {"object": "list", "data": data}


def _chunk_head(
    request_id: str, model: str, created: int, obj: str, system_fingerprint: str | None
) -> JsonDict:
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint,
    }


def _created(created: int | None) -> int:
    return int(time.time()) if created is None else created


def _safe_logprob(value: float) -> float:
    if math.isnan(value) or value < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return float(value)


def _token_bytes(token: str, raw: bytes | None) -> list[int]:
    return list(raw if raw is not None else token.encode("utf-8"))
