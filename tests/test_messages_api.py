"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) through
the official ``anthropic`` SDK.

* On the real in-process stack (tests/tiny_stack.py: a tiny random Llama with SmolLM2's
  tokenizer; prompts over 40 tokens are prefilled remotely and cross the KV hand-off): a plain
  and a streamed reply (``messages.stream``: Anthropic's event order), ``count_tokens`` equal to
  what a reply's prompt held, a tool loop (``any`` -> ``tool_use`` -> ``tool_result`` -> text),
  a named tool, a streamed ``input_json_delta``, ``stop_sequences`` (``stop_reason``
  ``stop_sequence`` naming it), ``x-api-key`` and bearer auth, and errors in Anthropic's shape.
  The model's text is gibberish: tool calls are forced by grammars and asserted on structure.
* On the fake stack (tests/gateway_fakes.py: exact scripted replies): the exact event sequence,
  and a stream whose decode worker dies mid-reply migrating without the client noticing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import jsonschema
import pytest
import pytest_asyncio

from services.gateway.choice import ChoiceEvent
from services.gateway.messages_renderer import MessagesRenderer
from services.gateway.renderers import ChatRenderer
from services.gateway.state import STATE_KEY
from tests.gateway_fakes import FRANCE_REPLY, MODEL, StackFactory
from tests.test_responses_api import with_tokenizer
from tests.tiny_stack import API_KEY, TinyStack, tiny_stack

TINY = "tiny"
# The tiny model's context is 256 tokens and the Hermes tool instructions take ~105 of them: one
# small tool leaves room for a reply of 50.
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS: list[Any] = [{"name": "weather", "input_schema": CITY}]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
HELLO = [{"role": "user", "content": "Hello there"}]
MODULE = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TinyStack]:
    async with tiny_stack(with_tokenizer(tmp_path_factory.mktemp("tiny-messages"))) as started:
        yield started


@pytest_asyncio.fixture(loop_scope="module")
async def client(stack: TinyStack) -> AsyncIterator[anthropic.AsyncAnthropic]:
    made = anthropic.AsyncAnthropic(base_url=stack.url, api_key=API_KEY, max_retries=0,
                                    timeout=60)  # fmt: skip
    yield made
    await made.close()


def remote_prefills(stack: TinyStack) -> float:
    metrics = stack.app[STATE_KEY].metrics
    return float(metrics.prefill_path.labels(path="remote")._value.get())


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


async def post(url: str, body: object, headers: dict[str, str]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


# --------------------------------------------------------------------------- the real stack


@MODULE
async def test_a_plain_and_a_streamed_reply(client: anthropic.AsyncAnthropic) -> None:
    done = await client.messages.create(model=TINY, max_tokens=8, messages=HELLO,
                                        system="Be brief.", extra_body={"temperature": 0})  # fmt: skip
    assert done.id.startswith("msg_") and done.type == "message" and done.role == "assistant"
    assert done.model == TINY and [block.type for block in done.content] == ["text"]
    assert 0 < done.usage.output_tokens <= 8
    cut = done.usage.output_tokens == 8
    assert done.stop_reason == ("max_tokens" if cut else "end_turn")
    assert done.stop_sequence is None
    counted = await client.messages.count_tokens(model=TINY, messages=HELLO, system="Be brief.")
    assert counted.input_tokens == done.usage.input_tokens + (done.usage.cache_read_input_tokens
                                                              or 0)  # fmt: skip
    async with client.messages.stream(model=TINY, max_tokens=8, messages=HELLO,
                                      system=[{"type": "text", "text": "Be brief."}],
                                      extra_body={"temperature": 0}) as stream:  # fmt: skip
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert text_of(final) == text_of(done)  # greedy: the same reply
    assert final.stop_reason == done.stop_reason
    assert final.usage.output_tokens == done.usage.output_tokens
    raw = [k for k in kinds if k not in ("text", "thinking", "input_json")]  # the SDK's own
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in raw and "content_block_stop" in raw


@MODULE
async def test_a_tool_loop(stack: TinyStack, client: anthropic.AsyncAnthropic) -> None:
    before = remote_prefills(stack)
    choice: Any = {"type": "any", "disable_parallel_tool_use": True}
    asked = await client.messages.create(model=TINY, max_tokens=50, messages=QUESTION, tools=TOOLS,
                                         tool_choice=choice, extra_body={"temperature": 0})  # fmt: skip
    assert remote_prefills(stack) > before  # the tools make the prompt long: remote prefill
    assert asked.stop_reason == "tool_use"
    uses = [block for block in asked.content if block.type == "tool_use"]
    assert len(uses) == 1, asked.content
    use = uses[0]
    assert use.id.startswith("toolu_") and use.name == "weather"
    jsonschema.validate(use.input, CITY)  # an object, not JSON text
    counted = await client.messages.count_tokens(model=TINY, messages=QUESTION, tools=TOOLS)
    assert counted.input_tokens == asked.usage.input_tokens + (asked.usage.cache_read_input_tokens
                                                               or 0)  # fmt: skip

    history: list[Any] = [*QUESTION, {"role": "assistant", "content": asked.content},
                          {"role": "user", "content": [
                              {"type": "tool_result", "tool_use_id": use.id,
                               "content": [{"type": "text", "text": "18 degrees"}]},
                              {"type": "text", "text": "And so?"}]}]  # fmt: skip
    final = await client.messages.create(model=TINY, max_tokens=6, messages=history, tools=TOOLS,
                                         tool_choice={"type": "none"}, extra_body={"temperature": 0})  # fmt: skip
    assert [block.type for block in final.content] == ["text"]
    assert final.stop_reason in ("end_turn", "max_tokens")
    failed = [*history[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "no such city",
         "is_error": True}]}]  # fmt: skip
    again = await client.messages.create(model=TINY, max_tokens=4, messages=failed, tools=TOOLS)
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")

    named = await client.messages.create(model=TINY, max_tokens=50, messages=QUESTION, tools=TOOLS,
                                         tool_choice={"type": "tool", "name": "weather",
                                                      "disable_parallel_tool_use": True})  # fmt: skip
    assert [b.name for b in named.content if b.type == "tool_use"] == ["weather"]
    await stack.wait_idle()


