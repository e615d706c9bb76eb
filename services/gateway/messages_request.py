"""``POST /v1/messages`` bodies (Anthropic's Messages API), mapped onto a chat-completions request.

Like the Responses API (``responses_request.py``), the body is rewritten as the chat body it
means and validated by the chat parser, so sampling, tools and tool choice are checked once:

1. ``system`` (a string or ``text`` blocks) -> a leading system message;
2. ``messages``: ``user`` / ``assistant`` turns whose content is a string or blocks. ``text``
   blocks join into the turn's text; an assistant's ``tool_use`` blocks (``id``, ``name``,
   ``input``) become its ``tool_calls``; a user's ``tool_result`` blocks (``tool_use_id``,
   ``content`` as a string or ``text`` blocks, ``is_error``) become ``tool`` turns before its
   text; ``thinking`` blocks sent back are dropped; ``image``, ``document`` and other blocks
   are a 400;
3. ``max_tokens`` (required, as Anthropic requires it), ``stop_sequences`` -> ``stop``,
   ``temperature``, ``top_p``, ``top_k``, ``stream``, ``metadata.user_id`` -> ``user``;
4. ``tools`` (``name``, ``description``, ``input_schema``; server tools such as web search are a
   400) and ``tool_choice``: ``auto``, ``any`` (-> ``required``), ``tool`` with ``name``,
   ``none``; ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``.

With ``stop_sequences`` the request also asks the workers for the tokens' logprobs (not shown
to the client): the last token then tells a stop sequence from the end of the turn
(``messages_renderer.py``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidArgumentError
from services.gateway.openai_fields import get_str, invalid_type, missing, require_object
from services.gateway.openai_requests import ChatRequest, parse_chat_request

Message = dict[str, Any]
_UNSUPPORTED = ("container", "mcp_servers")


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A validated Messages body: the chat request it means and its stop sequences."""

    chat: ChatRequest
    stop_sequences: tuple[str, ...]


def parse_messages_request(
    body: object, *, served_models: Sequence[str], require_max_tokens: bool = True
) -> MessagesRequest:
    """Validate a Messages body (``count_tokens`` needs no ``max_tokens``); 400 / 404."""
    obj = require_object(body)
    for key in _UNSUPPORTED:
        if obj.get(key) not in (None, [], {}):
            raise InvalidArgumentError(f"{key}: not supported by this server.", param=key,
                                       code="unsupported_parameter")  # fmt: skip
    if obj.get("model") is None:
        raise missing("model")
    if require_max_tokens and obj.get("max_tokens") is None:
        raise missing("max_tokens")
    raw = obj.get("messages")
    if raw is None:
        raise missing("messages")
    if not isinstance(raw, list):
        raise invalid_type("messages", "an array", raw)
    messages = _system(obj.get("system"))
    for i, message in enumerate(raw):
        messages += _turn(message, f"messages.{i}")
    chat: dict[str, Any] = {"model": obj["model"], "messages": messages}
    chat.update({k: obj[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "stream")
                 if obj.get(k) is not None})  # fmt: skip
    stops = _stop_sequences(obj.get("stop_sequences"))
    if stops:
        chat["stop"] = list(stops)
    metadata = obj.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise invalid_type("metadata", "an object", metadata)
        if metadata.get("user_id") is not None:
            chat["user"] = metadata["user_id"]
    tools = _tools(obj.get("tools"))
    if tools:
        chat["tools"] = tools
    chat.update(_tool_choice(obj.get("tool_choice")))
    parsed = parse_chat_request(chat, served_models=served_models)
    if stops:  # the last token's logprob says whether a stop sequence ended the reply
        parsed = dataclasses.replace(parsed, sampling=dataclasses.replace(parsed.sampling,
                                                                          logprobs=0))  # fmt: skip
    return MessagesRequest(parsed, stops)


def _system(raw: object) -> list[Message]:
    if raw is None:
        return []
    text = raw if isinstance(raw, str) else _text_blocks(raw, "system")
    return [{"role": "system", "content": text}] if text else []


