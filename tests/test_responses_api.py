"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``)
through the official ``openai`` SDK.

* On the real in-process stack (tests/tiny_stack.py: a tiny random Llama with SmolLM2's
  tokenizer; prompts over 40 tokens are prefilled remotely and cross the KV hand-off): plain and
  streamed replies (typed events in OpenAI's order, ``event:`` lines, sequence numbers,
  ``incomplete`` at ``max_output_tokens``), ``text.format`` json_schema through
  ``responses.parse`` / ``responses.stream``, a whole tool loop (``required`` -> a
  ``function_call``, its ``function_call_output`` sent with ``previous_response_id`` and again
  statelessly with the items), a named ``tool_choice``, store / retrieve / delete, and 400s
  naming the Responses API's fields. The model's text is gibberish: tool calls and JSON are
  forced by grammars and asserted on structure.
* On the fake stack (tests/gateway_fakes.py: exact scripted replies): the exact event sequence,
  and a stream whose decode worker dies mid-reply migrating without the client noticing.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel, ConfigDict, Field

from services.common.model_source import resolve_model
from services.gateway.choice import ChoiceEvent
from services.gateway.main import add_arguments
from services.gateway.renderers import ChatRenderer
from services.gateway.response_store import ResponseStore
from services.gateway.responses_renderer import ResponsesRenderer
from services.gateway.state import STATE_KEY
from services.tokenizer.tokenizer import Tokenizer
from tests.gateway_fakes import FRANCE_REPLY, MODEL, StackFactory
from tests.tiny_stack import API_KEY, TinyStack, tiny_stack

TINY = "tiny"
# The tiny model's context is 256 tokens and the Hermes tool instructions take ~105 of them: one
# small tool leaves room for a reply of 50.
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "name": "weather", "parameters": CITY}]
QUESTION = "Weather in Paris?"
MODULE = pytest.mark.asyncio(loop_scope="module")


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=99)


def with_tokenizer(folder: Path) -> Path:
    """``folder`` with SmolLM2's tokenizer files, so the tiny stack's prefill worker (which loads
    its tokenizer from the model folder) can sample under a grammar: the tool prompts here are
    long enough to be prefilled remotely."""
    tokenizer = Tokenizer.load(resolve_model("default"))
    (folder / "tokenizer.json").write_text(tokenizer.to_json())
    ids = {"bos_token": tokenizer.bos_token_id, "eos_token": tokenizer.eos_token_id}
    config = {k: tokenizer.id_to_token(v) for k, v in ids.items() if v is not None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TinyStack]:
    async with tiny_stack(with_tokenizer(tmp_path_factory.mktemp("tiny-responses"))) as started:
        yield started


@pytest_asyncio.fixture(loop_scope="module")
async def client(stack: TinyStack) -> AsyncIterator[openai.AsyncOpenAI]:
    made = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=API_KEY, max_retries=0,
                              timeout=60)  # fmt: skip
    yield made
    await made.close()


def remote_prefills(stack: TinyStack) -> float:
    metrics = stack.app[STATE_KEY].metrics
    return float(metrics.prefill_path.labels(path="remote")._value.get())


async def raw_events(url: str, body: dict[str, Any], key: str = API_KEY) -> list[tuple[str, Any]]:
    """``(event name, data)`` of every SSE event of a streamed ``POST /v1/responses``."""
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/responses", json=body,
                                                    headers=headers) as r:  # fmt: skip
        assert r.status == 200 and r.content_type == "text/event-stream"
        text = (await r.read()).decode()
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


# --------------------------------------------------------------------------- the real stack


