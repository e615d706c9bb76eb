"""Tool calling at the gateway, without a model: request parsing, the formats' parsers (whole and
streamed, fed one character at a time), the renderer's OpenAI shapes, and the grammars that
enforce ``required`` / named choices (checked with llguidance against the default model's
tokenizer where it is installed, else against a byte tokenizer of the library)."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgumentError
from services.gateway.choice import ChoiceEvent
from services.gateway.openai_requests import parse_chat_request
from services.gateway.renderers import ChatRenderer
from services.gateway.tool_calls import (
    StreamedCalls,
    ToolsRequest,
    choose_format,
    parse_calls,
    parse_tools,
    tool_grammar,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
SERVED = ["m"]


def chat(**fields: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_requests_parse() -> None:
    req = parse_chat_request(chat(tools=[WEATHER, TIME], tool_choice="required",
                                  parallel_tool_calls=False), served_models=SERVED)  # fmt: skip
    assert req.tools is not None and req.tools.forced and not req.tools.parallel
    assert [t.name for t in req.tools.tools] == ["get_weather", "get_time"]
    named = parse_chat_request(chat(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), served_models=SERVED)
    assert named.tools is not None and named.tools.choice == "get_weather"
    history = parse_chat_request({"model": "m", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]}, served_models=SERVED)
    assert history.messages[1].tool_calls[0].arguments == '{"city": "Paris"}'
    assert '{"city": "Paris"}' in history.texts()  # the input filter sees earlier arguments


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "code"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])  # fmt: skip
def test_bad_tool_requests(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        parse_chat_request(chat(**fields), served_models=SERVED)
    assert info.value.param == param


HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
                "</tool_call>")  # fmt: skip


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), [
    ("hermes", HERMES_REPLY, "Let me check.",
     [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    ("hermes", "No tools needed: it is <b>sunny</b>.", "No tools needed: it is <b>sunny</b>.", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", "It is sunny.", "It is sunny.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]', "",
     [("get_time", {"zone": "UTC"})]),
])  # fmt: skip
def test_parsers_whole_and_streamed(fmt: str, text: str, content: str, calls: list[tuple[str, dict[str, object]]]) -> None:  # fmt: skip
    got_content, got = parse_calls(text, fmt)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls
    stream = StreamedCalls(fmt)  # one character at a time: every hold-back boundary
    streamed_text, streamed = "", []
    for ch in text:
        piece, done = stream.feed(ch)
        streamed_text += piece
        streamed += done
    piece, done = stream.finish()
    streamed_text += piece
    streamed += done
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == calls
    assert streamed_text.strip() == content


def test_a_cut_reply_keeps_its_complete_calls() -> None:
    """Cut by max_tokens inside the second call: the first stays a call, finish_reason stays
    "length", and the cut call's markup is not returned as content (whole or streamed)."""
    cut = HERMES_REPLY[: HERMES_REPLY.index('"zone"')]
    assert parse_calls(cut, "hermes", truncated=True)[1][0].name == "get_weather"
    whole = ChatRenderer(request_id="r", model="m", n=1, logprobs=False, tool_format="hermes")
    whole.add(ChoiceEvent(0, cut, finish_reason="length"))
    choice = whole.response({})["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Let me check."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    streamed = ChatRenderer(request_id="r", model="m", n=1, logprobs=False, tool_format="hermes")
    chunks = [c for ch in cut for c in streamed.event_chunks(ChoiceEvent(0, ch))]
    chunks += streamed.event_chunks(ChoiceEvent(0, "", finish_reason="length"))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert "<tool_call>" not in text and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_renderer_shapes() -> None:
    renderer = ChatRenderer(request_id="r", model="m", n=1, logprobs=False, tool_format="hermes")
    chunks = []
    for i in range(0, len(HERMES_REPLY), 7):
        chunks += renderer.event_chunks(ChoiceEvent(0, HERMES_REPLY[i : i + 7]))
    chunks += renderer.event_chunks(ChoiceEvent(0, "", finish_reason="stop"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    heads = [c for c in calls if "id" in c]  # id, type and name first, as OpenAI streams them
    assert [(c["index"], c["function"]["name"], c["type"]) for c in heads] == [
        (0, "get_weather", "function"), (1, "get_time", "function")]
    assert heads[0]["id"].startswith("call_") and heads[0]["function"]["arguments"] == ""
    fragments = [[c["function"]["arguments"] for c in calls if c["index"] == i and "id" not in c]
                 for i in (0, 1)]  # fmt: skip
    assert all(len(f) > 2 for f in fragments)  # the arguments stream as they are written
    assert [json.loads("".join(f)) for f in fragments] == [{"city": "Paris"}, {"zone": "CET"}]
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Let me check."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = ChatRenderer(request_id="r", model="m", n=1, logprobs=False, tool_format="hermes")
    whole.add(ChoiceEvent(0, HERMES_REPLY, finish_reason="stop"))
    message = whole.response({})["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["content"] == "Let me check."
    assert [c["function"]["name"] for c in message["message"]["tool_calls"]] == ["get_weather",
                                                                               "get_time"]


def test_format_from_the_template() -> None:
    assert choose_format("auto", "{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"
    assert choose_format("auto", "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert choose_format("auto", "{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert choose_format("auto", '{% if tools %}<|python_tag|>{"parameters"}{% endif %}') == "llama3_json"
    assert choose_format("llama3_json", "") == "llama3_json"


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_forcing_grammars_accept_calls_only(fmt: str) -> None:
    import llguidance

    tools = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required",
                         "parallel_tool_calls": False})  # fmt: skip
    assert isinstance(tools, ToolsRequest)
    grammar = tool_grammar(tools, fmt)
    tokenizer = llguidance.LLTokenizer("byte")  # one token per byte: text in, text checked

    def accepts(text: str, grammar: str = grammar) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    key = "parameters" if fmt == "llama3_json" else "arguments"
    call = '{"name": "get_weather", "%s": {"city": "Rome"}}' % key
    good = {"hermes": f"<tool_call>\n{call}\n</tool_call>", "llama3_json": call,
            "mistral": f"[TOOL_CALLS][{call}]"}[fmt]  # fmt: skip
    assert accepts(good)
    assert parse_calls(good, fmt)[1][0].name == "get_weather"
    assert not accepts("Sure! " + good)  # required: nothing but calls
    assert not accepts(good.replace("Rome", "Rome\", \"extra\": \"x"))  # parameters' schema
    if fmt == "mistral":  # one call unless parallel calls are allowed
        two = f"[TOOL_CALLS][{call}, {call}]"
        assert not accepts(two)
        parallel = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
        assert parallel is not None and accepts(two, tool_grammar(parallel, fmt))
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}})
    assert named is not None
    only_time = tool_grammar(named, fmt)
    matcher = llguidance.LLMatcher(tokenizer, only_time)
    assert not matcher.consume_tokens(list(good.encode()))


def test_mistral_marker_is_its_special_token() -> None:
    """Where ``[TOOL_CALLS]`` is one special token (Mistral's tokenizers), a forced call starts
    with that token, not the marker spelled out in text pieces."""
    import llguidance
    from tokenizers import Tokenizer as HFTokenizer

    from services.common.model_source import resolve_model
    from services.tokenizer.tokenizer import Tokenizer

    hf = HFTokenizer.from_str(Tokenizer.load(resolve_model("default")).to_json())
    hf.add_special_tokens(["[TOOL_CALLS]"])
    mark = hf.token_to_id("[TOOL_CALLS]")
    tokenizer = llguidance.LLTokenizer(hf.to_str(), n_vocab=hf.get_vocab_size())
    tools = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    assert tools is not None
    grammar = tool_grammar(tools, "mistral", {"[TOOL_CALLS]": mark})
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert matcher.validate_tokens([mark]) == 1
    assert matcher.validate_tokens([hf.token_to_id("[")]) == 0
    body = hf.encode('[{"name": "get_weather", "arguments": {"city": "Rome"}}]',
                     add_special_tokens=False).ids  # fmt: skip
    assert matcher.consume_tokens([mark, *body]) and matcher.is_accepting()


# Qwen2.5's tool-calling chat template (the parts that render tools, calls and tool turns).
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]  # fmt: skip


@pytest.mark.slow
def test_a_tool_template_renders_as_transformers_does() -> None:
    """The gateway's messages through the tokenizer service's dicts and our template renderer
    equal transformers' rendering of the same OpenAI conversation (arguments as objects)."""
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    from services.gateway.completions import _chat_messages
    from services.tokenizer.chat_template import ChatTemplate
    from services.tokenizer.servicer import _message_dict, _tools

    req = parse_chat_request({"model": "m", "messages": HISTORY, "tools": [WEATHER, TIME]},
                             served_models=SERVED)  # fmt: skip
    assert req.tools is not None
    messages, tools_json = _chat_messages(req, req.tools, QWEN_TEMPLATE)
    ours = ChatTemplate(QWEN_TEMPLATE).render([_message_dict(m) for m in messages],
                                              add_generation_prompt=True, special_tokens={},
                                              tools=_tools(tools_json))  # fmt: skip
    reference = [dict(m, content=m["content"] or "") for m in HISTORY]
    reference[1]["tool_calls"] = [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    (theirs,), _ = render_jinja_template(conversations=[reference], tools=[WEATHER, TIME],
                                         chat_template=QWEN_TEMPLATE, add_generation_prompt=True)
    assert ours == theirs
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in ours
    assert "<tool_response>\n18 C\n</tool_response>" in ours and '"name": "get_time"' in ours
    assert choose_format("auto", QWEN_TEMPLATE) == "hermes"


def test_a_template_without_tools_gets_the_instructions() -> None:
    from services.gateway.completions import _chat_messages

    req = parse_chat_request({"model": "m", "messages": HISTORY, "tools": [WEATHER]},
                             served_models=SERVED)  # fmt: skip
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    messages, tools_json = _chat_messages(req, req.tools, plain)
    assert tools_json == "" and messages[0].role == "system"
    assert '"name": "get_weather"' in messages[0].content and "<tool_call>" in messages[0].content
    assert messages[2].content == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"city": "Paris"}}\n</tool_call>')  # fmt: skip
    assert messages[3].role == "user" and "<tool_response>\n18 C" in messages[3].content


