"""``GET /openapi.json``: the gateway's API as an OpenAPI 3.1 document.

Built per request from the same declarations the parsers use (``api_schema.py``), so the
documented request bodies are the accepted ones. The rest is stated here once:

1. the response bodies: what ``openai_responses.py`` and the status / token routes build
   (tests/test_openapi.py validates the builders' output against these schemas);
2. streaming: a ``text/event-stream`` response whose ``schema`` describes each event (OpenAPI 3.1
   style): ``data`` is ``[DONE]`` or a JSON chunk object (``contentMediaType`` /
   ``contentSchema``), or an in-stream error object after the 200 went out;
3. every error status the gateway really returns, in OpenAI's shape, with ``Retry-After`` on 429
   (and on 503 when it knows when to come back);
4. the served model's facts when known: ``ModelName`` lists the served names and ``TokenId`` is
   bounded by the vocabulary (otherwise any string, any uint32).

Routes outside the OpenAI API (``/health``, ``/ready``, ``/version``, ``/`` and this one) are
documented too; a method a path does not serve is 405 and an unknown path 404, both in OpenAI's
error shape. Prometheus ``/metrics`` is not on this server: the gateway serves it on its own
``--metrics-port`` (docs/metrics.md), so it is not in this document.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from services.common.errors import TandemError
from services.gateway.api_schema import (
    CHAT_COMPLETION,
    COMPLETION,
    DETOKENIZE,
    MAX_UINT32,
    NESTED_BODIES,
    REQUEST_BODIES,
    TOKENIZE,
    Body,
    JsonSchema,
    chat_message_schema,
)
from services.gateway.embeddings import embedding_schemas, embeddings_operation
from services.gateway.openapi_fronts import front_paths, front_schemas
from services.gateway.state import STATE_KEY
from services.gateway.token_routes import tandem_version

OPENAPI_VERSION = "3.1.0"
FINISH_REASONS = ("stop", "length", "content_filter", "abort")
SSE_DONE = "[DONE]"


def _ref(name: str) -> JsonSchema:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(
    properties: dict[str, Any], *, optional: Sequence[str] = (), description: str | None = None
) -> JsonSchema:
    """A closed object schema (a new field must be documented) whose properties are all required
    except ``optional``."""
    out: JsonSchema = {
        "type": "object",
        "required": [k for k in properties if k not in optional],
        "properties": properties,
        "additionalProperties": False,
    }
    if description:
        out["description"] = description
    return out


_STR, _INT, _NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}
_NULL_STR = {"type": ["string", "null"]}
_COUNT = {"type": "integer", "minimum": 0}


def _nullable(schema: JsonSchema) -> JsonSchema:
    return {"anyOf": [schema, {"type": "null"}]}


# --------------------------------------------------------------------------- response schemas


def _response_schemas() -> dict[str, JsonSchema]:
    usage = _obj({
        "prompt_tokens": _COUNT, "completion_tokens": _COUNT, "total_tokens": _COUNT,
        "prompt_tokens_details": _obj({"cached_tokens": _COUNT}),
    }, description="Token counts; cached_tokens were served from the prefix cache.")
    top = _obj({"token": _STR, "logprob": _NUM, "bytes": {"type": "array", "items": _COUNT}})
    token_logprob = _obj({**top["properties"], "top_logprobs": {"type": "array", "items": top}})
    chat_logprobs = _obj({"content": {"type": "array", "items": token_logprob},
                          "refusal": {"type": "null"}})
    completion_logprobs = _obj({  # an echoed prompt's first token has null logprobs
        "tokens": {"type": "array", "items": _STR},
        "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
        "top_logprobs": {"type": "array", "items": _nullable(
            {"type": "object", "additionalProperties": _NUM})},
        "text_offset": {"type": "array", "items": _COUNT},
    })
    prompt_logprobs = {  # vLLM's: per prompt token (the first null), token id -> its values
        "type": "array", "description": "With prompt_logprobs (vLLM's field): one entry per "
        "prompt token, the first null; token id -> logprob, rank, decoded_token.",
        "items": _nullable({"type": "object", "additionalProperties": _obj(
            {"logprob": _NUM, "rank": {"type": "integer", "minimum": 1},
             "decoded_token": _STR})}),
    }  # fmt: skip
    finish = {"type": "string", "enum": list(FINISH_REASONS)}
    head = {"id": _STR, "created": _INT, "model": _STR, "system_fingerprint": _NULL_STR}
    chat_choice = _obj({
        "index": _COUNT,
        "message": _obj({"role": {"const": "assistant"}, "content": _NULL_STR,
                         "refusal": {"type": "null"}}),
        "logprobs": _nullable(_ref("ChatLogprobs")),
        "finish_reason": finish,
    })
    chunk_choice = _obj({
        "index": _COUNT,
        "delta": _obj({"role": {"const": "assistant"}, "content": _STR},
                      optional=("role", "content")),
        "logprobs": _nullable(_ref("ChatLogprobs")),
        "finish_reason": {"type": ["string", "null"], "enum": [*FINISH_REASONS, None]},
    })
    text_choice = _obj({
        "index": _COUNT, "text": _STR,
        "logprobs": _nullable(_ref("CompletionLogprobs")),
        "finish_reason": {"type": ["string", "null"], "enum": [*FINISH_REASONS, None]},
        "prompt_logprobs": prompt_logprobs,
    }, optional=("prompt_logprobs",))
    model = _obj({"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR,
                  "max_model_len": {"type": "integer", "minimum": 1}}, optional=("max_model_len",))
    return {
        "Usage": usage,
        "ChatLogprobs": chat_logprobs,
        "CompletionLogprobs": completion_logprobs,
        "ChatCompletion": _obj({
            **head, "object": {"const": "chat.completion"},
            "choices": {"type": "array", "items": chat_choice},
            "usage": _nullable(_ref("Usage")),
            "prompt_logprobs": prompt_logprobs,
        }, optional=("prompt_logprobs",), description="A chat completion (stream false)."),
        "ChatCompletionChunk": _obj({
            **head, "object": {"const": "chat.completion.chunk"},
            "choices": {"type": "array", "items": chunk_choice},
            "usage": _ref("Usage"),
        }, optional=("usage",), description="One streamed event: the first chunk of a choice "
           "carries role, the last its finish_reason; with stream_options.include_usage a last "
           "chunk has no choices and the usage."),
        "Completion": _obj({
            **head, "object": {"const": "text_completion"},
            "choices": {"type": "array", "items": text_choice},
            "usage": _nullable(_ref("Usage")),
        }, optional=("usage",), description="A text completion, and each streamed chunk of one "
           "(finish_reason null until a choice ends; usage only on the optional last chunk)."),
        "Model": model,
        "ModelList": _obj({"object": {"const": "list"},
                           "data": {"type": "array", "items": _ref("Model")}}),
        "TokenizeResponse": _obj({
            "count": _COUNT, "max_model_len": {"type": ["integer", "null"]},
            "tokens": {"type": "array", "items": _COUNT},
            "token_strs": _nullable({"type": "array", "items": _STR}),
        }),
        "DetokenizeResponse": _obj({"prompt": _STR}),
        "VersionResponse": _obj({"version": _STR}),
        "HealthResponse": _obj({"status": {"const": "ok"}}),
        "ReadyResponse": _obj({
            "status": {"enum": ["ready", "not_ready"]},
            "problems": {"type": "array", "items": _STR,
                         "description": "Why the gateway cannot serve (empty when ready)."},
            "warnings": {"type": "array", "items": _STR,
                         "description": "What is degraded but still serves, e.g. no healthy "
                                        "prefill worker (decode workers prefill prompts)."},
            "model": _NULL_STR,
            "tokenizer": {"type": "array", "items": _obj(
                {"address": _STR, "healthy": {"type": "boolean"}, "status": _STR, "error": _STR},
                optional=("error",)), "description": "Every tokenizer replica."},
            "prefill": {"type": "array", "items": {"type": "object"},
                        "description": "Every prefill worker (optional: may be empty or down)."},
            "decode": {"type": "array", "items": {"type": "object"},
                       "description": "Every decode worker."},
            "in_flight": _COUNT,
        }, optional=("problems", "warnings", "model", "tokenizer", "prefill", "decode",
                     "in_flight"),
           description="Per-replica details; 503 lists the problems. Ready means a healthy "
           "tokenizer replica serving the model and a healthy decode worker; prefill workers "
           "are optional. When API keys are configured, only a caller with a valid key sees "
           "more than `status` (a wrong key: 401)."),
        "ErrorResponse": _obj({"error": _obj({
            "message": _STR, "type": _STR, "param": _NULL_STR, "code": _NULL_STR,
        })}, description="OpenAI's error shape: param names the offending field."),
    }  # fmt: skip


# --------------------------------------------------------------------------- errors

_ERRORS: dict[str, str] = {
    "400": "Invalid request: malformed JSON, invalid UTF-8, a wrong type or value (param names "
           "the field), an unsupported feature, a prompt too long for the context, or the "
           "content policy (code content_policy_violation).",
    "401": "Missing or wrong API key (when the gateway has keys).",
    "404": "Unknown model (code model_not_found).",
    "408": "The body did not arrive within the gateway's --body-read-timeout (code "
           "request_timeout); the connection is closed.",
    "413": "The body is over the gateway's --max-body-bytes (code request_too_large).",
    "429": "Over the API key's rate limit or the gateway's in-flight limit; nothing is queued.",
    "500": "An internal error (the details are only in the gateway's log).",
    "502": "A worker's data failed its checksum, or one service refused another's call.",
    "503": "A backend service is not ready or not reachable, or no decode worker has room (code "
           "decode_capacity).",
}  # fmt: skip
_RETRY_AFTER = {"description": "Seconds to wait before retrying.",
                "schema": {"type": "integer", "minimum": 1}}  # fmt: skip
_GENERATION_ERRORS = ("400", "401", "404", "408", "413", "429", "500", "502", "503")
_TOKEN_ROUTE_ERRORS = ("400", "401", "404", "408", "413", "500", "503")


def _error_responses(statuses: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for status in statuses:
        response: dict[str, Any] = {
            "description": _ERRORS[status],
            "content": {"application/json": {"schema": _ref("ErrorResponse")}},
        }
        if status == "429":
            response["headers"] = {"Retry-After": {**_RETRY_AFTER, "required": True}}
        elif status == "503":
            response["headers"] = {"Retry-After": _RETRY_AFTER}
        out[status] = response
    return out


# --------------------------------------------------------------------------- paths


def _json(schema: JsonSchema, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _sse_event(chunk: str) -> JsonSchema:
    """One server-sent event of a stream of ``chunk`` objects (OpenAPI 3.1: per-event schema)."""
    data = {
        "type": "string",
        "if": {"const": SSE_DONE},
        "else": {"contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]}},
    }  # fmt: skip
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": data},
        "description": f"`data: <{chunk} JSON>` per event, then `data: {SSE_DONE}`. A failure "
        "after the 200 went out is one `data: <ErrorResponse JSON>` event before "
        f"`data: {SSE_DONE}`.",
    }


def _generation(summary: str, op_id: str, body: Body, result: str, chunk: str) -> dict[str, Any]:
    ok = {
        "description": f"{result} (stream false), or server-sent {chunk} events (stream true). "
        "Header X-Request-Id carries the request's id.",
        "headers": {"X-Request-Id": {"schema": _STR}},
        "content": {
            "application/json": {"schema": _ref(result)},
            "text/event-stream": {"schema": _sse_event(chunk)},
        },
    }
    return {"post": {
        "summary": summary,
        "operationId": op_id,
        "security": _SECURITY,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(body.name)}}},
        "responses": {"200": ok, **_error_responses(_GENERATION_ERRORS)},
    }}  # fmt: skip


def _post(summary: str, op_id: str, body: Body, result: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "operationId": op_id, "security": _SECURITY,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(body.name)}}},
        "responses": {"200": _json(_ref(result), summary),
                      **_error_responses(_TOKEN_ROUTE_ERRORS)},
    }}  # fmt: skip


def _get(
    summary: str, op_id: str, responses: dict[str, Any], *, security: bool = False,
    parameters: list[Any] | None = None,
) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "operationId": op_id, "responses": responses}
    if security:
        op["security"] = _SECURITY
    if parameters:
        op["parameters"] = parameters
    return {"get": op}


_SECURITY: list[dict[str, list[str]]] = [{"bearerAuth": []}]  # dropped when keys are off


def _paths() -> dict[str, Any]:
    model_param = {"name": "model", "in": "path", "required": True,
                   "schema": _ref("ModelName")}  # fmt: skip
    ready = _ref("ReadyResponse")
    return {
        "/v1/chat/completions": _generation(
            "Chat completion", "createChatCompletion", CHAT_COMPLETION, "ChatCompletion",
            "ChatCompletionChunk"),
        "/v1/completions": _generation(
            "Text completion", "createCompletion", COMPLETION, "Completion", "Completion"),
        "/v1/embeddings": embeddings_operation(_error_responses(_GENERATION_ERRORS)),
        **front_paths(_error_responses, _SECURITY),
        "/v1/models": _get("The served models", "listModels", {
            "200": _json(_ref("ModelList"), "The served model names."),
            **_error_responses(("401", "503"))}, security=True),
        "/v1/models/{model}": _get("One served model", "retrieveModel", {
            "200": _json(_ref("Model"), "The model."),
            **_error_responses(("401", "404", "503"))}, security=True, parameters=[model_param]),
        "/tokenize": _post("Count and list a prompt's tokens (vLLM's)", "tokenize", TOKENIZE,
                           "TokenizeResponse"),
        "/detokenize": _post("Turn token ids into text (vLLM's)", "detokenize", DETOKENIZE,
                             "DetokenizeResponse"),
        "/version": _get("Tandem's version", "version",
                         {"200": _json(_ref("VersionResponse"), "The version.")}),
        "/health": _get("Liveness: 200 while the process serves HTTP", "health",
                        {"200": _json(_ref("HealthResponse"), "Alive.")}),
        "/ready": _get("Readiness: a tokenizer replica and a decode worker are reachable "
                       "(prefill workers are optional)",
                       "ready", {"200": _json(ready, "Ready."),
                                 "503": _json(ready, "Not ready; problems says why."),
                                 **_error_responses(("401",))}),
        "/openapi.json": _get("This document", "openapi", {"200": _json(
            {"type": "object"}, "The OpenAPI 3.1 document.")}),
        "/": _get("The browser playground", "playground", {"200": {
            "description": "An HTML page that talks to /v1/chat/completions.",
            "content": {"text/html": {"schema": _STR}}}}),
    }  # fmt: skip


# --------------------------------------------------------------------------- the document


def openapi_document(
    *, served_names: Sequence[str] = (), vocab_size: int = 0, version: str = "0+unknown",
    api_keys: bool = False,
) -> dict[str, Any]:
    """The OpenAPI 3.1 document; ``served_names`` / ``vocab_size`` narrow ``ModelName`` and
    ``TokenId`` to the served model when known; ``api_keys`` says whether the authenticated
    routes require a bearer key (else they declare no security)."""
    model_name: JsonSchema = {"type": "string", "description": "A served model's name."}
    if served_names:
        model_name["enum"] = list(served_names)
    token_id: JsonSchema = {
        "type": "integer", "minimum": 0, "maximum": vocab_size - 1 if vocab_size else MAX_UINT32,
        "description": "A token id of the served model's vocabulary.",
    }  # fmt: skip
    schemas: dict[str, JsonSchema] = {"ModelName": model_name, "TokenId": token_id}
    for body in (*REQUEST_BODIES, *NESTED_BODIES):
        schemas[body.name] = body.json_schema()
    schemas["ChatMessage"] = chat_message_schema()
    schemas.update(_response_schemas())
    schemas.update(front_schemas())
    schemas.update(embedding_schemas())
    return {
        "openapi": OPENAPI_VERSION,
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {
            "title": "Tandem gateway",
            "version": version,
            "description": "OpenAI-compatible inference API (docs/api.md). Errors are "
            "`{\"error\": {message, type, param, code}}`; a method a path does not serve is 405, "
            "an unknown path 404, both in that shape. Unknown fields are ignored on /v1 routes "
            "and refused on /tokenize and /detokenize.",
        },
        "paths": _with_security(_paths(), api_keys),
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearerAuth": {
                "type": "http", "scheme": "bearer",
                "description": "Required when the gateway has API keys (--api-keys-file, "
                "TANDEM_API_KEYS); then the operations that need it list it under security.",
            }},
        },
    }  # fmt: skip


def _with_security(paths: dict[str, Any], api_keys: bool) -> dict[str, Any]:
    if not api_keys:
        for item in paths.values():
            for operation in item.values():
                operation.pop("security", None)
    return paths


async def openapi_route(request: web.Request) -> web.Response:
    """``GET /openapi.json`` (no authentication): the document for what is served now (the
    generic one while the tokenizer service cannot say which model that is)."""
    state = request.app[STATE_KEY]
    with contextlib.suppress(TandemError):
        await state.require_model_info()
    info = state.model_info
    return web.json_response(openapi_document(
        served_names=state.served_names, vocab_size=info.vocab_size if info is not None else 0,
        version=tandem_version(), api_keys=state.auth.enabled,
    ))  # fmt: skip
