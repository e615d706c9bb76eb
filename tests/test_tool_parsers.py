"""The tool-call formats added to the hermes / llama3_json / mistral ones: ``qwen3_coder``,
``pythonic`` and ``deepseek_v3``, each against its model's real chat template.

The templates (``tests/chat_templates/``) are the tool templates vLLM ships in ``examples/``:
Qwen3-Coder's own, Llama 3.2's pythonic one, and DeepSeek-V3's (its calls written exactly as
the model's own template writes them back, plus the tool list in the system prompt). For each
format: ``auto`` picks it from the template; the template's rendering of an earlier call parses
back into that call; a reply as the model writes it parses whole and fed one character at a
time (arguments arriving in several deltas where they are JSON text in the output); a reply cut
by ``max_tokens`` keeps its complete calls and drops the markup of the cut one; and the grammar
that enforces ``required`` / named choices accepts such replies only (a named one: exactly one
call), also behind a reasoning block.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.gateway.reasoning_grammar import after_reasoning
from services.gateway.tool_calls import ToolsRequest, choose_format, parse_calls, parse_tools, tool_grammar
from services.gateway.tool_parsers import new_parser
from services.tokenizer.chat_template import ChatTemplate
from services.tokenizer.servicer import _message_dict, _tools
from services.common.pb import common_pb2

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["C", "F"]},
        "hourly": {"type": "boolean"}, "spots": {"type": "array", "items": {"type": "string"}}},
        "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
DS = {k.replace("\u2581", "_"): f"<\uff5ctool\u2581{k}\uff5c>" for k in
      ("calls\u2581begin", "calls\u2581end", "call\u2581begin", "call\u2581end", "sep")}  # fmt: skip


def ds_call(name: str, args: str) -> str:
    return (f"{DS['call_begin']}function{DS['sep']}{name}\n```json\n{args}\n```"
            f"{DS['call_end']}")


# A reply as each model writes it: some text (where the format allows it), then two calls.
REPLIES = {
    "qwen3_coder": ("I'll check both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                    "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=hourly>\n"
                    "true\n</parameter>\n<parameter=spots>\n[\"Louvre\", \"Orsay\"]\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>"
                    "\nEurope/Paris\n</parameter>\n</function>\n</tool_call>"),
    "pythonic": ('[get_weather(city="Paris", days=3, hourly=True, spots=["Louvre", "Orsay"]), '
                 "get_time(zone='Europe/Paris')]"),
    "deepseek_v3": ("I'll check both." + DS["calls_begin"]
                    + ds_call("get_weather", '{"city": "Paris", "days": 3, "hourly": true, '
                              '"spots": ["Louvre", "Orsay"]}')
                    + "\n" + ds_call("get_time", '{"zone": "Europe/Paris"}')
                    + DS["calls_end"]),
}  # fmt: skip
CONTENT = {"qwen3_coder": "I'll check both.", "pythonic": "", "deepseek_v3": "I'll check both."}
EXPECTED = [("get_weather", {"city": "Paris", "days": 3, "hourly": True, "spots": ["Louvre", "Orsay"]}),
            ("get_time", {"zone": "Europe/Paris"})]  # fmt: skip
TEMPLATE_FILES = {"qwen3_coder": "qwen3_coder.jinja", "pythonic": "llama3.2_pythonic.jinja",
                  "deepseek_v3": "deepseek_v3.jinja"}  # fmt: skip
FORMATS = list(REPLIES)


def tools() -> ToolsRequest:
    request = parse_tools({"tools": [WEATHER, TIME]})
    assert request is not None
    return request


def template(fmt: str) -> str:
    return (TEMPLATES / TEMPLATE_FILES[fmt]).read_text()


def decoded(calls: list) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_template_picks_the_format_and_its_calls_parse_back(fmt: str) -> None:
    source = template(fmt)
    assert choose_format("auto", source) == fmt
    history = [common_pb2.ChatMessage(role="user", content="Weather in Paris for 3 days?"),
               common_pb2.ChatMessage(role="assistant", tool_calls=[common_pb2.ToolCall(
                   id="call_1", name="get_weather", arguments='{"days": 3}')]),
               common_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="18 C")]  # fmt: skip
    tools_json = json.dumps([t.to_openai() for t in tools().tools])
    prompt = ChatTemplate(source).render([_message_dict(m) for m in history],
                                         add_generation_prompt=True, tools=_tools(tools_json),
                                         special_tokens={"bos_token": "<s>"})  # fmt: skip
    assert "get_time" in prompt and "Weather in Paris for 3 days?" in prompt
    start, end = {  # where the template wrote the assistant turn's call
        "qwen3_coder": (prompt.rfind("<tool_call>"), prompt.rfind("</tool_call>") + 12),
        "pythonic": (prompt.find("[get_weather"), prompt.find(")]", prompt.find("[get_")) + 2),
        "deepseek_v3": (prompt.rfind(DS["calls_begin"]), prompt.rfind(DS["calls_end"])),
    }[fmt]  # fmt: skip
    assert 0 <= start < end
    written = prompt[start:end]
    content, calls = parse_calls(written, fmt, tools().tools)
    assert content == "" and decoded(calls) == [("get_weather", {"days": 3})]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_reply_parses_whole_and_one_character_at_a_time(fmt: str) -> None:
    text = REPLIES[fmt]
    content, calls = parse_calls(text, fmt, tools().tools)
    assert content == CONTENT[fmt] and decoded(calls) == EXPECTED
    parser = new_parser(fmt, tools().tools)
    streamed, heads, fragments = "", [], {0: [], 1: []}
    for ch in text:
        delta = parser.feed(ch)
        streamed += delta.content
        for call in delta.calls:
            if call.id is not None:
                heads.append((call.index, call.name))
                assert call.arguments == "" and not fragments[call.index]  # the head comes first
            elif call.arguments:
                fragments[call.index].append(call.arguments)
    rest = parser.finish()
    streamed += rest.content
    for call in rest.calls:
        fragments[call.index].append(call.arguments)
    assert streamed.strip() == CONTENT[fmt]
    assert heads == [(0, "get_weather"), (1, "get_time")]
    assert [json.loads("".join(f)) for f in fragments.values()] == [args for _, args in EXPECTED]
    assert ["".join(f) for f in fragments.values()] == [c.arguments for c in parser.calls]
    if fmt == "deepseek_v3":  # JSON text in the output: it streams as it is written
        assert min(len(f) for f in fragments.values()) > 5
    elif fmt == "qwen3_coder":  # one finished parameter at a time
        assert len(fragments[0]) >= 4


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_cut_reply_keeps_its_complete_calls(fmt: str) -> None:
    text = REPLIES[fmt]
    cut = text[: text.index("get_time") + 6]  # inside the second call
    content, calls = parse_calls(cut, fmt, tools().tools, truncated=True)
    assert decoded(calls) == EXPECTED[:1] and content == CONTENT[fmt]
    assert "get_ti" not in content
    # ended there by the model (a stop string): the unfinished call is not a call, and its
    # text is not lost but returned as content
    content, calls = parse_calls(cut, fmt, tools().tools)
    assert "get_time" not in [c.name for c in calls] and "get_ti" in content


@pytest.mark.parametrize(("fmt", "text"), [
    ("qwen3_coder", "No call: use <function=x> in XML."),
    ("pythonic", "[1, 2, 3] are numbers."),
    ("pythonic", '[get_weather(city=__import__("os").system("x"))]'),
    ("deepseek_v3", "Plain answer."),
])  # fmt: skip
def test_text_that_is_not_calls_stays_content(fmt: str, text: str) -> None:
    assert parse_calls(text, fmt, tools().tools) == (text.strip(), [])


def test_qwen3_coder_values_follow_the_schema() -> None:
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n  two\nlines \n</parameter>\n"
            "<parameter=days>\nnull\n</parameter>\n<parameter=hourly>\nmaybe\n</parameter>\n"
            "<parameter=spots>\n['a', 'b']\n</parameter>\n<parameter=extra>\n42\n</parameter>\n"
            "</function>\n</tool_call>")  # fmt: skip
    _, calls = parse_calls(text, "qwen3_coder", tools().tools)
    assert json.loads(calls[0].arguments) == {"city": "  two\nlines ", "days": None,
                                              "hourly": "maybe", "spots": ["a", "b"],
                                              "extra": "42"}  # fmt: skip


def accepts(grammar: str, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar, log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


ONE = {"qwen3_coder": REPLIES["qwen3_coder"][18 : REPLIES["qwen3_coder"].index("</tool_call>") + 12],
       "pythonic": REPLIES["pythonic"][: REPLIES["pythonic"].index("),") + 1] + "]",
       "deepseek_v3": REPLIES["deepseek_v3"][16:].split("\n<")[0] + DS["calls_end"]}  # fmt: skip
TWO = {"qwen3_coder": REPLIES["qwen3_coder"][18:],
       "pythonic": REPLIES["pythonic"].replace("'", '"'),
       "deepseek_v3": REPLIES["deepseek_v3"][16:]}  # fmt: skip


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", *FORMATS])
def test_a_named_choice_is_exactly_one_call_in_every_format(fmt: str) -> None:
    """``parallel_tool_calls`` left at its default: ``required`` takes several calls where the
    format has them, a named function exactly one (the bug where a small model repeated its call
    until ``max_tokens``)."""
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert named is not None and required is not None and named.parallel and not named.many
    one = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
           "llama3_json": '{"name": "get_weather", "parameters": {"city": "Rome"}}',
           "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]',
           **ONE}[fmt]  # fmt: skip
    assert accepts(tool_grammar(named, fmt), one) and accepts(tool_grammar(required, fmt), one)
    assert not accepts(tool_grammar(required, fmt), "Sure. " + one)
    assert parse_calls(one, fmt, named.tools)[1][0].name == "get_weather"
    two = {"hermes": one + "\n" + one, "mistral": one[:-1] + ", " + one[13:], **TWO}.get(fmt)
    if two is not None:
        assert accepts(tool_grammar(required, fmt), two)
        assert not accepts(tool_grammar(named, fmt), two)
    for parser in ("qwen3", "deepseek_r1"):  # the grammar holds after the thinking
        wrapped = after_reasoning(tool_grammar(named, fmt), parser)
        assert accepts(wrapped, "<think>\nI need <tool_call> the weather.\n</think>\n\n" + one)
        assert not accepts(wrapped, "<think>hm</think>\nSure. " + one)
    assert accepts(after_reasoning(tool_grammar(named, fmt), "qwen3"), one)


def test_the_forcing_grammars_follow_the_parameters() -> None:
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert required is not None
    qwen = tool_grammar(required, "qwen3_coder")
    call = "<tool_call>\n<function=get_weather>\n{}</function>\n</tool_call>"
    param = "<parameter={}>\n{}\n</parameter>\n"
    assert accepts(qwen, call.format(param.format("city", "Paris\n</param> ok")
                                     + param.format("unit", "C")))  # fmt: skip
    assert not accepts(qwen, call.format(param.format("unit", "C")))  # city is required
    assert not accepts(qwen, call.format(param.format("city", "P") + param.format("days", "x")))
    assert not accepts(qwen, call.format(param.format("city", "P") + param.format("unit", "K")))
    short = parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}}}}],
        "tool_choice": "required"})  # fmt: skip
    assert short is not None
    bounded = "<tool_call>\n<function=f>\n<parameter=s>\n{}\n</parameter>\n</function>\n</tool_call>"
    assert accepts(tool_grammar(short, "qwen3_coder"), bounded.format("abc"))
    assert not accepts(tool_grammar(short, "qwen3_coder"), bounded.format("abcd"))
    pythonic = tool_grammar(required, "pythonic")
    assert accepts(pythonic, '[get_weather(city="Paris", unit="F")]')
    assert not accepts(pythonic, '[get_weather(unit="F")]')
    assert not accepts(pythonic, '[get_weather(city="Paris", days="3")]')
    deepseek = tool_grammar(required, "deepseek_v3")
    assert not accepts(deepseek, DS["calls_begin"] + ds_call("get_weather", '{"days": 3}')
                       + DS["calls_end"])  # fmt: skip


def test_a_response_format_holds_after_the_thinking() -> None:
    """Structured outputs behind a reasoning parser: the thinking is free text up to
    ``</think>``, the answer follows the schema (``none``: the grammar as it was)."""
    from services.gateway.structured_outputs import parse_structured_output

    grammar = parse_structured_output({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                "required": ["n"]}}}})  # fmt: skip
    assert grammar is not None and after_reasoning(grammar, "none") == grammar
    qwen3, r1 = after_reasoning(grammar, "qwen3"), after_reasoning(grammar, "deepseek_r1")
    assert accepts(qwen3, '<think>\nThe answer: {"n": "x"}?\n</think>\n\n{"n": 4}')
    assert accepts(qwen3, '{"n": 4}')  # thinking off (Qwen3's enable_thinking false)
    assert not accepts(qwen3, '<think>x</think>{"n": "x"}')
    assert accepts(r1, 'Four, surely.</think>\n{"n": 4}')
    assert not accepts(r1, '{"n": 4}')  # the template opened the thinking: it must close


@pytest.mark.parametrize("fmt", ["hermes", "pythonic", "qwen3_coder", "deepseek_v3"])
def test_a_long_call_streams_in_linear_time(fmt: str) -> None:
    """A stream re-reads its reply at every delta, so the scans jump between quotes and
    brackets at C speed: a call whose argument is 18 KB of code, fed 4 characters at a time
    (about 5,000 deltas), took 15-20 s with per-character Python loops and well under 1 s now."""
    import time

    code = 'print("x")\n' * 1600
    text = {"hermes": "<tool_call>\n" + json.dumps({"name": "run", "arguments": {"code": code}})
                      + "\n</tool_call>",
            "pythonic": f"[run(code={json.dumps(code)})]",
            "qwen3_coder": f"<tool_call>\n<function=run>\n<parameter=code>\n{code}\n</parameter>\n"
                           "</function>\n</tool_call>",
            "deepseek_v3": DS["calls_begin"] + ds_call("run", json.dumps({"code": code}))
                           + DS["calls_end"]}[fmt]  # fmt: skip
    parser, arguments = new_parser(fmt), ""
    start = time.perf_counter()
    for i in range(0, len(text), 4):
        arguments += "".join(c.arguments for c in parser.feed(text[i : i + 4]).calls)
    arguments += "".join(c.arguments for c in parser.finish().calls)
    assert time.perf_counter() - start < 5.0
    assert json.loads(arguments) == {"code": code if fmt != "qwen3_coder" else code}


@pytest.mark.parametrize("fmt", ["hermes", *FORMATS])
def test_the_engine_follows_a_call_after_the_thinking(fmt: str) -> None:
    """The worker's own compiler (services/engine/core/grammar.py) over the default model's
    tokenizer takes the wrapped grammar: a Qwen3 think block then the call, as that tokenizer
    writes them; the call alone (thinking off); never text before the call."""
    from services.common.model_source import resolve_model
    from services.engine.core.grammar import GrammarCompiler
    from services.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model("default"))
    compiler = GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    assert named is not None
    grammar = after_reasoning(tool_grammar(named, fmt, tokenizer.special_tokens), "qwen3",
                              tokenizer.special_tokens)  # fmt: skip
    one = ONE.get(fmt, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
                       "</tool_call>")  # fmt: skip
    for text, ok in (("<think>\nRome, then.\n</think>\n\n" + one, True), (one, True),
                     ("Sure. " + one, False)):  # fmt: skip
        matcher = compiler.matcher(grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert (matcher.consume_tokens(ids) and matcher.is_accepting()) == ok, text
        if ok:  # and then only the end of the reply
            assert matcher.consume_token(tokenizer.eos_token_ids[0])