@MODULE
async def test_a_plain_reply_and_its_stream(stack: TinyStack, client: openai.AsyncOpenAI) -> None:
    done = await client.responses.create(model=TINY, input="Hello there", max_output_tokens=8,
                                         temperature=0, instructions="Be brief.")  # fmt: skip
    assert done.id.startswith("resp_") and done.object == "response" and done.model == TINY
    assert [item.type for item in done.output] == ["message"]
    assert done.output[0].content[0].type == "output_text"
    usage = done.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    cut = usage.output_tokens == 8
    assert done.status == ("incomplete" if cut else "completed")
    if cut:
        assert done.incomplete_details.reason == "max_output_tokens"
    assert done.instructions == "Be brief." and done.max_output_tokens == 8

    body = {"model": TINY, "input": "Hello there", "max_output_tokens": 8, "temperature": 0,
            "instructions": "Be brief.", "stream": True}  # fmt: skip
    events = await raw_events(stack.url, body)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)  # event: lines name the type
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert names[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.completed" if not cut else "response.incomplete"]  # fmt: skip
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text == done.output_text  # greedy: the same reply
    final = events[-1][1]["response"]
    assert final["usage"]["output_tokens"] == usage.output_tokens
    await stack.wait_idle()


@MODULE
async def test_json_schema_through_parse_and_stream(client: openai.AsyncOpenAI) -> None:
    parsed = await client.responses.parse(model=TINY, input="Describe a person.",
                                          text_format=Person, max_output_tokens=50)  # fmt: skip
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    assert parsed.text.format.type == "json_schema"
    async with client.responses.stream(model=TINY, input="Describe a person.", text_format=Person,
                                       max_output_tokens=50, temperature=0) as stream:  # fmt: skip
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert isinstance(final.output_parsed, Person)


@MODULE
async def test_a_tool_loop_stateful_and_stateless(
    stack: TinyStack, client: openai.AsyncOpenAI
) -> None:
    before = remote_prefills(stack)
    asked = await client.responses.create(model=TINY, input=QUESTION, tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_output_tokens=50, temperature=0)  # fmt: skip
    assert remote_prefills(stack) > before  # the tools make the prompt long: remote prefill
    assert asked.status == "completed"
    calls = [item for item in asked.output if item.type == "function_call"]
    assert len(calls) == 1, asked.output
    call = calls[0]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert call.name == "weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), CITY)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"c": 18}'}
    stateful = await client.responses.create(model=TINY, previous_response_id=asked.id,
                                             input=[result], tools=TOOLS, tool_choice="none",
                                             max_output_tokens=6, temperature=0)  # fmt: skip
    assert stateful.previous_response_id == asked.id
    assert [item.type for item in stateful.output] == ["message"]
    history = [{"role": "user", "content": QUESTION},
               *[item.model_dump(exclude_none=True) for item in asked.output], result]  # fmt: skip
    stateless = await client.responses.create(model=TINY, input=history, tools=TOOLS, store=False,
                                              tool_choice="none", max_output_tokens=6,
                                              temperature=0)  # fmt: skip
    assert stateless.usage.input_tokens == stateful.usage.input_tokens  # the same conversation
    assert stateless.output_text == stateful.output_text

    named = await client.responses.create(model=TINY, input=QUESTION, tools=TOOLS,
                                          tool_choice={"type": "function", "name": "weather"},
                                          parallel_tool_calls=False, max_output_tokens=50)  # fmt: skip
    assert [item.name for item in named.output if item.type == "function_call"] == ["weather"]
    await stack.wait_idle()


@MODULE
async def test_a_streamed_tool_call(client: openai.AsyncOpenAI) -> None:
    async with client.responses.stream(model=TINY, input=QUESTION, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_output_tokens=50, temperature=0) as stream:  # fmt: skip
        events = [event async for event in stream]
        final = await stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds.index("response.output_item.added") < kinds.index(
        "response.function_call_arguments.delta") < kinds.index(
        "response.function_call_arguments.done") < kinds.index("response.completed")  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    call = final.output[-1]
    assert call.type == "function_call" and call.arguments == deltas
    jsonschema.validate(json.loads(call.arguments), CITY)


@MODULE
async def test_store_retrieve_and_delete(stack: TinyStack, client: openai.AsyncOpenAI) -> None:
    stored = await client.responses.create(model=TINY, input="Hi", max_output_tokens=3,
                                           metadata={"k": "v"}, user="u1",
                                           include=["reasoning.encrypted_content"])  # fmt: skip
    assert stored.store is True and stored.metadata == {"k": "v"} and stored.user == "u1"
    again = await client.responses.retrieve(stored.id)
    assert again.model_dump() == stored.model_dump()
    other = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="another-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await other.responses.retrieve(stored.id)
    await other.close()
    await client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(stored.id)
    unstored = await client.responses.create(model=TINY, input="Hi", max_output_tokens=3,
                                             store=False)  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=TINY, input="Hi", previous_response_id=unstored.id)
    assert info.value.body["param"] == "previous_response_id"


