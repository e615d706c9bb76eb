"""``POST /v1/responses`` bodies (OpenAI's Responses API), mapped onto a chat-completions request.

The Responses API is a front over the chat flow (``front.py``): its body is rewritten as the
chat-completions body it means and validated by the chat parser
(``openai_requests.parse_chat_request``), so sampling, tools, tool choice and structured outputs
are checked exactly once. Only what has no chat equivalent is checked here:

1. ``input``: a string (one user turn) or a list of items: ``message`` (role ``user``,
   ``assistant``, ``system`` or ``developer``, the last read as ``system``; content a string or
   ``input_text`` / ``output_text`` parts), ``function_call`` (``call_id``, ``name``,
   ``arguments``: an assistant turn's tool call), ``function_call_output`` (``call_id``,
   ``output``: a ``tool`` turn) and ``reasoning`` (earlier reasoning, dropped: chat templates do
   not take it back); consecutive assistant items form one assistant turn;
2. ``instructions``: a system message before everything (not carried to a continuation, as
   OpenAI's are not);
3. ``previous_response_id``: the stored conversation through that response (``store: true``)
   comes before this ``input``;
4. ``tools`` (``type: function`` with ``name`` / ``description`` / ``parameters`` / ``strict``),
   ``tool_choice`` (``auto``, ``none``, ``required``, ``{"type": "function", "name"}``),
   ``text.format`` (``text``, ``json_object``, ``json_schema``) -> ``response_format``,
   ``max_output_tokens`` -> ``max_completion_tokens``; ``temperature``, ``top_p``,
   ``parallel_tool_calls``, ``user`` and ``stream`` as they are;
5. refused with a 400 naming the field: built-in tools (``web_search``, ``file_search``, ...),
   ``background``, ``conversation``, ``prompt``, ``max_tool_calls``, ``top_logprobs``,
   ``include`` values other than ``reasoning.encrypted_content`` (accepted: nothing here is
   encrypted), and input items or content parts other than the above (images, files).

Errors the chat parser raises name chat fields; :func:`responses_param` renames them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import InvalidArgumentError
from services.gateway.openai_fields import get_bool, get_str, invalid_type, missing, require_object
from services.gateway.openai_requests import ChatRequest, parse_chat_request

Message = dict[str, Any]
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
_UNSUPPORTED = ("background", "conversation", "prompt", "max_tool_calls", "top_logprobs")
_IGNORED_INCLUDES = ("reasoning.encrypted_content",)  # nothing is encrypted: no such content
_COPIED = ("temperature", "top_p", "parallel_tool_calls", "user", "stream")


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated Responses body: the chat request it means, what the response echoes, and
    the conversation (without ``instructions``) that a stored response continues."""

    chat: ChatRequest
    echo: Mapping[str, Any]
    conversation: tuple[Message, ...]
    store: bool
    metadata: Mapping[str, str] = field(default_factory=dict)


History = Callable[[str], Sequence[Message] | None]
"""Looks a stored response's conversation up by id (None: no such response)."""


