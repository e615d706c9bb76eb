"""``GET /openapi.json`` and the declarations it shares with the request parsers
(``services/gateway/api_schema.py``): checks that the two cannot drift apart.

1. The document is valid OpenAPI 3.1 (Schemathesis validates it against the meta-schema) and
   documents exactly the routes the application serves.
2. The parsers read exactly the declared keys (a recording dict notes every key a parser looks
   up), every declared field with a valid value is accepted, and every declared bound holds on
   the parser itself: at the bound accepted, past it 400 naming the field.
3. Refused features accept only their empty values; unknown fields are ignored on /v1 routes and
   400 on /tokenize and /detokenize, as documented.
4. What the gateway answers validates against the documented response schemas: the builders'
   output, every error class, and live responses and stream events from the fake stack.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import pytest
import schemathesis
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from services.common import errors as tandem_errors
from services.common.errors import InvalidArgumentError, TandemError
from services.gateway.api_schema import (
    CHAT_COMPLETION,
    CHAT_MESSAGE,
    COMPLETION,
    DETOKENIZE,
    MAX_INT32,
    MAX_UINT32,
    STREAM_OPTIONS,
    TEXT_PART,
    TOKENIZE,
    Body,
    Field,
)
from services.gateway.app import build_app
from services.gateway.auth import AuthenticationError
from services.gateway.config import GatewayConfig
from services.gateway.http_errors import HTTPStatusError, RequestTimeoutError, RequestTooLargeError
from services.gateway.openai_requests import parse_chat_request, parse_completion_request
from services.gateway.openapi import openapi_document
from services.gateway.rate_limit import RateLimitError
from tests.gateway_fakes import MODEL, StackFactory, post_raw, sse_events
from tests.tls_identities import tls_for

SERVED = [MODEL]
DOC = openapi_document(served_names=SERVED, vocab_size=1000)
USER = {"role": "user", "content": "hi"}


def schema_validator(doc: Mapping[str, Any], name: str) -> Draft202012Validator:
    """A validator for ``#/components/schemas/<name>`` with the document's references."""
    registry = Registry().with_resource(
        "urn:tandem-openapi", Resource.from_contents(dict(doc), DRAFT202012)
    )
    ref = {"$ref": f"urn:tandem-openapi#/components/schemas/{name}"}
    return Draft202012Validator(ref, registry=registry)


def field_validator(field: Field) -> Draft202012Validator:
    """A validator for one declared field's schema, references resolved in :data:`DOC`."""
    registry = Registry().with_resource("urn:tandem-openapi",
                                        Resource.from_contents(DOC, DRAFT202012))  # fmt: skip
    text = json.dumps(field.json_schema())
    text = text.replace('"#/components', '"urn:tandem-openapi#/components')
    return Draft202012Validator(json.loads(text), registry=registry)


# --------------------------------------------------------------------------- the document


def test_the_document_is_valid_openapi_3_1() -> None:
    for doc in (DOC, openapi_document(), openapi_document(api_keys=True)):
        loaded = schemathesis.openapi.from_dict(doc)
        loaded.validate()  # the OpenAPI 3.1 meta-schema
        assert [op.ok().label for op in loaded.get_all_operations()]
        for schema in doc["components"]["schemas"].values():
            Draft202012Validator.check_schema(schema)
    assert DOC["components"]["schemas"]["ModelName"]["enum"] == SERVED
    assert DOC["components"]["schemas"]["TokenId"]["maximum"] == 999
    assert openapi_document()["components"]["schemas"]["TokenId"]["maximum"] == MAX_UINT32
    chat = openapi_document(api_keys=True)["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"bearerAuth": []}]
    assert "security" not in DOC["paths"]["/v1/chat/completions"]["post"]
    assert set(chat["responses"]) >= {"200", "400", "401", "404", "413", "429", "503"}
    assert chat["responses"]["429"]["headers"]["Retry-After"]["required"]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}


async def test_every_served_route_is_documented_and_nothing_else() -> None:
    app = build_app(GatewayConfig("127.0.0.1:1", (), ("127.0.0.1:2",), tls=tls_for("gateway")))
    served = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.method != "HEAD"}  # fmt: skip
    documented = {(method, path) for path, item in DOC["paths"].items() for method in item}
    assert served == documented