@MODULE
async def test_bad_requests_are_400s_naming_the_field(client: openai.AsyncOpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
         "text.format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ]  # fmt: skip
    for extra, param in cases:
        body = {"model": TINY, "input": "Hi", **extra}
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(**body)
        assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
        assert info.value.body["type"] == "invalid_request_error"


def test_the_store_is_bounded_by_age_and_count() -> None:
    now = [0.0]
    store = ResponseStore(ttl_s=10.0, max_entries=2, clock=lambda: now[0])
    for i in range(3):
        store.put(f"r{i}", {"id": f"r{i}"}, [{"role": "user", "content": "x"}], owner="k")
        now[0] += 1.0
    assert store.get("r0", owner="k") is None  # the oldest, evicted by the third
    assert store.get("r1", owner="k") is not None and store.get("r1", owner="other") is None
    assert not store.delete("r1", owner="other") and len(store) == 2
    now[0] = 11.5  # r1 was stored at 1.0: past its TTL; r2 (at 2.0) is not
    assert store.get("r1", owner="k") is None and store.get("r2", owner="k") is not None
    assert store.delete("r2", owner="k") and len(store) == 0
    off = ResponseStore(ttl_s=10.0, max_entries=0)
    off.put("r", {}, [], owner="k")
    assert off.get("r", owner="k") is None
    args = argparse.ArgumentParser()
    add_arguments(args)
    parsed = args.parse_args(["--response-store-ttl", "60", "--response-store-max-entries", "5"])
    assert (parsed.response_store_ttl, parsed.response_store_max_entries) == (60.0, 5)


# --------------------------------------------------------------------------- the fake stack


async def test_the_exact_event_sequence(make_stack: StackFactory) -> None:
    stack = await make_stack()
    events = await raw_events(stack.url, {"model": MODEL, "input": "France?", "stream": True,
                                          "max_output_tokens": 200}, key="none")  # fmt: skip
    names = [name for name, _ in events]
    deltas = names.count("response.output_text.delta")
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]  # fmt: skip
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == FRANCE_REPLY
    assert events[-4][1]["text"] == FRANCE_REPLY
    await stack.settled()


async def test_a_stream_migrates_when_its_decode_worker_dies(make_stack: StackFactory) -> None:
    stack = await make_stack(decode=2)
    for decode in stack.decodes:
        decode.die_after = 10  # whichever serves it dies at token 10
    stream = await stack.client().responses.create(model=MODEL, input="France?", stream=True,
                                                   max_output_tokens=40)  # fmt: skip
    events = [event async for event in stream]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == FRANCE_REPLY[:40]  # one uninterrupted stream
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 40
    assert await stack.metric("tandem:migrations_total") == 1
    await stack.settled()


async def test_a_client_leaving_mid_stream_frees_everything(make_stack: StackFactory) -> None:
    stack = await make_stack()
    stack.decodes[0].token_delay = 0.2
    body = {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 50}
    async with aiohttp.ClientSession() as s, s.post(stack.url + "/v1/responses", json=body) as r:
        assert r.status == 200
        await r.content.readline()  # response.created: generation is under way
        assert sum(d.blocks_in_use for d in stack.decodes) > 0
    await stack.settled()
    assert stack.decodes[0].cancelled or stack.decodes[0].aborted


async def test_a_failure_mid_stream_is_response_failed(make_stack: StackFactory) -> None:
    stack = await make_stack(decode=2, max_migrations=0)
    for decode in stack.decodes:
        decode.die_after = 5
    events = await raw_events(stack.url, {"model": MODEL, "input": "France?", "stream": True,
                                          "max_output_tokens": 30}, key="none")  # fmt: skip
    name, failed = events[-1]
    assert name == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"]
    assert [n for n, _ in events].count("response.output_text.delta") >= 1
    await stack.settled()


def test_reasoning_becomes_a_reasoning_item() -> None:
    """With --reasoning-parser, the thinking is a ``reasoning`` item before the message, streamed
    and not (the renderer alone: the fakes do not think)."""
    reply = [ChoiceEvent(0, "<think>Let me"), ChoiceEvent(0, " see.</think>\n\nParis"),
             ChoiceEvent(0, " it is.", finish_reason="stop")]  # fmt: skip
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip

    def renderer() -> ResponsesRenderer:
        chat = ChatRenderer(request_id="x", model=MODEL, n=1, logprobs=False, reasoning="qwen3")
        return ResponsesRenderer(chat=chat, response_id="resp_x", model=MODEL, echo={},
                                 on_done=lambda response, turn: None)  # fmt: skip

    whole = renderer()
    for event in reply:
        whole.add(event)
    done = whole.response(usage)
    streamed = renderer()
    events = [e for event in reply for e in streamed.event_chunks(event)]
    events += streamed.end_chunks(usage)
    for output in (done["output"], events[-1]["response"]["output"]):
        assert [item["type"] for item in output] == ["reasoning", "message"]
        assert output[0]["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
        assert output[1]["content"][0]["text"] == "Paris it is."
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") \
        == "Let me see."  # fmt: skip