def _text_blocks(raw: object, param: str) -> str:
    """``text`` blocks joined with newlines; any other block is a 400."""
    if not isinstance(raw, list):
        raise invalid_type(param, "a string or an array of text blocks", raw)
    texts = []
    for j, block in enumerate(raw):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _unsupported_block(block, f"{param}.{j}")
        text = block.get("text")
        if not isinstance(text, str):
            raise invalid_type(f"{param}.{j}.text", "a string", text)
        texts.append(text)
    return "\n".join(texts)


def _unsupported_block(block: object, param: str) -> InvalidArgumentError:
    kind = block.get("type") if isinstance(block, dict) else None
    return InvalidArgumentError(f"{param}.type: content blocks of type {json.dumps(kind)} are not "
                                "supported by this server.", param=f"{param}.type",
                                code="unsupported_parameter")  # fmt: skip


def _turn(raw: object, param: str) -> list[Message]:
    """One Anthropic message as chat messages (see the module docstring)."""
    if not isinstance(raw, dict):
        raise invalid_type(param, "an object", raw)
    role = raw.get("role")
    if role not in ("user", "assistant"):
        raise InvalidArgumentError(f"{param}.role: Input should be 'user' or 'assistant'.",
                                   param=f"{param}.role", code="invalid_value")  # fmt: skip
    content = raw.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid_type(f"{param}.content", "a string or an array of content blocks", content)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[Message] = []
    for j, block in enumerate(content):
        where = f"{param}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise invalid_type(f"{where}.text", "a string", block.get("text"))
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        elif kind not in ("thinking", "redacted_thinking") or role != "assistant":
            raise _unsupported_block(block, where)
    out = list(results)
    if role == "assistant":
        turn: Message = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    elif texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_use(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    call_id, name = get_str(block, "id", param=f"{param}.id"), get_str(block, "name")
    if call_id is None or name is None:
        raise missing(f"{param}.{'id' if call_id is None else 'name'}")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise invalid_type(f"{param}.input", "an object", arguments)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip


def _tool_result(block: Mapping[str, Any], param: str) -> Message:
    call_id = get_str(block, "tool_use_id", param=f"{param}.tool_use_id")
    if call_id is None:
        raise missing(f"{param}.tool_use_id")
    raw = block.get("content", "")
    text = raw if isinstance(raw, str) else _text_blocks(raw, f"{param}.content")
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _stop_sequences(raw: object) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise invalid_type("stop_sequences", "an array of strings", raw)
    return tuple(raw)


def _tools(raw: object) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid_type("tools", "an array", raw)
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise invalid_type(f"tools.{i}", "an object", tool)
        if tool.get("type", "custom") != "custom" or "input_schema" not in tool:
            kind = tool.get("type", "custom")
            raise InvalidArgumentError(f"tools.{i}: tools of type {json.dumps(kind)} are not "
                                       "supported by this server; give name, description and "
                                       "input_schema.", param=f"tools.{i}",
                                       code="unsupported_parameter")  # fmt: skip
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(raw: object) -> dict[str, Any]:
    """The chat ``tool_choice`` / ``parallel_tool_calls`` for Anthropic's ``tool_choice``."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise invalid_type("tool_choice", "an object", raw)
    kind = raw.get("type")
    choices: dict[str, object] = {"auto": "auto", "any": "required", "none": "none"}
    if kind == "tool":
        choice: object = {"type": "function", "function": {"name": raw.get("name")}}
    elif isinstance(kind, str) and kind in choices:
        choice = choices[kind]
    else:
        raise InvalidArgumentError(f"tool_choice.type: Input should be 'auto', 'any', 'tool' or "
                                   f"'none', not {json.dumps(kind)}.", param="tool_choice.type",
                                   code="invalid_value")  # fmt: skip
    out: dict[str, object] = {"tool_choice": choice}
    if raw.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def messages_param(param: str | None) -> str | None:
    """A chat-request field's name as the Messages API names it."""
    renamed = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}
    if param is None:
        return None
    if param.startswith("tools[") and ".function" in param:
        param = param.replace(".function.parameters", ".input_schema").replace(".function", "")
    return renamed.get(param, param)