# --------------------------------------------------------------------------- parser == schema


class Recording(dict):  # type: ignore[type-arg]
    """A JSON object that notes every key looked up in it."""

    def __init__(self, data: Mapping[str, Any], seen: set[str]) -> None:
        super().__init__(data)
        self.seen = seen

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.seen.add(str(key))
        return super().__contains__(key)


# One valid value per composite field (scalars get theirs from the declaration).
SAMPLES: dict[str, Any] = {
    "model": MODEL, "messages": [USER], "stream_options": {"include_usage": True},
    "stop": ["###"], "stop_token_ids": [2], "prompt": "Once upon", "tools": [], "functions": [], "tool_choice": "auto",
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}},
    "logit_bias": {"7": -1.5}, "suffix": "",
    # at most one output constraint per request: the other forms are looked up, and null
    "structured_outputs": None, "guided_json": None, "guided_regex": None, "guided_choice": None,
    "guided_grammar": None,
    "content": "hi", "tokens": [1, 2], "chat_template_kwargs": {"enable_thinking": False},
}  # fmt: skip
# Fields that need another to be valid.
COMPANIONS: dict[str, dict[str, Any]] = {
    "top_logprobs": {"logprobs": True}, "stream_options": {"stream": True},
    "min_tokens": {"max_tokens": MAX_INT32}, "best_of": {"n": 1},
}  # fmt: skip
PARSERS: dict[str, Callable[[Any], Any]] = {
    CHAT_COMPLETION.name: lambda body: parse_chat_request(body, served_models=SERVED),
    COMPLETION.name: lambda body: parse_completion_request(body, served_models=SERVED),
}
MINIMAL = {CHAT_COMPLETION.name: {"model": MODEL, "messages": [USER]},
           COMPLETION.name: {"model": MODEL, "prompt": "Once upon"}}  # fmt: skip


def sample(field: Field) -> Any:
    if field.name in SAMPLES:
        return SAMPLES[field.name]
    if field.enum:
        return field.enum[0]
    if field.type == "boolean":
        return True
    if field.type == "string":
        return "x"
    low = field.minimum if field.minimum is not None else 0
    if field.type == "integer":
        return int(low)
    high = field.maximum if field.maximum is not None else low + 1
    return (low + high) / 2


def full_body(body: Body) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in body.fields:
        out.update(COMPANIONS.get(field.name, {}))
        out[field.name] = sample(field)
    return out


@pytest.mark.parametrize("body", [CHAT_COMPLETION, COMPLETION], ids=lambda b: b.name)
def test_the_parser_reads_exactly_the_declared_keys(body: Body) -> None:
    parse = PARSERS[body.name]
    seen: set[str] = set()
    message_keys: set[str] = set()
    part_keys: set[str] = set()
    option_keys: set[str] = set()
    full = full_body(body)
    for variant in (full, {k: v for k, v in full.items() if k != "max_completion_tokens"}):
        wrapped = Recording(variant, seen)
        if "messages" in variant:
            part = Recording({"type": "text", "text": "a"}, part_keys)
            wrapped["messages"] = [Recording({**USER, "content": [part]}, message_keys)]
        wrapped["stream_options"] = Recording(variant["stream_options"], option_keys)
        parse(wrapped)
    assert seen == body.names
    assert option_keys == STREAM_OPTIONS.names
    if body is CHAT_COMPLETION:
        assert message_keys == CHAT_MESSAGE.names
        assert part_keys == TEXT_PART.names


@pytest.mark.parametrize("body", [CHAT_COMPLETION, COMPLETION], ids=lambda b: b.name)
def test_each_declared_field_alone_is_accepted(body: Body) -> None:
    parse = PARSERS[body.name]
    for field in body.fields:
        value = sample(field)
        assert field_validator(field).is_valid(value), (field.name, value)
        parse({**MINIMAL[body.name], **COMPANIONS.get(field.name, {}), field.name: value})
        if field.nullable and not field.required:
            assert field_validator(field).is_valid(None), field.name
            parse({**MINIMAL[body.name], field.name: None})


