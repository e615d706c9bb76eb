"""Tool calling at the gateway: the request's ``tools`` / ``tool_choice`` /
``parallel_tool_calls``, the grammar that enforces ``required`` and named choices, and the entry
points that turn a model's tool-call text into OpenAI ``tool_calls`` (whole, or streamed).

The formats themselves live in ``tool_parsers/`` (one class per format, registered by name; see
its ``__init__``): ``hermes``, ``llama3_json``, ``mistral``, ``qwen3_coder``, ``pythonic`` and
``deepseek_v3``; ``--tool-call-parser auto`` reads the model's chat template.

``tool_choice``: ``none`` renders no tools and parses nothing; ``auto`` renders them and parses
whatever calls the model writes; ``required`` and a named function constrain decoding with an
llguidance grammar (the format's Lark rules, whose arguments are the tools' ``parameters``
schemas), so the reply is a call whatever the model would have said. A named function gets
exactly one call (as OpenAI and vLLM answer it), ``required`` one or, with
``parallel_tool_calls`` (the default), several.

A reply cut by ``max_tokens`` keeps its complete calls (``finish_reason`` stays ``length``); the
call it was cut in is dropped, not returned as raw markup. The output safety filter runs on the
model's text before any of this, so it sees every argument.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import MAX_GRAMMAR_BYTES
from services.gateway.api_schema import MAX_TOOLS
from services.gateway.openai_fields import invalid_type
from services.gateway.structured_outputs import GrammarSource, compile_source
from services.gateway.tool_parsers import (
    PARSERS,
    TOOL_CALL_PARSERS,
    choose_format,
    new_parser,
    template_renders_tools,
)
from services.gateway.tool_parsers.base import (
    CallDelta,
    StreamDelta,
    Tool,
    ToolCall,
    ToolParser,
    ToolsRequest,
    literal_for,
    new_call_id,
    partial_marker,
)
from services.gateway.tool_parsers.hermes import CLOSE as HERMES_CLOSE
from services.gateway.tool_parsers.hermes import OPEN as HERMES_OPEN
from services.gateway.tool_parsers.llama3_json import PYTHON_TAG
from services.gateway.tool_parsers.mistral import MARK as MISTRAL_MARK

__all__ = [
    "HERMES_CLOSE", "HERMES_OPEN", "MISTRAL_MARK", "PYTHON_TAG", "TOOL_CALL_PARSERS", "CallDelta",
    "StreamDelta", "StreamedCalls", "Tool", "ToolCall", "ToolParser", "ToolsRequest",
    "choose_format", "hermes_instructions", "hermes_text", "new_parser", "parse_calls",
    "parse_message_tool_calls", "parse_tools", "partial_marker", "template_renders_tools",
    "tool_grammar",
    "tool_grammar_source",
]  # fmt: skip

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


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
        calls.append(ToolCall(function["name"], arguments, call_id or new_call_id()))
    return tuple(calls)


# --------------------------------------------------------------------------- formats


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


def tool_grammar_source(
    request: ToolsRequest, fmt: str, special_tokens: Mapping[str, int] | None = None
) -> GrammarSource:
    """The Lark text of :func:`tool_grammar`, not compiled: the handlers compile it in the
    grammar pool (``grammar_pool.py``), off the event loop; 400 naming ``tools`` when it is
    over the size budget."""
    if fmt not in PARSERS:
        raise InvalidArgumentError(f"tool_choice {request.choice!r} cannot be enforced for the "
                                   f"{fmt} format; use 'auto'", param="tool_choice")  # fmt: skip
    rules = PARSERS[fmt].grammar(request.chosen, request.many, literal_for(special_tokens))
    lark = "start: calls\n" + rules
    if len(lark.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidArgumentError(
            f"The tools' parameters are too large to enforce (over {MAX_GRAMMAR_BYTES} bytes as "
            "a grammar).", param="tools", code="invalid_value")  # fmt: skip
    return GrammarSource("lark", lark, "tools")


def tool_grammar(
    request: ToolsRequest, fmt: str, special_tokens: Mapping[str, int] | None = None
) -> str:
    """The llguidance grammar that makes the reply a call (``required``: any tool; a name:
    that one, exactly once), with arguments valid against the tool's ``parameters``.
    ``special_tokens`` (the tokenizer's text -> id) says which markers are single special
    tokens (then the grammar asks for that token, as the model was trained to write it, e.g.
    Mistral's ``[TOOL_CALLS]``) rather than text. Compiles on the calling thread."""
    return compile_source(tool_grammar_source(request, fmt, special_tokens))


# --------------------------------------------------------------------------- output parsing


def parse_calls(
    text: str, fmt: str, tools: Sequence[Tool] = (), *, truncated: bool = False
) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of a whole reply; ``truncated`` (cut by ``max_tokens``) keeps the
    complete calls and drops the one it was cut in."""
    return new_parser(fmt, tools).parse(text, truncated)


class StreamedCalls:
    """Streaming side of one choice, call by call: text deltas in, content deltas and the calls
    each delta completed out (for APIs that send a call whole; OpenAI's chat chunks use the
    parser's :class:`CallDelta` s instead)."""

    def __init__(self, fmt: str, tools: Sequence[Tool] = ()) -> None:
        self.fmt = fmt
        self.parser = new_parser(fmt, tools)

    @property
    def calls(self) -> list[ToolCall]:
        return self.parser.calls

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content now safe to send, and the calls completed by ``text``."""
        done = len(self.parser.calls)
        delta = self.parser.feed(text)
        return delta.content, self.parser.calls[done:]

    def finish(self, truncated: bool = False) -> tuple[str, list[ToolCall]]:
        """At the end of the reply: what was held back, as content or calls."""
        done = len(self.parser.calls)
        delta = self.parser.finish(truncated)
        return delta.content, self.parser.calls[done:]
