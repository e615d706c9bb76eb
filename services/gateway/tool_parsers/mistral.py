"""``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}`` objects
(Mistral's tokenizers before v11; ``[TOOL_CALLS]`` is one special token there, and the grammar
asks for that token). Text before the marker is content.

Streamed, each call's name leaves once written and its arguments as they are generated.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.tool_parsers.base import (
    Literal,
    Scan,
    ScannedCall,
    Tool,
    ToolParser,
    call_schema,
    json_rule,
    partial_marker,
)
from services.gateway.tool_parsers.json_scan import (
    NotJson,
    complete_call,
    scan_call_object,
    skip_ws,
)

MARK = "[TOOL_CALLS]"
_KEYS = ("arguments", "parameters")


class MistralParser(ToolParser):
    name = "mistral"

    def scan(self, text: str, final: bool, truncated: bool) -> Scan:
        start = text.find(MARK)
        if start < 0:
            keep = 0 if final else partial_marker(text, MARK)
            return Scan(text[: len(text) - keep], [])
        content, body = text[:start], text[start + len(MARK) :]
        calls: list[ScannedCall] = []
        i = skip_ws(body, 0)
        try:
            if i < len(body) and body[i] != "[":
                raise NotJson("an array of calls")
            i += 1
            while True:
                i = skip_ws(body, i)
                if i >= len(body):
                    if final and not truncated:
                        raise NotJson("an unfinished array")
                    break
                if body[i] == "]":
                    break
                if body[i] == ",":
                    i += 1
                    continue
                partial = scan_call_object(body, i, _KEYS, self.memo)
                if partial.end is None:
                    if final and not truncated:
                        raise NotJson("an unfinished call")
                    if not final and partial.name is not None:
                        calls.append(ScannedCall(partial.name, partial.arguments))
                    break
                end = partial.end
                found = self.cached(("call", i, end), lambda: complete_call(body[i:end], _KEYS))
                if found is None:
                    raise NotJson("not a call")
                calls.append(ScannedCall(found[0], found[1], complete=True))
                i = partial.end
        except NotJson:
            if final and not truncated:
                return Scan(text, [])
        return Scan(content, calls)

    @classmethod
    def grammar(cls, tools: Sequence[Tool], parallel: bool, literal: Literal) -> str:
        array: dict[str, object] = {"type": "array", "items": call_schema(tools, "arguments"),
                                    "minItems": 1}  # fmt: skip
        if not parallel:
            array["maxItems"] = 1
        return f"calls: {literal(MARK)} {json_rule(array)}\n"