def test_declared_defaults_are_what_an_empty_body_gets() -> None:
    for body in (CHAT_COMPLETION, COMPLETION):
        parsed = PARSERS[body.name](MINIMAL[body.name])
        for field in body.fields:
            if field.default is None:
                continue
            where = parsed if hasattr(parsed, field.name) else parsed.sampling
            assert getattr(where, field.name) == field.default, (body.name, field.name)


def _bound_cases(field: Field) -> list[tuple[Any, bool]]:
    """(value, accepted) at and past each declared bound of a numeric field."""
    cases: list[tuple[Any, bool]] = []
    step = 1 if field.type == "integer" else 0.5
    if field.minimum is not None:
        if field.exclusive_minimum:
            cases += [(field.minimum + 1e-6, True), (field.minimum, False)]
        else:
            cases += [(field.minimum, True), (field.minimum - step, False)]
    if field.maximum is not None:
        cases += [(field.maximum, True), (field.maximum + step, False)]
    return cases


@pytest.mark.parametrize("body", [CHAT_COMPLETION, COMPLETION], ids=lambda b: b.name)
def test_every_declared_bound_holds_on_the_parser(body: Body) -> None:
    parse = PARSERS[body.name]
    checked = 0
    for field in body.fields:
        if field.type not in ("integer", "number"):
            continue
        for value, accepted in _bound_cases(field):
            extra = dict(COMPANIONS.get(field.name, {}))
            if field.name == "best_of":
                extra["n"] = min(max(int(value), 1), 16)
            request = {**MINIMAL[body.name], **extra, field.name: value}
            assert field_validator(field).is_valid(value) == accepted, (field.name, value)
            if accepted:
                parse(request)
            else:
                with pytest.raises(InvalidArgumentError) as info:
                    parse(request)
                assert info.value.param == field.name, (field.name, value, info.value.message)
            checked += 1
    assert checked >= 20


def test_composite_bounds_hold_on_the_parser() -> None:
    parse = PARSERS[CHAT_COMPLETION.name]
    base = MINIMAL[CHAT_COMPLETION.name]
    stop, ids = CHAT_COMPLETION["stop"], CHAT_COMPLETION["stop_token_ids"]
    for field, value, accepted in [
        (stop, [str(i) for i in range(16)], True), (stop, [str(i) for i in range(17)], False),
        (stop, "", False), (stop, [""], False), (stop, [], True),
        (ids, [0, MAX_UINT32], True), (ids, [MAX_UINT32 + 1], False), (ids, [-1], False),
    ]:  # fmt: skip
        assert field_validator(field).is_valid(value) == accepted, (field.name, value)
        if accepted:
            parse({**base, field.name: value})
        else:
            with pytest.raises(InvalidArgumentError) as info:
                parse({**base, field.name: value})
            assert info.value.param == field.name


@pytest.mark.parametrize("body", [CHAT_COMPLETION, COMPLETION], ids=lambda b: b.name)
def test_refused_features_accept_only_empty_values(body: Body) -> None:
    parse = PARSERS[body.name]
    assert body.unsupported
    for name in body.unsupported:
        validator = field_validator(body[name])
        for empty in (None, "", [], {}):
            assert validator.is_valid(empty)
            parse({**MINIMAL[body.name], name: empty})
        for used in ("x", ["x"], {"x": 1}, 1, True):
            assert not validator.is_valid(used), (name, used)
            with pytest.raises(InvalidArgumentError) as info:
                parse({**MINIMAL[body.name], name: used})
            assert (info.value.param, info.value.code) == (name, "unsupported_parameter")


def test_unknown_field_policy_is_the_documented_one() -> None:
    schemas = DOC["components"]["schemas"]
    for body in (CHAT_COMPLETION, COMPLETION):
        assert schemas[body.name]["additionalProperties"] is True
        PARSERS[body.name]({**MINIMAL[body.name], "tool_choice": "none", "x-anything": {"a": 1}})
    for body in (TOKENIZE, DETOKENIZE):
        assert schemas[body.name]["additionalProperties"] is False


