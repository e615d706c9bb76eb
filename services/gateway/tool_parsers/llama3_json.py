"""``llama3_json``: Llama 3.1-3.3's JSON calls. The whole reply is ``{"name": ...,
"parameters": {...}}`` (``<|python_tag|>`` before it is dropped; several calls are separated by
``;``, as vLLM reads them). A reply that does not open like a call is all content.

Streamed, the reply is held while it may still open like a call; then each call's name leaves
once written and its parameters as they are generated.
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
)
from services.gateway.tool_parsers.json_scan import (
    NotJson,
    complete_call,
    scan_call_object,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"
_KEYS = ("parameters", "arguments")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool, truncated: bool) -> Scan:
        head = text.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip()
        elif not final and (not head or PYTHON_TAG.startswith(head)):
            return Scan("", [])  # not yet known whether the reply opens like a call
        if not head.startswith("{"):
            return Scan(text if head or final else "", [])
        calls: list[ScannedCall] = []
        i = 0
        try:
            while True:
                i = skip_ws(head, i)
                if i >= len(head):
                    break
                partial = scan_call_object(head, i, _KEYS, self.memo)
                if partial.end is None:
                    if not final and partial.name is not None:
                        calls.append(ScannedCall(partial.name, partial.arguments))
                    elif final and not truncated:
                        return Scan(text, [])  # an unfinished object: it was text
                    break
                end = partial.end
                found = self.cached(("call", i, end), lambda: complete_call(head[i:end], _KEYS))
                if found is None:
                    raise NotJson("not a call")
                calls.append(ScannedCall(found[0], found[1], complete=True))
                i = skip_ws(head, partial.end)
                if i < len(head) and head[i] == ";":
                    i += 1
                elif i < len(head):
                    raise NotJson("text after a call")
        except NotJson:
            if final and not truncated:
                return Scan(text, [])
        return Scan("", calls)

    @classmethod
    def grammar(cls, tools: Sequence[Tool], parallel: bool, literal: Literal) -> str:
        # One call: the Llama 3.1-3.3 models were trained to call one function per reply.
        return f"calls: {json_rule(call_schema(tools, 'parameters'))}\n"
