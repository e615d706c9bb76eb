"""OpenAI request parsing: chat and text completions, defaults, every option, a table of malformed
bodies -> the ``param`` named. The response builders are tests/test_gateway_response_builders.py."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from services.common.errors import InvalidArgumentError, NotFoundError
from services.gateway.openai_requests import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    UNBOUNDED_MAX_TOKENS,
    ChatMessage,
    parse_chat_request,
    parse_completion_request,
)

MODEL = "smollm2"
SERVED = [MODEL]
USER = [{"role": "user", "content": "hi"}]
TEXT_A = {"type": "text", "text": "a"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


def comp(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon", **fields}


def test_gateway_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import services.gateway.openai_requests, services.gateway.openai_responses\n"
        "import services.gateway.safety\n"
        "import services.gateway.auth, services.gateway.rate_limit\n"
        "import services.gateway.sse, services.gateway.http_errors\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- chat parsing


def test_chat_defaults() -> None:
    req = parse_chat_request(chat(), served_models=SERVED)
    assert req.model == MODEL
    assert req.messages == (ChatMessage("user", "hi"),)
    assert req.max_tokens is None
    assert req.sampling.max_tokens == UNBOUNDED_MAX_TOKENS
    assert req.sampling.temperature == 1.0
    assert req.sampling.logprobs is None
    assert (req.stream, req.include_usage, req.logprobs, req.user) == (False, False, False, None)


def test_chat_full_request() -> None:
    body = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [TEXT_A, {"type": "text", "text": "b"}]},
            {"role": "user", "content": "q", "name": "bob"},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ],
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        max_tokens=10,
        max_completion_tokens=20,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        seed=7,
        stop="###",
        stop_token_ids=[2],
        ignore_eos=True,
        min_tokens=3,
        n=2,
        logprobs=True,
        top_logprobs=5,
        user="u-1",
        unknown_field_is_ignored={"x": 1},
    )
    req = parse_chat_request(body, served_models=SERVED)
    assert [m.role for m in req.messages] == ["system", "developer", "user", "assistant", "tool"]
    assert req.messages[1].content == "a\nb"
    assert req.messages[2].to_dict() == {"role": "user", "content": "q", "name": "bob"}
    assert req.messages[3].content == ""
    assert req.messages[4].tool_call_id == "call_1"
    assert req.texts()[0] == "Be brief."
    assert req.stream and req.include_usage and req.logprobs
    assert req.max_tokens == 20  # max_completion_tokens wins
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.0, 0.9, 40, 0.05)
    assert s.greedy and s.n == 2  # n > 1 with greedy is allowed
    assert (s.max_tokens, s.min_tokens, s.seed) == (20, 3, 7)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert s.stop == ("###",) and s.stop_token_ids == (2,) and s.ignore_eos
    assert s.logprobs == 5
    assert req.user == "u-1"


def test_chat_logprobs_without_top_means_zero() -> None:
    req = parse_chat_request(chat(logprobs=True), served_models=SERVED)
    assert req.sampling.logprobs == 0
    req = parse_chat_request(chat(logprobs=False, max_tokens=5), served_models=SERVED)
    assert req.sampling.logprobs is None and req.max_tokens == 5


def test_nulls_mean_unset() -> None:
    body = chat(temperature=None, max_tokens=None, stop=None, n=None, seed=None, stream=None)
    req = parse_chat_request(body, served_models=SERVED)
    assert req.sampling.temperature == 1.0 and req.max_tokens is None and req.sampling.n == 1


def test_unknown_model_is_404() -> None:
    with pytest.raises(NotFoundError) as info:
        parse_chat_request(chat(model="gpt-9"), served_models=SERVED)
    err = info.value
    assert (err.http_status, err.param, err.code) == (404, "model", "model_not_found")
    assert "gpt-9" in err.message
    with pytest.raises(NotFoundError):
        parse_completion_request(comp(model="gpt-9"), served_models=SERVED)


BAD_CHAT: list[tuple[str, object, str | None]] = [
    ("list body", [1, 2], None),
    ("string body", "hello", None),
    ("null body", None, None),
    ("missing model", {"messages": USER}, "model"),
    ("model not string", chat(model=3), "model"),
    ("missing messages", {"model": MODEL}, "messages"),
    ("messages not list", chat(messages="hi"), "messages"),
    ("empty messages", chat(messages=[]), "messages"),
    ("message not object", chat(messages=["hi"]), "messages[0]"),
    ("missing role", chat(messages=[{"content": "x"}]), "messages[0].role"),
    ("bad role", chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    ("role not string", chat(messages=[{"role": 1, "content": "x"}]), "messages[0].role"),
    ("missing content", chat(messages=[USER[0], {"role": "user"}]), "messages[1].content"),
    ("content number", chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    ("content no parts", chat(messages=[{"role": "user", "content": []}]), "messages[0].content"),
    (
        "image part",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages[0].content[0].type",
    ),
    (
        "part without text",
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages[0].content[0].text",
    ),
    (
        "name not string",
        chat(messages=[{"role": "user", "content": "x", "name": 1}]),
        "messages[0].name",
    ),
    ("temperature string", chat(temperature="0.5"), "temperature"),
    ("temperature bool", chat(temperature=True), "temperature"),
    ("temperature negative", chat(temperature=-0.1), "temperature"),
    ("temperature huge", chat(temperature=1000), "temperature"),
    ("top_p zero", chat(top_p=0), "top_p"),
    ("top_p above one", chat(top_p=1.5), "top_p"),
    ("top_k float", chat(top_k=1.5), "top_k"),
    ("top_k below -1", chat(top_k=-2), "top_k"),
    ("min_p above one", chat(min_p=2), "min_p"),
    ("max_tokens negative", chat(max_tokens=-1), "max_tokens"),
    ("max_tokens zero", chat(max_tokens=0), "max_tokens"),
    ("max_tokens string", chat(max_tokens="10"), "max_tokens"),
    ("max_tokens bool", chat(max_tokens=True), "max_tokens"),
    ("max_tokens decimal", chat(max_tokens=10.0), "max_tokens"),
    ("max_completion_tokens zero", chat(max_completion_tokens=0), "max_completion_tokens"),
    ("presence_penalty range", chat(presence_penalty=3), "presence_penalty"),
    ("frequency_penalty range", chat(frequency_penalty=-3), "frequency_penalty"),
    ("repetition_penalty zero", chat(repetition_penalty=0), "repetition_penalty"),
    ("seed string", chat(seed="1"), "seed"),
    ("seed too big", chat(seed=2**70), "seed"),
    ("stop number", chat(stop=5), "stop"),
    ("stop list of numbers", chat(stop=[1]), "stop"),
    ("stop empty string", chat(stop=[""]), "stop"),
    ("stop too many", chat(stop=[str(i) for i in range(17)]), "stop"),
    ("stop_token_ids strings", chat(stop_token_ids=["a"]), "stop_token_ids"),
    ("stop_token_ids negative", chat(stop_token_ids=[-1]), "stop_token_ids"),
    ("ignore_eos string", chat(ignore_eos="yes"), "ignore_eos"),
    ("min_tokens negative", chat(min_tokens=-1), "min_tokens"),
    ("min_tokens above max", chat(min_tokens=10, max_tokens=5), "min_tokens"),
    ("n zero", chat(n=0), "n"),
    ("n too many", chat(n=1000), "n"),
    ("stream string", chat(stream="true"), "stream"),
    ("stream_options, no stream", chat(stream_options={"include_usage": True}), "stream_options"),
    ("stream_options not object", chat(stream=True, stream_options=True), "stream_options"),
    (
        "include_usage not bool",
        chat(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
    ),
    ("logprobs int in chat", chat(logprobs=1), "logprobs"),
    ("top_logprobs without logprobs", chat(top_logprobs=2), "top_logprobs"),
    ("top_logprobs too many", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("top_logprobs negative", chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("user not string", chat(user=1), "user"),
    ("tools without function", chat(tools=[{"type": "function"}]), "tools[0].function"),
    ("functions (deprecated)", chat(functions=[{"name": "f"}]), "functions"),
    ("response_format not object", chat(response_format="json"), "response_format"),
    ("response_format type", chat(response_format={"type": "xml"}), "response_format.type"),
    ("json_schema missing", chat(response_format={"type": "json_schema"}),
     "response_format.json_schema"),
    ("schema rejected", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}), "response_format"),
    ("regex rejected", chat(structured_outputs={"regex": "a(b"}), "structured_outputs"),
    ("lark rejected", chat(guided_grammar="start: foo"), "guided_grammar"),
    ("choice empty", chat(guided_choice=[]), "guided_choice"),
    ("two kinds in structured_outputs", chat(structured_outputs={"regex": "a", "choice": ["b"]}),
     "structured_outputs"),
    ("two constraints", chat(response_format={"type": "json_object"}, guided_regex="a+"),
     "guided_regex"),
    ("guided_json not json", chat(guided_json="{nope"), "guided_json"),
    ("schema too large", chat(guided_json={"enum": ["x" * 1000] * 300}), "guided_json"),
    ("logit_bias not object", chat(logit_bias=[1]), "logit_bias"),
    ("logit_bias key", chat(logit_bias={"abc": 1}), "logit_bias"),
    ("logit_bias value", chat(logit_bias={"5": 101}), "logit_bias"),
    ("logit_bias value type", chat(logit_bias={"5": "1"}), "logit_bias.5"),
]


@pytest.mark.parametrize(("body", "param"), [c[1:] for c in BAD_CHAT], ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_bodies(body: object, param: str | None) -> None:
    from services.gateway.structured_outputs import compile_source

    with pytest.raises(InvalidArgumentError) as info:
        parsed = parse_chat_request(body, served_models=SERVED)
        if parsed.grammar_source is not None:  # the gateway compiles it in its grammar pool
            compile_source(parsed.grammar_source)
    err = info.value
    assert err.param == param, err.message
    assert err.http_status == 400 and err.to_openai()["error"]["param"] == param
    assert err.message


def test_error_messages_follow_openai_wording() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        parse_chat_request({"messages": USER}, served_models=SERVED)
    assert info.value.message == "Missing required parameter: 'model'."
    assert info.value.code == "missing_required_parameter"
    with pytest.raises(InvalidArgumentError) as info:
        parse_chat_request(chat(temperature="hot"), served_models=SERVED)
    assert info.value.message == (
        "Invalid type for 'temperature': expected a decimal, but got a string instead."
    )
    assert info.value.code == "invalid_type"
    with pytest.raises(InvalidArgumentError) as info:
        parse_chat_request(chat(messages=[]), served_models=SERVED)
    assert info.value.code == "empty_array"


def test_benign_extras_are_accepted() -> None:
    body = chat(response_format={"type": "text"}, logit_bias={}, tools=[], tool_choice="none")
    req = parse_chat_request(body, served_models=SERVED)
    assert req.sampling.grammar is None and req.sampling.logit_bias == ()


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                         "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}},
    {"structured_outputs": {"json": {"type": "array"}}},
    {"structured_outputs": {"regex": "[0-9]{3}"}},
    {"structured_outputs": {"choice": ["yes", "no (really)"]}},
    {"structured_outputs": {"grammar": 'start: "a"+'}},
    {"guided_json": '{"type": "string"}'}, {"guided_regex": "x+"}, {"guided_choice": ["a"]},
    {"guided_grammar": 'root ::= "yes" | "no"'},  # GBNF, converted to Lark
], ids=lambda f: next(iter(f)) + ":" + json.dumps(next(iter(f.values())))[:24])
def test_output_constraints_compile_to_a_grammar(fields: dict[str, object]) -> None:
    import llguidance

    for parse, body in ((parse_chat_request, chat(**fields)),
                        (parse_completion_request, comp(**fields))):  # fmt: skip
        from services.gateway.structured_outputs import compile_source

        parsed = parse(body, served_models=SERVED)
        assert parsed.sampling.grammar is None and parsed.grammar_source is not None
        grammar = compile_source(parsed.grammar_source)  # what the grammar pool runs
        assert grammar and not llguidance.LLMatcher.validate_grammar(grammar)


def test_logit_bias_is_parsed_sorted() -> None:
    req = parse_chat_request(chat(logit_bias={"9": 5, "2": -100.0}), served_models=SERVED)
    assert req.sampling.logit_bias == ((2, -100.0), (9, 5.0))


# --------------------------------------------------------------------------- completions parsing


def test_completion_defaults() -> None:
    req = parse_completion_request(comp(), served_models=SERVED)
    assert req.prompt == "Once upon"
    assert req.sampling.max_tokens == COMPLETION_DEFAULT_MAX_TOKENS == 16
    assert not req.echo and req.sampling.logprobs is None
    assert req.texts() == ("Once upon",)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("abc", "abc"),
        (["abc"], "abc"),
        ([1, 2, 3], (1, 2, 3)),
        ([[4, 5]], (4, 5)),
    ],
)
def test_completion_prompt_forms(prompt: object, expected: object) -> None:
    req = parse_completion_request(comp(prompt=prompt), served_models=SERVED)
    assert req.prompt == expected
    if isinstance(expected, tuple):
        assert req.texts() == ()


def test_completion_options() -> None:
    body = comp(echo=True, logprobs=3, max_tokens=5, stream=True, best_of=2, n=2, user="x")
    req = parse_completion_request(body, served_models=SERVED)
    assert req.echo and req.sampling.logprobs == 3 and req.sampling.max_tokens == 5
    assert req.stream and req.sampling.n == 2 and req.user == "x"


BAD_COMPLETION: list[tuple[str, object, str | None]] = [
    ("array body", [comp()], None),
    ("missing prompt", {"model": MODEL}, "prompt"),
    ("empty prompt", comp(prompt=""), "prompt"),
    ("empty list prompt", comp(prompt=[]), "prompt"),
    ("prompt number", comp(prompt=5), "prompt"),
    ("prompt object", comp(prompt={"text": "x"}), "prompt"),
    ("batch of strings", comp(prompt=["a", "b"]), "prompt"),
    ("batch of id lists", comp(prompt=[[1], [2]]), "prompt"),
    ("mixed ids", comp(prompt=[1, "a"]), "prompt"),
    ("negative id", comp(prompt=[1, -5]), "prompt"),
    ("bool id", comp(prompt=[True]), "prompt[0]"),
    ("logprobs bool", comp(logprobs=True), "logprobs"),
    ("logprobs too many", comp(logprobs=6), "logprobs"),
    ("logprobs negative", comp(logprobs=-1), "logprobs"),
    ("max_tokens zero", comp(max_tokens=0), "max_tokens"),
    ("max_tokens negative", comp(max_tokens=-5), "max_tokens"),
    ("echo string", comp(echo="no"), "echo"),
    ("suffix", comp(suffix="end"), "suffix"),
    ("best_of differs", comp(best_of=3), "best_of"),
    ("temperature string", comp(temperature="1"), "temperature"),
]


@pytest.mark.parametrize(
    ("body", "param"), [c[1:] for c in BAD_COMPLETION], ids=[c[0] for c in BAD_COMPLETION]
)
def test_bad_completion_bodies(body: object, param: str | None) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        parse_completion_request(body, served_models=SERVED)
    assert info.value.param == param, info.value.message
