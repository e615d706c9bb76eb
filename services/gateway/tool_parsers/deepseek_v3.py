"""``deepseek_v3``: DeepSeek-V3's calls, as its chat template writes them back::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(the bars are U+FF5C, the low blocks U+2581; the markers are tokens of DeepSeek's tokenizer).
Text before ``<｜tool▁calls▁begin｜>`` is content. Streamed, a call's name leaves once its line
is written and its arguments as they are generated.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from services.gateway.tool_parsers.base import (
    Literal,
    Scan,
    ScannedCall,
    Tool,
    ToolParser,
    json_rule,
    partial_marker,
)
from services.gateway.tool_parsers.json_scan import Memo, NotJson, skip_ws, value_end

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"

    def scan(self, text: str, final: bool, truncated: bool) -> Scan:
        start = text.find(CALLS_BEGIN)
        if start < 0:
            keep = 0 if final else partial_marker(text, CALLS_BEGIN)
            return Scan(text[: len(text) - keep], [])
        calls: list[ScannedCall] = []
        pos = start + len(CALLS_BEGIN)
        try:
            while True:
                pos = skip_ws(text, pos)
                if text.startswith(CALLS_END, pos) or pos >= len(text):
                    break
                if not text.startswith(CALL_BEGIN, pos):
                    if CALL_BEGIN.startswith(text[pos:]) and not final:
                        break
                    raise NotJson("a call opens with its marker")
                call, pos = _call(text, pos + len(CALL_BEGIN), self.memo)
                if call is not None:
                    calls.append(call)
                if call is None or not call.complete:
                    if final and not truncated:
                        raise NotJson("an unfinished call")
                    if final:
                        calls = [c for c in calls if c.complete]
                    break
        except NotJson:
            if final and not truncated:
                return Scan(text, [])
        return Scan(text[:start], calls)

    @classmethod
    def grammar(cls, tools: Sequence[Tool], parallel: bool, literal: Literal) -> str:
        names = " | ".join(f"call_{i}" for i in range(len(tools)))
        many = 'call ("\\n" call)*' if parallel else "call"
        rules = [f"calls: {literal(CALLS_BEGIN)} {many} {literal(CALLS_END)}",
                 f"call: {literal(CALL_BEGIN)} ({names}) {literal(CALL_END)}"]  # fmt: skip
        for i, tool in enumerate(tools):
            rules.append(f'call_{i}: "function" {literal(SEP)} {json.dumps(tool.name)} '
                         f"{json.dumps(FENCE_OPEN)} {json_rule(tool.parameters)} "
                         f"{json.dumps(FENCE_CLOSE)}")  # fmt: skip
        return "\n".join(rules) + "\n"


def _call(text: str, pos: int, memo: Memo) -> tuple[ScannedCall | None, int]:
    """The call whose ``TYPE<｜tool▁sep｜>NAME`` starts at ``pos``, and where it ends."""
    sep = text.find(SEP, pos)
    if sep < 0:
        return None, len(text)
    line = text.find("\n", sep)
    if line < 0:
        return None, len(text)
    name = text[sep + len(SEP) : line].strip()
    if not name:
        raise NotJson("a call names its function")
    if not text.startswith(FENCE_OPEN, line):
        if FENCE_OPEN.startswith(text[line:]):
            return ScannedCall(name, None), len(text)
        raise NotJson("the arguments are a json block")
    args_start = line + len(FENCE_OPEN)
    end = value_end(text, args_start, memo) if args_start < len(text) else None
    if end is None:
        streaming = args_start < len(text) and text[args_start] == "{"
        return ScannedCall(name, text[args_start:] if streaming else None), len(text)
    arguments = text[args_start:end]
    if ("json", args_start, end) not in memo:
        try:
            json.loads(arguments)
        except ValueError as err:
            raise NotJson("arguments are JSON") from err
        memo["json", args_start, end] = True
    close = skip_ws(text, end)
    if not text.startswith("```", close):
        if close >= len(text) or "```".startswith(text[close:]):
            return ScannedCall(name, arguments), len(text)
        raise NotJson("the json block closes")
    close = skip_ws(text, close + 3)
    if not text.startswith(CALL_END, close):
        if CALL_END.startswith(text[close:]):
            return ScannedCall(name, arguments), len(text)
        raise NotJson("the call closes with its marker")
    return ScannedCall(name, arguments, complete=True), close + len(CALL_END)