def parse_responses_request(
    body: object, *, served_models: Sequence[str], history: History
) -> ResponsesRequest:
    """Validate a Responses body; InvalidArgumentError (400) / NotFoundError (404, the model)."""
    obj = require_object(body)
    for key in _UNSUPPORTED:
        value = obj.get(key)
        if value not in (None, False, [], {}, ""):
            raise InvalidArgumentError(f"Unsupported parameter: '{key}' is not supported by this "
                                       "server.", param=key, code="unsupported_parameter")  # fmt: skip
    _check_include(obj.get("include"))
    if "input" not in obj:
        raise missing("input")
    new = input_messages(obj["input"])
    previous_id = get_str(obj, "previous_response_id")
    earlier: Sequence[Message] = ()
    if previous_id is not None:
        found = history(previous_id)
        if found is None:
            raise InvalidArgumentError(f"Previous response with id '{previous_id}' not found.",
                                       param="previous_response_id",
                                       code="previous_response_not_found")  # fmt: skip
        earlier = found
    conversation = (*earlier, *new)
    instructions = get_str(obj, "instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {"model": obj.get("model"), "messages": messages + list(conversation)}
    chat.update({k: obj[k] for k in _COPIED if obj.get(k) is not None})
    if obj.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = obj["max_output_tokens"]
    tools = _tools(obj.get("tools"))
    if tools:
        chat["tools"] = [{"type": "function", "function": t} for t in tools]
    if obj.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(obj["tool_choice"])
    text_format = _text_format(obj.get("text"))
    if text_format is not None:
        chat["response_format"] = text_format
    metadata = _metadata(obj.get("metadata"))
    store = get_bool(obj, "store")
    parsed = parse_chat_request(chat, served_models=served_models)
    echo = {
        "instructions": instructions,
        "max_output_tokens": obj.get("max_output_tokens"),
        "parallel_tool_calls": parsed.tools.parallel if parsed.tools is not None else True,
        "previous_response_id": previous_id,
        "temperature": parsed.sampling.temperature,
        "top_p": parsed.sampling.top_p,
        "text": {"format": _echo_format(text_format)},
        "tool_choice": obj.get("tool_choice") or "auto",
        "tools": [{"type": "function", **t, "strict": t.get("strict", True)} for t in tools],
        "truncation": obj.get("truncation") or "disabled",
        "user": parsed.user,
        "metadata": metadata,
        "store": True if store is None else store,
    }  # fmt: skip
    return ResponsesRequest(parsed, echo, conversation, echo["store"], metadata)


def _check_include(raw: object) -> None:
    """``include`` may ask only for what is never produced here (agents send
    ``reasoning.encrypted_content`` by default); anything else is a 400."""
    if raw is None:
        return
    if not isinstance(raw, list):
        raise invalid_type("include", "an array of strings", raw)
    for i, value in enumerate(raw):
        if value not in _IGNORED_INCLUDES:
            raise InvalidArgumentError(f"Unsupported value in 'include': {json.dumps(value)}.",
                                       param=f"include[{i}]", code="unsupported_parameter")  # fmt: skip


def input_messages(raw: object) -> list[Message]:
    """``input`` as chat messages (see the module docstring)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise invalid_type("input", "a string or an array of input items", raw)
    out: list[Message] = []
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_type(param, "an object", item)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidArgumentError(f"Invalid value: {json.dumps(role)}. Supported values "
                                           "are: 'user', 'assistant', 'system' and 'developer'.",
                                           param=f"{param}.role", code="invalid_value")  # fmt: skip
            text = content_text(item.get("content"), f"{param}.content")
            if role == "assistant":
                turn = _assistant(out)
                turn["content"] = _joined(turn["content"], text)
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": _required_str(item, "call_id", param), "type": "function",
                    "function": {"name": _required_str(item, "name", param),
                                 "arguments": _required_str(item, "arguments", param)}}  # fmt: skip
            _assistant(out).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else content_text(output, f"{param}.output")
            out.append({"role": "tool", "tool_call_id": _required_str(item, "call_id", param),
                        "content": text})  # fmt: skip
        elif kind != "reasoning":
            raise InvalidArgumentError(f"Input items of type {json.dumps(kind)} are not supported "
                                       "by this server.", param=f"{param}.type",
                                       code="unsupported_parameter")  # fmt: skip
    return out


def _assistant(out: list[Message]) -> Message:
    """The assistant turn that assistant-side items join (a new one unless the last is one)."""
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": ""})
    return out[-1]


def _joined(before: str, text: str) -> str:
    return f"{before}\n{text}" if before and text else before + text


def content_text(raw: object, param: str) -> str:
    """A content string, or its text parts joined with newlines (other parts are a 400)."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise invalid_type(param, "a string or an array of content parts", raw)
    texts = []
    for j, part in enumerate(raw):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidArgumentError(f"Content parts of type {json.dumps(kind)} are not "
                                       "supported by this server; only text parts are.",
                                       param=f"{param}[{j}]", code="unsupported_parameter")  # fmt: skip
        texts.append(part["text"])
    return "\n".join(texts)


def _required_str(item: Mapping[str, object], key: str, param: str) -> str:
    value = get_str(item, key, param=f"{param}.{key}")
    if value is None:
        raise missing(f"{param}.{key}")
    return value


def _tools(raw: object) -> list[dict[str, Any]]:
    """Function tools in chat's ``function`` form; any other tool type is a 400."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid_type("tools", "an array", raw)
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise invalid_type(f"tools[{i}]", "an object", tool)
        kind = tool.get("type")
        if kind != "function":
            raise InvalidArgumentError(f"Tools of type {json.dumps(kind)} are not supported by "
                                       "this server; only 'function' tools are.",
                                       param=f"tools[{i}].type", code="unsupported_parameter")  # fmt: skip
        out.append({k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None})  # fmt: skip
    return out


def _tool_choice(raw: object) -> object:
    if isinstance(raw, str):
        return raw  # the chat parser checks the value
    if isinstance(raw, dict) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    kind = raw.get("type") if isinstance(raw, dict) else None
    raise InvalidArgumentError(f"'tool_choice' of type {json.dumps(kind)} is not supported by this "
                               "server; use 'auto', 'none', 'required' or "
                               '{"type": "function", "name": ...}.', param="tool_choice",
                               code="unsupported_parameter")  # fmt: skip


def _text_format(raw: object) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None for plain text)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid_type("text", "an object", raw)
    fmt = raw.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_type("text.format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise InvalidArgumentError(f"Invalid value: {json.dumps(kind)}. Supported values are: 'text', "
                               "'json_object' and 'json_schema'.", param="text.format.type",
                               code="invalid_value")  # fmt: skip


def _echo_format(chat_format: Mapping[str, Any] | None) -> dict[str, Any]:
    if chat_format is None:
        return {"type": "text"}
    if chat_format["type"] == "json_schema":
        return {"type": "json_schema", **chat_format["json_schema"]}
    return dict(chat_format)


def _metadata(raw: object) -> dict[str, str]:
    """Up to 16 string pairs, as OpenAI allows (keys up to 64, values up to 512 characters)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > 16:
        raise invalid_type("metadata", "an object of at most 16 string values", raw)
    for key, value in raw.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise InvalidArgumentError("'metadata' keys are at most 64 characters and values "
                                       "strings of at most 512.", param=f"metadata.{key}",
                                       code="invalid_value")  # fmt: skip
    return dict(raw)


def responses_param(param: str | None) -> str | None:
    """A chat-request field's name as the Responses API names it."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    if param in ("max_completion_tokens", "max_tokens"):
        return "max_output_tokens"
    if param.startswith("response_format"):
        return "text.format" + param[len("response_format"):].replace(".json_schema", "", 1)
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function", "", 1)
    return param