@MODULE
async def test_a_streamed_tool_use(client: anthropic.AsyncAnthropic) -> None:
    async with client.messages.stream(model=TINY, max_tokens=50, messages=QUESTION, tools=TOOLS,
                                      tool_choice={"type": "any",
                                                   "disable_parallel_tool_use": True},
                                      extra_body={"temperature": 0}) as stream:  # fmt: skip
        events = [event async for event in stream]
        final = await stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    use = final.content[-1]
    assert final.stop_reason == "tool_use" and use.type == "tool_use"
    assert json.loads(partial) == use.input
    jsonschema.validate(use.input, CITY)


@MODULE
async def test_stop_sequences(client: anthropic.AsyncAnthropic) -> None:
    greedy: Any = {"temperature": 0}  # this random model's greedy reply is a run of newlines
    free = await client.messages.create(model=TINY, max_tokens=6, messages=HELLO,
                                        stop_sequences=["zzqq"], extra_body=greedy)  # fmt: skip
    assert free.stop_reason == "max_tokens" and free.stop_sequence is None
    text = text_of(free)
    stop = text[:1]
    assert stop and text.find(stop) == 0, text
    done = await client.messages.create(model=TINY, max_tokens=6, messages=HELLO,
                                        stop_sequences=[stop], extra_body=greedy)  # fmt: skip
    assert done.stop_reason == "stop_sequence" and done.stop_sequence == stop
    assert text_of(done) == "" and done.usage.output_tokens < 6
    async with client.messages.stream(model=TINY, max_tokens=6, messages=HELLO,
                                      stop_sequences=[stop], extra_body=greedy) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


