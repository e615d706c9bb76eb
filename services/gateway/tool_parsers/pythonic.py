"""``pythonic``: a Python list of calls, the whole reply — ``[get_weather(city="Paris"),
get_time(zone="CET")]`` (Llama 3.2's and Llama 4's tool format; Llama 4 may wrap it in
``<|python_start|>`` / ``<|python_end|>``). A reply that is not such a list is content.

Read with :mod:`ast`, never run: the reply must parse as a list of calls of plain names with
keyword arguments, and each argument must be a literal (:func:`ast.literal_eval`; JSON's
``true`` / ``false`` / ``null`` are read as Python's). Streamed, a call's name leaves once
``name(`` is written, its arguments (JSON) once its ``)`` is.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any

from services.gateway.tool_parsers.base import (
    Literal,
    Scan,
    ScannedCall,
    Tool,
    ToolParser,
    json_rule,
)
from services.gateway.tool_parsers.json_scan import Memo, string_end

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*\(")
_JSON_NAMES = {"true": True, "false": False, "null": None}
_PY_STRUCTURE = re.compile(r"[\"'()\[\]{}]")


class PythonicParser(ToolParser):
    name = "pythonic"

    def scan(self, text: str, final: bool, truncated: bool) -> Scan:
        head = text.strip()
        if head.startswith(START):
            head = head[len(START) :].removesuffix(END).strip()
        elif not final and START.startswith(head):
            return Scan("", [])  # not yet known whether the reply opens like calls
        if not head.startswith("["):
            return Scan(text, [])
        calls: list[ScannedCall] = []
        pos = 1
        while True:
            while pos < len(head) and head[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(head) or head[pos] == "]":
                break
            match = _NAME.match(head, pos)
            if match is None:
                if not final and re.fullmatch(r"\s*[A-Za-z0-9_.-]*\s*", head[pos:]):
                    return Scan("", calls)  # a name still being written
                return Scan(text, []) if final and not truncated else Scan("", calls)
            close = _closing_paren(head, match.end(), self.memo)
            if close is None:
                if not final:
                    calls.append(ScannedCall(match.group(1), None))
                break
            start = match.end() - 1
            arguments = self.cached(("args", start, close),
                                    lambda: _arguments(head[start : close + 1]))  # fmt: skip
            if arguments is None:
                return Scan(text, []) if final and not truncated else Scan("", calls)
            calls.append(ScannedCall(match.group(1), arguments, complete=True))
            pos = close + 1
        if final and not truncated and head[pos:].strip() != "]":
            return Scan(text, [])  # not a list of calls and nothing else
        return Scan("", calls)

    @classmethod
    def grammar(cls, tools: Sequence[Tool], parallel: bool, literal: Literal) -> str:
        names = " | ".join(f"call_{i}" for i in range(len(tools)))
        many = 'call (", " call)*' if parallel else "call"
        rules = [f'calls: "[" {many} "]"', f"call: {names}"]
        for i, tool in enumerate(tools):
            properties = list((tool.parameters.get("properties") or {}).items())
            required = set(tool.parameters.get("required") or ())
            for j, (key, spec) in enumerate(properties):
                rules.append(f'v_{i}_{j}: "{key}=" {_value_rule(spec)}')
            # a_i_j: the arguments from the j-th on, the first without a leading ", "
            # (t_i_j: the same, each after ", "); optional ones may be left out.
            n = len(properties)
            rules.append(f'a_{i}_{n}: ""')
            rules.append(f't_{i}_{n}: ""')
            for j in range(n - 1, -1, -1):
                key = properties[j][0]
                rules.append(f'a_{i}_{j}: v_{i}_{j} t_{i}_{j + 1}'
                             + ("" if key in required else f" | a_{i}_{j + 1}"))
                rules.append(f't_{i}_{j}: ", " v_{i}_{j} t_{i}_{j + 1}'
                             + ("" if key in required else f" | t_{i}_{j + 1}"))  # fmt: skip
            rules.append(f'call_{i}: "{tool.name}(" a_{i}_0 ")"')
        return "\n".join(rules) + "\n"


def _closing_paren(text: str, pos: int, memo: Memo) -> int | None:
    """Index of the ``)`` closing the call whose arguments start at ``pos``, or None (jumping
    between quotes and brackets, and resuming where the last scan of this reply stopped: a
    stream re-reads its reply at every delta)."""
    depth, i = memo.get(("p", pos), (1, pos))
    while True:
        found = _PY_STRUCTURE.search(text, i)
        if found is None:
            memo["p", pos] = (depth, len(text))
            return None
        c, i = found.group(), found.start()
        if c in "\"'":
            end = string_end(text, i, c, memo)
            if end is None:
                memo["p", pos] = (depth, i)
                return None
            i = end
            continue
        depth += 1 if c in "([{" else -1
        if depth == 0:
            return i
        i += 1


def _arguments(args: str) -> str | None:
    """The JSON object of ``(k=v, ...)``, or None when it is not keyword literals."""
    try:
        node = ast.parse("f" + args, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    out: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            out[keyword.arg] = _literal(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        return json.dumps(out, ensure_ascii=False)
    except (TypeError, ValueError):
        return None  # a literal JSON has no form for (bytes, complex, sets)


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("no ** in a literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    value = ast.literal_eval(node)
    if isinstance(value, (set, frozenset, bytes, complex)):
        raise ValueError("not a JSON value")
    return value


def _value_rule(spec: object) -> str:
    """A keyword's value: Python's ``True`` / ``False`` / ``None`` for a boolean or null, else
    the JSON of its schema (a JSON string, number, list or object is also a Python literal)."""
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    return json_rule(spec) if isinstance(spec, dict) else f"%json {json.dumps(spec)}"
