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
    repeated,
    scan_tagged,
)
from services.gateway.tool_parsers.json_scan import NotJson, complete_call, scan_call_object

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_KEYS = ("arguments", "parameters")


class HermesParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool, truncated: bool) -> Scan:
        def partial(body_start: int, body: str) -> ScannedCall | None:
            try:
                found = scan_call_object(text, body_start, _KEYS, self.memo)
            except NotJson:
                return None
            return ScannedCall(found.name, found.arguments) if found.name is not None else None

        def whole(start: int, end: int, body: str) -> ScannedCall | None:
            found = self.cached(("call", start, end), lambda: complete_call(body, _KEYS))
            return None if found is None else ScannedCall(found[0], found[1], complete=True)

        return scan_tagged(text, final, truncated, OPEN, CLOSE, partial, whole)

    @classmethod
    def grammar(cls, tools: Sequence[Tool], parallel: bool, literal: Literal) -> str:
        schema = json_rule(call_schema(tools, "arguments"))
        return (repeated("call", parallel)
                + f'call: {literal(OPEN)} "\\n" {schema} "\\n" {literal(CLOSE)}\n')  # fmt: skip