@MODULE
async def test_auth_and_errors_in_anthropics_shape(stack: TinyStack) -> None:
    url = stack.url + "/v1/messages"
    body = {"model": TINY, "max_tokens": 2, "messages": HELLO}
    status, _ = await post(url, body, {"x-api-key": API_KEY})
    assert status == 200
    status, _ = await post(url, body, {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200
    status, err = await post(url, body, {})
    assert status == 401 and err["error"]["type"] == "authentication_error"
    assert "x-api-key" in err["error"]["message"]
    wrong = anthropic.AsyncAnthropic(base_url=stack.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        await wrong.messages.create(model=TINY, max_tokens=2, messages=HELLO)  # type: ignore[arg-type]
    await wrong.close()
    assert auth.value.status_code == 401
    assert auth.value.body["type"] == "error"
    assert auth.value.body["error"]["type"] == "authentication_error"

    key = {"x-api-key": API_KEY}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": [{"role": "user", "content": [image]}]}, "messages.0.content.0.type"),
        ({"max_tokens": None}, "max_tokens"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
        ({"model": "nope"}, "model"),
    ]  # fmt: skip
    for extra, field in cases:
        status, err = await post(url, {k: v for k, v in {**body, **extra}.items()
                                       if v is not None}, key)  # fmt: skip
        assert status == (404 if field == "model" else 400), err
        kind = "not_found_error" if field == "model" else "invalid_request_error"
        assert err == {"type": "error", "error": {"type": kind, "message": err["error"]["message"]}}
        assert field in err["error"]["message"], err
    status, err = await post(stack.url + "/v1/messages/count_tokens",
                             {"model": TINY, "messages": [{"role": "robot", "content": "x"}]}, key)
    assert status == 400 and err["error"]["type"] == "invalid_request_error"


# --------------------------------------------------------------------------- the fake stack


async def test_the_exact_event_sequence(make_stack: StackFactory) -> None:
    stack = await make_stack()
    client = anthropic.AsyncAnthropic(base_url=stack.url, api_key="none", max_retries=0)
    async with client.messages.stream(model=MODEL, max_tokens=200,
                                      messages=[{"role": "user", "content": "France?"}]) as stream:
        raw = [event.type async for event in stream
               if event.type not in ("text", "thinking", "input_json")]  # fmt: skip
        final = await stream.get_final_message()
    await client.close()
    deltas = raw.count("content_block_delta")
    assert raw == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                   "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    assert text_of(final) == FRANCE_REPLY and final.stop_reason == "end_turn"
    await stack.settled()


async def test_a_stream_migrates_when_its_decode_worker_dies(make_stack: StackFactory) -> None:
    stack = await make_stack(decode=2)
    for decode in stack.decodes:
        decode.die_after = 10  # whichever serves it dies at token 10
    client = anthropic.AsyncAnthropic(base_url=stack.url, api_key="none", max_retries=0)
    async with client.messages.stream(model=MODEL, max_tokens=40,
                                      messages=[{"role": "user", "content": "France?"}]) as stream:
        final = await stream.get_final_message()
    await client.close()
    assert text_of(final) == FRANCE_REPLY[:40]  # one uninterrupted stream
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 40
    assert await stack.metric("tandem:migrations_total") == 1
    await stack.settled()


async def test_a_failure_mid_stream_is_an_error_event(make_stack: StackFactory) -> None:
    stack = await make_stack(decode=2, max_migrations=0)
    for decode in stack.decodes:
        decode.die_after = 5
    client = anthropic.AsyncAnthropic(base_url=stack.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as info:
        async with client.messages.stream(model=MODEL, max_tokens=30,
                                          messages=[{"role": "user", "content": "France?"}]) as s:
            async for _ in s:
                pass
    await client.close()
    assert info.value.body["type"] == "error" and info.value.body["error"]["message"]
    await stack.settled()


async def test_a_client_leaving_mid_stream_frees_everything(make_stack: StackFactory) -> None:
    stack = await make_stack()
    stack.decodes[0].token_delay = 0.2
    body = {"model": MODEL, "max_tokens": 50, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    async with aiohttp.ClientSession() as s, s.post(stack.url + "/v1/messages", json=body) as r:
        assert r.status == 200
        await r.content.readline()  # message_start: generation is under way
        assert sum(d.blocks_in_use for d in stack.decodes) > 0
    await stack.settled()
    assert stack.decodes[0].cancelled or stack.decodes[0].aborted


def test_reasoning_becomes_a_thinking_block() -> None:
    """With --reasoning-parser, the thinking is a ``thinking`` block before the text, streamed
    and not (the renderer alone: the fakes do not think)."""
    reply = [ChoiceEvent(0, "<think>Let me"), ChoiceEvent(0, " see.</think>\n\nParis"),
             ChoiceEvent(0, " it is.", finish_reason="stop")]  # fmt: skip
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
             "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip

    def renderer() -> MessagesRenderer:
        chat = ChatRenderer(request_id="x", model=MODEL, n=1, logprobs=False, reasoning="qwen3")
        return MessagesRenderer(chat=chat, message_id="msg_x", model=MODEL, prompt_tokens=5,
                                stop_sequences=(), model_info=None)  # fmt: skip

    whole = renderer()
    for event in reply:
        whole.add(event)
    done = whole.response(usage)
    assert [b["type"] for b in done["content"]] == ["thinking", "text"]
    assert done["content"][0]["thinking"] == "Let me see."
    assert done["content"][1]["text"] == "Paris it is." and done["stop_reason"] == "end_turn"
    assert done["usage"]["input_tokens"] == 3 and done["usage"]["cache_read_input_tokens"] == 2
    streamed = renderer()
    events = streamed.start_chunks() + [e for event in reply for e in streamed.event_chunks(event)]
    events += streamed.end_chunks(usage)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Let me see."
    assert "".join(d.get("text", "") for d in deltas) == "Paris it is."
    assert [e["type"] for e in events][-2:] == ["message_delta", "message_stop"]
