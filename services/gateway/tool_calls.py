"""Tool calling: the request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, the grammar
that enforces ``required`` and named choices, and the parsers that turn a model's tool-call text
into OpenAI ``tool_calls`` (whole, or streamed: the function name first, then its arguments).

Formats (``--tool-call-parser``; ``auto`` reads the model's chat template):

* ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per
  call: Qwen2.5 / Qwen3, Hermes, and the instructions Tandem writes into the system prompt for a
  template that has no tool support of its own (SmolLM2's);
* ``llama3_json``: the whole reply is ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3;
  ``<|python_tag|>`` before it is dropped);
* ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}``.

``tool_choice``: ``none`` renders no tools and parses nothing; ``auto`` renders them and parses
whatever calls the model writes; ``required`` and a named function constrain decoding with an
llguidance grammar (a Lark grammar whose calls are ``%json`` schemas built from the tools'
``parameters``), so the reply is a call whatever the model would have said.

The output safety filter runs on the model's text before any of this, so it sees every argument.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import InvalidArgumentError
from services.gateway.api_schema import MAX_TOOLS
from services.gateway.openai_fields import invalid_type

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]
    function: Mapping[str, Any] = field(default_factory=dict)  # as the client sent it

    def to_openai(self) -> dict[str, Any]:
        """The ``{"type": "function", "function": {...}}`` object a chat template renders: the
        client's own, key order included (templates print it with ``tojson``)."""
        function = dict(self.function) or {"name": self.name, "description": self.description,
                                           "parameters": dict(self.parameters)}  # fmt: skip
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolsRequest:
    """The request's tools; ``choice`` is ``"none"``, ``"auto"``, ``"required"`` or a name."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether tools are rendered and calls parsed."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice != "auto"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        if index is not None:
            out["index"] = index
        return out


# --------------------------------------------------------------------------- request parsing


def parse_tools(obj: Mapping[str, object]) -> ToolsRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` (None when no tools are given)."""
    raw = obj.get("tools")
    choice_raw = obj.get("tool_choice")
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid_type("parallel_tool_calls", "a boolean", parallel)
    if raw is None or raw == []:
        if choice_raw not in (None, "none", "auto"):
            raise InvalidArgumentError("'tool_choice' needs 'tools'.", param="tool_choice",
                                       code="invalid_value")  # fmt: skip
        return None
    if not isinstance(raw, list):
        raise invalid_type("tools", "an array", raw)
    if len(raw) > MAX_TOOLS:
        raise InvalidArgumentError(f"At most {MAX_TOOLS} tools are supported.", param="tools",
                                   code="invalid_value")  # fmt: skip
    tools: list[Tool] = []
    for i, item in enumerate(raw):
        param = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function":
            raise InvalidArgumentError(f"'{param}' must be {{\"type\": \"function\", "
                                       "\"function\": {...}}.", param=param,
                                       code="invalid_value")  # fmt: skip
        function = item.get("function")
        if not isinstance(function, dict):
            raise invalid_type(f"{param}.function", "an object", function)
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgumentError(f"'{param}.function.name' must match {_NAME.pattern}.",
                                       param=f"{param}.function.name", code="invalid_value")  # fmt: skip
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise invalid_type(f"{param}.function.description", "a string", description)
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise invalid_type(f"{param}.function.parameters", "a JSON schema object", parameters)
        tools.append(Tool(name, description, parameters, function))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidArgumentError("Tool names must be unique.", param="tools", code="invalid_value")
    choice = _parse_choice(choice_raw, names)
    return ToolsRequest(tuple(tools), choice, True if parallel is None else parallel)


def _parse_choice(raw: object, names: Sequence[str]) -> str:
    if raw is None:
        return "auto"
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise InvalidArgumentError(f"Invalid value: {json.dumps(raw)}. Supported values are: "
                                       "'none', 'auto' and 'required'.", param="tool_choice",
                                       code="invalid_value")  # fmt: skip
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        function = raw.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise InvalidArgumentError(f"'tool_choice' names {json.dumps(name)}, which is not "
                                       "one of the tools.", param="tool_choice",
                                       code="invalid_value")  # fmt: skip
        return str(name)
    raise invalid_type("tool_choice", "'none', 'auto', 'required' or a named function", raw)


