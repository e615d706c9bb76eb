"""OpenAI response builders (chat and text completions, whole and streamed, logprobs, usage, the
model list) checked against the official ``openai`` SDK's pydantic models. Request parsing is
tests/test_gateway_protocol.py."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.gateway.openai_responses import (
    ChatChoice,
    CompletionChoice,
    ModelCard,
    TokenLogprob,
    TopLogprob,
    chat_completion_chunk,
    chat_completion_response,
    chat_logprobs,
    chat_usage_chunk,
    completion_chunk,
    completion_logprobs,
    completion_response,
    completion_usage_chunk,
    models_response,
    new_chat_completion_id,
    new_completion_id,
    usage_dict,
)

MODEL = "smollm2"


# --------------------------------------------------------------------------- response builders


def logprob_tokens() -> list[TokenLogprob]:
    return [
        TokenLogprob("Hel", -0.1, (TopLogprob("Hel", -0.1), TopLogprob("He", -2.5))),
        TokenLogprob("lo", float("-inf"), (TopLogprob("lo", float("nan")),)),
        TokenLogprob("\ufffd", -1.0, (), token_bytes=b"\xe2\x80"),
    ]


def roundtrip(obj: dict[str, Any]) -> dict[str, Any]:
    """What a client receives: strict JSON (no NaN / Infinity)."""
    return json.loads(json.dumps(obj, allow_nan=False))


def test_ids_and_usage() -> None:
    assert new_chat_completion_id().startswith("chatcmpl-")
    assert new_completion_id().startswith("cmpl-")
    assert new_chat_completion_id() != new_chat_completion_id()
    usage = usage_dict(10, 4, cached_tokens=8)
    assert usage == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_chat_completion_response_parses_with_sdk() -> None:
    lp = chat_logprobs(logprob_tokens())
    body = chat_completion_response(
        request_id="chatcmpl-1",
        model=MODEL,
        created=1700000000,
        choices=[
            ChatChoice(0, "Hello", "stop", lp),
            ChatChoice(1, "Hi", "length"),
            ChatChoice(2, "", "content_filter"),
        ],
        usage=usage_dict(5, 3, 2),
    )
    parsed = ChatCompletion.model_validate(roundtrip(body))
    assert parsed.object == "chat.completion" and parsed.id == "chatcmpl-1"
    assert parsed.choices[0].message.content == "Hello"
    assert parsed.choices[0].message.role == "assistant"
    assert [c.finish_reason for c in parsed.choices] == ["stop", "length", "content_filter"]
    content = parsed.choices[0].logprobs.content
    assert content[0].token == "Hel" and content[0].bytes == list(b"Hel")
    assert [t.token for t in content[0].top_logprobs] == ["Hel", "He"]
    assert content[1].logprob == -9999.0 and content[1].top_logprobs[0].logprob == -9999.0
    assert content[2].bytes == [0xE2, 0x80]
    assert parsed.usage.total_tokens == 8 and parsed.usage.prompt_tokens_details.cached_tokens == 2
    assert parsed.system_fingerprint


def test_chat_chunks_parse_with_sdk() -> None:
    common = {"request_id": "chatcmpl-2", "model": MODEL, "created": 1700000000}
    first = ChatCompletionChunk.model_validate(
        roundtrip(chat_completion_chunk(**common, role="assistant", content=""))
    )
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert first.choices[0].finish_reason is None
    lp = chat_logprobs(logprob_tokens()[:1])
    mid = chat_completion_chunk(**common, content="Hel", logprobs=lp)
    parsed = ChatCompletionChunk.model_validate(roundtrip(mid))
    assert parsed.choices[0].delta.content == "Hel" and parsed.choices[0].delta.role is None
    assert "role" not in mid["choices"][0]["delta"]
    assert parsed.choices[0].logprobs.content[0].token == "Hel"
    last = ChatCompletionChunk.model_validate(
        roundtrip(chat_completion_chunk(**common, index=1, finish_reason="length"))
    )
    assert last.choices[0].finish_reason == "length" and last.choices[0].index == 1
    assert last.choices[0].delta.content is None
    usage = ChatCompletionChunk.model_validate(
        roundtrip(chat_usage_chunk(**common, usage=usage_dict(3, 2)))
    )
    assert usage.choices == [] and usage.usage.total_tokens == 5
    assert usage.object == "chat.completion.chunk"


def test_completion_response_parses_with_sdk() -> None:
    lp = completion_logprobs(logprob_tokens(), text_offset_start=9)
    assert lp["text_offset"] == [9, 12, 14]
    assert lp["top_logprobs"][2] == {}
    body = completion_response(
        request_id="cmpl-1",
        model=MODEL,
        created=1700000000,
        choices=[CompletionChoice(0, "Hello\ufffd", "stop", lp)],
        usage=usage_dict(2, 3),
    )
    parsed = Completion.model_validate(roundtrip(body))
    assert parsed.object == "text_completion" and parsed.choices[0].text == "Hello\ufffd"
    assert parsed.choices[0].logprobs.tokens == ["Hel", "lo", "\ufffd"]
    assert parsed.choices[0].logprobs.token_logprobs == [-0.1, -9999.0, -1.0]
    assert parsed.choices[0].logprobs.top_logprobs[0] == {"Hel": -0.1, "He": -2.5}


def test_completion_chunks_parse_with_sdk() -> None:
    common = {"request_id": "cmpl-2", "model": MODEL, "created": 1700000000}
    last = Completion.model_validate(
        roundtrip(completion_chunk(**common, text="", finish_reason="stop"))
    )
    assert last.choices[0].finish_reason == "stop"
    # Mid-stream chunks carry finish_reason null, which the SDK's non-streaming model types as
    # required; everything else about them must validate.
    mid = roundtrip(completion_chunk(**common, text="Hel"))
    with pytest.raises(pydantic.ValidationError) as info:
        Completion.model_validate(mid)
    assert [e["loc"] for e in info.value.errors()] == [("choices", 0, "finish_reason")]
    usage = Completion.model_validate(
        roundtrip(completion_usage_chunk(**common, usage=usage_dict(1, 1)))
    )
    assert usage.choices == [] and usage.usage.total_tokens == 2


def test_models_response_parses_with_sdk() -> None:
    body = models_response([ModelCard(MODEL, 1700000000, max_model_len=8192), ModelCard("b", 1)])
    assert body["object"] == "list"
    models = [Model.model_validate(m) for m in roundtrip(body)["data"]]
    assert [m.id for m in models] == [MODEL, "b"]
    assert models[0].owned_by == "tandem" and models[0].object == "model"
    assert body["data"][0]["max_model_len"] == 8192 and "max_model_len" not in body["data"][1]