async def test_token_routes_accept_each_declared_field_and_refuse_others(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack()
    bases = {TOKENIZE.name: ("/tokenize", {"prompt": "hey"}),
             DETOKENIZE.name: ("/detokenize", {"tokens": [104]})}  # fmt: skip
    for body in (TOKENIZE, DETOKENIZE):
        path, base = bases[body.name]
        for field in body.fields:
            request = dict(base)
            if field.name == "messages":
                request = {"messages": [USER]}
            elif field.name != "prompt":
                request[field.name] = sample(field)
            assert field_validator(field).is_valid(request.get(field.name, sample(field)))
            status, raw, _ = await post_raw(stack.url + path, request)
            assert status == 200, (body.name, field.name, raw)
        status, raw, _ = await post_raw(stack.url + path, {**base, "unknown": 1})
        assert status == 400 and json.loads(raw)["error"]["code"] == "unknown_parameter"


# --------------------------------------------------------------------------- responses


def test_every_error_class_validates_as_error_response() -> None:
    validator = schema_validator(DOC, "ErrorResponse")
    classes = [c for c in vars(tandem_errors).values()
               if isinstance(c, type) and issubclass(c, TandemError)]  # fmt: skip
    errors: list[TandemError] = [cls("boom", param="p", code="c") for cls in classes]
    errors += [AuthenticationError("no key"), RequestTooLargeError("big", code="request_too_large"),
               RequestTimeoutError("slow", code="request_timeout"),
               HTTPStatusError("no", status=405), RateLimitError("slow down", retry_after=1.5)]
    documented = DOC["paths"]["/v1/chat/completions"]["post"]["responses"]
    for err in errors:
        validator.validate(err.to_openai())
        # 405 is documented once for every path; 499 is logged, never seen by a client.
        assert str(err.http_status) in documented or err.http_status in (405, 499), err


async def test_live_answers_validate_against_the_document(make_stack: StackFactory) -> None:
    stack = await make_stack(keys=("k",))
    auth = {"Authorization": "Bearer k"}
    async with aiohttp.ClientSession() as s, s.get(stack.url + "/openapi.json") as r:
        assert r.status == 200  # no key needed
        doc = await r.json()
    schemathesis.openapi.from_dict(doc).validate()
    assert doc["components"]["schemas"]["ModelName"]["enum"] == [MODEL]
    assert doc["components"]["schemas"]["TokenId"]["maximum"] == 0x110000 - 1
    assert doc["paths"]["/tokenize"]["post"]["security"] == [{"bearerAuth": []}]

    def check(name: str, value: object) -> None:
        schema_validator(doc, name).validate(value)

    chat = {"model": MODEL, "messages": [USER], "max_tokens": 6, "logprobs": True,
            "top_logprobs": 2, "n": 2}  # fmt: skip
    status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", chat, auth)
    assert status == 200
    check("ChatCompletion", json.loads(raw))
    streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    status, raw, headers = await post_raw(stack.url + "/v1/chat/completions", streamed, auth)
    events = sse_events(raw)
    assert headers["Content-Type"].startswith("text/event-stream") and events[-1] == "[DONE]"
    for event in events[:-1]:
        check("ChatCompletionChunk", event)
    comp = {"model": MODEL, "prompt": "Once", "max_tokens": 5, "logprobs": 2}
    status, raw, _ = await post_raw(stack.url + "/v1/completions", comp, auth)
    check("Completion", json.loads(raw))
    status, raw, _ = await post_raw(stack.url + "/v1/completions", {**comp, "stream": True}, auth)
    for event in sse_events(raw)[:-1]:
        check("Completion", event)
    for path, body, name in [
        ("/tokenize", {"prompt": "hey", "return_token_strs": True}, "TokenizeResponse"),
        ("/detokenize", {"tokens": [104]}, "DetokenizeResponse"),
    ]:
        status, raw, _ = await post_raw(stack.url + path, body, auth)
        assert status == 200
        check(name, json.loads(raw))
    for path, name in [("/v1/models", "ModelList"), (f"/v1/models/{MODEL}", "Model"),
                       ("/version", "VersionResponse"), ("/health", "HealthResponse"),
                       ("/ready", "ReadyResponse")]:  # fmt: skip
        async with aiohttp.ClientSession() as s, s.get(stack.url + path, headers=auth) as r:
            assert r.status == 200
            check(name, await r.json())
    status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", chat)
    assert status == 401
    check("ErrorResponse", json.loads(raw))