def parse_message_tool_calls(raw: object, param: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (kept in the history the template renders)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise invalid_type(param, "an array", raw)
    calls = []
    for i, item in enumerate(raw):
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid_type(f"{param}[{i}].function", "an object with a name", function)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):  # OpenAI's type: JSON text
            raise invalid_type(f"{param}[{i}].function.arguments", "a string", arguments)
        call_id = item.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise invalid_type(f"{param}[{i}].id", "a string", call_id)
        if item.get("type", "function") != "function":
            raise InvalidArgumentError(f"'{param}[{i}].type' must be 'function'.",
                                       param=f"{param}[{i}].type", code="invalid_value")  # fmt: skip
        calls.append(ToolCall(function["name"], arguments, call_id or ToolCall("", "").id))
    return tuple(calls)


# --------------------------------------------------------------------------- formats


def choose_format(flag: str, chat_template: str) -> str:
    """The tool-call format of ``--tool-call-parser``, ``auto`` reading the chat template."""
    if flag != "auto":
        return flag
    if MISTRAL_MARK in chat_template:
        return "mistral"
    if HERMES_OPEN in chat_template or "tools" not in chat_template:
        return "hermes"  # Qwen / Hermes, or Tandem's own instructions (no tool support)
    if PYTHON_TAG in chat_template or "<|eom_id|>" in chat_template or '"parameters"' in chat_template:
        return "llama3_json"
    return "hermes"


def template_renders_tools(chat_template: str) -> bool:
    """Whether the model's own template takes ``tools`` (else Tandem writes the instructions)."""
    return "tools" in chat_template


def hermes_instructions(tools: Sequence[Tool]) -> str:
    """The system-prompt text Qwen2.5's template writes, for templates without tool support."""
    lines = "\n".join(json.dumps(t.to_openai()) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{lines}\n</tools>\n\nFor each function call, return a json object with function name "
        "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def hermes_text(calls: Sequence[ToolCall]) -> str:
    """Earlier calls written back into the history, for templates without tool support."""
    return "\n".join(f'{HERMES_OPEN}\n{{"name": {json.dumps(c.name)}, "arguments": '
                     f"{c.arguments}}}\n{HERMES_CLOSE}" for c in calls)  # fmt: skip


def tool_grammar(
    request: ToolsRequest, fmt: str, special_tokens: Mapping[str, int] | None = None
) -> str:
    """The llguidance grammar that makes the reply a call (``required``: any tool; a name:
    that one), with arguments valid against the tool's ``parameters``. ``special_tokens`` (the
    tokenizer's text -> id) says whether Mistral's ``[TOOL_CALLS]`` is one token (then the
    grammar asks for that token, as the model was trained to write it) or plain text."""
    import llguidance

    tools = [t for t in request.tools if request.choice in ("required", t.name)]
    key = "parameters" if fmt == "llama3_json" else "arguments"
    schema: dict[str, Any] = {
        "anyOf": [{"type": "object", "properties": {"name": {"const": t.name},
                                                     key: dict(t.parameters)},
                   "required": ["name", key], "additionalProperties": False} for t in tools]
    }  # fmt: skip
    if fmt == "hermes":
        call = f'"{HERMES_OPEN}\\n" %json {json.dumps(schema)} "\\n{HERMES_CLOSE}"'
        start = 'call ("\\n" call)*' if request.parallel else "call"
    elif fmt == "llama3_json":
        call, start = f"%json {json.dumps(schema)}", "call"
    elif fmt == "mistral":
        array = {"type": "array", "items": schema, "minItems": 1}
        if not request.parallel:
            array["maxItems"] = 1
        mark_id = (special_tokens or {}).get(MISTRAL_MARK)
        mark = f"<[{mark_id}]>" if mark_id is not None else json.dumps(MISTRAL_MARK)
        call, start = f"%json {json.dumps(array)}", f"{mark} call"
    else:
        raise InvalidArgumentError(f"tool_choice {request.choice!r} cannot be enforced for the "
                                   f"{fmt} format; use 'auto'", param="tool_choice")  # fmt: skip
    grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {start}\ncall: {call}\n")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidArgumentError(f"Invalid tool parameters: {error.strip()}", param="tools",
                                   code="invalid_value")  # fmt: skip
    return grammar


