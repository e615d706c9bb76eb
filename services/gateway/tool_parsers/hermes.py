"""``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per
call, text around them being content. Qwen2.5 / Qwen3, Hermes, and the instructions Tandem
writes into the system prompt for a template with no tool support of its own (SmolLM2's).

Streamed, a block's name leaves once written and its arguments as they are generated.
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
    repeated,
    whitespace_only,
)
from services.gateway.tool_parsers.json_scan import NotJson, complete_call, scan_call_object

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_KEYS = ("arguments", "parameters")


class HermesParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool, truncated: bool) -> Scan:
        content: list[str] = []
        calls: list[ScannedCall] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - partial_marker(tail, OPEN)]
                if not calls or not whitespace_only(tail):
                    content.append(tail)
                break
            before = text[pos:start]
            if not calls or not whitespace_only(before):
                content.append(before)
            body_start = start + len(OPEN)
            end = text.find(CLOSE, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            if end < 0 and not final:
                try:
                    partial = scan_call_object(text, body_start, _KEYS, self.memo)
                except NotJson:
                    partial = None
                if partial is not None and partial.name is not None:
                    calls.append(ScannedCall(partial.name, partial.arguments))
                break
            found = self.cached(("call", start, end), lambda: complete_call(body, _KEYS))
            if found is not None:
                calls.append(ScannedCall(found[0], found[1], complete=True))
            elif end >= 0 or not truncated:  # not a call after all: it was text
                content.append(text[start : end + len(CLOSE)] if end >= 0 else text[start:])
            if end < 0:
                break
            pos = end + len(CLOSE)
        return Scan("".join(content), calls)

    @classmethod
    def grammar(cls, tools: Sequence[Tool], parallel: bool, literal: Literal) -> str:
        schema = json_rule(call_schema(tools, "arguments"))
        return (repeated("call", parallel)
                + f'call: {literal(OPEN)} "\\n" {schema} "\\n" {literal(CLOSE)}\n')  # fmt: skip
