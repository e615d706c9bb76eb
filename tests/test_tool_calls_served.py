"""Tool calling through a served stack (tests/tiny_stack.py: the real tokenizer service, prefill
and decode workers on a tiny random Llama with SmolLM2's vocabulary, and the real gateway) with
the official ``openai`` SDK, as the user who filed issue 46 drove it.

The tokenizer renders chats with a Qwen-style tool template (``--chat-template`` in production;
Qwen3's layout and ``enable_thinking`` switch, its wording shortened to fit the tiny model's 256
positions), so ``auto`` picks the ``hermes`` format. A random model writes gibberish, so every call here is
forced by the grammar (``required`` or a named function) and the checks are about structure:

* a named ``tool_choice`` with ``parallel_tool_calls`` at its default is exactly one call;
* a reply cut by ``max_tokens`` (``min_tokens`` keeps the model from stopping, the grammar from
  doing anything but calls) keeps its complete calls with ``finish_reason`` "length", and the
  cut call's markup is not in ``content``;
* streamed, a call's id and name come first and its arguments in several deltas;
* ``chat_template_kwargs`` reaches the template (``enable_thinking: false`` adds Qwen3's empty
  think block to the prompt, which ``usage.prompt_tokens`` counts), and a reserved key is a 400.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.tiny_stack import API_KEY, TinyStack, tiny_stack

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="needs the openai SDK"),
]

TEMPLATE = (  # Qwen3's tool template, its wording shortened to fit the tiny model's context
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a function as <tool_call>\\n{\"name\": <name>, \"arguments\": "
    "<args>}\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- for call in message.tool_calls %}{{- '\\n<tool_call>\\n{\"name\": \"' }}"
    "{{- call.function.name }}{{- '\", \"arguments\": ' }}{{- call.function.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)  # fmt: skip
UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
    "additionalProperties": False}}}  # fmt: skip
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False}}}  # fmt: skip
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's folder, with the vocabulary next to it, so the prefill worker (which
    loads its tokenizer from the model's folder) can compile the grammars too, as a real model's
    folder allows."""
    from services.common.model_source import resolve_model
    from services.tokenizer.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("tiny-tools")
    tokenizer = Tokenizer.load(resolve_model("default"))
    (path / "tokenizer.json").write_text(tokenizer.to_json())
    eos = next(text for text, i in tokenizer.special_tokens.items() if i == tokenizer.eos_token_id)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(folder: Path) -> AsyncIterator[TinyStack]:
    async with tiny_stack(folder, chat_template=TEMPLATE) as started:
        yield started


def client(stack: TinyStack) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=API_KEY, max_retries=0,
                              timeout=60)  # fmt: skip


async def test_a_named_choice_is_one_call(stack: TinyStack) -> None:
    named = {"type": "function", "function": {"name": "set_unit"}}
    for seed in range(3):
        reply = await client(stack).chat.completions.create(
            model="tiny", messages=ASK, tools=[UNIT, CITY], tool_choice=named, max_tokens=40,
            seed=seed)  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert [c.function.name for c in choice.message.tool_calls] == ["set_unit"]
        assert json.loads(choice.message.tool_calls[0].function.arguments)["unit"] in ("C", "F")
        assert not choice.message.content


async def test_a_cut_reply_keeps_its_complete_calls(stack: TinyStack) -> None:
    from services.common.model_source import resolve_model
    from services.tokenizer.tokenizer import Tokenizer

    call = '<tool_call>\n{"name": "set_unit", "arguments": {"unit": "C"}}\n</tool_call>'
    size = len(Tokenizer.load(resolve_model("default")).encode(call, add_special_tokens=False))
    limit = size + size // 2  # one call and half of the next
    ask = {"model": "tiny", "messages": ASK, "tools": [UNIT], "tool_choice": "required",
           "max_tokens": limit, "extra_body": {"min_tokens": limit}}  # fmt: skip
    reply = await client(stack).chat.completions.create(**ask)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == limit
    assert [c.function.name for c in choice.message.tool_calls] == ["set_unit"]
    assert "<tool_call>" not in (choice.message.content or "")
    stream = await client(stack).chat.completions.create(**ask, stream=True)
    heads, content, reason = [], "", None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        heads += [c for c in delta.tool_calls or [] if c.id]
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "length" and heads and heads[0].function.name == "set_unit"
    assert "<tool_call>" not in content


async def test_streamed_arguments_arrive_in_pieces(stack: TinyStack) -> None:
    stream = await client(stack).chat.completions.create(
        model="tiny", messages=ASK, tools=[CITY], stream=True, max_tokens=50,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    heads, fragments, reason = [], [], None
    async for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            assert call.index == 0
            if call.id:
                heads.append(call.function.name)
            elif call.function and call.function.arguments:
                assert heads, "the arguments came before the call's id and name"
                fragments.append(call.function.arguments)
        reason = chunk.choices[0].finish_reason or reason
    assert heads == ["get_weather"] and reason == "tool_calls"
    assert len(fragments) >= 3
    assert set(json.loads("".join(fragments))) == {"city"}


async def test_chat_template_kwargs_reach_the_template(stack: TinyStack) -> None:
    import openai

    async def prompt_tokens(**extra: Any) -> int:
        reply = await client(stack).chat.completions.create(
            model="tiny", messages=ASK, max_tokens=1, **extra)
        return int(reply.usage.prompt_tokens)

    plain = await prompt_tokens()
    no_thinking = await prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    thinking = await prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert no_thinking > plain == thinking
    with pytest.raises(openai.BadRequestError) as info:
        await prompt_tokens(extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert info.value.body["param"] == "chat_template_kwargs.add_generation_prompt"
    with pytest.raises(openai.BadRequestError) as info:
        await prompt_tokens(extra_body={"chat_template_kwargs": ["enable_thinking"]})
    assert info.value.body["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("fmt", ["qwen3_coder", "pythonic", "deepseek_v3", "mistral"])
async def test_every_format_is_forced_parsed_and_streamed(folder: Path, fmt: str) -> None:
    """``--tool-call-parser`` set to each format on a gateway of its own: the grammar the engine
    follows (SmolLM2's tokenizer, markers as text) and the parser that reads its tokens agree."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with tiny_stack(folder, chat_template=TEMPLATE,
                          gateway_options={"tool_call_parser": fmt}) as served:  # fmt: skip
        reply = await client(served).chat.completions.create(
            model="tiny", messages=ASK, tools=[CITY], tool_choice=named, max_tokens=120)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city"}
        stream = await client(served).chat.completions.create(
            model="tiny", messages=ASK, tools=[CITY], tool_choice=named, max_tokens=120,
            stream=True)  # fmt: skip
        heads, arguments, reason = [], "", None
        async for chunk in stream:
            for call in chunk.choices[0].delta.tool_calls or []:
                heads += [call.function.name] if call.id else []
                arguments += (call.function.arguments or "") if call.function else ""
            reason = chunk.choices[0].finish_reason or reason
        assert heads == ["get_weather"] and reason == "tool_calls"
        assert set(json.loads(arguments)) == {"city"}


async def test_the_served_template_has_qwen3s_thinking_switch() -> None:
    from services.tokenizer.chat_template import ChatTemplate

    render = ChatTemplate(TEMPLATE).render
    assert render(ASK, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(ASK).endswith("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"function": {
        "name": "set_unit", "arguments": {"unit": "C"}}}]}, {"role": "tool", "content": "ok"}]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "set_unit", "arguments": {"unit": "C"}}'
            "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nok\n</tool_response>"
            in render(history, tools=[UNIT]))  # fmt: skip