# --------------------------------------------------------------------------- output parsing


def parse_calls(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of a whole reply; a reply with no well-formed call is all content."""
    if fmt == "hermes":
        calls, kept, rest = [], [], text
        while HERMES_OPEN in rest:
            before, _, after = rest.partition(HERMES_OPEN)
            body, closed, rest = after.partition(HERMES_CLOSE)
            call = _call_of(body, "arguments")
            if call is None:
                return text, []
            kept.append(before)
            calls.append(call)
            if not closed:
                rest = ""
        content = ("".join(kept) + rest).strip()
        return content, calls
    stripped = text.strip()
    if fmt == "mistral" and MISTRAL_MARK in stripped:
        before, _, body = stripped.partition(MISTRAL_MARK)
        try:
            items = json.loads(body)
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [c for c in (_call_of(json.dumps(i), "arguments") for i in items) if c]
        return (before.strip(), calls) if len(calls) == len(items) else (text, [])
    if fmt == "llama3_json":
        body = stripped.removeprefix(PYTHON_TAG)
        if body.startswith("{"):
            call = _call_of(body, "parameters") or _call_of(body, "arguments")
            if call is not None:
                return "", [call]
    return text, []


def _call_of(body: str, key: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(key, obj.get("arguments", {}))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


class StreamedCalls:
    """Streaming side of one choice: text deltas in, content deltas and finished calls out.

    Text that might be the start of a call is held back until it is known: for ``hermes`` a
    block's text is held from ``<tool_call>`` to ``</tool_call>`` and leaves as one call (its
    name, then its arguments); for the whole-reply formats, a reply that opens like a call is
    held to the end and parsed whole."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._pending = ""
        self._started = False  # anything but whitespace was seen
        self._whole = False  # a whole-reply format holding everything
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content now safe to send, and the calls completed by ``text``."""
        self._pending += text
        if self.fmt != "hermes":
            if not self._started:
                head = self._pending.lstrip()
                markers = ("{", PYTHON_TAG, MISTRAL_MARK)
                if not head or any(m.startswith(head) and m != head for m in markers):
                    return "", []  # not yet known whether the reply opens like a call
                self._started = True
                self._whole = head.startswith(markers)
            if self._whole:
                return "", []
            out, self._pending = self._pending, ""
            return out, []
        out, done = [], []
        while True:
            start = self._pending.find(HERMES_OPEN)
            if start < 0:
                keep = partial_marker(self._pending, HERMES_OPEN)
                out.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            out.append(self._pending[:start])
            end = self._pending.find(HERMES_CLOSE, start)
            if end < 0:
                self._pending = self._pending[start:]
                break
            call = _call_of(self._pending[start + len(HERMES_OPEN) : end], "arguments")
            block = self._pending[start : end + len(HERMES_CLOSE)]
            self._pending = self._pending[end + len(HERMES_CLOSE) :]
            if call is None:
                out.append(block)  # not a well-formed call: it was text after all
            else:
                done.append(call)
        self.calls += done
        content = "".join(out)
        if self.calls and not content.strip():
            content = ""  # the newlines between calls
        return content, done

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the reply: what was held back, as content or calls."""
        pending, self._pending = self._pending, ""
        if not pending:
            return "", []
        content, calls = parse_calls(pending, self.fmt)
        self.calls += calls
        return content, calls


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (the text a
    stream must hold back: it may yet become the marker)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
