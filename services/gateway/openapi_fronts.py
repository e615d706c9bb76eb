"""The OpenAPI description of the two API fronts (``front.py``): OpenAI's Responses API and
Anthropic's Messages API, merged into ``GET /openapi.json`` by ``openapi.py``.

The request bodies list the fields the fronts read (``responses_request.py``,
``messages_request.py``; unknown fields are ignored, refused features are a 400). The responses
are described at the level clients rely on (the object's type, status and output / content
items); their streams are SSE events with an ``event:`` line naming each event's ``type``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

JsonSchema = dict[str, Any]
ErrorResponses = Callable[[Sequence[str]], dict[str, Any]]

_STR, _INT, _NUM, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {
    "type": "boolean"}  # fmt: skip
_OBJ = {"type": "object"}
_COUNT = {"type": "integer", "minimum": 0}
_ERRORS = ("400", "401", "404", "408", "413", "429", "500", "502", "503")


def _ref(name: str) -> JsonSchema:
    return {"$ref": f"#/components/schemas/{name}"}


def _body(properties: Mapping[str, JsonSchema], required: Sequence[str], text: str) -> JsonSchema:
    return {"type": "object", "description": text, "required": list(required),
            "properties": dict(properties), "additionalProperties": True}  # fmt: skip


def front_schemas() -> dict[str, JsonSchema]:
    """The component schemas of both fronts."""
    tool_choice = {"anyOf": [{"enum": ["auto", "none", "required"]}, _OBJ]}
    responses_request = _body({
        "model": _ref("ModelName"),
        "input": {"anyOf": [_STR, {"type": "array", "items": _OBJ}],
                  "description": "A user turn, or items: message (role user / assistant / system "
                  "/ developer; content a string or input_text / output_text parts), "
                  "function_call, function_call_output, reasoning (dropped)."},
        "instructions": _STR, "previous_response_id": _STR,
        "store": {**_BOOL, "description": "Keep the response (default true) for GET and "
                  "previous_response_id, in the gateway's bounded in-memory store."},
        "tools": {"type": "array", "items": _OBJ,
                  "description": "type function only: name, description, parameters, strict."},
        "tool_choice": tool_choice, "parallel_tool_calls": _BOOL,
        "text": {"type": "object", "properties": {"format": _OBJ},
                 "description": "format: text, json_object or json_schema (name, schema, strict)."},
        "max_output_tokens": {"type": "integer", "minimum": 1}, "temperature": _NUM,
        "top_p": _NUM, "stream": _BOOL, "metadata": _OBJ, "user": _STR,
    }, ["model", "input"], "OpenAI's Responses API request. Refused (400): built-in tools, "
       "background, conversation, prompt, max_tool_calls, top_logprobs, include (but "
       "reasoning.encrypted_content).")  # fmt: skip
    response = {
        "type": "object", "required": ["id", "object", "status", "output", "model"],
        "properties": {
            "id": _STR, "object": {"const": "response"}, "created_at": _INT, "model": _STR,
            "status": {"enum": ["in_progress", "completed", "incomplete", "failed"]},
            "incomplete_details": {"anyOf": [_OBJ, {"type": "null"}]},
            "output": {"type": "array", "items": _OBJ,
                       "description": "reasoning, message (output_text) and function_call items."},
            "usage": {"anyOf": [_OBJ, {"type": "null"}]},
        },
    }  # fmt: skip
    messages_request = _body({
        "model": _ref("ModelName"),
        "messages": {"type": "array", "items": _OBJ, "description": "user / assistant turns; "
                     "content a string or text, tool_use and tool_result blocks."},
        "system": {"anyOf": [_STR, {"type": "array", "items": _OBJ}]},
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop_sequences": {"type": "array", "items": _STR}, "temperature": _NUM, "top_p": _NUM,
        "top_k": _INT, "stream": _BOOL, "metadata": _OBJ,
        "tools": {"type": "array", "items": _OBJ,
                  "description": "name, description, input_schema (client tools only)."},
        "tool_choice": _OBJ,
    }, ["model", "messages", "max_tokens"], "Anthropic's Messages API request.")  # fmt: skip
    message = {
        "type": "object", "required": ["id", "type", "role", "content", "stop_reason", "usage"],
        "properties": {
            "id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"},
            "model": _STR, "content": {"type": "array", "items": _OBJ},
            "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use",
                                     "refusal"]},
            "stop_sequence": {"type": ["string", "null"]}, "usage": _OBJ,
        },
    }  # fmt: skip
    anthropic_error = {
        "type": "object", "required": ["type", "error"],
        "properties": {"type": {"const": "error"}, "error": {
            "type": "object", "required": ["type", "message"],
            "properties": {"type": _STR, "message": _STR}}},
    }  # fmt: skip
    return {
        "ResponsesRequest": responses_request, "Response": response,
        "ResponseDeleted": {"type": "object", "required": ["id", "object", "deleted"],
                            "properties": {"id": _STR, "object": {"const": "response"},
                                           "deleted": {"const": True}}},
        "MessagesRequest": messages_request, "Message": message,
        "CountTokensRequest": {**messages_request, "required": ["model", "messages"]},
        "CountTokensResponse": {"type": "object", "required": ["input_tokens"],
                                "properties": {"input_tokens": _COUNT}},
        "AnthropicError": anthropic_error,
    }  # fmt: skip


def _sse(names: str) -> JsonSchema:
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": _STR, "data": {"type": "string",
                                                   "contentMediaType": "application/json"}},
            "description": f"`event: <type>` and `data: <JSON>` per event: {names}."}  # fmt: skip


def _anthropic_errors() -> dict[str, Any]:
    return {status: {"description": "Anthropic's error shape.",
                     "content": {"application/json": {"schema": _ref("AnthropicError")}}}
            for status in _ERRORS}  # fmt: skip


def front_paths(errors: ErrorResponses, security: list[dict[str, list[str]]]) -> dict[str, Any]:
    """The fronts' paths; ``errors`` builds OpenAI-shaped error responses (``openapi.py``)."""
    response_id = {"name": "response_id", "in": "path", "required": True, "schema": _STR}
    stored = errors(("401", "404", "429"))

    def post(summary: str, op_id: str, body: str, ok: dict[str, Any],
             errs: dict[str, Any]) -> dict[str, Any]:
        return {"post": {"summary": summary, "operationId": op_id, "security": security,
                         "requestBody": {"required": True, "content": {
                             "application/json": {"schema": _ref(body)}}},
                         "responses": {"200": ok, **errs}}}  # fmt: skip

    def json_and_sse(result: str, names: str) -> dict[str, Any]:
        return {"description": f"{result} (stream false) or its SSE events (stream true).",
                "content": {"application/json": {"schema": _ref(result)},
                            "text/event-stream": {"schema": _sse(names)}}}  # fmt: skip

    return {
        "/v1/responses": post(
            "Create a response (OpenAI's Responses API)", "createResponse", "ResponsesRequest",
            json_and_sse("Response", "response.created, response.in_progress, "
                         "response.output_item.added/done, response.content_part.added/done, "
                         "response.output_text.delta/done, "
                         "response.function_call_arguments.delta/done, response.completed, "
                         "response.incomplete, response.failed"), errors(_ERRORS)),
        "/v1/responses/{response_id}": {
            "get": {"summary": "A stored response", "operationId": "getResponse",
                    "security": security, "parameters": [response_id],
                    "responses": {"200": {"description": "The response as returned.",
                                          "content": {"application/json": {
                                              "schema": _ref("Response")}}}, **stored}},
            "delete": {"summary": "Forget a stored response", "operationId": "deleteResponse",
                       "security": security, "parameters": [response_id],
                       "responses": {"200": {"description": "Deleted.", "content": {
                           "application/json": {"schema": _ref("ResponseDeleted")}}},
                           **stored}},
        },
        "/v1/messages": post(
            "Create a message (Anthropic's Messages API; x-api-key or bearer auth)",
            "createMessage", "MessagesRequest",
            json_and_sse("Message", "message_start, ping, content_block_start, "
                         "content_block_delta, content_block_stop, message_delta, "
                         "message_stop, error"), _anthropic_errors()),
        "/v1/messages/count_tokens": post(
            "Count a message request's input tokens (Anthropic's)", "countMessageTokens",
            "CountTokensRequest", {"description": "The count.", "content": {"application/json": {
                "schema": _ref("CountTokensResponse")}}}, _anthropic_errors()),
    }  # fmt: skip
