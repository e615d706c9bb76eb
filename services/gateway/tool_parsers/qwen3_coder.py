"""``qwen3_coder``: Qwen3-Coder's XML calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; it becomes JSON by the tool's ``parameters`` schema: ``string``
as written, ``integer`` / ``number`` / ``boolean`` / ``null`` read as such, objects and arrays
as JSON (or Python literals), anything unreadable as the string. Text outside the blocks is
content. Streamed, a call's name leaves once ``<function=NAME>`` is written, then its arguments
object one finished parameter at a time (the values are not JSON text in the output).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

from services.gateway.tool_parsers.base import (
    Literal,
    Scan,
    ScannedCall,
    Tool,
    ToolParser,
    json_rule,
    repeated,
    scan_tagged,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def scan(self, text: str, final: bool, truncated: bool) -> Scan:
        def whole(start: int, end: int, body: str) -> ScannedCall | None:
            call = self._call(body)
            return call if call is not None and call.complete else None

        return scan_tagged(text, final, truncated, OPEN, CLOSE,
                           lambda _, body: self._call(body), whole)  # fmt: skip

    def _call(self, body: str) -> ScannedCall | None:
        head = body.lstrip()
        if not head.startswith(FUNCTION):
            return None
        name_end = head.find(">")
        if name_end < 0:
            return None
        name = head[len(FUNCTION) : name_end].strip()
        schema = self.tools[name].parameters if name in self.tools else {}
        fields: list[str] = []
        pos = name_end + 1
        while True:
            at = head.find(PARAMETER, pos)
            done = head.find(FUNCTION_END, pos)
            if at < 0 or (0 <= done < at):
                break
            key_end = head.find(">", at)
            value_end = head.find(PARAMETER_END, key_end) if key_end >= 0 else -1
            if value_end < 0:
                break
            key = head[at + len(PARAMETER) : key_end].strip()
            value = _value(head[key_end + 1 : value_end], _schema_of(schema, key))
            fields.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
            pos = value_end + len(PARAMETER_END)
        complete = head.find(FUNCTION_END, pos) >= 0
        return ScannedCall(name, "{" + ", ".join(fields) + ("}" if complete else ""), complete)

    @classmethod
    def grammar(cls, tools: Sequence[Tool], parallel: bool, literal: Literal) -> str:
        names = " | ".join(f"call_{i}" for i in range(len(tools)))
        rules = [repeated("call", parallel).strip(),
                 f'call: {literal(OPEN)} "\\n" ({names}) "\\n" {literal(CLOSE)}',
                 'text[stop="\\n</parameter>"]: /(.|\\n)*/']  # fmt: skip
        for i, tool in enumerate(tools):
            properties = tool.parameters.get("properties") or {}
            required = set(tool.parameters.get("required") or ())
            params = []
            for j, (key, spec) in enumerate(properties.items()):
                rule = f"p_{i}_{j}"
                rules.append(f'{rule}: "<parameter={key}>\\n" {_value_rule(spec)} "\\n"')
                params.append(rule if key in required else f"{rule}?")
            body = " ".join(params)
            rules.append(f'call_{i}: "<function={tool.name}>\\n" {body} "</function>"')
        return "\n".join(rules) + "\n"


def _schema_of(parameters: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    properties = parameters.get("properties")
    spec = properties.get(key) if isinstance(properties, Mapping) else None
    return spec if isinstance(spec, Mapping) else {}


def _type_of(spec: Mapping[str, Any]) -> str:
    kind = spec.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind is None and "enum" in spec:
        values = spec["enum"]
        kind = "string" if all(isinstance(v, str) for v in values) else "object"
    return str(kind) if kind is not None else "string"


def _value(raw: str, spec: Mapping[str, Any]) -> Any:
    """A parameter's text as the JSON value its schema asks for (one newline either side is the
    layout's, not the value's)."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    kind = _type_of(spec)
    if text.strip().lower() == "null" and kind != "string":
        return None
    try:
        if kind in ("integer", "int"):
            return int(text.strip())
        if kind in ("number", "float"):
            number = float(text.strip())
            return int(number) if number.is_integer() and "." not in text else number
        if kind in ("boolean", "bool"):
            lowered = text.strip().lower()
            return {"true": True, "false": False}[lowered] if lowered in ("true", "false") else text
        if kind == "string":
            return text
        try:
            return json.loads(text)
        except ValueError:
            return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError):
        return text


def _value_rule(spec: Mapping[str, Any]) -> str:
    """The Lark expression of one parameter's value (ending before ``\\n</parameter>``)."""
    kind = _type_of(spec)
    if isinstance(spec.get("enum"), list) and all(isinstance(v, str) for v in spec["enum"]):
        return "(" + " | ".join(json.dumps(v) for v in spec["enum"]) + ') "\\n</parameter>"'
    if kind == "string" and isinstance(spec.get("maxLength"), int):  # one bounded line
        return f'/[^\\n]{{0,{spec["maxLength"]}}}/ "\\n</parameter>"'
    if kind == "string":
        return "text"
    if kind in ("integer", "int"):
        return '/-?[0-9]+/ "\\n</parameter>"'
    if kind in ("number", "float"):
        return f'{_NUMBER} "\\n</parameter>"'
    if kind in ("boolean", "bool"):
        return '("true" | "false") "\\n</parameter>"'
    return f'{json_rule(spec)} "\\n</parameter>"'