@pytest.mark.parametrize(("parser", "text", "reasoning", "answer"), [
    ("qwen3", "<think>\nLet me add.\n2+2=4\n</think>\n\nIt is 4.", "\nLet me add.\n2+2=4\n", "It is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),
    ("qwen3", "<think>still thinking", "still thinking", ""),
    ("deepseek_r1", "Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    ("deepseek_r1", "<think>Hmm.</think>\nFour.", "Hmm.", "Four."),
    ("deepseek_r1", "no end in sight", "no end in sight", ""),
])  # fmt: skip
def test_reasoning_is_split_whole_and_streamed(parser: str, text: str, reasoning: str, answer: str) -> None:  # fmt: skip
    from services.gateway.reasoning import ReasoningSplitter, split_reasoning

    assert split_reasoning(text, parser) == (reasoning, answer)
    splitter = ReasoningSplitter(parser)
    got_reasoning = got_answer = ""
    for ch in text:
        r, a = splitter.feed(ch)
        got_reasoning, got_answer = got_reasoning + r, got_answer + a
    r, a = splitter.finish()
    assert (got_reasoning + r, got_answer + a) == (reasoning, answer)


def test_renderer_splits_reasoning_before_tool_calls() -> None:
    reply = "<think>I should look it up.</think>\n" + HERMES_REPLY
    streamed = ChatRenderer(request_id="r", model="m", n=1, logprobs=False, tool_format="hermes",
                            reasoning="qwen3")  # fmt: skip
    chunks = []
    for i in range(0, len(reply), 5):
        chunks += streamed.event_chunks(ChoiceEvent(0, reply[i : i + 5]))
    chunks += streamed.event_chunks(ChoiceEvent(0, "", finish_reason="stop"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "I should look it up."
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Let me check."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = ChatRenderer(request_id="r", model="m", n=1, logprobs=False, tool_format="hermes",
                         reasoning="qwen3")  # fmt: skip
    whole.add(ChoiceEvent(0, reply, finish_reason="stop"))
    message = whole.response({})["choices"][0]["message"]
    assert message["reasoning_content"] == "I should look it up."
    assert message["content"] == "Let me check." and len(message["tool_calls"]) == 2
